"""Typed configuration: one dataclass per concern, the presets as instances, and the JSON
round trip a checkpoint stores.

    Config(model=ModelConfig(...), selection=SelectionConfig(...), data=DataConfig(...),
           optim=OptimConfig(...), run=RunConfig(...))

Each dataclass rejects bad values in ``__post_init__`` with a one-line ``ValueError`` that
names the field and what to do; ``Config`` adds the checks that span concerns (pool vs
dictionary size, SMoCo's sampler, the batch split over ranks). ``train.py`` maps its flags onto
these fields; the apps derive their runs from a preset with ``Config.replace``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field

import kernels
from data_dali.augment import AUGMENTS, SCALE, Augment, augment_names
from data_dali.classdist import zipf_exponent

from .encoders import VIDEO_ARCHS, backbone_features

OBJECTIVES = ("cross", "smoco")  # cross-modal (XMoCo / CM-ACC) or unimodal SMoCo
SAMPLERS = ("random", "active", "active-feature", "ohem", "pool-random")
GRAD_VIEWS = ("head", "queries")
POOL_MODES = ("rolling", "epoch")
SELECT_PRECISIONS = ("ieee", "tf32x3", "tf32")  # tl.dot input precision of the embedding kernel
SELECT_FACTORS = ("fp32", "bf16")  # storage of the gradient-embedding factors
KMEANS_VARIANTS = ("steps", "persistent")  # k-means++: a launch per step, or one persistent one
# k-means++ on a GPU: the variant measured fastest on the device for the pool (auto), every D
# each step (eager: --kmeans's variant), the lazy race, or the factors resident on chip in one
# cooperative launch (pools that do not fit run the per-step variant): kernels/triton_select.py
DIST_BACKENDS = ("auto", "nccl", "gloo")  # torch.distributed backends a run may use
SELECT_IMPLS = ("auto", "eager", "lazy", "resident")
DICT_INITS = ("encode", "random")
AMPS = ("none", "bf16", "fp16")
LOADERS = ("auto", "dali", "reference")


def _choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {choices}")


def _positive(obj, *names):
    for name in names:
        if getattr(obj, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(obj, name)}")


def _at_most(obj, **limits):
    """Numbers past any sensible run (``--lr 1e38``, a width of 10**9): a ValueError naming the
    field and its range, before they overflow or allocate deep inside torch."""
    for name, hi in limits.items():
        v = getattr(obj, name)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v <= hi):
            raise ValueError(f"{name} must be a number <= {hi:g}, got {v!r}")


MAX_STAGES = 6  # residual stages per backbone (ResNet-18: 4)
SEEDS = 2 ** 31  # seeds are in [0, SEEDS): DALI's seed and the loaders' (seed, epoch) mix fit


@dataclass
class ModelConfig:
    """The networks and the contrastive objective (docs/DESIGN.md §1)."""

    objective: str = "cross"
    fcl: bool = True
    video_arch: str = "r3d_18"
    video_width: int = 64
    video_layers: tuple[int, ...] = (2, 2, 2, 2)
    audio_width: int = 64
    audio_layers: tuple[int, ...] = (2, 2, 2, 2)
    n_mels: int = 80
    dim: int = 128  # d: key/query dimension
    fcl_dim: int = 512  # d_h when fcl is on
    batch_size: int = 128  # M: global mini-batch
    dict_size: int = 30 * 128  # K
    tau: float = 0.7
    momentum: float = 0.999
    seed: int = 0

    def __post_init__(self):
        self.video_layers = tuple(self.video_layers)
        self.audio_layers = tuple(self.audio_layers)
        _choice("objective", self.objective, OBJECTIVES)
        _choice("video_arch", self.video_arch, VIDEO_ARCHS)
        _positive(self, "video_width", "audio_width", "n_mels", "dim", "fcl_dim", "batch_size",
                  "dict_size")
        if self.batch_size < 2:  # 1 clip whose last map is 1x1x1: "Expected more than 1 value"
            raise ValueError(f"batch_size M={self.batch_size}: BatchNorm in training needs at "
                             "least 2 clips per batch; use --batch-size 2 or more")
        if self.dict_size < self.batch_size:
            raise ValueError(f"dict_size K={self.dict_size} must be >= batch_size M="
                             f"{self.batch_size} (each step enqueues M keys); the paper uses K = 30 * M")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.tau <= 0:
            raise ValueError(f"tau must be > 0, got {self.tau}")
        _at_most(self, video_width=4096, audio_width=4096, n_mels=1024, dim=65536,
                 fcl_dim=65536, batch_size=2 ** 20, dict_size=2 ** 26, tau=1e3)
        if not 0 <= self.seed < SEEDS:
            raise ValueError(f"seed must be in [0, {SEEDS}), got {self.seed}")
        for name in ("video_layers", "audio_layers"):
            layers = getattr(self, name)
            if not (1 <= len(layers) <= MAX_STAGES
                    and all(isinstance(n, int) and 1 <= n <= 64 for n in layers)):
                raise ValueError(f"{name}={layers}: 1 to {MAX_STAGES} stages of 1 to 64 residual "
                                 "blocks each, e.g. (2, 2, 2, 2) (ResNet-18)")
        self._check_fcl_shapes()

    def _check_fcl_shapes(self):
        """The cross-modal fcl: each modality's key fcl follows the OTHER modality's query fcl
        (cmacc/model.py), so both fcl layers [d_h, c] need the same backbone feature width c."""
        if not (self.fcl and self.objective == "cross"):
            return
        cv = backbone_features(self.video_width, self.video_layers)
        ca = backbone_features(self.audio_width, self.audio_layers)
        if cv != ca:
            stages = 2 ** (len(self.audio_layers) - 1)
            fix = (f"--audio-width {cv // stages}" if cv % stages == 0
                   else "equal backbone widths")
            raise ValueError(f"fcl: the video backbone gives {cv} features (video_width="
                             f"{self.video_width}) and the audio backbone {ca} (audio_width="
                             f"{self.audio_width}), but the cross-modal fcl layers need equal "
                             f"widths: set {fix}, or --no-fcl")


@dataclass
class SelectionConfig:
    """What is enqueued into the dictionaries each step, and from which pool
    (docs/DESIGN.md §1)."""

    sampler: str = "active"  # "random" = XMoCo, "active" = CM-ACC
    grad_view: str = "head"
    pool_mode: str = "rolling"
    pool_size: int = 300 * 128  # N
    tau_p: float = 1.0  # pseudo-posterior temperature (paper eq. 5: 1)
    # how the selection runs on a GPU (kernels.select); the CPU reference computes in fp32
    precision: str = "ieee"
    factors: str = "fp32"
    kmeans: str = "steps"  # not measured on a GPU yet: the default stays the per-step variant
    impl: str = "auto"  # the k-means++ variant on a GPU (SELECT_IMPLS); every one, the same picks
    overlap: bool = True  # CUDA: select on a side stream while the key encoders run
    pool_refresh: int = 0  # R: batches of M pool entries re-encoded per step by the current key
    # encoders, round robin, so no candidate's key is older than N / (R * M) steps (0: none, the
    # paper's Algorithm 1, whose pool keys are as old as the pool)

    # added after checkpoints existed: they count in config_hash only away from their default,
    # and those that cannot change a result (kmeans, impl, overlap) never count
    _HASH_IF_SET = ("precision", "factors", "pool_refresh")
    _HASH_NEVER = ("kmeans", "impl", "overlap")

    def __post_init__(self):
        _choice("sampler", self.sampler, SAMPLERS)
        _choice("precision", self.precision, SELECT_PRECISIONS)
        _choice("factors", self.factors, SELECT_FACTORS)
        _choice("kmeans", self.kmeans, KMEANS_VARIANTS)
        _choice("impl", self.impl, SELECT_IMPLS)
        if self.impl not in ("eager", "auto") and self.kmeans == "persistent":
            raise ValueError(f"--select-impl {self.impl} runs its own launches: it has no "
                             "persistent variant; drop --kmeans persistent or use "
                             "--select-impl eager")
        _choice("grad_view", self.grad_view, GRAD_VIEWS)
        _choice("pool_mode", self.pool_mode, POOL_MODES)
        _positive(self, "pool_size")
        if self.pool_refresh < 0:
            raise ValueError(f"pool_refresh must be >= 0 batches per step, got {self.pool_refresh}")
        if self.tau_p <= 0:
            raise ValueError(f"tau_p must be > 0, got {self.tau_p}")
        _at_most(self, pool_size=2 ** 26, tau_p=1e3, pool_refresh=2 ** 16)

    @property
    def kmeans_variant(self) -> str:
        """kernels.select's ``variant``: the lazy race, the resident kernel, the eager variant
        asked for (--select-impl eager, or --kmeans persistent), or "auto" (the plan's choice
        by measured speed on the device)."""
        if self.impl == "auto":
            return "auto" if self.kmeans == "steps" else self.kmeans
        return self.impl if self.impl in ("lazy", "resident") else self.kmeans


@dataclass
class DataConfig:
    """Where clips come from and their shape: a prepared manifest or the synthetic clips."""

    source: str = "synthetic"  # "synthetic" (in-memory clips) or a manifest.csv path
    frames: int = 16  # T
    size: int = 112  # crop side S
    loader: str = "auto"  # manifest backend: DALI, the PyAV reference, or auto
    workers: int = 2  # reference-loader worker processes (DALI: decoder threads)
    prefetch: int = 2  # batches decoded ahead: loader memory does not grow with the epoch
    max_bad_clips: int = -1  # damaged clips skipped before the run stops (-1: 1%, at least 10)
    augment: tuple = AUGMENTS  # manifest: training augmentations that run (data_dali/augment.py)
    crop_scale: float = SCALE[0]  # manifest: smallest crop area, as a fraction of the frame
    # synthetic clips only
    clips: int = 1024
    classes: int = 10
    redundancy: float = 0.0
    noise: float = 0.3
    class_dist: str = "uniform"  # clips per class: "uniform" or "zipf:S" (share ∝ 1/(c+1)^S)

    def __post_init__(self):
        _choice("loader", self.loader, LOADERS)
        _positive(self, "frames", "size", "clips", "classes")
        self.augment = augment_names(self.augment)  # (a JSON config's list, too)
        bad = [a for a in self.augment if a not in AUGMENTS]
        if bad:
            raise ValueError(f"augment {bad} not among {AUGMENTS} (or none)")
        if not 0 < self.crop_scale <= 1:
            raise ValueError(f"crop_scale must be in (0, 1], got {self.crop_scale}")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")
        if self.max_bad_clips < -1:
            raise ValueError(f"max_bad_clips must be >= 0 (or -1: 1% of the clips, at least 10), "
                             f"got {self.max_bad_clips}")
        if not 1 <= self.prefetch <= 64:
            raise ValueError(f"prefetch must be in [1, 64] batches, got {self.prefetch}")
        if not 0.0 <= self.redundancy < 1.0:
            raise ValueError(f"redundancy must be in [0, 1), got {self.redundancy}")
        if self.noise < 0:
            raise ValueError(f"noise must be >= 0, got {self.noise}")
        _at_most(self, frames=4096, size=4096, clips=2 ** 24, classes=2 ** 20, workers=256,
                 noise=1e3)
        zipf_exponent(self.class_dist, flag="--class-dist (class_dist)")

    @property
    def synthetic(self) -> bool:
        return self.source == "synthetic"

    @property
    def augmentation(self) -> Augment:
        """The loaders' training augmentation (a manifest's; the synthetic clips have none)."""
        return Augment(self.augment, (self.crop_scale, SCALE[1]))


@dataclass
class OptimConfig:
    """Optimiser, schedule and numerics."""

    lr: float = 1e-3
    warmup: int = 500  # iterations of linear warm-up (paper: Adam 1e-3 after 500)
    weight_decay: float = 0.0
    amp: str = "none"  # autocast dtype
    channels_last: bool = True  # channels_last_3d video encoders
    compile: bool = False  # torch.compile the backbones
    cudnn_benchmark: bool = True  # CUDA: cuDNN times its convolution algorithms for the shapes

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.warmup < 0 or self.weight_decay < 0:
            raise ValueError(f"warmup and weight_decay must be >= 0, got {self.warmup}, "
                             f"{self.weight_decay}")
        _at_most(self, lr=10.0, weight_decay=10.0)
        _choice("amp", self.amp, AMPS)

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then constant."""
        return self.lr * min(1.0, (step + 1) / self.warmup) if self.warmup else self.lr


