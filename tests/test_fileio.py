"""data_dali.fileio: a reader sees the old file or the new one, never part of one; a failed write
leaves the old file and no temporary; the sweep removes only temporaries of ended writers."""

import os
import subprocess
import sys

import numpy as np
import pytest

from data_dali import fileio


def _ended_pid():
    """The pid of a process that has run and ended (what a killed writer leaves in a name)."""
    p = subprocess.Popen([sys.executable, "-c", ""])
    p.wait()
    return p.pid


def test_the_old_file_stays_whole_until_the_replace(tmp_path):
    path = tmp_path / "manifest.csv"
    path.write_text("old\n")
    with fileio.atomic_path(path) as tmp:
        assert tmp.parent == path.parent and tmp.name.startswith(".") and tmp.suffix == ".csv"
        assert str(os.getpid()) in tmp.name
        tmp.write_text("new, half")
        assert path.read_text() == "old\n"  # a reader now still sees the old file
        tmp.write_text("new\n")
    assert path.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.csv"]


def test_an_exception_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "clip.webm"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="encoder failed"):
        with fileio.atomic_path(path) as tmp:
            tmp.write_bytes(b"partial")
            raise RuntimeError("encoder failed")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.webm"]
    with pytest.raises(RuntimeError):  # a failure before anything was written
        with fileio.atomic_path(tmp_path / "new.webm"):
            raise RuntimeError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.webm"]


def test_write_helpers_and_encoders_that_pick_the_format_by_name(tmp_path):
    assert fileio.atomic_write_text(tmp_path / "a.txt", "x\r\ny") == tmp_path / "a.txt"
    assert (tmp_path / "a.txt").read_bytes() == b"x\r\ny"  # no newline translation
    fileio.atomic_write_bytes(tmp_path / "a.txt", b"\x00\x01")
    assert (tmp_path / "a.txt").read_bytes() == b"\x00\x01"
    arr = np.arange(6.0).reshape(2, 3)
    with fileio.atomic_path(tmp_path / "m.mel.npy") as tmp:
        np.save(tmp, arr)  # np.save appends .npy to names without it: the temporary has it
    np.testing.assert_array_equal(np.load(tmp_path / "m.mel.npy"), arr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "m.mel.npy"]
    fileio.fsync_dir(tmp_path)


def test_sweep_removes_only_stale_temporaries_of_ours(tmp_path):
    ended = _ended_pid()
    sub = tmp_path / "clips" / "c"
    sub.mkdir(parents=True)
    stale = [tmp_path / f".manifest.csv.tmp{ended}.csv", tmp_path / f".r.json.tmp{ended}",
             sub / f".a.webm.tmp{ended}.webm"]
    live = [tmp_path / f".b.webm.tmp{os.getpid()}.webm",  # being written by this process
            tmp_path / f".c.webm.tmp{os.getppid()}.webm"]  # ... by a running one
    others = [tmp_path / "a.webm.tmp123", tmp_path / ".notes.tmp", tmp_path / ".x.tmpabc.webm",
              tmp_path / "manifest.csv", tmp_path / ".hidden"]
    for p in stale + live + others:
        p.write_bytes(b"x")
    (tmp_path / f".dir.tmp{ended}").mkdir()  # not a file: left alone
    assert fileio.sweep_temporaries(tmp_path) == 2  # the sub-folder only when recursive
    assert fileio.sweep_temporaries(tmp_path, recursive=True) == 1
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in live + others) and (tmp_path / f".dir.tmp{ended}").is_dir()
    assert fileio.sweep_temporaries(tmp_path / "missing") == 0


def test_temporary_names_match_the_sweep_pattern(tmp_path):
    for name in ("manifest.csv", "clip.mel.npy", "noext", ".hidden.json"):
        tmp = fileio.temporary_path(tmp_path / name)
        m = fileio.TEMPORARY.match(tmp.name)
        assert m and m["name"] == name and int(m["pid"]) == os.getpid()


def test_fileio_imports_neither_torch_nor_cmacc():
    code = ("import sys, data_dali.fileio; "
            "assert not {'torch', 'cmacc'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
