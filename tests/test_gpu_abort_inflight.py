"""A request aborted while its load or store is in flight: its GPU and host blocks are released
only after the copy finished (issue 37, item 1), with REAL asynchronous copies on the GPU.

How the copies are held in flight. Every job runs on the worker's own store / load stream
(TransferWorker.store_stream / load_stream; DMA lanes and the staged pipeline fork from it), so
a `Gate` -- torch.cuda._sleep on that stream, GATE_MS long (default 1.5 s), followed by an event --
queued BEFORE the submit holds the job's copy behind it. At the abort point each test ASSERTS that
the copy has not run yet: the gate's event query is False, the job is not in get_finished, and its
destination still holds its poison. The compute stream and the test's side streams are not gated:
work there runs at once, which is what makes a missing wait show up deterministically (below).

Direct tests (TransferWorker + BlockManager; 2 MiB unified blocks; every submit strategy: native
C++ thread, inline, Python async thread; unified DMA blocks and per-layer pack layouts):

  test_store_in_flight_of_an_aborted_request
    The aborted request's store job is in flight. (a) Host side: while it is, the BlockManager
    hands none of its slots to other stores under pressure, evicts none, and its keys are no hit.
    (b) GPU side: vLLM 0.26-0.33 fences the reuse of its source blocks through jobs_to_flush ->
    worker wait(); right after our wait() returns, the test overwrites the source blocks with
    poison on a side stream that waits for nothing, then loads the stored slots back into other
    (poisoned) blocks: bit-exact equal to the original random non-zero bytes (and, unified, the
    host rows themselves are). Fails on a wait() that returns without synchronising: the poison
    runs at once while the gated copy reads the source a second later, so the slots hold poison;
    also the gate is still closed when such a wait returns (asserted).
  test_load_in_flight_of_an_aborted_request
    The aborted request's load job is in flight. (a) Its host slots are pinned: never handed out,
    never evicted, still ready, under the same pressure. (b) vLLM frees an aborted-during-load
    request's GPU blocks when the job is reported (finished_recving): at that moment the blocks
    hold the loaded bytes; the test then writes them at once on a side stream (their next owner)
    and, after a device synchronize, they hold that write, not the load's bytes. Fails on a worker
    that reports a load before its copy ran: the gated copy lands after the write.
  test_store_negative_control_no_op_wait, test_load_negative_control_early_report
    The two failures above made on purpose on the GPU (wait() a no-op; get_finished reporting the
    load at once): the checks of the two tests see them (poison loaded back; the write lost).

test_cpu_model_of_the_direct_scenarios (CPU, no marker): the two scenarios above run against a
CPU model of the worker's stream contract (_ModelWorker: a copy runs when no gate holds its
stream, reading / writing the buffers as they are then): their bookkeeping checks pass, a correct
worker passes their GPU-side checks and the two broken ones fail them. It checks the tests' logic
and every helper they call, not the GPU.

Through vLLM's real scheduler and connector classes (tests/vllm_harness.py, KVOffloadConnector;
marker vllm too): with device="cuda" the harness runs our KVOffloadWorker's TransferWorker on CUDA
tensors (the gate on its stream); without CUDA the same scenarios run on CPU tensors with
`_OneStepCopies`, a stand-in copy engine that completes a job one engine step after its submit or
at wait() (the CPU worker itself copies synchronously, so nothing would be in flight):

  test_vllm_store_in_flight_abort_flush_waits[cuda|cpu]
    Request a's store (submitted at the start of the step after its prefill, as vLLM defers
    stores) is in flight when a is aborted (asserted). The scheduler's manager keeps its keys
    pending and its slots out of any other store; request b then gets a's freed GPU blocks, vLLM
    puts the job into jobs_to_flush, and our wait() is called while the copy is in flight and
    returns only after it finished (asserted around the call); b's compute then overwrites the
    blocks. Request c with a's prompt later loads a's blocks back: bit-exact.
  test_vllm_store_flush_negative_control[cuda|cpu]
    The same with our wait() a no-op: c loads b's bytes for the blocks b overwrote (the scenario's
    final check fails), i.e. the positive test above can fail and the fence it checks matters.
  test_vllm_load_in_flight_abort_frees_after_copy[cuda|cpu]
    Request b's load is in flight when b is aborted; vLLM keeps b (and its blocks) until our worker
    reports the job; the host slots stay pinned in the manager; when it is reported the blocks
    hold the loaded bytes, and a write right after it is what stays.
  test_vllm_load_report_negative_control_cpu
    The CPU stand-in made to report a load one step before its copy: the write right after the
    report is overwritten by the late copy (the final check fails).

Every test has a hard time limit (faulthandler kills the run with every thread's traceback after
LIMIT_S, default 180 s) and every poll for a job's report is bounded (POLL_S), so a copy that never
finishes fails the test instead of hanging it (a blocking wait() that never returns is ended by
the time limit). On the H200:
    python -m pytest -q -rs tests/test_gpu_abort_inflight.py        (1-2 minutes; 17 gates of 1.5 s)
Under compute-sanitizer memcheck: `bash profiling/device_run.sh abortsan` (KVO_ABORT_SANITIZER=1).
"""
from __future__ import annotations

import contextlib
import copy
import faulthandler
import os
import sys
import time
from typing import Optional

import numpy as np
import pytest
import torch

from connector.block_manager import BlockManager
from kernels import native
from tests.conftest import HAS_CUDA

