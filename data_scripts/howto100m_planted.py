"""Write planted HowTo100M-format data (features, captions, ground truth) into a folder, once.

    python data_scripts/howto100m_planted.py OUT [--videos 120] [--sigma 0] [--dim 2048] [--format
    json|pickle|csv]

Each video is a run of `segments` steps of `segment_seconds` each; a step is a (verb, object) topic
with its own direction in feature space, and its caption names the verb and the object among filler
words. Captions are shifted in time by Gaussian noise of `sigma` seconds (narration drifts from what
is shown) and on average `filler_rate` extra captions per step hold filler words only. Files:
`features_2d/`, `features_3d/` (float16, L2-normalised rows at 1 and 1.5 rows/s), the captions
(`caption.json`, `caption.pickle` or `captions/*.csv`), `truth.json` (each video's segments: window,
verb, object, clean caption) and `manifest.json`. Idempotent: an OUT built with the same settings is
left alone (`gcbs_lib.data.build_once`).
"""

import argparse
import csv
import json
import pickle
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gcbs_lib.data import build_once  # noqa: E402
from gcbs_lib.data.howto100m import FPS  # noqa: E402

FEATURE_DIM = 2048  # feature width per stream of the real HowTo100M features
FILLER_WORDS = (
    "so",
    "now",
    "okay",
    "we",
    "just",
    "going",
    "to",
    "right",
    "um",
    "this",
    "and",
    "then",
    "guys",
    "subscribe",
    "here",
    "like",
    "really",
    "little",
    "bit",
    "see",
)
CAPTION_FILE = {"json": "caption.json", "pickle": "caption.pickle", "csv": "captions"}


@dataclass(frozen=True)
class PlantedConfig:
    videos: int = 60
    segments: int = 6
    segment_seconds: float = 6.0
    verbs: int = 8
    objects: int = 24
    sigma: float = 0.0
    filler_rate: float = 0.5
    feature_noise: float = 0.2
    dim: int = FEATURE_DIM
    seed: int = 0


def write_captions(captions: dict, path: Path, fmt: str) -> Path:
    """Write captions as `caption.json`, `caption.pickle` (plain dicts of lists) or a directory of
    csv files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "json":
        path.write_text(json.dumps(captions), encoding="utf-8")
    elif fmt == "pickle":
        path.write_bytes(pickle.dumps(captions, protocol=4))
    else:
        path.mkdir(exist_ok=True)
        for video_id, entry in captions.items():
            with open(path / f"{video_id}.csv", "w", newline="", encoding="utf-8") as handle:
                writer = csv.writer(handle)
                writer.writerow(["start", "end", "text"])
                writer.writerows(zip(entry["start"], entry["end"], entry["text"]))
    return path


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def write_planted(
    root: Path, config: PlantedConfig = PlantedConfig(), caption_format: str = "json"
) -> dict:
    """Write planted videos in the real formats under `root`; return the ground truth (also in
    truth.json)."""
    rng = np.random.default_rng(config.seed)
    directions = {
        s: unit(rng.standard_normal((config.verbs + config.objects, config.dim))) for s in FPS
    }
    captions, truth = {}, {}
    for v in range(config.videos):
        video_id = f"v{v:05d}"
        topics = [
            (int(rng.integers(config.verbs)), int(rng.integers(config.objects)))
            for _ in range(config.segments)
        ]
        duration = config.segments * config.segment_seconds
        for stream, fps in FPS.items():
            t = np.arange(int(duration * fps)) / fps
            segment = np.minimum((t // config.segment_seconds).astype(int), config.segments - 1)
            signal = np.stack(
                [directions[stream][a] + directions[stream][config.verbs + b] for a, b in topics]
            )
            rows = signal[segment] + config.feature_noise * rng.standard_normal(
                (len(t), config.dim)
            )
            (root / f"features_{stream}").mkdir(parents=True, exist_ok=True)
            np.save(root / f"features_{stream}" / f"{video_id}.npy", unit(rows).astype(np.float16))
        entries, segments = [], []
        for i, (verb, obj) in enumerate(topics):
            s = i * config.segment_seconds
            text = " ".join(
                rng.permutation([f"verb{verb}", f"object{obj}", *rng.choice(FILLER_WORDS, 3)])
            )
            shift = max(0.0, s + rng.normal(0.0, config.sigma)) if config.sigma else s
            entries.append((shift, shift + config.segment_seconds * 0.8, text))
            segments.append(
                {
                    "window": [s, s + config.segment_seconds],
                    "verb": verb,
                    "object": obj,
                    "text": text,
                }
            )
            for _ in range(rng.poisson(config.filler_rate)):
                f = s + rng.uniform(0, config.segment_seconds)
                entries.append((f, f + 2.0, " ".join(rng.choice(FILLER_WORDS, 4))))
        entries.sort()
        captions[video_id] = {
            "start": [round(e[0], 3) for e in entries],
            "end": [round(e[1], 3) for e in entries],
            "text": [e[2] for e in entries],
        }
        truth[video_id] = segments
    write_captions(captions, root / CAPTION_FILE[caption_format], caption_format)
    (root / "truth.json").write_text(json.dumps(truth))
    return truth


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--videos", type=int, default=120)
    parser.add_argument("--sigma", type=float, default=0.0, help="caption misalignment in seconds")
    parser.add_argument(
        "--dim", type=int, default=FEATURE_DIM, help="feature width per stream (real: 2048)"
    )
    parser.add_argument("--format", choices=tuple(CAPTION_FILE), default="json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = PlantedConfig(videos=args.videos, sigma=args.sigma, dim=args.dim, seed=args.seed)
    spec = {"builder": "howto100m_planted", "format": args.format, **asdict(config)}
    build_once(
        args.out, spec, lambda staging: {"videos": len(write_planted(staging, config, args.format))}
    )
    print(f"{args.out}: {args.videos} planted videos")


if __name__ == "__main__":
    main()
