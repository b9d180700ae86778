"""Export a pretrained run's encoders for other code: plain state dicts, no cmacc needed to read.

    python -m cmacc.apps.export RUN_OR_CKPT --out DIR [--keys] [--num-classes N]

From the newest valid checkpoint of a run folder (or the checkpoint file given), writes to DIR:

- ``video_<arch>.pt``  the video backbone's state dict in torchvision's layout. With the paper's
  backbone (``r3d_18`` / ``r2plus1d_18`` at width 64, layers 2-2-2-2) torchvision's own model
  loads it (strict) once its classifier is set aside::

      net = torchvision.models.video.r3d_18()
      net.fc = torch.nn.Identity()                      # 512-d features, as pretrained
      net.load_state_dict(torch.load("video_r3d_18.pt", weights_only=True))

  or, with ``--num-classes N``, with a fresh classifier included (``fc.weight`` [N, 512],
  ``fc.bias`` [N], initialised as torchvision initialises it)::

      net = torchvision.models.video.r3d_18(num_classes=N)
      net.load_state_dict(torch.load("video_r3d_18.pt", weights_only=True))

  A scaled backbone (e.g. ``--preset tiny``) has the same layout at its own width and depth,
  which torchvision cannot build: ``cmacc.encoders.load_video_backbone(path)`` loads either.
- ``audio_resnet1d.pt``  the audio backbone (ResNet-18 with 1-D convolutions over the log-mel):
  ``cmacc.encoders.load_audio_encoder(path)`` returns the module, in eval mode.
- ``model_card.json``  what the weights are: config, data (manifest and its SHA-256), steps,
  date, the project commit, and the eval results found in the run folder.

The query encoders are exported by default (what the paper evaluates); ``--keys`` takes the
momentum (key) encoders. Every file holds tensors and plain containers only: it loads with
``torch.load(..., weights_only=True)``. Files are written atomically; an existing DIR is
written into as it is (re-running replaces the earlier export's files).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn as nn

from cmacc.checkpoint import save_atomic
from cmacc.encoders import audio_payload, torchvision_layout
from data_dali.cli import ArgumentParser, UserError, command, output_folder, setup_logging
from data_dali.fileio import atomic_write_text

from . import positive_int
from .eval import load_pretrained

CARD = "model_card.json"
AUDIO_FILE = "audio_resnet1d.pt"


def _sha256(path: Path) -> str | None:
    try:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    except OSError:
        return None


def _project_commit() -> str | None:
    """The commit of the cmacc checkout doing the export (None outside a git checkout)."""
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _eval_results(run: Path) -> dict:
    """Every eval_*.json that cmacc.apps.eval wrote into the run's eval folder, by file stem."""
    found = {}
    for js in sorted((run / "eval").glob("eval_*.json")):
        try:
            found[js.stem] = json.loads(js.read_text())
        except (OSError, ValueError):
            continue
    return found


def fresh_classifier(in_features: int, num_classes: int) -> dict:
    """``fc.weight`` / ``fc.bias`` of a new torchvision classifier (nn.Linear's own init)."""
    fc = nn.Linear(in_features, num_classes)
    return {"fc.weight": fc.weight.detach().clone(), "fc.bias": fc.bias.detach().clone()}


def export(checkpoint, out, *, keys: bool = False, num_classes: int | None = None) -> dict:
    """Write the exported files into ``out``; returns the model card."""
    model, state = load_pretrained(checkpoint)
    cfg = state["cfg"]
    run = Path(checkpoint) if Path(checkpoint).is_dir() else Path(checkpoint).parent
    video, audio = (model.h_v, model.h_a) if keys else (model.f_v, model.f_a)
    arch = cfg.model.video_arch
    vstate, paper_size = torchvision_layout(video.backbone, arch)
    if num_classes is not None:
        vstate.update(fresh_classifier(video.backbone.out_dim, num_classes))
    out = output_folder(out, "--out")
    vfile, afile = out / f"video_{arch}.pt", out / AUDIO_FILE
    save_atomic(vstate, vfile)
    save_atomic(audio_payload(audio.backbone), afile)
    source = cfg.data.source
    manifest = None if source == "synthetic" else Path(source)
    card = {
        "format": "cmacc export 1",
        "encoders": "key (momentum)" if keys else "query",
        "video": {"file": vfile.name, "arch": arch, "width": cfg.model.video_width,
                  "layers": list(cfg.model.video_layers), "features": video.backbone.out_dim,
                  "torchvision_loadable": paper_size,
                  "classifier": None if num_classes is None else
                  {"num_classes": num_classes, "init": "fresh (nn.Linear default)"}},
        "audio": {"file": afile.name, "n_mels": cfg.model.n_mels,
                  "width": cfg.model.audio_width, "layers": list(cfg.model.audio_layers),
                  "features": audio.backbone.out_dim,
                  "loader": "cmacc.encoders.load_audio_encoder"},
        "data": {"source": source,
                 "manifest_sha256": None if manifest is None else _sha256(manifest)},
        "steps": int(state.get("step", 0)),
        "checkpoint": str(checkpoint),
        "exported": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _project_commit(),
        "config": cfg.to_dict(),
        "eval": _eval_results(run),
    }
    atomic_write_text(out / CARD, json.dumps(card, indent=2) + "\n")
    return card


@command
def main(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument("checkpoint", help="a ckpt_*.pt file or a run folder (newest valid checkpoint)")
    p.add_argument("--out", required=True, help="folder for the exported files (created)")
    p.add_argument("--keys", action="store_true",
                   help="export the momentum (key) encoders instead of the query encoders")
    p.add_argument("--num-classes", type=positive_int, default=None,
                   help="include a fresh torchvision classifier (fc) of this many classes")
    args = p.parse_args(argv)
    setup_logging()
    if Path(args.out).resolve() == Path(args.checkpoint).resolve():
        raise UserError(f"--out {args.out}: is the run folder itself; pass another folder")
    card = export(args.checkpoint, args.out, keys=args.keys, num_classes=args.num_classes)
    print(f"exported {card['encoders']} encoders of step {card['steps']} to {args.out}: "
          f"{card['video']['file']}, {card['audio']['file']}, {CARD}")
    if not card["video"]["torchvision_loadable"]:
        print(f"note: the video backbone is scaled (width {card['video']['width']}, layers "
              f"{card['video']['layers']}); load it with cmacc.encoders.load_video_backbone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
