"""Specification of the SimCSE experiment, trained through `gcbs_lib.train` on small planted files
in the real formats (wiki1m, SentEval)."""

import json
import random

import pytest
import scipy.stats
import torch
import torch.nn.functional as F

from gcbs_lib.data.sts import STS_YEARS, TASKS
from gcbs_lib.experiments import get
from gcbs_lib.experiments.simcse import SimCSE
from gcbs_lib.train import load_config, train

WORDS = "cat dog bird fish tree river stone cloud rain sun moon star city road car ship".split()


def sentence(rng):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))


def scored_pairs(rng, n=12):
    return [(sentence(rng), sentence(rng), round(rng.uniform(0, 5), 2)) for _ in range(n)]


@pytest.fixture(scope="module")
def paper_root(tmp_path_factory):
    """A data root holding wiki1m and every SentEval task, tiny, in the published layouts."""
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("data")
    sts = root / "sts"
    senteval = sts / "SentEval"
    for year, names in STS_YEARS.items():
        folder = senteval / f"{year}-en-test"
        folder.mkdir(parents=True)
        for name in names:
            pairs = scored_pairs(rng, 4)
            (folder / f"STS.input.{name}.txt").write_text(
                "".join(f"{a}\t{b}\n" for a, b, _ in pairs)
            )
            (folder / f"STS.gs.{name}.txt").write_text("".join(f"{s}\n" for _, _, s in pairs))
    (senteval / "STSBenchmark").mkdir()
    for split in ("dev", "test"):
        rows = [
            f"genre\tfile\tyear\t{i}\t{s}\t{a}\t{b}\n"
            for i, (a, b, s) in enumerate(scored_pairs(rng))
        ]
        (senteval / "STSBenchmark" / f"sts-{split}.csv").write_text("".join(rows))
    (senteval / "SICK").mkdir()
    rows = [f"{i}\t{a}\t{b}\t{s}\tNEUTRAL\n" for i, (a, b, s) in enumerate(scored_pairs(rng))]
    (senteval / "SICK" / "SICK_test_annotated.txt").write_text(
        "pair_ID\tA\tB\tscore\tlabel\n" + "".join(rows)
    )
    (sts / "wiki1m_for_simcse.txt").write_text("".join(sentence(rng) + "\n" for _ in range(48)))
    return root


def tiny_config(experiment, root, **overrides):
    settings = dict(
        data="paper",
        data_root=str(root),
        encoder="tiny-bert",
        batch_size=8,
        epochs=1,
        max_steps=2,
        lr=1e-3,
        eval_max_length=16,
        progress=False,
        log_loss_gap=False,
    )
    return load_config(experiment, "ci", {**settings, **overrides})


def built(experiment, root, **overrides):
    config = tiny_config(experiment, root, **overrides)
    exp = get(experiment)(config.options, seed=0, device="cpu")
    exp.load_data()
    torch.manual_seed(0)
    return exp, exp.build_model()


def test_unsupervised_positives_are_the_same_sentence_under_two_dropout_masks(paper_root):
    exp, model = built("simcse", paper_root)
    batch = exp.collate([0, 1, 2, 3])
    first, second = batch.inputs
    assert first is second and first["input_ids"].shape[0] == 4
    model.train()
    assert not torch.equal(model(first), model(second))  # two dropout masks
    model.eval()
    assert torch.equal(model(first), model(second))
    z1, z2 = exp.pair_embeddings(model, torch.tensor([0, 1, 2]))
    assert torch.equal(z1, z2)


def test_training_pools_cls_through_the_mlp_and_evaluation_takes_the_raw_cls(paper_root):
    exp, model = built("simcse", paper_root, dropout=0.0)
    tokens = exp.collate([0, 1]).inputs[0]
    cls = model.backbone(**tokens).last_hidden_state[:, 0]
    model.train()
    torch.testing.assert_close(model(tokens), F.normalize(model.mlp(cls), dim=-1))
    model.eval()
    torch.testing.assert_close(model(tokens), F.normalize(cls, dim=-1))


