"""Active-selection ops, dispatched at call time to the Triton kernels or the PyTorch reference.

Gradient embedding (docs/DESIGN.md §1 steps 1-3) and k-means++ seeding (steps 4-5):

    CMACC_KERNELS=auto       (default) Triton for CUDA tensors; on CPU tensors the reference's
                             factors with the lazy k-means++ race (kernels/lazy_kmeanspp.py:
                             the reference's picks, a few candidates touched per step) for
                             pools of >= _LAZY_FROM_FLOATS factor floats, the reference's loop
                             for smaller ones; the PyTorch reference on other devices
    CMACC_KERNELS=reference  always the PyTorch reference (kernels/reference.py): on CPU its
                             k-means++ passes over the whole pool at every step
    CMACC_KERNELS=triton     always Triton (on CPU tensors only under TRITON_INTERPRET=1)

The Triton ops live in kernels/triton_grad_embed.py and kernels/triton_kmeanspp.py and are
imported on the first call that needs them (``import kernels`` defines no Triton kernel and
touches no CUDA). Triton decides between its interpreter and its compiler when a kernel is
defined, i.e. at that first import: set TRITON_INTERPRET=1 before it to run on CPU tensors.
``triton_status()`` says whether the Triton ops can run and, if not, why.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os

import torch

from . import reference
from .lazy_kmeanspp import kmeanspp_lazy
from .select_pool import select_from_pool_eager

__all__ = ["grad_embed", "kmeanspp", "select", "select_from_pool", "backend_for", "triton_status",
           "without_autocast", "max_queries", "TRITON_MAX_M"]

# The most pseudo-labels (queries: the global batch M) the Triton selection serves: up to 256 a
# candidate's softmax row is one tile, above it the embedding runs over chunks of the row
# (kernels/triton_grad_embed.py); compiled for sm_90 and tested up to here. The reference ops
# have no limit.
TRITON_MAX_M = 4096

_CHOICES = ("auto", "triton", "reference")
_TRITON_MODULES = ("triton_grad_embed", "triton_kmeanspp", "triton_select")
_NOT_INSTALLED = "triton is not installed (pip install triton)"
_triton = None  # after the first attempt: the modules of _TRITON_MODULES (a tuple), or why not


def _triton_modules():
    """The two Triton op modules, imported once; a str (the reason) when the triton package
    itself is missing. Any other error in a kernel file propagates: it is a bug to see."""
    global _triton
    if _triton is None:
        try:
            _triton = tuple(importlib.import_module(f"{__name__}.{m}") for m in _TRITON_MODULES)
        except ModuleNotFoundError as e:
            if e.name != "triton" and not (e.name or "").startswith("triton."):
                raise
            _triton = _NOT_INSTALLED
    return _triton


def triton_status() -> tuple[bool, str]:
    """(available, reason): whether the Triton ops can run in this process; the reason says why
    not, or how the kernels were defined. Imports the Triton modules on the first call."""
    mods = _triton_modules()
    if isinstance(mods, str):
        return False, mods
    import triton

    mode = "interpreter" if mods[0].INTERPRETED else "compiler"
    return True, f"triton {triton.__version__}, kernels defined for the {mode}"


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def backend_for(t: torch.Tensor) -> str:
    """'triton' or 'reference' for a tensor, from CMACC_KERNELS read now."""
    choice = os.environ.get("CMACC_KERNELS", "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"CMACC_KERNELS={choice!r} is not one of {_CHOICES}")
    if choice == "reference" or (choice == "auto" and not t.is_cuda):
        return "reference"
    if choice == "triton" and not t.is_cuda and not _interpret_env():  # checked before defining
        raise RuntimeError(
            "CMACC_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 (the Triton "
            "interpreter), set before the first Triton call; or use CMACC_KERNELS=auto"
        )
    available, reason = triton_status()
    if choice == "auto":
        return "triton" if available else "reference"
    if not available:
        raise RuntimeError(f"CMACC_KERNELS=triton but {reason}; or use CMACC_KERNELS=auto")
    if not t.is_cuda and not all(m.INTERPRETED for m in _triton):
        raise RuntimeError(
            "CMACC_KERNELS=triton on CPU tensors: the Triton kernels were already defined for the "
            "GPU compiler (TRITON_INTERPRET was not 1 when kernels.triton_* were first imported); "
            "set TRITON_INTERPRET=1 before importing kernels / before the first Triton call "
            "(e.g. in the shell), in a fresh process"
        )
    return "triton"


# Pools below this many factor floats (N x (a + b)) run the reference's eager loop on a CPU as
# well: its per-step pass is then cache-resident and cheaper than the lazy race's fixed cost of
# about 0.1 ms a step. Measured on 2 cores, M = 128, a + b = 256 (bench/RESULTS.md, "CPU
# selection"): N = 1,000: eager 13 ms, lazy 22 ms; 4,000: 37 vs 32 ms; 8,000: 71 vs 43 ms.
# Both draw the same picks.
_LAZY_FROM_FLOATS = 1 << 20


def _seeding(alpha: torch.Tensor, beta: torch.Tensor):
    """The k-means++ seeding of the non-Triton path for these factors: the lazy race on CPU
    tensors of a pool of at least _LAZY_FROM_FLOATS (unless CMACC_KERNELS=reference asks for
    the reference itself), else the reference's."""
    eager = os.environ.get("CMACC_KERNELS", "auto").strip().lower() == "reference"
    large = alpha.shape[0] * (alpha.shape[1] + beta.shape[1]) >= _LAZY_FROM_FLOATS
    return (kmeanspp_lazy if alpha.device.type == "cpu" and large and not eager
            else reference.kmeanspp)


