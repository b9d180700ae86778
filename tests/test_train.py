"""train.py end to end on CPU (tiny preset, synthetic clips): learning, resume, bad flags."""

import csv
import json
import shutil

import pytest
import torch

import train
from cmacc import checkpoint as ckpt

TINY = ["--preset", "tiny", "--clips", "96", "--classes", "6", "--log-every", "5"]
FAST = ["--preset", "tiny", "--clips", "24", "--classes", "4", "--batch-size", "4", "--dict-size",
        "8", "--pool-size", "16", "--log-every", "1"]  # a second or two a run


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
    # in line the selection ran alone: its time alone (the SM time it takes) is t_select
    assert all(r["t_select_alone"] == r["t_select"] for r in rows)
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


def test_a_pool_refresh_run_resumes_as_if_uninterrupted(tmp_path):
    """--pool-refresh: the round-robin position travels in the checkpoint (the pools' state),
    so a run stopped and resumed re-encodes the same slots and ends with the same weights,
    dictionaries and pools as one that never stopped."""
    a, b = tmp_path / "a", tmp_path / "b"
    extra = FAST + ["--sampler", "pool-random", "--pool-refresh", "1"]
    train.main(extra + ["--steps", "9", "--out", str(a)])
    train.main(extra + ["--steps", "6", "--out", str(b)])
    train.main(extra + ["--steps", "9", "--out", str(b), "--resume", "auto"])
    sa = ckpt.load(a / "ckpt_00000009.pt")["model"]
    sb = ckpt.load(b / "ckpt_00000009.pt")["model"]
    assert sa["pool_v._extra_state"]["refresh"] == sb["pool_v._extra_state"]["refresh"] != 0
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)


def test_the_pool_refresh_has_its_own_time_in_the_log_and_metrics(tmp_path, capsys):
    """Issue 51: --pool-refresh made a step ~10x slower and the log filed it all under "step";
    the refresh's own time (``refresh_pools``, within t_step) is a column of metrics.csv's
    own, t_refresh (seconds per step, as the other t_ columns), and the log line shows it in ms."""
    out = tmp_path / "run"
    train.main(FAST + ["--sampler", "pool-random", "--pool-refresh", "2", "--steps", "6",
                       "--out", str(out)])
    err = capsys.readouterr().err
    rows = _rows(out)  # one a step (--log-every 1); the pool is full, and refreshed, from step 4
    assert list(rows[0])[-2:] == ["t_refresh", "t_select_alone"]  # older columns first
    assert [float(r["t_refresh"]) > 0 for r in rows] == [False] * 3 + [True] * 3, rows
    assert all(float(r["t_refresh"]) <= float(r["t_step"]) for r in rows)
    lines = [line for line in err.splitlines() if "(of it refresh " in line]
    assert len(lines) == len(rows), err
    shown = float(lines[-1].split("(of it refresh ")[1].split(" ms")[0])
    assert shown == pytest.approx(1e3 * float(rows[-1]["t_refresh"]), abs=0.06)


