"""data_dali end to end: prepared audio and log-mels, the DALI CPU pipeline against the PyAV
reference loader, audio/video alignment, sharding, test-time clips, manifest safety, official
split bookkeeping, and the trainer reading prepared data (prepare's own checks:
test_data_prepare.py; the loader's contract: test_data_loader.py)."""

import csv

import numpy as np
import pytest
import torch

import data_dali
from data_dali import prepare as prep
from data_dali import synthetic
from data_dali.audio import MEL_FPS
from data_dali.manifest import Manifest
from data_dali.reference import ClipDataset


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_prepared_audio_is_16k_mono_and_mel_has_100_fps(broken):
    import soundfile as sf

    _, out, _, _ = broken
    m = Manifest(out / "manifest.csv")
    i = [k for k, r in enumerate(m.rows) if r["source"].endswith("ok.mp4")][0]
    wave, sr = sf.read(m.path(m.rows[i]["audio"]))
    assert sr == 16_000 and wave.ndim == 1
    mel = m.mel(i)
    assert mel.shape[0] == 80  # 3 s at 100 frames/s (+ AAC pads up to 2 frames of 1024 at the end)
    assert 3.0 * MEL_FPS <= mel.shape[1] <= 3.0 * MEL_FPS + 1 + 2048 // 160


def test_dali_cpu_pipeline_matches_reference_loader(broken):
    pytest.importorskip("nvidia.dali")
    _, out, _, _ = broken
    kw = dict(batch_size=2, clip_frames=8, crop=64, num_workers=0, seed=3)
    dali = data_dali.build_loader(out / "manifest.csv", backend="dali", **kw)
    ref = data_dali.build_loader(out / "manifest.csv", backend="reference", **kw)
    assert dali.backend == "dali"
    n = 0
    for bd, br in zip(dali, ref):
        assert torch.equal(bd["index"], br["index"]) and torch.equal(bd["label"], br["label"])
        assert bd["video"].shape == br["video"].shape == (2, 3, 8, 64, 64)
        diff = (bd["video"] - br["video"]).abs()
        assert diff.mean() < 0.05 and diff.max() < 0.5  # resampling arithmetic only
        torch.testing.assert_close(bd["audio"], br["audio"])
        n += 1
    assert n == len(dali) >= 2


@pytest.fixture(scope="module")
def click_manifest(tmp_path_factory):
    src = tmp_path_factory.mktemp("clicks")
    synthetic.write_click_clip(src / "c" / "clicks.mp4", click_frames=[5, 17, 29], seconds=4.0)
    out = tmp_path_factory.mktemp("clicks_out")
    prep.prepare(src, out, workers=1, progress=False)
    return out / "manifest.csv"


@pytest.mark.parametrize("backend", ["reference", "dali"])
def test_audio_is_aligned_with_the_sampled_frames(click_manifest, backend):
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    m = Manifest(click_manifest)
    full = m.mel(0)
    for epoch in range(6):  # random starts
        loader = data_dali.build_loader(m, batch_size=1, clip_frames=10, crop=32, seed=epoch,
                                        backend=backend, num_workers=0)
        loader.set_epoch(epoch)
        batch = next(iter(loader))
        ds = ClipDataset(m, [0], clip_frames=10, crop=32, seed=epoch)
        ds.epoch = epoch
        start = ds[0]["start"]
        seg = batch["audio"][0].numpy()  # [80, 100]
        assert seg.shape == (80, 100)
        np.testing.assert_allclose(seg, full[:, start * 10:start * 10 + 100], rtol=0, atol=1e-5)
        energy = seg.max(0)
        for k in (5, 17, 29):  # a click on frame k sits at mel frame 10 * (k - start)
            if start <= k < start + 10 - 1:
                j = 10 * (k - start)
                assert energy[j:j + 3].max() > energy.mean() + 3


