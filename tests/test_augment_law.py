"""The augmentation law (data_dali/augment.py): a pure function of (seed, epoch, index, view)
with the paper's distribution (checked against torchvision's RandomResizedCrop and binomial
bounds), and both backends obeying it: same seed, same parameters, the same pixels within
resampling tolerance, for 1 and 2 views, train and test mode."""

import math

import numpy as np
import pytest
import torch

import data_dali
from data_dali import prepare as prep
from data_dali import synthetic
from data_dali.augment import Augment, ClipParams, crop_box, draw, draw_row
from data_dali.manifest import Manifest
from data_dali.reference import MEAN, STD

H, W, N, T = 48, 64, 30, 8  # the law's sweeps: a 64 x 48 clip of 30 frames, 8 per sample
SWEEP = 4000


def _draws(train=True, jitter=None, view=0, h=H, w=W, n=N, seed=0, epoch=0, count=SWEEP):
    return [draw(seed, epoch, i, view, frames_in_clip=n, clip_frames=T, height=h, width=w,
                 train=train, jitter=jitter) for i in range(count)]


def _binomial_ok(hits, n, p, sigmas=5):
    return abs(hits - n * p) < sigmas * math.sqrt(n * p * (1 - p))


def test_draws_are_a_pure_function_of_seed_epoch_index_and_view():
    base = dict(frames_in_clip=N, clip_frames=T, height=H, width=W)
    assert draw(3, 1, 7, 0, **base) == draw(3, 1, 7, 0, **base)
    ref = [draw(3, 1, i, 0, **base) for i in range(50)]
    for change in (dict(seed=4), dict(epoch=2), dict(view=1)):
        args = dict(seed=3, epoch=1, view=0) | change
        other = [draw(args["seed"], args["epoch"], i, args["view"], **base) for i in range(50)]
        assert sum(a != b for a, b in zip(ref, other)) >= 45, change
    assert len(set(ref)) == 50  # indices differ too
    assert isinstance(ref[0], ClipParams) and ref[0].array().dtype == np.int32


def test_the_two_views_of_a_clip_differ():
    v0, v1 = _draws(view=0, count=200), _draws(view=1, count=200)
    assert sum(a.start != b.start or a.top != b.top or a.left != b.left for a, b in zip(v0, v1)) > 180


