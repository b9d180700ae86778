"""Fused k-means++ seeding (DESIGN.md §1 steps 4-5) over factored embeddings g = alpha (x) beta.

State on the device: D [N] fp32 (min squared distance to the chosen centres; -1 marks chosen
or excluded candidates) and picks [k]. Step t is two launches and no host synchronisation:

  _step_kernel (grid over BLOCK_N rows), reading the newest centre c = picks[t-1] from memory:
      D_n <- min(D_n, |a_n|^2|b_n|^2 + |a_c|^2|b_c|^2 - 2 (a_n . a_c)(b_n . b_c))   (clamped >= 0)
      D_c <- -1
      E_n  = -log U(seed, t, n)     U: the integer hash of kernels/reference.py, bit for bit
      score_n = D_n / E_n  (D_n > 0),  -E_n  (D_n == 0, or step 0: a uniform draw),
                -inf (D_n < 0: never drawn)
      per-block (max score, first index reaching it) -> partials
  _reduce_kernel (one program): picks[t] = smallest index among the blocks' best scores.

The argmax of D_n / E_n with E_n ~ Exp(1) is a draw with probability D_n / sum D (the
exponential race), so the seeding law is exactly k-means++'s. The launch sequence is fixed for a
given shape, so it can be captured in a CUDA graph (``kmeanspp_triton(..., graph=True)`` on
CUDA: the seed lives in device memory, so one captured graph serves every seed). The
interpreter (TRITON_INTERPRET=1) runs the same per-step kernels.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import reference

_GOLDEN = 0x9E3779B9


@triton.jit
def _fmix32(x):
    # murmur3 finaliser on uint32 (wrapping multiplies), as reference._fmix32_t
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    x = x ^ (x >> 16)
    return x


@triton.jit
def _step_kernel(
    a_ptr, b_ptr, sqn_ptr, dmin_ptr, picks_ptr, seed_ptr, part_score_ptr, part_idx_ptr,
    N, A, B, t, stride_an, stride_bn,
    FIRST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    dmin = tl.load(dmin_ptr + offs_n, mask=mask_n, other=-1.0)

    if not FIRST:
        # -- min-distance update against the newest centre c ---------------------------------
        c = tl.load(picks_ptr + t - 1)
        dot_a = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for a0 in range(0, A, BLOCK_A):
            offs_a = a0 + tl.arange(0, BLOCK_A)
            mask_a = offs_a < A
            x = tl.load(a_ptr + offs_n[:, None] * stride_an + offs_a[None, :],
                        mask=mask_n[:, None] & mask_a[None, :], other=0.0).to(tl.float32)
            xc = tl.load(a_ptr + c * stride_an + offs_a, mask=mask_a, other=0.0).to(tl.float32)
            dot_a += tl.sum(x * xc[None, :], axis=1)
        dot_b = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for b0 in range(0, B, BLOCK_B):
            offs_b = b0 + tl.arange(0, BLOCK_B)
            mask_b = offs_b < B
            y = tl.load(b_ptr + offs_n[:, None] * stride_bn + offs_b[None, :],
                        mask=mask_n[:, None] & mask_b[None, :], other=0.0).to(tl.float32)
            yc = tl.load(b_ptr + c * stride_bn + offs_b, mask=mask_b, other=0.0).to(tl.float32)
            dot_b += tl.sum(y * yc[None, :], axis=1)
        sqn = tl.load(sqn_ptr + offs_n, mask=mask_n, other=0.0)
        sqc = tl.load(sqn_ptr + c)
        d = tl.maximum(sqn + sqc - 2.0 * (dot_a * dot_b), 0.0)
        dmin = tl.where(dmin >= 0, tl.minimum(dmin, d), dmin)
        dmin = tl.where(offs_n == c, -1.0, dmin)
        tl.store(dmin_ptr + offs_n, dmin, mask=mask_n)

    # -- exponential race: E_n = -log U(seed, t, n) ------------------------------------------
    seed = tl.load(seed_ptr).to(tl.uint32)  # already folded to 32 bits on the host
    tk = tl.cast(t, tl.uint32) * _GOLDEN + 1
    key = _fmix32(seed ^ _fmix32(tk))
    h = _fmix32(offs_n.to(tl.uint32) ^ key)
    h = _fmix32(h + key)
    u = ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2^-24
    e = -tl.log(u)
    if FIRST:
        score = -e
    else:
        score = tl.where(dmin > 0, dmin / e, -e)
    score = tl.where((dmin >= 0) & mask_n, score, float("-inf"))
    best = tl.max(score, axis=0)
    best_i = tl.argmax(score, axis=0, tie_break_left=True) + pid * BLOCK_N
    tl.store(part_score_ptr + pid, best)
    tl.store(part_idx_ptr + pid, best_i.to(tl.int64))


@triton.jit
def _reduce_kernel(part_score_ptr, part_idx_ptr, picks_ptr, P, t, BLOCK_P: tl.constexpr):
    offs = tl.arange(0, BLOCK_P)
    mask = offs < P
    score = tl.load(part_score_ptr + offs, mask=mask, other=float("-inf"))
    idx = tl.load(part_idx_ptr + offs, mask=mask, other=0)
    best = tl.max(score, axis=0)
    big = 9223372036854775807
    pick = tl.min(tl.where(mask & (score == best), idx, big), axis=0)
    tl.store(picks_ptr + t, pick)


def _block_n(n: int) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return max(16, min(1024, triton.next_power_of_2(n)))  # few programs: fast interpreter
    return 256


def _launch_steps(a, b, sqn, dmin, picks, seed_t, part_score, part_idx, k, block_n):
    n, na = a.shape
    nb = b.shape[1]
    p = part_score.shape[0]
    blk_a = max(16, min(128, triton.next_power_of_2(na)))
    blk_b = max(16, min(128, triton.next_power_of_2(nb)))
    for t in range(k):
        _step_kernel[(p,)](
            a, b, sqn, dmin, picks, seed_t, part_score, part_idx,
            n, na, nb, t, a.stride(0), b.stride(0),
            FIRST=(t == 0), BLOCK_N=block_n, BLOCK_A=blk_a, BLOCK_B=blk_b,
        )
        _reduce_kernel[(1,)](part_score, part_idx, picks, p, t,
                             BLOCK_P=max(16, triton.next_power_of_2(p)))


class _GraphedSeeding:
    """The k-step launch sequence captured once per shape in a CUDA graph; inputs are copied
    into static buffers and the seed lives in device memory."""

    def __init__(self, n, na, nb, k, device, block_n):
        self.a = torch.zeros(n, na, device=device)
        self.b = torch.zeros(n, nb, device=device)
        self.sqn = torch.zeros(n, device=device)
        self.dmin = torch.zeros(n, device=device)
        self.picks = torch.zeros(k, dtype=torch.int64, device=device)
        self.seed = torch.zeros(1, dtype=torch.int64, device=device)
        p = triton.cdiv(n, block_n)
        self.ps = torch.empty(p, device=device)
        self.pi = torch.empty(p, dtype=torch.int64, device=device)
        args = (self.a, self.b, self.sqn, self.dmin, self.picks, self.seed, self.ps, self.pi, k,
                block_n)
        dmin0 = self.dmin.clone()
        _launch_steps(*args)  # compile + warm up outside the capture
        self.dmin.copy_(dmin0)
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            _launch_steps(*args)

    def run(self, a, b, sqn, dmin, seed_t):
        self.a.copy_(a)
        self.b.copy_(b)
        self.sqn.copy_(sqn)
        self.dmin.copy_(dmin)
        self.seed.copy_(seed_t)
        self.graph.replay()
        return self.picks.clone()


_GRAPHS: dict = {}


def kmeanspp_triton(alpha, beta, k, *, seed, exclude=None, validate=True, sqn=None,
                    graph=None, block_n=None):
    """Drop-in for ``reference.kmeanspp``: long [k] distinct indices, same draws as the
    reference for the same seed. ``sqn`` (optional, [N]) is |alpha_n|^2 |beta_n|^2 if the caller
    has it (grad_embed_triton_with_norms). ``graph`` (default: on for CUDA tensors unless
    CMACC_GRAPH=0) replays a captured CUDA graph of the k steps. ``block_n`` overrides the rows
    per program (tests use it to exercise the cross-block reduction)."""
    if alpha.dim() != 2 or beta.dim() != 2 or alpha.shape[0] != beta.shape[0]:
        raise ValueError(
            f"kmeanspp: alpha [N, a] and beta [N, b] must share N; got {tuple(alpha.shape)} and "
            f"{tuple(beta.shape)}"
        )
    n = alpha.shape[0]
    reference._check_kmeanspp_args(n, k, exclude, alpha.device, validate)
    a = alpha if alpha.stride(1) == 1 else alpha.contiguous()
    b = beta if beta.stride(1) == 1 else beta.contiguous()
    if sqn is None:
        af, bf = a.float(), b.float()
        sqn = (af * af).sum(1) * (bf * bf).sum(1)  # [N], exactly as the reference
    dmin = torch.full((n,), float("inf"), device=a.device, dtype=torch.float32)
    if exclude is not None:
        dmin = dmin.masked_fill(exclude.to(a.device), -1.0)
    seed_t = torch.tensor([reference.seed32(seed)], dtype=torch.int64, device=a.device)
    block_n = block_n or _block_n(n)
    if graph is None:
        graph = a.is_cuda and os.environ.get("CMACC_GRAPH", "1") == "1"
    if graph:
        key = (n, a.shape[1], b.shape[1], k, a.dtype, b.dtype, a.device, block_n)
        g = _GRAPHS.get(key)
        if g is None:
            g = _GRAPHS[key] = _GraphedSeeding(n, a.shape[1], b.shape[1], k, a.device, block_n)
        return g.run(a, b, sqn, dmin, seed_t)
    picks = torch.empty(k, dtype=torch.int64, device=a.device)
    p = triton.cdiv(n, block_n)
    part_score = torch.empty(p, device=a.device, dtype=torch.float32)
    part_idx = torch.empty(p, device=a.device, dtype=torch.int64)
    _launch_steps(a, b, sqn, dmin, picks, seed_t, part_score, part_idx, k, block_n)
    return picks
