"""Drop-in for vLLM's OffloadingConnector (vLLM >= 0.32.0, < 0.34).

Two ways to enable it (see the README for the full `vllm serve` line):

  1. keep vLLM's connector, plug in our spec:
     {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KVOffloadSpec",
          "spec_module_path": "connector.vllm_adapter", "cpu_bytes_to_use": 68719476736}}
  2. our connector class (asks vLLM for the block-outer BLHNC layout, so each
     block is one contiguous range and moves as one DMA):
     {"kv_connector": "KVOffloadConnector",
      "kv_connector_module_path": "connector.vllm_adapter", "kv_role": "kv_both",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 68719476736}}

Scheduler side: `KVOffloadManager` (our BlockManager behind vLLM's
OffloadingManager API). Worker side: `KVOffloadWorker` (our KVBlockMover and
TransferWorker behind vLLM's OffloadingWorker API; on CPU tensors it copies
synchronously, which is how the conformance tests run it).
"""
from __future__ import annotations

import time
from typing import Collection, Iterable, Optional

import numpy as np
import torch

SUPPORTED = ((0, 32, 0), (0, 34, 0))  # [min, max)


def _check_vllm_version() -> str:
    try:
        import vllm
    except ImportError as e:  # pragma: no cover - exercised where vllm is absent
        raise ImportError("connector.vllm_adapter needs vLLM: pip install -e '.[vllm]' "
                          "(supported: vllm >= 0.32.0, < 0.34)") from e
    ver = vllm.__version__
    parts = tuple(int(x) for x in ver.split("+")[0].split(".")[:3] if x.isdigit())
    if not (SUPPORTED[0] <= parts < SUPPORTED[1]):
        raise ImportError(f"connector.vllm_adapter supports vLLM >= 0.32.0, < 0.34; found {ver}")
    return ver


VLLM_VERSION = _check_vllm_version()

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: E402
    OffloadingConnector)
from vllm.v1.kv_offload.base import (CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec,  # noqa: E402
                                     LookupResult, Medium, OffloadingEvent, OffloadingManager,
                                     OffloadingSpec, OffloadingWorker, PrepareStoreOutput,
                                     RequestOffloadingContext, TransferResult)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402

try:  # metric metadata types (0.32+)
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata  # noqa: E402
except ImportError:  # pragma: no cover
    OffloadingCounterMetadata = OffloadingGaugeMetadata = None

# counters and gauges our manager adds to vLLM's offloading stats (and Prometheus)
M_HITS = "kvoffload:cpu_hit_blocks"
M_MISSES = "kvoffload:cpu_miss_blocks"
M_EVICTIONS = "kvoffload:cpu_evicted_blocks"
M_USAGE = "kvoffload:cpu_pool_usage"

from layout.fragments import FragmentTable  # noqa: E402
from layout.pack import KVBlockMover  # noqa: E402

from .block_manager import BlockManager  # noqa: E402

# extra_config keys: vLLM's own, then ours
VLLM_KEYS = {"spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "canonical_layout",
             "offload_prompt_only", "self_describing_kv_events"}
OUR_KEYS = {"cpu_bytes_to_use", "eviction_policy", "store_threshold", "method", "kv_cache_layout", "native_submit"}
SUPPORTED_LAYOUTS = {None, "BLHNC", "BLNHC", "BHLNC", "LBHNC", "LBNHC", "LHBNC", "NHD", "HND"}


class KVOffloadConfigError(ValueError):
    """A configuration this adapter cannot run; raised at start-up."""


