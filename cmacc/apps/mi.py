"""The mutual-information study (paper appendix; Ozair et al. 2019, Spatial-MultiOmniglot).
Installed as the command ``cmacc-mi`` (= ``python -m cmacc.apps.mi``).

A pair (x, y) shows l characters in a grid of 32x32 cells. Position i draws its character z_i
from the i-th alphabet (l_i characters): the paper's alphabets are the 9 largest of Omniglot's
background set (Tifinagh 55, Hiragana 52, Gujarati 48, Katakana 47, Bengali 46, Grantha 43,
Sanskrit 42, Armenian 41, Mkhedruli 41), so ``Glyphs`` takes the alphabets with the most
characters, all of them. In y, position i shows character (z_i + 1) mod l_i of the same alphabet
(``relation="next"``, Ozair et al.'s construction as public reproductions build it; the CM-ACC
appendix does not restate it) or z_i itself (``"same"``), always drawn by another person.
Either way I(x; y) = sum_i log l_i grows with l. SMoCo (x vs an augmented x), XMoCo and CM-ACC
(x vs y) are trained with a small CNN for l = 1..9 and judged by a linear probe of the
character at every position from the frozen x-encoder's backbone features (pre-head, mean
accuracy over positions). docs/FIDELITY.md has what this shows and what it takes.

    python -m cmacc.apps.mi --omniglot ROOT --out runs/mi [--chars 1 2 4 9] [--steps 300]

ROOT is the folder that holds ``omniglot-py/images_background`` (torchvision's layout;
``torchvision.datasets.Omniglot(ROOT, download=False)`` must load it). ``--make-glyphs DIR``
writes a small generated stand-in in that layout (for trying the command without Omniglot).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from cmacc.config import ModelConfig, SelectionConfig
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
RELATIONS = ("next", "same")  # y's character at a position: x's next in the alphabet, or x's


class OmniglotError(UserError, FileNotFoundError):
    """An Omniglot folder that is missing or lacks what the study needs; the message says what."""


class Glyphs:
    """Omniglot character images as [n_drawers, 32, 32] tensors per (alphabet, character): the
    ``max_alphabets`` alphabets with the most characters (ties by name), largest first, each
    with all its characters (at most ``max_chars`` if given)."""

    def __init__(self, root, max_alphabets=9, max_chars=None):
        # torchvision's Omniglot layout, read directly (torchvision's own class also insists on
        # the downloaded zip files being present, which a copied folder may lack)
        base = Path(root) / "omniglot-py" / "images_background"
        if not base.is_dir():
            raise OmniglotError(
                f"{root}: no Omniglot in torchvision's layout; expected "
                f"{base}/<alphabet>/<character>/*.png (torchvision.datasets.Omniglot(ROOT, "
                "download=True) writes it; --make-glyphs DIR makes a generated stand-in)")
        folders = {a: sorted(p for p in a.iterdir() if p.is_dir())
                   for a in base.iterdir() if a.is_dir()}
        largest = sorted((a for a in folders if folders[a]),
                         key=lambda a: (-len(folders[a]), a.name))[:max_alphabets]
        self.names = [a.name for a in largest]
        self.alphabets = []  # per alphabet: list of [drawers, 32, 32] tensors
        for a in largest:
            chars = []
            for ch in folders[a][:max_chars]:
                files = sorted(ch.glob("*.png"))
                if len(files) < 2:
                    raise OmniglotError(f"{ch}: needs >= 2 drawings (.png) per character")
                chars.append(torch.stack([self._load(f) for f in files]))
            self.alphabets.append(chars)
        if not self.alphabets:
            raise OmniglotError(f"{base}: no alphabet folders with characters")

    @staticmethod
    def _load(path):
        from PIL import Image

        try:
            img = Image.open(path).convert("L").resize((CELL, CELL), Image.BILINEAR)
        except OSError as e:
            raise OmniglotError(f"{path}: not a readable image ({e}); replace or remove it") from None
        t = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).float()
        return 1.0 - t.view(CELL, CELL) / 255.0  # ink = 1


class MultiOmniglotPairs:
    """n pairs (x, y, per-position character labels of x) for l characters in a near-square
    grid; y's character at a position is x's next in its alphabet (``relation="next"``) or x's
    (``"same"``), drawn by another person."""

    def __init__(self, glyphs: Glyphs, n_chars: int, n: int, *, seed: int, drawers: slice,
                 relation: str = "next"):
        if relation not in RELATIONS:
            raise ValueError(f"relation {relation!r} is not one of {RELATIONS}")
        if n_chars > len(glyphs.alphabets):
            raise ValueError(f"{n_chars} characters need {n_chars} alphabets; the Omniglot "
                             f"folder has {len(glyphs.alphabets)}")
        rows = math.ceil(math.sqrt(n_chars))
        cols = math.ceil(n_chars / rows)
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.stack([torch.randint(0, len(glyphs.alphabets[i]), (n,), generator=g)
                                   for i in range(n_chars)], 1)  # [n, l]
        self.sizes = [len(glyphs.alphabets[i]) for i in range(n_chars)]
        self.x = torch.zeros(n, 1, rows * CELL, cols * CELL)
        self.y = torch.zeros_like(self.x)
        shift = 1 if relation == "next" else 0
        for i in range(n_chars):
            r, c = divmod(i, cols)
            alphabet = glyphs.alphabets[i]
            for j in range(n):
                z = int(self.labels[j, i])
                imgs_x = alphabet[z][drawers]
                imgs_y = alphabet[(z + shift) % len(alphabet)][drawers]
                d = torch.randperm(imgs_x.shape[0], generator=g)[:2]  # two different people
                self.x[j, 0, r * CELL:(r + 1) * CELL, c * CELL:(c + 1) * CELL] = imgs_x[d[0]]
                self.y[j, 0, r * CELL:(r + 1) * CELL, c * CELL:(c + 1) * CELL] = imgs_y[d[-1]]

    @property
    def mutual_information(self) -> float:
        return float(sum(math.log(s) for s in self.sizes))


class SmallCNN(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        layers, c = [], 1
        for w in (width, 2 * width, 4 * width, 4 * width):
            layers += [nn.Conv2d(c, w, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(w),
                       nn.ReLU(inplace=True)]
            c = w
        self.net = nn.Sequential(*layers)
        self.out_dim = c

    def forward(self, x):
        return F.adaptive_avg_pool2d(self.net(x), 1).flatten(1)


def _augment(x, g):
    """Random translation by up to 2 px and pixel noise (SMoCo's second view)."""
    dx, dy = (int(v) for v in torch.randint(-2, 3, (2,), generator=g))
    return x.roll((dy, dx), (-2, -1)) + 0.05 * torch.randn(x.shape, generator=g)


def train_one(method: str, train: MultiOmniglotPairs, *, steps, batch, seed, width=32):
    torch.manual_seed(seed)
    k = 4 * batch
    objective, sampler = METHODS[method]
    cfg = ModelConfig(objective=objective, batch_size=batch, dict_size=k, dim=64, fcl=False,
                      momentum=0.99, seed=seed)
    sel = SelectionConfig(sampler=sampler, pool_size=3 * k + batch)
    model = CMACC(cfg, sel, backbones=(SmallCNN(width), SmallCNN(width)))
    opt = torch.optim.Adam(model.query_parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    n = train.x.shape[0]
    for step in range(steps):
        idx = torch.randperm(n, generator=g)[:batch]
        x, y = train.x[idx], train.y[idx]
        kw = {}
        if method == "SMoCo":  # unimodal: x vs augmented x (y vs augmented y)
            kw = dict(video2=_augment(x, g), audio2=_augment(y, g))
        loss, _ = model(x, y, idx, step=step, **kw)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model


@torch.no_grad()
def probe_accuracy(model, train: MultiOmniglotPairs, test: MultiOmniglotPairs) -> float:
    bb = model.f_v.backbone.eval()
    ftr = torch.cat([bb(train.x[s:s + 256]) for s in range(0, len(train.x), 256)])
    fte = torch.cat([bb(test.x[s:s + 256]) for s in range(0, len(test.x), 256)])
    accs = [linear_probe(ftr, train.labels[:, i], fte, test.labels[:, i],
                         num_classes=train.sizes[i])["top1"] for i in range(len(train.sizes))]
    return sum(accs) / len(accs)


def run(root, out, chars=(1, 2, 4, 9), steps=300, batch=32, n_train=2000, n_test=500, seed=0,
        methods=tuple(METHODS), relation="next") -> dict:
    glyphs = Glyphs(root)
    check_glyphs(glyphs, root, max(chars))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"chars": list(chars), "mi": [], "alphabets": glyphs.names[:max(chars)],
               "relation": relation, "steps": steps, "n_train": n_train, "untrained": [],
               **{m: [] for m in methods}}
    for l in chars:
        # drawers 0..13 make the training pairs, 14.. the test pairs (unseen handwriting)
        tr = MultiOmniglotPairs(glyphs, l, n_train, seed=seed + l,
                                drawers=slice(0, TRAIN_DRAWERS), relation=relation)
        te = MultiOmniglotPairs(glyphs, l, n_test, seed=seed + 100 + l,
                                drawers=slice(TRAIN_DRAWERS, None), relation=relation)
        results["mi"].append(tr.mutual_information)
        # the floor: the same encoder at initialisation (what the probe reads without learning)
        results["untrained"].append(probe_accuracy(
            train_one(methods[0], tr, steps=0, batch=batch, seed=seed), tr, te))
        print(f"l={l} (MI {tr.mutual_information:.2f} nats) untrained: probe accuracy "
              f"{results['untrained'][-1]:.3f}", flush=True)
        for m in methods:
            model = train_one(m, tr, steps=steps, batch=batch, seed=seed)
            acc = probe_accuracy(model, tr, te)
            results[m].append(acc)
            print(f"l={l} (MI {tr.mutual_information:.2f} nats) {m}: probe accuracy {acc:.3f}",
                  flush=True)
    atomic_write_text(out / "mi.json", json.dumps(results, indent=2))
    _plot(results, methods, out / "mi.png")
    return results


def check_glyphs(glyphs: Glyphs, root, max_chars: int) -> None:
    """Before any training: enough alphabets for ``max_chars`` characters, and enough drawers
    per character for disjoint train and test hands."""
    if max_chars > len(glyphs.alphabets):
        raise OmniglotError(f"{root}: {max_chars} characters need {max_chars} alphabets, the "
                            f"folder has {len(glyphs.alphabets)}; pass a smaller --chars or the "
                            "full Omniglot images_background")
    fewest = min(c.shape[0] for a in glyphs.alphabets[:max_chars] for c in a)
    if fewest < TRAIN_DRAWERS + 2:
        raise OmniglotError(f"{root}: a character has only {fewest} drawings; the study needs "
                            f">= {TRAIN_DRAWERS + 2} ({TRAIN_DRAWERS} training hands, >= 2 test "
                            "hands; Omniglot has 20)")


def _plot(results, methods, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.6))
    for m in methods:
        ax.plot(results["chars"], results[m], marker="o", label=m)
    if results.get("untrained"):
        ax.plot(results["chars"], results["untrained"], color="grey", ls="--", marker=".",
                label="untrained encoder")
    ax.set_xlabel("number of characters l (MI = sum log l_i grows)")
    ax.set_ylabel("linear-probe character accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
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
    p.add_argument("--chars", type=positive_int, nargs="+", default=[1, 2, 4, 9])
    p.add_argument("--steps", type=positive_int, default=300)
    p.add_argument("--batch", type=positive_int, default=32)
    p.add_argument("--train-pairs", type=positive_int, default=2000)
    p.add_argument("--test-pairs", type=positive_int, default=500)
    p.add_argument("--relation", choices=RELATIONS, default="next",
                   help="y's character: x's next in its alphabet (Ozair et al., default) or x's own")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not (args.make_glyphs or args.omniglot):
        p.error("pass --omniglot ROOT (torchvision layout) or --make-glyphs DIR")
    if max(args.chars) > 9:
        p.error("--chars must be between 1 and 9")
    if args.train_pairs < args.batch:
        p.error(f"--train-pairs {args.train_pairs} is smaller than --batch {args.batch}")
    output_folder(args.out, "--out")
    if args.make_glyphs:
        root = make_glyphs(output_folder(args.make_glyphs, "--make-glyphs"),
                           alphabets=max(args.chars))
    else:
        root = args.omniglot
    run(root, args.out, tuple(args.chars), args.steps, args.batch, args.train_pairs,
        args.test_pairs, seed=args.seed, relation=args.relation)
    print(f"plot: {Path(args.out) / 'mi.png'}  results: {Path(args.out) / 'mi.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
