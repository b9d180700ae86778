"""cmacc/: ring buffers, momentum rules, the loss, the samplers — each against a hand or brute
force computation."""

import math

import pytest
import torch
import torch.nn.functional as F

from cmacc.config import PRESETS, method_configs
from cmacc.encoders import AudioResNet1d, video_backbone
from cmacc.model import CMACC, contrastive_loss
from cmacc.queues import KeyPool, KeyQueue
from cmacc.samplers import select
from kernels import reference as ref

TINY = dict(batch_size=4, dict_size=10, pool_size=30, video_width=4, video_layers=(1, 1, 1, 1),
            audio_width=4, audio_layers=(1, 1, 1, 1), fcl_dim=16, dim=8, momentum=0.9)


def tiny_cfg(**kw):
    return method_configs(**{**TINY, **kw})


def tiny_batch(b=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, 3, 4, 16, 16, generator=g), torch.randn(b, 80, 20, generator=g),
            torch.arange(b) + 100 * seed)


# -- queues ---------------------------------------------------------------------------------
def test_queue_wraps_around_with_k_not_a_multiple_of_m():
    q = KeyQueue(7, 2)
    written = []
    for step in range(5):  # 5 * 3 = 15 writes into 7 slots
        keys = torch.full((3, 2), float(step)) + torch.arange(3)[:, None] / 10
        idx = torch.arange(3) + 10 * step
        q.enqueue(keys, idx)
        written += list(zip(idx.tolist(), keys[:, 0].tolist()))
    # slot s holds the last write w with w % 7 == s
    for s in range(7):
        last = max(w for w in range(15) if w % 7 == s)
        assert q.index[s].item() == written[last][0]
        assert q.keys[s, 0].item() == pytest.approx(written[last][1])
    assert q.ptr.item() == 15 % 7
    for m in (1, 3, 7):  # the m newest writes, oldest first
        keys, idx = q.last(m)
        assert idx.tolist() == [i for i, _ in written[-m:]]
        assert keys[:, 0].tolist() == pytest.approx([k for _, k in written[-m:]])


def test_queue_keeps_only_newest_when_m_exceeds_k():
    q = KeyQueue(4, 1)
    q.enqueue(torch.arange(6.0)[:, None], torch.arange(6))
    assert sorted(q.index.tolist()) == [2, 3, 4, 5]


def test_pool_count_and_state_roundtrip():
    p = KeyPool(5, 2)
    p.push(torch.ones(3, 2), torch.arange(3))
    assert p.count == 3 and p.valid()[0].shape == (3, 2)
    p.push(torch.ones(4, 2), torch.arange(4))
    assert p.count == 5
    p2 = KeyPool(5, 2)
    p2.load_state_dict(p.state_dict())
    assert p2.count == 5 and torch.equal(p2.index, p.index)


# -- encoders -------------------------------------------------------------------------------
def test_paper_backbones_have_512_features():
    assert video_backbone("r3d_18").out_dim == 512
    assert video_backbone("r2plus1d_18").out_dim == 512
    assert AudioResNet1d().out_dim == 512
    with pytest.raises(ValueError, match="log-mel batch"):
        AudioResNet1d()(torch.randn(2, 40, 10))


@pytest.mark.parametrize("arch", ["r3d_18", "r2plus1d_18"])
def test_scaled_video_backbone_runs(arch):
    net = video_backbone(arch, width=4, layers=(1, 1, 1, 1))
    assert net(torch.randn(2, 3, 4, 16, 16)).shape == (2, 32)


# -- momentum -------------------------------------------------------------------------------
def test_momentum_update_with_cross_modal_fcl_rule():
    model = CMACC(*tiny_cfg())
    for p in model.parameters():  # make query and key weights all differ
        p.data.normal_()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model._momentum_update_key_encoders()
    m = 0.9
    for n, p in model.named_parameters():
        if n.startswith("h_"):
            x = n[2]  # v or a
            other = "a" if x == "v" else "v"
            src = f"f_{other}" if ".fcl." in n else f"f_{x}"  # fcl follows the OTHER modality
            want = m * before[n] + (1 - m) * before[src + n[3:]]
            torch.testing.assert_close(p, want)
        else:
            assert torch.equal(p, before[n])  # query encoders untouched


