"""data_dali under faults: output names that never collide, the output folder never read as a
source, a full or unwritable disk and ``kill -9`` during prepare (nothing half-made stays, a
re-run finishes the job), the free-space check, every bad manifest named by line in one error,
the default held-out split, and the commands' bad command lines (one line, exit 2)."""

import csv
import errno
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import data_dali.cli
from data_dali import prepare as prep
from data_dali import synthetic
from data_dali.prepare import transcode
from data_dali.cli import UserError, command
from data_dali.loader import EvalSplits
from data_dali.manifest import Manifest, ManifestError

REPO = Path(__file__).resolve().parents[1]
CFG = prep.PrepareConfig(short_side=16, min_seconds=0.5)
CFG_FLAGS = ["--short-side", "16", "--min-seconds", "0.5", "--workers", "1"]


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _tmp_files(folder):
    return [p for p in Path(folder).rglob("*") if ".tmp" in p.name]


def _one_line_error(capsys, exc, *names):
    """The command's error: exit 2, one line on stderr naming each of ``names``, no traceback
    (its log lines aside: "HH:MM:SS LEVEL ...", e.g. prepare's progress in a log that is not a
    terminal)."""
    assert exc.value.code == 2
    err = "".join(ln for ln in capsys.readouterr().err.splitlines(keepends=True)
                  if not re.match(r"\d\d:\d\d:\d\d [A-Z]+ ", ln))
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for name in names:
        assert str(name) in err, (name, err)
    return err


def _copy_src(tiny_prepared, tmp_path):
    return Path(shutil.copytree(tiny_prepared[0], tmp_path / "src"))


# ----------------------------------------------------------------------------------------------
# A. prepare
# ----------------------------------------------------------------------------------------------
def test_every_source_gets_its_own_outputs_named_after_its_path(tmp_path):
    names = ["a.mp4", "a.avi", "A.mp4", "clip.part1.mp4", "clip.part2.mp4", "y.mp4", "y.mel.mp4"]
    src = tmp_path / "src"
    for k, n in enumerate(names):  # source k is a flat picture of brightness 30 k
        synthetic.write_av(src / "c" / n, np.full((8, 32, 32, 3), 30 * k, np.uint8), 10,
                           np.zeros(8000, np.float32), 16000)
    out = tmp_path / "out"
    s = prep.prepare(src, out, workers=1, progress=False, cfg=CFG)
    rows = {r["source"]: r for r in _csv(out / "manifest.csv")}
    assert s["kept"] == len(names) and set(rows) == {f"c/{n}" for n in names}
    paths = [r[k] for r in rows.values() for k in ("video", "audio", "mel")]
    assert len(set(paths)) == len(paths) and all((out / p).is_file() for p in paths)
    for n in ("a.avi", "clip.part1.mp4", "y.mp4", "y.mel.mp4"):  # the documented names
        assert rows[f"c/{n}"]["video"] == f"clips/c/{n}.webm"
        assert rows[f"c/{n}"]["mel"] == f"clips/c/{n}.mel.npy"
    # names equal but for case get a hash (one file on case-insensitive disks)
    assert rows["c/a.mp4"]["video"] != rows["c/A.mp4"]["video"]
    assert rows["c/a.mp4"]["video"].lower() != rows["c/A.mp4"]["video"].lower()
    import av

    for k, n in enumerate(names):  # each output shows its own source: nothing was overwritten
        with av.open(str(out / rows[f"c/{n}"]["video"])) as c:
            frame = next(c.decode(video=0)).to_ndarray(format="gray")
        assert abs(frame.mean() - 30 * k) < 6, n
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    s = prep.prepare(src, out, workers=1, progress=False, cfg=CFG)  # stable: a no-op
    assert s["processed"] == 0 and {p: p.stat().st_mtime_ns for p in before} == before
    assert {r["source"]: r["video"] for r in _csv(out / "manifest.csv")} == \
        {k: r["video"] for k, r in rows.items()}


