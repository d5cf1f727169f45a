"""`speculators-compat verify` (pipeline/output/verify.py): damage named, unfinished runs said INCOMPLETE."""

import pytest

from speculators_compat.pipeline.output.outdir import OutputDir
from tests.pipeline.helpers import five_files


@pytest.mark.parametrize("checksum", ["crc32", "sha256"])
def test_verify_finds_every_kind_of_damage(tmp_path, checksum, capsys):
    """`speculators-compat verify`: a clean output passes; a flipped byte (same size), a truncated
    file, a deleted file and an unlisted data file are each named, and the exit code is 1."""
    torch = pytest.importorskip("torch")
    from speculators_compat.cli import main
    from speculators_compat.pipeline.writers import threads as w

    out = OutputDir(tmp_path, "pt", checksum)
    out.prepare({"m": 1})
    bw = w.BackgroundWriter(out, queue_size=1, threads=2)
    bw.put(
        [
            (i, {"input_ids": torch.arange(6), "hidden_states": [torch.randn(6, 16)], "loss_mask": torch.ones(6)})
            for i in range(5)
        ]
    )
    bw.close()
    # before the manifest (checksums.jsonl): intact, but the run has not finished
    assert main(["verify", str(tmp_path)]) == 3
    assert "INCOMPLETE" in capsys.readouterr().out
    out.finalize(5, {})
    assert main(["verify", str(tmp_path)]) == 0
    assert "OK: 5 files checked against manifest.json" in capsys.readouterr().out
    b = bytearray((tmp_path / "data_1.pt").read_bytes())
    b[-100] ^= 0xFF
    (tmp_path / "data_1.pt").write_bytes(bytes(b))
    (tmp_path / "data_2.pt").write_bytes(b[:50])
    (tmp_path / "data_3.pt").unlink()
    (tmp_path / "data_9.pt").write_bytes(b"x")
    assert main(["verify", str(tmp_path)]) == 1
    text = capsys.readouterr().out
    assert f"data_1.pt: {checksum} differs" in text
    assert "data_2.pt: 50 bytes, listed as" in text
    assert "data_3.pt: missing" in text
    assert "data_9.pt: on disk but not listed" in text
    assert "data_0.pt" not in text and "data_4.pt" not in text
    assert main(["verify", str(tmp_path / "nope")]) == 2  # a clear error, not a traceback
    assert "no output directory" in capsys.readouterr().err


def test_verify_right_after_a_kill_says_incomplete_not_failed(tmp_path, capsys):
    """A run killed between a file's rename and its record leaves a whole file that checksums.jsonl
    does not list: that is a run that has not finished (the next one writes the file again), not
    damage. With a manifest, an unlisted file is still a problem."""
    from speculators_compat.cli import main

    five_files(tmp_path)
    lines = (tmp_path / "checksums.jsonl").read_text().splitlines()
    (tmp_path / "checksums.jsonl").write_text("\n".join(lines[:4]) + "\n")  # data_4.pt's record never came
    assert main(["verify", str(tmp_path)]) == 3
    text = capsys.readouterr().out
    assert "NOTE data_4.pt: on disk but not yet in checksums.jsonl" in text
    assert "INCOMPLETE: 4 of 8 samples have no file yet (indices 4-7)" in text and "BAD" not in text


def _checkpoint(d, weights: bytes):
    import json as _json
    import struct

    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}')
    head = _json.dumps(
        {"w": {"dtype": "F32", "shape": [len(weights) // 4], "data_offsets": [0, len(weights)]}}
    ).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + weights)
    return d


def test_verify_model_catches_states_of_another_models_weights(tmp_path, capsys):
    """``verify OUT --model M``: run.json's fingerprint of the model that made the states against
    M's files: the same model passes, one whose weights differ (same shapes) is an error naming it."""
    import json as _json

    from speculators_compat.checkpoint import fingerprint_checkpoint
    from speculators_compat.cli import main

    made = _checkpoint(tmp_path / "made", b"\x00" * 64)
    other = _checkpoint(tmp_path / "other", b"\x01" * 64)
    out = tmp_path / "out"
    out.mkdir()
    run = {"format": "pt", "fingerprints": {"model": fingerprint_checkpoint(str(made))}}
    (out / "run.json").write_text(_json.dumps(run))
    assert main(["verify", str(out), "--model", str(made)]) in (0, 3)  # (no files yet: incomplete, not bad)
    assert main(["verify", str(out), "--model", str(other)]) == 1
    text = capsys.readouterr().out
    assert f"BAD  these states were not made by the model at {other}: weight file model.safetensors" in text
