"""How hard the picks are, measured the same way for both samplers (cmacc.apps.mi.train's
``pick_hardness`` and ``measure_hardness``): the figures against float64 computations written
out here, and, in a run, that the measurement scores the loss's own queries and positives
against the picks the run enqueued and against an eligible draw of the other sampler from the
same pool at the same step."""

import math

import pytest
import torch

from cmacc import model as model_mod
from cmacc.apps import mi
from cmacc.queues import KeyQueue, KeyPool

from test_mi import identity_glyphs, trained_alike_measured_or_not


def test_pick_hardness_against_float64():
    """acc, InfoNCE loss, mean and max cosine, query by query in float64."""
    torch.manual_seed(0)
    m, k, d, tau = 7, 11, 5, 0.3
    q = torch.nn.functional.normalize(torch.randn(m, d), dim=1)
    p = torch.nn.functional.normalize(q + 0.8 * torch.randn(m, d), dim=1)
    neg = torch.nn.functional.normalize(torch.randn(k, d), dim=1)
    got = mi.train.pick_hardness(q, p, neg, tau)
    acc = loss = cmean = cmax = 0.0
    for j in range(m):
        qj = q[j].double()
        pos = float(qj @ p[j].double())
        negs = [float(qj @ neg[i].double()) for i in range(k)]
        acc += pos > max(negs)
        loss += -pos / tau + math.log(sum(math.exp(s / tau) for s in [pos, *negs]))
        cmean += sum(negs) / k
        cmax += max(negs)
    assert got["acc"] == pytest.approx(acc / m)
    assert got["loss"] == pytest.approx(loss / m, rel=1e-5)
    assert got["cos_mean"] == pytest.approx(cmean / m, abs=1e-6)
    assert got["cos_max"] == pytest.approx(cmax / m, abs=1e-6)


def _row_index(rows: torch.Tensor, table: torch.Tensor) -> list[int]:
    """The row of ``table`` equal to each of ``rows`` (exactly; the first if several)."""
    out = []
    for r in rows:
        hit = (table == r).all(1).nonzero().flatten()
        assert hit.numel(), "a scored negative is not a pool entry"
        out.append(int(hit[0]))
    return out


@pytest.mark.parametrize("method", ["CM-ACC", "pool-random"])
def test_hardness_scores_the_loss_queries_against_both_pick_sets_of_one_step(method):
    """Every measured step: the queries and positives scored are the loss's own (spied on
    ``contrastive_loss``), the run's own sampler's set is exactly what it enqueued into that
    dictionary, and the other set is m distinct pool entries outside the dictionary (U \\ D),
    drawn from the pool as it stood; the recorded figures are ``pick_hardness`` of those."""
    pairs = mi.MultiOmniglotPairs(identity_glyphs([12, 7]), 2, 512, seed=1, drawers=range(0, 14))
    cfg = mi.MIConfig(**{**mi.QUICK, "bn_groups": 1, "max_steps": 8, "min_steps": 8,
                         "window": 4, "pool_mode": "epoch"})
    scored, losses, enqueued, pools, dicts = [], [], [], [], []
    real_hard, real_loss = mi.train.pick_hardness, model_mod.contrastive_loss
    real_enq, real_select = KeyQueue.enqueue, model_mod.CMACC._select

    def spy_hard(q, p, neg, tau):
        scored.append((q.clone(), p.clone(), neg.clone()))
        return real_hard(q, p, neg, tau)

    def spy_loss(q, k_pos, negatives, tau):
        losses.append((q.detach().clone(), k_pos.clone()))
        return real_loss(q, k_pos, negatives, tau)

    def spy_enq(self, keys, index):
        if not isinstance(self, KeyPool):
            enqueued.append((id(self), keys.clone(), index.clone()))
        return real_enq(self, keys, index)

    def spy_select(self, pool, dictionary, *a, sampler=None, **kw):
        if sampler is None:  # the run's own selection: the pool and D as they stand
            pools.append((pool.keys[:pool.count].clone(), pool.index[:pool.count].clone()))
            dicts.append(dictionary.index.clone())
        return real_select(self, pool, dictionary, *a, sampler=sampler, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(mi.train, "KEY_COS_EVERY", 2)
    mp.setattr(mi.train, "pick_hardness", spy_hard)
    mp.setattr(model_mod, "contrastive_loss", spy_loss)
    mp.setattr(KeyQueue, "enqueue", spy_enq)
    mp.setattr(model_mod.CMACC, "_select", spy_select)
    try:
        model, hist = mi.train_one(method, pairs, cfg, seed=0)
    finally:
        mp.undo()
    own = "active" if method == "CM-ACC" else "uniform"
    other = "uniform" if own == "active" else "active"
    # per step: 2 selections (D_v, D_a), 2 loss calls (q_v vs D_a, q_a vs D_v), 2 enqueues;
    # the active steps are the last len(pools) / 2 (the pool warm-up enqueues batches)
    steps = len(pools) // 2
    assert steps == cfg.max_steps  # an epoch pool from step 0: every step selects
    losses, enqueued = losses[-2 * steps:], enqueued[-2 * steps:]
    dict_ids = (id(model.dict_v), id(model.dict_a))
    n_measured = 0
    for s in range(steps):
        if (s + 1) % 2:
            continue
        for which in (0, 1):  # D_v: the audio queries (the loss's second call), and back
            q, k_pos = losses[2 * s + (1 if which == 0 else 0)]
            enq = [e for e in enqueued[2 * s:2 * s + 2] if e[0] == dict_ids[which]][0]
            keys_pool, index_pool = pools[2 * s + which]
            sets = {}
            for name in ("active", "uniform"):
                sq, sp, neg = scored.pop(0)
                torch.testing.assert_close(sq, q.float(), rtol=0, atol=0)
                torch.testing.assert_close(sp, k_pos.float(), rtol=0, atol=0)
                sets[name] = neg
            torch.testing.assert_close(sets[own], enq[1].float(), rtol=0, atol=0)
            rows = _row_index(sets[other], keys_pool.float())
            assert len(set(rows)) == cfg.batch  # m distinct entries
            in_dict = set(dicts[2 * s + which].tolist())
            assert not in_dict & {int(index_pool[r]) for r in rows}  # U \ D
            n_measured += 1
    assert n_measured == 8 and not scored
    assert len(hist["hard_acc_gap"]) == 2
    for f in mi.train.HARDNESS:
        a, u, g = (hist[f"hard_{f}_{x}_2nd_half"] for x in ("active", "uniform", "gap"))
        assert g == pytest.approx(a - u, abs=1e-9)


def test_measuring_the_hardness_leaves_a_fresh_picks_run_as_it_was():
    """Inside the step's forward the measurement draws CM-ACC's picks on pool-random's run and
    re-encodes both sets (--fresh-picks: shuffle-BN draws, BN buffers move): the run must train
    exactly as without it, losses, accuracies and weights bit for bit."""
    pairs = mi.MultiOmniglotPairs(identity_glyphs([12, 7]), 2, 256, seed=1, drawers=range(0, 14))
    cfg = mi.MIConfig(**{**mi.QUICK, "max_steps": 12, "min_steps": 12, "window": 6,
                         "pool_mode": "epoch", "fresh_picks": True})
    assert cfg.bn_groups > 1  # the shuffled key encoders: the random state is used
    h0, h1 = trained_alike_measured_or_not("pool-random", pairs, cfg)
    assert all(math.isfinite(c) for c in h1["hard_loss_gap"]) and h1["hardness_cpu_seconds"] > 0
    assert all(math.isnan(c) for c in h0["hard_loss_gap"])
