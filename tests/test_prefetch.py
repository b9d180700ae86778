"""The background prefetcher (cmacc/prefetch.py) against the loaders it wraps: the same batches in
the same order (shards, epochs, a mid-epoch start, two views), run ahead by at most ``depth``
batches, errors raised at their batch, its thread stopped when the iterator closes; and the
pinned ring's reuse rule."""

import contextlib
import threading
import time

import pytest
import torch

import data_dali
from cmacc.data import keep_clips_on_device
from cmacc.prefetch import PinnedRing, Prefetcher
from data_dali.synthetic import ToyAV, ToyLoader


def _toy(views=1, rank=0, world=1):
    data = ToyAV(num_clips=40, num_classes=4, frames=4, size=8, seed=3)
    return ToyLoader(data, 8, seed=5, rank=rank, world=world, views=views)


def _epoch(loader, epoch, start=0):
    loader.set_epoch(epoch, start=start)
    with contextlib.closing(iter(loader)) as it:
        return [{k: v.clone() if torch.is_tensor(v) else v for k, v in b.items()} for b in it]


def _same(a, b):
    assert len(a) == len(b) and len(a) > 0
    for x, y in zip(a, b):
        assert sorted(x) == sorted(y)
        for k in x:
            torch.testing.assert_close(x[k], y[k], rtol=0, atol=0)


def _threads():
    return [t for t in threading.enumerate() if t.name == "cmacc-prefetch"]


@pytest.mark.parametrize("views,rank,world", [(1, 0, 1), (2, 0, 1), (1, 1, 2), (2, 1, 2)])
def test_the_prefetched_batches_are_the_loaders(views, rank, world):
    plain, ahead = _toy(views, rank, world), Prefetcher(_toy(views, rank, world), "cpu", depth=2)
    for epoch, start in ((0, 0), (1, 0), (1, 3), (2, 4)):  # a mid-epoch resume: start > 0
        _same(_epoch(ahead, epoch, start), _epoch(plain, epoch, start))
    assert ahead.num_clips == plain.num_clips and ahead.labels is ahead.loader.labels
    assert len(ahead) == len(plain) and not _threads()


def test_the_video_comes_channels_last_with_the_same_values():
    plain, ahead = _toy(), Prefetcher(_toy(), "cpu", channels_last=True)
    got, want = _epoch(ahead, 0), _epoch(plain, 0)
    for g, w in zip(got, want):
        assert g["video"].is_contiguous(memory_format=torch.channels_last_3d)
    _same(got, want)


class _Counting:
    """A loader that counts the batches it has made, and may fail at one."""

    def __init__(self, n=12, fail_at=None):
        self.n, self.fail_at, self.made, self.epoch = n, fail_at, 0, 0

    def set_epoch(self, epoch, start=0):
        self.epoch = epoch

    def __iter__(self):
        for b in range(self.n):
            if b == self.fail_at:
                raise FileNotFoundError(f"clip {b} vanished")
            self.made += 1
            yield {"x": torch.full((2,), float(b))}


def _wait_for(cond, seconds=10.0):
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


@pytest.mark.parametrize("depth", [1, 3])
def test_the_loader_runs_ahead_by_at_most_depth_batches(depth):
    loader = _Counting()
    it = iter(Prefetcher(loader, "cpu", depth=depth))
    first = next(it)
    # ready ahead while the consumer holds batch 0: depth waiting, one more in the thread's hand
    assert _wait_for(lambda: loader.made == 1 + depth + 1)
    time.sleep(0.2)
    assert loader.made == 1 + depth + 1  # and no further: memory is flat
    assert float(first["x"][0]) == 0.0 and [float(b["x"][0]) for b in it] == list(range(1, 12))
    assert _wait_for(lambda: not _threads())


def test_a_loader_error_is_raised_at_its_batch_after_the_earlier_ones():
    it = iter(Prefetcher(_Counting(fail_at=5), "cpu", depth=2))
    got = [float(next(it)["x"][0]) for _ in range(5)]
    assert got == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(FileNotFoundError, match="clip 5 vanished"):
        next(it)
    assert _wait_for(lambda: not _threads())


def test_closing_early_stops_the_thread_and_the_next_epoch_starts_afresh():
    loader = _Counting(n=50)
    ahead = Prefetcher(loader, "cpu", depth=2)
    with contextlib.closing(iter(ahead)) as it:
        next(it)
    assert _wait_for(lambda: not _threads())
    made = loader.made
    time.sleep(0.1)
    assert loader.made == made <= 5  # the thread stopped: nothing more is read
    assert [float(b["x"][0]) for b in ahead] == [float(k) for k in range(50)]


def test_the_reference_loaders_batches_are_the_same_prefetched(tiny_prepared):
    _, prepared = tiny_prepared

    def build():
        return data_dali.build_loader(prepared / "manifest.csv", batch_size=2, clip_frames=4,
                                      crop=16, backend="reference", num_workers=1, seed=1)

    plain, ahead = build(), Prefetcher(build(), "cpu", depth=2)
    for epoch, start in ((0, 0), (1, 2)):
        _same(_epoch(ahead, epoch, start), _epoch(plain, epoch, start))
    assert not _threads()


class _Event:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def synchronize(self):
        self.log.append(self.name)


def test_a_ring_slot_is_written_again_only_after_its_copy_has_run():
    ring, log = PinnedRing(2, pin=False), []
    bufs = []
    for k in range(5):
        buf = ring.stage("video", torch.full((3,), float(k)))
        assert buf.tolist() == [float(k)] * 3
        bufs.append(buf)
        ring.fence("video", _Event(log, f"copy {k}"))
    # slot k % 2 is reused at batch k + 2, after waiting for the copy of batch k out of it
    assert log == ["copy 0", "copy 1", "copy 2"]
    assert bufs[0] is bufs[2] is bufs[4] and bufs[1] is bufs[3] and bufs[0] is not bufs[1]
    assert ring.allocated == 2  # flat: two buffers for five batches
    ring.stage("video", torch.zeros(4))  # another shape: a new buffer for that slot
    assert ring.allocated == 3


def test_the_in_memory_clips_move_to_the_gpu_only_when_they_fit(monkeypatch):
    class Props:
        total_memory = 0

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    moved = []
    monkeypatch.setattr(ToyLoader, "to", lambda self, device: moved.append(device) or self)
    loader = _toy()
    Props.total_memory = 4 * loader.nbytes
    assert "kept on cuda:0" in keep_clips_on_device(loader, "cuda:0") and len(moved) == 1
    Props.total_memory = 4 * loader.nbytes - 4
    assert "stay in host memory" in keep_clips_on_device(loader, "cuda:0") and len(moved) == 1
    assert keep_clips_on_device(loader, "cpu") == "" and keep_clips_on_device(_toy(2), "cuda") == ""
    assert len(moved) == 1


def test_a_cuda_device_without_an_index_is_the_callers_current_one(monkeypatch):
    """The thread starts on device 0, so "cuda" is resolved where the Prefetcher is made, to the
    caller's current device (a rank's), never left for the thread to read."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert Prefetcher(_toy(), "cuda").device == torch.device("cuda", 3)
    assert Prefetcher(_toy(), torch.device("cuda", 1)).device == torch.device("cuda", 1)
    assert Prefetcher(_toy(), "cpu").device == torch.device("cpu")