@dataclass
class RunConfig:
    """Length, outputs, resumption and devices of one run."""

    steps: int = 1000
    out: str = "runs/default"
    resume: str = "auto"  # auto | none | a checkpoint path
    device: str = "cpu"
    log_every: int = 10
    ckpt_every: int = 0  # 0: only at the end (and on a stop signal)
    tensorboard: bool = False
    dict_init: str = "encode"
    shuffle_bn: bool = True
    keep: int = 3  # checkpoints of this run kept in OUT (the newest valid one always)
    on_nonfinite: str = "stop"  # a NaN/Inf loss or gradient: stop, or skip the step
    max_nonfinite: int = 10  # with "skip": stop once more steps than this were skipped
    # seconds a collective waits for a rank that never joins (a lost node) before the
    # survivors fail and torchrun restarts them: docs/RELIABILITY.md, "A lost node"
    dist_timeout: float = 300.0
    # torch.distributed's backend: auto = NCCL on CUDA, gloo on the CPU; gloo on CUDA tensors
    # lets several ranks share one GPU (a test of the distributed paths before a cluster)
    dist_backend: str = "auto"

    def __post_init__(self):
        _positive(self, "steps", "log_every", "keep")
        _choice("on_nonfinite", self.on_nonfinite, ("stop", "skip"))
        if self.max_nonfinite < 0:
            raise ValueError(f"max_nonfinite must be >= 0, got {self.max_nonfinite}")
        if self.ckpt_every < 0:
            raise ValueError(f"ckpt_every must be >= 0, got {self.ckpt_every}")
        _at_most(self, steps=2 ** 40, log_every=2 ** 40, ckpt_every=2 ** 40, keep=2 ** 20,
                 max_nonfinite=2 ** 40)
        _choice("device", self.device, ("cpu", "cuda"))
        _choice("dict_init", self.dict_init, DICT_INITS)
        _choice("dist_backend", self.dist_backend, DIST_BACKENDS)
        if not (isinstance(self.dist_timeout, (int, float)) and 1 <= self.dist_timeout <= 86400):
            raise ValueError(f"dist_timeout must be 1 to 86400 seconds, got {self.dist_timeout!r}")


