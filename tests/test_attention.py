"""The engine's Triton kernels (connector/engine/attention.py) against plain torch.

CPU (CI) runs them under TRITON_INTERPRET=1; the GPU runs the same tests on CUDA tensors.
The torch reference lives in tests/reference.py style: explicit softmax over the visible keys.
"""
import math

import pytest
import torch

from kernels.triton_copy import HAVE_TRITON

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def ref_attention(q, K, V, starts, lens, ctx, tables):
    """Per query row: softmax over keys 0..pos of its sequence (fp32), [T, H, D]."""
    T, H, D = q.shape
    KV = K.shape[2]
    G = H // KV
    bs = K.shape[1]
    out = torch.full_like(q, float("nan"), dtype=torch.float32)
    for s, n, c, tb in zip(starts, lens, ctx, tables):
        idx = torch.tensor(tb, device=K.device)
        ks = K[idx].reshape(-1, KV, D)[:c].float()      # [c, KV, D]
        vs = V[idx].reshape(-1, KV, D)[:c].float()
        for j in range(n):
            pos = c - n + j
            for h in range(H):
                sc = (ks[: pos + 1, h // G] @ q[s + j, h].float()) / math.sqrt(D)
                out[s + j, h] = torch.softmax(sc, 0) @ vs[: pos + 1, h // G]
    return out


def unified_kv(nb, bs, KV, D, layers, dtype, gen):
    """Per-layer K/V views of a [NB, NL, 2, BS, KV, D] buffer (strided, like the engine's)."""
    buf = torch.randn(nb, layers, 2, bs, KV, D, generator=gen).to(dtype).to(DEV)
    return buf, buf[:, layers // 2, 0], buf[:, layers // 2, 1]


def batch(lens, ctx, bs, nb, gen):
    perm = torch.randperm(nb, generator=gen).tolist()
    tables, used = [], 0
    for c in ctx:
        k = -(-c // bs)
        tables.append(perm[used:used + k])
        used += k
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return starts, tables


CASES = [  # lens, ctx, block size, kv heads, query heads per kv head, head dim
    ([1], [1], 16, 2, 4, 64),
    ([16], [1024], 16, 8, 4, 128),         # the TTFT shape: 16 tokens over a loaded prefix
    ([1, 3, 1, 16, 5], [9, 40, 2, 77, 5], 16, 2, 4, 64),
    ([2, 1], [300, 513], 1, 1, 1, 32),      # block size 1, MHA
    ([7, 1], [130, 64], 64, 2, 3, 16),     # G = 3 (rows not a power of two), 64-token blocks
    ([20], [21], 4, 2, 2, 96),            # head dim not a power of two, two query tiles
]


@pytest.mark.parametrize("lens,ctx,bs,KV,G,D", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_reference(lens, ctx, bs, KV, G, D, dtype):
    from connector.engine.attention import paged_attention, paged_meta

    gen = torch.Generator().manual_seed(sum(lens) + D)
    nb = sum(-(-c // bs) for c in ctx) + 3
    _, K, V = unified_kv(nb, bs, KV, D, 3, dtype, gen)
    starts, tables = batch(lens, ctx, bs, nb, gen)
    T, H = sum(lens) + 2, KV * G  # two extra rows belong to no sequence here: must stay untouched
    q = torch.randn(T, H, D, generator=gen).to(dtype).to(DEV)
    out = torch.full((T, H, D), 7.0, dtype=dtype, device=DEV)
    meta = paged_meta([s + 1 for s in starts], lens, ctx, tables, G, KV, torch.device(DEV))
    paged_attention(q, K, V, meta, out)
    ref = ref_attention(q[1:T - 1], K, V, starts, lens, ctx, tables)
    torch.testing.assert_close(out[1:T - 1].float(), ref, **TOL[dtype])
    assert (out[0] == 7).all() and (out[T - 1] == 7).all()


def test_paged_attention_splits_the_keys(monkeypatch):
    """A long context is split over several programs (flash-decoding) and merged exactly."""
    from connector.engine import attention as A

    monkeypatch.setattr(A, "_num_sms", lambda dev: 64)
    gen = torch.Generator().manual_seed(3)
    lens, ctx, bs, KV, G, D = [3], [2000], 16, 1, 2, 32
    nb = 130
    _, K, V = unified_kv(nb, bs, KV, D, 1, torch.float32, gen)
    starts, tables = batch(lens, ctx, bs, nb, gen)
    q = torch.randn(3, KV * G, D, generator=gen).to(DEV)
    meta = A.paged_meta(starts, lens, ctx, tables, G, KV, torch.device(DEV))
    assert meta.splits > 1 and meta.splits * int(meta.seq[0, 3]) >= 2000
    out = torch.empty_like(q)
    A.paged_attention(q, K, V, meta, out)
    torch.testing.assert_close(out, ref_attention(q, K, V, starts, lens, ctx, tables), **TOL[torch.float32])
    # a second layer with the same metadata reuses its split scratch
    part = meta.scratch(KV, 32, q.device)[0]
    _, K2, V2 = unified_kv(nb, bs, KV, D, 1, torch.float32, gen)
    out2 = torch.empty_like(q)
    A.paged_attention(q, K2, V2, meta, out2)
    assert meta.scratch(KV, 32, q.device)[0] is part
    torch.testing.assert_close(out2, ref_attention(q, K2, V2, starts, lens, ctx, tables), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_matches_torch(dtype):
    from connector.engine.attention import rope_store
    from connector.engine.model import LlamaConfig, apply_rope, rope_cos_sin, rope_inv_freq

    gen = torch.Generator().manual_seed(5)
    H, KV, D, bs, nb, T = 4, 2, 16, 4, 9, 7
    cfg = LlamaConfig.tiny()
    buf, K, V = unified_kv(nb, bs, KV, D, 2, dtype, gen)
    before = buf.clone()
    qkv = torch.randn(T, (H + 2 * KV) * D, generator=gen).to(dtype).to(DEV)
    pos = torch.tensor([0, 5, 6, 7, 30, 31, 100], device=DEV)
    blocks = torch.tensor([3, 1, 1, 1, 8, 8, 0], device=DEV)
    offs = torch.tensor([0, 1, 2, 3, 2, 3, 1], device=DEV)
    inv = rope_inv_freq(cfg).to(DEV)
    cos, sin = rope_cos_sin(pos, inv)
    q = rope_store(qkv, cos, sin, K, V, blocks, offs, H, KV, D)
    qk = apply_rope(qkv[:, :(H + KV) * D].view(T, H + KV, D), pos, inv, (cos, sin))
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 and DEV == "cpu" else TOL[dtype]
    torch.testing.assert_close(q, qk[:, :H], **tol)
    torch.testing.assert_close(K[blocks, offs], qk[:, H:], **tol)
    v = qkv[:, (H + KV) * D:].view(T, KV, D)
    assert torch.equal(V[blocks, offs], v)  # V is a plain copy: bit-exact
    # every other byte of the buffer (other layers, other slots) is untouched
    mask = torch.ones(buf.shape[:4], dtype=torch.bool, device=DEV)
    mask[blocks, 1, :, offs] = False
    assert torch.equal(buf[mask], before[mask])


@pytest.mark.parametrize("layout", ["unified", "per_layer"])
def test_engine_paged_attention_is_token_identical(layout):
    """The paged Triton path (prefix hits, host loads, decode) gives the same tokens as SDPA."""
    from connector.engine import EngineConfig, LlamaConfig, LLMEngine

    prompts = [list(range(1, 23)), [i * 7 % 250 + 1 for i in range(31)], [7, 3, 9] * 6]

    def eng(att, offload):
        return LLMEngine(EngineConfig(LlamaConfig.tiny(), block_size=4, num_gpu_blocks=48, layout=layout,
                                      offload_blocks=offload, device=DEV, attention=att))

    ref = eng("sdpa", 0).generate(prompts, 5)
    e = eng("paged", 64)
    assert e.paged
    assert e.generate(prompts, 5) == ref               # decode steps use the paged kernel
    e.reset_prefix_cache()
    for t in e.kv_views:
        t.fill_(0.25)
    assert e.generate(prompts, 5) == ref               # prefixes loaded from the host
    assert e.stats["loaded_blocks"] > 0
    assert e.generate(prompts, 5) == ref               # GPU prefix-cache hits


def test_bad_attention_config():
    from connector.engine import EngineConfig, LlamaConfig, LLMEngine

    with pytest.raises(ValueError, match="attention"):
        LLMEngine(EngineConfig(LlamaConfig.tiny(), attention="flash"))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["unified", "per_layer"])
def test_engine_cuda_graphs_are_token_identical(layout):
    """Captured and replayed forwards (decode, prefix hits, host loads) give SDPA's tokens."""
    from connector.engine import EngineConfig, LlamaConfig, LLMEngine

    prompts = [list(range(1, 23)), [i * 7 % 250 + 1 for i in range(31)], [7, 3, 9] * 6]

    def eng(att, offload, graph_tokens):  # graphs for batches of up to 3 sequences: every step here
        return LLMEngine(EngineConfig(LlamaConfig.tiny(), block_size=4, num_gpu_blocks=48, layout=layout,
                                      offload_blocks=offload, device="cuda", attention=att,
                                      cuda_graph_tokens=graph_tokens, cuda_graph_seqs=3))

    ref = eng("sdpa", 0, 0).generate(prompts, 8)
    e = eng("paged", 64, 256)
    for _ in range(3):
        assert e.generate(prompts, 8) == ref
    assert e.graphs.stats["captures"] > 0 and e.graphs.stats["replays"] > 0
    for _ in range(2):
        e.reset_prefix_cache()
        for t in e.kv_views:
            t.fill_(0.25)
        assert e.generate(prompts, 8) == ref
