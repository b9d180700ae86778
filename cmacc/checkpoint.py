"""Checkpoints: atomic writes, weights_only loads, latest-valid resume, RNG state capture.

A checkpoint holds plain containers and tensors only (configs as dicts, RNG states as
tensors), so ``torch.load(..., weights_only=True)`` loads it and evaluating a checkpoint that
someone shared never runs code.
"""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path

import numpy as np
import torch

from data_dali.fileio import atomic_path

log = logging.getLogger(__name__)
_NAME = re.compile(r"^ckpt_(\d{8})\.pt$")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(),
             "numpy": torch.from_numpy(np.frombuffer(
                 np.random.get_state()[1].astype(np.uint32).tobytes(), dtype=np.uint8).copy()),
             "python": torch.tensor(random.getstate()[1], dtype=torch.int64)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    keys = np.frombuffer(state["numpy"].numpy().tobytes(), dtype=np.uint32)
    np.random.set_state(("MT19937", keys, 624, 0, 0.0))
    random.setstate((3, tuple(int(x) for x in state["python"].tolist()), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_atomic(obj, path) -> Path:
    """Write ``obj`` to ``path`` (temporary sibling, fsync, rename): a crash leaves either the
    old file or the new one, never a partial one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
    return path


def checkpoint_path(out_dir, step: int) -> Path:
    return Path(out_dir) / f"ckpt_{step:08d}.pt"


def load(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def find_latest_valid(out_dir) -> tuple[Path, dict] | None:
    """Newest checkpoint in ``out_dir`` that loads; corrupt ones are skipped with a warning."""
    d = Path(out_dir)
    if not d.is_dir():
        return None
    cands = sorted((p for p in d.iterdir() if _NAME.match(p.name)), reverse=True)
    for p in cands:
        try:
            ck = load(p)
            if not isinstance(ck, dict) or "step" not in ck or "model" not in ck:
                raise ValueError("missing 'step'/'model'")
            return p, ck
        except Exception as e:  # a partial or corrupt file: never loaded, never fatal
            log.warning("skipping unreadable checkpoint %s (%s)", p, e)
    return None


def prune(out_dir, keep: int = 3) -> None:
    d = Path(out_dir)
    cands = sorted(p for p in d.iterdir() if _NAME.match(p.name))
    for p in cands[:-keep]:
        p.unlink(missing_ok=True)
