"""The demo (``make demo``): on CPU, in minutes —

  1. write synthetic audio-visual MP4s (H.264 + AAC; data_dali.synthetic),
  2. prepare them (VP9 + 16 kHz FLAC + log-mel + manifest; data_dali.prepare),
  3. pretrain XMoCo (random negatives) and CM-ACC (active negatives) under the same budget,
     3 seeds each (``--seeds``), reading the prepared files through the data loaders (DALI
     CPU operators when available),
  4. linear-probe both encoders of every run (and of the untrained network) on held-out clips,
  5. print a comparison table, active − random with its 95% interval over the seeds and what
     that interval allows one to say, and write the curves (OUT/curves.png).

The clips and the budget are the diversity analysis's setting (``cmacc.apps.analysis``:
``DIVERSITY_DATA``, 500 steps, 3 seeds), where the diversity of the negatives can differ and
the key encoder has time to learn: C = 32 classes for M = 16 negatives per step, 512 clips,
Zipf-distributed (class c has a share ∝ 1 / (c + 1)), groups of 4 near-duplicate instances.
Random sampling's expected unique/M is printed beside the table; the diversity figure of a run
is its mean unique/M over the last quarter of its logged rows that have one (its summary.json's
``unique_per_m_last``, the analysis's "last" window);
active − random is paired by seed (same seed: same initial weights), with a 95% t-interval
over the seeds. Honest numbers, whatever they show: when the interval holds 0 the demo says
its budget cannot show a difference, and why (``why_not``: what its own runs learned, and what
the walk from memory to files measured). Pretraining sees every clip without labels; the probe
is fit on the train split and scored on the test split. The files are trained with the paper's
augmentation unless ``--augment`` / ``--crop-scale`` say otherwise; the setting is printed.

    python -m cmacc.apps.demo --out runs/demo [--steps 500] [--seeds 3] [--data toy]
        [--augment crop flip gray jitter | none] [--crop-scale 0.3]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from cmacc.metrics import expected_unique, format_interval, mean_ci
from cmacc.model import CMACC
from cmacc.runlog import plot_metrics
from data_dali.augment import AUGMENTS, SCALE, augment_names
from data_dali.cli import ArgumentParser, command, output_folder, setup_logging
from data_dali.synthetic import class_counts

from . import positive_int
from .analysis import DIVERSITY_DATA, DIVERSITY_SEEDS, DIVERSITY_STEPS, check_runs, pretrain
from .eval import evaluate, load_pretrained


# the demo's clips: the diversity analysis's (32 classes x 16 clips on average, Zipf-distributed,
# near-duplicate groups of 4, noise 0.3), written as files
DEMO = dict(classes=DIVERSITY_DATA["classes"],
            per_class=DIVERSITY_DATA["clips"] // DIVERSITY_DATA["classes"],
            **{k: DIVERSITY_DATA[k] for k in ("class_dist", "redundancy", "noise")})


def prepare_demo_data(out: Path) -> str:
    from data_dali import prepare as prep
    from data_dali import synthetic

    src = synthetic.write_dataset(out / "source", seconds=2.0, **DEMO)
    summary = prep.prepare(src, out / "data", layout="list", list_file=src / "list.csv",
                           cfg=prep.PrepareConfig(short_side=64, min_seconds=1.0))
    print(f"prepared {summary['kept']} clips ({summary['rejected']} rejected) → "
          f"{summary['manifest']}", flush=True)
    return summary["manifest"]


def verdict(diffs: list[float]) -> str:
    """What active − random (one paired difference per seed) allows one to say: the mean, the
    95% t-interval over the seeds, and whether that interval excludes 0."""
    mean, half = mean_ci(diffs)
    per = "per seed: " + ", ".join(f"{d:+.3f}" for d in diffs)
    if len(diffs) < 2:
        return (f"{mean:+.3f} ({per}); one seed gives no interval: run --seeds 3 or more to "
                f"tell a difference from the spread between seeds")
    head = f"{format_interval(mean, half, signed=True)} (95% interval over {len(diffs)} seeds; {per}); "
    if mean - half > 0:
        return head + "the interval excludes 0: active enqueues more varied negatives than random"
    if mean + half < 0:
        return head + "the interval excludes 0: active enqueues less varied negatives than random"
    return head + ("the interval holds 0: this budget cannot show a difference between active "
                   "and random (more steps or seeds narrow it)")


AUGMENT_LABELS = {"crop": "random resized crop", "flip": "horizontal flip",
                  "gray": "grayscale", "jitter": "random clip start"}


def augmentation_line(data: str, augment: tuple, crop_scale: float) -> str:
    """The training augmentation the runs use, in words, and whether it is the paper's."""
    if data == "toy":
        return "augmentation: none (the in-memory clips are not augmented)"
    if not augment:
        return ("augmentation: none (centre crop, no flip, no grayscale, the clip's start; the "
                "paper's is all four: --augment crop flip gray jitter)")
    words = [f"{AUGMENT_LABELS[a]} (area {crop_scale:g}–1)" if a == "crop" else AUGMENT_LABELS[a]
             for a in augment]
    paper = set(augment) == set(AUGMENTS) and crop_scale == SCALE[0]
    return "augmentation: " + ", ".join(words) + (
        " (the paper's)" if paper else f" (the paper's: all four, crop area {SCALE[0]:g}–1)")


