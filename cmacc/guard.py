"""A step's update is applied only if it is finite, decided on the device; the host learns it one
step late, so a steady-state step never waits for the device.

After each backward ``StepGuard.check`` computes, on the device, what is NaN/Inf — the loss, the
dictionaries, the query gradients (fp16: the GradScaler checks those) — beside two host facts
(a stop signal on this rank, its share of the run's damaged clips: ``BadClips.share``),
all-reduced (SUM) over the ranks in one small collective: a flag is set where its sum is
positive (any rank's), and the shares add up to the run's count of damaged clips. From them it
returns ``skip`` (0-d float, 1 = do not apply this step's update), which ``GuardedAdam`` hands
to the fused Adam kernel as its ``found_inf`` (the way the GradScaler skips a step with fused
optimisers): a skipped step leaves the weights, the moments and the step count as they were,
on every rank alike. ``skip`` is also 1 on every step after the
run has halted on the device: after a non-finite step when a non-finite step stops the run
(``--on-nonfinite stop``), after a non-finite dictionary, and once more than
``--max-nonfinite`` steps were skipped (``skip``). So nothing after a poisoned step is applied,
whenever the host reads the flags.

The reduced flags go to a small host mirror by a non-blocking copy (pinned on CUDA) and an
event; ``read(step)`` returns the records of the steps up to ``step``, waiting only for their
events. The trainer reads the previous step's record after it has queued the current step
(the device then has a whole step to run while the host waits), and the current step's before a
checkpoint is saved or a log row written (those wait for the device anyway).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

FLAGS = ("loss", "dictionaries", "gradients")  # what can be non-finite, in record order


class NonFiniteLoss(RuntimeError):
    """The loss became NaN/Inf; the last good checkpoint is kept."""


class GuardedAdam(torch.optim.Adam):
    """Fused Adam whose step is skipped on the device where ``skip`` (a 0-d device tensor,
    set before each ``step``) is 1, combined with the GradScaler's own found-inf flag (fp16)."""

    def __init__(self, params, **kw):
        super().__init__(params, fused=True, **kw)
        self.skip = None

    def step(self, closure=None):
        theirs = getattr(self, "found_inf", None)  # the GradScaler's (fp16), set before step
        if self.skip is not None:
            self.found_inf = (self.skip if theirs is None else
                              torch.maximum(theirs.to(self.skip.dtype), self.skip))
        try:
            return super().step(closure)
        finally:
            if theirs is None:
                self.__dict__.pop("found_inf", None)
            else:
                self.found_inf = theirs


class StepGuard:
    """The device-side check of every step and its records for the host (module docstring)."""

    SLOTS = 4  # host mirror slots: a record is read at most one step after it is written

    def __init__(self, device, world: int, *, halt_on_nonfinite: bool, max_skipped: int):
        dev = torch.device(device)
        self.device, self.world, self.cuda = dev, world, dev.type == "cuda"
        self.halt_on_nonfinite, self.max_skipped = halt_on_nonfinite, max_skipped
        self.halted = torch.zeros((), device=dev)  # 1: no update is applied any more
        self.skipped = torch.zeros((), device=dev)  # non-finite steps so far (this run's)
        self.host = torch.zeros(2, device=dev)  # [signalled, damaged clips] on the device
        self._host_values = (0.0, 0.0)
        n = len(FLAGS) + 3  # + signalled, damaged, skip
        self.mirror = torch.zeros(self.SLOTS, n, pin_memory=self.cuda)  # host records
        self.pending: deque = deque()  # (step, slot, event or None), oldest first
        self._slot = 0

    def start(self, skipped: int) -> None:
        """A resumed run: the non-finite steps its checkpoint counted."""
        self.skipped.fill_(float(skipped))

    def _host_flags(self, signalled: bool, damaged: int) -> torch.Tensor:
        """The two host facts on the device, copied only when they change (rarely): a copy
        from pageable memory would wait for the device."""
        values = (float(signalled), float(damaged))
        if values != self._host_values:
            src = torch.tensor(values, pin_memory=self.cuda)
            self.host.copy_(src, non_blocking=self.cuda)
            self._host_values = values
        return self.host

    @torch.no_grad()
    def check(self, step: int, loss, dictionaries, grads, signalled: bool, damaged: int):
        """This step's flags, agreed by every rank; returns ``skip`` [] (1: not applied).
        ``damaged``: this rank's share of the run's damaged clips (their sum over the ranks is
        what ``read`` returns)."""
        finite = [torch.isfinite(loss.detach()).all(),
                  torch.stack([torch.isfinite(d).all() for d in dictionaries]).all(),
                  (torch.isfinite(torch.stack(torch._foreach_norm(grads))).all() if grads
                   else torch.ones((), dtype=torch.bool, device=self.device))]
        flags = torch.cat([(~torch.stack(finite)).float(), self._host_flags(signalled, damaged)])
        if self.world > 1:  # one collective; SUM: the damaged clips' shares add up
            torch.distributed.all_reduce(flags, op=dist.ReduceOp.SUM)
            flags = torch.cat([(flags[:-1] > 0).float(), flags[-1:]])  # set on any rank: 1
        bad = flags[:len(FLAGS)].amax()  # [] 1 if anything is non-finite on any rank
        skip = torch.maximum(bad, self.halted)
        self.skipped += bad * (1 - self.halted)  # counted until the run halts
        halt = flags[1] if not self.halt_on_nonfinite else bad  # a bad dictionary always halts
        halt = torch.maximum(halt, (self.skipped > self.max_skipped).float())
        self.halted.copy_(torch.maximum(self.halted, halt))
        self._record(step, torch.cat([flags, skip[None]]))
        return skip

    def _record(self, step: int, values: torch.Tensor) -> None:
        if len(self.pending) >= self.SLOTS:
            raise RuntimeError("StepGuard: records written but never read; call read(step)")
        slot, self._slot = self._slot, (self._slot + 1) % self.SLOTS
        self.mirror[slot].copy_(values, non_blocking=self.cuda)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        self.pending.append((step, slot, event))

    def read(self, upto: int) -> list[dict]:
        """The records of steps <= ``upto`` not read yet, oldest first: {"step", "bad" (names),
        "signalled", "damaged", "skipped"}. Waits only for those steps' events."""
        out = []
        while self.pending and self.pending[0][0] <= upto:
            step, slot, event = self.pending.popleft()
            if event is not None:
                event.synchronize()  # that step's work only: later steps stay queued
            *bad, signalled, damaged, skip = self.mirror[slot].tolist()
            out.append(dict(step=step, bad=[n for n, b in zip(FLAGS, bad) if b],
                            signalled=bool(signalled), damaged=int(damaged), skipped=bool(skip)))
        return out
