"""The manifest: one row per prepared clip, the only thing the loaders read.

Written by ``python -m data_dali.prepare``; format in docs/DATA.md. Paths are relative to the manifest's folder (the dataset root) and must resolve inside it: a
manifest someone shared cannot make a loader read ``../../anything``. Every row is checked when
the manifest is opened, so a bad manifest fails before training starts, naming the row.
"""

from __future__ import annotations

import csv
from functools import lru_cache
from pathlib import Path

import numpy as np

REQUIRED = ("id", "video", "audio", "mel", "label", "frames", "fps")
FIELDS = ["id", "video", "audio", "mel", "label", "class_name", "split1", "split2", "split3",
          "fold", "duration", "frames", "fps", "width", "height", "audio_present", "silent",
          "source"]


class ManifestError(ValueError):
    """A manifest that cannot be used; the message names the file, the row and the fix."""


class Manifest:
    """Rows of a prepared dataset. ``rows[i]`` is dataset index i (the ``index`` the loaders
    return and the dictionaries store)."""

    def __init__(self, path):
        self.file = Path(path).resolve()
        if not self.file.is_file():
            raise FileNotFoundError(f"{path}: no manifest; create one with "
                                    "`python -m data_dali.prepare SRC OUT` (OUT/manifest.csv)")
        self.root = self.file.parent
        with open(self.file, newline="") as f:
            reader = csv.DictReader(f)
            missing = sorted(set(REQUIRED) - set(reader.fieldnames or ()))
            if missing:
                raise ManifestError(f"{path}: not a data_dali manifest (missing columns {missing}); "
                                    "re-run `python -m data_dali.prepare`")
            self.rows = list(reader)
        names: dict[int, str] = {}
        for i, r in enumerate(self.rows):
            self._check_row(i, r)
            names[int(r["label"])] = r.get("class_name") or str(r["label"])
        n = max(names, default=-1) + 1
        self.class_names = [names.get(i, str(i)) for i in range(n)]
        self.label_array = np.array([int(r["label"]) for r in self.rows], dtype=np.int64)

    def _check_row(self, i: int, r: dict) -> None:
        where = f"{self.file}, row {i + 2} (id {r.get('id')!r})"
        try:
            if int(r["id"]) != i:
                raise ManifestError(f"{where}: id {r['id']} != its position {i}; ids must be "
                                    "0..N-1 in order (they are the dataset indices); re-run prepare")
            int(r["label"]), int(r["frames"] or 0)
            if float(r["fps"]) <= 0:
                raise ValueError("fps must be > 0")
        except ManifestError:
            raise
        except (TypeError, ValueError) as e:
            raise ManifestError(f"{where}: bad value ({e}); re-run `python -m data_dali.prepare`") from None
        for k in ("video", "audio", "mel"):
            if r[k]:
                r[k] = str(self.path(r[k], where))  # absolute from here on (validated once)
        if not r["video"] and not r["mel"] and not r["audio"]:
            raise ManifestError(f"{where}: no video, audio or mel path; re-run prepare")

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def labels(self):
        """Labels of all rows as a torch long tensor (-1 = unlabeled)."""
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
