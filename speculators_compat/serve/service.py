"""What one request becomes: its prompt (token ids, text, or chat messages rendered with the
tokenizer's chat template) checked, submitted to the engine's continuous loop (engine/stream.py),
and its states written where speculators' clients look for them.

The file: ``<hidden-states-path>/<request id>.safetensors`` in hs-connectors' layout
(``hidden_states`` [T, L, H], ``token_ids`` [T]; FP8 adds ``hidden_states_scales``), written to a
temporary name and renamed in while ``<file>.lock`` is held with an exclusive flock; the client
takes the lock once it is free and removes it (speculators' ``wait_for_lock``). A request whose
client went away before its file was written leaves neither file nor lock.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("speculators_compat.serve")


class RequestError(ValueError):
    """A request that cannot be served as sent (HTTP 400, the message names the problem)."""


@dataclass
class Served:
    """One request's outcome, for the response."""

    request_id: str
    path: str
    prompt: list[int]
    token: int


class Service:
    """The engine's continuous loop, the tokenizer and the output folder, behind the HTTP layer."""

    def __init__(self, generator, loop, out_dir: str, model_name: str):
        self.generator, self.loop = generator, loop
        self.out_dir = Path(out_dir)
        self.model_name = model_name
        self.max_len = generator.engine.max_model_len - 1
        self.vocab = generator.engine.vocab_size
        self.states_dtype = generator.engine.states_dtype

    # -- prompts ------------------------------------------------------------------------------------
    def prompt_ids(self, prompt: Any) -> list[int]:
        """A completion's ``prompt``: token ids (a list of ints, or one such list in a list) or text."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            if len(prompt) > 1:
                raise RequestError(f"{len(prompt)} prompts in one request: send one prompt a request")
            prompt = prompt[0]  # (the OpenAI API's batch form, one prompt)
        if isinstance(prompt, str):
            ids = self.generator.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        elif isinstance(prompt, list):
            ids = prompt
        else:
            raise RequestError("prompt must be token ids (a list of integers) or text, one prompt a request")
        return self.check(ids)

    def chat_ids(self, body: dict) -> list[int]:
        """A chat request's messages rendered as the model's chat template renders them."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError("messages must be a non-empty list of {role, content} objects")
        tok = self.generator.tokenizer
        if not getattr(tok, "chat_template", None):
            raise RequestError(f"the tokenizer of {self.model_name} has no chat template: send token ids instead")
        cont = bool(body.get("continue_final_message", False))
        gen_prompt = bool(body.get("add_generation_prompt", not cont))
        if cont and gen_prompt:
            raise RequestError("continue_final_message and add_generation_prompt cannot both be true")
        try:
            ids = tok.apply_chat_template(
                messages, add_generation_prompt=gen_prompt, continue_final_message=cont, tokenize=True
            )
        except Exception as e:  # the template's own complaint, passed on
            raise RequestError(f"the chat template could not render these messages: {e}") from e
        if hasattr(ids, "keys"):  # (transformers 5 returns a BatchEncoding)
            ids = ids["input_ids"]
        return self.check(list(ids))

    def check(self, ids: Any) -> list[int]:
        from ..errors import TokenIdError
        from ..generator import to_token_lists

        try:
            (ids,) = to_token_lists([ids], self.vocab)
        except TokenIdError as e:
            raise RequestError(e.message("the prompt")) from e
        except (TypeError, ValueError) as e:
            raise RequestError(str(e).replace("sequence 0", "the prompt")) from e
        if len(ids) > self.max_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; at most max_model_len - 1 = {self.max_len} fit on this server"
            )
        return ids

    # -- serving --------------------------------------------------------------------------------
    async def serve(self, ids: list[int], gone) -> Served:
        """Capture ``ids``, write the file; ``gone()`` (async): has the client disconnected?"""
        captured = await asyncio.wrap_future(self.loop.submit(ids))
        rid = f"sc-{uuid.uuid4().hex}"
        path = self.out_dir / f"{rid}.safetensors"
        if await gone():
            return Served(rid, "", ids, captured.token)  # nobody to read it: nothing written
        await asyncio.to_thread(self.write, path, ids, captured.states)
        if await gone():  # (went away while it was written)
            for p in (path, Path(f"{path}.lock")):
                p.unlink(missing_ok=True)
        return Served(rid, str(path), ids, captured.token)

    def write(self, path: Path, ids: list[int], states) -> None:
        from ..engine.fp8 import SCALES_KEY, Fp8States
        from ..files.formats import write_sample
        from ..generator import token_tensor

        sample = {"input_ids": token_tensor(ids)}
        if isinstance(states, Fp8States):
            sample.update({"hidden_states": states.layers, SCALES_KEY: states.scales})
        else:
            sample["hidden_states"] = states
        fd = os.open(f"{path}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # (the client flocks it, then removes it)
            write_sample(path, sample, "speculators-hs")
        finally:
            os.close(fd)

    def file(self, name: str) -> Path | None:
        """The finished hs file ``name`` names under the output folder (a bare file name: no path
        leaves the folder), or None."""
        if not name.endswith(".safetensors") or name != os.path.basename(name) or name.startswith("."):
            return None
        path = self.out_dir / name
        if not path.is_file():
            return None
        lock = Path(f"{path}.lock")
        if lock.exists():  # (written before its response; a writer still at it holds the lock)
            try:
                fd = os.open(lock, os.O_RDONLY)
            except FileNotFoundError:
                return path
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
            finally:
                os.close(fd)
        return path

    def delete(self, path: Path) -> None:
        for p in (path, Path(f"{path}.lock")):
            p.unlink(missing_ok=True)

    def text(self, token: int) -> str:
        try:
            return self.generator.tokenizer.decode([token])
        except Exception as e:  # a token the tokenizer cannot show: the ids still say it
            logger.debug("cannot decode token %d: %s", token, e)
            return ""
