"""Decode + augment throughput (clips/s) of the DALI pipeline and the PyAV reference loader, and
where a training batch's time goes on the file path beside the in-memory clips.

Same manifest, batch size, worker count and prefetch depth for both backends, at the paper's
clip shape by default (16 x 112 x 112, with the aligned 80 x 160 log-mel; views=2 doubles the
work per clip). Throughput is whole epochs over wall time after one warm-up epoch (pipeline
build, file cache), not a per-call timing; each loader builds its pipeline once (the ``builds``
column). Target on a GPU: >= 1,000 clips/s per H100 (more than the trainer eats).

    python bench/bench_pipeline.py [--manifest DATA/manifest.csv] [--device cpu|cuda]
        [--backends dali reference] [--batch 8] [--workers 2 ...] [--epochs 2] [--breakdown N]

Without --manifest it prepares --clips synthetic clips (data_dali.synthetic, 4 s at 160 x 120)
in a temporary folder. Each backend runs at each --workers count. Rows are appended to
OUT/pipeline.csv.

``--breakdown N`` also times N training batches of the reference path stage by stage, in this
process (what its DataLoader does with workers=0: each item, then the collation), after one
untimed pass over the same clips: the augmentation law's draws, the PyAV decode
(reference.decode_clip), the log-mel load and slice (Manifest.mel + audio.mel_segment), the
augmentation (reference.augment) and the collation; "other" is the rest of the batch's wall time
(the item dicts). DALI runs its operators inside one pipeline: it is timed whole only. Beside
them, the in-memory synthetic clips (data_dali.synthetic.ToyAV + ToyLoader, the analysis's
``DIVERSITY_DATA`` clips) at the same batch, frames and size: their one-off render, then
clips/s. The demo's setting (tiny preset: M = 16, 8 x 32 x 32; the demo's prepared clips, made
by ``make demo`` under OUT/data or by bench/filepath_ablation.py under OUT/data/prepared/data):

    python bench/bench_pipeline.py --manifest runs/demo/data/manifest.csv --device cpu \
        --batch 16 --frames 8 --crop 32 --workers 0 2 --epochs 1 --breakdown 8

Rows are appended to OUT/pipeline_breakdown.csv.
"""

from __future__ import annotations

import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import base_parser, check_device, env_info, markdown_table, write_csv  # noqa: E402

BACKENDS = ("dali", "reference")
STAGES = ("draw", "decode", "mel", "augment", "collate")  # a reference batch's stages, in order


