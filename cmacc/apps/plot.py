"""Render training curves of one or more runs to a PNG.

    python -m cmacc.apps.plot runs/xmoco runs/cmacc --out curves.png [--keys loss acc coverage]
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from cmacc.runlog import plot_metrics
from data_dali.cli import ArgumentParser, UserError, command

from . import output_file


def metrics_columns(run) -> tuple[Path, list[str]]:
    """The metrics.csv of a run folder (or the file itself) and its columns; a UserError when
    there is none or it is not one train.py wrote."""
    path = Path(run) / "metrics.csv" if Path(run).is_dir() else Path(run)
    if not path.is_file():
        where = "in this folder" if Path(run).is_dir() else "there"
        raise UserError(f"{run}: no metrics.csv {where}; pass a run folder written by train.py "
                        "or its metrics.csv")
    try:
        with open(path, newline="") as f:
            columns = next(csv.reader(f), [])
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"{path}: cannot read it as a CSV ({e}); pass a metrics.csv written by "
                        "train.py") from None
    if "step" not in columns:
        raise UserError(f"{path}: not a metrics.csv written by train.py (no 'step' column); pass "
                        "a run folder written by train.py")
    return path, columns


def run_labels(folders) -> list[str]:
    """A legend label per run: the fewest trailing path parts that tell the runs apart, the
    same number for every run (runs/a/seed0, runs/b/seed0 → a/seed0, b/seed0)."""
    parts = [Path(f).resolve().parts for f in folders]
    for k in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-k:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(Path(f)) for f in folders]  # the same folder twice: as given


@command
def main(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument("runs", nargs="+", help="run folders (each with metrics.csv) or metrics.csv files")
    p.add_argument("--out", default="curves.png", help="the PNG to write (default: curves.png)")
    p.add_argument("--keys", nargs="+", default=["loss", "acc", "unique_per_m", "coverage", "gnorm"],
                   help="metrics.csv columns, one panel each (default: loss acc unique_per_m "
                        "coverage gnorm)")
    args = p.parse_args(argv)
    found, columns = [], set()
    for r in args.runs:
        path, cols = metrics_columns(r)
        found.append(path)
        columns.update(cols)
    paths = dict(zip(run_labels([f.parent for f in found]), map(str, found)))
    missing = [k for k in args.keys if k not in columns]
    if missing:
        have = ", ".join(sorted(columns - {"step"}))
        raise UserError(f"--keys {' '.join(missing)}: no such column in "
                        f"{', '.join(paths.values())}; columns: {have}")
    out = output_file(args.out)
    print(plot_metrics(paths, out, keys=tuple(args.keys)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
