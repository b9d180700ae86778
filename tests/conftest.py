"""Shared fixtures. Without a GPU, Triton kernels run in the Triton interpreter: the variable
must be set before any @triton.jit function is defined (at the first import of
kernels.triton_grad_embed / kernels.triton_kmeanspp), hence here, before any test imports."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A 6-step tiny-preset pretraining run on synthetic clips (run folder with checkpoint)."""
    import train

    out = tmp_path_factory.mktemp("tiny_run")
    train.main(["--preset", "tiny", "--clips", "96", "--classes", "6", "--steps", "6",
                "--log-every", "3", "--out", str(out)])
    return out


@pytest.fixture(scope="session")
def broken(tmp_path_factory):
    """A folder of deliberately bad and good videos (data_dali.synthetic.write_broken) and its
    prepared dataset: (source folder, prepared folder, expected outcome per file, summary).
    Tests only read it (re-running prepare on it is a no-op)."""
    from data_dali import prepare as prep
    from data_dali import synthetic

    src = tmp_path_factory.mktemp("src")
    truth = synthetic.write_broken(src / "cls")
    out = tmp_path_factory.mktemp("prepared")
    summary = prep.prepare(src, out, workers=2, progress=False)
    return src, out, truth, summary
