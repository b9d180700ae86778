"""bench/gpu_session.py off a GPU: its --dry-run runs every part on the CPU at tiny sizes and
writes one JSON line per part, in order, with the keys the GPU session writes (the env line
first, the end line last); a part whose process dies costs only its own line, which names how it
ended and the command that reruns it alone. (The figures themselves are taken on a GPU.)"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import gpu_session as gs  # noqa: E402
from bench import session_common as sc  # noqa: E402
from bench import session_parts as sp  # noqa: E402

NCU_CSV = "\n".join([
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
    '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"',
    '"0","1","python3","h","_grad_embed_kernel","1","7","(128, 1, 1)","(300, 1, 1)","0","9.0",'
    '"GPU Speed Of Light Throughput","Duration","us","12.35"',
    '"0","1","python3","h","_grad_embed_kernel","1","7","(128, 1, 1)","(300, 1, 1)","0","9.0",'
    '"Launch Statistics","Registers Per Thread","register/thread","96"',
    '"1","1","python3","h","_kmeanspp_step_kernel","1","7","(128, 1, 1)","(300, 1, 1)","0","9.0",'
    '"GPU Speed Of Light Throughput","Duration","us","4.10"',
])

# a stand-in for Nsight Compute: runs the profiled command, writes a report and its CSV
FAKE_NCU = f'''#!{sys.executable}
import subprocess, sys
argv = sys.argv[1:]
if "--import" in argv:
    print({NCU_CSV!r})
    sys.exit(0)
app = next(i for i, a in enumerate(argv) if a.endswith("gpu_session.py")) - 1
rc = subprocess.run(argv[app:]).returncode
open(argv[argv.index("-o") + 1] + ".ncu-rep", "w").write("report")
sys.exit(rc)
'''


def _session(tmp_path, *extra, path_dirs=()):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    env["OMP_NUM_THREADS"] = "1"
    env["PATH"] = os.pathsep.join([*map(str, path_dirs), env.get("PATH", "")])
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_session.py"), "--dry-run",
                        "--out", str(out), *extra], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    lines = [json.loads(ln) for ln in (out / gs.LINES).read_text().splitlines()]
    return p, out, lines


def _keys(line):
    status = line["status"]
    body = {"ok": gs.spec(line["part"]).keys, "skipped": gs.SKIPPED, "failed": gs.FAILED}[status]
    return list(gs.HEAD) + list(body)


def test_the_dry_run_writes_one_line_per_part_with_its_keys_in_order(tmp_path):
    p, out, lines = _session(tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert [ln["part"] for ln in lines] == ["env", *gs.PARTS, "end"]
    for line in lines[:-1]:
        assert list(line) == _keys(line), line["part"]
    assert list(lines[-1]) == list(gs.HEAD) + list(gs.END)
    by = {ln["part"]: ln for ln in lines}
    assert by["env"]["status"] == "ok" and by["env"]["dry_run"] is True
    for name in ("pairs", "layers", "bn", "profile", "convs", "loader", "compile", "select",
                 "dist"):
        assert by[name]["status"] == "ok", by[name]
    assert by["dali"]["status"] == "skipped" and "dry run" in by["dali"]["why"]
    assert by["ncu"]["status"] == "skipped" or by["ncu"]["status"] == "ok"  # ncu on PATH or not
    pairs = by["pairs"]
    assert [r["sampler"] for r in pairs["runs"]] == ["random", "active"] * 3  # alternating
    assert len(pairs["step_ratio"]) == 3 and pairs["step_ratio_ci95"] is not None
    assert all(r["active"] == 1.0 for r in pairs["runs"][1::2])  # active selected every step
    assert all(r["active"] == 0.0 for r in pairs["runs"][0::2])
    lay = by["layers"]  # fast forms, fast stem only, declared layers, triton batch norm
    assert [r["forms"] for r in lay["runs"]] == ["fast", "stem", "off", "triton"] * sp.LAYER_PAIRS
    assert len(lay["speedup"]) == sp.LAYER_PAIRS and (lay["stem"], lay["bn"]) == ("fold", "flat")
    assert lay["speedup"][0] == lay["runs"][2]["step_ms"] / lay["runs"][0]["step_ms"]
    assert lay["bn_speedup"][1] == lay["runs"][5]["step_ms"] / lay["runs"][4]["step_ms"]
    assert lay["triton_speedup"][1] == lay["runs"][4]["step_ms"] / lay["runs"][7]["step_ms"]
    bn = by["bn"]  # each BatchNorm3d shape alone, three forms
    assert bn["shapes"] and all(f"{f}_fwd_bwd_ms" in r for r in bn["shapes"] for f in bn["forms"])
    assert sum(len(r["names"]) for r in bn["shapes"]) == _batch_norms(sp.sizes(_DRY).preset)
    assert all(r["triton_y_diff"] < 1e-5 and r["triton_dx_diff"] < 1e-5 for r in bn["shapes"])
    prof = by["profile"]
    assert (out / prof["trace"]).is_file() and (out / prof["kernels_csv"]).is_file()
    assert prof["top20"] and set(prof["ranges"]) | set(prof["ranges_missing"]) == set(sp.RANGES)
    assert any(r["name"] == "aten::native_batch_norm" and r["input_shapes"].startswith("[[")
               for r in prof["ops_by_shape"])  # operators with their input shapes
    assert by["convs"]["layers"][0]["input_grad"] is False  # the stem: no input gradient
    assert all(f"{w}_ms_{m}" in lay for lay in by["convs"]["layers"] for w in ("fwd", "bwd")
               for m in ("off", "on"))
    assert set(by["convs"]["encoder"]) >= {"off", "on", "gflop_fwd_bwd"}
    for lay in by["convs"]["layers"]:  # TFLOP/s x seconds = FLOPs (1e12 x 1e-3 ms = 1e9 GFLOP)
        assert abs(lay["fwd_tflops_on"] * 1e12 * lay["fwd_ms_on"] / 1e3
                   - lay["gflop_fwd"] * 1e9) <= 1e-6 * lay["gflop_fwd"] * 1e9
    enc = by["convs"]["encoder"]
    assert enc["stem"] == "fold" and {"on_stem_pad", "on_stem_off", "on_bn_off"} <= set(enc)
    assert enc["bn"] == "flat"
    stem = by["convs"]["stem"]  # the stem's forms: 3, 4, 8 channels-last, NCDHW, folded 12, 16
    assert [(r["channels"], r["layout"]) for r in stem] == [
        (3, "channels_last"), (4, "channels_last"), (8, "channels_last"), (3, "ncdhw"),
        (12, "fold2d_nhwc"), (16, "fold2d_nhwc")]
    assert all(r["max_rel_diff"] < 1e-5 for r in stem)  # fp32 on the CPU: the same convolution
    assert abs(enc["on"]["tflops"] * 1e12 * enc["on"]["ms"] / 1e3 - enc["gflop_fwd_bwd"] * 1e9) \
        <= 1e-6 * enc["gflop_fwd_bwd"] * 1e9
    assert by["loader"]["prefetch"] in ("absent",) or by["loader"]["prefetch_batches_per_s"] > 0
    assert by["compile"]["error"] is None and by["compile"]["step_ms"] > 0
    dist = by["dist"]  # 2 gloo ranks: 4 steps with a checkpoint, then resumed to 6
    assert dist["steps"] == 6 and dist["resumed"] and dist["active"] == 1.0, dist
    assert [r["returncode"] for r in dist["runs"]] == [0, 0]
    assert by["compile"]["forwards_started_at_s"]  # (each forward's start, as reported)
    sel = by["select"]
    assert [r["kmeans"] for r in sel["alone"]] == ["steps", "steps"]
    assert [r["ran"] for r in sel["alone"]] == ["steps", "steps"]
    assert [r["base"] for r in sel["alone"]] == ["ieee/fp32/steps", "ieee/bf16/steps"]
    assert [sel["beside"][k]["priority"] for k in ("default", "high")] == [0, -1]
    assert all("ms" in r for r in sel["alone"]) and set(sel["beside"]) == {"default", "high"}
    assert lines[-1]["failed"] == [] and lines[-1]["skipped"] == ["dali"] + (
        ["ncu"] if by["ncu"]["status"] == "skipped" else [])


def test_a_crashing_part_costs_only_its_own_line_which_says_how_to_rerun_it(tmp_path):
    """--fail-part: that part's process aborts (SIGABRT); the parts after it still run and
    write their lines (ncu here through a stand-in on PATH, dali skipped), the failure line
    names how it ended and the rerun command, and the session exits 1."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ncu = bin_dir / "ncu"
    ncu.write_text(FAKE_NCU)
    ncu.chmod(0o755)
    p, out, lines = _session(tmp_path, "--part", "loader", "dali", "ncu", "--fail-part",
                             "loader", path_dirs=[bin_dir])
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert [ln["part"] for ln in lines] == ["env", "loader", "dali", "ncu", "end"]
    for line in lines[:-1]:
        assert list(line) == _keys(line), line["part"]
    loader = lines[1]
    assert loader["status"] == "failed" and "SIGABRT" in loader["how"]
    assert loader["rerun"] == "python3 bench/gpu_session.py --part loader --dry-run"
    assert lines[2]["status"] == "skipped"
    ncu = lines[3]
    assert ncu["status"] == "ok", ncu
    assert (out / ncu["csv"]).read_text().strip() == NCU_CSV
    assert (out / ncu["report"]).is_file()
    assert [k["name"] for k in ncu["kernels"]] == ["_grad_embed_kernel", "_kmeanspp_step_kernel"]
    assert ncu["kernels"][0]["Duration"] == "12.35 us"
    assert "--set basic" in ncu["command"] and f"--launch-count {sp.NCU_LAUNCHES}" in ncu["command"]
    assert "--profile-from-start off" in ncu["command"]  # the selection's launches, not warm-up
    assert "--cache-control none" in ncu["command"]  # caches as the selection left them
    assert f"'{sp.NCU_KERNELS}'" in ncu["command"]  # quoted: the regex's | is not a pipe
    assert lines[-1]["failed"] == ["loader"] and lines[-1]["status"] == "failed"
    assert "rerun alone: python3 bench/gpu_session.py --part loader --dry-run" in p.stdout