def test_an_output_folder_inside_the_source_is_never_read(tiny_prepared, tmp_path):
    src = _copy_src(tiny_prepared, tmp_path)
    out = src / "prepared"
    first = prep.prepare(src, out, workers=1, progress=False, cfg=CFG)
    shutil.copytree(out, src / "class00" / "older")  # another prepared dataset, deeper down
    again = prep.prepare(src, out, workers=1, progress=False, cfg=CFG)
    assert first["files"] == again["files"] == 12 and again["processed"] == 0
    assert {r["class_name"] for r in _csv(out / "manifest.csv")} == {"class00", "class01"}
    assert any("left out 2 prepared dataset folder(s)" in w for w in again["warnings"])
    # a list entry pointing into OUT is rejected, not prepared
    (src / "listed").mkdir()
    shutil.copy(src / "class00" / "class00_000.mp4", src / "listed" / "x.mp4")
    lst = tmp_path / "files.csv"
    lst.write_text("path,label\nclass00/class00_000.mp4,0\nlisted/x.mp4,1\n")
    s = prep.prepare(src, src / "listed", layout="list", list_file=lst, workers=1,
                     progress=False, cfg=CFG)
    assert s["kept"] == 1 and _csv(src / "listed" / "rejects.csv")[0]["reason"].startswith(
        "inside the output folder")


def _fail_on_call(n, error):
    """A stand-in for a writer that raises ``error`` on its n-th call (1-based)."""
    calls = Counter()

    def write(path, data):
        calls["n"] += 1
        if calls["n"] == n:
            raise error
        return original(path, data)

    original = transcode._write_npy
    return write


@pytest.mark.parametrize("error, low_disk", [
    (OSError(errno.ENOSPC, "No space left on device"), False),
    (RuntimeError("Error : System error."), True),  # a library that loses errno (libsndfile)
])
def test_a_full_disk_stops_with_one_line_and_leaves_nothing_half_made(
        tiny_prepared, tmp_path, monkeypatch, capsys, error, low_disk):
    src, clean = tiny_prepared
    out = tmp_path / "out"
    monkeypatch.setattr(transcode, "_write_npy", _fail_on_call(3, error))
    if low_disk:
        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1 << 20))
    with pytest.raises(SystemExit) as exc:
        prep.main([str(src), str(out), "--no-space-check"] + CFG_FLAGS)
    _one_line_error(capsys, exc, out, "full", "class00/class00_002.mp4", "run the same command again")
    # the two finished files are kept whole; the third left nothing; no manifest lists anything
    assert len(list((out / "records").iterdir())) == 2
    names = sorted(p.relative_to(out / "clips").as_posix() for p in (out / "clips").rglob("*")
                   if p.is_file())
    assert names == sorted(f"class00/class00_00{k}.mp4{e}" for k in (0, 1)
                           for e in (".flac", ".mel.npy", ".webm"))
    assert not _tmp_files(out) and not (out / "manifest.csv").exists()
    monkeypatch.undo()
    s = prep.prepare(src, out, workers=1, progress=False, cfg=CFG)
    assert s["skipped_done"] == 2 and s["processed"] == 10
    assert (out / "manifest.csv").read_bytes() == (clean / "manifest.csv").read_bytes()


def test_a_full_disk_on_a_redo_keeps_the_last_manifest_usable(tiny_prepared, tmp_path, monkeypatch, capsys):
    src = _copy_src(tiny_prepared, tmp_path)
    out = tmp_path / "out"
    prep.prepare(src, out, workers=1, progress=False, cfg=CFG)
    manifest = (out / "manifest.csv").read_bytes()
    for k in (1, 4):  # changed sources: redone on the next run
        shutil.copy(src / "class01" / "class01_000.mp4", src / "class00" / f"class00_00{k}.mp4")
    monkeypatch.setattr(transcode, "_write_npy", _fail_on_call(2, OSError(errno.ENOSPC, "No space")))
    with pytest.raises(SystemExit) as exc:
        prep.main([str(src), str(out)] + CFG_FLAGS)
    _one_line_error(capsys, exc, out, "class00/class00_004.mp4")
    assert (out / "manifest.csv").read_bytes() == manifest and not _tmp_files(out)
    assert len(Manifest(out / "manifest.csv")) == 12  # every file it lists is there


