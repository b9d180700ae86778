"""The study: every run of the plan (seeds, l, methods, samplers), the floors, resuming from
mi.json, and the departures from the paper's protocol."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import torch

from cmacc.metrics import expected_unique
from data_dali.classdist import zipf_exponent
from data_dali.cli import UserError, eta
from data_dali.fileio import atomic_write_text

from .data import (PAPER_ALPHABET_SIZES, PAPER_TRAIN_PAIRS, TRAIN_DRAWERS, Glyphs,
                   MultiOmniglotPairs, check_glyphs)
from .partial import utc_now
from .probe import probe_accuracy
from .report import _floor_key, write_outputs
from .train import (DEPARTURE_WHY, METHODS, PAPER_CONFIG, SAMPLERS, MIConfig, build_model,
                    selects, train_one)


def departures(glyphs: Glyphs, chars, n_train, cfg: MIConfig, relation, seeds,
               char_dist="uniform") -> list[str]:
    """Every way this run differs from the paper's protocol (appendix; Ozair et al. 2019)."""
    d = []
    if glyphs.sizes[:len(PAPER_ALPHABET_SIZES)] != list(PAPER_ALPHABET_SIZES)[:len(glyphs.sizes)]:
        d.append(f"alphabets: {', '.join(f'{n} {s}' for n, s in zip(glyphs.names, glyphs.sizes))}"
                 f" (paper: Tifinagh 55, Hiragana 52, ... Mkhedruli 41), so the MI at each l is "
                 "lower than the paper's")
    if max(chars) < 9:
        d.append(f"l up to {max(chars)} (paper: 1..9)")
    if n_train != PAPER_TRAIN_PAIRS:
        d.append(f"{n_train} training pairs (paper: {PAPER_TRAIN_PAIRS})")
    d.append(f"y's relation to x: '{relation}' (the appendix does not state it; 'next' is Ozair "
             "et al.'s construction as public reproductions build it)")
    d.append(f"encoder: a 4-layer CNN of width {cfg.width} (features d_h = {4 * cfg.width}) with "
             "global average pooling (the appendix does not name the encoder for this study; "
             "width 16 runs ~2.5x faster than 32 on a CPU at l >= 4), "
             f"{'with' if cfg.fcl else 'no'} fcl")
    d.append(f"drawers 0..{TRAIN_DRAWERS - 1} for training pairs, the others for the probe's "
             "test pairs (not stated in the appendix); the probe is also scored on new pairs "
             "of the training drawers' own drawings ('seen drawings')")
    if cfg.fresh_picks:
        d.append("fresh picks (--fresh-picks): the active samplers' picks are re-encoded by the "
                 "current key encoders before they are enqueued; Algorithm 1 enqueues the "
                 "pool's keys as encoded when the pool was drawn")
    if zipf_exponent(char_dist) > 0:
        d.append(f"a long tail (--char-dist {char_dist}): in the training pairs character c of "
                 "an alphabet is drawn with probability ∝ 1 / (c + 1)^S (the paper's are "
                 "uniform); the test pairs stay uniform, and probe_*_tail scores the rarer half "
                 "of each alphabet in the training pairs")
    if cfg.pool_refresh:
        d.append(f"pool refresh (--pool-refresh {cfg.pool_refresh}): {cfg.pool_refresh} batches "
                 "of the pool's pairs re-encoded per step by the current key encoders, round "
                 f"robin, so no candidate is older than {cfg.pool_mult / cfg.pool_refresh:g} "
                 "steps; Algorithm 1's pool keys are as old as the pool")
    d.append("the dictionaries start as K random unit vectors (no pair behind them), replaced "
             "as the first K / M steps enqueue; Algorithm 1 (lines 3-4) starts them with K "
             "encoded samples")
    tau = 1 / (1 - cfg.momentum)
    d.append(f"momentum m = {cfg.momentum}: the key encoders' time constant 1 / (1 - m) = "
             f"{tau:g} steps; an epoch of {n_train // cfg.batch} steps is "
             f"{n_train // cfg.batch / tau:.2f} time constants, the age of an epoch pool's "
             "keys at the epoch's end without pool refresh (paper: m = 0.999 and 50,000 pairs "
             "at M = 128, 0.39)")
    for name, paper in PAPER_CONFIG.items():
        if getattr(cfg, name) != paper:
            d.append(f"{name} = {getattr(cfg, name)} (paper: {paper}){DEPARTURE_WHY.get(name, '')}")
    d.append(f"training stops at a loss plateau (window-mean loss falls < {cfg.tol} nats per "
             f"window for {cfg.patience} windows, counted from step "
             f"{max(cfg.warmup, cfg.min_steps)}) or at {cfg.max_steps} steps, the same budget "
             "for every objective (the paper does not state its schedule)")
    d.append(f"seeds {list(seeds)}; the probe: multinomial logistic regression (L-BFGS) on the "
             "frozen backbone features, one per position, mean accuracy")
    return d


