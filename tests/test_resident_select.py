"""The resident selection variant (issue 48, kernels/triton_resident.py ``resident``): one
cooperative launch holding the factors on chip for all k rounds. The interpreter cannot run its
grid barrier, so on CPU its per-round twin runs -- the same programs, rows, per-row math, race
keys and tie rule, one launch a round -- and must draw the eager reference's picks: both
gradient views (the head view's Gram route), exclusions, NaN / Inf rows, zero-distance ties,
every candidate drawn, rows past the valid count, k = M, bf16 factors of odd width. On a GPU
the cooperative kernel must equal its twin and the reference (``make gpu-check`` runs that)."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # before any Triton kernel is defined (at kernels import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kernels  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels import triton_kmeanspp as km  # noqa: E402
from kernels import triton_resident as kr  # noqa: E402
from kernels import triton_select as ts  # noqa: E402

from devices import DEV, selection_inputs  # noqa: E402


_pool = selection_inputs


@pytest.fixture(autouse=True)
def _fresh_plans(monkeypatch):
    monkeypatch.setenv("CMACC_KERNELS", "triton")  # the plan path, also on CPU tensors
    ts.clear_plans()
    yield
    ts.clear_plans()


def _cooperative_too():
    """(False,) under the interpreter; (False, True) on a GPU: the twin and the kernel."""
    return (False,) if km.INTERPRETED else (False, True)


@pytest.mark.parametrize("view", ["head", "queries"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_resident_rounds_draw_the_reference_picks(view, dtype):
    """333 candidates over 4 programs of 64 + 32 rows (the last ragged), both views (head: the
    Gram route's centre-side beta_c), with and without exclusions, two seeds."""
    keys, queries, feats, exclude = _pool(333, 16, 24, 40, seed=6)
    alpha, beta, beta_c, _ = ref.select_factors(keys, queries, feats, tau=0.7, view=view)
    alpha, beta = alpha.to(dtype), beta.to(dtype)
    beta_c = None if beta_c is None else beta_c.to(dtype)
    cfg = km.seeding_config(333, alpha.shape[1], beta.shape[1], "resident", sms=4, factors=dtype,
                            cooperative=False)
    assert (cfg["ROWS_A"], cfg["ROWS_B"], cfg["grid"]) == (64, 32, 4)
    for seed, ex in ((0, None), (2**40 + 7, exclude)):
        want = ref.kmeanspp(alpha, beta, 24, seed=seed, exclude=ex, beta_c=beta_c)
        for coop in _cooperative_too():
            got = km.kmeanspp_triton(alpha, beta, 24, seed=seed, exclude=ex, beta_c=beta_c,
                                     variant="resident", sms=4, cooperative=coop)
            assert torch.equal(got.cpu(), want.cpu()), (seed, coop, got[:8], want[:8])


def test_resident_rounds_with_nonfinite_rows_duplicates_and_every_candidate_drawn():
    """NaN / Inf rows are never drawn; 12 copies of one point reach D = 0 (the uniform fallback
    -E among them); k = every eligible candidate; bf16 factors of odd widths (5 and 9: read as
    words with a zero pad); one tile per program (3 programs of 16 rows)."""
    g = torch.Generator().manual_seed(5)
    alpha, beta = torch.randn(36, 5, generator=g), torch.randn(36, 9, generator=g)
    alpha[8:20], beta[8:20] = alpha[8], beta[8]  # D = 0 once one copy is chosen
    alpha[[3, 25]] = float("nan")
    beta[26] = float("inf")
    exclude = torch.zeros(36, dtype=torch.bool)
    exclude[30:33] = True
    alpha, beta = alpha.to(DEV, torch.bfloat16), beta.to(DEV, torch.bfloat16)
    exclude = exclude.to(DEV)
    cfg = km.seeding_config(36, 5, 9, "resident", sms=3, factors=torch.bfloat16,
                            cooperative=False)
    assert (cfg["ROWS_A"], cfg["ROWS_B"], cfg["grid"], cfg["WA"], cfg["WB"]) == (16, 0, 3, 3, 5)
    want = ref.kmeanspp(alpha, beta, 30, seed=1, exclude=exclude)
    assert sorted(want.tolist()) == sorted(set(range(36)) - {3, 25, 26, 30, 31, 32})
    for coop in _cooperative_too():
        got = km.kmeanspp_triton(alpha, beta, 30, seed=1, exclude=exclude, variant="resident",
                                 sms=3, cooperative=coop)
        assert torch.equal(got.cpu(), want.cpu()), coop


@triton.jit
def _keys_kernel(score_ptr, idx_ptr, key_ptr, back_ptr, S: tl.constexpr):
    offs = tl.arange(0, S)
    key = kr._race_key(tl.load(score_ptr + offs), tl.load(idx_ptr + offs))
    tl.store(key_ptr + offs, key)
    tl.store(back_ptr + offs, kr._key_index(key))


def test_race_keys_order_by_score_then_smallest_index():
    """The int64 key the programs' atomic max compares: the larger score wins, and on equal
    scores (+0 and -0 included) the smaller index, as torch.argmax; the index comes back."""
    scores = [float("-inf"), -3.5, -1e-30, -0.0, 0.0, 1e-38, 2.0, 2.0, float("inf"), -3.5,
              7.25, 7.25, 0.0, -0.0, 1e30, -1e30]
    idx = [5, 9, 2, 44, 3, 0, 17, 6, 1000, 8, 2**31 - 2, 0, 12, 1, 40000, 7]
    s = torch.tensor(scores, dtype=torch.float32, device=DEV)
    i = torch.tensor(idx, dtype=torch.int32, device=DEV)
    key = torch.empty(16, dtype=torch.int64, device=DEV)
    back = torch.empty(16, dtype=torch.int32, device=DEV)
    _keys_kernel[(1,)](s, i, key, back, S=16)
    assert back.cpu().tolist() == idx
    by_key = sorted(range(16), key=lambda j: int(key[j]))
    by_rule = sorted(range(16), key=lambda j: (scores[j], -idx[j]))
    assert by_key == by_rule


@pytest.mark.parametrize("view", ["head", "queries"])
def test_the_resident_plan_reads_a_partly_filled_pool_and_picks_as_the_reference(view):
    """kernels.select(variant="resident") -- `train.py` with the resident variant on a GPU:
    the capacity plan over the first n of 200 rows (the rest masked), k = M, exclusions, bf16
    factors (odd width 15 in the queries view: padded rows) and fp32; the reference on the
    same rounded factors picks the same."""
    cap, m, d, dh = 200, 15, 16, 40
    keys, queries, feats, exclude = _pool(cap, m, d, dh, seed=7)
    for factors, n in (("bf16", 150), ("fp32", cap)):
        got = kernels.select(keys, queries, feats, m, seed=5, view=view, exclude=exclude[:n],
                             n=n, validate=False, factors=factors, variant="resident")
        a, b, bc, _ = ref.select_factors(keys[:n], queries, feats, tau=1.0, view=view)
        dt = ts.FACTOR_DTYPES[factors]
        want = ref.kmeanspp(a.to(dt), b.to(dt), m, seed=5, exclude=exclude[:n],
                            beta_c=None if bc is None else bc.to(dt))
        assert torch.equal(got.cpu(), want.cpu()), (factors, got, want)
        assert int(got.max()) < n
    plans = list(ts._PLANS.values())
    assert len(plans) == 2 and all(p.variant == "resident" for p in plans)
    assert all(p.cfg["cooperative"] == (not km.INTERPRETED) for p in plans)


def test_resident_fits_where_the_factors_fit_on_chip_and_the_plan_falls_back_elsewhere():
    """The issue's setting fits (N = 38,400, M = d = 128, bf16, 132 SMs: 320 rows a program);
    N = 153,600, M = 4,096 and fp32 factors at 38,400 do not, and a plan for a pool that does
    not fit runs the per-step variant."""
    fits = ts.resident_fits
    assert fits(38400, 128, 128, 512, view="head", factors="bf16", sms=132)
    assert fits(38400, 128, 128, 512, view="queries", factors="bf16", sms=132)
    assert not fits(153600, 128, 128, 512, view="head", factors="bf16", sms=132)
    assert not fits(1228800, 4096, 128, 512, view="head", factors="bf16", sms=132)
    assert not fits(38400, 4096, 128, 512, view="queries", factors="bf16", sms=132)
    assert not fits(38400, 128, 128, 512, view="head", factors="fp32", sms=132)
    assert fits(16000, 128, 128, 512, view="head", factors="fp32", sms=132)
    keys, queries, feats, _ = _pool(2048, 8, 256, 16, seed=1)  # 512 rows x 136 words at 4 SMs
    assert not fits(2048, 8, 256, 16, view="head", factors="bf16", sms=ts._sms(DEV))
    got = kernels.select(keys, queries, feats, 4, seed=0, n=2048, validate=False,
                         factors="bf16", variant="resident")
    (plan,) = ts._PLANS.values()
    assert plan.variant == "steps" and plan.best is None and len(got) == 4
    with pytest.raises(ValueError, match="does not hold 2048 candidates"):
        km.seeding_config(2048, 256, 16, "resident", sms=4, factors=torch.bfloat16)
