"""`make gpu-session`: one lent GPU turned into every figure, in one call of at most 9 minutes.

    python3 bench/gpu_session.py [--out DIR] [--budget-s 540] [--part NAME ...]
                                 [--pairs 3] [--dali-manifest CSV] [--dry-run]

Written for a machine with torch and triton but no package index (it never installs anything:
`make gpu-session` runs it with `$(PYTHON)`, python3 by default). Every figure goes to
``DIR/session.jsonl`` (default ``$OUT``, else runs/gpu_session), one JSON line per part, written
and flushed (fsync) AS EACH PART ENDS; each part runs in a process of its own (as in
bench/gpu_check.py), so a part that raises, crashes the interpreter or hangs past its time cap
costs only its own line, and a call cut off at its time limit loses nothing already written.
A part's process leads a process group of its own, killed whole when the part ends, however
it ended, and with the driver.

Lines, in this order (``part`` names each; docs/GPU.md, "The prepared GPU session", lists
every key):

0. ``env``: device name, SM count, memory, compute capability, torch / triton / CUDA / cuDNN /
   driver versions, commit, and the clocks, power and temperature nvidia-smi reads;
1. ``pairs``: ``train.py --preset paper`` (AMP bf16, channels-last, the in-memory synthetic
   clips, M = 128, K = 3,840, N = 38,400, the paper's r3d_18 / ResNet-18 encoders) through
   ``cmacc.trainer.Trainer`` itself, random against active in ``--pairs`` alternating pairs
   (random, active, random, active, ...): each run a fresh trainer, its pools filled with random
   unit keys before its first step (so active selects from step 1), 4 warm-up steps then 16
   timed; per run the trainer's own metrics (step, data wait, selection total / visible,
   clips/s, MFU); then active / random per pair and the mean with its 95 % t-interval
   (``cmacc.metrics.mean_ci``);
2. ``layers``: the same trainer (random sampler) with the video encoders' fast layer forms
   (cmacc.layer_forms.StemConv3d, ChannelsLastBatchNorm3d: the defaults), with the fast stem and
   BatchNorm3d's own path, with their declared nn.Conv3d / nn.BatchNorm3d, and with the fast
   stem and the Triton batch norm with its fused add and ReLU (kernels/triton_batchnorm.py),
   2 alternating rounds: step time off / fast, stem-only / fast and fast / triton per round,
   each mean with its 95 % t-interval;
2b. ``bn``: each BatchNorm3d shape of r3d_18 at the paper batch alone, in training: forward,
   and forward + backward, in BatchNorm3d's own path, the 4-D view and the Triton kernels (ms,
   GB/s of the least traffic, the Triton form's largest difference from the view's);
3. ``select``: one dictionary's selection (N = 38,400, M = 128, head view, ieee dots) for every
   k-means++ variant in kernels/triton_kmeanspp.py ``VARIANTS`` x fp32 / bf16 factors
   (``triton.testing.do_bench``), then the training's two selections on a side stream beside a
   bf16 r3d_18 key-encoder forward on the main stream, at default and at high priority (the
   side stream's and the graph captures'); each setting's row kept as it ends;
4. ``profile``: a ``torch.profiler`` trace (CPU + CUDA) of 10 active steps of the same trainer:
   ``profile_trace.json.gz``, ``profile_kernels.csv`` (name, calls, total and mean CUDA us per
   kernel), the top 20 kernels, and the totals of every ``record_function`` range that appears;
5. ``convs``: each r3d_18 conv layer at the paper's shapes (batch 128, 3 x 16 x 112 x 112,
   channels-last-3d, bf16), forward and backward TFLOP/s with cuDNN autotuning
   (``torch.backends.cudnn.benchmark``) off and on, the whole video encoder's forward +
   backward at both, with its fast layer forms off and with the Triton batch norm, and the stem
   alone in six forms;
6. ``loader``: the in-memory loader alone at the paper batch: gather, pin and host-to-device ms
   per batch and batches/s, without and with the background prefetch (cmacc/prefetch.py;
   "absent" where it is not there);
7. ``dali``: DALI decode throughput of ``--dali-manifest`` clips (bench/gpu_check.py's part), or
   a line saying why it was skipped;
8. ``ncu``: Nsight Compute (``--set basic`` and the warp stall reasons, 6 launches, the
   selection's own: not its plan's warm-up) on the selection's kernels: ``ncu_selection.ncu-rep`` and ``ncu_selection.csv``;
9. ``compile``: the paper trainer with ``--compile`` (torch.compile of the backbones): the
   warm-up (compile) time and the step time, or the error line (a cold inductor compile may
   take its whole cap);
10. ``dist``: ``torchrun --nproc_per_node 2`` on the one GPU with ``--dist-backend gloo`` (the
   ranks share it): a few steps with DDP, shuffle-BN, the gathers and a checkpoint, then a
   resume: the distributed paths on CUDA tensors before a multi-GPU run (last: a test of the
   paths, no speed figure, run when the budget leaves time for it);

and a closing ``end`` line (failed and skipped parts, the clocks after the session).

Time: ``--budget-s`` (default 540 s) for the whole session; each part has a time cap (PARTS
below) and is given at most the budget left; a part is skipped, with a line that says so and
the command that runs it alone, when less is left than it needs. A failed part's line names how
it ended, its error, the figures it had reported so far and the command that reruns it alone
(``--part NAME``). Exit status 1 if a part failed, 2 without a GPU (unless ``--dry-run``).

This file is the driver (the parts' table, the budget, one process per part, the lines); the
parts are in bench/session_parts.py and what they share (sizes, timers, the trainer run) in
bench/session_common.py. It puts the repository root on sys.path itself, so it runs where the
project is not installed.

``--dry-run``: every part on the CPU at the tiny preset's sizes (a few steps, N = 192; the
select part through the Triton interpreter), in well under a minute: the same lines and keys,
no meaningful figures. tests/test_gpu_session.py runs it. ``--fail-part NAME`` (a testing hook)
makes that part's process abort at its start (``NAME:hang``: hang there, beside a child;
``NAME:orphan``: exit 1, leaving a child running).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402  (no CUDA call at import time, here or in the parts' modules)

from bench.gpu_check import (_env_without_interpreter, _how_it_ended,  # noqa: E402
                             end_running_part_on_signals, run_in_group)
from bench.session_common import Skipped, nvidia_smi_clocks  # noqa: E402
from bench.session_parts import (ncu_target, part_bn, part_compile, part_convs, part_dali,  # noqa: E402
                                 part_dist, part_env, part_layers, part_loader, part_ncu,
                                 part_pairs, part_profile, part_select)
from data_dali.cli import first_line  # noqa: E402
from data_dali.fileio import atomic_write_text  # noqa: E402

SCRIPT = Path(__file__).resolve()
REPORT_ENV = "GPU_SESSION_REPORT"  # where a part's process writes its figures (JSON)
LINES = "session.jsonl"
HEAD = ("part", "status", "seconds", "cap_s")  # every line starts with these
SKIPPED = ("why",)
FAILED = ("how", "error", "rerun", "partial")
END = ("failed", "skipped", "budget_s", "clocks")


def _finite(x):
    """JSON has no NaN / inf: None instead (at any depth)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


