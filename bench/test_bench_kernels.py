"""pytest-benchmark suite (`make bench`): the selection providers at small sizes, so that it
runs anywhere; the scripts bench_kmeanspp.py / bench_grad_embed.py do the full sweeps.

    pytest bench --benchmark-only [--benchmark-json out.json]
"""

import pytest
import torch

from bench.bench_grad_embed import providers as ge_providers
from bench.bench_kmeanspp import make_inputs
from bench.bench_kmeanspp import providers as sel_providers

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
M, D, DH = 128, 128, 512


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("n", [4096])
@pytest.mark.parametrize("provider", list(sel_providers(DEVICE)))
def test_selection(benchmark, provider, n):
    if provider in ("materialised", "sklearn") and DEVICE == "cpu":
        n = 1024  # 65,536-dim embeddings: keep the CPU run short
    keys, queries, feats = make_inputs(n, M, D, DH, DEVICE)
    fn = sel_providers(DEVICE)[provider]
    benchmark.group = f"selection N={n}"
    benchmark.extra_info.update(device=DEVICE, N=n, M=M)

    def run():
        out = fn(keys, queries, feats, M, 0)
        _sync()
        return out

    slow = provider in ("materialised", "sklearn")
    idx = benchmark.pedantic(run, rounds=1 if slow else 3, iterations=1, warmup_rounds=0 if slow else 1)
    assert len(set(torch.as_tensor(idx).tolist())) == M


@pytest.mark.parametrize("n", [4096, 38400])
@pytest.mark.parametrize("provider", [p for p in ge_providers(DEVICE) if p != "materialised"])
def test_grad_embed(benchmark, provider, n):
    keys, queries, feats = make_inputs(n, M, D, DH, DEVICE)
    fn = ge_providers(DEVICE)[provider]
    benchmark.group = f"grad_embed N={n}"

    def run():
        out = fn(keys, queries, feats)
        _sync()
        return out

    alpha, beta = benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
    assert alpha.shape == (n, D) and beta.shape == (n, DH)
