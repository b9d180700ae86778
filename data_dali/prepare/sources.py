"""Scanning a source folder into items {rel, class_name, label?, split1..3, fold[, reject]}:
the layouts (class folders, a list file, UCF101, HMDB51, ESC-50, Kinetics) and their official
splits.
"""

from __future__ import annotations

import csv
import os
import re
from collections import Counter
from pathlib import Path

from ..manifest import MAX_CLASSES, SPLIT_NAMES, UNLABELED
from .config import AUDIO_EXT, PrepareError, VIDEO_EXT


def _item(rel, class_name, split1="", fold="", label=None):
    return dict(rel=str(rel).replace(os.sep, "/"), class_name=str(class_name), label=label,
                split1=split1, split2="", split3="", fold=str(fold))


LAYOUTS = ("auto", "folders", "list", "ucf101", "hmdb51", "esc50", "kinetics")
SPLIT_DIRS = {"ucf101": "ucfTrainTestlist", "hmdb51": "testTrainMulti_7030_splits",
              "kinetics": "annotation CSVs (train.csv, validate.csv, test.csv) or 'path label' "
                          "lists (mmaction's kinetics400_train_list_videos.txt)"}
SPLITS_AS_CLASSES = "--split-folders-are-classes"  # the flag that prepares them anyway


def scan(src: Path, layout: str = "auto", list_file=None, splits=None,
         audio_only: bool = False, exclude=None,
         split_folders_are_classes: bool = False) -> tuple[list[dict], list[str]]:
    """Items to prepare, and warnings about the source (e.g. split entries without a file).
    ``exclude``: the output folder, never read as a source (nor any other prepared dataset).
    Class folders named like splits (train/, val/, test/: SPLIT_NAMES) are refused unless
    ``split_folders_are_classes``: a probe would learn the split."""
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
    named = sorted(p.name + "/" for p in src.iterdir()
                   if p.is_dir() and p.name.lower() in SPLIT_NAMES and not _is_output(p, exclude))
    if named and layout == "folders":
        said = (f"class folders {', '.join(named)} look like splits, not classes: a probe would "
                "learn the split")
        if not split_folders_are_classes:
            raise PrepareError(f"{src}: {said}; prepare with --layout list --list FILE (one "
                               "'path label split' line per clip, paths relative to SRC) or, for "
                               "Kinetics, --layout kinetics --splits ANNOTATIONS; if they are "
                               f"classes, pass {SPLITS_AS_CLASSES}")
        warnings.append(f"{said} (prepared as classes: {SPLITS_AS_CLASSES})")
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


LIST_FORMATS = ("a CSV with a header path,label[,split][,fold][,class_name], or 'path label' lines "
                "separated by spaces (a header line 'path label [split] [fold] [class_name]' "
                "optional; UCF101's and mmaction's lists)")


def _first_line(path: Path) -> str:
    """The first line of a text file with something on it ("" for none); PrepareError-free:
    undecodable bytes are for _read_table / _read_spaced to name."""
    try:
        with open(path, encoding="utf-8-sig", errors="replace") as f:
            return next((ln.strip() for ln in f if ln.strip()), "")
    except OSError:
        return ""


def _read_list(path, flag: str, hint: str) -> list[dict]:
    """The rows {path, label[, split, fold, class_name]} of a list of clips, in either format
    of LIST_FORMATS: a first line with a comma is a CSV (its header names the columns), any
    other is a list of space-separated 'path label' lines."""
    path = Path(path)
    if path.is_file() and "," not in _first_line(path):
        return _read_spaced(path, flag, hint)
    return _read_table(path, flag, {"path", "label"}, hint)


def _read_spaced(path: Path, flag: str, hint: str) -> list[dict]:
    """'path label' lines (words separated by spaces or tabs); a first line naming the columns
    (path, label and any of split, fold, class_name) is a header, and its columns are read
    instead. A line of other than that many words is refused (a rawframes list's 'path frames
    label', a path with a space: the CSV form quotes it)."""
    try:
        lines = [(n, ln.strip()) for n, ln in enumerate(
            path.read_text(encoding="utf-8-sig").splitlines(), start=1) if ln.strip()]
    except UnicodeDecodeError:
        raise PrepareError(f"{flag} {path}: not a text file; {hint}") from None
    cols = ["path", "label"]
    if lines:
        words = lines[0][1].lower().split()
        if {"path", "label"} <= set(words) and set(words) <= {"path", "label", "split", "fold",
                                                               "class_name"}:
            cols = words
            lines = lines[1:]
    rows = []
    for n, ln in lines:
        cells = ln.split()
        if len(cells) != len(cols):
            raise PrepareError(f"{flag} {path}, line {n}: {ln[:60]!r} is not "
                               f"'{' '.join(cols)}' ({len(cols)} words; a path with spaces "
                               f"needs the CSV form, quoted); {hint}")
        rows.append(dict(zip(cols, cells)))
    return rows


def _scan_esc50(src: Path) -> list[dict]:
    rows = _read_table(src / "meta" / "esc50.csv", "ESC-50 metadata", {"filename", "fold", "category"},
                       "SRC must be the ESC-50 folder (with audio/ and meta/esc50.csv)")
    return [_item(f"audio/{r['filename']}", r["category"], fold=r["fold"],
                  label=int(r["target"]) if (r.get("target") or "").isdigit() else None)
            for r in rows]


