"""The mutual-information study (cmacc.apps.mi): the pairs are built as the protocol says —
checked by decoding every rendered cell of glyphs that carry their own identity (alphabet,
character, drawer) in their pixels; the MI of each l against hand-computed values; the uint8
glyph bank against the PNG bytes it was read from; SMoCo's per-sample translation against a
shifted copy; the plateau rule on hand-made curves (the study itself: tests/test_mi_study.py)."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from PIL import Image

from cmacc.apps import mi


def identity_glyphs(sizes, drawers=20):
    """A Glyphs whose glyph (a, c, d) has pixels (0, 0), (0, 1), (0, 2) = a + 1, c + 1, d + 1."""
    g = object.__new__(mi.Glyphs)
    g.names = [f"A{a}" for a in range(len(sizes))]
    g.bank = []
    for a, n in enumerate(sizes):
        b = torch.zeros(n, drawers, 32, 32, dtype=torch.uint8)
        b[:, :, 0, 0] = a + 1
        b[:, :, 0, 1] = torch.arange(n, dtype=torch.uint8)[:, None] + 1
        b[:, :, 0, 2] = torch.arange(drawers, dtype=torch.uint8)[None, :] + 1
        g.bank.append(b)
    return g


def decode(img, rows, cols):
    """{(row, col): (alphabet, character, drawer)} of one rendered image [1, H, W] (uint8);
    None for an empty cell."""
    out = {}
    for r in range(rows):
        for c in range(cols):
            cell = img[0, r * 32:(r + 1) * 32, c * 32:(c + 1) * 32]
            a, ch, d = (int(v) for v in cell[0, :3])
            out[r, c] = None if a == 0 else (a - 1, ch - 1, d - 1)
    return out


# the grid of l characters, written out by hand: (rows, cols), row-major positions
GRIDS = {1: (1, 1), 2: (2, 1), 3: (2, 2), 4: (2, 2), 5: (3, 2), 6: (3, 2), 7: (3, 3), 8: (3, 3),
         9: (3, 3)}


@pytest.mark.parametrize("l", sorted(GRIDS))
def test_grid_shape(l):
    assert mi.grid_shape(l) == GRIDS[l]


@pytest.mark.parametrize("relation, shift", [("next", 1), ("same", 0)])
@pytest.mark.parametrize("l", [1, 3, 5])
def test_pairs_follow_the_relation_with_another_drawer(relation, shift, l):
    sizes = [7, 5, 4, 3, 3]
    g = identity_glyphs(sizes)
    pairs = mi.MultiOmniglotPairs(g, l, 200, seed=3, drawers=range(0, 14), relation=relation)
    x, y = pairs.images(torch.arange(200))
    rows, cols = GRIDS[l]
    assert x.dtype == torch.uint8 and x.shape == (200, 1, 32 * rows, 32 * cols) == y.shape
    for j in range(200):
        dx, dy = decode(x[j], rows, cols), decode(y[j], rows, cols)
        for i in range(rows * cols):
            cell = divmod(i, cols)
            if i >= l:  # cells beyond l characters stay blank
                assert dx[cell] is None and dy[cell] is None
                continue
            (ax, cx, wx), (ay, cy, wy) = dx[cell], dy[cell]
            assert ax == ay == i  # position i: alphabet i
            assert cx == int(pairs.labels[j, i])
            assert cy == (cx + shift) % sizes[i]  # y's character: x's next, or x's own
            assert wx != wy and 0 <= wx < 14 and 0 <= wy < 14  # another training drawer


def test_held_out_drawers_and_uniform_draws():
    """Test pairs use only drawers 14..19; characters and drawers are uniform (chi-square at
    the 0.1% level, an independent law) and y's drawer is never x's."""
    from scipy import stats

    g = identity_glyphs([6, 4])
    n = 6000
    te = mi.MultiOmniglotPairs(g, 2, n, seed=1, drawers=range(14, 20))
    x, y = te.images(torch.arange(n))
    wx = torch.stack([x[:, 0, 0, 2], x[:, 0, 32, 2]], 1).long() - 1  # [n, 2] drawers per position
    wy = torch.stack([y[:, 0, 0, 2], y[:, 0, 32, 2]], 1).long() - 1
    assert wx.min() >= 14 and wx.max() <= 19 and wy.min() >= 14 and wy.max() <= 19
    assert (wx != wy).all()
    for counts in (torch.bincount(x[:, 0, 0, 1].long() - 1, minlength=6),
                   torch.bincount(wx[:, 0] - 14, minlength=6),
                   torch.bincount(wy[:, 1] - 14, minlength=6)):
        assert stats.chisquare(counts.numpy()).pvalue > 1e-3
    # the same seed builds the same pairs; another seed others
    again = mi.MultiOmniglotPairs(g, 2, n, seed=1, drawers=range(14, 20))
    assert torch.equal(again.images(torch.arange(50))[0], x[:50])
    other = mi.MultiOmniglotPairs(g, 2, n, seed=2, drawers=range(14, 20))
    assert not torch.equal(other.labels, te.labels)


def test_mutual_information_in_nats_per_l():
    """I(x; y) = sum_i log l_i, against products computed by hand: the background set's
    alphabets largest first (47, 42, 40, 26, 24, 24, 22, 17) and the paper's (55, 52, 48, ...;
    its text: e^I = 55, 2,860 and 137,280 for l = 1, 2, 3)."""
    ours = identity_glyphs([47, 42, 40, 26, 24, 24, 22, 17], drawers=4)
    by_hand = {1: 47, 2: 1974, 3: 78960, 4: 2052960, 6: 1182504960, 8: 442256855040}
    for l, product in by_hand.items():
        pairs = mi.MultiOmniglotPairs(ours, l, 4, seed=0, drawers=range(0, 4))
        assert pairs.mutual_information == pytest.approx(math.log(product), rel=1e-12)
    for l, e_mi in {1: 55, 2: 2860, 3: 137280}.items():
        assert mi.mutual_information(mi.PAPER_ALPHABET_SIZES[:l]) == pytest.approx(math.log(e_mi))


def test_glyph_bank_is_the_png_bytes_as_uint8_ink(tmp_path):
    """A 32x32 PNG's grey levels g come back as uint8 ink 255 - g, and as floats (255 - g)/255."""
    base = tmp_path / "omniglot-py" / "images_background" / "Alpha"
    gen = torch.Generator().manual_seed(0)
    grey = {}
    for c in range(2):
        for d in range(3):
            folder = base / f"character{c + 1:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            px = torch.randint(0, 256, (32, 32), generator=gen, dtype=torch.int32)
            Image.fromarray(px.numpy().astype("uint8"), mode="L").save(folder / f"{c}_{d:02d}.png")
            grey[c, d] = px
    g = mi.Glyphs(tmp_path)
    assert g.bank[0].dtype == torch.uint8 and g.bank[0].shape == (2, 3, 32, 32)
    for (c, d), px in grey.items():
        assert torch.equal(g.bank[0][c, d].int(), 255 - px)
    pairs = mi.MultiOmniglotPairs(g, 1, 12, seed=0, drawers=range(0, 3))
    x, _ = pairs.batch(torch.arange(12))
    for j in range(12):
        px = grey[int(pairs.labels[j, 0]), int(pairs.drawer_x[j, 0])]
        assert torch.equal(x[j, 0], (255 - px).float() / 255)


