"""Failed stores in KVOffloadWorker (connector/vllm_adapter.py): reported finished (vLLM asserts
every transfer succeeded), their host slots marked bad on this rank, a later load that reads a
bad slot failed before anything is copied, a later good store clearing the mark.

On CPU tensors (the worker's synchronous reference path) and, for the CUDA branch's refusal
paths, a stand-in TransferWorker that behaves as the real one does on a refused submit (returns
False AND reports the job failed at its next get_finished).
How each test can fail: without the bad-slot check in _submit the poisoned GPU blocks receive the
junk (test_failed_store...); without the failed-store conversion in _reported get_finished hands
vLLM success=False (vLLM's `assert transfer_result.success`); with a second failed result appended
for a refused job, the job is reported twice (the second time failed)."""
from __future__ import annotations

import numpy as np
import pytest

vllm = pytest.importorskip("vllm", reason="vLLM not installed: pip install -e '.[vllm]'")
import torch  # noqa: E402
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor  # noqa: E402
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402

from connector.vllm_adapter import KVOffloadWorker  # noqa: E402
from connector.worker import JobResult  # noqa: E402
from tests.vllm_harness import gpu_spec  # noqa: E402

NB, SLOTS, PAGE, LAYERS = 16, 8, 256, 3


def _worker(recompute: bool):
    g = torch.Generator().manual_seed(0)
    bufs = [torch.randint(1, 127, (NB, PAGE), dtype=torch.int8, generator=g) for _ in range(LAYERS)]
    tensors = [CanonicalKVCacheTensor(t, PAGE) for t in bufs]
    caches = CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]])
    host = torch.zeros(SLOTS, LAYERS * PAGE, dtype=torch.uint8)
    return KVOffloadWorker(caches, host, recompute_failed_loads=recompute), bufs


def _done(w) -> dict:
    out = w.get_finished()
    ids = [r.job_id for r in out]
    assert len(ids) == len(set(ids)), f"a job reported twice: {out}"
    return {r.job_id: r for r in out}


@pytest.mark.vllm
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "fail-policy"])
def test_failed_store_is_finished_and_its_slots_are_never_loaded(recompute):
    w, bufs = _worker(recompute)
    want = [b[[4, 5]].clone() for b in bufs]
    w.fail_next_stores = 1
    assert w.submit_store(1, gpu_spec([0, 1]), CPULoadStoreSpec([2, 3]))  # fails: junk in slots 2, 3
    assert w.submit_store(2, gpu_spec([4, 5]), CPULoadStoreSpec([5, 6]))  # succeeds
    d = _done(w)
    assert d[1].success and d[1].transfer_size is None and d[1].transfer_time is None  # no stats counted
    assert d[2].success and d[2].transfer_size == 2 * LAYERS * PAGE
    assert w.fail_next_stores == 0 and w.failed_store_blocks == 2
    assert w.bad_slots.tolist() == [s in (2, 3) for s in range(SLOTS)]
    assert not (w.host[2:4] == 0).all(), "the hook did not write junk into the failed store's slots"

    for b in bufs:
        b[8:12] = -1  # poison the load destinations
    # a load reading one bad slot among good ones: failed before launch, nothing copied
    ok = w.submit_load(3, CPULoadStoreSpec([5, 3]), gpu_spec([8, 9]))
    assert ok  # vLLM asserts on False: the failure comes through get_finished
    d = _done(w)
    assert w.refused_loads == 1
    if recompute:
        assert d[3].success and d[3].transfer_size is None
        assert w.take_load_errors() == {8, 9}
    else:
        assert not d[3].success  # vLLM's "fail" policy: the engine stops, no wrong token
    for b in bufs:
        assert (b[8:10] == -1).all(), "a bad slot's bytes reached the GPU"
    # good slots still load, bit-exact
    assert w.submit_load(4, CPULoadStoreSpec([5, 6]), gpu_spec([10, 11]))
    assert _done(w)[4].success
    for b, ref in zip(bufs, want):
        assert torch.equal(b[10:12], ref)
    # a later good store into slot 3 clears its mark (slot 2 stays bad)
    assert w.submit_store(5, gpu_spec([4]), CPULoadStoreSpec([3]))
    assert _done(w)[5].success
    assert w.bad_slots.tolist() == [s == 2 for s in range(SLOTS)]
    assert w.submit_load(6, CPULoadStoreSpec([3]), gpu_spec([12]))
    assert _done(w)[6].transfer_size == LAYERS * PAGE
    for b, ref in zip(bufs, want):
        assert torch.equal(b[12], ref[0])
    assert w.refused_loads == 1 and not w.take_load_errors()


