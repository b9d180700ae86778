"""kernels/triton_batchnorm.py under the interpreter (TRITON_INTERPRET=1, tests/conftest.py)
against nn.BatchNorm3d in float64 on the same values: the output, the input / weight / bias
gradients, the running statistics and their count, several channel counts (powers of two and
not), slabs of one and of several tiles, a last slab cut short; and as
cmacc.encoders.ChannelsLastBatchNorm3d's ``mode = "triton"``."""

import copy

import pytest
import torch
import torch.nn as nn

import kernels.triton_batchnorm as tbn
from cmacc.encoders import ChannelsLastBatchNorm3d
from devices import FakeCuda

CL3 = torch.channels_last_3d

pytestmark = pytest.mark.skipif(not tbn.INTERPRETED, reason="the kernels run on the CPU under "
                                "TRITON_INTERPRET=1 only (set by tests/conftest.py)")


def _reference(c, **kw):
    torch.manual_seed(c)
    ref = nn.BatchNorm3d(c, **kw).double()
    if ref.affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-0.5, 0.5)
    return ref


def _input(shape, scale=3.0, offset=2.0, dtype=torch.float32):
    # values exactly representable in ``dtype``, so float64 sees the kernel's own input
    x = (torch.randn(shape, dtype=torch.float64) * scale + offset).to(dtype)
    return x.contiguous(memory_format=CL3)


def _close(got, want, rel):
    err = (got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)
    assert err <= rel, f"relative error {err:.3g} > {rel:g}"


@pytest.mark.parametrize("shape", [(3, 6, 4, 5, 7), (2, 64, 3, 5, 5), (2, 100, 2, 3, 3),
                                   (3, 2, 1, 1, 1), (4, 16, 2, 4, 4)])
@pytest.mark.parametrize("slabs", [512, 2])  # slabs of one tile, and of many tiles
def test_training_batch_norm_equals_batchnorm3d(shape, slabs, monkeypatch):
    monkeypatch.setattr(tbn, "SLABS", slabs)
    c = shape[1]
    ref = _reference(c)
    x = _input(shape)
    x64 = x.double().requires_grad_()
    y64 = ref(x64)
    gy = torch.randn_like(y64)
    (y64 * gy).sum().backward()
    w = ref.weight.detach().float().clone().requires_grad_()
    b = ref.bias.detach().float().clone().requires_grad_()
    rm, rv = torch.zeros(c), torch.ones(c)
    xk = x.clone().requires_grad_()
    y = tbn.batch_norm_train(xk, w, b, rm, rv, 0.1, 1e-5)
    assert y.dtype == x.dtype and y.is_contiguous(memory_format=CL3) and y._base is None
    (y * gy.float()).sum().backward()
    _close(y, y64, 2e-6)
    _close(xk.grad, x64.grad, 2e-6)
    _close(w.grad, ref.weight.grad, 2e-6)
    _close(b.grad, ref.bias.grad, 2e-6)
    _close(rm, ref.running_mean, 2e-6)
    _close(rv, ref.running_var, 2e-6)


def test_a_large_mean_beside_a_small_spread_does_not_cancel(monkeypatch):
    # mean 300, spread 1: fp32 sums of squares minus the squared sum would lose the variance
    # (300^2 / 1 = 9e4 of cancellation on top of the summation's rounding)
    monkeypatch.setattr(tbn, "SLABS", 2)
    c = 8
    ref = _reference(c, momentum=1.0)
    x = _input((64, c, 2, 4, 4), scale=1.0, offset=300.0)
    y64 = ref(x.double())
    rm, rv = torch.zeros(c), torch.ones(c)
    y = tbn.batch_norm_train(x, ref.weight.detach().float(), ref.bias.detach().float(), rm, rv,
                             1.0, 1e-5)
    _close(rv, ref.running_var, 1e-4)  # momentum 1: the batch's unbiased variance itself
    _close(y, y64, 1e-4)


