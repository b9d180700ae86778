"""One dictionary's active selection at pool capacity: gradient embedding + k-means++ seeding
(docs/DESIGN.md §1 steps 1-5) over buffers shaped by the pool's CAPACITY, replayed from one CUDA graph.

A ``SelectPlan`` is built once per (capacity, M, d, d_h, k, view, tau, precision, factor dtype,
variant, device, keys buffer) and owns every buffer of the hot path:

    inputs   keys [cap, d] (the caller's pool buffer itself when bound: no copy), queries [M, d],
             feats [M, d_h], exclude [cap], n [1] (valid rows), seed [1]
    factors  alpha [cap, a], beta / beta_c [cap, b], sqn [cap]   (written by the embedding kernel)
    seeding  D [cap], picks [k], partials [2, P (+ P2)], barrier [1]; the lazy race also seen
             [cap + 1] and thr [1]; the resident variant best [k] (its rounds' race keys)

``variant="resident"`` (issue 48) holds the factors on chip for all k rounds (one cooperative
launch, kernels/triton_resident.py; its per-round twin under the interpreter) where the pool
fits (``resident_fits``); a plan whose pool does not fit runs the per-step variant
(``plan.variant`` says which runs).

A call writes the small inputs (queries, feats, exclude; fill kernels for n and seed), replays
the graph and returns the picks: no allocation, no host synchronisation, no copy of the pool or
of the factors. A pool that grows (rolling pool warm-up) or shrinks runs in the same graph: rows
n <= i < cap are masked, so a whole run costs one capture per dictionary shape. The head view
takes the Gram route when d_h > M (G = H H^T computed in the graph, no QR; see
kernels/reference.py ``select_factors``), so beta has M columns instead of d_h.

Without CUDA (the interpreter) the plan runs the same launches eagerly; ``captures`` counts the
graphs captured (0 there). Plans are cached (``plan_for``), at most ``MAX_PLANS``, least
recently used first out.
"""

from __future__ import annotations

import collections
import os

import torch

from . import reference
from . import triton_grad_embed as ge
from .select_pool import dictionary_exclusion
from . import triton_kmeanspp as km
from . import triton_resident as rs

__all__ = ["SelectPlan", "plan_for", "select_triton", "select_pool_triton", "clear_plans",
           "resident_fits", "auto_variant",
           "FACTOR_DTYPES", "MAX_PLANS", "CAPTURE_PRIORITY", "INTERPRETED"]

INTERPRETED = ge.INTERPRETED
FACTOR_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MAX_PLANS = 8
MIN_CAPACITY = 1024  # unbound calls round the pool up to a power of two >= this
# the CUDA stream priority that plans capture their graphs at, and so replay at (lower is
# higher; torch clamps to the device's range). Plans built after a change use it: clear_plans()
CAPTURE_PRIORITY = -1


