"""A CPU harness around vLLM's real Scheduler and connector classes (no GPU, no model).

Builds a VllmConfig from a tiny local Llama config.json, the KV-transfer config
under test, a KVCacheConfig of CPU tensors, vLLM's Scheduler, and a worker-role
connector whose KV caches are CPU tensors. `step()` runs one scheduler step the
way the engine core does: schedule, run the worker connector (loads, stores,
completions), fake one sampled token per request, update the scheduler.
"""
from __future__ import annotations

import dataclasses
import json
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from connector.vllm_compat import CROSS_LAYER_BLOCKS  # noqa: E402

BLOCK = 16
LAYERS = 2
HEADS = 2
HEAD = 16


def make_model_dir(path: str) -> str:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": HEADS,
           "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "torch_dtype": "float32", "head_dim": HEAD}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def kv_cache_tensors(KVCacheTensor, layer_names, page, num_blocks, block_outer):
    """vLLM's description of one buffer holding every layer, block-outer (a block holds every
    layer's page) or layer-outer. vLLM 0.32+: one KVCacheTensor with layer/block strides;
    0.26: one per layer."""
    n = len(layer_names)
    if "layers" in {f.name for f in dataclasses.fields(KVCacheTensor)}:
        return [KVCacheTensor(size=page * n * num_blocks, layers=list(layer_names),
                              layer_stride=page if block_outer else page * num_blocks,
                              block_stride=page * n if block_outer else page)]
    # 0.26: one tensor per layer (block-outer buffers are registered as vLLM 0.26 does it,
    # one cross-layer tensor: Harness.__init__)
    return [KVCacheTensor(size=page * num_blocks, shared_by=[name]) for name in layer_names]


class _CrossLayerBackend:
    """The two attention-backend methods vLLM 0.26's register_cross_layers_kv_cache reads:
    logical shape (num_blocks, 2, block, heads, head); with the layers dimension in front,
    physical order = (num_blocks, layers, 2, block, heads, head)."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension=False):
        return (1, 0, 2, 3, 4, 5) if include_num_layers_dimension else (0, 1, 2, 3, 4)


def make_vllm_config(model_dir: str, kv_transfer: dict, max_num_batched_tokens: int = 256):
    """A VllmConfig for the tiny model with `kv_transfer` (deep-copied: the connector may
    write into its extra config, and the caller's dict must stay as it was)."""
    import copy

    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                             VllmConfig)

    model_config = ModelConfig(model=model_dir, tokenizer=None, skip_tokenizer_init=True,
                               dtype="float32", max_model_len=2048, seed=0)
    return VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=2048, is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(**copy.deepcopy(kv_transfer)),
        device_config=DeviceConfig("cpu"),
    )