def test_two_shards_cover_the_epoch_once_disjointly(broken):
    _, out, _, _ = broken
    m = Manifest(out / "manifest.csv")
    usable = m.select(need_video=True, need_audio=False)
    shards = [data_dali.build_loader(m, batch_size=1, shard_id=r, num_shards=2, seed=1,
                                     backend="reference", need_audio=False, drop_last=False)
              for r in (0, 1)]
    seen = [sum(s.shard_indices(), []) for s in shards]
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == sorted(usable)


def test_manifest_paths_must_stay_inside_the_dataset(tmp_path):
    (tmp_path / "manifest.csv").write_text(
        "id,video,audio,mel,label,frames,fps\n0,../../etc/passwd,,,0,10,10\n")
    with pytest.raises(ValueError, match="escapes the dataset folder"):
        Manifest(tmp_path / "manifest.csv")
    with pytest.raises(FileNotFoundError, match="data_dali.prepare"):
        Manifest(tmp_path / "nope.csv")


def _tiny_video(path):
    frames = np.full((20, 32, 32, 3), 128, np.uint8)
    synthetic.write_av(path, frames, 10, np.zeros(32000, np.float32), 16000)


def test_ucf101_splits_never_mix_train_and_test(tmp_path):
    src, lists = tmp_path / "UCF-101", tmp_path / "ucfTrainTestlist"
    names = [("ApplyEyeMakeup", f"v_ApplyEyeMakeup_g0{g}_c01.avi") for g in (1, 2, 3)] + \
            [("Archery", f"v_Archery_g0{g}_c01.avi") for g in (1, 2, 3)]
    for cls, f in names:
        _tiny_video(src / cls / f)
    lists.mkdir()
    for k in (1, 2, 3):  # group k is the test group of split k
        tr = [f"{c}/{f} 1" for c, f in names if f"g0{k}" not in f]
        te = [f"{c}/{f}" for c, f in names if f"g0{k}" in f]
        (lists / f"trainlist0{k}.txt").write_text("\n".join(tr) + "\n")
        (lists / f"testlist0{k}.txt").write_text("\n".join(te) + "\n")
    out = tmp_path / "out"
    prep.prepare(src, out, layout="ucf101", splits=lists, workers=1, progress=False,
                 cfg=prep.PrepareConfig(min_seconds=1.0))
    splits = data_dali.EvalSplits(out / "manifest.csv").splits()
    assert [s[0] for s in splits] == ["split1", "split2", "split3"]
    m = Manifest(out / "manifest.csv")
    for k, (_, tr, te) in enumerate(splits, 1):
        assert not set(tr.tolist()) & set(te.tolist())
        assert {m.rows[i]["source"].split("_")[-2] for i in te.tolist()} == {f"g0{k}"}
        assert len(tr) == 4 and len(te) == 2


