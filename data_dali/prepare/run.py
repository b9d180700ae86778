"""The run: scan, assign outputs, check space, prepare every file (in worker processes, with a
progress bar), write manifest.csv and rejects.csv and the summary; the command line.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import re
import sys
from collections import Counter
from pathlib import Path

from ..cli import (ArgumentParser, ProgressLog, command, ignore_interrupts, output_folder,
                   progress_bar, prog_name, setup_logging)
from ..fileio import atomic_write_bytes, sweep_temporaries
from ..manifest import FIELDS as _MANIFEST_FIELDS
from ..manifest import UNLABELED, clip_properties, note_kind
from .config import AUDIO_EXT, VIDEO_EXT, PrepareConfig, PrepareError
from .outputs import (_assign_outputs, _check_space, _record_path, _remove_unfinished, _writing,
                      SPACE_FACTOR)
from .records import _job
from .sources import LAYOUTS, scan

log = logging.getLogger("data_dali.prepare")

FIELDS = _MANIFEST_FIELDS + ["notes"]
SRC_RECORD = "src.json"  # OUT/src.json: {"src": the absolute SRC that OUT was prepared from}


def prepare(src, out, *, layout="auto", list_file=None, splits=None, cfg=None, workers=None,
            retry_rejects=False, progress=True, audio_only=None, space_check=True,
            new_src=False, split_folders_are_classes=False) -> dict:
    """Prepare SRC into OUT; returns the summary (also what the CLI prints). A PrepareError
    (a UserError) for a mistake in the arguments, an OUT prepared from another SRC (unless
    ``new_src``) or an output disk that is full or cannot be written; a run stopped early
    (that, Ctrl-C) leaves no partial output and the manifest of the last complete run, and the
    same call again finishes the job. Class folders named like splits (train/, val/, test/)
    are a PrepareError unless ``split_folders_are_classes``."""
    src, out = Path(src).resolve(), Path(out).resolve()
    cfg = cfg or PrepareConfig()
    if out == src or any(d in src.parents or d == src for d in (out / "clips", out / "records")):
        raise PrepareError(f"{out}: OUT must not be SRC ({src}) or hold it in its clips/ or "
                           "records/; pick another folder")
    esc = layout == "esc50" or (layout == "auto" and (src / "meta" / "esc50.csv").is_file())
    audio_only = esc if audio_only is None else (audio_only or esc)
    items, warnings = scan(src, layout, list_file, splits, audio_only=audio_only, exclude=out,
                           split_folders_are_classes=split_folders_are_classes)
    for w in warnings:
        log.warning("%s", w)
    if not items:
        kind = "audio" if audio_only else "video"
        exts = ", ".join(sorted(AUDIO_EXT if audio_only else VIDEO_EXT))
        raise PrepareError(f"{src}: no {kind} files found ({exts}); expected SRC/<class "
                           f"name>/<files> (labelled), {kind} files at the top of SRC (unlabeled), "
                           "or --layout list/ucf101/hmdb51/kinetics/esc50"
                           + ("" if audio_only else "; for sounds, add --audio-only"))
    if not new_src:
        _check_same_src(src, out)
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
    with _writing(out, f"writing {SRC_RECORD}"):
        _record_src(src, out)
    jobs = [(src, out, it, cfg, audio_only, retry_rejects) for it in items if it.get("out")]
    results = [(it, {"reject": it["reject"]}, False) for it in items if not it.get("out")]
    try:
        results += _run(jobs, workers, progress)
    except BaseException:  # a full disk, Ctrl-C: nothing half-made stays
        _remove_unfinished(out, items)
        raise
    with _writing(out, "writing manifest.csv"):
        return _finish(out, items, results, warnings)


def _check_same_src(src: Path, out: Path) -> None:
    """OUT goes on only with the SRC it was prepared from: a run from another source would
    replace its manifest with that source's files (the earlier dataset's clips then in no
    manifest). OUT/src.json names the SRC; for a folder prepared before it was written, a clip
    of its manifest whose source is unchanged in SRC (the path, size and time its record holds)
    tells that SRC is the same."""
    hint = ("; prepare SRC into another OUT (nothing in OUT is changed), or pass --new-src if "
            "SRC is that data moved or should replace it")
    try:
        theirs = Path(json.loads((out / SRC_RECORD).read_text())["src"])
    except (OSError, ValueError, KeyError, TypeError):
        theirs = None  # none (a new OUT, an older data_dali) or damaged: look at the manifest
    if theirs is not None:
        if theirs != src and not _same_folder(theirs, src):
            raise PrepareError(f"OUT {out} holds the dataset prepared from {theirs}, not from "
                               f"SRC {src}" + hint)
        return
    try:
        with open(out / "manifest.csv", newline="", encoding="utf-8-sig") as f:
            listed = [r.get("source") for r in csv.DictReader(f)]
    except (OSError, UnicodeDecodeError, csv.Error):
        return  # no manifest: no earlier dataset to lose
    listed = [rel for rel in listed if rel]
    if not listed or any(_unchanged(src, out, rel) for rel in listed):
        return
    raise PrepareError(f"OUT {out} holds a dataset prepared from another source: none of the "
                       f"{len(listed)} clips its manifest.csv lists (e.g. {listed[0]}) is "
                       f"unchanged in SRC {src}" + hint)


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)  # the same folder by another path (a bind mount)
    except OSError:
        return False


def _unchanged(src: Path, out: Path, rel: str) -> bool:
    """Whether SRC/rel is the file OUT's record of ``rel`` was made from (size and time)."""
    try:
        key = json.loads(_record_path(out, rel).read_text())["key"]
        st = (src / rel).stat()
        return key["rel"] == rel and key["source"] == [st.st_size, st.st_mtime_ns]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _record_src(src: Path, out: Path) -> None:
    """OUT/src.json: the SRC that OUT follows (rewritten only when it changes: --new-src)."""
    data = (json.dumps({"src": str(src)}) + "\n").encode()
    path = out / SRC_RECORD
    if not (path.is_file() and path.read_bytes() == data):
        atomic_write_bytes(path, data)


