"""CM-ACC pretraining: cross-modal active contrastive coding of audio-visual video.

One process (CPU, seconds, on the built-in synthetic clips):
    python train.py --preset tiny --steps 200 --out runs/tiny

Ablations are flags (paper Tables 1-3):
    --sampler random                XMoCo            --sampler active          CM-ACC
    --sampler active-feature        feature space    --sampler ohem            OHEM
    --objective smoco               unimodal SMoCo   --no-fcl                  w/o fcl
    --grad-view queries             BADGE's view     --pool-mode epoch         paper's pools

One GPU / one node with 8 GPUs / several nodes (same flags on every node):
    python train.py --preset paper --data DATA/manifest.csv --device cuda --out runs/x
    torchrun --nproc_per_node=8 train.py --preset paper --data DATA/manifest.csv --device cuda
    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 \\
        --rdzv_id=cmacc train.py --preset paper --data DATA/manifest.csv --device cuda

--batch-size is the GLOBAL mini-batch M (split over all ranks); --resume auto continues from
the newest valid checkpoint in --out. Metrics go to OUT/metrics.csv (plot: OUT/metrics.png).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from cmacc import checkpoint as ckpt
from cmacc import distributed as du
from cmacc.config import (DICT_INITS, GRAD_VIEWS, OBJECTIVES, POOL_MODES, SAMPLERS, ModelConfig,
                          TrainConfig, config_hash, to_dict)
from cmacc.encoders import VIDEO_ARCHS
from cmacc.engine import (SectionTimer, any_rank, fill_epoch_pools, init_dictionaries, peak_flops,
                          verify_ranks_agree)
from cmacc.metrics import CSVLog, category_diversity, plot_metrics
from cmacc.model import CMACC

log = logging.getLogger("train")

PRESETS = {
    # DESIGN.md §1 / paper §5: M=128, K=30M, N=300M, tau=0.7, m=0.999, Adam 1e-3, 500 warm-up
    "paper": dict(model=dict(batch_size=128, dict_size=30 * 128, pool_size=300 * 128),
                  train=dict(lr=1e-3, warmup=500, amp="bf16", steps=100_000),
                  data=dict(frames=16, size=112)),
    # CPU in seconds: narrow, shallow encoders on 8x32x32 clips
    "tiny": dict(model=dict(batch_size=16, dict_size=64, pool_size=192, video_width=8,
                            video_layers=(1, 1, 1, 1), audio_width=8, audio_layers=(1, 1, 1, 1),
                            fcl_dim=64, dim=32, momentum=0.99),
                 train=dict(lr=1e-3, warmup=10, amp="none", steps=200, log_every=10),
                 data=dict(frames=8, size=32, clips=256, classes=8, noise=1.0)),
}
METRIC_FIELDS = ["step", "epoch", "loss", "acc", "lr", "clips_per_s", "diversity", "gnorm",
                 "active", "fallback", "t_data", "t_step", "t_select", "mfu", "mem_gb"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="base settings (default: tiny)")
    g.add_argument("--data", default="synthetic",
                   help="'synthetic' (built-in in-memory clips) or a prepared manifest (python -m data_dali.prepare)")
    g.add_argument("--steps", type=int, help="training iterations (global batches)")
    g.add_argument("--out", default=None, help="output folder: checkpoints, metrics.csv, plots (default runs/<preset>)")
    g.add_argument("--resume", default="auto", help="'auto' (newest valid checkpoint in --out), 'none', or a checkpoint path")
    g.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--loader", choices=("auto", "dali", "reference"), default="auto",
                   help="data loader for a manifest: DALI (GPU decode; CPU operators without a GPU) "
                        "or the PyAV reference loader; auto = DALI when it works")
    g.add_argument("--workers", type=int, default=2, help="reference-loader worker processes")
    g.add_argument("--log-every", type=int, help="log/metrics interval in steps")
    g.add_argument("--ckpt-every", type=int, default=0, help="checkpoint interval in steps (0: only at the end)")
    g.add_argument("--config", help="JSON file of flag values (long names); command-line flags win")
    g.add_argument("--tensorboard", action="store_true", help="also write TensorBoard scalars to OUT/tb")
    g = p.add_argument_group("method")
    g.add_argument("--objective", choices=OBJECTIVES, help="cross (XMoCo/CM-ACC) or smoco (unimodal)")
    g.add_argument("--sampler", choices=SAMPLERS, help="negatives enqueued each step (default active = CM-ACC)")
    g.add_argument("--grad-view", choices=GRAD_VIEWS, help="last-layer gradient view (default head)")
    g.add_argument("--pool-mode", choices=POOL_MODES, help="rolling (default, free) or epoch (paper)")
    g.add_argument("--fcl", dest="fcl", action="store_true", default=None, help="cross-modal FC layer (default on)")
    g.add_argument("--no-fcl", dest="fcl", action="store_false", help="ablation 'w/o fcl'")
    g.add_argument("--batch-size", type=int, help="GLOBAL mini-batch M")
    g.add_argument("--dict-size", type=int, help="dictionary size K (paper 30*M)")
    g.add_argument("--pool-size", type=int, help="candidate pool size N (paper 300*M)")
    g.add_argument("--tau", type=float, help="contrastive temperature (0.7)")
    g.add_argument("--tau-p", type=float, help="pseudo-posterior temperature (1.0)")
    g.add_argument("--momentum", type=float, help="key-encoder momentum (0.999)")
    g.add_argument("--dict-init", choices=DICT_INITS, help="dictionary init: encode K random clips (paper) or random keys")
    g = p.add_argument_group("model")
    g.add_argument("--video-arch", choices=VIDEO_ARCHS)
    g.add_argument("--video-width", type=int)
    g.add_argument("--audio-width", type=int)
    g.add_argument("--dim", type=int, help="key dimension d (128)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=float)
    g.add_argument("--warmup", type=int, help="linear warm-up iterations")
    g.add_argument("--amp", choices=("none", "bf16", "fp16"), help="autocast dtype")
    g.add_argument("--no-channels-last", dest="channels_last", action="store_false", default=True,
                   help="keep the video encoders in NCTHW (default: channels_last_3d)")
    g.add_argument("--compile", action="store_true", help="torch.compile the backbones")
    g.add_argument("--no-shuffle-bn", dest="shuffle_bn", action="store_false", default=True,
                   help="disable MoCo's shuffle-BN in the key encoders (multi-rank runs)")
    g = p.add_argument_group("synthetic data")
    g.add_argument("--clips", type=int, help="number of synthetic clips")
    g.add_argument("--classes", type=int, help="number of synthetic classes")
    g.add_argument("--redundancy", type=float, default=0.0, help="near-duplicate fraction in [0,1)")
    g.add_argument("--noise", type=float, help="pixel / mel noise level (tiny preset: 1.0)")
    return p


def configs_from_args(args):
    preset = PRESETS[args.preset]
    mk = {**preset["model"], "seed": args.seed}
    for name in ("objective", "sampler", "grad_view", "pool_mode", "fcl", "batch_size",
                 "dict_size", "pool_size", "tau", "tau_p", "momentum", "video_arch",
                 "video_width", "audio_width", "dim"):
        if getattr(args, name) is not None:
            mk[name] = getattr(args, name)
    tk = dict(preset["train"])
    for name in ("steps", "lr", "warmup", "amp", "log_every", "dict_init"):
        if getattr(args, name) is not None:
            tk[name] = getattr(args, name)
    tk["channels_last"] = args.channels_last
    tk["out"] = args.out or f"runs/{args.preset}"
    tk["device"] = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    data = dict(preset["data"])
    for name in ("clips", "classes", "noise"):
        if getattr(args, name) is not None:
            data[name] = getattr(args, name)
    data["redundancy"] = args.redundancy
    return ModelConfig(**mk), TrainConfig(**tk), data


def build_data(args, mcfg, data, rank, world, views, device):
    if args.data != "synthetic":
        import data_dali  # the real pipelines (DALI on GPU, reference loader otherwise)

        try:
            return data_dali.build_loader(args.data, batch_size=mcfg.batch_size // world,
                                          clip_frames=data["frames"], crop=data["size"],
                                          shard_id=rank, num_shards=world, seed=mcfg.seed,
                                          views=views, device=device, backend=args.loader,
                                          num_workers=args.workers)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"error: --data {args.data}: {e}") from None
    from cmacc.toydata import ToyAV, ToyLoader

    toy = ToyAV(num_clips=data.get("clips", 1024), num_classes=data.get("classes", 10),
                frames=data["frames"], size=data["size"], redundancy=data["redundancy"],
                noise=data.get("noise", 0.3), seed=mcfg.seed)
    return ToyLoader(toy, mcfg.batch_size, seed=mcfg.seed, rank=rank, world=world, views=views)


def lr_at(step, tcfg):
    return tcfg.lr * min(1.0, (step + 1) / tcfg.warmup) if tcfg.warmup else tcfg.lr


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config:
        args = apply_config_file(parser, args, argv)
    try:
        mcfg, tcfg, data = configs_from_args(args)
    except ValueError as e:
        parser.error(str(e))

    # -- distributed setup (torchrun sets WORLD_SIZE / RANK / LOCAL_RANK) -----------------
    if tcfg.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is visible; use --device cpu")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if tcfg.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if tcfg.device == "cuda" else "gloo")
    rank, world = du.rank(), du.world_size()
    if mcfg.batch_size % world:
        parser.error(f"--batch-size {mcfg.batch_size} (global M) does not divide over {world} "
                     f"ranks; use a multiple of {world}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, force=True,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    device = torch.device("cuda", torch.cuda.current_device()) if tcfg.device == "cuda" else torch.device("cpu")
    torch.manual_seed(mcfg.seed)  # identical initial weights on every rank
    out = Path(tcfg.out)
    out.mkdir(parents=True, exist_ok=True)

    # -- data, model, optimiser -----------------------------------------------------------
    loader = build_data(args, mcfg, data, rank, world, 2 if mcfg.objective == "smoco" else 1, device)
    model = CMACC(mcfg).to(device)
    model.shuffle_bn = args.shuffle_bn
    if tcfg.channels_last:
        model.f_v.to(memory_format=torch.channels_last_3d)
        model.h_v.to(memory_format=torch.channels_last_3d)
    opt = torch.optim.Adam(model.query_parameters(), lr=tcfg.lr, weight_decay=tcfg.weight_decay)
    step_fn = model
    if world > 1:  # gradients of the query encoders all-reduced; buffers are kept in lock-step
        step_fn = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    if args.compile:
        model.f_v.backbone = torch.compile(model.f_v.backbone)
        model.f_a.backbone = torch.compile(model.f_a.backbone)
    amp_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[tcfg.amp]
    scaler = torch.amp.GradScaler(device.type, enabled=tcfg.amp == "fp16")
    labels = getattr(loader, "labels", None)
    labels = labels.to(device) if labels is not None else None
    chash = config_hash(mcfg)

    # -- resume, or initialise the dictionaries --------------------------------------------
    step, epoch, skip = 0, 0, 0  # skip: batches of the current epoch already trained on
    found = None
    if args.resume == "auto":
        found = ckpt.find_latest_valid(out)
    elif args.resume != "none":
        try:
            found = (Path(args.resume), ckpt.load(args.resume))
        except Exception as e:
            parser.error(f"--resume {args.resume}: cannot load this checkpoint ({e})")
    if found is not None:
        path, state = found
        if state.get("config_hash") != chash:
            parser.error(f"checkpoint {path} was made with a different model config; use "
                         "another --out, or --resume none to start afresh")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        ckpt.set_rng_state(state["rng"])
        step, epoch, skip = int(state["step"]), int(state["epoch"]), int(state["batch_in_epoch"])
        log.info("resumed from %s at step %d", path, step)
    elif mcfg.objective == "cross":
        init_dictionaries(model, loader, tcfg.dict_init, device)
    batch_in_epoch = skip

    def save(reason):
        if rank == 0:
            state = dict(model=model.state_dict(), optimizer=opt.state_dict(),
                         scaler=scaler.state_dict(), rng=ckpt.rng_state(), step=step,
                         epoch=epoch, batch_in_epoch=batch_in_epoch, config_hash=chash,
                         model_config=to_dict(mcfg), train_config=to_dict(tcfg),
                         data_config=json.loads(json.dumps(data)))
            p = ckpt.save_atomic(state, ckpt.checkpoint_path(out, step))
            ckpt.prune(out)
            log.info("checkpoint (%s): %s", reason, p)

    stop = {"flag": False}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.update(flag=True))

    # -- observability ---------------------------------------------------------------------
    logger = RunLogger(out, enabled=rank == 0, tensorboard=args.tensorboard)
    timer = SectionTimer(device)
    model.timer = timer
    flops_clip = None
    peak = peak_flops(device)
    log.info("%s | %s | world %d | M=%d K=%d N=%d | amp %s | out %s", mcfg.method, device, world,
             mcfg.batch_size, mcfg.dict_size, mcfg.pool_size, tcfg.amp, out)
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=tcfg.steps, initial=step, desc=mcfg.method, dynamic_ncols=True,
                   disable=not sys.stderr.isatty())
    sums = torch.zeros(5, device=device, dtype=torch.float64)  # loss, acc, div, gnorm, fallback
    n_sum, t0, last_enq = 0, time.perf_counter(), None

    # -- the loop ----------------------------------------------------------------------------
    while step < tcfg.steps and not stop["flag"]:
        if mcfg.pool_mode == "epoch" and mcfg.objective == "cross" and skip == 0:
            fill_epoch_pools(model, loader, device, epoch)  # (restored from the checkpoint
        loader.set_epoch(epoch)                             #  when resuming mid-epoch)
        batch_in_epoch = 0
        td = timer.start()
        for batch in loader:
            if batch_in_epoch < skip:  # resuming mid-epoch: same data order as uninterrupted
                batch_in_epoch += 1
                continue
            if step >= tcfg.steps or stop["flag"]:
                break
            timer.stop("data", td)
            ts = timer.start()
            for group in opt.param_groups:
                group["lr"] = lr_at(step, tcfg)
            video = batch["video"].to(device, non_blocking=True)
            if tcfg.channels_last:
                video = video.contiguous(memory_format=torch.channels_last_3d)
            audio, index = batch["audio"].to(device), batch["index"].to(device)
            kw = {}
            if "video2" in batch:
                kw = dict(video2=batch["video2"].to(device), audio2=batch["audio2"].to(device))
            if flops_clip is None:
                flops_clip = model_flops_per_clip(model, video, audio)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss, stats = step_fn(video, audio, index, step=step, **kw)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            timer.stop("step", ts)
            step += 1
            batch_in_epoch += 1
            last_enq = stats["enq_index_v"]
            zero = torch.zeros((), device=device)
            div = category_diversity(last_enq, labels, loader.num_classes) if labels is not None else zero
            sums += torch.stack([loss.detach().float(), stats["acc"].float(), div,
                                 stats.get("gnorm", zero).float(), stats.get("fallback", zero).float()]).double()
            n_sum += 1
            if bar is not None:
                bar.update(1)
            if step % tcfg.log_every == 0 or step == tcfg.steps:
                # the only host syncs: metrics, rank agreement, stop agreement
                if world > 1:
                    dist.all_reduce(sums)
                    sums /= world
                vals = (sums / n_sum).tolist()
                if not all(math.isfinite(v) for v in vals[:2]):
                    logger.close()
                    raise SystemExit(f"error: non-finite loss at step {step} (lr {lr_at(step, tcfg):.2e}, "
                                     f"amp {tcfg.amp}); the last good checkpoint in {out} is kept. "
                                     "Lower --lr, use --amp none, or resume from it")
                verify_ranks_agree(model, chash, last_enq, step)
                stop["flag"] = any_rank(stop["flag"], device)
                secs = timer.collect()
                dt = time.perf_counter() - t0
                clips_s = n_sum * mcfg.batch_size / dt / world
                row = dict(step=step, epoch=epoch, loss=vals[0], acc=vals[1], lr=opt.param_groups[0]["lr"],
                           clips_per_s=clips_s, diversity=vals[2] if labels is not None else float("nan"),
                           gnorm=vals[3], active=float(stats.get("active", 0.0)), fallback=vals[4],
                           t_data=secs.get("data", 0.0) / n_sum, t_step=secs.get("step", 0.0) / n_sum,
                           t_select=secs.get("select", 0.0) / n_sum,
                           mfu=(flops_clip * clips_s / peak) if (peak and flops_clip) else float("nan"),
                           mem_gb=(torch.cuda.max_memory_allocated(device) / 2**30) if device.type == "cuda" else float("nan"))
                logger.write(row)
                sums.zero_()
                n_sum, t0 = 0, time.perf_counter()
            if args.ckpt_every and step % args.ckpt_every == 0:
                save("interval")
            td = timer.start()
        else:
            epoch, skip = epoch + 1, 0
        if world > 1:  # a signal seen between log intervals: agree before leaving the epoch
            stop["flag"] = any_rank(stop["flag"], device)
    if bar is not None:
        bar.close()
    save("stop signal" if stop["flag"] else "end")
    logger.close()
    if rank == 0:
        summary = summarise(logger.history, mcfg, out)
        print(json.dumps(summary, indent=2))
    if world > 1:
        dist.destroy_process_group()
    return 0


def apply_config_file(parser, args, argv):
    """--config FILE (JSON of flag names → values); flags given on the command line win."""
    try:
        values = json.loads(Path(args.config).read_text())
    except (OSError, ValueError) as e:
        parser.error(f"--config {args.config}: cannot read JSON ({e})")
    known = {a.dest for a in parser._actions}
    bad = sorted(k for k in (kk.replace("-", "_") for kk in values) if k not in known)
    if bad:
        parser.error(f"--config {args.config}: unknown keys {bad}; use the long flag names of --help")
    parser.set_defaults(**{k.replace("-", "_"): v for k, v in values.items()})
    return parser.parse_args(argv)


def model_flops_per_clip(model, video, audio) -> float:
    """Training FLOPs per clip: 3x the query encoders' forward (forward + backward) plus the
    key encoders' forward, counted on one clip with copies of the encoders."""
    import copy

    fv, fa = copy.deepcopy(model.f_v), copy.deepcopy(model.f_a)
    with torch.no_grad():
        fwd = flops_of(lambda: fv(video[:1])) + flops_of(lambda: fa(audio[:1]))
    return 4.0 * fwd


