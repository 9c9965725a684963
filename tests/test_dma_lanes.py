"""DMA lanes (kvo::DmaLanes): one DMA job spread over several streams, forked from and
joined back to the caller's stream.

CPU: the lane rule, argument checks, and a clean error (no crash) without a driver.
GPU (marked): exact copies for 1-8 lanes in every direction, the fork (lanes start after
earlier work on the caller's stream), the join (later work waits for every lane), two caller
streams at once, and the native DMA submitter with lanes.
"""
import numpy as np
import pytest
import torch

from kernels import BlockCopier, KVOffloadError
from kernels._ext import _C
from tests.conftest import HAS_CUDA
from tests.reference import POISON, copy_blocks_ref, poisoned, random_bytes
from tests.test_copy_blocks import DIRS, run_case

needs_ext = pytest.mark.skipif(_C is None, reason="kernels._C is not built")


@needs_ext
def test_lane_rule():
    ln = _C.DmaLanes(lanes=4, min_lane_bytes=1 << 20)
    assert (ln.lanes, ln.min_lane_bytes) == (4, 1 << 20)
    assert ln.min_desc_bytes == 64 << 10
    assert ln.lanes_for(count=1000, bytes=1000 * 4096) == 1  # 4 KiB descriptors: one lane
    assert ln.lanes_for(count=40, bytes=40 * (64 << 10)) == 2  # 2.5 MiB: 2 lanes of >= 1 MiB
    assert _C.DmaLanes(lanes=4, min_lane_bytes=1 << 20, min_desc_bytes=0).lanes_for(
        count=1000, bytes=1000 * 4096) == 3
    assert ln.lanes_for(count=512, bytes=1 << 30) == 4
    assert ln.lanes_for(count=2, bytes=1 << 30) == 2  # never more lanes than descriptors
    assert ln.lanes_for(count=1000, bytes=(1 << 20) + 5) == 1
    assert ln.lanes_for(count=0, bytes=0) == 1
    assert _C.DmaLanes(lanes=8, min_lane_bytes=0, min_desc_bytes=0).lanes_for(count=5, bytes=5) == 5


@needs_ext
@pytest.mark.parametrize("lanes", [0, -1, 9])
def test_lanes_out_of_range_rejected(lanes):
    with pytest.raises(ValueError, match=r"dma_batch|bindings.cu:\d+: DmaLanes: lanes must be in \[1, 8\]"):
        _C.DmaLanes(lanes=lanes, min_lane_bytes=0)


@pytest.mark.parametrize("kw", [{"dma_lanes": 0}, {"dma_lanes": 9}, {"dma_lanes": 2.0},
                                {"dma_lane_min_bytes": -1}, {"dma_lane_min_desc_bytes": None}])
def test_copier_rejects_bad_lane_settings(kw):
    with pytest.raises(KVOffloadError, match="dma_lane"):
        BlockCopier("cpu", **kw)


@pytest.mark.parametrize("kw", [{"max_descriptors_per_call": 0}, {"max_descriptors_per_call": -512},
                                {"max_descriptors_per_call": 512.0}, {"ring_slots": 0}, {"ring_capacity": 0},
                                {"num_ctas": 0}, {"triton_h2d_ctas": -1}, {"staging_bytes": 0},
                                {"max_descriptors_per_call": True}])
def test_copier_rejects_bad_bounds(kw):
    name = next(iter(kw))
    with pytest.raises(KVOffloadError, match=f"{name} must be an int >= 1"):
        BlockCopier("cpu", **kw)


def test_copier_default_descriptors_per_call():
    # the default the per-call sweep chose (profiling/results/dma_per_call_*.json), and an
    # explicit bound taken as given
    from kernels.copy import DEFAULT_MAX_DESC_PER_CALL
    assert BlockCopier("cpu").max_desc == DEFAULT_MAX_DESC_PER_CALL == 512
    assert BlockCopier("cpu", max_descriptors_per_call=3).max_desc == 3


