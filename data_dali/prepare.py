"""Prepare a dataset for the loaders: source media in, uniform clips and a manifest out.

Probe every file (PyAV), transcode video to VP9 in WebM (DALI decodes VP9 on CPU and GPU;
H.264 only on GPU) at a constant frame rate and short side, resample audio to 16 kHz mono FLAC,
precompute the 80-band log-mel, and write the manifest (the only thing loaders read).

    python -m data_dali.prepare SRC OUT                            # SRC/<class>/<video files>
    python -m data_dali.prepare SRC OUT --layout list --list files.csv   # path,label[,split]
    python -m data_dali.prepare UCF-101 OUT --layout ucf101 --splits ucfTrainTestlist
    python -m data_dali.prepare hmdb51 OUT --layout hmdb51 --splits testTrainMulti_7030_splits
    python -m data_dali.prepare ESC-50-master OUT --layout esc50   # audio/*.wav + meta/esc50.csv
    python -m data_dali.prepare SOUNDS OUT --audio-only            # SRC/<class>/<audio files>

Outputs: OUT/clips/... (prepared media), OUT/manifest.csv, OUT/rejects.csv (file, reason),
OUT/records/ (one small JSON per source file: what was done, for resuming) and a summary of
what was kept, noted and rejected, by reason. Bad inputs never stop the run and are never
dropped silently: each is either handled (and noted in the manifest's ``notes`` column) or
written to rejects.csv. Every output is written atomically (data_dali/fileio.py);
a re-run skips files whose source and settings are unchanged (a no-op when nothing changed;
``--retry-rejects`` tries rejected files again).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import logging
import os
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from .audio import MEL_FPS, SR, log_mel
from .fileio import atomic_path, atomic_write_bytes, atomic_write_text, sweep_temporaries
from .manifest import FIELDS as _MANIFEST_FIELDS

log = logging.getLogger("data_dali.prepare")
VIDEO_EXT = {".mp4", ".avi", ".mkv", ".webm", ".mov", ".m4v", ".mpg", ".mpeg", ".flv", ".ogv",
             ".3gp", ".wmv", ".ts"}
AUDIO_EXT = {".wav", ".flac", ".ogg", ".mp3", ".m4a", ".aac", ".opus"}
FIELDS = _MANIFEST_FIELDS + ["notes"]
SILENT_PEAK = 1e-4  # peak |sample| below this (-80 dBFS): the clip is flagged silent
RECORD_VERSION = 2  # bump when the output format changes: finished files are then redone


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
            raise ValueError(f"--fps must be in (0, 120], got {self.fps}")
        if self.short_side < 16 or self.short_side % 2:
            raise ValueError(f"--short-side must be an even number >= 16, got {self.short_side}")
        if self.min_seconds < 0:
            raise ValueError(f"--min-seconds must be >= 0, got {self.min_seconds}")
        if not 0 <= self.crf <= 63:
            raise ValueError(f"--crf must be in [0, 63] (VP9), got {self.crf}")


class Reject(Exception):
    """A file that cannot be used; the message is the reason written to rejects.csv."""


# ----------------------------------------------------------------------------------------------
# Scanning sources: items {rel, class_name, label?, split1..3, fold[, reject]}
# ----------------------------------------------------------------------------------------------
def _item(rel, class_name, split1="", fold="", label=None):
    return dict(rel=str(rel).replace(os.sep, "/"), class_name=str(class_name), label=label,
                split1=split1, split2="", split3="", fold=str(fold))


def scan(src: Path, layout: str = "auto", list_file=None, splits=None,
         audio_only: bool = False) -> tuple[list[dict], list[str]]:
    """Items to prepare, and warnings about the source (e.g. split entries without a file)."""
    src = Path(src)
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: source folder not found; pass the folder holding the "
                                "class sub-folders (or audio/ and meta/ for ESC-50)")
    if layout == "auto":
        layout = "esc50" if (src / "meta" / "esc50.csv").is_file() else ("list" if list_file else "folders")
    warnings: list[str] = []
    if layout == "list":
        return _scan_list(list_file), warnings
    if layout == "esc50":
        meta = src / "meta" / "esc50.csv"
        if not meta.is_file():
            raise FileNotFoundError(f"{meta}: ESC-50 metadata missing; SRC must be the ESC-50 "
                                    "folder (with audio/ and meta/esc50.csv)")
        with open(meta, newline="") as f:
            return [_item(f"audio/{r['filename']}", r["category"], fold=r["fold"],
                          label=int(r["target"]) if r.get("target", "").isdigit() else None)
                    for r in csv.DictReader(f)], warnings
    if layout not in ("folders", "ucf101", "hmdb51"):
        raise ValueError(f"unknown --layout {layout!r}; use auto, folders, list, ucf101, hmdb51 "
                         "or esc50")
    exts = AUDIO_EXT if audio_only else VIDEO_EXT
    items, skipped = [], Counter()
    for cls in sorted(p for p in src.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for f in sorted(cls.rglob("*")):
            if not f.is_file() or f.name.startswith("."):
                continue
            if f.suffix.lower() in exts:
                items.append(_item(f.relative_to(src), cls.name))
            else:
                skipped[f.suffix.lower() or "(none)"] += 1
    if skipped:
        warnings.append(f"ignored {sum(skipped.values())} files that are not "
                        f"{'audio' if audio_only else 'video'} by extension: {dict(skipped)}")
    if layout in ("ucf101", "hmdb51"):
        if not splits:
            raise ValueError(f"--layout {layout} needs --splits DIR (the official split files: "
                             f"{'ucfTrainTestlist' if layout == 'ucf101' else 'testTrainMulti_7030_splits'})")
        fn = _ucf_splits if layout == "ucf101" else _hmdb_splits
        warnings += fn(items, Path(splits))
    return items, warnings


def _scan_list(list_file) -> list[dict]:
    if not list_file:
        raise ValueError("--layout list needs --list FILE (CSV with a header: path,label[,split][,fold])")
    with open(list_file, newline="") as f:
        reader = csv.DictReader(f)
        if not {"path", "label"} <= set(reader.fieldnames or ()):
            raise ValueError(f"{list_file}: needs a header with 'path' and 'label' columns "
                             "(optional: split, fold, class_name)")
        rows = list(reader)
    numeric = bool(rows) and all(r["label"].strip().lstrip("-").isdigit() for r in rows)
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
                raise FileNotFoundError(f"{f}: UCF101 split file missing; --splits must be the "
                                        "ucfTrainTestlist folder")
            for line in f.read_text().splitlines():
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
                raise FileNotFoundError(f"{f}: HMDB51 split file missing; --splits must be the "
                                        "testTrainMulti_7030_splits folder")
            for line in f.read_text().splitlines():
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
    base = out / "clips" / item["out"]
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
        vpath = base.with_name(base.name + ".webm")
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
            if row["duration"] < cfg.min_seconds:
                raise Reject(f"too short ({row['duration']:.2f} s < --min-seconds {cfg.min_seconds})")
        elif len(wave) == 0 and not any(n.startswith("audio decode failed") for n in notes):
            notes.append("audio stream has no samples, kept video-only")
        if len(wave):
            if has_v and len(wave) < SR * row["duration"] - SR // MEL_FPS:
                wave = np.concatenate([wave, np.zeros(int(SR * row["duration"]) - len(wave), np.float32)])
                notes.append("audio shorter than video (padded with silence)")
            apath = base.with_name(base.name + ".flac")
            wave = _write_flac(apath, wave)  # as stored (16-bit): the mel is of what loaders read
            row.update(audio=str(apath.relative_to(out)), audio_present=1,
                       silent=int(float(np.abs(wave).max()) < SILENT_PEAK))
            if row["silent"]:
                notes.append("silent audio")
            if cfg.mel:
                mpath = base.with_name(base.name + ".mel.npy")
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
    if item.get("reject"):
        rec = {"reject": item["reject"]}
    else:
        try:
            rec = {"row": process(src, out, item, cfg, audio_only)}
        except Reject as e:
            rec = {"reject": str(e)}
        except Exception as e:  # never let one file stop the run
            log.debug("unexpected error on %s", item["rel"], exc_info=True)
            rec = {"reject": f"unexpected error ({_short(e)}); please report it with the file"}
    rec["key"] = key
    atomic_write_text(rec_path, json.dumps(rec))
    return item, rec, False


def _assign_outputs(items: list[dict], src: Path) -> None:
    """Output stem per item (its path without extension); if two sources share a stem (a.mp4,
    a.avi), the later one keeps its extension in the name. Items escaping SRC are rejected."""
    taken = set()
    for it in items:
        rel = Path(it["rel"])
        resolved = (src / rel).resolve()
        if rel.is_absolute() or src not in resolved.parents:
            it["reject"] = f"path escapes the source folder {src}; list paths must be relative to SRC"
            it["out"] = "_rejected/" + hashlib.sha1(it["rel"].encode()).hexdigest()[:20]
            continue
        stem = rel.with_suffix("").as_posix()
        if stem.lower() in taken:
            stem = f"{stem}_{rel.suffix.lstrip('.').lower()}"
        taken.add(stem.lower())
        it["out"] = stem


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------
def prepare(src, out, *, layout="auto", list_file=None, splits=None, cfg=None, workers=None,
            retry_rejects=False, progress=True, audio_only=None) -> dict:
    """Prepare SRC into OUT; returns the summary (also what the CLI prints)."""
    src, out = Path(src).resolve(), Path(out).resolve()
    cfg = cfg or PrepareConfig()
    if out == src or src in out.parents:
        raise ValueError(f"{out}: OUT must be outside SRC ({src}), or its clips would be scanned "
                         "as sources; pick another folder")
    esc = layout == "esc50" or (layout == "auto" and (src / "meta" / "esc50.csv").is_file())
    audio_only = esc if audio_only is None else (audio_only or esc)
    items, warnings = scan(src, layout, list_file, splits, audio_only=audio_only)
    for w in warnings:
        log.warning("%s", w)
    if not items:
        raise ValueError(f"{src}: no {'audio' if audio_only else 'video'} files found; expected "
                         "SRC/<class name>/<files> (or --layout list/ucf101/hmdb51/esc50)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "records").mkdir(exist_ok=True)
    swept = sum(sweep_temporaries(out / sub, recursive=sub == "clips")
                for sub in ("clips", "records", "."))
    if swept:
        log.info("removed %d temporary files left by an interrupted run", swept)
    _assign_outputs(items, src)
    jobs = [(src, out, it, cfg, audio_only, retry_rejects) for it in items]
    workers = max(1, min(len(jobs), workers or os.cpu_count() or 1))
    results = []
    from tqdm import tqdm

    with tqdm(total=len(jobs), desc="prepare", unit="file", disable=None if progress else True) as bar:
        if workers > 1:
            import multiprocessing as mp

            with mp.get_context("spawn").Pool(workers) as pool:
                for res in pool.imap_unordered(_job, jobs, chunksize=1):
                    results.append(res)
                    bar.update(1)
        else:
            for j in jobs:
                results.append(_job(j))
                bar.update(1)
    return _finish(out, items, results, warnings)


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


def _write_csv(path: Path, rows: list[dict], fields: list[str]):
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    data = buf.getvalue().encode()
    if path.is_file() and path.read_bytes() == data:
        return  # unchanged: leave the file (and its mtime) alone
    atomic_write_bytes(path, data)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m data_dali.prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="source folder")
    p.add_argument("out", help="output folder (clips/, manifest.csv, rejects.csv, records/)")
    p.add_argument("--layout", default="auto", choices=("auto", "folders", "list", "ucf101", "hmdb51", "esc50"),
                   help="auto: esc50 if SRC/meta/esc50.csv exists, list if --list, else folders")
    p.add_argument("--list", dest="list_file", help="CSV with a header path,label[,split][,fold][,class_name]; "
                   "paths relative to SRC (layout list)")
    p.add_argument("--splits", help="folder of official split files (ucf101: ucfTrainTestlist, "
                   "hmdb51: testTrainMulti_7030_splits)")
    p.add_argument("--audio-only", action="store_true", help="an audio dataset (implied by esc50)")
    p.add_argument("--fps", type=float, default=10.0, help="target frame rate (paper: 10)")
    p.add_argument("--short-side", type=int, default=128, help="resize so the short side is this (even)")
    p.add_argument("--min-seconds", type=float, default=1.6, help="reject clips shorter than this")
    p.add_argument("--crf", type=int, default=32, help="VP9 quality, 0-63 (lower = better)")
    p.add_argument("--no-mel", dest="mel", action="store_false",
                   help="do not precompute log-mels (loaders then compute them from the FLAC)")
    p.add_argument("--workers", type=int, default=None, help="parallel processes (default: all cores)")
    p.add_argument("--retry-rejects", action="store_true", help="try previously rejected files again")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        cfg = PrepareConfig(fps=args.fps, short_side=args.short_side, min_seconds=args.min_seconds,
                            mel=args.mel, crf=args.crf)
        summary = prepare(args.src, args.out, layout=args.layout, list_file=args.list_file,
                          splits=args.splits, cfg=cfg, workers=args.workers,
                          retry_rejects=args.retry_rejects, audio_only=args.audio_only)
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
