"""A failed transfer costs a recompute, never a wrong token: GPU fault injection (issue 37, item 1).

The test-only hook kernels/csrc/fault.h (armed through kernels.native.inject_fault) makes a chosen
driver call fail on the real GPU, `after` successful calls into a job: cudaMemcpyBatchAsync
("memcpy_batch"), a job's cudaMemcpyAsync ("memcpy_async": the DMA loop, id uploads) or a copy /
pack kernel launch ("kernel_launch"). For each submit path of connector.worker.TransferWorker and
both directions:
  * the job is reported failed (JobResult ok=False, nbytes 0, an error naming the failure), the
    hook fired exactly once after `after` calls that went through (fault_counts), the submit and
    get_finished raise nothing;
  * bytes outside the job's destination are untouched, and so is its source;
  * the next job (disarmed) on the same worker is bit-exact (random non-zero data, destination
    poisoned) and touches nothing else;
  * nothing hangs: every test runs under a hard time limit (faulthandler kills the process with
    a traceback after LIMIT_S);
  * shutdown with jobs in flight drains (exact) or cancels (reported failed), a failed job among
    them included.
And in a real vLLM engine (gpu + vllm): with loads failing, a request's greedy output equals the
no-offload output (the load is recomputed). Seeded random weights (profiling/vllm_util.py).

GPU tests marked gpu (the CPU side of the hook is tests/test_dma_issue_host.py); the worker's
error handling itself is also checked on CPU here, with stand-ins. On the H200:
    python -m pytest -q tests/test_gpu_faults.py
    compute-sanitizer --tool memcheck  python -m pytest -q -m "not vllm" tests/test_gpu_faults.py
    compute-sanitizer --tool racecheck python -m pytest -q -m "not vllm" tests/test_gpu_faults.py
"""
from __future__ import annotations

import faulthandler
import os
import time
import zlib

import numpy as np
import pytest
import torch

from kernels import native
from tests.conftest import HAS_CUDA

_GPU = pytest.mark.skipif(not (HAS_CUDA and native.AVAILABLE), reason="needs CUDA and kernels._C")

LIMIT_S = float(os.environ.get("KVO_FAULT_TEST_LIMIT_S", "300"))  # per test; compute-sanitizer is slow
ERR = 999  # cudaErrorUnknown: what the armed call returns instead of being made
N = 200    # blocks per job: several driver calls per job on every path


@pytest.fixture(autouse=True)
def _limit_and_disarm():
    """A hard time limit (a hang kills the run with every thread's traceback) and no fault left
    armed for the next test, whatever happened."""
    faulthandler.dump_traceback_later(LIMIT_S, exit=True)
    if native.AVAILABLE:
        native.clear_faults()
    try:
        yield
    finally:
        if native.AVAILABLE:
            native.clear_faults()
        faulthandler.cancel_dump_traceback_later()


# ----------------------------------------------------------------------------- setups
def _cache(layout: str, nb: int):
    """A KV cache of nb blocks of random non-zero bytes and its mover: 'unified' (whole blocks,
    DMA of unified blocks) or 'per_layer' (fragments: the pack kernel / staged pipeline)."""
    from kernels import BlockCopier
    from layout import KVBlockMover, KVLayout, KVSpec, UnifiedKVCache, allocate

    spec = KVSpec(4, 2, 64, 16)
    # its own copier: the settings a test changes (DMA mode, staged chunk) never reach the
    # process-wide one other tests use
    cp = BlockCopier(torch.device("cuda", torch.cuda.current_device()))
    if layout == "unified":
        c = UnifiedKVCache(spec, nb, device="cuda")
        c.buffer.random_(1, 255)
        return spec, KVBlockMover(spec, KVLayout.NB_NL_TWO_BS_NH_HS, c.unified(), copier=cp)
    kv = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, nb, device="cuda",
                  fill=lambda t: t.view(-1).view(torch.uint8).random_(1, 255))
    return spec, KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv, copier=cp)


