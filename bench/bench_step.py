"""What active sampling adds to a training step: random against active on the same model.

One row per setting and sampler; every row times whole training steps (data, forward,
backward, optimiser update) with the model's own section timer (cmacc/metrics.py
``SectionTimer``, the one train.py logs with), and splits each step into

    data          waiting for the batch (MI: rendering the pairs' images; video: the loader)
    select        the active selection of both dictionaries (kernels.select: gradient-embedding
                  factors + k-means++, or the feature / OHEM samplers), in total ...
    visible       ... and the part the step waited for (on a GPU the selection can run beside
                  the key encoders on a side stream, --overlap; on a CPU all of it is visible)
    reencode      --pool-refresh R: R batches of the pool re-encoded by the key encoders
                  (the clips read again, then encoded; rows "active R=..." beside R = 0)
    fwd+bwd       the rest of the step: forward, backward, update, momentum, keys, enqueue
    step          the whole step, data included

Both samplers of a setting start from the same weights (same seed) and the same candidate pool,
filled once before the timed steps (and copied into the second model) so that the active
sampler selects from the first of them:
``encode`` pools are the key encoders' outputs of real batches (as a rolling pool holds
them), ``random`` pools are random unit keys (the `paper` preset on a CPU, where encoding
300 M clips would take many minutes; the selection's cost does not depend on the keys beyond
the few candidates the lazy race touches). Settings:

    mi        the MI study's nets (cmacc/apps/mi: SmallCNN width 16, M = 128, K = 30 M,
              shuffle-BN in 4 groups, channels-last) at l characters and N = pool_mult * M
              (60 M: the study's CPU default; 300 M: the paper's), on Omniglot (--omniglot
              ROOT, torchvision's layout) or generated stand-in glyphs (the default; the same
              image sizes and nets)
    tiny      train.py --preset tiny (synthetic in-memory clips, M = 16, N = 192)
    paper     train.py --preset paper's encoders (r3d_18-sized video, ResNet-18 1-D audio,
              16 x 112 x 112 clips) at a CPU-sized batch (--paper-batch, default 4) with
              K = 30 M and N = 300 M, fp32 (bf16 autocast is emulated on CPUs without
              AVX-512 BF16)

Per-step figures are means over --steps timed steps after --warmup untimed ones. The ratio
column is the active step over the random step of the same setting; "1 + visible / random" is
what the selection alone adds (its visible time over the random step), which the noise of the
two rows' forward/backward times does not move. On a GPU (--device cuda)
the same rows run with CUDA events (``make gpu-check`` runs them).

    python bench/bench_step.py                                  # every row, CPU
    python bench/bench_step.py --rows mi --chars 3 --pool-mults 300 --steps 20
    python bench/bench_step.py --rows tiny paper --out bench/results
    python bench/bench_step.py --rows mi --chars 3 --pool-mults 300 --pool-refresh 0 1 4
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import env_info  # noqa: E402
from cmacc import metrics  # noqa: E402

ROWS = ("mi", "tiny", "paper")
SECTIONS = ("data", "select", "visible", "reencode", "fwd_bwd", "step")


@dataclasses.dataclass
class Setting:
    """A model, its optimiser and a batch source for one sampler, ready to time."""
    name: str
    sampler: str
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    next_batch: object  # () -> (video, audio, index)
    pool: str  # how the pool was filled: encode | random
    n_pool: int
    m: int
    refresh: int = 0  # --pool-refresh R


# ---------------------------------------------------------------------------------------------
# the settings
# ---------------------------------------------------------------------------------------------
def glyph_root(omniglot: str | None, tmp: Path) -> Path:
    from cmacc.apps.mi.data import make_glyphs

    if omniglot:
        return Path(omniglot)
    return make_glyphs(tmp / "glyphs", alphabets=8, chars=12, drawers=20)


def mi_setting(sampler: str, l: int, pool_mult: int, glyphs, seed=0, device="cpu",
               fill=True, refresh=0, **sizes) -> Setting:
    """``sizes``: MIConfig fields to change (e.g. batch, width) beside the pool."""
    from cmacc.apps.mi.data import TRAIN_DRAWERS, MultiOmniglotPairs
    from cmacc.apps.mi.train import MIConfig, build_model

    cfg = MIConfig(pool_mult=pool_mult, pool_refresh=refresh, **sizes)
    method = {"random": "XMoCo", "active": "CM-ACC"}[sampler]
    model = build_model(method, cfg, seed).to(device)
    opt = torch.optim.Adam(model.query_parameters(), lr=cfg.lr)
    pairs = MultiOmniglotPairs(glyphs, l, 50_000, seed=1000 * l, drawers=range(TRAIN_DRAWERS))
    model.fetch = lambda index: tuple(t.to(device) for t in pairs.batch(index.cpu()))
    g = torch.Generator().manual_seed(seed)

    def next_batch():
        idx = torch.randint(0, len(pairs), (cfg.batch,), generator=g)
        x, y = pairs.batch(idx)
        return x, y, idx

    n = cfg.pool_mult * cfg.batch
    if fill:
        _fill_by_encoding(model, next_batch, n, device)
    return Setting(f"MI l={l} N={pool_mult}M", sampler, model, opt, next_batch, "encode", n,
                   cfg.batch, refresh)


def video_setting(sampler: str, preset: str, batch: int | None, seed=0, device="cpu",
                  fill=True, refresh=0) -> Setting:
    from cmacc.config import PRESETS
    from cmacc.data import clip_fetcher, train_loader
    from cmacc.model import CMACC

    cfg = PRESETS[preset]
    model_cfg, sel_cfg = cfg.model, cfg.selection
    if batch is not None:  # a CPU-sized batch: K and N keep their multiples of M
        model_cfg = dataclasses.replace(model_cfg, batch_size=batch,
                                        dict_size=model_cfg.dict_size // model_cfg.batch_size * batch)
        sel_cfg = dataclasses.replace(sel_cfg, pool_size=sel_cfg.pool_size // cfg.model.batch_size
                                      * batch)
    sel_cfg = dataclasses.replace(sel_cfg, sampler=sampler, pool_refresh=refresh)
    model_cfg = dataclasses.replace(model_cfg, seed=seed)
    torch.manual_seed(seed)
    model = CMACC(model_cfg, sel_cfg).to(device)
    model.f_v.to(memory_format=torch.channels_last_3d)
    model.h_v.to(memory_format=torch.channels_last_3d)
    opt = torch.optim.Adam(model.query_parameters(), lr=cfg.optim.lr)
    dcfg = dataclasses.replace(cfg.data, source="synthetic",
                               clips=max(cfg.data.clips, 4 * model_cfg.batch_size))
    loader = train_loader(dcfg, batch_size=model_cfg.batch_size, seed=seed)
    model.fetch = clip_fetcher(loader, device)
    batches = iter(())

    def next_batch():
        nonlocal batches
        b = next(batches, None)
        if b is None:
            batches = iter(loader)
            b = next(batches)
        video = b["video"].contiguous(memory_format=torch.channels_last_3d)
        return video, b["audio"], b["index"]

    n = sel_cfg.pool_size
    how = "random" if preset == "paper" else "encode"
    if refresh and how == "random":
        raise ValueError("pool refresh re-encodes real clips: not with a random-key pool")
    if fill and how == "random":
        _fill_random(model, n)
    elif fill:
        _fill_by_encoding(model, next_batch, n, device)
    name = f"video {preset}" + (f" M={model_cfg.batch_size}" if batch else "")
    return Setting(name, sampler, model, opt, next_batch, how, n, model_cfg.batch_size, refresh)


@torch.no_grad()
def _fill_by_encoding(model, next_batch, n, device):
    """Both pools full of the key encoders' outputs of real batches."""
    while model.pool_v.count < n:
        video, audio, index = (t.to(device) for t in next_batch())
        k_v, k_a = model.encode_clips(video, audio)
        model.pool_v.push(k_v, index)
        model.pool_a.push(k_a, index)


