"""The parts of bench/gpu_session.py (`make gpu-session`): what each one measures.

``part_NAME(args, report) -> figures`` runs in a process of its own that the driver,
bench/gpu_session.py, starts (``gpu_session.py --one NAME``): it returns its figures as a dict
(the driver keeps the keys of the part's ``Spec``, in that order), calls ``report(**figures)``
to keep what it has measured so far (a crash or a timeout then keeps it in the failure line),
and raises ``Skipped`` where it does not run or ``PartFailed`` where its result is a failure.
The driver's docstring and docs/GPU.md ("The prepared GPU session") list every part's keys;
what the parts share (sizes, timers, the trainer run) is in bench/session_common.py; the
`convs` part is in bench/session_convs.py (re-exported here). Nothing here touches CUDA at
import time.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu_check import PartFailed, _pool, _time_settings, dali_throughput, versions
from bench.session_common import (Skipped, _rows, nvidia_smi_clocks, sizes, sync, trainer_run,
                                  wall_ms)
from bench.session_convs import part_bn, part_convs  # noqa: F401  (in their own module)
from data_dali.cli import first_line

DRIVER = Path(__file__).resolve().with_name("gpu_session.py")  # the command (ncu's target too)
ROOT = DRIVER.parents[1]

# record_function ranges of the trainer, the model and the prefetching loader (reported if seen)
RANGES = ("gather", "pin", "h2d", "momentum", "query_forward", "select_v", "select_a",
          "key_forward", "loss", "backward", "sync", "optimizer")
TRACE_LIMIT = 15 * 2 ** 20  # bytes: a file back from the device machine is at most 16 MiB


# ---------------------------------------------------------------------------------------------
# the parts: fn(args, report) -> figures (a dict in the part's key order); report(**figures)
# keeps what is measured so far (a crash or a timeout then keeps it in the failure line)
# ---------------------------------------------------------------------------------------------
def _layer_forms() -> dict:
    """The video encoders' layer forms every part runs unless it sets its own (the defaults, or
    what CMACC_FAST_LAYERS / CMACC_BATCH_NORM chose)."""
    from cmacc.encoders import ChannelsLastBatchNorm3d, StemConv3d

    return dict(stem=StemConv3d.mode, batch_norm=ChannelsLastBatchNorm3d.mode)


def part_env(args, report) -> dict:
    from bench.common import git_commit, source_sha256

    cuda = torch.cuda.is_available() and not args.dry_run
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    out = dict(device=None, sm_count=None, memory_gib=None, capability=None, l2_mib=None,
               torch=torch.__version__, triton=triton_version, cuda=torch.version.cuda,
               cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available()
               else None, driver=None,
               versions="dry run: not read" if args.dry_run else versions(),
               commit=git_commit(), source_sha256=source_sha256(),
               date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), python=sys.version.split()[0],
               cpu_count=os.cpu_count(), clocks=nvidia_smi_clocks(), dry_run=args.dry_run,
               budget_s=args.budget_s, layer_forms=_layer_forms())
    if cuda:
        p = torch.cuda.get_device_properties(0)
        out.update(device=p.name, sm_count=p.multi_processor_count,
                   memory_gib=p.total_memory / 2 ** 30, capability=f"{p.major}.{p.minor}",
                   l2_mib=getattr(p, "L2_cache_size", 0) / 2 ** 20 or None)
        exe = shutil.which("nvidia-smi")
        if exe:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                out["driver"] = subprocess.run(
                    [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True, text=True, timeout=30).stdout.strip() or None
    else:
        from bench.common import env_info

        out["device"] = env_info("cpu")["device"]
    return out


def _alternate(pairs: int, arms: dict, report, part: str) -> tuple[list, list]:
    """``pairs`` rounds of the runs ``arms`` (name -> a function returning a run's figures), in
    their order each round: (every run, as it ended; per round {name: run}). Each run is
    reported and printed as it ends."""
    runs, rounds = [], []
    for _ in range(pairs):
        pair = {}
        for name, run in arms.items():
            pair[name] = run()
            runs.append(pair[name])
            report(runs=runs)
            print(f"{part}: {name}: {_short(pair[name])}", flush=True)
        rounds.append(pair)
    return runs, rounds


def part_pairs(args, report) -> dict:
    """Random and active runs alternating; the ratio active / random per pair, with mean_ci."""
    from cmacc.metrics import mean_ci

    sz = sizes(args)
    runs, rounds = _alternate(args.pairs, {
        sampler: (lambda s=sampler: trainer_run(sz, s, timed=sz.timed))
        for sampler in ("random", "active")}, report, "pairs")
    step_ratio = [p["active"]["step_ms"] / p["random"]["step_ms"] for p in rounds]
    iter_ratio = [p["active"]["iter_ms"] / p["random"]["iter_ms"] for p in rounds]
    mean, half = mean_ci(step_ratio)
    imean, ihalf = mean_ci(iter_ratio)
    first = runs[0]
    return dict(preset=sz.preset, warmup_steps=sz.warm, timed_steps=first["steps"],
                pairs=args.pairs, runs=runs, step_ratio=step_ratio, step_ratio_mean=mean,
                step_ratio_ci95=half, iter_ratio=iter_ratio, iter_ratio_mean=imean,
                iter_ratio_ci95=ihalf, cudnn_benchmark=torch.backends.cudnn.benchmark)


def part_layers(args, report) -> dict:
    """The training step with the video encoders' fast layer forms (StemConv3d,
    ChannelsLastBatchNorm3d: the defaults, "fast"), with the fast stem and BatchNorm3d's own
    path ("stem"), with their declared nn.Conv3d / nn.BatchNorm3d ("off"), and with the fast
    stem and the Triton batch norm with its fused residual add and ReLU ("triton":
    kernels/triton_batchnorm.py), random sampler,
    alternating rounds; per round off / fast, stem / fast and fast / triton step time, each
    with mean_ci."""
    from cmacc.encoders import ChannelsLastBatchNorm3d, StemConv3d
    from cmacc.metrics import mean_ci

    sz = sizes(args)
    defaults = StemConv3d.mode, ChannelsLastBatchNorm3d.mode
    forms = {"fast": defaults, "stem": (defaults[0], "off"), "off": ("off", "off"),
             "triton": (defaults[0], "triton")}

    def run(name):
        StemConv3d.mode, ChannelsLastBatchNorm3d.mode = forms[name]
        try:
            return dict(trainer_run(sz, "random", timed=sz.timed), forms=name)
        finally:
            StemConv3d.mode, ChannelsLastBatchNorm3d.mode = defaults

    runs, rounds = _alternate(LAYER_PAIRS, {f: (lambda f=f: run(f)) for f in forms},
                              report, "layers")
    figures = dict(stem=defaults[0], bn=defaults[1], runs=runs)
    for key, (num, den) in (("speedup", ("off", "fast")), ("bn_speedup", ("stem", "fast")),
                            ("triton_speedup", ("fast", "triton"))):
        ratio = [p[num]["step_ms"] / p[den]["step_ms"] for p in rounds]
        mean, half = mean_ci(ratio)
        figures.update({key: ratio, f"{key}_mean": mean, f"{key}_ci95": half})
    return figures


LAYER_PAIRS = 2


def _short(r) -> str:
    return (f"step {r['step_ms']:.1f} ms, iteration {r['iter_ms']:.1f} ms, data "
            f"{r['data_ms']:.1f} ms ({r['data_wait']:.3f} of the wall), selection "
            f"{r['select_ms']:.2f} / {r['visible_ms']:.2f} ms visible / {r['alone_ms']:.2f} ms "
            f"alone, {r['clips_per_s']:.1f} "
            f"clips/s, MFU {r['mfu']:.3f}")


def _device_us(e, self_only: bool = False) -> float:
    """A profiler event's CUDA time in us, total or (``self_only``) its own, under the name this
    torch gives it (``device_time_total``, before that ``cuda_time_total``); 0 if neither."""
    prefix = "self_" if self_only else ""
    for name in ("device_time_total", "cuda_time_total"):
        v = getattr(e, prefix + name, None)
        if v is not None:
            return float(v)
    return 0.0


def _write_trace(prof, out: Path) -> tuple[str, int, str]:
    """The chrome trace gzipped to OUT/profile_trace.json.gz; above TRACE_LIMIT, again without
    the CPU operator events (kernels, memcpys and the ranges stay). (name, bytes, what)."""
    dest = out / "profile_trace.json.gz"
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(dest, "wb", compresslevel=6) as g:
            shutil.copyfileobj(f, g)
        what = "every event"
        if dest.stat().st_size > TRACE_LIMIT:
            trace = json.loads(raw.read_text())
            trace["traceEvents"] = [e for e in trace.get("traceEvents", [])
                                    if e.get("cat") not in ("cpu_op", "python_function")]
            with gzip.open(dest, "wt", compresslevel=9) as g:
                json.dump(trace, g)
            what = "without cpu_op events (the whole trace exceeded the 15 MiB limit)"
    return dest.name, dest.stat().st_size, what


def part_profile(args, report) -> dict:
    from torch.profiler import ProfilerActivity, profile

    sz = sizes(args)
    cuda = sz.device == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    all_threads = True
    try:  # the prefetch thread's ranges (gather, pin, h2d) are on another thread
        from torch._C._profiler import _ExperimentalConfig

        prof = profile(activities=acts, record_shapes=True,
                       experimental_config=_ExperimentalConfig(profile_all_threads=True))
    except (ImportError, TypeError):
        prof, all_threads = profile(activities=acts, record_shapes=True), False
    n = sz.profile_steps
    state = dict(calls=0, t0=None, wall=None, done=False)

    def on_step():  # at the start of every forward: profile forwards warm+1 .. warm+n
        state["calls"] += 1
        if state["calls"] == sz.warm + 1:
            sync(sz.device)
            prof.start()
            state["t0"] = time.perf_counter()
        elif state["calls"] == sz.warm + n + 1:
            sync(sz.device)
            state["wall"] = time.perf_counter() - state["t0"]
            prof.stop()
            state["done"] = True

    from cmacc.model import CMACC

    alone = CMACC.time_selection_alone

    def not_in_the_window(model):  # a metrics row's timing of the selections alone would add
        if state["t0"] is not None and not state["done"]:  # two selections and a sync to it
            return float("nan")
        return alone(model)

    CMACC.time_selection_alone = not_in_the_window  # (this part's own process)
    run = trainer_run(sz, "active", timed=sz.warm, on_step=on_step,
                      extra_steps=n + 1 - sz.warm)
    report(steps=n, wall_ms_per_step=1e3 * state["wall"] / n if state["done"] else None,
           run=run)  # (kept if the trace's processing below outlasts the cap)
    if not state["done"]:
        raise PartFailed(f"the profiler window did not close: {state['calls']} forwards seen, "
                         f"{sz.warm + n + 1} needed")
    out = Path(args.out)
    trace, trace_bytes, trace_what = _write_trace(prof, out)
    events = prof.events()
    kernels, ranges, others = {}, {}, set()
    for e in events:
        dev = str(getattr(e, "device_type", "")).rsplit(".", 1)[-1]
        if cuda and dev == "CUDA":
            if e.name in RANGES or getattr(e, "is_user_annotation", False):
                continue  # the GPU side of a range: counted with its CPU side
            k = kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += _device_us(e, self_only=True) or float(getattr(e, "time_range").elapsed_us())
        elif dev == "CPU":
            if e.name in RANGES:
                r = ranges.setdefault(e.name, dict(calls=0, cpu_ms=0.0, device_ms=0.0))
                r["calls"] += 1
                r["cpu_ms"] += e.cpu_time_total / 1e3
                r["device_ms"] += _device_us(e) / 1e3
            elif getattr(e, "is_user_annotation", False) and not e.name.startswith("ProfilerStep"):
                others.add(e.name)
            elif not cuda:  # the dry run: CPU operators stand in for kernels
                k = kernels.setdefault(e.name, [0, 0.0])
                k[0] += 1
                k[1] += float(getattr(e, "self_cpu_time_total", 0.0))
    table = sorted(([name, c, us, us / c] for name, (c, us) in kernels.items()),
                   key=lambda r: -r[2])
    with open(out / "profile_kernels.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["name", "calls", "total_us" if cuda else "total_cpu_us",
                    "mean_us" if cuda else "mean_cpu_us"])
        w.writerows([[n_, c, f"{t:.1f}", f"{m:.2f}"] for n_, c, t, m in table])
    total_us = sum(r[2] for r in table)
    return dict(steps=n, wall_ms_per_step=1e3 * state["wall"] / n, ops_by_shape=_ops_by_shape(
                    prof, n, cuda),
                all_threads=all_threads, what="CUDA kernels and memory copies" if cuda else
                "CPU operators (dry run: no kernels)", trace=trace, trace_bytes=trace_bytes,
                trace_holds=trace_what, kernels_csv="profile_kernels.csv",
                kernel_count=len(table), kernel_ms_per_step=total_us / 1e3 / n,
                top20=[dict(name=n_[:200], calls=c, total_ms=t / 1e3, mean_us=m,
                            share=t / total_us if total_us else None)
                       for n_, c, t, m in table[:20]],
                ranges={k: dict(v, per_step_ms=v["device_ms" if cuda else "cpu_ms"] / n)
                        for k, v in ranges.items()},
                ranges_missing=[r for r in RANGES if r not in ranges],
                other_ranges=sorted(others)[:40], run=run)


def _ops_by_shape(prof, steps: int, cuda: bool, top: int = 25) -> list[dict]:
    """The operators that launched the most device time of their own (CPU time in the dry
    run), by operator and input shapes and dtypes: what a kernel class of ``top20`` was run on
    (which tensors the copies copy, which BatchNorms)."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        own = _device_us(e, self_only=True) if cuda else float(e.self_cpu_time_total)
        if own > 0:
            rows.append(dict(name=e.key, input_shapes=str(e.input_shapes)[:300],
                             calls_per_step=e.count / steps, own_ms_per_step=own / 1e3 / steps))
    return sorted(rows, key=lambda r: -r["own_ms_per_step"])[:top]


