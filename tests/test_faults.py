"""Faults around the copies (issue 37): a full pool, aborts with copies in flight, pinning and
/dev/shm failures, a rank killed in the middle of a store into a shared pool, regressions for
vLLM's own offloading bugs, and a stress of the staged H2D path (GPU).

Every test runs under a time limit (`limit`, SIGALRM; subprocesses joined with a timeout):
an injected fault must end in a failed job or a clear error, never a hang.
"""
from __future__ import annotations

import functools
import multiprocessing as mp
import os
import signal
import time
import uuid
import warnings

import numpy as np
import pytest
import torch

import connector.host_pool as hp
from connector.block_manager import BlockManager
from connector.host_pool import HostPool, HostPoolError
from connector.tp import CellCommits, CommittedWorker, rank_cells, row_bytes
from connector.worker import JobResult


def limit(seconds: int):
    """Fails the test (instead of hanging CI) if it runs longer than `seconds`."""
    def deco(fn):
        @functools.wraps(fn)
        def run(*a, **kw):
            def boom(*_):
                raise TimeoutError(f"{fn.__name__} exceeded its {seconds} s limit")
            old = signal.signal(signal.SIGALRM, boom)
            signal.alarm(seconds)
            try:
                return fn(*a, **kw)
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, old)
        return run
    return deco


# ---------------------------------------------------------------------------- pool full
@limit(30)
def test_pool_full_stores_skipped_and_loading_blocks_never_evicted():
    bm = BlockManager(4)
    p = bm.prepare_store(["a", "b", "c", "d"])
    bm.complete_store(p.hashes)
    slots = dict(zip("abcd", p.slots))
    assert bm.prepare_load(["a", "c"]) == [slots["a"], slots["c"]]  # loads in flight
    plan = bm.prepare_store(["e", "f", "g"])
    # two unpinned victims (b, d), then no room: g is skipped cleanly, nothing else happens
    assert sorted(plan.evicted) == ["b", "d"] and len(plan.hashes) == 2 and "g" not in plan.hashes
    assert bm.counters.store_rejected == 1
    assert bm.is_ready("a") and bm.is_ready("c") and bm.slot_of("a") == slots["a"] and bm.slot_of("c") == slots["c"]
    assert set(plan.slots) == {slots["b"], slots["d"]}
    # every slot is now loading or being stored: a store finds nothing and changes nothing
    before = {h: (b.slot, b.ready, b.refs) for h, b in bm.blocks.items()}
    assert bm.prepare_store(["x", "y"]).hashes == []
    assert {h: (b.slot, b.ready, b.refs) for h, b in bm.blocks.items()} == before
    bm.complete_load(["a", "c"])
    bm.complete_store(plan.hashes)
    assert len(bm.prepare_store(["x"]).hashes) == 1  # room again once the loads are done


@limit(60)
def test_random_interleaving_never_hands_out_a_busy_slot():
    """Random stores, loads, completions and failures on a small pool: a slot with a load or
    store in flight is never handed to another block, never more than capacity in use, and a
    block that is not completely stored is never a hit."""
    rng = np.random.default_rng(0)
    bm = BlockManager(6, policy="arc")
    loads: list = []   # (hashes, slots) in flight
    stores: list = []  # (hashes, slots) in flight
    for step in range(3000):
        op = rng.integers(0, 5)
        if op == 0:
            keys = [f"k{int(x)}" for x in rng.integers(0, 20, rng.integers(1, 4))]
            plan = bm.prepare_store(list(dict.fromkeys(keys)))
            busy = {s for _, ss in loads + stores for s in ss}
            assert not busy & set(plan.slots), f"step {step}: a busy slot was handed out"
            if plan.hashes:
                stores.append((plan.hashes, plan.slots))
        elif op == 1:
            ready = [h for h, b in bm.blocks.items() if b.ready]
            if ready:
                hs = list(rng.choice(ready, min(len(ready), 2), replace=False))
                loads.append((hs, bm.prepare_load(hs)))
        elif op == 2 and loads:
            hs, _ = loads.pop(int(rng.integers(0, len(loads))))
            bm.complete_load(hs)
        elif op == 3 and stores:
            hs, _ = stores.pop(int(rng.integers(0, len(stores))))
            bm.complete_store(hs, success=bool(rng.integers(0, 4)))  # 1 in 4 fails
        else:
            in_flight = {h for hs, _ in stores for h in hs}
            for h in in_flight:
                assert bm.lookup([h]) == 0  # never a hit before its store completed
        assert bm.used <= bm.capacity
        assert len(set(b.slot for b in bm.blocks.values())) == bm.used  # one block per slot


