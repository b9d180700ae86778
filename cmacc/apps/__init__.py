"""The applications built on the CM-ACC library, each a command:

    python -m cmacc.apps.demo       the CPU demo (make demo): prepare, pretrain, probe, compare
    python -m cmacc.apps.eval       linear probe / fine-tuning of a pretrained checkpoint
    python -m cmacc.apps.analysis   the paper's analyses (diversity, dictionary size, gallery, ...)
    python -m cmacc.apps.mi         the Spatial-MultiOmniglot mutual-information study
    python -m cmacc.apps.plot       training curves of runs to a PNG

Apps import the library (cmacc.*, kernels, data_dali); the library never imports an app.
Each ``main(argv)`` is a ``data_dali.cli.command``: a user's mistake is one line on stderr and
exit 2 (``--debug`` keeps the traceback), checked before the first minute of work; parsers are
``data_dali.cli.ArgumentParser`` (``--help`` lists ``--debug``); output folders go through
``data_dali.cli.output_folder``.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from data_dali.cli import UserError, output_folder
from data_dali.manifest import sha256_file  # noqa: F401 - the apps' one SHA-256 helper


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (anything else is the parser's one-line error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def output_file(path, flag: str = "--out") -> Path:
    """``path`` as an output file (overwritten if it exists) in a folder that takes files."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{flag} {path}: is a folder; pass a file path, e.g. {p / 'curves.png'}")
    output_folder(p.parent, flag)
    return p


ROOT = Path(__file__).resolve().parents[2]


def git_commit() -> str | None:
    """The git commit of the code that runs (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None