@dataclasses.dataclass(frozen=True)
class Spec:
    fn: object  # fn(args, report) -> figures
    cap_s: float  # the part's time limit
    min_s: float  # skipped when less of the budget than this is left
    keys: tuple  # its figures, in this order


PARTS = {  # in the order they run: the most valuable first
    "pairs": Spec(part_pairs, 200, 90, (
        "preset", "warmup_steps", "timed_steps", "pairs", "runs", "step_ratio", "step_ratio_mean",
        "step_ratio_ci95", "iter_ratio", "iter_ratio_mean", "iter_ratio_ci95",
        "cudnn_benchmark")),
    "layers": Spec(part_layers, 150, 60, (
        "stem", "bn", "runs", "speedup", "speedup_mean", "speedup_ci95", "bn_speedup",
        "bn_speedup_mean", "bn_speedup_ci95", "triton_speedup", "triton_speedup_mean",
        "triton_speedup_ci95")),
    "bn": Spec(part_bn, 90, 30, ("batch", "forms", "shapes", "encoder_fwd_bwd_ms")),
    "select": Spec(part_select, 60, 25, (
        "N", "M", "d", "d_h", "variants", "alone", "overlap_setting", "encoder_ms",
        "selections_ms", "beside")),
    "profile": Spec(part_profile, 90, 40, (
        "steps", "wall_ms_per_step", "ops_by_shape", "all_threads", "what", "trace",
        "trace_bytes", "trace_holds",
        "kernels_csv", "kernel_count", "kernel_ms_per_step", "top20", "ranges", "ranges_missing",
        "other_ranges", "run")),
    "convs": Spec(part_convs, 75, 30, (
        "dtype", "batch", "input", "layout", "flops", "layers", "encoder", "stem",
        "peak_tflops")),
    "loader": Spec(part_loader, 50, 20, (
        "batch", "clips", "make_s", "batch_mb", "batches", "gather_ms", "pin_ms", "h2d_ms",
        "h2d_gb_s", "serial_batches_per_s", "prefetch", "prefetch_batches_per_s",
        "prefetch_speedup")),
    "dali": Spec(part_dali, 60, 20, ("manifest", "summary", "clips_per_s")),
    "ncu": Spec(part_ncu, 90, 60, ("command", "report", "csv", "kernels")),
    # last: a cold inductor compile of the paper encoders may take its whole cap
    "compile": Spec(part_compile, 150, 60, (
        "backend", "warm_s", "step_ms", "iter_ms", "clips_per_s", "mfu", "error",
        "forwards_started_at_s")),
    # after compile: a test of the distributed paths (no speed figure), run when time is left
    "dist": Spec(part_dist, 120, 45, (
        "world", "backend", "device", "runs", "steps", "loss", "active", "clips_per_s",
        "resumed")),
}
ENV = Spec(part_env, 60, 0, (
    "device", "sm_count", "memory_gib", "capability", "l2_mib", "torch", "triton", "cuda",
    "cudnn", "driver", "versions", "commit", "source_sha256", "date", "python", "cpu_count",
    "clocks", "dry_run", "budget_s", "layer_forms"))