def test_esc50_folds_never_mix_train_and_test(tmp_path):
    src = tmp_path / "ESC-50"
    (src / "audio").mkdir(parents=True)
    (src / "meta").mkdir()
    import soundfile as sf

    lines = ["filename,fold,target,category,esc10,src_file,take"]
    for fold in range(1, 6):
        for c, cat in enumerate(("dog", "rain")):
            name = f"{fold}-{c}-A-{c}.wav"
            t = np.arange(5 * 16000) / 16000
            sf.write(src / "audio" / name, 0.3 * np.sin(2 * np.pi * (300 + 300 * c) * t), 16000)
            lines.append(f"{name},{fold},{c},{cat},False,x,A")
    (src / "meta" / "esc50.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    summary = prep.prepare(src, out, workers=1, progress=False)
    assert summary["kept"] == 10
    splits = data_dali.EvalSplits(out / "manifest.csv", modality="audio").splits()
    assert [s[0] for s in splits] == [f"fold{f}" for f in range(1, 6)]
    m = Manifest(out / "manifest.csv")
    for f, (_, tr, te) in enumerate(splits, 1):
        assert not set(tr.tolist()) & set(te.tolist())
        assert {m.rows[i]["fold"] for i in te.tolist()} == {str(f)}
        assert len(te) == 2 and len(tr) == 8


def test_audio_only_loader_serves_log_mel_segments(tmp_path):
    import soundfile as sf

    src = tmp_path / "ESC"
    (src / "audio").mkdir(parents=True)
    (src / "meta").mkdir()
    lines = ["filename,fold,target,category"]
    for k in range(4):
        sf.write(src / "audio" / f"{k}.wav", 0.2 * np.random.default_rng(k).standard_normal(32000), 16000)
        lines.append(f"{k}.wav,{k % 2 + 1},{k % 2},c{k % 2}")
    (src / "meta" / "esc50.csv").write_text("\n".join(lines) + "\n")
    prep.prepare(src, tmp_path / "out", workers=1, progress=False, cfg=prep.PrepareConfig(min_seconds=1.0))
    loader = data_dali.build_loader(tmp_path / "out" / "manifest.csv", batch_size=2, need_video=False,
                                    clip_frames=16, num_workers=0)
    assert loader.backend == "reference"  # nothing to decode: log-mel slices
    batch = next(iter(loader))
    assert batch["audio"].shape == (2, 80, 160) and "video" not in batch


@pytest.fixture(scope="module")
def small_manifest(tmp_path_factory):
    """12 clips (2 classes) prepared at 48 px: the trainer's data in these tests."""
    root = tmp_path_factory.mktemp("small")
    src = synthetic.write_dataset(root / "src", classes=2, per_class=6, seconds=2.0,
                                  width=64, height=48)
    return prep.prepare(src, root / "data", layout="list", list_file=src / "list.csv",
                        progress=False, cfg=prep.PrepareConfig(short_side=48, min_seconds=1.0))["manifest"]


SMALL = ["--preset", "tiny", "--batch-size", "4", "--dict-size", "8", "--pool-size", "16",
         "--log-every", "3"]


def test_trainer_reads_prepared_data_through_the_loaders(small_manifest, tmp_path):
    import train
    from cmacc import checkpoint as ckpt

    out = tmp_path / "run"
    train.main(SMALL + ["--data", small_manifest, "--steps", "6", "--out", str(out)])
    state = ckpt.load(out / "ckpt_00000006.pt")
    assert state["step"] == 6
    idx = state["model"]["dict_v.index"]
    assert ((idx >= 0) & (idx < 12)).all()  # the dictionary holds keys of real clips
    rows = _csv(out / "metrics.csv")
    assert len(rows) == 2 and all(float(r["loss"]) > 0 for r in rows)


@pytest.mark.parametrize("backend", ["dali", "reference"])
def test_mid_epoch_resume_through_the_loaders_equals_an_uninterrupted_run(small_manifest,
                                                                          tmp_path, backend):
    """3 batches an epoch: stopping at step 4 resumes inside epoch 1 (its first batch is not
    decoded again), and the weights end bit-identical to an uninterrupted run's."""
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    import train
    from cmacc import checkpoint as ckpt

    a, b = tmp_path / "a", tmp_path / "b"
    flags = SMALL + ["--data", small_manifest, "--loader", backend, "--workers", "1"]
    train.main(flags + ["--steps", "7", "--out", str(a)])
    train.main(flags + ["--steps", "4", "--out", str(b)])
    assert ckpt.load(b / "ckpt_00000004.pt")["batch_in_epoch"] == 1
    train.main(flags + ["--steps", "7", "--out", str(b)])
    sa, sb = (ckpt.load(d / "ckpt_00000007.pt")["model"] for d in (a, b))
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)


def test_smoco_runs_with_the_dali_loader(small_manifest, tmp_path):
    pytest.importorskip("nvidia.dali")
    import train
    from cmacc import checkpoint as ckpt

    out = tmp_path / "run"
    train.main(SMALL + ["--data", small_manifest, "--loader", "dali", "--objective", "smoco",
                        "--sampler", "random", "--steps", "3", "--out", str(out)])
    assert ckpt.load(out / "ckpt_00000003.pt")["step"] == 3


