"""Triton kernels for the engine's small-query forwards: decode, and prompts whose prefix was
loaded or found in the GPU prefix cache.

Without them such a forward is launch-bound: RoPE, two cache writes, a block gather, a mask
and SDPA cost a couple of dozen kernels per layer, and the forward takes several times its
weight reads (docs/design/engine-host-path.md). Here each layer runs one RoPE-and-cache-write
kernel and one paged attention kernel.

  rope_store(qkv, cos, sin, K, V, slot_blocks, slot_offsets, H, KV, D) -> q [T, H, D]
  paged_attention(q, K, V, meta, out)       out[rows of meta's sequences] <- attention

K, V: one layer's cache, [num_blocks, block_size, KV, D] views with any block, token and
head strides (D contiguous), so both the unified cross-layer buffer and per-layer tensors work.
Runs on the GPU, and on CPU tensors under TRITON_INTERPRET=1 (how CI tests it).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from kernels.triton_copy import HAVE_TRITON, jit_unspecialized

if HAVE_TRITON:
    import triton
    import triton.language as tl

    # Arguments left unspecialised below are views into the forward's one upload buffer, whose
    # offsets change with the batch, or per-call sizes: specialising on their alignment or
    # value would compile new variants mid-run.
    _jit = jit_unspecialized

    @_jit("blk_ptr", "off_ptr")
    def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, blk_ptr, off_ptr,
                           s_qkv, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                           H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, HALF_P2: tl.constexpr,
                           ROWS_P2: tl.constexpr, KV_P2: tl.constexpr, D_P2: tl.constexpr):
        # one program per token: rotate its H query and KV key heads (pairs i, i + D/2, the
        # HF convention), write q out and k, v into the token's cache slot
        t = tl.program_id(0).to(tl.int64)
        HALF: tl.constexpr = D // 2
        r = tl.arange(0, ROWS_P2)
        i = tl.arange(0, HALF_P2)
        m = (r < H + KV)[:, None] & (i < HALF)[None, :]
        src = qkv_ptr + t * s_qkv + r[:, None] * D + i[None, :]
        x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + t * HALF + i, mask=i < HALF, other=0.0)[None, :]
        s = tl.load(sin_ptr + t * HALF + i, mask=i < HALF, other=0.0)[None, :]
        o1 = x1 * c - x2 * s
        o2 = x2 * c + x1 * s
        qd = q_ptr + t * (H * D) + r[:, None] * D + i[None, :]
        mq = m & (r < H)[:, None]
        tl.store(qd, o1.to(q_ptr.dtype.element_ty), mask=mq)
        tl.store(qd + HALF, o2.to(q_ptr.dtype.element_ty), mask=mq)
        blk = tl.load(blk_ptr + t).to(tl.int64)
        off = tl.load(off_ptr + t).to(tl.int64)
        kd = k_ptr + blk * sk_b + off * sk_t + (r - H)[:, None] * sk_h + i[None, :]
        mk = m & (r >= H)[:, None]
        tl.store(kd, o1.to(k_ptr.dtype.element_ty), mask=mk)
        tl.store(kd + HALF, o2.to(k_ptr.dtype.element_ty), mask=mk)
        vh = tl.arange(0, KV_P2)
        j = tl.arange(0, D_P2)
        mv = (vh < KV)[:, None] & (j < D)[None, :]
        v = tl.load(qkv_ptr + t * s_qkv + (H + KV) * D + vh[:, None] * D + j[None, :], mask=mv)
        tl.store(v_ptr + blk * sv_b + off * sv_t + vh[:, None] * sv_h + j[None, :],
                 v.to(v_ptr.dtype.element_ty), mask=mv)

    @triton.jit
    def _tile(work_ptr, seq_ptr, w, G: tl.constexpr, BLOCK_M: tl.constexpr):
        # work item w: its sequence's (first row in q, query count, context, keys per split),
        # and per row of the tile: query index in the sequence and whether the row is real
        b = tl.load(work_ptr + 2 * w)
        q0 = tl.load(work_ptr + 2 * w + 1)
        qs = tl.load(seq_ptr + 4 * b)
        qn = tl.load(seq_ptr + 4 * b + 1)
        ctx = tl.load(seq_ptr + 4 * b + 2)
        chunk = tl.load(seq_ptr + 4 * b + 3)
        r = tl.arange(0, BLOCK_M)
        t = q0 + r // G
        row_ok = (r < (BLOCK_M // G) * G) & (t < qn)
        return b, q0, qs, qn, ctx, chunk, r, t, row_ok

    @_jit("table_ptr", "work_ptr", "seq_ptr", "table_stride", "splits")
    def _paged_attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, part_ptr, ml_ptr, table_ptr, work_ptr, seq_ptr,
                           sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, table_stride, scale_log2, splits,
                           H: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, BS: tl.constexpr,
                           D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, FP32: tl.constexpr):
        # splits: programs per tile along the keys (runtime, so it costs no compiled variant);
        # SPLIT = splits > 1: write partials for _combine_kernel instead of the output
        # FP32: upcast q, k, v and use IEEE fp32 dots
        # program (work item w, kv head kh, split sp): the BLOCK_M // G queries of tile w
        # times the G query heads sharing kv head kh, against keys [sp*chunk, (sp+1)*chunk)
        w = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        # chunk: keys per split, per sequence, read from device memory (graph replays)
        b, q0, qs, qn, ctx, chunk, r, t, row_ok = _tile(work_ptr, seq_ptr, w, G, BLOCK_M)
        TQ: tl.constexpr = BLOCK_M // G
        pos = ctx - qn + t                      # absolute position of each row's query
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        q = tl.load(q_ptr + (qs + t).to(tl.int64)[:, None] * (H * D) + (kh * G + r % G)[:, None] * D
                    + d[None, :], mask=row_ok[:, None] & dm[None, :], other=0.0)
        last = ctx - qn + tl.minimum(q0 + TQ, qn)  # keys past the tile's last query are never seen
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, last)
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked tile keeps p = 0
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kb = k_ptr + kh * sk_h
        vb = v_ptr + kh * sv_h
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            page = tl.load(table_ptr + b * table_stride + n // BS, mask=n_ok, other=0).to(tl.int64)
            tok = (n % BS).to(tl.int64)
            km = n_ok[:, None] & dm[None, :]
            k = tl.load(kb + (page * sk_b + tok * sk_t)[:, None] + d[None, :], mask=km, other=0.0)
            if FP32:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale_log2
            s = tl.where(n_ok[None, :] & (n[None, :] <= pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(vb + (page * sv_b + tok * sv_t)[:, None] + d[None, :], mask=km, other=0.0)
            if FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if not SPLIT:
            o = acc / tl.maximum(l_i, 1e-30)[:, None]
            tl.store(o_ptr + (qs + t).to(tl.int64)[:, None] * (H * D) + (kh * G + r % G)[:, None] * D
                     + d[None, :], o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dm[None, :])
        else:
            base = ((w * KV + kh) * splits + sp).to(tl.int64) * BLOCK_M + r
            tl.store(part_ptr + base[:, None] * BLOCK_D + d[None, :], acc)
            tl.store(ml_ptr + 2 * base, m_i)
            tl.store(ml_ptr + 2 * base + 1, l_i)

    @_jit("work_ptr", "seq_ptr", "splits")
    def _combine_kernel(part_ptr, ml_ptr, o_ptr, work_ptr, seq_ptr, splits,
                        H: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
        # merges the splits' (max, sum, unnormalised output) as flash-decoding does
        w = tl.program_id(0)
        kh = tl.program_id(1)
        b, q0, qs, qn, ctx, chunk, r, t, row_ok = _tile(work_ptr, seq_ptr, w, G, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        m = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for sp in range(splits):
            base = ((w * KV + kh) * splits + sp).to(tl.int64) * BLOCK_M + r
            ms = tl.load(ml_ptr + 2 * base)
            ls = tl.load(ml_ptr + 2 * base + 1)
            a = tl.load(part_ptr + base[:, None] * BLOCK_D + d[None, :])
            m_new = tl.maximum(m, ms)
            c_old = tl.exp2(m - m_new)
            c_new = tl.exp2(ms - m_new)
            l = l * c_old + ls * c_new
            acc = acc * c_old[:, None] + a * c_new[:, None]
            m = m_new
        o = acc / tl.maximum(l, 1e-30)[:, None]
        tl.store(o_ptr + (qs + t).to(tl.int64)[:, None] * (H * D) + (kh * G + r % G)[:, None] * D
                 + d[None, :], o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (d < D)[None, :])


def _p2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _strides(c: torch.Tensor, name: str) -> tuple:
    if c.dim() != 4 or c.stride(3) != 1:
        raise ValueError(f"{name} must be a [num_blocks, block_size, kv_heads, head_dim] view with a "
                         f"contiguous last dimension, got shape {tuple(c.shape)} strides {c.stride()}")
    return c.stride(0), c.stride(1), c.stride(2)


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
               slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, H: int, KV: int, D: int) -> torch.Tensor:
    """RoPE on q and k, and the cache write of k and v, in one launch.

    qkv: [T, (H + 2 KV) D], rows contiguous (the fused QKV GEMM's output).
    cos, sin: [T, D/2] fp32 (rope_cos_sin of the token positions).
    K, V: [num_blocks, block_size, KV, D] cache views; token t goes to
    (slot_blocks[t], slot_offsets[t]). Returns q: [T, H, D] in qkv's dtype.
    """
    T = qkv.shape[0]
    q = torch.empty((T, H, D), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    if qkv.stride(1) != 1 or D % 2:
        raise ValueError("rope_store needs contiguous qkv rows and an even head_dim")
    ks, vs = _strides(K, "K"), _strides(V, "V")
    _rope_store_kernel[(T,)](qkv, cos.reshape(T, D // 2).contiguous(), sin.reshape(T, D // 2).contiguous(), q,
                             K, V, slot_blocks, slot_offsets, qkv.stride(0), *ks, *vs,
                             H=H, KV=KV, D=D, HALF_P2=_p2(D // 2), ROWS_P2=_p2(H + KV), KV_P2=_p2(KV),
                             D_P2=_p2(D))
    return q


@dataclass
class PagedMeta:
    """Per-forward description of the sequences the paged kernel serves (same for every layer).

    Device int64 views: seq [B, 4] (first row in q, query count, context length, keys per
    split); work [W, 2] (sequence, first query) per tile of block_m // G queries;
    table [B, width] block ids.
    """

    seq: torch.Tensor
    work: torch.Tensor
    table: torch.Tensor
    num_work: int
    block_m: int
    block_n: int
    splits: int
    _scratch: tuple = ()

    def scratch(self, kv_heads: int, block_d: int, device: torch.device | str) -> tuple:
        """Split partials (unnormalised output, max and sum), allocated on the first layer's
        call and reused by every later layer of the same forward."""
        rows = self.num_work * kv_heads * self.splits * self.block_m
        if not self._scratch or self._scratch[0].shape != (rows, block_d):
            self._scratch = (torch.empty((rows, block_d), dtype=torch.float32, device=device),
                             torch.empty((rows, 2), dtype=torch.float32, device=device))
        return self._scratch


@dataclass
class PagedPlan:
    """PagedMeta's host side: `flat` (int64) is seq, work and table back to back, so it
    reaches the GPU in one upload (or is copied into a CUDA graph's static buffer)."""

    flat: np.ndarray
    B: int
    width: int
    num_work: int
    block_m: int
    block_n: int
    splits: int

    @property
    def key(self) -> tuple:
        """What a captured launch depends on (everything else is read from device memory)."""
        return (self.B, self.width, self.num_work, self.block_m, self.block_n, self.splits)

    def views(self, dev: torch.Tensor) -> PagedMeta:
        """PagedMeta over `dev`, a device copy of `flat`."""
        n1, n2 = 4 * self.B, 2 * self.num_work
        return PagedMeta(dev[:n1].view(self.B, 4), dev[n1:n1 + n2].view(-1, 2),
                         dev[n1 + n2:n1 + n2 + self.B * self.width].view(self.B, self.width),
                         self.num_work, self.block_m, self.block_n, self.splits)

    def to(self, device: torch.device | str) -> PagedMeta:
        return self.views(torch.from_numpy(self.flat).to(device))


_SM_COUNT: dict = {}


def _num_sms(dev: torch.device) -> int:
    if dev.type != "cuda":
        return 4
    n = _SM_COUNT.get(dev.index)
    if n is None:
        n = _SM_COUNT[dev.index] = torch.cuda.get_device_properties(dev).multi_processor_count
    return n


def _tile_shape(qmax: int, G: int) -> tuple:
    """(block_m, block_n) for a batch whose longest query run is qmax: the compiled variants."""
    return max(16, _p2(min(qmax, 16) * G)), (64 if qmax * G <= 16 else 32)


def warmup(K: torch.Tensor, V: torch.Tensor, heads: int, dtype: torch.dtype) -> int:
    """Compiles every kernel variant a forward can need, so no JIT compile lands mid-run
    (one that did, inside a timed benchmark, cost seconds: docs/design/engine-host-path.md). K, V: one layer's cache views;
    slot (0, 0) is written by the RoPE warm-up and zeroed again. Returns the launches made."""
    if K.device.type != "cuda":
        return 0
    KV, D = K.shape[2], K.shape[3]
    G = heads // KV
    dev = K.device
    qkv = torch.zeros((1, (heads + 2 * KV) * D), dtype=dtype, device=dev)
    cs = torch.ones((1, D // 2), dtype=torch.float32, device=dev)
    idx = torch.zeros(2, dtype=torch.int64, device=dev)
    q = rope_store(qkv, cs, cs, K, V, idx[:1], idx[1:], heads, KV, D)
    K[0, 0].zero_()
    V[0, 0].zero_()
    out = torch.empty_like(q)
    n = 1
    for shape in sorted({_tile_shape(m, G) for m in range(1, 18)}):
        for splits in (1, 2):
            flat = np.asarray([0, 1, 1, shape[1], 0, 0, 0], np.int64)  # seq, work, table
            plan = PagedPlan(flat, 1, 1, 1, shape[0], shape[1], splits)
            paged_attention(q, K, V, plan.to(dev), out)
            n += splits
    return n


def paged_plan(starts: list, lens: list, ctx: list, tables: list, G: int, KV: int,
               device: torch.device) -> PagedPlan:
    """Plans sequences i with queries starts[i] .. starts[i]+lens[i]-1 at positions
    ctx[i]-lens[i] .. ctx[i]-1 and KV blocks tables[i] (host ints)."""
    B = len(lens)
    qmax = max(lens)
    block_m, block_n = _tile_shape(qmax, G)
    tq = block_m // G
    ntiles = [-(-n // tq) for n in lens]
    W = sum(ntiles)
    # split the keys (flash-decoding) until the grid covers the GPU twice, each split
    # keeping at least 4 key tiles; powers of two bound the number of compiled variants
    cmax = max(ctx)
    want = -(-2 * _num_sms(device) // (W * KV))
    splits = max(1, min(_p2(want), _p2(-(-cmax // (4 * block_n)))))
    c = np.asarray(ctx, np.int64)
    chunk = -(-(-(-c // splits)) // block_n) * block_n   # per sequence, a multiple of block_n
    width = _p2(max(len(t) for t in tables))            # bucketed: fewer distinct graph keys
    flat = np.zeros(4 * B + 2 * W + B * width, np.int64)
    flat[:4 * B].reshape(B, 4)[:] = np.stack([np.asarray(starts), np.asarray(lens), c, chunk], 1)
    work = flat[4 * B:4 * B + 2 * W].reshape(W, 2)
    work[:, 0] = np.repeat(np.arange(B), ntiles)
    work[:, 1] = np.concatenate([np.arange(k) * tq for k in ntiles])
    table = flat[4 * B + 2 * W:].reshape(B, width)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    return PagedPlan(flat, B, width, W, block_m, block_n, splits)


def paged_meta(starts: list, lens: list, ctx: list, tables: list, G: int, KV: int,
               device: torch.device) -> PagedMeta:
    """paged_plan(...) copied to `device` (one H2D copy)."""
    return paged_plan(starts, lens, ctx, tables, G, KV, device).to(device)


def paged_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, meta: PagedMeta, out: torch.Tensor,
                    scale: float | None = None) -> None:
    """Causal attention of meta's queries over their paged K/V, written into out's rows.

    q, out: [T, H, D] contiguous; K, V: [num_blocks, block_size, KV, D] views.
    Query j of sequence i (row starts[i]+j) sits at position ctx[i]-lens[i]+j and sees
    keys 0 .. that position.
    """
    T, H, D = q.shape
    KV = K.shape[2]
    G = H // KV
    ks, vs = _strides(K, "K"), _strides(V, "V")
    scale = (1.0 / math.sqrt(D)) if scale is None else scale
    bd = max(16, _p2(D))
    # fp32 dots in IEEE precision for fp32 models; the interpreter's bf16 dot is wrong
    # (Triton 3.x on CPU), so under it every dtype is upcast
    fp32 = q.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    grid = (meta.num_work, KV, meta.splits)
    part, ml = (out, out) if meta.splits == 1 else meta.scratch(KV, bd, q.device)  # (unused when 1)
    _paged_attn_kernel[grid](q, K, V, out, part, ml, meta.table, meta.work, meta.seq, *ks, *vs,
                             meta.table.stride(0), scale * 1.4426950408889634, meta.splits,
                             H=H, KV=KV, G=G, BS=K.shape[1], D=D, BLOCK_D=bd, BLOCK_M=meta.block_m,
                             BLOCK_N=meta.block_n, SPLIT=meta.splits > 1, FP32=fp32, num_warps=4)
    if meta.splits > 1:
        _combine_kernel[(meta.num_work, KV)](part, ml, out, meta.work, meta.seq, meta.splits, H=H, KV=KV, G=G,
                                             D=D, BLOCK_D=bd, BLOCK_M=meta.block_m)
