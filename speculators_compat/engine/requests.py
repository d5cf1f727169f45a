"""vLLM ``Request`` objects for a hand-built engine loop, on every vLLM 0.11 -> 0.34: built from
the parameters the installed ``Request.__init__`` takes (``eos_token_id`` went in 0.17,
``mm_features`` came), and the block hasher a prefix-caching scheduler needs (the same one vLLM
gives its own requests). The ``vllm_request`` patch uses the same helpers to keep other hand-built
loops, upstream's among them, alive.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import Any

logger = logging.getLogger("speculators_compat")


_params_cache: dict[Any, frozenset] = {}


def request_params(Request) -> frozenset:
    # keyed by the __init__ object itself, so applying or reverting a patch is seen at once
    init = getattr(Request.__init__, "__wrapped__", Request.__init__)
    params = _params_cache.get(init)
    if params is None:
        params = _params_cache[init] = frozenset(inspect.signature(init).parameters)
    return params


def build_request(
    request_id: str, prompt: list[int], sampling_params, *, block_hasher=None, eos_token_id: int | None = None
):
    """A ``vllm.v1.request.Request`` for any vLLM 0.11 -> 0.34 (signature-aware, no patch needed)."""
    from vllm.v1.request import Request

    params = request_params(Request)
    kw: dict[str, Any] = dict(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=sampling_params,
        pooling_params=None,
        arrival_time=0.0,
    )
    if "eos_token_id" in params:
        kw["eos_token_id"] = eos_token_id
    elif eos_token_id is not None:
        set_eos(sampling_params, eos_token_id)
    if block_hasher is not None:
        kw["block_hasher"] = block_hasher
    if "mm_features" in params:
        kw["mm_features"] = None
    return Request(**kw)


def set_eos(sampling_params, eos: int) -> None:
    if sampling_params is None or getattr(sampling_params, "ignore_eos", False):
        return
    upd = getattr(sampling_params, "update_from_generation_config", None)
    if upd is not None and "eos_token_id" in inspect.signature(upd).parameters:
        upd({}, eos_token_id=eos)


#: schedulers that cache prefixes (recorded by the vllm_request patch), and the (hash block size, hash algorithm, look-ahead tokens) each needs.
caching_schedulers: weakref.WeakKeyDictionary[Any, tuple[int, str, int]] = weakref.WeakKeyDictionary()


_hasher_cache: dict[tuple[int, str, int], Any] = {}


def _hasher_for(block_size: int, algo: str, lookahead: int = 0):
    key = (block_size, algo, lookahead)
    if key not in _hasher_cache:
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        try:
            from vllm.utils.hashing import get_hash_fn_by_name  # 0.12+
        except ImportError:
            from vllm.utils import get_hash_fn_by_name  # 0.11
        fn = get_hash_fn_by_name(algo)
        init_none_hash(fn)
        # 0.33+: hashes may also cover look-ahead tokens (speculative decoding); pass them only when
        # set, so older signatures (two parameters) are called as before
        args = (block_size, fn, lookahead) if lookahead else (block_size, fn)
        _hasher_cache[key] = get_request_block_hasher(*args)
    return _hasher_cache[key]


def active_block_hasher():
    """The block hasher the most recently built prefix-caching scheduler needs, or None."""
    items = list(caching_schedulers.values())
    if not items:
        return None
    if len(set(items)) > 1:
        logger.warning(
            "speculators_compat: several prefix-caching schedulers with different block "
            "sizes are alive; supplying the newest one's block hasher"
        )
    return _hasher_for(*items[-1])
