"""What the ranks of a run must agree on at its start, with 2 CPU ranks (gloo) in forked
processes: the checkpoint to resume from and an agreed stop are rank 0's choice even where
another rank's listing lags (NFS); whether an attempt is a torchrun restart is agreed where
the ranks' counts differ; a lock file that cannot be written stops every rank in one line; a
collective that a rank never joins fails after --dist-timeout; and the --out lock does not
outlive its run in a forked loader worker."""

import errno
import os
import time

import pytest

from cmacc import checkpoint as ckpt
from cmacc import distributed as du
from cmacc.config import PRESETS, config_hash
from cmacc.data import data_record
from cmacc.trainer import Trainer
from data_dali import fileio
from ranks import run_ranks

CFG = PRESETS["tiny"]


def _trainer(out, **run):
    t = Trainer(CFG.replace(run=dict(out=str(out), **run)))
    t.rank, t.world, t.chash = du.rank(), du.world_size(), config_hash(CFG.model, CFG.selection)
    t.data = data_record(t.cfg.data)  # (_setup's: the resume checks the data too)
    return t


def _hide_from_rank_1(rank, names):
    """Rank 1's directory listing lags: it does not see ``names`` yet."""
    if rank == 1:
        listing = fileio.Path.iterdir
        fileio.Path.iterdir = lambda p: (q for q in listing(p) if q.name not in names)


def test_every_rank_resumes_from_rank_0s_choice_when_its_listing_lags(tmp_path):
    store = ckpt.Checkpoints(tmp_path, "run1")
    chash = config_hash(CFG.model, CFG.selection)
    for step in (2, 4):
        store.save(dict(model={}, config_hash=chash, data=data_record(CFG.data)), step)

    def rank_fn(rank):
        _hide_from_rank_1(rank, {"ckpt_00000004.pt"})
        du.init_process_group("gloo", 20)
        t = _trainer(tmp_path)
        path, state = t._find_resume()
        return path.name, int(state["step"]), t.run_id

    assert run_ranks(rank_fn) == [("ok", ("ckpt_00000004.pt", 4, "run1"))] * 2


def test_a_rank_that_cannot_read_rank_0s_choice_stops_every_rank_in_one_line(tmp_path):
    ckpt.Checkpoints(tmp_path, "run1").save(
        dict(model={}, config_hash=config_hash(CFG.model, CFG.selection),
             data=data_record(CFG.data)), 2)

    def rank_fn(rank):
        if rank == 1:  # the file rank 0 chose is not there yet for rank 1
            ckpt.load = lambda p: (_ for _ in ()).throw(FileNotFoundError(2, "No such file"))
        du.init_process_group("gloo", 20)
        _trainer(tmp_path)._find_resume()

    res = run_ranks(rank_fn)
    assert res[0] == res[1] and res[0][0] == "error", res
    assert res[0][1].startswith("UsageError: rank 1 cannot read checkpoint ") and \
        "ckpt_00000002.pt that rank 0 chose" in res[0][1] and "\n" not in res[0][1]


def test_a_restart_repeats_rank_0s_agreed_stop_on_every_rank(tmp_path):
    ckpt.write_stop(tmp_path, "the agreed line", 2, "job7", 5)

    def rank_fn(rank):
        if rank == 1:  # stopped.json not visible on rank 1's node yet
            ckpt.read_stop = lambda out, job: None
        du.init_process_group("gloo", 20)
        _trainer(tmp_path)._repeat_an_agreed_stop()

    env = dict(TORCHELASTIC_RUN_ID="job7", TORCHELASTIC_RESTART_COUNT="1")
    assert run_ranks(rank_fn, env=env) == [("error", "UsageError: the agreed line")] * 2


class _FullDisk:
    """A file whose writes fail as on a full disk (the rest is the real file's)."""

    def __init__(self, f):
        self._f = f

    def __getattr__(self, name):
        return getattr(self._f, name)

    def write(self, _text):
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("fault", ["open", "write"])
def test_a_lock_file_that_cannot_be_written_stops_every_rank_in_one_line(tmp_path, fault):
    real_open = open

    def faulty_open(*a, **k):
        if fault == "open":
            raise PermissionError(errno.EACCES, "Permission denied", a[0])
        return _FullDisk(real_open(*a, **k))

    def rank_fn(rank):
        if rank == 0:
            fileio.open = faulty_open
        du.init_process_group("gloo", 10)
        _trainer(tmp_path)._hold_out(tmp_path)

    res = run_ranks(rank_fn)
    why = "Permission denied" if fault == "open" else "No space left on device"
    assert res[0] == res[1] and res[0][0] == "error", res
    assert res[0][1].startswith(f"UsageError: --out {tmp_path}: cannot write its lock file "
                                ".run.lock (") and why in res[0][1], res
    fileio.hold_folder(tmp_path).close()  # the failed write let go of the lock