class SelectPlan:
    def __init__(self, capacity, m, d, dh, k, *, view, tau, precision, factors, variant,
                 device, keys_dtype=torch.float32, keys_buffer=None, graph=None, pool=None):
        if view not in reference.VIEWS:
            raise ValueError(f"select: view={view!r} is not one of {reference.VIEWS}")
        if factors not in FACTOR_DTYPES:
            raise ValueError(f"select: factors={factors!r} is not one of {tuple(FACTOR_DTYPES)}")
        ge.check_m(m)
        if not 1 <= k <= capacity:
            raise ValueError(f"select: k={k} must be in [1, capacity={capacity}]")
        dev = torch.device(device)
        if variant == "auto":  # the one measured fastest here (plan_for resolves it first)
            variant = _auto(capacity, m, d, dh, view, factors, dev)
        self.capacity, self.m, self.k, self.view, self.tau = capacity, m, k, view, float(tau)
        self.precision, self.variant, self.device = ge.precision_of(precision), variant, dev
        head = view == "head"
        self.gram = head and dh > m and m <= ge.GRAM_MAX_M
        fdt = FACTOR_DTYPES[factors]
        a = d if head else m
        b = (m if self.gram else dh) if head else d
        if variant == "resident" and rs.resident_config(capacity, a, b, fdt,
                                                        _sms(dev)) is None:
            self.variant = "steps"  # the pool does not fit on chip: today's default variant
        f32 = dict(device=dev, dtype=torch.float32)
        if keys_buffer is not None:
            if keys_buffer.shape != (capacity, d) or keys_buffer.stride(1) != 1:
                raise ValueError(f"select: the bound keys buffer must be [capacity={capacity}, "
                                 f"d={d}] with unit column stride; got {tuple(keys_buffer.shape)}")
            self.keys = keys_buffer  # [cap, d] the caller's pool storage, read in place
        else:
            self.keys = torch.zeros(capacity, d, device=dev, dtype=keys_dtype)  # [cap, d]
        self.bound = keys_buffer is not None
        self.queries = torch.zeros(m, d, **f32)  # [M, d]
        self.feats = torch.zeros(m, dh, **f32)  # [M, d_h]
        self.f = torch.zeros(m, m, **f32) if self.gram else self.feats  # G [M, M] or H
        self.exclude = torch.zeros(capacity, device=dev, dtype=torch.uint8)  # [cap]
        self.n = torch.zeros(1, device=dev, dtype=torch.int32)
        self.seed = torch.zeros(1, device=dev, dtype=torch.int64)
        # the resident variant reads bf16 factors as 32-bit words: rows padded to an even width
        # with a zero column (the embedding writes the first a / b columns only)
        pad = 1 if self.variant == "resident" and fdt == torch.bfloat16 else 0
        self.alpha = torch.zeros(capacity, a + (a & pad), device=dev, dtype=fdt)[:, :a]
        self.beta = torch.zeros(capacity, b + (b & pad), device=dev, dtype=fdt)[:, :b]
        self.beta_c = (torch.zeros(capacity, b + (b & pad), device=dev, dtype=fdt)[:, :b]
                       if self.gram else None)  # [cap, a], [cap, b], [cap, b]
        self.sqn = torch.zeros(capacity, **f32)  # [cap] |g_n|^2
        self.dmin = torch.zeros(capacity, **f32)  # [cap]
        self.picks = torch.zeros(k, device=dev, dtype=torch.int64)  # [k]
        self.cfg = km.seeding_config(capacity, a, b, self.variant, device=dev,
                                     sms=_sms(dev) if self.variant == "resident" else None,
                                     factors=fdt)
        parts = self.cfg["partials"]  # [2, P] ping-pong (+ [2, P2] on two-level grids)
        self.part_score = torch.zeros(parts, **f32)
        self.part_idx = torch.zeros(parts, device=dev, dtype=torch.int32)
        self.bar = torch.zeros(1, device=dev, dtype=torch.int32)
        lazy = self.variant == "lazy"
        self.seen = torch.zeros(capacity + 1, device=dev, dtype=torch.int32) if lazy else None
        self.thr = torch.zeros(1, **f32) if lazy else None
        self.best = (torch.zeros(k, device=dev, dtype=torch.int64)  # [k] the rounds' race keys
                     if self.variant == "resident" else None)
        self._bind_pool(pool)
        self.graph, self.captures, self.replays, self.copies = None, 0, 0, 0
        # compile, autotune and warm up outside any capture, over k valid rows (zeros until
        # the first run): with no valid row the race variants draw no index (2^31 - 1), which
        # a pool-bound plan's gathers would read out of range; with every row, the lazy race
        # meets all-equal distances (its slowest case: minutes in the Triton interpreter)
        self.n.fill_(k)
        self._launch()
        if graph if graph is not None else (dev.type == "cuda"
                                            and os.environ.get("CMACC_GRAPH", "1") == "1"):
            self._capture()

    def _bind_pool(self, pool):
        """``pool`` = (pool_index [cap], dict_index [K]): the pool's and the dictionary's index
        buffers, read in place, so that the exclusion U \\ D and the gathers of what is enqueued
        run in the plan (``run_pool``); None: the caller passes the exclusion (``run``)."""
        self.pool_index = self.dict_index = None
        if pool is None:
            return
        if not self.bound:
            raise ValueError("select: a plan that reads the pool's index reads its keys in place "
                             "too (build it with the pool's keys buffer)")
        self.pool_index, self.dict_index = pool
        if self.pool_index.shape != (self.capacity,):
            raise ValueError(f"select: the pool's index buffer must be [capacity="
                             f"{self.capacity}], got {tuple(self.pool_index.shape)}")
        dev = self.device
        self.rows = torch.arange(self.capacity, device=dev, dtype=torch.int32)  # [cap]
        self.out_keys = torch.zeros(self.k, self.keys.shape[1], device=dev,
                                    dtype=self.keys.dtype)  # [k, d]
        self.out_index = torch.zeros(self.k, device=dev, dtype=self.pool_index.dtype)  # [k]
        self.out_gnorm = torch.zeros((), device=dev)
        self.out_fallback = torch.zeros((), device=dev)

    def _pool_extras_before(self):
        """U \\ D over the valid rows, written into ``exclude`` (dropped if fewer than k)."""
        exclude, too_few = dictionary_exclusion(self.pool_index, self.dict_index,
                                                self.rows < self.n, self.k)
        self.exclude.copy_(exclude)
        self.out_fallback.copy_(too_few)

    def _pool_extras_after(self):
        """What is enqueued: the picks' keys and indices, and their mean |g| = sqrt(|g_n|^2)."""
        torch.index_select(self.keys, 0, self.picks, out=self.out_keys)
        torch.index_select(self.pool_index, 0, self.picks, out=self.out_index)
        torch.mean(self.sqn.index_select(0, self.picks).sqrt(), dim=0, out=self.out_gnorm)

    def _launch(self):
        """Every launch of one selection, on the current stream, from the plan's buffers."""
        if self.pool_index is not None:
            self._pool_extras_before()
        if self.gram:
            torch.mm(self.feats, self.feats.t(), out=self.f)  # G = H H^T [M, M]
        ge.embed_into(self.keys, self.queries, self.f, self.alpha, self.beta, self.beta_c,
                      self.sqn, self.n, tau=self.tau, view=self.view, gram=self.gram,
                      precision=self.precision)
        bc = self.beta if self.beta_c is None else self.beta_c
        km.launch_seeding(self.alpha, self.beta, bc, self.sqn, self.dmin, self.exclude, self.n,
                          self.picks, self.seed, self.part_score, self.part_idx, self.bar,
                          self.k, self.cfg, self.variant, self.seen, self.thr, self.best)
        if self.pool_index is not None:
            self._pool_extras_after()

    def _capture(self):
        torch.cuda.synchronize(self.device)  # once per plan, at capture time only
        graph = torch.cuda.CUDAGraph()
        # captured on a high-priority stream: a replay runs each node at the priority it was
        # captured with, so the selection's kernels go before the key encoders' queued ones
        stream = torch.cuda.Stream(device=self.device, priority=CAPTURE_PRIORITY)
        try:
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                self._launch()
        except RuntimeError as e:  # a capture that failed leaves the allocator mid-capture:
            raise RuntimeError(  # not safe to go on in this process
                f"select: the selection plan's CUDA graph capture failed ({str(e)[:300]}); run "
                "with CMACC_GRAPH=0 (the same launches, eagerly, the same picks) and report "
                "this torch version") from e
        self.graph, self.captures = graph, self.captures + 1

    def _set_inputs(self, n: int, queries, feats, seed: int) -> None:
        if not self.k <= n <= self.capacity:
            raise ValueError(f"select: n={n} valid candidates must be in [k={self.k}, "
                             f"capacity={self.capacity}]")
        self.queries.copy_(queries)
        if feats is not None and self.view == "head":
            self.feats.copy_(feats)
        self.n.fill_(n)
        self.seed.fill_(reference.seed32(seed))

    def _replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            self.replays += 1
        else:
            self._launch()

    @torch.no_grad()
    def run_pool(self, n: int, queries, feats, seed: int):
        """The whole selection from the bound pool (``pool``): (keys [k, d], index [k], gnorm [],
        fallback []) of the picks among the first n rows not in the dictionary. The index is a
        copy (it outlives the step in the caller's statistics); keys, gnorm and fallback are the
        plan's buffers, valid until its next run (the caller enqueues and reduces them first)."""
        if self.pool_index is None:
            raise ValueError("select: run_pool needs a plan built with the pool's index buffers")
        self._set_inputs(n, queries, feats, seed)
        self._replay()
        return self.out_keys, self.out_index.clone(), self.out_gnorm, self.out_fallback

    @torch.no_grad()
    def run(self, keys, n: int, queries, feats, exclude, seed: int) -> torch.Tensor:
        """Picks (long [k], indices < n) from the first n rows of ``keys``. ``keys`` is the bound
        buffer (read in place) or any [>= n, d] tensor (its first n rows are copied in, counted
        in ``copies``). ``exclude``: bool [>= n] or None. ``feats`` may be None in the queries
        view."""
        if self.pool_index is not None:
            raise ValueError("select: this plan computes its exclusion from the pool: call "
                             "run_pool")
        if self.bound:
            if keys.data_ptr() != self.keys.data_ptr():
                raise ValueError("select: this plan reads the pool buffer it was built with; "
                                 "pass that buffer (or build an unbound plan)")
        else:
            self.keys[:n].copy_(keys[:n])
            self.copies += 1
        self._set_inputs(n, queries, feats, seed)
        if exclude is None:
            self.exclude.zero_()
        else:
            self.exclude[:n].copy_(exclude[:n])
        self._replay()
        return self.picks.clone()


