"""Render benchmark CSVs (bench/results/*.csv) to PNG plots and Markdown tables.

The CSVs are written by bench_*.py. Each keeps every run; by default only the latest row per
(provider, N) on the device of the newest row is shown (--device picks another).

    python bench/report.py                                    # every CSV in bench/results
    python bench/report.py bench/results/selection.csv --device H100 --y ms
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ROOT, latest, markdown_table, plot, read_csv  # noqa: E402

COLUMNS = ["provider", "N", "ms", "gbps", "tflops", "materialised_over_this", "factored_over_this",
           "extrapolated", "device", "torch", "triton", "date", "commit"]


def render(csv_path: Path, y: str = "ms", device: str | None = None, out: Path | None = None,
           all_rows: bool = False) -> Path | None:
    rows = read_csv(csv_path)
    if device:
        rows = [r for r in rows if device.lower() in str(r.get("device", "")).lower()]
    elif rows:  # default: the device of the newest row (never mix CPU and GPU figures)
        rows = [r for r in rows if r.get("device") == rows[-1].get("device")]
    if not rows or "N" not in rows[0] or y not in rows[0]:
        print(f"{csv_path}: no rows with N and {y} (device filter: {device!r}); nothing drawn")
        return None
    shown = rows if all_rows else latest(rows, ("provider", "N"))
    print(f"## {csv_path.name}\n")
    print(markdown_table(shown, [c for c in COLUMNS if c in shown[0]]) + "\n")
    devices = ", ".join(dict.fromkeys(str(r["device"]) for r in shown))
    png = out or csv_path.with_suffix(".png")
    return plot(shown, "N", y, "provider", png, f"{csv_path.stem} on {devices}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", nargs="*", type=Path,
                   help="default: every bench/results/*.csv with an N column")
    p.add_argument("--y", default="ms", help="column to plot against N (ms, gbps, ...)")
    p.add_argument("--device", help="only rows whose device name contains this")
    p.add_argument("--all-rows", action="store_true", help="every run, not the latest per N")
    args = p.parse_args(argv)
    paths = args.csv or sorted((ROOT / "bench" / "results").glob("*.csv"))
    for path in paths:
        if not path.exists():
            p.error(f"{path}: no such file; run bench/bench_kmeanspp.py or bench_grad_embed.py")
        png = render(path, args.y, args.device, all_rows=args.all_rows)
        if png:
            print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
