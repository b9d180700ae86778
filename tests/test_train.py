"""train.py end to end on CPU (tiny preset, synthetic clips): learning, resume, bad flags."""

import csv
import json

import pytest
import torch

import train
from cmacc import checkpoint as ckpt

TINY = ["--preset", "tiny", "--clips", "96", "--classes", "6", "--log-every", "5"]


def _rows(out):
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_short_run_learns(tmp_path):
    out = tmp_path / "run"
    train.main(TINY + ["--steps", "60", "--out", str(out), "--sampler", "active"])
    rows = _rows(out)
    first = sum(float(r["loss"]) for r in rows[:3]) / 3
    last = sum(float(r["loss"]) for r in rows[-3:]) / 3
    assert last < first - 0.1, (first, last)
    assert float(rows[-1]["active"]) == 1.0  # the active sampler was running at the end
    # the step's wait for the selection never exceeds the selection's time (in line on CPU:
    # they are equal)
    assert all(0 <= float(r["t_select_visible"]) <= float(r["t_select"]) for r in rows)
    assert float(rows[-1]["t_select_visible"]) == pytest.approx(float(rows[-1]["t_select"]))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 60 and (out / "metrics.png").exists()
    waits = [float(r["data_wait"]) for r in rows]  # share of wall time spent waiting for data
    assert all(0.0 <= w < 1.0 for w in waits)
    assert summary["data_wait_share"] == pytest.approx(sum(waits) / len(waits), rel=1e-4)


@pytest.mark.parametrize("extra", [["--sampler", "active"], ["--sampler", "ohem", "--pool-mode", "epoch"]])
def test_resume_equals_uninterrupted(tmp_path, extra):
    a, b = tmp_path / "a", tmp_path / "b"
    train.main(TINY + extra + ["--steps", "14", "--out", str(a)])
    train.main(TINY + extra + ["--steps", "7", "--out", str(b)])
    train.main(TINY + extra + ["--steps", "14", "--out", str(b), "--resume", "auto"])
    sa = ckpt.load(a / "ckpt_00000014.pt")["model"]
    sb = ckpt.load(b / "ckpt_00000014.pt")["model"]
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)


def test_a_compiled_run_resumes_uncompiled_and_evaluates(tmp_path):
    """--compile (CPU inductor here) compiles the backbones in place: the checkpoint's keys are
    the uncompiled model's, so the run resumes without --compile (and the reverse) and
    cmacc.apps.eval reads it."""
    from cmacc.apps import eval as ev

    out = tmp_path / "run"
    small = ["--preset", "tiny", "--clips", "48", "--classes", "4", "--log-every", "1"]
    train.main(small + ["--steps", "2", "--compile", "--out", str(out)])
    plain = ckpt.load(out / "ckpt_00000002.pt")["model"]
    assert not [k for k in plain if "_orig_mod" in k]
    train.main(small + ["--steps", "3", "--out", str(out), "--resume", "auto"])
    train.main(small + ["--steps", "4", "--compile", "--out", str(out), "--resume", "auto"])
    assert ckpt.load(out / "ckpt_00000004.pt")["model"].keys() == plain.keys()
    assert ev.main([str(out), "--modality", "audio"]) == 0


def test_corrupt_latest_checkpoint_is_skipped(tmp_path):
    out = tmp_path / "run"
    train.main(TINY + ["--steps", "5", "--out", str(out)])
    (out / "ckpt_00000009.pt").write_bytes(b"not a checkpoint")
    path, state = ckpt.find_latest_valid(out)
    assert path.name == "ckpt_00000005.pt" and state["step"] == 5


@pytest.mark.parametrize("argv,msg", [
    (["--sampler", "nope"], "invalid choice"),
    (["--dict-size", "4"], "dict_size"),
    (["--steps", "0"], "steps must be"),
    (["--objective", "smoco", "--sampler", "active"], "random sampling"),
    (["--class-dist", "zipf:-1"], "--class-dist (class_dist) 'zipf:-1': expected 'uniform' or"),
])
def test_bad_flags_are_clear_errors(tmp_path, capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        train.main(TINY + argv + ["--out", str(tmp_path)])
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_config_file_and_flag_precedence(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"sampler": "ohem", "steps": 4, "log-every": 2}))
    out = tmp_path / "run"
    train.main(TINY + ["--config", str(cfg), "--steps", "6", "--out", str(out)])
    state = ckpt.load(out / "ckpt_00000006.pt")  # the flag (6) beat the file (4)
    assert state["config"]["selection"]["sampler"] == "ohem"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"samplr": "ohem"}))
    with pytest.raises(SystemExit):
        train.main(TINY + ["--config", str(bad), "--out", str(out)])


def test_bf16_autocast_channels_last_run_is_finite(tmp_path):
    out = tmp_path / "run"
    train.main(TINY + ["--steps", "3", "--log-every", "1", "--amp", "bf16", "--out", str(out)])
    rows = _rows(out)
    assert all(float(r["loss"]) == float(r["loss"]) for r in rows)  # not NaN
