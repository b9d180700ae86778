"""The paper's analyses as commands that write PNG plots and a Markdown report.

    python -m cmacc.apps.analysis diversity --out runs/analysis [--steps 120]   # Fig. 3
    python -m cmacc.apps.analysis dictsize  --out runs/analysis [--sizes 32 64 128]
    python -m cmacc.apps.analysis gallery   runs/analysis/active --out runs/analysis
    python -m cmacc.apps.analysis perclass  runs/analysis/active --out runs/analysis
    python -m cmacc.apps.analysis all       --out runs/analysis    # everything + report.md

The training runs use the tiny preset on the built-in synthetic clips (CPU); pass
``--data MANIFEST`` to pretrain on a prepared dataset instead. Finished runs are resumed, not
redone. Everything a command needs (output folder, run configs, the data's evaluation splits
for both encoders, the run to analyse) is checked before the first run starts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from cmacc.config import PRESETS, Config
from cmacc.data import synthetic_clips
from cmacc.runlog import plot_metrics, save_figure
from cmacc.trainer import Trainer
from data_dali.cli import ArgumentParser, UserError, command, output_folder, setup_logging
from data_dali.fileio import atomic_write_text

from . import positive_int
from .eval import eval_data, evaluate, load_pretrained, write_results

SAMPLER_LABELS = {"random": "random (XMoCo)", "active": "active, gradient (CM-ACC)",
                  "active-feature": "active, feature", "ohem": "OHEM"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run_config(run_dir, sampler, steps, *, data="synthetic", sections=None) -> Config:
    """The tiny-preset config of one analysis run. ``sections``: further config overrides per
    section, e.g. ``{"model": {"dict_size": 32}, "data": {"redundancy": 0.5}}``."""
    over = {k: dict(v) for k, v in (sections or {}).items()}
    over.setdefault("selection", {})["sampler"] = sampler
    over.setdefault("data", {})["source"] = data
    over.setdefault("run", {}).update(steps=steps, out=str(run_dir), resume="auto", log_every=10,
                                      device="cuda" if torch.cuda.is_available() else "cpu")
    return PRESETS["tiny"].replace(**over)


def check_runs(runs: dict, steps, data="synthetic") -> None:
    """Before the first of ``runs`` (run folder → (sampler, overrides)) starts: each config is
    valid, ``data`` has evaluation splits for both encoders' probes (what ``pretrain`` needs
    after training), and each run folder takes files (made here). A UserError otherwise."""
    cfgs = []
    for run_dir, (sampler, sections) in runs.items():
        try:
            cfgs.append(run_config(run_dir, sampler, steps, data=data, sections=sections))
        except ValueError as e:
            raise UserError(f"run {run_dir}: {e}") from None
    for modality in ("video", "audio"):  # the runs share the data and its shape
        eval_data(cfgs[0], data, modality=modality)
    for run_dir in runs:
        output_folder(run_dir, "--out")


def pretrain(run_dir, sampler, steps, *, data="synthetic", sections=None) -> dict:
    """Tiny-preset pretraining (resumes if the run exists) + linear probes of both encoders.
    ``sections``: further config overrides (``run_config``)."""
    run_dir = Path(run_dir)
    Trainer(run_config(run_dir, sampler, steps, data=data, sections=sections)).run()
    summary = json.loads((run_dir / "summary.json").read_text())
    model, state = load_pretrained(run_dir)
    for modality in ("video", "audio"):  # linear probes on the held-out clips
        res = evaluate(model, state, data, modality=modality, protocol="linear")
        write_results(res, run_dir / "eval")
        summary[f"probe_{modality}"] = res["top1_mean"]
    return summary


# -- (a) negative-category diversity per iteration ---------------------------------------------
def diversity_runs(out, samplers=tuple(SAMPLER_LABELS)) -> dict:
    """Run folder → (sampler, config overrides) of the diversity analysis."""
    return {Path(out) / s: (s, {}) for s in samplers}


def diversity(out, steps, data="synthetic", samplers=tuple(SAMPLER_LABELS)) -> dict:
    out = Path(out)
    runs, table = {}, {}
    for run_dir, (s, sections) in diversity_runs(out, samplers).items():
        table[s] = pretrain(run_dir, s, steps, data=data, sections=sections)
        runs[SAMPLER_LABELS[s]] = str(run_dir / "metrics.csv")
    png = plot_metrics(runs, out / "diversity.png", keys=("unique_per_m", "coverage", "acc", "gnorm"))
    return {"png": str(png), "runs": table}


# -- (d) dictionary size K, random vs active ---------------------------------------------------
def dictsize_runs(out, sizes) -> dict:
    """Run folder → (sampler, config overrides) of the dictionary-size analysis."""
    return {Path(out) / f"K{k}_{s}": (s, dict(model=dict(dict_size=k),
                                              selection=dict(pool_size=3 * k + 32)))
            for k in sizes for s in ("random", "active")}


def dictsize(out, steps, sizes, data="synthetic") -> dict:
    out = Path(out)
    rows = []
    for run_dir, (s, sections) in dictsize_runs(out, sizes).items():
        summ = pretrain(run_dir, s, steps, data=data, sections=sections)
        rows.append(dict(K=sections["model"]["dict_size"], sampler=s, acc=summ["acc_last"],
                         probe_video=summ.get("probe_video", float("nan")),
                         probe_audio=summ.get("probe_audio", float("nan"))))
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, key in zip(axes, ("acc", "probe_video")):
        for s in ("random", "active"):
            pts = [(r["K"], r[key]) for r in rows if r["sampler"] == s]
            ax.plot(*zip(*pts), marker="o", label=SAMPLER_LABELS[s])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("dictionary size K")
        ax.set_title({"acc": "pretext accuracy (last)", "probe_video": "video linear probe"}[key])
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    return {"png": str(save_figure(fig, out / "dictsize.png")), "rows": rows}


# -- (b) gradient-norm gallery -------------------------------------------------------------------
@torch.no_grad()
def gallery(run, out, n_queries=3, n_show=4, seed=0) -> dict:
    """For a few audio queries of a batch, the video candidates whose pseudo-label is that query:
    the hardest (largest last-layer gradient norm) and easiest (smallest), centre frames."""
    from kernels import grad_embed

    model, data = synthetic_run(run)
    m = model.cfg.batch_size
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(data), generator=g)
    qb, cb = data.batch(perm[:m]), data.batch(perm[m:])
    q_a, h_a = model.f_a(qb["audio"])  # pseudo-label space: the audio queries of the batch
    k_v, _ = model.h_v(cb["video"])  # candidates: video keys
    alpha, beta = grad_embed(k_v, q_a, h_a, tau=model.sel.tau_p, view=model.sel.grad_view)
    norm = alpha.norm(dim=1) * beta.norm(dim=1)  # |g_n|
    yhat = (k_v @ q_a.t()).argmax(1)
    counts = torch.bincount(yhat, minlength=m)
    queries = [int(j) for j in counts.argsort(descending=True)[:n_queries]]
    plt = _plt()
    fig, axes = plt.subplots(len(queries), 1 + 2 * n_show,
                             figsize=(1.6 * (1 + 2 * n_show), 1.9 * len(queries)), squeeze=False)
    rows = []
    for r, j in enumerate(queries):
        cand = torch.nonzero(yhat == j).flatten()
        order = cand[norm[cand].argsort(descending=True)]
        hard, easy = order[:n_show], order.flip(0)[:n_show]
        _frame(axes[r, 0], qb["video"][j], f"query ({data.class_names[qb['label'][j]]})")
        for c, (idx, kind) in enumerate([(i, "hard") for i in hard] + [(i, "easy") for i in easy]):
            _frame(axes[r, 1 + c], cb["video"][idx],
                   f"{kind} |g|={norm[idx]:.2g}\n{data.class_names[cb['label'][idx]]}")
        rows.append(dict(query=j, n_candidates=int(cand.numel()),
                         hard=[float(norm[i]) for i in hard], easy=[float(norm[i]) for i in easy]))
        for c in range(1 + len(hard) + len(easy), 1 + 2 * n_show):
            axes[r, c].axis("off")
    fig.tight_layout()
    return {"png": str(save_figure(fig, Path(out) / "gallery.png", dpi=100)), "rows": rows}


def _frame(ax, video, title):
    img = video[:, video.shape[1] // 2].permute(1, 2, 0)  # centre frame [H, W, 3]
    img = (img - img.min()) / (img.max() - img.min() + 1e-8)
    ax.imshow(img.numpy())
    ax.set_title(title, fontsize=7)
    ax.axis("off")


# -- (c) pretext accuracy per class ------------------------------------------------------------
@torch.no_grad()
def perclass(run, out, top=5) -> dict:
    """Cross-modal pretext top-1 (positive key beats every dictionary key) per class, both
    directions, with the checkpoint's dictionaries."""
    model, data = synthetic_run(run)
    hits = {"video→audio": torch.zeros(data.num_classes), "audio→video": torch.zeros(data.num_classes)}
    n = torch.zeros(data.num_classes)
    for s in range(0, len(data), 64):
        b = data.batch(torch.arange(s, min(len(data), s + 64)))
        q_v, _ = model.f_v(b["video"])
        q_a, _ = model.f_a(b["audio"])
        k_v, _ = model.h_v(b["video"])
        k_a, _ = model.h_a(b["audio"])
        for name, q, k, d in (("video→audio", q_v, k_a, model.dict_a.keys),
                              ("audio→video", q_a, k_v, model.dict_v.keys)):
            ok = (q * k).sum(1) > (q @ d.t()).max(1).values
            hits[name].index_add_(0, b["label"], ok.float())
        n.index_add_(0, b["label"], torch.ones(len(b["label"])))
    acc = {k: (v / n.clamp_min(1)).tolist() for k, v in hits.items()}
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, (name, vals) in zip(axes, acc.items()):
        order = sorted(range(len(vals)), key=lambda c: -vals[c])
        ax.bar(range(len(vals)), [vals[c] for c in order])
        ax.set_xticks(range(len(vals)), [data.class_names[c] for c in order], rotation=60,
                      fontsize=7)
        ax.set_title(f"pretext accuracy per class, {name}")
    fig.tight_layout()
    save_figure(fig, Path(out) / "perclass.png")
    ranked = {k: sorted(((data.class_names[c], v[c]) for c in range(len(v))), key=lambda t: -t[1])
              for k, v in acc.items()}
    return {"png": str(Path(out) / "perclass.png"),
            "top": {k: r[:top] for k, r in ranked.items()},
            "bottom": {k: r[-top:] for k, r in ranked.items()}}


