"""Run a function on a few CPU ranks in forked processes, under torchrun's environment variables
(MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK): what ranks must agree on, tested in seconds
without torchrun's start-up. Each rank returns ("ok", value) or ("error", "Type: line")."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world, env, queue):
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    try:
        res = ("ok", fn(rank))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        res = ("error", f"{type(e).__name__}: {e}")
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    queue.put((rank, res))


def run_ranks(fn, world: int = 2, timeout: float = 60, env: dict | None = None) -> list:
    """``fn(rank)`` in ``world`` forked processes (the test's monkeypatches come along; ``fn``
    may patch more in its own process); each rank's result, in rank order. ``fn`` joins the
    group itself (``cmacc.distributed.init_process_group``, or the code under test does)."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    env = dict(env or {}, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    procs = [ctx.Process(target=_child, args=(fn, r, world, env, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(world):
            rank, res = queue.get(timeout=timeout)
            out[rank] = res
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]
