"""Training-loop components used by ``train.py``: dictionary/pool filling from encoded clips,
cross-rank agreement checks, step timing without host syncs, and model FLOPs."""

from __future__ import annotations

import time
import zlib

import torch
import torch.distributed as dist

from . import distributed as du

# dense bf16 tensor-core peak (FLOP/s) by device name, for model FLOP utilisation
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


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
    """U_v, U_a ← key encodings of N random clips, at each epoch start (--pool-mode epoch)."""
    kv, ka, idx = encode_random_clips(model, loader, model.cfg.pool_size, device,
                                      model.cfg.seed * 31 + epoch + 1)
    model.pool_v.fill(kv, idx)
    model.pool_a.fill(ka, idx)


# ----------------------------------------------------------------------------------------------
# Ranks must agree: config, weights, dictionaries, the last selection
# ----------------------------------------------------------------------------------------------
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


FINGERPRINT_FIELDS = ("config", "key encoders", "query encoders", "dictionary keys",
                      "dictionary indices", "selected indices")


def verify_ranks_agree(model, config_hash: str, enq_index, step: int) -> None:
    """All-gather the fingerprint; raise RuntimeError naming what differs. Call at log
    intervals only (it syncs)."""
    if du.world_size() == 1:
        return
    f = fingerprint(model, config_hash, enq_index)
    parts = [torch.empty_like(f) for _ in range(du.world_size())]
    dist.all_gather(parts, f)
    for r, p in enumerate(parts):
        bad = [FINGERPRINT_FIELDS[i] for i in range(6) if p[i].item() != parts[0][i].item()]
        if bad:
            raise RuntimeError(
                f"ranks diverged at step {step}: rank {r} differs from rank 0 in "
                f"{', '.join(bad)}. Check that every rank runs the same code, flags and data "
                "manifest; the last checkpoint is kept"
            )


def any_rank(flag: bool, device) -> bool:
    """True on every rank if ``flag`` is True on any rank (one tiny all-reduce; syncs)."""
    if du.world_size() == 1:
        return flag
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


# ----------------------------------------------------------------------------------------------
# Timing and FLOPs
# ----------------------------------------------------------------------------------------------
class SectionTimer:
    """Accumulates named sections. On CUDA it records events and reads them only in
    ``collect`` (no host sync in the step); on CPU it uses perf_counter."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.pending, self.total = [], {}

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, name, start):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.pending.append((name, start, e))
        else:
            self.total[name] = self.total.get(name, 0.0) + time.perf_counter() - start

    def collect(self) -> dict:
        """Seconds per section since the last collect (syncs on CUDA)."""
        if self.pending:
            self.pending[-1][2].synchronize()
            for name, s, e in self.pending:
                self.total[name] = self.total.get(name, 0.0) + s.elapsed_time(e) / 1e3
        out, self.pending, self.total = self.total, [], {}
        return out


def flops_per_step(step_fn, *args, **kwargs) -> float:
    """Model FLOPs of one training iteration (forward + backward), counted by PyTorch's
    FlopCounterMode on the given batch. Restore the model's state yourself if it matters."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        loss, _ = step_fn(*args, **kwargs)
        loss.backward()
    return float(counter.get_total_flops())


def peak_flops(device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, val in PEAK_FLOPS.items():
        if key in name:
            return val
    return None
