"""Active-selection ops, dispatched at call time to the Triton kernels or the PyTorch reference.

Gradient embedding (DESIGN.md §1 steps 1-3) and k-means++ seeding (steps 4-5):

    CMACC_KERNELS=auto       (default) Triton for CUDA tensors, the PyTorch reference otherwise
    CMACC_KERNELS=reference  always the PyTorch reference (kernels/reference.py)
    CMACC_KERNELS=triton     always Triton (on CPU tensors only under TRITON_INTERPRET=1)

The Triton ops live in kernels/triton_grad_embed.py and kernels/triton_kmeanspp.py and are
imported on the first call that needs them (``import kernels`` defines no Triton kernel and
touches no CUDA). Triton decides between its interpreter and its compiler when a kernel is
defined, i.e. at that first import: set TRITON_INTERPRET=1 before it to run on CPU tensors.
``triton_status()`` says whether the Triton ops can run and, if not, why.
"""

from __future__ import annotations

import importlib
import os

import torch

from . import reference

__all__ = ["grad_embed", "kmeanspp", "select", "backend_for", "triton_status"]

_CHOICES = ("auto", "triton", "reference")
_TRITON_MODULES = ("triton_grad_embed", "triton_kmeanspp")
_NOT_INSTALLED = "triton is not installed (pip install triton)"
_triton = None  # after the first attempt: (grad_embed module, kmeanspp module), or why not


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


def grad_embed(keys, queries, feats=None, *, tau=1.0, view="head", compress=False):
    """(alpha, beta) fp32 with g_n = alpha_n (x) beta_n; see kernels.reference.grad_embed."""
    if backend_for(keys) == "triton":
        return _triton[0].grad_embed_triton(keys, queries, feats, tau=tau, view=view,
                                            compress=compress)
    return reference.grad_embed(keys, queries, feats, tau=tau, view=view, compress=compress)


def kmeanspp(alpha, beta, k, *, seed, exclude=None, validate=True):
    """k distinct indices by k-means++ seeding over alpha (x) beta; see reference.kmeanspp."""
    if backend_for(alpha) == "triton":
        return _triton[1].kmeanspp_triton(alpha, beta, k, seed=seed, exclude=exclude,
                                          validate=validate)
    return reference.kmeanspp(alpha, beta, k, seed=seed, exclude=exclude, validate=validate)


def select(keys, queries, feats, k, *, seed, tau=1.0, view="head", exclude=None, validate=True):
    """One dictionary's active selection: grad_embed (row-space compressed in the `head` view)
    followed by k-means++ seeding. Returns long [k] indices into ``keys``."""
    if backend_for(keys) == "triton":  # fused: grad_embed also emits |g_n|^2 for k-means++
        ge, km = _triton
        alpha, beta, sqn = ge.grad_embed_triton_with_norms(keys, queries, feats, tau=tau,
                                                           view=view, compress=True)
        return km.kmeanspp_triton(alpha, beta, k, seed=seed, exclude=exclude, validate=validate,
                                  sqn=sqn)
    alpha, beta = reference.grad_embed(keys, queries, feats, tau=tau, view=view, compress=True)
    return reference.kmeanspp(alpha, beta, k, seed=seed, exclude=exclude, validate=validate)