def max_queries(device_type: str) -> int | None:
    """The most pseudo-labels M the selection ops take on tensors of ``device_type`` as
    ``backend_for`` would dispatch them now (CMACC_KERNELS, triton installed): TRITON_MAX_M on
    the Triton path, None (no limit) on the reference. For checks at configuration time."""
    choice = os.environ.get("CMACC_KERNELS", "auto").strip().lower() or "auto"
    if choice == "reference" or (choice == "auto" and device_type != "cuda"):
        return None
    if choice == "auto" and importlib.util.find_spec("triton") is None:
        return None
    return TRITON_MAX_M


def without_autocast(op):
    """The selection computes in fp32 whatever the caller's autocast says: under the trainer's
    bf16/fp16 autocast the reference's matmuls (logits, the Gram matrix, distances) would
    otherwise run in half precision and change the picks. The tensor arguments' device types
    say which autocast to switch off."""
    @functools.wraps(op)
    def run(*args, **kwargs):
        types = {a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
        if not any(torch.is_autocast_enabled(t) for t in types if t in ("cpu", "cuda")):
            return op(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for t in types & {"cpu", "cuda"}:
                stack.enter_context(torch.autocast(t, enabled=False))
            return op(*args, **kwargs)
    return run


@without_autocast
def grad_embed(keys, queries, feats=None, *, tau=1.0, view="head", compress=False):
    """(alpha, beta) fp32 with g_n = alpha_n (x) beta_n; see kernels.reference.grad_embed."""
    if backend_for(keys) == "triton":
        return _triton[0].grad_embed_triton(keys, queries, feats, tau=tau, view=view,
                                            compress=compress)
    return reference.grad_embed(keys, queries, feats, tau=tau, view=view, compress=compress)


@without_autocast
def kmeanspp(alpha, beta, k, *, seed, exclude=None, validate=True, beta_c=None, sqn=None):
    """k distinct indices by k-means++ seeding over alpha (x) beta; see reference.kmeanspp."""
    if backend_for(alpha) == "triton":
        return _triton[1].kmeanspp_triton(alpha, beta, k, seed=seed, exclude=exclude,
                                          validate=validate, beta_c=beta_c, sqn=sqn)
    return _seeding(alpha, beta)(alpha, beta, k, seed=seed, exclude=exclude, validate=validate,
                                 beta_c=beta_c, sqn=sqn)


@without_autocast
def select(keys, queries, feats, k, *, seed, tau=1.0, view="head", exclude=None, validate=True,
           n=None, precision=None, factors="fp32", variant="steps"):
    """One dictionary's active selection: the gradient-embedding factors (Gram route in the
    `head` view, no QR) followed by k-means++ seeding. Returns long [k] indices into ``keys``.

    ``n``: ``keys`` is a pool's capacity buffer [cap, d] and its first n rows are the candidates
    (``exclude`` [cap] too). On the Triton path this reads the buffer in place from one CUDA graph
    per pool shape (kernels/triton_select.py); without ``n`` the keys are copied into a plan.
    ``precision`` (tl.dot: ieee | tf32x3 | tf32), ``factors`` (fp32 | bf16 storage of the
    factors) and ``variant`` (steps | persistent | lazy | resident k-means++: a launch per
    step, one persistent launch, the lazy race of kernels/lazy_kmeanspp.py, or one persistent
    launch holding the factors on chip where the pool fits, else steps; "auto": the one measured
    fastest on the device for the pool's capacity, triton_select.auto_variant; all the same
    picks) apply
    to the Triton path; the reference computes in fp32 (bf16 factors: rounded as the kernel
    stores them); on CPU tensors its k-means++ is the lazy race for large pools whatever the
    variant (``_seeding``)."""
    if backend_for(keys) == "triton":
        return _triton[2].select_triton(keys, queries, feats, k, seed=seed, n=n, tau=tau,
                                        view=view, exclude=exclude, validate=validate,
                                        precision=precision, factors=factors, variant=variant)
    if n is not None:
        keys = keys[:n]
        exclude = None if exclude is None else exclude[:n]
    if factors not in ("fp32", "bf16"):
        raise ValueError(f"select: factors={factors!r} is not one of ('fp32', 'bf16')")
    alpha, beta, beta_c, sqn = reference.select_factors(keys, queries, feats, tau=tau, view=view)
    if factors == "bf16":  # stored as the kernel stores them; |g|^2 from the rounded values
        bf = torch.bfloat16
        alpha, beta, sqn = alpha.to(bf), beta.to(bf), None
        beta_c = None if beta_c is None else beta_c.to(bf)
    return _seeding(alpha, beta)(alpha, beta, k, seed=seed, exclude=exclude, validate=validate,
                                 beta_c=beta_c, sqn=sqn)


@without_autocast
def select_from_pool(pool_keys, pool_index, dict_index, queries, feats, m, *, seed, n, tau=1.0,
                     view="head", precision=None, factors="fp32", variant="steps"):
    """CM-ACC's selection for one dictionary from its pool (kernels/select_pool.py): the
    candidates are the first ``n`` rows of the pool's capacity buffers (``pool_keys`` [cap, d],
    ``pool_index`` [cap]) whose clip is not in ``dict_index`` [K] (the exclusion dropped when
    fewer than m remain); returns (keys [m, d], index [m], gnorm [] the picks' mean |g|,
    fallback [] 1.0 where the exclusion was dropped). No host sync. On the Triton path the
    exclusion, the selection and the gathers run in the plan's one CUDA graph
    (``SelectPlan.run_pool``); elsewhere as eager ops around ``select``."""
    if backend_for(pool_keys) == "triton":
        return _triton[2].select_pool_triton(pool_keys, pool_index, dict_index, queries, feats, m,
                                             seed=seed, n=n, tau=tau, view=view,
                                             precision=precision, factors=factors,
                                             variant=variant)
    return select_from_pool_eager(select, grad_embed, pool_keys, pool_index, dict_index, queries,
                                  feats, m, seed=seed, n=n, tau=tau, view=view,
                                  engine=dict(precision=precision, factors=factors,
                                              variant=variant))
