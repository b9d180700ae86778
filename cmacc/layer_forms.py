"""The video encoders' layers in the forms the GPU kernels are fast at, with the parameters and
state dict of the layers they stand for (cmacc/encoders.py builds the backbones and calls
``fast_video_layers`` on each):

- ``StemConv3d``: the RGB stem as a folded 2-D convolution (or channel-padded) on CUDA;
- ``ChannelsLastBatchNorm3d``: BatchNorm3d on the 4-D channels-last view (``mode`` "flat", the
  default), or as kernels/triton_batchnorm.py (``mode`` "triton", with the residual add and
  ReLU after it fused by ``_FusingSequential`` / ``_FusedBasicBlock``), or as declared ("off");
- ``CMACC_FAST_LAYERS=0`` / ``CMACC_BATCH_NORM`` choose the forms for a process at import.

On the CPU, in TorchScript and with ``mode`` "off" each is the layer it declares.
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.models.video.resnet import BasicBlock as BasicBlock3d
from torchvision.models.video.resnet import BasicStem, R2Plus1dStem


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

    def triton_forward(self, x, residual=None, relu=False):
        """The batch's statistics by kernels/triton_batchnorm.py (``mode = "triton"``; on the
        CPU under TRITON_INTERPRET=1 in the tests), then ``+= residual`` and an in-place ReLU
        when asked, all in ONE pass: in training, for a dense channels_last_3d fp32 / bf16 /
        fp16 input (and a residual of its layout); otherwise (eval with running statistics,
        other inputs) ``flat_forward`` and those ops one by one. The same running-statistics
        rules."""
        nn.BatchNorm3d._check_input_dim(self, x)
        from kernels import triton_batchnorm as tbn

        if not (self._uses_batch_stats() and tbn.supports(x)):
            return _add_relu(self.flat_forward(x), residual, relu)
        _, running, factor = self._batch_args(x)
        fused = residual is None or tbn.fits(residual, x)  # else added after, as the ops
        y = tbn.batch_norm_train(x, self.weight, self.bias, *running, factor, self.eps,
                                 residual=residual if fused else None, relu=relu and fused)
        return y if fused else _add_relu(y, residual, relu)

    def fused_forward(self, x, residual=None, relu=False):
        """``self(x)``, then ``+= residual`` and an in-place ReLU when asked (what torchvision's
        blocks do after a batch norm): ``triton_forward`` where ``mode`` is "triton" and the
        kernels run, otherwise those three ops."""
        if self.mode == "triton" and _triton_device(x):
            return self.triton_forward(x, residual, relu)
        return _add_relu(self(x), residual, relu)

    def _uses_batch_stats(self) -> bool:  # _BatchNorm.forward's rule
        return self.training or (self.running_mean is None and self.running_var is None)

    def _batch_args(self, x):
        """_BatchNorm.forward's arguments, its count stepped: (normalise by the batch's
        statistics, (running mean, running var) or Nones when not updated or used, the
        momentum factor). Refuses a batch of one value per channel in training, as
        F.batch_norm."""
        factor = 0.0 if self.momentum is None else self.momentum
        use_batch = self._uses_batch_stats()
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


def _add_relu(y, residual, relu):
    """torchvision's ops after a batch norm, each when asked: ``y += residual``, in-place ReLU."""
    if residual is not None:
        y += residual
    return torch.relu_(y) if relu else y


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