def _gpu_blocks(mover, blocks) -> torch.Tensor:
    """The unified bytes of GPU blocks (a reference read with torch ops), [len(blocks), ub] on the host."""
    blocks = np.asarray(blocks, dtype=np.int64)
    out = torch.zeros(len(blocks), mover.unified_block_bytes, dtype=torch.uint8)
    mover.pack(blocks, out, np.arange(len(blocks), dtype=np.int64), method="torch")
    torch.cuda.synchronize()
    return out


def _poison_gpu(mover, blocks, value=0x5A) -> None:
    blocks = np.asarray(blocks, dtype=np.int64)
    src = torch.full((len(blocks), mover.unified_block_bytes), value, dtype=torch.uint8)
    mover.unpack(src, np.arange(len(blocks), dtype=np.int64), blocks, method="torch")
    torch.cuda.synchronize()


def _results(w, job_ids, timeout=60.0) -> dict:
    """Polls get_finished until every job in job_ids is reported (a bounded wait, no hang)."""
    want, got = set(job_ids), {}
    deadline = time.monotonic() + timeout
    while not want <= got.keys():
        for r in w.get_finished():
            got[r.job_id] = r
        assert time.monotonic() < deadline, f"jobs {sorted(want - got.keys())} never reported"
        time.sleep(0.001)
    return got


# (name, layout, TransferWorker kwargs, method, DMA mode, site, after): each path, failing
# `after` calls into a job of N blocks
NATIVE, INLINE, ASYNC = dict(native_submit=True), dict(native_submit=False), dict(async_submit=True, native_submit=False)
PATHS = [
    # native DMA thread: 64 descriptors per batch call (NATIVE_SLICE), the third call fails
    ("native-dma", "unified", NATIVE, "dma", None, "memcpy_batch", 2),
    # ... its cudaMemcpyAsync loop, the 18th copy fails
    ("native-dma-loop", "unified", NATIVE, "dma", "loop", "memcpy_async", 17),
    # native pack job: the id upload made, the pack kernel's launch fails
    ("native-pack", "per_layer", NATIVE, "cuda", None, "kernel_launch", 0),
    # ... its id upload fails
    ("native-pack-upload", "per_layer", NATIVE, "cuda", None, "memcpy_async", 0),
    # native staged pipeline (chunks of 8 blocks): the 4th chunk's pack kernel / 3rd DMA call fails
    ("native-staged-kernel", "per_layer", NATIVE, "staged", None, "kernel_launch", 3),
    ("native-staged-dma", "per_layer", NATIVE, "staged", None, "memcpy_batch", 2),
    # inline (caller's thread): DMA loop; the block-copy kernel after its id upload; pack_native
    ("inline-dma-loop", "unified", INLINE, "dma", "loop", "memcpy_async", 17),
    ("inline-kernel", "unified", INLINE, "cuda", None, "kernel_launch", 0),
    ("inline-pack", "per_layer", INLINE, "cuda", None, "kernel_launch", 0),
    # the Python staged pipeline (layout.pack, general path): the second chunk's pack kernel fails
    ("inline-staged", "per_layer", INLINE, "staged", None, "kernel_launch", 1),
    ("async-staged", "per_layer", ASYNC, "staged", None, "kernel_launch", 1),
    # async (Python submit thread)
    ("async-dma-loop", "unified", ASYNC, "dma", "loop", "memcpy_async", 17),
    ("async-pack", "per_layer", ASYNC, "cuda", None, "kernel_launch", 0),
]


def _worker(layout, kwargs, method, dma_mode, nb=256, ns=320):
    from connector import TransferWorker

    spec, mover = _cache(layout, nb)
    cp = mover.copier
    cp.staged_chunk_bytes = 8 * mover.unified_block_bytes  # staged jobs of N blocks: N/8 chunks
    if dma_mode == "loop":
        cp.dma_mode = native.DMA_LOOP  # one cudaMemcpyAsync per descriptor
    host = torch.empty(ns, mover.unified_block_bytes, dtype=torch.uint8).pin_memory()
    host.random_(1, 255)
    return mover, host, TransferWorker(mover, host, method=method, **kwargs)


