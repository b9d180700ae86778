"""The manifest: one row per prepared clip (see data_dali.prepare). Paths are relative to the
manifest's folder and must resolve inside it."""

from __future__ import annotations

import csv
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch


class Manifest:
    def __init__(self, path):
        self.file = Path(path).resolve()
        if not self.file.is_file():
            raise FileNotFoundError(f"{path}: no manifest; create one with "
                                    "`python -m data_dali.prepare SRC OUT` (OUT/manifest.csv)")
        self.root = self.file.parent
        with open(self.file, newline="") as f:
            self.rows = list(csv.DictReader(f))
        need = {"video", "audio", "mel", "label", "frames", "fps"}
        if self.rows and not need <= set(self.rows[0]):
            raise ValueError(f"{path}: not a data_dali manifest (missing columns "
                             f"{sorted(need - set(self.rows[0]))}); re-run data_dali.prepare")
        for r in self.rows:
            for k in ("video", "audio", "mel"):
                if r[k]:
                    self.path(r[k])  # validates now: a bad manifest fails before training
        names = {}
        for r in self.rows:
            names[int(r["label"])] = r.get("class_name", str(r["label"]))
        self.class_names = [names.get(i, str(i)) for i in range(max(names, default=-1) + 1)]
        self.labels = torch.tensor([int(r["label"]) for r in self.rows], dtype=torch.long)

    def __len__(self):
        return len(self.rows)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def path(self, rel: str) -> Path:
        p = (self.root / rel).resolve()
        if self.root not in p.parents:
            raise ValueError(f"{self.file}: path {rel!r} escapes the dataset folder {self.root}; "
                             "manifest paths must stay inside it")
        return p

    def mel(self, i: int) -> np.ndarray:
        row = self.rows[i]
        if not row["mel"]:
            raise ValueError(f"{self.file}: clip {row.get('id', i)} ({row.get('source', '')}) has "
                             "no log-mel; it has no audio, or prepare ran with --no-mel")
        return _load_mel(str(self.path(row["mel"])))

    def select(self, *, need_video=True, need_audio=True, split=None) -> list[int]:
        """Row indices usable for a purpose; ``split`` = (column, value), e.g. ("split1", "train")
        or ("fold", "1")."""
        out = []
        for i, r in enumerate(self.rows):
            if need_video and not r["video"]:
                continue
            if need_audio and not (r["mel"] and int(r.get("audio_present", 1))):
                continue
            if split is not None and r.get(split[0], "") != split[1]:
                continue
            out.append(i)
        return out


@lru_cache(maxsize=4096)
def _load_mel(path: str) -> np.ndarray:
    return np.load(path, mmap_mode="r")
