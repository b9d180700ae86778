"""`make gpu-check`: everything that needs a CUDA GPU, in one command, appended to bench/RESULTS.md.

    python bench/gpu_check.py [--sizes 9600 19200 38400 76800 153600] [--quick]

1. the kernel tests, compiled (not interpreted): tests/test_grad_embed.py, test_kmeanspp.py,
   test_select_plan.py, test_reference.py with TRITON_INTERPRET unset;
2. the selection sweep: one dictionary's selection (kernels/triton_select.py, a bound
   capacity-shaped plan replayed from its CUDA graph) for N in --sizes, M = k = 128, d = 128,
   d_h = 512, both gradient views, every dot precision x factor dtype x k-means++ variant; the
   median of ``triton.testing.do_bench``; plus, at the largest N <= 38,400, the index agreement
   of each setting with the fp32 / ieee / per-step selection (same seed);
3. the DALI GPU decode throughput (bench/bench_pipeline.py's measurement, synthetic clips);
4. a short ``train.py`` run with AMP (bf16) + channels-last on the GPU: clips/s, step time,
   total and visible selection time (the selection overlaps the key encoders on a side stream).

Each part that fails is reported as failed (its first error line) and the others still run;
the dated section (device, versions, commit) is appended to bench/RESULTS.md, the raw sweep to
bench/results/gpu_check.csv. Exit status 1 if a part failed, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import env_info, write_csv  # noqa: E402
from data_dali.cli import first_line  # noqa: E402
from data_dali.fileio import atomic_write_text  # noqa: E402

SIZES = (9600, 19200, 38400, 76800, 153600)
KERNEL_TESTS = ("tests/test_grad_embed.py", "tests/test_kmeanspp.py",
                "tests/test_select_plan.py", "tests/test_reference.py")


def _env_without_interpreter() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CMACC_KERNELS")}


def kernel_tests() -> str:
    out = subprocess.run([sys.executable, "-m", "pytest", *KERNEL_TESTS, "-q",
                          "-p", "no:cacheprovider"], cwd=ROOT, env=_env_without_interpreter(),
                         capture_output=True, text=True, timeout=1800)
    tail = [ln for ln in out.stdout.splitlines() if ln.strip()][-1:] or ["(no output)"]
    return ("passed: " if out.returncode == 0 else "FAILED: ") + tail[0]


def selection_sweep(sizes, quick: bool) -> list[dict]:
    import torch.nn.functional as F
    from triton.testing import do_bench

    from kernels import triton_select as ts

    m = k = 128
    d, dh = 128, 512
    settings = [(p, f, v) for p in ("ieee", "tf32x3", "tf32") for f in ("fp32", "bf16")
                for v in ("steps", "persistent")]
    if quick:
        settings = [("ieee", "fp32", "steps"), ("tf32x3", "bf16", "persistent")]
    g = torch.Generator().manual_seed(0)
    rows = []
    agree_n = max([n for n in sizes if n <= 38400] or [min(sizes)])
    for n in sizes:
        keys = F.normalize(torch.randn(n, d, generator=g), dim=1).cuda()  # the pool buffer
        queries = F.normalize(torch.randn(m, d, generator=g), dim=1).cuda()
        feats = torch.randn(m, dh, generator=g).cuda()
        for view in ("head", "queries"):
            base = None
            for prec, fac, var in settings:
                row = dict(N=n, view=view, precision=prec, factors=fac, kmeans=var)
                try:
                    plan = ts.SelectPlan(n, m, d, dh, k, view=view, tau=1.0, precision=prec,
                                         factors=fac, variant=var, device="cuda",
                                         keys_buffer=keys)
                    run = lambda: plan.run(keys, n, queries, feats, None, 7)  # noqa: E731
                    picks = run()
                    row["ms"] = do_bench(run, return_mode="median")
                    row["captures"] = plan.captures
                    if n == agree_n:
                        if base is None:
                            base = picks
                        row["same_picks_vs_first"] = float((picks == base).float().mean())
                        row["same_set_vs_first"] = len(set(picks.tolist()) &
                                                       set(base.tolist())) / k
                    del plan
                except Exception as e:  # noqa: BLE001 - reported in the table, the sweep goes on
                    row["error"] = first_line(e)
                rows.append(row)
                print(row, flush=True)
        torch.cuda.empty_cache()
    return rows


def dali_throughput() -> str:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return "not measured: nvidia-dali is not installed here"
    from bench.bench_pipeline import clips_per_second, make_manifest

    with tempfile.TemporaryDirectory() as tmp:
        manifest = make_manifest(Path(tmp), 64)
        out = []
        for views in (1, 2):
            cps, backend, builds = clips_per_second(manifest, "dali", "cuda", batch=8, workers=4,
                                                    frames=16, crop=112, views=views, prefetch=2,
                                                    epochs=2)
            out.append(f"{cps:.1f} clips/s ({views} view{'s' * (views > 1)}, {backend}, "
                       f"{builds} build)")
    return "; ".join(out)


def train_run() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "train.py", "--preset", "tiny", "--device", "cuda", "--amp", "bf16",
               "--steps", "60", "--log-every", "20", "--out", tmp, "--resume", "none"]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
        if out.returncode != 0:
            return "FAILED: " + (out.stderr.strip().splitlines() or ["?"])[-1]
        with open(Path(tmp) / "metrics.csv", newline="") as f:
            last = list(csv.DictReader(f))[-1]
    return (f"`{' '.join(cmd[1:-4])}`: {float(last['clips_per_s']):.0f} clips/s/GPU, step "
            f"{1e3 * float(last['t_step']):.1f} ms, selection {1e3 * float(last['t_select']):.2f}"
            f" ms total / {1e3 * float(last['t_select_visible']):.2f} ms visible, "
            f"MFU {last['mfu']}")


def versions() -> str:
    parts = [f"torch {torch.__version__}", f"CUDA {torch.version.cuda}"]
    for mod in ("triton", "torchaudio", "torchvision", "nvidia.dali"):
        try:
            parts.append(f"{mod.split('.')[-1]} {__import__(mod, fromlist=['x']).__version__}")
        except ImportError:
            parts.append(f"{mod.split('.')[-1]} n/a")
    return ", ".join(parts)


def section(info, parts: dict, rows: list[dict]) -> str:
    lines = [f"\n## GPU check, {info['date']}: {info['device']}\n",
             f"Commit {info['commit']}; {versions()}. Command: `make gpu-check`.\n"]
    for name, text in parts.items():
        lines.append(f"- **{name}**: {text}")
    lines += ["", "Selection (one dictionary, M = k = 128, d = 128, d_h = 512; median of "
              "`triton.testing.do_bench`, ms; bound plan replayed from one CUDA graph):", "",
              "| N | view | precision | factors | k-means++ | ms | same picks / same set vs "
              "first row |", "|---:|---|---|---|---|---:|---|"]
    for r in rows:
        agree = (f"{r['same_picks_vs_first']:.3f} / {r['same_set_vs_first']:.3f}"
                 if "same_picks_vs_first" in r else "")
        ms = f"{r['ms']:.3f}" if "ms" in r else f"failed: {r.get('error', '?')}"
        lines.append(f"| {r['N']} | {r['view']} | {r['precision']} | {r['factors']} | "
                     f"{r['kmeans']} | {ms} | {agree} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    p.add_argument("--quick", action="store_true", help="two settings per size instead of twelve")
    p.add_argument("--results", default=str(ROOT / "bench" / "RESULTS.md"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("make gpu-check needs a CUDA GPU (torch.cuda.is_available() is False here); on a "
              "CPU machine run `make test` (the kernels run in the Triton interpreter there)",
              file=sys.stderr)
        return 2
    os.environ.pop("TRITON_INTERPRET", None)
    info = env_info("cuda")
    parts, failed = {}, False
    for name, fn in (("kernel tests, compiled", kernel_tests),
                     ("DALI GPU decode + augment", dali_throughput),
                     ("train.py, AMP bf16 + channels-last", train_run)):
        try:
            parts[name] = fn()
        except Exception as e:  # noqa: BLE001 - one part's failure must not lose the others
            parts[name] = f"FAILED: {first_line(e)}"
        failed |= parts[name].startswith("FAILED")
        print(f"{name}: {parts[name]}", flush=True)
    try:
        rows = selection_sweep(args.sizes, args.quick)
    except Exception as e:  # noqa: BLE001
        rows, failed = [], True
        parts["selection sweep"] = f"FAILED: {first_line(e)}"
    failed |= any("error" in r for r in rows)
    if rows:
        write_csv([{**info, **r} for r in rows], ROOT / "bench" / "results" / "gpu_check.csv")
    path = Path(args.results)
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    atomic_write_text(path, text + section(info, parts, rows))
    print(f"appended to {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
