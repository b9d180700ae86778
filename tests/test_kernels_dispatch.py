"""The kernels package's dispatch: why Triton is unavailable, bugs in a kernel file surfacing
instead of a silent fallback, lazy Triton imports, module names, and CMACC_KERNELS errors.

Everything that changes what `import triton` or a kernel file does runs in a fresh interpreter
(``sys.executable``), so this process's sys.modules and environment are left as they were."""

import importlib
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import kernels
from kernels import reference as ref

ROOT = Path(__file__).resolve().parents[1]

# A meta-path hook that makes `import triton` (and triton.*) fail as if the wheel were absent.
HIDE_TRITON = """
import sys
class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NoTriton())
"""


def _python(code: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter, without this process's TRITON_INTERPRET and
    CMACC_KERNELS (``env`` sets what the case needs)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CMACC_KERNELS")}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env={**clean, **env},
                          capture_output=True, text=True, timeout=300)


def test_missing_triton_is_reported_and_auto_falls_back_to_the_reference():
    code = HIDE_TRITON + """
import os, types
import torch
import kernels
from kernels import reference as ref

ok, why = kernels.triton_status()
assert not ok and why == "triton is not installed (pip install triton)", (ok, why)
assert kernels.backend_for(types.SimpleNamespace(is_cuda=True)) == "reference"  # auto, "CUDA"
alpha, beta = torch.randn(40, 3), torch.randn(40, 5)
assert torch.equal(kernels.kmeanspp(alpha, beta, 4, seed=1), ref.kmeanspp(alpha, beta, 4, seed=1))
os.environ["CMACC_KERNELS"] = "triton"
try:
    kernels.kmeanspp(alpha, beta, 4, seed=1)
except RuntimeError as e:
    assert "CMACC_KERNELS=triton" in str(e) and "triton is not installed" in str(e), e
else:
    raise AssertionError("CMACC_KERNELS=triton ran without triton")
print("ok")
"""
    out = _python(code, TRITON_INTERPRET="1")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.parametrize("bug, error", [
    ("undefined_name_in_kernel_file", "NameError"),
    ("def broken(:", "SyntaxError"),
    ("import a_dependency_that_is_not_installed", "ModuleNotFoundError"),
])
def test_a_bug_in_a_kernel_file_propagates_instead_of_falling_back(tmp_path, bug, error):
    """A copy of the package whose triton_kmeanspp.py has a bug: `import kernels` still works
    (the Triton modules load lazily), and the first call that needs Triton raises that bug --
    also under CMACC_KERNELS=auto, which must not pass it off as "triton missing"."""
    pytest.importorskip("triton")
    shutil.copytree(ROOT / "kernels", tmp_path / "kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "kernels" / "triton_kmeanspp.py", "a") as f:
        f.write(f"\n{bug}\n")
    code = f"""
import sys, types
import kernels
assert kernels.__file__.startswith({str(tmp_path)!r}), kernels.__file__
assert "kernels.triton_kmeanspp" not in sys.modules and "triton" not in sys.modules
kernels.backend_for(types.SimpleNamespace(is_cuda=True))
"""
    out = _python(code, cwd=tmp_path, CMACC_KERNELS="auto")
    assert out.returncode != 0, "the bug was swallowed"
    assert f"{error}" in out.stderr and "triton_kmeanspp.py" in out.stderr, out.stderr[-3000:]


def test_kernels_defined_for_the_compiler_then_interpret_on_cpu_names_the_fix():
    """TRITON_INTERPRET=1 set after the kernels were defined in compiled mode: the error says
    to set it before importing kernels / the first Triton call (defining needs no GPU)."""
    pytest.importorskip("triton")
    code = """
import os
import torch
import kernels

ok, why = kernels.triton_status()
assert ok and why.endswith("compiler"), why
os.environ["TRITON_INTERPRET"] = "1"
os.environ["CMACC_KERNELS"] = "triton"
try:
    kernels.kmeanspp(torch.randn(40, 3), torch.randn(40, 5), 4, seed=1)
except RuntimeError as e:
    assert "TRITON_INTERPRET=1 before importing kernels" in str(e), e
else:
    raise AssertionError("compiled kernels ran on CPU tensors")
print("ok")
"""
    out = _python(code)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_triton_modules_are_modules_and_the_public_names_are_the_ops():
    pytest.importorskip("triton")
    import kernels.triton_grad_embed as ge
    import kernels.triton_kmeanspp as km

    assert isinstance(km, types.ModuleType) and callable(km.kmeanspp_triton)
    assert isinstance(ge, types.ModuleType) and callable(ge.grad_embed_triton)
    for name in ("grad_embed", "kmeanspp", "select", "backend_for", "triton_status"):
        assert callable(getattr(kernels, name)) and name in kernels.__all__
    with pytest.raises(ModuleNotFoundError):  # the old module paths are gone, not shadowed
        importlib.import_module("kernels.kmeanspp")


def test_triton_status_in_this_process():
    pytest.importorskip("triton")
    ok, why = kernels.triton_status()
    assert ok and why.startswith("triton "), why


@pytest.mark.parametrize("value", ["bogus", "cuda", "tritonn"])
def test_a_bad_cmacc_kernels_value_names_the_variable(monkeypatch, value):
    alpha, beta = torch.randn(20, 2), torch.randn(20, 3)
    monkeypatch.setenv("CMACC_KERNELS", value)
    with pytest.raises(ValueError, match=f"CMACC_KERNELS='{value}'"):
        kernels.kmeanspp(alpha, beta, 3, seed=0)


def test_reference_choice_never_needs_triton(monkeypatch):
    keys, queries, feats = torch.randn(50, 8), torch.randn(6, 8), torch.randn(6, 12)
    monkeypatch.setenv("CMACC_KERNELS", "reference")
    assert kernels.backend_for(keys) == "reference"
    want = ref.kmeanspp(*ref.grad_embed(keys, queries, feats, compress=True), 5, seed=3)
    assert torch.equal(kernels.select(keys, queries, feats, 5, seed=3), want)


def test_select_impl_flag_forces_a_variant_with_the_measured_choice_the_default():
    """`train.py --select-impl lazy` makes the selection ask kernels.select for the lazy
    variant; the default is "auto" (the plan's measured choice), eager forces the --kmeans
    variant, and so does --kmeans persistent; lazy and resident have no persistent form (a
    one-line refusal); and, having the same picks, none changes the checkpoint hash."""
    sys.path.insert(0, str(ROOT))
    import train
    from cmacc.config import SelectionConfig, config_hash

    def sel(*argv):
        return train.config_from_args(train.build_parser().parse_args(list(argv))).selection

    assert sel().impl == "auto" and sel().kmeans_variant == "auto"
    assert sel("--select-impl", "eager").kmeans_variant == "steps"
    assert sel("--kmeans", "persistent").kmeans_variant == "persistent"
    assert sel("--select-impl", "eager", "--kmeans", "persistent").kmeans_variant == "persistent"
    assert sel("--select-impl", "lazy").kmeans_variant == "lazy"
    assert sel("--select-impl", "resident").kmeans_variant == "resident"
    for impl in ("lazy", "resident"):
        with pytest.raises(ValueError, match="no persistent variant; drop --kmeans persistent"):
            sel("--select-impl", impl, "--kmeans", "persistent")
    lazy = train.config_from_args(train.build_parser().parse_args(["--select-impl", "lazy"]))
    eager = SelectionConfig(**{**vars(lazy.selection), "impl": "eager"})
    assert config_hash(lazy.model, lazy.selection) == config_hash(lazy.model, eager)
