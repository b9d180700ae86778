"""Shared fixtures. Without a GPU, Triton kernels run in the Triton interpreter: the variable
must be set before any @triton.jit function is defined (at the first import of
kernels.triton_grad_embed / kernels.triton_kmeanspp), hence here, before any test imports.
Under CMACC_TEST_DEVICE=meta (tests/devices.py) the kernels are the interpreter's too, and
``_kernels_take_the_declared_device`` checks what each test hands them.

``make test`` runs the suite on two pytest-xdist workers with one torch thread each (set here,
before torch is imported, for a worker started without it), then the tests marked ``serial``
alone: those that start several processes at once (torchrun) or wait on timers that a busy
machine would stretch."""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch

from devices import DEV

if not torch.cuda.is_available() or DEV == "meta":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "serial: needs the whole machine; make test runs it alone, "
                            "after the parallel pass")


REACHED = "reached the kernels with every tensor on the declared device"


def _host_tensors(args: dict, dev: str) -> list[str]:
    return [f"{name} ({t.device})" for name, t in args.items()
            if isinstance(t, torch.Tensor) and t.device.type != dev]


@pytest.fixture(autouse=True)
def _kernels_take_the_declared_device(monkeypatch):
    """Only with DEV = 'meta' (a device that is not the CPU and exists without a GPU): every
    Triton launch and every call of the dispatch (kernels.select / grad_embed / kmeanspp, the
    reference path included) first checks that each tensor argument is on DEV -- a compiled
    Triton launch refuses a host tensor ("Pointer argument cannot be accessed from Triton (cpu
    tensor?)") -- and then ends the test as skipped (meta tensors hold no values to compute
    with). Off meta: nothing."""
    if DEV != "meta":
        yield
        return
    import kernels
    from triton.runtime.interpreter import InterpretedFunction

    def check(what, named):
        bad = _host_tensors(named, DEV)
        if bad:
            pytest.fail(f"this test declares device {DEV!r} but handed the kernels a host "
                        f"tensor: {what} got {', '.join(bad)}; build its inputs on DEV",
                        pytrace=False)
        pytest.skip(f"{REACHED} ({what})")

    def launch(self, *args, grid, warmup, **kwargs):
        check(f"launch of {self.__name__}", {**dict(zip(self.arg_names, args)), **kwargs})

    def dispatch(name):
        def op(*args, **kwargs):
            check(f"kernels.{name}", {**{f"arg {i}": a for i, a in enumerate(args)}, **kwargs})
        return op

    monkeypatch.setattr(InterpretedFunction, "run", launch)
    for name in ("select", "grad_embed", "kmeanspp"):
        monkeypatch.setattr(kernels, name, dispatch(name))
    yield


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
