"""DALI pipelines: decode and augment prepared clips on the device, log-mels aligned.

VP9 decode (NVDEC with device cuda, libavcodec with CPU operators), resized crop, flip,
grayscale and normalisation on the device, layout C x T x H x W; the log-mel segment aligned
with the decoded frames travels with each clip.

One pipeline per use, all built from the same video branch:
- ``pretrain_pipeline``  video + aligned log-mel (views=2: a second view of both)
- ``video_pipeline``     downstream video (no audio)
- ``audio_pipeline``     downstream audio: log-mel segments only (nothing to decode)

Sampling happens on the host, in ``ClipSource``: the start frame, crop box, flip and grayscale
of every view come from the augmentation law (data_dali/augment.py: one generator per (seed,
epoch, dataset index, view), the law the reference loader uses too) and reach the decoder
(``start_frame``) and the augmentation operators as per-sample arguments. So the video clip and
its log-mel segment are aligned by construction (mel frames [round(100 s / fps), + round(100 T
/ fps)) for start frame s; data_dali/audio.py), the two loaders agree sample for sample, and a
clip's augmentation does not depend on how the epoch is sharded.

Streaming: ``DaliStream`` builds a loader's pipeline once (its rank's batch size; a smaller
last batch goes through the same pipeline: the external source takes batches up to that size)
and reuses it for every epoch. ``ClipSource`` is persistent: each epoch hands it that epoch's
batches; at their end it raises StopIteration, DALI stops asking (its prefetch never runs into
the next epoch), and ``pipe.reset()`` re-arms it. At most ``prefetch`` batches are decoded ahead
of the consumer, so memory does not depend on the epoch length. Sharding and the epoch order
are the loader's (data_dali/loader.py).

This module imports DALI at import time; import it only through ``data_dali.loader``.
"""

from __future__ import annotations

import numpy as np
import torch
from nvidia.dali import fn, pipeline_def, types

from .audio import mel_segment
from .augment import draw_row
from .cli import first_line
from .reference import MEAN, STD


def check_available(device: torch.device) -> None:
    """Raise with the reason if DALI cannot run here."""
    from nvidia.dali.plugin.pytorch import DALIGenericIterator  # noqa: F401

    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device cuda requested but CUDA is not available")


# ----------------------------------------------------------------------------------------------
# Graph pieces
# ----------------------------------------------------------------------------------------------
def _video_branch(enc, params, *, clip_frames, crop, gpu, dtype):
    """encoded VP9/WebM bytes + the law's int32 [7] (start, top, left, crop_h, crop_w, flip,
    gray) → [3, T, crop, crop] normalised (CFHW)."""
    frames = fn.decoders.video(enc, device="mixed" if gpu else "cpu", start_frame=params[0],
                               sequence_length=clip_frames, pad_mode="edge")  # [T, H, W, 3] u8
    top_left = params[1:3]
    frames = fn.resize(frames, roi_start=fn.cast(top_left, dtype=types.FLOAT),
                       roi_end=fn.cast(top_left + params[3:5], dtype=types.FLOAT),
                       roi_relative=False, size=[crop, crop], interp_type=types.INTERP_LINEAR,
                       antialias=True)
    # saturation 0 = grayscale (0.299/0.587/0.114)
    frames = fn.hsv(frames, saturation=fn.cast(1 - params[6], dtype=types.FLOAT))
    return fn.crop_mirror_normalize(frames, mirror=params[5], dtype=dtype,
                                    mean=[255 * m for m in MEAN], std=[255 * s for s in STD],
                                    output_layout="CFHW")