def synthetic_run(run):
    """The model of a run (eval mode) and the synthetic clips it was pretrained on; a
    UserError when the run was pretrained on a prepared dataset."""
    model, state = load_pretrained(run)
    cfg = state["cfg"]
    if not cfg.data.synthetic:
        raise UserError(f"{run}: gallery and perclass read the built-in synthetic clips, but this "
                        f"run was pretrained on {cfg.data.source}; pass a run made with --data "
                        "synthetic")
    return model.eval(), synthetic_clips(cfg.data, cfg.model.seed)


def write_report(out, results: dict) -> Path:
    out = Path(out)
    lines = ["# CM-ACC analyses", ""]
    if "diversity" in results:
        lines += ["## Negative-category diversity per iteration (paper Fig. 3)", "",
                  "![diversity](diversity.png)", "",
                  "unique/M = distinct categories among the M enqueued negatives / M (the paper's "
                  "appendix metric); coverage = distinct categories / min(M, C) (1.0 = ceiling).", "",
                  "| sampler | unique/M (last) | coverage (last) | pretext acc (last) | probe video | "
                  "probe audio |",
                  "|---|---|---|---|---|---|"]
        for s, r in results["diversity"]["runs"].items():
            lines.append(f"| {SAMPLER_LABELS[s]} | {r['unique_per_m_last']:.3f} | "
                         f"{r['coverage_last']:.3f} | {r['acc_last']:.3f} | "
                         f"{r.get('probe_video', float('nan')):.3f} | {r.get('probe_audio', float('nan')):.3f} |")
        lines.append("")
    if "dictsize" in results:
        lines += ["## Dictionary size K, random vs active", "", "![dictsize](dictsize.png)", "",
                  "| K | sampler | pretext acc | probe video | probe audio |", "|---|---|---|---|---|"]
        lines += [f"| {r['K']} | {r['sampler']} | {r['acc']:.3f} | {r['probe_video']:.3f} | "
                  f"{r['probe_audio']:.3f} |" for r in results["dictsize"]["rows"]]
        lines.append("")
    if "gallery" in results:
        lines += ["## Gradient-norm gallery (hard vs easy negatives)", "", "![gallery](gallery.png)", ""]
    if "perclass" in results:
        lines += ["## Pretext accuracy per class", "", "![perclass](perclass.png)", ""]
        for k, v in results["perclass"]["top"].items():
            lines.append(f"- {k}: top {', '.join(f'{c} ({a:.2f})' for c, a in v)}; bottom "
                         f"{', '.join(f'{c} ({a:.2f})' for c, a in results['perclass']['bottom'][k])}")
        lines.append("")
    path = out / "report.md"
    atomic_write_text(path, "\n".join(lines))
    atomic_write_text(out / "results.json", json.dumps(results, indent=2))
    return path