def test_test_mode_is_the_centre_clip_and_the_centre_square():
    for p in _draws(train=False, count=20):
        assert p == ClipParams((N - T) // 2, 0, (W - H) // 2, H, H, False, False)
    short = draw(0, 0, 0, 0, frames_in_clip=5, clip_frames=T, height=H, width=W, train=False)
    assert short.start == 0  # shorter than a sample: from frame 0 (the decoders repeat the last)
    # a second test view is another segment, still centre-cropped, unflipped, in colour
    second = _draws(train=False, view=1, count=200)
    assert len({p.start for p in second}) > 10
    assert all((p.top, p.left, p.crop_h, p.crop_w, p.flip, p.gray) == (0, 8, H, H, False, False)
               for p in second)


def test_jitter_changes_the_start_only():
    starts = []
    for p in _draws(train=False, jitter=True):
        assert (p.top, p.left, p.crop_h, p.crop_w, p.flip, p.gray) == (0, (W - H) // 2, H, H, False, False)
        starts.append(p.start)
    counts = np.bincount(starts, minlength=N - T + 1)
    assert len(counts) == N - T + 1  # starts in [0, N - T]
    assert all(_binomial_ok(c, SWEEP, 1 / (N - T + 1)) for c in counts), counts


@pytest.mark.parametrize("h,w", [(H, W), (128, 171), (7, 300)])  # the last: crops often fall back
def test_crops_stay_inside_the_frame_and_follow_torchvision(h, w):
    from torchvision.transforms import RandomResizedCrop

    law = _draws(h=h, w=w)
    for p in law:
        assert 0 <= p.top and p.top + p.crop_h <= h and 0 <= p.left and p.left + p.crop_w <= w
        assert p.crop_h > 0 and p.crop_w > 0
    if h * 4 / 3 < w / 2:  # 10 misses in a row are common: the fallback is the centre square
        # (torchvision's is the centre crop at the nearest allowed ratio; kept from before)
        assert sum((p.top, p.left, p.crop_h, p.crop_w) == crop_box(h, w, None) for p in law) > SWEEP / 2
        return
    torch.manual_seed(0)
    img = torch.empty(1, h, w)
    tv = [RandomResizedCrop.get_params(img, scale=[0.3, 1.0], ratio=[3 / 4, 4 / 3])
          for _ in range(SWEEP)]
    q = np.linspace(0.05, 0.95, 19)
    for stat in (lambda y, x, ch, cw: ch * cw / (h * w), lambda y, x, ch, cw: cw / ch,
                 lambda y, x, ch, cw: (y + ch / 2) / h, lambda y, x, ch, cw: (x + cw / 2) / w):
        ours = np.quantile([stat(p.top, p.left, p.crop_h, p.crop_w) for p in law], q)
        theirs = np.quantile([stat(*b) for b in tv], q)
        np.testing.assert_allclose(ours, theirs, atol=0.03 * max(1, theirs.max()))


def test_flip_grayscale_and_start_frequencies():
    law = _draws()
    assert _binomial_ok(sum(p.flip for p in law), SWEEP, 0.5)
    assert _binomial_ok(sum(p.gray for p in law), SWEEP, 0.2)
    counts = np.bincount([p.start for p in law], minlength=N - T + 1)
    assert len(counts) == N - T + 1 and all(_binomial_ok(c, SWEEP, 1 / (N - T + 1)) for c in counts)
    assert crop_box(H, W, None) == (0, 8, H, H)


# ----------------------------------------------------------------------------------------------
# Both backends obey it
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """4 clips whose red grows left to right, green top to bottom, blue with time: a crop, a
    flip or a grayscale shows in the pixels."""
    src = tmp_path_factory.mktemp("law_src")
    y, x = np.mgrid[0:H, 0:W]
    for k in range(4):
        frames = np.zeros((N, H, W, 3), np.uint8)
        frames[..., 0] = (255 * x / (W - 1))
        frames[..., 1] = (255 * ((y + 8 * k) % H) / (H - 1))
        frames[..., 2] = (255 * np.arange(N) / (N - 1))[:, None, None]
        wave = 0.1 * np.random.default_rng(k).standard_normal(N * 1600).astype(np.float32)
        synthetic.write_av(src / f"c{k % 2}" / f"clip{k}.mp4", frames, 10, wave, 16_000)
    out = tmp_path_factory.mktemp("law_prepared")
    prep.prepare(src, out, workers=1, progress=False,
                 cfg=prep.PrepareConfig(short_side=H, min_seconds=1.0))
    return out / "manifest.csv"


@pytest.mark.parametrize("views", [1, 2])
@pytest.mark.parametrize("train", [True, False])
def test_both_backends_draw_the_same_and_agree_on_pixels(clips, views, train):
    pytest.importorskip("nvidia.dali")
    m = Manifest(clips)
    kw = dict(batch_size=2, clip_frames=T, crop=32, num_workers=0, seed=11, views=views,
              train=train)
    dali = data_dali.build_loader(m, backend="dali", **kw)
    ref = data_dali.build_loader(m, backend="reference", **kw)
    assert dali.backend == "dali"
    mean = torch.tensor(MEAN)[:, None, None, None]
    std = torch.tensor(STD)[:, None, None, None]
    flips, n = set(), 0
    for epoch in (0, 1):
        dali.set_epoch(epoch)
        ref.set_epoch(epoch)
        for bd, br in zip(dali, ref):
            assert torch.equal(bd["index"], br["index"]) and torch.equal(bd["label"], br["label"])
            for sfx in [""] + ["2"] * (views == 2):
                for key in ("start", "crop", "flip", "gray"):
                    assert torch.equal(bd[key + sfx], br[key + sfx]), key + sfx
                for b, i in enumerate(bd["index"].tolist()):  # the law itself, drawn here
                    p = draw_row(m.rows[i], i, int(sfx or 1) - 1, seed=11, epoch=epoch,
                                 clip_frames=T, train=train)
                    assert bd["start" + sfx][b] == p.start and bd["flip" + sfx][b] == p.flip
                    assert bd["crop" + sfx][b].tolist() == [p.top, p.left, p.crop_h, p.crop_w]
                    flips.add(p.flip)
                    # the pixels show the flip: red grows left to right unless flipped
                    red = (bd["video" + sfx][b] * std + mean)[0].mean((0, 1))
                    if not bd["gray" + sfx][b]:
                        assert (red[-1] < red[0]) == p.flip
                vd, vr = bd["video" + sfx], br["video" + sfx]
                assert vd.shape == vr.shape == (2, 3, T, 32, 32)
                diff = (vd - vr).abs()
                assert diff.mean() < 0.05 and diff.max() < 0.5  # resampling arithmetic only
                torch.testing.assert_close(bd["audio" + sfx], br["audio" + sfx])
            n += 1
    assert n == 2 * len(dali) == 4
    assert flips == ({False, True} if train else {False})
    assert dali.builds == ref.builds == 1


# ----------------------------------------------------------------------------------------------
# Augmentations turned off one by one (data_dali.augment.Augment: train.py --augment)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("on", [(), ("crop",), ("flip",), ("gray",), ("jitter",)])
def test_an_augmentation_that_is_off_keeps_the_test_choice_and_the_others_draw_the_paper_law(on):
    aug = Augment(on)
    test = _draws(train=False, count=1)[0]  # centre clip, centre square, no flip, no grayscale
    for p, paper in zip(_draws(count=400), [draw(0, 0, i, 0, frames_in_clip=N, clip_frames=T,
                                                 height=H, width=W, train=True, aug=aug)
                                            for i in range(400)]):
        want = {"jitter": ("start",), "crop": ("top", "left", "crop_h", "crop_w"),
                "flip": ("flip",), "gray": ("gray",)}
        for a, fields in want.items():
            for f in fields:  # on: the paper's draw; off: the test mode's choice
                assert getattr(paper, f) == getattr(p if a in on else test, f), (a, f)


def test_crop_scale_bounds_the_crop_area():
    aug = Augment(scale=(0.8, 1.0))
    boxes = [draw(0, 0, i, 0, frames_in_clip=N, clip_frames=T, height=H, width=W, aug=aug)
             for i in range(500)]
    drawn = [p.crop_h * p.crop_w / (H * W) for p in boxes
             if (p.top, p.left, p.crop_h, p.crop_w) != crop_box(H, W, None)]  # not a fallback
    assert len(drawn) > 100 and min(drawn) > 0.8 - 0.05  # (rounding of the sides)
    with pytest.raises(ValueError, match="crop scale"):
        Augment(scale=(0.0, 1.0))
    with pytest.raises(ValueError, match="not among"):
        Augment(("blur",))


def test_augment_none_alone_or_not_at_all():
    """The trainer's config reads ``--augment none`` as no augmentation, refuses it beside
    others (contradictory: the demo refuses it too), and its stored form rebuilds."""
    from cmacc.config import DataConfig
    assert DataConfig(augment=("none",)).augment == ()
    kept = DataConfig(augment=["flip", "crop"])
    assert DataConfig(augment=kept.augment).augment == ("flip", "crop")
    with pytest.raises(ValueError, match="none cannot be combined"):
        DataConfig(augment=("none", "flip"))


def test_a_loader_without_augmentation_gives_the_test_clips(clips):
    m = Manifest(clips)
    kw = dict(batch_size=2, clip_frames=T, crop=32, num_workers=0, seed=11, backend="reference")
    off = {int(i): v for b in data_dali.build_loader(m, augment=Augment(()), **kw)
           for i, v in zip(b["index"], b["video"])}
    test = {int(i): v for b in data_dali.build_loader(m, train=False, **kw)
            for i, v in zip(b["index"], b["video"])}
    assert off.keys() == test.keys() and len(off) == 4
    for i in off:
        torch.testing.assert_close(off[i], test[i], rtol=0, atol=0)