def _ids(rng, nb, ns):
    """N distinct random GPU blocks and host slots (few runs: one descriptor per block)."""
    return rng.permutation(nb)[:N].astype(np.int64), rng.permutation(ns)[:N].astype(np.int64)


@pytest.mark.gpu
@_GPU
@pytest.mark.parametrize("kind", ["store", "load"])
@pytest.mark.parametrize("name,layout,kwargs,method,dma_mode,site,after", PATHS, ids=[p[0] for p in PATHS])
def test_failed_call_mid_job_fails_the_job_and_the_next_job_is_exact(name, layout, kwargs, method, dma_mode, site,
                                                                       after, kind):
    mover, host, w = _worker(layout, kwargs, method, dma_mode)
    nb, ns = 256, host.shape[0]
    rng = np.random.default_rng(zlib.crc32(f"{name}/{kind}".encode()))
    blocks, slots = _ids(rng, nb, ns)
    submit = (lambda jid: w.submit_store(jid, blocks, slots)) if kind == "store" else \
        (lambda jid: w.submit_load(jid, slots, blocks))

    def poison_dst():
        if kind == "store":
            host[torch.from_numpy(slots)] = 0xA5
        else:
            _poison_gpu(mover, blocks)

    def snapshot():
        return _gpu_blocks(mover, np.arange(nb)), host.clone()

    # 1. armed: `after` calls go through, the next fails
    poison_dst()
    gpu0, host0 = snapshot()
    native.inject_fault(site, after=after, error=ERR)
    submit(1)  # True (queued, fails later) or False (failed on the caller's thread): both report below
    w.wait([1])
    r = _results(w, [1])[1]
    calls, hits, armed = native.fault_counts(site)
    assert (calls, hits, armed) == (after + 1, 1, False), \
        f"{name}: the hook saw {calls} calls, fired {hits} times (armed={armed}): not the path under test"
    assert r.ok is False and r.nbytes == 0 and r.error, r
    assert w.stats["failed_jobs"] == 1
    gpu1, host1 = snapshot()
    if kind == "store":  # the source and every host row outside the job's slots untouched
        assert torch.equal(gpu1, gpu0)
        outside = np.setdiff1d(np.arange(ns), slots)
        assert torch.equal(host1[outside], host0[outside])
    else:
        assert torch.equal(host1, host0)
        outside = np.setdiff1d(np.arange(nb), blocks)
        assert torch.equal(gpu1[outside], gpu0[outside])

    # 2. disarmed: the same job again, into a poisoned destination: exact, nothing else touched
    poison_dst()
    gpu0, host0 = snapshot()
    assert submit(2) is True
    w.wait([2])
    r = _results(w, [2])[2]
    assert r.ok and r.error is None and r.nbytes == N * mover.unified_block_bytes, r
    gpu1, host1 = snapshot()
    if kind == "store":
        assert torch.equal(host1[torch.from_numpy(slots)], gpu0[torch.from_numpy(blocks)])
        assert torch.equal(gpu1, gpu0)
        outside = np.setdiff1d(np.arange(ns), slots)
        assert torch.equal(host1[outside], host0[outside])
    else:
        assert torch.equal(gpu1[torch.from_numpy(blocks)], host0[torch.from_numpy(slots)])
        assert torch.equal(host1, host0)
        outside = np.setdiff1d(np.arange(nb), blocks)
        assert torch.equal(gpu1[outside], gpu0[outside])
    assert native.fault_counts(site)[:2] == (after + 1, 1)  # disarmed: nothing more seen
    assert w.shutdown() == []  # everything was reported


