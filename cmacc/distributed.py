"""Distributed helpers: rank queries, gathers, MoCo's shuffle-BN, and the checks that ranks
agree. Every function is the identity at world size 1 (or without torch.distributed
initialised), so the method runs unchanged in one process."""

from __future__ import annotations

import datetime
import inspect
import os
import pickle
import zlib

import torch
import torch.distributed as dist


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (``--max-restarts``): 0 on the
    first attempt and outside torchrun."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    except ValueError:
        return 0


def elastic_run_id() -> str:
    """torchrun's job id (``--rdzv-id``; a fresh one per ``--standalone`` command), "" outside
    torchrun."""
    return os.environ.get("TORCHELASTIC_RUN_ID", "")


def restarts_allowed() -> bool:
    """Whether torchrun would start this job's workers again after a failure (--max-restarts
    > 0)."""
    try:
        return bool(elastic_run_id()) and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) > 0
    except ValueError:
        return False


def init_process_group(backend: str, timeout: float | None = None) -> None:
    """The default group from torchrun's environment, its store keys under this attempt's own
    prefix when the store is the agent's. torchrun's agent may keep serving one store across
    worker restarts (TORCHELASTIC_USE_AGENT_STORE, the default of one node), so the workers of
    attempt n + 1 would read attempt n's keys under the same names (gloo: the dead workers'
    addresses, "connectFullMesh ... Connection refused") and never form a group; a prefix per
    attempt makes each attempt's rendezvous its own. With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    (what several nodes need: ``shared_store_warning``) rank 0 of each attempt serves a new
    store on a new port: nothing stale to avoid, and no prefix, since the agents of several
    nodes count their restarts differently (a membership change is not counted).

    ``timeout`` (seconds; None: torch's default, 10 min for NCCL, 30 for gloo) bounds the wait
    of a collective that a peer never joins (a lost node): the survivors then fail and torchrun
    restarts them (docs/RELIABILITY.md, "A lost node")."""
    store, rank_, world = next(dist.rendezvous("env://"))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.PrefixStore(f"cmacc/attempt_{restart_count()}", store)
    kw = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    dist.init_process_group(backend, store=store, rank=rank_, world_size=world, **kw)


def agree(decide):
    """``decide()`` on rank 0, its result on every rank (picklable; broadcast), or its exception
    raised on every rank: one decision where ranks may see different things (an NFS listing
    lags 30-60 s behind another node's writes). Every rank must call it, at the same point."""
    if world_size() == 1:
        return decide()
    box = [None]
    if rank() == 0:
        try:
            box[0] = (True, decide())
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            try:
                pickle.dumps(e)
            except Exception:  # noqa: BLE001 - an exception that does not travel: its line does
                e = RuntimeError(f"{type(e).__name__}: {e}")
            box[0] = (False, e)
    dist.broadcast_object_list(box, 0)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def gather_objects(obj) -> list:
    """``obj`` of every rank (picklable), in rank order, on every rank."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def shared_store_warning() -> str | None:
    """Why several torchrun nodes sharing the agents' store cannot re-form after a lost or a
    joining node, and the fix; None where that is not the case. (torch 2.14: a node that joins
    a later round waits forever for the bootstrap address the leader published only in its
    first round; and the per-attempt prefix above differs between agents.)"""
    try:
        nodes = int(os.environ.get("GROUP_WORLD_SIZE") or 1)
    except ValueError:
        return None
    if nodes > 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return (f"{nodes} torchrun nodes share the agents' rendezvous store: a lost node or one "
                "that joins will leave the job waiting instead of re-forming it; start torchrun "
                "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment on every node")
    return None


def wrap_ddp(model: torch.nn.Module) -> torch.nn.Module:
    """DistributedDataParallel that all-reduces the gradients and never re-broadcasts buffers in
    forward: the dictionaries, pools and BN statistics are kept in lock-step by the method itself
    (gathered keys, identical picks), and a per-forward broadcast would cost a copy of the pools
    each step. torch >= 2.13 names this ``forward_sync_buffers=False`` (``broadcast_buffers`` is
    deprecated there, with a FutureWarning per rank); older torch only has ``broadcast_buffers``."""
    ddp = torch.nn.parallel.DistributedDataParallel
    if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters:
        return ddp(model, forward_sync_buffers=False)
    return ddp(model, broadcast_buffers=False)


@torch.no_grad()
def gather_cat(x: torch.Tensor) -> torch.Tensor:
    """Concatenate ``x`` from all ranks along dim 0 (no gradient), rank order."""
    if world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, 0)


@torch.no_grad()
def broadcast_(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    if world_size() > 1:
        dist.broadcast(x, src)
    return x


@torch.no_grad()
def batch_shuffle(x: torch.Tensor, generator: torch.Generator | None = None):
    """Shuffle-BN (MoCo): gather the global batch, permute it with a permutation shared by all
    ranks (drawn on rank 0, broadcast), return this rank's slice and the inverse permutation."""
    if world_size() == 1:
        return x, None
    local = x.shape[0]
    xs = gather_cat(x)  # [B_global, ...]
    perm = torch.randperm(xs.shape[0], device=x.device, generator=generator)
    broadcast_(perm, 0)
    unshuffle = torch.argsort(perm)
    r = rank()
    return xs[perm[r * local:(r + 1) * local]], unshuffle


