"""pytest-benchmark entry of bench/bench_step.py (`make bench`): one training step of the MI
study's net at l = 1, random against active sampling on the same model, at a small size (M = 32,
K = 30 M, N = 60 M) so that it runs anywhere; bench_step.py does the full table."""

import pytest
import torch

from bench.bench_step import glyph_root, mi_setting, train_step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def glyphs(tmp_path_factory):
    from cmacc.apps.mi.data import Glyphs

    return Glyphs(glyph_root(None, tmp_path_factory.mktemp("glyphs")))


@pytest.mark.parametrize("sampler", ["random", "active"])
def test_training_step(benchmark, glyphs, sampler):
    s = mi_setting(sampler, 1, 60, glyphs, device=DEVICE, batch=32, width=16)
    step = iter(range(10**6))

    def run():
        stats = train_step(s, next(step), DEVICE)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return stats

    benchmark.group = "training step, MI l=1, M=32, N=60M"
    benchmark.extra_info.update(device=DEVICE, sampler=sampler, M=32, N=s.n_pool)
    stats = benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
    assert float(stats["active"]) == (1.0 if sampler == "active" else 0.0)
