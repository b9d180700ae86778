"""The reference loader: plain PyTorch + PyAV + NumPy, the same tensors as the DALI pipelines.
For machines without DALI, and the independent reference in tests.

A sample = one clip of T frames at a random start (temporal jitter) of a prepared video, with
the log-mel segment aligned to it (data_dali/audio.py), augmented like the paper: random
resized crop to S, horizontal flip, random grayscale, normalisation; layout C x T x H x W.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from .audio import mel_segment
from .manifest import Manifest

MEAN = (0.45, 0.45, 0.45)  # per-channel, on [0, 1] pixels
STD = (0.225, 0.225, 0.225)


def decode_clip(path: str | Path, start: int, frames: int, fps: float | None = None) -> np.ndarray:
    """Frames [start, start + frames) of a prepared (constant-rate) video as [T, H, W, 3] uint8;
    the last frame repeats if the video is shorter (as DALI's pad_mode="edge"). Deep starts
    seek to the keyframe before them (prepared clips have one per second) instead of decoding
    from the beginning; frame k of a prepared clip is presented at k / fps."""
    import av

    out = []
    with av.open(str(path)) as c:
        vs = c.streams.video[0]
        rate = float(fps or vs.average_rate or 0)
        seek = rate > 0 and start > 2 * rate and vs.time_base is not None
        if seek:
            c.seek(int((start - 0.5) / rate / vs.time_base), stream=vs, backward=True)
        for i, f in enumerate(c.decode(vs)):
            k = int(round(f.time * rate)) if seek and f.pts is not None else i
            if k >= start:
                out.append(f.to_ndarray(format="rgb24"))
            if len(out) == frames:
                break
    if not out:
        raise ValueError(f"{path}: no frames at or after frame {start}; the manifest's frame count "
                         "is wrong for this file: re-run `python -m data_dali.prepare`")
    while len(out) < frames:
        out.append(out[-1])
    return np.stack(out)


def crop_box(h, w, rng: np.random.Generator | None, scale=(0.3, 1.0), ratio=(3 / 4, 4 / 3)):
    """(top, left, height, width) of a random resized crop (torchvision's rule), or the centre
    square when rng is None."""
    if rng is None:
        s = min(h, w)
        return (h - s) // 2, (w - s) // 2, s, s
    area = h * w
    for _ in range(10):
        target = area * rng.uniform(*scale)
        logr = rng.uniform(math.log(ratio[0]), math.log(ratio[1]))
        ar = math.exp(logr)
        cw, ch = int(round(math.sqrt(target * ar))), int(round(math.sqrt(target / ar)))
        if 0 < cw <= w and 0 < ch <= h:
            return int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw
    s = min(h, w)
    return (h - s) // 2, (w - s) // 2, s, s


def augment(frames: np.ndarray, size: int, rng: np.random.Generator | None, *,
            gray_p=0.2, dtype=torch.float32):
    """[T, H, W, 3] uint8 → [3, T, size, size] normalised. rng None: centre crop, no flip."""
    import torch.nn.functional as F

    t, h, w, _ = frames.shape
    top, left, ch, cw = crop_box(h, w, rng)
    x = torch.from_numpy(frames[:, top:top + ch, left:left + cw]).permute(0, 3, 1, 2).float() / 255
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
    if rng is not None and rng.random() < 0.5:
        x = x.flip(-1)
    if rng is not None and rng.random() < gray_p:
        g = (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2])[:, None]
        x = g.expand(-1, 3, -1, -1)
    mean = torch.tensor(MEAN)[None, :, None, None]
    std = torch.tensor(STD)[None, :, None, None]
    return ((x - mean) / std).permute(1, 0, 2, 3).contiguous().to(dtype)  # [3, T, S, S]


class ClipDataset(torch.utils.data.Dataset):
    """Dataset over manifest rows ``index`` (dataset indices). Item i of epoch e draws its
    start frame and augmentation from a generator seeded by (seed, e, dataset index)."""

    def __init__(self, manifest: Manifest, index, *, clip_frames=16, crop=112, views=1,
                 train=True, seed=0, need_audio=True, start=None, dtype=torch.float32,
                 temporal_jitter=None, need_video=True):
        """train: random start + augmentation; train=False: the centre clip, centre crop, unless
        ``temporal_jitter`` (test-time multi-clip: random start, still centre crop, no flip)."""
        self.m, self.index = manifest, list(index)
        self.jitter = train if temporal_jitter is None else temporal_jitter
        self.t, self.s, self.views, self.train = clip_frames, crop, views, train
        self.seed, self.epoch, self.need_audio, self.start, self.dtype = seed, 0, need_audio, start, dtype
        self.need_video = need_video

    def __len__(self):
        return len(self.index)

    def sample(self, i: int, rng, start: int | None = None):
        row = self.m.rows[i]
        n = int(row["frames"]) or int(float(row["duration"]) * float(row["fps"]))  # audio-only: by duration
        if start is None:
            start = int(rng.integers(0, max(1, n - self.t + 1))) if rng is not None else max(0, (n - self.t) // 2)
        out = {}
        if row["video"] and self.need_video:
            out["video"] = augment(decode_clip(row["video"], start, self.t, float(row["fps"])),
                                   self.s, rng if self.train else None, dtype=self.dtype)
        if self.need_audio:
            out["audio"] = torch.from_numpy(
                mel_segment(self.m.mel(i), start, self.t, float(row["fps"]))).to(self.dtype)
        out["start"] = start
        return out

    def __getitem__(self, k):
        i = self.index[k]
        rng = np.random.default_rng([self.seed, self.epoch, i]) if (self.train or self.jitter) else None
        out = self.sample(i, rng, self.start)
        if self.views == 2:
            second = self.sample(i, rng if rng is not None else np.random.default_rng([self.seed, i]))
            out["video2"], out["audio2"] = second.get("video"), second.get("audio")
            out["start2"] = second["start"]
        out["index"] = i
        out["label"] = int(self.m.rows[i]["label"])
        return {k: v for k, v in out.items() if v is not None}
