"""The mutual-information study as a study (cmacc.apps.mi): --quick end to end on generated
glyphs, a stopped study that resumes run by run and reports its partial figures, the plan of runs
seed by seed, paired differences by seed, `compare`'s paired intervals and verdicts against the
declared margin, each run's UTC start and end, and the one-line refusals of a bad pool mode."""

import dataclasses
import json
import math
import re

import numpy as np
import pytest

from cmacc.apps import mi

# --quick, shorter: 40 steps (two windows of 20: the curves and the second-half figures have
# rows; the active samplers select from step 5) and the probe fit on 1,000 pairs, not 2,000;
# what these tests check is the study's bookkeeping and report, not how good its figures are
SHORT = ["--quick", "--max-steps", "40", "--probe-pairs", "1000"]
QUICK_ARGS = [*SHORT, "--chars", "1", "3", "--seeds", "0", "--sampler-chars", "3"]


def test_quick_end_to_end_on_generated_glyphs(tmp_path):
    out = tmp_path / "mi"
    assert mi.main(["--make-glyphs", str(tmp_path / "g"), *QUICK_ARGS, "--out", str(out)]) == 0
    res = json.loads((out / "mi.json").read_text())
    assert res["chars"] == [1, 3] and res["alphabet_sizes"] == [12, 12, 12] and res["complete"]
    assert res["mi"] == pytest.approx({"1": math.log(12), "3": 3 * math.log(12)})
    for m in mi.METHODS:
        for l in ("1", "3"):
            (r,) = res["runs"][m][l]
            assert 0.0 <= r["probe"] <= 1.0 and 0 < r["steps"] <= 60 and r["acc"]
            assert 0.0 <= r["probe_seen"] <= 1.0
    # the samplers the paper compares ran at --sampler-chars only
    for m in mi.SAMPLERS:
        assert set(res["runs"][m]) == {"3"}
    assert set(res["untrained"]) == set(res["untrained_seen"]) == {"1", "3"}
    assert set(res["untrained"]["1"]) == {"0"}  # per seed
    assert set(res["pixels"]) == set(res["pixels_seen"]) == {"1", "3"}
    assert all(0.0 <= v <= 1.0 for v in [*res["pixels"].values(), *res["pixels_seen"].values()])
    report = (out / "report.md").read_text()
    assert "## Held-out drawers" in report and "## Seen drawings" in report
    assert "## Samplers of the cross-modal objective" in report and "OHEM (ohem)" in report
    # each sampler against random (XMoCo) and against the active sampler, paired by seed
    section = report.split("## Samplers: differences, paired by seed")[1].split("## ")[0]
    head = next(line for line in section.splitlines() if line.startswith("| l |"))
    cols = [c.strip() for c in head.strip("|").split("|")]
    row = next(line for line in section.splitlines() if line.startswith("| 3 | held-out"))
    cells = dict(zip(cols, (c.strip() for c in row.strip("|").split("|"))))
    for a, b in [("OHEM", "XMoCo"), ("CM-ACC", "OHEM"), ("CM-ACC-feature", "XMoCo")]:
        (ra,), (rb,) = res["runs"][a]["3"], res["runs"][b]["3"]
        assert cells[f"{a} − {b}"] == f"{ra['probe'] - rb['probe']:+.3f} (one row)"
    assert "Departures from the paper" in report and "training pairs (paper: 50000)" in report
    assert "partial" not in report
    runs = [r for per_l in res["runs"].values() for rs in per_l.values() for r in rs]
    minutes = sum(r["seconds"] + r["probe_seconds"] for r in runs) / 60
    assert f"the {len(runs)} runs in the tables: {minutes:.1f} min" in report
    assert (out / "mi.png").stat().st_size > 0 and (out / "mi_curves.png").stat().st_size > 0
    # the negatives' diversity by the real characters: every method, each sampler − random
    assert (out / "mi_diversity.png").stat().st_size > 0
    section = report.split("### unique/M, second half of training")[1].split("### ")[0]
    head = next(line for line in section.splitlines() if line.startswith("| l |"))
    cols = [c.strip() for c in head.strip("|").split("|")]
    row = next(line for line in section.splitlines() if line.startswith("| 3 |"))
    cells = dict(zip(cols, (c.strip() for c in row.strip("|").split("|"))))
    assert cells["random law"] == f"{res['diversity_law']['3']['unique_per_m']:.3f}"
    for m in mi.ALL_METHODS:
        (r,) = res["runs"][m]["3"]
        assert 0 < r["unique_per_m_2nd_half"] <= 1 and len(r["unique_per_m"]) == len(r["acc"])
        assert 0 < r["coverage_2nd_half"] <= 1
        assert cells[m] == f"{r['unique_per_m_2nd_half']:.3f} (one row)"
        if m != "XMoCo" and m != "SMoCo":
            (x,) = res["runs"]["XMoCo"]["3"]
            assert cells[f"{m} − XMoCo"] == \
                f"{r['unique_per_m_2nd_half'] - x['unique_per_m_2nd_half']:+.3f} (one row)"
    assert "### coverage, second half of training" in report


