"""torchrun with 2 CPU ranks (gloo): DDP gradients equal the single-process gradient of the
same global batch, ranks stay in lock-step (selected indices, dictionaries, weights), a
diverged rank is caught; train.py runs under torchrun; SIGTERM saves and exits cleanly."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cmacc import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(cmd, timeout=240):
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    _run(TORCHRUN + [str(ROOT / "tests" / "dist_worker.py"), str(out)])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.serial
def test_ddp_gradient_equals_single_process(worker):
    for res in worker:
        assert res["grad_err"] < 1e-5
        assert res["dict_ok"]  # the gathered global batch keys, in rank order


@pytest.mark.serial
def test_ranks_stay_in_lock_step(worker):
    r0, r1 = worker
    assert len(r0["selected"]) >= 5  # active steps happened
    assert r0["selected"] == r1["selected"]
    assert r0["dict_v"] == r1["dict_v"] and r0["dict_a"] == r1["dict_a"]
    assert r0["wsum"] == r1["wsum"]


@pytest.mark.serial
def test_diverged_rank_is_caught(worker):
    for res in worker:
        assert "rank 1 differs from rank 0 in dictionary keys" in res["caught"]


@pytest.mark.serial
def test_torchrun_train_tiny(tmp_path):
    """(With the pool refresh: each rank re-encodes its share of the pool's slots and gathers
    the rest; the ranks' fingerprints, compared at every log line, hold the dictionaries that
    the refreshed pools feed.)"""
    out = tmp_path / "run"
    p = _run(TORCHRUN + ["train.py", "--preset", "tiny", "--clips", "96", "--classes", "6",
                         "--steps", "12", "--log-every", "4", "--sampler", "active",
                         "--pool-refresh", "1", "--out", str(out)])
    state = ckpt.load(out / "ckpt_00000012.pt")
    assert state["step"] == 12
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3  # 3 log intervals, written by rank 0 only
    assert "FutureWarning" not in p.stderr and "DeprecationWarning" not in p.stderr, p.stderr[-2000:]
    # the step's wait for the selection never exceeds the selection's time
    assert any(float(r["active"]) > 0 and float(r["t_select"]) > 0 for r in rows), rows
    assert all(0 <= float(r["t_select_visible"]) <= float(r["t_select"]) for r in rows), rows


@pytest.mark.serial
def test_batch_must_divide_over_ranks(tmp_path):
    p = subprocess.run(TORCHRUN + ["train.py", "--preset", "tiny", "--batch-size", "15",
                                   "--steps", "2", "--out", str(tmp_path)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "does not divide over 2 ranks" in p.stderr


def _terminate_once_training(cmd, out, ctrl_c=False, **popen):
    """Start ``cmd``, SIGTERM it once its first metrics row is written (metrics.csv starts
    with its header before the first step; ``ctrl_c``: SIGINT to its whole process group, as
    a terminal's Ctrl-C does); (returncode, stderr)."""
    p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=ctrl_c, **popen)
    metrics, deadline = out / "metrics.csv", time.time() + 120
    while time.time() < deadline and not (metrics.exists() and
                                          len(metrics.read_text().splitlines()) > 1):
        assert p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.2)
    if ctrl_c:
        os.killpg(p.pid, signal.SIGINT)
    else:
        p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    found = ckpt.find_latest_valid(out)
    assert found is not None and 0 < found[1]["step"] < 100000, err[-3000:]
    return p.returncode, err


LONG_RUN = ["train.py", "--preset", "tiny", "--steps", "100000", "--log-every", "1", "--out"]


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    rc, err = _terminate_once_training([sys.executable, *LONG_RUN, str(tmp_path / "run")],
                                       tmp_path / "run")
    assert rc == 0, err[-2000:]
    assert "stop signal" in err


