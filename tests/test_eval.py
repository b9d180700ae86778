"""Downstream protocols: the linear probe against planted signal and pure noise; the eval CLI
on a tiny checkpoint; held-out splits never mix train and test items. The evaluation names its
data (a run's own by default, never the synthetic clips for a run pretrained on a manifest),
records what it measured, keeps results of other data side by side, leaves damaged clips out
(named, counted, a limit), and evaluates exported encoder files."""

import csv
import hashlib
import json
import math
import shutil
import subprocess

import numpy as np
import pytest
import torch

from cmacc.apps import eval as ev
from cmacc.config import DataConfig
from cmacc.data import eval_splits
from cmacc.probe import linear_probe


def test_linear_probe_recovers_planted_linear_signal():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 24, generator=g)
    w = torch.randn(24, 5, generator=g)
    y = (x @ w).argmax(1)  # linearly separable by construction
    res = linear_probe(x[:3000], y[:3000], x[3000:], y[3000:], num_classes=5)
    assert res["top1"] >= 0.95 and res["train_top1"] >= 0.98


def test_linear_probe_is_at_chance_on_noise():
    g = torch.Generator().manual_seed(1)
    n_test, c = 3000, 4
    x = torch.randn(1000 + n_test, 16, generator=g)
    y = torch.randint(0, c, (1000 + n_test,), generator=g)  # independent of x
    res = linear_probe(x[:1000], y[:1000], x[1000:], y[1000:], num_classes=c)
    sigma = math.sqrt(0.25 * 0.75 / n_test)
    assert abs(res["top1"] - 1 / c) < 4 * sigma, res


def test_linear_probe_rejects_empty_split():
    with pytest.raises(ValueError, match="empty train or test"):
        linear_probe(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long), torch.zeros(2, 3),
                     torch.zeros(2, dtype=torch.long))


def test_toy_split_is_disjoint_and_class_balanced():
    ds = eval_splits("synthetic", DataConfig(clips=96, classes=6, frames=4, size=16), 0,
                     modality="video")
    (_, tr, te), = ds.splits()
    assert not set(tr.tolist()) & set(te.tolist())
    assert sorted(tr.tolist() + te.tolist()) == list(range(96))
    assert torch.bincount(ds.data.labels[te], minlength=6).tolist() == [4] * 6


def test_eval_cli_linear_writes_results(tiny_run, capsys):
    assert ev.main([str(tiny_run), "--modality", "audio"]) == 0
    res = json.loads((tiny_run / "eval" / "eval_audio_linear_synthetic.json").read_text())
    assert res["splits"][0]["n_test"] == 24 and res["splits"][0]["num_classes"] == 6
    assert "| **mean** |" in capsys.readouterr().out


def test_finetune_learns_the_synthetic_audio_classes(tiny_run):
    model, state = ev.load_pretrained(tiny_run)
    res = ev.evaluate(model, state, "synthetic", modality="audio", protocol="finetune",
                      epochs=4, batch_size=16)
    assert res["top1_mean"] > 0.5  # chance is 1/6


def test_eval_cli_names_a_missing_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ev.main([str(tmp_path / "nothing-here")])
    assert e.value.code == 2 and "no such checkpoint" in capsys.readouterr().err


# -- what an evaluation measured, and on which data (issue 31) ---------------------------------

def _errline(capsys):
    """The command's error line, and its error lines (log lines aside): one, no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.strip().splitlines() if not ln[:2].isdigit()]  # not a log line
    assert lines, "no error line"
    return lines[-1], lines


def _pretrained_on(tiny_run, manifest, dest):
    """tiny_run's checkpoint in ``dest`` as a run pretrained on ``manifest`` records it."""
    from cmacc import checkpoint as ckpt

    src = sorted(tiny_run.glob("ckpt_*.pt"))[-1]
    state = ckpt.load(src)
    state["config"]["data"]["source"] = str(manifest)
    state["data"] = {"source": str(manifest.resolve()), "manifest_sha256": _sha(manifest)}
    ckpt.save_atomic(state, dest / src.name)
    return dest


