"""Every configuration that ``Config`` accepts trains: a deterministic sample over the presets,
widths, stages and blocks, samplers, objectives (views), architectures and clip shapes, each
trained one step in-process on tiny synthetic clips. (A deep encoder on a small clip has a
1x1x1 last map, where a train-mode BatchNorm on one clip refuses to run: the FLOP count used to
do that at step 1.)"""

import random
from pathlib import Path

import pytest

from cmacc.config import GRAD_VIEWS, POOL_MODES, PRESETS, SAMPLERS, VIDEO_ARCHS
from cmacc.trainer import Trainer

CASES = 12


def _sample(rng: random.Random, i: int) -> dict:
    """One candidate configuration: the cyclic fields make the sample cover every sampler and
    stage count; the rest is drawn."""
    objective, sampler = (("smoco", "random") if i % 6 == 5
                          else ("cross", SAMPLERS[i % len(SAMPLERS)]))
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
                       pool_mode=rng.choice(POOL_MODES), pool_size=k + m + rng.choice((0, 3)),
                       pool_refresh=rng.choice((0, 0, 1))),
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


@pytest.mark.parametrize("built,smi,says", [
    ("13.0", "535.104.05\n535.104.05\n", "built for CUDA 13.0, which needs an NVIDIA driver >= "
     "580.65.06; found: driver 535.104.05; install for your driver"),
    ("12.8", None, "built for CUDA 12.8, which needs an NVIDIA driver >= 570.26; found: no "
     "nvidia-smi on PATH"),
    (None, None, "is a CPU-only build; found: no nvidia-smi"),
])
def test_a_gpu_run_without_usable_cuda_names_the_driver_needed_and_found(
        tmp_path, monkeypatch, capsys, built, smi, says):
    """torch's CUDA query simulated: a driver older than the wheels' CUDA (an H100 on R535 with
    the cu130 pins) is one line naming both, exit 2."""
    import subprocess

    import train

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("torch.version.cuda", built)
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/nvidia-smi" if smi else None)
    monkeypatch.setattr("subprocess.run", lambda *a, **k: subprocess.CompletedProcess(
        a[0], 0, stdout=smi, stderr=""))
    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "tiny", "--device", "cuda", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and says in err[0], err


ROOT = Path(__file__).resolve().parents[1]


def _pins(name):
    lines = (ROOT / name).read_text().splitlines()
    return dict(line.split("==") for line in lines if "==" in line and not line.startswith("#"))


@pytest.mark.parametrize("name,cuda", [("requirements.txt", "130"), ("requirements-cu12.txt", "120")])
def test_each_install_option_pins_one_consistent_set(name, cuda):
    """torchvision 0.N+15 goes with torch 2.N (torchvision's release rule), DALI's wheel is
    for the option's CUDA, and both options share every other requirement."""
    pins = _pins(name)
    minor = int(pins["torch"].split(".")[1])
    assert pins["torchvision"].startswith(f"0.{minor + 15}.")
    assert set(pins) == {"torch", "torchvision", "torchaudio", f"nvidia-dali-cuda{cuda}"}
    assert "-r requirements-common.txt" in (ROOT / name).read_text()


def _make_sandbox(tmp_path, stamp=None):
    """The Makefile and the files its install depends on in a folder of their own, with a stand-in
    .venv whose install stamp says which CUDA set it holds (newer than the requirements)."""
    import os
    import shutil

    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in ("Makefile", "requirements.txt", "requirements-cu12.txt",
                 "requirements-common.txt", "setup.py"):
        shutil.copy(ROOT / name, tmp_path / name)
        os.utime(tmp_path / name, (1e9, 1e9))  # older than any stamp
    if stamp:
        (tmp_path / ".venv" / "bin").mkdir(parents=True)
        py = tmp_path / ".venv" / "bin" / "python"
        py.write_text("#!/bin/sh\nexit 0\n")
        py.chmod(0o755)
        (tmp_path / ".venv" / stamp).touch()
    return tmp_path


def _make(cwd, *args):
    import subprocess

    p = subprocess.run(["make", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout + p.stderr


def test_the_cuda_set_installed_is_kept_by_every_later_make_target(tmp_path):
    """`make install CUDA=12`, then `make test` / `make demo` / `make gpu-check`: the CUDA 12 set
    is kept, nothing is installed over it (the targets run with it); another CUDA= recreates
    .venv instead of installing the other torch and DALI into it; a new clone installs CUDA 13."""
    box = _make_sandbox(tmp_path, stamp=".installed-cuda12")
    for target in ("test", "demo", "gpu-check"):
        code, out = _make(box, "-n", target)
        assert code == 0 and "pip install" not in out and "-m venv" not in out, (target, out)
    code, out = _make(box, "-n", "install", "CUDA=13")
    assert "-r requirements.txt" in out and "recreating" in out, out
    code, out = _make(box, "install", "CUDA=13", "PYTHON=false")  # runs the switch, then stops
    assert "holds the CUDA 12 set; CUDA=13 asked: recreating .venv" in out, out
    assert code != 0 and not (box / ".venv").exists()
    fresh = _make_sandbox(tmp_path / "fresh")
    code, out = _make(fresh, "-n", "install")
    assert code == 0 and "-r requirements.txt" in out and "requirements-cu12" not in out, out


def test_a_machine_whose_cuda_is_unusable_says_so_before_it_trains_on_the_cpu(
        tmp_path, monkeypatch, capsys):
    """Without --device: a CUDA build of torch on a machine with a driver it cannot use trains on
    the CPU and says so in one line naming the driver needed and found; --device cpu, or a
    machine without a driver, says nothing."""
    import subprocess

    import train

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("torch.version.cuda", "13.0")
    monkeypatch.setattr("subprocess.run", lambda *a, **k: subprocess.CompletedProcess(
        a[0], 0, stdout="535.104.05\n", stderr=""))
    tiny = ["--preset", "tiny", "--clips", "32", "--steps", "1"]
    for smi, extra, says in ((True, [], True), (True, ["--device", "cpu"], False),
                             (False, [], False)):
        monkeypatch.setattr("shutil.which", lambda name, smi=smi: "/usr/bin/nvidia-smi" if smi
                            else None)
        out = tmp_path / f"run{len(capsys.readouterr().err)}{smi}{len(extra)}"
        train.main(tiny + extra + ["--out", str(out)])
        lines = [l for l in capsys.readouterr().err.splitlines() if "CUDA is not usable" in l]
        assert len(lines) == (1 if says else 0), lines
        if says:
            assert ">= 580.65.06" in lines[0] and "driver 535.104.05" in lines[0], lines
