"""The method: cross-modal (and unimodal) momentum contrast with active negative sampling.

One training iteration (``CMACC.forward``), for the global batch of M clips split over ranks:

    1. momentum update of the key encoders (incl. the cross-modal fcl rule)
    2. queries  q_v, h_v = f_v(v);  q_a, h_a = f_a(a)            (with grad, this rank's clips)
       keys     k_v = h_v(v);       k_a = h_a(a)                 (no grad, shuffle-BN)
    3. pool refresh (--pool-refresh R): R batches of the pools' clips through the key encoders
       active samplers: S_v = select(U_v \\ D_v; pseudo-labels from the global q_a, h_a) → D_v
                        S_a = select(U_a \\ D_a; pseudo-labels from the global q_v, h_v) → D_a
    4. loss = ½ [CE([q_v·k_a, q_v·D_a]/τ, 0) + CE([q_a·k_v, q_a·D_v]/τ, 0)]
    5. random sampler: enqueue the batch keys (MoCo order: after the loss);
       rolling pools: push the batch keys into U_v, U_a

``smoco`` replaces 3-5 by two unimodal MoCo losses (second augmented views as keys).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function

from . import distributed as du
from .config import ModelConfig, SelectionConfig, check_method, method_name
from .encoders import (AudioResNet1d, Encoder, key_copy, momentum_pairs, momentum_update,
                       video_backbone)
from .queues import KeyPool, KeyQueue
from .samplers import select, selection_seed


def contrastive_loss(q, k_pos, negatives, tau):
    """InfoNCE with one positive (index 0) and the dictionary as negatives.
    q [B, d], k_pos [B, d], negatives [K, d] → (mean CE, top-1 accuracy)."""
    l_pos = (q * k_pos).sum(1, keepdim=True)  # [B, 1]
    l_neg = q @ negatives.t().to(q.dtype)  # [B, K]
    logits = torch.cat([l_pos, l_neg], 1) / tau  # [B, 1 + K]
    target = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
    loss = F.cross_entropy(logits.float(), target)
    acc = (logits.argmax(1) == 0).float().mean()
    return loss, acc


@contextlib.contextmanager
def _on(stream):
    """Run the block on ``stream`` after everything queued so far on the current one; None: in
    line."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


def _join(stream, *selections):
    """The current stream waits for ``stream``; the selections' tensors, made there, are marked
    as used here too (so the allocator does not hand their memory back to the side stream
    early)."""
    main = torch.cuda.current_stream(stream.device)
    main.wait_stream(stream)
    for sel in selections:
        for t in (sel.keys, sel.index, sel.gnorm, sel.fallback):
            t.record_stream(main)


