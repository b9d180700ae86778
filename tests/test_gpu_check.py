"""bench/gpu_check.py off a GPU: it refuses with the fix named (exit 2), and its RESULTS.md
section renders every measured and failed row (the GPU figures themselves are taken on a GPU)."""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402

from bench import gpu_check  # noqa: E402


def test_without_a_gpu_it_names_the_fix(capsys, tmp_path):
    if torch.cuda.is_available():
        return  # on a GPU machine the command runs for real (make gpu-check)
    results = tmp_path / "RESULTS.md"
    assert gpu_check.main(["--results", str(results)]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "make test" in err
    assert not results.exists()  # nothing appended


def test_sweep_table_lists_every_measured_and_failed_row():
    rows = [dict(M=128, N=38400, view="head", precision="ieee", factors="fp32", kmeans="steps",
                 ms=0.91, same_picks_vs_first=1.0, same_set_vs_first=1.0),
            dict(M=128, N=38400, view="head", precision="tf32", factors="bf16",
                 kmeans="persistent", error="out of memory"),
            dict(M=4096, N=1228800, view="head", precision="ieee", factors="fp32", kmeans="lazy",
                 ms=512.5, same_picks_vs_first=0.998, same_set_vs_first=1.0),
            dict(M=128, N=38400, view="head", precision="ieee", factors="fp32",
                 kmeans="resident", ran="steps", ms=0.9, same_picks_vs_first=1.0,
                 same_set_vs_first=1.0)]
    text = gpu_check.sweep_table(rows)
    assert "| ieee | fp32 | resident (ran steps) | 0.900 |" in text
    assert "| 128 | 38400 | head | ieee | fp32 | steps | 0.910 | 1.000 / 1.000 |" in text
    assert "| 128 | 38400 | head | tf32 | bf16 | persistent | failed: out of memory |  |" in text
    assert "| 4096 | 1228800 | head | ieee | fp32 | lazy | 512.500 | 0.998 / 1.000 |" in text


def test_sweep_times_eager_and_lazy_selection_and_the_large_batches(monkeypatch):
    """The sweep's plan, without a GPU: eager (steps, persistent) and lazy k-means++ at M = 128
    for every N, both views, index agreement at one N; then M = 512 and 4,096 at N = 300 M,
    eager and lazy with their agreement."""
    calls = []
    monkeypatch.setattr(gpu_check, "_pool", lambda n, m, d, dh, g: (n, m))
    monkeypatch.setattr(gpu_check, "_time_settings", lambda n, m, pool, view, settings, agree:
                        calls.append((m, n, view, tuple(settings), agree)) or [])
    gpu_check.selection_sweep([19200, 38400, 76800], quick=False)
    full = {(m, n, view): (settings, agree) for m, n, view, settings, agree in calls}
    assert len(calls) == 3 * 2 + 2 and len(full) == len(calls)
    for n in (19200, 38400, 76800):
        for view in ("head", "queries"):
            settings, agree = full[(128, n, view)]
            assert agree == (n == 38400) and len(settings) == 18
            assert settings[0] == ("ieee", "fp32", "steps")
            assert {v for _, _, v in settings} == {"steps", "persistent", "lazy"}
    for m in (512, 4096):
        assert full[(m, 300 * m, "head")] == ((("ieee", "fp32", "steps"),
                                               ("ieee", "fp32", "lazy")), True)
    head = gpu_check.header(dict(date="2026-11-23", device="NVIDIA H100 80GB HBM3",
                                 commit="abc123"))
    assert "## GPU check, 2026-11-23: NVIDIA H100 80GB HBM3" in head and "abc123" in head
    assert "Command: `make gpu-check`" in head  # the whole check
    head = gpu_check.header(dict(date="d", device="x", commit="c"), ["--part", "sweep", "--quick"])
    assert "Command: `python bench/gpu_check.py --part sweep --quick`" in head


def test_the_dali_part_times_prepared_clips_when_given_a_manifest(monkeypatch, tmp_path):
    """--dali-manifest: those clips are timed (no synthetic ones are made: that needs PyAV and
    librosa); a manifest that is not there fails the part with the flag named."""
    pytest.importorskip("nvidia.dali")
    from bench import bench_pipeline

    timed = []
    monkeypatch.setattr(bench_pipeline, "make_manifest",
                        lambda *a: pytest.fail("made synthetic clips despite --dali-manifest"))
    monkeypatch.setattr(bench_pipeline, "clips_per_second",
                        lambda manifest, backend, device, **kw: timed.append(
                            (manifest, backend, device, kw["views"])) or (12.5, "dali", 1))
    missing = tmp_path / "nope" / "manifest.csv"
    with pytest.raises(gpu_check.PartFailed, match=r"--dali-manifest .*nope.*no such file"):
        gpu_check.dali_throughput(argparse.Namespace(dali_manifest=str(missing)))
    assert timed == []
    manifest = tmp_path / "manifest.csv"
    manifest.write_text("id,video\n")
    text = gpu_check.dali_throughput(argparse.Namespace(dali_manifest=str(manifest)))
    assert [(m, b, d, v) for m, b, d, v in timed] == [(str(manifest), "dali", "cuda", 1),
                                                      (str(manifest), "dali", "cuda", 2)]
    assert str(manifest) in text and "12.5 clips/s (1 view" in text and "(2 views" in text


def test_the_section_names_the_options_it_ran_with_and_parts_get_them(monkeypatch, tmp_path):
    """A partial check says so in its RESULTS.md head (the command that ran, less --results), and
    each part's process and rerun command carry the options (--dali-manifest among them)."""
    seen = []
    monkeypatch.chdir(tmp_path)  # a relative --dali-manifest is the caller's, not the parts' cwd
    m = str(tmp_path / "m.csv")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # main() drops it; restored after the test
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "env_info", lambda dev: dict(date="d", device="x", commit="c"))
    monkeypatch.setattr(gpu_check, "run_parts",
                        lambda parts, results, head: seen.append((parts, head)) or [])
    assert gpu_check.main(["--part", "dali", "train", "--quick", "--dali-manifest", "m.csv",
                           "--results", str(tmp_path / "R.md")]) == 0
    (parts, head), = seen
    assert (f"Command: `python bench/gpu_check.py --part dali train --quick --dali-manifest "
            f"{m}`") in head
    assert [p.name for p in parts] == ["dali", "train"]
    for p in parts:
        assert p.argv[-3:] == ["--quick", "--dali-manifest", m]
        assert p.rerun == f"python bench/gpu_check.py --part {p.name} --quick --dali-manifest {m}"


