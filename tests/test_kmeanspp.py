"""Triton k-means++ seeding against the PyTorch reference: the counter-based RNG bit for bit,
identical indices for the same seed (with and without exclusion, compressed or not, several
row blocks so that the cross-block reduction decides picks), distinctness, the fallback rule
for duplicated points, clear errors; the fused selection path and the dispatch."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # before any Triton kernel is defined (at kernels import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import kernels  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels.triton_grad_embed import grad_embed_triton, grad_embed_triton_with_norms  # noqa: E402
from kernels.triton_kmeanspp import kmeanspp_triton, uniform_hash_triton  # noqa: E402

from devices import DEV  # noqa: E402


def _factors(n, a, b, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, a, generator=g).to(DEV, dtype),  # [N, a]
            torch.randn(n, b, generator=g).to(DEV, dtype))  # [N, b]


def _pool(n, m, d, dh, seed=4):
    g = torch.Generator().manual_seed(seed)
    keys = F.normalize(torch.randn(n, d, generator=g), dim=1).to(DEV)
    queries = F.normalize(torch.randn(m, d, generator=g), dim=1).to(DEV)
    feats = torch.randn(m, dh, generator=g).to(DEV)
    exclude = (torch.rand(n, generator=g) < 0.2).to(DEV)
    return keys, queries, feats, exclude


@pytest.mark.parametrize("seed", [0, 1, -3, 2**40 + 7, 2**63 - 1])
@pytest.mark.parametrize("step", [0, 1, 127, 2**31 + 5])
def test_rng_equals_reference_bit_for_bit(seed, step):
    got = uniform_hash_triton(seed, step, 3000, device=DEV).cpu()
    want = ref.uniform_hash(seed, step, 3000)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert 0.0 < float(got.min()) and float(got.max()) < 1.0


@pytest.mark.parametrize("n,a,b,k,block_n", [
    (1000, 48, 24, 32, None),  # one block under the interpreter
    (1000, 48, 24, 12, 256),  # 4 blocks: the cross-block reduction decides every pick
    (300, 5, 9, 16, 64),  # 5 blocks, a ragged tail, tiny a and b
    (50, 3, 200, 10, None),  # b spans two column chunks
])
@pytest.mark.parametrize("with_exclude", [False, True])
def test_same_indices_as_reference(n, a, b, k, block_n, with_exclude):
    alpha, beta = _factors(n, a, b)
    exclude = (torch.rand(n, generator=torch.Generator().manual_seed(9)) < 0.3).to(DEV)
    exclude = exclude if with_exclude else None
    for seed in (0, 2**40 + 7):  # (the interpreter is slow: few steps x blocks x seeds)
        got = kmeanspp_triton(alpha, beta, k, seed=seed, exclude=exclude, block_n=block_n)
        want = ref.kmeanspp(alpha, beta, k, seed=seed, exclude=exclude)
        assert got.dtype == torch.int64 and got.shape == (k,)
        assert torch.equal(got.cpu(), want.cpu()), (seed, got[:8], want[:8])
        assert len(set(got.tolist())) == k
        if exclude is not None:
            assert not exclude[got].any()


@pytest.mark.parametrize("view", ["head", "queries"])
def test_lazy_variant_same_picks_as_the_eager_reference(view):
    """The GPU lazy race (variant='lazy') draws the eager reference's picks for both gradient
    views (head: the Gram route's centre-side beta_c), with and without exclusions, over several
    row blocks and RNG seeds -- and brings only some candidates up to date after the full pass."""
    keys, queries, feats, exclude = _pool(600, 16, 16, 40, seed=6)
    alpha, beta, beta_c, sqn = ref.select_factors(keys, queries, feats, tau=0.7, view=view)
    for seed, ex in ((0, None), (2**40 + 7, exclude)):
        stats = {}
        got = kmeanspp_triton(alpha, beta, 24, seed=seed, exclude=ex, beta_c=beta_c, sqn=sqn,
                              block_n=128, variant="lazy", stats=stats)
        want = ref.kmeanspp(alpha, beta, 24, seed=seed, exclude=ex, beta_c=beta_c, sqn=sqn)
        assert torch.equal(got.cpu(), want.cpu()), (seed, got[:8], want[:8])
        assert 22 <= stats["refreshed"] < 300  # >= one a step from step 2 on, far from all


def test_lazy_variant_with_nonfinite_rows_duplicates_and_every_candidate_drawn():
    """NaN / Inf rows are never drawn; 12 copies of one point reach D = 0 (their bounds tie at
    0, so every such row is brought up to date and the first index wins among equal scores);
    k = every eligible candidate; bf16 factors: the eager reference's picks throughout."""
    g = torch.Generator().manual_seed(5)
    alpha, beta = torch.randn(36, 6, generator=g), torch.randn(36, 5, generator=g)
    alpha[8:20], beta[8:20] = alpha[8], beta[8]  # D = 0 once one copy is chosen
    alpha[[3, 25]] = float("nan")
    beta[26] = float("inf")
    exclude = torch.zeros(36, dtype=torch.bool)
    exclude[30:33] = True
    alpha, beta, exclude = alpha.to(DEV), beta.to(DEV), exclude.to(DEV)
    got = kmeanspp_triton(alpha, beta, 30, seed=1, exclude=exclude, block_n=16, variant="lazy")
    assert torch.equal(got.cpu(), ref.kmeanspp(alpha, beta, 30, seed=1, exclude=exclude).cpu())
    assert sorted(got.tolist()) == sorted(set(range(36)) - {3, 25, 26, 30, 31, 32})
    a16, b16 = _factors(300, 5, 9, seed=2, dtype=torch.bfloat16)
    assert torch.equal(kmeanspp_triton(a16, b16, 12, seed=3, block_n=64, variant="lazy").cpu(),
                       ref.kmeanspp(a16, b16, 12, seed=3).cpu())


def test_lazy_selection_plan_reads_the_pool_buffer_and_picks_as_the_reference(monkeypatch):
    """kernels.select(variant='lazy') -- what `train.py --select-impl lazy` runs on a GPU: the
    capacity-shaped plan over a pool's first n rows, with exclusions, picks the reference's."""
    keys, queries, feats, exclude = _pool(400, 12, 16, 40, seed=7)
    monkeypatch.setenv("CMACC_KERNELS", "reference")
    want = kernels.select(keys[:300], queries, feats, 16, seed=5, exclude=exclude[:300])
    monkeypatch.setenv("CMACC_KERNELS", "triton")
    got = kernels.select(keys, queries, feats, 16, seed=5, exclude=exclude, n=300,
                         variant="lazy")
    assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("variant", ["steps", "lazy"])
def test_two_level_reduction_of_a_large_grid_gives_the_reference_picks(variant):
    """A grid of more blocks than one program reduces (N >= 1.2 M on a GPU) reduces its
    per-block maxima in two levels: here 10 blocks of 16 rows, 4 partials a program (3 level-2
    partials, the last one ragged), with exclusions -- the reference's picks."""
    alpha, beta = _factors(160, 5, 9, seed=4)
    exclude = (torch.rand(160, generator=torch.Generator().manual_seed(2)) < 0.3).to(DEV)
    from kernels.triton_kmeanspp import seeding_config
    cfg = seeding_config(160, 5, 9, variant, block_n=16, group=4)
    assert (cfg["grid"], cfg["P2"], cfg["GROUP"]) == (10, 3, 4)
    got = kmeanspp_triton(alpha, beta, 10, seed=7, exclude=exclude, block_n=16, group=4,
                          variant=variant)
    assert torch.equal(got.cpu(), ref.kmeanspp(alpha, beta, 10, seed=7, exclude=exclude).cpu())


def test_first_pick_follows_the_counter_rng_for_many_seeds():
    """Step 0 is argmin_n E(seed, 0, n) over the eligible candidates."""
    alpha, beta = _factors(200, 4, 4)
    got = [int(kmeanspp_triton(alpha, beta, 1, seed=s, block_n=64)[0]) for s in range(30)]
    want = [int(ref.uniform_hash(s, 0, 200).argmax()) for s in range(30)]  # -E max = U max
    assert got == want
    assert len(set(got)) > 15  # and the draws do move with the seed


@pytest.mark.parametrize("compress", [False, True])
def test_picks_from_grad_embed_equal_reference(compress):
    """grad_embed -> kmeanspp, head view, with and without row-space compression: the Triton
    pair picks what the reference pair picks, for several seeds, with an exclusion mask."""
    keys, queries, feats, exclude = _pool(500, 20, 32, 72)
    a, b = grad_embed_triton(keys, queries, feats, view="head", compress=compress)
    ra, rb = ref.grad_embed(keys, queries, feats, view="head", compress=compress)
    assert b.shape[1] == (20 if compress else 72)
    for seed in (3, 11):
        got = kmeanspp_triton(a, b, 20, seed=seed, exclude=exclude)
        want = ref.kmeanspp(ra, rb, 20, seed=seed, exclude=exclude)
        assert torch.equal(got.cpu(), want.cpu()), (seed, got, want)


def test_low_precision_factors_give_the_reference_picks():
    alpha, beta = _factors(500, 16, 24, seed=3, dtype=torch.bfloat16)
    for seed in range(2):
        assert torch.equal(kmeanspp_triton(alpha, beta, 30, seed=seed).cpu(),
                           ref.kmeanspp(alpha, beta, 30, seed=seed).cpu())


def test_duplicates_fall_back_to_uniform_and_stay_distinct():
    """Once every remaining candidate has D = 0 (copies of chosen points), the draw is uniform
    over them (score -E) and picks stay distinct -- exactly the reference's rule."""
    alpha = torch.ones(40, 3, device=DEV)
    beta = torch.ones(40, 2, device=DEV)
    alpha[:5] = 2.0  # 5 copies of one point, 35 copies of another
    alpha[1] = 3.0
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
    with pytest.raises(ValueError, match="k must be >= 1"):
        kmeanspp_triton(alpha, beta, 0, seed=0)
    with pytest.raises(ValueError, match="exclude must be a bool mask"):
        kmeanspp_triton(alpha, beta, 2, seed=0, exclude=exclude[:3])


def test_fused_selection_path_equals_reference(monkeypatch):
    """kernels.select (grad_embed with |g|^2 and compression, then k-means++) under both
    backends, and the reference against the materialised uncompressed embeddings."""
    keys, queries, feats, exclude = _pool(600, 20, 32, 72)
    monkeypatch.setenv("CMACC_KERNELS", "reference")
    want = kernels.select(keys, queries, feats, 24, seed=8, exclude=exclude)
    a, b = ref.grad_embed(keys, queries, feats, view="head")  # uncompressed, materialisable
    assert torch.equal(want, ref.kmeanspp_dense(ref.materialise(a, b), 24, seed=8, exclude=exclude))
    monkeypatch.setenv("CMACC_KERNELS", "triton")
    got = kernels.select(keys, queries, feats, 24, seed=8, exclude=exclude)
    assert torch.equal(got.cpu(), want.cpu())
    _, _, sqn = grad_embed_triton_with_norms(keys, queries, feats, compress=True)
    torch.testing.assert_close(sqn, (a * a).sum(1) * (b * b).sum(1), rtol=1e-4, atol=1e-6)


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