@needs_ext
@pytest.mark.skipif(HAS_CUDA, reason="checks the no-driver error path")
def test_multi_lane_job_without_a_driver_fails_cleanly():
    # a job that needs 2 lanes asks the driver for its stream's device first: without a
    # driver that is a RuntimeError naming the call, raised before any copy is issued
    ln = _C.DmaLanes(lanes=2, min_lane_bytes=0, min_desc_bytes=0)
    src = np.array([0, 1], np.int64)
    dst = np.array([1, 0], np.int64)
    with pytest.raises(RuntimeError, match=r"kernels/csrc/\w+\.(cu|cuh|h):\d+"):
        _C.dma_blocks(src_ids=src.ctypes.data, dst_ids=dst.ctypes.data, n=2, src_base=4096, dst_base=1 << 20,
                      src_stride=64, dst_stride=64, block_bytes=64, coalesce=False, max_per_call=16,
                      mode=_C.DMA_BATCH, src_any_order=False, stream=0, lanes=ln)


@pytest.mark.gpu
@pytest.mark.parametrize("lanes", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("d", list(DIRS))
@pytest.mark.parametrize("bb", [4096, 65552, 1 << 20])
def test_gpu_lanes_exact(lanes, d, bb):
    cp = BlockCopier("cuda", dma_lanes=lanes, dma_lane_min_bytes=0, dma_lane_min_desc_bytes=0)
    n = 61
    run_case(cp, "dma", bb, n + 3, n + 9, n, *DIRS[d], seed=bb + lanes, pin=True)


@pytest.mark.gpu
def test_gpu_lanes_contiguous_runs_coalesce_then_split():
    # consecutive ids coalesce into few long descriptors; the lanes split those by bytes
    cp = BlockCopier("cuda", dma_lanes=4, dma_lane_min_bytes=0, dma_lane_min_desc_bytes=0)
    run_case(cp, "dma", 8192, 300, 300, 256, "cuda", "cpu", seed=3, pin=True, shuffle=False)
    run_case(cp, "dma", 8192, 300, 300, 256, "cpu", "cuda", seed=4, pin=True, shuffle=False)


@pytest.mark.gpu
def test_gpu_lanes_fork_waits_for_earlier_work_on_the_stream():
    """D2H of a source that the stream rewrites after a long sleep: every lane must copy the
    rewritten bytes (a lane that did not wait on the fork would copy the old ones)."""
    bb, n = 1 << 20, 192
    cp = BlockCopier("cuda", dma_lanes=4, dma_lane_min_bytes=0)
    src = random_bytes((n * bb,), device="cuda", seed=1).view(n, bb)
    new = random_bytes((n * bb,), device="cuda", seed=2).view(n, bb)
    dst = poisoned(n * bb, pin=True).view(n, bb)
    ids = np.random.default_rng(0).permutation(n)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # the buffers were filled there
    with torch.cuda.stream(s):
        torch.cuda._sleep(100_000_000)  # tens of ms on the stream before the rewrite
        src.copy_(new)
        cp.copy(src, dst, ids, ids[::-1].copy(), method="dma", stream=s)
    s.synchronize()
    assert torch.equal(dst, copy_blocks_ref(new, poisoned(n * bb).view(n, bb), ids, ids[::-1], bb))


@pytest.mark.gpu
def test_gpu_lanes_join_orders_later_work_on_the_stream():
    """H2D, then at once (same stream) a device kernel reads the destination: it must see
    every lane's bytes. 192 MiB takes milliseconds; the clone would otherwise overtake it."""
    bb, n = 1 << 20, 192
    cp = BlockCopier("cuda", dma_lanes=4, dma_lane_min_bytes=0)
    src = random_bytes((n * bb,), seed=5, pin=True).view(n, bb)
    ids = np.random.default_rng(1).permutation(n)
    for _ in range(3):
        dst = poisoned(n * bb, device="cuda").view(n, bb)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())  # dst was poisoned there
        with torch.cuda.stream(s):
            cp.copy(src, dst, ids, np.arange(n), method="dma", stream=s)
            seen = dst.clone()
        s.synchronize()
        assert torch.equal(seen.cpu(), src[torch.from_numpy(ids)])


@pytest.mark.gpu
def test_gpu_lanes_two_caller_streams_at_once():
    """Stores and loads on two streams through one copier (as the worker issues them): each
    caller stream gets its own side streams, and both jobs are exact."""
    bb, n = 1 << 20, 96
    cp = BlockCopier("cuda", dma_lanes=4, dma_lane_min_bytes=0)
    g = random_bytes((2 * n * bb,), device="cuda", seed=7).view(2 * n, bb)
    h = random_bytes((2 * n * bb,), seed=8, pin=True).view(2 * n, bb)
    g0, h0 = g.cpu(), h.clone()
    rng = np.random.default_rng(2)
    si, di = rng.permutation(n), rng.permutation(n) + n  # store g[:n] -> h[n:], load h[:n] -> g[n:]
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()  # the buffers were filled on the current stream
    for _ in range(2):
        cp.copy(g, h, si, di, method="dma", stream=s1)
        cp.copy(h, g, si, di, method="dma", stream=s2)
    torch.cuda.synchronize()
    assert torch.equal(h, copy_blocks_ref(g0, h0, si, di, bb))
    assert torch.equal(g.cpu(), copy_blocks_ref(h0, g0, si, di, bb))


