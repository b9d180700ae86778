"""k-means++ seeding on the CPU that touches a few candidates per step: the lazy exponential race.

The same law, the same uniforms and the same picks as ``reference.kmeanspp`` (docs/DESIGN.md
§1 step 5), without a pass over the pool's factors at every step.

The reference draws centre t as the argmax over candidates of the race score

    score_n = D_n / E_n   (D_n > 0)      -E_n   (D_n == 0)      -inf   (chosen / unavailable)

with D_n = min over the centres so far of ||g_n - g_c||^2 and E_n = -log U(seed, t, n), and it
brings every D_n up to date after each draw: one pass over all N candidates' factors
(N x (a + b) floats: 39 MB at N = 38,400 and a = b = 128) per step, 127 passes per selection.
That pass is the whole cost on a CPU: the bytes do not fit its caches, so each step waits on
memory.

D_n only ever decreases as centres are added. So a D_n that has not been updated since centre s
(a *stale* D_n, with ``seen_n = s`` centres applied) is an upper bound of the true D_n, and
``D_stale_n / E_n`` bounds the true score from above (for D_n == 0 the bound is 0 > -E_n).
Step t therefore

1. computes the bounds of all candidates from the stale D, ``D_stale_n / (1 - U_n)`` (one
   division over an [N] vector, 150 KB, cache-resident; E = -log U >= 1 - U, so no logarithm
   over all N is needed, and correctly rounded divisions keep the fp32 bound >= the fp32 true
   score),
2. brings the candidate with the largest bound up to date (distances to the centres it has
   not seen) and takes its true score s,
3. brings every candidate whose bound reaches s up to date, and draws the argmax of their true
   scores (the lowest index among equal scores, as the reference's argmax).

No candidate left stale can beat the drawn one: its true score is at most its bound, which is
below s <= the drawn score. The draw is the reference's draw, exactly.

How many candidates step 3 touches: the race's winning score is about sum_n D_n (the largest of
N scores whose tails sum to one), and a stale candidate's bound exceeds it with probability
about D_stale_n / sum D; so step 3 touches about sum D_stale / sum D candidates — a handful,
because D falls slowly once the first centres are in. The first centre's distances are the
one full pass (every D_n is +inf before it).

The distances are computed with the reference's formula in fp32,
max(sqn_n + sqn_c - 2 (a_n . a_c)(b_n . bc_c), 0), but the dot products of an update come from
a small matrix product instead of one matrix-vector product per centre: their rounding may
differ in the last bit, so a pick can differ from the reference's only where two race scores
tie to within that rounding (tests check equal picks over many draws). Min-updates applied
twice are harmless (a minimum), so an update covers every centre from the smallest ``seen_n``
of the candidates it brings up to date.
"""

from __future__ import annotations

import numpy as np
import torch

# names, not the package: ``kernels`` imports this module (one import direction)
from .reference import (_RNG_STEPS, _blas_threads, _check_factors, _check_kmeanspp_args,
                        _sqnorm, uniform_hash_steps)

__all__ = ["kmeanspp_lazy"]

_BLOCK = 4096  # candidates updated together (temporaries of _BLOCK x centres floats)