def test_the_dist_parts_train_commands_pass_train_pys_checks_at_both_sizes(tmp_path):
    """The dist part's two train.py commands, as a GPU session runs them (the paper preset on
    cuda) and as the dry run does, are accepted by train.py before any work: its flags, the
    config's own checks, the warm-up check and the selection batch check (the dry run alone
    would not see a refusal that only the paper preset meets)."""
    import train

    for sz in (sc.GPU, sc.DRY):
        argvs = sp.dist_train_argvs(sz.preset, sz.device, sz is sc.DRY, tmp_path / "run")
        assert [a[a.index("--steps") + 1] for a in argvs] == ["4", "6"]
        for argv in argvs:
            args = train.build_parser().parse_args(argv)
            cfg = train.config_from_args(args)
            train.check_warmup(cfg, args.preset, given=getattr(args, "optim.warmup") is not None)
            cfg.check_selection_batch()
            assert (cfg.run.device, cfg.run.dist_backend) == (sz.device, "gloo")


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # (a zombie has ended: its new parent has not reaped it yet)


def _ended(pid: int, within: float = 5.0) -> bool:
    """Whether ``pid`` has ended, or ends within ``within`` s: a SIGKILL sent to its group is
    delivered, not yet acted on, when killpg returns."""
    deadline = time.monotonic() + within
    while _running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_part_ends_with_every_process_it_started(tmp_path):
    """A part that does not finish within its cap, or that fails leaving a child running (its
    own subprocess timed out: the dist part's torchrun ranks, ncu's target), ends with every
    process it started: on a GPU they would hold it through the later parts. Its line says how
    it ended and keeps what it had reported."""
    import argparse

    args = argparse.Namespace(dry_run=True, fail_part="loader:hang", pairs=3, dali_manifest=None,
                              ncu_engine=None)
    status, body, secs = gs.run_part("loader", args, tmp_path, timeout=10)
    assert status == "failed" and body["how"] == "did not finish within 10 s (killed)", body
    assert _ended(body["partial"]["child_pid"])
    assert secs < 30
    args.fail_part = "loader:orphan"
    status, body, secs = gs.run_part("loader", args, tmp_path, timeout=60)
    assert status == "failed" and body["how"] == "failed (exit status 1)", body
    assert _ended(body["partial"]["child_pid"])
    assert secs < 30


