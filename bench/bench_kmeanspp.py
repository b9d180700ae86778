"""Benchmark one dictionary's active selection (grad_embed + k-means++) across providers.

The selection = grad_embed + k-means++ seeding of k = M centres (docs/DESIGN.md §4), `head` view,
M = 128, d = 128, d_h = 512.

Providers (the baselines are imported from kernels/reference.py, never re-implemented here):
  triton        the Triton branch of kernels.select: a capacity-shaped plan bound to the pool
                buffer (kernels/triton_select.py: fused grad_embed emitting |g|^2, the Gram
                route, k-means++ steps), replayed from its CUDA graph. GPU; on CPU only under
                TRITON_INTERPRET=1 and at the smallest size, printed as "interpreter: not a
                performance figure" and never written to the CSV.
  lazy          (CPU) the reference's factors + kernels/lazy_kmeanspp.py (what kernels.select
                runs on CPU tensors: the reference's picks, a few candidates touched per step)
  factored      reference.select (Gram-route factors + reference.kmeanspp, eager PyTorch)
  materialised  reference.grad_embed (uncompressed) + reference.materialise (d*d_h = 65,536
                floats per candidate) + reference.kmeanspp_dense
  sklearn       sklearn.cluster.kmeans_plusplus(g, n_clusters=M, n_local_trials=1,
                random_state=seed) on the materialised g (CPU only)

Materialised/sklearn above --materialised-cap-gib / --sklearn-cap-gib of embeddings are not
run (memory: 10 GiB at N = 38,400, plus a same-size temporary; minutes per selection on a CPU):
their time is extrapolated linearly in N from the largest size that was measured (materialising
and every seeding step are linear in N), and the row says so.

Bytes a selection must move (fp32), the model behind the GB/s column:
    N*d*4 + M*(d+d_h)*4          read keys, queries, features once
  + N*(a+2b+1)*4                 write alpha, beta, beta_c, |g|^2    (a = d, b = M: Gram route)
  + k*N*(a+b+3)*4                each of the k steps reads alpha, beta, |g|^2, D and writes D
Time per selection: the median, from triton.testing.do_bench on CUDA and from
torch.utils.benchmark.Timer.blocked_autorange on CPU (--min-run-time seconds of calls after a
first, warming one; the slow providers run twice). The sweep is a triton.testing.perf_report
Benchmark over N with a provider axis (bench/common.py).

    python bench/bench_kmeanspp.py --device cpu --sizes 4096 38400 --out bench/results
    python bench/bench_kmeanspp.py --device cuda          # N in {4096, 38400, 150000}
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (base_parser, benchmark, check_device, env_info, finish,  # noqa: E402
                          interpreter_skips, median_ms, report, sweep)
from kernels import reference as ref  # noqa: E402
from kernels.lazy_kmeanspp import kmeanspp_lazy  # noqa: E402

GIB = 2**30
PROVIDERS = ("triton", "lazy", "factored", "materialised", "sklearn")
SLOW = ("materialised", "sklearn")


def make_inputs(n, m, d, dh, device, seed=0):
    """Unit-norm keys [N, d] and queries [M, d], Gaussian pre-head features [M, d_h]."""
    g = torch.Generator().manual_seed(seed)
    keys = F.normalize(torch.randn(n, d, generator=g), dim=1).to(device)
    queries = F.normalize(torch.randn(m, d, generator=g), dim=1).to(device)
    feats = torch.randn(m, dh, generator=g).to(device)
    return keys, queries, feats


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def providers(device) -> dict:
    """name -> fn(keys, queries, feats, k, seed) -> indices, for the providers that can run on
    ``device`` (triton: CUDA, or the interpreter on CPU)."""

    def triton_sel(keys, queries, feats, k, seed):
        from kernels.triton_select import select_triton

        return select_triton(keys, queries, feats, k, seed=seed, n=keys.shape[0], validate=False)

    def factored(keys, queries, feats, k, seed):
        return ref.select(keys, queries, feats, k, seed=seed, validate=False)

    def lazy(keys, queries, feats, k, seed):  # what kernels.select runs on CPU tensors
        alpha, beta, beta_c, sqn = ref.select_factors(keys, queries, feats)
        return kmeanspp_lazy(alpha, beta, k, seed=seed, validate=False, beta_c=beta_c, sqn=sqn)

    def materialised(keys, queries, feats, k, seed):
        a, b = ref.grad_embed(keys, queries, feats)
        return ref.kmeanspp_dense(ref.materialise(a, b), k, seed=seed, validate=False)

    def sklearn_pp(keys, queries, feats, k, seed):
        from sklearn.cluster import kmeans_plusplus

        a, b = ref.grad_embed(keys, queries, feats)
        x = ref.materialise(a, b).cpu().numpy()
        return torch.as_tensor(kmeans_plusplus(x, n_clusters=k, n_local_trials=1,
                                               random_state=seed)[1])

    out = {}
    if device == "cuda" or interpreting():
        out["triton"] = triton_sel
    if device == "cpu":
        out["lazy"] = lazy
    out["factored"] = factored
    out["materialised"] = materialised
    if device == "cpu":
        out["sklearn"] = sklearn_pp
    return out


def bytes_model(n, m, d, dh, k):
    a, b = d, min(m, dh)
    return n * d * 4 + m * (d + dh) * 4 + n * (a + 2 * b + 1) * 4 + k * n * (a + b + 3) * 4


def extrapolate(rows, names):
    """Points of providers ``names`` that were not run (over their cap) get a time linear in N
    from the largest smaller N that was measured (materialising and every seeding step are
    linear in N); the row says so."""
    for name in names:
        timed = [(r["N"], r["ms"]) for r in rows
                 if r["provider"] == name and not math.isnan(r["ms"])]
        for r in rows:
            if r["provider"] != name or not math.isnan(r["ms"]):
                continue
            below = [t for t in timed if t[0] < r["N"]]
            if not below:
                print(f"skip {name} at N={r['N']}: over its cap and no smaller size was timed")
                continue
            n0, ms0 = max(below)
            r.update(ms=ms0 * r["N"] / n0, extrapolated=f"linear in N from N={n0}")
            print(f"{name:>12} N={r['N']:>7}: {r['ms']:11.3f} ms (extrapolated from N={n0})")


def run(sizes, device, m=128, d=128, dh=512, min_run_time=1.0, mat_cap_gib=2.5, sk_cap_gib=1.0,
        only=None):
    names = [p for p in providers(device) if not only or p in only]
    caps = dict(materialised=mat_cap_gib, sklearn=sk_cap_gib)

    @benchmark(sizes, names, "selection", M=m, d=d, d_h=dh, k=m)
    def selection_ms(N, provider, M, d, d_h, k):
        gib = N * d * d_h * 4 / GIB  # the materialised embeddings
        if provider in caps and gib > caps[provider]:
            print(f"{provider} at N={N}: {gib:.1f} GiB of materialised embeddings > its cap "
                  f"{caps[provider]} GiB; not run")
            return float("nan")
        if interpreter_skips(provider, N, sizes, device):
            return float("nan")
        keys, queries, feats = make_inputs(N, M, d, d_h, device)
        fn = providers(device)[provider]
        return median_ms(lambda: fn(keys, queries, feats, k, 1), device, min_run_time=min_run_time)

    rows = [dict(r, extrapolated="") for r in sweep(selection_ms, env_info(device))]
    extrapolate(rows, [p for p in SLOW if p in names])
    rows = finish(rows, device, over=("materialised", "factored"))
    for r in rows:
        r["gbps"] = bytes_model(r["N"], m, d, dh, m) / r["ms"] / 1e6
    return rows


def main(argv=None):
    p = base_parser(__doc__)
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, help="default: all that can run")
    p.add_argument("--materialised-cap-gib", type=float, default=2.5,
                   help="above this many GiB of materialised embeddings, materialised/sklearn "
                        "times are extrapolated linearly in N (default 2.5)")
    p.add_argument("--sklearn-cap-gib", type=float, default=1.0,
                   help="the same for sklearn, ~10x slower than materialised (default 1.0: "
                        "N = 4096 at d*d_h = 65,536)")
    args = p.parse_args(argv)
    check_device(p, args)
    rows = run(args.sizes, args.device, min_run_time=args.min_run_time,
               mat_cap_gib=args.materialised_cap_gib, sk_cap_gib=args.sklearn_cap_gib,
               only=args.providers)
    cols = ["provider", "N", "ms", "gbps", "materialised_over_this", "factored_over_this",
            "extrapolated", "note", "device", "torch", "triton", "date", "commit"]
    report(rows, cols, args.out, "selection", "selection: grad_embed + k-means++, k=M=128, d=128, "
           "d_h=512")
    return rows


if __name__ == "__main__":
    main()