@pytest.fixture
def data_copy(tiny_prepared, tmp_path):
    """A copy of the 12-clip prepared set (2 classes, a held-out split); its manifest."""
    shutil.copytree(tiny_prepared[1], tmp_path / "data")
    return tmp_path / "data" / "manifest.csv"


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_run_pretrained_on_a_manifest_is_evaluated_on_it_and_says_so(tiny_run, data_copy,
                                                                        tmp_path, capsys):
    run = _pretrained_on(tiny_run, data_copy, tmp_path / "run")
    assert ev.main([str(run), "--modality", "audio"]) == 0
    captured = capsys.readouterr()
    first = captured.err.splitlines()[0]  # the first log line names the encoder and the data
    assert " INFO evaluating the audio query encoder of " in first and "(step 6)" in first
    assert str(data_copy.resolve()) in first and "the run's own pretraining data" in first
    (js,) = (run / "eval").glob("eval_audio_linear_*.json")
    res = json.loads(js.read_text())
    assert res["data"]["source"] == str(data_copy.resolve())
    assert res["data"]["manifest_sha256"] == _sha(data_copy)
    assert js.name == f"eval_audio_linear_data-{_sha(data_copy)[:8]}.json"
    assert res["splits"][0]["num_classes"] == 2  # the manifest's classes, not the toy's 6
    assert res["splits"][0]["n_train"] + res["splits"][0]["n_test"] == 12

    # the synthetic clips are refused for it, in one line naming --data
    with pytest.raises(SystemExit) as e:
        ev.main([str(run), "--modality", "audio", "--data", "synthetic"])
    line, err = _errline(capsys)
    assert e.value.code == 2 and len(err) == 1
    assert line.startswith("error: --data synthetic: ") and str(data_copy) in line

    # its data gone: one line naming --data, no fallback
    shutil.move(data_copy.parent, tmp_path / "moved")
    with pytest.raises(SystemExit) as e:
        ev.main([str(run), "--modality", "audio"])
    line, err = _errline(capsys)
    assert e.value.code == 2 and len(err) == 1
    assert line.startswith("error: --data: ") and "not there now" in line and str(data_copy) in line


def test_a_run_records_its_manifest_by_absolute_path_and_hash_and_continues_only_on_it(
        data_copy, tmp_path, monkeypatch, capsys):
    """--data typed relative: the checkpoint, eval and the model card name the manifest by
    its absolute path and SHA-256, so eval from another folder finds it; the same clips in
    another row order (the dictionaries' indices would point at other clips) are refused, by
    train.py in one line naming both hashes and by eval of the run's own data."""
    import train
    from cmacc import checkpoint as ckpt
    from cmacc.apps import export as ex

    monkeypatch.chdir(data_copy.parent.parent)
    small = ["--preset", "tiny", "--batch-size", "4", "--dict-size", "8", "--pool-size", "16",
             "--data", "data/manifest.csv", "--loader", "reference", "--workers", "0",
             "--out", "run"]
    train.main(small + ["--steps", "1"])
    sha = _sha(data_copy)
    state = ckpt.load(tmp_path / "run" / "ckpt_00000001.pt")
    assert state["data"] == {"source": str(data_copy.resolve()), "manifest_sha256": sha}
    assert state["config"]["data"]["source"] == str(data_copy.resolve())

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert ev.main(["../run", "--modality", "audio"]) == 0
    assert "the run's own pretraining data" in capsys.readouterr().err
    assert ex.main(["../run", "--out", "../exported"]) == 0
    card = json.loads((tmp_path / "exported" / "model_card.json").read_text())
    assert card["data"] == {"source": str(data_copy.resolve()), "manifest_sha256": sha}
    assert card["checkpoint"] == str(tmp_path / "run" / "ckpt_00000001.pt")

    header, *rows = data_copy.read_text().splitlines(keepends=True)
    data_copy.write_text(header + "".join(rows[::-1]))  # the same clips, other row positions
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        ev.main(["../run", "--modality", "audio"])
    line, err = _errline(capsys)
    assert e.value.code == 2 and len(err) == 1 and "has changed since" in line
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        train.main(small + ["--steps", "2"])
    line, err = _errline(capsys)
    assert e.value.code == 2 and len(err) == 1
    assert sha[:12] in line and _sha(data_copy)[:12] in line and "ckpt_00000001.pt" in line
    assert not (tmp_path / "run" / "ckpt_00000002.pt").exists()


