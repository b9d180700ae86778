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


@pytest.fixture(autouse=True)
def _commands_log_only_within_their_test():
    """Commands run in-process (here, or in session fixtures) install a stderr log handler
    (data_dali.cli.setup_logging); each test starts and ends without it, so what a test reads
    on stderr never depends on test order."""
    from data_dali.cli import drop_logging

    drop_logging()
    yield
    drop_logging()


@pytest.fixture(scope="session")
def tiny_prepared(tmp_path_factory):
    """12 tiny synthetic clips (2 classes, class folders: no split columns) and their prepared
    dataset: (source folder, prepared folder). Tests only read it."""
    from data_dali import prepare as prep
    from data_dali import synthetic

    root = tmp_path_factory.mktemp("tiny")
    src = synthetic.write_dataset(root / "src", classes=2, per_class=6, seconds=1.0, width=32,
                                  height=24, fps=10)
    (src / "list.csv").unlink()
    prep.prepare(src, root / "clean", workers=1, progress=False,
                 cfg=prep.PrepareConfig(short_side=16, min_seconds=0.5))
    return src, root / "clean"
