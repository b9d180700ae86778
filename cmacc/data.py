"""The library's data side: a DataConfig becomes the training loader or the evaluation splits —
data_dali's loaders for a prepared manifest, the in-memory synthetic clips otherwise. The only
module of the library that imports data_dali's loaders."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

import data_dali
from data_dali.cli import first_line
from data_dali.damaged import rank_csv
from data_dali.manifest import sha256_file
from data_dali.synthetic import ToyAV, ToyLoader, held_out

from .config import DataConfig

log = logging.getLogger("cmacc")


def synthetic_clips(dcfg: DataConfig, seed: int) -> ToyAV:
    """The built-in clips of a run (the one place they are made from a config)."""
    return ToyAV(num_clips=dcfg.clips, num_classes=dcfg.classes, frames=dcfg.frames,
                 size=dcfg.size, redundancy=dcfg.redundancy, noise=dcfg.noise,
                 class_dist=dcfg.class_dist, seed=seed)


SYNTHETIC_FIELDS = ("clips", "classes", "redundancy", "noise", "class_dist")  # what makes the clips


def data_record(dcfg: DataConfig) -> dict:
    """What a run trains on, as its checkpoints record it: a manifest's absolute path and the
    SHA-256 of its bytes, or the synthetic clips with what makes them. A run's dictionaries
    and pools hold row positions of these clips: a resume on other data is refused."""
    if dcfg.synthetic:
        return {"source": "synthetic", **{k: getattr(dcfg, k) for k in SYNTHETIC_FIELDS}}
    p = Path(dcfg.source).resolve()
    return {"source": str(p), "manifest_sha256": sha256_file(p) if p.is_file() else None}


def describe_data(record: dict) -> str:
    """A data record in words: the manifest and its hash's first 12 digits, or the synthetic
    clips' settings."""
    if record.get("source") != "synthetic":
        digest = record.get("manifest_sha256")
        return f"{record.get('source')}" + (f" (sha256 {digest[:12]})" if digest else "")
    return "synthetic (" + ", ".join(f"--{k.replace('_', '-')} {record[k]}"
                                     for k in SYNTHETIC_FIELDS if k in record) + ")"


def train_loader(dcfg: DataConfig, *, batch_size: int, seed: int, rank: int = 0, world: int = 1,
                 views: int = 1, device="cpu", out=None, stop_past_limit: bool = True):
    """Shuffled epochs of this rank's share of each global batch of ``batch_size`` clips
    (``set_epoch`` reshuffles); ``labels`` / ``num_classes`` describe the whole dataset.
    Damaged clips of a manifest are replaced and named in ``out``/bad_clips.csv (under torchrun
    one file a rank, bad_clips.rank<r>.csv: data_dali/damaged.py); past
    --max-bad-clips the loader raises, or with ``stop_past_limit=False`` leaves the stop to the
    caller (the trainer sums ``loader.bad.share(rank)`` over the ranks — the run's count, earlier
    attempts included — and stops every rank).

    The data order does not depend on ``world`` (both loaders): epoch e is one permutation of
    the dataset drawn from (seed, e), global batch b is its clips [b M, (b + 1) M), and rank r
    takes slice r of it. So the clips of step s, gathered over the ranks, are the same at any
    world size, and a run resumed on another number of ranks continues the same sequence from
    its global position (epoch, batch in the epoch)."""
    if batch_size % world:
        raise ValueError(f"batch_size {batch_size} (global M) does not divide over {world} ranks; "
                         f"use a multiple of {world}")
    if dcfg.synthetic:
        return ToyLoader(synthetic_clips(dcfg, seed), batch_size, seed=seed, rank=rank,
                         world=world, views=views)
    return data_dali.build_loader(dcfg.source, batch_size=batch_size // world,
                                  clip_frames=dcfg.frames, crop=dcfg.size, shard_id=rank,
                                  num_shards=world, seed=seed, views=views, device=device,
                                  backend=dcfg.loader, num_workers=dcfg.workers,
                                  prefetch=dcfg.prefetch, augment=dcfg.augmentation,
                                  bad_clips_csv=out and rank_csv(Path(out) / "bad_clips.csv",
                                                                 rank, world),
                                  max_bad_clips=None if dcfg.max_bad_clips < 0
                                  else dcfg.max_bad_clips, stop_past_limit=stop_past_limit)


def keep_clips_on_device(loader, device) -> str:
    """The in-memory clips kept on the GPU when they take at most a quarter of its memory
    (``ToyLoader.to``; one view): each batch is then a gather there, with no host copy. Returns
    the words for the loader's log line ("" where nothing changes)."""
    device = torch.device(device)
    if not isinstance(loader, ToyLoader) or device.type != "cuda" or loader.views != 1:
        return ""
    gb, total = loader.nbytes / 2**30, torch.cuda.get_device_properties(device).total_memory
    if loader.nbytes > total // 4:
        return (f"; the clips ({gb:.1f} GiB) stay in host memory (more than a quarter of the "
                "GPU's), each batch gathered there and copied")
    loader.to(device)
    return f"; the clips ({gb:.1f} GiB) kept on {device}, each batch gathered there"


def loader_line(loader) -> str:
    """Which loader runs and why, in words (train.py logs it at the start)."""
    if isinstance(loader, ToyLoader):
        return "the in-memory synthetic clips (--data synthetic: nothing to decode)"
    name = "DALI" if loader.backend == "dali" else "the PyAV reference loader"
    return f"{name}: {loader.why}"


