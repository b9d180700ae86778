"""Compile the Triton kernels for an NVIDIA GPU on a machine without one (ahead of time), exactly
as the selection path launches them.

The interpreter (TRITON_INTERPRET=1) checks what the kernels compute, but not that they compile
for a GPU (a plain Python int global is fine in the interpreter and a NameError in the
compiler), nor what the compiled code costs. This module runs the host code of the selection
path (kernels/triton_grad_embed.py ``embed_into`` and kernels/triton_kmeanspp.py
``launch_seeding``, the functions kernels/triton_select.py calls) on CPU tensors of the real
shapes with every launch *recorded* instead of run (and the ``grad_norms`` launch of every active
step: the uncompressed head-view or queries-view embedding of the M picks); each recorded launch then goes through
Triton's own argument binder -- the runtime specialisation: integers equal to 1 become
constants, integers and pointers divisible by 16 get the divisibility attribute, the launch
options (warps, stages, enable_fp_fusion, cooperative grid) apply -- and the real compiler
pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin, with the ptxas bundled in the triton wheel).
Nothing is autotuned: each launch has the one configuration the trainer uses
(kernels/triton_grad_embed.py ``embed_config``), so what compiles here is what every rank runs.
Identical kernels (same source, constants, specialisation and options) are compiled once.
Reported per variant: shared memory, registers and spills (ptxas -v):

    TRITON_INTERPRET=0 python -m kernels._aot [--arch 90] [--n 38400] [--m 16 ... 4096] [--markdown]

No CUDA driver or device is needed. TRITON_INTERPRET must be unset/0 *before* the Triton modules
are imported: Triton decides between interpreter and compiler when a kernel is defined.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile

# Shared memory per block (opt-in maximum, bytes) by compute capability: a launch limit.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
SMS = {80: 108, 86: 84, 89: 128, 90: 132}  # SMs of the reference part (A100, ..., H100 SXM)


def _modules():
    from . import triton_grad_embed as ge
    from . import triton_kmeanspp as km

    if ge.INTERPRETED or km.INTERPRETED:
        raise RuntimeError("kernels._aot: the Triton kernels are defined for the interpreter "
                           "(TRITON_INTERPRET=1 when kernels/triton_*.py were imported), which "
                           "cannot be compiled; run it in a fresh process with TRITON_INTERPRET "
                           "unset")
    return ge, km


@contextlib.contextmanager
def _recording(kernels):
    """Within the block, launching any of ``kernels`` (JITFunctions) appends (jit function, args,
    kwargs) to the yielded list instead of running."""
    calls = []

    def recorder(fn):
        def run(*args, grid, warmup, **kwargs):
            calls.append((fn, args, kwargs))
        return run

    for k in kernels:
        k.run = recorder(k)
    try:
        yield calls
    finally:
        for k in kernels:
            del k.run  # the class's run again


def record_selection(n=38400, m=128, d=128, dh=512, k=128, *, view="head", precision="ieee",
                     factors="fp32", variant="steps", sms=132, cooperative=None):
    """The launches of one selection (kernels/triton_select.py's sequence) at these shapes.
    ``cooperative=False``: the resident variant's per-round twin instead of its one launch."""
    import torch

    ge, km = _modules()
    from . import triton_lazy as lz
    from . import triton_race as race
    from . import triton_resident as rs

    fdt = {"fp32": torch.float32, "bf16": torch.bfloat16}[factors]
    head = view == "head"
    gram = head and dh > m and m <= ge.GRAM_MAX_M
    a = d if head else m
    b = (m if gram else dh) if head else d
    # the [N, .] buffers are never written (launches are recorded, not run): torch.empty's
    # untouched pages cost no memory, so N = 1.2 M compiles on a small machine too
    keys = torch.empty(n, d)
    queries = torch.zeros(m, d)
    f = torch.zeros(m, m) if gram else torch.zeros(m, dh)
    alpha, beta = torch.empty(n, a, dtype=fdt), torch.empty(n, b, dtype=fdt)
    beta_c = torch.empty(n, b, dtype=fdt) if gram else None
    sqn, dmin = torch.zeros(n), torch.zeros(n)
    excl = torch.zeros(n, dtype=torch.uint8)
    n_t, seed_t = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
    picks = torch.zeros(k, dtype=torch.int64)
    if variant == "resident" and rs.resident_config(n, a, b, fdt, sms) is None:
        variant = "steps"  # as the plan: a pool that does not fit on chip runs the per-step one
    cfg = km.seeding_config(n, a, b, variant, sms=sms, factors=fdt,
                            cooperative=cooperative if variant == "resident" else None)
    ps = torch.zeros(cfg["partials"])
    pi = torch.zeros(cfg["partials"], dtype=torch.int32)
    bar = torch.zeros(1, dtype=torch.int32)
    seen, thr = torch.zeros(n + 1, dtype=torch.int32), torch.zeros(1)
    best = torch.zeros(k, dtype=torch.int64)
    kernels = [ge._grad_embed_kernel, ge._grad_embed_tiled_kernel, km._kmeanspp_step_kernel,
               km._kmeanspp_pick_kernel, km._kmeanspp_persistent_kernel,
               race._reduce_partials_kernel, lz._lazy_bound_kernel, lz._lazy_top_kernel,
               lz._lazy_draw_kernel, rs._kmeanspp_resident_kernel,
               rs._kmeanspp_resident_round_kernel, rs._resident_pick_kernel]
    with _recording(kernels) as calls:
        ge.embed_into(keys, queries, f, alpha, beta, beta_c, sqn, n_t, tau=1.0, view=view,
                      gram=gram, precision=precision)
        km.launch_seeding(alpha, beta, beta if beta_c is None else beta_c, sqn, dmin, excl, n_t,
                          picks, seed_t, ps, pi, bar, k, cfg, variant, seen, thr, best)
        # cmacc.samplers.grad_norms on the k picks: the per-call, uncompressed embedding
        ge.grad_embed_triton_with_norms(keys[:k], queries, torch.zeros(m, dh), view=view,
                                        precision=precision)
    return calls


_BINDERS = {}  # (jit function, target): (backend, binder), built once as the runtime does


def _binder(fn, target):
    if (fn, target) not in _BINDERS:
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        backend = make_backend(target)
        _BINDERS[fn, target] = backend, create_function_from_signature(fn.signature, fn.params,
                                                                       backend)
    return _BINDERS[fn, target]


def _bind(fn, args, kwargs, target, seen=None):
    """One recorded launch through Triton's runtime binder (its specialisation rules): the
    source to compile and its options. ``seen`` (a set): the runtime's kernel-cache keys
    (function, specialisation, options) bound so far; a launch whose key is in it is one the
    runtime would not compile again (the per-step k-means++ launches: thousands a selection at
    M = 4,096) and returns None."""
    from triton.compiler import ASTSource

    backend, binder = _binder(fn, target)
    bound, specialization, options = binder(*args, **kwargs)
    if seen is not None:
        key = (fn, tuple(specialization), str(options))  # jit.py compute_cache_key's input
        if key in seen:
            return None
        seen.add(key)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                          specialization, options)
    return ASTSource(fn, signature, constexprs, attrs), options, signature, constexprs