def test_an_audio_only_dataset_points_at_the_audio_encoder(tiny_run, data_copy, capsys):
    """Labelled clips with audio but none with video (spoken digits): the video probe's line
    names the fix, --modality audio."""
    with data_copy.open(newline="") as f:
        rows = list(csv.DictReader(f))
    with data_copy.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(dict(r, video="") for r in rows)
    with pytest.raises(SystemExit) as e:
        ev.main([str(tiny_run), "--data", str(data_copy), "--modality", "video"])
    line, err = _errline(capsys)
    assert e.value.code == 2 and len(err) == 1
    assert "no labelled clips with video, but labelled clips with audio" in line
    assert line.endswith("(--modality audio)")


def _git_head():
    from cmacc.apps import ROOT

    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                         text=True)
    return out.stdout.strip() or None


def test_results_record_what_they_measured_and_other_data_sit_side_by_side(
        tiny_run, data_copy, tmp_path, capsys):
    from cmacc.apps import export as ex

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("eval"))
    assert ev.main([str(run), "--modality", "audio"]) == 0  # the run's own: synthetic
    assert ev.main([str(run), "--modality", "audio", "--data", str(data_copy), "--clips", "2"]) == 0
    capsys.readouterr()
    tag = f"data-{_sha(data_copy)[:8]}"
    names = sorted(p.name for p in (run / "eval").glob("*.json"))
    assert names == ["eval_audio_linear_data-" + _sha(data_copy)[:8] + ".json",
                     "eval_audio_linear_synthetic.json"]
    syn = json.loads((run / "eval" / "eval_audio_linear_synthetic.json").read_text())
    real = json.loads((run / "eval" / f"eval_audio_linear_{tag}.json").read_text())
    ckpt = sorted(run.glob("ckpt_*.pt"))[-1]
    for res in (syn, real):
        assert res["checkpoint"] == str(ckpt) and res["step"] == 6
        assert res["settings"] == {"weight_decay": 1e-4, "max_iter": 200, "batch_size": 64}
        assert res["commit"] == _git_head()
        assert res["date"].endswith("+00:00") and res["bad_clips"]["count"] == 0
        assert res["frames"] == 8  # the tiny preset's clip length
    assert syn["data"]["source"] == "synthetic" and syn["clips"] == 1
    assert real["data"]["manifest_sha256"] == _sha(data_copy) and real["clips"] == 2
    assert syn["splits"][0]["num_classes"] == 6 and real["splits"][0]["num_classes"] == 2

    # the model card carries both, each with its dataset
    assert ex.main([str(run), "--out", str(tmp_path / "exported")]) == 0
    capsys.readouterr()
    card = json.loads((tmp_path / "exported" / "model_card.json").read_text())
    assert sorted(card["eval"]) == names
    assert card["eval"][names[0]]["data"]["manifest_sha256"] == _sha(data_copy)
    assert card["eval"][names[1]]["data"]["source"] == "synthetic"


def test_a_result_that_names_no_dataset_stays_off_the_model_card(tiny_run, tmp_path, capsys):
    from cmacc.apps import export as ex

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("eval"))
    (run / "eval").mkdir()
    (run / "eval" / "eval_video_linear.json").write_text(json.dumps(
        {"modality": "video", "protocol": "linear", "top1_mean": 0.9, "splits": []}))
    assert ex.main([str(run), "--out", str(tmp_path / "exported")]) == 0
    err = capsys.readouterr().err
    assert json.loads((tmp_path / "exported" / "model_card.json").read_text())["eval"] == {}
    assert "eval_video_linear.json records no dataset" in err


def _rows(manifest):
    return list(csv.DictReader(open(manifest, newline="")))