def test_test_time_clips_vary_the_start_but_not_the_crop(broken):
    _, out, _, _ = broken
    m = Manifest(out / "manifest.csv")
    i = [k for k, r in enumerate(m.rows) if r["source"].endswith("ok.mp4")][0]
    starts = set()
    for seed in range(6):
        jit = ClipDataset(m, [i], clip_frames=8, crop=32, train=False, temporal_jitter=True, seed=seed)[0]
        starts.add(jit["start"])
        fixed = ClipDataset(m, [i], clip_frames=8, crop=32, train=False, start=jit["start"])[0]
        assert torch.equal(jit["video"], fixed["video"])  # centre crop, no flip, no grayscale
    assert len(starts) > 1
    centre = ClipDataset(m, [i], clip_frames=8, crop=32, train=False)[0]
    assert centre["start"] == (30 - 8) // 2


def test_trainer_names_a_missing_manifest(tmp_path, capsys):
    import train

    with pytest.raises(SystemExit) as e:  # a usage error: one line on stderr, exit code 2
        train.main(["--preset", "tiny", "--data", str(tmp_path / "nope.csv"), "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--data" in err and "nope.csv" in err and "no manifest; create one with" in err


FLASHES = (0.6, 1.8, 3.0)  # seconds: a white frame and a click at each, in a 30 fps source


@pytest.fixture(scope="module")
def flash_manifest(tmp_path_factory):
    """A 4 s clip at 30 fps (prepared to 10 fps): dark frames but a white one at each of
    FLASHES, silence but a 20 ms click starting at each."""
    src = tmp_path_factory.mktemp("flash")
    fps, sr = 30, 16_000
    frames = np.full((4 * fps, 48, 64, 3), 16, np.uint8)
    wave = np.zeros(4 * sr, np.float32)
    for t in FLASHES:
        frames[round(t * fps)] = 240
        s = round(t * sr)
        wave[s:s + 320] = 0.8 * np.sin(2 * np.pi * 3000 * np.arange(320) / sr)
    synthetic.write_av(src / "c" / "flash.mp4", frames, fps, wave, sr)
    out = tmp_path_factory.mktemp("flash_out")
    prep.prepare(src, out, workers=1, progress=False, cfg=prep.PrepareConfig(short_side=48))
    return out / "manifest.csv"


# The worst audio-video offset allowed: 40 ms = the click's own length (20 ms: its energy peaks
# anywhere in it) + one mel hop (10 ms: where a mel frame's window sits) + 10 ms for the AAC
# frame edges of the source. The flashes sit on the prepared 10 fps grid, so the picture adds
# nothing; 40 ms is under half a frame (50 ms): a clip whose sound slipped by one video frame
# against its picture (100 ms) fails.
WORST_OFFSET_MS = 40


@pytest.mark.parametrize("backend", ["reference", "dali"])
def test_a_flash_and_its_click_arrive_together_through_both_loaders(flash_manifest, backend):
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    seen = 0
    for seed in range(6):  # training mode: temporal jitter (and every other augmentation) on
        loader = data_dali.build_loader(flash_manifest, batch_size=1, clip_frames=8, crop=32,
                                        seed=seed, backend=backend, num_workers=0)
        b = next(iter(loader))
        start = int(b["start"])
        bright = b["video"][0].mean((0, 2, 3))  # [T] per frame
        energy = torch.from_numpy(np.asarray(b["audio"][0])).max(0).values  # [L] per mel frame
        for t in FLASHES:
            if not start / 10 <= t < (start + 8) / 10 - 0.05:  # in this clip, click included
                continue
            t_video = (start + int(bright.argmax())) / 10
            t_audio = start / 10 + int(energy.argmax()) / MEL_FPS
            assert bright.max() > bright.median() + 3  # the flash is there
            assert abs(t_video - t) < 1e-6, (seed, start)
            assert abs(t_audio - t_video) * 1000 <= WORST_OFFSET_MS, (seed, start, t_audio, t_video)
            seen += 1
    assert seen >= 3
