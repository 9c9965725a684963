"""Descriptor planning and coalescing (CPU)."""
import numpy as np
import pytest
import torch

from kernels.plan import BlockView, coalesce, count_runs, plan_dma, vec_width


def test_coalesce_runs_in_order():
    s = np.array([0, 1, 2, 7, 8, 3, 4, 9], np.int64)
    d = np.array([5, 6, 7, 1, 2, 9, 20, 21], np.int64)
    s0, d0, ln = coalesce(s, d)
    assert s0.tolist() == [0, 7, 3, 4, 9]
    assert d0.tolist() == [5, 1, 9, 20, 21]
    assert ln.tolist() == [3, 2, 1, 1, 1]
    assert ln.sum() == len(s)
    assert count_runs(s, d) == 5
    assert count_runs(s) == 4  # 0-2, 7-8, 3-4, 9


def test_coalesce_empty_and_single():
    e = np.empty(0, np.int64)
    assert [x.size for x in coalesce(e, e)] == [0, 0, 0]
    s0, d0, ln = coalesce(np.array([4]), np.array([9]))
    assert (s0.tolist(), d0.tolist(), ln.tolist()) == ([4], [9], [1])
    assert count_runs(e) == 0


def test_coalesce_matches_loop_on_random():
    rng = np.random.default_rng(1)
    for _ in range(50):
        n = int(rng.integers(1, 200))
        s = np.cumsum(rng.integers(0, 3, n)) + rng.integers(0, 5)
        d = np.cumsum(rng.integers(1, 3, n))
        s0, d0, ln = coalesce(s.astype(np.int64), d.astype(np.int64))
        # expand back: must reproduce the pairs exactly, in order
        es = np.concatenate([np.arange(a, a + k) for a, k in zip(s0, ln)])
        ed = np.concatenate([np.arange(a, a + k) for a, k in zip(d0, ln)])
        assert (es == s).all() and (ed == d).all()
        # maximal: no two neighbouring runs could merge
        for i in range(len(ln) - 1):
            assert not (s0[i] + ln[i] == s0[i + 1] and d0[i] + ln[i] == d0[i + 1])


def _bv(nb, bb, stride=None, ptr_base=0x10000):
    t = torch.empty(nb * (stride or bb), dtype=torch.uint8)
    return BlockView(t, nb, bb, stride or bb)


def test_plan_dma_addresses_and_sizes():
    src, dst = _bv(16, 4096), _bv(32, 4096)
    s = np.array([3, 4, 5, 0], np.int64)
    d = np.array([10, 11, 12, 31], np.int64)
    dsts, srcs, sizes = plan_dma(src, dst, s, d)
    assert dsts.dtype == np.uint64 and srcs.dtype == np.uint64 and sizes.dtype == np.uint64
    assert sizes.tolist() == [3 * 4096, 4096]
    assert srcs.tolist() == [src.ptr + 3 * 4096, src.ptr]
    assert dsts.tolist() == [dst.ptr + 10 * 4096, dst.ptr + 31 * 4096]


def test_plan_dma_strided_blocks_not_coalesced():
    src = _bv(8, 1000, stride=1024)
    dst = _bv(8, 1000)
    s = np.arange(4, dtype=np.int64)
    dsts, srcs, sizes = plan_dma(src, dst, s, s)
    assert sizes.tolist() == [1000] * 4  # the gap between blocks must not be copied
    assert (srcs - np.uint64(src.ptr)).tolist() == [0, 1024, 2048, 3072]


def test_plan_dma_64bit_offsets():
    # ids far beyond 4 GiB / block size must not wrap
    t = torch.empty(16, dtype=torch.uint8)
    big = BlockView(t, 1 << 22, 1 << 21, 1 << 21)  # 8 TiB virtual span, ids only
    s = np.array([(1 << 22) - 1], np.int64)
    dsts, srcs, sizes = plan_dma(big, big, s, s - 5)
    assert int(srcs[0]) - t.data_ptr() == ((1 << 22) - 1) << 21


