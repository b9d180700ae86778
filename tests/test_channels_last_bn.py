"""The video encoders' BatchNorm3d on CUDA (cmacc.layer_forms.ChannelsLastBatchNorm3d): a
channels_last_3d input is normalised as its 4-D channels-last view [B, C, T H, W]. Run here on
the CPU (``flat_forward``) against nn.BatchNorm3d in float64: outputs, the gradients of the
input, weight and bias, the running statistics and their count, in training and in eval."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from cmacc.encoders import ChannelsLastBatchNorm3d, video_backbone
from devices import FakeCuda

CL3 = torch.channels_last_3d


def _pair(c=6, **kw):
    torch.manual_seed(0)
    plain = nn.BatchNorm3d(c, **kw).double()
    if plain.affine:
        with torch.no_grad():
            plain.weight.uniform_(0.5, 1.5)
            plain.bias.uniform_(-0.5, 0.5)
    flat = copy.deepcopy(plain)
    flat.__class__ = ChannelsLastBatchNorm3d
    return plain, flat


@pytest.mark.parametrize("shape", [(3, 6, 4, 5, 7), (2, 6, 1, 5, 7), (2, 6, 4, 1, 7),
                                   (2, 6, 4, 5, 1), (1, 6, 1, 1, 3)])
@pytest.mark.parametrize("kw", [{}, dict(momentum=None), dict(affine=False),
                                dict(track_running_stats=False)])
def test_the_flat_view_is_the_same_batch_norm_in_training(shape, kw):
    plain, flat = _pair(**kw)
    for step in range(3):  # the running statistics and their count over several steps
        x = (torch.randn(shape, dtype=torch.float64) * 2 + step).contiguous(memory_format=CL3)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1, y2 = plain(x1), flat.flat_forward(x2)
        torch.testing.assert_close(y2, y1, rtol=1e-12, atol=1e-12)
        assert y2.shape == y1.shape and y2.is_contiguous(memory_format=CL3)
        gy = torch.randn_like(y1)
        (y1 * gy).sum().backward()
        (y2 * gy).sum().backward()
        torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-10, atol=1e-12)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(dict(flat.named_parameters())[name].grad, p.grad,
                                   rtol=1e-10, atol=1e-12)
    for name, b in plain.named_buffers():
        torch.testing.assert_close(dict(flat.named_buffers())[name], b, rtol=1e-12, atol=1e-12)


def test_the_flat_view_is_the_same_batch_norm_in_eval():
    plain, flat = _pair()
    warm = torch.randn(3, 6, 4, 5, 7, dtype=torch.float64).contiguous(memory_format=CL3)
    plain(warm)  # the same running statistics first
    flat.flat_forward(warm)
    plain.eval()
    flat.eval()
    x = torch.randn(3, 6, 4, 5, 7, dtype=torch.float64).contiguous(memory_format=CL3)
    torch.testing.assert_close(flat.flat_forward(x), plain(x), rtol=1e-12, atol=1e-12)


class _Ops(TorchDispatchMode):
    """Every aten op run under it, with its arguments (an independent record of what PyTorch
    was given)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)

    def named(self, name):
        return [(a, k) for f, a, k in self.calls if f.__name__.split(".")[0] == name]


def _block_tail(bn, x, identity):
    # what follows a batch norm in a torchvision block: ReLU(inplace=True), out += identity
    y = bn.flat_forward(x)
    y += identity
    return torch.relu_(y)


def test_the_flat_view_is_a_4d_channels_last_batch_norm_without_a_copy():
    # forward and backward: the 4-D channels-last view of the input's own memory, an output of
    # its own (not a view, so the in-place ops after it cost no copy of the gradient), and no
    # copy or clone of anything in either pass
    _, flat = _pair()
    x = torch.randn(3, 6, 4, 5, 7, dtype=torch.float64).contiguous(memory_format=CL3)
    x.requires_grad_()
    identity = torch.randn_like(x)
    with _Ops() as ops:
        y = _block_tail(flat, x, identity)
        y.backward(torch.randn_like(y))
    (fwd_args, fwd_kw), = ops.named("native_batch_norm")
    seen = fwd_args[0]
    assert seen.shape == (3, 6, 20, 7) and seen.is_contiguous(memory_format=torch.channels_last)
    assert seen.data_ptr() == x.data_ptr()
    out = fwd_kw["out"]
    assert out.shape == (3, 6, 20, 7) and out.is_contiguous(memory_format=torch.channels_last)
    assert out.data_ptr() == y.data_ptr()
    (bwd_args, _), = ops.named("native_batch_norm_backward")
    for t in bwd_args[:2]:  # the gradient and the input: 4-D channels-last
        assert t.shape == (3, 6, 20, 7) and t.is_contiguous(memory_format=torch.channels_last)
    copies = [f.__name__ for f, _, _ in ops.calls
              if f.__name__.split(".")[0] in ("copy_", "clone", "_to_copy", "as_strided_scatter",
                                              "contiguous")]
    assert copies == []