def default_sampler_chars(chars) -> list[int]:
    """Where the samplers are compared by default: the two largest l >= 3 of the study (the
    high-MI settings, e^MI above the 50,000 training pairs)."""
    return sorted(l for l in chars if l >= 3)[-2:]


def plan(chars, seeds, methods, sampler_chars, samplers) -> list[tuple[int, int, str]]:
    """The study's runs (seed, l, method) in the order they train: first the curve (every l,
    ``methods``), then ``samplers`` at ``sampler_chars``; seeds outermost in each, so a study
    stopped early holds whole curves of its first seeds, and the claim before the samplers."""
    curve = [(seed, l, m) for seed in seeds for l in chars for m in methods]
    return curve + [(seed, l, m) for seed in seeds for l in chars if l in sampler_chars
                    for m in samplers]


def _settings(glyphs: Glyphs, chars, cfg: MIConfig, relation, n_train, n_test, n_probe,
              char_dist="uniform") -> dict:
    """What a run's figures depend on besides (seed, l, method): a resumed study must match."""
    return {"alphabets": glyphs.names[:max(chars)], "alphabet_sizes": glyphs.sizes[:max(chars)],
            "relation": relation, "n_train": n_train, "n_test": n_test, "n_probe": n_probe,
            "config": dataclasses.asdict(cfg),
            **({"char_dist": char_dist} if zipf_exponent(char_dist) > 0 else {})}


def _resume(path: Path, settings: dict) -> dict:
    """The figures of an earlier study in ``path`` with the same settings (a study resumes:
    its finished runs are kept), or empty ones; a UserError if the settings differ."""
    empty = {"mi": {}, "untrained": {}, "untrained_seen": {}, "pixels": {}, "pixels_seen": {},
             "diversity_law": {}, "runs": {}, "runs_other_pool": {}, "seconds": 0.0}
    if not path.exists():
        return empty
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable ({e}); move it away or pass another --out") from None
    defaults = dataclasses.asdict(MIConfig())

    def same(k):
        # a shorter earlier study of the same alphabets is still the same study
        a, b = old.get(k), settings[k]
        if k in ("alphabets", "alphabet_sizes") and isinstance(a, list):
            n = min(len(a), len(b))
            return a[:n] == b[:n]
        if k == "config" and isinstance(a, dict):  # the pool is a setting of each active run
            pool = {"pool_mult": None, "pool_mode": None}
            # a field an older mi.json lacks had its default then
            return {**defaults, **a, **pool} == {**b, **pool}
        return a == b
    diff = [k for k in settings if not same(k)]
    if diff:
        what = "; ".join(_differences(k, old.get(k), settings[k]) for k in diff)
        raise UserError(f"{path}: a study with other settings ({what}); pass another --out, or "
                        "the same settings to resume it")
    return {k: old.get(k, v) for k, v in empty.items()}


def _say(line: str) -> None:
    """A progress line on stdout, at once (a log file or pipe gets it as it happens)."""
    print(line, flush=True)


def _differences(key, there, now) -> str:
    """``key: A there, B now``; of two dicts (the config), only the fields that differ, by
    name: ``config.max_steps: 60 there, 80 now``."""
    if isinstance(there, dict) and isinstance(now, dict):
        keys = [k for k in sorted(set(there) | set(now)) if there.get(k) != now.get(k)
                and k not in ("pool_mult", "pool_mode")]  # (the pool: a setting of each run)
        if keys:
            return "; ".join(f"{key}.{k}: {there.get(k)!r} there, {now.get(k)!r} now"
                             for k in keys)
    return f"{key}: {there!r} there, {now!r} now"


def _run_done(results, seed, l, m) -> bool:
    return any(r["seed"] == seed for r in results["runs"].get(m, {}).get(str(l), []))


def _pool(run) -> tuple:
    """An active run's pool: (size multiple, mode); runs of older mi.json files, which had no
    pool mode, had the rolling pool."""
    return run.get("pool_mult"), run.get("pool_mode", "rolling")


