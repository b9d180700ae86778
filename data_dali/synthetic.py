"""Synthetic audio-visual clips, the one definition: in memory and as MP4 files.

In memory: ``ToyAV`` and ``ToyLoader`` (torch tensors in seconds, no files, no decoders; the
CPU playground of the method). As files: ``write_dataset`` (H.264 video + AAC audio, read
through ``data_dali.prepare`` and the loaders like any dataset).

Both renderings follow one law (the functions below the imports):
- class c of C: a sinusoidal grating with orientation pi c / C and spatial frequency 2 + c % 3
  cycles per frame width (``class_grating``), with a class sound: energy in a class band of the
  log-mel (in memory) or a class pitch (files; ``class_pitch``);
- instance: drift speed, phase and colour (``instance_params``); the grating drifts and the
  sound's envelope beats at the same speed and phase, so picture and sound correspond per
  instance; plus noise;
- ``redundancy`` r in [0, 1): groups of ``group_size(r)`` = round(1 / (1 - r)) consecutive
  instances of a class share their parameters (near duplicates: the paper's premise that random
  negatives are redundant; ``instance_group``);
- ``class_dist``: how many clips each class gets — ``uniform`` (balanced) or ``zipf:S`` (class c
  gets a share proportional to 1 / (c + 1)^S: a long tail, as in UCF101 / Kinetics-like
  pools). Quotas, not draws: the counts are the largest-remainder rounding of n * p_c
  (``class_counts``), so a dataset is exactly its law, whatever the seed.

    python -m data_dali.synthetic OUT [--classes 8 --per-class 12 --seconds 3 --class-dist zipf:1]

writes OUT/<class>/<clip>.mp4 (the class-folder layout that ``data_dali.prepare`` reads) and
OUT/list.csv. ``write_broken`` writes deliberately bad files for tests (truncated, zero-size, no
audio, silent, 5.1 audio, vertical video, ...).
"""

from __future__ import annotations

import math
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from .classdist import CLASS_DIST_FORMS, class_counts, class_probs, zipf_exponent  # noqa: F401
from .cli import ArgumentParser, UserError, command, output_folder
from .fileio import atomic_path, atomic_write_bytes, atomic_write_text


class SyntheticError(UserError, ValueError):
    """A bad request for synthetic clips (sizes, counts): the message names the argument."""


# ----------------------------------------------------------------------------------------------
# The law shared by both renderings
# ----------------------------------------------------------------------------------------------
def group_size(redundancy: float) -> int:
    """How many consecutive instances of a class share their parameters: round(1 / (1 - r))."""
    if not 0.0 <= redundancy < 1.0:
        raise SyntheticError(f"redundancy must be in [0, 1), got {redundancy}")
    return max(1, round(1.0 / (1.0 - redundancy)))


def instance_group(k, redundancy: float):
    """The parameter group of the k-th instance of a class (int, array or tensor)."""
    return k // group_size(redundancy)


def interleave(counts) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels [n], instance [n]) of the clips of ``counts[c]`` instances per class, in rounds:
    instance 0 of every class, then instance 1 of every class that has one, and so on. With
    equal counts clip j is class j % C, instance j // C."""
    counts = torch.as_tensor(counts)
    inst = torch.arange(int(counts.max()) if len(counts) else 0)
    keep = inst[:, None] < counts[None, :]  # [rounds, C]
    return (torch.arange(len(counts)).expand_as(keep)[keep],  # row-major: rounds, then classes
            inst[:, None].expand_as(keep)[keep])


def held_out(instance):
    """The test-split rule of both renderings: every 4th instance of a class is a test clip."""
    return instance % 4 == 3


def class_grating(label, num_classes: int):
    """(orientation in radians, spatial frequency in cycles per frame width) of class ``label``
    (a number, an array or a float tensor)."""
    return math.pi * label / num_classes, 2.0 + label % 3


def class_pitch(label, num_classes: int) -> float:
    """The tone of class ``label`` in the files, Hz: 220 * 2^(label * step), step = 1/4 octave
    (a minor third) while C <= 20, else 5 / C octaves, so that every class stays at or below
    220 * 2^5 = 7040 Hz, under the 8 kHz Nyquist frequency of 16 kHz audio (no aliasing)."""
    return 220.0 * 2 ** (label * min(0.25, 5.0 / num_classes))


