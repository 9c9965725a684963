"""Layout model, unified allocation, pack/unpack exactness (CPU: torch + Triton interpreter; GPU: all)."""
import numpy as np
import pytest
import torch

from kernels import KVOffloadError
from layout import (MODELS, KVBlockMover, KVLayout, KVLayoutError, KVSpec, UnifiedKVCache, allocate,
                    fragments)
from tests.conftest import HAS_CUDA

KiB, MiB = 1 << 10, 1 << 20


def test_blog_block_size_table():
    want = {"llama-3.1-8b": (32 * KiB, 2 * MiB), "llama-3.2-1b": (16 * KiB, MiB // 2),
            "llama-3.1-70b-tp4": (8 * KiB, 5 * MiB // 4), "deepseek-v2-lite": (72 * KiB, 1944 * KiB),
            "mistral-small-24b": (32 * KiB, 5 * MiB // 2), "qwen2.5-1.5b": (8 * KiB, 448 * KiB),
            "qwen3-0.6b": (32 * KiB, 1792 * KiB)}
    for name, (frag, unified) in want.items():
        s = MODELS[name]
        assert (s.fragment_bytes, s.unified_block_bytes) == (frag, unified), name
    assert round(MODELS["deepseek-v2-lite"].unified_block_bytes / MiB, 1) == 1.9


def test_shapes_and_strides():
    s = KVSpec(4, 8, 128, 16)
    assert s.shape(KVLayout.TWO_NB_BS_NH_HS, 10) == (2, 10, 16, 8, 128)
    assert s.shape(KVLayout.NB_TWO_NH_BS_HS, 10) == (10, 2, 8, 16, 128)
    assert s.shape("BLHNC", 10) == (10, 4, 8, 16, 256)
    assert s.shape(KVLayout.NB_NL_TWO_BS_NH_HS, 10) == (10, 4, 2, 16, 8, 128)
    assert s.strides(KVLayout.NB_TWO_BS_NH_HS, 10) == (2 * 16 * 8 * 128, 16 * 8 * 128, 8 * 128, 128, 1)
    assert KVLayout.from_vllm("lbhnc") is KVLayout.NL_NB_NH_BS_C
    assert KVLayout.NB_NL_NH_BS_C.block_outer and not KVLayout.NL_NB_NH_BS_C.block_outer
    tp = KVSpec(80, 8, 128, 16, tp_size=16)  # more ranks than heads: replicated
    assert tp.heads == 1


def test_bad_specs_and_layouts():
    with pytest.raises(KVLayoutError, match="does not divide"):
        KVSpec(2, 6, 64, 16, tp_size=4)
    with pytest.raises(KVLayoutError, match="positive"):
        KVSpec(0, 8, 64, 16)
    with pytest.raises(KVLayoutError, match="unknown layout"):
        KVSpec(2, 2, 64, 16).shape("NB_XX", 4)
    with pytest.raises(KVLayoutError, match="unknown vLLM"):
        KVLayout.from_vllm("QQQ")
    with pytest.raises(KVLayoutError, match="MLA"):
        KVSpec(2, 1, 576, 64, mla=True).shape(KVLayout.TWO_NB_BS_NH_HS, 4)
    with pytest.raises(KVLayoutError, match="head sizes must match"):
        KVSpec(2, 2, 64, 16, head_size_v=32).shape(KVLayout.TWO_NB_BS_NH_HS, 4)
    s = KVSpec(2, 2, 64, 16)
    ts = allocate(s, KVLayout.TWO_NB_BS_NH_HS, 4)
    with pytest.raises(KVLayoutError, match="strides"):
        fragments(s, KVLayout.TWO_NB_BS_NH_HS, [t.transpose(3, 4).contiguous().transpose(3, 4) for t in ts])
    with pytest.raises(KVLayoutError, match="shape"):
        fragments(s, KVLayout.NB_TWO_BS_NH_HS, ts)
    with pytest.raises(KVLayoutError, match="one tensor per layer"):
        fragments(s, KVLayout.TWO_NB_BS_NH_HS, ts[:1])
    with pytest.raises(KVLayoutError, match="dtype"):
        fragments(s, KVLayout.TWO_NB_BS_NH_HS, [t.float() for t in ts])
    with pytest.raises(KVLayoutError, match="bytes"):
        UnifiedKVCache(s, 4, device="cpu", buffer=torch.empty(s.unified_block_bytes * 4 + 3, dtype=torch.uint8))


def fill_random(t, seed=[0]):
    seed[0] += 1
    g = torch.Generator().manual_seed(seed[0])
    b = t.view(-1).view(torch.uint8) if t.is_contiguous() else None
    b.copy_(torch.randint(1, 255, b.shape, generator=g, dtype=torch.int32).to(torch.uint8))
    if t.dtype in (torch.float16, torch.bfloat16, torch.float32):
        # keep values finite so that comparisons of typed views stay meaningful
        t.nan_to_num_(0.5, 1.0, -1.0)


def u8(t):
    return t.contiguous().view(-1).view(torch.uint8)


def canonical_block(spec, layout, tensors, b):
    """Independent reference of the unified block bytes for block b (per-layer layouts)."""
    parts = []
    for t in tensors:
        if layout == KVLayout.NB_BS_NH_HS:
            parts += [u8(t[0][b]), u8(t[1][b])]
        elif layout.dims[0] == "TWO":
            parts += [u8(t[0, b]), u8(t[1, b])]
        else:
            parts.append(u8(t[b]))
    return torch.cat(parts)


def layout_block(spec, layout, t, b):
    """Reference for fused-C layouts: the block's bytes in dimension order with NB removed."""
    p = layout.dims.index("NB")
    return u8(t.select(p, b))


SHAPES = [  # (NL, NH, HS_K, HS_V, BS)
    (1, 1, 64, 64, 1), (2, 1, 96, 96, 16), (1, 2, 128, 128, 64), (3, 1, 192, 192, 1),
    (1, 1, 256, 256, 16), (1, 1, 512, 512, 1), (2, 2, 128, 64, 16),
]
DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float32]
LAYOUTS = [l for l in KVLayout if l not in (KVLayout.NB_BS_HS,)]


def run_roundtrip(layout, dtype, shape, device, method, mla=False):
    nl, nh, hk, hv, bs = shape
    spec = KVSpec(nl, 1 if mla else nh, hk, bs, dtype=dtype, head_size_v=None if mla else hv, mla=mla)
    try:
        spec.check_layout(layout)
    except KVLayoutError:
        pytest.skip("layout cannot hold this spec")
    nb = 7
    src = allocate(spec, layout, nb, device=device)
    for t in (src if isinstance(src, list) else [src]):
        for x in (t if isinstance(t, tuple) else (t,)):
            fill_random(x)
    mover = KVBlockMover(spec, layout, src)
    nslots = 6
    pin = device == "cuda"
    uni = torch.full((nslots, spec.unified_block_bytes), 0xA5, dtype=torch.uint8,
                     pin_memory=pin)
    blocks = np.array([5, 0, 3, 6])
    slots = np.array([1, 4, 0, 2])
    mover.pack(blocks, uni, slots, method=method)
    if device == "cuda":
        torch.cuda.synchronize()
    for b, s in zip(blocks, slots):
        if layout.per_layer:
            want = canonical_block(spec, layout, src, b)
        elif layout.block_outer or layout == KVLayout.NB_NL_TWO_BS_NH_HS:
            want = layout_block(spec, layout, src, b)
        else:  # L-outer fused layouts: fragments in outer-index order
            p = layout.dims.index("NB")
            want = u8(src.select(p, b))
        assert torch.equal(uni[s], want.cpu()), f"pack {layout.value} block {b}"
    assert (uni[[3, 5]] == 0xA5).all(), "pack wrote outside its slots"
    # unpack into a poisoned cache, other block ids
    dst = allocate(spec, layout, nb, device=device)
    for t in (dst if isinstance(dst, list) else [dst]):
        for x in (t if isinstance(t, tuple) else (t,)):
            u8(x).fill_(0x5A) if x.is_contiguous() else None
    mover2 = KVBlockMover(spec, layout, dst)
    back = np.array([2, 1, 6, 4])
    mover2.unpack(uni, slots, back, method=method)
    if device == "cuda":
        torch.cuda.synchronize()
    for a, b in zip(blocks, back):
        ref = KVBlockMover(spec, layout, src)
        ua = torch.zeros(1, spec.unified_block_bytes, dtype=torch.uint8)
        ub = torch.zeros(1, spec.unified_block_bytes, dtype=torch.uint8)
        ref.pack([a], ua, [0], method="torch")
        mover2.pack([b], ub, [0], method="torch")
        assert torch.equal(ua, ub), f"unpack {layout.value} block {a}->{b}"
    untouched = [0, 3, 5]
    ut = torch.zeros(len(untouched), spec.unified_block_bytes, dtype=torch.uint8)
    mover2.pack(untouched, ut, list(range(len(untouched))), method="torch")
    assert (ut == 0x5A).all(), "unpack wrote outside its blocks"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
def test_roundtrip_cpu_triton_interpreter(layout, dtype, shape):
    if HAS_CUDA:
        pytest.skip("CPU interpreter test")
    run_roundtrip(layout, dtype, shape, "cpu", "triton")


@pytest.mark.parametrize("shape", [(1, 1, 576, 0, 64), (3, 1, 512, 0, 1), (2, 1, 64, 0, 16)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mla_roundtrip_cpu(dtype, shape):
    if HAS_CUDA:
        pytest.skip("CPU interpreter test")
    run_roundtrip(KVLayout.NB_BS_HS, dtype, shape, "cpu", "triton", mla=True)


def test_unified_views_alias_buffer():
    s = KVSpec(3, 2, 16, 4, dtype=torch.float16)
    c = UnifiedKVCache(s, 5, device="cpu")
    c.buffer.zero_()
    fa = c.layer_view(1, KVLayout.TWO_NB_BS_NH_HS)       # [2, NB, BS, H, D]
    fi = c.layer_view(2, KVLayout.NB_TWO_BS_NH_HS)       # [NB, 2, BS, H, D]
    hnd = c.layer_view(0, KVLayout.TWO_NB_NH_BS_HS)      # [2, NB, H, BS, D]
    assert fa.shape == (2, 5, 4, 2, 16) and fi.shape == (5, 2, 4, 2, 16) and hnd.shape == (2, 5, 2, 4, 16)
    fa[1, 3, 2, 1, 5] = 1.5   # layer 1, V, block 3, token 2, head 1, dim 5
    fi[4, 0, 0, 0, 0] = 2.5   # layer 2, K, block 4
    hnd[0, 0, 1, 3, 7] = 3.5  # layer 0, K, block 0, head 1, token 3, dim 7
    u = c.buffer.view(torch.float16).view(5, 3, 2, 4, 2, 16)
    assert u[3, 1, 1, 2, 1, 5] == 1.5 and u[4, 2, 0, 0, 0, 0] == 2.5 and u[0, 0, 0, 3, 1, 7] == 3.5
    assert int((c.buffer.view(torch.float16) != 0).sum()) == 3  # exactly three values written
    assert fa.data_ptr() != 0 and fa.untyped_storage().data_ptr() == c.buffer.untyped_storage().data_ptr()
    # a block is one contiguous range of the buffer: the mover needs no packing
    m = KVBlockMover(s, KVLayout.NB_NL_TWO_BS_NH_HS, c.unified())
    assert m.contiguous_blocks


def test_unified_views_mla_and_kv_sizes():
    s = KVSpec(2, 1, 576, 64, mla=True)
    c = UnifiedKVCache(s, 3, device="cpu")
    v = c.layer_view(1, KVLayout.NB_BS_HS)
    assert v.shape == (3, 64, 576)
    s2 = KVSpec(2, 2, 128, 16, head_size_v=64)
    c2 = UnifiedKVCache(s2, 3, device="cpu")
    k, vv = c2.layer_kv(1)
    assert k.shape == (3, 16, 2, 128) and vv.shape == (3, 16, 2, 64)
    c2.buffer.zero_()
    vv[2, 15, 1, 63] = 1
    assert c2.buffer[2, -2:].view(torch.bfloat16).item() == 1  # last element of block 2


def test_mover_rejects_bad_input():
    s = KVSpec(2, 2, 16, 4, dtype=torch.float16)
    ts = allocate(s, KVLayout.TWO_NB_BS_NH_HS, 4)
    m = KVBlockMover(s, KVLayout.TWO_NB_BS_NH_HS, ts)
    with pytest.raises(KVOffloadError, match="unified blocks are"):
        m.pack([0], torch.zeros(2, s.unified_block_bytes - 2, dtype=torch.uint8), [0], method="torch")
    u = torch.zeros(3, s.unified_block_bytes, dtype=torch.uint8)
    with pytest.raises(KVOffloadError, match="out of range"):
        m.pack([4], u, [0], method="torch")
    with pytest.raises(KVOffloadError, match="duplicate"):
        m.pack([0, 1], u, [2, 2], method="torch")
    with pytest.raises(KVOffloadError, match="duplicate"):
        m.unpack(u, [0, 1], [3, 3], method="torch")
    with pytest.raises(KVOffloadError, match="needs a CUDA"):
        m.pack([0], u, [0], method="cuda")


# ------------------------------------------------------------------ GPU
GPU_LAYOUTS = [KVLayout.TWO_NB_BS_NH_HS, KVLayout.NB_TWO_NH_BS_HS, KVLayout.NB_BS_NH_HS,
               KVLayout.NL_NH_NB_BS_C, KVLayout.NB_NL_NH_BS_C, KVLayout.NB_NL_TWO_BS_NH_HS]


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["cuda", "triton", "staged", "dma", "dma-loop", "auto"])
@pytest.mark.parametrize("layout", GPU_LAYOUTS, ids=lambda l: l.value)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_roundtrip(layout, dtype, method):
    for shape in ((2, 2, 128, 128, 16), (1, 1, 96, 96, 1), (2, 2, 128, 64, 16)):
        run_roundtrip(layout, dtype, shape, "cuda", method)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["cuda", "triton", "staged", "dma"])
def test_gpu_mla_roundtrip(method):
    for dtype in DTYPES:
        run_roundtrip(KVLayout.NB_BS_HS, dtype, (3, 1, 576, 0, 64), "cuda", method, mla=True)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["cuda", "staged"])
def test_gpu_mover_and_copier_share_one_copier_across_threads(method):
    """A mover's kernel or staged packs in one thread and plain block copies in another, both on
    one copier with a 2-slot index ring: the ring and staging are taken under the copier's
    lock, so every job's bytes are exact (without it, a slot could be handed out twice)."""
    import threading

    from kernels import BlockCopier

    spec = KVSpec(2, 2, 64, 16, dtype=torch.bfloat16)
    kv = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, 64, device="cuda", fill=lambda t: t.view(torch.int16).random_(1, 30000))
    cp = BlockCopier("cuda", ring_slots=2, ring_capacity=64, staging_bytes=1 << 20)
    mover = KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv, copier=cp)
    host = torch.zeros((64, spec.unified_block_bytes), dtype=torch.uint8).pin_memory()
    want = torch.zeros_like(host)
    KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv).pack(list(range(64)), want, list(range(64)), method="torch")
    src = torch.randint(1, 255, (256, 4096), dtype=torch.uint8, device="cuda")
    dst = torch.zeros((256, 4096), dtype=torch.uint8).pin_memory()
    rng = np.random.default_rng(3)
    errors = []

    def packs():
        try:
            s = torch.cuda.Stream()
            for r in range(30):
                ids = rng.permutation(64)[: 48].tolist()
                mover.pack(ids, host, ids, method=method, stream=s)
            s.synchronize()
        except Exception as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=packs)
    t.start()
    s2 = torch.cuda.Stream()
    for r in range(30):
        perm = np.random.default_rng(r).permutation(256)
        cp.copy(src, dst, perm[:200], perm[:200], method="cuda", stream=s2)
    s2.synchronize()
    t.join()
    torch.cuda.synchronize()
    assert not errors, errors
    touched = sorted({i for r in range(30) for i in np.random.default_rng(r).permutation(256)[:200]})
    assert torch.equal(dst[touched], src[touched].cpu())
    packed = host.view(torch.int16).any(dim=1).nonzero().flatten().tolist()
    assert packed and torch.equal(host[packed], want[packed])


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["cuda", "triton", "staged"])
def test_gpu_pack_unpack_with_ids_via_uva(method):
    """Pack kernels reading block and slot ids from the pinned ring slot (BlockCopier(ids_via_uva=True))."""
    from kernels import BlockCopier

    spec = KVSpec(3, 2, 64, 16, dtype=torch.bfloat16)
    kv = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, 12, device="cuda", fill=lambda t: t.view(torch.int16).random_(1, 30000))
    cp = BlockCopier("cuda", ids_via_uva=True, staging_bytes=1 << 20)
    host = torch.full((8, spec.unified_block_bytes), 0x5A, dtype=torch.uint8).pin_memory()
    want = torch.full_like(host, 0x5A)
    blocks, slots = [11, 0, 6, 3], [7, 1, 4, 0]
    KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv, copier=cp).pack(blocks, host, slots, method=method)
    KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv).pack(blocks, want, slots, method="torch")
    back = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, 12, device="cuda", fill=lambda t: t.zero_())
    KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, back, copier=cp).unpack(host, slots, blocks, method=method)
    torch.cuda.synchronize()
    assert torch.equal(host, want)  # slots 2, 3, 5, 6 keep their poison
    idx = torch.tensor(blocks, device="cuda")
    for a, b in zip(kv, back):
        assert torch.equal(a[:, idx].view(torch.int16), b[:, idx].view(torch.int16))
        rest = torch.tensor([i for i in range(12) if i not in blocks], device="cuda")
        assert not b[:, rest].view(torch.int16).any()


