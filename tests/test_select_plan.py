"""The capacity-shaped selection path (kernels/triton_select.py) against the PyTorch reference:
a growing pool runs in one plan (one CUDA graph on a GPU), a capacity-padded selection equals
the unpadded reference, the Gram route (no QR) equals the materialised head-view embeddings,
non-finite candidates are treated as the reference treats them, and the dot precision, factor
dtype and k-means++ variant are part of the plan key. Runs under the Triton interpreter on CPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # before any Triton kernel is defined (at kernels import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import kernels  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels import triton_select as ts  # noqa: E402
from kernels.triton_kmeanspp import kmeanspp_triton  # noqa: E402

from devices import DEV, selection_inputs  # noqa: E402


_pool = selection_inputs


def _reference_picks(keys, queries, feats, k, seed, view, exclude):
    """Independent of the plan: the uncompressed factors (materialisable, no Gram route) and
    the reference seeding over exactly the valid rows."""
    a, b = ref.grad_embed(keys, queries, feats, view=view)
    return ref.kmeanspp(a, b, k, seed=seed, exclude=exclude)


@pytest.fixture(autouse=True)
def _fresh_plans(monkeypatch):
    monkeypatch.setenv("CMACC_KERNELS", "triton")  # the plan path, also on CPU tensors
    real = kernels.backend_for

    def on_declared_device(t):  # a tensor built off DEV would fail far from its cause
        assert t.device.type == DEV, (f"this test declares device {DEV!r} but handed the kernels "
                                      f"a {t.device} tensor: build its model and inputs on DEV")
        return real(t)

    monkeypatch.setattr(kernels, "backend_for", on_declared_device)
    ts.clear_plans()
    yield
    ts.clear_plans()


@pytest.mark.parametrize("view", ["head", "queries"])
def test_a_growing_pool_runs_in_one_plan_and_equals_the_unpadded_reference(view):
    """The rolling-pool warm-up: n grows from 2k to the capacity; every selection reads the
    capacity buffer in place (no copy), all of them come from ONE plan (one graph capture on a
    GPU), and each equals the reference on the unpadded first n rows."""
    cap, m, d, dh, k = 640, 16, 24, 40, 12  # d_h > M: the head view takes the Gram route
    keys, queries, feats, exclude = _pool(cap, m, d, dh)
    for i, n in enumerate((2 * k, 100, 333, cap)):
        got = kernels.select(keys, queries, feats, k, seed=i, view=view, exclude=exclude[:n],
                             n=n, validate=False)
        want = _reference_picks(keys[:n], queries, feats, k, i, view, exclude[:n])
        assert torch.equal(got.cpu(), want.cpu()), (n, got, want)
        assert int(got.max()) < n
    (plan,) = ts._PLANS.values()
    assert plan.bound and plan.copies == 0 and plan.capacity == cap
    assert plan.gram == (view == "head")
    assert plan.captures == (1 if DEV == "cuda" else 0)
    assert plan.replays == (4 if DEV == "cuda" else 0)


def _tiny_active_model(device):
    """A tiny CM-ACC model with the active sampler and 8 steps of inputs, all on ``device``."""
    from cmacc.config import method_configs
    from cmacc.model import CMACC

    model_cfg, sel = method_configs(batch_size=4, dict_size=8, pool_size=40, video_width=4,
                                    video_layers=(1, 1, 1, 1), audio_width=4,
                                    audio_layers=(1, 1, 1, 1), fcl_dim=16, dim=8, sampler="active")
    torch.manual_seed(0)
    model = CMACC(model_cfg, sel).to(device)
    g = torch.Generator().manual_seed(1)
    steps = [(torch.randn(4, 3, 4, 16, 16, generator=g).to(device),
              torch.randn(4, 80, 20, generator=g).to(device),
              (torch.arange(4) + 4 * step).to(device)) for step in range(8)]
    return model, steps


def test_the_plan_tests_build_on_their_declared_device():
    """On a GPU machine the plan tests run the compiled kernels, which take CUDA tensors only: a
    model or input left on the CPU there fails in the dispatch. Checked here with a device that
    is not the CPU."""
    model, steps = _tiny_active_model("meta")
    assert {t.device.type for t in (*model.parameters(), *model.buffers())} == {"meta"}
    assert {t.device.type for batch in steps for t in batch} == {"meta"}


def test_the_model_selects_from_one_plan_while_its_pool_fills():
    """Through the method, on the Triton path: the rolling pool fills over the steps and the
    active sampler runs at several fill levels, all from one plan per pool buffer (U_v, U_a)."""
    model, steps = _tiny_active_model(DEV)
    fills = []
    for step, (video, audio, index) in enumerate(steps):
        with torch.no_grad():
            _, stats = model(video, audio, index, step=step)
        if float(stats["active"]):
            fills.append(model.pool_v.count)
    assert len(set(fills)) > 1, fills  # selections at several fill levels
    assert len(ts._PLANS) == 2
    assert all(p.bound and p.copies == 0 and p.capacity == 40 for p in ts._PLANS.values())


@pytest.mark.parametrize("view", ["head", "queries"])
def test_a_global_batch_above_one_softmax_tile_selects_as_the_reference(view):
    """M = 300 > MAX_M pseudo-labels (the embedding over chunks of the softmax row) from a bound
    capacity buffer: the reference's picks, with fp32 and with bf16 factors (k = 40 here: the seeding does not depend on M in the
    head view, and only through the factors' width in the queries view; the trainer asks k =
    M, which the interpreter would take minutes over)."""
    from kernels import triton_grad_embed as ge

    cap, m, d, dh, k = 200, 300, 16, 40, 40
    assert m > ge.MAX_M
    keys, queries, feats, exclude = _pool(cap, m, d, dh, seed=7)
    got = kernels.select(keys, queries, feats, k, seed=5, view=view, exclude=exclude, n=cap,
                         validate=False)
    want = _reference_picks(keys, queries, feats, k, 5, view, exclude)
    assert torch.equal(got.cpu(), want.cpu())
    (plan,) = ts._PLANS.values()
    assert not plan.gram and plan.alpha.shape[1] == (d if view == "head" else m)
    got = kernels.select(keys, queries, feats, k, seed=5, view=view, exclude=exclude, n=cap,
                         validate=False, factors="bf16")  # stored rounded, as the reference
    a, b, bc, _ = ref.select_factors(keys, queries, feats, tau=1.0, view=view)
    bf = torch.bfloat16
    want = ref.kmeanspp(a.to(bf), b.to(bf), k, seed=5, exclude=exclude,
                        beta_c=None if bc is None else bc.to(bf))
    assert torch.equal(got.cpu(), want.cpu())


def test_unbound_calls_round_the_capacity_up_and_copy():
    keys, queries, feats, _ = _pool(300, 8, 16, 8)
    for n in (200, 300, 250):
        got = kernels.select(keys[:n], queries, feats, 6, seed=1, view="head", validate=False,
                             precision="ieee")
        assert torch.equal(got.cpu(), _reference_picks(keys[:n], queries, feats, 6, 1, "head",
                                                       None).cpu())
    (plan,) = ts._PLANS.values()
    assert plan.capacity == ts.MIN_CAPACITY and not plan.bound and plan.copies == 3
    assert not plan.gram  # d_h <= M: beta = r H / tau, no Gram factor


def test_precision_factors_and_variant_are_part_of_the_plan_key(monkeypatch):
    keys, queries, feats, _ = _pool(256, 8, 16, 24)
    kernels.select(keys, queries, feats, 4, seed=0, n=256, validate=False)
    kernels.select(keys, queries, feats, 4, seed=0, n=256, validate=False, precision="tf32x3")
    kernels.select(keys, queries, feats, 4, seed=0, n=256, validate=False, factors="bf16")
    monkeypatch.setenv("CMACC_DOT_PRECISION", "tf32")  # the environment default counts too
    kernels.select(keys, queries, feats, 4, seed=0, n=256, validate=False)
    kinds = {(key[7], key[8], key[9]) for key in ts._PLANS}
    interp = ts.INTERPRETED  # the interpreter computes ieee whatever is asked
    want = {("ieee", "fp32", "steps"), ("ieee" if interp else "tf32x3", "fp32", "steps"),
            ("ieee", "bf16", "steps"), ("ieee" if interp else "tf32", "fp32", "steps")}
    assert kinds == want
    with pytest.raises(ValueError, match="CMACC_DOT_PRECISION='fp8'"):
        monkeypatch.setenv("CMACC_DOT_PRECISION", "fp8")
        kernels.select(keys, queries, feats, 4, seed=0, n=256, validate=False)


def test_bf16_factors_equal_the_reference_on_the_same_rounded_factors():
    """factors='bf16': the kernel stores alpha, beta, beta_c in bf16 and computes |g|^2 and the
    distances from the rounded values in fp32; the reference given the same rounded factors
    picks the same indices."""
    keys, queries, feats, exclude = _pool(500, 16, 24, 40, seed=3)
    for view in ("head", "queries"):
        got = kernels.select(keys, queries, feats, 20, seed=4, view=view, exclude=exclude,
                             factors="bf16")
        a, b, bc, _ = ref.select_factors(keys, queries, feats, tau=1.0, view=view)
        bf = torch.bfloat16
        want = ref.kmeanspp(a.to(bf), b.to(bf), 20, seed=4, exclude=exclude,
                            beta_c=None if bc is None else bc.to(bf))
        assert torch.equal(got.cpu(), want.cpu()), view


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_candidates_are_never_drawn_as_in_the_reference(bad):
    """A candidate whose |g|^2 is NaN or Inf is excluded by both backends, and the picks equal
    those of the same problem with those rows masked out."""
    keys, queries, feats, _ = _pool(400, 12, 16, 30, seed=5)
    a, b = ref.grad_embed(keys, queries, feats, view="queries")
    poisoned = [3, 77, 201]
    a[poisoned[0], 0] = bad
    b[poisoned[1], 2] = bad
    a[poisoned[2]] = bad
    mask = torch.zeros(400, dtype=torch.bool, device=DEV)
    mask[poisoned] = True
    a_clean = a.masked_fill(mask[:, None], 0.0)
    b_clean = b.masked_fill(mask[:, None], 0.0)
    want = ref.kmeanspp(a_clean, b_clean, 30, seed=2, exclude=mask)
    got_ref = ref.kmeanspp(a, b, 30, seed=2)
    got = kmeanspp_triton(a, b, 30, seed=2, block_n=128)
    assert torch.equal(got_ref.cpu(), want.cpu())
    assert torch.equal(got.cpu(), want.cpu())
    assert not set(got.tolist()) & set(poisoned)
    with pytest.raises(ValueError, match="non-finite"):
        kmeanspp_triton(a, b, 398, seed=0)


def test_select_errors_name_the_problem():
    keys, queries, feats, _ = _pool(64, 8, 16, 8)
    with pytest.raises(ValueError, match=r"n=70 valid candidates must be in \[k=4, capacity=64\]"):
        kernels.select(keys, queries, feats, 4, seed=0, n=70, validate=False)
    plan = ts.plan_for(keys, queries, feats, 4, n=64)
    with pytest.raises(ValueError, match="reads the pool buffer it was built with"):
        plan.run(keys.clone(), 64, queries, feats, None, 0)
    with pytest.raises(ValueError, match="factors='fp16'"):
        kernels.select(keys, queries, feats, 4, seed=0, n=64, factors="fp16")


def _run_method(overlap: bool, steps=7):
    from cmacc.config import method_configs
    from cmacc.model import CMACC

    model_cfg, sel = method_configs(batch_size=4, dict_size=8, pool_size=24, video_width=4,
                                    video_layers=(1, 1, 1, 1), audio_width=4,
                                    audio_layers=(1, 1, 1, 1), fcl_dim=16, dim=8,
                                    sampler="active", overlap=overlap)
    torch.manual_seed(0)
    model = CMACC(model_cfg, sel).to(DEV)
    opt = torch.optim.SGD(model.query_parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    active = []
    for step in range(steps):
        video = torch.randn(4, 3, 4, 16, 16, generator=g).to(DEV)  # [B, C, T, H, W]
        audio = torch.randn(4, 80, 20, generator=g).to(DEV)  # [B, mel, frames]
        index = (torch.arange(4) + 4 * (step % 5)).to(DEV)  # [B]
        loss, stats = model(video, audio, index, step=step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        active.append(float(stats["active"]))
    return model, active


def test_overlapped_schedule_gives_the_serial_results(monkeypatch):
    """overlap=True issues the selection before the key encoders (on CUDA on a side stream);
    overlap=False runs the keys first, then the selection. On CPU both run serially: the
    weights, dictionaries and pools after several active steps must be bit-identical. On CUDA
    (make gpu-check) too, with deterministic cuDNN: a missing stream wait would read a pool or
    dictionary before its write, or a selection before it ends."""
    monkeypatch.setenv("CMACC_KERNELS", "reference")
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    a, act = _run_method(True)
    b, _ = _run_method(False)
    assert sum(act) >= 3  # several active steps
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:  # tensors, and the pools' extra state (their fill counts)
        same = torch.equal(sa[name], sb[name]) if torch.is_tensor(sa[name]) else sa[name] == sb[name]
        assert same, name


def test_select_settings_added_later_keep_old_checkpoints_resumable():
    """config_hash decides whether a checkpoint resumes: the selection-engine fields added after
    checkpoints existed do not change the hash at their defaults (the value below is the hash
    of the default configs before they existed); overlap and the k-means++ variant never change
    results so never count; precision and factors do when set."""
    from cmacc.config import ModelConfig, SelectionConfig, config_hash

    base = config_hash(ModelConfig(), SelectionConfig())
    assert base == "dc4b78a87b67474a"
    assert config_hash(ModelConfig(), SelectionConfig(overlap=False, kmeans="persistent")) == base
    assert config_hash(ModelConfig(), SelectionConfig(precision="tf32x3")) != base
    assert config_hash(ModelConfig(), SelectionConfig(factors="bf16")) != base


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the persistent variant needs a GPU "
                    "(its grid barrier would hang the interpreter); make gpu-check runs this")
@pytest.mark.parametrize("view", ["head", "queries"])
def test_persistent_kmeanspp_equals_the_per_step_variant_and_the_reference(view):
    keys, queries, feats, exclude = _pool(5000, 32, 64, 96, seed=6)
    for n in (1000, 5000):
        want = _reference_picks(keys[:n], queries, feats, 32, 3, view, exclude[:n])
        for variant in ("steps", "persistent"):
            got = kernels.select(keys, queries, feats, 32, seed=3, view=view,
                                 exclude=exclude[:n], n=n, variant=variant)
            assert torch.equal(got.cpu(), want.cpu()), (variant, n)
    assert all(p.captures == 1 for p in ts._PLANS.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's refusal")
def test_the_persistent_variant_is_refused_under_the_interpreter_with_the_fix():
    keys, queries, feats, _ = _pool(64, 8, 16, 8)
    with pytest.raises(ValueError, match="needs a GPU.*variant='steps'"):
        kernels.select(keys, queries, feats, 4, seed=0, n=64, variant="persistent")


def test_the_auto_variant_is_the_one_measured_faster_on_the_device(monkeypatch):
    """variant="auto" (the trainer's default): the lazy race where it was measured ahead (an
    H200 from N = 38,400: bench/RESULTS.md), with bf16 factors the resident variant where it
    was measured ahead and the pool fits on chip, the per-step variant elsewhere (smaller pools,
    devices not measured, the CPU); a plan asked for "auto" on the CPU runs steps and draws the
    reference's picks."""
    names = {"cuda": "NVIDIA H200"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: names["cuda"])
    assert ts.auto_variant(38_400, "cuda") == "lazy" == ts.auto_variant(1 << 20, "cuda:0")
    assert ts.auto_variant(38_399, "cuda") == "steps" == ts.auto_variant(9_600, "cuda")
    # bf16 factors: the resident variant where the pool fits on chip, else the fp32 rule
    assert ts.auto_variant(38_400, "cuda", factors="bf16", resident_fit=True) == "resident"
    assert ts.auto_variant(38_400, "cuda", factors="bf16", resident_fit=False) == "lazy"
    assert ts.auto_variant(38_400, "cuda", factors="fp32", resident_fit=True) == "lazy"
    assert ts.auto_variant(9_600, "cuda", factors="bf16", resident_fit=True) == "steps"
    # what a plan of the paper preset's sizes asks (132 SMs: an H200's); and a pool too large
    monkeypatch.setattr(ts, "_sms", lambda device: 132)
    assert ts._auto(38_400, 128, 128, 512, "head", "bf16", "cuda") == "resident"
    assert ts._auto(38_400, 128, 128, 512, "head", "fp32", "cuda") == "lazy"
    assert ts._auto(153_600, 128, 128, 512, "head", "bf16", "cuda") == "lazy"
    names["cuda"] = "NVIDIA H100 80GB HBM3"  # not measured yet: today's default
    assert ts.auto_variant(38_400, "cuda") == "steps"
    assert ts.auto_variant(38_400, "cuda", factors="bf16", resident_fit=True) == "steps"
    assert ts.auto_variant(1 << 20, "cpu") == "steps"
    monkeypatch.undo()
    keys, queries, feats, exclude = _pool(300, 8, 16, 24, seed=3)
    plan = ts.plan_for(keys, queries, feats, 8, n=300, variant="auto")
    assert plan.variant == ("steps" if DEV != "cuda" else ts.auto_variant(300, DEV))
    direct = ts.SelectPlan(300, 8, 16, 24, 8, view="head", tau=1.0, precision=None,
                           factors="fp32", variant="auto", device=DEV, keys_buffer=keys)
    assert direct.variant == plan.variant  # a plan built directly resolves "auto" too
    got = ts.select_triton(keys, queries, feats, 8, seed=11, n=300, exclude=exclude,
                           variant="auto")
    want = ref.select(keys, queries, feats, 8, seed=11, exclude=exclude)
    assert got.tolist() == want.tolist()


