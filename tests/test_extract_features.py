"""Specification of `data_scripts/howto100m_extract_features.py` on real videos written with
imageio-ffmpeg's ffmpeg: a 3.5 s video at 8 frames/s whose frame i has background level 8·i (and a
moving square), a corrupt, an empty and a truncated file, and a pipe that never delivers a byte.
Tiny frozen random networks with the default encoders' output widths stand in for ResNet-152 /
R(2+1)D-18; torchvision's own are tried when it imports."""

import importlib.util
import os
from pathlib import Path

# pinned in requirements.txt: a missing install fails here rather than skipping the file
import imageio_ffmpeg
import numpy as np
import pytest
import torch
from torch import nn

from gcbs_lib.data.howto100m import FeatureStore

SCRIPT = Path(__file__).resolve().parents[1] / "data_scripts" / "howto100m_extract_features.py"
spec = importlib.util.spec_from_file_location("howto100m_extract_features", SCRIPT)
extractor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(extractor)

FRAMES, FPS = 28, 8  # 3.5 s: ⌊3.5⌋ = 3 rows of 2D features, ⌊1.5 · 3.5⌋ = 5 rows of 3D features


def write_video(path: Path) -> None:
    writer = imageio_ffmpeg.write_frames(str(path), (64, 48), fps=FPS, ffmpeg_log_level="error")
    writer.send(None)
    for i in range(FRAMES):
        frame = np.full((48, 64, 3), 8 * i, dtype=np.uint8)
        frame[16:32, 2 * i : 2 * i + 16] = 255  # a square moving right
        writer.send(frame.tobytes())
    writer.close()


def tiny_encoders() -> tuple[nn.Module, nn.Module]:
    """Random networks with the default encoders' output widths: 2D frames → 2048, 3D clips →
    512."""
    torch.manual_seed(0)
    net_2d = nn.Sequential(nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(3 * 16, 2048))
    net_3d = nn.Sequential(nn.AdaptiveAvgPool3d((2, 4, 4)), nn.Flatten(), nn.Linear(3 * 32, 512))
    return net_2d, net_3d


def source_frame(frames: torch.Tensor) -> list[int]:
    """Which source frame each decoded frame shows: its background level is 8·i (ffmpeg's colour
    round trip moves it by at most 2)."""
    return (frames[:, 2, 2, :].float().mean(1) / 8).round().long().tolist()


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("videos")
    write_video(folder / "good.mp4")
    (folder / "corrupt.mp4").write_bytes(
        np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    )
    (folder / "empty.mp4").write_bytes(b"")
    (folder / "truncated.mp4").write_bytes((folder / "good.mp4").read_bytes()[:1000])
    (folder / "notes.txt").write_text("not a video")
    return folder


@pytest.fixture(scope="module")
def extracted(videos, tmp_path_factory):
    out = tmp_path_factory.mktemp("features")
    return out, extractor.extract_folder(videos, out, *tiny_encoders(), timeout=60)


def test_decoding_samples_one_frame_per_second_for_2d_and_16_per_second_for_3d(videos):
    frames_2d, frames_3d = extractor.decode(videos / "good.mp4")
    assert frames_2d.shape == (3, 224, 224, 3) and frames_3d.shape == (56, 112, 112, 3)
    assert frames_2d.dtype == frames_3d.dtype == torch.uint8
    assert source_frame(frames_2d) == [0, 8, 16]  # t = 0, 1, 2 s at 8 frames/s
    # 16 frames/s from 8: each frame twice
    assert source_frame(frames_3d) == [j // 2 for j in range(56)]
    assert extractor.clip_starts(56).tolist() == [0, 11, 21, 32, 43]  # every 1/1.5 s at 16 frames/s


def test_a_video_gives_unit_float16_rows_at_1_and_1_5_per_second(extracted):
    out, done = extracted
    assert done["extracted"] == ["good.mp4"]
    rows_2d, rows_3d = (
        np.load(out / "features_2d" / "good.npy"),
        np.load(out / "features_3d" / "good.npy"),
    )
    assert rows_2d.shape == (3, 2048) and rows_3d.shape == (5, 512)
    assert rows_2d.dtype == rows_3d.dtype == np.float16
    for rows in (rows_2d, rows_3d):
        np.testing.assert_allclose(np.linalg.norm(rows.astype(np.float32), axis=1), 1.0, atol=2e-3)
        assert len({r.tobytes() for r in rows}) == len(rows)  # each row saw other frames


def test_undecodable_files_are_listed_in_the_skip_list_not_fatal(extracted):
    out, done = extracted
    assert [name for name, _ in done["skipped"]] == ["corrupt.mp4", "empty.mp4", "truncated.mp4"]
    lines = (out / "skipped.txt").read_text().splitlines()
    assert [line.split("\t")[0] for line in lines] == ["corrupt.mp4", "empty.mp4", "truncated.mp4"]
    assert all("ffmpeg exit code" in line for line in lines)
    assert sorted(p.name for p in (out / "features_2d").iterdir()) == ["good.npy"]


def test_a_file_that_never_ends_is_stopped_by_the_timeout(tmp_path):
    folder = tmp_path / "videos"
    folder.mkdir()
    os.mkfifo(folder / "stalled.mp4")  # ffmpeg waits for a writer that never comes
    done = extractor.extract_folder(folder, tmp_path / "out", *tiny_encoders(), timeout=0.5)
    assert done["skipped"] == [("stalled.mp4", "ffmpeg did not finish within 0.5 s")]


def test_a_rerun_keeps_what_was_extracted_and_retries_only_the_skipped(videos, extracted):
    out, _ = extracted
    written = {p: p.stat().st_mtime_ns for p in out.glob("features_*/*.npy")}
    done = extractor.extract_folder(videos, out, *tiny_encoders(), timeout=60)
    assert done["kept"] == ["good.mp4"] and done["extracted"] == [] and len(done["skipped"]) == 3
    assert {p: p.stat().st_mtime_ns for p in out.glob("features_*/*.npy")} == written


def test_the_feature_store_reads_the_output(extracted):
    out, _ = extracted
    store = FeatureStore(out)
    loaded = store.load("good")
    assert {k: v.shape for k, v in loaded.items()} == {"2d": (3, 2048), "3d": (5, 512)}
    assert store.load("corrupt") is None and "corrupt" in store.skipped


def test_torchvision_encoders_have_the_documented_widths():
    try:
        import torchvision  # noqa: F401
    except Exception as error:  # not installed, or a CUDA build beside a CPU torch
        pytest.skip(
            f"torchvision cannot be imported here ({type(error).__name__}: {error}); the "
            "pipeline is "
            f"tested with tiny networks of the same widths"
        )
    net_2d, net_3d = extractor.torchvision_encoders(random_weights=True)
    with torch.no_grad():
        assert net_2d.eval()(torch.zeros(1, 3, 224, 224)).shape == (1, 2048)
        assert net_3d.eval()(torch.zeros(1, 3, 16, 112, 112)).shape == (1, 512)
