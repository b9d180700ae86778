"""Bad command lines of the app commands (eval, analysis, mi, plot, demo): each is one line on
stderr naming the thing and the fix, exit code 2, no traceback; ``--debug`` re-raises; a real
bug still raises; and the analyses check their data before any pretraining starts."""

import csv
import json
import os

import pytest
import torch

from cmacc import checkpoint as ckpt
from cmacc.apps import analysis, demo, mi, plot
from cmacc.apps import eval as ev
from cmacc.trainer import Trainer


def fails(main, argv, capsys, *names) -> str:
    """Run ``main(argv)``: exit 2, no traceback, the last stderr line an error naming ``names``."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert "error: " in last, err
    for name in names:
        assert str(name) in last, err
    return last


@pytest.fixture(scope="module")
def junk(tmp_path_factory):
    """Files that are not checkpoints, and a plain file to misuse as an output folder."""
    d = tmp_path_factory.mktemp("junk")
    (d / "random.pt").write_bytes(os.urandom(2048))
    (d / "config.json").write_text(json.dumps({"model": {}, "config": {}}))
    torch.save(torch.zeros(3), d / "tensor.pt")
    (d / "empty").mkdir()
    (d / "a_file").write_text("not a folder")
    return d


@pytest.fixture
def prepared(tiny_prepared):
    """A tiny prepared class-folder dataset (no split columns): its manifest.csv."""
    return str(tiny_prepared[1] / "manifest.csv")


def variant(manifest, name, **values):
    """A copy of ``manifest`` beside it (so its relative paths resolve) with columns set."""
    with open(manifest, newline="") as f:
        reader = csv.DictReader(f)
        fields, rows = list(reader.fieldnames), list(reader)
    path = os.path.join(os.path.dirname(manifest), name)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows({**r, **values} for r in rows)
    return path


def _no_training(self):
    pytest.fail("pretraining started before the command checked its data")


# -- eval ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, why", [("random.pt", "not a checkpoint file"),
                                       ("config.json", "not a checkpoint file"),
                                       ("tensor.pt", "not a checkpoint written by train.py"),
                                       ("empty", "no readable checkpoint"),
                                       ("missing.pt", "no such checkpoint")])
def test_eval_rejects_what_is_not_a_checkpoint(junk, capsys, name, why):
    last = fails(ev.main, [junk / name], capsys, junk / name, why)
    assert "train.py" in last  # the fix: a checkpoint train.py wrote


def test_eval_names_a_missing_manifest(tiny_run, tmp_path, capsys):
    fails(ev.main, [tiny_run, "--data", tmp_path / "none.csv", "--out", tmp_path],
          capsys, "--data", tmp_path / "none.csv", "data_dali.prepare")


def test_eval_names_splits_that_do_not_exist(tiny_run, tmp_path, capsys):
    fails(ev.main, [tiny_run, "--splits", "7", "--out", tmp_path], capsys, "--splits 7",
          "has splits 1")


@pytest.mark.parametrize("out", ["a_file", "a_file/sub"])
def test_eval_out_must_be_a_writable_folder(tiny_run, junk, capsys, out):
    fails(ev.main, [tiny_run, "--out", junk / out], capsys, "--out", junk / out)


def test_eval_modality_the_manifest_lacks(tiny_run, prepared, tmp_path, capsys):
    silent = variant(prepared, "video_only.csv", audio="", mel="", audio_present="0")
    fails(ev.main, [tiny_run, "--data", silent, "--modality", "audio", "--out", tmp_path],
          capsys, silent, "audio")


def test_eval_split_without_test_clips(tiny_run, prepared, tmp_path, capsys):
    no_test = variant(prepared, "no_test.csv", split1="train")
    fails(ev.main, [tiny_run, "--data", no_test, "--out", tmp_path], capsys, no_test,
          "split1", "0 test clips")


def test_eval_names_a_missing_test_split_and_how_to_get_one(tiny_run, prepared, tmp_path, capsys):
    """Issue 51: a manifest whose split column marks no clip 'test' was told "0 test clips with
    audio ... prepare the data with audio", though its clips have audio: the line says the
    manifest has no test split and how to get one."""
    no_test = variant(prepared, "no_test_split.csv", split1="train")
    last = fails(ev.main, [tiny_run, "--data", no_test, "--modality", "audio", "--out", tmp_path],
                 capsys, no_test, "split1 has 12 train and 0 test clips with audio",
                 "the manifest has no test split", "split1 column marks 12 clip(s), none 'test'",
                 "split column of the --list file", "'heldout'")
    assert "prepare the data with audio" not in last


def test_eval_flag_values_are_argparse_errors(tiny_run, capsys):
    with pytest.raises(SystemExit) as e:
        ev.main([str(tiny_run), "--batch-size", "0"])
    assert e.value.code == 2 and "--batch-size" in capsys.readouterr().err


# -- analysis --------------------------------------------------------------------------------------
def test_analysis_gallery_needs_a_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(Trainer, "run", _no_training)
    fails(analysis.main, ["gallery", "--out", tmp_path], capsys, "gallery needs a run folder")
    fails(analysis.main, ["perclass", tmp_path / "nope", "--out", tmp_path], capsys,
          tmp_path / "nope", "no such checkpoint")


def test_analysis_perclass_of_a_manifest_run_needs_its_manifest(tiny_run, prepared, tmp_path,
                                                                 capsys):
    """perclass / gallery read a manifest run's own clips (test_analysis.py): a manifest that
    is gone is one line naming it and --data; the synthetic clips are refused for such a run."""
    import hashlib

    path, state = ckpt.find_latest_valid(tiny_run)
    gone = tmp_path / "UCF101" / "manifest.csv"
    state["config"]["data"]["source"] = str(gone)
    state["data"] = {"source": str(gone), "manifest_sha256": "0" * 64}
    (tmp_path / "run").mkdir()
    torch.save(state, tmp_path / "run" / path.name)
    fails(analysis.main, ["perclass", tmp_path / "run", "--out", tmp_path], capsys,
          gone, "not there", "--data MANIFEST")
    sha = hashlib.sha256(open(prepared, "rb").read()).hexdigest()
    state["config"]["data"]["source"] = prepared
    state["data"] = {"source": prepared, "manifest_sha256": sha}
    torch.save(state, tmp_path / "run" / path.name)
    fails(analysis.main, ["gallery", tmp_path / "run", "--data", "synthetic", "--out", tmp_path],
          capsys, "--data synthetic", prepared)


def test_analysis_bad_dictionary_size_fails_before_pretraining(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(Trainer, "run", _no_training)
    fails(analysis.main, ["dictsize", "--sizes", "4", "--out", tmp_path / "an"], capsys,
          "K4_random", "dict_size K=4")
    assert not (tmp_path / "an" / "K4_random").exists()


def test_analysis_out_is_a_file(junk, capsys, monkeypatch):
    monkeypatch.setattr(Trainer, "run", _no_training)
    fails(analysis.main, ["diversity", "--out", junk / "a_file"], capsys, "--out",
          junk / "a_file")


def test_analysis_all_on_a_manifest_pretrains(prepared, tmp_path, monkeypatch):
    """``all --data MANIFEST`` was refused while gallery and perclass read only the synthetic
    clips; now they read OUT/active/seed0's manifest, so the pretraining starts."""
    class Started(Exception):
        pass

    def run(self):
        raise Started

    monkeypatch.setattr(Trainer, "run", run)
    with pytest.raises(Started):
        analysis.main(["all", "--data", prepared, "--out", str(tmp_path)])