def flops_of(fn) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return float(counter.get_total_flops())


class RunLogger:
    """Rank-0 metrics: a log line, a CSV row, TensorBoard scalars (optional), history."""

    def __init__(self, out, enabled, tensorboard):
        self.enabled, self.history, self.tb = enabled, [], None
        self.csv = CSVLog(Path(out) / "metrics.csv", METRIC_FIELDS) if enabled else None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(out) / "tb"))
            except Exception as e:  # tensorboard is optional
                log.warning("TensorBoard disabled (%s); pip install tensorboard", e)

    def write(self, row):
        if not self.enabled:
            return
        self.history.append(row)
        self.csv.write(row)
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, float) and math.isfinite(v):
                    self.tb.add_scalar(k, v, row["step"])
        log.info("step %6d | loss %.4f | acc %.3f | div %.3f | gnorm %.3g | lr %.2e | "
                 "%.1f clips/s/rank | data %.1f ms, step %.1f ms, select %.2f ms | mfu %.3g",
                 row["step"], row["loss"], row["acc"], row["diversity"], row["gnorm"], row["lr"],
                 row["clips_per_s"], 1e3 * row["t_data"], 1e3 * row["t_step"],
                 1e3 * row["t_select"], row["mfu"])

    def close(self):
        if self.csv is not None:
            self.csv.close()
        if self.tb is not None:
            self.tb.close()


def summarise(history, mcfg, out):
    if not history:
        return {}
    w = max(1, len(history) // 4)
    first, last = history[:w], history[-w:]
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    summary = dict(method=mcfg.method, steps=history[-1]["step"],
                   loss_first=mean(first, "loss"), loss_last=mean(last, "loss"),
                   acc_first=mean(first, "acc"), acc_last=mean(last, "acc"),
                   diversity_last=mean(last, "diversity"),
                   clips_per_s=mean(last, "clips_per_s"), out=str(out))
    tmp = out / ".summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, out / "summary.json")
    try:
        plot_metrics({mcfg.method: str(out / "metrics.csv")}, out / "metrics.png")
    except Exception as e:  # a plot must never cost the run
        log.warning("could not write metrics.png: %s", e)
    return summary


if __name__ == "__main__":
    sys.exit(main())
