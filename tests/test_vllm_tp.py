"""The vLLM adapter at TP=2 on CPU: two worker processes, rank and world size from vLLM's
OffloadingConfig, one shared host pool with a cell per rank (or one cell for replicated MLA KV)."""
import multiprocessing as mp
import os
import uuid

import pytest

pytest.importorskip("vllm", reason="vLLM not installed: pip install -e '.[vllm]'")

NB, PAGE = 12, 4096


def _config(rank, world, engine_id, replicated):
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                           OffloadingModelConfig, OffloadingParallelConfig)

    from connector.vllm_compat import dataclass_kwargs as kw  # drops fields this vLLM release lacks

    return OffloadingConfig(**kw(
        OffloadingConfig,
        groups=(OffloadingGroupConfig(**kw(OffloadingGroupConfig, tokens_per_block=16, layer_names=("l0", "l1"),
                                           group_id=0)),),
        worker_kv_bytes_per_block=2 * PAGE,
        enable_kv_cache_events=False, extra_config={"cpu_bytes_to_use": 2 * 2 * PAGE * 6},
        engine_id=engine_id, model=OffloadingModelConfig("tiny", "float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(**kw(
            OffloadingParallelConfig, rank=rank, world_size=world, tp_size=world, pp_size=1, pcp_size=1,
            dcp_size=1, data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False)),
        replicated_layout=replicated, kv_cache_layout="BLHNC"))


def _rank(rank, world, engine_id, replicated, q, go):
    try:
        import torch
        from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor,
                                             GPULoadStoreSpec)
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        from connector.vllm_adapter import KVOffloadSpec

        spec = KVOffloadSpec(_config(rank, world, engine_id, replicated))
        seed = 0 if replicated else rank  # replicated KV: identical bytes on every rank
        tensors = [torch.randint(1, 127, (NB, PAGE), dtype=torch.int8,
                                 generator=torch.Generator().manual_seed(seed * 10 + i)) for i in range(2)]
        caches = CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in tensors],
                                   [[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)]])
        w = spec.get_worker(caches)
        gpu, cpu = [3, 7, 9], [0, 5, 2]
        if rank == 0 or not replicated:  # vLLM skips stores on non-writer ranks of a replicated layout
            assert w.submit_store(1, GPULoadStoreSpec(gpu, [3], [0]), CPULoadStoreSpec(cpu))
        q.put(("stored", rank, spec.num_chunks, tuple(spec.pool.tensor.shape)))
        go.wait(60)
        before = [t[gpu].clone() for t in tensors]
        for t in tensors:
            t.zero_()
        assert w.submit_load(2, CPULoadStoreSpec(cpu), GPULoadStoreSpec(gpu, [3], [0]))
        ok = all(torch.equal(t[gpu], b) for t, b in zip(tensors, before))
        res = [r.success for r in w.get_finished()]
        q.put(("loaded", rank, ok and all(res)))
        spec.pool.close()
    except Exception as e:
        q.put(("error", rank, repr(e)))


@pytest.mark.parametrize("replicated", [False, True], ids=["sharded", "replicated"])
def test_two_tp_ranks_one_pool(replicated):
    from connector import vllm_compat

    if replicated and vllm_compat.config_field(_config(0, 2, "x", True), "replicated_layout") is None:
        pytest.skip("this vLLM release has no replicated (MLA) KV layout")
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    eid = f"kvo-test-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    ps = [ctx.Process(target=_rank, args=(r, 2, eid, replicated, q, go)) for r in range(2)]
    for p in ps:
        p.start()
    try:
        got = [q.get(timeout=180) for _ in range(2)]
        assert all(g[0] == "stored" for g in got), got
        row = 2 * PAGE if replicated else 2 * 2 * PAGE
        assert {g[3] for g in got} == {(got[0][2], row)}  # one pool: a cell per rank, or one cell
        assert got[0][2] == (6 if not replicated else 12)  # replicated KV doubles the blocks that fit
        go.set()
        done = sorted(q.get(timeout=180) for _ in range(2))
        assert done == [("loaded", 0, True), ("loaded", 1, True)], done
    finally:
        for p in ps:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        path = f"/dev/shm/kvoffload-{eid}-pool"
        if os.path.exists(path):
            os.unlink(path)


