"""Ctrl-C and SIGTERM in every kind of command: one line ("interrupted; ..." with what was kept
and how to continue), the documented exit code, no traceback (workers included: the signal of a
Ctrl-C reaches the whole process group); a command made of several runs stops as a whole; and
the same evaluation twice gives the same figures."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cmacc import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--preset", "tiny", "--clips", "96", "--classes", "6"]


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_when(cmd, ready, sig, tmp_path, timeout=120):
    """Run ``cmd`` in its own process group; once ``ready(stderr so far)`` holds, send ``sig``
    to the whole group (as a terminal's Ctrl-C does); (returncode, stdout, stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    err_file = tmp_path / "stderr.txt"
    with open(err_file, "w") as err:
        # Ctrl-C's default action restored in the command: a shell starts background jobs with
        # SIGINT ignored, and a pytest started that way would hand that on to every command
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err,
                             text=True, start_new_session=True, preexec_fn=_default_sigint)
        deadline = time.time() + timeout
        try:  # the wait too: a command that never gets ready must not outlive the test
            while not ready(err_file.read_text()):
                assert p.poll() is None and time.time() < deadline, err_file.read_text()[-3000:]
                time.sleep(0.2)
            os.killpg(p.pid, sig)
            out, _ = p.communicate(timeout=timeout)
        finally:
            if p.poll() is None:  # never leave a busy process behind a failed test
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    return p.returncode, out, err_file.read_text()


def _one_interrupted_line(err):
    lines = [ln for ln in err.splitlines() if ln.startswith("interrupted; ")]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    return lines[0]


def test_ctrl_c_on_train_saves_and_says_how_to_continue(tmp_path):
    out = tmp_path / "run"
    rc, _, err = _signal_when(
        [sys.executable, "train.py", *TINY, "--steps", "100000", "--log-every", "1",
         "--out", str(out)], lambda e: (out / "metrics.csv").exists(), signal.SIGINT, tmp_path)
    line = _one_interrupted_line(err)
    assert rc == 0, err[-2000:]  # documented: saved on every rank (torchrun must not restart)
    step = ckpt.find_latest_valid(out)[1]["step"]
    assert f"stopped by SIGINT after step {step} of 100000" in line and "--resume auto" in line
    assert not (out / "summary.json").exists()  # a cut-short run is not summarised as finished


def test_ctrl_c_on_prepare_stops_workers_quietly_and_a_rerun_finishes(tmp_path):
    from data_dali import synthetic

    src = synthetic.write_dataset(tmp_path / "src", classes=2, per_class=6, seconds=2.0,
                                  width=32, height=24, fps=10)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "data_dali.prepare", str(src), str(out), "--workers", "2"]
    rc, _, err = _signal_when(cmd, lambda e: len(list((out / "records").glob("*.json"))) >= 1,
                              signal.SIGINT, tmp_path)
    line = _one_interrupted_line(err)
    assert rc == 130 and "run the same command again" in line, err[-2000:]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["kept"] == 12
    assert not [p for p in out.rglob(".*.tmp*")]


def test_ctrl_c_on_eval_is_one_line_and_writes_no_results(tmp_path, tiny_run):
    res = tmp_path / "eval"
    rc, out, err = _signal_when(
        [sys.executable, "-m", "cmacc.apps.eval", str(tiny_run), "--protocol", "finetune",
         "--epochs", "100000", "--out", str(res)],
        lambda e: " evaluating " in e, signal.SIGINT, tmp_path)
    line = _one_interrupted_line(err)
    assert rc == 130 and "no results were written" in line, err[-2000:]
    assert not list(res.glob("*")), list(res.glob("*"))


def test_sigterm_stops_the_demo_as_a_whole(tmp_path):
    """The demo is two pretrainings, then probes and a table: a SIGTERM during the first ends
    the demo (exit 143), and no comparison of cut-short runs is printed."""
    out = tmp_path / "demo"
    rc, stdout, err = _signal_when(
        [sys.executable, "-m", "cmacc.apps.demo", "--data", "toy", "--steps", "100000",
         "--out", str(out)], lambda e: (out / "xmoco" / "metrics.csv").exists(),
        signal.SIGTERM, tmp_path)
    line = _one_interrupted_line(err)
    assert rc == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by SIGTERM" in line and "of 100000" in line
    assert "CM-ACC (active)" not in stdout and "| method" not in stdout, stdout
    assert not (out / "cmacc" / "metrics.csv").exists()  # the second run never started
    assert not (out / "xmoco" / "summary.json").exists()


def test_the_same_eval_twice_gives_the_same_figures(tmp_path, tiny_run, capsys):
    from cmacc.apps import eval as ev

    figures = []
    for k in range(2):
        ev.main([str(tiny_run), "--protocol", "finetune", "--epochs", "1", "--batch-size", "32",
                 "--out", str(tmp_path / str(k))])
        res = json.loads((tmp_path / str(k) / "eval_video_finetune_synthetic.json").read_text())
        figures.append([s["top1"] for s in res["splits"]])
    capsys.readouterr()
    assert figures[0] == figures[1]
