"""Analyses and the mutual-information study: plots and reports are written; the diversity
table is the seeds' window means with a 95% t-interval (recomputed here from the runs'
metrics.csv with scipy's t law); random sampling's diversity law matches a brute-force
enumeration. (The mutual-information study's tests are in test_mi.py.)"""

import csv
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from cmacc.apps import analysis
from cmacc.metrics import expected_unique, format_ci, format_interval, mean_ci, t975


def test_gallery_orders_hard_before_easy(tiny_run, tmp_path):
    res = analysis.gallery(tiny_run, tmp_path, n_queries=2, n_show=2)
    assert (tmp_path / "gallery.png").stat().st_size > 1000
    for row in res["rows"]:
        assert row["hard"] == sorted(row["hard"], reverse=True)
        if row["n_candidates"] >= 4:
            assert min(row["hard"]) >= max(row["easy"])


def test_perclass_and_report(tiny_run, tmp_path):
    res = analysis.perclass(tiny_run, tmp_path)
    accs = [a for _, a in res["top"]["video→audio"]]
    assert accs == sorted(accs, reverse=True) and all(0 <= a <= 1 for a in accs)
    report = analysis.write_report(tmp_path, {"perclass": res})
    assert "perclass.png" in report.read_text()


def test_diversity_command_compares_samplers_over_seeds(tmp_path):
    data = dict(classes=6, clips=96, class_dist="zipf:1", redundancy=0.5, noise=1.0)
    res = analysis.diversity(tmp_path, steps=20, samplers=("random", "active"), seeds=2,
                             data_over=data)
    assert set(res["table"]) == {"random", "active"} and (tmp_path / "diversity.png").exists()
    per_seed = {}
    for s in ("random", "active"):
        per_seed[s] = []
        for k in range(2):
            with open(tmp_path / s / f"seed{k}" / "metrics.csv", newline="") as f:
                rows = list(csv.DictReader(f))
            assert len(rows) == 2  # logged every 10 steps: quarters are the first, last row
            per_seed[s].append([float(r["unique_per_m"]) for r in rows])
        a = np.array(per_seed[s])  # [seed, row]
        row = res["table"][s]
        for key, vals in (("unique_per_m_all", a.mean(1)), ("unique_per_m_first", a[:, 0]),
                          ("unique_per_m_last", a[:, 1])):
            mean, half = row[key]
            assert mean == pytest.approx(vals.mean())
            sem = vals.std(ddof=1) / math.sqrt(2)
            assert half == pytest.approx(stats.t.ppf(0.975, 1) * sem, rel=1e-3, abs=1e-9)
        assert 0 < row["coverage_last"][0] <= 1 and 0 <= row["probe_video"][0] <= 1
        assert row["purity_chance"][0] == pytest.approx(
            sum((k / 96) ** 2 for k in [39, 20, 13, 10, 8, 6]))  # 96 p_c, Zipf 1 over 6 classes
    gap = np.array(per_seed["active"])[:, 1] - np.array(per_seed["random"])[:, 1]
    assert res["table"]["active"]["gap_last"][0] == pytest.approx(gap.mean())
    assert "gap_last" not in res["table"]["random"]
    # the law of a random batch: 16 of the 96 clips, classes of 39, 20, 13, 10, 8, 6 clips
    assert res["setting"]["random_law"] == pytest.approx(expected_unique([39, 20, 13, 10, 8, 6], 16) / 16)
    report = analysis.write_report(tmp_path, {"diversity": res}).read_text()
    assert "| random (XMoCo) | " in report and "key purity video" in report


def test_expected_unique_matches_enumeration():
    """E[U] of m clips drawn without replacement, against every m-subset counted."""
    for counts, m in (([2, 2], 2), ([3, 1, 1], 2), ([4, 2, 1, 1], 3), ([5, 3, 2, 1, 1], 4)):
        clips = [c for c, k in enumerate(counts) for _ in range(k)]
        subsets = list(itertools.combinations(clips, m))
        brute = sum(len(set(sub)) for sub in subsets) / len(subsets)
        assert expected_unique(counts, m) == pytest.approx(brute)
    assert expected_unique([2, 2], 2) == pytest.approx(5 / 3)  # 1 - 1/6 same-class pairs, x2
    assert expected_unique([7], 3) == pytest.approx(1.0)


