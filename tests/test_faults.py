"""Faults injected into pretraining, and what survives: other runs' checkpoints, the last good
checkpoint under NaN, a full disk and kill -9; metrics and summary equal to an uninterrupted run
after a resume; bad command lines end in one line on stderr, exit 2, no traceback."""

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import train
from cmacc import checkpoint as ckpt
from cmacc.model import CMACC

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--preset", "tiny", "--clips", "96", "--classes", "6", "--log-every", "2"]
TIMING = {"clips_per_s", "t_data", "t_step", "t_select", "t_select_visible", "mfu", "mem_gb",
          "data_wait", "t_refresh", "t_select_alone"}


def _rows(out):
    with open(out / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in csv.DictReader(f)]


def _ckpts(out):
    return sorted(p.name for p in out.glob("ckpt_*.pt"))


def _usage_error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err
    return err


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A run of 2 steps (TINY; checkpoint ckpt_00000002.pt), trained once: the tests that
    continue or damage such a run work on their own copy."""
    out = tmp_path_factory.mktemp("two_steps") / "run"
    train.main(TINY + ["--steps", "2", "--out", str(out)])
    return out


# -- checkpoints: one run per folder, retention deletes only this run's ------------------------
def test_new_run_never_deletes_or_overwrites_another_runs_checkpoints(tmp_path, capsys):
    out = tmp_path / "run"
    train.main(TINY + ["--steps", "4", "--ckpt-every", "1", "--out", str(out)])
    before = {p: p.read_bytes() for p in out.glob("ckpt_*.pt")}
    assert len(before) == 3  # keep=3 of this run
    err = _usage_error(capsys, TINY + ["--steps", "6", "--resume", "none", "--out", str(out)])
    assert "already holds run" in err and "another --out" in err
    assert {p: p.read_bytes() for p in out.glob("ckpt_*.pt")} == before


def test_retention_keeps_newest_valid_and_never_touches_foreign_files(tmp_path):
    out = tmp_path / "run"
    train.main(TINY + ["--steps", "2", "--ckpt-every", "1", "--out", str(out)])
    corrupt = out / "ckpt_99999999.pt"  # newer by name, unreadable: must not push ours out
    corrupt.write_bytes(b"\x00" * 100)
    foreign = out / "ckpt_00000001.pt.bak"
    foreign.write_bytes(b"keep me")
    train.main(TINY + ["--steps", "8", "--ckpt-every", "1", "--keep", "2", "--out", str(out)])
    assert _ckpts(out) == ["ckpt_00000007.pt", "ckpt_00000008.pt", "ckpt_99999999.pt"]
    assert foreign.read_bytes() == b"keep me"
    path, state = ckpt.find_latest_valid(out, json.loads((out / "run.json").read_text())["run_id"])
    assert path.name == "ckpt_00000008.pt" and state["step"] == 8


def test_resume_auto_names_the_skipped_checkpoints(tmp_path, capsys, two_steps):
    out = tmp_path / "run"
    shutil.copytree(two_steps, out)
    (out / "ckpt_00000009.pt").write_bytes(b"truncated")
    capsys.readouterr()
    train.main(TINY + ["--steps", "3", "--out", str(out)])
    log = capsys.readouterr().err
    assert "skipping checkpoint" in log and "ckpt_00000009.pt" in log
    assert "ckpt_00000002.pt (step 2)" in log and "resumed run" in log


def test_a_checkpoint_of_another_world_size_resumes_and_says_what_changed(tmp_path, capsys,
                                                                          two_steps):
    """A checkpoint written by 8 ranks resumes in one process (nothing in it depends on the
    world size): one log line names what was re-derived, and the run ends equal to the same
    resume of the same checkpoint marked as written by one rank."""
    out, same = tmp_path / "run", tmp_path / "same"
    shutil.copytree(two_steps, out)
    shutil.copytree(two_steps, same)
    state = ckpt.load(out / "ckpt_00000002.pt")
    state["world_size"] = 8
    torch.save(state, out / "ckpt_00000002.pt")
    capsys.readouterr()
    train.main(TINY + ["--steps", "4", "--out", str(out)])
    log = capsys.readouterr().err
    changed = [line for line in log.splitlines() if "world size" in line]
    assert len(changed) == 1 and "world size 8 -> 1: 16 clips per rank (was 2)" in changed[0], log
    train.main(TINY + ["--steps", "4", "--out", str(same)])
    assert "world size" not in capsys.readouterr().err
    a, b = ckpt.load(out / "ckpt_00000004.pt"), ckpt.load(same / "ckpt_00000004.pt")
    torch.testing.assert_close(a["model"], b["model"], rtol=0, atol=0)
    torch.testing.assert_close(a["optimizer"], b["optimizer"], rtol=0, atol=0)


# -- non-finite losses: stop before any save, or skip -----------------------------------------
@pytest.fixture
def nan_at_step(monkeypatch):
    """CMACC.forward returns a NaN loss at the given step (0-based iteration index)."""
    def install(bad_step):
        real = CMACC.forward

        def forward(self, *args, step, **kw):
            loss, stats = real(self, *args, step=step, **kw)
            return (loss * float("nan") if step == bad_step else loss), stats

        monkeypatch.setattr(CMACC, "forward", forward)
    return install


def test_nan_stops_the_run_without_a_poisoned_checkpoint(tmp_path, capsys, nan_at_step):
    out = tmp_path / "run"
    nan_at_step(4)  # the 5th iteration
    with pytest.raises(SystemExit) as e:
        train.main(TINY + ["--steps", "10", "--ckpt-every", "1", "--keep", "10", "--out", str(out)])
    assert e.value.code != 0
    msg = str(e.value.code)
    assert "non-finite loss" in msg and "at step 5" in msg and str(out / "ckpt_00000004.pt") in msg
    assert _ckpts(out) == [f"ckpt_{s:08d}.pt" for s in range(1, 5)]  # nothing after the NaN
    for name in _ckpts(out):
        assert all(torch.isfinite(v).all() for v in ckpt.load(out / name)["model"].values()
                   if torch.is_tensor(v) and v.is_floating_point())


def test_nan_steps_can_be_skipped_and_counted(tmp_path, nan_at_step):
    out = tmp_path / "run"
    nan_at_step(3)
    train.main(TINY + ["--steps", "6", "--on-nonfinite", "skip", "--out", str(out)])
    rows = _rows(out)
    assert [float(r["nonfinite"]) for r in rows] == [0.0, 1.0, 1.0]
    assert all(float(r["loss"]) == float(r["loss"]) for r in rows)  # no NaN reached the metrics
    state = ckpt.load(out / "ckpt_00000006.pt")
    assert state["nonfinite"] == 1
    assert all(torch.isfinite(v).all() for v in state["model"].values()
               if torch.is_tensor(v) and v.is_floating_point())


def test_a_restart_after_an_agreed_nan_stop_repeats_the_line_at_once(tmp_path, nan_at_step,
                                                                     monkeypatch, capsys):
    """As torchrun sees it (its environment set by hand, one rank): the NaN stop is recorded in
    OUT/stopped.json; a restarted attempt of the same job ends at once with the same line and
    exit code, before any work (no resume, no checkpoint touched); another job's restart does
    not read it, and a new job's first attempt removes it."""
    out = tmp_path / "run"
    argv = TINY + ["--steps", "6", "--ckpt-every", "1", "--out", str(out)]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    healthy = CMACC.forward
    nan_at_step(2)
    with pytest.raises(SystemExit) as first:
        train.main(argv)
    stop = json.loads((out / ckpt.STOP_FILE).read_text())
    assert stop["line"] in str(first.value.code) and stop["code"] == 1 and stop["step"] == 2
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("ckpt_*.pt")}
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    capsys.readouterr()
    with pytest.raises(SystemExit) as again:
        train.main(argv)
    assert again.value.code == first.value.code  # the same line, exit 1 (sys.exit of a str)
    err = capsys.readouterr().err
    assert "not training again into the same failure" in err and "resumed run" not in err
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("ckpt_*.pt")} == before
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job2")  # another job's restart trains
    monkeypatch.setattr(CMACC, "forward", healthy)
    train.main(argv)
    assert "resumed run" in capsys.readouterr().err and (out / ckpt.STOP_FILE).exists()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # a new job: the record goes
    train.main(argv)
    assert not (out / ckpt.STOP_FILE).exists()


