"""Distributed helpers: rank queries, gathers, MoCo's shuffle-BN, and the checks that ranks
agree. Every function is the identity at world size 1 (or without torch.distributed
initialised), so the method runs unchanged in one process."""

from __future__ import annotations

import datetime
import inspect
import os
import pickle
import zlib
from typing import NamedTuple

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


def job_restart_count() -> int:
    """How many times torchrun has restarted this job, as every rank agrees: the largest
    ``restart_count`` of any rank (one gather; every rank must call it, at the same point).
    torchrun's agents count per node: only the agent whose worker failed counts the restart, a
    membership change is not counted, and a replacement node starts at 0; so after one rank's
    failure the ranks of one attempt see different counts, and a rank that decided from its
    own would skip a collective that the others enter. The largest is a restart if any agent
    counted one, whichever node rank 0 is on (a replacement may be)."""
    return max(gather_objects(restart_count()))


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


def backend_for(device: str, asked: str = "auto") -> str:
    """The process group's backend: NCCL for CUDA and gloo for the CPU (``auto``), or the one
    asked for (``--dist-backend``: gloo over CUDA tensors lets ranks share a GPU)."""
    if asked == "auto":
        return "nccl" if device == "cuda" else "gloo"
    if asked == "nccl" and device != "cuda":
        raise ValueError("--dist-backend nccl needs --device cuda (NCCL moves CUDA tensors "
                         "only); use gloo or auto on the CPU")
    return asked


