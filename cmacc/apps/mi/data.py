"""Spatial-MultiOmniglot pairs: the Omniglot glyph bank (uint8 ink), the pairs of l characters
stored as indices and rendered per batch, the MI of each l, and a generated stand-in."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from data_dali.classdist import class_probs, zipf_exponent
from data_dali.cli import UserError

CELL = 32
TRAIN_DRAWERS = 14  # drawers 0..13 make the training pairs, the rest (>= 2) the test pairs
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


def background_folder(root) -> Path:
    """Omniglot's images_background folder under ``root``: the folder holding omniglot-py
    (torchvision's layout), omniglot-py itself, or images_background itself."""
    r = Path(root)
    for base in (r / "omniglot-py" / "images_background", r / "images_background"):
        if base.is_dir():
            return base
    return r if r.name == "images_background" else r / "omniglot-py" / "images_background"


class Glyphs:
    """Omniglot character images as uint8 ink, one tensor per alphabet
    ``bank[a]`` [n_chars, n_drawers, 32, 32]: the ``max_alphabets`` alphabets with the most
    characters (ties by name), largest first, each with all its characters (at most
    ``max_chars`` if given)."""

    def __init__(self, root, max_alphabets=9, max_chars=None):
        # torchvision's Omniglot layout, read directly (torchvision's own class also insists on
        # the downloaded zip files being present, which a copied folder may lack)
        base = background_folder(root)
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
                 relation: str = "next", char_dist: str = "uniform"):
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
        self.char_dist = char_dist
        if zipf_exponent(char_dist, flag="--char-dist") == 0:
            self.labels = torch.stack([torch.randint(0, s, (n,), generator=g)
                                       for s in self.sizes], 1)  # [n, l]
        else:  # a long tail: character c of an alphabet with probability ∝ 1 / (c + 1)^S
            self.labels = torch.stack([torch.multinomial(
                torch.from_numpy(class_probs(char_dist, s)), n, replacement=True, generator=g)
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
        """sum_i log l_i for uniform characters; with a long tail, sum_i H(character at i), the
        entropy of its law (y's character is still a bijection of x's)."""
        if zipf_exponent(self.char_dist) == 0:
            return mutual_information(self.sizes)
        return float(sum(-(p * np.log(p)).sum()
                         for p in (class_probs(self.char_dist, s) for s in self.sizes)))

    def tail(self) -> list[torch.Tensor]:
        """Per position, bool [l_i]: the rarer half of the alphabet (the floor(l_i / 2)
        characters drawn least often among these pairs; ties to the later character)."""
        out = []
        for i, size in enumerate(self.sizes):
            counts = torch.bincount(self.labels[:, i], minlength=size)
            order = sorted(range(size), key=lambda c: (counts[c].item(), -c))
            mask = torch.zeros(size, dtype=torch.bool)
            mask[order[:size // 2]] = True
            out.append(mask)
        return out

    def y_labels(self, idx=slice(None)) -> torch.Tensor:
        """y's character at every position [n, l] (of the pairs ``idx``: [B, l])."""
        shift = 1 if self.relation == "next" else 0
        return (self.labels[idx] + shift) % torch.tensor(self.sizes)

    def image(self, idx, side: str) -> torch.Tensor:
        """uint8 ink [B, 1, rows*32, cols*32] of the x or y ``side`` of the pairs ``idx`` (one
        gather per position; empty cells of the grid stay blank)."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        chars = self.labels[idx] if side == "x" else self.y_labels(idx)  # [B, l]
        hands = (self.drawer_x if side == "x" else self.drawer_y)[idx].long()  # [B, l]
        img = torch.zeros(idx.shape[0], self.rows, self.cols, CELL, CELL, dtype=torch.uint8)
        for i, bank in enumerate(self.bank):
            img[:, i // self.cols, i % self.cols] = bank[chars[:, i], hands[:, i]]
        # [B, rows, cols, 32, 32] → [B, 1, rows*32, cols*32]
        return img.permute(0, 1, 3, 2, 4).reshape(idx.shape[0], 1, self.rows * CELL, self.cols * CELL)

    def images(self, idx) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 ink x, y [B, 1, rows*32, cols*32] of the pairs ``idx``."""
        return self.image(idx, "x"), self.image(idx, "y")

    def render(self, idx, side: str) -> torch.Tensor:
        """Float [0, 1] (ink = 1), channels-last: the ``side`` ("x" or "y") of the pairs ``idx``."""
        return ink_to_float(self.image(idx, side)).contiguous(memory_format=torch.channels_last)

    def batch(self, idx) -> tuple[torch.Tensor, torch.Tensor]:
        """Float x, y in [0, 1] (ink = 1), channels-last, of the pairs ``idx``."""
        return self.render(idx, "x"), self.render(idx, "y")


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