def _graph(source, *, views, with_video, with_audio, clip_frames, crop, gpu, dtype):
    """External source columns: index, label, [encoded video], then per view: the law's
    params, [its log-mel segment]. Outputs: index, label, then per view params, [video],
    [audio] (``output_names``)."""
    dtypes = [types.INT64, types.INT64] + [types.UINT8] * with_video
    dtypes += ([types.INT32] + [types.FLOAT] * with_audio) * views
    cols = list(fn.external_source(source=source, num_outputs=len(dtypes), batch=True,
                                   dtype=dtypes))
    outs = cols[:2]
    enc = cols[2] if with_video else None
    per_view = cols[2 + with_video:]
    for v in range(views):
        params, *mel = per_view[v * (1 + with_audio):(v + 1) * (1 + with_audio)]
        outs.append(params)
        if with_video:
            outs.append(_video_branch(enc, params, clip_frames=clip_frames, crop=crop, gpu=gpu,
                                      dtype=dtype))
        if with_audio:
            outs.append(mel[0].gpu() if gpu else mel[0])
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
        names.append("params" + sfx)
        names += (["video" + sfx] if with_video else []) + (["audio" + sfx] if with_audio else [])
    return names


def output_device(tl, device: torch.device) -> torch.device:
    """Where a pipeline output is copied first: a GPU tensor list (decoded, augmented video;
    audio moved with ``.gpu()``) into memory of ``device``, a CPU one (index, label, params;
    every output of a CPU pipeline) into host memory, moved afterwards. Told by the list's type:
    CPU and GPU tensor lists both have ``as_cpu`` (DALI >= 2), and a device-memory destination
    for a CPU list makes ``feed_ndarray`` write host bytes to a device address."""
    from nvidia.dali.tensors import TensorListGPU

    return device if isinstance(tl, TensorListGPU) else torch.device("cpu")


# ----------------------------------------------------------------------------------------------
# Host side: the per-sample parameters, one epoch after another
# ----------------------------------------------------------------------------------------------
class ClipSource:
    """The pipeline's persistent external source. ``start(batches, epoch)`` hands it an epoch
    (this rank's batches: lists of dataset indices); it yields their columns, then raises
    StopIteration until the next ``start``. ``stop()`` ends the epoch early (at the next call).
    ``fed`` counts the samples handed to DALI (tests: how far ahead decoding runs)."""

    def __init__(self, loader):
        self.l, self.batches, self.k, self.epoch, self.fed = loader, [], 0, 0, 0

    def start(self, batches, epoch):
        self.batches, self.k, self.epoch = batches, 0, epoch

    def stop(self):
        self.batches = self.batches[:self.k]

    def __iter__(self):
        return self

    def __next__(self):
        if self.k >= len(self.batches):
            raise StopIteration
        l, batch = self.l, self.batches[self.k]
        self.k += 1
        cols = None
        for i in batch:
            i = l.bad.usable(i, self.epoch)  # a damaged clip: recorded, replaced
            row = l.m.rows[i]
            vals = [np.array(i, np.int64), np.array(int(row["label"]), np.int64)]
            if l.need_video:
                vals.append(np.fromfile(row["video"], dtype=np.uint8))
            for v in range(l.views):
                p = draw_row(row, i, v, seed=l.seed, epoch=self.epoch, clip_frames=l.t,
                             train=l.train, jitter=l.jitter, aug=l.aug)
                vals.append(p.array())
                if l.need_audio:
                    vals.append(mel_segment(l.m.mel(i), p.start, l.t, float(row["fps"])))
            cols = [[] for _ in vals] if cols is None else cols
            for c, x in zip(cols, vals):
                c.append(x)
        self.fed += len(batch)
        return cols


def _built(pipe, loader):
    pipe.build()
    loader.builds += 1
    return pipe


def _decode_problem(row) -> str | None:
    """Why PyAV cannot decode the whole of a prepared clip (fewer frames than the manifest
    says: truncated), else None."""
    import av

    try:
        with av.open(row["video"]) as c:
            n = sum(1 for _ in c.decode(video=0))
    except Exception as e:  # noqa: BLE001 - PyAV on a damaged file
        return f"cannot decode ({first_line(e, 160)})"
    if n < int(row["frames"]):
        return f"decodes to {n} of its {row['frames']} frames (truncated)"
    return None


