"""CPU selection, side by side: ours (lazy race and reference) vs BADGE's own seeding.

One dictionary's active selection (gradient-embedding factors + k-means++ seeding of k
centres) in the `queries` view (alpha = r [N, M], beta = k / tau [N, d]) on the CPU, the
providers in one run (docs/DESIGN.md §4):

  lazy        kernels.select on CPU tensors, what training runs: the reference's factors, then
              the lazy exponential race (kernels/lazy_kmeanspp.py): the reference's picks, with
              one full pass over the pool (the first centre's distances) and then, per step,
              one pass over the [N] stale distances and a few candidates brought up to date.
  lazy-bf16   the same with the factors stored in bf16 (``factors="bf16"``), as on the GPU.
  reference   kernels.reference.select: the factors in torch, then (CPU tensors) the k steps
              in numpy on views of the same memory: per step two matrix-vector products
              (OpenBLAS) for the factored distances, a minimum, and the exponential-race draw
              (an argmax), with uniforms from the counter-based hash, 16 steps at a time.
  badge-own   only with --badge-src FILE: BADGE's own ``init_centers`` and ``distance``, read
              from the BADGE authors' ``query_strategies/badge_sampling.py`` (their repository
              at github.com/JordanAsh/badge; not part of this project) and run as they wrote them,
              driven as their ``BadgeSampling.query`` drives them: factored distances in
              float64, D^2 sampling with ``scipy.stats.rv_discrete``, the largest-norm point
              first; their per-step print goes to /dev/null. The softmax that gives their
              ``probs`` is computed here in numpy (their ``get_embedding`` runs the network).
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

PROVIDERS = ("lazy", "lazy-bf16", "reference", "badge", "badge-own")


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


def load_badge(path: str) -> dict:
    """BADGE's own ``distance`` and ``init_centers`` from their badge_sampling.py, unchanged:
    the two function definitions are taken from the file's syntax tree (the module itself
    imports their networks) and defined with numpy and scipy.stats, as the file imports them."""
    import ast

    from scipy import stats

    tree = ast.parse(Path(path).read_text(), filename=path)
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef)
           and n.name in ("distance", "init_centers")]
    if len(fns) != 2:
        raise SystemExit(f"--badge-src {path}: no distance / init_centers functions in it; "
                         "pass the BADGE authors' query_strategies/badge_sampling.py")
    ns = {"np": np, "stats": stats}
    exec(compile(ast.Module(body=fns, type_ignores=[]), path, "exec"), ns)
    return ns


def badge_own(ns: dict, keys: np.ndarray, queries: np.ndarray, k: int, tau: float):
    """k indices by BADGE's ``init_centers`` loop, driven as ``BadgeSampling.query`` drives it
    (its lines from ``m = ...`` on), with embs = keys / tau and probs = softmax(keys q^T / tau):
    the `queries` view's factors (their probs - e_max is -r, the same distances)."""
    import contextlib
    import os

    s = keys @ queries.T / tau  # [N, M]
    probs = np.exp(s - s.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    embs = keys / tau  # [N, d]
    m = len(embs)
    mu = D2 = None
    chosen, chosen_list = set(), []
    emb_norms_square = np.sum(embs ** 2, axis=-1)
    max_inds = np.argmax(probs, axis=-1)
    probs = -1 * probs
    probs[np.arange(m), max_inds] += 1
    prob_norms_square = np.sum(probs ** 2, axis=-1)
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        for _ in range(k):
            chosen, chosen_list, mu, D2 = ns["init_centers"](
                (probs, prob_norms_square), (embs, emb_norms_square), chosen, chosen_list, mu, D2)
    return np.asarray(chosen_list, dtype=np.int64)


def providers(tau: float, badge_src: str | None = None) -> dict:
    """name -> fn(keys, queries, k, seed) -> k indices, on CPU tensors."""
    import kernels

    def lazy(keys, queries, k, seed):
        return kernels.select(keys, queries, None, k, seed=seed, tau=tau, view="queries")

    def lazy_bf16(keys, queries, k, seed):
        return kernels.select(keys, queries, None, k, seed=seed, tau=tau, view="queries",
                              factors="bf16")

    def reference(keys, queries, k, seed):
        return ref.select(keys, queries, None, k, seed=seed, tau=tau, view="queries")

    def badge(keys, queries, k, seed):
        return badge_select(keys.numpy(), queries.numpy(), k, tau=tau, seed=seed)

    out = {"lazy": lazy, "lazy-bf16": lazy_bf16, "reference": reference, "badge": badge}
    if badge_src:
        ns = load_badge(badge_src)
        out["badge-own"] = lambda keys, queries, k, seed: badge_own(
            ns, keys.numpy(), queries.numpy(), k, tau)
    return out


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


def run(sizes, repeats=5, m=128, d=128, k=128, tau=0.7, seed=0, badge_src=None,
        only=None) -> list[dict]:
    """Rows {N, provider, s, threads, picks_as_reference}, plus on each row the time of each
    BADGE provider over this one (``over``: {badge provider: ratio})."""
    fns = providers(tau, badge_src)
    fns = {name: fn for name, fn in fns.items() if not only or name in only}
    rows = []
    for n in sizes:
        keys, queries = make_inputs(n, m, d, seed=seed)
        at = {}
        want = ref.select(keys, queries, None, k, seed=seed, tau=tau, view="queries")
        for name, fn in fns.items():
            idx = torch.as_tensor(np.asarray(fn(keys, queries, k, seed)))
            if len(set(idx.tolist())) != k:
                raise RuntimeError(f"{name} at N={n} did not return {k} distinct indices")
            at[name] = median_s(lambda: fn(keys, queries, k, seed), repeats)
            same = None if name.startswith("badge") else torch.equal(idx, want)  # same seed
            rows.append(dict(N=n, provider=name, s=at[name], threads=threads(),
                             picks_as_reference=same))
            print(f"{name:>10} N={n:>7}: {at[name] * 1e3:9.1f} ms", flush=True)
        for r in rows[-len(fns):]:
            r["over"] = {b: at[b] / r["s"] for b in ("badge-own", "badge") if b in at}
    return rows


def markdown(rows) -> str:
    lines = ["| provider | N | median time per selection | badge-own / this | badge-style / this "
             "| picks = reference's | threads |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        over = r.get("over", {})
        ratio = [f"**{over[b]:.1f}x**" if b in over else "" for b in ("badge-own", "badge")]
        same = {None: "", True: "yes", False: "no"}[r["picks_as_reference"]]
        lines.append(f"| {r['provider']} | {r['N']:,} | {r['s'] * 1e3:.0f} ms | {ratio[0]} | "
                     f"{ratio[1]} | {same} | {r['threads']} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[9600, 38400],
                   help="candidate pool sizes N (default: 9600 38400)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per point (median; "
                   "default 5)")
    p.add_argument("--k", type=int, default=128, help="centres per selection (default 128)")
    p.add_argument("--m", type=int, default=128, help="queries in the batch, M (default 128)")
    p.add_argument("--d", type=int, default=128, help="key dimension (default 128)")
    p.add_argument("--tau", type=float, default=0.7, help="default 0.7")
    p.add_argument("--badge-src", metavar="FILE",
                   help="the BADGE authors' query_strategies/badge_sampling.py: adds the "
                        "badge-own provider (their init_centers as written)")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS,
                   help="run only these (default: all; badge-own needs --badge-src)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.k < 1 or min(args.sizes) < args.k:
        p.error("need --repeats >= 1, --k >= 1 and every size >= k")
    if args.badge_src and not Path(args.badge_src).is_file():
        p.error(f"--badge-src {args.badge_src}: no such file")
    print(f"device: CPU, {torch.get_num_threads()} threads, {cpu_model()}; torch "
          f"{torch.__version__}, numpy {np.__version__}; {datetime.date.today().isoformat()}")
    rows = run(args.sizes, args.repeats, m=args.m, d=args.d, k=args.k, tau=args.tau,
               badge_src=args.badge_src, only=args.providers)
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
