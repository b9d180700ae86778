"""Downstream evaluation of a pretrained checkpoint: linear probe on frozen features and
end-to-end fine-tuning, for the video or the audio encoder. Installed as the command
``cmacc-eval`` (= ``python -m cmacc.apps.eval``).

    python -m cmacc.apps.eval runs/cmacc --modality video --protocol linear
    python -m cmacc.apps.eval runs/cmacc/ckpt_00001000.pt --data UCF101/manifest.csv \\
        --modality video --protocol finetune --splits 1 2 3 --out runs/cmacc/eval
    python -m cmacc.apps.eval exported/audio_resnet1d.pt --data ESC-50/manifest.csv

Without ``--data`` a run is evaluated on its own pretraining data, as its checkpoint records
it (the built-in synthetic clips: held-out instances; a manifest: its splits); the first log
line names the encoder and the data. A run pretrained on a manifest is never evaluated on the
synthetic clips. An exported encoder file (``cmacc-export``) is evaluated too: its
model_card.json beside it gives the run's config and data, or ``--data`` names the data.

Every top-1 is printed, and recorded, beside the baselines it must beat: the majority-class
rate of its test split, and for each clip property the manifest records (silent audio, padded
audio, no audio stream: prepare's notes) that alone scores above it, that property's accuracy
(a classifier that sees only the property, fitted on the train split): a probe that does not
beat them is warned about. Class names that look like splits (train, val, test) are warned
about too (a probe would learn the split).

Results (mean top-1 over splits/folds and per split) go to
OUT/eval_<modality>_<protocol>_<data tag>.json and a Markdown table beside it; the tag names
the dataset (``synthetic``, or the manifest's folder and the first 8 hex digits of its
SHA-256), so results on different data sit side by side. Each records the dataset (path and
SHA-256 of its manifest), the encoder (checkpoint and step), clips, frames, the protocol's
settings, the damaged clips left out, the date and the commit. A damaged clip (truncated WebM,
unreadable or non-finite log-mel, a decode failure) is left out, named and counted; past
``--max-bad-clips`` the evaluation stops with one line (exit 2).
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import sys
from pathlib import Path

import torch
import torch.nn as nn

from cmacc import checkpoint as ckpt
from cmacc.config import Config
from cmacc.data import eval_splits
from cmacc.encoders import EncoderFileError, load_audio_encoder, load_video_encoder
from cmacc.model import CMACC
from cmacc.probe import baselines, extract_features, finetune, linear_probe
from data_dali.cli import (ArgumentParser, UserError, command, first_line, output_folder,
                           setup_logging)
from data_dali.fileio import atomic_write_text
from data_dali.manifest import SPLIT_NAMES, clip_properties

from . import git_commit, positive_int, sha256_file

log = logging.getLogger("cmacc.eval")
_FIX = "pass a ckpt_*.pt file written by train.py, or its run folder"
LINEAR = dict(weight_decay=1e-4, max_iter=200)  # the linear probe's settings (cmacc.probe)


class CheckpointError(UserError):
    """A path that is not a usable train.py checkpoint or run folder; the message says why."""


def load_pretrained(path, state=None) -> tuple[CMACC, dict]:
    """The CMACC model of a checkpoint file or run folder (newest valid checkpoint), and the
    checkpoint with its typed config under "cfg" and its path under "file". ``state``: the
    file's contents, when the caller has read them already."""
    p = Path(path)
    if p.is_dir():
        found = ckpt.find_latest_valid(p)
        if found is None:
            raise CheckpointError(f"{p}: no readable checkpoint (ckpt_*.pt) in this folder; {_FIX}")
        p, state = found
    elif not p.is_file():
        raise CheckpointError(f"{p}: no such checkpoint file or run folder; {_FIX}")
    elif state is None:
        try:
            state = ckpt.load(p)
        except Exception as e:  # noqa: BLE001 - corrupt or foreign bytes: torch's weights-only
            # unpickler raises UnpicklingError, EOFError, RuntimeError, but also IndexError etc.
            raise CheckpointError(f"{p}: not a checkpoint file ({ckpt.why_unloadable(e)}); "
                                  f"{_FIX}") from None
    if _is_state_dict(state):
        raise CheckpointError(f"{p}: an encoder exported by cmacc-export, not a checkpoint of "
                              f"train.py (cmacc-eval evaluates such a file); {_FIX}")
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
    state["file"] = p.resolve()  # absolute: results and model cards name it from anywhere
    return model, state


