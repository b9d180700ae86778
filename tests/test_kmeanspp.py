"""Triton k-means++ seeding against the PyTorch reference: identical indices for the same seed
(the counter-based RNG reproduced bit for bit), exclusion, distinctness, the fallback rule,
cross-block reductions; the fused selection path and the dispatch."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import kernels  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels.kmeanspp import kmeanspp_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _factors(n, a, b, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, a, generator=g).to(DEV, dtype),
            torch.randn(n, b, generator=g).to(DEV, dtype))


@pytest.mark.parametrize("n,a,b,k,block_n", [
    (1000, 48, 24, 32, None),
    (1000, 48, 24, 12, 256),  # 4 blocks: the cross-block reduction decides every pick
    (300, 5, 9, 16, 64),  # 5 blocks, a ragged tail
    (50, 3, 4, 10, None),
])
@pytest.mark.parametrize("with_exclude", [False, True])
def test_same_indices_as_reference(n, a, b, k, block_n, with_exclude):
    alpha, beta = _factors(n, a, b)
    exclude = (torch.rand(n, generator=torch.Generator().manual_seed(9)) < 0.3).to(DEV)
    exclude = exclude if with_exclude else None
    for seed in (0, 2**40 + 7):  # (the interpreter is slow: few steps x blocks x seeds)
        got = kmeanspp_triton(alpha, beta, k, seed=seed, exclude=exclude, block_n=block_n)
        want = ref.kmeanspp(alpha, beta, k, seed=seed, exclude=exclude)
        assert torch.equal(got.cpu(), want.cpu()), (seed, got[:8], want[:8])
        assert len(set(got.tolist())) == k
        if exclude is not None:
            assert not exclude[got].any()


def test_first_pick_follows_the_counter_rng_for_many_seeds():
    """Step 0 is argmin_n E(seed, 0, n): it equals the reference's only if the uint32 hash and
    the uniform map match bit for bit."""
    alpha, beta = _factors(200, 4, 4)
    got = [int(kmeanspp_triton(alpha, beta, 1, seed=s, block_n=64)[0]) for s in range(40)]
    want = [int(ref.kmeanspp(alpha, beta, 1, seed=s)[0]) for s in range(40)]
    assert got == want
    assert len(set(got)) > 20  # and the draws do move with the seed


def test_low_precision_factors_give_the_reference_picks():
    alpha, beta = _factors(500, 16, 24, seed=3, dtype=torch.bfloat16)
    for seed in range(3):
        assert torch.equal(kmeanspp_triton(alpha, beta, 40, seed=seed).cpu(),
                           ref.kmeanspp(alpha, beta, 40, seed=seed).cpu())


def test_duplicates_fall_back_to_uniform_and_stay_distinct():
    alpha = torch.ones(40, 3, device=DEV)
    beta = torch.ones(40, 2, device=DEV)
    alpha[:5] = 2.0  # 5 distinct points, 35 copies of one point
    exclude = torch.zeros(40, dtype=torch.bool, device=DEV)
    exclude[::4] = True
    got = kmeanspp_triton(alpha, beta, 30, seed=5, exclude=exclude, block_n=16)
    want = ref.kmeanspp(alpha, beta, 30, seed=5, exclude=exclude)
    assert torch.equal(got.cpu(), want.cpu())
    assert sorted(got.tolist()) == [i for i in range(40) if not exclude[i]]


def test_errors_are_clear():
    alpha, beta = _factors(10, 2, 2)
    exclude = torch.zeros(10, dtype=torch.bool, device=DEV)
    exclude[:5] = True
    with pytest.raises(ValueError, match="only 5 of 10 candidates are eligible"):
        kmeanspp_triton(alpha, beta, 6, seed=0, exclude=exclude)
    with pytest.raises(ValueError, match="must share N"):
        kmeanspp_triton(alpha, beta[:4], 2, seed=0)


def test_fused_selection_path_equals_reference(monkeypatch):
    g = torch.Generator().manual_seed(4)
    keys = F.normalize(torch.randn(600, 32, generator=g), dim=1).to(DEV)
    queries = F.normalize(torch.randn(20, 32, generator=g), dim=1).to(DEV)
    feats = torch.randn(20, 72, generator=g).to(DEV)
    exclude = (torch.rand(600, generator=g) < 0.2).to(DEV)
    monkeypatch.setenv("CMACC_KERNELS", "reference")
    want = kernels.select(keys, queries, feats, 24, seed=8, exclude=exclude)
    a, b = ref.grad_embed(keys, queries, feats, view="head")  # uncompressed, materialisable
    assert torch.equal(want, ref.kmeanspp_dense(ref.materialise(a, b), 24, seed=8, exclude=exclude))
    monkeypatch.setenv("CMACC_KERNELS", "triton")
    got = kernels.select(keys, queries, feats, 24, seed=8, exclude=exclude)
    assert torch.equal(got.cpu(), want.cpu())


def test_dispatch_reads_the_environment_at_call_time(monkeypatch):
    alpha, beta = _factors(30, 2, 2)
    monkeypatch.setenv("CMACC_KERNELS", "bogus")
    with pytest.raises(ValueError, match="CMACC_KERNELS"):
        kernels.kmeanspp(alpha, beta, 3, seed=0)
    monkeypatch.setenv("CMACC_KERNELS", "triton")
    assert kernels.backend_for(alpha) == "triton"
    monkeypatch.setenv("CMACC_KERNELS", "auto")
    assert kernels.backend_for(alpha) == ("triton" if alpha.is_cuda else "reference")
    if not alpha.is_cuda:
        monkeypatch.setenv("CMACC_KERNELS", "triton")
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            kernels.kmeanspp(alpha, beta, 3, seed=0)