@pytest.mark.gpu
def test_gpu_native_submitter_with_lanes_exact():
    bb, n = 1 << 20, 64
    ln = _C.DmaLanes(lanes=3, min_lane_bytes=0)
    q = _C.DmaSubmitter(device=0, max_per_call=16, lanes=ln)
    del ln  # the submitter keeps its lanes alive
    src = random_bytes((n * bb,), device="cuda", seed=9).view(n, bb)
    dst = poisoned((n + 5) * bb, pin=True).view(n + 5, bb)
    rng = np.random.default_rng(3)
    si = np.ascontiguousarray(rng.permutation(n).astype(np.int64))
    di = np.ascontiguousarray(rng.permutation(n + 5)[:n].astype(np.int64))
    want = copy_blocks_ref(src, dst, si, di, bb)
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    t = q.submit_blocks(src_ids=si.ctypes.data, dst_ids=di.ctypes.data, n=n, src_base=src.data_ptr(),
                        dst_base=dst.data_ptr(), src_stride=bb, dst_stride=bb, block_bytes=bb, coalesce=True,
                        mode=_C.DMA_BATCH, src_any_order=False, stream=s.cuda_stream, wait_event=0,
                        src_seg_base=0, src_seg_bytes=0, dst_seg_base=0, dst_seg_bytes=0)
    q.synchronize(ticket=t)
    assert q.query(ticket=t) == 1 and q.error(ticket=t) == ""
    assert q.elapsed_ms(ticket=t) > 0
    assert torch.equal(dst, want)
    assert (dst[torch.from_numpy(np.setdiff1d(np.arange(n + 5), di))] == POISON).all()
    q.release(ticket=t)
    q.stop()


@pytest.mark.gpu
def test_gpu_native_submitter_gate_bounds_the_pause():
    """A caller that holds the gate and never lets go only delays the thread's slices (at most
    kGateWaitUs per job): the job is still issued, complete and exact; after release_hold the
    next job runs without pauses."""
    import time

    bb, n = 64 << 10, 96
    q = _C.DmaSubmitter(device=0, max_per_call=4)  # 24 slices: a gate check before each
    src = random_bytes((n * bb,), device="cuda", seed=10).view(n, bb)
    rng = np.random.default_rng(4)
    si = np.ascontiguousarray(rng.permutation(n).astype(np.int64))
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    for held in (True, False):
        dst = poisoned((n + 3) * bb, pin=True).view(n + 3, bb)
        di = np.ascontiguousarray(rng.permutation(n + 3)[:n].astype(np.int64))
        want = copy_blocks_ref(src, dst, si, di, bb)
        if held:
            q.hold()
        t0 = time.perf_counter()
        t = q.submit_blocks(src_ids=si.ctypes.data, dst_ids=di.ctypes.data, n=n, src_base=src.data_ptr(),
                            dst_base=dst.data_ptr(), src_stride=bb, dst_stride=bb, block_bytes=bb, coalesce=False,
                            mode=_C.DMA_BATCH, src_any_order=False, stream=s.cuda_stream, wait_event=0,
                            src_seg_base=0, src_seg_bytes=0, dst_seg_base=0, dst_seg_bytes=0)
        q.wait_issued(ticket=t)
        waited = time.perf_counter() - t0
        if held:
            assert waited >= 1.5e-3, f"the held gate did not pause the thread ({waited * 1e3:.2f} ms)"
            assert waited < 1.0, f"the held gate stalled the thread ({waited:.2f} s)"
            q.release_hold()
        q.synchronize(ticket=t)
        assert q.query(ticket=t) == 1 and q.descriptors(ticket=t) == n
        assert torch.equal(dst, want)
        assert (dst[torch.from_numpy(np.setdiff1d(np.arange(n + 3), di))] == POISON).all()
        q.release(ticket=t)
    q.stop()