def test_a_part_is_skipped_when_the_budget_left_is_too_small(tmp_path):
    """No time left: every part's line says it was skipped and how to run it alone (only the
    env line is measured)."""
    p, _, lines = _session(tmp_path, "--budget-s", "1", "--part", "select", "ncu")
    assert p.returncode == 0, p.stderr[-3000:]
    assert [(ln["part"], ln["status"]) for ln in lines] == [
        ("env", "ok"), ("select", "skipped"), ("ncu", "skipped"), ("end", "ok")]
    assert "--budget-s 1" in lines[1]["why"] and "--part select --dry-run" in lines[1]["why"]


def test_the_ncu_engine_is_checked_and_carried_to_the_parts_process(capsys):
    with pytest.raises(SystemExit):
        gs.main(["--ncu-engine", "bf16:fastest", "--dry-run"])
    assert "FACTORS:VARIANT" in capsys.readouterr().err
    import argparse

    args = argparse.Namespace(dry_run=True, pairs=3, dali_manifest=None,
                              ncu_engine="bf16:resident")
    assert gs.common_argv(args)[-2:] == ["--ncu-engine", "bf16:resident"]
    assert "--ncu-engine bf16:resident" in gs.rerun_command("ncu", args)


def test_without_a_gpu_the_session_names_the_dry_run(capsys, tmp_path):
    import torch

    if torch.cuda.is_available():
        return  # on a GPU machine the session runs for real
    assert gs.main(["--out", str(tmp_path)]) == 2
    assert "--dry-run" in capsys.readouterr().err
    assert not (tmp_path / gs.LINES).exists()


