"""The video stem's fast forms (cmacc.layer_forms.StemConv3d): on CUDA the RGB stem runs as a 2-D
convolution of each frame with the kT frames it sees folded into the input channels ("fold"),
or with its 3 input channels zero-padded ("pad"). Both are run here on the CPU
(``folded_forward`` / ``padded_forward``) against nn.Conv3d in float64: the output, the
weight's gradient and the input's gradient."""

import copy

import pytest
import torch
import torch.nn as nn

from cmacc.encoders import StemConv3d, export_video, fold_width, video_backbone
from devices import FakeCuda

R3D = dict(kernel=(3, 7, 7), stride=(1, 2, 2), padding=(1, 3, 3))


def _convs(kernel, stride, padding, cin=3, cout=6, bias=False, dilation=1, groups=1):
    torch.manual_seed(0)
    plain = nn.Conv3d(cin, cout, kernel, stride=stride, padding=padding, bias=bias,
                      dilation=dilation, groups=groups).double()
    fast = copy.deepcopy(plain)
    fast.__class__ = StemConv3d
    return plain, fast


def _same_and_same_gradients(plain, fast, forward, x):
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = plain(x1), forward(x2)
    assert y2.shape == y1.shape
    torch.testing.assert_close(y2, y1, rtol=1e-12, atol=1e-12)
    gy = torch.randn_like(y1)
    (y1 * gy).sum().backward()
    (y2 * gy).sum().backward()
    torch.testing.assert_close(fast.weight.grad, plain.weight.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-12, atol=1e-12)
    assert fast.weight.grad.shape == plain.weight.shape  # the parameter keeps its 3 channels
    if plain.bias is not None:
        torch.testing.assert_close(fast.bias.grad, plain.bias.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("geometry", [
    R3D,  # r3d_18's stem: depth 3, temporal padding 1
    dict(kernel=(3, 7, 7), stride=(1, 2, 2), padding=(0, 3, 3)),  # no temporal padding
    dict(kernel=(5, 3, 3), stride=(1, 1, 2), padding=(2, 1, 0)),  # deeper, odd strides
    dict(kernel=(2, 3, 3), stride=(1, 2, 2), padding=(1, 1, 1)),  # even depth: T + 1 frames
    dict(kernel=(3, 3, 3), stride=(1, 1, 1), padding=(1, 2, 1), dilation=(1, 2, 1)),  # spatial
])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("frames", [1, 2, 5])
def test_the_folded_stem_is_the_same_convolution_and_the_same_gradients(geometry, layout,
                                                                        frames):
    plain, fast = _convs(**geometry, bias=frames == 5)
    assert fast.foldable()
    x = torch.randn(2, 3, frames, 17, 19, dtype=torch.float64)
    if frames + 2 * geometry["padding"][0] < geometry["kernel"][0]:
        pytest.skip("no output frame")
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    _same_and_same_gradients(plain, fast, fast.folded_forward, x)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_the_padded_stem_is_the_same_convolution_and_the_same_gradients(layout):
    plain, fast = _convs(**R3D)
    x = torch.randn(2, 3, 5, 17, 19, dtype=torch.float64)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    _same_and_same_gradients(plain, fast, fast.padded_forward, x)


def _spy(monkeypatch, fast, name):
    seen = {}
    real = getattr(torch.nn.functional, name)

    def spy(x, w, *args):
        seen.update(x=x, w=w)
        return real(x, w, *args)

    monkeypatch.setattr(torch.nn.functional, name, spy)
    return seen


def test_the_folded_convolution_is_2d_over_16_channels_in_channels_last(monkeypatch):
    # what cuDNN is given: a 2-D convolution of B x T frames whose 16 input channels are the
    # 3 taps x 3 colours (tap-major) and 7 zeros, input and weight stored channels-last
    _, fast = _convs(**R3D)
    seen = _spy(monkeypatch, fast, "conv2d")
    x = torch.randn(2, 3, 4, 9, 9, dtype=torch.float64)
    fast.folded_forward(x)
    assert seen["x"].shape == (2 * 4, 16, 9, 9) and seen["w"].shape == (6, 16, 7, 7)
    assert seen["x"].is_contiguous(memory_format=torch.channels_last)
    assert seen["w"].is_contiguous(memory_format=torch.channels_last)
    assert seen["x"][:, 9:].abs().sum() == 0 and seen["w"][:, 9:].abs().sum() == 0
    frames = seen["x"].view(2, 4, 16, 9, 9)
    torch.testing.assert_close(frames[:, 1, 0:3], x[:, :, 0])  # frame 1, tap 0: frame 0
    torch.testing.assert_close(frames[:, 1, 6:9], x[:, :, 2])  # frame 1, tap 2: frame 2
    assert frames[:, 0, 0:3].abs().sum() == 0  # frame 0, tap 0: the temporal padding
    torch.testing.assert_close(seen["w"][:, 3:6], fast.weight[:, :, 1])  # tap 1's weights


@pytest.mark.parametrize("geometry", [
    dict(kernel=(3, 7, 7), stride=(2, 2, 2), padding=(1, 3, 3)),  # temporal stride
    dict(kernel=(3, 3, 3), stride=(1, 1, 1), padding=(2, 1, 1), dilation=(2, 1, 1)),
    dict(kernel=(3, 3, 3), stride=(1, 1, 1), padding=(1, 1, 1), cin=3, cout=6, groups=3),
    dict(kernel=(1, 7, 7), stride=(1, 2, 2), padding=(0, 3, 3)),  # nothing to fold
])
def test_a_conv_that_cannot_be_folded_is_refused_and_forward_runs_it_as_declared(geometry,
                                                                                  monkeypatch):
    plain, fast = _convs(**geometry)
    assert not fast.foldable()
    x = torch.randn(1, 3, 4, 9, 9, dtype=torch.float64)
    with pytest.raises(ValueError, match="cannot fold"):
        fast.folded_forward(x)
    if fast.groups != 1:
        with pytest.raises(ValueError, match="cannot pad"):
            fast.padded_forward(x)

    torch.testing.assert_close(fast(x.as_subclass(FakeCuda)).as_subclass(torch.Tensor),
                               plain(x), rtol=1e-12, atol=1e-12)


def test_under_the_cuda_autocast_the_folded_input_is_made_in_its_dtype(monkeypatch):
    # the fold casts once to the autocast dtype (bf16 in training), not to the clip's fp32
    _, fast = _convs(**R3D)
    fast.float()
    seen = _spy(monkeypatch, fast, "conv2d")
    x = torch.randn(1, 3, 4, 9, 9)
    state = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    try:
        with pytest.raises(RuntimeError):  # the bf16 input meets the fp32 weight on the CPU,
            fast.folded_forward(x)         # where no autocast casts the weight: the spy saw it
    finally:
        torch.set_autocast_enabled("cuda", state[0])
        torch.set_autocast_dtype("cuda", state[1])
    assert seen["x"].dtype == torch.bfloat16
    fast.folded_forward(x)  # autocast off: the input's dtype
    assert seen["x"].dtype == torch.float32


def test_a_scripted_backbone_is_the_plain_one_on_the_same_parameters():
    net = video_backbone("r3d_18", 4, (1, 1, 1, 1)).eval()
    x = torch.randn(2, 3, 4, 16, 16)
    want = net(x)
    scripted = torch.jit.script(net)
    torch.testing.assert_close(scripted(x), want)


def test_the_fold_width_is_a_multiple_of_8_at_least_16():
    assert [fold_width(c) for c in (3, 9, 16, 17, 21)] == [16, 16, 16, 24, 24]


@pytest.mark.parametrize("mode,kernel,expect", [
    ("fold", (3, 7, 7), "folded_forward"),
    ("fold", (1, 7, 7), "padded_forward"),  # r2plus1d_18's stem: nothing to fold
    ("pad", (3, 7, 7), "padded_forward"),
])
def test_on_cuda_the_stem_takes_its_fast_form_and_on_the_cpu_none(monkeypatch, mode, kernel,
                                                                   expect):
    _, fast = _convs(kernel, (1, 2, 2), (kernel[0] // 2, 3, 3))
    monkeypatch.setattr(StemConv3d, "mode", mode)
    called = []
    for name in ("folded_forward", "padded_forward"):
        monkeypatch.setattr(fast, name, lambda x, name=name: called.append(name))

    x = torch.randn(1, 3, 3, 9, 9, dtype=torch.float64)
    fast(x)  # on the CPU: nn.Conv3d
    assert called == []
    fast(x.as_subclass(FakeCuda))
    assert called == [expect]
    monkeypatch.setattr(StemConv3d, "mode", "off")
    fast(x.as_subclass(FakeCuda))
    assert called == [expect]


@pytest.mark.parametrize("arch,size", [("r3d_18", (64, (2, 2, 2, 2))),
                                       ("r2plus1d_18", (64, (2, 2, 2, 2))),
                                       ("r3d_18", (4, (1, 1, 1, 1)))])
def test_every_video_backbone_has_the_fast_stem_and_exports_torchvisions_names(arch, size):
    net = video_backbone(arch, *size)
    assert type(net.stem[0]) is StemConv3d
    assert net.stem[0].weight.shape[1] == 3
    names = set(export_video(net))
    assert "stem.0.weight" in names and len(names) == len(net.state_dict())


def test_the_flop_count_is_the_declared_convolutions_whatever_the_stems_form(monkeypatch):
    # MFU counts the model's FLOPs (cmacc.metrics.model_flops_per_clip): a stem that folds
    # wherever it runs (the meta copies included) still counts as its declared Conv3d
    from cmacc.config import PRESETS
    from cmacc.metrics import model_flops_per_clip
    from cmacc.model import CMACC

    cfg = PRESETS["tiny"]
    torch.manual_seed(0)
    model = CMACC(cfg.model, cfg.selection)
    v = torch.randn(2, 3, cfg.data.frames, cfg.data.size, cfg.data.size)
    a = torch.randn(2, cfg.model.n_mels, 64)
    declared = model_flops_per_clip(model, v, a)
    monkeypatch.setattr(StemConv3d, "forward", lambda self, x: (
        self.folded_forward(x) if StemConv3d.mode == "fold" else nn.Conv3d.forward(self, x)))
    from torch.utils.flop_counter import FlopCounterMode

    stem = model.f_v.backbone.stem[0]
    with FlopCounterMode(display=False) as folded:  # the fold does count more: 16 channels
        stem(v[:1])
    with FlopCounterMode(display=False) as plain:
        nn.Conv3d.forward(stem, v[:1])
    assert folded.get_total_flops() > plain.get_total_flops()
    assert model_flops_per_clip(model, v, a) == declared
    assert StemConv3d.mode == "fold"