@pytest.mark.gpu
@_GPU
@pytest.mark.parametrize("mode", ["native", "inline", "async"])
def test_fence_of_a_failed_job_orders_and_does_not_raise(mode):
    """An engine fences a store before it frees the store's blocks: a failed job's fence orders
    behind what the job queued and raises nothing (the failure comes with get_finished)."""
    kwargs = {"native": NATIVE, "inline": INLINE, "async": ASYNC}[mode]
    mover, host, w = _worker("unified", kwargs, "dma", "loop")
    rng = np.random.default_rng(3)
    blocks, slots = _ids(rng, 256, host.shape[0])
    native.inject_fault("memcpy_async", after=5, error=ERR)
    w.submit_store(1, blocks, slots)
    w.fence(1)  # must not raise
    torch.cuda.current_stream().synchronize()
    r = _results(w, [1])[1]
    assert r.ok is False and native.fault_counts("memcpy_async")[1] == 1
    assert w.shutdown() == []


@pytest.mark.gpu
@_GPU
@pytest.mark.parametrize("mode", ["native-dma", "native-pack", "inline", "async"])
@pytest.mark.parametrize("drain", [True, False], ids=["drain", "cancel"])
def test_shutdown_with_jobs_in_flight_one_failing(mode, drain):
    """Jobs queued behind a long compute kernel (stores wait for compute), the first of them
    failing by injection: shutdown neither hangs nor raises; drained, the others are exact and
    ok; cancelled, all are reported failed; every job is reported once."""
    layout, kwargs, method, site = {
        "native-dma": ("unified", NATIVE, "dma", "memcpy_batch"),
        "native-pack": ("per_layer", NATIVE, "cuda", "kernel_launch"),
        "inline": ("unified", INLINE, "cuda", "kernel_launch"),
        "async": ("unified", ASYNC, "cuda", "kernel_launch"),
    }[mode]
    mover, host, w = _worker(layout, kwargs, method, None)
    ns = host.shape[0]
    host.fill_(0xA5)
    gpu = _gpu_blocks(mover, np.arange(256))
    native.inject_fault(site, after=0, error=ERR)  # the first job's first call at the site
    torch.cuda._sleep(200_000_000)  # ~0.1 s of compute the stores wait for
    jobs = {}
    for j in range(4):
        b = np.arange(40 * j, 40 * j + 40, dtype=np.int64)
        s = np.arange(40 * j, 40 * j + 40, dtype=np.int64)[::-1].copy()
        w.submit_store(j, b, s)
        jobs[j] = (b, s)
    res = {r.job_id: r for r in w.shutdown(drain=drain)}
    assert sorted(res) == [0, 1, 2, 3], res
    assert native.fault_counts(site)[1] == 1
    assert res[0].ok is False
    for j in (1, 2, 3):
        if drain:
            b, s = jobs[j]
            assert res[j].ok, res[j]
            assert torch.equal(host[torch.from_numpy(s)], gpu[torch.from_numpy(b)])
        else:
            assert res[j].ok is False and "cancelled" in res[j].error
    assert (host[160:ns] == 0xA5).all()  # no job wrote there
    with pytest.raises(RuntimeError):
        w.submit_store(9, np.array([0], np.int64), np.array([0], np.int64))


# ----------------------------------------------------------------------------- vLLM
def _vllm_ok() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def check_failed_loads_recompute(llm, prompts, reference, max_tokens, sites=native.FAULT_SITES) -> dict:
    """Given an `LLM` (in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0) with our connector and
    the greedy tokens `reference` of `prompts` without offloading: runs the prompts once (their
    blocks are stored), empties the device prefix cache, then runs them again with every
    transfer's first driver call failing (so the loads of the stored prefixes fail), and a
    third time disarmed. Both outputs must equal the reference: a failed load is recomputed,
    never served. Returns what happened (fault hits, cached tokens per run)."""
    from profiling import vllm_util as U

    first, _ = U.generate(llm, prompts, max_tokens)
    assert first == reference, "offloading changed the output before any fault"
    U.reset_prefix_cache(llm)
    time.sleep(0.5)  # the stores of the first run finish in the background
    for s in sites:
        native.inject_fault(s, after=0, error=ERR, times=-1)
    try:
        faulty, cached_faulty = U.generate(llm, prompts, max_tokens)
    finally:
        hits = {s: native.fault_counts(s)[1] for s in sites}
        native.clear_faults()
    assert sum(hits.values()) > 0, f"no transfer was attempted while armed: {hits}"
    assert faulty == reference, "a failed load changed the output (served instead of recomputed)"
    U.reset_prefix_cache(llm)
    again, cached_again = U.generate(llm, prompts, max_tokens)
    assert again == reference
    return {"hits": hits, "cached_faulty": cached_faulty, "cached_again": cached_again}


