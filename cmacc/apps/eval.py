"""Downstream evaluation of a pretrained checkpoint: linear probe on frozen features and
end-to-end fine-tuning, for the video or the audio encoder. Installed as the command
``cmacc-eval`` (= ``python -m cmacc.apps.eval``).

    python -m cmacc.apps.eval runs/cmacc --data synthetic --modality video --protocol linear
    python -m cmacc.apps.eval runs/cmacc/ckpt_00001000.pt --data UCF101/manifest.csv \\
        --modality video --protocol finetune --splits 1 2 3 --out runs/cmacc/eval

Results (mean top-1 over splits/folds and per split) go to OUT/eval_<modality>_<protocol>.json
and a Markdown table beside it. ``--data synthetic`` evaluates on the built-in clips the run
was pretrained on (held-out instances); a manifest comes from ``python -m data_dali.prepare``.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import torch

from cmacc import checkpoint as ckpt
from cmacc.config import Config
from cmacc.data import eval_splits
from cmacc.model import CMACC
from cmacc.probe import extract_features, finetune, linear_probe
from data_dali.cli import (ArgumentParser, UserError, command, first_line, output_folder,
                           setup_logging)
from data_dali.fileio import atomic_write_text

from . import positive_int

log = logging.getLogger("cmacc.eval")
_FIX = "pass a ckpt_*.pt file written by train.py, or its run folder"


class CheckpointError(UserError):
    """A path that is not a usable train.py checkpoint or run folder; the message says why."""


def load_pretrained(path) -> tuple[CMACC, dict]:
    """The CMACC model of a checkpoint file or run folder (newest valid checkpoint), and the
    checkpoint with its typed config under "cfg" and its path under "file"."""
    p = Path(path)
    if p.is_dir():
        found = ckpt.find_latest_valid(p)
        if found is None:
            raise CheckpointError(f"{p}: no readable checkpoint (ckpt_*.pt) in this folder; {_FIX}")
        p, state = found
    elif not p.is_file():
        raise CheckpointError(f"{p}: no such checkpoint file or run folder; {_FIX}")
    else:
        try:
            state = ckpt.load(p)
        except Exception as e:  # noqa: BLE001 - corrupt or foreign bytes: torch's weights-only
            # unpickler raises UnpicklingError, EOFError, RuntimeError, but also IndexError etc.
            raise CheckpointError(f"{p}: not a checkpoint file ({ckpt.why_unloadable(e)}); "
                                  f"{_FIX}") from None
    if not isinstance(state, dict) or "config" not in state or "model" not in state:
        raise CheckpointError(f"{p}: a torch file, but not a checkpoint written by train.py (no "
                              f"config/model); {_FIX}")
    try:
        state["cfg"] = cfg = Config.from_dict(state["config"])
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{p}: its config does not fit this version of cmacc ({e}); "
                              "re-train it with train.py") from None
    model = CMACC(cfg.model, cfg.selection)
    try:
        model.load_state_dict(state["model"])
    except (RuntimeError, TypeError) as e:
        raise CheckpointError(f"{p}: its weights do not match its own config "
                              f"({first_line(e, 160)}); {_FIX}") from None
    state["file"] = p
    return model, state


def eval_data(cfg: Config, data, *, modality, protocol="linear", splits=None, frames=None):
    """The evaluation data of a run pretrained with ``cfg``, and its (name, train, test) splits
    to run. Cheap (no clip is decoded), so the apps call it before any long work: a UserError
    naming --data / --splits when the data cannot serve the protocol."""
    if frames is None and protocol == "finetune" and modality == "video" and data != "synthetic":
        frames = 32  # the paper fine-tunes on 32-frame clips
    try:
        ds = eval_splits(data, cfg.data, cfg.model.seed, modality=modality, frames=frames)
        available = ds.splits()
    except UserError:
        raise
    except (FileNotFoundError, ValueError) as e:
        msg = str(e) if str(e).startswith(str(data)) else f"{data}: {e}"
        raise UserError(f"--data {msg}") from None
    if not available:
        raise UserError(f"--data {data}: no train/test splits for the {modality} encoder; prepare "
                        "it with --layout ucf101/hmdb51/esc50 or a --list file with a split column")
    keys = {_split_key(name): name for name, _, _ in available}
    chosen = available
    if splits:
        wanted = {str(s) for s in splits}
        unknown = sorted(wanted - set(keys) - set(keys.values()))
        if unknown:
            raise UserError(f"--splits {' '.join(unknown)}: {data} has splits {', '.join(keys)}; "
                            "pass some of those or drop --splits")
        chosen = [t for t in available if t[0] in wanted or _split_key(t[0]) in wanted]
    for name, tr, te in chosen:
        if len(tr) == 0 or len(te) == 0:
            raise UserError(f"--data {data}: {name} has {len(tr)} train and {len(te)} test clips "
                            f"with {modality}; a probe needs both (prepare the data with "
                            f"{modality}, or choose another --modality / --splits)")
    if ds.num_classes < 2:
        raise UserError(f"--data {data}: {ds.num_classes} labelled class(es); a probe needs >= 2 "
                        "(prepare a labelled dataset)")
    return ds, chosen


def _split_key(name: str) -> str:
    """What --splits calls a split: split2 → "2", fold3 → "3"; other names as they are."""
    m = re.search(r"(\d+)$", name)
    return m.group(1) if m else name


def evaluate(model, state, data, *, modality, protocol, splits=None, device="cpu", clips=1,
             epochs=10, lr=1e-3, batch_size=64, frames=None):
    """Top-1 per split and mean. ``frames``: clip length for prepared datasets (default: the
    pretraining clip length; the paper fine-tunes on 32-frame clips: --frames 32)."""
    enc = model.f_v if modality == "video" else model.f_a
    key = "video" if modality == "video" else "audio"
    ds, chosen = eval_data(state["cfg"], data, modality=modality, protocol=protocol,
                           splits=splits, frames=frames)
    results = []
    for k, (name, tr, te) in enumerate(chosen):
        with torch.random.fork_rng(devices=[]):  # the caller's RNG stream is left as it was
            torch.manual_seed(_SEED + k)  # the head's init, dropout: the same on every run
            res = _evaluate_split(enc, ds, tr, te, key=key, protocol=protocol, device=device,
                                  clips=clips, epochs=epochs, lr=lr, batch_size=batch_size)
        res["split"] = name
        log.info("%s %s %s: top-1 %.4f", modality, protocol, name, res["top1"])
        results.append(res)
    mean = sum(r["top1"] for r in results) / len(results)
    return {"modality": modality, "protocol": protocol, "top1_mean": mean, "splits": results}


_SEED = 20210503  # the evaluation's own seed (split k uses _SEED + k): results repeat


def _evaluate_split(enc, ds, tr, te, *, key, protocol, device, clips, epochs, lr, batch_size):
    backbone = _fresh_copy(enc.backbone).to(device)
    if protocol == "linear":
        xtr, ytr, _ = extract_features(backbone, ds.batches(tr, batch_size), key, device, 1)
        xte, yte, _ = extract_features(backbone, ds.batches(te, batch_size), key, device, clips)
        return linear_probe(xtr, ytr, xte, yte, num_classes=ds.num_classes)
    return finetune(backbone, enc.backbone.out_dim, ds.num_classes,
                    ds.batches(tr, batch_size, shuffle_seed=1), ds.batches(te, batch_size),
                    key, device, epochs=epochs, lr=lr, clips=clips)


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


@command(kept="no results were written (they are, whole, once every split has finished); run "
               "the same command again: it gives the same figures")
def main(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument("checkpoint", help="a ckpt_*.pt file or a run folder (newest valid checkpoint)")
    p.add_argument("--data", default="synthetic", help="'synthetic' or a prepared manifest")
    p.add_argument("--modality", choices=("video", "audio"), default="video")
    p.add_argument("--protocol", choices=("linear", "finetune"), default="linear")
    p.add_argument("--splits", nargs="*", help="official splits / folds to run (default: all)")
    p.add_argument("--clips", type=positive_int, default=1, help="test clips per video (averaged)")
    p.add_argument("--epochs", type=positive_int, default=10, help="fine-tuning epochs")
    p.add_argument("--lr", type=float, default=1e-3, help="fine-tuning learning rate")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--frames", type=positive_int, default=None,
                   help="clip length on prepared data (default: the pretraining length for linear probes, "
                        "32 for video fine-tuning as in the paper)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--out", default=None, help="results folder (default: <run>/eval)")
    args = p.parse_args(argv)
    if args.lr <= 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    setup_logging()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible; use --device cpu")
    model, state = load_pretrained(args.checkpoint)
    run = Path(args.checkpoint)
    out = output_folder(args.out or (run if run.is_dir() else run.parent) / "eval", "--out")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    res = evaluate(model, state, args.data, modality=args.modality, protocol=args.protocol,
                   splits=args.splits, device=device, clips=args.clips, epochs=args.epochs,
                   lr=args.lr, batch_size=args.batch_size, frames=args.frames)
    js, md = write_results(res, out)
    print(md.read_text())
    print(f"results: {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