def front_end_prom(vllm_config):
    """vLLM's front-end Prometheus side of the KV connector (KVConnectorProm, built the way
    the API server / LLM's process builds it: from the config alone, no connector instance),
    on a private registry. Returns (prom, registry)."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    reg = CollectorRegistry()

    class Prom(KVConnectorProm):
        _gauge_cls = functools.partial(Gauge, registry=reg)
        _counter_cls = functools.partial(Counter, registry=reg)
        _histogram_cls = functools.partial(Histogram, registry=reg)

    return Prom(vllm_config, ["engine"], {0: ["0"]}), reg


class Harness:
    def __init__(self, model_dir: str, kv_transfer: dict, num_gpu_blocks: int = 40,
                 max_num_batched_tokens: int = 256, block_outer: bool = True, hybrid: bool = False,
                 device: str = "cpu"):
        """hybrid: two KV-cache groups the way vLLM's hybrid allocator lays them out (layer 0 full
        attention, layer 1 sliding window of 2 blocks), both over ONE buffer [num_blocks, 2, BLOCK,
        HEADS, HEAD]: a block id belongs to one group at a time.
        device: where the stand-in KV caches live (default "cpu": the worker copies synchronously;
        "cuda": our worker runs its real asynchronous TransferWorker on them, and `fill_computed`
        writes on the current stream, as compute would)."""
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                                KVCacheTensor, SlidingWindowSpec)
        from vllm.v1.structured_output import StructuredOutputManager

        self.vllm_config = make_vllm_config(model_dir, kv_transfer, max_num_batched_tokens)
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
        self.num_blocks = num_gpu_blocks
        page = spec.page_size_bytes
        self.block_outer = block_outer
        # one allocation; block-outer (BLHNC-like: a block holds every layer) or layer-outer
        self.hybrid = hybrid
        if hybrid:
            swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32,
                                    sliding_window=2 * BLOCK)
            groups = [KVCacheGroupSpec([self.layer_names[0]], spec), KVCacheGroupSpec([self.layer_names[1]], swa)]
            if "layers" in {f.name for f in dataclasses.fields(KVCacheTensor)}:
                tensors = [KVCacheTensor(size=page * num_gpu_blocks, layers=[n], layer_stride=page * num_gpu_blocks,
                                         block_stride=page) for n in self.layer_names]
            else:
                tensors = [KVCacheTensor(size=page * num_gpu_blocks, shared_by=list(self.layer_names))]
        else:
            groups = [KVCacheGroupSpec(self.layer_names, spec)]
            tensors = kv_cache_tensors(KVCacheTensor, self.layer_names, page, num_gpu_blocks, block_outer)
        self.kv_cache_config = KVCacheConfig(num_blocks=num_gpu_blocks, kv_cache_tensors=tensors,
                                             kv_cache_groups=groups)
        self.group_layers = [[self.layer_names.index(n) for n in g.layer_names] for g in groups]
        self.page = page
        self.vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
        with set_current_vllm_config(self.vllm_config):
            self.scheduler = Scheduler(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                                       structured_output_manager=StructuredOutputManager(self.vllm_config),
                                       block_size=BLOCK, log_stats=True)
            self.worker = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER,
                                                              self.kv_cache_config)
        # CPU tensors stand in for the GPU caches: per-layer views [num_blocks, 2, BLOCK, HEADS, HEAD]
        # of one buffer, in the placement the KVCacheTensor above describes
        if hybrid:
            self.buf = torch.zeros(num_gpu_blocks, 2, BLOCK, HEADS, HEAD, device=device)
            self.kv = {n: self.buf for n in self.layer_names}
        elif block_outer:
            self.buf = torch.zeros(num_gpu_blocks, LAYERS, 2, BLOCK, HEADS, HEAD, device=device)
            self.kv = {n: self.buf[:, i] for i, n in enumerate(self.layer_names)}
        else:
            self.buf = torch.zeros(LAYERS, num_gpu_blocks, 2, BLOCK, HEADS, HEAD, device=device)
            self.kv = {n: self.buf[i] for i, n in enumerate(self.layer_names)}
        if block_outer and not hybrid and CROSS_LAYER_BLOCKS:
            # vLLM 0.26's block-outer route: the model runner allocates one cross-layer tensor
            # (prefer_cross_layer_blocks) and registers it whole
            self.worker.register_cross_layers_kv_cache(self.buf, _CrossLayerBackend)
        else:
            self.worker.register_kv_caches(self.kv)
        self.stored_jobs = 0
        self.finished_sending: set = set()
        self.finished_recving: set = set()
        self.steps = 0
        self.block_ids: dict = {}  # request -> its group-0 block ids
        self.group_block_ids: dict = {}  # request -> block ids per KV-cache group
        self.stats: list = []
        self.preempted: set = set()

    @property
    def connector(self):
        return self.scheduler.connector

    def add_request(self, req_id: str, prompt: list[int], max_tokens: int = 1):
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        if not getattr(self, "_none_hash", False):  # once: vLLM 0.26 draws a random one per call
            init_none_hash(sha256)
            self._none_hash = True
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        r = Request(req_id, prompt, sp, None, block_hasher=get_request_block_hasher(BLOCK, sha256))
        self.scheduler.add_request(r)
        return r

    def fill_computed(self, so):
        """'Compute' KV for scheduled tokens: a deterministic function of (token id, position),
        so loaded blocks can be checked against what a recompute would write."""
        reqs = {r.req_id: r for r in so.scheduled_new_reqs}
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            start = req.num_computed_tokens - n  # schedule() already advanced it
            per_group = self.scheduler.kv_cache_manager.get_block_ids(rid)
            self.block_ids[rid] = list(per_group[0])
            self.group_block_ids[rid] = [list(b) for b in per_group]
            toks = req.all_token_ids
            for blocks, layers in zip(per_group, self.group_layers):
                for pos in range(start, start + n):
                    b, o = blocks[pos // BLOCK], pos % BLOCK
                    for li in layers:
                        self.kv[self.layer_names[li]][b, :, o] = kv_value(toks[pos], pos, li)
        return reqs

    def step(self):
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        self.preempted |= set(getattr(so, "preempted_req_ids", None) or ())
        meta = so.kv_connector_metadata
        w = self.worker
        w.bind_connector_metadata(meta)
        w.handle_preemptions(meta)
        w.start_load_kv(None)
        self.fill_computed(so)
        w.wait_for_save()
        sending, recving = w.get_finished(so.finished_req_ids)
        worker_meta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        self.finished_sending |= sending or set()
        self.finished_recving |= recving or set()
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            done_prefill = req.num_computed_tokens >= req.num_prompt_tokens
            sampled.append([7] if done_prefill else [])
        out = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled,
                                kv_connector_output=KVConnectorOutput(
                                    finished_sending=sending, finished_recving=recving,
                                    kv_connector_worker_meta=worker_meta))
        eco = self.scheduler.update_from_output(so, out)
        for v in (eco or {}).values():  # what vLLM's stats path received this step
            st = getattr(v, "scheduler_stats", None)
            if st is not None and st.kv_connector_stats:
                self.stats.append(st.kv_connector_stats)
        self.steps += 1
        return so, eco

    def run_until_idle(self, max_steps=200):
        outs = []
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and not self.scheduler.has_unfinished_requests():
                break
            outs.append(self.step())
        return outs


def kv_value(token: int, pos: int, layer: int) -> float:
    """What `fill_computed` writes for a token: loads must bring back exactly this."""
    return float(token * 1000 + pos * 10 + layer + 1)


def stat_total(stats: list, name: str) -> float:
    """Sum of a counter over the per-step kv_connector_stats dicts vLLM reported."""
    return sum(sum(d.get("data", {}).get(name, {}).values()) for d in stats)


def stat_last(stats: list, name: str):
    """The last value vLLM's stats path received for a gauge (None if never set)."""
    vals = [v for d in stats for v in d.get("data", {}).get(name, {}).values()]
    return vals[-1] if vals else None



def random_canonical_caches(block_outer: bool, nb: int = 64, page: int = 4096, layers: int = 4, seed: int = 0):
    """vLLM CanonicalKVCaches over random non-zero int8 CUDA tensors: block-outer (one tensor, a
    block = every layer's page) or per-layer (one tensor per layer). Returns (tensors, caches)."""
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    g = torch.Generator(device="cuda").manual_seed(seed)
    if block_outer:
        buf = torch.randint(1, 127, (nb, layers * page), dtype=torch.int8, device="cuda", generator=g)
        tensors = [CanonicalKVCacheTensor(buf, layers * page)]
    else:
        bufs = [torch.randint(1, 127, (nb, page), dtype=torch.int8, device="cuda", generator=g) for _ in range(layers)]
        tensors = [CanonicalKVCacheTensor(t, page) for t in bufs]
    caches = CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(i, t.page_size_bytes) for i, t in enumerate(tensors)]])
    return tensors, caches

def gpu_spec(block_ids):
    """vLLM's GPULoadStoreSpec for one KV-cache group."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    return GPULoadStoreSpec(list(block_ids), group_sizes=[len(block_ids)], block_indices=[0])