def instance_params(uniform) -> dict:
    """One draw of the instance law: drift speed in [0.5, 1.5) cycles per unit of clip time,
    phase in [0, 2 pi), colour in [0.5, 1) per RGB channel. ``uniform(*shape)`` returns U[0, 1)
    samples (numpy or torch) of its batch shape + ``shape``; it is called in this order: speed,
    phase, colour (shape (3,))."""
    speed = 0.5 + uniform()
    phase = 2 * math.pi * uniform()
    colour = 0.5 + 0.5 * uniform(3)
    return dict(speed=speed, phase=phase, colour=colour)


# ----------------------------------------------------------------------------------------------
# In memory: the CPU playground of the method (tests, ``--data synthetic``)
# ----------------------------------------------------------------------------------------------
class ToyAV:
    """``num_clips`` clips: ``class_counts(class_dist, ...)`` of each class, in the order of
    ``interleave`` (balanced: clip j of class j % num_classes and instance j // num_classes);
    ``labels`` and ``instance`` (the clip's rank within its class) [n]. ``video`` [n, 3, frames, size, size] (a grating in [-1, 1] times the colour, + noise);
    ``audio`` [n, n_mels, mel_frames] (log-mel-like: a Gaussian band at the class's band,
    beating at the drift rate, + noise). Clip time runs over [0, 1) in both."""

    def __init__(self, num_clips=256, num_classes=8, frames=8, size=32, mel_frames=None,
                 n_mels=80, fps=10, redundancy=0.0, noise=0.3, class_dist="uniform", seed=0):
        if num_clips < 1 or num_classes < 1:
            raise ValueError("ToyAV: num_clips and num_classes must be >= 1")
        self.num_clips, self.num_classes, self.redundancy = num_clips, num_classes, redundancy
        self.frames, self.size, self.n_mels = frames, size, n_mels
        self.mel_frames = mel_frames or round(frames * 100 / fps)
        self.class_names = [f"class{c:02d}" for c in range(num_classes)]
        self.labels, self.instance = interleave(class_counts(class_dist, num_clips, num_classes))
        g = torch.Generator().manual_seed(seed)
        inst = instance_group(self.instance, redundancy)  # [n] parameter group
        n_inst = int(inst.max()) + 1
        p = instance_params(lambda *shape: torch.rand(n_inst, num_classes, *shape, generator=g))
        c, i = self.labels, inst
        self.video = self._video(c, p["speed"][i, c], p["phase"][i, c], p["colour"][i, c], noise, g)
        self.audio = self._audio(c, p["speed"][i, c], p["phase"][i, c], noise, g)

    def _video(self, c, speed, phase, colour, noise, g):
        T, S = self.frames, self.size
        theta, freq = class_grating(c.float(), self.num_classes)  # [n] orientation, frequency
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
    every global batch, so the gathered global batch is the same as in one process, at any
    world size: the second views are drawn for the whole global batch, then sliced)."""

    def __init__(self, data: ToyAV, batch_size: int, *, seed=0, rank=0, world=1, views=1):
        if batch_size % world:
            raise ValueError(f"global batch {batch_size} does not divide over {world} ranks")
        if batch_size > len(data):
            raise ValueError(f"batch {batch_size} > {len(data)} clips: use fewer or more clips")
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.rank, self.world, self.views, self.epoch, self.start = rank, world, views, 0, 0
        self.num_clips, self.num_classes = len(data), data.num_classes
        self.class_names, self.labels = data.class_names, data.labels

    def __len__(self):
        return len(self.data) // self.batch_size

    def to(self, device) -> "ToyLoader":
        """Keep the clips on ``device`` and gather each batch there (one views only: the second
        view's draws are host tensors): a batch then costs one gather on the device instead of
        a host gather and a host-to-device copy of the clips. The batches are the same."""
        if self.views != 1:
            raise ValueError("ToyLoader.to: the clips stay on the host with views=2")
        d = self.data
        d.video, d.audio, d.labels = d.video.to(device), d.audio.to(device), d.labels.to(device)
        return self

    @property
    def nbytes(self) -> int:
        """Bytes of the clips (video and audio)."""
        return self.data.video.nbytes + self.data.audio.nbytes

    def set_epoch(self, epoch: int, start: int = 0):
        """The next ``iter()`` is epoch ``epoch`` from its batch ``start`` on."""
        self.epoch, self.start = epoch, start

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 7919 + self.epoch)
        perm = torch.randperm(len(self.data), generator=g)
        if self.views == 1:  # where the clips are (ToyLoader.to): one copy an epoch
            perm = perm.to(self.data.video.device)
        per = self.batch_size // self.world
        mine = slice(self.rank * per, (self.rank + 1) * per)
        for b in range(len(self)):
            idx = perm[b * self.batch_size:(b + 1) * self.batch_size]
            if self.views == 1:
                batch = self.data.batch(idx[mine])
            else:  # (earlier batches still advance g: the views' draws)
                batch = {k: v[mine] for k, v in self.data.batch(idx, g, self.views).items()}
            if b >= self.start:
                yield batch


# ----------------------------------------------------------------------------------------------
# As files: MP4s for data_dali.prepare (the demo's and the tests' embedded dataset)
# ----------------------------------------------------------------------------------------------
def _frames(label, n_classes, inst, t_frames, fps, w, h, noise, rng):
    """[t_frames, h, w, 3] uint8: the class grating drifting at the instance's speed (cycles
    per second), in the instance's colour around mid-grey, + noise."""
    theta, freq = class_grating(label, n_classes)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    x, y = x / max(w, h), y / max(w, h)
    proj = x * math.cos(theta) + y * math.sin(theta)
    out = np.empty((t_frames, h, w, 3), dtype=np.uint8)
    for t in range(t_frames):
        v = np.sin(2 * math.pi * freq * proj - 2 * math.pi * inst["speed"] * t / fps + inst["phase"])
        img = 0.5 + 0.4 * v[..., None] * inst["colour"][None, None, :]
        img = img + noise * rng.standard_normal(img.shape, dtype=np.float32)
        out[t] = np.clip(img * 255, 0, 255).astype(np.uint8)
    return out


