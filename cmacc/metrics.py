"""Metrics: negative-category diversity, a CSV metrics log, and a PNG plot of it."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import torch


def category_diversity(index: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Fraction of the categories covered by the clips with these dataset indices (entries
    with index < 0, i.e. no clip, are ignored). The paper's Figure 3 metric."""
    index = index.to(labels.device)
    valid = (index >= 0).float()  # no boolean indexing: no host sync in the training step
    lab = labels[index.clamp_min(0)]
    present = torch.zeros(num_classes, device=labels.device).scatter_reduce(
        0, lab, valid, reduce="amax")
    return present.mean()


class CSVLog:
    """Append-only CSV with a fixed header; flushed after every row (nothing finished is lost)."""

    def __init__(self, path, fields: list[str]):
        self.path, self.fields = Path(path), fields
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists() or self.path.stat().st_size == 0
        self.f = open(self.path, "a", newline="")
        self.w = csv.DictWriter(self.f, fieldnames=fields, extrasaction="ignore")
        if new:
            self.w.writeheader()

    def write(self, row: dict) -> None:
        self.w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self):
        self.f.close()


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def plot_metrics(csv_paths: dict[str, str], out_png, keys=("loss", "acc", "diversity", "gnorm")) -> Path:
    """One panel per metric, one line per run (label → metrics.csv). Returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.4))
    for ax, key in zip(axes, keys):
        for label, path in csv_paths.items():
            rows = [r for r in read_csv(path) if r.get(key) not in (None, "", "nan")]
            if rows:
                ax.plot([int(r["step"]) for r in rows], [float(r[key]) for r in rows], label=label)
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
