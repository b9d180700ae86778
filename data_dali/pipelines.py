"""DALI pipelines: VP9 decode (NVDEC with device='cuda', libavcodec on CPU), random resized crop,
flip, grayscale and normalisation on the device, layout C x T x H x W; the aligned log-mel
segment travels with each clip. Yields torch tensors through DALIGenericIterator.

Per-sample choices (start frame, crop box, flip, grayscale) come from the same generator as the
reference loader — seeded by (seed, epoch, dataset index) — so the two loaders agree sample for
sample up to resampling arithmetic, and sharding/seeding is the loader's (data_dali/loader.py).

Pipelines: ``pretrain_pipeline`` (video + audio), ``video_pipeline`` (downstream video) and
audio-only batches (log-mel slices need no decoding: ``iterate_dali`` serves them directly).
"""

from __future__ import annotations

import numpy as np
import torch

from .audio import mel_segment
from .reference import MEAN, STD, crop_box


def check_available(device: torch.device) -> None:
    """Raise with the reason if DALI cannot run here."""
    import nvidia.dali  # noqa: F401
    from nvidia.dali.plugin.pytorch import DALIGenericIterator  # noqa: F401

    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device cuda requested but CUDA is not available")


def _pipeline(batch_size, clip_frames, crop, device, with_audio, source, seed, threads=2):
    from nvidia.dali import fn, pipeline_def, types

    gpu = device.type == "cuda"

    @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=(device.index or 0) if gpu else None,
                  seed=seed, exec_dynamic=True)
    def pipe():
        enc, start, roi_s, roi_e, mirror, sat, index, label, mel = fn.external_source(
            source=source, num_outputs=9, batch=True,
            dtype=[types.UINT8, types.INT32, types.FLOAT, types.FLOAT, types.INT32, types.FLOAT,
                   types.INT64, types.INT64, types.FLOAT])
        frames = fn.decoders.video(enc, device="mixed" if gpu else "cpu", start_frame=start,
                                   sequence_length=clip_frames, pad_mode="edge")  # [T, H, W, 3]
        frames = fn.resize(frames, roi_start=roi_s, roi_end=roi_e, roi_relative=False,
                           size=[crop, crop], interp_type=types.INTERP_LINEAR, antialias=True)
        frames = fn.hsv(frames, saturation=sat)  # saturation 0 = grayscale (luma 0.299/0.587/0.114)
        video = fn.crop_mirror_normalize(frames, mirror=mirror, dtype=types.FLOAT,
                                         mean=[255 * m for m in MEAN], std=[255 * s for s in STD],
                                         output_layout="CFHW")
        outs = [video, index, label]
        if with_audio:
            outs.append(mel.gpu() if gpu else mel)
        return tuple(outs)

    return pipe()


class _Source:
    """Feeds one epoch of this rank's batches; per-sample parameters as the reference loader."""

    def __init__(self, loader, batches):
        self.l, self.batches, self.k = loader, batches, 0
        self.bytes = {}

    def __iter__(self):
        self.k = 0
        return self

    def _encoded(self, path):
        b = self.bytes.get(path)
        if b is None:
            with open(path, "rb") as f:
                b = np.frombuffer(f.read(), dtype=np.uint8)
            if len(self.bytes) < 4096:
                self.bytes[path] = b
        return b

    def __next__(self):
        if self.k >= len(self.batches):
            raise StopIteration
        l, batch = self.l, self.batches[self.k]
        self.k += 1
        cols = [[] for _ in range(9)]
        for i in batch:
            row = l.m.rows[i]
            rng = np.random.default_rng([l.seed, l.epoch, i]) if l.train else None
            n, h, w = int(row["frames"]), int(row["height"]), int(row["width"])
            start = int(rng.integers(0, max(1, n - l.t + 1))) if rng is not None else max(0, (n - l.t) // 2)
            top, left, ch, cw = crop_box(h, w, rng)
            flip = rng is not None and rng.random() < 0.5
            gray = rng is not None and rng.random() < 0.2
            mel = (mel_segment(l.m.mel(i), start, l.t, float(row["fps"])) if l.need_audio
                   else np.zeros((1, 1), np.float32))
            vals = [self._encoded(str(l.m.path(row["video"]))), np.array(start, np.int32),
                    np.array([top, left], np.float32), np.array([top + ch, left + cw], np.float32),
                    np.array(int(flip), np.int32), np.array(0.0 if gray else 1.0, np.float32),
                    np.array(i, np.int64), np.array(int(row["label"]), np.int64), mel]
            for c, v in zip(cols, vals):
                c.append(v)
        return cols


def iterate_dali(loader, batches):
    """One epoch of batch dicts (torch tensors on loader.device). The last, smaller batch (if
    any) runs through a pipeline of its own size."""
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    if not batches:
        return
    names = ["video", "index", "label"] + (["audio"] if loader.need_audio else [])
    groups = {}
    for b in batches:  # DALI pipelines have a fixed batch size: group equal-sized batches
        groups.setdefault(len(b), []).append(b)
    order = {id(b): k for k, b in enumerate(batches)}
    results = {}
    for size, group in groups.items():
        src = _Source(loader, group)
        pipe = _pipeline(size, loader.t, loader.s, loader.device, loader.need_audio, src,
                         seed=loader.seed * 7919 + loader.epoch + 1)
        pipe.build()
        it = DALIGenericIterator(pipe, names, auto_reset=False)
        for b, out in zip(group, it):
            d = out[0]
            batch = {k: d[k] for k in names}
            batch["index"], batch["label"] = batch["index"].reshape(-1), batch["label"].reshape(-1)
            if batch["video"].dtype != loader.dtype:
                batch["video"] = batch["video"].to(loader.dtype)
            results[order[id(b)]] = {k: v.to(loader.device) for k, v in batch.items()}
        del it, pipe
    for k in range(len(batches)):
        yield results[k]
