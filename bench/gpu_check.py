"""`make gpu-check`: everything that needs a CUDA GPU, in one command, appended to bench/RESULTS.md.

    python bench/gpu_check.py [--sizes 9600 19200 38400 76800 153600] [--quick] [--part NAME ...]

Parts (``--part`` runs only those named; each part runs in a process of its own):

1. ``kernels``: the kernel tests, compiled (not interpreted): tests/test_grad_embed.py,
   test_kmeanspp.py, test_select_plan.py, test_reference.py with TRITON_INTERPRET unset;
2. ``sweep``: one dictionary's selection (kernels/triton_select.py, a bound capacity-shaped plan
   replayed from its CUDA graph) for N in --sizes, M = k = 128, d = 128, d_h = 512, both
   gradient views, every dot precision x factor dtype x k-means++ variant (steps, persistent,
   and the lazy race: ``train.py --select-impl lazy``); the median of
   ``triton.testing.do_bench``; plus, at the largest N <= 38,400, the index agreement of each
   setting with the fp32 / ieee / per-step selection (same seed); then M = 512 and 4,096 at
   N = 300 M (head view, ieee, fp32 factors), eager against lazy, with their agreement;
3. ``dali``: the DALI GPU decode throughput (bench/bench_pipeline.py's measurement, synthetic
   clips);
4. ``train``: a short ``train.py`` run with AMP (bf16) + channels-last on the GPU: clips/s, step
   time, total and visible selection time (the selection overlaps the key encoders on a side
   stream);
5. ``step``: bench/bench_step.py on the GPU: a training step of the MI nets (l = 1, 3, 8;
   N = 60 M and 300 M) and of the tiny preset, random against active on the same model, split
   into data, forward/backward and selection (total and visible).

A dated section (device, versions, commit) is appended to bench/RESULTS.md before the first part
starts, and each part's figures as soon as that part ends, so a part that fails, hangs past its
time limit or crashes the interpreter (a segmentation fault in a driver or library) costs only
its own figures. The closing summary names every failed part and the command that reruns it
alone. The raw sweep goes to bench/results/gpu_check.csv. Exit status 1 if a part failed, 2
without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import env_info, write_csv  # noqa: E402
from data_dali.cli import first_line  # noqa: E402
from data_dali.fileio import atomic_write_text  # noqa: E402

SIZES = (9600, 19200, 38400, 76800, 153600)
BATCHES = (512, 4096)  # global batches M timed at their pool N = 300 M (M = 128 at every size)
KERNEL_TESTS = ("tests/test_grad_embed.py", "tests/test_kmeanspp.py",
                "tests/test_select_plan.py", "tests/test_reference.py",
                "tests/test_resident_select.py")


def _env_without_interpreter() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CMACC_KERNELS")}


_RUNNING: list = []  # the part's process now running (for the signal handler)


def _kill_group(proc) -> None:
    """SIGKILL to ``proc``'s process group (its session's every process), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # no process of the group is left (ours)
        pass
    proc.wait()


def _die_with_parent() -> None:
    """In a part's process before it starts (Linux): SIGKILL when the driver dies, even by
    SIGKILL (a device call cut off at its limit), so that no part outlives its driver."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_in_group(argv: list, *, env: dict, timeout: float) -> tuple[int | None, bool]:
    """(exit status or None, timed out) of ``argv`` run from the repository root in a process
    group of its own, which is killed whole when it ends, however it ended: what the part
    started and left running (torchrun's ranks, ncu's target) would hold the GPU through the
    later parts. A part dies with its driver (``_die_with_parent``)."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, start_new_session=True,
                            preexec_fn=_die_with_parent)
    _RUNNING[:] = [proc]
    try:
        return proc.wait(timeout=timeout), False
    except subprocess.TimeoutExpired:
        return None, True
    finally:
        _kill_group(proc)
        _RUNNING.clear()


def _on_signal(signum, _frame):
    for proc in list(_RUNNING):
        _kill_group(proc)
    raise SystemExit(128 + signum)


