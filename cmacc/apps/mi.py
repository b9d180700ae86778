"""The mutual-information study (paper appendix; Ozair et al. 2019, Spatial-MultiOmniglot).
Installed as the command ``cmacc-mi`` (= ``python -m cmacc.apps.mi``).

A pair (x, y) shows l characters in a near-square grid of 32x32 cells. Position i draws its
character z_i uniformly from the i-th alphabet (l_i characters); the alphabets are taken
largest first, whole (the paper's 9: Tifinagh 55, Hiragana 52, Gujarati 48, Katakana 47,
Bengali 46, Grantha 43, Sanskrit 42, Armenian 41, Mkhedruli 41; Omniglot's background set
small1 + small2 has Katakana 47, Sanskrit 42, Korean 40, Latin 26, Balinese 24, Greek 24,
Early_Aramaic 22, Tagalog 17). In y, position i shows character (z_i + 1) mod l_i of the same
alphabet (``relation="next"``, Ozair et al.'s construction as public reproductions build it;
the CM-ACC appendix does not restate it) or z_i itself (``"same"``), always drawn by another
person. Either way I(x; y) = sum_i log l_i (nats) grows with l.

The protocol (defaults): 50,000 training pairs drawn by drawers 0..13, test pairs by the
other drawers (unseen handwriting); the pairs are stored as indices (character, drawer per
position) and rendered on demand, per batch, from a uint8 glyph bank (~0.25 MB per alphabet).
SMoCo (x vs an augmented x), XMoCo and CM-ACC (x vs y) train a small CNN per modality with the
paper's optimiser and sizes (Adam 1e-3 after a 500-step warm-up, M = 128, K = 30 M,
m = 0.999, tau = 0.7) until the pretext accuracy plateaus (``--window``/``--tol``/``--patience``)
or ``--max-steps``; a linear probe of the character at every position reads the frozen
x-encoder's backbone features (mean accuracy over positions), beside the untrained floor.
``report.md`` lists every departure from the paper's protocol. The probe is scored on two
test sets: pairs drawn by held-out drawers (unseen handwriting, the protocol) and new pairs of
the training drawers' own drawings (seen images). ``mi.json`` is rewritten after every run
(``"complete": false`` until the last one is in), so a stopped study keeps what finished. docs/FIDELITY.md §4 has what
this shows.

    python -m cmacc.apps.mi --omniglot ROOT --out runs/mi [--chars 1 2 3 4 6 8] [--seeds 0 1 2]
    python -m cmacc.apps.mi --make-glyphs /tmp/glyphs --quick --out runs/mi_quick

ROOT is the folder that holds ``omniglot-py/images_background`` (torchvision's layout).
``--make-glyphs DIR`` writes a small generated stand-in in that layout (for trying the command
without Omniglot); ``--quick`` is a minutes-long setting for tests, not a result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from cmacc.config import ModelConfig, SelectionConfig
from cmacc.metrics import mean_ci
from cmacc.model import CMACC
from cmacc.probe import linear_probe
from cmacc.runlog import save_figure
from data_dali.cli import ArgumentParser, UserError, command, output_folder
from data_dali.fileio import atomic_write_text

from . import positive_int

CELL = 32
TRAIN_DRAWERS = 14  # drawers 0..13 make the training pairs, the rest (>= 2) the test pairs
METHODS = {"SMoCo": ("smoco", "random"),  # (objective, sampler)
           "XMoCo": ("cross", "random"),
           "CM-ACC": ("cross", "active")}
PAPER_ALPHABET_SIZES = (55, 52, 48, 47, 46, 43, 42, 41, 41)  # Tifinagh, Hiragana, ..., Mkhedruli
PAPER_TRAIN_PAIRS = 50_000
RELATIONS = ("next", "same")  # y's character at a position: x's next in the alphabet, or x's


class OmniglotError(UserError, FileNotFoundError):
    """An Omniglot folder that is missing or lacks what the study needs; the message says what."""


# -- data -------------------------------------------------------------------------------------

def grid_shape(n_chars: int) -> tuple[int, int]:
    """Rows and columns of the near-square grid of ``n_chars`` cells (row-major positions)."""
    rows = math.ceil(math.sqrt(n_chars))
    return rows, math.ceil(n_chars / rows)


def mutual_information(sizes) -> float:
    """I(x; y) in nats of pairs whose positions draw uniform characters from alphabets of these
    sizes, y's character a bijection of x's: sum_i log l_i."""
    return float(sum(math.log(s) for s in sizes))


def to_ink_uint8(gray: torch.Tensor) -> torch.Tensor:
    """8-bit greyscale (paper white = 255) → uint8 ink (255 = full ink)."""
    return 255 - gray.to(torch.uint8)


def ink_to_float(ink: torch.Tensor) -> torch.Tensor:
    """uint8 ink → float in [0, 1] (ink = 1), the network input."""
    return ink.float().div_(255.0)


class Glyphs:
    """Omniglot character images as uint8 ink, one tensor per alphabet
    ``bank[a]`` [n_chars, n_drawers, 32, 32]: the ``max_alphabets`` alphabets with the most
    characters (ties by name), largest first, each with all its characters (at most
    ``max_chars`` if given)."""

    def __init__(self, root, max_alphabets=9, max_chars=None):
        # torchvision's Omniglot layout, read directly (torchvision's own class also insists on
        # the downloaded zip files being present, which a copied folder may lack)
        base = Path(root) / "omniglot-py" / "images_background"
        if not base.is_dir():
            raise OmniglotError(
                f"{root}: no Omniglot in torchvision's layout; expected "
                f"{base}/<alphabet>/<character>/*.png (unzip images_background*.zip there, "
                "alphabet folders directly under it; --make-glyphs DIR makes a generated stand-in)")
        folders = {a: sorted(p for p in a.iterdir() if p.is_dir())
                   for a in base.iterdir() if a.is_dir()}
        largest = sorted((a for a in folders if folders[a]),
                         key=lambda a: (-len(folders[a]), a.name))[:max_alphabets]
        self.names = [a.name for a in largest]
        self.bank = []  # per alphabet: uint8 [n_chars, n_drawers, 32, 32]
        for a in largest:
            chars = []
            for ch in folders[a][:max_chars]:
                files = sorted(ch.glob("*.png"))
                if len(files) < 2:
                    raise OmniglotError(f"{ch}: needs >= 2 drawings (.png) per character")
                if chars and len(files) != chars[0].shape[0]:
                    raise OmniglotError(f"{ch}: {len(files)} drawings, the alphabet's first "
                                        f"character has {chars[0].shape[0]}; every character "
                                        "needs the same drawers (Omniglot has 20)")
                chars.append(torch.stack([self._load(f) for f in files]))
            self.bank.append(torch.stack(chars))
        if not self.bank:
            raise OmniglotError(f"{base}: no alphabet folders with characters")

    @property
    def sizes(self) -> list[int]:
        return [b.shape[0] for b in self.bank]

    @staticmethod
    def _load(path) -> torch.Tensor:
        from PIL import Image

        try:
            img = Image.open(path).convert("L").resize((CELL, CELL), Image.BILINEAR)
        except OSError as e:
            raise OmniglotError(f"{path}: not a readable image ({e}); replace or remove it") from None
        gray = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(CELL, CELL)
        return to_ink_uint8(gray)


class MultiOmniglotPairs:
    """n pairs for l characters: per pair and position, x's character (``labels`` [n, l]) and
    the drawers of x and y (``drawer_x``, ``drawer_y`` [n, l], uint8, from ``drawers``; y's is
    always another person). y's character at a position is x's next in its alphabet
    (``relation="next"``) or x's own (``"same"``). Images are rendered on demand from the uint8
    glyph bank (``images``; ``batch`` gives floats): 50,000 pairs cost ~1 MB, not gigabytes."""

    def __init__(self, glyphs: Glyphs, n_chars: int, n: int, *, seed: int, drawers: range,
                 relation: str = "next"):
        if relation not in RELATIONS:
            raise ValueError(f"relation {relation!r} is not one of {RELATIONS}")
        if n_chars > len(glyphs.bank):
            raise ValueError(f"{n_chars} characters need {n_chars} alphabets; the Omniglot "
                             f"folder has {len(glyphs.bank)}")
        nd = len(drawers)
        if nd < 2 or drawers.start < 0 or drawers.stop > min(b.shape[1] for b in glyphs.bank):
            raise ValueError(f"drawers {drawers}: need >= 2 drawers that every character has")
        self.bank = glyphs.bank[:n_chars]
        self.sizes = glyphs.sizes[:n_chars]
        self.relation, self.drawers = relation, drawers
        self.rows, self.cols = grid_shape(n_chars)
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.stack([torch.randint(0, s, (n,), generator=g)
                                   for s in self.sizes], 1)  # [n, l]
        dx = torch.randint(0, nd, (n, n_chars), generator=g)  # [n, l]
        dy = (dx + torch.randint(1, nd, (n, n_chars), generator=g)) % nd  # another person
        self.drawer_x = (dx + drawers.start).to(torch.uint8)
        self.drawer_y = (dy + drawers.start).to(torch.uint8)

    def __len__(self) -> int:
        return self.labels.shape[0]

    @property
    def n_chars(self) -> int:
        return len(self.sizes)

    @property
    def mutual_information(self) -> float:
        return mutual_information(self.sizes)

    def y_labels(self) -> torch.Tensor:
        """y's character at every position [n, l]."""
        shift = 1 if self.relation == "next" else 0
        return (self.labels + shift) % torch.tensor(self.sizes)

    def images(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 ink x, y [B, 1, rows*32, cols*32] of the pairs ``idx`` (one gather per
        position; empty cells of the grid stay blank)."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        b = idx.shape[0]
        x = torch.zeros(b, self.rows, self.cols, CELL, CELL, dtype=torch.uint8)
        y = torch.zeros_like(x)
        zy = self.y_labels()[idx] if self.relation == "next" else None
        for i, bank in enumerate(self.bank):
            r, c = divmod(i, self.cols)
            z = self.labels[idx, i]
            x[:, r, c] = bank[z, self.drawer_x[idx, i].long()]
            y[:, r, c] = bank[z if zy is None else zy[:, i], self.drawer_y[idx, i].long()]
        # [B, rows, cols, 32, 32] → [B, 1, rows*32, cols*32]
        shape = (b, 1, self.rows * CELL, self.cols * CELL)
        return (x.permute(0, 1, 3, 2, 4).reshape(shape), y.permute(0, 1, 3, 2, 4).reshape(shape))

    def batch(self, idx) -> tuple[torch.Tensor, torch.Tensor]:
        """Float x, y in [0, 1] (ink = 1), channels-last, of the pairs ``idx``."""
        x, y = self.images(idx)
        cl = torch.channels_last
        return ink_to_float(x).contiguous(memory_format=cl), ink_to_float(y).contiguous(memory_format=cl)


# -- networks and the pretext ----------------------------------------------------------------

class GroupBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm whose training statistics come from ``groups`` equal, consecutive parts of the
    batch, as if each part were on its own device (MoCo's per-GPU BN, simulated in one
    process); running statistics are the mean over the parts. Eval mode: plain BN.

    One native batch-norm call: the parts are laid side by side as channels
    ([G, B/G, C, H, W] → [B/G, G*C, H, W]), each starting from the shared running statistics;
    ``running_mean``/``running_var`` become the mean of the parts' updated ones (the same
    value as updating with the parts' mean: the update is linear)."""

    def __init__(self, channels: int, groups: int = 1):
        super().__init__(channels)
        self.groups = groups

    def forward(self, x):
        b = x.shape[0]
        if not self.training or self.groups == 1:
            return super().forward(x)
        if b % self.groups:
            raise ValueError(f"batch {b} is not a multiple of the BN groups {self.groups}")
        g, c = self.groups, x.shape[1]
        mean, var = self.running_mean.repeat(g), self.running_var.repeat(g)  # [G*C], updated
        side = x.reshape(g, b // g, *x.shape[1:]).transpose(0, 1).reshape(b // g, g * c,
                                                                           *x.shape[2:])
        y = F.batch_norm(side, mean, var, self.weight.repeat(g), self.bias.repeat(g),
                         training=True, momentum=self.momentum, eps=self.eps)
        with torch.no_grad():
            self.running_mean.copy_(mean.view(g, c).mean(0))
            self.running_var.copy_(var.view(g, c).mean(0))
            self.num_batches_tracked += 1
        return y.reshape(b // g, g, *x.shape[1:]).transpose(0, 1).reshape(x.shape)


class SmallCNN(nn.Module):
    """4 stride-2 conv-BN-ReLU layers (width w, 2w, 4w, 4w) and global average pooling; BN
    statistics over ``bn_groups`` parts of the batch (GroupBatchNorm2d)."""

    def __init__(self, width=32, bn_groups=1):
        super().__init__()
        layers, c = [], 1
        for w in (width, 2 * width, 4 * width, 4 * width):
            layers += [nn.Conv2d(c, w, 3, stride=2, padding=1, bias=False),
                       GroupBatchNorm2d(w, bn_groups), nn.ReLU(inplace=True)]
            c = w
        self.net = nn.Sequential(*layers)
        self.out_dim = c

    def forward(self, x):
        return F.adaptive_avg_pool2d(self.net(x), 1).flatten(1)


def augment(x: torch.Tensor, g: torch.Generator, *, shift: int = 2, noise: float = 0.05):
    """SMoCo's second view, per sample: a random translation by up to ``shift`` px (zero fill)
    and Gaussian pixel noise. x [B, 1, H, W] float."""
    b, _, h, w = x.shape
    pad = F.pad(x, (shift, shift, shift, shift))
    d = torch.randint(0, 2 * shift + 1, (b, 2), generator=g)  # [B, (dy, dx)]
    rows = (d[:, 0, None] + torch.arange(h))[:, :, None]  # [B, H, 1]
    cols = (d[:, 1, None] + torch.arange(w))[:, None, :]  # [B, 1, W]
    out = pad[torch.arange(b)[:, None, None], 0, rows, cols].unsqueeze(1)  # [B, 1, H, W]
    if noise:
        out = out + noise * torch.randn(out.shape, generator=g)
    return out.contiguous(memory_format=torch.channels_last)


@dataclass
class MIConfig:
    """One training run of the study. Defaults: the paper's optimiser and sizes (§4.1, App. A)."""

    batch: int = 128  # M
    dict_mult: int = 30  # K = dict_mult * M
    pool_mult: int = 300  # N = pool_mult * M (CM-ACC's candidate pool)
    lr: float = 1e-3
    warmup: int = 500  # linear warm-up steps of the learning rate
    tau: float = 0.7
    momentum: float = 0.999
    dim: int = 128
    fcl: bool = False  # the paper's extra FC layer with the cross-modal momentum rule (§3.2)
    fcl_dim: int = 128
    width: int = 32
    bn_groups: int = 4  # shuffle-BN: BN statistics per quarter of the batch, keys shuffled
    max_steps: int = 6000
    window: int = 200  # pretext accuracy is averaged over windows of this many steps
    tol: float = 0.005  # plateau: a window's mean gains < tol over the previous one ...
    patience: int = 2  # ... this many windows in a row
    shift: int = 2  # SMoCo's second view: translation (px) and noise
    noise: float = 0.05

    def __post_init__(self):
        for name in ("batch", "dict_mult", "pool_mult", "dim", "width", "max_steps", "window",
                     "patience", "bn_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch % self.bn_groups:
            raise ValueError(f"batch {self.batch} must be a multiple of bn_groups {self.bn_groups}")
        if self.lr <= 0 or self.tau <= 0 or not 0 <= self.momentum < 1 or self.warmup < 0:
            raise ValueError("lr and tau must be > 0, momentum in [0, 1), warmup >= 0")

    @property
    def dict_size(self) -> int:
        return self.dict_mult * self.batch


QUICK = dict(batch=32, dict_mult=4, pool_mult=12, warmup=20, max_steps=60, window=20, width=8,
             dim=32)
PAIRS = dict(train=PAPER_TRAIN_PAIRS, test=2000, probe=10_000)
QUICK_PAIRS = dict(train=4000, test=500, probe=2000)


class ShuffledKeysCMACC(CMACC):
    """CM-ACC whose key encoders see the batch in a random order (MoCo's shuffle-BN in one
    process): with BN statistics per group of the batch (``bn_groups``), a query and its
    positive key are normalised with different samples, so the pretext task cannot be solved
    by recognising the current batch's BN signature (MoCo §3.3; the paper uses shuffling BN in
    all encoders, §4.1). ``distributed.batch_shuffle`` is the identity in one process."""

    @torch.no_grad()
    def encode_keys(self, encoder, x):
        perm = torch.randperm(x.shape[0], device=x.device)
        k, _ = encoder(x[perm])
        return k[torch.argsort(perm)]


def build_model(method: str, cfg: MIConfig, seed: int) -> CMACC:
    torch.manual_seed(seed)
    objective, sampler = METHODS[method]
    mcfg = ModelConfig(objective=objective, batch_size=cfg.batch, dict_size=cfg.dict_size,
                       dim=cfg.dim, fcl=cfg.fcl, fcl_dim=cfg.fcl_dim, momentum=cfg.momentum,
                       tau=cfg.tau, seed=seed)
    sel = SelectionConfig(sampler=sampler, pool_size=cfg.pool_mult * cfg.batch)
    backbones = (SmallCNN(cfg.width, cfg.bn_groups), SmallCNN(cfg.width, cfg.bn_groups))
    cls = ShuffledKeysCMACC if cfg.bn_groups > 1 else CMACC
    model = cls(mcfg, sel, backbones=backbones)
    return model.to(memory_format=torch.channels_last)


def plateau_step(curve: list[float], tol: float, patience: int) -> int | None:
    """The window (index into ``curve``, the pretext accuracy per window) at which training
    stops: the first where each of the last ``patience`` windows gained < ``tol`` over the one
    before it; None if there is none."""
    run = 0
    for i in range(1, len(curve)):
        run = run + 1 if curve[i] - curve[i - 1] < tol else 0
        if run >= patience:
            return i
    return None


def train_one(method: str, train: MultiOmniglotPairs, cfg: MIConfig, seed: int, *,
              log=None) -> tuple[CMACC, dict]:
    """Train to the pretext-accuracy plateau (or ``cfg.max_steps``). Returns the model and its
    history: pretext accuracy and loss per window, steps run, why it stopped, seconds."""
    model = build_model(method, cfg, seed)
    opt = torch.optim.Adam(model.query_parameters(), lr=cfg.lr)
    g = torch.Generator().manual_seed(seed)
    n = len(train)
    perm, pos = torch.randperm(n, generator=g), 0
    hist = {"acc": [], "loss": [], "steps": 0, "stop": "max_steps"}
    acc_sum = loss_sum = 0.0
    t0 = time.perf_counter()
    for step in range(cfg.max_steps):
        if pos + cfg.batch > n:  # epochs without replacement
            perm, pos = torch.randperm(n, generator=g), 0
        idx = perm[pos:pos + cfg.batch]
        pos += cfg.batch
        for group in opt.param_groups:
            group["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup) if cfg.warmup else cfg.lr
        x, y = train.batch(idx)
        kw = {}
        if method == "SMoCo":  # unimodal: x vs augmented x (y vs augmented y)
            kw = dict(video2=augment(x, g, shift=cfg.shift, noise=cfg.noise),
                      audio2=augment(y, g, shift=cfg.shift, noise=cfg.noise))
        loss, stats = model(x, y, idx, step=step, **kw)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        acc_sum += float(stats["acc"])
        loss_sum += float(loss.detach())
        if (step + 1) % cfg.window == 0:
            hist["acc"].append(acc_sum / cfg.window)
            hist["loss"].append(loss_sum / cfg.window)
            acc_sum = loss_sum = 0.0
            if log:
                log(f"  {method} step {step + 1}: pretext acc {hist['acc'][-1]:.3f} "
                    f"loss {hist['loss'][-1]:.3f}")
            if (step + 1) > cfg.warmup and plateau_step(
                    hist["acc"][cfg.warmup // cfg.window:], cfg.tol, cfg.patience) is not None:
                hist["stop"] = "plateau"
                hist["steps"] = step + 1
                break
    else:
        hist["steps"] = cfg.max_steps
    hist["seconds"] = time.perf_counter() - t0
    return model, hist


@torch.no_grad()
def features(model: CMACC, pairs: MultiOmniglotPairs, n: int | None = None, chunk=512):
    """The frozen x-encoder's backbone features (pre-head, eval mode) of the first n pairs."""
    bb = model.f_v.backbone.eval()
    n = len(pairs) if n is None else min(n, len(pairs))
    out = torch.cat([bb(pairs.batch(torch.arange(s, min(s + chunk, n)))[0])
                     for s in range(0, n, chunk)])
    model.f_v.backbone.train()
    return out


@torch.no_grad()
def pixel_features(pairs: MultiOmniglotPairs, n: int | None = None, chunk=1000):
    """x's pixels, 2x2-average-pooled (16x16 per character cell), flattened: the probe's
    floor without any encoder."""
    n = len(pairs) if n is None else min(n, len(pairs))
    return torch.cat([F.avg_pool2d(pairs.batch(torch.arange(s, min(s + chunk, n)))[0], 2)
                      .flatten(1) for s in range(0, n, chunk)])


def probe_accuracy(model, train: MultiOmniglotPairs, tests: dict[str, MultiOmniglotPairs],
                   n_probe: int | None = None) -> dict[str, float]:
    """Per test set (name → pairs): the mean over positions of a linear probe's test accuracy
    on x's character; the probe is fit once per position on the first ``n_probe`` training
    pairs (deterministic, so each test set sees the same probe). ``model`` None: the probe
    reads raw pixels (``pixel_features``)."""
    def feats(pairs, n=None):
        return pixel_features(pairs, n) if model is None else features(model, pairs, n)

    ftr = feats(train, n_probe)
    ytr = train.labels[:ftr.shape[0]]
    out = {}
    for name, test in tests.items():
        fte = feats(test)
        accs = [linear_probe(ftr, ytr[:, i], fte, test.labels[:, i],
                             num_classes=train.sizes[i])["top1"] for i in range(train.n_chars)]
        out[name] = sum(accs) / len(accs)
    return out


# -- the study -------------------------------------------------------------------------------

def departures(glyphs: Glyphs, chars, n_train, cfg: MIConfig, relation, seeds) -> list[str]:
    """Every way this run differs from the paper's protocol (appendix; Ozair et al. 2019)."""
    d = []
    if glyphs.sizes[:len(PAPER_ALPHABET_SIZES)] != list(PAPER_ALPHABET_SIZES)[:len(glyphs.sizes)]:
        d.append(f"alphabets: {', '.join(f'{n} {s}' for n, s in zip(glyphs.names, glyphs.sizes))}"
                 f" (paper: Tifinagh 55, Hiragana 52, ... Mkhedruli 41), so the MI at each l is "
                 "lower than the paper's")
    if max(chars) < 9:
        d.append(f"l up to {max(chars)} (paper: 1..9)")
    if n_train != PAPER_TRAIN_PAIRS:
        d.append(f"{n_train} training pairs (paper: {PAPER_TRAIN_PAIRS})")
    d.append(f"y's relation to x: '{relation}' (the appendix does not state it; 'next' is Ozair "
             "et al.'s construction as public reproductions build it)")
    d.append(f"encoder: a 4-layer CNN of width {cfg.width} with global average pooling, no fcl "
             "(the appendix does not name the encoder for this study)")
    d.append(f"drawers 0..{TRAIN_DRAWERS - 1} for training pairs, the others for the probe's "
             "test pairs (not stated in the appendix); the probe is also scored on new pairs "
             "of the training drawers' own drawings ('seen drawings')")
    paper = MIConfig()
    for f in dataclasses.fields(MIConfig):
        a, b = getattr(cfg, f.name), getattr(paper, f.name)
        if a != b and f.name not in ("max_steps", "window", "tol", "patience"):
            d.append(f"{f.name} = {a} (this command's protocol default / the paper's: {b})")
    d.append(f"training stops at a pretext-accuracy plateau (window {cfg.window} steps, gain < "
             f"{cfg.tol} for {cfg.patience} windows) or {cfg.max_steps} steps (the paper does "
             "not state its schedule)")
    d.append(f"seeds {list(seeds)}; the probe: multinomial logistic regression (L-BFGS) on the "
             "frozen backbone features, one per position, mean accuracy")
    return d


def _floor_key(floor: str, test: str) -> str:
    """mi.json's key of figures on a test set: "untrained" / "untrained_seen", "probe" /
    "probe_seen" (a run's), "pixels" / "pixels_seen"."""
    return floor if test == "held_out" else f"{floor}_{test}"


def run(root, out, chars=(1, 2, 3, 4, 6, 8), cfg: MIConfig | None = None,
        n_train=PAPER_TRAIN_PAIRS, n_test=2000, n_probe=10_000, seeds=(0,),
        methods=tuple(METHODS), relation="next", log=print, verbose=False) -> dict:
    cfg = cfg or MIConfig()
    glyphs = Glyphs(root)
    check_glyphs(glyphs, root, max(chars))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"chars": list(chars), "alphabets": glyphs.names[:max(chars)],
               "alphabet_sizes": glyphs.sizes[:max(chars)], "relation": relation,
               "n_train": n_train, "n_test": n_test, "n_probe": n_probe, "seeds": list(seeds),
               "config": dataclasses.asdict(cfg), "mi": [], "untrained": {}, "untrained_seen": {},
               "pixels": {}, "pixels_seen": {},
               "runs": {}, "complete": False,  # True once every run is in
               "departures": departures(glyphs, chars, n_train, cfg, relation, seeds)}
    t_start = time.perf_counter()
    for l in chars:
        n_drawers = glyphs.bank[0].shape[1]
        tr = MultiOmniglotPairs(glyphs, l, n_train, seed=1000 * l, relation=relation,
                                drawers=range(0, TRAIN_DRAWERS))
        te = MultiOmniglotPairs(glyphs, l, n_test, seed=1000 * l + 1, relation=relation,
                                drawers=range(TRAIN_DRAWERS, n_drawers))
        # new pairs of the training drawers' own drawings: what a probe measures when the test
        # images were seen in training (how the paper's near-1.0 floor at l <= 2 can arise)
        ts = MultiOmniglotPairs(glyphs, l, n_test, seed=1000 * l + 2, relation=relation,
                                drawers=range(0, TRAIN_DRAWERS))
        tests = {"held_out": te, "seen": ts}
        results["mi"].append(tr.mutual_information)
        pixels = probe_accuracy(None, tr, tests, n_probe)  # the floor without an encoder
        for k, v in pixels.items():
            results[_floor_key("pixels", k)][str(l)] = v
        log(f"l={l} pixels: probe {pixels['held_out']:.3f} (seen drawings {pixels['seen']:.3f})")
        for seed in seeds:
            # the floor: the same encoder at initialisation
            floor = probe_accuracy(build_model(methods[0], cfg, seed), tr, tests, n_probe)
            for k, v in floor.items():
                results[_floor_key("untrained", k)].setdefault(str(l), []).append(v)
            log(f"l={l} (MI {tr.mutual_information:.2f} nats) seed {seed} untrained: probe "
                f"{floor['held_out']:.3f} (seen drawings {floor['seen']:.3f})")
            for m in methods:
                model, hist = train_one(m, tr, cfg, seed, log=log if verbose else None)
                acc = probe_accuracy(model, tr, tests, n_probe)
                results["runs"].setdefault(m, {}).setdefault(str(l), []).append(
                    {"seed": seed, **{_floor_key("probe", k): v for k, v in acc.items()}, **hist})
                log(f"l={l} seed {seed} {m}: probe {acc['held_out']:.3f} (seen drawings "
                    f"{acc['seen']:.3f})  ({hist['steps']} steps, {hist['stop']}, pretext acc "
                    f"{hist['acc'][-1]:.3f}, {hist['seconds']:.0f} s)")
                # each finished run is on disk at once: a stopped study keeps it
                atomic_write_text(out / "mi.json", json.dumps(results, indent=2))
    results["seconds"] = time.perf_counter() - t_start
    results["complete"] = True
    atomic_write_text(out / "mi.json", json.dumps(results, indent=2))
    atomic_write_text(out / "report.md", report(results, methods))
    _plot(results, methods, out / "mi.png")
    return results


def report(results: dict, methods) -> str:
    seeds = results["seeds"]
    lines = [f"# MI study: {len(seeds)} seed(s), relation '{results['relation']}', "
             f"{results['n_train']} training pairs, {results['seconds']:.0f} s", "",
             "Linear-probe accuracy of x's characters (mean over positions), mean ± 95% "
             "t-interval over seeds; steps = mean steps trained; pixels = the probe on x's "
             "2x2-pooled pixels (no encoder). Two test sets of new pairs: "
             "drawn by held-out drawers (unseen handwriting: the protocol), and drawn from the "
             "training drawers' own drawings (seen images)."]
    for title, test in (("Held-out drawers", "held_out"), ("Seen drawings", "seen")):
        key, floor, pix = (_floor_key(f, test) for f in ("probe", "untrained", "pixels"))
        lines += ["", f"## {title}", "",
                  "| l | MI (nats) | pixels | untrained | " + " | ".join(methods) + " |",
                  "|---" * (4 + len(methods)) + "|"]
        for l, mi in zip(results["chars"], results["mi"]):
            cells = [f"{l}", f"{mi:.2f}", f"{results[pix][str(l)]:.3f}",
                     _pm(results[floor][str(l)])]
            for m in methods:
                runs = results["runs"][m][str(l)]
                steps = statistics.fmean(r["steps"] for r in runs)
                cells.append(f"{_pm([r[key] for r in runs])} ({steps:.0f} steps)")
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Alphabets: " + ", ".join(f"{n} ({s})" for n, s in
                                            zip(results["alphabets"], results["alphabet_sizes"])),
              "", "## Departures from the paper's protocol", ""]
    lines += [f"- {d}" for d in results["departures"]]
    return "\n".join(lines) + "\n"


def _pm(values) -> str:
    mean, half = mean_ci(values)
    return f"{mean:.3f}" if math.isnan(half) else f"{mean:.3f} ± {half:.3f}"


def check_glyphs(glyphs: Glyphs, root, max_chars: int) -> None:
    """Before any training: enough alphabets for ``max_chars`` characters, and enough drawers
    per character for disjoint train and test hands."""
    if max_chars > len(glyphs.bank):
        raise OmniglotError(f"{root}: {max_chars} characters need {max_chars} alphabets, the "
                            f"folder has {len(glyphs.bank)}; pass a smaller --chars or more "
                            "of Omniglot's images_background")
    fewest = min(b.shape[1] for b in glyphs.bank[:max_chars])
    if fewest < TRAIN_DRAWERS + 2:
        raise OmniglotError(f"{root}: a character has only {fewest} drawings; the study needs "
                            f">= {TRAIN_DRAWERS + 2} ({TRAIN_DRAWERS} training hands, >= 2 test "
                            "hands; Omniglot has 20)")


def _plot(results, methods, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    ls = results["chars"]
    for ax, test, title in ((axes[0], "held_out", "held-out drawers (protocol)"),
                            (axes[1], "seen", "seen drawings")):
        key, floor = _floor_key("probe", test), _floor_key("untrained", test)
        for m in methods:
            stats = [mean_ci([r[key] for r in results["runs"][m][str(l)]]) for l in ls]
            ax.errorbar(ls, [s[0] for s in stats],
                        yerr=[0 if math.isnan(s[1]) else s[1] for s in stats],
                        marker="o", capsize=3, label=m)
        ax.plot(ls, [mean_ci(results[floor][str(l)])[0] for l in ls], color="grey", ls="--",
                marker=".", label="untrained encoder")
        ax.set_xlabel("number of characters l (MI = sum log l_i grows)")
        ax.set_title(f"test pairs: {title}; {len(results['seeds'])} seed(s), "
                     f"{results['n_train']} pairs", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("linear-probe character accuracy")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, png)


def make_glyphs(root, alphabets=9, chars=None, drawers=20, seed=0) -> Path:
    """A generated stand-in for Omniglot in torchvision's layout: each character is a fixed
    random set of strokes; each drawer jitters them. ``chars`` characters per alphabet, or the
    sizes of the paper's alphabets (55, 52, ..., 41: ``PAPER_ALPHABET_SIZES``)."""
    from PIL import Image, ImageDraw

    g = torch.Generator().manual_seed(seed)
    base = Path(root) / "omniglot-py" / "images_background"
    for a in range(alphabets):
        n_chars = chars or PAPER_ALPHABET_SIZES[a % len(PAPER_ALPHABET_SIZES)]
        for c in range(n_chars):
            folder = base / f"Alphabet_{a:02d}" / f"character{c + 1:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            strokes = torch.rand(3, 4, generator=g) * 80 + 12
            for d in range(drawers):
                img = Image.new("L", (105, 105), 255)
                draw = ImageDraw.Draw(img)
                for s in strokes:
                    j = (s + torch.randn(4, generator=g) * 3).tolist()
                    draw.line(j, fill=0, width=6)
                img.save(folder / f"{a:02d}{c:02d}_{d + 1:02d}.png")
    return Path(root)


@command
def main(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument("--omniglot", help="folder holding omniglot-py/images_background")
    p.add_argument("--make-glyphs", metavar="DIR", help="write generated glyphs there and use them")
    p.add_argument("--out", default="runs/mi")
    p.add_argument("--chars", type=positive_int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--methods", nargs="+", choices=tuple(METHODS), default=list(METHODS))
    p.add_argument("--train-pairs", type=positive_int,
                   help=f"default {PAIRS['train']} (the paper's; {QUICK_PAIRS['train']} with --quick)")
    p.add_argument("--test-pairs", type=positive_int,
                   help=f"default {PAIRS['test']} ({QUICK_PAIRS['test']} with --quick)")
    p.add_argument("--probe-pairs", type=positive_int,
                   help=f"training pairs the linear probe is fit on (the first ones); default "
                        f"{PAIRS['probe']} ({QUICK_PAIRS['probe']} with --quick)")
    p.add_argument("--relation", choices=RELATIONS, default="next",
                   help="y's character: x's next in its alphabet (Ozair et al., default) or x's own")
    p.add_argument("--quick", action="store_true",
                   help="a minutes-long setting for tests (tiny networks, 60 steps): not a result")
    for f in dataclasses.fields(MIConfig):
        kind = (dict(action=argparse.BooleanOptionalAction) if isinstance(f.default, bool)
                else dict(type=type(f.default)))
        p.add_argument("--" + f.name.replace("_", "-"), default=None, **kind,
                       help=f"default {f.default} ({QUICK.get(f.name, f.default)} with --quick)")
    args = p.parse_args(argv)
    if not (args.make_glyphs or args.omniglot):
        p.error("pass --omniglot ROOT (torchvision layout) or --make-glyphs DIR")
    if max(args.chars) > 9:
        p.error("--chars must be between 1 and 9")
    for k, v in (QUICK_PAIRS if args.quick else PAIRS).items():
        if getattr(args, f"{k}_pairs") is None:
            setattr(args, f"{k}_pairs", v)
    base = dict(QUICK) if args.quick else {}
    base.update({f.name: getattr(args, f.name) for f in dataclasses.fields(MIConfig)
                 if getattr(args, f.name) is not None})
    try:
        cfg = MIConfig(**base)
    except ValueError as e:
        raise UserError(f"{e} (see --help)") from None
    if args.train_pairs < cfg.batch:
        p.error(f"--train-pairs {args.train_pairs} is smaller than --batch {cfg.batch}")
    if args.train_pairs < cfg.dict_size and "CM-ACC" in args.methods:
        p.error(f"--train-pairs {args.train_pairs} is smaller than K = {cfg.dict_size}: the "
                "active sampler needs more distinct pairs than the dictionary holds")
    output_folder(args.out, "--out")
    if args.make_glyphs:
        root = make_glyphs(output_folder(args.make_glyphs, "--make-glyphs"),
                           alphabets=max(args.chars), chars=12 if args.quick else None)
    else:
        root = args.omniglot
    run(root, args.out, tuple(args.chars), cfg, n_train=args.train_pairs,
        n_test=args.test_pairs, n_probe=args.probe_pairs, seeds=tuple(args.seeds),
        methods=tuple(args.methods), relation=args.relation)
    print(f"plot: {Path(args.out) / 'mi.png'}  results: {Path(args.out) / 'mi.json'}  "
          f"report: {Path(args.out) / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