def clip_fetcher(loader, device):
    """(dataset index [m]) → (video, audio) of those clips on ``device``: what the pool refresh
    (``--pool-refresh``) re-encodes. The in-memory clips as they are; a manifest's clips through
    the PyAV reference dataset in this process, each with the augmentation law's draw of the
    loader's current epoch (DALI's too: one law), damaged clips replaced and recorded as in
    training. The decode runs on the host, in line with the step: its cost is the refresh's."""
    if isinstance(loader, ToyLoader):
        def fetch(index):
            batch = loader.data.batch(index.cpu())
            return batch["video"].to(device), batch["audio"].to(device)
        return fetch
    from data_dali.reference import ClipDataset

    ds = ClipDataset(loader.m, loader.index, clip_frames=loader.t, crop=loader.s,
                     train=loader.train, seed=loader.seed, need_audio=loader.need_audio,
                     need_video=loader.need_video, dtype=loader.dtype,
                     temporal_jitter=loader.jitter, bad=loader.bad, aug=loader.aug)
    pos = {i: k for k, i in enumerate(loader.index)}

    def fetch(index):
        items = [ds[(pos[i], loader.epoch)] for i in index.tolist()]
        for item in items:
            for i, reason in item.pop("bad", []):
                loader.bad.record(i, reason)
        batch = torch.utils.data.default_collate(items)
        return batch["video"].to(device), batch["audio"].to(device)
    return fetch


class SyntheticSplits:
    """Held-out instances of the synthetic clips: one split ("1"), 1/4 of each class's
    instances for testing (never in the probe's training set; ``held_out``)."""

    def __init__(self, data: ToyAV):
        self.data, self.num_classes = data, data.num_classes
        self.test_mask = held_out(data.instance)  # [n] by the clip's rank within its class

    def splits(self, wanted=None):
        if wanted and set(map(str, wanted)) != {"1"}:
            raise ValueError(f"the synthetic clips have one split ('1'), not {list(wanted)}; "
                             "drop --splits or evaluate on a prepared manifest")
        tr = torch.nonzero(~self.test_mask).flatten()
        te = torch.nonzero(self.test_mask).flatten()
        return [("split1", tr, te)]

    def batches(self, index, batch_size=64, shuffle_seed=None):
        """A callable pass -> iterable of batch dicts, as cmacc.probe expects."""
        def gen(p):
            idx = index
            if shuffle_seed is not None:
                g = torch.Generator().manual_seed(shuffle_seed + p)
                idx = index[torch.randperm(len(index), generator=g)]
            for s in range(0, len(idx), batch_size):
                yield self.data.batch(idx[s:s + batch_size])
        return gen


class ManifestClips:
    """The labelled clips of a prepared manifest that have video and audio, as the analyses that
    look at a run's own clips (``cmacc-analysis gallery`` / ``perclass``) read them: each clip
    as evaluation sees it (the centre clip of ``dcfg.frames`` frames, the centre square at
    ``dcfg.size``, no augmentation), with the same keys and attributes as the synthetic clips
    (``ToyAV``): ``batch(positions)`` → {"video", "audio", "label", "index"}, ``len``,
    ``class_names``, ``num_classes``. Cheap to make (the manifest is read, no clip decoded). A
    clip that fails to decode is left out of its batch, named in the log once."""

    def __init__(self, source, dcfg: DataConfig, seed: int):
        from data_dali.manifest import Manifest, ManifestError
        from data_dali.reference import ClipDataset

        self.m = Manifest(source)
        labels = self.m.label_array
        self.index = [i for i in self.m.select(need_video=True, need_audio=True) if labels[i] >= 0]
        if not self.index:
            raise ManifestError(f"{self.m.file}: no labelled clip with both video and audio, "
                                "which the gallery and perclass analyses read; prepare labelled "
                                "clips with their audio (class folders or a --list with labels)")
        self.ds = ClipDataset(self.m, self.index, clip_frames=dcfg.frames, crop=dcfg.size,
                              train=False, seed=seed)
        self.class_names, self.num_classes = list(self.m.class_names), self.m.num_classes
        self.labels = torch.as_tensor(labels[self.index])
        self.failed: set[int] = set()

    def __len__(self) -> int:
        return len(self.index)

    def batch(self, positions) -> dict:
        items = []
        for k in (int(p) for p in positions):
            if k in self.failed:
                continue
            try:
                items.append(self.ds[k])
            except Exception as e:  # noqa: BLE001 - PyAV/NumPy on a damaged file
                self.failed.add(k)
                row = self.m.rows[self.index[k]]
                log.warning(
                    "%s: clip %s (%s) cannot be decoded (%s); left out", self.m.file,
                    row.get("id", self.index[k]), row.get("source", ""), first_line(e, 120))
        if not items:
            return {"video": torch.zeros(0), "audio": torch.zeros(0),
                    "label": torch.zeros(0, dtype=torch.long), "index": torch.zeros(0, dtype=torch.long)}
        b = torch.utils.data.default_collate(items)
        return {"video": b["video"], "audio": b["audio"], "label": b["label"], "index": b["index"]}


def run_clips(source: str, dcfg: DataConfig, seed: int):
    """The clips of ``source`` that a run pretrained with ``dcfg`` looks at in the analyses:
    its synthetic clips, or a prepared manifest's labelled clips (``ManifestClips``)."""
    if source == "synthetic":
        return synthetic_clips(dcfg, seed)
    return ManifestClips(source, dcfg, seed)


def eval_splits(source: str, dcfg: DataConfig, seed: int, *, modality: str, frames: int | None = None):
    """Train/test splits for downstream evaluation of a run pretrained with ``dcfg``: the
    run's synthetic clips (held-out instances) or a prepared manifest's splits/folds."""
    if source == "synthetic":
        return SyntheticSplits(synthetic_clips(dcfg, seed))
    return data_dali.EvalSplits(source, modality=modality, clip_frames=frames or dcfg.frames,
                                crop=dcfg.size, seed=seed)
