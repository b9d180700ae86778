"""The `convs` and `bn` parts of bench/gpu_session.py (`make gpu-session`): the video encoder's
convolutions one by one and whole, cuDNN autotuning off and on, the encoder with its fast layer
forms off (and with the Triton batch norm), and the video stem alone in each of its forms; each
BatchNorm3d shape alone in its three forms. bench/session_parts.py has the other
parts and re-exports this one. Nothing here touches CUDA at import time.
"""

from __future__ import annotations

import math

import torch

from bench.session_common import bench_ms, sizes


def _inputs_by(backbone, x, cls, key) -> dict:
    """{key(module, its input): [names]} over the modules of type ``cls`` in ``backbone``, as a
    no-grad forward of ``x`` reaches them."""
    seen, hooks = {}, []
    for name, mod in backbone.named_modules():
        if isinstance(mod, cls):
            def hook(m, inp, _out, name=name):
                seen.setdefault(key(m, inp[0]), []).append(name)
            hooks.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad():
            backbone(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _conv_layers(backbone, x) -> list[dict]:
    """Every Conv3d of ``backbone`` with the input shape it sees on ``x``, grouped by shape."""
    import torch.nn as nn

    seen = _inputs_by(backbone, x, nn.Conv3d, lambda m, inp: (
        tuple(inp.shape), m.out_channels, m.kernel_size, m.stride, m.padding, m.dilation,
        m.groups))
    return [dict(zip(("in_shape", "out_channels", "kernel", "stride", "padding", "dilation",
                      "groups"), key), names=names) for key, names in seen.items()]


def part_convs(args, report) -> dict:
    """cuDNN autotuning off and on: each conv shape's forward and backward, and the encoder."""
    import torch.nn.functional as F

    from cmacc.config import PRESETS
    from cmacc.encoders import (ChannelsLastBatchNorm3d, Encoder, StemConv3d, declared_stem,
                                video_backbone)
    from cmacc.metrics import flops_of, peak_flops

    sz, dev = sizes(args), sizes(args).device
    cfg = PRESETS[sz.preset]
    mc, dc = cfg.model, cfg.data
    cuda = dev == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32  # CPU bf16 Conv3d: see cmacc/amp.py
    cl = torch.channels_last_3d
    shape = (sz.conv_batch, 3, dc.frames, dc.size, dc.size)
    torch.manual_seed(0)
    backbone = video_backbone(mc.video_arch, mc.video_width, mc.video_layers).to(dev)
    backbone = backbone.to(memory_format=cl)
    layers = _conv_layers(backbone.eval(), torch.randn(shape, device=dev).contiguous(
        memory_format=cl))
    for i, layer in enumerate(layers):
        n, cin, *spatial = layer["in_shape"]
        out_sp = [(s + 2 * p - d * (k - 1) - 1) // st + 1 for s, p, d, k, st in
                  zip(spatial, layer["padding"], layer["dilation"], layer["kernel"],
                      layer["stride"])]
        layer["out_shape"] = [n, layer["out_channels"], *out_sp]
        # forward FLOPs = 2 * N * C_out * T_out * H_out * W_out * (C_in / groups) * kT * kH * kW
        layer["gflop_fwd"] = 2 * n * layer["out_channels"] * math.prod(out_sp) * (
            cin // layer["groups"]) * math.prod(layer["kernel"]) / 1e9
        # backward: the weight gradient (as many FLOPs as the forward) and, past the stem (the
        # clip itself needs no gradient), the input gradient (as many again)
        layer["input_grad"] = i > 0
        layer["gflop_bwd"] = layer["gflop_fwd"] * (2 if layer["input_grad"] else 1)
    encoder = Encoder(video_backbone(mc.video_arch, mc.video_width, mc.video_layers), mc.dim,
                      mc.fcl_dim if mc.fcl else None).to(dev).to(memory_format=cl)
    clip = torch.randn(shape, device=dev).contiguous(memory_format=cl)
    with declared_stem():  # the model's FLOPs, not the padded or folded stem's
        enc_gflop = 3 * flops_of(lambda: encoder.eval()(clip[:1])) * sz.conv_batch / 1e9
    stem_default = StemConv3d.mode
    encoder.train()
    peak = peak_flops(dev) if cuda else None
    modes = {}
    for bench in (False, True):
        torch.backends.cudnn.benchmark = bench
        tag = "on" if bench else "off"
        for layer in layers:
            n, cin, *_ = layer["in_shape"]
            x = torch.randn(layer["in_shape"], device=dev, dtype=dtype).contiguous(
                memory_format=cl)
            w = torch.randn(layer["out_channels"], cin // layer["groups"], *layer["kernel"],
                            device=dev, dtype=dtype).contiguous(memory_format=cl)
            conv = dict(stride=layer["stride"], padding=layer["padding"],
                        dilation=layer["dilation"], groups=layer["groups"])
            y = F.conv3d(x, w, None, **conv)
            gy = torch.randn_like(y)
            mask = [layer["input_grad"], True, False]

            def bwd(gy=gy, x=x, w=w, conv=conv, mask=mask):
                return torch.ops.aten.convolution_backward(
                    gy, x, w, None, list(conv["stride"]), list(conv["padding"]),
                    list(conv["dilation"]), False, [0, 0, 0], conv["groups"], mask)

            fwd_ms = bench_ms(lambda x=x, w=w, conv=conv: F.conv3d(x, w, None, **conv), dev)
            bwd_ms = bench_ms(bwd, dev)
            layer[f"fwd_ms_{tag}"], layer[f"bwd_ms_{tag}"] = fwd_ms, bwd_ms
            layer[f"fwd_tflops_{tag}"] = layer["gflop_fwd"] / fwd_ms  # GFLOP / ms = TFLOP/s
            layer[f"bwd_tflops_{tag}"] = layer["gflop_bwd"] / bwd_ms
            del x, w, y, gy
        report(layers=layers)

        def step():
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=cuda):
                q, h = encoder(clip)
            (q.float().sum() + h.float().sum()).backward()

        ms = bench_ms(step, dev, rep_ms=1000)  # (~100 ms a call: a median of ~10)
        encoder.zero_grad(set_to_none=True)
        modes[tag] = dict(ms=ms, tflops=enc_gflop / ms,
                          conv_fwd_ms=sum(len(lay["names"]) * lay[f"fwd_ms_{tag}"]
                                          for lay in layers),
                          conv_bwd_ms=sum(len(lay["names"]) * lay[f"bwd_ms_{tag}"]
                                          for lay in layers))
        if peak:
            modes[tag]["of_peak"] = enc_gflop * 1e9 / (ms / 1e3) / peak
        if bench:  # the encoder again with the stem's other forms and BatchNorm3d's own path
            for other, cls, mode in (("stem_pad", StemConv3d, "pad"),
                                     ("stem_off", StemConv3d, "off"),
                                     ("bn_off", ChannelsLastBatchNorm3d, "off"),
                                     ("bn_triton", ChannelsLastBatchNorm3d, "triton")):
                before = cls.mode
                cls.mode = mode
                try:
                    ms = bench_ms(step, dev, rep_ms=1000)
                finally:
                    cls.mode = before
                encoder.zero_grad(set_to_none=True)
                modes[f"on_{other}"] = dict(ms=ms, tflops=enc_gflop / ms,
                                            speedup_of_default=ms / modes["on"]["ms"])
                report(encoder=modes)
    torch.backends.cudnn.benchmark = True
    stem = _stem_rows(layers[0], dev, dtype)
    torch.backends.cudnn.benchmark = False
    return dict(dtype=str(dtype).split(".")[-1], batch=sz.conv_batch, input=list(shape),
                layout="channels_last_3d",
                flops="fwd 2*N*Cout*To*Ho*Wo*(Cin/groups)*kT*kH*kW; bwd = weight grad (1x fwd) "
                      "+ input grad (1x fwd, not for the stem); TFLOP/s = FLOPs / time",
                layers=layers, encoder=dict(arch=mc.video_arch, gflop_fwd_bwd=enc_gflop,
                                            flops="3 x FlopCounterMode forward of one clip x "
                                                  "batch", stem=stem_default,
                                            bn=ChannelsLastBatchNorm3d.mode, **modes),
                stem=stem, peak_tflops=peak / 1e12 if peak else None)


STEM_PADS = (3, 4, 8)  # the stem's input channels: RGB as is, padded to 4 and to 8


def _stem_rows(layer: dict, dev: str, dtype) -> list[dict]:
    """The stem's convolution (cuDNN autotuned) with its 3 input channels zero-padded to each of
    STEM_PADS, channels-last, and once in NCDHW: forward and weight-gradient ms (TFLOP/s of the
    unpadded FLOPs) and the largest difference from the unpadded output, relative to its
    largest magnitude (the padded channels add zeros: rounding only)."""
    import torch.nn.functional as F

    cl = torch.channels_last_3d
    n, cin, *spatial = layer["in_shape"]
    conv = dict(stride=layer["stride"], padding=layer["padding"], dilation=layer["dilation"])
    torch.manual_seed(0)
    x3 = torch.randn(layer["in_shape"], device=dev, dtype=dtype)
    w3 = torch.randn(layer["out_channels"], cin, *layer["kernel"], device=dev, dtype=dtype)
    ref = None
    rows = []
    for pad, fmt in [(c, "channels_last") for c in STEM_PADS] + [(cin, "ncdhw")]:
        mf = cl if fmt == "channels_last" else torch.contiguous_format
        x = F.pad(x3, (0, 0, 0, 0, 0, 0, 0, pad - cin)).contiguous(memory_format=mf)
        w = F.pad(w3, (0, 0, 0, 0, 0, 0, 0, pad - cin)).contiguous(memory_format=mf)
        y = F.conv3d(x, w, None, **conv)
        gy = torch.randn_like(y)

        def bwd(gy=gy, x=x, w=w):
            return torch.ops.aten.convolution_backward(
                gy, x, w, None, list(conv["stride"]), list(conv["padding"]),
                list(conv["dilation"]), False, [0, 0, 0], 1, [False, True, False])

        fwd_ms = bench_ms(lambda x=x, w=w: F.conv3d(x, w, None, **conv), dev)
        bwd_ms = bench_ms(bwd, dev)
        yf = y.float()
        if ref is None:
            ref = yf
        rows.append(dict(channels=pad, layout=fmt, fwd_ms=fwd_ms, wgrad_ms=bwd_ms,
                         fwd_tflops=layer["gflop_fwd"] / fwd_ms,
                         wgrad_tflops=layer["gflop_fwd"] / bwd_ms,
                         max_rel_diff=float((yf - ref).abs().max() / ref.abs().max())))
        del x, w, y, gy, yf
    if layer["stride"][0] == 1 and layer["dilation"] == (1, 1, 1):
        rows += _stem_fold_rows(layer, x3, w3, ref, dev)
    return rows


def _stem_fold_rows(layer, x3, w3, ref, dev) -> list[dict]:
    """The stem as a 2-D convolution of each frame (kT frames x 3 channels folded into the
    input channels, zero-padded to 12 and to 16), the fold the model runs
    (cmacc.layer_forms.fold_frames / fold_weight): forward, the fold itself, and weight-gradient
    ms."""
    import torch.nn.functional as F

    from cmacc.encoders import fold_frames, fold_weight

    kt = layer["kernel"][0]
    pt = layer["padding"][0]
    b = x3.shape[0]
    conv = dict(stride=layer["stride"][1:], padding=layer["padding"][1:])
    rows = []
    for width in (12, 16):
        def fold(x3=x3, width=width):
            return fold_frames(x3, kt, pt, width, x3.dtype)  # NCHW view, NHWC storage
        x = fold()
        wt = fold_weight(w3, width)
        y = F.conv2d(x, wt, None, **conv)  # [B T, O, Ho, Wo]
        gy = torch.randn_like(y)

        def bwd(gy=gy, x=x, wt=wt):
            return torch.ops.aten.convolution_backward(
                gy, x, wt, None, list(conv["stride"]), list(conv["padding"]), [1, 1], False,
                [0, 0], 1, [False, True, False])

        fwd_ms = bench_ms(lambda x=x, wt=wt: F.conv2d(x, wt, None, **conv), dev)
        fold_ms = bench_ms(fold, dev)
        bwd_ms = bench_ms(bwd, dev)
        yf = y.float().view(b, y.shape[0] // b, *y.shape[1:]).permute(0, 2, 1, 3, 4)
        rows.append(dict(channels=width, layout="fold2d_nhwc", fwd_ms=fwd_ms, fold_ms=fold_ms,
                         wgrad_ms=bwd_ms, fwd_tflops=layer["gflop_fwd"] / fwd_ms,
                         wgrad_tflops=layer["gflop_fwd"] / bwd_ms,
                         max_rel_diff=float((yf - ref).abs().max() / ref.abs().max())))
        del x, y, gy, yf
    return rows


def _bn_shapes(backbone, x) -> list[dict]:
    """Every BatchNorm3d of ``backbone`` with the input shape it sees on ``x``, by shape."""
    import torch.nn as nn

    seen = _inputs_by(backbone, x, nn.BatchNorm3d, lambda m, inp: tuple(inp.shape))
    return [dict(shape=list(shape), names=names) for shape, names in seen.items()]


BN_FORMS = ("bn3d", "flat", "triton")  # BatchNorm3d's own path, the 4-D view, the Triton kernels


def part_bn(args, report) -> dict:
    """Each BatchNorm3d shape of the video encoder at the paper batch, alone, in training:
    forward (under no_grad, as the key encoder runs it), and forward + backward (input, weight
    and bias gradients; backward GB/s from the difference), in BatchNorm3d's own
    path, the 4-D channels-last view (``flat``) and kernels/triton_batchnorm.py (``triton``);
    ms, the GB/s of the bytes each form must move at least (forward: x read twice, y written;
    backward: g and x read twice, dx written), and the largest difference of the triton form's
    output and input gradient from the flat form's (over the largest value)."""
    import torch.nn as nn

    from cmacc.config import PRESETS
    from cmacc.encoders import ChannelsLastBatchNorm3d, video_backbone
    from kernels import triton_batchnorm as tbn

    sz = sizes(args)
    dev = sz.device
    cfg = PRESETS[sz.preset]
    mc, dc = cfg.model, cfg.data
    cl = torch.channels_last_3d
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    backbone = video_backbone(mc.video_arch, mc.video_width, mc.video_layers).to(dev)
    shapes = _bn_shapes(backbone.to(memory_format=cl).eval(), torch.randn(
        sz.conv_batch, 3, dc.frames, dc.size, dc.size, device=dev).contiguous(memory_format=cl))
    del backbone
    rows = []
    for row in shapes:
        torch.manual_seed(0)
        x = torch.randn(row["shape"], device=dev, dtype=dtype).contiguous(memory_format=cl)
        xr = x.detach().requires_grad_()
        gy = torch.randn_like(x)
        layer = ChannelsLastBatchNorm3d(row["shape"][1]).to(dev).train()
        run = {"bn3d": lambda t: nn.BatchNorm3d.forward(layer, t), "flat": layer.flat_forward,
               "triton": layer.triton_forward}
        size = x.numel() * x.element_size()
        row.update(dtype=str(dtype).split(".")[-1], triton_takes=tbn.supports(x),
                   min_mb_fwd=3 * size / 1e6, min_mb_bwd=5 * size / 1e6)
        outs = {}
        for form in BN_FORMS:
            fn = run[form]
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                with torch.no_grad():  # the forward's kernels alone (the key encoder's case)
                    fwd = bench_ms(lambda fn=fn, x=x: fn(x), dev)
                both = bench_ms(lambda fn=fn, xr=xr, gy=gy: torch.autograd.grad(
                    fn(xr), [xr, layer.weight, layer.bias], gy), dev)
            row[f"{form}_fwd_ms"], row[f"{form}_fwd_bwd_ms"] = fwd, both
            row[f"{form}_fwd_gb_s"] = row["min_mb_fwd"] / fwd / 1e3
            row[f"{form}_bwd_gb_s"] = row["min_mb_bwd"] / max(both - fwd, 1e-6) / 1e3
            y = fn(xr)
            outs[form] = (y.detach().float(), torch.autograd.grad(y, xr, gy)[0].float())
        for i, what in enumerate(("y", "dx")):
            ref = outs["flat"][i]
            row[f"triton_{what}_diff"] = float((outs["triton"][i] - ref).abs().max()
                                               / ref.abs().max().clamp_min(1e-30))
        rows.append(row)
        report(shapes=rows)
        del x, xr, gy, outs
    total = {form: sum(len(r["names"]) * r[f"{form}_fwd_bwd_ms"] for r in rows)
             for form in BN_FORMS}
    return dict(batch=sz.conv_batch, forms=list(BN_FORMS), shapes=rows,
                encoder_fwd_bwd_ms=total)
