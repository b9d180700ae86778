"""Dictionaries and candidate pools: ring buffers of L2-normalised keys with the dataset index
of each key (-1 = no clip, e.g. a random initial key).

``KeyQueue`` (the dictionary D_x, K keys): ``enqueue`` overwrites the oldest entries, wrapping
around; any K works (no K % M == 0 requirement). The write pointer lives on the device, so an
enqueue never syncs with the host.

``KeyPool`` (the candidate pool U_x, N keys): ``rolling`` mode pushes every key-encoder output
(FIFO of the most recent N); ``epoch`` mode replaces the whole pool at each epoch start
(``fill``). ``count`` (valid entries, host-side int) is saved with the state dict, and so is
``refresh``, the next slot that ``CMACC`` re-encodes with ``--pool-refresh`` (round robin).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class KeyQueue(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.size = size
        self.register_buffer("keys", F.normalize(torch.randn(size, dim), dim=1))  # [K, d]
        self.register_buffer("index", torch.full((size,), -1, dtype=torch.long))  # [K]
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))  # next write slot

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor, index: torch.Tensor) -> None:
        """Write m keys at the pointer (wrapping), dequeuing the m oldest."""
        m = keys.shape[0]  # [m, d]
        if m > self.size:  # only the newest K survive
            keys, index, m = keys[-self.size:], index[-self.size:], self.size
        pos = (self.ptr + torch.arange(m, device=self.ptr.device)) % self.size  # [m]
        self.keys.index_copy_(0, pos, keys.to(self.keys.dtype))
        self.index.index_copy_(0, pos, index.to(torch.long))
        self.ptr.copy_((self.ptr + m) % self.size)

    def last(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [m, d], index [m]) of the m newest entries, oldest first (m <= K)."""
        pos = (self.ptr - m + torch.arange(m, device=self.ptr.device)) % self.size  # [m]
        return self.keys[pos], self.index[pos]

    @torch.no_grad()
    def fill(self, keys: torch.Tensor, index: torch.Tensor) -> None:
        """Replace the contents (initialisation with K encoded random clips)."""
        if keys.shape[0] != self.size:
            raise ValueError(f"fill: need exactly K={self.size} keys, got {keys.shape[0]}")
        self.keys.copy_(keys)
        self.index.copy_(index)
        self.ptr.zero_()


class KeyPool(KeyQueue):
    def __init__(self, size: int, dim: int):
        super().__init__(size, dim)
        self.keys.zero_()
        self.count = 0  # valid entries: slots [0, count) until the pool is full
        self.refresh = 0  # next slot to re-encode (pool refresh, round robin over the slots)

    @torch.no_grad()
    def push(self, keys: torch.Tensor, index: torch.Tensor) -> None:
        self.enqueue(keys, index)
        self.count = min(self.size, self.count + keys.shape[0])

    @torch.no_grad()
    def fill(self, keys: torch.Tensor, index: torch.Tensor) -> None:
        super().fill(keys, index)
        self.count = self.size

    def valid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [n, d], index [n]) of the valid entries."""
        return self.keys[: self.count], self.index[: self.count]

    def next_refresh(self, m: int) -> torch.Tensor:
        """The m slots to re-encode now [m] (host; wrapping over the valid entries), and the
        pointer moved past them."""
        slots = (self.refresh + torch.arange(m)) % self.count
        self.refresh = (self.refresh + m) % self.count
        return slots

    def get_extra_state(self):
        return {"count": int(self.count), "refresh": int(self.refresh)}

    def set_extra_state(self, state):
        self.count = int(state["count"])
        self.refresh = int(state.get("refresh", 0))  # checkpoints from before pool refresh
