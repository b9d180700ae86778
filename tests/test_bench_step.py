"""bench/bench_step.py measures what it says: the active sampler selects in every timed step
(the pool is full before them) and the random one never; the split of a step adds up; both
samplers of a setting start from the same weights and pools."""

import pytest
import torch

from bench.bench_step import SECTIONS, glyph_root, mi_setting, run, settings_pair, time_steps


@pytest.fixture(scope="module")
def glyphs(tmp_path_factory):
    from cmacc.apps.mi.data import Glyphs, make_glyphs

    root = make_glyphs(tmp_path_factory.mktemp("glyphs"), alphabets=2, chars=4, drawers=16)
    assert glyph_root(str(root), None) == root  # --omniglot ROOT is used as given
    return Glyphs(root)


def test_active_selects_in_every_timed_step_and_the_split_adds_up(glyphs):
    for sampler, selecting in (("random", 0.0), ("active", 1.0)):
        s = mi_setting(sampler, 2, 40, glyphs, batch=16, width=4, dim=16)
        assert s.model.pool_v.count == s.n_pool == 40 * 16
        t = time_steps(s, steps=2, warmup=1)
        assert set(SECTIONS) <= set(t) and t["active_steps"] == selecting
        assert (t["select"] > 0) == bool(selecting) and t["visible"] <= t["select"]
        # the step's wall time holds the timed sections (the rest is the loop's own overhead)
        assert t["data"] + t["fwd_bwd"] + t["visible"] <= t["step"] * 1.01
        assert t["reencode"] == 0.0  # no pool refresh asked for


def test_both_samplers_start_from_the_same_weights_and_pools(glyphs):
    random_s, active_s = settings_pair(
        lambda smp, fill, r: mi_setting(smp, 1, 40, glyphs, batch=16, width=4, dim=16, fill=fill,
                                        refresh=r))
    assert (random_s.sampler, active_s.sampler) == ("random", "active")
    want, got = random_s.model.state_dict(), active_s.model.state_dict()
    assert want.keys() == got.keys()
    for name, p in want.items():  # weights, BN statistics, dictionaries, pools (and their counts)
        assert torch.equal(p, got[name]) if torch.is_tensor(p) else p == got[name], name
    assert active_s.model.pool_a.count == random_s.model.pool_a.count == 40 * 16


def test_the_tiny_rows():
    rows = run(rows=("tiny",), steps=1, warmup=0, refreshes=(0, 2), log=lambda line: None)
    assert [(r["sampler"], r["refresh"]) for r in rows] == [("random", 0), ("active", 0),
                                                            ("active", 2)]
    # the pool refresh row: its re-encoding timed apart, and the step still adds up
    assert rows[1]["reencode"] == 0.0 < rows[2]["reencode"] and rows[2]["active_steps"] == 1.0
    assert (rows[2]["data"] + rows[2]["fwd_bwd"] + rows[2]["visible"] + rows[2]["reencode"]
            <= rows[2]["step"] * 1.01)
    rows = rows[:2]
    assert rows[1]["active_steps"] == 1.0 and rows[0]["active_steps"] == 0.0
    assert rows[1]["ratio"] == pytest.approx(rows[1]["step"] / rows[0]["step"])
    assert rows[1]["added"] == pytest.approx(1 + rows[1]["visible"] / rows[0]["step"])
    assert rows[0]["N"] == rows[1]["N"] == 192 and rows[0]["pool"] == "encode"
