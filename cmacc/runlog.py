"""What a run writes for people (rank 0): the log line, OUT/metrics.csv, TensorBoard scalars,
OUT/summary.json and the OUT/metrics.png plot. Each row is a ``StepMetrics``."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from data_dali.cli import eta
from data_dali.fileio import atomic_path, atomic_write_text

log = logging.getLogger("cmacc")
NAN = float("nan")


@dataclass
class StepMetrics:
    """One metrics.csv row: means over the steps since the previous row."""

    step: int
    epoch: int
    loss: float
    acc: float
    lr: float
    clips_per_s: float  # per rank
    unique_per_m: float = NAN  # distinct categories among the M enqueued negatives / M
    coverage: float = NAN  # distinct categories / min(M, C): 1.0 is the ceiling
    gnorm: float = NAN  # mean |g| of the enqueued negatives (NaN: the sampler does not measure it)
    active: float = 0.0  # 1 once the active sampler runs (after the pool warm-up)
    fallback: float = 0.0  # share of steps whose U \ D exclusion had to be dropped
    t_data: float = 0.0  # seconds per step waiting for data
    t_step: float = 0.0  # seconds per step computing
    t_select: float = 0.0  # seconds per step in the active selection (total)
    mfu: float = NAN  # model FLOP utilisation (NaN where the peak is unknown)
    mem_gb: float = NAN  # peak CUDA memory
    nonfinite: float = 0.0  # steps skipped so far for a NaN/Inf loss or gradient
    data_wait: float = NAN  # share of the wall time spent waiting for the next batch
    t_select_visible: float = 0.0  # of t_select, seconds the step waited (overlap hides the rest)
    bad_clips: float = 0.0  # damaged clips skipped and replaced so far (OUT/bad_clips.csv)
    # of t_step, seconds per step re-encoding the pools (--pool-refresh; 0: none). Last, so a
    # metrics.csv of an older version only gains a column (_upgrade_header) when it resumes
    t_refresh: float = 0.0
    # seconds one step's selections take alone on the device (model.time_selection_alone, once
    # a row, where they overlap the key encoders; in line it is t_select): the SM time they
    # take from a step. Last, as t_refresh
    t_select_alone: float = 0.0


FIELDS = [f.name for f in dataclasses.fields(StepMetrics)]


class CSVLog:
    """Append-only CSV with a fixed header; each row is fsynced as it is written (nothing
    finished is lost), and a row that cannot be written whole (a full disk) is cut back off:
    the file always ends with a complete row."""

    def __init__(self, path, fields: list[str]):
        self.path, self.fields = Path(path), fields
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists() or self.path.stat().st_size == 0
        if not new:
            _upgrade_header(self.path, fields)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if new:
            self._append(dict(zip(fields, fields)))

    def write(self, row: dict) -> None:
        self._append({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})

    def _append(self, row: dict) -> None:
        buf = io.StringIO()
        csv.DictWriter(buf, fieldnames=self.fields, extrasaction="ignore").writerow(row)
        data, size = buf.getvalue().encode(), os.fstat(self.fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
            os.fsync(self.fd)
        except BaseException:
            os.ftruncate(self.fd, size)  # no half row
            raise

    def close(self):
        os.close(self.fd)


def _upgrade_header(path, fields) -> None:
    """A CSV written by a version with other columns (a resumed run) is rewritten, atomically,
    under ``fields``: its rows keep their values, columns it lacks are left empty."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames == fields:
            return
        rows = list(reader)
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def truncate_rows(path, keep) -> int:
    """Rewrite a metrics CSV (atomically) with only the rows ``keep(row)`` accepts; returns how
    many were dropped. Resuming drops the rows past the checkpoint this way."""
    path = Path(path)
    if not path.is_file():
        return 0
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        fields, rows = reader.fieldnames or FIELDS, list(reader)
    kept = [r for r in rows if keep(r)]
    if len(kept) < len(rows):
        with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(kept)
    return len(rows) - len(kept)


class MetricsWriteError(Exception):
    """A metrics row could not be written (``what``; the cause: a full disk, say)."""

    def __init__(self, what: str):
        super().__init__(f"cannot write {what}")
        self.what = what


