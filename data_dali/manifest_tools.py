"""Shape prepared datasets without re-running prepare: ``python -m data_dali.manifest_tools``
(installed as the command ``cmacc-manifest``).

    python -m data_dali.manifest_tools stats data/ucf101/manifest.csv [--json]
    python -m data_dali.manifest_tools subset data/ucf101/manifest.csv --out data/ucf101/small.csv \\
        --classes ApplyEyeMakeup Archery --split split1:train --fraction 0.25 --seed 0
    python -m data_dali.manifest_tools merge data/ucf101 data/hmdb51 --out data/ucf_hmdb.csv

``stats`` counts clips, classes, clips per class, durations, splits and flagged clips.
``subset`` keeps the rows of some classes (``--classes`` / ``--drop-classes``, by name or
label), of one split (``split1:train``, ``fold:3``) and a seeded fraction of each class; ids and
labels stay as they are. ``merge`` concatenates several prepared datasets (folders or
manifests): ids are renumbered 0..N-1 and labels matched by class name (the first dataset's
labels stay; a new name gets the next free label).

Every output is an ordinary manifest (docs/DATA.md) written atomically; its media paths are
rewritten relative to its own folder, which must hold every clip (a manifest's paths stay
inside its folder): for a merge, a common parent of the datasets. An ``--out`` that is an
input (the same file, however named: a link, another spelling) is refused: no input is ever
replaced. A manifest cut by hand (``shuf | head``, pandas) loads as well, as long as its ids
stay unique.
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
import sys
from collections import Counter
from pathlib import Path

from .cli import ArgumentParser, UserError, command, prog_name
from .fileio import atomic_write_text
from .manifest import FIELDS, MEDIA, UNLABELED, Manifest, ManifestError, parse_split


def open_manifest(path) -> Manifest:
    """A prepared folder (its manifest.csv) or a manifest file, checked."""
    p = Path(path)
    if p.is_dir():
        p = p / "manifest.csv"
    try:
        return Manifest(p)
    except FileNotFoundError as e:
        raise ManifestError(str(e)) from None


def _name(row: dict) -> str:
    return row.get("class_name") or row["label"]


# ----------------------------------------------------------------------------------------------
# stats
# ----------------------------------------------------------------------------------------------
def stats(m: Manifest) -> dict:
    """Clips, classes, clips per class, durations, splits and flagged clips of a manifest."""
    labels = [int(r["label"]) for r in m.rows]
    per_class = Counter(labels)
    durations = [float(r["duration"]) for r in m.rows if (r.get("duration") or "").strip()]
    splits = {}
    for col in ("split1", "split2", "split3", "fold"):
        values = Counter(r.get(col, "") for r in m.rows)
        if set(values) - {""}:
            splits[col] = {v or "(none)": n for v, n in sorted(values.items())}
    return {
        "manifest": str(m.file),
        "clips": len(m),
        "with_video": sum(1 for r in m.rows if r["video"]),
        "with_audio": sum(1 for i in range(len(m)) if m.has_audio(i)),
        "classes": len([c for c in per_class if c != UNLABELED]),
        "unlabeled": per_class.get(UNLABELED, 0),
        "per_class": {f"{c} {m.class_names[c]}": per_class[c] for c in sorted(per_class)
                      if c != UNLABELED},
        "duration_s": {"total": sum(durations), "min": min(durations, default=0.0),
                       "mean": sum(durations) / len(durations) if durations else 0.0,
                       "max": max(durations, default=0.0), "clips_with_duration": len(durations)},
        "splits": splits,
        "flagged": {"silent": sum(1 for r in m.rows if r.get("silent") == "1"),
                    "no_audio": sum(1 for r in m.rows if r.get("audio_present") == "0"),
                    "notes": sum(1 for r in m.rows if (r.get("notes") or "").strip())},
    }


def format_stats(s: dict) -> str:
    d = s["duration_s"]
    lines = [f"manifest: {s['manifest']}",
             f"clips: {s['clips']} ({s['with_video']} with video, {s['with_audio']} with audio)",
             f"classes: {s['classes']} ({s['unlabeled']} unlabeled clips)",
             f"duration: {d['total'] / 3600:.2f} h; per clip min {d['min']:.2f} s, mean "
             f"{d['mean']:.2f} s, max {d['max']:.2f} s",
             "flagged: " + ", ".join(f"{k} {v}" for k, v in s["flagged"].items())]
    for col, values in s["splits"].items():
        lines.append(f"{col}: " + ", ".join(f"{v} {n}" for v, n in values.items()))
    lines.append("clips per class (label name: clips):")
    lines += [f"  {name}: {n}" for name, n in s["per_class"].items()]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# subset and merge
# ----------------------------------------------------------------------------------------------
def subset(m: Manifest, *, classes=None, drop_classes=None, split=None, fraction=1.0,
           seed=0) -> list[dict]:
    """The rows of ``m`` in the given classes (names or labels; ``drop_classes`` leaves some
    out), of one split, and ``round(fraction * n)`` of each class's n clips (seeded), in the
    manifest's order."""
    if not 0.0 < fraction <= 1.0:
        raise UserError(f"--fraction {fraction}: use a number in (0, 1]")
    try:
        col_val = parse_split(split)
    except ValueError as e:
        raise UserError(f"--split {e}; see the splits of {m.file} with `stats`") from None
    if col_val and col_val[0] not in m.rows[0]:
        raise UserError(f"--split {split}: {m.file} has no column {col_val[0]!r}; splits are "
                        "split1..split3 (train/test) or fold (see `stats`)")
    keep = _class_filter(m, classes, "--classes")
    drop = _class_filter(m, drop_classes, "--drop-classes") or set()
    rows = [r for r in m.rows
            if (keep is None or int(r["label"]) in keep) and int(r["label"]) not in drop
            and (col_val is None or r.get(col_val[0], "") == col_val[1])]
    if fraction < 1.0:
        rng = random.Random(seed)
        by_class: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            by_class.setdefault(int(r["label"]), []).append(i)
        chosen = set()
        for c in sorted(by_class):
            chosen.update(rng.sample(by_class[c], round(fraction * len(by_class[c]))))
        rows = [r for i, r in enumerate(rows) if i in chosen]
    if not rows:
        raise UserError(f"{m.file}: no clip is left by these choices; see `python -m "
                        f"data_dali.manifest_tools stats {m.file}`")
    return rows