@torch.no_grad()
def batch_unshuffle(x: torch.Tensor, unshuffle: torch.Tensor | None) -> torch.Tensor:
    """Undo ``batch_shuffle`` on the key encoder outputs: this rank's original rows."""
    if unshuffle is None:
        return x
    local = x.shape[0]
    xs = gather_cat(x)
    r = rank()
    return xs[unshuffle[r * local:(r + 1) * local]]


# ----------------------------------------------------------------------------------------------
# Ranks must agree: config, weights, dictionaries, the last selection
# ----------------------------------------------------------------------------------------------
FINGERPRINT_FIELDS = ("config", "key encoders", "query encoders", "dictionary keys",
                      "dictionary indices", "selected indices")


@torch.no_grad()
def fingerprint(model, config_hash: str, enq_index: torch.Tensor | None) -> torch.Tensor:
    """float64 [6]: config hash, key-encoder and query-encoder weight sums, dictionary keys and
    indices, the indices enqueued last. Equal on all ranks iff the run is in lock-step."""
    dev = model.dict_v.keys.device
    f = torch.zeros(6, dtype=torch.float64, device=dev)
    f[0] = float(zlib.crc32(config_hash.encode()))
    f[1] = sum(p.double().sum() for p in model.h_v.parameters()) + sum(
        p.double().sum() for p in model.h_a.parameters())
    f[2] = sum(p.double().sum() for p in model.f_v.parameters()) + sum(
        p.double().sum() for p in model.f_a.parameters())
    f[3] = model.dict_v.keys.double().sum() + model.dict_a.keys.double().sum()
    w = torch.arange(1, model.dict_v.index.numel() + 1, device=dev, dtype=torch.float64)
    f[4] = (model.dict_v.index.double() * w).sum() + (model.dict_a.index.double() * w).sum()
    if enq_index is not None:
        f[5] = (enq_index.double() * torch.arange(1, enq_index.numel() + 1, device=dev)).sum()
    return f


def verify_ranks_agree(model, config_hash: str, enq_index, step: int) -> None:
    """All-gather the fingerprint; raise RuntimeError naming what differs. Call at log
    intervals only (it syncs)."""
    if world_size() == 1:
        return
    f = fingerprint(model, config_hash, enq_index)
    parts = [torch.empty_like(f) for _ in range(world_size())]
    dist.all_gather(parts, f)
    table = torch.stack(parts).cpu()  # [world, 6]: one device-to-host copy
    for r, p in enumerate(table):
        bad = [FINGERPRINT_FIELDS[i] for i in range(6) if p[i] != table[0][i]]
        if bad:
            raise RuntimeError(
                f"ranks diverged at step {step}: rank {r} differs from rank 0 in "
                f"{', '.join(bad)}. Check that every rank runs the same code, flags and data "
                "manifest; the last checkpoint is kept"
            )
