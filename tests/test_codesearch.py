"""Specification of the code-search experiment: data in UniXcoder's layouts (the stdlib stand-in
built on first use), duplicate groups, collation with mined negatives, the loss, and evaluation
against the whole pool."""

import json
import random
from pathlib import Path

import pytest
import torch

from gcbs_lib import experiments
from gcbs_lib.data import data_root
from gcbs_lib.experiments.codesearch import CodeSearch, duplicate_groups
from gcbs_lib.losses import info_nce
from gcbs_lib.train import main


def tiny(**options):
    return CodeSearch(
        CodeSearch.Options(
            **{
                "tiny_dim": 8,
                "tiny_layers": 1,
                "query_length": 8,
                "code_length": 8,
                "dropout": 0.0,
                **options,
            }
        ),
        seed=0,
        device="cpu",
    )


def test_the_experiment_is_found_by_name():
    assert experiments.get("codesearch") is CodeSearch and "codesearch" in experiments.available()


def test_pairs_sharing_a_query_or_a_code_form_one_duplicate_group():
    pairs = [
        {"query": "a", "code": "x"},
        {"query": "b", "code": "y"},
        {"query": "a", "code": "z"},
        {"query": "c", "code": "y"},
        {"query": "d", "code": "w"},
        {"query": "e", "code": "z "},
    ]
    groups = duplicate_groups(pairs)
    assert groups[0] == groups[2] == groups[5] and groups[1] == groups[3]
    assert len({groups[0], groups[1], groups[4]}) == 3


def write_layout(folder, rows, pool=None):
    """`rows` as train, valid and test files in `folder`; with `pool`, also a codebase.jsonl of
    those rows."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in (("train", rows), ("valid", rows), ("test", rows), ("codebase", pool)):
        if content is not None:
            (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in content))


@pytest.fixture
def codesearch(tmp_path):
    rng = random.Random(0)
    rows = [
        {
            "url": f"u{i}",
            "docstring_tokens": [f"w{rng.randrange(50)}" for _ in range(5)],
            "code_tokens": ["def", f"f{i}", "(", ")", ":", "pass"],
        }
        for i in range(12)
    ]
    write_layout(tmp_path / "codesearch" / "AdvTest", rows)
    experiment = tiny(data="advtest", data_root=str(tmp_path))
    assert experiment.load_data().size == 12 and experiment.data_name == "paper"
    return experiment, experiment.build_model().eval()


def test_mined_negatives_follow_their_query_s_positive_and_the_loss_is_in_batch_info_nce(
    codesearch,
):
    experiment, model = codesearch
    batch = experiment.collate([0, 1, 2], negatives=[5, 7, 9])
    queries, codes = (model(x) for x in batch.inputs)
    assert codes.shape[0] == 6
    expected_codes = model(
        experiment.encoder.tokenize([experiment.train[i]["code"] for i in (0, 5, 1, 7, 2, 9)], 8)
    )
    torch.testing.assert_close(codes, expected_codes)
    torch.testing.assert_close(
        experiment.loss([queries, codes], batch, 20.0), info_nce(queries, codes, 20.0)
    )


def test_evaluation_ranks_each_query_against_the_whole_pool(codesearch):
    experiment, model = codesearch
    with torch.no_grad():
        outputs = experiment.evaluate(model, "test")
    assert outputs["queries"]["candidates"] == [12] * len(outputs["queries"]["rank"])
    scores = experiment.scores(outputs)
    assert set(scores) == {"mrr", "recall@1", "recall@10"} and 1 / 12 <= scores["mrr"] <= 1
    z1, z2 = experiment.pair_embeddings(model, torch.arange(12))
    assert z1.shape == z2.shape == (12, 8)


def test_the_stdlib_stand_in_is_built_on_first_use_in_advtest_s_layout(tmp_path):
    experiment = tiny(data="stdlib-advtest", data_root=str(tmp_path), eval_limit=50)
    train_set = experiment.load_data()
    assert (tmp_path / "codesearch" / "stdlib-advtest" / "manifest.json").is_file()
    # repeated docstrings
    assert train_set.size > 3000 and len(set(train_set.duplicate_keys)) < train_set.size
    test = experiment.tasks["test"]
    assert (
        len(test.queries) == 50
        and len(test.codes) > 50
        and test.codes[0].startswith(("def func", "async def"))
    )
    assert (
        experiment.data_name == "stdlib-docstrings-advtest"
        and experiment.model_name == "tiny-text-encoder"
    )


def test_missing_real_data_and_unknown_data_names_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="download_codesearch.py"):
        tiny(data="cosqa", data_root=str(tmp_path)).load_data()
    with pytest.raises(ValueError, match="data must be one of"):
        tiny(data="nope").load_data()


def test_a_data_root_that_does_not_exist_is_refused_before_anything_is_made(tmp_path, capsys):
    missing = f"/nonexistent-{tmp_path.name}"
    with pytest.raises(SystemExit) as exit:
        main(
            [
                "--experiment",
                "codesearch",
                "--output-dir",
                str(tmp_path / "run"),
                "--set",
                f"data_root={missing}",
            ]
        )
    assert (
        exit.value.code == 2
        and f"error: data_root {missing} does not exist: create it, or leave data_root "
        f"unset for {data_root()}"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "run").exists() and not Path(missing).exists()
    # a folder to build
    assert data_root(str(tmp_path / "new"), "data_dir", built_here=True) == tmp_path / "new"
    with pytest.raises(ValueError, match="data_dir .*/new: its parent folder does not exist"):
        data_root(f"{missing}/new", "data_dir", built_here=True)


def test_pool_keys_missing_or_repeated_are_counted_when_the_data_loads_and_scored_as_unixcoder_does(
    tmp_path, capsys
):
    """A query whose key is not in the pool scores 0 (not an error at the first evaluation); of a
    key repeated in the pool only its first row stays. One line per split counts both, before any
    training step."""
    rows = [
        {"url": f"u{i}", "docstring_tokens": ["q", str(i)], "code_tokens": ["c", str(i)]}
        for i in range(4)
    ]
    repeat = {**rows[0], "code_tokens": ["another", "c"]}
    write_layout(
        tmp_path / "codesearch" / "CSN" / "python", rows, pool=[rows[0], rows[1], repeat, rows[2]]
    )
    experiment = tiny(data="csn", data_root=str(tmp_path))
    experiment.load_data()
    assert capsys.readouterr().out.splitlines() == [
        f"{split}: 1 queries with no pool key (scored 0), 1 repeated keys (first kept)"
        for split in ("dev", "test")
    ]
    task = experiment.tasks["test"]
    assert task.codes == ["c 0", "c 1", "c 2"] and task.positive.tolist() == [0, 1, 2, -1]
    with torch.no_grad():
        scores = experiment.scores(experiment.evaluate(experiment.build_model().eval(), "test"))
    # the pool holds 3 codes: only u3 misses
    assert scores["recall@10"] == 0.75 and scores["mrr"] <= 0.75
