"""Fused gradient embedding (DESIGN.md §1 steps 1-3) in one pass over the candidate pool.

For a tile of BLOCK_N candidate keys, all on chip:

    s   = K Q^T / tau                       [BLOCK_N, M]   (tl.dot over d in BLOCK_D chunks)
    p   = softmax(s);  yhat = argmax(s)     (first index on ties, as torch.argmax)
    r   = p - onehot(yhat)                  [BLOCK_N, M]
    view "queries":  alpha = r,  beta = K / tau
    view "head":     alpha = K,  beta = r F / tau      (second on-chip tl.dot, F = H or R_H^T)

plus sqn_n = |alpha_n|^2 |beta_n|^2 (the squared norm of g_n, used by k-means++). Inputs may be
fp32/fp16/bf16: every load is cast to fp32 before any arithmetic. Any N (masked tail), M up to
MAX_M, d and d_h of any size (chunked loops, masked).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import reference

MAX_M = 256


def _precision() -> str:
    """fp32 products for tl.dot: 'ieee' (default, matches the reference to ~1e-6) or 'tf32'
    (CMACC_TF32=1, faster on tensor cores, ~1e-3 relative)."""
    return "tf32" if os.environ.get("CMACC_TF32", "0") == "1" else "ieee"


@triton.jit
def _grad_embed_kernel(
    k_ptr, q_ptr, f_ptr, alpha_ptr, beta_ptr, sqn_ptr,
    N, M, D, DH, inv_tau,
    stride_kn, stride_kd, stride_qm, stride_qd, stride_fm, stride_fh,
    stride_an, stride_bn,
    HEAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] candidate rows
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M] pseudo-labels (queries)
    mask_n = offs_n < N
    mask_m = offs_m < M

    # -- logits s = K Q^T / tau, accumulated over d in chunks -------------------------------
    s = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        k = tl.load(k_ptr + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        q = tl.load(q_ptr + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        s += tl.dot(k, tl.trans(q), input_precision=PRECISION)
        k_sq += tl.sum(k * k, axis=1)
    s = s * inv_tau
    s = tl.where(mask_m[None, :], s, float("-inf"))

    # -- softmax, pseudo-label, residual r = p - e_yhat --------------------------------------
    s_max = tl.max(s, axis=1)
    e = tl.exp(s - s_max[:, None])
    p = e / tl.sum(e, axis=1)[:, None]
    yhat = tl.argmax(s, axis=1, tie_break_left=True)  # [BLOCK_N]
    r = p - tl.where(offs_m[None, :] == yhat[:, None], 1.0, 0.0)
    r = tl.where(mask_m[None, :], r, 0.0)
    r_sq = tl.sum(r * r, axis=1)

    if HEAD:
        # alpha = k (fp32 copy), beta = r F / tau
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            k = tl.load(k_ptr + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                        mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
            tl.store(alpha_ptr + offs_n[:, None] * stride_an + offs_d[None, :], k,
                     mask=mask_n[:, None] & mask_d[None, :])
        b_sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for h0 in range(0, DH, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask_h = offs_h < DH
            f = tl.load(f_ptr + offs_m[:, None] * stride_fm + offs_h[None, :] * stride_fh,
                        mask=mask_m[:, None] & mask_h[None, :], other=0.0).to(tl.float32)
            beta = tl.dot(r, f, input_precision=PRECISION) * inv_tau  # [BLOCK_N, BLOCK_H]
            tl.store(beta_ptr + offs_n[:, None] * stride_bn + offs_h[None, :], beta,
                     mask=mask_n[:, None] & mask_h[None, :])
            b_sq += tl.sum(beta * beta, axis=1)
        sqn = k_sq * b_sq
    else:
        # alpha = r, beta = k / tau
        tl.store(alpha_ptr + offs_n[:, None] * stride_an + offs_m[None, :], r,
                 mask=mask_n[:, None] & mask_m[None, :])
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            k = tl.load(k_ptr + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                        mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
            tl.store(beta_ptr + offs_n[:, None] * stride_bn + offs_d[None, :], k * inv_tau,
                     mask=mask_n[:, None] & mask_d[None, :])
        sqn = r_sq * k_sq * inv_tau * inv_tau
    tl.store(sqn_ptr + offs_n, sqn, mask=mask_n)


def _blocks(m: int, d: int, dh: int) -> dict:
    """Tile sizes: BLOCK_M covers all M (softmax needs the whole row); tl.dot needs >= 16."""
    block_m = max(16, triton.next_power_of_2(m))
    block_n = 16 if (block_m >= 256 or os.environ.get("TRITON_INTERPRET") == "1") else 32
    if block_m <= 64 and os.environ.get("TRITON_INTERPRET") != "1":
        block_n = 64
    return dict(BLOCK_N=block_n, BLOCK_M=block_m,
                BLOCK_D=max(16, min(64, triton.next_power_of_2(d))),
                BLOCK_H=max(16, min(64, triton.next_power_of_2(dh))))


def grad_embed_triton_with_norms(keys, queries, feats=None, *, tau=1.0, view="head",
                                 compress=False):
    """(alpha [N, a], beta [N, b], sqn [N]) fp32; sqn_n = |alpha_n|^2 |beta_n|^2."""
    reference._check_grad_embed_args(keys, queries, feats, tau, view)
    n, d = keys.shape
    m = queries.shape[0]
    if m > MAX_M:
        raise ValueError(f"grad_embed (triton): M={m} pseudo-labels > {MAX_M}; use "
                         "CMACC_KERNELS=reference or a smaller batch")
    head = view == "head"
    if head:
        f = reference.row_space_factor(feats) if compress else feats  # [M, d_h or M]
    else:
        f = queries  # unused by the kernel in this view
    dh = f.shape[1]
    dev = keys.device
    alpha = torch.empty(n, d if head else m, device=dev, dtype=torch.float32)
    beta = torch.empty(n, dh if head else d, device=dev, dtype=torch.float32)
    sqn = torch.empty(n, device=dev, dtype=torch.float32)
    if n == 0:
        return alpha, beta, sqn
    blocks = _blocks(m, d, dh)
    grid = (triton.cdiv(n, blocks["BLOCK_N"]),)
    _grad_embed_kernel[grid](
        keys, queries, f, alpha, beta, sqn,
        n, m, d, dh, 1.0 / tau,
        keys.stride(0), keys.stride(1), queries.stride(0), queries.stride(1),
        f.stride(0), f.stride(1), alpha.stride(0), beta.stride(0),
        HEAD=head, PRECISION=_precision(), **blocks,
    )
    return alpha, beta, sqn


def grad_embed_triton(keys, queries, feats=None, *, tau=1.0, view="head", compress=False):
    """Drop-in for ``reference.grad_embed``: (alpha, beta), fp32."""
    alpha, beta, _ = grad_embed_triton_with_norms(keys, queries, feats, tau=tau, view=view,
                                                  compress=compress)
    return alpha, beta
