"""Distributed helpers. Every function is the identity at world size 1 (or without
torch.distributed initialised), so the method runs unchanged in one process."""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


@torch.no_grad()
def gather_cat(x: torch.Tensor) -> torch.Tensor:
    """Concatenate ``x`` from all ranks along dim 0 (no gradient), rank order."""
    if world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, 0)


@torch.no_grad()
def broadcast_(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    if world_size() > 1:
        dist.broadcast(x, src)
    return x


@torch.no_grad()
def batch_shuffle(x: torch.Tensor, generator: torch.Generator | None = None):
    """Shuffle-BN (MoCo): gather the global batch, permute it with a permutation shared by all
    ranks (drawn on rank 0, broadcast), return this rank's slice and the inverse permutation."""
    if world_size() == 1:
        return x, None
    local = x.shape[0]
    xs = gather_cat(x)  # [B_global, ...]
    perm = torch.randperm(xs.shape[0], device=x.device, generator=generator)
    broadcast_(perm, 0)
    unshuffle = torch.argsort(perm)
    r = rank()
    return xs[perm[r * local:(r + 1) * local]], unshuffle


@torch.no_grad()
def batch_unshuffle(x: torch.Tensor, unshuffle: torch.Tensor | None) -> torch.Tensor:
    """Undo ``batch_shuffle`` on the key encoder outputs: this rank's original rows."""
    if unshuffle is None:
        return x
    local = x.shape[0]
    xs = gather_cat(x)
    r = rank()
    return xs[unshuffle[r * local:(r + 1) * local]]
