"""bench/gpu_check.py off a GPU: it refuses with the fix named (exit 2), and its RESULTS.md
section renders every measured and failed row (the GPU figures themselves are taken on a GPU)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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


def test_section_lists_every_row_with_device_versions_and_commit():
    info = dict(date="2026-11-23", device="NVIDIA H100 80GB HBM3", commit="abc123")
    rows = [dict(N=38400, view="head", precision="ieee", factors="fp32", kmeans="steps",
                 ms=0.91, same_picks_vs_first=1.0, same_set_vs_first=1.0),
            dict(N=38400, view="head", precision="tf32", factors="bf16", kmeans="persistent",
                 error="out of memory")]
    text = gpu_check.section(info, {"kernel tests, compiled": "passed: 120 passed"}, rows)
    assert "## GPU check, 2026-11-23: NVIDIA H100 80GB HBM3" in text and "abc123" in text
    assert "| 38400 | head | ieee | fp32 | steps | 0.910 | 1.000 / 1.000 |" in text
    assert "| 38400 | head | tf32 | bf16 | persistent | failed: out of memory |  |" in text
    assert "**kernel tests, compiled**: passed: 120 passed" in text