@pytest.mark.gpu
@_GPU
@pytest.mark.vllm
@pytest.mark.skipif(not _vllm_ok(), reason="needs vllm")
@pytest.mark.parametrize("route", ["connector"])
def test_vllm_failed_loads_recompute_same_tokens(tmp_path, monkeypatch, route):
    """A tiny seeded-random-weight Llama in vLLM (0.26 on the H200), in this process so that the
    hook armed here is the worker's: loads failing by injection cost a recompute, the greedy
    output equals the no-offload output. Our connector class with kv_load_failure_policy
    "recompute" only: vLLM's own OffloadingConnector (route 1, our spec under it) asserts that
    every transfer succeeded and stops the engine on a failed load, whatever the policy
    (docs/vllm.md, failure table); without "recompute" our class stops it too, as vLLM's
    policy "fail" says (the first H200 run of this test, without the policy, did exactly that
    on both routes: `assert transfer_result.success` in vLLM's offloading worker)."""
    from profiling import vllm_util as U

    U.set_env_defaults()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model = U.TinyLlama(dtype="float32")
    mdir = U.write_tiny_llama(str(tmp_path / "tiny_llama"), model, seed=1234)
    bs = U.default_block_size()
    prompts = U.make_prompts(6, 8 * bs, seed=11, vocab=model.vocab, shared_prefix=4 * bs)
    common = dict(model=model, device_blocks=128, host_blocks=256, block_size=bs, max_model_len=32 * bs)
    llm = None
    try:
        llm = U.make_llm(mdir, **common)
        reference, _ = U.generate(llm, prompts, 16)
    finally:
        U.close_llm(llm)
    llm = None
    try:
        llm = U.make_llm(mdir, route=route, load_failure_policy="recompute", **common)
        info = check_failed_loads_recompute(llm, prompts, reference, 16)
    finally:
        U.close_llm(llm)
    print(route, info)


# ----------------------------------------------------------------------------- CPU: the worker's error paths
class _Ev:
    """A stand-in CUDA event: record/query/synchronize, each able to raise."""

    def __init__(self, record_raises=False, query_raises=False):
        self.record_raises, self.query_raises, self.records = record_raises, query_raises, 0

    def record(self, stream=None):
        if self.record_raises:
            raise RuntimeError("CUDA error: injected (record)")
        self.records += 1

    def query(self):
        if self.query_raises:
            raise RuntimeError("CUDA error: injected (query)")
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 0.5


class _Stream:
    def __init__(self):
        self.syncs = 0

    def wait_event(self, e):
        pass

    def synchronize(self):
        self.syncs += 1


def _bare_worker():
    """A TransferWorker without CUDA: the fields _issue, get_finished, wait and shutdown read."""
    import threading
    from types import SimpleNamespace

    from connector import TransferWorker

    w = TransferWorker.__new__(TransferWorker)
    w.jobs, w.done, w.methods, w._closed, w._raw, w._native, w._thread = {}, [], {}, False, False, None, None
    w.stats = {"store_bytes": 0, "load_bytes": 0, "store_ms": 0.0, "load_ms": 0.0, "failed_jobs": 0}
    w._free_events = {True: [], False: []}
    w.async_submit = False
    w.mover = SimpleNamespace(copier=SimpleNamespace(last_method="dma"))
    return w, threading