def rank_device(local_rank: int, gpus: int, backend: str) -> int:
    """The GPU of a rank: its LOCAL_RANK; one visible GPU: that one (a scheduler's one GPU a task,
    or ranks sharing it with gloo); with more ranks on a node than its several GPUs, NCCL refuses
    (one GPU a rank), gloo shares them round robin (``local_rank % gpus``)."""
    if gpus < 1:
        raise ValueError("no CUDA device is visible to this rank (CUDA_VISIBLE_DEVICES?)")
    if local_rank < gpus:
        return local_rank
    if gpus == 1:  # a scheduler that binds one GPU a task (SLURM): each rank sees its own as 0
        return 0  # (ranks that truly share one GPU get NCCL's own error)
    if backend == "nccl":
        raise ValueError(f"LOCAL_RANK {local_rank} but {gpus} GPU(s) visible on this node: NCCL "
                         f"needs a GPU a rank; start at most {gpus} per node (torchrun "
                         f"--nproc_per_node {gpus}), or pass --dist-backend gloo to share them "
                         "(a test of the distributed paths, not a fast run)")
    return local_rank % gpus


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
    restarts them (docs/RELIABILITY.md, "A lost node"). It bounds the store's waits too: rank
    0's wait for the other ranks to connect, a worker's connect, and each key read of the
    group's own rendezvous (gloo's addresses, NCCL's unique id). torch sets the store's timeout
    only for a store it makes itself; this one is passed in, so it is set here (else 30 min)."""
    td = None if timeout is None else datetime.timedelta(seconds=timeout)
    store, rank_, world = next(dist.rendezvous("env://", **({} if td is None else {"timeout": td})))
    if td is not None:
        store.set_timeout(td)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.PrefixStore(f"cmacc/attempt_{restart_count()}", store)
    kw = {} if td is None else {"timeout": td}
    reset_shuffle_generator()
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


# -- shuffle-BN ----------------------------------------------------------------------------
# MoCo's shuffle-BN: the key encoder sees the global batch permuted over the ranks, so the BN
# statistics of a key and of its query come from different clips. The permutation is drawn
# on the host from a generator in the same state on every rank, so every rank knows every
# rank's routing without a broadcast or a device-to-host copy, and the clips move with one
# all_to_all_single: rank r receives exactly its M / world rows (the gather this replaced
# received all M on every rank: world times the bytes, and twice M rows of transient memory).
SHUFFLE_SEED = 0x5EED_B4  # the fallback generator's seed (no generator passed)
_shuffle_gen: torch.Generator | None = None


def reset_shuffle_generator(seed: int = SHUFFLE_SEED) -> None:
    """Re-seed the fallback generator of ``batch_shuffle`` (done by ``init_process_group``):
    every rank of a new group starts from the same state, and draws once per shuffle."""
    global _shuffle_gen
    _shuffle_gen = torch.Generator().manual_seed(seed)


def shuffle_generator(seed: int, step: int) -> torch.Generator:
    """A host generator for the shuffles of ``step``, the same on every rank and after a
    resume (the fallback's state is not in the checkpoint). Pass it to every ``batch_shuffle``
    of that step, in the same order on every rank."""
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + int(step) * 7919 + 0x5EED)
                                         % (2 ** 63))


class Shuffle(NamedTuple):
    """One shuffle's routing, all on the host except the ``*_dev`` index tensors (on the
    clips' device). ``perm`` [M]: global row j of the shuffled batch is global row perm[j] of
    the input (rank r holds rows r·L … r·L + L − 1, L = M / world, before and after)."""
    perm: torch.Tensor
    send_splits: list  # rows this rank sends to each rank (forward)
    recv_splits: list  # rows this rank receives from each rank (forward)
    send_rows_dev: torch.Tensor  # [L] local input rows in send order
    recv_inv_dev: torch.Tensor  # [L] output row j = received row recv_inv[j]
    recv_order_dev: torch.Tensor  # [L] received row k = output row recv_order[k]
    send_inv_dev: torch.Tensor  # [L] input row i = row send_inv[i] of what comes back


def shuffle_plan(perm: torch.Tensor, world: int, rank_: int, device) -> Shuffle:
    """The routing of ``perm`` (host int64 [M], a permutation, M = world · L) for ``rank_``:
    which local rows go to which rank, and where the received ones land. Pure host work."""
    m = perm.numel()
    local = m // world
    owner = perm // local  # the rank holding each output position's source row
    mine = owner[rank_ * local:(rank_ + 1) * local]
    # receive: grouped by source rank, within a group in output order (senders send so)
    recv_order = torch.sort(mine, stable=True).indices
    recv_inv = torch.argsort(recv_order)
    recv_splits = torch.bincount(mine, minlength=world).tolist()
    # send: the output positions, in order, whose source row is here; grouped by destination
    pos = torch.nonzero(owner == rank_).squeeze(1)
    send_rows = perm[pos] - rank_ * local
    send_splits = torch.bincount(pos // local, minlength=world).tolist()
    send_inv = torch.argsort(send_rows)
    idx = torch.stack([send_rows, recv_inv, recv_order, send_inv])
    dev = torch.device(device)
    if dev.type == "cuda":  # pinned: the copy does not wait for the device's queue
        idx = idx.pin_memory().to(dev, non_blocking=True)
    else:
        idx = idx.to(dev)
    return Shuffle(perm, send_splits, recv_splits, *idx.unbind(0))


def _as_rows(x: torch.Tensor):
    """``x`` as a contiguous [N, -1] view in its memory order (channels-last kept: no copy
    where it is channels-last), and how to give rows back x's shape and memory format."""
    n = x.shape[0]
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        y = x.permute(0, 2, 3, 4, 1)
        return y.reshape(n, -1), lambda r: r.view(r.shape[0], *y.shape[1:]).permute(0, 4, 1, 2, 3)
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        y = x.permute(0, 2, 3, 1)
        return y.reshape(n, -1), lambda r: r.view(r.shape[0], *y.shape[1:]).permute(0, 3, 1, 2)
    shape = x.shape[1:]
    return x.contiguous().view(n, -1), lambda r: r.view(r.shape[0], *shape)


def _route(x: torch.Tensor, send_rows, send_splits, recv_splits, recv_index) -> torch.Tensor:
    """rows ``send_rows`` of ``x`` out (``send_splits`` per rank), ``recv_splits`` rows in, put
    in order by ``recv_index``: one all_to_all_single, two local copies of this rank's rows."""
    rows, back = _as_rows(x)
    send = rows.index_select(0, send_rows)
    recv = torch.empty((sum(recv_splits), rows.shape[1]), dtype=rows.dtype, device=rows.device)
    dist.all_to_all_single(recv, send, recv_splits, send_splits)
    return back(recv.index_select(0, recv_index))


@torch.no_grad()
def batch_shuffle(x: torch.Tensor, generator: torch.Generator | None = None):
    """Shuffle-BN (MoCo): this rank's L rows of the global batch [M = world · L, ...] permuted
    by a permutation shared by all ranks, and the ``Shuffle`` that ``batch_unshuffle`` undoes
    (None at world size 1, where ``x`` is returned as is). Every rank must pass the same L.

    The permutation is ``torch.randperm(M, generator=generator)`` on the host: ``generator``
    (a CPU generator) must be in the same state on every rank (``shuffle_generator(seed,
    step)``); None draws from this module's generator, seeded alike on every rank when the
    group is made (``init_process_group``; ``reset_shuffle_generator``). The rows returned are
    bit for bit those of gathering the global batch and indexing it with ``perm[r·L:(r+1)·L]``
    (what this did before), in ``x``'s memory format (channels-last kept)."""
    w = world_size()
    if w == 1:
        return x, None
    if generator is None:
        if _shuffle_gen is None:
            reset_shuffle_generator()
        generator = _shuffle_gen
    if generator.device.type != "cpu":
        raise ValueError("batch_shuffle draws its permutation on the host: pass a CPU generator")
    perm = torch.randperm(x.shape[0] * w, generator=generator)
    plan = shuffle_plan(perm, w, rank(), x.device)
    return _route(x, plan.send_rows_dev, plan.send_splits, plan.recv_splits,
                  plan.recv_inv_dev), plan


@torch.no_grad()
def batch_unshuffle(x: torch.Tensor, unshuffle: Shuffle | None) -> torch.Tensor:
    """Undo ``batch_shuffle`` on the key encoder outputs [L, d]: this rank's original rows.
    The forward routing run backwards, one all_to_all_single (each rank receives its own L
    rows, where a gather would bring all M to every rank; no M-row buffer either)."""
    if unshuffle is None:
        return x
    p = unshuffle
    return _route(x, p.recv_order_dev, p.recv_splits, p.send_splits, p.send_inv_dev)


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
