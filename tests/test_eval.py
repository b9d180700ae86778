"""Downstream protocols: the linear probe against planted signal and pure noise; the eval CLI
on a tiny checkpoint; held-out splits never mix train and test items."""

import json
import math

import pytest
import torch

from cmacc.apps import eval as ev
from cmacc.config import DataConfig
from cmacc.data import eval_splits
from cmacc.probe import linear_probe


def test_linear_probe_recovers_planted_linear_signal():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 24, generator=g)
    w = torch.randn(24, 5, generator=g)
    y = (x @ w).argmax(1)  # linearly separable by construction
    res = linear_probe(x[:3000], y[:3000], x[3000:], y[3000:], num_classes=5)
    assert res["top1"] >= 0.95 and res["train_top1"] >= 0.98


def test_linear_probe_is_at_chance_on_noise():
    g = torch.Generator().manual_seed(1)
    n_test, c = 3000, 4
    x = torch.randn(1000 + n_test, 16, generator=g)
    y = torch.randint(0, c, (1000 + n_test,), generator=g)  # independent of x
    res = linear_probe(x[:1000], y[:1000], x[1000:], y[1000:], num_classes=c)
    sigma = math.sqrt(0.25 * 0.75 / n_test)
    assert abs(res["top1"] - 1 / c) < 4 * sigma, res


def test_linear_probe_rejects_empty_split():
    with pytest.raises(ValueError, match="empty train or test"):
        linear_probe(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long), torch.zeros(2, 3),
                     torch.zeros(2, dtype=torch.long))


def test_toy_split_is_disjoint_and_class_balanced():
    ds = eval_splits("synthetic", DataConfig(clips=96, classes=6, frames=4, size=16), 0,
                     modality="video")
    (_, tr, te), = ds.splits()
    assert not set(tr.tolist()) & set(te.tolist())
    assert sorted(tr.tolist() + te.tolist()) == list(range(96))
    assert torch.bincount(ds.data.labels[te], minlength=6).tolist() == [4] * 6


def test_eval_cli_linear_writes_results(tiny_run, capsys):
    assert ev.main([str(tiny_run), "--modality", "audio"]) == 0
    res = json.loads((tiny_run / "eval" / "eval_audio_linear.json").read_text())
    assert res["splits"][0]["n_test"] == 24 and res["splits"][0]["num_classes"] == 6
    assert "| **mean** |" in capsys.readouterr().out


def test_finetune_learns_the_synthetic_audio_classes(tiny_run):
    model, state = ev.load_pretrained(tiny_run)
    res = ev.evaluate(model, state, "synthetic", modality="audio", protocol="finetune",
                      epochs=4, batch_size=16)
    assert res["top1_mean"] > 0.5  # chance is 1/6


def test_eval_cli_names_a_missing_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ev.main([str(tmp_path / "nothing-here")])
    assert e.value.code == 2 and "no such checkpoint" in capsys.readouterr().err
