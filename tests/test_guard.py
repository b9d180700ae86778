"""The step's guard (cmacc/guard.py): a steady-state training step reads no result of the device
back to the host, a non-finite step is never applied (decided on the device, against plain Adam
as the reference), and the host learns it one step late."""

import collections
import math
import traceback

import pytest
import torch

from cmacc import trainer as trainer_mod
from cmacc.config import PRESETS
from cmacc.guard import GuardedAdam, StepGuard
from cmacc.trainer import Trainer

# the calls that make the host wait for a device tensor's value (on CUDA: a sync)
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def _count_reads(monkeypatch, trainer, steady):
    """Counts READS made while ``steady(step)`` holds for the step being run, by caller. Not
    counted: the guard's host mirror (filled by a non-blocking copy of an earlier step: reading
    it waits only for that step's event) and kernels/reference.py's numpy views of CPU tensors
    (the CPU selection; on CUDA the selection is the Triton plan, tests/test_select_plan.py)."""
    calls, on = collections.Counter(), [False]
    real_step = trainer_mod.Trainer._train_step

    def step(self, batch):
        on[0] = steady(self.step)
        try:
            return real_step(self, batch)
        finally:
            on[0] = False

    monkeypatch.setattr(trainer_mod.Trainer, "_train_step", step)

    def wrap(name):
        real = getattr(torch.Tensor, name)

        def read(self, *args, **kw):
            if on[0]:
                mirror = trainer.guard.mirror.untyped_storage().data_ptr()
                caller = traceback.extract_stack(limit=3)[-2]
                if (self.untyped_storage().data_ptr() != mirror and not
                        (name == "numpy" and caller.filename.endswith("kernels/reference.py"))):
                    calls[(name, caller.filename.rsplit("/", 2)[-1], caller.lineno)] += 1
            return real(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, name, read)

    for name in READS:
        wrap(name)
    return calls


@pytest.mark.parametrize("sampler", ["active", "random"])
def test_a_steady_state_step_reads_nothing_of_its_own_back_to_the_host(tmp_path, monkeypatch,
                                                                       sampler):
    """Steps that neither log nor save (here: every step but the 7th and 14th, after the first
    two) make no host read of a device result: the non-finite check, the stop and damaged-clip
    agreement are read one step late from the guard's mirror. (Before: ``flags.tolist()`` after
    every backward.)"""
    cfg = PRESETS["tiny"].replace(
        run=dict(steps=14, log_every=7, out=str(tmp_path / "run"), resume="none"),
        data=dict(clips=96, classes=6), selection=dict(sampler=sampler))
    tr = Trainer(cfg)
    steady = [False] * 14

    def is_steady(step):  # step: the 0-based iteration about to run
        steady[step] = step >= 2 and (step + 1) % 7 != 0
        return steady[step]

    calls = _count_reads(monkeypatch, tr, is_steady)
    tr.run()
    assert sum(steady) == 10  # the counter ran on 10 steps
    assert not calls, dict(calls)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=g)),
            torch.nn.Parameter(torch.randn(7, generator=g))]


def _grads(params, step, nan=False):
    for k, p in enumerate(params):
        g = torch.Generator().manual_seed(100 * step + k)
        p.grad = torch.randn(p.shape, generator=g)
        if nan:
            p.grad[0] = float("nan")


def test_guarded_adam_skips_a_flagged_step_and_is_adam_otherwise():
    """Against torch's single-tensor Adam fed only the unflagged steps: the same weights after
    every step; a flagged step (NaN gradients) changes no weight, moment nor step count."""
    ours, ref = _params(), _params()
    opt = GuardedAdam(ours, lr=1e-2, weight_decay=1e-3)
    ref_opt = torch.optim.Adam(ref, lr=1e-2, weight_decay=1e-3, foreach=False)
    flagged = {2, 3, 6}
    for step in range(8):
        bad = step in flagged
        before = {k: v.clone() for k, v in opt.state[ours[0]].items()} if opt.state else None
        _grads(ours, step, nan=bad)
        opt.skip = torch.tensor(float(bad))
        opt.step()
        if bad:
            assert before is not None
            for k, v in opt.state[ours[0]].items():
                torch.testing.assert_close(v, before[k], rtol=0, atol=0)
        else:
            _grads(ref, step)
            ref_opt.step()
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert int(opt.state[ours[0]]["step"]) == 8 - len(flagged)
    assert not hasattr(opt, "found_inf")  # nothing left for the next step


