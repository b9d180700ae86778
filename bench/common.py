"""Shared benchmark plumbing: environment record, timing, CSV/Markdown/PNG output.
The baselines are imported from kernels/reference.py (one baseline for tests and benchmarks)."""

from __future__ import annotations

import csv
import datetime
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """HEAD's hash (12 digits), '+dirty' if tracked files differ from it; 'unknown' if git or the
    repository is unavailable. (subprocess with list arguments, never a shell.)"""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "uncommitted (no HEAD)"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def env_info(device: str) -> dict:
    """Who/what/when of a benchmark row: device name, torch/triton versions, date, commit."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "n/a"
    if device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        gpu = "no GPU" if not torch.cuda.is_available() else "GPU unused"
        name = f"CPU ({os.cpu_count()} cores, {platform.machine()}, {gpu})"
    return dict(device=name, torch=torch.__version__, triton=triton_version,
                date=datetime.date.today().isoformat(), commit=git_commit())


def sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def time_fn(fn, device: str, *, repeats=5, warmup=1, max_seconds=60.0) -> float:
    """Median wall time of fn() in seconds (synchronised on CUDA); fewer repeats if slow."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > max_seconds:
            break
    return statistics.median(times)


def write_csv(rows: list[dict], path: Path) -> Path:
    """Append rows to a CSV (history is kept). Columns are the union of the file's and the
    rows'; the file is rewritten to a temporary name and renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = read_csv(path) if path.exists() else []
    fields = list(dict.fromkeys(k for r in old + rows for k in r))
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(old + rows)
    os.replace(tmp, path)
    return path


def read_csv(path: Path) -> list[dict]:
    """Rows of a results CSV, numbers parsed back to int/float."""
    text = {"provider", "device", "torch", "triton", "date", "commit", "extrapolated", "note"}

    def num(k, v):
        if k in text:
            return v
        for cast in (int, float):
            try:
                return cast(v)
            except (TypeError, ValueError):
                pass
        return v

    with open(path, newline="") as f:
        return [{k: num(k, v) for k, v in r.items()} for r in csv.DictReader(f)]


def markdown_table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def latest(rows: list[dict], keys=("provider", "N")) -> list[dict]:
    """The last row for each (provider, N): what a plot of an appended CSV should show."""
    last = {}
    for r in rows:
        last[tuple(r.get(k) for k in keys)] = r
    return list(last.values())


def plot(rows: list[dict], x: str, y: str, series: str, path: Path, title: str) -> Path:
    """Log-log plot of y vs x, one line per series (Agg backend: no display needed).
    Extrapolated points are drawn hollow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for s in dict.fromkeys(r[series] for r in rows):
        pts = sorted((r[x], r[y], bool(r.get("extrapolated"))) for r in rows
                     if r[series] == s and isinstance(r[y], (int, float)) and r[y] == r[y])
        if not pts:
            continue
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
        ext = [p for p in pts if p[2]]
        if ext:
            ax.plot([p[0] for p in ext], [p[1] for p in ext], "o", mfc="white",
                    color=line.get_color(), label=f"{s} (extrapolated)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def base_parser(doc: str):
    import argparse

    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 38400, 150000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"),
                   help="folder for <name>.csv (appended) and <name>.png")
    return p


def check_device(p, args):
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is visible")


def report(rows, cols, out, name, title) -> None:
    """Print the table; append the rows to OUT/<name>.csv; plot ms vs N (this run's rows) to
    OUT/<name>.png. bench/report.py re-renders a CSV later."""
    if not rows:
        print("no rows measured (every provider skipped)")
        return
    print(markdown_table(rows, cols))
    print(write_csv(rows, Path(out) / f"{name}.csv"))
    print(plot(rows, "N", "ms", "provider", Path(out) / f"{name}.png",
               f"{title}\non {rows[0]['device']}, {rows[0]['date']}"))