# ---------------------------------------------------------------------------- aborts
@limit(30)
def test_abort_with_copies_in_flight_releases_only_after_the_copy():
    """An aborted request sends no calls of its own: its store job and its load job are still
    in flight, and the scheduler (vLLM's OffloadingConnector, through our manager) releases
    their host slots only when the worker reports the jobs finished. Until then no other
    request can get those slots, however much it stores."""
    bm = BlockManager(4)
    p = bm.prepare_store(["r1-a", "r1-b"])  # request 1 stores two blocks ...
    bm.complete_store(["r1-a"])
    ld = bm.prepare_load(["r1-a"])          # ... and loads one back; then request 1 is aborted
    held = set(p.slots)
    for i in range(20):  # other requests under pressure
        plan = bm.prepare_store([f"r2-{i}-{j}" for j in range(3)])
        assert not held & set(plan.slots), "a slot of an in-flight copy was reused"
        bm.complete_store(plan.hashes)
    assert bm.slot_of("r1-a") == ld[0] and bm.slot_of("r1-b") == p.slots[1]
    # the store job reports (failed: cancelled with its request): slot freed, never a hit
    bm.complete_store(["r1-b"], success=False)
    assert not bm.is_ready("r1-b") and p.slots[1] in bm.free
    # the load job reports: r1-a becomes an ordinary evictable block
    bm.complete_load(["r1-a"])
    plan = bm.prepare_store([f"r3-{j}" for j in range(4)])
    assert ld[0] in plan.slots or p.slots[1] in plan.slots


# ---------------------------------------------------------------------------- pinning, /dev/shm
class FakeC:
    """kernels._C's host-pool entry points, with injectable cudaHostRegister failures."""

    def __init__(self, fail_from_call=0, err=2, delay_s=0.0):
        self.calls: list = []
        self.fail_from_call, self.err, self.delay_s = fail_from_call, err, delay_s
        self.unregistered: list = []

    def prefault(self, ptr, nbytes, threads, write):
        pass

    def host_register(self, ptr, nbytes):
        time.sleep(self.delay_s)
        self.calls.append((ptr, nbytes))
        return self.err if len(self.calls) > self.fail_from_call else 0

    def host_unregister(self, ptr):
        self.unregistered.append(ptr)


def _fake_cuda(monkeypatch, fake):
    monkeypatch.setattr(hp, "_C", fake)
    monkeypatch.setattr(hp.torch.cuda, "is_available", lambda: True)


@limit(30)
@pytest.mark.parametrize("fail_from", [0, 1])
def test_pinning_failure_falls_back_to_pageable_with_a_warning(monkeypatch, fail_from):
    fake = FakeC(fail_from_call=fail_from)
    _fake_cuda(monkeypatch, fake)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        pool = HostPool(8, 4096, torch.device("cpu"), chunk_bytes=2 * 4096, background=False)
    msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    assert len(msgs) == 1 and "cudaHostRegister" in msgs[0] and "pageable" in msgs[0]
    assert not pool.pinned and "CUDA error 2" in pool.error
    assert pool.usable_blocks == 8  # every block usable (pageable)
    assert len(fake.calls) == fail_from + 1  # no further register attempts after the failure
    pool.tensor[:] = 3
    assert int(pool.tensor.sum()) == 3 * 8 * 4096
    pool.close()
    assert len(fake.unregistered) == fail_from  # what was registered is unregistered


@limit(30)
def test_shm_too_small_is_a_clear_startup_error(monkeypatch, tmp_path):
    monkeypatch.setattr(hp, "SHM_DIR", str(tmp_path))

    def enospc(fd, off, n):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hp.os, "posix_fallocate", enospc)
    with pytest.raises(HostPoolError, match=r"shm-size"):
        HostPool(4, 1 << 20, torch.device("cpu"), shared_name="small", pin=False)
    assert not os.path.exists(tmp_path / "kvoffload-small")  # no half-made file left behind


@limit(30)
def test_shared_pool_pages_are_reserved_at_startup(monkeypatch):
    """The shared file's pages are allocated (posix_fallocate, whose ENOSPC is the clear error
    above) before the pool maps it: no sparse file that SIGBUSes on a later touch once the
    tmpfs is full. (On this tmpfs even a sparse file's pages are faulted in by the mapping's
    set-up, so st_blocks cannot tell; the call is what the test checks.)"""
    calls = []
    real = os.posix_fallocate

    def spy(fd, off, n):
        calls.append((off, n))
        return real(fd, off, n)

    monkeypatch.setattr(hp.os, "posix_fallocate", spy)
    name = f"test-reserve-{uuid.uuid4().hex[:8]}"
    pool = HostPool(3, 1 << 20, torch.device("cpu"), shared_name=name, pin=False, background=False)
    try:
        assert calls == [(0, 3 << 20)]
        st = os.stat(pool.shared_path)
        assert st.st_size == 3 << 20 and st.st_blocks * 512 >= 3 << 20
        # a second rank maps the existing file without reserving again
        other = HostPool(3, 1 << 20, torch.device("cpu"), shared_name=name, pin=False, background=False)
        assert calls == [(0, 3 << 20)]
        other.close()
    finally:
        pool.unlink()
        pool.close()