def _part(name, code, timeout=60.0):
    return gpu_check.Part(name, f"part {name}", [sys.executable, "-c", code],
                          f"python bench/gpu_check.py --part {name}", timeout)


def test_a_crashing_part_loses_no_other_parts_figures(tmp_path):
    """Each part runs in its own process and its figures are appended as soon as it ends: a
    part that dies of a segmentation fault, one that hangs past its limit and one that fails
    cost only their own figures; the summary names each with the command that reruns it."""
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\nolder figures\n")
    report = f"open(os.environ[{gpu_check.REPORT_ENV!r}], 'w').write"
    seen = tmp_path / "seen_by_the_crashing_part.md"
    parts = [
        _part("first", f"import os; {report}('first figure: 41.5 clips/s')"),
        _part("crash", "import os, shutil, signal; "
              f"shutil.copy({str(results)!r}, {str(seen)!r}); os.kill(os.getpid(), signal.SIGSEGV)"),
        _part("hang", "import time; time.sleep(60)", timeout=2.0),
        _part("fails", f"import os, sys; {report}('3 failed, 10 passed'); sys.exit(1)"),
        _part("last", f"import os; {report}('last figure: 0.42 ms')"),
    ]
    failed = gpu_check.run_parts(parts, results, "\n## GPU check, today: a GPU\n")
    text = results.read_text()
    assert [name for name, _ in failed] == ["crash", "hang", "fails"]
    assert "first figure: 41.5 clips/s" in seen.read_text()  # appended before the crash
    assert text.startswith("# Benchmark results\n\nolder figures\n\n## GPU check, today")
    assert "### part first: passed" in text and "### part last: passed" in text
    assert "last figure: 0.42 ms" in text and "3 failed, 10 passed" in text
    assert "### part crash: **FAILED**: crashed (SIGSEGV)" in text
    assert "### part hang: **FAILED**: did not finish within 2 s (killed)" in text
    assert "### part fails: **FAILED**: failed (exit status 1)" in text
    summary = text[text.index("**Failed parts**"):]
    for name in ("crash", "hang", "fails"):
        assert f"- {name}: " in summary and f"`python bench/gpu_check.py --part {name}`" in summary
    assert "first" not in summary and "last" not in summary


def test_each_setting_is_compared_with_the_first_of_its_factor_dtype_and_reported_as_it_ends():
    """_time_settings (the GPU session's `select` part and the sweep), on CPU tensors:
    a bf16 row's agreement is against the first bf16 row (exact agreement, not bf16 rounding
    against fp32), each row names the variant that ran, and on_row sees the rows after each."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    n, m, d, dh = 96, 4, 8, 16
    pool = (F.normalize(torch.randn(n, d, generator=g), dim=1),
            F.normalize(torch.randn(m, d, generator=g), dim=1), torch.randn(m, dh, generator=g))
    settings = [("ieee", "fp32", "steps"), ("ieee", "bf16", "steps"), ("ieee", "fp32", "lazy"),
                ("ieee", "bf16", "lazy")]
    seen = []
    rows = gpu_check._time_settings(n, m, pool, "head", settings, True, timer=lambda fn: 1.0,
                                    on_row=lambda rows: seen.append(len(rows)))
    assert seen == [1, 2, 3, 4]
    assert [r.get("error") for r in rows] == [None] * 4
    assert [r["ran"] for r in rows] == ["steps", "steps", "lazy", "lazy"]
    assert [r["base"] for r in rows] == ["ieee/fp32/steps", "ieee/bf16/steps"] * 2
    assert [r["same_picks_vs_first"] for r in rows] == [1.0] * 4  # lazy draws steps' picks


def test_a_copy_of_the_tree_says_its_commit_and_its_code_can_be_matched(tmp_path, monkeypatch):
    """On the GPU machine the tree is a copy (git metadata stale or absent): $CMACC_COMMIT names
    the commit, and source_sha256 is equal for an equal copy of the code and differs after a
    one-byte change, so a reader can match the figures to a checkout."""
    import shutil

    from bench import common

    monkeypatch.setenv(common.COMMIT_ENV, "0123456789ab")
    assert common.git_commit() == "0123456789ab (said by $CMACC_COMMIT)"
    for d in common.SOURCE_DIRS:
        shutil.copytree(common.ROOT / d, tmp_path / d,
                        ignore=shutil.ignore_patterns("__pycache__", "results"))
    shutil.copy(common.ROOT / "train.py", tmp_path / "train.py")
    assert common.source_sha256(tmp_path) == common.source_sha256()
    f = tmp_path / "kernels" / "triton_select.py"
    f.write_bytes(f.read_bytes() + b" ")
    assert common.source_sha256(tmp_path) != common.source_sha256()
