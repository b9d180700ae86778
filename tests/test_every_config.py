"""Every configuration that ``Config`` accepts trains: a deterministic sample over the presets,
widths, stages and blocks, samplers, objectives (views), architectures and clip shapes, each
trained one step in-process on tiny synthetic clips. (A deep encoder on a small clip has a
1x1x1 last map, where a train-mode BatchNorm on one clip refuses to run: the FLOP count used to
do that at step 1.)"""

import random

import pytest

from cmacc.config import GRAD_VIEWS, POOL_MODES, PRESETS, SAMPLERS, VIDEO_ARCHS
from cmacc.trainer import Trainer

CASES = 12


def _sample(rng: random.Random, i: int) -> dict:
    """One candidate configuration: the cyclic fields make the sample cover every sampler and
    stage count; the rest is drawn."""
    objective, sampler = (("smoco", "random") if i % 5 == 4 else ("cross", SAMPLERS[i % 4]))
    width = rng.choice((1, 2, 3))
    stages = 1 + i % 6
    m = rng.choice((2, 3, 4))
    k = m * rng.choice((1, 2))
    return dict(
        preset=rng.choice(sorted(PRESETS)),
        model=dict(objective=objective, fcl=rng.random() < 0.7, video_arch=rng.choice(VIDEO_ARCHS),
                   video_width=width, audio_width=width,
                   video_layers=tuple(rng.choice((1, 2)) for _ in range(stages)),
                   audio_layers=tuple(rng.choice((1, 2)) for _ in range(stages)),
                   dim=rng.choice((2, 4)), fcl_dim=rng.choice((3, 4)), batch_size=m,
                   dict_size=k),
        selection=dict(sampler=sampler, grad_view=rng.choice(GRAD_VIEWS),
                       pool_mode=rng.choice(POOL_MODES), pool_size=k + m + rng.choice((0, 3))),
        data=dict(frames=rng.choice((1, 2, 3)), size=rng.choice((1, 5, 8)), clips=2 * m,
                  classes=2),
        optim=dict(warmup=1, channels_last=rng.random() < 0.5),
        run=dict(dict_init=rng.choice(("encode", "random")), shuffle_bn=rng.random() < 0.5),
    )


def _configs(tmp_path):
    rng, out = random.Random(40), []
    for i in range(CASES):
        s = _sample(rng, i)
        preset = PRESETS[s.pop("preset")]
        s["run"].update(steps=1, log_every=1, out=str(tmp_path / f"c{i}"), device="cpu")
        s["optim"]["amp"] = "none"  # (bf16 on CPU: tests/test_amp.py)
        out.append(preset.replace(**s))  # every sample is accepted: a refusal fails the test
    return out


def test_every_accepted_configuration_trains_one_step(tmp_path, monkeypatch):
    monkeypatch.setattr("cmacc.runlog.plot_metrics", lambda *a, **k: None)  # (most of the time)
    cfgs = _configs(tmp_path)
    assert {c.selection.sampler for c in cfgs} == set(SAMPLERS)
    assert {len(c.model.video_layers) for c in cfgs} == set(range(1, 7))
    assert {c.model.objective for c in cfgs} == {"cross", "smoco"}
    for cfg in cfgs:
        summary = Trainer(cfg).run()
        assert summary["steps"] == 1 and summary["loss_last"] == summary["loss_last"], cfg


def test_one_clip_per_batch_is_refused_by_the_config():
    with pytest.raises(ValueError, match="batch_size M=1: BatchNorm in training needs at least 2"):
        PRESETS["tiny"].replace(model=dict(batch_size=1, dict_size=1), selection=dict(
            sampler="random"))


def test_one_clip_per_rank_is_refused_at_the_start(tmp_path, monkeypatch):
    """M = 2 over 2 ranks: 1 clip per rank, refused before any work, naming the sizes that
    work (the rank count is simulated: the check runs before any collective)."""
    from cmacc.trainer import UsageError

    monkeypatch.setattr("cmacc.distributed.world_size", lambda: 2)
    cfg = PRESETS["tiny"].replace(model=dict(batch_size=2, dict_size=2), selection=dict(
        sampler="random"), run=dict(steps=1, out=str(tmp_path / "run")))
    with pytest.raises(UsageError, match=r"does not divide over 2 ranks into at least 2 clips "
                       r"each .* \(1\)$"):
        Trainer(cfg).run()
    assert not (tmp_path / "run").exists()
