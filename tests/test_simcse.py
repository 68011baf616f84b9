"""Specification of the SimCSE experiment (and what PromCSE changes), trained through `gcbs_lib.train` on small
planted files in the real formats (wiki1m, NLI csv, SentEval)."""
import random

import pytest
import scipy.stats
import torch
import torch.nn.functional as F

from gcbs_lib.arms import run_arms
from gcbs_lib.data.sts import STS_YEARS, TASKS
from gcbs_lib.experiments import get
from gcbs_lib.experiments.simcse import split_by_document
from gcbs_lib.losses import info_nce
from gcbs_lib.train import load_config, load_checkpoint, train

WORDS = "cat dog bird fish tree river stone cloud rain sun moon star city road car ship".split()


def sentence(rng):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))


def scored_pairs(rng, n=12):
    return [(sentence(rng), sentence(rng), round(rng.uniform(0, 5), 2)) for _ in range(n)]


@pytest.fixture(scope="module")
def paper_root(tmp_path_factory):
    """A data root holding wiki1m, the NLI csv and every SentEval task, tiny, in the published layouts."""
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("data")
    sts = root / "sts"
    senteval = sts / "SentEval"
    for year, names in STS_YEARS.items():
        folder = senteval / f"{year}-en-test"
        folder.mkdir(parents=True)
        for name in names:
            pairs = scored_pairs(rng, 4)
            (folder / f"STS.input.{name}.txt").write_text("".join(f"{a}\t{b}\n" for a, b, _ in pairs))
            (folder / f"STS.gs.{name}.txt").write_text("".join(f"{s}\n" for _, _, s in pairs))
    (senteval / "STSBenchmark").mkdir()
    for split in ("dev", "test"):
        rows = [f"genre\tfile\tyear\t{i}\t{s}\t{a}\t{b}\n" for i, (a, b, s) in enumerate(scored_pairs(rng))]
        (senteval / "STSBenchmark" / f"sts-{split}.csv").write_text("".join(rows))
    (senteval / "SICK").mkdir()
    rows = [f"{i}\t{a}\t{b}\t{s}\tNEUTRAL\n" for i, (a, b, s) in enumerate(scored_pairs(rng))]
    (senteval / "SICK" / "SICK_test_annotated.txt").write_text("pair_ID\tA\tB\tscore\tlabel\n" + "".join(rows))
    (sts / "wiki1m_for_simcse.txt").write_text("".join(sentence(rng) + "\n" for _ in range(48)))
    triples = [(sentence(rng), sentence(rng), sentence(rng)) for _ in range(48)]
    (sts / "nli_for_simcse.csv").write_text("sent0,sent1,hard_neg\n" + "".join(",".join(t) + "\n" for t in triples))
    return root


def tiny_config(experiment, root, **overrides):
    settings = dict(data="paper", data_root=str(root), encoder="tiny-bert", batch_size=8, epochs=1, max_steps=2,
                    lr=1e-3, eval_max_length=16, progress=False, log_loss_gap=False)
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


def test_supervised_batches_interleave_entailment_and_contradiction(paper_root):
    exp, model = built("simcse", paper_root, supervised=True)
    anchors, docs = exp.collate([5, 7]).inputs
    texts = [exp.train[5][1], exp.train[5][2], exp.train[7][1], exp.train[7][2]]
    assert torch.equal(docs["input_ids"], exp.encoder.tokenize(texts, exp.options.max_length)["input_ids"])
    assert anchors["input_ids"].shape[0] == 2


def test_evaluation_is_the_spearman_rho_of_pair_cosines(paper_root):
    exp, model = built("simcse", paper_root)
    model.eval()
    with torch.no_grad():
        scores = exp.evaluate(model, "test")
        first, second, gold = exp.tasks["test"]["STSBenchmark"]
        tokens = [exp.encoder.tokenize([t], exp.options.eval_max_length) for t in first + second]
        embedded = torch.cat([model(t) for t in tokens])
    cosines = F.cosine_similarity(embedded[:len(first)], embedded[len(first):], dim=-1)
    assert scores["spearman_STSBenchmark"] == pytest.approx(scipy.stats.spearmanr(cosines, gold)[0], abs=1e-6)
    assert set(scores) == {"spearman", *(f"spearman_{task}" for task in TASKS)}
    assert scores["spearman"] == pytest.approx(sum(scores[f"spearman_{t}"] for t in TASKS) / len(TASKS))


