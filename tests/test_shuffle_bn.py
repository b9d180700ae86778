"""Shuffle-BN over CPU ranks (gloo, forked: tests/ranks.py), and the store's timeout (issue 49).

1. ``batch_shuffle`` moves each rank's clips with one all_to_all_single: with the same
   permutation its rows are bit for bit those of the gather-and-index it replaced (kept below
   as ``_gather_shuffle`` / ``_gather_unshuffle``), ``batch_unshuffle`` gives each rank its own
   rows back, channels-last stays channels-last, every rank draws the same permutation, and a
   rank receives its L rows instead of the whole global batch (bytes counted on the collectives).
2. ``init_process_group(backend, timeout)`` sets the store's timeout: a rank that never joins
   makes the others fail in about ``--dist-timeout``, not torch's 30 minutes.

``python tests/test_shuffle_bn.py`` prints the bytes each rank receives per shuffle, before and
after, at the test's shapes (bench/RESULTS.md, "Shuffle-BN traffic per rank")."""

from __future__ import annotations

import queue
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ranks import run_ranks  # noqa: E402

from cmacc import distributed as du  # noqa: E402

L = 4  # rows per rank
SEED = 1234


# -- the gather-and-index shuffle this replaced (HEAD before issue 49), the reference --------
@torch.no_grad()
def _gather_shuffle(x, generator):
    if du.world_size() == 1:
        return x, None
    local = x.shape[0]
    xs = du.gather_cat(x)
    perm = torch.randperm(xs.shape[0], device=x.device, generator=generator)
    du.broadcast_(perm, 0)
    unshuffle = torch.argsort(perm)
    r = du.rank()
    return xs[perm[r * local:(r + 1) * local]], unshuffle


@torch.no_grad()
def _gather_unshuffle(x, unshuffle):
    if unshuffle is None:
        return x
    local = x.shape[0]
    xs = du.gather_cat(x)
    r = du.rank()
    return xs[unshuffle[r * local:(r + 1) * local]]


# -- a global batch known to every rank; rank r holds rows r·L … r·L + L − 1 -----------------
def _inputs(world, r):
    g = torch.Generator().manual_seed(7)
    m = world * L
    video = torch.randn(m, 3, 4, 6, 6, generator=g)  # [M, C, T, H, W]
    audio = torch.randn(m, 80, 20, generator=g)  # [M, mel, frames]
    sl = slice(r * L, (r + 1) * L)
    return {
        "video_cl_fp32": video[sl].contiguous(memory_format=torch.channels_last_3d),
        "video_cl_bf16": video[sl].to(torch.bfloat16).contiguous(
            memory_format=torch.channels_last_3d),
        "video_fp32": video[sl].contiguous(),
        "audio_fp32": audio[sl].contiguous(),
    }


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _keys(x):
    """A stand-in key encoder: a row-wise function of the clip, [N, 5] fp32."""
    return x.float().flatten(1)[:, :5] * 2 + 1


class _Received:
    """Counts the bytes that reach this rank from other ranks in all_gather, broadcast and
    all_to_all_single (the collectives the two shuffles use), by patching torch.distributed."""

    def __init__(self):
        self.bytes = 0
        self._real = {}

    def __enter__(self):
        me = dist.get_rank()
        real = self._real = {n: getattr(dist, n) for n in
                             ("all_gather", "broadcast", "all_to_all_single")}

        def all_gather(parts, x, *a, **k):
            self.bytes += sum(p.numel() * p.element_size() for i, p in enumerate(parts) if i != me)
            return real["all_gather"](parts, x, *a, **k)

        def broadcast(x, src, *a, **k):
            self.bytes += 0 if src == me else x.numel() * x.element_size()
            return real["broadcast"](x, src, *a, **k)

        def all_to_all_single(out, inp, out_splits=None, in_splits=None, *a, **k):
            row = out[0].numel() * out.element_size() if out.shape[0] else 0
            self.bytes += sum(n for i, n in enumerate(out_splits) if i != me) * row
            return real["all_to_all_single"](out, inp, out_splits, in_splits, *a, **k)

        dist.all_gather, dist.broadcast, dist.all_to_all_single = (
            all_gather, broadcast, all_to_all_single)
        return self

    def __exit__(self, *exc):
        for n, f in self._real.items():
            setattr(dist, n, f)


