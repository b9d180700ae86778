"""What is enqueued into a dictionary D_x each iteration (docs/DESIGN.md §1).

    random          XMoCo: the current batch's keys (MoCo)
    active          CM-ACC: k-means++ over last-layer gradient embeddings (kernels.select)
    active-feature  k-means++ over the raw candidate keys (paper Table 2)
    ohem            the M candidates with the highest pseudo-label CE loss (paper Table 3)
    pool-random     M uniform picks from the same pool, enqueued with the pool's stored keys:
                    a control, the pool's staleness without any selection

Active samplers pick from the pool U_x minus the candidates whose clip is already in D_x. The
pseudo-label space is the other modality's queries of the (global) batch. No host sync: if a
degenerate pool (tiny dataset) leaves fewer than M eligible candidates, the exclusion is
dropped for that step on the device and ``fallback`` records it.

The pool is passed as its capacity buffers and the valid count n: on a GPU the active
selection reads the buffer in place, from one CUDA graph for every n (kernels/triton_select.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from kernels.select_pool import dictionary_exclusion, in_sorted  # noqa: F401 (in_sorted: cmacc's)

from .config import SAMPLERS


@dataclass
class Selection:
    keys: torch.Tensor  # [m, d]
    index: torch.Tensor  # [m] dataset indices
    gnorm: torch.Tensor  # [] mean gradient-embedding norm |alpha||beta| of what was enqueued
    fallback: torch.Tensor  # [] 1.0 if the exclusion had to be dropped


def grad_norms(keys, queries, feats, *, tau_p, view) -> torch.Tensor:
    """|g_n| = |alpha_n| |beta_n| for each key [n]."""
    alpha, beta = kernels.grad_embed(keys, queries, feats, tau=tau_p, view=view)
    return alpha.norm(dim=1) * beta.norm(dim=1)


def selection_seed(base: int, step: int, which: int) -> int:
    """Same on every rank: a function of the run seed, the step and the dictionary (0=v, 1=a)."""
    return (int(base) * 1_000_003 + int(step) * 2 + int(which)) & ((1 << 62) - 1)


@torch.no_grad()
@kernels.without_autocast  # OHEM scores and every selection in fp32, also under training AMP
def select(
    sampler: str,
    *,
    pool_keys: torch.Tensor,  # [cap, d] (rows [0, n) valid)
    pool_index: torch.Tensor,  # [cap]
    dict_index: torch.Tensor,  # [K]
    queries: torch.Tensor,  # [M, d] other modality's queries (pseudo-label space)
    feats: torch.Tensor,  # [M, d_h] their pre-head features
    m: int,
    seed: int,
    tau_p: float = 1.0,
    view: str = "head",
    n: int | None = None,  # valid candidates (default: every row)
    engine: dict | None = None,  # kernels.select options: precision, factors, variant
) -> Selection:
    if sampler not in SAMPLERS or sampler == "random":
        raise ValueError(f"select: sampler {sampler!r} is not one of {SAMPLERS[1:]}")
    n = pool_keys.shape[0] if n is None else n
    if n < m:
        raise ValueError(f"select: the pool holds {n} candidates, fewer than m={m}")
    if sampler == "active":  # U \ D, the picks, their keys: one CUDA graph on the Triton path
        return Selection(*kernels.select_from_pool(
            pool_keys, pool_index, dict_index, queries, feats, m, seed=seed, n=n, tau=tau_p,
            view=view, **(engine or {})))
    valid = torch.arange(pool_keys.shape[0], device=pool_keys.device) < n  # [cap]
    exclude, too_few = dictionary_exclusion(pool_index, dict_index, valid, m)  # U \ D
    exclude = exclude[:n]
    if sampler == "active-feature":
        ones = torch.ones(n, 1, device=pool_keys.device)
        idx = kernels.kmeanspp(pool_keys[:n], ones, m, seed=seed, exclude=exclude,
                               validate=False)
    elif sampler == "pool-random":  # the top m of n i.i.d. uniform scores: a uniform m-subset
        g = torch.Generator(device=pool_keys.device).manual_seed(seed)
        u = torch.rand(n, generator=g, device=pool_keys.device)  # [n] in [0, 1)
        idx = u.masked_fill(exclude, -1.0).topk(m).indices  # excluded never beat an eligible
    else:  # ohem: CE(p_n, yhat_n) = logsumexp_j s_nj - max_j s_nj
        s = pool_keys[:n].float() @ queries.float().t() / tau_p  # [n, M]
        ce = torch.logsumexp(s, 1) - s.max(1).values  # [n]
        ce = ce.masked_fill(exclude, float("-inf"))
        idx = ce.topk(m).indices
    keys, index = pool_keys[idx], pool_index[idx]
    gn = grad_norms(keys, queries, feats, tau_p=tau_p, view=view).mean()
    return Selection(keys, index, gn, too_few.float())