def test_momentum_update_without_fcl_is_same_modality():
    model = CMACC(*tiny_cfg(fcl=False))
    assert model.f_v.fcl is None
    for p in model.parameters():
        p.data.normal_()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model._momentum_update_key_encoders()
    for n, p in model.named_parameters():
        if n.startswith("h_"):
            torch.testing.assert_close(p, 0.9 * before[n] + 0.1 * before["f_" + n[2:]])


def test_momentum_update_is_one_multi_tensor_update_with_the_per_parameter_bits(monkeypatch):
    """Every key parameter in one ``_foreach`` update (a few launches a step, not two per
    parameter), bit for bit the per-parameter ``mul_(m).add_(q, alpha=1 - m)``."""
    model = CMACC(*tiny_cfg())
    for p in model.parameters():
        p.data.normal_()
    params, m = dict(model.named_parameters()), model.cfg.momentum
    want = {}
    for n, p in params.items():
        if n.startswith("h_"):
            x = n[2]
            src = (f"f_{'a' if x == 'v' else 'v'}" if ".fcl." in n else f"f_{x}") + n[3:]
            want[n] = p.detach().clone().mul_(m).add_(params[src].detach(), alpha=1.0 - m)
    calls, real = [], torch._foreach_mul_
    monkeypatch.setattr(torch, "_foreach_mul_", lambda ts, s: calls.append(len(ts)) or real(ts, s))
    model._momentum_update_key_encoders()
    assert calls == [len(want)]
    for n, w in want.items():
        assert torch.equal(params[n], w), n


def test_key_encoders_get_no_gradient():
    model = CMACC(*tiny_cfg(sampler="random"))
    v, a, idx = tiny_batch()
    loss, _ = model(v, a, idx, step=0)
    loss.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n.startswith("h_"))
    assert all(p.grad is not None for p in model.f_v.parameters())
    assert all(p.grad is not None for p in model.f_a.parameters())


# -- loss -----------------------------------------------------------------------------------
def test_contrastive_loss_equals_hand_computation():
    q = F.normalize(torch.tensor([[1.0, 0.0], [0.6, 0.8]]), dim=1)
    k = F.normalize(torch.tensor([[0.8, 0.6], [0.0, 1.0]]), dim=1)
    neg = F.normalize(torch.tensor([[1.0, 1.0], [-1.0, 0.0], [0.0, -1.0]]), dim=1)
    tau = 0.7
    want, acc = 0.0, 0.0
    for i in range(2):
        pos = float(q[i] @ k[i])
        negs = [float(q[i] @ n) for n in neg]
        z = sum(math.exp(x / tau) for x in [pos] + negs)
        want += -(pos / tau - math.log(z)) / 2
        acc += float(pos > max(negs)) / 2
    loss, got_acc = contrastive_loss(q, k, neg, tau)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert got_acc.item() == pytest.approx(acc)


def test_cross_modal_loss_uses_the_other_modalitys_dictionary():
    model = CMACC(*tiny_cfg(sampler="random"))
    v, a, idx = tiny_batch()
    dv, da = model.dict_v.keys.clone(), model.dict_a.keys.clone()
    torch.manual_seed(0)
    loss, stats = model(v, a, idx, step=0)
    # recompute by hand with the post-update key encoders (momentum ran first in forward)
    with torch.no_grad():
        q_v, _ = model.f_v(v)
        q_a, _ = model.f_a(a)
        k_v, _ = model.h_v(v)
        k_a, _ = model.h_a(a)
    l_va, _ = contrastive_loss(q_v, k_a, da, 0.7)
    l_av, _ = contrastive_loss(q_a, k_v, dv, 0.7)
    assert loss.item() == pytest.approx(((l_va + l_av) / 2).item(), rel=1e-5)
    # XMoCo: the batch keys were enqueued after the loss
    assert torch.equal(model.dict_v.index[:4], idx)
    torch.testing.assert_close(model.dict_v.keys[:4], k_v)
    torch.testing.assert_close(model.dict_a.keys[:4], k_a)


