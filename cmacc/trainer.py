"""The training loop of CM-ACC pretraining, in one class: ``Trainer(cfg).run()``.

    from cmacc.config import PRESETS
    summary = Trainer(PRESETS["tiny"].replace(run=dict(steps=50, out="runs/x"))).run()

One iteration (``_train_step``): learning rate, batch to the device (channels_last_3d video),
forward under autocast (the model does momentum update, keys, active selection, enqueue and the
loss: cmacc/model.py), backward, optimiser step; every ``log_every`` steps one log row
(``_log_interval``: the only host syncs — metrics, rank agreement, stop agreement); a
checkpoint every ``ckpt_every`` steps, at the end and on SIGTERM/SIGINT. Resuming restores the
weights, optimiser, scaler, RNG, dictionaries, pools and the position in the epoch, so N + N
steps equal 2N steps bit for bit.

Under torchrun (WORLD_SIZE > 1) ``run`` creates the process group and always destroys it;
signal handlers are installed for the run only and the previous ones restored.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from . import amp
from . import checkpoint as ckpt
from . import distributed as du
from .config import Config, config_hash
from .data import train_loader
from .metrics import (RunningMeans, SectionTimer, category_diversity, model_flops_per_clip,
                      peak_flops)
from .model import CMACC
from .runlog import RunLogger, StepMetrics, summarise

log = logging.getLogger("cmacc")


class UsageError(ValueError):
    """A mistake in what the user asked for (flags, files, devices): the message says which and
    what to do. ``train.py`` prints it as one line and exits 2."""


class NonFiniteLoss(RuntimeError):
    """The loss became NaN/Inf; the last good checkpoint is kept."""


# ----------------------------------------------------------------------------------------------
# Dictionaries and pools from encoded clips (paper Alg. 1 lines 3-4 and 6-7)
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def encode_random_clips(model, loader, n, device, seed):
    """Key-encoder outputs (k_v, k_a, index) of n random clips of the global dataset (drawn
    with replacement across passes when the dataset is smaller than n). Same on every rank."""
    ks_v, ks_a, idx, got = [], [], [], 0
    g = torch.Generator().manual_seed(seed)
    while got < n:
        loader.set_epoch(10_000 + int(torch.randint(0, 1 << 30, (1,), generator=g)))
        for batch in loader:
            kv, ka = model.encode_clips(batch["video"].to(device), batch["audio"].to(device))
            ks_v.append(du.gather_cat(kv))
            ks_a.append(du.gather_cat(ka))
            idx.append(du.gather_cat(batch["index"].to(device)))
            got += idx[-1].shape[0]
            if got >= n:
                break
    return torch.cat(ks_v)[:n], torch.cat(ks_a)[:n], torch.cat(idx)[:n]


def init_dictionaries(model, loader, how, device):
    """D_v, D_a ← key encodings of K random clips ('encode', the paper) or random unit keys."""
    if how == "random":
        return
    kv, ka, idx = encode_random_clips(model, loader, model.cfg.dict_size, device, model.cfg.seed)
    model.dict_v.fill(kv, idx)
    model.dict_a.fill(ka, idx)


def fill_epoch_pools(model, loader, device, epoch):
    """U_v, U_a ← key encodings of N random clips, at each epoch start (pool mode 'epoch')."""
    kv, ka, idx = encode_random_clips(model, loader, model.sel.pool_size, device,
                                      model.cfg.seed * 31 + epoch + 1)
    model.pool_v.fill(kv, idx)
    model.pool_a.fill(ka, idx)


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------
MEANS = ("loss", "acc", "diversity", "gnorm", "fallback")  # per-step scalars averaged per row


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.out = Path(cfg.run.out)
        self.step = self.epoch = self.skip = self.batch_in_epoch = 0
        self.stop_requested = False

    # -- public -------------------------------------------------------------------------------
    def run(self) -> dict:
        """Train to ``cfg.run.steps`` (resuming per ``cfg.run.resume``); returns the summary
        (rank 0; {} on other ranks)."""
        with self._process_group(), self._stop_on_signals():
            self._setup()
            try:
                self._resume_or_init()
                while self.step < self.cfg.run.steps and not self.stop_requested:
                    self._train_epoch()
                self.save("stop signal" if self.stop_requested else "end")
            finally:
                if self.bar is not None:
                    self.bar.close()
                self.logger.close()
            if self.rank != 0:
                return {}
            return summarise(self.logger.history, self.model.method, self.out)

    def save(self, reason: str) -> None:
        """Checkpoint (rank 0): plain containers and tensors only (weights_only loads)."""
        if self.rank != 0:
            return
        state = dict(model=self.model.state_dict(), optimizer=self.opt.state_dict(),
                     scaler=self.scaler.state_dict(), rng=ckpt.rng_state(), step=self.step,
                     epoch=self.epoch, batch_in_epoch=self.batch_in_epoch,
                     config_hash=self.chash, config=self.cfg.to_dict(), world_size=self.world)
        p = ckpt.save_atomic(state, ckpt.checkpoint_path(self.out, self.step))
        ckpt.prune(self.out)
        log.info("checkpoint (%s): %s", reason, p)

    # -- set-up -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _process_group(self):
        """torchrun sets WORLD_SIZE / RANK / LOCAL_RANK; the group lives for this run only."""
        run = self.cfg.run
        if run.device == "cuda" and not torch.cuda.is_available():
            raise UsageError("device cuda requested but no CUDA device is visible; use --device cpu")
        created = False
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not du.is_dist():
            if run.device == "cuda":
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            dist.init_process_group("nccl" if run.device == "cuda" else "gloo")
            created = True
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

    def _request_stop(self, *_):
        self.stop_requested = True

    def _setup(self):
        cfg = self.cfg
        self.rank, self.world = du.rank(), du.world_size()
        if cfg.model.batch_size % self.world:
            raise UsageError(f"--batch-size {cfg.model.batch_size} (global M) does not divide over "
                             f"{self.world} ranks; use a multiple of {self.world}")
        self.device = (torch.device("cuda", torch.cuda.current_device()) if cfg.run.device == "cuda"
                       else torch.device("cpu"))
        torch.manual_seed(cfg.model.seed)  # identical initial weights on every rank
        self.out.mkdir(parents=True, exist_ok=True)
        views = 2 if cfg.model.objective == "smoco" else 1
        try:
            self.loader = train_loader(cfg.data, batch_size=cfg.model.batch_size,
                                       seed=cfg.model.seed, rank=self.rank, world=self.world,
                                       views=views, device=self.device)
        except (FileNotFoundError, ValueError) as e:
            raise UsageError(f"--data {cfg.data.source}: {e}") from None
        self.model = model = CMACC(cfg.model, cfg.selection).to(self.device)
        model.shuffle_bn = cfg.run.shuffle_bn
        if cfg.optim.channels_last:
            model.f_v.to(memory_format=torch.channels_last_3d)
            model.h_v.to(memory_format=torch.channels_last_3d)
        self.opt = torch.optim.Adam(model.query_parameters(), lr=cfg.optim.lr,
                                    weight_decay=cfg.optim.weight_decay)
        self.step_fn = model
        if self.world > 1:  # query-encoder gradients all-reduced; buffers kept in lock-step
            self.step_fn = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
        if cfg.optim.compile:
            model.f_v.backbone = torch.compile(model.f_v.backbone)
            model.f_a.backbone = torch.compile(model.f_a.backbone)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.optim.amp == "fp16")
        labels = getattr(self.loader, "labels", None)
        self.labels = labels.to(self.device) if labels is not None else None
        self.chash = config_hash(cfg.model, cfg.selection)
        self.timer = model.timer = SectionTimer(self.device)
        self.means = RunningMeans(MEANS, self.device)
        self.logger = RunLogger(self.out, enabled=self.rank == 0, tensorboard=cfg.run.tensorboard)
        self.flops_clip, self.peak = None, peak_flops(self.device)
        self.last_enq, self.t0, self.bar = None, time.perf_counter(), None

    def _resume_or_init(self):
        cfg, model = self.cfg, self.model
        found, resume = None, cfg.run.resume
        if resume == "auto":
            found = ckpt.find_latest_valid(self.out)
        elif resume != "none":
            try:
                found = (Path(resume), ckpt.load(resume))
            except Exception as e:
                raise UsageError(f"--resume {resume}: cannot load this checkpoint ({e})") from None
        if found is not None:
            path, state = found
            if state.get("config_hash") != self.chash:
                raise UsageError(f"checkpoint {path} was made with a different model config; use "
                                 "another --out, or --resume none to start afresh")
            model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
            self.scaler.load_state_dict(state["scaler"])
            ckpt.set_rng_state(state["rng"])
            self.step, self.epoch = int(state["step"]), int(state["epoch"])
            self.skip = self.batch_in_epoch = int(state["batch_in_epoch"])
            log.info("resumed from %s at step %d", path, self.step)
        elif cfg.model.objective == "cross":
            init_dictionaries(model, self.loader, cfg.run.dict_init, self.device)
        if self.rank == 0:
            from tqdm import tqdm

            log.info("%s | %s | world %d | M=%d K=%d N=%d | amp %s | out %s", model.method,
                     self.device, self.world, cfg.model.batch_size, cfg.model.dict_size,
                     cfg.selection.pool_size, cfg.optim.amp, self.out)
            self.bar = tqdm(total=cfg.run.steps, initial=self.step, desc=model.method,
                            dynamic_ncols=True, disable=not sys.stderr.isatty())
        self.t0 = time.perf_counter()

    # -- the loop -------------------------------------------------------------------------------
    def _train_epoch(self):
        cfg, timer = self.cfg, self.timer
        if cfg.selection.pool_mode == "epoch" and cfg.model.objective == "cross" and self.skip == 0:
            fill_epoch_pools(self.model, self.loader, self.device, self.epoch)  # (restored from
        self.loader.set_epoch(self.epoch)                 # the checkpoint when resuming mid-epoch)
        self.batch_in_epoch = 0
        td = timer.start()
        for batch in self.loader:
            if self.batch_in_epoch < self.skip:  # resuming mid-epoch: same order as uninterrupted
                self.batch_in_epoch += 1
                continue
            if self.step >= cfg.run.steps or self.stop_requested:
                break
            timer.stop("data", td)
            stats = self._train_step(batch)
            if self.step % cfg.run.log_every == 0 or self.step == cfg.run.steps:
                self._log_interval(stats)
            if cfg.run.ckpt_every and self.step % cfg.run.ckpt_every == 0:
                self.save("interval")
            td = timer.start()
        else:
            self.epoch, self.skip = self.epoch + 1, 0
        if self.world > 1:  # a signal seen between log intervals: agree before leaving the epoch
            self.stop_requested = du.any_rank(self.stop_requested, self.device)

    def _train_step(self, batch) -> dict:
        cfg, dev = self.cfg, self.device
        ts = self.timer.start()
        for group in self.opt.param_groups:
            group["lr"] = cfg.optim.lr_at(self.step)
        video = batch["video"].to(dev, non_blocking=True)
        if cfg.optim.channels_last:
            video = video.contiguous(memory_format=torch.channels_last_3d)
        audio, index = batch["audio"].to(dev), batch["index"].to(dev)
        kw = {}
        if "video2" in batch:
            kw = dict(video2=batch["video2"].to(dev), audio2=batch["audio2"].to(dev))
        if self.flops_clip is None:
            self.flops_clip = model_flops_per_clip(self.model, video, audio)
        with amp.precision(dev, cfg.optim.amp):  # autocast (+ the CPU bf16 Conv3d guard)
            loss, stats = self.step_fn(video, audio, index, step=self.step, **kw)
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.timer.stop("step", ts)
        self.step += 1
        self.batch_in_epoch += 1
        self.last_enq = stats["enq_index_v"]
        zero = torch.zeros((), device=dev)
        div = (category_diversity(self.last_enq, self.labels, self.loader.num_classes)
               if self.labels is not None else zero)
        self.means.add(loss=loss.detach().float(), acc=stats["acc"].float(), diversity=div,
                       gnorm=stats.get("gnorm", zero).float(),
                       fallback=stats.get("fallback", zero).float())
        if self.bar is not None:
            self.bar.update(1)
        return stats

    def _log_interval(self, stats):
        """One metrics row; the only host syncs of the loop."""
        cfg, n = self.cfg, self.means.count
        m = self.means.means()
        if not (math.isfinite(m["loss"]) and math.isfinite(m["acc"])):
            raise NonFiniteLoss(
                f"non-finite loss at step {self.step} (lr {cfg.optim.lr_at(self.step):.2e}, amp "
                f"{cfg.optim.amp}); the last good checkpoint in {self.out} is kept. Lower --lr, "
                "use --amp none, or resume from it")
        du.verify_ranks_agree(self.model, self.chash, self.last_enq, self.step)
        self.stop_requested = du.any_rank(self.stop_requested, self.device)
        secs = self.timer.collect()
        clips_s = n * cfg.model.batch_size / (time.perf_counter() - self.t0) / self.world
        dev = self.device
        self.logger.write(StepMetrics(
            step=self.step, epoch=self.epoch, loss=m["loss"], acc=m["acc"],
            lr=self.opt.param_groups[0]["lr"], clips_per_s=clips_s,
            diversity=m["diversity"] if self.labels is not None else float("nan"),
            gnorm=m["gnorm"], active=float(stats.get("active", 0.0)), fallback=m["fallback"],
            t_data=secs.get("data", 0.0) / n, t_step=secs.get("step", 0.0) / n,
            t_select=secs.get("select", 0.0) / n,
            mfu=(self.flops_clip * clips_s / self.peak) if (self.peak and self.flops_clip)
            else float("nan"),
            mem_gb=(torch.cuda.max_memory_allocated(dev) / 2**30) if dev.type == "cuda"
            else float("nan")))
        self.t0 = time.perf_counter()