def test_the_driver_runs_where_the_project_is_not_installed_and_imports_touch_no_cuda(tmp_path):
    """`python3 bench/gpu_session.py` from another folder, without the editable install (``-S``:
    no .pth files, torch found through PYTHONPATH): the driver puts the repository root on
    sys.path and finds its parts' modules; importing them initialises no CUDA context."""
    import torch

    site = str(Path(torch.__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OUT")}
    env.update(PYTHONPATH=site, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-S", str(ROOT / "bench" / "gpu_session.py"), "--help"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "--dry-run" in p.stdout and "--part" in p.stdout
    probe = ("import sys, torch; sys.path.insert(0, sys.argv[1]); import bench.gpu_session as g; "
             "assert 'bench.session_parts' in sys.modules and g.PARTS['pairs'].fn.__module__ == "
             "'bench.session_parts'; print(torch.cuda.is_initialized())")
    q = subprocess.run([sys.executable, "-c", probe, str(ROOT)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert q.returncode == 0 and q.stdout.strip() == "False", q.stdout + q.stderr[-3000:]


def test_a_parts_trainer_runs_make_the_synthetic_clips_once(monkeypatch):
    """bench/session_common.trainer_run: the second run of a part (pairs runs six) finds the
    first run's clips (the paper preset's 1,024 take seconds to make and a 2.5 GB copy to the
    GPU each), and the data module's own function is back after each run."""
    from cmacc import data

    made = []

    def counting(dcfg, seed):
        made.append(seed)
        return real(dcfg, seed)

    real = data.synthetic_clips
    monkeypatch.setattr(data, "synthetic_clips", counting)
    monkeypatch.setattr(sc, "_CLIPS", {})
    runs = [sc.trainer_run(sc.DRY, "random", timed=1) for _ in range(2)]
    assert made == [0] and data.synthetic_clips is counting
    assert runs[0]["steps"] == runs[1]["steps"] == 1


_DRY = argparse.Namespace(dry_run=True)


def _batch_norms(preset: str) -> int:
    """How many BatchNorm3d the preset's video encoder has (the ``bn`` part times each)."""
    import torch.nn as nn

    from cmacc.config import PRESETS
    from cmacc.encoders import video_backbone

    mc = PRESETS[preset].model
    return sum(isinstance(m, nn.BatchNorm3d) for m in video_backbone(
        mc.video_arch, mc.video_width, mc.video_layers).modules())
