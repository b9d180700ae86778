"""The training loop of CM-ACC pretraining, in one class: ``Trainer(cfg).run()``.

    from cmacc.config import PRESETS
    summary = Trainer(PRESETS["tiny"].replace(run=dict(steps=50, out="runs/x"))).run()

One iteration (``_train_step``): learning rate; the batch, already on the device (a background
thread runs the loader ahead and copies on a copy stream: cmacc/prefetch.py; channels_last_3d
video); forward under autocast (the model does momentum update, keys, active selection, enqueue
and the loss: cmacc/model.py), backward, the step's check on the device and the optimiser step
it gates (cmacc/guard.py: a non-finite step is never applied, and the host learns it one step
late); every ``log_every`` steps one log row (``_log_interval``: with checkpoints, the only
points where the host waits for the device's current step — metrics, rank agreement); a
checkpoint every ``ckpt_every`` steps, at the end and on SIGTERM/SIGINT. Resuming restores the
weights, optimiser, scaler, RNG, dictionaries, pools and the position in the epoch, so N + N
steps equal 2N steps bit for bit.

Another world size resumes too (a lost node, a bigger allocation; ``_resume_or_init``): what
is global continues — the global batch M, the clip sequence from its global position (the
data order does not depend on the world size: cmacc/data.py), dictionaries, pools, optimiser,
RNG — and what depends on the world size is re-derived: M / world clips per rank, shuffle-BN
over groups of that size, each global batch split world ways. The log says so in one line.
Only an M that does not divide over the new ranks is refused (``_setup``).

A run-ending condition is agreed by every rank (the per-step all-reduce, read one step late: a
non-finite step, more damaged clips in the run than --max-bad-clips — summed over the ranks,
earlier attempts included — a stop signal), so every rank stops after the same step
with the same line, said by every rank before any exits (``_end_together``); under torchrun the line is kept in OUT/stopped.json, and a restarted
attempt of the same job repeats it at once instead of redoing the work into the same failure
(``_repeat_an_agreed_stop``).

Under torchrun (WORLD_SIZE > 1) ``run`` creates the process group and always destroys it;
signal handlers are installed for the run only and the previous ones restored.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

from data_dali.cli import Interrupted, progress_bar, say_error
from data_dali.fileio import write_failure

from . import amp
from . import checkpoint as ckpt
from . import distributed as du
from .config import Config, config_hash
from .data import clip_fetcher, data_record, keep_clips_on_device, loader_line, train_loader
from .devices import autotune_convolutions, cuda_needs
from .fill import fill_epoch_pools, first_selecting_step, init_dictionaries
from .guard import GuardedAdam, NonFiniteLoss, StepGuard
from .metrics import (RunningMeans, SectionTimer, model_flops_per_clip, negative_diversity,
                      peak_flops)
from .model import CMACC
from .prefetch import Prefetcher
from .runfolder import RunFolder, UsageError
from .runlog import MetricsWriteError, RunLogger, StepMetrics, summarise, truncate_rows

log = logging.getLogger("cmacc")


def agreed(e: Exception) -> Exception:
    """``e``, marked as raised by every rank after the same step (an agreed stop)."""
    e.agreed = True
    return e


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------
# per-step scalars averaged per row (gnorm NaN where the sampler does not measure it)
MEANS = ("loss", "acc", "unique_per_m", "coverage", "gnorm", "fallback")


class Trainer(RunFolder):
    def __init__(self, cfg: Config):
        try:
            cfg.check_selection_batch()  # before any data or model: one line, not a traceback
        except ValueError as e:
            raise UsageError(str(e)) from None
        self.cfg = cfg
        self.out = Path(cfg.run.out)
        self.step = self.epoch = self.skip = self.batch_in_epoch = self.nonfinite = 0
        self.signalled = False  # set by SIGTERM/SIGINT on this rank
        self.signum = signal.SIGINT  # the signal received (the stop of every rank is agreed)
        self.stop_requested = False  # agreed by all ranks after every step
        self.too_many_bad = None  # the line of an agreed stop past --max-bad-clips
        self.bad_total = 0  # the run's damaged clips (every rank's, every attempt's): agreed
        self.logger = self.bar = self.store = self.stats = self.saved_step = None
        self.held = None  # rank 0: the open lock file of OUT (one run per folder)
        self.resumed_from = None  # the checkpoint this run resumed from (its path)
        # torchrun restarts of this job as every rank agrees (_agree_on_the_attempt); every
        # decision that depends on it reads this. None: not agreed yet (a first attempt)
        self.restart = None

    # -- public -------------------------------------------------------------------------------
    def run(self) -> dict:
        """Train to ``cfg.run.steps`` (resuming per ``cfg.run.resume``); returns the summary
        (rank 0; {} on other ranks). Stopped by SIGTERM/SIGINT: saves, then raises
        ``Interrupted`` (a cut-short run never returns a summary as if it had finished)."""
        try:
            return self._run()
        finally:
            if self.held is not None:  # OUT is free for the next command
                self.held.close()
                self.held = None

    def _run(self) -> dict:
        with self._process_group(), self._stop_on_signals():
            self._check_world()  # before any collective: a refusal costs nothing
            self._agree_on_the_attempt()
            try:
                self._repeat_an_agreed_stop()
            except (NonFiniteLoss, UsageError) as e:
                self._end_together(e)
                raise
            self._setup()
            try:
                self._resume_or_init()
                try:
                    while self.step < self.cfg.run.steps and not self.stop_requested:
                        self._train_epoch()
                    if self.saved_step != self.step:  # (an interval save may have just written it)
                        self.save("stop signal" if self.stop_requested else "end")
                except (NonFiniteLoss, UsageError) as e:  # ends the run (on every rank if agreed)
                    self._record_agreed_stop(e)
                    if isinstance(e, NonFiniteLoss) or getattr(e, "agreed", False):
                        self._end_together(e)
                    raise
            finally:
                if self.bar is not None:
                    self.bar.close()
                if self.logger is not None:
                    self.logger.close()
            if self.stop_requested and self.step < self.cfg.run.steps:
                raise Interrupted(
                    f"stopped by {signal.Signals(self.signum).name} after step {self.step} of "
                    f"{self.cfg.run.steps}; checkpoint {self.store.last} kept: run the same "
                    "command again to continue from it (--resume auto)", self.signum)
            if self.rank != 0:
                return {}
            first = first_selecting_step(self.cfg)
            try:
                return summarise(self.out, self.model.method, selected_steps=0 if first is None
                                 else max(0, self.step - first + 1))
            except OSError as e:
                raise self._write_error("summary.json", e) from None

    def save(self, reason: str) -> None:
        """Checkpoint: plain containers and tensors only (weights_only loads). Collective: the
        running means are averaged over ranks, rank 0 writes, and every rank learns whether
        the write succeeded (so a full disk stops all ranks, none waits in a collective)."""
        self._take_records(self.step)  # this step's check completes before anything is saved
        means = self.means.state_dict()
        self.saved_step = self.step
        error = None
        if self.rank == 0:
            state = dict(model=self.model.state_dict(), optimizer=self.opt.state_dict(),
                         scaler=self.scaler.state_dict(), rng=ckpt.rng_state(), epoch=self.epoch,
                         batch_in_epoch=self.batch_in_epoch, config_hash=self.chash,
                         config=self.cfg.to_dict(), data=self.data, world_size=self.world,
                         means=means, nonfinite=self.nonfinite)
            try:
                log.info("checkpoint (%s): %s", reason, self.store.save(state, self.step))
            except Exception as e:  # a full disk (torch: RuntimeError "unexpected pos"), a
                error = e  # vanished folder: the temporary is gone, the previous one stays
        if self.world > 1:  # rank 0 tells every rank the file it wrote (None: it failed)
            told = [str(self.store.last) if self.rank == 0 and error is None else None]
            dist.broadcast_object_list(told, 0)
            if told[0] is None and error is None:
                raise agreed(UsageError(f"rank 0 could not write the checkpoint of step "
                                        f"{self.step} in {self.out} (its log says why); resume "
                                        "with --resume auto"))
            if told[0] is not None:  # each rank's stop line names the checkpoint
                self.store.last = Path(told[0])
        if error is not None:
            raise agreed(self._write_error(f"the checkpoint of step {self.step}", error)) from None

    # -- agreed stops under torchrun -------------------------------------------------------------
    def _record_agreed_stop(self, e: Exception) -> None:
        """Rank 0 keeps the line of a run-ending error in OUT/stopped.json for the attempts that
        torchrun would restart into the same failure (only under torchrun with --max-restarts;
        best effort: a full disk that ended the run may refuse this file too)."""
        if self.rank != 0 or not du.restarts_allowed():
            return
        code = 1 if isinstance(e, NonFiniteLoss) else 2
        try:
            ckpt.write_stop(self.out, str(e), code, du.elastic_run_id(),
                            getattr(e, "step", self.step))  # (a non-finite step: the steps before it)
        except Exception as w:  # noqa: BLE001 - the run's own error is the one to report
            log.warning("could not write %s (%s): a restarted attempt will redo the steps since "
                        "the last checkpoint", self.out / ckpt.STOP_FILE, w)

    def _end_together(self, e: Exception) -> None:
        """An agreed stop under torchrun: each rank says its line, then waits for the others
        before it exits (torchrun ends the ranks still running once one has exited, which could
        cut a rank off before its line)."""
        if du.is_dist() and du.world_size() > 1:
            say_error(e)
            with contextlib.suppress(Exception):  # a lost rank: the others' lines are said
                dist.barrier()

    def _agree_on_the_attempt(self) -> None:
        """Whether this is a restarted attempt of a torchrun job, decided once, the same on
        every rank (``du.job_restart_count``: the largest count of any rank), before any
        decision that depends on it: repeating an agreed stop, clearing its record, tolerating
        a busy lock, overriding --resume. torchrun's agents count per node (only the node whose
        worker failed counts; a membership change is not counted; a replacement node starts at
        0): ranks that each read their own count would skip collectives the others enter, and
        hang or unpack another call's broadcast. Every rank calls it, at the start of the run."""
        self.restart = du.job_restart_count()

    def _repeat_an_agreed_stop(self) -> None:
        """A torchrun restart of a job whose ranks agreed to stop: the same line and exit code at
        once, before any work; rank 0 reads the record for every rank (another node's listing
        may lag behind). (The first attempt of a job — a new command, after the fix — removes
        the record instead: ``_prepare_out``.) Every rank calls it, at the same point."""
        if self.restart is None:  # (called on its own)
            self._agree_on_the_attempt()
        if not du.elastic_run_id() or not self.restart:
            return
        stop = du.agree(lambda: ckpt.read_stop(self.out, du.elastic_run_id()))
        if stop is None:
            return
        log.info("torchrun restart %d: this job's ranks agreed to stop at step %s; not "
                 "training again into the same failure", self.restart, stop["step"])
        if stop["code"] == 1:
            raise NonFiniteLoss(stop["line"])
        raise agreed(UsageError(stop["line"]))

    def _write_error(self, what: str, e: BaseException) -> UsageError:
        """One line for a write that failed (full disk, vanished folder: any exception type)."""
        return UsageError(f"cannot write {what} in {self.out} ({write_failure(e, self.out)}); "
                          f"the last good checkpoint is {self.store.last or 'none yet'}: free "
                          "space or fix the folder, then resume with --resume auto")

    # -- set-up -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _process_group(self):
        """torchrun sets WORLD_SIZE / RANK / LOCAL_RANK; the group lives for this run only."""
        run = self.cfg.run
        if run.device == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"device cuda requested but CUDA is not usable: {cuda_needs()}; "
                             "install for your driver (README, Install: make install CUDA=12) "
                             "or use --device cpu")
        created = False
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not du.is_dist():
            local = int(os.environ.get("LOCAL_RANK", "0"))
            try:
                backend = du.backend_for(run.device, run.dist_backend)
                index = (du.rank_device(local, torch.cuda.device_count(), backend)
                         if run.device == "cuda" else None)
            except ValueError as e:
                raise UsageError(str(e)) from None
            if index is not None:
                if index != local:
                    log.warning("LOCAL_RANK %d shares GPU %d (--dist-backend gloo, more ranks "
                                "than GPUs: a test of the distributed paths, not a fast run)",
                                local, index)
                torch.cuda.set_device(index)
            try:
                du.init_process_group(backend, run.dist_timeout)
            except dist.DistError as e:  # the store or a peer never answered in time
                raise UsageError(
                    f"the {os.environ.get('WORLD_SIZE')} ranks did not form a group within "
                    f"--dist-timeout {run.dist_timeout:g} s (rank {os.environ.get('RANK')}: "
                    f"{str(e).splitlines()[0][:200]}); a node never started its worker or hangs "
                    "before joining; --out is unchanged: run the same command again once every "
                    "node is up") from None
            created = True
            warning = du.shared_store_warning()
            if warning and du.rank() == 0:
                log.warning(warning)
        try:
            yield
        finally:
            if created:
                dist.destroy_process_group()

    @contextlib.contextmanager
    def _stop_on_signals(self):
        """SIGTERM/SIGINT ask the loop to stop after the current step and save."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be installed from the main thread
            return
        sigs = (signal.SIGTERM, signal.SIGINT)
        old = {s: signal.getsignal(s) for s in sigs}
        for s in sigs:
            signal.signal(s, self._request_stop)
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _request_stop(self, signum, _frame):
        self.signalled, self.signum = True, signum
        if du.world_size() == 1:
            self.stop_requested = True

    def _check_world(self):
        """The global batch M divides over the ranks, at least 2 clips each (BatchNorm)."""
        self.rank, self.world = du.rank(), du.world_size()
        m = self.cfg.model.batch_size
        if m % self.world or m // self.world < 2:  # the world sizes a run cannot continue at
            fits = [w for w in range(1, m // 2 + 1) if m % w == 0]  # (BatchNorm: 2 clips a rank)
            raise UsageError(f"--batch-size {m} (global M) does not divide over {self.world} "
                             "ranks into at least 2 clips each (BatchNorm); use a multiple of "
                             f"{2 * self.world} for a new run, or run this one on a number of "
                             f"ranks that divides it so ({', '.join(map(str, fits))})")

    def _setup(self):
        cfg = self.cfg
        self._check_world()
        self.device = (torch.device("cuda", torch.cuda.current_device()) if cfg.run.device == "cuda"
                       else torch.device("cpu"))
        self.chash = config_hash(cfg.model, cfg.selection)
        if not cfg.data.synthetic:  # absolute: eval and export find it from any folder
            self.cfg = cfg = cfg.replace(data=dict(source=str(Path(cfg.data.source).resolve())))
        self.data = data_record(cfg.data)  # part of the run's identity (_same_data)
        self._prepare_out()
        self.resume_from = self._find_resume()  # before any work: a refusal costs nothing
        torch.manual_seed(cfg.model.seed)  # identical initial weights on every rank
        views = 2 if cfg.model.objective == "smoco" else 1
        try:
            loader = train_loader(cfg.data, batch_size=cfg.model.batch_size,
                                  seed=cfg.model.seed, rank=self.rank, world=self.world,
                                  views=views, device=self.device, out=self.out,
                                  stop_past_limit=False)  # agreed: StepGuard
        except (FileNotFoundError, ValueError) as e:  # (a manifest's words start with its path)
            said = str(e) if str(e).startswith(cfg.data.source) else f"{cfg.data.source}: {e}"
            raise UsageError(f"--data {said}") from None
        where = keep_clips_on_device(loader, self.device)
        log.info("loader: %s%s", loader_line(loader), where)
        # the loader runs ahead in a thread; batches come on the device (cmacc/prefetch.py)
        self.loader = Prefetcher(loader, self.device, depth=cfg.data.prefetch,
                                 channels_last=cfg.optim.channels_last)
        autotune_convolutions(self.device, cfg.optim.cudnn_benchmark)
        self.model = model = CMACC(cfg.model, cfg.selection).to(self.device)
        model.shuffle_bn = cfg.run.shuffle_bn
        if cfg.selection.pool_refresh:
            model.fetch = clip_fetcher(loader, self.device)
        if cfg.optim.channels_last:
            model.f_v.to(memory_format=torch.channels_last_3d)
            model.h_v.to(memory_format=torch.channels_last_3d)
        # fused Adam: its step is skipped on the device when the guard says so (no host sync)
        self.opt = GuardedAdam(model.query_parameters(), lr=cfg.optim.lr,
                               weight_decay=cfg.optim.weight_decay)
        run = cfg.run
        self.guard = StepGuard(self.device, self.world, max_skipped=run.max_nonfinite
                               if run.on_nonfinite == "skip" else 0,
                               halt_on_nonfinite=run.on_nonfinite == "stop")
        if cfg.optim.compile:  # in place: state-dict keys unchanged, before the DDP wrap
            model.f_v.backbone.compile()
            model.f_a.backbone.compile()
        self.step_fn = model
        if self.world > 1:  # query-encoder gradients all-reduced; buffers kept in lock-step
            self.step_fn = du.wrap_ddp(model)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.optim.amp == "fp16")
        labels = getattr(self.loader, "labels", None)
        self.labels = labels.to(self.device) if labels is not None else None
        self.timer = model.timer = SectionTimer(self.device)
        self.means = RunningMeans(MEANS, self.device)
        self.flops_clip, self.peak = None, peak_flops(self.device)
        self.last_enq, self.t0, self.waited = None, time.perf_counter(), 0.0

    def _resume_or_init(self):
        cfg, model = self.cfg, self.model
        purge = None
        if self.resume_from is not None:
            path, state = self.resume_from  # (dropped below, once loaded)
            model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
            self.scaler.load_state_dict(state["scaler"])
            ckpt.set_rng_state(state["rng"])
            self.step, self.epoch = int(state["step"]), int(state["epoch"])
            self.skip = self.batch_in_epoch = int(state["batch_in_epoch"])
            self.means.load_state_dict(state["means"])
            self.nonfinite = int(state.get("nonfinite", 0))
            self.guard.start(self.nonfinite)
            purge = self._drop_rows_after(self.step)
            self.saved_step = self.step
            log.info("resumed run %s from %s at step %d", self.run_id, path, self.step)
            self._log_world_change(int(state.get("world_size", self.world)))
        else:
            if cfg.model.objective == "cross":
                init_dictionaries(model, self.loader, cfg.run.dict_init, self.device)
            purge = self._drop_rows_after(0)
        self.store = ckpt.Checkpoints(self.out, self.run_id, keep=cfg.run.keep,
                                      writer=self.rank == 0)  # (only rank 0 reads run.json)
        if self.resume_from is not None:
            self.store.last = self.resumed_from = self.resume_from[0]
            self.resume_from = None  # the loaded state (~0.6 GB at the paper preset) is let go
        self.logger = RunLogger(self.out, enabled=self.rank == 0, tensorboard=cfg.run.tensorboard,
                                purge_step=purge, total=cfg.run.steps, start_step=self.step)
        bad = getattr(self.loader, "bad", None)
        if bad is not None:  # the run's damaged clips so far, as the ranks agreed (rank 0 writes)
            self.bad_total = bad.share(0)  # (until the first step's record: the earlier ones)
            self.logger.counters["bad_clips"] = lambda: float(self.bad_total)
        if self.rank == 0:
            log.info("%s | run %s | %s | world %d | M=%d K=%d N=%d | amp %s | out %s", model.method,
                     self.run_id, self.device, self.world, cfg.model.batch_size,
                     cfg.model.dict_size, cfg.selection.pool_size, cfg.optim.amp, self.out)
            self._warn_selection()
            self.bar = progress_bar(total=cfg.run.steps, initial=self.step, desc=model.method,
                                    dynamic_ncols=True)
        self.t0, self.waited = time.perf_counter(), 0.0

    def _warn_selection(self) -> None:
        """A run named CM-ACC (or another selecting sampler) that would never select, and a
        dictionary larger than the dataset, are said at the start, with the fix."""
        cfg, first = self.cfg, first_selecting_step(self.cfg)
        m, k, n = cfg.model.batch_size, cfg.model.dict_size, cfg.selection.pool_size
        if first is not None and first > cfg.run.steps:
            log.warning("--sampler %s selects from step %d (its rolling pool must first hold "
                        "min(N, K + M) = %d keys at M = %d a step), after the last step %d: this "
                        "run never selects and trains as XMoCo; pass more --steps, a smaller "
                        "--dict-size, or --pool-mode epoch", cfg.selection.sampler, first,
                        min(n, k + m), m, cfg.run.steps)
        clips = getattr(self.loader, "num_clips", None)
        if clips is not None and k > clips:
            log.warning("--dict-size %d is larger than the dataset (%d clips): the dictionary "
                        "holds clips more than once, a batch's own positives included; pass a "
                        "--dict-size below %d, or more data", k, clips, clips)

    def _log_world_change(self, was: int) -> None:
        """One line: what a resume on another number of ranks re-derived, and what continues."""
        if was == self.world:
            return
        m = self.cfg.model.batch_size
        log.info("world size %d -> %d: %d clips per rank (was %d), shuffle-BN over groups of %d "
                 "(was %d), each global batch split %d ways (was %d); the global batch M=%d, the "
                 "clip sequence from epoch %d batch %d, dictionaries, pools and optimiser continue",
                 was, self.world, m // self.world, m // was, m // self.world, m // was,
                 self.world, was, m, self.epoch, self.batch_in_epoch)

    def _drop_rows_after(self, step: int) -> int:
        """metrics.csv keeps the rows an uninterrupted run has at ``step``: those up to it on
        the log grid (a run's off-grid last row is replayed; its means are in the checkpoint).
        Returns the first TensorBoard step to purge."""
        every = self.cfg.run.log_every
        if self.rank == 0:
            n = truncate_rows(self.out / "metrics.csv",
                              lambda r: int(r["step"]) < step or
                              (int(r["step"]) == step and step % every == 0))
            if n:
                log.info("metrics.csv: dropped %d row(s) past step %d (replayed now)", n, step)
        return step + 1 if step % every == 0 else step

    # -- the loop -------------------------------------------------------------------------------
    def _train_epoch(self):
        cfg, timer = self.cfg, self.timer
        if cfg.selection.pool_mode == "epoch" and cfg.model.objective == "cross" and self.skip == 0:
            fill_epoch_pools(self.model, self.loader, self.device, self.epoch)  # (restored from
        self.loader.set_epoch(self.epoch, start=self.skip)  # the checkpoint when resuming)
        self.batch_in_epoch = self.skip  # resuming mid-epoch: the rest of the same epoch
        td, tw = timer.start(), time.perf_counter()
        with contextlib.closing(iter(self.loader)) as batches:  # (closing stops the thread)
            ended = self._run_batches(batches, td, tw)
        if ended:  # the epoch ran out: a save from here on (a stop, the end) names the next one
            self.epoch, self.skip, self.batch_in_epoch = self.epoch + 1, 0, 0

    def _run_batches(self, batches, td, tw) -> bool:
        """The steps of one epoch's batches; True if the epoch ran out."""
        cfg, timer = self.cfg, self.timer
        for batch in batches:
            if self.step >= cfg.run.steps or self.stop_requested:
                return False
            timer.stop("data", td)
            self.waited += time.perf_counter() - tw  # host wall time spent waiting for data
            self.stats = self._train_step(batch)
            on_grid = self.step % cfg.run.log_every == 0
            saving = cfg.run.ckpt_every and self.step % cfg.run.ckpt_every == 0
            if on_grid or saving or self.step == cfg.run.steps:
                self._take_records(self.step)  # waits for this step: a row or a save follows
            if on_grid or self.step == cfg.run.steps:
                try:
                    self._log_interval(self.stats, reset=on_grid)  # an off-grid last row keeps its sums
                except MetricsWriteError as e:  # rank 0 only: torchrun then ends the others
                    raise self._write_error(e.what, e.__cause__) from None
            if self.too_many_bad:  # agreed by every rank: this step is kept, then all stop
                if self.saved_step != self.step:
                    self.save("too many damaged clips")
                raise agreed(UsageError(self.too_many_bad))
            if saving:
                self.save("interval")
            td, tw = timer.start(), time.perf_counter()
        return True

    def _train_step(self, batch) -> dict:
        """One iteration, queued without waiting for the device: its update is applied only if
        the guard finds it finite (on the device); the previous step's record is read here."""
        cfg, dev, model = self.cfg, self.device, self.model
        ts = self.timer.start()
        for group in self.opt.param_groups:
            group["lr"] = cfg.optim.lr_at(self.step)
        video = batch["video"]  # [B, C, T, H, W] (channels-last from the prefetcher)
        audio, index = batch["audio"], batch["index"]  # [B, mel, frames], [B]
        kw = {}
        if "video2" in batch:
            kw = dict(video2=batch["video2"], audio2=batch["audio2"])
        if self.flops_clip is None:
            self.flops_clip = model_flops_per_clip(model, video, audio)
        with amp.precision(dev, cfg.optim.amp):  # autocast (+ the CPU bf16 Conv3d guard)
            loss, stats = self.step_fn(video, audio, index, step=self.step, **kw)
        self.opt.zero_grad(set_to_none=True)
        with record_function("backward"):
            self.scaler.scale(loss).backward()
        with record_function("optimizer"):
            grads = [] if self.scaler.is_enabled() else [  # (fp16: the GradScaler checks them)
                p.grad for p in model.query_parameters() if p.grad is not None]
            damaged = getattr(self.loader, "bad", None)  # the ranks' shares add up to the run's
            self.opt.skip = skip = self.guard.check(
                self.step, loss, (model.dict_v.keys, model.dict_a.keys), grads, self.signalled,
                damaged.share(self.rank) if damaged is not None else 0)
            self.scaler.step(self.opt)
            self.scaler.update()
        self.timer.stop("step", ts)
        self.step += 1
        self.batch_in_epoch += 1
        if self.bar is not None:
            self.bar.update(1)
        self.last_enq = stats["enq_index_v"]
        zero, nan = torch.zeros((), device=dev), torch.full((), float("nan"), device=dev)
        div = (negative_diversity(self.last_enq, self.labels, self.loader.num_classes)
               if self.labels is not None else {"unique_per_m": nan, "coverage": nan})
        self.means.add(weight=1 - skip, loss=loss.detach().float(), acc=stats["acc"].float(),
                       **div, gnorm=stats.get("gnorm", nan).float(),
                       fallback=stats.get("fallback", zero).float())
        with record_function("sync"):  # the previous step's check (its work has run by now)
            self._take_records(self.step - 1)
        return stats

    def _take_records(self, upto: int) -> None:
        """Act on the guard's records of steps up to ``upto`` (1-based: the steps done): stop
        requests, the run's damaged clips past the limit (every rank, the same step: the sum of
        the ranks' shares, earlier attempts included) and non-finite steps, whose updates the
        device has already skipped."""
        damaged = getattr(self.loader, "bad", None)
        for r in self.guard.read(upto - 1):
            self.stop_requested = self.stop_requested or r["signalled"]
            self.bad_total = r["damaged"]
            if damaged is not None and r["damaged"] > damaged.limit and not self.too_many_bad:
                self.too_many_bad = damaged.limit_message(r["damaged"])
            if r["bad"]:
                self._handle_nonfinite(r["step"], r["bad"])

    def _handle_nonfinite(self, step: int, what: list[str]) -> None:
        """Step ``step`` (0-based) was non-finite and not applied: count it, or end the run."""
        run = self.cfg.run
        self.nonfinite += 1
        where = (f"non-finite {' and '.join(what)} at step {step + 1} (lr "
                 f"{self.cfg.optim.lr_at(step):.2e}, amp {self.cfg.optim.amp})")
        if run.on_nonfinite == "skip" and "dictionaries" not in what and \
                self.nonfinite <= run.max_nonfinite:
            log.warning("%s: step skipped (%d of at most %d)", where, self.nonfinite,
                        run.max_nonfinite)
            return
        why = ("more than --max-nonfinite steps skipped" if run.on_nonfinite == "skip" and
               "dictionaries" not in what else "")
        e = NonFiniteLoss(
            f"{where}{'; ' + why if why else ''}: stopped before any update or save; the last "
            f"good checkpoint is {self.store.last or 'none (nothing was saved yet)'}. Lower --lr, "
            "use --amp none or --on-nonfinite skip, and resume from it with --resume auto")
        e.step = step  # the steps applied before it
        raise e

    def _selection_alone(self, secs: dict, n: int) -> float:
        """Seconds one step's selections take alone on the device, for a log row: where they
        overlap the key encoders (a CUDA side stream) they run again once, alone
        (``CMACC.time_selection_alone``: after the row's sync and its wall time, outside
        every step); in line they ran alone already: t_select."""
        if not (self.device.type == "cuda" and self.model.sel.overlap):
            return secs.get("select", 0.0) / n
        return self.model.time_selection_alone()

    def _log_interval(self, stats, reset: bool = True):
        """One metrics row; with the non-finite check, the only host syncs of the loop."""
        cfg, n = self.cfg, self.means.count
        m = self.means.means(reset=reset)
        if m["steps"] == 0:  # every step since the last row was skipped (non-finite)
            return
        du.verify_ranks_agree(self.model, self.chash, self.last_enq, self.step)
        secs = self.timer.collect()
        wall = time.perf_counter() - self.t0
        alone = self._selection_alone(secs, n)
        clips_s = n * cfg.model.batch_size / wall / self.world
        dev = self.device
        self.logger.write(StepMetrics(
            step=self.step, epoch=self.epoch, loss=m["loss"], acc=m["acc"],
            lr=self.opt.param_groups[0]["lr"], clips_per_s=clips_s,
            unique_per_m=m["unique_per_m"], coverage=m["coverage"],
            gnorm=m["gnorm"], active=float(stats.get("active", 0.0)), fallback=m["fallback"],
            t_data=secs.get("data", 0.0) / n, t_step=secs.get("step", 0.0) / n,
            t_select=secs.get("select", 0.0) / n,
            t_refresh=secs.get("refresh", 0.0) / n,  # (model.refresh_pools, within t_step)
            # the step's wait for the selection, at most all of it (docs/ARCHITECTURE.md)
            t_select_visible=min(secs.get("select_visible", 0.0), secs.get("select", 0.0)) / n,
            t_select_alone=alone,
            mfu=(self.flops_clip * clips_s / self.peak) if (self.peak and self.flops_clip)
            else float("nan"),
            mem_gb=(torch.cuda.max_memory_allocated(dev) / 2**30) if dev.type == "cuda"
            else float("nan"), nonfinite=float(self.nonfinite), data_wait=self.waited / wall))
        self.t0, self.waited = time.perf_counter(), 0.0
