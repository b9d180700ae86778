"""DALI pipelines: decode and augment prepared clips on the device, log-mels aligned.

VP9 decode (NVDEC with device cuda, libavcodec with CPU operators), random resized crop, flip,
grayscale and normalisation on the device, layout C x T x H x W; the log-mel segment aligned
with the decoded frames travels with each clip.

One pipeline per use, all built from the same video branch:
- ``pretrain_pipeline``  video + aligned log-mel (views=2: a second, independent view of both)
- ``video_pipeline``     downstream video (no audio)
- ``audio_pipeline``     downstream audio: log-mel segments only (nothing to decode)

Sampling happens on the host, in ``ClipSource``: the start frame, crop box, flip and grayscale
of every sample are drawn from a generator seeded by (seed, epoch, dataset index) — the same
draws, in the same order, as the reference loader (data_dali/reference.py) — and handed to the
decoder (``start_frame``) and the augmentation operators as per-sample arguments. So the video
clip and its log-mel segment are aligned by construction (mel frames
[round(100 s / fps), + round(100 T / fps)) for start frame s; data_dali/audio.py), the two
loaders agree sample for sample, and a clip's augmentation does not depend on how the epoch is
sharded. Sharding and the epoch order are the loader's (data_dali/loader.py).

This module imports DALI at import time; import it only through ``data_dali.loader``.
"""

from __future__ import annotations

import numpy as np
import torch
from nvidia.dali import fn, pipeline_def, types

from .audio import mel_segment
from .reference import MEAN, STD, crop_box


def check_available(device: torch.device) -> None:
    """Raise with the reason if DALI cannot run here."""
    from nvidia.dali.plugin.pytorch import DALIGenericIterator  # noqa: F401

    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device cuda requested but CUDA is not available")


# ----------------------------------------------------------------------------------------------
# Graph pieces
# ----------------------------------------------------------------------------------------------
def _video_branch(enc, start, roi_start, roi_end, mirror, saturation, *, clip_frames, crop, gpu,
                  dtype):
    """encoded VP9/WebM bytes → [3, T, crop, crop] normalised (CFHW)."""
    frames = fn.decoders.video(enc, device="mixed" if gpu else "cpu", start_frame=start,
                               sequence_length=clip_frames, pad_mode="edge")  # [T, H, W, 3] u8
    frames = fn.resize(frames, roi_start=roi_start, roi_end=roi_end, roi_relative=False,
                       size=[crop, crop], interp_type=types.INTERP_LINEAR, antialias=True)
    frames = fn.hsv(frames, saturation=saturation)  # saturation 0 = grayscale (0.299/0.587/0.114)
    return fn.crop_mirror_normalize(frames, mirror=mirror, dtype=dtype,
                                    mean=[255 * m for m in MEAN], std=[255 * s for s in STD],
                                    output_layout="CFHW")


_VIEW_TYPES = [types.UINT8, types.INT32, types.FLOAT, types.FLOAT, types.INT32, types.FLOAT]


def _inputs(source, views, with_video, with_audio):
    """External source → (index, label, [per-view dicts])."""
    per_view = (6 if with_video else 1) + int(with_audio)
    dtypes = [types.INT64, types.INT64]
    for _ in range(views):
        dtypes += (_VIEW_TYPES if with_video else [types.INT32]) + ([types.FLOAT] if with_audio else [])
    outs = fn.external_source(source=source, num_outputs=len(dtypes), batch=True, dtype=dtypes)
    index, label, rest = outs[0], outs[1], list(outs[2:])
    views_out = []
    for v in range(views):
        cols = rest[v * per_view:(v + 1) * per_view]
        d = {}
        if with_video:
            d.update(zip(("enc", "start", "roi_start", "roi_end", "mirror", "saturation"), cols[:6]))
        else:
            d["start"] = cols[0]
        if with_audio:
            d["mel"] = cols[-1]
        views_out.append(d)
    return index, label, views_out


def _graph(source, *, views, with_video, with_audio, clip_frames, crop, gpu, dtype):
    index, label, vs = _inputs(source, views, with_video, with_audio)
    outs = [index, label]
    for d in vs:
        outs.append(d["start"])
        if with_video:
            outs.append(_video_branch(d["enc"], d["start"], d["roi_start"], d["roi_end"], d["mirror"],
                                      d["saturation"], clip_frames=clip_frames, crop=crop, gpu=gpu,
                                      dtype=dtype))
        if with_audio:
            outs.append(d["mel"].gpu() if gpu else d["mel"])
    return tuple(outs)


@pipeline_def(exec_dynamic=True)
def pretrain_pipeline(source, *, views=1, clip_frames=16, crop=112, gpu=False, dtype=types.FLOAT):
    """Pretraining: video + aligned log-mel per view."""
    return _graph(source, views=views, with_video=True, with_audio=True, clip_frames=clip_frames,
                  crop=crop, gpu=gpu, dtype=dtype)


