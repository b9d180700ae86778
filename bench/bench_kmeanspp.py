"""Benchmark: one dictionary's active selection = grad_embed + k-means++ seeding of k = M centres
(DESIGN.md §4), `head` view, M = 128, d = 128, d_h = 512.

Providers (the baselines are imported from kernels/reference.py, never re-implemented here):
  triton        the Triton branch of kernels.select: fused grad_embed emitting |g|^2, row-space
                compression, k-means++ steps replayed from a CUDA graph. GPU; on CPU only under
                TRITON_INTERPRET=1 and at the smallest size, printed as "interpreter: not a
                performance figure" and never written to the CSV.
  factored      reference.grad_embed(compress=True) + reference.kmeanspp (eager PyTorch)
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
  + N*(a+b+1)*4                  write alpha, beta', |g|^2           (a = d, b = min(M, d_h))
  + k*N*(a+b+2)*4                each of the k steps reads alpha, beta', |g|^2 and D
Time per selection: median over --repeats (one run for materialised/sklearn), synchronised.

    python bench/bench_kmeanspp.py --device cpu --sizes 4096 38400 --out bench/results
    python bench/bench_kmeanspp.py --device cuda          # N in {4096, 38400, 150000}
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import base_parser, check_device, env_info, report, time_fn  # noqa: E402
from kernels import reference as ref  # noqa: E402

GIB = 2**30
PROVIDERS = ("triton", "factored", "materialised", "sklearn")
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
        from kernels.grad_embed import grad_embed_triton_with_norms
        from kernels.kmeanspp import kmeanspp_triton

        a, b, sqn = grad_embed_triton_with_norms(keys, queries, feats, compress=True)
        return kmeanspp_triton(a, b, k, seed=seed, validate=False, sqn=sqn)

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
        return torch.as_tensor(kmeans_plusplus(x, n_clusters=k, n_local_trials=1,
                                               random_state=seed)[1])

    out = {}
    if device == "cuda" or interpreting():
        out["triton"] = triton_sel
    out["factored"] = factored
    out["materialised"] = materialised
    if device == "cpu":
        out["sklearn"] = sklearn_pp
    return out


def bytes_model(n, m, d, dh, k):
    a, b = d, min(m, dh)
    return n * d * 4 + m * (d + dh) * 4 + n * (a + b + 1) * 4 + k * n * (a + b + 2) * 4


def run(sizes, device, m=128, d=128, dh=512, repeats=3, mat_cap_gib=2.5, sk_cap_gib=1.0,
        only=None):
    info = env_info(device)
    rows, measured = [], {}  # measured: provider -> [(N, seconds)] actually timed
    for n in sizes:
        keys, queries, feats = make_inputs(n, m, d, dh, device)
        for name, fn in providers(device).items():
            if only and name not in only:
                continue
            row = dict(provider=name, N=n, M=m, d=d, d_h=dh, k=m, **info, extrapolated="", note="")
            mat_gib = n * d * dh * 4 / GIB
            if name == "triton" and device == "cpu" and n != min(sizes):
                print(f"skip triton at N={n}: the interpreter only runs the smallest size")
                continue
            cap = sk_cap_gib if name == "sklearn" else mat_cap_gib
            if name in SLOW and mat_gib > cap:
                pts = measured.get(name)
                if not pts:
                    print(f"skip {name} at N={n}: {mat_gib:.1f} GiB of materialised embeddings > "
                          f"its cap {cap} GiB and no smaller size was timed")
                    continue
                n0, t0 = pts[-1]
                sec = t0 * n / n0
                row["extrapolated"] = f"linear in N from N={n0}"
                print(f"{name} at N={n}: {mat_gib:.1f} GiB > cap; time extrapolated from N={n0}")
            else:
                slow = name in SLOW or (name == "triton" and device == "cpu")
                sec = time_fn(lambda: fn(keys, queries, feats, m, 1), device,
                              repeats=1 if slow else repeats, warmup=0 if slow else 1)
                measured.setdefault(name, []).append((n, sec))
            if name == "triton" and device == "cpu":
                row["note"] = "interpreter: not a performance figure"
            row.update(ms=sec * 1e3, gbps=bytes_model(n, m, d, dh, m) / sec / 1e9)
            rows.append(row)
            print(f"{name:>12} N={n:>7}: {sec * 1e3:11.2f} ms  {row['gbps']:7.3f} GB/s"
                  f"{'  (extrapolated)' if row['extrapolated'] else ''}{'  ' + row['note']}",
                  flush=True)
    for n in sizes:  # ratios: materialised / this, factored (reference) / this
        at = {r["provider"]: r["ms"] for r in rows if r["N"] == n}
        for r in rows:
            if r["N"] == n:
                r["materialised_over_this"] = at.get("materialised", float("nan")) / r["ms"]
                r["factored_over_this"] = at.get("factored", float("nan")) / r["ms"]
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
    rows = run(args.sizes, args.device, repeats=args.repeats,
               mat_cap_gib=args.materialised_cap_gib, sk_cap_gib=args.sklearn_cap_gib,
               only=args.providers)
    keep = [r for r in rows if not r["note"]]  # interpreter timings never reach the CSV/plot
    cols = ["provider", "N", "ms", "gbps", "materialised_over_this", "factored_over_this",
            "extrapolated", "note", "device", "torch", "triton", "date", "commit"]
    if len(keep) < len(rows):
        from bench.common import markdown_table

        print(markdown_table([r for r in rows if r["note"]], cols))
    report(keep, cols, args.out, "selection", "selection: grad_embed + k-means++, k=M=128, d=128, "
           "d_h=512")
    return rows


if __name__ == "__main__":
    main()
