"""The paper's analyses as commands that write PNG plots and a Markdown report.
Installed as the command ``cmacc-analysis`` (= ``python -m cmacc.apps.analysis``).

    python -m cmacc.apps.analysis diversity --out runs/analysis [--steps 500 --seeds 3]  # Fig. 3
    python -m cmacc.apps.analysis dictsize  --out runs/analysis [--sizes 32 64 128]
    python -m cmacc.apps.analysis gallery   runs/analysis/active/seed0 --out runs/analysis
    python -m cmacc.apps.analysis perclass  runs/analysis/active/seed0 --out runs/analysis
    python -m cmacc.apps.analysis all       --out runs/analysis    # everything + report.md

The training runs use the tiny preset (M = 16) on the built-in synthetic clips (CPU); pass
``--data MANIFEST`` to pretrain on a prepared dataset instead. ``gallery`` and ``perclass`` look
at the clips the run was pretrained on (the synthetic clips, or its manifest's labelled clips
with video and audio, each the centre clip, as evaluation reads it), or at ``--data``'s.
``diversity`` runs every sampler
(random, active, active-feature, OHEM) with several seeds in a regime where the metric is not
saturated (``DIVERSITY_DATA``: 32 classes, Zipf-distributed, redundant instances; ~5 minutes on
2 CPU cores) and reports mean ± 95% CI over seeds. Finished runs are resumed, not redone. Everything a command needs (output folder, run configs, the data's evaluation splits
for both encoders, the run to analyse) is checked before the first run starts.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch

from cmacc.config import GRAD_VIEWS, PRESETS, Config
from cmacc.data import run_clips, synthetic_clips
from cmacc.metrics import expected_unique, format_interval, mean_ci
from cmacc.runlog import read_csv, save_figure
from cmacc.trainer import Trainer
from data_dali.synthetic import class_counts
from data_dali.cli import (ArgumentParser, UserError, command, first_line, output_folder,
                           setup_logging)
from data_dali.fileio import atomic_write_text

from . import positive_int
from .eval import eval_data, evaluate, load_pretrained, resolve_data, write_results

log = logging.getLogger("cmacc.analysis")
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
# The default setting: not saturated (C = 32 classes >= 2M, M = 16 from the tiny preset), a
# long-tailed pool (Zipf, S = 1) of redundant clips (groups of 4 instances share a source),
# noise 0.3 (DataConfig's default; the tiny preset's 1.0 leaves the encoder near chance on 32
# classes in this budget: docs/FIDELITY.md). 4 samplers x 3 seeds x 500 steps: ~5 min, 2 cores.
DIVERSITY_DATA = dict(classes=32, clips=512, class_dist="zipf:1", redundancy=0.75, noise=0.3)
DIVERSITY_STEPS, DIVERSITY_SEEDS = 500, 3
WINDOWS = ("all", "first", "last")  # every logged row, the first and the last quarter of them


def diversity_runs(out, samplers=tuple(SAMPLER_LABELS), seeds=DIVERSITY_SEEDS,
                   data_over=None, selection_over=None) -> dict:
    """Run folder OUT/<sampler>/seed<k> → (sampler, config overrides: seed k, the synthetic
    data settings (DIVERSITY_DATA unless ``data_over``) and ``selection_over``, e.g. tau_p)."""
    data_over = DIVERSITY_DATA if data_over is None else data_over
    return {Path(out) / s / f"seed{k}": (s, dict(model=dict(seed=k), data=dict(data_over),
                                                  selection=dict(selection_over or {})))
            for s in samplers for k in range(seeds)}


def diversity(out, steps=DIVERSITY_STEPS, data="synthetic", samplers=tuple(SAMPLER_LABELS),
              seeds=DIVERSITY_SEEDS, data_over=None, selection_over=None) -> dict:
    """Pretrain every sampler with every seed; per sampler, the curves of unique/M and coverage
    (mean and 95% t-interval over seeds, ``plot_diversity``), a table of window means and, on
    the synthetic clips, why (``key_diagnostics``)."""
    out = Path(out)
    data_over = DIVERSITY_DATA if data_over is None else data_over
    curves, summaries = {}, {}
    runs = diversity_runs(out, samplers, seeds, data_over, selection_over)
    cfg = run_config(out, samplers[0], steps, data=data, sections=next(iter(runs.values()))[1])
    law = diversity_law(cfg)
    if law["saturated"]:
        log.warning("%s", law["saturated"])
    for run_dir, (s, sections) in runs.items():
        summary = pretrain(run_dir, s, steps, data=data, sections=sections)
        if data == "synthetic":
            summary.update(key_diagnostics(run_dir))
        summaries.setdefault(s, []).append(summary)
        curves.setdefault(s, []).append(read_csv(run_dir / "metrics.csv"))
    m, random_law = cfg.model.batch_size, law["random_law"]
    table = {s: diversity_row(rows, summaries[s], None if s == "random" else curves.get("random"))
             for s, rows in curves.items()}
    setting = dict(M=m, K=cfg.model.dict_size, N=cfg.selection.pool_size, steps=steps,
                   seeds=seeds, data=data, random_law=random_law, C=law["classes"],
                   ceiling=law["ceiling"], saturated=law["saturated"], tau_p=cfg.selection.tau_p,
                   grad_view=cfg.selection.grad_view,
                   **({k: getattr(cfg.data, k) for k in DIVERSITY_DATA} if cfg.data.synthetic else {}))
    png = plot_diversity(curves, out / "diversity.png", random_law, ceiling=law["ceiling"],
                         saturated=law["saturated"])
    return {"png": str(png), "setting": setting, "table": table, "runs": summaries}


def diversity_law(cfg: Config) -> dict:
    """What unique/M can be on a run's data: C labelled categories (the synthetic clips' class
    quotas, or the labels of a manifest's clips with video and audio), the ceiling min(C, M)/M
    that no sampler passes, random sampling's expected unique/M (``expected_unique``; None when
    the data holds fewer than M clips) and, when C <= M, the line saying that every sampler
    then reaches the ceiling: unique/M and coverage cannot tell them apart."""
    m = cfg.model.batch_size
    if cfg.data.synthetic:
        counts = class_counts(cfg.data.class_dist, cfg.data.clips, cfg.data.classes)
    else:
        from data_dali.manifest import Manifest

        man = Manifest(cfg.data.source)
        labels = man.label_array[man.select()]
        counts = [int((labels == c).sum()) for c in sorted(set(labels.tolist()) - {-1})]
    c = sum(1 for k in counts if k > 0)
    law = expected_unique(counts, m) / m if m <= sum(counts) else None
    ceiling = min(c, m) / m
    saturated = None
    if c <= m:
        saturated = (f"unique/M is saturated on {cfg.data.source}: C = {c} classes <= M = {m}, "
                     f"so a batch's M negatives hold at most C categories and unique/M is at "
                     f"most C/M = {ceiling:.3f} for every sampler (random's expected: "
                     + (f"{law:.3f}" if law is not None else "not defined, fewer clips than M")
                     + "); unique/M and coverage cannot tell the samplers apart: use data with "
                     f"more classes than M (2M = {2 * m} or more)")
    return dict(classes=c, ceiling=ceiling, random_law=law, saturated=saturated)


def window(rows: list[dict], key: str, which: str) -> float:
    """Mean of ``key`` over the rows of a window: all, the first or the last quarter."""
    q = max(1, len(rows) // 4)
    part = {"all": rows, "first": rows[:q], "last": rows[-q:]}[which]
    return sum(float(r[key]) for r in part) / len(part)


def diversity_row(runs: list[list[dict]], summaries: list[dict], random=None) -> dict:
    """(mean, 95% half-width) over seeds of each window's unique/M and coverage, the
    difference to random paired by seed (same seed: same clips and initial weights), the last
    pretext accuracy and the probes."""
    row = {}
    for key in ("unique_per_m", "coverage"):
        for w in WINDOWS:
            row[f"{key}_{w}"] = mean_ci([window(r, key, w) for r in runs])
    if random is not None:
        for w in WINDOWS:
            row[f"gap_{w}"] = mean_ci([window(a, "unique_per_m", w) - window(b, "unique_per_m", w)
                                       for a, b in zip(runs, random)])
    for key in ("acc_last", "probe_video", "probe_audio", *DIAGNOSTICS):
        row[key] = mean_ci([sm.get(key, float("nan")) for sm in summaries])
    return row


DIAGNOSTICS = ("purity_video", "purity_audio", "purity_chance", "pmax", "entropy", "pool_dup")


@torch.no_grad()
def key_diagnostics(run, n_batches=20, seed=0) -> dict:
    """What decides whether a sampler can find other categories (docs/FIDELITY.md), measured on
    the synthetic clips of a run with its final key encoders:

    - ``purity_video`` / ``purity_audio``: share of clips whose nearest other key (cosine) has
      the same class, clips of the same near-duplicate group excluded; ``purity_chance`` =
      sum_c p_c^2, what keys without class information get;
    - ``pmax``, ``entropy``: the pseudo-posterior of paper eq. 5 (at the run's tau_p) of every
      video key over M random audio queries: mean max_j p_nj (uniform: 1/M) and mean entropy /
      log M (1 = uniform);
    - ``pool_dup``: share of the final video pool U_v whose near-duplicate group (same class,
      same ``instance_group``) has another member in the pool (0 = de-duplicated)."""
    import math

    from data_dali.synthetic import instance_group

    model, data = synthetic_run(run)
    cfg, n = model.cfg, len(data)
    keys = {"video": [], "audio": []}
    queries = []
    for s in range(0, n, 128):
        b = data.batch(torch.arange(s, min(n, s + 128)))
        keys["video"].append(model.h_v(b["video"])[0])
        keys["audio"].append(model.h_a(b["audio"])[0])
        queries.append(model.f_a(b["audio"])[0])
    keys = {k: torch.cat(v) for k, v in keys.items()}  # [n, d]
    queries = torch.cat(queries)  # [n, d] audio queries
    lab = data.labels
    group = lab * n + instance_group(data.instance, data.redundancy)  # [n] near-duplicate group
    same_group = group[:, None] == group[None, :]  # [n, n], self included
    out = {}
    for mod, k in keys.items():
        sim = (k @ k.t()).masked_fill(same_group, -float("inf"))
        out[f"purity_{mod}"] = (lab[sim.argmax(1)] == lab).float().mean().item()
    share = torch.bincount(lab, minlength=data.num_classes).double() / n
    out["purity_chance"] = float((share ** 2).sum())
    m, g = cfg.batch_size, torch.Generator().manual_seed(seed)
    pmax = ent = 0.0
    for _ in range(n_batches):
        p = (keys["video"] @ queries[torch.randperm(n, generator=g)[:m]].t()
             / model.sel.tau_p).softmax(1)  # [n, M] eq. 5
        pmax += p.max(1).values.mean().item() / n_batches
        ent += (-(p * p.clamp_min(1e-12).log()).sum(1) / math.log(m)).mean().item() / n_batches
    out.update(pmax=pmax, entropy=ent)
    pool = model.pool_v.index[: model.pool_v.count]
    pool = group[pool[pool >= 0]]
    out["pool_dup"] = ((pool[:, None] == pool[None, :]).sum(1) > 1).float().mean().item()
    return out


# what each figure of plot_diversity can be: (lowest, highest); unique/M's highest is the
# data's ceiling min(C, M) / M where it is known
DIVERSITY_RANGE = {"unique_per_m": (0.0, 1.0), "coverage": (0.0, 1.0), "acc": (0.0, 1.0)}


def diversity_bands(runs: list[list[dict]], key: str, points=25,
                    limits=(-float("inf"), float("inf"))) -> dict:
    """What plot_diversity draws of one sampler and figure: the logged rows in about ``points``
    consecutive bins; ``steps`` (each bin's last step), ``mean`` over seeds of each seed's bin
    mean, and the 95% t-band ``low``/``high`` around it clipped to ``limits`` (the figure's
    range: 2 seeds' t = 12.7 reaches far past it); no band (``low`` = ``high`` = None) from
    one seed."""
    import math

    n = min(len(r) for r in runs)
    width = max(1, n // points)
    bins = [range(b, min(n, b + width)) for b in range(0, n, width)]
    steps = [int(runs[0][b[-1]]["step"]) for b in bins]
    stats = [mean_ci([sum(float(r[i][key]) for i in b) / len(b) for r in runs]) for b in bins]
    mean = [a for a, _ in stats]
    if len(runs) < 2:
        return dict(steps=steps, mean=mean, low=None, high=None, n=len(runs))
    lo, hi = limits
    low = [min(max(a - h, lo), hi) if not math.isnan(h) else a for a, h in stats]
    high = [max(min(a + h, hi), lo) if not math.isnan(h) else a for a, h in stats]
    return dict(steps=steps, mean=mean, low=low, high=high, n=len(runs))


def plot_diversity(curves: dict, png, random_law=None, points=25, ceiling=None,
                   saturated=None) -> Path:
    """unique/M, coverage and pretext accuracy over the steps (``diversity_bands``): per
    sampler the mean over seeds and its 95% t-band, clipped to what the figure can be (unique/M
    to the data's ``ceiling`` min(C, M)/M where given), the number of seeds in the legend;
    random sampling's law as a dashed line, the ceiling as a dotted one, and ``saturated`` (C
    <= M: every sampler at the ceiling) written on the unique/M and coverage panels."""
    plt = _plt()
    keys = {"unique_per_m": "unique/M (paper Fig. 3)", "coverage": "coverage = U / min(M, C)",
            "acc": "pretext accuracy"}
    limits = dict(DIVERSITY_RANGE)
    if ceiling is not None:
        limits["unique_per_m"] = (0.0, ceiling)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.3))
    for ax, (key, title) in zip(axes, keys.items()):
        for s, runs in curves.items():
            b = diversity_bands(runs, key, points, limits[key])
            seeds = f"{b['n']} seed{'s' if b['n'] > 1 else ''}"
            band = ", mean ± 95% t-band" if b["low"] is not None else ", no band"
            line, = ax.plot(b["steps"], b["mean"], lw=1.4,
                            label=f"{SAMPLER_LABELS[s]} (n = {seeds}{band})")
            if b["low"] is not None:
                ax.fill_between(b["steps"], b["low"], b["high"], color=line.get_color(),
                                alpha=0.18)
        if key == "unique_per_m" and random_law is not None:
            ax.axhline(random_law, color="k", ls="--", lw=1, label="random, expected (law)")
        if key == "unique_per_m" and ceiling is not None:
            ax.axhline(ceiling, color="k", ls=":", lw=1,
                       label=f"ceiling min(C, M)/M = {ceiling:.3f}")
        if saturated and key in ("unique_per_m", "coverage"):  # in the title: no legend on it
            bound = f" = {ceiling:.3f}" if ceiling is not None else ""
            title += (f"\nsaturated: C <= M, so unique/M <= C/M{bound} for every\nsampler: "
                      "they cannot be told apart here")
        ax.set_xlabel("step")
        ax.set_title(title, fontsize=10 if "\n" not in title else 8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, png, dpi=80)


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
    png = plot_dictsize(rows, out / "dictsize.png")
    return {"png": str(png), "rows": rows}


def dictsize_chance(k: int) -> float:
    """The pretext task's chance at dictionary size K: the positive key against K negatives,
    1 / (K + 1); it falls as K grows, so pretext accuracies at different K are not on one scale."""
    return 1.0 / (k + 1)


def plot_dictsize(rows: list[dict], png) -> Path:
    """Pretext accuracy and the video probe against K, per sampler; the pretext panel draws
    its chance 1 / (K + 1) at each K and says in its title that chance changes with K."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    sizes = sorted({r["K"] for r in rows})
    for ax, key in zip(axes, ("acc", "probe_video")):
        for s in ("random", "active"):
            pts = [(r["K"], r[key]) for r in rows if r["sampler"] == s]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=SAMPLER_LABELS[s])
        if key == "acc":
            ax.plot(sizes, [dictsize_chance(k) for k in sizes], color="grey", ls="--",
                    marker=".", label="chance = 1/(K+1)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("dictionary size K")
        ax.set_title({"acc": "pretext accuracy (last); chance 1/(K+1) changes with K",
                      "probe_video": "video linear probe"}[key], fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, png)


# -- (b) gradient-norm gallery -------------------------------------------------------------------
@torch.no_grad()
def gallery(run, out, n_queries=3, n_show=4, seed=0, data=None, candidates=512) -> dict:
    """For a few audio queries of a batch, the video candidates whose pseudo-label is that query:
    the hardest (largest last-layer gradient norm) and easiest (smallest), centre frames. The
    clips: ``data`` (None: the run's own pretraining data, the synthetic clips or its manifest;
    ``analysed_run``), a batch of M queries and up to ``candidates`` other clips."""
    from kernels import grad_embed

    model, data = analysed_run(run, data, "gallery")
    m = min(model.cfg.batch_size, len(data) // 2)  # queries: a batch (of a small set: half)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(data), generator=g)
    qb, cb = data.batch(perm[:m]), data.batch(perm[m:m + candidates])
    if len(qb["label"]) == 0 or len(cb["label"]) == 0:
        raise UserError(f"{run}: the gallery needs at least 2 readable clips with video and "
                        f"audio, and its data has {len(data)}; pass --data with more clips")
    m = len(qb["label"])
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
def perclass(run, out, top=5, data=None) -> dict:
    """Cross-modal pretext top-1 (positive key beats every dictionary key) per class, both
    directions, with the checkpoint's dictionaries, over every clip of ``data`` (None: the
    run's own pretraining data; ``analysed_run``)."""
    model, data = analysed_run(run, data, "perclass")
    hits = {"video→audio": torch.zeros(data.num_classes), "audio→video": torch.zeros(data.num_classes)}
    n = torch.zeros(data.num_classes)
    for s in range(0, len(data), 64):
        b = data.batch(torch.arange(s, min(len(data), s + 64)))
        if len(b["label"]) == 0:  # every clip of the batch failed to decode (logged)
            continue
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
    """The model of a run (eval mode) and the synthetic clips it was pretrained on (what
    ``key_diagnostics`` measures: it needs their near-duplicate groups); a UserError when the
    run was pretrained on a prepared dataset."""
    model, state = load_pretrained(run)
    cfg = state["cfg"]
    if not cfg.data.synthetic:
        raise UserError(f"{run}: the key diagnostics read the built-in synthetic clips, but this "
                        f"run was pretrained on {cfg.data.source}; pass a run made with --data "
                        "synthetic")
    return model.eval(), synthetic_clips(cfg.data, cfg.model.seed)


def analysed_run(run, data=None, what: str | None = "the analysis"):
    """The model of a run (eval mode) and the clips that gallery and perclass look at:
    ``data`` (a manifest, or 'synthetic'), or with None the run's own pretraining data as its
    checkpoint records it (``cmacc.apps.eval.resolve_data``: a UserError naming --data when
    that manifest is not there or has changed since, or when the synthetic clips are asked of
    a run pretrained on a manifest). Cheap: the manifest is read, no clip is decoded."""
    model, state = load_pretrained(run)
    cfg = state["cfg"]
    source, why = resolve_data(data, state)
    try:
        clips = run_clips(source, cfg.data, cfg.model.seed)
    except (UserError, FileNotFoundError, ValueError) as e:
        said = str(e)  # (a manifest's message starts with its path)
        named = said.startswith((source, str(Path(source).resolve())))
        raise UserError(f"--data {said if named else f'{source}: {said}'}") from None
    if what:
        log.info("%s: the run %s (step %s) on %s (%s: %d clips, %d classes)", what,
                 state["file"], state.get("step"), source, why, len(clips), clips.num_classes)
    return model.eval(), clips


def _pm(stat) -> str:
    """mean ± 95% t-interval over seeds; from one seed (no interval) the mean says it is one
    row, not an interval of zero width."""
    import math

    mean, half = stat
    one = math.isnan(half) and not math.isnan(mean)
    return format_interval(mean, half) + (" (one row)" if one else "")


def diversity_report(res: dict) -> list[str]:
    """The diversity section of report.md: the setting, the figure and the tables."""
    st = res["setting"]
    data = (f"{st['clips']} synthetic clips, C = {st['classes']} classes, class_dist "
            f"{st['class_dist']}, redundancy {st['redundancy']}, noise {st['noise']}"
            if "classes" in st else f"data {st['data']}")
    law = (f" Random sampling's expected unique/M (the law of a random batch of these clips): "
           f"{st['random_law']:.3f}." if st.get("random_law") is not None else "")
    lines = ["## Negative-category diversity per iteration (paper Fig. 3)", "",
             f"M = {st['M']}, K = {st['K']}, N = {st['N']}, τ_p = {st['tau_p']}, gradient view "
             f"{st['grad_view']}, {st['steps']} steps, {st['seeds']} seeds; {data}.{law}", "",
             *([f"**Warning: {st['saturated']}.**", ""] if st.get("saturated") else []),
             "![diversity](diversity.png)", "",
             "unique/M = distinct categories among the M negatives enqueued per step / M (the "
             "paper appendix's metric); coverage = distinct categories / min(M, C) (1.0 = "
             "ceiling). Mean ± 95% t-interval over seeds of each seed's mean over all logged "
             "steps, the first or the last quarter of them; Δ = unique/M minus random's, paired "
             "by seed (same seed: same clips, same initial weights).", "",
             "| sampler | unique/M all | unique/M first ¼ | unique/M last ¼ | coverage last ¼ | "
             "Δ vs random, first ¼ | Δ vs random, last ¼ | pretext acc (last) | probe video | "
             "probe audio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s, r in res["table"].items():
        gaps = [_pm(r[k]) if k in r else "" for k in ("gap_first", "gap_last")]
        lines.append(f"| {SAMPLER_LABELS[s]} | {_pm(r['unique_per_m_all'])} | "
                     f"{_pm(r['unique_per_m_first'])} | {_pm(r['unique_per_m_last'])} | "
                     f"{_pm(r['coverage_last'])} | {gaps[0]} | {gaps[1]} | {_pm(r['acc_last'])} | "
                     f"{_pm(r['probe_video'])} | {_pm(r['probe_audio'])} |")
    rows = {s: r for s, r in res["table"].items() if r["purity_video"][0] == r["purity_video"][0]}
    if rows:
        lines += ["", "Why (`key_diagnostics`, final encoders): key 1-NN class purity (near "
                  "duplicates excluded; chance = Σ p_c²), the pseudo-posterior of eq. 5 at "
                  f"τ_p (max p; uniform = 1/M = {1 / st['M']:.4f}; entropy / log M, 1 = "
                  "uniform), and the share of the pool U_v with a near duplicate in it.", "",
                  "| sampler | key purity video | key purity audio | chance | posterior max p | "
                  "posterior entropy | pool near-duplicates |", "|---|---|---|---|---|---|---|"]
        for s, r in rows.items():
            lines.append(f"| {SAMPLER_LABELS[s]} | " + " | ".join(
                _pm(r[k]) for k in DIAGNOSTICS) + " |")
    return lines + [""]


def merged_results(out, results: dict) -> dict:
    """``results`` over the sections already in OUT/results.json: one analysis never drops
    another's section (a section run again replaces its own). A results.json that does not
    read as an object of sections is set aside, logged."""
    path = Path(out) / "results.json"
    try:
        old = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as e:
        log.warning("%s: not readable JSON (%s); its sections are dropped", path, first_line(e, 100))
        old = {}
    if not isinstance(old, dict):
        log.warning("%s: not an object of sections; dropped", path)
        old = {}
    kept = sorted(set(old) - set(results))
    if kept:
        log.info("report.md keeps the sections %s from %s", ", ".join(kept), path)
    return {**old, **results}


def write_report(out, results: dict) -> Path:
    """OUT/report.md and OUT/results.json of ``results`` merged with the sections already there
    (``merged_results``)."""
    out = Path(out)
    results = merged_results(out, results)
    lines = ["# CM-ACC analyses", ""]
    if "diversity" in results:
        lines += diversity_report(results["diversity"])
    if "dictsize" in results:
        lines += ["## Dictionary size K, random vs active", "", "![dictsize](dictsize.png)", "",
                  "Pretext accuracy: the positive key against the K dictionary keys, so its "
                  "chance is 1/(K+1) and changes with K (the figure's grey line; the table's "
                  "chance column): compare samplers at one K, not accuracies across K.", "",
                  "| K | sampler | pretext acc | chance 1/(K+1) | probe video | probe audio |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['K']} | {r['sampler']} | {r['acc']:.3f} | {dictsize_chance(r['K']):.4f} | "
                  f"{r['probe_video']:.3f} | {r['probe_audio']:.3f} |"
                  for r in results["dictsize"]["rows"]]
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
    p.add_argument("run", nargs="?", help="run folder (gallery, perclass; all: default OUT/active/seed0)")
    p.add_argument("--out", default="runs/analysis",
                   help="folder of the figures, report.md and results.json; each analysis adds "
                        "its section to them (default: runs/analysis)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help=f"pretraining steps per run (default: diversity {DIVERSITY_STEPS}, "
                        "dictsize 120)")
    p.add_argument("--sizes", type=positive_int, nargs="+", default=[32, 64, 128])
    p.add_argument("--data", default=None,
                   help="diversity, dictsize, all: the data the runs pretrain on, 'synthetic' "
                        "(default) or a prepared manifest.csv (cmacc-prepare); gallery, perclass: "
                        "the clips to look at (default: the run's own pretraining data, as its "
                        "checkpoint records it)")
    g = p.add_argument_group("diversity", "runs, and the synthetic clips they pretrain on")
    g.add_argument("--seeds", type=positive_int, default=DIVERSITY_SEEDS,
                   help=f"seeds per sampler (default {DIVERSITY_SEEDS}; the CIs are over seeds)")
    g.add_argument("--samplers", nargs="+", choices=tuple(SAMPLER_LABELS),
                   default=list(SAMPLER_LABELS))
    for name, value in DIVERSITY_DATA.items():
        g.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value,
                       help=f"default {value} (train.py --{name.replace('_', '-')})")
    g.add_argument("--tau-p", type=float, default=None, help="pseudo-posterior temperature "
                   "(default: the method's, 1 as paper eq. 5)")
    g.add_argument("--grad-view", choices=GRAD_VIEWS, default=None,
                   help="gradient-embedding view (default: the method's, head)")
    args = p.parse_args(argv)
    setup_logging()
    data_over = {name: getattr(args, name) for name in DIVERSITY_DATA}
    selection_over = {k: v for k, v in (("tau_p", args.tau_p), ("grad_view", args.grad_view))
                      if v is not None}
    if args.what in ("gallery", "perclass") and not args.run:
        p.error(f"{args.what} needs a run folder (a pretrained checkpoint), e.g. runs/analysis/active/seed0")
    data = args.data or "synthetic"  # what the runs pretrain on
    out = output_folder(args.out, "--out")
    div_steps, size_steps = args.steps or DIVERSITY_STEPS, args.steps or 120
    div = diversity_runs(out, tuple(args.samplers), args.seeds, data_over, selection_over)
    runs = {}  # everything to pretrain, checked before the first run starts
    if args.what in ("diversity", "all"):
        runs.update(div)
    if args.what in ("dictsize", "all"):
        runs.update(dictsize_runs(out, args.sizes))
    if runs:
        check_runs(runs, min(div_steps, size_steps), data)
    if runs and args.run:  # the run analysed after the pretraining
        analysed_run(args.run, args.data, None)
    results = {}
    if args.what in ("diversity", "all"):
        results["diversity"] = diversity(out, div_steps, data, tuple(args.samplers),
                                         args.seeds, data_over, selection_over)
    if args.what in ("dictsize", "all"):
        results["dictsize"] = dictsize(out, size_steps, args.sizes, data)
    run = args.run or str(out / "active" / "seed0")
    if args.what in ("gallery", "all"):
        results["gallery"] = gallery(run, out, data=args.data)
    if args.what in ("perclass", "all"):
        results["perclass"] = perclass(run, out, data=args.data)
    print(f"report: {write_report(out, results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
