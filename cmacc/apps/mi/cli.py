"""The command line of ``python -m cmacc.apps.mi`` / ``cmacc-mi``."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from data_dali.cli import ArgumentParser, UserError, command, output_folder, prog_name

from cmacc.config import POOL_MODES
from data_dali.classdist import zipf_exponent

from .. import positive_int
from .data import RELATIONS, make_glyphs
from .report import write_outputs
from .study import run
from .train import ALL_METHODS, METHODS, PAIRS, QUICK, QUICK_PAIRS, SAMPLERS, MIConfig, selects


FIELD_HELP = {  # MIConfig's fields that need more than their default
    "pool_mult": "the candidate pool N = pool_mult * M of the active samplers; ",
    "pool_mode": "the candidate pool: rolling = the key-encoder outputs of the last N / M "
                 "steps; epoch (the paper) = N random training pairs through the key encoders "
                 "at each epoch start, an epoch being one pass over the training pairs at batch "
                 "M (floor(pairs / M) steps). A resumed study with another pool trains only the "
                 "active samplers' runs again; ",
    "fresh_picks": "a departure, to measure what the pool's staleness costs: the active "
                   "samplers' picks are re-encoded by the current key encoders before they are "
                   "enqueued (Algorithm 1 enqueues the pool's keys, encoded when the pool was "
                   "drawn); ",
    "pool_refresh": "R: batches of M pool pairs re-encoded per step by the current key "
                    "encoders, round robin (no candidate older than pool_mult / R steps), so "
                    "that the selection sees the current model; ",
    "tau_p": "the pseudo-posterior temperature of CM-ACC's gradient embedding, p_n = "
             "softmax(k_n . q_j / tau_p) over the M queries (paper eq. 5 and Algorithm 1: 1; "
             "the trainer's --tau-p); OHEM's scores read it too. Each run records the "
             "posterior's entropy and the spread of the k-means++ D^2 weights in mi.json; ",
}


@command
def main(argv=None):
    from cmacc.apps import mi

    p = ArgumentParser(prog=prog_name("cmacc.apps.mi", "cmacc-mi"), description=mi.__doc__)
    p.add_argument("--omniglot", help="folder holding omniglot-py/images_background (or "
                   "omniglot-py itself)")
    p.add_argument("--make-glyphs", metavar="DIR", help="write generated glyphs there and use them")
    p.add_argument("--out", default="runs/mi",
                   help="folder of mi.json, report.md and the plots (default: runs/mi)")
    p.add_argument("--chars", type=positive_int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", choices=tuple(ALL_METHODS), default=list(METHODS),
                   help="the objectives of the curve, run at every l (default: %(default)s)")
    p.add_argument("--samplers", nargs="*", choices=tuple(ALL_METHODS), default=list(SAMPLERS),
                   help="more samplers of the cross-modal objective, run at --sampler-chars "
                        "only (default: %(default)s; none: --samplers with no name)")
    p.add_argument("--sampler-chars", type=positive_int, nargs="*",
                   help="the l at which --samplers run (default: the two largest l >= 3 of "
                        "--chars)")
    p.add_argument("--report-only", action="store_true",
                   help="write report.md and the plots from --out's mi.json (a stopped study's "
                        "too) and train nothing")
    p.add_argument("--train-pairs", type=positive_int,
                   help=f"default {PAIRS['train']} (the paper's; {QUICK_PAIRS['train']} with --quick)")
    p.add_argument("--test-pairs", type=positive_int,
                   help=f"default {PAIRS['test']} ({QUICK_PAIRS['test']} with --quick)")
    p.add_argument("--probe-pairs", type=positive_int,
                   help=f"training pairs the linear probe is fit on (the first ones); default "
                        f"{PAIRS['probe']} ({QUICK_PAIRS['probe']} with --quick)")
    p.add_argument("--relation", choices=RELATIONS, default="next",
                   help="y's character: x's next in its alphabet (Ozair et al., default) or x's own")
    p.add_argument("--char-dist", default="uniform", metavar="DIST",
                   help="the training pairs' characters: uniform (the paper's, default) or "
                        "zipf:S (character c of an alphabet ∝ 1/(c+1)^S: a long tail, where "
                        "random negatives repeat the head and a sampler has room to diversify; "
                        "test pairs stay uniform, and the probe is also scored on the tail)")
    p.add_argument("--quick", action="store_true",
                   help="a minutes-long setting for tests (tiny networks, 60 steps): not a result")
    for f in dataclasses.fields(MIConfig):
        kind = (dict(action=argparse.BooleanOptionalAction) if isinstance(f.default, bool)
                else dict(type=type(f.default)))
        if f.name == "pool_mode":
            kind["choices"] = POOL_MODES
        p.add_argument("--" + f.name.replace("_", "-"), default=None, **kind,
                       help=FIELD_HELP.get(f.name, "")
                       + f"default {f.default} ({QUICK.get(f.name, f.default)} with --quick)")
    args = p.parse_args(argv)
    if args.report_only:
        return report_only(Path(args.out))
    if not (args.make_glyphs or args.omniglot):
        p.error("pass --omniglot ROOT (torchvision layout) or --make-glyphs DIR")
    if max(args.chars) > 9:
        p.error("--chars must be between 1 and 9")
    zipf_exponent(args.char_dist, flag="--char-dist")  # one line naming the forms
    for k, v in (QUICK_PAIRS if args.quick else PAIRS).items():
        if getattr(args, f"{k}_pairs") is None:
            setattr(args, f"{k}_pairs", v)
    base = dict(QUICK) if args.quick else {}
    base.update({f.name: getattr(args, f.name) for f in dataclasses.fields(MIConfig)
                 if getattr(args, f.name) is not None})
    try:
        cfg = MIConfig(**base)
    except ValueError as e:
        raise UserError(f"{e} (see --help)") from None
    if args.train_pairs < cfg.batch:
        p.error(f"--train-pairs {args.train_pairs} is smaller than --batch {cfg.batch}")
    if args.sampler_chars and not set(args.sampler_chars) <= set(args.chars):
        p.error(f"--sampler-chars {args.sampler_chars}: each must be one of --chars {args.chars}")
    active = {m for m in (*args.methods, *args.samplers) if selects(m)}
    if args.train_pairs < cfg.dict_size and active:
        p.error(f"--train-pairs {args.train_pairs} is smaller than K = {cfg.dict_size}: the "
                f"samplers {sorted(active)} need more distinct pairs than the dictionary holds")
    output_folder(args.out, "--out")
    if args.make_glyphs:
        root = make_glyphs(output_folder(args.make_glyphs, "--make-glyphs"),
                           alphabets=max(args.chars), chars=12 if args.quick else None)
    else:
        root = args.omniglot
    run(root, args.out, tuple(args.chars), cfg, n_train=args.train_pairs,
        n_test=args.test_pairs, n_probe=args.probe_pairs, seeds=tuple(args.seeds),
        methods=tuple(args.methods), relation=args.relation, sampler_chars=args.sampler_chars,
        samplers=tuple(m for m in args.samplers if m not in args.methods),
        char_dist=args.char_dist, quick=args.quick)
    _say_outputs(Path(args.out))
    return 0


def _say_outputs(out: Path) -> None:
    print(f"plots: {out / 'mi.png'} {out / 'mi_curves.png'}  results: {out / 'mi.json'}  "
          f"report: {out / 'report.md'}")


def report_only(out: Path) -> int:
    path = out / "mi.json"
    try:
        results = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: no study there; pass the --out of a study (it writes mi.json "
                        "after its first run)") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable ({e})") from None
    if not results.get("runs"):
        raise UserError(f"{path}: no finished run yet; nothing to report")
    write_outputs(results, out)
    _say_outputs(out)
    return 0
