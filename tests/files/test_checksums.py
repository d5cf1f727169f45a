"""Checksums (files/checksums.py): each file listed with the chosen one, kept across reruns."""

import json

import pytest

from speculators_compat.pipeline.output.outdir import OutputDir
from tests.pipeline.helpers import lent_samples


def _independent_digest(algo, data):
    import hashlib
    import zlib

    return hashlib.sha256(data).hexdigest() if algo == "sha256" else f"{zlib.crc32(data):08x}"


@pytest.mark.parametrize("kind", ["thread", "process"])
@pytest.mark.parametrize("checksum", ["sha256", "crc32", "none"])
def test_each_file_is_listed_with_the_chosen_checksum(tmp_path, kind, checksum, monkeypatch):
    """checksums.jsonl and manifest.json carry the chosen algorithm's digest of each file's bytes,
    keyed by its name, and no other; 'none' lists sizes only. Streamed and in-memory writes both."""

    from speculators_compat.files import formats as files
    from speculators_compat.pipeline.writers import processes as w
    from speculators_compat.pipeline.writers.threads import BackgroundWriter

    monkeypatch.setattr(files, "SMALL_SAMPLE_BYTES", 64 * 2 * 3 * 8)  # some samples stream, some do not
    arena, reader, items = lent_samples(tmp_path)
    out = OutputDir(tmp_path / "out", "pt", checksum)
    out.prepare({"m": 1})
    bw = (
        w.ProcessWriter(out, reader.describe, queue_size=1, processes=2)
        if kind == "process"
        else BackgroundWriter(out, queue_size=1, threads=2)
    )
    bw.put(items[:3])
    bw.put(items[3:])
    bw.close()
    recs = [json.loads(x) for x in (tmp_path / "out" / "checksums.jsonl").read_text().splitlines()]
    manifest = out.finalize(len(items), {})
    assert manifest["checksum"] == checksum
    for r in recs + manifest["files"]:
        data = (tmp_path / "out" / r["file"]).read_bytes()
        assert r["bytes"] == len(data)
        others = {"sha256", "crc32"} - {checksum}
        assert not others & set(r), r
        if checksum == "none":
            assert "none" not in r
        else:
            assert r[checksum] == _independent_digest(checksum, data)
    assert sorted(r["index"] for r in recs) == list(range(len(items)))


def test_manifest_rehashes_files_listed_with_another_checksum(tmp_path):
    """A resumed run with another --checksum: the manifest lists every file with the new algorithm
    (files of the earlier run are rehashed), never a mix."""
    torch = pytest.importorskip("torch")
    from speculators_compat.pipeline.writers import threads as w

    sample = {"input_ids": torch.arange(5), "hidden_states": [torch.randn(5, 8)], "loss_mask": torch.ones(5)}
    for checksum, idx in [("sha256", [0, 1]), ("crc32", [2])]:
        out = OutputDir(tmp_path, "pt", checksum)
        out.prepare({"m": 1})
        bw = w.BackgroundWriter(out, queue_size=1, threads=1)
        bw.put([(i, sample) for i in idx])
        bw.close()
    manifest = out.finalize(3, {})
    assert manifest["checksum"] == "crc32" and manifest["num_files"] == 3
    for r in manifest["files"]:
        assert "sha256" not in r
        assert r["crc32"] == _independent_digest("crc32", (tmp_path / r["file"]).read_bytes())


def test_unknown_checksum_is_refused_before_anything_starts(tmp_path):
    from speculators_compat.cli import build_parser
    from speculators_compat.pipeline.extract import run_extract

    with pytest.raises(ValueError, match="checksum must be one of crc32, sha256, none, not 'md5'"):
        OutputDir(tmp_path, "pt", "md5")
    # refused before the input is read or an engine starts (neither exists here)
    with pytest.raises(ValueError, match="'md5'"):
        run_extract(str(tmp_path / "no-model"), str(tmp_path / "no-input.jsonl"), str(tmp_path / "o"), checksum="md5")
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["extract", "--model", "m", "--input", "i", "--output", "o", "--checksum", "md5"])


@pytest.mark.parametrize("name", ["md5", None])
def test_a_digest_needs_a_chosen_algorithm(name):
    """None means "choose later" only before the run; a digest asked for None is a bug and must
    not silently become no checksum."""
    from speculators_compat.files.checksums import new_digest

    with pytest.raises(ValueError, match=f"checksum must be one of crc32, sha256, none, not {name!r}"):
        new_digest(name)
    assert new_digest("none").hexdigest() is None and len(new_digest("crc32", b"x").hexdigest()) == 8


def test_a_rerun_keeps_the_checksum_it_finds_unless_told(tmp_path):
    """No --checksum: a new output gets crc32; a rerun into an output made with sha256 keeps sha256
    (no rehash of a large dataset because a default changed)."""
    torch = pytest.importorskip("torch")
    from speculators_compat.pipeline.writers import threads as w

    sample = {"input_ids": torch.arange(4), "hidden_states": [torch.randn(4, 8)], "loss_mask": torch.ones(4)}
    assert OutputDir(tmp_path / "new").checksum is None
    fresh = OutputDir(tmp_path / "new")
    fresh.prepare({"m": 1})
    assert fresh.checksum == "crc32"
    old = OutputDir(tmp_path / "old", "pt", "sha256")
    old.prepare({"m": 1})
    bw = w.BackgroundWriter(old, queue_size=1, threads=1)
    bw.put([(0, sample)])
    bw.close()
    again = OutputDir(tmp_path / "old")
    again.prepare({"m": 1})
    assert again.checksum == "sha256"
    bw = w.BackgroundWriter(again, queue_size=1, threads=1)
    bw.put([(1, sample)])
    bw.close()
    manifest = again.finalize(2, {})
    assert manifest["checksum"] == "sha256"
    assert all(
        r["sha256"] == _independent_digest("sha256", (tmp_path / "old" / r["file"]).read_bytes())
        for r in manifest["files"]
    )
