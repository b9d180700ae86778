"""In-memory synthetic audio-visual clips: seconds to make, no files, no decoders.

Each class pairs a visual pattern (a sinusoidal grating with a class orientation and spatial
frequency, drifting over time) with a sound pattern (energy in a class band of the log-mel,
modulated at the grating's drift rate). Per instance: colour, drift speed, phase and noise.
``redundancy`` r in [0, 1) makes groups of about 1/(1-r) consecutive clips of a class share
their instance parameters (near duplicates: the paper's premise). The video and audio of one
clip share the drift speed and phase, so cross-modal correspondence is learnable per instance.

This is the CPU playground of the method (tests, ``--data synthetic``); real files come from
``data_dali`` (prepared datasets).
"""

from __future__ import annotations

import math

import torch


class ToyAV:
    def __init__(self, num_clips=256, num_classes=8, frames=8, size=32, mel_frames=None,
                 n_mels=80, fps=10, redundancy=0.0, noise=0.3, seed=0):
        if num_clips < 1 or num_classes < 1:
            raise ValueError("ToyAV: num_clips and num_classes must be >= 1")
        if not 0.0 <= redundancy < 1.0:
            raise ValueError(f"ToyAV: redundancy must be in [0, 1), got {redundancy}")
        self.num_clips, self.num_classes = num_clips, num_classes
        self.frames, self.size, self.n_mels = frames, size, n_mels
        self.mel_frames = mel_frames or round(frames * 100 / fps)
        self.class_names = [f"class{c:02d}" for c in range(num_classes)]
        self.labels = torch.arange(num_clips) % num_classes  # [n]
        group = max(1, round(1.0 / (1.0 - redundancy)))
        g = torch.Generator().manual_seed(seed)
        inst = (torch.arange(num_clips) // num_classes) // group  # shared within a group
        n_inst = int(inst.max()) + 1
        speed = 0.5 + torch.rand(n_inst, num_classes, generator=g)  # cycles / clip-second
        phase = 2 * math.pi * torch.rand(n_inst, num_classes, generator=g)
        colour = 0.5 + 0.5 * torch.rand(n_inst, num_classes, 3, generator=g)
        c, i = self.labels, inst
        self.video = self._video(c, speed[i, c], phase[i, c], colour[i, c], noise, g)
        self.audio = self._audio(c, speed[i, c], phase[i, c], noise, g)

    def _video(self, c, speed, phase, colour, noise, g):
        T, S, C = self.frames, self.size, self.num_classes
        theta = math.pi * c.float() / C  # [n] orientation
        freq = 2.0 + (c % 3).float()  # [n] cycles per frame width
        y, x = torch.meshgrid(torch.linspace(0, 1, S), torch.linspace(0, 1, S), indexing="ij")
        proj = x * torch.cos(theta)[:, None, None] + y * torch.sin(theta)[:, None, None]  # [n,S,S]
        t = torch.arange(T).float() / T  # [T] clip time in [0, 1)
        arg = (2 * math.pi * freq[:, None, None, None] * proj[:, None]
               - 2 * math.pi * speed[:, None, None, None] * t[None, :, None, None]
               + phase[:, None, None, None])  # [n, T, S, S]
        v = torch.sin(arg)[:, None] * colour[:, :, None, None, None]  # [n, 3, T, S, S]
        return v + noise * torch.randn(v.shape, generator=g)

    def _audio(self, c, speed, phase, noise, g):
        L, B, C = self.mel_frames, self.n_mels, self.num_classes
        centre = (c.float() + 0.5) * B / C  # [n]
        band = torch.exp(-0.5 * ((torch.arange(B)[None] - centre[:, None]) / 2.5) ** 2)  # [n,B]
        t = torch.arange(L).float() / L  # [L], same clip time axis as the video
        env = 1 + torch.cos(2 * math.pi * speed[:, None] * t[None] - phase[:, None])  # [n, L]
        a = 3.0 * band[:, :, None] * env[:, None, :]  # [n, B, L]
        return a + noise * torch.randn(a.shape, generator=g)

    def __len__(self):
        return self.num_clips

    def batch(self, index: torch.Tensor, g: torch.Generator | None = None, views: int = 1):
        """A batch dict for these dataset indices; with views=2 adds an augmented second view
        (random horizontal flip and a small circular time shift) for SMoCo."""
        out = {"video": self.video[index], "audio": self.audio[index], "index": index,
               "label": self.labels[index]}
        if views == 2:
            flip = torch.rand(len(index), generator=g) < 0.5
            v2 = torch.where(flip[:, None, None, None, None], out["video"].flip(-1), out["video"])
            shift = int(torch.randint(0, max(1, self.mel_frames // 8), (1,), generator=g))
            out["video2"] = v2 + 0.1 * torch.randn(v2.shape, generator=g)
            out["audio2"] = out["audio"].roll(shift, -1)
        return out


class ToyLoader:
    """Epochs of shuffled batches from ToyAV; sharded by rank (each rank gets its slice of
    every global batch, so the gathered global batch is the same as in one process)."""

    def __init__(self, data: ToyAV, batch_size: int, *, seed=0, rank=0, world=1, views=1):
        if batch_size % world:
            raise ValueError(f"global batch {batch_size} does not divide over {world} ranks")
        if batch_size > len(data):
            raise ValueError(f"batch {batch_size} > {len(data)} clips: use fewer or more clips")
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.rank, self.world, self.views, self.epoch = rank, world, views, 0
        self.num_clips, self.num_classes = len(data), data.num_classes
        self.class_names, self.labels = data.class_names, data.labels

    def __len__(self):
        return len(self.data) // self.batch_size

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 7919 + self.epoch)
        perm = torch.randperm(len(self.data), generator=g)
        per = self.batch_size // self.world
        for b in range(len(self)):
            idx = perm[b * self.batch_size:(b + 1) * self.batch_size]
            yield self.data.batch(idx[self.rank * per:(self.rank + 1) * per], g, self.views)
