"""Checkpoints: atomic writes, weights_only loads, newest-valid resume, per-run retention, RNG
state capture.

A checkpoint holds plain containers and tensors only (configs as dicts, RNG states as
tensors), so ``torch.load(..., weights_only=True)`` loads it and evaluating a checkpoint that
someone shared never runs code.
"""

from __future__ import annotations

import json
import logging
import pickle
import random
import re
import uuid
from pathlib import Path

import numpy as np
import torch

from data_dali.cli import first_line
from data_dali.fileio import atomic_path, atomic_write_text

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


def why_unloadable(e: BaseException) -> str:
    """Why ``load`` failed, in our words. torch's own message on a weights-only refusal advises
    loading with ``weights_only=False``: the one thing never to do with a file one did not
    write (it runs whatever code the file holds), so that text is never passed on."""
    if isinstance(e, pickle.UnpicklingError):
        return ("it holds objects other than tensors and plain containers, which a safe "
                "(weights-only) load refuses; it was not written by train.py")
    if isinstance(e, EOFError):
        return "empty or truncated"
    if isinstance(e, OSError):
        return e.strerror or first_line(e, 160)
    msg = first_line(e, 160)
    if "weights_only" in msg.lower() or "weights only" in msg.lower():
        return "a safe (weights-only) load refuses it: not a checkpoint of tensors and plain containers"
    if "PytorchStreamReader" in msg or "zip archive" in msg:
        return "damaged: not a complete torch file (truncated or overwritten)"
    return msg


def validate(path, ck, run_id=None) -> dict:
    """``ck`` if it is a usable checkpoint (of ``run_id`` when given), else ValueError(why)."""
    if not isinstance(ck, dict) or "step" not in ck or "model" not in ck:
        raise ValueError("not a train.py checkpoint (no 'step'/'model')")
    if run_id is not None and ck.get("run_id") != run_id:
        raise ValueError(f"belongs to run {ck.get('run_id')!r}, not this folder's run {run_id!r}")
    return ck


def find_latest_valid(out_dir, run_id: str | None = None) -> tuple[Path, dict] | None:
    """Newest checkpoint in ``out_dir`` that loads (and, given ``run_id``, belongs to that run).
    Each one skipped is logged with the reason; the chosen one too."""
    d = Path(out_dir)
    if not d.is_dir():
        return None
    cands = sorted((p for p in d.iterdir() if _NAME.match(p.name)), reverse=True)
    for p in cands:
        try:
            ck = validate(p, load(p), run_id)
        except Exception as e:  # a partial, corrupt or foreign file: never used, never fatal
            log.warning("skipping checkpoint %s: %s", p, why_unloadable(e))
            continue
        log.info("newest valid checkpoint in %s: %s (step %d)", d, p.name, ck["step"])
        return p, ck
    return None


# ----------------------------------------------------------------------------------------------
# A run's checkpoints in its folder
# ----------------------------------------------------------------------------------------------
RUN_FILE = "run.json"


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def read_run(out_dir) -> dict | None:
    """OUT/run.json: the run id of the folder and the checkpoints that run wrote."""
    p = Path(out_dir) / RUN_FILE
    if not p.is_file():
        return None
    try:
        info = json.loads(p.read_text())
        if not isinstance(info, dict) or not isinstance(info.get("run_id"), str):
            raise ValueError("no run_id")
    except ValueError as e:
        raise ValueError(f"{p} is not a run record ({e}); move it away or use another --out") from None
    info.setdefault("checkpoints", [])
    return info


class Checkpoints:
    """The checkpoints of one run in one folder. ``save`` writes atomically (temporary file,
    fsync, rename), reads the file back, records it in OUT/run.json, and only then deletes this
    run's older checkpoints beyond ``keep`` — never another run's, never the newest valid one."""

    def __init__(self, out_dir, run_id: str, keep: int = 3, writer: bool = True):
        """``writer=False`` (ranks other than 0, which never save): OUT/run.json is not read
        (a partial read on a network filesystem must not fail a rank that needs nothing of it)."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.out, self.run_id, self.keep = Path(out_dir), run_id, keep
        info = read_run(self.out) if writer else None
        self.mine = list(info["checkpoints"]) if info and info["run_id"] == run_id else []
        self.last: Path | None = None  # the newest valid checkpoint of this run

    def save(self, state: dict, step: int) -> Path:
        state = dict(state, run_id=self.run_id, step=step)
        path = checkpoint_path(self.out, step)
        save_atomic(state, path)
        validate(path, load(path), self.run_id)  # read back: what is on disk is whole
        self.mine = [n for n in self.mine if n != path.name] + [path.name]
        self.last = path
        self._record()  # the new checkpoint is on record before any old one goes
        old, self.mine = self.mine[:-self.keep], self.mine[-self.keep:]
        for name in old:  # oldest first; the newest (just read back) stays
            (self.out / name).unlink(missing_ok=True)
        if old:
            self._record()
        return path

    def _record(self):
        atomic_write_text(self.out / RUN_FILE, json.dumps(
            {"run_id": self.run_id, "checkpoints": self.mine}, indent=2))


# ----------------------------------------------------------------------------------------------
# An agreed stop, for torchrun's restarts of the same job
# ----------------------------------------------------------------------------------------------
STOP_FILE = "stopped.json"


def write_stop(out_dir, line: str, code: int, job: str, step: int) -> None:
    """OUT/stopped.json: the one line (and exit code) with which every rank of torchrun job
    ``job`` (TORCHELASTIC_RUN_ID) stopped at ``step``."""
    atomic_write_text(Path(out_dir) / STOP_FILE, json.dumps(
        {"job": job, "line": line, "code": int(code), "step": int(step)}, indent=2))


def read_stop(out_dir, job: str) -> dict | None:
    """The agreed stop recorded for torchrun job ``job``, or None (none, another job's, or a
    file that does not read as one: a restart then trains as it would without it)."""
    p = Path(out_dir) / STOP_FILE
    try:
        stop = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stop, dict) or stop.get("job") != job or not isinstance(stop.get("line"), str):
        return None
    return dict(stop, code=2 if stop.get("code") != 1 else 1)


def clear_stop(out_dir) -> None:
    """A new job (the first attempt of a torchrun command) starts without the old record."""
    (Path(out_dir) / STOP_FILE).unlink(missing_ok=True)
