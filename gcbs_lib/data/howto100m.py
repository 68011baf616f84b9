"""HowTo100M for MIL-NCE: captions, per-video features `features_2d/<video_id>.npy` [T, 2048]
float16 at 1 row/s and `features_3d/` at 1.5 rows/s, and bags of neighbouring captions as
memory-mapped index arrays (batch features are pooled from the memory-mapped video files). Stand-ins
in this layout: `data_scripts/howto100m_planted.py`, `howto100m_standin.py`."""

import csv
import functools
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from gcbs_lib.check import require
from gcbs_lib.data import PlainUnpickler

FPS = {"2d": 1.0, "3d": 1.5}  # feature rows per second of each stream
MIN_TIME = 5.0  # the MIL-NCE loader widens shorter clip windows to this many seconds


def read_csv_captions(path: Path) -> dict[str, list]:
    """One video's caption columns from its `<video_id>.csv`, unchecked (see `plain_captions`)."""
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
    return {key: [row[key] for row in rows] for key in reader.fieldnames or ()}


def plain_captions(video_id: str, entry) -> dict[str, list]:
    """One video's captions as lists (float start, float end, str text), checked."""
    where = f"video {video_id!r}"
    keys = isinstance(entry, Mapping) and {"start", "end", "text"} <= set(entry)
    require(keys, f"captions of {where} need the keys (columns) start,end,text")
    columns = [entry[key] for key in ("start", "end", "text")]
    lists = all(isinstance(c, Iterable) and not isinstance(c, (str, bytes)) for c in columns)
    require(lists, f"{where}: start, end and text are each a list of one item per caption")
    start, end, text = map(list, columns)
    counts = f"{len(start)} starts, {len(end)} ends and {len(text)} texts"
    require(len(start) == len(end) == len(text), f"{where}: {counts}")
    start, end = [float(s) for s in start], [float(e) for e in end]
    ordered = all(math.isfinite(s) and math.isfinite(e) and s <= e for s, e in zip(start, end))
    require(ordered, f"{where}: caption times must be finite with start <= end")
    return {"start": start, "end": end, "text": ["" if t is None else str(t) for t in text]}


def read_captions(path: str | Path, skipped: dict | None = None) -> dict[str, dict[str, list]]:
    """`{video_id: {"start": [...], "end": [...], "text": [...]}}` (seconds) from `caption.json`,
    `caption.pickle` (by `PlainUnpickler`: unpickling could run code) or a folder of
    `<video_id>.csv` (start,end,text). Bad captions raise, or are noted in `skipped` if given."""
    path = Path(path)
    if path.is_dir():  # each file read below, where a bad one is skipped
        raw = {p.stem: p for p in sorted(path.glob("*.csv"))}
    elif path.suffix in (".json", ".pickle", ".pkl"):
        with open(path, "rb") as handle:
            raw = json.load(handle) if path.suffix == ".json" else PlainUnpickler(handle).load()
    else:
        raise ValueError(
            f"{path}: expected caption.json, caption.pickle or a directory of <video_id>.csv"
        )
    require(isinstance(raw, Mapping), f"{path}: not a map of video ids to {{start, end, text}}")
    require(raw, f"{path}: no captions")
    captions = {}
    for key, entry in raw.items():
        try:
            entry = read_csv_captions(entry) if path.is_dir() else entry
            captions[str(key)] = plain_captions(str(key), entry)
        except (ValueError, TypeError, csv.Error) as error:  # a UnicodeDecodeError is a ValueError
            if skipped is None:
                raise
            skipped[str(key)] = f"captions: {type(error).__name__}: {error}"
    return captions


def caption_path(root: str | Path) -> Path:
    """The captions under a data root: the first of caption.json, caption.pickle, captions/."""
    for name in ("caption.json", "caption.pickle", "captions"):
        if (Path(root) / name).exists():
            return Path(root) / name
    raise FileNotFoundError(
        f"{root}: no caption.json, caption.pickle or captions/ directory "
        "(see data_scripts/howto100m_download.md)"
    )


class FeatureStore:
    """Per-video features `root/features_<stream>/<video_id>.npy`. `load(video_id)`: the checked
    {stream: [T, width] memory map}, or None with the reason in `skipped` (missing, truncated or
    corrupt, not [T > 0, the first video's width], NaN/inf); `open` maps one (cached)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.widths = {}  # each stream's, from the first video
        self.skipped = {}  # video id: why
        self.open = functools.lru_cache(maxsize=4096)(self._map)

    def _map(self, video: str) -> dict[str, np.ndarray]:
        return {s: np.load(self.root / f"features_{s}/{video}.npy", mmap_mode="r") for s in FPS}

    def load(self, video_id: str) -> dict[str, np.ndarray] | None:
        try:
            streams = self.open(video_id)
            for stream, rows in streams.items():
                if rows.ndim == 2 and len(rows):  # the first video's width: every video's
                    self.widths.setdefault(stream, rows.shape[1])
                width = self.widths.get(stream, "W")
                shaped = rows.ndim == 2 and len(rows) and rows.shape[1] == width
                require(shaped, f"{stream} has shape {rows.shape}, not [T > 0, {width}]")
                require(np.isfinite(rows).all(), f"{stream} holds NaN or inf")
        except (OSError, ValueError, EOFError) as error:
            self.skipped[video_id] = f"{type(error).__name__}: {error}"
            return None
        return streams


def clip_features(streams: Mapping, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Clip features `[M, Σ widths]` float32 of {stream: rows} for windows `[M, 2]` (seconds), and
    whether each clip has rows in every stream (none past a stream's end: zeros, as HowTo100M's)."""
    windows = np.asarray(windows, dtype=np.float64).reshape(-1, 2)
    parts, present = [], np.ones(len(windows), dtype=bool)
    for stream, rows in streams.items():
        pooled = np.zeros((len(windows), rows.shape[1]), dtype=np.float32)
        for m, (s, e) in enumerate(windows):
            window = rows[int(s * FPS[stream]) : int(e * FPS[stream]) + 1]
            present[m] &= len(window) > 0
            pooled[m] = window.max(axis=0) if len(window) else 0
        parts.append(pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12))
    return np.concatenate(parts, axis=1), present