def test_a_stopped_study_resumes_and_its_partial_figures_report(tmp_path, capsys):
    """A study keeps its finished runs: run again with more seeds, only the new seed trains
    (the first seed's figures are the file's, untouched); another setting is one clear error,
    except the pool, a setting of the active sampler's runs only (those train again); --report-
    only renders a partial mi.json, saying it is partial."""
    glyphs, out = str(tmp_path / "g"), tmp_path / "mi"
    base = ["--make-glyphs", glyphs, *SHORT, "--chars", "1", "--samplers", "--out", str(out)]
    assert mi.main([*base, "--seeds", "0"]) == 0
    said = capsys.readouterr().out  # progress with the total, in a log that is not a terminal
    for i in (1, 2, 3):
        assert re.search(rf"^run {i} of 3 \(eta [^)]+\): l=1 seed 0 ", said, re.M), said
    assert "run 3 of 3 (eta 0s)" in said
    first = json.loads((out / "mi.json").read_text())
    trained = []
    real_train = mi.train_one

    def counting(method, train, cfg, seed, **kw):
        trained.append((method, seed))
        return real_train(method, train, cfg, seed, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(mi.study, "train_one", counting)  # the name study.run calls
    try:
        assert mi.main([*base, "--seeds", "0", "1"]) == 0
    finally:
        mp.undo()
    assert sorted(trained) == sorted((m, 1) for m in mi.METHODS)
    both = json.loads((out / "mi.json").read_text())
    for m in mi.METHODS:
        runs = both["runs"][m]["1"]
        assert [r["seed"] for r in runs] == [0, 1]
        assert runs[0] == first["runs"][m]["1"][0]
    assert both["untrained"]["1"]["0"] == first["untrained"]["1"]["0"]
    first_cmacc = both["runs"]["CM-ACC"]["1"]  # seeds 0, 1 at the quick pool
    assert both["seconds"] > first["seconds"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # another setting: the command's one-line error
        mi.main([*base, "--seeds", "0", "--tau", "0.2"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(r"config\.tau: [0-9.]+ there, 0\.2 now", err)
    assert "config: {" not in err and "max_steps" not in err  # only the field that differs
    # another pool: the active sampler's runs are trained again, the random ones kept
    trained.clear()
    mp.setattr(mi.study, "train_one", counting)
    try:
        assert mi.main([*base, "--seeds", "0", "1", "--pool-mult", "20"]) == 0
    finally:
        mp.undo()
    assert sorted(trained) == [("CM-ACC", 0), ("CM-ACC", 1)]
    both = json.loads((out / "mi.json").read_text())
    assert [r["pool_mult"] for r in both["runs"]["CM-ACC"]["1"]] == [20, 20]
    # the other pool's finished runs are set aside in mi.json, not deleted
    assert both["runs_other_pool"]["CM-ACC"]["1"] == first_cmacc
    assert both["runs"]["SMoCo"]["1"][0] == first["runs"]["SMoCo"]["1"][0]
    # a partial study: drop the second seed's CM-ACC run and report; XMoCo's runs as an older
    # mi.json has them, without the diversity record
    del both["runs"]["CM-ACC"]["1"][1]
    both["complete"] = False
    for r in both["runs"]["XMoCo"]["1"]:
        for k in ("unique_per_m", "coverage", "unique_per_m_2nd_half", "coverage_2nd_half"):
            del r[k]
    (out / "mi.json").write_text(json.dumps(both))
    for f in ("report.md", "mi.png", "mi_curves.png", "mi_diversity.png"):
        (out / f).unlink()
    assert mi.main(["--report-only", "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "partial: 5 runs in" in report
    section = report.split("### unique/M, second half of training")[1].split("### ")[0]
    row = next(line for line in section.splitlines() if line.startswith("| 1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]  # l, law, SMoCo, XMoCo, CM-ACC, diff
    assert cells[3] == cells[5] == "not recorded" and cells[4] != "not recorded"
    assert (out / "mi_diversity.png").stat().st_size > 0
    assert (out / "mi.png").stat().st_size > 0 and (out / "mi_curves.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        mi.main(["--report-only", "--out", str(tmp_path / "nothing")])


def test_plan_runs_whole_curves_seed_by_seed():
    runs = mi.plan([1, 4, 8], [0, 1], ["SMoCo", "CM-ACC"], [4], ["OHEM"])
    curve = [(1, "SMoCo"), (1, "CM-ACC"), (4, "SMoCo"), (4, "CM-ACC"), (8, "SMoCo"),
             (8, "CM-ACC")]
    assert runs == [(seed, l, m) for seed in (0, 1) for l, m in curve] + [(0, 4, "OHEM"),
                                                                           (1, 4, "OHEM")]
    assert mi.default_sampler_chars([1, 2, 3, 4, 6, 8]) == [6, 8]
    assert mi.default_sampler_chars([1, 2]) == []


def test_paired_difference_is_per_seed():
    res = {"runs": {"A": {"3": [{"seed": 0, "probe": 0.5}, {"seed": 2, "probe": 0.7},
                                {"seed": 1, "probe": 0.4}]},
                    "B": {"3": [{"seed": 1, "probe": 0.1}, {"seed": 0, "probe": 0.45}]}}}
    # seed 2 has no B run: left out; seeds 0, 1 paired whatever the order in the file
    assert mi.paired_difference(res, "A", "B", 3, "probe") == pytest.approx([0.05, 0.3])


def test_a_resume_with_another_pool_mode_trains_only_the_active_runs_again(tmp_path):
    """The pool mode is, like the pool size, a setting of the active samplers' runs: a study
    with another one is the same study (no error), its active runs are set aside (runs of an
    older mi.json, without a mode, had the rolling pool), XMoCo's and SMoCo's stay."""
    from cmacc.apps.mi.study import _drop_other_pools, _resume
    from data_dali.cli import UserError

    rolling = mi.MIConfig(**mi.QUICK)
    epoch = mi.MIConfig(**{**mi.QUICK, "pool_mode": "epoch"})
    settings = {"relation": "next", "config": dataclasses.asdict(rolling)}
    (tmp_path / "mi.json").write_text(json.dumps({**settings, "runs": {}}))
    moved = _resume(tmp_path / "mi.json",
                    {**settings, "config": dataclasses.asdict(epoch)})
    assert moved["runs"] == {} and moved["diversity_law"] == {}
    with pytest.raises(UserError, match="tau"):
        _resume(tmp_path / "mi.json", {**settings, "config": {**settings["config"], "tau": 0.2}})
    old = {"seed": 0, "pool_mult": 12}  # an older file's active run: rolling
    results = {"runs": {"CM-ACC": {"3": [old, {"seed": 1, "pool_mult": 12, "pool_mode": "epoch"}]},
                        "XMoCo": {"3": [{"seed": 0}]}, "SMoCo": {"3": [{"seed": 0}]}},
               "runs_other_pool": {}}
    assert _drop_other_pools(results, epoch) == 1
    assert results["runs"]["CM-ACC"]["3"] == [{"seed": 1, "pool_mult": 12, "pool_mode": "epoch"}]
    assert results["runs_other_pool"]["CM-ACC"]["3"] == [old]
    assert results["runs"]["XMoCo"]["3"] == [{"seed": 0}] == results["runs"]["SMoCo"]["3"]
    assert _drop_other_pools(results, rolling) == 1  # and back: the epoch run is set aside
    assert results["runs_other_pool"]["CM-ACC"]["3"][-1]["pool_mode"] == "epoch"


def test_bad_pool_mode_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        mi.main(["--make-glyphs", str(tmp_path / "g"), "--quick", "--pool-mode", "weekly"])
    assert e.value.code == 2
    assert "--pool-mode: invalid choice: 'weekly'" in capsys.readouterr().err


def _study(runs: dict, **over) -> dict:
    """A hand-built mi.json: ``runs`` = method → l → list of per-seed figures."""
    return {"alphabets": ["A", "B"], "relation": "next", "n_train": 100, "n_test": 10,
            "n_probe": 50, "config": {"max_steps": 60, "tau": 0.7},
            "runs": {m: {str(l): rs for l, rs in per.items()} for m, per in runs.items()},
            **over}


def test_compare_pairs_two_studies_by_seed(tmp_path, capsys):
    """mi.compare: first − second per seed that both sides ran (seed 2 only on one side is
    left out, of the sides' means too), with the t-interval of those differences (numpy/scipy
    as the reference); the settings that differ are named; studies of other pairs are
    refused in one line."""
    from scipy import stats

    from cmacc.apps.mi import compare

    def run(seed, probe, uniq, steps=60):
        return {"seed": seed, "probe": probe, "probe_seen": probe + 0.5, "steps": steps,
                "unique_per_m_2nd_half": uniq, "coverage_2nd_half": 2 * uniq,
                "seconds": 10.0 * steps, "cpu_seconds": 9.0 * steps}

    a = _study({"CM-ACC": {3: [run(0, 0.30, 0.40), run(1, 0.26, 0.42), run(2, 0.9, 0.9)]}})
    b = _study({"XMoCo": {3: [run(0, 0.25, 0.35, 120), run(1, 0.24, 0.36, 120)]}},
               config={"max_steps": 120, "tau": 0.7})
    c = compare.compare(a, "CM-ACC", b, "XMoCo", 3)
    d = np.array([0.30 - 0.25, 0.26 - 0.24])
    assert c["seeds"] == [0, 1]
    assert c["diff"]["probe"]["per_seed"] == pytest.approx(d.tolist())
    assert c["diff"]["probe"]["mean"] == pytest.approx(d.mean())
    assert c["diff"]["probe"]["half"] == pytest.approx(
        stats.t.ppf(0.975, 1) * d.std(ddof=1) / np.sqrt(2), rel=1e-3)  # metrics.t975: 4 digits
    assert c["diff"]["unique_per_m_2nd_half"]["per_seed"] == pytest.approx([0.05, 0.06])
    assert c["a"]["steps"][0] == 60 and c["b"]["steps"][0] == 120
    assert c["a"]["probe"][0] == pytest.approx(0.28)  # the paired seeds only: not seed 2's 0.9
    assert c["b"]["cpu_seconds"][0] == pytest.approx(1080.0)
    assert compare.config_differences(a, b) == ["max_steps: 60 vs 120"]
    for name, r in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mi.json").write_text(json.dumps(r))
    assert compare.main([f"{tmp_path / 'a'}:CM-ACC", f"{tmp_path / 'b'}:XMoCo"]) == 0
    out = capsys.readouterr().out
    assert "+0.035 ± " in out and "settings that differ: max_steps: 60 vs 120" in out
    (tmp_path / "b" / "mi.json").write_text(json.dumps({**b, "n_train": 200}))
    with pytest.raises(SystemExit) as e:
        compare.main([f"{tmp_path / 'a'}:CM-ACC", f"{tmp_path / 'b'}:XMoCo"])
    assert e.value.code == 2
    assert "drew different pairs (n_train: 100 vs 200)" in capsys.readouterr().err


@pytest.mark.parametrize("mean, half, want", [
    (0.05, 0.02, "better"), (0.01, 0.005, "better, within the margin"),
    (-0.05, 0.02, "worse"), (-0.01, 0.008, "worse, within the margin"),
    (0.0, 0.015, "equivalent"), (0.01, 0.01, "equivalent"), (0.01, 0.03, "undetermined"),
    (-0.015, 0.02, "undetermined"), (-0.015, 0.01, "worse"), (0.3, float("nan"), "undetermined")])
def test_a_verdict_reads_the_paired_interval_against_the_declared_margin(mean, half, want):
    """better / worse: the interval excludes 0; equivalent: it holds 0 inside ±margin;
    undetermined: it holds 0 and reaches past the margin, or there is no interval (1 seed)."""
    from cmacc.apps.mi import compare

    assert compare.verdict(mean, half, 0.02) == want


def test_compare_gives_each_probe_row_a_verdict_with_a_margin(tmp_path, capsys):
    from cmacc.apps.mi import compare

    a = _study({"CM-ACC": {3: [{"seed": s, "probe": p, "probe_seen": 0.5} for s, p in
                               enumerate((0.30, 0.31, 0.29))]}})
    b = _study({"XMoCo": {3: [{"seed": s, "probe": p, "probe_seen": 0.5} for s, p in
                              enumerate((0.30, 0.30, 0.30))]}})
    for name, r in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mi.json").write_text(json.dumps(r))
    assert compare.main([f"{tmp_path / 'a'}:CM-ACC", f"{tmp_path / 'b'}:XMoCo",
                         "--margin", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "verdict (margin ±0.05)" in out
    row = next(line for line in out.splitlines() if "| probe, held-out drawers |" in line)
    assert row.rstrip().endswith("| equivalent |")  # +0.000 ± 0.025 (t_2 = 4.303)
    with pytest.raises(SystemExit):
        compare.main([f"{tmp_path / 'a'}:CM-ACC", f"{tmp_path / 'b'}:XMoCo", "--margin", "0"])


def test_each_run_records_its_utc_start_and_end_and_the_report_prints_them(tmp_path, capsys):
    """Issue 50, item 5: every run of a study records when it started and ended (UTC, ISO 8601,
    to the second) beside its figures, inside the study's own span and one after another; the
    report lists them run by run with the first end, and prints "not recorded" for a run of an
    older mi.json (no such keys); compare prints them for the paired seeds."""
    from datetime import datetime, timezone

    from cmacc.apps.mi import compare

    def parse(s):
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", s), s
        return datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)

    out = tmp_path / "mi"
    before = datetime.now(timezone.utc).replace(microsecond=0)
    assert mi.main(["--make-glyphs", str(tmp_path / "g"), *SHORT, "--chars", "1",
                    "--seeds", "0", "1", "--methods", "XMoCo", "--out", str(out)]) == 0
    after = datetime.now(timezone.utc)
    res = json.loads((out / "mi.json").read_text())
    runs = res["runs"]["XMoCo"]["1"]
    assert [r["seed"] for r in runs] == [0, 1]
    spans = [(parse(r["started_utc"]), parse(r["ended_utc"])) for r in runs]
    for start, end in spans:
        assert before <= start <= end <= after
    assert spans[0][1] <= spans[1][0]  # seed 1 starts after seed 0 ended
    report = (out / "report.md").read_text()
    section = report.split("## When each run ran")[1].split("\n## ")[0]
    for r in runs:
        assert f"| XMoCo | 1 | {r['seed']} | {r['started_utc']} | {r['ended_utc']} |" in section
    assert f"The first of these runs to finish ended at {runs[0]['ended_utc']}." in section
    # an older record: seed 0 without the times (as every run before this record)
    old = json.loads(json.dumps(res))
    del old["runs"]["XMoCo"]["1"][0]["started_utc"], old["runs"]["XMoCo"]["1"][0]["ended_utc"]
    (out / "mi.json").write_text(json.dumps(old))
    assert mi.main(["--report-only", "--out", str(out)]) == 0
    section = (out / "report.md").read_text().split("## When each run ran")[1].split("\n## ")[0]
    assert "| XMoCo | 1 | 0 | not recorded | not recorded |" in section
    assert (f"ended at {runs[1]['ended_utc']}; 1 of 2 runs did not record it." in section)
    capsys.readouterr()
    assert compare.main([f"{out}:XMoCo", f"{out}:XMoCo"]) == 0
    said = capsys.readouterr().out
    assert f"first end: {runs[1]['ended_utc']}" in said
    assert (f"seed 0 not recorded; seed 1 {runs[1]['started_utc']} – {runs[1]['ended_utc']}"
            in said)
