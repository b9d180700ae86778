"""A run of the MI study in progress, on disk: ``train_one`` writes its whole state at the end
of every window of steps (``save``), and a run started again with the same file continues from
the last window written (``load``), bit for bit as if it had not stopped. A long run (6,000
steps at l = 3 is over an hour of one CPU core) then loses at most one window's steps to a
stop, a full disk or the end of a session.

The file holds the model and optimizer states, every random state the run draws from (its own
generator and torch's global one: the shuffled key encoders' permutations), the epoch order
and position, the history and the measurements' records so far, and the wall and CPU seconds
spent. It names what it belongs to (method, seed, the pairs' count and every MIConfig field):
a file of another run is refused, never continued and never overwritten."""

from __future__ import annotations

import dataclasses
import io
from datetime import datetime, timezone
from pathlib import Path

import torch

from data_dali.cli import UserError
from data_dali.fileio import atomic_write_bytes


def utc_now() -> str:
    """The time now in UTC, ISO 8601 to the second: ``2026-11-27T21:57:03Z``."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def identity(method: str, seed: int, n_train: int, cfg) -> dict:
    """What a partial run belongs to: it continues only a run with all of these equal."""
    return {"method": method, "seed": int(seed), "n_train": int(n_train),
            "cfg": dataclasses.asdict(cfg)}


def save(path: Path, ident: dict, state: dict) -> None:
    """Write ``state`` (tensors, lists, dicts, numbers) for the run ``ident``, atomically: a
    stop during the write leaves the previous window's file."""
    buf = io.BytesIO()
    torch.save({"identity": ident, **state}, buf)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue())


def load(path: Path | None, ident: dict) -> dict | None:
    """The state written for the run ``ident`` at ``path``; None if there is none. A file
    that is not such a state, or is another run's, is a UserError naming it and the fix."""
    if path is None or not Path(path).is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated or foreign file: name it, never guess
        raise UserError(f"{path}: not a readable partial MI run ({type(e).__name__}: {e}); "
                        "move it away to start that run from step 0") from None
    got = state.get("identity") if isinstance(state, dict) else None
    if got != ident:
        diff = ("not a partial MI run" if not isinstance(got, dict) else ", ".join(
            f"{k}: {got.get(k)!r} here, {v!r} asked" for k, v in ident.items()
            if got.get(k) != v and k != "cfg") or ", ".join(
            f"{k}: {got['cfg'].get(k)!r} here, {v!r} asked"
            for k, v in ident["cfg"].items() if got.get("cfg", {}).get(k) != v))
        raise UserError(f"{path} belongs to another run ({diff}); it is kept: move it away, "
                        "or run with the settings it was written with")
    return state