def _caches(seed):
    import torch
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    tensors = [torch.randint(1, 127, (NB, PAGE), dtype=torch.int8,
                             generator=torch.Generator().manual_seed(seed * 10 + i)) for i in range(2)]
    return tensors, CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in tensors],
                                      [[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)]])


def test_a_pool_left_by_a_killed_engine_is_never_read():
    """Issue 37: a rank killed in the middle of a store into the shared pool. vLLM stops the whole
    engine when a worker process dies (MultiprocExecutor's worker monitor), so no rank of that
    engine loads again; the pool FILE outlives it (/dev/shm, not unlinked by a killed process)
    and an engine started with the same engine_id maps it again, half-written rows and all.
    They are never read: which slot holds which block lives only in the scheduler's
    KVOffloadManager, which starts empty, and a slot becomes loadable only when vLLM reports this
    engine's store of it done on every rank. A sharded rank's view covers only its own cells.
    Can fail: a manager that persisted or recovered its table from the pool would report HIT for
    the old keys; a rank view that overlapped another rank's cells fails the offset check; a
    shutdown that leaves the file fails the last assert."""
    import numpy as np
    import torch
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from connector.vllm_adapter import KVOffloadSpec

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    eid = f"kvo-test-{uuid.uuid4().hex[:8]}"
    path = f"/dev/shm/kvoffload-{eid}-pool"
    try:
        # engine 1, rank 1 of 2: stores blocks, then a store is cut off half-way (junk in row 4)
        old = KVOffloadSpec(_config(1, 2, eid, False))
        m_old = old.get_manager()
        plan = m_old.prepare_store(["a", "b"], None)
        m_old.complete_store(plan.keys_to_store, None)
        tensors, caches = _caches(1)
        w_old = old.get_worker(caches)
        pool = old.pool.tensor
        assert w_old.host.data_ptr() - pool.data_ptr() == 2 * PAGE and w_old.host.stride(0) == pool.shape[1]
        assert w_old.submit_store(1, GPULoadStoreSpec([3, 7], [2], [0]), CPULoadStoreSpec(list(plan.store_spec.block_ids)))
        w_old.get_finished()
        w_old.host[4, : PAGE] = 0xAB  # the killed store: half of a cell written
        junk = pool.clone()
        del w_old, old  # killed: no shutdown, the file stays
        assert os.path.exists(path)

        # engine 2 with the same engine_id maps the same file: the old bytes are there ...
        new = KVOffloadSpec(_config(1, 2, eid, False))
        tensors, caches = _caches(2)
        w = new.get_worker(caches)
        assert torch.equal(new.pool.tensor, junk), "not the same file: the hazard is not exercised"
        # ... and unreachable: the new manager knows no block, so vLLM schedules no load
        m = new.get_manager()
        assert [m.lookup(k, None).name for k in ("a", "b")] == ["MISS", "MISS"]
        # the slot of the killed store becomes readable only through this engine's own store
        plan = m.prepare_store(["c"], None)
        slot = int(np.asarray(plan.store_spec.block_ids)[0])
        want = [t[5].clone() for t in tensors]
        assert w.submit_store(2, GPULoadStoreSpec([5], [1], [0]), CPULoadStoreSpec([slot]))
        assert all(r.success for r in w.get_finished())
        m.complete_store(["c"], None)
        assert m.lookup("c", None).name == "HIT"
        for t in tensors:
            t[6] = -1
        assert w.submit_load(3, CPULoadStoreSpec([slot]), GPULoadStoreSpec([6], [1], [0]))
        assert all(r.success for r in w.get_finished())
        assert all(torch.equal(t[6], v) for t, v in zip(tensors, want))
        w.shutdown()
        assert not os.path.exists(path), "the shared pool file outlived a clean shutdown"
        new.pool.close()
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_shm_too_small_is_a_clear_startup_error_in_the_adapter(monkeypatch, tmp_path):
    """Issue 37 items 1 and 5 (vLLM's offloading died with "Bus error" when a container's /dev/shm
    was smaller than the pool): the TP adapter's shared pool reserves its pages at start-up, so a
    /dev/shm too small is a HostPoolError from get_worker (vLLM's register_kv_caches), naming
    --shm-size, before any transfer; no half-made file is left. Can fail: a sparse file (ftruncate)
    would start and SIGBUS later; an exception without the advice fails the match."""
    import connector.host_pool as hp
    from connector.vllm_adapter import KVOffloadSpec

    monkeypatch.setattr(hp, "SHM_DIR", str(tmp_path))

    def enospc(fd, off, n):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hp.os, "posix_fallocate", enospc)
    spec = KVOffloadSpec(_config(0, 2, "kvo-small", False))
    _, caches = _caches(0)
    with pytest.raises(hp.HostPoolError, match="shm-size"):
        spec.get_worker(caches)
    assert os.listdir(tmp_path) == []


