"""The manifest: one row per prepared clip, the only thing the loaders read.

Written by ``python -m data_dali.prepare``; format in docs/DATA.md. Paths are relative to the
manifest's folder (the dataset root) and must resolve inside it: a manifest someone shared
cannot make a loader read ``../../anything``. Every row is checked when the manifest is opened
(columns, ids, numbers, labels, files present, no row or id twice), so a bad manifest fails
before any worker starts: one ManifestError naming the first few bad rows by line, and the fix.

Rows may be any subset, reordering or concatenation of prepared manifests as long as the ids
stay unique: the dataset index (what the loaders return and the dictionaries store) is the
row's position, 0..N-1, whatever its ``id``. ``python -m data_dali.manifest_tools
stats|subset|merge`` shapes manifests (data_dali/manifest_tools.py imports this module, never
the other way).
"""

from __future__ import annotations

import csv
import hashlib
import math
import re
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np

from .cli import UserError

REQUIRED = ("id", "video", "audio", "mel", "label", "frames", "fps")
FIELDS = ["id", "video", "audio", "mel", "label", "class_name", "split1", "split2", "split3",
          "fold", "duration", "frames", "fps", "width", "height", "audio_present", "silent",
          "source"]
MEDIA = ("video", "audio", "mel")
UNLABELED = -1  # the label of a clip without one (pretraining uses it; probes leave it out)
MAX_CLASSES = 100_000  # labels are < max(MAX_CLASSES, rows): a larger one is a damaged cell
SHOWN = 5  # bad rows named in the error
# folder or class names that are splits, not classes (Kinetics' download layout: train/, val/,
# test/): prepare refuses them as class folders, eval warns of them in a manifest
SPLIT_NAMES = frozenset({"train", "training", "val", "valid", "validate", "validation", "test",
                         "testing"})
FIX = "re-run `python -m data_dali.prepare SRC OUT` to rewrite it (or correct those rows)"


class ManifestError(UserError, ValueError):
    """A manifest that cannot be used; the message names the file, the row and the fix."""


