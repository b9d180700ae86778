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

import contextlib
import copy
import os
import re

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.models.video import r2plus1d_18, r3d_18
from torchvision.models.video.resnet import BasicBlock as BasicBlock3d
from torchvision.models.video.resnet import BasicStem, Conv2Plus1D, Conv3DSimple, R2Plus1dStem

VIDEO_ARCHS = ("r3d_18", "r2plus1d_18")


# ----------------------------------------------------------------------------------------------
# Video backbones
# ----------------------------------------------------------------------------------------------
class StemConv3d(nn.Conv3d):
    """The video stem's Conv3d (RGB in), run on CUDA in the form cuDNN is fast at:

    - ``mode = "fold"`` (kernel depth kT > 1, temporal stride 1: r3d_18's 3x7x7 stem): each
      output frame is a 2-D convolution over the kT input frames it sees, their kT x 3 values
      folded into the input channels and zero-padded to ``fold_width(kT x 3)`` (9 -> 16), in
      channels-last storage; the weight [O, 3, kT, kH, kW] becomes [O, kT x 3 (+ zeros), kH, kW].
      Frames outside the clip are zeros, as the temporal padding's.
    - ``mode = "pad"`` (and for stems with kT = 1, r2plus1d_18's): the 3 input channels
      zero-padded to ``pad_to``, still a 3-D convolution.

    Both compute the same convolution (zeros add exact zeros; only the summation order
    differs), and return channels_last_3d storage whatever the input's layout. On an H200, bf16,
    batch 128 x 16 x 112 x 112 (bench/RESULTS.md, 2026-11-28), alone: forward 25.5 ms as
    nn.Conv3d with 3 channels-last channels (about 10 ms inside a training step, where cuDNN
    padded the input itself), 9.4 ms padded to 8, 3.1 ms folded (plus 1.7 ms for a first fold
    the bench made its own way; ``fold_frames`` is timed by the convs part since);
    weight gradient 6.1 / 5.7 / 3.2 ms. The folded input saved for the backward is 16/3 the
    size of the bf16 clip (+0.6 GiB at batch 128). Parameters and state dict are nn.Conv3d's;
    on the CPU, with ``mode = "off"`` and in TorchScript it is nn.Conv3d
    (``__prepare_scriptable__``: ``torch.jit.script`` also puts the plain layer, on the same
    parameters, in the module it scripts). ``mode`` is a class attribute: every instance in the
    process follows it."""

    mode = "fold"  # "fold", "pad" or "off" (bench/gpu_session.py's convs part times each)
    pad_to = 8

    def forward(self, x):
        if (not x.is_cuda or self.mode == "off" or self.groups != 1 or x.dim() != 5
                or self.padding_mode != "zeros" or isinstance(self.padding, str)):
            return super().forward(x)
        if self.mode == "fold" and self.foldable():
            return self.folded_forward(x)
        if self.in_channels % self.pad_to:
            return self.padded_forward(x)
        return super().forward(x)

    def foldable(self) -> bool:
        return (self.kernel_size[0] > 1 and self.stride[0] == 1 and self.dilation[0] == 1
                and self.groups == 1 and self.padding_mode == "zeros"
                and not isinstance(self.padding, str))

    def __prepare_scriptable__(self):
        # torch.jit.script: the plain nn.Conv3d on the same parameters (class-level modes and
        # Python branching do not script)
        plain = copy.copy(self)
        plain.__class__ = nn.Conv3d
        return plain

    @staticmethod
    def _dtype(x):
        # cast once here, not again by autocast on the wider copy
        return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype

    def folded_forward(self, x):
        """The folded 2-D convolution on any device (the tests run it on the CPU); a conv
        that ``foldable`` refuses is refused here too."""
        if not self.foldable() or x.dim() != 5:
            raise ValueError(f"StemConv3d: cannot fold kernel {self.kernel_size}, stride "
                             f"{self.stride}, dilation {self.dilation}, groups {self.groups}, "
                             f"padding {self.padding!r} over a {x.dim()}-D input; "
                             "use forward()")
        b = x.shape[0]
        width = fold_width(self.kernel_size[0] * x.shape[1])
        frames = fold_frames(x, self.kernel_size[0], self.padding[0], width, self._dtype(x))
        y = F.conv2d(frames, fold_weight(self.weight, width), self.bias, self.stride[1:],
                     self.padding[1:], self.dilation[1:])
        # [B T, O, Ho, Wo] (NHWC storage) -> [B, O, T, Ho, Wo] (channels_last_3d storage)
        y = y.permute(0, 2, 3, 1).reshape(b, y.shape[0] // b, *y.shape[2:], y.shape[1])
        return y.permute(0, 4, 1, 2, 3)

    def padded_forward(self, x):
        """The channel-padded 3-D convolution on any device (the tests run it on the CPU)."""
        if self.groups != 1 or x.dim() != 5:
            raise ValueError(f"StemConv3d: cannot pad the channels of groups={self.groups} "
                             f"over a {x.dim()}-D input; use forward()")
        c = self.in_channels
        p = -c % self.pad_to
        b, _, t, h, w = x.shape
        wide = x.new_zeros((b, t, h, w, c + p), dtype=self._dtype(x))  # channels-last storage
        wide[..., :c] = x.permute(0, 2, 3, 4, 1)
        weight = F.pad(self.weight, (0, 0, 0, 0, 0, 0, 0, p)).contiguous(
            memory_format=torch.channels_last_3d)
        return self._conv_forward(wide.permute(0, 4, 1, 2, 3), weight, self.bias)


@contextlib.contextmanager
def declared_stem():
    """Within: every StemConv3d runs as the nn.Conv3d it declares (FLOP counts of the model,
    not of its padded or folded stem). It sets the class attribute: not for use while another
    thread runs a video encoder."""
    mode = StemConv3d.mode
    StemConv3d.mode = "off"
    try:
        yield
    finally:
        StemConv3d.mode = mode


def fold_frames(x, kt: int, pt: int, width: int, dtype) -> torch.Tensor:
    """The folded stem's input: for a clip x [B, C, T, H, W] and a temporal kernel of depth
    ``kt`` with padding ``pt`` (stride 1), the frames [B T_out, width, H, W] (NHWC storage,
    ``dtype``) whose channel j C + c is colour c of input frame s + j - pt (zeros outside the
    clip and past kt C)."""
    b, c, t, h, w = x.shape
    t_out = t + 2 * pt - kt + 1
    folded = x.new_zeros((b, t_out, h, w, width), dtype=dtype)  # NHWC frames
    for j in range(kt):  # tap j of output frame s reads input frame s + j - pt
        lo, hi = max(0, pt - j), min(t_out, t + pt - j)
        if lo < hi:
            folded[:, lo:hi, :, :, j * c:(j + 1) * c] = \
                x[:, :, lo + j - pt:hi + j - pt].permute(0, 2, 3, 4, 1)
    return folded.view(b * t_out, h, w, width).permute(0, 3, 1, 2)


def fold_weight(weight: torch.Tensor, width: int) -> torch.Tensor:
    """The folded stem's weight: [O, C, kT, kH, kW] -> [O, width, kH, kW] (channel j C + c =
    colour c of tap j, zeros past kT C), channels-last."""
    o, c, kt = weight.shape[:3]
    folded = weight.permute(0, 2, 1, 3, 4).reshape(o, kt * c, *weight.shape[3:])
    return F.pad(folded, (0, 0, 0, 0, 0, width - kt * c)).contiguous(
        memory_format=torch.channels_last)


def fold_width(channels: int) -> int:
    """Input channels of the folded stem: ``channels`` rounded up to a multiple of 8, at least
    16 (9 -> 16: measured faster than 12 on an H200)."""
    return max(16, -(-channels // 8) * 8)


class _FlatBatchNorm(torch.autograd.Function):
    """Batch norm of a dense channels_last_3d input [B, C, T, H, W] as its 4-D channels-last
    view [B, C, T H, W], into a 5-D output of its own. The output must not be a view: the
    blocks that follow modify it in place (ReLU(inplace=True), ``out += identity``), and an
    in-place change of a view makes autograd's backward copy the whole gradient through a
    contiguous (NCDHW) clone at every such layer, which then sends the batch norm's backward
    the general way (measured on an H200: 39 whole-activation copies, 34 ms a paper-preset
    step; bench/RESULTS.md). So the forward writes into a fresh channels_last_3d tensor through
    ``native_batch_norm.out`` and the backward is ``native_batch_norm_backward`` on the views."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps):
        b, c, t, h, w = x.shape
        y = torch.empty_like(x, memory_format=torch.channels_last_3d)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32  # the statistics'
        mean = torch.empty(0, dtype=acc, device=x.device)
        invstd = torch.empty(0, dtype=acc, device=x.device)
        x4 = x.view(b, c, t * h, w)
        torch.ops.aten.native_batch_norm.out(
            x4, weight, bias, running_mean, running_var, training, momentum, eps,
            out=y.view(b, c, t * h, w), save_mean=mean, save_invstd=invstd)
        # in training the backward reads the batch's statistics only, not the running ones
        kept = (None, None) if training else (running_mean, running_var)
        ctx.save_for_backward(x, weight, *kept, mean, invstd)
        ctx.training, ctx.eps = training, eps
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x, weight, running_mean, running_var, mean, invstd = ctx.saved_tensors
        b, c, t, h, w = x.shape
        gy = gy.contiguous(memory_format=torch.channels_last_3d)  # a no-op when it already is
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
            gy.view(b, c, t * h, w), x.view(b, c, t * h, w), weight, running_mean, running_var,
            mean, invstd, ctx.training, ctx.eps, list(ctx.needs_input_grad[:3]))
        gx = gx.view(b, c, t, h, w) if gx is not None else None
        return gx, gw, gb, None, None, None, None, None


class ChannelsLastBatchNorm3d(nn.BatchNorm3d):
    """BatchNorm3d that, on CUDA, normalises a channels_last_3d input [B, C, T, H, W] as the
    4-D channels-last view [B, C, T H, W] of the same memory (no copy in). The statistics are
    per channel over the same B T H W values, so it is the same normalisation (running
    statistics and their count included). Why: PyTorch's CUDA batch norm takes its
    channels-last kernels for 4-D channels-last inputs only; a 5-D channels-last bf16 input goes
    the general way, which first copies the whole input to fp32 for the statistics (in a
    paper-preset step on an H200, bench/RESULTS.md, 2026-11-28, those copies, the fp32
    statistics and the general elementwise kernel took about 48 ms of 189). The output is a
    tensor of its own, not a view (``_FlatBatchNorm``). Parameters and state dict are
    BatchNorm3d's; on the CPU, with ``mode = "off"`` and in TorchScript it is BatchNorm3d."""

    # "flat", "triton" (kernels/triton_batchnorm.py: the batch's statistics in training; not
    # yet timed on a GPU, so not the default) or "off" (bench/gpu_session.py times each)
    mode = "flat"

    def forward(self, x):
        if self.mode == "triton" and _triton_device(x):
            return self.triton_forward(x)
        if self.mode != "off" and x.is_cuda:
            return self.flat_forward(x)
        nn.BatchNorm3d._check_input_dim(self, x)  # 5-D, as BatchNorm3d (this class's own
        return super().forward(x)                 # check lets the 4-D view through)

    def flat_forward(self, x):
        """The 4-D channels-last view's batch norm (the tests run it on the CPU, with fp32 or
        fp64 parameters; once differentiable: no double backward); inputs of another layout
        go through BatchNorm3d. Refuses other than 5-D input, as BatchNorm3d. The running
        statistics' rules are _BatchNorm.forward's: the count steps in training, momentum None
        is the cumulative average, the batch's statistics normalise in training or where no
        running statistics are kept."""
        nn.BatchNorm3d._check_input_dim(self, x)
        if x.is_contiguous() or not x.is_contiguous(memory_format=torch.channels_last_3d):
            return super().forward(x)
        use_batch, running, factor = self._batch_args(x)
        return _FlatBatchNorm.apply(x, self.weight, self.bias, *running, use_batch, factor,
                                    self.eps)

    def triton_forward(self, x):
        """The batch's statistics by kernels/triton_batchnorm.py (``mode = "triton"``; on the
        CPU under TRITON_INTERPRET=1 in the tests): in training, for a dense channels_last_3d
        fp32 / bf16 / fp16 input; otherwise (eval with running statistics, other inputs) as
        ``flat_forward``. The same running-statistics rules."""
        nn.BatchNorm3d._check_input_dim(self, x)
        from kernels import triton_batchnorm as tbn

        if not (self.training or (self.running_mean is None and self.running_var is None)) \
                or not tbn.supports(x):
            return self.flat_forward(x)
        _, running, factor = self._batch_args(x)
        return tbn.batch_norm_train(x, self.weight, self.bias, *running, factor, self.eps)

    def fused_forward(self, x, residual=None, relu=False):
        """``self(x)``, then ``+= residual`` and an in-place ReLU when asked (what torchvision's
        blocks do after a batch norm), as ONE Triton pass over the activation where ``mode``
        is "triton", the batch's statistics normalise and the kernels take x and the residual
        (kernels/triton_batchnorm.py); otherwise as those three ops."""
        if self.mode == "triton" and _triton_device(x):
            from kernels import triton_batchnorm as tbn

            use_batch = self.training or (self.running_mean is None and self.running_var is None)
            if use_batch and tbn.supports(x) and (residual is None or tbn.fits(residual, x)):
                nn.BatchNorm3d._check_input_dim(self, x)
                _, running, factor = self._batch_args(x)
                return tbn.batch_norm_train(x, self.weight, self.bias, *running, factor,
                                            self.eps, residual=residual, relu=relu)
        y = self(x)
        if residual is not None:
            y += residual
        return torch.relu_(y) if relu else y

    def _batch_args(self, x):
        """_BatchNorm.forward's arguments, its count stepped: (normalise by the batch's
        statistics, (running mean, running var) or Nones when not updated or used, the
        momentum factor). Refuses a batch of one value per channel in training, as
        F.batch_norm."""
        factor = 0.0 if self.momentum is None else self.momentum
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        if use_batch and x.numel() // x.shape[1] < 2:
            raise ValueError(f"Expected more than 1 value per channel when training, got input "
                             f"size {list(x.shape)}")
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        keep = not self.training or self.track_running_stats
        running = (self.running_mean, self.running_var) if keep else (None, None)
        return use_batch, running, factor

    def _check_input_dim(self, input):
        # _BatchNorm.forward's check: the 5-D input (checked as such by forward or
        # flat_forward before it gets here), or flat_forward's 4-D view of it
        if input.dim() not in (4, 5):
            raise ValueError(f"expected 5D input (got {input.dim()}D input)")

    def __prepare_scriptable__(self):
        plain = copy.copy(self)  # torch.jit.script: the plain BatchNorm3d on the same state
        plain.__class__ = nn.BatchNorm3d
        return plain


def _triton_device(x) -> bool:
    """Where ``mode = "triton"`` runs the Triton kernels: CUDA tensors, and CPU tensors when the
    kernels run under the interpreter (TRITON_INTERPRET=1: the tests)."""
    if x.is_cuda:
        return True
    if x.device.type != "cpu" or os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    from kernels import triton_batchnorm as tbn

    return tbn.INTERPRETED


class _FusingSequential(nn.Sequential):
    """nn.Sequential that, in ``ChannelsLastBatchNorm3d.mode`` "triton", runs each batch norm
    followed by a ReLU as one fused pass (``fused_forward``): the stem and a block's first
    convolution (conv, BN, ReLU; r(2+1)d's factored convolution inside it, a Conv2Plus1D, is
    not fused). In other modes and in TorchScript it is nn.Sequential; where the kernels do not
    run, ``fused_forward`` runs the same ops one by one. A fused batch norm and its ReLU are
    not called as modules: their forward hooks do not run in this mode."""

    def forward(self, x):
        if ChannelsLastBatchNorm3d.mode != "triton":
            return super().forward(x)
        mods = list(self)
        i = 0
        while i < len(mods):
            if (type(mods[i]) is ChannelsLastBatchNorm3d and i + 1 < len(mods)
                    and type(mods[i + 1]) is nn.ReLU):
                x = mods[i].fused_forward(x, relu=True)
                i += 2
            else:
                x = mods[i](x)
                i += 1
        return x

    def __prepare_scriptable__(self):
        plain = copy.copy(self)
        plain.__class__ = nn.Sequential
        return plain


class _FusedBasicBlock(BasicBlock3d):
    """torchvision's BasicBlock whose last batch norm, residual add and ReLU run as one fused
    pass in ``ChannelsLastBatchNorm3d.mode`` "triton" (``fused_forward``: the same ops one by
    one where the kernels do not run); in other modes and in TorchScript, BasicBlock's forward.
    Same parameters and state dict."""

    def forward(self, x):
        bn = self.conv2[-1]
        if ChannelsLastBatchNorm3d.mode != "triton" or type(bn) is not ChannelsLastBatchNorm3d:
            return super().forward(x)
        out = self.conv1(x)
        for mod in list(self.conv2)[:-1]:
            out = mod(out)
        residual = x if self.downsample is None else self.downsample(x)
        return bn.fused_forward(out, residual=residual, relu=True)

    def __prepare_scriptable__(self):
        plain = copy.copy(self)
        plain.__class__ = BasicBlock3d
        return plain


FAST_LAYERS_ENV = "CMACC_FAST_LAYERS"  # "0": the declared layers on CUDA too (set at import)
if os.environ.get(FAST_LAYERS_ENV, "1") == "0":
    StemConv3d.mode = ChannelsLastBatchNorm3d.mode = "off"
BATCH_NORM_ENV = "CMACC_BATCH_NORM"  # the batch norm's form on CUDA (set at import; wins over
BATCH_NORMS = ("flat", "triton", "off")  # CMACC_FAST_LAYERS for the batch norm)
if os.environ.get(BATCH_NORM_ENV):
    if os.environ[BATCH_NORM_ENV] not in BATCH_NORMS:
        raise ValueError(f"{BATCH_NORM_ENV}={os.environ[BATCH_NORM_ENV]!r}: the video encoders' "
                         f"batch norm form is one of {', '.join(BATCH_NORMS)} (unset: flat)")
    ChannelsLastBatchNorm3d.mode = os.environ[BATCH_NORM_ENV]


def fast_video_layers(backbone: nn.Module) -> nn.Module:
    """``backbone`` with its stem's first Conv3d made a StemConv3d, every BatchNorm3d a
    ChannelsLastBatchNorm3d, every torchvision BasicBlock a _FusedBasicBlock and every plain
    nn.Sequential or torchvision stem (BasicStem, R2Plus1dStem: nn.Sequential with their own
    __init__ only) holding a batch norm then a ReLU a _FusingSequential (the same parameters
    and buffers, in place; the last two differ only in "triton" mode); returns it."""
    conv = backbone.stem[0]
    if type(conv) is nn.Conv3d:
        conv.__class__ = StemConv3d
    for mod in backbone.modules():
        if type(mod) is nn.BatchNorm3d:
            mod.__class__ = ChannelsLastBatchNorm3d
        elif type(mod) is BasicBlock3d:
            mod.__class__ = _FusedBasicBlock
        elif type(mod) in (nn.Sequential, BasicStem, R2Plus1dStem) and any(
                type(a) is nn.BatchNorm3d and type(b) is nn.ReLU
                for a, b in zip(list(mod), list(mod)[1:])):
            mod.__class__ = _FusingSequential
    return backbone


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
