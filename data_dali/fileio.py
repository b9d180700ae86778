"""Atomic file writes for every writer of the project.

A reader sees the old file or the new one, never half of one, and a killed writer leaves only
a temporary that the next run sweeps.

    with atomic_path(out / "clip.webm") as tmp:   # .clip.webm.tmp<pid>.webm, same folder
        encode(tmp)                               # exception: tmp removed, clip.webm untouched
    atomic_write_text(out / "manifest.csv", text)
    atomic_write_bytes(out / "x.bin", data)
    sweep_temporaries(out, recursive=True)        # what a killed run left behind
    write_failure(e, out)                         # why a write failed, in one line

The temporary is a hidden sibling (same folder, so ``os.replace`` is atomic) named after the
target and the writing process, ending in the target's extension so that encoders which pick the
format by name (PyAV, soundfile, ``np.save``) write the right one. On success the file is
fsync'ed before the rename; ``fsync_dir`` also makes the rename itself durable.

Standard library only (no torch, no cmacc): ``data_dali`` is the bottom layer, and ``cmacc``
imports this module too.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from contextlib import contextmanager, suppress
from pathlib import Path

# .NAME.tmpPID[SUFFIX] — e.g. .clip.webm.tmp4242.webm
TEMPORARY = re.compile(r"^\.(?P<name>.+)\.tmp(?P<pid>\d+)(?P<suffix>\.[^./]+)?$")


# errors of the disk being written, not of the data: full, over quota, mounted read-only
DISK_ERRNOS = frozenset(getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EROFS") if hasattr(errno, n))
LOW_SPACE = 8 << 20  # a failed write with less free than this: the disk is full
# what torch's zip writer (torch.save) raises on a full disk instead of OSError(ENOSPC)
FULL_DISK_TEXT = ("unexpected pos", "file write failed", "No space left")


def write_failure(e: BaseException, folder) -> str:
    """Why a write into ``folder`` failed, in one line — named a full (or read-only, or
    vanished) disk whatever the exception type: torch.save raises RuntimeError("[enforce fail
    at inline_container.cc] unexpected pos ...") on a full filesystem, and some libraries lose
    the errno; the free space decides then."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return f"the folder is gone or cannot be read ({text})"
    full = (isinstance(e, OSError) and e.errno in DISK_ERRNOS) or free < LOW_SPACE or \
        any(t in text for t in FULL_DISK_TEXT)
    if full:
        return f"the disk is full or refuses writes, {free / 2 ** 20:.1f} MiB free: {text}"
    return text


def temporary_path(path, suffix: str | None = None) -> Path:
    """The temporary sibling this process writes ``path`` through (``suffix`` defaults to the
    extension of ``path``)."""
    path = Path(path)
    suffix = path.suffix if suffix is None else suffix
    return path.with_name(f".{path.name}.tmp{os.getpid()}{suffix}")


def fsync_file(path) -> None:
    """Flush a written file's data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path) -> None:
    """Flush a folder's entries (a rename into it) to the disk; a no-op where folders cannot be
    opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path, suffix: str | None = None):
    """Yield a temporary sibling of ``path`` to write; when the block ends without an
    exception, fsync it and ``os.replace`` it onto ``path``; otherwise remove it and re-raise
    (``path`` is untouched). The folder must exist."""
    path = Path(path)
    tmp = temporary_path(path, suffix)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns ``path``."""
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return path


def atomic_write_text(path, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (no newline translation); returns ``path``."""
    return atomic_write_bytes(path, text.encode(encoding))


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except PermissionError:  # another user's live process
        return True
    except (OSError, OverflowError):  # no such process (or no such pid at all)
        return False
    return True


def sweep_temporaries(folder, recursive: bool = False) -> int:
    """Remove the stale temporaries of ``atomic_path`` in ``folder`` (and its sub-folders when
    ``recursive``): files named like ours whose writing process is no longer running on this
    machine. Everything else is left alone. Returns how many were removed."""
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    n = 0
    for p in folder.rglob(".*.tmp*") if recursive else folder.glob(".*.tmp*"):
        m = TEMPORARY.match(p.name)
        if m and p.is_file() and not _alive(int(m["pid"])):
            p.unlink(missing_ok=True)
            n += 1
    return n


# ----------------------------------------------------------------------------------------------
# One writer per folder
# ----------------------------------------------------------------------------------------------
LOCK_NAME = ".run.lock"


class FolderLockError(RuntimeError):
    """The folder cannot be held (``hold_folder``): its lock file cannot be written; the message
    says why in one line."""


class FolderBusy(FolderLockError):
    """Another live process holds the folder (``hold_folder``); the message names it."""


class HeldFolder:
    """The lock of ``hold_folder``; ``close()`` lets go. The lock belongs to the open file,
    which a forked child (a loader worker) shares: closing this process's descriptor alone
    would leave the folder locked for as long as any child lives, so ``close`` unlocks first."""

    def __init__(self, file):
        self.file = file

    def close(self) -> None:
        import fcntl

        if self.file.closed:
            return
        try:
            fcntl.flock(self.file, fcntl.LOCK_UN)
        finally:
            self.file.close()


def hold_folder(folder, flag: str = "--out") -> HeldFolder | None:
    """An exclusive lock on ``folder`` until ``close()`` (the kernel lets go when the process
    and its forked children end, killed or not, so a crashed run never leaves the folder
    locked; the lock conflicts with any other open, in this process too). Raises ``FolderBusy``
    naming the holder (pid, host, since when) if another holds it, ``FolderLockError`` if the
    lock file cannot be written (no permission, a full disk). A filesystem without locks (some
    network mounts) returns None: the run goes on unguarded rather than not at all."""
    import fcntl
    import socket
    import time

    path = Path(folder) / LOCK_NAME

    def unwritable(e: OSError) -> FolderLockError:
        return FolderLockError(f"{flag} {folder}: cannot write its lock file {LOCK_NAME} "
                               f"({write_failure(e, folder)}); fix the folder's permissions or "
                               f"free space, or pass another {flag}")

    try:
        f = open(path, "a+", encoding="utf-8")
    except OSError as e:
        raise unwritable(e) from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process that has not said who it is"
        f.close()
        raise FolderBusy(f"{flag} {folder} is in use by another run ({holder}): two runs in one "
                         "folder would overwrite each other's checkpoints and logs; wait for "
                         f"it to end, stop it, or pass another {flag}") from None
    except OSError:  # ENOLCK / EOPNOTSUPP: no locks on this filesystem
        f.close()
        return None
    held = HeldFolder(f)
    try:
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
    except OSError as e:  # the lock is let go (closing may fail the same way: unlocked first)
        with suppress(OSError):
            held.close()
        raise unwritable(e) from None
    return held
