"""Typed configuration. Each dataclass rejects bad values in ``__post_init__`` with a
``ValueError`` that names the field and what to do; ``train.py`` maps argparse onto these."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from .encoders import VIDEO_ARCHS

OBJECTIVES = ("cross", "smoco")  # cross-modal (XMoCo / CM-ACC) or unimodal SMoCo
SAMPLERS = ("random", "active", "active-feature", "ohem")
GRAD_VIEWS = ("head", "queries")
POOL_MODES = ("rolling", "epoch")
DICT_INITS = ("encode", "random")


@dataclass
class ModelConfig:
    objective: str = "cross"
    sampler: str = "active"  # "random" = XMoCo, "active" = CM-ACC
    grad_view: str = "head"
    pool_mode: str = "rolling"
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
    pool_size: int = 300 * 128  # N
    tau: float = 0.7
    tau_p: float = 1.0  # pseudo-posterior temperature (paper eq. 5: 1)
    momentum: float = 0.999
    seed: int = 0

    def __post_init__(self):
        self.video_layers = tuple(self.video_layers)
        self.audio_layers = tuple(self.audio_layers)
        _choice("objective", self.objective, OBJECTIVES)
        _choice("sampler", self.sampler, SAMPLERS)
        _choice("grad_view", self.grad_view, GRAD_VIEWS)
        _choice("pool_mode", self.pool_mode, POOL_MODES)
        _choice("video_arch", self.video_arch, VIDEO_ARCHS)
        for name in ("video_width", "audio_width", "n_mels", "dim", "fcl_dim", "batch_size",
                     "dict_size", "pool_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dict_size < self.batch_size:
            raise ValueError(
                f"dict_size K={self.dict_size} must be >= batch_size M={self.batch_size} (each "
                "step enqueues M keys); the paper uses K = 30 * M"
            )
        if self.sampler != "random" and self.pool_size < self.dict_size + self.batch_size:
            raise ValueError(
                f"pool_size N={self.pool_size} must be >= K + M = "
                f"{self.dict_size + self.batch_size} for sampler {self.sampler!r} (candidates "
                "already in the dictionary are excluded); the paper uses N = 300 * M"
            )
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.tau <= 0 or self.tau_p <= 0:
            raise ValueError(f"temperatures must be > 0, got tau={self.tau}, tau_p={self.tau_p}")
        if self.objective == "smoco" and self.sampler != "random":
            raise ValueError(
                f"objective 'smoco' (unimodal MoCo baseline) uses random sampling; got sampler "
                f"{self.sampler!r}: pass --sampler random"
            )

    @property
    def method(self) -> str:
        if self.objective == "smoco":
            return "SMoCo"
        name = {"random": "XMoCo", "active": "CM-ACC", "active-feature": "CM-ACC(feature)",
                "ohem": "XMoCo+OHEM"}[self.sampler]
        return name if self.fcl else f"{name} (w/o fcl)"


def _choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {choices}")


def to_dict(cfg) -> dict:
    """Plain containers only (safe for weights_only checkpoints and JSON)."""
    d = dataclasses.asdict(cfg)
    return json.loads(json.dumps(d))


def config_hash(*cfgs) -> str:
    blob = json.dumps([to_dict(c) for c in cfgs], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class TrainConfig:
    steps: int = 1000
    lr: float = 1e-3
    warmup: int = 500  # iterations of linear warm-up (paper: Adam 1e-3 after 500)
    weight_decay: float = 0.0
    log_every: int = 10
    amp: str = "none"  # none | bf16 | fp16
    channels_last: bool = True
    dict_init: str = "encode"
    out: str = "runs/default"
    device: str = "cpu"
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {self.log_every}")
        _choice("amp", self.amp, ("none", "bf16", "fp16"))
        _choice("dict_init", self.dict_init, DICT_INITS)
        _choice("device", self.device, ("cpu", "cuda"))