LIMIT_S = float(os.environ.get("KVO_ABORT_TEST_LIMIT_S", "180"))  # per test
GATE_MS = float(os.environ.get("KVO_ABORT_GATE_MS", "1500"))      # how long a gate holds its stream
POLL_S = 60.0                                                     # a bounded wait for one job's report
# Under compute-sanitizer (profiling/device_run.sh abortsan), which runs kernels one at a time and
# slows everything, a GPU read inside a held window waits for the gate and a gate can run out
# before the host looks: the window cannot be observed there. Set, the tests run every path to its
# final checks (what the sanitizer inspects) and judge no in-window observation (Gate.holds is
# False) and no negative control; the ordinary GPU run judges those.
SANITIZER = os.environ.get("KVO_ABORT_SANITIZER") == "1"
_NOT_UNDER_SANITIZER = pytest.mark.skipif(SANITIZER, reason="a negative control needs the window observed "
                                                            "(not under compute-sanitizer: KVO_ABORT_SANITIZER)")

_GPU = pytest.mark.skipif(not (HAS_CUDA and native.AVAILABLE), reason="needs CUDA and kernels._C")


def _vllm_supported() -> bool:
    try:
        from connector import vllm_compat  # noqa: F401  (ImportError outside the supported range)
    except Exception:
        return False
    return True


_VLLM = pytest.mark.skipif(not _vllm_supported(), reason="vLLM not importable or outside the supported range")


@pytest.fixture(autouse=True)
def _time_limit():
    """A hang (a copy that never finishes, a wait that never returns) kills the run with every
    thread's traceback after LIMIT_S instead of blocking it."""
    faulthandler.dump_traceback_later(LIMIT_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


# ----------------------------------------------------------------------------- the gate
_CYCLES_PER_MS: list = []


def _cycles_per_ms() -> float:
    """torch.cuda._sleep cycles per millisecond on this GPU (measured once, on a side stream; the
    fastest of three, so a run slowed by another process on the GPU never shortens the gates)."""
    if not _CYCLES_PER_MS:
        s = torch.cuda.Stream()
        ms = []
        for _ in range(3):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(s):
                torch.cuda._sleep(1_000_000)  # warm-up
                e0.record(s)
                torch.cuda._sleep(50_000_000)
                e1.record(s)
            e1.synchronize()
            ms.append(e0.elapsed_time(e1))
        _CYCLES_PER_MS.append(50_000_000 / max(min(ms), 1e-3))
    return _CYCLES_PER_MS[0]


class Gate:
    """Holds `stream` for `ms` milliseconds: a sleep kernel queued on it, then an event. Work
    queued on the stream after it (a job's copies) runs only once the gate has run out."""

    def __init__(self, stream: torch.cuda.Stream, ms: float = GATE_MS):
        cycles = int(ms * _cycles_per_ms())
        self.ms = ms
        self.event = torch.cuda.Event()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)
            self.event.record(stream)
        self.t0 = time.monotonic()

    def is_open(self) -> bool:
        return bool(self.event.query())

    def holds(self, where: str) -> bool:
        """Whether what was observed before this call was observed inside the window, so the
        caller judges it: the gate must still be closed (else the test fails, see
        assert_closed). False under SANITIZER: nothing in the window is judged there."""
        if SANITIZER:
            return False
        self.assert_closed(where)
        return True

    def assert_closed(self, where: str) -> None:
        if SANITIZER:  # the window is not judged there (SANITIZER)
            return
        assert not self.is_open(), (
            f"{where}: the gate ({self.ms:.0f} ms) had already run out {time.monotonic() - self.t0:.3f} s after "
            f"it was queued, so the copy may have finished: the window is not certain (raise KVO_ABORT_GATE_MS)")


# ----------------------------------------------------------------------------- direct tests
MODES = {"native": dict(native_submit=True), "inline": dict(native_submit=False),
         "async": dict(async_submit=True, native_submit=False)}
NB, NS, N = 96, 64, 24   # GPU blocks, host slots, blocks per job (2 MiB each: 48 MiB a job)