class _RefusingTW:
    """Stand-in for TransferWorker's refusal contract: submit_* returns False for a refused job and
    the job is reported failed (ok=False) at the next get_finished; accepted jobs succeed."""

    def __init__(self, refuse: set):
        self.refuse, self.done, self.submitted = refuse, [], []

    def _sub(self, kind, job_id, n):
        self.submitted.append(job_id)
        ok = job_id not in self.refuse
        self.done.append(JobResult(job_id, kind, ok, n * 8 if ok else 0, 0.1 if ok else None,
                                   None if ok else "refused"))
        return ok

    def submit_store(self, job_id, block_ids, slot_ids):
        return self._sub("store", job_id, len(block_ids))

    def submit_load(self, job_id, slot_ids, block_ids):
        return self._sub("load", job_id, len(block_ids))

    def get_finished(self):
        out, self.done = self.done, []
        return out

    def wait(self, job_ids):
        pass

    def shutdown(self, drain=True):
        return self.get_finished()


@pytest.mark.vllm
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "fail-policy"])
def test_store_refused_at_submit_marks_slots_bad(recompute):
    """The CUDA branch: a store the TransferWorker refuses (returns False) used to be handed to
    vLLM as False (`assert success`: engine stopped). Now: True, the job reported finished once,
    its slots bad; a load of them is failed without reaching the TransferWorker."""
    w, _ = _worker(recompute)
    w.cuda, w.tw = True, _RefusingTW(refuse={1, 3})
    assert w.submit_store(1, gpu_spec([0, 1]), CPULoadStoreSpec([2, 3]))
    assert w.submit_store(2, gpu_spec([4]), CPULoadStoreSpec([4]))
    d = _done(w)
    assert d[1].success and d[1].transfer_size is None and d[2].success
    assert w.bad_slots[[2, 3]].all() and w.bad_slots.sum() == 2
    # a load of a bad slot never reaches the TransferWorker
    assert w.submit_load(5, CPULoadStoreSpec([3]), gpu_spec([7]))
    assert 5 not in w.tw.submitted
    d = _done(w)
    assert d[5].success == recompute
    # a load the TransferWorker refuses: reported exactly once (recompute) / False to vLLM (fail)
    assert w.submit_load(3, CPULoadStoreSpec([4]), gpu_spec([6])) == recompute
    d = _done(w)
    assert set(d) == {3} and d[3].success == recompute
    if recompute:
        assert w.take_load_errors() == {6, 7}


@pytest.mark.vllm
def test_expedited_load_of_a_bad_slot_fails_before_launch():
    """vLLM 0.33's expedited loads take the same check (before either TransferWorker)."""
    w, _ = _worker(True)
    w.cuda, w.tw = True, _RefusingTW(refuse={1})
    w.tw_expedited = _RefusingTW(refuse=set())
    assert w.submit_store(1, gpu_spec([0]), CPULoadStoreSpec([2]))
    _done(w)
    assert w.submit_load(2, CPULoadStoreSpec([2]), gpu_spec([3]), expedited=True)
    w.wait({2})  # returns: the job never reached a TransferWorker
    assert not w.tw_expedited.submitted and _done(w)[2].success and w.take_load_errors() == {3}
    assert w.submit_load(3, CPULoadStoreSpec([5]), gpu_spec([4]), expedited=True)
    assert w.tw_expedited.submitted == [3]


@pytest.mark.vllm
def test_no_bad_slot_costs_no_check():
    """The load check is skipped while no slot is bad (one int test per load job)."""
    w, _ = _worker(False)
    w.bad_slots = None  # any index into it would raise
    assert w.submit_store(1, gpu_spec([0]), CPULoadStoreSpec([0]))
    assert w.submit_load(2, CPULoadStoreSpec([0]), gpu_spec([1]))
    assert all(r.success for r in w.get_finished())


@pytest.mark.vllm
def test_manager_invalidated_slots_are_missed_then_dropped():
    """Scheduler side (KVOffloadConnector under recompute): the slots of a load vLLM got back as
    invalid are never handed out again. Without this, the request rescheduled for recompute
    hits the same keys, loads the same bad slots and fails again, forever (seen in a real engine:
    an endless 'Recovered from KV load failure' loop). A key still held by its load is missed at
    once and dropped when the load completes; its slot is free for a new store."""
    from vllm.v1.kv_offload.base import LookupResult

    from connector.vllm_adapter import KVOffloadManager

    m = KVOffloadManager(4)
    plan = m.prepare_store(["a", "b", "c"], None)
    m.complete_store(["a", "b", "c"], None)
    slots = dict(zip(plan.keys_to_store, plan.store_spec.block_ids))
    m.prepare_load(["a", "b"], None)  # a load in flight holds a, b
    m.invalidate_slots([slots["a"], slots["b"]])
    assert [m.lookup(k, None) for k in "abc"] == [LookupResult.MISS, LookupResult.MISS, LookupResult.HIT]
    assert "a" in m.bm.blocks  # still held by its load: not freed under it
    m.complete_load(["a", "b"], None)
    assert "a" not in m.bm.blocks and "b" not in m.bm.blocks and m.invalidated_blocks == 2
    again = m.prepare_store(["a", "d"], None)  # recomputed blocks are stored anew
    assert set(again.keys_to_store) == {"a", "d"}
    assert slots["c"] not in set(np.asarray(again.store_spec.block_ids).tolist())  # c's slot is still c's
    m.complete_store(["a", "d"], None)
    assert m.lookup("a", None) == LookupResult.HIT and not m._doomed


