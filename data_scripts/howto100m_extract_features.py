"""Extract HowTo100M-style per-video features: decode once, sample at fixed rates, encode with
frozen networks, write `<out>/features_2d/<id>.npy` and `<out>/features_3d/<id>.npy` (the layout
`gcbs_lib.data.howto100m.FeatureStore` reads).

    python data_scripts/howto100m_extract_features.py VIDEOS_DIR OUT [--device cuda]
    [--random-weights]

Decoding. One ffmpeg process per video (the binary bundled with the `imageio-ffmpeg` wheel, under a
time limit) resamples the video stream to 16 frames per second and scales every frame to 224×224 (no
aspect-preserving crop). A video of duration d seconds then gives:
  2D  ⌊d⌋ rows: the frames at t = 0, 1, 2, … s (1 per second) → ResNet-152 (ImageNet weights)
  without its
      classifier → [⌊d⌋, 2048];
  3D  ⌊1.5·d⌋ rows: 16-frame clips (1 s of video at 16 frames/s, frames at 112×112) starting every
  1/1.5 s, a clip
      running past the end repeating the last frame → R(2+1)D-18 (Kinetics-400 weights) without its
      classifier → [⌊1.5·d⌋, 512] (HowTo100M's own 3D features come from ResNeXt-101 and are 2048
      wide).
Rows are L2-normalised and stored as float16, each file written atomically.

The networks are torchvision's; their weights are downloaded where the network allows,
`--random-weights` builds them untrained (to test the pipeline offline). `extract_folder` takes any
two frozen torch modules with the same input shapes, so other encoders (and the tests' tiny ones)
plug in. Files that fail to decode (corrupt, empty, truncated, shorter than one second, or ffmpeg
past its time limit) are skipped and listed in `<out>/skipped.txt` (one `file<TAB>reason` per line);
videos already extracted are not redone, so a rerun retries only the skipped ones.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".avi", ".mov")
FPS_2D, FPS_3D = 1.0, 1.5  # feature rows per second of video
# the decoded frame rate; a 3D clip is 16 consecutive decoded frames (1 s)
DECODE_FPS, CLIP_FRAMES = 16, 16
SIZE_2D, SIZE_3D = 224, 112
MEAN_2D, STD_2D = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MEAN_3D, STD_3D = (0.43216, 0.394666, 0.37645), (0.22803, 0.22145, 0.216989)
TIMEOUT = 600.0  # seconds ffmpeg may take for one video


class DecodeError(RuntimeError):
    """A video ffmpeg cannot decode (in time), or one too short to give a feature row."""


def decode(path: Path, timeout: float = TIMEOUT) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode `path` once at 16 frames/s, 224×224: the 2D frames `[⌊d⌋, 224, 224, 3]` (one per
    second) and every frame downscaled for the 3D clips `[16·d, 112, 112, 3]`, both uint8. ffmpeg is
    killed after `timeout` seconds (a file that never ends, e.g. a pipe, cannot hang the run); any
    failure raises `DecodeError`."""
    import imageio_ffmpeg

    command = [
        imageio_ffmpeg.get_ffmpeg_exe(),
        "-v",
        "error",
        "-nostdin",
        "-i",
        str(path),
        "-an",
        "-sn",
        "-vf",
        f"fps={DECODE_FPS},scale={SIZE_2D}:{SIZE_2D}",
        "-f",
        "rawvideo",
        "-pix_fmt",
        "rgb24",
        "pipe:1",
    ]
    frame_bytes = SIZE_2D * SIZE_2D * 3
    frames_2d, frames_3d, count = [], [], 0
    # a file, not a pipe: ffmpeg's messages cannot fill a buffer and block
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=errors, stdin=subprocess.DEVNULL
        )
        timed_out = threading.Event()
        watchdog = threading.Timer(timeout, lambda: (timed_out.set(), process.kill()))
        watchdog.start()
        try:
            # one second of video at a time
            while chunk := process.stdout.read(frame_bytes * DECODE_FPS):
                whole = len(chunk) // frame_bytes * frame_bytes  # a cut-off last frame is dropped
                if whole:
                    frames = torch.frombuffer(bytearray(chunk[:whole]), dtype=torch.uint8).view(
                        -1, SIZE_2D, SIZE_2D, 3
                    )
                    # decoded frames 0, 16, 32, …
                    frames_2d.append(frames[-count % DECODE_FPS :: DECODE_FPS])
                    frames_3d.append(_resize(frames, SIZE_3D))
                    count += len(frames)
            process.wait()
        finally:
            watchdog.cancel()
            if process.poll() is None:  # stopped by an error on this side: stop ffmpeg too
                process.kill()
                process.wait()
            process.stdout.close()
        if timed_out.is_set():
            raise DecodeError(f"ffmpeg did not finish within {timeout:g} s")
        if process.returncode != 0:
            errors.seek(0)
            message = errors.read().decode(errors="replace").strip().splitlines()
            raise DecodeError(
                f"ffmpeg exit code {process.returncode}: {message[-1] if message else 'no message'}"
            )
    if count < DECODE_FPS:
        raise DecodeError(f"{count} frames decoded: shorter than one second, no feature row")
    return torch.cat(frames_2d)[: count // DECODE_FPS], torch.cat(frames_3d)


def _resize(frames: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 `[N, H, W, 3]` → uint8 `[N, size, size, 3]` (bilinear, antialiased)."""
    x = F.interpolate(
        frames.permute(0, 3, 1, 2).float(),
        size=(size, size),
        mode="bilinear",
        antialias=True,
        align_corners=False,
    )
    return x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)


def _normalise(frames: torch.Tensor, mean, std) -> torch.Tensor:
    """uint8 `[..., H, W, 3]` → float `[..., 3, H, W]` on the same device, each channel
    standardised."""
    x = frames.movedim(-1, -3).float() / 255
    mean, std = (torch.tensor(v, device=x.device)[:, None, None] for v in (mean, std))
    return (x - mean) / std


def clip_starts(frame_count: int) -> np.ndarray:
    """First decoded frame of each 3D clip: ⌊1.5·d⌋ clips, one every 1/1.5 s, for `frame_count`
    frames at 16/s."""
    starts = np.arange(int(frame_count / DECODE_FPS * FPS_3D)) / FPS_3D
    return (starts * DECODE_FPS).round().astype(int)


@torch.no_grad()
def encode(
    frames_2d: torch.Tensor,
    frames_3d: torch.Tensor,
    net_2d: nn.Module,
    net_3d: nn.Module,
    device: str | torch.device = "cpu",
    batch: int = 32,
) -> dict[str, np.ndarray]:
    """Feature rows of decoded frames: `{"2d": [⌊d⌋, width], "3d": [⌊1.5·d⌋, width]}`, float16, unit
    rows."""
    rows_2d = [
        net_2d(_normalise(frames_2d[i : i + batch].to(device), MEAN_2D, STD_2D)).float().cpu()
        for i in range(0, len(frames_2d), batch)
    ]
    starts, clips_per_batch = clip_starts(len(frames_3d)), max(1, batch // 4)
    rows_3d = []
    for i in range(0, len(starts), clips_per_batch):
        index = np.minimum(
            starts[i : i + clips_per_batch, None] + np.arange(CLIP_FRAMES), len(frames_3d) - 1
        )
        clips = frames_3d[torch.from_numpy(index)].to(device)  # [N, 16, H, W, 3] uint8
        # [N, 3, 16, H, W]
        rows_3d.append(net_3d(_normalise(clips, MEAN_3D, STD_3D).transpose(1, 2)).float().cpu())
    return {
        stream: F.normalize(torch.cat(rows), dim=1).half().numpy()
        for stream, rows in (("2d", rows_2d), ("3d", rows_3d))
    }


def _save_atomically(array: np.ndarray, target: Path) -> None:
    """np.save to a temporary file beside `target`, then rename: an interrupted run leaves no
    partial .npy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.stem}.tmp-{os.getpid()}.npy")
    try:
        np.save(temporary, array)
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def extract_folder(
    videos: str | Path,
    out: str | Path,
    net_2d: nn.Module,
    net_3d: nn.Module,
    device: str | torch.device = "cpu",
    timeout: float = TIMEOUT,
    batch: int = 32,
) -> dict[str, list]:
    """Extract every video file of `videos` into `out` (see the module docstring); writes
    `out/skipped.txt`. Returns `{"extracted": [...], "kept": [...], "skipped": [(file, reason),
    ...]}` (kept: already extracted)."""
    videos, out = Path(videos), Path(out)
    for net in (net_2d, net_3d):
        net.eval().requires_grad_(False).to(device)
    done = {"extracted": [], "kept": [], "skipped": []}
    for path in sorted(p for p in videos.iterdir() if p.suffix.lower() in VIDEO_SUFFIXES):
        targets = {s: out / f"features_{s}" / f"{path.stem}.npy" for s in ("2d", "3d")}
        if all(t.exists() for t in targets.values()):
            done["kept"].append(path.name)
            continue
        try:
            features = encode(*decode(path, timeout), net_2d, net_3d, device, batch)
        except DecodeError as error:
            done["skipped"].append((path.name, str(error)))
            continue
        for stream, target in targets.items():
            _save_atomically(features[stream], target)
        done["extracted"].append(path.name)
    out.mkdir(parents=True, exist_ok=True)
    (out / "skipped.txt").write_text(
        "".join(f"{name}\t{reason}\n" for name, reason in done["skipped"])
    )
    return done


def torchvision_encoders(random_weights: bool = False) -> tuple[nn.Module, nn.Module]:
    """torchvision's ResNet-152 (ImageNet) and R(2+1)D-18 (Kinetics-400) without their classifiers:
    2048 and 512 wide. Weights are downloaded (into torch's hub cache) unless `random_weights`."""
    try:
        from torchvision.models import ResNet152_Weights, resnet152
        from torchvision.models.video import R2Plus1D_18_Weights, r2plus1d_18
    except Exception as error:  # not installed, or a build that does not match this torch
        raise RuntimeError(
            f"the default encoders need torchvision built for torch {torch.__version__} "
            f"({type(error).__name__}: {error})"
        ) from error
    try:
        net_2d = resnet152(weights=None if random_weights else ResNet152_Weights.IMAGENET1K_V2)
        net_3d = r2plus1d_18(weights=None if random_weights else R2Plus1D_18_Weights.KINETICS400_V1)
    except OSError as error:  # URLError and friends: no network
        raise RuntimeError(
            f"could not fetch the pretrained weights ({error}); with no network, "
            f"--random-weights tests the pipeline with untrained networks"
        ) from error
    net_2d.fc, net_3d.fc = nn.Identity(), nn.Identity()
    return net_2d, net_3d


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "videos", type=Path, help="folder of video files (.mp4, .webm, .mkv, .avi, .mov)"
    )
    parser.add_argument(
        "out", type=Path, help="feature root: features_2d/, features_3d/, skipped.txt"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--random-weights", action="store_true", help="untrained networks (offline pipeline test)"
    )
    parser.add_argument(
        "--timeout", type=float, default=TIMEOUT, help="seconds ffmpeg may take per video"
    )
    parser.add_argument(
        "--batch", type=int, default=32, help="2D frames per forward pass (3D clips: a quarter)"
    )
    args = parser.parse_args(argv)
    done = extract_folder(
        args.videos,
        args.out,
        *torchvision_encoders(args.random_weights),
        args.device,
        args.timeout,
        args.batch,
    )
    print(
        f"{len(done['extracted'])} videos extracted, {len(done['kept'])} already there, "
        f"{len(done['skipped'])} "
        f"skipped (see {args.out / 'skipped.txt'})",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
