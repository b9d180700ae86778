"""Analyses and the mutual-information study: plots and reports are written; the MultiOmniglot
pairs are built as specified (same characters, different drawers, disjoint train/test hands)."""

import json
import math

import pytest
import torch

from cmacc.apps import analysis, mi


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


def test_diversity_command_compares_samplers(tmp_path):
    res = analysis.diversity(tmp_path, steps=10, samplers=("random", "active"))
    assert set(res["runs"]) == {"random", "active"}
    assert (tmp_path / "diversity.png").exists()
    for r in res["runs"].values():
        assert 0 < r["unique_per_m_last"] <= r["coverage_last"] <= 1 and 0 <= r["probe_video"] <= 1


@pytest.fixture(scope="module")
def glyphs(tmp_path_factory):
    root = mi.make_glyphs(tmp_path_factory.mktemp("omni"), alphabets=3, chars=5, drawers=20)
    return mi.Glyphs(root)


def test_multiomniglot_pairs_same_characters_other_drawers(glyphs):
    pairs = mi.MultiOmniglotPairs(glyphs, 3, 20, seed=0, drawers=slice(0, 14))
    assert pairs.x.shape == (20, 1, 64, 64)  # 3 characters in a 2x2 grid of 32x32 cells
    assert pairs.mutual_information == pytest.approx(3 * math.log(5))
    for j in range(20):
        for i in range(3):
            r, c = divmod(i, 2)
            cell = lambda t: t[j, 0, r * 32:(r + 1) * 32, c * 32:(c + 1) * 32]  # noqa: E731
            stack = glyphs.alphabets[i][int(pairs.labels[j, i])][:14]
            dx = [k for k in range(14) if torch.equal(stack[k], cell(pairs.x))]
            dy = [k for k in range(14) if torch.equal(stack[k], cell(pairs.y))]
            assert dx and dy and set(dx).isdisjoint(dy)  # same character, another person


def test_mi_run_writes_plot(glyphs, tmp_path):
    res = mi.run(glyphs_root(glyphs, tmp_path), tmp_path / "mi", chars=(1, 2), steps=4, batch=8,
                 n_train=64, n_test=32, methods=("XMoCo", "CM-ACC"))
    assert res["chars"] == [1, 2] and len(res["CM-ACC"]) == 2
    assert (tmp_path / "mi" / "mi.png").exists()
    assert json.loads((tmp_path / "mi" / "mi.json").read_text())["mi"][1] > res["mi"][0]


def glyphs_root(_, tmp_path):
    return mi.make_glyphs(tmp_path / "g", alphabets=2, chars=4, drawers=20)


def test_missing_omniglot_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="torchvision's layout"):
        mi.Glyphs(tmp_path)
