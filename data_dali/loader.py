"""The one entry point the trainer and the evaluation use: ``build_loader``.

Epochs are shuffled with a generator seeded by (seed, epoch); every global batch (batch_size x
num_shards clips) is split over the ranks (shard r takes its slice), so the gathered global
batch is the same whatever the number of ranks, and the shards cover an epoch once, disjointly.
backend "dali" decodes and augments with DALI (GPU when device is cuda, CPU operators
otherwise); "reference" uses the PyAV loader; "auto" picks DALI when it imports and its first
pipeline builds and runs, else the reference, with a warning saying why.

Memory stays flat whatever the epoch length: batches stream as they are decoded, at most
``prefetch`` ahead of the consumer, and a Loader builds its DALI pipeline (or its PyAV
DataLoader with persistent workers) once and reuses it for every epoch. Every augmentation
choice comes from one law (data_dali/augment.py), shared by both backends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .audio import mel_frames
from .augment import PAPER, Augment, batch_fields
from .cli import first_line
from .damaged import BadClips, default_limit
from .manifest import Manifest, ManifestError

log = logging.getLogger("data_dali")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def read_manifest(path) -> Manifest:
    """The manifest's rows, every one checked (``Manifest``: one ManifestError naming the bad lines)."""
    return Manifest(path)


def manifest_info(path) -> dict:
    """Counts, classes and splits of a prepared dataset."""
    m = path if isinstance(path, Manifest) else Manifest(path)
    rows = m.rows
    return dict(file=str(m.file), clips=len(m), classes=m.num_classes, class_names=m.class_names,
                with_video=sum(1 for r in rows if r["video"]),
                with_audio=sum(1 for i in range(len(m)) if m.has_audio(i)),
                silent=sum(1 for r in rows if r.get("silent") == "1"),
                fps=sorted({float(r["fps"]) for r in rows}),
                splits=[c for c in ("split1", "split2", "split3") if any(r.get(c) for r in rows)],
                folds=sorted({r["fold"] for r in rows if r.get("fold")}))


@dataclass
class LoaderConfig:
    batch_size: int
    clip_frames: int = 16
    crop: int = 112
    fps: float = 10.0
    shard_id: int = 0
    num_shards: int = 1
    seed: int = 0
    views: int = 1
    num_workers: int = 2
    drop_last: bool = True
    dtype: torch.dtype = torch.float32
    backend: str = "auto"
    prefetch: int = 2
    augment: Augment = PAPER  # training augmentations that run (data_dali/augment.py)

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.clip_frames < 1:
            raise ValueError(f"clip_frames must be >= 1, got {self.clip_frames}")
        if self.crop < 8:
            raise ValueError(f"crop must be >= 8 pixels, got {self.crop}")
        if self.fps <= 0:
            raise ValueError(f"fps must be > 0, got {self.fps}")
        if not 0 <= self.shard_id < self.num_shards:
            raise ValueError(f"shard_id {self.shard_id} must be in [0, num_shards={self.num_shards})")
        if self.views not in (1, 2):
            raise ValueError(f"views must be 1 or 2, got {self.views}")
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype}")
        if self.backend not in ("auto", "dali", "reference"):
            raise ValueError(f"backend {self.backend!r} is not one of auto, dali, reference")
        if not (isinstance(self.prefetch, int) and 1 <= self.prefetch <= 64):
            raise ValueError(f"prefetch must be an integer in [1, 64] (batches decoded ahead of "
                             f"the consumer), got {self.prefetch!r}")


