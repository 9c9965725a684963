"""The Python side of method `staged` (kernels/copy.py BlockCopier._run_staged and
staged_pipeline) at the sizes of the staged H2D fault (docs/design/staged-h2d-fault.md), on
the CPU: the copier's staging, index ring and streams are replaced by recording fakes and
`_C.copy_blocks` / `_C.dma_blocks` by checkers, so the real chunking, id slicing and address
arguments run unchanged and every DMA step is planned by the real C++ planner (`_C.plan_dma`,
what `_C.dma_blocks` runs) into arrays of the call's `n` entries. Checked: every descriptor
inside its buffer (host: 2^21 blocks of 4 KiB at an address past 2^32, so offsets cross 2^31
and 2^32 bytes; staging: the half the chunk alternates to) and within one registration
segment, the descriptors of a job covering exactly its blocks, each chunk's ids staged in the
ring matching the DMA step's, and the SM step's device id pointers inside the staged group.
Virtual addresses only: nothing is read or written through them."""
import ctypes
import types

import numpy as np
import pytest

import kernels.copy as kc
from kernels.plan import BlockView, register_segments, unregister_segments

_C = kc._C
pytestmark = pytest.mark.skipif(_C is None or not hasattr(_C, "plan_dma"), reason="needs the built extension")

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BB, N, HOST_BLOCKS, GPU_BLOCKS = 4 * KiB, 262144, 1 << 21, 1 << 19
HOST_BASE, GPU_BASE, STAGE_BASE = 0x3A0000000000, 0x3B0000000000, 0x3C0000000000


class _T:  # a tensor as BlockView / the staging see it: an address and a device
    def __init__(self, ptr, device="cuda"):
        self._p, self.device = ptr, types.SimpleNamespace(type=device)

    def data_ptr(self):
        return self._p


class _Ev:
    def record(self, stream=None):
        pass


class _Stream:
    def __init__(self, handle):
        self.cuda_stream = handle

    def wait_event(self, e):
        pass

    def synchronize(self):
        pass


def _read(addr, n):
    return np.frombuffer((ctypes.c_int64 * n).from_address(addr), dtype=np.int64).copy()


class _Ring:
    """IndexRing.stage/release: copies the ids (as the real ring's memcpy into its slot) and
    hands out fake device addresses of them."""

    def __init__(self, capacity):
        self.capacity, self.groups, self.next, self.live = capacity, {}, 0, set()

    def stage(self, src, dst, n, stream):
        assert 0 < n <= self.capacity
        r = self.next % 4
        self.next += 1
        assert r not in self.live
        self.live.add(r)
        dev = 0x3D0000000000 + self.next * (1 << 32)  # one address per group: checked after the job
        self.groups[dev] = (_read(src, n), _read(dst, n))
        return r, dev, dev + (1 << 31)

    def release(self, r, stream):
        self.live.discard(r)