class RunLogger:
    """Rank-0 metrics: a log line, a CSV row, TensorBoard scalars (optional). On other ranks
    every method does nothing. ``purge_step``: TensorBoard events from that step on (written
    before a resume) are discarded."""

    def __init__(self, out, enabled: bool, tensorboard: bool, purge_step: int | None = None,
                 total: int | None = None, start_step: int = 0):
        self.enabled, self.tb = enabled, None
        # the log line's "step s/total (pct%)" and ETA, at the rate since start_step
        self.total, self.start_step, self.t0 = total, start_step, time.perf_counter()
        self.counters = {}  # field → a callable read at each row (running totals of the run)
        self.csv = CSVLog(Path(out) / "metrics.csv", FIELDS) if enabled else None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(out) / "tb"), purge_step=purge_step)
            except Exception as e:  # tensorboard is optional
                log.warning("TensorBoard disabled (%s); pip install tensorboard", e)

    def write(self, m: StepMetrics) -> None:
        """One row; MetricsWriteError (its cause: the library's exception) if it cannot be."""
        if not self.enabled:
            return
        row = dict(dataclasses.asdict(m), **{k: f() for k, f in self.counters.items()})
        try:
            self.csv.write(row)
        except Exception as e:
            raise MetricsWriteError("metrics.csv") from e
        if self.tb is not None:
            try:
                for k, v in row.items():
                    if k != "step" and isinstance(v, float) and math.isfinite(v):
                        self.tb.add_scalar(k, v, m.step)
            except Exception as e:
                raise MetricsWriteError("the TensorBoard events (OUT/tb)") from e
        where = f"{m.step:6d}"
        if self.total:
            left = eta(self.total - m.step, m.step - self.start_step, time.perf_counter() - self.t0)
            where += f"/{self.total} ({100 * m.step / self.total:.0f}%, eta {left})"
        log.info("step %s | loss %.4f | acc %.3f | uniq/M %.3f cov %.3f | gnorm %.3g | lr %.2e | "
                 "%.1f clips/s/rank | data %.1f ms (%.0f%% of the time waiting), step %.1f ms "
                 "(of it refresh %.1f ms), select %.2f ms (%.2f visible, %.2f alone) | mfu %s", where,
                 m.loss,
                 m.acc, m.unique_per_m, m.coverage, m.gnorm, m.lr,
                 m.clips_per_s, 1e3 * m.t_data, 100 * m.data_wait, 1e3 * m.t_step,
                 1e3 * m.t_refresh, 1e3 * m.t_select, 1e3 * m.t_select_visible,
                 1e3 * m.t_select_alone,
                 f"{m.mfu:.3g}" if math.isfinite(m.mfu) else "n/a")

    def close(self):
        if self.csv is not None:
            self.csv.close()
        if self.tb is not None:
            self.tb.close()


def summarise(out, method: str, **extra) -> dict:
    """OUT/summary.json (each metric's mean over the first and the last quarter of the rows of
    OUT/metrics.csv that have a value of it: a row that did not measure it, empty or NaN, is
    skipped; NaN if none has; and ``extra``) and OUT/metrics.png. Read from the CSV, so a
    resumed run summarises its whole history."""
    out = Path(out)
    path = out / "metrics.csv"
    rows = [{k: float(v) if v not in ("", None) else NAN for k, v in r.items()}
            for r in (read_csv(path) if path.is_file() else [])]
    if not rows:
        return {}

    def mean(k, which):
        vals = [r[k] for r in rows if not math.isnan(r.get(k, NAN))]
        w = max(1, len(vals) // 4)
        part = {"first": vals[:w], "last": vals[-w:], "all": vals}[which]
        return sum(part) / len(part) if part else NAN

    summary = dict(method=method, steps=int(rows[-1]["step"]),
                   loss_first=mean("loss", "first"), loss_last=mean("loss", "last"),
                   acc_first=mean("acc", "first"), acc_last=mean("acc", "last"),
                   unique_per_m_last=mean("unique_per_m", "last"),
                   coverage_last=mean("coverage", "last"),
                   clips_per_s=mean("clips_per_s", "last"),
                   data_wait_share=mean("data_wait", "all"),  # of the wall time, whole run
                   out=str(out.resolve()), **extra)  # absolute: read from anywhere
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    try:
        plot_metrics({method: str(path)}, out / "metrics.png")
    except Exception as e:  # a plot must never cost the run
        log.warning("could not write metrics.png: %s", e)
    return summary


def plot_metrics(csv_paths: dict[str, str], out_png,
                 keys=("loss", "acc", "unique_per_m", "coverage", "gnorm")) -> Path:
    """One panel per metric, one line per run (label → metrics.csv); a value a run did not
    measure (empty or NaN) is a gap, not a zero. Returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.4), squeeze=False)
    axes = axes[0]
    for ax, key in zip(axes, keys):
        for label, path in csv_paths.items():
            rows = read_csv(path)
            vals = [float(r[key]) if r.get(key) not in (None, "") else NAN for r in rows]
            if any(math.isfinite(v) for v in vals):  # NaN breaks the line: a gap
                ax.plot([int(r["step"]) for r in rows], vals, label=label, **point_marks(vals))
            else:
                ax.plot([], [], linestyle="none", label=f"{label}: not measured")
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    for i, ax in enumerate(axes):  # the runs on the first panel; elsewhere what was not measured
        names = ax.get_legend_handles_labels()[1]
        if names and (i == 0 or any(n.endswith("not measured") for n in names)):
            ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, out_png)


def point_marks(values) -> dict:
    """matplotlib line options that show a value with no finite neighbour (a run of one logged
    row, a value between gaps), which a line alone would not draw: a marker."""
    ok = [math.isfinite(v) for v in values]
    alone = any(f and not (i and ok[i - 1]) and not (i + 1 < len(ok) and ok[i + 1])
                for i, f in enumerate(ok))
    return dict(marker="o", markersize=3) if alone else {}


def save_figure(fig, png, dpi=110) -> Path:
    """Write a matplotlib figure to a PNG atomically and close it."""
    import matplotlib.pyplot as plt

    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(png) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")
    plt.close(fig)
    return png
