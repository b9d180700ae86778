"""The video stem's channel padding (cmacc.encoders.ChannelPaddedConv3d): on CUDA the RGB input
and the weight are padded with zero channels so that cuDNN runs a tensor-core kernel. The
padded convolution is run here on the CPU (``padded_forward``) against nn.Conv3d in float64:
the output, the weight's gradient and the input's gradient."""

import copy

import pytest
import torch
import torch.nn as nn

from cmacc.encoders import ChannelPaddedConv3d, export_video, video_backbone


def _convs(pad_to, stride=(1, 2, 2), kernel=(3, 7, 7), padding=(1, 3, 3), cin=3, cout=6):
    torch.manual_seed(0)
    plain = nn.Conv3d(cin, cout, kernel, stride=stride, padding=padding, bias=False).double()
    padded = copy.deepcopy(plain)
    padded.__class__ = ChannelPaddedConv3d
    padded.pad_to = pad_to
    return plain, padded


@pytest.mark.parametrize("pad_to", [4, 8])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_the_padded_stem_is_the_same_convolution_and_the_same_gradients(pad_to, layout):
    plain, padded = _convs(pad_to)
    x = torch.randn(2, 3, 5, 17, 19, dtype=torch.float64)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = plain(x1), padded.padded_forward(x2)
    assert y2.shape == y1.shape
    torch.testing.assert_close(y2, y1, rtol=1e-12, atol=1e-12)
    gy = torch.randn_like(y1)
    (y1 * gy).sum().backward()
    (y2 * gy).sum().backward()
    torch.testing.assert_close(padded.weight.grad, plain.weight.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-12, atol=1e-12)
    assert padded.weight.grad.shape == (6, 3, 3, 7, 7)  # the parameter keeps its 3 channels


def test_the_padded_convolution_sees_pad_to_channels(monkeypatch):
    # the convolution the padded path runs: its input and weight have pad_to channels, the
    # added ones zero, and the input is stored channels-last (cuDNN's tensor-core layout)
    _, padded = _convs(8)
    seen = {}

    def spy(x, w, b):
        seen.update(x=x, w=w)
        return nn.Conv3d._conv_forward(padded, x, w, b)

    monkeypatch.setattr(padded, "_conv_forward", spy)
    x = torch.randn(1, 3, 3, 9, 9, dtype=torch.float64)
    padded.padded_forward(x)
    assert seen["x"].shape[1] == 8 and seen["w"].shape[1] == 8
    assert seen["x"].is_contiguous(memory_format=torch.channels_last_3d)
    assert seen["x"][:, 3:].abs().sum() == 0 and seen["w"][:, 3:].abs().sum() == 0
    torch.testing.assert_close(seen["x"][:, :3], x)


def test_on_the_cpu_the_stem_is_nn_conv3d(monkeypatch):
    _, padded = _convs(8)
    monkeypatch.setattr(padded, "padded_forward", lambda x: pytest.fail("padded on the CPU"))
    padded(torch.randn(1, 3, 3, 9, 9, dtype=torch.float64))


@pytest.mark.parametrize("arch,size", [("r3d_18", (64, (2, 2, 2, 2))),
                                       ("r2plus1d_18", (64, (2, 2, 2, 2))),
                                       ("r3d_18", (4, (1, 1, 1, 1)))])
def test_every_video_backbone_pads_its_stem_and_exports_torchvisions_names(arch, size):
    net = video_backbone(arch, *size)
    assert type(net.stem[0]) is ChannelPaddedConv3d
    assert net.stem[0].weight.shape[1] == 3
    names = set(export_video(net))
    assert "stem.0.weight" in names and not any("pad" in n for n in names)
