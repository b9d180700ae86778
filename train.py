"""CM-ACC pretraining: cross-modal active contrastive coding of audio-visual video.
Installed as the command ``cmacc-train`` (= ``python train.py``; torchrun runs ``train.py``).

One process (CPU, seconds, on the built-in synthetic clips):
    python train.py --preset tiny --steps 200 --out runs/tiny

Ablations are flags (paper Tables 1-3):
    --sampler random                XMoCo            --sampler active          CM-ACC
    --sampler active-feature        feature space    --sampler ohem            OHEM
    --objective smoco               unimodal SMoCo   --no-fcl                  w/o fcl
    --grad-view queries             BADGE's view     --pool-mode epoch         paper's pools
    --sampler pool-random           control: the pool's keys, uniform picks (no selection)

One GPU / one node with 8 GPUs / several nodes (same flags on every node):
    python train.py --preset paper --data DATA/manifest.csv --device cuda --out runs/x
    torchrun --nproc_per_node=8 train.py --preset paper --data DATA/manifest.csv --device cuda
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=2:4 --nproc_per_node=8 \\
        --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 --rdzv_id=cmacc --max-restarts 3 \\
        train.py --preset paper --data DATA/manifest.csv --device cuda

--batch-size is the GLOBAL mini-batch M (split over all ranks); --resume auto continues from
the newest valid checkpoint in --out, also on another number of ranks that divides M (a lost
node, a bigger allocation: docs/RELIABILITY.md). Metrics go to OUT/metrics.csv (plot:
OUT/metrics.png).
Every flag sets one field of the typed config (cmacc/config.py); the loop is cmacc.trainer.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path

import torch

from cmacc.config import (AMPS, DICT_INITS, DIST_BACKENDS, GRAD_VIEWS, KMEANS_VARIANTS, LOADERS,
                          OBJECTIVES,
                          POOL_MODES, PRESETS, SAMPLERS, SELECT_FACTORS, SELECT_IMPLS,
                          SELECT_PRECISIONS)
from cmacc.encoders import VIDEO_ARCHS
from data_dali.augment import AUGMENTS
from cmacc.trainer import NonFiniteLoss, Trainer
from data_dali.cli import (ArgumentParser, Interrupted, UserError, command, say_line,
                           setup_logging)

# flag → config field ("section.field"), argparse options; one --help group per block
FLAGS = {
    "run": [
        ("--data", "data.source", dict(help="'synthetic' (built-in clips) or a prepared manifest.csv (python -m data_dali.prepare)")),
        ("--steps", "run.steps", dict(type=int, help="training iterations (global batches)")),
        ("--out", "run.out", dict(help="output folder: checkpoints, metrics.csv, plots (default runs/<preset>)")),
        ("--resume", "run.resume", dict(help="'auto' (newest valid checkpoint in --out, the default), 'none', or a path")),
        ("--device", "run.device", dict(choices=("cpu", "cuda"), help="default: cuda if available")),
        ("--seed", "model.seed", dict(type=int)),
        ("--loader", "data.loader", dict(choices=LOADERS, help="manifest loader: DALI (GPU decode; CPU operators "
                                         "without a GPU), the PyAV reference, or auto = DALI when it works")),
        ("--workers", "data.workers", dict(type=int, help="loader worker processes (DALI: decoder threads)")),
        ("--max-bad-clips", "data.max_bad_clips", dict(type=int, help="damaged clips skipped, replaced and listed in "
                                                       "OUT/bad_clips*.csv before the run stops, counted over the whole run: every "
                                                       "rank, every attempt and resume, each clip once (default: 1%% of the clips, at least 10)")),
        ("--augment", "data.augment", dict(nargs="+", choices=AUGMENTS + ("none",), help=(
            "training augmentations of a manifest's clips: random resized crop, flip, grayscale, "
            "random start (default all: the paper's; none: centre clip and square, docs/DATA.md)"))),
        ("--crop-scale", "data.crop_scale", dict(type=float, help="smallest random-crop area, as a fraction of the frame")),
        ("--prefetch", "data.prefetch", dict(type=int, help="batches decoded ahead (default 2; memory is flat over an epoch)")),
        ("--log-every", "run.log_every", dict(type=int, help="log/metrics interval in steps")),
        ("--ckpt-every", "run.ckpt_every", dict(type=int, help="checkpoint interval in steps (0: only at the end)")),
        ("--keep", "run.keep", dict(type=int, help="checkpoints of this run kept in --out (default 3)")),
        ("--on-nonfinite", "run.on_nonfinite", dict(choices=("stop", "skip"), help="a NaN/Inf loss or gradient: "
                                                    "stop (default) or skip that step's update")),
        ("--max-nonfinite", "run.max_nonfinite", dict(type=int, help="with skip: stop after this many (default 10)")),
        ("--dist-timeout", "run.dist_timeout", dict(type=float, help="torchrun: seconds a collective waits for a rank that never "
                                                    "joins (a lost node) before the others fail and restart (default 300)")),
        ("--dist-backend", "run.dist_backend", dict(choices=DIST_BACKENDS, help=(
            "torchrun: the process group's backend (default auto: NCCL on CUDA, gloo on the CPU); "
            "gloo on CUDA lets ranks share a GPU, a test of the distributed paths (slow)"))),
        ("--tensorboard", "run.tensorboard", dict(action="store_const", const=True, help="also write OUT/tb")),
        ("--no-shuffle-bn", "run.shuffle_bn", dict(action="store_const", const=False, help="no shuffle-BN in the key encoders")),
        ("--dict-init", "run.dict_init", dict(choices=DICT_INITS, help="encode K random clips (paper) or random keys")),
    ],
    "method": [
        ("--objective", "model.objective", dict(choices=OBJECTIVES, help="cross (XMoCo/CM-ACC) or smoco (unimodal)")),
        ("--sampler", "selection.sampler", dict(choices=SAMPLERS, help="negatives enqueued each step (default active = CM-ACC)")),
        ("--grad-view", "selection.grad_view", dict(choices=GRAD_VIEWS, help="last-layer gradient view (default head)")),
        ("--pool-mode", "selection.pool_mode", dict(choices=POOL_MODES, help="rolling (default, free) or epoch (paper)")),
        ("--pool-size", "selection.pool_size", dict(type=int, help="candidate pool size N (paper 300*M)")),
        ("--pool-refresh", "selection.pool_refresh", dict(type=int, metavar="R", help=(
            "re-encode R batches of the pool per step by the current key encoders, round robin, "
            "so that no candidate is older than N / (R*M) steps (default 0: Algorithm 1, pool "
            "keys as old as the pool); costs R key-encoder batches a step, decoded on the host"))),
        ("--tau-p", "selection.tau_p", dict(type=float, help="pseudo-posterior temperature")),
        ("--select-precision", "selection.precision", dict(choices=SELECT_PRECISIONS, help="GPU selection: tl.dot precision of the gradient embedding")),
        ("--select-factors", "selection.factors", dict(choices=SELECT_FACTORS, help="GPU selection: storage of the embedding factors (bf16 halves k-means++ bytes)")),
        ("--kmeans", "selection.kmeans", dict(choices=KMEANS_VARIANTS, help="GPU k-means++: a launch per step (default) or one persistent launch")),
        ("--select-impl", "selection.impl", dict(choices=SELECT_IMPLS, help="GPU k-means++: auto (default: the variant measured fastest on this GPU for the pool's size, else eager), eager (every distance each step; --kmeans picks its form), lazy (the exponential race touches ~1-10 candidates a step) or resident (the factors held on chip by one cooperative launch; pools that do not fit run eager); the same picks; docs/GPU.md")),
        ("--no-select-overlap", "selection.overlap", dict(action="store_const", const=False, help="GPU: run the selection in line instead of on a side stream")),
        ("--fcl", "model.fcl", dict(action="store_const", const=True, help="cross-modal FC layer (default on)")),
        ("--no-fcl", "model.fcl", dict(action="store_const", const=False, help="ablation 'w/o fcl'")),
        ("--batch-size", "model.batch_size", dict(type=int, help="GLOBAL mini-batch M")),
        ("--dict-size", "model.dict_size", dict(type=int, help="dictionary size K (paper 30*M)")),
        ("--tau", "model.tau", dict(type=float, help="contrastive temperature")),
        ("--momentum", "model.momentum", dict(type=float, help="key-encoder momentum")),
        ("--video-arch", "model.video_arch", dict(choices=VIDEO_ARCHS)),
        ("--video-width", "model.video_width", dict(type=int)),
        ("--audio-width", "model.audio_width", dict(type=int)),
        ("--video-layers", "model.video_layers", dict(type=int, nargs="+", metavar="N", help=(
            "residual blocks per stage of the video ResNet: 2 2 2 2 with --video-width 64 is "
            "torchvision's r3d_18 / r2plus1d_18 at any --preset"))),
        ("--audio-layers", "model.audio_layers", dict(type=int, nargs="+", metavar="N",
                                                      help="residual blocks per stage of the audio ResNet")),
        ("--dim", "model.dim", dict(type=int, help="key dimension d")),
    ],
    "optimisation": [
        ("--lr", "optim.lr", dict(type=float)),
        ("--warmup", "optim.warmup", dict(type=int, help="linear warm-up iterations")),
        ("--amp", "optim.amp", dict(choices=AMPS, help="autocast dtype")),
        ("--no-channels-last", "optim.channels_last", dict(action="store_const", const=False, help="NCTHW video encoders")),
        ("--compile", "optim.compile", dict(action="store_const", const=True, help="torch.compile the backbones")),
        ("--no-cudnn-benchmark", "optim.cudnn_benchmark", dict(action="store_const", const=False, help=(
            "CUDA: use cuDNN's heuristic convolution algorithms instead of timing them once for "
            "the run's fixed shapes (the default, torch.backends.cudnn.benchmark)"))),
    ],
    "synthetic data": [
        ("--clips", "data.clips", dict(type=int, help="number of synthetic clips")),
        ("--classes", "data.classes", dict(type=int, help="number of synthetic classes")),
        ("--redundancy", "data.redundancy", dict(type=float, help="near-duplicate fraction in [0,1)")),
        ("--class-dist", "data.class_dist", dict(help="clips per class: 'uniform' or 'zipf:S' "
                                                 "(class c gets a share ∝ 1/(c+1)^S: a long tail)")),
        ("--noise", "data.noise", dict(type=float, help="pixel / mel noise level")),
    ],
}


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="base settings (default: tiny)")
    p.add_argument("--config", help="JSON file of flag values (long names); command-line flags win")
    for title, flags in FLAGS.items():
        g = p.add_argument_group(title)
        for flag, dest, kw in flags:
            g.add_argument(flag, dest=dest, default=None, **_with_defaults(dest, kw))
    return p


FIELD_FLAGS = {dest.split(".")[1]: flag for group in FLAGS.values() for flag, dest, kw in group
               if kw.get("action") != "store_const"}  # batch_size -> --batch-size, source -> --data


def in_flag_terms(message: str) -> str:
    """A config dataclass's message in the command line's words: the field it starts with, and
    every snake_case field in it, become their flags ("batch_size must be >= 1" -> "--batch-size
    must be >= 1"), unless the message names the flag already."""
    def flag(m):
        word = m.group(0)
        if (m.start() == 0 or "_" in word) and FIELD_FLAGS.get(word, "--") not in message:
            return FIELD_FLAGS.get(word, word)
        return word
    return re.sub(r"\b[a-z][a-z0-9_]*\b", flag, message)


def _with_defaults(dest: str, kw: dict) -> dict:
    """``kw`` with the presets' values of the field appended to its help ("tiny: 32, paper:
    128"), so --help never states a default that the preset in use does not have."""
    if (kw.get("action") == "store_const" or dest in ("run.out", "run.device", "run.resume")
            or "default" in kw.get("help", "")):  # says its default itself
        return kw
    section, name = dest.split(".")
    values = {preset: getattr(getattr(cfg, section), name) for preset, cfg in sorted(PRESETS.items())}
    shown = (f"default {next(iter(values.values()))}" if len(set(map(str, values.values()))) == 1
             else "default " + ", ".join(f"{k}: {v}" for k, v in values.items()))
    help_text = kw.get("help")
    return dict(kw, help=f"{help_text} ({shown})" if help_text else f"({shown})")


def config_from_args(args):
    """The preset with every flag that was given applied (re-validated by the dataclasses)."""
    sections: dict[str, dict] = {}
    for key, value in vars(args).items():
        if "." in key and value is not None:
            section, name = key.split(".")
            sections.setdefault(section, {})[name] = value
    run = sections.setdefault("run", {})
    run.setdefault("out", f"runs/{args.preset}")
    run.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
    return PRESETS[args.preset].replace(**sections)


def apply_config_file(parser, args, argv):
    """--config FILE (JSON of long flag names → values); flags given on the command line win."""
    try:
        values = json.loads(Path(args.config).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--config {args.config}: cannot read JSON ({e}); pass a JSON object of "
                        "long flag names, e.g. {\"steps\": 100}") from None
    if not isinstance(values, dict):
        raise UserError(f"--config {args.config}: expected a JSON object of long flag names, got "
                        f"{type(values).__name__}")
    dests = {opt.lstrip("-").replace("-", "_"): a.dest for a in parser._actions for opt in a.option_strings}
    bad = sorted(k for k in values if k.replace("-", "_") not in dests)
    if bad:
        raise UserError(f"--config {args.config}: unknown keys {bad}; use the long flag names of --help")
    parser.set_defaults(**{dests[k.replace("-", "_")]: v for k, v in values.items()})
    return parser.parse_args(argv)


WARMUP_REACH = 0.1  # a run must reach at least this share of --lr by its last step


def check_warmup(cfg, preset: str, *, given: bool) -> None:
    """A warm-up so much longer than the run that the learning rate would not reach a tenth of
    --lr by its end (``--preset paper --steps 4``: 0.8%) is refused in one line. The schedule is
    never rescaled behind the user's back: a run resumed with more --steps must train as if it
    had never stopped."""
    steps, warmup = cfg.run.steps, cfg.optim.warmup
    if not warmup or steps >= WARMUP_REACH * warmup:
        return
    whose = "" if given else f" (the {preset} preset's)"
    raise UserError(f"--warmup {warmup}{whose} is longer than the run (--steps {steps}): the "
                    f"learning rate would reach only {100 * steps / warmup:.1f}% of --lr "
                    f"{cfg.optim.lr:g} by its end; pass --warmup {steps} or fewer, or more --steps")


def say_unusable_gpu() -> None:
    """Without --device, a machine with an NVIDIA driver whose CUDA torch cannot use trains on
    the CPU: said in one line (what torch needs, what was found), not silently."""
    import shutil

    if torch.version.cuda is not None and shutil.which("nvidia-smi"):
        from cmacc.devices import cuda_needs

        logging.getLogger("cmacc").warning(
            "this machine has an NVIDIA driver but CUDA is not usable, so the run trains on the "
            "CPU: %s; install for your driver (README, Install), or pass --device cpu to say so",
            cuda_needs())


@command  # user errors: one line on stderr, exit 2 (--debug: the traceback)
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config:
        args = apply_config_file(parser, args, argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:  # a dataclass rejected a value: the message names the field
        raise UserError(in_flag_terms(str(e))) from None
    setup_logging(quiet=os.environ.get("RANK", "0") != "0")
    check_warmup(cfg, args.preset, given=getattr(args, "optim.warmup") is not None)
    if args.__dict__.get("run.device") is None and cfg.run.device == "cpu":
        say_unusable_gpu()
    try:
        summary = Trainer(cfg).run()
    except NonFiniteLoss as e:  # not the user's mistake, but no traceback either: exit 1
        sys.exit(1 if getattr(e, "said", False) else f"error: {e}")  # (said: by every rank)
    except Interrupted as e:  # saved on every rank: exit 0, so that torchrun does not restart
        say_line(f"interrupted; {e}")  # the workers and a scheduler sees a clean stop
        return 0
    if summary and summary.get("steps", 0) > cfg.run.steps:  # resumed past the asked end
        logging.getLogger("cmacc").warning(
            "the run in %s is already at step %d, past --steps %d: nothing was trained (its "
            "checkpoints are as they were); pass --steps above %d to train on", cfg.run.out,
            summary["steps"], cfg.run.steps, summary["steps"])
    if summary:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
