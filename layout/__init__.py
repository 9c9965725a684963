"""Layout transformer: per-layer paged KV <-> unified cross-layer blocks.

  KVLayout, KVSpec, MODELS     layouts named by dimensions; model shapes
  fragments(spec, layout, t)   resolve tensors to a fragment table (host, once)
  allocate(spec, layout, nb)   KV tensors in any layout
  UnifiedKVCache               one block-outer buffer with per-layer views
  KVBlockMover                 pack/unpack kernels (CUDA, Triton), staged and DMA paths
"""
from .fragments import FragmentTable, allocate, fragments
from .pack import PACK_METHODS, KVBlockMover
from .spec import MODELS, KVLayout, KVLayoutError, KVSpec, as_layout
from .unified import UnifiedKVCache

__all__ = ["KVLayout", "KVSpec", "KVLayoutError", "MODELS", "as_layout", "fragments", "allocate",
           "FragmentTable", "UnifiedKVCache", "KVBlockMover", "PACK_METHODS"]
