"""The linear probe of x's characters: frozen backbone features (or raw pixels), one
multinomial logistic regression per position."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cmacc.model import CMACC
from cmacc.probe import linear_probe

from .data import MultiOmniglotPairs


@torch.no_grad()
def features(model: CMACC, pairs: MultiOmniglotPairs, n: int | None = None, chunk=512):
    """The frozen x-encoder's backbone features (pre-head, eval mode) of the first n pairs."""
    bb = model.f_v.backbone.eval()
    n = len(pairs) if n is None else min(n, len(pairs))
    out = torch.cat([bb(pairs.render(torch.arange(s, min(s + chunk, n)), "x"))
                     for s in range(0, n, chunk)])
    model.f_v.backbone.train()
    return out


@torch.no_grad()
def pixel_features(pairs: MultiOmniglotPairs, n: int | None = None, chunk=1000):
    """x's pixels, 2x2-average-pooled (16x16 per character cell), flattened: the probe's
    floor without any encoder."""
    n = len(pairs) if n is None else min(n, len(pairs))
    return torch.cat([F.avg_pool2d(pairs.render(torch.arange(s, min(s + chunk, n)), "x"), 2)
                      .flatten(1) for s in range(0, n, chunk)])


def probe_accuracy(model, train: MultiOmniglotPairs, tests: dict[str, MultiOmniglotPairs],
                   n_probe: int | None = None, tail=None) -> dict[str, float]:
    """Per test set (name → pairs): the mean over positions of a linear probe's test accuracy
    on x's character; the probe is fit once per position on the first ``n_probe`` training
    pairs (deterministic, so each test set sees the same probe). ``model`` None: the probe
    reads raw pixels (``pixel_features``). ``tail`` (per position, a bool mask over the
    alphabet): also "NAME_tail", the accuracy on the test pairs whose character is in it
    (the mean over positions)."""
    def feats(pairs, n=None):
        return pixel_features(pairs, n) if model is None else features(model, pairs, n)

    ftr = feats(train, n_probe)
    ytr = train.labels[:ftr.shape[0]]
    out = {}
    for name, test in tests.items():
        fte = feats(test)
        per = [linear_probe(ftr, ytr[:, i], fte, test.labels[:, i], num_classes=train.sizes[i],
                            subsets=None if tail is None else
                            {"tail": tail[i][test.labels[:, i]]}) for i in range(train.n_chars)]
        out[name] = sum(p["top1"] for p in per) / len(per)
        if tail is not None:
            out[f"{name}_tail"] = sum(p["top1_tail"] for p in per) / len(per)
    return out