def test_in_place_ops_after_the_flat_batch_norm_give_batchnorm3ds_gradients():
    plain, flat = _pair()
    x = (torch.randn(3, 6, 4, 5, 7, dtype=torch.float64)).contiguous(memory_format=CL3)
    identity = torch.randn_like(x)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1 = torch.relu_(plain(x1) + identity)
    y2 = _block_tail(flat, x2, identity)
    torch.testing.assert_close(y2, y1, rtol=1e-12, atol=1e-12)
    gy = torch.randn_like(y1)
    y1.backward(gy)
    y2.backward(gy)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-10, atol=1e-12)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(dict(flat.named_parameters())[name].grad, p.grad,
                                   rtol=1e-10, atol=1e-12)


def test_two_forwards_of_one_layer_before_one_backward_give_batchnorm3ds_gradients():
    # each backward reads its own forward's batch statistics (the running ones change between)
    plain, flat = _pair()
    xs = [torch.randn(2, 6, 3, 4, 5, dtype=torch.float64).contiguous(memory_format=CL3)
          .requires_grad_() for _ in range(2)]
    ys = [flat.flat_forward(x) for x in xs]
    sum((y * y).sum() for y in ys).backward()
    refs = [x.detach().clone().requires_grad_() for x in xs]
    sum((y * y).sum() for y in (plain(r) for r in refs)).backward()
    for x, r in zip(xs, refs):
        torch.testing.assert_close(x.grad, r.grad, rtol=1e-10, atol=1e-12)


def test_other_layouts_and_the_cpu_take_batchnorm3d_and_cuda_the_flat_view(monkeypatch):
    plain, flat = _pair()
    x = torch.randn(3, 6, 4, 5, 7, dtype=torch.float64)  # contiguous (NCDHW)
    torch.testing.assert_close(flat.flat_forward(x), plain(x))
    called = []
    monkeypatch.setattr(flat, "flat_forward", lambda x: called.append(x))
    flat(x.contiguous(memory_format=CL3))
    assert called == []  # the CPU: BatchNorm3d

    flat(x.contiguous(memory_format=CL3).as_subclass(FakeCuda))
    assert len(called) == 1  # CUDA: the flat view
    monkeypatch.setattr(ChannelsLastBatchNorm3d, "mode", "off")
    flat(x.contiguous(memory_format=CL3).as_subclass(FakeCuda))
    assert len(called) == 1


@pytest.mark.parametrize("shape", [(3, 6, 4), (3, 6, 4, 5), (6, 4, 5, 7)])
def test_a_batch_norm_3d_refuses_other_than_5d_input_on_every_path(shape, monkeypatch):
    # BatchNorm3d's error, before any path (a 4-D input would otherwise be taken as the view)
    _, flat = _pair()
    x = torch.randn(shape, dtype=torch.float64)
    for fn in (flat, flat.flat_forward):
        with pytest.raises(ValueError, match="expected 5D input"):
            fn(x)


@pytest.mark.parametrize("arch", ["r3d_18", "r2plus1d_18"])
def test_every_batch_norm_of_a_video_backbone_is_the_flat_one_with_its_state(arch):
    net = video_backbone(arch, 4, (1, 1, 1, 1))
    bns = [m for m in net.modules() if isinstance(m, nn.BatchNorm3d)]
    assert bns and all(type(m) is ChannelsLastBatchNorm3d for m in bns)
    keys = set(net.state_dict())
    assert all(any(k.endswith(s) for k in keys) for s in ("running_mean", "num_batches_tracked"))


def test_cmacc_fast_layers_0_turns_both_forms_off_for_the_process():
    # the escape hatch: the declared nn.Conv3d / nn.BatchNorm3d on CUDA too; and the batch
    # norm's own choice (CMACC_BATCH_NORM), which wins for the batch norm, a bad value refused
    import subprocess
    import sys

    probe = ("from cmacc.encoders import StemConv3d as S, ChannelsLastBatchNorm3d as B; "
             "print(S.mode, B.mode)")
    for fast, bn, want in (("0", None, "off off"), ("1", None, "fold flat"),
                           (None, None, "fold flat"), (None, "triton", "fold triton"),
                           ("0", "flat", "off flat"), (None, "bogus", None)):
        env = {k: v for k, v in __import__("os").environ.items()
               if k not in ("CMACC_FAST_LAYERS", "CMACC_BATCH_NORM")}
        env.update({k: v for k, v in (("CMACC_FAST_LAYERS", fast), ("CMACC_BATCH_NORM", bn))
                    if v is not None})
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, timeout=300)
        if want is None:
            assert out.returncode != 0 and "CMACC_BATCH_NORM='bogus'" in out.stderr
            assert "one of flat, triton, off" in out.stderr
        else:
            assert out.returncode == 0 and out.stdout.split() == want.split(), out.stderr[-2000:]