def _is_state_dict(obj) -> bool:
    return (isinstance(obj, dict) and bool(obj)
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()))


def load_encoder(path, modality=None) -> tuple[nn.Module, dict]:
    """The backbone to evaluate and what it is: a run's (or checkpoint's) query encoder of
    ``modality`` (default video), or an exported encoder file of cmacc-export (its modality is
    the file's; its model_card.json beside it gives the run's config, step and data). The dict
    holds "cfg", "file", "step" (None when unknown), "modality", "encoder" (words for the log)
    and "data" (the pretraining data's source, None when unknown)."""
    p = Path(path)
    state = None
    if p.is_file():
        try:
            if p.suffix == ".safetensors":  # cmacc-export --format safetensors
                from safetensors.torch import load_file

                state = load_file(p)
            else:
                state = ckpt.load(p)
        except Exception:  # noqa: BLE001 - not a torch file: load_pretrained says why
            state = None
    if not _is_state_dict(state):
        model, state = load_pretrained(p, state)
        modality = modality or "video"
        enc = model.f_v if modality == "video" else model.f_a
        return enc.backbone, {
            "cfg": state["cfg"], "file": state["file"], "step": int(state["step"]),
            "modality": modality, "data": recorded_data(state),
            "encoder": f"the {modality} query encoder of {state['file']} (step {state['step']})"}
    try:
        backbone, found = load_audio_encoder(p), "audio"
    except EncoderFileError:
        try:
            backbone, found = load_video_encoder(p), "video"
        except EncoderFileError as e:
            raise CheckpointError(f"{p}: a state dict, but neither encoder of cmacc-export "
                                  f"({first_line(e, 160)}); {_FIX}, or a video_<arch>.pt / "
                                  "audio_resnet1d.pt written by cmacc-export") from None
    if modality and modality != found:
        raise UserError(f"--modality {modality}: {p} is an exported {found} encoder; pass "
                        f"--modality {found}, or the {modality} file of the export")
    if getattr(backbone, "fc", None) is not None and isinstance(backbone.fc, nn.Linear):
        backbone.fc = nn.Identity()  # --num-classes added a classifier: evaluate the features
    if not hasattr(backbone, "out_dim"):  # torchvision's model: the last stage's channels
        backbone.out_dim = [m for m in backbone.modules()
                            if isinstance(m, nn.modules.batchnorm._BatchNorm)][-1].num_features
    card_file = p.parent / "model_card.json"
    card = None
    if card_file.is_file():
        try:
            card = json.loads(card_file.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{card_file}: not readable JSON ({first_line(e, 100)}); "
                                  "export the run again, or move the file away") from None
    if card is None:
        cfg, step, data, origin = Config(), None, None, "no model_card.json beside it"
    else:
        try:
            cfg = Config.from_dict(card["config"])
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{card_file}: its config does not fit this version of cmacc "
                                  f"({e}); export the run again") from None
        step, data = card.get("steps"), card.get("data")
        origin = (f"{card.get('encoders', 'query')} encoder exported from "
                  f"{card.get('checkpoint')} (step {step})")
    return backbone, {"cfg": cfg, "file": p.resolve(), "step": step, "modality": found, "data": data,
                      "encoder": f"the exported {found} encoder {p} ({origin})"}


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
    _check_sizes(chosen, data, modality, ds)
    if ds.num_classes < 2:
        raise UserError(f"--data {data}: {ds.num_classes} labelled class(es); a probe needs >= 2 "
                        "(prepare a labelled dataset)")
    return ds, chosen


def _split_key(name: str) -> str:
    """What --splits calls a split: split2 → "2", fold3 → "3"; other names as they are."""
    m = re.search(r"(\d+)$", name)
    return m.group(1) if m else name


def recorded_data(state) -> dict | None:
    """The pretraining data a checkpoint (or an export's model card) records: {"source", and
    "manifest_sha256" where recorded}, or None when nothing records it. A checkpoint written
    before checkpoints recorded their data has its config's source (as typed)."""
    if "data" not in state:
        return {"source": state["cfg"].data.source}
    rec = state["data"]
    return rec if isinstance(rec, dict) or rec is None else {"source": rec}


