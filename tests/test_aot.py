"""The interpreter cannot see GPU compile errors (a plain-int global inside a kernel is fine
there and a NameError in the compiler), nor what Triton's runtime specialisation makes of the
real launch arguments: record the selection path's launches at full pool size and compile each
for an H100 (sm_90) through Triton's own binder, with the ptxas bundled with triton, in a
subprocess without TRITON_INTERPRET — no GPU needed."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(__file__))


def _run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("settings", [
    "views=('head',), precisions=('ieee', 'tf32x3'), factors=('fp32', 'bf16')",
    "views=('queries',), precisions=('tf32',), factors=('fp32',)",
])
def test_every_selection_variant_compiles_for_h100_without_a_gpu(settings):
    pytest.importorskip("triton.backends.nvidia")
    out = _run("import kernels._aot as a; "
               f"rs = a.compile_selection(90, {settings}); "
               "assert all(r['shared'] <= a.SHARED_LIMIT[90] for r in rs), rs; "
               "print(sorted({r['name'].split()[0] for r in rs}))")
    # the embedding kernel, both k-means++ step kernels (first and later steps share a name),
    # the last pick, and the persistent single-launch variant
    assert "'grad_embed'" in out and "'kmeanspp_step'" in out and "'kmeanspp_pick'" in out
    assert "'kmeanspp_persistent'" in out


def test_compiled_launches_get_the_runtime_specialisation():
    """What the AOT compiles is what the runtime would: a unit stride becomes a constant, sizes
    and strides divisible by 16 carry the divisibility attribute, and the launch options
    (enable_fp_fusion=False, the cooperative grid of the persistent variant) reach the
    compiler."""
    pytest.importorskip("triton.backends.nvidia")
    out = _run(
        "import kernels._aot as a\n"
        "from triton.backends.compiler import GPUTarget\n"
        "calls = a.record_selection(38400, 128, 128, 512, 128, view='queries', variant='persistent')\n"
        "fn, args, kw = calls[0]\n"
        "ck, sig, consts = a._compile_call(fn, args, kw, GPUTarget('cuda', 90, 32))\n"
        "names = {fn.arg_names[p[0]]: v for p, v in consts.items()}\n"
        "print('kd', names.get('stride_kd'), 'fusion', ck.metadata.enable_fp_fusion)\n"
        "print('D', sig['D'], 'div16', '(9,)' in str(ck.src.attrs) or 'tt.divisibility' in str(ck.asm['ttir']))\n"
        "fn, args, kw = calls[-1]\n"
        "ck, sig, consts = a._compile_call(fn, args, kw, GPUTarget('cuda', 90, 32))\n"
        "print(fn.__name__, 'coop', ck.metadata.launch_cooperative_grid)\n")
    assert "kd 1 fusion False" in out, out
    assert "div16 True" in out, out
    assert "_kmeanspp_persistent_kernel coop True" in out, out