def test_glyphs_take_the_largest_alphabets_whole(tmp_path):
    """The paper's alphabets are Omniglot's largest, all their characters: here 3 alphabets of
    2, 4 and 3 characters, the 2 largest wanted, largest first."""
    base = tmp_path / "omniglot-py" / "images_background"
    for name, n in (("A_small", 2), ("B_large", 4), ("C_mid", 3)):
        for c in range(n):
            (base / name / f"character{c:02d}").mkdir(parents=True)
            for d in range(2):
                Image.new("L", (8, 8), 255 - 40 * c).save(base / name / f"character{c:02d}" / f"{d}.png")
    g = mi.Glyphs(tmp_path, max_alphabets=2)
    assert g.names == ["B_large", "C_mid"] and g.sizes == [4, 3]
    for folder in (tmp_path / "omniglot-py", base):  # --omniglot omniglot-py is taken as well
        assert mi.Glyphs(folder, max_alphabets=2).names == g.names


def test_missing_omniglot_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="torchvision's layout"):
        mi.Glyphs(tmp_path)


def test_an_encoder_renders_only_the_side_it_encodes():
    """A key re-encoding (encode_pairs) and the probe's features render only x or only y (each
    rendered image is a gather of every position's glyph), and encode what pairs.batch gives."""
    pairs = mi.MultiOmniglotPairs(identity_glyphs([7, 5]), 2, 40, seed=3, drawers=range(0, 14))
    model = mi.train.build_model("CM-ACC", mi.MIConfig(**mi.QUICK), seed=0).eval()
    sides, image = [], pairs.image
    pairs.image = lambda idx, side: sides.append(side) or image(idx, side)
    index = torch.arange(8)
    x, y = mi.MultiOmniglotPairs.batch(pairs, index)  # (the reference: both sides rendered)
    sides.clear()
    with torch.no_grad():
        for which, enc, side in (("video", model.h_v, x), ("audio", model.h_a, y)):
            got = mi.train.encode_pairs(model, pairs, index, which)
            assert sides == [{"video": "x", "audio": "y"}[which]]
            torch.testing.assert_close(got, model.encode_keys(enc, side), rtol=0, atol=0)
            sides.clear()
        mi.probe.features(model, pairs, n=8)
        mi.probe.pixel_features(pairs, n=8)
    assert sides == ["x", "x"]


