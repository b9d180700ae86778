"""Manifests people shape: a shuffled subset cut by hand and a merge of two prepared datasets
train without re-running prepare (the loader indexes rows densely); ``python -m
data_dali.manifest_tools stats|subset|merge`` against hand-built manifests and hand-counted answers."""

import csv
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from data_dali import manifest_tools as mt
from data_dali.manifest import Manifest, ManifestError

SMALL = ["--preset", "tiny", "--batch-size", "4", "--dict-size", "8", "--pool-size", "16",
         "--log-every", "2", "--steps", "2", "--loader", "reference", "--workers", "0"]


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def two_prepared(tmp_path_factory):
    """Two prepared datasets under one folder: a (3 classes x 9 clips, split1 from its list
    file) and b (2 classes x 3 clips)."""
    from data_dali import prepare as prep
    from data_dali import synthetic

    root = tmp_path_factory.mktemp("two")
    cfg = prep.PrepareConfig(short_side=32, min_seconds=0.5)
    for name, classes, per_class in (("a", 3, 9), ("b", 2, 3)):
        src = synthetic.write_dataset(root / f"src_{name}", classes=classes, per_class=per_class,
                                      seconds=1.0, width=48, height=32, fps=10)
        prep.prepare(src, root / name, layout="list", list_file=src / "list.csv", workers=2,
                     progress=False, cfg=cfg)
    return root


def _train(manifest, out):
    import train
    from cmacc import checkpoint as ckpt

    assert train.main(SMALL + ["--data", str(manifest), "--out", str(out)]) == 0
    return ckpt.load(out / "ckpt_00000002.pt")


def test_a_shuffled_24_row_subset_cut_by_hand_trains(two_prepared, tmp_path):
    text = (two_prepared / "a" / "manifest.csv").read_text().splitlines()
    body = text[1:]
    random.Random(5).shuffle(body)  # what `shuf | head -24` does
    cut = two_prepared / "a" / "shuffled.csv"
    cut.write_text("\n".join([text[0]] + body[:24]) + "\n")
    m = Manifest(cut)
    ids = [int(r["id"]) for r in _rows(cut)]
    assert len(m) == 24 and ids != sorted(ids) and max(ids) >= 24  # neither dense nor in order
    state = _train(cut, tmp_path / "run")
    idx = state["model"]["dict_v.index"]
    assert ((idx >= 0) & (idx < 24)).all()  # the dictionaries hold dense row indices


def test_a_merge_of_two_prepared_folders_trains(two_prepared, tmp_path):
    out = two_prepared / "ab.csv"
    assert mt.main(["merge", str(two_prepared / "a"), str(two_prepared / "b"), "--out", str(out)]) == 0
    rows = _rows(out)
    a, b = _rows(two_prepared / "a" / "manifest.csv"), _rows(two_prepared / "b" / "manifest.csv")
    assert [int(r["id"]) for r in rows] == list(range(len(a) + len(b)))
    assert [r["video"] for r in rows] == [f"a/{r['video']}" for r in a] + [f"b/{r['video']}" for r in b]
    # b's classes class00, class01 are a's: the same labels
    assert [(r["label"], r["class_name"]) for r in rows[len(a):]] == \
        [(r["label"], r["class_name"]) for r in b]
    state = _train(out, tmp_path / "run")
    assert state["step"] == 2


def test_merge_matches_labels_by_class_name(tmp_path):
    a = _hand_built(tmp_path / "a", [("0", "cat"), ("1", "dog")])
    b = _hand_built(tmp_path / "b", [("0", "dog"), ("1", "owl"), ("-1", "")])
    rows = mt.merge([Manifest(a), Manifest(b)])
    assert [(r["id"], r["label"], r["class_name"]) for r in rows] == [
        ("0", "0", "cat"), ("1", "1", "dog"), ("2", "1", "dog"), ("3", "2", "owl"), ("4", "-1", "")]


