"""The demo (``make demo``): on CPU, in a few minutes —

  1. write synthetic audio-visual MP4s (H.264 + AAC; data_dali.synthetic),
  2. prepare them (VP9 + 16 kHz FLAC + log-mel + manifest; data_dali.prepare),
  3. pretrain XMoCo (random negatives) and CM-ACC (active negatives) under the same budget,
     2 seeds each (``--seeds``), reading the prepared files through the data loaders (DALI
     CPU operators when available),
  4. linear-probe both encoders of both runs (and of the untrained network) on held-out clips,
  5. print a comparison table and write the curves (OUT/curves.png).

The clips (``DEMO``) are a setting where the diversity of the negatives can differ: C = 32
classes for M = 16 negatives per step, Zipf-distributed (class c has a share ∝ 1 / (c + 1)),
groups of 4 near-duplicate instances — random sampling's expected unique/M is printed beside the
table, and the diversity figure is the mean unique/M over the second half of training, per
seed, with active − random per seed and whether its sign holds in every seed. Honest
numbers, whatever they show. Pretraining sees every clip without labels; the probe is fit on
the train split and scored on the test split.

    python -m cmacc.apps.demo --out runs/demo [--steps 300] [--seeds 2] [--data toy]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from cmacc.metrics import expected_unique
from cmacc.model import CMACC
from cmacc.runlog import plot_metrics, read_csv
from data_dali.cli import ArgumentParser, command, output_folder, setup_logging
from data_dali.synthetic import class_counts

from . import positive_int
from .analysis import check_runs, pretrain
from .eval import evaluate, load_pretrained


# the demo's clips: 32 classes x 8 clips on average, Zipf-distributed, near-duplicate groups of 4
DEMO = dict(classes=32, per_class=8, class_dist="zipf:1", redundancy=0.75, noise=0.3)


def prepare_demo_data(out: Path) -> str:
    from data_dali import prepare as prep
    from data_dali import synthetic

    src = synthetic.write_dataset(out / "source", seconds=2.0, **DEMO)
    summary = prep.prepare(src, out / "data", layout="list", list_file=src / "list.csv",
                           cfg=prep.PrepareConfig(short_side=64, min_seconds=1.0))
    print(f"prepared {summary['kept']} clips ({summary['rejected']} rejected) → "
          f"{summary['manifest']}", flush=True)
    return summary["manifest"]


def second_half_unique(metrics_csv, steps: int) -> float:
    """Mean unique/M of the negatives over the logged rows of the second half of training
    (step > steps / 2): the demo's diversity figure (a last row alone is one noisy sample)."""
    vals = [float(r["unique_per_m"]) for r in read_csv(metrics_csv)
            if int(r["step"]) > steps / 2 and r["unique_per_m"] not in ("", "nan")]
    if not vals:
        raise ValueError(f"{metrics_csv}: no unique_per_m rows in the second half of training")
    return sum(vals) / len(vals)


def run_dir(out: Path, name: str, seed: int) -> Path:
    """OUT/xmoco, OUT/cmacc for seed 0 (what the README's export command reads); OUT/<name>_seed<k>."""
    return out / (name if seed == 0 else f"{name}_seed{seed}")


@command
def main(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--steps", type=positive_int, default=300)
    p.add_argument("--seeds", type=positive_int, default=2,
                   help="pretraining seeds per method (0..N-1); the diversity figure is the mean "
                        "over them, each seed shown")
    p.add_argument("--data", choices=("files", "toy"), default="files",
                   help="files: synthetic MP4s through prepare + loaders (default); toy: in-memory clips")
    args = p.parse_args(argv)
    setup_logging()
    out = output_folder(args.out, "--out")
    data = prepare_demo_data(out) if args.data == "files" else "synthetic"
    n_clips = DEMO["classes"] * DEMO["per_class"]
    extra = {}
    if args.data == "toy":  # the same clip counts, rendered in memory
        extra = dict(data=dict(clips=n_clips, **{k: v for k, v in DEMO.items() if k != "per_class"}))
    methods = {"XMoCo (random)": ("random", "xmoco"), "CM-ACC (active)": ("active", "cmacc")}
    runs = {(label, k): (sampler, run_dir(out, name, k), {**extra, "model": {"seed": k}})
            for label, (sampler, name) in methods.items() for k in range(args.seeds)}
    check_runs({d: (s, over) for s, d, over in runs.values()}, args.steps, data)  # before pretraining
    summaries = {}
    for (label, k), (sampler, d, over) in runs.items():
        print(f"\n=== {label}, seed {k}: {args.steps} steps ===", flush=True)
        summaries[label, k] = pretrain(d, sampler, args.steps, data=data, sections=over)
        summaries[label, k]["unique_2nd_half"] = second_half_unique(d / "metrics.csv", args.steps)
    # the floor: the same encoders, untrained
    model, state = load_pretrained(out / "xmoco")
    torch.manual_seed(model.cfg.seed)
    fresh = CMACC(model.cfg, model.sel)
    floor = {m: evaluate(fresh, state, data, modality=m, protocol="linear")["top1_mean"]
             for m in ("video", "audio")}
    png = plot_metrics({label: str(run_dir(out, name, 0) / "metrics.csv")
                        for label, (_, name) in methods.items()}, out / "curves.png")
    print("\n| method | seed | loss first → last | pretext acc first → last | negatives unique/M: "
          "last row, mean of the 2nd half | linear probe video / audio | clips/s |")
    print("|---|---|---|---|---|---|---|")
    for (label, k), s in summaries.items():
        print(f"| {label} | {k} | {s['loss_first']:.3f} → {s['loss_last']:.3f} | "
              f"{s['acc_first']:.3f} → {s['acc_last']:.3f} | {s['unique_per_m_last']:.3f}, "
              f"{s['unique_2nd_half']:.3f} | "
              f"{s['probe_video']:.3f} / {s['probe_audio']:.3f} | {s['clips_per_s']:.0f} |")
    print(f"| no pretraining (random init) | | | | | {floor['video']:.3f} / {floor['audio']:.3f} | |")
    m = model.cfg.batch_size
    law = expected_unique(class_counts(DEMO["class_dist"], n_clips, DEMO["classes"]), m) / m
    print(f"\nrandom sampling's expected unique/M for these {n_clips} clips ({DEMO['classes']} "
          f"classes, {DEMO['class_dist']}; M = {m}): {law:.3f}")
    rl, al = list(methods)
    diff = [summaries[al, k]["unique_2nd_half"] - summaries[rl, k]["unique_2nd_half"]
            for k in range(args.seeds)]
    mean = sum(diff) / len(diff)
    verdict = ("higher in every seed" if min(diff) > 0 else "lower in every seed" if max(diff) < 0
               else "not the same sign in every seed: no difference is seen at this budget")
    print(f"active − random, unique/M over the 2nd half of training: {mean:+.3f} (per seed: "
          + ", ".join(f"{d:+.3f}" for d in diff) + f"); active is {verdict}")
    print(f"\ncurves: {png}\nruns: " + ", ".join(str(d) for _, d, _ in runs.values())
          + " (re-running resumes/finishes them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