def resolve_data(data, state) -> tuple[str, str]:
    """The data to evaluate on and why: ``--data`` as given, or (None) the run's own
    pretraining data as its checkpoint (or an export's model card) records it. A UserError
    naming --data when that data is not there or has changed since (another SHA-256), when
    nothing records it, or when the synthetic clips are asked for a run pretrained on a
    manifest (their figure says nothing of it)."""
    rec = recorded_data(state) or {}
    recorded, digest = rec.get("source"), rec.get("manifest_sha256")
    what = state["file"]
    fix = "pass --data MANIFEST (a labelled manifest.csv from cmacc-prepare)"
    if data is None:
        if recorded is None:
            raise UserError(f"--data: {what} does not say which data its run was pretrained on "
                            f"(no model_card.json beside it); {fix} or --data synthetic")
        if recorded != "synthetic" and not Path(recorded).is_file():
            where = ("" if Path(recorded).is_absolute() else
                     f" (a path relative to the folder its run was started in, as older runs "
                     f"recorded it; not found from {Path.cwd()})")
            raise UserError(f"--data: {what} was pretrained on {recorded}, which is not there "
                            f"now{where}; {fix}")
        if digest and sha256_file(recorded) != digest:
            raise UserError(f"--data: {what} was pretrained on {recorded} (sha256 {digest[:12]}), "
                            f"which has changed since (sha256 {sha256_file(recorded)[:12]}): its "
                            f"figure would be of other clips; pass --data {recorded} to evaluate "
                            "on it as it is now")
        return recorded, "the run's own pretraining data"
    if data == "synthetic" and recorded not in (None, "synthetic"):
        raise UserError(f"--data synthetic: {what} was pretrained on {recorded}, not on the "
                        "built-in synthetic clips, whose figure would say nothing of it; pass "
                        f"--data with a labelled prepared manifest (e.g. --data {recorded}) or "
                        "leave --data out to evaluate on the run's own data")
    same = recorded is not None and (data == recorded or (
        data != "synthetic" and recorded != "synthetic" and Path(data).is_file()
        and Path(recorded).is_file() and Path(data).resolve() == Path(recorded).resolve()))
    if same and digest and sha256_file(data) != digest:
        same = False  # the same path, other contents
    return data, "the run's own pretraining data" if same else "named by --data"


def dataset_record(source: str) -> dict:
    """What an evaluation result says of its data: the source (a manifest's absolute path),
    the SHA-256 of the manifest's bytes, and the tag its result files carry (``synthetic``, or
    the manifest's folder name and the hash's first 8 hex digits)."""
    if source == "synthetic":
        return {"source": "synthetic", "manifest_sha256": None, "tag": "synthetic"}
    p = Path(source).resolve()
    digest = sha256_file(p) if p.is_file() else None  # (not a file: eval_data says so)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", p.parent.name or p.stem).strip("._") or "data"
    return {"source": str(p), "manifest_sha256": digest,
            "tag": f"{name}-{digest[:8]}" if digest else name}