def make_manifest(tmp: Path, clips: int) -> str:
    from data_dali import prepare as prep
    from data_dali import synthetic

    per_class = -(-clips // 4)
    src = synthetic.write_dataset(tmp / "src", classes=4, per_class=per_class, seconds=4.0,
                                  width=160, height=120)
    return prep.prepare(src, tmp / "data", progress=False)["manifest"]


def clips_per_second(manifest, backend, device, *, batch, workers, frames, crop, views,
                     prefetch, epochs):
    """(clips/s over ``epochs`` timed epochs, the backend used, pipelines built)."""
    import data_dali

    loader = data_dali.build_loader(manifest, batch_size=batch, clip_frames=frames, crop=crop,
                                    backend=backend, device=device, num_workers=workers,
                                    views=views, prefetch=prefetch)
    loader.set_epoch(0)
    for _ in loader:  # warm-up epoch (pipeline build, file cache)
        pass
    n, t0 = 0, time.perf_counter()
    for e in range(1, epochs + 1):
        loader.set_epoch(e)
        for b in loader:
            n += b["video"].shape[0]
    if device == "cuda":
        torch.cuda.synchronize()  # the last batch's copies
    return n / (time.perf_counter() - t0), loader.backend, loader.builds


def _timed(spent: dict, stage: str, fn):
    """fn, adding each call's seconds and count to spent[stage] = [seconds, calls]."""
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[stage][0] += time.perf_counter() - t0
            spent[stage][1] += 1
    return run


@contextmanager
def stage_timers(ds, spent: dict):
    """While open, the stages of the reference dataset ``ds`` (data_dali.reference.ClipDataset)
    run timed where it calls them, into spent[stage] = [seconds, calls]: data_dali.reference's
    draw_row, decode_clip, mel_segment and augment, and ``ds``'s Manifest.mel (the log-mel
    load, counted with its slice under "mel")."""
    from data_dali import reference

    names = {"draw_row": "draw", "decode_clip": "decode", "mel_segment": "mel",
             "augment": "augment"}
    saved = {name: getattr(reference, name) for name in names}
    try:
        for name, stage in names.items():
            setattr(reference, name, _timed(spent, stage, saved[name]))
        ds.m.mel = _timed(spent, "mel", ds.m.mel)  # (an instance attribute: this manifest only)
        yield spent
    finally:
        for name, fn in saved.items():
            setattr(reference, name, fn)
        ds.m.__dict__.pop("mel", None)


def breakdown(manifest, *, batch, batches, frames, crop, views, seed=0):
    """The first ``batches`` training batches of epoch 1 through the reference path in this
    process (the loader's own dataset's items, then its collation: what its DataLoader does
    with workers=0), after one untimed pass over them (file cache, memory maps). Returns
    ({stage: seconds} for STAGES, "whole": the batches' wall time, "other": whole - the stages,
    "<stage>_calls", "clips"), [the batches, as the loader yields them]."""
    from data_dali.loader import _collate, _ReferenceStream, _with_params, build_loader

    loader = build_loader(manifest, batch_size=batch, clip_frames=frames, crop=crop, views=views,
                          backend="reference", num_workers=0, seed=seed)
    loader.set_epoch(1)
    chosen = loader.shard_indices()[:batches]
    ref = _ReferenceStream(loader)
    ds = ref.dl.dataset
    spent = {stage: [0.0, 0] for stage in STAGES}

    def collate(items):  # the loader's batch: default_collate, then the law's fields
        return _with_params(_collate(items), views, True)

    def one_batch(b, collate):
        out = collate([ds[(ref.pos[i], 1)] for i in b])
        out.pop("bad")  # (damaged clips replaced: none in a prepared manifest's good rows)
        return out

    for b in chosen:  # untimed pass
        one_batch(b, collate)
    with stage_timers(ds, spent):
        timed_collate = _timed(spent, "collate", collate)
        t0 = time.perf_counter()
        out = [one_batch(b, timed_collate) for b in chosen]
        whole = time.perf_counter() - t0
    row = {stage: seconds for stage, (seconds, _) in spent.items()}
    row.update(whole=whole, other=whole - sum(row.values()), clips=sum(map(len, chosen)),
               **{f"{stage}_calls": calls for stage, (_, calls) in spent.items()})
    return row, out


def memory_clips_per_second(*, batch, frames, size, views, epochs):
    """(seconds to render the in-memory clips once, clips/s of ToyLoader over ``epochs``
    epochs): the analysis's DIVERSITY_DATA clips (the demo's, in memory) at this shape."""
    from cmacc.apps.analysis import DIVERSITY_DATA
    from cmacc.config import DataConfig
    from cmacc.data import synthetic_clips
    from data_dali.synthetic import ToyLoader

    t0 = time.perf_counter()
    data = synthetic_clips(DataConfig(frames=frames, size=size, **DIVERSITY_DATA), seed=0)
    render = time.perf_counter() - t0
    loader = ToyLoader(data, batch, views=views)
    n, t0 = 0, time.perf_counter()
    for e in range(epochs):
        loader.set_epoch(e)
        for b in loader:
            n += b["video"].shape[0]
    return render, n / (time.perf_counter() - t0)


def main(argv=None):
    p = base_parser(__doc__)
    p.add_argument("--manifest", help="a prepared manifest.csv (default: synthetic clips)")
    p.add_argument("--clips", type=int, default=32, help="synthetic clips without --manifest")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--workers", type=int, nargs="+", default=[2],
                   help="reference worker processes / DALI threads; each count is a row")
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--crop", type=int, default=112)
    p.add_argument("--views", type=int, choices=(1, 2), default=1)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2, help="timed epochs after the warm-up one")
    p.add_argument("--breakdown", type=int, default=0, metavar="N",
                   help="also time N reference batches stage by stage, beside the in-memory "
                        "clips (CPU; 0: off)")
    args = p.parse_args(argv)
    check_device(p, args)
    if args.clips < 1 or args.epochs < 1 or args.breakdown < 0 or min(args.workers) < 0:
        p.error("--clips and --epochs must be >= 1, --breakdown and --workers >= 0")
    if args.breakdown and args.device != "cpu":
        p.error("--breakdown times the host's stages: use --device cpu")
    info = env_info(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        manifest = args.manifest or make_manifest(Path(tmp), args.clips)
        source = args.manifest or f"synthetic {args.clips} clips"
        clip = f"{args.frames}x{args.crop}x{args.crop}"
        rows = []
        for backend in args.backends:
            for workers in args.workers:
                cps, used, builds = clips_per_second(
                    manifest, backend, args.device, batch=args.batch, workers=workers,
                    frames=args.frames, crop=args.crop, views=args.views, prefetch=args.prefetch,
                    epochs=args.epochs)
                rows.append(dict(provider=used, clips_per_s=cps, batch=args.batch,
                                 workers=workers, prefetch=args.prefetch, views=args.views,
                                 clip=clip, builds=builds, manifest=source, **info))
                print(f"{used:>10} workers {workers}: {cps:8.1f} clips/s", flush=True)
        if args.breakdown:
            parts, _ = breakdown(manifest, batch=args.batch, batches=args.breakdown,
                                 frames=args.frames, crop=args.crop, views=args.views)
            render, mem_cps = memory_clips_per_second(batch=args.batch, frames=args.frames,
                                                      size=args.crop, views=args.views,
                                                      epochs=args.epochs)
    if rows:
        print(markdown_table(rows, ["provider", "clips_per_s", "batch", "workers", "prefetch",
                                    "views", "clip", "builds", "device", "torch", "date",
                                    "commit"]))
        print(write_csv(rows, Path(args.out) / "pipeline.csv"))
    if args.breakdown:
        print(breakdown_table(parts, render, mem_cps, args, source, info))
    return rows


def breakdown_table(parts, render, mem_cps, args, source, info) -> str:
    """The stage rows (ms per batch, share of the batch, clips/s if the stage were all) and the
    in-memory rows, printed and appended to OUT/pipeline_breakdown.csv."""
    n_batches = args.breakdown
    common = dict(batch=args.batch, views=args.views, clip=f"{args.frames}x{args.crop}x{args.crop}",
                  manifest=source, **info)
    rows = [dict(stage=stage, calls=parts.get(f"{stage}_calls", ""),
                 ms_per_batch=1e3 * parts[stage] / n_batches,
                 share=parts[stage] / parts["whole"],
                 clips_per_s=parts["clips"] / parts[stage] if parts[stage] > 0 else float("inf"),
                 **common) for stage in STAGES + ("other", "whole")]
    rows.append(dict(stage="in memory: render all clips once", calls=1, seconds=render, **common))
    rows.append(dict(stage="in memory: ToyLoader batches", ms_per_batch=1e3 * args.batch / mem_cps,
                     clips_per_s=mem_cps, **common))
    print(write_csv(rows, Path(args.out) / "pipeline_breakdown.csv"))
    return markdown_table(rows, ["stage", "calls", "ms_per_batch", "share", "clips_per_s",
                                 "seconds", "batch", "clip", "date", "commit"])


if __name__ == "__main__":
    main()