def why_not(diffs: list[float], acc_last: list[float], data: str, augment: tuple,
            crop_scale: float) -> list[str]:
    """Why a demo whose interval does not show active above random could not: the lines it
    prints under its verdict, from its own runs (the pretext accuracy they reached, the spread
    of the seeds) and the walk from memory to files (docs/FIDELITY.md §5); [] when the
    interval excludes 0 upwards (the mechanism showed)."""
    mean, half = mean_ci(diffs)
    if len(diffs) > 1 and mean - half > 0:
        return []
    lines = ["why this run cannot show it:",
             "- the active sampler spreads its picks over what the key encoders have learned; these "
             f"runs' pretext accuracy in the last quarter is {min(acc_last):.3f}–{max(acc_last):.3f}"]
    if data == "files" and "crop" in augment and crop_scale < 0.5:
        lines.append(
            "- through the files, the training augmentation holds the encoders back, the random "
            f"resized crop above all: an area of {crop_scale:g} of a 64-pixel frame keeps little of a "
            "grating whose class is its orientation and frequency (measured one difference at a "
            "time: docs/FIDELITY.md §5, bench/filepath_ablation.py)")
    if len(diffs) > 1:
        lines.append(f"- the seeds vary (per seed: {', '.join(f'{d:+.3f}' for d in diffs)}): "
                     f"{len(diffs)} seeds leave an interval of ±{half:.3f}")
    lines.append("- where it shows: --data toy (the same clips in memory, not augmented)"
                 + ("; --augment none --seeds 5 (the files without augmentation: "
                    "docs/FIDELITY.md §5 has what it gives)" if data == "files" else ""))
    return lines


def run_dir(out: Path, name: str, seed: int) -> Path:
    """OUT/xmoco, OUT/cmacc for seed 0 (what the README's export command reads); OUT/<name>_seed<k>."""
    return out / (name if seed == 0 else f"{name}_seed{seed}")