FAIL_ENV = "GPU_SESSION_FAIL"  # the --fail-part hook, as the parts' processes see it


def spec(name: str) -> Spec:
    return ENV if name == "env" else PARTS[name]


# ---------------------------------------------------------------------------------------------
# the session: each part in a process of its own, its line appended as soon as it ends
# ---------------------------------------------------------------------------------------------
def write_line(path: Path, line: dict) -> None:
    """Append one JSON line and force it to disk (a timeout or crash later loses nothing)."""
    with open(path, "a") as f:
        f.write(json.dumps(_finite(line)) + "\n")
        f.flush()
        os.fsync(f.fileno())


def part_line(name: str, status: str, seconds: float, cap: float, body: dict) -> dict:
    """A part's line: HEAD, then its figures in spec(name).keys order (ok), or SKIPPED / FAILED."""
    keys = {"ok": spec(name).keys, "skipped": SKIPPED, "failed": FAILED}[status]
    return {"part": name, "status": status, "seconds": round(seconds, 2), "cap_s": cap,
            **{k: body.get(k) for k in keys}}


def common_argv(args) -> list[str]:
    """The options that a part's process and a rerun command carry."""
    out = ["--dry-run"] if args.dry_run else []
    out += ["--pairs", str(args.pairs)] if args.pairs != 3 else []
    out += ["--dali-manifest", args.dali_manifest] if args.dali_manifest else []
    out += ["--ncu-engine", args.ncu_engine] if args.ncu_engine else []
    return out


def rerun_command(name: str, args) -> str:
    return " ".join(["python3 bench/gpu_session.py --part", name, *common_argv(args)])