SECTIONS = {"model": ModelConfig, "selection": SelectionConfig, "data": DataConfig,
            "optim": OptimConfig, "run": RunConfig}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        check_method(self.model, self.selection)

    def check_selection_batch(self):
        """Every sampler but random embeds the candidates against the M queries of the global
        batch; on CUDA that is the Triton kernel, which holds a softmax row in one tile (at most
        kernels.TRITON_MAX_M). A run checks this at its start (cmacc.trainer.Trainer), not at
        the first active step K/M + 1 steps in; a stored config (evaluation) is not checked."""
        if self.selection.sampler == "random":
            return
        limit = kernels.max_queries(self.run.device)
        m = self.model.batch_size
        if limit is not None and m > limit:
            raise ValueError(f"batch_size M={m}: on {self.run.device} the {self.selection.sampler}"
                             f" sampler's Triton kernels take at most {limit} pseudo-labels (the "
                             f"global batch); use --batch-size <= {limit}, --sampler random, or "
                             "CMACC_KERNELS=reference (the PyTorch selection, slower)")

    def replace(self, **sections: dict) -> Config:
        """A copy with fields overridden per section, re-validated:
        ``cfg.replace(run=dict(steps=10), selection=dict(sampler="random"))``."""
        bad = sorted(set(sections) - set(SECTIONS))
        if bad:
            raise ValueError(f"unknown config sections {bad}; use {sorted(SECTIONS)}")
        parts = {name: getattr(self, name) for name in SECTIONS}
        for name, values in sections.items():
            fields = {f.name for f in dataclasses.fields(SECTIONS[name])}
            unknown = sorted(set(values) - fields)
            if unknown:
                raise ValueError(f"unknown {name} settings {unknown}; valid: {sorted(fields)}")
            parts[name] = dataclasses.replace(parts[name], **values)
        return Config(**parts)

    def to_dict(self) -> dict:
        """Plain containers only (safe for weights_only checkpoints and JSON)."""
        return {name: to_dict(getattr(self, name)) for name in SECTIONS}

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        return cls(**{name: SECTIONS[name](**d[name]) for name in SECTIONS if name in d})

    @property
    def method(self) -> str:
        return method_name(self.model, self.selection)


