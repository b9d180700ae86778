"""kernels/reference.py against independent references: torch.autograd (float64), materialised
embeddings, and the k-means++ D^2 law (chi-square over many seeds)."""

import itertools

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