def test_mean_ci_is_the_t_interval():
    for df in (1, 2, 5, 29, 30, 31, 60, 200):
        assert t975(df) == pytest.approx(stats.t.ppf(0.975, df), abs=1e-3)
    v = [0.61, 0.66, 0.70, 0.64]
    mean, half = mean_ci(v)
    assert mean == pytest.approx(np.mean(v))
    assert half == pytest.approx(stats.t.ppf(0.975, 3) * np.std(v, ddof=1) / 2, rel=1e-3)
    assert math.isnan(mean_ci([0.5])[1])


def test_intervals_print_as_mean_plus_minus_half_width():
    """One format for every report: mean ± t-interval half-width, signed for differences, the
    mean alone for one value. [1, 2, 3]: mean 2, s = 1, t(0.975, 2) = 4.3027 → ± 2.484."""
    assert format_ci([1, 2, 3]) == "2.000 ± 2.484"
    assert format_ci([-1, -2, -3], digits=2, signed=True) == "-2.00 ± 2.48"
    assert format_ci([0.25], signed=True) == "+0.250"
    assert format_interval(0.1, 0.02, signed=True) == "+0.100 ± 0.020"



def test_the_demo_diversity_figure_is_the_mean_of_the_last_quarter(tmp_path):
    """The demo's figure, runlog.summarise's unique_per_m_last: the mean unique/M of the last
    quarter of the rows that have a value (a hand-built metrics.csv: 9 valued rows -> the last
    2; 'nan' and empty skipped, the other metrics' quarters taken over their own rows); a file
    with no value gives NaN."""
    from cmacc.runlog import summarise

    vals = [0.1, 0.2, 0.9, 0.5, 0.3, 0.4, 0.6, 0.8, "nan", 0.7, ""]
    head = "step,loss,acc,unique_per_m,coverage,clips_per_s,data_wait\n"
    path = tmp_path / "metrics.csv"
    path.write_text(head + "".join(f"{10 * (i + 1)},{i},0.5,{v},0,1,0\n" for i, v in enumerate(vals)))
    s = summarise(tmp_path, "CM-ACC")
    assert s["unique_per_m_last"] == pytest.approx((0.8 + 0.7) / 2)
    assert s["loss_last"] == pytest.approx((9 + 10) / 2) and s["steps"] == 110  # 11 rows: 2
    path.write_text(head + "10,1,0.5,nan,0,1,0\n")
    assert math.isnan(summarise(tmp_path, "CM-ACC")["unique_per_m_last"])


def test_a_summary_names_its_run_folder_absolutely(tmp_path, monkeypatch):
    """summary.json's ``out`` is the run folder's absolute path, also when the run was given a
    relative --out (a summary read from another folder still finds its run)."""
    from cmacc.runlog import summarise

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.csv").write_text("step,loss\n10,1\n")
    monkeypatch.chdir(tmp_path)
    summarise("run", "CM-ACC")
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["out"] == str(tmp_path.resolve() / "run")


@pytest.mark.parametrize("diffs, says", [
    ([0.10, 0.12, 0.08], "excludes 0: active enqueues more varied"),
    ([-0.10, -0.12, -0.08], "excludes 0: active enqueues less varied"),
    ([0.05, -0.04, 0.01], "holds 0: this budget cannot show a difference"),
    ([0.05], "one seed gives no interval"),
])
def test_the_demo_verdict_follows_the_t_interval_over_seeds(diffs, says):
    """demo.verdict: the mean and 95% t-interval of the paired differences (scipy's t
    quantile as the reference) and what they allow one to say."""
    from cmacc.apps import demo

    text = demo.verdict(diffs)
    assert says in text and f"{np.mean(diffs):+.3f}" in text
    if len(diffs) > 1:
        half = stats.t.ppf(0.975, len(diffs) - 1) * np.std(diffs, ddof=1) / np.sqrt(len(diffs))
        assert f"± {half:.3f}" in text and (abs(np.mean(diffs)) > half) == ("excludes" in text)


@pytest.mark.parametrize("diffs", [[0.10, 0.12, 0.08], [0.05, -0.04, 0.01], [-0.10, -0.12, -0.08],
                                   [0.05], [0.02, 0.03, 0.021, 0.4, -0.1]])
