"""The lazy k-means++ race against the eager reference on trained embeddings: same picks?

The CPU selection (kernels.select on CPU tensors: the reference's factors + the lazy race of
kernels/lazy_kmeanspp.py) must draw the reference's picks (kernels.reference.select: every
candidate's distance brought up to date at every step). The tests check that on random inputs;
this checks it where it matters, on the pools of a model being trained: the MI study's CM-ACC
(cmacc/apps/mi, width 16, M = 128, K = 30 M, N = --pool-mult * M, rolling pool) is trained
--train-steps steps on Omniglot (--omniglot ROOT) or generated glyphs, then, for --selections
further batches, both dictionaries' selections are made by both implementations from the same
pool, queries, features, exclusion and seed, and compared: identical index sequences, and the
candidates each step of the lazy race brought up to date (``touched``, summed over the steps after
the first full pass) per step.

    python bench/lazy_agreement.py --omniglot ROOT --chars 3 --train-steps 300
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_step import glyph_root, mi_setting, train_step  # noqa: E402
from bench.common import env_info  # noqa: E402
from cmacc.samplers import in_sorted, selection_seed  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels.lazy_kmeanspp import kmeanspp_lazy  # noqa: E402


@torch.no_grad()
def compare(model, video, audio, seed) -> list[dict]:
    """Both dictionaries' selections for this batch, lazy vs eager: [{same, touched}] x 2."""
    q_v, h_v = model.f_v(video)
    q_a, h_a = model.f_a(audio)
    out = []
    for pool, dictionary, q, h in ((model.pool_v, model.dict_v, q_a, h_a),
                                   (model.pool_a, model.dict_a, q_v, h_v)):
        keys, index = pool.valid()
        exclude = in_sorted(index, dictionary.index.sort().values)
        tau, view, m = model.sel.tau_p, model.sel.grad_view, q.shape[0]
        alpha, beta, beta_c, sqn = ref.select_factors(keys, q, h.float(), tau=tau, view=view)
        want = ref.kmeanspp(alpha, beta, m, seed=seed, exclude=exclude, beta_c=beta_c, sqn=sqn)
        stats = {}
        got = kmeanspp_lazy(alpha, beta, m, seed=seed, exclude=exclude, beta_c=beta_c, sqn=sqn,
                            stats=stats)
        out.append(dict(same=bool(torch.equal(got, want)),
                        same_set=bool(set(got.tolist()) == set(want.tolist())),
                        touched=stats["touched"] / (m - 2)))
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--omniglot", metavar="ROOT", help="default: generated glyphs")
    p.add_argument("--chars", type=int, default=3, help="l (default 3)")
    p.add_argument("--pool-mult", type=int, default=300, help="N = this * M (default 300)")
    p.add_argument("--train-steps", type=int, default=300, help="default 300")
    p.add_argument("--selections", type=int, default=10, help="batches compared (default 10)")
    args = p.parse_args(argv)
    if args.train_steps < 0 or args.selections < 1 or not 1 <= args.chars <= 8:
        p.error("need --train-steps >= 0, --selections >= 1, --chars in 1..8")
    info = env_info("cpu")
    print(f"device: {info['device']}, {info['date']}, commit {info['commit']}")
    from cmacc.apps.mi.data import Glyphs

    with tempfile.TemporaryDirectory() as tmp:
        glyphs = Glyphs(glyph_root(args.omniglot, Path(tmp)))
        s = mi_setting("active", args.chars, args.pool_mult, glyphs)
        for step in range(args.train_steps):
            train_step(s, step)
        rows = []
        for i in range(args.selections):
            video, audio, _ = s.next_batch()
            seed = selection_seed(0, args.train_steps + i, 0)
            rows += compare(s.model, video, audio, seed)
    same = sum(r["same"] for r in rows)
    same_set = sum(r["same_set"] for r in rows)
    touched = [r["touched"] for r in rows]
    data = args.omniglot or "generated glyphs"
    print(f"MI CM-ACC, l = {args.chars}, N = {args.pool_mult} M, after {args.train_steps} "
          f"training steps ({data}): {same} of {len(rows)} selections drew the reference's "
          f"picks in the same order ({same_set} the same set); the lazy race brought "
          f"{statistics.fmean(touched):.2f} candidates up to date per step on average "
          f"(max {max(touched):.2f} over a selection)")
    return rows


if __name__ == "__main__":
    main()