def test_a_nan_mel_is_left_out_named_and_counted_never_a_poisoned_figure(tiny_run, data_copy,
                                                                          tmp_path, capsys):
    rows = _rows(data_copy)
    out = tmp_path / "eval"
    assert ev.main([str(tiny_run), "--modality", "audio", "--data", str(data_copy),
                    "--out", str(out)]) == 0
    clean = json.loads(next(out.glob("*.json")).read_text())
    mel_file = data_copy.parent / rows[5]["mel"]
    mel = np.load(mel_file)
    mel[7, 3] = np.nan
    np.save(mel_file, mel)
    assert ev.main([str(tiny_run), "--modality", "audio", "--data", str(data_copy),
                    "--out", str(tmp_path / "eval2")]) == 0
    err = capsys.readouterr().err
    res = json.loads(next((tmp_path / "eval2").glob("*.json")).read_text())
    assert res["bad_clips"]["count"] == 1
    (bad,) = res["bad_clips"]["clips"]
    assert bad["index"] == 5 and bad["file"].endswith(rows[5]["mel"]) and "non-finite" in bad["reason"]
    assert f"damaged clip {bad['file']}" in err and "left out of the evaluation" in err
    s0, s1 = clean["splits"][0], res["splits"][0]
    assert s1["n_train"] + s1["n_test"] == s0["n_train"] + s0["n_test"] - 1
    assert math.isfinite(res["top1_mean"]) and math.isfinite(s1["train_top1"])

    # past --max-bad-clips: one line, exit 2, no result
    with pytest.raises(SystemExit) as e:
        ev.main([str(tiny_run), "--modality", "audio", "--data", str(data_copy),
                 "--max-bad-clips", "0", "--out", str(tmp_path / "eval3")])
    line, _ = _errline(capsys)
    assert e.value.code == 2
    assert line.startswith("error: ") and "1 damaged clips, more than --max-bad-clips 0" in line
    assert not (tmp_path / "eval3").exists()  # nothing written, not even the folder


