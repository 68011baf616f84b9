"""Extract HowTo100M-style per-video features with torchvision video models: decode once, sample at a fixed
rate, encode with frozen networks, write `<out>/features_2d/<id>.npy` and `<out>/features_3d/<id>.npy`.

    python data_scripts/howto100m_extract_features.py VIDEOS_DIR OUT [--device cuda] [--random-weights]

2D: one frame per second → ResNet-152 (ImageNet weights) without its classifier → [T, 2048].
3D: 16-frame clips (at 16 frames/s of video time, resized to 112) starting every 1/1.5 s → R(2+1)D-18
(Kinetics-400 weights) without its classifier → [T', 512]. Rows are L2-normalised and stored as float16.
Weights are downloaded by torchvision where the network allows; `--random-weights` builds the same networks
untrained (to test the pipeline offline). Files that fail to decode are skipped and listed in
`<out>/skipped.txt` (one `video<TAB>reason` per line); videos already extracted are not redone.

UNTESTED on the machine that built the kit: torchvision from PyPI does not import beside torch 2.13.0 there.
"""
import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".avi", ".mov")
FPS_2D, FPS_3D, CLIP_FRAMES = 1.0, 1.5, 16
MEAN_2D, STD_2D = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MEAN_3D, STD_3D = (0.43216, 0.394666, 0.37645), (0.22803, 0.22145, 0.216989)


def sample_times(duration: float, rate: float) -> np.ndarray:
    """Start times (seconds) of samples taken `rate` times per second over a video of `duration` seconds."""
    return np.arange(int(duration * rate)) / rate


def decode(path: Path) -> tuple[torch.Tensor, float]:
    """All frames `[F, H, W, 3]` uint8 and the frame rate (torchvision.io; raises on undecodable files)."""
    from torchvision.io import read_video

    frames, _, info = read_video(str(path), pts_unit="sec", output_format="THWC")
    if frames.shape[0] == 0 or "video_fps" not in info:
        raise ValueError("no decodable video frames")
    return frames, float(info["video_fps"])


def frames_at(frames: torch.Tensor, fps: float, times: np.ndarray) -> torch.Tensor:
    index = np.minimum((times * fps).astype(int), frames.shape[0] - 1)
    return frames[torch.from_numpy(index)]


def prepare(frames: torch.Tensor, size: int, mean, std) -> torch.Tensor:
    """uint8 [N, H, W, 3] → float [N, 3, size, size], normalised."""
    x = frames.permute(0, 3, 1, 2).float() / 255
    x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return (x - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]


def networks(random_weights: bool, device: str):
    from torchvision.models import ResNet152_Weights, resnet152
    from torchvision.models.video import R2Plus1D_18_Weights, r2plus1d_18

    net_2d = resnet152(weights=None if random_weights else ResNet152_Weights.IMAGENET1K_V2)
    net_3d = r2plus1d_18(weights=None if random_weights else R2Plus1D_18_Weights.KINETICS400_V1)
    net_2d.fc, net_3d.fc = torch.nn.Identity(), torch.nn.Identity()
    return net_2d.eval().to(device), net_3d.eval().to(device)


@torch.no_grad()
def extract(path: Path, net_2d, net_3d, device: str, batch: int = 32) -> dict[str, np.ndarray]:
    frames, fps = decode(path)
    duration = frames.shape[0] / fps
    images = prepare(frames_at(frames, fps, sample_times(duration, FPS_2D)), 224, MEAN_2D, STD_2D)
    rows_2d = torch.cat([net_2d(images[i:i + batch].to(device)).cpu() for i in range(0, len(images), batch)])
    starts = sample_times(duration, FPS_3D)  # clips running past the end repeat the last frame
    clips = torch.stack([prepare(frames_at(frames, fps, s + np.arange(CLIP_FRAMES) / 16), 112, MEAN_3D, STD_3D)
                         for s in starts]).permute(0, 2, 1, 3, 4)  # [N, 3, 16, 112, 112]
    rows_3d = torch.cat([net_3d(clips[i:i + batch // 4].to(device)).cpu() for i in range(0, len(clips), batch // 4)])
    return {"2d": F.normalize(rows_2d, dim=1).half().numpy(), "3d": F.normalize(rows_3d, dim=1).half().numpy()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("videos", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--random-weights", action="store_true")
    args = parser.parse_args(argv)
    net_2d, net_3d = networks(args.random_weights, args.device)
    skipped = []
    for path in sorted(p for p in args.videos.iterdir() if p.suffix.lower() in VIDEO_SUFFIXES):
        targets = {s: args.out / f"features_{s}" / f"{path.stem}.npy" for s in ("2d", "3d")}
        if all(t.exists() for t in targets.values()):
            continue
        try:
            features = extract(path, net_2d, net_3d, args.device)
        except Exception as error:  # undecodable or broken file: list it and go on
            skipped.append(f"{path.name}\t{type(error).__name__}: {error}")
            continue
        for stream, target in targets.items():
            target.parent.mkdir(parents=True, exist_ok=True)
            np.save(target, features[stream])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "skipped.txt").write_text("".join(line + "\n" for line in skipped))
    print(f"done; {len(skipped)} videos skipped (see {args.out / 'skipped.txt'})", file=sys.stderr)


if __name__ == "__main__":
    main()
