"""Unified cross-layer allocation with zero-copy per-layer views.

One buffer holds every layer block-outermost (NB_NL_TWO_BS_NH_HS), so each
block is one contiguous byte range that a single DMA moves, while an engine
keeps indexing per layer through views in the convention it expects.
"""
from __future__ import annotations

import torch

from .spec import KVLayout, KVLayoutError, KVSpec, as_layout


class UnifiedKVCache:
    """One contiguous buffer of ``num_blocks`` unified blocks.

    Attributes:
      buffer: uint8 [num_blocks, unified_block_bytes] (the bytes the host pool stores).
      spec, num_blocks.
    """

    def __init__(self, spec: KVSpec, num_blocks: int, device: torch.device | str = "cuda",
                 buffer: torch.Tensor | None = None) -> None:
        if num_blocks <= 0:
            raise KVLayoutError(f"num_blocks must be positive, got {num_blocks}")
        self.spec, self.num_blocks = spec, num_blocks
        ub = spec.unified_block_bytes
        if buffer is None:
            buffer = torch.empty(num_blocks * ub, dtype=torch.uint8, device=device)
        if buffer.dtype != torch.uint8 or not buffer.is_contiguous() or buffer.numel() != num_blocks * ub:
            raise KVLayoutError(f"buffer must be contiguous uint8 of {num_blocks * ub} bytes")
        self.buffer = buffer.view(num_blocks, ub)
        # typed [NB, NL, layer_block_elems]
        self._typed = self.buffer.view(-1).view(spec.dtype).view(num_blocks, spec.num_layers, -1)

    def unified(self) -> torch.Tensor:
        """[NB, NL, 2, BS, NH, HS] typed view (MLA: [NB, NL, 1, BS, 1, HS]); needs K and V sizes equal."""
        s = self.spec
        if s.hs_v not in (0, s.head_size):
            raise KVLayoutError("K and V head sizes differ: use layer_kv()")
        return self._typed.view(self.num_blocks, s.num_layers, 1 if s.mla else 2, s.block_size,
                                s.heads, s.head_size)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(K [NB, BS, NH, HS_K], V [NB, BS, NH, HS_V]) views of one layer (V None for MLA)."""
        s = self.spec
        lb = self._typed[:, layer]
        ke = s.block_size * s.heads * s.head_size
        k = lb[:, :ke].unflatten(1, (s.block_size, s.heads, s.head_size))
        if s.mla:
            return k, None
        v = lb[:, ke:].unflatten(1, (s.block_size, s.heads, s.hs_v))
        return k, v

    def layer_view(self, layer: int, layout: KVLayout | str = KVLayout.TWO_NB_BS_NH_HS) -> torch.Tensor:
        """Zero-copy view of one layer in a per-layer convention.

        TWO_NB_BS_NH_HS (FlashAttention), NB_TWO_BS_NH_HS (FlashInfer),
        their heads-first variants (a permuted view), or NB_BS_HS (MLA).
        """
        layout = as_layout(layout)
        s = self.spec
        if s.mla:
            if layout != KVLayout.NB_BS_HS:
                raise KVLayoutError("an MLA cache offers NB_BS_HS views")
            return self.layer_kv(layer)[0].squeeze(2)
        u = self.unified()[:, layer]  # [NB, 2, BS, NH, HS]
        if layout == KVLayout.NB_TWO_BS_NH_HS:
            return u
        if layout == KVLayout.TWO_NB_BS_NH_HS:
            return u.transpose(0, 1)
        if layout == KVLayout.NB_TWO_NH_BS_HS:
            return u.transpose(2, 3)
        if layout == KVLayout.TWO_NB_NH_BS_HS:
            return u.transpose(0, 1).transpose(2, 3)
        raise KVLayoutError(f"no per-layer view for {layout.value}")
