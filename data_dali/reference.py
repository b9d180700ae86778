"""The reference loader: plain PyTorch + PyAV + NumPy, the same tensors as the DALI pipelines.
For machines without DALI, and the independent reference in tests.

A sample = one clip of T frames at a random start (temporal jitter) of a prepared video, with
the log-mel segment aligned to it (data_dali/audio.py), augmented like the paper: random
resized crop to S, horizontal flip, random grayscale, normalisation; layout C x T x H x W.
Every random choice comes from the augmentation law (data_dali/augment.py), as in the DALI
pipelines.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from .audio import mel_segment
from .augment import PAPER, ClipParams, crop_box, draw_row
from .cli import first_line
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


def augment(frames: np.ndarray, size: int, params: ClipParams | None, *, dtype=torch.float32):
    """[T, H, W, 3] uint8 → [3, T, size, size] normalised: crop ``params``' box (clipped to the
    frame), resize (bilinear, antialiased), flip, grayscale (0.299/0.587/0.114). params None:
    centre square, no flip."""
    import torch.nn.functional as F

    t, h, w, _ = frames.shape
    if params is None:
        top, left, ch, cw = crop_box(h, w, None)
        flip = gray = False
    else:
        top, left = min(params.top, h - 1), min(params.left, w - 1)
        ch, cw = min(params.crop_h, h - top), min(params.crop_w, w - left)
        flip, gray = params.flip, params.gray
    x = torch.from_numpy(frames[:, top:top + ch, left:left + cw]).permute(0, 3, 1, 2).float() / 255
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
    if flip:
        x = x.flip(-1)
    if gray:
        g = (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2])[:, None]
        x = g.expand(-1, 3, -1, -1)
    mean = torch.tensor(MEAN)[None, :, None, None]
    std = torch.tensor(STD)[None, :, None, None]
    return ((x - mean) / std).permute(1, 0, 2, 3).contiguous().to(dtype)  # [3, T, S, S]


class ClipDataset(torch.utils.data.Dataset):
    """Dataset over manifest rows ``index`` (dataset indices). Item k of epoch e is clip
    index[k] with each view's start frame and augmentation from the law (data_dali/augment.py:
    ``draw(seed, e, index[k], view)``). Keys: k (epoch ``self.epoch``) or (k, e) — how the
    loader's persistent workers learn the epoch."""

    def __init__(self, manifest: Manifest, index, *, clip_frames=16, crop=112, views=1,
                 train=True, seed=0, need_audio=True, start=None, dtype=torch.float32,
                 temporal_jitter=None, need_video=True, bad=None, aug=PAPER):
        """train: random start + augmentation; train=False: the centre clip, centre crop, unless
        ``temporal_jitter`` (test-time multi-clip: random start, still centre crop, no flip).
        ``start``: force the first view's start frame. ``bad`` (data_dali.damaged.BadClips):
        a damaged clip is replaced, and the item lists it under "bad" [(index, reason)].
        ``aug``: the training augmentations that run (data_dali.augment.Augment)."""
        self.m, self.index = manifest, list(index)
        self.jitter = train if temporal_jitter is None else temporal_jitter
        self.t, self.s, self.views, self.train = clip_frames, crop, views, train
        self.seed, self.epoch, self.need_audio, self.start, self.dtype = seed, 0, need_audio, start, dtype
        self.need_video, self.bad, self.aug = need_video, bad, aug

    def __len__(self):
        return len(self.index)

    def params(self, i: int, view: int, epoch: int) -> ClipParams:
        """The law's draw for view ``view`` of dataset clip ``i`` in ``epoch``."""
        p = draw_row(self.m.rows[i], i, view, seed=self.seed, epoch=epoch, clip_frames=self.t,
                     train=self.train, jitter=self.jitter, aug=self.aug)
        return replace(p, start=self.start) if view == 0 and self.start is not None else p

    def sample(self, i: int, p: ClipParams) -> dict:
        """One view of dataset clip ``i``: "video", "audio" (as needed), "params" int [7]."""
        row = self.m.rows[i]
        out = {}
        if row["video"] and self.need_video:
            out["video"] = augment(decode_clip(row["video"], p.start, self.t, float(row["fps"])),
                                   self.s, p, dtype=self.dtype)
        if self.need_audio:
            out["audio"] = torch.from_numpy(
                mel_segment(self.m.mel(i), p.start, self.t, float(row["fps"]))).to(self.dtype)
        out["params"] = torch.from_numpy(p.array()).long()
        return out

    def __getitem__(self, key):
        k, epoch = key if isinstance(key, tuple) else (key, self.epoch)
        i = self.index[k]
        if self.bad is None:
            return self._item(i, epoch)
        damaged, attempt = [], 0
        while True:  # each turn finds one more damaged clip (TooManyBadClips: every clip is)
            reason = self.bad.check(i)
            if reason is None:
                try:
                    return dict(self._item(i, epoch), bad=damaged)
                except Exception as e:  # noqa: BLE001 - PyAV/NumPy on a damaged file
                    reason = f"cannot decode ({first_line(e, 160)})"
                    self.bad.mark(i, reason)
            damaged.append((i, reason))
            i = self.bad.replacement(i, epoch, attempt)
            attempt += 1

    def _item(self, i: int, epoch: int) -> dict:
        out = {"index": i, "label": int(self.m.rows[i]["label"])}
        for v in range(self.views):
            sfx = "" if v == 0 else str(v + 1)
            view = self.sample(i, self.params(i, v, epoch))
            out.update({name + sfx: x for name, x in view.items()})
            out["start" + sfx] = int(view["params"][0])
        return out