def test_merge_refuses_one_dataset_twice_and_an_out_outside_the_datasets(tmp_path, capsys):
    a = _hand_built(tmp_path / "a", [("0", "cat")])
    _hand_built(tmp_path / "b", [("0", "cat")])
    _fails(["merge", str(a), str(a), "--out", str(tmp_path / "x.csv")], capsys, "merge each dataset once")
    (tmp_path / "a" / "sub").mkdir()
    _fails(["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "a" / "sub" / "x.csv")],
           capsys, "lie outside its folder", str(tmp_path / "x.csv"))
    assert not (tmp_path / "a" / "sub" / "x.csv").exists()


def test_an_out_that_is_an_input_is_refused_and_the_input_kept(tmp_path, capsys):
    """`subset M --out M` would replace the manifest it reads (64 clips -> 49): every command
    that writes an --out refuses an --out that is one of its inputs -- the same file, however
    named (the prepared folder, another spelling, a symbolic or hard link) -- and writes nothing."""
    m = _hand_built(tmp_path / "d", HAND, HAND_EXTRA)
    b = _hand_built(tmp_path / "b", [("0", "cat")])
    (tmp_path / "d" / "sym.csv").symlink_to(m)
    os.link(m, tmp_path / "d" / "hard.csv")
    (tmp_path / "d" / "sub").mkdir()
    before = m.read_bytes()
    for out in (m, tmp_path / "d" / "sub" / ".." / "manifest.csv", tmp_path / "d" / "sym.csv",
                tmp_path / "d" / "hard.csv"):
        for given in (m, m.parent):  # the manifest, or the prepared folder holding it
            _fails(["subset", str(given), "--classes", "cat", "--out", str(out)], capsys,
                   f"--out {out}: is the input manifest {m}", "choose another --out")
            assert m.read_bytes() == before and (tmp_path / "d" / "hard.csv").read_bytes() == before
    assert (tmp_path / "d" / "sym.csv").is_symlink()
    _fails(["merge", str(b), str(m), "--out", str(m)], capsys,
           f"--out {m}: is the input manifest {m}", "choose another --out")
    _fails(["merge", str(b.parent), str(m.parent), "--out", str(b)], capsys,
           f"--out {b}: is the input manifest {b}", "choose another --out")
    half = tmp_path / "d" / "half.csv"  # said before merge's own checks (the same clips twice)
    assert mt.main(["subset", str(m), "--classes", "cat", "--out", str(half)]) == 0
    half_before = half.read_bytes()
    _fails(["merge", str(half), str(m.parent), "--out", str(half)], capsys,
           f"--out {half}: is the input manifest {half}", "choose another --out")
    assert m.read_bytes() == before and len(_rows(b)) == 1 and half.read_bytes() == half_before
    assert not [p for p in tmp_path.rglob(".*.tmp*")]  # nothing half-written either


def _hand_built(folder, labels, extra=None):
    """A manifest of len(labels) clips with (empty) media files: the checks never decode."""
    (folder / "clips").mkdir(parents=True)
    head = ["id", "video", "audio", "mel", "label", "class_name", "split1", "fold", "duration",
            "frames", "fps", "audio_present", "silent"]
    lines = [",".join(head)]
    for i, (label, name) in enumerate(labels):
        for ext in ("webm", "mel.npy"):
            (folder / "clips" / f"c{i}.{ext}").write_bytes(b"")
        cells = dict(id=str(i), video=f"clips/c{i}.webm", audio="", mel=f"clips/c{i}.mel.npy",
                     label=label, class_name=name, split1="", fold="", duration="2.0", frames="20",
                     fps="10", audio_present="1", silent="0")
        cells.update((extra or {}).get(i, {}))
        lines.append(",".join(cells[h] for h in head))
    (folder / "manifest.csv").write_text("\n".join(lines) + "\n")
    return folder / "manifest.csv"


HAND = [("0", "cat"), ("0", "cat"), ("0", "cat"), ("1", "dog"), ("2", "owl"), ("2", "owl"),
        ("-1", "")]
HAND_EXTRA = {0: dict(split1="train", duration="1.5"), 1: dict(split1="test", silent="1"),
              3: dict(split1="train", duration="4.0"), 4: dict(audio_present="0", mel=""),
              5: dict(fold="2"), 6: dict(duration="")}


def test_stats_of_a_hand_built_manifest(tmp_path, capsys):
    path = _hand_built(tmp_path / "d", HAND, HAND_EXTRA)
    assert mt.main(["stats", str(path), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["clips"] == 7 and s["with_video"] == 7 and s["with_audio"] == 6
    assert s["classes"] == 3 and s["unlabeled"] == 1
    assert s["per_class"] == {"0 cat": 3, "1 dog": 1, "2 owl": 2}
    # durations: 1.5, 2, 4, 2, 2, 2 (the last clip has none)
    assert s["duration_s"] == {"total": 13.5, "min": 1.5, "mean": 13.5 / 6, "max": 4.0,
                               "clips_with_duration": 6}
    assert s["splits"] == {"split1": {"(none)": 4, "test": 1, "train": 2},
                           "fold": {"(none)": 6, "2": 1}}
    assert s["flagged"] == {"silent": 1, "no_audio": 1, "notes": 0}
    assert mt.main(["stats", str(path.parent)]) == 0  # a folder, as text
    text = capsys.readouterr().out
    assert "clips: 7 (7 with video, 6 with audio)" in text and "  2 owl: 2" in text


def test_subset_by_class_split_and_fraction(tmp_path, capsys):
    path = _hand_built(tmp_path / "d", HAND, HAND_EXTRA)
    out = tmp_path / "d" / "cats_dogs.csv"
    assert mt.main(["subset", str(path), "--classes", "cat", "1", "--split", "train",
                    "--out", str(out)]) == 0
    assert [(r["id"], r["label"]) for r in _rows(out)] == [("0", "0"), ("3", "1")]  # ids kept
    assert mt.main(["subset", str(path), "--drop-classes", "owl", "-1", "--out", str(out)]) == 0
    assert [r["id"] for r in _rows(out)] == ["0", "1", "2", "3"]
    # a fraction of each class, seeded: round(2/3 * 3) = 2 cats, round(2/3) = 1 dog, 1 owl, 1 unlabeled
    picks = set()
    for seed in range(20):
        assert mt.main(["subset", str(path), "--fraction", "0.667", "--seed", str(seed),
                        "--out", str(out)]) == 0
        rows = _rows(out)
        assert [r["label"] for r in rows].count("0") == 2 and len(rows) == 5
        picks.add(tuple(r["id"] for r in rows))
        assert len(Manifest(out)) == 5
    assert len(picks) > 1  # the seed decides which
    sub = tmp_path / "d" / "clips" / "only_owls.csv"  # another folder inside the dataset
    assert mt.main(["subset", str(path), "--classes", "owl", "--out", str(sub)]) == 0
    assert [r["video"] for r in _rows(sub)] == ["c4.webm", "c5.webm"]
    assert len(Manifest(sub)) == 2


def test_subset_mistakes_are_one_line(tmp_path, capsys):
    path = _hand_built(tmp_path / "d", HAND, HAND_EXTRA)
    out = str(tmp_path / "d" / "x.csv")
    _fails(["subset", str(path), "--classes", "zebra", "--out", out], capsys, "--classes zebra",
           "cat, dog, owl")
    _fails(["subset", str(path), "--split", "split2:test", "--out", out], capsys, "no column 'split2'")
    _fails(["subset", str(path), "--fraction", "0", "--out", out], capsys, "--fraction")
    _fails(["subset", str(path), "--classes", "dog", "--split", "test", "--out", out], capsys,
           "no clip is left")
    _fails(["stats", str(tmp_path / "nope")], capsys, "no manifest")
    _fails(["subset", str(path), "--split", "validation", "--out", out], capsys,
           "--split split 'validation': use 'train'/'test'")


def test_a_manifest_copied_out_of_its_folder_says_why_and_how(tmp_path, capsys):
    """Every clip missing: the line says that paths are relative to the manifest's folder and
    how to write a manifest elsewhere, not "re-run prepare"."""
    path = _hand_built(tmp_path / "d", HAND, HAND_EXTRA)
    (tmp_path / "elsewhere").mkdir()
    moved = Path(shutil.copy(path, tmp_path / "elsewhere" / "manifest.csv"))
    _fails(["stats", str(moved)], capsys, "relative to the manifest's own folder",
           str(tmp_path / "elsewhere"), "manifest_tools subset")
    with pytest.raises(SystemExit):
        mt.main(["stats", str(moved)])
    assert "re-run" not in capsys.readouterr().err


def test_a_duplicated_id_is_still_one_clear_error(tmp_path):
    path = _hand_built(tmp_path / "d", HAND, {2: dict(id="0")})
    with pytest.raises(ManifestError, match=r"line 4 \(id '0'\): id '0' is also the id of line 2"):
        Manifest(path)


def test_python_dash_m_data_dali_manifest_tools_runs(tmp_path):
    path = _hand_built(tmp_path / "d", HAND)
    res = subprocess.run([sys.executable, "-m", "data_dali.manifest_tools", "stats", str(path)],
                         capture_output=True, text=True)
    assert res.returncode == 0 and "clips: 7" in res.stdout, res.stderr
    old = subprocess.run([sys.executable, "-m", "data_dali.manifest", "stats", str(path)],
                         capture_output=True, text=True)  # the format module: no commands
    assert old.returncode == 1 and old.stderr.count("\n") == 1, old.stderr
    assert "python -m data_dali.manifest_tools" in old.stderr


def test_stats_into_a_reader_that_left_ends_quietly(tmp_path):
    """`cmacc-manifest stats ... | head`: the reader is gone before the output is written; the
    command ends as a SIGPIPE would (exit 141), without a traceback."""
    path = _hand_built(tmp_path / "d", HAND)
    proc = subprocess.Popen([sys.executable, "-m", "data_dali.manifest_tools", "stats", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the interpreter has even started: nothing reads what it writes
    err = proc.stderr.read().decode()
    assert proc.wait() == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_help_names_the_installed_command(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/cmacc-manifest", "--help"])
    with pytest.raises(SystemExit):
        mt.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: cmacc-manifest ")


def _fails(argv, capsys, *says):
    with pytest.raises(SystemExit) as e:
        mt.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:"), err
    for s in says:
        assert s in err, err