def test_augment_translates_each_sample_by_its_own_shift():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(64, 1, 12, 10, generator=gen)
    out = mi.augment(x, torch.Generator().manual_seed(1), shift=2, noise=0.0)
    pad = torch.nn.functional.pad(x, (2, 2, 2, 2))
    shifts = set()
    for j in range(64):
        found = [(dy, dx) for dy in range(5) for dx in range(5)
                 if torch.equal(out[j, 0], pad[j, 0, dy:dy + 12, dx:dx + 10])]
        assert found  # a translated copy with zero fill
        shifts.add(found[0])
    assert len(shifts) > 10  # per sample, not one shift for the whole batch (25 possible)


@pytest.mark.parametrize("curve, tol, patience, expect", [
    ([0.1, 0.3, 0.5, 0.502, 0.503], 0.005, 2, 4),  # two small gains in a row: stop at window 4
    ([0.1, 0.3, 0.301, 0.4, 0.401], 0.005, 2, None),  # the run of small gains is broken
    ([0.1, 0.3, 0.301, 0.4, 0.401], 0.005, 1, 2),
    ([0.5, 0.4, 0.45], 0.005, 1, 1),  # a drop counts as no gain
])
def test_plateau_rule(curve, tol, patience, expect):
    assert mi.plateau_step(curve, tol, patience) == expect


