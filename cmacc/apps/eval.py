"""Downstream evaluation of a pretrained checkpoint: linear probe on frozen features and
end-to-end fine-tuning, for the video or the audio encoder.

    python -m cmacc.apps.eval runs/cmacc --data synthetic --modality video --protocol linear
    python -m cmacc.apps.eval runs/cmacc/ckpt_00001000.pt --data UCF101/manifest.csv \\
        --modality video --protocol finetune --splits 1 2 3 --out runs/cmacc/eval

Results (mean top-1 over splits/folds and per split) go to OUT/eval_<modality>_<protocol>.json
and a Markdown table beside it. ``--data synthetic`` evaluates on the built-in clips the run
was pretrained on (held-out instances); a manifest comes from ``python -m data_dali.prepare``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from cmacc import checkpoint as ckpt
from cmacc.config import Config
from cmacc.data import eval_splits
from cmacc.model import CMACC
from cmacc.probe import extract_features, finetune, linear_probe
from data_dali.fileio import atomic_write_text

log = logging.getLogger("cmacc.eval")


def load_pretrained(path) -> tuple[CMACC, dict]:
    """The CMACC model of a checkpoint file or run folder (newest valid checkpoint), and the
    checkpoint with its typed config under "cfg"."""
    p = Path(path)
    if p.is_dir():
        found = ckpt.find_latest_valid(p)
        if found is None:
            raise FileNotFoundError(f"{p}: no readable checkpoint (ckpt_*.pt) in this folder")
        p, state = found
    else:
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no such checkpoint file")
        state = ckpt.load(p)
    if not isinstance(state, dict) or "config" not in state or "model" not in state:
        raise KeyError(f"{p} is not a checkpoint written by train.py (no config/model)")
    state["cfg"] = cfg = Config.from_dict(state["config"])
    model = CMACC(cfg.model, cfg.selection)
    model.load_state_dict(state["model"])
    return model, state


def evaluate(model, state, data, *, modality, protocol, splits=None, device="cpu", clips=1,
             epochs=10, lr=1e-3, batch_size=64, frames=None):
    """Top-1 per split and mean. ``frames``: clip length for prepared datasets (default: the
    pretraining clip length; the paper fine-tunes on 32-frame clips: --frames 32)."""
    enc = model.f_v if modality == "video" else model.f_a
    key = "video" if modality == "video" else "audio"
    cfg = state["cfg"]
    if frames is None and protocol == "finetune" and modality == "video" and data != "synthetic":
        frames = 32  # the paper fine-tunes on 32-frame clips
    ds = eval_splits(data, cfg.data, cfg.model.seed, modality=modality, frames=frames)
    results = []
    for name, tr, te in ds.splits(splits):
        backbone = _fresh_copy(enc.backbone).to(device)
        if protocol == "linear":
            xtr, ytr, _ = extract_features(backbone, ds.batches(tr, batch_size), key, device, 1)
            xte, yte, _ = extract_features(backbone, ds.batches(te, batch_size), key, device, clips)
            res = linear_probe(xtr, ytr, xte, yte, num_classes=ds.num_classes)
        else:
            res = finetune(backbone, enc.backbone.out_dim, ds.num_classes,
                           ds.batches(tr, batch_size, shuffle_seed=1), ds.batches(te, batch_size),
                           key, device, epochs=epochs, lr=lr, clips=clips)
        res["split"] = name
        log.info("%s %s %s: top-1 %.4f", modality, protocol, name, res["top1"])
        results.append(res)
    mean = sum(r["top1"] for r in results) / len(results)
    return {"modality": modality, "protocol": protocol, "top1_mean": mean, "splits": results}


def _fresh_copy(module):
    import copy

    m = copy.deepcopy(module)
    for p in m.parameters():
        p.requires_grad_(True)
    return m


def write_results(res: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"eval_{res['modality']}_{res['protocol']}"
    js, md = out / f"{stem}.json", out / f"{stem}.md"
    lines = [f"| {res['modality']} {res['protocol']} | top-1 |", "|---|---|"]
    lines += [f"| {r['split']} | {100 * r['top1']:.1f} |" for r in res["splits"]]
    lines.append(f"| **mean** | **{100 * res['top1_mean']:.1f}** |")
    atomic_write_text(js, json.dumps(res, indent=2))
    atomic_write_text(md, "\n".join(lines) + "\n")
    return js, md


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a ckpt_*.pt file or a run folder (newest valid checkpoint)")
    p.add_argument("--data", default="synthetic", help="'synthetic' or a prepared manifest")
    p.add_argument("--modality", choices=("video", "audio"), default="video")
    p.add_argument("--protocol", choices=("linear", "finetune"), default="linear")
    p.add_argument("--splits", nargs="*", help="official splits / folds to run (default: all)")
    p.add_argument("--clips", type=int, default=1, help="test clips per video (averaged)")
    p.add_argument("--epochs", type=int, default=10, help="fine-tuning epochs")
    p.add_argument("--lr", type=float, default=1e-3, help="fine-tuning learning rate")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--frames", type=int, default=None,
                   help="clip length on prepared data (default: the pretraining length for linear probes, "
                        "32 for video fine-tuning as in the paper)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--out", default=None, help="results folder (default: <run>/eval)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    try:
        model, state = load_pretrained(args.checkpoint)
    except (FileNotFoundError, KeyError, RuntimeError) as e:
        p.error(f"cannot load {args.checkpoint}: {e}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    res = evaluate(model, state, args.data, modality=args.modality, protocol=args.protocol,
                   splits=args.splits, device=device, clips=args.clips, epochs=args.epochs,
                   lr=args.lr, batch_size=args.batch_size, frames=args.frames)
    run = Path(args.checkpoint)
    out = Path(args.out) if args.out else (run if run.is_dir() else run.parent) / "eval"
    js, md = write_results(res, out)
    print(md.read_text())
    print(f"results: {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
