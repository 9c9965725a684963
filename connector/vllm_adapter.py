"""Drop-in for vLLM's OffloadingConnector, for vLLM 0.26.0 <= version < 0.34.

Importing this module outside that range raises ImportError (naming the range and the
version found). What differs between the supported releases lives in
`connector.vllm_compat`; this file is written once against it.

Two routes (the README has the full `vllm serve` / `python -m vllm.entrypoints.openai.api_server` lines):

  1. vLLM's connector, our spec:
     {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KVOffloadSpec",
          "spec_module_path": "connector.vllm_adapter", "cpu_bytes_to_use": 68719476736}}
  2. our connector class: the same spec, plus the block-outer KV layout (each block one
     contiguous range, moved as one DMA; 0.32+: layout "BLHNC", 0.26: vLLM's cross-layer
     blocks; vLLM's CPU platform knows only LBHNC, warns, and uses that):
     {"kv_connector": "KVOffloadConnector",
      "kv_connector_module_path": "connector.vllm_adapter", "kv_role": "kv_both",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 68719476736}}

Scheduler side: `KVOffloadManager` (kvoffload's BlockManager behind vLLM's
OffloadingManager API). Worker side: `KVOffloadWorker` (our KVBlockMover and
TransferWorker behind vLLM's OffloadingWorker API; on CPU tensors it copies
synchronously, which is how the CPU tests and the CPU engine run it).

Hybrid models (several KV-cache groups: sliding window, Mamba): supported (both
connector classes declare vLLM's `SupportsHMA`). A host slot holds one GPU block id's
row of every KV tensor the spec was given. vLLM hands a block id to one group at a time
and lays groups over the same tensors (kv_cache_interface.KVCacheTensor), so that row is
exactly the group's block; keys carry the group index, and the scheduler orders CPU
slots and GPU block ids alike (group-major), which the worker pairs one to one.
(tests/test_vllm_conformance.py checks full attention + sliding window on 0.26/0.32/0.33;
Mamba groups rest on the same argument, untested here.)

Stats (vLLM's stats path: the log line and Prometheus `/metrics`; docs/vllm.md has what each
counts on every failure path): the manager's `METRICS` and the worker's `WORKER_METRICS`
(failed stores, failed loads, checksum mismatches; KVOffloadConnector only: vLLM's own
connector never asks its worker for stats). vLLM itself adds
vllm:kv_offload_{load,store}_{bytes,time,size} from the worker's TransferResults (bytes =
blocks x unified block bytes; successful jobs only). vLLM's OffloadingConnector asserts that
every transfer succeeded (0.26-0.33), so the worker reports a failed store (and, under the
recompute policy, a failed load) as finished with no bytes: the manager's stored/loaded
counters count such jobs too, and the worker counters say how many failed.

Failed stores (both routes, any policy; KVOffloadWorker): reported finished with no bytes,
their host slots marked bad on that rank; a load that would read a bad slot is failed before
launch, so a failed store costs at most a failed load later, never a wrong token.
KVOffloadConnector also sends the failed jobs' slots to its scheduler side
(KVOffloadWorkerMetadata), which drops their keys as vLLM completes the job: no lookup hits them.

Failed loads (KVOffloadConnector only): with `kv_load_failure_policy="recompute"` in
KVTransferConfig, the worker never hands vLLM a failed load. It reports the job finished
(success, no bytes/time, so no stats are counted) and keeps the job's GPU block ids, which
`KVOffloadConnector.get_block_ids_with_load_errors()` returns in the SAME step output as the
job's finished_recving (vLLM's model runner calls it right after get_finished). vLLM's
scheduler handles invalid_block_ids before finished_recving (update_from_output, 0.26-0.33):
the request, still WAITING_FOR_REMOTE_KVS, has its computed tokens cut at the first failed
block and recomputes from there. One KV-cache group only: vLLM cannot map block ids of
several groups (0.32+ raise RuntimeError), so with several groups a failed load stops the
engine. The scheduler side drops the host copies that load read (KVOffloadConnector.
update_connector_output maps the invalid GPU block ids, the union over ranks, to the job's host
slots; KVOffloadManager.invalidate_slots), so the recomputed blocks are stored anew; keeping
them made the rescheduled request hit and fail the same bad slots forever.
Under the default policy "fail" a failed load is reported failed, and vLLM stops the engine.
Route 1 (vLLM's OffloadingConnector + KVOffloadSpec) never asks for failed blocks: a failed
load there always stops the engine (a failed store only when a load reads its slots).
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Collection, Iterable, Optional

import numpy as np
import torch

from . import vllm_compat as compat  # raises ImportError outside the supported range
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402
from vllm.v1.kv_offload.base import (CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec,  # noqa: E402
                                     LookupResult, OffloadingCounterMetadata, OffloadingEvent,
                                     OffloadingGaugeMetadata, OffloadingManager, OffloadingSpec,
                                     OffloadingWorker, PrepareStoreOutput, RequestOffloadingContext,
                                     TransferResult)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402

from layout.fragments import FragmentTable  # noqa: E402
from layout.pack import KVBlockMover  # noqa: E402

from .block_manager import BlockManager  # noqa: E402

if TYPE_CHECKING:  # vLLM's types in our signatures (the same modules in 0.26-0.33)
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorMetadata, KVConnectorRole,
                                                                   KVConnectorWorkerMetadata)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.kv_offload.base import OffloadingMetricMetadata, OffloadKey, ReqContext
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.outputs import KVConnectorOutput

logger = logging.getLogger(__name__)

VLLM_VERSION = ".".join(map(str, compat.VERSION))

# Our counters and gauges in vLLM's offloading stats. Each is counted where its event happens.
M_STORED = "kvoffload:cpu_stored_blocks"
M_LOADED = "kvoffload:cpu_loaded_blocks"
M_EVICTED = "kvoffload:cpu_evicted_blocks"
M_USED = "kvoffload:cpu_pool_used_blocks"
M_USAGE = "kvoffload:cpu_pool_usage"
METRICS = {  # name -> (kind, documentation)
    M_STORED: ("counter", "Blocks of store jobs vLLM reported done on every worker (complete_store), "
                          "failed ones included (vLLM allows no failed store; see "
                          "kvoffload:failed_store_blocks)."),
    M_LOADED: ("counter", "Blocks of load jobs vLLM reported done on every worker (complete_load), loads "
                          "failed and recomputed included (see kvoffload:failed_load_blocks)."),
    M_EVICTED: ("counter", "Ready blocks dropped from the host pool to make room for a store (prepare_store)."),
    M_USED: ("gauge", "Host pool slots in use: ready blocks plus stores in flight."),
    M_USAGE: ("gauge", "Fraction of host pool slots in use (cpu_pool_used_blocks / slots)."),
}
INFO_KEYS = ("kvoffload_slots", "kvoffload_slot_bytes", "kvoffload_eviction_policy")

# kv_connector_extra_config keys: vLLM's own (per release, vllm_compat), then ours
OUR_KEYS = {"cpu_bytes_to_use", "eviction_policy", "store_threshold", "method", "kv_cache_layout", "native_submit",
            "integrity"}


class KVOffloadConfigError(ValueError):
    """A configuration this adapter cannot run; raised at start-up."""


class KVOffloadManager(OffloadingManager):
    """vLLM's scheduler-side manager API over kvoffload's BlockManager.

    Keys are vLLM's OffloadKeys (block hash + KV-cache group index); one key, one host slot."""

    def __init__(self, num_slots: int, policy: str = "lru", store_threshold: int = 0,
                 enable_events: bool = False, slot_bytes: int = 0):
        self.bm = BlockManager(num_slots, policy=policy, admit_after=store_threshold)
        self.enable_events = enable_events
        self.slot_bytes = slot_bytes
        self.policy_name = policy
        self._reported = {M_STORED: 0, M_LOADED: 0, M_EVICTED: 0}
        self._doomed: set = set()  # keys whose load failed, dropped once no load holds them
        self.invalidated_blocks = 0
        self.reset_busy_blocks = 0  # blocks in flight or pinned that reset_cache dropped (total)

    @property
    def lock(self) -> AbstractContextManager[None]:
        """vLLM 0.33 holds this across a step. Only the scheduler thread enters this
        manager (no background thread), so no lock is needed."""
        return nullcontext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._doomed and key in self._doomed:
            return LookupResult.MISS  # its load failed: recompute it (invalidate_slots)
        b = self.bm.blocks.get(key)
        if b is not None and not b.ready:
            return LookupResult.HIT_PENDING
        self.bm.lookup([key])  # counts a miss toward admission (store_threshold)
        return LookupResult.MISS if b is None else LookupResult.HIT

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return CPULoadStoreSpec(self.bm.prepare_load(list(keys)))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for k in keys:
            self.bm.policy.touch(k)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.bm.complete_load(list(keys))
        if self._doomed:
            for k in keys:
                if k in self._doomed:
                    self._drop(k)

    def invalidate_slots(self, slots: Iterable[int]) -> None:
        """Host slots whose load failed (KVOffloadConnector under the recompute policy): their
        keys are never handed out again (lookup: MISS, so vLLM recomputes and stores them anew
        instead of loading the same bad slot forever) and are dropped once no load holds them.
        Failure path only: one pass over the table."""
        want = {int(x) for x in slots}
        for k, b in list(self.bm.blocks.items()):
            if b.slot in want and b.ready:
                self._doomed.add(k)
                self._drop(k)

    def _drop(self, k) -> None:
        if k not in self.bm.blocks:
            self._doomed.discard(k)
        elif self.bm.discard(k):  # no load holds it (else: again at its complete_load)
            self._doomed.discard(k)
            self.invalidated_blocks += 1

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Optional[PrepareStoreOutput]:
        """Slots for the keys not stored yet, in the order given (vLLM pairs them with its
        GPU block ids in that order); None when there was no room for the first of them
        (vLLM counts an allocation failure and tries again later). Keys not yet admitted
        (store_threshold) are left out without failing."""
        rejected = self.bm.counters.store_rejected
        plan = self.bm.prepare_store(list(keys))
        if not plan.hashes and self.bm.counters.store_rejected != rejected:
            return None  # no room: every candidate is pinned
        return PrepareStoreOutput(keys_to_store=plan.hashes, store_spec=CPULoadStoreSpec(plan.slots),
                                  evicted_keys=plan.evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        pending = [k for k in keys if k in self.bm.blocks and not self.bm.blocks[k].ready]
        self.bm.complete_store(pending, success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        ev = self.bm.take_events()
        if not self.enable_events:
            return ()
        out = []
        for kind, removed in (("stored", False), ("evicted", True)):
            keys = [h for k, h in ev if k == kind]
            if keys:
                out.append(OffloadingEvent(keys=keys, medium=compat.MEDIUM_CPU, removed=removed))
        return out

    def get_stats(self) -> OffloadingConnectorStats:
        """`METRICS` since the last call (counters as increments), into vLLM's stats path."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        c = self.bm.counters
        st = OffloadingConnectorStats()
        for name, total in ((M_STORED, c.stored_blocks), (M_LOADED, c.loaded_blocks), (M_EVICTED, c.evictions)):
            if total != self._reported[name]:
                st.increase_counter(name, total - self._reported[name])
                self._reported[name] = total
        st.set_gauge(M_USED, self.bm.used)
        st.set_gauge(M_USAGE, self.bm.used / self.bm.capacity)
        return st

    def config_info(self) -> list[dict[str, object]]:
        """vLLM 0.33's vllm:kv_offload_config_info labels (KVOffloadSpec.config_info_keys)."""
        return [dict(zip(INFO_KEYS, (self.bm.capacity, self.slot_bytes, self.policy_name)))]

    def reset_cache(self) -> None:
        """Drops EVERY block, in flight or not, as vLLM's own CPU manager does (0.26-0.33).

        vLLM's scheduler (offloading/scheduler.py reset_cache) marks every job issued before
        the reset stale: their completions are skipped, so complete_store/complete_load never
        come for those keys. It also flushes them: its workers wait for those jobs before they
        submit any new one, so a freed slot is not written again while an old store or load
        still uses it. Keeping in-flight blocks (as this manager once did) pinned their slots
        and left their keys HIT_PENDING for ever: the pool shrank by every store in flight at a
        reset, and a later request with such a key would wait for a completion that never comes
        (docs/design/reset-inflight-leak.md). `reset_busy_blocks` counts what resets dropped in
        flight or pinned."""
        self.reset_busy_blocks += self.bm.reset()
        self._doomed.clear()


def _result(r) -> TransferResult:
    """connector.worker.JobResult (bytes, ms) -> vLLM's TransferResult (bytes, seconds)."""
    return TransferResult(r.job_id, r.ok, r.nbytes if r.ok else None, (r.ms or 0.0) / 1e3 if r.ok else None)


class KVOffloadWorker(OffloadingWorker):
    """vLLM's worker API over kvoffload: canonical KV tensors -> fragment table -> mover.

    A job moves whole unified blocks: GPU block id g <-> host row s, every canonical tensor's
    row g (its page_size_bytes) packed back to back into host[s] (uint8, unified_block_bytes).
    On CUDA, stores and loads go through a TransferWorker; 0.33's expedited loads (waited on
    within the step) through a second one with its own load stream, so they never queue
    behind regular loads, as vLLM's own CPU worker does.

    Failed loads: with recompute_failed_loads (KVOffloadConnector under kv_load_failure_policy=
    "recompute"), a failed or refused load job is reported finished with no bytes, and its GPU
    block ids wait in `take_load_errors()` (module doc); otherwise it is reported failed.

    Failed stores (both routes, any policy): vLLM asserts that every store succeeded, so a store
    job that failed (or was refused at submit) is reported finished with no bytes, and its host
    slots are marked BAD on this rank (`bad_slots`, bool [slots]). A later load that reads a bad
    slot is failed before anything is launched (`refused_loads` counts them): under
    recompute_failed_loads the request recomputes, otherwise vLLM stops the engine; it never
    reads the half-written bytes. A later successful store into a slot clears its mark. The
    check costs one numpy gather per load job, and only while some slot is bad.
    Tensor parallelism: each rank keeps its own marks. Sharded KV: each rank reads only its own
    cells, so its own marks cover them. Replicated KV (MLA, rank 0 the only writer): ranks > 0
    cannot see rank 0's marks, but rank 0 runs the same load job, fails it, and vLLM takes the
    union of every rank's failed block ids, so all ranks recompute those blocks (or the engine
    stops), before any forward reads them.
    With report_failed_stores (KVOffloadConnector) each failed store job's slots also wait in
    `take_failed_stores()`; the connector sends them to its scheduler side, which drops the keys
    as the job completes (KVOffloadConnector.update_connector_output), so on that route the
    manager never hands out a failed store's slot and the load check is a second line only.

    Counters (`WORKER_METRICS`, handed to vLLM by `take_stats()`): failed_store_blocks (slots
    marked bad), failed_load_blocks (GPU blocks of loads reported failed under
    recompute_failed_loads), the integrity wrapper's failed_blocks.

    `fail_next_loads` / `fail_next_stores` (TEST-ONLY, default 0): the next N load (store) jobs
    write random bytes into their GPU blocks (host slots), a half-written copy, and fail.
    tests/test_vllm_load_failure.py and tests/test_vllm_store_failure.py set them through
    vLLM's collective_rpc."""

    fail_next_loads = 0
    fail_next_stores = 0

    def __init__(self, kv_caches: CanonicalKVCaches, host: torch.Tensor, method: str = "auto",
                 native_submit: bool = True, expedited_loads: bool = False, integrity: bool = False,
                 recompute_failed_loads: bool = False, report_failed_stores: bool = False):
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
        self.recompute_failed_loads = recompute_failed_loads
        self._loads: dict[int, np.ndarray] = {}  # recompute: load job id -> GPU block ids, until reported
        self._load_errors: set[int] = set()  # GPU block ids of failed loads, until taken
        self._stores: dict[int, np.ndarray] = {}  # store job id -> host slot ids, until reported
        self._failed_stores: dict[int, list] = {}  # failed store job id -> its host slots, until taken
        self.report_failed_stores = report_failed_stores  # someone takes them (KVOffloadConnector)
        self.bad_slots = np.zeros(int(host.shape[0]), dtype=bool)  # failed stores' slots (class doc)
        self._n_bad = 0
        self.failed_store_blocks = 0  # slots marked bad so far (WORKER_METRICS)
        self.failed_load_blocks = 0  # GPU blocks of load jobs reported failed under recompute (WORKER_METRICS)
        self.refused_loads = 0  # load jobs failed before launch because they read a bad slot
        self._taken = dict.fromkeys(WORKER_METRICS, 0)  # totals handed to vLLM's stats path (take_stats)
        self.checked = None  # the CheckedTransferWorker in integrity mode (its `integrity` counters)
        self.tw = self.tw_expedited = None
        if self.cuda:
            from .worker import TransferWorker

            self.tw = TransferWorker(self.mover, host, method=method, native_submit=native_submit)
            if integrity:  # per-block checksums at store, checked at load (connector/integrity.py);
                # expedited loads then take the same worker, so one table holds every slot's sum
                from .integrity import CheckedTransferWorker

                self.tw = self.checked = CheckedTransferWorker(self.tw, self.mover)
            elif expedited_loads:  # its own mover too: no copier state shared between two workers
                self.tw_expedited = TransferWorker(KVBlockMover.from_table(table), host, method=method,
                                                   native_submit=native_submit)

    def _workers(self):
        return [w for w in (self.tw, self.tw_expedited) if w is not None]

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, True, src_spec.block_ids, dst_spec.block_ids)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        """expedited (vLLM 0.33, sync_load_budget_bytes > 0): vLLM waits for this job within the
        step (wait() right after submitting), so it takes the expedited worker's own stream."""
        return self._submit(job_id, False, dst_spec.block_ids, src_spec.block_ids, expedited)

    def _submit(self, job_id, store, gpu_ids, cpu_ids, expedited=False) -> bool:
        gpu_ids = np.asarray(gpu_ids, np.int64)  # int32 from vLLM 0.32 on; int64 is the fast path's
        cpu_ids = np.asarray(cpu_ids, np.int64)
        if store:
            self._stores[job_id] = cpu_ids
            if self.fail_next_stores > 0:  # test-only fault injection (class doc)
                self.fail_next_stores -= 1
                junk = torch.randint(0, 256, (len(cpu_ids), self.host.shape[1]), dtype=torch.uint8)
                self.host[torch.from_numpy(cpu_ids)] = junk
                self._finished.append(TransferResult(job_id, False, None, None))
                return True
        else:
            if self.recompute_failed_loads:
                self._loads[job_id] = gpu_ids
            # a failed store's slot: never read it (clip: a bad id is the TransferWorker's to refuse)
            if self._n_bad and self.bad_slots.take(cpu_ids, mode="clip").any():
                self.refused_loads += 1
                logger.warning("kvoffload: load job %d reads host slot(s) whose store failed; failed before "
                               "launch", job_id)
                self._finished.append(TransferResult(job_id, False, None, None))
                return True
            if self.fail_next_loads > 0:  # test-only fault injection (class doc)
                self.fail_next_loads -= 1
                junk = torch.randint(0, 256, (len(gpu_ids), self.mover.unified_block_bytes), dtype=torch.uint8)
                self.mover.unpack(junk, np.arange(len(gpu_ids)), gpu_ids, method="torch")
                self._finished.append(TransferResult(job_id, False, None, None))
                return True
        if self.cuda:
            if store:  # refused (False): the worker reports it failed at its next get_finished,
                self.tw.submit_store(job_id, gpu_ids, cpu_ids)  # and _reported marks its slots bad
                return True
            # No fence: vLLM keeps a loading request out of the batch until get_finished()
            # reports its job (or, expedited, wait() returned), and a job is reported only
            # after its end event completed, so the blocks have landed before attention reads them.
            ok = (self.tw_expedited or self.tw).submit_load(job_id, cpu_ids, gpu_ids) if expedited \
                else self.tw.submit_load(job_id, cpu_ids, gpu_ids)
            # refused (False): the worker reports the job failed at its next get_finished (once;
            # nothing else may report it), which under recompute becomes a recompute
            return ok or self.recompute_failed_loads
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
        return ok or store or self.recompute_failed_loads

    def get_finished(self) -> list:
        out, self._finished = self._finished, []
        out += [_result(r) for w in self._workers() for r in w.get_finished()]
        return [self._reported(r) for r in out] if (self._loads or self._stores) else out

    def _reported(self, r):
        """A failed store: its host slots are marked bad and it is reported finished with no
        bytes (class doc). A failed load under recompute_failed_loads: its GPU block ids go to
        take_load_errors() and it is reported finished with no bytes. vLLM reads both in one
        step (module doc)."""
        slots = self._stores.pop(r.job_id, None)
        if slots is not None:
            if r.success:
                if self._n_bad:  # a slot written completely is readable again
                    self.bad_slots[slots] = False
                    self._n_bad = int(self.bad_slots.sum())
                return r
            if self.report_failed_stores:
                self._failed_stores[r.job_id] = slots.tolist()
            slots = slots[(slots >= 0) & (slots < len(self.bad_slots))]  # a job refused for bad ids
            self.bad_slots[slots] = True
            self._n_bad = int(self.bad_slots.sum())
            self.failed_store_blocks += len(slots)
            logger.warning("kvoffload: store job %d failed; its %d host slot(s) are not loaded until stored again",
                           r.job_id, len(slots))
            return TransferResult(r.job_id, True, None, None)
        gpu_ids = self._loads.pop(r.job_id, None)
        if r.success or gpu_ids is None:
            return r
        self._load_errors.update(gpu_ids.tolist())
        self.failed_load_blocks += len(gpu_ids)
        logger.warning("kvoffload: load job %d failed; its %d block(s) will be recomputed", r.job_id, len(gpu_ids))
        return TransferResult(r.job_id, True, None, None)

    def take_stats(self) -> Optional[OffloadingConnectorStats]:
        """`WORKER_METRICS` since the last call (counter increments) as vLLM's OffloadingConnectorStats,
        or None when none moved (so an idle step sends nothing). KVOffloadConnector's worker side
        hands it to vLLM (get_kv_connector_stats), which sums it over ranks."""
        totals = {M_FAILED_STORE: self.failed_store_blocks, M_FAILED_LOAD: self.failed_load_blocks,
                  M_CHECKSUM_FAILED: self.checked.integrity["failed_blocks"] if self.checked is not None else 0}
        moved = {k: v - self._taken[k] for k, v in totals.items() if v != self._taken[k]}
        if not moved:
            return None
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        st = OffloadingConnectorStats()
        for k, d in moved.items():
            st.increase_counter(k, d)
        self._taken.update(totals)
        return st

    def take_failed_stores(self) -> dict[int, list]:
        """{store job id: its host slots} of the failed stores reported so far; cleared by the call.
        KVOffloadConnector sends them to its scheduler side (KVOffloadWorkerMetadata)."""
        out, self._failed_stores = self._failed_stores, {}
        return out

    def take_load_errors(self) -> set[int]:
        """GPU block ids of the failed loads reported so far; cleared by the call."""
        out, self._load_errors = self._load_errors, set()
        return out

    def wait(self, job_ids: set) -> None:
        for w in self._workers():  # each ignores the ids it does not hold
            w.wait(job_ids)

    pool = None  # the spec's HostPool when it is shared between TP ranks (unlinked at shutdown)

    def shutdown(self) -> None:
        for w in self._workers():
            self._finished += [_result(r) for r in w.shutdown(drain=True)]
        if self.pool is not None and self.pool.shared_path:
            # every rank mapped it at start-up: the name can go now (mappings stay valid); each
            # rank tries, the first one wins. A killed engine leaves the file behind (docs/vllm.md)
            try:
                os.unlink(self.pool.shared_path)
            except OSError:
                pass


# Worker-side counters (KVOffloadWorker counts them on each rank; only KVOffloadConnector's worker
# side hands them to vLLM, which sums them over ranks; vLLM's OffloadingConnector never asks a
# worker for stats, so on route 1 they stay at 0). docs/vllm.md has what every metric counts.
M_FAILED_STORE = "kvoffload:failed_store_blocks"
M_FAILED_LOAD = "kvoffload:failed_load_blocks"
M_CHECKSUM_FAILED = "kvoffload:checksum_failed_blocks"
WORKER_METRICS = {  # name -> (kind, documentation), as METRICS
    M_FAILED_STORE: ("counter", "Host slots a store job failed to write (copy error, or refused at submit), "
                                "summed over ranks. Their store was reported done to vLLM (it allows no failed "
                                "store), so they are in cpu_stored_blocks too; never loaded until stored again."),
    M_FAILED_LOAD: ("counter", "GPU blocks of load jobs that failed and were recomputed instead "
                               "(kv_load_failure_policy=recompute): copy error, checksum mismatch, or refused "
                               "before launch for reading a failed store's slot; summed over ranks. Also in "
                               "cpu_loaded_blocks (vLLM saw the job finish)."),
    M_CHECKSUM_FAILED: ("counter", "Loaded blocks whose checksum differed from the one taken at store "
                                   "(integrity mode; their load job failed)."),
}


class KVOffloadSpec(OffloadingSpec):
    """kvoffload behind vLLM's OffloadingSpec (spec_name="KVOffloadSpec",
    spec_module_path="connector.vllm_adapter").

    extra_config: cpu_bytes_to_use (required, bytes of host memory for all ranks together),
    eviction_policy ("lru" | "arc"), store_threshold (admit a block after this many lookups),
    method (kvoffload copy method, default "auto"), kv_cache_layout (KVOffloadConnector only;
    default vllm_compat.DEFAULT_LAYOUT), native_submit (bool, default true: DMA jobs of whole
    blocks, and per-layer pack jobs, are issued by a C++ thread; false: by vLLM's worker
    thread), integrity (bool, default false: a checksum per block taken on the GPU at store and
    checked at load, connector/integrity.py; a mismatch fails the load job: with
    KVOffloadConnector and kv_load_failure_policy="recompute" the request recomputes, otherwise
    vLLM stops the engine rather than return a wrong token), plus vLLM's own offloading keys
    (vllm_compat.VLLM_EXTRA_KEYS; 0.33's sync_load_budget_bytes > 0 makes the worker build its
    expedited-load stream).
    Unknown keys, canonical_layout=true and blocks_per_chunk != 1 are errors.
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        meta = {"counter": OffloadingCounterMetadata, "gauge": OffloadingGaugeMetadata}
        return {name: meta[kind](documentation=doc) for name, (kind, doc) in {**METRICS, **WORKER_METRICS}.items()}

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return INFO_KEYS

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        x = self.extra_config
        unknown = set(x) - compat.VLLM_EXTRA_KEYS - OUR_KEYS
        if unknown:
            raise KVOffloadConfigError(f"unknown kv_connector_extra_config keys {sorted(unknown)} for vLLM "
                                       f"{VLLM_VERSION}; known: {sorted(compat.VLLM_EXTRA_KEYS | OUR_KEYS)}")
        if "cpu_bytes_to_use" not in x:
            raise KVOffloadConfigError("kv_connector_extra_config needs cpu_bytes_to_use (bytes of host memory)")
        if self.blocks_per_chunk != 1:
            raise KVOffloadConfigError(f"blocks_per_chunk={self.blocks_per_chunk}: kvoffload stores one GPU "
                                       "block per host slot; drop block_size/blocks_per_chunk from the config")
        if x.get("canonical_layout"):
            raise KVOffloadConfigError("canonical_layout=true asks for vLLM's own CPU tier's host format; "
                                       "KVOffloadSpec stores each worker's blocks as they are: drop it, or use "
                                       "vLLM's CPUOffloadingSpec")
        for name, layout in (("vLLM kv_cache_layout", compat.config_field(config, "kv_cache_layout")),
                             ("kv_cache_layout", x.get("kv_cache_layout"))):
            if layout is not None and layout not in compat.LAYOUTS:
                raise KVOffloadConfigError(f"{name} {layout!r} is not supported with vLLM {VLLM_VERSION}; "
                                           f"supported: {sorted(compat.LAYOUTS)}")
        self.policy = x.get("eviction_policy", "lru")
        if self.policy not in ("lru", "arc"):
            raise KVOffloadConfigError(f"eviction_policy must be 'lru' or 'arc', got {self.policy!r}")
        self.method = x.get("method", "auto")
        self.native_submit = x.get("native_submit", True)
        if not isinstance(self.native_submit, bool):
            raise KVOffloadConfigError(f"native_submit must be true or false, got {self.native_submit!r}")
        self.expedited_loads = compat.EXPEDITED_LOADS and int(x.get("sync_load_budget_bytes", 0) or 0) > 0
        self.integrity = x.get("integrity", False)
        if not isinstance(self.integrity, bool):
            raise KVOffloadConfigError(f"integrity must be true or false, got {self.integrity!r}")
        world = max(1, config.parallel.world_size)
        self.world, self.rank = world, config.parallel.rank
        # replicated KV (pure-MLA, TP-only, vLLM 0.32+) is stored once for all ranks; telling
        # vLLM (replicated_layout) makes it submit stores from rank 0 only
        self.replicated = bool(compat.config_field(config, "replicated_layout", False)) and world > 1
        self.replicated_layout = self.replicated
        self.block_bytes = config.worker_kv_bytes_per_block  # one worker's share of a block
        cpu_bytes = int(x["cpu_bytes_to_use"])
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
        # set by KVOffloadConnector under kv_load_failure_policy="recompute" (module doc)
        self.recompute_failed_loads = False
        # set by KVOffloadConnector, which sends failed stores to its scheduler side
        self.report_failed_stores = False

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KVOffloadManager(max(1, self.num_chunks), self.policy,
                                             int(self.extra_config.get("store_threshold", 0)),
                                             self.kv_events_config.enable_kv_cache_events,
                                             slot_bytes=self.block_bytes)
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
            from .tp import is_writer

            # checksums live in this process: a rank that loads cells another rank stored
            # (replicated KV, ranks > 0) cannot check them
            checked = self.integrity and is_writer(self.rank, self.replicated)
            self._worker = KVOffloadWorker(kv_caches, host, self.method, self.native_submit, self.expedited_loads,
                                           integrity=checked, recompute_failed_loads=self.recompute_failed_loads,
                                           report_failed_stores=self.report_failed_stores)
            self._worker.pool = self.pool
        return self._worker


@dataclass
class KVOffloadWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker -> scheduler metadata (completed job ids, transfer stats), plus the store jobs
    that failed on some rank: {job id: host slots}, the union over ranks (aggregate). Every
    KVOffloadConnector worker returns this class, so vLLM's aggregation (the first rank's object
    .aggregate(the next)) keeps the field."""

    failed_stores: dict = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVOffloadWorkerMetadata:
        out = super().aggregate(other)  # vLLM's class: completed_jobs, transfer_stats
        failed = dict(self.failed_stores)
        for j, slots in getattr(other, "failed_stores", {}).items():
            failed[j] = sorted(set(failed.get(j, ())) | set(slots))
        return KVOffloadWorkerMetadata(completed_jobs=out.completed_jobs, transfer_stats=out.transfer_stats,
                                       failed_stores=failed)


class KVOffloadConnector(OffloadingConnector):
    """vLLM's OffloadingConnector with KVOffloadSpec and a block-outer KV layout.

    Inherits vLLM's `SupportsHMA` (hybrid models; see the module doc)."""

    SPEC = {"spec_name": "KVOffloadSpec", "spec_module_path": __name__}

    @classmethod
    def _select_spec(cls, vllm_config) -> None:
        """Puts our spec into kv_connector_extra_config. Every process that reads the config
        calls this: the engine core and workers (__init__) and the front end (build_prom_metrics),
        which builds vLLM's Prometheus metric table from the spec named there."""
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        for k, v in cls.SPEC.items():
            if extra.setdefault(k, v) != v:
                raise KVOffloadConfigError(f"KVOffloadConnector always uses {cls.SPEC}; got {k}={extra[k]!r}. "
                                           "For another spec use kv_connector='OffloadingConnector'")

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Optional[KVCacheConfig] = None) -> None:
        self._select_spec(vllm_config)
        super().__init__(vllm_config, role, kv_cache_config)
        policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "fail")
        groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        recompute = policy == "recompute" and groups == 1
        self._recompute = recompute and self.connector_scheduler is not None
        self._load_slots: dict[int, tuple] = {}  # scheduler: load job id -> (GPU ids, slots), until done
        self._failed_stores: dict[int, set] = {}  # scheduler: failed store job id -> its slots, until done
        if self.connector_worker is not None:  # the worker is built later, in register_kv_caches
            self.connector_worker.spec.recompute_failed_loads = recompute
            self.connector_worker.spec.report_failed_stores = True
        elif policy != "recompute":  # scheduler side: warn once at start-up
            logger.warning("KVOffloadConnector: kv_load_failure_policy=%r, so a failed KV load stops the "
                           "engine; set KVTransferConfig(kv_load_failure_policy='recompute') to recompute "
                           "the request instead", policy)
        elif not recompute:
            logger.warning("KVOffloadConnector: %d KV-cache groups; vLLM takes block-level load failures "
                           "for one group only, so a failed KV load stops the engine", groups)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Scheduler side: also remembers each load job's (GPU block ids, host slots) until the
        job completes, so that update_connector_output can map failed GPU blocks to slots."""
        meta = super().build_connector_meta(scheduler_output)
        if self._recompute:
            for job_id, job in meta.load_jobs.items():
                self._load_slots[job_id] = (np.asarray(job.dst_spec.block_ids, np.int64),
                                            np.asarray(job.src_spec.block_ids, np.int64))
        return meta

    def build_connector_worker_meta(self) -> Optional[OffloadingWorkerMetadata]:
        """Worker side: vLLM's metadata as KVOffloadWorkerMetadata, with the store jobs that failed
        on this rank since the last call (each is also in completed_jobs: reported done)."""
        meta = super().build_connector_worker_meta()
        w = self.connector_worker and self.connector_worker.worker
        failed = w.take_failed_stores() if isinstance(w, KVOffloadWorker) else {}
        if meta is None and not failed:
            return None
        meta = meta or OffloadingWorkerMetadata()
        return KVOffloadWorkerMetadata(completed_jobs=meta.completed_jobs, transfer_stats=meta.transfer_stats,
                                       failed_stores=failed)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler side: a load whose GPU blocks vLLM got back as invalid (the union over every
        rank) invalidates its host slots in the manager. Without this the request, rescheduled
        for recompute, hits the same keys again and loads the same bad slots, forever.
        A store job that failed on some rank (KVOffloadWorkerMetadata.failed_stores) invalidates
        its slots once vLLM completed it (on every rank; complete_store made its keys ready): its
        keys are never looked up as hits, so no load is ever refused for them (any policy)."""
        failed = getattr(connector_output.kv_connector_worker_meta, "failed_stores", None)
        for j, slots in (failed or {}).items():
            self._failed_stores.setdefault(j, set()).update(slots)
        if self._load_slots:
            bad = connector_output.invalid_block_ids
            if bad:
                bad = np.fromiter(bad, np.int64, len(bad))
                for gpu, slots in self._load_slots.values():
                    hit = np.isin(gpu, bad)
                    if hit.any():  # the worker failed the whole job: drop every slot it read
                        self.connector_scheduler.manager.invalidate_slots(slots)
        super().update_connector_output(connector_output)
        live = getattr(self.connector_scheduler, "_jobs", None)  # 0.26-0.33
        if self._failed_stores:
            for j in [j for j in self._failed_stores if live is None or j not in live]:
                self.connector_scheduler.manager.invalidate_slots(sorted(self._failed_stores.pop(j)))
        if self._load_slots:  # forget jobs vLLM no longer tracks (done on every rank)
            meta = connector_output.kv_connector_worker_meta
            done = [j for j in self._load_slots if j not in live] if live is not None else \
                [j for j in getattr(meta, "completed_jobs", ()) if j in self._load_slots]
            for j in done:
                del self._load_slots[j]

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        """Scheduler side: vLLM's (the manager's METRICS and vLLM's transfer counters). Worker
        side: our worker's WORKER_METRICS since the last call (vLLM's model runner asks every
        step, after get_finished; vLLM sums the ranks' and adds them to the scheduler's)."""
        if self.connector_scheduler is not None:
            return super().get_kv_connector_stats()
        w = self.connector_worker and self.connector_worker.worker
        return w.take_stats() if isinstance(w, KVOffloadWorker) else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU block ids whose load failed since the last call (recompute policy; module doc)."""
        w = self.connector_worker and self.connector_worker.worker
        return w.take_load_errors() if isinstance(w, KVOffloadWorker) else set()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, *args: Any, **kwargs: Any) -> KVConnectorPromMetrics:
        """Runs in the front-end process (API server, or LLM's own process next to a
        multi-process engine core), which never constructs the connector."""
        cls._select_spec(vllm_config)
        return super().build_prom_metrics(vllm_config, *args, **kwargs)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> Optional[str]:
        # Block-outer layouts make a block one contiguous byte range (one DMA). On vLLM 0.26
        # block-outer comes from prefer_cross_layer_blocks() (inherited: True) instead.
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        return extra.get("kv_cache_layout", compat.DEFAULT_LAYOUT)