def _rank_fn(world):
    def fn(r):
        if world > 1:
            du.init_process_group("gloo", 30)
        res = {}
        for name, x in _inputs(world, r).items():
            ref, ref_un = _gather_shuffle(x, torch.Generator().manual_seed(SEED))
            xs, plan = du.batch_shuffle(x, torch.Generator().manual_seed(SEED))
            k = _keys(xs)
            back = du.batch_unshuffle(k, plan)
            item = dict(
                same_rows=_same_bits(xs, ref),
                unshuffled=_same_bits(back, _keys(x)),
                same_as_gather_unshuffle=_same_bits(back, _gather_unshuffle(_keys(ref), ref_un))
                if ref_un is not None else True,
                cl_in=x.is_contiguous(memory_format=torch.channels_last_3d),
                cl_out=xs.is_contiguous(memory_format=torch.channels_last_3d),
                perm=None if plan is None else getattr(plan, "perm", plan).tolist(),
                ref_perm=torch.randperm(world * L,
                                        generator=torch.Generator().manual_seed(SEED)).tolist(),
                identity=xs is x and back is k,
            )
            if world > 1:  # bytes from other ranks, one shuffle + unshuffle, before and after
                with _Received() as before:
                    s, u = _gather_shuffle(x, torch.Generator().manual_seed(SEED))
                    _gather_unshuffle(_keys(s), u)
                with _Received() as after:
                    s, p = du.batch_shuffle(x, torch.Generator().manual_seed(SEED))
                    du.batch_unshuffle(_keys(s), p)
                item.update(before=before.bytes, after=after.bytes,
                            row=x[0].numel() * x.element_size(),
                            key_row=_keys(x)[0].numel() * 4)
            res[name] = item
        # without a generator: the module's own, alike on every rank, a new draw each call
        x = _inputs(world, r)["audio_fp32"]
        draws = []
        for _ in range(2):
            xs, plan = du.batch_shuffle(x)
            draws.append(None if plan is None else getattr(plan, "perm", plan).tolist())
            du.batch_unshuffle(_keys(xs), plan)
        res["fallback"] = draws
        return res

    return fn


