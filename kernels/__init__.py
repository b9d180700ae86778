"""Active-selection kernels: gradient embedding (DESIGN.md §1 steps 1-3) and k-means++ seeding
(steps 4-5). The public functions dispatch to an implementation at call time:

    CMACC_KERNELS=auto       (default) Triton for CUDA tensors, the PyTorch reference otherwise
    CMACC_KERNELS=reference  always the PyTorch reference (kernels/reference.py)
    CMACC_KERNELS=triton     always Triton (on CPU tensors only under TRITON_INTERPRET=1)

Nothing here touches CUDA or compiles anything at import time. Triton decides between the
interpreter and compilation when the kernels are defined (at ``import kernels``): set
TRITON_INTERPRET=1 before that import to run them on CPU tensors.
"""

from __future__ import annotations

import os

import torch

from . import reference

try:  # the Triton ops (compiled lazily at first launch; nothing touches CUDA here)
    from .grad_embed import grad_embed_triton, grad_embed_triton_with_norms
    from .kmeanspp import kmeanspp_triton
except ImportError:  # pragma: no cover - triton missing: the reference still works
    grad_embed_triton = grad_embed_triton_with_norms = kmeanspp_triton = None

__all__ = ["grad_embed", "kmeanspp", "select", "backend_for"]

_CHOICES = ("auto", "triton", "reference")


def backend_for(t: torch.Tensor) -> str:
    """'triton' or 'reference' for a tensor, from CMACC_KERNELS read now."""
    choice = os.environ.get("CMACC_KERNELS", "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"CMACC_KERNELS={choice!r} is not one of {_CHOICES}")
    if choice == "auto":
        return "triton" if (t.is_cuda and _triton_available()) else "reference"
    if choice == "triton":
        if not _triton_available():
            raise RuntimeError("CMACC_KERNELS=triton but triton is not importable; pip install triton")
        if not t.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError(
                "CMACC_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 (the Triton "
                "interpreter); or use CMACC_KERNELS=auto"
            )
    return choice


def _triton_available() -> bool:
    return kmeanspp_triton is not None


def grad_embed(keys, queries, feats=None, *, tau=1.0, view="head", compress=False):
    """(alpha, beta) fp32 with g_n = alpha_n (x) beta_n; see kernels.reference.grad_embed."""
    if backend_for(keys) == "triton":
        return grad_embed_triton(keys, queries, feats, tau=tau, view=view, compress=compress)
    return reference.grad_embed(keys, queries, feats, tau=tau, view=view, compress=compress)


def kmeanspp(alpha, beta, k, *, seed, exclude=None, validate=True):
    """k distinct indices by k-means++ seeding over alpha (x) beta; see kernels.reference.kmeanspp."""
    if backend_for(alpha) == "triton":
        return kmeanspp_triton(alpha, beta, k, seed=seed, exclude=exclude, validate=validate)
    return reference.kmeanspp(alpha, beta, k, seed=seed, exclude=exclude, validate=validate)


def select(keys, queries, feats, k, *, seed, tau=1.0, view="head", exclude=None, validate=True):
    """One dictionary's active selection: grad_embed (row-space compressed in the `head` view)
    followed by k-means++ seeding. Returns long [k] indices into ``keys``."""
    if backend_for(keys) == "triton":  # fused: grad_embed also emits |g_n|^2 for k-means++
        alpha, beta, sqn = grad_embed_triton_with_norms(keys, queries, feats, tau=tau, view=view,
                                                        compress=True)
        return kmeanspp_triton(alpha, beta, k, seed=seed, exclude=exclude, validate=validate,
                               sqn=sqn)
    alpha, beta = reference.grad_embed(keys, queries, feats, tau=tau, view=view, compress=True)
    return reference.kmeanspp(alpha, beta, k, seed=seed, exclude=exclude, validate=validate)
