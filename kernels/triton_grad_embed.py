"""Fused gradient embedding (docs/DESIGN.md §1 steps 1-3) in one pass over the candidate pool.

For a tile of BLOCK_N candidate keys, everything stays on chip:

    s   = K Q^T / tau                       [BLOCK_N, M]   (tl.dot over d in BLOCK_D chunks)
    p   = softmax(s);  yhat = argmax(s)     (first index on ties, as torch.argmax)
    r   = p - onehot(yhat)                  [BLOCK_N, M]   (dCE(p, yhat)/ds)
    view "queries":  alpha = r,  beta = K / tau
    view "head":     alpha = K,  beta = r F / tau      (second on-chip tl.dot over d_h chunks;
                                                        F = H, or R_H^T when compress=True)
    view "head", Gram route (the selection path when d_h > M, M <= GRAM_MAX_M; no QR):
                     alpha = K,  beta = r / tau,  beta_c = r G / tau     with G = H H^T [M, M]
                     so beta_n . beta_c_c = (r_n H) . (r_c H) / tau^2  (kernels/reference.py)

plus sqn_n = |g_n|^2 (alpha_n . alpha_n)(beta_n . beta_c_n), used by k-means++. Each key is read
once. Inputs may be fp32/fp16/bf16: every load is cast to fp32 before any arithmetic; outputs
are stored fp32 or bf16 (the output buffers' dtype), and sqn is computed from the stored values.
Any N (masked tail; the valid count may be read from device memory, so one launch shape serves
a growing pool), 1 <= M <= MAX_M (the whole softmax row lives in one tile), d and d_h of any
size (chunked loops, masked). MAX_M < M <= TILED_MAX_M (global batches of 512 ... 4,096):
``_grad_embed_tiled_kernel``, the same math over chunks of TILED_BLOCK_M pseudo-labels (an
online softmax pass for the row max, sum and argmax, then the residuals chunk by chunk with the
logits recomputed: about d_h / BLOCK_H + 2 times the logit work of the one-tile kernel).

tl.dot precision (``precision=`` or CMACC_DOT_PRECISION): ieee (default: true fp32 products,
~1e-6 relative to the reference) | tf32x3 (NVIDIA tensor cores, ~fp32 accuracy, faster) | tf32
(fastest, ~1e-3 relative; may flip near-tied pseudo-labels). The precision is a compile-time
constant. The launch configuration is pinned per shape (``embed_config``), never autotuned, so
every rank computes the same bits. Compiled with ``enable_fp_fusion=False``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import TRITON_MAX_M, reference

__all__ = ["grad_embed_triton", "grad_embed_triton_with_norms", "embed_into", "precision_of",
           "MAX_M", "TILED_MAX_M", "GRAM_MAX_M", "PRECISIONS", "INTERPRETED"]

MAX_M = 256  # up to here a candidate's whole softmax row of M pseudo-labels is one tile
TILED_MAX_M = TRITON_MAX_M  # above MAX_M: _grad_embed_tiled_kernel, in chunks of TILED_BLOCK_M
TILED_BLOCK_M = 64
GRAM_MAX_M = 128  # the Gram route holds G [M, M] in one tile
PRECISIONS = ("ieee", "tf32x3", "tf32")
# Triton picks the interpreter or the compiler when a kernel below is defined (TRITON_INTERPRET
# at import); the host code follows that choice, not the variable's value at call time.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def precision_of(precision: str | None = None) -> str:
    """input_precision of the fp32 tl.dot calls: ``precision``, else CMACC_DOT_PRECISION, else
    ieee (module docstring). The interpreter computes in fp32 whatever is asked: ieee there."""
    choice = precision if precision is not None else (
        os.environ.get("CMACC_DOT_PRECISION", "ieee").strip().lower() or "ieee")
    if choice not in PRECISIONS:
        src = "precision" if precision is not None else "CMACC_DOT_PRECISION"
        raise ValueError(f"{src}={choice!r} is not one of {PRECISIONS}")
    return "ieee" if INTERPRETED else choice


# One launch configuration per shape, the same in every process: the ranks of a run must compute
# bit-identical factors (their picks are compared), and configs that differ in rows per program
# compile to different MMA layouts and summation orders. So nothing is autotuned at run time; the
# table below was chosen offline from the sm_90 compile (kernels/_aot.py, registers and spill
# stores reported by ptxas for every candidate; bench/RESULTS.md): the most rows per program that
# compile without spilling, keeping the [BLOCK_N, BLOCK_M] fp32 logit/residual tiles <= 8K
# elements. CMACC_EMBED_CONFIG="BLOCK_N,num_warps" overrides it (benchmarks; set it on every rank).
EMBED_CANDIDATES = ((16, 4), (16, 8), (32, 4), (32, 8), (64, 8))


def embed_config(m: int, view: str, gram: bool, precision: str,
                 factors: str = "fp32") -> tuple[int, int]:
    """(BLOCK_N, num_warps) of the embedding kernel for M pseudo-labels: a pure function of the
    launch's shape and settings (module comment above). ``view`` and ``gram`` are part of the
    key although the table does not need them today. The interpreter runs 64-row programs (it is
    slow per program and has no registers to spill)."""
    env = os.environ.get("CMACC_EMBED_CONFIG", "").strip()
    if env:
        try:
            bn, nw = (int(x) for x in env.split(","))
        except ValueError:
            raise ValueError(f"CMACC_EMBED_CONFIG={env!r}: expected 'BLOCK_N,num_warps', e.g. "
                             "'32,8'") from None
        if bn not in (16, 32, 64, 128) or nw not in (1, 2, 4, 8, 16):
            raise ValueError(f"CMACC_EMBED_CONFIG={env!r}: BLOCK_N must be 16, 32, 64 or 128 "
                             "and num_warps 1, 2, 4, 8 or 16")
        return bn, nw
    if INTERPRETED:
        return 64, 4
    small = max(16, triton.next_power_of_2(m)) <= 128
    if precision == "tf32":
        return (64, 8) if small else (32, 8)
    if factors == "bf16":  # the bf16 stores of 32- and 64-row tiles spill at M = 128
        return 16, 8
    if small:
        return 64, 8
    # M = 256: the least spill; M > 256 (the tiled kernel, [BLOCK_N, 64] tiles): no spill in
    # the default setting (bench/RESULTS.md)
    return (16, 8) if precision == "tf32x3" else (32, 8)


@triton.jit
def _store_key_chunk(k, alpha_ptr, beta_ptr, offs_n64, offs_d, mask_nd, stride_an, stride_bn,
                     tau, HEAD: tl.constexpr):
    # one column chunk of the key tile is alpha = k (HEAD) or beta = k / tau (queries view),
    # stored in the buffer's dtype; returns the row sums of squares of the stored values
    if HEAD:
        ks = k.to(alpha_ptr.dtype.element_ty)
        tl.store(alpha_ptr + offs_n64[:, None] * stride_an + offs_d[None, :], ks, mask=mask_nd)
    else:
        ks = tl.math.div_rn(k, tau).to(beta_ptr.dtype.element_ty)
        tl.store(beta_ptr + offs_n64[:, None] * stride_bn + offs_d[None, :], ks, mask=mask_nd)
    ks = ks.to(tl.float32)
    return tl.sum(ks * ks, axis=1)


@triton.jit
def _grad_embed_kernel(
    k_ptr, q_ptr, f_ptr, alpha_ptr, beta_ptr, betac_ptr, sqn_ptr, n_ptr,
    CAP, M, D, DH, tau,
    stride_kn, stride_kd, stride_qm, stride_qd, stride_fm, stride_fh,
    stride_an, stride_bn, stride_bcn,
    HEAD: tl.constexpr, GRAM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
):
    # One tile of candidates n (rows, n < n_valid <= CAP), all M pseudo-labels j (columns):
    #   s_nj = k_n . q_j / tau;  p_n = softmax_j(s_n);  yhat_n = argmax_j s_nj;  r_n = p_n - e_yhat
    #   HEAD:        alpha_n = k_n,  beta_n = r_n F / tau            sqn_n = |k_n|^2 |beta_n|^2
    #   HEAD, GRAM:  alpha_n = k_n,  beta_n = r_n / tau,  betac_n = r_n G / tau  (F = G = H H^T)
    #                                                               sqn_n = |k_n|^2 beta_n.betac_n
    #   queries:     alpha_n = r_n,  beta_n = k_n / tau              sqn_n = |r_n|^2 |k_n|^2 / tau^2
    # Outputs are stored in the pointers' dtype (fp32 or bf16); sqn is computed from the stored
    # (rounded) values so that d(n, n) = 0 in the k-means++ algebra.
    pid = tl.program_id(0)
    n_valid = tl.minimum(tl.load(n_ptr), CAP)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] candidate rows
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M] pseudo-labels (queries)
    mask_n = offs_n < n_valid
    mask_m = offs_m < M
    offs_n64 = offs_n.to(tl.int64)  # row offsets of big pools in 64 bits
    a_ty = alpha_ptr.dtype.element_ty
    b_ty = beta_ptr.dtype.element_ty

    # -- logits s = K Q^T / tau over d in chunks; the key tile is also alpha (HEAD) or beta ------
    s = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_nd = mask_n[:, None] & (offs_d < D)[None, :]
        k = tl.load(k_ptr + offs_n64[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=mask_nd, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        q = tl.load(q_ptr + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                    mask=mask_m[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)
        s += tl.dot(k, tl.trans(q), input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
        k_sq += _store_key_chunk(k, alpha_ptr, beta_ptr, offs_n64, offs_d, mask_nd, stride_an,
                                 stride_bn, tau, HEAD)
    s = tl.math.div_rn(s, tau)
    s = tl.where(mask_m[None, :], s, float("-inf"))

    # -- softmax, pseudo-label, residual r = p - e_yhat ------------------------------------
    s_max = tl.max(s, axis=1)
    e = tl.exp(s - s_max[:, None])
    p = e / tl.sum(e, axis=1)[:, None]
    yhat = tl.argmax(s, axis=1, tie_break_left=True)  # [BLOCK_N]
    r = p - tl.where(offs_m[None, :] == yhat[:, None], 1.0, 0.0)
    r = tl.where(mask_m[None, :], r, 0.0)  # [BLOCK_N, BLOCK_M]
    mask_nm = mask_n[:, None] & mask_m[None, :]

    if HEAD and GRAM:
        # -- beta = r / tau;  betac = r G / tau  (G = H H^T [M, M]: the host takes this route only
        #    for M <= GRAM_MAX_M), G in column chunks of BLOCK_H: a whole [BLOCK_M, BLOCK_M] fp32
        #    tile next to the softmax tiles spills registers in ieee precision. beta is stored,
        #    then read back chunk by chunk (rounded as stored) for sqn = |k|^2 beta . betac ------
        beta = tl.math.div_rn(r, tau).to(b_ty)
        tl.store(beta_ptr + offs_n64[:, None] * stride_bn + offs_m[None, :], beta, mask=mask_nm)
        tl.debug_barrier()  # the program's beta stores are visible to all its threads
        b_dot = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for c0 in range(0, M, BLOCK_H):
            offs_c = c0 + tl.arange(0, BLOCK_H)
            mask_c = offs_c < M
            mask_nc = mask_n[:, None] & mask_c[None, :]
            g = tl.load(f_ptr + offs_m[:, None] * stride_fm + offs_c[None, :] * stride_fh,
                        mask=mask_m[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
            bc = tl.math.div_rn(tl.dot(r, g, input_precision=PRECISION), tau).to(b_ty)
            tl.store(betac_ptr + offs_n64[:, None] * stride_bcn + offs_c[None, :], bc,
                     mask=mask_nc)
            bt = tl.load(beta_ptr + offs_n64[:, None] * stride_bn + offs_c[None, :],
                         mask=mask_nc, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_H]
            b_dot += tl.sum(bt * bc.to(tl.float32), axis=1)
        sqn = k_sq * b_dot
    elif HEAD:
        # -- beta = r F / tau over d_h in chunks (F: H [M, d_h], or R_H^T when compressed) ----
        b_sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for h0 in range(0, DH, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask_h = offs_h < DH
            f = tl.load(f_ptr + offs_m[:, None] * stride_fm + offs_h[None, :] * stride_fh,
                        mask=mask_m[:, None] & mask_h[None, :], other=0.0).to(tl.float32)
            beta = tl.math.div_rn(tl.dot(r, f, input_precision=PRECISION), tau).to(b_ty)
            tl.store(beta_ptr + offs_n64[:, None] * stride_bn + offs_h[None, :], beta,
                     mask=mask_n[:, None] & mask_h[None, :])
            beta = beta.to(tl.float32)
            b_sq += tl.sum(beta * beta, axis=1)
        sqn = k_sq * b_sq
    else:
        ra = r.to(a_ty)
        tl.store(alpha_ptr + offs_n64[:, None] * stride_an + offs_m[None, :], ra, mask=mask_nm)
        ra = ra.to(tl.float32)
        sqn = tl.sum(ra * ra, axis=1) * k_sq
    tl.store(sqn_ptr + offs_n, sqn, mask=mask_n)


@triton.jit
def _logit_chunk(k_ptr, q_ptr, offs_n64, mask_n, m0, M, D, tau, stride_kn, stride_kd,
                 stride_qm, stride_qd, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    # s[:, j] = k_n . q_{m0 + j} / tau for one chunk of BLOCK_M pseudo-labels; -inf past M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    s = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        k = tl.load(k_ptr + offs_n64[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=mask_n[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)
        q = tl.load(q_ptr + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                    mask=mask_m[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)
        s += tl.dot(k, tl.trans(q), input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
    s = tl.math.div_rn(s, tau)
    return tl.where(mask_m[None, :], s, float("-inf"))


@triton.jit
def _residual_chunk(s, mx, lsum, yhat, m0, M, BLOCK_M: tl.constexpr):
    # r = softmax(s_n) - e_yhat for one chunk of columns, from the row statistics; 0 past M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    p = tl.exp(s - mx[:, None]) / lsum[:, None]
    r = p - tl.where(offs_m[None, :] == yhat[:, None], 1.0, 0.0)
    return tl.where((offs_m < M)[None, :], r, 0.0)  # [BLOCK_N, BLOCK_M]


@triton.jit
def _grad_embed_tiled_kernel(
    k_ptr, q_ptr, f_ptr, alpha_ptr, beta_ptr, sqn_ptr, n_ptr,
    CAP, M, D, DH, tau,
    stride_kn, stride_kd, stride_qm, stride_qd, stride_fm, stride_fh,
    stride_an, stride_bn,
    HEAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
):
    # _grad_embed_kernel's math for M > MAX_M (no Gram route), the pseudo-labels in chunks of
    # BLOCK_M: no tile holds a whole softmax row.
    #   pass 1 (online):  mx_n = max_j s_nj,  l_n = sum_j exp(s_nj - mx_n),  yhat_n = first argmax
    #   pass 2: r = exp(s - mx) / l - e_yhat chunk by chunk (logits recomputed)
    #     HEAD:     beta[:, h-chunk] = sum over M chunks of r F[m-chunk, h-chunk] / tau
    #     queries:  alpha[:, m-chunk] = r
    pid = tl.program_id(0)
    n_valid = tl.minimum(tl.load(n_ptr), CAP)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] candidate rows
    mask_n = offs_n < n_valid
    offs_n64 = offs_n.to(tl.int64)
    a_ty = alpha_ptr.dtype.element_ty
    b_ty = beta_ptr.dtype.element_ty

    # -- the key tile is alpha (HEAD) or beta = k / tau; |.|^2 from the stored values ---------
    k_sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_nd = mask_n[:, None] & (offs_d < D)[None, :]
        k = tl.load(k_ptr + offs_n64[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=mask_nd, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        k_sq += _store_key_chunk(k, alpha_ptr, beta_ptr, offs_n64, offs_d, mask_nd, stride_an,
                                 stride_bn, tau, HEAD)

    # -- pass 1: row max, first argmax, sum of exponentials --------------------------------
    mx = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    lsum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    yhat = tl.zeros((BLOCK_N,), dtype=tl.int32)
    for m0 in range(0, M, BLOCK_M):
        s = _logit_chunk(k_ptr, q_ptr, offs_n64, mask_n, m0, M, D, tau, stride_kn, stride_kd,
                         stride_qm, stride_qd, BLOCK_N, BLOCK_M, BLOCK_D, PRECISION)
        cmax = tl.max(s, axis=1)
        carg = tl.argmax(s, axis=1, tie_break_left=True).to(tl.int32) + m0
        yhat = tl.where(cmax > mx, carg, yhat)  # a later chunk wins only when strictly larger
        new = tl.maximum(mx, cmax)
        lsum = lsum * tl.exp(mx - new) + tl.sum(tl.exp(s - new[:, None]), axis=1)
        mx = new

    # -- pass 2: the residuals, chunk by chunk ---------------------------------------------
    if HEAD:
        b_sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for h0 in range(0, DH, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask_h = offs_h < DH
            acc = tl.zeros((BLOCK_N, BLOCK_H), dtype=tl.float32)
            for m0 in range(0, M, BLOCK_M):
                s = _logit_chunk(k_ptr, q_ptr, offs_n64, mask_n, m0, M, D, tau, stride_kn,
                                 stride_kd, stride_qm, stride_qd, BLOCK_N, BLOCK_M, BLOCK_D,
                                 PRECISION)
                r = _residual_chunk(s, mx, lsum, yhat, m0, M, BLOCK_M)
                offs_m = m0 + tl.arange(0, BLOCK_M)
                f = tl.load(f_ptr + offs_m[:, None] * stride_fm + offs_h[None, :] * stride_fh,
                            mask=(offs_m < M)[:, None] & mask_h[None, :],
                            other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_H]
                acc += tl.dot(r, f, input_precision=PRECISION)
            beta = tl.math.div_rn(acc, tau).to(b_ty)
            tl.store(beta_ptr + offs_n64[:, None] * stride_bn + offs_h[None, :], beta,
                     mask=mask_n[:, None] & mask_h[None, :])
            beta = beta.to(tl.float32)
            b_sq += tl.sum(beta * beta, axis=1)
        sqn = k_sq * b_sq
    else:
        r_sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for m0 in range(0, M, BLOCK_M):
            s = _logit_chunk(k_ptr, q_ptr, offs_n64, mask_n, m0, M, D, tau, stride_kn,
                             stride_kd, stride_qm, stride_qd, BLOCK_N, BLOCK_M, BLOCK_D,
                             PRECISION)
            ra = _residual_chunk(s, mx, lsum, yhat, m0, M, BLOCK_M).to(a_ty)
            offs_m = m0 + tl.arange(0, BLOCK_M)
            tl.store(alpha_ptr + offs_n64[:, None] * stride_an + offs_m[None, :], ra,
                     mask=mask_n[:, None] & (offs_m < M)[None, :])
            ra = ra.to(tl.float32)
            r_sq += tl.sum(ra * ra, axis=1)
        sqn = r_sq * k_sq
    tl.store(sqn_ptr + offs_n, sqn, mask=mask_n)


def _check_devices(keys, queries, feats):
    devs = {t.device for t in (keys, queries, feats) if t is not None}
    if len(devs) > 1:
        raise ValueError(f"grad_embed (triton): keys, queries and feats must be on one device; "
                         f"got {sorted(str(d) for d in devs)}")


def embed_into(keys, queries, f, alpha, beta, beta_c, sqn, n_t, *, tau, view, gram,
               precision):
    """Launch the kernel into given buffers (the capacity-shaped ones of kernels/triton_select.py,
    or per-call ones): rows n < min(n_t[0], cap) of alpha [cap, a], beta / beta_c [cap, b] and
    sqn [cap] are written; f is H (or R_H^T) for the head view, G = H H^T for the Gram route,
    unused for the queries view. n_t: int32 [1] on the device (no host sync, graph-capturable)."""
    cap, d = keys.shape
    m = queries.shape[0]
    head = view == "head"
    dh = f.shape[1]
    bc = beta if beta_c is None else beta_c
    block_d = 128 if INTERPRETED else 64
    prec = precision_of(precision)
    factors = "bf16" if alpha.dtype == torch.bfloat16 else "fp32"
    block_n, warps = embed_config(m, view, gram, prec, factors)
    block_h = max(16, min(block_d, triton.next_power_of_2(dh)))  # dh = M on the Gram route
    if m > MAX_M:  # the pseudo-labels in chunks (no Gram route: GRAM_MAX_M < MAX_M)
        _grad_embed_tiled_kernel[(triton.cdiv(cap, block_n),)](
            keys, queries, f, alpha, beta, sqn, n_t,
            cap, m, d, dh, float(tau),
            keys.stride(0), keys.stride(1), queries.stride(0), queries.stride(1),
            f.stride(0), f.stride(1), alpha.stride(0), beta.stride(0),
            HEAD=head, BLOCK_N=block_n, BLOCK_M=TILED_BLOCK_M,
            BLOCK_D=max(16, min(block_d, triton.next_power_of_2(d))), BLOCK_H=block_h,
            PRECISION=prec, num_warps=warps, num_stages=2, enable_fp_fusion=False,
        )
        return
    _grad_embed_kernel[(triton.cdiv(cap, block_n),)](
        keys, queries, f, alpha, beta, bc, sqn, n_t,
        cap, m, d, dh, float(tau),
        keys.stride(0), keys.stride(1), queries.stride(0), queries.stride(1),
        f.stride(0), f.stride(1), alpha.stride(0), beta.stride(0), bc.stride(0),
        HEAD=head, GRAM=gram, BLOCK_N=block_n, BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_D=max(16, min(block_d, triton.next_power_of_2(d))), BLOCK_H=block_h,
        PRECISION=prec, num_warps=warps, num_stages=2, enable_fp_fusion=False,
    )


def check_m(m: int) -> None:
    if not 1 <= m <= TILED_MAX_M:
        raise ValueError(f"grad_embed (triton): M={m} pseudo-labels (queries) must be in "
                         f"[1, {TILED_MAX_M}]; use CMACC_KERNELS=reference for larger batches")


def grad_embed_triton_with_norms(
    keys: torch.Tensor,  # [N, d]
    queries: torch.Tensor,  # [M, d]
    feats: torch.Tensor | None = None,  # [M, d_h]
    *,
    tau: float = 1.0,
    view: str = "head",
    compress: bool = False,
    precision: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(alpha [N, a], beta [N, b], sqn [N]) fp32 with sqn_n = |alpha_n|^2 |beta_n|^2.
    ``compress=True`` (head view): beta in the row space of H (reference.row_space_factor, a
    QR: for analysis; the selection path uses the Gram route of kernels/triton_select.py)."""
    reference._check_grad_embed_args(keys, queries, feats, tau, view)
    _check_devices(keys, queries, feats)
    n, d = keys.shape
    m = queries.shape[0]
    check_m(m)
    head = view == "head"
    if head:
        f = reference.row_space_factor(feats) if compress else feats  # [M, d_h or M]
    else:
        f = queries  # unused by the kernel in this view
    dh = f.shape[1]
    dev = keys.device
    alpha = torch.empty(n, d if head else m, device=dev, dtype=torch.float32)  # [N, a]
    beta = torch.empty(n, dh if head else d, device=dev, dtype=torch.float32)  # [N, b]
    sqn = torch.empty(n, device=dev, dtype=torch.float32)  # [N]
    if n == 0:
        return alpha, beta, sqn
    n_t = torch.full((1,), n, dtype=torch.int32, device=dev)
    embed_into(keys, queries, f, alpha, beta, None, sqn, n_t, tau=tau, view=view, gram=False,
               precision=precision)
    return alpha, beta, sqn


def grad_embed_triton(keys, queries, feats=None, *, tau=1.0, view="head", compress=False,
                      precision=None):
    """Drop-in for ``reference.grad_embed``: (alpha [N, a], beta [N, b]), fp32."""
    alpha, beta, _ = grad_embed_triton_with_norms(keys, queries, feats, tau=tau, view=view,
                                                  compress=compress, precision=precision)
    return alpha, beta
