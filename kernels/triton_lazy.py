"""The ``lazy`` k-means++ variant (any GPU, the interpreter): the lazy exponential race of
kernels/lazy_kmeanspp.py on the GPU, the same draws as the eager ``steps`` variant
(kernels/triton_kmeanspp.py, which dispatches here). Steps 0 and 1 are the ``steps`` kernel's
(step 1 is the one full pass); then each step t is three launches that read the [cap] D vector
but only a few candidates' factors:

  1. ``_lazy_bound_kernel`` (grid): finish step t-1's draw (picks[t-1] = c, D_c <- -1); each
     block's largest bound D_stale / (1 - U) (D only decreases and E >= 1 - U, so it bounds
     the true score from above) -> partials;
  2. ``_lazy_top_kernel`` (one program): the candidate of the largest bound is brought up to
     date (its distances to the centres it has not seen: ``seen`` [cap] counts the centres
     applied to each D), its true score s gives the threshold thr = s (1 - 2^-20);
  3. ``_lazy_draw_kernel`` (grid): every candidate whose bound reaches thr -- a
     data-dependent set, ~1-10 a step, usually none in a block -- is brought up to date one
     by one (a loop whose trip count is the block's count), and each block writes its best
     true score -> partials, drawn by the next step's launch 1 (or the last pick).

A candidate left stale has true score <= bound < thr <= s, so the draw is the eager one's.
The distances of a row are the eager kernel's (same chunks and products), so D matches it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_race import NO_FMA, _best_of_partials, _reduce, _reduced, _uniform

LAZY_WARPS = 4  # the lazy race's refresh launches (8 spilled more: 24-32 B against 8-20 B)


# ----------------------------------------------------------------------------------------------
# Variant "lazy": the lazy exponential race (kernels/lazy_kmeanspp.py) on the GPU
# ----------------------------------------------------------------------------------------------
@triton.jit
def _dot_centres(x_ptr, xc_ptr, stride_xn, stride_xcn, row64, cidx, mask_c, X,
                 BLOCK_X: tl.constexpr, BLOCK_C: tl.constexpr):
    # x[row] . xc[c] for BLOCK_C centres c, over column chunks of BLOCK_X -> [BLOCK_C] fp32
    offs_x = tl.arange(0, BLOCK_X)
    dot = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for x0 in range(0, X, BLOCK_X):
        mx = (x0 + offs_x) < X
        x = tl.load(x_ptr + row64 * stride_xn + x0 + offs_x, mask=mx, other=0.0).to(tl.float32)
        xc = tl.load(xc_ptr + cidx[:, None] * stride_xcn + (x0 + offs_x)[None, :],
                     mask=mask_c[:, None] & mx[None, :], other=0.0).to(tl.float32)
        dot += tl.sum(xc * x[None, :], axis=1)
    return dot


@triton.jit
def _refresh_row(a_ptr, b_ptr, bc_ptr, sqn_ptr, dmin_ptr, seen_ptr, picks_ptr, row, t,
                 A, B, stride_an, stride_bn, stride_bcn,
                 BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr):
    # D[row] <- min(D[row], d(row, c)) over the centres c = picks[seen[row]], ..., picks[t-1] it
    # has not seen, BLOCK_C centres at a time (a [BLOCK_C, BLOCK_A] tile of centre rows against
    # the row); seen[row] <- t. Returns the new D[row]. The dot products are the eager kernel's
    # (same chunks, same products, one sum per chunk), so D equals the eager D bit for bit.
    # A row at D <= 0 (zero: it stays zero; -1: chosen / unavailable) needs nothing.
    row64 = row.to(tl.int64)
    dmin = tl.load(dmin_ptr + row)
    sqn = tl.load(sqn_ptr + row)  # |g_row|^2
    first = tl.where(dmin > 0, tl.load(seen_ptr + row), t)
    for j0 in range(first, t, BLOCK_C):
        offs_c = j0 + tl.arange(0, BLOCK_C)
        mask_c = offs_c < t
        cidx = tl.load(picks_ptr + offs_c, mask=mask_c, other=0)  # [BLOCK_C] int64 centres
        dot_a = _dot_centres(a_ptr, a_ptr, stride_an, stride_an, row64, cidx, mask_c, A,
                             BLOCK_A, BLOCK_C)  # a_row . a_c
        dot_b = _dot_centres(b_ptr, bc_ptr, stride_bn, stride_bcn, row64, cidx, mask_c, B,
                             BLOCK_B, BLOCK_C)  # b_row . bc_c
        sqc = tl.load(sqn_ptr + cidx, mask=mask_c, other=0.0)  # |g_c|^2
        d = tl.maximum(sqn + sqc - 2.0 * (dot_a * dot_b), 0.0)
        dmin = tl.minimum(dmin, tl.min(tl.where(mask_c, d, float("inf")), axis=0))
    tl.store(dmin_ptr + row, dmin)
    tl.store(seen_ptr + row, t)
    return dmin


@triton.jit
def _race_score(dmin, seed, t, offs_n):
    # the eager kernel's race score of up-to-date candidates (D >= 0): D / E, or -E at D == 0
    e = -tl.log(_uniform(seed, t, offs_n))
    return tl.where(dmin > 0, tl.math.div_rn(dmin, e), -e)


@triton.jit
def _race_bound(dmin, seed, t, offs_n):
    # an upper bound of the race score from a stale D (D only decreases, E = -log U >= 1 - U);
    # -inf for chosen / unavailable rows (D < 0)
    u = _uniform(seed, t, offs_n)
    return tl.where(dmin >= 0, tl.math.div_rn(dmin, 1.0 - u), float("-inf"))


@triton.jit(do_not_specialize=["t"])
def _lazy_bound_kernel(dmin_ptr, n_ptr, picks_ptr, seed_ptr, part_score_ptr, part_idx_ptr,
                       P, R0, RP, t, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr):
    # lazy step t >= 2, launch 1 of 3 (grid): c = the draw of step t-1 (its partials), picks[t-1]
    # = c, D_c <- -1; then this block's largest bound D_stale / (1 - U) and its first index ->
    # partials[t % 2]
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < tl.load(n_ptr)
    seed = tl.load(seed_ptr).to(tl.uint32)
    prev = R0 + ((t - 1) % 2) * RP
    c = _best_of_partials(part_score_ptr + prev, part_idx_ptr + prev, RP, BLOCK_P)
    tl.store(picks_ptr + t - 1, c.to(tl.int64), mask=pid == 0)
    dmin = tl.load(dmin_ptr + offs_n, mask=mask_n, other=-1.0)
    dmin = tl.where(offs_n == c, -1.0, dmin)
    tl.store(dmin_ptr + offs_n, dmin, mask=mask_n & (offs_n == c))
    bound = tl.where(mask_n, _race_bound(dmin, seed, t, offs_n), float("-inf"))
    cur = (t % 2) * P
    tl.store(part_score_ptr + cur + pid, tl.max(bound, axis=0))
    best_n = tl.argmax(bound, axis=0, tie_break_left=True) + pid * BLOCK_N
    tl.store(part_idx_ptr + cur + pid, best_n.to(tl.int32))


@triton.jit(do_not_specialize=["t"])
def _lazy_top_kernel(
    a_ptr, b_ptr, bc_ptr, sqn_ptr, dmin_ptr, seen_ptr, picks_ptr, seed_ptr,
    part_score_ptr, part_idx_ptr, thr_ptr, R0, RP, t, cap,
    A, B, stride_an, stride_bn, stride_bcn,
    BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
):
    # launch 2 of 3 (one program): top = the largest bound (launch 1's partials); bring it up to
    # date; its true score s lower-bounds step t's draw: thr = s less a 2^-20 slack (a logarithm
    # rounded below 1 - U), and seen[cap] = top
    cur = R0 + (t % 2) * RP
    top = _best_of_partials(part_score_ptr + cur, part_idx_ptr + cur, RP, BLOCK_P)
    seed = tl.load(seed_ptr).to(tl.uint32)
    dmin = _refresh_row(a_ptr, b_ptr, bc_ptr, sqn_ptr, dmin_ptr, seen_ptr, picks_ptr, top, t,
                        A, B, stride_an, stride_bn, stride_bcn, BLOCK_A, BLOCK_B, BLOCK_C)
    s = _race_score(dmin, seed, t, top)
    tl.store(thr_ptr, s - tl.abs(s) * 9.5367431640625e-07)  # 2^-20
    tl.store(seen_ptr + cap, top)


@triton.jit(do_not_specialize=["t"])
def _lazy_draw_kernel(
    a_ptr, b_ptr, bc_ptr, sqn_ptr, dmin_ptr, seen_ptr, n_ptr, picks_ptr, seed_ptr,
    part_score_ptr, part_idx_ptr, thr_ptr, P, t, cap,
    A, B, stride_an, stride_bn, stride_bcn,
    BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # launch 3 of 3 (grid): the candidates whose bound reaches thr (and the top) are brought up
    # to date one by one -- a data-dependent number, usually none in a block -- and the block's
    # best true score and its first index -> partials[t % 2], what the next step draws from. A
    # candidate left stale has true score <= bound < thr <= s: it cannot be the draw.
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < tl.load(n_ptr)
    seed = tl.load(seed_ptr).to(tl.uint32)
    thr = tl.load(thr_ptr)
    top = tl.load(seen_ptr + cap)
    dmin = tl.load(dmin_ptr + offs_n, mask=mask_n, other=-1.0)
    bound = _race_bound(dmin, seed, t, offs_n)
    touched = mask_n & (dmin >= 0) & ((bound >= thr) | (offs_n == top))
    best = float("-inf")
    best_n = 2147483647
    row = pid * BLOCK_N - 1
    for _ in range(tl.sum(touched.to(tl.int32), axis=0)):  # ascending rows
        row = tl.min(tl.where(touched & (offs_n > row), offs_n, 2147483647), axis=0)
        d = _refresh_row(a_ptr, b_ptr, bc_ptr, sqn_ptr, dmin_ptr, seen_ptr, picks_ptr, row, t,
                         A, B, stride_an, stride_bn, stride_bcn, BLOCK_A, BLOCK_B, BLOCK_C)
        s = _race_score(d, seed, t, row)
        take = s > best  # rows ascend: an equal score keeps the smaller index
        best_n = tl.where(take, row, best_n)
        best = tl.where(take, s, best)
    cur = (t % 2) * P
    tl.store(part_score_ptr + cur + pid, best)
    tl.store(part_idx_ptr + cur + pid, best_n)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------
def _launch_lazy(a, b, bc, sqn, dmin, n_t, picks, seed_t, part_score, part_idx, seen, thr, k,
                 cfg):
    """Steps 2 .. k-1 of the lazy variant (steps 0 and 1 are the eager kernel's: a uniform draw,
    then the one full pass, every D being +inf before the first centre): three launches a step
    (bound, top, draw; plus the second level of each grid-wide reduction on large grids), each
    reading the [cap] D vector and the factors of the few candidates brought up to date."""
    p, cap = cfg["grid"], dmin.shape[0]
    r0, rp = _reduced(cfg)
    sizes = (a.shape[1], b.shape[1], a.stride(0), b.stride(0), bc.stride(0))
    blocks = dict(BLOCK_A=cfg["BLOCK_A"], BLOCK_B=cfg["BLOCK_B"], BLOCK_C=cfg["BLOCK_C"])
    seen.fill_(1)  # after step 1 every D has seen centre 0
    for t in range(2, k):
        _lazy_bound_kernel[(p,)](dmin, n_t, picks, seed_t, part_score, part_idx, p, r0, rp, t,
                                 BLOCK_N=cfg["BLOCK_N"], BLOCK_P=cfg["BLOCK_P"],
                                 num_warps=cfg["num_warps"], **NO_FMA)
        _reduce(part_score, part_idx, t, cfg)
        _lazy_top_kernel[(1,)](a, b, bc, sqn, dmin, seen, picks, seed_t, part_score, part_idx,
                               thr, r0, rp, t, cap, *sizes, BLOCK_P=cfg["BLOCK_P"],
                               num_warps=LAZY_WARPS, **NO_FMA, **blocks)
        _lazy_draw_kernel[(p,)](a, b, bc, sqn, dmin, seen, n_t, picks, seed_t, part_score,
                                part_idx, thr, p, t, cap, *sizes, BLOCK_N=cfg["BLOCK_N"],
                                num_warps=LAZY_WARPS, **NO_FMA, **blocks)
        _reduce(part_score, part_idx, t, cfg)
