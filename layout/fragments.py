"""Resolve a layout + tensors into a fragment table (host side, once at registration).

A fragment is one contiguous byte range of one block inside one tensor. For
block b, fragment f lives at ``ptr[f] + b * block_stride[f]`` and holds
``nbytes[f]`` bytes; inside the unified host block it sits at
``unified_offset[f]``. Fragments are ordered layer-major, so for the per-layer
FlashAttention/FlashInfer layouts the unified block is exactly
``[NL, 2, BS, NH, HS]`` (the NB_NL_TWO_BS_NH_HS block); for heads-first (HND)
layouts it is ``[NL, 2, NH, BS, HS]``; for fused-C layouts it is the block's
bytes in the engine's own dimension order with NB removed.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .spec import KVLayout, KVLayoutError, KVSpec, as_layout, prod

# An engine's KV tensors as `fragments` takes them and `allocate` returns them: one tensor (all-layer
# layouts), a list of one tensor per layer, or (NB_BS_NH_HS) a list of one (K, V) pair per layer.
KVTensors = Union[torch.Tensor, Sequence[torch.Tensor], Sequence[Tuple[torch.Tensor, torch.Tensor]]]


@dataclass
class FragmentTable:
    ptr: np.ndarray             # int64 [F] address of the fragment of block 0
    block_stride: np.ndarray    # int64 [F] bytes between blocks
    nbytes: np.ndarray          # int64 [F]
    unified_offset: np.ndarray  # int64 [F]
    unified_block_bytes: int
    num_blocks: int
    device: torch.device
    tensors: list = field(repr=False, default_factory=list)  # keeps the memory alive

    @property
    def num_fragments(self) -> int:
        return int(self.ptr.shape[0])

    def as_array(self) -> np.ndarray:
        """int64 [4, F]: rows ptr, block_stride, nbytes, unified_offset (the kernels' table)."""
        return np.ascontiguousarray(np.stack([self.ptr, self.block_stride, self.nbytes,
                                              self.unified_offset]).astype(np.int64))


def _contig_strides(shape):
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= s
    return tuple(reversed(st))


def _check_tensor(t, shape, spec: KVSpec, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise KVLayoutError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise KVLayoutError(f"{name} has shape {tuple(t.shape)}, the layout needs {tuple(shape)}")
    if t.dtype != spec.dtype:
        raise KVLayoutError(f"{name} has dtype {t.dtype}, the spec says {spec.dtype}")
    if tuple(t.stride()) != _contig_strides(shape):
        raise KVLayoutError(f"{name} has strides {tuple(t.stride())}, which do not match the layout "
                            f"(contiguous {_contig_strides(shape)})")


def _tensor_fragments(t: torch.Tensor, dims, sizes, es: int):
    """(offset, block_stride, nbytes) for each fragment of one tensor, in row-major outer order."""
    p = dims.index("NB")
    st = _contig_strides(sizes)
    inner = prod(sizes[p + 1:])
    outer = [range(s) for s in sizes[:p]]
    out = []
    for idx in itertools.product(*outer):
        off = sum(i * s for i, s in zip(idx, st[:p]))
        out.append((t.data_ptr() + off * es, st[p] * es, inner * es))
    return out


def _heads_to_tokens(arr, uoff, spec: KVSpec, kv_per_frag: int):
    """Splits [kv, NH, BS, HS] fragments into one fragment per (kv, head, token) row and
    places each row where a [kv, BS, NH, HS] block keeps it."""
    H, T, row = spec.heads, spec.block_size, spec.head_size * spec.elem_size
    kv, h, t = np.meshgrid(np.arange(kv_per_frag), np.arange(H), np.arange(T), indexing="ij")
    src = ((kv * H + h) * T + t).ravel() * row
    dst = ((kv * T + t) * H + h).ravel() * row
    ptr = (arr[:, 0:1] + src[None, :]).ravel()
    stride = np.repeat(arr[:, 1], src.size)
    nb = np.full(ptr.size, row, dtype=np.int64)
    new_uoff = (uoff[:, None] + dst[None, :]).ravel()
    return np.stack([ptr, stride, nb], axis=1).astype(np.int64), new_uoff.astype(np.int64)


def fragments(spec: KVSpec, layout: KVLayout | str, tensors: KVTensors, num_blocks: int | None = None,
              canonical: bool = False) -> FragmentTable:
    """Builds the fragment table of an engine's KV tensors.

    tensors: per-layer layouts take a list of `num_layers` tensors (for
    NB_BS_NH_HS: a list of (k, v) pairs); all-layer layouts take one tensor.
    canonical: for the heads-first (HND) per-layer layouts, order the unified
    block tokens-first ([NL, 2, BS, NH, HS]) as for the NHD layouts, so host
    copies do not depend on the engine's head order. The conversion is only a
    finer fragment table (one fragment per head and token), so every method
    and kernel applies it unchanged.
    """
    layout = as_layout(layout)
    spec.check_layout(layout)
    es = spec.elem_size
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    tensors = list(tensors)
    if not tensors:
        raise KVLayoutError("no tensors given")
    first = tensors[0][0] if isinstance(tensors[0], (tuple, list)) else tensors[0]
    nb = num_blocks if num_blocks is not None else int(first.shape[layout.dims.index("NB")]
                                                         if layout != KVLayout.NB_BS_HS else first.shape[0])
    frags = []
    keep = []
    if layout.per_layer:
        if len(tensors) != spec.num_layers:
            raise KVLayoutError(f"{layout.value} needs one tensor per layer: {spec.num_layers}, "
                                f"got {len(tensors)}")
        for l, t in enumerate(tensors):
            if layout == KVLayout.NB_BS_NH_HS:
                if not (isinstance(t, (tuple, list)) and len(t) == 2):
                    raise KVLayoutError("NB_BS_NH_HS takes a (k, v) pair of tensors per layer")
                k, v = t
                ks = (nb, spec.block_size, spec.heads, spec.head_size)
                vs = (nb, spec.block_size, spec.heads, spec.hs_v)
                _check_tensor(k, ks, spec, f"layer {l} K")
                _check_tensor(v, vs, spec, f"layer {l} V")
                dims = ("NB", "BS", "NH", "HS")
                frags += _tensor_fragments(k, dims, ks, es) + _tensor_fragments(v, dims, vs, es)
                keep += [k, v]
            else:
                shp = spec.shape(layout, nb)
                _check_tensor(t, shp, spec, f"layer {l}")
                dims = ("NB", "BS", "HS") if layout == KVLayout.NB_BS_HS else layout.dims
                frags += _tensor_fragments(t, dims, shp, es)
                keep.append(t)
    else:
        if len(tensors) != 1:
            raise KVLayoutError(f"{layout.value} holds every layer in one tensor; got {len(tensors)}")
        t = tensors[0]
        shp = spec.shape(layout, nb)
        _check_tensor(t, shp, spec, "kv cache")
        frags = _tensor_fragments(t, layout.dims, shp, es)
        keep.append(t)
    devs = {x.device for x in keep}
    if len(devs) != 1:
        raise KVLayoutError(f"KV tensors are on several devices: {sorted(map(str, devs))}")
    arr = np.array(frags, dtype=np.int64).reshape(-1, 3)
    nbytes = arr[:, 2]
    uoff = np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.int64)
    if canonical and layout in (KVLayout.TWO_NB_NH_BS_HS, KVLayout.NB_TWO_NH_BS_HS):
        arr, uoff = _heads_to_tokens(arr, uoff, spec, 2 if layout == KVLayout.NB_TWO_NH_BS_HS else 1)
        nbytes = arr[:, 2]
    total = int(nbytes.sum())
    if total != spec.unified_block_bytes:
        raise KVLayoutError(f"fragments add up to {total} B per block, the spec says "
                            f"{spec.unified_block_bytes} B")
    return FragmentTable(arr[:, 0].copy(), arr[:, 1].copy(), nbytes.copy(), uoff, total, nb,
                         devs.pop(), keep)


def allocate(spec: KVSpec, layout: KVLayout | str, num_blocks: int, device: torch.device | str = "cpu",
             fill: Optional[Callable[[torch.Tensor], object]] = None) -> KVTensors:
    """Allocates KV tensors in `layout` (a list per layer, or one tensor)."""
    layout = as_layout(layout)
    spec.check_layout(layout)

    def mk(shape):
        t = torch.empty(shape, dtype=spec.dtype, device=device)
        if fill is not None:
            fill(t)
        return t

    if layout == KVLayout.NB_BS_NH_HS:
        return [(mk((num_blocks, spec.block_size, spec.heads, spec.head_size)),
                 mk((num_blocks, spec.block_size, spec.heads, spec.hs_v))) for _ in range(spec.num_layers)]
    if layout.per_layer:
        return [mk(spec.shape(layout, num_blocks)) for _ in range(spec.num_layers)]
    return mk(spec.shape(layout, num_blocks))