class _Checker:
    """_C with copy_blocks and dma_blocks replaced; everything else is the real module."""

    def __init__(self, host, gpu, stage_half, seg):
        self.host, self.gpu, self.half, self.seg = host, gpu, stage_half, seg
        self.moved = []  # (host block, staging slot, half) per block, in issue order
        self.sm = []
        self.bad = []
        self.streams = set()  # the stream handles the DMA steps were issued on

    def __getattr__(self, k):
        return getattr(_C, k)

    def copy_blocks(self, **kw):
        self.sm.append((kw["src_ids"], kw["dst_ids"], kw["n_pairs"]))

    def dma_blocks(self, *, src_ids, dst_ids, n, src_base, dst_base, src_stride, dst_stride, block_bytes,
                   coalesce, max_per_call, stream, src_seg_base=0, src_seg_bytes=0, dst_seg_base=0,
                   dst_seg_bytes=0, lanes=None, **kw):
        assert lanes is None
        self.streams.add(stream)
        d, s, z = (np.zeros(n, np.uint64) for _ in range(3))  # dma_blocks' arrays: n entries
        k = _C.plan_dma(src_ids=src_ids, dst_ids=dst_ids, n=n, src_base=src_base, dst_base=dst_base,
                        src_stride=src_stride, dst_stride=dst_stride, block_bytes=block_bytes, coalesce=coalesce,
                        dsts=d.ctypes.data, srcs=s.ctypes.data, sizes=z.ctypes.data, src_seg_base=src_seg_base,
                        src_seg_bytes=src_seg_bytes, dst_seg_base=dst_seg_base, dst_seg_bytes=dst_seg_bytes)
        assert 1 <= k <= n
        si, di = _read(src_ids, n), _read(dst_ids, n)
        h2d = src_base == HOST_BASE
        hb, hs = (s, src_seg_bytes) if h2d else (d, dst_seg_bytes)
        sb = d if h2d else s
        a, b, sz = (x[:k].astype(np.int64) for x in (hb, sb, z))
        end = HOST_BASE + HOST_BLOCKS * BB
        for q in np.flatnonzero((a < HOST_BASE) | (a + sz > end)):
            self.bad.append(("host", int(q), hex(int(a[q])), int(sz[q])))
        if hs:
            for q in np.flatnonzero((a - HOST_BASE) // hs != (a + sz - 1 - HOST_BASE) // hs):
                self.bad.append(("segment", int(q), hex(int(a[q])), int(sz[q])))
        half0 = np.where(b < STAGE_BASE + self.half, STAGE_BASE, STAGE_BASE + self.half)
        for q in np.flatnonzero((b < STAGE_BASE) | (b + sz > half0 + self.half)):
            self.bad.append(("staging", int(q), hex(int(b[q])), int(sz[q])))
        # the descriptors, cut into blocks, are the call's pairs in order
        nb = sz // BB
        assert np.all(sz % BB == 0) and int(nb.sum()) == n
        within = np.arange(n) - np.repeat(np.cumsum(nb) - nb, nb)
        blocks_h = (np.repeat(a, nb) - HOST_BASE) // BB + within
        blocks_s = np.repeat(b, nb) - STAGE_BASE + within * BB
        want_h = si if h2d else di
        assert np.array_equal(blocks_h, want_h)
        half = int(blocks_s[0]) // self.half
        assert np.array_equal(blocks_s - half * self.half, (di if h2d else si) * BB)
        # the staging side is slots 0..n-1 of the half, the slots the SM step reads or writes
        assert np.array_equal(di if h2d else si, np.arange(n))
        self.moved.append((want_h, half))
        return 1, k


def _host_ids(order, rng):
    if order == "sequential":
        return np.arange(N, dtype=np.int64) + HOST_BLOCKS - N - 3
    ids = rng.permutation(HOST_BLOCKS)[:N]
    return {"random": ids, "sorted": np.sort(ids), "reversed": np.sort(ids)[::-1].copy()}[order]


@pytest.mark.parametrize("d", ["h2d", "d2h"])
@pytest.mark.parametrize("seg", [0, GiB, 3 * GiB // 2 + 7 * BB])
def test_staged_chunks_plan_inside_their_buffers(monkeypatch, d, seg):
    cp = kc.BlockCopier("cpu")
    half = (cp.staging_bytes // 2) & ~255
    staging = types.SimpleNamespace(half=half, buf=_T(STAGE_BASE), views=[_T(STAGE_BASE), _T(STAGE_BASE + half)],
                                    aux=_Stream(0x77), ready=[_Ev(), _Ev()], free=[_Ev(), _Ev()], entry=_Ev(),
                                    exit=_Ev(), used=[False, False], work=_Stream(0x78), fork=_Ev(), join=_Ev())
    ring = _Ring(32768)
    monkeypatch.setattr(cp, "_staging_get", lambda d_: staging)
    monkeypatch.setattr(cp, "_ring_get", lambda: ring)
    chk = _Checker(HOST_BASE, GPU_BASE, half, seg)
    monkeypatch.setattr(kc, "_C", chk)
    if seg:
        register_segments(HOST_BASE, HOST_BLOCKS * BB, seg)
    try:
        host = BlockView(_T(HOST_BASE, "cpu"), HOST_BLOCKS, BB, BB)
        gpu = BlockView(_T(GPU_BASE), GPU_BLOCKS, BB, BB)
        rng = np.random.default_rng(37)
        gi = rng.permutation(GPU_BLOCKS)[:N]
        for order in ("random", "sequential", "sorted", "reversed"):
            hi = _host_ids(order, rng)
            chk.moved.clear()
            chk.sm.clear()
            ring.groups.clear()
            if d == "h2d":
                cp._run_staged(host, gpu, hi, gi, _Stream(0), d, 16)
            else:
                cp._run_staged(gpu, host, gi, hi, _Stream(0), d, 16)
            assert not chk.bad, (order, chk.bad[:5])
            # every block once, chunk by chunk, the halves alternating
            assert np.array_equal(np.concatenate([m[0] for m in chk.moved]), hi)
            assert [m[1] for m in chk.moved] == [c % 2 for c in range(len(chk.moved))]
            # the SM steps read the GPU ids the ring staged for their chunk, and staging slots 0..
            per = len(chk.moved[0][0])
            assert per == min(half, cp.staged_chunk_bytes) // BB == 8192
            seen = []
            for ids_p, slots_p, n in chk.sm:
                if d == "h2d":
                    ids_p, slots_p = slots_p, ids_p  # scatter: src = slots, dst = blocks
                base = max(b for b in ring.groups if b <= ids_p)
                g_ids, g_slots = ring.groups[base]
                off = (ids_p - base) // 8
                assert slots_p == base + (1 << 31) + 8 * off and off + n <= len(g_ids)
                seen.append(g_ids[off:off + n])
                assert np.array_equal(g_slots[off:off + n], np.arange(n))
            assert np.array_equal(np.concatenate(seen), gi)
            assert not ring.live
            # a job on the legacy default stream issues no DMA step there (where the batch API
            # would map it to the per-thread default stream): it runs on the staging's own stream
            assert chk.streams == {staging.work.cuda_stream}, chk.streams
            chk.streams.clear()
    finally:
        if seg:
            unregister_segments(HOST_BASE)