@torch.no_grad()
def _fill_random(model, n):
    g = torch.Generator().manual_seed(1)
    d = model.pool_v.keys.shape[1]
    dev = model.pool_v.keys.device
    for pool in (model.pool_v, model.pool_a):
        pool.fill(F.normalize(torch.randn(n, d, generator=g), dim=1).to(dev),
                  torch.randperm(10 * n, generator=g)[:n].to(dev))


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
def train_step(s: Setting, step: int, device: str = "cpu", timer=None) -> dict:
    """One training step of the setting (batch, forward, backward, update); its stats. With a
    ``timer``, the data wait and the step are timed as "data" and "step"."""
    td = timer.start() if timer else None
    video, audio, index = s.next_batch()
    video, audio, index = video.to(device), audio.to(device), index.to(device)
    if timer:
        timer.stop("data", td)
    ts = timer.start() if timer else None
    loss, stats = s.model(video, audio, index, step=step)
    s.opt.zero_grad(set_to_none=True)
    loss.backward()
    s.opt.step()
    if timer:
        timer.stop("step", ts)
    return stats


def time_steps(s: Setting, steps: int, warmup: int, device: str = "cpu") -> dict:
    """Mean milliseconds per step of each section (SECTIONS) over ``steps`` steps after
    ``warmup``; ``active_steps``: the share of the timed steps in which the sampler selected."""
    model = s.model
    timer = model.timer = metrics.SectionTimer(device)
    per = {k: [] for k in SECTIONS}
    active = []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        stats = train_step(s, step, device, timer)
        secs = timer.collect()  # syncs on CUDA
        wall = time.perf_counter() - t0
        if step < warmup:
            continue
        active.append(float(stats.get("active", 0.0)))
        visible = min(secs.get("select_visible", 0.0), secs.get("select", 0.0))
        per["data"].append(secs["data"])
        per["select"].append(secs.get("select", 0.0))
        per["visible"].append(visible)
        per["reencode"].append(secs.get("refresh", 0.0))
        per["fwd_bwd"].append(secs["step"] - visible - per["reencode"][-1])
        per["step"].append(wall)
    out = {k: 1e3 * statistics.fmean(v) for k, v in per.items()}
    out["active_steps"] = sum(active) / len(active)
    return out