def evaluate(model, state, data=None, *, modality, protocol, splits=None, device="cpu", clips=1,
             epochs=10, lr=1e-3, batch_size=64, frames=None, max_bad_clips=None):
    """Top-1 per split and mean, with what was measured: dataset, encoder, checkpoint step,
    clips, frames, settings, damaged clips left out, date and commit. ``model``: a CMACC model
    (its query encoder of ``modality``) or a backbone (``load_encoder``); ``state``: its
    checkpoint (``load_pretrained``) or ``load_encoder``'s dict. ``data``: None is the run's
    own pretraining data (``resolve_data``). ``frames``: clip length for prepared datasets
    (default: the pretraining clip length; the paper fine-tunes on 32-frame clips: --frames
    32). ``max_bad_clips``: damaged clips left out before it stops (default 1%, at least 10)."""
    backbone = (model.f_v if modality == "video" else model.f_a).backbone \
        if isinstance(model, CMACC) else model
    key = "video" if modality == "video" else "audio"
    cfg = state["cfg"]
    source, why = resolve_data(data, state)
    record = dataset_record(source)
    step = state.get("step")
    encoder = state.get("encoder") or (f"the {modality} query encoder of {state['file']} "
                                       f"(step {step})")
    digest = record["manifest_sha256"]
    log.info("evaluating %s on %s (%s%s)", encoder, record["source"], why,
             f"; manifest sha256 {digest[:12]}" if digest else "")
    ds, chosen = eval_data(cfg, source, modality=modality, protocol=protocol, splits=splits,
                           frames=frames)
    warnings = _split_named_classes(ds, chosen, source)
    for w in warnings:
        log.warning("%s", w)
    bad = None
    if hasattr(ds, "leave_out_damaged"):
        chosen = ds.leave_out_damaged(chosen, max_bad_clips)
        bad = ds.bad
        _check_sizes(chosen, source, modality, ds)
    labels, props, names = _labels_and_properties(ds, chosen)
    results = []
    for k, (name, tr, te) in enumerate(chosen):
        with torch.random.fork_rng(devices=[]):  # the caller's RNG stream is left as it was
            torch.manual_seed(_SEED + k)  # the head's init, dropout: the same on every run
            res = _evaluate_split(backbone, ds, tr, te, key=key, protocol=protocol,
                                  device=device, clips=clips, epochs=epochs, lr=lr,
                                  batch_size=batch_size)
        res["split"] = name
        res.update(_split_baselines(ds, tr, te, labels, props, names))
        log.info("%s %s %s: top-1 %.4f (%s)", modality, protocol, name, res["top1"],
                 _baseline_words(res))
        warnings += _not_beaten(res, f"{modality} {protocol} {name}")
        results.append(res)
    mean = sum(r["top1"] for r in results) / len(results)
    n = len(results)
    baseline_means = {"majority_top1_mean": sum(r["majority_top1"] for r in results) / n,
                      "property_top1_mean": {p: sum(r["property_top1"][p] for r in results) / n
                                             for p in props}}
    settings = (dict(LINEAR, batch_size=batch_size) if protocol == "linear" else
                dict(epochs=epochs, lr=lr, weight_decay=FINETUNE_WD, batch_size=batch_size))
    if bad is not None and bad.count:
        log.warning("%d damaged clip(s) left out of the evaluation (listed under bad_clips in "
                    "the result)", bad.count)
    return {
        "modality": modality, "protocol": protocol, "top1_mean": mean, **baseline_means,
        "splits": results, "warnings": warnings,
        "data": dict(record, how=why), "encoder": encoder,
        "checkpoint": str(state["file"]), "step": None if step is None else int(step),
        "clips": clips, "frames": getattr(ds, "t", cfg.data.frames), "settings": settings,
        "bad_clips": {"count": bad.count if bad else 0, "limit": bad.limit if bad else None,
                      "clips": bad.named() if bad else []},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
    }


def _split_named_classes(ds, chosen, source) -> list[str]:
    """The warning prepare gives for class folders named train/, val/, test/, repeated for a
    manifest whose classes in the chosen splits are so named (prepared with
    --split-folders-are-classes, or by an older data_dali): the probe would learn the split."""
    m = getattr(ds, "m", None)
    if m is None:
        return []
    used = {int(m.label_array[int(i)]) for _, tr, te in chosen for i in torch.cat([tr, te])}
    named = sorted(n for c, n in enumerate(m.class_names) if c in used and n.lower() in SPLIT_NAMES)
    if not named:
        return []
    return [f"{source}: class names {', '.join(named)} look like splits, not classes: a probe "
            "would learn the split, not what the clips show; prepare the source with --layout "
            "list --list FILE (a 'path label split' line per clip) or, for Kinetics, --layout "
            "kinetics --splits ANNOTATIONS"]


def _labels_and_properties(ds, chosen) -> tuple[torch.Tensor, dict, list | None]:
    """Every clip's label, the clip properties prepare recorded (``clip_properties``: notes,
    silent audio, no audio stream) that some clip of the chosen splits has, as {name: bool
    [clips]}, and the class names (None: the synthetic clips, which record none)."""
    m = getattr(ds, "m", None)
    if m is None:
        return torch.as_tensor(ds.data.labels), {}, None
    kinds = [clip_properties(r) for r in m.rows]
    used = sorted({int(i) for _, tr, te in chosen for i in torch.cat([tr, te])})
    names = sorted(set().union(*(kinds[i] for i in used))) if used else []
    return (torch.as_tensor(m.label_array),
            {p: torch.tensor([p in k for k in kinds], dtype=torch.bool) for p in names},
            list(m.class_names))


