"""The study's encoders: a small CNN with per-part batch norm (shuffle-BN in one process), and
SMoCo's second view."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class GroupBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm whose training statistics come from ``groups`` equal, consecutive parts of the
    batch, as if each part were on its own device (MoCo's per-GPU BN, simulated in one
    process); running statistics are the mean over the parts. Eval mode: plain BN.

    Each part of a channels-last batch (consecutive samples) is itself channels-last and
    contiguous, so each runs native BN as it is (no layout change); the only copy is the
    concatenation of the outputs. Each part updates its own copy of the running statistics,
    and ``running_mean``/``running_var`` become their mean (the same as updating with the
    parts' mean statistics: the update is linear). Measured on 2 CPU cores at l = 4 (M = 128,
    width 32): 219 ms a training step, against 293 ms when the parts were laid side by side as
    channels (a copy in and out of every BN, and BN in NCHW)."""

    def __init__(self, channels: int, groups: int = 1):
        super().__init__(channels)
        self.groups = groups

    def forward(self, x):
        b = x.shape[0]
        if not self.training or self.groups == 1:
            return super().forward(x)
        if b % self.groups:
            raise ValueError(f"batch {b} is not a multiple of the BN groups {self.groups}")
        g = self.groups
        runs = [(self.running_mean.clone(), self.running_var.clone()) for _ in range(g)]
        # a part (consecutive samples) of a channels-last batch is itself channels-last and
        # contiguous: native BN on each, one copy (the concatenation) for the output
        y = torch.cat([F.batch_norm(part, rm, rv, self.weight, self.bias, training=True,
                                    momentum=self.momentum, eps=self.eps)
                       for part, (rm, rv) in zip(x.chunk(g), runs)])
        with torch.no_grad():
            self.running_mean.copy_(torch.stack([rm for rm, _ in runs]).mean(0))
            self.running_var.copy_(torch.stack([rv for _, rv in runs]).mean(0))
            self.num_batches_tracked += 1
        return y


class SmallCNN(nn.Module):
    """4 stride-2 conv-BN-ReLU layers (width w, 2w, 4w, 4w) and global average pooling; BN
    statistics over ``bn_groups`` parts of the batch (GroupBatchNorm2d)."""

    def __init__(self, width=32, bn_groups=1):
        super().__init__()
        layers, c = [], 1
        for w in (width, 2 * width, 4 * width, 4 * width):
            layers += [nn.Conv2d(c, w, 3, stride=2, padding=1, bias=False),
                       GroupBatchNorm2d(w, bn_groups), nn.ReLU(inplace=True)]
            c = w
        self.net = nn.Sequential(*layers)
        self.out_dim = c

    def forward(self, x):
        return F.adaptive_avg_pool2d(self.net(x), 1).flatten(1)


def augment(x: torch.Tensor, g: torch.Generator, *, shift: int = 2, noise: float = 0.05):
    """SMoCo's second view, per sample: a random translation by up to ``shift`` px (zero fill)
    and Gaussian pixel noise. x [B, 1, H, W] float."""
    b, _, h, w = x.shape
    pad = F.pad(x, (shift, shift, shift, shift))
    d = torch.randint(0, 2 * shift + 1, (b, 2), generator=g)  # [B, (dy, dx)]
    rows = (d[:, 0, None] + torch.arange(h))[:, :, None]  # [B, H, 1]
    cols = (d[:, 1, None] + torch.arange(w))[:, None, :]  # [B, 1, W]
    out = pad[torch.arange(b)[:, None, None], 0, rows, cols].unsqueeze(1)  # [B, 1, H, W]
    if noise:
        out = out + noise * torch.randn(out.shape, generator=g)
    return out.contiguous(memory_format=torch.channels_last)