def _rank_failed_store(rank, world, engine_id, q, go):
    """Replicated KV: rank 0's store fails (test hook: junk in the shared cells); every rank
    then loads those cells. Reports (rank, load errors, bytes equal to the stored ones)."""
    try:
        import torch
        from vllm.v1.kv_offload.base import GPULoadStoreSpec
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        from connector.vllm_adapter import KVOffloadSpec

        spec = KVOffloadSpec(_config(rank, world, engine_id, True))
        spec.recompute_failed_loads = True  # KVOffloadConnector under kv_load_failure_policy="recompute"
        tensors, caches = _caches(0)  # replicated KV: identical bytes on every rank
        w = spec.get_worker(caches)
        gpu, cpu = [3, 7, 9], [0, 5, 2]
        before = [t[gpu].clone() for t in tensors]
        if rank == 0:
            w.fail_next_stores = 1
            assert w.submit_store(1, GPULoadStoreSpec(gpu, [3], [0]), CPULoadStoreSpec(cpu))
            assert all(r.success for r in w.get_finished())  # reported finished: vLLM does not stop
        q.put(("stored", rank))
        go.wait(60)
        for t in tensors:
            t.zero_()
        assert w.submit_load(2, CPULoadStoreSpec(cpu), GPULoadStoreSpec(gpu, [3], [0]))
        assert all(r.success for r in w.get_finished())
        same = all(torch.equal(t[gpu], b) for t, b in zip(tensors, before))
        q.put(("loaded", rank, sorted(w.take_load_errors()), same))
        spec.pool.close()
    except Exception as e:
        q.put(("error", rank, repr(e)))


def test_replicated_failed_store_is_caught_by_rank_0():
    """A failed store of replicated (MLA) KV: only rank 0 stores and only it knows its cells are
    bad; ranks > 0 read them as they are (junk). Rank 0 runs the same load job and fails it, and
    vLLM recomputes the union of every rank's failed block ids (KVOutputAggregator), so the junk
    on rank 1 is overwritten before any forward reads it. Can fail: rank 0 loading the junk
    (no bad-slot check) reports no error and the union is empty."""
    from connector import vllm_compat

    if vllm_compat.config_field(_config(0, 2, "x", True), "replicated_layout") is None:
        pytest.skip("this vLLM release has no replicated (MLA) KV layout")
    eid = f"kvo-test-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    ps = [ctx.Process(target=_rank_failed_store, args=(r, 2, eid, q, go)) for r in range(2)]
    for p in ps:
        p.start()
    try:
        got = [q.get(timeout=180) for _ in range(2)]
        assert all(g[0] == "stored" for g in got), got
        go.set()
        done = sorted(q.get(timeout=180) for _ in range(2))
        assert all(d[0] == "loaded" for d in done), done
        (_, _, err0, same0), (_, _, err1, same1) = done
        assert err0 == [3, 7, 9] and err1 == [] and not same1  # rank 1 read junk, rank 0 flagged it
        assert set(err0) | set(err1) == {3, 7, 9}
    finally:
        for p in ps:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        path = f"/dev/shm/kvoffload-{eid}-pool"
        if os.path.exists(path):
            os.unlink(path)
