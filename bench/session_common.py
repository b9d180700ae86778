"""What the parts of bench/gpu_session.py (`make gpu-session`) share: the sizes they run at (the
GPU session's, or the dry run's), their timers, and the trainer run as train.py runs it
(``trainer_run``: cmacc.trainer.Trainer itself, with its pools filled before the first step).

The parts themselves are in bench/session_parts.py; the driver (one process per part, the JSON
lines, the budget) is bench/gpu_session.py. Nothing here touches CUDA at import time.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import math
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench.common import median_ms
from bench.gpu_check import PartFailed
from data_dali.cli import first_line


class Skipped(Exception):
    """The part did not run here; the message says why (and what would make it run)."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What the parts run at: the GPU session's, or the dry run's (CPU, tiny preset)."""
    preset: str
    device: str
    warm: int  # untimed trainer steps (= the metrics rows' interval)
    timed: int  # timed trainer steps a run (a multiple of warm)
    profile_steps: int
    conv_batch: int
    loader_batches: int
    compile_timed: int
    overlap_reps: int
    select_variants: tuple | None  # None: every kernels VARIANTS entry


GPU = Sizes("paper", "cuda", warm=4, timed=16, profile_steps=10, conv_batch=128,
            loader_batches=16, compile_timed=6, overlap_reps=5, select_variants=None)
DRY = Sizes("tiny", "cpu", warm=1, timed=2, profile_steps=2, conv_batch=4, loader_batches=3,
            compile_timed=1, overlap_reps=1, select_variants=("steps",))


def sizes(args) -> Sizes:
    return DRY if args.dry_run else GPU


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn, device, reps=2, rep_ms: int = 100) -> float:
    """Median ms of fn(): ``triton.testing.do_bench`` on CUDA (bench/common.py's ``median_ms``,
    over ``rep_ms``); on the CPU (the dry run) the mean of ``reps`` wall-clock calls after one."""
    if torch.device(device).type == "cuda":
        return median_ms(fn, "cuda", rep_ms=rep_ms)
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def wall_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _release() -> None:
    """What a finished trainer run held: its selection plans (CUDA graphs bound to its pools)
    and the cached blocks of its tensors, before the next run builds its own."""
    import gc

    gc.collect()
    with contextlib.suppress(ImportError):
        from kernels import triton_select

        triton_select.clear_plans()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def nvidia_smi_clocks() -> dict | str:
    """Clocks, power and temperature now ({column: value}), or why they are not known."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return "nvidia-smi not on PATH"
    try:
        p = subprocess.run([exe, "--query-gpu=clocks.sm,clocks.max.sm,clocks.mem,power.draw,"
                            "temperature.gpu", "--format=csv"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"nvidia-smi failed: {first_line(e)}"
    rows = list(csv.reader(p.stdout.strip().splitlines()))
    if p.returncode != 0 or len(rows) < 2:
        return f"nvidia-smi failed ({p.returncode}): {(p.stderr or p.stdout).strip()[:200]}"
    return {k.strip(): v.strip() for k, v in zip(rows[0], rows[1])}


# ---------------------------------------------------------------------------------------------
# the trainer, run as train.py runs it (cmacc.trainer.Trainer), with two hooks
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def fill_pools(model, clips: int, seed: int = 1) -> None:
    """Both rolling pools full of random unit keys (bench/bench_step.py's paper row does the
    same: encoding N = 38,400 clips first would take longer than the session), so that the active
    sampler selects from the first step. Unlike bench_step's fill, the indices are clips of the
    run's data set ([0, clips)): the trainer looks their labels up for its diversity metric."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    for pool in (model.pool_v, model.pool_a):
        n, d = pool.keys.shape
        pool.fill(F.normalize(torch.randn(n, d, generator=g), dim=1).to(pool.keys.device),
                  torch.randint(0, clips, (n,), generator=g).to(pool.index.device))


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: float(v) if v not in ("", None) else float("nan") for k, v in r.items()}
                for r in csv.DictReader(f)]


def _mean(rows, key) -> float:
    vals = [r[key] for r in rows if key in r and math.isfinite(r[key])]
    return sum(vals) / len(vals) if vals else float("nan")


_CLIPS: dict = {}  # (data config, seed) -> the synthetic clips, made once per part process