def features_of(store: FeatureStore, clips: Mapping, rows: np.ndarray) -> np.ndarray:
    """Features `[len(rows), F]` of clips `rows` of `clips` (video_ids, clip_video, clip_window)."""
    video, window = np.asarray(clips["clip_video"][rows]), np.asarray(clips["clip_window"][rows])
    pooled = [
        clip_features(store.open(str(clips["video_ids"][v])), window[video == v])[0]
        for v in np.unique(video)
    ]
    return np.concatenate(pooled)[np.argsort(np.argsort(video, kind="stable"))]  # back in order


def nearest_bag(start: np.ndarray, end: np.ndarray, anchor: int, k: int) -> int:
    """First of the K consecutive captions around `anchor` (MIL-NCE's `_find_nearest_candidates`):
    grow toward the neighbour keeping end − start shorter (a tie: later); at an edge, the other."""
    first = last = anchor
    while last - first + 1 < min(k, len(start)):
        left = end[last] - start[first - 1] if first > 0 else math.inf
        right = end[last + 1] - start[first] if last < len(start) - 1 else math.inf
        first, last = (first - 1, last) if left < right else (first, last + 1)
    return first


def widen(start: float, end: float, min_time: float) -> tuple[float, float]:
    """A window widened evenly to `min_time` seconds (not before 0), as the MIL-NCE loader does."""
    if end - start >= min_time:
        return start, end
    start = max(0.0, start - (min_time - end + start) / 2)
    return start, start + min_time


def _padded(rows: list[list[int]], width: int = 1) -> np.ndarray:
    width = max([width] + [len(r) for r in rows])
    padded = [[*r] + [-1] * (width - len(r)) for r in rows]
    return np.array(padded, dtype=np.int64).reshape(len(rows), width)


def build_bags(
    captions, store: FeatureStore, k: int, video_ids=None, clip_windows=None, min_time=MIN_TIME
) -> dict[str, np.ndarray]:
    """Bags of `k` of the `captions` for the clips of `video_ids` (default all): a clip per caption,
    widened to `min_time` (the MIL-NCE sampling), or each video's `clip_windows`, anchored at the
    caption nearest its middle; videos `store.load` refuses are skipped. Arrays: video_ids [V],
    caption_text [C] (UTF-8), clip_video [M], clip_window [M, 2], anchor [M], bag_idx [M, k],
    exclude_idx [M, E] (-1 pads)."""
    require(k >= 1, f"a bag needs at least one caption, got k={k}")
    ids, texts, clips = [], [], []
    for video_id in sorted(captions) if video_ids is None else video_ids:
        streams = store.load(video_id)
        entry = captions[video_id]
        if streams is None:
            continue
        v, offset = len(ids), len(texts)  # this video's index, and its first caption's
        start, end = np.asarray(entry["start"]), np.asarray(entry["end"])
        if clip_windows is None:
            windows = [widen(s, e, min_time) for s, e in zip(start, end)]
            anchors = range(len(start))
        else:
            windows = [tuple(w) for w in clip_windows.get(video_id, [])]
            anchors = [int(np.abs((start + end) / 2 - (s + e) / 2).argmin()) for s, e in windows]
        ids.append(video_id)
        texts += [text.encode() for text in entry["text"]]
        present = clip_features(streams, np.array(windows))[1]  # feature rows in every stream
        for (s, e), a, has_rows in zip(windows, anchors, present):
            first = nearest_bag(start, end, a, k)
            bag = range(first, first + min(k, len(start)))
            exclude = [offset + j for j in np.flatnonzero((start < e) & (end > s)) if j not in bag]
            if has_rows:
                clips.append((v, (s, e), offset + a, [offset + j for j in bag], exclude))
    skipped = dict(list(store.skipped.items())[:5])
    require(clips, f"no usable clips among the videos; skipped: {skipped}")
    video, window, anchor, bag, exclude = zip(*clips)
    return {
        "video_ids": np.array(ids),
        "caption_text": np.array(texts, dtype=bytes),
        "clip_video": np.array(video),
        "clip_window": np.array(window, dtype=np.float64),
        "anchor": np.array(anchor),
        "bag_idx": _padded(bag, k),
        "exclude_idx": _padded(exclude),
    }


def save_arrays(arrays: Mapping[str, np.ndarray], folder: str | Path) -> Path:
    """Each array as a plain `folder/<name>.npy` (no pickles), for `open_arrays` to memory-map."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        np.save(Path(folder) / f"{name}.npy", np.asarray(array), allow_pickle=False)
    return Path(folder)


def open_arrays(folder: str | Path) -> dict[str, np.ndarray]:
    paths = sorted(Path(folder).glob("*.npy"))
    return {p.stem: np.load(p, mmap_mode="r", allow_pickle=False) for p in paths}