class CMACC(nn.Module):
    def __init__(self, cfg: ModelConfig, selection: SelectionConfig | None = None, *,
                 backbones: tuple[nn.Module, nn.Module] | None = None):
        """``selection`` defaults to CM-ACC's (active, head view, rolling pool of
        SelectionConfig's size). ``backbones`` (optional) replaces the video and audio backbones
        by any two modules with an ``out_dim`` attribute (e.g. the image CNNs of the
        mutual-information study)."""
        super().__init__()
        self.cfg, self.sel = cfg, selection if selection is not None else SelectionConfig()
        check_method(cfg, self.sel)
        fcl = cfg.fcl_dim if cfg.fcl else None
        if backbones is None:
            backbones = (video_backbone(cfg.video_arch, cfg.video_width, cfg.video_layers),
                         AudioResNet1d(cfg.n_mels, cfg.audio_width, cfg.audio_layers))
        self.f_v = Encoder(backbones[0], cfg.dim, fcl)  # modality "v" (video, or x)
        self.f_a = Encoder(backbones[1], cfg.dim, fcl)  # modality "a" (audio, or y)
        self.h_v = key_copy(self.f_v)
        self.h_a = key_copy(self.f_a)
        if self.cross_fcl:
            if self.f_v.fcl.weight.shape != self.f_a.fcl.weight.shape:
                raise ValueError(
                    "fcl: the video and audio fcl layers differ in shape "
                    f"({tuple(self.f_v.fcl.weight.shape)} vs {tuple(self.f_a.fcl.weight.shape)}); "
                    "use equal backbone widths or --no-fcl"
                )
            # key fcl of modality x follows the query fcl of the other modality from the start
            self.h_v.fcl.load_state_dict(self.f_a.fcl.state_dict())
            self.h_a.fcl.load_state_dict(self.f_v.fcl.state_dict())
        self.dict_v = KeyQueue(cfg.dict_size, cfg.dim)  # D_v: video keys
        self.dict_a = KeyQueue(cfg.dict_size, cfg.dim)  # D_a: audio keys
        self.pool_v = KeyPool(self.sel.pool_size, cfg.dim)  # U_v
        self.pool_a = KeyPool(self.sel.pool_size, cfg.dim)  # U_a
        self.shuffle_bn = True  # MoCo's shuffle-BN in the key encoders (world size > 1)
        self.timer = None  # optional metrics.SectionTimer: times the active selection
        # optional: (dataset index [m], "video" | "audio") → keys [m, d] of those clips by the
        # current key encoder. Set, the picks' keys are re-encoded before they are enqueued (a
        # departure from Algorithm 1, which enqueues the pool's keys, encoded when the pool was
        # drawn: the MI study's --fresh-picks tests what that staleness costs)
        self.reencode = None
        # (dataset index [m] of this rank's share) → (video, audio) of those clips on the
        # model's device: what the pool refresh (SelectionConfig.pool_refresh) re-encodes
        self.fetch = None
        self._stream = None  # CUDA side stream of the selection (created on first use)
        self._last_select = None  # the last selecting step's inputs: time_selection_alone
        # this step's shuffle-BN generator, the same on every rank and after a resume (forward
        # and cmacc/fill.py set it; None: distributed.py's own)
        self.shuffle_gen = None

    @property
    def method(self) -> str:
        return method_name(self.cfg, self.sel)

    @property
    def cross_fcl(self) -> bool:
        return self.cfg.fcl and self.cfg.objective == "cross"

    def query_parameters(self):
        return list(self.f_v.parameters()) + list(self.f_a.parameters())

    # -- no-grad helpers ------------------------------------------------------------------
    @torch.no_grad()
    def _momentum_update_key_encoders(self):
        keys, queries = [], []  # every key parameter and its query source: one update
        for key, query, other in ((self.h_v, self.f_v, self.f_a), (self.h_a, self.f_a, self.f_v)):
            pairs = [(key.backbone, query.backbone), (key.head, query.head)]
            if key.fcl is not None:  # θ_k^{x,fc} ← m θ_k^{x,fc} + (1−m) θ_q^{other,fc}
                pairs.append((key.fcl, other.fcl if self.cross_fcl else query.fcl))
            for k, q in pairs:
                pk, pq = momentum_pairs(k, q)
                keys += pk
                queries += pq
        momentum_update((keys, queries), m=self.cfg.momentum)

    @torch.no_grad()
    def encode_keys(self, encoder: Encoder, x: torch.Tensor) -> torch.Tensor:
        """Key encoder forward with shuffle-BN across ranks. [B, ...] → [B, d]."""
        if not self.shuffle_bn:
            return encoder(x)[0]
        xs, unshuffle = du.batch_shuffle(x, self.shuffle_gen)
        k, _ = encoder(xs)
        return du.batch_unshuffle(k, unshuffle)

    # -- one iteration --------------------------------------------------------------------
    def forward(self, video, audio, index, step: int, video2=None, audio2=None):
        """Returns (loss, stats) with stats a dict of 0-d tensors (no host sync)."""
        cfg = self.cfg
        self.shuffle_gen = du.shuffle_generator(cfg.seed, step)
        with record_function("momentum"):
            self._momentum_update_key_encoders()
        with record_function("query_forward"):
            q_v, h_v = self.f_v(video)  # [B, d], [B, d_h]
            q_a, h_a = self.f_a(audio)
        if cfg.objective == "smoco":
            return self._smoco(q_v, q_a, index, video2, audio2)

        index_all = du.gather_cat(index)  # [M]
        stats = {}
        # active once the pool can hold the dictionary plus a batch: U \ D then has >= M
        # candidates (before that, and for XMoCo, the batch keys are enqueued: warm-up)
        ready = min(self.pool_v.size, cfg.dict_size + index_all.shape[0])
        active = self.sel.sampler != "random" and self.pool_v.count >= ready
        side, keys = None, None
        if active and self.sel.pool_refresh:
            self.refresh_pools()
        if not (active and self.sel.overlap):  # the serial schedule: keys, then the selection
            keys = self._encode_batch_keys(video, audio)
        if active:  # paper Alg. 1 lines 10-21: select, enqueue, then the loss
            q_v_all, h_v_all = du.gather_cat(q_v.detach()), du.gather_cat(h_v.detach().float())
            q_a_all, h_a_all = du.gather_cat(q_a.detach()), du.gather_cat(h_a.detach().float())
            m = index_all.shape[0]
            self._last_select = (q_a_all, h_a_all, q_v_all, h_v_all, m, step)
            # the selection needs only the queries and the pools: with overlap it is issued
            # before the key encoders, on CUDA on a side stream that runs while they do
            side = self._side_stream(q_v) if self.sel.overlap else None
            with _on(side):
                t0 = self.timer.start() if self.timer else None
                with record_function("select_v"):
                    sel_v = self._select(self.pool_v, self.dict_v, q_a_all, h_a_all, m, step, 0)
                with record_function("select_a"):
                    sel_a = self._select(self.pool_a, self.dict_a, q_v_all, h_v_all, m, step, 1)
                if self.timer:
                    self.timer.stop("select", t0)  # total time of the selection
                    if side is None:  # in line: the step waited for all of it
                        self.timer.stop("select_visible", t0)
        if keys is None:
            keys = self._encode_batch_keys(video, audio)
        k_v, k_a, k_v_all, k_a_all = keys
        if active:
            if side is not None:  # the step waits here only for what the keys did not hide
                tw = self.timer.start() if self.timer else None
                _join(side, sel_v, sel_a)
                if self.timer:  # visible: that wait
                    self.timer.stop("select_visible", tw)
            if self.reencode is not None:  # the departure above: fresh keys of the picks
                sel_v.keys = self.reencode(sel_v.index, "video")
                sel_a.keys = self.reencode(sel_a.index, "audio")
            self.dict_v.enqueue(sel_v.keys, sel_v.index)
            self.dict_a.enqueue(sel_a.keys, sel_a.index)
            stats["gnorm"] = (sel_v.gnorm + sel_a.gnorm) / 2
            stats["fallback"] = torch.maximum(sel_v.fallback, sel_a.fallback)
            stats["enq_index_v"], stats["enq_index_a"] = sel_v.index, sel_a.index
        with record_function("loss"):
            loss_va, acc_va = contrastive_loss(q_v, k_a, self.dict_a.keys.clone(), cfg.tau)
            loss_av, acc_av = contrastive_loss(q_a, k_v, self.dict_v.keys.clone(), cfg.tau)
        if not active:  # XMoCo (and the pool warm-up of the active samplers)
            self.dict_v.enqueue(k_v_all, index_all)
            self.dict_a.enqueue(k_a_all, index_all)
            stats["enq_index_v"] = stats["enq_index_a"] = index_all
        if self.sel.pool_mode == "rolling":
            self.pool_v.push(k_v_all, index_all)
            self.pool_a.push(k_a_all, index_all)
        stats.update(loss_va=loss_va.detach(), loss_av=loss_av.detach(),
                     acc=(acc_va + acc_av) / 2, active=float(active))
        return (loss_va + loss_av) / 2, stats

    @torch.no_grad()
    def refresh_pools(self):
        """Re-encode R = ``sel.pool_refresh`` global batches of the pools' entries by the current
        key encoders, round robin over the slots (at most the whole pool a step), so that no
        candidate's key is older than N / (R * M) steps. U_v and U_a hold the same clips slot by
        slot (both take each batch's, or each epoch draw's, indices), so one pass fills both.
        Every rank encodes its contiguous share of each batch and gathers the rest, as with a
        batch's keys (shuffle-BN included): every rank ends with the same pools."""
        if self.fetch is None:
            raise ValueError("pool refresh needs the clips of the pool's entries: set "
                             "CMACC.fetch (index → video, audio)")
        n, m = self.pool_v.count, self.cfg.batch_size
        world, rank = du.world_size(), du.rank()
        t0 = self.timer.start() if self.timer else None
        for _ in range(min(self.sel.pool_refresh, n // m)):
            slots = self.pool_v.next_refresh(m)  # [M] host
            self.pool_a.refresh = self.pool_v.refresh
            mine = slots.view(world, -1)[rank].to(self.pool_v.index.device)  # [M / world]
            # the clips' indices to the host: the data is read there (one sync per batch)
            video, audio = self.fetch(self.pool_v.index[mine])
            k_v, k_a = self.encode_clips(video, audio)  # [M / world, d]
            at = slots.to(self.pool_v.keys.device)
            self.pool_v.keys.index_copy_(0, at, du.gather_cat(k_v).to(self.pool_v.keys.dtype))
            self.pool_a.keys.index_copy_(0, at, du.gather_cat(k_a).to(self.pool_a.keys.dtype))
        if self.timer:
            self.timer.stop("refresh", t0)

    def _select(self, pool, dictionary, queries, feats, m, step, which, sampler=None):
        # the pool's capacity buffers and valid count: one GPU graph for every fill level;
        # ``sampler``: another sampler on the same inputs and seed (a measurement's picks)
        return select(sampler or self.sel.sampler, pool_keys=pool.keys, pool_index=pool.index, n=pool.count,
                      dict_index=dictionary.index, queries=queries, feats=feats, m=m,
                      tau_p=self.sel.tau_p, view=self.sel.grad_view,
                      seed=selection_seed(self.cfg.seed, step, which),
                      engine=dict(precision=self.sel.precision, factors=self.sel.factors,
                                  variant=self.sel.kmeans_variant))

    @record_function("key_forward")
    def _encode_batch_keys(self, video, audio):
        """k_v, k_a [B, d] of this rank's clips and their global [M, d] gathers."""
        k_v = self.encode_keys(self.h_v, video)  # [B, d]
        k_a = self.encode_keys(self.h_a, audio)
        return k_v, k_a, du.gather_cat(k_v), du.gather_cat(k_a)

    @torch.no_grad()
    def time_selection_alone(self) -> float:
        """Seconds that the last selecting step's two selections take with nothing else
        running: their device time alone, i.e. the SM time they take from a step (``t_select``
        beside the key encoders is longer by its queueing; ``t_select_visible`` is what the
        step waited). They run again with the step's queries, features, m and seeds, against
        the pools and dictionaries as the step left them (its picks enqueued: the same sizes,
        a few candidates changed), on their own stream, once the device has finished its
        queued work: a host sync, for a log row, never inside a step. The picks are discarded
        and nothing the run reads changes (the plan's output buffers are rewritten before their
        next use). 0.0 if no step has selected yet."""
        if self._last_select is None:
            return 0.0
        q_a, h_a, q_v, h_v, m, step = self._last_select

        def both():
            self._select(self.pool_v, self.dict_v, q_a, h_a, m, step, 0)
            self._select(self.pool_a, self.dict_a, q_v, h_v, m, step, 1)

        if not q_v.is_cuda:
            t = time.perf_counter()
            both()
            return time.perf_counter() - t
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        torch.cuda.synchronize(q_v.device)
        with _on(self._side_stream(q_v) if self.sel.overlap else None):
            start.record()
            both()
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def _side_stream(self, like: torch.Tensor):
        """The CUDA stream the selection runs on (created once), or None off CUDA."""
        if not like.is_cuda:
            return None
        if self._stream is None:  # high priority: its short launches go before the key
            # encoders' queued kernels instead of waiting behind each of them
            self._stream = torch.cuda.Stream(device=like.device, priority=-1)
        return self._stream

    def _smoco(self, q_v, q_a, index, video2, audio2):
        if video2 is None or audio2 is None:
            raise ValueError("objective 'smoco' needs a second augmented view (video2, audio2)")
        k_v = self.encode_keys(self.h_v, video2)
        k_a = self.encode_keys(self.h_a, audio2)
        loss_v, acc_v = contrastive_loss(q_v, k_v, self.dict_v.keys.clone(), self.cfg.tau)
        loss_a, acc_a = contrastive_loss(q_a, k_a, self.dict_a.keys.clone(), self.cfg.tau)
        index_all = du.gather_cat(index)
        self.dict_v.enqueue(du.gather_cat(k_v), index_all)
        self.dict_a.enqueue(du.gather_cat(k_a), index_all)
        stats = dict(loss_vv=loss_v.detach(), loss_aa=loss_a.detach(), acc=(acc_v + acc_a) / 2,
                     enq_index_v=index_all, enq_index_a=index_all)
        return (loss_v + loss_a) / 2, stats

    # -- dictionaries and pools from encoded clips ----------------------------------------
    @torch.no_grad()
    def encode_clips(self, video, audio):
        """Key-encoder outputs (k_v, k_a) for a batch of clips (dictionary init, epoch pools)."""
        return self.encode_keys(self.h_v, video), self.encode_keys(self.h_a, audio)