def test_the_loss_is_one_direction_infonce_at_temperature_0_05(paper_root):
    exp, _ = built("simcse", paper_root)
    torch.manual_seed(1)
    z1, z2 = F.normalize(torch.randn(6, 8), dim=-1), F.normalize(torch.randn(6, 8), dim=-1)
    expected = F.cross_entropy(z1 @ z2.T / 0.05, torch.arange(6))
    torch.testing.assert_close(exp.loss([z1, z2], None, 20.0), expected)


def test_evaluation_is_the_spearman_rho_of_pair_cosines(paper_root):
    exp, model = built("simcse", paper_root)
    model.eval()
    with torch.no_grad():
        scores = exp.scores(exp.evaluate(model, "test"))
        first, second, gold = exp.tasks["test"]["STSBenchmark"]
        tokens = [exp.encoder.tokenize([t], exp.options.eval_max_length) for t in first + second]
        embedded = torch.cat([model(t) for t in tokens])
    cosines = F.cosine_similarity(embedded[: len(first)], embedded[len(first) :], dim=-1)
    assert scores["spearman_STSBenchmark"] == pytest.approx(
        scipy.stats.spearmanr(cosines, gold)[0], abs=1e-6
    )
    assert set(scores) == {"spearman", *(f"spearman_{task}" for task in TASKS)}
    assert scores["spearman"] == pytest.approx(
        sum(scores[f"spearman_{t}"] for t in TASKS) / len(TASKS)
    )


@pytest.mark.parametrize("sampler", ["random", "gcbs"])
def test_simcse_trains_through_the_training_loop_and_writes_result_rows(
    paper_root, tmp_path, sampler
):
    summary = train(tiny_config("simcse", paper_root, sampler=sampler, log_loss_gap=True), tmp_path)
    assert summary["steps"] == 2 and {r["arm"] for r in summary["rows"]} == {sampler}
    assert {r["metric"] for r in summary["rows"]} >= {
        "test_spearman",
        "dev_spearman",
        "test_spearman_STS12",
    }
    assert all(r["data"] == "paper" and r["experiment"] == "simcse" for r in summary["rows"])
    assert "loss_gap" in summary["epochs"][0]


def test_a_built_encoder_is_named_with_its_weights_hash_as_its_manifest_records_it(paper_root):
    exp, _ = built("simcse", paper_root)
    manifest = json.loads((paper_root / "models" / "tiny-bert" / "manifest.json").read_text())
    assert len(manifest["weights_sha256"]) == 64
    assert exp.model_name == f"tiny-bert@{manifest['weights_sha256'][:7]}"
    pretrained, _ = built("simcse", paper_root, encoder="minilm")  # not built here: its own name
    assert pretrained.model_name == "all-MiniLM-L6-v2"


def test_missing_paper_files_say_where_to_get_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="download_sts.py"):
        built("simcse", tmp_path)
    with pytest.raises(ValueError, match="'standin' or 'paper'"):
        built("simcse", tmp_path, data="sts-b")


def test_the_profile_carries_the_papers_recipe():
    simcse = load_config("simcse", "paper")
    assert (simcse.lr, simcse.batch_size, simcse.scale, simcse.options.max_length) == (
        3e-5,
        64,
        20.0,
        32,
    )
    assert simcse.options.pooling == "cls_mlp_train"


def test_constant_cosines_or_gold_rank_nothing_and_score_zero():
    outputs = {
        "collapsed": {"predicted": [0.999997] * 4, "gold": [1.0, 2.0, 3.0, 4.0]},
        "ranked": {"predicted": [0.1, 0.2, 0.4, 0.3], "gold": [1.0, 2.0, 3.0, 4.0]},
    }
    scores = SimCSE.scores(outputs)
    assert scores["spearman_collapsed"] == 0.0 and scores["spearman_ranked"] == pytest.approx(0.8)
    assert scores["spearman"] == pytest.approx(0.4)