def test_training_stops_on_a_loss_plateau_after_min_steps():
    """The stop rule on window-mean losses (window 100): a flat start before min_steps is not a
    plateau; after it, patience windows that each fall < tol nats are."""
    cfg = mi.MIConfig(window=100, warmup=100, min_steps=300, tol=0.01, patience=2)
    flat_start = [8.24, 8.24, 8.24]  # windows ending at 100, 200, 300: all before min_steps
    assert not mi.loss_plateaued(flat_start, cfg)
    falling = flat_start + [8.0, 7.5, 7.0]
    assert not mi.loss_plateaued(falling, cfg)
    assert not mi.loss_plateaued(falling + [6.995], cfg)  # one small fall: patience 2
    assert mi.loss_plateaued(falling + [6.995, 6.99], cfg)
    assert mi.loss_plateaued(falling + [6.995, 7.2], cfg)  # a rise is no fall
    # the same losses counted from step 0 would have stopped in the flat start
    assert mi.loss_plateaued(flat_start, mi.MIConfig(window=100, warmup=0, min_steps=0,
                                                     tol=0.01, patience=2))


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
def test_group_batch_norm_is_batch_norm_per_part(fmt):
    """Training mode: each quarter of the batch normalised by its own statistics (F.batch_norm
    on that quarter alone); running statistics the mean over the quarters; eval: plain BN; the
    input's memory format kept (the study's networks run channels-last)."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(16, 3, 5, 4, generator=gen) * 2 + 1).contiguous(memory_format=fmt)
    bn = mi.GroupBatchNorm2d(3, groups=4)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
        bn.bias.copy_(torch.tensor([0.0, -1.0, 3.0]))
    out = bn(x)
    assert out.is_contiguous(memory_format=fmt)
    ref_means, ref_vars = [], []
    for g in range(4):
        part = x[4 * g:4 * g + 4]
        rm, rv = torch.zeros(3), torch.ones(3)
        ref = torch.nn.functional.batch_norm(part, rm, rv, bn.weight, bn.bias, training=True,
                                             momentum=1.0, eps=bn.eps)
        torch.testing.assert_close(out[4 * g:4 * g + 4], ref, rtol=1e-5, atol=1e-5)
        ref_means.append(rm)
        ref_vars.append(rv)
    torch.testing.assert_close(bn.running_mean, 0.1 * torch.stack(ref_means).mean(0))
    torch.testing.assert_close(bn.running_var, 0.9 + 0.1 * torch.stack(ref_vars).mean(0))
    plain = torch.nn.BatchNorm2d(3)
    plain.load_state_dict(bn.state_dict())
    torch.testing.assert_close(bn.eval()(x), plain.eval()(x))
    with pytest.raises(ValueError, match="multiple of the BN groups"):
        bn.train()(x[:10])
    # gradients (float64, autograd through per-part F.batch_norm as the reference)
    bn64 = mi.GroupBatchNorm2d(3, groups=4).double().train()
    xg = x.double().contiguous(memory_format=fmt).requires_grad_()
    w = torch.randn(16, 3, 5, 4, generator=gen, dtype=torch.float64)
    (bn64(xg) * w).sum().backward()
    xr = x.double().requires_grad_()
    weight = bn64.weight.detach().clone().requires_grad_()
    bias = bn64.bias.detach().clone().requires_grad_()
    ref = torch.cat([torch.nn.functional.batch_norm(xr[4 * g:4 * g + 4], None, None, weight, bias,
                                                    training=True, eps=bn64.eps) for g in range(4)])
    (ref * w).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad)
    torch.testing.assert_close(bn64.weight.grad, weight.grad)
    torch.testing.assert_close(bn64.bias.grad, bias.grad)


def test_character_diversity_of_a_known_enqueue():
    """Four pairs of two characters enqueued, counted by hand: position 0 (5 characters) holds
    0, 0, 1, 4 (3 distinct), position 1 (3 characters) 2, 2, 2, 0 (2 distinct); unique/M =
    (3/4 + 2/4) / 2, coverage = (3/min(4, 5) + 2/min(4, 3)) / 2. Pair 5 is not enqueued."""
    pairs = mi.MultiOmniglotPairs(identity_glyphs([5, 3]), 2, 6, seed=0, drawers=range(0, 14))
    pairs.labels = torch.tensor([[0, 2], [0, 2], [1, 2], [4, 0], [3, 1], [2, 1]])
    d = mi.character_diversity(pairs, torch.tensor([0, 1, 2, 3]))
    assert d["unique_per_m"] == pytest.approx((3 / 4 + 2 / 4) / 2)
    assert d["coverage"] == pytest.approx((3 / 4 + 2 / 3) / 2)
    d = mi.character_diversity(pairs, torch.tensor([5, 4, 3, 2, 1, 0]))  # all: 5 and 3 distinct
    assert d["unique_per_m"] == pytest.approx((5 / 6 + 3 / 6) / 2)
    assert d["coverage"] == pytest.approx((5 / 5 + 3 / 3) / 2)


def exact_expected_distinct(labels: torch.Tensor, m: int) -> float:
    """E[distinct values] among m of ``labels`` drawn without replacement: sum over values c of
    1 - C(n - n_c, m) / C(n, m), in exact integers (math.comb)."""
    n = len(labels)
    counts = torch.bincount(labels).tolist()
    return sum(1 - math.comb(n - k, m) / math.comb(n, m) for k in counts if k)


def test_random_sampling_diversity_follows_its_law():
    """XMoCo enqueues its batch, a uniformly random M of the training pairs: its recorded
    unique/M and coverage must match the hypergeometric law of distinct characters per
    position (computed here in exact integers), over all steps and over the second half; the
    study's ``diversity_law`` is that law too. Alphabets of 12, 7 and 40 characters at M = 32
    (40 > M: coverage's ceiling is M there)."""
    sizes = [12, 7, 40]
    pairs = mi.MultiOmniglotPairs(identity_glyphs(sizes), 3, 2000, seed=5, drawers=range(0, 14))
    cfg = mi.MIConfig(**{**mi.QUICK, "min_steps": 60})
    _, hist = mi.train_one("XMoCo", pairs, cfg, seed=0)
    m = cfg.batch
    e = [exact_expected_distinct(pairs.labels[:, i], m) for i in range(3)]
    law = {"unique_per_m": sum(u / m for u in e) / 3,
           "coverage": sum(u / min(m, s) for u, s in zip(e, sizes)) / 3}
    ceiling = (12 + 7 + 32) / 32 / 3  # min(M, l_i) / M: no sampler can pass it
    assert mi.diversity_law(pairs, m) == pytest.approx(
        {**law, "unique_per_m_ceiling": ceiling}, rel=1e-9)
    assert hist["steps"] == 60 and len(hist["unique_per_m"]) == 3  # windows of 20 steps
    # CPU time is recorded beside the wall time: positive, at most the wall time per thread
    assert 0 < hist["cpu_seconds"] <= hist["seconds"] * (torch.get_num_threads() + 1) + 0.5
    for k in ("unique_per_m", "coverage"):
        # per step sd of the mean over 3 positions ~0.03: over 60 steps ~0.004, 30 ~0.006
        assert sum(hist[k]) / 3 == pytest.approx(law[k], abs=0.015)
        assert hist[f"{k}_2nd_half"] == pytest.approx(law[k], abs=0.02)


def test_epoch_pools_are_drawn_at_each_epoch_start_by_the_current_key_encoders():
    """--pool-mode epoch: 256 training pairs at M = 32 make an epoch of 8 steps, so 17 steps
    draw the pools at steps 0, 8 and 16. At each draw the pools hold their pairs' keys from the
    key encoders of that moment (recomputed here, batch by batch, BN statistics per batch as
    the draw had them); between draws nothing else is written to them (no rolling pushes)."""
    pairs = mi.MultiOmniglotPairs(identity_glyphs([12, 7]), 2, 256, seed=1, drawers=range(0, 14))
    cfg = mi.MIConfig(**{**mi.QUICK, "bn_groups": 1, "momentum": 0.5, "max_steps": 17,
                         "min_steps": 17, "pool_mode": "epoch"})
    m, n = cfg.batch, cfg.pool_mult * cfg.batch
    real = mi.train.fill_epoch_pools
    draws = []

    def checking(model, loader, device, epoch):
        if draws:  # untouched since the last draw
            assert torch.equal(model.pool_v.keys, draws[-1][0])
            assert torch.equal(model.pool_a.keys, draws[-1][1])
        real(model, loader, device, epoch)
        idx = model.pool_v.index
        assert model.pool_v.count == model.pool_a.count == n and torch.equal(idx, model.pool_a.index)
        with torch.no_grad():
            xs, ys = zip(*(pairs.batch(idx[s:s + m]) for s in range(0, n, m)))
            ref_v = torch.cat([model.h_v(x)[0] for x in xs])
            ref_a = torch.cat([model.h_a(y)[0] for y in ys])
        torch.testing.assert_close(model.pool_v.keys, ref_v, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.pool_a.keys, ref_a, rtol=1e-5, atol=1e-5)
        draws.append((model.pool_v.keys.clone(), model.pool_a.keys.clone(), idx.clone()))

    mp = pytest.MonkeyPatch()
    mp.setattr(mi.train, "fill_epoch_pools", checking)
    try:
        model, hist = mi.train_one("CM-ACC", pairs, cfg, seed=0)
    finally:
        mp.undo()
    assert hist["pool_draws"] == [0, 8, 16] and len(draws) == 3
    # the draws' time is recorded, a part of the run's
    assert 0 < hist["pool_seconds"] <= hist["seconds"]
    assert 0 < hist["pool_cpu_seconds"] <= hist["cpu_seconds"]
    assert torch.equal(model.pool_v.keys, draws[-1][0])  # the last step wrote nothing there
    assert not torch.equal(draws[0][2], draws[1][2])  # new random pairs each epoch
    # the rolling pool is never drawn
    _, hist = mi.train_one("CM-ACC", pairs, mi.MIConfig(**{**mi.QUICK, "max_steps": 3}), seed=0)
    assert "pool_draws" not in hist
    with pytest.raises(ValueError, match="pool_mode must be one of"):
        mi.MIConfig(pool_mode="weekly")


def trained_alike_measured_or_not(method, pairs, cfg, every=3):
    """The histories of two runs, measured never and every ``every`` steps (KEY_COS_EVERY),
    after asserting that they trained alike: losses, accuracies and weights bit for bit."""
    runs = []
    mp = pytest.MonkeyPatch()
    try:
        for e in (10**9, every):
            mp.setattr(mi.train, "KEY_COS_EVERY", e)
            runs.append(mi.train_one(method, pairs, cfg, seed=0))
    finally:
        mp.undo()
    (m0, h0), (m1, h1) = runs
    assert h0["loss"] == h1["loss"] and h0["acc"] == h1["acc"]
    s0, s1 = m0.state_dict(), m1.state_dict()
    assert all(torch.equal(s0[k], s1[k]) if torch.is_tensor(s0[k]) else s0[k] == s1[k]
               for k in s0)
    return h0, h1


def test_measuring_the_keys_freshness_leaves_the_run_as_it_was():
    """The freshness of the enqueued keys is measured every KEY_COS_EVERY steps by encoding
    pairs again (shuffle-BN draws a permutation each time, and BN buffers move): the run must
    train exactly as without it, losses, accuracies and weights bit for bit."""
    pairs = mi.MultiOmniglotPairs(identity_glyphs([12, 7]), 2, 256, seed=1, drawers=range(0, 14))
    cfg = mi.MIConfig(**{**mi.QUICK, "max_steps": 24, "min_steps": 24, "window": 6,
                         "pool_mode": "epoch"})
    assert cfg.bn_groups > 1  # the shuffled key encoders: the random state is used
    h0, h1 = trained_alike_measured_or_not("CM-ACC", pairs, cfg)
    assert all(math.isnan(c) for c in h0["key_cos"]) and math.isnan(h0["key_cos_2nd_half"])
    assert len(h1["key_cos"]) == 4 and all(-1 <= c <= 1 for c in h1["key_cos"])
    for k in mi.train.FRESHNESS:  # the selection's inputs and the fair pretext accuracy too
        assert all(math.isnan(c) for c in h0[k]) and math.isnan(h0[f"{k}_2nd_half"])
        assert len(h1[k]) == 4 and all(-1 <= c <= 1 for c in h1[k])
    for k in mi.train.SELECTION_DIAG:  # what the selection sees: measured, the run unchanged
        assert all(math.isnan(c) for c in h0[k]) and math.isnan(h0[f"{k}_2nd_half"])
        assert len(h1[k]) == 4 and all(c >= 0 for c in h1[k]) and h1[f"{k}_2nd_half"] >= 0
    assert all(0 < c <= 1 for c in h1["post_entropy_rel"])
    assert all(c >= 1 for c in h1["d2_max_mean"] + h1["d2_max_mean_8"])
    assert h0["selection_diag_cpu_seconds"] == 0 < h1["selection_diag_cpu_seconds"]
    for k in mi.train.HARD_KEYS:  # the picks' hardness: measured, the run unchanged
        assert all(math.isnan(c) for c in h0[k]) and math.isnan(h0[f"{k}_2nd_half"])
        assert len(h1[k]) == 4 and all(math.isfinite(c) for c in h1[k])
    assert all(0 <= c <= 1 for c in h1["hard_acc_active"] + h1["hard_acc_uniform"])
    assert h0["hardness_cpu_seconds"] == 0 < h1["hardness_cpu_seconds"]


def _last_enqueued(model, m):
    """The last m (keys, pair indices) written into D_v and D_a."""
    out = []
    for d in (model.dict_v, model.dict_a):
        pos = (int(d.ptr) - m + torch.arange(m)) % d.size
        out.append((d.keys[pos], d.index[pos]))
    return out


@pytest.mark.parametrize("fresh", [False, True])
def test_fresh_picks_enqueue_the_current_key_encoders_keys(fresh):
    """Algorithm 1 enqueues the picks' keys from the pool, encoded when the pool was drawn;
    --fresh-picks re-encodes them by the current key encoders first. Checked against the key
    encoders run here on the last step's picks (BN over the whole batch: one group) and against
    the pool's own keys; and the recorded freshness: 1 for fresh keys and for XMoCo's batch
    keys, below 1 for the pool's keys once the key encoder has moved (m = 0.5)."""
    # 512 pairs: an epoch of 16 steps, pools drawn at steps 0 and 16, each pair once per pool
    pairs = mi.MultiOmniglotPairs(identity_glyphs([12, 7]), 2, 512, seed=1, drawers=range(0, 14))
    cfg = mi.MIConfig(**{**mi.QUICK, "bn_groups": 1, "momentum": 0.5, "max_steps": 20,
                         "min_steps": 20, "window": 5, "pool_mode": "epoch", "fresh_picks": fresh})
    mp = pytest.MonkeyPatch()
    mp.setattr(mi.train, "KEY_COS_EVERY", 2)
    try:
        model, hist = mi.train_one("CM-ACC", pairs, cfg, seed=0)
        _, xmoco = mi.train_one("XMoCo", pairs, cfg, seed=0)
    finally:
        mp.undo()
    m = cfg.batch
    (kv, iv), (ka, ia) = _last_enqueued(model, m)
    with torch.no_grad():
        ref_v = model.h_v(pairs.batch(iv)[0])[0]
        ref_a = model.h_a(pairs.batch(ia)[1])[0]
    assert torch.equal(model.pool_v.index, model.pool_a.index)
    assert len(set(model.pool_v.index.tolist())) == model.pool_v.count  # no pair twice
    slot = {int(i): s for s, i in enumerate(model.pool_v.index)}
    pool_v = model.pool_v.keys[[slot[int(i)] for i in iv]]
    pool_a = model.pool_a.keys[[slot[int(i)] for i in ia]]
    if fresh:
        torch.testing.assert_close(kv, ref_v, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ka, ref_a, rtol=1e-5, atol=1e-5)
        assert min(hist["key_cos"]) > 1 - 1e-5
    else:
        torch.testing.assert_close(kv, pool_v)
        torch.testing.assert_close(ka, pool_a)
        assert (kv * ref_v).sum(1).mean() < 0.999
        assert hist["key_cos"][-1] < 0.999
    assert min(xmoco["key_cos"]) > 1 - 1e-5  # XMoCo ignores fresh_picks: it has no picks


def test_long_tailed_pairs_follow_the_zipf_law_and_name_their_tail():
    """--char-dist zipf:S: each position's characters follow p_c ∝ 1/(c+1)^S (chi-square
    against the law at the 0.1% level), the MI is the sum of the laws' entropies (by hand), and
    the tail is the rarer half of each alphabet by these pairs' own counts; 'uniform' draws
    exactly the pairs it always drew."""
    from scipy import stats

    g = identity_glyphs([6, 4])
    n = 8000
    pairs = mi.MultiOmniglotPairs(g, 2, n, seed=3, drawers=range(0, 14), char_dist="zipf:1")
    for i, size in enumerate((6, 4)):
        p = np.array([1 / (c + 1) for c in range(size)])
        p /= p.sum()
        counts = torch.bincount(pairs.labels[:, i], minlength=size).numpy()
        assert stats.chisquare(counts, n * p).pvalue > 1e-3
    h = sum(-sum(q * math.log(q) for q in (np.array([1 / (c + 1) for c in range(s)])
                                           / sum(1 / (c + 1) for c in range(s))))
            for s in (6, 4))
    assert pairs.mutual_information == pytest.approx(h, rel=1e-9)
    tail = pairs.tail()
    assert [t.tolist() for t in tail] == [[False] * 3 + [True] * 3, [False] * 2 + [True] * 2]
    flat = mi.MultiOmniglotPairs(g, 2, 100, seed=3, drawers=range(0, 14))
    gen = torch.Generator().manual_seed(3)
    assert torch.equal(flat.labels[:, 0], torch.randint(0, 6, (100,), generator=gen))


def test_the_tail_probe_is_the_probe_on_the_tail_characters_test_pairs():
    """probe_accuracy(..., tail): NAME_tail scores only the test pairs whose character is in
    the tail: with every character in it, it is the whole probe; the tail's and its
    complement's scores, weighted by their test pairs, give the whole probe back (l = 1: one
    position, so no mean over positions in between)."""
    from cmacc.apps.mi.probe import probe_accuracy

    g = identity_glyphs([6])
    tr = mi.MultiOmniglotPairs(g, 1, 600, seed=0, drawers=range(0, 14), char_dist="zipf:1")
    te = mi.MultiOmniglotPairs(g, 1, 300, seed=1, drawers=range(14, 20))
    tests = {"held_out": te}
    every = probe_accuracy(None, tr, tests, 400, [torch.ones(6, dtype=torch.bool)])
    assert every["held_out_tail"] == pytest.approx(every["held_out"])
    (half,) = tr.tail()
    a = probe_accuracy(None, tr, tests, 400, [half])["held_out_tail"]
    b = probe_accuracy(None, tr, tests, 400, [~half])["held_out_tail"]
    share = half[te.labels[:, 0]].double().mean().item()
    assert 0 < share < 1
    assert share * a + (1 - share) * b == pytest.approx(every["held_out"], rel=1e-9)


def _residual64(keys, queries, tau_p):
    """softmax(k_n . q_j / tau_p) - onehot(argmax_j), float64 [n, M], computed here."""
    s = keys.double() @ queries.double().t() / tau_p
    p = torch.softmax(s, 1)
    return p - torch.nn.functional.one_hot(s.argmax(1), s.shape[1]).double()


def test_tau_p_reaches_the_selection(tmp_path):
    """--tau-p goes from the command line into MIConfig and each run's settings, and from there
    into every selection of a CM-ACC run: the temperature the selection is called with is
    --tau-p's, and the embedding's residuals at it are softmax(k . q / tau_p) - onehot,
    recomputed here in float64 from the same inputs (and differ from tau_p = 1's)."""
    from cmacc.apps.mi import cli

    seen = {}
    mp = pytest.MonkeyPatch()
    mp.setattr(cli, "run", lambda *a, **kw: seen.setdefault("cfg", a[3]))
    mp.setattr(cli, "_say_outputs", lambda out: None)
    try:
        assert mi.main(["--make-glyphs", str(tmp_path / "g"), "--quick", "--chars", "1",
                        "--tau-p", "0.05", "--out", str(tmp_path / "o")]) == 0
    finally:
        mp.undo()
    assert seen["cfg"].tau_p == 0.05 and dataclasses.asdict(seen["cfg"])["tau_p"] == 0.05
    assert "tau_p = 0.05 (paper: 1.0)" in " ".join(mi.departures(
        mi.Glyphs(tmp_path / "g"), [1], 100, seen["cfg"], "next", [0]))
    with pytest.raises(ValueError, match="tau_p must be > 0"):
        mi.MIConfig(tau_p=0.0)

    import kernels
    pairs = mi.MultiOmniglotPairs(identity_glyphs([12, 7]), 2, 512, seed=1, drawers=range(0, 14))
    calls = []
    real = kernels.select

    def spy(keys, queries, feats, k, *, tau, n, **kw):
        calls.append((keys[:n].clone(), queries.clone(), feats.clone(), tau))
        return real(keys, queries, feats, k, tau=tau, n=n, **kw)

    cfg = mi.MIConfig(**{**mi.QUICK, "max_steps": 2, "min_steps": 2, "pool_mode": "epoch",
                         "tau_p": 0.1})
    mp.setattr(kernels, "select", spy)
    try:
        model, _ = mi.train_one("CM-ACC", pairs, cfg, seed=0)
    finally:
        mp.undo()
    assert model.sel.tau_p == 0.1 and len(calls) == 4  # 2 steps x 2 dictionaries
    for keys, queries, feats, tau in calls:
        assert tau == 0.1
        r, _ = kernels.grad_embed(keys, queries, feats, tau=tau, view="queries")  # alpha = r
        torch.testing.assert_close(r.double(), _residual64(keys, queries, 0.1),
                                   rtol=1e-4, atol=1e-5)
        r1, _ = kernels.grad_embed(keys, queries, feats, tau=1.0, view="queries")
        assert (r - r1).abs().max() > 0.01  # the temperature changes the residuals


@pytest.mark.parametrize("d_h", [4, 10])  # d_h <= M (beta = r H / tau), > M (Gram route)
@pytest.mark.parametrize("tau_p", [1.0, 0.1])
def test_selection_spread_against_float64(d_h, tau_p):
    """The posterior's entropy, the uncertainty factor's spread and the D^2 weights' spread of
    ``selection_spread`` against the same figures computed here in float64 from materialised
    embeddings g_n = k_n (x) (r_n H) / tau_p, with the centres the selection's own first picks
    (``kernels.select``, same seed and exclusion)."""
    import kernels
    torch.manual_seed(0)
    n, m, d = 60, 6, 5
    keys = torch.nn.functional.normalize(torch.randn(n, d), dim=1)
    queries = torch.nn.functional.normalize(torch.randn(m, d), dim=1)
    feats = torch.randn(m, d_h)
    exclude = torch.zeros(n, dtype=torch.bool)
    exclude[::7] = True
    got = mi.train.selection_spread(keys, queries, feats, exclude, tau_p=tau_p, seed=3)

    ok = ~exclude
    logits = keys.double() @ queries.double().t() / tau_p
    p = torch.softmax(logits, 1)
    ent = -(p * p.log()).sum(1)[ok]
    assert got["post_entropy"] == pytest.approx(float(ent.mean()), rel=1e-5)
    assert got["post_entropy_rel"] == pytest.approx(float(ent.mean()) / math.log(m), rel=1e-5)
    p1 = torch.softmax(keys.double() @ queries.double().t(), 1)
    ent1 = -(p1 * p1.log()).sum(1)[ok]
    assert got["post_entropy_rel_tau1"] == pytest.approx(float(ent1.mean()) / math.log(m),
                                                         rel=1e-5)
    r = _residual64(keys, queries, tau_p)
    g = (keys.double()[:, :, None] * ((r @ feats.double()) / tau_p)[:, None, :]).flatten(1)
    gn = g.norm(dim=1)[ok]
    assert got["gnorm_cv"] == pytest.approx(float(gn.std(unbiased=False) / gn.mean()), rel=1e-4)
    picks = kernels.select(keys, queries, feats, 9, seed=3, tau=tau_p, exclude=exclude).tolist()
    for t, suffix in ((1, ""), (8, "_8")):
        dist = torch.cdist(g, g[picks[:t]]).pow(2).min(1).values  # D^2 after t centres
        avail = ok.clone()
        avail[picks[:t]] = False
        w = dist[avail]
        assert got[f"d2_cv{suffix}"] == pytest.approx(float(w.std(unbiased=False) / w.mean()),
                                                      rel=1e-3)
        assert got[f"d2_max_mean{suffix}"] == pytest.approx(float(w.max() / w.mean()), rel=1e-3)