def _scan_list(list_file) -> list[dict]:
    if not list_file:
        raise PrepareError(f"--layout list needs --list FILE ({LIST_FORMATS})")
    rows = _read_list(list_file, "--list", f"pass {LIST_FORMATS}")
    numeric = bool(rows) and all((r["label"] or "").strip().lstrip("-").isdigit() for r in rows)
    cap = max(MAX_CLASSES, len(rows))
    for n, r in enumerate(rows, start=1):
        if None in r or None in r.values() or not r["path"].strip() or not r["label"].strip():
            raise PrepareError(f"--list {list_file}, row {n} after any header: needs a path and a "
                               "label (and as many cells as the header; quote a cell with a comma)")
        if numeric and not (int(r["label"]) == UNLABELED or 0 <= int(r["label"]) < cap):
            raise PrepareError(f"--list {list_file}, row {n} after any header: label {r['label']} "
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


KINETICS_HINT = ("pass Kinetics annotation CSVs (label,youtube_id,time_start,time_end,split) or "
                 "'path label' lists (one clip per line, space-separated, a header line optional: "
                 "mmaction's kinetics400_train_list_videos.txt), a folder of them or one file")


def _scan_kinetics(src: Path, annotations: Path, exclude) -> tuple[list[dict], list[str]]:
    """Kinetics as it comes: the annotation CSVs (label,youtube_id,time_start,time_end,split;
    a test file may lack the label) name each clip ``{youtube_id}_{start:06d}_{end:06d}.mp4``,
    found anywhere under SRC (class folders or flat). split1 = train / test (the official
    validation set, where Kinetics results are reported), split2 = train / the official test
    set. Or 'path label' lists (``_scan_kinetics_list``). A listed clip without a file is a
    reject ("missing file"); files in no list, a warning."""
    if annotations.is_dir():  # the CSVs; a folder without any: its .txt lists
        files = sorted(annotations.glob("*.csv")) or sorted(annotations.glob("*.txt"))
    else:
        files = [annotations]
    if not files:
        raise PrepareError(f"--splits {annotations}: no .csv or .txt files; {KINETICS_HINT}")
    found = {f.stem: f.relative_to(src) for f in _files(src, exclude, []) if
             f.suffix.lower() in VIDEO_EXT and not f.name.startswith(".")}
    items, listed, warnings, lists = [], set(), [], []
    for f in files:
        if f.is_file() and "," not in _first_line(f):
            lists.append(f)
            continue
        rows = _read_table(f, "--splits", {"youtube_id", "time_start", "time_end"}, KINETICS_HINT)
        for n, r in enumerate(rows, start=1):
            try:
                name = f"{r['youtube_id']}_{int(float(r['time_start'])):06d}_{int(float(r['time_end'])):06d}"
            except (TypeError, ValueError):
                raise PrepareError(f"--splits {f}, row {n} after the header: time_start / "
                                   f"time_end are not numbers; {KINETICS_HINT}") from None
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
    if lists:
        more, stems, said = _scan_kinetics_list(src, lists, found)
        items += more
        listed |= stems
        warnings += said
    unlisted = sorted(set(found) - listed)
    if unlisted:
        warnings.append(f"left out {len(unlisted)} video files of SRC that no annotation file "
                        f"lists (e.g. {found[unlisted[0]]})")
    return items, warnings


def _split_in_name(stem: str) -> str | None:
    """The Kinetics split a list file's name says (kinetics400_val_list_videos → "validate")."""
    words = set(re.split(r"[^a-z]+", stem.lower()))
    for split, names in (("train", {"train", "training"}),
                         ("validate", {"val", "valid", "validate", "validation"}),
                         ("test", {"test", "testing"})):
        if words & names:
            return split
    return None


def _scan_kinetics_list(src: Path, files: list[Path], found: dict) -> tuple[list, set, list]:
    """Kinetics from 'path label' lists (mmaction's kinetics400_{train,val}_list_videos.txt:
    ``abseiling/0347ZoDXyP0_000095_000105.mp4 0``): the split is the file name's (train, val,
    test: as the CSVs' split column), the clip is SRC/path, or else the file of that name
    anywhere under SRC (lists are relative to a split's own folder). Integer labels are kept
    (mmaction's class indices; the class name is the path's folder); names are sorted into
    0..C-1 as the CSVs' are. Returns (items, the stems listed, warnings)."""
    listed = [(f, r) for f in files for r in _read_spaced(f, "--splits", KINETICS_HINT)]
    numeric = all(r["label"].lstrip("-").isdigit() for _, r in listed)
    names = {int(r["label"]): Path(r["path"]).parent.name for _, r in listed
             if numeric and Path(r["path"]).parent.name}
    items, stems, warnings = [], set(), []
    for f in files:
        split = _split_in_name(f.stem)
        if split is None:
            warnings.append(f"--splits {f.name}: its name says no split (train, val or test): "
                            "its clips are in no evaluation split; name the file after its split")
    for f, r in listed:
        rel, stem = r["path"].replace("\\", "/"), Path(r["path"]).stem
        label = int(r["label"]) if numeric else None
        name = ("" if label == UNLABELED else names.get(label) or str(label)) if numeric \
            else r["label"]
        s1, s2 = KINETICS_SPLITS.get(_split_in_name(f.stem) or "", ("", ""))
        where = rel if (src / rel).is_file() else found.get(stem)
        it = _item(where or rel, name, split1=s1, label=label)
        it["split2"] = s2
        if where is None:
            it["reject"] = f"missing file (listed in {f.name}, class {name or '-'})"
        stems.add(Path(str(where or rel)).stem)
        items.append(it)
    return items, stems, warnings


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