def settings_pair(make, refreshes=(0,)):
    """The random setting, then the active one for each pool refresh R (each built when the
    one before is done with: one model in memory at a time), started from the random one's
    state before its timed steps: the same weights, BN statistics, dictionaries and filled
    pools. ``make(sampler, fill, refresh)``."""
    first = make("random", True, 0)
    state = copy.deepcopy(first.model.state_dict())  # tensors and the pools' fill counts
    yield first
    del first
    for r in refreshes:
        second = make("active", False, r)
        second.model.load_state_dict(state)
        yield second
        del second


def run(rows=ROWS, chars=(1, 3, 8), pool_mults=(60, 300), steps=10, warmup=2, omniglot=None,
        paper_batch=4, paper_steps=3, device="cpu", refreshes=(0,), log=print) -> list[dict]:
    """One dict per setting and sampler: the setting, sampler, pool, the SECTIONS in ms, and
    on the active row ``ratio`` = its step over the random one's."""
    out = []

    def both(make, n_steps, refreshes=refreshes):
        pair = {}
        for s in settings_pair(make, refreshes):
            t = time_steps(s, n_steps, warmup, device)
            pair[s.sampler] = t
            row = dict(setting=s.name, sampler=s.sampler, M=s.m, N=s.n_pool, pool=s.pool,
                       refresh=s.refresh, **t)
            if s.sampler == "active":  # the whole steps' ratio, and the selection's own share
                row["ratio"] = t["step"] / pair["random"]["step"]
                row["added"] = 1 + t["visible"] / pair["random"]["step"]
            out.append(row)
            log(_line(row))

    with tempfile.TemporaryDirectory() as tmp:
        if "mi" in rows:
            from cmacc.apps.mi.data import Glyphs

            glyphs = Glyphs(glyph_root(omniglot, Path(tmp)))
            for l in chars:
                for pm in pool_mults:
                    both(lambda smp, fill, r: mi_setting(smp, l, pm, glyphs, device=device,
                                                         fill=fill, refresh=r), steps)
        if "tiny" in rows:
            both(lambda smp, fill, r: video_setting(smp, "tiny", None, device=device, fill=fill,
                                                    refresh=r), steps)
        if "paper" in rows:  # a pool of random keys: nothing to re-encode
            both(lambda smp, fill, r: video_setting(smp, "paper", paper_batch, device=device,
                                                    fill=fill), paper_steps, (0,))
    return out


