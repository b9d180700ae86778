"""The layers import in one direction (docs/ARCHITECTURE.md), checked by walking every import
statement (function-level ones included) with ``ast``:

    kernels  ←  cmacc (library)  ←  cmacc.apps, train.py
    data_dali ← cmacc.data (the library's data side), cmacc.apps
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool) -> set[str]:
    """Absolute names of every module imported by ``source`` (relative imports resolved)."""
    out = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)  # `from pkg import submodule`
    return out


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(module: str, imported: set[str]) -> list[str]:
    """Upward or sideways arrows from ``module``: one message each."""
    bad = []
    for name in sorted(imported):
        if under(name, "train") and module != "train":
            bad.append(f"{module} imports the CLI train.py ({name})")
        elif under(name, "nvidia.dali") and not under(module, "data_dali"):
            bad.append(f"{module} imports DALI directly ({name}); only data_dali does")
        elif under(module, "kernels") and any(under(name, p) for p in
                                              ("cmacc", "data_dali", "bench", "torch.distributed")):
            bad.append(f"kernels module {module} imports {name} (kernels: ops only)")
        elif under(module, "data_dali") and any(under(name, p) for p in ("cmacc", "kernels", "bench")):
            bad.append(f"data_dali module {module} imports {name} (data_dali is below cmacc)")
        elif under(module, "cmacc") and not under(module, "cmacc.apps"):
            if under(name, "cmacc.apps") or under(name, "bench"):
                bad.append(f"library module {module} imports the application {name}")
            elif (under(name, "data_dali") and module != "cmacc.data"
                  and not any(under(name, f"data_dali.{m}") for m in ("fileio", "cli", "classdist"))):
                bad.append(f"library module {module} imports {name}; only cmacc.data (the data "
                           "side) reads data_dali")
    return bad


def project_modules():
    files = [ROOT / "train.py"]
    for pkg in ("kernels", "cmacc", "data_dali"):
        files += sorted((ROOT / pkg).rglob("*.py"))
    return files


def test_imports_point_one_way():
    found = []
    for path in project_modules():
        module = module_name(path)
        found += violations(module, imports_of(path.read_text(), module, path.name == "__init__.py"))
    assert not found, "\n".join(found)


@pytest.mark.parametrize("module,source", [
    ("cmacc.model", "import train"),
    ("cmacc.samplers", "def f():\n    from .apps import demo\n"),
    ("cmacc.trainer", "from data_dali.loader import build_loader"),
    ("kernels.reference", "from cmacc import config"),
    ("kernels.triton_kmeanspp", "import torch.distributed as dist"),
    ("data_dali.loader", "from cmacc.config import DataConfig"),
    ("cmacc.encoders", "from nvidia.dali import fn"),
])
def test_the_checker_catches_upward_arrows(module, source):
    assert violations(module, imports_of(source, module, False))


def test_every_module_states_its_job():
    missing = [str(p.relative_to(ROOT)) for p in project_modules() + sorted((ROOT / "bench").glob("*.py"))
               if p.stat().st_size and not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, f"modules without a docstring: {missing}"


def test_the_typed_config_does_not_import_the_data_side():
    """cmacc.data builds loaders from a DataConfig; the config never imports cmacc.data back
    (the class-distribution check comes from data_dali.classdist)."""
    path = ROOT / "cmacc" / "config.py"
    imported = imports_of(path.read_text(), "cmacc.config", False)
    assert not any(under(name, "cmacc.data") for name in imported), sorted(imported)