@command
def main(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument("what", choices=("diversity", "dictsize", "gallery", "perclass", "all"))
    p.add_argument("run", nargs="?", help="run folder (gallery, perclass; all: default OUT/active)")
    p.add_argument("--out", default="runs/analysis")
    p.add_argument("--steps", type=positive_int, default=120)
    p.add_argument("--sizes", type=positive_int, nargs="+", default=[32, 64, 128])
    p.add_argument("--data", default="synthetic")
    args = p.parse_args(argv)
    setup_logging()
    if args.what in ("gallery", "perclass") and not args.run:
        p.error(f"{args.what} needs a run folder (a pretrained checkpoint), e.g. runs/analysis/active")
    if args.what == "all" and args.data != "synthetic" and not args.run:
        raise UserError(f"all --data {args.data}: gallery and perclass read the built-in synthetic "
                        "clips, so OUT/active (pretrained on --data) cannot serve them; run "
                        "diversity and dictsize with --data, or pass a synthetic run folder")
    out = output_folder(args.out, "--out")
    runs = {}  # everything to pretrain, checked before the first run starts
    if args.what in ("diversity", "all"):
        runs.update(diversity_runs(out))
    if args.what in ("dictsize", "all"):
        runs.update(dictsize_runs(out, args.sizes))
    if runs and args.run:  # all RUN: the run analysed after the pretraining
        synthetic_run(args.run)
    if runs:
        check_runs(runs, args.steps, args.data)
    results = {}
    if args.what in ("diversity", "all"):
        results["diversity"] = diversity(out, args.steps, args.data)
    if args.what in ("dictsize", "all"):
        results["dictsize"] = dictsize(out, args.steps, args.sizes, args.data)
    run = args.run or str(out / "active")
    if args.what in ("gallery", "all"):
        results["gallery"] = gallery(run, out)
    if args.what in ("perclass", "all"):
        results["perclass"] = perclass(run, out)
    print(f"report: {write_report(out, results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
