"""Two runs of the MI study side by side, paired by seed: one method of one study against one
method of another (or of the same) study, on the same pairs.

    python -m cmacc.apps.mi.compare runs/mi_cmacc:CM-ACC runs/mi_xmoco_long:XMoCo [--chars 3]

What it is for: settings that one study cannot hold, e.g. CM-ACC at 600 steps against XMoCo
given CM-ACC's compute (more steps: another ``--max-steps``, so another ``--out``). Each side
is ``STUDY:METHOD`` (STUDY = a study's ``--out`` folder or its ``mi.json``). The two studies must
have drawn the same pairs (alphabets, relation, training/test/probe pair counts): a seed then
means the same pairs order and initial encoders in both, and the differences are paired by
seed. Printed, per l both ran: steps, wall and CPU seconds of training per run, the probe on
both test sets, the enqueued negatives' diversity and their keys' freshness (second half of
training), each side's
mean ± 95% t-interval over the seeds both ran, and the first minus the second per seed with
its interval; then when each paired run started and ended (UTC, as mi.json records it; "not
recorded" for older studies) and the settings in which the two studies differ.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

from cmacc.metrics import format_interval, mean_ci
from data_dali.cli import ArgumentParser, UserError, command

from .train import MIConfig

# what must be equal for a seed to mean the same pairs in both studies
SAME_DATA = ("alphabets", "relation", "n_train", "n_test", "n_probe", "char_dist")
# the per-run figures compared: (mi.json key, label)
FIGURES = (("probe", "probe, held-out drawers"), ("probe_seen", "probe, seen drawings"),
           ("probe_held_out_tail", "probe, held-out drawers, tail characters"),
           ("probe_seen_tail", "probe, seen drawings, tail characters"),
           ("unique_per_m_2nd_half", "negatives unique/M, 2nd half"),
           ("coverage_2nd_half", "negatives coverage, 2nd half"),
           ("key_cos_2nd_half", "enqueued keys' cosine to fresh keys, 2nd half"),
           ("pool_cos_2nd_half", "pool keys' cosine to fresh keys, 2nd half"),
           ("acc_stored_2nd_half", "pretext accuracy, M stored entries, 2nd half"),
           ("acc_fresh_2nd_half", "pretext accuracy, the entries re-encoded, 2nd half"),
           ("post_entropy_rel_2nd_half", "pseudo-posterior entropy / log M, 2nd half"),
           ("gnorm_cv_2nd_half", "|g_n| coefficient of variation, 2nd half"),
           ("d2_cv_2nd_half", "D^2 weights after 1 centre, std/mean, 2nd half"),
           ("d2_cv_8_2nd_half", "D^2 weights after 8 centres, std/mean, 2nd half"),
           ("hard_acc_active_2nd_half", "pretext accuracy, CM-ACC's picks, 2nd half"),
           ("hard_acc_uniform_2nd_half", "pretext accuracy, uniform picks, 2nd half"),
           ("hard_acc_gap_2nd_half", "pretext accuracy, CM-ACC's picks − uniform picks "
                                     "(same queries), 2nd half"),
           ("hard_loss_gap_2nd_half", "InfoNCE loss, CM-ACC's picks − uniform picks, 2nd half"),
           ("hard_cos_max_gap_2nd_half", "closest negative's cosine, CM-ACC's − uniform, "
                                         "2nd half"))


def load_side(spec: str) -> tuple[dict, str, str]:
    """``STUDY:METHOD`` → (the study's results, the method, the study's path as given)."""
    path, sep, method = spec.rpartition(":")
    if not sep or not path or not method:
        raise UserError(f"{spec!r}: give a side as STUDY:METHOD, e.g. runs/mi:CM-ACC")
    f = Path(path)
    f = f / "mi.json" if f.is_dir() else f
    if not f.is_file():
        raise UserError(f"{path}: no MI study there (no mi.json): give a study's --out folder")
    try:
        results = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{f}: not a readable mi.json ({e})") from None
    if method not in results.get("runs", {}):
        ran = ", ".join(sorted(results.get("runs", {}))) or "none"
        raise UserError(f"{path}: method {method!r} has no runs there (it has: {ran})")
    return results, method, path


def check_same_data(a: dict, b: dict, name_a: str, name_b: str) -> None:
    """A UserError naming the first data setting in which the two studies differ."""
    for key in SAME_DATA:
        if a.get(key) != b.get(key):
            raise UserError(f"{name_a} and {name_b} drew different pairs ({key}: {a.get(key)} vs "
                            f"{b.get(key)}): runs of one seed are not paired; compare studies "
                            "with the same data settings")


def _runs(results, method, l) -> dict[int, dict]:
    return {r["seed"]: r for r in results["runs"].get(method, {}).get(str(l), [])}


def compare(a: dict, ma: str, b: dict, mb: str, l: int) -> dict:
    """The figures of method ``ma`` of study ``a`` and ``mb`` of ``b`` at l, over the seeds
    both ran (``seeds``): per side the mean ± half-width of steps, seconds, cpu_seconds and
    each of ``FIGURES``; ``diff``: (a − b) per seed that both recorded, with its mean and
    half-width."""
    ra, rb = _runs(a, ma, l), _runs(b, mb, l)
    seeds = sorted(set(ra) & set(rb))
    out = {"l": l, "seeds": seeds, "a": {}, "b": {}, "diff": {}}
    for side, runs in (("a", ra), ("b", rb)):
        for key in ("steps", "seconds", "cpu_seconds", *(k for k, _ in FIGURES)):
            vals = [runs[s][key] for s in seeds if key in runs[s]]
            out[side][key] = (*mean_ci(vals), len(vals)) if vals else None
    for key, _ in FIGURES:
        d = [ra[s][key] - rb[s][key] for s in out["seeds"] if key in ra[s] and key in rb[s]]
        out["diff"][key] = {"per_seed": d, **dict(zip(("mean", "half"), mean_ci(d)))} if d else None
    # when each paired run ran (UTC, ISO 8601; None where its mi.json predates the record)
    out["when"] = {side: {s: (runs[s].get("started_utc"), runs[s].get("ended_utc"))
                          for s in seeds} for side, runs in (("a", ra), ("b", rb))}
    return out


def when_lines(cmp: list[dict], name_a: str, name_b: str) -> list[str]:
    """Per l and side, each paired seed's UTC start – end as recorded ("not recorded" for runs
    of older studies), and the first end among them."""
    lines, ends = [], []
    for c in cmp:
        for side, name in (("a", name_a), ("b", name_b)):
            spans = []
            for seed, (start, end) in c["when"][side].items():
                spans.append(f"seed {seed} " + ("not recorded" if not (start or end) else
                                                f"{start or 'not recorded'} – "
                                                f"{end or 'not recorded'}"))
                ends += [end] if end else []
            lines.append(f"l = {c['l']}, {name}: " + "; ".join(spans))
    first = f"first end: {min(ends)}" if ends else "no run recorded when it ran"
    return ["when the runs ran (UTC, ISO 8601; " + first + "):", *lines]


def config_differences(a: dict, b: dict) -> list[str]:
    """'key: a vs b' for every training setting in which the two studies differ (a setting
    an older mi.json lacks had its default then)."""
    defaults = dataclasses.asdict(MIConfig())
    ca, cb = {**defaults, **a.get("config", {})}, {**defaults, **b.get("config", {})}
    return [f"{k}: {ca.get(k)} vs {cb.get(k)}" for k in sorted(set(ca) | set(cb))
            if ca.get(k) != cb.get(k)]


def _pm(stat, digits=3) -> str:
    return "not recorded" if stat is None else format_interval(*stat[:2], digits=digits)


def verdict(mean: float, half: float, margin: float) -> str:
    """A paired difference's 95% interval [mean - half, mean + half] read against an
    equivalence margin declared before the runs: "better" / "worse" when it excludes 0 (",
    within the margin" when it also lies inside ±margin), "equivalent" when it holds 0 and lies
    inside ±margin, "undetermined" otherwise (and with fewer than 2 seeds: no interval)."""
    if not math.isfinite(half):
        return "undetermined"
    lo, hi = mean - half, mean + half
    inside = -margin <= lo and hi <= margin
    if lo > 0 or hi < 0:
        return ("better" if lo > 0 else "worse") + (", within the margin" if inside else "")
    return "equivalent" if inside else "undetermined"


def table(cmp: list[dict], name_a: str, name_b: str, margin: float | None = None) -> list[str]:
    """Markdown lines: one row per l and figure (with ``margin``: a verdict per probe row)."""
    extra = (f" verdict (margin ±{margin:g}) |", "---|") if margin is not None else ("", "")
    lines = [f"| l | figure | {name_a} | {name_b} | first − second (per seed) |" + extra[0],
             "|---|---|---|---|---|" + extra[1]]
    for c in cmp:
        for key, label in (("steps", "steps"), ("seconds", "training s per run (wall)"),
                           ("cpu_seconds", "training s per run (CPU)")):
            lines.append(f"| {c['l']} | {label} | {_pm(c['a'][key], 0)} | "
                         f"{_pm(c['b'][key], 0)} | |" + (" |" if margin is not None else ""))
        for key, label in FIGURES:
            d = c["diff"][key]
            cell = "—" if d is None else (
                format_interval(d["mean"], d["half"], signed=True)
                + " (" + ", ".join(f"{v:+.3f}" for v in d["per_seed"]) + ")")
            call = ""
            if margin is not None:
                call = (f" {verdict(d['mean'], d['half'], margin)} |"
                        if d is not None and key.startswith("probe") else " |")
            lines.append(f"| {c['l']} | {label} | {_pm(c['a'][key])} | {_pm(c['b'][key])} | "
                         f"{cell} |" + call)
    return lines


@command
def main(argv=None):
    p = ArgumentParser(prog="python -m cmacc.apps.mi.compare", description=__doc__)
    p.add_argument("first", metavar="STUDY:METHOD", help="e.g. runs/mi:CM-ACC")
    p.add_argument("second", metavar="STUDY:METHOD", help="e.g. runs/mi_long:XMoCo")
    p.add_argument("--chars", type=int, nargs="+",
                   help="the l to compare (default: every l both sides ran)")
    p.add_argument("--margin", type=float, metavar="E",
                   help="an equivalence margin on the probes' paired differences, declared "
                        "before the runs (e.g. 0.02): each probe row gets a verdict, better / "
                        "equivalent / worse / undetermined, from its 95%% interval")
    args = p.parse_args(argv)
    if args.margin is not None and not args.margin > 0:
        p.error("--margin: a positive number, e.g. 0.02")
    a, ma, na = load_side(args.first)
    b, mb, nb = load_side(args.second)
    check_same_data(a, b, na, nb)
    both = sorted(set(map(int, a["runs"][ma])) & set(map(int, b["runs"][mb])))
    chars = args.chars or both
    if missing := [l for l in chars if l not in both]:
        raise UserError(f"--chars {' '.join(map(str, missing))}: not run by both sides "
                        f"(both ran l = {', '.join(map(str, both)) or 'none'})")
    cmp = [compare(a, ma, b, mb, l) for l in chars]
    if not any(c["seeds"] for c in cmp):
        raise UserError(f"{na} and {nb}: no seed run by both sides: nothing to pair")
    print(f"first: {na} {ma}; second: {nb} {mb}; paired by seed "
          f"({', '.join(str(s) for s in cmp[0]['seeds'])}); mean ± 95% t-interval over seeds\n")
    print("\n".join(table(cmp, f"{ma} ({Path(na).name})", f"{mb} ({Path(nb).name})",
                           args.margin)))
    print("\n" + "\n".join(when_lines(cmp, f"{ma} ({Path(na).name})",
                                        f"{mb} ({Path(nb).name})")))
    diffs = config_differences(a, b)
    print("\nsettings that differ: " + ("; ".join(diffs) if diffs else "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
