"""The paper's analyses as commands that write PNG plots and a Markdown report.

    python -m cmacc.analysis diversity --out runs/analysis [--steps 120]   # Fig. 3: samplers
    python -m cmacc.analysis dictsize  --out runs/analysis [--sizes 32 64 128]
    python -m cmacc.analysis gallery   runs/analysis/active --out runs/analysis
    python -m cmacc.analysis perclass  runs/analysis/active --out runs/analysis
    python -m cmacc.analysis all       --out runs/analysis        # everything + report.md

The training runs use the tiny preset on the built-in synthetic clips (CPU); pass
``--data MANIFEST`` to pretrain on a prepared dataset instead. Finished runs are resumed, not
redone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from .eval import evaluate, load_pretrained, write_results
from .metrics import plot_metrics
from .toydata import ToyAV

SAMPLER_LABELS = {"random": "random (XMoCo)", "active": "active, gradient (CM-ACC)",
                  "active-feature": "active, feature", "ohem": "OHEM"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def pretrain(run_dir, sampler, steps, *, data="synthetic", extra=()) -> dict:
    """Tiny-preset pretraining (resumes if the run exists) + linear probes of both encoders."""
    import train  # the entry point, in-process

    run_dir = Path(run_dir)
    train.main(["--preset", "tiny", "--sampler", sampler, "--steps", str(steps), "--data", data,
                "--out", str(run_dir), "--resume", "auto", "--log-every", "10", *extra])
    summary = json.loads((run_dir / "summary.json").read_text())
    model, state = load_pretrained(run_dir)
    for modality in ("video", "audio"):  # linear probes on the held-out clips
        res = evaluate(model, state, data, modality=modality, protocol="linear")
        write_results(res, run_dir / "eval")
        summary[f"probe_{modality}"] = res["top1_mean"]
    return summary


# -- (a) negative-category diversity per iteration ---------------------------------------------
def diversity(out, steps, data="synthetic", samplers=tuple(SAMPLER_LABELS)) -> dict:
    out = Path(out)
    runs, table = {}, {}
    for s in samplers:
        table[s] = pretrain(out / s, s, steps, data=data)
        runs[SAMPLER_LABELS[s]] = str(out / s / "metrics.csv")
    png = plot_metrics(runs, out / "diversity.png", keys=("diversity", "acc", "gnorm"))
    return {"png": str(png), "runs": table}


# -- (d) dictionary size K, random vs active ---------------------------------------------------
def dictsize(out, steps, sizes, data="synthetic") -> dict:
    out = Path(out)
    rows = []
    for k in sizes:
        for s in ("random", "active"):
            summ = pretrain(out / f"K{k}_{s}", s, steps, data=data,
                            extra=("--dict-size", str(k), "--pool-size", str(3 * k + 32)))
            rows.append(dict(K=k, sampler=s, acc=summ["acc_last"],
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
    fig.savefig(out / "dictsize.png", dpi=110)
    plt.close(fig)
    return {"png": str(out / "dictsize.png"), "rows": rows}


# -- (b) gradient-norm gallery -------------------------------------------------------------------
@torch.no_grad()
def gallery(run, out, n_queries=3, n_show=4, seed=0) -> dict:
    """For a few audio queries of a batch, the video candidates whose pseudo-label is that query:
    the hardest (largest last-layer gradient norm) and easiest (smallest), centre frames."""
    from kernels import grad_embed

    model, state = load_pretrained(run)
    model.eval()
    data = _toy(state)
    m = model.cfg.batch_size
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(data), generator=g)
    qb, cb = data.batch(perm[:m]), data.batch(perm[m:])
    q_a, h_a = model.f_a(qb["audio"])  # pseudo-label space: the audio queries of the batch
    k_v, _ = model.h_v(cb["video"])  # candidates: video keys
    alpha, beta = grad_embed(k_v, q_a, h_a, tau=model.cfg.tau_p, view=model.cfg.grad_view)
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
    Path(out).mkdir(parents=True, exist_ok=True)
    fig.savefig(Path(out) / "gallery.png", dpi=100)
    plt.close(fig)
    return {"png": str(Path(out) / "gallery.png"), "rows": rows}


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
    model, state = load_pretrained(run)
    model.eval()
    data = _toy(state)
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
    Path(out).mkdir(parents=True, exist_ok=True)
    fig.savefig(Path(out) / "perclass.png", dpi=110)
    plt.close(fig)
    ranked = {k: sorted(((data.class_names[c], v[c]) for c in range(len(v))), key=lambda t: -t[1])
              for k, v in acc.items()}
    return {"png": str(Path(out) / "perclass.png"),
            "top": {k: r[:top] for k, r in ranked.items()},
            "bottom": {k: r[-top:] for k, r in ranked.items()}}


def _toy(state) -> ToyAV:
    dc = state["data_config"]
    return ToyAV(num_clips=dc.get("clips", 1024), num_classes=dc.get("classes", 10),
                 frames=dc["frames"], size=dc["size"], redundancy=dc.get("redundancy", 0.0),
                 noise=dc.get("noise", 0.3), seed=state["model_config"]["seed"])


def write_report(out, results: dict) -> Path:
    out = Path(out)
    lines = ["# CM-ACC analyses", ""]
    if "diversity" in results:
        lines += ["## Negative-category diversity per iteration (paper Fig. 3)", "",
                  "![diversity](diversity.png)", "",
                  "| sampler | diversity (last) | pretext acc (last) | probe video | probe audio |",
                  "|---|---|---|---|---|"]
        for s, r in results["diversity"]["runs"].items():
            lines.append(f"| {SAMPLER_LABELS[s]} | {r['diversity_last']:.3f} | {r['acc_last']:.3f} | "
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
    tmp = out / ".report.md.tmp"
    tmp.write_text("\n".join(lines))
    os.replace(tmp, path)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("diversity", "dictsize", "gallery", "perclass", "all"))
    p.add_argument("run", nargs="?", help="run folder (gallery, perclass)")
    p.add_argument("--out", default="runs/analysis")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--data", default="synthetic")
    args = p.parse_args(argv)
    if args.what in ("gallery", "perclass") and not args.run:
        p.error(f"{args.what} needs a run folder (a pretrained checkpoint), e.g. runs/analysis/active")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
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
