"""What a training run measures, without host syncs in the step: negative-category diversity,
named running means, section timings, model FLOPs and the device's peak for utilisation."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from . import distributed as du

# dense bf16 tensor-core peak (FLOP/s) by device name, for model FLOP utilisation
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def negative_diversity(index: torch.Tensor, labels: torch.Tensor, num_classes: int) -> dict:
    """Category diversity of the negatives just enqueued (dataset indices; index < 0 = no clip,
    ignored), two ways, as 0-d tensors (no host sync):

    - ``unique_per_m`` = U / M: distinct categories U among the M enqueued clips, divided by M —
      the paper appendix's "probability of sampling unique negatives" (its Fig. 3 metric);
    - ``coverage`` = U / min(M, C): the same count against its ceiling (C categories), so 1.0
      means no sampler could do better.
    """
    index = index.to(labels.device)
    valid = (index >= 0).float()  # no boolean indexing: no host sync in the training step
    lab = labels[index.clamp_min(0)]
    present = torch.zeros(num_classes, device=labels.device).scatter_reduce(
        0, lab, valid, reduce="amax")
    unique, m = present.sum(), valid.sum().clamp_min(1)
    return {"unique_per_m": unique / m, "coverage": unique / m.clamp_max(num_classes)}


class RunningMeans:
    """Named per-step scalars summed on the device; ``means()`` averages them over the steps
    since the last call and across ranks (one all-reduce, the only sync)."""

    def __init__(self, names: tuple[str, ...], device):
        self.names = tuple(names)
        self.sums = torch.zeros(len(self.names), device=device, dtype=torch.float64)
        self.count = 0

    def add(self, **values: torch.Tensor) -> None:
        if set(values) != set(self.names):
            raise KeyError(f"RunningMeans.add needs exactly {self.names}, got {sorted(values)}")
        self.sums += torch.stack([values[n].detach().double().reshape(()) for n in self.names])
        self.count += 1

    def _reduced(self) -> torch.Tensor:
        sums = self.sums.clone()
        if du.world_size() > 1:
            dist.all_reduce(sums)
            sums /= du.world_size()
        return sums

    def means(self, reset: bool = True) -> dict[str, float]:
        """Means since the last reset, averaged over ranks (collective when distributed)."""
        vals = (self._reduced() / max(1, self.count)).tolist()
        if reset:
            self.sums.zero_()
            self.count = 0
        return dict(zip(self.names, vals))

    def state_dict(self) -> dict:
        """The rank-averaged sums (collective when distributed): restored on every rank, the
        next ``means`` equals that of a run that was never interrupted."""
        return {"sums": self._reduced().cpu(), "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.sums.copy_(state["sums"])
        self.count = int(state["count"])


class SectionTimer:
    """Accumulates named sections. On CUDA it records events and reads them only in
    ``collect`` (no host sync in the step); on CPU it uses perf_counter."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
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


def flops_of(fn) -> float:
    """FLOPs of ``fn()`` counted by PyTorch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return float(counter.get_total_flops())


def model_flops_per_clip(model, video, audio) -> float:
    """Training FLOPs per clip: 3x the query encoders' forward (forward + backward) plus the
    key encoders' forward, counted on one clip with copies of the encoders."""
    import copy

    fv, fa = copy.deepcopy(model.f_v), copy.deepcopy(model.f_a)
    with torch.no_grad():
        fwd = flops_of(lambda: fv(video[:1])) + flops_of(lambda: fa(audio[:1]))
    return 4.0 * fwd


def peak_flops(device) -> float | None:
    """Dense bf16 peak of a known GPU; None where unknown (CPU included)."""
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, val in PEAK_FLOPS.items():
        if key in name:
            return val
    return None
