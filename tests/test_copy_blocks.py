"""copy_blocks: exact semantics against the torch reference.

CPU: the torch path and the Triton kernel under TRITON_INTERPRET=1.
GPU (marked): every method and direction, 16 B to 16 MiB, > 4 GiB buffers,
asynchrony.
"""
import time

import numpy as np
import pytest
import torch

from kernels import BlockCopier, KVOffloadError, copy_blocks
from tests.conftest import HAS_CUDA
from tests.reference import POISON, copy_blocks_ref, poisoned, random_bytes


def cpu_copier(method):
    cp = BlockCopier("cpu")
    if method not in cp.available_methods():
        pytest.skip(f"{method} needs TRITON_INTERPRET=1 on CPU tensors")
    return cp


def run_case(copier, method, bb, n_src, n_dst, n, src_dev, dst_dev, seed, pin=False, shuffle=True,
             src_off=0, dst_off=0):
    rng = np.random.default_rng(seed)
    src = random_bytes((n_src * bb + src_off,), device=src_dev, seed=seed, pin=pin and src_dev == "cpu")
    dst = poisoned(n_dst * bb + dst_off, device=dst_dev, pin=pin and dst_dev == "cpu")
    s = src[src_off:].view(n_src, bb)
    d = dst[dst_off:].view(n_dst, bb)
    si = rng.choice(n_src, n, replace=True) if shuffle else np.arange(n)
    di = rng.permutation(n_dst)[:n] if shuffle else np.arange(n)
    want = copy_blocks_ref(s, d, si, di, bb)
    copier.copy(s, d, si, di, method=method)
    if HAS_CUDA:
        torch.cuda.synchronize()
    got = d.cpu()
    assert torch.equal(got, want), f"{method} bb={bb} n={n}: mismatch"
    # bytes outside the destination blocks (prefix padding) stay untouched
    if dst_off:
        assert (dst[:dst_off].cpu() == POISON).all()
    untouched = np.setdiff1d(np.arange(n_dst), di)
    if untouched.size:
        assert (got[torch.from_numpy(untouched)] == POISON).all()


CPU_METHODS = ["torch", "triton"]


@pytest.mark.parametrize("method", CPU_METHODS)
@pytest.mark.parametrize("bb", [1, 3, 16, 48, 100, 4096, 8200])
def test_cpu_methods_exact(method, bb):
    cp = cpu_copier(method)
    run_case(cp, method, bb, 13, 17, 11, "cpu", "cpu", seed=bb)


@pytest.mark.parametrize("method", CPU_METHODS)
def test_cpu_misaligned_base(method):
    # 16-byte path impossible: bases offset by odd bytes -> narrower vectors
    cp = cpu_copier(method)
    run_case(cp, method, 64, 9, 9, 7, "cpu", "cpu", seed=3, src_off=1, dst_off=3)


@pytest.mark.parametrize("method", CPU_METHODS)
def test_cpu_typed_tensors_and_pairs(method):
    cp = cpu_copier(method)
    g = torch.Generator().manual_seed(0)
    src = torch.randn(10, 2, 16, 8, generator=g).to(torch.bfloat16)
    dst = torch.full_like(src, float("nan"))
    pairs = np.array([[9, 0], [0, 9], [4, 4]])
    cp.copy(src, dst, pairs, method=method)
    for s, d in pairs:
        assert torch.equal(dst[d].view(torch.int16), src[s].view(torch.int16))
    assert torch.isnan(dst[1].float()).all()


def test_cpu_empty_job():
    cp = BlockCopier("cpu")
    s, d = torch.ones(4, 16), torch.zeros(4, 16)
    cp.copy(s, d, [], [], method="torch")
    assert d.sum() == 0


def test_triton_kernel_cpu_interpreter_multi_chunk_blocks():
    # blocks bigger than one program chunk (8 KiB) exercise the chunk loop
    cp = cpu_copier("triton")
    run_case(cp, "triton", 20000, 5, 6, 5, "cpu", "cpu", seed=7)


# ------------------------------------------------------------------ GPU
GPU_METHODS = ["dma", "cuda", "triton", "staged", "torch"]
DIRS = {"d2h": ("cuda", "cpu"), "h2d": ("cpu", "cuda"), "d2d": ("cuda", "cuda")}


@pytest.mark.gpu
@pytest.mark.parametrize("method", GPU_METHODS)
@pytest.mark.parametrize("d", list(DIRS))
@pytest.mark.parametrize("bb", [16, 48, 4096, 32768, 2 << 20, 16 << 20])
def test_gpu_roundtrip_exact(method, d, bb):
    if method == "staged" and d == "d2d":
        pytest.skip("staged is host<->device only")
    cp = BlockCopier("cuda", staging_bytes=32 << 20)
    n = 7 if bb >= (2 << 20) else 1001
    run_case(cp, method, bb, n + 3, n + 5, n, *DIRS[d], seed=bb + len(method), pin=True)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["dma", "cuda", "triton", "staged"])
def test_gpu_contiguous_runs_and_odd_sizes(method):
    cp = BlockCopier("cuda", staging_bytes=1 << 20)
    for bb in (3, 6, 1000, 12340):
        for d in ("d2h", "h2d"):
            run_case(cp, method, bb, 301, 301, 257, *DIRS[d], seed=bb, pin=True, shuffle=False)
            run_case(cp, method, bb, 300, 301, 255, *DIRS[d], seed=bb + 1, pin=True, src_off=5, dst_off=7)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["dma", "cuda", "triton", "staged"])
