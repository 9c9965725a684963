"""A minimal paged-KV inference engine hosting the offload connector (nano-vllm sized).

    eng = LLMEngine(EngineConfig(LlamaConfig.tiny(), num_gpu_blocks=32, offload_blocks=256))
    outs = eng.generate([[1, 2, 3, ...], ...], max_tokens=8)     # greedy

The connector is driven in vLLM's order:
  1. lookup      GPU prefix cache first, then the host pool (BlockManager)
  2. allocate    GPU blocks for the rest of the prompt
  3. start loads host -> GPU on the load stream: the requests admitted in a step with host
                 hits go out as jobs of up to load_job_blocks blocks; they wait in LOADING
                 while others run (overlap)
  4. wait        a request joins a forward only after its load job is reported
                 finished (its end event completed), so attention reads landed blocks
  5. store       newly full blocks, queued as one job per step right after the forward
                 is launched (the job waits on the compute stream, so host work overlaps it)
  6. flush       on preemption and finish: the compute stream is fenced on the
                 request's pending stores before its GPU blocks can be reused
"""
from __future__ import annotations

import copy
import gc
import hashlib
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Hashable, Optional

import numpy as np
import torch

from kernels.tracing import nvtx_range
from layout import KVBlockMover, KVLayout, UnifiedKVCache, allocate

from ..block_manager import BlockManager
from .io import tokens_to_host, upload
from .model import Llama, LlamaConfig, SeqBatch


@dataclass
class EngineConfig:
    model: LlamaConfig
    block_size: int = 16
    num_gpu_blocks: int = 64
    layout: str = "unified"        # "unified" (NB_NL_TWO_BS_NH_HS) or "per_layer" (TWO_NB_BS_NH_HS)
    offload_blocks: int = 0        # host pool blocks; 0 disables offloading
    method: str = "auto"           # kvoffload transfer method
    max_batch_tokens: int = 4096
    max_seqs: int = 64             # sequences in a forward batch
    # requests whose host blocks are being loaded; like vLLM's WAITING_FOR_REMOTE_KVS they do
    # not count against max_seqs, so the next loads overlap the current batch (None: 2 x max_seqs)
    max_loading_seqs: Optional[int] = None
    # a step's admitted loads go out as jobs of at most this many blocks (a request is never
    # split). Several jobs queued back to back keep the load stream busy while the host is
    # launching a forward; one job per step left PCIe idle from a job's end to the next poll
    # (docs/design/engine-host-path.md). 0: one job per step.
    load_job_blocks: int = 1024
    device: str = "cpu"
    seed: int = 0
    # "paged": Triton RoPE/cache-write and paged attention for prefix-continuing sequences
    # (connector.engine.attention); "sdpa": torch only; "auto": paged on CUDA with Triton
    attention: str = "auto"
    freeze_gc: bool = True         # gc.freeze() after start-up (see LLMEngine.__init__)
    # CUDA graphs for paged batches of only prefix-continuing sequences, up to this many
    # tokens and sequences (connector.engine.graphs); 0 disables. Only with attention "paged"
    # on CUDA.
    cuda_graph_tokens: int = 256
    cuda_graph_seqs: int = 1
    # TransferWorker(native_submit=...): DMA jobs from a C++ thread. The worker's default is
    # True; here False, the mode the committed TTFT and throughput runs used (--native-submit)
    native_submit: bool = False
    warmup: bool = True            # compile every Triton variant at start-up (attention.warmup)
    time_forwards: bool = False    # CUDA events around each forward (forward_gpu_ms; benchmarks)


@dataclass
class Seq:
    id: int
    prompt: list
    max_tokens: int
    output: list = field(default_factory=list)
    blocks: list = field(default_factory=list)
    num_computed: int = 0
    status: str = "waiting"        # waiting | loading | running | finished
    load_job: Optional[int] = None
    load_hashes: list = field(default_factory=list)
    stored_upto: int = 0           # full blocks already handed to the store path
    store_jobs: list = field(default_factory=list)
    preemptions: int = 0
    hashes: list = field(default_factory=list)  # chained hashes of the full blocks so far (cached)

    @property
    def tokens(self) -> list:
        return self.prompt + self.output


