"""KV-cache layouts and model shapes.

Layouts are named by their dimensions, outermost first (LMCache style):
  NL layers, NB blocks, TWO K/V, BS tokens per block, NH kv heads,
  HS head size, C fused K|V content per token (HS_K + HS_V).
A layout resolves, on the host, to a shape and strides; every kernel sees
only a fragment table (see `fragments`), so one kernel body serves all.
"""
from __future__ import annotations

import math
from typing import Iterable
from dataclasses import dataclass
from enum import Enum

import torch


class KVLayoutError(ValueError):
    """A layout, spec or tensor that cannot be used; raised before any launch."""


class KVLayout(str, Enum):
    # one tensor per layer (vLLM <= 0.14 attention backends)
    TWO_NB_BS_NH_HS = "TWO_NB_BS_NH_HS"  # FlashAttention [2, NB, BS, H, D]
    TWO_NB_NH_BS_HS = "TWO_NB_NH_BS_HS"  # FlashAttention, heads-first (HND)
    NB_TWO_BS_NH_HS = "NB_TWO_BS_NH_HS"  # FlashInfer / Triton [NB, 2, BS, H, D]
    NB_TWO_NH_BS_HS = "NB_TWO_NH_BS_HS"  # FlashInfer, heads-first (HND)
    NB_BS_HS = "NB_BS_HS"                # MLA latent cache [NB, BS, D]
    NB_BS_NH_HS = "NB_BS_NH_HS"          # separate K and V tensors per layer (K/V head sizes may differ)
    # one tensor for all layers, K|V fused in C (vLLM 0.33 kv_cache_layout)
    NL_NB_NH_BS_C = "NL_NB_NH_BS_C"      # LBHNC (vLLM's default for offloading)
    NL_NB_BS_NH_C = "NL_NB_BS_NH_C"      # LBNHC
    NL_NH_NB_BS_C = "NL_NH_NB_BS_C"      # LHBNC
    NB_NL_NH_BS_C = "NB_NL_NH_BS_C"      # BLHNC (block-outer: one contiguous range per block)
    NB_NL_BS_NH_C = "NB_NL_BS_NH_C"      # BLNHC
    NB_NH_NL_BS_C = "NB_NH_NL_BS_C"      # BHLNC
    # the unified cross-layer block this project stores on the host
    NB_NL_TWO_BS_NH_HS = "NB_NL_TWO_BS_NH_HS"

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(_split(self.value))

    @property
    def per_layer(self) -> bool:
        """True if an engine holds one tensor of this layout per layer."""
        return "NL" not in self.dims

    @property
    def block_outer(self) -> bool:
        """True if each block is one contiguous byte range (DMA-ready as is)."""
        return self.dims[0] == "NB"

    @property
    def fused_kv(self) -> bool:
        return "C" in self.dims

    # vLLM 0.33 names of the fused layouts
    @classmethod
    def from_vllm(cls, name: str) -> "KVLayout":
        m = {"LBHNC": cls.NL_NB_NH_BS_C, "LBNHC": cls.NL_NB_BS_NH_C, "LHBNC": cls.NL_NH_NB_BS_C,
             "BLHNC": cls.NB_NL_NH_BS_C, "BLNHC": cls.NB_NL_BS_NH_C, "BHLNC": cls.NB_NH_NL_BS_C}
        try:
            return m[name.upper()]
        except KeyError:
            raise KVLayoutError(f"unknown vLLM kv-cache layout {name!r}; known: {sorted(m)}") from None


def _split(name: str) -> list[str]:
    out, toks = [], name.split("_")
    for t in toks:
        out.append(t)
    return out


_DTYPES = {torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2,
           torch.uint8, torch.int8}


