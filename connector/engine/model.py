"""A Llama-architecture model in plain torch, reading and writing a paged KV cache.

RMSNorm, RoPE with Llama-3 frequency scaling, grouped-query attention, SwiGLU.
Weights are random and seeded, or loaded from a local safetensors checkpoint
with Hugging Face parameter names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from layout.spec import KVSpec

from .io import upload

if TYPE_CHECKING:
    from .graphs import GraphRunner


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float = 500000.0
    rope_factor: float = 8.0           # Llama-3 scaling (1.0: none)
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_pos: int = 8192
    rms_eps: float = 1e-5
    dtype: torch.dtype = torch.bfloat16

    @classmethod
    def tiny(cls, dtype: torch.dtype = torch.float32) -> "LlamaConfig":
        return cls(vocab_size=257, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16,
                   dtype=dtype)

    @classmethod
    def llama_3_2_1b(cls) -> "LlamaConfig":
        return cls(vocab_size=128256, hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8,
                   head_dim=64, rope_factor=32.0)

    @classmethod
    def llama_3_1_8b(cls) -> "LlamaConfig":
        return cls(vocab_size=128256, hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                   head_dim=128)

    def kv_spec(self, block_size: int) -> KVSpec:
        return KVSpec(self.layers, self.kv_heads, self.head_dim, block_size, dtype=self.dtype)


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies with Llama-3 scaling: long wavelengths are divided by
    `rope_factor`, short ones kept, and the band between interpolated smoothly."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    if cfg.rope_factor == 1.0:
        return inv.float()
    low_wl = cfg.rope_original_max_pos / cfg.rope_low_freq_factor
    high_wl = cfg.rope_original_max_pos / cfg.rope_high_freq_factor
    wl = 2 * math.pi / inv
    scaled = torch.where(wl > low_wl, inv / cfg.rope_factor, inv)
    smooth = (cfg.rope_original_max_pos / wl - cfg.rope_low_freq_factor) / (
        cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
    mid = (wl <= low_wl) & (wl >= high_wl)
    scaled = torch.where(mid, (1 - smooth) * inv / cfg.rope_factor + smooth * inv, scaled)
    return scaled.float()


def rope_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple:
    """cos, sin of each position's angles, [T, 1, D/2] fp32: computed once per forward."""
    ang = pos.float()[:, None] * inv_freq[None, :]            # [T, D/2]
    return ang.cos()[:, None, :], ang.sin()[:, None, :]


def apply_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor,
               cos_sin: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """x: [T, H, D]; pos: [T] absolute positions. Rotates pairs (i, i + D/2) (HF convention)."""
    cos, sin = cos_sin if cos_sin is not None else rope_cos_sin(pos, inv_freq)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one fused kernel (fp32 accumulation) instead of six: the engine is launch-bound at small T
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