class _Env:
    """A KV cache of NB random non-zero 2 MiB blocks (bf16, 32 layers x 8 heads x 128 x 16 tokens),
    a pinned HostPool of NS slots, a TransferWorker in `mode`, and helpers that read / write GPU
    blocks on a side stream that waits for nothing (never on the gated worker streams, never a
    device-wide synchronize)."""

    def __init__(self, layout: str, mode: str):
        from connector import TransferWorker
        from connector.host_pool import HostPool
        from kernels import BlockCopier
        from layout import KVBlockMover, KVLayout, KVSpec, UnifiedKVCache, allocate

        dev = torch.device("cuda", torch.cuda.current_device())
        spec = KVSpec(32, 8, 128, 16)  # bf16: 64 KiB a layer, 2 MiB a unified block
        cp = BlockCopier(dev)          # its own copier: nothing shared with other tests
        if layout == "unified":
            c = UnifiedKVCache(spec, NB, device=dev)
            c.buffer.random_(1, 255)
            self.mover = KVBlockMover(spec, KVLayout.NB_NL_TWO_BS_NH_HS, c.unified(), copier=cp)
            self.views = [(c.buffer, 0)]  # uint8 [NB, ub]: a block is a row
            self.rows = c.buffer
        else:
            kv = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, NB, device=dev,
                          fill=lambda t: t.view(-1).view(torch.uint8).random_(1, 255))
            self.mover = KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv, copier=cp)
            self.views = [(t.view(torch.uint8), 1) for t in kv]  # [2, NB, BS, H, 2*D] bytes: blocks on dim 1
            self.rows = None
        self.ub = self.mover.unified_block_bytes
        assert self.ub == 2 << 20
        self.pool = HostPool(NS, self.ub, dev, background=False)
        assert self.pool.pinned, self.pool.error
        self.host = self.pool.tensor
        self.w = TransferWorker(self.mover, self.host, **MODES[mode])
        self.side = torch.cuda.Stream(dev)

    def read(self, ids) -> list:
        """The bytes of GPU blocks `ids`, on the host (read on the side stream)."""
        self.side.wait_stream(torch.cuda.current_stream())  # after the set-up's writes (no host wait)
        with torch.cuda.stream(self.side):
            idx = torch.as_tensor(np.asarray(ids, np.int64), device="cuda")
            return [t.index_select(d, idx).cpu() for t, d in self.views]

    def fill(self, ids, value: int, sync: bool = True) -> None:
        """Writes `value` into every byte of GPU blocks `ids` on the side stream (which waits for
        nothing: a job still queued on a worker stream does not hold it back)."""
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            idx = torch.as_tensor(np.asarray(ids, np.int64), device="cuda")
            for t, d in self.views:
                t.index_fill_(d, idx, value)
        if sync:
            self.side.synchronize()

    def results(self, job_ids, timeout: float = POLL_S) -> dict:
        """Polls get_finished until every job in job_ids is reported (bounded: never hangs)."""
        want, got = set(job_ids), {}
        deadline = time.monotonic() + timeout
        while not want <= got.keys():
            for r in self.w.get_finished():
                got[r.job_id] = r
            assert time.monotonic() < deadline, f"jobs {sorted(want - got.keys())} never reported"
            time.sleep(0.0005)
        return got

    def close(self) -> None:
        self.w.shutdown(drain=True)
        self.pool.close()


def _equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _all_bytes(parts: list, value: int) -> bool:
    return all(bool((p == value).all()) for p in parts)


def _pressure(bm: BlockManager, busy: set, keys_busy: list, tag: str, rounds: int = 4) -> None:
    """Other requests store under pressure (more keys than the pool holds, each completed so it
    becomes evictable): none may get a slot in `busy` or evict a key of `keys_busy`."""
    for r in range(rounds):
        plan = bm.prepare_store([(tag, r, j) for j in range(bm.capacity)])
        assert not busy & set(plan.slots), f"round {r}: a slot of the in-flight copy was handed out"
        assert not set(keys_busy) & set(plan.evicted), f"round {r}: a key of the in-flight copy was evicted"
        bm.complete_store(plan.hashes)
    for k in keys_busy:
        assert k in bm.blocks and bm.blocks[k].slot in busy


def _warm(env: _Env) -> None:
    """One ungated round trip first: first-use costs (kernel loads, the submit thread, lanes)
    stay out of the gated window, and the path is shown to work at all."""
    src, slots = np.arange(N, dtype=np.int64), np.arange(N, dtype=np.int64)
    want = env.read(src)
    assert env.w.submit_store(901, src, slots)
    env.w.wait([901])
    dst = np.arange(N, 2 * N, dtype=np.int64)
    env.fill(dst, 0x11)
    assert env.w.submit_load(902, slots, dst)
    env.w.wait([902])
    res = env.results([901, 902])
    assert res[901].ok and res[902].ok, res
    assert _equal(env.read(dst), want), "warm-up round trip not exact"


def _store_scenario(layout: str, mode: str, broken_wait: bool = False) -> dict:
    """Store in flight, request aborted (test_store_in_flight_of_an_aborted_request). Asserts the
    in-flight window and the host-side bookkeeping; returns what the GPU side observed.
    broken_wait: the worker's wait() replaced by a no-op (the negative control)."""
    env = _Env(layout, mode)
    try:
        w, host = env.w, env.host
        _warm(env)
        if broken_wait:
            w.wait = lambda job_ids: None
        rng = np.random.default_rng(37)
        src = rng.permutation(NB)[:N].astype(np.int64)
        bm = BlockManager(NS)  # the scheduler's host-pool bookkeeping
        keys = [("aborted", i) for i in range(N)]
        plan = bm.prepare_store(keys)
        slots = np.asarray(plan.slots, np.int64)
        busy = set(plan.slots)
        host[torch.from_numpy(slots)] = 0xA5  # the job's destination, poisoned
        want = env.read(src)
        gate = Gate(w.store_stream)
        assert w.submit_store(1, src, slots) is True
        # ---- the abort point: the request is gone, its store job is not
        early = [r.job_id for r in w.get_finished()]
        poisoned = bool((host[torch.from_numpy(slots)] == 0xA5).all())
        if gate.holds("at the abort"):
            assert 1 not in early, "the store was reported finished while its copy was held"
            assert poisoned, "the held copy already wrote host slots"
        # (a) its host slots: never handed out, never evicted, never a hit while it is in flight
        assert bm.lookup(keys) == 0
        _pressure(bm, busy, keys, "other")
        gate.assert_closed("after the host-side checks")
        # (b) its GPU blocks are reused: vLLM flushes the job first (jobs_to_flush -> wait)
        w.wait([1])
        opened = gate.is_open()
        env.fill(src, 0x5A)  # the blocks' next owner writes them at once, on a stream that waits for nothing
        r = env.results([1])[1]
        assert r.ok and r.nbytes == N * env.ub, r
        bm.complete_store(keys, r.ok)
        assert bm.lookup(keys) == N
        host_exact = torch.equal(host[torch.from_numpy(slots)], want[0]) if env.rows is not None else None
        # load the stored slots back into other, poisoned blocks
        dst = np.setdiff1d(np.arange(NB), src)[:N].astype(np.int64)
        env.fill(dst, 0x3C)
        ls = np.asarray(bm.prepare_load(keys), np.int64)
        assert w.submit_load(2, ls, dst)
        w.wait([2])
        env.results([2])  # polled too: with the no-op wait() of the control, the report says when it is done
        bm.complete_load(keys)
        back = env.read(dst)
        return dict(opened=opened, host_exact=host_exact, back_exact=_equal(back, want),
                    back_poison=_all_bytes(back, 0x5A), src_poison=_all_bytes(env.read(src), 0x5A))
    finally:
        env.close()


