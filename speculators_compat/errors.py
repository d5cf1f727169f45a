"""Every exception speculators-compat raises for its users to catch (also exported by the package).

ValueErrors name bad input (a token id, a sample, a checkpoint, a setting); RuntimeErrors name a
run that could not go on (a capture check that failed, a dead worker, an output that cannot be
written). Messages name the sample, file or setting concerned.
"""

from __future__ import annotations


class CaptureError(RuntimeError):
    """Captured hidden states failed a correctness check (coverage, NaN/Inf, shape)."""


class StallError(RuntimeError):
    """The engine stopped making progress with requests still pending."""


class WorkerDiedError(RuntimeError):
    """A vLLM worker process died; the engine cannot continue (files already written are intact)."""


class HostLostError(RuntimeError):
    """Another host of an engine over several hosts is gone (engine/liveness.py)."""


class ArenaSpaceError(RuntimeError):
    """The hand-off arena could not be allocated (/dev/shm too small?)."""


class TokenIdError(ValueError):
    """A sequence holds a token id the model cannot embed (negative, or at or above its vocabulary
    size). ``seq`` is its index in the batch, ``token`` the id, ``vocab`` the vocabulary size.

    Checked before anything reaches vLLM: we hand it token ids directly, past the input processor
    that checks them for ``LLM.generate``. Unchecked, such an id is an IndexError in a CPU worker, a
    device-side assert that kills the engine on CUDA, and under tensor parallelism (where each rank
    masks the ids outside its shard of the table) a row of zeros: silently wrong states."""

    def __init__(self, seq: int, token: int, vocab: int | None):
        self.seq, self.token, self.vocab = seq, token, vocab
        super().__init__(self.message(f"sequence {seq}"))

    def message(self, where: str) -> str:
        """The error, with ``where`` naming the sequence (the pipeline names its sample)."""
        if self.token < 0:
            return f"{where} holds a negative token id {self.token}"
        return (
            f"{where} holds token id {self.token}, outside the model's vocabulary of {self.vocab} ids "
            f"[0, {self.vocab - 1}] (tokenized for another model?)"
        )


class CheckpointError(ValueError):
    """The model checkpoint cannot be loaded; the message names the file and what is wrong."""


class DatasetError(ValueError):
    """A malformed input sample or input file; the message names the file and line / row."""


class OutputError(RuntimeError):
    """The output directory cannot be used or written (another run's, locked, unwritable, full)."""


class WriterProcessDied(OutputError):
    """A writer process of the pipeline died; the files already written are complete."""


class ShardFailedError(RuntimeError):
    """One engine of a data-parallel or Ray run failed or died; the others were stopped. Every file
    written is complete, and a rerun of the same command resumes. ``rank`` is the failed part."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


__all__ = [
    "CaptureError",
    "StallError",
    "WorkerDiedError",
    "ArenaSpaceError",
    "TokenIdError",
    "CheckpointError",
    "DatasetError",
    "OutputError",
    "WriterProcessDied",
    "ShardFailedError",
]
