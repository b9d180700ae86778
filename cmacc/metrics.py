"""What a training run measures, without host syncs in the step: negative-category diversity,
named running means, section timings, model FLOPs and the device's peak for utilisation. And two
laws to read them against: the diversity random sampling has by chance (``expected_unique``)
and a 95% confidence interval over seeds (``mean_ci``)."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from . import distributed as du

# dense bf16 tensor-core peak (FLOP/s) by device name, for model FLOP utilisation
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def negative_diversity(index: torch.Tensor, labels: torch.Tensor, num_classes: int) -> dict:
    """Category diversity of the negatives just enqueued (dataset indices; index < 0 = no clip,
    and clips labelled -1 = unlabelled, ignored; NaN for a dataset without labels), two ways,
    as 0-d tensors (no host sync):

    - ``unique_per_m`` = U / M: distinct categories U among the M enqueued clips, divided by M —
      the paper appendix's "probability of sampling unique negatives" (its Fig. 3 metric);
    - ``coverage`` = U / min(M, C): the same count against its ceiling (C categories), so 1.0
      means no sampler could do better.
    """
    index = index.to(labels.device)
    if num_classes < 1:  # an unlabelled dataset: no categories to count
        nan = torch.full((), float("nan"), device=labels.device)
        return {"unique_per_m": nan, "coverage": nan.clone()}
    lab = labels[index.clamp_min(0)]
    # clips without a label (-1) are not counted; no boolean indexing: no host sync
    valid = ((index >= 0) & (lab >= 0)).float()
    present = torch.zeros(num_classes, device=labels.device).scatter_reduce(
        0, lab.clamp_min(0), valid, reduce="amax")
    unique, m = present.sum(), valid.sum().clamp_min(1)
    return {"unique_per_m": unique / m, "coverage": unique / m.clamp_max(num_classes)}


def expected_unique(counts, m: int) -> float:
    """E[U]: expected number of distinct categories among m clips drawn without replacement
    from a population of counts[c] clips of category c (a random batch, what XMoCo enqueues):
    sum_c 1 - C(n - n_c, m) / C(n, m). ``E[U] / m`` is random sampling's unique/M."""
    n = sum(counts)
    if not 0 <= m <= n:
        raise ValueError(f"expected_unique: m={m} clips cannot be drawn from {n}")

    def log_choose(a, b):
        return math.lgamma(a + 1) - math.lgamma(b + 1) - math.lgamma(a - b + 1)

    return sum(1.0 - (math.exp(log_choose(n - k, m) - log_choose(n, m)) if n - k >= m else 0.0)
               for k in counts if k > 0)


# two-sided 95% Student-t quantiles t_{0.975, df}, df = 1..30
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """t_{0.975, df}: the table above to df 30, then the Cornish-Fisher expansion around
    z = 1.95996 (error < 1e-4 there)."""
    if df < 1:
        raise ValueError(f"t975: df must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_ci(values) -> tuple[float, float]:
    """(mean, half-width of the 95% t-interval) of independent values (e.g. one per seed):
    t_{0.975, n-1} * s / sqrt(n) with s the sample standard deviation; NaN with one value."""
    v = [float(x) for x in values]
    n = len(v)
    if n == 0:
        raise ValueError("mean_ci: no values")
    mean = sum(v) / n
    if n == 1:
        return mean, float("nan")
    sd = math.sqrt(sum((x - mean) ** 2 for x in v) / (n - 1))
    return mean, t975(n - 1) * sd / math.sqrt(n)


def format_interval(mean: float, half: float, digits: int = 3, signed: bool = False) -> str:
    """``mean ± half`` as every report prints it ("+0.105 ± 0.030" signed, for differences); the
    mean alone where there is no interval (half NaN: one value)."""
    m = f"{mean:{'+' if signed else ''}.{digits}f}"
    return m if math.isnan(half) else f"{m} ± {half:.{digits}f}"


def format_ci(values, digits: int = 3, signed: bool = False) -> str:
    """``format_interval`` of ``mean_ci(values)``: mean ± 95% t-interval."""
    return format_interval(*mean_ci(values), digits=digits, signed=signed)


class RunningMeans:
    """Named per-step scalars summed on the device; ``means()`` averages them over the steps
    since the last call and across ranks (one all-reduce, the only sync). A step added with
    ``weight`` 0 (a device flag: a skipped, non-finite step) is counted in ``count`` but not in
    the means, whatever its values (NaN included)."""

    def __init__(self, names: tuple[str, ...], device):
        self.names = tuple(names)
        # the sums, then the number of steps they hold (the weights' sum), on the device
        self.sums = torch.zeros(len(self.names) + 1, device=device, dtype=torch.float64)
        self.count = 0  # steps added (host)

    def add(self, weight: torch.Tensor | float = 1.0, **values: torch.Tensor) -> None:
        if set(values) != set(self.names):
            raise KeyError(f"RunningMeans.add needs exactly {self.names}, got {sorted(values)}")
        w = torch.as_tensor(weight, dtype=torch.float64, device=self.sums.device).reshape(())
        v = torch.stack([values[n].detach().double().reshape(()) for n in self.names])
        self.sums += torch.cat([torch.where(w > 0, v * w, 0.0), w[None]])
        self.count += 1

    def _reduced(self) -> torch.Tensor:
        sums = self.sums.clone()
        if du.world_size() > 1:
            dist.all_reduce(sums)
            sums /= du.world_size()
        return sums

    def means(self, reset: bool = True) -> dict[str, float]:
        """Means since the last reset, averaged over ranks (collective when distributed), and
        "steps": how many steps they hold (NaN means where that is 0)."""
        *sums, steps = self._reduced().tolist()
        if reset:
            self.sums.zero_()
            self.count = 0
        out = {n: (v / steps if steps else float("nan")) for n, v in zip(self.names, sums)}
        return dict(out, steps=steps)

    def state_dict(self) -> dict:
        """The rank-averaged sums (collective when distributed): restored on every rank, the
        next ``means`` equals that of a run that was never interrupted."""
        sums = self._reduced().cpu()
        return {"sums": sums[:-1], "steps": sums[-1], "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        steps = state.get("steps", float(state["count"]))  # (before skipped steps were weighed)
        self.sums.copy_(torch.cat([torch.as_tensor(state["sums"], dtype=torch.float64),
                                   torch.as_tensor(steps, dtype=torch.float64).reshape(1)]))
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
    key encoders' forward, counted on one clip with copies of the encoders in eval mode: the
    count is that of the convolutions and matmuls, and a train-mode BatchNorm refuses one clip
    whose last map is 1x1x1 (deep stages on small clips). The copies run on the meta device
    (shapes only): on a GPU a real one-clip fp32 forward would cost cuDNN's autotuning of ~20
    convolution shapes the training never uses; an encoder with an op that has no meta kernel
    is counted on its real copy instead."""
    import copy

    from .encoders import declared_stem

    def count(dev=None):
        fv, fa = copy.deepcopy(model.f_v).eval(), copy.deepcopy(model.f_a).eval()
        v, a = video[:1], audio[:1]
        if dev is not None:
            fv, fa, v, a = fv.to(dev), fa.to(dev), v.to(dev), a.to(dev)
        with torch.no_grad(), declared_stem():
            return flops_of(lambda: fv(v)) + flops_of(lambda: fa(a))

    try:
        fwd = count("meta")
    except (NotImplementedError, RuntimeError):
        fwd = count()
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
