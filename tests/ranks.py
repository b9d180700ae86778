"""Run a function on a few CPU ranks in forked processes, under torchrun's environment variables
(MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK): what ranks must agree on, tested in seconds
without torchrun's start-up. Each rank returns ("ok", value) or ("error", "Type: line"); a rank
that returns nothing within the timeout fails the test with its stack. Ranks are never forked
beside another live thread (a fork would copy the locks it holds), and never collect the
parent's garbage."""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing as mp
import os
import queue as queue_mod
import random
import socket
import sys
import tempfile
import threading


def _free_port() -> int:
    """A free port that no other pytest-xdist worker's ranks draw: each worker has its own
    1,000 ports below the kernel's ephemeral range (32768+). Two workers asking the kernel for
    a free port at once could both get one port, and their two groups would then meet in one
    store (gloo: "connectFullMesh ... closed by peer", or a wait that never ends)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    base = 20000 + 1000 * (int(worker) % 12 if worker.isdigit() else 0)
    for port in random.Random().sample(range(base, base + 1000), 1000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {base}..{base + 999}")


def _child(fn, rank, world, env, queue, dump, timeout):
    faulthandler.dump_traceback_later(timeout, file=open(dump, "w"))  # a rank that hangs says where
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


# gloo's mesh between the forked ranks failed to connect (a loopback socket closed under a
# loaded host: seen once in many suite runs, with the other xdist worker's ranks beside them).
# It fails inside init_process_group, before ``fn`` does anything else: the ranks start again.
MESH_FAILED = "Gloo connectFullMesh failed"


def run_ranks(fn, world: int = 2, timeout: float = 60, env: dict | None = None) -> list:
    """``fn(rank)`` in ``world`` forked processes (the test's monkeypatches come along; ``fn``
    may patch more in its own process); each rank's result, in rank order. ``fn`` joins the
    group itself (``cmacc.distributed.init_process_group``, or the code under test does) as
    its first act: a group whose gloo mesh failed to connect (MESH_FAILED) is formed again
    once, on a new port."""
    out = _run_ranks(fn, world, timeout, env)
    if any(r[0] == "error" and MESH_FAILED in r[1] for r in out):
        out = _run_ranks(fn, world, timeout, env)
    return out


def _end_tqdm_monitor() -> None:
    """tqdm's monitor thread, where a bar in this process started one: ended (joined, so it
    holds no lock), and none started again."""
    std = sys.modules.get("tqdm.std")
    if std is None:
        return
    std.tqdm.monitor_interval = 0
    monitor = getattr(std.tqdm, "monitor", None)
    if monitor is not None:
        monitor.exit()
        std.tqdm.monitor = None


def _run_ranks(fn, world, timeout, env) -> list:
    # a fork copies the locks that other threads hold at that moment, held, with no thread to
    # release them: a rank then waits forever on the first one it takes (tqdm's, once: its
    # monitor thread, which torch.compile's first bar starts too, is ended here first). Idle
    # workers of a thread pool (inductor's compile pool lives as long as the process) wait on
    # their own queue, whose lock no rank takes.
    _end_tqdm_monitor()
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()
              and not t.name.startswith("ThreadPoolExecutor-")]
    assert not others, f"forking ranks beside live threads {others}: they could hang; end them first"
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    env = dict(env or {}, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    with tempfile.TemporaryDirectory() as tmp:
        dumps = [os.path.join(tmp, f"rank{r}.txt") for r in range(world)]
        dump_at = max(timeout - 2, timeout / 2)
        procs = [ctx.Process(target=_child, args=(fn, r, world, env, queue, dumps[r], dump_at))
                 for r in range(world)]
        # the parent's garbage dies here, not in a rank: a DALI pipeline left by an earlier
        # test, collected in a fork, waits in its __del__ for worker threads a fork does not
        # copy (seen in CI); what remains is frozen, so no rank's collector ever visits it
        gc.collect()
        gc.freeze()
        try:
            for p in procs:
                p.start()
        finally:
            gc.unfreeze()
        out = {}
        try:
            for _ in range(world):
                rank, res = queue.get(timeout=timeout)
                out[rank] = res
        except queue_mod.Empty:  # (each rank's stacks were written at dump_at)
            for r, p in enumerate(procs):
                if r not in out:
                    p.kill()
            stacks = "\n".join(f"rank {r}:\n{open(d).read()}" for r, d in enumerate(dumps)
                               if r not in out)
            raise AssertionError(f"ranks {sorted(set(range(world)) - set(out))} gave no result in "
                                 f"{timeout:g} s; where they were:\n{stacks}") from None
        finally:
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
    return [out[r] for r in range(world)]
