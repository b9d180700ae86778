"""cmacc.amp: bf16 CPU Conv3d gradients under ``precision`` match float64 for the shapes the
presets produce (including temporal depth < kernel depth, where oneDNN's bf16 weight-gradient
kernel is broken on AVX-512 BF16 CPUs), and the context leaves no global state behind."""

import logging

import pytest
import torch
import torch.nn.functional as F

from cmacc import amp
from cmacc.amp import autocast_dtype, precision

CPU = torch.device("cpu")
TOL = 2e-2  # relative Frobenius error; bf16 rounding of inputs and outputs gives ~3e-3

K333 = dict(kernel_size=3, padding=1)
K311 = dict(kernel_size=(3, 1, 1), padding=(1, 0, 0))  # (2+1)D temporal conv


def _poison_freed_memory():
    junk = [torch.full((2**k,), float("nan")) for k in range(8, 20) for _ in range(2)]
    del junk


def _global_state():
    return (torch.backends.mkldnn.enabled, torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"), torch._C._len_torch_function_stack())


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm())


CASES = [(t, k, 1, 4, True) for t in (1, 2, 4, 8) for k in ("333", "311")] + [
    (4, "333", 2, 4, True), (2, "333", 2, 4, True), (3, "333", (1, 2, 2), 2, True),  # downsampling
    (2, "333", 1, 4, False), (2, "311", 1, 4, False),  # backward after leaving the context
]


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last_3d],
                         ids=["contiguous", "channels_last_3d"])
@pytest.mark.parametrize("t,kernel,stride,hw,backward_inside", CASES)
def test_bf16_conv3d_gradients_match_float64(t, kernel, stride, hw, backward_inside,
                                              memory_format):
    g = torch.Generator().manual_seed(t)
    conv = torch.nn.Conv3d(32, 32, stride=stride, bias=False, **(K333 if kernel == "333" else K311))
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) / 20)
    x = torch.randn(4, 32, t, hw, hw, generator=g)
    w64 = conv.weight.detach().double().requires_grad_()
    x64 = x.double().requires_grad_()
    y64 = F.conv3d(x64, w64, stride=conv.stride, padding=conv.padding)
    gy = torch.randn(y64.shape, generator=g)
    y64.backward(gy.double())

    conv.to(memory_format=memory_format)
    x = x.contiguous(memory_format=memory_format).requires_grad_()
    gy = gy.contiguous(memory_format=memory_format)
    before = _global_state()
    _poison_freed_memory()  # an unwritten gradient would read NaN, not a lucky 0
    with precision(CPU, "bf16"):
        y = conv(x)
        if backward_inside:
            y.backward(gy.to(y.dtype))
    if not backward_inside:
        y.backward(gy.to(y.dtype))
    assert _global_state() == before

    gw, gx = conv.weight.grad, x.grad
    assert torch.isfinite(gw).all() and torch.isfinite(gx).all()
    assert _rel(gw, w64.grad) <= TOL
    assert _rel(gx, x64.grad) <= TOL
    scale = w64.grad.norm() / w64.shape[2] ** 0.5  # every temporal tap, also all-padding ones
    for kd in range(w64.shape[2]):
        assert float((gw[:, :, kd].double() - w64.grad[:, :, kd]).norm() / scale) <= TOL, kd


def test_self_check_is_cached_and_explains():
    ok, detail = amp.cpu_bf16_conv3d_check()
    assert isinstance(ok, bool) and "kd=0,1,2" in detail
    assert amp.cpu_bf16_conv3d_check() == (ok, detail)
    assert amp.cpu_bf16_conv3d_ok() is ok
    print(f"cpu_bf16_conv3d_check: ok={ok}: {detail}")


def test_route_around_runs_conv3d_in_fp32_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(amp, "cpu_bf16_conv3d_check", lambda: (False, "forced"))
    monkeypatch.setattr(amp, "_warned", False)
    conv, lin = torch.nn.Conv3d(4, 4, 3, padding=1), torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, 2, 3, 3)
    with caplog.at_level(logging.WARNING, logger="cmacc"):
        for _ in range(2):
            with precision("cpu", "bf16"):
                assert conv(x).dtype == torch.float32  # rerouted
                assert lin(x.movedim(1, -1)).dtype == torch.bfloat16  # the rest stays bf16
    assert sum("forced" in r.getMessage() for r in caplog.records) == 1


def test_context_restores_state_on_exception():
    before = _global_state()
    with pytest.raises(RuntimeError, match="boom"):
        with precision(CPU, "bf16"):
            assert torch.is_autocast_enabled("cpu")
            raise RuntimeError("boom")
    assert _global_state() == before


def test_none_and_fp16():
    before = _global_state()
    with precision(CPU, "none"):
        assert _global_state() == before
    with precision(CPU, "fp16"):
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.float16
    assert _global_state() == before


def test_autocast_dtype():
    assert autocast_dtype("none") is None
    assert autocast_dtype("bf16") is torch.bfloat16
    assert autocast_dtype("fp16") is torch.float16
    with pytest.raises(ValueError, match="'none', 'bf16', 'fp16'"):
        autocast_dtype("fp8")
    with pytest.raises(ValueError):
        with precision(CPU, "bfloat16"):
            pass