@pytest.mark.parametrize("vals,expect", [((0, 16, 32), 16), ((8, 16), 8), ((4,), 4), ((6,), 2), ((3,), 1),
                                         ((16, 16, 1040, 7), 1)])
def test_vec_width(vals, expect):
    assert vec_width(*vals) == expect


# ---- the C++ planner (kernels._C, host code: runs without a GPU) must match numpy
from kernels._ext import _C  # noqa: E402
from kernels.plan import KVOffloadError, check_ids  # noqa: E402

needs_ext = pytest.mark.skipif(_C is None, reason="kernels._C not built (no nvcc at install)")


@needs_ext
def test_cpp_plan_dma_matches_numpy():
    rng = np.random.default_rng(3)
    for trial in range(40):
        n = int(rng.integers(1, 300))
        if trial % 2:
            s = np.cumsum(rng.integers(0, 3, n)).astype(np.int64)
            d = np.cumsum(rng.integers(1, 3, n)).astype(np.int64)
        else:
            s = rng.integers(0, 1000, n).astype(np.int64)
            d = rng.permutation(1000)[:n].astype(np.int64)
        bb = int(rng.choice([16, 4096, 1 << 21]))
        stride = bb if trial % 3 else bb + 64
        src, dst = _bv(int(s.max()) + 1, bb, stride), _bv(int(d.max()) + 1, bb)
        want = plan_dma(src, dst, s, d)
        out = [np.zeros(n, np.uint64) for _ in range(3)]
        k = _C.plan_dma(src_ids=s.ctypes.data, dst_ids=d.ctypes.data, n=n, src_base=src.ptr,
                        dst_base=dst.ptr, src_stride=src.stride, dst_stride=dst.stride, block_bytes=bb,
                        coalesce=src.stride == bb, dsts=out[0].ctypes.data, srcs=out[1].ctypes.data,
                        sizes=out[2].ctypes.data)
        assert k == len(want[0])
        for got, w in zip(out, want):
            assert (got[:k] == w).all()


@needs_ext
def test_cpp_check_ids_matches_numpy():
    rng = np.random.default_rng(4)
    for trial in range(300):
        n = int(rng.integers(1, 40))
        s = rng.integers(-2, 30, n).astype(np.int64)
        d = (np.sort(rng.choice(40, n, replace=False)) if trial % 3 == 0
             else rng.integers(-2, 30, n)).astype(np.int64)
        try:
            check_ids(s, d, 28, 28)
            ok_np = True
        except KVOffloadError:
            ok_np = False
        code, idx, val, rb, rs, rd = _C.check_ids(src_ids=s.ctypes.data, dst_ids=d.ctypes.data, n=n,
                                                  n_src=28, n_dst=28)
        assert (code == 0) == ok_np, (s, d, code)
        if code == 0:
            assert (rb, rs, rd) == (count_runs(s, d), count_runs(s), count_runs(d))
        else:
            assert 0 <= idx < n


@needs_ext
def test_cpp_check_and_stage_matches_check_ids_and_stages_exactly():
    """check_and_stage_ids (what IndexRing.stage_checked runs) must agree with check_ids on every
    outcome and, when valid, leave exactly src ids then dst ids in the slot. Sizes straddle the
    vector widths of every compiled clone (AVX-512 / AVX2 / baseline), so tails are covered."""
    rng = np.random.default_rng(9)
    sizes = list(range(1, 70)) + [127, 128, 129, 1000, 4097, 32768]
    for trial, n in enumerate(sizes * 3):
        nb = max(4 * n, 64)
        kind = trial % 4
        s = rng.integers(0, nb, n).astype(np.int64)
        d = np.sort(rng.choice(nb, n, replace=False)).astype(np.int64)
        if kind == 1:
            d = rng.permutation(d)  # unsorted: the bitmap path
        elif kind == 2 and n > 1:
            d[rng.integers(1, n)] = d[0]  # a duplicate
        elif kind == 3:
            (s if trial % 2 else d)[rng.integers(0, n)] = nb if trial % 3 else -1  # out of range / negative
        out = np.full(2 * n, -7, np.int64)
        want = _C.check_ids(src_ids=s.ctypes.data, dst_ids=d.ctypes.data, n=n, n_src=nb, n_dst=nb)
        got = _C.check_and_stage_ids(src_ids=s.ctypes.data, dst_ids=d.ctypes.data, n=n, n_src=nb, n_dst=nb,
                                     out=out.ctypes.data)
        assert got == want, (n, kind)
        if got[0] == 0:
            assert np.array_equal(out[:n], s) and np.array_equal(out[n:], d)
            assert got[3:] == (count_runs(s, d), count_runs(s), count_runs(d))
        else:
            assert (out == -7).all()  # bad ids are never staged