def test_truncated_videos_are_left_out_not_a_traceback(tiny_run, data_copy, tmp_path, capsys):
    rows = _rows(data_copy)
    video = data_copy.parent / rows[1]["video"]
    video.write_bytes(video.read_bytes()[:video.stat().st_size // 2])  # the cheap check sees it
    hidden = data_copy.parent / rows[2]["video"]  # 'unknown size': only decoding finds it
    raw = bytearray(hidden.read_bytes())
    seg = raw.index(b"\x18\x53\x80\x67")
    n = 8 - raw[seg + 4].bit_length() + 1
    raw[seg + 4:seg + 4 + n] = bytes([0xFF >> (n - 1)]) + b"\xff" * (n - 1)
    hidden.write_bytes(bytes(raw[:len(raw) // 3]))
    assert ev.main([str(tiny_run), "--modality", "video", "--data", str(data_copy),
                    "--out", str(tmp_path / "eval")]) == 0
    capsys.readouterr()
    res = json.loads(next((tmp_path / "eval").glob("*.json")).read_text())
    named = {c["index"]: c for c in res["bad_clips"]["clips"]}
    assert sorted(named) == [1, 2] and res["bad_clips"]["count"] == 2
    assert "truncated" in named[1]["reason"] and named[2]["reason"].startswith("cannot decode")
    s = res["splits"][0]
    assert s["n_train"] + s["n_test"] == 10


def test_an_exported_encoder_is_evaluated_and_named(tiny_run, tmp_path, capsys):
    from cmacc.apps import export as ex

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("eval"))
    assert ex.main([str(run), "--out", str(tmp_path / "exported")]) == 0
    audio = tmp_path / "exported" / "audio_resnet1d.pt"
    assert ev.main([str(audio)]) == 0  # its modality is the file's; its data, the card's
    assert ev.main([str(run), "--modality", "audio"]) == 0  # the same weights, from the run
    err = capsys.readouterr().err
    got = json.loads((tmp_path / "exported" / "eval" / "eval_audio_linear_synthetic.json").read_text())
    want = json.loads((run / "eval" / "eval_audio_linear_synthetic.json").read_text())
    assert got["encoder"].startswith(f"the exported audio encoder {audio}")
    assert f"evaluating the exported audio encoder {audio}" in err
    assert got["step"] == 6 and got["data"]["source"] == "synthetic"
    assert got["top1_mean"] == want["top1_mean"]

    with pytest.raises(SystemExit) as e:
        ev.main([str(tmp_path / "exported" / "video_r3d_18.pt"), "--modality", "audio"])
    line, err = _errline(capsys)
    assert e.value.code == 2 and len(err) == 1
    assert line == (f"error: --modality audio: {tmp_path / 'exported' / 'video_r3d_18.pt'} is an "
                    "exported video encoder; pass --modality video, or the audio file of the "
                    "export")


# -- the baselines a score must beat (issue 51, items 3 and 4) ---------------------------------

def test_baselines_are_the_majority_class_and_each_clip_property_alone():
    """The issue's Kinetics test split: 9 of 15 clips of one class (the video probe's 60.0 %
    was exactly that), every 'typing' clip silent and no other (the audio probe's 93.3 % was
    'silent means typing', 14/15). A property that says nothing scores the majority."""
    from cmacc.probe import baselines

    y_train = torch.tensor([0] * 27 + [1] * 12 + [2] * 3)
    y_test = torch.tensor([0] * 9 + [1] * 5 + [2])
    silent = (y_train == 1, y_test == 1)
    spread = (torch.arange(42) % 2 == 0, torch.arange(15) % 2 == 0)  # in every class alike
    b = baselines(y_train, y_test, {"silent audio": silent, "padded": spread})
    assert b["majority_top1"] == 9 / 15 and b["majority_label"] == 0
    assert b["property_top1"] == {"silent audio": 14 / 15, "padded": 9 / 15}
    unseen = (torch.zeros(42, dtype=torch.bool), y_test == 2)  # no train clip has it
    assert baselines(y_train, y_test, {"x": unseen})["property_top1"] == {"x": 9 / 15}


def _rewrite(manifest, change):
    rows = _rows(manifest)
    with manifest.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(change(dict(r)) for r in rows)


def test_every_probe_result_prints_and_records_the_baselines_it_must_beat(tiny_run, data_copy,
                                                                          tmp_path, capsys):
    """One class all silent: the result (JSON and the table printed) holds the majority-class
    rate of each test split and what 'silent audio' alone scores beside the probe's top-1, and
    a probe that does not beat it is warned about (issue 51: eval printed 93.3 % and nothing
    else)."""
    def silence_class_0(r):
        if r["label"] == "0":
            r["silent"], r["notes"] = "1", "silent audio"
        return r

    _rewrite(data_copy, silence_class_0)
    assert ev.main([str(tiny_run), "--modality", "audio", "--data", str(data_copy),
                    "--out", str(tmp_path / "eval")]) == 0
    captured = capsys.readouterr()
    res = json.loads(next((tmp_path / "eval").glob("*.json")).read_text())
    (split,) = res["splits"]
    assert split["majority_top1"] == 0.5 and split["majority_class"] in ("class00", "class01")
    assert split["property_top1"] == {"silent audio": 1.0}
    assert res["majority_top1_mean"] == 0.5 and res["property_top1_mean"] == {"silent audio": 1.0}
    assert "| top-1 | majority class | a clip property alone |" in captured.out
    assert f"| heldout | {100 * split['top1']:.1f} | 50.0 ({split['majority_class']}) | " \
           "100.0 (silent audio) |" in captured.out
    said = [w for w in res["warnings"] if "'silent audio' alone scores (1.0000)" in w]
    assert len(said) == 1 and said[0] in captured.err and said[0] in captured.out
    assert "majority class 0.5000" in captured.err and "'silent audio' alone 1.0000" in captured.err

    # the synthetic clips record no property: the majority class alone
    assert ev.main([str(tiny_run), "--modality", "audio", "--out", str(tmp_path / "syn")]) == 0
    syn = json.loads((tmp_path / "syn" / "eval_audio_linear_synthetic.json").read_text())
    assert syn["splits"][0]["majority_top1"] == 4 / 24 and syn["splits"][0]["property_top1"] == {}


def test_eval_repeats_the_warning_for_classes_named_like_splits(tiny_run, data_copy, tmp_path,
                                                                 capsys):
    """A manifest whose classes are train/ and test/ (prepared with --split-folders-are-classes,
    or by an older data_dali, which only warned): eval says so too, in the log and the result
    (issue 51: it reported 70.6 % with no warning)."""
    _rewrite(data_copy, lambda r: dict(r, class_name={"0": "train", "1": "Test"}[r["label"]]))
    assert ev.main([str(tiny_run), "--modality", "audio", "--data", str(data_copy),
                    "--out", str(tmp_path / "eval")]) == 0
    err = capsys.readouterr().err
    assert "class names Test, train look like splits" in err
    res = json.loads(next((tmp_path / "eval").glob("*.json")).read_text())
    said = [w for w in res["warnings"] if "look like splits" in w]
    assert said == [f"{data_copy.resolve()}: class names Test, train look like splits, not "
                    "classes: a probe would learn the split, not what the clips show; prepare the "
                    "source with --layout list --list FILE (a 'path label split' line per clip) "
                    "or, for Kinetics, --layout kinetics --splits ANNOTATIONS"]
    assert said[0] in err