class KVOffloadManager(OffloadingManager):
    """vLLM's scheduler-side manager API over kvoffload's BlockManager."""

    def __init__(self, num_chunks: int, policy: str = "lru", store_threshold: int = 0,
                 enable_events: bool = False):
        self.bm = BlockManager(num_chunks, policy=policy, admit_after=store_threshold)
        self.enable_events = enable_events

    def lookup(self, key, req_context) -> LookupResult:
        b = self.bm.blocks.get(key)
        if b is None:
            self.bm.lookup([key])  # counts the miss (and admission)
            return LookupResult.MISS
        if not b.ready:
            return LookupResult.HIT_PENDING
        self.bm.lookup([key])
        return LookupResult.HIT

    def prepare_load(self, keys: Collection, req_context) -> LoadStoreSpec:
        return CPULoadStoreSpec(self.bm.prepare_load(list(keys)))

    def touch(self, keys: Collection, req_context) -> None:
        for k in keys:
            self.bm.policy.touch(k)

    def complete_load(self, keys: Collection, req_context) -> None:
        self.bm.complete_load(list(keys))

    def prepare_store(self, keys: Collection, req_context) -> Optional[PrepareStoreOutput]:
        keys = list(keys)
        plan = self.bm.prepare_store(keys)
        new = set(plan.hashes)
        wanted = [k for k in keys if k not in self.bm.blocks or k in new]
        if wanted and not plan.hashes:
            return None  # no room: every candidate is pinned
        return PrepareStoreOutput(keys_to_store=plan.hashes, store_spec=CPULoadStoreSpec(plan.slots),
                                  evicted_keys=plan.evicted)

    def complete_store(self, keys: Collection, req_context, success: bool = True) -> None:
        pending = [k for k in keys if k in self.bm.blocks and not self.bm.blocks[k].ready]
        self.bm.complete_store(pending, success)

    def on_new_request(self, req_context) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        ev = self.bm.take_events()
        if not self.enable_events:
            return ()
        stored = [h for kind, h in ev if kind == "stored"]
        evicted = [h for kind, h in ev if kind == "evicted"]
        out = []
        if stored:
            out.append(OffloadingEvent(keys=stored, medium=Medium.CPU, removed=False))
        if evicted:
            out.append(OffloadingEvent(keys=evicted, medium=Medium.CPU, removed=True))
        return out

    def get_stats(self):
        """Hits, misses and evictions since the last call, and pool usage, into vLLM's stats path."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        c = self.bm.counters
        now = (c.hit_blocks, c.miss_blocks, c.evictions)
        last = getattr(self, "_last", (0, 0, 0))
        self._last = now
        st = OffloadingConnectorStats()
        for name, a, b in zip((M_HITS, M_MISSES, M_EVICTIONS), now, last):
            if a - b:
                st.increase_counter(name, a - b)
        st.set_gauge(M_USAGE, self.bm.used / self.bm.capacity)
        return st

    def reset_cache(self) -> None:
        for k in [k for k, b in self.bm.blocks.items() if b.ready and not b.refs]:
            b = self.bm.blocks.pop(k)
            self.bm.policy.remove(k)
            self.bm.free.append(b.slot)


class KVOffloadWorker(OffloadingWorker):
    """vLLM's worker API over kvoffload: canonical KV tensors -> fragment table -> mover."""

    def __init__(self, kv_caches: CanonicalKVCaches, host: torch.Tensor, method: str = "auto",
                 native_submit: bool = True):
        tensors = [t.tensor for t in kv_caches.tensors]
        if not tensors:
            raise KVOffloadConfigError("no KV cache tensors to offload")
        nb = {int(t.shape[0]) for t in tensors}
        if len(nb) != 1:
            raise KVOffloadConfigError(f"KV tensors disagree on num_blocks: {sorted(nb)}")
        es = [t.element_size() for t in tensors]
        ptr = np.array([t.data_ptr() for t in tensors], np.int64)
        stride = np.array([t.stride(0) * e for t, e in zip(tensors, es)], np.int64)
        nbytes = np.array([c.page_size_bytes for c in kv_caches.tensors], np.int64)
        uoff = np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.int64)
        ub = int(nbytes.sum())
        if host.dim() != 2 or host.shape[1] != ub:  # (a rank's cells are a strided view)
            raise KVOffloadConfigError(f"host pool blocks are {tuple(host.shape)}, the KV cache needs "
                                       f"{ub} B per block")
        table = FragmentTable(ptr, stride, nbytes, uoff, ub, nb.pop(), tensors[0].device, tensors)
        self.mover = KVBlockMover.from_table(table)
        self.host = host
        self.cuda = self.mover.device.type == "cuda"
        self.method = method
        self._finished: list = []
        if self.cuda:
            from .worker import TransferWorker

            self.tw = TransferWorker(self.mover, host, method=method, native_submit=native_submit)

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, True, src_spec.block_ids, dst_spec.block_ids)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._submit(job_id, False, dst_spec.block_ids, src_spec.block_ids)

    def _submit(self, job_id, store, gpu_ids, cpu_ids) -> bool:
        gpu_ids = np.asarray(gpu_ids, np.int64)
        cpu_ids = np.asarray(cpu_ids, np.int64)
        if self.cuda:
            if store:
                return self.tw.submit_store(job_id, gpu_ids, cpu_ids)
            # No fence here: vLLM keeps a loading request out of the batch until
            # get_finished() reports its job, and a job is reported only after its
            # end event completed, so the blocks have landed before attention reads
            # them, while other requests keep computing (overlap).
            return self.tw.submit_load(job_id, cpu_ids, gpu_ids)
        t0 = time.perf_counter()
        try:  # CPU tensors stand in for GPU caches: synchronous reference path
            if store:
                self.mover.pack(gpu_ids, self.host, cpu_ids, method="torch")
            else:
                self.mover.unpack(self.host, cpu_ids, gpu_ids, method="torch")
            ok = True
        except Exception:
            ok = False
        self._finished.append(TransferResult(job_id, ok, len(gpu_ids) * self.mover.unified_block_bytes if ok else None,
                                             time.perf_counter() - t0 if ok else None))
        return ok

    def get_finished(self) -> list:
        if self.cuda:
            return [TransferResult(r.job_id, r.ok, r.nbytes if r.ok else None,
                                   (r.ms or 0.0) / 1e3 if r.ok else None) for r in self.tw.get_finished()]
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set) -> None:
        if self.cuda:
            self.tw.wait(job_ids)

    def shutdown(self) -> None:
        if self.cuda:
            self._finished += self.tw.shutdown(drain=True)


