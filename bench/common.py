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


def env_info(device: str) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = "n/a"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        commit = (commit or "unknown") + ("+dirty" if dirty else "")
    except Exception:
        commit = "unknown"
    if device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"
    return dict(device=name, torch=torch.__version__, triton=triton_version,
                date=datetime.date.today().isoformat(), commit=commit)


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
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    fields = list(rows[0].keys())
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows(rows)
    return path


def markdown_table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def plot(rows: list[dict], x: str, y: str, series: str, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for s in dict.fromkeys(r[series] for r in rows):
        pts = sorted((r[x], r[y]) for r in rows if r[series] == s and r[y] == r[y])
        if pts:
            ax.plot(*zip(*pts), marker="o", label=s)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def base_parser(doc: str):
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 38400, 150000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/results")
    return p


def check_device(p, args):
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is visible")


def report(rows, cols, out, name, title) -> None:
    """Print the table; append the rows to OUT/<name>.csv; plot ms vs N to OUT/<name>.png."""
    print(markdown_table(rows, cols))
    print(write_csv(rows, Path(out) / f"{name}.csv"))
    print(plot(rows, "N", "ms", "provider", Path(out) / f"{name}.png", f"{title} on {rows[0]['device']}"))
