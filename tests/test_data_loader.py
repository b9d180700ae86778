"""data_dali.build_loader with the reference backend (no DALI needed): the batch contract, audio
/video alignment against clips whose picture and sound encode time, sharding, epochs, and
manifest safety."""

import numpy as np
import pytest
import torch

import data_dali
from data_dali import prepare as prep
from data_dali import synthetic
from data_dali.manifest import Manifest, ManifestError
from data_dali.reference import MEAN, STD

CLICKS = (5, 17, 29)  # the click clip: frame k has brightness 6k, a click sounds at frame k


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    synthetic.write_dataset(src, classes=2, per_class=3, seconds=2.0, width=64, height=48)
    synthetic.write_click_clip(src / "clicks" / "clicks.mp4", click_frames=CLICKS, seconds=4.0)
    out = tmp_path_factory.mktemp("prepared")
    prep.prepare(src, out, workers=2, progress=False,
                 cfg=prep.PrepareConfig(short_side=48, min_seconds=1.6))
    return out / "manifest.csv"


def test_batches_follow_the_contract(data):
    m = Manifest(data)
    loader = data_dali.build_loader(data, batch_size=2, clip_frames=8, crop=32, backend="reference",
                                    num_workers=0, views=2)
    assert loader.backend == "reference" and len(loader) == len(m) // 2 == 3
    assert loader.num_clips == len(m) and loader.num_classes == 3
    assert loader.class_names == ["class00", "class01", "clicks"]
    batches = list(loader)
    assert len(batches) == 3
    for b in batches:
        assert b["video"].shape == b["video2"].shape == (2, 3, 8, 32, 32)
        assert b["audio"].shape == b["audio2"].shape == (2, 80, 80)  # round(8 * 100 / 10)
        assert b["video"].dtype == torch.float32
        assert b["index"].dtype == b["label"].dtype == torch.long
        for i, lab in zip(b["index"].tolist(), b["label"].tolist()):
            assert int(m.rows[i]["label"]) == lab
    seen = torch.cat([b["index"] for b in batches]).tolist()
    assert len(set(seen)) == 6 and set(seen) < set(range(len(m)))  # one epoch (drop_last): no repeats
    # the second view is another segment/crop of the same clip
    assert any((b["start"] != b["start2"]).any() for b in batches)


def test_epochs_reshuffle_with_the_seed(data):
    def order(seed, epoch):
        ld = data_dali.build_loader(data, batch_size=1, seed=seed, backend="reference")
        ld.set_epoch(epoch)
        return sum(ld.shard_indices(), [])

    assert order(0, 0) == order(0, 0) and order(0, 1) != order(0, 0) and order(1, 0) != order(0, 0)
    assert sorted(order(0, 1)) == sorted(order(0, 0))