@command
def main(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument("--out", default="runs/demo",
                   help="the demo's folder: data, runs, curves (default runs/demo)")
    p.add_argument("--steps", type=positive_int, default=DIVERSITY_STEPS,
                   help=f"pretraining steps per run (default {DIVERSITY_STEPS})")
    p.add_argument("--seeds", type=positive_int, default=DIVERSITY_SEEDS,
                   help=f"pretraining seeds per method, 0..N-1 (default {DIVERSITY_SEEDS}); "
                        "active - random is paired by seed, with a 95%% interval over them")
    p.add_argument("--data", choices=("files", "toy"), default="files",
                   help="files: synthetic MP4s through prepare + loaders (default); toy: in-memory clips")
    p.add_argument("--augment", nargs="+", choices=AUGMENTS + ("none",), default=None,
                   help="training augmentations of the files (default all four: the paper's; none: "
                        "centre crop, no flip, no grayscale, the clip's start)")
    p.add_argument("--crop-scale", type=float, default=None,
                   help=f"smallest random-crop area, as a fraction of the frame (default {SCALE[0]:g}, "
                        "the paper's)")
    args = p.parse_args(argv)
    if args.data == "toy" and (args.augment is not None or args.crop_scale is not None):
        p.error("--augment and --crop-scale apply to the files (--data files); the in-memory "
                "clips (--data toy) are not augmented")
    try:
        augment = AUGMENTS if args.augment is None else augment_names(args.augment)
    except ValueError as e:
        p.error(f"--{e}")
    crop_scale = SCALE[0] if args.crop_scale is None else args.crop_scale
    if not 0 < crop_scale <= 1:
        p.error(f"--crop-scale must be in (0, 1], got {crop_scale:g}")
    setup_logging()
    out = output_folder(args.out, "--out")
    setting = augmentation_line(args.data, augment, crop_scale)
    print(setting, flush=True)
    data = prepare_demo_data(out) if args.data == "files" else "synthetic"
    n_clips = DEMO["classes"] * DEMO["per_class"]
    extra = {}
    if args.data == "toy":  # the same clip counts, rendered in memory
        extra = dict(data=dict(clips=n_clips, **{k: v for k, v in DEMO.items() if k != "per_class"}))
    elif args.augment is not None or args.crop_scale is not None:  # the default: the config's own
        extra = dict(data=dict(augment=augment, crop_scale=crop_scale))
    methods = {"XMoCo (random)": ("random", "xmoco"), "CM-ACC (active)": ("active", "cmacc")}
    runs = {(label, k): (sampler, run_dir(out, name, k), {**extra, "model": {"seed": k}})
            for label, (sampler, name) in methods.items() for k in range(args.seeds)}
    check_runs({d: (s, over) for s, d, over in runs.values()}, args.steps, data)  # before pretraining
    summaries = {}
    for (label, k), (sampler, d, over) in runs.items():
        print(f"\n=== {label}, seed {k}: {args.steps} steps ===", flush=True)
        summaries[label, k] = pretrain(d, sampler, args.steps, data=data, sections=over)
    # the floor: the same encoders, untrained
    model, state = load_pretrained(out / "xmoco")
    torch.manual_seed(model.cfg.seed)
    fresh = CMACC(model.cfg, model.sel)
    floor = {m: evaluate(fresh, state, data, modality=m, protocol="linear")["top1_mean"]
             for m in ("video", "audio")}
    png = plot_metrics({label: str(run_dir(out, name, 0) / "metrics.csv")
                        for label, (_, name) in methods.items()}, out / "curves.png")
    print("\n| method | seed | loss: first → last quarter | pretext acc: first → last quarter | "
          "negatives unique/M: last quarter | linear probe video / audio | clips/s |")
    print("|---|---|---|---|---|---|---|")
    for (label, k), s in summaries.items():
        print(f"| {label} | {k} | {s['loss_first']:.3f} → {s['loss_last']:.3f} | "
              f"{s['acc_first']:.3f} → {s['acc_last']:.3f} | {s['unique_per_m_last']:.3f} | "
              f"{s['probe_video']:.3f} / {s['probe_audio']:.3f} | {s['clips_per_s']:.0f} |")
    print(f"| no pretraining (random init) | | | | | {floor['video']:.3f} / {floor['audio']:.3f} | |")
    m = model.cfg.batch_size
    law = expected_unique(class_counts(DEMO["class_dist"], n_clips, DEMO["classes"]), m) / m
    print(f"\nrandom sampling's expected unique/M for these {n_clips} clips ({DEMO['classes']} "
          f"classes, {DEMO['class_dist']}; M = {m}): {law:.3f}")
    rl, al = list(methods)
    diff = [summaries[al, k]["unique_per_m_last"] - summaries[rl, k]["unique_per_m_last"]
            for k in range(args.seeds)]
    print("active − random, unique/M over the last quarter of training: " + verdict(diff))
    print(setting)
    for line in why_not(diff, [s["acc_last"] for s in summaries.values()], args.data, augment,
                        crop_scale):
        print(line)
    print(f"\ncurves: {png}\nruns: " + ", ".join(str(d) for _, d, _ in runs.values())
          + " (re-running resumes/finishes them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