def part_loader(args, report) -> dict:
    """The in-memory loader alone: gather, pin, copy per batch; then the prefetching wrapper."""
    from cmacc.config import PRESETS
    from cmacc.data import train_loader

    sz = sizes(args)
    cfg, dev = PRESETS[sz.preset], sz.device
    cuda = dev == "cuda"
    m = cfg.model.batch_size
    t0 = time.perf_counter()
    loader = train_loader(cfg.data, batch_size=m, seed=0)
    make_s = time.perf_counter() - t0

    def batches():
        epoch = 0
        while True:
            loader.set_epoch(epoch)
            yield from loader
            epoch += 1

    it, per = batches(), dict(gather=[], pin=[], h2d=[])
    nbytes = 0
    next(it)  # warm
    t_all = time.perf_counter()
    for _ in range(sz.loader_batches):
        t0 = time.perf_counter()
        batch = next(it)
        t1 = time.perf_counter()
        if cuda:
            batch = {k: v.pin_memory() if torch.is_tensor(v) else v for k, v in batch.items()}
        t2 = time.perf_counter()
        on = {k: v.to(dev, non_blocking=cuda) if torch.is_tensor(v) else v
              for k, v in batch.items()}
        sync(dev)
        t3 = time.perf_counter()
        nbytes = sum(v.numel() * v.element_size() for v in batch.values() if torch.is_tensor(v))
        per["gather"].append(t1 - t0)
        per["pin"].append(t2 - t1)
        per["h2d"].append(t3 - t2)
        del on
    serial_s = time.perf_counter() - t_all
    # medians: the first pin_memory of a size allocates (pinned memory, cached after that)
    ms = {k: 1e3 * sorted(v)[len(v) // 2] for k, v in per.items()}
    out = dict(batch=m, clips=len(loader.data) if hasattr(loader, "data") else None,
               make_s=make_s, batch_mb=nbytes / 1e6, batches=sz.loader_batches,
               gather_ms=ms["gather"], pin_ms=ms["pin"] if cuda else None, h2d_ms=ms["h2d"],
               h2d_gb_s=nbytes / 1e9 / (ms["h2d"] / 1e3) if cuda and ms["h2d"] else None,
               serial_batches_per_s=sz.loader_batches / serial_s)
    report(**out)
    try:
        from cmacc.prefetch import Prefetcher
    except ImportError as e:
        out.update(prefetch="absent", prefetch_batches_per_s=None, prefetch_speedup=None)
        print(f"loader: no prefetching wrapper ({first_line(e)})", flush=True)
        return out
    pre = Prefetcher(loader, dev, depth=2, channels_last=True)
    got = 0
    t_all = None
    epoch = 0
    while got <= sz.loader_batches:
        pre.set_epoch(epoch)
        with contextlib.closing(iter(pre)) as bit:
            for b in bit:
                sync(dev)  # delivered: its copy has run
                if t_all is None:  # the first batch starts the clock (thread start-up)
                    t_all = time.perf_counter()
                else:
                    got += 1
                del b
                if got >= sz.loader_batches:
                    break
        epoch += 1
        if got >= sz.loader_batches:
            break
    rate = sz.loader_batches / (time.perf_counter() - t_all)
    out.update(prefetch="cmacc.prefetch.Prefetcher(depth=2, channels_last=True)",
               prefetch_batches_per_s=rate,
               prefetch_speedup=rate / out["serial_batches_per_s"])
    return out


def part_compile(args, report) -> dict:
    """The trainer with --compile: a few steps' time, or the error line (a finding, not a
    failure of the session)."""
    sz = sizes(args)
    backend = "inductor (torch.compile's default, as train.py --compile)"
    if args.dry_run:  # inductor's C++ build takes minutes on two cores: trace with dynamo only
        import torch.nn as nn

        compile_ = nn.Module.compile
        nn.Module.compile = lambda self, *a, **k: compile_(self, *a, **{"backend": "eager", **k})
        backend = "eager (dry run: dynamo only)"
    out = dict(backend=backend, warm_s=None, step_ms=None, iter_ms=None, clips_per_s=None,
               mfu=None, error=None)
    t0, forwards = time.perf_counter(), []

    def on_step():  # how far it got, if the cap ends it (a cold inductor compile is long)
        forwards.append(round(time.perf_counter() - t0, 1))
        report(backend=backend, forwards_started_at_s=forwards)

    try:
        r = trainer_run(sz, "active", timed=sz.compile_timed, compile=True, on_step=on_step)
    except Exception as e:  # noqa: BLE001 - the finding is the error line
        out["error"] = f"{type(e).__name__}: {first_line(e, 500)}"
        return dict(out, forwards_started_at_s=forwards)
    out.update({k: r[k] for k in ("warm_s", "step_ms", "iter_ms", "clips_per_s", "mfu")})
    return dict(out, forwards_started_at_s=forwards)


def part_select(args, report) -> dict:
    """Each k-means++ variant x factor dtype alone; then the training's selections on a side
    stream beside a bf16 r3d_18 key-encoder forward, at default and high priority (the side
    stream's and the plans' graph captures': a replay runs at its capture's priority)."""
    from cmacc.config import PRESETS
    from cmacc.encoders import Encoder, video_backbone
    from cmacc.samplers import select
    from kernels import triton_kmeanspp as km
    from kernels import triton_select as ts

    sz = sizes(args)
    cfg, dev = PRESETS[sz.preset], sz.device
    cuda = dev == "cuda"
    mc = cfg.model
    n, m, d, dh = cfg.selection.pool_size, mc.batch_size, mc.dim, mc.fcl_dim
    variants = [v for v in km.VARIANTS if sz.select_variants is None or v in sz.select_variants]
    g = torch.Generator().manual_seed(0)
    pool = _pool(n, m, d, dh, g, device=dev)
    settings = [("ieee", f, v) for f in ("fp32", "bf16") for v in variants]
    timer = None if cuda else wall_ms  # the interpreter: one call (seconds each)
    rows = _time_settings(n, m, pool, "head", settings, True, timer=timer,
                          on_row=lambda rows: report(N=n, M=m, d=d, d_h=dh, variants=variants,
                                                     alone=rows))
    # beside the key encoder: the model's selection call (cmacc.samplers.select), both
    # dictionaries as a training step makes them, default engine settings
    keys, queries, feats = pool
    index = torch.arange(n, device=dev)
    dict_index = torch.arange(n, n + mc.dict_size, device=dev)  # nothing excluded
    sel = cfg.selection
    engine = dict(precision=sel.precision, factors=sel.factors, variant=sel.kmeans_variant)

    def selections():
        for which in (0, 1):
            select("active", pool_keys=keys, pool_index=index, dict_index=dict_index,
                   queries=queries, feats=feats, m=m, seed=7 + which, tau_p=sel.tau_p,
                   view=sel.grad_view, n=n, engine=engine)

    torch.manual_seed(0)
    enc = Encoder(video_backbone(mc.video_arch, mc.video_width, mc.video_layers), mc.dim,
                  mc.fcl_dim if mc.fcl else None).to(dev).to(memory_format=torch.channels_last_3d)
    dc = cfg.data
    clip = torch.randn(m, 3, dc.frames, dc.size, dc.size, device=dev).contiguous(
        memory_format=torch.channels_last_3d)

    @torch.no_grad()
    def encode():
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=cuda):
            return enc(clip)[0]

    def timed(fn_main, fn_side, side):
        """(main ms, side ms, both ms, host ms to issue the side's work): the side's work is
        issued first (as the model issues the selection before the key encoders)."""
        if not cuda:  # the dry run: in line, wall clock
            t0 = time.perf_counter()
            if fn_side:
                fn_side()
            t1 = time.perf_counter()
            if fn_main:
                fn_main()
            t2 = time.perf_counter()
            return 1e3 * (t2 - t1), 1e3 * (t1 - t0), 1e3 * (t2 - t0), 1e3 * (t1 - t0)
        main = torch.cuda.current_stream()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize()
        ev[0].record(main)
        h0 = time.perf_counter()
        if fn_side:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                fn_side()
                ev[1].record(side)
        host = 1e3 * (time.perf_counter() - h0)
        ev[2].record(main)
        if fn_main:
            fn_main()
        ev[3].record(main)
        if fn_side:
            main.wait_stream(side)
        torch.cuda.synchronize()
        main_ms = ev[2].elapsed_time(ev[3])
        side_ms = ev[0].elapsed_time(ev[1]) if fn_side else 0.0
        both = max(ev[0].elapsed_time(ev[3]), side_ms)
        return main_ms, side_ms, both, host

    def median(fn):
        if cuda:  # warm-up (compile, capture, cuDNN); the dry run's interpreter has none
            fn()
        vals = [fn() for _ in range(sz.overlap_reps)]
        return [sorted(v[i] for v in vals)[len(vals) // 2] for i in range(4)]

    priorities = {"default": 0, "high": -1}
    enc_ms = median(lambda: timed(encode, None, None))[0]
    sel_ms, beside = None, {}
    for name, priority in priorities.items():
        ts.clear_plans()  # captured again (in median's warm-up) at this priority
        ts.CAPTURE_PRIORITY = priority
        stream = torch.cuda.Stream(priority=priority) if cuda else None
        if sel_ms is None:
            sel_ms = median(lambda s=stream: timed(None, selections, s))[1]
        main_ms, side_ms, both_ms, host_ms = median(lambda s=stream: timed(encode, selections, s))
        beside[name] = dict(priority=priority, main_ms=main_ms, side_ms=side_ms, both_ms=both_ms,
                            host_issue_ms=host_ms, main_slowdown=main_ms / enc_ms)
        report(encoder_ms=enc_ms, selections_ms=sel_ms, beside=beside)
    return dict(N=n, M=m, d=d, d_h=dh, variants=variants, alone=rows,
                overlap_setting=dict(engine, view=sel.grad_view, selections=2,
                                     encoder=f"{mc.video_arch} key encoder forward, bf16 "
                                             f"autocast, batch {m}, {dc.frames}x{dc.size}x"
                                             f"{dc.size}"),
                encoder_ms=enc_ms, selections_ms=sel_ms, beside=beside)


def dist_train_argvs(preset: str, device: str, dry_run: bool, out) -> list[list[str]]:
    """train.py's arguments of the dist part's two runs: 4 steps with a checkpoint at 2 and 4,
    then to 6 (a resume). On a GPU the paper preset, small (its 500-step warm-up shortened:
    train.py refuses a run that would not reach a tenth of --lr); the dry run's tiny preset."""
    small = (["--clips", "96"] if dry_run else
             ["--batch-size", "16", "--dict-size", "160", "--pool-size", "480", "--clips", "256",
              "--amp", "bf16", "--warmup", "2"])
    common = ["--preset", preset, "--device", device, "--dist-backend", "gloo",
              "--pool-mode", "epoch", "--log-every", "2", "--out", str(out), *small]
    return [[*common, "--steps", "4", "--ckpt-every", "2"], [*common, "--steps", "6"]]


def part_dist(args, report) -> dict:
    """``torchrun --nproc_per_node 2`` on the one GPU with gloo over CUDA tensors
    (``--dist-backend gloo``: the ranks share it): DDP's gradient all-reduce, shuffle-BN's
    all-to-all, the queues' gathers, the selection on every rank, the per-step all-reduce, a
    checkpoint, and a resume from it; so device placement and dtype errors of the distributed
    paths show before a user's first multi-GPU run (a test, not a speed figure)."""
    sz = sizes(args)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        for train_argv in dist_train_argvs(sz.preset, sz.device, args.dry_run, out):
            steps = int(train_argv[train_argv.index("--steps") + 1])
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node", "2", "train.py", *train_argv]
            t0 = time.monotonic()
            p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1"),
                               timeout=max(30.0, args.cap - 10))
            runs.append(dict(steps=steps, returncode=p.returncode,
                             seconds=round(time.monotonic() - t0, 1),
                             resumed="resumed run" in p.stderr,
                             tail=p.stderr.strip().splitlines()[-8:]))
            report(runs=runs)
            if p.returncode != 0:
                raise PartFailed(f"torchrun 2 ranks, --dist-backend gloo, {steps} steps: exit "
                                 f"{p.returncode}: " + " | ".join(runs[-1]["tail"][-4:]))
        rows = _rows(out / "metrics.csv")
    last = rows[-1] if rows else {}
    return dict(world=2, backend="gloo", device=sz.device, runs=runs,
                steps=int(last.get("step", 0)), loss=last.get("loss"),
                active=last.get("active"), clips_per_s=last.get("clips_per_s"),
                resumed=runs[-1]["resumed"])


def part_dali(args, report) -> dict:
    if args.dry_run:
        raise Skipped("dry run: DALI decodes on the GPU")
    if not args.dali_manifest:
        raise Skipped("no --dali-manifest CSV given (clips prepared elsewhere: this machine has "
                      "no PyAV or librosa to make them)")
    try:
        import nvidia.dali  # noqa: F401
    except ImportError as e:
        raise Skipped(f"nvidia.dali does not import here ({first_line(e)}): carry its wheels "
                      "(.whl, docs/GPU.md)") from None
    text = dali_throughput(args)
    cps = [float(x) for x in re.findall(r"([0-9.]+) clips/s", text)]
    return dict(manifest=args.dali_manifest, summary=text, clips_per_s=cps)


# the embedding, then the k-means++ launches of any variant (steps, persistent, lazy, resident)
NCU_KERNELS = "regex:grad_embed|kmeanspp|lazy|resident"
NCU_LAUNCHES = 6


def ncu_target(args) -> int:
    """What ncu runs (``--ncu-target``): one selection at the session's sizes, launched eagerly
    (no CUDA graph: each kernel a launch of its own), the default engine settings; on CUDA
    only its launches are profiled (``cudaProfilerStart``/``Stop`` around it, ncu's
    ``--profile-from-start off``), not the plan's warm-up over its zeroed buffers."""
    from cmacc.config import PRESETS
    from kernels import triton_select as ts

    sz = sizes(args)
    cfg = PRESETS[sz.preset]
    n, m, d, dh = (cfg.selection.pool_size, cfg.model.batch_size, cfg.model.dim,
                   cfg.model.fcl_dim)
    keys, queries, feats = _pool(n, m, d, dh, torch.Generator().manual_seed(0), sz.device)
    sel = cfg.selection
    factors, variant = sel.factors, sel.kmeans_variant
    if args.ncu_engine:  # checked by the driver's parser
        factors, _, variant = args.ncu_engine.partition(":")
    plan = ts.SelectPlan(n, m, d, dh, m, view=sel.grad_view, tau=sel.tau_p,
                         precision=sel.precision, factors=factors, variant=variant,
                         device=sz.device, keys_buffer=keys, graph=False)
    sync(sz.device)
    cuda = torch.device(sz.device).type == "cuda"
    if cuda:
        torch.cuda.profiler.start()
    plan.run(keys, n, queries, feats, None, 7)
    sync(sz.device)
    if cuda:
        torch.cuda.profiler.stop()
    return 0


def _ncu_kernels(csv_text: str) -> list[dict]:
    """ncu --page details CSV -> [{id, name, <metric>: "value unit"}] for each profiled launch."""
    lines = [ln for ln in csv_text.splitlines() if ln.startswith('"')]
    out = {}
    for r in csv.DictReader(lines):
        k = out.setdefault(r.get("ID"), {"id": r.get("ID"), "name": r.get("Kernel Name")})
        metric = r.get("Metric Name")
        if metric:
            unit = r.get("Metric Unit") or ""
            k[metric] = f"{r.get('Metric Value')} {unit}".strip()
    return list(out.values())


def part_ncu(args, report) -> dict:
    exe = shutil.which("ncu")
    if not exe:
        raise Skipped("ncu is not on PATH")
    out = Path(args.out)
    rep = out / "ncu_selection"
    target = ([sys.executable, str(DRIVER), "--ncu-target"] + (["--dry-run"] * args.dry_run)
              + (["--ncu-engine", args.ncu_engine] if args.ncu_engine else []))
    # --cache-control none: the launches see the caches as the selection left them (ncu's
    # default flushes them before each profiled launch: per-launch times were upper bounds);
    # WarpStateStats: what the warps wait on (a round's latency: the barrier, loads, compute)
    cmd = [exe, "--target-processes", "all", "--clock-control", "none", "--cache-control",
           "none", "--set", "basic", "--section", "WarpStateStats",
           "--profile-from-start", "off", "--kernel-name", NCU_KERNELS,
           "--launch-count", str(NCU_LAUNCHES), "-f", "-o", str(rep), *target]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10, args.cap - 25))
    said = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith(("==ERROR==",
                                                                               "==WARNING=="))]
    if p.returncode != 0:
        raise PartFailed(f"ncu exited {p.returncode}: " + " | ".join(
            (said or (p.stderr or p.stdout).strip().splitlines())[-3:]))
    rep_file = rep.with_suffix(".ncu-rep")
    if not rep_file.exists():
        raise PartFailed("ncu wrote no report: " + " | ".join(said[-3:] or ["(no ncu lines)"]))
    q = subprocess.run([exe, "--import", str(rep_file), "--csv", "--page", "details"],
                       capture_output=True, text=True,
                       timeout=max(5, args.cap - 5 - (time.monotonic() - t0)))
    if q.returncode != 0:
        raise PartFailed(f"ncu --import exited {q.returncode}: {q.stderr.strip()[:300]}")
    (out / "ncu_selection.csv").write_text(q.stdout)
    kernels = _ncu_kernels(q.stdout)
    if not kernels:
        raise PartFailed("ncu profiled no kernel: " + " | ".join(said[-3:] or ["(no ncu lines)"]))
    return dict(command=shlex.join(cmd[1:-len(target)] + ["python3", "bench/gpu_session.py",
                                                          *target[2:]]),
                report=rep_file.name, csv="ncu_selection.csv", kernels=kernels)
