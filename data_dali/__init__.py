"""CM-ACC's data package: prepare datasets, load them in batches, make synthetic clips.

Dataset preparation (``python -m data_dali.prepare``), DALI pipelines (GPU decode +
augmentation; CPU operators without a GPU), a PyAV reference loader, synthetic audio-visual
clips (``python -m data_dali.synthetic``) and the atomic writes every writer uses (fileio).

    loader = data_dali.build_loader("DATA/manifest.csv", batch_size=32)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:  # batch["video"] [B,3,T,S,S], ["audio"] [B,80,L], ["index"], ["label"]
            ...

``import data_dali`` is cheap: torch, DALI, PyAV and librosa load when first needed (the
prepare workers never import torch).
"""

from __future__ import annotations

from importlib import import_module

_LAZY = {
    "build_loader": "loader", "Loader": "loader", "EvalSplits": "loader",
    "read_manifest": "loader", "manifest_info": "loader", "Manifest": "manifest",
    "ManifestError": "manifest",
}
__all__ = sorted(_LAZY)


def __getattr__(name):  # PEP 562: import the submodule on first use
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'data_dali' has no attribute {name!r}")
