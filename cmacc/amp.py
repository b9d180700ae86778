"""Mixed-precision policy of the trainer: autocast, plus a route around a broken CPU bf16 Conv3d.

On CPUs with AVX-512 BF16, oneDNN's bf16 Conv3d weight-gradient kernel (PyTorch 2.x) is wrong
for small inputs: with temporal depth 2 < kernel depth 3 and padding 1 the kd=0 tap has
relative error ~1.4 and the kd=1 tap is never written (it keeps freed memory: 0, 1e35, NaN);
small spatial inputs with stride 2 (any depth) give NaN and can even corrupt the heap. The
r3d_18 / r2plus1d_18 encoders hit this in their last stages (depth 16→8→4→2, 7x7; tiny preset
8→4→2→1, 2x2). fp32 and fp16 CPU convolutions and bf16 with oneDNN disabled are correct.

``precision(device, amp)`` enters ``torch.autocast`` for amp "bf16"/"fp16". On CPU with bf16,
if the start-up self-check ``cpu_bf16_conv3d_ok()`` fails, Conv3d (``F.conv3d``, which
``nn.Conv3d`` calls) runs in fp32 inside the context (a scoped ``TorchFunctionMode``); all
other ops keep bf16. Why not ``torch.backends.mkldnn.flags(enabled=False)``: it is correct,
but bf16 convolutions then fall back to a slow reference path, measured 20-200x slower (fwd+bwd
of r3d blocks on 2 busy cores: 15-30 ms -> 1.4-3 s) and it would also slow bf16 Linear/Conv1d;
fp32 Conv3d costs what an fp32 run costs (30-80 ms there). Shape-based rerouting was rejected:
the failing shapes are many and not documented. The fp32 conv is recorded in the autograd
graph, so the backward is right wherever it runs: the context may wrap the forward only
(PyTorch's advice) or forward and backward; it sets no process-wide flag, only the
thread-local autocast state and mode stack, which it restores on exit, also on exceptions.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger("cmacc")

AMP_CHOICES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_TOL = 2e-2  # per-tap error / tap-average norm; bf16 rounding gives ~3e-3, the bug ~1 or NaN
_warned = False


def autocast_dtype(name: str) -> torch.dtype | None:
    """The autocast dtype for an ``amp`` setting: none → None, bf16, fp16."""
    if name not in AMP_CHOICES:
        raise ValueError(f"amp {name!r} is not one of {tuple(AMP_CHOICES)}")
    return AMP_CHOICES[name]


def _poison_freed_memory() -> None:
    """Fill then free heap blocks with NaN, so that an unwritten output shows up as NaN."""
    junk = [torch.full((2**k,), float("nan")) for k in range(8, 20) for _ in range(2)]
    del junk


@functools.lru_cache(maxsize=None)
def _check(mkldnn_enabled: bool) -> tuple[bool, str]:
    gen = torch.Generator().manual_seed(0)
    errors = {}
    with torch.backends.mkldnn.flags(enabled=mkldnn_enabled, deterministic=None,
                                     allow_tf32=None, fp32_precision=None):
        for fmt in (torch.contiguous_format, torch.channels_last_3d):
            # depth 2 < kernel depth 3, padding 1: the failing regime (heap-safe, ~1 ms)
            x, gy = (torch.randn(4, 16, 2, 4, 4, generator=gen).bfloat16()
                     .contiguous(memory_format=fmt) for _ in range(2))
            w = (torch.randn(16, 16, 3, 3, 3, generator=gen) / 20).bfloat16()
            _poison_freed_memory()
            args = (None, [1] * 3, [1] * 3, [1] * 3, False, [0] * 3, 1, [False, True, False])
            gw = torch.ops.aten.convolution_backward(gy, x, w, *args)[1].double()
            ref = torch.ops.aten.convolution_backward(gy.double(), x.double(), w.double(),
                                                     *args)[1]
            scale = ref.norm() / ref.shape[2] ** 0.5
            errors[str(fmt).split(".")[-1]] = [
                float((gw[:, :, kd] - ref[:, :, kd]).norm() / scale) for kd in range(3)]
    ok = all(e <= _TOL for errs in errors.values() for e in errs)  # False on NaN
    taps = "; ".join(f"{f} " + ", ".join(f"{e:.3g}" for e in errs) for f, errs in errors.items())
    return ok, f"bf16 Conv3d weight-grad error by tap kd=0,1,2: {taps} (tolerance {_TOL})"


def cpu_bf16_conv3d_check() -> tuple[bool, str]:
    """(ok, detail): whether this CPU's bf16 Conv3d weight gradient is right, with the current
    oneDNN setting, for depth < kernel depth; cached per process (~ms the first time)."""
    return _check(torch.backends.mkldnn.enabled)


def cpu_bf16_conv3d_ok() -> bool:
    return cpu_bf16_conv3d_check()[0]


def _f32(a):
    return a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a


class _Conv3dInFloat32(TorchFunctionMode):
    """Runs CPU conv3d in fp32 while CPU autocast is on (the mode is off inside the handler)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else kwargs.get("input")
        if (func is torch.conv3d and isinstance(x, torch.Tensor) and x.device.type == "cpu"
                and torch.is_autocast_enabled("cpu")):
            with torch.autocast("cpu", enabled=False):
                return func(*map(_f32, args), **{k: _f32(v) for k, v in kwargs.items()})
        return func(*args, **kwargs)


@contextlib.contextmanager
def precision(device: torch.device | str, amp: str):
    """Autocast for ``amp`` on ``device``; on a CPU whose bf16 Conv3d is broken, Conv3d in fp32.

        with precision(device, tcfg.amp):
            loss, stats = step_fn(video, audio, index)
        scaler.scale(loss).backward()   # inside or outside the context: both are correct
    """
    dtype = autocast_dtype(amp)
    device = torch.device(device)
    if dtype is None:
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autocast(device.type, dtype=dtype))
        if device.type == "cpu" and dtype is torch.bfloat16:
            ok, detail = cpu_bf16_conv3d_check()
            if not ok:
                global _warned
                if not _warned:
                    _warned = True
                    log.warning("amp: broken oneDNN bf16 Conv3d backward on this CPU (%s); "
                                "running Conv3d in fp32 under bf16 autocast", detail)
                stack.enter_context(_Conv3dInFloat32())
        yield