class Loader:
    """Iterable per epoch (each ``iter()`` is one epoch of this rank's batches; call
    ``set_epoch(e)`` first to reshuffle); ``len`` = batches per epoch on this rank.

    Batches: dicts of tensors on ``device``: "video" [B,3,T,S,S], "audio" [B,80,L] with
    L = round(100 T / fps), "index" long [B] (manifest row = dataset index), "label" long [B]
    (-1 = unlabeled), "start" long [B] (first frame of the clip); with video also the rest of
    the law's draw (data_dali/augment.py): "crop" long [B, 4] (top, left, height, width in
    the prepared frame), "flip" and "gray" bool [B]; views=2 adds "video2", "audio2",
    "start2", ... (another segment, crop and flip of the same clip).

    Streaming: at most ``prefetch`` batches are decoded ahead; one epoch runs at a time
    (starting an epoch ends an unfinished one). ``builds`` counts the pipelines (DALI) or
    DataLoaders (reference) built: one per Loader, whatever the number of epochs."""

    def __init__(self, manifest: Manifest, index: list[int], cfg: LoaderConfig, *, device="cpu",
                 train=True, need_video=True, need_audio=True, bad_clips_csv=None,
                 max_bad_clips=None, stop_past_limit=True):
        if not index:
            raise ValueError(f"{manifest.file}: no usable clips for this loader (need video="
                             f"{need_video}, audio={need_audio}); check the manifest and rejects.csv")
        if cfg.batch_size * cfg.num_shards > len(index) and cfg.drop_last:
            raise ValueError(f"{manifest.file}: {len(index)} usable clips < one global batch of "
                             f"{cfg.batch_size * cfg.num_shards}; lower the batch size or add data")
        self.cfg, self.m, self.index = cfg, manifest, index
        self.batch_size, self.t, self.s = cfg.batch_size, cfg.clip_frames, cfg.crop
        self.shard_id, self.num_shards, self.seed = cfg.shard_id, cfg.num_shards, cfg.seed
        self.device, self.views, self.num_workers = torch.device(device), cfg.views, cfg.num_workers
        self.drop_last, self.dtype, self.epoch, self.start = cfg.drop_last, cfg.dtype, 0, 0
        self.prefetch, self.builds, self._stream, self._ref = cfg.prefetch, 0, None, None
        self.train = self.jitter = train
        self.aug = cfg.augment
        self.need_video, self.need_audio = need_video, need_audio
        self.num_clips, self.num_classes = len(manifest), manifest.num_classes
        self.class_names, self.labels = manifest.class_names, manifest.labels
        self.audio_frames = mel_frames(cfg.clip_frames, cfg.fps)
        # damaged clips: skipped, replaced, named in bad_clips_csv (data_dali/damaged.py)
        self.bad = BadClips(manifest, index, seed=cfg.seed, limit=max_bad_clips,
                            csv_path=bad_clips_csv, need_video=need_video, need_audio=need_audio,
                            stop_past_limit=stop_past_limit)
        self.backend = self._pick_backend(cfg.backend)
        self._dali_checked = self.backend != "dali" or cfg.backend == "dali"

    def _pick_backend(self, backend):
        """The backend that runs; ``self.why`` says why, in words (the trainer logs it)."""
        if backend == "reference":
            self.why = "asked for (--loader reference)"
            return "reference"
        if backend == "auto" and not self.need_video:
            self.why = "audio-only batches are log-mel slices: nothing to decode"
            return "reference"
        try:
            from . import pipelines

            pipelines.check_available(self.device)
            self.why = (f"asked for (--loader dali), on {self.device}" if backend == "dali" else
                        f"--loader auto found DALI, decoding on {self.device}")
            return "dali"
        except Exception as e:  # ImportError, a missing CUDA runtime, ...
            if backend == "dali":
                raise RuntimeError(f"DALI backend unavailable ({type(e).__name__}: {e}); install "
                                   "nvidia-dali-cuda130 or use backend='reference'") from e
            self.why = f"DALI unavailable ({type(e).__name__}: {first_line(e, 120)})"
            log.warning("%s; using the PyAV reference loader", self.why)
            return "reference"

    def set_epoch(self, epoch: int, start: int = 0):
        """The next ``iter()`` is epoch ``epoch`` from its batch ``start`` on (a mid-epoch
        resume: the earlier batches are not decoded; every sample's augmentation depends only
        on (seed, epoch, index, view), so the rest is what an uninterrupted epoch gives)."""
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        self.epoch, self.start = int(epoch), int(start)

    def _global_batches(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        perm = [self.index[i] for i in torch.randperm(len(self.index), generator=g).tolist()] \
            if self.train else list(self.index)
        gb = self.batch_size * self.num_shards
        n = len(perm) // gb * gb if self.drop_last else len(perm)
        for s in range(0, n, gb):
            chunk = perm[s:s + gb]
            per = -(-len(chunk) // self.num_shards)
            yield chunk[self.shard_id * per:(self.shard_id + 1) * per]

    def shard_indices(self) -> list[list[int]]:
        """This rank's batches of dataset indices for the current epoch."""
        return [b for b in self._global_batches() if b]

    def __len__(self):
        return len(self.shard_indices())

    def __iter__(self):
        batches = self.shard_indices()[self.start:]
        if self.backend != "dali":
            yield from self._iter_reference(batches)
            return
        gen = self._iter_dali(batches)
        if self._dali_checked:
            yield from gen
            return
        try:  # backend "auto": the first batch proves DALI works here
            first = next(gen)
        except StopIteration:
            return
        except Exception as e:
            self.why = f"DALI's first batch failed ({type(e).__name__}: {first_line(e, 120)})"
            log.warning("%s; using the PyAV reference loader", self.why)
            self.backend, self._dali_checked, self._stream = "reference", True, None
            yield from self._iter_reference(batches)
            return
        self._dali_checked = True
        yield first
        yield from gen

    def _iter_dali(self, batches):
        if self._stream is None:
            from .pipelines import DaliStream

            self._stream = DaliStream(self)
        try:
            for batch in self._stream.epoch(batches, self.epoch):
                yield _with_params(batch, self.views, self.need_video)
        except Exception:
            self._stream = None  # a failed pipeline is not reused: the next epoch rebuilds it
            raise

    def _iter_reference(self, batches):
        if self._ref is None:
            self._ref = _ReferenceStream(self)
            self.builds += 1
        for batch in self._ref.epoch(batches, self.epoch):
            yield {k: (v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v)
                   for k, v in batch.items()}


def _with_params(batch: dict, views: int, video: bool) -> dict:
    """A batch whose "params"/"params2" (long [B, 7], the law's draws) become "start", "crop",
    "flip", "gray" (augment.batch_fields)."""
    for v in range(views):
        sfx = "" if v == 0 else str(v + 1)
        batch.update(batch_fields(batch.pop("params" + sfx), sfx, video))
    return batch


class _EpochBatches(torch.utils.data.Sampler):
    """The batch sampler of the persistent DataLoader: an epoch's batches of (position, epoch)
    keys, so workers that live across epochs draw each epoch's augmentation."""

    def __init__(self):
        self.batches, self.epoch = [], 0

    def __iter__(self):
        epoch = self.epoch
        return ([(k, epoch) for k in b] for b in self.batches)

    def __len__(self):
        return len(self.batches)


class _ReferenceStream:
    """The PyAV backend: one DataLoader (persistent workers when num_workers > 0, pinned memory
    on CUDA, ``prefetch`` batches in flight) over a ClipDataset, fed each epoch's batches."""

    def __init__(self, loader: Loader):
        from .reference import ClipDataset

        ds = ClipDataset(loader.m, loader.index, clip_frames=loader.t, crop=loader.s,
                         views=loader.views, train=loader.train, seed=loader.seed,
                         need_audio=loader.need_audio, need_video=loader.need_video,
                         dtype=loader.dtype, temporal_jitter=loader.jitter, bad=loader.bad,
                         aug=loader.aug)
        self.bad = loader.bad  # (the workers' copies find damaged clips; this one records them)
        self.pos = {i: k for k, i in enumerate(loader.index)}
        self.sampler, self.views, self.video = _EpochBatches(), loader.views, loader.need_video
        workers = loader.num_workers
        self.dl = torch.utils.data.DataLoader(
            ds, batch_sampler=self.sampler, num_workers=workers, collate_fn=_collate,
            pin_memory=loader.device.type == "cuda", persistent_workers=workers > 0,
            prefetch_factor=-(-loader.prefetch // workers) if workers else None)

    def epoch(self, batches, epoch):
        self.sampler.batches = [[self.pos[i] for i in b] for b in batches]
        self.sampler.epoch = epoch
        for batch in self.dl:
            for i, reason in batch.pop("bad"):
                self.bad.record(i, reason)
            yield _with_params(batch, self.views, self.video)


def _collate(items: list[dict]) -> dict:
    """default_collate, with each item's list of damaged clips it replaced joined under "bad"."""
    bad = [b for it in items for b in it.pop("bad", [])]
    return dict(torch.utils.data.default_collate(items), bad=bad)


def build_loader(manifest, *, batch_size, clip_frames=16, crop=112, fps=10, split=None,
                 shard_id=0, num_shards=1, seed=0, device="cpu", backend="auto", views=1,
                 num_workers=2, drop_last=True, dtype=torch.float32, train=True,
                 need_video=True, need_audio=True, prefetch=2, bad_clips_csv=None,
                 max_bad_clips=None, stop_past_limit=True, augment=PAPER) -> Loader:
    """Pretraining (need_video and need_audio: clips without audio are skipped, and counted in
    the log) or downstream (need_audio=False: video-only; need_video=False: audio-only) loader
    over a prepared manifest. ``fps`` must be the rate the clips were prepared at (checked).
    ``split``: None (all rows), "train"/"test" (split1), "split2:test", "fold:3" or a
    (column, value) pair. ``train=False``: centre clip, centre crop, fixed order.
    ``prefetch``: batches decoded ahead of the consumer (DALI's queue depth; the PyAV
    DataLoader's batches in flight over all workers); memory grows with it, not with the
    epoch length. A damaged clip is skipped and replaced, named once in ``bad_clips_csv`` and
    the log; more than ``max_bad_clips`` (default: 1% of the clips, at least 10) raise
    TooManyBadClips (data_dali/damaged.py), or with ``stop_past_limit=False`` leave the stop
    to the caller (``loader.bad.count``: the trainer agrees on it over ranks). ``augment``:
    the training augmentations that run and the crop's strength (data_dali.augment.Augment;
    default the paper's)."""
    cfg = LoaderConfig(batch_size=batch_size, clip_frames=clip_frames, crop=crop, fps=fps,
                       shard_id=shard_id, num_shards=num_shards, seed=seed, views=views,
                       num_workers=num_workers, drop_last=drop_last, dtype=dtype, backend=backend,
                       prefetch=prefetch, augment=augment)
    if not (need_video or need_audio):
        raise ValueError("need_video and need_audio are both False: nothing to load")
    m = manifest if isinstance(manifest, Manifest) else Manifest(manifest)
    index = m.select(need_video=need_video, need_audio=need_audio, split=split)
    rates = {float(m.rows[i]["fps"]) for i in index}
    if rates and rates != {float(fps)}:
        raise ManifestError(f"{m.file}: clips were prepared at {sorted(rates)} fps but the loader "
                            f"was asked for fps={fps}; pass fps={min(rates):g} or re-run "
                            f"`python -m data_dali.prepare --fps {fps:g}`")
    skipped = len(m) - len(index)
    if skipped:
        log.info("%s: %d of %d clips lack what this loader needs (video=%s, audio=%s%s) and are "
                 "skipped", m.file, skipped, len(m), need_video, need_audio,
                 f", split={split}" if split is not None else "")
    return Loader(m, index, cfg, device=device, train=train, need_video=need_video,
                  need_audio=need_audio, bad_clips_csv=bad_clips_csv, max_bad_clips=max_bad_clips,
                  stop_past_limit=stop_past_limit)


HELD_OUT = 4  # the default split tests 1 in HELD_OUT clips of each class


def held_out_split(labels, seed: int, ok=None) -> tuple[list[int], list[int]]:
    """A seeded, stratified train/test split of the labelled rows (label >= 0) in ``ok``
    (default: all): each class's clips in a random order drawn from ``seed``, the first
    round(n / HELD_OUT) of them (at least one when the class has two or more) are the test
    set. Deterministic for a seed; sorted index lists."""
    by_class: dict[int, list[int]] = {}
    for i in sorted(range(len(labels)) if ok is None else ok):
        if int(labels[i]) >= 0:
            by_class.setdefault(int(labels[i]), []).append(i)
    g = torch.Generator().manual_seed(int(seed))
    train, test = [], []
    for c in sorted(by_class):
        idx = by_class[c]
        order = [idx[k] for k in torch.randperm(len(idx), generator=g).tolist()]
        n_test = max(1, round(len(idx) / HELD_OUT)) if len(idx) > 1 else 0
        test += order[:n_test]
        train += order[n_test:]
    return sorted(train), sorted(test)


class EvalSplits:
    """Train/test splits of a prepared labelled dataset for ``cmacc.apps.eval``: the official
    UCF101/HMDB51 splits (columns split1..3), ESC-50's 5 folds (column fold: each fold is the
    test set once), a --list file's split column (split1), or, when the manifest has none of
    these, one seeded stratified split "heldout" (1 in HELD_OUT clips of each class for testing;
    ``held_out_split``), which is logged. Unlabeled clips (label -1) are in no split."""

    def __init__(self, manifest, *, modality="video", clip_frames=16, crop=112, seed=0):
        self.m = manifest if isinstance(manifest, Manifest) else Manifest(manifest)
        self.modality, self.t, self.s, self.seed = modality, clip_frames, crop, seed
        self.num_classes = self.m.num_classes
        self.bad = None  # data_dali.damaged.BadClips, once leave_out_damaged has run

    def splits(self, wanted=None):
        rows, labels = self.m.rows, self.m.label_array
        need_v, need_a = self.modality == "video", self.modality == "audio"
        ok = [i for i in self.m.select(need_video=need_v, need_audio=need_a) if labels[i] >= 0]
        out = []
        folds = sorted({r["fold"] for r in rows if r.get("fold")}, key=_fold_key)
        for f in folds:
            if not wanted or f in wanted:
                out.append((f"fold{f}", _tensor(i for i in ok if rows[i]["fold"] != f),
                            _tensor(i for i in ok if rows[i]["fold"] == f)))
        columns = [] if folds else [k for k in "123" if any(r.get(f"split{k}") for r in rows)]
        for k in columns:
            if not wanted or k in wanted:
                col = f"split{k}"
                out.append((col, _tensor(i for i in ok if rows[i][col] == "train"),
                            _tensor(i for i in ok if rows[i][col] == "test")))
        if folds or columns:
            return out
        if not ok:
            other = "audio" if need_v else "video"
            if any(labels[i] >= 0 for i in self.m.select(need_video=not need_v,
                                                          need_audio=not need_a)):
                raise ManifestError(f"{self.m.file}: no labelled clips with {self.modality}, but "
                                    f"labelled clips with {other}; evaluate the {other} encoder "
                                    f"(--modality {other})")
            raise ManifestError(f"{self.m.file}: no labelled clips with {self.modality}; a probe "
                                "needs labels (prepare SRC/<class>/<files> or a --list with labels)")
        tr, te = held_out_split(labels, self.seed, ok)
        log.info("%s: no split1..3 or fold columns; testing on a stratified 1 in %d of each "
                 "class's clips (seed %d: %d train, %d test, split 'heldout')", self.m.file,
                 HELD_OUT, self.seed, len(tr), len(te))
        if not wanted or "heldout" in wanted:
            out.append(("heldout", _tensor(tr), _tensor(te)))
        return out

    def batches(self, index, batch_size=64, shuffle_seed=None):
        """A callable pass -> iterable of batch dicts, as cmacc.probe expects."""
        from .reference import ClipDataset

        idx = [int(i) for i in index]

        def gen(p):
            # training passes augment; test pass 0 is the centre clip, later passes other
            # temporal positions (multi-clip averaging), always centre-cropped
            ds = ClipDataset(self.m, idx, clip_frames=self.t, crop=self.s,
                             train=shuffle_seed is not None, temporal_jitter=p > 0,
                             seed=self.seed + p, need_audio=self.modality == "audio",
                             need_video=self.modality == "video")
            order = list(range(len(idx)))
            if shuffle_seed is not None:
                g = torch.Generator().manual_seed(shuffle_seed + p)
                order = torch.randperm(len(idx), generator=g).tolist()
            for s in range(0, len(order), batch_size):
                items = [item for k in order[s:s + batch_size] if (item := self._item(ds, k, idx))]
                if items:
                    batch = torch.utils.data.default_collate(items)
                    yield _with_params(batch, 1, self.modality == "video")

        return gen

    def _item(self, ds, k, idx):
        """Item ``k`` of ``ds``; after ``leave_out_damaged``, None for a clip found damaged
        (named and counted: it fails to decode now, or did before)."""
        if self.bad is None:
            return ds[k]
        if idx[k] in self.bad.found:
            return None
        try:
            return ds[k]
        except Exception as e:  # noqa: BLE001 - PyAV/NumPy on a damaged file
            self.bad.record(idx[k], f"cannot decode ({first_line(e, 160)})")
        return None

    def leave_out_damaged(self, chosen, limit=None):
        """``chosen`` (name, train, test) splits without the clips that fail the cheap checks
        (data_dali.damaged: truncated WebM, unreadable or non-finite log-mel), each named in the
        log and counted; clips that fail to decode later are left out as they are met
        (``batches``). A clip is left out, never replaced: a replacement would change the
        figures. TooManyBadClips (one line) past ``limit`` (default: 1% of these clips, at
        least 10). ``self.bad.named()`` lists them."""
        clips = sorted({int(i) for _, tr, te in chosen for i in (*tr.tolist(), *te.tolist())})
        self.bad = BadClips(self.m, clips, limit=default_limit(len(clips)) if limit is None
                            else limit, need_video=self.modality == "video",
                            need_audio=self.modality == "audio",
                            action="left out of the evaluation")
        for i in clips:
            reason = self.bad.check(i)
            if reason is not None:
                self.bad.record(i, reason)
        found = self.bad.found
        return [(name, _tensor(i for i in tr.tolist() if i not in found),
                 _tensor(i for i in te.tolist() if i not in found)) for name, tr, te in chosen]


def _tensor(index) -> torch.Tensor:
    return torch.tensor(list(index), dtype=torch.long)


def _fold_key(fold: str):
    """Folds in numeric order when they are numbers (ESC-50: 1..5), else by name."""
    return (0, int(fold), "") if fold.strip().lstrip("-").isdigit() else (1, 0, fold)