@pytest.mark.serial
def test_ctrl_c_on_torchrun_saves_on_every_rank_and_each_names_the_checkpoint(tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group: torchrun and its workers; torchrun's
    agent forwards it too, as it forwards SIGTERM): the ranks agree to stop after the same
    step, rank 0 saves, and each rank says so in one line naming that checkpoint, exit 0.
    torchrun itself then ends as README says: its agent re-raises the signal as a
    SignalException (a traceback of torchrun's own), exit 1."""
    out = tmp_path / "run"
    rc, err = _terminate_once_training(TORCHRUN + [*LONG_RUN, str(out)], out, ctrl_c=True)
    assert "checkpoint (stop signal)" in err, err[-3000:]
    assert "[rank0]" not in err and "[rank1]" not in err, err[-3000:]  # no worker traceback
    path, state = ckpt.find_latest_valid(out)
    said = [ln for ln in err.splitlines() if ln.startswith("interrupted; stopped by SIGINT")]
    assert len(said) == 2, err[-3000:]  # one line per rank, each naming the file on disk
    assert all(f"after step {state['step']} of" in ln and f"checkpoint {path} kept" in ln
               for ln in said), said
    assert rc == 1 and "SignalException: Process" in err and "got signal: 2" in err, err[-3000:]


@pytest.mark.serial
def test_a_failed_save_on_rank_0_stops_every_rank(tmp_path):
    """A full disk on rank 0 must not leave rank 1 waiting in a collective: both stop, exit 2."""
    script = tmp_path / "full_disk.py"
    script.write_text(
        "import os, sys, torch\n"
        "import train\n"
        "def full(*a, **k):\n"
        "    raise OSError(28, 'No space left on device')\n"
        "if os.environ['RANK'] == '0':\n"
        "    torch.save = full\n"
        "sys.exit(train.main(sys.argv[1:]))\n")
    p = subprocess.run(TORCHRUN + [str(script), "--preset", "tiny", "--steps", "2",
                                   "--out", str(tmp_path / "run")],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    # each rank says it in one line, before either exits (an agreed stop: trainer._end_together)
    assert "error: cannot write the checkpoint of step 2" in p.stderr, p.stderr[-3000:]
    assert "error: rank 0 could not write the checkpoint of step 2" in p.stderr, p.stderr[-3000:]
    assert "exitcode  : 2" in p.stderr, p.stderr[-3000:]
    assert "[rank0]" not in p.stderr and "[rank1]" not in p.stderr  # no worker traceback


def _pid_of_local_rank(cmd_marker: str, local_rank: int) -> int | None:
    """The pid of the torchrun worker with LOCAL_RANK=local_rank whose command line holds
    ``cmd_marker`` (read from /proc)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if cmd_marker not in (d / "cmdline").read_bytes().decode(errors="replace"):
                continue
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"LOCAL_RANK={local_rank}".encode() in env:
            return int(d.name)
    return None


@pytest.mark.serial
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc to find a rank")
def test_a_killed_rank_is_restarted_and_the_run_finishes_as_if_uninterrupted(tmp_path):
    """torchrun --max-restarts 1; rank 1 SIGKILLed after the first checkpoint: the new group
    forms, resumes from the newest valid checkpoint and ends at the requested step; metrics.csv
    has each logged step once; the final weights equal an uninterrupted run from that same
    checkpoint. (The active sampler selects from step 6 on, once the pool holds K + M keys: in
    both attempts and in the reference.)"""
    out, ref = tmp_path / "run", tmp_path / "ref"
    args = ["train.py", "--preset", "tiny", "--steps", "20", "--ckpt-every", "10",
            "--log-every", "5", "--sampler", "active", "--out"]
    elastic = TORCHRUN[:-1] + ["--nproc_per_node=2", "--max-restarts", "1"]
    p = subprocess.Popen(elastic + args + [str(out)], cwd=ROOT, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while time.time() < deadline and not (out / "ckpt_00000010.pt").exists():
        time.sleep(0.2)
    victim = _pid_of_local_rank(str(out), 1)
    assert victim is not None, "rank 1 not found"
    os.kill(victim, signal.SIGKILL)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    resumed = [line for line in err.splitlines() if "resumed run" in line]
    assert len(resumed) == 1, err[-3000:]  # the restarted attempt, and only it, resumed
    start = Path(resumed[0].split(" from ")[1].split(" at step")[0])
    final = ckpt.load(out / "ckpt_00000020.pt")
    assert final["step"] == 20
    with open(out / "metrics.csv", newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [5, 10, 15, 20]
    # the same run, uninterrupted from the checkpoint the restart resumed from
    ref.mkdir()
    for name in (start.name, "run.json"):
        (ref / name).write_bytes((out / name).read_bytes())
    _run(TORCHRUN + args + [str(ref)])
    want = ckpt.load(ref / "ckpt_00000020.pt")
    torch.testing.assert_close(final["model"], want["model"], rtol=0, atol=0)
    torch.testing.assert_close(final["optimizer"], want["optimizer"], rtol=0, atol=0)


def test_the_backend_and_each_ranks_gpu_follow_the_flag():
    """--dist-backend auto: NCCL on CUDA, gloo on the CPU; a rank's GPU is its LOCAL_RANK; with
    more ranks on a node than GPUs NCCL is refused in one line naming the fix, and gloo shares the
    GPUs round robin (the prepared GPU session runs 2 ranks on its one GPU so)."""
    from cmacc import distributed as du

    assert du.backend_for("cuda") == "nccl" and du.backend_for("cpu") == "gloo"
    assert du.backend_for("cuda", "gloo") == "gloo"
    with pytest.raises(ValueError, match="needs --device cuda"):
        du.backend_for("cpu", "nccl")
    assert [du.rank_device(r, 8, "nccl") for r in range(8)] == list(range(8))
    assert [du.rank_device(r, 1, "gloo") for r in range(3)] == [0, 0, 0]
    assert [du.rank_device(r, 2, "gloo") for r in range(4)] == [0, 1, 0, 1]
    assert du.rank_device(1, 1, "nccl") == 0  # SLURM's one GPU a task: each sees its own as 0
    with pytest.raises(ValueError, match=r"LOCAL_RANK 2 but 2 GPU\(s\).*--nproc_per_node 2.*"
                                         r"--dist-backend gloo"):
        du.rank_device(2, 2, "nccl")
    with pytest.raises(ValueError, match="no CUDA device"):
        du.rank_device(0, 0, "gloo")
    import train

    parse = train.build_parser().parse_args
    assert train.config_from_args(parse(["--dist-backend", "gloo"])).run.dist_backend == "gloo"
    assert train.config_from_args(parse([])).run.dist_backend == "auto"