@pytest.mark.vllm
def test_out_of_range_ids_in_a_failed_job_do_not_crash_the_bookkeeping():
    """A job refused for an out-of-range slot id is still just a failed store (no IndexError out
    of get_finished), and a load check with such an id leaves the refusal to the TransferWorker."""
    w, _ = _worker(True)
    w.cuda, w.tw = True, _RefusingTW(refuse={1})
    assert w.submit_store(1, gpu_spec([0, 1]), CPULoadStoreSpec([3, SLOTS + 5]))
    assert _done(w)[1].success and w.bad_slots.tolist() == [s == 3 for s in range(SLOTS)]
    assert w.submit_load(2, CPULoadStoreSpec([-1]), gpu_spec([2]))  # reaches the TransferWorker
    assert w.tw.submitted == [1, 2]


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.parametrize("integrity", [False, True], ids=["plain", "integrity"])
def test_gpu_failed_store_never_loaded(integrity):
    """KVOffloadWorker on CUDA (TransferWorker, optionally behind CheckedTransferWorker): a store
    failed by the hook (junk in its pinned host slots) is reported finished, its slots' load is
    failed before launch (the poisoned GPU blocks keep their poison), good slots load bit-exact,
    and a new store into a bad slot makes it loadable again."""
    from connector.host_pool import HostPool

    nb, page, layers = 32, 4096, 2
    g = torch.Generator(device="cuda").manual_seed(3)
    bufs = [torch.randint(1, 127, (nb, page), dtype=torch.int8, device="cuda", generator=g) for _ in range(layers)]
    tensors = [CanonicalKVCacheTensor(t, page) for t in bufs]
    caches = CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(i, page) for i in range(layers)]])
    pool = HostPool(16, layers * page, torch.device("cuda"))
    w = KVOffloadWorker(caches, pool.tensor, integrity=integrity, recompute_failed_loads=True)
    want = [t[[4, 5]].clone() for t in bufs]
    w.fail_next_stores = 1
    assert w.submit_store(1, gpu_spec([0, 1]), CPULoadStoreSpec([2, 3]))
    assert w.submit_store(2, gpu_spec([4, 5]), CPULoadStoreSpec([6, 7]))
    w.wait({1, 2})
    torch.cuda.synchronize()
    d = {r.job_id: r for r in w.get_finished()}
    assert set(d) == {1, 2} and d[1].success and d[1].transfer_size is None and d[2].success
    assert w.bad_slots[[2, 3]].all() and w.bad_slots.sum() == 2
    for t in bufs:
        t[8:12] = -1
    assert w.submit_load(3, CPULoadStoreSpec([3, 6]), gpu_spec([8, 9]))
    assert w.submit_load(4, CPULoadStoreSpec([6, 7]), gpu_spec([10, 11]))
    w.wait({3, 4})
    torch.cuda.synchronize()
    d = {r.job_id: r for r in w.get_finished()}
    assert d[3].success and d[3].transfer_size is None and w.take_load_errors() == {8, 9}
    assert d[4].success and d[4].transfer_size == 2 * layers * page
    from connector.vllm_adapter import M_FAILED_LOAD, M_FAILED_STORE

    assert _counters(w) == {M_FAILED_STORE: 2, M_FAILED_LOAD: 2}  # refused before launch: no checksum run
    for t, ref in zip(bufs, want):
        assert (t[8:10] == -1).all() and torch.equal(t[10:12], ref)
    assert w.submit_store(5, gpu_spec([4]), CPULoadStoreSpec([3]))
    w.wait({5})
    torch.cuda.synchronize()
    assert all(r.success for r in w.get_finished()) and w.bad_slots.sum() == 1
    assert w.submit_load(6, CPULoadStoreSpec([3]), gpu_spec([12]))
    w.wait({6})
    torch.cuda.synchronize()
    d = {r.job_id: r for r in w.get_finished()}
    assert d[6].success and d[6].transfer_size == layers * page
    for t, ref in zip(bufs, want):
        assert torch.equal(t[12], ref[0])
    w.shutdown()
    pool.close()


