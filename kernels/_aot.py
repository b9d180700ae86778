"""Compile the Triton kernels for an NVIDIA GPU on a machine without one (ahead of time).

The interpreter (TRITON_INTERPRET=1) checks what the kernels compute, but not that they compile
for a GPU: e.g. a plain Python int global is fine in the interpreter and a NameError in the
compiler. This module runs the real compiler pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin,
with the ptxas bundled in the triton wheel) for the shapes of the selection path, and reports
shared memory, registers and spills per kernel variant:

    TRITON_INTERPRET=0 python -m kernels._aot [--arch 90] [--all]

No CUDA driver or device is needed. Needs TRITON_INTERPRET unset/0 *before* the Triton modules
(kernels/triton_*.py) are imported: Triton decides between interpreter and compiler when a kernel
is defined, and the interpreter's kernels cannot be compiled.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

# Shared memory per block (opt-in maximum, bytes) by compute capability: a launch limit.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


def _variants(full: bool, ops):
    """(name, jit function, signature, constexprs, options, divisible-by-16 args): the tile
    configurations the host wrappers launch on a GPU."""
    from . import triton_grad_embed as ge
    from . import triton_kmeanspp as km

    if ge.INTERPRETED or km.INTERPRETED:
        raise RuntimeError("kernels._aot: the Triton kernels are defined for the interpreter "
                           "(TRITON_INTERPRET=1 when kernels/triton_*.py were imported), which "
                           "cannot be compiled; run it in a fresh process with TRITON_INTERPRET "
                           "unset")

    f32p = "*fp32"
    ge_sig = dict(k_ptr=f32p, q_ptr=f32p, f_ptr=f32p, alpha_ptr=f32p, beta_ptr=f32p,
                  sqn_ptr=f32p, N="i32", M="i32", D="i32", DH="i32", tau="fp32",
                  stride_kn="i32", stride_kd="i32", stride_qm="i32", stride_qd="i32",
                  stride_fm="i32", stride_fh="i32", stride_an="i32", stride_bn="i32")
    ge_div = [k for k in ge_sig if k.endswith("_ptr")] + [
        "stride_kn", "stride_qm", "stride_fm", "stride_an", "stride_bn"]
    km_sig = dict(a_ptr=f32p, b_ptr=f32p, sqn_ptr=f32p, dmin_ptr=f32p, picks_ptr="*i64",
                  seed_ptr="*i64", part_score_ptr=f32p, part_idx_ptr="*i32", N="i32", A="i32",
                  B="i32", P="i32", t="i32", stride_an="i32", stride_bn="i32")
    km_div = [k for k in km_sig if k.endswith("_ptr")] + ["stride_an", "stride_bn"]
    gfn = ge._grad_embed_kernel.fn  # the JITFunction under the autotuner
    configs = [c for c in ge._grad_embed_configs()]
    cases = [(128, True), (128, False)] + ([(256, True), (256, False), (64, True)] if full else [])
    for bm, head in cases if "grad_embed" in ops else ():
        kept = ge._prune_configs(configs, {}, BLOCK_M=bm)
        for c in kept if full else kept[1:2]:
            bn = c.kwargs["BLOCK_N"]
            yield (f"grad_embed M<={bm} {'head' if head else 'queries'} BLOCK_N={bn} "
                   f"warps={c.num_warps}", gfn, ge_sig,
                   dict(HEAD=head, BLOCK_N=bn, BLOCK_M=bm, BLOCK_D=64, BLOCK_H=64,
                        PRECISION="ieee"),
                   dict(num_warps=c.num_warps, num_stages=c.num_stages), ge_div)
    if "kmeanspp" not in ops:
        return
    for n in ((38400, 150000) if full else (38400,)):
        cfg = dict(km._step_config(n))
        p = -(-n // cfg["BLOCK_N"])
        bp = 1 << (p - 1).bit_length()
        for first in ((True, False) if full else (False,)):
            yield (f"kmeanspp step N={n} FIRST={first} BLOCK_N={cfg['BLOCK_N']}",
                   km._kmeanspp_step_kernel, km_sig,
                   dict(FIRST=first, BLOCK_N=cfg["BLOCK_N"], BLOCK_A=cfg["BLOCK_K"],
                        BLOCK_B=cfg["BLOCK_K"], BLOCK_P=bp), dict(num_warps=cfg["num_warps"]),
                   km_div)
    yield ("kmeanspp pick", km._kmeanspp_pick_kernel,
           dict(part_score_ptr=f32p, part_idx_ptr="*i32", picks_ptr="*i64", P="i32", t="i32"),
           dict(BLOCK_P=512), dict(num_warps=4), ["part_score_ptr", "part_idx_ptr", "picks_ptr"])
    yield ("uniform_hash (test helper)", km._uniform_hash_kernel,
           dict(u_ptr=f32p, seed_ptr="*i64", N="i32", t="i32"), dict(BLOCK_N=1024),
           dict(num_warps=4), ["u_ptr", "seed_ptr"])


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


def compile_all(arch: int = 90, full: bool = False, ptxas_info: bool = False,
                ops=("grad_embed", "kmeanspp")) -> list[dict]:
    """Compile the variants of ``ops`` for sm_<arch>; returns [{name, shared, info}]. Raises on
    the first variant that does not compile (the error names it), or if the kernels were
    defined for the interpreter."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    out = []
    for name, fn, sig, consts, options, div16 in _variants(full, ops):
        attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in div16}
        src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}},
                        constexprs=consts, attrs=attrs)
        try:
            ck = triton.compile(src, target=target, options=options)
        except Exception as e:  # name the variant; the compiler's message follows
            raise RuntimeError(f"{name}: does not compile for sm_{arch}: {e}") from e
        info = _ptxas_info(ck.asm["ptx"], arch) if ptxas_info else ""
        out.append(dict(name=name, shared=ck.metadata.shared, info=info))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100)")
    p.add_argument("--all", action="store_true", help="every tile variant, not only the defaults")
    args = p.parse_args(argv)
    limit = SHARED_LIMIT.get(args.arch, 101376)
    bad = 0
    for r in compile_all(args.arch, full=args.all, ptxas_info=True):
        over = r["shared"] > limit
        bad += over
        print(f"{r['name']:<52} shared {r['shared']:>7} B{' > LIMIT' if over else ''}  {r['info']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
