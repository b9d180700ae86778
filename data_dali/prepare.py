"""Prepare a dataset for the loaders: probe every file, transcode video to VP9 (decodable by DALI
on CPU and GPU) at a fixed fps and short side, resample audio to 16 kHz mono FLAC, precompute
the 80-band log-mel, and write the manifest (the only thing loaders read).

    python -m data_dali.prepare SRC OUT                          # SRC/<class>/<video files>
    python -m data_dali.prepare SRC OUT --list files.csv         # CSV: path,label[,split]
    python -m data_dali.prepare UCF-101 OUT --layout ucf101 --splits ucfTrainTestlist
    python -m data_dali.prepare hmdb51 OUT --layout hmdb51 --splits testTrainMulti_7030_splits
    python -m data_dali.prepare ESC-50-master OUT --layout esc50  # audio/*.wav + meta/esc50.csv

Outputs: OUT/clips/... (prepared media), OUT/manifest.csv, OUT/rejects.csv (file, reason), and
a summary of what was kept, flagged and rejected, by reason. Bad inputs never stop the run.
Every output is written to a temporary name and renamed; a re-run skips finished files (a
no-op when nothing changed; --retry-rejects tries rejected files again).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import os
import sys
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from .audio import SR, log_mel

log = logging.getLogger("data_dali.prepare")
VIDEO_EXT = {".mp4", ".avi", ".mkv", ".webm", ".mov", ".m4v", ".mpg", ".mpeg", ".flv", ".ogv"}
AUDIO_EXT = {".wav", ".flac", ".ogg", ".mp3", ".m4a", ".aac", ".opus"}
FIELDS = ["id", "video", "audio", "mel", "label", "class_name", "split1", "split2", "split3",
          "fold", "duration", "frames", "fps", "width", "height", "audio_present", "silent",
          "source"]
SILENT_PEAK = 1e-4


@dataclass
class PrepareConfig:
    fps: float = 10.0
    short_side: int = 128
    min_seconds: float = 1.6  # 16 frames at 10 fps: one pretraining clip
    mel: bool = True
    crf: int = 32

    def __post_init__(self):
        if self.fps <= 0:
            raise ValueError(f"--fps must be > 0, got {self.fps}")
        if self.short_side < 16 or self.short_side % 2:
            raise ValueError(f"--short-side must be an even number >= 16, got {self.short_side}")
        if self.min_seconds < 0:
            raise ValueError(f"--min-seconds must be >= 0, got {self.min_seconds}")


class Reject(Exception):
    """A file that cannot be used; the message is the reason written to rejects.csv."""


# ----------------------------------------------------------------------------------------------
# Scanning sources
# ----------------------------------------------------------------------------------------------
def scan(src: Path, layout: str, list_file=None, splits=None) -> list[dict]:
    """Items {source (path), rel, class_name, split1..3, fold}; labels assigned later."""
    src = Path(src)
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: source folder not found")
    if layout == "auto":
        layout = "esc50" if (src / "meta" / "esc50.csv").is_file() else ("list" if list_file else "folders")
    if layout == "list":
        if not list_file:
            raise ValueError("--layout list needs --list FILE (CSV with columns path,label[,split])")
        items = []
        with open(list_file, newline="") as f:
            for row in csv.DictReader(f):
                if "path" not in row or "label" not in row:
                    raise ValueError(f"{list_file}: needs a header with 'path' and 'label' columns")
                items.append(dict(rel=row["path"], class_name=row["label"],
                                  split1=row.get("split", ""), split2="", split3="", fold=""))
        return items
    if layout == "esc50":
        meta = src / "meta" / "esc50.csv"
        items = []
        with open(meta, newline="") as f:
            for row in csv.DictReader(f):
                items.append(dict(rel=f"audio/{row['filename']}", class_name=row["category"],
                                  split1="", split2="", split3="", fold=row["fold"]))
        return items
    items = []
    for cls in sorted(p for p in src.iterdir() if p.is_dir()):
        for f in sorted(cls.rglob("*")):
            if f.is_file() and f.suffix.lower() in VIDEO_EXT | AUDIO_EXT:
                items.append(dict(rel=str(f.relative_to(src)), class_name=cls.name, split1="",
                                  split2="", split3="", fold=""))
    if layout in ("ucf101", "hmdb51"):
        if not splits:
            raise ValueError(f"--layout {layout} needs --splits DIR (the official split files)")
        (_ucf_splits if layout == "ucf101" else _hmdb_splits)(items, Path(splits))
    elif layout != "folders":
        raise ValueError(f"unknown --layout {layout!r}")
    return items


def _ucf_splits(items, d: Path):
    """trainlist0k.txt lines 'Class/v_x.avi label', testlist0k.txt lines 'Class/v_x.avi'."""
    by_rel = {i["rel"].replace(os.sep, "/"): i for i in items}
    for k in (1, 2, 3):
        for kind in ("train", "test"):
            f = d / f"{kind}list0{k}.txt"
            if not f.is_file():
                raise FileNotFoundError(f"{f}: UCF101 split file missing (ucfTrainTestlist)")
            for line in f.read_text().split("\n"):
                name = line.strip().split(" ")[0]
                if name and name in by_rel:
                    by_rel[name][f"split{k}"] = kind


def _hmdb_splits(items, d: Path):
    """<class>_test_split<k>.txt lines '<file> <flag>': 1 = train, 2 = test, 0 = unused."""
    by_name = {(i["class_name"], Path(i["rel"]).name): i for i in items}
    for cls in {i["class_name"] for i in items}:
        for k in (1, 2, 3):
            f = d / f"{cls}_test_split{k}.txt"
            if not f.is_file():
                raise FileNotFoundError(f"{f}: HMDB51 split file missing (testTrainMulti_7030_splits)")
            for line in f.read_text().split("\n"):
                parts = line.split()
                if len(parts) == 2 and (cls, parts[0]) in by_name:
                    by_name[(cls, parts[0])][f"split{k}"] = {"1": "train", "2": "test"}.get(parts[1], "")


# ----------------------------------------------------------------------------------------------
# One file
# ----------------------------------------------------------------------------------------------
def _atomic_path(path: Path) -> Path:
    return path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")


def _decode_audio(container) -> np.ndarray:
    """All audio as 16 kHz mono float32 (any layout is downmixed by the resampler)."""
    import av

    res = av.AudioResampler(format="flt", layout="mono", rate=SR)
    chunks, first = [], None
    stream = container.streams.audio[0]
    for frame in container.decode(audio=0):
        if first is None and frame.pts is not None:
            first = float(frame.pts * (frame.time_base or stream.time_base))
        for out in res.resample(frame):
            chunks.append(out.to_ndarray().reshape(-1))
    for out in res.resample(None):
        chunks.append(out.to_ndarray().reshape(-1))
    wave = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    # put sample 0 at t = 0 (the video's origin): pad a late start, drop encoder priming
    shift = int(round((first or 0.0) * SR))
    if shift > 0:
        wave = np.concatenate([np.zeros(shift, np.float32), wave])
    elif shift < 0:
        wave = wave[-shift:]
    return wave


def _decode_video_cfr(container, fps: float, short_side: int):
    """Frames resampled to constant ``fps`` by presentation time (handles variable frame rate),
    resized so the short side is ``short_side`` (even dimensions). Returns [T, H, W, 3] uint8."""
    stream = container.streams.video[0]
    tb = stream.time_base or Fraction(1, 1000)
    out, next_t, last = [], 0.0, None
    w = h = None
    for frame in container.decode(video=0):
        if frame.pts is None:
            continue
        t = float(frame.pts * tb)
        if w is None:
            fw, fh = frame.width, frame.height
            scale = short_side / min(fw, fh)
            w, h = max(2, int(round(fw * scale / 2)) * 2), max(2, int(round(fh * scale / 2)) * 2)
        img = None
        while t >= next_t - 1e-6:  # this frame is the newest one at time next_t
            if last is not None and t > next_t + 1e-6:
                out.append(last)  # a gap in a variable-rate stream: repeat the previous frame
            else:
                img = img if img is not None else frame.to_ndarray(width=w, height=h, format="rgb24")
                out.append(img)
            next_t += 1.0 / fps
        last = img if img is not None else (last if last is not None else
                                             frame.to_ndarray(width=w, height=h, format="rgb24"))
    if not out:
        return np.zeros((0, 2, 2, 3), np.uint8)
    return np.stack(out)


def _write_vp9(path: Path, frames: np.ndarray, fps: float, crf: int):
    import av

    tmp = _atomic_path(path)
    with av.open(str(tmp), "w", format="webm") as out:
        s = out.add_stream("libvpx-vp9", rate=Fraction(fps).limit_denominator(1000))
        s.width, s.height = frames.shape[2], frames.shape[1]
        s.pix_fmt = "yuv420p"
        s.options = {"crf": str(crf), "b": "0", "deadline": "realtime", "cpu-used": "8",
                     "row-mt": "1", "g": str(int(round(fps)))}
        for f in frames:
            for pkt in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(pkt)
        for pkt in s.encode():
            out.mux(pkt)
    os.replace(tmp, path)


def _write_flac(path: Path, wave: np.ndarray):
    import soundfile as sf

    tmp = _atomic_path(path)
    sf.write(str(tmp), wave, SR, format="FLAC", subtype="PCM_16")
    os.replace(tmp, path)


def _write_npy(path: Path, arr: np.ndarray):
    tmp = _atomic_path(path)
    with open(tmp, "wb") as f:
        np.save(f, arr)
    os.replace(tmp, path)


def process(src: Path, out: Path, item: dict, cfg: PrepareConfig, audio_only: bool) -> dict:
    """Prepare one file; returns the manifest row (without id/label) or raises Reject."""
    import av

    path = src / item["rel"]
    if not path.is_file():
        raise Reject("missing file")
    if path.stat().st_size == 0:
        raise Reject("zero-size file")
    stem = Path(item["rel"]).with_suffix("")
    base = out / "clips" / stem
    base.parent.mkdir(parents=True, exist_ok=True)
    row = dict(video="", audio="", mel="", duration=0.0, frames=0, fps=cfg.fps, width=0,
               height=0, audio_present=0, silent=0)
    try:
        with av.open(str(path)) as c:
            has_v, has_a = bool(c.streams.video), bool(c.streams.audio)
    except Exception as e:  # PyAV raises many error types for broken files
        raise Reject(f"unreadable or corrupt ({type(e).__name__}: {str(e)[:80]})") from None
    if not audio_only and not has_v:
        raise Reject("no video stream")
    if audio_only and not has_a:
        raise Reject("no audio stream")
    if has_v and not audio_only:
        try:
            with av.open(str(path)) as c:
                frames = _decode_video_cfr(c, cfg.fps, cfg.short_side)
        except Exception as e:
            raise Reject(f"video decode failed ({type(e).__name__}: {str(e)[:80]})") from None
        if len(frames) == 0:
            raise Reject("truncated or corrupt: no decodable video frames")
        seconds = len(frames) / cfg.fps
        if seconds < cfg.min_seconds:
            raise Reject(f"too short ({seconds:.2f} s < {cfg.min_seconds} s)")
        vpath = base.with_suffix(".webm")
        _write_vp9(vpath, frames, cfg.fps, cfg.crf)
        row.update(video=str(vpath.relative_to(out)), frames=len(frames), duration=seconds,
                   width=frames.shape[2], height=frames.shape[1])
    if has_a:
        try:
            with av.open(str(path)) as c:
                wave = _decode_audio(c)
        except Exception as e:
            if audio_only:
                raise Reject(f"audio decode failed ({type(e).__name__}: {str(e)[:80]})") from None
            wave = np.zeros(0, np.float32)
        if len(wave):
            apath = base.with_suffix(".flac")
            _write_flac(apath, np.clip(wave, -1, 1))
            row.update(audio=str(apath.relative_to(out)), audio_present=1,
                       silent=int(float(np.abs(wave).max()) < SILENT_PEAK))
            if audio_only:
                row["duration"] = len(wave) / SR
                if row["duration"] < cfg.min_seconds:
                    raise Reject(f"too short ({row['duration']:.2f} s < {cfg.min_seconds} s)")
            if cfg.mel:
                mpath = base.with_suffix(".mel.npy")
                _write_npy(mpath, log_mel(wave))
                row["mel"] = str(mpath.relative_to(out))
    return row


def _job(args):
    src, out, item, cfg, audio_only, retry = args
    rec = _record_path(out, item["rel"])
    if rec.is_file():
        done = json.loads(rec.read_text())
        if not (retry and "reject" in done):
            return item, done, True
    try:
        result = {"row": process(src, out, item, cfg, audio_only)}
    except Reject as e:
        result = {"reject": str(e)}
    except Exception as e:  # never let one file stop the run
        result = {"reject": f"unexpected error ({type(e).__name__}: {str(e)[:80]})"}
    tmp = _atomic_path(rec)
    tmp.write_text(json.dumps(result))
    os.replace(tmp, rec)
    return item, result, False


def _record_path(out: Path, rel: str) -> Path:
    h = hashlib.sha1(rel.encode()).hexdigest()[:16]
    p = out / "records" / f"{h}.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------
def prepare(src, out, *, layout="auto", list_file=None, splits=None, cfg=None, workers=None,
            retry_rejects=False, progress=True) -> dict:
    src, out = Path(src).resolve(), Path(out).resolve()
    cfg = cfg or PrepareConfig()
    out.mkdir(parents=True, exist_ok=True)
    items = scan(src, layout, list_file, splits)
    audio_only = layout == "esc50" or (layout == "auto" and (src / "meta" / "esc50.csv").is_file())
    for it in items:  # paths in a list file must stay inside the source folder
        p = (src / it["rel"]).resolve()
        if src not in p.parents:
            raise ValueError(f"{it['rel']}: path escapes the source folder {src}; fix the list")
    jobs = [(src, out, it, cfg, audio_only, retry_rejects) for it in items]
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    results = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc="prepare", unit="file", disable=not sys.stderr.isatty())
    if workers > 1 and len(jobs) > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(workers) as pool:
            for res in pool.imap_unordered(_job, jobs, chunksize=1):
                results.append(res)
                if bar:
                    bar.update(1)
    else:
        for j in jobs:
            results.append(_job(j))
            if bar:
                bar.update(1)
    if bar:
        bar.close()
    results.sort(key=lambda r: r[0]["rel"])
    classes = sorted({it["class_name"] for it, res, _ in results if "row" in res})
    label_of = {c: i for i, c in enumerate(classes)}
    rows, rejects, reasons, flags, skipped = [], [], Counter(), Counter(), 0
    for it, res, was_done in results:
        skipped += was_done
        if "reject" in res:
            rejects.append(dict(file=it["rel"], reason=res["reject"]))
            reasons[res["reject"].split(" (")[0]] += 1
            continue
        r = res["row"]
        if not r["audio_present"]:
            flags["no audio (kept for video-only use; pretraining skips it)"] += 1
        if r["silent"]:
            flags["silent audio (kept; flagged)"] += 1
        rows.append(dict(id=len(rows), label=label_of[it["class_name"]], class_name=it["class_name"],
                         split1=it["split1"], split2=it["split2"], split3=it["split3"],
                         fold=it["fold"], source=it["rel"], **r))
    _write_csv(out / "manifest.csv", rows, FIELDS)
    _write_csv(out / "rejects.csv", rejects, ["file", "reason"])
    summary = dict(files=len(items), kept=len(rows), rejected=len(rejects), skipped_done=skipped,
                   classes=len(classes), rejects_by_reason=dict(reasons), flagged=dict(flags),
                   manifest=str(out / "manifest.csv"), rejects=str(out / "rejects.csv"))
    return summary


def _write_csv(path: Path, rows: list[dict], fields: list[str]):
    tmp = _atomic_path(path)
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    if path.is_file() and path.read_bytes() == tmp.read_bytes():
        tmp.unlink()  # unchanged: leave the file (and its mtime) alone
        return
    os.replace(tmp, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="source folder")
    p.add_argument("out", help="output folder (prepared clips, manifest.csv, rejects.csv)")
    p.add_argument("--layout", default="auto", choices=("auto", "folders", "list", "ucf101", "hmdb51", "esc50"))
    p.add_argument("--list", dest="list_file", help="CSV with columns path,label[,split] (layout list)")
    p.add_argument("--splits", help="folder of official split files (ucf101, hmdb51)")
    p.add_argument("--fps", type=float, default=10.0, help="target frame rate (paper: 10)")
    p.add_argument("--short-side", type=int, default=128, help="resize so the short side is this (even)")
    p.add_argument("--min-seconds", type=float, default=1.6, help="reject clips shorter than this")
    p.add_argument("--no-mel", dest="mel", action="store_false", help="do not precompute log-mels")
    p.add_argument("--workers", type=int, default=None, help="parallel processes (default: all cores)")
    p.add_argument("--retry-rejects", action="store_true", help="try previously rejected files again")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        cfg = PrepareConfig(fps=args.fps, short_side=args.short_side, min_seconds=args.min_seconds,
                            mel=args.mel)
        summary = prepare(args.src, args.out, layout=args.layout, list_file=args.list_file,
                          splits=args.splits, cfg=cfg, workers=args.workers,
                          retry_rejects=args.retry_rejects)
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
