"""Downstream protocols on frozen or trainable encoders: feature extraction with multi-clip
averaging, a linear probe (multinomial logistic regression, full-batch L-BFGS), end-to-end
fine-tuning, and the baselines every probe's score is printed beside (``baselines``: the
majority class, and what a clip property such as silent audio scores alone)."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

from data_dali.cli import progress_bar

log = logging.getLogger(__name__)


@torch.no_grad()
def extract_features(backbone: nn.Module, batches, key: str, device, clips: int = 1):
    """Mean backbone feature per dataset index over ``clips`` passes of ``batches`` (a callable
    returning an iterable of batch dicts for a pass number: each pass may sample other clips of
    the same videos — test-time multi-clip averaging; a clip left out of some pass, damaged,
    is averaged over the passes that had it). Returns (X [n, c], y [n], index [n])."""
    was_training = backbone.training
    backbone.eval()
    sums, counts, labels = {}, {}, {}
    for p in range(clips):
        for batch in progress_bar(batches(p), desc=f"features (clip pass {p + 1}/{clips})",
                                  leave=False):
            f = backbone(batch[key].to(device)).float().cpu()  # [B, c]
            for i, lab, row in zip(batch["index"].tolist(), batch["label"].tolist(), f):
                s = sums.get(i)
                sums[i] = row.clone() if s is None else s + row
                counts[i] = counts.get(i, 0) + 1
                labels[i] = lab
    backbone.train(was_training)
    index = sorted(sums)
    x = torch.stack([sums[i] / counts[i] for i in index])
    return x, torch.tensor([labels[i] for i in index]), torch.tensor(index)


def linear_probe(x_train, y_train, x_test, y_test, *, num_classes=None, weight_decay=1e-4,
                 max_iter=200, seed=0, subsets=None) -> dict:
    """Multinomial logistic regression on standardised features (train statistics), trained
    to convergence by full-batch L-BFGS; deterministic. Returns top-1 on train and test, and
    ``top1_NAME`` on each of ``subsets`` (name → bool mask [n_test]; NaN for an empty one)."""
    if x_train.shape[0] == 0 or x_test.shape[0] == 0:
        raise ValueError("linear_probe: empty train or test set; check the split/fold settings")
    c = int(num_classes or int(max(y_train.max(), y_test.max())) + 1)
    mu, sd = x_train.mean(0), x_train.std(0).clamp_min(1e-6)
    xtr, xte = ((x_train - mu) / sd).double(), ((x_test - mu) / sd).double()
    g = torch.Generator().manual_seed(seed)
    w = (0.01 * torch.randn(xtr.shape[1], c, generator=g, dtype=torch.float64)).requires_grad_()
    b = torch.zeros(c, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1, max_iter=max_iter, history_size=20,
                            line_search_fn="strong_wolfe", tolerance_grad=1e-9)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(xtr @ w + b, y_train) + weight_decay * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        train_acc = ((xtr @ w + b).argmax(1) == y_train).double().mean().item()
        hit = (xte @ w + b).argmax(1) == y_test  # [n_test]
        test_acc = hit.double().mean().item()
    out = {"top1": test_acc, "train_top1": train_acc, "n_train": int(x_train.shape[0]),
           "n_test": int(x_test.shape[0]), "num_classes": c}
    for name, mask in (subsets or {}).items():
        out[f"top1_{name}"] = hit[mask].double().mean().item() if mask.any() else float("nan")
    return out


def baselines(y_train, y_test, properties=None) -> dict:
    """What a probe's test top-1 must beat, from the labels and what is recorded of each clip
    beside them (none of it learnt from the clips' content): ``majority_top1``, the rate of the
    test split's most common class (``majority_label``; what a classifier that always says it
    scores), and ``property_top1`` {name: top-1} for each clip property (name → (bool
    [n_train], bool [n_test]), e.g. silent audio) of the classifier that sees only that
    property, fitted on the train split: a clip with it is called the most common class of
    the train clips with it, a clip without it the most common of those without (the train
    split's most common class where no train clip is so; ties: the smaller label). A probe
    that scores no more than one of these has not shown that it learnt the classes."""
    y_train, y_test = torch.as_tensor(y_train), torch.as_tensor(y_test)
    if y_test.numel() == 0:
        return {"majority_top1": float("nan"), "majority_label": None, "property_top1": {}}
    counts = torch.bincount(y_test)
    out = {"majority_top1": counts.max().item() / y_test.numel(),
           "majority_label": int(counts.argmax()), "property_top1": {}}

    def mode(y, default):
        return int(torch.bincount(y).argmax()) if y.numel() else default

    fallback = mode(y_train, out["majority_label"])
    for name, (p_train, p_test) in (properties or {}).items():
        p_train = torch.as_tensor(p_train, dtype=torch.bool)
        p_test = torch.as_tensor(p_test, dtype=torch.bool)
        said = {v: mode(y_train[p_train == v], fallback) for v in (True, False)}
        pred = torch.where(p_test, torch.tensor(said[True]), torch.tensor(said[False]))
        out["property_top1"][name] = (pred == y_test).double().mean().item()
    return out


def finetune(backbone: nn.Module, feat_dim: int, num_classes: int, train_batches, test_batches,
             key: str, device, *, epochs=10, lr=1e-3, weight_decay=1e-4, clips=1,
             progress=None) -> dict:
    """End-to-end fine-tuning: backbone + a new linear classifier, Adam, cross-entropy; test
    top-1 with multi-clip averaging of the logits' features. ``train_batches(epoch)`` and
    ``test_batches(pass)`` return iterables of batch dicts."""
    head = nn.Linear(feat_dim, num_classes).to(device)
    params = list(backbone.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    backbone.train()
    for epoch in progress_bar(range(epochs), desc="fine-tuning"):
        for batch in train_batches(epoch):
            logits = head(backbone(batch[key].to(device)))
            loss = F.cross_entropy(logits.float(), batch["label"].to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if progress is not None:
            progress(epoch, float(loss))
    x, y, _ = extract_features(backbone, test_batches, key, device, clips)
    with torch.no_grad():
        pred = head(x.to(device)).argmax(1).cpu()
    return {"top1": (pred == y).double().mean().item(), "n_test": int(y.numel()),
            "num_classes": num_classes, "epochs": epochs}
