"""Dictionaries and pools from encoded clips (paper Alg. 1 lines 3-4 and 6-7), and the first step
at which a run's sampler selects."""

from __future__ import annotations

import torch

from . import distributed as du
from .config import Config
from .prefetch import to_device


@torch.no_grad()
def encode_random_clips(model, loader, n, device, seed):
    """Key-encoder outputs (k_v, k_a, index) of n random clips of the global dataset (drawn
    with replacement across passes when the dataset is smaller than n). Same on every rank."""
    ks_v, ks_a, idx, got = [], [], [], 0
    g = torch.Generator().manual_seed(seed)
    model.shuffle_gen = du.shuffle_generator(seed, -1)  # shuffle-BN's, the same on every rank
    while got < n:
        loader.set_epoch(10_000 + int(torch.randint(0, 1 << 30, (1,), generator=g)))
        batches = iter(loader)
        try:
            for batch in batches:
                batch = to_device({k: batch[k] for k in ("video", "audio", "index")}, device)
                kv, ka = model.encode_clips(batch["video"], batch["audio"])
                ks_v.append(du.gather_cat(kv))
                ks_a.append(du.gather_cat(ka))
                idx.append(du.gather_cat(batch["index"]))
                got += idx[-1].shape[0]
                if got >= n:
                    break
        finally:  # a generator's (a prefetching loader's thread) ends here
            getattr(batches, "close", lambda: None)()
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


def first_selecting_step(cfg: Config) -> int | None:
    """The first step (1-based) at which the sampler selects the negatives (None: never, as
    XMoCo and SMoCo do not select). A rolling pool must first hold the dictionary plus a batch,
    min(N, K + M) keys, at M keys a step (cmacc/model.py); an epoch pool is filled at once."""
    sel, m = cfg.selection, cfg.model
    if sel.sampler == "random" or m.objective != "cross":
        return None
    if sel.pool_mode == "epoch":
        return 1
    return -(-min(sel.pool_size, m.dict_size + m.batch_size) // m.batch_size) + 1