def test_a_collective_a_rank_never_joins_fails_after_dist_timeout(tmp_path):
    """--dist-timeout reaches the process group: rank 1 is alive but never joins the
    all-reduce; rank 0 fails after the 1 s set, not torch's 30 minutes (gloo's default)."""
    def rank_fn(rank):
        import torch
        import torch.distributed as dist

        t = Trainer(CFG.replace(run=dict(out=str(tmp_path), dist_timeout=1.0)))
        with t._process_group():
            if rank == 1:
                time.sleep(4)  # (then leaves: a closed connection would fail rank 0 at once)
                return None
            t0 = time.perf_counter()
            try:
                dist.all_reduce(torch.ones(1))
            except RuntimeError:
                return time.perf_counter() - t0
            return "joined"

    res = run_ranks(rank_fn)
    assert res[0][0] == "ok" and isinstance(res[0][1], float) and 0.9 < res[0][1] < 3.0, res


def test_the_out_lock_does_not_outlive_its_run_in_a_forked_worker(tmp_path):
    """A loader worker forked while the run holds --out shares the lock (one open file): once
    the run lets go, the folder is free although the worker still lives."""
    held = fileio.hold_folder(tmp_path)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: lives on until the test is done with it
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        held.close()
        fileio.hold_folder(tmp_path).close()  # FolderBusy while the worker lives, before the fix
    finally:
        os.close(w)
        os.waitpid(pid, 0)


def _stub_manifest(n):
    from types import SimpleNamespace

    return SimpleNamespace(file="m.csv", rows=[dict(id=f"c{i}", video=f"v{i}.webm", mel="")
                                               for i in range(n)])


def test_each_rank_lists_damaged_clips_in_its_own_file_and_a_resume_reads_them_all(tmp_path):
    """Appends from several nodes to one file are not atomic on NFS (and each rank wrote a
    header): one file a rank, one header each; a run resumed at another world size knows every
    clip listed; the stop's line names the files alike on every rank."""
    from data_dali.damaged import BadClips, rank_csv

    met = {0: [1, 2], 1: [2, 3]}  # clip 2 met by both ranks

    def rank_fn(rank):
        du.init_process_group("gloo", 20)
        bad = BadClips(_stub_manifest(8), list(range(8)), limit=0, stop_past_limit=False,
                       csv_path=rank_csv(tmp_path / "bad_clips.csv", rank, 2))
        for i in met[rank]:
            bad.record(i, "truncated")
        return bad.limit_message(2)

    lines = run_ranks(rank_fn)
    assert lines[0] == lines[1] and f"(listed in {tmp_path}/bad_clips.rank*.csv)" in lines[0][1]
    listed = []
    for rank in (0, 1):
        text = (tmp_path / f"bad_clips.rank{rank}.csv").read_text().splitlines()
        assert text[0] == "index,id,file,reason" and "index,id,file,reason" not in text[1:]
        rows = [int(row.split(",")[0]) for row in text[1:]]
        # only the clips this rank met, each once (clip 2, met by both, is in one file or in
        # both: a rank that has read the other's file first does not list it again)
        assert set(rows) <= set(met[rank]) and len(rows) == len(set(rows))
        listed += rows
    assert not (tmp_path / "bad_clips.csv").exists()
    resumed = BadClips(_stub_manifest(8), list(range(8)), limit=9,
                       csv_path=rank_csv(tmp_path / "bad_clips.csv", 0, 1))
    assert resumed.listed == {1, 2, 3} and set(listed) == {1, 2, 3}


SMALL = ["--preset", "tiny", "--clips", "32", "--classes", "4", "--batch-size", "4",
         "--dict-size", "8", "--pool-size", "16", "--sampler", "random", "--log-every", "2",
         "--device", "cpu", "--dist-timeout", "10"]


def _config(out, *flags):
    import train

    return train.config_from_args(train.build_parser().parse_args(
        SMALL + ["--out", str(out), *flags]))