def test_the_demo_says_why_exactly_when_its_interval_does_not_show_active_above_random(diffs):
    """demo.why_not: no lines when the 95% t-interval (scipy's quantile) lies above 0; otherwise
    the runs' pretext-accuracy range, every seed's difference, the interval's half-width, the
    crop only where the files are cropped hard, and where the mechanism does show."""
    from cmacc.apps import demo

    acc = [0.071, 0.108, 0.093]
    shows = len(diffs) > 1 and np.mean(diffs) - stats.t.ppf(0.975, len(diffs) - 1) * np.std(
        diffs, ddof=1) / np.sqrt(len(diffs)) > 0
    for data, augment, scale, crop in (("files", demo.AUGMENTS, 0.3, True),
                                       ("files", ("flip",), 0.3, False),
                                       ("files", demo.AUGMENTS, 0.8, False),
                                       ("toy", (), 0.3, False)):
        lines = demo.why_not(diffs, acc, data, augment, scale)
        if shows:
            assert lines == []
            continue
        text = "\n".join(lines)
        assert "0.071–0.108" in text and "--data toy" in text
        assert ("random resized crop above all" in text) == crop
        assert ("--augment none" in text) == (data == "files")
        if len(diffs) > 1:
            assert all(f"{d:+.3f}" in text for d in diffs)
            half = stats.t.ppf(0.975, len(diffs) - 1) * np.std(diffs, ddof=1) / np.sqrt(len(diffs))
            assert f"±{half:.3f}" in text


def test_the_demo_states_its_augmentation_and_passes_it_to_every_run(monkeypatch, tmp_path, capsys):
    """The demo's setting line names the augmentation and whether it is the paper's; --augment
    and --crop-scale reach every run's config (none: no augmentation), the default leaves the
    config's own (the paper's, so earlier demo folders resume); flags that cannot apply are one
    line, exit 2, before anything is written."""
    from cmacc.apps import demo

    assert demo.augmentation_line("files", demo.AUGMENTS, 0.3).endswith("(the paper's)")
    assert "(the paper's: all four, crop area 0.3–1)" in demo.augmentation_line("files", ("crop",), 0.5)
    assert "area 0.5–1" in demo.augmentation_line("files", ("crop",), 0.5)
    assert demo.augmentation_line("files", (), 0.3).startswith("augmentation: none (centre crop")
    seen = []

    class Stop(Exception):
        pass

    def fake_pretrain(run_dir, sampler, steps, *, data, sections):
        seen.append(analysis.run_config(run_dir, sampler, steps, data=data, sections=sections).data)
        raise Stop

    monkeypatch.setattr(demo, "prepare_demo_data", lambda out: "synthetic")
    monkeypatch.setattr(demo, "pretrain", fake_pretrain)
    for flags, augment, scale in (([], demo.AUGMENTS, 0.3), (["--augment", "none"], (), 0.3),
                                  (["--augment", "flip", "--crop-scale", "0.6"], ("flip",), 0.6)):
        with pytest.raises(Stop):
            demo.main(["--out", str(tmp_path / f"demo{len(seen)}"), "--steps", "2", "--seeds", "1", *flags])
        assert seen[-1].augment == augment and seen[-1].crop_scale == scale
        assert capsys.readouterr().out.startswith(demo.augmentation_line("files", augment, scale))
    for flags in (["--data", "toy", "--augment", "none"], ["--data", "toy", "--crop-scale", "0.5"],
                  ["--augment", "none", "flip"], ["--crop-scale", "0"]):
        out = tmp_path / "refused"
        with pytest.raises(SystemExit) as e:
            demo.main(["--out", str(out), *flags])
        assert e.value.code == 2 and not out.exists()
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) <= 2 and ("--augment" in err[-1] or "--crop-scale" in err[-1])


def test_analyses_add_their_sections_to_one_report(tiny_run, tmp_path, capsys):
    """gallery then perclass into one --out: report.md and results.json hold both sections
    (each used to overwrite the other's)."""
    out = tmp_path / "analysis"
    assert analysis.main(["gallery", str(tiny_run), "--out", str(out)]) == 0
    assert analysis.main(["perclass", str(tiny_run), "--out", str(out)]) == 0
    capsys.readouterr()
    report = (out / "report.md").read_text()
    assert "## Gradient-norm gallery" in report and "## Pretext accuracy per class" in report
    assert sorted(json.loads((out / "results.json").read_text())) == ["gallery", "perclass"]


def _drawn_at(saved, x, y, colour, tol=0.06) -> bool:
    """Whether the PNG of ``saved`` ((figure, png) as save_figure got them) has pixels of
    ``colour`` within 4 pixels of the data point (x, y) of its first axes (away from the
    legend, whose sample line has the same colour)."""
    import matplotlib.colors
    import matplotlib.image

    fig, png = saved
    fx, fy = fig.axes[0].transData.transform((x, y)) / (fig.bbox.width, fig.bbox.height)
    img = matplotlib.image.imread(png)[..., :3]
    r, c = int(round((1 - fy) * img.shape[0])), int(round(fx * img.shape[1]))
    near = img[r - 4:r + 5, c - 4:c + 5]
    return bool((np.abs(near - matplotlib.colors.to_rgb(colour)).max(-1) < tol).any())


