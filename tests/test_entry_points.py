"""The commands declared in the package metadata (setup.py console_scripts) exist, run
``--help`` and name themselves there; README lists every one of them."""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def console_scripts() -> dict[str, str]:
    """name → "module:function", read from setup.py's entry_points without running it."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "entry_points":
            scripts = ast.literal_eval(node.value)["console_scripts"]
            return dict(s.replace(" ", "").split("=", 1) for s in scripts)
    raise AssertionError("setup.py declares no entry_points")


def test_every_command_of_the_issue_is_declared():
    assert {"cmacc-train", "cmacc-prepare", "cmacc-eval", "cmacc-export", "cmacc-mi",
            "cmacc-analysis", "cmacc-manifest"} <= set(console_scripts())


@pytest.mark.parametrize("name,target", sorted(console_scripts().items()))
def test_each_command_runs_help_and_names_itself(name, target, capsys):
    module, func = target.split(":")
    main = getattr(importlib.import_module(module), func)
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert name in capsys.readouterr().out
    assert f"`{name}`" in (ROOT / "README.md").read_text()


def test_a_plain_install_carries_every_package(tmp_path):
    """A non-editable `pip install .` ships every package folder of the project, subpackages
    (cmacc.apps, data_dali.prepare) included: the wheel built from setup.py holds each
    __init__.py found on disk."""
    import os
    import shutil
    import subprocess
    import sys
    import zipfile

    src = tmp_path / "src"  # a copy: building writes build/ beside setup.py
    src.mkdir()
    for name in ("setup.py", "README.md", "train.py"):
        shutil.copy(ROOT / name, src / name)
    for name in ("cmacc", "kernels", "data_dali"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(src)], check=True, cwd=tmp_path,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    (wheel,) = tmp_path.glob("*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    on_disk = {p.relative_to(ROOT).as_posix() for top in ("cmacc", "kernels", "data_dali")
               for p in (ROOT / top).rglob("__init__.py")}
    assert "data_dali/prepare/__init__.py" in on_disk and "cmacc/apps/__init__.py" in on_disk
    assert on_disk <= shipped, sorted(on_disk - shipped)