@pytest.mark.parametrize("train", [True, False])
def test_picture_and_sound_stay_aligned(data, train):
    m = Manifest(data)
    i = [k for k, r in enumerate(m.rows) if r["class_name"] == "clicks"][0]
    full = m.mel(i)
    starts = set()
    for seed in range(5 if train else 1):
        loader = data_dali.build_loader(m, batch_size=1, clip_frames=10, crop=32, seed=seed,
                                        backend="reference", num_workers=0, split=None, train=train)
        b = [b for b in loader if b["index"].item() == i][0]
        s = int(b["start"])
        starts.add(s)
        # the picture: frame j of the clip is source frame s + j (brightness 255 * k / 40)
        pix = b["video"][0] * torch.tensor(STD)[:, None, None, None] + torch.tensor(MEAN)[:, None, None, None]
        frame_no = (pix.mean((0, 2, 3)) * 40).numpy()
        np.testing.assert_allclose(frame_no, np.arange(s, s + 10), atol=0.5)  # off by one: 1.0
        # the sound: mel frames [10 s, 10 s + 100), a click at frame k sits at mel frame 10 (k - s)
        seg = b["audio"][0].numpy()
        np.testing.assert_array_equal(seg, full[:, 10 * s:10 * s + 100])
        energy = seg.max(0)
        for k in CLICKS:
            if s <= k < s + 9:
                j = 10 * (k - s)
                assert energy[j:j + 3].max() > np.median(energy) + 3, (s, k)
                if j >= 6:  # and not before it
                    assert energy[j - 6:j - 3].max() < np.median(energy) + 1
    assert len(starts) > 1 if train else starts == {(40 - 10) // 2}


def test_two_shards_cover_the_epoch_once_disjointly(data):
    m = Manifest(data)
    for drop_last in (False, True):
        shards = [data_dali.build_loader(m, batch_size=2, shard_id=r, num_shards=2, seed=1,
                                         backend="reference", num_workers=0, crop=16,
                                         clip_frames=2, drop_last=drop_last) for r in (0, 1)]
        got = [torch.cat([b["index"] for b in s]).tolist() for s in shards]
        assert not set(got[0]) & set(got[1])
        if drop_last:
            assert len(got[0]) == len(got[1]) == 2 and len(shards[0]) == len(shards[1]) == 1
        else:
            assert sorted(got[0] + got[1]) == list(range(len(m)))


def test_audio_only_and_video_only_loaders(data, tmp_path):
    a = data_dali.build_loader(data, batch_size=3, need_video=False, backend="reference",
                               num_workers=0, clip_frames=16)
    b = next(iter(a))
    assert set(b) == {"audio", "index", "label", "start"} and b["audio"].shape == (3, 80, 160)
    v = data_dali.build_loader(data, batch_size=3, need_audio=False, backend="reference",
                               num_workers=0, clip_frames=4, crop=16, dtype=torch.bfloat16)
    b = next(iter(v))
    assert "audio" not in b and b["video"].shape == (3, 3, 4, 16, 16) and b["video"].dtype == torch.bfloat16


def test_loaders_compute_the_mel_when_prepare_skipped_it(tmp_path):
    src = tmp_path / "src"
    synthetic.write_click_clip(src / "c" / "a.mp4", click_frames=(3,), seconds=2.0)
    with_mel, without = tmp_path / "m1", tmp_path / "m2"
    prep.prepare(src, with_mel, workers=1, progress=False)
    prep.prepare(src, without, workers=1, progress=False, cfg=prep.PrepareConfig(mel=False))
    kw = dict(batch_size=1, clip_frames=8, backend="reference", num_workers=0, need_video=False)
    a = next(iter(data_dali.build_loader(with_mel / "manifest.csv", **kw)))["audio"]
    b = next(iter(data_dali.build_loader(without / "manifest.csv", **kw)))["audio"]
    torch.testing.assert_close(a, b)


def test_manifest_paths_must_stay_inside_the_dataset(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    head = "id,video,audio,mel,label,frames,fps\n"
    for bad in ("../../etc/passwd", str(tmp_path / "x.webm"), "clips/../../x.webm"):
        (root / "manifest.csv").write_text(head + f"0,{bad},,,0,10,10\n")
        with pytest.raises(ValueError, match="escapes the dataset folder"):
            Manifest(root / "manifest.csv")
    (root / "link.webm").symlink_to(tmp_path / "secret.webm")  # a link pointing outside
    (root / "manifest.csv").write_text(head + "0,link.webm,,,0,10,10\n")
    with pytest.raises(ValueError, match="escapes the dataset folder"):
        data_dali.read_manifest(root / "manifest.csv")
    with pytest.raises(FileNotFoundError, match="python -m data_dali.prepare"):
        Manifest(tmp_path / "nope.csv")


def test_bad_manifests_and_arguments_get_clear_errors(data, tmp_path):
    (tmp_path / "manifest.csv").write_text("id,video,audio,mel,label,frames,fps\n0,a.webm,,,dog,10,10\n")
    with pytest.raises(ManifestError, match=r"line 2 .*label .dog. is not an integer"):
        Manifest(tmp_path / "manifest.csv")
    (tmp_path / "manifest.csv").write_text("video,label\na.webm,0\n")
    with pytest.raises(ManifestError, match="not a data_dali manifest"):
        Manifest(tmp_path / "manifest.csv")
    with pytest.raises(ManifestError, match="--fps 25"):
        data_dali.build_loader(data, batch_size=1, fps=25)
    with pytest.raises(ValueError, match="views must be 1 or 2"):
        data_dali.build_loader(data, batch_size=1, views=3)
    with pytest.raises(ValueError, match="lower the batch size"):
        data_dali.build_loader(data, batch_size=64)
    with pytest.raises(ValueError, match="split"):
        data_dali.build_loader(data, batch_size=1, split="validation")


def test_manifest_info_and_cheap_import(data):
    import subprocess
    import sys

    info = data_dali.manifest_info(data)
    assert info["clips"] == 7 and info["classes"] == 3 and info["fps"] == [10.0]
    code = "import sys, data_dali; assert 'torch' not in sys.modules and 'av' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_persistent_workers_follow_the_epochs(data):
    """The PyAV backend keeps one DataLoader (persistent workers) across epochs: each epoch's
    draws reach the workers, and match an in-process loader's."""
    kw = dict(batch_size=2, clip_frames=4, crop=16, backend="reference", seed=2, need_audio=False)
    workers = data_dali.build_loader(data, num_workers=2, **kw)
    inline = data_dali.build_loader(data, num_workers=0, **kw)
    starts = []
    for epoch in (0, 1, 2):
        workers.set_epoch(epoch)
        inline.set_epoch(epoch)
        got = [(b["index"].tolist(), b["start"].tolist(), b["crop"].tolist()) for b in workers]
        assert got == [(b["index"].tolist(), b["start"].tolist(), b["crop"].tolist()) for b in inline]
        starts.append({i: s for idx, st, _ in got for i, s in zip(idx, st)})
    assert workers.builds == inline.builds == 1
    assert workers._ref.dl.persistent_workers
    assert any(starts[0][i] != starts[1].get(i, starts[0][i]) for i in starts[0])  # reshuffled draws


def test_the_log_says_which_loader_runs_and_why(tiny_prepared, tmp_path, monkeypatch, caplog):
    """One line at the start of train.py names the loader and the reason: asked for, audio-only
    (nothing to decode), DALI missing (what failed), or the synthetic clips in memory."""
    import logging

    import train
    from cmacc.config import DataConfig
    from cmacc.data import loader_line, train_loader
    from data_dali import pipelines

    def cfg(**kw):
        return DataConfig(source=str(tiny_prepared[1] / "manifest.csv"), frames=4, size=16,
                          workers=0, **kw)

    assert loader_line(train_loader(cfg(loader="reference"), batch_size=4, seed=0)) == \
        "the PyAV reference loader: asked for (--loader reference)"
    assert loader_line(data_dali.build_loader(cfg().source, batch_size=4, clip_frames=4,
                                              crop=16, need_video=False, num_workers=0)) == \
        "the PyAV reference loader: audio-only batches are log-mel slices: nothing to decode"

    def missing(device):
        raise ImportError("No module named 'nvidia.dali'")

    monkeypatch.setattr(pipelines, "check_available", missing)
    assert loader_line(train_loader(cfg(loader="auto"), batch_size=4, seed=0)) == \
        "the PyAV reference loader: DALI unavailable (ImportError: No module named 'nvidia.dali')"
    with caplog.at_level(logging.INFO, logger="cmacc"):
        train.main(["--preset", "tiny", "--clips", "24", "--classes", "4", "--batch-size", "4",
                    "--dict-size", "8", "--pool-size", "16", "--steps", "1",
                    "--out", str(tmp_path / "run")])
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loader: ")]
    assert said == ["loader: the in-memory synthetic clips (--data synthetic: nothing to decode)"]
