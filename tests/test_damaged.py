"""Clips damaged after prepare (a truncated video, a log-mel with NaN, a video whose header
hides its truncation from the cheap checks) never end a run: each is skipped and replaced, named
once in OUT/bad_clips.csv, counted in metrics.csv; both backends; a failed DALI pipeline is
rebuilt; past --max-bad-clips the run stops with one line."""

import csv
import shutil

import numpy as np
import pytest

import train
from data_dali.damaged import mel_problem, webm_problem

SMALL = ["--preset", "tiny", "--batch-size", "4", "--dict-size", "8", "--pool-size", "16",
         "--log-every", "3", "--workers", "0"]


def _dali_available():
    try:
        from data_dali import pipelines  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


BACKENDS = ["reference", pytest.param("dali", marks=pytest.mark.skipif(
    not _dali_available(), reason="DALI does not import here"))]


@pytest.fixture
def damaged(tiny_prepared, tmp_path):
    """A copy of the 12-clip prepared set with clip 1's video cut to half its bytes and clip 4's
    log-mel holding NaN; (manifest, {row: file name})."""
    data = tmp_path / "data"
    shutil.copytree(tiny_prepared[1], data)
    rows = list(csv.DictReader(open(data / "manifest.csv", newline="")))
    video = data / rows[1]["video"]
    video.write_bytes(video.read_bytes()[:video.stat().st_size // 2])
    mel = np.load(data / rows[4]["mel"])
    mel[3, 2] = np.nan
    np.save(data / rows[4]["mel"], mel)
    return data / "manifest.csv", {1: rows[1]["video"], 4: rows[4]["mel"]}


def _bad_rows(out):
    return list(csv.DictReader(open(out / "bad_clips.csv", newline="")))


@pytest.mark.parametrize("backend", BACKENDS)
def test_damaged_clips_are_replaced_named_and_counted(damaged, tmp_path, backend, capsys):
    manifest, names = damaged
    out = tmp_path / "run"
    train.main(SMALL + ["--data", str(manifest), "--loader", backend, "--steps", "6",
                        "--out", str(out)])  # 2 epochs of 3 batches: every clip, twice
    capsys.readouterr()
    rows = _bad_rows(out)
    assert sorted(int(r["index"]) for r in rows) == [1, 4]  # once each, over both epochs
    by = {int(r["index"]): r for r in rows}
    assert by[1]["file"].endswith(names[1]) and "truncated" in by[1]["reason"]
    assert by[4]["file"].endswith(names[4]) and "non-finite" in by[4]["reason"]
    metrics = list(csv.DictReader(open(out / "metrics.csv", newline="")))
    assert int(metrics[-1]["step"]) == 6 and float(metrics[-1]["bad_clips"]) == 2


def test_past_max_bad_clips_the_run_stops_with_one_line(damaged, tmp_path, capsys):
    manifest, _ = damaged
    with pytest.raises(SystemExit) as e:
        train.main(SMALL + ["--data", str(manifest), "--loader", "reference", "--steps", "6",
                            "--max-bad-clips", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("error: "), err[-3:]
    assert "2 damaged clips, more than --max-bad-clips 1" in err[-1], err[-1]
    assert "bad_clips.csv" in err[-1]


@pytest.mark.skipif(not _dali_available(), reason="DALI does not import here")
def test_a_failed_dali_pipeline_is_rebuilt_and_the_epoch_goes_on(tiny_prepared, tmp_path, capsys):
    """A truncated video whose header says 'unknown size' passes the cheap checks: DALI fails on
    it, the clip is found (PyAV: too few frames), recorded, the pipeline rebuilt."""
    data = tmp_path / "data"
    shutil.copytree(tiny_prepared[1], data)
    rows = list(csv.DictReader(open(data / "manifest.csv", newline="")))
    video = data / rows[2]["video"]
    raw = bytearray(video.read_bytes())
    seg = raw.index(b"\x18\x53\x80\x67")
    n = 8 - raw[seg + 4].bit_length() + 1  # the Segment size's length: set it to "unknown"
    raw[seg + 4:seg + 4 + n] = bytes([0xFF >> (n - 1)]) + b"\xff" * (n - 1)
    video.write_bytes(bytes(raw[:len(raw) // 3]))
    assert webm_problem(video) is None  # the cheap check cannot see it
    out = tmp_path / "run"
    train.main(SMALL + ["--data", str(data / "manifest.csv"), "--loader", "dali", "--steps",
                        "6", "--out", str(out)])
    capsys.readouterr()
    rows = _bad_rows(out)
    assert [int(r["index"]) for r in rows] == [2] and "frames" in rows[0]["reason"], rows


def test_the_cheap_checks_against_independent_facts(tmp_path, tiny_prepared):
    rows = list(csv.DictReader(open(tiny_prepared[1] / "manifest.csv", newline="")))
    video, mel = tiny_prepared[1] / rows[0]["video"], tiny_prepared[1] / rows[0]["mel"]
    assert webm_problem(video) is None and mel_problem(mel) is None
    data = video.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 40, 3):
        (tmp_path / "v.webm").write_bytes(data[:cut])
        assert webm_problem(tmp_path / "v.webm") is not None, cut
    (tmp_path / "v.webm").write_bytes(b"")
    assert "empty" in webm_problem(tmp_path / "v.webm")
    (tmp_path / "m.npy").write_bytes(mel.read_bytes()[:-8])
    assert "cannot read" in mel_problem(tmp_path / "m.npy")
    np.save(tmp_path / "m.npy", np.full((80, 5), np.inf, np.float32))
    assert "non-finite" in mel_problem(tmp_path / "m.npy")


def test_replacements_never_give_up_while_a_clip_is_usable():
    """199 of 200 clips damaged and a limit that allows it: every damaged clip is replaced by
    the one usable clip (64 random draws miss it with probability 0.73: these stopped one rank
    alone, outside the limit that the ranks agree on); all 200 damaged: one line."""
    from types import SimpleNamespace

    from data_dali.damaged import BadClips, TooManyBadClips

    m = SimpleNamespace(file="m.csv", rows=[dict(id=i, video="", mel="") for i in range(200)])
    bad = BadClips(m, list(range(200)), limit=1000, need_video=False, need_audio=False)
    for i in range(1, 200):
        bad.mark(i, "truncated")
    assert {bad.usable(i, epoch=e) for i in range(1, 200) for e in (0, 1)} == {0}
    bad.mark(0, "truncated")
    with pytest.raises(TooManyBadClips, match=r"^m.csv: every clip is damaged \(200 found\)"):
        bad.usable(5, epoch=0)
