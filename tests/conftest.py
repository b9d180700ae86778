"""Shared fixtures. Without a GPU, Triton kernels run in the Triton interpreter: the variable
must be set before any @triton.jit function is defined (at import of kernels.grad_embed /
kernels.kmeanspp), hence here."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import train


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A 6-step tiny-preset pretraining run on synthetic clips (run folder with checkpoint)."""
    out = tmp_path_factory.mktemp("tiny_run")
    train.main(["--preset", "tiny", "--clips", "96", "--classes", "6", "--steps", "6",
                "--log-every", "3", "--out", str(out)])
    return out