def test_a_metrics_csv_without_t_refresh_resumes_and_plots(tmp_path):
    """A metrics.csv of a version before t_refresh (no such column) resumes: the rows past the
    checkpoint are cut (truncate_rows), the header gains the column at its end, the old rows
    keep their values with t_refresh empty; the summary and cmacc-plot read it."""
    from cmacc.apps import plot

    out = tmp_path / "run"
    train.main(FAST + ["--steps", "3", "--ckpt-every", "2", "--out", str(out)])
    (out / "ckpt_00000003.pt").unlink()  # resume from step 2: row 3 is cut
    rows = _rows(out)
    old = [k for k in rows[0] if k != "t_refresh"]
    with open(out / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=old, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    train.main(FAST + ["--steps", "4", "--out", str(out)])
    after = _rows(out)
    assert [r["step"] for r in after] == ["1", "2", "3", "4"]
    assert list(after[0])[-2:] == ["t_refresh", "t_select_alone"]
    assert [r["t_refresh"] for r in after[:2]] == ["", ""] and float(after[-1]["t_refresh"]) == 0
    assert [r["loss"] for r in after[:2]] == [r["loss"] for r in rows[:2]]
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    assert plot.main([str(out), "--keys", "t_step", "t_refresh", "--out",
                      str(tmp_path / "curves.png")]) == 0


def test_pool_refresh_reads_the_clips_the_loader_reads(tiny_prepared):
    """What the pool refresh re-encodes of a prepared dataset is each clip as the training
    loader gives it in the same epoch (the same augmentation draw): checked against a batch of
    the reference loader itself."""
    from cmacc.config import DataConfig
    from cmacc.data import clip_fetcher, train_loader

    dcfg = DataConfig(source=str(tiny_prepared[1] / "manifest.csv"), frames=4, size=16,
                      loader="reference", workers=0)
    loader = train_loader(dcfg, batch_size=4, seed=3)
    loader.set_epoch(2)
    batch = next(iter(loader))
    video, audio = clip_fetcher(loader, "cpu")(batch["index"])
    assert torch.equal(video, batch["video"]) and torch.equal(audio, batch["audio"])


def test_a_compiled_run_resumes_uncompiled_and_evaluates(tmp_path):
    """--compile (CPU inductor here) compiles the backbones in place: the checkpoint's keys are
    the uncompiled model's, so the run resumes without --compile (and the reverse) and
    cmacc.apps.eval reads it. (One residual stage a backbone: inductor's C++ build is per
    kernel, 16 here against 47 at the tiny preset's four; the stem, a residual block with its
    batch norms, forward and backward, compile and load as at any depth.)"""
    from cmacc.apps import eval as ev

    out = tmp_path / "run"
    small = ["--preset", "tiny", "--clips", "48", "--classes", "4", "--log-every", "1",
             "--video-layers", "1", "--audio-layers", "1"]
    train.main(small + ["--steps", "2", "--compile", "--out", str(out)])
    plain = ckpt.load(out / "ckpt_00000002.pt")["model"]
    assert not [k for k in plain if "_orig_mod" in k]
    train.main(small + ["--steps", "3", "--out", str(out), "--resume", "auto"])
    train.main(small + ["--steps", "4", "--compile", "--out", str(out), "--resume", "auto"])
    assert ckpt.load(out / "ckpt_00000004.pt")["model"].keys() == plain.keys()
    assert ev.main([str(out), "--modality", "audio"]) == 0


def test_a_run_continues_only_on_the_synthetic_clips_it_trained_on(tmp_path, capsys):
    """Other synthetic clips (--clips 32 after 24) are other data: the resume is refused in
    one line naming both, before any work; the checkpoint stays as it was."""
    out = tmp_path / "run"
    train.main(FAST + ["--steps", "2", "--out", str(out)])
    before = (out / "ckpt_00000002.pt").read_bytes()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(FAST + ["--clips", "32", "--steps", "3", "--out", str(out)])
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert e.value.code == 2 and "Traceback" not in err and line.startswith("error: --data")
    assert "--clips 32" in line and "--clips 24" in line and "ckpt_00000002.pt" in line
    assert (out / "ckpt_00000002.pt").read_bytes() == before
    assert not (out / "ckpt_00000003.pt").exists()


def test_a_run_goes_on_with_its_manifest_moved_and_records_the_new_path(tiny_prepared, tmp_path,
                                                                        capsys):
    """Issue 51: a resume from the byte-identical manifest at another path (the dataset folder
    moved) was refused with the same SHA-256 printed twice; it goes on, one log line names
    both paths, and the checkpoints written from then on record the new path."""
    small = ["--preset", "tiny", "--batch-size", "4", "--dict-size", "8", "--pool-size", "16",
             "--log-every", "1", "--loader", "reference", "--workers", "0"]
    old, new, out = tmp_path / "old", tmp_path / "new", tmp_path / "run"
    shutil.copytree(tiny_prepared[1], old)
    train.main(small + ["--data", str(old / "manifest.csv"), "--steps", "1", "--out", str(out)])
    shutil.move(old, new)
    capsys.readouterr()
    train.main(small + ["--data", str(new / "manifest.csv"), "--steps", "2", "--out", str(out)])
    err = capsys.readouterr().err
    was, now = str((tmp_path / "old" / "manifest.csv").resolve()), str((new / "manifest.csv").resolve())
    moved = [line for line in err.splitlines() if "the manifest has moved" in line]
    assert len(moved) == 1 and was in moved[0] and now in moved[0], err
    assert "resumed run" in err
    state = ckpt.load(out / "ckpt_00000002.pt")
    assert state["step"] == 2 and state["data"]["source"] == now
    assert state["config"]["data"]["source"] == now


def test_a_resume_with_another_config_names_each_field_and_both_values(tmp_path, capsys):
    """Issue 51: a resume after changing --sampler and --dict-size said only "a different
    model/selection config"; the line names each field that counts in the config hash, the
    checkpoint's value and the new one, and the flags that resume the run."""
    out = tmp_path / "run"
    train.main(FAST + ["--steps", "2", "--out", str(out)])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(FAST + ["--sampler", "random", "--dict-size", "12", "--steps", "3",
                           "--out", str(out)])
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert e.value.code == 2 and "Traceback" not in err and line.startswith("error: checkpoint")
    assert "--dict-size 8 in the checkpoint, --dict-size 12 now" in line, line
    assert "--sampler active in the checkpoint, --sampler random now" in line, line
    assert "resume it with --dict-size 8 --sampler active" in line, line
    assert "--pool-size" not in line and "--seed" not in line  # only what differs


def test_the_config_fields_are_named_by_their_flags():
    """cmacc.config.as_flag (the refusal above) names each model/selection field as train.py's
    flag; a field without one as name=value."""
    import dataclasses

    from cmacc.config import ModelConfig, SelectionConfig, as_flag

    for c in (ModelConfig, SelectionConfig):
        for f in dataclasses.fields(c):
            flag = as_flag(f.name, "x").split(" ")[0]
            if f.name == "fcl":
                assert as_flag("fcl", False) == "--no-fcl" and as_flag("fcl", True) == "--fcl"
            elif flag.startswith("--"):
                assert train.FIELD_FLAGS.get(f.name) == flag, f.name
            else:
                assert f.name not in train.FIELD_FLAGS, f.name


@pytest.mark.parametrize("steps", [3, 6])
def test_a_run_says_when_its_sampler_selects_and_records_the_steps_that_did(tmp_path, capsys,
                                                                            steps):
    """FAST: M = 4, K = 8, N = 16, 24 clips. The rolling pool holds K + M = 12 keys after 3
    steps, so CM-ACC selects from step 4: a 3-step run is warned at its start that it never
    selects; summary.json counts the steps that selected, as metrics.csv's per-step `active`
    flags show them. A dictionary larger than the dataset is warned too."""
    out = tmp_path / "run"
    train.main(FAST + ["--steps", str(steps), "--sampler", "active", "--out", str(out)])
    err = capsys.readouterr().err
    active = [float(r["active"]) for r in _rows(out)]  # one row a step (--log-every 1)
    summary = json.loads((out / "summary.json").read_text())
    assert len(active) == steps and summary["selected_steps"] == sum(active)
    assert ("never selects" in err) == (sum(active) == 0) == (steps == 3), err
    assert "larger than the dataset" not in err
    if steps == 3:
        train.main(FAST + ["--steps", "1", "--dict-size", "32", "--pool-size", "40", "--out", str(tmp_path / "k")])
        assert "--dict-size 32 is larger than the dataset (24 clips)" in capsys.readouterr().err


def test_corrupt_latest_checkpoint_is_skipped(tmp_path, tiny_run):
    out = tmp_path / "run"
    shutil.copytree(tiny_run, out)  # (a 6-step run)
    (out / "ckpt_00000009.pt").write_bytes(b"not a checkpoint")
    path, state = ckpt.find_latest_valid(out)
    assert path.name == "ckpt_00000006.pt" and state["step"] == 6


def test_a_second_run_on_a_folder_in_use_is_refused_and_a_run_lets_go_when_it_ends(tmp_path,
                                                                                  capsys):
    """One run per --out: while another process holds the folder (here this test, through the
    same lock; flock conflicts between two opens even in one process), train.py stops in one
    line naming the holder, before writing anything; once the holder lets go the run trains,
    and a finished run leaves the folder free (the lock file says who held it last)."""
    import os

    from data_dali.fileio import LOCK_NAME, hold_folder

    out = tmp_path / "run"
    out.mkdir()
    held = hold_folder(out)
    with pytest.raises(SystemExit) as e:
        train.main(TINY + ["--steps", "2", "--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is in use by another run (pid " in err, err
    assert f"pid {os.getpid()} on " in err and "pass another --out" in err
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing read or written
    held.close()
    train.main(TINY + ["--steps", "2", "--out", str(out)])
    assert (out / "ckpt_00000002.pt").is_file()
    hold_folder(out).close()  # free again: the run let go of it


def test_a_refused_run_removes_the_folders_it_made_and_only_those(tmp_path, capsys):
    """--data that is no manifest is refused after --out was made and locked: the folders the
    command created go again (lock file and all); a folder that was there before stays."""
    kept = tmp_path / "kept"
    kept.mkdir()
    for out in (tmp_path / "new" / "run", kept / "run"):
        with pytest.raises(SystemExit) as e:
            train.main(TINY + ["--steps", "2", "--data", str(tmp_path / "none.csv"),
                               "--out", str(out)])
        assert e.value.code == 2 and "no manifest" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
    assert list(kept.iterdir()) == []


@pytest.mark.parametrize("argv,msg", [
    (["--sampler", "nope"], "invalid choice"),
    (["--dict-size", "4"], "--dict-size K=4 must be >= --batch-size M=16"),
    (["--batch-size", "0"], "error: --batch-size must be >= 1"),  # flags, not config fields
    (["--steps", "0"], "steps must be"),
    (["--objective", "smoco", "--sampler", "active"], "random sampling"),
    (["--class-dist", "zipf:-1"], "--class-dist (class_dist) 'zipf:-1': expected 'uniform' or"),
    (["--video-width", "64"], "set --audio-width 64, or --no-fcl"),  # before any data is read
    (["--steps", "4", "--warmup", "80"], "--warmup 80 is longer than the run (--steps 4): the "
     "learning rate would reach only 5.0% of --lr 0.001 by its end; pass --warmup 4 or fewer"),
    (["--preset", "paper", "--steps", "4"], "--warmup 500 (the paper preset's) is longer than the "
     "run (--steps 4): the learning rate would reach only 0.8% of --lr 0.001 by its end"),
    (["--device", "cuda", "--batch-size", "8192", "--dict-size", "8192", "--pool-size", "16384"],
     "batch_size M=8192: on cuda the active sampler's Triton kernels take at most 4096"),
])
def test_bad_flags_are_clear_errors(tmp_path, capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        train.main(TINY + argv + ["--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1, err


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


def _record_copies(monkeypatch):
    """Tensor.pin_memory / is_pinned / to replaced by recorders (no CUDA here): pin_memory
    returns a marked copy, ``to`` records (target, non_blocking, source pinned) and stays put."""
    pinned, calls = [], []

    def pin_memory(self, *args):
        t = self.clone()
        pinned.append(t)
        calls.append("pin")
        return t

    def is_pinned(self, *args):
        return any(self is t for t in pinned)

    def to(self, *args, **kwargs):
        calls.append((str(args[0]), kwargs.get("non_blocking", False), is_pinned(self)))
        return self

    for name, fn in (("pin_memory", pin_memory), ("is_pinned", is_pinned), ("to", to)):
        monkeypatch.setattr(torch.Tensor, name, fn)
    return pinned, calls


def test_host_batches_are_pinned_and_copied_without_blocking_to_cuda(monkeypatch):
    from cmacc.prefetch import to_device

    batch = {"video": torch.zeros(2, 3), "audio": torch.zeros(2, 4), "index": torch.arange(2),
             "name": ["a", "b"]}
    pinned, calls = _record_copies(monkeypatch)
    got = to_device(batch, torch.device("cuda"))
    monkeypatch.undo()
    assert calls == ["pin", ("cuda", True, True)] * 3  # every tensor pinned, then non-blocking
    assert got["name"] == ["a", "b"] and all(got[k] is t for k, t in zip(batch, pinned))
    pinned, calls = _record_copies(monkeypatch)
    pinned.append(batch["audio"])  # pinned by the loader already: not pinned again
    to_device(batch, torch.device("cuda:1"))
    assert calls == ["pin", ("cuda:1", True, True), ("cuda:1", True, True), "pin",
                     ("cuda:1", True, True)]
    calls.clear()
    to_device(batch, torch.device("cpu"))  # the CPU: as it was
    assert calls == [("cpu", False, False), ("cpu", False, True), ("cpu", False, False)]


def test_the_trainer_readies_every_batch_through_the_prefetcher(tmp_path, monkeypatch):
    """The training batches are readied by the background prefetcher (cmacc/prefetch.py), the
    dictionaries' clips go through to_device."""
    from cmacc import fill, prefetch

    seen = []
    real_ready, real_to_device = prefetch.Prefetcher._ready, fill.to_device

    def ready(self, batch):
        seen.append(("prefetch", sorted(batch)))
        return real_ready(self, batch)

    def to_device(batch, device):
        seen.append(("to_device", sorted(batch)))
        return real_to_device(batch, device)

    monkeypatch.setattr(prefetch.Prefetcher, "_ready", ready)
    monkeypatch.setattr(fill, "to_device", to_device)
    train.main(TINY + ["--steps", "2", "--out", str(tmp_path / "run")])
    assert seen.count(("prefetch", ["audio", "index", "label", "video"])) >= 2, seen
    assert ("to_device", ["audio", "index", "video"]) in seen, seen


@pytest.mark.parametrize("env,device,sampler,m,refused", [
    ("auto", "cuda", "active", 4097, True),
    ("auto", "cuda", "ohem", 8192, True),  # every sampler but random embeds (grad_norms)
    ("triton", "cpu", "active-feature", 4097, True),
    ("auto", "cuda", "active", 4096, False),  # above 256: the tiled embedding
    ("auto", "cuda", "active", 512, False),
    ("auto", "cuda", "random", 8192, False),
    ("auto", "cpu", "active", 8192, False),  # the PyTorch reference: no limit
    ("reference", "cuda", "active", 8192, False),
])
def test_a_batch_the_selection_kernels_cannot_take_is_refused_at_start(monkeypatch, env, device,
                                                                       sampler, m, refused):
    """The Triton selection serves global batches M up to 4,096 (one softmax tile up to 256,
    chunks above: tests/test_grad_embed.py, test_select_plan.py); the CPU reference has no
    limit. A run refuses what its kernels cannot take before it starts, not at the first active
    step; the limit is the kernel's own (check_m)."""
    from cmacc.config import PRESETS
    from cmacc.trainer import Trainer, UsageError
    from kernels import triton_grad_embed as ge

    monkeypatch.setenv("CMACC_KERNELS", env)
    cfg = PRESETS["tiny"].replace(model=dict(batch_size=m, dict_size=2 * m),
                                  selection=dict(sampler=sampler, pool_size=4 * m),
                                  run=dict(device=device))
    if not refused:
        Trainer(cfg)
        return
    with pytest.raises(UsageError) as e:
        Trainer(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "at most 4096" in msg and "CMACC_KERNELS=reference" in msg, msg
    with pytest.raises(ValueError, match=r"\[1, 4096\]"):  # what the kernel itself would say
        ge.check_m(m)


def test_blocks_per_stage_give_a_torchvision_sized_encoder_at_any_preset(tmp_path):
    """--video-layers (or its --config key) with --video-width 64: the tiny preset's backbone
    is torchvision's r3d_18, whose own model loads its weights strictly."""
    import torchvision

    from cmacc.encoders import export_video
    from cmacc.model import CMACC

    flags = ["--preset", "tiny", "--video-width", "64", "--audio-width", "64", "--audio-layers",
             "2", "2", "2", "2"]
    cfg = train.config_from_args(train.build_parser().parse_args(
        flags + ["--video-layers", "2", "2", "2", "2"]))
    assert cfg.model.video_layers == (2, 2, 2, 2) and cfg.model.audio_layers == (2, 2, 2, 2)
    tv = torchvision.models.video.r3d_18()
    tv.fc = torch.nn.Identity()
    tv.load_state_dict(export_video(CMACC(cfg.model, cfg.selection).f_v.backbone), strict=True)

    (tmp_path / "c.json").write_text(json.dumps({"video_layers": [1, 2, 1, 1]}))
    parser = train.build_parser()
    args = train.apply_config_file(parser, parser.parse_args(["--config", str(tmp_path / "c.json")]),
                                   ["--config", str(tmp_path / "c.json")])
    assert train.config_from_args(args).model.video_layers == (1, 2, 1, 1)


def test_log_lines_carry_the_total_and_an_eta(tmp_path, capsys):
    train.main(FAST + ["--steps", "2", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert "step      1/2 (50%, eta " in err
    assert "step      2/2 (100%, eta 0s) | loss " in err


def test_steps_below_the_runs_step_say_that_nothing_was_trained(tmp_path, capsys):
    small = FAST + ["--out", str(tmp_path / "run")]
    train.main(small + ["--steps", "2"])
    capsys.readouterr()
    assert train.main(small + ["--steps", "1"]) == 0
    err = capsys.readouterr().err
    assert (f"the run in {tmp_path / 'run'} is already at step 2, past --steps 1: nothing was "
            "trained") in err
    assert sorted(p.name for p in (tmp_path / "run").glob("ckpt_*.pt")) == ["ckpt_00000002.pt"]


def test_cudnn_autotuning_is_on_for_cuda_runs_and_a_flag_turns_it_off(monkeypatch):
    from cmacc.devices import autotune_convolutions

    parser = train.build_parser()
    assert train.config_from_args(parser.parse_args(TINY)).optim.cudnn_benchmark is True
    off = train.config_from_args(parser.parse_args(TINY + ["--no-cudnn-benchmark"]))
    assert off.optim.cudnn_benchmark is False
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    autotune_convolutions("cpu", True)  # other devices: untouched
    assert torch.backends.cudnn.benchmark is False
    autotune_convolutions(torch.device("cuda", 0), True)
    assert torch.backends.cudnn.benchmark is True
    autotune_convolutions("cuda", off.optim.cudnn_benchmark)
    assert torch.backends.cudnn.benchmark is False