def block_hashes(tokens: list, block_size: int, prefix: Optional[list] = None) -> list:
    """Chained hashes of the full blocks: block i's key covers tokens 0 .. (i+1)*block_size.

    prefix: hashes already known for the first blocks (extended, not recomputed).
    """
    out = list(prefix or [])
    n = len(tokens) // block_size
    if len(out) >= n:
        return out[:n]
    raw = np.asarray(tokens[len(out) * block_size:n * block_size], np.int64).tobytes()
    step = block_size * 8
    prev = out[-1] if out else b""
    for i in range(n - len(out)):
        prev = hashlib.sha256(prev + raw[i * step:(i + 1) * step]).digest()
        out.append(prev)
    return out


def seq_hashes(s: "Seq", block_size: int, upto_tokens: int) -> list:
    """s's chained block hashes for its first upto_tokens tokens, cached on s (tokens never change)."""
    n = upto_tokens // block_size
    if len(s.hashes) < n:
        s.hashes = block_hashes(s.tokens[: n * block_size], block_size, s.hashes)
    return s.hashes[:n]


_UNFREEZE = []


def _unfreeze_at_exit() -> None:
    # frozen objects are skipped by the final collection; extensions that count their live
    # objects at exit (nanobind) would report them as leaks
    if not _UNFREEZE:
        import atexit

        atexit.register(gc.unfreeze)
        _UNFREEZE.append(True)


class BlockPool:
    """GPU blocks: a free list in LRU order plus a prefix cache (hash -> block) of blocks
    whose contents stay valid until the block is handed out again."""

    def __init__(self, n: int):
        self.free: OrderedDict = OrderedDict((b, None) for b in range(n))
        self.ref = [0] * n
        self.cached: dict = {}     # hash -> block
        self.hash_of: dict = {}    # block -> hash

    def allocate(self) -> Optional[int]:
        if not self.free:
            return None
        b, _ = self.free.popitem(last=False)
        h = self.hash_of.pop(b, None)
        if h is not None:
            self.cached.pop(h, None)
        self.ref[b] = 1
        return b

    def take_cached(self, h: Hashable) -> Optional[int]:
        b = self.cached.get(h)
        if b is None:
            return None
        if self.ref[b] == 0:
            self.free.pop(b)
        self.ref[b] += 1
        return b

    def register(self, b: int, h: Hashable) -> None:
        if h not in self.cached:
            self.cached[h] = b
            self.hash_of[b] = h

    def release(self, blocks: list) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None  # newest at the end: evicted last

    def reset_prefix_cache(self) -> None:
        self.cached.clear()
        self.hash_of.clear()