def _sms(device) -> int:
    """The resident variant's program count: the device's SMs (the interpreter: a few)."""
    device = torch.device(device)
    if device.type != "cuda":
        return rs.INTERPRETED_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def resident_fits(capacity: int, m: int, d: int, dh: int | None = None, *, view: str = "head",
                  factors: str = "bf16", sms: int | None = None, device=None) -> bool:
    """Whether ``variant="resident"`` holds this pool on chip: ``capacity`` candidates of the
    selection's factors (M pseudo-labels, key dim d, feature dim d_h; the head view's Gram
    route when d_h > M) in ``factors`` storage, over ``sms`` programs (default: the device's
    SMs). The budget is the register file, not shared memory: Triton keeps the resident rows
    in registers, rs.RESIDENT_WORDS 32-bit words a program (one program per SM). A plan whose
    pool does not fit runs the per-step variant instead."""
    head = view == "head"
    gram = head and dh is not None and dh > m and m <= ge.GRAM_MAX_M
    a = d if head else m
    b = (m if gram else dh) if head else d
    if sms is None:
        sms = _sms(device if device is not None else
                   ("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"))
    return rs.resident_config(capacity, a, b, FACTOR_DTYPES[factors], sms) is not None


def _auto(capacity, m, d, dh, view, factors, device) -> str:
    """auto_variant for a plan of these sizes (whether its pool fits on chip, if it matters)."""
    fit = (factors == "bf16" and torch.device(device).type == "cuda"
           and resident_fits(capacity, m, d, dh, view=view, factors=factors, device=device))
    return auto_variant(capacity, device, factors=factors, resident_fit=fit)