@needs_ext
def test_cpp_check_and_stage_ids32_agrees_with_check_ids_and_narrows_exactly():
    """The SM path's one-pass stager (IndexRing.copy_blocks): the same verdict as check_ids
    (code, position, value) for every outcome, the same run counts when valid, and when valid exactly src then dst ids as int32.
    Ids near 2**31 - 1 check the narrowing; sizes cover every clone's vector tail."""
    rng = np.random.default_rng(19)
    sizes = list(range(1, 70)) + [127, 128, 129, 1000, 4097, 32768]
    for trial, n in enumerate(sizes * 3):
        kind = trial % 4
        # ids up to 2**31 - 1, with dst sorted (no duplicate bitmap over 2**31 ids)
        nb = 2 ** 31 if trial % 5 == 0 and kind in (0, 3) else max(4 * n, 64)
        s = rng.integers(max(0, nb - 8 * n), nb, n).astype(np.int64)
        d = np.sort(rng.choice(np.arange(nb - 8 * n, nb) if nb > 8 * n else nb, n, replace=False)).astype(np.int64)
        if kind == 0 and trial % 2:  # runs: mostly consecutive src ids, as after coalescing
            s = (nb - 8 * n if nb > 8 * n else 0) + np.cumsum(1 + (rng.random(n) < 0.2) * rng.integers(1, 3, n)) - 1
        if kind == 1:
            d = rng.permutation(d)
        elif kind == 2 and n > 1:
            d[rng.integers(1, n)] = d[0]
        elif kind == 3:
            (s if trial % 2 else d)[rng.integers(0, n)] = nb if trial % 3 else -1
        want = _C.check_ids(src_ids=s.ctypes.data, dst_ids=d.ctypes.data, n=n, n_src=nb, n_dst=nb)
        out = np.full(2 * n, -7, np.int32)
        got = _C.check_and_stage_ids32(src_ids=s.ctypes.data, dst_ids=d.ctypes.data, n=n, n_src=nb, n_dst=nb,
                                       out=out.ctypes.data)
        assert got[:3] == want[:3], (n, kind)
        if got[0] == 0:
            assert got[3:] == want[3:], (n, kind)  # run counts: what auto's fast path reads
            assert np.array_equal(out[:n].astype(np.int64), s) and np.array_equal(out[n:].astype(np.int64), d)
    with pytest.raises(ValueError, match="int32"):
        _C.check_and_stage_ids32(src_ids=s.ctypes.data, dst_ids=d.ctypes.data, n=1, n_src=2 ** 31 + 1, n_dst=4,
                                 out=out.ctypes.data)


@needs_ext
def test_cpp_check_ids_duplicate_bitmap_is_reset_between_calls():
    d = np.array([5, 3, 5], np.int64)
    s = np.zeros(3, np.int64)
    assert _C.check_ids(src_ids=s.ctypes.data, dst_ids=d.ctypes.data, n=3, n_src=1, n_dst=10)[0] == 5
    d2 = np.array([5, 3, 7], np.int64)  # bits left over from the failed call would flag 5 again
    assert _C.check_ids(src_ids=s.ctypes.data, dst_ids=d2.ctypes.data, n=3, n_src=1, n_dst=10)[0] == 0


