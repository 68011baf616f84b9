"""Write planted HowTo100M-format data (features, captions, video list, ground truth) into a folder.

    python data_scripts/howto100m_planted.py OUT [--videos 120] [--sigma 0] [--dim 2048] [--format json|pickle|csv]

Idempotent: an OUT that already holds videos.csv is left alone (delete it to rebuild).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gcbs_lib.data.howto100m import FEATURE_DIM, PlantedConfig, write_planted  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--videos", type=int, default=120)
    parser.add_argument("--sigma", type=float, default=0.0, help="caption misalignment in seconds")
    parser.add_argument("--dim", type=int, default=FEATURE_DIM, help="feature width per stream (real: 2048)")
    parser.add_argument("--format", choices=("json", "pickle", "csv"), default="json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if (args.out / "videos.csv").exists():
        print(f"{args.out} already holds planted data")
        return
    truth = write_planted(args.out, PlantedConfig(videos=args.videos, sigma=args.sigma, dim=args.dim, seed=args.seed),
                          args.format)
    print(f"wrote {len(truth)} planted videos to {args.out}")


if __name__ == "__main__":
    main()
