"""kernels/triton_batchnorm.py under the interpreter (TRITON_INTERPRET=1, tests/conftest.py)
against nn.BatchNorm3d in float64 on the same values: the output, the input / weight / bias
gradients, the running statistics and their count, several channel counts (powers of two and
not), slabs of one and of several tiles, a last slab cut short; and as
cmacc.layer_forms.ChannelsLastBatchNorm3d's ``mode = "triton"``."""

import copy

import pytest
import torch
import torch.nn as nn

import kernels.triton_batchnorm as tbn
from cmacc.encoders import ChannelsLastBatchNorm3d, video_backbone
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
                                   (3, 2, 1, 1, 1), (4, 16, 2, 4, 4), (3, 24, 5, 7, 11)])
@pytest.mark.parametrize("slabs,merge", [(512, 64), (2, 64), (512, 2)])
def test_training_batch_norm_equals_batchnorm3d(shape, slabs, merge, monkeypatch):
    # slabs of one tile and of many (the last one cut short: 515 rows over 5 tiles at
    # (3, 24, 5, 7, 11) in 2 slabs); the merges over one block of partials and over many
    monkeypatch.setattr(tbn, "SLABS", slabs)
    monkeypatch.setitem(tbn.MERGE, "BLOCK_P", merge)
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
    monkeypatch.setattr(tbn, "batch_norm_train", lambda *a, **k: taken.append("triton") or a[0])
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
    layer(cl)  # the CPU under the interpreter (these tests): the triton path too
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    layer(cl)  # the CPU otherwise: BatchNorm3d
    assert taken == ["triton", "triton"]


def test_one_value_per_channel_in_training_is_refused_as_batchnorm3d():
    layer = _reference(6).float()
    layer.__class__ = ChannelsLastBatchNorm3d
    x = _input((1, 6, 1, 1, 1))
    for fn in (layer.triton_forward, layer.flat_forward, nn.BatchNorm3d(6)):
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            fn(x)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        tbn.batch_norm_train(x, None, None, None, None, 0.1, 1e-5)


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_the_fused_residual_and_relu_equal_the_ops_after_batchnorm3d(relu, residual):
    ref = _reference(16)
    x = _input((2, 16, 3, 4, 4), offset=0.3)
    r = _input((2, 16, 3, 4, 4), scale=1.0, offset=0.0)
    x64, r64 = x.double().requires_grad_(), r.double().requires_grad_()
    y64 = ref(x64)
    if residual:
        y64 = y64 + r64
    if relu:
        y64 = torch.relu(y64)
    w = ref.weight.detach().float().clone().requires_grad_()
    b = ref.bias.detach().float().clone().requires_grad_()
    xk, rk = x.clone().requires_grad_(), r.clone().requires_grad_()
    y = tbn.batch_norm_train(xk, w, b, None, None, 0.1, 1e-5,
                             residual=rk if residual else None, relu=relu)
    _close(y, y64, 2e-6)
    assert not relu or bool((y >= 0).all()) and bool((y == 0).any())  # the ReLU cut some
    gy = torch.randn_like(y64)
    y64.backward(gy)
    y.backward(gy.float())
    _close(xk.grad, x64.grad, 2e-6)
    _close(w.grad, ref.weight.grad, 2e-6)
    _close(b.grad, ref.bias.grad, 2e-6)
    if residual:
        _close(rk.grad, r64.grad, 1e-6)
    else:
        assert rk.grad is None


def test_the_fused_output_changed_in_place_before_the_backward_is_an_error():
    # its ReLU mask is the saved output itself: autograd's version check, not a wrong gradient
    x = _input((2, 8, 2, 3, 3)).requires_grad_()
    y = tbn.batch_norm_train(x, None, None, None, None, 0.1, 1e-5, relu=True)
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_a_residual_of_another_layout_is_refused_by_the_kernel_and_added_by_the_layer():
    layer = _reference(8).float()
    layer.__class__ = ChannelsLastBatchNorm3d
    x = _input((2, 8, 2, 3, 3))
    r = torch.randn(x.shape)  # NCDHW
    with pytest.raises(ValueError, match="residual must have the input's shape"):
        tbn.batch_norm_train(x, None, None, None, None, 0.1, 1e-5, residual=r)
    ref = copy.deepcopy(layer)
    want = torch.relu(nn.BatchNorm3d.forward(ref, x) + r)
    torch.testing.assert_close(layer.fused_forward(x, residual=r, relu=True), want)