@pipeline_def(exec_dynamic=True)
def video_pipeline(source, *, views=1, clip_frames=16, crop=112, gpu=False, dtype=types.FLOAT):
    """Downstream video (clips without audio included)."""
    return _graph(source, views=views, with_video=True, with_audio=False, clip_frames=clip_frames,
                  crop=crop, gpu=gpu, dtype=dtype)


@pipeline_def(exec_dynamic=True)
def audio_pipeline(source, *, views=1, clip_frames=16, crop=112, gpu=False, dtype=types.FLOAT):
    """Downstream audio: the log-mel segments (sliced on the host; nothing to decode)."""
    return _graph(source, views=views, with_video=False, with_audio=True, clip_frames=clip_frames,
                  crop=crop, gpu=gpu, dtype=dtype)


def output_names(views, with_video, with_audio) -> list[str]:
    names = ["index", "label"]
    for v in range(views):
        sfx = "" if v == 0 else str(v + 1)
        names.append("start" + sfx)
        names += (["video" + sfx] if with_video else []) + (["audio" + sfx] if with_audio else [])
    return names


# ----------------------------------------------------------------------------------------------
# Host side: the per-sample parameters
# ----------------------------------------------------------------------------------------------
class ClipSource:
    """Feeds one epoch of this rank's batches (lists of dataset indices) to a pipeline."""

    def __init__(self, loader, batches):
        self.l, self.batches, self.k = loader, batches, 0

    def __iter__(self):
        self.k = 0
        return self

    def _view(self, row, i, rng):
        l = self.l
        n = int(row["frames"]) or int(float(row["duration"]) * float(row["fps"]))
        start = int(rng.integers(0, max(1, n - l.t + 1))) if rng is not None else max(0, (n - l.t) // 2)
        vals = []
        if l.need_video:
            h, w = int(row["height"]), int(row["width"])
            aug = rng if l.train else None
            top, left, ch, cw = crop_box(h, w, aug)
            flip = aug is not None and aug.random() < 0.5
            gray = aug is not None and aug.random() < 0.2
            vals += [np.fromfile(row["video"], dtype=np.uint8), np.array(start, np.int32),
                     np.array([top, left], np.float32), np.array([top + ch, left + cw], np.float32),
                     np.array(int(flip), np.int32), np.array(0.0 if gray else 1.0, np.float32)]
        else:
            vals.append(np.array(start, np.int32))
        if l.need_audio:
            vals.append(mel_segment(l.m.mel(i), start, l.t, float(row["fps"])))
        return vals

    def __next__(self):
        if self.k >= len(self.batches):
            raise StopIteration
        l, batch = self.l, self.batches[self.k]
        self.k += 1
        cols = None
        for i in batch:
            row = l.m.rows[i]
            rng = np.random.default_rng([l.seed, l.epoch, i]) if (l.train or l.jitter) else None
            vals = [np.array(i, np.int64), np.array(int(row["label"]), np.int64)]
            for v in range(l.views):
                if v == 1 and rng is None:  # eval with two views: a fixed second generator
                    rng = np.random.default_rng([l.seed, i])
                vals += self._view(row, i, rng)
            cols = [[] for _ in vals] if cols is None else cols
            for c, x in zip(cols, vals):
                c.append(x)
        return cols


def _build(loader, size, batches):
    gpu = loader.device.type == "cuda"
    pipe_fn = (pretrain_pipeline if loader.need_video and loader.need_audio else
               video_pipeline if loader.need_video else audio_pipeline)
    dtype = types.FLOAT16 if loader.dtype == torch.float16 else types.FLOAT
    device_id = (loader.device.index if loader.device.index is not None
                 else torch.cuda.current_device()) if gpu else None
    pipe = pipe_fn(ClipSource(loader, batches), views=loader.views, clip_frames=loader.t,
                   crop=loader.s, gpu=gpu, dtype=dtype, batch_size=size,
                   num_threads=max(1, loader.num_workers), device_id=device_id,
                   seed=(loader.seed * 1_000_003 + loader.epoch) % (2 ** 31),
                   prefetch_queue_depth=2)
    pipe.build()
    return pipe


def iterate_dali(loader, batches):
    """One epoch of batch dicts (torch tensors on loader.device), streamed. DALI pipelines have
    a fixed batch size: every run of equal-sized batches (in practice: all but a smaller last
    one) goes through a pipeline of that size."""
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    names = output_names(loader.views, loader.need_video, loader.need_audio)
    runs: list[list[list[int]]] = []
    for b in batches:
        if runs and len(runs[-1][0]) == len(b):
            runs[-1].append(b)
        else:
            runs.append([b])
    for run in runs:
        pipe = _build(loader, len(run[0]), run)
        it = DALIGenericIterator(pipe, names, auto_reset=False)
        try:
            for _, out in zip(run, it):
                d = out[0]
                batch = {}
                for k in names:
                    v = d[k]
                    if k in ("index", "label") or k.startswith("start"):
                        v = v.reshape(-1).long()
                    elif v.dtype != loader.dtype:
                        v = v.to(loader.dtype)
                    batch[k] = v.to(loader.device, non_blocking=True)
                yield batch
        finally:
            del it, pipe
