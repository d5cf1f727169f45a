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
    from speculators_compat.files.registry import data_file_index, file_name

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


@pytest.mark.parametrize("fmt", ["pt", "safetensors", "speculators-hs"])
@pytest.mark.parametrize("fp8", [False, True])
def test_each_built_in_format_reads_back_what_it_wrote(tmp_path, fmt, fp8):
    """A format's reader (what verify looks at) gives back the sample its writer was handed: the
    ids, every layer in order, bit for bit, and the FP8 scales where there are some."""
    torch = pytest.importorskip("torch")
    from speculators_compat.engine.fp8 import SCALES_KEY
    from speculators_compat.files.formats import write_sample
    from speculators_compat.files.registry import file_name, get_format

    g = torch.Generator().manual_seed(3)
    sample = {
        "input_ids": torch.arange(9),
        "loss_mask": torch.ones(9, dtype=torch.long),
        "hidden_states": [torch.randn(9, 16, generator=g).bfloat16() for _ in range(3)],
    }
    if fp8:
        sample["hidden_states"] = [h.float().to(torch.float8_e4m3fn) for h in sample["hidden_states"]]
        sample[SCALES_KEY] = torch.rand(9, 1, generator=g) + 0.5
        sample["dequantize_dtype"] = "bfloat16"
    path = tmp_path / file_name(0, fmt)
    write_sample(path, sample, fmt)
    back = get_format(fmt).read(path)
    assert back["input_ids"].tolist() == list(range(9))
    assert len(back["hidden_states"]) == 3
    for a, b in zip(back["hidden_states"], sample["hidden_states"]):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert (SCALES_KEY in back) == fp8
    if fp8:
        assert torch.equal(back[SCALES_KEY].reshape(-1), sample[SCALES_KEY].reshape(-1))


def test_a_registered_format_is_a_choice_and_its_files_are_known(monkeypatch):
    from speculators_compat.cli import build_parser
    from speculators_compat.files import registry

    monkeypatch.setattr(registry, "FORMATS", dict(registry.FORMATS))  # (the module's own, restored after)
    registry.register(registry.Format("toy", "toy", "bin", bytes, dict))
    assert registry.data_file_index("toy_5.bin") == 5 and registry.file_name(5, "toy") == "toy_5.bin"
    for cmd in (["extract", "--input", "i", "--output", "o"], ["plan"]):
        args, _ = build_parser().parse_known_args([*cmd, "--model", "m", "--format", "toy"])
        assert args.format == "toy"
    with pytest.raises(ValueError, match="would be named as pt's"):
        registry.register(registry.Format("pt2", "data", "pt", bytes, dict))
    with pytest.raises(ValueError, match="unknown format 'npy': one of pt, safetensors, speculators-hs, toy"):
        registry.get_format("npy")