def check_method(model: ModelConfig, sel: SelectionConfig) -> None:
    """Checks that span the model and the selection."""
    if model.objective == "smoco" and sel.sampler != "random":
        raise ValueError(f"objective 'smoco' (unimodal MoCo baseline) uses random sampling; got "
                         f"sampler {sel.sampler!r}: pass --sampler random")
    if sel.sampler != "random" and sel.pool_size < model.dict_size + model.batch_size:
        raise ValueError(
            f"pool_size N={sel.pool_size} must be >= K + M = {model.dict_size + model.batch_size} "
            f"for sampler {sel.sampler!r} (candidates already in the dictionary are excluded); "
            "the paper uses N = 300 * M")


def method_configs(**fields) -> tuple[ModelConfig, SelectionConfig]:
    """(ModelConfig, SelectionConfig) from one flat set of fields, each to its dataclass:
    ``CMACC(*method_configs(sampler="random", batch_size=8, dict_size=16))``."""
    names = {f.name for f in dataclasses.fields(SelectionConfig)}
    sel = {k: v for k, v in fields.items() if k in names}
    model = ModelConfig(**{k: v for k, v in fields.items() if k not in names})
    selection = SelectionConfig(**sel)
    check_method(model, selection)
    return model, selection


def method_name(model: ModelConfig, sel: SelectionConfig) -> str:
    if model.objective == "smoco":
        return "SMoCo"
    name = {"random": "XMoCo", "active": "CM-ACC", "active-feature": "CM-ACC(feature)",
            "ohem": "XMoCo+OHEM", "pool-random": "XMoCo(pool)"}[sel.sampler]
    return name if model.fcl else f"{name} (w/o fcl)"


