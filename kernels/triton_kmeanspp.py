"""Fused k-means++ seeding (docs/DESIGN.md §1 steps 4-5) over factored embeddings
g = alpha (x) beta.

Distances use the factored algebra with an optional centre-side factor beta_c (the head view's
Gram route, kernels/reference.py ``select_factors``; beta_c = beta otherwise):

    ||g_n - g_c||^2 = sqn_n + sqn_c - 2 (a_n . a_c)(b_n . bc_c)        sqn_n = |g_n|^2

State on the device, sized by the pool's CAPACITY (rows >= n, the valid count read from device
memory, are never drawn): D [cap] fp32 (min squared distance to the chosen centres; -1 marks a
chosen, excluded, padding or non-finite candidate), picks [k] and two ping-pong buffers of
per-block partials. Four variants of the k steps:

* ``steps`` (any GPU, the interpreter, the fallback): step t is ONE launch of
  ``_kmeanspp_step_kernel`` over BLOCK_N-row blocks, k + 1 launches per seeding:
    1. prefetch this block's first factor chunks, |g_n|^2 and D_n (independent of the centre);
    2. (t > 0) finish step t-1's draw: every program reduces the P partials of step t-1 to
       the same centre c (largest score, smallest index on ties); program 0 stores picks[t-1];
    3. (t > 0) D_n <- min(D_n, d(n, c)) (clamped >= 0), D_c <- -1;  (t = 0) D_n <- +inf, or -1
       if n >= n_valid, excluded, or |g_n|^2 is not finite (NaN / Inf: never drawn);
    4. exponential race E_n = -log U(seed, t, n), U the integer hash of kernels/reference.py
       bit for bit:  score_n = D_n / E_n if D_n > 0;  -E_n if D_n == 0 (or t == 0: a uniform
       draw);  -inf if D_n < 0. Each program writes (max score, first index) to partials[t % 2].
  A last one-program launch (``_kmeanspp_pick_kernel``) reduces step k-1's partials.
* ``persistent`` (CUDA only): ONE cooperative launch of ``_kmeanspp_persistent_kernel``, one
  program per SM looping over its blocks, a grid-wide barrier (an atomic counter) between steps.
  The interpreter runs programs one after another, so a barrier would hang there: this variant
  is never run under TRITON_INTERPRET=1 (kernels/triton_select.py picks ``steps`` there).
* ``lazy`` (any GPU, the interpreter): the lazy exponential race of kernels/lazy_kmeanspp.py,
  the same draws. Steps 0 and 1 are the ``steps`` kernel's (step 1 is the one full pass); then
  each step t is three launches (bound, top, draw) that read the [cap] D vector but only a few
  candidates' factors: kernels/triton_lazy.py has the kernels and why the draw is the eager one.
* ``resident`` (issue 48; pools that fit on chip, ``resident_config``): ONE cooperative launch
  of ``_kmeanspp_resident_kernel``, at most one program per SM, each owning a fixed block of
  rows whose factors, |g_n|^2 and D stay in registers for all k rounds; the draw is one int64
  atomic max of (score, -index) keys per program and one grid barrier. Under the interpreter
  its per-round twin runs instead. kernels/triton_resident.py has the kernels, the fit rule and
  the math.

The argmax of D_n / E_n with E_n ~ Exp(1) is a draw with probability D_n / sum D (the
exponential race), so the law is exactly k-means++'s. Every reduction that decides a pick is a
max/min over values, never a float atomic; ties go to the smallest index as ``torch.argmax``.
The kernels are compiled with ``enable_fp_fusion=False``: no multiply-add contraction, so the
element-wise arithmetic rounds as PyTorch's eager ops do. Dot products still sum in a different
order than the reference's matrix-vector products, so two scores equal to ~1e-7 relative could
order differently; the tests check index equality on thousands of draws.

This file holds the ``steps`` and ``persistent`` kernels and what the variants share on the
host (``seeding_config``, the ``launch_seeding`` dispatch, ``kmeanspp_triton``); the device
pieces every variant shares (the RNG, the partial reductions, the grid barrier) are in
kernels/triton_race.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from .triton_lazy import _launch_lazy
from .triton_race import (INTERPRETED, NO_FMA, _best_of_partials, _grid_barrier, _reduce,
                          _reduced, _uniform, uniform_hash_triton)
from .triton_resident import (_aligned_words, _launch_resident, _resident_seeding_config,
                              factor_words, resident_config)

__all__ = ["kmeanspp_triton", "uniform_hash_triton", "launch_seeding", "seeding_config",
           "resident_config", "factor_words", "INTERPRETED", "VARIANTS"]

VARIANTS = ("steps", "persistent", "lazy", "resident")


# ----------------------------------------------------------------------------------------------
# One block of one step (steps, persistent, the lazy race's first two steps)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _dot_chunk(x_ptr, stride_xn, offs_n64, mask_n, c, x0, X, BLOCK_X: tl.constexpr):
    # sum_j x[n, x0 + j] * xc[c, x0 + j] over one column chunk -> [BLOCK_N] fp32
    offs_x = x0 + tl.arange(0, BLOCK_X)
    mask_x = offs_x < X
    x = tl.load(x_ptr + offs_n64[:, None] * stride_xn + offs_x[None, :],
                mask=mask_n[:, None] & mask_x[None, :], other=0.0).to(tl.float32)
    xc = tl.load(x_ptr + c * stride_xn + offs_x, mask=mask_x, other=0.0).to(tl.float32)
    return tl.sum(x * xc[None, :], axis=1)


@triton.jit
def _step_block(
    a_ptr, b_ptr, bc_ptr, sqn_ptr, dmin_ptr, excl_ptr, seed, n_valid, c, t, offs_n,
    A, B, stride_an, stride_bn, stride_bcn,
    FIRST, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
):
    # D update against centre c (t > 0) or the initial D (t == 0), then the race scores of
    # this block. Returns (score [BLOCK_N]). c is int64; FIRST may be a runtime bool.
    mask_n = offs_n < n_valid
    offs_n64 = offs_n.to(tl.int64)
    sqn = tl.load(sqn_ptr + offs_n, mask=mask_n, other=0.0)  # |g_n|^2
    if FIRST:
        excl = tl.load(excl_ptr + offs_n, mask=mask_n, other=1)
        finite = (sqn == sqn) & (tl.abs(sqn) < float("inf"))
        dmin = tl.where(mask_n & (excl == 0) & finite, float("inf"), -1.0)
    else:
        # first chunks issued before anything that needs the centre's row
        offs_a = tl.arange(0, BLOCK_A)
        offs_b = tl.arange(0, BLOCK_B)
        x = tl.load(a_ptr + offs_n64[:, None] * stride_an + offs_a[None, :],
                    mask=mask_n[:, None] & (offs_a < A)[None, :], other=0.0).to(tl.float32)
        y = tl.load(b_ptr + offs_n64[:, None] * stride_bn + offs_b[None, :],
                    mask=mask_n[:, None] & (offs_b < B)[None, :], other=0.0).to(tl.float32)
        dmin = tl.load(dmin_ptr + offs_n, mask=mask_n, other=-1.0)
        xc = tl.load(a_ptr + c * stride_an + offs_a, mask=offs_a < A, other=0.0).to(tl.float32)
        yc = tl.load(bc_ptr + c * stride_bcn + offs_b, mask=offs_b < B,
                     other=0.0).to(tl.float32)
        dot_a = tl.sum(x * xc[None, :], axis=1)  # a_n . a_c
        dot_b = tl.sum(y * yc[None, :], axis=1)  # b_n . bc_c
        for a0 in range(BLOCK_A, A, BLOCK_A):  # wider factors: the remaining chunks
            dot_a += _dot_chunk(a_ptr, stride_an, offs_n64, mask_n, c, a0, A, BLOCK_A)
        for b0 in range(BLOCK_B, B, BLOCK_B):
            offs_x = b0 + tl.arange(0, BLOCK_B)
            mask_x = offs_x < B
            yy = tl.load(b_ptr + offs_n64[:, None] * stride_bn + offs_x[None, :],
                         mask=mask_n[:, None] & mask_x[None, :], other=0.0).to(tl.float32)
            yyc = tl.load(bc_ptr + c * stride_bcn + offs_x, mask=mask_x,
                          other=0.0).to(tl.float32)
            dot_b += tl.sum(yy * yyc[None, :], axis=1)
        sqc = tl.load(sqn_ptr + c)  # |g_c|^2
        d = tl.maximum(sqn + sqc - 2.0 * (dot_a * dot_b), 0.0)
        dmin = tl.where(dmin >= 0, tl.minimum(dmin, d), dmin)
        dmin = tl.where(offs_n == c, -1.0, dmin)
    tl.store(dmin_ptr + offs_n, dmin, mask=mask_n)
    e = -tl.log(_uniform(seed, t, offs_n))  # E_n ~ Exp(1), E_n > 0
    if FIRST:
        score = -e
    else:
        score = tl.where(dmin > 0, tl.math.div_rn(dmin, e), -e)  # IEEE division, as torch
    return tl.where((dmin >= 0) & mask_n, score, float("-inf"))


# ----------------------------------------------------------------------------------------------
# Variant "steps": one launch per step
# ----------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["t"])
def _kmeanspp_step_kernel(
    a_ptr, b_ptr, bc_ptr, sqn_ptr, dmin_ptr, excl_ptr, n_ptr, picks_ptr, seed_ptr,
    part_score_ptr, part_idx_ptr,
    A, B, P, R0, RP, t,
    stride_an, stride_bn, stride_bcn,
    FIRST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    # Step t (module docstring): c = argmax of step t-1's partials (t > 0), picks[t-1] = c;
    # D update; race; partials[t % 2][pid] = (max score, first index reaching it)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] candidate rows
    n_valid = tl.load(n_ptr)
    seed = tl.load(seed_ptr).to(tl.uint32)  # folded to 32 bits on the host (reference.seed32)
    c = 0
    if not FIRST:
        prev = R0 + ((t - 1) % 2) * RP  # the RP partials step t-1 reduced to (one or two levels)
        c = _best_of_partials(part_score_ptr + prev, part_idx_ptr + prev, RP, BLOCK_P)
        tl.store(picks_ptr + t - 1, c.to(tl.int64), mask=pid == 0)
    score = _step_block(a_ptr, b_ptr, bc_ptr, sqn_ptr, dmin_ptr, excl_ptr, seed, n_valid,
                        tl.cast(c, tl.int64), t, offs_n, A, B, stride_an, stride_bn, stride_bcn,
                        FIRST, BLOCK_A, BLOCK_B)
    best = tl.max(score, axis=0)
    best_n = tl.argmax(score, axis=0, tie_break_left=True) + pid * BLOCK_N
    cur = (t % 2) * P
    tl.store(part_score_ptr + cur + pid, best)
    tl.store(part_idx_ptr + cur + pid, best_n.to(tl.int32))


@triton.jit(do_not_specialize=["t"])
def _kmeanspp_pick_kernel(part_score_ptr, part_idx_ptr, picks_ptr, R0, RP, t,
                          BLOCK_P: tl.constexpr):
    # the last draw: picks[t] = argmax over step t's RP (reduced) partials (one program)
    cur = R0 + (t % 2) * RP
    c = _best_of_partials(part_score_ptr + cur, part_idx_ptr + cur, RP, BLOCK_P)
    tl.store(picks_ptr + t, c.to(tl.int64))


# ----------------------------------------------------------------------------------------------
# Variant "persistent": one cooperative launch, a grid barrier per step (CUDA only)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _kmeanspp_persistent_kernel(
    a_ptr, b_ptr, bc_ptr, sqn_ptr, dmin_ptr, excl_ptr, n_ptr, picks_ptr, seed_ptr,
    part_score_ptr, part_idx_ptr, bar_ptr,
    A, B, K,
    stride_an, stride_bn, stride_bcn,
    BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr,
):
    # G programs (co-resident: cooperative launch); program pid owns blocks pid, pid + G, ...
    # step t: c from the G partials of step t-1; D update + race over its blocks; its partial;
    # grid barrier. bar_ptr counts arrivals and must be 0 at launch.
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    n_valid = tl.load(n_ptr)
    seed = tl.load(seed_ptr).to(tl.uint32)
    n_blocks = tl.cdiv(n_valid, BLOCK_N)
    for t in range(0, K):
        c = tl.zeros((), dtype=tl.int32)
        if t > 0:
            prev = ((t - 1) % 2) * G
            c = _best_of_partials(part_score_ptr + prev, part_idx_ptr + prev, G, BLOCK_P)
            tl.store(picks_ptr + t - 1, c.to(tl.int64), mask=pid == 0)
        best = float("-inf")
        best_n = 2147483647
        for blk in range(pid, n_blocks, G):
            offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            score = _step_block(a_ptr, b_ptr, bc_ptr, sqn_ptr, dmin_ptr, excl_ptr, seed,
                                n_valid, c.to(tl.int64), t, offs_n, A, B, stride_an, stride_bn,
                                stride_bcn, t == 0, BLOCK_A, BLOCK_B)
            s = tl.max(score, axis=0)
            i = tl.argmax(score, axis=0, tie_break_left=True) + blk * BLOCK_N
            take = s > best  # blocks ascend: an equal score keeps the smaller index
            best_n = tl.where(take, i, best_n)
            best = tl.where(take, s, best)
        cur = (t % 2) * G
        tl.store(part_score_ptr + cur + pid, best)
        tl.store(part_idx_ptr + cur + pid, best_n.to(tl.int32))
        _grid_barrier(bar_ptr, (t + 1) * G)
    last = ((K - 1) % 2) * G
    c = _best_of_partials(part_score_ptr + last, part_idx_ptr + last, G, BLOCK_P)
    tl.store(picks_ptr + K - 1, c.to(tl.int64), mask=pid == 0)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------
# Partials one program reduces: a grid of more blocks than this (N > 131,072 at 128 rows a block)
# reduces its per-block maxima in two levels (``_reduce_partials_kernel``), so no program holds
# more than a [GROUP] tile of them.
GROUP = 1024


def seeding_config(capacity: int, a: int, b: int, variant: str = "steps",
                   block_n: int | None = None, device=None, sms: int | None = None,
                   group: int | None = None, factors=torch.float32,
                   cooperative: bool | None = None) -> dict:
    """Tile sizes, warps and grid of one seeding. Under the interpreter: few, large programs
    (it is slow per program). On GPU: [128, <=64]-wide fp32 chunks, the first one of each
    factor prefetched before the centre is known (ptxas figures in bench/RESULTS.md).
    ``group``: the most per-block partials one program reduces; a larger grid reduces them in
    two levels (``P2`` level-2 partials; tests pass a small group to reach it). ``partials``:
    the size of each partials buffer. Resident variant: ``factors`` (the factor dtype) and
    ``cooperative`` (the one persistent launch; default: on a GPU; False: the per-round twin)
    (``resident_config``; a pool that does not fit on chip is a ValueError)."""
    if variant not in VARIANTS:
        raise ValueError(f"kmeanspp: variant {variant!r} is not one of {VARIANTS}")
    if variant == "resident":
        return _resident_seeding_config(capacity, a, b, factors, device, sms, cooperative)
    chunk = 128 if INTERPRETED else 64
    if INTERPRETED:
        bn, warps = max(16, min(1024, triton.next_power_of_2(capacity))), 4
    else:
        bn, warps = 128, 8
    bn = block_n or bn
    cfg = dict(BLOCK_N=bn, BLOCK_A=max(16, min(chunk, triton.next_power_of_2(a))),
               BLOCK_B=max(16, min(chunk, triton.next_power_of_2(b))), num_warps=warps)
    if variant == "lazy":  # centres per chunk when a row is brought up to date: on a GPU a
        # stale row's refresh is a chain of dependent loads per chunk, so few, wide chunks
        cfg["BLOCK_C"] = 16 if INTERPRETED else 64
    if variant == "persistent":
        if INTERPRETED:
            raise ValueError("kmeanspp: the persistent variant needs a GPU (its grid barrier "
                             "would hang the Triton interpreter); use variant='steps'")
        if sms is None:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
        cfg["grid"] = min(sms, triton.cdiv(capacity, bn))
    else:
        cfg["grid"] = triton.cdiv(capacity, bn)
    p = cfg["grid"]
    group = triton.next_power_of_2(group or GROUP)
    two = variant != "persistent" and p > group  # persistent: one partial per SM
    cfg["P2"] = triton.cdiv(p, group) if two else None
    cfg["GROUP"] = group if two else None
    cfg["BLOCK_P"] = max(16, triton.next_power_of_2(cfg["P2"] or p))
    cfg["partials"] = 2 * (p + (cfg["P2"] or 0))
    return cfg


def launch_seeding(a, b, bc, sqn, dmin, excl, n_t, picks, seed_t, part_score, part_idx, bar,
                   k: int, cfg: dict, variant: str = "steps", seen=None, thr=None, best=None):
    """The launches of one seeding over capacity-shaped buffers (a fixed sequence for a given
    configuration: graph-capturable). a [cap, A], b / bc [cap, B] (any float dtype, row-major
    rows), sqn / dmin [cap] fp32, excl [cap] uint8/bool, n_t [1] int32 (valid rows),
    picks [k] int64, seed_t [1] int64, part_score / part_idx [cfg["partials"]], bar [1] int32
    (zeroed here; persistent variant only). Lazy variant only: seen int32 [cap + 1] (the
    centres applied to each D; the last entry: the step's top candidate), thr [1] fp32.
    Resident variant only: best int64 [k] (the rounds' race keys; filled here), and bf16
    factors with 4-byte aligned rows (``factor_words``)."""
    p = cfg["grid"]
    if variant == "resident":
        _launch_resident(a, b, bc, sqn, dmin, excl, n_t, picks, seed_t, best, bar, k, cfg)
        return
    tiles = dict(BLOCK_N=cfg["BLOCK_N"], BLOCK_A=cfg["BLOCK_A"], BLOCK_B=cfg["BLOCK_B"],
                 BLOCK_P=cfg["BLOCK_P"])
    strides = (a.stride(0), b.stride(0), bc.stride(0))
    if variant == "persistent":
        bar.zero_()
        _kmeanspp_persistent_kernel[(p,)](
            a, b, bc, sqn, dmin, excl, n_t, picks, seed_t, part_score, part_idx, bar,
            a.shape[1], b.shape[1], k, *strides,
            num_warps=cfg["num_warps"], launch_cooperative_grid=True, **NO_FMA, **tiles)
        return
    r0, rp = _reduced(cfg)
    for t in range(min(k, 2) if variant == "lazy" else k):
        _kmeanspp_step_kernel[(p,)](
            a, b, bc, sqn, dmin, excl, n_t, picks, seed_t, part_score, part_idx,
            a.shape[1], b.shape[1], p, r0, rp, t, *strides,
            FIRST=(t == 0), num_warps=cfg["num_warps"], **NO_FMA, **tiles)
        _reduce(part_score, part_idx, t, cfg)
    if variant == "lazy":
        _launch_lazy(a, b, bc, sqn, dmin, n_t, picks, seed_t, part_score, part_idx, seen, thr,
                     k, cfg)
    _kmeanspp_pick_kernel[(1,)](part_score, part_idx, picks, r0, rp, k - 1,
                                BLOCK_P=tiles["BLOCK_P"], **NO_FMA)


def kmeanspp_triton(
    alpha: torch.Tensor,  # [N, a]
    beta: torch.Tensor,  # [N, b]
    k: int,
    *,
    seed: int,
    exclude: torch.Tensor | None = None,  # bool [N]
    validate: bool = True,
    beta_c: torch.Tensor | None = None,  # [N, b] centre-side factor (Gram route)
    sqn: torch.Tensor | None = None,  # [N] |g_n|^2, if the caller has it
    block_n: int | None = None,
    variant: str = "steps",
    stats: dict | None = None,
    group: int | None = None,
    sms: int | None = None,
    cooperative: bool | None = None,
) -> torch.Tensor:
    """Drop-in for ``reference.kmeanspp``: long [k] distinct indices, the reference's draws for
    the same seed; non-finite |g_n|^2 candidates are never drawn, as in the reference. Factors of
    any float dtype (computed on in fp32). Eager launches into buffers allocated per call: the
    selection hot path uses kernels/triton_select.py (capacity-shaped buffers, one CUDA graph).
    ``block_n``: rows per program (tests use it to make the cross-block reduction decide picks),
    ``group``: partials per program of the reduction (a small one reaches its two levels).
    ``validate=True`` syncs once to count the eligible candidates, as the reference does.
    ``stats`` (lazy variant), if given, receives ``refreshed``: the candidates brought up to
    date after the first full pass (a host sync). Resident variant: ``sms`` (its programs: the
    SMs, or INTERPRETED_SMS under the interpreter), ``cooperative`` (False: the per-round
    twin); bf16 factors of odd width are copied with a zero column."""
    reference._check_factors(alpha, beta, beta_c, sqn)
    n = alpha.shape[0]
    reference._check_kmeanspp_args(n, k, exclude, alpha.device, validate=False)
    dev = alpha.device
    a = alpha if alpha.stride(1) == 1 else alpha.contiguous()  # [N, a]
    b = beta if beta.stride(1) == 1 else beta.contiguous()  # [N, b]
    bc = b if beta_c is None else (beta_c if beta_c.stride(1) == 1 else beta_c.contiguous())
    if n * max(a.stride(0), b.stride(0), bc.stride(0), 1) >= 2**31:
        raise ValueError(f"kmeanspp (triton): alpha {tuple(a.shape)} / beta {tuple(b.shape)} "
                         "span >= 2^31 elements; split the pool or use CMACC_KERNELS=reference")
    if sqn is None:  # |a_n|^2 (b_n . bc_n), exactly as the reference
        sqn = reference._sqnorm(a.float(), b.float(), bc.float())  # [N]
    sqn = sqn.float().contiguous()
    excl = (torch.zeros(n, dtype=torch.uint8, device=dev) if exclude is None
            else exclude.to(device=dev, dtype=torch.uint8).contiguous())
    if validate:  # one host sync, as the reference: excluded and non-finite are not eligible
        reference._check_kmeanspp_args(n, k, excl != 0, dev, True,
                                       nonfinite=~torch.isfinite(sqn))
    cfg = seeding_config(n, a.shape[1], b.shape[1], variant, block_n, dev, sms=sms, group=group,
                         factors=a.dtype, cooperative=cooperative)
    if variant == "resident":
        if not a.dtype == b.dtype == bc.dtype:
            raise ValueError("kmeanspp: the resident variant needs one factor dtype")
        a, b, bc = (_aligned_words(x) for x in (a, b, bc))
    # fill kernels, not host-to-device copies (a blocking copy would synchronise the stream)
    n_t = torch.full((1,), n, dtype=torch.int32, device=dev)
    seed_t = torch.full((1,), reference.seed32(seed), dtype=torch.int64, device=dev)
    picks = torch.empty(k, dtype=torch.int64, device=dev)  # [k]
    dmin = torch.empty(n, device=dev, dtype=torch.float32)  # [N]
    part_score = torch.empty(cfg["partials"], device=dev, dtype=torch.float32)  # ping-pong
    part_idx = torch.empty(cfg["partials"], device=dev, dtype=torch.int32)
    bar = torch.zeros(1, device=dev, dtype=torch.int32)
    seen = torch.empty(n + 1, device=dev, dtype=torch.int32) if variant == "lazy" else None
    thr = torch.empty(1, device=dev, dtype=torch.float32) if variant == "lazy" else None
    best = torch.empty(k, device=dev, dtype=torch.int64) if variant == "resident" else None
    launch_seeding(a, b, bc, sqn, dmin, excl, n_t, picks, seed_t, part_score, part_idx, bar, k,
                   cfg, variant, seen, thr, best)
    if stats is not None and seen is not None:
        stats["refreshed"] = int((seen[:n] > 1).sum())
    return picks