@pytest.mark.parametrize("arch", ["r3d_18", "r2plus1d_18"])
def test_a_backbone_in_triton_mode_trains_as_the_declared_layers(arch, monkeypatch):
    # a whole (small) video backbone, one training step, all in float64 (the kernels then
    # compute in float64 too): the declared layers (mode "off": nn.Conv3d, BatchNorm3d,
    # torchvision's blocks) against the same weights with every batch norm, residual add and
    # ReLU the Triton kernels run, fused where torchvision's blocks put them; then eval
    torch.manual_seed(0)
    net = video_backbone(arch, 8, (1, 1, 1, 1)).double()
    for m in net.modules():
        if isinstance(m, nn.BatchNorm3d):
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    for m in net.modules():  # float64 convolutions on the CPU answer NCDHW: made channels-last
        if isinstance(m, nn.Conv3d):  # (what the kernels take; the values do not change)
            m.register_forward_hook(lambda _m, _i, out: out.contiguous(memory_format=CL3))
    ref = copy.deepcopy(net)
    clip = torch.randn(2, 3, 4, 16, 16, dtype=torch.float64).contiguous(memory_format=CL3)
    monkeypatch.setattr(ChannelsLastBatchNorm3d, "mode", "off")
    y64 = ref(clip)
    gy = torch.randn_like(y64)
    y64.backward(gy)
    calls = []
    real = tbn.batch_norm_train
    monkeypatch.setattr(tbn, "batch_norm_train", lambda *a, **k: calls.append(
        (k.get("residual") is not None, k.get("relu", False))) or real(*a, **k))
    monkeypatch.setattr(ChannelsLastBatchNorm3d, "mode", "triton")
    y = net(clip)
    y.backward(gy)
    _close(y, y64, 1e-10)
    for (name, p), p64 in zip(net.named_parameters(), ref.parameters()):
        _close(p.grad, p64.grad, 1e-9)
    for b, b64 in zip(net.buffers(), ref.buffers()):  # (momentum reaches a kernel as fp32)
        _close(b.double(), b64.double(), 1e-7)
    bns = sum(isinstance(m, nn.BatchNorm3d) for m in net.modules())
    assert len(calls) == bns and calls.count((True, True)) == 4  # every BN; 4 blocks' tails
    assert calls.count((False, True)) >= 5  # the stem's and each block's first BN, with ReLU
    net.eval()
    ref.eval()
    monkeypatch.setattr(ChannelsLastBatchNorm3d, "mode", "off")
    want = ref(clip)
    monkeypatch.setattr(ChannelsLastBatchNorm3d, "mode", "triton")
    _close(net(clip), want, 1e-7)  # the running statistics' (fp32 momentum) agreement


def test_the_residual_is_added_to_the_output_rounded_to_its_dtype():
    # as ``bn(x) + r`` in bf16: the batch norm's output is a bf16 tensor before the add.
    # weight 0, bias 1 + 2^-8 (between two bf16 values: 1.0 either way it rounds) and r = -1:
    # 0 when rounded first, 2^-8 if the sum were taken in fp32
    c = 4
    x = _input((2, c, 2, 3, 3), dtype=torch.bfloat16)
    r = torch.full_like(x, -1.0)
    w, b = torch.zeros(c), torch.full((c,), 1.0 + 2 ** -8)
    eager = nn.BatchNorm3d.forward(_layer_with(w, b), x) + r
    assert bool((eager == 0).all())
    y = tbn.batch_norm_train(x, w, b, None, None, 0.1, 1e-5, residual=r)
    assert bool((y == 0).all())


def _layer_with(w, b):
    layer = nn.BatchNorm3d(w.numel())
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    return layer


