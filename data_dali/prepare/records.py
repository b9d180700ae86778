"""Resuming: one record per source file (what was done, with which settings); the job that
prepares a file unless its record says it is done, and writes the record last.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

from ..fileio import atomic_write_text
from .config import _short, PrepareConfig, Reject
from .outputs import _disk_full, _record_path, _writing
from .transcode import process

log = logging.getLogger("data_dali.prepare")

RECORD_VERSION = 3  # bump when the output format changes: finished files are then redone


def _key(src: Path, item: dict, cfg: PrepareConfig, audio_only: bool) -> dict:
    p = src / item["rel"]
    try:
        st = p.stat()
        stat = [st.st_size, st.st_mtime_ns]
    except OSError:
        stat = None
    return dict(version=RECORD_VERSION, rel=item["rel"], out=item["out"], source=stat,
                cfg=asdict(cfg), audio_only=audio_only)


def _done(out: Path, rec: dict, key: dict, retry_rejects: bool) -> bool:
    if rec.get("key") != key:
        return False
    if "reject" in rec:
        return not retry_rejects
    return all((out / rec["row"][k]).is_file() for k in ("video", "audio", "mel") if rec["row"][k])


def _attempt(src: Path, out: Path, item: dict, cfg: PrepareConfig, audio_only: bool) -> dict:
    """The record of one file: its row, or why it was rejected. A full output disk is no
    fault of the file: it propagates (and stops the run)."""
    try:
        return {"row": process(src, out, item, cfg, audio_only)}
    except Reject as e:
        return {"reject": str(e)}
    except Exception as e:  # never let one file stop the run
        if _disk_full(e, out):
            raise
        log.debug("unexpected error on %s", item["rel"], exc_info=True)
        return {"reject": f"unexpected error ({_short(e)}); please report it with the file"}


def _job(args):
    src, out, item, cfg, audio_only, retry = args
    rec_path = _record_path(out, item["rel"])
    key = _key(src, item, cfg, audio_only)
    if rec_path.is_file():
        try:
            rec = json.loads(rec_path.read_text())
            if _done(out, rec, key, retry):
                return item, rec, True
        except (OSError, ValueError):
            pass  # a damaged record: redo the file
    with _writing(out, f"preparing {item['rel']}"):
        rec = _attempt(src, out, item, cfg, audio_only)
        rec["key"] = key
        atomic_write_text(rec_path, json.dumps(rec))  # last: the file is done
    return item, rec, False