def _drop_other_pools(results, cfg: MIConfig) -> int:
    """Move the runs of the active samplers that had another pool (size or mode) out of
    ``runs`` into ``runs_other_pool`` (kept in mi.json, never deleted; the study trains them
    again; the random samplers never read the pool and stay). Returns how many were moved."""
    moved, pool = 0, (cfg.pool_mult, cfg.pool_mode)
    for m, per_l in results["runs"].items():
        if not selects(m):
            continue
        for l, runs in per_l.items():
            keep = [r for r in runs if _pool(r) == pool]
            other = [r for r in runs if _pool(r) != pool]
            results["runs_other_pool"].setdefault(m, {}).setdefault(l, []).extend(other)
            moved += len(other)
            per_l[l] = keep
    return moved


def diversity_law(pairs: MultiOmniglotPairs, m: int) -> dict[str, float]:
    """What random sampling's enqueue (a uniformly random batch of m training pairs: XMoCo's,
    SMoCo's) has by chance, per ``train.character_diversity``: E[U_i] / m and
    E[U_i] / min(m, l_i), E[U_i] the expected distinct characters at position i among m pairs
    drawn without replacement (``cmacc.metrics.expected_unique``), each the mean over the
    positions."""
    e = [expected_unique(torch.bincount(pairs.labels[:, i], minlength=size).tolist(), m)
         for i, size in enumerate(pairs.sizes)]
    return {"unique_per_m": sum(u / m for u in e) / len(e),
            "coverage": sum(u / min(m, size) for u, size in zip(e, pairs.sizes)) / len(e),
            # what no sampler can pass: min(m, l_i) distinct characters at position i
            "unique_per_m_ceiling": sum(min(m, size) / m for size in pairs.sizes) / len(e)}


