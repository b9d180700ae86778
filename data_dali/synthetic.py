"""Synthetic audio-visual clips written as ordinary MP4 files (H.264 video + AAC audio), the
embedded default data of the demo and the tests. Generation takes seconds.

Each class pairs a visual pattern (a grating with a class orientation and spatial frequency,
drifting) with a sound (a class pitch, amplitude-modulated at the drift rate). Per instance:
colour, drift speed, phase, noise. ``redundancy`` r makes groups of ~1/(1-r) instances of a
class near copies (the paper's premise: random negatives are redundant).

    python -m data_dali.synthetic OUT [--classes 8 --per-class 12 --seconds 3]

Writes OUT/<class>/<clip>.mp4 — the class-folder layout that ``data_dali.prepare`` reads.
``write_broken`` writes deliberately bad files for tests (truncated, zero-size, no audio,
silent, 5.1 audio, vertical video).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import numpy as np


def _frames(label, n_classes, inst, t_frames, fps, w, h, noise, rng):
    theta = math.pi * label / n_classes
    freq = 2.0 + (label % 3)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    x, y = x / max(w, h), y / max(w, h)
    proj = x * math.cos(theta) + y * math.sin(theta)
    out = np.empty((t_frames, h, w, 3), dtype=np.uint8)
    for t in range(t_frames):
        v = np.sin(2 * math.pi * freq * proj - 2 * math.pi * inst["speed"] * t / fps + inst["phase"])
        img = 0.5 + 0.4 * v[..., None] * inst["colour"][None, None, :]
        img = img + noise * rng.standard_normal(img.shape).astype(np.float32)
        out[t] = np.clip(img * 255, 0, 255).astype(np.uint8)
    return out


def _sound(label, inst, seconds, sr, noise, rng):
    t = np.arange(int(seconds * sr)) / sr
    pitch = 220.0 * 2 ** (label / 4)
    env = 0.5 * (1 + np.cos(2 * math.pi * inst["speed"] * t - inst["phase"]))
    wave = 0.3 * env * np.sin(2 * math.pi * pitch * t) + 0.3 * noise * rng.standard_normal(t.shape)
    return wave.astype(np.float32)


def write_av(path, frames: np.ndarray | None, fps: int, wave: np.ndarray | None, sr: int,
             layout: str = "mono", vcodec: str = "libx264", acodec: str = "aac"):
    """Write an MP4 with PyAV (atomic: temp name, then rename). frames [T, H, W, 3] uint8;
    wave [samples] (mono; copied to every channel of ``layout``)."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")
    with av.open(str(tmp), "w") as out:
        vs = as_ = None
        if frames is not None:
            vs = out.add_stream(vcodec, rate=fps)
            vs.width, vs.height = frames.shape[2], frames.shape[1]
            vs.pix_fmt = "yuv420p"
        if wave is not None:
            as_ = out.add_stream(acodec, rate=sr, layout=layout)
        if vs is not None:
            for f in frames:
                for pkt in vs.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
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
    os.replace(tmp, path)
    return path


def write_dataset(out, classes=8, per_class=12, seconds=3.0, width=96, height=72, fps=15,
                  sr=16_000, redundancy=0.3, noise=0.15, seed=0) -> Path:
    """Write OUT/classNN/classNN_iii.mp4 and OUT/list.csv (path,label,split: every 4th instance
    of a class is a test clip); return OUT. Existing files are kept (resumable)."""
    out = Path(out)
    listing = ["path,label,split"]
    rng = np.random.default_rng(seed)
    group = max(1, round(1.0 / (1.0 - redundancy)))
    params = {}
    for c in range(classes):
        for i in range(per_class):
            key = (c, i // group)
            if key not in params:
                params[key] = dict(speed=0.5 + rng.random(), phase=2 * math.pi * rng.random(),
                                   colour=(0.5 + 0.5 * rng.random(3)).astype(np.float32))
            path = out / f"class{c:02d}" / f"class{c:02d}_{i:03d}.mp4"
            listing.append(f"{path.relative_to(out)},class{c:02d},{'test' if i % 4 == 3 else 'train'}")
            if path.exists():
                continue
            inst = params[key]
            crng = np.random.default_rng([seed, c, i])
            frames = _frames(c, classes, inst, int(seconds * fps), fps, width, height, noise, crng)
            write_av(path, frames, fps, _sound(c, inst, seconds, sr, noise, crng), sr)
    tmp = out / ".list.csv.tmp"
    tmp.write_text("\n".join(listing) + "\n")
    os.replace(tmp, out / "list.csv")
    return out


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


def write_broken(out, fps=10, sr=16_000) -> dict:
    """Deliberately bad inputs; returns {file name: what is wrong}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    inst = dict(speed=1.0, phase=0.0, colour=np.ones(3, np.float32))
    good = _frames(0, 4, inst, 30, fps, 64, 48, 0.1, rng)
    tone = _sound(0, inst, 3.0, sr, 0.1, rng)
    write_av(out / "ok.mp4", good, fps, tone, sr)
    write_av(out / "no_audio.mp4", good, fps, None, sr)
    write_av(out / "silent.mp4", good, fps, np.zeros_like(tone), sr)
    write_av(out / "surround.mp4", good, fps, tone, sr, layout="5.1")
    write_av(out / "vertical.mp4", _frames(1, 4, inst, 30, fps, 48, 80, 0.1, rng), fps, tone, sr)
    write_av(out / "too_short.mp4", good[:5], fps, tone[: sr // 2], sr)
    data = (out / "ok.mp4").read_bytes()
    (out / "truncated.mp4").write_bytes(data[: len(data) // 3])
    (out / "zero.mp4").write_bytes(b"")
    (out / "not_a_video.mp4").write_bytes(b"this is text, not a video\n" * 20)
    write_av(out / "audio_only.mp4", None, fps, tone, sr)
    return {"ok.mp4": "ok", "no_audio.mp4": "no audio stream", "silent.mp4": "silent audio",
            "surround.mp4": "5.1 audio", "vertical.mp4": "vertical video",
            "too_short.mp4": "too short", "truncated.mp4": "truncated", "zero.mp4": "zero size",
            "not_a_video.mp4": "not a media file", "audio_only.mp4": "no video stream"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--per-class", type=int, default=12)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--redundancy", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(write_dataset(args.out, args.classes, args.per_class, args.seconds,
                        redundancy=args.redundancy, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
