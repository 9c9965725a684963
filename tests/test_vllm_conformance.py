"""Conformance with vLLM's real CPU-side classes (skipped when vllm is not installed).

vLLM's own factory builds our connector in both roles from a kv-transfer
config; vLLM's real Scheduler drives requests with shared prefixes,
preemption and aborts; our worker runs on CPU tensors standing in for GPU
caches, and the bytes loaded back must equal the bytes stored.
"""
import pytest

vllm = pytest.importorskip("vllm", reason="vLLM not installed: pip install -e '.[vllm]'")
from connector import vllm_compat as compat  # noqa: E402
from connector.vllm_adapter import (M_EVICTED, M_LOADED, M_STORED, M_USAGE, M_USED, KVOffloadConnector,  # noqa: E402
                                     KVOffloadManager, KVOffloadWorker)
from tests.vllm_harness import (BLOCK, LAYERS, Harness, front_end_prom, kv_value, make_model_dir,  # noqa: E402
                                make_vllm_config, stat_last, stat_total)

PLUGIN = dict(kv_connector="OffloadingConnector", kv_role="kv_both",
              kv_connector_extra_config={"spec_name": "KVOffloadSpec", "spec_module_path": "connector.vllm_adapter",
                                         "cpu_bytes_to_use": 1 << 22})
CLASS = dict(kv_connector="KVOffloadConnector", kv_connector_module_path="connector.vllm_adapter",
             kv_role="kv_both", kv_connector_extra_config={"cpu_bytes_to_use": 1 << 22})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("tinyllama")))


def cfg(base, **extra):
    c = dict(base)
    c["kv_connector_extra_config"] = {**base["kv_connector_extra_config"], **extra}
    return c


