"""From memory to files, one difference at a time: the demo's comparison (issue 37).

The demo's clips (cmacc.apps.demo.DEMO: 512 clips, 32 classes, Zipf, groups of 4, noise 0.3),
its budget (500 steps, tiny preset, M = 16) and seeds, pretrained with one sampler (default
active: its unique/M is read against random's law, printed) at each step of the walk:

  memory     the in-memory clips as they are (``--data toy``: ToyAV, 8 x 32 x 32, no augmentation)
  lossless   the same clips written as files without loss (VP9 lossless RGB, 8 frames at 10 fps;
             the log-mel array as .mel.npy; pixel = 128 + 32 x value) read by the loader with
             augmentation off: what the container, 8-bit pixels and the loader's normalisation change
  rendered   the file law (data_dali.synthetic: a grating around mid-grey, noise on [0, 1]
             pixels, a real tone → log-mel) rendered at the prepared geometry (64 px short
             side, 10 fps, 2 s) and written without loss (VP9 lossless, log-mel of the float
             wave): what the file rendering, frame rate and clip length change
  prepared   the demo's files (H.264 + AAC → prepare: VP9 crf 32 at 64 px, 16 kHz FLAC,
             log-mel), augmentation off: what the codecs change
  +jitter, +crop, +flip, +gray   the prepared files with one training augmentation on
  all        all four: the demo as it runs (``make demo``)

Seed 0 of every step runs first, then seed 1, ...; each run's figures land in
OUT/<step>/seed<k>/ablation.json as it ends, and table.md is rewritten; a re-run skips the
finished ones (and resumes an unfinished run from its checkpoint). The table: mean ± 95%
interval over the seeds of the pretext accuracy (first and last quarter), unique/M (last
quarter), the linear probes (video, audio) and clips/s.

    python bench/filepath_ablation.py --out /work/runs/ablation [--steps 500 --seeds 3]
        [--steps-only memory lossless ...] [--sampler active|random] [--clips 512]
"""

from __future__ import annotations

import csv
import json
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cmacc.apps.analysis import DIVERSITY_SEEDS, DIVERSITY_STEPS, check_runs, pretrain  # noqa: E402
from cmacc.apps.demo import DEMO  # noqa: E402
from cmacc.config import PRESETS  # noqa: E402
from cmacc.data import synthetic_clips  # noqa: E402
from cmacc.metrics import expected_unique, format_interval, mean_ci  # noqa: E402
from data_dali import synthetic  # noqa: E402
from data_dali.audio import SR, log_mel  # noqa: E402
from data_dali.augment import AUGMENTS  # noqa: E402
from data_dali.cli import ArgumentParser, command, output_folder, setup_logging  # noqa: E402
from data_dali.fileio import atomic_path, atomic_write_text  # noqa: E402
from data_dali.manifest import FIELDS  # noqa: E402

STEPS = ("memory", "lossless", "rendered", "prepared", *(f"+{a}" for a in AUGMENTS), "all")
FPS, SECONDS, SHORT_SIDE = 10, 2.0, 64  # the demo's prepared clips
COLUMNS = ("acc_first", "acc_last", "unique_last", "probe_video", "probe_audio", "clips_per_s")


def write_lossless_video(path: Path, frames: np.ndarray, fps: int = FPS) -> None:
    """[T, H, W, 3] uint8 as VP9 lossless RGB (gbrp) WebM: every loader reads it back exactly."""
    import av

    with atomic_path(path) as tmp, av.open(str(tmp), "w", format="webm") as out:
        vs = out.add_stream("libvpx-vp9", rate=Fraction(fps))
        vs.width, vs.height, vs.pix_fmt = frames.shape[2], frames.shape[1], "gbrp"
        vs.options = {"lossless": "1", "deadline": "realtime", "cpu-used": "8", "threads": "1",
                      "g": str(fps)}
        for f in frames:
            for pkt in vs.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                out.mux(pkt)
        for pkt in vs.encode():
            out.mux(pkt)