# -- resume continuity: metrics, TensorBoard and summary as if never interrupted --------------
def test_resumed_metrics_and_summary_equal_an_uninterrupted_run(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train.main(TINY + ["--steps", "5", "--tensorboard", "--out", str(a)])
    train.main(TINY + ["--steps", "3", "--tensorboard", "--out", str(b)])  # an off-grid last row
    train.main(TINY + ["--steps", "5", "--tensorboard", "--out", str(b)])
    assert _rows(b) == _rows(a)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    for k in sa:
        if k not in ("clips_per_s", "data_wait_share", "out"):
            assert sa[k] == sb[k], k
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def tb_loss(d):
        acc = EventAccumulator(str(d / "tb"))
        acc.Reload()
        return [(e.step, round(e.value, 5)) for e in acc.Scalars("loss")]

    assert tb_loss(b) == tb_loss(a)


# -- kill -9 during a save; a full disk -----------------------------------------------------
KILL_DURING_THIRD_SAVE = textwrap.dedent("""
    import os, signal, sys
    import torch
    import train
    real, calls = torch.save, []

    def save(obj, f, *a, **k):
        calls.append(1)
        if len(calls) == 3:  # half a file in the temporary, then the power goes
            with open(f, "wb") as fh:
                fh.write(b"PK" + b"\\0" * 4096)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(obj, f, *a, **k)

    torch.save = save
    train.main(sys.argv[1:])
""")


def test_kill_9_during_a_save_loses_nothing_finished(tmp_path):
    out = tmp_path / "run"
    argv = TINY + ["--steps", "6", "--ckpt-every", "1", "--out", str(out)]
    env = dict(os.environ, CMACC_KERNELS="reference")
    p = subprocess.run([sys.executable, "-c", KILL_DURING_THIRD_SAVE, *argv], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert _ckpts(out) == ["ckpt_00000001.pt", "ckpt_00000002.pt"]
    assert [q.name for q in out.glob(".*.tmp*")]  # the half-written temporary is there ...
    train.main(argv)  # ... and resuming sweeps it, continues from step 2, finishes
    assert not list(out.glob(".*.tmp*"))
    assert ckpt.load(out / "ckpt_00000006.pt")["step"] == 6
    ref = tmp_path / "ref"
    train.main(TINY + ["--steps", "6", "--out", str(ref)])
    assert _rows(out) == _rows(ref)


def test_full_disk_on_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path, capsys, monkeypatch,
                                                                    two_steps):
    out = tmp_path / "run"
    shutil.copytree(two_steps, out)
    real = torch.save

    def full(obj, f, *a, **k):
        with open(f, "wb") as fh:
            fh.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    err = _usage_error(capsys, TINY + ["--steps", "4", "--out", str(out)])
    monkeypatch.setattr(torch, "save", real)
    assert "No space left on device" in err and "ckpt_00000002.pt" in err
    assert _ckpts(out) == ["ckpt_00000002.pt"] and not list(out.glob(".*.tmp*"))
    assert ckpt.load(out / "ckpt_00000002.pt")["step"] == 2


# -- bad command lines ----------------------------------------------------------------------
def _bad_command_lines(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "typo.json").write_text('{"samplr": "ohem"}')
    (tmp_path / "garbage.pt").write_bytes(os.urandom(64))
    out = str(tmp_path / "out")
    return [
        (["--out", str(a_file)], "is a file"),
        (["--out", str(a_file / "sub")], "cannot write there"),
        (["--config", str(tmp_path / "bad.json"), "--out", out], "cannot read JSON"),
        (["--config", str(tmp_path / "list.json"), "--out", out], "expected a JSON object"),
        (["--config", str(tmp_path / "typo.json"), "--out", out], "unknown keys ['samplr']"),
        (["--config", str(tmp_path / "missing.json"), "--out", out], "missing.json"),
        (["--resume", str(tmp_path / "garbage.pt"), "--out", out], "not a readable checkpoint"),
        (["--steps", "0", "--out", out], "steps must be >= 1"),
        (["--redundancy", "1.5", "--out", out], "redundancy must be in [0, 1)"),
        (["--lr", "-1", "--out", out], "lr must be > 0"),
        (["--lr", "1e38", "--out", out], "lr must be a number <= 10"),
        (["--lr", "nan", "--out", out], "lr must be"),
        (["--tau", "inf", "--out", out], "tau must be a number <= 1000"),
        (["--seed", "99999999999999999999", "--out", out], "seed must be in [0, 2147483648)"),
        (["--video-width", "1000000000", "--out", out], "--video-width must be a number <= 4096"),
        (["--pool-size", "99999999999", "--out", out], "--pool-size must be a number"),
        (["--keep", "0", "--out", out], "keep must be >= 1"),
        (["--dict-size", "4", "--out", out], "--dict-size K=4"),
        (["--data", str(tmp_path / "nope.csv"), "--out", out], "nope.csv"),
        (["--sampler", "nope", "--out", out], "invalid choice"),
    ]


def test_bad_command_lines_are_one_line_errors(tmp_path, capsys):
    for argv, msg in _bad_command_lines(tmp_path):
        err = _usage_error(capsys, TINY + argv)
        assert msg in err, (argv, err)
        assert err.strip().count("\n") == 0 and err.startswith("error: "), err
        assert "weights_only" not in err, err  # never torch's advice to load unsafely


def test_a_skipped_checkpoint_says_why_in_our_words(tmp_path, caplog, two_steps):
    """A file a weights-only load refuses (it pickles an object: it could run code) is skipped
    by --resume auto with our reason; torch's "re-run with weights_only=False" never shows."""
    import argparse

    out = tmp_path / "run"
    shutil.copytree(two_steps, out)
    torch.save({"step": 9, "model": argparse.Namespace(x=1)}, out / "ckpt_00000009.pt")
    with caplog.at_level("WARNING"):
        train.main(TINY + ["--steps", "3", "--out", str(out)])
    skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(skipped) == 1 and "ckpt_00000009.pt" in skipped[0], skipped
    assert "weights-only" in skipped[0] and "weights_only" not in skipped[0], skipped[0]
    assert ckpt.load(out / "ckpt_00000003.pt")["step"] == 3


def test_debug_shows_the_traceback(tmp_path):
    from data_dali.cli import UserError

    with pytest.raises(UserError, match="steps must be"):
        train.main(TINY + ["--steps", "0", "--debug", "--out", str(tmp_path)])


# -- a real full filesystem --------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A real 8 MiB filesystem (tmpfs, mounted for the test): one tiny-preset checkpoint
    (~4.6 MB) fits, a second does not. Skipped where mounting is not permitted."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                           capture_output=True, text=True, timeout=30)
    except OSError as e:
        pytest.skip(f"cannot run mount ({e}): a real full filesystem needs root")
    if p.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({p.stderr.strip()[:120]})")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_a_checkpoint_on_a_really_full_disk_is_one_line_and_keeps_the_last(small_disk, capsys,
                                                                           two_steps):
    """torch.save on a full filesystem raises RuntimeError('... unexpected pos ...'), not
    OSError: still one line naming the step and the last good checkpoint, exit 2, no
    temporary left, the last checkpoint loadable."""
    out = small_disk / "run"
    shutil.copytree(two_steps, out)
    err = _usage_error(capsys, TINY + ["--steps", "4", "--out", str(out)])
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: cannot write the checkpoint of step 4"), lines[-1]
    assert "disk is full" in lines[-1] and "ckpt_00000002.pt" in lines[-1], lines[-1]
    assert _ckpts(out) == ["ckpt_00000002.pt"] and not list(out.glob(".*.tmp*"))
    assert ckpt.load(out / "ckpt_00000002.pt")["step"] == 2
    rows = (out / "metrics.csv").read_bytes()
    assert rows.endswith(b"\r\n") and int(_rows(out)[-1]["step"]) == 4  # whole rows only


def test_a_metrics_row_on_a_full_disk_is_never_half_written(small_disk):
    """The disk fills up while a row is appended (part of it fits in the file's last page):
    the write fails and the file still ends with its last whole row."""
    from cmacc.runlog import CSVLog

    log = CSVLog(small_disk / "m.csv", ["step", "note"])
    log.write({"step": 1, "note": "ok"})
    with open(small_disk / "filler", "wb", buffering=0) as f:  # take every free block
        with pytest.raises(OSError):
            while True:
                f.write(b"\0" * 65536)
    with pytest.raises(OSError):
        log.write({"step": 2, "note": "x" * 100_000})
    log.close()
    assert (small_disk / "m.csv").read_bytes() == b"step,note\r\n1,ok\r\n"
