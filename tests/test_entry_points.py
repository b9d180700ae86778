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
