"""Reference ops in plain PyTorch (the k-means++ steps in numpy for CPU tensors): the contract
every Triton kernel must meet.

Math (docs/DESIGN.md §1, steps 1-5). For candidate keys k_n (rows of ``keys``, N x d) and the M
pseudo-label queries q_j (rows of ``queries``, M x d) with their pre-head features h_j (rows
of ``feats``, M x d_h):

    s_nj = k_n . q_j / tau          p_n = softmax_j(s_n)       yhat_n = argmax_j p_nj
    r_n  = p_n - e_{yhat_n}                                    (dCE/ds_n)

The gradient of CE(p_n, yhat_n) w.r.t. the last layer is a rank-1 outer product
g_n = alpha_n (x) beta_n, never materialised here:

    view="head":    alpha_n = k_n          (d)    beta_n = H^T r_n / tau   (d_h)
    view="queries": alpha_n = r_n          (M)    beta_n = k_n / tau       (d)

and ||g_n - g_c||^2 = |a_n|^2 |b_n|^2 + |a_c|^2 |b_c|^2 - 2 (a_n . a_c)(b_n . b_c).

Which gradient the head view is. The encoder's query is q_j = (W h_j + b) / |W h_j + b|
(cmacc/encoders.py), and r_n is taken at the logits of those normalised queries. The head view
then differentiates as if q_j = W h_j: g_n = k_n (H^T r_n)^T / tau is dCE/dW of CE on the
logits k_n . (W h_j) / tau with the residual evaluated at the normalised logits -- the exact
gradient with the normalisation's Jacobian (I - q_j q_j^T) / |W h_j + b| replaced by the
identity (autograd: a straight-through normalisation, ``grad_embed_autograd(...,
query="straight-through")``). That keeps it rank 1. The exact gradient through the
normalisation ("head-exact": ``exact_factors``, ``grad_embed_exact``, ``select_exact``;
reference only) is a rank-1 term plus a term in the span of the M products q_j h_j^T, and is
selected on d + 3M floats a candidate; docs/FIDELITY.md §6 measures how much its picks differ.

The selection path (``select_factors``, ``select``) needs only those dot products, so in the
head view with d_h > M it never forms H^T r_n: with the Gram matrix G = H H^T (M x M) it keeps
beta_n = r_n / tau (M) and a centre-side factor bc_n = G r_n / tau (M), and
beta_n . bc_c = r_n^T G r_c / tau^2 = (H^T r_n) . (H^T r_c) / tau^2 -- exact, no QR. ``kmeanspp``
takes that optional ``beta_c``:

    ||g_n - g_c||^2 = sqn_n + sqn_c - 2 (a_n . a_c)(b_n . bc_c)     sqn_n = |a_n|^2 (b_n . bc_n)

k-means++ seeding draws each centre by an *exponential race*: with E_n ~ Exp(1) from a
counter-based RNG keyed by (seed, step, n), the candidate maximising D_n / E_n is drawn with
probability D_n / sum(D) -- the D^2 law -- and the race needs only a max-reduction. The RNG is
integer-only (murmur3 finaliser on 32-bit words) so the Triton kernel reproduces the draws bit
for bit; see ``uniform_hash``. A candidate whose |g_n|^2 is not finite (NaN or Inf in its
factors) is never drawn, exactly like an excluded one.

Everything here is deterministic for a given seed and runs on any device without a host
synchronisation inside the k steps (the optional argument check in ``kmeanspp`` syncs once).
On CPU tensors the k steps run in numpy on views of the same memory (``_NUMPY_ON_CPU``): same
rules, same uniforms bit for bit, and 2x faster on a 2-core machine than eager torch. For a
small pool those steps run with one BLAS thread (``_blas_threads``).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "ExactFactors",
    "exact_factors",
    "grad_embed",
    "grad_embed_exact",
    "grad_embed_autograd",
    "hash_to_uniform",
    "kmeanspp",
    "kmeanspp_dense",
    "kmeanspp_exact",
    "materialise",
    "pairwise_sqdist_exact",
    "pairwise_sqdist_factored",
    "row_space_factor",
    "seed32",
    "select",
    "select_exact",
    "select_factors",
    "step_key",
    "uniform_hash",
    "uniform_hash_steps",
    "VIEWS",
]

VIEWS = ("head", "queries")

_MASK32 = 0xFFFFFFFF
# murmur3 fmix32 multipliers, and the golden-ratio increment used to key (seed, step).
_C1 = 0x85EBCA6B
_C2 = 0xC2B2AE35
_GOLDEN = 0x9E3779B9
_RNG_STEPS = 16  # race uniforms are generated for this many steps at once ([16, N] int32)
# Below this many factor floats read per k-means++ step, numpy's BLAS runs on one thread: each
# step's matrix-vector products then take tens of microseconds, and inside a training step a
# second BLAS thread, waking beside torch's own pool on the same cores, costs more than it gives.
# Measured on 2 cores (bench/RESULTS.md, "CPU selection"): CM-ACC in the MI study (N = 3,968)
# trained 150 steps in 25.1 s with two BLAS threads, 11.1 s with one (XMoCo: 5.5 s); the
# samplers' selection alone at that N, 83 vs 39 ms. The bare reference timed back to back in
# bench/bench_select_cpu.py is faster on two threads (19 vs 30 ms at N = 3,968), and so is the
# samplers' call at N = 38,400 (10M floats: 268 vs 328 ms). No pick depends on the threads.
_BLAS_ONE_THREAD_BELOW = 1 << 22
_blas = None  # threadpoolctl's controller, made on first use; False where it is missing


# ----------------------------------------------------------------------------------------------
# Counter-based RNG (integer only, identical in torch and Triton)
# ----------------------------------------------------------------------------------------------
# Tensors hold each uint32 word as its int32 bit pattern: xor, add and multiply wrap mod 2^32
# exactly as on uint32, and a logical right shift is the arithmetic one with the sign bits
# masked off. The pure-int versions below (``_fmix32_int``) are the spec the tests check against.
def _i32(c: int) -> int:
    """The int32 value with the bit pattern of the uint32 c."""
    c &= _MASK32
    return c - (1 << 32) if c >= 1 << 31 else c


def _fmix32_(x: torch.Tensor) -> torch.Tensor:
    """murmur3 fmix32, in place on an int32 tensor (uint32 bit patterns)."""
    x ^= (x >> 16) & 0xFFFF
    x *= _i32(_C1)
    x ^= (x >> 13) & 0x7FFFF
    x *= _i32(_C2)
    x ^= (x >> 16) & 0xFFFF
    return x


def _fmix32_int(x: int) -> int:
    x &= _MASK32
    x ^= x >> 16
    x = (x * _C1) & _MASK32
    x ^= x >> 13
    x = (x * _C2) & _MASK32
    x ^= x >> 16
    return x


def seed32(seed: int) -> int:
    """Fold any Python int seed into 32 bits."""
    seed = int(seed)
    if seed < 0:
        seed &= (1 << 64) - 1
    return (seed ^ (seed >> 32) ^ (seed >> 64)) & _MASK32


def step_key(seed: int, step: int) -> int:
    """The per-step 32-bit key h = fmix(seed32 ^ fmix(step * golden + 1)). Host-side int."""
    return _fmix32_int(seed32(seed) ^ _fmix32_int((int(step) * _GOLDEN + 1) & _MASK32))


def _step_keys(seed: int, step0: int, steps: int, device) -> torch.Tensor:
    """step_key(seed, t) for t in [step0, step0 + steps), computed on ``device`` (no copy from
    the host): int32 [steps]."""
    t = torch.arange(steps, device=device, dtype=torch.int32)
    t += _i32(step0)
    t *= _i32(_GOLDEN)
    t += 1
    t = _fmix32_(t)
    t ^= _i32(seed32(seed))
    return _fmix32_(t)


def _as_i32(idx: torch.Tensor) -> torch.Tensor:
    """Integer indices, reduced mod 2^32, as int32 bit patterns."""
    if idx.dtype == torch.int32:
        return idx
    idx = idx.to(torch.int64)
    return (((idx + (1 << 31)) & _MASK32) - (1 << 31)).to(torch.int32)


def hash_to_uniform(h: torch.Tensor) -> torch.Tensor:
    """U = ((h >> 9) + 0.5) * 2^-23 for 32-bit hashes h (an int32 tensor of bit patterns, or
    any integer tensor holding values in [0, 2^32)): fp32 in [2^-24, 1 - 2^-24], strictly inside
    (0, 1), every value exactly representable (23 bits + the half), so -log U is finite and > 0."""
    top = (_as_i32(h) >> 9) & 0x7FFFFF  # logical h >> 9: 23 bits
    return top.to(torch.float32).add_(0.5).mul_(2.0**-23)


def _hash_block(seed: int, step0: int, steps: int, idx: torch.Tensor) -> torch.Tensor:
    """The 32-bit hashes h(seed, t, n) = fmix(fmix(n ^ key_t) + key_t), key_t = step_key(seed, t),
    for t in [step0, step0 + steps) and the int32 indices ``idx`` [N]: int32 [steps, N]."""
    keys = _step_keys(seed, step0, steps, idx.device)[:, None]  # [S, 1]
    h = idx[None, :] ^ keys  # [S, N]
    h = _fmix32_(h)
    h += keys
    return _fmix32_(h)


def uniform_hash_steps(seed: int, step0: int, steps: int, n: int, device=None) -> torch.Tensor:
    """U(seed, t, n) for the steps t in [step0, step0 + steps) and n in [0, N), fp32 [steps, N],
    in one vectorised pass (bit for bit the rows of ``uniform_hash``)."""
    idx = torch.arange(n, device=device, dtype=torch.int32)
    return hash_to_uniform(_hash_block(seed, step0, steps, idx))


def uniform_hash(seed: int, step: int, n: int | torch.Tensor, device=None) -> torch.Tensor:
    """U(seed, step, n) in (0, 1), fp32, exactly representable: U = ((h >> 9) + 0.5) * 2^-23
    (``hash_to_uniform``, so U lies in [2^-24, 1 - 2^-24]) with the 32-bit hash
    h = fmix(fmix(n ^ key) + key), key = step_key(seed, step), fmix = murmur3's fmix32 and all
    arithmetic mod 2^32. ``n`` is an int N (the indices 0..N-1 are used) or an integer tensor
    of indices (taken mod 2^32)."""
    if isinstance(n, int):
        return uniform_hash_steps(seed, step, 1, n, device=device)[0]
    return hash_to_uniform(_hash_block(seed, step, 1, _as_i32(n.reshape(-1)))[0]).view(n.shape)


# ----------------------------------------------------------------------------------------------
# Gradient embedding (steps 1-3)
# ----------------------------------------------------------------------------------------------
def _check_grad_embed_args(keys, queries, feats, tau, view):
    if view not in VIEWS:
        raise ValueError(f"grad_embed: view={view!r} is not one of {VIEWS}")
    if keys.dim() != 2 or queries.dim() != 2:
        raise ValueError(
            f"grad_embed: keys must be [N, d] and queries [M, d]; got {tuple(keys.shape)} and "
            f"{tuple(queries.shape)}"
        )
    if keys.shape[1] != queries.shape[1]:
        raise ValueError(
            f"grad_embed: key dim {keys.shape[1]} != query dim {queries.shape[1]}; both must be "
            "the projection-head output size d"
        )
    if not tau > 0:
        raise ValueError(f"grad_embed: tau must be > 0, got {tau}")
    if view == "head":
        if feats is None:
            raise ValueError("grad_embed: view='head' needs feats [M, d_h] (pre-head features)")
        if feats.dim() != 2 or feats.shape[0] != queries.shape[0]:
            raise ValueError(
                f"grad_embed: feats must be [M, d_h] with M={queries.shape[0]}; got "
                f"{tuple(feats.shape)}"
            )


def _residual(k: torch.Tensor, q: torch.Tensor, tau: float) -> torch.Tensor:
    """r = softmax(k q^T / tau) - onehot(argmax), fp32 [N, M] (dCE/ds for the pseudo-labels)."""
    s = (k @ q.t()).div_(tau)  # [N, M]  (in place: no second [N, M] buffer)
    r = torch.softmax(s, dim=1)  # [N, M]  p
    yhat = s.argmax(dim=1)  # [N]
    return r.scatter_add_(1, yhat[:, None], -torch.ones_like(r[:, :1]))  # [N, M]  p - e_yhat


def grad_embed(
    keys: torch.Tensor,  # [N, d]
    queries: torch.Tensor,  # [M, d]
    feats: torch.Tensor | None = None,  # [M, d_h]
    *,
    tau: float = 1.0,
    view: str = "head",
    compress: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors (alpha [N, a], beta [N, b]), fp32, of the last-layer gradient embeddings
    g_n = alpha_n (x) beta_n (module docstring). Inputs of any float dtype; math in fp32.

    Which gradient (head view): dCE/dW of CE on the logits k_n . (W h_j) / tau, i.e. as if
    q_j = W h_j, with the residual r_n evaluated at the logits of ``queries`` -- the encoder's
    normalised queries in training. Given q_j = W h_j it is that gradient exactly; given the
    normalised q_j it leaves out the normalisation's Jacobian (I - q_j q_j^T) / |W h_j + b|
    (``grad_embed_autograd(..., query="straight-through")``). The gradient through the
    normalisation is ``grad_embed_exact``.

    ``compress=True`` (``head`` view only): beta is returned in the row space of H,
    beta'_n = R_H r_n / tau with H^T = Q_H R_H (thin QR), whenever d_h > M. Dot products and
    norms of beta' equal those of beta, so it is a materialisable compressed embedding with
    b = M (for analysis); the selection path uses ``select_factors`` instead (no QR).
    """
    _check_grad_embed_args(keys, queries, feats, tau, view)
    k = keys.float()  # [N, d]
    r = _residual(k, queries.float(), tau)  # [N, M]
    if view == "queries":
        return r, k / tau
    f = feats.float()  # [M, d_h]
    if compress:
        f = row_space_factor(f)  # [M, min(M, d_h)]
    return k, (r @ f) / tau  # [N, d], [N, d_h or M]


