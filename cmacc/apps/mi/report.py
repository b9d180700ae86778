"""report.md and the plots of a study's figures (mi.json), complete or not."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from cmacc.metrics import format_ci, mean_ci
from cmacc.runlog import point_marks, save_figure
from data_dali.fileio import atomic_write_text

from .train import ALL_METHODS, DIVERSITY, METHODS, QUICK


def _floor_key(floor: str, test: str) -> str:
    """mi.json's key of figures on a test set: "untrained" / "untrained_seen", "probe" /
    "probe_seen" (a run's), "pixels" / "pixels_seen"."""
    return floor if test == "held_out" else f"{floor}_{test}"


TESTS = (("held_out", "Held-out drawers"), ("seen", "Seen drawings"))


def write_outputs(results: dict, out: Path) -> None:
    """report.md, mi.png (probe accuracy per l), mi_curves.png (loss and pretext accuracy over
    training) and mi_diversity.png (the enqueued negatives' diversity over training, where
    recorded) from the figures, complete or not."""
    atomic_write_text(out / "report.md", report(results))
    _plot(results, out / "mi.png")
    _plot_curves(results, out / "mi_curves.png")
    _plot_curves(results, out / "mi_diversity.png", DIVERSITY_ROWS, results.get("diversity_law"),
                 title="negative diversity over training")


def _runs(results, m, l, key=None):
    runs = results["runs"].get(m, {}).get(str(l), [])
    return runs if key is None else [r[key] for r in runs]


def _seeds_run(results, methods, chars) -> int:
    return len({r["seed"] for m in methods for l in chars for r in _runs(results, m, l)})


def _cell(values) -> str:
    return "—" if not values else _pm(values)


def is_quick(results: dict) -> bool:
    """Whether a study ran with --quick (recorded so: ``quick``) or with every value --quick
    sets (an mi.json from before that was recorded, or the values given one by one)."""
    cfg = results.get("config", {})
    return bool(results.get("quick")) or all(cfg.get(k) == v for k, v in QUICK.items())


def report(results: dict, methods=None) -> str:
    methods = list(methods or results.get("methods", METHODS))
    samplers = results.get("samplers", [])
    seeds, chars = results["seeds"], results["chars"]
    done = sum(len(v) for per_l in results["runs"].values() for v in per_l.values())
    status = "" if results.get("complete") else f" — **partial: {done} runs in, the study did " \
                                                 "not finish**"
    mach = results.get("machine", {})
    quick = ("--quick (a minutes-long test setting: tiny networks, few steps): not a result. "
             if is_quick(results) else "")
    lines = [f"# {quick}MI study: seeds {seeds}, relation '{results['relation']}', "
             f"{results['n_train']} training pairs, {results['seconds']:.0f} s of compute"
             f"{status}", "",
             f"Machine: {mach.get('cpu', '?')}, {mach.get('torch_threads', '?')} torch "
             f"threads, torch {mach.get('torch', '?')}.", "",
             "Linear-probe accuracy of x's characters (mean over positions), mean ± 95% "
             "t-interval over seeds (one seed: its value, marked '(one row)', no interval; "
             "— = not run); steps = mean "
             "steps trained; pixels = the probe on x's 2x2-pooled pixels (no encoder). Two test "
             "sets of new pairs: drawn by held-out drawers (unseen handwriting: the protocol), "
             "and drawn from the training drawers' own drawings (seen images)."]
    for test, title in TESTS:
        key, floor, pix = (_floor_key(f, test) for f in ("probe", "untrained", "pixels"))
        lines += ["", f"## {title}", "",
                  "| l | MI (nats) | pixels | untrained | " + " | ".join(methods) + " |",
                  "|---" * (4 + len(methods)) + "|"]
        for l in chars:
            mi_l = results["mi"].get(str(l))
            cells = [f"{l}", "—" if mi_l is None else f"{mi_l:.2f}",
                     "—" if str(l) not in results[pix] else f"{results[pix][str(l)]:.3f}",
                     _cell(list(results[floor].get(str(l), {}).values()))]
            for m in methods:
                runs = _runs(results, m, l)
                steps = f" ({statistics.fmean(r['steps'] for r in runs):.0f} steps)" if runs else ""
                cells.append(_cell([r[key] for r in runs]) + steps)
            lines.append("| " + " | ".join(cells) + " |")
    lines += _paired_lines(results, chars,
                           [("CM-ACC", "XMoCo"), ("CM-ACC", "SMoCo"), ("XMoCo", "SMoCo")])
    lines += _sampler_lines(results, methods, samplers)
    lines += _diversity_lines(results, chars, [*methods, *samplers])
    lines += _time_lines(results, chars, [*methods, *samplers])
    lines += _when_lines(results, chars, [*methods, *samplers])
    lines += ["", "Alphabets: " + ", ".join(f"{n} ({s})" for n, s in
                                            zip(results["alphabets"], results["alphabet_sizes"])),
              "", "## Departures from the paper's protocol", ""]
    lines += [f"- {d}" for d in results["departures"]]
    return "\n".join(lines) + "\n"


def paired_difference(results, a: str, b: str, l: int, key: str) -> list[float]:
    """a's figure ``key`` (probe accuracy, diversity) minus b's, per seed that both ran and
    recorded it (same seed: same pairs order, same initial encoders), for a paired interval."""
    rb = {r["seed"]: r[key] for r in _runs(results, b, l) if key in r}
    return [r[key] - rb[r["seed"]] for r in _runs(results, a, l) if key in r and r["seed"] in rb]


def _paired_lines(results, chars, pairs, heading="Differences, paired by seed") -> list[str]:
    pairs = [(a, b) for a, b in pairs if a in results["runs"] and b in results["runs"]]
    if not pairs:
        return []
    lines = ["", f"## {heading}", "",
             "Probe accuracy of the first minus the second, per seed, mean ± 95% t-interval "
             "over seeds: an interval that excludes 0 is a difference these seeds support.", "",
             "| l | test pairs | " + " | ".join(f"{a} − {b}" for a, b in pairs) + " |",
             "|---" * (2 + len(pairs)) + "|"]
    for l in chars:
        for test, title in TESTS:
            key = _floor_key("probe", test)
            diffs = [paired_difference(results, a, b, l, key) for a, b in pairs]
            if any(diffs):
                lines.append(f"| {l} | {title.lower()} | "
                             + " | ".join(_signed(d) for d in diffs) + " |")
    return lines


ONE_ROW = " (one row)"


def _signed(values) -> str:
    if not values:
        return "—"
    return format_ci(values, signed=True) + (ONE_ROW if len(values) == 1 else "")


def _sampler_lines(results, methods, samplers) -> list[str]:
    cols = [m for m in ("XMoCo", "CM-ACC", *samplers) if m in (*methods, *samplers)]
    chars = results.get("sampler_chars", [])
    if not samplers or not chars:
        return []
    names = {m: f"{m} ({ALL_METHODS[m][1]})" for m in cols}
    lines = ["", "## Samplers of the cross-modal objective", "",
             "What is enqueued into the dictionaries: random (XMoCo), active = k-means++ over "
             "gradient embeddings (CM-ACC), active-feature = k-means++ over the keys, OHEM = "
             "the highest-loss candidates (paper Tables 2, 3).", "",
             "| l | test pairs | " + " | ".join(names[m] for m in cols) + " |",
             "|---" * (2 + len(cols)) + "|"]
    for l in chars:
        for test, title in TESTS:
            key = _floor_key("probe", test)
            lines.append(f"| {l} | {title.lower()} | "
                         + " | ".join(_cell(_runs(results, m, l, key)) for m in cols) + " |")
    pairs = [(m, "XMoCo") for m in ("CM-ACC", *samplers)] + [("CM-ACC", m) for m in samplers]
    pairs = list(dict.fromkeys((a, b) for a, b in pairs if a != b))
    return lines + _paired_lines(results, chars, pairs,
                                 "Samplers: differences, paired by seed")


DIVERSITY_ROWS = (("unique_per_m", "enqueued: unique/M"),  # window means
                  ("coverage", "enqueued: coverage"))


def _recorded(results, m, l, key) -> str:
    """A cell of the diversity tables: mean ± interval over the seeds that recorded ``key``;
    — where the method did not run at l, "not recorded" where its runs predate the record."""
    runs = _runs(results, m, l)
    values = [r[key] for r in runs if key in r]
    if not runs:
        return "—"
    if not values:
        return "not recorded"
    return _pm(values) + ("" if len(values) == len(runs) else
                          f" ({len(values)} of {len(runs)} runs recorded)")


def _diversity_lines(results, chars, methods) -> list[str]:
    """Negative diversity by the real characters: per l and method, the mean over the second
    half of training, and each sampler minus random (XMoCo), paired by seed."""
    methods = [m for m in methods if m in results["runs"]]
    if not methods:
        return []
    others = [m for m in methods if m != "XMoCo" and ALL_METHODS.get(m, ("", ""))[0] == "cross"]
    pairs = [(m, "XMoCo") for m in others] if "XMoCo" in methods else []
    law = results.get("diversity_law", {})
    lines = ["", "## Negative diversity by the real characters", "",
             "Which pairs each sampler enqueued into the dictionaries, counted by their "
             "characters position by position: U_i = distinct characters at position i among "
             "the M pairs of a step; unique/M = U_i / M (the paper's Fig. 3 metric), coverage = "
             "U_i / min(M, l_i) (1.0 = no sampler could do better); each the mean over the l "
             "positions and the two dictionaries (y's character is a bijection of x's at each "
             "position). Per position, not per tuple: from l = 3 there are more tuples than "
             "training pairs, so nearly every pair is its own tuple and unique/M of tuples is "
             "~1 for every sampler; a position's character is what the probe reads. Mean over "
             "the second half of each run's steps, ± 95% t-interval over seeds; random law = "
             "the expected value of a uniformly random batch of the training pairs (what "
             "XMoCo and SMoCo enqueue); the differences are paired by seed ('not recorded': "
             "runs from before this was measured). Freshness: the mean cosine between the "
             "keys a step enqueued and the keys of the same pairs by the current key encoders, "
             "every 10th step (1 = encoded now; XMoCo's batch keys are, with other BN groups; "
             "the active samplers enqueue the pool's keys, as old as the pool). The same "
             "measurement of the selection's inputs: the pool's stored keys of M random "
             "entries against the current key encoders' (NaN: no pool). Pretext accuracy, "
             "stored vs fresh: the step's queries against their positive and M random "
             "dictionary entries as stored, and the same entries re-encoded now (what the "
             "entries' age alone makes of the task)."]
    for key, name in (("unique_per_m", "unique/M"), ("coverage", "coverage"),
                      ("key_cos", "freshness of the enqueued keys"),
                      ("pool_cos", "freshness of the selection's inputs (pool keys)"),
                      ("acc_stored", "pretext accuracy against M stored dictionary entries"),
                      ("acc_fresh", "pretext accuracy against the same entries re-encoded")):
        lines += ["", f"### {name}, second half of training", "",
                  "| " + " | ".join(["l", "random law", *methods,
                                     *(f"{a} − {b}" for a, b in pairs)]) + " |",
                  "|---" * (2 + len(methods) + len(pairs)) + "|"]
        for l in chars:
            cells = ["—" if str(l) not in law or key not in law[str(l)]
                     else f"{law[str(l)][key]:.3f}"]
            cells += [_recorded(results, m, l, f"{key}_2nd_half") for m in methods]
            for a, b in pairs:
                d = paired_difference(results, a, b, l, f"{key}_2nd_half")
                ran = _runs(results, a, l) and _runs(results, b, l)
                cells.append(_signed(d) if d or not ran else "not recorded")
            lines.append(f"| {l} | " + " | ".join(cells) + " |")
        ceil = {l: law[str(l)]["unique_per_m_ceiling"] for l in chars
                if "unique_per_m_ceiling" in law.get(str(l), {})}
        if key == "unique_per_m" and ceil:  # how much room the measure leaves above random
            lines += ["", "The ceiling of unique/M (min(M, l_i) distinct characters at every "
                      "position): " + ", ".join(f"l = {l}: {c:.3f}" for l, c in ceil.items())
                      + "."]
    return lines


def _run_seconds(run) -> float:
    """A run's training + probe time (older mi.json files have no probe time)."""
    return run["seconds"] + run.get("probe_seconds", 0)


def _time_lines(results, chars, methods) -> list[str]:
    lines = ["", "## Run time", "",
             "Seconds per run (training + probe), mean over the seeds run.", "",
             "| l | " + " | ".join(methods) + " |", "|---" * (1 + len(methods)) + "|"]
    for l in chars:
        cells = []
        for m in methods:
            runs = _runs(results, m, l)
            secs = [_run_seconds(r) for r in runs]
            cells.append(f"{statistics.fmean(secs):.0f}" if secs else "—")
        lines.append(f"| {l} | " + " | ".join(cells) + " |")
    runs = [r for m in methods for l in chars for r in _runs(results, m, l)]
    in_tables = sum(_run_seconds(r) for r in runs)
    lines += ["", f"Whole study: {results['seconds'] / 60:.1f} min of compute (floors, probes "
              "and any runs set aside included, summed over resumed invocations); the "
              f"{len(runs)} runs in the tables: {in_tables / 60:.1f} min of training and probing."]
    return lines


NOT_RECORDED = "not recorded"


def _when_lines(results, chars, methods) -> list[str]:
    """When each run ran: its UTC start and end (ISO 8601) as mi.json records them, "not
    recorded" for runs of older studies, which lack them; and the first end among the runs
    that recorded one (what "declared before any of these runs finished" is checked against)."""
    rows = [(m, l, r) for m in dict.fromkeys(methods) for l in chars for r in _runs(results, m, l)]
    if not rows:
        return []
    lines = ["", "## When each run ran", "",
             "UTC, ISO 8601, as recorded when the run finished (its training and its probe); "
             f"'{NOT_RECORDED}': a run from before mi.json recorded it.", "",
             "| method | l | seed | started (UTC) | ended (UTC) |", "|---|---|---|---|---|"]
    for m, l, r in sorted(rows, key=lambda x: (x[2].get("started_utc") or "", x[0], x[1],
                                               x[2]["seed"])):
        lines.append(f"| {m} | {l} | {r['seed']} | {r.get('started_utc') or NOT_RECORDED} | "
                     f"{r.get('ended_utc') or NOT_RECORDED} |")
    ends = [r["ended_utc"] for _, _, r in rows if r.get("ended_utc")]
    missing = len(rows) - len(ends)
    if not ends:
        return lines + ["", f"None of these {len(rows)} runs recorded when it ran."]
    lines += ["", f"The first of these runs to finish ended at {min(ends)}"
              + (f"; {missing} of {len(rows)} runs did not record it." if missing else ".")]
    return lines


def _pm(values) -> str:
    """mean ± 95% t-interval over the values (seeds); one value says it is one row, not an
    interval of zero width."""
    return format_ci(values) + (ONE_ROW if len(values) == 1 else "")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _color(method: str) -> str:
    """One colour per method in every plot of every study (an unknown name: olive)."""
    names = list(ALL_METHODS)
    return f"C{names.index(method)}" if method in names else "tab:olive"


def _plot(results, png, methods=None):
    plt = _pyplot()
    methods = list(methods or results.get("methods", METHODS))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    ls = results["chars"]
    n_seeds = _seeds_run(results, methods, ls)
    for ax, (test, title) in zip(axes, TESTS):
        key, floor = _floor_key("probe", test), _floor_key("untrained", test)
        for m in methods:
            pts = [(l, mean_ci(v)) for l in ls if (v := _runs(results, m, l, key))]
            if pts:
                ax.errorbar([p[0] for p in pts], [p[1][0] for p in pts],
                            yerr=[0 if math.isnan(p[1][1]) else p[1][1] for p in pts],
                            marker="o", capsize=3, label=m, color=_color(m))
        fl = [(l, mean_ci(list(results[floor][str(l)].values()))[0]) for l in ls
              if results.get(floor, {}).get(str(l))]
        if fl:
            ax.plot([p[0] for p in fl], [p[1] for p in fl], color="grey", ls="--", marker=".",
                    label="untrained encoder")
        pix = _floor_key("pixels", test)
        px = [(l, results[pix][str(l)]) for l in ls if str(l) in results.get(pix, {})]
        if px:
            ax.plot([p[0] for p in px], [p[1] for p in px], color="black", ls=":", marker="x",
                    label="raw pixels (2x2-pooled)")
        ax.set_xlabel("number of characters l (MI = sum log l_i grows)")
        ax.set_title(f"test pairs: {title.lower()}; {n_seeds} seed(s) run, "
                     f"{results['n_train']} pairs", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("linear-probe character accuracy (mean ± 95% CI)")
    handles = drawn_handles(axes)
    if handles:
        axes[0].legend(list(handles.values()), list(handles), fontsize=8)
    fig.tight_layout()
    save_figure(fig, png)


def drawn_handles(axes) -> dict:
    """label → artist of every labelled line or error bar of ``axes`` that draws at least one
    finite point, first occurrence kept: a legend of these has no entry without a line."""
    import numpy as np

    out = {}
    for ax in np.ravel(axes):
        # an error bar's label is its container's; its data line is the container's first
        drawn = [(c.get_label(), c, c.lines[0]) for c in ax.containers if c.lines[0] is not None]
        drawn += [(line.get_label(), line, line) for line in ax.get_lines()]
        for label, handle, line in drawn:
            if not label or label.startswith("_") or label in out:
                continue
            y = np.asarray(line.get_ydata(), dtype=float)
            if y.size and np.isfinite(y).any():
                out[label] = handle
    return out


# what each row of the figures can be (lowest, highest), for the bands' clipping and the axes
ROW_RANGE = {"loss": (0.0, float("inf")), "acc": (0.0, 1.0), "unique_per_m": (0.0, 1.0),
             "coverage": (0.0, 1.0)}
# the least span of a row's shared y axis on a bounded figure: a mean that moves by 0.005
# over training is not drawn as a climb across the panel
MIN_SPAN = 0.1


def saturation(results, l) -> str | None:
    """At l, the panel note when unique/M is saturated: every position's alphabet has at most
    M characters (C <= M), so no sampler passes the ceiling min(M, l_i)/M and all sit at it;
    None where one position has more, or the sizes are not known."""
    sizes = results.get("alphabet_sizes", [])[:int(l)]
    m = results.get("config", {}).get("batch")
    if not m or len(sizes) < int(l) or max(sizes) > m:
        return None
    ceil = sum(min(m, c) / m for c in sizes) / len(sizes)  # the mean over positions of C/M
    return (f"saturated: C <= M = {m} at every position,\nso unique/M <= C/M = {ceil:.3f} for "
            "every sampler")


def curve_bands(runs, key, rng=(-float("inf"), float("inf"))) -> dict:
    """What _plot_curves draws of one method at one l: per window, the mean over the runs
    (seeds) and the 95% t-band clipped to ``rng`` (None from one run: no band), over the
    windows every run reached."""
    n = min(len(r[key]) for r in runs)
    stats = [mean_ci([r[key][i] for r in runs]) for i in range(n)]
    mean = [a for a, _ in stats]
    if len(runs) < 2:
        return dict(mean=mean, low=None, high=None)
    lo, hi = rng
    return dict(mean=mean, low=[min(max(a - h, lo), hi) for a, h in stats],
                high=[max(min(a + h, hi), lo) for a, h in stats])


def _plot_curves(results, png, rows=(("loss", "loss (window mean, nats)"),
                                     ("acc", "pretext accuracy (window mean)")), law=None,
                 title="training curves"):
    """Per-window figures of training (default: the loss, what the plateau rule reads, and the
    pretext accuracy), one column per l, mean over seeds per method with its 95% t-band
    (clipped to what the figure can be), on one y axis per row (at least ``MIN_SPAN`` tall for
    a bounded figure): where each run stopped, and whether it had flattened. ``law``: {l: {row
    key: value}}, drawn as a dashed line (random sampling's diversity), and unique/M's ceiling
    as a dotted one, with a note on the panel where it is saturated (``saturation``). The
    legend names only what is drawn. Nothing is drawn where no run recorded the rows."""
    import math

    plt = _pyplot()
    methods = [m for m in (*results.get("methods", METHODS), *results.get("samplers", ()))
               if m in results["runs"]]
    keys = [k for k, _ in rows]
    ls = [l for l in results["chars"]
          if any(r.get(k) for m in methods for r in _runs(results, m, l) for k in keys)]
    if not ls:
        return
    window = results["config"]["window"]
    width = 3.2 * len(ls) + 1.6  # the legend's column on the right
    fig, axes = plt.subplots(len(rows), len(ls), figsize=(width, 2.8 * len(rows)),
                             squeeze=False, sharex="col", sharey="row")
    for col, l in enumerate(ls):
        for row, (key, _) in enumerate(rows):
            ax = axes[row][col]
            rng = ROW_RANGE.get(key, (-math.inf, math.inf))
            for m in methods:
                runs = [r for r in _runs(results, m, l) if r.get(key)]
                if not runs:
                    continue
                b = curve_bands(runs, key, rng)
                x = [window * (i + 1) for i in range(len(b["mean"]))]
                ax.plot(x, b["mean"], label=m, color=_color(m), **point_marks(b["mean"]))
                if b["low"] is not None:
                    ax.fill_between(x, b["low"], b["high"], color=_color(m), alpha=0.18,
                                    lw=0)
            if law and str(l) in law and key in law[str(l)]:
                ax.axhline(law[str(l)][key], color="grey", ls="--", lw=1, label="random law")
            if key == "unique_per_m" and law and "unique_per_m_ceiling" in law.get(str(l), {}):
                ax.axhline(law[str(l)]["unique_per_m_ceiling"], color="black", ls=":", lw=1,
                           label="ceiling min(M, l_i)/M")
            if key == "unique_per_m" and (note := saturation(results, l)):
                ax.text(0.03, 0.04, note, transform=ax.transAxes, fontsize=6,
                        color="firebrick", va="bottom")
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(f"l = {l}", fontsize=9)
            if row == len(rows) - 1:
                ax.set_xlabel("step")
    for row, (key, label) in enumerate(rows):
        axes[row][0].set_ylabel(label)
        lo, hi = axes[row][0].get_ylim()  # shared by the row's panels
        bound = ROW_RANGE.get(key, (-math.inf, math.inf))
        if math.isfinite(bound[1]) and hi - lo < MIN_SPAN:
            mid = (lo + hi) / 2
            lo, hi = mid - MIN_SPAN / 2, mid + MIN_SPAN / 2
            shift = max(0.0, bound[0] - lo) - max(0.0, hi - bound[1])
            axes[row][0].set_ylim(lo + shift, hi + shift)
    handles = drawn_handles(axes)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="center right", fontsize=7)
    n_seeds = _seeds_run(results, methods, ls)
    fig.suptitle(f"{title},\nmean ± 95% t-band over the {n_seeds} seed(s) run (no band "
                 "from one)", fontsize=8, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1 - 1.6 / width, 0.93))
    save_figure(fig, png)
