"""data_dali.synthetic: the redundancy groups follow round(1 / (1 - r)), labels are balanced,
the class-distribution knob gives each class its share of the Zipf law (hand counts, and
|count - n p_c| < 1 against the law written out), shapes and seeds behave, and the in-memory
clips and the MP4 files draw the same class grating (orientation and spatial frequency measured
on the pictures, against pi c / C and 2 + c % 3)."""

import math

import numpy as np
import pytest
import torch

from data_dali import synthetic


def _grating(img):
    """(orientation in [0, pi), frequency in cycles per pixel) of a 2-D sinusoidal grating, from
    its gradients: the structure tensor's main axis, and sqrt(E|grad I|^2 / E(I - mean)^2) = 2 pi f."""
    img = np.asarray(img, np.float64)
    img = img - img.mean()
    gy, gx = np.gradient(img)
    theta = 0.5 * math.atan2(2 * (gx * gy).mean(), (gx ** 2).mean() - (gy ** 2).mean())
    freq = math.sqrt((gx ** 2 + gy ** 2).mean() / (img ** 2).mean()) / (2 * math.pi)
    return theta % math.pi, freq


def _angle_gap(a, b):
    d = abs(a - b) % math.pi
    return min(d, math.pi - d)


@pytest.mark.parametrize("r, size", [(0.0, 1), (0.3, 1), (0.5, 2), (2 / 3, 3), (0.75, 4), (0.9, 10)])
def test_group_size_is_round_one_over_one_minus_r(r, size):
    assert synthetic.group_size(r) == size
    assert [synthetic.instance_group(k, r) for k in range(2 * size)] == [0] * size + [1] * size


@pytest.mark.parametrize("r", [-0.1, 1.0, 1.5])
def test_redundancy_outside_zero_one_is_refused(r):
    with pytest.raises(ValueError, match="redundancy must be in"):
        synthetic.ToyAV(num_clips=8, num_classes=2, redundancy=r)


