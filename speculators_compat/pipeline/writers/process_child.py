"""A writer process's side (processes.py is the driver's): it maps the engine's arena files and
writes each sample a task names; the task records that cross its pipe."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ...engine.fp8 import SCALES_KEY
from ...files.formats import write_sample
from ...files.registry import file_name
from ...files.stages import StageTimes

_FRAME = 8  # bytes of the little-endian length that precedes each pickled task


def _read_exact(fd: int, n: int) -> bytes | None:
    """``n`` bytes from ``fd`` (blocking), or None at end of file (the driver closed its end)."""
    parts, got = [], 0
    while got < n:
        b = os.read(fd, min(n - got, 1 << 20))
        if not b:
            return None
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def _writer_process_main(task_conn, result_conn) -> None:
    """A writer process: maps the engine's arena files and writes each sample it is sent.

    A task names where each layer's rows lie ((file, byte offset, rows) in /dev/shm); the rows
    are read in place, so they cross no pipe. The driver keeps them lent (the engine does not
    reuse that memory) until this process reports the file written. It exits when the driver
    sends None or closes its end of the task pipe (it died).
    """
    import gc
    import mmap
    import pickle
    import select

    import torch

    torch.set_num_threads(1)
    parent = os.getppid()
    fd = task_conn.fileno()
    maps: dict[str, mmap.mmap] = {}
    times = StageTimes()  # (sent with each result, then reset)
    while True:
        if not select.select([fd], [], [], 2)[0]:
            # (a process forked from the driver, e.g. an engine worker, may hold the pipe's
            # other end too, so end-of-file alone does not prove the driver is gone)
            if os.getppid() != parent:
                return
            continue
        head = _read_exact(fd, _FRAME)
        body = _read_exact(fd, int.from_bytes(head, "little")) if head is not None else None
        if body is None:
            return
        task = pickle.loads(body)
        if task is None:
            return
        if task == "ping":  # _WriterPool.wait_ready: torch is imported, tasks are read
            result_conn.send(("pong", [], StageTimes()))
            continue
        done = []
        for t in task.samples:
            sample = None
            try:
                sample = _task_sample(t, maps)
                path = Path(task.root) / file_name(t.index, task.fmt)
                digest, nbytes = write_sample(path, sample, task.fmt, task.checksum, durable=True, times=times)
                done.append(FileWritten(t.index, digest, nbytes, int(t.input_ids.size), os.stat(path).st_mtime_ns))
            except BaseException as e:  # reported to the driver, which stops the run
                err = (t.index, f"{type(e).__name__}: {e}", getattr(e, "errno", None))
                result_conn.send(("error", done, times.take(), *err))
                done = None
                break
            finally:
                sample = None
        if done is not None:
            result_conn.send(("ok", done, times.take()))  # one message a task
        gc.collect(1)  # cycles made while writing (write_sample keeps the mapped rows out of torch.save's)
        for p in [p for p in maps if not os.path.exists(p)]:  # the engine released that arena file
            try:
                maps.pop(p).close()
            except BufferError:  # still referenced (cannot happen once the sample is dropped)
                pass


def _task_sample(t: SampleTask, maps: dict) -> dict:
    """The sample a task names, its rows read in place from the engine's arena files (mapped
    once into ``maps``)."""
    import mmap

    import numpy as np
    import torch

    def rows(path: str, off: int, n: int, width: int, dtype):
        mm = maps.get(path)
        if mm is None:
            with open(path, "r+b") as f:
                mm = maps[path] = mmap.mmap(f.fileno(), 0)
        buf = np.frombuffer(mm, dtype=np.uint8, count=n * width * dtype.itemsize, offset=off)
        return torch.from_numpy(buf).view(dtype).view(n, width)

    dtype = getattr(torch, t.dtype)
    sample = {
        "input_ids": torch.from_numpy(t.input_ids),
        "hidden_states": [rows(*b, t.hidden, dtype) for b in t.blocks],
        "loss_mask": torch.from_numpy(t.loss_mask),
    }
    if t.scales is not None:  # FP8 states: their per-token scales, float32 [T, 1]
        sample[SCALES_KEY] = rows(*t.scales, 1, torch.float32)
        sample["dequantize_dtype"] = t.dequantize_dtype
    return sample


@dataclass
class SampleTask:
    """One sample a writer process writes: its ids and mask, and where its rows lie (wire record)."""

    index: int
    input_ids: Any  # numpy int64 [tokens]
    loss_mask: Any  # numpy int64 [tokens]
    blocks: list[tuple[str, int, int]]  # per layer: (arena file, byte offset, rows)
    hidden: int
    dtype: str  # torch dtype name
    scales: tuple[str, int, int] | None = None  # FP8 states: where their float32 scales lie
    dequantize_dtype: str | None = None  # FP8 states: the model's dtype (a pt file dequantizes to it)


class FileWritten(NamedTuple):
    """A file a writer process wrote, synced and renamed into place (wire record of its results:
    the driver records it in checksums.jsonl as it stands, without reading the file again)."""

    index: int
    digest: str | None
    nbytes: int
    tokens: int
    mtime_ns: int


@dataclass
class WriteTask:
    """A process's share of one batch (wire record, pickled into its task pipe)."""

    root: str
    fmt: str
    checksum: str
    samples: list[SampleTask]