def _class_filter(m: Manifest, wanted, flag: str) -> set[int] | None:
    if not wanted:
        return None
    by_name = {name: c for c, name in enumerate(m.class_names)}
    out, unknown = set(), []
    for w in wanted:
        if w in by_name:
            out.add(by_name[w])
        elif w.lstrip("-").isdigit() and (int(w) == UNLABELED or 0 <= int(w) < m.num_classes):
            out.add(int(w))
        else:
            unknown.append(w)
    if unknown:
        shown = ", ".join(m.class_names[:8]) + (" ..." if m.num_classes > 8 else "")
        raise UserError(f"{flag} {' '.join(unknown)}: no such class in {m.file} (classes: "
                        f"{shown}; names or labels)")
    return out


def merge(manifests: list[Manifest]) -> list[dict]:
    """The rows of every manifest, ids renumbered 0..N-1, labels matched by class name."""
    owner: dict[str, int] = {}
    labels: dict[str, int] = {}
    rows = []
    for j, m in enumerate(manifests):
        for k in MEDIA:  # the same clip twice would be refused when the merged manifest opens
            for r in m.rows:
                if r[k] and owner.setdefault(r[k], j) != j:
                    raise UserError(f"{m.file} and {manifests[owner[r[k]]].file} list the same "
                                    f"clip {r[k]}; merge each dataset once")
        order = sorted({int(r["label"]) for r in m.rows} - {UNLABELED})
        for c in order:
            labels.setdefault(m.class_names[c], len(labels))
        for r in m.rows:
            label = int(r["label"])
            new = dict(r, label=str(labels[m.class_names[label]] if label != UNLABELED else label))
            rows.append(new)
    for i, r in enumerate(rows):
        r["id"] = str(i)
    return rows


