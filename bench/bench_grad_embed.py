"""Benchmark: the gradient embedding alone (DESIGN.md §1 steps 1-3), `head` view.

Providers: triton (CUDA), factored (kernels.reference.grad_embed), materialised (the reference
followed by building the full g_n = alpha_n (x) beta_n, d*d_h floats per candidate).
Bytes it must move (fp32): read keys, queries, features; write alpha and beta:
N*d*4 + M*(d+d_h)*4 + N*(d+d_h)*4.  FLOPs: 2*N*M*(d+d_h).

    python bench/bench_grad_embed.py --device cpu --sizes 4096 38400 --out bench/results
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_kmeanspp import GIB, make_inputs  # noqa: E402
from bench.common import base_parser, check_device, env_info, report, time_fn  # noqa: E402
from kernels import reference as ref  # noqa: E402


def providers(device):
    out = {"factored": lambda k, q, f: ref.grad_embed(k, q, f),
           "materialised": lambda k, q, f: ref.materialise(*ref.grad_embed(k, q, f))}
    if device == "cuda":
        from kernels.grad_embed import grad_embed_triton

        out = {"triton": lambda k, q, f: grad_embed_triton(k, q, f), **out}
    return out


def run(sizes, device, m=128, d=128, dh=512, repeats=5, mat_cap_gib=2.5):
    info, rows = env_info(device), []
    for n in sizes:
        keys, queries, feats = make_inputs(n, m, d, dh, device)
        for name, fn in providers(device).items():
            if name == "materialised" and n * d * dh * 4 / GIB > mat_cap_gib:
                print(f"skip materialised at N={n}: {n * d * dh * 4 / GIB:.1f} GiB > cap", flush=True)
                continue
            sec = time_fn(lambda: fn(keys, queries, feats), device, repeats=repeats)
            moved = n * d * 4 + m * (d + dh) * 4 + n * (d + dh) * 4
            rows.append(dict(provider=name, N=n, M=m, d=d, d_h=dh, ms=sec * 1e3,
                             gbps=moved / sec / 1e9, tflops=2 * n * m * (d + dh) / sec / 1e12, **info))
            print(f"{name:>12} N={n:>7}: {sec * 1e3:9.3f} ms", flush=True)
    for n in sizes:
        at = {r["provider"]: r["ms"] for r in rows if r["N"] == n}
        for r in rows:
            if r["N"] == n:
                r["factored_over_this"] = at.get("factored", float("nan")) / r["ms"]
    return rows


def main(argv=None):
    p = base_parser(__doc__)
    args = p.parse_args(argv)
    check_device(p, args)
    os.environ.setdefault("CMACC_TF32", "0")
    rows = run(args.sizes, args.device, repeats=args.repeats)
    report(rows, ["provider", "N", "ms", "gbps", "tflops", "factored_over_this", "device",
                  "torch", "triton", "date", "commit"],
           args.out, "grad_embed", "grad_embed (head view, M=128, d=128, d_h=512)")
    return rows


if __name__ == "__main__":
    main()