def _run(jobs: list, workers, progress: bool) -> list:
    """``_job`` over ``jobs`` in ``workers`` processes (default: all cores), with a progress bar."""
    workers = max(1, min(len(jobs), workers or os.cpu_count() or 1))
    results = []
    # a log that is not a terminal gets progress lines with the total and an ETA instead
    lines = ProgressLog(log, "prepare:", len(jobs), " files",
                        enabled=progress and not sys.stderr.isatty())
    with progress_bar(total=len(jobs), enabled=progress, desc="prepare", unit="file") as bar:
        if workers > 1:
            import multiprocessing as mp

            # exiting terminates the workers; Ctrl-C is the parent's to handle (no worker traceback)
            with mp.get_context("spawn").Pool(workers, ignore_interrupts) as pool:
                for res in pool.imap_unordered(_job, jobs, chunksize=1):
                    results.append(res)
                    bar.update(1)
                    lines.update(len(results))
        else:
            for j in jobs:
                results.append(_job(j))
                bar.update(1)
                lines.update(len(results))
    return results


def _finish(out: Path, items, results, warnings) -> dict:
    results.sort(key=lambda r: r[0]["rel"])
    # labels: from the source (ints in a list file, ESC-50 targets) or the sorted class names of
    # every scanned file (stable when some files are rejected)
    if all(it["label"] is not None for it in items):
        label_of = {it["class_name"]: it["label"] for it in items}
    else:
        label_of = {c: i for i, c in enumerate(sorted({it["class_name"] for it in items
                                                       if it["label"] is None}))}
    rows, rejects, reasons, noted, skipped = [], [], Counter(), Counter(), 0
    for it, rec, was_done in results:
        skipped += was_done
        if "reject" in rec:
            rejects.append(dict(file=it["rel"], reason=rec["reject"]))
            reasons[re.split(r" \(|;", rec["reject"])[0]] += 1
            continue
        r = rec["row"]
        for n in filter(None, r.get("notes", "").split(" | ")):
            noted[note_kind(n)] += 1
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
    by_class = confounded_notes(rows)
    for c, kinds in by_class.items():
        for kind, n in kinds.items():
            warnings.append(
                f"class {c!r}: {n['noted']} of {n['clips']} clips ({_pct(n['noted'], n['clips'])}) "
                f"are noted {kind!r}, against {n['others_noted']} of {n['others']} "
                f"({_pct(n['others_noted'], n['others'])}) in the other classes: a probe could "
                "tell the class by that alone (cmacc-eval prints what that note alone scores "
                "beside each probe); check its sources")
            log.warning("%s", warnings[-1])
    summary = dict(files=len(items), kept=len(rows), rejected=len(rejects),
                   skipped_done=skipped, processed=len(items) - skipped,
                   classes=len({r["label"] for r in rows} - {UNLABELED}),
                   unlabeled=sum(1 for r in rows if r["label"] == UNLABELED),
                   video_only=sum(1 for r in rows if r["video"] and not r["audio_present"]),
                   rejects_by_reason=dict(sorted(reasons.items())), noted=dict(sorted(noted.items())),
                   noted_by_class=by_class,
                   warnings=warnings, manifest=str(out / "manifest.csv"),
                   rejects=str(out / "rejects.csv"))
    log.info("kept %d of %d files (%d rejected, see %s)", len(rows), len(items), len(rejects),
             out / "rejects.csv")
    return summary


CONFOUND_MARGIN = 0.5  # a note's share in one class against the other classes' share
CONFOUND_MIN_CLIPS = 5  # clips the class, and the other classes together, need to be compared