@pytest.mark.gpu
def test_gpu_triton_unpack_from_host_uses_the_h2d_program_count():
    """prepare() resolves a Triton unpack from pinned host to the copier's triton_h2d_ctas and
    a pack (or a GPU-side unified buffer) to num_ctas; an explicit count wins."""
    from kernels import BlockCopier

    spec = KVSpec(2, 2, 64, 16, dtype=torch.bfloat16)
    kv = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, 6, device="cuda", fill=lambda t: t.zero_())
    cp = BlockCopier("cuda", num_ctas=16, triton_h2d_ctas=32)
    m = KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv, copier=cp)
    host = torch.zeros(4, spec.unified_block_bytes, dtype=torch.uint8).pin_memory()
    dev = torch.zeros(4, spec.unified_block_bytes, dtype=torch.uint8, device="cuda")
    assert m.prepare([1, 2], host, [0, 3], False, method="triton").num_ctas == 32
    assert m.prepare([1, 2], host, [0, 3], True, method="triton").num_ctas == 16
    assert m.prepare([1, 2], dev, [0, 3], False, method="triton").num_ctas == 16
    assert m.prepare([1, 2], host, [0, 3], False, method="cuda").num_ctas == 16
    assert m.prepare([1, 2], host, [0, 3], False, method="triton", num_ctas=5).num_ctas == 5