@dataclass
class SeqBatch:
    """Where each sequence's tokens of this forward sit.

    tokens/positions: [T] concatenated over sequences; for sequence i,
    tokens[starts[i]:starts[i]+lens[i]] are at positions ctx[i]-lens[i] ..
    ctx[i]-1, its KV lives in blocks block_tables[i] (a LongTensor).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    slot_blocks: torch.Tensor  # [T] KV block of each token
    slot_offsets: torch.Tensor  # [T] offset of each token inside its block
    starts: list
    lens: list
    ctx: list
    block_tables: list
    host_tables: Optional[list] = None  # the same as host int lists (paged kernel metadata, no device read)
    host_io: Optional[np.ndarray] = None  # [4, T] int64 tokens, positions, slot blocks, slot offsets (paged)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        g = torch.Generator().manual_seed(seed)
        H, D, KV = cfg.heads, cfg.head_dim, cfg.kv_heads

        def lin(o, i):
            return nn.Parameter(torch.randn(o, i, generator=g) * (1.0 / math.sqrt(i)))

        self.embed = nn.Parameter(torch.randn(cfg.vocab_size, cfg.hidden, generator=g))
        self.layers = nn.ModuleList()
        for _ in range(cfg.layers):
            m = nn.Module()
            m.ln1, m.ln2 = RMSNorm(cfg.hidden, cfg.rms_eps), RMSNorm(cfg.hidden, cfg.rms_eps)
            m.wq, m.wk, m.wv = lin(H * D, cfg.hidden), lin(KV * D, cfg.hidden), lin(KV * D, cfg.hidden)
            m.wo = lin(cfg.hidden, H * D)
            m.w_gate, m.w_up = lin(cfg.intermediate, cfg.hidden), lin(cfg.intermediate, cfg.hidden)
            m.w_down = lin(cfg.hidden, cfg.intermediate)
            self.layers.append(m)
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.lm_head = lin(cfg.vocab_size, cfg.hidden)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.to(cfg.dtype)

    HF_NAMES = {"embed": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                "lm_head": "lm_head.weight"}
    HF_LAYER = {"ln1.weight": "input_layernorm.weight", "ln2.weight": "post_attention_layernorm.weight",
                "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
                "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
                "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight"}

    def hf_state_dict_names(self) -> dict:
        """Our parameter name -> Hugging Face checkpoint name."""
        out = dict(self.HF_NAMES)
        for i in range(self.cfg.layers):
            for ours, hf in self.HF_LAYER.items():
                out[f"layers.{i}.{ours}"] = f"model.layers.{i}.{hf}"
        return out

    def load_safetensors(self, path: str) -> None:
        """Loads HF-named weights from a .safetensors file or a folder of them."""
        import glob
        import os

        from safetensors.torch import load_file

        files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else [path]
        if not files:
            raise FileNotFoundError(f"no .safetensors under {path}")
        tensors = {}
        for f in files:
            tensors.update(load_file(f))
        params = dict(self.named_parameters())
        for ours, hf in self.hf_state_dict_names().items():
            if hf not in tensors:
                raise KeyError(f"checkpoint lacks {hf}")
            t = tensors[hf]
            if tuple(t.shape) != tuple(params[ours].shape):
                raise ValueError(f"{hf}: shape {tuple(t.shape)} != {tuple(params[ours].shape)}")
            with torch.no_grad():
                params[ours].copy_(t.to(params[ours].dtype))
        self._weights_version += 1

    def _fused_weights(self) -> list:
        """Per layer (W_qkv, W_gate_up): concatenated once, so a layer runs 2 GEMMs fewer.
        Rebuilt when the parameters move or are reloaded."""
        key = (self.layers[0].wq.device, self.layers[0].wq.dtype, self._weights_version)
        if getattr(self, "_fused_key", None) != key:
            self._fused = [(torch.cat([m.wq, m.wk, m.wv]).detach(), torch.cat([m.w_gate, m.w_up]).detach())
                           for m in self.layers]
            self._fused_key = key
        return self._fused

    _weights_version = 0

    @torch.no_grad()
    def forward(self, b: SeqBatch, kv_layer: Callable[[int], tuple[torch.Tensor, torch.Tensor]], block_size: int,
                nvtx: Optional[Callable[[str], ContextManager[object]]] = None, paged: bool = False,
                graphs: Optional[GraphRunner] = None) -> torch.Tensor:
        """Runs the batch, writing its K/V into the cache; returns last-token logits [num_seqs, V].

        kv_layer(l) -> (K, V), each [num_blocks, block_size, kv_heads, head_dim] views of the cache.
        paged: use the Triton kernels (connector.engine.attention) for RoPE + cache write, and
        for the attention of sequences that continue a cached prefix (decode, prefix hits);
        whole prompts keep SDPA. All per-forward indices then reach the GPU in one upload
        (connector.engine.io: an SM copy, never queued behind KV transfers).
        graphs: a graphs.GraphRunner; small batches (graphs.applies) of only prefix-continuing
        sequences replay a captured CUDA graph (the host issues one launch, not ~400).
        The returned logits may be a graph's static buffer: read them before the next forward.
        """
        cfg = self.cfg
        H, KV = cfg.heads, cfg.kv_heads
        G = H // KV
        if not paged:
            last = torch.tensor([s + n - 1 for s, n in zip(b.starts, b.lens)], device=b.tokens.device)
            groups = _resolve(_Padded.plan(b, block_size, G), None)
            return self._layers(b.tokens, b.positions, b.slot_blocks, b.slot_offsets, last, None, groups, b,
                                kv_layer, nvtx, False)
        from .attention import paged_plan

        part = [i for i, (n, c) in enumerate(zip(b.lens, b.ctx)) if n < c]
        whole = [i for i, (n, c) in enumerate(zip(b.lens, b.ctx)) if n == c]
        plan = None
        if part:
            plan = paged_plan([b.starts[i] for i in part], [b.lens[i] for i in part], [b.ctx[i] for i in part],
                              [b.host_tables[i] if b.host_tables is not None else b.block_tables[i].tolist()
                               for i in part], G, KV, self.embed.device)
        io = b.host_io if b.host_io is not None else torch.stack(
            [b.tokens, b.positions, b.slot_blocks, b.slot_offsets]).cpu().numpy()
        T, B = io.shape[1], len(b.lens)
        last = np.asarray([s + n - 1 for s, n in zip(b.starts, b.lens)], np.int64)
        head = [io.astype(np.int64, copy=False).ravel(), last] + ([plan.flat] if plan else [])
        # whole prompts' SDPA metadata joins the same buffer: every index of the forward
        # reaches the GPU in one upload
        arena = _Arena(sum(a.size for a in head))
        groups = _Padded.plan(b, block_size, G, whole, put=arena.put)
        flat = np.concatenate(head + arena.parts)

        def run(buf: torch.Tensor) -> torch.Tensor:
            tok, pos, blk, off = buf[:4 * T].view(4, T)
            meta = plan.views(buf[4 * T + B:]) if plan else None
            return self._layers(tok, pos, blk, off, buf[4 * T:4 * T + B], meta, _resolve(groups, buf), b,
                                kv_layer, nvtx, True)

        if graphs is not None and not whole and graphs.applies(T, B):
            return graphs.run((T,) + plan.key, flat, run)
        return run(upload(flat, self.embed.device))

    def _layers(self, tokens, positions, slot_blocks, slot_offsets, last, meta, groups, b, kv_layer, nvtx,
                paged: bool) -> torch.Tensor:
        cfg = self.cfg
        H, KV, D = cfg.heads, cfg.kv_heads, cfg.head_dim
        x = self.embed[tokens]
        T = x.shape[0]
        if paged:
            from .attention import paged_attention, rope_store
        cos_sin = rope_cos_sin(positions, self.inv_freq)
        fused = self._fused_weights()
        QK = (H + KV) * D
        for li, m in enumerate(self.layers):
            ctx_mgr = nvtx(f"engine.layer {li}") if nvtx else _null()
            w_qkv, w_gu = fused[li]
            with ctx_mgr:
                h = m.ln1(x)
                qkv = h @ w_qkv.T                                  # [T, (H + 2 KV) D]: one GEMM
                K, V = kv_layer(li)
                if paged:
                    q = rope_store(qkv, cos_sin[0], cos_sin[1], K, V, slot_blocks, slot_offsets, H, KV, D)
                    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
                    if meta is not None:
                        paged_attention(q, K, V, meta, out)
                    attend(q, K, V, b, groups, KV, out)
                else:
                    qk = apply_rope(qkv[:, :QK].view(T, H + KV, D), positions, self.inv_freq, cos_sin)
                    q, k = qk[:, :H], qk[:, H:]
                    v = qkv[:, QK:].view(T, KV, D)
                    # K/V may be strided views of a unified buffer: index by (block, offset)
                    K.index_put_((slot_blocks, slot_offsets), k.to(K.dtype))
                    V.index_put_((slot_blocks, slot_offsets), v.to(V.dtype))
                    out = attend(q, K, V, b, groups, KV)
                # residual adds in the GEMM epilogue, in place (out-of-place addmm first copies x)
                x.addmm_(out.view(T, H * D), m.wo.T)
                h = m.ln2(x)
                gate, up = (h @ w_gu.T).chunk(2, dim=-1)
                x.addmm_(F.silu(gate) * up, m.w_down.T)
        return self.norm(x[last]).float() @ self._lm_head_f32().T

    def _lm_head_f32(self) -> torch.Tensor:
        """fp32 copy of lm_head, made once (not 1 GB of conversion per forward)."""
        key = (self.lm_head.device, self.lm_head.dtype, self._weights_version)
        if getattr(self, "_lm_key", None) != key:
            self._lm_f32 = self.lm_head.detach().float()
            self._lm_key = key
        return self._lm_f32


def attend(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, b: SeqBatch, groups: list, KV: int,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of the queries of `groups`' sequences over their paged K/V, into out [T, H, D].

    groups: from _Padded.plan(); each padded group is one SDPA call, leftovers (long
    prompts) run one call per sequence.
    """
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for g in groups:
        if isinstance(g, _Padded):
            if g.mask is None:  # planned with device tensors, not resolved yet
                g = g.resolve(lambda x: x)
            out[g.rows] = _attend_padded(q, K, V, g, KV)
        else:
            _attend_one(q, K, V, b, g[0], g[1], KV, out)
    return out