def end_running_part_on_signals() -> None:
    """SIGTERM / SIGHUP / SIGINT to the driver: the running part's whole group ends with it
    (what was written so far stays)."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _on_signal)


class PartFailed(Exception):
    """A part ran to its end but its result is a failure; the message is its report."""


def kernel_tests(args) -> str:
    out = subprocess.run([sys.executable, "-m", "pytest", *KERNEL_TESTS, "-q",
                          "-p", "no:cacheprovider"], cwd=ROOT, env=_env_without_interpreter(),
                         capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    if out.returncode != 0:
        failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
        raise PartFailed("\n".join([(lines or ["(no output)"])[-1], *failed[:20]]))
    return "passed: " + (lines or ["(no output)"])[-1]


def _pool(n, m, d, dh, g, device="cuda"):
    import torch.nn.functional as F

    keys = F.normalize(torch.randn(n, d, generator=g), dim=1).to(device)  # the pool buffer [N, d]
    queries = F.normalize(torch.randn(m, d, generator=g), dim=1).to(device)  # [M, d]
    return keys, queries, torch.randn(m, dh, generator=g).to(device)  # feats [M, d_h]


def _time_settings(n, m, pool, view, settings, agree: bool, timer=None,
                   on_row=None) -> list[dict]:
    """One row per (precision, factors, k-means++) setting: the variant that ran (``ran``: a
    resident plan whose pool does not fit on chip runs steps), the median ms of a bound plan's
    replay (``timer(fn)`` -> ms; default ``triton.testing.do_bench``'s median), and
    (``agree``) its picks against those of the first setting with the same factor dtype
    (``base``; same seed: equal picks are exact agreement, not bf16 rounding against fp32).
    ``on_row(rows)`` after each row (a part's report: a timeout keeps the rows so far). The
    plans live on the pool's device (the Triton interpreter's CPU tensors too:
    bench/gpu_session.py --dry-run)."""
    from triton.testing import do_bench

    from kernels import triton_select as ts

    timer = timer or (lambda fn: do_bench(fn, return_mode="median"))

    keys, queries, feats = pool
    d, dh, k = keys.shape[1], feats.shape[1], m
    rows, bases = [], {}  # factor dtype -> (setting, picks) of its first row
    for prec, fac, var in settings:
        row = dict(M=m, N=n, view=view, precision=prec, factors=fac, kmeans=var)
        try:
            plan = ts.SelectPlan(n, m, d, dh, k, view=view, tau=1.0, precision=prec,
                                 factors=fac, variant=var, device=keys.device, keys_buffer=keys)
            row["ran"] = plan.variant
            run = lambda: plan.run(keys, n, queries, feats, None, 7)  # noqa: E731
            picks = run().clone()
            row["ms"] = timer(run)
            row["captures"] = plan.captures
            if agree:
                name, base = bases.setdefault(fac, (f"{prec}/{fac}/{plan.variant}", picks))
                row["base"] = name
                row["same_picks_vs_first"] = float((picks == base).float().mean())
                row["same_set_vs_first"] = len(set(picks.tolist()) & set(base.tolist())) / k
            del plan
        except Exception as e:  # noqa: BLE001 - reported in the table, the sweep goes on
            row["error"] = first_line(e)
        rows.append(row)
        print(row, flush=True)
        if on_row is not None:
            on_row(rows)
    return rows


def selection_sweep(sizes, quick: bool, batches=BATCHES) -> list[dict]:
    """M = 128 at every N in ``sizes`` (every setting; eager and lazy k-means++), then each M in
    ``batches`` at its paper pool N = 300 M (the default setting, eager and lazy)."""
    m, d, dh = 128, 128, 512
    settings = [(p, f, v) for p in ("ieee", "tf32x3", "tf32") for f in ("fp32", "bf16")
                for v in ("steps", "persistent", "lazy")]
    if quick:
        settings = [("ieee", "fp32", "steps"), ("ieee", "fp32", "lazy"),
                    ("tf32x3", "bf16", "persistent")]
    g = torch.Generator().manual_seed(0)
    rows = []
    agree_n = max([n for n in sizes if n <= 38400] or [min(sizes)])
    for n in sizes:
        pool = _pool(n, m, d, dh, g)
        for view in ("head", "queries"):
            rows += _time_settings(n, m, pool, view, settings, n == agree_n)
        del pool
        torch.cuda.empty_cache()
    for m in batches:  # global batches above 256: the tiled embedding, two-level reductions
        n = 300 * m
        pool = _pool(n, m, d, dh, g)
        rows += _time_settings(n, m, pool, "head", [("ieee", "fp32", "steps"),
                                                    ("ieee", "fp32", "lazy")], True)
        del pool
        torch.cuda.empty_cache()
    return rows


def dali_throughput(args) -> str:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        raise PartFailed("not measured: nvidia-dali is not installed here") from None
    from bench.bench_pipeline import clips_per_second, make_manifest

    with tempfile.TemporaryDirectory() as tmp:
        if args.dali_manifest:  # prepared clips (your own, or ones made where PyAV is installed);
            manifest = args.dali_manifest  # main() made it absolute
            if not Path(manifest).is_file():
                raise PartFailed(f"--dali-manifest {args.dali_manifest}: no such file; give the "
                                 "manifest.csv that `cmacc-prepare` wrote")
        else:
            manifest = make_manifest(Path(tmp), 64)
        out = [f"clips: {args.dali_manifest or '64 synthetic clips, prepared here'}"]
        for views in (1, 2):
            cps, backend, builds = clips_per_second(manifest, "dali", "cuda", batch=8, workers=4,
                                                    frames=16, crop=112, views=views, prefetch=2,
                                                    epochs=2)
            out.append(f"{cps:.1f} clips/s ({views} view{'s' * (views > 1)}, {backend}, "
                       f"{builds} build)")
    return "; ".join(out)


def train_run(args) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "train.py", "--preset", "tiny", "--device", "cuda", "--amp", "bf16",
               "--steps", "60", "--log-every", "20", "--out", tmp, "--resume", "none"]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
        if out.returncode != 0:
            raise PartFailed("`train.py` exited %d: %s" % (
                out.returncode, (out.stderr.strip().splitlines() or ["?"])[-1]))
        with open(Path(tmp) / "metrics.csv", newline="") as f:
            last = list(csv.DictReader(f))[-1]
    return (f"`{' '.join(cmd[1:-4])}`: {float(last['clips_per_s']):.0f} clips/s/GPU, step "
            f"{1e3 * float(last['t_step']):.1f} ms, selection {1e3 * float(last['t_select']):.2f}"
            f" ms total / {1e3 * float(last['t_select_visible']):.2f} ms visible / "
            f"{1e3 * float(last['t_select_alone']):.2f} ms alone (its SM time), "
            f"MFU {last['mfu']}")


def step_table(args) -> str:
    from bench.bench_step import markdown, run

    rows = run(rows=("mi", "tiny"), steps=5 if args.quick else 20, device="cuda")
    return "Command: `python bench/bench_step.py --device cuda --rows mi tiny`\n\n" + markdown(rows)


def versions() -> str:
    parts = [f"torch {torch.__version__}", f"CUDA {torch.version.cuda}"]
    for mod in ("triton", "torchaudio", "torchvision", "nvidia.dali"):
        try:
            parts.append(f"{mod.split('.')[-1]} {__import__(mod, fromlist=['x']).__version__}")
        except ImportError:
            parts.append(f"{mod.split('.')[-1]} n/a")
    return ", ".join(parts)


def header(info, argv=()) -> str:
    """The dated section's head; ``argv``: the options the check ran with (none: the whole
    check, as `make gpu-check` runs it)."""
    command = "python bench/gpu_check.py " + " ".join(argv) if argv else "make gpu-check"
    return (f"\n## GPU check, {info['date']}: {info['device']}\n\n"
            f"Commit {info['commit']}; {versions()}. Command: `{command.strip()}`. Each part "
            "below was appended when it ended.\n")


def sweep_table(rows: list[dict]) -> str:
    lines = ["Selection (one dictionary, k = M, d = 128, d_h = 512; median of "
             "`triton.testing.do_bench`, ms; bound plan replayed from one CUDA graph; k-means++ "
             "`lazy` = `--select-impl lazy`):", "",
             "| M | N | view | precision | factors | k-means++ | ms | same picks / same set vs "
             "the first row of its M, N and factors |", "|---:|---:|---|---|---|---|---:|---|"]
    for r in rows:
        agree = (f"{r['same_picks_vs_first']:.3f} / {r['same_set_vs_first']:.3f}"
                 if "same_picks_vs_first" in r else "")
        ms = f"{r['ms']:.3f}" if "ms" in r else f"failed: {r.get('error', '?')}"
        ran = r.get("ran", r["kmeans"])  # (a resident plan whose pool does not fit runs steps)
        kmeans = r["kmeans"] if ran == r["kmeans"] else f"{r['kmeans']} (ran {ran})"
        lines.append(f"| {r.get('M', 128)} | {r['N']} | {r['view']} | {r['precision']} | "
                     f"{r['factors']} | {kmeans} | {ms} | {agree} |")
    return "\n".join(lines)


def sweep(args) -> str:
    rows = selection_sweep(args.sizes, args.quick)
    if rows:
        info = env_info("cuda")
        write_csv([{**info, **r} for r in rows], ROOT / "bench" / "results" / "gpu_check.csv")
    table = sweep_table(rows)
    if not rows or any("error" in r for r in rows):
        raise PartFailed(table)
    return table


PARTS = {  # name: (title, function(args) -> Markdown of its figures; PartFailed if it failed)
    "kernels": ("kernel tests, compiled", kernel_tests),
    "sweep": ("selection sweep", sweep),
    "dali": ("DALI GPU decode + augment", dali_throughput),
    "train": ("train.py, AMP bf16 + channels-last", train_run),
    "step": ("training step, random vs active (bench/bench_step.py)", step_table),
}
REPORT_ENV = "GPU_CHECK_REPORT"  # where a part's process writes its figures (Markdown)


@dataclass
class Part:
    name: str
    title: str
    argv: list  # the command that runs this part alone (in a process of its own)
    rerun: str  # the same, for a person
    timeout: float = 3600.0


def append(path: Path, text: str) -> None:
    """Append to the results file at once (atomically: a crash never leaves it half-written)."""
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    atomic_write_text(path, old + text)


def _how_it_ended(rc: int | None, timed_out: bool, timeout: float) -> str:
    if timed_out:
        return f"did not finish within {timeout:.0f} s (killed)"
    if rc is not None and rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"crashed ({name})"
    return f"failed (exit status {rc})"


def run_parts(parts: list[Part], results: Path, head: str) -> list[tuple[str, str]]:
    """Run each part in its own process, one after another; append ``head`` first and each
    part's figures (or what went wrong) as soon as it ends. Returns [(name, how it failed)] of
    the failed parts, after appending a summary that names them and how to rerun each alone."""
    append(results, head)
    end_running_part_on_signals()
    failed = []
    for part in parts:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.md"
            env = {**os.environ, REPORT_ENV: str(report)}
            rc, timed_out = run_in_group(part.argv, env=env, timeout=part.timeout)
            text = report.read_text().strip() if report.exists() else ""
        secs = time.monotonic() - t0
        if rc == 0:
            status = f"passed ({secs:.0f} s)"
        else:
            status = f"**FAILED**: {_how_it_ended(rc, timed_out, part.timeout)} after {secs:.0f} s"
            status += f"; rerun alone: `{part.rerun}`"
            failed.append((part.name, _how_it_ended(rc, timed_out, part.timeout)))
        body = text or ("(no figures: the part ended before writing them)" if rc else "")
        append(results, f"\n### {part.title}: {status}\n\n{body}\n")
        print(f"{part.title}: {status}", flush=True)
    if failed:
        lines = [f"- {name}: {how}; rerun alone: `{next(p.rerun for p in parts if p.name == name)}`"
                 for name, how in failed]
        summary = "\n**Failed parts** (the others' figures are above):\n\n" + "\n".join(lines)
    else:
        summary = f"\nAll {len(parts)} parts passed."
    append(results, summary + "\n")
    print(summary.strip(), flush=True)
    return failed


def run_one(name: str, args) -> int:
    """The body of a part's own process: run it, write its figures where the parent reads them
    (REPORT_ENV; stdout without it). Exit 0 passed, 1 failed."""
    title, fn = PARTS[name]
    try:
        text, rc = fn(args), 0
    except PartFailed as e:
        text, rc = str(e), 1
    except Exception as e:  # noqa: BLE001 - reported as this part's failure
        text, rc = f"error: {first_line(e)}", 1
    dest = os.environ.get(REPORT_ENV)
    if dest:
        atomic_write_text(Path(dest), text + "\n")
    print(f"{title}: {text}", flush=True)
    return rc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    p.add_argument("--quick", action="store_true",
                   help="three settings per size instead of eighteen")
    p.add_argument("--results", default=str(ROOT / "bench" / "RESULTS.md"))
    p.add_argument("--dali-manifest", metavar="CSV",
                   help="dali part: time these prepared clips instead of 64 synthetic ones made "
                        "here (making them needs PyAV and librosa)")
    p.add_argument("--part", nargs="+", choices=tuple(PARTS), help="run only these parts")
    p.add_argument("--one", choices=tuple(PARTS), help=argparse.SUPPRESS)  # a part's process
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("make gpu-check needs a CUDA GPU (torch.cuda.is_available() is False here); on a "
              "CPU machine run `make test` (the kernels run in the Triton interpreter there)",
              file=sys.stderr)
        return 2
    os.environ.pop("TRITON_INTERPRET", None)
    if args.dali_manifest:  # the parts run from the repository root, not from here
        args.dali_manifest = str(Path(args.dali_manifest).resolve())
    if args.one:
        return run_one(args.one, args)
    common = (["--sizes", *map(str, args.sizes)] if args.sizes != list(SIZES) else [])
    common += ["--quick"] if args.quick else []
    common += ["--dali-manifest", args.dali_manifest] if args.dali_manifest else []
    parts = [Part(name, PARTS[name][0], [sys.executable, str(Path(__file__).resolve()), "--one",
                                         name, *common],
                  f"python bench/gpu_check.py --part {name} {' '.join(common)}".strip())
             for name in (args.part or PARTS)]
    results = Path(args.results)
    shown = (["--part", *args.part] if args.part else []) + common  # what was measured
    failed = run_parts(parts, results, header(env_info("cuda"), shown))
    print(f"appended to {results}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