def write_manifest(out: Path, clips) -> str:
    """A prepared dataset (clips/NNNNN.webm + .mel.npy, manifest.csv) of ``clips``: (frames
    [T, H, W, 3] uint8, log-mel [80, L], label, test split?); existing clips are kept."""
    (out / "clips").mkdir(parents=True, exist_ok=True)
    rows = []
    for k, (frames, mel, label, test) in enumerate(clips):
        video, melf = f"clips/{k:05d}.webm", f"clips/{k:05d}.mel.npy"
        if not (out / video).exists():
            with atomic_path(out / melf) as tmp, open(tmp, "wb") as f:
                np.save(f, mel.astype(np.float32))
            write_lossless_video(out / video, frames)
        t, h, w = frames.shape[:3]
        rows.append(dict(id=k, video=video, audio="", mel=melf, label=label,
                         class_name=f"class{label:02d}", split1="test" if test else "train",
                         duration=t / FPS, frames=t, fps=float(FPS), width=w, height=h,
                         audio_present=1, silent=0, source=video))
    with atomic_path(out / "manifest.csv") as tmp, open(tmp, "w", newline="") as f:
        wr = csv.DictWriter(f, FIELDS, extrasaction="ignore")
        wr.writeheader()
        wr.writerows(rows)
    return str(out / "manifest.csv")


def lossless_data(out: Path, clips: int, seed: int) -> str:
    """The in-memory clips of seed ``seed`` (what ``--data toy`` trains on) written without loss."""
    cfg = PRESETS["tiny"].replace(data=dict(clips=clips, **toy_data()))
    toy = synthetic_clips(cfg.data, seed)
    pix = (128 + 32 * toy.video).round().clamp(0, 255).byte().permute(0, 2, 3, 4, 1).numpy()
    return write_manifest(out, ((pix[j], toy.audio[j].numpy(), int(toy.labels[j]),
                                 bool(synthetic.held_out(toy.instance[j]))) for j in range(len(toy))))