def _loss(x):
    return torch.tensor(float(x))


def _check(guard, step, loss=1.0, dict_ok=True, grads_ok=True, signalled=False, damaged=0):
    d = torch.zeros(3, 2) if dict_ok else torch.full((3, 2), float("nan"))
    g = [torch.ones(2) if grads_ok else torch.full((2,), float("inf"))]
    return float(guard.check(step, _loss(loss), (d, torch.zeros(1)), g, signalled, damaged))


def test_a_stop_run_applies_nothing_after_its_first_nonfinite_step():
    guard = StepGuard("cpu", 1, halt_on_nonfinite=True, max_skipped=0)
    skips = [_check(guard, 0), _check(guard, 1, loss=math.nan), _check(guard, 2),
             _check(guard, 3)]
    assert skips == [0.0, 1.0, 1.0, 1.0]  # halted on the device: the finite steps after too
    records = guard.read(3)
    assert [r["bad"] for r in records] == [[], ["loss"], [], []]
    assert [r["skipped"] for r in records] == [False, True, True, True]


def test_a_skip_run_skips_each_nonfinite_step_then_halts_past_the_limit():
    guard = StepGuard("cpu", 1, halt_on_nonfinite=False, max_skipped=2)
    got, bad = [], []
    for step, kw in enumerate([dict(grads_ok=False), {}, dict(loss=math.inf), {},
                               dict(loss=math.nan), {}]):
        got.append(_check(guard, step, **kw))
        bad += [r["bad"] for r in guard.read(step - 1)]  # one step late, as the trainer reads
    assert got == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]  # the third exceeds 2: halted after it
    bad += [r["bad"] for r in guard.read(5)]
    assert bad == [["gradients"], [], ["loss"], [], ["loss"], []]
    resumed = StepGuard("cpu", 1, halt_on_nonfinite=False, max_skipped=2)
    resumed.start(2)  # a checkpoint that had counted 2
    assert [_check(resumed, 0), _check(resumed, 1, loss=math.nan), _check(resumed, 2)] == [
        0.0, 1.0, 1.0]
    bad_dict = StepGuard("cpu", 1, halt_on_nonfinite=False, max_skipped=10)
    assert [_check(bad_dict, 0, dict_ok=False), _check(bad_dict, 1)] == [1.0, 1.0]


def test_records_are_read_up_to_the_step_asked_and_host_facts_travel_with_them():
    guard = StepGuard("cpu", 1, halt_on_nonfinite=True, max_skipped=0)
    _check(guard, 0)
    _check(guard, 1, signalled=True, damaged=3)
    assert [r["step"] for r in guard.read(0)] == [0]  # step 1's record waits for its turn
    (r,) = guard.read(1)
    assert r["step"] == 1 and r["signalled"] and r["damaged"] == 3 and r["bad"] == []
    assert guard.read(5) == []
    for step in range(StepGuard.SLOTS):  # records never read: an error, not an overwrite
        _check(guard, 2 + step)
    with pytest.raises(RuntimeError, match="never read"):
        _check(guard, 9)


def test_over_ranks_one_sum_adds_the_damaged_shares_and_any_ranks_flag_counts_once():
    """2 forked gloo ranks, one all-reduce (SUM) a step: the damaged clips' shares add up (the
    run's count: 2 + 3), while a flag set on both ranks (a NaN loss, a stop signal) or on one
    (the gradients) is one flag, and one skipped step, not two. (Before: MAX, the largest
    share.)"""
    from cmacc import distributed as du
    from ranks import run_ranks

    def rank_fn(rank):
        du.init_process_group("gloo", 20)
        guard = StepGuard("cpu", 2, halt_on_nonfinite=False, max_skipped=1)
        skips = [_check(guard, 0, loss=math.nan, signalled=True, damaged=2 + rank),
                 _check(guard, 1, grads_ok=rank == 0, damaged=2 + rank), _check(guard, 2)]
        return skips, guard.read(2), float(guard.skipped), float(guard.halted)

    res = run_ranks(rank_fn, timeout=60)
    skips, records, skipped, halted = res[0][1]
    assert res[0] == res[1] and skips == [1.0, 1.0, 1.0] and (skipped, halted) == (2.0, 1.0)
    assert [(r["bad"], r["signalled"], r["damaged"], r["skipped"]) for r in records] == [
        (["loss"], True, 5, True), (["gradients"], False, 5, True), ([], False, 0, True)]