def run(root, out, chars=(1, 2, 3, 4, 6, 8), cfg: MIConfig | None = None,
        n_train=PAPER_TRAIN_PAIRS, n_test=2000, n_probe=10_000, seeds=(0, 1, 2),
        methods=tuple(METHODS), relation="next", sampler_chars=None,
        samplers=tuple(SAMPLERS), log=None, verbose=False, char_dist="uniform",
        quick=False) -> dict:
    """Train and probe every run of ``plan``; ``mi.json`` in ``out`` is rewritten after each
    one, and runs already there (same settings) are kept, not trained again."""
    cfg = cfg or MIConfig()
    log = log or _say
    glyphs = Glyphs(root)
    check_glyphs(glyphs, root, max(chars))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sampler_chars = default_sampler_chars(chars) if sampler_chars is None else list(sampler_chars)
    settings = _settings(glyphs, chars, cfg, relation, n_train, n_test, n_probe, char_dist)
    results = {**settings, **_resume(out / "mi.json", settings)}
    results.update({"chars": list(chars), "seeds": list(seeds), "methods": list(methods),
                    "samplers": list(samplers), "sampler_chars": sampler_chars,
                    "complete": False,  # True once every run of the plan is in
                    "quick": bool(quick),  # --quick: a test setting, not a result
                    "machine": machine(),
                    "departures": departures(glyphs, chars, n_train, cfg, relation, seeds,
                                             char_dist)})
    dropped = _drop_other_pools(results, cfg)
    if dropped:
        log(f"{out / 'mi.json'}: {dropped} runs of the active samplers had another pool than "
            f"--pool-mult {cfg.pool_mult} --pool-mode {cfg.pool_mode}; they are trained again "
            "(the old ones are kept in mi.json under runs_other_pool)")
    todo = plan(chars, seeds, methods, sampler_chars, samplers)
    kept = sum(_run_done(results, *r) for r in todo)
    if kept:
        log(f"resuming {out / 'mi.json'}: {kept} of {len(todo)} runs already there, kept")
    n_drawers = glyphs.bank[0].shape[1]
    data = {}  # l -> (train pairs, test sets), built on first use

    def pairs(l):
        if l not in data:
            # a long tail (--char-dist) in the training pairs only: the test pairs stay uniform,
            # so that every character is tested, the tail's as often as the head's
            tr = MultiOmniglotPairs(glyphs, l, n_train, seed=1000 * l, relation=relation,
                                    drawers=range(0, TRAIN_DRAWERS), char_dist=char_dist)
            te = MultiOmniglotPairs(glyphs, l, n_test, seed=1000 * l + 1, relation=relation,
                                    drawers=range(TRAIN_DRAWERS, n_drawers))
            # new pairs of the training drawers' own drawings: what a probe measures when the
            # test images were seen in training (how the paper's near-1.0 floor can arise)
            ts = MultiOmniglotPairs(glyphs, l, n_test, seed=1000 * l + 2, relation=relation,
                                    drawers=range(0, TRAIN_DRAWERS))
            data.clear()  # one l at a time in memory
            tail = tr.tail() if zipf_exponent(char_dist) > 0 else None  # (zipf:0 is uniform)
            data[l] = tr, {"held_out": te, "seen": ts}, tail
        return data[l]

    def save():
        atomic_write_text(out / "mi.json", json.dumps(results, indent=2))

    t_last = time.perf_counter()

    def tick():  # this study's compute time, summed over resumed invocations
        nonlocal t_last
        now = time.perf_counter()
        results["seconds"] += now - t_last
        t_last = now

    t_start, n_done, n_new = time.perf_counter(), kept, 0  # "run i of N" and the ETA
    for seed, l, m in todo:
        if _run_done(results, seed, l, m):
            continue
        tr, tests, tail = pairs(l)
        results["mi"][str(l)] = tr.mutual_information
        results["diversity_law"][str(l)] = diversity_law(tr, cfg.batch)
        if str(l) not in results["pixels"]:
            pixels = probe_accuracy(None, tr, tests, n_probe, tail)  # the floor without an encoder
            for k, v in pixels.items():
                results.setdefault(_floor_key("pixels", k), {})[str(l)] = v
            log(f"l={l} pixels: probe {pixels['held_out']:.3f} (seen drawings "
                f"{pixels['seen']:.3f})")
        if str(seed) not in results["untrained"].get(str(l), {}):
            # the floor: the same encoder at initialisation
            floor = probe_accuracy(build_model(methods[0] if methods else m, cfg, seed), tr,
                                   tests, n_probe, tail)
            for k, v in floor.items():
                results.setdefault(_floor_key("untrained", k), {}).setdefault(str(l), {})[
                    str(seed)] = v
            log(f"l={l} (MI {tr.mutual_information:.2f} nats) seed {seed} untrained: probe "
                f"{floor['held_out']:.3f} (seen drawings {floor['seen']:.3f})")
        # a stopped run's state, written every window: the run continues from it
        part = out / "partial" / f"{m}_l{l}_seed{seed}.pt"
        model, hist = train_one(m, tr, cfg, seed, log=log if verbose else None,
                                partial_path=part)
        t0 = time.perf_counter()
        acc = probe_accuracy(model, tr, tests, n_probe, tail)
        hist["probe_seconds"] = time.perf_counter() - t0
        # when it ran, so that "declared before any of these runs finished" can be checked
        # against the record (runs of older mi.json files lack these: "not recorded")
        hist["ended_utc"] = utc_now()  # started_utc: train_one's, kept when it continues
        if selects(m):
            hist["pool_mult"], hist["pool_mode"] = cfg.pool_mult, cfg.pool_mode
            hist["tau_p"] = cfg.tau_p
        results["runs"].setdefault(m, {}).setdefault(str(l), []).append(
            {"seed": seed, **{_floor_key("probe", k): v for k, v in acc.items()}, **hist})
        n_done, n_new = n_done + 1, n_new + 1
        left = eta(len(todo) - n_done, n_new, time.perf_counter() - t_start)
        log(f"run {n_done} of {len(todo)} (eta {left}): l={l} seed {seed} {m}: probe "
            f"{acc['held_out']:.3f} (seen drawings "
            f"{acc['seen']:.3f})  ({hist['steps']} steps, {hist['stop']}, pretext acc "
            f"{hist['acc'][-1]:.3f}, {hist['seconds']:.0f} s)")
        tick()
        save()  # each finished run is on disk at once: a stopped study keeps it
        part.unlink(missing_ok=True)  # recorded: its partial state is no longer needed
    tick()
    results["complete"] = True
    save()
    write_outputs(results, out)
    return results


def machine() -> dict:
    """Where the figures (run times above all) were measured."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    # the vector ISA torch's CPU kernels dispatch to (AVX2, AVX512, ...): floating-point
    # results, and a run's per-seed figures with them, can differ between two of these
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "isa": torch.backends.cpu.get_cpu_capability()}