def _load_scenario(layout: str, mode: str, broken_report: bool = False) -> dict:
    """Load in flight, request aborted (test_load_in_flight_of_an_aborted_request). Asserts the
    in-flight window and the host-side bookkeeping; returns what the GPU side observed.
    broken_report: get_finished reports the load at once, before its copy ran (the negative control)."""
    from connector.worker import JobResult

    env = _Env(layout, mode)
    try:
        w = env.w
        _warm(env)
        rng = np.random.default_rng(38)
        src = rng.permutation(NB)[:N].astype(np.int64)
        bm = BlockManager(NS)
        keys = [("stored", i) for i in range(N)]
        plan = bm.prepare_store(keys)
        assert w.submit_store(1, src, np.asarray(plan.slots, np.int64))
        w.wait([1])
        assert env.results([1])[1].ok
        bm.complete_store(keys)
        want = env.read(src)
        dst = np.setdiff1d(np.arange(NB), src)[:N].astype(np.int64)
        env.fill(dst, 0x3C)  # the load's destination, poisoned
        slots = np.asarray(bm.prepare_load(keys), np.int64)  # pins them
        busy = set(slots.tolist())
        gate = Gate(w.load_stream)
        assert w.submit_load(2, slots, dst) is True
        # ---- the abort point: the request is gone, its load job is not
        early = [r.job_id for r in w.get_finished()]
        held = None if SANITIZER else env.read(dst)  # (SANITIZER: a GPU read would wait for the gate)
        if gate.holds("at the abort (the destination read)"):
            assert 2 not in early, "the load was reported finished while its copy was held"
            assert held is None or _all_bytes(held, 0x3C), "the held load already wrote its GPU blocks"
        # (a) the host slots it reads: still ready, never handed out, never evicted
        _pressure(bm, busy, keys, "other")
        assert all(bm.is_ready(k) for k in keys)
        gate.assert_closed("after the host-side checks")
        if broken_report:
            real = w.get_finished
            w.get_finished = lambda: [JobResult(2, "load", True, N * env.ub, 0.0)] + real()
        # (b) vLLM frees the aborted request's GPU blocks when the job is reported (finished_recving)
        r = env.results([2])[2]
        opened = gate.is_open()
        at_report = env.read(dst)
        env.fill(dst, 0x77, sync=False)  # the blocks' next owner writes them at once
        torch.cuda.synchronize()         # whatever was still queued has landed now
        final = env.read(dst)
        assert r.ok and r.nbytes == N * env.ub, r
        bm.complete_load(keys)
        # unpinned now: an ordinary evictable block again
        plan = bm.prepare_store([("after", j) for j in range(bm.capacity)])
        assert busy & set(plan.slots)
        return dict(opened=opened, at_report_exact=_equal(at_report, want), final_written=_all_bytes(final, 0x77),
                    final_loaded=_equal(final, want))
    finally:
        env.close()


@pytest.mark.gpu
@_GPU
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("layout", ["unified", "per_layer"])
def test_store_in_flight_of_an_aborted_request(layout, mode):
    r = _store_scenario(layout, mode)
    assert r["opened"], "wait() returned while the store's copy was still held behind the gate"
    assert r["host_exact"] in (True, None), "host slots differ from the source blocks"
    assert r["back_exact"], "the stored copy is not the source's bytes (the poison raced the store?)"
    assert r["src_poison"]


@pytest.mark.gpu
@_GPU
@_NOT_UNDER_SANITIZER
def test_store_negative_control_no_op_wait():
    """wait() a no-op: it returns with the gate closed, and the poison written right after it
    reaches the held store, so the slots load back poison instead of the source's bytes."""
    r = _store_scenario("unified", "native", broken_wait=True)
    assert not r["opened"], "a no-op wait() returned after the gate: the window was not held"
    assert r["host_exact"] is False and not r["back_exact"] and r["back_poison"], r


@pytest.mark.gpu
@_GPU
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("layout", ["unified", "per_layer"])
def test_load_in_flight_of_an_aborted_request(layout, mode):
    r = _load_scenario(layout, mode)
    assert r["opened"], "the load was reported finished while its copy was still held behind the gate"
    assert r["at_report_exact"], "when reported, the load's blocks did not hold the loaded bytes"
    assert r["final_written"], "a write made after the load was reported was overwritten by the load"