def _split_baselines(ds, tr, te, labels, props, names) -> dict:
    """``cmacc.probe.baselines`` on the split's clips (less any found damaged): the majority
    class of the test clips, and each clip property's accuracy alone."""
    found = getattr(getattr(ds, "bad", None), "found", None) or ()
    tr = torch.tensor([int(i) for i in tr if int(i) not in found], dtype=torch.long)
    te = torch.tensor([int(i) for i in te if int(i) not in found], dtype=torch.long)
    b = baselines(labels[tr], labels[te], {p: (v[tr], v[te]) for p, v in props.items()})
    lab = b.pop("majority_label")
    b["majority_class"] = None if lab is None else (names[lab] if names else str(lab))
    return b


def _baseline_words(res: dict) -> str:
    """The baselines of one split's result in words: the majority class, and each clip
    property whose accuracy alone is above it."""
    words = f"majority class {res['majority_top1']:.4f} ({res['majority_class']})"
    for p, acc in _telling(res):
        words += f"; {p!r} alone {acc:.4f}"
    return words


def _telling(res: dict) -> list[tuple[str, float]]:
    """The clip properties that alone score above the majority class, best first."""
    return sorted(((p, a) for p, a in res.get("property_top1", {}).items()
                   if a > res["majority_top1"] + 1e-9), key=lambda t: (-t[1], t[0]))


def _not_beaten(res: dict, what: str) -> list[str]:
    """A logged warning for each baseline the probe's top-1 does not beat."""
    out = []
    if res["top1"] <= res["majority_top1"] + 1e-9:
        out.append(f"{what}: top-1 {res['top1']:.4f} does not beat the majority class "
                   f"{res['majority_class']!r} of its test clips ({res['majority_top1']:.4f}): "
                   "the probe has shown nothing of the classes")
    for p, acc in _telling(res):
        if res["top1"] <= acc + 1e-9:
            out.append(f"{what}: top-1 {res['top1']:.4f} does not beat what the clip property "
                       f"{p!r} alone scores ({acc:.4f}): the probe may detect that, not the "
                       "classes; see the class's clips with that note (cmacc-manifest stats) "
                       "and the prepare warning about it")
    for w in out:
        log.warning("%s", w)
    return out


def _check_sizes(chosen, data, modality, ds=None) -> None:
    for name, tr, te in chosen:
        if len(tr) == 0 or len(te) == 0:
            part = "test" if len(te) == 0 else "train"
            why = _no_split_part(ds, name, part, chosen)
            if why:
                raise UserError(f"--data {data}: {name} has {len(tr)} train and {len(te)} test "
                                f"clips with {modality}: {why}")
            raise UserError(f"--data {data}: {name} has {len(tr)} train and {len(te)} test clips "
                            f"with {modality}; a probe needs both (prepare the data with "
                            f"{modality}, or choose another --modality / --splits)")


def _no_split_part(ds, name, part, chosen) -> str | None:
    """Why split ``name`` of a manifest has no ``part`` ("train"/"test") clips at all, whatever
    their modality, and how to get them: the words, or None when it has such clips (they lack
    the modality, or a label) or the data is not a manifest."""
    m = getattr(ds, "m", None)
    if m is None:
        return None
    rows = m.rows
    others = [n for n, tr, te in chosen if n != name and len(tr) and len(te)]
    elsewhere = (f"pass --splits {' '.join(_split_key(n) for n in others)} (the splits that "
                 "have both), " if others else "")
    heldout = ("or prepare the list without its split column, so that cmacc-eval holds out 1 "
               f"in {_held_out()} of each class's clips (split 'heldout')")
    if re.fullmatch(r"split[123]", name):
        if any(r.get(name) == part for r in rows):
            return None
        marked = sum(1 for r in rows if r.get(name))
        return (f"the manifest has no {part} split: its {name} column marks {marked} clip(s), "
                f"none '{part}', and a probe needs both: mark some clips '{part}' in the split "
                "column of the --list file and prepare again (docs/DATA.md, Evaluation splits), "
                f"{elsewhere}{heldout}")
    if name.startswith("fold") and part == "train":
        folds = sorted({r["fold"] for r in rows if r.get("fold")})
        if len(folds) > 1:
            return None
        return (f"the manifest has one fold ({', '.join(folds)}), so no clip is left to train "
                "a probe when it is the test set; give the clips two or more folds (the fold "
                f"column of the --list file) and prepare again, {heldout}")
    if name == "heldout" and part == "test":
        return ("every labelled class has at most one such clip, and the held-out split tests "
                f"1 in {_held_out()} of the clips of each class that has 2 or more; add clips, "
                "or a split column with 'test' clips (the --list file's split column)")
    return None