def test_cpu_issue_failure_whose_end_record_fails_too_is_a_failed_job_not_an_exception():
    """_issue (inline and the async thread's body): the copy raises, then recording the end event
    raises as well. Before: that second exception escaped (inline: out of submit with the job
    unregistered; async: it ended the submit thread, and every later job waited forever). Now:
    a failed job, the stream waited for (what it queued ran), issued set; the next job issues."""
    from connector.worker import _Job

    w, threading = _bare_worker()
    st = _Stream()
    prep = type("P", (), {"block_ids": np.zeros(3, np.int64)})()

    def run_fail(p):
        raise RuntimeError("CUDA error: injected (launch)")

    w.mover.run = run_fail
    j = _Job("store", 3, _Ev(), _Ev(record_raises=True), issued=threading.Event())
    w._issue(j, st, _Ev(), prep, False, "store")  # must not raise
    assert j.issued.is_set() and "injected (launch)" in j.error and j.end is None and st.syncs == 1
    w.jobs[1] = j
    w.mover.run = lambda p: "dma"
    j2 = _Job("store", 3, _Ev(), _Ev(), issued=threading.Event())
    w._issue(j2, st, _Ev(), prep, False, "store")
    assert j2.error is None and j2.end.records == 1
    w.jobs[2] = j2
    res = {r.job_id: r for r in w.get_finished()}
    assert res[1].ok is False and res[1].nbytes == 0 and res[2].ok and w.stats["failed_jobs"] == 1
    assert w._free_events[True] == [j.start, j2.start, j2.end]  # events back, the lost end not


def test_cpu_get_finished_reports_a_job_whose_query_raises_as_failed():
    """An event query that raises (a sticky CUDA error) made get_finished raise, and every later
    call raise again (the job stayed). Now that job is reported failed, the others as usual."""
    from connector.worker import _ISSUED, _Job

    w, _ = _bare_worker()
    w.jobs[1] = _Job("load", 8, _Ev(), _Ev(query_raises=True), issued=_ISSUED)
    w.jobs[2] = _Job("load", 8, _Ev(), _Ev(), issued=_ISSUED)
    res = {r.job_id: r for r in w.get_finished()}
    assert sorted(res) == [1, 2] and res[1].ok is False and "injected (query)" in res[1].error and res[2].ok
    assert w.get_finished() == [] and not w.jobs


class _FailedTicketSubmitter:
    """A DmaSubmitter stand-in whose every job failed on the thread (query -1, synchronize raises)."""

    def __init__(self):
        self.released = []

    def query(self, ticket):
        return -1

    def synchronize(self, ticket):
        raise RuntimeError("kernels/csrc/bindings.cu: cudaErrorUnknown: injected")

    def wait_issued(self, ticket):
        pass

    def error(self, ticket):
        return "cudaErrorUnknown: injected"

    def elapsed_ms(self, ticket):
        raise AssertionError("a failed job has no time")

    def release(self, ticket):
        self.released.append(ticket)

    def hold(self):
        pass

    def release_hold(self):
        pass

    def stop(self):
        pass


def test_cpu_wait_and_shutdown_on_a_failed_native_job_do_not_raise():
    """wait() on a failed native job raised the job's CUDA error out of wait (a flush on
    preemption); now the error stays on the job and get_finished / shutdown report it failed."""
    from connector.worker import _ISSUED, _Job

    w, _ = _bare_worker()
    w._native = _FailedTicketSubmitter()
    w.jobs[1] = _Job("store", 8, None, None, None, _ISSUED, 11)
    w.jobs[2] = _Job("store", 8, None, None, None, _ISSUED, 12)
    w.wait([1])  # must not raise
    res = w.get_finished()
    assert [(r.job_id, r.ok) for r in res] == [(1, False), (2, False)] and "injected" in res[0].error
    w.jobs[3] = _Job("load", 8, None, None, None, _ISSUED, 13)
    res = w.shutdown(drain=True)
    assert [(r.job_id, r.ok) for r in res] == [(3, False)] and w._native.released == [11, 12, 13]
