"""bench/bench_pipeline.py's breakdown times what the reference loader does: every stage of every
clip and view is timed, the stages add up to no more than the batches' wall time, the batches
timed are the loader's own, and the timers are gone afterwards."""

import torch

import data_dali
from bench.bench_pipeline import STAGES, breakdown
from data_dali import reference


def test_the_breakdown_times_every_stage_of_the_loaders_own_batches(tiny_prepared):
    manifest = tiny_prepared[1] / "manifest.csv"
    originals = {n: getattr(reference, n)
                 for n in ("draw_row", "decode_clip", "mel_segment", "augment")}
    parts, batches = breakdown(manifest, batch=4, batches=2, frames=4, crop=8, views=2)
    clips, views = 8, 2
    assert parts["clips"] == clips and len(batches) == 2
    # each view of each clip: one draw, one decode, one augmentation, a log-mel load and a slice
    assert {s: parts[f"{s}_calls"] for s in STAGES} == dict(
        draw=clips * views, decode=clips * views, mel=2 * clips * views, augment=clips * views,
        collate=2)
    assert all(parts[s] > 0 for s in STAGES)
    assert sum(parts[s] for s in STAGES) <= parts["whole"]
    assert parts["other"] == parts["whole"] - sum(parts[s] for s in STAGES)
    # the loader's batches of the same epoch, through its DataLoader
    loader = data_dali.build_loader(manifest, batch_size=4, clip_frames=4, crop=8, views=2,
                                    backend="reference", num_workers=0)
    loader.set_epoch(1)
    for want, got in zip(loader, batches):
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(want[k], got[k]), k
    assert {n: getattr(reference, n) for n in originals} == originals
