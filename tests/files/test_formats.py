"""Data files (files/formats.py): names by format, and the same bytes however written."""

import pytest


@pytest.mark.parametrize("rows", [128, 1500])  # under and over SMALL_SAMPLE_BYTES (hidden 256, 2 layers)
def test_in_memory_and_streamed_writes_give_the_same_file(tmp_path, monkeypatch, rows):
    """With torch.save, small samples are serialised in memory and written once; big ones stream
    through the hash. Both, and the direct encoder, must write the same bytes (a resumed run stays byte-identical across the threshold) and
    report that file's checksum and size."""
    import hashlib

    torch = pytest.importorskip("torch")
    from speculators_compat.files import formats as writer

    g = torch.Generator().manual_seed(rows)
    sample = {
        "input_ids": torch.arange(rows),
        "loss_mask": torch.ones(rows, dtype=torch.long),
        "hidden_states": [torch.randn(rows, 256, generator=g).bfloat16() for _ in range(2)],
    }
    got = {}
    for name, limit, pt_writer in [("memory", 1 << 40, "torch"), ("stream", 0, "torch"), ("direct", 0, "direct")]:
        monkeypatch.setattr(writer, "SMALL_SAMPLE_BYTES", limit)
        monkeypatch.setenv("SPECULATORS_COMPAT_PT_WRITER", pt_writer)
        p = tmp_path / f"data_{name}.pt"
        digest, n = writer.write_sample(p, sample, "pt", "sha256")
        data = p.read_bytes()
        assert (digest, n) == (hashlib.sha256(data).hexdigest(), len(data))
        assert not list(tmp_path.glob(".*partial"))
        got[name] = data
    assert got["memory"] == got["stream"] == got["direct"]
    back = torch.load(tmp_path / "data_memory.pt", weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(back["hidden_states"], sample["hidden_states"]))


def test_file_names_of_each_format():
    from speculators_compat.files.formats import data_file_index, file_name

    assert [file_name(7, f) for f in ("pt", "safetensors", "speculators-hs")] == [
        "data_7.pt",
        "data_7.safetensors",
        "hs_7.safetensors",
    ]
    assert data_file_index("hs_12.safetensors") == 12 and data_file_index("data_3.pt") == 3
    assert data_file_index("hs_12.safetensors", "speculators-hs") == 12
    assert data_file_index("hs_12.safetensors", "safetensors") is None  # (another format's file)
    assert data_file_index("data_3.pt", "speculators-hs") is None
    for other in ("hs_1.pt", ".hs_1.safetensors.partial", "hs_x.safetensors", "sample_lengths.json"):
        assert data_file_index(other) is None, other