def _saving(monkeypatch, module) -> dict:
    """{png name: (figure, png)} of every figure ``module.save_figure`` writes from now on."""
    saved, save = {}, module.save_figure
    monkeypatch.setattr(module, "save_figure", lambda fig, png, **k: saved.update(
        {Path(png).name: (fig, png)}) or save(fig, png, **k))
    return saved


def test_a_run_of_one_logged_row_is_drawn(tmp_path, monkeypatch):
    """cmacc.apps.plot of a run that logged one row: its value is on the figure (a marker;
    a line through one point draws nothing), in the run's colour."""
    from cmacc import runlog
    from cmacc.apps import plot

    saved = _saving(monkeypatch, runlog)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text("step,loss\n5,2.5\n")
    assert plot.main([str(run), "--keys", "loss", "--out", str(tmp_path / "c.png")]) == 0
    assert _drawn_at(saved["c.png"], 5, 2.5, "C0")


def test_the_mi_diversity_figure_has_its_own_title_and_draws_one_window_runs(tmp_path,
                                                                             monkeypatch):
    """mi_diversity.png is titled as what it shows (not "training curves"), and a run of one
    window is drawn (a marker), so no legend entry names a method the figure does not show."""
    import importlib

    report = importlib.import_module("cmacc.apps.mi.report")
    one = [{"seed": 0, "unique_per_m": [0.5], "coverage": [0.9], "loss": [1.0], "acc": [0.1]}]
    res = dict(chars=[4], runs={"CM-ACC": {"4": one}}, config=dict(window=10),
               diversity_law={"4": {"unique_per_m": 0.4, "coverage": 0.8}})
    saved = _saving(monkeypatch, report)
    monkeypatch.setattr(report, "report", lambda results: "")  # (the figures only)
    monkeypatch.setattr(report, "_plot", lambda results, png: None)
    report.write_outputs(res, tmp_path)
    assert {png: fig._suptitle.get_text() for png, (fig, _) in saved.items()} == {"mi_curves.png": "training curves, mean over the 1 seed(s) run",
                      "mi_diversity.png": "negative diversity over training, mean over the 1 "
                                          "seed(s) run"}
    assert _drawn_at(saved["mi_diversity.png"], 10, 0.5, report._color("CM-ACC"))
    assert _drawn_at(saved["mi_curves.png"], 10, 1.0, report._color("CM-ACC"))


def test_diversity_says_when_few_classes_saturate_unique_per_m(tiny_prepared, tmp_path):
    """C <= M: every sampler reaches unique/M = C/M, so the analysis says so (log and report),
    with the ceiling and random's expected value; C > M (the default setting) says nothing."""
    _, prepared = tiny_prepared
    with open(prepared / "manifest.csv", newline="") as f:
        c = len({r["label"] for r in csv.DictReader(f)})  # 2 classes, 12 clips
    cfg = analysis.run_config(tmp_path, "random", 1, data=str(prepared / "manifest.csv"))
    m = cfg.model.batch_size
    law = analysis.diversity_law(cfg)
    assert (law["classes"], law["ceiling"]) == (c, c / m) == (2, 0.125)
    assert law["random_law"] is None  # 12 clips < M = 16: no random batch of M to speak of
    assert f"C = 2 classes <= M = {m}" in law["saturated"] and "C/M = 0.125" in law["saturated"]
    # synthetic, 4 uniform classes of 24 clips: random's E[U] = sum_c 1 - C(72, M) / C(96, M)
    syn = analysis.run_config(tmp_path, "random", 1, sections=dict(data=dict(
        classes=4, clips=96, class_dist="uniform")))
    want = 4 * (1 - math.comb(72, m) / math.comb(96, m)) / m
    law = analysis.diversity_law(syn)
    assert law["random_law"] == pytest.approx(want) and f"random's expected: {want:.3f}" in \
        law["saturated"]
    st = dict(M=m, K=64, N=96, tau_p=1.0, grad_view="head", steps=1, seeds=1,
              data="x", saturated=law["saturated"])
    assert f"**Warning: {law['saturated']}.**" in analysis.diversity_report(
        {"setting": st, "table": {}})
    default = analysis.run_config(tmp_path, "random", 1, sections=dict(
        data=analysis.DIVERSITY_DATA))
    assert analysis.diversity_law(default)["saturated"] is None