_PLANS: collections.OrderedDict = collections.OrderedDict()


def _drop(plan: SelectPlan) -> None:
    """Free a plan only after the device has finished with it: a graph replay still running
    would otherwise read and write buffers the allocator may hand out again (graph teardown does
    not synchronise). Eviction is rare (at most MAX_PLANS live plans), so the wait is cheap."""
    if plan.device.type == "cuda":
        torch.cuda.synchronize(plan.device)


def clear_plans() -> None:
    while _PLANS:
        _drop(_PLANS.popitem(last=False)[1])


# The k-means++ variant a plan runs for variant "auto" (the trainer's default): the one measured
# fastest on that device at the pool's capacity and factor storage; all variants draw the same
# picks, so the choice changes time only. Measured on an H200 (bench/RESULTS.md, one
# dictionary, k = M = 128, a bound plan replayed from its graph):
# - fp32 factors: the lazy race is ahead of the per-step variant from N = 38,400 (1.60 against
#   2.65 ms, 2026-11-28; 3.0-3.3x at 153,600 and 1.5x at M = 512 and 4,096 with N = 300 M,
#   2026-11-27) and behind it at 9,600 (1.35 against 0.93 ms);
# - bf16 factors at N = 38,400 (2026-11-28): resident 0.94 ms, per-step 1.48, lazy 1.62,
#   persistent 1.75: the resident variant where the pool fits on chip, else the fp32 rule.
# Device names not listed (an H100: not measured yet) run the per-step variant, as before;
# bench/gpu_session.py's select part measures every variant on the card it is given.
LAZY_FROM = {"H200": 38_400}  # device name contains key -> the lazy race from this capacity on
RESIDENT_FROM = {"H200": 38_400}  # ... -> bf16 factors: resident from this capacity, if it fits