@dataclass(frozen=True)
class KVSpec:
    """Model shape as the KV cache sees it (one tensor-parallel rank).

    Args:
      num_layers: attention layers.
      num_kv_heads: KV heads of the whole model (split across `tp_size` ranks;
        replicated when tp_size > num_kv_heads, as vLLM does).
      head_size: K head size (for MLA: kv_lora_rank + rope dim, e.g. 512 + 64).
      head_size_v: V head size (default: head_size). Ignored for MLA.
      block_size: tokens per block.
      dtype: element type.
      mla: one latent vector per token, no separate V, no heads (replicated
        across TP ranks).
      tp_size: tensor-parallel ranks.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype = torch.bfloat16
    head_size_v: int | None = None
    mla: bool = False
    tp_size: int = 1

    def __post_init__(self):
        for f in ("num_layers", "num_kv_heads", "head_size", "block_size", "tp_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise KVLayoutError(f"{f} must be a positive int, got {v!r}")
        if self.head_size_v is not None and self.head_size_v <= 0:
            raise KVLayoutError(f"head_size_v must be positive, got {self.head_size_v}")
        if self.dtype not in _DTYPES:
            raise KVLayoutError(f"unsupported dtype {self.dtype}")
        if not self.mla and self.num_kv_heads >= self.tp_size and self.num_kv_heads % self.tp_size:
            raise KVLayoutError(f"num_kv_heads={self.num_kv_heads} does not divide across "
                                f"tp_size={self.tp_size} ranks")

    # ---- derived sizes (bytes unless noted)
    @property
    def elem_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def heads(self) -> int:
        """KV heads held by one rank."""
        if self.mla:
            return 1
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def hs_v(self) -> int:
        return 0 if self.mla else (self.head_size_v or self.head_size)

    @property
    def k_fragment_bytes(self) -> int:
        """One layer's K (or MLA latent) for one block."""
        return self.block_size * self.heads * self.head_size * self.elem_size

    @property
    def v_fragment_bytes(self) -> int:
        return self.block_size * self.heads * self.hs_v * self.elem_size

    @property
    def fragment_bytes(self) -> int:
        """The per-layer fragment an old vLLM moved: one layer's K of one block."""
        return self.k_fragment_bytes

    @property
    def layer_block_bytes(self) -> int:
        return self.k_fragment_bytes + self.v_fragment_bytes

    @property
    def unified_block_bytes(self) -> int:
        """One block of every layer, K and V: the unit the host pool stores."""
        return self.num_layers * self.layer_block_bytes

    @property
    def content(self) -> int:
        """C: fused per-token content of one head (K then V), elements."""
        return self.head_size + self.hs_v

    # ---- shapes and strides
    def dim_sizes(self, num_blocks: int) -> dict[str, int]:
        return {"NL": self.num_layers, "NB": num_blocks, "TWO": 1 if self.mla else 2,
                "BS": self.block_size, "NH": self.heads, "HS": self.head_size, "C": self.content}

    def shape(self, layout: KVLayout, num_blocks: int) -> tuple[int, ...]:
        """Shape of one tensor in `layout` (per layer for per-layer layouts)."""
        layout = as_layout(layout)
        self.check_layout(layout)
        sz = self.dim_sizes(num_blocks)
        if layout == KVLayout.NB_BS_HS:
            return (num_blocks, self.block_size, self.head_size)
        return tuple(sz[d] for d in layout.dims)

    def strides(self, layout: KVLayout, num_blocks: int) -> tuple[int, ...]:
        """Contiguous element strides for `shape(layout, num_blocks)`."""
        shp = self.shape(layout, num_blocks)
        st, acc = [], 1
        for s in reversed(shp):
            st.append(acc)
            acc *= s
        return tuple(reversed(st))

    def check_layout(self, layout: KVLayout) -> None:
        if self.mla and layout not in (KVLayout.NB_BS_HS, KVLayout.NB_NL_TWO_BS_NH_HS):
            raise KVLayoutError(f"MLA caches use NB_BS_HS per layer, not {layout.value}")
        if not self.mla and layout == KVLayout.NB_BS_HS:
            raise KVLayoutError("NB_BS_HS is the MLA layout; this spec is not MLA")
        if (layout.dims.count("TWO") and not self.mla and self.hs_v != self.head_size):
            raise KVLayoutError(f"{layout.value} stacks K and V in one dim, so their head sizes "
                                f"must match (K {self.head_size}, V {self.hs_v}); use NB_BS_NH_HS "
                                "tensors per layer or a fused-C layout")


def as_layout(layout: KVLayout | str) -> KVLayout:
    if isinstance(layout, KVLayout):
        return layout
    try:
        return KVLayout(str(layout))
    except ValueError:
        try:
            return KVLayout.from_vllm(str(layout))
        except KVLayoutError:
            raise KVLayoutError(f"unknown layout {layout!r}; known: "
                                f"{[x.value for x in KVLayout]}") from None


# The blog's model shapes (vLLM, 16-token blocks unless noted).
MODELS = {
    "llama-3.1-8b": KVSpec(32, 8, 128, 16),
    "llama-3.2-1b": KVSpec(16, 8, 64, 16),
    "llama-3.1-70b-tp4": KVSpec(80, 8, 128, 16, tp_size=4),
    "deepseek-v2-lite": KVSpec(27, 1, 576, 64, mla=True),
    "mistral-small-24b": KVSpec(40, 8, 128, 16),
    "qwen2.5-1.5b": KVSpec(28, 2, 128, 16),
    "qwen3-0.6b": KVSpec(28, 8, 128, 16),
}


def prod(xs: Iterable[int]) -> int:
    return int(math.prod(xs))
