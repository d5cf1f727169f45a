"""The connector's file writer (connector/worker.py ``_write``) on a real filesystem that fills up:
the write fails with the disk's own error in the log, naming the request, and leaves no file, no
temporary and no ``.lock`` (a client waiting on the lock finds no file); with room, the file lands
whole and its lock is let go, not removed (the client takes and removes it)."""

from __future__ import annotations

import logging
import os

import pytest

torch = pytest.importorskip("torch")

from speculators_compat.connector.records import FinishedCapture  # noqa: E402
from speculators_compat.connector.worker import _write  # noqa: E402
from speculators_compat.files import locks  # noqa: E402


def write(folder, rid, tokens, hidden):
    path = str(folder / f"{rid}.safetensors")
    lock = locks.hold(path)
    states = [torch.randn(tokens, hidden) for _ in range(2)]
    _write(FinishedCapture(rid, path, list(range(tokens))), states, False, lock)
    return path


def test_a_full_disk_leaves_no_file_and_no_lock(small_disk, caplog):
    disk = small_disk("1m")
    with caplog.at_level(logging.ERROR, logger="speculators_compat.connector"):
        path = write(disk, "big-1", 2048, 128)  # 2 MiB of states on a 1 MiB disk
    assert os.listdir(disk) == []
    assert "request big-1" in caplog.text and "No space left on device" in caplog.text
    path = write(disk, "small-1", 16, 128)
    assert sorted(os.listdir(disk)) == ["small-1.safetensors", "small-1.safetensors.lock"]
    assert not locks.is_held(path + ".lock")
    from safetensors.torch import load_file

    f = load_file(path)
    assert f["hidden_states"].shape == (16, 2, 128) and f["token_ids"].tolist() == list(range(16))


def test_rows_that_do_not_match_the_tokens_or_are_not_finite_are_not_written(tmp_path, caplog):
    path = str(tmp_path / "r.safetensors")
    bad = [torch.randn(4, 8), torch.randn(4, 8)]
    bad[1][2, 3] = float("nan")
    with caplog.at_level(logging.ERROR, logger="speculators_compat.connector"):
        _write(FinishedCapture("r", path, [1, 2, 3, 4]), bad, False, locks.hold(path))
        _write(FinishedCapture("s", path, [1, 2, 3]), [torch.randn(4, 8)], False, locks.hold(path))
    assert os.listdir(tmp_path) == []
    assert "NaN/Inf" in caplog.text and "4 rows captured for 3 token ids" in caplog.text