@pytest.mark.gpu
@_GPU
@_NOT_UNDER_SANITIZER
def test_load_negative_control_early_report():
    """get_finished reports the load before its copy ran: the write made right after the report
    is overwritten by the late copy, which the checks above see."""
    r = _load_scenario("unified", "native", broken_report=True)
    assert not r["opened"] and not r["at_report_exact"], r
    assert not r["final_written"] and r["final_loaded"], r


# ----------------------------------------------------------------------------- a CPU model of the above
class _ModelStream:
    def __init__(self):
        self.gates: list = []


class _ModelGate(Gate):
    """Gate in the CPU model: closed until time passes for its stream: a host wait on a job
    there (wait), a device synchronize, or a few get_finished polls."""

    POLLS = 3

    def __init__(self, stream, ms: float = GATE_MS):
        self.ms, self.t0, self.polls, self.opened = ms, time.monotonic(), 0, False
        stream.gates.append(self)

    def is_open(self) -> bool:
        return self.opened


class _ModelWorker:
    """TransferWorker's contract on CPU tensors: a job's copy runs when no closed gate holds its
    stream (at the copy's time, reading / writing whatever the buffers hold then); it is reported
    by get_finished only after it ran; wait() returns only after it ran."""

    last: Optional["_ModelWorker"] = None  # the latest one: a device synchronize lets time pass for it

    def __init__(self, env):
        self.env, self.store_stream, self.load_stream = env, _ModelStream(), _ModelStream()
        self.jobs: dict = {}  # job id -> [kind, stream, gpu ids, slot ids, done]
        _ModelWorker.last = self

    def _submit(self, job_id, kind, blocks, slots) -> bool:
        self.jobs[job_id] = [kind, self.store_stream if kind == "store" else self.load_stream, blocks, slots, False]
        self._progress()
        return True

    def submit_store(self, job_id, block_ids, slot_ids):
        return self._submit(job_id, "store", block_ids, slot_ids)

    def submit_load(self, job_id, slot_ids, block_ids):
        return self._submit(job_id, "load", block_ids, slot_ids)

    def _progress(self) -> None:
        rows, host = self.env.rows, self.env.host
        for j in self.jobs.values():
            if not j[4] and all(g.opened for g in j[1].gates):
                b, s = torch.as_tensor(j[2]), torch.as_tensor(j[3])
                if j[0] == "store":
                    host[s] = rows[b]
                else:
                    rows[b] = host[s]
                j[4] = True

    @staticmethod
    def synchronize(*_) -> None:
        """torch.cuda.synchronize in the model: every gate runs out, every queued copy runs."""
        w = _ModelWorker.last
        w._pass_time((w.store_stream, w.load_stream))

    def _pass_time(self, streams) -> None:
        for st in streams:
            for g in st.gates:
                g.opened = True
        self._progress()

    def get_finished(self) -> list:
        from connector.worker import JobResult

        for st in (self.store_stream, self.load_stream):
            for g in st.gates:
                g.polls += 1
                g.opened |= g.polls >= _ModelGate.POLLS
        self._progress()
        out = [JobResult(k, j[0], True, len(j[2]) * self.env.ub, 0.0) for k, j in self.jobs.items() if j[4]]
        for r in out:
            del self.jobs[r.job_id]
        return out

    def wait(self, job_ids) -> None:
        self._pass_time({self.jobs[j][1] for j in job_ids if j in self.jobs})

    def shutdown(self, drain: bool = True) -> list:
        self._pass_time((self.store_stream, self.load_stream))
        return self.get_finished()


class _ModelEnv(_Env):
    """_Env in the CPU model: unified blocks of 64 random non-zero bytes, a _ModelWorker."""

    def __init__(self, layout: str, mode: str):
        g = torch.Generator().manual_seed(0)
        self.ub = 64
        self.rows = torch.randint(1, 255, (NB, self.ub), dtype=torch.uint8, generator=g)
        self.views = [(self.rows, 0)]
        self.host = torch.zeros(NS, self.ub, dtype=torch.uint8)
        self.w = _ModelWorker(self)

    def read(self, ids) -> list:
        return [t.index_select(d, torch.as_tensor(np.asarray(ids, np.int64))).clone() for t, d in self.views]

    def fill(self, ids, value: int, sync: bool = True) -> None:
        for t, d in self.views:
            t.index_fill_(d, torch.as_tensor(np.asarray(ids, np.int64)), value)

    def close(self) -> None:
        self.w.shutdown()


def test_cpu_model_of_the_direct_scenarios(monkeypatch):
    """The two GPU scenarios above, run against a CPU model of the worker's stream semantics
    (_ModelWorker, _ModelGate): their host-side bookkeeping checks pass, and their GPU-side
    observations separate a correct worker from the two broken ones exactly as the GPU tests
    expect. A model, not evidence about the GPU: it checks the tests' own logic (and that every
    helper they call runs) before the one GPU run."""
    monkeypatch.setattr(sys.modules[__name__], "_Env", _ModelEnv)
    monkeypatch.setattr(sys.modules[__name__], "Gate", _ModelGate)
    monkeypatch.setattr(torch.cuda, "synchronize", _ModelWorker.synchronize)
    assert _store_scenario("unified", "model") == dict(opened=True, host_exact=True, back_exact=True,
                                                       back_poison=False, src_poison=True)
    r = _store_scenario("unified", "model", broken_wait=True)
    assert not r["opened"] and r["host_exact"] is False and not r["back_exact"] and r["back_poison"], r
    assert _load_scenario("unified", "model") == dict(opened=True, at_report_exact=True, final_written=True,
                                                      final_loaded=False)
    r = _load_scenario("unified", "model", broken_report=True)  # the late copy lands at the synchronize
    assert not r["opened"] and not r["at_report_exact"], r
    assert not r["final_written"] and r["final_loaded"], r