class DaliStream:
    """A loader's pipeline, built once (``loader.builds`` counts builds) and reused by every
    epoch. One epoch runs at a time: starting one ends an unfinished one (its source stops, the
    at most ``prefetch`` batches in flight are drained, the pipeline reset)."""

    def __init__(self, loader):
        self.l, self.source = loader, ClipSource(loader)
        self.names = output_names(loader.views, loader.need_video, loader.need_audio)
        self.gpu = gpu = loader.device.type == "cuda"
        pipe_fn = (pretrain_pipeline if loader.need_video and loader.need_audio else
                   video_pipeline if loader.need_video else audio_pipeline)
        device_id = (loader.device.index if loader.device.index is not None
                     else torch.cuda.current_device()) if gpu else None
        self._build = lambda: _built(pipe_fn(
            self.source, views=loader.views, clip_frames=loader.t, crop=loader.s, gpu=gpu,
            dtype=types.FLOAT16 if loader.dtype == torch.float16 else types.FLOAT,
            batch_size=loader.batch_size, num_threads=max(1, loader.num_workers),
            device_id=device_id, seed=loader.seed % (2 ** 31),
            prefetch_queue_depth=loader.prefetch), loader)
        self.pipe = self._build()
        self.running = None  # the token of the epoch in flight

    def epoch(self, batches, epoch):
        """One epoch of batch dicts (torch tensors on loader.device), streamed."""
        self.end()
        token = self.running = object()
        self.source.start(batches, epoch)
        done = base = 0  # batches returned; the first one of the source's current list
        while self.running is token:  # a later epoch ends this one
            try:
                # GPU: the outputs are bound to torch's stream, so DALI reuses their memory only
                # after the copies _batch queues there (host-synchronous otherwise)
                out = self.pipe.run(torch.cuda.current_stream(self.l.device) if self.gpu
                                    else None)
            except StopIteration:
                self.pipe.reset()
                self.running = None
                return
            except Exception as e:  # noqa: BLE001 - a clip DALI could not decode
                self._recover(batches[done:base + self.source.k], epoch, e)
                self.source.start(batches[done:], epoch)
                base = done
                continue
            done += 1
            yield self._batch(out)

    def _recover(self, pending, epoch, error):
        """A failed pipeline is no longer valid: name the damaged clips of the batches fed but
        not returned (``pending``; PyAV decodes each: the reference), record them and build a
        new pipeline; the caller goes on from the failed batch (its damaged clips replaced)."""
        l = self.l
        l.bad.check_limit()  # (raised inside DALI's source: said as it is)
        fed = {l.bad.usable(i, epoch) for b in pending for i in b}
        found = [(i, why) for i in sorted(fed) if (why := _decode_problem(l.m.rows[i]))]
        if not found:
            raise error  # not a damaged clip: a real fault
        for i, why in found:
            l.bad.record(i, why)
        self.pipe = self._build()

    def end(self):
        """End the epoch in flight, if any, without decoding the rest of it."""
        if self.running is None:
            return
        self.running = None
        self.source.stop()
        try:
            while True:
                self.pipe.run()
        except StopIteration:
            self.pipe.reset()

    def _batch(self, out) -> dict:
        from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

        l, batch = self.l, {}
        stream = torch.cuda.current_stream(l.device) if l.device.type == "cuda" else None
        for name, tl in zip(self.names, out):
            t = tl.as_tensor()
            x = torch.empty(t.shape(), dtype=to_torch_type[t.dtype],
                            device=output_device(tl, l.device))
            feed_ndarray(t, x, cuda_stream=stream)
            if name in ("index", "label") or name.startswith("params"):
                x = x.long()
            elif x.dtype != l.dtype:
                x = x.to(l.dtype)
            batch[name] = x.to(l.device, non_blocking=True)
        return batch
