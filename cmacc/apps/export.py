"""Export a pretrained run's encoders as plain state dicts for other code. Installed as the
command ``cmacc-export`` (= ``python -m cmacc.apps.export``).

    python -m cmacc.apps.export runs/paper --out exported            # query encoders
    python -m cmacc.apps.export runs/paper/ckpt_00100000.pt --out exported --keys --num-classes 101

writes, from the newest valid checkpoint of a run folder (or the checkpoint given):

  video_<arch>.pt     the video backbone under torchvision's names, without ``fc``
                      (``--num-classes N``: with a freshly initialised ``fc`` of N classes)
  audio_resnet1d.pt   the 1-D audio ResNet over the log-mel
  model_card.json     config, data (the manifest's absolute path and its SHA-256 as the run
                      trained on it), steps, date, commit, the eval
                      results found in the run (each with its dataset, checkpoint and
                      settings), and how to load each file

  README.md           the same as a model card in the Hugging Face style: the method,
                      the data, the steps, how to load, and every result with its data

``--format safetensors`` writes ``video_<arch>.safetensors`` and ``audio_resnet1d.safetensors``
instead (``--format torch safetensors``: both), the same tensors under the same names.
Only tensors are written: ``torch.load(path, weights_only=True)`` or
``safetensors.torch.load_file(path)`` reads every file. Loading:

    model = torchvision.models.video.r3d_18()
    model.fc = torch.nn.Identity()                     # or r3d_18(num_classes=N) with --num-classes
    model.load_state_dict(torch.load("exported/video_r3d_18.pt", weights_only=True))
    # or: model.load_state_dict(safetensors.torch.load_file("exported/video_r3d_18.safetensors"))
    audio = cmacc.encoders.load_audio_encoder("exported/audio_resnet1d.pt")  # (or .safetensors)

torchvision's models have one size (width 64, two blocks per stage); a run of another size
(the tiny preset) exports the same names and shapes of its own, which
``cmacc.encoders.load_video_encoder`` rebuilds (the model card says which).
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from pathlib import Path

import torch
import torch.nn as nn

from cmacc.checkpoint import save_atomic
from cmacc.data import describe_data
from cmacc.encoders import backbone_features, export_video, is_torchvision_size
from data_dali.cli import ArgumentParser, UserError, command, output_folder, setup_logging
from data_dali.fileio import atomic_write_bytes, atomic_write_text

from . import git_commit, positive_int, sha256_file
from .eval import load_pretrained, recorded_data

log = logging.getLogger("cmacc.export")


def export(model, *, keys: bool = False, num_classes: int | None = None,
           seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """File name → state dict of the run's video and audio backbones (query encoders, or the
    momentum key encoders with ``keys``); ``num_classes`` adds a fresh ``fc`` (torchvision's
    nn.Linear initialisation, seeded) so that ``<arch>(num_classes=N)`` loads the file."""
    enc_v, enc_a = (model.h_v, model.h_a) if keys else (model.f_v, model.f_a)
    arch = model.cfg.video_arch
    video = export_video(enc_v.backbone)
    if num_classes:
        torch.manual_seed(seed)
        fc = nn.Linear(enc_v.backbone.out_dim, num_classes)
        video.update({f"fc.{k}": v.detach().clone() for k, v in fc.state_dict().items()})
    audio = {k: v.detach().clone() for k, v in enc_a.backbone.state_dict().items()}
    return {f"video_{arch}.pt": video, "audio_resnet1d.pt": audio}


FORMATS = {"torch": ".pt", "safetensors": ".safetensors"}


def save_weights(sd: dict[str, torch.Tensor], path: Path) -> Path:
    """A state dict as ``path``'s format says (.pt: torch.save, .safetensors: safetensors),
    written atomically."""
    if path.suffix == ".pt":
        return save_atomic(sd, path)
    from safetensors.torch import save

    atomic_write_bytes(path, save({k: v.contiguous() for k, v in sd.items()},
                                  metadata={"format": "pt"}))
    return path


def _loader_line(name: str, arch: str, num_classes, tv: bool) -> str:
    """The Python line that loads exported file ``name`` (a video or audio file, either format)."""
    if name.startswith("audio"):
        return f"model = cmacc.encoders.load_audio_encoder('{name}')"
    if not tv:
        return f"model = cmacc.encoders.load_video_encoder('{name}')"
    read = (f"safetensors.torch.load_file('{name}')" if name.endswith(".safetensors")
            else f"torch.load('{name}', weights_only=True)")
    return (f"model = torchvision.models.video.{arch}("
            + (f"num_classes={num_classes})" if num_classes else "); model.fc = torch.nn.Identity()")
            + f"; model.load_state_dict({read})")


def model_card(state: dict, files: dict[str, Path], *, keys: bool, num_classes: int | None) -> dict:
    """What the exported weights are and where they came from (plain JSON)."""
    cfg = state["cfg"]
    m = cfg.model
    arch = m.video_arch
    tv = is_torchvision_size(m.video_width, m.video_layers)
    video_file = next(n for n in files if n.startswith("video_"))
    audio_file = next(n for n in files if n.startswith("audio_"))
    run = Path(state["file"]).parent
    return {
        "method": cfg.method,
        "encoders": "key (momentum)" if keys else "query",
        "checkpoint": str(state["file"]),
        "steps": int(state["step"]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "checkpoint_date": datetime.datetime.fromtimestamp(
            Path(state["file"]).stat().st_mtime, datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "data": recorded_data(state),
        "config": cfg.to_dict(),
        "video": {"file": video_file, "files": [n for n in files if n.startswith("video_")],
                  "arch": arch, "width": m.video_width,
                  "layers": list(m.video_layers),
                  "features": backbone_features(m.video_width, m.video_layers),
                  "fc_classes": num_classes, "torchvision": tv,
                  "load": _loader_line(video_file, arch, num_classes, tv),
                  "input": "[B, 3, T, H, W], normalised as data_dali's loaders do"},
        "audio": {"file": audio_file, "files": [n for n in files if n.startswith("audio_")],
                  "width": m.audio_width,
                  "layers": list(m.audio_layers), "n_mels": m.n_mels,
                  "features": backbone_features(m.audio_width, m.audio_layers),
                  "load": _loader_line(audio_file, arch, num_classes, tv),
                  "input": f"[B, {m.n_mels}, L] log-mel, 100 frames per second (data_dali/audio.py)"},
        "sha256": {name: sha256_file(p) for name, p in files.items()},
        "eval": _eval_results(run),
    }


def card_markdown(card: dict) -> str:
    """The model card as README.md in the Hugging Face style: YAML front matter (library,
    tags, the data and each result as model-index entries) and the sections a reader looks for:
    method, training data, training (steps, config), how to load, results with their data."""
    cfg, data = card["config"], card["data"] or {}
    source = data.get("source", "unrecorded")
    digest = data.get("manifest_sha256")
    results = [(name, r) for name, r in card["eval"].items()]
    yaml = ["---", "library_name: pytorch", "license: other",
            "tags: [self-supervised, audio-visual, video, audio, contrastive, cm-acc]",
            f"datasets: [{json.dumps(source)}]"]
    if results:
        yaml += ["model-index:", f"- name: {json.dumps(card['method'])}", "  results:"]
        for name, r in results:
            yaml += [f"  - task: {{type: {r.get('protocol', 'linear')}-probe, name: "
                     f"{json.dumps(name)}}}",
                     f"    dataset: {{name: {json.dumps(str(r['data'].get('source')))}, type: "
                     f"{json.dumps(str(r['data'].get('manifest_sha256') or 'synthetic'))}}}",
                     f"    metrics: [{{type: top1, value: {r.get('top1_mean')}}}]"]
    yaml.append("---")
    v, a = card["video"], card["audio"]
    lines = [*yaml, "", f"# {card['method']} encoders ({card['encoders']})", "",
             "## Method", "",
             f"Self-supervised audio-visual pretraining, method `{card['method']}` (sampler "
             f"`{cfg['selection']['sampler']}`, objective `{cfg['model']['objective']}`): "
             "cross-modal contrastive coding with actively sampled negatives (Ma et al., "
             "ICLR 2021). No labels are used in pretraining.", "",
             "## Training data", "",
             (f"`{describe_data(data)}`" if data else "not recorded")
             + (f", SHA-256 `{digest}`" if digest else "")
             + " — every clip with video and audio, labels unused.", "",
             "## Training", "",
             f"{card['steps']} steps from checkpoint `{card['checkpoint']}` "
             f"({card['checkpoint_date']}), commit {card['commit']}; batch M = "
             f"{cfg['model']['batch_size']}, dictionary K = {cfg['model']['dict_size']}; the "
             "full config is in model_card.json.", "",
             "## How to load", "",
             f"- video ({v['arch']}, width {v['width']}, layers {v['layers']}, "
             f"{v['features']} features; input {v['input']}): `{v['load']}`",
             f"- audio (1-D ResNet, {a['features']} features; input {a['input']}): "
             f"`{a['load']}`", "",
             "Files and SHA-256: " + ", ".join(f"`{n}` `{h[:16]}…`"
                                               for n, h in card["sha256"].items()), "",
             "## Results", ""]
    if results:
        lines += ["| result | encoder | protocol | top-1 (mean over splits) | evaluated on | "
                  "checkpoint |", "|---|---|---|---|---|---|"]
        for name, r in results:
            d = r["data"]
            on = str(d.get("source")) + (f" (sha256 {d['manifest_sha256'][:12]})"
                                         if d.get("manifest_sha256") else "")
            top1 = r.get("top1_mean")
            lines.append(f"| {name} | {r.get('modality', '?')} | {r.get('protocol', '?')} | "
                         f"{top1 if not isinstance(top1, float) else f'{top1:.4f}'} | {on} | "
                         f"{r.get('checkpoint', '?')} |")
    else:
        lines.append("No evaluation found in the run (`cmacc-eval RUN` writes one; export again).")
    return "\n".join(lines) + "\n"


def _eval_results(run: Path) -> dict:
    """RUN/eval/eval_*.json written by cmacc.apps.eval, by file name, each with the dataset,
    checkpoint and settings it records. A result that records no dataset (written by an older
    cmacc-eval) is left out, and said: its figure could be of any data."""
    found = {}
    for p in sorted((run / "eval").glob("eval_*.json")):
        try:
            res = json.loads(p.read_text())
        except (OSError, ValueError):
            continue  # a damaged result is left out of the card, never fatal
        if not isinstance(res, dict) or not isinstance(res.get("data"), dict):
            log.warning("%s records no dataset (an older cmacc-eval): left out of the model card; "
                        "run cmacc-eval again to include it", p)
            continue
        found[p.name] = res
    return found


@command
def main(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument("checkpoint", help="a run folder (its newest valid checkpoint) or a ckpt_*.pt")
    p.add_argument("--out", required=True, help="folder for the exported files (created if missing)")
    p.add_argument("--keys", action="store_true",
                   help="export the momentum (key) encoders instead of the query encoders")
    p.add_argument("--num-classes", type=positive_int, default=None,
                   help="include a fresh fc of this many classes in the video file")
    p.add_argument("--seed", type=int, default=0, help="seed of the fresh fc (with --num-classes)")
    p.add_argument("--format", nargs="+", choices=tuple(FORMATS), default=["torch"],
                   help="file formats to write: torch (.pt, default), safetensors "
                        "(.safetensors), or both")
    args = p.parse_args(argv)
    if "safetensors" in args.format:
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            raise UserError("--format safetensors needs the safetensors package: pip install "
                            "safetensors (or leave the flag out for torch files)") from None
    setup_logging()
    model, state = load_pretrained(args.checkpoint)
    cfg = state["cfg"]
    if args.num_classes and not is_torchvision_size(cfg.model.video_width, cfg.model.video_layers):
        raise UserError(f"--num-classes: the run's video backbone is a scaled {cfg.model.video_arch} "
                        f"(width {cfg.model.video_width}, layers {list(cfg.model.video_layers)}), "
                        "which torchvision's model cannot hold; drop --num-classes and add your "
                        "own classifier on cmacc.encoders.load_video_encoder's features")
    out = output_folder(args.out, "--out")
    files = {}
    for name, sd in export(model, keys=args.keys, num_classes=args.num_classes,
                           seed=args.seed).items():
        for fmt in dict.fromkeys(args.format):
            path = (out / name).with_suffix(FORMATS[fmt])
            files[path.name] = save_weights(sd, path)
    card = model_card(state, files, keys=args.keys, num_classes=args.num_classes)
    atomic_write_text(out / "model_card.json", json.dumps(card, indent=2))
    atomic_write_text(out / "README.md", card_markdown(card))
    for name in files:
        print(f"{out / name}")
    print(f"{out / 'model_card.json'}")
    print(f"{out / 'README.md'}")
    print(f"video: {card['video']['load']}")
    print(f"audio: {card['audio']['load']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
