"""Triton grad_embed (the interpreter on CPU, compiled on GPU) against independent references:
torch.autograd and the formulas in float64, the PyTorch reference op, and -- for fp16/bf16
inputs -- the error plain PyTorch makes in that dtype (flash-attention style).

Pseudo-labels: yhat = argmax of the logits. Two implementations that sum in different orders
may disagree when a row's top-2 logits are within rounding of each other, and then that row's
residual r differs entirely. The comparisons are therefore made on rows whose float64 top-2
gap exceeds a margin well above the rounding error of the dtype (``_clear_rows``); at least 95%
of the rows must qualify, so the tests cannot pass vacuously.
"""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # before any Triton kernel is defined (at kernels import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from kernels import reference as ref  # noqa: E402
from kernels.triton_grad_embed import (  # noqa: E402
    TILED_MAX_M,
    grad_embed_triton,
    grad_embed_triton_with_norms,
)

from devices import DEV  # noqa: E402
SHAPES = [  # N, M, d, d_h
    (1000, 24, 48, 80),  # awkward sizes; N not a multiple of the row block (tail)
    (37, 3, 5, 7),  # tiny, everything padded
    (70, 1, 16, 16),  # one pseudo-label: r = 0
    (45, 128, 128, 512),  # the real M, d, d_h; d_h spans several column chunks
    (33, 256, 300, 20),  # M = 256 (MAX_M), d = 300 spans several chunks, d_h < M
    (40, 300, 20, 150),  # M > MAX_M: the tiled kernel, 5 chunks of pseudo-labels, a ragged one
]