@pytest.mark.parametrize("how", ["sum", "ncdhw"])
@pytest.mark.parametrize("form", ["flat", "triton"])
def test_a_gradient_of_another_layout_reaches_the_backward_right(how, form):
    # a sum over the batch hands back a gradient expanded along it (stride 0), and an op after
    # the layer may hand back an NCDHW one: both must be read as values, not as channels-last
    # memory
    ref = _reference(6)
    layer = copy.deepcopy(ref).float()
    layer.__class__ = ChannelsLastBatchNorm3d
    x = _input((3, 6, 4, 5, 7))
    x64, xk = x.double().requires_grad_(), x.clone().requires_grad_()
    weights = torch.randn(x.shape, dtype=torch.float64)  # NCDHW
    run = layer.flat_forward if form == "flat" else layer.triton_forward
    y64, y = ref(x64), run(xk)
    if how == "sum":
        w = weights[0]
        (y64.sum(0) * w).sum().backward()
        (y.sum(0) * w.float()).sum().backward()
    else:
        (y64.contiguous() * weights).sum().backward()
        (y.contiguous() * weights.float()).sum().backward()
    _close(xk.grad, x64.grad, 2e-6)
    _close(layer.weight.grad, ref.weight.grad, 2e-6)


def test_the_flat_form_in_eval_back_propagates_as_batchnorm3d():
    # a frozen batch norm (eval: running statistics) that still passes gradients
    ref = _reference(6)
    ref(_input((3, 6, 4, 5, 7)).double())  # running statistics of their own
    ref.eval()
    layer = copy.deepcopy(ref).float()
    layer.__class__ = ChannelsLastBatchNorm3d
    x = _input((3, 6, 4, 5, 7))
    x64, xk = x.double().requires_grad_(), x.clone().requires_grad_()
    gy = torch.randn(x.shape, dtype=torch.float64).contiguous(memory_format=CL3)
    (ref(x64) * gy).sum().backward()
    (layer.flat_forward(xk) * gy.float()).sum().backward()
    _close(xk.grad, x64.grad, 2e-6)
    _close(layer.weight.grad, ref.weight.grad, 2e-6)
    _close(layer.bias.grad, ref.bias.grad, 2e-6)


def test_an_empty_batch_is_batchnorm3ds_empty_output():
    layer = _reference(6).float()
    layer.__class__ = ChannelsLastBatchNorm3d
    x = torch.empty(0, 6, 2, 3, 3).contiguous(memory_format=CL3)
    assert not tbn.supports(x)
    assert layer.triton_forward(x).shape == x.shape


def test_a_nan_or_inf_goes_through_the_fused_relu_as_through_torch():
    # relu(nan) is nan, and threshold_backward zeroes the gradient only where y <= 0
    c = 4
    x = _input((2, c, 2, 3, 3))
    r = torch.zeros_like(x)
    r[0, 0, 0, 0, 0], r[0, 1, 0, 0, 0], r[0, 2, 0, 0, 0] = float("nan"), float("inf"), -float("inf")
    want_x, want_r = x.clone().requires_grad_(), r.clone().requires_grad_()
    want = torch.relu(nn.BatchNorm3d.forward(_layer_with(torch.ones(c), torch.zeros(c)), want_x)
                      + want_r)
    gy = torch.ones_like(want)
    want.backward(gy)
    got_r = r.clone().requires_grad_()
    got = tbn.batch_norm_train(x, torch.ones(c), torch.zeros(c), None, None, 0.1, 1e-5,
                               residual=got_r, relu=True)
    got.backward(gy)
    torch.testing.assert_close(got, want.detach(), equal_nan=True)
    torch.testing.assert_close(got_r.grad, want_r.grad, equal_nan=True)


def test_the_paper_size_backbones_fuse_their_stems_and_blocks():
    # torchvision's own r3d_18 / r2plus1d_18 (BasicStem / R2Plus1dStem: nn.Sequential
    # subclasses) get the fusing stem and blocks, not only the scaled copies the tests train
    from cmacc.layer_forms import _FusedBasicBlock, _FusingSequential

    for arch in ("r3d_18", "r2plus1d_18"):
        net = video_backbone(arch)
        assert type(net.stem) is _FusingSequential, arch
        blocks = [m for layer in (net.layer1, net.layer2, net.layer3, net.layer4) for m in layer]
        assert len(blocks) == 8 and all(type(b) is _FusedBasicBlock for b in blocks), arch
        assert all(type(b.conv1) is _FusingSequential for b in blocks), arch
