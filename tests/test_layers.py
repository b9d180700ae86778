"""The layers import in one direction (docs/ARCHITECTURE.md), checked by walking every import
statement (function-level ones included) with ``ast``:

    kernels  ←  cmacc (library)  ←  cmacc.apps, train.py
    data_dali ← cmacc.data (the library's data side), cmacc.apps

and no two project modules import each other, directly or around a loop (``import_cycles``).
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
                  # the plain modules (standard library and numpy): files, messages, and the
                  # laws the typed config checks values against (class shares, augmentations)
                  and not any(under(name, f"data_dali.{m}")
                              for m in ("fileio", "cli", "classdist", "augment"))):
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


def imports_in_functions(source: str, module: str, is_package: bool) -> set[str]:
    """The modules imported only inside functions (run after every module has loaded)."""
    tree = ast.parse(source)
    top = ast.Module(body=[n for n in tree.body
                           if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))],
                     type_ignores=[])
    return (imports_of(source, module, is_package)
            - imports_of(ast.unparse(top), module, is_package))


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the project modules it imports (``from pkg import name`` counts as importing
    ``pkg.name`` when that is a module, else ``pkg``); sources: module -> (source, is_package).
    One arrow is left out: a function of a submodule importing its own package (Python has
    initialised the package before the submodule, e.g. cmacc.apps.mi.cli reading the package's
    docstring for --help)."""
    graph = {}
    for module, (source, is_package) in sources.items():
        late = imports_in_functions(source, module, is_package)
        graph[module] = {name for name in imports_of(source, module, is_package)
                         if name in sources and name != module
                         and not (name in late and module.startswith(name + "."))}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every loop of imports (a strongly connected component of more than one module, found by
    Tarjan's algorithm), each as a sorted list of its modules. A package importing its own
    submodules (``__init__`` re-exports) is not a loop unless a submodule imports it back."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_two_modules_import_each_other():
    sources = {module_name(p): (p.read_text(), p.name == "__init__.py") for p in project_modules()}
    cycles = import_cycles(import_graph(sources))
    assert not cycles, "import loops (make one module the lower one): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_cycle_finder_sees_a_loop_through_a_function_level_import():
    """The loop data_dali.manifest <-> data_dali.manifest_tools had: a module-level import one
    way, an import under ``if __name__ == "__main__"`` the other; and a three-module loop."""
    pair = {"data_dali.manifest": ("if __name__ == '__main__':\n"
                                   "    from data_dali.manifest_tools import main\n", False),
            "data_dali.manifest_tools": ("from .manifest import Manifest\n", False)}
    assert import_cycles(import_graph(pair)) == [["data_dali.manifest", "data_dali.manifest_tools"]]
    ring = {"a.x": ("from a import y\n", False), "a.y": ("import a.z\n", False),
            "a.z": ("def f():\n    from .x import g\n", False), "a.w": ("import a.x\n", False)}
    assert import_cycles(import_graph(ring)) == [["a.x", "a.y", "a.z"]]
    assert import_cycles(import_graph({k: v for k, v in ring.items() if k != "a.z"})) == []
    package = {"p": ("from .cli import main\n", True), "p.cli": ("from p import doc\n", False)}
    assert import_cycles(import_graph(package)) == [["p", "p.cli"]]  # at import: a real loop
    package["p.cli"] = ("def main():\n    from p import doc\n", False)
    assert import_cycles(import_graph(package)) == []  # the package is loaded by then


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
