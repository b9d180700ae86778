"""The lazy k-means++ race (kernels/lazy_kmeanspp.py) against the eager reference
(kernels/reference.py ``kmeanspp``, every D brought up to date at every step): the same picks
for both views, exclusions, non-finite rows, duplicated points (D = 0), every eligible candidate
drawn, several RNG blocks; the dispatch that runs it on CPU tensors; its errors; and that it
touches few candidates per step (the reason it exists)."""

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import reference as ref
from kernels.lazy_kmeanspp import kmeanspp_lazy


def _pool(n, m, d, dh, seed):
    g = torch.Generator().manual_seed(seed)
    keys = F.normalize(torch.randn(n, d, generator=g), dim=1)  # [N, d]
    queries = F.normalize(torch.randn(m, d, generator=g), dim=1)  # [M, d]
    feats = torch.randn(m, dh, generator=g)  # [M, d_h]
    return keys, queries, feats


@pytest.mark.parametrize("view", ["head", "queries"])
@pytest.mark.parametrize("n,m,dh,k", [
    (3000, 32, 64, 32),  # Gram route (d_h > M), two RNG blocks
    (1111, 48, 24, 40),  # d_h <= M: beta = r H / tau; an awkward N
    (500, 16, 40, 16),
])
def test_same_picks_as_the_reference(view, n, m, dh, k):
    keys, queries, feats = _pool(n, m, 16, dh, seed=n + m)
    exclude = torch.rand(n, generator=torch.Generator().manual_seed(1)) < 0.3
    alpha, beta, beta_c, sqn = ref.select_factors(keys, queries, feats, tau=0.7, view=view)
    for seed in (0, 1, 2**40 + 7):
        for ex in (None, exclude):
            want = ref.kmeanspp(alpha, beta, k, seed=seed, exclude=ex, beta_c=beta_c, sqn=sqn)
            got = kmeanspp_lazy(alpha, beta, k, seed=seed, exclude=ex, beta_c=beta_c, sqn=sqn)
            assert got.dtype == torch.long and torch.equal(got, want)


def test_same_picks_with_nonfinite_rows_duplicates_and_every_candidate_drawn():
    g = torch.Generator().manual_seed(5)
    alpha, beta = torch.randn(60, 6, generator=g), torch.randn(60, 5, generator=g)
    alpha[10:30], beta[10:30] = alpha[10], beta[10]  # 20 copies of one point: D = 0 after it
    alpha[[3, 40]] = float("nan")
    beta[41] = float("inf")
    exclude = torch.zeros(60, dtype=torch.bool)
    exclude[50:55] = True
    eligible = 60 - 3 - 5
    for seed in range(4):
        for k in (8, 30, eligible):  # k = eligible: the zero-distance copies must be drawn too
            want = ref.kmeanspp(alpha, beta, k, seed=seed, exclude=exclude)
            got = kmeanspp_lazy(alpha, beta, k, seed=seed, exclude=exclude)
            assert torch.equal(got, want)
    assert sorted(got.tolist()) == sorted(set(range(60)) - {3, 40, 41, 50, 51, 52, 53, 54})
    with pytest.raises(ValueError, match=f"only {eligible} of 60 candidates are eligible"):
        kmeanspp_lazy(alpha, beta, eligible + 1, seed=0, exclude=exclude)


def test_bf16_factors_same_picks():
    keys, queries, feats = _pool(2000, 32, 16, 64, seed=3)
    alpha, beta, beta_c, _ = ref.select_factors(keys, queries, feats, view="head")
    bf = torch.bfloat16
    a, b, bc = alpha.to(bf), beta.to(bf), beta_c.to(bf)
    assert torch.equal(kmeanspp_lazy(a, b, 32, seed=4, beta_c=bc),
                       ref.kmeanspp(a, b, 32, seed=4, beta_c=bc))


def test_touches_a_few_candidates_per_step():
    """After the first centre's full pass, each step brings only the candidates whose stale
    bound reaches the drawn score up to date: about sum(D_stale) / sum(D) of them, not N."""
    keys, queries, feats = _pool(20000, 64, 16, 128, seed=8)
    alpha, beta, beta_c, sqn = ref.select_factors(keys, queries, feats, tau=0.7, view="head")
    stats = {}
    kmeanspp_lazy(alpha, beta, 64, seed=0, beta_c=beta_c, sqn=sqn, stats=stats)
    assert 62 <= stats["touched"] <= 62 * 20  # steps 2..63, each touching >= 1 candidate


def test_dispatch_runs_the_lazy_race_on_large_cpu_pools_and_the_reference_when_asked(
        monkeypatch):
    """kernels.select on CPU tensors: the lazy race from kernels._LAZY_FROM_FLOATS factor
    floats on, the reference's loop below it and whenever CMACC_KERNELS=reference; the same
    picks in every case."""
    keys, queries, feats = _pool(800, 16, 16, 32, seed=2)  # 800 x (16 + 16) floats a pass
    calls = []
    real = kernels.kmeanspp_lazy

    def spy(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    def draws():
        return [kernels.select(keys, queries, feats, 16, seed=s, factors=f)
                for s in range(2) for f in ("fp32", "bf16")]

    monkeypatch.setattr(kernels, "kmeanspp_lazy", spy)
    monkeypatch.setenv("CMACC_KERNELS", "auto")
    small = draws()
    assert calls == []  # below the size: the reference's loop
    monkeypatch.setattr(kernels, "_LAZY_FROM_FLOATS", 800 * 32)
    lazy = draws()
    assert len(calls) == 4
    monkeypatch.setenv("CMACC_KERNELS", "reference")
    eager = draws()
    assert len(calls) == 4  # the reference's own loop this time
    for a, b, c in zip(small, lazy, eager):
        assert torch.equal(a, b) and torch.equal(b, c)
