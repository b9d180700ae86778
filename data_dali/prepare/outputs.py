"""Where outputs go under OUT and whether OUT can take them: output and record names, the
free-space check before any work, a full disk told from a bad file, and removing what an
unfinished run left.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from ..cli import DISK_ERRNOS
from ..fileio import sweep_temporaries
from .config import _short, OUTPUTS, PrepareError

SPACE_FACTOR = 0.25  # outputs need at least this fraction of the sources' size (VP9 at 128 px)
LOW_SPACE = 8 << 20  # an unexpected error with less free than this on OUT: the disk is full


def _assign_outputs(items: list[dict], src: Path, out: Path) -> None:
    """Output name per item: ``it["out"]`` = its path in SRC, extension included (clips/c/a.mp4
    → clips/c/a.mp4.webm, .flac, .mel.npy), so two sources never share an output (a.mp4 and
    a.avi, y.mp4 and y.mel.mp4) and a name never depends on the other files. Names equal but
    for case (one file on case-insensitive disks) and names too long for a file system end in
    ``~`` + 8 hex digits of the path instead. Items escaping SRC, inside OUT or listed twice get
    ``it["reject"]`` and no name. A symbolic link inside SRC is a source wherever it points."""
    seen: dict[str, str] = {}
    folded = Counter(os.path.normpath(it["rel"]).lower() for it in items)
    for it in items:
        if it.get("reject"):  # rejected by the scan (a listed clip without a file)
            continue
        name = os.path.normpath(it["rel"]).replace(os.sep, "/")
        resolved = (src / name).resolve()  # a symbolic link's target may live anywhere ...
        if os.path.isabs(name) or name.split("/")[0] in ("..", "."):  # ... the link not
            it["reject"] = f"path escapes the source folder {src}; list paths must be relative to SRC"
        elif resolved == out or out in resolved.parents:
            it["reject"] = f"inside the output folder {out}: outputs are never sources"
        elif name in seen:
            it["reject"] = f"listed twice (as {seen[name]!r} before); each file is prepared once"
        else:
            seen[name] = it["rel"]
            it["rel"] = name
            it["out"] = _unique_name(name) if folded[name.lower()] > 1 or \
                len(Path(name).name.encode()) > 200 else name


def _unique_name(rel: str) -> str:
    """``rel`` cut to a safe length + ``~`` + 8 hex digits of its SHA-1: distinct and stable."""
    p = Path(rel)
    stem = p.name.encode()[:150].decode(errors="ignore")
    return (p.parent / f"{stem}~{hashlib.sha1(rel.encode()).hexdigest()[:8]}").as_posix()


def _record_path(out: Path, rel: str) -> Path:
    return out / "records" / f"{hashlib.sha1(rel.encode()).hexdigest()[:20]}.json"


def _check_space(src: Path, out: Path, items: list[dict]) -> None:
    """Fail before any work when OUT clearly cannot hold the outputs: at least SPACE_FACTOR x
    the size of the sources not prepared yet."""
    size = 0
    for it in items:
        if it.get("out") and not _record_path(out, it["rel"]).is_file():
            try:
                size += (src / it["rel"]).stat().st_size
            except OSError:
                pass  # missing: rejected later
    need, free = int(SPACE_FACTOR * size), shutil.disk_usage(out).free
    if need > free:
        raise PrepareError(f"{out}: about {_gb(need)} needed ({SPACE_FACTOR:g} x the {_gb(size)} "
                           f"of sources still to prepare) but {_gb(free)} free; free space, pick "
                           "another OUT, or pass --no-space-check if you know the outputs fit")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e7 else f"{n / 1e6:.2f} MB"


def _remove_unfinished(out: Path, items: list[dict]) -> None:
    """After a run stopped early: the outputs of files without a record (never finished, so in
    no manifest) and every temporary. Files with a record keep theirs: the manifest of an
    earlier run may list them."""
    for it in items:
        if it.get("out") and not _record_path(out, it["rel"]).is_file():
            for ext in OUTPUTS:
                (out / "clips" / (it["out"] + ext)).unlink(missing_ok=True)
    sweep_temporaries(out, recursive=True)


def _disk_full(e: BaseException, out: Path) -> bool:
    """Whether ``e`` is the output disk failing (full, over quota, read-only) rather than the
    data: by errno, or, for libraries that lose it (libsndfile), by the space left on OUT."""
    if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
        return True
    try:
        return shutil.disk_usage(out).free < LOW_SPACE
    except OSError:
        return False


@contextmanager
def _writing(out: Path, what: str):
    """Turn a full or read-only output disk into a PrepareError saying what to do."""
    try:
        yield
    except PrepareError:
        raise
    except Exception as e:
        if not _disk_full(e, out):
            raise
        raise PrepareError(f"{out}: the output disk is full or cannot be written "
                           f"({getattr(e, 'strerror', None) or _short(e)}) while {what}; free space "
                           "or pick another OUT, then run the same command again (finished files "
                           "are kept and skipped)") from None