class Manifest:
    """Rows of a prepared dataset. ``rows[i]`` is dataset index i (the ``index`` the loaders
    return and the dictionaries store): the row's position, not its ``id``."""

    def __init__(self, path):
        self.file = Path(path).resolve()
        if self.file.is_dir():
            inside = self.file / "manifest.csv"
            if inside.is_file():
                raise ManifestError(f"{path}: a folder, not a manifest; pass the manifest.csv in "
                                    f"it ({inside})")
            raise ManifestError(f"{path}: a folder with no manifest.csv (a folder of videos?); "
                                f"prepare it first: `cmacc-prepare {path} OUT` (= python -m "
                                "data_dali.prepare), then pass OUT/manifest.csv")
        if not self.file.is_file():
            raise FileNotFoundError(f"{path}: no manifest; create one with "
                                    "`python -m data_dali.prepare SRC OUT` (OUT/manifest.csv)")
        self.root = self.file.parent
        self.rows, lines = self._read(path)
        self._check_rows(path, lines)
        names: dict[int, str] = {}
        for r in self.rows:
            if int(r["label"]) != UNLABELED:
                names[int(r["label"])] = r.get("class_name") or str(r["label"])
        n = max(names, default=-1) + 1  # bounded: every label was checked against the cap
        self.class_names = [names.get(i, str(i)) for i in range(n)]
        self.label_array = np.array([int(r["label"]) for r in self.rows], dtype=np.int64)

    def _read(self, path) -> tuple[list[dict], list[int]]:
        """The rows and the line of each; the header checked."""
        try:
            with open(self.file, newline="", encoding="utf-8-sig") as f:
                reader = csv.DictReader(f)
                header = reader.fieldnames
                if not header:
                    raise ManifestError(f"{path}: empty file, not a manifest; {FIX}")
                missing = [c for c in REQUIRED if c not in header]
                if missing:
                    raise ManifestError(f"{path}: not a data_dali manifest (missing columns "
                                        f"{missing}; line 1 has {header[:8]}); {FIX}")
                rows, lines = [], []
                for r in reader:
                    rows.append(r)
                    lines.append(reader.line_num)  # its (last) line in the file
        except (UnicodeDecodeError, csv.Error) as e:
            raise ManifestError(f"{path}: not a CSV text file ({type(e).__name__}: "
                                f"{str(e)[:80]}); {FIX}") from None
        if not rows:
            raise ManifestError(f"{path}: no clips (a header only); every source was rejected? "
                                f"see rejects.csv next to it, then {FIX}")
        return rows, lines

    def _check_rows(self, path, lines: list[int]) -> None:
        """Every row, before anything is allocated from it: one error naming the first few."""
        cap = max(MAX_CLASSES, len(self.rows))
        bad, seen = [], {}
        for i, r in enumerate(self.rows):
            problem = self._problem(r, cap) or self._duplicate(r, seen, lines[i])
            if problem:
                bad.append(f"line {lines[i]} (id {_show(r.get('id'))}): {problem}")
        if bad and len(bad) == len(self.rows) and all(b.endswith("is missing") for b in bad):
            raise ManifestError(  # a manifest copied out of its dataset folder
                f"{path}: none of its {len(bad)} clip files is found ({bad[0]}): its paths are "
                f"relative to the manifest's own folder, {self.root}. Keep the manifest in its "
                "dataset folder, pass the dataset's own manifest.csv, or write one in a folder "
                "that holds the clips with `python -m data_dali.manifest_tools subset "
                "DATASET/manifest.csv --out FOLDER/NAME.csv` (it rewrites the paths)")
        if bad:
            more = f" (and {len(bad) - SHOWN} more)" if len(bad) > SHOWN else ""
            raise ManifestError(f"{path}: {len(bad)} bad row(s) of {len(self.rows)}: "
                                f"{'; '.join(bad[:SHOWN])}{more}; {FIX}")

    def _problem(self, r: dict, cap: int) -> str | None:
        """What is wrong with row ``r`` (the first thing found), else None. Media paths become
        absolute (validated once)."""
        if None in r or None in r.values():
            return "wrong number of cells (a cell with a comma must be quoted)"
        clip_id = _int(r["id"])
        if clip_id is None or clip_id < 0:
            return f"id {_show(r['id'])} is not a whole number >= 0"
        label = _int(r["label"])
        if label is None:
            return (f"label {_show(r['label'])} is not an integer (class index from 0; "
                    f"{UNLABELED} = unlabeled)")
        if not (label == UNLABELED or 0 <= label < cap):
            return (f"label {label} is out of range: labels are 0..{cap - 1} "
                    f"(at most max({MAX_CLASSES}, rows) classes; {UNLABELED} = unlabeled)")
        fps = _float(r["fps"])
        if not (fps is not None and math.isfinite(fps) and fps > 0):
            return f"fps {_show(r['fps'])} is not a number > 0"
        frames = _int(r["frames"] or "0")
        if frames is None or frames < 0 or (r["video"] and frames == 0):
            return f"frames {_show(r['frames'])} is not a whole number > 0"
        if (r.get("duration") or "").strip():
            d = _float(r["duration"])
            if not (d is not None and math.isfinite(d) and d > 0):
                return f"duration {_show(r['duration'])} is not a number of seconds > 0"
        if not any(r[k] for k in MEDIA):
            return "no video, audio or mel path"
        for k in MEDIA:
            if not r[k]:
                continue
            p = (self.root / r[k]).resolve()
            if self.root not in p.parents:
                return (f"{k} path {_show(r[k])} escapes the dataset folder {self.root}; paths are "
                        "relative to it and stay inside")
            if not p.is_file():
                return f"{k} file {_show(r[k])} is {'a folder' if p.is_dir() else 'missing'}"
            r[k] = str(p)
        return None

    @staticmethod
    def _duplicate(r: dict, seen: dict, line: int) -> str | None:
        """A row whose id or media file an earlier row already has (the same clip twice)."""
        key = ("id", _int(r["id"]))
        if key in seen:
            return (f"id {_show(r['id'])} is also the id of line {seen[key]}; ids must be unique "
                    "(`python -m data_dali.manifest_tools merge` renumbers the rows of several datasets)")
        seen[key] = line
        for k in MEDIA:
            if r[k]:
                if r[k] in seen:
                    return f"the same {k} file as line {seen[r[k]]} (a row listed twice)"
                seen[r[k]] = line
        return None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def labels(self):
        """Labels of all rows as a torch long tensor (UNLABELED = -1: no label)."""
        import torch

        return torch.from_numpy(self.label_array)

    def path(self, rel: str, where: str | None = None) -> Path:
        """``rel`` resolved against the dataset root; must stay inside it."""
        p = (self.root / rel).resolve()
        if self.root not in p.parents:
            raise ManifestError(f"{where or self.file}: path {rel!r} escapes the dataset folder "
                                f"{self.root}; manifest paths must be relative and stay inside it "
                                "(re-run `python -m data_dali.prepare` rather than editing paths)")
        return p

    def has_audio(self, i: int) -> bool:
        r = self.rows[i]
        return bool(r["mel"] or r["audio"]) and r.get("audio_present", "1") != "0"

    def mel(self, i: int) -> np.ndarray:
        """[80, frames] log-mel of row i: the precomputed .npy (memory-mapped), or computed
        from the prepared audio when prepare ran with --no-mel."""
        row = self.rows[i]
        if row["mel"]:
            return _load_mel(row["mel"])
        if row["audio"]:
            return _mel_from_audio(row["audio"])
        raise ManifestError(f"{self.file}: clip {row.get('id', i)} ({row.get('source', '')}) has no "
                            "audio; select clips with need_audio=False for video-only use")

    def select(self, *, need_video=True, need_audio=True, split=None) -> list[int]:
        """Row indices usable for a purpose. ``split``: None, "train"/"test" (= split1),
        "split2:test", "fold:3" or a (column, value) pair."""
        col_val = parse_split(split)
        if col_val and self.rows and col_val[0] not in self.rows[0]:
            raise ManifestError(f"{self.file}: no column {col_val[0]!r} for split {split!r}; "
                                "splits are split1..split3 (train/test) or fold")
        out = []
        for i, r in enumerate(self.rows):
            if need_video and not r["video"]:
                continue
            if need_audio and not self.has_audio(i):
                continue
            if col_val is not None and r.get(col_val[0], "") != col_val[1]:
                continue
            out.append(i)
        return out


