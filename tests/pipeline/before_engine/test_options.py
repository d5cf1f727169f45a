"""ExtractOptions (pipeline/options.py): settings refused before anything starts."""

import pytest

from tests.pipeline.helpers import write_jsonl


def test_speculators_hs_refusals_before_any_engine(tmp_path):
    from speculators_compat.pipeline.extract import run_extract

    src = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": [5, 6, 7]}])
    with pytest.raises(ValueError, match="on-overlength skip would leave a dataset row"):
        run_extract("/nonexistent", str(src), str(tmp_path / "o"), fmt="speculators-hs", on_overlength="skip")
    d = tmp_path / "prepared"
    d.mkdir()
    with pytest.raises(ValueError, match="is the input dataset"):
        run_extract("/nonexistent", str(d), str(d), fmt="speculators-hs")
    assert not (tmp_path / "o").exists()
