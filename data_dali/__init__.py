"""Data for CM-ACC: dataset preparation (``python -m data_dali.prepare``), DALI pipelines
(GPU decode + augmentation; CPU operators without a GPU), a PyAV reference loader, and
synthetic audio-visual clips. ``import data_dali`` is cheap: DALI and PyAV load lazily.

    loader = data_dali.build_loader("DATA/manifest.csv", batch_size=32)
    for batch in loader:   # one epoch; batch["video"] [B,3,T,S,S], ["audio"] [B,80,L], ["index"], ["label"]
        ...
"""

from __future__ import annotations

from .loader import EvalSplits, Loader, build_loader, manifest_info, read_manifest

__all__ = ["build_loader", "Loader", "EvalSplits", "read_manifest", "manifest_info"]
