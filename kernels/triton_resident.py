"""The ``resident`` k-means++ variant (issue 48; pools that fit on chip, ``resident_config``):
ONE cooperative launch of ``_kmeanspp_resident_kernel``, at most one program per SM, each
owning a fixed block of rows whose factors (as 32-bit words: bf16 pairs or fp32), |g_n|^2 and
D stay in registers for all k rounds; a round reads only the centre's row (L2), and the draw is
one int64 atomic max of (score, -index) keys per program and one grid barrier. Under the
interpreter (and as a GPU check) its per-round twin ``_kmeanspp_resident_round_kernel`` runs
the same helpers one launch a round. The section "Variant resident" below has the math;
kernels/triton_kmeanspp.py ``seeding_config`` / ``launch_seeding`` / ``kmeanspp_triton``
dispatch here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_race import INTERPRETED, NO_FMA, _grid_barrier, _uniform

__all__ = ["resident_rows", "resident_config", "factor_words", "RESIDENT_WORDS",
           "INTERPRETED_SMS"]


# ----------------------------------------------------------------------------------------------
# Variant "resident": the factors held on chip for all k rounds (issue 48)
# ----------------------------------------------------------------------------------------------
# A program owns the fixed rows [pid RPP, (pid + 1) RPP), RPP = ROWS_A + ROWS_B (two tiles:
# powers of two, ROWS_B may be 0, so RPP fits ceil(cap / SMs) to within a third). Its factors
# are loaded ONCE as 32-bit words (bf16: two values a word, element 2j in the low half, so
# fp32(element) = the word's half << 16, exact; fp32: one value a word) and stay in registers
# across the rounds, with sqn and D. A round against centre c (its row read from L2):
#
#     d_n = max(sqn_n + sqn_c - 2 (a_n . a_c)(b_n . bc_c), 0)      (fp32 accumulate)
#     D_n <- min(D_n, d_n) for D_n >= 0;  D_c <- -1
#     score_n = D_n / E_n if D_n > 0;  -E_n if D_n == 0 (or round 0);  -inf if D_n < 0
#     key = (monotone int32 bits of score) << 32 | (2^31 - 1 - n)   (int64)
#
# and the draw is the largest key: the largest score, the smallest index on ties (as
# torch.argmax), decided by one int64 atomic max per program into best[t] -- exact, no float
# atomic. The cooperative kernel then passes one grid barrier and every program reads best[t].
# The per-round twin (``_kmeanspp_resident_round_kernel``: the interpreter, and a GPU check of
# the cooperative kernel) runs the same helpers, one launch a round, D kept in global memory.
@triton.jit
def _dot_words(x, xc, PACK: tl.constexpr):
    # sum_j x[n, j] xc[j] over the values packed in the words x [R, W] and xc [W] -> [R] fp32
    if PACK == 2:  # bf16 pairs: the low half is the even element, the high half the odd one
        lo = (x << 16).to(tl.float32, bitcast=True) * (xc << 16).to(tl.float32, bitcast=True)[None, :]
        hi = ((x >> 16) << 16).to(tl.float32, bitcast=True) * \
            ((xc >> 16) << 16).to(tl.float32, bitcast=True)[None, :]
        return tl.sum(lo + hi, axis=1)
    else:
        return tl.sum(x.to(tl.float32, bitcast=True) * xc.to(tl.float32, bitcast=True)[None, :],
                      axis=1)


@triton.jit
def _resident_load(aw_ptr, bw_ptr, sqn_ptr, excl_ptr, row0, n_valid, WA, WB,
                   stride_an, stride_bn,
                   ROWS: tl.constexpr, BLOCK_WA: tl.constexpr, BLOCK_WB: tl.constexpr):
    # one tile of a program's rows: factor words [ROWS, BLOCK_WA], [ROWS, BLOCK_WB], sqn, the
    # round-0 D (+inf, or -1 if masked, excluded or |g_n|^2 not finite), rows, mask
    offs = row0 + tl.arange(0, ROWS)
    mask = offs < n_valid
    offs64 = offs.to(tl.int64)
    wa = tl.arange(0, BLOCK_WA)
    wb = tl.arange(0, BLOCK_WB)
    xa = tl.load(aw_ptr + offs64[:, None] * stride_an + wa[None, :],
                 mask=mask[:, None] & (wa < WA)[None, :], other=0)
    xb = tl.load(bw_ptr + offs64[:, None] * stride_bn + wb[None, :],
                 mask=mask[:, None] & (wb < WB)[None, :], other=0)
    sqn = tl.load(sqn_ptr + offs, mask=mask, other=0.0)  # |g_n|^2
    excl = tl.load(excl_ptr + offs, mask=mask, other=1)
    finite = (sqn == sqn) & (tl.abs(sqn) < float("inf"))
    d0 = tl.where(mask & (excl == 0) & finite, float("inf"), -1.0)
    return xa, xb, sqn, d0, offs, mask


@triton.jit
def _resident_update(xa, xb, sqn, dmin, offs, ca, cb, sqc, c, PACK: tl.constexpr):
    # D <- min(D, d(n, c)) for D >= 0 (clamped at 0), D_c <- -1
    dot_a = _dot_words(xa, ca, PACK)  # a_n . a_c
    dot_b = _dot_words(xb, cb, PACK)  # b_n . bc_c
    d = tl.maximum(sqn + sqc - 2.0 * (dot_a * dot_b), 0.0)
    dmin = tl.where(dmin >= 0, tl.minimum(dmin, d), dmin)
    return tl.where(offs == c, -1.0, dmin)


@triton.jit
def _race_key(score, idx):
    # int64 key ordered as (score, -index): -0.0 made +0.0, then the fp32 bits made monotone
    # as a signed int32 (negatives: magnitude bits flipped) in the high word, 2^31 - 1 - index
    # in the low word
    score = tl.where(score == 0, 0.0, score)
    bits = score.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (2147483647 - idx).to(tl.int64)


@triton.jit
def _key_index(key):
    # the candidate index of a race key
    return (2147483647 - (key & 2147483647)).to(tl.int32)


@triton.jit
def _resident_key(dmin, offs, mask, seed, t, row0):
    # the race over one tile (rows row0 + [0, R); round t, round 0 a uniform draw): its best key
    e = -tl.log(_uniform(seed, t, offs))  # E_n ~ Exp(1), E_n > 0
    score = tl.where((dmin > 0) & (t > 0), tl.math.div_rn(dmin, e), -e)  # IEEE division
    score = tl.where((dmin >= 0) & mask, score, float("-inf"))
    best = tl.max(score, axis=0)
    i = tl.argmax(score, axis=0, tie_break_left=True)
    return _race_key(best, row0 + i)


@triton.jit
def _centre_words(aw_ptr, bcw_ptr, sqn_ptr, c, WA, WB, stride_an, stride_bcn,
                  BLOCK_WA: tl.constexpr, BLOCK_WB: tl.constexpr):
    # the centre's words a_c [BLOCK_WA], bc_c [BLOCK_WB] and |g_c|^2
    c64 = c.to(tl.int64)
    wa = tl.arange(0, BLOCK_WA)
    wb = tl.arange(0, BLOCK_WB)
    ca = tl.load(aw_ptr + c64 * stride_an + wa, mask=wa < WA, other=0)
    cb = tl.load(bcw_ptr + c64 * stride_bcn + wb, mask=wb < WB, other=0)
    return ca, cb, tl.load(sqn_ptr + c64)


@triton.jit
def _opaque(x):
    # the identity, as an asm statement with side effects: LLVM cannot hoist what depends on it
    # out of the round loop. Without it the loop-invariant bf16 -> fp32 unpacking of the
    # resident words was hoisted (two fp32 registers for every word: 255 registers and spills
    # at sm_90); with it each word stays one register and is unpacked per round (GPU only: the
    # interpreter has no inline asm, and the twin has no loop)
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _kmeanspp_resident_kernel(
    aw_ptr, bw_ptr, bcw_ptr, sqn_ptr, dmin_ptr, excl_ptr, n_ptr, picks_ptr, seed_ptr,
    best_ptr, bar_ptr,
    K, WA, WB, stride_an, stride_bn, stride_bcn,
    ROWS_A: tl.constexpr, ROWS_B: tl.constexpr, BLOCK_WA: tl.constexpr,
    BLOCK_WB: tl.constexpr, PACK: tl.constexpr,
):
    # G co-resident programs (cooperative launch, G <= SMs). The tiles are loaded once; each of
    # the K rounds: update against the last centre (rounds > 0), race, one int64 atomic max into
    # best[t], one grid barrier, every program reads the draw. best [K] must hold INT64_MIN and
    # bar 0 at launch. The final D is stored at the end (for checks; nothing reads it).
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    n_valid = tl.load(n_ptr)
    seed = tl.load(seed_ptr).to(tl.uint32)  # folded to 32 bits on the host (reference.seed32)
    row0 = pid * (ROWS_A + ROWS_B)
    xa1, xb1, sq1, d1, offs1, m1 = _resident_load(aw_ptr, bw_ptr, sqn_ptr, excl_ptr, row0,
                                                  n_valid, WA, WB, stride_an, stride_bn,
                                                  ROWS_A, BLOCK_WA, BLOCK_WB)
    key = _resident_key(d1, offs1, m1, seed, 0, row0)
    if ROWS_B > 0:
        xa2, xb2, sq2, d2, offs2, m2 = _resident_load(aw_ptr, bw_ptr, sqn_ptr, excl_ptr,
                                                      row0 + ROWS_A, n_valid, WA, WB,
                                                      stride_an, stride_bn, ROWS_B, BLOCK_WA,
                                                      BLOCK_WB)
        key = tl.maximum(key, _resident_key(d2, offs2, m2, seed, 0, row0 + ROWS_A))
    tl.atomic_max(best_ptr, key, sem="relaxed", scope="gpu")
    _grid_barrier(bar_ptr, G)
    c = _key_index(tl.load(best_ptr, volatile=True))
    tl.store(picks_ptr, c.to(tl.int64), mask=pid == 0)
    for t in range(1, K):
        ca, cb, sqc = _centre_words(aw_ptr, bcw_ptr, sqn_ptr, c, WA, WB, stride_an, stride_bcn,
                                    BLOCK_WA, BLOCK_WB)
        d1 = _resident_update(_opaque(xa1), _opaque(xb1), sq1, d1, offs1, ca, cb, sqc, c, PACK)
        key = _resident_key(d1, offs1, m1, seed, t, row0)
        if ROWS_B > 0:
            d2 = _resident_update(_opaque(xa2), _opaque(xb2), sq2, d2, offs2, ca, cb, sqc, c,
                                  PACK)
            key = tl.maximum(key, _resident_key(d2, offs2, m2, seed, t, row0 + ROWS_A))
        tl.atomic_max(best_ptr + t, key, sem="relaxed", scope="gpu")
        _grid_barrier(bar_ptr, (t + 1) * G)
        c = _key_index(tl.load(best_ptr + t, volatile=True))
        tl.store(picks_ptr + t, c.to(tl.int64), mask=pid == 0)
    tl.store(dmin_ptr + offs1, d1, mask=m1)
    if ROWS_B > 0:
        tl.store(dmin_ptr + offs2, d2, mask=m2)


@triton.jit(do_not_specialize=["t"])
def _kmeanspp_resident_round_kernel(
    aw_ptr, bw_ptr, bcw_ptr, sqn_ptr, dmin_ptr, excl_ptr, n_ptr, picks_ptr, seed_ptr,
    best_ptr, t, WA, WB, stride_an, stride_bn, stride_bcn,
    FIRST: tl.constexpr, ROWS_A: tl.constexpr, ROWS_B: tl.constexpr, BLOCK_WA: tl.constexpr,
    BLOCK_WB: tl.constexpr, PACK: tl.constexpr,
):
    # the twin of one round of _kmeanspp_resident_kernel (same programs, rows, helpers and
    # keys): the launch boundary is the barrier, D lives in dmin between launches. Round t > 0
    # reads the draw of round t-1 from best[t-1] (program 0 stores picks[t-1]).
    pid = tl.program_id(0)
    n_valid = tl.load(n_ptr)
    seed = tl.load(seed_ptr).to(tl.uint32)
    row0 = pid * (ROWS_A + ROWS_B)
    c = 0
    if not FIRST:
        c = _key_index(tl.load(best_ptr + t - 1))
        tl.store(picks_ptr + t - 1, c.to(tl.int64), mask=pid == 0)
        ca, cb, sqc = _centre_words(aw_ptr, bcw_ptr, sqn_ptr, c, WA, WB, stride_an, stride_bcn,
                                    BLOCK_WA, BLOCK_WB)
    xa1, xb1, sq1, d1, offs1, m1 = _resident_load(aw_ptr, bw_ptr, sqn_ptr, excl_ptr, row0,
                                                  n_valid, WA, WB, stride_an, stride_bn,
                                                  ROWS_A, BLOCK_WA, BLOCK_WB)
    if not FIRST:
        d1 = tl.load(dmin_ptr + offs1, mask=m1, other=-1.0)
        d1 = _resident_update(xa1, xb1, sq1, d1, offs1, ca, cb, sqc, c, PACK)
    tl.store(dmin_ptr + offs1, d1, mask=m1)
    key = _resident_key(d1, offs1, m1, seed, t, row0)
    if ROWS_B > 0:
        xa2, xb2, sq2, d2, offs2, m2 = _resident_load(aw_ptr, bw_ptr, sqn_ptr, excl_ptr,
                                                      row0 + ROWS_A, n_valid, WA, WB,
                                                      stride_an, stride_bn, ROWS_B, BLOCK_WA,
                                                      BLOCK_WB)
        if not FIRST:
            d2 = tl.load(dmin_ptr + offs2, mask=m2, other=-1.0)
            d2 = _resident_update(xa2, xb2, sq2, d2, offs2, ca, cb, sqc, c, PACK)
        tl.store(dmin_ptr + offs2, d2, mask=m2)
        key = tl.maximum(key, _resident_key(d2, offs2, m2, seed, t, row0 + ROWS_A))
    tl.atomic_max(best_ptr + t, key, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["t"])
def _resident_pick_kernel(best_ptr, picks_ptr, t):
    # the twin's last draw: picks[t] from best[t] (one program)
    tl.store(picks_ptr + t, _key_index(tl.load(best_ptr + t)).to(tl.int64))


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------
# The resident variant's register budget, calibrated on the sm_90 compile at 8 warps (ptxas
# -v, tests/test_aot.py): a program's tiles may hold (rows + RESIDENT_SLACK_ROWS) x (padded
# words a row) <= RESIDENT_WORDS 32-bit words, the slack standing for the round's working set,
# which grows with the row width (the centre's unpacked words). N = 38,400 at M = d = 128, bf16,
# 132 SMs: 320 rows x 128 words, 255 registers a thread, no spill; fp32 rows of 256 words: 144
# rows compile without spill, 160 spilled 52 B (so they are refused).
RESIDENT_WORDS = 43008
RESIDENT_SLACK_ROWS = 16
RESIDENT_WARPS = 8
RESIDENT_MIN_ROWS = 16  # the smallest tile
INTERPRETED_SMS = 4  # "SMs" of the interpreter's resident grid: several programs, two tiles
INT64_MIN = -(2**63)


def resident_rows(capacity: int, sms: int) -> tuple[int, int]:
    """(ROWS_A, ROWS_B): the rows of a resident program's two tiles, powers of two (ROWS_B may
    be 0, ROWS_B <= ROWS_A), the smallest sum >= ceil(capacity / sms) (so at most ``sms``
    programs), one tile on ties."""
    need = max(RESIDENT_MIN_ROWS, -(-capacity // max(1, sms)))
    best = None
    ra = RESIDENT_MIN_ROWS
    while True:
        for rb in [0] + [1 << i for i in range(4, ra.bit_length())]:
            if ra + rb >= need and (best is None or (ra + rb, rb) < (sum(best), best[1])):
                best = (ra, rb)
        if ra >= need:
            return best
        ra *= 2


def resident_config(capacity: int, a: int, b: int, factors, sms: int,
                    words: int = RESIDENT_WORDS) -> dict | None:
    """The resident variant's tiles for a pool of ``capacity`` rows with factors of widths a
    and b (beta_c has b columns too) of dtype ``factors`` (torch.bfloat16: two values a
    32-bit word; torch.float32: one) over ``sms`` programs, or None when the factors do not
    fit on chip (over the register budget of RESIDENT_WORDS), or are of another dtype."""
    pack = {torch.bfloat16: 2, torch.float32: 1}.get(factors)
    if pack is None or capacity < 1:
        return None
    wa, wb = -(-a // pack), -(-b // pack)
    bwa, bwb = triton.next_power_of_2(wa), triton.next_power_of_2(wb)
    ra, rb = resident_rows(capacity, sms)
    if (ra + rb + RESIDENT_SLACK_ROWS) * (bwa + bwb) > words:
        return None
    return dict(ROWS_A=ra, ROWS_B=rb, BLOCK_WA=bwa, BLOCK_WB=bwb, PACK=pack, WA=wa, WB=wb,
                grid=-(-capacity // (ra + rb)))


def factor_words(x: torch.Tensor) -> torch.Tensor:
    """A factor [rows, cols] (unit column stride; fp32, or bf16 with 4-byte aligned rows) as
    its 32-bit words [rows, ceil(cols * size / 4)] (no copy): bf16 element 2j is the low half
    of word j. An odd bf16 width reads the row's padding element, which must be 0."""
    if x.stride(1) != 1:
        raise ValueError("resident k-means++: factors need a unit column stride")
    if x.element_size() == 4:
        return x.view(torch.int32)
    if x.stride(0) % 2 or x.storage_offset() % 2:
        raise ValueError("resident k-means++: bf16 factor rows must start on 4-byte boundaries "
                         "(an even row stride: pad odd widths with a zero column)")
    wide = x.as_strided((x.shape[0], x.stride(0)), (x.stride(0), 1))  # the padded rows
    return wide.view(torch.int32)[:, :-(-x.shape[1] // 2)]


def _resident_seeding_config(capacity, a, b, factors, device, sms, cooperative) -> dict:
    if sms is None:
        sms = (INTERPRETED_SMS if INTERPRETED
               else torch.cuda.get_device_properties(device).multi_processor_count)
    cfg = resident_config(capacity, a, b, factors, sms)
    if cfg is None:
        raise ValueError(f"kmeanspp: the resident variant does not hold {capacity} candidates "
                         f"of {a} + {b} {factors} factor values on {sms} SMs (or the factors "
                         "are not bf16/fp32); use variant='steps' or 'lazy'")
    cooperative = not INTERPRETED if cooperative is None else cooperative
    if cooperative and INTERPRETED:
        raise ValueError("kmeanspp: the cooperative resident kernel needs a GPU (its grid "
                         "barrier would hang the Triton interpreter); cooperative=False runs "
                         "its per-round twin")
    cfg.update(num_warps=4 if INTERPRETED else RESIDENT_WARPS, cooperative=cooperative,
               partials=2, P2=None, GROUP=None, BLOCK_P=16)
    return cfg


def _launch_resident(a, b, bc, sqn, dmin, excl, n_t, picks, seed_t, best, bar, k, cfg):
    """The resident variant: one cooperative launch (k rounds, a grid barrier each), or its
    per-round twin (k launches and the last pick). Fill kernels only: graph-capturable."""
    p = cfg["grid"]
    aw, bw, bcw = factor_words(a), factor_words(b), factor_words(bc)
    best.fill_(INT64_MIN)
    ptrs = (aw, bw, bcw, sqn, dmin, excl, n_t, picks, seed_t, best)
    sizes = (cfg["WA"], cfg["WB"], aw.stride(0), bw.stride(0), bcw.stride(0))
    tiles = {key: cfg[key] for key in ("ROWS_A", "ROWS_B", "BLOCK_WA", "BLOCK_WB", "PACK")}
    if cfg["cooperative"]:
        bar.zero_()
        _kmeanspp_resident_kernel[(p,)](*ptrs, bar, k, *sizes, num_warps=cfg["num_warps"],
                                        launch_cooperative_grid=True, **NO_FMA, **tiles)
        return
    for t in range(k):
        _kmeanspp_resident_round_kernel[(p,)](*ptrs, t, *sizes, FIRST=(t == 0),
                                              num_warps=cfg["num_warps"], **NO_FMA, **tiles)
    _resident_pick_kernel[(1,)](best, picks, k - 1, **NO_FMA)


def _aligned_words(x: torch.Tensor) -> torch.Tensor:
    """x itself where ``factor_words`` can read it in place, else a copy (bf16: padded with a
    zero column to an even width)."""
    if x.element_size() == 4 or not (x.stride(0) % 2 or x.storage_offset() % 2):
        return x
    return torch.nn.functional.pad(x, (0, x.shape[1] % 2))