def confounded_notes(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """{class name: {note kind: {noted, clips, others_noted, others}}} for the kinds of what
    prepare recorded of a clip (``data_dali.manifest.clip_properties``: its notes, silent audio,
    no audio stream) whose share among the class's labelled clips differs from their share
    among the other classes' by CONFOUND_MARGIN or more, the class and the others having
    CONFOUND_MIN_CLIPS or more: a probe would score from the note (31 of 36 'typing' clips
    silent, none of the others). A kind spread evenly (padded sounds in every class) is not
    flagged, however common. Where one class has more of a kind than the rest, that class is
    named; a class with less (every class padded but one) only where none has more (with two
    classes, one names the association)."""
    labelled = [(r["class_name"] or str(r["label"]), clip_properties(r)) for r in rows
                if int(r["label"]) != UNLABELED]
    size, noted = Counter(), Counter()
    for c, kinds in labelled:
        size[c] += 1
        for k in kinds:
            noted[c, k] += 1
    total, kind_total = len(labelled), Counter(k for _, kinds in labelled for k in kinds)
    more, less = {}, {}
    for c, k in ((c, k) for c in sorted(size) for k in sorted(kind_total)):
        n, others = size[c], total - size[c]
        if n < CONFOUND_MIN_CLIPS or others < CONFOUND_MIN_CLIPS:
            continue
        mine, theirs = noted[c, k], kind_total[k] - noted[c, k]
        diff = mine / n - theirs / others
        if abs(diff) >= CONFOUND_MARGIN:
            (more if diff > 0 else less).setdefault(k, {})[c] = dict(
                noted=mine, clips=n, others_noted=theirs, others=others)
    out: dict[str, dict[str, dict]] = {}
    for k in sorted(set(more) | set(less)):
        for c, counts in (more.get(k) or less[k]).items():
            out.setdefault(c, {})[k] = counts
    return dict(sorted(out.items()))


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


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
    p = ArgumentParser(prog=prog_name("data_dali.prepare", "cmacc-prepare"),
                       description=sys.modules[__package__].__doc__)
    p.add_argument("src", help="source folder")
    p.add_argument("out", help="output folder (clips/, manifest.csv, rejects.csv, records/); "
                   "created if missing; may be inside SRC (it is never read as a source)")
    p.add_argument("--layout", default="auto", choices=LAYOUTS,
                   help="auto: esc50 if SRC/meta/esc50.csv exists, list if --list, else folders")
    p.add_argument("--list", dest="list_file", help="the clips (layout list): a CSV with a header "
                   "path,label[,split][,fold][,class_name], or 'path label' lines separated by "
                   "spaces (a header line optional); paths relative to SRC")
    p.add_argument("--splits", help="official split files (ucf101: the ucfTrainTestlist folder, "
                   "hmdb51: testTrainMulti_7030_splits, kinetics: the annotation CSVs or "
                   "space-separated 'path label' lists such as mmaction's "
                   "kinetics400_train_list_videos.txt, a folder of them or one file)")
    p.add_argument("--split-folders-are-classes", action="store_true",
                   help="prepare class folders named train/, val/, test/ (...) as classes; "
                   "without it they are refused (they look like splits: a probe would learn "
                   "the split; use --layout list or kinetics for splits)")
    p.add_argument("--audio-only", action="store_true", help="an audio dataset (implied by esc50)")
    p.add_argument("--fps", type=float, default=10.0, help="target frame rate (default: 10, the paper's)")
    p.add_argument("--short-side", type=int, default=128, help="resize so the short side is this (even; default: 128)")
    p.add_argument("--min-seconds", type=float, default=1.6,
                   help="reject videos shorter than this (audio-only: pad shorter sounds with silence to "
                        "it; default: 1.6)")
    p.add_argument("--crf", type=int, default=32, help="VP9 quality, 0-63 (lower = better; default: 32)")
    p.add_argument("--no-mel", dest="mel", action="store_false",
                   help="do not precompute log-mels (loaders then compute them from the FLAC)")
    p.add_argument("--workers", type=int, default=None, help="parallel processes (default: all cores)")
    p.add_argument("--retry-rejects", action="store_true", help="try previously rejected files again")
    p.add_argument("--new-src", action="store_true",
                   help="OUT was prepared from another SRC and follows this one from now on (the "
                   "data moved, or replacing that dataset is intended): files unchanged at the "
                   "same path, size and time are kept, the manifest lists SRC's files only; "
                   "without it such an OUT is refused")
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
                      space_check=args.space_check, new_src=args.new_src,
                      split_folders_are_classes=args.split_folders_are_classes)
    print(json.dumps(summary, indent=2))
    if not summary["kept"]:
        reasons = "; ".join(f"{n} x {r}" for r, n in summary["rejects_by_reason"].items())
        raise PrepareError(f"{args.src}: kept 0 of {summary['files']} files ({reasons}); see "
                           f"{summary['rejects']}, fix the sources or the flags, and run again")
    return 0