def row_space_factor(feats: torch.Tensor) -> torch.Tensor:
    """F' [M, m] with F' F'^T = H H^T (so r^T F' has the norms and dot products of r^T H).
    With H^T = Q R (thin QR, d_h >= M): F' = R^T [M, M]. When d_h <= M, H itself is returned."""
    f = feats.float()
    m, dh = f.shape
    if dh <= m:
        return f
    _, r = torch.linalg.qr(f.t(), mode="reduced")  # f.t() = Q R, R [M, M]
    return r.t().contiguous()


def _sqnorm(alpha: torch.Tensor, beta: torch.Tensor, beta_c: torch.Tensor) -> torch.Tensor:
    """|g_n|^2 = |a_n|^2 (b_n . bc_n), fp32 [N] (factors already fp32)."""
    return (alpha * alpha).sum(1) * (beta * beta_c).sum(1)


def select_factors(
    keys: torch.Tensor,  # [N, d]
    queries: torch.Tensor,  # [M, d]
    feats: torch.Tensor | None = None,  # [M, d_h]
    *,
    tau: float = 1.0,
    view: str = "head",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The selection path's factors (alpha [N, a], beta [N, b], beta_c [N, b] or None,
    sqn [N]), fp32, for ``kmeanspp(alpha, beta, k, beta_c=beta_c, sqn=sqn)``; no QR.

      queries view:         alpha = r   [N, M]   beta = k / tau     [N, d]    beta_c = None
      head view, d_h <= M:  alpha = k   [N, d]   beta = r H / tau   [N, d_h]  beta_c = None
      head view, d_h > M:   alpha = k   [N, d]   beta = r / tau     [N, M]    beta_c = r G / tau
                            with G = H H^T [M, M], so beta_n . beta_c_c = (r_n H).(r_c H) / tau^2

    and sqn_n = |alpha_n|^2 (beta_n . bc_n) = |g_n|^2 (bc = beta_c, or beta when None):
    |r|^2 |k|^2 / tau^2, |k|^2 |beta|^2 and |k|^2 (beta . beta_c) respectively.

    The head view's gradient is ``grad_embed``'s: the normalisation's Jacobian left out (r at
    the normalised logits, differentiated as if q_j = W h_j). ``select_exact`` selects over the
    gradient through the normalisation.
    """
    _check_grad_embed_args(keys, queries, feats, tau, view)
    k = keys.float()  # [N, d]
    r = _residual(k, queries.float(), tau)  # [N, M]
    # (in place where the values are the same: each fresh [N, M] buffer of a large pool costs
    # its page faults again on a CPU)
    if view == "queries":
        alpha, beta, beta_c = r, k / tau, None  # [N, M], [N, d]
    else:
        f = feats.float()  # [M, d_h]
        alpha = k
        if f.shape[1] <= f.shape[0]:
            beta, beta_c = (r @ f).div_(tau), None  # [N, d_h]
        else:
            beta_c = (r @ (f @ f.t())).div_(tau)  # [N, M]
            beta = r.div_(tau)  # [N, M]
    sqn = _sqnorm(alpha, beta, beta if beta_c is None else beta_c)  # [N]
    return alpha, beta, beta_c, sqn


# ----------------------------------------------------------------------------------------------
# The exact gradient through the query's L2 normalisation ("head-exact"; issue 27, item 1)
# ----------------------------------------------------------------------------------------------
# The encoder's query is q_j = z_j / nu_j with z_j = W h_j (+ b) and nu_j = |z_j|
# (cmacc/encoders.py). Through that normalisation, with u_nj = r_nj / (tau nu_j) and
# s_nj = q_j . k_n (the unscaled cosine), the gradient of CE(p_n, yhat_n) w.r.t. W is
#
#     g_n = sum_j u_nj (I - q_j q_j^T) k_n h_j^T = k_n (H^T u_n)^T - sum_j w_nj q_j h_j^T,
#     w_n = s_n o u_n                                                    (o: elementwise)
#
# a rank-1 term plus a term in the span of the M products q_j h_j^T: no longer rank 1. With the
# Gram matrices G = H H^T and C = Q Q^T (M x M) and z_n = s_n o (G u_n), inner products stay
# factored:
#
#     <g_n, g_c> = (k_n . k_c)(u_n^T G u_c) - w_n . z_c - z_n . w_c + w_n^T (G o C) w_c
#
# so a candidate needs d + 3M floats (k_n, u_n, w_n, z_n) and a centre two M x M products.
class ExactFactors(NamedTuple):
    """Per-candidate factors of the exact embedding (fp32): k [N, d], u [N, M], w [N, M],
    z [N, M]; the shared gram = G [M, M] and gram_qc = G o C [M, M]; sqn = |g_n|^2 [N]."""

    k: torch.Tensor
    u: torch.Tensor
    w: torch.Tensor
    z: torch.Tensor
    gram: torch.Tensor
    gram_qc: torch.Tensor
    sqn: torch.Tensor


def _check_exact_args(keys, head_out, feats, tau):
    """The exact embedding's inputs: keys [N, d], head_out [M, d] (W h_j + b, before the
    normalisation), feats [M, d_h]."""
    _check_grad_embed_args(keys, head_out, feats, tau, "head")


def _exact_parts(keys, head_out, feats, tau):
    """fp32 k [N, d], q [M, d] (normalised), u [N, M], w [N, M] and H [M, d_h] (see above)."""
    _check_exact_args(keys, head_out, feats, tau)
    k = keys.float()  # [N, d]
    zq = head_out.float()  # [M, d]
    nu = zq.norm(dim=1)  # [M]  |W h_j + b|
    q = zq / nu[:, None]  # [M, d]  the encoder's query
    s = k @ q.t()  # [N, M]  s_nj = q_j . k_n
    u = _residual(k, q, tau).div_(nu * tau)  # [N, M]  r_nj / (tau nu_j)
    return k, q, u, s.mul_(u), feats.float()


def exact_factors(
    keys: torch.Tensor,  # [N, d]
    head_out: torch.Tensor,  # [M, d] the head's outputs W h_j + b before the L2 normalisation
    feats: torch.Tensor,  # [M, d_h]
    *,
    tau: float = 1.0,
) -> ExactFactors:
    """Factors of the exact ("head-exact") gradient embedding: dCE/dW of the pseudo-label loss
    on the logits k_n . q_j / tau with q_j = (W h_j + b) / |W h_j + b| *through* the
    normalisation (the section comment above has the algebra). ``head_out`` must be the
    pre-normalisation output: the queries are its rows normalised, and |W h_j + b| scales u.
    Inputs of any float dtype; math in fp32. The bias gets no embedding (as in the head view)."""
    k, q, u, w, f = _exact_parts(keys, head_out, feats, tau)
    gram = f @ f.t()  # [M, M]  G = H H^T
    gram_qc = gram * (q @ q.t())  # [M, M]  G o C
    ug = u @ gram  # [N, M]  (G u_n)^T
    s = k @ q.t()  # [N, M]
    z = s * ug  # [N, M]  z_n = s_n o (G u_n)
    sqn = (k * k).sum(1) * (u * ug).sum(1) - 2.0 * (w * z).sum(1) + (w * (w @ gram_qc)).sum(1)
    return ExactFactors(k, u, w, z, gram, gram_qc, sqn)


def grad_embed_exact(
    keys: torch.Tensor,  # [N, d]
    head_out: torch.Tensor,  # [M, d] W h_j + b, before the normalisation
    feats: torch.Tensor,  # [M, d_h]
    *,
    tau: float = 1.0,
) -> torch.Tensor:
    """The exact embeddings materialised from the closed form, fp32 [N, d * d_h]:
    g_n = k_n (H^T u_n)^T - Q^T diag(w_n) H (tests, and selection over small pools:
    ``kmeanspp_dense``). ``grad_embed_exact_autograd`` is its independent reference."""
    k, q, u, w, f = _exact_parts(keys, head_out, feats, tau)
    g = k[:, :, None] * (u @ f)[:, None, :]  # [N, d, d_h]  k_n (H^T u_n)^T
    g -= torch.einsum("nj,jd,jh->ndh", w, q, f)  # sum_j w_nj q_j h_j^T
    return g.reshape(k.shape[0], -1)


def pairwise_sqdist_exact(f: ExactFactors, centres: torch.Tensor) -> torch.Tensor:
    """||g_n - g_c||^2 [N, C] of the exact embeddings from their factors, for the candidates
    ``centres`` (long [C]), fp32, clamped at 0."""
    cols = [x[centres].t() for x in (f.k, f.u, f.w, f.z)]  # [d, C], [M, C] x 3
    cross = _exact_cross(f.k, f.u, f.w, f.z, f.gram, f.gram_qc, *cols)  # [N, C]
    return (f.sqn[:, None] + f.sqn[centres][None, :] - 2.0 * cross).clamp_min(0.0)


def _exact_cross(k, u, w, z, gram, gram_qc, kc, uc, wc, zc):
    """<g_n, g_c> [N] for one centre (kc [d], uc, wc, zc [M]) or [N, C] for C centres (the
    same as columns: [d, C], [M, C]); torch tensors or numpy arrays alike. Four products over
    the pool, d + 3M floats a candidate; the centre's two M x M products are negligible."""
    return ((k @ kc) * (u @ (gram @ uc))  # (k_n . k_c)(u_n^T G u_c)
            - z @ wc  # z_n . w_c
            + w @ (gram_qc @ wc - zc))  # w_n^T (G o C) w_c - w_n . z_c


