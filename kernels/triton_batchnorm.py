"""Training-mode batch norm of a channels-last activation in Triton, forward and backward, at
the memory bound (the video encoders' BatchNorm3d: cmacc.layer_forms.ChannelsLastBatchNorm3d,
``mode = "triton"``).

A dense channels_last_3d tensor [B, C, T, H, W] is, in memory, a row-major matrix of R = B T H W
rows of C values; batch norm in training is per column (channel):

    mean_c = sum_r x_rc / R,  var_c = sum_r (x_rc - mean_c)^2 / R,
    invstd_c = 1 / sqrt(var_c + eps),  y_rc = (x_rc - mean_c) invstd_c w_c + b_c,
    running_mean <- (1 - m) running_mean + m mean,
    running_var <- (1 - m) running_var + m var R / (R - 1)

and its backward, with g = dL/dy:

    db_c = sum_r g_rc,  dw_c = invstd_c sum_r g_rc (x_rc - mean_c)
    dx_rc = (g_rc - db_c / R - (x_rc - mean_c) invstd_c^2 sum_r g_rc (x_rc - mean_c) / R)
            invstd_c w_c

Each reduction is two launches: programs that each own a contiguous slab of rows and write one
partial per column (statistics: the slab's mean and sum of squared deviations, from sums of the
values shifted by the slab's first tile's mean, so no large sums of squares cancel), then one
small launch that merges the partials (the weighted mean first, then sum M2_p + n_p
(mean_p - mean)^2, Chan's formula) and writes the per-channel results. The elementwise passes
read x (and g) once and write y (dx) once.

What torchvision's blocks do after a batch norm can run in the same pass (``residual``,
``relu``): y = max(bn(x) + r, 0), the sum rounded as in the tensor's dtype first; the backward
then masks g by y > 0 (the saved output, as ReLU's own backward) in both of its passes and
writes the residual's gradient with dx. That saves the add's and the ReLU's passes forward and
backward.

Every value is computed in fp32 after its load (fp64 for fp64 tensors: the tests' exact
comparisons; fp32 is also right under the interpreter, where bf16 arithmetic is not); stores
cast to the tensor's dtype. The compiled kernels depend on C (padded to BLOCK_C, a power of two,
at most 1024), the dtype and the options, not on the number of rows (R, the slab size and the
number of slabs are not specialised): another batch size compiles nothing new. The first tile
of a slab is read twice (once for its shift): at most a quarter more of the statistics pass's
reads where a slab is 4 tiles (C = 512 at the paper batch), a few percent elsewhere.

Measured against PyTorch's kernels: bench/gpu_session.py's ``bn`` part (each BatchNorm shape of
r3d_18 at the paper batch, forward and backward) and ``layers`` part (the step).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["batch_norm_train", "supports", "fits", "INTERPRETED"]

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # as Triton saw it at definition
SLABS = 512  # about this many row slabs (programs) per reduction: ~4 per SM of an H100 / H200
MAX_C = 1024
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _blocks(c: int) -> tuple[int, int]:
    """(BLOCK_C, BLOCK_R): the column tile (C rounded up to a power of two) and rows a tile, so
    that a tile is 4,096 values (16 KB of fp32 over the program's threads)."""
    block_c = triton.next_power_of_2(c)
    return block_c, max(1, 4096 // block_c)


def _slabs(r: int, block_r: int) -> tuple[int, int]:
    """(rows per slab, slabs): a whole number of tiles a slab, about SLABS slabs."""
    per = triton.cdiv(triton.cdiv(r, SLABS), block_r) * block_r
    return per, triton.cdiv(r, per)


# ----------------------------------------------------------------------------------------------
# Forward: statistics (slab partials, then their merge), then y
# ----------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["R", "per_slab"])
def _stats_partial_kernel(x_ptr, part_ptr, R, C, per_slab,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    # slab p: its rows' mean and M2 per column -> part[p, 0:C], part[p, C:2C]. Sums of the
    # values shifted by the slab's first tile's mean (near the slab's mean, so M2 = S2 - S1^2 / n
    # does not cancel), kept per thread over the tiles and reduced across rows once at the end
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    start = pid * per_slab
    end = tl.minimum(start + per_slab, R)
    rows = start + tl.arange(0, BLOCK_R)
    mask = (rows < end)[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=mask,
                other=0.0).to(ACC)
    shift = tl.sum(x, axis=0) / tl.minimum(end - start, BLOCK_R).to(ACC)
    s1 = tl.zeros([BLOCK_R, BLOCK_C], ACC)
    s2 = tl.zeros([BLOCK_R, BLOCK_C], ACC)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows < end)[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=mask,
                    other=0.0).to(ACC)
        d = tl.where(mask, x - shift[None, :], 0.0)
        s1 += d
        s2 += d * d
    n = (end - start).to(ACC)
    t1 = tl.sum(s1, axis=0)
    t2 = tl.sum(s2, axis=0)
    base = part_ptr + pid.to(tl.int64) * 2 * C
    tl.store(base + cols, shift + t1 / n, mask=cmask)
    tl.store(base + C + cols, tl.maximum(t2 - t1 * t1 / n, 0.0), mask=cmask)


@triton.jit
def _slab_partials(part_ptr, p0, P, R, C, per_slab, cols, cmask, BLOCK_P: tl.constexpr,
                   ACC: tl.constexpr):
    # slabs p0 .. p0 + BLOCK_P: (their first partials, their second partials, rows, mask)
    ps = p0 + tl.arange(0, BLOCK_P)
    mask = (ps < P)[:, None] & cmask[None, :]
    rows = ps.to(tl.int64)[:, None] * 2 * C + cols[None, :]
    first = tl.load(part_ptr + rows, mask=mask, other=0.0)
    second = tl.load(part_ptr + rows + C, mask=mask, other=0.0)
    cnt = tl.minimum(R - ps * per_slab, per_slab).to(ACC)
    return first, second, cnt, mask


@triton.jit(do_not_specialize=["R", "P", "per_slab"])
def _stats_merge_kernel(part_ptr, mean_ptr, invstd_ptr, rmean_ptr, rvar_ptr, R, C, P, per_slab,
                        momentum, eps, UPDATE: tl.constexpr, BLOCK_P: tl.constexpr,
                        BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    # columns [pid BLOCK_C, ...): merge the P slab partials -> mean, invstd (and running stats)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    acc = tl.zeros([BLOCK_P, BLOCK_C], ACC)
    for p0 in range(0, P, BLOCK_P):
        m, _, cnt, mask = _slab_partials(part_ptr, p0, P, R, C, per_slab, cols, cmask, BLOCK_P,
                                       ACC)
        acc += tl.where(mask, m * cnt[:, None], 0.0)
    mean = tl.sum(acc, axis=0) / R
    acc = tl.zeros([BLOCK_P, BLOCK_C], ACC)
    for p0 in range(0, P, BLOCK_P):
        m, m2, cnt, mask = _slab_partials(part_ptr, p0, P, R, C, per_slab, cols, cmask, BLOCK_P,
                                       ACC)
        d = m - mean[None, :]
        acc += tl.where(mask, m2 + cnt[:, None] * d * d, 0.0)
    var = tl.sum(acc, axis=0) / R
    tl.store(mean_ptr + cols, mean, mask=cmask)
    tl.store(invstd_ptr + cols, 1.0 / tl.sqrt(var + eps), mask=cmask)
    if UPDATE:
        rm = tl.load(rmean_ptr + cols, mask=cmask).to(ACC)
        rv = tl.load(rvar_ptr + cols, mask=cmask).to(ACC)
        rows = R.to(ACC)
        unbiased = var * (rows / (rows - 1.0))
        tl.store(rmean_ptr + cols, (1.0 - momentum) * rm + momentum * mean, mask=cmask)
        tl.store(rvar_ptr + cols, (1.0 - momentum) * rv + momentum * unbiased, mask=cmask)


@triton.jit
def _row_tile(R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # this program's BLOCK_R rows: (offsets, mask, columns, column mask)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    mask = (rows < R)[:, None] & cmask[None, :]
    return rows.to(tl.int64)[:, None] * C + cols[None, :], mask, cols, cmask


@triton.jit
def _channel_scale(invstd_ptr, w_ptr, cols, cmask, HAS_W: tl.constexpr, ACC: tl.constexpr):
    # invstd_c w_c (invstd_c without an affine weight)
    scale = tl.load(invstd_ptr + cols, mask=cmask, other=0.0)
    if HAS_W:
        scale = scale * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(ACC)
    return scale


@triton.jit(do_not_specialize=["R"])
def _normalise_kernel(x_ptr, y_ptr, mean_ptr, invstd_ptr, w_ptr, b_ptr, r_ptr, R, C,
                      HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_R: tl.constexpr,
                      RELU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                      ACC: tl.constexpr):
    # y = (x - mean) invstd w + b [+ r] [then max(., 0)]
    offs, mask, cols, cmask = _row_tile(R, C, BLOCK_R, BLOCK_C)
    mean = tl.load(mean_ptr + cols, mask=cmask, other=0.0)
    scale = _channel_scale(invstd_ptr, w_ptr, cols, cmask, HAS_W, ACC)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(ACC)
    y = (x - mean[None, :]) * scale[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(ACC)[None, :]
    if HAS_R:
        # the sum rounded to the output's dtype first, as ``bn(x) + r`` in that dtype would be
        y = y.to(y_ptr.dtype.element_ty).to(ACC)
        y = y + tl.load(r_ptr + offs, mask=mask, other=0.0).to(ACC)
    if RELU:
        y = tl.maximum(y, 0.0, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN, as relu
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Backward: sum g and sum g (x - mean) (slab partials, then their sum), then dx
# ----------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["R", "per_slab"])
def _grad_partial_kernel(g_ptr, x_ptr, y_ptr, mean_ptr, part_ptr, R, C, per_slab,
                         RELU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                      ACC: tl.constexpr):
    # with RELU, g is the gradient of the ReLU's output y: the batch norm's is g where y > 0
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    mean = tl.load(mean_ptr + cols, mask=cmask, other=0.0)
    start = pid * per_slab
    end = tl.minimum(start + per_slab, R)
    sg = tl.zeros([BLOCK_R, BLOCK_C], ACC)
    sgx = tl.zeros([BLOCK_R, BLOCK_C], ACC)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows < end)[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        g = _masked_grad(g_ptr, y_ptr, offs, mask, RELU, ACC)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(ACC)
        sg += g
        sgx += g * tl.where(mask, x - mean[None, :], 0.0)
    base = part_ptr + pid.to(tl.int64) * 2 * C
    tl.store(base + cols, tl.sum(sg, axis=0), mask=cmask)
    tl.store(base + C + cols, tl.sum(sgx, axis=0), mask=cmask)


@triton.jit
def _masked_grad(g_ptr, y_ptr, offs, mask, RELU: tl.constexpr, ACC: tl.constexpr):
    # the gradient at the batch norm's (+ residual's) output: g, or g where the ReLU passed
    # (read only there: 0 elsewhere, as ReLU's backward)
    if RELU:
        # zero where y <= 0, as threshold_backward (a NaN output passes its gradient)
        mask = mask & ~(tl.load(y_ptr + offs, mask=mask, other=0.0) <= 0)
    return tl.load(g_ptr + offs, mask=mask, other=0.0).to(ACC)


@triton.jit(do_not_specialize=["R", "P", "per_slab"])
def _grad_merge_kernel(part_ptr, sums_ptr, R, C, P, per_slab, BLOCK_P: tl.constexpr,
                       BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    # sums[0:C] = sum g, sums[C:2C] = sum g (x - mean), over the P slab partials
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    sg = tl.zeros([BLOCK_P, BLOCK_C], ACC)
    sgx = tl.zeros([BLOCK_P, BLOCK_C], ACC)
    for p0 in range(0, P, BLOCK_P):
        g, gx, _, _ = _slab_partials(part_ptr, p0, P, R, C, per_slab, cols, cmask, BLOCK_P,
                                       ACC)
        sg += g
        sgx += gx
    tl.store(sums_ptr + cols, tl.sum(sg, axis=0), mask=cmask)
    tl.store(sums_ptr + C + cols, tl.sum(sgx, axis=0), mask=cmask)


@triton.jit(do_not_specialize=["R"])
def _grad_input_kernel(g_ptr, x_ptr, y_ptr, dx_ptr, dr_ptr, mean_ptr, invstd_ptr, w_ptr,
                       sums_ptr, R, C, RELU: tl.constexpr, HAS_R: tl.constexpr,
                       HAS_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                       ACC: tl.constexpr):
    # dx; with HAS_R also the residual's gradient (the masked g itself)
    offs, mask, cols, cmask = _row_tile(R, C, BLOCK_R, BLOCK_C)
    mean = tl.load(mean_ptr + cols, mask=cmask, other=0.0)
    invstd = tl.load(invstd_ptr + cols, mask=cmask, other=0.0)
    mean_g = tl.load(sums_ptr + cols, mask=cmask, other=0.0) / R
    proj = tl.load(sums_ptr + C + cols, mask=cmask, other=0.0) / R * invstd * invstd
    scale = _channel_scale(invstd_ptr, w_ptr, cols, cmask, HAS_W, ACC)
    g = _masked_grad(g_ptr, y_ptr, offs, mask, RELU, ACC)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(ACC)
    dx = (g - mean_g[None, :] - (x - mean[None, :]) * proj[None, :]) * scale[None, :]
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_R:
        tl.store(dr_ptr + offs, g.to(dr_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Host
# ----------------------------------------------------------------------------------------------
MERGE = dict(BLOCK_P=64, BLOCK_C=32, num_warps=4)  # the merges: 64 partials x 32 columns a tile
WARPS = 8  # the passes over the activation: 4,096 values a tile, 16 a thread


def supports(x: torch.Tensor) -> bool:
    """Whether ``batch_norm_train`` takes ``x``: a dense channels_last_3d 5-D tensor (or a 4-D
    channels-last one) of fp32 / bf16 / fp16 / fp64 with 2 <= C <= MAX_C, whose rows fit int32
    tiles, on CUDA or (under the interpreter) the CPU."""
    if x.dim() not in (4, 5) or x.dtype not in DTYPES or not 2 <= x.shape[1] <= MAX_C:
        return False
    fmt = torch.channels_last_3d if x.dim() == 5 else torch.channels_last
    if not x.is_contiguous(memory_format=fmt):  # (also contiguous where T = H = W = 1)
        return False
    return 0 < x.numel() < 2 ** 31 and (x.is_cuda or (INTERPRETED and x.device.type == "cpu"))


def _merge_grid(c):
    return (triton.cdiv(c, MERGE["BLOCK_C"]),)


def _acc(x):
    """(torch, triton) dtype the kernels compute and keep statistics in: fp64 for fp64 input
    (the tests' exact comparisons), fp32 otherwise."""
    return (torch.float64, tl.float64) if x.dtype == torch.float64 else (torch.float32,
                                                                           tl.float32)


def _forward(x, weight, bias, running_mean, running_var, momentum, eps, residual=None,
             relu=False):
    r, c = x.numel() // x.shape[1], x.shape[1]
    block_c, block_r = _blocks(c)
    per, slabs = _slabs(r, block_r)
    acc, acc_tl = _acc(x)
    stats = dict(dtype=acc, device=x.device)
    part = torch.empty(slabs, 2 * c, **stats)
    mean, invstd = torch.empty(c, **stats), torch.empty(c, **stats)
    y = torch.empty_like(x)  # the same (channels-last) layout
    _stats_partial_kernel[(slabs,)](x, part, r, c, per, BLOCK_R=block_r, BLOCK_C=block_c,
                                    ACC=acc_tl, num_warps=WARPS)
    update = running_mean is not None
    _stats_merge_kernel[_merge_grid(c)](
        part, mean, invstd, running_mean if update else mean, running_var if update else invstd,
        r, c, slabs, per, float(momentum), float(eps), UPDATE=update, ACC=acc_tl, **MERGE)
    _normalise_kernel[(triton.cdiv(r, block_r),)](
        x, y, mean, invstd, weight if weight is not None else mean,
        bias if bias is not None else mean, residual if residual is not None else x, r, c,
        HAS_W=weight is not None, HAS_B=bias is not None, HAS_R=residual is not None,
        RELU=relu, BLOCK_R=block_r, BLOCK_C=block_c, ACC=acc_tl, num_warps=WARPS)
    return y, mean, invstd


def _backward(g, x, y, mean, invstd, weight, has_residual=False, relu=False):
    r, c = x.numel() // x.shape[1], x.shape[1]
    block_c, block_r = _blocks(c)
    per, slabs = _slabs(r, block_r)
    acc, acc_tl = _acc(x)
    part = torch.empty(slabs, 2 * c, dtype=acc, device=x.device)
    sums = torch.empty(2 * c, dtype=acc, device=x.device)
    y = y if relu else g  # (read only with RELU)
    _grad_partial_kernel[(slabs,)](g, x, y, mean, part, r, c, per, RELU=relu,
                                   BLOCK_R=block_r, BLOCK_C=block_c, ACC=acc_tl,
                                   num_warps=WARPS)
    _grad_merge_kernel[_merge_grid(c)](part, sums, r, c, slabs, per, ACC=acc_tl, **MERGE)
    dx = torch.empty_like(x)
    dr = torch.empty_like(g) if has_residual else None
    _grad_input_kernel[(triton.cdiv(r, block_r),)](
        g, x, y, dx, dr if dr is not None else dx, mean, invstd,
        weight if weight is not None else mean, sums, r, c, RELU=relu, HAS_R=has_residual,
        HAS_W=weight is not None, BLOCK_R=block_r, BLOCK_C=block_c, ACC=acc_tl,
        num_warps=WARPS)
    dw = sums[c:] * invstd if weight is not None else None
    db = sums[:c].clone()
    return dx, dw, db, dr


class _BatchNormTrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, residual, relu):
        y, mean, invstd = _forward(x, weight, bias, running_mean, running_var, momentum, eps,
                                   residual, relu)
        # with a ReLU its output is the mask of the backward: saved, so an in-place change of
        # it before the backward is an error (autograd's version check), not a wrong gradient
        ctx.save_for_backward(x, weight, mean, invstd, y if relu else None)
        ctx.has_bias, ctx.has_residual, ctx.relu = bias is not None, residual is not None, relu
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x, weight, mean, invstd, y = ctx.saved_tensors
        fmt = torch.channels_last_3d if x.dim() == 5 else torch.channels_last
        gy = gy.contiguous(memory_format=fmt)  # a no-op when it already is
        need = ctx.needs_input_grad
        dx, dw, db, dr = _backward(gy, x, y, mean, invstd, weight,
                                   ctx.has_residual and need[7], ctx.relu)
        dw = dw.to(weight.dtype) if weight is not None else None
        db = db.to(weight.dtype if weight is not None else db.dtype) if ctx.has_bias else None
        return (dx if need[0] else None, dw if need[1] else None, db if need[2] else None,
                None, None, None, None, dr, None)


def batch_norm_train(x, weight, bias, running_mean, running_var, momentum, eps, residual=None,
                     relu=False):
    """Training-mode batch norm of ``x`` (see ``supports``) with the batch's statistics,
    updating ``running_mean`` / ``running_var`` in place when given (momentum ``momentum``,
    the unbiased variance, as PyTorch), then (fused into the same pass) ``+ residual`` (a
    tensor of x's shape, dtype and layout; the sum rounded as ``bn(x) + residual`` in that
    dtype) and a ReLU when asked; differentiable in x, weight, bias and residual, once (no
    double backward). The output has x's layout and dtype and is a tensor of its own (not a
    view)."""
    if not supports(x):
        raise ValueError(f"kernels.triton_batchnorm: a dense channels-last fp32/bf16/fp16/fp64 "
                         f"tensor with 2..{MAX_C} channels on CUDA is needed, got "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}")
    if residual is not None and not fits(residual, x):
        raise ValueError(f"kernels.triton_batchnorm: the residual must have the input's shape, "
                         f"dtype, device and layout, got {tuple(residual.shape)} "
                         f"{residual.dtype} against {tuple(x.shape)} {x.dtype}")
    if x.numel() // x.shape[1] < 2:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size "
                         f"{list(x.shape)}")
    return _BatchNormTrain.apply(x, weight, bias, running_mean, running_var, momentum, eps,
                                 residual, bool(relu))


def fits(residual: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``residual`` can be added in ``batch_norm_train``'s pass over ``x``: the same
    shape, dtype, device and strides (x being one ``supports`` takes)."""
    return (residual.shape == x.shape and residual.dtype == x.dtype
            and residual.device == x.device and residual.stride() == x.stride())
