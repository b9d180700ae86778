"""Prepare a dataset for the loaders: source media in, uniform clips and a manifest out.
Installed as the command ``cmacc-prepare`` (= ``python -m data_dali.prepare``).

Probe every file (PyAV), transcode video to VP9 in WebM (DALI decodes VP9 on CPU and GPU;
H.264 only on GPU) at a constant frame rate and short side, resample audio to 16 kHz mono FLAC,
precompute the 80-band log-mel, and write the manifest (the only thing loaders read).

    python -m data_dali.prepare SRC OUT                            # SRC/<class>/<video files>
    python -m data_dali.prepare SRC OUT --layout list --list files.csv   # path,label[,split]
    python -m data_dali.prepare UCF-101 OUT --layout ucf101 --splits ucfTrainTestlist
    python -m data_dali.prepare hmdb51 OUT --layout hmdb51 --splits testTrainMulti_7030_splits
    python -m data_dali.prepare ESC-50-master OUT --layout esc50   # audio/*.wav + meta/esc50.csv
    python -m data_dali.prepare SOUNDS OUT --audio-only            # SRC/<class>/<audio files>

Outputs: OUT/clips/<path in SRC>.webm|.flac|.mel.npy (prepared media, named after the whole
source path with its extension, so no two sources share an output), OUT/manifest.csv,
OUT/rejects.csv (file, reason), OUT/records/ (one small JSON per source file: what was done,
for resuming) and a summary of what was kept, noted and rejected, by reason. Bad inputs never
stop the run and are never dropped silently: each is either handled (and noted in the
manifest's ``notes`` column) or written to rejects.csv. A mistake in the command (paths, flags,
list and split files) or an output disk that is full or cannot be written stops it with one
line (exit 2; ``--debug`` shows the traceback), before the work where it can be known. Every
output is written atomically (data_dali/fileio.py); a re-run, also after a crash or
``kill -9``, skips files whose source and settings are unchanged (a no-op when nothing changed;
``--retry-rejects`` tries rejected files again).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import os
import re
import shutil
import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from .audio import MEL_FPS, SR, log_mel
from .cli import (DISK_ERRNOS, ArgumentParser, UserError, command, ignore_interrupts,
                  output_folder, setup_logging)
from .fileio import atomic_path, atomic_write_bytes, atomic_write_text, sweep_temporaries
from .manifest import FIELDS as _MANIFEST_FIELDS
from .manifest import MAX_CLASSES, UNLABELED

log = logging.getLogger("data_dali.prepare")
VIDEO_EXT = {".mp4", ".avi", ".mkv", ".webm", ".mov", ".m4v", ".mpg", ".mpeg", ".flv", ".ogv",
             ".3gp", ".wmv", ".ts"}
AUDIO_EXT = {".wav", ".flac", ".ogg", ".mp3", ".m4a", ".aac", ".opus"}
FIELDS = _MANIFEST_FIELDS + ["notes"]
SILENT_PEAK = 1e-4  # peak |sample| below this (-80 dBFS): the clip is flagged silent
RECORD_VERSION = 3  # bump when the output format changes: finished files are then redone
OUTPUTS = (".webm", ".flac", ".mel.npy")  # appended to clips/<source path>
SPACE_FACTOR = 0.25  # outputs need at least this fraction of the sources' size (VP9 at 128 px)
LOW_SPACE = 8 << 20  # an unexpected error with less free than this on OUT: the disk is full


class PrepareError(UserError, ValueError):
    """A mistake in what prepare was asked (paths, flags, list and split files), or an output
    folder it cannot write (full disk, no permission): the message names it and the fix."""


@dataclass
class PrepareConfig:
    """What every prepared clip looks like. A change re-prepares the affected files."""

    fps: float = 10.0  # paper: 10 fps
    short_side: int = 128  # so 112 crops work; 256 for 224 crops
    min_seconds: float = 1.6  # 16 frames at 10 fps: one pretraining clip
    mel: bool = True  # precompute the log-mel (.mel.npy); otherwise loaders compute it
    crf: int = 32  # VP9 constant quality (lower = better, larger files)

    def __post_init__(self):
        if not 0 < self.fps <= 120:
            raise PrepareError(f"--fps must be in (0, 120], got {self.fps}")
        if self.short_side < 16 or self.short_side % 2:
            raise PrepareError(f"--short-side must be an even number >= 16, got {self.short_side}")
        if not 0 <= self.min_seconds < float("inf"):
            raise PrepareError(f"--min-seconds must be >= 0, got {self.min_seconds}")
        if not 0 <= self.crf <= 63:
            raise PrepareError(f"--crf must be in [0, 63] (VP9), got {self.crf}")


class Reject(Exception):
    """A file that cannot be used; the message is the reason written to rejects.csv."""


# ----------------------------------------------------------------------------------------------
# Scanning sources: items {rel, class_name, label?, split1..3, fold[, reject]}
# ----------------------------------------------------------------------------------------------
def _item(rel, class_name, split1="", fold="", label=None):
    return dict(rel=str(rel).replace(os.sep, "/"), class_name=str(class_name), label=label,
                split1=split1, split2="", split3="", fold=str(fold))


LAYOUTS = ("auto", "folders", "list", "ucf101", "hmdb51", "esc50")
SPLIT_DIRS = {"ucf101": "ucfTrainTestlist", "hmdb51": "testTrainMulti_7030_splits"}


def scan(src: Path, layout: str = "auto", list_file=None, splits=None,
         audio_only: bool = False, exclude=None) -> tuple[list[dict], list[str]]:
    """Items to prepare, and warnings about the source (e.g. split entries without a file).
    ``exclude``: the output folder, never read as a source (nor any other prepared dataset)."""
    src = Path(src)
    if not src.is_dir():
        what = "is a file, not a folder" if src.exists() else "source folder not found"
        raise PrepareError(f"{src}: {what}; pass the folder holding the class sub-folders (or "
                           "audio/ and meta/ for ESC-50)")
    if layout not in LAYOUTS:
        raise PrepareError(f"unknown --layout {layout!r}; use {', '.join(LAYOUTS)}")
    if layout == "auto":
        layout = "esc50" if (src / "meta" / "esc50.csv").is_file() else ("list" if list_file else "folders")
    if list_file and layout != "list":
        raise PrepareError(f"--list {list_file} is only read with --layout list (not {layout}); "
                           "drop it or pass --layout list")
    if splits and layout not in SPLIT_DIRS:
        raise PrepareError(f"--splits {splits} is only read with --layout ucf101 or hmdb51 (not "
                           f"{layout}); drop it or pass the layout")
    warnings: list[str] = []
    if layout == "list":
        return _scan_list(list_file), warnings
    if layout == "esc50":
        return _scan_esc50(src), warnings
    exts = AUDIO_EXT if audio_only else VIDEO_EXT
    items, skipped, outputs = [], Counter(), []
    for cls in sorted(p for p in src.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for f in _files(cls, exclude, outputs):
            if not f.is_file() or f.name.startswith("."):
                continue
            if f.suffix.lower() in exts:
                items.append(_item(f.relative_to(src), cls.name))
            else:
                skipped[f.suffix.lower() or "(none)"] += 1
    if outputs:
        warnings.append(f"left out {len(outputs)} prepared dataset folder(s) inside SRC (outputs "
                        f"are never sources): {', '.join(sorted(outputs)[:3])}")
    if skipped:
        warnings.append(f"ignored {sum(skipped.values())} files that are not "
                        f"{'audio' if audio_only else 'video'} by extension: {dict(skipped)}")
    if layout in SPLIT_DIRS:
        if not splits:
            raise PrepareError(f"--layout {layout} needs --splits DIR (the official split files: "
                               f"{SPLIT_DIRS[layout]})")
        if not Path(splits).is_dir():
            raise PrepareError(f"--splits {splits}: not a folder; pass the {SPLIT_DIRS[layout]} "
                               "folder of the official split files")
        fn = _ucf_splits if layout == "ucf101" else _hmdb_splits
        warnings += fn(items, Path(splits))
    return items, warnings


def _is_output(folder: Path, exclude) -> bool:
    """The output folder of this run, or a dataset prepared earlier (manifest.csv, records/)."""
    return (exclude is not None and folder.resolve() == Path(exclude).resolve()) or (
        (folder / "records").is_dir() and (folder / "manifest.csv").is_file())


def _files(folder: Path, exclude, outputs: list) -> list[Path]:
    """Files under ``folder``, sorted, without descending into outputs (appended to ``outputs``)."""
    if _is_output(folder, exclude):
        outputs.append(str(folder))
        return []
    found, seen = [], {os.path.realpath(folder)}
    for root, dirs, files in os.walk(folder, followlinks=True):  # datasets are often links
        for d in list(dirs):
            real = os.path.realpath(os.path.join(root, d))
            if _is_output(Path(root) / d, exclude):
                outputs.append(str(Path(root) / d))
                dirs.remove(d)
            elif real in seen:  # a link back to a folder already walked: no loop, no twice
                dirs.remove(d)
            else:
                seen.add(real)
        found += [Path(root) / f for f in files]
    return sorted(found)


def _read_table(path, flag: str, needed: set, hint: str) -> list[dict]:
    """Rows of a CSV file the user points at, with its columns checked; PrepareError naming
    ``flag`` and ``path`` otherwise."""
    path = Path(path)
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "no such file"
        raise PrepareError(f"{flag} {path}: {what}; {hint}")
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            missing = sorted(needed - set(reader.fieldnames or ()))
            if missing:
                raise PrepareError(f"{flag} {path}: no column(s) {missing} in the header "
                                   f"{(reader.fieldnames or [])[:6]}; {hint}")
            return list(reader)
    except (UnicodeDecodeError, csv.Error) as e:
        raise PrepareError(f"{flag} {path}: not a CSV text file ({type(e).__name__}); {hint}") from None


def _scan_esc50(src: Path) -> list[dict]:
    rows = _read_table(src / "meta" / "esc50.csv", "ESC-50 metadata", {"filename", "fold", "category"},
                       "SRC must be the ESC-50 folder (with audio/ and meta/esc50.csv)")
    return [_item(f"audio/{r['filename']}", r["category"], fold=r["fold"],
                  label=int(r["target"]) if (r.get("target") or "").isdigit() else None)
            for r in rows]


def _scan_list(list_file) -> list[dict]:
    if not list_file:
        raise PrepareError("--layout list needs --list FILE (CSV with a header: path,label[,split][,fold])")
    rows = _read_table(list_file, "--list", {"path", "label"},
                       "pass a CSV with a header path,label[,split][,fold][,class_name]")
    numeric = bool(rows) and all((r["label"] or "").strip().lstrip("-").isdigit() for r in rows)
    cap = max(MAX_CLASSES, len(rows))
    for n, r in enumerate(rows, start=1):
        if None in r or None in r.values() or not r["path"].strip() or not r["label"].strip():
            raise PrepareError(f"--list {list_file}, row {n} after the header: needs a path and a "
                               "label (and as many cells as the header; quote a cell with a comma)")
        if numeric and not (int(r["label"]) == UNLABELED or 0 <= int(r["label"]) < cap):
            raise PrepareError(f"--list {list_file}, row {n} after the header: label {r['label']} "
                               f"is not a class index 0..{cap - 1} (or {UNLABELED} = unlabeled)")
    items = []
    for r in rows:
        label = int(r["label"]) if numeric else None
        name = r.get("class_name") or r["label"].strip()
        items.append(_item(r["path"].strip(), name, split1=(r.get("split") or "").strip(),
                           fold=(r.get("fold") or "").strip(), label=label))
    return items


def _ucf_splits(items, d: Path) -> list[str]:
    """trainlist0k.txt lines 'Class/v_x.avi label', testlist0k.txt lines 'Class/v_x.avi'."""
    by_rel = {i["rel"].lower(): i for i in items}
    missing = Counter()
    for k in (1, 2, 3):
        for kind in ("train", "test"):
            f = d / f"{kind}list0{k}.txt"
            if not f.is_file():
                raise PrepareError(f"--splits: {f} is missing (UCF101 split file); pass the "
                                   "ucfTrainTestlist folder")
            for line in f.read_text(errors="replace").splitlines():
                name = line.strip().split(" ")[0]
                if not name:
                    continue
                it = by_rel.get(name.lower())
                if it is None:
                    missing[f.name] += 1
                else:
                    it[f"split{k}"] = kind
    return [f"{f}: {n} entries have no file in SRC" for f, n in sorted(missing.items())]


def _hmdb_splits(items, d: Path) -> list[str]:
    """<class>_test_split<k>.txt lines '<file> <flag>': 1 = train, 2 = test, 0 = unused."""
    by_name = {(i["class_name"], Path(i["rel"]).name): i for i in items}
    missing = Counter()
    for cls in sorted({i["class_name"] for i in items}):
        for k in (1, 2, 3):
            f = d / f"{cls}_test_split{k}.txt"
            if not f.is_file():
                raise PrepareError(f"--splits: {f} is missing (HMDB51 split file); pass the "
                                   "testTrainMulti_7030_splits folder")
            for line in f.read_text(errors="replace").splitlines():
                parts = line.split()
                if len(parts) != 2:
                    continue
                it = by_name.get((cls, parts[0]))
                if it is None:
                    missing[f.name] += 1
                else:
                    it[f"split{k}"] = {"1": "train", "2": "test"}.get(parts[1], "")
    return [f"{f}: {n} entries have no file in SRC" for f, n in sorted(missing.items())]


# ----------------------------------------------------------------------------------------------
# One file
# ----------------------------------------------------------------------------------------------
def _short(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e)[:100]}"


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


# ----------------------------------------------------------------------------------------------
# Resuming: one record per source file
# ----------------------------------------------------------------------------------------------
def _record_path(out: Path, rel: str) -> Path:
    return out / "records" / f"{hashlib.sha1(rel.encode()).hexdigest()[:20]}.json"


def _key(src: Path, item: dict, cfg: PrepareConfig, audio_only: bool) -> dict:
    p = src / item["rel"]
    try:
        st = p.stat()
        stat = [st.st_size, st.st_mtime_ns]
    except OSError:
        stat = None
    return dict(version=RECORD_VERSION, rel=item["rel"], out=item["out"], source=stat,
                cfg=asdict(cfg), audio_only=audio_only)


def _done(out: Path, rec: dict, key: dict, retry_rejects: bool) -> bool:
    if rec.get("key") != key:
        return False
    if "reject" in rec:
        return not retry_rejects
    return all((out / rec["row"][k]).is_file() for k in ("video", "audio", "mel") if rec["row"][k])


def _attempt(src: Path, out: Path, item: dict, cfg: PrepareConfig, audio_only: bool) -> dict:
    """The record of one file: its row, or why it was rejected. A full output disk is no
    fault of the file: it propagates (and stops the run)."""
    try:
        return {"row": process(src, out, item, cfg, audio_only)}
    except Reject as e:
        return {"reject": str(e)}
    except Exception as e:  # never let one file stop the run
        if _disk_full(e, out):
            raise
        log.debug("unexpected error on %s", item["rel"], exc_info=True)
        return {"reject": f"unexpected error ({_short(e)}); please report it with the file"}


def _job(args):
    src, out, item, cfg, audio_only, retry = args
    rec_path = _record_path(out, item["rel"])
    key = _key(src, item, cfg, audio_only)
    if rec_path.is_file():
        try:
            rec = json.loads(rec_path.read_text())
            if _done(out, rec, key, retry):
                return item, rec, True
        except (OSError, ValueError):
            pass  # a damaged record: redo the file
    with _writing(out, f"preparing {item['rel']}"):
        rec = _attempt(src, out, item, cfg, audio_only)
        rec["key"] = key
        atomic_write_text(rec_path, json.dumps(rec))  # last: the file is done
    return item, rec, False


def _disk_full(e: BaseException, out: Path) -> bool:
    """Whether ``e`` is the output disk failing (full, over quota, read-only) rather than the
    data: by errno, or, for libraries that lose it (libsndfile), by the space left on OUT."""
    if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
        return True
    try:
        return shutil.disk_usage(out).free < LOW_SPACE
    except OSError:
        return False


@contextmanager
def _writing(out: Path, what: str):
    """Turn a full or read-only output disk into a PrepareError saying what to do."""
    try:
        yield
    except PrepareError:
        raise
    except Exception as e:
        if not _disk_full(e, out):
            raise
        raise PrepareError(f"{out}: the output disk is full or cannot be written "
                           f"({getattr(e, 'strerror', None) or _short(e)}) while {what}; free space "
                           "or pick another OUT, then run the same command again (finished files "
                           "are kept and skipped)") from None


def _assign_outputs(items: list[dict], src: Path, out: Path) -> None:
    """Output name per item: ``it["out"]`` = its path in SRC, extension included (clips/c/a.mp4
    → clips/c/a.mp4.webm, .flac, .mel.npy), so two sources never share an output (a.mp4 and
    a.avi, y.mp4 and y.mel.mp4) and a name never depends on the other files. Names equal but
    for case (one file on case-insensitive disks) and names too long for a file system end in
    ``~`` + 8 hex digits of the path instead. Items escaping SRC, inside OUT or listed twice get
    ``it["reject"]`` and no name. A symbolic link inside SRC is a source wherever it points."""
    seen: dict[str, str] = {}
    folded = Counter(os.path.normpath(it["rel"]).lower() for it in items)
    for it in items:
        name = os.path.normpath(it["rel"]).replace(os.sep, "/")
        resolved = (src / name).resolve()  # a symbolic link's target may live anywhere ...
        if os.path.isabs(name) or name.split("/")[0] in ("..", "."):  # ... the link not
            it["reject"] = f"path escapes the source folder {src}; list paths must be relative to SRC"
        elif resolved == out or out in resolved.parents:
            it["reject"] = f"inside the output folder {out}: outputs are never sources"
        elif name in seen:
            it["reject"] = f"listed twice (as {seen[name]!r} before); each file is prepared once"
        else:
            seen[name] = it["rel"]
            it["rel"] = name
            it["out"] = _unique_name(name) if folded[name.lower()] > 1 or \
                len(Path(name).name.encode()) > 200 else name


def _unique_name(rel: str) -> str:
    """``rel`` cut to a safe length + ``~`` + 8 hex digits of its SHA-1: distinct and stable."""
    p = Path(rel)
    stem = p.name.encode()[:150].decode(errors="ignore")
    return (p.parent / f"{stem}~{hashlib.sha1(rel.encode()).hexdigest()[:8]}").as_posix()


def _remove_unfinished(out: Path, items: list[dict]) -> None:
    """After a run stopped early: the outputs of files without a record (never finished, so in
    no manifest) and every temporary. Files with a record keep theirs: the manifest of an
    earlier run may list them."""
    for it in items:
        if it.get("out") and not _record_path(out, it["rel"]).is_file():
            for ext in OUTPUTS:
                (out / "clips" / (it["out"] + ext)).unlink(missing_ok=True)
    sweep_temporaries(out, recursive=True)


def _check_space(src: Path, out: Path, items: list[dict]) -> None:
    """Fail before any work when OUT clearly cannot hold the outputs: at least SPACE_FACTOR x
    the size of the sources not prepared yet."""
    size = 0
    for it in items:
        if it.get("out") and not _record_path(out, it["rel"]).is_file():
            try:
                size += (src / it["rel"]).stat().st_size
            except OSError:
                pass  # missing: rejected later
    need, free = int(SPACE_FACTOR * size), shutil.disk_usage(out).free
    if need > free:
        raise PrepareError(f"{out}: about {_gb(need)} needed ({SPACE_FACTOR:g} x the {_gb(size)} "
                           f"of sources still to prepare) but {_gb(free)} free; free space, pick "
                           "another OUT, or pass --no-space-check if you know the outputs fit")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e7 else f"{n / 1e6:.2f} MB"


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------
def prepare(src, out, *, layout="auto", list_file=None, splits=None, cfg=None, workers=None,
            retry_rejects=False, progress=True, audio_only=None, space_check=True) -> dict:
    """Prepare SRC into OUT; returns the summary (also what the CLI prints). A PrepareError
    (a UserError) for a mistake in the arguments or an output disk that is full or cannot be
    written; a run stopped early (that, Ctrl-C) leaves no partial output and the manifest of
    the last complete run, and the same call again finishes the job."""
    src, out = Path(src).resolve(), Path(out).resolve()
    cfg = cfg or PrepareConfig()
    if out == src or any(d in src.parents or d == src for d in (out / "clips", out / "records")):
        raise PrepareError(f"{out}: OUT must not be SRC ({src}) or hold it in its clips/ or "
                           "records/; pick another folder")
    esc = layout == "esc50" or (layout == "auto" and (src / "meta" / "esc50.csv").is_file())
    audio_only = esc if audio_only is None else (audio_only or esc)
    items, warnings = scan(src, layout, list_file, splits, audio_only=audio_only, exclude=out)
    for w in warnings:
        log.warning("%s", w)
    if not items:
        raise PrepareError(f"{src}: no {'audio' if audio_only else 'video'} files found; expected "
                           "SRC/<class name>/<files> (or --layout list/ucf101/hmdb51/esc50)")
    output_folder(out, "OUT")
    with _writing(out, "starting"):
        (out / "records").mkdir(exist_ok=True)
        swept = sum(sweep_temporaries(out / sub, recursive=sub == "clips")
                    for sub in ("clips", "records", "."))
    if swept:
        log.info("removed %d temporary files left by an interrupted run", swept)
    _assign_outputs(items, src, out)
    if space_check:
        _check_space(src, out, items)
    jobs = [(src, out, it, cfg, audio_only, retry_rejects) for it in items if it.get("out")]
    results = [(it, {"reject": it["reject"]}, False) for it in items if not it.get("out")]
    try:
        results += _run(jobs, workers, progress)
    except BaseException:  # a full disk, Ctrl-C: nothing half-made stays
        _remove_unfinished(out, items)
        raise
    with _writing(out, "writing manifest.csv"):
        return _finish(out, items, results, warnings)


def _run(jobs: list, workers, progress: bool) -> list:
    """``_job`` over ``jobs`` in ``workers`` processes (default: all cores), with a progress bar."""
    from tqdm import tqdm

    workers = max(1, min(len(jobs), workers or os.cpu_count() or 1))
    results = []
    with tqdm(total=len(jobs), desc="prepare", unit="file", disable=None if progress else True) as bar:
        if workers > 1:
            import multiprocessing as mp

            # exiting terminates the workers; Ctrl-C is the parent's to handle (no worker traceback)
            with mp.get_context("spawn").Pool(workers, ignore_interrupts) as pool:
                for res in pool.imap_unordered(_job, jobs, chunksize=1):
                    results.append(res)
                    bar.update(1)
        else:
            for j in jobs:
                results.append(_job(j))
                bar.update(1)
    return results


def _finish(out: Path, items, results, warnings) -> dict:
    results.sort(key=lambda r: r[0]["rel"])
    # labels: from the source (ints in a list file, ESC-50 targets) or the sorted class names of
    # every scanned file (stable when some files are rejected)
    if all(it["label"] is not None for it in items):
        label_of = {it["class_name"]: it["label"] for it in items}
    else:
        label_of = {c: i for i, c in enumerate(sorted({it["class_name"] for it in items}))}
    rows, rejects, reasons, noted, skipped = [], [], Counter(), Counter(), 0
    for it, rec, was_done in results:
        skipped += was_done
        if "reject" in rec:
            rejects.append(dict(file=it["rel"], reason=rec["reject"]))
            reasons[re.split(r" \(|;", rec["reject"])[0]] += 1
            continue
        r = rec["row"]
        for n in filter(None, r.get("notes", "").split(" | ")):
            noted[re.split(r" \(|:", n)[0]] += 1
        label = it["label"] if it["label"] is not None else label_of[it["class_name"]]
        rows.append(dict(id=len(rows), label=label, class_name=it["class_name"],
                         split1=it["split1"], split2=it["split2"], split3=it["split3"],
                         fold=it["fold"], source=it["rel"], **r))
    _write_csv(out / "manifest.csv", rows, FIELDS)
    _write_csv(out / "rejects.csv", rejects, ["file", "reason"])
    stray = _stray_outputs(out, rows)
    if stray:
        warnings.append(f"{stray} files in {out / 'clips'} are in no manifest row (outputs of "
                        "removed sources or of an older data_dali); delete that folder and run "
                        "again to drop them")
        log.warning("%s", warnings[-1])
    summary = dict(files=len(items), kept=len(rows), rejected=len(rejects),
                   skipped_done=skipped, processed=len(items) - skipped,
                   classes=len({r["label"] for r in rows}),
                   video_only=sum(1 for r in rows if r["video"] and not r["audio_present"]),
                   rejects_by_reason=dict(sorted(reasons.items())), noted=dict(sorted(noted.items())),
                   warnings=warnings, manifest=str(out / "manifest.csv"),
                   rejects=str(out / "rejects.csv"))
    log.info("kept %d of %d files (%d rejected, see %s)", len(rows), len(items), len(rejects),
             out / "rejects.csv")
    return summary


def _stray_outputs(out: Path, rows: list[dict]) -> int:
    """How many files under OUT/clips no manifest row refers to."""
    listed = {os.path.join(out, r[k]) for r in rows for k in ("video", "audio", "mel") if r[k]}
    return sum(os.path.join(root, f) not in listed
               for root, _, files in os.walk(out / "clips") for f in files)


def _write_csv(path: Path, rows: list[dict], fields: list[str]):
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    data = buf.getvalue().encode()
    if path.is_file() and path.read_bytes() == data:
        return  # unchanged: leave the file (and its mtime) alone
    atomic_write_bytes(path, data)


@command
def main(argv=None):
    p = ArgumentParser(prog="python -m data_dali.prepare", description=__doc__)
    p.add_argument("src", help="source folder")
    p.add_argument("out", help="output folder (clips/, manifest.csv, rejects.csv, records/); "
                   "created if missing; may be inside SRC (it is never read as a source)")
    p.add_argument("--layout", default="auto", choices=LAYOUTS,
                   help="auto: esc50 if SRC/meta/esc50.csv exists, list if --list, else folders")
    p.add_argument("--list", dest="list_file", help="CSV with a header path,label[,split][,fold][,class_name]; "
                   "paths relative to SRC (layout list)")
    p.add_argument("--splits", help="folder of official split files (ucf101: ucfTrainTestlist, "
                   "hmdb51: testTrainMulti_7030_splits)")
    p.add_argument("--audio-only", action="store_true", help="an audio dataset (implied by esc50)")
    p.add_argument("--fps", type=float, default=10.0, help="target frame rate (paper: 10)")
    p.add_argument("--short-side", type=int, default=128, help="resize so the short side is this (even)")
    p.add_argument("--min-seconds", type=float, default=1.6,
                   help="reject videos shorter than this (audio-only: pad shorter sounds with silence to it)")
    p.add_argument("--crf", type=int, default=32, help="VP9 quality, 0-63 (lower = better)")
    p.add_argument("--no-mel", dest="mel", action="store_false",
                   help="do not precompute log-mels (loaders then compute them from the FLAC)")
    p.add_argument("--workers", type=int, default=None, help="parallel processes (default: all cores)")
    p.add_argument("--retry-rejects", action="store_true", help="try previously rejected files again")
    p.add_argument("--no-space-check", dest="space_check", action="store_false",
                   help=f"skip the free-space check (OUT must have {SPACE_FACTOR:g} x the size of "
                   "the sources still to prepare)")
    args = p.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        raise PrepareError(f"--workers must be >= 1, got {args.workers} (leave it out for all cores)")
    setup_logging()
    cfg = PrepareConfig(fps=args.fps, short_side=args.short_side, min_seconds=args.min_seconds,
                        mel=args.mel, crf=args.crf)
    summary = prepare(args.src, args.out, layout=args.layout, list_file=args.list_file,
                      splits=args.splits, cfg=cfg, workers=args.workers,
                      retry_rejects=args.retry_rejects, audio_only=args.audio_only,
                      space_check=args.space_check)
    print(json.dumps(summary, indent=2))
    if not summary["kept"]:
        reasons = "; ".join(f"{n} x {r}" for r, n in summary["rejects_by_reason"].items())
        raise PrepareError(f"{args.src}: kept 0 of {summary['files']} files ({reasons}); see "
                           f"{summary['rejects']}, fix the sources or the flags, and run again")
    return 0


if __name__ == "__main__":
    sys.exit(main())