def _sampler(r) -> str:
    return r["sampler"] + (f" R={r['refresh']}" if r.get("refresh") else "")


def _line(r) -> str:
    ratio = f"  active/random {r['ratio']:.2f}x" if "ratio" in r else ""
    return (f"{r['setting']:>22} {_sampler(r):>10}: step {r['step']:8.1f} ms = data "
            f"{r['data']:6.1f} + fwd+bwd {r['fwd_bwd']:8.1f} + selection visible "
            f"{r['visible']:7.1f} (total {r['select']:7.1f}) + pool refresh "
            f"{r['reencode']:7.1f}{ratio}")


def markdown(rows) -> str:
    lines = ["| setting | M | N | pool | sampler | step ms | data | fwd+bwd | selection "
             "(visible / total) | pool refresh | active / random | 1 + visible / random |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"**{r['ratio']:.2f}x**" if "ratio" in r else ""
        added = f"{r['added']:.2f}x" if "added" in r else ""
        lines.append(f"| {r['setting']} | {r['M']} | {r['N']:,} | {r['pool']} | {_sampler(r)} | "
                     f"{r['step']:.1f} | {r['data']:.1f} | {r['fwd_bwd']:.1f} | "
                     f"{r['visible']:.1f} / {r['select']:.1f} | {r['reencode']:.1f} | {ratio} | "
                     f"{added} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS),
                   help="which settings (default: all)")
    p.add_argument("--chars", type=int, nargs="+", default=[1, 3, 8],
                   help="MI rows: characters per image, l (default: 1 3 8)")
    p.add_argument("--pool-mults", type=int, nargs="+", default=[60, 300],
                   help="MI rows: candidate pool N = this * M (default: 60 300)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--paper-batch", type=int, default=4,
                   help="paper row: the global batch M (default 4)")
    p.add_argument("--paper-steps", type=int, default=3,
                   help="paper row: timed steps (default 3; seconds each on a CPU)")
    p.add_argument("--omniglot", metavar="ROOT",
                   help="MI rows: Omniglot in torchvision's layout (default: generated glyphs)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default cpu")
    p.add_argument("--pool-refresh", type=int, nargs="+", default=[0], metavar="R",
                   help="an active row per R (train.py --pool-refresh; 0: none), e.g. 0 1 4 "
                        "(default 0; the mi and tiny rows: the paper row's pool is random keys)")
    args = p.parse_args(argv)
    if min(args.pool_refresh) < 0:
        p.error("--pool-refresh: each R >= 0")
    if min(args.steps, args.paper_steps) < 1 or args.warmup < 0 or args.paper_batch < 1:
        p.error("need --steps, --paper-steps, --paper-batch >= 1 and --warmup >= 0")
    if min(args.chars) < 1 or max(args.chars) > 8:
        p.error("--chars: each l in 1..8 (the MI study's range)")
    if min(args.pool_mults) < 31:
        p.error("--pool-mults: each >= 31 (the pool must hold K = 30 M plus a batch)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    info = env_info(args.device)
    print(f"device: {info['device']}, torch {info['torch']} ({torch.get_num_threads()} threads), "
          f"{info['date']}, commit {info['commit']}")
    rows = run(args.rows, args.chars, args.pool_mults, args.steps, args.warmup, args.omniglot,
               args.paper_batch, args.paper_steps, args.device, tuple(args.pool_refresh))
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
