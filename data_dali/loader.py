"""The one entry point the trainer and the evaluation use: ``build_loader``.

Epochs are shuffled with a generator seeded by (seed, epoch); every global batch is split over
the ranks (shard r takes its slice), so the gathered global batch is the same whatever the
number of ranks, and 2 shards cover an epoch once, disjointly. backend "dali" decodes and
augments with DALI (GPU when device is cuda, CPU operators otherwise); "reference" uses the
PyAV loader; "auto" picks DALI when it imports and works, else the reference, with a warning.
"""

from __future__ import annotations

import logging

import torch

from .manifest import Manifest

log = logging.getLogger("data_dali")


def read_manifest(path) -> Manifest:
    return Manifest(path)


def manifest_info(path) -> dict:
    m = Manifest(path)
    return dict(clips=len(m), classes=m.num_classes, class_names=m.class_names,
                with_audio=sum(1 for r in m.rows if r["mel"]),
                with_video=sum(1 for r in m.rows if r["video"]))


class Loader:
    """Iterable per epoch (``set_epoch`` first); ``len`` = batches per epoch (per rank)."""

    def __init__(self, manifest: Manifest, index: list[int], *, batch_size, clip_frames, crop,
                 shard_id, num_shards, seed, device, backend, views, num_workers, drop_last,
                 dtype, train=True, need_video=True, need_audio=True):
        if not index:
            raise ValueError(f"{manifest.file}: no usable clips for this loader (need video="
                             f"{need_video}, audio={need_audio}); check the manifest and rejects.csv")
        if batch_size * num_shards > len(index) and drop_last:
            raise ValueError(f"{manifest.file}: {len(index)} usable clips < one global batch of "
                             f"{batch_size * num_shards}; lower --batch-size or add data")
        self.m, self.index = manifest, index
        self.batch_size, self.t, self.s = batch_size, clip_frames, crop
        self.shard_id, self.num_shards, self.seed = shard_id, num_shards, seed
        self.device, self.views, self.num_workers = torch.device(device), views, num_workers
        self.drop_last, self.dtype, self.train, self.epoch = drop_last, dtype, train, 0
        self.need_video, self.need_audio = need_video, need_audio
        self.num_clips, self.num_classes = len(manifest), manifest.num_classes
        self.class_names, self.labels = manifest.class_names, manifest.labels
        self.backend = self._pick_backend(backend)

    def _pick_backend(self, backend):
        if backend not in ("auto", "dali", "reference"):
            raise ValueError(f"backend {backend!r} is not one of auto, dali, reference")
        if backend == "reference":
            return "reference"
        if not self.need_video:  # audio-only batches are log-mel slices: nothing to decode
            return "reference"
        try:
            from . import pipelines

            pipelines.check_available(self.device)
            return "dali"
        except Exception as e:
            if backend == "dali":
                raise RuntimeError(f"DALI backend unavailable: {e}") from e
            log.warning("DALI unavailable (%s); using the PyAV reference loader", e)
            return "reference"

    def set_epoch(self, epoch: int):
        self.epoch = epoch

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
        batches = self.shard_indices()
        if self.backend == "dali":
            from .pipelines import iterate_dali

            yield from iterate_dali(self, batches)
            return
        from .reference import ClipDataset

        ds = ClipDataset(self.m, self.index, clip_frames=self.t, crop=self.s, views=self.views,
                         train=self.train, seed=self.seed, need_audio=self.need_audio,
                         dtype=self.dtype)
        ds.epoch = self.epoch
        pos = {i: k for k, i in enumerate(self.index)}
        dl = torch.utils.data.DataLoader(ds, batch_sampler=[[pos[i] for i in b] for b in batches],
                                         num_workers=self.num_workers,
                                         persistent_workers=False)
        for batch in dl:
            yield {k: (v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v)
                   for k, v in batch.items()}


def build_loader(manifest, *, batch_size, clip_frames=16, crop=112, fps=10, split=None,
                 shard_id=0, num_shards=1, seed=0, device="cpu", backend="auto", views=1,
                 num_workers=2, drop_last=True, dtype=torch.float32, train=True,
                 need_video=True, need_audio=True) -> Loader:
    """Pretraining / downstream loader over a prepared manifest (``fps`` is the prepared rate;
    the manifest's own fps column is what alignment uses)."""
    if not 0 <= shard_id < num_shards:
        raise ValueError(f"shard_id {shard_id} must be in [0, num_shards={num_shards})")
    m = manifest if isinstance(manifest, Manifest) else Manifest(manifest)
    index = m.select(need_video=need_video, need_audio=need_audio, split=split)
    skipped = len(m) - len(index)
    if skipped:
        log.info("%s: %d of %d clips lack what this loader needs (video=%s, audio=%s) and are "
                 "skipped", m.file, skipped, len(m), need_video, need_audio)
    return Loader(m, index, batch_size=batch_size, clip_frames=clip_frames, crop=crop,
                  shard_id=shard_id, num_shards=num_shards, seed=seed, device=device,
                  backend=backend, views=views, num_workers=num_workers, drop_last=drop_last,
                  dtype=dtype, train=train, need_video=need_video, need_audio=need_audio)


class EvalSplits:
    """Train/test splits of a prepared labelled dataset for ``cmacc.eval``: the official
    UCF101/HMDB51 splits (columns split1..3), ESC-50's 5 folds (column fold: each fold is the
    test set once), or, for a plain folder, split1 if present."""

    def __init__(self, manifest, *, modality="video", clip_frames=16, crop=112, seed=0):
        self.m = manifest if isinstance(manifest, Manifest) else Manifest(manifest)
        self.modality, self.t, self.s, self.seed = modality, clip_frames, crop, seed
        self.num_classes = self.m.num_classes

    def splits(self, wanted=None):
        rows = self.m.rows
        need_v, need_a = self.modality == "video", self.modality == "audio"
        ok = set(self.m.select(need_video=need_v, need_audio=need_a))
        out = []
        folds = sorted({r["fold"] for r in rows if r.get("fold")}, key=lambda f: int(f))
        if folds:
            for f in folds:
                if wanted and f not in wanted:
                    continue
                tr = [i for i in ok if rows[i]["fold"] != f]
                te = [i for i in ok if rows[i]["fold"] == f]
                out.append((f"fold{f}", torch.tensor(sorted(tr)), torch.tensor(sorted(te))))
            return out
        for k in ("1", "2", "3"):
            col = f"split{k}"
            if not any(r.get(col) for r in rows) or (wanted and k not in wanted):
                continue
            tr = [i for i in ok if rows[i][col] == "train"]
            te = [i for i in ok if rows[i][col] == "test"]
            out.append((col, torch.tensor(sorted(tr)), torch.tensor(sorted(te))))
        if not out:
            raise ValueError(f"{self.m.file}: no split1..3 or fold columns; prepare with "
                             "--layout ucf101/hmdb51/esc50 or a --list file with a split column")
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
                             seed=self.seed + p, need_audio=self.modality == "audio")
            order = list(range(len(idx)))
            if shuffle_seed is not None:
                g = torch.Generator().manual_seed(shuffle_seed + p)
                order = torch.randperm(len(idx), generator=g).tolist()
            for s in range(0, len(order), batch_size):
                items = [ds[k] for k in order[s:s + batch_size]]
                yield {key: (torch.stack([it[key] for it in items]) if torch.is_tensor(items[0][key])
                             else torch.tensor([it[key] for it in items]))
                       for key in items[0]}

        return gen
