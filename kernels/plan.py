"""Host-side validation and DMA descriptor planning (numpy, vectorised).

Nothing here touches a GPU, so all of it is tested on CPU in CI. Every check
raises before anything is launched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np
import torch


class KVOffloadError(ValueError):
    """Raised for invalid arguments, always before any GPU work is queued."""


_INT_KINDS = ("i", "u")


def as_host_ids(ids: Union[np.ndarray, torch.Tensor, Sequence[int]], name: str) -> np.ndarray:
    """Converts block ids (list, numpy array or CPU tensor) to a 1-D int64 numpy array.

    Block ids live on the host: validating them on the device would need a
    host synchronisation. A CUDA tensor is rejected with a clear message.
    """
    if type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1 and ids.flags.c_contiguous:
        return ids  # the hot path: already what the C++ side reads
    if isinstance(ids, torch.Tensor):
        if ids.device.type != "cpu":
            raise KVOffloadError(f"{name} must be on the host (CPU tensor, numpy array or list); "
                                 f"got a tensor on {ids.device}")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dtype.is_complex:
            raise KVOffloadError(f"{name} must hold integers, got {ids.dtype}")
        arr = ids.contiguous().numpy()
    else:
        arr = np.asarray(ids)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in _INT_KINDS:
            raise KVOffloadError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise KVOffloadError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise KVOffloadError(f"{name} has ids beyond int64")
    return np.ascontiguousarray(arr, dtype=np.int64)


def check_ids(src_ids: np.ndarray, dst_ids: np.ndarray, n_src: int, n_dst: int) -> None:
    """Range, length and duplicate-destination checks, vectorised.

    Sorted destination ids (the common case: a pool hands out ascending slots)
    are proven duplicate-free by one diff; otherwise a sort finds duplicates.
    """
    if src_ids.shape[0] != dst_ids.shape[0]:
        raise KVOffloadError(f"src_ids and dst_ids differ in length "
                             f"({src_ids.shape[0]} vs {dst_ids.shape[0]})")
    if src_ids.size == 0:
        return
    for ids, n, name in ((src_ids, n_src, "src_ids"), (dst_ids, n_dst, "dst_ids")):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0:
            raise KVOffloadError(f"{name} contains a negative block id ({lo})")
        if hi >= n:
            raise KVOffloadError(f"{name} contains block id {hi}, out of range for {n} blocks")
    if dst_ids.size > 1:
        d = np.diff(dst_ids)
        if not (d > 0).all():
            s = np.sort(dst_ids)
            dup = s[1:][s[1:] == s[:-1]]
            if dup.size:
                raise KVOffloadError(f"dst_ids contains duplicate destination block {int(dup[0])}: "
                                     "two copies would race for the same bytes")


@dataclass(frozen=True)
class BlockView:
    """A buffer seen as `num_blocks` blocks of `block_bytes` bytes, `stride` apart."""

    tensor: torch.Tensor
    num_blocks: int
    block_bytes: int
    stride: int

    @property
    def ptr(self) -> int:
        return self.tensor.data_ptr()

    @property
    def device(self) -> torch.device:
        return self.tensor.device


def block_view(t: torch.Tensor, block_bytes: int | None, name: str) -> BlockView:
    """Interprets a tensor as a stack of blocks.

    Without `block_bytes`, dim 0 indexes blocks (`t[i]` is block i and must be
    contiguous). With it, the whole tensor must be contiguous and its byte size
    a multiple of `block_bytes`, which must be a multiple of the element width.
    """
    if not isinstance(t, torch.Tensor):
        raise KVOffloadError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    es = t.element_size()
    if block_bytes is None:
        if t.dim() == 0 or t.shape[0] == 0:
            raise KVOffloadError(f"{name} needs a leading block dimension, got shape {tuple(t.shape)}")
        inner = t[0]
        if not inner.is_contiguous():
            raise KVOffloadError(f"{name}: each block t[i] must be contiguous")
        nb = t.shape[0]
        bb = inner.numel() * es
        stride = t.stride(0) * es
        if bb == 0:
            raise KVOffloadError(f"{name}: blocks are empty")
        if stride < bb:
            raise KVOffloadError(f"{name}: blocks overlap (stride {stride} B < block {bb} B)")
        return BlockView(t, nb, bb, stride)
    bb = int(block_bytes)
    if bb <= 0:
        raise KVOffloadError(f"block_bytes must be positive, got {bb}")
    if bb % es:
        raise KVOffloadError(f"block_bytes={bb} is not a multiple of {name}'s element width "
                             f"({es} B for {t.dtype})")
    if not t.is_contiguous():
        raise KVOffloadError(f"{name} must be contiguous when block_bytes is given")
    total = t.numel() * es
    if total % bb:
        raise KVOffloadError(f"{name} holds {total} B, not a multiple of block_bytes={bb}")
    return BlockView(t, total // bb, bb, bb)


def vec_width(*values: int) -> int:
    """Widest access (16, 8, 4, 2, 1 bytes) that divides every address, size and stride."""
    acc = 0
    for v in values:
        acc |= int(v)
    for w in (16, 8, 4, 2):
        if acc % w == 0:
            return w
    return 1


def coalesce(src_ids: np.ndarray, dst_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merges runs where both ids advance by one into (src_start, dst_start, length).

    Order is kept; vectorised (no per-block Python).
    """
    n = src_ids.shape[0]
    if n == 0:
        e = np.empty(0, np.int64)
        return e, e, e
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    np.not_equal(np.diff(src_ids), 1, out=brk[1:])
    brk[1:] |= np.diff(dst_ids) != 1
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, n))
    return src_ids[starts], dst_ids[starts], lengths