class KVOffloadSpec(OffloadingSpec):
    """kvoffload behind vLLM's OffloadingSpec (spec_name="KVOffloadSpec",
    spec_module_path="connector.vllm_adapter").

    extra_config: cpu_bytes_to_use (required), eviction_policy ("lru" | "arc"),
    store_threshold (admit after this many lookups), method (kvoffload method,
    default "auto"), kv_cache_layout (for KVOffloadConnector, default "BLHNC"),
    native_submit (bool, default true: DMA jobs of whole blocks, and per-layer pack jobs, are
    issued by a C++ thread; false: by vLLM's worker thread),
    plus vLLM's own offloading keys. Unknown keys are an error.
    """

    @classmethod
    def build_metric_definitions(cls, extra_config):
        if OffloadingCounterMetadata is None:  # pragma: no cover
            return {}
        return {M_HITS: OffloadingCounterMetadata(documentation="Blocks found ready in the kvoffload host pool."),
                M_MISSES: OffloadingCounterMetadata(documentation="Blocks looked up and not found in the host pool."),
                M_EVICTIONS: OffloadingCounterMetadata(documentation="Blocks evicted from the host pool."),
                M_USAGE: OffloadingGaugeMetadata(documentation="Fraction of host pool slots holding blocks.")}

    def __init__(self, config):
        super().__init__(config)
        unknown = set(self.extra_config) - VLLM_KEYS - OUR_KEYS
        if unknown:
            raise KVOffloadConfigError(f"unknown kv_connector_extra_config keys {sorted(unknown)}; "
                                       f"known: {sorted(VLLM_KEYS | OUR_KEYS)}")
        if "cpu_bytes_to_use" not in self.extra_config:
            raise KVOffloadConfigError("kv_connector_extra_config needs cpu_bytes_to_use (bytes of host memory)")
        if self.blocks_per_chunk != 1:
            raise KVOffloadConfigError(f"blocks_per_chunk={self.blocks_per_chunk}: kvoffload stores one GPU "
                                       "block per host slot; drop block_size/blocks_per_chunk from the config")
        layout = config.kv_cache_layout
        if layout not in SUPPORTED_LAYOUTS:
            raise KVOffloadConfigError(f"vLLM kv_cache_layout {layout!r} is not supported; "
                                       f"supported: {sorted(x for x in SUPPORTED_LAYOUTS if x)}")
        self.policy = self.extra_config.get("eviction_policy", "lru")
        if self.policy not in ("lru", "arc"):
            raise KVOffloadConfigError(f"eviction_policy must be 'lru' or 'arc', got {self.policy!r}")
        self.method = self.extra_config.get("method", "auto")
        self.native_submit = self.extra_config.get("native_submit", True)
        if not isinstance(self.native_submit, bool):
            raise KVOffloadConfigError(f"native_submit must be true or false, got {self.native_submit!r}")
        world = max(1, config.parallel.world_size)
        self.world, self.rank = world, config.parallel.rank
        # replicated KV (pure-MLA, TP-only) is stored once for all ranks
        self.replicated = bool(config.replicated_layout) and world > 1
        self.block_bytes = config.worker_kv_bytes_per_block  # one worker's share of a block
        cpu_bytes = int(self.extra_config["cpu_bytes_to_use"])
        per_block_all_ranks = self.block_bytes * (1 if self.replicated else world)
        if self.block_bytes <= 0:
            self.num_chunks = 0
        else:
            self.num_chunks = cpu_bytes // per_block_all_ranks
            if self.num_chunks < 1:
                raise KVOffloadConfigError(f"cpu_bytes_to_use={cpu_bytes} holds no block: one block needs "
                                           f"{per_block_all_ranks} B across {world} rank(s)")
        self._manager = None
        self._worker = None
        self.pool = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KVOffloadManager(max(1, self.num_chunks), self.policy,
                                             int(self.extra_config.get("store_threshold", 0)),
                                             self.kv_events_config.enable_kv_cache_events)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """One pool per engine: with several TP ranks, a shared mapping in which each
        rank owns one cell of every row (rank and world size from vLLM's config)."""
        if self._worker is None:
            from .host_pool import HostPool
            from .tp import rank_cells, row_bytes

            ub = sum(c.page_size_bytes for c in kv_caches.tensors)
            dev = kv_caches.tensors[0].tensor.device
            if self.world > 1:
                self.pool = HostPool(self.num_chunks, row_bytes(ub, self.world, self.replicated), dev,
                                     shared_name=f"{self.config.engine_id}-pool", pin=dev.type == "cuda",
                                     background=dev.type == "cuda")
                host = rank_cells(self.pool.tensor, self.rank, self.world, ub, self.replicated)
            elif dev.type == "cuda":
                self.pool = HostPool(self.num_chunks, ub, dev)
                host = self.pool.tensor
            else:
                host = torch.zeros(self.num_chunks, ub, dtype=torch.uint8)
            self._worker = KVOffloadWorker(kv_caches, host, self.method, self.native_submit)
        return self._worker


class KVOffloadConnector(OffloadingConnector):
    """vLLM's OffloadingConnector with KVOffloadSpec and a block-outer KV layout."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        extra.setdefault("spec_name", "KVOffloadSpec")
        extra.setdefault("spec_module_path", "connector.vllm_adapter")
        super().__init__(vllm_config, role, kv_cache_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> Optional[str]:
        # Block-outer layouts make a block one contiguous byte range (one DMA).
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        return extra.get("kv_cache_layout", "BLHNC")