def _ref_select_n(keys, queries, feats, k, *, n, exclude, **kw):
    """The reference selection of a capacity buffer's first n rows."""
    return ref.select(keys[:n], queries, feats, k, exclude=exclude[:n], **kw)


@pytest.mark.parametrize("view,variant", [("head", "steps"), ("queries", "steps"),
                                          ("head", "lazy"), ("queries", "resident")])
def test_the_whole_selection_from_the_pool_in_one_plan_equals_the_eager_composition(
        monkeypatch, view, variant):
    """kernels.select_from_pool on the Triton path (the exclusion U \\ D, the selection, the
    gathers of the picks' keys and indices and their mean |g|, all inside the plan: one CUDA
    graph on a GPU) against the same steps as eager ops (kernels/select_pool.py, the reference
    path): the same keys and indices, the same fallback, |g| to float rounding; a pool filled
    to n < capacity, a dictionary holding some of the pool's clips (and -1, no clip), and a
    dictionary that leaves fewer than m candidates (the exclusion dropped, fallback 1). Every
    variant the interpreter runs (the resident one as its per-round twin): a plan is warmed up
    when it is built, before any pool is in it, and the picks of that warm-up are gathered too."""
    from kernels.select_pool import select_from_pool_eager

    monkeypatch.setenv("CMACC_KERNELS", "triton")  # the plan path, also on CPU tensors
    cap, m = 600, 12
    keys, queries, feats, _ = _pool(cap, m, 16, 40, seed=9)
    g = torch.Generator().manual_seed(2)
    pool_index = torch.randperm(5000, generator=g)[:cap].to(DEV)  # [cap] dataset indices
    dicts = {"some": torch.cat([pool_index[torch.randperm(400, generator=g)[:150].to(DEV)],
                                torch.full((10,), -1, device=DEV)]),  # [K]
             "too many": pool_index[:395].clone()}  # n = 400: 5 left < m
    for n in (400, cap):
        for which, dict_index in dicts.items():
            got = kernels.select_from_pool(keys, pool_index, dict_index, queries, feats, m,
                                           seed=7, n=n, view=view, variant=variant)
            want = select_from_pool_eager(_ref_select_n, ref.grad_embed, keys, pool_index,
                                          dict_index, queries, feats, m, seed=7, n=n,
                                          tau=1.0, view=view, engine={})
            assert got[1].tolist() == want[1].tolist(), (n, which)
            torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
            torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-6)
            assert float(got[3]) == float(want[3]) == float(which == "too many" and n == 400)
            if which == "some":  # never a clip of the dictionary
                assert not set(got[1].tolist()) & set(dict_index.tolist())
    plans = [p for p in ts._PLANS.values() if p.pool_index is not None]
    assert plans and all(p.pool_index.data_ptr() == pool_index.data_ptr() for p in plans)
    assert {p.variant for p in plans} == {variant}
