"""Encoders: video 3-D ResNet-18 (r3d_18 / r2plus1d_18), audio 1-D ResNet-18 over the 80-band
log-mel, the optional cross-modal FC layer ("fcl") and the projection head (the "last layer").

    x ─ backbone ─► f [B, c] ─ fcl: Linear(c, d_h) + ReLU (optional) ─► h [B, d_h]
                                   ─ head: Linear(d_h, d) ─► L2-normalise ─► q [B, d]

``h`` is the pre-head feature H of docs/DESIGN.md §1 step 3 (the head is the last layer, as in
the `head` gradient view). Without fcl, h = f and d_h = c. The fcl sits below the head so that the
head stays the last layer; its key copy is momentum-updated from the other modality's query fcl
(cmacc/model.py), which needs equal fcl shapes in both modalities.

Out of a run (``python -m cmacc.apps.export``): ``export_video`` gives a backbone's weights
under torchvision's VideoResNet names (``torchvision.models.video.r3d_18()`` loads them once
its ``fc`` is replaced, when the backbone has torchvision's size); ``load_video_encoder`` and
``load_audio_encoder`` rebuild a backbone of any size from such a file alone (its shapes say
the architecture, width and depth).
"""

from __future__ import annotations

import copy
import re

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.models.video import r2plus1d_18, r3d_18
from torchvision.models.video.resnet import BasicBlock as BasicBlock3d
from torchvision.models.video.resnet import Conv2Plus1D, Conv3DSimple

from cmacc.layer_forms import (  # noqa: F401  (re-exported: the layer forms' public names)
    BATCH_NORM_ENV, BATCH_NORMS, FAST_LAYERS_ENV, ChannelsLastBatchNorm3d, StemConv3d,
    declared_stem, fast_video_layers, fold_frames, fold_weight, fold_width)

VIDEO_ARCHS = ("r3d_18", "r2plus1d_18")


# ----------------------------------------------------------------------------------------------
# Video backbones (their layers' fast forms: cmacc/layer_forms.py)
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
        self.layers = tuple(layers)
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
    if is_torchvision_size(width, layers):
        net = (r3d_18 if arch == "r3d_18" else r2plus1d_18)(weights=None)
        net.out_dim = net.fc.in_features
        net.fc = nn.Identity()
        return fast_video_layers(net)
    return fast_video_layers(_ScaledVideoResNet(arch, width, layers))


def backbone_features(width: int, layers) -> int:
    """c, the feature width of a video or audio backbone: ``width`` doubled at each stage after
    the first (torchvision's r3d_18 / r2plus1d_18: 64 * 2**3 = 512). The config checks the fcl
    shapes with it before any network is built."""
    return width * 2 ** (len(tuple(layers)) - 1)


def is_torchvision_size(width: int, layers) -> bool:
    """Whether a video backbone of this size is torchvision's own r3d_18 / r2plus1d_18."""
    return width == 64 and tuple(layers) == (2, 2, 2, 2)


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
def momentum_pairs(key: nn.Module, query: nn.Module) -> tuple[list, list]:
    """(key parameters, query parameters) of two modules of the same shapes, in order."""
    pairs = list(zip(key.parameters(), query.parameters(), strict=True))
    return [pk.detach() for pk, _ in pairs], [pq.detach() for _, pq in pairs]


@torch.no_grad()
def momentum_update(key: nn.Module | tuple[list, list], query: nn.Module | None = None,
                    m: float = 0.999) -> None:
    """θ_key ← m θ_key + (1 − m) θ_query for every parameter (shapes must match), as two
    multi-tensor ops over all of them (a few launches instead of two per parameter; the same
    arithmetic, so the same bits). ``key`` may be ``momentum_pairs``' lists (several modules in
    one update)."""
    keys, queries = key if query is None else momentum_pairs(key, query)
    if keys:
        torch._foreach_mul_(keys, m)
        torch._foreach_add_(keys, queries, alpha=1.0 - m)


# ----------------------------------------------------------------------------------------------
# Stand-alone weights: export and load
# ----------------------------------------------------------------------------------------------
class EncoderFileError(ValueError):
    """A file that is not an exported encoder state dict; the message says why and what to do."""


def _block_names(layers) -> dict[str, str]:
    """Our flat ``blocks.b.`` → torchvision's ``layer{stage}.{block}.`` for a scaled backbone."""
    stages = [(i, j) for i, n in enumerate(layers) for j in range(n)]
    return {f"blocks.{b}.": f"layer{i + 1}.{j}." for b, (i, j) in enumerate(stages)}


def _renamed(sd: dict, prefixes: dict[str, str]) -> dict:
    """``sd`` with each key's leading prefix (a key of ``prefixes``) replaced by its value."""
    def name(k):
        return next((new + k[len(old):] for old, new in prefixes.items() if k.startswith(old)), k)
    return {name(k): v for k, v in sd.items()}