@pytest.mark.parametrize("world", [1, 2, 4])
def test_shuffle_moves_the_gathers_rows_with_one_exchange(world):
    out = run_ranks(_rank_fn(world), world=world, timeout=120)
    assert all(status == "ok" for status, _ in out), out
    res = [v for _, v in out]
    for r, rr in enumerate(res):
        for name, item in rr.items():
            if name == "fallback":
                continue
            assert item["same_rows"], (world, r, name)  # bit for bit today's rows
            assert item["unshuffled"], (world, r, name)  # each rank's own rows back
            assert item["same_as_gather_unshuffle"], (world, r, name)
            assert item["cl_out"] == item["cl_in"], (world, r, name)  # channels-last kept
            if world == 1:
                assert item["identity"] and item["perm"] is None  # a no-op
                continue
            # this rank receives, of its L rows (and, back, of its L keys), those another rank
            # holds; the gather brought every other rank's L rows, the permutation and keys
            mine = torch.tensor(item["ref_perm"][r * L:(r + 1) * L]) // L
            foreign = int((mine != r).sum())
            home = torch.tensor(item["ref_perm"]) // L  # where each output row's source is
            sent_away = int(((home == r) & (torch.arange(world * L) // L != r)).sum())
            assert item["after"] == foreign * item["row"] + sent_away * item["key_row"], \
                (world, r, name, item)
            assert item["before"] == (world - 1) * L * (item["row"] + item["key_row"]) \
                + (world * L * 8 if r else 0), (world, r, name, item)  # perm: rank 0's
            # the permutation: the generator's, the same on every rank
            assert item["perm"] == item["ref_perm"] == res[0][name]["perm"], (world, r, name)
    if world > 1:  # summed over ranks: exactly the rows whose destination is another rank
        for name in res[0]:
            if name == "fallback":
                continue
            perm = torch.tensor(res[0][name]["perm"])
            moved = int(((perm // L) != (torch.arange(world * L) // L)).sum())
            it = res[0][name]
            assert sum(rr[name]["after"] for rr in res) == moved * (it["row"] + it["key_row"])
        fb = [rr["fallback"] for rr in res]
        assert all(f == fb[0] for f in fb) and fb[0][0] != fb[0][1], fb


def test_a_rank_that_never_joins_fails_the_others_after_dist_timeout():
    """--dist-timeout reaches the store: 3 ranks, rank 2 never calls init_process_group.
    Rank 0 (serving the store) waits for it to connect, rank 1 for its gloo address: both fail
    in about the 2 s set, not the store's 30 min. (Bounded: the ranks are killed after 30 s.)"""
    def fn(r):
        if r == 2:
            time.sleep(5)  # alive, never joins (then leaves)
            return None
        t0 = time.perf_counter()
        try:
            du.init_process_group("gloo", 2)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            return ("failed", time.perf_counter() - t0, f"{type(e).__name__}: {e}"[:300])
        return ("joined", time.perf_counter() - t0, "")

    t0 = time.perf_counter()
    try:
        res = run_ranks(fn, world=3, timeout=30)
    except queue.Empty:
        pytest.fail(f"no rank failed within {time.perf_counter() - t0:.0f} s of a 2 s "
                    "--dist-timeout: the store still waits its own 30 minutes")
    for r in (0, 1):
        status, (what, took, why) = res[r]
        assert status == "ok" and what == "failed", res
        assert 1.5 <= took <= 20, res  # the 2 s timeout, not at once and not 30 min


def test_a_worker_of_the_agents_store_reads_a_lost_ranks_key_for_dist_timeout(tmp_path):
    """torchrun's default of one node: every worker is a client of the agent's store
    (TORCHELASTIC_USE_AGENT_STORE). The store's reads are bounded by --dist-timeout: NCCL's
    first collective reads the unique id that rank 0 writes (store.get); when rank 0 is lost
    there, the others fail after --dist-timeout, not after the store's 30 min. (gloo's own
    address exchange already used the group's timeout; the read below is the NCCL id's.)"""
    def fn(r):
        import os

        if r == 2:  # the agent: its store outlives the workers (until both are done, or 25 s)
            store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=True,
                                  wait_for_workers=False)
            end = time.time() + 25
            while time.time() < end and len(list(tmp_path.glob("done*"))) < 2:
                time.sleep(0.1)
            del store
            return None
        os.environ["WORLD_SIZE"] = "2"
        du.init_process_group("gloo", 2)
        store = dist.distributed_c10d._get_default_store()
        t0 = time.perf_counter()
        try:  # what rank 1 does for NCCL's id when rank 0 never writes it
            store.get("an id a lost rank never writes")
        except Exception as e:  # noqa: BLE001 - the test looks at it
            return ("failed", time.perf_counter() - t0, f"{type(e).__name__}: {e}"[:300])
        finally:
            (tmp_path / f"done{r}").touch()
        return ("read", time.perf_counter() - t0, "")

    t0 = time.perf_counter()
    try:
        res = run_ranks(fn, world=3, timeout=30,
                        env={"TORCHELASTIC_USE_AGENT_STORE": "True",
                             "TORCHELASTIC_RESTART_COUNT": "0"})
    except queue.Empty:
        pytest.fail(f"no worker failed within {time.perf_counter() - t0:.0f} s of a 2 s "
                    "--dist-timeout: the store still waits its own 30 minutes")
    for r in (0, 1):
        status, (what, took, why) = res[r]
        assert status == "ok" and what == "failed", res
        assert 1.5 <= took <= 20, res


def _measure(world):
    def fn(r):
        du.init_process_group("gloo", 30)
        x = _inputs(world, r)["video_cl_fp32"]
        rows = {}
        for label, shuf, unshuf in (("gather", _gather_shuffle, _gather_unshuffle),
                                    ("all_to_all", du.batch_shuffle, du.batch_unshuffle)):
            with _Received() as got:
                s, u = shuf(x, torch.Generator().manual_seed(SEED))
                unshuf(_keys(s), u)
            rows[label] = got.bytes
        return rows
    return [v for _, v in run_ranks(fn, world=world, timeout=120)]


if __name__ == "__main__":
    print(f"per shuffle + unshuffle, video [L={L}, 3, 4, 6, 6] fp32 channels-last "
          f"({3 * 4 * 6 * 6 * 4} B a clip), keys [L, 5] fp32; bytes received from other ranks")
    for w in (2, 4):
        got = _measure(w)
        print(f"world {w}: gather " + ", ".join(str(g["gather"]) for g in got)
              + " | all_to_all " + ", ".join(str(g["all_to_all"]) for g in got))
