"""The class distribution of the synthetic clips: 'uniform' or 'zipf:S', parsed and turned
into exact per-class quotas. Standard library and numpy only (no torch, no media), so the typed
config (cmacc/config.py) checks a --class-dist value with it without importing the loaders.
"""

from __future__ import annotations

import math

import numpy as np

from .cli import UserError


class ClassDistError(UserError, ValueError):
    """A class distribution that is neither 'uniform' nor 'zipf:S'; the message names the flag."""


CLASS_DIST_FORMS = "'uniform' or 'zipf:S' (S a number >= 0; class c gets a share ∝ 1/(c+1)^S)"


def zipf_exponent(class_dist: str, flag: str = "--class-dist") -> float:
    """The exponent S of a class distribution: 'uniform' is 0, 'zipf:S' is S (>= 0, finite).
    Anything else is a ClassDistError (a ValueError) naming ``flag`` and the accepted forms."""
    text = str(class_dist).strip()
    if text == "uniform":
        return 0.0
    kind, _, value = text.partition(":")
    try:
        s = float(value) if kind == "zipf" else math.nan
    except ValueError:
        s = math.nan
    if not (math.isfinite(s) and s >= 0):
        raise ClassDistError(f"{flag} {class_dist!r}: expected {CLASS_DIST_FORMS}, e.g. zipf:1")
    return s


def class_probs(class_dist: str, num_classes: int) -> np.ndarray:
    """[C] float64: the share of each class, p_c = (c + 1)^-S / sum_k (k + 1)^-S."""
    w = np.arange(1, num_classes + 1, dtype=np.float64) ** -zipf_exponent(class_dist)
    return w / w.sum()


def class_counts(class_dist: str, num_clips: int, num_classes: int) -> list[int]:
    """Clips per class: the largest-remainder rounding of num_clips * p_c (floors first, then
    one more clip for the largest remainders, ties to the lower class). Sums to num_clips and
    |count_c - num_clips * p_c| < 1; 'uniform' gives the first num_clips % C classes one more."""
    share = num_clips * class_probs(class_dist, num_classes)
    counts = np.floor(share).astype(np.int64)  # sum <= num_clips
    rest = share - counts
    order = sorted(range(num_classes), key=lambda c: (-round(rest[c], 9), c))
    for c in order[:num_clips - int(counts.sum())]:
        counts[c] += 1
    return counts.tolist()
