"""Triton grad_embed (interpreter on CPU, compiled on GPU) against an independent float64
computation and the PyTorch reference; low-precision inputs judged flash-attention style."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kernels import reference as ref  # noqa: E402
from kernels.grad_embed import grad_embed_triton, grad_embed_triton_with_norms  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [  # N, M, d, d_h: awkward sizes, a tail block, M = 1 and 3, d_h > M and < M
    (1000, 24, 48, 80),
    (37, 3, 5, 7),
    (70, 1, 16, 16),
    (45, 128, 128, 512),
    (33, 256, 40, 20),
]


def _inputs(n, m, d, dh, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = F.normalize(torch.randn(n, d, generator=g), dim=1)
    queries = F.normalize(torch.randn(m, d, generator=g), dim=1)
    feats = torch.randn(m, dh, generator=g)
    return keys.to(DEV), queries.to(DEV), feats.to(DEV)


def _float64(keys, queries, feats, tau, view):
    """The formulas of DESIGN.md §1 step 3, in float64, written out independently."""
    k, q = keys.double(), queries.double()
    s = k @ q.t() / tau
    p = torch.softmax(s, 1)
    r = p - F.one_hot(s.argmax(1), q.shape[0]).double()
    if view == "queries":
        return r, k / tau, s
    return k, r @ feats.double() / tau, s


def _clear_rows(s, gap=1e-4):
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
    ok = _clear_rows(s)
    assert ok.float().mean() > 0.95
    assert a.dtype == b.dtype == torch.float32 and a.shape == ra.shape and b.shape == rb.shape
    for got, want, exact in ((a, ra, xa), (b, rb, xb)):
        torch.testing.assert_close(got[ok], want[ok], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[ok].double(), exact[ok], rtol=1e-5, atol=1e-5)
    want_sqn = (xa * xa).sum(1) * (xb * xb).sum(1)
    torch.testing.assert_close(sqn[ok].double(), want_sqn[ok], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n,m,d,dh", [(300, 24, 48, 80), (50, 128, 128, 512)])
def test_compressed_beta_preserves_distances(n, m, d, dh):
    keys, queries, feats = _inputs(n, m, d, dh, seed=1)
    a, b = grad_embed_triton(keys, queries, feats, view="head", compress=True)
    ra, rb = ref.grad_embed(keys, queries, feats, view="head")  # uncompressed
    assert b.shape[1] == min(m, dh)
    got = ref.pairwise_sqdist_factored(a, b, a, b)
    want = ref.pairwise_sqdist_factored(ra, rb, ra, rb)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4 * want.max().item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("view", ["head", "queries"])
def test_low_precision_inputs_error_at_most_twice_plain_torch(dtype, view):
    """Inputs rounded to fp16/bf16. Error against float64 on the same rounded inputs must be at
    most ~2x the error of plain PyTorch doing the same math in that dtype."""
    keys, queries, feats = (t.to(dtype) for t in _inputs(400, 24, 48, 80, seed=2))
    a, b = grad_embed_triton(keys, queries, feats, tau=0.7, view=view)
    xa, xb, s = _float64(keys, queries, feats, 0.7, view)
    ok = _clear_rows(s, gap=5e-2)  # low-precision baselines may flip near-tied pseudo-labels
    # plain PyTorch in the input dtype
    sl = keys @ queries.t() / 0.7
    pl = torch.softmax(sl.float(), 1).to(dtype)
    rl = pl - F.one_hot(sl.argmax(1), 24).to(dtype)
    la, lb = (rl, keys / 0.7) if view == "queries" else (keys, (rl @ feats) / 0.7)
    for got, low, exact in ((a, la, xa), (b, lb, xb)):
        err = (got[ok].double() - exact[ok]).abs().max().item()
        err_low = (low[ok].double() - exact[ok]).abs().max().item()
        assert err <= 2 * err_low + 1e-6, (err, err_low)


def test_shape_errors_are_clear():
    keys, queries, feats = _inputs(10, 4, 8, 12)
    with pytest.raises(ValueError, match="needs feats"):
        grad_embed_triton(keys, queries, None, view="head")
    with pytest.raises(ValueError, match="pseudo-labels > 256"):
        grad_embed_triton(keys[:, :8], torch.randn(300, 8, device=DEV), torch.randn(300, 4, device=DEV))