def test_gpu_roundtrip_d2h_h2d(method):
    """Store to host then load back into other GPU blocks: bit-exact."""
    cp = BlockCopier("cuda")
    bb, n = 32768, 513
    g = random_bytes((2 * n * bb,), device="cuda", seed=11).view(2 * n, bb)
    h = poisoned(n * bb, pin=True).view(n, bb)
    rng = np.random.default_rng(0)
    gi = rng.permutation(n)  # first half of g
    hi = rng.permutation(n)
    cp.copy(g, h, gi, hi, method=method)
    back = n + rng.permutation(n)  # second half
    g[n:].fill_(POISON)
    cp.copy(h, g, hi, back, method=method)
    torch.cuda.synchronize()
    assert torch.equal(g[torch.from_numpy(back).cuda()], g[torch.from_numpy(gi).cuda()])


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["dma", "cuda", "triton"])
def test_gpu_buffers_over_4gib(method):
    free, _ = torch.cuda.mem_get_info()
    if free < (12 << 30):
        pytest.skip("not enough GPU memory")
    bb = 1 << 20
    nb = 5 * 1024 + 3  # > 5 GiB
    big = torch.empty(nb * bb, dtype=torch.uint8, device="cuda")
    big.fill_(POISON)
    small = random_bytes((8 * bb,), pin=True).view(8, bb)
    hi_ids = np.array([nb - 1, nb - 2, 4100, 4097])  # byte offsets > 4 GiB
    cp = BlockCopier("cuda")
    cp.copy(small, big.view(nb, bb), np.arange(4), hi_ids, method=method)
    back = poisoned(8 * bb, pin=True).view(8, bb)
    cp.copy(big.view(nb, bb), back, hi_ids, np.arange(4) + 4, method=method)
    torch.cuda.synchronize()
    assert torch.equal(back[4:], small[:4])
    assert (back[:4] == POISON).all()
    assert (big[: 4096 * bb] == POISON).all()


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["dma", "cuda", "triton", "staged", "auto"])
def test_gpu_async_host_returns_at_once(method):
    """Queue a long GPU sleep, then copy: the call must return before the sleep ends."""
    cp = BlockCopier("cuda")
    bb, n = 65536, 256
    g = random_bytes((n * bb,), device="cuda", seed=2).view(n, bb)
    h = poisoned(n * bb, pin=True).view(n, bb)
    ids = np.arange(n)[::-1].copy()
    cp.copy(g, h, ids, ids, method=method)  # warm-up (JIT, ring, staging)
    torch.cuda.synchronize()
    s = torch.cuda.current_stream()
    torch.cuda._sleep(2_000_000_000)  # ~1 s at ~2 GHz
    t0 = time.perf_counter()
    cp.copy(g, h, ids, ids, method=method, stream=s)
    dt = time.perf_counter() - t0
    assert not s.query(), "sleep finished before the check; test is void"
    assert dt < 0.1, f"{method}: copy call blocked the host for {dt * 1e3:.1f} ms"
    torch.cuda.synchronize()
    assert torch.equal(h.cpu(), g.cpu())