def test_the_free_space_check_fails_early_naming_the_numbers(tiny_prepared, tmp_path, monkeypatch, capsys):
    src = tiny_prepared[0]
    out = tmp_path / "out"
    size = sum(p.stat().st_size for p in src.rglob("*.mp4"))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(SystemExit) as exc:
        prep.main([str(src), str(out)] + CFG_FLAGS)
    _one_line_error(capsys, exc, out, f"{size / 1e6:.2f} MB", "0.00 MB free", "--no-space-check")
    assert not (out / "records").exists() or not any((out / "records").iterdir())
    assert prep.main([str(src), str(out), "--no-space-check"] + CFG_FLAGS) == 0


SLOW_MEL = """
import sys, time
import numpy as np
from data_dali.prepare import main, transcode

def slow(path, arr):  # the mel of every file takes 0.5 s to write: a kill lands mid-write
    with transcode.atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, arr)
        f.flush()
        time.sleep(0.5)

transcode._write_npy = slow
main(sys.argv[1:])
"""


def test_kill_9_during_prepare_then_a_rerun_finishes_the_job(tiny_prepared, tmp_path):
    src, clean = tiny_prepared
    out = tmp_path / "out"
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", SLOW_MEL, str(src), str(out)] + CFG_FLAGS,
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.time() + 60
        while not (list(out.glob("records/*.json")) and
                   [p for p in _tmp_files(out / "clips") if ".mel.npy.tmp" in p.name]):
            assert proc.poll() is None and time.time() < deadline, \
                f"prepare ended before the kill: {(tmp_path / 'stderr.txt').read_text()[-2000:]}"
            time.sleep(0.02)
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # kill -9
        proc.wait()
    assert _tmp_files(out) and not (out / "manifest.csv").exists()  # killed mid-write
    records = [json.loads(p.read_text()) for p in out.glob("records/*.json")]
    finished = {out / r["row"][k] for r in records for k in ("video", "audio", "mel")}
    mtimes = {p: p.stat().st_mtime_ns for p in finished}
    s = prep.prepare(src, out, workers=1, progress=False, cfg=CFG)
    assert s["skipped_done"] == len(records) >= 1 and not _tmp_files(out)
    assert (out / "manifest.csv").read_bytes() == (clean / "manifest.csv").read_bytes()
    assert {p: p.stat().st_mtime_ns for p in finished} == mtimes  # finished work was kept


def test_unusable_output_folders_stop_with_one_line(tiny_prepared, tmp_path, monkeypatch, capsys):
    src = tiny_prepared[0]
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [(src, a_file, a_file, "is a file, not a folder"),  # (SRC, OUT, named, why)
             (src, a_file / "out", a_file / "out", "cannot write there"),
             (a_file, tmp_path / "out", a_file, "is a file, not a folder")]
    for s, o, name, why in cases:
        with pytest.raises(SystemExit) as exc:
            prep.main([str(s), str(o)] + CFG_FLAGS)
        _one_line_error(capsys, exc, name, why)
    assert not (tmp_path / "out").exists()

    def refuse(**kw):  # what a read-only mount, a quota or an ACL does to the first write
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(data_dali.cli, "tempfile", SimpleNamespace(TemporaryFile=refuse))
    with pytest.raises(SystemExit) as exc:
        prep.main([str(src), str(tmp_path / "ro")] + CFG_FLAGS)
    _one_line_error(capsys, exc, tmp_path / "ro", "cannot write there (Permission denied)")
    assert not (tmp_path / "ro").exists()  # the folder it made is removed again


# ----------------------------------------------------------------------------------------------
# B. manifests: every row checked when opened, one error naming the first bad rows by line
# ----------------------------------------------------------------------------------------------
HEAD = "id,video,audio,mel,label,frames,fps,duration"
ROW0 = "0,clips/a.webm,clips/a.flac,clips/a.mel.npy,0,10,10,1.0"


def _rows(*rows):
    return "\n".join([HEAD, ROW0, *rows]) + "\n"