def _held_out() -> int:
    from data_dali.loader import HELD_OUT

    return HELD_OUT


_SEED = 20210503  # the evaluation's own seed (split k uses _SEED + k): results repeat
FINETUNE_WD = 1e-4  # fine-tuning's weight decay (Adam)


def _evaluate_split(enc, ds, tr, te, *, key, protocol, device, clips, epochs, lr, batch_size):
    backbone = _fresh_copy(enc).to(device)
    if protocol == "linear":
        xtr, ytr, _ = _features(backbone, ds, tr, batch_size, key, device, 1)
        xte, yte, _ = _features(backbone, ds, te, batch_size, key, device, clips)
        return linear_probe(xtr, ytr, xte, yte, num_classes=ds.num_classes, **LINEAR)
    return finetune(backbone, enc.out_dim, ds.num_classes,
                    ds.batches(tr, batch_size, shuffle_seed=1), ds.batches(te, batch_size),
                    key, device, epochs=epochs, lr=lr, clips=clips, weight_decay=FINETUNE_WD)


def _features(backbone, ds, index, batch_size, key, device, clips):
    """extract_features, less the clips found damaged on the way (in any pass)."""
    x, y, idx = extract_features(backbone, ds.batches(index, batch_size), key, device, clips)
    found = getattr(getattr(ds, "bad", None), "found", None)
    if found:
        keep = torch.tensor([int(i) not in found for i in idx], dtype=torch.bool)
        x, y, idx = x[keep], y[keep], idx[keep]
    return x, y, idx


def _fresh_copy(module):
    import copy

    m = copy.deepcopy(module)
    for p in m.parameters():
        p.requires_grad_(True)
    return m


def result_stem(res: dict) -> str:
    """eval_<modality>_<protocol>_<data tag>: results on other data never share a file."""
    tag = (res.get("data") or {}).get("tag")
    return f"eval_{res['modality']}_{res['protocol']}" + (f"_{tag}" if tag else "")


_SAME_MEASUREMENT = ("encoder", "step", "clips", "frames", "settings")


def write_results(res: dict, out: Path) -> tuple[Path, Path]:
    """OUT/<result_stem>.json and .md, whole. A file of the same data and protocol from
    another encoder, step or settings is replaced with a warning naming what it held."""
    out.mkdir(parents=True, exist_ok=True)
    stem = result_stem(res)
    js, md = out / f"{stem}.json", out / f"{stem}.md"
    try:
        old = json.loads(js.read_text()) if js.is_file() else None
    except (OSError, ValueError):
        old = None
    if isinstance(old, dict):
        changed = [k for k in _SAME_MEASUREMENT if old.get(k) != res.get(k)]
        if changed:
            log.warning("%s held top-1 %.4f of %s; replaced (it differs in %s)", js,
                        old.get("top1_mean", float("nan")), old.get("encoder"), ", ".join(changed))
    data = res.get("data") or {}
    lines = [f"| {res['modality']} {res['protocol']} ({data.get('tag', '?')}) | top-1 | "
             "majority class | a clip property alone |", "|---|---|---|---|"]
    for r in res["splits"]:
        told = _telling(r) if "majority_top1" in r else []
        lines.append(f"| {r['split']} | {100 * r['top1']:.1f} | "
                     + (f"{100 * r['majority_top1']:.1f} ({r['majority_class']})"
                        if "majority_top1" in r else "-") + " | "
                     + ("; ".join(f"{100 * a:.1f} ({p})" for p, a in told) or "-") + " |")
    means = res.get("property_top1_mean") or {}
    best = sorted(((a, p) for p, a in means.items()), key=lambda t: (-t[0], t[1]))
    told = [(p, a) for a, p in best if "majority_top1_mean" in res
            and a > res["majority_top1_mean"] + 1e-9]
    lines.append(f"| **mean** | **{100 * res['top1_mean']:.1f}** | "
                 + (f"{100 * res['majority_top1_mean']:.1f}" if "majority_top1_mean" in res
                    else "-") + " | "
                 + ("; ".join(f"{100 * a:.1f} ({p})" for p, a in told) or "-") + " |")
    lines.append("")
    lines.append("majority class: the test clips' most common class (what always saying it "
                 "scores); a clip property alone: a classifier that sees only what prepare "
                 "noted of each clip (e.g. silent audio), fitted on the train split, where it "
                 "scores above the majority class. The probe must beat both.")
    for w in res.get("warnings") or []:
        lines.append(f"warning: {w}")
    if data:
        lines.append(f"data: {data['source']}" + (f" (manifest sha256 {data['manifest_sha256']})"
                                                  if data.get("manifest_sha256") else ""))
    if res.get("encoder"):
        lines.append(f"encoder: {res['encoder']}")
    n_bad = (res.get("bad_clips") or {}).get("count", 0)
    if n_bad:
        lines.append(f"damaged clips left out: {n_bad} (listed in {js.name})")
    atomic_write_text(js, json.dumps(res, indent=2))
    atomic_write_text(md, "\n".join(lines) + "\n")
    return js, md