def _attend_one(q, K, V, b: SeqBatch, i: int, bt: torch.Tensor, KV: int, out: torch.Tensor) -> None:
    """Sequence i alone, KV blocks bt (no padding; causal flash when it is a whole prompt)."""
    T, H, D = q.shape
    s, n, c = b.starts[i], b.lens[i], b.ctx[i]
    ks = K[bt].reshape(-1, KV, D)[:c]             # [ctx, KV, D]
    vs = V[bt].reshape(-1, KV, D)[:c]
    qs = q[s:s + n]                                # [n, H, D]
    if n == c:  # whole sequence: plain causal. K/V are expanded to every query head, so a fused
        # (flash) kernel applies whatever its GQA support; the math fallback is O(n^2) memory
        G = H // KV
        ks = ks[:, :, None].expand(c, KV, G, D).reshape(c, H, D)
        vs = vs[:, :, None].expand(c, KV, G, D).reshape(c, H, D)
        mask, causal, gqa = None, True, False
    else:  # query i (absolute position c-n+i) sees keys 0..c-n+i
        mask = torch.arange(c, device=q.device)[None, :] <= (c - n + torch.arange(n, device=q.device))[:, None]
        causal, gqa = False, True
    # 4-D [1, H, n, D]: SDPA's fused kernels take only 4-D inputs (3-D falls back to math)
    o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1).to(qs.dtype)[None],
                                       vs.transpose(0, 1).to(qs.dtype)[None], attn_mask=mask,
                                       is_causal=causal, enable_gqa=gqa)
    out[s:s + n] = o[0].transpose(0, 1)