def export_video(backbone: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of a video backbone as a plain state dict under torchvision's VideoResNet
    names (``stem.*``, ``layer1.0.*`` ...), without ``fc``: torchvision's own model of the same
    architecture loads it with ``strict=True`` once ``model.fc = torch.nn.Identity()``."""
    sd = {k: v.detach().clone() for k, v in backbone.state_dict().items()}
    if isinstance(backbone, _ScaledVideoResNet):
        sd = _renamed(sd, _block_names(backbone.layers))
    return sd  # torchvision's model itself has an Identity fc: no weights to leave out


def _read_state(path, what: str) -> dict[str, torch.Tensor]:
    try:
        if str(path).endswith(".safetensors"):  # cmacc-export --format safetensors
            from safetensors.torch import load_file

            sd = load_file(path)
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise EncoderFileError(f"{path}: no such file; write it with `python -m cmacc.apps.export "
                               "RUN --out DIR`") from None
    except Exception as e:  # noqa: BLE001 - foreign bytes: the weights-only unpickler's errors vary
        raise EncoderFileError(f"{path}: not a torch state dict ({type(e).__name__}); pass the "
                               f"{what} written by `python -m cmacc.apps.export`") from None
    if not isinstance(sd, dict) or not sd or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise EncoderFileError(f"{path}: not a state dict of tensors; pass the {what} written by "
                               "`python -m cmacc.apps.export`")
    return sd


def _layers(sd: dict, prefix: str) -> tuple[int, ...]:
    """Blocks per stage from the keys ``{prefix}{stage}.{block}.``."""
    counts: dict[int, set] = {}
    for k in sd:
        m = re.match(rf"{prefix}(\d+)\.(\d+)\.", k)
        if m:
            counts.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    return tuple(len(counts[i]) for i in sorted(counts))


def _audio_layers(sd: dict) -> tuple[int, ...]:
    """Blocks per stage of the flat ``blocks.k``: a stage is a run of equal output widths."""
    widths = []
    for k in range(len(sd)):
        w = sd.get(f"blocks.{k}.conv1.weight")
        if w is None:
            break
        widths.append(int(w.shape[0]))
    stages = []
    for i, w in enumerate(widths):
        if i and w == widths[i - 1]:
            stages[-1] += 1
        else:
            stages.append(1)
    return tuple(stages)


def _load_strict(net: nn.Module, sd: dict, path, what: str) -> nn.Module:
    try:
        net.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise EncoderFileError(f"{path}: does not fit a {what} ({str(e).splitlines()[0][:160]}); "
                               "pass a file written by `python -m cmacc.apps.export`") from None
    return net.eval()


def load_video_encoder(path) -> nn.Module:
    """The video backbone of an exported ``video_<arch>.pt``, in eval mode: x [B, 3, T, H, W]
    → features [B, 8 * width] (or [B, num_classes] when the file has an ``fc``). Architecture,
    width and depth come from the weights' shapes; torchvision's own model at its size."""
    sd = _read_state(path, "video_<arch>.pt")
    arch = "r2plus1d_18" if "stem.3.weight" in sd else "r3d_18"
    stem_out = sd.get("stem.3.weight" if arch == "r2plus1d_18" else "stem.0.weight")
    layers = _layers(sd, "layer")
    if stem_out is None or not layers:
        raise EncoderFileError(f"{path}: no stem / layer weights of a video ResNet; pass the "
                               "video_<arch>.pt written by `python -m cmacc.apps.export`")
    width = int(stem_out.shape[0])
    net = video_backbone(arch, width, layers)
    if isinstance(net, _ScaledVideoResNet):
        sd = _renamed(sd, {v: k for k, v in _block_names(layers).items()})
    if "fc.weight" in sd and not isinstance(net, _ScaledVideoResNet):  # a classifier included
        net.fc = nn.Linear(sd["fc.weight"].shape[1], sd["fc.weight"].shape[0])
    return _load_strict(net, sd, path, f"{arch} video backbone (width {width}, layers {layers})")


def load_audio_encoder(path) -> AudioResNet1d:
    """The audio backbone of an exported ``audio_resnet1d.pt``, in eval mode: log-mel
    [B, n_mels, L] → features [B, 8 * width]. Mel bands, width and depth come from the shapes."""
    sd = _read_state(path, "audio_resnet1d.pt")
    stem = sd.get("stem.0.weight")
    layers = _audio_layers(sd)
    if stem is None or stem.dim() != 3 or not layers:
        raise EncoderFileError(f"{path}: not the weights of the 1-D audio ResNet; pass the "
                               "audio_resnet1d.pt written by `python -m cmacc.apps.export`")
    net = AudioResNet1d(n_mels=int(stem.shape[1]), width=int(stem.shape[0]), layers=layers)
    return _load_strict(net, sd, path, "1-D audio ResNet")
