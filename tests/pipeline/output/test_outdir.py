"""The output directory (pipeline/output/outdir.py): what a resume may trust, and what it refuses."""

import json

import pytest

from speculators_compat.errors import OutputError
from speculators_compat.pipeline.output.outdir import OutputDir
from tests.pipeline.helpers import finished_file, five_files


def test_output_dir_refuses_another_run(tmp_path):
    out = OutputDir(tmp_path / "o")
    assert out.prepare({"model": "a", "layer_ids": [1, 2]}) == set()
    finished_file(tmp_path / "o", "data_0.pt", b"x")  # (with no sample written there is no run to protect)
    with pytest.raises(OutputError, match="layer_ids: \\[1, 2\\] -> \\[1, 3\\]"):
        out.prepare({"model": "a", "layer_ids": [1, 3]})


def test_output_dir_resumes_with_another_batch_size(tmp_path, caplog):
    # (a lower --batch-size is how a user gets past a memory error: refusing it lost the run's files)
    info = {"model": "a", "layer_ids": [1, 2], "batch_size": 32}
    out = OutputDir(tmp_path / "o")
    out.prepare(info)
    finished_file(tmp_path / "o", "data_0.pt", b"x")
    with caplog.at_level("WARNING", logger="speculators_compat"):
        assert OutputDir(tmp_path / "o").prepare(dict(info, batch_size=8)) == {0}
    assert "with batch_size 8 (the run that made it used 32)" in caplog.text
    assert json.loads((tmp_path / "o" / "run.json").read_text())["batch_size"] == 32
    with pytest.raises(OutputError, match=r"holds a different run \(layer_ids: \[1, 2\] -> \[1, 3\]\)"):
        OutputDir(tmp_path / "o").prepare(dict(info, batch_size=8, layer_ids=[1, 3]))  # only what matters is named


def test_output_dir_uncreatable(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="cannot create output directory"):
        OutputDir(tmp_path / "file" / "sub").prepare({})


def test_partial_files_dropped_and_done_detected(tmp_path):
    out = OutputDir(tmp_path)
    out.prepare({"m": 1})
    finished_file(tmp_path, "data_0.pt", b"x")
    (tmp_path / ".data_1.pt.partial").write_bytes(b"half")
    (tmp_path / "data_2.safetensors").write_bytes(b"other format")
    assert out.prepare({"m": 1}) == {0}
    assert not (tmp_path / ".data_1.pt.partial").exists()


def test_a_torn_last_record_does_not_take_the_next_one_with_it(tmp_path):
    """A kill mid-append leaves a torn last line in checksums.jsonl. The resume cuts it off: the
    torn record's file is computed again, and the records appended after it are whole."""
    torch = pytest.importorskip("torch")
    from speculators_compat.pipeline.writers import threads as w

    five_files(tmp_path)
    f = tmp_path / "checksums.jsonl"
    f.write_bytes(f.read_bytes()[:-20])  # data_4.pt's record torn
    again = OutputDir(tmp_path, "pt")
    done = again.prepare({"m": 1, "samples": 8})
    assert done == {0, 1, 2, 3}  # data_4.pt had no whole record: removed, to be written again
    assert f.read_bytes().endswith(b"\n")
    bw = w.BackgroundWriter(again, queue_size=1, threads=1)
    sample = {"input_ids": torch.arange(6), "hidden_states": [torch.randn(6, 16)], "loss_mask": torch.ones(6)}
    bw.put([(i, sample) for i in (4, 5)])
    bw.close()
    assert sorted(again.checksum_records()) == [0, 1, 2, 3, 4, 5]
    manifest = again.finalize(6, {})
    assert manifest["total_tokens"] == 36 and json.loads((tmp_path / "sample_lengths.json").read_text())["5"] == 6


def test_a_run_reading_fewer_samples_than_the_output_holds_is_refused(tmp_path):
    """--max-samples 3 over an output holding 5 files would write a manifest for 3 and leave 2 out."""
    out = five_files(tmp_path)
    with pytest.raises(OutputError, match=r"holds files of 2 sample\(s\) at index 3 and above \(up to 4\)"):
        out.check_total(3)
    out.check_total(5)
    out.check_total(64)
