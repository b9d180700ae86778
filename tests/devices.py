"""The device the kernel tests declare (``DEV``): ``cuda`` on a GPU machine (``make gpu-check``
runs them with the compiled kernels), ``cpu`` elsewhere (the Triton interpreter).
``CMACC_TEST_DEVICE`` overrides it; ``CMACC_TEST_DEVICE=meta`` is the declared-device check of
tests/test_declared_device.py (tests/conftest.py then stops each test at its first kernel)."""

import os

import torch

DEV = os.environ.get("CMACC_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
