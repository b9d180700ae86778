"""Fused gradient embedding (DESIGN.md §1 steps 1-3) in one pass over the candidate pool.

For a tile of BLOCK_N candidate keys, everything stays on chip:

    s   = K Q^T / tau                       [BLOCK_N, M]   (tl.dot over d in BLOCK_D chunks)
    p   = softmax(s);  yhat = argmax(s)     (first index on ties, as torch.argmax)
    r   = p - onehot(yhat)                  [BLOCK_N, M]   (dCE(p, yhat)/ds)
    view "queries":  alpha = r,  beta = K / tau
    view "head":     alpha = K,  beta = r F / tau      (second on-chip tl.dot over d_h chunks;
                                                        F = H, or R_H^T when compress=True)

plus sqn_n = |alpha_n|^2 |beta_n|^2 (the squared norm of g_n = alpha_n (x) beta_n, used by
k-means++). Each key is read once. Inputs may be fp32/fp16/bf16: every load is cast to fp32
before any arithmetic. Any N (masked tail), 1 <= M <= MAX_M (the whole softmax row lives in one
tile), d and d_h of any size (chunked loops, masked).

tl.dot precision: CMACC_DOT_PRECISION = ieee (default: true fp32 products, ~1e-6 relative to
the reference) | tf32x3 (NVIDIA tensor cores, ~fp32 accuracy) | tf32 (fastest, ~1e-3 relative;
may flip near-tied pseudo-labels).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import reference

__all__ = ["grad_embed_triton", "grad_embed_triton_with_norms", "MAX_M", "INTERPRETED"]

MAX_M = 256
_PRECISIONS = ("ieee", "tf32x3", "tf32")
# Triton picks the interpreter or the compiler when a kernel below is defined (TRITON_INTERPRET
# at import); the host code follows that choice, not the variable's value at call time.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _precision() -> str:
    """input_precision of the fp32 tl.dot calls (module docstring)."""
    choice = os.environ.get("CMACC_DOT_PRECISION", "ieee").strip().lower() or "ieee"
    if choice not in _PRECISIONS:
        raise ValueError(f"CMACC_DOT_PRECISION={choice!r} is not one of {_PRECISIONS}")
    return "ieee" if INTERPRETED else choice


def _grad_embed_configs() -> list:
    """Autotuning space: rows per program x warps, kept small (each config is a compile of a
    few seconds on the first call per (M, d, d_h, view)). sm_90 offline compile (kernels/_aot.py):
    all fit shared memory at M <= 256; BLOCK_N = 64 with 4 warps spills at M = 128, so it is not
    offered. Exactly one config under the interpreter (it cannot benchmark several), with large
    tiles because it is slow per program."""
    if INTERPRETED:
        return [triton.Config({"BLOCK_N": 64}, num_warps=4)]
    return [triton.Config({"BLOCK_N": bn}, num_warps=nw, num_stages=2)
            for bn, nw in ((16, 4), (32, 4), (32, 8), (64, 8))]


def _prune_configs(configs, named_args, **kwargs):
    """Keep the [BLOCK_N, BLOCK_M] fp32 logit/residual tiles at <= 8K elements (register
    budget); BLOCK_N = 16 always survives."""
    block_m = {**named_args, **kwargs}["BLOCK_M"]
    kept = [c for c in configs if c.kwargs["BLOCK_N"] * block_m <= 8192]
    return kept or [c for c in configs if c.kwargs["BLOCK_N"] == 16][:1] or configs[:1]


@triton.autotune(configs=_grad_embed_configs(), key=["M", "D", "DH", "HEAD"],
                 prune_configs_by={"early_config_prune": _prune_configs})
@triton.jit
def _grad_embed_kernel(
    k_ptr, q_ptr, f_ptr, alpha_ptr, beta_ptr, sqn_ptr,
    N, M, D, DH, tau,
    stride_kn, stride_kd, stride_qm, stride_qd, stride_fm, stride_fh,
    stride_an, stride_bn,
    HEAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
):
    # One tile of candidates n (rows), all M pseudo-labels j (columns):
    #   s_nj = k_n . q_j / tau;  p_n = softmax_j(s_n);  yhat_n = argmax_j s_nj;  r_n = p_n - e_yhat
    #   HEAD:     alpha_n = k_n,  beta_n = r_n F / tau      sqn_n = |k_n|^2 |beta_n|^2
    #   queries:  alpha_n = r_n,  beta_n = k_n / tau        sqn_n = |r_n|^2 |k_n|^2 / tau^2
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] candidate rows
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M] pseudo-labels (queries)
    mask_n = offs_n < N
    mask_m = offs_m < M
    offs_n64 = offs_n.to(tl.int64)  # row offsets of big pools in 64 bits

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
        k_sq += tl.sum(k * k, axis=1)
        if HEAD:  # alpha = k, an fp32 copy
            tl.store(alpha_ptr + offs_n64[:, None] * stride_an + offs_d[None, :], k, mask=mask_nd)
        else:  # beta = k / tau
            tl.store(beta_ptr + offs_n64[:, None] * stride_bn + offs_d[None, :],
                     tl.math.div_rn(k, tau), mask=mask_nd)
    s = tl.math.div_rn(s, tau)
    s = tl.where(mask_m[None, :], s, float("-inf"))

    # -- softmax, pseudo-label, residual r = p - e_yhat ------------------------------------
    s_max = tl.max(s, axis=1)
    e = tl.exp(s - s_max[:, None])
    p = e / tl.sum(e, axis=1)[:, None]
    yhat = tl.argmax(s, axis=1, tie_break_left=True)  # [BLOCK_N]
    r = p - tl.where(offs_m[None, :] == yhat[:, None], 1.0, 0.0)
    r = tl.where(mask_m[None, :], r, 0.0)  # [BLOCK_N, BLOCK_M]

    if HEAD:
        # -- beta = r F / tau over d_h in chunks (F: [M, d_h] or [M, M] compressed) ----------
        b_sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for h0 in range(0, DH, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask_h = offs_h < DH
            f = tl.load(f_ptr + offs_m[:, None] * stride_fm + offs_h[None, :] * stride_fh,
                        mask=mask_m[:, None] & mask_h[None, :], other=0.0).to(tl.float32)
            beta = tl.math.div_rn(tl.dot(r, f, input_precision=PRECISION), tau)
            tl.store(beta_ptr + offs_n64[:, None] * stride_bn + offs_h[None, :], beta,
                     mask=mask_n[:, None] & mask_h[None, :])
            b_sq += tl.sum(beta * beta, axis=1)
        sqn = k_sq * b_sq
    else:
        tl.store(alpha_ptr + offs_n64[:, None] * stride_an + offs_m[None, :], r,
                 mask=mask_n[:, None] & mask_m[None, :])
        sqn = tl.sum(r * r, axis=1) * (k_sq / (tau * tau))
    tl.store(sqn_ptr + offs_n, sqn, mask=mask_n)


def _check_devices(keys, queries, feats):
    devs = {t.device for t in (keys, queries, feats) if t is not None}
    if len(devs) > 1:
        raise ValueError(f"grad_embed (triton): keys, queries and feats must be on one device; "
                         f"got {sorted(str(d) for d in devs)}")


def grad_embed_triton_with_norms(
    keys: torch.Tensor,  # [N, d]
    queries: torch.Tensor,  # [M, d]
    feats: torch.Tensor | None = None,  # [M, d_h]
    *,
    tau: float = 1.0,
    view: str = "head",
    compress: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(alpha [N, a], beta [N, b], sqn [N]) fp32 with sqn_n = |alpha_n|^2 |beta_n|^2.
    ``compress=True`` (head view): beta in the row space of H (reference.row_space_factor,
    an M x M torch QR on the host side, no synchronisation), b = min(M, d_h)."""
    reference._check_grad_embed_args(keys, queries, feats, tau, view)
    _check_devices(keys, queries, feats)
    n, d = keys.shape
    m = queries.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"grad_embed (triton): M={m} pseudo-labels (queries) must be in "
                         f"[1, {MAX_M}]; use CMACC_KERNELS=reference for larger batches")
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
    block_d = 128 if INTERPRETED else 64
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _grad_embed_kernel[grid](
        keys, queries, f, alpha, beta, sqn,
        n, m, d, dh, float(tau),
        keys.stride(0), keys.stride(1), queries.stride(0), queries.stride(1),
        f.stride(0), f.stride(1), alpha.stride(0), beta.stride(0),
        HEAD=head, BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_D=max(16, min(block_d, triton.next_power_of_2(d))),
        BLOCK_H=max(16, min(block_d, triton.next_power_of_2(dh))),
        PRECISION=_precision(),
    )
    return alpha, beta, sqn


def grad_embed_triton(keys, queries, feats=None, *, tau=1.0, view="head", compress=False):
    """Drop-in for ``reference.grad_embed``: (alpha [N, a], beta [N, b]), fp32."""
    alpha, beta, _ = grad_embed_triton_with_norms(keys, queries, feats, tau=tau, view=view,
                                                  compress=compress)
    return alpha, beta