def run_part(name: str, args, out: Path, timeout: float) -> tuple[str, dict, float]:
    """(status, body, seconds) of one part run in its own process within ``timeout`` s."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        env = _env_without_interpreter() if not args.dry_run else dict(os.environ)
        env.pop("TRITON_INTERPRET", None)
        if args.dry_run and name in ("select", "ncu"):  # Triton kernels on CPU tensors
            env["TRITON_INTERPRET"] = "1"
        env[REPORT_ENV] = str(report)
        if args.fail_part:
            env[FAIL_ENV] = args.fail_part
        argv = [sys.executable, str(SCRIPT), "--one", name, "--out", str(out),
                "--cap", f"{timeout:.0f}", *common_argv(args)]
        # a process group of its own: its end (or Ctrl-C) ends the part's torchrun ranks and
        # ncu's target too, which would otherwise hold the GPU through the later parts
        rc, timed_out = run_in_group(argv, env=env, timeout=timeout)
        try:
            got = json.loads(report.read_text()) if report.exists() else {}
        except ValueError:
            got = {}
    secs = time.monotonic() - t0
    if rc == 0 and got.get("status") in ("ok", "skipped"):
        return got["status"], got.get("figures", {}) if got["status"] == "ok" else got, secs
    how = _how_it_ended(rc, timed_out, timeout)
    return "failed", dict(how=how, error=got.get("error"), rerun=rerun_command(name, args),
                          partial=got.get("figures", {})), secs


def run_session(args) -> int:
    end_running_part_on_signals()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = out / LINES
    t_start = time.monotonic()
    status, body, secs = run_part("env", args, out, ENV.cap_s)
    write_line(lines, part_line("env", status, secs, ENV.cap_s, body))
    print(f"env: {status} ({secs:.0f} s): {body.get('device') or body.get('error')}", flush=True)
    failed, skipped = [], []
    for name in args.part or PARTS:
        s = PARTS[name]
        left = args.budget_s - (time.monotonic() - t_start)
        if left < s.min_s:
            why = (f"budget: {max(0.0, left):.0f} s left of --budget-s {args.budget_s:.0f}, this "
                   f"part needs at least {s.min_s:.0f} s (cap {s.cap_s:.0f} s); run it alone: "
                   f"{rerun_command(name, args)}")
            write_line(lines, part_line(name, "skipped", 0.0, s.cap_s, dict(why=why)))
            skipped.append(name)
            print(f"{name}: skipped ({why})", flush=True)
            continue
        cap = min(s.cap_s, left)
        status, body, secs = run_part(name, args, out, cap)
        write_line(lines, part_line(name, status, secs, cap, body))
        if status == "failed":
            failed.append(name)
            print(f"{name}: FAILED: {body['how']}: {body['error']}; rerun alone: "
                  f"{body['rerun']}", flush=True)
        else:
            if status == "skipped":
                skipped.append(name)
            print(f"{name}: {status} ({secs:.0f} s)", flush=True)
    total = time.monotonic() - t_start
    write_line(lines, {"part": "end", "status": "failed" if failed else "ok",
                       "seconds": round(total, 2), "cap_s": args.budget_s, "failed": failed,
                       "skipped": skipped, "budget_s": args.budget_s,
                       "clocks": nvidia_smi_clocks()})
    print(f"session: {total:.0f} s, {len(failed)} failed {failed}, {len(skipped)} skipped "
          f"{skipped}; lines in {lines}", flush=True)
    return 1 if failed else 0


def run_one(name: str, args) -> int:
    """The body of a part's own process: its figures (or why it skipped, or its error) as JSON
    where the session reads them (REPORT_ENV), rewritten at each report() so that a crash or
    a timeout keeps what was measured. Exit 0 ok or skipped, 1 failed."""
    dest = os.environ.get(REPORT_ENV)
    state = {"status": "running", "figures": {}}

    def save():
        if dest:
            atomic_write_text(Path(dest), json.dumps(_finite(state)))

    def report(**figures):
        state["figures"].update(figures)
        save()

    if os.environ.get(FAIL_ENV) == name:  # the testing hook: this part's process dies
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # (no core file left behind)
        os.abort()
    if os.environ.get(FAIL_ENV) in (name + ":hang", name + ":orphan"):  # the testing hooks: a
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        report(child_pid=child.pid)  # child left running, and this part hangs or fails
        if os.environ[FAIL_ENV].endswith(":orphan"):
            sys.exit(1)
        time.sleep(600)
    if not args.dry_run:
        os.environ.pop("TRITON_INTERPRET", None)
    try:
        figures = spec(name).fn(args, report)
        state.update(status="ok", figures={k: figures.get(k) for k in spec(name).keys})
        rc = 0
    except Skipped as e:
        state.update(status="skipped", why=str(e))
        rc = 0
    except Exception as e:  # noqa: BLE001 - this part's failure, in its line
        state.update(status="failed", error=f"{type(e).__name__}: {first_line(e, 500)}")
        rc = 1
        import traceback

        traceback.print_exc()
    save()
    if not args.dry_run:  # figures are on disk: leave without the interpreter's teardown
        sys.stdout.flush()  # (inductor's workers, the CUDA context), which could outlast the
        sys.stderr.flush()  # cap and turn a finished part into a killed one
        os._exit(rc)
    return rc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "runs" / "gpu_session"),
                   help=f"folder for {LINES} and the parts' files (default $OUT, else "
                        "runs/gpu_session)")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="seconds for the whole session (default 540: one 10-minute device call "
                        "with a minute to spare)")
    p.add_argument("--part", nargs="+", choices=tuple(PARTS), help="run only these parts")
    p.add_argument("--pairs", type=int, default=3,
                   help="pairs part: alternating random / active pairs (default 3)")
    p.add_argument("--dali-manifest", metavar="CSV",
                   help="dali part: clips prepared elsewhere (cmacc-prepare's manifest.csv)")
    p.add_argument("--ncu-engine", metavar="FACTORS:VARIANT",
                   help="ncu part: profile the selection with these factors (fp32, bf16) and "
                        "k-means++ variant (steps, persistent, lazy, resident) instead of the "
                        "paper preset's (e.g. bf16:resident)")
    p.add_argument("--dry-run", action="store_true",
                   help="every part on the CPU at tiny sizes: the lines, not the figures")
    p.add_argument("--fail-part", choices=(*PARTS, *(f"{n}:{how}" for n in PARTS
                                                     for how in ("hang", "orphan"))),
                   help=argparse.SUPPRESS)  # testing hook
    p.add_argument("--one", choices=("env", *PARTS), help=argparse.SUPPRESS)  # a part's process
    p.add_argument("--cap", type=float, default=60.0, help=argparse.SUPPRESS)
    p.add_argument("--ncu-target", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.pairs < 1 or args.budget_s <= 0:
        p.error("--pairs must be >= 1 and --budget-s > 0")
    if args.ncu_engine:
        factors, _, variant = args.ncu_engine.partition(":")
        from cmacc.config import SELECT_FACTORS
        from kernels.triton_kmeanspp import VARIANTS

        if factors not in SELECT_FACTORS or variant not in VARIANTS:
            p.error(f"--ncu-engine {args.ncu_engine!r}: FACTORS:VARIANT with FACTORS one of "
                    f"{SELECT_FACTORS} and VARIANT one of {VARIANTS} (e.g. bf16:resident)")
    if args.dali_manifest:  # the parts run from the repository root, not from here
        args.dali_manifest = str(Path(args.dali_manifest).resolve())
    args.out = str(Path(args.out).resolve())
    if args.ncu_target:
        return ncu_target(args)
    if args.one:
        return run_one(args.one, args)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench/gpu_session.py needs a CUDA GPU (torch.cuda.is_available() is False here); "
              "on a CPU machine `python bench/gpu_session.py --dry-run` checks the plumbing",
              file=sys.stderr)
        return 2
    return run_session(args)


if __name__ == "__main__":
    sys.exit(main())
