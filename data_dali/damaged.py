"""Damaged clips met while loading (a file truncated or overwritten after prepare: a disk
error, a partial copy, a sync still running): checked cheaply before decode, skipped and
replaced, named once in OUT/bad_clips.csv and the log, counted; too many stop the run.

    bad = BadClips(manifest, index, seed=0, limit=10, csv_path=out / "bad_clips.csv")
    reason = bad.check(i)                      # None, or why clip i cannot be used
    j = bad.replacement(i, epoch, attempt)     # a usable clip in its place (deterministic)
    bad.record(i, reason)                      # log + CSV once; TooManyBadClips past the limit

Under torchrun each rank appends to a file of its own (``rank_csv``: bad_clips.rank0.csv,
bad_clips.rank1.csv, ...: appends from several nodes to one file on NFS are not atomic), and
every rank reads them all, bad_clips.csv included (``listed_clips``): a run resumed at any world
size names a clip once.

The limit is the run's, not a rank's nor an attempt's: the damaged clips its files list, each
once. A process counts the clips it lists first (``new``: not in any file when it met them; the
files are read again before a clip is listed, since another rank may have met it in an earlier
epoch of its shard), and the clips the files held when it started (``earlier``: earlier attempts
and resumes, any rank) are counted by one rank; ``share(rank)`` is a rank's part, and the trainer
sums the parts over the ranks in its per-step all-reduce. (Two ranks that meet the same new clip
before either's line is visible to the other, within a step or behind an NFS listing's lag,
both count it.)

The checks need no decode: the video file is a WebM whose EBML header and Segment size say how
many bytes it must hold (what prepare wrote: a shorter file is truncated); the log-mel loads,
has 80 bands and only finite values (a NaN would poison the loss steps later, unnamed). A clip
that passes them and still fails to decode is found by the loader (PyAV raises; a DALI
pipeline fails and is rebuilt) and goes the same way.

A replacement is drawn from (seed, epoch, clip, attempt) among the loader's clips, so it is the
same on every run and resume, and its dataset index travels with it: the dictionaries store
the index of the clip whose keys they hold. Replacements never give up while a usable clip is
left (after MAX_TRIES draws, the next clip in order not known to be damaged), so however many
clips are damaged, the stop is the limit's — which the trainer agrees on over ranks — and not
one rank's; only a loader whose every clip is damaged stops alone.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import os
import re
from pathlib import Path

import numpy as np

from .cli import UserError, first_line
from .manifest import Manifest

log = logging.getLogger("data_dali")
FIELDS = ["index", "id", "file", "reason"]
EBML_MAGIC = b"\x1a\x45\xdf\xa3"
SEGMENT_ID = b"\x18\x53\x80\x67"
MAX_TRIES = 64  # random replacements drawn for one clip before the next usable one in order
RANK_FILE = re.compile(r"\.rank(\d+)$")  # STEM.rankN: rank N's file


def rank_csv(path, rank: int, world: int) -> Path:
    """The damaged-clips file rank ``rank`` of ``world`` appends to: ``path`` in one process,
    its sibling ``STEM.rankN.csv`` under torchrun."""
    path = Path(path)
    return path if world == 1 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def csv_files(path) -> list[Path]:
    """The existing damaged-clips files of the run that writes ``path`` (any rank's): the
    one-process file, then the ranks' by rank."""
    path = Path(path)
    first = path.with_name(RANK_FILE.sub("", path.stem) + path.suffix)
    ranks = {int(m[1]): p for p in first.parent.glob(f"{first.stem}.rank*{first.suffix}")
             if (m := RANK_FILE.search(p.stem)) and p.stem == f"{first.stem}{m[0]}"}
    return [p for p in [first, *(ranks[r] for r in sorted(ranks))] if p.is_file()]


def listed_clips(path) -> list[dict]:
    """The rows of every rank's damaged-clips file (``csv_files``), each clip once."""
    rows, seen = [], set()
    for f in csv_files(path):
        with open(f, newline="", encoding="utf-8") as fh:
            for r in csv.DictReader(fh):
                if (r.get("index") or "").isdigit() and int(r["index"]) not in seen:
                    seen.add(int(r["index"]))
                    rows.append(r)
    return rows


class TooManyBadClips(UserError):
    """More damaged clips than --max-bad-clips: the data needs fixing, not the run."""


def default_limit(clips: int) -> int:
    """--max-bad-clips by default: 1% of the clips, at least 10."""
    return max(10, math.ceil(0.01 * clips))


def _vint(data: bytes, pos: int) -> tuple[int, int] | None:
    """An EBML variable-length integer at ``pos``: (value, its length); None if cut off.
    All-ones values (unknown size) are returned as -1."""
    if pos >= len(data) or data[pos] == 0:
        return None
    n = 8 - data[pos].bit_length() + 1
    if pos + n > len(data):
        return None
    value = data[pos] & (0xFF >> n)
    for b in data[pos + 1:pos + n]:
        value = (value << 8) | b
    return (-1 if value == (1 << (7 * n)) - 1 else value), n


def webm_problem(path) -> str | None:
    """Why the WebM file at ``path`` is unusable without decoding it (missing, empty, not a
    WebM, or shorter than its Segment says: truncated), else None."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as e:
        return f"cannot read the video ({e.strerror or e})"
    if size == 0:
        return "the video file is empty"
    if not head.startswith(EBML_MAGIC):
        return "the video file is not a WebM (no EBML header): overwritten or not from prepare"
    hdr = _vint(head, 4)
    if hdr is None:
        return "the video file's header is cut off"
    seg = 4 + hdr[1] + hdr[0]
    if head[seg:seg + 4] != SEGMENT_ID:
        return None  # another layout: left to the decoder
    length = _vint(head, seg + 4)
    if length is None:
        return "the video file's header is cut off"
    if length[0] >= 0 and size < seg + 4 + length[1] + length[0]:
        return (f"the video file is truncated ({size} of {seg + 4 + length[1] + length[0]} "
                "bytes)")
    return None


def mel_problem(path) -> str | None:
    """Why the log-mel .npy at ``path`` is unusable (unreadable, truncated, not [80, frames],
    non-finite values), else None."""
    try:
        mel = np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as e:
        return f"cannot read the log-mel ({first_line(e, 100)})"
    if mel.ndim != 2 or mel.shape[0] != 80 or mel.shape[1] == 0:
        return f"the log-mel has shape {list(mel.shape)}, not [80, frames]"
    if not np.isfinite(mel).all():
        return "the log-mel holds non-finite values (NaN/Inf)"
    return None


class BadClips:
    """The damaged clips of one loader: checks, replacements, the record and the limit.
    ``found`` maps dataset index → reason (this process); ``count`` is what ``record`` saw."""

    def __init__(self, manifest: Manifest, index: list[int], *, seed: int = 0,
                 limit: int | None = None, csv_path=None, need_video=True, need_audio=True,
                 action: str = "skipped and replaced", stop_past_limit: bool = True):
        self.m, self.index, self.seed = manifest, list(index), int(seed)
        self.action = action  # what happens to a damaged clip, as the log line says it
        self.limit = default_limit(len(manifest)) if limit is None else int(limit)
        # False: past the limit, clips are still replaced and the caller stops (the trainer
        # agrees on the count over ranks, so that every rank stops after the same step)
        self.stop_past_limit = stop_past_limit
        self.csv_path = Path(csv_path) if csv_path else None
        self.need_video, self.need_audio = need_video, need_audio
        self.found: dict[int, str] = {}
        self.checked: set[int] = set()
        self.files: dict[int, str] = {}  # the damaged file of a clip, when not its video
        self.counted: set[int] = set()
        self.listed = self._read_csv()
        # the run's count (module docstring): the clips listed before this process started, and
        # those it listed first
        self.earlier = len(self.listed)
        self.new: set[int] = set()

    def check(self, i: int) -> str | None:
        """Why clip ``i`` cannot be used (known, or found by the cheap checks), else None."""
        if i in self.found:
            return self.found[i]
        if i in self.checked:
            return None
        row = self.m.rows[i]
        reason = None
        if self.need_video and row["video"]:
            reason = webm_problem(row["video"])
        if reason is None and self.need_audio and row["mel"]:
            reason = mel_problem(row["mel"])
            self.files[i] = row["mel"]  # (the file to name, if it is the damaged one)
        self.checked.add(i)
        if reason is not None:
            self.found[i] = reason
        return reason

    def mark(self, i: int, reason: str) -> None:
        """Clip ``i`` failed to decode: never used again in this process."""
        self.found.setdefault(i, reason)

    def replacement(self, i: int, epoch: int, attempt: int = 0) -> int:
        """A clip in place of ``i`` for this epoch: drawn from (seed, epoch, i, attempt) among
        the loader's clips not known to be damaged; deterministic."""
        rng = np.random.default_rng([self.seed, epoch + 1, i, attempt])
        for _ in range(MAX_TRIES):
            j = self.index[int(rng.integers(len(self.index)))]
            if j != i and j not in self.found:
                return j
        start = int(rng.integers(len(self.index)))  # most clips are damaged: the next in order
        for k in range(len(self.index)):
            j = self.index[(start + k) % len(self.index)]
            if j != i and j not in self.found:
                return j
        raise TooManyBadClips(f"{self.m.file}: every clip is damaged ({len(self.found)} found); "
                              "re-run `python -m data_dali.prepare`")

    def usable(self, i: int, epoch: int) -> int:
        """Clip ``i``, or (when it is damaged: recorded) its replacement for ``epoch``."""
        attempt = 0
        while (reason := self.check(i)) is not None:  # each turn finds one more damaged clip
            self.record(i, reason)
            i = self.replacement(i, epoch, attempt)
            attempt += 1
        return i

    def record(self, i: int, reason: str) -> None:
        """Note clip ``i`` (once per process), log it, add it to bad_clips.csv unless a file of
        the run lists it already (once over ranks and runs: the files are read again first) and
        then count it as ``new``; TooManyBadClips past ``limit``."""
        self.mark(i, reason)
        if i in self.counted:
            return
        self.counted.add(i)
        row = self.m.rows[i]
        name = self.files.get(i) or row["video"] or row["mel"]
        if i not in self.listed:  # another rank may have listed it since this one started
            self.listed |= self._read_csv()
        if i not in self.listed:
            self.listed.add(i)
            self.new.add(i)
            self._append(dict(index=i, id=row.get("id", i), file=name, reason=reason))
        log.warning("damaged clip %s (row %d): %s; %s (%d in this run as this process knows "
                    "it, at most %d)", name, i, reason, self.action, self.total, self.limit)
        self.check_limit()

    def check_limit(self) -> None:
        """TooManyBadClips if the run has more than ``limit`` damaged clips as this process
        knows them (``total``; and ``stop_past_limit``)."""
        if self.stop_past_limit and self.total > self.limit:
            raise TooManyBadClips(self.limit_message(self.total))

    def limit_message(self, count: int) -> str:
        """The one line of a stop past the limit, for ``count`` damaged clips."""
        path = self.csv_path  # the same words on every rank: the ranks' files as a pattern
        if path is not None and RANK_FILE.search(path.stem):
            path = path.with_name(RANK_FILE.sub(".rank*", path.stem) + path.suffix)
        where = f" (listed in {path})" if path else ""
        return (f"{self.m.file}: {count} damaged clips, more than --max-bad-clips "
                f"{self.limit}{where}; re-run `python -m data_dali.prepare` on their sources, or "
                "raise --max-bad-clips")

    def named(self) -> list[dict]:
        """The clips ``record`` counted: index, file, reason (by index)."""
        return [dict(index=i, file=self.files.get(i) or self.m.rows[i]["video"]
                     or self.m.rows[i]["mel"], reason=self.found[i]) for i in sorted(self.counted)]

    @property
    def count(self) -> int:
        """The damaged clips this process met (listed before or not)."""
        return len(self.counted)

    @property
    def total(self) -> int:
        """The run's damaged clips as this process knows them: those its files listed when it
        started (earlier attempts, any rank) and those it listed first."""
        return self.earlier + len(self.new)

    def share(self, rank: int) -> int:
        """Rank ``rank``'s part of the run's count, which the ranks sum (the trainer's per-step
        all-reduce): the clips it listed first, and on rank 0 also those listed before."""
        return len(self.new) + (self.earlier if rank == 0 else 0)

    def _read_csv(self) -> set[int]:
        if self.csv_path is None:
            return set()
        return {int(r["index"]) for r in listed_clips(self.csv_path)}

    def _append(self, row: dict) -> None:
        """One whole line appended to this rank's own file (one writer a file)."""
        if self.csv_path is None:
            return
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=FIELDS)
        fd = os.open(self.csv_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size == 0:
                w.writeheader()
            w.writerow(row)
            os.write(fd, buf.getvalue().encode())
        finally:
            os.close(fd)