def to_dict(cfg) -> dict:
    """A dataclass as plain containers (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def hashed_fields(c, d: dict | None = None) -> dict:
    """The fields of config ``c`` (a dataclass) that count in ``config_hash``, as plain
    containers; ``d``: the same section as a checkpoint stored it (``to_dict``), read under
    ``c``'s type's rules instead."""
    d = dict(to_dict(c) if d is None else d)
    for name in getattr(c, "_HASH_NEVER", ()):
        d.pop(name, None)
    for name in getattr(c, "_HASH_IF_SET", ()):
        if d.get(name) == getattr(type(c), name):
            d.pop(name, None)
    return d


def config_hash(*cfgs) -> str:
    """What must match for a checkpoint to resume: a short hash of these configs."""
    blob = json.dumps([hashed_fields(c) for c in cfgs], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


NOT_SET = "(not recorded)"
# the train.py flag of a model/selection field where it is not --<field with dashes>; None: no
# flag (the preset sets it). tests/test_train.py checks these against train.py's flags.
FLAG_OF = {"precision": "--select-precision", "factors": "--select-factors",
           "impl": "--select-impl", "fcl": None, "fcl_dim": None, "n_mels": None,
           "overlap": None}


def as_flag(name: str, value) -> str:
    """A model/selection field and its value as the command line says it (``--sampler
    random``, ``--video-layers 1 1 1 1``, ``--no-fcl``); a field without a flag as
    ``name=value``."""
    if name == "fcl" and isinstance(value, bool):
        return "--fcl" if value else "--no-fcl"
    shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    flag = FLAG_OF.get(name, "--" + name.replace("_", "-"))
    return f"{flag} {shown}" if flag else f"{name}={shown}"


def config_differences(stored: dict, *cfgs) -> list[tuple[str, object, object]]:
    """(field, value stored, value now) of every field that counts in ``config_hash`` and
    differs between a checkpoint's config (``stored``: its ``to_dict``, sections by name) and
    ``cfgs`` (e.g. the ModelConfig and SelectionConfig of the new command); a field the
    checkpoint lacks reads as its default where the hash rules say so, else ``NOT_SET``."""
    out = []
    for c in cfgs:
        section = next(k for k, v in SECTIONS.items() if isinstance(c, v))
        now = hashed_fields(c)
        then = hashed_fields(c, (stored or {}).get(section) or {})
        for name in [f.name for f in dataclasses.fields(c)]:
            if name in now or name in then:
                a = then.get(name, getattr(type(c), name) if name in getattr(
                    c, "_HASH_IF_SET", ()) else NOT_SET)
                b = now.get(name, getattr(type(c), name))
                if a != b:
                    out.append((name, a, b))
    return out


PRESETS = {
    # docs/DESIGN.md §1 / paper §5: M=128, K=30M, N=300M, tau=0.7, m=0.999, Adam 1e-3, 500 warm-up
    "paper": Config(model=ModelConfig(batch_size=128, dict_size=30 * 128),
                    selection=SelectionConfig(pool_size=300 * 128),
                    data=DataConfig(frames=16, size=112),
                    optim=OptimConfig(lr=1e-3, warmup=500, amp="bf16"),
                    run=RunConfig(steps=100_000, out="runs/paper")),
    # CPU in seconds: narrow, shallow encoders on 8x32x32 clips
    "tiny": Config(model=ModelConfig(batch_size=16, dict_size=64, video_width=8,
                                     video_layers=(1, 1, 1, 1), audio_width=8,
                                     audio_layers=(1, 1, 1, 1), fcl_dim=64, dim=32, momentum=0.99),
                   selection=SelectionConfig(pool_size=192),
                   data=DataConfig(frames=8, size=32, clips=256, classes=8, noise=1.0),
                   optim=OptimConfig(lr=1e-3, warmup=10, amp="none"),
                   run=RunConfig(steps=200, log_every=10, out="runs/tiny")),
}
