"""The DALI loader at scale, in miniature: an epoch of many more batches than the prefetch depth
streams with flat memory, the first batch comes before the epoch is decoded, one pipeline
serves every epoch (abandoned ones included), the smaller last batch comes through, and the
ranks' shards cover an epoch once. CPU operators, tiny synthetic clips."""

import ctypes
import numpy as np
import pytest
import torch

import data_dali
from data_dali import prepare as prep
from data_dali import synthetic

pytest.importorskip("nvidia.dali")

CLIPS, BATCH, PREFETCH = 61, 3, 1  # 21 batches per epoch (the last of 1 clip) = 21 x prefetch
MIB = 1 << 20


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    src = synthetic.write_dataset(root / "src", classes=1, per_class=CLIPS, seconds=1.0, width=32,
                                  height=24, fps=10)
    return prep.prepare(src, root / "data", workers=2, progress=False,
                        cfg=prep.PrepareConfig(short_side=16, min_seconds=0.5))["manifest"]


def _loader(manifest, **kw):
    kw = dict(batch_size=BATCH, clip_frames=16, crop=112, backend="dali", num_workers=1,
              prefetch=PREFETCH, drop_last=False, seed=5) | kw
    return data_dali.build_loader(manifest, **kw)


try:  # glibc's malloc_trim (absent elsewhere: RSS is read as it is)
    _LIBC = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
except (OSError, AttributeError):
    _LIBC = None


def _rss() -> int:
    """This process's resident memory now, in bytes (/proc/self/status VmRSS), after glibc
    has returned its free pages (malloc_trim): without it RSS keeps what the decoder threads'
    malloc arenas freed, and swings by ±20 MiB from one run to the next at a fixed live size."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib * 1024


def test_epochs_stream_with_flat_memory_through_one_pipeline(manifest):
    loader = _loader(manifest)
    assert len(loader) == 21 >= 20 * PREFETCH
    rss, sizes, epoch_bytes, fed_at_first = [], [], 0, []
    for epoch in range(4):  # epoch 0 warms up (DALI's buffers, the allocator); 1-3 measured
        loader.set_epoch(epoch)
        seen = []
        for k, b in enumerate(loader):
            if k == 0:  # samples handed to the decoder when the first batch is out
                fed_at_first.append(loader._stream.source.fed - epoch * CLIPS)
            if epoch:
                rss.append(_rss())
            else:
                epoch_bytes += sum(v.nbytes for v in b.values())
            seen += b["index"].tolist()
            sizes.append(len(b["index"]))
        assert sorted(seen) == list(range(CLIPS))  # the whole epoch, once, smaller last batch too
        assert seen == sum(loader.shard_indices(), [])  # in the epoch's order
    assert sizes == ([BATCH] * 20 + [1]) * 4
    assert loader.builds == 1
    # streaming: when the first batch is out, only it and the prefetched ones were fed
    assert all(f <= (PREFETCH + 2) * BATCH < CLIPS for f in fed_at_first), fed_at_first
    # flat memory: no growth from the first third of the batches to the last (medians: the
    # allocator's noise is a few batches), no peak anywhere near one epoch of batches
    third, growth, peak = len(rss) // 3, 24 * MIB, 64 * MIB
    assert epoch_bytes > 2 * peak  # the bounds would catch a loader that held an epoch
    first, last, mib = np.median(rss[:third]), np.median(rss[-third:]), [r // MIB for r in rss]
    assert last - first < growth and max(rss) - first < peak, mib


def test_an_abandoned_epoch_is_not_decoded_to_its_end(manifest):
    loader = _loader(manifest)
    loader.set_epoch(0)
    it = iter(loader)
    next(it), next(it)  # the consumer stops after two batches (a step limit, a pool filled)
    loader.set_epoch(1)
    got = [b["index"].tolist() for b in loader]
    assert got == loader.shard_indices()  # the next epoch whole and in order
    assert loader.builds == 1
    assert loader._stream.source.fed <= (2 + PREFETCH + 1) * BATCH + CLIPS
    assert next(it, None) is None  # the abandoned epoch is over


def test_dali_shards_cover_the_epoch_once_disjointly(manifest):
    shards = [_loader(manifest, shard_id=r, num_shards=2, crop=16, clip_frames=2) for r in (0, 1)]
    got = [torch.cat([b["index"] for b in s]).tolist() for s in shards]
    assert not set(got[0]) & set(got[1])
    assert sorted(got[0] + got[1]) == list(range(CLIPS))


def test_prefetch_is_checked():
    from data_dali.loader import LoaderConfig  # (run alone, nothing has imported it yet)

    for bad in (0, -1, 65, 2.0):
        with pytest.raises(ValueError, match="prefetch"):
            LoaderConfig(batch_size=1, prefetch=bad)


def test_cpu_outputs_of_a_pipeline_are_copied_to_host_memory_whatever_the_device(manifest):
    """On a GPU pipeline the index, label and params outputs stay CPU tensor lists; they must be
    copied into host memory and moved afterwards (a device-memory destination makes DALI write
    host bytes to a device address: a segmentation fault). Told by the list's type, not by an
    attribute both kinds have. The outputs of a real (CPU) pipeline, asked for device cuda."""
    from nvidia.dali.tensors import TensorListCPU

    from data_dali.pipelines import output_device

    loader = _loader(manifest)
    loader.set_epoch(0)
    next(iter(loader))  # builds the pipeline
    out = loader._stream.pipe.run()
    assert len(out) == len(loader._stream.names) >= 3
    cuda = torch.device("cuda", 0)
    for tl in out:
        assert isinstance(tl, TensorListCPU) and hasattr(tl, "as_cpu")
        assert output_device(tl, cuda) == torch.device("cpu")


def test_the_prefetched_dali_batches_are_the_loaders_and_an_epoch_can_be_left_early(manifest):
    """Through cmacc.prefetch.Prefetcher (the trainer's thread that runs the loader ahead): the
    same batches as the DALI loader itself, a mid-epoch start included; an epoch left after two
    batches ends its thread, and the next one comes whole through the same pipeline."""
    import contextlib
    import threading

    from cmacc.prefetch import Prefetcher

    kw = dict(crop=16, clip_frames=2, prefetch=2)
    plain, ahead = _loader(manifest, **kw), Prefetcher(_loader(manifest, **kw), "cpu", depth=2)
    for epoch, start in ((0, 0), (1, 5)):
        plain.set_epoch(epoch, start=start)
        ahead.set_epoch(epoch, start=start)
        want, got = list(plain), list(ahead)
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            assert sorted(g) == sorted(w)
            for k in w:
                torch.testing.assert_close(g[k], w[k], rtol=0, atol=0)
    ahead.set_epoch(2)
    with contextlib.closing(iter(ahead)) as it:
        next(it), next(it)
    assert not [t for t in threading.enumerate() if t.name == "cmacc-prefetch"]
    ahead.set_epoch(3)
    plain.set_epoch(3)
    assert [b["index"].tolist() for b in ahead] == [b["index"].tolist() for b in plain]
    assert ahead.builds == 1
