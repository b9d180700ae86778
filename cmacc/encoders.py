"""Encoders: video 3-D ResNet-18 (r3d_18 / r2plus1d_18), audio 1-D ResNet-18 over the 80-band
log-mel, the optional cross-modal FC layer ("fcl") and the projection head (the "last layer").

    x ─ backbone ─► f [B, c] ─ fcl: Linear(c, d_h) + ReLU (optional) ─► h [B, d_h]
                                   ─ head: Linear(d_h, d) ─► L2-normalise ─► q [B, d]

``h`` is the pre-head feature H of DESIGN.md §1 step 3 (the head is the last layer, as in the
`head` gradient view). Without fcl, h = f and d_h = c. The fcl sits below the head so that the
head stays the last layer; its key copy is momentum-updated from the other modality's query fcl
(cmacc/model.py), which needs equal fcl shapes in both modalities.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.models.video import r2plus1d_18, r3d_18
from torchvision.models.video.resnet import BasicBlock as BasicBlock3d
from torchvision.models.video.resnet import Conv2Plus1D, Conv3DSimple

VIDEO_ARCHS = ("r3d_18", "r2plus1d_18")


# ----------------------------------------------------------------------------------------------
# Video backbones
# ----------------------------------------------------------------------------------------------
def _video_stem(arch: str, width: int) -> nn.Sequential:
    if arch == "r3d_18":
        return nn.Sequential(
            nn.Conv3d(3, width, (3, 7, 7), stride=(1, 2, 2), padding=(1, 3, 3), bias=False),
            nn.BatchNorm3d(width),
            nn.ReLU(inplace=True),
        )
    mid = max(1, (45 * width) // 64)  # torchvision's 45 mid-channels at width 64
    return nn.Sequential(
        nn.Conv3d(3, mid, (1, 7, 7), stride=(1, 2, 2), padding=(0, 3, 3), bias=False),
        nn.BatchNorm3d(mid),
        nn.ReLU(inplace=True),
        nn.Conv3d(mid, width, (3, 1, 1), stride=1, padding=(1, 0, 0), bias=False),
        nn.BatchNorm3d(width),
        nn.ReLU(inplace=True),
    )


class _ScaledVideoResNet(nn.Module):
    """torchvision's VideoResNet with a configurable width and depth (for tiny CPU configs),
    built from torchvision's own blocks. Output: [B, 8 * width]."""

    def __init__(self, arch: str, width: int, layers: tuple[int, ...]):
        super().__init__()
        conv = Conv3DSimple if arch == "r3d_18" else Conv2Plus1D
        self.stem = _video_stem(arch, width)
        blocks, inplanes = [], width
        for i, n in enumerate(layers):
            planes = width * 2**i
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                down = None
                if stride != 1 or inplanes != planes:
                    down = nn.Sequential(
                        nn.Conv3d(inplanes, planes, 1, stride=conv.get_downsample_stride(stride),
                                  bias=False),
                        nn.BatchNorm3d(planes),
                    )
                blocks.append(BasicBlock3d(inplanes, planes, conv, stride, down))
                inplanes = planes
        self.blocks = nn.Sequential(*blocks)
        self.out_dim = inplanes

    def forward(self, x):  # [B, 3, T, H, W]
        x = self.blocks(self.stem(x))
        return F.adaptive_avg_pool3d(x, 1).flatten(1)  # [B, 8w]


def video_backbone(arch: str = "r3d_18", width: int = 64, layers=(2, 2, 2, 2)) -> nn.Module:
    """Video backbone with fc removed. The paper's r3d_18 / r2plus1d_18 come from torchvision
    (trained from scratch) at width 64 and layers (2, 2, 2, 2); other sizes are scaled copies."""
    if arch not in VIDEO_ARCHS:
        raise ValueError(f"video arch {arch!r} is not one of {VIDEO_ARCHS}")
    layers = tuple(layers)
    if width == 64 and layers == (2, 2, 2, 2):
        net = (r3d_18 if arch == "r3d_18" else r2plus1d_18)(weights=None)
        net.out_dim = net.fc.in_features
        net.fc = nn.Identity()
        return net
    return _ScaledVideoResNet(arch, width, layers)


# ----------------------------------------------------------------------------------------------
# Audio backbone: ResNet-18 with 1-D convolutions, mel bands as channels
# ----------------------------------------------------------------------------------------------
class BasicBlock1d(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv1d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm1d(planes)
        self.conv2 = nn.Conv1d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm1d(planes)
        self.down = None
        if stride != 1 or inplanes != planes:
            self.down = nn.Sequential(
                nn.Conv1d(inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm1d(planes)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class AudioResNet1d(nn.Module):
    """ResNet-18 over an 80-channel 1-D log-mel signal [B, n_mels, L]. Output: [B, 8 * width]."""

    def __init__(self, n_mels: int = 80, width: int = 64, layers=(2, 2, 2, 2)):
        super().__init__()
        self.n_mels = n_mels
        self.stem = nn.Sequential(
            nn.Conv1d(n_mels, width, 7, stride=1, padding=3, bias=False),
            nn.BatchNorm1d(width),
            nn.ReLU(inplace=True),
        )
        blocks, inplanes = [], width
        for i, n in enumerate(layers):
            planes = width * 2**i
            for j in range(n):
                blocks.append(BasicBlock1d(inplanes, planes, 2 if (i > 0 and j == 0) else 1))
                inplanes = planes
        self.blocks = nn.Sequential(*blocks)
        self.out_dim = inplanes

    def forward(self, x):  # [B, n_mels, L]
        if x.dim() != 3 or x.shape[1] != self.n_mels:
            raise ValueError(
                f"audio encoder expects a log-mel batch [B, {self.n_mels}, L]; got "
                f"{tuple(x.shape)}"
            )
        return F.adaptive_avg_pool1d(self.blocks(self.stem(x)), 1).flatten(1)  # [B, 8w]


# ----------------------------------------------------------------------------------------------
# Encoder = backbone + optional fcl + projection head
# ----------------------------------------------------------------------------------------------
class Encoder(nn.Module):
    """backbone → [fcl] → head → L2-normalise. ``forward`` returns (q [B, d], h [B, d_h])."""

    def __init__(self, backbone: nn.Module, dim: int = 128, fcl_dim: int | None = 512):
        super().__init__()
        self.backbone = backbone
        c = backbone.out_dim
        self.fcl = None
        if fcl_dim:
            self.fcl = nn.Linear(c, fcl_dim)
        self.feat_dim = fcl_dim or c
        self.head = nn.Linear(self.feat_dim, dim)  # the "last layer" W: q = W h

    def forward(self, x):
        h = self.backbone(x)  # [B, c]
        if self.fcl is not None:
            h = F.relu(self.fcl(h))  # [B, d_h]
        q = F.normalize(self.head(h).float(), dim=1)  # [B, d]
        return q, h


def key_copy(encoder: Encoder) -> Encoder:
    """A momentum (key) copy: same weights, no gradients."""
    k = copy.deepcopy(encoder)
    for p in k.parameters():
        p.requires_grad_(False)
    return k


@torch.no_grad()
def momentum_update(key: nn.Module, query: nn.Module, m: float) -> None:
    """θ_key ← m θ_key + (1 − m) θ_query, parameter by parameter (shapes must match)."""
    for pk, pq in zip(key.parameters(), query.parameters(), strict=True):
        pk.mul_(m).add_(pq.detach(), alpha=1.0 - m)