def _clips_once(make):
    """``cmacc.data.synthetic_clips`` that makes each set of clips once in this process: the
    paper preset's 1,024 clips (~2.5 GB, one seeded randn on one core: seconds) are the same
    for every run of a part, and once one run has moved them to the GPU (``ToyLoader.to``,
    in place) the next finds them there, with no second copy."""
    def clips(dcfg, seed):
        key = (repr(dcfg), seed)
        if key not in _CLIPS:
            _CLIPS[key] = make(dcfg, seed)
        return _CLIPS[key]
    return clips


def trainer_run(sz: Sizes, sampler: str, *, timed: int, compile: bool = False,
                on_step=None, extra_steps: int = 0) -> dict:
    """One run of the trainer at the session's preset: ``sz.warm`` warm-up steps, then
    ``timed`` (+ ``extra_steps``, unaveraged) steps, metrics rows every ``sz.warm`` steps.
    Hooks: at the model's first forward the pools are filled (``fill_pools``, selecting samplers)
    and ``on_step()`` is called at the start of every forward; the run saves no checkpoint and
    draws no metrics.png (its folder is thrown away: a second or two of matplotlib a run). The
    figures are the means of the trainer's metrics rows after the warm-up. The synthetic clips
    are made once per process (``_clips_once``)."""
    from cmacc import data, runlog
    from cmacc.config import PRESETS
    from cmacc.model import CMACC
    from cmacc.trainer import Trainer

    base = PRESETS[sz.preset]
    timed = -(-timed // sz.warm) * sz.warm
    model_seen = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = base.replace(selection=dict(sampler=sampler), optim=dict(compile=compile),
                           run=dict(steps=sz.warm + timed + extra_steps, log_every=sz.warm,
                                    out=tmp, device=sz.device, resume="none",
                                    dict_init="random", ckpt_every=0))

        def first_forward(module, _args):
            if not isinstance(module, CMACC) or model_seen:
                return
            model_seen.append(module)
            handle.remove()
            if sampler != "random":
                fill_pools(module, cfg.data.clips)
            if on_step is not None:
                on_step()
                module.register_forward_pre_hook(lambda _m, _a: on_step())

        handle = torch.nn.modules.module.register_module_forward_pre_hook(first_forward)
        trainer = Trainer(cfg)
        if hasattr(trainer, "save"):  # no checkpoint (~0.7 GB at the paper preset) per run
            trainer.save = lambda reason: None
        plot, runlog.plot_metrics = runlog.plot_metrics, lambda *_a, **_k: None
        make, data.synthetic_clips = data.synthetic_clips, _clips_once(data.synthetic_clips)
        t0 = time.perf_counter()
        try:
            trainer.run()
        finally:
            handle.remove()
            runlog.plot_metrics, data.synthetic_clips = plot, make
        wall = time.perf_counter() - t0
        if not model_seen:
            raise PartFailed("the trainer ran no forward of a cmacc.model.CMACC: the pool-filling "
                             "hook never fired (bench/session_common.py trainer_run)")
        rows = _rows(Path(tmp) / "metrics.csv")
        del trainer, model_seen[:]
    _release()
    m = cfg.model.batch_size
    timed_rows = [r for r in rows if sz.warm < r["step"] <= sz.warm + timed]
    warm_rows = [r for r in rows if r["step"] <= sz.warm]
    if not timed_rows:
        raise PartFailed(f"metrics.csv has no row after step {sz.warm} (rows at steps "
                         f"{[int(r['step']) for r in rows]})")
    clips_s = _mean(timed_rows, "clips_per_s")
    return dict(sampler=sampler, steps=timed,
                step_ms=1e3 * _mean(timed_rows, "t_step"),
                iter_ms=1e3 * m / clips_s if clips_s > 0 else float("nan"),
                data_ms=1e3 * _mean(timed_rows, "t_data"),
                data_wait=_mean(timed_rows, "data_wait"),
                select_ms=1e3 * _mean(timed_rows, "t_select"),
                visible_ms=1e3 * _mean(timed_rows, "t_select_visible"),
                alone_ms=1e3 * _mean(timed_rows, "t_select_alone"),  # its SM time
                clips_per_s=clips_s, mfu=_mean(timed_rows, "mfu"),
                active=_mean(timed_rows, "active"), mem_gib=_mean(timed_rows, "mem_gb"),
                warm_s=(sz.warm * m / warm_rows[0]["clips_per_s"]
                        if warm_rows and warm_rows[0]["clips_per_s"] > 0 else float("nan")),
                wall_s=wall)