@pytest.mark.gpu
def test_gpu_functional_and_side_stream():
    s = torch.cuda.Stream()
    g = random_bytes((64 * 4096,), device="cuda", seed=5).view(64, 4096)
    h = poisoned(64 * 4096, pin=True).view(64, 4096)
    ev = torch.cuda.Event()
    ev.record()
    s.wait_event(ev)
    used = copy_blocks(g, h, np.arange(64), np.arange(64), stream=s)
    s.synchronize()
    assert used in ("dma", "cuda", "triton", "staged")
    assert torch.equal(h.cpu(), g.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("uva", [False, True], ids=["ids-uploaded", "ids-via-uva"])
@pytest.mark.parametrize("method", ["cuda", "triton", "staged"])
def test_gpu_ring_wraps_with_many_jobs(method, uva):
    """Two ring slots, 20 launches queued back to back: a slot is refilled only after the
    launch that read it ran (with uva the kernel reads the pinned slot itself, so refilling
    it early would corrupt the copy in flight)."""
    cp = BlockCopier("cuda", ring_slots=2, ring_capacity=64, ids_via_uva=uva, staging_bytes=64 << 10)
    cp.staged_chunk_bytes = 8 << 10
    g = random_bytes((1000 * 512,), device="cuda", seed=9).view(1000, 512)
    h = poisoned(1000 * 512, pin=True).view(1000, 512)
    ids = np.random.default_rng(0).permutation(1000)
    for k in range(0, 1000, 100):  # 10 jobs, each split into 2 launches of <= 64
        cp.copy(g, h, ids[k:k + 100], ids[k:k + 100], method=method)
    torch.cuda.synchronize()
    assert torch.equal(h.cpu(), g.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("d", ["d2h", "h2d"])
@pytest.mark.parametrize("method,ring", [("cuda", "uva"), ("triton", "uva"), ("cuda", "uploads")])
def test_gpu_ring_reuses_a_slot_only_once_read(method, ring, d):
    """The ring hands the slot released last to the next job when the GPU is done with it
    (its lines are still in the CPU cache), else the next slot in ring order. With ids read
    through UVA a slot rewritten while a queued kernel still has to read it would send that
    kernel's blocks to the wrong places: jobs queued behind a GPU sleep, then after a sync,
    alternately, must all land exactly. ring "uploads": a ring that uploads ids, whose small
    D2H and H2D cuda jobs read them through UVA all the same (ids_uva_*_max_bytes)."""
    cp = BlockCopier("cuda", ring_slots=3, ring_capacity=64, ids_via_uva=ring == "uva")
    g = random_bytes((960 * 512,), device="cuda", seed=11).view(960, 512)
    h = random_bytes((960 * 512,), seed=12, pin=True).view(960, 512)
    src, dst = (g, poisoned(960 * 512, pin=True).view(960, 512)) if d == "d2h" else \
        (h, poisoned(960 * 512, device="cuda").view(960, 512))
    ids = np.random.default_rng(1).permutation(960)
    for r, k in enumerate(range(0, 960, 60)):
        if r % 4 == 0:
            torch.cuda.synchronize()  # the last slot is free: the next job reuses it
        elif r % 4 == 1:
            torch.cuda._sleep(2_000_000)  # the jobs after this queue behind the GPU
        cp.copy(src, dst, ids[k:k + 60], ids[k:k + 60][::-1].copy(), method=method)
    torch.cuda.synchronize()
    want = torch.empty(960, 512, dtype=torch.uint8)
    want[torch.from_numpy(ids.reshape(-1, 60)[:, ::-1].copy().ravel())] = \
        src.cpu()[torch.from_numpy(ids)]
    assert torch.equal(dst.cpu(), want)


class _RingSpy:
    """Forwards to an _C.IndexRing, recording copy_blocks' ids_uva argument per call."""

    def __init__(self, ring):
        self._ring, self.ids_uva = ring, []

    def copy_blocks(self, *a, **kw):
        self.ids_uva.append(kw.get("ids_uva", a[17] if len(a) > 17 else False))
        return self._ring.copy_blocks(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._ring, name)


@pytest.mark.gpu
def test_gpu_small_host_cuda_jobs_read_ids_through_uva():
    """On a ring that uploads ids, a D2H (H2D) cuda job of the warp shape of up to
    ids_uva_d2h_max_bytes (ids_uva_h2d_max_bytes) reads them from the pinned slot (no
    upload); D2D, bigger jobs and the cta and bulk shapes get the upload. Each job
    exact, bytes outside the destination blocks untouched; stage_checked(ids_uva=True) hands
    out the pinned slot's own addresses."""
    cp = BlockCopier("cuda", ring_slots=3, ring_capacity=64, ids_uva_d2h_max_bytes=100 * 4096,
                     ids_uva_h2d_max_bytes=50 * 4096)
    r = cp._ring_get()
    assert not r.ring.uva
    ids = np.arange(5, dtype=np.int64)
    code, _, _, slot, ds, dd = r.ring.stage_checked(ids.ctypes.data, ids.ctypes.data, 5, 8, 8, 0, ids_uva=True)
    assert code == 0 and ds == r.host[slot].data_ptr() and dd == ds + 5 * 8
    r.release(slot, 0)
    code, _, _, slot, ds, dd = r.ring.stage_checked(ids.ctypes.data, ids.ctypes.data, 5, 8, 8, 0)
    assert code == 0 and ds == r.dev[slot].data_ptr() and dd == ds + 5 * 8
    r.release(slot, 0)
    torch.cuda.synchronize()
    spy = r.ring = _RingSpy(r.ring)
    bb, nb = 4096, 300
    g = random_bytes((nb * bb,), device="cuda", seed=21).view(nb, bb)
    rng = np.random.default_rng(5)
    # (direction, n): 60 -> one ring slot, BoundCopy; 100 -> two launches through _run_kernel
    for d, n, want_uva in (("d2h", 60, True), ("d2h", 100, True), ("d2h", 101, False),
                           ("h2d", 50, True), ("h2d", 60, False), ("h2d", 101, False), ("d2d", 60, False)):
        src = g if d != "h2d" else random_bytes((nb * bb,), seed=n, pin=True).view(nb, bb)
        dst = poisoned(nb * bb, device="cpu" if d == "d2h" else "cuda", pin=d == "d2h").view(nb, bb)
        si, di = rng.permutation(nb)[:n], rng.permutation(nb)[:n]
        spy.ids_uva.clear()
        assert cp.copy(src, dst, si, di, method="cuda") == "cuda"
        torch.cuda.synchronize()
        assert spy.ids_uva and all(u == want_uva for u in spy.ids_uva), (d, n, spy.ids_uva)
        want = torch.full((nb, bb), POISON, dtype=torch.uint8)
        want[torch.from_numpy(di)] = src.cpu()[torch.from_numpy(si)]
        assert torch.equal(dst.cpu(), want), (d, n)
    for v in ("cta", "bulk"):  # these shapes read a block's ids before its copy: uploaded ids
        cp.cuda_variant = v
        spy.ids_uva.clear()
        dst = poisoned(nb * bb, pin=True).view(nb, bb)
        cp.copy(g, dst, np.arange(10), np.arange(10)[::-1].copy(), method="cuda")
        torch.cuda.synchronize()
        assert spy.ids_uva == [False], v
        assert torch.equal(dst[:10].cpu(), g[:10].cpu().flip(0)) and (dst[10:] == POISON).all()
    cp.cuda_variant = "auto"
    cp.ids_uva_d2h_max_bytes = cp.ids_uva_h2d_max_bytes = 0
    h = random_bytes((nb * bb,), seed=3, pin=True).view(nb, bb)
    for src, dst in ((g, poisoned(nb * bb, pin=True).view(nb, bb)), (h, poisoned(nb * bb, device="cuda").view(nb, bb))):
        spy.ids_uva.clear()
        cp.copy(src, dst, np.arange(10), np.arange(10)[::-1].copy(), method="cuda")
        torch.cuda.synchronize()
        assert spy.ids_uva == [False]
        assert torch.equal(dst[:10].cpu(), src[:10].cpu().flip(0)) and (dst[10:].cpu() == POISON).all()


@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 7)])
def test_cuda_copier_without_a_visible_gpu_is_a_clear_error(device, monkeypatch):
    """BlockCopier on a CUDA device that is not there: KVOffloadError naming the cause, raised
    before torch touches CUDA (whose own error on a CPU-only build is a bare AssertionError).
    The CUDA runtime is stubbed to report none, so this runs on a GPU box too; the negative
    control is the next test's real device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("CUDA touched"))
    with pytest.raises(KVOffloadError, match="no CUDA device is visible"):
        BlockCopier(device)
    with pytest.raises(KVOffloadError, match="no CUDA device is visible"):
        BlockCopier(device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only box's real error")
def test_cuda_copier_on_a_cpu_box_unstubbed():
    with pytest.raises(KVOffloadError, match="no CUDA device is visible"):
        BlockCopier("cuda")


def test_cuda_copier_past_the_visible_devices_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(KVOffloadError, match="sees 2 CUDA device"):
        BlockCopier("cuda:2")


@pytest.mark.parametrize("arg", ["ids_uva_d2h_max_bytes", "ids_uva_h2d_max_bytes"])
def test_ids_uva_max_bytes_is_checked(arg):
    for bad in (-1, 1.5, "8"):
        with pytest.raises(KVOffloadError, match=arg):
            BlockCopier("cpu", **{arg: bad})


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["cuda", "triton", "staged"])
@pytest.mark.parametrize("d", ["d2h", "h2d", "d2d"])
def test_gpu_ids_via_uva_exact(method, d):
    if method == "staged" and d == "d2d":
        pytest.skip("staged is host<->device only")
    cp = BlockCopier("cuda", ids_via_uva=True, staging_bytes=4 << 20)
    assert cp._ring_get().ring.uva
    for bb in (16, 4096, 32768, 1 << 20):
        n = 5 if bb >= (1 << 20) else 333
        run_case(cp, method, bb, n + 3, n + 5, n, *DIRS[d], seed=bb + 7, pin=True)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["warp", "cta", "bulk"])
@pytest.mark.parametrize("d", ["d2h", "h2d", "d2d"])
def test_gpu_cuda_kernel_variants(variant, d):
    """Each kernel shape exact; 'bulk' (TMA, 8 KiB chunks, 4 stages per CTA) with blocks of one
    vector, a partial last chunk (8208, 3 x 8192 + 48), many chunks per CTA (1 MiB) and
    16-byte-aligned offsets; unaligned blocks or offsets fall back to 'warp'."""
    cp = BlockCopier("cuda", num_ctas=5)
    cp.cuda_variant = variant
    for bb in (16, 4100, 8208, 3 * 8192 + 48, 65536, 1 << 20):
        run_case(cp, "cuda", bb, 41, 43, 37, *DIRS[d], seed=bb, pin=True)
        run_case(cp, "cuda", bb, 41, 43, 37, *DIRS[d], seed=bb + 1, pin=True, src_off=4, dst_off=12)
        run_case(cp, "cuda", bb, 41, 43, 37, *DIRS[d], seed=bb + 2, pin=True, src_off=16, dst_off=48)


@pytest.mark.gpu
def test_gpu_bulk_variant_one_cta_and_many():
    """The bulk kernel's stage ring: one CTA walking 300 chunks (the refill and parity
    flips), and more CTAs than chunks."""
    for ctas, bb, n in ((1, 8192 * 5 + 16, 60), (64, 32, 7)):
        cp = BlockCopier("cuda", num_ctas=ctas)
        cp.cuda_variant = "bulk"
        for d in ("d2h", "h2d"):
            run_case(cp, "cuda", bb, n + 3, n + 5, n, *DIRS[d], seed=ctas + bb, pin=True)


def test_cuda_variant_names_checked():
    from kernels import KVOffloadError

    cp = BlockCopier("cpu")
    cp.cuda_variant = "tma"
    with pytest.raises(KVOffloadError, match="cuda_variant"):
        cp._variant(4096, 16)
    cp.cuda_variant = "bulk"  # no sm_90 here (or no GPU at all): falls back to warp chunks
    assert cp._variant(4096, 16) == (2 if cp._bulk_ok else 0)
    assert cp._variant(4100, 4) == 0
    cp.cuda_variant = "auto"  # warp chunks by default
    assert cp._variant(4096, 16, h2d=True) == 0
    cp.bulk_h2d = True  # bulk for H2D where it can run
    assert cp._variant(4096, 16, h2d=True) == (2 if cp._bulk_ok else 0)
    assert cp._variant(4096, 16, h2d=False) == 0
    assert cp._variant(4100, 4, h2d=True) == 0
    cp.bulk_h2d = False
    cp.bulk_min_bytes = 4096
    assert cp._variant(4096, 16) == (2 if cp._bulk_ok else 0)


def test_default_ctas_per_method_and_direction():
    """Triton H2D gets its own default program count; every other SM path the copier's;
    an explicit num_ctas always wins."""
    cp = BlockCopier("cpu", num_ctas=12, triton_h2d_ctas=40)
    assert cp.default_ctas("triton", "h2d") == 40
    for m, d in (("triton", "d2h"), ("triton", "d2d"), ("cuda", "h2d"), ("cuda", "d2h"), ("staged", "h2d")):
        assert cp.default_ctas(m, d) == 12, (m, d)
    assert cp._check_launch_args(None, None, "triton", "h2d") == 40
    assert cp._check_launch_args(None, 3, "triton", "h2d") == 3
    assert BlockCopier("cpu").default_ctas("triton", "h2d") == 32


@pytest.mark.gpu
def test_gpu_triton_h2d_default_programs_bound_and_exact():
    """bind() and copy() resolve Triton H2D to triton_h2d_ctas programs, other directions to
    num_ctas, and the copies stay exact with each count."""
    cp = BlockCopier("cuda", num_ctas=16, triton_h2d_ctas=32)
    g = torch.empty(64, 4096, dtype=torch.uint8, device="cuda")
    h = torch.empty(64, 4096, dtype=torch.uint8, pin_memory=True)
    assert cp.bind(h, g, method="triton").num_ctas == 32
    assert cp.bind(g, h, method="triton").num_ctas == 16
    assert cp.bind(h, g, method="cuda").num_ctas == 16
    assert cp.bind(h, g, method="triton", num_ctas=7).num_ctas == 7
    for d in ("h2d", "d2h"):
        run_case(cp, "triton", 32768, 70, 90, 61, *DIRS[d], seed=5, pin=True)
        run_case(cp, "triton", 4096, 700, 900, 613, *DIRS[d], seed=6, pin=True)


@pytest.mark.gpu
def test_gpu_staged_pipeline_many_chunks_both_directions_in_flight():
    """Tiny chunks force many alternations of the two staging halves; two jobs queued back to back."""
    cp = BlockCopier("cuda", staging_bytes=64 << 10)
    cp.staged_chunk_bytes = 8 << 10
    bb, n = 4096, 300
    g = random_bytes((n * bb,), device="cuda", seed=21).view(n, bb)
    h = poisoned(n * bb, pin=True).view(n, bb)
    g2 = poisoned(n * bb, device="cuda").view(n, bb)
    perm = np.random.default_rng(1).permutation(n)
    cp.copy(g, h, perm, np.arange(n), method="staged")
    cp.copy(h, g2, np.arange(n), perm[::-1].copy(), method="staged")
    torch.cuda.synchronize()
    assert torch.equal(h.cpu(), g.cpu()[torch.from_numpy(perm)])
    assert torch.equal(g2[torch.from_numpy(perm[::-1].copy()).cuda()], g[torch.from_numpy(perm).cuda()])


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["cuda", "triton", "dma"])
@pytest.mark.parametrize("d", ["d2h", "h2d", "d2d"])
def test_gpu_bind_exact_and_reusable(method, d):
    """BlockCopier.bind: buffers checked once; repeated calls with new ids stay exact, poison
    outside the destination blocks survives, and bad ids raise with nothing queued."""
    from kernels import KVOffloadError

    cp = BlockCopier("cuda")
    bb, n_src, n_dst = 4096 + 16, 300, 310
    src_dev, dst_dev = DIRS[d]
    src = random_bytes((n_src * bb,), device=src_dev, seed=5, pin=src_dev == "cpu").view(n_src, bb)
    dst = poisoned(n_dst * bb, device=dst_dev, pin=dst_dev == "cpu").view(n_dst, bb)
    bound = cp.bind(src, dst, method=method)
    want = dst.cpu().clone()
    rng = np.random.default_rng(1)
    for k in range(3):  # each call writes a disjoint set of destination blocks
        si = rng.choice(n_src, 90, replace=True)
        di = rng.permutation(np.arange(k * 100, k * 100 + 100))[:90]
        want = copy_blocks_ref(src, want, si, di, bb)
        assert bound(si, di.tolist() if k == 1 else di) == method
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), want)
    for bad_si, bad_di, msg in (([0, 1], [5, 5], "duplicate"), ([n_src], [0], "out of range"),
                                ([-1], [0], "negative"), ([0, 1], [2], "differ in length")):
        with pytest.raises(KVOffloadError, match=msg):
            bound(bad_si, bad_di)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), want)  # nothing was queued by the failed calls


@pytest.mark.gpu
def test_gpu_bind_rejects_bad_buffers_and_falls_back_past_the_ring():
    from kernels import KVOffloadError

    cp = BlockCopier("cuda", ring_capacity=64)
    g = random_bytes((200 * 256,), device="cuda", seed=2).view(200, 256)
    with pytest.raises(KVOffloadError, match="pageable"):
        cp.bind(g, torch.zeros(10, 256, dtype=torch.uint8), method="cuda")
    with pytest.raises(KVOffloadError, match="overlap"):
        cp.bind(g[:100], g[50:150], method="cuda")
    with pytest.raises(KVOffloadError, match="bind"):
        cp.bind(g[:100], g[100:], method="staged")
    # a job longer than one ring slot (64 pairs) is split, still exact
    h = poisoned(150 * 256, pin=True).view(150, 256)
    si = np.random.default_rng(3).permutation(200)[:150]
    want = copy_blocks_ref(g, h.clone(), si, np.arange(150), 256)
    cp.bind(g, h, method="cuda")(si, np.arange(150))
    torch.cuda.synchronize()
    assert torch.equal(h, want)
    # copy() of an explicit method reuses a cached BoundCopy and still sees variant changes
    h2 = poisoned(150 * 256, pin=True).view(150, 256)
    for variant in ("warp", "cta", "bulk", "warp"):
        cp.cuda_variant = variant
        h2.fill_(0x5A)
        cp.copy(g, h2, si[:60], np.arange(60), method="cuda")
        torch.cuda.synchronize()
        assert torch.equal(h2[:60], want[:60]) and (h2[60:] == 0x5A).all()
    assert len(cp._bound) == 1


@pytest.mark.gpu
def test_gpu_stream_busy_probe():
    """The auto path's busy probe (kernels._C.stream_busy): True while a kernel is queued on
    the current stream, False once it is done; it never waits."""
    from kernels._ext import _C

    cp = BlockCopier("cuda")
    torch.cuda.synchronize()
    assert cp._stream_busy() is False
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)  # ~0.1 s
        t0 = time.perf_counter()
        assert cp._stream_busy() is True
        assert time.perf_counter() - t0 < 0.05  # did not wait for the sleep
        assert _C.stream_busy(s.cuda_stream, cp.device.index) is True
    s.synchronize()
    assert _C.stream_busy(s.cuda_stream, cp.device.index) is False


@pytest.mark.gpu
@pytest.mark.parametrize("d", ["d2h", "h2d", "d2d"])
def test_gpu_auto_cached_path_exact_and_checked(d):
    """auto on buffers it has seen takes the cached path (checks cached, pick memoised, issued
    through a BoundCopy): repeated calls stay exact, bad ids still raise before anything is
    queued, and pageable host memory is still refused."""
    cp = BlockCopier("cuda")
    for seed, bb in ((1, 4096), (2, 4096), (3, 1 << 20)):
        run_case(cp, "auto", bb, 40, 50, 33, *DIRS[d], seed=seed, pin=True)
    src = random_bytes((8 * 4096,), device=DIRS[d][0], seed=5, pin=True).view(8, 4096)
    dst = poisoned(8 * 4096, device=DIRS[d][1], pin=True).view(8, 4096)
    cp.copy(src, dst, [0, 1], [2, 3], method="auto")
    torch.cuda.synchronize()
    before = dst.clone()
    for bad in (([0, 8], [1, 2]), ([0, 1], [2, 2]), ([-1], [0])):
        with pytest.raises(KVOffloadError):
            cp.copy(src, dst, *bad, method="auto")
    torch.cuda.synchronize()
    assert torch.equal(dst, before)
    if d != "d2d":
        host = torch.zeros(8 * 4096, dtype=torch.uint8).view(8, 4096)  # pageable
        a, b = (src, host) if d == "d2h" else (host, dst)
        with pytest.raises(KVOffloadError, match="pinned|pageable"):
            cp.copy(a, b, [0], [1], method="auto")


@pytest.mark.gpu
@pytest.mark.parametrize("d", ["d2h", "h2d", "d2d"])
def test_gpu_auto_fused_path_exact_and_as_chosen(d, monkeypatch):
    """auto on an idle GPU, shapes seen before: random small blocks go through the fused
    C++ check + stage + launch without a separate id check; ids that coalesce are handed
    back unqueued and copied by what `choose` picks for their run counts. Every call: the
    method `choose` would pick, exact bytes, untouched bytes outside, and bad ids rejected
    with nothing written."""
    import kernels.copy as kc
    from kernels._ext import _C

    cp = BlockCopier("cuda")
    bb, nb, n = 4096, 4096, 1000
    dev = {"d2h": ("cuda", "cpu"), "h2d": ("cpu", "cuda"), "d2d": ("cuda", "cuda")}[d]
    src = random_bytes((nb * bb,), device=dev[0], seed=11, pin=dev[0] == "cpu").view(nb, bb)
    if dev[0] == "cuda":
        src = src.cuda()
    dst = poisoned(nb * bb, device=dev[1], pin=dev[1] == "cpu").view(nb, bb)
    checks = []
    real = kc._check_ids_fast
    monkeypatch.setattr(kc, "_check_ids_fast", lambda *a: checks.append(1) or real(*a))
    rng = np.random.default_rng(3)
    cases = {"random": (rng.permutation(nb)[:n], rng.permutation(nb)[:n]),
             "one run": (np.arange(100, 100 + n), np.arange(2000, 2000 + n)),
             "runs of 16": (np.concatenate([np.arange(k * 64, k * 64 + 16) for k in range(n // 16)]),
                            np.concatenate([np.arange(k * 32, k * 32 + 16) for k in range(n // 16)]))}
    avail = cp.available_methods()
    for name, (si, di) in cases.items():
        for call in range(3):  # the first sighting of a shape takes the ordinary path
            dst.fill_(0x5A)
            checks.clear()
            _, _, _, rb, rs, rd = _C.check_ids(si.ctypes.data, di.ctypes.data, len(si), nb, nb)
            want_method = cp.cost_model.choose(d, bb, len(si), False, avail, n_desc=rb,
                                               n_desc_host=rs if d == "h2d" else rd)
            got_method = cp.copy(src, dst, si, di, busy=False)
            torch.cuda.synchronize()
            assert got_method == want_method == cp.last_method, (name, call)
            want = torch.full((nb, bb), 0x5A, dtype=torch.uint8)
            want[torch.from_numpy(di)] = src.cpu()[torch.from_numpy(si)]
            assert torch.equal(dst.cpu(), want), (name, call)
            if name == "random" and call:
                assert got_method == "cuda" and not checks  # fused: no separate id check
    assert cp.cost_model.kernel_limits(d, bb, n, avail) is not None
    si, di = cases["random"]
    dst.fill_(0x5A)
    torch.cuda.synchronize()
    for bad_si, bad_di, msg in ((si, np.where(np.arange(n) == 7, di[3], di), "duplicate"),
                                (np.where(np.arange(n) == 9, nb, si), di, "out of range"),
                                (si, np.where(np.arange(n) == 2, -1, di), "negative")):
        with pytest.raises(KVOffloadError, match=msg):
            cp.copy(src, dst, bad_si, bad_di, busy=False)
    torch.cuda.synchronize()
    assert (dst.cpu() == 0x5A).all()
    # the settled limits are remembered per cost model: a new one is asked on the next call
    assert cp._auto_lims[0] is cp.cost_model and (d, bb, n) in cp._auto_lims[1]
    from tests.test_cost_model import one_curve_model

    other = one_curve_model()
    for m in ("cuda", "triton"):
        other.table["gbps"][d][m] = [1e-3] * len(other.table["sizes"])  # SM kernels never win
    cp.cost_model = other
    for call in range(3):
        dst.fill_(0x5A)
        got = cp.copy(src, dst, si, di, busy=False)
        torch.cuda.synchronize()
        assert got not in ("cuda", "triton") and got == cp.last_method, (call, got)
        want = torch.full((nb, bb), 0x5A, dtype=torch.uint8)
        want[torch.from_numpy(di)] = src.cpu()[torch.from_numpy(si)]
        assert torch.equal(dst.cpu(), want), call


def test_triton_spec_key_separates_what_triton_specialises_on():
    """The fast launcher reuses a compiled kernel only for calls Triton would compile the
    same way: ints by divisibility by 16, == 1 and int32 range; pointers by dtype and
    16-byte alignment; constexprs by value."""
    from kernels.triton_copy import DevPtr, _spec_key

    base = _spec_key((DevPtr(4096, torch.int64), 32, 7, 1 << 20), (8192, 2))
    assert base == _spec_key((DevPtr(8192, torch.int64), 48, 9, 1 << 21), (8192, 2))
    for args, consts in (((DevPtr(4104, torch.int64), 32, 7, 1 << 20), (8192, 2)),  # pointer alignment
                         ((DevPtr(4096, torch.int32), 32, 7, 1 << 20), (8192, 2)),  # pointer dtype
                         ((DevPtr(4096, torch.int64), 33, 7, 1 << 20), (8192, 2)),  # divisibility
                         ((DevPtr(4096, torch.int64), 32, 1, 1 << 20), (8192, 2)),  # == 1
                         ((DevPtr(4096, torch.int64), 32, 7, 1 << 40), (8192, 2)),  # int64 range
                         ((DevPtr(4096, torch.int64), 32, 7, 1 << 20), (4096, 2)),  # constexpr
                         ((DevPtr(4096, torch.int64), 32, 7, 1 << 20), (8192, 1))):
        assert _spec_key(args, consts) != base


@pytest.mark.gpu
def test_gpu_triton_fast_launch_exact_across_specialisations():
    """After the first launch of a specialisation the compiled kernel is launched directly;
    calls alternating between specialisations (aligned and unaligned offsets, block sizes)
    stay exact, and the direct path is really taken."""
    from kernels import triton_copy

    cp = BlockCopier("cuda")
    for rep in range(3):
        for bb, so, do in ((4096, 0, 0), (4100, 4, 12), (32768, 16, 48), (24, 8, 0)):
            run_case(cp, "triton", bb, 41, 43, 37, *DIRS["d2h"], seed=bb + rep, pin=True, src_off=so, dst_off=do)
    assert any(v for v in triton_copy._compiled.values())


def _fake_ck(names, signature, constants=None, function=0, **meta):
    """A stand-in for a Triton CompiledKernel: what param_spec/fn_spec read."""
    from types import SimpleNamespace

    md = dict(num_warps=4, shared=256, num_ctas=1, global_scratch_size=0, profile_scratch_size=0,
              launch_cooperative_grid=False, launch_pdl=False)
    md.update(meta)
    md = {k: v for k, v in md.items() if v is not ...}  # ...: the attribute is absent
    src = SimpleNamespace(fn=SimpleNamespace(arg_names=list(names)), signature=signature,
                          constants=constants or {})
    return SimpleNamespace(src=src, metadata=SimpleNamespace(**md), function=function)


def test_triton_param_spec_rules():
    """What a C++ launch of a compiled Triton kernel passes: kept arguments by size (pointer
    and int64 8 bytes, int32 4), dropped constants, one null per declared scratch buffer;
    anything it cannot reproduce is declined (None), never guessed."""
    from kernels.triton_copy import fn_spec, param_spec

    names = ["a", "b", "c", "D", "E"]
    sig = {"a": "*i64", "b": "i32", "c": "i64", "D": "constexpr", "E": "constexpr"}
    want_kinds = 2 | (1 << 2) | (2 << 4)
    assert param_spec(_fake_ck(names, sig), 3) == (128, 256, want_kinds, 2)
    assert param_spec(_fake_ck(names, sig, profile_scratch_size=...), 3) == (128, 256, want_kinds, 1)
    assert param_spec(_fake_ck(names, sig, profile_scratch_size=..., global_scratch_size=...), 3)[3] == 0
    # older Triton: signature keyed by position, constants by (position,) tuples
    by_pos = {0: "*i64", 1: "i32", 2: "i64", 3: "constexpr", 4: "constexpr"}
    assert param_spec(_fake_ck(names, by_pos, constants={(1,): 1}), 3) == (128, 256, 2 | (2 << 4), 2)
    assert param_spec(_fake_ck(names, dict(sig, b="constexpr")), 3)[2] == 2 | (2 << 4)
    for bad in (dict(global_scratch_size=64), dict(profile_scratch_size=8), dict(launch_pdl=True),
                dict(launch_cooperative_grid=True), dict(num_ctas=2), dict(cluster_dims=(2, 1, 1))):
        assert param_spec(_fake_ck(names, sig, **bad), 3) is None, bad
    assert param_spec(_fake_ck(names, dict(sig, b="fp32")), 3) is None  # a float argument
    assert param_spec(_fake_ck(names, sig), 2) is None  # "c" is a runtime argument past n_runtime
    assert param_spec(object(), 3) is None
    assert fn_spec(_fake_ck(names, sig), 3) is None  # not loaded: no function handle
    assert fn_spec(_fake_ck(names, sig, function=77), 3) == (77, 128, 256, want_kinds, 2)


def test_triton_hooks_set_reads_none_and_hook_chains(monkeypatch):
    """Launch hooks count as set when one is installed: None and an empty HookChain (what
    Triton >= 3.5 keeps there by default) are not, a function or a non-empty chain is."""
    from types import SimpleNamespace

    from kernels import triton_copy

    for enter, exit_, want in ((None, None, False), (SimpleNamespace(calls=[]), SimpleNamespace(calls=[]), False),
                               (SimpleNamespace(calls=[print]), None, True), (None, print, True)):
        monkeypatch.setattr(triton_copy, "_launch_hooks", lambda: (enter, exit_))
        assert triton_copy.hooks_set() is want
    monkeypatch.undo()
    assert triton_copy.hooks_set() is False  # this Triton, untouched


def test_triton_param_spec_of_a_real_compile():
    """param_spec on the copy kernel as this Triton compiles it for sm_90 (no GPU needed):
    the four pointers and six ints are kept, in order, and the hidden scratch pointers
    counted."""
    triton = pytest.importorskip("triton")
    from kernels import triton_copy

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction

        k = triton_copy._copy_blocks_kernel
        fn = JITFunction(getattr(k, "fn", k))
        names = fn.arg_names
        sig = {n: "*i64" if n.endswith("_ptr") and not n.endswith("ids_ptr") else "*i32" if n.endswith("_ptr")
               else "i32" for n in names[:10]}
        sig.update(CHUNK="constexpr", ALIGN="constexpr")
        ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs={"CHUNK": 1024, "ALIGN": 2}),
                            target=GPUTarget("cuda", 90, 32))
    except Exception as e:  # no ptxas / an API this Triton lacks: nothing to check here
        pytest.skip(f"cannot compile for sm_90 here: {type(e).__name__}: {e}")
    scratch = sum(hasattr(ck.metadata, a) for a in ("global_scratch_size", "profile_scratch_size"))
    ptrs = sum(2 << (2 * i) for i in range(4))
    ints = sum(1 << (2 * i) for i in range(4, 10))
    assert triton_copy.param_spec(ck, 10) == (128, ck.metadata.shared, ptrs | ints, scratch)
    assert triton_copy.param_spec(ck, 9) is None  # dst_off is a runtime argument


@pytest.mark.gpu
@pytest.mark.parametrize("d", ["d2h", "h2d", "d2d"])
def test_gpu_triton_bound_launch_from_cpp_exact(d, monkeypatch):
    """bind(method="triton"): a job shape's first launch goes through Triton's launcher, later
    ones launch the compiled kernel from C++ (IndexRing.copy_blocks_fn). Every job is exact,
    bytes outside the destination blocks keep their poison, a side stream is honoured, bad
    ids raise with nothing queued, jobs past one ring slot are split, and with Triton's
    launch hooks set (a profiler) or the fast launch off every launch goes through Triton."""
    from kernels import triton_copy

    cp = BlockCopier("cuda", ring_capacity=64)
    bb, n_src, n_dst = 4096 + 16, 300, 1200
    src_dev, dst_dev = DIRS[d]
    src = random_bytes((n_src * bb,), device=src_dev, seed=11, pin=src_dev == "cpu").view(n_src, bb)
    dst = poisoned(n_dst * bb, device=dst_dev, pin=dst_dev == "cpu").view(n_dst, bb)
    bound = cp.bind(src, dst, method="triton")
    want = dst.cpu().clone()
    rng = np.random.default_rng(2)
    side = torch.cuda.Stream()
    used = 0

    def job(n, stream=None):
        nonlocal used, want
        si = rng.choice(n_src, n, replace=True)
        di = rng.permutation(np.arange(used, used + n))
        used += n
        want = copy_blocks_ref(src, want, si, di, bb)
        assert bound(si, di, stream=stream) == "triton"

    for n in (1, 16, 4, 7, 33, 64) * 2:  # each shape twice: the second launch is from C++
        job(n, side if n == 7 else None)
    assert bound.fast_launches >= 6, (bound._tfn, triton_copy.hooks_set())
    job(100)  # past the 64-id ring slot: split, through Triton's launcher
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), want)
    for bad_si, bad_di, msg in (([0, 1], [5, 5], "duplicate"), ([n_src], [0], "out of range"),
                                ([-1], [0], "negative")):
        with pytest.raises(KVOffloadError, match=msg):
            bound(bad_si, bad_di)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), want)  # the failed calls queued nothing
    fast = bound.fast_launches
    calls = []
    monkeypatch.setattr(triton_copy, "hooks_set", lambda: True)
    monkeypatch.setattr(triton_copy, "_launch_hooks", lambda: (lambda *a: calls.append(a), None))
    job(16)
    monkeypatch.undo()
    monkeypatch.setattr(triton_copy, "_FAST", False)
    job(33)
    monkeypatch.undo()
    torch.cuda.synchronize()
    assert bound.fast_launches == fast and calls  # both went through Triton's launcher
    job(4)
    torch.cuda.synchronize()
    assert bound.fast_launches == fast + 1
    assert torch.equal(dst.cpu(), want)


@pytest.mark.skipif(__import__("kernels._ext", fromlist=["_C"])._C is None, reason="needs kernels._C")
def test_triton_bound_copy_launch_geometry_matches_launch_triton_copy():
    """What BoundCopy precomputes for the C++ launch of the Triton copy (programs, chunks per
    block, elements per block, strides in elements) equals launch_triton_copy's own math,
    for aligned and unaligned geometries (no GPU: a copier that reports a CUDA device)."""
    from types import SimpleNamespace

    from kernels.copy import BoundCopy
    from kernels.plan import block_view
    from kernels.triton_copy import copy_launch_args

    for bb, n_src, n_dst, off, pad in ((4096, 8, 9, 0, 64), (4100, 5, 7, 4, 0), (24, 3, 3, 8, 8), (2 << 20, 2, 2, 16, 0)):
        s = torch.empty(n_src * bb + off, dtype=torch.uint8)[off:].view(n_src, bb)
        d = torch.empty(n_dst, bb + pad, dtype=torch.uint8)[:, :bb]  # dst blocks `pad` bytes apart
        sv, dv = block_view(s, None, "src"), block_view(d, None, "dst")
        fake = SimpleNamespace(device=torch.device("cuda", 0))
        b = BoundCopy(fake, sv, dv, "triton", "h2d", 13)
        w, epb, chunk, chunks, ss, ds = copy_launch_args(bb, sv.stride, dv.stride, b._vec)
        assert b._targs == (13, chunks, sv.ptr, dv.ptr)
        assert b._tgeom == (epb, ss, ds, 0, 0)
        assert epb * w == bb and chunks == -(-epb // chunk) and chunk >= 16
