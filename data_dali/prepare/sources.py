"""Scanning a source folder into items {rel, class_name, label?, split1..3, fold[, reject]}:
the layouts (class folders, a list file, UCF101, HMDB51, ESC-50, Kinetics) and their official
splits.
"""

from __future__ import annotations

import csv
import os
from collections import Counter
from pathlib import Path

from ..manifest import MAX_CLASSES, UNLABELED
from .config import AUDIO_EXT, PrepareError, VIDEO_EXT


def _item(rel, class_name, split1="", fold="", label=None):
    return dict(rel=str(rel).replace(os.sep, "/"), class_name=str(class_name), label=label,
                split1=split1, split2="", split3="", fold=str(fold))


LAYOUTS = ("auto", "folders", "list", "ucf101", "hmdb51", "esc50", "kinetics")
SPLIT_DIRS = {"ucf101": "ucfTrainTestlist", "hmdb51": "testTrainMulti_7030_splits",
              "kinetics": "annotation CSVs (train.csv, validate.csv, test.csv)"}
# folder names that are splits, not classes (Kinetics' own download layout: train/, val/, test/)
SPLIT_NAMES = {"train", "training", "val", "valid", "validate", "validation", "test", "testing"}


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
        raise PrepareError(f"--splits {splits} is only read with --layout ucf101, hmdb51 or kinetics (not "
                           f"{layout}); drop it or pass the layout")
    warnings: list[str] = []
    if layout == "list":
        return _scan_list(list_file), warnings
    if layout == "esc50":
        return _scan_esc50(src), warnings
    if layout == "kinetics":
        if not splits:
            raise PrepareError(f"--layout kinetics needs --splits (the {SPLIT_DIRS['kinetics']}, "
                               "a folder of them or one file)")
        return _scan_kinetics(src, Path(splits), exclude)
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
    named = sorted(p.name + "/" for p in src.iterdir() if p.is_dir() and p.name.lower() in SPLIT_NAMES)
    if named and layout == "folders":
        warnings.append(f"class folders {', '.join(named)} look like splits, not classes: a probe "
                        "would learn the split; prepare with --layout list --list FILE (path,"
                        "label,split) or, for Kinetics, --layout kinetics --splits with its "
                        "annotation CSVs")
    top = [f for f in sorted(src.iterdir()) if f.is_file() and not f.name.startswith(".")
           and f.suffix.lower() in exts]
    if top and layout == "folders":
        if items:  # labelled class folders beside them: a file at the top has no class
            warnings.append(f"left out {len(top)} files at the top of SRC, outside the class "
                            f"folders (e.g. {top[0].name}): move them into SRC/<class name>/, or "
                            "list them with --layout list and label -1 (unlabeled)")
        else:  # a flat folder: unlabelled clips (pretraining uses them; probes leave them out)
            items = [_item(f.name, "", label=UNLABELED) for f in top]
            warnings.append(f"no class folders in SRC: its {len(top)} files are unlabeled clips "
                            "(label -1: pretraining uses them, probes need labels: put them in "
                            "SRC/<class name>/ for those)")
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


KINETICS_SPLITS = {"train": ("train", "train"), "validate": ("test", ""), "val": ("test", ""),
                   "test": ("", "test")}  # official split -> (split1, split2)


def _scan_kinetics(src: Path, annotations: Path, exclude) -> tuple[list[dict], list[str]]:
    """Kinetics as it comes: the annotation CSVs (label,youtube_id,time_start,time_end,split;
    a test file may lack the label) name each clip ``{youtube_id}_{start:06d}_{end:06d}.mp4``,
    found anywhere under SRC (class folders or flat). split1 = train / test (the official
    validation set, where Kinetics results are reported), split2 = train / the official test
    set. A listed clip without a file is a reject ("missing file"); files in no list, a warning."""
    files = sorted(annotations.glob("*.csv")) if annotations.is_dir() else [annotations]
    if not files:
        raise PrepareError(f"--splits {annotations}: no .csv files; pass the folder of the "
                           f"Kinetics {SPLIT_DIRS['kinetics']} or one of them")
    found = {f.stem: f.relative_to(src) for f in _files(src, exclude, []) if
             f.suffix.lower() in VIDEO_EXT and not f.name.startswith(".")}
    items, listed = [], set()
    for f in files:
        hint = "pass Kinetics annotation CSVs (label,youtube_id,time_start,time_end,split)"
        rows = _read_table(f, "--splits", {"youtube_id", "time_start", "time_end"}, hint)
        for n, r in enumerate(rows, start=1):
            try:
                name = f"{r['youtube_id']}_{int(float(r['time_start'])):06d}_{int(float(r['time_end'])):06d}"
            except (TypeError, ValueError):
                raise PrepareError(f"--splits {f}, row {n} after the header: time_start / "
                                   f"time_end are not numbers; {hint}") from None
            split = (r.get("split") or f.stem).strip().lower()
            s1, s2 = KINETICS_SPLITS.get(split, ("", ""))
            label = (r.get("label") or "").strip()
            it = _item(found.get(name, f"{name}.mp4"), label, split1=s1,
                       label=None if label else UNLABELED)
            it["split2"] = s2
            if name not in found:
                it["reject"] = f"missing file (listed in {f.name}, class {label or '-'})"
            listed.add(name)
            items.append(it)
    unlisted = sorted(set(found) - listed)
    warnings = [f"left out {len(unlisted)} video files of SRC that no annotation file lists "
                f"(e.g. {found[unlisted[0]]})"] if unlisted else []
    return items, warnings


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