def note_kind(note: str) -> str:
    """What a note is counted and compared under: its words before any figure or detail
    ("audio padded with silence from 0.37 s to 1.60 s" → "audio padded with silence")."""
    return re.split(r"\s*(?:[(:,]|\b(?:from |at |to )?\d)", note)[0] or note


def clip_properties(row: dict) -> set[str]:
    """What prepare recorded of a clip beside its label, as kinds: the kinds of its ``notes``
    (``note_kind``), "silent audio" for ``silent`` = 1 and "no audio stream" for
    ``audio_present`` = 0 (also without the note). A property that goes with one class is a
    confound: a probe can score from it alone (prepare warns; eval prints its accuracy)."""
    kinds = {note_kind(n) for n in (row.get("notes") or "").split(" | ") if n.strip()}
    if str(row.get("silent", "")).strip() == "1":
        kinds.add("silent audio")
    if str(row.get("audio_present", "")).strip() == "0":
        kinds.add("no audio stream")
    return kinds


def sha256_file(path) -> str:
    """The SHA-256 of a file's bytes (hex): a manifest's identity, beside its path."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _show(cell, width: int = 40) -> str:
    """A cell for an error message: quoted, cut short."""
    text = str(cell)
    return repr(text if len(text) <= width else text[:width] + "...")


def _int(text) -> int | None:
    try:
        return int(str(text).strip())
    except ValueError:
        return None


def _float(text) -> float | None:
    try:
        return float(str(text).strip())
    except ValueError:
        return None


def parse_split(split) -> tuple[str, str] | None:
    if split is None:
        return None
    if isinstance(split, (tuple, list)) and len(split) == 2:
        return str(split[0]), str(split[1])
    if isinstance(split, str):
        if ":" in split:
            col, val = split.split(":", 1)
            return col, val
        if split in ("train", "test"):
            return "split1", split
    raise ValueError(f"split {split!r}: use 'train'/'test' (split1), 'split2:test', 'fold:3' or "
                     "a (column, value) pair")


@lru_cache(maxsize=4096)
def _load_mel(path: str) -> np.ndarray:
    return np.load(path, mmap_mode="r")


@lru_cache(maxsize=256)
def _mel_from_audio(path: str) -> np.ndarray:
    import soundfile as sf

    from .audio import SR, log_mel

    wave, sr = sf.read(path, dtype="float32", always_2d=True)
    if sr != SR:
        raise ManifestError(f"{path}: sample rate {sr} != {SR}; re-run `python -m data_dali.prepare`")
    return log_mel(wave.mean(1))


if __name__ == "__main__":  # the commands live above this module (one import direction)
    sys.exit("error: the manifest commands moved: run `python -m data_dali.manifest_tools "
             "stats|subset|merge ...` (or `cmacc-manifest`)")
