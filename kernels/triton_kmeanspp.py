"""Fused k-means++ seeding (DESIGN.md §1 steps 4-5) over factored embeddings g = alpha (x) beta.

State on the device: D [N] fp32 (min squared distance to the chosen centres; -1 marks chosen
or excluded candidates), picks [k] and two ping-pong buffers of per-block partials. Step t is
ONE launch of ``_kmeanspp_step_kernel`` (grid over BLOCK_N candidate rows), with no host
synchronisation anywhere in the k steps:

  1. (t > 0) finish step t-1's draw: every program reduces the P per-block partials of step
     t-1 to the same centre c (largest score, smallest index on ties); program 0 stores
     picks[t-1] = c.
  2. (t > 0) min-distance update against c, from the factored algebra:
        D_n <- min(D_n, |a_n|^2|b_n|^2 + |a_c|^2|b_c|^2 - 2 (a_n . a_c)(b_n . b_c))   (>= 0)
        D_c <- -1
  3. exponential race:  E_n = -log U(seed, t, n)  with U the integer hash of
     kernels/reference.py, bit for bit, and
        score_n = D_n / E_n  if D_n > 0;   -E_n  if D_n == 0 (or t == 0: a uniform draw);
                  -inf       if D_n < 0 (chosen / excluded: never drawn)
     each program writes its block's (max score, first index reaching it) to partials[t % 2].

A last one-program launch (``_kmeanspp_pick_kernel``) reduces the partials of step k-1. So the
k steps are k + 1 launches whose sequence depends only on the shape: on CUDA they are captured
once per shape in a CUDA graph and replayed (the seed lives in device memory, so one graph
serves every seed). The argmax of D_n / E_n with E_n ~ Exp(1) is a draw with probability
D_n / sum D (the exponential race), so the seeding law is exactly k-means++'s.

Determinism: every reduction that decides a pick is a max/min over values, never a float
atomic, and ties resolve to the smallest global index exactly as ``torch.argmax`` does.
Agreement with ``reference.kmeanspp`` is index-for-index: U is bit-identical; E, D and D/E are
fp32 values computed by different (correctly rounded to ~1 ulp) log, dot-product and division
routines, so two candidates whose scores agree to ~1e-7 relative could in principle order
differently -- the tests below check equality on thousands of draws.

The interpreter (TRITON_INTERPRET=1) runs the same per-step kernels; a persistent
single-kernel variant (one grid-wide barrier per step) is deliberately not offered: the
interpreter runs programs one after another, so a grid barrier would hang there, and it could
not be tested on CPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import reference

__all__ = ["kmeanspp_triton", "uniform_hash_triton", "INTERPRETED"]

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # as Triton saw it at definition


# ----------------------------------------------------------------------------------------------
# Counter-based RNG: reference.uniform_hash, reproduced on uint32 (wrapping arithmetic)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _fmix32(x):
    # murmur3 finaliser on uint32: the literals are > 2^31, so Triton types them uint32 and
    # the multiplies wrap mod 2^32 (reference._fmix32_t does the same on int64 with masks)
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    x = x ^ (x >> 16)
    return x


@triton.jit
def _uniform(seed, t, offs_n):
    # key = fmix(seed32 ^ fmix(t * golden + 1));  h = fmix(fmix(n ^ key) + key)
    # U = ((h >> 8) + 0.5) * 2^-24  in (0, 1), exactly representable in fp32
    tk = tl.cast(t, tl.uint32) * 0x9E3779B9 + 1
    key = _fmix32(seed ^ _fmix32(tk))
    h = _fmix32(offs_n.to(tl.uint32) ^ key)
    h = _fmix32(h + key)
    return ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2^-24


@triton.jit(do_not_specialize=["t"])
def _uniform_hash_kernel(u_ptr, seed_ptr, N, t, BLOCK_N: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    seed = tl.load(seed_ptr).to(tl.uint32)
    tl.store(u_ptr + offs_n, _uniform(seed, t, offs_n), mask=offs_n < N)


def uniform_hash_triton(seed: int, step: int, n: int, device=None) -> torch.Tensor:
    """U(seed, step, 0..n-1) [n] fp32 computed by the Triton RNG (for tests: it must equal
    ``reference.uniform_hash`` bit for bit)."""
    u = torch.empty(n, device=device, dtype=torch.float32)
    seed_t = torch.full((1,), reference.seed32(seed), dtype=torch.int64, device=device)
    block = 1024
    _uniform_hash_kernel[(triton.cdiv(n, block),)](u, seed_t, n, int(step) & 0xFFFFFFFF,
                                                   BLOCK_N=block)
    return u


# ----------------------------------------------------------------------------------------------
# The k-means++ step
# ----------------------------------------------------------------------------------------------
@triton.jit
def _best_of_partials(part_score_ptr, part_idx_ptr, P, BLOCK_P: tl.constexpr):
    # phase 2 of a draw: the largest block score, and the smallest index reaching it (each
    # block already broke its own ties to the left, so this is torch.argmax's first index)
    offs_p = tl.arange(0, BLOCK_P)
    mask_p = offs_p < P
    score = tl.load(part_score_ptr + offs_p, mask=mask_p, other=float("-inf"))
    idx = tl.load(part_idx_ptr + offs_p, mask=mask_p, other=0)
    best = tl.max(score, axis=0)
    return tl.min(tl.where(mask_p & (score == best), idx, 2147483647), axis=0)


@triton.jit(do_not_specialize=["t"])
def _kmeanspp_step_kernel(
    a_ptr, b_ptr, sqn_ptr, dmin_ptr, picks_ptr, seed_ptr, part_score_ptr, part_idx_ptr,
    N, A, B, P, t,
    stride_an, stride_bn,
    FIRST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    # Step t of k-means++ (module docstring):
    #   c = argmax over step t-1's partials;  picks[t-1] = c
    #   D_n = min(D_n, |g_n|^2 + |g_c|^2 - 2 (a_n . a_c)(b_n . b_c))  (clamped >= 0);  D_c = -1
    #   score_n = D_n / E_n (D_n > 0) | -E_n (D_n == 0 or t == 0) | -inf (D_n < 0)
    #   partials[t % 2][pid] = (max_n score_n, first n reaching it)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] candidate rows
    mask_n = offs_n < N
    dmin = tl.load(dmin_ptr + offs_n, mask=mask_n, other=-1.0)  # [BLOCK_N]

    if not FIRST:
        # -- finish step t-1's draw (every program computes the same c) ----------------------
        prev = ((t - 1) % 2) * P
        c = _best_of_partials(part_score_ptr + prev, part_idx_ptr + prev, P, BLOCK_P)
        tl.store(picks_ptr + t - 1, c.to(tl.int64), mask=pid == 0)
        c = c.to(tl.int64)  # row offsets below in 64 bits

        # -- min-distance update against the newest centre c ---------------------------------
        dot_a = tl.zeros((BLOCK_N,), dtype=tl.float32)  # a_n . a_c
        for a0 in range(0, A, BLOCK_A):
            offs_a = a0 + tl.arange(0, BLOCK_A)
            mask_a = offs_a < A
            x = tl.load(a_ptr + offs_n[:, None] * stride_an + offs_a[None, :],
                        mask=mask_n[:, None] & mask_a[None, :], other=0.0).to(tl.float32)
            xc = tl.load(a_ptr + c * stride_an + offs_a, mask=mask_a, other=0.0).to(tl.float32)
            dot_a += tl.sum(x * xc[None, :], axis=1)
        dot_b = tl.zeros((BLOCK_N,), dtype=tl.float32)  # b_n . b_c
        for b0 in range(0, B, BLOCK_B):
            offs_b = b0 + tl.arange(0, BLOCK_B)
            mask_b = offs_b < B
            y = tl.load(b_ptr + offs_n[:, None] * stride_bn + offs_b[None, :],
                        mask=mask_n[:, None] & mask_b[None, :], other=0.0).to(tl.float32)
            yc = tl.load(b_ptr + c * stride_bn + offs_b, mask=mask_b, other=0.0).to(tl.float32)
            dot_b += tl.sum(y * yc[None, :], axis=1)
        sqn = tl.load(sqn_ptr + offs_n, mask=mask_n, other=0.0)  # |g_n|^2
        sqc = tl.load(sqn_ptr + c)  # |g_c|^2
        d = tl.maximum(sqn + sqc - 2.0 * (dot_a * dot_b), 0.0)
        dmin = tl.where(dmin >= 0, tl.minimum(dmin, d), dmin)
        dmin = tl.where(offs_n == c, -1.0, dmin)
        tl.store(dmin_ptr + offs_n, dmin, mask=mask_n)

    # -- exponential race ----------------------------------------------------------------
    seed = tl.load(seed_ptr).to(tl.uint32)  # folded to 32 bits on the host (reference.seed32)
    e = -tl.log(_uniform(seed, t, offs_n))  # E_n ~ Exp(1)
    if FIRST:
        score = -e
    else:
        score = tl.where(dmin > 0, tl.math.div_rn(dmin, e), -e)  # IEEE division, as torch
    score = tl.where((dmin >= 0) & mask_n, score, float("-inf"))
    best = tl.max(score, axis=0)
    best_n = tl.argmax(score, axis=0, tie_break_left=True) + pid * BLOCK_N
    cur = (t % 2) * P
    tl.store(part_score_ptr + cur + pid, best)
    tl.store(part_idx_ptr + cur + pid, best_n.to(tl.int32))


@triton.jit(do_not_specialize=["t"])
def _kmeanspp_pick_kernel(part_score_ptr, part_idx_ptr, picks_ptr, P, t, BLOCK_P: tl.constexpr):
    # the last draw: picks[t] = argmax over step t's partials (one program)
    cur = (t % 2) * P
    c = _best_of_partials(part_score_ptr + cur, part_idx_ptr + cur, P, BLOCK_P)
    tl.store(picks_ptr + t, c.to(tl.int64))


def _step_config(n: int) -> dict:
    """Rows per program, column chunk and warps. Under the interpreter: few, large programs (it
    is slow per program). On GPU: [128-256, 32] fp32 tiles; ptxas reports ~95-106 registers and
    no spills for sm_90 (offline compile). No autotuning: the launch sequence is CUDA-graph
    captured, and no GPU was available to tune on (see bench/RESULTS.md)."""
    if INTERPRETED:
        return dict(BLOCK_N=max(16, min(1024, triton.next_power_of_2(n))), BLOCK_K=128,
                    num_warps=4)
    if n >= 65536:
        return dict(BLOCK_N=256, BLOCK_K=32, num_warps=8)
    return dict(BLOCK_N=128, BLOCK_K=32, num_warps=4)


def _launch_steps(a, b, sqn, dmin, picks, seed_t, part_score, part_idx, k, cfg):
    """The k + 1 launches of one seeding; a fixed sequence for a given shape (graph-capturable).
    part_score / part_idx hold 2 x P partials (ping-pong between consecutive steps)."""
    n, na = a.shape
    nb = b.shape[1]
    p = triton.cdiv(n, cfg["BLOCK_N"])
    blocks = dict(BLOCK_N=cfg["BLOCK_N"],
                  BLOCK_A=max(16, min(cfg["BLOCK_K"], triton.next_power_of_2(na))),
                  BLOCK_B=max(16, min(cfg["BLOCK_K"], triton.next_power_of_2(nb))),
                  BLOCK_P=max(16, triton.next_power_of_2(p)))
    for t in range(k):
        _kmeanspp_step_kernel[(p,)](
            a, b, sqn, dmin, picks, seed_t, part_score, part_idx,
            n, na, nb, p, t, a.stride(0), b.stride(0),
            FIRST=(t == 0), num_warps=cfg["num_warps"], **blocks,
        )
    _kmeanspp_pick_kernel[(1,)](part_score, part_idx, picks, p, k - 1, BLOCK_P=blocks["BLOCK_P"])


class _GraphedSeeding:
    """The k + 1 launches captured once per shape in a CUDA graph. Inputs are copied into the
    graph's static buffers; the seed lives in device memory, so one graph serves every seed."""

    def __init__(self, n, na, nb, k, device, cfg):
        self.a = torch.zeros(n, na, device=device)  # [N, a] fp32
        self.b = torch.zeros(n, nb, device=device)  # [N, b] fp32
        self.sqn = torch.zeros(n, device=device)  # [N]
        self.dmin = torch.zeros(n, device=device)  # [N]
        self.picks = torch.zeros(k, dtype=torch.int64, device=device)  # [k]
        self.seed = torch.zeros(1, dtype=torch.int64, device=device)
        p = triton.cdiv(n, cfg["BLOCK_N"])
        self.ps = torch.empty(2 * p, device=device)
        self.pi = torch.empty(2 * p, dtype=torch.int32, device=device)
        args = (self.a, self.b, self.sqn, self.dmin, self.picks, self.seed, self.ps, self.pi, k,
                cfg)
        _launch_steps(*args)  # compile + warm up outside the capture
        torch.cuda.synchronize(device)  # once per shape, at capture time only
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