def _counters(w) -> dict:
    """What take_stats() hands vLLM's stats path (counter increments since the last call)."""
    st = w.take_stats()
    if st is None:
        return {}
    assert set(st.data["types"].values()) == {"counter"}
    return {k: sum(v.values()) for k, v in st.data["data"].items()}


@pytest.mark.vllm
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "fail-policy"])
def test_worker_counters_count_exactly_what_failed(recompute):
    """kvoffload:failed_store_blocks = host slots of store jobs that failed (injected: fail_next_stores
    = N jobs of 2 blocks -> 2N) or were refused at submit; kvoffload:failed_load_blocks = GPU blocks
    of load jobs reported failed and recomputed (recompute policy only: under "fail" vLLM stops the
    engine on the first one, so nothing is counted). Each failure counted once, as an increment."""
    from connector.vllm_adapter import M_CHECKSUM_FAILED, M_FAILED_LOAD, M_FAILED_STORE, WORKER_METRICS

    assert set(WORKER_METRICS) == {M_FAILED_STORE, M_FAILED_LOAD, M_CHECKSUM_FAILED}
    w, _ = _worker(recompute)
    assert w.take_stats() is None  # nothing moved: an idle step sends nothing
    n = 3
    w.fail_next_stores = n
    for j in range(n):  # 3 jobs x 2 blocks, all fail
        assert w.submit_store(j, gpu_spec([2 * j, 2 * j + 1]), CPULoadStoreSpec([2 * j, 2 * j + 1]))
    assert w.submit_store(10, gpu_spec([7]), CPULoadStoreSpec([7]))  # succeeds: not counted
    _done(w)
    assert _counters(w) == {M_FAILED_STORE: 2 * n}
    assert w.take_stats() is None  # increments: reported once
    # a load refused for a bad slot (2 blocks), a load failed by the hook (1 block), a good load
    assert w.submit_load(11, CPULoadStoreSpec([7, 1]), gpu_spec([8, 9]))
    w.fail_next_loads = 1
    assert w.submit_load(12, CPULoadStoreSpec([7]), gpu_spec([10]))
    assert w.submit_load(13, CPULoadStoreSpec([7]), gpu_spec([11]))
    d = _done(w)
    assert d[13].success and d[13].transfer_size == LAYERS * PAGE
    assert w.refused_loads == 1
    assert _counters(w) == ({M_FAILED_LOAD: 3} if recompute else {})
    # the CUDA branch: a store and a load refused at submit by the TransferWorker
    w.cuda, w.tw = True, _RefusingTW(refuse={20, 21})
    assert w.submit_store(20, gpu_spec([0, 1, 2]), CPULoadStoreSpec([0, 1, 2]))
    w.submit_load(21, CPULoadStoreSpec([7]), gpu_spec([12, 13]))
    _done(w)
    assert _counters(w) == ({M_FAILED_STORE: 3, M_FAILED_LOAD: 2} if recompute else {M_FAILED_STORE: 3})
    assert w.failed_store_blocks == 2 * n + 3


@pytest.mark.vllm
def test_checksum_failures_reach_the_stats_path():
    """Integrity mode: the CheckedTransferWorker's failed_blocks counter becomes
    kvoffload:checksum_failed_blocks (increments)."""
    from connector.vllm_adapter import M_CHECKSUM_FAILED

    w, _ = _worker(True)

    class _Checked:
        integrity = {"stored_blocks": 0, "checked_blocks": 0, "failed_blocks": 0, "failed_jobs": 0}

    w.checked = _Checked()
    assert w.take_stats() is None
    w.checked.integrity["failed_blocks"] = 5
    assert _counters(w) == {M_CHECKSUM_FAILED: 5}
    w.checked.integrity["failed_blocks"] = 6
    assert _counters(w) == {M_CHECKSUM_FAILED: 1}


@pytest.mark.vllm
def test_worker_metadata_keeps_failed_stores_through_rank_aggregation():
    """vLLM aggregates the ranks' worker metadata as first.aggregate(second)...: the failed store
    jobs of every rank survive it (slots unioned per job) beside vLLM's completed-job counts."""
    from connector.vllm_adapter import KVOffloadWorkerMetadata

    r0 = KVOffloadWorkerMetadata(completed_jobs={1: 1, 2: 1}, failed_stores={1: [3, 4]})
    r1 = KVOffloadWorkerMetadata(completed_jobs={1: 1, 2: 1}, failed_stores={1: [4, 5], 2: [7]})
    r2 = KVOffloadWorkerMetadata(completed_jobs={1: 1})
    out = r0.aggregate(r1).aggregate(r2)
    assert isinstance(out, KVOffloadWorkerMetadata)
    assert out.completed_jobs == {1: 3, 2: 2} and out.failed_stores == {1: [3, 4, 5], 2: [7]}
