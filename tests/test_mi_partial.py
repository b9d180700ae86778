"""A stopped MI run continues from its last window (cmacc.apps.mi.partial): stopped mid-window
and started again, it ends bit for bit as the same run never stopped — losses, accuracies,
every measurement and the weights — and a file of another run is refused and kept."""

import math

import pytest
import torch

from cmacc.apps import mi
from data_dali.cli import UserError

from test_mi import identity_glyphs

TIMES = ("seconds", "cpu_seconds", "pool_seconds", "pool_cpu_seconds", "started_utc",
         "selection_diag_cpu_seconds", "hardness_cpu_seconds")


def _same(a, b) -> bool:
    """Equal, NaN equal to NaN (a window with nothing measured)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class Stop(Exception):
    pass


@pytest.mark.parametrize("method", ["CM-ACC", "XMoCo"])
def test_a_run_stopped_mid_window_continues_bit_for_bit(tmp_path, method):
    pairs = mi.MultiOmniglotPairs(identity_glyphs([12, 7]), 2, 256, seed=1, drawers=range(0, 14))
    cfg = mi.MIConfig(**{**mi.QUICK, "max_steps": 24, "min_steps": 24, "window": 6,
                         "pool_mode": "epoch"})  # 8 steps an epoch: pools drawn 3 times
    mp = pytest.MonkeyPatch()
    mp.setattr(mi.train, "KEY_COS_EVERY", 4)  # every measurement recorded and carried over
    try:
        m0, h0 = mi.train_one(method, pairs, cfg, seed=0, partial_path=tmp_path / "a.pt")
        assert torch.load(tmp_path / "a.pt", weights_only=False)["step"] == 24
        calls = [0]
        real = mi.train.character_diversity

        def dies_at_step_15(*a):  # two calls a step: the 16th step (15) never ends
            calls[0] += 1
            if calls[0] > 2 * 15:
                raise Stop
            return real(*a)

        mp.setattr(mi.train, "character_diversity", dies_at_step_15)
        with pytest.raises(Stop):
            mi.train_one(method, pairs, cfg, seed=0, partial_path=tmp_path / "b.pt")
        assert torch.load(tmp_path / "b.pt", weights_only=False)["step"] == 12  # window 2's
        mp.setattr(mi.train, "character_diversity", real)
        said = []
        m1, h1 = mi.train_one(method, pairs, cfg, seed=0, partial_path=tmp_path / "b.pt",
                              log=said.append)
    finally:
        mp.undo()
    assert any("continues at step 12" in s for s in said)
    assert set(h0) == set(h1)
    for k in h0:
        if k not in TIMES:
            assert _same(h0[k], h1[k]), k
    assert h0["stop"] == h1["stop"] and h1["steps"] == 24
    s0, s1 = m0.state_dict(), m1.state_dict()
    assert all(torch.equal(s0[k], s1[k]) if torch.is_tensor(s0[k]) else s0[k] == s1[k]
               for k in s0)
    assert h1["cpu_seconds"] > 0 and h1["started_utc"] == torch.load(
        tmp_path / "b.pt", weights_only=False)["hist"]["started_utc"]


def test_a_partial_file_of_another_run_is_refused_and_kept(tmp_path):
    pairs = mi.MultiOmniglotPairs(identity_glyphs([12, 7]), 2, 256, seed=1, drawers=range(0, 14))
    cfg = mi.MIConfig(**{**mi.QUICK, "max_steps": 6, "min_steps": 6, "window": 6})
    f = tmp_path / "p.pt"
    mi.train_one("XMoCo", pairs, cfg, seed=0, partial_path=f)
    before = f.read_bytes()
    with pytest.raises(UserError, match=r"p\.pt belongs to another run \(seed: 0 here, 1 asked"):
        mi.train_one("XMoCo", pairs, cfg, seed=1, partial_path=f)
    other = mi.MIConfig(**{**mi.QUICK, "max_steps": 6, "min_steps": 6, "window": 6, "lr": 0.5})
    with pytest.raises(UserError, match=r"lr: 0\.001 here, 0\.5 asked"):
        mi.train_one("XMoCo", pairs, other, seed=0, partial_path=f)
    assert f.read_bytes() == before  # refused, not overwritten
    f.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="not a readable partial MI run"):
        mi.train_one("XMoCo", pairs, cfg, seed=0, partial_path=f)
    assert f.read_bytes() == b"not a checkpoint"  # kept as it was
