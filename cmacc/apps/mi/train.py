"""One training run of the study: its settings (``MIConfig``, the paper's values beside them),
the model of each method, the stop rule and the loop."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from cmacc.config import POOL_MODES, ModelConfig, SelectionConfig
from cmacc.metrics import negative_diversity
from cmacc.model import CMACC
from cmacc.fill import fill_epoch_pools
from cmacc.samplers import in_sorted, selection_seed
from kernels import reference

from .partial import identity as partial_identity, load as load_partial, save as save_partial
from .partial import utc_now
from .data import PAPER_TRAIN_PAIRS, MultiOmniglotPairs
from .nets import SmallCNN, augment

METHODS = {"SMoCo": ("smoco", "random"),  # the curve: (objective, sampler)
           "XMoCo": ("cross", "random"),
           "CM-ACC": ("cross", "active")}
SAMPLERS = {"CM-ACC-feature": ("cross", "active-feature"),  # the samplers the paper compares
            "OHEM": ("cross", "ohem"),  # (Tables 2, 3), beside XMoCo's random and CM-ACC's;
            "pool-random": ("cross", "pool-random")}  # the control: the pool's keys, no selection
ALL_METHODS = {**METHODS, **SAMPLERS}


def selects(method: str) -> bool:
    """Whether a method's runs select from the candidate pool (its sampler is not random); a
    name this version does not know (an older mi.json's) counts as not selecting."""
    return ALL_METHODS.get(method, ("", "random"))[1] != "random"


@dataclass
class MIConfig:
    """One training run of the study. Defaults: the paper's optimiser and method sizes (§4.1,
    App. A), with CPU-sized encoder width, pool and warm-up (``PAPER_CONFIG`` has the paper's
    values; the report lists each departure)."""

    batch: int = 128  # M
    dict_mult: int = 30  # K = dict_mult * M
    pool_mult: int = 60  # N = pool_mult * M, the candidate pool (paper: 300). It must exceed K
    # by far: the sampler chooses from the pool minus the dictionary, ~N - K candidates. 60:
    # ~K candidates for M picks; a selection costs ~40 ms on 2 CPU cores (~80-110 ms at 300:
    # bench/RESULTS.md, "What active sampling costs")
    pool_mode: str = "rolling"  # rolling: the last N key-encoder outputs; epoch (the paper): N
    # random training pairs encoded by the key encoders at each epoch start, an epoch being one
    # pass over the training pairs at batch M (floor(n / M) steps)
    lr: float = 1e-3
    warmup: int = 100  # linear warm-up steps of the learning rate (paper: 500, for 200 epochs)
    tau: float = 0.7
    momentum: float = 0.999
    dim: int = 128
    fcl: bool = False  # the paper's extra FC layer with the cross-modal momentum rule (§3.2)
    fcl_dim: int = 128
    width: int = 16  # channels of the first layer (16, 32, 64, 64; features d_h = 4 * width)
    bn_groups: int = 4  # shuffle-BN: BN statistics per quarter of the batch, keys shuffled
    max_steps: int = 1500
    window: int = 100  # the loss and pretext accuracy are averaged over windows of this many steps
    tol: float = 0.01  # plateau: the window-mean loss falls by < tol nats from the one before ...
    patience: int = 3  # ... this many windows in a row ...
    min_steps: int = 500  # ... counted from this step on (the loss is flat near log(K + 1)
    # before it starts to fall)
    shift: int = 2  # SMoCo's second view: translation (px) and noise
    noise: float = 0.05
    fresh_picks: bool = False  # re-encode the picked candidates by the current key encoders
    # before they are enqueued (a departure: Algorithm 1 enqueues the pool's keys, encoded when
    # the pool was drawn); what the pool's staleness costs, measured
    pool_refresh: int = 0  # R: batches of M pool pairs re-encoded per step by the current key
    # encoders, round robin, so no candidate is older than pool_mult / R steps (the selection
    # then sees the current model)
    tau_p: float = 1.0  # the pseudo-posterior temperature of the gradient embedding: p_n =
    # softmax(k_n . q_j / tau_p) over the batch's M queries (paper eq. 5, Algorithm 1: 1); the
    # main trainer's --tau-p (SelectionConfig.tau_p). It reaches CM-ACC's embedding and OHEM's
    # scores; the other samplers do not read it

    def __post_init__(self):
        if self.pool_refresh < 0:
            raise ValueError(f"pool_refresh must be >= 0, got {self.pool_refresh}")
        if not self.tau_p > 0:
            raise ValueError(f"tau_p must be > 0, got {self.tau_p}")
        for name in ("batch", "dict_mult", "pool_mult", "dim", "width", "max_steps", "window",
                     "patience", "bn_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.pool_mode not in POOL_MODES:
            raise ValueError(f"pool_mode must be one of {POOL_MODES}, got {self.pool_mode!r}")
        if self.min_steps < 0:
            raise ValueError(f"min_steps must be >= 0, got {self.min_steps}")
        if self.batch % self.bn_groups:
            raise ValueError(f"batch {self.batch} must be a multiple of bn_groups {self.bn_groups}")
        if self.lr <= 0 or self.tau <= 0 or not 0 <= self.momentum < 1 or self.warmup < 0:
            raise ValueError("lr and tau must be > 0, momentum in [0, 1), warmup >= 0")

    @property
    def dict_size(self) -> int:
        return self.dict_mult * self.batch


# the paper's values of MIConfig's fields (§4.1, App. A; docs/DESIGN.md §1), for the report's
# departures
PAPER_CONFIG = dict(batch=128, dict_mult=30, pool_mult=300, pool_mode="epoch", lr=1e-3,
                    warmup=500, tau=0.7, momentum=0.999, dim=128, tau_p=1.0)
DEPARTURE_WHY = {
    "pool_mult": ": the CPU cost: at 300 * M the two selections of a step take ~160-240 ms "
                 "on 2 CPU cores (an active step 2-2.7x a random one at l = 3), at 60 * M "
                 "~70 ms. The samplers choose from the pool minus the dictionary, ~N - K "
                 "candidates: 60 * M leaves ~K = 30 M for M picks (paper: ~270 M). At "
                 "N = K + M (31 * M) only ~M are left and the choice is gone: CM-ACC equalled "
                 "XMoCo within 0.02 at every l there",
    "pool_mode": ": the rolling pool holds the key-encoder outputs of the last N / M steps' "
                 "batches; the paper draws N random samples per epoch (--pool-mode epoch)",
    "warmup": ": the paper's warm-up is for 200 epochs of Kinetics; these runs are ~10^3 steps",
    "tau_p": ": the pseudo-posterior temperature of the gradient embedding (--tau-p), "
             "softmax(k . q / tau_p) over the M queries; a sharper posterior than eq. 5's, so "
             "that the uncertainty factor varies across candidates (post_entropy, gnorm_cv and "
             "the D^2 spread in mi.json measure it)",
}
QUICK = dict(batch=32, dict_mult=4, pool_mult=12, warmup=20, min_steps=20, max_steps=60, window=20,
             width=8, dim=32)
PAIRS = dict(train=PAPER_TRAIN_PAIRS, test=2000, probe=10_000)
QUICK_PAIRS = dict(train=4000, test=500, probe=2000)


class ShuffledKeysCMACC(CMACC):
    """CM-ACC whose key encoders see the batch in a random order (MoCo's shuffle-BN in one
    process): with BN statistics per group of the batch (``bn_groups``), a query and its
    positive key are normalised with different samples, so the pretext task cannot be solved
    by recognising the current batch's BN signature (MoCo §3.3; the paper uses shuffling BN in
    all encoders, §4.1). ``distributed.batch_shuffle`` is the identity in one process."""

    @torch.no_grad()
    def encode_keys(self, encoder, x):
        perm = torch.randperm(x.shape[0], device=x.device)
        k, _ = encoder(x[perm])
        return k[torch.argsort(perm)]


def build_model(method: str, cfg: MIConfig, seed: int) -> CMACC:
    torch.manual_seed(seed)
    objective, sampler = ALL_METHODS[method]
    mcfg = ModelConfig(objective=objective, batch_size=cfg.batch, dict_size=cfg.dict_size,
                       dim=cfg.dim, fcl=cfg.fcl, fcl_dim=cfg.fcl_dim, momentum=cfg.momentum,
                       tau=cfg.tau, seed=seed)
    sel = SelectionConfig(sampler=sampler, pool_size=cfg.pool_mult * cfg.batch,
                          pool_mode=cfg.pool_mode, pool_refresh=cfg.pool_refresh,
                          tau_p=cfg.tau_p)
    backbones = (SmallCNN(cfg.width, cfg.bn_groups), SmallCNN(cfg.width, cfg.bn_groups))
    cls = ShuffledKeysCMACC if cfg.bn_groups > 1 else CMACC
    model = cls(mcfg, sel, backbones=backbones)
    return model.to(memory_format=torch.channels_last)


def plateau_step(curve: list[float], tol: float, patience: int) -> int | None:
    """The window (index into ``curve``, a quantity that should grow per window: the negated
    loss in training) at which training stops: the first where each of the last ``patience``
    windows gained < ``tol`` over the one before it; None if there is none."""
    run = 0
    for i in range(1, len(curve)):
        run = run + 1 if curve[i] - curve[i - 1] < tol else 0
        if run >= patience:
            return i
    return None


def loss_plateaued(losses: list[float], cfg: MIConfig) -> bool:
    """Whether training stops after these window-mean losses (one per ``cfg.window`` steps):
    the loss fell by < ``cfg.tol`` nats for ``cfg.patience`` windows in a row, counting only
    the windows that end after ``max(warmup, min_steps)`` (the loss sits near log(K + 1)
    before it starts to fall, which is not a plateau)."""
    first = -(-max(cfg.warmup, cfg.min_steps) // cfg.window)  # windows ending after that step
    return plateau_step([-v for v in losses[first:]], cfg.tol, cfg.patience) is not None


DIVERSITY = ("unique_per_m", "coverage")
KEY_COS_EVERY = 10  # steps between two measurements of the enqueued keys' freshness


def encode_pairs(model: CMACC, pairs: MultiOmniglotPairs, index: torch.Tensor,
                 which: str) -> torch.Tensor:
    """Keys [m, d] of the pairs ``index`` by the current key encoder of ``which`` ("video":
    x, h_v; "audio": y, h_a), as the model encodes a batch's keys."""
    video = which == "video"
    return model.encode_keys(model.h_v if video else model.h_a,
                             pairs.render(index, "x" if video else "y"))


@contextlib.contextmanager
def _measurement(model: CMACC, keys_only: bool = False):
    """A block that measures and leaves the run as it was: the random state (shuffle-BN draws
    a permutation per encoding) and every encoder's BN buffers are restored after it
    (``keys_only``: the key encoders' only, for a block inside a step's forward, where the
    query encoders' buffers are saved for the backward and only the key encoders may run)."""
    encoders = (model.h_v, model.h_a) if keys_only else (model.f_v, model.f_a, model.h_v,
                                                         model.h_a)
    buffers = [b for enc in encoders for b in enc.buffers()]
    saved = [b.clone() for b in buffers]
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        yield
    for b, s in zip(buffers, saved):
        b.copy_(s)


def _cosine_to_fresh(model, pairs, keys, index, which) -> float:
    """The mean cosine between stored keys and the current key encoder's keys of their pairs."""
    fresh = encode_pairs(model, pairs, index, which)
    return float((keys.float() * fresh.float()).sum(1).mean())


def enqueued_key_cosine(model: CMACC, pairs: MultiOmniglotPairs, m: int) -> float:
    """How fresh the keys just enqueued are: the mean cosine between each of the last m keys
    of D_v and D_a and the key of the same pair by the current key encoder (1: encoded now;
    XMoCo's batch keys are encoded in this step, with other BN groups). A measurement only
    (``_measurement``): the run trains as it would without it."""
    with _measurement(model):
        return statistics.fmean(_cosine_to_fresh(model, pairs, *dictionary.last(m), which)
                                for dictionary, which in ((model.dict_v, "video"),
                                                          (model.dict_a, "audio")))


def _mean(values) -> float:
    """The mean of the finite values; NaN if there is none."""
    values = [v for v in values if math.isfinite(v)]
    return statistics.fmean(values) if values else math.nan


def freshness(model: CMACC, pairs: MultiOmniglotPairs, batch: torch.Tensor, step: int) -> dict:
    """What the selection and the pretext task see, measured against the current encoders
    (a measurement only, ``_measurement``).

    pool_cos   the mean cosine between M random pool entries' stored keys (the selection's
               inputs) and the current key encoders' keys of the same pairs; NaN for a
               sampler that does not select, or an empty pool
    acc_stored the pretext accuracy of this batch's queries (current query encoders) against
               their positive (current key encoders) and M random dictionary entries as
               stored (entries of a real pair only)
    acc_fresh  the same queries, positives and entries, the entries re-encoded now: the
               difference to acc_stored is what the entries' age alone makes of the task"""
    m = batch.numel()
    g = torch.Generator().manual_seed(step)
    out = {"pool_cos": math.nan}
    with _measurement(model):
        if model.sel.sampler != "random" and model.pool_v.count:
            out["pool_cos"] = statistics.fmean(
                _cosine_to_fresh(model, pairs, pool.keys[at], pool.index[at], which)
                for pool, which in ((model.pool_v, "video"), (model.pool_a, "audio"))
                for at in [torch.randperm(pool.count, generator=g)[:m]])
        x, y = pairs.batch(batch)
        q = {"video": model.f_v(x)[0].float(), "audio": model.f_a(y)[0].float()}
        pos = {"video": model.encode_keys(model.h_v, x).float(),
               "audio": model.encode_keys(model.h_a, y).float()}
        acc = {"stored": [], "fresh": []}
        for dictionary, which, other in ((model.dict_a, "audio", "video"),
                                         (model.dict_v, "video", "audio")):
            real = (dictionary.index >= 0).nonzero().flatten()  # entries of a real pair
            at = real[torch.randperm(real.numel(), generator=g)[:m]]  # D_which's, of q_other
            if not at.numel():
                continue
            negs = {"stored": dictionary.keys[at].float(),
                    "fresh": encode_pairs(model, pairs, dictionary.index[at], which).float()}
            l_pos = (q[other] * pos[which]).sum(1, keepdim=True)  # [M, 1]
            for k, neg in negs.items():
                logits = torch.cat([l_pos, q[other] @ neg.t()], 1)  # [M, 1 + m']
                acc[k].append(float((logits.argmax(1) == 0).float().mean()))
        for k, v in acc.items():
            out[f"acc_{k}"] = statistics.fmean(v) if v else math.nan
    return out


FRESHNESS = ("pool_cos", "acc_stored", "acc_fresh")

# What CM-ACC's selection sees, every KEY_COS_EVERY steps of a run that selects from a pool
# (``selection_spread``): for CM-ACC the figures of its own picks; for the other pool samplers
# (pool-random, ...) what CM-ACC's embedding would see on that run's pool and queries
SELECTION_DIAG = ("post_entropy", "post_entropy_rel", "post_entropy_rel_tau1", "gnorm_cv",
                  "d2_cv", "d2_max_mean", "d2_cv_8", "d2_max_mean_8")
D2_CENTRES = (1, 8)  # the k-means++ D^2 weights are measured after this many centres


def _spread(x: torch.Tensor) -> tuple[float, float]:
    """(coefficient of variation std/mean, max/mean) of non-negative values (population std);
    NaN for an empty or all-zero x."""
    x = x.double()
    mean = float(x.mean()) if x.numel() else 0.0
    if not mean > 0:
        return math.nan, math.nan
    return float(x.std(unbiased=False)) / mean, float(x.max()) / mean


@torch.no_grad()
def selection_spread(pool_keys: torch.Tensor, queries: torch.Tensor, feats: torch.Tensor,
                     exclude: torch.Tensor, *, tau_p: float, seed: int, view: str = "head",
                     centres=D2_CENTRES) -> dict[str, float]:
    """How much CM-ACC's selection of one dictionary has to go on, over the eligible
    candidates (the pool's n keys [n, d] minus ``exclude`` [n], as ``cmacc.samplers.select``
    excludes them), from the same factors as the selection (``kernels.reference.
    select_factors``: queries [M, d] of the other modality, their features [M, d_h], tau_p):

    post_entropy      the mean over candidates of the entropy (nats) of the pseudo-posterior
                      p_n = softmax(k_n . q_j / tau_p) over the M queries (eq. 5)
    post_entropy_rel  the same / log M (1: every p_n uniform)
    post_entropy_rel_tau1  the same at tau_p = 1 (Algorithm 1's posterior) on the same inputs
    gnorm_cv          the coefficient of variation of |g_n| over candidates: the uncertainty
                      factor (|g_n| = |k_n| |beta_n|, |k_n| = 1); ~0: nearly constant
    d2_cv, d2_max_mean          the D^2 weights of k-means++ after its first centre (the
                      weights of its 2nd draw, over the candidates still available):
                      std/mean and max/mean (0 and 1: a uniform draw)
    d2_cv_8, d2_max_mean_8      the same after 8 centres (the 9th draw's weights)

    The centres are the selection's own first picks (the same seed, the same race)."""
    k = pool_keys.float()
    ok = ~exclude.to(torch.bool)
    m = queries.shape[0]
    logits = k @ queries.float().t()  # [n, M]

    def entropy(tau):  # the mean over the eligible candidates, nats
        logp = torch.log_softmax(logits / tau, dim=1)  # [n, M]
        return float(-(logp.exp() * logp).sum(1)[ok].double().mean())

    ent, log_m = entropy(tau_p), math.log(m) if m > 1 else math.nan
    out = {"post_entropy": ent, "post_entropy_rel": ent / log_m,
           "post_entropy_rel_tau1": (ent if tau_p == 1 else entropy(1.0)) / log_m}
    alpha, beta, beta_c, sqn = reference.select_factors(pool_keys, queries, feats, tau=tau_p,
                                                        view=view)
    bc = beta if beta_c is None else beta_c
    avail = ok & torch.isfinite(sqn)
    out["gnorm_cv"] = _spread(sqn[avail].clamp_min(0).sqrt())[0]
    want = max(centres)
    picks = reference.kmeanspp(alpha, beta, min(want, int(avail.sum())), seed=seed,
                               exclude=~avail, validate=False, beta_c=beta_c, sqn=sqn)
    dmin = torch.full_like(sqn, math.inf)
    for t, c in enumerate(picks.tolist(), start=1):
        d = sqn + sqn[c] - 2.0 * (alpha @ alpha[c]) * (beta @ bc[c])  # [n] d(n, c)
        dmin = torch.minimum(dmin, d.clamp_min(0.0))
        avail[c] = False
        if t in centres:
            cv, mx = _spread(dmin[avail])
            suffix = "" if t == 1 else f"_{t}"
            out[f"d2_cv{suffix}"], out[f"d2_max_mean{suffix}"] = cv, mx
    for t in centres:  # fewer candidates than centres: not measured
        suffix = "" if t == 1 else f"_{t}"
        out.setdefault(f"d2_cv{suffix}", math.nan)
        out.setdefault(f"d2_max_mean{suffix}", math.nan)
    return out


def measure_selections(model: CMACC, every: int) -> tuple[list, list]:
    """Wrap ``model._select`` so that every ``every``-th step (step + 1 divisible by it) each
    dictionary's selection inputs are measured by ``selection_spread`` before the selection
    runs (a measurement only: no random state, no encoder, nothing written; the selection then
    runs as it would). Returns (records, cpu): records gets (step, which, figures), cpu[0] the
    CPU seconds the measurement took."""
    records, cpu = [], [0.0]
    select = model._select

    def measured(pool, dictionary, queries, feats, m, step, which):
        if (step + 1) % every == 0:
            c = time.process_time()
            n = pool.count
            exclude = in_sorted(pool.index[:n], dictionary.index.sort().values)  # U \ D
            if int((~exclude).sum()) < m:  # as the selection does: the exclusion dropped
                exclude = torch.zeros_like(exclude)
            records.append((step, which, selection_spread(
                pool.keys[:n], queries, feats, exclude, tau_p=model.sel.tau_p,
                seed=selection_seed(model.cfg.seed, step, which), view=model.sel.grad_view)))
            cpu[0] += time.process_time() - c
        return select(pool, dictionary, queries, feats, m, step, which)

    model._select = measured
    return records, cpu


# The same queries scored against two pick sets from the same pool at the same step, every
# KEY_COS_EVERY steps of a run that selects (``measure_hardness``): CM-ACC's picks ("active")
# and M uniform picks of the eligible candidates ("uniform", pool-random's draw), each as it
# would be enqueued. Per figure: both sets and their difference (active − uniform, paired
# within the measurement)
HARDNESS = ("acc", "loss", "cos_mean", "cos_max")
HARD_SETS = ("active", "uniform")
HARD_KEYS = tuple(f"hard_{f}_{s}" for f in HARDNESS for s in (*HARD_SETS, "gap"))
HARD_SAMPLER = {"active": "active", "uniform": "pool-random"}


def pick_hardness(queries: torch.Tensor, positives: torch.Tensor, negatives: torch.Tensor,
                  tau: float) -> dict[str, float]:
    """How hard one set of negatives [m, d] is for queries [M, d] whose positives are [M, d]
    (row j: query j's positive), as the loss scores them (``cmacc.model.contrastive_loss``,
    the picks alone as the negatives):

    acc       the fraction of queries whose positive scores above every negative (the pretext
              accuracy; lower: harder)
    loss      the InfoNCE loss, mean over the queries (higher: harder)
    cos_mean  the mean cosine between a query and a negative
    cos_max   the mean over queries of the cosine to its closest negative"""
    q, neg = queries.float(), negatives.float()
    l_neg = q @ neg.t()  # [M, m]
    l_pos = (q * positives.float()).sum(1, keepdim=True)  # [M, 1]
    logits = torch.cat([l_pos, l_neg], 1) / tau
    target = torch.zeros(q.shape[0], dtype=torch.long)
    return {"acc": float((logits.argmax(1) == 0).float().mean()),
            "loss": float(torch.nn.functional.cross_entropy(logits, target)),
            "cos_mean": float(l_neg.mean()), "cos_max": float(l_neg.max(1).values.mean())}


def measure_hardness(model: CMACC, every: int) -> tuple[list, list, Callable[[], None]]:
    """Wrap ``model._select`` so that every ``every``-th step (step + 1 divisible by it), after
    a dictionary's selection, the step's queries (the selection's, of the other modality) are
    scored by ``pick_hardness`` against CM-ACC's picks and against uniform picks from the
    same pool minus the dictionary, each drawn as that sampler would draw it (the same seed)
    and each as it would be enqueued (re-encoded with ``model.reencode``, as the run's own
    picks are, under --fresh-picks); the positives are the batch's keys of the dictionary's
    modality, as the loss's. The run's own sampler's picks are its selection's. The picks are
    drawn at the selection; they are scored by ``score()``, to be called after the step's
    forward, when the batch's keys are known (the key encoders may run after the selection).
    A measurement only: the run trains as it would without it. Returns (records, cpu, score):
    records gets (step, which, figures) with figures[set] = pick_hardness(...), cpu[0] the
    CPU seconds it took."""
    records, cpu, keys, pending = [], [0.0], [None], []
    select, encode = model._select, model._encode_batch_keys

    def encoded(video, audio):  # the batch's keys, the loss's positives: kept for score()
        keys[0] = encode(video, audio)
        return keys[0]

    def measured(pool, dictionary, queries, feats, m, step, which):
        sel = select(pool, dictionary, queries, feats, m, step, which)
        if (step + 1) % every == 0:
            c = time.process_time()
            negatives = {}
            with _measurement(model, keys_only=True):
                for s in HARD_SETS:
                    picks = (sel if HARD_SAMPLER[s] == model.sel.sampler else
                             CMACC._select(model, pool, dictionary, queries, feats, m,
                                           step, which, sampler=HARD_SAMPLER[s]))
                    negatives[s] = (picks.keys if model.reencode is None else
                                    model.reencode(picks.index, "video" if which == 0
                                                   else "audio"))
            pending.append((step, which, queries, negatives))
            cpu[0] += time.process_time() - c
        return sel

    def score():
        if not pending:
            keys[0] = None
            return
        c = time.process_time()
        for step, which, queries, negatives in pending:
            positives = keys[0][2] if which == 0 else keys[0][3]  # k_v_all: D_v's, of q_a
            records.append((step, which, {s: pick_hardness(queries, positives, neg,
                                                           model.cfg.tau)
                                          for s, neg in negatives.items()}))
        pending.clear()
        keys[0] = None
        cpu[0] += time.process_time() - c

    model._select, model._encode_batch_keys = measured, encoded
    return records, cpu, score


def hardness_figures(records: list) -> dict[str, float]:
    """The mean of each HARD_KEYS figure over ``records`` (``measure_hardness``'s), the gap
    being active − uniform per measurement; NaN where there is none."""
    out = {}
    for f in HARDNESS:
        for s in HARD_SETS:
            out[f"hard_{f}_{s}"] = _mean([r[s][f] for _, _, r in records])
        out[f"hard_{f}_gap"] = _mean([r["active"][f] - r["uniform"][f] for _, _, r in records])
    return out


def character_diversity(pairs: MultiOmniglotPairs, index: torch.Tensor) -> dict[str, float]:
    """Diversity of the negatives one step enqueued (``index``: their pair indices), by the
    pairs' real characters, position by position: U_i = distinct characters at position i among
    the M pairs, unique/M = U_i / M and coverage = U_i / min(M, l_i)
    (``cmacc.metrics.negative_diversity``, the video trainer's metric), each the mean over the
    l positions. Per position and not per tuple of l characters: from l = 3 there are more
    tuples than training pairs, so nearly every pair is a class of its own and unique/M of
    tuples is ~1 whatever a sampler does; a position has l_i <= 55 characters, fewer than M,
    and its character is what the probe reads. y's character at a position is a bijection of
    x's, so x's characters count the negatives of both dictionaries."""
    per = [negative_diversity(index, pairs.labels[:, i], size)
           for i, size in enumerate(pairs.sizes)]
    return {k: statistics.fmean(float(d[k]) for d in per) for k in DIVERSITY}


class PairsLoader:
    """The training pairs as the loader ``cmacc.fill.fill_epoch_pools`` reads: ``set_epoch``
    picks the order (a seed), iterating gives whole batches of M pairs ({"video": x,
    "audio": y, "index"}) in that random order, one pass."""

    def __init__(self, pairs: MultiOmniglotPairs, batch: int):
        if len(pairs) < batch:
            raise ValueError(f"{len(pairs)} training pairs are fewer than one batch of {batch}")
        self.pairs, self.batch, self.epoch = pairs, batch, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        perm = torch.randperm(len(self.pairs), generator=torch.Generator().manual_seed(self.epoch))
        for s in range(0, len(perm) - self.batch + 1, self.batch):  # whole batches: BN groups
            idx = perm[s:s + self.batch]
            x, y = self.pairs.batch(idx)
            yield {"video": x, "audio": y, "index": idx}


def train_one(method: str, train: MultiOmniglotPairs, cfg: MIConfig, seed: int, *,
              log=None, partial_path=None) -> tuple[CMACC, dict]:
    """Train to the loss's plateau (or ``cfg.max_steps``). Returns the model and its
    history: pretext accuracy, loss and the enqueued negatives' diversity
    (``character_diversity``, mean of the two dictionaries) per window, that diversity's mean
    over the second half of the steps, steps run, why it stopped, seconds (wall) and
    cpu_seconds (this process's CPU time: the cost on a shared host); with epoch pools
    (an active sampler and ``cfg.pool_mode == "epoch"``) the steps at which they were drawn and
    the time their drawing took (pool_seconds, pool_cpu_seconds; part of the above). Every
    KEY_COS_EVERY steps, per window and over the second half: the keys' freshness
    (``enqueued_key_cosine``, ``freshness``) and, in a run that selects from a pool, what the
    selection sees (``selection_spread``: the posterior's entropy, the spread of the
    uncertainty factor and of the D^2 weights; selection_diag_cpu_seconds, part of
    cpu_seconds) and how hard the step's queries find CM-ACC's picks against uniform picks of
    the same pool (``measure_hardness``: HARD_KEYS; hardness_cpu_seconds, part of
    cpu_seconds). Measurements only: the run trains as it would without them.

    ``partial_path``: the run's state is written there at the end of every window, and a run
    started with a file there continues from it (``cmacc.apps.mi.partial``), bit for bit."""
    model = build_model(method, cfg, seed)
    if cfg.fresh_picks and selects(method):
        model.reencode = lambda index, which: encode_pairs(model, train, index, which)
    opt = torch.optim.Adam(model.query_parameters(), lr=cfg.lr)
    g = torch.Generator().manual_seed(seed)
    n = len(train)
    perm, pos = torch.randperm(n, generator=g), 0
    epoch_pools = selects(method) and cfg.pool_mode == "epoch"
    if cfg.pool_refresh and selects(method):
        model.fetch = lambda index: train.batch(index.cpu())
    hist = {"acc": [], "loss": [], "unique_per_m": [], "coverage": [], "key_cos": [],
            **{k: [] for k in FRESHNESS}, **{k: [] for k in SELECTION_DIAG},
            **{k: [] for k in HARD_KEYS}, "steps": 0,
            "stop": "max_steps",
            **({"pool_draws": [], "pool_seconds": 0.0, "pool_cpu_seconds": 0.0}
               if epoch_pools else {})}
    acc_sum = loss_sum = 0.0
    div = {k: [] for k in DIVERSITY}  # per step
    key_cos = []  # (step, enqueued_key_cosine) every KEY_COS_EVERY steps
    fresh = []  # (step, freshness(...)) every KEY_COS_EVERY steps
    # (step, dictionary, selection_spread(...)) every KEY_COS_EVERY steps, selecting runs only
    spread, spread_cpu = (measure_selections(model, KEY_COS_EVERY) if selects(method)
                          else ([], [0.0]))
    # (step, dictionary, {set: pick_hardness(...)}) every KEY_COS_EVERY steps, selecting runs
    hard, hard_cpu, score_hardness = (measure_hardness(model, KEY_COS_EVERY)
                                      if selects(method) else ([], [0.0], lambda: None))
    ident = partial_identity(method, seed, n, cfg)
    start = 0
    if (state := load_partial(partial_path, ident)) is not None:  # continue where it stopped
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        g.set_state(state["g"])
        torch.set_rng_state(state["rng"])
        start, perm, pos, hist, div = (state[k] for k in ("step", "perm", "pos", "hist", "div"))
        for mine, saved in ((key_cos, "key_cos"), (fresh, "fresh"), (spread, "spread"),
                            (hard, "hard")):
            mine += state[saved]
        spread_cpu[0], hard_cpu[0] = state["spread_cpu"], state["hard_cpu"]
        if log:
            log(f"  {method} continues at step {start} ({partial_path})")
    else:  # the run's own span starts now (its probe's end closes it: the study)
        hist["started_utc"] = utc_now()
    t0 = time.perf_counter() - (state["seconds"] if state else 0.0)
    c0 = time.process_time() - (state["cpu_seconds"] if state else 0.0)
    for step in range(start, cfg.max_steps):
        if pos + cfg.batch > n:  # epochs without replacement
            perm, pos = torch.randperm(n, generator=g), 0
        if epoch_pools and pos == 0:  # an epoch starts: N random pairs through the key encoders
            t, c = time.perf_counter(), time.process_time()
            fill_epoch_pools(model, PairsLoader(train, cfg.batch), "cpu", len(hist["pool_draws"]))
            hist["pool_draws"].append(step)
            hist["pool_seconds"] += time.perf_counter() - t
            hist["pool_cpu_seconds"] += time.process_time() - c
        idx = perm[pos:pos + cfg.batch]
        pos += cfg.batch
        for group in opt.param_groups:
            group["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup) if cfg.warmup else cfg.lr
        x, y = train.batch(idx)
        kw = {}
        if method == "SMoCo":  # unimodal: x vs augmented x (y vs augmented y)
            kw = dict(video2=augment(x, g, shift=cfg.shift, noise=cfg.noise),
                      audio2=augment(y, g, shift=cfg.shift, noise=cfg.noise))
        loss, stats = model(x, y, idx, step=step, **kw)
        score_hardness()  # the picks drawn in the step, against its queries and positives
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        acc_sum += float(stats["acc"])
        loss_sum += float(loss.detach())
        enq = [character_diversity(train, stats[k]) for k in ("enq_index_v", "enq_index_a")]
        for k in DIVERSITY:
            div[k].append((enq[0][k] + enq[1][k]) / 2)
        if method != "SMoCo" and (step + 1) % KEY_COS_EVERY == 0:
            key_cos.append((step, enqueued_key_cosine(model, train, cfg.batch)))
            fresh.append((step, freshness(model, train, idx, step)))
        if (step + 1) % cfg.window == 0:
            hist["acc"].append(acc_sum / cfg.window)
            hist["loss"].append(loss_sum / cfg.window)
            for k in DIVERSITY:
                hist[k].append(statistics.fmean(div[k][-cfg.window:]))
            window = [c for s, c in key_cos if s > step - cfg.window]
            hist["key_cos"].append(statistics.fmean(window) if window else math.nan)
            for k in FRESHNESS:
                hist[k].append(_mean([f[k] for s, f in fresh if s > step - cfg.window]))
            for k in SELECTION_DIAG:  # both dictionaries' measurements in the window
                hist[k].append(_mean([f[k] for s, _, f in spread if s > step - cfg.window]))
            for k, v in hardness_figures([r for r in hard if r[0] > step - cfg.window]).items():
                hist[k].append(v)
            acc_sum = loss_sum = 0.0
            if log:
                log(f"  {method} step {step + 1}: pretext acc {hist['acc'][-1]:.3f} "
                    f"loss {hist['loss'][-1]:.3f} negatives' unique/M "
                    f"{hist['unique_per_m'][-1]:.3f}")
            if loss_plateaued(hist["loss"], cfg):
                hist["stop"] = "plateau"
                hist["steps"] = step + 1
                break
            if partial_path is not None:  # the window is on disk: a stop loses at most one
                save_partial(partial_path, ident, {
                    "step": step + 1, "model": model.state_dict(), "opt": opt.state_dict(),
                    "g": g.get_state(), "rng": torch.get_rng_state(), "perm": perm, "pos": pos,
                    "hist": hist, "div": div, "key_cos": key_cos, "fresh": fresh,
                    "spread": spread, "hard": hard, "spread_cpu": spread_cpu[0],
                    "hard_cpu": hard_cpu[0], "seconds": time.perf_counter() - t0,
                    "cpu_seconds": time.process_time() - c0})
    else:
        hist["steps"] = cfg.max_steps
    for k in DIVERSITY:  # the second half of the steps run: past the pool warm-up
        hist[f"{k}_2nd_half"] = statistics.fmean(div[k][hist["steps"] // 2:])
    late = [c for s, c in key_cos if s >= hist["steps"] // 2]
    hist["key_cos_2nd_half"] = statistics.fmean(late) if late else math.nan
    for k in FRESHNESS:
        hist[f"{k}_2nd_half"] = _mean([f[k] for s, f in fresh if s >= hist["steps"] // 2])
    for k in SELECTION_DIAG:
        hist[f"{k}_2nd_half"] = _mean([f[k] for s, _, f in spread if s >= hist["steps"] // 2])
    hist["selection_diag_cpu_seconds"] = spread_cpu[0]  # a part of cpu_seconds
    for k, v in hardness_figures([r for r in hard if r[0] >= hist["steps"] // 2]).items():
        hist[f"{k}_2nd_half"] = v
    hist["hardness_cpu_seconds"] = hard_cpu[0]  # a part of cpu_seconds
    hist["seconds"] = time.perf_counter() - t0
    hist["cpu_seconds"] = time.process_time() - c0
    return model, hist
