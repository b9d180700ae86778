"""bench/filepath_ablation.py on a tiny budget: the in-memory clips written "without loss" are
the in-memory clips (pixels back to the values within 8-bit rounding, the log-mel exact), the
table has a row per step, and a re-run skips finished runs."""

import json

import numpy as np
import torch

from bench import filepath_ablation as abl
from cmacc.config import PRESETS
from cmacc.data import synthetic_clips
from data_dali.manifest import Manifest
from data_dali.reference import MEAN, STD, ClipDataset


def test_lossless_files_are_the_in_memory_clips(tmp_path):
    man = Manifest(abl.lossless_data(tmp_path, 32, seed=1))
    toy = synthetic_clips(PRESETS["tiny"].replace(data=dict(clips=32, **abl.toy_data())).data, 1)
    ds = ClipDataset(man, range(len(man)), clip_frames=8, crop=32, train=False)
    for j in (0, 7, 31):
        item = ds[j]
        pix = item["video"] * STD[0] + MEAN[0]  # [0, 1] pixels
        back = (pix * 255 - 128) / 32  # the writer's pixel = 128 + 32 x value
        assert (back - toy.video[j].clamp(-4, 3.95)).abs().max() < 0.5 / 32 + 1e-4
        torch.testing.assert_close(item["audio"], toy.audio[j], rtol=0, atol=0)
        assert item["label"] == int(toy.labels[j])


def test_the_walk_runs_resumes_and_prints_its_table(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--steps", "2", "--seeds", "1", "--clips", "32",
            "--only", "memory", "lossless"]
    abl.main(argv)
    first = capsys.readouterr().out
    assert first.count("=== ") == 2
    rows = [r for r in (tmp_path / "table.md").read_text().splitlines() if r.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| memory", "| lossless"]
    done = json.loads((tmp_path / "lossless" / "seed0" / "ablation.json").read_text())
    assert set(done) == set(abl.COLUMNS) and 0 <= done["acc_last"] <= 1
    abl.main(argv)  # finished runs are read, not redone
    again = capsys.readouterr().out
    assert "=== " not in again and "| memory | 1 |" in again
    assert np.isfinite(done["clips_per_s"])