def test_clips_of_a_group_share_their_instance_and_other_groups_do_not():
    C, per_class, r = 3, 8, 0.75  # groups of 4 instances
    d = synthetic.ToyAV(num_clips=C * per_class, num_classes=C, frames=4, size=12, noise=0.0,
                        redundancy=r, seed=1)
    for a in range(len(d)):
        for b in range(a + 1, len(d)):
            same_class = a % C == b % C
            same_group = same_class and (a // C) // 4 == (b // C) // 4
            assert torch.equal(d.video[a], d.video[b]) == same_group, (a, b)
            assert torch.equal(d.audio[a], d.audio[b]) == same_group, (a, b)
    noisy = synthetic.ToyAV(num_clips=C * per_class, num_classes=C, frames=4, size=12,
                            noise=0.3, redundancy=r, seed=1)
    assert not torch.equal(noisy.video[0], noisy.video[C])  # near copies: own noise


@pytest.mark.parametrize("dist, n, C, counts", [
    ("zipf:1", 100, 4, [48, 24, 16, 12]),  # p = 12/25, 6/25, 4/25, 3/25: no remainders
    ("zipf:2", 49, 3, [36, 9, 4]),  # p = 36/49, 9/49, 4/49
    ("zipf:1", 10, 3, [5, 3, 2]),  # 10 p = 5.45, 2.73, 1.82: floors 5, 2, 1 + the 2 largest rests
    ("zipf:0", 10, 4, [3, 3, 2, 2]),  # = uniform: the first n % C classes get one more
    ("uniform", 10, 4, [3, 3, 2, 2]),
])
def test_class_counts_by_hand(dist, n, C, counts):
    assert synthetic.class_counts(dist, n, C) == counts


@pytest.mark.parametrize("s", [0.5, 1.0, 1.3, 2.0])
def test_zipf_clips_follow_their_law(s):
    n, C = 997, 37
    law = [(c + 1) ** -s for c in range(C)]
    law = [w / sum(law) for w in law]  # the law written out: p_c ∝ 1 / (c + 1)^S
    d = synthetic.ToyAV(num_clips=n, num_classes=C, frames=1, size=4, n_mels=4, mel_frames=2,
                        class_dist=f"zipf:{s}", redundancy=0.5)
    counts = torch.bincount(d.labels, minlength=C).tolist()
    assert sum(counts) == n and all(abs(k - n * p) < 1 for k, p in zip(counts, law))
    assert counts == sorted(counts, reverse=True) and counts[0] > 2 * counts[-1]
    for c in range(C):  # each class's clips are its instances 0, 1, ..., count - 1
        assert sorted(d.instance[d.labels == c].tolist()) == list(range(counts[c]))


@pytest.mark.parametrize("bad", ["zipf", "zipf:", "zipf:-1", "zipf:nan", "zipf:inf", "Zipf:1",
                                 "pareto:1", "uniform:1", ""])
def test_bad_class_dist_is_refused_with_the_accepted_forms(bad):
    with pytest.raises(ValueError, match=r"--class-dist .*expected 'uniform' or 'zipf:S'"):
        synthetic.ToyAV(num_clips=8, num_classes=2, class_dist=bad)
    with pytest.raises(ValueError, match=r"--class-dist .*expected 'uniform' or 'zipf:S'"):
        synthetic.write_dataset("unused", class_dist=bad)


def test_labels_are_balanced_and_shapes_follow_the_arguments():
    d = synthetic.ToyAV(num_clips=50, num_classes=7, frames=5, size=9, fps=10, n_mels=40)
    assert torch.equal(d.labels, torch.arange(50) % 7)
    assert torch.equal(d.instance, torch.arange(50) // 7)
    counts = torch.bincount(d.labels, minlength=7)
    assert counts.max() - counts.min() <= 1 and counts.sum() == 50
    assert d.video.shape == (50, 3, 5, 9, 9) and d.audio.shape == (50, 40, 50)  # 100 mel fps
    assert d.class_names == [f"class{c:02d}" for c in range(7)]
    loader = synthetic.ToyLoader(d, 10, seed=0, rank=1, world=2, views=2)
    batches = list(loader)
    assert len(batches) == len(loader) == 5
    b = batches[0]
    assert b["video"].shape == b["video2"].shape == (5, 3, 5, 9, 9)
    assert b["audio"].shape == b["audio2"].shape == (5, 40, 50)
    assert torch.equal(b["label"], d.labels[b["index"]])


def test_same_seed_same_clips_and_epochs_other_seed_other_clips():
    kw = dict(num_clips=16, num_classes=4, frames=3, size=8)
    a, b, c = synthetic.ToyAV(seed=5, **kw), synthetic.ToyAV(seed=5, **kw), synthetic.ToyAV(seed=6, **kw)
    assert torch.equal(a.video, b.video) and torch.equal(a.audio, b.audio)
    assert not torch.equal(a.video, c.video)
    la, lb = synthetic.ToyLoader(a, 4, seed=2, views=2), synthetic.ToyLoader(b, 4, seed=2, views=2)
    for x, y in zip(la, lb):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    la.set_epoch(1)
    assert not torch.equal(next(iter(la))["index"], next(iter(lb))["index"])
    # the global batch, second views included, is the same whatever the number of ranks
    whole = list(synthetic.ToyLoader(a, 4, seed=2, views=2))
    for world in (2, 4):
        parts = zip(*[synthetic.ToyLoader(a, 4, seed=2, rank=k, world=world, views=2)
                      for k in range(world)])
        for ps, w in zip(parts, whole):
            assert all(torch.equal(torch.cat([p[k] for p in ps]), w[k]) for k in w), world


def test_files_and_memory_draw_the_same_class_grating(tmp_path):
    av = pytest.importorskip("av")
    C, W, H = 4, 96, 72
    src = synthetic.write_dataset(tmp_path, classes=C, per_class=1, seconds=1.0, width=W,
                                  height=H, noise=0.0, redundancy=0.0)
    mem = synthetic.ToyAV(num_clips=C, num_classes=C, frames=2, size=64, noise=0.0)
    for c in range(C):
        theta, freq = math.pi * c / C, 2.0 + c % 3  # the law, written out
        with av.open(str(src / f"class{c:02d}" / f"class{c:02d}_000.mp4")) as f:
            frame = next(f.decode(video=0)).to_ndarray(format="rgb24").mean(-1)
        t_file, f_file = _grating(frame)
        t_mem, f_mem = _grating(mem.video[c, :, 0].mean(0).numpy())
        assert _angle_gap(t_file, theta) < math.radians(3) and _angle_gap(t_mem, theta) < math.radians(3)
        assert f_file * max(W, H) == pytest.approx(freq, rel=0.1)  # cycles per frame width
        assert f_mem * 63 == pytest.approx(freq, rel=0.1)  # linspace(0, 1, 64): 63 pixel steps
        assert synthetic.class_grating(c, C) == pytest.approx((theta, freq))
    rows = (src / "list.csv").read_text().splitlines()
    assert rows[0] == "path,label,class_name,split" and len(rows) == 1 + C
    assert [r.split(",")[1:3] for r in rows[1:]] == [[str(c), f"class{c:02d}"] for c in range(C)]


@pytest.mark.parametrize("C", [8, 20, 32, 101])
def test_file_tones_follow_the_pitch_law_below_nyquist(C):
    """The class tone of the files: a minor third apart up to 20 classes, squeezed to stay at or
    below 7040 Hz beyond (16 kHz audio: Nyquist 8 kHz); the spectrum's peak is the tone."""
    sr, inst = 16_000, dict(speed=1.0, phase=0.0, colour=np.ones(3))
    for c in (0, C // 2, C - 1):
        wave = synthetic._sound(c, C, inst, 1.0, sr, 0.0, np.random.default_rng(0))
        peak = np.argmax(np.abs(np.fft.rfft(wave))) * sr / len(wave)  # 1 Hz bins
        law = 220 * 2 ** (c / 4) if C <= 20 else 220 * 2 ** (5 * c / C)
        assert abs(peak - law) <= 1.5 and law <= 7040


def test_file_clips_of_a_group_share_their_instance(tmp_path):
    av = pytest.importorskip("av")
    src = synthetic.write_dataset(tmp_path, classes=1, per_class=4, seconds=1.0, width=64,
                                  height=48, noise=0.0, redundancy=0.5)  # groups of 2
    first = []
    for i in range(4):
        with av.open(str(src / "class00" / f"class00_{i:03d}.mp4")) as f:
            first.append(next(f.decode(video=0)).to_ndarray(format="rgb24").astype(float))
    assert np.abs(first[0] - first[1]).mean() < 1 and np.abs(first[2] - first[3]).mean() < 1
    assert np.abs(first[0] - first[2]).mean() > 5


def test_zipf_file_dataset_has_the_quota_of_each_class(tmp_path):
    pytest.importorskip("av")
    src = synthetic.write_dataset(tmp_path, classes=3, per_class=3, seconds=0.2, width=16,
                                  height=16, fps=10, class_dist="zipf:1")  # 9 p = 4.91, 2.45, 1.64
    rows = (src / "list.csv").read_text().splitlines()[1:]
    labels = [r.split(",")[1] for r in rows]  # integer labels, as the list format wants
    assert [labels.count(str(c)) for c in range(3)] == [5, 2, 2]
    assert all((src / r.split(",")[0]).is_file() for r in rows)