def _attend_each(q, K, V, b: SeqBatch, KV: int) -> torch.Tensor:
    """One SDPA call per sequence (the reference for the padded path)."""
    return attend(q, K, V, b, [(i, b.block_tables[i]) for i in range(len(b.starts))], KV)


class _Ref:
    """A slice of the forward's upload buffer, known before the upload happens."""

    __slots__ = ("off", "shape")

    def __init__(self, off: int, shape: tuple):
        self.off, self.shape = off, shape

    def get(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.off:self.off + int(np.prod(self.shape))].view(self.shape)


class _Arena:
    """Collects int64 host arrays to append to an upload buffer starting at `base`."""

    def __init__(self, base: int):
        self.base, self.n, self.parts = base, 0, []

    def put(self, a: np.ndarray) -> _Ref:
        a = np.ascontiguousarray(a, np.int64)
        r = _Ref(self.base + self.n, a.shape)
        self.parts.append(a.ravel())
        self.n += a.size
        return r


def _resolve(groups: list, buf: torch.Tensor) -> list:
    f = (lambda x: x.get(buf) if isinstance(x, _Ref) else x)
    return [g.resolve(f) if isinstance(g, _Padded) else (g[0], f(g[1])) for g in groups]


def _host_table(b: "SeqBatch", i: int) -> list:
    return b.host_tables[i] if b.host_tables is not None else b.block_tables[i].tolist()


