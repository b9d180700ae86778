"""Benchmark the gradient embedding alone (docs/DESIGN.md §1 steps 1-3) across providers.

`head` view, uncompressed (beta has d_h columns), M = 128, d = 128, d_h = 512.

Providers: triton (kernels.triton_grad_embed.grad_embed_triton; GPU, or on CPU only under
TRITON_INTERPRET=1 at the smallest size, printed as "interpreter: not a performance figure" and
never written to the CSV), factored (kernels.reference.grad_embed), materialised (the
reference followed by reference.materialise: d*d_h floats per candidate; skipped above
--materialised-cap-gib).

Bytes it must move (fp32), the model behind the GB/s column:
    N*d*4 + M*(d+d_h)*4        read keys, queries, features
  + N*(d+d_h)*4                write alpha, beta
FLOPs: 2*N*M*(d+d_h) (the two matmuls). Time: the median, from triton.testing.do_bench on
CUDA and torch.utils.benchmark.Timer.blocked_autorange on CPU; the sweep is a
triton.testing.perf_report Benchmark with a provider axis (bench/common.py).

    python bench/bench_grad_embed.py --device cpu --sizes 4096 38400 --out bench/results
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_kmeanspp import GIB, interpreting, make_inputs  # noqa: E402
from bench.common import (base_parser, benchmark, check_device, env_info, finish,  # noqa: E402
                          interpreter_skips, median_ms, report, sweep)
from kernels import reference as ref  # noqa: E402

PROVIDERS = ("triton", "factored", "materialised")


def providers(device) -> dict:
    """name -> fn(keys, queries, feats) -> (alpha, beta) or g, for what can run on ``device``."""
    out = {}
    if device == "cuda" or interpreting():
        from kernels.triton_grad_embed import grad_embed_triton

        out["triton"] = lambda k, q, f: grad_embed_triton(k, q, f)
    out["factored"] = lambda k, q, f: ref.grad_embed(k, q, f)
    out["materialised"] = lambda k, q, f: ref.materialise(*ref.grad_embed(k, q, f))
    return out


def bytes_model(n, m, d, dh):
    return n * d * 4 + m * (d + dh) * 4 + n * (d + dh) * 4


def run(sizes, device, m=128, d=128, dh=512, min_run_time=1.0, mat_cap_gib=2.5, only=None):
    names = [p for p in providers(device) if not only or p in only]

    @benchmark(sizes, names, "grad_embed", M=m, d=d, d_h=dh)
    def grad_embed_ms(N, provider, M, d, d_h):
        gib = N * d * d_h * 4 / GIB
        if provider == "materialised" and gib > mat_cap_gib:
            print(f"skip materialised at N={N}: {gib:.1f} GiB > --materialised-cap-gib "
                  f"{mat_cap_gib}", flush=True)
            return float("nan")
        if interpreter_skips(provider, N, sizes, device):
            return float("nan")
        keys, queries, feats = make_inputs(N, M, d, d_h, device)
        fn = providers(device)[provider]
        return median_ms(lambda: fn(keys, queries, feats), device, min_run_time=min_run_time)

    rows = finish(sweep(grad_embed_ms, env_info(device)), device)
    for r in rows:
        r["gbps"] = bytes_model(r["N"], m, d, dh) / r["ms"] / 1e6
        r["tflops"] = 2 * r["N"] * m * (d + dh) / r["ms"] / 1e9
    return rows


def main(argv=None):
    p = base_parser(__doc__)
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, help="default: all that can run")
    p.add_argument("--materialised-cap-gib", type=float, default=2.5)
    args = p.parse_args(argv)
    check_device(p, args)
    rows = run(args.sizes, args.device, min_run_time=args.min_run_time,
               mat_cap_gib=args.materialised_cap_gib, only=args.providers)
    cols = ["provider", "N", "ms", "gbps", "tflops", "factored_over_this", "note", "device",
            "torch", "triton", "date", "commit"]
    report(rows, cols, args.out, "grad_embed", "grad_embed, head view, M=128, d=128, d_h=512")
    return rows


if __name__ == "__main__":
    main()
