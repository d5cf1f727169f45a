"""The input datasets (pipeline/dataset.py): JSONL and saved datasets, read and refused."""

import json

import pytest

from speculators_compat.pipeline.dataset import DatasetError, open_dataset
from tests.pipeline.helpers import write_jsonl


def test_jsonl_ok(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, "", {"input_ids": [4]}])
    got = list(open_dataset(f))
    assert [(s.index, s.input_ids, s.loss_mask) for s in got] == [(0, [1, 2, 3], [0, 1, 1]), (1, [4], None)]


def test_jsonl_with_a_byte_order_mark_and_crlf(tmp_path):
    # (a file saved by Windows tools: before, line 1 was "malformed JSON (Unexpected UTF-8 BOM)")
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"input_ids": [1, 2]}\r\n{"input_ids": [3], "loss_mask": [1]}\r\n')
    assert [(s.input_ids, s.loss_mask) for s in open_dataset(f)] == [([1, 2], None), ([3], [1])]
    f.write_bytes(b'{"input_ids": [1]}\n\xef\xbb\xbf{"input_ids": [3]}\n')  # one mid-file is still an error
    with pytest.raises(DatasetError, match="bom.jsonl:2: malformed JSON"):
        list(open_dataset(f))


@pytest.mark.parametrize(
    "line,text",
    [
        ('{"input_ids": [1, 2', "d.jsonl:2: malformed JSON"),
        ('{"ids": [1]}', "d.jsonl:2: input_ids must be a non-empty list"),
        ('{"input_ids": []}', "non-empty"),
        ('{"input_ids": [1, -2]}', "holds -2"),
        ('{"input_ids": [1, "x"]}', "holds 'x'"),
        ('{"input_ids": [1, 2], "loss_mask": [1]}', "as long as input_ids"),
        ('{"input_ids": [1, 2], "loss_mask": [1, 7]}', "0/1"),
        ("[1, 2, 3]", "expected an object"),
        (
            '{"conversations": [{"from": "human", "value": "hi"}]}',
            "this sample has conversations: the input must be tokenized already",
        ),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, line, text):
    f = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1]}, line])
    with pytest.raises(DatasetError, match=text):
        list(open_dataset(f))


def test_missing_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_dataset(tmp_path / "nope.jsonl")


def test_directory_without_dataset(tmp_path):
    with pytest.raises(DatasetError, match="saved dataset"):
        open_dataset(tmp_path)


def test_arrow_dataset_dir(tmp_path):
    pa = pytest.importorskip("pyarrow")
    table = pa.table({"input_ids": [[5, 6, 7], [8]], "loss_mask": [[0, 1, 1], [1]]})
    with pa.OSFile(str(tmp_path / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    (tmp_path / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    got = [(s.input_ids, s.loss_mask) for s in open_dataset(tmp_path)]
    assert got == [([5, 6, 7], [0, 1, 1]), ([8], [1])]


def _saved_derived_dataset(tmp_path):
    """A dataset as users make one: loaded from JSON (so its info records 50 examples), shuffled,
    cut to 10 by ``select``, mapped, and saved in two shards by ``datasets`` itself."""
    datasets = pytest.importorskip("datasets")
    raw = write_jsonl(tmp_path / "raw.jsonl", [{"input_ids": [1, 2, i], "loss_mask": [0, 1, i % 2]} for i in range(50)])
    d = datasets.load_dataset("json", data_files=str(raw), split="train", cache_dir=str(tmp_path / "cache"))
    d = (
        d.shuffle(seed=0)
        .select(range(10))
        .map(lambda e: {"input_ids": e["input_ids"] + [7], "loss_mask": e["loss_mask"] + [1]})
    )
    d.save_to_disk(str(tmp_path / "saved"), num_shards=2)
    return datasets, tmp_path / "saved"


def test_dataset_saved_by_datasets_reads_as_datasets_does(tmp_path):
    datasets, saved = _saved_derived_dataset(tmp_path)
    want = [(r["input_ids"], r["loss_mask"]) for r in datasets.load_from_disk(str(saved))]
    got = [(s.index, s.input_ids, s.loss_mask) for s in open_dataset(saved)]
    assert got == [(i, ids, mask) for i, (ids, mask) in enumerate(want)]
    assert len(want) == 10 and all(ids[-1] == 7 for ids, _ in want)


def test_saved_dataset_is_counted_from_its_rows_not_its_info(tmp_path):
    # dataset_info.json still says 50 (the JSON file's split): the progress bar's total and the
    # short-last-shard decision on resume were taken from it
    from speculators_compat.pipeline.dataset import count_arrow_rows

    _, saved = _saved_derived_dataset(tmp_path)
    assert json.loads((saved / "dataset_info.json").read_text())["splits"]["train"]["num_examples"] == 50
    assert count_arrow_rows(saved) == 10


def test_saved_dataset_with_torch_format_int32_ids_and_bool_mask(tmp_path):
    datasets = pytest.importorskip("datasets")
    d = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4]], "loss_mask": [[True, False, True], [False]]})
    d = d.cast_column("input_ids", datasets.Sequence(datasets.Value("int32")))
    d.set_format("torch")  # (what speculators' preprocessing leaves set)
    d.save_to_disk(str(tmp_path / "t"))
    got = [(s.input_ids, s.loss_mask) for s in open_dataset(tmp_path / "t")]
    assert got == [([1, 2, 3], [1, 0, 1]), ([4], [0])]
    assert all(type(t) is int for s in open_dataset(tmp_path / "t") for t in s.input_ids + s.loss_mask)


def test_saved_dataset_dict_names_its_splits(tmp_path):
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(DatasetError, match=r"saved DatasetDict \(splits: train, test\).*dd/train"):
        open_dataset(tmp_path / "dd")


@pytest.mark.parametrize(
    "state,text",
    [
        ("{not json", "not a saved dataset's state file"),
        ('{"_data_files": [{"name": "x"}]}', "not a saved dataset's state file"),
        ('{"_data_files": []}', "lists no data files"),
        ('{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}', "not there: data-00000-of-00001.arrow"),
    ],
)
def test_broken_saved_dataset_is_refused_before_any_sample(tmp_path, state, text):
    (tmp_path / "state.json").write_text(state)
    with pytest.raises(DatasetError, match=text):
        open_dataset(tmp_path)  # (raised by the call itself: before a pipeline starts its engine)


def test_damaged_arrow_file_is_named(tmp_path):
    pytest.importorskip("pyarrow")
    from speculators_compat.pipeline.dataset import count_arrow_rows

    (tmp_path / "data-00000-of-00001.arrow").write_bytes(b"\xff\xff\xff\xff not arrow at all" * 4)
    (tmp_path / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    with pytest.raises(DatasetError, match="data-00000-of-00001.arrow: not a readable Arrow stream"):
        list(open_dataset(tmp_path))
    with pytest.raises(DatasetError, match="not a readable Arrow stream"):
        count_arrow_rows(tmp_path)


def test_a_non_utf8_line_is_named(tmp_path):
    """The JSONL is decoded line by line: a bad byte names its line (not the read block's first)."""
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"input_ids": [1]}\n{"input_ids": [2]}\n{"input_ids": [3], "x": "\xff"}\n')
    it = open_dataset(f)
    assert [next(it).input_ids, next(it).input_ids] == [[1], [2]]  # what precedes it is read
    with pytest.raises(DatasetError, match=r"d.jsonl:3: not UTF-8 text \(invalid start byte at column 26\)"):
        next(it)
