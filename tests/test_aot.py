"""The interpreter cannot see GPU compile errors (a plain-int global inside a kernel is fine
there and a NameError in the compiler), nor what Triton's runtime specialisation makes of the
real launch arguments: record the selection path's launches at full pool size and compile each
for an H100 (sm_90) through Triton's own binder, with the ptxas bundled with triton, in a
subprocess without TRITON_INTERPRET — no GPU needed."""

import os
import re
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
    # M = 4,096's pool, N = 300 M: the per-block maxima reduced in two levels, the lazy race
    # (the k-means++ kernels do not depend on M: M = 256 adds the untiled embedding only)
    "n=1228800, ms=(256, 4096), precisions=('ieee',), factors=('fp32',), "
    "variants=('steps', 'lazy')",
])
def test_every_selection_variant_compiles_for_h100_without_a_gpu(settings):
    pytest.importorskip("triton.backends.nvidia")
    big = "n=" in settings
    out = _run("import kernels._aot as a; "
               f"rs = a.compile_selection(90, {settings}, ptxas_info={big}); "
               "assert all(r['shared'] <= a.SHARED_LIMIT[90] for r in rs), rs; "
               "print(sorted({r['name'].split()[0] for r in rs})); "
               "[print(r['name'], '|', r['info']) for r in rs]")
    # the embedding kernel, both k-means++ step kernels (first and later steps share a name),
    # the last pick, and the persistent single-launch variant where it is asked for
    assert "'grad_embed'" in out and "'kmeanspp_step'" in out and "'kmeanspp_pick'" in out
    assert ("'grad_embed_tiled'" in out) == ("4096" in settings)  # M > 256: in chunks
    assert ("'kmeanspp_persistent'" in out) == ("variants=" not in settings)
    assert ("'reduce_partials'" in out) == big  # 9,600 blocks: a second level
    assert ("'lazy_draw'" in out) == ("lazy" in settings or "variants=" not in settings)
    if big:  # one level held a [16384] tile of partials: 255 registers and spills
        eager = [ln for ln in out.splitlines() if ln.startswith(("kmeanspp", "reduce"))]
        assert len(eager) >= 4 and all("0 bytes spill stores" in ln for ln in eager), out
        lazy = [re.search(r"(\d+) bytes spill stores", ln) for ln in out.splitlines()
                if ln.startswith("lazy")]  # up to 20 B in the refresh loops (RESULTS.md)
        assert len(lazy) >= 3 and all(m and int(m.group(1)) <= 32 for m in lazy), out


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
        "fn, args, kw = next(c for c in calls if c[0].__name__ == '_kmeanspp_persistent_kernel')\n"
        "ck, sig, consts = a._compile_call(fn, args, kw, GPUTarget('cuda', 90, 32))\n"
        "print(fn.__name__, 'coop', ck.metadata.launch_cooperative_grid)\n")
    assert "kd 1 fusion False" in out, out
    assert "div16 True" in out, out
    assert "_kmeanspp_persistent_kernel coop True" in out, out


def test_the_default_selection_compiles_without_spills():
    """The default setting (M = 128, ieee, fp32 factors, per-step k-means++), both views, the
    grad_norms launch included: ptxas reports no spill store in any kernel."""
    pytest.importorskip("triton.backends.nvidia")
    out = _run("import kernels._aot as a\n"
               "rs = a.compile_selection(90, precisions=('ieee',), factors=('fp32',), "
               "variants=('steps',), ptxas_info=True)\n"
               "for r in rs: print(r['name'], '|', r['info'])\n")
    rows = out.strip().splitlines()
    assert len(rows) >= 6 and any(r.startswith("grad_embed HEAD=True GRAM=False") for r in rows)
    assert all("0 bytes spill stores" in r for r in rows), out


def test_every_embedding_launch_has_one_configuration_the_same_in_every_process():
    """Ranks must compute bit-identical factors: the embedding kernel is not autotuned (a timing
    on each rank could pick a different tile, and so a different summation order), its launch
    configuration is a function of the shape alone. Two processes (two ranks) record the
    launches of every M, view and precision the trainer can use and get the same list."""
    pytest.importorskip("triton.backends.nvidia")
    code = ("import kernels._aot as a\n"
            "from kernels import triton_grad_embed as ge\n"
            "assert not hasattr(ge._grad_embed_kernel, 'configs'), 'autotuned'\n"
            "for m in (16, 32, 64, 128, 256, 512, 4096):\n"
            "  for view in ('head', 'queries'):\n"
            "    for prec in ('ieee', 'tf32x3', 'tf32'):\n"
            "     for fac in ('fp32', 'bf16'):\n"
            "      calls = [c for c in a.record_selection(38400, m, 128, 512, m, view=view, "
            "precision=prec, factors=fac)\n"
            "               if c[0] in (ge._grad_embed_kernel, ge._grad_embed_tiled_kernel)]\n"
            "      assert len(calls) == 2, len(calls)  # the selection and grad_norms\n"
            "      for (fn, args, kw), f in zip(calls, (fac, 'fp32')):  # grad_norms: fp32\n"
            "        want = ge.embed_config(m, view, kw.get('GRAM', False), prec, f)\n"
            "        assert (kw['BLOCK_N'], kw['num_warps']) == want, (kw, want)\n"
            "        print(m, view, prec, f, kw.get('GRAM'), kw['BLOCK_N'], kw['num_warps'])\n")
    first, second = _run(code), _run(code)
    assert first == second and len(first.splitlines()) == 7 * 2 * 3 * 2 * 2


