"""Benchmark: the gradient embedding alone (DESIGN.md §1 steps 1-3), `head` view, uncompressed
(beta has d_h columns), M = 128, d = 128, d_h = 512.

Providers: triton (kernels.grad_embed.grad_embed_triton; GPU, or on CPU only under
TRITON_INTERPRET=1 at the smallest size, printed as "interpreter: not a performance figure" and
never written to the CSV), factored (kernels.reference.grad_embed), materialised (the
reference followed by reference.materialise: d*d_h floats per candidate; skipped above
--materialised-cap-gib).

Bytes it must move (fp32), the model behind the GB/s column:
    N*d*4 + M*(d+d_h)*4        read keys, queries, features
  + N*(d+d_h)*4                write alpha, beta
FLOPs: 2*N*M*(d+d_h) (the two matmuls). Time: median over --repeats, synchronised.

    python bench/bench_grad_embed.py --device cpu --sizes 4096 38400 --out bench/results
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_kmeanspp import GIB, interpreting, make_inputs  # noqa: E402
from bench.common import (base_parser, check_device, env_info, markdown_table, report,  # noqa: E402
                          time_fn)
from kernels import reference as ref  # noqa: E402

PROVIDERS = ("triton", "factored", "materialised")


def providers(device) -> dict:
    """name -> fn(keys, queries, feats) -> (alpha, beta) or g, for what can run on ``device``."""
    out = {}
    if device == "cuda" or interpreting():
        from kernels.grad_embed import grad_embed_triton

        out["triton"] = lambda k, q, f: grad_embed_triton(k, q, f)
    out["factored"] = lambda k, q, f: ref.grad_embed(k, q, f)
    out["materialised"] = lambda k, q, f: ref.materialise(*ref.grad_embed(k, q, f))
    return out


def bytes_model(n, m, d, dh):
    return n * d * 4 + m * (d + dh) * 4 + n * (d + dh) * 4


def run(sizes, device, m=128, d=128, dh=512, repeats=5, mat_cap_gib=2.5, only=None):
    info, rows = env_info(device), []
    for n in sizes:
        keys, queries, feats = make_inputs(n, m, d, dh, device)
        for name, fn in providers(device).items():
            if only and name not in only:
                continue
            if name == "materialised" and n * d * dh * 4 / GIB > mat_cap_gib:
                print(f"skip materialised at N={n}: {n * d * dh * 4 / GIB:.1f} GiB > "
                      f"--materialised-cap-gib {mat_cap_gib}", flush=True)
                continue
            note = ""
            if name == "triton" and device == "cpu":
                if n != min(sizes):
                    print(f"skip triton at N={n}: the interpreter only runs the smallest size")
                    continue
                note = "interpreter: not a performance figure"
            sec = time_fn(lambda: fn(keys, queries, feats), device,
                          repeats=1 if note else repeats, warmup=0 if note else 1)
            rows.append(dict(provider=name, N=n, M=m, d=d, d_h=dh, ms=sec * 1e3,
                             gbps=bytes_model(n, m, d, dh) / sec / 1e9,
                             tflops=2 * n * m * (d + dh) / sec / 1e12, note=note, **info))
            print(f"{name:>12} N={n:>7}: {sec * 1e3:9.3f} ms  {note}", flush=True)
    for n in sizes:  # ratio: factored (reference) / this
        at = {r["provider"]: r["ms"] for r in rows if r["N"] == n}
        for r in rows:
            if r["N"] == n:
                r["factored_over_this"] = at.get("factored", float("nan")) / r["ms"]
    return rows


def main(argv=None):
    p = base_parser(__doc__)
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, help="default: all that can run")
    p.add_argument("--materialised-cap-gib", type=float, default=2.5)
    args = p.parse_args(argv)
    check_device(p, args)
    rows = run(args.sizes, args.device, repeats=max(args.repeats, 3),
               mat_cap_gib=args.materialised_cap_gib, only=args.providers)
    cols = ["provider", "N", "ms", "gbps", "tflops", "factored_over_this", "note", "device",
            "torch", "triton", "date", "commit"]
    if any(r["note"] for r in rows):
        print(markdown_table([r for r in rows if r["note"]], cols))
    report([r for r in rows if not r["note"]], cols, args.out, "grad_embed",
           "grad_embed, head view, M=128, d=128, d_h=512")
    return rows


if __name__ == "__main__":
    main()