class LLMEngine:
    def __init__(self, cfg: EngineConfig, model: Optional[Llama] = None):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.model = (model or Llama(cfg.model, seed=cfg.seed)).to(self.device)
        self.spec = cfg.model.kv_spec(cfg.block_size)
        nb = cfg.num_gpu_blocks
        if cfg.layout == "unified":
            self.cache = UnifiedKVCache(self.spec, nb, device=self.device)
            self.cache.buffer.zero_()
            views = [self.cache.layer_view(l, KVLayout.TWO_NB_BS_NH_HS) for l in range(cfg.model.layers)]
            self.mover = KVBlockMover(self.spec, KVLayout.NB_NL_TWO_BS_NH_HS, self.cache.unified())
        elif cfg.layout == "per_layer":
            views = allocate(self.spec, KVLayout.TWO_NB_BS_NH_HS, nb, device=self.device, fill=lambda t: t.zero_())
            self.mover = KVBlockMover(self.spec, KVLayout.TWO_NB_BS_NH_HS, views)
        else:
            raise ValueError(f"layout must be 'unified' or 'per_layer', got {cfg.layout!r}")
        self.kv_views = views  # per layer [2, NB, BS, H, D]
        if cfg.attention not in ("auto", "paged", "sdpa"):
            raise ValueError(f"attention must be 'auto', 'paged' or 'sdpa', got {cfg.attention!r}")
        from kernels.triton_copy import HAVE_TRITON

        if cfg.attention == "paged" and not HAVE_TRITON:
            raise ValueError("attention='paged' needs triton")
        self.paged = cfg.attention == "paged" or (cfg.attention == "auto" and self.device.type == "cuda"
                                                  and HAVE_TRITON)
        self.graphs = None
        if self.paged and self.device.type == "cuda" and cfg.cuda_graph_tokens > 0:
            from .graphs import GraphRunner

            self.graphs = GraphRunner(self.device, max_tokens=cfg.cuda_graph_tokens,
                                      max_seqs=cfg.cuda_graph_seqs)
        if self.paged and self.device.type == "cuda" and cfg.warmup:
            from .attention import warmup

            with nvtx_range("engine.warmup"):
                warmup(views[0][0], views[0][1], cfg.model.heads, self.model.embed.dtype)
                tokens_to_host(upload(np.zeros(1, np.int64), self.device))
        self.pool = BlockPool(nb)
        self.seqs: dict = {}
        self.waiting: deque = deque()
        self.running: list = []
        self.loading: list = []
        self.next_id = 0
        self.next_job = 0
        self.cuda = self.device.type == "cuda"
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "loaded_blocks": 0, "stored_blocks": 0,
                      "gpu_prefix_hit_blocks": 0, "preemptions": 0, "steps": 0, "forwards": 0,
                      "forward_seqs": 0}
        # host seconds per step phase (launches are asynchronous: "forward" is the host time to
        # queue it, "finish" includes the wait for its logits); "forward_gpu": GPU seconds of
        # the forwards, summed by forward_gpu_ms()
        self.timing = {"schedule": 0.0, "forward": 0.0, "store": 0.0, "finish": 0.0, "forward_gpu": 0.0}
        self._fwd_events: list = []  # (start, end) CUDA events of each forward, see forward_gpu_ms
        self.offload = cfg.offload_blocks > 0
        if self.offload:
            ub = self.spec.unified_block_bytes
            self.bm = BlockManager(cfg.offload_blocks, block_bytes=ub)
            if self.cuda:
                from ..host_pool import HostPool
                from ..worker import TransferWorker

                self.host_pool = HostPool(cfg.offload_blocks, ub, self.device)
                self.host_pool.wait_pinned()
                self.worker = TransferWorker(self.mover, self.host_pool.tensor, method=cfg.method,
                                             native_submit=cfg.native_submit)
            else:
                self.host = torch.zeros(cfg.offload_blocks, ub, dtype=torch.uint8)
            self._cpu_done: list = []       # CPU path: finished jobs awaiting the next poll
            self.pending_stores: dict = {}  # job -> hashes
            self.pending_loads: dict = {}   # job -> seq ids
        self.deferred: list = []  # (pending store jobs, GPU blocks freed once they are done)
        self._offload_epoch = 0   # reset_offload count: offload_state snapshots are only valid within one
        if cfg.freeze_gc:
            # A full collection walks every object torch, triton and the model created (pauses
            # of milliseconds inside steps: docs/design/engine-host-path.md); freezing them, as
            # vLLM does after start-up, leaves collections only the engine's own garbage.
            gc.collect()
            gc.freeze()
            _unfreeze_at_exit()

    # ------------------------------------------------------------------ API
    def add_request(self, prompt: list, max_tokens: int) -> int:
        if not prompt:
            raise ValueError("empty prompt")
        s = Seq(self.next_id, list(prompt), max_tokens)
        self.next_id += 1
        self.seqs[s.id] = s
        self.waiting.append(s)
        return s.id

    def generate(self, prompts: list, max_tokens: int) -> list:
        ids = [self.add_request(p, max_tokens) for p in prompts]
        while self.has_work():
            self.step()
        self.drain()
        return [self.seqs[i].output for i in ids]

    def forward_gpu_ms(self) -> float:
        """GPU milliseconds from each forward's first to last kernel since the last call, also
        added to timing["forward_gpu"] (needs EngineConfig.time_forwards; synchronises). Compared
        with wall time it shows whether a run was bound by the forwards or by something else."""
        if not self._fwd_events:
            return 0.0
        self._fwd_events[-1][1].synchronize()
        ms = sum(a.elapsed_time(b) for a, b in self._fwd_events)
        self._fwd_events = []
        self.timing["forward_gpu"] += ms / 1e3
        return ms

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def drain(self) -> None:
        """Waits for every transfer (end of a run)."""
        if self.offload:
            if self.cuda:
                self.worker.wait(list(self.worker.jobs))
            self._poll()

    # ------------------------------------------------------------------ one step
    def step(self) -> None:
        self.stats["steps"] += 1
        tm, t0 = self.timing, time.perf_counter()
        with nvtx_range("engine.schedule"):
            self._poll()
            self._reserve_decode_blocks()
            self._admit()
        # loaded requests join `running` when their job completes, so it can briefly hold more
        # than max_seqs; the oldest max_seqs go first
        batch = [s for s in self.running if s.status == "running"][: self.cfg.max_seqs]
        t1 = time.perf_counter()
        tm["schedule"] += t1 - t0
        if not batch:
            return
        self.stats["forwards"] += 1
        self.stats["forward_seqs"] += len(batch)
        timed = self.cuda and self.cfg.time_forwards
        if timed:
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
        with nvtx_range(f"engine.forward seqs={len(batch)}"):
            logits = self._forward(batch)
        if timed:
            ev[1].record()
            self._fwd_events.append(ev)
        t2 = time.perf_counter()
        # Stores cover only tokens computed before this step's output, so they are queued
        # while the GPU still runs the forward (each waits on the compute stream), and the
        # whole step's new full blocks go out as one job.
        with nvtx_range("engine.store"):
            self._store_step(batch)
        t3 = time.perf_counter()
        nxt = tokens_to_host(logits.argmax(-1))  # an SM copy: the copy engines may be busy with KV
        for s, t in zip(batch, nxt):
            s.output.append(int(t))
        for s in [s for s in batch if len(s.output) >= s.max_tokens]:
            self._finish(s)
        tm["forward"] += t2 - t1
        tm["store"] += t3 - t2
        tm["finish"] += time.perf_counter() - t3
        if len(self._fwd_events) >= 64:
            self.forward_gpu_ms()  # the token read-back above waited for these: no extra sync

    # ------------------------------------------------------------------ scheduling
    def _poll(self) -> None:
        if not self.offload:
            return
        done = self.worker.get_finished() if self.cuda else self._cpu_done
        if not self.cuda:
            self._cpu_done = []
        for r in done:
            if r.job_id in self.pending_stores:
                self.bm.complete_store(self.pending_stores.pop(r.job_id), r.ok)
            elif r.job_id in self.pending_loads:
                for sid in self.pending_loads.pop(r.job_id):
                    s = self.seqs[sid]
                    self.bm.complete_load(s.load_hashes)
                    if not r.ok:
                        raise RuntimeError(f"load job {r.job_id} failed: {r.error}")
                    # reported only after its end event completed: the blocks have landed
                    s.status, s.load_job = "running", None
                    self.loading.remove(s)
                    self.running.append(s)
        if self.deferred:
            keep = []
            for jobs, blocks in self.deferred:
                jobs = {j for j in jobs if j in self.pending_stores}
                if jobs:
                    keep.append((jobs, blocks))
                else:
                    self.pool.release(blocks)
            self.deferred = keep

    def _blocks_needed(self, s: Seq, upto: int) -> int:
        return -(-upto // self.cfg.block_size) - len(s.blocks)

    def _reserve_decode_blocks(self) -> None:
        for s in list(self.running):
            if s not in self.running:
                continue
            while self._blocks_needed(s, len(s.tokens)) > 0:
                b = self.pool.allocate()
                if b is None and self._reclaim():
                    continue
                if b is None:
                    victim = self.running[-1]
                    self._preempt(victim)
                    if victim is s:
                        break
                    continue
                s.blocks.append(b)

    def _admit(self) -> None:
        bs = self.cfg.block_size
        budget = self.cfg.max_batch_tokens - len(self.running)
        loads: dict = {}
        max_loading = 2 * self.cfg.max_seqs if self.cfg.max_loading_seqs is None else self.cfg.max_loading_seqs
        cap = self.cfg.load_job_blocks
        while self.waiting and (len(self.running) < self.cfg.max_seqs or len(self.loading) < max_loading):
            s = self.waiting[0]
            toks = s.tokens
            hashes = seq_hashes(s, bs, len(toks))
            usable = (len(toks) - 1) // bs  # keep at least one token to compute
            n_gpu = 0
            for h in hashes[:usable]:
                if h not in self.pool.cached:
                    break
                n_gpu += 1
            n_cpu = self.bm.lookup(hashes[n_gpu:usable]) if self.offload else 0
            if (len(self.loading) >= max_loading) if n_cpu else (len(self.running) >= self.cfg.max_seqs):
                break  # keep arrival order: the head request waits for its kind of slot
            need = -(-len(toks) // bs) - n_gpu
            if need > len(self.pool.free) - sum(self.pool.ref[self.pool.cached[h]] == 0 for h in hashes[:n_gpu]):
                if self._reclaim():
                    continue
                break
            todo = len(toks) - (n_gpu + n_cpu) * bs
            if todo > budget and self.running:
                break
            self.waiting.popleft()
            s.blocks = [self.pool.take_cached(h) for h in hashes[:n_gpu]]
            s.blocks += [self.pool.allocate() for _ in range(need)]
            self.stats["gpu_prefix_hit_blocks"] += n_gpu
            s.num_computed = (n_gpu + n_cpu) * bs
            s.stored_upto = n_gpu + n_cpu  # these are already on the host or shared
            budget -= todo
            if n_cpu:
                if cap and loads and len(loads["blocks"]) + n_cpu > cap:
                    self._submit_loads(loads)  # full: queue it, start the next job
                    loads = {}
                self._begin_load(s, hashes[n_gpu:n_gpu + n_cpu], s.blocks[n_gpu:n_gpu + n_cpu], loads)
            else:
                s.status = "running"
                self.running.append(s)
        self._submit_loads(loads)

    def _begin_load(self, s: Seq, hashes: list, gpu_blocks: list, batch: dict) -> None:
        """Pins s's host blocks (so they cannot be evicted) and adds them to this step's load job."""
        if "job" not in batch:
            batch.update(job=self._job(), slots=[], blocks=[], seqs=[])
        batch["slots"] += self.bm.prepare_load(hashes)
        batch["blocks"] += gpu_blocks
        batch["seqs"].append(s.id)
        s.status, s.load_job, s.load_hashes = "loading", batch["job"], hashes
        self.loading.append(s)
        self.stats["loaded_blocks"] += len(hashes)

    def _submit_loads(self, batch: dict) -> None:
        """One load job for the requests gathered in `batch`; each of them waits until the
        job is reported done."""
        if not batch:
            return
        job = batch["job"]
        self.pending_loads[job] = batch["seqs"]
        with nvtx_range(f"engine.load.submit n={len(batch['blocks'])} seqs={len(batch['seqs'])}"):
            self._transfer(job, False, batch["blocks"], batch["slots"])

    # ------------------------------------------------------------------ forward
    def _forward(self, batch: list) -> torch.Tensor:
        bs = self.cfg.block_size
        cols, starts, lens, ctx, tables, host_tables = [], [], [], [], [], []
        T = 0
        for s in batch:
            all_t = s.tokens
            lo, hi = s.num_computed, len(all_t)
            starts.append(T)
            lens.append(hi - lo)
            ctx.append(hi)
            T += hi - lo
            p = np.arange(lo, hi)
            # token, position, KV block, offset in the block
            cols.append(np.stack([np.asarray(all_t[lo:hi], np.int64), p,
                                  np.asarray(s.blocks, np.int64)[p // bs], p % bs]))
            host_tables.append(s.blocks[: -(-hi // bs)])
            # the paged path uploads host_tables with the rest of the forward's indices
            tables.append(None if self.paged else torch.as_tensor(host_tables[-1], device=self.device))
            if hi - lo > 1:
                self.stats["prefill_tokens"] += hi - lo
            else:
                self.stats["decode_tokens"] += 1
        io = np.concatenate(cols, 1)  # [4, T]
        if self.paged:  # the model packs io with the attention metadata into one upload
            b = SeqBatch(None, None, None, None, starts, lens, ctx, tables, host_tables, io)
        else:
            meta = upload(io, self.device).view(4, -1)  # one upload
            b = SeqBatch(meta[0], meta[1], meta[2], meta[3], starts, lens, ctx, tables, host_tables)
        logits = self.model(b, lambda l: (self.kv_views[l][0], self.kv_views[l][1]), bs, nvtx=nvtx_range,
                            paged=self.paged, graphs=self.graphs)
        for s in batch:
            s.num_computed = len(s.tokens)
        return logits

    # ------------------------------------------------------------------ stores, finish, preemption
    def _store_step(self, batch: list) -> None:
        """Registers the batch's newly full blocks in the GPU prefix cache and stores them to
        the host in one job (blocks already on the host or in flight are skipped)."""
        bs = self.cfg.block_size
        hashes, blocks, owners = [], [], []
        for s in batch:
            full = s.num_computed // bs
            if full <= s.stored_upto:
                continue
            hs = seq_hashes(s, bs, full * bs)
            for i in range(s.stored_upto, full):
                self.pool.register(s.blocks[i], hs[i])
            hashes += hs[s.stored_upto:full]
            blocks += s.blocks[s.stored_upto:full]
            owners.append(s)
            s.stored_upto = full
        if not self.offload or not hashes:
            return
        plan = self.bm.prepare_store(hashes)
        if not plan.hashes:
            return
        idx = {h: i for i, h in enumerate(hashes)}
        job = self._job()
        self.pending_stores[job] = plan.hashes
        for s in owners:
            s.store_jobs.append(job)
        self.stats["stored_blocks"] += len(plan.hashes)
        with nvtx_range(f"engine.store.submit n={len(plan.hashes)} seqs={len(owners)}"):
            self._transfer(job, True, [blocks[idx[h]] for h in plan.hashes], plan.slots)

    def _release(self, s: Seq) -> None:
        """Frees s's GPU blocks once its pending stores have read them (see _poll). Until then
        the blocks keep their reference, so nothing reuses them and compute never waits for a
        store; `_reclaim` frees them early, behind a stream fence, when blocks run short."""
        jobs = {j for j in s.store_jobs if j in self.pending_stores} if self.offload else set()
        s.store_jobs = []
        if jobs:
            self.deferred.append((jobs, s.blocks))
        else:
            self.pool.release(s.blocks)
        s.blocks = []

    def _reclaim(self) -> bool:
        """Frees every deferred block now: compute waits (on the GPU, no host sync) for the
        stores that still read them. Returns whether anything was freed."""
        if not self.deferred:
            return False
        with nvtx_range(f"engine.reclaim n={len(self.deferred)}"):
            for jobs, blocks in self.deferred:
                if self.cuda:
                    for j in jobs:
                        self.worker.fence(j)
                self.pool.release(blocks)
            self.deferred = []
        return True

    def _finish(self, s: Seq) -> None:
        s.status = "finished"
        self.running.remove(s)
        self._release(s)

    def _preempt(self, s: Seq) -> None:
        """Frees s's GPU blocks (after storing its full blocks) and puts it back in front of the queue."""
        self.stats["preemptions"] += 1
        s.preemptions += 1
        self.running.remove(s)
        self._release(s)
        s.num_computed, s.stored_upto, s.status = 0, 0, "waiting"
        self.waiting.appendleft(s)

    # ------------------------------------------------------------------ transfers
    def _job(self) -> int:
        self.next_job += 1
        return self.next_job

    def _transfer(self, job: int, store: bool, gpu_blocks: list, slots: list) -> None:
        if self.cuda:
            if store:
                self.worker.submit_store(job, gpu_blocks, slots)
            else:
                self.worker.submit_load(job, slots, gpu_blocks)
            return
        # CPU: the reference path, synchronous; completion is reported at the next poll
        from ..worker import JobResult

        if store:
            self.mover.pack(gpu_blocks, self.host, slots, method="torch")
        else:
            self.mover.unpack(self.host, slots, gpu_blocks, method="torch")
        self._cpu_done.append(
            JobResult(job, "store" if store else "load", True, len(slots) * self.spec.unified_block_bytes, None))

    def reset_prefix_cache(self) -> None:
        """Forgets the GPU prefix cache (as if its blocks had been evicted)."""
        self.pool.reset_prefix_cache()

    def reset_offload(self) -> None:
        """Forgets every block stored in the host pool (keeps the pool and its pinning: benchmarks
        reuse one engine across runs). Waits for transfers in flight first."""
        if not self.offload:
            return
        self.drain()
        self.bm = BlockManager(self.cfg.offload_blocks, block_bytes=self.spec.unified_block_bytes)
        self._offload_epoch += 1

    def offload_state(self) -> tuple:
        """A copy of the host pool's bookkeeping (which blocks it holds, in which slots), for
        `restore_offload`: a benchmark repeats a run from the same stored set without
        computing and storing it again. Waits for transfers in flight first."""
        if not self.offload:
            raise RuntimeError("offload_state: this engine has no host pool")
        self.drain()
        return self._offload_epoch, copy.deepcopy(self.bm)

    def restore_offload(self, state: tuple) -> None:
        """Back to the stored set of `state` (from `offload_state`). The pool's bytes are not
        copied: the slots `state` maps must not have been written since. That holds while the
        pool has neither been reset (`reset_offload` frees every slot) nor evicted anything
        (stores then only take free slots); else this raises."""
        epoch, bm = state
        self.drain()
        if epoch != self._offload_epoch:
            raise RuntimeError("restore_offload: reset_offload ran since the snapshot; its slots may hold "
                               "other bytes now")
        if self.bm.counters.evictions != bm.counters.evictions:
            raise RuntimeError(f"restore_offload: the pool evicted {self.bm.counters.evictions - bm.counters.evictions}"
                               " blocks since the snapshot; their slots may hold other bytes now")
        self.bm = copy.deepcopy(bm)