def grad_embed_autograd(
    keys: torch.Tensor,
    queries_or_head: torch.Tensor,
    feats: torch.Tensor | None = None,
    *,
    tau: float = 1.0,
    view: str = "head",
    query: str = "linear",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Materialised gradient embeddings by torch.autograd, one candidate at a time (tests only).

    view="head":    ``queries_or_head`` is the head weight W [d, d_h], z_j = W h_j (+ ``bias``);
                    returns dCE/dW flattened, [N, d * d_h], of CE on the logits k_n . q_j / tau
                    with the pseudo-label yhat_n = argmax_j of those logits, where ``query``
                    picks q_j:
                    "linear":           q_j = z_j (the unnormalised head output);
                    "normalised":       q_j = z_j / |z_j|, differentiated through the
                                        normalisation: the exact gradient (``grad_embed_exact``);
                    "straight-through": q_j takes the value z_j / |z_j| but is differentiated
                                        as if q_j = z_j (the normalisation's Jacobian left out):
                                        what the head view computes from the encoder's queries.
    view="queries": ``queries_or_head`` is Q [M, d]; returns dCE/dQ flattened, [N, M * d].
    Runs in the dtype of its inputs (use float64 for a tight reference)."""
    if query not in _AUTOGRAD_QUERIES:
        raise ValueError(f"grad_embed_autograd: query={query!r} is not one of {_AUTOGRAD_QUERIES}")
    out = []
    for n in range(keys.shape[0]):
        w = queries_or_head.detach().clone().requires_grad_(True)
        q = _autograd_query(w, feats, bias, query) if view == "head" else w  # [M, d]
        s = (keys[n] @ q.t()) / tau  # [M]
        target = s.detach().argmax()
        loss = torch.nn.functional.cross_entropy(s[None], target[None])
        (g,) = torch.autograd.grad(loss, w)
        out.append(g.reshape(-1))
    return torch.stack(out)


_AUTOGRAD_QUERIES = ("linear", "normalised", "straight-through")


def _autograd_query(w, feats, bias, query):
    z = feats @ w.t() + (0 if bias is None else bias)  # [M, d]
    if query == "linear":
        return z
    qn = torch.nn.functional.normalize(z, dim=1)  # the encoder's query
    return qn if query == "normalised" else z + (qn - z).detach()


def materialise(alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """g_n = alpha_n (x) beta_n, flattened: [N, a * b] (the thing the factored path avoids)."""
    return (alpha[:, :, None] * beta[:, None, :]).reshape(alpha.shape[0], -1)


def pairwise_sqdist_factored(alpha, beta, alpha_c, beta_c) -> torch.Tensor:
    """||g_n - g_c||^2 [N, C] between g_n = alpha_n (x) beta_n and the centres
    g_c = alpha_c (x) beta_c (rows of the last two arguments), from factors, fp32, clamped at 0."""
    a, b = alpha.float(), beta.float()
    ac, bc = alpha_c.float(), beta_c.float()
    sq = (a * a).sum(1) * (b * b).sum(1)  # [N]
    sqc = (ac * ac).sum(1) * (bc * bc).sum(1)  # [C]
    cross = (a @ ac.t()) * (b @ bc.t())  # [N, C]
    return (sq[:, None] + sqc[None, :] - 2.0 * cross).clamp_min(0.0)


# ----------------------------------------------------------------------------------------------
# k-means++ seeding (steps 4-5)
# ----------------------------------------------------------------------------------------------
def _check_kmeanspp_args(n: int, k: int, exclude: torch.Tensor | None, device, validate: bool,
                         nonfinite: torch.Tensor | None = None):
    """Checks k and the exclude mask's shape; with ``validate``, that k <= the eligible count
    (not excluded and, where ``nonfinite`` [N] bool is given, not non-finite): one host sync."""
    if k < 1:
        raise ValueError(f"kmeanspp: k must be >= 1, got {k}")
    if exclude is not None and (exclude.dim() != 1 or exclude.shape[0] != n):
        raise ValueError(
            f"kmeanspp: exclude must be a bool mask of shape [{n}], got {tuple(exclude.shape)}"
        )
    if not validate:
        return
    # One host sync: the eligible count decides whether the request can be met at all.
    out = torch.zeros(n, dtype=torch.bool, device=device)
    if exclude is not None:
        out |= exclude.to(device=device, dtype=torch.bool)
    bad = 0
    if nonfinite is not None:
        bad_mask = nonfinite.to(device) & ~out
        out |= bad_mask
        bad = int(bad_mask.sum())
    eligible = n - int(out.sum())
    if k > eligible:
        why = "eligible (not excluded)" if nonfinite is None else (
            f"eligible (not excluded; {bad} more had non-finite gradient embeddings, NaN or Inf "
            "in their factors: check the keys/queries/features)")
        raise ValueError(
            f"kmeanspp: asked for k={k} centres but only {eligible} of {n} candidates are "
            f"{why}; lower k or enlarge the candidate pool"
        )


def _check_factors(alpha, beta, beta_c=None, sqn=None):
    """kmeanspp's factor arguments: alpha [N, a], beta [N, b], beta_c [N, b] or None, sqn [N]
    or None, all on one device."""
    if alpha.dim() != 2 or beta.dim() != 2 or alpha.shape[0] != beta.shape[0]:
        raise ValueError(
            f"kmeanspp: alpha [N, a] and beta [N, b] must share N; got {tuple(alpha.shape)} and "
            f"{tuple(beta.shape)}"
        )
    if beta_c is not None and beta_c.shape != beta.shape:
        raise ValueError(f"kmeanspp: beta_c must have beta's shape {tuple(beta.shape)}, got "
                         f"{tuple(beta_c.shape)}")
    if sqn is not None and tuple(sqn.shape) != tuple(alpha.shape[:1]):
        raise ValueError(f"kmeanspp: sqn must be [{alpha.shape[0]}] (|g_n|^2), got "
                         f"{tuple(sqn.shape)}")
    devs = {t.device for t in (alpha, beta, beta_c, sqn) if t is not None}
    if len(devs) > 1:
        raise ValueError("kmeanspp: alpha, beta, beta_c and sqn must be on one device; got "
                         f"{sorted(map(str, devs))}")


# On CPU the k steps run in numpy, on views of the same memory, with not one torch op inside the
# loop: OpenBLAS's matrix-vector products stream the pool at close to memory bandwidth on
# 2 threads, and numpy's single-threaded element-wise ops on the [N] vectors need no thread
# wake-ups. On 2 cores the same loop in eager torch (MKL's products, an OpenMP fork/join for
# every [N] op) was 2-2.5x slower, and torch ops between OpenBLAS calls (their idle threads
# spinning) cost more still. (OpenBLAS's worker keeps spinning for a while after the loop, so
# multi-threaded torch ops started right after it run slower when threads outnumber cores.)
# Other devices run the loop in torch. Tests switch this off to check both draw the same picks.
_NUMPY_ON_CPU = True


def _host(*tensors):
    """numpy views of CPU tensors when the k steps run in numpy; the tensors otherwise."""
    if _NUMPY_ON_CPU and tensors[0].device.type == "cpu":
        return tuple(t.detach().numpy() for t in tensors)
    return tensors


def _blas_threads(floats_per_step: int, device) -> contextlib.AbstractContextManager:
    """One BLAS thread for a small pool's numpy k-means++ steps (``_BLAS_ONE_THREAD_BELOW``);
    no change otherwise, on other devices, or without threadpoolctl."""
    global _blas
    if (not _NUMPY_ON_CPU or torch.device(device).type != "cpu"
            or floats_per_step >= _BLAS_ONE_THREAD_BELOW):
        return contextlib.nullcontext()
    if _blas is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:  # an install without it: two threads, slower for small pools
            _blas = False
        else:
            _blas = ThreadpoolController()
    return _blas.limit(limits=1, user_api="blas") if _blas else contextlib.nullcontext()


def _fmix32_np(x: np.ndarray) -> np.ndarray:
    """murmur3 fmix32, in place on a uint32 array (numpy wraps and shifts logically)."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(_C1)
    x ^= x >> np.uint32(13)
    x *= np.uint32(_C2)
    x ^= x >> np.uint32(16)
    return x


def _uniform_steps_np(seed: int, step0: int, steps: int, n: int) -> np.ndarray:
    """``uniform_hash_steps`` in numpy (uint32 arithmetic), the same bits: fp32 [steps, N]."""
    keys = np.array([step_key(seed, t) for t in range(step0, step0 + steps)], np.uint32)[:, None]
    h = _fmix32_np(np.arange(n, dtype=np.uint32)[None, :] ^ keys)  # [S, N]
    h += keys
    h = _fmix32_np(h) >> np.uint32(9)
    u = h.astype(np.float32)
    u += np.float32(0.5)
    u *= np.float32(2.0**-23)
    return u


def _kmeanspp_loop(k, seed, unavailable, sqn, cross_to):
    """k-means++ seeding by the exponential race, for any distance of the form
    d(n, c) = max(sqn_n + sqn_c - 2 cross_to(c)_n, 0); ``cross_to`` takes a centre index and
    works on the arrays ``_host`` gives for this device (numpy for CPU tensors).

    D [N] fp32 holds min_c d(n, c) for available candidates and -inf for chosen or
    ``unavailable`` ones (the contract's "D = -1": never drawn). Step t scores
        -E_n (t = 0: a uniform draw) | D_n / E_n if D_n > 0 | -E_n if D_n == 0 | -inf if taken
    with E_n = -log U(seed, t, n) > 0, and draws the argmax (first index on ties). The uniforms
    of _RNG_STEPS steps are generated at once (one vectorised hash pass per block). Returns the
    picks, long [k] on sqn's device."""
    device, n = sqn.device, sqn.shape[0]
    inf = float("inf")
    dmin = torch.full_like(sqn, inf).masked_fill_(unavailable, -inf)  # [N]
    sqn, dmin = _host(sqn, dmin)
    if isinstance(dmin, np.ndarray):
        xp = np

        def log_u(step0, steps):
            return np.log(_uniform_steps_np(seed, step0, steps, n))

        def clamp0(d):
            return np.maximum(d, 0.0, out=d)
    else:
        xp = torch

        def log_u(step0, steps):
            return uniform_hash_steps(seed, step0, steps, n, device=device).log_()

        def clamp0(d):
            return d.clamp_min_(0.0)

    picks = []
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf rows: never drawn anyway
        for step in range(k):
            if step % _RNG_STEPS == 0:
                neg_e = log_u(step, min(_RNG_STEPS, k - step))  # -E [S, N]
                e = -neg_e
            j = step % _RNG_STEPS
            if step == 0:
                score = xp.where(dmin > 0, neg_e[j], dmin)  # -E, or -inf where unavailable
            else:  # D/E: 0 where D == 0 (replaced by -E), -inf where taken
                score = xp.where(dmin == 0, neg_e[j], dmin / e[j])
            c = score.argmax()  # first index on ties; a 0-dim tensor in torch (no host sync)
            picks.append(c)
            if step == k - 1:
                break
            d = sqn + sqn[c]  # [N]
            d -= 2.0 * cross_to(c)  # 2x is exact: rounds as sqn_n + sqn_c - 2 cross
            xp.fmin(dmin, clamp0(d), out=dmin)  # -inf stays (a NaN d never replaces D)
            dmin[c] = -inf
    if xp is np:
        return torch.from_numpy(np.stack(picks).astype(np.int64))
    return torch.stack(picks)


def kmeanspp(
    alpha: torch.Tensor,  # [N, a]
    beta: torch.Tensor,  # [N, b]
    k: int,
    *,
    seed: int,
    exclude: torch.Tensor | None = None,  # bool [N]
    validate: bool = True,
    beta_c: torch.Tensor | None = None,  # [N, b] centre-side factor (head view's Gram route)
    sqn: torch.Tensor | None = None,  # [N] |g_n|^2, if the caller has it
) -> torch.Tensor:
    """k distinct indices (long [k]) by k-means++ seeding over g_n = alpha_n (x) beta_n with
    factored fp32 distances

        d(n, c) = max(sqn_n + sqn_c - 2 (a_n . a_c)(b_n . bc_c), 0)

    where bc = ``beta_c`` if given (an asymmetric centre-side factor of beta's shape, see
    ``select_factors``) else beta, and sqn defaults to |a_n|^2 (b_n . bc_n); and the
    exponential-race D^2 draw. Excluded candidates, and those whose sqn_n is not finite (NaN or
    Inf), are never chosen. Deterministic per seed. Factors of any float dtype, math in fp32.
    ``validate=False`` skips the eligible-count check (and its host sync); the caller then
    guarantees k <= eligible (not excluded, finite sqn)."""
    _check_factors(alpha, beta, beta_c, sqn)
    a, b = alpha.float(), beta.float()
    bc = b if beta_c is None else beta_c.float()
    sqn = _sqnorm(a, b, bc) if sqn is None else sqn.float()  # [N]
    unavailable = _unavailable(sqn, exclude, k, validate)
    # One pass over the pool per step (a+b floats per candidate): two matrix-vector products.
    a, b, bc = _host(a, b, bc)

    def cross_to(c):
        return (a @ a[c]) * (b @ bc[c])  # [N]  (a_n . a_c)(b_n . bc_c)

    with _blas_threads(alpha.shape[0] * (alpha.shape[1] + beta.shape[1]), alpha.device):
        return _kmeanspp_loop(k, seed, unavailable, sqn, cross_to)


def _unavailable(sqn, exclude, k, validate) -> torch.Tensor:
    """bool [N]: excluded or non-finite |g_n|^2 (never drawn); checks k against the rest."""
    nonfinite = ~torch.isfinite(sqn)  # [N]
    _check_kmeanspp_args(sqn.shape[0], k, exclude, sqn.device, validate, nonfinite=nonfinite)
    if exclude is None:
        return nonfinite
    return nonfinite | exclude.to(device=sqn.device, dtype=torch.bool)


def kmeanspp_dense(
    x: torch.Tensor,  # [N, D] materialised embeddings
    k: int,
    *,
    seed: int,
    exclude: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """The same seeding (same RNG, same rules, non-finite |x_n|^2 never drawn) over
    materialised vectors: the baseline that the factored path is measured against, and a check
    of the factored algebra."""
    if x.dim() != 2:
        raise ValueError(f"kmeanspp_dense: x must be [N, D], got {tuple(x.shape)}")
    xf = x.float()
    sq = (xf * xf).sum(1)  # [N]
    unavailable = _unavailable(sq, exclude, k, validate)
    (xh,) = _host(xf)
    with _blas_threads(x.numel(), x.device):
        return _kmeanspp_loop(k, seed, unavailable, sq, lambda c: xh @ xh[c])


def select(
    keys: torch.Tensor,  # [N, d]
    queries: torch.Tensor,  # [M, d]
    feats: torch.Tensor | None,  # [M, d_h] (head view)
    k: int,
    *,
    seed: int,
    tau: float = 1.0,
    view: str = "head",
    exclude: torch.Tensor | None = None,  # bool [N]
    validate: bool = True,
) -> torch.Tensor:
    """The reference selection of one dictionary: ``select_factors`` + ``kmeanspp``. Returns k
    distinct long indices into ``keys``."""
    alpha, beta, beta_c, sqn = select_factors(keys, queries, feats, tau=tau, view=view)
    return kmeanspp(alpha, beta, k, seed=seed, exclude=exclude, validate=validate,
                    beta_c=beta_c, sqn=sqn)


def kmeanspp_exact(
    f: ExactFactors,
    k: int,
    *,
    seed: int,
    exclude: torch.Tensor | None = None,  # bool [N]
    validate: bool = True,
) -> torch.Tensor:
    """k distinct indices (long [k]) by the same k-means++ seeding as ``kmeanspp`` (same RNG,
    same race, same rules for excluded and non-finite candidates) over the exact embeddings,
    with factored fp32 distances d(n, c) = max(sqn_n + sqn_c - 2 <g_n, g_c>, 0) (the section
    comment above ``ExactFactors``): one pass over d + 3M floats a candidate per step."""
    n = f.sqn.shape[0]
    if any(x.dim() != 2 or x.shape[0] != n for x in (f.k, f.u, f.w, f.z)):
        raise ValueError("kmeanspp_exact: the factors k, u, w, z must be [N, .] with the N of "
                         f"sqn ({n}); build them with exact_factors")
    unavailable = _unavailable(f.sqn, exclude, k, validate)
    kk, u, w, z, gram, gram_qc = _host(f.k, f.u, f.w, f.z, f.gram, f.gram_qc)

    def cross_to(c):
        return _exact_cross(kk, u, w, z, gram, gram_qc, kk[c], u[c], w[c], z[c])  # [N]

    with _blas_threads(n * (f.k.shape[1] + 3 * f.u.shape[1]), f.k.device):
        return _kmeanspp_loop(k, seed, unavailable, f.sqn, cross_to)


def select_exact(
    keys: torch.Tensor,  # [N, d]
    head_out: torch.Tensor,  # [M, d] W h_j + b, before the normalisation
    feats: torch.Tensor,  # [M, d_h]
    k: int,
    *,
    seed: int,
    tau: float = 1.0,
    exclude: torch.Tensor | None = None,  # bool [N]
    validate: bool = True,
) -> torch.Tensor:
    """The selection over the exact ("head-exact") gradient embedding: ``exact_factors`` +
    ``kmeanspp_exact``. Reference only (no Triton kernel; not a ``select`` view). Returns k
    distinct long indices into ``keys``."""
    return kmeanspp_exact(exact_factors(keys, head_out, feats, tau=tau), k, seed=seed,
                          exclude=exclude, validate=validate)
