"""Result rows: one measured number each, checked when made, written and read; their runs'
per-item test outputs beside them, a record a line; `record` saves a notebook's rows in the
runner's folder."""

import json

import pytest

from gcbs_lib.rows import (
    RESULTS_DIR_VARIABLE,
    check_row,
    read_outputs,
    read_rows,
    record,
    result_row,
    write_outputs,
    write_rows,
)

NAMES = dict(experiment="codesearch", metric="test_mrr", profile="cpu", data="stand-in", model="m")
OUTPUTS = [
    dict(experiment="codesearch", arm=arm, seed=0, checkpoint="best", outputs={"queries": {}})
    for arm in ("random", "gcbs")
]


def test_rows_round_trip_and_bad_rows_are_refused_with_a_clear_error(tmp_path):
    rows = [result_row(arm="random", seed=0, value=0.5, **NAMES)]
    rows.append(result_row(arm="gcbs", seed="0", value="0.25", **NAMES))
    assert rows[1]["seed"] == 0 and rows[1]["value"] == 0.25
    assert read_rows(write_rows(tmp_path / "r.json", rows)) == rows
    with pytest.raises(ValueError, match="exactly the keys"):
        check_row({**rows[0], "extra": 1})
    with pytest.raises(ValueError, match="finite value"):
        result_row(arm="gcbs", seed=1, value=float("nan"), **NAMES)
    with pytest.raises(ValueError, match="non-empty names"):
        result_row(arm="", seed=1, value=0.5, **NAMES)
    (tmp_path / "bad.json").write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="JSON list"):
        read_rows(tmp_path / "bad.json")
    (tmp_path / "cut.json").write_text('[{"experiment": ')
    with pytest.raises(ValueError, match="cut.json is not valid JSON"):
        read_rows(tmp_path / "cut.json")


def test_outputs_are_written_a_record_a_line_and_a_corrupt_file_is_named(tmp_path):
    path = write_outputs(tmp_path / "r.json", OUTPUTS)
    assert path.name == "r.outputs.jsonl"
    assert [json.loads(line) for line in path.read_text().splitlines()] == OUTPUTS
    assert read_outputs(tmp_path / "r.json") == OUTPUTS
    assert read_outputs(tmp_path / "none.json") == []
    path.write_text('{"experiment": \n')
    with pytest.raises(ValueError, match=r"r.outputs.jsonl:1 is not valid JSON"):
        read_outputs(tmp_path / "r.json")


def test_record_writes_into_the_runner_folder_and_nothing_without_it(tmp_path, monkeypatch):
    first = result_row(arm="random", seed=0, value=0.5, **NAMES)
    monkeypatch.delenv(RESULTS_DIR_VARIABLE, raising=False)
    assert record([first], "04_x") is None
    monkeypatch.setenv(RESULTS_DIR_VARIABLE, str(tmp_path))
    assert read_rows(record([first], "04_x", OUTPUTS[:1])) == [first]
    assert read_outputs(tmp_path / "04_x.json") == OUTPUTS[:1]


def test_record_replaces_the_rows_and_outputs_of_the_same_run_and_keeps_the_others(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(RESULTS_DIR_VARIABLE, str(tmp_path))
    old = [result_row(arm=arm, seed=0, value=0.5, **NAMES) for arm in ("random", "gcbs")]
    record(old, "04_x", OUTPUTS)
    again = result_row(arm="gcbs", seed=0, value=0.75, **NAMES)
    rerun = {**OUTPUTS[1], "outputs": {"queries": {"rank": [1]}}}
    assert read_rows(record([again], "04_x", [rerun])) == [old[0], again]
    assert read_outputs(tmp_path / "04_x.json") == [OUTPUTS[0], rerun]
