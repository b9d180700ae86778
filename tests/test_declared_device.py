"""The kernel tests run on the device they declare: the check that would have caught both
kernel-test defects of the first GPU run: a model built on the CPU in
test_select_plan.py::test_overlapped_schedule_gives_the_serial_results, host tensors handed to
grad_embed_triton in
test_grad_embed.py::test_a_launch_configuration_set_by_hand_is_used_and_checked.

The kernel test modules of ``make gpu-check`` run in a subprocess with CMACC_TEST_DEVICE=meta:
``DEV`` (tests/devices.py) is then ``meta``, a device that is not the CPU and exists without a
GPU, and tests/conftest.py checks every Triton launch and every call of the dispatch
(kernels.select / grad_embed / kmeanspp, the reference path too): a tensor argument off DEV
fails the test, as a compiled launch on a GPU would ("Pointer argument cannot be accessed from
Triton (cpu tensor?)"); all on DEV ends the test there (skipped, "reached").

What it sees: every tensor handed to the first kernel call of each test, wherever it was built
(a helper, a model, a fixture). What it cannot see: calls after a test's first kernel call (the
test stops there: meta tensors hold no values); tests that stop before any kernel because they
compute on values first (a reference pick, ``torch.equal``, ``.item()``: listed as "not reached"
in the output, about one test in six today); host tensors given to plain torch ops (on CUDA
these fail loudly at once, with the op named); and everything only a compiled kernel does.
tests/test_reference.py is left out: it tests the reference ops on CPU tensors by design and
calls no kernel.
"""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.gpu_check import KERNEL_TESTS  # noqa: E402

MODULES = [m for m in KERNEL_TESTS if m != "tests/test_reference.py"]
HOST = "but handed the kernels a host tensor"


def run_on_meta(paths, tmp_path, extra=()) -> dict[str, tuple[str, str]]:
    """test id -> (outcome, message) of ``paths`` run with DEV = meta; outcome is one of
    'reached' (every tensor on DEV at the first kernel call), 'host' (a tensor off DEV), 'not
    reached' (failed for another reason before any kernel) or 'no kernel' (passed or skipped
    without calling one)."""
    from conftest import REACHED

    xml = tmp_path / "meta.xml"
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "CMACC_TEST_DEVICE": "meta", "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    # --tb=native: the failures' messages (all that is read here) as in pytest's own style,
    # without rendering its long tracebacks of the ~25 "not reached" tests (half the time)
    res = subprocess.run([sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider",
                          "--tb=native", f"--junitxml={xml}", *extra], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert xml.exists(), res.stdout[-2000:] + res.stderr[-2000:]
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            msg = bad.get("message") or ""
            out[name] = ("host" if HOST in msg else "not reached", msg.splitlines()[0][:160])
        elif skip is not None and REACHED in (skip.get("message") or ""):
            out[name] = ("reached", skip.get("message"))
        else:
            out[name] = ("no kernel", "")
    return out


def test_every_kernel_test_hands_the_kernels_tensors_on_its_declared_device(tmp_path):
    got = run_on_meta(MODULES, tmp_path)
    for name, (outcome, msg) in sorted(got.items()):
        print(f"{outcome:<12} {name}  {msg}")
    host = [f"{n}: {m}" for n, (o, m) in got.items() if o == "host"]
    assert not host, "\n".join(host)
    reached = {n.rsplit("::", 1)[-1] for n, (o, _) in got.items() if o == "reached"}
    assert {"test_a_launch_configuration_set_by_hand_is_used_and_checked",
            "test_overlapped_schedule_gives_the_serial_results"} <= reached
    assert len(reached) >= 0.6 * len(got), (len(reached), len(got))


def test_the_check_fails_a_test_that_builds_on_the_cpu(tmp_path):
    """The defect class, both ways it happened: a kernel launch with host tensors and a model
    run through the dispatch with host tensors; beside them the same calls built on DEV."""
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        "import torch\n"
        "import kernels\n"
        "from devices import DEV\n"
        "from kernels.triton_grad_embed import grad_embed_triton\n\n"
        "def test_host_launch():\n"
        "    grad_embed_triton(torch.randn(70, 12), torch.randn(9, 12), torch.randn(9, 20))\n\n"
        "def test_host_dispatch():\n"
        "    kernels.select(torch.randn(50, 8), torch.randn(4, 8).to(DEV), None, 4, seed=0,\n"
        "                   view='queries')\n\n"
        "def test_declared_launch():\n"
        "    grad_embed_triton(*(torch.randn(s).to(DEV) for s in ((70, 12), (9, 12), (9, 20))))\n")
    got = run_on_meta([str(sample), "-p", "conftest", f"--rootdir={tmp_path}"], tmp_path)
    got = {n.rsplit("::", 1)[-1]: o for n, (o, _) in got.items()}
    assert got == {"test_host_launch": "host", "test_host_dispatch": "host",
                   "test_declared_launch": "reached"}, got
