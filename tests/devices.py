"""The device the kernel tests declare (``DEV``): ``cuda`` on a GPU machine (``make gpu-check``
runs them with the compiled kernels), ``cpu`` elsewhere (the Triton interpreter).
``CMACC_TEST_DEVICE`` overrides it; ``CMACC_TEST_DEVICE=meta`` is the declared-device check of
tests/test_declared_device.py (tests/conftest.py then stops each test at its first kernel)."""

import os

import torch

DEV = os.environ.get("CMACC_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


def selection_inputs(cap, m, d, dh, seed=0):
    """A selection's inputs on DEV: unit keys [cap, d], unit queries [M, d], features [M, d_h]
    and a random exclusion mask [cap] (a fifth excluded), drawn from ``seed``."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    keys = F.normalize(torch.randn(cap, d, generator=g), dim=1).to(DEV)  # [cap, d]
    queries = F.normalize(torch.randn(m, d, generator=g), dim=1).to(DEV)  # [M, d]
    feats = torch.randn(m, dh, generator=g).to(DEV)  # [M, d_h]
    exclude = (torch.rand(cap, generator=g) < 0.2).to(DEV)  # [cap]
    return keys, queries, feats, exclude


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA (``x.as_subclass(FakeCuda)``): a layer's CUDA
    branch, run on the CPU."""

    @property
    def is_cuda(self):
        return True
