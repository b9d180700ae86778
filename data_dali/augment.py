"""The augmentation law: every random choice of a sample, drawn from (seed, epoch, index, view).

One pure function, ``draw``, decides a view of a clip: its first frame (temporal jitter), its
crop box, its horizontal flip and whether it is grayscale. Both loaders consume its output —
the DALI pipelines through their external source (data_dali/pipelines.py), the PyAV
``ClipDataset`` directly (data_dali/reference.py) — so the same seed gives the same parameters
on both backends, for any number of views, and a clip's draws never depend on the epoch order,
the sharding, the batch it lands in or the other views.

The law (the paper's augmentation):
- train:  start ~ U{0, ..., n - T} (n frames in the clip, T per sample; 0 if n <= T);
          crop box: torchvision's RandomResizedCrop rule (area fraction ~ U(0.3, 1), log aspect
          ratio ~ U(log 3/4, log 4/3), position uniform; 10 tries, then the centre square);
          flip with p = 0.5; grayscale with p = 0.2.
- test:   the centre clip (start (n - T) // 2), the centre square, no flip, no grayscale.
- test with ``jitter`` (test-time multi-clip): a random start as in training, otherwise test.
- views after the first in test mode get a random start (another segment of the clip, centre
  crop): two identical views would carry no information.
- ``Augment`` turns training augmentations off one by one and sets the crop's strength
  (``train.py --augment``, ``--crop-scale``); an augmentation that is off keeps the test
  mode's choice (centre clip, centre square, no flip, no grayscale). The draws are made
  whatever is on, so the augmentations left on draw what they draw under the paper's law.

Each (seed, epoch, index, view) has its own generator, ``np.random.default_rng([seed, epoch,
index, view])``, drawn in the order start, crop, flip, grayscale. (Until this module existed
the views of a sample shared one generator seeded by (seed, epoch, index), and a second test
view used (seed, index); the distribution is unchanged, the individual draws differ.)
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass

import numpy as np

SCALE = (0.3, 1.0)  # crop area, as a fraction of the frame
RATIO = (3 / 4, 4 / 3)  # crop aspect ratio (width / height)
FLIP_P = 0.5
GRAY_P = 0.2
_MASK = (1 << 64) - 1
AUGMENTS = ("crop", "flip", "gray", "jitter")  # random resized crop, flip, grayscale, random start


def augment_names(given) -> tuple:
    """``--augment``'s words as the augmentations that run: ``none`` alone is none of them, and
    beside another is refused (contradictory); the names are checked by ``Augment``."""
    given = tuple(given)
    if "none" in given and len(given) > 1:
        raise ValueError(f"augment none cannot be combined with other augmentations, got "
                         f"{' '.join(given)}: give none alone, or the ones to run")
    return tuple(a for a in given if a != "none")


@dataclass(frozen=True)
class Augment:
    """Which training augmentations run, and the crop's area range (default: all, the paper's
    SCALE)."""

    on: tuple = AUGMENTS
    scale: tuple = SCALE

    def __post_init__(self):
        bad = [a for a in self.on if a not in AUGMENTS]
        if bad:
            raise ValueError(f"augmentations {bad} are not among {AUGMENTS}")
        if not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise ValueError(f"crop scale must satisfy 0 < min <= max <= 1, got {self.scale}")


PAPER = Augment()


@dataclass(frozen=True)
class ClipParams:
    """A view's choices: frames [start, start + T); crop rows [top, top + crop_h) and columns
    [left, left + crop_w) (resized to S x S afterwards); flip; grayscale."""

    start: int
    top: int
    left: int
    crop_h: int
    crop_w: int
    flip: bool
    gray: bool

    def array(self) -> np.ndarray:
        """int32 [7]: start, top, left, crop_h, crop_w, flip, gray (what the pipelines take)."""
        return np.array(astuple(self), np.int32)


PARAM_FIELDS = ("start", "top", "left", "crop_h", "crop_w", "flip", "gray")


def crop_box(h, w, rng: np.random.Generator | None, scale=SCALE, ratio=RATIO):
    """(top, left, height, width) of a random resized crop (torchvision's rule), or the centre
    square when rng is None."""
    if rng is not None:
        area = h * w
        for _ in range(10):
            target = area * rng.uniform(*scale)
            ar = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
            cw, ch = int(round(math.sqrt(target * ar))), int(round(math.sqrt(target / ar)))
            if 0 < cw <= w and 0 < ch <= h:
                return int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw
    s = min(h, w)
    return (h - s) // 2, (w - s) // 2, s, s


def draw(seed: int, epoch: int, index: int, view: int, *, frames_in_clip: int, clip_frames: int,
         height: int, width: int, train: bool = True, jitter: bool | None = None,
         aug: Augment = PAPER) -> ClipParams:
    """The parameters of view ``view`` of dataset clip ``index`` in ``epoch`` (module docstring).
    ``jitter`` defaults to ``train``; height/width 0 (a clip without video) give an empty box.
    ``aug``: the training augmentations that are on (``Augment``)."""
    jitter = train if jitter is None else jitter
    rng = np.random.default_rng([int(seed) & _MASK, int(epoch) & _MASK, int(index), int(view)])
    span = max(1, frames_in_clip - clip_frames + 1)  # possible first frames
    centre = (span - 1) // 2
    start = int(rng.integers(0, span)) if (train or jitter or view > 0) else centre
    if train and view == 0 and "jitter" not in aug.on:
        start = centre
    top, left, ch, cw = crop_box(height, width, rng if train else None, scale=aug.scale)
    if "crop" not in aug.on:
        top, left, ch, cw = crop_box(height, width, None)
    flip = bool(train and rng.random() < FLIP_P) and "flip" in aug.on
    gray = bool(train and rng.random() < GRAY_P) and "gray" in aug.on
    return ClipParams(start, top, left, ch, cw, flip, gray)


def draw_row(row: dict, index: int, view: int, *, seed: int, epoch: int, clip_frames: int,
             train: bool, jitter: bool | None = None, aug: Augment = PAPER) -> ClipParams:
    """``draw`` for manifest row ``row`` (its frames, height and width; an audio-only row counts
    its frames from the duration)."""
    n = int(row["frames"]) or int(float(row["duration"]) * float(row["fps"]))
    h, w = int(row.get("height") or 0), int(row.get("width") or 0)
    if row.get("video") and not (h > 0 and w > 0):
        raise ValueError(f"manifest row {index} ({row['video']}) has no width/height; re-run "
                         "`python -m data_dali.prepare` to write them")
    return draw(seed, epoch, index, view, frames_in_clip=n, clip_frames=clip_frames, height=h,
                width=w, train=train, jitter=jitter, aug=aug)


def batch_fields(params, suffix: str = "", video: bool = True) -> dict:
    """Batch entries of a view from its stacked parameters (long tensor [B, 7]): "start" [B];
    with video also "crop" [B, 4] (top, left, height, width), "flip" and "gray" (bool [B])."""
    out = {"start" + suffix: params[:, 0].contiguous()}
    if video:
        out["crop" + suffix] = params[:, 1:5].contiguous()
        out["flip" + suffix] = params[:, 5].bool()
        out["gray" + suffix] = params[:, 6].bool()
    return out