def test_bf16_in_and_out_within_bf16_rounding():
    c = 64
    ref = _reference(c)
    x = _input((2, c, 3, 4, 4), dtype=torch.bfloat16)
    y64 = ref(x.double())
    y = tbn.batch_norm_train(x, ref.weight.detach().float(), ref.bias.detach().float(),
                             torch.zeros(c), torch.ones(c), 0.1, 1e-5)
    assert y.dtype == torch.bfloat16
    _close(y, y64, 2 ** -7)  # one bf16 unit in the last place (the interpreter's cast to bf16
    # may truncate where the GPU rounds to nearest)


@pytest.mark.parametrize("kw", [{}, dict(momentum=None), dict(affine=False),
                                dict(track_running_stats=False)])
def test_the_module_in_triton_mode_is_batchnorm3d_over_steps(kw):
    # the layer as the encoders run it: three training steps (count, cumulative momentum,
    # no affine, no running statistics), then eval (which takes the flat path)
    ref = _reference(6, **kw)
    layer = copy.deepcopy(ref).float()
    layer.__class__ = ChannelsLastBatchNorm3d
    for step in range(3):
        x = _input((3, 6, 4, 5, 7), offset=step)
        x64 = x.double().requires_grad_()
        xk = x.clone().requires_grad_()
        y64, y = ref(x64), layer.triton_forward(xk)
        _close(y, y64, 2e-6)
        gy = torch.randn_like(y64)
        (y64 * gy).sum().backward()
        (y * gy.float()).sum().backward()
        _close(xk.grad, x64.grad, 2e-6)
    for name, p in ref.named_parameters():
        _close(dict(layer.named_parameters())[name].grad, p.grad, 2e-6)
    for name, buf in ref.named_buffers():
        _close(dict(layer.named_buffers())[name], buf, 2e-6)
    ref.eval()
    layer.eval()
    x = _input((3, 6, 4, 5, 7))
    _close(layer.triton_forward(x), ref(x.double()), 2e-6)


def test_in_place_ops_after_it_give_batchnorm3ds_gradients():
    ref = _reference(16)
    layer = copy.deepcopy(ref).float()
    layer.__class__ = ChannelsLastBatchNorm3d
    x = _input((2, 16, 3, 4, 4))
    identity = torch.randn(x.shape, dtype=torch.float64).float().contiguous(memory_format=CL3)
    x64, xk = x.double().requires_grad_(), x.clone().requires_grad_()
    y64 = torch.relu_(ref(x64) + identity.double())
    y = layer.triton_forward(xk)
    y += identity
    y = torch.relu_(y)
    gy = torch.randn_like(y64)
    y64.backward(gy)
    y.backward(gy.float())
    _close(xk.grad, x64.grad, 2e-6)


def test_what_the_kernels_do_not_take_goes_the_flat_way_and_cuda_takes_triton(monkeypatch):
    layer = _reference(6).float()
    layer.__class__ = ChannelsLastBatchNorm3d
    taken = []
    monkeypatch.setattr(tbn, "batch_norm_train", lambda *a: taken.append("triton") or a[0])
    real_flat = ChannelsLastBatchNorm3d.flat_forward
    monkeypatch.setattr(ChannelsLastBatchNorm3d, "flat_forward",
                        lambda self, x: taken.append("flat") or real_flat(self, x))
    cl = _input((3, 6, 4, 5, 7))
    layer.triton_forward(cl)
    layer.triton_forward(cl.contiguous())  # NCDHW
    layer.triton_forward(cl[..., :3])  # not dense
    layer.eval()
    layer.triton_forward(cl)  # eval with running statistics
    assert taken == ["triton", "flat", "flat", "flat"]
    layer.train()
    taken.clear()
    monkeypatch.setattr(ChannelsLastBatchNorm3d, "mode", "triton")
    layer(cl.as_subclass(FakeCuda))  # CUDA: the triton path
    layer(cl)  # the CPU: BatchNorm3d
    assert taken == ["triton"]


def test_one_value_per_channel_in_training_is_refused_as_batchnorm3d():
    layer = _reference(6).float()
    layer.__class__ = ChannelsLastBatchNorm3d
    x = _input((1, 6, 1, 1, 1))
    for fn in (layer.triton_forward, layer.flat_forward, nn.BatchNorm3d(6)):
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            fn(x)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        tbn.batch_norm_train(x, None, None, None, None, 0.1, 1e-5)