def _sound(label, n_classes, inst, seconds, sr, noise, rng):
    """[seconds * sr] float32: the class pitch, its envelope beating with the grating's drift."""
    t = np.arange(int(seconds * sr)) / sr
    pitch = class_pitch(label, n_classes)
    env = 0.5 * (1 + np.cos(2 * math.pi * inst["speed"] * t - inst["phase"]))
    wave = 0.3 * env * np.sin(2 * math.pi * pitch * t) + 0.3 * noise * rng.standard_normal(t.shape)
    return wave.astype(np.float32)


def write_av(path, frames: np.ndarray | None, fps: int, wave: np.ndarray | None, sr: int,
             layout: str = "mono", vcodec: str = "libx264", acodec: str = "aac",
             times: np.ndarray | None = None, pix_fmt: str = "yuv420p", faststart: bool = False):
    """Write an MP4 with PyAV (atomically: data_dali/fileio.py). frames [T, H, W, 3] uint8;
    wave [samples] (mono; copied to every channel of ``layout``); ``times`` [T] seconds: the
    presentation time of each frame (variable frame rate), else frame k is at k / fps."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opts = {"movflags": "+faststart"} if faststart else {}
    with atomic_path(path) as tmp, av.open(str(tmp), "w", format="mp4", options=opts) as out:
        vs = as_ = None
        if frames is not None:
            vs = out.add_stream(vcodec, rate=fps)
            vs.width, vs.height = frames.shape[2], frames.shape[1]
            vs.pix_fmt = pix_fmt  # yuv420p needs even dimensions; yuv444p takes odd ones
            if vcodec == "libx264":  # tiny frames: the fastest preset, one thread each
                vs.options = {"preset": "ultrafast", "threads": "1"}
            if times is not None:
                vs.codec_context.time_base = Fraction(1, 1000)
        if wave is not None:
            as_ = out.add_stream(acodec, rate=sr, layout=layout)
        if vs is not None:
            for k, f in enumerate(frames):
                vf = av.VideoFrame.from_ndarray(f, format="rgb24")
                if times is not None:
                    vf.pts, vf.time_base = int(round(times[k] * 1000)), Fraction(1, 1000)
                for pkt in vs.encode(vf):
                    out.mux(pkt)
            for pkt in vs.encode():
                out.mux(pkt)
        if as_ is not None:
            if acodec == "aac":
                # FFmpeg's AAC encoder primes 1024 samples that this muxer does not signal in an
                # edit list, so decoders would play the sound 64 ms late: start 1024 samples in
                wave = wave[1024:]
            n_ch = av.AudioLayout(layout).nb_channels
            chunk = 1024
            for s in range(0, len(wave), chunk):
                block = np.repeat(wave[None, s:s + chunk], n_ch, 0).astype(np.float32)
                af = av.AudioFrame.from_ndarray(block, format="fltp", layout=layout)
                af.sample_rate = sr
                for pkt in as_.encode(af):
                    out.mux(pkt)
            for pkt in as_.encode():
                out.mux(pkt)
    return path


def write_dataset(out, classes=8, per_class=12, seconds=3.0, width=96, height=72, fps=15,
                  sr=16_000, redundancy=0.3, noise=0.15, seed=0, class_dist="uniform") -> Path:
    """Write OUT/classNN/classNN_iii.mp4 and OUT/list.csv (path,label,class_name,split in the
    list format of ``prepare --layout list``: label NN, every 4th instance of a class a test
    clip); return OUT. ``classes * per_class`` clips, shared out by
    ``class_counts(class_dist, ...)`` (uniform: ``per_class`` each; a class whose quota is 0
    has no clip). Existing files are kept (resumable)."""
    for name, value, low in (("classes", classes, 1), ("per_class", per_class, 1), ("width", width, 2),
                             ("height", height, 2), ("fps", fps, 1), ("sr", sr, 1000)):
        if value < low:
            raise SyntheticError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    if not 0 < seconds * fps < 1e6:
        raise SyntheticError(f"--seconds must give 1 to 10^6 frames at {fps} fps, got {seconds}")
    group_size(redundancy)  # checks the range
    out = output_folder(out, "OUT")
    listing = ["path,label,class_name,split"]
    for c, i, inst, crng in file_clips(classes, per_class, redundancy, seed, class_dist):
        path = out / f"class{c:02d}" / f"class{c:02d}_{i:03d}.mp4"
        listing.append(f"{path.relative_to(out).as_posix()},{c},class{c:02d},"
                       f"{'test' if held_out(i) else 'train'}")
        if not path.exists():
            frames = _frames(c, classes, inst, int(seconds * fps), fps, width, height, noise, crng)
            write_av(path, frames, fps, _sound(c, classes, inst, seconds, sr, noise, crng), sr)
    atomic_write_text(out / "list.csv", "\n".join(listing) + "\n")
    return out


def file_clips(classes, per_class, redundancy, seed, class_dist):
    """(class c, instance i, instance parameters, the clip's noise generator) of every clip of
    ``write_dataset``, in its order: render a clip with ``_frames`` then ``_sound`` (that order)
    from the generator."""
    rng = np.random.default_rng(seed)
    params = {}
    for c, n in enumerate(class_counts(class_dist, classes * per_class, classes)):
        for i in range(n):
            key = (c, instance_group(i, redundancy))
            if key not in params:
                p = instance_params(lambda *shape: rng.random(shape or None))  # () -> a float
                params[key] = dict(p, colour=p["colour"].astype(np.float32))
            yield c, i, params[key], np.random.default_rng([seed, c, i])


def write_click_clip(path, click_frames, seconds=4.0, fps=10, sr=16_000, size=64):
    """A clip whose sound is silent except for a short click at the start of each frame in
    ``click_frames`` and whose frames show the frame number as brightness (alignment tests)."""
    t_frames = int(seconds * fps)
    frames = np.zeros((t_frames, size, size, 3), dtype=np.uint8)
    for t in range(t_frames):
        frames[t] = int(255 * t / t_frames)
    wave = np.zeros(int(seconds * sr), dtype=np.float32)
    for k in click_frames:
        s = int(k / fps * sr)
        wave[s:s + 320] = 0.8 * np.sin(2 * math.pi * 3000 * np.arange(min(320, len(wave) - s)) / sr)
    return write_av(path, frames, fps, wave, sr)


# Deliberately bad inputs and what data_dali.prepare must do with each: (outcome, text) where
# outcome is "keep" (text: a note expected in the manifest's notes column, "" = none) or
# "reject" (text: the start of the reason in rejects.csv).
BROKEN = {
    "ok.mp4": ("keep", ""),
    "no_audio.mp4": ("keep", "no audio stream"),  # kept video-only, audio_present=0
    "silent.mp4": ("keep", "silent audio"),
    "surround.mp4": ("keep", ""),  # 5.1 → mono
    "stereo.mp4": ("keep", ""),  # stereo → mono
    "vertical.mp4": ("keep", ""),  # 48x80 → short side 128: 128x214 (even)
    "odd_size.mp4": ("keep", ""),  # 67x45 → even dimensions
    "vfr.mp4": ("keep", "variable frame rate"),  # 30, 7 and 25 fps stretches → constant fps
    "truncated_tail.mp4": ("keep", "truncated"),  # index up front, the tail cut off
    "too_short.mp4": ("reject", "too short"),
    "truncated.mp4": ("reject", "unreadable or corrupt"),  # cut before its index: undecodable
    "zero.mp4": ("reject", "zero-size file"),
    "not_a_video.mp4": ("reject", "unreadable or corrupt"),
    "audio_only.mp4": ("reject", "no video stream"),
}


def vfr_times() -> np.ndarray:
    """Presentation times of the variable-frame-rate test clip (3 s: 30, 7 and 25 fps)."""
    return np.concatenate([np.arange(0, 1, 1 / 30), 1 + np.arange(0, 1, 1 / 7),
                           2 + np.arange(0, 1, 1 / 25)])


def write_broken(out, fps=10, sr=16_000) -> dict:
    """Write the files of ``BROKEN`` into ``out`` (3 s each unless too short); returns BROKEN."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    inst = dict(speed=1.0, phase=0.0, colour=np.ones(3, np.float32))
    good = _frames(0, 4, inst, 30, fps, 64, 48, 0.1, rng)
    tone = _sound(0, 4, inst, 3.0, sr, 0.1, rng)
    write_av(out / "ok.mp4", good, fps, tone, sr)
    write_av(out / "no_audio.mp4", good, fps, None, sr)
    write_av(out / "silent.mp4", good, fps, np.zeros_like(tone), sr)
    write_av(out / "surround.mp4", good, fps, tone, sr, layout="5.1")
    write_av(out / "stereo.mp4", good, fps, tone, sr, layout="stereo")
    write_av(out / "vertical.mp4", _frames(1, 4, inst, 30, fps, 48, 80, 0.1, rng), fps, tone, sr)
    write_av(out / "odd_size.mp4", _frames(2, 4, inst, 30, fps, 67, 45, 0.1, rng), fps, tone, sr,
             pix_fmt="yuv444p")
    times = vfr_times()
    vfr = np.zeros((len(times), 48, 64, 3), np.uint8)
    for k, t in enumerate(times):
        vfr[k] = int(round(t * 80))  # brightness encodes the presentation time
    write_av(out / "vfr.mp4", vfr, 30, tone, sr, times=times)
    write_av(out / "too_short.mp4", good[:5], fps, tone[: sr // 2], sr)
    write_av(out / "audio_only.mp4", None, fps, tone, sr)
    long = np.concatenate([good, good])  # 6 s, the index (moov) written first
    write_av(out / ".long.mp4", long, fps, np.concatenate([tone, tone]), sr, faststart=True)
    data = (out / ".long.mp4").read_bytes()
    (out / ".long.mp4").unlink()
    atomic_write_bytes(out / "truncated_tail.mp4", data[: int(len(data) * 0.6)])
    data = (out / "ok.mp4").read_bytes()
    atomic_write_bytes(out / "truncated.mp4", data[: len(data) // 3])
    atomic_write_bytes(out / "zero.mp4", b"")
    atomic_write_bytes(out / "not_a_video.mp4", b"this is text, not a video\n" * 20)
    return dict(BROKEN)


@command
def main(argv=None):
    p = ArgumentParser(prog="python -m data_dali.synthetic", description=__doc__)
    p.add_argument("out", help="output folder (created if missing; existing clips are kept)")
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--per-class", type=int, default=12)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--redundancy", type=float, default=0.3, help="in [0, 1): near-duplicate instances")
    p.add_argument("--class-dist", default="uniform",
                   help=f"clips per class: {CLASS_DIST_FORMS}; --per-class is then the mean")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(write_dataset(args.out, args.classes, args.per_class, args.seconds,
                        redundancy=args.redundancy, seed=args.seed, class_dist=args.class_dist))
    return 0


if __name__ == "__main__":
    sys.exit(main())
