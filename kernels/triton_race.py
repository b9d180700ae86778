"""The device pieces every k-means++ seeding variant shares (kernels/triton_kmeanspp.py: steps
and persistent; kernels/triton_lazy.py; kernels/triton_resident.py): the counter-based RNG of
the exponential race (``reference.uniform_hash`` bit for bit; ``uniform_hash_triton`` tests
it), the reduction of per-block (max score, first index) partials to a draw (in one or two
levels), the grid barrier of the cooperative launches, and the launch options.

``INTERPRETED`` is what Triton saw when these kernels were defined (TRITON_INTERPRET read at
the first import: set it before, see kernels/__init__.py); the variant modules import it from
here, so every seeding kernel is defined in the same mode.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import reference

__all__ = ["uniform_hash_triton", "INTERPRETED", "NO_FMA"]

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # as Triton saw it at definition
NO_FMA = dict(enable_fp_fusion=False)  # launch option: no contraction into FMAs (parity)


# ----------------------------------------------------------------------------------------------
# Counter-based RNG: reference.uniform_hash, reproduced on uint32 (wrapping arithmetic)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _fmix32(x):
    # murmur3 finaliser on uint32: the literals are > 2^31, so Triton types them uint32 and
    # the multiplies wrap mod 2^32, as the reference's uint32 arithmetic
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    x = x ^ (x >> 16)
    return x


@triton.jit
def _uniform(seed, t, offs_n):
    # key = fmix(seed32 ^ fmix(t * golden + 1));  h = fmix(fmix(n ^ key) + key)
    # U = ((h >> 9) + 0.5) * 2^-23  in [2^-24, 1 - 2^-24]: every value exact in fp32, never 1.0
    tk = tl.cast(t, tl.uint32) * 0x9E3779B9 + 1
    key = _fmix32(seed ^ _fmix32(tk))
    h = _fmix32(offs_n.to(tl.uint32) ^ key)
    h = _fmix32(h + key)
    return ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23


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
# Draw reductions: the largest of per-block partials (every variant but resident)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _best_pair(part_score_ptr, part_idx_ptr, P, BLOCK_P: tl.constexpr):
    # the largest of P partial scores, and the smallest index reaching it (each block already
    # broke its own ties to the left, so this is torch.argmax's first index): (score, index)
    offs_p = tl.arange(0, BLOCK_P)
    mask_p = offs_p < P
    score = tl.load(part_score_ptr + offs_p, mask=mask_p, other=float("-inf"))
    idx = tl.load(part_idx_ptr + offs_p, mask=mask_p, other=0)
    best = tl.max(score, axis=0)
    return best, tl.min(tl.where(mask_p & (score == best), idx, 2147483647), axis=0)


@triton.jit
def _best_of_partials(part_score_ptr, part_idx_ptr, P, BLOCK_P: tl.constexpr):
    # phase 2 of a draw: the index drawn from P partials
    _, idx = _best_pair(part_score_ptr, part_idx_ptr, P, BLOCK_P)
    return idx


@triton.jit(do_not_specialize=["t"])
def _reduce_partials_kernel(part_score_ptr, part_idx_ptr, P, R0, t, GROUP: tl.constexpr):
    # the second level of a large pool's reduction: program g reduces step t's level-1
    # partials [g GROUP, (g + 1) GROUP) to one level-2 partial at R0 + (t % 2) P2 + g; the next
    # launch then reads P2 = cdiv(P, GROUP) partials instead of P (at N = 1.2 M and 128 rows a
    # block, 10 instead of 9,600: a one-level [16384] tile took 255 registers and spilled)
    g = tl.program_id(0)
    src = (t % 2) * P + g * GROUP
    best, idx = _best_pair(part_score_ptr + src, part_idx_ptr + src, P - g * GROUP, GROUP)
    dst = R0 + (t % 2) * tl.num_programs(0) + g
    tl.store(part_score_ptr + dst, best)
    tl.store(part_idx_ptr + dst, idx)


# ----------------------------------------------------------------------------------------------
# Grid barrier of the cooperative launches (persistent, resident; CUDA only)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _grid_barrier(bar_ptr, target):
    # every program's stores of this step are visible to every program after this returns
    tl.debug_barrier()  # the program's threads are done writing (bar.sync)
    cnt = tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")
    while cnt < target:
        cnt = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------
def _reduced(cfg) -> tuple[int, int]:
    """(R0, RP): where a step's reduced partials start in the partials buffers (per ping-pong
    slot RP of them): the level-1 ones, or the level-2 ones after the grid's 2 P."""
    p = cfg["grid"]
    return (2 * p, cfg["P2"]) if cfg["P2"] else (0, p)


def _reduce(part_score, part_idx, t, cfg):
    """The second level of step t's reduction, if the grid needs one (one launch)."""
    if cfg["P2"]:
        _reduce_partials_kernel[(cfg["P2"],)](part_score, part_idx, cfg["grid"], 2 * cfg["grid"],
                                              t, GROUP=cfg["GROUP"], **NO_FMA)
