"""Integrity mode: the block checksum kernel (kernels.checksum) and CheckedTransferWorker.

CPU: the Triton kernel under TRITON_INTERPRET=1 bit-compared with the torch reference, on
plain [NB, bytes] blocks and on per-layer KV (a FragmentTable: the checksum over GPU fragments
must equal the one over the packed unified image), single-byte sensitivity, and the wrapper
around a stand-in worker (the TransferWorker itself needs CUDA). GPU (marker gpu): the wrapper
around a real TransferWorker, with the negative control (a corrupted host copy fails its load
and is counted).
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from connector.integrity import CheckedTransferWorker
from connector.worker import JobResult
from kernels.checksum import BlockChecksum, checksum_reference
from layout.fragments import fragments
from layout.pack import KVBlockMover
from layout.spec import KVLayout, KVSpec


# Triton runs on CPU tensors only under its interpreter (tests/conftest.py sets it where there is no
# GPU); on a GPU machine the kernel is covered by the CUDA tests below.
CPU_TRITON = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="triton needs TRITON_INTERPRET=1 on CPU tensors")


def _rand_u8(shape, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, shape, dtype=torch.uint8, generator=g).to(device)


@CPU_TRITON
@pytest.mark.parametrize("nbytes", [4, 12, 8192, 8196, 3 * 8192 + 20])
def test_kernel_matches_reference(nbytes):
    x = _rand_u8((7, nbytes), nbytes)
    ck = BlockChecksum(x)
    ids = torch.tensor([6, 0, 3, 3, 5], dtype=torch.int64)
    got = ck.compute(ids)
    ref = checksum_reference(x[ids])
    assert torch.equal(got, ref)
    assert torch.equal(got[2], got[3])  # same block, same sum
    assert len({tuple(r) for r in ref[[0, 1, 2, 4]].tolist()}) == 4  # different data, different sums


@CPU_TRITON
def test_kernel_on_strided_rows():
    big = _rand_u8((5, 1024 + 64), 3)
    x = big[:, 32:32 + 1024]  # a row stride larger than the row (as a rank's cells in a shared pool)
    got = BlockChecksum(x).compute(torch.arange(5))
    assert torch.equal(got, checksum_reference(x.contiguous()))


@CPU_TRITON
def test_single_flipped_byte_changes_both_lanes():
    x = _rand_u8((1, 16384), 11)
    ck = BlockChecksum(x)
    ids = torch.zeros(1, dtype=torch.int64)
    base = ck.compute(ids).clone()
    rng = np.random.default_rng(0)
    positions = [0, 1, 16383, 8191, 8192] + rng.integers(0, 16384, 40).tolist()
    for p in positions:
        old = int(x[0, p])
        x[0, p] = old ^ (1 << int(rng.integers(0, 8)))
        s = ck.compute(ids)
        assert (s[0] != base[0]).all(), f"flip at byte {p} not seen by both lanes"
        assert torch.equal(s, checksum_reference(x))
        x[0, p] = old
    assert torch.equal(ck.compute(ids), base)


@CPU_TRITON
def test_swapped_words_change_the_sum():
    x = _rand_u8((1, 4096), 12)
    ck = BlockChecksum(x)
    base = ck.compute(torch.zeros(1, dtype=torch.int64)).clone()
    y = x.clone()
    y[0, 0:4], y[0, 4:8] = x[0, 4:8], x[0, 0:4]  # same bytes, other order
    assert not torch.equal(checksum_reference(y), base)
    assert not torch.equal(checksum_reference(torch.zeros(1, 4096, dtype=torch.uint8)),
                           checksum_reference(torch.zeros(1, 4100, dtype=torch.uint8)[:, :4096] + 1))


@CPU_TRITON
def test_bad_geometry_refused():
    with pytest.raises(ValueError):
        BlockChecksum(torch.zeros(4, 10, dtype=torch.uint8))
    with pytest.raises(ValueError):
        BlockChecksum(torch.zeros(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError):
        checksum_reference(torch.zeros(2, 6, dtype=torch.uint8))
    ck = BlockChecksum(torch.zeros(4, 16, dtype=torch.uint8))
    with pytest.raises(ValueError):
        ck.compute(torch.zeros(2, dtype=torch.int32))


def _per_layer(seed=0, nb=6):
    spec = KVSpec(num_layers=3, num_kv_heads=2, head_size=8, block_size=4, dtype=torch.float16)
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(spec.shape(KVLayout.TWO_NB_BS_NH_HS, nb), generator=g).to(torch.float16)
               for _ in range(spec.num_layers)]
    return spec, tensors


@CPU_TRITON
def test_fragment_table_checksum_equals_unified_image():
    spec, tensors = _per_layer()
    table = fragments(spec, KVLayout.TWO_NB_BS_NH_HS, tensors)
    assert table.num_fragments > 1
    mover = KVBlockMover.from_table(table)
    host = torch.zeros(4, table.unified_block_bytes, dtype=torch.uint8)
    ids = [5, 0, 2]
    mover.pack(ids, host, [1, 3, 0], method="torch")
    got = BlockChecksum(table).compute(torch.tensor(ids))
    assert torch.equal(got, checksum_reference(host[[1, 3, 0]]))


class StandInWorker:
    """TransferWorker's public API on CPU tensors: copies synchronously through the mover
    (as the vLLM adapter's CPU path), jobs reported at the next get_finished. `fail_next`
    makes the next job report ok=False (a copy error)."""

    def __init__(self, mover, host):
        self.mover, self.host = mover, host
        self.done: list = []
        self.fail_next = False
        self.stats = {"failed_jobs": 0}

    def _run(self, job_id, kind, block_ids, slot_ids):
        if kind == "store":
            self.mover.pack(block_ids, self.host, slot_ids, method="torch")
        else:
            self.mover.unpack(self.host, slot_ids, block_ids, method="torch")
        ok, self.fail_next = not self.fail_next, False
        self.done.append(JobResult(job_id, kind, ok, len(block_ids) * self.mover.unified_block_bytes if ok else 0,
                                   0.1 if ok else None, None if ok else "injected"))
        return True

    def submit_store(self, job_id, block_ids, slot_ids, *, after=None):
        return self._run(job_id, "store", block_ids, slot_ids)

    def submit_load(self, job_id, slot_ids, block_ids, *, after=None):
        return self._run(job_id, "load", block_ids, slot_ids)

    def get_finished(self):
        out, self.done = self.done, []
        return out

    def fence(self, job_id, stream=None):
        pass

    def wait(self, job_ids):
        pass

    def flush(self):
        pass

    def shutdown(self, drain=True):
        return self.get_finished()


def _checked(nb=8, slots=6):
    spec, tensors = _per_layer(1, nb)
    table = fragments(spec, KVLayout.TWO_NB_BS_NH_HS, tensors)
    mover = KVBlockMover.from_table(table)
    host = torch.zeros(slots, table.unified_block_bytes, dtype=torch.uint8)
    inner = StandInWorker(mover, host)
    return CheckedTransferWorker(inner, mover), inner, tensors, host


@CPU_TRITON
def test_wrapper_roundtrip_ok_and_corruption_fails():
    w, inner, tensors, host = _checked()
    assert w.submit_store(1, np.array([0, 1, 2]), np.array([3, 4, 5]))
    assert [r.ok for r in w.get_finished()] == [True]
    assert w.integrity["stored_blocks"] == 3
    want = [t.clone() for t in tensors]
    for t in tensors:
        t[:, 5:8].fill_(0)  # poison the destination blocks
    assert w.submit_load(2, np.array([3, 4, 5]), np.array([5, 6, 7]))
    (r,) = w.get_finished()
    assert r.ok and r.nbytes > 0
    for t, ref in zip(tensors, want):
        assert torch.equal(t[:, 5:8], ref[:, 0:3])
    assert w.integrity == {"stored_blocks": 3, "checked_blocks": 3, "failed_blocks": 0, "failed_jobs": 0}
    # negative control: one byte of one host copy changes -> that load fails, counted once
    host[4, 17] ^= 0x01
    assert w.submit_load(3, np.array([3, 4, 5]), np.array([5, 6, 7]))
    (r,) = w.get_finished()
    assert not r.ok and r.nbytes == 0 and "integrity" in r.error
    assert w.integrity["failed_blocks"] == 1 and w.integrity["failed_jobs"] == 1
    # a load of the untouched slots still passes
    assert w.submit_load(4, np.array([3, 5]), np.array([1, 2]))
    assert [r.ok for r in w.get_finished()] == [True]
    assert w.integrity["failed_jobs"] == 1


@CPU_TRITON
def test_wrapper_slot_reuse_takes_the_new_checksum():
    w, inner, tensors, host = _checked()
    w.submit_store(1, [0], [2])
    w.submit_store(2, [4], [2])  # the slot is reused for another block
    w.get_finished()
    w.submit_load(3, [2], [7])
    (r,) = w.get_finished()
    assert r.ok
    for t in tensors:
        assert torch.equal(t[:, 7], t[:, 4])


@CPU_TRITON
def test_wrapper_failed_copy_not_counted_as_corruption():
    w, inner, tensors, host = _checked()
    w.submit_store(1, [0, 1], [0, 1])
    w.get_finished()
    inner.fail_next = True
    w.submit_load(2, [0, 1], [3, 4])
    (r,) = w.get_finished()
    assert not r.ok and r.error == "injected"
    assert w.integrity["failed_jobs"] == 0 and w.integrity["checked_blocks"] == 0
    assert len(w._free_flags) == len(w.flags)  # its flag slot went back


@CPU_TRITON
def test_wrapper_holds_a_result_until_its_check_is_done():
    w, inner, tensors, host = _checked()
    w.submit_store(1, [0], [0])

    class Pending:
        done = False

        def query(self):
            return self.done

    ev = Pending()
    w._checks[1].event = ev  # as on the GPU: the check still running
    w._free_events = []
    assert w.get_finished() == []
    ev.done = True
    (r,) = w.get_finished()
    assert r.job_id == 1 and r.ok
    assert w.stats is inner.stats  # the rest of the API is the worker's


@CPU_TRITON
def test_wrapper_shutdown_applies_the_verdicts_and_passes_after_through():
    w, inner, tensors, host = _checked()
    seen = []
    orig = inner.submit_store

    def spy(job_id, block_ids, slot_ids, *, after=None):
        seen.append(after)
        return orig(job_id, block_ids, slot_ids)

    inner.submit_store = spy
    w.submit_store(1, [0, 1], [0, 1], after="evt")
    assert seen == ["evt"]
    host[1, 0] ^= 0xFF
    w.submit_load(2, [0, 1], [4, 5])
    res = {r.job_id: r for r in w.shutdown()}  # never polled: shutdown reports both, checked
    assert res[1].ok and not res[2].ok and w.integrity["failed_jobs"] == 1


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["unified", "per_layer"])
@pytest.mark.parametrize("native", [True, False])
def test_gpu_checked_worker_roundtrip_and_negative_control(layout, native):
    from connector.worker import TransferWorker

    dev = torch.device("cuda", 0)
    spec = KVSpec(num_layers=4, num_kv_heads=4, head_size=64, block_size=16, dtype=torch.bfloat16)
    nb, slots = 64, 48
    g = torch.Generator(device=dev).manual_seed(5)
    if layout == "unified":
        kv = torch.randn(spec.shape(KVLayout.NB_NL_TWO_BS_NH_HS, nb), device=dev, generator=g).to(spec.dtype)
        table = fragments(spec, KVLayout.NB_NL_TWO_BS_NH_HS, kv)
        tensors = [kv]
    else:
        tensors = [torch.randn(spec.shape(KVLayout.TWO_NB_BS_NH_HS, nb), device=dev, generator=g).to(spec.dtype)
                   for _ in range(spec.num_layers)]
        table = fragments(spec, KVLayout.TWO_NB_BS_NH_HS, tensors)
    mover = KVBlockMover.from_table(table)
    host = torch.zeros(slots, table.unified_block_bytes, dtype=torch.uint8).pin_memory()
    w = CheckedTransferWorker(TransferWorker(mover, host, native_submit=native), mover)
    src = np.arange(0, 32, dtype=np.int64)
    assert w.submit_store(1, src, np.arange(32, dtype=np.int64))
    w.wait([1])
    assert [r.ok for r in w.get_finished()] == [True]
    want = [t.clone() for t in tensors]
    for t in tensors:  # poison the destination blocks
        (t[32:64] if layout == "unified" else t[:, 32:64]).fill_(7)
    assert w.submit_load(2, np.arange(32, dtype=np.int64), np.arange(32, 64, dtype=np.int64))
    w.wait([2])
    res = w.get_finished()
    assert [r.ok for r in res] == [True], res
    for t, ref in zip(tensors, want):
        a = t[32:64] if layout == "unified" else t[:, 32:64]
        b = ref[0:32] if layout == "unified" else ref[:, 0:32]
        assert torch.equal(a, b)
    assert w.integrity["checked_blocks"] == 32 and w.integrity["failed_blocks"] == 0
    # negative control: corrupt one host copy -> the load fails -> counter 1
    host[10, 123] ^= 0x40
    assert w.submit_load(3, np.arange(32, dtype=np.int64), np.arange(32, 64, dtype=np.int64))
    w.wait([3])
    res = w.get_finished()
    assert len(res) == 1 and not res[0].ok and "integrity" in res[0].error
    assert w.integrity["failed_blocks"] == 1 and w.integrity["failed_jobs"] == 1
    # many jobs in flight, no waits: every one reported, all ok
    # (a job's blocks are not written by anyone else until it is reported: distinct destinations)
    jobs = list(range(10, 18)) + list(range(20, 36))
    for j in jobs:
        assert w.submit_store(j, np.array([j - 10]), np.array([40 + j - 10])) if j < 18 else \
            w.submit_load(j, np.array([12 + j % 10, 13 + j % 10]), np.array([32 + 2 * (j - 20), 33 + 2 * (j - 20)]))
    got = {}
    for _ in range(2000):
        for r in w.get_finished():
            got[r.job_id] = r.ok
        if len(got) == len(jobs):
            break
        time.sleep(0.005)
    assert sorted(got) == jobs and all(got.values()), got
    w.shutdown()


@pytest.mark.gpu
def test_gpu_kernel_matches_reference():
    dev = torch.device("cuda", 0)
    x = _rand_u8((64, (2 << 20) + 4), 9, dev)
    ids = torch.randperm(64, device=dev)[:40]
    assert torch.equal(BlockChecksum(x).compute(ids), checksum_reference(x[ids]))