@pytest.mark.gpu
def test_gpu_pack_to_gpu_buffer():
    s = KVSpec(4, 2, 64, 16)
    ts = allocate(s, KVLayout.TWO_NB_BS_NH_HS, 8, device="cuda", fill=lambda t: t.normal_())
    m = KVBlockMover(s, KVLayout.TWO_NB_BS_NH_HS, ts)
    g = torch.zeros(4, s.unified_block_bytes, dtype=torch.uint8, device="cuda")
    m.pack([7, 2], g, [3, 0], method="cuda")
    h = torch.zeros(4, s.unified_block_bytes, dtype=torch.uint8)
    m.pack([7, 2], h, [3, 0], method="torch")
    assert torch.equal(g.cpu(), h)


@pytest.mark.parametrize("hnd,nhd", [(KVLayout.TWO_NB_NH_BS_HS, KVLayout.TWO_NB_BS_NH_HS),
                                     (KVLayout.NB_TWO_NH_BS_HS, KVLayout.NB_TWO_BS_NH_HS)],
                         ids=["flashattention", "flashinfer"])
@pytest.mark.parametrize("method", ["torch", "triton"])
def test_heads_first_packs_to_canonical_tokens_first(hnd, nhd, method):
    if HAS_CUDA:
        pytest.skip("CPU interpreter test")
    spec = KVSpec(2, 3, 16, 4, dtype=torch.float16)
    a = allocate(spec, nhd, 6)
    for t in a:
        fill_random(t)
    # the same logical KV, stored heads-first
    b = [t.transpose(-3, -2).contiguous() for t in a]
    ua = torch.zeros(4, spec.unified_block_bytes, dtype=torch.uint8)
    ub = torch.zeros_like(ua)
    KVBlockMover(spec, nhd, a).pack([5, 0, 2], ua, [0, 3, 1], method=method)
    mh = KVBlockMover(spec, hnd, b, canonical=True)
    assert mh.table.num_fragments == 2 * 2 * 3 * 4  # one per layer, kv, head and token
    mh.pack([5, 0, 2], ub, [0, 3, 1], method=method)
    assert torch.equal(ua, ub), "canonical host bytes differ between HND and NHD engines"
    back = allocate(spec, hnd, 6, fill=lambda t: t.zero_())
    KVBlockMover(spec, hnd, back, canonical=True).unpack(ub, [0, 3, 1], [5, 0, 2], method=method)
    for x, y in zip(b, back):
        sel = (slice(None), [5, 0, 2]) if hnd == KVLayout.TWO_NB_NH_BS_HS else ([5, 0, 2],)
        assert torch.equal(x[sel].view(torch.int16), y[sel].view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["cuda", "triton", "staged", "dma"])
def test_gpu_heads_first_canonical(method):
    spec = KVSpec(2, 4, 64, 16, dtype=torch.bfloat16)
    a = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, 8, device="cuda", fill=lambda t: t.view(torch.int16).random_(1, 30000))
    b = [t.transpose(-3, -2).contiguous() for t in a]
    ua = torch.zeros(4, spec.unified_block_bytes, dtype=torch.uint8).pin_memory()
    ub = torch.zeros_like(ua).pin_memory()
    KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, a).pack([7, 1], ua, [2, 0], method="torch")
    KVBlockMover(spec, KVLayout.TWO_NB_NH_BS_HS, b, canonical=True).pack([7, 1], ub, [2, 0], method=method)
    torch.cuda.synchronize()
    assert torch.equal(ua, ub)
