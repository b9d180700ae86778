"""Clips damaged after prepare (a truncated video, a log-mel with NaN, a video whose header
hides its truncation from the cheap checks) never end a run: each is skipped and replaced, named
once in OUT/bad_clips.csv, counted in metrics.csv; both backends; a failed DALI pipeline is
rebuilt; past --max-bad-clips the run stops with one line."""

import csv
import shutil

import numpy as np
import pytest

import train
from data_dali.damaged import listed_clips, mel_problem, webm_problem

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


def _one_damaged_clip_a_rank(tiny_prepared, tmp_path, seed):
    """A copy of the 12-clip set with one video cut in half in each rank's slice of global batch 0
    (2 ranks, M = 4: the loader's law, data_dali/loader.py), chosen so that neither rank's
    replacement draw is the other's damaged clip: in epoch 0 each rank meets exactly one."""
    import torch

    from data_dali.damaged import BadClips
    from data_dali.manifest import Manifest

    data = tmp_path / "data"
    shutil.copytree(tiny_prepared[1], data)
    rows = list(csv.DictReader(open(data / "manifest.csv", newline="")))
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(
        seed * 1_000_003)).tolist()
    hit = [perm[0], perm[2]]  # rank 0's first clip, rank 1's first clip
    bad = BadClips(Manifest(data / "manifest.csv"), list(range(len(rows))), seed=seed)
    assert not {bad.replacement(hit[0], 0), bad.replacement(hit[1], 0)} & set(hit)
    for i in hit:
        video = data / rows[i]["video"]
        video.write_bytes(video.read_bytes()[:video.stat().st_size // 2])
    return data / "manifest.csv"


def test_max_bad_clips_counts_the_whole_run_over_ranks_and_attempts(tiny_prepared, tmp_path):
    """--max-bad-clips 1 on 2 forked gloo ranks, each meeting 1 damaged clip (neither rank alone
    passes the limit; the run's 2 do): both stop after the same step (2: the step whose record
    first holds both, read one step late) with the one line naming the run's 2. Running the same
    command again (limit 1; rank 0 counts the clips the files list, each rank only those it
    lists first) stops again after its first step, naming 2 — not a count started afresh; one
    process with --max-bad-clips 2 trains on through epoch 1, where it meets both clips again
    (listed: not counted again), metrics.csv counting the run's 2. (Before: the largest count of
    one rank, per attempt, and the run trained on to its end.)"""
    from cmacc.trainer import Trainer
    from ranks import run_ranks

    seed, out = 5, tmp_path / "run"
    manifest = _one_damaged_clip_a_rank(tiny_prepared, tmp_path, seed)

    def config(limit, steps=3):
        return train.config_from_args(train.build_parser().parse_args(
            SMALL + ["--data", str(manifest), "--loader", "reference", "--seed", str(seed),
                     "--dict-init", "random", "--steps", str(steps), "--max-bad-clips", str(limit),
                     "--device", "cpu", "--dist-timeout", "10", "--out", str(out)]))

    def rank_fn(rank):
        t = Trainer(config(1))
        try:
            t.run()
        except Exception as e:  # noqa: BLE001 - the line and the step, per rank
            return t.step, type(e).__name__, str(e)
        return t.step, None, None

    line = (f"{manifest}: 2 damaged clips, more than --max-bad-clips 1 (listed in "
            f"{out}/bad_clips.rank*.csv); re-run `python -m data_dali.prepare` on their sources, "
            "or raise --max-bad-clips")
    first = run_ranks(rank_fn, timeout=60)
    assert first == [("ok", (2, "UsageError", line))] * 2, first
    mine = [len(_bad_rows_of(out / f"bad_clips.rank{r}.csv")) for r in (0, 1)]
    assert mine == [1, 1]  # each rank met one: neither alone is past the limit
    again = run_ranks(rank_fn, timeout=60)  # resumed at step 2; no damaged clip in step 3
    assert again == [("ok", (3, "UsageError", line))] * 2, again
    Trainer(config(2, steps=6)).run()  # one process: the run's 2 are not past 2
    metrics = list(csv.DictReader(open(out / "metrics.csv", newline="")))
    assert [(int(r["step"]), float(r["bad_clips"])) for r in metrics] == [(3, 2), (6, 2)]
    assert sorted(int(r["index"]) for r in listed_clips(out / "bad_clips.csv")) == sorted(
        int(r["index"]) for f in ("bad_clips.rank0.csv", "bad_clips.rank1.csv")
        for r in _bad_rows_of(out / f))  # each clip listed once, in the rank that met it


def _bad_rows_of(path):
    return list(csv.DictReader(open(path, newline="")))
