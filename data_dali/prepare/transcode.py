"""One source file in, its prepared outputs out: probe (PyAV), VP9 WebM at a constant frame
rate and short side, 16 kHz mono FLAC, the log-mel; the manifest row, with notes on what
was handled (or Reject with the reason).
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np

from ..audio import log_mel, MEL_FPS, SR
from ..fileio import atomic_path
from .config import _short, AUDIO_EXT, OUTPUTS, PrepareConfig, Reject

SILENT_PEAK = 1e-4  # peak |sample| below this (-80 dBFS): the clip is flagged silent


def _until_error(frames, errors: list):
    """Decoded frames until the stream ends or the decoder fails (a truncated or damaged
    tail); the error, if any, is appended to ``errors``."""
    while True:
        try:
            f = next(frames)
        except StopIteration:
            return
        except Exception as e:  # PyAV raises InvalidDataError, EOFError, ValueError, ...
            errors.append(e)
            return
        yield f


def _decode_audio(path: Path, origin: float, errors: list) -> np.ndarray:
    """All audio as 16 kHz mono float32, sample 0 at time ``origin`` (the container's start).
    Mono = the mean of the channels (as librosa.to_mono), LFE left out: the level of a sound
    is the same whatever the layout (stereo, 5.1, ...) and nothing clips. A decoder error ends
    the audio there (appended to ``errors``)."""
    import av

    with av.open(str(path)) as c:
        stream = c.streams.audio[0]
        res, keep = None, None
        chunks, first = [], None

        def mono(frames):
            for out in frames:
                chunks.append(out.to_ndarray()[keep].mean(0))

        for frame in _until_error(c.decode(stream), errors):
            if first is None and frame.pts is not None:
                first = float(frame.pts * (frame.time_base or stream.time_base))
            if res is None:  # keep the layout, change the rate and sample format only
                layout = frame.layout
                res = av.AudioResampler(format="fltp", layout=layout, rate=SR)
                names = [ch.name for ch in layout.channels]
                keep = [k for k, n in enumerate(names) if n != "LFE"] or list(range(len(names)))
            mono(res.resample(frame))
        if res is not None:
            mono(res.resample(None))
    wave = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    shift = int(round(((first if first is not None else origin) - origin) * SR))
    if shift > 0:  # audio starts late: pad with silence
        wave = np.concatenate([np.zeros(shift, np.float32), wave])
    elif shift < 0:  # starts early (encoder priming, negative pts): drop what precedes t = 0
        wave = wave[-shift:]
    return wave


def _transcode_video(path: Path, dst: Path, cfg: PrepareConfig, origin: float, errors: list) -> dict:
    """Decode, resample to constant ``cfg.fps`` by presentation time (sample and hold: each
    output slot k/fps shows the newest frame at or before it — variable frame rate in, constant
    out), resize so the short side is ``cfg.short_side`` (even dimensions) and encode VP9, one
    frame at a time (bounded memory). Writes ``dst`` atomically unless too short."""
    import av

    n_out = n_in = 0
    size = None
    gaps: list[float] = []  # intervals between source frames (variable frame rate check)
    with atomic_path(dst) as tmp:
        with av.open(str(path)) as c, av.open(str(tmp), "w", format="webm") as out:
            vs = c.streams.video[0]
            vs.thread_type = "AUTO"
            rate = float(vs.average_rate or vs.guessed_rate or 25)
            tb = vs.time_base or Fraction(1, 1000)
            enc = None
            prev = prev_t = None
            for frame in _until_error(c.decode(vs), errors):
                t = float(frame.pts * tb) - origin if frame.pts is not None else (
                    n_in / rate if prev_t is None else prev_t + 1.0 / rate)
                n_in += 1
                if prev_t is not None and t <= prev_t:  # out-of-order or duplicate timestamp
                    continue
                if size is None:
                    scale = cfg.short_side / min(frame.width, frame.height)
                    size = (max(2, int(round(frame.width * scale / 2)) * 2),
                            max(2, int(round(frame.height * scale / 2)) * 2))
                    rate_out = Fraction(cfg.fps).limit_denominator(1000)
                    enc = out.add_stream("libvpx-vp9", rate=rate_out)
                    enc.codec_context.time_base = 1 / rate_out
                    enc.width, enc.height = size
                    enc.pix_fmt = "yuv420p"
                    enc.options = {"crf": str(cfg.crf), "b": "0", "deadline": "realtime",
                                   "cpu-used": "8", "row-mt": "1", "threads": "1",
                                   "g": str(max(1, int(round(cfg.fps))))}
                cur = frame.reformat(width=size[0], height=size[1], format="yuv420p",
                                     interpolation="AREA")
                while n_out / cfg.fps <= t + 1e-6:
                    # slots before t show the previous frame (if any); the slot at t shows this one
                    use = cur if (prev is None or n_out / cfg.fps > t - 1e-6) else prev
                    _encode(out, enc, use, n_out)
                    n_out += 1
                if prev_t is not None:
                    gaps.append(t - prev_t)
                prev, prev_t = cur, t
            if enc is not None:
                for pkt in enc.encode():
                    out.mux(pkt)
        if n_out == 0:
            why = f" ({_short(errors[0])})" if errors else ""
            raise Reject(f"truncated or corrupt: no decodable video frames{why}")
        if n_out / cfg.fps < cfg.min_seconds:
            raise Reject(f"too short ({n_out / cfg.fps:.2f} s < --min-seconds {cfg.min_seconds})")
    vfr = bool(gaps) and max(gaps) > 1.5 * min(gaps) + 1e-3
    return dict(frames=n_out, width=size[0], height=size[1], decoded=n_in, src_rate=rate,
                vfr=(min(gaps), max(gaps)) if vfr else None)


def _encode(out, enc, frame, k: int):
    """Encode ``frame`` as output frame k (the encoder keeps its own reference, so one decoded
    frame can fill several slots)."""
    frame.pts, frame.time_base = k, enc.codec_context.time_base  # 1 / fps
    for pkt in enc.encode(frame):
        out.mux(pkt)


def _write_flac(path: Path, wave: np.ndarray) -> np.ndarray:
    """Write 16-bit FLAC; returns the samples as stored (read back)."""
    import soundfile as sf

    with atomic_path(path) as tmp:
        sf.write(str(tmp), np.clip(wave, -1, 1), SR, format="FLAC", subtype="PCM_16")
        stored, _ = sf.read(str(tmp), dtype="float32")
    return stored


def _write_npy(path: Path, arr: np.ndarray):
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, arr)


def process(src: Path, out: Path, item: dict, cfg: PrepareConfig, audio_only: bool) -> dict:
    """Prepare one file; returns its manifest fields (without id/label) or raises Reject."""
    import av

    path = src / item["rel"]
    if not path.is_file():
        raise Reject("missing file")
    if path.stat().st_size == 0:
        raise Reject("zero-size file")
    base = out / "clips" / item["out"]  # + OUTPUTS
    base.parent.mkdir(parents=True, exist_ok=True)
    row = dict(video="", audio="", mel="", duration=0.0, frames=0, fps=cfg.fps, width=0,
               height=0, audio_present=0, silent=0)
    notes = []
    try:
        with av.open(str(path)) as c:
            has_v = bool(c.streams.video) and not audio_only
            has_a = bool(c.streams.audio)
            declared = (c.duration or 0) / 1e6
            origin = (c.start_time or 0) / 1e6
    except Exception as e:  # PyAV raises many error types for broken files
        raise Reject(f"unreadable or corrupt ({_short(e)}); check the file plays, or re-download it") from None
    if not audio_only and not has_v:
        hint = " (an audio file: prepare audio datasets with --audio-only)" \
            if path.suffix.lower() in AUDIO_EXT else ""
        raise Reject(f"no video stream{hint}")
    if audio_only and not has_a:
        raise Reject("no audio stream")
    if has_v:
        vpath = base.with_name(base.name + OUTPUTS[0])
        errors: list = []
        try:
            v = _transcode_video(path, vpath, cfg, origin, errors)
        except Reject:
            raise
        except Exception as e:
            raise Reject(f"video decode failed ({_short(e)}); the file is corrupt or uses an "
                         "unsupported codec") from None
        row.update(video=str(vpath.relative_to(out)), frames=v["frames"],
                   duration=round(v["frames"] / cfg.fps, 3), width=v["width"], height=v["height"])
        if v["vfr"]:
            lo, hi = v["vfr"]
            notes.append(f"variable frame rate (frame intervals {1e3 * lo:.0f}-{1e3 * hi:.0f} ms, "
                         f"resampled to {cfg.fps:g} fps)")
        if errors or declared and row["duration"] < 0.9 * declared - 1.0 / cfg.fps:
            why = f" ({_short(errors[0])})" if errors else ""
            notes.append(f"truncated: decoded {row['duration']:.2f} s of {declared:.2f} s declared{why}")
    if not has_a:
        notes.append("no audio stream")
    else:
        errors = []
        try:
            wave = _decode_audio(path, origin, errors)
            if errors and (audio_only or not any(n.startswith("truncated") for n in notes)):
                notes.append(f"audio truncated at {len(wave) / SR:.2f} s ({_short(errors[0])})")
        except Exception as e:
            if audio_only:
                raise Reject(f"audio decode failed ({_short(e)})") from None
            notes.append(f"audio decode failed ({_short(e)}), kept video-only")
            wave = np.zeros(0, np.float32)
        if audio_only:
            row["duration"] = round(len(wave) / SR, 3)
            if len(wave) == 0:
                raise Reject("audio stream has no samples")
            if row["duration"] < cfg.min_seconds:  # sounds are short: pad, never reject
                wave = np.concatenate([wave, np.zeros(round(cfg.min_seconds * SR) - len(wave),
                                                      np.float32)])
                notes.append(f"audio padded with silence from {row['duration']:.2f} s to "
                             f"--min-seconds {cfg.min_seconds:g} s")
                row["duration"] = round(len(wave) / SR, 3)
        elif len(wave) == 0 and not any(n.startswith("audio decode failed") for n in notes):
            notes.append("audio stream has no samples, kept video-only")
        if len(wave):
            if has_v and len(wave) < SR * row["duration"] - SR // MEL_FPS:
                wave = np.concatenate([wave, np.zeros(int(SR * row["duration"]) - len(wave), np.float32)])
                notes.append("audio shorter than video (padded with silence)")
            apath = base.with_name(base.name + OUTPUTS[1])
            wave = _write_flac(apath, wave)  # as stored (16-bit): the mel is of what loaders read
            row.update(audio=str(apath.relative_to(out)), audio_present=1,
                       silent=int(float(np.abs(wave).max()) < SILENT_PEAK))
            if row["silent"]:
                notes.append("silent audio")
            if cfg.mel:
                mpath = base.with_name(base.name + OUTPUTS[2])
                _write_npy(mpath, log_mel(wave))
                row["mel"] = str(mpath.relative_to(out))
    row["notes"] = " | ".join(notes)
    return row