def check_loaded(h, rid, prompt, upto):
    """The GPU blocks of request `rid` hold, for every position < upto, what compute wrote for it."""
    blocks = h.block_ids[rid]
    for pos in range(upto):
        b, o = blocks[pos // BLOCK], pos % BLOCK
        for li, name in enumerate(h.layer_names):
            v = h.kv[name][b, :, o]
            assert (v == kv_value(prompt[pos], pos, li)).all(), f"{rid}: wrong bytes at pos {pos} layer {li}"


@pytest.mark.vllm
@pytest.mark.parametrize("config", [PLUGIN, CLASS], ids=["spec-plugin", "connector-class"])
def test_factory_builds_both_roles(model_dir, config):
    h = Harness(model_dir, config)
    assert isinstance(h.connector.connector_scheduler.manager, KVOffloadManager)
    assert isinstance(h.worker.connector_worker.worker, KVOffloadWorker)
    if config is CLASS:
        assert isinstance(h.connector, KVOffloadConnector)
        assert KVOffloadConnector.get_required_kvcache_layout(h.vllm_config) == compat.DEFAULT_LAYOUT


@pytest.mark.vllm
@pytest.mark.parametrize("block_outer", [True, False], ids=["block-outer", "layer-outer"])
@pytest.mark.parametrize("config", [PLUGIN, CLASS], ids=["spec-plugin", "connector-class"])
def test_store_then_load_gives_back_the_same_bytes(model_dir, config, block_outer):
    h = Harness(model_dir, config, block_outer=block_outer)
    prompt = list(range(1, 70))  # 4 full blocks + 5 tokens
    h.add_request("a", prompt)
    h.run_until_idle()
    m = h.connector.connector_scheduler.manager
    assert m.bm.counters.stored_blocks == 4 and m.bm.used == 4
    w = h.worker.connector_worker.worker
    assert w.mover.contiguous_blocks == block_outer  # block-outer: one range per block
    h.scheduler.reset_prefix_cache()  # drop the GPU prefix cache ...
    h.buf.zero_()                     # ... and its bytes: only the CPU copy is left
    h.add_request("b", prompt)
    h.run_until_idle()
    assert "b" in h.finished_recving
    assert m.bm.counters.loaded_blocks == 4
    check_loaded(h, "b", prompt, 4 * BLOCK)
    assert all(b.refs == 0 for b in m.bm.blocks.values())
    # bytes and times reached vLLM's stats path (scheduler_stats.kv_connector_stats)
    ub = h.worker.connector_worker.worker.mover.unified_block_bytes
    assert stat_total(h.stats, "vllm:kv_offload_store_bytes") == 4 * ub
    assert stat_total(h.stats, "vllm:kv_offload_load_bytes") == 4 * ub
    assert stat_total(h.stats, "vllm:kv_offload_store_time") > 0
    # our counters: each counts its event once, where it happens (not per lookup)
    assert stat_total(h.stats, M_STORED) == 4 and stat_total(h.stats, M_LOADED) == 4
    assert stat_total(h.stats, M_EVICTED) == 0
    assert stat_last(h.stats, M_USED) == 4 and stat_last(h.stats, M_USAGE) == 4 / m.bm.capacity


@pytest.mark.vllm
def test_shared_prefixes_store_once_and_hit(model_dir):
    h = Harness(model_dir, CLASS)
    base = list(range(100, 148))  # 3 full blocks shared
    h.add_request("x", base + [1, 2, 3, 4] * 5)
    h.add_request("y", base + [9, 8, 7, 6] * 5)
    h.run_until_idle()
    m = h.connector.connector_scheduler.manager
    stored = m.bm.counters.stored_blocks
    assert stored == 3 + 1 + 1  # shared prefix deduplicated, one distinct 4th block each
    h.scheduler.reset_prefix_cache()
    h.buf.zero_()
    h.add_request("z", base + [1, 2, 3, 4] * 5)
    h.run_until_idle()
    check_loaded(h, "z", base + [1, 2, 3, 4] * 5, 4 * BLOCK)


@pytest.mark.vllm
def test_preemption_and_abort_leave_no_pinned_blocks(model_dir):
    from vllm.v1.request import RequestStatus

    h = Harness(model_dir, CLASS, num_gpu_blocks=12)  # too few: forces preemption
    prompts = {f"r{i}": [i * 50 + t for t in range(1, 49)] for i in range(4)}
    for rid, p in prompts.items():
        h.add_request(rid, p, max_tokens=24)
    h.step()
    if compat.VERSION >= (0, 32):  # 0.26's scheduler asserts on an aborted request that never got blocks
        h.scheduler.finish_requests("r3", RequestStatus.FINISHED_ABORTED)
    for _ in range(100):
        if h.preempted:
            break
        h.step()
    # and one with blocks, its loads/stores under way, after a preemption
    h.scheduler.finish_requests(h.scheduler.running[0].request_id, RequestStatus.FINISHED_ABORTED)
    h.run_until_idle(max_steps=400)
    m = h.connector.connector_scheduler.manager
    assert not h.scheduler.has_unfinished_requests()
    assert h.preempted, "the scenario must actually preempt a request"
    assert all(b.refs == 0 for b in m.bm.blocks.values()), "a block stayed pinned"
    assert m.bm.counters.stored_blocks >= 3 * 3
    assert m.bm.used <= m.bm.capacity


@pytest.mark.vllm
def test_bad_configs_fail_at_startup(model_dir):
    with pytest.raises(Exception, match="unknown kv_connector_extra_config keys"):
        Harness(model_dir, cfg(CLASS, cpu_byts=5))
    with pytest.raises(Exception, match="holds no block"):
        Harness(model_dir, cfg(CLASS, cpu_bytes_to_use=100))
    with pytest.raises(Exception, match="eviction_policy"):
        Harness(model_dir, cfg(CLASS, eviction_policy="fifo"))
    c = dict(CLASS)
    c["kv_connector_extra_config"] = {}
    with pytest.raises(Exception, match="cpu_bytes_to_use"):
        Harness(model_dir, c)
    with pytest.raises(Exception, match="blocks_per_chunk"):
        Harness(model_dir, cfg(CLASS, blocks_per_chunk=2))
    with pytest.raises(Exception, match="native_submit must be true or false"):
        Harness(model_dir, cfg(CLASS, native_submit="yes"))
    Harness(model_dir, cfg(CLASS, native_submit=False))  # a known key, accepted


@pytest.mark.vllm
def test_running_out_of_host_memory_evicts(model_dir):
    h = Harness(model_dir, cfg(CLASS, cpu_bytes_to_use=LAYERS * 2 * BLOCK * 2 * 16 * 4 * 3))  # 3 blocks
    for i in range(4):
        h.add_request(f"q{i}", [i * 100 + t for t in range(1, 34)])  # 2 full blocks each
        h.run_until_idle()
    m = h.connector.connector_scheduler.manager
    assert m.bm.capacity == 3 and m.bm.used <= 3 and m.bm.counters.evictions > 0
    assert stat_total(h.stats, M_EVICTED) == m.bm.counters.evictions


def _store_then_load(h, prompt):
    """Store a prompt's blocks, drop the device prefix cache and its bytes, run it again."""
    h.add_request("a", prompt)
    h.run_until_idle()
    h.scheduler.reset_prefix_cache()
    h.buf.zero_()
    h.add_request("b", prompt)
    h.run_until_idle()


@pytest.mark.vllm
@pytest.mark.parametrize("config", [PLUGIN, CLASS], ids=["spec-plugin", "connector-class"])
def test_front_end_metric_table_knows_our_stats(model_dir, config):
    """vLLM builds its Prometheus table in the front-end process (API server, or LLM's process
    beside a multi-process engine core) from the config alone; the engine's stats reach it.
    Before KVOffloadConnector named its spec there too, observe() failed on our keys
    (AssertionError in offloading/metrics.py) for the connector-class route."""
    h = Harness(model_dir, config)
    _store_then_load(h, list(range(1, 70)))
    prom, reg = front_end_prom(make_vllm_config(model_dir, config))  # a config no connector touched
    for st in h.stats:
        prom.observe(st, engine_idx=0)
    val = lambda name: reg.get_sample_value(name, {"engine": "0"})  # noqa: E731
    assert val(M_STORED + "_total") == 4 and val(M_LOADED + "_total") == 4
    assert not val(M_EVICTED + "_total") and val(M_USED) == 4  # (a counter never increased has no sample)
    assert val("vllm:kv_offload_load_bytes_total") == 4 * h.worker.connector_worker.worker.mover.unified_block_bytes
    if compat.VERSION >= (0, 33):  # the info metric: our spec declares the labels, our manager fills them
        m = h.connector.connector_scheduler.manager
        labels = {"engine": "0", **{k: str(v) for k, v in m.config_info()[0].items()}}
        assert reg.get_sample_value("vllm:kv_offload_config_info", labels) == 1


@pytest.mark.vllm
def test_connector_declares_hybrid_model_support():
    from vllm.distributed.kv_transfer.kv_connector.v1 import supports_hma

    assert supports_hma(KVOffloadConnector)  # vLLM keeps its hybrid KV cache manager on


@pytest.mark.vllm
def test_manager_lock_and_config_info(model_dir):
    from connector.vllm_adapter import KVOffloadSpec

    h = Harness(model_dir, CLASS)
    m = h.connector.connector_scheduler.manager
    with m.lock:  # vLLM 0.33 holds it across a step
        pass
    (info,) = m.config_info()
    assert tuple(info) == KVOffloadSpec.config_info_keys({})
    assert info["kvoffload_slots"] == m.bm.capacity and info["kvoffload_slot_bytes"] == 2 * h.page
    assert info["kvoffload_eviction_policy"] == "lru"


@pytest.mark.vllm
@pytest.mark.skipif(not compat.EXPEDITED_LOADS, reason="expedited (sync) loads are vLLM 0.33+")
def test_expedited_loads(model_dir):
    """0.33, sync_load_budget_bytes > 0: vLLM submits a hit it can run this step as an
    expedited load and waits for it within the step; the bytes must land all the same."""
    h = Harness(model_dir, cfg(CLASS, sync_load_budget_bytes=1 << 30))
    w = h.worker.connector_worker.worker
    flags = []
    submit = w.submit_load
    w.submit_load = lambda job_id, src, dst, expedited=False: flags.append(expedited) or submit(
        job_id, src, dst, expedited=expedited)
    prompt = list(range(1, 70))
    _store_then_load(h, prompt)
    assert flags == [True]  # one load, expedited
    assert "b" not in h.finished_recving  # ran in the step that loaded it
    m = h.connector.connector_scheduler.manager
    assert m.bm.counters.loaded_blocks == 4 and all(b.refs == 0 for b in m.bm.blocks.values())
    check_loaded(h, "b", prompt, 4 * BLOCK)


@pytest.mark.vllm
def test_out_of_range_version_is_refused(monkeypatch):
    import importlib
    import sys

    import connector.vllm_compat as c

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    monkeypatch.delitem(sys.modules, "connector.vllm_compat")
    with pytest.raises(ImportError, match=r"supports vllm >= 0.26.0, < 0.34; found vllm 0.34.0"):
        importlib.import_module("connector.vllm_compat")
    monkeypatch.setitem(sys.modules, "connector.vllm_compat", c)


@pytest.mark.vllm
@pytest.mark.parametrize("config", [PLUGIN, CLASS], ids=["spec-plugin", "connector-class"])
def test_hybrid_model_two_groups_over_one_buffer(model_dir, config):
    """Full attention + sliding window (vLLM's hybrid allocator: groups overlay one buffer, a block
    id belongs to one group at a time). Every block the second request holds, in either group,
    must carry its own group's bytes after the loads, none clobbered by the other group's."""
    h = Harness(model_dir, config, hybrid=True)
    assert len(h.kv_cache_config.kv_cache_groups) == 2
    prompt = list(range(1, 70))  # 4 full blocks + 5 tokens
    _store_then_load(h, prompt)
    m = h.connector.connector_scheduler.manager
    assert m.bm.counters.loaded_blocks >= 4 + 1  # group 0's whole prefix, and the window of group 1
    checked = 0
    for g, (blocks, layers) in enumerate(zip(h.group_block_ids["b"], h.group_layers)):
        for i, b in enumerate(blocks[:4]):
            if b == 0:  # a sliding-window block outside the window: vLLM's null block
                continue
            for pos in range(i * BLOCK, (i + 1) * BLOCK):
                for li in layers:
                    assert (h.kv[h.layer_names[li]][b, :, pos % BLOCK] == kv_value(prompt[pos], pos, li)).all(), \
                        f"group {g} block {i} (id {b}) pos {pos}"
            checked += 1
    assert checked >= 5
    assert all(b.refs == 0 for b in m.bm.blocks.values())


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.parametrize("native_submit", [True, False], ids=["native", "inline"])
@pytest.mark.parametrize("block_outer", [True, False], ids=["block-outer", "per-layer"])
def test_cuda_worker_regular_and_expedited_loads(native_submit, block_outer):
    """KVOffloadWorker on CUDA tensors: stores, then a regular load and an expedited one (vLLM
    0.33's sync loads: their own TransferWorker and stream) in flight together; vLLM waits on the
    expedited job within the step. Random non-zero bytes, destination poisoned, bit-exact."""
    import torch
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from connector.host_pool import HostPool
    from tests.vllm_harness import gpu_spec, random_canonical_caches

    nb, page, layers = 64, 4096, 4
    tensors, caches = random_canonical_caches(block_outer, nb, page, layers)
    pool = HostPool(32, layers * page, torch.device("cuda"))
    w = KVOffloadWorker(caches, pool.tensor, native_submit=native_submit, expedited_loads=True)
    assert w.tw_expedited is not None and w.tw_expedited is not w.tw
    gpu = [t.tensor for t in tensors]
    src, slots = list(range(0, 16)), list(range(0, 16))
    want = [t[src].clone() for t in gpu]
    assert w.submit_store(1, gpu_spec(src), CPULoadStoreSpec(slots))
    w.wait({1})
    for t in gpu:
        t.fill_(-1)  # poison
    regular, expedited = list(range(20, 28)), list(range(40, 48))
    assert w.submit_load(2, CPULoadStoreSpec(slots[:8]), gpu_spec(regular))
    assert w.submit_load(3, CPULoadStoreSpec(slots[8:]), gpu_spec(expedited), expedited=True)
    w.wait({3})
    torch.cuda.current_stream().synchronize()
    for t, ref in zip(gpu, want):
        assert torch.equal(t[expedited], ref[8:])
    w.wait({2})
    for t, ref in zip(gpu, want):
        assert torch.equal(t[regular], ref[:8])
    done = {r.job_id: r for r in w.get_finished()}
    assert set(done) == {1, 2, 3} and all(r.success for r in done.values())
    assert done[3].transfer_size == 8 * layers * page
    w.shutdown()


@pytest.mark.vllm
def test_store_threshold_leaves_unadmitted_blocks_out_without_failing(model_dir):
    """store_threshold=1: a block is stored only once a lookup has missed it. vLLM's prefix lookup
    stops at the first miss, so a new prompt's first block is admitted and the others are not
    yet; leaving them out is not an allocation failure (vLLM would count one and retry)."""
    h = Harness(model_dir, cfg(CLASS, store_threshold=1), max_num_batched_tokens=2 * BLOCK)  # 2 blocks a step
    h.add_request("a", list(range(1, 70)))
    h.run_until_idle()
    m = h.connector.connector_scheduler.manager
    assert m.bm.counters.stored_blocks == 1
    assert stat_total(h.stats, "vllm:kv_offload_allocation_failure") == 0


@pytest.mark.vllm
@pytest.mark.parametrize("hybrid", [False, True], ids=["one-group", "hybrid"])
@pytest.mark.parametrize("config", [PLUGIN, CLASS], ids=["spec-plugin", "connector-class"])
def test_host_pool_takes_at_most_what_was_asked(model_dir, config, hybrid):
    """Issue 37 item 5, vLLM's pool that took 1.92x the host memory asked for: the host memory
    the adapter allocates (slots x bytes per slot, the worker's whole host tensor) is at most
    cpu_bytes_to_use and wastes less than one block of it, with one KV-cache group and with two
    groups over one buffer (a slot holds one GPU block id's row of every tensor once, not once
    per group). Can fail: a slot sized per group, or slots counted from a smaller block size
    than the worker's rows, exceed the budget. (HostPool's own bytes: tests/test_faults.py.)"""
    asked = config["kv_connector_extra_config"]["cpu_bytes_to_use"]
    h = Harness(model_dir, config, hybrid=hybrid)
    w = h.worker.connector_worker.worker
    spec = h.worker.connector_worker.spec
    host = w.host.numel() * w.host.element_size()
    assert host <= asked, f"host pool {host} B > asked {asked} B ({host / asked:.2f}x)"
    assert asked - host < w.host.shape[1], f"host pool {host} B wastes a block or more of {asked} B"
    assert w.host.shape[0] == spec.num_chunks == h.connector.connector_scheduler.manager.bm.capacity


@pytest.mark.vllm
@pytest.mark.parametrize("config", [PLUGIN, CLASS], ids=["spec-plugin", "connector-class"])
def test_failed_stores_are_counted_where_vllm_shows_them(model_dir, config):
    """A store job that fails on the worker (fail_next_stores: the request's one job of 4 blocks)
    is reported done to vLLM (it allows no failed store), so the manager counts its blocks in
    cpu_stored_blocks; the worker counts them in kvoffload:failed_store_blocks, which reaches the
    front end's Prometheus table through KVOffloadConnector's worker-side get_kv_connector_stats
    (summed with the scheduler side's stats, as vLLM's scheduler does). vLLM's OffloadingConnector
    (spec route) never asks its worker for stats: there the worker counter is not exported."""
    from connector.vllm_adapter import M_FAILED_STORE

    h = Harness(model_dir, config)
    w = h.worker.connector_worker.worker
    w.fail_next_stores = 1
    worker_stats = []
    h.add_request("a", list(range(1, 70)))
    for _ in range(50):
        if not h.scheduler.has_requests() and not h.scheduler.has_unfinished_requests():
            break
        h.step()
        st = h.worker.get_kv_connector_stats()  # what the model runner sends after this step
        if st is not None:
            worker_stats.append(st.data)
    assert w.fail_next_stores == 0 and w.failed_store_blocks == 4
    prom, reg = front_end_prom(make_vllm_config(model_dir, config))
    for st in h.stats + worker_stats:
        prom.observe(st, engine_idx=0)
    val = lambda name: reg.get_sample_value(name, {"engine": "0"})  # noqa: E731
    assert val(M_STORED + "_total") == 4  # store completions, the failed job's included (docs/vllm.md)
    assert not val("vllm:kv_offload_store_bytes_total")  # no bytes for a failed job
    if config is CLASS:
        assert val(M_FAILED_STORE + "_total") == 4
        assert w.take_stats() is None  # each increment handed over once
    else:
        assert worker_stats == [] and not val(M_FAILED_STORE + "_total")


@pytest.mark.vllm
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_store_keys_are_dropped_by_the_scheduler(model_dir, policy):
    """KVOffloadConnector: a store job that failed on the worker reaches the scheduler side
    (KVOffloadWorkerMetadata.failed_stores) and its keys are dropped as vLLM completes it, so the
    manager never hands out its half-written slots: the next request misses them and recomputes
    (under EITHER load-failure policy; before, its lookup hit, the worker refused the load, and
    under "fail" vLLM stopped the engine), stores them anew, and a third request loads the good
    copy bit-exact. Counters: cpu_stored_blocks counts both stores (4 + 4), failed_store_blocks the
    failed one (4), no load refused or failed."""
    from vllm.v1.kv_offload.base import LookupResult

    from connector.vllm_adapter import M_FAILED_LOAD, M_FAILED_STORE

    h = Harness(model_dir, {**CLASS, "kv_load_failure_policy": policy})
    w = h.worker.connector_worker.worker
    m = h.connector.connector_scheduler.manager
    prompt = list(range(1, 70))  # 4 full blocks + 5 tokens
    w.fail_next_stores = 1
    h.add_request("a", prompt)
    h.run_until_idle()
    assert w.fail_next_stores == 0 and w.failed_store_blocks == 4 and w.bad_slots.sum() == 4
    assert m.bm.used == 0 and m.invalidated_blocks == 4  # dropped when the job completed
    assert all(m.lookup(k, None) == LookupResult.MISS for k in list(m.bm.blocks)) and not m.bm.blocks
    h.scheduler.reset_prefix_cache()
    h.buf.zero_()
    h.add_request("b", prompt)  # misses the host: recomputed, stored again
    h.run_until_idle()
    assert "b" not in h.finished_recving and w.refused_loads == 0 and m.bm.used == 4
    h.scheduler.reset_prefix_cache()
    h.buf.zero_()
    h.add_request("c", prompt)  # loads the good copy
    h.run_until_idle()
    assert "c" in h.finished_recving and m.bm.counters.loaded_blocks == 4
    check_loaded(h, "c", prompt, 4 * BLOCK)
    assert w.refused_loads == 0 and w.take_stats() is not None
    assert stat_total(h.stats, M_STORED) == 8 and stat_total(h.stats, M_LOADED) == 4
    assert w.failed_store_blocks == 4 and w.failed_load_blocks == 0
