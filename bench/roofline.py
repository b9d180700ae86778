"""Roofline estimate of one dictionary's selection per kernel variant: bytes moved and launches
per selection, and the time floors they imply on an H100 -- an estimate from the code's memory
traffic, not a measurement (bench/gpu_check.py measures).

    python bench/roofline.py [--n 38400] [--m 128] [--d 128] [--dh 512] [--markdown]

Bytes per selection (k = M steps; s = 4 for fp32 factors, 2 for bf16; Gram route in the head
view: a = d, b = M; queries view: a = M, b = d):
    embedding   N*d*4 (keys) + N*(a + b [+ b for beta_c])*s + N*4 (|g|^2)
    k-means++   per step: N*(a + b)*s (factors) + N*4 (|g|^2) + N*4*2 (D read and written)
Launches per selection: 1 Gram matmul (head view) + 1 embedding + (k + 1) k-means++ launches
(``steps``) or 1 (``persistent``, plus one grid barrier per step), all replayed from one graph.
Floors: bytes / bandwidth for HBM3 (3.35 TB/s, H100 SXM) and for L2 when the per-step working set
fits its 50 MB (~2.5x HBM, an assumption); launches at ~2.5 us each inside a CUDA graph, or a
~1.5 us grid barrier per step for the persistent variant.
"""

from __future__ import annotations

import argparse

HBM_TBS = 3.35
L2_BYTES = 50e6
L2_FACTOR = 2.5
GRAPH_LAUNCH_US = 2.5
BARRIER_US = 1.5


def estimate(n, m, d, dh, *, view, factors, variant):
    k = m
    s = 4 if factors == "fp32" else 2
    gram = view == "head" and dh > m
    a, b = (d, m if gram else dh) if view == "head" else (m, d)
    embed = n * d * 4 + n * (a + b + (b if gram else 0)) * s + n * 4
    step = n * (a + b) * s + n * 4 + n * 8
    total = embed + k * step
    launches = (1 if gram else 0) + 1 + (k + 1 if variant == "steps" else 1)
    in_l2 = step <= L2_BYTES
    bw = HBM_TBS * (L2_FACTOR if in_l2 else 1.0) * 1e12
    mem_ms = (embed / (HBM_TBS * 1e12) + k * step / bw) * 1e3
    sync_ms = (launches * GRAPH_LAUNCH_US if variant == "steps" else
               GRAPH_LAUNCH_US * launches + k * BARRIER_US) / 1e3
    return dict(view=view, factors=factors, kmeans=variant, step_mb=step / 1e6,
                total_gb=total / 1e9, launches=launches, in_l2=in_l2,
                hbm_ms=total / (HBM_TBS * 1e12) * 1e3, floor_ms=mem_ms + sync_ms)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=38400)
    p.add_argument("--m", type=int, default=128)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--dh", type=int, default=512)
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    rows = [estimate(args.n, args.m, args.d, args.dh, view=v, factors=f, variant=k)
            for v in ("head", "queries") for f in ("fp32", "bf16") for k in ("steps", "persistent")]
    print("| view | factors | k-means++ | MB per step | GB per selection | launches | step set "
          "in L2 | all from HBM, ms | estimated floor, ms |")
    print("|---|---|---|---:|---:|---:|---|---:|---:|")
    for r in rows:
        print(f"| {r['view']} | {r['factors']} | {r['kmeans']} | {r['step_mb']:.1f} | "
              f"{r['total_gb']:.2f} | {r['launches']} | {'yes' if r['in_l2'] else 'no'} | "
              f"{r['hbm_ms']:.2f} | {r['floor_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