def write_manifest(rows: list[dict], out, sources: list[Manifest], flag: str = "--out") -> Path:
    """``rows`` (absolute media paths, as a Manifest holds them; from ``sources``) as a manifest
    at ``out``, paths relative to its folder; a UserError if a clip lies outside that folder."""
    out = Path(out)
    if out.is_dir():
        raise UserError(f"{flag} {out}: is a folder; pass a file name, e.g. {out / 'subset.csv'}")
    check_not_an_input(out, sources, flag)
    root = out.parent.resolve()
    if not root.is_dir():
        raise UserError(f"{flag} {out}: folder {root} does not exist; pass a file in a dataset folder")
    outside = [r[k] for r in rows for k in MEDIA if r[k] and root not in Path(r[k]).parents]
    if outside:
        common = os.path.commonpath([str(m.root) for m in sources])
        raise UserError(f"{flag} {out}: {len(outside)} clip file(s) lie outside its folder "
                        f"(e.g. {outside[0]}); a manifest's paths stay inside its folder: write it "
                        f"into a folder that holds every dataset, e.g. {Path(common) / out.name}")
    fields = list(FIELDS)
    for r in rows:
        fields += [k for k in r if k not in fields]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({**r, **{k: Path(os.path.relpath(r[k], root)).as_posix()
                            for k in MEDIA if r[k]}})
    atomic_write_text(out, buf.getvalue())
    return out


def check_not_an_input(out, sources: list[Manifest], flag: str = "--out") -> None:
    """A UserError if ``out`` is one of the ``sources``' manifests: writing it would replace
    the input with what was read from it (``subset M --out M``)."""
    for m in sources:
        if _same_file(Path(out), m.file):
            raise UserError(f"{flag} {out}: is the input manifest {m.file}, which writing "
                            f"would replace; choose another {flag} (a new file name)")


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: the same path once resolved (``..``, symbolic
    links), or, where both exist, the same file on disk (a hard link, a case-insensitive disk)."""
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): not the same file
        return False


# ----------------------------------------------------------------------------------------------
# the command
# ----------------------------------------------------------------------------------------------
@command
def main(argv=None):
    p = ArgumentParser(prog=prog_name("data_dali.manifest_tools", "cmacc-manifest"),
                       description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="stats|subset|merge")
    st = sub.add_parser("stats", help="counts of a manifest")
    st.add_argument("manifest", help="a manifest.csv or a prepared folder")
    st.add_argument("--json", action="store_true", help="print JSON instead of text")
    su = sub.add_parser("subset", help="some classes / one split / a fraction of a manifest")
    su.add_argument("manifest", help="a manifest.csv or a prepared folder")
    su.add_argument("--out", required=True, help="the new manifest (a file inside the dataset folder)")
    su.add_argument("--classes", nargs="+", help="keep these classes (names or labels)")
    su.add_argument("--drop-classes", nargs="+", help="leave these classes out (names or labels)")
    su.add_argument("--split", help="keep one split: train / test (split1), split2:test, fold:3")
    su.add_argument("--fraction", type=float, default=1.0,
                    help="keep this share of each class's clips, drawn with --seed (default 1)")
    su.add_argument("--seed", type=int, default=0)
    me = sub.add_parser("merge", help="several prepared datasets → one manifest")
    me.add_argument("datasets", nargs="+", help="prepared folders or manifest.csv files")
    me.add_argument("--out", required=True,
                    help="the merged manifest, in a folder that holds every dataset")
    args = p.parse_args(argv)
    if args.cmd == "stats":
        s = stats(open_manifest(args.manifest))
        print(json.dumps(s, indent=2) if args.json else format_stats(s))
        return 0
    if args.cmd == "subset":
        sources = [open_manifest(args.manifest)]
        check_not_an_input(args.out, sources)  # before the work: its errors would hide this one
        rows = subset(sources[0], classes=args.classes, drop_classes=args.drop_classes,
                      split=args.split, fraction=args.fraction, seed=args.seed)
    else:
        sources = [open_manifest(d) for d in args.datasets]
        check_not_an_input(args.out, sources)
        rows = merge(sources)
    out = write_manifest(rows, args.out, sources)
    print(f"{out}: {len(rows)} clips")
    return 0


if __name__ == "__main__":
    sys.exit(main())
