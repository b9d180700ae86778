"""Reference ops in plain PyTorch: the contract every Triton kernel must meet.

Math (DESIGN.md §1, steps 1-5). For candidate keys k_n (rows of ``keys``, N x d) and the M
pseudo-label queries q_j (rows of ``queries``, M x d) with their pre-head features h_j (rows
of ``feats``, M x d_h):

    s_nj = k_n . q_j / tau          p_n = softmax_j(s_n)       yhat_n = argmax_j p_nj
    r_n  = p_n - e_{yhat_n}                                    (dCE/ds_n)

The gradient of CE(p_n, yhat_n) w.r.t. the last layer is a rank-1 outer product
g_n = alpha_n (x) beta_n, never materialised here:

    view="head":    alpha_n = k_n          (d)    beta_n = H^T r_n / tau   (d_h)
    view="queries": alpha_n = r_n          (M)    beta_n = k_n / tau       (d)

and ||g_n - g_c||^2 = |a_n|^2 |b_n|^2 + |a_c|^2 |b_c|^2 - 2 (a_n . a_c)(b_n . b_c).

k-means++ seeding draws each centre by an *exponential race*: with E_n ~ Exp(1) from a
counter-based RNG keyed by (seed, step, n), the candidate maximising D_n / E_n is drawn with
probability D_n / sum(D) -- the D^2 law -- and the race needs only a max-reduction. The RNG is
integer-only (murmur3 finaliser on uint32) so the Triton kernel reproduces the draws bit for
bit; see ``uniform_hash``.

Everything here is deterministic for a given seed and runs on any device without a host
synchronisation inside the k steps (the optional argument check in ``kmeanspp`` syncs once).
"""

from __future__ import annotations

import torch

__all__ = [
    "grad_embed",
    "grad_embed_autograd",
    "kmeanspp",
    "kmeanspp_dense",
    "materialise",
    "pairwise_sqdist_factored",
    "row_space_factor",
    "seed32",
    "uniform_hash",
    "step_key",
    "VIEWS",
]

VIEWS = ("head", "queries")

_MASK32 = 0xFFFFFFFF
# murmur3 fmix32 multipliers, and the golden-ratio increment used to key (seed, step).
_C1 = 0x85EBCA6B
_C2 = 0xC2B2AE35
_GOLDEN = 0x9E3779B9


# ----------------------------------------------------------------------------------------------
# Counter-based RNG (integer only, identical in torch and Triton)
# ----------------------------------------------------------------------------------------------
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 tensors holding uint32 values, without int64 overflow."""
    lo = x & 0xFFFF
    hi = x >> 16
    return ((lo * c) + (((hi * c) & 0xFFFF) << 16)) & _MASK32


def _fmix32_t(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 13)
    x = _mul32(x, _C2)
    x = x ^ (x >> 16)
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


def uniform_hash(seed: int, step: int, n: int | torch.Tensor, device=None) -> torch.Tensor:
    """U(seed, step, n) in (0, 1), fp32, exactly representable: ((h >> 8) + 0.5) * 2^-24
    with h = fmix(fmix(n ^ key) + key), key = step_key(seed, step). ``n`` is an int N (the
    indices 0..N-1 are used) or an integer tensor of indices."""
    if isinstance(n, int):
        idx = torch.arange(n, device=device, dtype=torch.int64)
    else:
        idx = n.to(torch.int64)
    key = step_key(seed, step)
    h = _fmix32_t((idx & _MASK32) ^ key)
    h = _fmix32_t((h + key) & _MASK32)
    return ((h >> 8).to(torch.float32) + 0.5) * (2.0**-24)


def _exp1(seed: int, step: int, n: int, device) -> torch.Tensor:
    """E_n ~ Exp(1), fp32: -log(U)."""
    return -torch.log(uniform_hash(seed, step, n, device=device))


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

    ``compress=True`` (``head`` view only, used by the selection path): beta is returned in
    the row space of H, beta'_n = R_H r_n / tau with H^T = Q_H R_H (thin QR), whenever
    d_h > M. Dot products and norms of beta' equal those of beta, so k-means++ distances and
    picks are unchanged while b shrinks from d_h to M.
    """
    _check_grad_embed_args(keys, queries, feats, tau, view)
    k = keys.float()  # [N, d]
    q = queries.float()  # [M, d]
    s = (k @ q.t()) / tau  # [N, M]
    p = torch.softmax(s, dim=1)  # [N, M]
    yhat = s.argmax(dim=1)  # [N]
    r = p.scatter_add(1, yhat[:, None], -torch.ones_like(p[:, :1]))  # [N, M]  p - e_yhat
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


def grad_embed_autograd(
    keys: torch.Tensor,
    queries_or_head: torch.Tensor,
    feats: torch.Tensor | None = None,
    *,
    tau: float = 1.0,
    view: str = "head",
) -> torch.Tensor:
    """Materialised gradient embeddings by torch.autograd, one candidate at a time (tests only).

    view="head":    ``queries_or_head`` is the head weight W [d, d_h]; q_j = W h_j; returns
                    dCE/dW flattened, [N, d * d_h].
    view="queries": ``queries_or_head`` is Q [M, d]; returns dCE/dQ flattened, [N, M * d].
    Runs in the dtype of its inputs (use float64 for a tight reference)."""
    out = []
    for n in range(keys.shape[0]):
        w = queries_or_head.detach().clone().requires_grad_(True)
        q = feats @ w.t() if view == "head" else w  # [M, d]
        s = (keys[n] @ q.t()) / tau  # [M]
        target = s.detach().argmax()
        loss = torch.nn.functional.cross_entropy(s[None], target[None])
        (g,) = torch.autograd.grad(loss, w)
        out.append(g.reshape(-1))
    return torch.stack(out)