@pytest.mark.parametrize("counts", [(1, 0), (0, 1)], ids=["rank0-counted", "rank1-counted"])
def test_ranks_whose_agents_counted_restarts_differently_start_the_same_way(tmp_path, counts):
    """torchrun counts restarts per agent (only the node whose worker failed counts; a
    replacement node starts at 0), so the ranks of one restarted attempt see different
    TORCHELASTIC_RESTART_COUNTs (set here per rank, 2 forked gloo ranks, whole runs). They must
    enter the same collectives and decide alike: with this job's agreed stop recorded, both
    repeat its line at once; without one, both resume from the checkpoint of the job's first
    attempt (--resume none applies to a first attempt only) and train on. (Before: the ranks
    with count 0 skipped the stop's broadcast, so the next broadcasts paired up across call
    sites: a rank unpacked None, or rank 0, seeing no restart, refused the folder.) Each rank
    is bounded by --dist-timeout 10 s and the whole by 60 s."""
    out = tmp_path / "run"
    Trainer(_config(out, "--steps", "2")).run()  # the job's first attempt (one process)
    env = dict(TORCHELASTIC_RUN_ID="job9", TORCHELASTIC_MAX_RESTARTS="3")

    def rank_fn(rank):
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(counts[rank])
        t = Trainer(_config(out, "--steps", "4", "--resume", "none"))
        t.run()
        return t.step, t.resumed_from.name if t.resumed_from else None, t.restart

    ckpt.write_stop(out, "the agreed line", 2, "job9", 2)
    assert run_ranks(rank_fn, env=env) == [("error", "UsageError: the agreed line")] * 2
    assert not (out / "ckpt_00000004.pt").exists()  # nothing trained
    (out / ckpt.STOP_FILE).unlink()
    assert run_ranks(rank_fn, env=env) == [("ok", (4, "ckpt_00000002.pt", 1))] * 2


def test_only_rank_0_reads_run_json_and_no_rank_keeps_the_loaded_checkpoint(tmp_path):
    """A rank other than 0 never reads OUT/run.json (here: every read of it on rank 1 fails, as
    a partial NFS read would), and once the run has resumed no rank holds the loaded state
    (~0.6 GB a rank at the paper preset): the checkpoint's model dict is freed before the first
    step."""
    import gc
    import weakref

    cfg = CFG.replace(data=dict(clips=64), run=dict(out=str(tmp_path), steps=2, log_every=1))
    assert Trainer(cfg).run()["steps"] == 2

    def rank_fn(rank):
        if rank == 1:
            ckpt.read_run = lambda out: (_ for _ in ()).throw(OSError(5, "Input/output error"))
        loaded, real_load, seen = [], ckpt.load, []

        def load(path):
            state = real_load(path)
            loaded.append(weakref.ref(state["model"]))
            return state

        ckpt.load = load
        real_step = Trainer._train_step

        def step(self, batch):
            gc.collect()
            seen.append(self.resume_from is None and all(r() is None for r in loaded))
            return real_step(self, batch)

        Trainer._train_step = step
        t = Trainer(cfg.replace(run=dict(steps=4)))
        t.run()
        return t.step, bool(loaded), all(seen)

    assert run_ranks(rank_fn) == [("ok", (4, True, True))] * 2


def test_a_rank_that_hangs_is_reported_with_where_it_waits():
    """run_ranks (this suite's harness) names the rank that gave no result and its stack."""

    def rank_fn(rank):
        if rank == 1:
            time.sleep(30)  # the line the report must name
        return rank

    with pytest.raises(AssertionError, match=r"(?s)ranks \[1\] gave no result in 4 s.*rank 1:.*"
                                             r"in rank_fn"):
        run_ranks(rank_fn, timeout=4)


def test_ranks_fork_safely_after_a_tqdm_bar_elsewhere_in_the_process():
    """A bar made elsewhere in the test process (torch.compile makes one) starts tqdm's
    monitor thread; run_ranks ends it before forking, so no rank can copy tqdm's lock held."""
    import threading

    from tqdm import tqdm

    monitor_interval = tqdm.monitor_interval
    try:
        tqdm.monitor_interval = 10
        tqdm(range(2), disable=True)
        assert any(t.name == "tqdm_monitor" for t in threading.enumerate())
        assert run_ranks(lambda rank: rank) == [("ok", 0), ("ok", 1)]
        assert not any(t.name == "tqdm_monitor" for t in threading.enumerate())
    finally:
        tqdm.monitor_interval = monitor_interval


class _WaitsInAFork:
    """Garbage in a reference cycle whose __del__ waits forever outside the process that made
    it, as a DALI pipeline's does for worker threads a fork does not copy."""

    def __init__(self):
        self.pid, self.me = os.getpid(), self

    def __del__(self):
        if os.getpid() != self.pid:
            time.sleep(3600)


def test_a_rank_never_collects_the_parents_garbage():
    """run_ranks collects the parent's garbage before forking and freezes the rest: a rank's
    collector never runs a finaliser of the parent's objects (CI met a DALI pipeline's)."""
    import gc

    gc.disable()  # (the cycle stays garbage until run_ranks collects it)
    try:
        _WaitsInAFork()
        assert run_ranks(lambda rank: gc.collect() >= 0, timeout=10) == [("ok", True)] * 2
    finally:
        gc.enable()
