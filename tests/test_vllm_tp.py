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