def test_the_resident_kernel_compiles_for_h100_without_spills():
    """The resident variant (issue 48) at the issue's pool, N = 38,400, M = d = 128, d_h = 512,
    bf16 factors, 132 SMs: 120 programs of 256 + 64 rows holding 128 words a row in registers,
    both views, and a pool of one tile a program (N = 33,792): ptxas reports no spill, the
    shared memory is the reductions' scratch only, and the launch is cooperative. Its per-round
    twin and last pick compile too; N = 153,600 does not fit and records the per-step kernel."""
    pytest.importorskip("triton.backends.nvidia")
    out = _run(
        "import kernels._aot as a\n"
        "from triton.backends.compiler import GPUTarget\n"
        "names = ('_kmeanspp_resident_kernel', '_kmeanspp_resident_round_kernel', "
        "'_resident_pick_kernel')\n"
        "for n, view, coop in ((38400, 'head', None), (38400, 'queries', None), "
        "(33792, 'head', None), (38400, 'head', False)):\n"
        "    calls = a.record_selection(n, 128, 128, 512, 128, view=view, factors='bf16', "
        "variant='resident', cooperative=coop)\n"
        "    done = set()\n"
        "    for fn, args, kw in calls:\n"
        "        if fn.__name__ not in names or (fn.__name__, kw.get('FIRST')) in done:\n"
        "            continue\n"
        "        done.add((fn.__name__, kw.get('FIRST')))\n"
        "        ck, _, _ = a._compile_call(fn, args, kw, GPUTarget('cuda', 90, 32))\n"
        "        print(n, view, fn.__name__, kw.get('ROWS_A'), kw.get('ROWS_B'), "
        "'coop', ck.metadata.launch_cooperative_grid, 'shared', ck.metadata.shared, '|', "
        "a._ptxas_info(ck.asm['ptx'], 90))\n"
        "calls = a.record_selection(153600, 128, 128, 512, 128, factors='bf16', "
        "variant='resident')\n"
        "print('153600', sorted({fn.__name__ for fn, _, _ in calls}))\n")
    rows = [ln for ln in out.splitlines() if "resident" in ln and "|" in ln]
    assert len(rows) == 6, out  # kernel x 3 settings, round kernel (first / later), last pick
    kernel = [r for r in rows if "_kmeanspp_resident_kernel" in r]
    assert len(kernel) == 3 and all("coop True" in r for r in kernel), out
    assert all(" 256 64 " in r for r in kernel if r.startswith("38400")), out
    assert all("0 bytes spill stores" in r for r in rows), out
    shared = [int(re.search(r"shared (\d+)", r).group(1)) for r in kernel]
    assert max(shared) <= 4096, out  # reduction scratch, no resident data in shared memory
    last = out.splitlines()[-1]
    assert "_kmeanspp_step_kernel" in last and "resident" not in last, out
    print(out)


def test_the_batch_norm_kernels_compile_for_h100_without_spills():
    """kernels/triton_batchnorm.py's six launches (forward statistics, their merge, the
    normalisation; the backward's sums, their merge, the input gradient), plain and with the
    residual add and ReLU fused, as the trainer makes them for r3d_18's channel counts (64,
    128, 256, 512) in bf16, and for fp32 and a channel count that is not a power of two: each
    compiles for sm_90 with no spill (the launches are recorded on CPU tensors of the same
    channel count)."""
    pytest.importorskip("triton.backends.nvidia")
    out = _run(
        "import torch\n"
        "import kernels._aot as a\n"
        "import kernels.triton_batchnorm as bn\n"
        "from triton.backends.compiler import GPUTarget\n"
        "ks = [bn._stats_partial_kernel, bn._stats_merge_kernel, bn._normalise_kernel, "
        "bn._grad_partial_kernel, bn._grad_merge_kernel, bn._grad_input_kernel]\n"
        "bn.INTERPRETED = True  # supports() takes the CPU tensors (nothing runs: recorded)\n"
        "for c, dt in ((64, torch.bfloat16), (128, torch.bfloat16), (256, torch.bfloat16), "
        "(512, torch.bfloat16), (64, torch.float32), (100, torch.float16)):\n"
        "    x = torch.zeros(4, c, 4, 8, 8, dtype=dt).contiguous(memory_format="
        "torch.channels_last_3d)\n"
        "    w = torch.ones(c)\n"
        "    with a._recording(ks) as calls:\n"
        "        bn._forward(x, w, w, torch.zeros(c), torch.ones(c), 0.1, 1e-5)\n"
        "        bn._backward(x, x, x, w, w, w)\n"
        "        bn._forward(x, w, w, None, None, 0.1, 1e-5, residual=x, relu=True)\n"
        "        bn._backward(x, x, x, w, w, w, has_residual=True, relu=True)\n"
        "    assert [f.__name__ for f, _, _ in calls] == [k.__name__ for k in ks] * 2, calls\n"
        "    for fn, args, kw in calls:\n"
        "        ck, _, _ = a._compile_call(fn, args, kw, GPUTarget('cuda', 90, 32))\n"
        "        print(c, dt, fn.__name__, '|', a._ptxas_info(ck.asm['ptx'], 90))\n")
    rows = [ln for ln in out.splitlines() if "|" in ln]
    assert len(rows) == 6 * 12, out
    assert all("0 bytes spill stores" in r for r in rows), out