@dataclass
class _Padded:
    """Sequences padded to [B, n] queries and [B, C] keys, so their attention is one SDPA call
    per layer instead of one per sequence. GQA is folded into the query axis ([B, KV, G*n, D]
    against [B, KV, C, D]), so K/V are never repeated per query head.

    Index fields are device tensors, or _Refs into the forward's upload until `resolve`."""

    table: object          # [B, max_blocks] block ids (padding: block 0, masked out)
    q_idx: object          # [B, n] row of each query in the concatenated batch (padding: 0)
    valid_idx: object      # [sum of lens] positions of the real queries in the flattened [B * n]
    rows: object           # [sum of lens] their rows in the batch: where this group's outputs go
    qpos0: object          # [B] position of each sequence's first query
    n: int
    G: int
    C: int
    mask: Optional[torch.Tensor] = None   # [B, 1, G*n, C] bool, key visible to query (resolve)

    MAX_ELEMS = 1 << 27    # mask elements per group; a group never grows past this

    @classmethod
    def plan(cls, b: SeqBatch, block_size: int, G: int, only=None, put=None) -> list:
        """Groups sequences (all, or the indices `only`) of similar query length (power-of-two
        buckets: a batch of 16-token cache hits is never padded to a 512-token prompt) and
        splits groups to MAX_ELEMS. Returns _Padded groups and, for sequences that must run
        alone, (index, block table) pairs. put(int64 array) -> its device copy or a _Ref
        (default: a device tensor per array, on the tables' device)."""
        if put is None:
            dev = b.tokens.device
            put = (lambda a: torch.as_tensor(np.ascontiguousarray(a, np.int64), device=dev))
        buckets: dict = {}
        for i in (range(len(b.lens)) if only is None else only):
            buckets.setdefault(int(b.lens[i] - 1).bit_length(), []).append(i)
        out: list = []
        for idx in buckets.values():
            n = max(b.lens[i] for i in idx)
            C = max(len(_host_table(b, i)) for i in idx) * block_size
            per = max(1, cls.MAX_ELEMS // (G * n * C))
            for k in range(0, len(idx), per):
                part = idx[k:k + per]
                if len(part) > 1:
                    out.append(cls.build(b, part, block_size, G, put))
                else:
                    out.append((part[0], put(np.asarray(_host_table(b, part[0]), np.int64))))
        return out

    @classmethod
    def build(cls, b: SeqBatch, idx: list, block_size: int, G: int, put) -> "_Padded":
        B = len(idx)
        lens = np.asarray([b.lens[i] for i in idx])
        starts = np.asarray([b.starts[i] for i in idx])
        ctx = np.asarray([b.ctx[i] for i in idx])
        n = int(lens.max())
        tables = [_host_table(b, i) for i in idx]
        table = np.zeros((B, max(len(t) for t in tables)), np.int64)
        for j, t in enumerate(tables):
            table[j, :len(t)] = t
        ar = np.arange(n)
        valid = ar[None, :] < lens[:, None]
        q_idx = np.where(valid, starts[:, None] + ar[None, :], 0)
        return cls(put(table), put(q_idx), put(np.flatnonzero(valid)), put(q_idx[valid]), put(ctx - lens),
                   n, G, table.shape[1] * block_size)

    def resolve(self, f) -> "_Padded":
        """The group with device tensors (f maps a _Ref to its view) and its mask, built on
        the device: query i of sequence j sits at position ctx_j - len_j + i and sees keys
        0 .. that position."""
        table, q_idx, valid_idx, rows, qpos0 = (f(x) for x in (self.table, self.q_idx, self.valid_idx, self.rows,
                                                              self.qpos0))
        B, n, C, G, dev = table.shape[0], self.n, self.C, self.G, table.device
        qpos = qpos0[:, None] + torch.arange(n, device=dev)[None, :]
        mask = torch.arange(C, device=dev)[None, None, :] <= qpos[:, :, None]          # [B, n, C]
        mask = mask[:, None].expand(B, G, n, C).reshape(B, 1, G * n, C)
        return _Padded(table, q_idx, valid_idx, rows, qpos0, n, G, C, mask)


def _attend_padded(q, K, V, p: _Padded, KV: int) -> torch.Tensor:
    T, H, D = q.shape
    B, n, G = p.table.shape[0], p.n, p.G
    kf = K[p.table].reshape(B, -1, KV, D).transpose(1, 2).to(q.dtype)          # [B, KV, C, D]
    vf = V[p.table].reshape(B, -1, KV, D).transpose(1, 2).to(q.dtype)
    qf = q[p.q_idx].view(B, n, KV, G, D).permute(0, 2, 3, 1, 4).reshape(B, KV, G * n, D)
    o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=p.mask)           # [B, KV, G*n, D]
    o = o.view(B, KV, G, n, D).permute(0, 3, 1, 2, 4).reshape(B * n, H, D)
    return o[p.valid_idx]             # rows p.rows, in order (index, not a bool mask: no sync)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