def rendered_data(out: Path, clips: int) -> str:
    """The file law's clips (seed 0, as the demo writes them) at the prepared geometry and rate,
    without loss: frames from ``synthetic._frames``, log-mel of the float wave."""
    w = int(round(96 * SHORT_SIDE / 72 / 2)) * 2  # the demo's 96 x 72 with the prepared short side
    per_class = max(1, clips // DEMO["classes"])

    def gen():
        for c, i, inst, rng in synthetic.file_clips(DEMO["classes"], per_class, DEMO["redundancy"],
                                                    0, DEMO["class_dist"]):
            frames = synthetic._frames(c, DEMO["classes"], inst, int(SECONDS * FPS), FPS, w,
                                       SHORT_SIDE, DEMO["noise"], rng)
            wave = synthetic._sound(c, DEMO["classes"], inst, SECONDS, SR, DEMO["noise"], rng)
            yield frames, log_mel(wave), c, synthetic.held_out(i)

    return write_manifest(out, gen())


def prepared_data(out: Path, clips: int) -> str:
    """The demo's files: synthetic MP4s (H.264 + AAC) through ``data_dali.prepare``."""
    from data_dali import prepare as prep

    demo = dict(DEMO, per_class=max(1, clips // DEMO["classes"]))
    src = synthetic.write_dataset(out / "source", seconds=SECONDS, **demo)
    return prep.prepare(src, out / "data", layout="list", list_file=src / "list.csv",
                        progress=False, cfg=prep.PrepareConfig(short_side=SHORT_SIDE,
                                                               min_seconds=1.0))["manifest"]


def toy_data() -> dict:
    return {k: v for k, v in DEMO.items() if k != "per_class"}


def step_runs(out: Path, steps, seeds: int, clips: int) -> dict:
    """(step, seed) → (data source, config sections); writes the datasets the steps need."""
    runs, prepared = {}, None
    for k in range(seeds):  # seed-major: a whole walk with seed 0 comes first
        for step in steps:
            sections = {"model": {"seed": k}}
            if step == "memory":
                data, sections["data"] = "synthetic", dict(clips=clips, **toy_data())
            elif step == "lossless":
                data, sections["data"] = lossless_data(out / "data" / f"lossless_seed{k}", clips, k), \
                    {"augment": ()}
            elif step == "rendered":
                data, sections["data"] = rendered_data(out / "data" / "rendered", clips), {"augment": ()}
            else:
                prepared = prepared or prepared_data(out / "data" / "prepared", clips)
                on = AUGMENTS if step == "all" else (step[1:],) if step.startswith("+") else ()
                data, sections["data"] = prepared, {"augment": on}
            runs[step, k] = (data, sections)
    return runs


def summarise(rows: list[dict]) -> dict:
    """Mean and 95% half-width over the seeds of each column."""
    return {c: mean_ci([r[c] for r in rows]) for c in COLUMNS}


def table(results: dict) -> str:
    lines = ["| step | seeds | pretext acc first ¼ | pretext acc last ¼ | unique/M last ¼ | "
             "probe video | probe audio | clips/s |", "|---|---|---|---|---|---|---|---|"]
    for step, rows in results.items():
        s = summarise(rows)
        lines.append(f"| {step} | {len(rows)} | " + " | ".join(
            format_interval(*s[c]) if c != "clips_per_s" else f"{s[c][0]:.0f}" for c in COLUMNS) + " |")
    return "\n".join(lines)


@command
def main(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="folder of the runs, the data and table.md")
    p.add_argument("--steps", type=int, default=DIVERSITY_STEPS, help=f"pretraining steps per run "
                   f"(default {DIVERSITY_STEPS}, the demo's)")
    p.add_argument("--seeds", type=int, default=DIVERSITY_SEEDS,
                   help=f"seeds 0..N-1 per step (default {DIVERSITY_SEEDS})")
    p.add_argument("--clips", type=int, default=DEMO["classes"] * DEMO["per_class"],
                   help="clips (default the demo's 512)")
    p.add_argument("--sampler", default="active", choices=("active", "random"))
    p.add_argument("--only", nargs="+", choices=STEPS, default=list(STEPS), metavar="STEP",
                   help=f"the steps to run, in the order given, of {', '.join(STEPS)} (default "
                        "all, in that order); each step's seed 0 runs before any seed 1")
    args = p.parse_args(argv)
    for name in ("steps", "seeds", "clips"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.clips < DEMO["classes"]:
        p.error(f"--clips must be >= {DEMO['classes']} (one per class), got {args.clips}")
    setup_logging()
    out = output_folder(args.out, "--out")
    steps = list(dict.fromkeys(args.only))  # in the order given
    runs = step_runs(out, steps, args.seeds, args.clips)
    for data in {d for d, _ in runs.values()}:  # every config and dataset, before any run
        check_runs({out / s / f"seed{k}": (args.sampler, o) for (s, k), (d, o) in runs.items()
                    if d == data}, args.steps, data)
    results = {}
    for (step, k), (data, sections) in runs.items():
        run = out / step / f"seed{k}"
        done = run / "ablation.json"
        if not done.is_file():
            print(f"\n=== {step}, seed {k}: {args.steps} steps ===", flush=True)
            s = pretrain(run, args.sampler, args.steps, data=data, sections=sections)
            s["unique_last"] = s["unique_per_m_last"]  # the summary's: NaN rows skipped
            atomic_write_text(done, json.dumps({c: s[c] for c in COLUMNS}))
        results.setdefault(step, []).append(json.loads(done.read_text()))
        atomic_write_text(out / "table.md", table(results) + "\n")
    m = PRESETS["tiny"].model.batch_size
    law = expected_unique(synthetic.class_counts(DEMO["class_dist"], args.clips, DEMO["classes"]), m) / m
    print(f"\nsampler {args.sampler}, {args.steps} steps, seeds 0..{args.seeds - 1}, {args.clips} "
          f"clips; random sampling's expected unique/M: {law:.3f}\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