@needs_ext
@pytest.mark.parametrize("n_dst", [64, 1 << 12, 1 << 24])  # bitmap cleared by memset / by the touched words
def test_cpp_duplicate_check_first_position_and_clean_bitmap(n_dst):
    """The duplicate check reports the first repeat (not the first id repeated later) and leaves
    the per-thread bitmap clean after both outcomes, in either clearing mode."""
    rng = np.random.default_rng(n_dst)
    for trial in range(30):
        n = int(rng.integers(2, min(n_dst, 3000)))
        d = rng.choice(n_dst, n, replace=False).astype(np.int64)
        s = np.zeros(n, np.int64)
        dup = trial % 2 == 0
        if dup:
            i, j = sorted(rng.choice(n, 2, replace=False))
            d[j] = d[i]
        got = _C.check_ids(src_ids=s.ctypes.data, dst_ids=d.ctypes.data, n=n, n_src=1, n_dst=n_dst)
        if dup:
            first = next(k for k in range(n) if d[k] in set(d[:k].tolist()))
            assert got[:3] == (5, first, d[first])
        else:
            assert got[0] == 0
        # a clean bitmap: the same ids without the repeat pass
        ok = np.ascontiguousarray(np.unique(d)[::-1])  # descending: the bitmap path again
        assert _C.check_ids(src_ids=s.ctypes.data, dst_ids=ok.ctypes.data, n=ok.size, n_src=1, n_dst=n_dst)[0] == 0


@needs_ext
def test_cpp_duplicate_check_every_pair_position_within_and_across_groups_of_four():
    """The marking pass handles four ids per iteration: a repeat at any two positions (same
    group, neighbouring groups, the scalar tail) is found at its first position, and distinct ids
    sharing one bitmap word (all ids < 64 here) are never flagged."""
    rng = np.random.default_rng(4)
    for n in range(2, 14):
        base = rng.permutation(64)[:n].astype(np.int64)  # all in one 64-bit word
        s = np.zeros(n, np.int64)
        assert _C.check_ids(s.ctypes.data, base[::-1].copy().ctypes.data, n, 1, 64)[0] == 0
        for i in range(n):
            for j in range(i + 1, n):
                d = base.copy()
                d[j] = d[i]
                assert _C.check_ids(s.ctypes.data, d.ctypes.data, n, 1, 64)[:3] == (5, j, d[i]), (n, i, j)


def test_numpy_check_ids_errors():
    with pytest.raises(KVOffloadError, match="negative"):
        check_ids(np.array([-1]), np.array([0]), 4, 4)
    with pytest.raises(KVOffloadError, match="out of range"):
        check_ids(np.array([0]), np.array([4]), 4, 4)
    with pytest.raises(KVOffloadError, match="duplicate"):
        check_ids(np.array([0, 1]), np.array([2, 2]), 4, 4)
    with pytest.raises(KVOffloadError, match="length"):
        check_ids(np.array([0, 1]), np.array([2]), 4, 4)


@needs_ext
def test_cpp_plan_fragments_merges_and_addresses():
    # 2 fragments per block, both contiguous in the source (FlashInfer-like): one
    # descriptor per block; consecutive blocks -> consecutive slots merge further.
    F = 2
    table = np.array([[1000, 1064], [128, 128], [64, 64], [0, 64]], np.int64)
    blocks = np.array([0, 1, 5], np.int64)
    slots = np.array([3, 4, 0], np.int64)
    out = [np.zeros(6, np.uint64) for _ in range(3)]
    k = _C.plan_fragments(table=table.ctypes.data, num_frags=F, unified=1 << 20, unified_stride=128,
                          block_ids=blocks.ctypes.data, slot_ids=slots.ctypes.data, n=3, to_unified=True,
                          dsts=out[0].ctypes.data, srcs=out[1].ctypes.data, sizes=out[2].ctypes.data)
    assert k == 2
    assert out[1][:2].tolist() == [1000, 1000 + 5 * 128]
    assert out[0][:2].tolist() == [(1 << 20) + 3 * 128, 1 << 20]
    assert out[2][:2].tolist() == [256, 128]
    # FlashAttention-like: K and V far apart -> no merge inside a block
    table2 = np.array([[1000, 9000], [64, 64], [64, 64], [0, 64]], np.int64)
    k = _C.plan_fragments(table=table2.ctypes.data, num_frags=F, unified=0, unified_stride=128,
                          block_ids=blocks.ctypes.data, slot_ids=slots.ctypes.data, n=3, to_unified=False,
                          dsts=out[0].ctypes.data, srcs=out[1].ctypes.data, sizes=out[2].ctypes.data)
    assert k == 6  # K and V alternate, so only the previous descriptor could merge and none does
    assert out[2][:6].tolist() == [64] * 6 and out[1][:2].tolist() == [3 * 128, 3 * 128 + 64]


