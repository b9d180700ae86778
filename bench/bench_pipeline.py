"""Decode + augment throughput (clips/s) of the DALI pipeline and the PyAV reference loader.

Same manifest, batch size, worker count and prefetch depth for both backends, at the paper's
clip shape by default (16 x 112 x 112, with the aligned 80 x 160 log-mel; views=2 doubles the
work per clip). Throughput is whole epochs over wall time after one warm-up epoch (pipeline
build, file cache), not a per-call timing; each loader builds its pipeline once (the ``builds``
column). Target on a GPU: >= 1,000 clips/s per H100 (more than the trainer eats).

    python bench/bench_pipeline.py [--manifest DATA/manifest.csv] [--device cpu|cuda]
        [--backends dali reference] [--batch 8] [--workers 2] [--epochs 2]

Without --manifest it prepares --clips synthetic clips (data_dali.synthetic, 4 s at 160 x 120)
in a temporary folder. Rows are appended to OUT/pipeline.csv.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import base_parser, check_device, env_info, markdown_table, write_csv  # noqa: E402

BACKENDS = ("dali", "reference")


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


def main(argv=None):
    p = base_parser(__doc__)
    p.add_argument("--manifest", help="a prepared manifest.csv (default: synthetic clips)")
    p.add_argument("--clips", type=int, default=32, help="synthetic clips without --manifest")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--crop", type=int, default=112)
    p.add_argument("--views", type=int, choices=(1, 2), default=1)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2, help="timed epochs after the warm-up one")
    args = p.parse_args(argv)
    check_device(p, args)
    if args.clips < 1 or args.epochs < 1:
        p.error("--clips and --epochs must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        manifest = args.manifest or make_manifest(Path(tmp), args.clips)
        rows = []
        for backend in args.backends:
            cps, used, builds = clips_per_second(
                manifest, backend, args.device, batch=args.batch, workers=args.workers,
                frames=args.frames, crop=args.crop, views=args.views, prefetch=args.prefetch,
                epochs=args.epochs)
            rows.append(dict(provider=used, clips_per_s=cps, batch=args.batch,
                             workers=args.workers, prefetch=args.prefetch, views=args.views,
                             clip=f"{args.frames}x{args.crop}x{args.crop}", builds=builds,
                             manifest=args.manifest or f"synthetic {args.clips} clips",
                             **env_info(args.device)))
            print(f"{used:>10}: {cps:8.1f} clips/s", flush=True)
    print(markdown_table(rows, ["provider", "clips_per_s", "batch", "workers", "prefetch", "views",
                                "clip", "builds", "device", "torch", "date", "commit"]))
    print(write_csv(rows, Path(args.out) / "pipeline.csv"))
    return rows


if __name__ == "__main__":
    main()
