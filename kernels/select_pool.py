"""One dictionary's whole active selection from its pool: the candidates U \\ D, the picks, and what
is enqueued (docs/DESIGN.md §1 steps 1-6 but the enqueue itself).

    keys [m, d], index [m], gnorm [], fallback [] = select_from_pool(pool_keys, pool_index,
                                                                     dict_index, queries, feats, m,
                                                                     seed=..., n=...)

The candidates are the pool's first n rows whose clip is not in the dictionary; when fewer than
m remain (a tiny data set) the exclusion is dropped and ``fallback`` is 1. ``gnorm`` is the mean
gradient-embedding norm |alpha_n| |beta_n| of the picks. No host sync, no data-dependent shape:
the exclusion is a binary search in the sorted dictionary indices over the pool's capacity.

This module holds the eager composition (every device but the Triton path's, and the reference
the Triton path is tested against); on the Triton path ``kernels/triton_select.py``
``SelectPlan.run_pool`` runs the same steps inside the plan's one CUDA graph.
"""

from __future__ import annotations

import torch

__all__ = ["in_sorted", "dictionary_exclusion", "select_from_pool_eager"]


def in_sorted(x: torch.Tensor, sorted_set: torch.Tensor) -> torch.Tensor:
    """``torch.isin(x, sorted_set)`` for a sorted set, by binary search: no data-dependent
    output size, so no host sync on CUDA (``torch.isin`` sorts through ``unique`` there, which
    waits for the device: twice per dictionary per step)."""
    if sorted_set.numel() == 0:
        return torch.zeros_like(x, dtype=torch.bool)
    pos = torch.searchsorted(sorted_set, x).clamp_max(sorted_set.numel() - 1)  # [n]
    return sorted_set[pos] == x


def dictionary_exclusion(pool_index, dict_index, valid, m):
    """(exclude [cap] bool, too_few [] bool): the rows of the pool whose clip is in the dictionary,
    among the ``valid`` ones ([cap] bool: the first n); none (``too_few``) when fewer than m
    valid rows would remain."""
    exclude = in_sorted(pool_index, dict_index.sort().values) & valid  # [cap]  U \ D
    too_few = (valid & ~exclude).sum() < m  # [] bool, stays on the device
    return exclude & ~too_few, too_few


def select_from_pool_eager(select, grad_embed, pool_keys, pool_index, dict_index, queries, feats,
                           m, *, seed, n, tau, view, engine):
    """The selection as eager ops: ``select`` and ``grad_embed`` are the dispatched
    ``kernels.select`` / ``kernels.grad_embed``; ``engine``: select's precision, factors and
    variant."""
    valid = torch.arange(pool_keys.shape[0], device=pool_keys.device) < n  # [cap]
    exclude, too_few = dictionary_exclusion(pool_index, dict_index, valid, m)
    idx = select(pool_keys, queries, feats, m, seed=seed, tau=tau, view=view, exclude=exclude,
                 validate=False, n=n, **engine)  # [m]
    keys, index = pool_keys[idx], pool_index[idx]
    alpha, beta = grad_embed(keys, queries, feats, tau=tau, view=view)
    gnorm = (alpha.norm(dim=1) * beta.norm(dim=1)).mean()
    return keys, index, gnorm, too_few.float()