# -- samplers -------------------------------------------------------------------------------
def _pool(n=40, m=5, d=6, dh=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = F.normalize(torch.randn(n, d, generator=g), dim=1)
    queries = F.normalize(torch.randn(m, d, generator=g), dim=1)
    feats = torch.randn(m, dh, generator=g)
    index = torch.randperm(1000, generator=g)[:n]
    return keys, index, queries, feats


@pytest.mark.parametrize("sampler", ["active", "active-feature", "ohem", "pool-random"])
def test_samplers_exclude_clips_already_in_the_dictionary(sampler):
    keys, index, queries, feats = _pool()
    dict_index = torch.cat([index[::2], torch.tensor([-1, -1])])  # half the pool is in D
    sel = select(sampler, pool_keys=keys, pool_index=index, dict_index=dict_index,
                 queries=queries, feats=feats, m=5, seed=3)
    assert sel.keys.shape == (5, 6)
    assert len(set(sel.index.tolist())) == 5
    assert not torch.isin(sel.index, dict_index).any()
    assert sel.fallback.item() == 0.0


def test_active_sampler_is_kmeanspp_over_gradient_embeddings():
    keys, index, queries, feats = _pool()
    sel = select("active", pool_keys=keys, pool_index=index, dict_index=torch.tensor([-1]),
                 queries=queries, feats=feats, m=5, seed=11)
    a, b = ref.grad_embed(keys, queries, feats, view="head")  # uncompressed: same picks
    want = ref.kmeanspp(a, b, 5, seed=11)
    assert torch.equal(sel.index, index[want])
    # gradient norms of the picks: |g| of the materialised embedding
    g = ref.materialise(a, b)[want]
    assert sel.gnorm.item() == pytest.approx(g.norm(dim=1).mean().item(), rel=1e-5)


def test_ohem_picks_the_highest_pseudo_label_losses():
    keys, index, queries, feats = _pool()
    dict_index = index[:10]
    sel = select("ohem", pool_keys=keys, pool_index=index, dict_index=dict_index,
                 queries=queries, feats=feats, m=5, seed=0)
    ce = [F.cross_entropy((keys[n] @ queries.t())[None], (keys[n] @ queries.t()).argmax()[None])
          .item() if n >= 10 else -1 for n in range(40)]
    want = sorted(range(40), key=lambda n: -ce[n])[:5]
    assert sorted(sel.index.tolist()) == sorted(index[want].tolist())


def test_pool_random_picks_a_uniform_subset_of_the_pool_outside_the_dictionary():
    """pool-random: M distinct picks of the pool minus the dictionary, every eligible candidate
    equally likely (chi-square against the uniform law over 3,000 seeds), the dictionary's
    clips never picked, the pool's stored keys enqueued as they are."""
    from scipy.stats import chisquare

    keys, index, queries, feats = _pool(n=40)
    dict_index = torch.cat([index[:12], torch.tensor([-1])])  # 28 eligible
    counts = torch.zeros(40)
    for seed in range(3000):
        sel = select("pool-random", pool_keys=keys, pool_index=index, dict_index=dict_index,
                     queries=queries, feats=feats, m=5, seed=seed)
        at = (index[None] == sel.index[:, None]).float().argmax(1)  # pool rows of the picks
        assert len(set(at.tolist())) == 5 and torch.equal(sel.keys, keys[at])
        counts[at] += 1
    assert counts[:12].sum() == 0  # exclusions exact
    assert chisquare(counts[12:].numpy()).pvalue > 1e-3  # 3,000 * 5 / 28 ~ 536 per candidate
    again = select("pool-random", pool_keys=keys, pool_index=index, dict_index=dict_index,
                   queries=queries, feats=feats, m=5, seed=2999)
    assert torch.equal(again.index, sel.index)  # a function of the seed (same on every rank)


class _MatmulDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the input dtypes of every matrix product that runs inside the block."""

    PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default,
                torch.ops.aten.mv.default, torch.ops.aten.dot.default}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.PRODUCTS:
            self.seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sampler", ["active", "active-feature", "ohem", "pool-random"])
@pytest.mark.parametrize("view", ["head", "queries"])
def test_selection_computes_in_fp32_under_the_training_autocast(sampler, view):
    """The trainer runs the model's forward (and so the selection) under bf16/fp16 autocast;
    every product of the selection must still run in fp32, and the picks, keys and gradient
    norms equal those of a call without autocast."""
    keys, index, queries, feats = _pool(n=60, m=6, d=8, dh=12, seed=4)
    args = dict(pool_keys=keys, pool_index=index, dict_index=index[:7], queries=queries,
                feats=feats, m=6, seed=5, view=view)
    want = select(sampler, **args)
    with torch.autocast("cpu", dtype=torch.bfloat16), _MatmulDtypes() as mode:
        got = select(sampler, **args)
    assert mode.seen, "no matrix product recorded"
    assert all(dt == torch.float32 for dts in mode.seen for dt in dts), mode.seen
    assert torch.equal(got.index, want.index)
    assert torch.equal(got.keys, want.keys) and torch.equal(got.gnorm, want.gnorm)


def test_sampler_drops_exclusion_when_too_few_candidates_remain():
    keys, index, queries, feats = _pool(n=8)
    sel = select("active", pool_keys=keys, pool_index=index, dict_index=index[:6],
                 queries=queries, feats=feats, m=5, seed=0)
    assert sel.fallback.item() == 1.0 and len(set(sel.index.tolist())) == 5


def test_active_model_enqueues_selected_pool_keys_before_the_loss():
    model = CMACC(*tiny_cfg(sampler="active", pool_size=30))
    seen, n_active = set(), 0
    for step in range(8):
        v, a, idx = tiny_batch(seed=step)
        seen |= set(idx.tolist())
        dict_before = set(model.dict_v.index.tolist())
        loss, stats = model(v, a, idx, step=step)
        assert math.isfinite(loss.item())
        if stats["active"]:
            picked = stats["enq_index_v"].tolist()
            assert set(picked) <= seen and not set(picked) & dict_before
            assert set(picked) <= set(model.dict_v.index.tolist())
            assert stats["fallback"].item() == 0.0
            n_active += 1
    assert model.pool_v.count == 30 and n_active == 4  # warm-up: 4 steps fill 14 >= K + M


def test_the_selection_timed_alone_is_the_steps_own_and_changes_nothing():
    """``time_selection_alone`` (a log row's SM time of the selection) runs the last selecting
    step's two selections again: 0 before any step selected; after, a positive time, spent in
    exactly two selections with that step's queries, features and seeds (recorded here); and
    the model goes on bit for bit as a twin never timed (losses, picks, every buffer)."""
    torch.manual_seed(0)
    timed = CMACC(*tiny_cfg(sampler="active", pool_size=30))
    twin = CMACC(*tiny_cfg(sampler="active", pool_size=30))
    twin.load_state_dict(timed.state_dict())
    calls, real = [], timed._select

    def spy(pool, dictionary, queries, feats, m, step, which, sampler=None):
        calls.append((queries, feats, m, step, which))
        return real(pool, dictionary, queries, feats, m, step, which, sampler)

    timed._select = spy
    assert timed.time_selection_alone() == 0.0 and not calls
    for step in range(8):
        v, a, idx = tiny_batch(seed=step)
        outs = [mdl(v, a, idx, step=step) for mdl in (timed, twin)]
        (l0, s0), (l1, s1) = outs
        assert torch.equal(l0, l1) and torch.equal(s0["enq_index_v"], s1["enq_index_v"])
        if s0["active"]:
            step_calls = calls[-2:]
            assert timed.time_selection_alone() > 0
            again = calls[-2:]
            assert len(calls) == 2 * (step - 3) + 2 * (step - 3)  # 2 in the step, 2 timed
            for (q0, f0, *r0), (q1, f1, *r1) in zip(step_calls, again):
                assert r0 == r1 and q0 is q1 and f0 is f1  # the step's own inputs and seeds
        st0, st1 = timed.state_dict(), twin.state_dict()
        assert all(torch.equal(st0[k], st1[k]) if torch.is_tensor(st0[k]) else st0[k] == st1[k]
                   for k in st0)


class _Clips:
    """Clips by dataset index (tiny_batch's shapes), as CMACC.fetch reads them; records what
    was fetched."""

    def __init__(self):
        g = torch.Generator().manual_seed(7)
        self.video = torch.randn(1000, 3, 4, 16, 16, generator=g)
        self.audio = torch.randn(1000, 80, 20, generator=g)
        self.fetched = []

    def __call__(self, index):
        self.fetched.append(index.clone())
        return self.video[index], self.audio[index]


@pytest.mark.parametrize("sampler", ["active", "pool-random"])
def test_pool_refresh_re_encodes_round_robin_by_the_current_key_encoders(sampler):
    """--pool-refresh R: before each selection R batches of pool slots, in slot order wrapping
    around, are encoded again by the key encoders as they are at that step (checked by running
    them directly on the same clips, BN over the same batch), so no key is older than
    N / (R M) steps; the other slots keep their keys. (An epoch pool: nothing else writes it.)"""
    clips = _Clips()
    model = CMACC(*tiny_cfg(sampler=sampler, pool_size=30, pool_mode="epoch", pool_refresh=2))
    model.fetch = clips
    g = torch.Generator().manual_seed(1)
    pool_index = torch.randperm(1000, generator=g)[:30]
    model.pool_v.fill(F.normalize(torch.randn(30, 8, generator=g), dim=1), pool_index)
    model.pool_a.fill(F.normalize(torch.randn(30, 8, generator=g), dim=1), pool_index)
    for step in range(5):  # 5 steps of 8 slots wrap around the 30
        _, _, idx = tiny_batch(seed=step)
        slots = [(8 * step + i) % 30 for i in range(8)]
        before_v, before_a = model.pool_v.keys.clone(), model.pool_a.keys.clone()
        ref_model = CMACC(*tiny_cfg(sampler=sampler, pool_size=30, pool_mode="epoch"))
        ref_model.load_state_dict(model.state_dict())
        ref_model._momentum_update_key_encoders()  # the step's first act
        model(clips.video[idx], clips.audio[idx], idx, step=step)
        assert model.pool_v.refresh == model.pool_a.refresh == (8 * step + 8) % 30
        for k in range(2):  # two batches of M = 4 slots
            s_k = slots[4 * k:4 * k + 4]
            assert torch.equal(clips.fetched[-2 + k], pool_index[s_k])
            with torch.no_grad():
                want_v = ref_model.h_v(clips.video[pool_index[s_k]])[0]
                want_a = ref_model.h_a(clips.audio[pool_index[s_k]])[0]
            torch.testing.assert_close(model.pool_v.keys[s_k], want_v)
            torch.testing.assert_close(model.pool_a.keys[s_k], want_a)
        rest = sorted(set(range(30)) - set(slots))
        assert torch.equal(model.pool_v.keys[rest], before_v[rest])
        assert torch.equal(model.pool_a.keys[rest], before_a[rest])
        assert torch.equal(model.pool_v.index, pool_index)


def test_pool_refresh_waits_for_the_selection_and_needs_the_clips():
    """No refresh while the pool warms up (nothing selects yet); a model asked to refresh
    without a way to read the pool's clips says so."""
    clips = _Clips()
    model = CMACC(*tiny_cfg(sampler="active", pool_size=30, pool_refresh=1))
    model.fetch = clips
    for step in range(4):  # the rolling pool holds 4, 8, 12, 16 >= K + M = 14 after these
        _, _, idx = tiny_batch(seed=step)
        _, stats = model(clips.video[idx], clips.audio[idx], idx, step=step)
        assert not stats["active"] and not clips.fetched
    model.fetch = None
    _, _, idx = tiny_batch(seed=4)
    with pytest.raises(ValueError, match="CMACC.fetch"):
        model(clips.video[idx], clips.audio[idx], idx, step=4)


def test_pool_refresh_resumes_where_it_stopped():
    """The round-robin pointer is part of the pool's state: a model restored from a state dict
    mid-run re-encodes the same slots and trains to the same weights as one that never
    stopped."""
    clips = _Clips()

    def run(model, steps):
        model.fetch = clips
        for step in steps:
            idx = torch.arange(4) + 40 * step  # 12 steps: clips 0..443
            loss, _ = model(clips.video[idx], clips.audio[idx], idx, step=step)
            loss.backward()
            with torch.no_grad():
                for p in model.query_parameters():
                    p -= 0.1 * p.grad
                    p.grad = None

    torch.manual_seed(0)
    whole = CMACC(*tiny_cfg(sampler="active", pool_size=30, pool_refresh=3))
    torch.manual_seed(0)
    first = CMACC(*tiny_cfg(sampler="active", pool_size=30, pool_refresh=3))
    run(whole, range(12))
    run(first, range(7))
    state = first.state_dict()
    assert state["pool_v._extra_state"]["refresh"] == first.pool_v.refresh != 0
    second = CMACC(*tiny_cfg(sampler="active", pool_size=30, pool_refresh=3))
    second.load_state_dict(state)
    run(second, range(7, 12))
    for k, v in whole.state_dict().items():
        if torch.is_tensor(v):
            assert torch.equal(v, second.state_dict()[k]), k


def test_smoco_needs_second_view_and_runs():
    model = CMACC(*tiny_cfg(objective="smoco", sampler="random"))
    v, a, idx = tiny_batch()
    with pytest.raises(ValueError, match="second augmented view"):
        model(v, a, idx, step=0)
    loss, stats = model(v, a, idx, step=0, video2=v.flip(-1), audio2=a)
    assert math.isfinite(loss.item()) and "loss_vv" in stats


@pytest.mark.parametrize("kw,msg", [
    (dict(sampler="bogus"), "sampler"),
    (dict(dict_size=2), "dict_size"),
    (dict(pool_size=12), "pool_size"),
    (dict(objective="smoco"), "random sampling"),
    (dict(momentum=1.0), "momentum"),
])
def test_config_rejects_bad_values(kw, msg):
    with pytest.raises(ValueError, match=msg):
        tiny_cfg(**kw)


def test_a_config_is_refused_at_once_exactly_when_its_model_cannot_be_built():
    """Widths, depths, dims, fcl on/off and both objectives: a ModelConfig is accepted exactly
    when the cross-modal fcl can tie the two modalities (the real backbones' feature widths are
    equal, or there is no cross-modal fcl), the refusal is one line naming --audio-width (when a
    width fixes it) and --no-fcl, and every accepted config builds its model."""
    import itertools

    from cmacc.config import ModelConfig, SelectionConfig

    widths, depths = (4, 6), ((1,), (1, 1, 1))  # 6 at 1 stage vs 3 stages: no whole width
    out_v = {(w, n): video_backbone("r3d_18", w, n).out_dim for w in widths for n in depths}
    out_a = {(w, n): AudioResNet1d(80, w, n).out_dim for w in widths for n in depths}
    accepted = refused = 0
    for (vw, vl), (aw, al), fcl, objective, (dim, fcl_dim) in itertools.product(
            out_v, out_a, (True, False), ("cross", "smoco"), ((8, 16), (12, 24))):
        kw = dict(video_width=vw, video_layers=vl, audio_width=aw, audio_layers=al, fcl=fcl,
                  objective=objective, dim=dim, fcl_dim=fcl_dim, batch_size=4, dict_size=8)
        buildable = not (fcl and objective == "cross") or out_v[vw, vl] == out_a[aw, al]
        try:
            cfg = ModelConfig(**kw)
        except ValueError as e:
            assert not buildable, (kw, e)
            msg = str(e)
            assert "\n" not in msg and "--no-fcl" in msg, msg
            if out_v[vw, vl] % 2 ** (len(al) - 1) == 0:  # a whole audio width matches
                want = out_v[vw, vl] // 2 ** (len(al) - 1)
                assert f"--audio-width {want}" in msg, msg
                assert AudioResNet1d(80, want, al).out_dim == out_v[vw, vl]
            refused += 1
            continue
        assert buildable, kw
        sampler = "random" if objective == "smoco" else "active"
        CMACC(cfg, SelectionConfig(sampler=sampler, pool_size=16))
        accepted += 1
    assert accepted and refused, (accepted, refused)
    for bad in ((), (0, 1), (1,) * 7, (65,)):
        with pytest.raises(ValueError, match=r"video_layers=.*1 to 6 stages"):
            ModelConfig(video_layers=bad, audio_layers=bad)


def test_negative_diversity_equals_hand_counts():
    from cmacc.metrics import negative_diversity

    def div(index, c=5):
        return {k: v.item() for k, v in negative_diversity(torch.tensor(index), labels, c).items()}

    labels = torch.tensor([0, 0, 1, 2, 2, 3, 4, 4])  # dataset index -> class (5 classes)
    # clips 0, 1, 4, 3, 1 (+ a no-clip entry): M = 5 enqueued, classes {0, 2}: U = 2
    assert div([0, 1, 4, -1, 3, 1]) == pytest.approx({"unique_per_m": 2 / 5, "coverage": 2 / 5})
    # M = 3 < C = 5: every class distinct is the ceiling, coverage 1
    assert div([0, 2, 5]) == pytest.approx({"unique_per_m": 1.0, "coverage": 1.0})
    # M = 8 > C = 5: U = 5 is the ceiling; U / M = 5 / 8
    assert div(list(range(8))) == pytest.approx({"unique_per_m": 5 / 8, "coverage": 1.0})
    assert div([6, 7, 7, 6]) == pytest.approx({"unique_per_m": 1 / 4, "coverage": 1 / 4})
    assert div([-1, -1]) == {"unique_per_m": 0.0, "coverage": 0.0}


def test_negative_diversity_ignores_unlabelled_clips():
    """Manifests may hold unlabelled clips (label -1): they are not counted (on CUDA a -1 in the
    scatter is a device-side assert that kills the run); no labels at all: NaN."""
    from cmacc.metrics import negative_diversity

    labels = torch.tensor([0, -1, 1, -1, 2])  # clips 1 and 3 unlabelled (3 classes)
    got = negative_diversity(torch.tensor([0, 1, 2, 3, 0]), labels, 3)
    # labelled enqueued clips 0, 2, 0: M = 3, classes {0, 1}: U = 2
    assert {k: v.item() for k, v in got.items()} == pytest.approx(
        {"unique_per_m": 2 / 3, "coverage": 2 / 3})
    none = negative_diversity(torch.tensor([0, 1]), torch.tensor([-1, -1]), 0)
    assert all(math.isnan(v.item()) for v in none.values())


# ops whose output size depends on the data: on CUDA each waits for the device (a host sync)
_SYNCING = {"aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
            "aten::nonzero", "aten::masked_select", "aten::_local_scalar_dense", "aten::item"}


class _OpNames(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("trial", range(20))
def test_the_dictionary_exclusion_equals_isin_without_a_data_dependent_op(trial):
    """U \\ D is computed by binary search in the sorted dictionary indices: the same set as
    torch.isin (which goes through unique, a host sync on CUDA, twice per dictionary per step),
    with duplicates, padding (-1), an empty pool overlap and a full one."""
    from cmacc.samplers import in_sorted

    g = torch.Generator().manual_seed(trial)
    n, k = int(torch.randint(1, 60, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
    pool = torch.randint(-1, 50, (n,), generator=g)
    dic = torch.randint(-1, 50, (k,), generator=g) if trial % 5 else pool[torch.randint(0, n, (k,), generator=g)]
    with _OpNames() as ops:
        got = in_sorted(pool, dic.sort().values)
    assert torch.equal(got, torch.isin(pool, dic))
    assert not ops.names & _SYNCING, ops.names & _SYNCING
    assert not in_sorted(pool, torch.empty(0, dtype=torch.long)).any()


@pytest.mark.parametrize("sampler", ["active", "active-feature", "ohem", "pool-random"])
def test_a_selection_step_has_no_data_dependent_op(sampler):
    """The whole sampler call (exclusion, selection, gathers, gradient norms) runs without an op
    whose output size depends on the data: on CUDA none of them waits for the device, so the
    selection can overlap the key encoders."""
    keys, index, queries, feats = _pool(n=60, m=6, d=8, dh=12, seed=1)
    with _OpNames() as ops:
        select(sampler, pool_keys=keys, pool_index=index, dict_index=index[:7], queries=queries,
               feats=feats, m=6, seed=1)
    assert ops.names and not ops.names & _SYNCING, ops.names & _SYNCING


@pytest.mark.parametrize("preset", ["tiny", "paper"])
def test_the_flops_per_clip_counted_on_the_meta_device_equal_a_real_forwards(preset):
    """cmacc.metrics.model_flops_per_clip counts on meta copies of the encoders (no real
    forward: on a GPU it would autotune cuDNN for shapes the run never uses): the same count
    as FlopCounterMode over a real one-clip forward of eval copies, x4 (3 query + 1 key)."""
    import copy

    from cmacc.data import train_loader
    from cmacc.metrics import flops_of, model_flops_per_clip

    cfg = PRESETS[preset].replace(data=dict(clips=8))
    torch.manual_seed(0)
    model = CMACC(cfg.model, cfg.selection)
    batch = next(iter(train_loader(cfg.data, batch_size=4, seed=0)))
    v, a = batch["video"], batch["audio"]
    fv, fa = copy.deepcopy(model.f_v).eval(), copy.deepcopy(model.f_a).eval()
    with torch.no_grad():
        real = flops_of(lambda: fv(v[:1])) + flops_of(lambda: fa(a[:1]))
    assert real > 0 and model_flops_per_clip(model, v, a) == 4 * real