def test_the_lee_split_keeps_every_document_in_one_half():
    documents = [f"document {i}" for i in range(10)]
    pairs = [(a, b, float(i + j)) for i, a in enumerate(documents) for j, b in enumerate(documents) if i < j]
    dev, test = split_by_document(tuple(map(list, zip(*pairs))))
    dev_docs, test_docs = set(dev[0]) | set(dev[1]), set(test[0]) | set(test[1])
    assert not dev_docs & test_docs and len(dev_docs) == len(test_docs) == 5
    assert len(dev[2]) == len(test[2]) == 10  # C(5, 2) each; the 25 pairs across the halves are dropped


@pytest.mark.parametrize("sampler", ["random", "gcbs"])
def test_simcse_trains_through_the_training_loop_and_writes_result_rows(paper_root, tmp_path, sampler):
    summary = train(tiny_config("simcse", paper_root, sampler=sampler, log_loss_gap=True), tmp_path)
    assert summary["steps"] == 2 and {r["arm"] for r in summary["rows"]} == {sampler}
    assert {r["metric"] for r in summary["rows"]} >= {"test_spearman", "dev_spearman", "test_spearman_STS12"}
    assert all(r["data"] == "paper" and r["experiment"] == "simcse" for r in summary["rows"])
    assert "loss_gap" in summary["epochs"][0]


def test_run_arms_trains_every_arm_on_every_seed_and_then_loads_the_finished_runs(paper_root, tmp_path):
    overrides = dict(data="paper", data_root=str(paper_root), encoder="tiny-bert", batch_size=8, epochs=1,
                     max_steps=2, eval_max_length=16, progress=False)
    first = run_arms("simcse", "ci", ["random", "gcbs"], [0, 1], tmp_path, overrides)
    assert set(first) == {("random", 0), ("random", 1), ("gcbs", 0), ("gcbs", 1)}
    logged = (tmp_path / "gcbs-seed1" / "metrics.jsonl").read_text()
    again = run_arms("simcse", "ci", ["gcbs"], [1], tmp_path, overrides)
    assert again["gcbs", 1]["rows"] == first["gcbs", 1]["rows"]
    assert (tmp_path / "gcbs-seed1" / "metrics.jsonl").read_text() == logged  # loaded, not retrained


def test_promcse_updates_only_the_prompt_and_the_mlp_through_gradcache(paper_root, tmp_path):
    config = tiny_config("promcse", paper_root, pre_seq_len=3, chunk_size=3, checkpoint_every=1, max_steps=1)
    exp = get("promcse")(config.options, seed=0, device="cpu")
    exp.load_data()
    torch.manual_seed(0)
    before = {k: v.clone() for k, v in exp.build_model().state_dict().items()}
    train(config, tmp_path)
    after = load_checkpoint(tmp_path / "checkpoint.pt")["model"]
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {"backbone.prefix.prompt", "mlp.0.weight", "mlp.0.bias"}
    assert before["backbone.prefix.prompt"].shape[3] == 3


def test_promcse_adds_the_energy_hinge_only_when_asked(paper_root):
    plain, _ = built("promcse", paper_root, supervised=True)
    hinged, _ = built("promcse", paper_root, supervised=True, energy_hinge=True, hinge_margin=0.5, hinge_weight=3.0)
    torch.manual_seed(2)
    anchors, docs = torch.randn(4, 8), torch.randn(8, 8)
    base = info_nce(anchors, docs, 20.0)
    torch.testing.assert_close(plain.loss([anchors, docs], None, 20.0), base)
    cos = F.normalize(anchors, dim=-1) @ F.normalize(docs, dim=-1).T
    positive = cos[torch.arange(4), torch.arange(4) * 2]
    hardest = cos.scatter(1, (torch.arange(4) * 2)[:, None], -2.0).amax(1)
    expected = base + 3.0 * torch.relu(0.5 - positive + hardest).mean()
    torch.testing.assert_close(hinged.loss([anchors, docs], None, 20.0), expected)


def test_the_stand_in_has_no_nli_and_missing_paper_files_say_where_to_get_them(tmp_path):
    with pytest.raises(ValueError, match="no NLI"):
        built("simcse", tmp_path, data="standin", supervised=True)
    with pytest.raises(FileNotFoundError, match="download_sts.py"):
        built("simcse", tmp_path)
    with pytest.raises(ValueError, match="'standin' or 'paper'"):
        built("simcse", tmp_path, data="sts-b")


def test_the_profiles_carry_the_papers_recipe():
    simcse, promcse = load_config("simcse", "paper"), load_config("promcse", "paper")
    assert (simcse.lr, simcse.batch_size, simcse.scale, simcse.options.max_length) == (3e-5, 64, 20.0, 32)
    assert simcse.options.pooling == promcse.options.pooling == "cls_mlp_train"
    assert (promcse.lr, promcse.batch_size, promcse.options.pre_seq_len) == (3e-2, 256, 16)
    assert load_config("promcse", "cpu").chunk_size == 64  # batch 256 on a CPU: GradCache
