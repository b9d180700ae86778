"""Every command has an installed entry point (make install) that answers --help."""

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

COMMANDS = {"cmacc-train", "cmacc-prepare", "cmacc-eval", "cmacc-export", "cmacc-mi",
            "cmacc-analysis", "cmacc-plot"}


def test_the_package_declares_every_command():
    declared = {ep.name for ep in metadata.entry_points(group="console_scripts")
                if ep.value.split(":")[0].split(".")[0] in ("train", "cmacc", "data_dali")}
    assert declared == COMMANDS


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_installed_command_answers_help(name):
    script = Path(sys.executable).parent / name
    if not script.exists():
        pytest.skip(f"{name} is not installed in this environment (make install installs it)")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage: "), out.stdout[:300]
