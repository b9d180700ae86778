"""Benchmark: one dictionary's active selection = grad_embed + k-means++ seeding of M centres.

Providers (DESIGN.md §4):
  triton        kernels.select on CUDA (fused grad_embed with |g|^2, row-space compression,
                k-means++ launches replayed from a CUDA graph)
  factored      the PyTorch reference: kernels.reference grad_embed(compress=True) + kmeanspp
  materialised  the PyTorch reference with g_n = alpha_n (x) beta_n materialised (d*d_h floats
                per candidate) and kmeanspp_dense over it
  sklearn       sklearn.cluster.kmeans_plusplus(n_local_trials=1) on the materialised g (CPU)

Bytes a selection must move (fp32; the model behind the GB/s column): read keys, queries and
features once, then each of the k steps reads the factored pool (a + b floats per candidate)
plus |g|^2 and D:  N*d*4 + M*(d+d_h)*4 + k*N*(a+b+2)*4 with a = d, b = min(M, d_h).

    python bench/bench_kmeanspp.py --device cpu --sizes 4096 38400 --out bench/results
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import base_parser, check_device, env_info, report, time_fn  # noqa: E402
from kernels import reference as ref  # noqa: E402

GIB = 2**30


def make_inputs(n, m, d, dh, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = F.normalize(torch.randn(n, d, generator=g), dim=1).to(device)
    queries = F.normalize(torch.randn(m, d, generator=g), dim=1).to(device)
    feats = torch.randn(m, dh, generator=g).to(device)
    return keys, queries, feats


def providers(device):
    import kernels

    def triton_sel(keys, queries, feats, k, seed):
        import os

        os.environ["CMACC_KERNELS"] = "triton"
        return kernels.select(keys, queries, feats, k, seed=seed, validate=False)

    def factored(keys, queries, feats, k, seed):
        a, b = ref.grad_embed(keys, queries, feats, compress=True)
        return ref.kmeanspp(a, b, k, seed=seed, validate=False)

    def materialised(keys, queries, feats, k, seed):
        a, b = ref.grad_embed(keys, queries, feats)
        return ref.kmeanspp_dense(ref.materialise(a, b), k, seed=seed, validate=False)

    def sklearn_pp(keys, queries, feats, k, seed):
        from sklearn.cluster import kmeans_plusplus

        a, b = ref.grad_embed(keys, queries, feats)
        x = ref.materialise(a, b).cpu().numpy()
        return kmeans_plusplus(x, n_clusters=k, n_local_trials=1, random_state=seed)[1]

    out = {"factored": factored, "materialised": materialised}
    if device == "cuda":
        out = {"triton": triton_sel, **out}
    else:
        out["sklearn"] = sklearn_pp
    return out


def bytes_model(n, m, d, dh, k):
    return n * d * 4 + m * (d + dh) * 4 + k * n * (d + min(m, dh) + 2) * 4


def run(sizes, device, m=128, d=128, dh=512, repeats=3, mat_cap_gib=2.5, only=None):
    info = env_info(device)
    rows = []
    measured = {}  # provider -> [(n, seconds)] actually timed, for extrapolation
    for n in sizes:
        keys, queries, feats = make_inputs(n, m, d, dh, device)
        for name, fn in providers(device).items():
            if only and name not in only:
                continue
            row = dict(provider=name, N=n, M=m, d=d, d_h=dh, **info, extrapolated="")
            mat_gib = n * d * dh * 4 / GIB
            if name in ("materialised", "sklearn") and (mat_gib > mat_cap_gib or device == "cpu" and
                                                        name == "sklearn" and mat_gib > 1.1):
                pts = measured.get(name, [])
                if not pts:
                    print(f"skip {name} at N={n}: the materialised pool would be {mat_gib:.1f} GiB "
                          f"(cap {mat_cap_gib} GiB) and no smaller size was timed", flush=True)
                    continue
                n0, t0 = pts[-1]
                sec = t0 * n / n0  # both the materialisation and every step are linear in N
                row["extrapolated"] = f"linear in N from N={n0}"
                print(f"{name} at N={n}: {mat_gib:.1f} GiB materialised > cap; extrapolated "
                      f"linearly from N={n0}", flush=True)
            else:
                sec = time_fn(lambda: fn(keys, queries, feats, m, 1), device,
                              repeats=1 if name in ("materialised", "sklearn") else repeats,
                              warmup=0 if name in ("materialised", "sklearn") else 1)
                measured.setdefault(name, []).append((n, sec))
            row.update(ms=sec * 1e3, gbps=bytes_model(n, m, d, dh, m) / sec / 1e9)
            rows.append(row)
            print(f"{name:>12} N={n:>7}: {sec * 1e3:10.2f} ms  {row['gbps']:.2f} GB/s"
                  f"{'  (extrapolated)' if row['extrapolated'] else ''}", flush=True)
    # ratios at each size
    for n in sizes:
        at = {r["provider"]: r["ms"] for r in rows if r["N"] == n}
        for r in rows:
            if r["N"] == n:
                r["materialised_over_this"] = at.get("materialised", float("nan")) / r["ms"]
                r["factored_over_this"] = at.get("factored", float("nan")) / r["ms"]
    return rows


def main(argv=None):
    p = base_parser(__doc__)
    p.add_argument("--providers", nargs="+", help="subset of: triton factored materialised sklearn")
    p.add_argument("--materialised-cap-gib", type=float, default=2.5,
                   help="above this the materialised/sklearn times are extrapolated (linear in N)")
    args = p.parse_args(argv)
    check_device(p, args)
    rows = run(args.sizes, args.device, repeats=args.repeats, mat_cap_gib=args.materialised_cap_gib,
               only=args.providers)
    report(rows, ["provider", "N", "ms", "gbps", "materialised_over_this", "factored_over_this",
                  "extrapolated", "device", "torch", "triton", "date", "commit"],
           args.out, "selection", "selection (grad_embed + k-means++, M=128)")
    return rows


if __name__ == "__main__":
    main()