# ---------------------------------------------------------------------------- killed rank
class SlowCellWriter:
    """A stand-in worker whose store writes a cell in pieces (as a DMA would, slower), telling
    `started` after the first piece: the window in which the test kills the process."""

    def __init__(self, host, started=None, pieces=64, pause=0.05):
        self.host, self.started, self.pieces, self.pause = host, started, pieces, pause
        self.done: list = []

    def submit_store(self, job_id, block_ids, slot_ids):
        for b, s in zip(block_ids, slot_ids):
            cell = self.host[int(s)]
            for i, chunk in enumerate(torch.tensor_split(torch.arange(cell.numel()), self.pieces)):
                cell[chunk] = int(b) % 250 + 1
                if i == 0 and self.started is not None:
                    self.started.set()
                time.sleep(self.pause)
        self.done.append(JobResult(job_id, "store", True, 0, 0.0))
        return True

    def submit_load(self, job_id, slot_ids, block_ids):
        self.done.append(JobResult(job_id, "load", True, 0, 0.0))
        self.loaded = [self.host[int(s)].clone() for s in slot_ids]
        return True

    def get_finished(self):
        out, self.done = self.done, []
        return out

    def shutdown(self, drain=True):
        return self.get_finished()


ROWS, CELL, WORLD = 4, 1 << 16, 2


def _rank0_store(name, value_block, pieces, pause, started):
    """Rank 0 of a replicated (MLA) shared pool: stores block `value_block` into row 1."""
    pool = HostPool(ROWS, row_bytes(CELL, WORLD, True), None, shared_name=name, pin=False, background=False)
    commits = CellCommits(ROWS, 0, WORLD, replicated=True, shared_name=name)
    w = CommittedWorker(SlowCellWriter(rank_cells(pool.tensor, 0, WORLD, CELL, True), started, pieces, pause),
                        commits)
    assert w.submit_store(1, [value_block], [1])
    assert [r.ok for r in w.get_finished()] == [True]


def _run_rank0(ctx, name, value_block, pieces, pause, kill):
    started = ctx.Event()
    p = ctx.Process(target=_rank0_store, args=(name, value_block, pieces, pause, started))
    p.start()
    try:
        if kill:
            assert started.wait(120), "rank 0 never started writing"
            time.sleep(pause * 3)
            os.kill(p.pid, signal.SIGKILL)
        p.join(120)
        assert not p.is_alive()
        return p.exitcode
    finally:
        if p.is_alive():
            p.kill()


@limit(300)
def test_rank_killed_mid_store_never_leaves_a_readable_half_written_cell():
    ctx = mp.get_context("spawn")
    name = f"test-kill-{uuid.uuid4().hex[:8]}"
    pool = HostPool(ROWS, row_bytes(CELL, WORLD, True), None, shared_name=name, pin=False, background=False)
    commits = CellCommits(ROWS, 1, WORLD, replicated=True, shared_name=name)  # rank 1: a reader
    try:
        cells = rank_cells(pool.tensor, 1, WORLD, CELL, True)
        reader = CommittedWorker(SlowCellWriter(cells), commits)
        # control: a store that completes is committed and read back whole
        assert _run_rank0(ctx, name, 7, pieces=4, pause=0.0, kill=False) == 0
        assert reader.submit_load(10, [1], [0])
        (r,) = reader.get_finished()
        assert r.ok and bool((reader.tw.loaded[0] == 8).all())
        # the same row rewritten by a rank 0 that is killed in the middle of its store
        assert _run_rank0(ctx, name, 20, pieces=64, pause=0.05, kill=True) == -signal.SIGKILL
        vals = set(cells[1].unique().tolist())
        assert vals == {8, 21}, f"the cell should be half-written, holds {vals}"  # the hazard is real
        reader.tw.loaded = None
        assert not reader.submit_load(11, [1], [0])  # refused: nothing is read
        (r,) = reader.get_finished()
        assert not r.ok and "not committed" in r.error and reader.tw.loaded is None
        assert reader.refused_loads == 1
        assert commits.ready([0, 2, 3]).tolist() == [False] * 3  # never written: not readable either
    finally:
        pool.unlink()
        commits.unlink()
        pool.close()


@limit(30)
def test_commit_words_per_rank_sharded():
    """Sharded KV: each rank's cell has its own word; rank 0's commit says nothing of rank 1's."""
    c0, c1 = CellCommits(3, 0, 2), CellCommits(3, 1, 2)
    c1.words = c0.words  # one shared table (as through /dev/shm)
    c0.begin([2])
    c0.commit([2])
    assert c0.ready([2]).all() and not c1.ready([2]).any()
    c1.begin([2])
    assert c0.ready([2]).all() and not c1.ready([2]).any()
    with pytest.raises(ValueError):
        CellCommits(3, 2, 2)