@needs_ext
def test_cpp_plan_dma_never_spans_two_registrations():
    # host pool of 10 blocks of 100 B registered in chunks of 300 B (3 blocks)
    bb, base = 100, 1 << 20
    s = np.arange(10, dtype=np.int64)
    out = [np.zeros(10, np.uint64) for _ in range(3)]
    k = _C.plan_dma(src_ids=s.ctypes.data, dst_ids=s.ctypes.data, n=10, src_base=1 << 30, dst_base=base,
                    src_stride=bb, dst_stride=bb, block_bytes=bb, coalesce=True, dsts=out[0].ctypes.data,
                    srcs=out[1].ctypes.data, sizes=out[2].ctypes.data, dst_seg_base=base, dst_seg_bytes=300)
    assert k == 4 and out[2][:4].tolist() == [300, 300, 300, 100]
    for d, sz in zip(out[0][:k], out[2][:k]):
        assert (int(d) - base) // 300 == (int(d) + int(sz) - 1 - base) // 300
    k = _C.plan_dma(src_ids=s.ctypes.data, dst_ids=s.ctypes.data, n=10, src_base=1 << 30, dst_base=base,
                    src_stride=bb, dst_stride=bb, block_bytes=bb, coalesce=True, dsts=out[0].ctypes.data,
                    srcs=out[1].ctypes.data, sizes=out[2].ctypes.data)
    assert k == 1 and out[2][0] == 1000