@command(kept="no results were written (they are, whole, once every split has finished); run "
               "the same command again: it gives the same figures")
def main(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument("checkpoint", help="a ckpt_*.pt file, a run folder (newest valid checkpoint), "
                                      "or an encoder file written by cmacc-export")
    p.add_argument("--data", default=None,
                   help="'synthetic' or a prepared manifest.csv (default: the data the run was "
                        "pretrained on, as its checkpoint or model card records it)")
    p.add_argument("--modality", choices=("video", "audio"), default=None,
                   help="the encoder to evaluate (default: video; an exported file's own)")
    p.add_argument("--protocol", choices=("linear", "finetune"), default="linear",
                   help="linear probe on frozen features or end-to-end fine-tuning "
                        "(default: linear)")
    p.add_argument("--splits", nargs="*", help="official splits / folds to run (default: all)")
    p.add_argument("--clips", type=positive_int, default=1,
                   help="test clips per video, averaged (default: 1)")
    p.add_argument("--epochs", type=positive_int, default=10,
                   help="fine-tuning epochs (default: 10)")
    p.add_argument("--lr", type=float, default=1e-3,
                   help="fine-tuning learning rate (default: 0.001)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="(default: 64)")
    p.add_argument("--frames", type=positive_int, default=None,
                   help="clip length on prepared data (default: the pretraining length for linear probes, "
                        "32 for video fine-tuning as in the paper)")
    p.add_argument("--max-bad-clips", type=int, default=None,
                   help="damaged clips left out (named, counted) before the evaluation stops "
                        "(default: 1%% of the clips evaluated, at least 10)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="(default: cuda if available)")
    p.add_argument("--out", default=None, help="results folder (default: <run>/eval, or the "
                                               "exported file's folder/eval)")
    args = p.parse_args(argv)
    if args.lr <= 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    if args.max_bad_clips is not None and args.max_bad_clips < 0:
        p.error(f"--max-bad-clips must be >= 0, got {args.max_bad_clips}")
    setup_logging()
    if args.device == "cuda" and not torch.cuda.is_available():
        from cmacc.devices import cuda_needs

        raise UserError(f"--device cuda: CUDA is not usable: {cuda_needs()}; install for your "
                        "driver (README, Install: make install CUDA=12) or use --device cpu")
    chosen = logging.getLogger("cmacc.checkpoint")  # (its "newest valid checkpoint" line: the
    level, chosen.level = chosen.level, logging.WARNING  # first line below names that file)
    try:
        backbone, state = load_encoder(args.checkpoint, args.modality)
    finally:
        chosen.setLevel(level)
    run = Path(args.checkpoint)
    out = output_folder(args.out or (run if run.is_dir() else run.parent) / "eval", "--out")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    res = evaluate(backbone, state, args.data, modality=state["modality"],
                   protocol=args.protocol, splits=args.splits, device=device, clips=args.clips,
                   epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, frames=args.frames,
                   max_bad_clips=args.max_bad_clips)
    js, md = write_results(res, out)
    print(md.read_text())
    print(f"results: {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
