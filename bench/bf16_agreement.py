"""How much do bf16 factors change the selection? The reference selection (kernels.select on the
reference backend, fp32 math) with fp32 factors vs the same factors rounded to bf16 (as the
kernel stores them with ``factors="bf16"``), same seed: the share of picks equal position by
position, the share of the selected set in common, and the first step where they differ.

    python bench/bf16_agreement.py [--n 38400] [--seeds 4] [--view head]

Inputs as in bench/bench_kmeanspp.py (unit keys and queries, Gaussian pre-head features).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
from bench.bench_kmeanspp import make_inputs  # noqa: E402
from bench.common import env_info  # noqa: E402


def agreement(n, m, d, dh, view, seed):
    keys, queries, feats = make_inputs(n, m, d, dh, "cpu", seed=seed)
    a = kernels.select(keys, queries, feats, m, seed=seed, view=view, validate=False)
    b = kernels.select(keys, queries, feats, m, seed=seed, view=view, validate=False,
                       factors="bf16")
    same = (a == b)
    first = int((~same).nonzero()[0]) if not bool(same.all()) else m
    return float(same.float().mean()), len(set(a.tolist()) & set(b.tolist())) / m, first


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=38400)
    p.add_argument("--m", type=int, default=128)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--view", choices=("head", "queries"), default="head")
    args = p.parse_args(argv)
    info = env_info("cpu")
    print(f"{info['device']}, torch {info['torch']}, {info['date']}, commit {info['commit']}")
    print("| seed | same position | same set | first differing step |")
    print("|---:|---:|---:|---:|")
    for seed in range(args.seeds):
        pos, st, first = agreement(args.n, args.m, 128, 512, args.view, seed)
        print(f"| {seed} | {pos:.3f} | {st:.3f} | {first} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