_GRAPHS: dict = {}  # (shape, device, config) -> _GraphedSeeding


def kmeanspp_triton(
    alpha: torch.Tensor,  # [N, a]
    beta: torch.Tensor,  # [N, b]
    k: int,
    *,
    seed: int,
    exclude: torch.Tensor | None = None,  # bool [N]
    validate: bool = True,
    sqn: torch.Tensor | None = None,  # [N] |alpha_n|^2 |beta_n|^2, if the caller has it
    graph: bool | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Drop-in for ``reference.kmeanspp``: long [k] distinct indices, the reference's draws for
    the same seed. Factors of any float dtype (computed on in fp32).

    ``sqn``: |alpha_n|^2 |beta_n|^2 from ``grad_embed_triton_with_norms`` (saves a pass).
    ``graph``: replay the k steps from a CUDA graph cached per shape (default: on for CUDA
    tensors unless CMACC_GRAPH=0). ``block_n``: rows per program (tests use it to make the
    cross-block reduction decide picks). ``validate=True`` syncs once to count the eligible
    candidates, as the reference does; nothing else leaves the device."""
    if alpha.dim() != 2 or beta.dim() != 2 or alpha.shape[0] != beta.shape[0]:
        raise ValueError(
            f"kmeanspp: alpha [N, a] and beta [N, b] must share N; got {tuple(alpha.shape)} and "
            f"{tuple(beta.shape)}"
        )
    if beta.device != alpha.device or (sqn is not None and sqn.shape != alpha.shape[:1]):
        raise ValueError("kmeanspp (triton): alpha, beta and sqn [N] must be on one device with "
                         f"one N; got {alpha.device}/{beta.device}, sqn "
                         f"{None if sqn is None else tuple(sqn.shape)}")
    n = alpha.shape[0]
    reference._check_kmeanspp_args(n, k, exclude, alpha.device, validate)
    dev = alpha.device
    a = alpha if alpha.stride(1) == 1 else alpha.contiguous()  # [N, a]
    b = beta if beta.stride(1) == 1 else beta.contiguous()  # [N, b]
    if n * max(a.stride(0), b.stride(0), 1) >= 2**31:  # the kernel's element offsets are int32
        raise ValueError(f"kmeanspp (triton): alpha {tuple(a.shape)} / beta {tuple(b.shape)} "
                         "span >= 2^31 elements; split the pool or use CMACC_KERNELS=reference")
    if sqn is None:
        af, bf = a.float(), b.float()
        sqn = (af * af).sum(1) * (bf * bf).sum(1)  # [N], exactly as the reference
    sqn = sqn.float().contiguous()
    dmin = torch.full((n,), float("inf"), device=dev, dtype=torch.float32)  # [N]
    if exclude is not None:
        dmin = dmin.masked_fill(exclude.to(dev), -1.0)
    # a fill kernel, not a host-to-device copy (a blocking copy would synchronise the stream)
    seed_t = torch.full((1,), reference.seed32(seed), dtype=torch.int64, device=dev)
    cfg = _step_config(n)
    if block_n is not None:
        cfg["BLOCK_N"] = block_n
    if graph is None:
        graph = a.is_cuda and os.environ.get("CMACC_GRAPH", "1") == "1"
    if graph:
        key = (n, a.shape[1], b.shape[1], k, dev, tuple(sorted(cfg.items())))
        g = _GRAPHS.get(key)
        if g is None:
            g = _GRAPHS[key] = _GraphedSeeding(n, a.shape[1], b.shape[1], k, dev, cfg)
        return g.run(a, b, sqn, dmin, seed_t)
    picks = torch.empty(k, dtype=torch.int64, device=dev)  # [k]
    p = triton.cdiv(n, cfg["BLOCK_N"])
    part_score = torch.empty(2 * p, device=dev, dtype=torch.float32)  # [2, P] ping-pong
    part_idx = torch.empty(2 * p, device=dev, dtype=torch.int32)
    _launch_steps(a, b, sqn, dmin, picks, seed_t, part_score, part_idx, k, cfg)
    return picks