def kmeanspp_lazy(
    alpha: torch.Tensor,  # [N, a]
    beta: torch.Tensor,  # [N, b]
    k: int,
    *,
    seed: int,
    exclude: torch.Tensor | None = None,  # bool [N]
    validate: bool = True,
    beta_c: torch.Tensor | None = None,  # [N, b] centre-side factor (head view's Gram route)
    sqn: torch.Tensor | None = None,  # [N] |g_n|^2, if the caller has it
    stats: dict | None = None,
) -> torch.Tensor:
    """``reference.kmeanspp`` for CPU tensors (same arguments, same picks, long [k]), by the
    lazy exponential race (module docstring). ``stats``, if given, receives ``touched``: the
    candidates whose bound reached the drawn score after the first full pass, summed over the
    steps."""
    _check_factors(alpha, beta, beta_c, sqn)
    if alpha.device.type != "cpu":
        raise ValueError(f"kmeanspp_lazy: CPU tensors only, got {alpha.device}")
    a = alpha.detach().float().numpy()  # [N, a] (a view when already fp32)
    b = beta.detach().float().numpy()  # [N, b]
    bc = b if beta_c is None else beta_c.detach().float().numpy()  # [N, b]
    sq = (_sqnorm(torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(bc))
          if sqn is None else sqn.detach().float()).numpy()  # [N]
    n = sq.shape[0]
    # in numpy: a torch op here would wait on torch's thread pool, woken beside BLAS threads
    unavailable = ~np.isfinite(sq)  # [N] bool
    _check_kmeanspp_args(n, k, exclude, "cpu", validate,
                             nonfinite=torch.from_numpy(unavailable))
    if exclude is not None:
        unavailable |= exclude.detach().numpy().astype(bool, copy=False)
    inf = np.float32(np.inf)

    dmin = np.where(unavailable, -inf, inf).astype(np.float32)  # [N] stale min distances
    seen = np.zeros(n, np.int32)  # [N] centres applied to dmin[n]
    ac = np.empty((k, a.shape[1]), np.float32)  # [k, a] the centres' alpha rows
    bcc = np.empty((k, b.shape[1]), np.float32)  # [k, b] and their beta_c rows
    sqc = np.empty(k, np.float32)  # [k]
    picks = np.empty(k, np.int64)
    touched = 0

    def bring_up_to_date(rows, t):
        """dmin[rows] = min over centres 0..t-1. Rows already up to date, chosen or
        unavailable (-inf) or at D = 0 (it stays 0) need nothing; the others are updated from
        the smallest ``seen`` among them, in blocks of _BLOCK rows (bounded temporaries)."""
        rows = rows[(seen[rows] < t) & (dmin[rows] > 0)]
        for i in range(0, rows.size, _BLOCK):
            r = rows[i:i + _BLOCK]
            s0 = int(seen[r].min())
            cross = (a[r] @ ac[s0:t].T) * (b[r] @ bcc[s0:t].T)  # [R, t - s0]
            d = sq[r, None] + sqc[None, s0:t]
            d -= 2.0 * cross  # 2x is exact: rounds as sqn_n + sqn_c - 2 cross
            np.maximum(d, 0.0, out=d)
            # fmin: a NaN distance never replaces D
            dmin[r] = np.fmin(dmin[r], d.min(axis=1))
            seen[r] = t

    def true_scores(rows, u):
        """The reference's race scores of ``rows`` (E = -log U, as it computes it)."""
        d, neg_e = dmin[rows], np.log(u[rows])
        return np.where(d == 0, neg_e, d / -neg_e)

    # One BLAS thread: each step's products are tiny, and an idle BLAS thread left spinning
    # slows torch's next parallel op on the same cores (the training step that follows).
    with _blas_threads(0, "cpu"), np.errstate(invalid="ignore", over="ignore",
                                                   divide="ignore"):
        for step in range(k):
            j = step % _RNG_STEPS
            if j == 0:
                # the hash in torch (its threads; numpy's passes are single-threaded): the same
                # bits as the reference's numpy uniforms (tests/test_reference.py)
                u = uniform_hash_steps(seed, step, min(_RNG_STEPS, k - step), n).numpy()
                one_minus_u = np.float32(1.0) - u  # exact: U is a multiple of 2^-24 in (0, 1)
            if step == 0:  # a uniform draw among the available candidates
                c = int(np.where(dmin > 0, np.log(u[0]), dmin).argmax())
            elif step == 1:  # the one full pass: every D is +inf before the first centre
                d = sq + sq[picks[0]]
                d -= 2.0 * ((a @ a[picks[0]]) * (b @ bc[picks[0]]))
                np.fmin(dmin, np.maximum(d, 0.0, out=d), out=dmin)
                seen[:] = 1
                c = int(true_scores(slice(None), u[j]).argmax())
            else:
                # E = -log U >= 1 - U, so D_stale / (1 - U) >= D_stale / E >= the true score
                # (0 where D == 0 > -E): a bound without a logarithm over all N
                bound = dmin / one_minus_u[j]  # [N]
                top = int(bound.argmax())
                bring_up_to_date(np.array([top]), step)
                s = float(true_scores(np.array([top]), u[j])[0])
                # ascending: the first index on ties; the slack (2^-20 of s) only adds rows,
                # against a logarithm that rounds below 1 - U
                rows = np.flatnonzero(bound >= s - abs(s) * 2.0**-20)
                touched += rows.size
                if rows.size == 1:  # the top alone (the usual case): it is the draw
                    c = top
                else:
                    bring_up_to_date(rows, step)
                    c = int(rows[true_scores(rows, u[j]).argmax()])
            picks[step] = c
            ac[step], bcc[step], sqc[step] = a[c], bc[c], sq[c]
            dmin[c] = -inf
    if stats is not None:
        stats["touched"] = touched
    return torch.from_numpy(picks)
