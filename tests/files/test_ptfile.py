"""The direct data_{i}.pt encoder (speculators_compat.files.ptfile): its files must be the
bytes torch.save writes, in every torch the matrix installs (each engine cell runs this file with
its own torch: 2.8 ... 2.13), and anything it cannot reproduce must go to torch.save."""

import io
import logging
import os
import random

import pytest

torch = pytest.importorskip("torch")

from speculators_compat.files import formats as writer  # noqa: E402
from speculators_compat.files import ptfile  # noqa: E402
from speculators_compat.files.checksums import file_digest  # noqa: E402


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _joined(parts) -> bytes:
    return b"".join(bytes(p) for p in parts)


def _sample(rows, hidden, layers, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 32000, (rows,), generator=g),
        "hidden_states": [torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(layers)],
        "loss_mask": torch.randint(0, 2, (rows,), generator=g),
    }


@pytest.fixture(autouse=True)
def _direct(monkeypatch):
    monkeypatch.delenv(ptfile.MODE_ENV, raising=False)


def test_the_encoder_matches_this_torch():
    """Built and self-checked against this torch's torch.save; None here would mean every file of
    this cell goes through torch.save (slower, and this test says so)."""
    assert ptfile.encoder() is not None, ptfile._build()[1]


def test_random_samples_are_byte_identical_to_torch_save():
    """200 samples of random lengths, widths, layer counts (1..16, so storage keys pass 10) and
    dtypes, some with a layer listed twice: every local header's padding to 64 bytes is met."""
    rng = random.Random(0)
    for i in range(200):
        s = _sample(
            rng.randint(1, 300),
            rng.choice([1, 3, 64, 128, 7168 // 56]),
            rng.randint(1, 16),
            rng.choice([torch.bfloat16, torch.float16, torch.float32]),
            seed=i,
        )
        if len(s["hidden_states"]) > 2 and rng.random() < 0.3:  # upstream's default ids on 6 layers: [2, 3, 3, 5]
            s["hidden_states"][2] = s["hidden_states"][1]
        parts = ptfile.encode(s)
        assert parts is not None, i
        assert _joined(parts) == _saved(s), f"sample {i} differs from torch.save"


def test_views_share_storage_as_torch_save_does():
    """A slice saves its whole storage with an offset, a transpose its strides, two views of one
    storage one copy of it: as torch.save does."""
    x = torch.randn(10, 4)
    ids = torch.arange(20)
    s = {
        "input_ids": ids[2:7],
        "hidden_states": [x[1:6], x.t()[:, :5].t().contiguous(), x[3:8]],
        "loss_mask": ids[10:15],
    }
    parts = ptfile.encode(s)
    assert parts is not None and _joined(parts) == _saved(s)
    back = torch.load(io.BytesIO(_joined(parts)), weights_only=True)
    assert torch.equal(back["hidden_states"][2], x[3:8]) and torch.equal(back["input_ids"], ids[2:7])


def test_a_big_sample_is_written_without_copying_its_states(tmp_path):
    """The states go to the file as views of their own memory (no serialised copy): a 32 MiB
    sample's buffers hold under 1 MiB of their own bytes."""
    s = _sample(4096, 2048, 2)
    parts = ptfile.encode(s)
    own = sum(len(p) for p in parts if isinstance(p, bytes))
    assert own < 1 << 20
    digest, n = writer.write_sample(tmp_path / "data_0.pt", s, "pt", "crc32")
    ref = _saved(s)
    assert (tmp_path / "data_0.pt").read_bytes() == ref and n == len(ref)


@pytest.mark.parametrize("case", ["requires_grad", "non_tensor_value", "nested_dict", "int_key", "empty"])
def test_what_it_cannot_reproduce_goes_to_torch_save(tmp_path, case):
    s = _sample(5, 8, 2)
    if case == "requires_grad":
        s["hidden_states"][0] = s["hidden_states"][0].float().requires_grad_()
    elif case == "non_tensor_value":
        s["extra"] = (1, 2)
    elif case == "empty":  # (the pipeline refuses empty sequences before any engine runs)
        s = {"input_ids": torch.arange(0), "hidden_states": [torch.zeros(0, 8)], "loss_mask": torch.ones(0)}
    elif case == "nested_dict":
        s["extra"] = {"a": torch.ones(2)}
    else:
        s[3] = torch.ones(2)
    assert ptfile.encode(s) is None
    writer.write_sample(tmp_path / "data_0.pt", s, "pt")
    assert (tmp_path / "data_0.pt").read_bytes() == _saved(s)


def test_a_torch_whose_archive_differs_falls_back_loudly(monkeypatch, caplog, tmp_path):
    """If this torch's torch.save wrote anything else than the encoder (here: the encoder is made
    to pad to 32 bytes, as a future torch might), the self-check finds it, says why once, and every
    file is then torch.save's."""
    monkeypatch.setattr(ptfile, "ALIGN", 32)
    monkeypatch.setattr(ptfile, "_ENCODER", [])
    with caplog.at_level(logging.WARNING, logger="speculators_compat.pipeline"):
        assert ptfile.encoder() is None
        s = _sample(33, 16, 2)
        assert ptfile.encode(s) is None
        writer.write_sample(tmp_path / "data_0.pt", s, "pt")
    assert (tmp_path / "data_0.pt").read_bytes() == _saved(s)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "differs from torch" in msgs[0] and "torch.save" in msgs[0]


def test_the_env_var_chooses_torch_save(monkeypatch, mocker, tmp_path):
    s = _sample(9, 8, 2)
    monkeypatch.setenv(ptfile.MODE_ENV, "torch")
    spy = mocker.spy(torch, "save")  # which path wrote it: the bytes are the same either way
    writer.write_sample(tmp_path / "data_0.pt", s, "pt")
    assert spy.call_count == 1
    monkeypatch.setenv(ptfile.MODE_ENV, "direct")
    writer.write_sample(tmp_path / "data_1.pt", s, "pt")
    assert spy.call_count == 1
    assert (tmp_path / "data_0.pt").read_bytes() == (tmp_path / "data_1.pt").read_bytes() == _saved(s)
    monkeypatch.setenv(ptfile.MODE_ENV, "fast")
    with pytest.raises(ValueError, match="SPECULATORS_COMPAT_PT_WRITER must be one of direct, torch, not 'fast'"):
        writer.write_sample(tmp_path / "data_2.pt", s, "pt")


def test_short_writes_and_many_buffers_still_give_the_whole_file(tmp_path, monkeypatch):
    """os.writev may write less than asked (and takes at most IOV_MAX buffers): write_parts goes on
    where it stopped. Here each call writes at most 1,000 bytes, over 1,500 buffers."""
    real = os.writev

    def short(fd, bufs):
        return real(fd, [memoryview(b"".join(bytes(b) for b in bufs))[:1000]])

    monkeypatch.setattr(writer.os, "writev", short)
    parts = [os.urandom(random.Random(i).randint(0, 700)) for i in range(1500)]
    n = writer.write_parts(tmp_path / "f.bin", parts)
    assert n == sum(map(len, parts)) and (tmp_path / "f.bin").read_bytes() == b"".join(parts)


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    def full(fd, bufs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer.os, "writev", full)
    with pytest.raises(OSError, match="No space left"):
        writer.write_sample(tmp_path / "data_0.pt", _sample(64, 32, 3), "pt")
    assert not list(tmp_path.iterdir())  # neither the file nor its temp


def test_one_memory_given_as_two_tensors_is_saved_as_the_torch_save_path_saves_it(tmp_path, monkeypatch):
    """The process writer maps a layer listed twice as two tensor objects over the same rows; the
    torch.save path saves one alias for both, so the file equals the thread writer's (one object
    listed twice). The direct encoder must give those bytes too, not torch.save's two storages."""
    import numpy as np

    raw = np.frombuffer(bytearray(torch.randn(6, 8).numpy().tobytes()), dtype=np.float32)
    a, b = torch.from_numpy(raw).view(6, 8), torch.from_numpy(raw).view(6, 8)
    s = {"input_ids": torch.arange(6), "hidden_states": [a, b, a], "loss_mask": torch.ones(6, dtype=torch.long)}
    one = {**s, "hidden_states": [a, a, a]}
    writer.write_sample(tmp_path / "data_0.pt", s, "pt")
    monkeypatch.setenv(ptfile.MODE_ENV, "torch")
    writer.write_sample(tmp_path / "data_1.pt", s, "pt")
    got = (tmp_path / "data_0.pt").read_bytes()
    assert got == (tmp_path / "data_1.pt").read_bytes() == _saved(one) != _saved(s)


def test_an_unreadable_serialization_id_falls_back_once_and_says_so(monkeypatch, caplog, tmp_path):
    """The id's first half is read from a torch.save probe per tensor count. If that probe's id is
    not the 40 digits expected, files of that count go to torch.save, one warning says so, and
    the probe is not repeated for every file."""
    enc = ptfile.encoder()
    assert enc is not None
    monkeypatch.setattr(enc, "_name_hash", {})
    probes = []
    monkeypatch.setattr(ptfile, "_records", lambda data: probes.append(1) or {".data/serialization_id": b"x"})
    s = _sample(4, 8, 3)
    with caplog.at_level(logging.WARNING, logger="speculators_compat.pipeline"):
        for i in range(3):
            assert ptfile.encode(s) is None
            writer.write_sample(tmp_path / f"data_{i}.pt", s, "pt")
            assert (tmp_path / f"data_{i}.pt").read_bytes() == _saved(s)
    assert len(probes) == 1
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "with 5 tensors are written by torch.save" in msgs[0]


@pytest.mark.parametrize("rows,hidden", [(3, 8), (128, 128), (300, 1024)])
def test_the_files_crc32_is_zlibs_over_its_bytes(tmp_path, rows, hidden):
    """The checksum the pipeline records for a direct-built file (made from the zip records' own
    CRCs, crc.of_parts) is zlib's CRC-32 of the file as written, small states and big."""
    import zlib

    s = _sample(rows, hidden, 4, seed=rows)
    s["hidden_states"][2] = s["hidden_states"][1]  # a repeated layer: one record, listed twice
    digest, n = writer.write_sample(tmp_path / "data_0.pt", s, "pt", "crc32")
    data = (tmp_path / "data_0.pt").read_bytes()
    assert data == _saved(s) and n == len(data)
    assert digest == f"{zlib.crc32(data):08x}"
    assert file_digest(tmp_path / "data_0.pt", "crc32") == digest