@needs_ext
def test_cpp_parallel_id_pass_matches_serial_at_piece_boundaries():
    """Jobs of >= 8192 pairs split their id pass over the host thread pool (work_pool.h): the
    verdict (code, first offending position and value), the run counts and the int32 ids
    staged must equal the serial pass's, for run breaks, order breaks, duplicates and bad ids
    placed on either side of piece boundaries; and the helpers really take pieces."""
    helpers, enabled, spin, _ = _C.host_threads()
    rng = np.random.default_rng(23)
    cases = []
    for n in (8191, 8192, 8193, 12289, 32768, 65537):
        nb = 4 * n
        for kind in range(6):
            s = np.arange(n, dtype=np.int64) + 7  # one long run: breaks only where placed
            d = np.arange(n, dtype=np.int64) * 2 + 1  # strictly increasing, no duplicates
            for cut in rng.choice([2048, 2049, 4096, n // 2, n - 1], 2):
                cut = int(min(max(cut, 1), n - 1))
                if kind == 1:
                    s[cut] += 3  # a src run break
                elif kind == 2:
                    d[cut] = d[cut - 1]  # a duplicate right across a boundary
                elif kind == 3:
                    d[cut:] = d[cut:][::-1].copy()  # order break, no duplicate: the bitmap decides
                elif kind == 4:
                    s[cut] = nb  # out of range
                elif kind == 5:
                    d[cut] = -1  # negative
            cases.append((s, d, nb))
    try:
        for s, d, nb in cases:
            n = len(s)
            got = {}
            for on in (0, 1):
                _C.host_threads(enable=on)
                out = np.full(2 * n, -7, np.int32)
                got[on] = (_C.check_ids(s.ctypes.data, d.ctypes.data, n, nb, nb),
                           _C.check_and_stage_ids32(s.ctypes.data, d.ctypes.data, n, nb, nb, out.ctypes.data), out)
            assert got[0][0] == got[1][0] and got[0][1] == got[1][1], n
            if got[1][0][0] == 0:
                assert got[1][0][3:] == (count_runs(s, d), count_runs(s), count_runs(d))
                assert np.array_equal(got[1][2], np.concatenate([s, d]).astype(np.int32))
        if helpers > 0:
            _C.host_threads(enable=1, spin_us=20000)
            s, d, nb = np.arange(32768, dtype=np.int64), np.arange(32768, dtype=np.int64), 32768
            before = _C.host_threads()[3]
            for _ in range(2000):  # helpers spin between back-to-back jobs, so they join
                _C.check_ids(s.ctypes.data, d.ctypes.data, len(s), nb, nb)
                if _C.host_threads()[3] > before:
                    break
            assert _C.host_threads()[3] > before, "no helper thread ever took a piece"
    finally:
        _C.host_threads(enable=int(enabled), spin_us=spin)


@pytest.mark.parametrize("pair", [True, False], ids=["int64_pair", "ctypes-fallback"])
def test_id_addrs_gives_each_arrays_first_id(monkeypatch, pair):
    """kernels.copy.id_addrs, the address of each id array that the C++ calls read: the first
    id's address for whole arrays and slices, through _C.int64_pair or (without it, or for a
    pair it refuses) numpy's .ctypes; the C++ reads ids where they lie."""
    import ctypes

    import kernels.copy as kc

    if pair and kc._PAIR is None:
        pytest.skip("kernels._C (with int64_pair) is not built")
    if not pair:
        monkeypatch.setattr(kc, "_PAIR", None)
    a = np.arange(100, 110, dtype=np.int64)
    b = np.arange(200, 210, dtype=np.int64)
    for x, y in ((a, b), (a[3:], b[:7]), (a[::2], b[:5])):
        pa, pb = kc.id_addrs(x, y)
        assert ctypes.c_int64.from_address(pa).value == x[0] and ctypes.c_int64.from_address(pb).value == y[0]
        assert (pa, pb) == (x.ctypes.data, y.ctypes.data)


@pytest.mark.parametrize("pair", [True, False], ids=["check_pair", "check_ids"])
def test_check_ids_fast_same_verdicts_either_call(monkeypatch, pair):
    """kernels.copy._check_ids_fast through _C.check_pair (addresses and check in one call) or,
    without it, int64_pair + _C.check_ids: the same run counts for valid ids and the same
    message for each bad id, on whole arrays and slices."""
    import kernels.copy as kc
    from kernels import KVOffloadError

    if kc._C is None or (pair and kc._CHECK_PAIR is None):
        pytest.skip("kernels._C (with check_pair) is not built")
    if not pair:
        monkeypatch.setattr(kc, "_CHECK_PAIR", None)
    si = np.array([0, 1, 2, 7, 8, 3], np.int64)
    di = np.array([4, 5, 6, 9, 10, 0], np.int64)
    # runs: both sides advance together at 0->1->2 and 7->8: 3 runs; src 3 runs; dst 3 runs
    assert kc._check_ids_fast(si, di, 16, 16) == (3, 3, 3)
    assert kc._check_ids_fast(si[3:], di[3:], 16, 16) == (2, 2, 2)
    bad = [((si, di, 8, 16), "src_ids contains block id 8, out of range for 8 blocks (position 4)"),
           ((si, di, 16, 10), "dst_ids contains block id 10, out of range for 10 blocks (position 4)"),
           ((np.array([1, -2], np.int64), di[:2], 16, 16), "src_ids contains a negative block id (-2)"),
           ((si[:2], np.array([3, -1], np.int64), 16, 16), "dst_ids contains a negative block id (-1)"),
           ((si[:3], np.array([3, 5, 3], np.int64), 16, 16), "dst_ids contains duplicate destination block 3")]
    for args, msg in bad:
        with pytest.raises(KVOffloadError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            kc._check_ids_fast(*args)
    with pytest.raises(KVOffloadError, match="differ in length"):
        kc._check_ids_fast(si, di[:3], 16, 16)
    assert kc._check_ids_fast(si[:0], di[:0], 16, 16) == (0, 0, 0)
