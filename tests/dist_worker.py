"""Run by tests/test_distributed.py under `torchrun --nproc_per_node=2` (gloo, CPU).
Writes OUT/rank{r}.json with what each rank saw; the test compares them.

1. gradient: the single-process gradient of a global batch (computed before the process group
   exists) equals the DDP gradient with the batch split over 2 ranks (BN in eval mode and
   shuffle-BN off, so no statistic couples the samples).
2. lock-step: several active-sampling steps under DDP; every rank reports its selected
   indices, dictionaries and weights.
3. the agreement check fails loudly when one rank's dictionary is perturbed.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from cmacc import distributed as du
from cmacc.config import method_configs
from cmacc.distributed import verify_ranks_agree
from cmacc.model import CMACC

CFG = dict(batch_size=8, dict_size=16, pool_size=40, video_width=4, video_layers=(1, 1, 1, 1),
           audio_width=4, audio_layers=(1, 1, 1, 1), fcl_dim=16, dim=8, momentum=0.9)


def global_batch(seed, b=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, 3, 4, 16, 16, generator=g), torch.randn(b, 80, 20, generator=g),
            torch.arange(b) + 100 * seed)


def grads_of(model):
    return torch.cat([p.grad.reshape(-1) for p in model.query_parameters()])


def eval_bn(model):
    for mod in model.modules():
        if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
            mod.eval()


def main(out):
    # 1a. single process, before the process group exists (world size 1)
    torch.manual_seed(0)
    ref = CMACC(*method_configs(sampler="random", **CFG))
    eval_bn(ref)
    ref.shuffle_bn = False
    v, a, idx = global_batch(0)
    loss, _ = ref(v, a, idx, step=0)
    loss.backward()
    g_single = grads_of(ref)

    dist.init_process_group("gloo")
    r, w = du.rank(), du.world_size()
    per = 8 // w
    # 1b. DDP over 2 ranks, same global batch split
    torch.manual_seed(0)
    model = CMACC(*method_configs(sampler="random", **CFG))
    eval_bn(model)
    model.shuffle_bn = False
    ddp = du.wrap_ddp(model)
    loss, _ = ddp(v[r * per:(r + 1) * per], a[r * per:(r + 1) * per], idx[r * per:(r + 1) * per],
                  step=0)
    loss.backward()
    g_ddp = grads_of(model)
    grad_err = float((g_ddp - g_single).abs().max() / g_single.abs().max())
    # the global batch keys reached every rank's dictionary in rank order
    dict_ok = bool(torch.equal(model.dict_v.index[:8], idx))

    # 2. lock-step active sampling with shuffle-BN on, train-mode BN, rank-local seeds differ
    torch.manual_seed(1)
    model = CMACC(*method_configs(sampler="active", **CFG))
    ddp = du.wrap_ddp(model)
    opt = torch.optim.Adam(model.query_parameters(), lr=1e-3)
    torch.manual_seed(1000 + r)  # different local RNG streams must not matter
    selected = []
    for step in range(10):
        v, a, idx = global_batch(step + 1)
        loss, stats = ddp(v[r * per:(r + 1) * per], a[r * per:(r + 1) * per],
                          idx[r * per:(r + 1) * per], step=step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if stats["active"]:
            selected.append(stats["enq_index_v"].tolist() + stats["enq_index_a"].tolist())
        verify_ranks_agree(model, "h", stats["enq_index_v"], step)
    # 3. a perturbed dictionary on rank 1 must be caught
    if r == 1:
        model.dict_a.keys[0, 0] += 1.0
    try:
        verify_ranks_agree(model, "h", None, 99)
        caught = ""
    except RuntimeError as e:
        caught = str(e)
    res = dict(rank=r, grad_err=grad_err, dict_ok=dict_ok, selected=selected,
               dict_v=model.dict_v.index.tolist(), dict_a=model.dict_a.index.tolist(),
               wsum=float(sum(p.double().sum() for p in model.parameters())), caught=caught)
    with open(os.path.join(out, f"rank{r}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