def _compile_call(fn, args, kwargs, target):
    """Compile one recorded launch as the runtime would."""
    import triton

    src, options, signature, constexprs = _bind(fn, args, kwargs, target)
    return triton.compile(src, target=target, options=options.__dict__), signature, constexprs


def _ptxas_info(ptx: str, arch: int) -> str:
    """'Used R registers, S bytes spill stores, ...' from the bundled ptxas -v."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, f"-arch=sm_{arch}a" if arch >= 90 else f"-arch=sm_{arch}",
                              "-v", path, "-o", os.devnull], capture_output=True, text=True,
                             timeout=300)
    lines = [ln.split(":", 1)[-1].strip() for ln in out.stderr.splitlines()
             if "Used" in ln or "spill" in ln]
    return "; ".join(lines)


def _describe(fn, kwargs, constexprs, args) -> str:
    name = fn.__name__.lstrip("_").replace("_kernel", "")
    keep = ("HEAD", "GRAM", "FIRST", "PRECISION", "BLOCK_N", "BLOCK_M", "BLOCK_A", "BLOCK_B",
            "ROWS_A", "ROWS_B", "PACK")
    cs = {fn.arg_names[p[0]]: v for p, v in constexprs.items()}
    parts = [f"{k}={cs[k]}" for k in keep if k in cs]
    dts = sorted({str(a.dtype).replace("torch.", "") for a in args if hasattr(a, "dtype")
                  and a.is_floating_point() and a.dtype != __import__("torch").float32})
    if dts:
        parts.append("factors=" + "/".join(dts))
    parts.append(f"warps={kwargs.get('num_warps', 4)}")
    return f"{name} " + " ".join(parts)


def compile_selection(arch=90, *, n=38400, ms=(128,), d=128, dh=512,
                      views=("head", "queries"), precisions=("ieee", "tf32x3", "tf32"),
                      factors=("fp32", "bf16"), variants=("steps", "persistent", "lazy"),
                      ptxas_info=False) -> list[dict]:
    """Compile every distinct kernel variant the trainer launches for these settings (k = M:
    the selection, its k-means++ variant and the grad_norms embedding); returns [{name, shared,
    info, settings}]. Raises on the first variant that does not compile (the error names it)."""
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", arch, 32)
    seen, bound, out = set(), set(), []
    for m in ms:
        for view in views:
            for prec in precisions:
                for fac in factors:
                    for var in variants:
                        settings = f"M={m} {view}/{prec}/{fac}/{var}"
                        calls = record_selection(n, m, d, dh, m, view=view, precision=prec,
                                                 factors=fac, variant=var,
                                                 sms=SMS.get(arch, 132))
                        for fn, args, kwargs in calls:
                            got = _bind(fn, args, kwargs, target, bound)
                            if got is None:  # a launch the runtime's cache already holds
                                continue
                            src, options, _, consts = got
                            key = (src.hash(), repr(sorted(options.__dict__.items())))
                            if key in seen:
                                continue
                            seen.add(key)
                            try:
                                ck = triton.compile(src, target=target, options=options.__dict__)
                            except Exception as e:  # name the variant; the compiler's message
                                raise RuntimeError(f"{fn.__name__} ({settings}): does not "
                                                   f"compile for sm_{arch}: {e}") from e
                            info = _ptxas_info(ck.asm["ptx"], arch) if ptxas_info else ""
                            out.append(dict(name=_describe(fn, kwargs, consts, args),
                                            shared=ck.metadata.shared, info=info,
                                            settings=settings))
    return out


def scan_embed_configs(arch=90, *, n=38400, ms=(16, 32, 64, 128, 256), d=128, dh=512):
    """Spill stores (bytes, from ptxas) of every candidate launch configuration of the embedding
    kernel (triton_grad_embed.EMBED_CANDIDATES), for both of its launches (the selection's and
    grad_norms'), every M, view, precision and factor dtype: the evidence behind
    ``embed_config``. Yields (M, view, gram, precision, factors, {(BLOCK_N, warps): spill},
    the pinned config)."""
    import re

    from triton.backends.compiler import GPUTarget

    ge, _ = _modules()
    target = GPUTarget("cuda", arch, 32)
    seen = set()
    for m in ms:
        block_m = max(16, 1 << (m - 1).bit_length())
        for view in ("head", "queries"):
            for prec in ("ieee", "tf32x3", "tf32"):
                for fac in ("fp32", "bf16"):
                    calls = [c for c in record_selection(n, m, d, dh, m, view=view,
                                                         precision=prec, factors=fac)
                             if c[0] in (ge._grad_embed_kernel, ge._grad_embed_tiled_kernel)]
                    for (fn, args, kw), f in zip(calls, (fac, "fp32")):  # grad_norms: fp32
                        key = (m, view, kw.get("GRAM", False), prec, f)
                        if key in seen:
                            continue
                        seen.add(key)
                        spills = {}
                        for bn, nw in ge.EMBED_CANDIDATES:
                            if bn * block_m > 8192 and bn > 16:
                                continue  # the fp32 logit tile's register budget
                            ck, _, _ = _compile_call(fn, args, {**kw, "BLOCK_N": bn,
                                                                "num_warps": nw}, target)
                            info = _ptxas_info(ck.asm["ptx"], arch)
                            hit = re.search(r"(\d+) bytes spill stores", info)
                            spills[(bn, nw)] = int(hit.group(1)) if hit else -1
                        yield (*key, spills, ge.embed_config(m, view, key[2], prec, f))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100)")
    p.add_argument("--n", type=int, default=38400, help="pool capacity")
    p.add_argument("--m", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 4096],
                   help="batch sizes M (pseudo-labels, k = M)")
    p.add_argument("--markdown", action="store_true", help="a Markdown table (bench/RESULTS.md)")
    p.add_argument("--scan-configs", action="store_true",
                   help="spill stores of every candidate embedding config (embed_config's evidence)")
    args = p.parse_args(argv)
    if args.scan_configs:
        for m, view, gram, prec, fac, spills, pinned in scan_embed_configs(args.arch, n=args.n,
                                                                            ms=tuple(args.m)):
            cands = "  ".join(f"{bn}x{nw}:{sp}B" for (bn, nw), sp in spills.items())
            print(f"M={m:<3} {view:<7} {'gram' if gram else '    '} {prec:<6} {fac}  pinned "
                  f"{pinned[0]}x{pinned[1]} ({spills.get(pinned, '?')}B)   {cands}", flush=True)
        return 0
    limit = SHARED_LIMIT.get(args.arch, 101376)
    rows = compile_selection(args.arch, n=args.n, ms=tuple(args.m), ptxas_info=True)
    bad = 0
    if args.markdown:
        print("| kernel variant | first seen in (M view/precision/factors/k-means++) | shared B | "
              "ptxas -v |")
        print("|---|---|---:|---|")
    for r in rows:
        over = r["shared"] > limit
        bad += over
        if args.markdown:
            print(f"| {r['name']} | {r['settings']} | {r['shared']}{' > LIMIT' if over else ''} "
                  f"| {r['info']} |")
        else:
            print(f"{r['name']:<70} shared {r['shared']:>7} B{' > LIMIT' if over else ''}  "
                  f"{r['info']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