def count_runs(*ids: np.ndarray) -> int:
    """Descriptors left after coalescing runs where every given id array advances by one."""
    n = ids[0].shape[0]
    if n == 0:
        return 0
    brk = np.zeros(n - 1, dtype=bool)
    for a in ids:
        brk |= np.diff(a) != 1
    return int(brk.sum()) + 1


def plan_dma(src: BlockView, dst: BlockView, src_ids: np.ndarray,
             dst_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Builds the (dsts, srcs, sizes) uint64 descriptor arrays for the DMA batcher.

    Consecutive runs become one descriptor when both sides store blocks
    back to back (stride == block size); otherwise one descriptor per block.
    """
    bb = src.block_bytes
    if src.stride == bb and dst.stride == bb:
        s0, d0, ln = coalesce(src_ids, dst_ids)
        sizes = ln.astype(np.uint64) * np.uint64(bb)
    else:
        s0, d0 = src_ids, dst_ids
        sizes = np.full(src_ids.shape[0], bb, dtype=np.uint64)
    srcs = (s0 * src.stride).astype(np.uint64) + np.uint64(src.ptr)
    dsts = (d0 * dst.stride).astype(np.uint64) + np.uint64(dst.ptr)
    return dsts, srcs, sizes


def ranges_overlap(a: BlockView, b: BlockView) -> bool:
    a0, a1 = a.ptr, a.ptr + a.num_blocks * a.stride
    b0, b1 = b.ptr, b.ptr + b.num_blocks * b.stride
    return a0 < b1 and b0 < a1


# Buffers made of several registrations (a host pool pinned chunk by chunk):
# base address -> (end address, segment bytes). A single DMA descriptor must
# not span two cudaHostRegister chunks, so the planners break runs there.
_SEGMENTS: dict = {}
# bumped on every change to _SEGMENTS, so that callers may cache segments_for's answers
SEGMENTS_VERSION = [0]


def register_segments(base: int, nbytes: int, seg_bytes: int) -> None:
    _SEGMENTS[int(base)] = (int(base) + int(nbytes), int(seg_bytes))
    SEGMENTS_VERSION[0] += 1


def unregister_segments(base: int) -> None:
    _SEGMENTS.pop(int(base), None)
    SEGMENTS_VERSION[0] += 1


def segments_for(ptr: int) -> tuple[int, int]:
    """(segment base, segment bytes) of the registered buffer holding ptr, else (0, 0)."""
    for base, (end, seg) in _SEGMENTS.items():
        if base <= ptr < end:
            return base, seg
    return 0, 0
