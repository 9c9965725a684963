"""The staged pipeline's chunking and id staging, with the GPU pieces replaced by recorders (CPU).

Checks what the GPU tests cannot show cheaply: every item lands in exactly one
chunk and one staging slot, a job stages its ids once per group (never once per
chunk, so the host never waits on the index ring), and the two buffers alternate.
"""
import numpy as np
import pytest

from kernels.copy import BlockCopier


class _Ev:
    def record(self, s=None):
        pass


class _Stream:
    cuda_stream = 7

    def wait_event(self, e):
        pass


class _Staging:
    def __init__(self, half):
        import torch

        self.half = half
        self.buf = torch.empty(2 * half, dtype=torch.uint8)
        self.views = [self.buf[:half], self.buf[half:]]
        self.aux = _Stream()
        self.ready, self.free = [_Ev(), _Ev()], [_Ev(), _Ev()]
        self.entry, self.exit = _Ev(), _Ev()
        self.used = [False, False]


class _Ring:
    def __init__(self, capacity):
        self.capacity = capacity
        self.staged, self.released = [], []
        self.mem = {}

    def stage(self, a_ptr, b_ptr, n, stream):
        import ctypes

        a = np.ctypeslib.as_array((ctypes.c_int64 * n).from_address(a_ptr)).copy()
        b = np.ctypeslib.as_array((ctypes.c_int64 * n).from_address(b_ptr)).copy()
        base = 1_000_000 * (len(self.staged) + 1)
        self.staged.append((a, b))
        for i in range(n):  # fake device memory: address -> value
            self.mem[base + 8 * i] = a[i]
            self.mem[base + 8 * (n + i)] = b[i]
        return len(self.staged) - 1, base, base + 8 * n

    def release(self, r, s):
        self.released.append(r)


@pytest.mark.parametrize("n,per_blocks,cap", [(1000, 16, 64), (37, 5, 12), (8, 8, 8), (1, 3, 4), (100, 7, 7)])
@pytest.mark.parametrize("d", ["d2h", "h2d"])
def test_pipeline_stages_once_per_group_and_covers_every_item(n, per_blocks, cap, d):
    bb = 1024
    cp = BlockCopier("cpu")
    st, ring = _Staging(per_blocks * bb), _Ring(cap)
    cp._staging_get = lambda d_: st
    cp._ring_get = lambda: ring
    cp.staged_chunk_bytes = 1 << 30
    ids = np.random.default_rng(0).permutation(10 * n)[:n].astype(np.int64)
    seen, bufs, order = {}, [], []

    def sm(a, b, buf, aux, dev_ids, dev_slots):
        order.append(("sm", a))
        bufs.append(buf.ptr)
        for i in range(b - a):
            item = ring.mem[dev_ids + 8 * i]
            slot = ring.mem[dev_slots + 8 * i]
            assert item == ids[a + i] and slot == i, "chunk sees the wrong ids or slots"
            seen[a + i] = seen.get(a + i, 0) + 1
        assert b - a <= st.half // bb

    def dma(a, b, buf, s):
        order.append(("dma", a))

    cp.staged_pipeline(d, ids, bb, _Stream(), sm, dma)
    assert sorted(seen) == list(range(n)) and set(seen.values()) == {1}
    per = min(per_blocks, cap)
    group = (cap // per) * per
    assert len(ring.staged) == -(-n // group) == len(ring.released)  # once per group, all released
    assert all(bufs[i] != bufs[i + 1] for i in range(len(bufs) - 1))  # the two buffers alternate
    first = [k for k, _ in order[:2]]
    assert first == (["sm", "dma"] if d == "d2h" else ["dma", "sm"])[: len(first)]


def test_mover_holds_the_copier_lock_around_its_ring_and_staging(monkeypatch):
    # KVBlockMover's kernel and staged paths use its copier's index ring and staging buffers,
    # which the copier shares with every other caller (get_copier's is process-wide) and whose
    # C++ bookkeeping is not thread-safe: each use must hold the copier's lock, as
    # BlockCopier.copy does. The GPU pieces are replaced by recorders of the lock's state.
    import types

    import torch

    import layout.pack as lp
    from layout import KVBlockMover, KVLayout, KVSpec, allocate

    cp = BlockCopier("cpu")
    held = []

    class Ring(_Ring):
        def stage(self, a_ptr, b_ptr, n, stream):
            held.append(("stage", cp._lock.locked()))
            return super().stage(a_ptr, b_ptr, n, stream)

        def release(self, r, s):
            held.append(("release", cp._lock.locked()))
            super().release(r, s)

    spec = KVSpec(2, 2, 64, 16)
    mover = KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, allocate(spec, KVLayout.TWO_NB_BS_NH_HS, 8), copier=cp)
    ring, st = Ring(64), _Staging(4 * mover.unified_block_bytes)
    cp._ring_get = lambda: ring
    cp._staging_get = lambda d: st
    mover._table_dev = torch.from_numpy(mover._host_table)
    monkeypatch.setattr(lp, "native", types.SimpleNamespace(
        pack_layers=lambda *a, **k: held.append(("pack", cp._lock.locked()))))
    monkeypatch.setattr(cp, "_run_dma", lambda *a, **k: held.append(("dma", cp._lock.locked())))
    uv = mover._unified_view(torch.zeros(8, mover.unified_block_bytes, dtype=torch.uint8))
    bi, si = np.arange(6, dtype=np.int64), np.arange(6, dtype=np.int64)[::-1].copy()
    for to_unified in (True, False):
        mover._staged(bi, uv, si, to_unified, _Stream(), 16)
    mover.device = torch.device("cuda")  # the kernel path's GPU branch, on the recorders above
    mover._kernel("cuda", bi, uv, si, True, _Stream(), 16)
    assert {k for k, _ in held} == {"stage", "release", "pack", "dma"}
    assert all(h for _, h in held), [k for k, h in held if not h]
    assert not cp._lock.locked()