def test_analysis_checks_the_probe_splits_before_pretraining(prepared, tmp_path, capsys,
                                                             monkeypatch):
    """The reported case: a manifest whose probe cannot run used to pretrain a whole run and
    then die; now the splits are checked first."""
    monkeypatch.setattr(Trainer, "run", _no_training)
    no_test = variant(prepared, "all_train.csv", split1="train")
    fails(analysis.main, ["diversity", "--data", no_test, "--out", tmp_path / "an"], capsys,
          no_test, "0 test clips")
    assert not (tmp_path / "an" / "random").exists()  # no run folder made either


def test_analysis_class_folder_manifest_splits_are_settled_before_pretraining(
        prepared, tmp_path, capsys, monkeypatch):
    """A class-folder manifest (no split column) gets data_dali's seeded held-out split, so the
    probes after pretraining can run: settled before pretraining starts."""
    started = []

    class Started(Exception):
        pass

    def run(self):
        started.append(self.cfg)
        raise Started

    monkeypatch.setattr(Trainer, "run", run)
    with pytest.raises(Started):
        analysis.main(["diversity", "--data", prepared, "--out", str(tmp_path)])
    for modality in ("video", "audio"):
        _, chosen = ev.eval_data(started[0], prepared, modality=modality)
        assert chosen and all(len(tr) and len(te) for _, tr, te in chosen)


# -- mi, plot, demo ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def few_glyphs(tmp_path_factory):
    """Two alphabets of 3 characters by 20 drawers, and the same by only 5 drawers."""
    d = tmp_path_factory.mktemp("glyphs")
    return (mi.make_glyphs(d / "g20", alphabets=2, chars=3, drawers=20),
            mi.make_glyphs(d / "g5", alphabets=2, chars=3, drawers=5))


