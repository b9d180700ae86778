"""Render training curves of one or more runs to a PNG.

    python -m cmacc.apps.plot runs/xmoco runs/cmacc --out curves.png [--keys loss acc diversity]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cmacc.runlog import plot_metrics


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders (each with metrics.csv) or metrics.csv files")
    p.add_argument("--out", default="curves.png")
    p.add_argument("--keys", nargs="+", default=["loss", "acc", "diversity", "gnorm"],
                   help="metrics.csv columns, one panel each")
    args = p.parse_args(argv)
    paths = {}
    for r in args.runs:
        path = Path(r) / "metrics.csv" if Path(r).is_dir() else Path(r)
        if not path.is_file():
            p.error(f"{r}: no metrics.csv there; pass a run folder written by train.py")
        paths[path.parent.name or str(path)] = str(path)
    print(plot_metrics(paths, args.out, keys=tuple(args.keys)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
