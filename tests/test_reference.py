"""kernels/reference.py against independent references: torch.autograd (float64; also through
the query's L2 normalisation, and straight-through to pin down the head view), materialised
embeddings, the k-means++ D^2 law (chi-square over many seeds), and a pure-Python-int murmur3
for the counter-based RNG."""

import itertools
import random

import numpy as np
import pytest
import torch
from scipy import stats

from kernels import reference as ref

SHAPES = [  # N, M, d, d_h (odd ones included)
    (7, 5, 3, 4),
    (13, 6, 9, 11),
    (20, 3, 16, 40),
]


def _inputs(n, m, d, dh, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    keys = torch.nn.functional.normalize(torch.randn(n, d, generator=g, dtype=dtype), dim=1)
    feats = torch.randn(m, dh, generator=g, dtype=dtype)
    w = torch.randn(d, dh, generator=g, dtype=dtype) / dh**0.5
    return keys, feats, w


@pytest.mark.parametrize("n,m,d,dh", SHAPES)
@pytest.mark.parametrize("tau", [1.0, 0.3])
def test_grad_embed_head_equals_autograd(n, m, d, dh, tau):
    keys, feats, w = _inputs(n, m, d, dh)
    queries = feats @ w.t()  # q_j = W h_j
    alpha, beta = ref.grad_embed(keys, queries, feats, tau=tau, view="head")
    assert alpha.dtype == beta.dtype == torch.float32
    assert alpha.shape == (n, d) and beta.shape == (n, dh)
    want = ref.grad_embed_autograd(keys, w, feats, tau=tau, view="head")  # [N, d*d_h] float64
    got = ref.materialise(alpha.double(), beta.double())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,m,d,dh", SHAPES)
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_grad_embed_queries_equals_autograd(n, m, d, dh, tau):
    keys, feats, w = _inputs(n, m, d, dh)
    queries = torch.nn.functional.normalize(feats @ w.t(), dim=1)
    alpha, beta = ref.grad_embed(keys, queries, None, tau=tau, view="queries")
    assert alpha.shape == (n, m) and beta.shape == (n, d)
    want = ref.grad_embed_autograd(keys, queries, None, tau=tau, view="queries")  # [N, M*d]
    torch.testing.assert_close(ref.materialise(alpha.double(), beta.double()), want,
                               rtol=1e-5, atol=1e-6)



# -- the exact gradient through the query's L2 normalisation ("head-exact"), and which gradient
# the head view is (autograd through a straight-through normalisation) ------------------------
def _exact_inputs(n, m, d, dh, seed=0, dtype=torch.float64):
    keys, feats, w = _inputs(n, m, d, dh, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 100)
    return keys, feats, w, 0.3 * torch.randn(d, generator=g, dtype=dtype)  # bias b


@pytest.mark.parametrize("n,m,d,dh", SHAPES)
@pytest.mark.parametrize("tau", [1.0, 0.3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_exact_embedding_equals_autograd_through_the_normalisation(n, m, d, dh, tau, with_bias):
    keys, feats, w, bias = _exact_inputs(n, m, d, dh)
    bias = bias if with_bias else None
    head_out = feats @ w.t() + (0 if bias is None else bias)  # z_j = W h_j + b
    want = ref.grad_embed_autograd(keys, w, feats, tau=tau, query="normalised", bias=bias)
    got = ref.grad_embed_exact(keys, head_out, feats, tau=tau)
    assert got.dtype == torch.float32 and got.shape == (n, d * dh)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    f = ref.exact_factors(keys, head_out, feats, tau=tau)
    torch.testing.assert_close(f.sqn.double(), (want * want).sum(1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,m,d,dh", SHAPES)
@pytest.mark.parametrize("tau", [1.0, 0.3])
def test_head_view_is_the_gradient_with_the_normalisation_jacobian_left_out(n, m, d, dh, tau):
    """From the encoder's (normalised) queries, the head view is dCE/dW of CE on k . (W h) / tau
    with the residual taken at the normalised logits: autograd through a straight-through
    normalisation (value z/|z|, derivative of z). It is not the exact gradient."""
    keys, feats, w = _inputs(n, m, d, dh)
    q = torch.nn.functional.normalize(feats @ w.t(), dim=1)  # the encoder's queries
    alpha, beta = ref.grad_embed(keys, q, feats, tau=tau, view="head")
    got = ref.materialise(alpha.double(), beta.double())
    st = ref.grad_embed_autograd(keys, w, feats, tau=tau, query="straight-through")
    torch.testing.assert_close(got, st, rtol=1e-5, atol=1e-6)
    exact = ref.grad_embed_autograd(keys, w, feats, tau=tau, query="normalised")
    assert (got - exact).norm() > 0.1 * exact.norm()  # the two gradients differ materially


@pytest.mark.parametrize("n,m,d,dh", SHAPES)
@pytest.mark.parametrize("tau", [1.0, 0.5])
def test_exact_factored_distances_equal_materialised(n, m, d, dh, tau):
    keys, feats, w, bias = _exact_inputs(n, m, d, dh, seed=1)
    head_out = feats @ w.t() + bias
    g = ref.grad_embed_autograd(keys, w, feats, tau=tau, query="normalised", bias=bias)
    want = torch.cdist(g, g).square()  # [N, N] float64, materialised
    f = ref.exact_factors(keys, head_out, feats, tau=tau)
    centres = torch.arange(n).flip(0)[: max(2, n // 2)]
    got = ref.pairwise_sqdist_exact(f, centres)  # [N, C]
    torch.testing.assert_close(got.double(), want[:, centres], rtol=1e-4,
                               atol=1e-6 * float(want.max()))


@pytest.mark.parametrize("numpy_loop", [True, False])
def test_exact_selection_equals_kmeanspp_dense_on_materialised(numpy_loop, monkeypatch):
    """Same picks as the plain seeding over the materialised exact embeddings (same seed):
    the factored cross products draw the same race, in numpy and in torch."""
    monkeypatch.setattr(ref, "_NUMPY_ON_CPU", numpy_loop)
    n, m, d, dh = 150, 8, 12, 20
    keys, feats, w, bias = _exact_inputs(n, m, d, dh, seed=2, dtype=torch.float32)
    head_out = feats @ w.t() + bias
    g = ref.grad_embed_autograd(keys.double(), w.double(), feats.double(), tau=0.7,
                                query="normalised", bias=bias.double())
    ex = torch.zeros(n, dtype=torch.bool)
    ex[::7] = True
    for seed in range(4):
        got = ref.select_exact(keys, head_out, feats, m, seed=seed, tau=0.7, exclude=ex)
        assert torch.equal(got, ref.kmeanspp_dense(g, m, seed=seed, exclude=ex))
        assert len(set(got.tolist())) == m and not ex[got].any()


def test_exact_rejects_bad_input():
    keys, feats, w, _ = _exact_inputs(5, 4, 3, 6)
    with pytest.raises(ValueError, match="feats"):
        ref.exact_factors(keys, feats @ w.t(), feats[:3])
    with pytest.raises(ValueError, match="key dim"):
        ref.select_exact(keys[:, :2], feats @ w.t(), feats, 2, seed=0)
    with pytest.raises(ValueError, match="query="):
        ref.grad_embed_autograd(keys, w, feats, query="unit")
    with pytest.raises(ValueError, match="asked for k=6"):
        ref.select_exact(keys, feats @ w.t(), feats, 6, seed=0)


def test_grad_embed_rejects_bad_input():
    keys, feats, w = _inputs(5, 4, 3, 6)
    q = feats @ w.t()
    with pytest.raises(ValueError, match="needs feats"):
        ref.grad_embed(keys, q, None, view="head")
    with pytest.raises(ValueError, match="view"):
        ref.grad_embed(keys, q, feats, view="bogus")
    with pytest.raises(ValueError, match="key dim"):
        ref.grad_embed(keys[:, :2], q, feats)
    with pytest.raises(ValueError, match=r"feats must be \[M, d_h\]"):
        ref.grad_embed(keys, q, feats[:3])


@pytest.mark.parametrize("m,dh", [(6, 40), (24, 80), (10, 10)])
def test_row_space_compression_preserves_distances(m, dh):
    keys, feats, w = _inputs(50, m, 12, dh, seed=3, dtype=torch.float32)
    q = torch.nn.functional.normalize(feats @ w.t(), dim=1)
    a, b = ref.grad_embed(keys, q, feats, view="head")
    ac, bc = ref.grad_embed(keys, q, feats, view="head", compress=True)
    assert bc.shape[1] == min(m, dh)
    dist = ref.pairwise_sqdist_factored(a, b, a, b)
    dist_c = ref.pairwise_sqdist_factored(ac, bc, ac, bc)
    torch.testing.assert_close(dist_c, dist, rtol=1e-4, atol=1e-5 * dist.max().item())
    for seed in range(5):
        assert torch.equal(ref.kmeanspp(a, b, 10, seed=seed), ref.kmeanspp(ac, bc, 10, seed=seed))


def test_factored_distances_equal_materialised():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(40, 7, generator=g), torch.randn(40, 13, generator=g)
    x = ref.materialise(a, b).double()
    want = torch.cdist(x, x) ** 2
    got = ref.pairwise_sqdist_factored(a, b, a, b).double()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # same seeding decisions as on the materialised vectors
    for seed in range(5):
        assert torch.equal(ref.kmeanspp(a, b, 12, seed=seed),
                           ref.kmeanspp_dense(ref.materialise(a, b), 12, seed=seed))


def test_kmeanspp_distinct_excluded_deterministic():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(300, 5, generator=g), torch.randn(300, 9, generator=g)
    exclude = torch.rand(300, generator=g) < 0.6
    for seed in range(10):
        idx = ref.kmeanspp(a, b, 64, seed=seed, exclude=exclude)
        assert idx.dtype == torch.long and idx.shape == (64,)
        assert len(set(idx.tolist())) == 64
        assert not exclude[idx].any()
        assert torch.equal(idx, ref.kmeanspp(a, b, 64, seed=seed, exclude=exclude))
    assert not torch.equal(ref.kmeanspp(a, b, 64, seed=0), ref.kmeanspp(a, b, 64, seed=1))


def _race_plain(x, k, seed, exclude):
    """The documented draw rules, step by step in float64 on materialised vectors: step t
    scores -E_n (t = 0), D_n / E_n (D_n > 0) or -E_n (D_n = 0), E_n = -log U(seed, t, n);
    chosen and excluded candidates never win; argmax, first index on ties."""
    x = x.double()
    d = torch.full((x.shape[0],), float("inf"), dtype=torch.float64)
    taken = exclude.clone()
    picks = []
    for t in range(k):
        e = -torch.log(ref.uniform_hash(seed, t, x.shape[0]).double())
        score = -e if t == 0 else torch.where(d > 0, d / e, -e)
        c = int(torch.where(taken, float("-inf"), score).argmax())
        picks.append(c)
        taken[c] = True
        d = torch.minimum(d, ((x - x[c]) ** 2).sum(1))
    return picks


def test_kmeanspp_equals_the_plain_per_step_race():
    """k = 40 crosses the blocks of steps whose uniforms are generated together."""
    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(120, 4, generator=g), torch.randn(120, 6, generator=g)
    exclude = torch.rand(120, generator=g) < 0.3
    x = ref.materialise(a, b)
    for seed in range(4):
        assert ref.kmeanspp(a, b, 40, seed=seed, exclude=exclude).tolist() == _race_plain(
            x, 40, seed, exclude)


def test_kmeanspp_takes_every_eligible_when_k_equals_eligible_even_with_duplicates():
    a = torch.ones(20, 3)  # all points identical: every distance is 0 (the fallback rule)
    b = torch.ones(20, 2)
    exclude = torch.zeros(20, dtype=torch.bool)
    exclude[::3] = True
    k = int((~exclude).sum())
    idx = ref.kmeanspp(a, b, k, seed=4, exclude=exclude)
    assert sorted(idx.tolist()) == [i for i in range(20) if not exclude[i]]


def test_kmeanspp_too_many_centres_is_a_clear_error():
    a, b = torch.randn(10, 2), torch.randn(10, 2)
    ex = torch.zeros(10, dtype=torch.bool)
    ex[:5] = True
    with pytest.raises(ValueError, match="only 5 of 10 candidates are eligible"):
        ref.kmeanspp(a, b, 6, seed=0, exclude=ex)
    with pytest.raises(ValueError, match="exclude must be"):
        ref.kmeanspp(a, b, 2, seed=0, exclude=ex[:4])


# ---------------------------------------------------------------------------------------------
# Counter-based RNG
# ---------------------------------------------------------------------------------------------
def _fmix32_py(x):
    """murmur3 fmix32 on Python ints (the independent spec of the tensor hash)."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _key_py(seed, step):
    """key = fmix(seed32 ^ fmix(step * golden + 1)), seed32 = the seed's 32-bit words xor-ed."""
    s = seed & (2**64 - 1)
    s32 = (s ^ (s >> 32)) & 0xFFFFFFFF
    return _fmix32_py(s32 ^ _fmix32_py((step * 0x9E3779B9 + 1) & 0xFFFFFFFF))


def _hash_py(seed, step, n):
    """h = fmix(fmix(n ^ key) + key), in ints."""
    key = _key_py(seed, step)
    return _fmix32_py((_fmix32_py((n & 0xFFFFFFFF) ^ key) + key) & 0xFFFFFFFF)


def _u_exact(h):
    """U for a 32-bit hash, as an exact Python float: ((h >> 9) + 0.5) / 2^23."""
    return ((h >> 9) + 0.5) / 2**23


def test_tensor_hash_is_murmur3_bit_for_bit():
    rnd = random.Random(0)
    idx = list(range(200)) + [rnd.randrange(2**32) for _ in range(150)]
    idx += [2**31 - 1, 2**31, 2**32 - 1, 2**32 + 7]  # sign-bit and wrap-around indices
    for seed, step in [(0, 0), (123, 1), (-5, 17), (2**40 + 3, 127), (7, 2**31 + 9)]:
        want_h = [_hash_py(seed, step, n) for n in idx]
        got_h = ref._hash_block(seed, step, 1, ref._as_i32(torch.tensor(idx)))[0]
        assert (got_h.to(torch.int64) & 0xFFFFFFFF).tolist() == want_h
        assert ref.step_key(seed, step) == _key_py(seed, step)  # host side
        assert int(ref._step_keys(seed, step, 1, None)[0]) & 0xFFFFFFFF == _key_py(seed, step)
        got_u = ref.uniform_hash(seed, step, torch.tensor(idx))
        assert got_u.dtype == torch.float32
        assert got_u.double().tolist() == [_u_exact(h) for h in want_h]  # exact, no rounding


def test_uniforms_of_many_steps_in_one_pass_equal_the_per_step_stream():
    block = ref.uniform_hash_steps(9, 5, 7, 1000)  # steps 5..11
    assert block.shape == (7, 1000)
    for j in range(7):
        assert torch.equal(block[j], ref.uniform_hash(9, 5 + j, 1000))
    assert torch.equal(ref.uniform_hash(9, 6, torch.arange(30, 40)), block[1, 30:40])
    # the numpy generator of the CPU loop: the same bits, checked against the int spec too
    block_np = ref._uniform_steps_np(9, 5, 7, 1000)
    assert block_np.dtype == np.float32 and np.array_equal(block_np, block.numpy())
    assert block_np[3, :50].tolist() == [_u_exact(_hash_py(9, 8, n)) for n in range(50)]


def test_uniform_is_strictly_inside_unit_interval_for_every_hash():
    """Every one of the 2^23 values h >> 9 can take (so every 32-bit hash), as int32 bit
    patterns and as int64 values: U = ((h >> 9) + 0.5) 2^-23 exactly, in [2^-24, 1 - 2^-24],
    strictly increasing, so E = -log U is finite and > 0."""
    top = torch.arange(2**23, dtype=torch.int64)
    for h in (top << 9, (top << 9) | 511):  # the lowest and highest hash of each U value
        u64 = ref.hash_to_uniform(h)
        u32 = ref.hash_to_uniform(ref._as_i32(h))  # same hashes as int32 bit patterns
        assert u64.dtype == u32.dtype == torch.float32 and torch.equal(u64, u32)
        torch.testing.assert_close(u64.double(), (top.double() + 0.5) / 2**23, rtol=0, atol=0)
        assert (u64 > 0).all() and (u64 < 1).all() and (u64[1:] > u64[:-1]).all()
        e = -torch.log(u64)
        assert torch.isfinite(e).all() and (e > 0).all()
    ext = ref.hash_to_uniform(torch.tensor([0, 0xFFFFFFFF]))
    assert ext.tolist() == [2.0**-24, 1 - 2.0**-24]
    assert ref.hash_to_uniform(torch.tensor([-1], dtype=torch.int32)).item() == 1 - 2.0**-24


def test_rng_is_uniform_and_keyed():
    u = ref.uniform_hash(123, 0, 200_000)
    assert (u > 0).all() and (u < 1).all()
    # Kolmogorov-Smirnov against U(0, 1)
    assert stats.kstest(u.double().numpy(), "uniform").pvalue > 1e-3
    # different steps and seeds give (practically) independent streams
    v = ref.uniform_hash(123, 1, 200_000)
    w = ref.uniform_hash(124, 0, 200_000)
    assert abs(torch.corrcoef(torch.stack([u, v]))[0, 1]) < 0.01
    assert abs(torch.corrcoef(torch.stack([u, w]))[0, 1]) < 0.01
    # indices given as a tensor are the same stream
    assert torch.equal(ref.uniform_hash(123, 0, torch.arange(5, 9)), u[5:9])


def test_kmeanspp_draw_law_chi_square():
    """Over many seeds, (first, second) pick frequencies follow the k-means++ law:
    P(c0) uniform over eligible, P(c1 | c0) = D(n, c0) / sum D."""
    g = torch.Generator().manual_seed(5)
    n = 6
    a, b = torch.randn(n, 3, generator=g), torch.randn(n, 4, generator=g)
    exclude = torch.zeros(n, dtype=torch.bool)
    exclude[4] = True  # never drawn
    elig = [i for i in range(n) if not exclude[i]]
    dist = ref.pairwise_sqdist_factored(a, b, a, b).double()
    trials = 6000
    counts = {}
    for s in range(trials):
        c0, c1 = ref.kmeanspp(a, b, 2, seed=s, exclude=exclude).tolist()
        counts[(c0, c1)] = counts.get((c0, c1), 0) + 1
    cells = [(i, j) for i, j in itertools.permutations(elig, 2)]
    assert set(counts) <= set(cells)
    expected = []
    for i, j in cells:
        row = dist[i, elig]
        expected.append(trials / len(elig) * float(dist[i, j] / row.sum()))
    observed = [counts.get(c, 0) for c in cells]
    res = stats.chisquare(observed, expected)
    assert res.pvalue > 1e-3, (observed, expected)


def test_kmeanspp_first_pick_uniform_chi_square():
    a, b = torch.randn(8, 2), torch.randn(8, 2)
    trials = 4000
    first = torch.tensor([ref.kmeanspp(a, b, 1, seed=s)[0].item() for s in range(trials)])
    observed = torch.bincount(first, minlength=8).tolist()
    assert stats.chisquare(observed).pvalue > 1e-3


# ---------------------------------------------------------------------------------------------
# The selection path: select_factors (no QR, Gram route) + kmeanspp(beta_c, sqn)
# ---------------------------------------------------------------------------------------------
FACTOR_CASES = [  # N, M, d, d_h, view: the Gram route (d_h > M), d_h <= M, the queries view
    (23, 6, 9, 40, "head"),
    (23, 6, 9, 5, "head"),
    (19, 7, 9, 7, "head"),
    (23, 6, 9, 40, "queries"),
]


def _materialised(keys, feats, w, tau, view):
    """Autograd gradient embeddings (float64) and the queries they came from."""
    queries = feats @ w.t() if view == "head" else torch.nn.functional.normalize(feats @ w.t(),
                                                                                 dim=1)
    g = ref.grad_embed_autograd(keys, w if view == "head" else queries,
                                feats if view == "head" else None, tau=tau, view=view)
    return g, queries


def _factored_sqdist(alpha, beta, beta_c, sqn):
    """The contract's d(n, c) = sqn_n + sqn_c - 2 (a_n . a_c)(b_n . bc_c), float64 [N, N]."""
    a, b, s = alpha.double(), beta.double(), sqn.double()
    bc = b if beta_c is None else beta_c.double()
    return s[:, None] + s[None, :] - 2 * (a @ a.t()) * (b @ bc.t())


@pytest.mark.parametrize("n,m,d,dh,view", FACTOR_CASES)
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_select_factors_distances_equal_materialised(n, m, d, dh, view, tau):
    keys, feats, w = _inputs(n, m, d, dh, seed=4)
    g, queries = _materialised(keys, feats, w, tau, view)  # [N, D] float64
    alpha, beta, beta_c, sqn = ref.select_factors(keys, queries, feats, tau=tau, view=view)
    assert alpha.dtype == beta.dtype == sqn.dtype == torch.float32
    gram = view == "head" and dh > m
    assert (beta_c is not None) == gram
    assert beta.shape == (n, {"queries": d, "head": m if gram else dh}[view])
    if gram:
        assert beta_c.shape == beta.shape
    want = ((g[:, None, :] - g[None, :, :]) ** 2).sum(-1)  # [N, N] float64
    got = _factored_sqdist(alpha, beta, beta_c, sqn)
    scale = want.max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * scale)
    torch.testing.assert_close(sqn.double(), (g * g).sum(1), rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("n,m,d,dh,view", FACTOR_CASES)
def test_select_equals_kmeanspp_dense_on_materialised(n, m, d, dh, view):
    keys, feats, w = _inputs(n, m, d, dh, seed=6)
    g, queries = _materialised(keys, feats, w, 0.7, view)
    exclude = torch.zeros(n, dtype=torch.bool)
    exclude[[1, 4, 11]] = True
    for seed in range(6):
        ex = exclude if seed % 2 else None
        got = ref.select(keys, queries, feats, 8, seed=seed, tau=0.7, view=view, exclude=ex)
        assert torch.equal(got, ref.kmeanspp_dense(g, 8, seed=seed, exclude=ex))


def test_select_rejects_bad_input():
    keys, feats, w = _inputs(5, 4, 3, 6)
    with pytest.raises(ValueError, match="needs feats"):
        ref.select(keys, feats @ w.t(), None, 2, seed=0)
    a, b = torch.randn(6, 2), torch.randn(6, 3)
    with pytest.raises(ValueError, match="beta_c must have beta's shape"):
        ref.kmeanspp(a, b, 2, seed=0, beta_c=b[:, :2])
    with pytest.raises(ValueError, match=r"sqn must be \[6\]"):
        ref.kmeanspp(a, b, 2, seed=0, sqn=torch.ones(5))
    with pytest.raises(ValueError, match="must be on one device"):
        ref.kmeanspp(a, b, 2, seed=0, sqn=torch.ones(6, device="meta"))


# ---------------------------------------------------------------------------------------------
# Non-finite candidates: never drawn, exactly like excluded ones
# ---------------------------------------------------------------------------------------------
def _poison(a, b, rows):
    """Copies of (a, b) with NaN / +Inf / -Inf written into some factor rows."""
    a, b = a.clone(), b.clone()
    kinds = [(a, float("nan")), (b, float("inf")), (a, float("-inf")), (b, float("nan"))]
    for i, row in enumerate(rows):
        t, v = kinds[i % len(kinds)]
        t[row, i % t.shape[1]] = v
    return a, b


def test_nonfinite_candidates_are_excluded():
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(90, 5, generator=g), torch.randn(90, 7, generator=g)
    rows = [0, 3, 17, 40, 41, 89]
    bad = torch.zeros(90, dtype=torch.bool)
    bad[rows] = True
    pa, pb = _poison(a, b, rows)
    user = torch.zeros(90, dtype=torch.bool)
    user[[5, 6, 17]] = True
    for seed in range(8):
        got = ref.kmeanspp(pa, pb, 40, seed=seed)
        assert not bad[got].any()
        assert torch.equal(got, ref.kmeanspp(a, b, 40, seed=seed, exclude=bad))
        got = ref.kmeanspp(pa, pb, 40, seed=seed, exclude=user)
        assert torch.equal(got, ref.kmeanspp(a, b, 40, seed=seed, exclude=bad | user))
        x = ref.materialise(a, b)
        px = ref.materialise(pa, pb)
        assert torch.equal(ref.kmeanspp_dense(px, 40, seed=seed),
                           ref.kmeanspp_dense(x, 40, seed=seed, exclude=bad))


def test_nonfinite_keys_are_never_selected():
    for view, dh in [("head", 40), ("head", 5), ("queries", 40)]:
        keys, feats, w = _inputs(60, 6, 9, dh, seed=8, dtype=torch.float32)
        queries = feats @ w.t()
        bad = torch.zeros(60, dtype=torch.bool)
        bad[[2, 30, 59]] = True
        poisoned = keys.clone()
        poisoned[2, 0], poisoned[30, 4], poisoned[59, 8] = float("nan"), float("inf"), -float("inf")
        for seed in range(4):
            got = ref.select(poisoned, queries, feats, 20, seed=seed, view=view)
            assert torch.equal(got, ref.select(keys, queries, feats, 20, seed=seed, view=view,
                                               exclude=bad))


def test_nonfinite_count_is_in_the_error():
    a, b = torch.randn(10, 2), torch.randn(10, 2)
    a[[1, 2, 3]] = float("nan")
    ex = torch.zeros(10, dtype=torch.bool)
    ex[[3, 4]] = True  # row 3 both excluded and NaN: counted once, as excluded
    with pytest.raises(ValueError, match="only 6 of 10 candidates are eligible .*2 more had "
                                         "non-finite gradient embeddings"):
        ref.kmeanspp(a, b, 7, seed=0, exclude=ex)
    assert sorted(ref.kmeanspp(a, b, 6, seed=0, exclude=ex).tolist()) == [0, 5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="3 more had non-finite"):
        ref.kmeanspp_dense(ref.materialise(a, b), 8, seed=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reference_on_cuda_draws_the_same_bits_and_picks():
    idx = torch.tensor([0, 1, 2**31, 2**32 - 1])
    assert torch.equal(ref.uniform_hash_steps(3, 0, 20, 5000, device="cuda").cpu(),
                       ref.uniform_hash_steps(3, 0, 20, 5000))
    assert torch.equal(ref.uniform_hash(3, 2, idx.cuda()).cpu(), ref.uniform_hash(3, 2, idx))
    keys, feats, w = _inputs(300, 8, 16, 40, seed=9, dtype=torch.float32)
    q = feats @ w.t()
    want = ref.select(keys, q, feats, 16, seed=1)
    got = ref.select(keys.cuda(), q.cuda(), feats.cuda(), 16, seed=1)
    assert torch.equal(got.cpu(), want)


def test_numpy_and_torch_backends_draw_the_same(monkeypatch):
    """On CPU the k steps run in numpy (kernels/reference.py ``_NUMPY_ON_CPU``); the torch loop
    that runs on other devices must draw the same picks (the uniforms are the same bits)."""
    keys, feats, w = _inputs(2000, 16, 32, 64, seed=12, dtype=torch.float32)
    queries = feats @ w.t()
    keys[[5, 700]] = float("nan")
    exclude = torch.zeros(2000, dtype=torch.bool)
    exclude[100:300] = True
    x = ref.materialise(*ref.grad_embed(keys[:300], queries, None, view="queries"))

    def draws():
        return [ref.select(keys, queries, feats, 40, seed=s, view=v, exclude=exclude)
                for s in range(3) for v in ("head", "queries")] + [
            ref.kmeanspp_dense(x, 30, seed=s) for s in range(3)]

    on_numpy = draws()
    monkeypatch.setattr(ref, "_NUMPY_ON_CPU", False)
    on_torch = draws()
    for a, b in zip(on_numpy, on_torch):
        assert a.dtype == b.dtype == torch.long and torch.equal(a, b)


def test_small_pools_run_their_steps_on_one_blas_thread_with_the_same_picks(monkeypatch):
    """A small pool's numpy k-means++ steps run with one BLAS thread (the pool's factors are
    under kernels.reference._BLAS_ONE_THREAD_BELOW floats), a large one's with the process's
    setting; the thread count changes no pick."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    blas = threadpoolctl.ThreadpoolController().select(user_api="blas")
    if not blas.lib_controllers:
        pytest.skip("numpy has no BLAS that threadpoolctl can control here")
    seen = []
    loop = ref._kmeanspp_loop

    def recording(*args, **kw):
        seen.append(max(c.num_threads for c in
                        threadpoolctl.ThreadpoolController().select(user_api="blas").lib_controllers))
        return loop(*args, **kw)

    monkeypatch.setattr(ref, "_kmeanspp_loop", recording)
    keys, feats, w = _inputs(1500, 16, 32, 64, seed=3, dtype=torch.float32)
    queries = feats @ w.t()

    def draws():
        return [ref.select(keys, queries, feats, 40, seed=s, view=v)
                for s in range(2) for v in ("head", "queries")]

    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        small = draws()  # 1500 x (32 + 16) floats a step: below the threshold
        assert seen == [1] * 4
        seen.clear()
        monkeypatch.setattr(ref, "_BLAS_ONE_THREAD_BELOW", 1)  # every pool is "large" now
        large = draws()
        assert seen == [2] * 4
    for a, b in zip(small, large):
        assert torch.equal(a, b)
