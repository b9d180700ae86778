"""pytest-benchmark suite of the selection ops at small sizes (`make bench`).

Collected by `pytest bench`, never by `pytest tests`. Small sizes so that it runs anywhere;
bench_kmeanspp.py / bench_grad_embed.py do the sweeps.
The Triton provider runs only on CUDA (interpreter timings are not performance figures).

    python -m pytest bench -q --benchmark-only [--benchmark-json out.json]
"""

import pytest
import torch

from bench.bench_grad_embed import providers as ge_providers
from bench.bench_kmeanspp import make_inputs
from bench.bench_kmeanspp import providers as sel_providers

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
M, D, DH = 128, 128, 512
SLOW = ("materialised", "sklearn")


def _runs_here(provider):
    return provider != "triton" or DEVICE == "cuda"


def _timed(benchmark, fn, slow):
    def run():
        out = fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return out

    return benchmark.pedantic(run, rounds=1 if slow else 5, iterations=1,
                              warmup_rounds=0 if slow else 1)


@pytest.mark.parametrize("provider", [p for p in sel_providers(DEVICE) if _runs_here(p)])
def test_selection(benchmark, provider):
    """grad_embed + k-means++ of M centres; N = 4096 (1024 for the 65,536-dim materialised
    providers on CPU, to keep the run short)."""
    n = 1024 if provider in SLOW and DEVICE == "cpu" else 4096
    keys, queries, feats = make_inputs(n, M, D, DH, DEVICE)
    fn = sel_providers(DEVICE)[provider]
    benchmark.group = f"selection N={n}"
    benchmark.extra_info.update(device=DEVICE, N=n, M=M, d=D, d_h=DH)
    idx = _timed(benchmark, lambda: fn(keys, queries, feats, M, 0), provider in SLOW)
    assert len(set(torch.as_tensor(idx).tolist())) == M


@pytest.mark.parametrize("n", [4096, 38400])
@pytest.mark.parametrize("provider", [p for p in ge_providers(DEVICE)
                                      if p != "materialised" and _runs_here(p)])
def test_grad_embed(benchmark, provider, n):
    keys, queries, feats = make_inputs(n, M, D, DH, DEVICE)
    fn = ge_providers(DEVICE)[provider]
    benchmark.group = f"grad_embed N={n}"
    benchmark.extra_info.update(device=DEVICE, N=n, M=M, d=D, d_h=DH)
    alpha, beta = _timed(benchmark, lambda: fn(keys, queries, feats), False)
    assert alpha.shape == (n, D) and beta.shape == (n, DH)