# ----------------------------------------------------------------------------- through vLLM
CLASS = dict(kv_connector="KVOffloadConnector", kv_connector_module_path="connector.vllm_adapter",
             kv_role="kv_both", kv_connector_extra_config={"cpu_bytes_to_use": 1 << 22})
PROMPT_A = list(range(1, 70))     # 4 full blocks + 5 tokens
PROMPT_B = list(range(500, 569))  # another 4 + 5
DEVICES = [pytest.param("cuda", marks=[pytest.mark.gpu, _GPU]), "cpu"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.vllm_harness import make_model_dir

    return make_model_dir(str(tmp_path_factory.mktemp("tinyllama")))


class _OneStepCopies:
    """CPU stand-in for an asynchronous copy engine, around KVOffloadWorker's CPU path (which
    copies synchronously at submit): a submitted job's copy runs, and its result is queued, only
    when the job completes: at wait() on it, or at the second get_finished after its submit (a
    copy takes one engine step). report_loads_early: a broken worker that reports a load at
    that point but copies it one get_finished later (the load negative control)."""

    def __init__(self, w, report_loads_early: bool = False):
        from vllm.v1.kv_offload.base import TransferResult

        self.w, self.early, self.TR = w, report_loads_early, TransferResult
        self.store, self.load, self.finished, self.real_wait = w.submit_store, w.submit_load, w.get_finished, w.wait
        self.pending: dict = {}  # job id -> [submit call, get_finished calls seen]
        self.late: list = []     # loads reported but not copied yet (report_loads_early)
        w.submit_store, w.submit_load, w.get_finished, w.wait = self._store, self._load, self._finished, self._wait

    def _store(self, job_id, src, dst):
        self.pending[job_id] = [lambda: self.store(job_id, src, dst), 0]
        return True

    def _load(self, job_id, src, dst, expedited=False):
        self.pending[job_id] = [lambda: self.load(job_id, src, dst), 0, True]
        return True

    def _run(self, job_id) -> None:
        self.pending.pop(job_id)[0]()  # the copy now; the worker queues its result

    def _wait(self, ids) -> None:
        for j in list(ids):
            if j in self.pending:
                self._run(j)
        self.real_wait(ids)

    def _finished(self):
        fake = []
        for call in self.late:  # broken worker: the copy of a load reported one call ago
            call()
            self.w._finished.pop()  # reported already
        self.late = []
        for j, p in list(self.pending.items()):
            p[1] += 1
            if p[1] >= 2:
                if self.early and len(p) == 3:
                    self.late.append(self.pending.pop(j)[0])
                    fake.append(self.TR(j, True, None, None))
                else:
                    self._run(j)
        return self.finished() + fake


def _harness(model_dir, device: str, num_gpu_blocks: int, report_loads_early: bool = False):
    from tests.vllm_harness import Harness

    h = Harness(model_dir, CLASS, num_gpu_blocks=num_gpu_blocks, device=device)
    w = h.worker.connector_worker.worker
    sim = None
    if device == "cuda":
        assert w.tw is not None, "the CUDA harness must run our TransferWorker"
    else:
        assert w.tw is None
        sim = _OneStepCopies(w, report_loads_early)
    side = torch.cuda.Stream() if device == "cuda" else None
    return h, w, sim, side


def _on(side):
    return torch.cuda.stream(side) if side is not None else contextlib.nullcontext()


def _idle(h, w, sim) -> bool:
    sched = not h.scheduler.has_requests() and not h.scheduler.has_unfinished_requests()
    jobs = bool(w.tw.jobs) if w.tw is not None else bool(sim.pending or sim.late)
    return sched and not jobs


def _step_until(h, cond, what: str, timeout: float = POLL_S) -> None:
    """Engine steps until cond() (bounded: a job that never completes fails, never hangs)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        h.step()
        time.sleep(0.001)


def _block_expected(prompt, i: int) -> torch.Tensor:
    """What compute writes into the i-th full block of `prompt` (tests/vllm_harness.py
    fill_computed): [LAYERS, 2, BLOCK, HEADS, HEAD] of the harness's block-outer buffer."""
    from tests.vllm_harness import BLOCK, HEAD, HEADS, LAYERS, kv_value

    vals = torch.tensor([[kv_value(prompt[i * BLOCK + o], i * BLOCK + o, li) for o in range(BLOCK)]
                         for li in range(LAYERS)])  # [LAYERS, BLOCK]
    return vals[:, None, :, None, None].expand(LAYERS, 2, BLOCK, HEADS, HEAD).contiguous()


def _read_blocks(h, side, ids) -> torch.Tensor:
    """GPU blocks `ids` of the harness's buffer, on the host; read on the side stream (ordered
    after the compute stream's earlier writes, not after the worker's streams)."""
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
    with _on(side):
        return h.buf[torch.as_tensor(list(ids), device=h.buf.device)].cpu()


def _bad_blocks(h, side, ids, prompt) -> list:
    """Indices i for which block ids[i] does not hold prompt's block i as compute wrote it."""
    got = _read_blocks(h, side, ids)
    return [i for i in range(len(ids)) if not torch.equal(got[i], _block_expected(prompt, i))]


def _spy(w, name: str, log: list) -> None:
    real = getattr(w, name)

    def call(*a, **kw):
        log.append((name, a))
        return real(*a, **kw)

    setattr(w, name, call)


def _store_abort_scenario(model_dir, device: str, break_wait: bool) -> dict:
    """Request a prefills (its store job is built then and submitted at the start of the next
    step, as vLLM defers stores), is aborted while that store is in flight, and b takes a's freed
    GPU blocks. Returns what happened; the final check is c (a's prompt) loading a's blocks."""
    from vllm.v1.kv_offload.base import LookupResult
    from vllm.v1.request import RequestStatus

    h, w, sim, side = _harness(model_dir, device, num_gpu_blocks=7)  # 6 usable: b must reuse a's
    m = h.connector.connector_scheduler.manager
    log: list = []
    _spy(w, "submit_store", log)
    _spy(w, "submit_load", log)
    if break_wait:  # the negative control: a wait() that returns at once
        w.wait = lambda ids: None
    waits: list = []
    real_wait = w.wait
    gate = None
    ctx: dict = {}  # the job, its slots and what they must hold, once known

    def stored() -> bool:
        """Whether a's store job has written a's bytes into its host slots (read on the host)."""
        got = w.host[torch.as_tensor(ctx["slots"])].view(ctx["want"].dtype).view(ctx["want"].shape)
        return torch.equal(got, ctx["want"])

    def in_flight() -> bool:
        held = ctx["job"] in sim.pending if sim is not None else not gate.is_open()
        return held and not stored()

    def spy_wait(ids):
        before = in_flight() if ctx.get("job") in ids else None
        if gate is not None and ctx.get("job") in ids:
            ctx["wait_at"] = f"wait entered {time.monotonic() - gate.t0:.3f} s after the {gate.ms:.0f} ms gate was queued"
        real_wait(ids)
        if ctx.get("job") in ids:
            waits.append((set(ids), before, stored()))

    w.wait = spy_wait
    h.add_request("a", PROMPT_A, max_tokens=8)
    h.step()  # a prefills; its store job is built now and submitted at the next step's start
    assert not [e for e in log if e[0] == "submit_store"], "vLLM submitted the store in the prefill step"
    if device == "cuda":
        # longer than the direct tests' gate: between the abort and b's step (where vLLM's flush
        # calls our wait) this scenario copies the block manager and plans a probe store; at
        # GATE_MS the first H200 run entered wait() with the gate already run out
        gate = Gate(w.tw.store_stream, ms=max(GATE_MS, 5000.0))
    h.step()  # the store is submitted (held behind the gate / one step in the stand-in); a decodes
    stores = [e[1] for e in log if e[0] == "submit_store"]
    assert len(stores) == 1, stores
    job, src_spec, dst_spec = stores[0]
    a_blocks, a_slots = [int(x) for x in src_spec.block_ids], [int(x) for x in dst_spec.block_ids]
    assert a_blocks == h.block_ids["a"][:4], (a_blocks, h.block_ids["a"])  # a's 4 full blocks, in order
    ctx.update(job=job, slots=a_slots, want=torch.stack([_block_expected(PROMPT_A, i) for i in range(4)]))
    h.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    # ---- the abort point: a's store job is in flight
    if device == "cuda":
        assert job in w.tw.jobs
    observed = in_flight()
    if gate is None or gate.holds("at the abort"):
        assert observed, "a's store finished before the abort: nothing was in flight"
    keys = [k for k, b in m.bm.blocks.items() if b.slot in set(a_slots)]
    assert len(keys) == len(a_slots) and all(m.lookup(k, None) == LookupResult.HIT_PENDING for k in keys)
    probe = copy.deepcopy(m.bm)  # the manager under pressure, without touching the engine's state
    plan = probe.prepare_store([("probe", j) for j in range(probe.capacity)])
    assert not set(a_slots) & set(plan.slots) and not set(keys) & set(plan.evicted)
    # ---- b takes a's freed blocks: vLLM flushes a's store (jobs_to_flush -> our wait) before b's compute
    h.add_request("b", PROMPT_B, max_tokens=1)
    so, _ = h.step()
    reused = set(h.block_ids["b"]) & set(a_blocks)
    flushed = set(getattr(so.kv_connector_metadata, "jobs_to_flush", None) or ())
    _step_until(h, lambda: _idle(h, w, sim), "the engine to go idle")
    # ---- c with a's prompt loads what a stored
    h.scheduler.reset_prefix_cache()
    h.buf.zero_()
    h.add_request("c", PROMPT_A, max_tokens=1)
    _step_until(h, lambda: _idle(h, w, sim), "c to finish")
    if device == "cuda":
        torch.cuda.synchronize()
    return dict(job=job, reused=reused, flushed=flushed, waits=waits, loaded="c" in h.finished_recving,
                wait_at=ctx.get("wait_at"),
                bad=_bad_blocks(h, side, h.block_ids["c"][:4], PROMPT_A), a_blocks=a_blocks)


@pytest.mark.vllm
@_VLLM
@pytest.mark.parametrize("device", DEVICES)
def test_vllm_store_in_flight_abort_flush_waits(model_dir, device):
    r = _store_abort_scenario(model_dir, device, break_wait=False)
    job = r["job"]
    assert r["reused"], "b did not get a's blocks: the scenario did not reuse them"
    assert job in r["flushed"], "vLLM did not flush a's store before reusing its blocks"
    assert r["waits"], "our wait() was never called for the flushed store"
    ids, before, after = r["waits"][0]
    assert before or SANITIZER, \
        f"wait() was called after the copy had finished: nothing was in flight ({r.get('wait_at')})"
    assert after, "wait() returned before the store's copy had written a's bytes to its host slots"
    assert r["loaded"] and r["bad"] == [], f"c loaded wrong bytes in blocks {r['bad']}"


@pytest.mark.vllm
@_VLLM
@_NOT_UNDER_SANITIZER
@pytest.mark.parametrize("device", DEVICES)
def test_vllm_store_flush_negative_control(model_dir, device):
    """wait() made a no-op: b's compute overwrites a's blocks before the held store reads them,
    so c loads b's bytes: the check the test above passes fails here."""
    r = _store_abort_scenario(model_dir, device, break_wait=True)
    assert r["reused"] and r["job"] in r["flushed"]
    assert r["loaded"] and r["bad"], "a no-op wait went unnoticed: the scenario cannot catch a missing fence"


def _load_abort_scenario(model_dir, device: str, report_early: bool) -> dict:
    """a's prompt is stored; b with the same prompt loads it and is aborted while the load is in
    flight; when the job is reported b's blocks are written at once (their next owner)."""
    from vllm.v1.request import RequestStatus

    h, w, sim, side = _harness(model_dir, device, num_gpu_blocks=40, report_loads_early=report_early)
    m = h.connector.connector_scheduler.manager
    log: list = []
    _spy(w, "submit_load", log)
    h.add_request("a", PROMPT_A, max_tokens=1)
    _step_until(h, lambda: _idle(h, w, sim), "a to be stored")
    assert m.bm.counters.stored_blocks == 4
    h.scheduler.reset_prefix_cache()
    h.buf.zero_()
    gate = Gate(w.tw.load_stream) if device == "cuda" else None
    h.add_request("b", PROMPT_A, max_tokens=1)
    h.step()  # b's load is submitted; b waits for it
    loads = [e[1] for e in log if e[0] == "submit_load"]
    assert len(loads) == 1, loads
    job, src_spec, dst_spec = loads[0]
    slots, blocks = [int(x) for x in src_spec.block_ids], [int(x) for x in dst_spec.block_ids]
    h.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    # ---- the abort point: b's load job is in flight
    if device == "cuda":
        assert job in w.tw.jobs
    else:
        assert job in sim.pending
    assert "b" not in h.finished_recving and "b" in h.scheduler.requests  # vLLM holds b and its blocks
    held = None if SANITIZER and device == "cuda" else _read_blocks(h, side, blocks)  # (a GPU read would wait there)
    if gate is None or gate.holds("at the abort (the blocks read)"):
        assert bool((held == 0).all()), "the held load already wrote its blocks"
    keys = [k for k, b in m.bm.blocks.items() if b.slot in set(slots)]
    assert len(keys) == len(slots) and all(m.bm.blocks[k].refs > 0 and m.bm.blocks[k].ready for k in keys)
    probe = copy.deepcopy(m.bm)
    plan = probe.prepare_store([("probe", j) for j in range(probe.capacity)])
    assert not set(slots) & set(plan.slots) and not set(keys) & set(plan.evicted)
    # ---- vLLM frees b's blocks when our worker reports the job (finished_recving)
    _step_until(h, lambda: "b" in h.finished_recving, "b's load to be reported")
    opened = gate.is_open() if gate is not None else None
    freed = "b" not in h.scheduler.requests
    at_report = _bad_blocks(h, side, blocks, PROMPT_A)
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
    with _on(side):  # the blocks' next owner writes them at once (no stream waits for a load)
        h.buf[torch.as_tensor(blocks, device=h.buf.device)] = -7.0
    if device == "cuda":
        torch.cuda.synchronize()  # whatever was still queued has landed now
    else:
        h.step()  # a late copy of the stand-in would land now
    final = _read_blocks(h, side, blocks)
    _step_until(h, lambda: _idle(h, w, sim), "the engine to go idle")
    return dict(opened=opened, freed=freed, at_report=at_report, overwritten=not bool((final == -7.0).all()),
                refs=[m.bm.blocks[k].refs for k in keys if k in m.bm.blocks])


@pytest.mark.vllm
@_VLLM
@pytest.mark.parametrize("device", DEVICES)
def test_vllm_load_in_flight_abort_frees_after_copy(model_dir, device):
    r = _load_abort_scenario(model_dir, device, report_early=False)
    if device == "cuda":
        assert r["opened"], "the load was reported while its copy was still held behind the gate"
    assert r["freed"], "vLLM did not free the aborted request when its load was reported"
    assert r["at_report"] == [], f"when reported, blocks {r['at_report']} did not hold the loaded bytes"
    assert not r["overwritten"], "a write made after the load was reported was overwritten by the load"
    assert r["refs"] and not any(r["refs"]), "the load's host slots stayed pinned"


@pytest.mark.vllm
@_VLLM
def test_vllm_load_report_negative_control_cpu(model_dir):
    """A worker that reports a load before its copy ran (the stand-in, broken on purpose): the
    write made right after the report is overwritten by the late copy, which the test sees."""
    r = _load_abort_scenario(model_dir, "cpu", report_early=True)
    assert r["freed"]
    assert r["overwritten"], "a load reported before its copy went unnoticed"
