"""Shared benchmark plumbing: environment record, timing, sweeps, CSV/Markdown/PNG output.

Timing uses the standard tools: ``triton.testing.do_bench`` (median) for CUDA providers,
``torch.utils.benchmark.Timer(...).blocked_autorange()`` (median) for CPU providers; a sweep is
declared as a ``triton.testing.perf_report`` / ``Benchmark`` with a ``provider`` axis. The
baselines are imported from kernels/reference.py (one baseline for tests and benchmarks).
"""

from __future__ import annotations

import csv
import datetime
import hashlib
import math
import os
import platform
import subprocess
from pathlib import Path

import torch

from cmacc.runlog import save_figure
from data_dali.fileio import atomic_path

ROOT = Path(__file__).resolve().parents[1]


COMMIT_ENV = "CMACC_COMMIT"  # the commit a copy of the tree came from, said by its sender
SOURCE_DIRS = ("cmacc", "kernels", "bench", "data_dali")


def git_commit() -> str:
    """HEAD's hash (12 digits), '+dirty' if tracked files differ from it; $CMACC_COMMIT where
    set (a copy of the tree on another machine, whose git metadata may be stale or absent:
    the sender names the commit, and ``source_sha256`` lets a reader check it); 'not a git
    checkout' or 'unknown' (no git) otherwise. (subprocess with list arguments, no shell.)"""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV] + " (said by $" + COMMIT_ENV + ")"
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "not a git checkout"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def source_sha256(root: Path = ROOT) -> str:
    """SHA-256 over the code that runs (every .py file under cmacc/, kernels/, bench/,
    data_dali/, and train.py: each file's relative path and bytes, in sorted order), so a
    figure taken on a copy of the tree can be matched to a commit: run this on its checkout."""
    h = hashlib.sha256()
    files = sorted(p for d in SOURCE_DIRS for p in (root / d).rglob("*.py")) + [root / "train.py"]
    for p in files:
        if p.is_file():
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


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
        isa = torch.backends.cpu.get_cpu_capability()  # the ISA torch's kernels dispatch to
        name = f"CPU ({os.cpu_count()} cores, {platform.machine()}, {isa}, {gpu})"
    return dict(device=name, torch=torch.__version__, triton=triton_version,
                date=datetime.date.today().isoformat(), commit=git_commit())


def median_ms(fn, device: str, *, min_run_time: float = 1.0, rep_ms: int = 100) -> float:
    """Median time of one fn() call in milliseconds. CUDA: ``triton.testing.do_bench`` (its
    warm-up, L2 flush before each run, CUDA events; as many runs as fit in ``rep_ms``, at
    least one: a 100 ms fn needs a larger ``rep_ms`` for a median of several). CPU:
    ``torch.utils.benchmark.Timer``'s ``blocked_autorange`` on all of torch's threads (the first call sizes the blocks and warms
    up; blocks run until ``min_run_time`` seconds are spent, so a slow fn runs twice)."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, rep=rep_ms, return_mode="median")
    from torch.utils.benchmark import Timer

    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def benchmark(sizes, providers, plot_name: str, **args):
    """A ``triton.testing.perf_report`` decorator for a sweep over N with a ``provider`` axis;
    ``args`` are the fixed shape arguments. The decorated fn(N, provider, **args) returns the
    median ms of that point, or NaN for a point it does not run."""
    from triton.testing import Benchmark, perf_report

    return perf_report(Benchmark(x_names=["N"], x_vals=list(sizes), line_arg="provider",
                                 line_vals=list(providers), line_names=list(providers),
                                 plot_name=plot_name, args=args, xlabel="N", ylabel="ms",
                                 x_log=True, y_log=True))


def sweep(mark, info: dict) -> list[dict]:
    """Every point of a perf_report ``mark`` in ``Mark.run``'s order (each N, then each
    provider), as rows {provider, N, <args>, ms, <info>}; NaN ms where a point was not run.
    (``Mark.run`` itself needs pandas, and rewrites a CSV without the environment columns.)"""
    bench, rows = mark.benchmarks, []
    for n in bench.x_vals:
        for provider in bench.line_vals:
            ms = mark.fn(N=n, **{bench.line_arg: provider}, **bench.args)
            rows.append(dict(provider=provider, N=n, **bench.args, ms=ms, **info))
            if not math.isnan(ms):
                print(f"{provider:>12} N={n:>7}: {ms:11.3f} ms", flush=True)
    return rows


def interpreter_skips(provider, n, sizes, device) -> bool:
    """True (and says so) for a triton point on CPU above the smallest size: the interpreter is
    slow and its timings are not performance figures."""
    if provider == "triton" and device == "cpu" and n != min(sizes):
        print(f"skip triton at N={n}: the interpreter only runs the smallest size")
        return True
    return False


def finish(rows, device, over=("factored",)) -> list[dict]:
    """Drop the points that were not run, mark interpreter rows, add the ratios
    '<p>_over_this' = time of provider p / this row's time at the same N."""
    rows = [r for r in rows if not math.isnan(r["ms"])]
    for r in rows:
        r["note"] = "interpreter: not a performance figure" if (
            r["provider"] == "triton" and device == "cpu") else ""
        at = {q["provider"]: q["ms"] for q in rows if q["N"] == r["N"]}
        for p in over:
            r[f"{p}_over_this"] = at.get(p, float("nan")) / r["ms"]
    return rows


def write_csv(rows: list[dict], path: Path) -> Path:
    """Append rows to a CSV (history is kept). Columns are the union of the file's and the
    rows'; the file is rewritten to a temporary name and renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = read_csv(path) if path.exists() else []
    fields = list(dict.fromkeys(k for r in old + rows for k in r))
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(old + rows)
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
    return save_figure(fig, path)


def base_parser(doc: str):
    import argparse

    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 38400, 150000])
    p.add_argument("--min-run-time", type=float, default=1.0,
                   help="CPU: seconds of timed calls per point after the first (torch.utils."
                        "benchmark blocked_autorange); CUDA uses triton.testing.do_bench")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"),
                   help="folder for <name>.csv (appended) and <name>.png")
    return p


def check_device(p, args):
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is visible")


def report(rows, cols, out, name, title) -> None:
    """Print the table; append the rows to OUT/<name>.csv; plot ms vs N (this run's rows) to
    OUT/<name>.png. Rows with a note (interpreter timings) are printed, never written or
    plotted. bench/report.py re-renders a CSV later."""
    if rows:
        print(markdown_table(rows, cols))
    rows = [r for r in rows if not r.get("note")]
    if not rows:
        print("no rows to write (every provider skipped, or only interpreter timings)")
        return
    print(write_csv(rows, Path(out) / f"{name}.csv"))
    print(plot(rows, "N", "ms", "provider", Path(out) / f"{name}.png",
               f"{title}\non {rows[0]['device']}, {rows[0]['date']}"))