def test_mi_without_omniglot(tmp_path, capsys):
    fails(mi.main, ["--omniglot", tmp_path / "none", "--out", tmp_path], capsys,
          tmp_path / "none", "torchvision's layout", "--make-glyphs")
    fails(mi.main, ["--out", tmp_path], capsys, "--omniglot")


def test_mi_checks_alphabets_and_drawers_before_training(few_glyphs, tmp_path, capsys):
    g20, g5 = few_glyphs
    fails(mi.main, ["--omniglot", g20, "--chars", "1", "3", "--out", tmp_path], capsys, g20,
          "3 characters need 3 alphabets", "--chars")
    fails(mi.main, ["--omniglot", g5, "--chars", "1", "--out", tmp_path], capsys, g5,
          "only 5 drawings")
    assert not (tmp_path / "mi.json").exists()


def test_mi_out_is_a_file(few_glyphs, junk, capsys):
    fails(mi.main, ["--omniglot", few_glyphs[0], "--out", junk / "a_file"], capsys, "--out",
          junk / "a_file")


def test_plot_needs_metrics(tiny_run, junk, tmp_path, capsys):
    fails(plot.main, [junk / "empty"], capsys, junk / "empty", "no metrics.csv")
    fails(plot.main, [junk / "config.json"], capsys, junk / "config.json", "no 'step' column")
    fails(plot.main, [tiny_run, "--keys", "loss", "nosuch"], capsys, "--keys nosuch")
    fails(plot.main, [tiny_run, "--out", tmp_path], capsys, "--out", tmp_path, "is a folder")
    fails(plot.main, [tiny_run, "--out", junk / "a_file" / "c.png"], capsys, "--out",
          junk / "a_file")


def test_demo_out_is_a_file(junk, capsys, monkeypatch):
    monkeypatch.setattr(Trainer, "run", _no_training)
    monkeypatch.setattr(demo, "prepare_demo_data", lambda out: pytest.fail("prepared first"))
    fails(demo.main, ["--out", junk / "a_file"], capsys, "--out", junk / "a_file")


# -- the convention ------------------------------------------------------------------------------
@pytest.mark.parametrize("app", [ev, analysis, mi, plot, demo], ids=lambda m: m.__name__)
def test_help_documents_debug(app, capsys):
    with pytest.raises(SystemExit) as e:
        app.main(["--help"])
    assert e.value.code == 0 and "--debug" in capsys.readouterr().out


def test_debug_reraises_the_original_error(tmp_path):
    with pytest.raises(ev.CheckpointError, match="no such checkpoint"):
        ev.main([str(tmp_path / "none.pt"), "--debug"])
    with pytest.raises(mi.OmniglotError, match="torchvision's layout"):
        mi.main(["--debug", "--omniglot", str(tmp_path / "none"), "--out", str(tmp_path)])


def test_a_real_bug_still_raises(tiny_run, tmp_path, monkeypatch):
    def bug(*args, **kwargs):
        raise ZeroDivisionError("a bug, not a user's mistake")

    monkeypatch.setattr(ev, "evaluate", bug)
    with pytest.raises(ZeroDivisionError):
        ev.main([str(tiny_run), "--out", str(tmp_path)])


def test_plot_labels_runs_of_one_name_alike(tiny_run, tmp_path, monkeypatch):
    """Two runs named seed0 (runs/analysis/active/seed0, .../random/seed0) are labelled by the
    parts that tell them apart, both the same way: active/seed0 and random/seed0."""
    import shutil

    for s in ("active", "random"):
        (tmp_path / s / "seed0").mkdir(parents=True)
        shutil.copy(tiny_run / "metrics.csv", tmp_path / s / "seed0")
    seen = {}
    monkeypatch.setattr(plot, "plot_metrics", lambda paths, out, keys: seen.update(paths) or out)
    assert plot.main([str(tmp_path / "active" / "seed0"), str(tmp_path / "random" / "seed0"),
                      "--out", str(tmp_path / "c.png")]) == 0
    assert seen == {"active/seed0": str(tmp_path / "active" / "seed0" / "metrics.csv"),
                    "random/seed0": str(tmp_path / "random" / "seed0" / "metrics.csv")}


@pytest.mark.parametrize("main,defaults", [
    (ev.main, ["--data DATA 'synthetic' or a prepared manifest.csv (default: the data the run "
               "was pretrained on", "--modality {video,audio} the encoder to evaluate (default: "
               "video; an exported file's own)", "(default: linear)", "fine-tuning epochs "
               "(default: 10)"]),
    (analysis.main, ["(default: runs/analysis)"]),
    (plot.main, ["--out OUT the PNG to write (default: curves.png)"]),
    (mi.main, ["(default: runs/mi)"]),
])
def test_help_shows_the_defaults(main, defaults, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # (argparse wraps lines)
    for d in defaults:
        assert d in text, d