def auto_variant(capacity: int, device, *, factors: str = "fp32",
                 resident_fit: bool = False) -> str:
    """``variant="auto"``: with bf16 factors, "resident" where it was measured fastest on this
    device for pools of this capacity (``RESIDENT_FROM``) and ``resident_fit`` (the pool fits
    on chip: ``resident_fits``); else "lazy" where the lazy race was measured faster
    (``LAZY_FROM``); else "steps" (unmeasured devices, the CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "steps"
    name = torch.cuda.get_device_name(device)
    if factors == "bf16" and resident_fit:
        for model, from_n in RESIDENT_FROM.items():
            if model in name and capacity >= from_n:
                return "resident"
    for model, from_n in LAZY_FROM.items():
        if model in name and capacity >= from_n:
            return "lazy"
    return "steps"


def _capacity_for(n: int) -> int:
    cap = MIN_CAPACITY
    while cap < n:
        cap *= 2
    return cap


def plan_for(keys, queries, feats, k, *, n=None, tau=1.0, view="head", precision=None,
             factors="fp32", variant="steps", pool=None) -> SelectPlan:
    """The cached plan for this call. ``n`` given: ``keys`` is a capacity buffer [cap, d] read in
    place (bound). ``n`` None: ``keys`` [N, d] is copied into a plan of capacity rounded up to a
    power of two (>= MIN_CAPACITY), so varying N costs a bounded number of plans. ``variant``
    "auto": the one measured fastest on this device for this capacity (``auto_variant``).
    ``pool`` (pool_index, dict_index): the index buffers a ``run_pool`` plan reads in place."""
    reference._check_grad_embed_args(keys, queries, feats, tau, view)
    cap = keys.shape[0] if n is not None else _capacity_for(keys.shape[0])
    m, d = queries.shape
    dh = feats.shape[1] if (view == "head") else d
    if variant == "auto":
        variant = _auto(cap, m, d, dh, view, factors, keys.device)
    bound = keys if n is not None else None
    key = (cap, m, d, dh, k, view, float(tau), ge.precision_of(precision), factors, variant,
           str(keys.device), keys.dtype, None if bound is None else bound.data_ptr(),
           None if pool is None else tuple(t.data_ptr() for t in pool))
    plan = _PLANS.get(key)
    if plan is None:
        plan = SelectPlan(cap, m, d, dh, k, view=view, tau=tau, precision=precision,
                          factors=factors, variant=variant, device=keys.device,
                          keys_dtype=keys.dtype, keys_buffer=bound, pool=pool)
        _PLANS[key] = plan
        while len(_PLANS) > MAX_PLANS:
            _drop(_PLANS.popitem(last=False)[1])
    _PLANS.move_to_end(key)
    return plan


def select_pool_triton(pool_keys, pool_index, dict_index, queries, feats, m, *, seed, n,
                       tau=1.0, view="head", precision=None, factors="fp32", variant="steps"):
    """kernels.select_from_pool on the Triton path: one plan bound to the pool's keys and
    index and to the dictionary's index buffers; the exclusion, the embedding, the k-means++
    seeding and the gathers of what is enqueued replay from its one CUDA graph."""
    plan = plan_for(pool_keys, queries, feats, m, n=n, tau=tau, view=view, precision=precision,
                    factors=factors, variant=variant, pool=(pool_index, dict_index))
    return plan.run_pool(n, queries, feats, seed)


def select_triton(keys, queries, feats, k, *, seed, n=None, tau=1.0, view="head",
                  exclude=None, validate=True, precision=None, factors="fp32", variant="steps"):
    """kernels.select on the Triton path: long [k] indices into the first n rows of ``keys``
    (n = keys.shape[0] when not given). ``validate=True`` checks the request first (one host
    sync: eligible count) and, after, that non-finite embeddings left enough candidates (a
    second sync); the hot path passes validate=False."""
    n_valid = keys.shape[0] if n is None else int(n)
    if validate:
        excl = None if exclude is None else exclude[:n_valid]
        reference._check_kmeanspp_args(n_valid, k, excl, keys.device, True)
    plan = plan_for(keys, queries, feats, k, n=n, tau=tau, view=view, precision=precision,
                    factors=factors, variant=variant)
    picks = plan.run(keys, n_valid, queries, feats, exclude, seed)
    if validate:  # non-finite embeddings are known only now
        reference._check_kmeanspp_args(n_valid, k, plan.exclude[:n_valid] != 0, keys.device,
                                       True, nonfinite=~torch.isfinite(plan.sqn[:n_valid]))
    return picks
