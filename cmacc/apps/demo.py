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
over the seeds. Honest numbers, whatever they show; the words under the verdict follow the
interval (``verdict_text``): above 0, active's negatives are more varied and nothing more is
said; below 0, they are less varied, and the demo says what the evidence beside it shows
(``below_lines``: these runs, the recorded runs of this command, the MI study's long-tailed
cell; evidence, not a cause); holding 0, its budget cannot show a difference, and why
(``why_not``: what its own runs learned, and what the walk from memory to files measured).

Which of the three a host prints is not fixed. ``make demo`` (files, the paper's augmentation)
on 2-core AMD EPYC hosts with AVX-512 and BF16 (``RECORDED_FILES_RUNS``): −0.059 ± 0.159 at
commit 3d05064 and −0.050 ± 0.123 at 132744b (both hold 0), −0.073 ± 0.031 in a later run
(per seed −0.083, −0.059, −0.078: below 0); 9 of those 9 seeds have active below random. The
same host with torch's and oneDNN's kernels held to AVX2 gave −0.040 ± 0.220 (per seed −0.032,
−0.133, +0.044: holds 0). The per-seed figures move with the floating-point path and the code
version, and the verdict's words with them. Pretraining sees every clip without labels; the
probe is fit on the train split and scored on the test split. The files are trained with the
paper's augmentation unless ``--augment`` / ``--crop-scale`` say otherwise; the setting is
printed.

    python -m cmacc.apps.demo --out runs/demo [--steps 500] [--seeds 3] [--data toy]
        [--augment crop flip gray jitter | none] [--crop-scale 0.3]
"""

from __future__ import annotations

import math
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


# ``make demo`` (files, the paper's augmentation, 3 seeds, 500 steps) as recorded on 2-core AMD
# EPYC hosts with AVX-512 and BF16 (docs/FIDELITY.md §5, docs/DEMO.md): which run, active −
# random's unique/M as printed (mean, 95% half-width) and per seed
RECORDED_FILES_RUNS = (("commit 3d05064", -0.059, 0.159, (-0.024, -0.133, -0.019)),
                       ("commit 132744b", -0.050, 0.123, (-0.002, -0.101, -0.047)),
                       ("a later run (issue 51)", -0.073, 0.031, (-0.083, -0.059, -0.078)))
# the MI study's long-tailed cell (docs/FIDELITY.md §8, cell d′ at l = 3): CM-ACC − uniform picks
# from the same pool, the enqueued characters' diversity
MI_LONG_TAIL = "l = 3, 3 seeds: unique/M -0.010 ± 0.002, coverage -0.030 ± 0.007"


def side(mean: float, half: float) -> str:
    """Where a 95% interval mean ± half lies: "above" 0, "below" 0, "holds" 0, or "none" (no
    interval: one value, half NaN)."""
    if not math.isfinite(half):
        return "none"
    return "above" if mean - half > 0 else "below" if mean + half < 0 else "holds"


def verdict_words(mean: float, half: float, per_seed) -> str:
    """The verdict line: active − random's mean, its 95% interval over the seeds and what that
    interval allows one to say, in words that follow its side of 0."""
    per = "per seed: " + ", ".join(f"{d:+.3f}" for d in per_seed)
    where = side(mean, half)
    if where == "none":
        return (f"{mean:+.3f} ({per}); one seed gives no interval: run --seeds 3 or more to "
                f"tell a difference from the spread between seeds")
    head = (f"{format_interval(mean, half, signed=True)} (95% interval over {len(per_seed)} "
            f"seeds; {per}); ")
    return head + {
        "above": "the interval excludes 0: active enqueues more varied negatives than random",
        "below": "the interval excludes 0: active enqueues less varied negatives than random",
        "holds": "the interval holds 0: this budget cannot show a difference between active "
                 "and random (more steps or seeds narrow it)"}[where]


def verdict(diffs: list[float]) -> str:
    """``verdict_words`` of active − random (one paired difference per seed)."""
    return verdict_words(*mean_ci(diffs), diffs)


def verdict_text(mean: float, half: float, per_seed, acc_last=(), data: str = "files",
                 augment: tuple = AUGMENTS, crop_scale: float = SCALE[0]) -> list[str]:
    """What the demo prints about active − random: the verdict line (``verdict_words``), then
    the lines that follow the interval's side of 0: none above it; below it, what the evidence
    shows (``below_lines``); holding it, or with no interval, why this run cannot show a
    difference (``why_not``)."""
    where = side(mean, half)
    lines = [verdict_words(mean, half, per_seed)]
    if where == "below":
        lines += below_lines(per_seed, acc_last, data, augment, crop_scale)
    elif where != "above":
        lines += _cannot_show(half, per_seed, acc_last, data, augment, crop_scale)
    return lines


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


def paper_files(data: str, augment: tuple, crop_scale: float) -> bool:
    """Whether the runs are the recorded ``make demo``'s setting: the files, the paper's
    augmentation."""
    return data == "files" and set(augment) == set(AUGMENTS) and crop_scale == SCALE[0]


def _where_it_shows(data: str) -> str:
    return ("--data toy (the same clips in memory, not augmented)"
            + ("; --augment none --seeds 5 (the files without augmentation: "
               "docs/FIDELITY.md §5 has what it gives)" if data == "files" else ""))


def below_lines(per_seed, acc_last, data: str, augment: tuple, crop_scale: float) -> list[str]:
    """What the evidence shows when active − random's interval lies below 0 (active's
    negatives less varied than random's): these runs' seeds and pretext accuracy, the recorded
    runs of the same command, the MI study's long-tailed cell, and where active is above
    random. What is seen, not a cause."""
    below = sum(d < 0 for d in per_seed)
    lines = ["what the evidence shows (what is seen, not a cause):",
             f"- these runs: active below random in {below} of {len(per_seed)} seeds"
             + (f"; pretext accuracy in the last quarter {min(acc_last):.3f}–{max(acc_last):.3f}"
                if acc_last else "")]
    if paper_files(data, augment, crop_scale):
        recorded = [d for *_, ds in RECORDED_FILES_RUNS for d in ds]
        runs = "; ".join(f"{where}: {format_interval(mean, half, signed=True)}"
                         for where, mean, half, _ in RECORDED_FILES_RUNS)
        lines.append(
            "- with the paper's augmentation through the files, active's negatives are less "
            "varied than random's: the recorded runs of this command on 2-core AMD EPYC hosts "
            f"(AVX-512, BF16) have active below random in {sum(d < 0 for d in recorded)} of "
            f"{len(recorded)} seeds ({runs}); whether the interval holds 0 or lies below it "
            "has varied with the host's floating-point path and the code's version")
    lines.append("- the MI study's long-tailed cell found the same: CM-ACC's negatives less "
                 f"varied than uniform picks from the same pool ({MI_LONG_TAIL}; "
                 "docs/FIDELITY.md §8)")
    lines.append("- where active is above random: " + _where_it_shows(data))
    return lines


def _cannot_show(half, per_seed, acc_last, data, augment, crop_scale) -> list[str]:
    lines = ["why this run cannot show it:",
             "- the active sampler spreads its picks over what the key encoders have learned"
             + (f"; these runs' pretext accuracy in the last quarter is {min(acc_last):.3f}–"
                f"{max(acc_last):.3f}" if acc_last else "")]
    if data == "files" and "crop" in augment and crop_scale < 0.5:
        lines.append(
            "- through the files, the training augmentation holds the encoders back, the random "
            f"resized crop above all: an area of {crop_scale:g} of a 64-pixel frame keeps little of a "
            "grating whose class is its orientation and frequency (measured one difference at a "
            "time: docs/FIDELITY.md §5, bench/filepath_ablation.py)")
    if len(per_seed) > 1:
        lines.append(f"- the seeds vary (per seed: {', '.join(f'{d:+.3f}' for d in per_seed)}): "
                     f"{len(per_seed)} seeds leave an interval of ±{half:.3f}")
    lines.append("- where it shows: " + _where_it_shows(data))
    return lines


def why_not(diffs: list[float], acc_last: list[float], data: str, augment: tuple,
            crop_scale: float) -> list[str]:
    """Why a demo whose interval holds 0 (or that has no interval: one seed) could not show a
    difference: from its own runs (the pretext accuracy they reached, the spread of the seeds)
    and the walk from memory to files (docs/FIDELITY.md §5); [] when the interval excludes 0,
    either way (below 0: ``below_lines``)."""
    mean, half = mean_ci(diffs)
    if side(mean, half) in ("above", "below"):
        return []
    return _cannot_show(half, diffs, acc_last, data, augment, crop_scale)


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
    first, *lines = verdict_text(*mean_ci(diff), diff,
                                 [s["acc_last"] for s in summaries.values()], args.data,
                                 augment, crop_scale)
    print("active − random, unique/M over the last quarter of training: " + first)
    print(setting)
    for line in lines:
        print(line)
    print(f"\ncurves: {png}\nruns: " + ", ".join(str(d) for _, d, _ in runs.values())
          + " (re-running resumes/finishes them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