def _inputs(n, m, d, dh, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = F.normalize(torch.randn(n, d, generator=g), dim=1)  # [N, d]
    queries = F.normalize(torch.randn(m, d, generator=g), dim=1)  # [M, d]
    feats = torch.randn(m, dh, generator=g)  # [M, d_h]
    return keys.to(DEV), queries.to(DEV), feats.to(DEV)


def _float64(keys, queries, feats, tau, view):
    """docs/DESIGN.md §1 steps 1-3 in float64, written out independently: (alpha, beta, logits)."""
    k, q = keys.double(), queries.double()
    s = k @ q.t() / tau  # [N, M]
    p = torch.softmax(s, 1)
    r = p - F.one_hot(s.argmax(1), q.shape[0]).double()
    if view == "queries":
        return r, k / tau, s
    return k, r @ feats.double() / tau, s


def _clear_rows(s, gap):
    """Rows whose top-2 logits differ by more than ``gap``: the pseudo-label is unambiguous."""
    if s.shape[1] == 1:
        return torch.ones(s.shape[0], dtype=torch.bool, device=s.device)
    top2 = s.topk(2, dim=1).values
    return (top2[:, 0] - top2[:, 1]) > gap


@pytest.mark.parametrize("n,m,d,dh", SHAPES)
@pytest.mark.parametrize("view", ["head", "queries"])
def test_fp32_matches_reference_and_float64(n, m, d, dh, view):
    keys, queries, feats = _inputs(n, m, d, dh)
    a, b, sqn = grad_embed_triton_with_norms(keys, queries, feats, tau=0.7, view=view)
    ra, rb = ref.grad_embed(keys, queries, feats, tau=0.7, view=view)
    xa, xb, s = _float64(keys, queries, feats, 0.7, view)
    ok = _clear_rows(s, gap=1e-4)
    assert ok.float().mean() > 0.95
    assert a.dtype == b.dtype == sqn.dtype == torch.float32
    assert a.shape == ra.shape and b.shape == rb.shape and sqn.shape == (n,)
    for got, want, exact in ((a, ra, xa), (b, rb, xb)):
        torch.testing.assert_close(got[ok], want[ok], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[ok].double(), exact[ok], rtol=1e-5, atol=1e-5)
    want_sqn = (xa * xa).sum(1) * (xb * xb).sum(1)  # |g_n|^2
    torch.testing.assert_close(sqn[ok].double(), want_sqn[ok], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("view", ["head", "queries"])
def test_outer_product_equals_autograd(view):
    """alpha (x) beta is the gradient of CE(softmax(s_n), yhat_n) w.r.t. the last layer, as
    torch.autograd computes it in float64 (the head view: W [d, d_h] with q_j = W h_j)."""
    n, m, d, dh = 19, 6, 9, 11
    g = torch.Generator().manual_seed(3)
    keys = F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)
    feats = torch.randn(m, dh, generator=g, dtype=torch.float64)
    w = torch.randn(d, dh, generator=g, dtype=torch.float64) / dh**0.5
    queries = feats @ w.t()  # [M, d]
    a, b = grad_embed_triton(keys.float().to(DEV), queries.float().to(DEV),
                             feats.float().to(DEV), tau=0.5, view=view)
    want = ref.grad_embed_autograd(keys, w if view == "head" else queries, feats, tau=0.5,
                                   view=view)
    torch.testing.assert_close(ref.materialise(a, b).double().cpu(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,m,d,dh", [(300, 24, 48, 80), (50, 128, 128, 512), (40, 130, 20, 90)])
def test_compressed_beta_preserves_distances(n, m, d, dh):
    keys, queries, feats = _inputs(n, m, d, dh, seed=1)
    a, b = grad_embed_triton(keys, queries, feats, view="head", compress=True)
    ra, rb = ref.grad_embed(keys, queries, feats, view="head")  # uncompressed
    assert b.shape[1] == min(m, dh)
    got = ref.pairwise_sqdist_factored(a, b, a, b)
    want = ref.pairwise_sqdist_factored(ra, rb, ra, rb)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4 * float(want.max()))


def test_strided_inputs():
    """Non-contiguous keys / queries / feats (transposed and sliced views) are read through
    their strides."""
    keys, queries, feats = _inputs(90, 10, 24, 40, seed=4)
    keys_t = keys.t().contiguous().t()  # [N, d] with stride (1, N)
    feats_s = torch.stack([feats, -feats], 2).flatten(1)[:, ::2]  # [M, d_h], column stride 2
    assert torch.equal(feats_s, feats) and feats_s.stride(1) == 2
    for view in ("head", "queries"):
        a, b = grad_embed_triton(keys_t, queries.t().contiguous().t(), feats_s, view=view)
        ra, rb = ref.grad_embed(keys, queries, feats, view=view)
        torch.testing.assert_close(a, ra, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b, rb, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("view", ["head", "queries"])
def test_low_precision_inputs(dtype, view):
    """Inputs rounded to fp16/bf16. (1) The kernel computes in fp32, so it matches the fp32
    reference on the same rounded inputs to fp32 tolerance. (2) Its error against float64 on
    those inputs is at most ~2x the error of plain PyTorch doing the math in that dtype."""
    keys, queries, feats = (t.to(dtype) for t in _inputs(400, 24, 48, 80, seed=2))
    a, b = grad_embed_triton(keys, queries, feats, tau=0.7, view=view)
    xa, xb, s = _float64(keys, queries, feats, 0.7, view)
    # plain PyTorch in fp16 / bf16 errs on the logits by up to ~6e-4 / 3e-3 here: a label can
    # only flip where the top-2 gap is below twice that
    ok = _clear_rows(s, gap=2e-3 if dtype == torch.float16 else 1e-2)
    assert ok.float().mean() > 0.9
    ra, rb = ref.grad_embed(keys, queries, feats, tau=0.7, view=view)  # fp32 math
    torch.testing.assert_close(a[ok], ra[ok], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b[ok], rb[ok], rtol=1e-5, atol=1e-5)
    # plain PyTorch in the input dtype (softmax upcast internally, as autocast would)
    sl = keys @ queries.t() / 0.7
    pl = torch.softmax(sl.float(), 1).to(dtype)
    rl = pl - F.one_hot(sl.argmax(1), 24).to(dtype)
    la, lb = (rl, keys / 0.7) if view == "queries" else (keys, (rl @ feats) / 0.7)
    for got, low, exact in ((a, la, xa), (b, lb, xb)):
        err = (got[ok].double() - exact[ok]).abs().max().item()
        err_low = (low[ok].double() - exact[ok]).abs().max().item()
        assert err <= 2 * err_low + 1e-6, (err, err_low)


def test_bad_input_is_a_clear_error():
    keys, queries, feats = _inputs(10, 4, 8, 12)
    with pytest.raises(ValueError, match="needs feats"):
        grad_embed_triton(keys, queries, None, view="head")
    with pytest.raises(ValueError, match="key dim"):
        grad_embed_triton(keys[:, :5], queries, feats)
    with pytest.raises(ValueError, match="view="):
        grad_embed_triton(keys, queries, feats, view="weights")
    too_many = torch.randn(TILED_MAX_M + 1, 8, device=DEV)
    with pytest.raises(ValueError, match=rf"must be in \[1, {TILED_MAX_M}\]"):
        grad_embed_triton(keys, too_many, torch.randn(TILED_MAX_M + 1, 4, device=DEV))


def test_empty_pool():
    keys, queries, feats = _inputs(0, 4, 8, 12)
    a, b, sqn = grad_embed_triton_with_norms(keys, queries, feats)
    assert a.shape == (0, 8) and b.shape == (0, 12) and sqn.shape == (0,)


def test_a_launch_configuration_set_by_hand_is_used_and_checked(monkeypatch):
    """CMACC_EMBED_CONFIG pins (rows per program, warps) for comparisons on a GPU; the factors
    agree to rounding (here: the interpreter, 16-row programs against the default 64; another
    tile shape sums in another order, which is why every rank must use the same one)."""
    from kernels import triton_grad_embed as ge

    g = torch.Generator().manual_seed(3)
    keys = torch.randn(70, 12, generator=g).to(DEV)  # [N, d]
    queries = torch.randn(9, 12, generator=g).to(DEV)  # [M, d]
    feats = torch.randn(9, 20, generator=g).to(DEV)  # [M, d_h]
    want = grad_embed_triton(keys, queries, feats, view="head")
    monkeypatch.setenv("CMACC_EMBED_CONFIG", "16,4")
    assert ge.embed_config(9, "head", False, "ieee") == (16, 4)
    got = grad_embed_triton(keys, queries, feats, view="head")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for bad, msg in (("32", "expected 'BLOCK_N,num_warps'"), ("48,8", "BLOCK_N must be")):
        monkeypatch.setenv("CMACC_EMBED_CONFIG", bad)
        with pytest.raises(ValueError, match=msg):
            ge.embed_config(9, "head", False, "ieee")
