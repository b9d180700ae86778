"""CPU selection, side by side: the PyTorch reference vs a BADGE-style numpy + scipy seeding.

One dictionary's active selection (gradient-embedding factors + k-means++ seeding of k
centres) in the `queries` view (alpha = r [N, M], beta = k / tau [N, d]) on the CPU, two
providers in one run (docs/DESIGN.md §4, issue 13 item 8):

  reference   kernels.reference.select: the factors in torch, then (CPU tensors) the k steps
              in numpy on views of the same memory: per step two matrix-vector products
              (OpenBLAS) for the factored distances, a minimum, and the exponential-race draw
              (an argmax), with uniforms from the counter-based hash, 16 steps at a time.
  badge       ``badge_select`` below, written for this benchmark in numpy + scipy the way
              BADGE's k-means++ seeding (``init_centers`` in the BADGE authors' code) works, on
              the same factored distances: keep D_n = min over centres of ||g_n - g_c||^2,
              updated with a minimum after each new centre, and draw the next centre with
              ``scipy.stats.rv_discrete`` from D / sum(D) (BADGE: squared Euclidean distances
              from sklearn's pairwise_distances on materialised embeddings, an element-wise
              Python loop for the minimum, and the largest-norm embedding as the first centre;
              here the distances are factored, the minimum vectorised and the first centre
              uniform, as in k-means++). Its draws follow the same D^2 law from another RNG,
              so its picks differ from the reference's.

Time: the median wall-clock time (time.perf_counter) of --repeats calls after one warm-up
call, per provider and N. Threads: torch's for the factors (reference), OpenBLAS's for the
matrix-vector products (both providers); numpy's element-wise work is single-threaded. Both
providers start from the same torch inputs and return the k indices. On a machine shared with
other jobs every multi-threaded provider slows down by integer factors (a descheduled thread
stalls each parallel call): take figures on a quiet machine.

    python bench/bench_select_cpu.py                         # N = 9,600 and 38,400
    python bench/bench_select_cpu.py --sizes 38400 --repeats 7
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make kernels/ importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import reference as ref  # noqa: E402

PROVIDERS = ("reference", "badge")


def make_inputs(n: int, m: int, d: int, seed: int = 0):
    """Unit-norm candidate keys [N, d] and queries [M, d], fp32 on the CPU."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)
    queries = torch.nn.functional.normalize(torch.randn(m, d, generator=g), dim=1)
    return keys, queries


def badge_select(keys: np.ndarray, queries: np.ndarray, k: int, *, tau: float,
                 seed: int) -> np.ndarray:
    """BADGE-style k-means++ seeding in numpy + scipy over the factored `queries`-view
    embeddings g_n = r_n (x) k_n / tau: k distinct indices (int64 [k])."""
    from scipy import stats

    rng = np.random.default_rng(seed)
    s = keys @ queries.T / tau  # [N, M] logits
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    r = p
    r[np.arange(len(r)), s.argmax(1)] -= 1.0  # [N, M]  p - e_yhat
    beta = keys / tau  # [N, d]
    sqn = (r * r).sum(1) * (beta * beta).sum(1)  # [N]  |g_n|^2
    n = len(sqn)
    chosen = [int(rng.integers(n))]
    dist = np.full(n, np.inf)
    while len(chosen) < k:
        c = chosen[-1]
        d_new = sqn + sqn[c] - 2.0 * (r @ r[c]) * (beta @ beta[c])  # [N] ||g_n - g_c||^2
        np.minimum(dist, np.maximum(d_new, 0.0), out=dist)
        dist[chosen] = 0.0
        law = stats.rv_discrete(values=(np.arange(n), dist / dist.sum()))
        nxt = int(law.rvs(random_state=rng))
        while nxt in chosen:  # only when every remaining distance is 0 (as BADGE re-draws)
            nxt = int(rng.integers(n))
        chosen.append(nxt)
    return np.asarray(chosen, dtype=np.int64)


def providers(tau: float) -> dict:
    """name -> fn(keys, queries, k, seed) -> k indices, on CPU tensors."""

    def reference(keys, queries, k, seed):
        return ref.select(keys, queries, None, k, seed=seed, tau=tau, view="queries")

    def badge(keys, queries, k, seed):
        return badge_select(keys.numpy(), queries.numpy(), k, tau=tau, seed=seed)

    return dict(reference=reference, badge=badge)


def median_s(fn, repeats: int) -> float:
    """Median wall-clock seconds of ``repeats`` calls of fn() after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def threads() -> str:
    """Torch's intra-op threads and each loaded BLAS's (MKL: torch's, OpenBLAS: numpy's)."""
    out = f"torch {torch.get_num_threads()}"
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return out
    blas = sorted({f"{i['internal_api']} {i['num_threads']}" for i in threadpool_info()
                   if i.get("user_api") == "blas"})
    return ", ".join([out] + blas)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(sizes, repeats=5, m=128, d=128, k=128, tau=0.7, seed=0) -> list[dict]:
    """Rows {N, provider, s, threads}, plus badge_over_reference on the reference rows."""
    fns = providers(tau)
    rows = []
    for n in sizes:
        keys, queries = make_inputs(n, m, d, seed=seed)
        at = {}
        for name, fn in fns.items():
            idx = fn(keys, queries, k, seed)
            if len(set(np.asarray(idx).tolist())) != k:
                raise RuntimeError(f"{name} at N={n} did not return {k} distinct indices")
            at[name] = median_s(lambda: fn(keys, queries, k, seed), repeats)
            rows.append(dict(N=n, provider=name, s=at[name], threads=threads()))
            print(f"{name:>10} N={n:>7}: {at[name] * 1e3:9.1f} ms", flush=True)
        rows[-len(fns)]["badge_over_reference"] = at["badge"] / at["reference"]
    return rows


def markdown(rows) -> str:
    lines = ["| provider | N | median time per selection | badge / reference | threads |",
             "|---|---|---|---|---|"]
    for r in rows:
        ratio = r.get("badge_over_reference")
        lines.append(f"| {r['provider']} | {r['N']:,} | {r['s'] * 1e3:.0f} ms | "
                     f"{'' if ratio is None else f'**{ratio:.2f}x**'} | {r['threads']} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[9600, 38400],
                   help="candidate pool sizes N")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per point (median)")
    p.add_argument("--k", type=int, default=128, help="centres per selection (M)")
    p.add_argument("--m", type=int, default=128, help="queries in the batch (M)")
    p.add_argument("--d", type=int, default=128, help="key dimension")
    p.add_argument("--tau", type=float, default=0.7)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.k < 1 or min(args.sizes) < args.k:
        p.error("need --repeats >= 1, --k >= 1 and every size >= k")
    print(f"device: CPU, {torch.get_num_threads()} threads, {cpu_model()}; torch "
          f"{torch.__version__}, numpy {np.__version__}; {datetime.date.today().isoformat()}")
    rows = run(args.sizes, args.repeats, m=args.m, d=args.d, k=args.k, tau=args.tau)
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