BAD_MANIFESTS = [  # (case, manifest text or bytes, what the one-line error must say)
    ("missing file", _rows("1,clips/gone.webm,,,0,10,10,1.0"), ["line 3", "'clips/gone.webm' is missing"]),
    ("escapes the root", _rows("1,../x.webm,,,0,10,10,1.0"), ["line 3", "escapes the dataset folder"]),
    ("absolute path", _rows("1,/etc/passwd,,,0,10,10,1.0"), ["line 3", "escapes the dataset folder"]),
    ("fps 0", _rows("1,clips/b.webm,,,0,10,0,1.0"), ["line 3", "fps '0'"]),
    ("fps abc", _rows("1,clips/b.webm,,,0,10,abc,1.0"), ["line 3", "fps 'abc'"]),
    ("fps nan", _rows("1,clips/b.webm,,,0,10,nan,1.0"), ["line 3", "fps 'nan'"]),
    ("frames 0", _rows("1,clips/b.webm,,,0,0,10,1.0"), ["line 3", "frames '0'"]),
    ("duration 0", _rows("1,clips/b.webm,,,0,10,10,0"), ["line 3", "duration '0'"]),
    ("label -2", _rows("1,clips/b.webm,,,-2,10,10,1.0"), ["line 3", "label -2 is out of range"]),
    ("label 50000000", _rows("1,clips/b.webm,,,50000000,10,10,1.0"), ["line 3", "label 50000000"]),
    ("label 1.5", _rows("1,clips/b.webm,,,1.5,10,10,1.0"), ["line 3", "label '1.5' is not an integer"]),
    ("missing column", "id,video,audio,mel,label,frames\n0,clips/a.webm,,,0,10\n",
     ["line 1", "missing columns ['fps']"]),
    ("wrong column names", "path,label\nclips/a.webm,0\n", ["line 1", "missing columns"]),
    ("duplicate row", _rows("1,clips/a.webm,clips/a.flac,clips/a.mel.npy,0,10,10,1.0"),
     ["line 3", "the same video file as line 2"]),
    ("empty file", "", ["empty file"]),
    ("header only", HEAD + "\n", ["no clips", "rejects.csv"]),
    ("binary file", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe" * 20, ["not a CSV text file"]),
    ("duplicate id", _rows("0,clips/b.webm,,,0,10,10,1.0"), ["line 3", "id '0' is also the id of line 2"]),
    ("negative id", _rows("-1,clips/b.webm,,,0,10,10,1.0"), ["line 3", "id '-1' is not a whole number"]),
    ("no media", _rows("1,,,,0,10,10,1.0"), ["line 3", "no video, audio or mel path"]),
    ("a folder for a file", _rows("1,clips/dir.webm,,,0,10,10,1.0"), ["line 3", "is a folder"]),
    ("too few cells", _rows("1,clips/b.webm,,,0"), ["line 3", "wrong number of cells"]),
    ("a blank line before it", _rows("", "1,clips/b.webm,,,0,10,-1,1.0"), ["line 4", "fps '-1'"]),
    ("a quoted cell over two lines", _rows('1,"clips/b.webm",,,"0\n",10,10,1.0', "2,,,,0,10,10,1.0"),
     ["line 5", "no video"]),
]


@pytest.fixture()
def dataset(tmp_path):
    """A dataset folder with (empty) media files: the checks never decode."""
    for name in ("a.webm", "a.flac", "a.mel.npy", "b.webm"):
        (tmp_path / "clips").mkdir(exist_ok=True)
        (tmp_path / "clips" / name).write_bytes(b"")
    (tmp_path / "clips" / "dir.webm").mkdir()
    return tmp_path


@pytest.mark.parametrize("case, text, says", BAD_MANIFESTS, ids=[c[0] for c in BAD_MANIFESTS])
def test_a_bad_manifest_is_one_error_naming_the_line_and_the_fix(dataset, capsys, case, text, says):
    path = dataset / "manifest.csv"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ManifestError) as e:
        Manifest(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "prepare" in msg, msg
    for s in says:
        assert s in msg, (s, msg)
    with pytest.raises(SystemExit) as exc:  # a command shows it as one line, no traceback
        command(lambda argv: Manifest(argv[0]))([str(path)])
    _one_line_error(capsys, exc, path)


def test_the_good_manifest_of_the_table_opens(dataset):
    (dataset / "manifest.csv").write_text(_rows("1,clips/b.webm,,,-1,10,10,1.0"))
    m = Manifest(dataset / "manifest.csv")
    assert len(m) == 2 and m.num_classes == 1 and m.labels.tolist() == [0, -1]  # -1: unlabeled


def test_many_bad_rows_are_one_error_with_the_first_few(dataset):
    (dataset / "manifest.csv").write_text(_rows(*[f"{i},clips/b.webm,,,x,10,10,1.0" for i in range(1, 40)]))
    with pytest.raises(ManifestError) as e:
        Manifest(dataset / "manifest.csv")
    msg = str(e.value)
    assert "39 bad row(s) of 40" in msg and "line 7 " in msg and "line 8 " not in msg
    assert "(and 34 more)" in msg


def test_an_implausible_label_fails_before_anything_is_allocated(dataset):
    rows = [f"{i},clips/b.webm,,,0,10,10,1.0" for i in (1, 2)] + ["3,clips/b.webm,,,2000000000,10,10,1.0"]
    (dataset / "manifest.csv").write_text(_rows(*rows))
    tracemalloc.start()
    try:
        with pytest.raises(ManifestError, match="label 2000000000 is out of range"):
            Manifest(dataset / "manifest.csv")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5e6  # a class list that long would take gigabytes


def test_the_manifest_path_is_a_folder(dataset):
    (dataset / "manifest.csv").write_text(_rows("1,clips/a.webm,,,0,10,10,1.0"))
    with pytest.raises(ManifestError, match="a folder, not a manifest; pass the manifest.csv in "
                                            "it"):
        Manifest(dataset)


def test_a_folder_of_videos_as_data_says_to_prepare_it_first(tmp_path, capsys):
    """Issue 51: --data given a raw video folder was told "pass the manifest.csv in it", where
    there is none: the line says to run prepare first, and what to pass after."""
    import train

    (tmp_path / "videos" / "dog").mkdir(parents=True)
    (tmp_path / "videos" / "dog" / "a.mp4").write_bytes(b"")
    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "tiny", "--data", str(tmp_path / "videos"), "--steps", "1",
                    "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert e.value.code == 2 and "Traceback" not in err
    assert line.startswith(f"error: --data {tmp_path / 'videos'}: a folder with no manifest.csv"), line
    assert f"cmacc-prepare {tmp_path / 'videos'} OUT" in line and "then pass OUT/manifest.csv" in line
    assert "pass the manifest.csv in it" not in line


# ----------------------------------------------------------------------------------------------
# C. the default split when a manifest has labels but no split/fold columns
# ----------------------------------------------------------------------------------------------
def _labelled(root, counts, unlabeled=2):
    """A manifest of counts[c] clips of class c (+ unlabeled ones), no split columns."""
    (root / "clips").mkdir()
    lines, labels = [HEAD], [c for c, n in enumerate(counts) for _ in range(n)] + [-1] * unlabeled
    for i, c in enumerate(labels):
        (root / "clips" / f"{i}.webm").write_bytes(b"")
        lines.append(f"{i},clips/{i}.webm,,,{c},10,10,1.0")
    (root / "manifest.csv").write_text("\n".join(lines) + "\n")
    return Manifest(root / "manifest.csv"), np.array(labels)


def test_without_split_columns_a_seeded_stratified_split_is_held_out(tmp_path, caplog):
    m, labels = _labelled(tmp_path, [8, 12, 4, 5])
    with caplog.at_level(logging.INFO, logger="data_dali"):
        splits = EvalSplits(m, seed=3).splits()
    assert "no split1..3 or fold columns" in caplog.text and "stratified" in caplog.text
    [(name, tr, te)] = splits
    tr, te = set(tr.tolist()), set(te.tolist())
    assert name == "heldout" and not tr & te
    assert tr | te == set(np.flatnonzero(labels >= 0).tolist())  # every labelled clip, no -1
    for c, n in enumerate([8, 12, 4, 5]):  # a quarter of each class is the test set
        assert sum(labels[i] == c for i in te) == round(n / 4), c
    again = EvalSplits(m, seed=3).splits()[0]
    other = EvalSplits(m, seed=4).splits()[0]
    assert set(again[2].tolist()) == te and set(other[2].tolist()) != te
    assert [s[0] for s in EvalSplits(m, seed=3).splits(wanted={"1"})] == []


def test_official_split_columns_still_win(tmp_path):
    m, _ = _labelled(tmp_path, [4, 4], unlabeled=0)
    text = (tmp_path / "manifest.csv").read_text().splitlines()
    text = [text[0] + ",split1"] + [f"{r},{'test' if i % 2 else 'train'}" for i, r in enumerate(text[1:])]
    (tmp_path / "manifest.csv").write_text("\n".join(text) + "\n")
    [(name, tr, te)] = EvalSplits(tmp_path / "manifest.csv").splits()
    assert name == "split1" and te.tolist() == [1, 3, 5, 7] and tr.tolist() == [0, 2, 4, 6]


# ----------------------------------------------------------------------------------------------
# D. bad command lines: one line, exit 2, naming the thing; --debug shows the traceback
# ----------------------------------------------------------------------------------------------
def _bad_lines(src, tmp):
    tmp.mkdir(exist_ok=True)
    (tmp / "cols.csv").write_text("file,class\na.mp4,0\n")
    (tmp / "a_file").write_text("x")
    s, o, cols = str(src), str(tmp / "out"), str(tmp / "cols.csv")
    return [  # (command, argv, what the error must name)
        (prep.main, [s, o, "--fps", "abc"], ["--fps", "'abc'"]),
        (prep.main, [s, o, "--fps", "0"], ["--fps must be in (0, 120]"]),
        (prep.main, [s, o, "--short-side", "127"], ["--short-side must be an even number"]),
        (prep.main, [s, o, "--workers", "0"], ["--workers must be >= 1"]),
        (prep.main, [s, o, "--layout", "youtube8m"], ["--layout", "'youtube8m'"]),
        (prep.main, [s, o, "--layout", "kinetics"], ["--layout kinetics needs --splits"]),
        (prep.main, [s, o, "--layout", "kinetics", "--splits", cols],
         ["--splits", "cols.csv", "no column(s) ['time_end', 'time_start', 'youtube_id']"]),
        (prep.main, [str(tmp / "nowhere"), o], ["nowhere: source folder not found"]),
        (prep.main, [s, str(tmp / "a_file")], ["a_file: is a file, not a folder"]),
        (prep.main, [s, o, "--layout", "list", "--list", str(tmp / "none.csv")],
         ["--list", "none.csv: no such file"]),
        (prep.main, [s, o, "--list", str(tmp)], ["--list", "is a folder, not a file"]),
        (prep.main, [s, o, "--list", cols], ["cols.csv", "no column(s) ['label', 'path']"]),
        (prep.main, [s, o, "--layout", "folders", "--list", cols], ["only read with --layout list"]),
        (prep.main, [s, o, "--layout", "ucf101"], ["--layout ucf101 needs --splits"]),
        (prep.main, [s, o, "--layout", "hmdb51", "--splits", str(tmp / "a_file")],
         ["--splits", "not a folder"]),
        (prep.main, [s, o, "--layout", "ucf101", "--splits", str(tmp)], ["trainlist01.txt is missing"]),
        (synthetic.main, [o, "--classes", "0"], ["--classes must be >= 1"]),
        (synthetic.main, [o, "--redundancy", "1.5"], ["redundancy must be in [0, 1)"]),
        (synthetic.main, [o, "--seconds", "abc"], ["--seconds", "'abc'"]),
        (synthetic.main, [str(tmp / "a_file")], ["a_file: is a file, not a folder"]),
    ]


def test_bad_command_lines_are_one_line_naming_the_thing(tiny_prepared, tmp_path, capsys):
    for main, argv, names in _bad_lines(tiny_prepared[0], tmp_path / "t"):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        _one_line_error(capsys, exc, *names)
        assert not (tmp_path / "t" / "out").exists(), argv  # nothing made on the way


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(UserError, match="source folder not found"):
        prep.main([str(tmp_path / "nowhere"), str(tmp_path / "out"), "--debug"])
    with pytest.raises(UserError, match="--classes must be >= 1"):
        synthetic.main([str(tmp_path / "out"), "--classes", "0", "--debug"])


def test_a_command_line_that_works_still_works(tmp_path, capsys):
    assert synthetic.main([str(tmp_path / "syn"), "--classes", "1", "--per-class", "1",
                           "--seconds", "0.6"]) == 0
    assert os.path.isfile(tmp_path / "syn" / "class00" / "class00_000.mp4")
    assert capsys.readouterr().out.strip() == str(tmp_path / "syn")