def materialise(alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """g_n = alpha_n (x) beta_n, flattened: [N, a * b] (the thing the factored path avoids)."""
    return (alpha[:, :, None] * beta[:, None, :]).reshape(alpha.shape[0], -1)


def pairwise_sqdist_factored(alpha, beta, alpha_c, beta_c) -> torch.Tensor:
    """||g_n - g_c||^2 [N, C] from factors, fp32, clamped at 0."""
    a, b = alpha.float(), beta.float()
    ac, bc = alpha_c.float(), beta_c.float()
    sq = (a * a).sum(1) * (b * b).sum(1)  # [N]
    sqc = (ac * ac).sum(1) * (bc * bc).sum(1)  # [C]
    cross = (a @ ac.t()) * (b @ bc.t())  # [N, C]
    return (sq[:, None] + sqc[None, :] - 2.0 * cross).clamp_min(0.0)


# ----------------------------------------------------------------------------------------------
# k-means++ seeding (steps 4-5)
# ----------------------------------------------------------------------------------------------
def _check_kmeanspp_args(n: int, k: int, exclude: torch.Tensor | None, device, validate: bool):
    if k < 1:
        raise ValueError(f"kmeanspp: k must be >= 1, got {k}")
    if exclude is not None and (exclude.dim() != 1 or exclude.shape[0] != n):
        raise ValueError(
            f"kmeanspp: exclude must be a bool mask of shape [{n}], got {tuple(exclude.shape)}"
        )
    if not validate:
        return
    # One host sync: the eligible count decides whether the request can be met at all.
    eligible = n if exclude is None else n - int(exclude.sum())
    if k > eligible:
        raise ValueError(
            f"kmeanspp: asked for k={k} centres but only {eligible} of {n} candidates are "
            "eligible (not excluded); lower k or enlarge the candidate pool"
        )


def _race_pick(dmin: torch.Tensor, e: torch.Tensor, first: bool) -> torch.Tensor:
    """One draw of the exponential race. ``dmin`` holds D_n >= 0 for available candidates and
    -1 for chosen/excluded ones. Score: D/E where D > 0; -E where D == 0 (only wins when no
    candidate has D > 0: then the draw is uniform over the tied ones); -inf when unavailable.
    On the first step every available candidate scores -E: a uniform draw."""
    avail = dmin >= 0
    if first:
        score = -e
    else:
        score = torch.where(dmin > 0, dmin / e, -e)
    score = torch.where(avail, score, torch.full_like(score, float("-inf")))
    return score.argmax()  # first index on ties


def _kmeanspp_loop(n, k, seed, exclude, device, dist_to):
    dmin = torch.full((n,), float("inf"), device=device, dtype=torch.float32)  # [N]
    if exclude is not None:
        dmin = torch.where(exclude.to(device), torch.full_like(dmin, -1.0), dmin)
    picks = torch.empty(k, dtype=torch.long, device=device)
    for step in range(k):
        c = _race_pick(dmin, _exp1(seed, step, n, device), first=(step == 0))
        picks[step] = c
        d = dist_to(c)  # [N], squared distance to the new centre, clamped at 0
        dmin = torch.where(dmin >= 0, torch.minimum(dmin, d), dmin)
        dmin = dmin.index_fill(0, c.reshape(1), -1.0)
    return picks


def kmeanspp(
    alpha: torch.Tensor,  # [N, a]
    beta: torch.Tensor,  # [N, b]
    k: int,
    *,
    seed: int,
    exclude: torch.Tensor | None = None,  # bool [N]
    validate: bool = True,
) -> torch.Tensor:
    """k distinct indices (long [k]) by k-means++ seeding over g_n = alpha_n (x) beta_n, with
    factored fp32 distances and the exponential-race D^2 draw. Excluded indices are never
    chosen. Deterministic per seed. ``validate=False`` skips the eligible-count check (and
    its host sync); the caller then guarantees k <= eligible."""
    if alpha.dim() != 2 or beta.dim() != 2 or alpha.shape[0] != beta.shape[0]:
        raise ValueError(
            f"kmeanspp: alpha [N, a] and beta [N, b] must share N; got {tuple(alpha.shape)} and "
            f"{tuple(beta.shape)}"
        )
    n = alpha.shape[0]
    _check_kmeanspp_args(n, k, exclude, alpha.device, validate)
    a, b = alpha.float(), beta.float()
    sq = (a * a).sum(1) * (b * b).sum(1)  # [N]  |g_n|^2

    def dist_to(c):
        cross = (a @ a[c]) * (b @ b[c])  # [N]
        return (sq + sq[c] - 2.0 * cross).clamp_min(0.0)

    return _kmeanspp_loop(n, k, seed, exclude, alpha.device, dist_to)


def kmeanspp_dense(
    x: torch.Tensor,  # [N, D] materialised embeddings
    k: int,
    *,
    seed: int,
    exclude: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """The same seeding (same RNG, same rules) over materialised vectors: the baseline that the
    factored path is measured against, and a check of the factored algebra."""
    if x.dim() != 2:
        raise ValueError(f"kmeanspp_dense: x must be [N, D], got {tuple(x.shape)}")
    n = x.shape[0]
    _check_kmeanspp_args(n, k, exclude, x.device, validate)
    xf = x.float()
    sq = (xf * xf).sum(1)

    def dist_to(c):
        return (sq + sq[c] - 2.0 * (xf @ xf[c])).clamp_min(0.0)

    return _kmeanspp_loop(n, k, seed, exclude, x.device, dist_to)
