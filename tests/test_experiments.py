"""Specification of the experiment registry and of the code-search experiment's pieces."""
import json
import random

import pytest
import torch

from gcbs_lib import experiments
from gcbs_lib.experiments.codesearch import CodeSearch, duplicate_groups
from gcbs_lib.losses import info_nce


def test_the_registry_finds_experiments_by_name_and_refuses_unknown_ones():
    assert experiments.get("codesearch") is CodeSearch and "codesearch" in experiments.available()
    with pytest.raises(KeyError, match="unknown experiment 'nope'"):
        experiments.get("nope")


def test_pairs_sharing_a_query_or_a_code_form_one_duplicate_group():
    pairs = [{"query": "a", "code": "x"}, {"query": "b", "code": "y"}, {"query": "a", "code": "z"},
             {"query": "c", "code": "y"}, {"query": "d", "code": "w"}, {"query": "e", "code": "z "}]
    groups = duplicate_groups(pairs)
    assert groups[0] == groups[2] == groups[5] and groups[1] == groups[3]
    assert len({groups[0], groups[1], groups[4]}) == 3


@pytest.fixture
def codesearch(tmp_path):
    folder = tmp_path / "codesearch" / "AdvTest"
    folder.mkdir(parents=True)
    rng = random.Random(0)
    rows = [{"url": f"u{i}", "docstring_tokens": [f"w{rng.randrange(50)}" for _ in range(5)],
             "code_tokens": ["def", f"f{i}", "(", ")", ":", "pass"]} for i in range(12)]
    for split in ("train", "valid", "test"):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    experiment = CodeSearch(CodeSearch.Options(data="advtest", data_root=str(tmp_path), tiny_dim=8, tiny_layers=1,
                                               query_length=8, code_length=8, dropout=0.0), seed=0, device="cpu")
    assert experiment.load_data().size == 12 and experiment.data_name == "paper"
    return experiment, experiment.build_model().eval()


def test_mined_negatives_follow_their_query_s_positive_and_the_loss_is_in_batch_info_nce(codesearch):
    experiment, model = codesearch
    batch = experiment.collate([0, 1, 2], negatives=[5, 7, 9])
    queries, codes = (model(x) for x in batch.inputs)
    assert codes.shape[0] == 6
    expected_codes = model(experiment.encoder.tokenize([experiment.train[i]["code"] for i in (0, 5, 1, 7, 2, 9)], 8))
    torch.testing.assert_close(codes, expected_codes)
    torch.testing.assert_close(experiment.loss([queries, codes], batch, 20.0), info_nce(queries, codes, 20.0))


def test_evaluation_ranks_each_query_against_the_whole_pool(codesearch):
    experiment, model = codesearch
    with torch.no_grad():
        scores = experiment.evaluate(model, "test")
    assert set(scores) == {"mrr", "recall@1", "recall@10"} and 1 / 12 <= scores["mrr"] <= 1
    z1, z2 = experiment.pair_embeddings(model, torch.arange(12))
    assert z1.shape == z2.shape == (12, 8)
