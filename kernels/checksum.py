"""Per-block checksums of KV blocks, computed on the GPU (the integrity mode's kernel).

The checksum of a block is a function of its *unified image* (the bytes a host slot holds,
[unified_block_bytes]), so it can be computed on either side of a copy: over the engine's
GPU fragments (through a FragmentTable, any layout) before a store, and over the loaded
GPU blocks after a load, and the two agree exactly when the bytes came back unchanged.

Definition (two independent 32-bit lanes, together 64 bits). The image is read as
little-endian 32-bit words w[i], i = 0 .. unified_block_bytes/4 - 1 (so block sizes and
every fragment's offset, stride and size must be multiples of 4 bytes; KV blocks are):

    lane k:  sum_i fmix32(w[i] ^ (i * M_k + S_k))   mod 2**32

fmix32 is MurmurHash3's finaliser (a bijection on 32-bit words), M_k/S_k odd constants per
lane. Why this form: each word's term depends on its value and position, so a changed word
always changes both lanes (a bijection of a different input), swapped or shifted words change
them with probability ~1 - 2**-64, and the sum is order-free, so fragments can be summed in
any order (the kernel walks them per block, the reference walks the contiguous image).
It is an error-detecting code against corruption (a stale or torn copy, a flipped bit), not a
cryptographic MAC.

    ck = BlockChecksum(table_or_tensor)        # FragmentTable, or uint8 [num_blocks, block_bytes]
    ck.compute(block_ids) -> int32 [n, 2]      # tests and tools
    ck.record(block_ids, slot_ids, sums)       # sums[slot_ids[j]] = checksum(block_ids[j])
    ck.verify(block_ids, slot_ids, sums, flags, k)   # flags[k] += blocks whose checksum differs
    checksum_reference(images) -> int32 [n, 2] # torch reference over uint8 [n, bytes] images

All launches go on the current torch stream; ids are int64 tensors on the blocks' device.
Runs on the GPU, and on CPU tensors under TRITON_INTERPRET=1 (how CI exercises it).
"""
from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np
import torch

from .triton_copy import HAVE_TRITON, TRITON_REASON  # noqa: F401  (it picks the interpreter on CPU first)

if HAVE_TRITON:
    import triton
    import triton.language as tl

# lane constants (odd multipliers, seeds from the digits of pi)
_M = (0x9E3779B1, 0x7FEB352D)
_S = (0x243F6A88, 0x85A308D3)
CHUNK_WORDS = 2048  # 32-bit words one program hashes per loop iteration (8 KiB)
_MASK = 0xFFFFFFFF

if HAVE_TRITON:

    @triton.jit
    def _fmix32(x):
        x ^= x >> 16
        x *= 0x85EBCA6B
        x ^= x >> 13
        x *= 0xC2B2AE35
        x ^= x >> 16
        return x

    def _jit_unspecialized(*names):
        """triton.jit that does not specialise the named arguments on their value or alignment
        (they change from call to call: one compiled kernel per VERIFY serves every job)."""
        import inspect

        params = inspect.signature(triton.jit).parameters
        kw = {k: list(names) for k in ("do_not_specialize", "do_not_specialize_on_alignment") if k in params}
        return triton.jit(**kw)

    @_jit_unspecialized("block_ids_ptr", "slot_ids_ptr", "flag_index")
    def _checksum_kernel(base_ptr, table_ptr, block_ids_ptr, slot_ids_ptr, sums_ptr, flags_ptr, flag_index,
                         num_frags, VERIFY: tl.constexpr, CHUNK: tl.constexpr):
        # one program per block: walks every fragment of the block in CHUNK-word steps.
        # table_ptr: int64 [4, F] in 32-bit words: fragment offset relative to base_ptr (may be
        # negative), block stride, fragment size, offset inside the unified image.
        j = tl.program_id(0)
        b = tl.load(block_ids_ptr + j).to(tl.int64)
        s = tl.load(slot_ids_ptr + j).to(tl.int64)
        acc0 = tl.zeros([CHUNK], dtype=tl.uint32)
        acc1 = tl.zeros([CHUNK], dtype=tl.uint32)
        lane = tl.arange(0, CHUNK)
        for f in range(0, num_frags):
            off = tl.load(table_ptr + f)
            stride = tl.load(table_ptr + num_frags + f)
            nw = tl.load(table_ptr + 2 * num_frags + f)
            uoff = tl.load(table_ptr + 3 * num_frags + f)
            start = off + b * stride
            for c in range(0, nw, CHUNK):
                offs = c + lane
                mask = offs < nw
                w = tl.load(base_ptr + start + offs, mask=mask, other=0, eviction_policy="evict_first")
                w = w.to(tl.uint32, bitcast=True)
                i = (uoff + offs).to(tl.uint32)
                h0 = _fmix32(w ^ (i * 0x9E3779B1 + 0x243F6A88))
                h1 = _fmix32(w ^ (i * 0x7FEB352D + 0x85A308D3))
                acc0 += tl.where(mask, h0, 0).to(tl.uint32)
                acc1 += tl.where(mask, h1, 0).to(tl.uint32)
        s0 = tl.sum(acc0, axis=0).to(tl.uint32).to(tl.int32, bitcast=True)
        s1 = tl.sum(acc1, axis=0).to(tl.uint32).to(tl.int32, bitcast=True)
        if VERIFY:
            e0 = tl.load(sums_ptr + 2 * s)
            e1 = tl.load(sums_ptr + 2 * s + 1)
            bad = ((e0 != s0) | (e1 != s1)).to(tl.int32)
            tl.atomic_add(flags_ptr + flag_index, bad)
        else:
            tl.store(sums_ptr + 2 * s, s0)
            tl.store(sums_ptr + 2 * s + 1, s1)


def checksum_reference(images: torch.Tensor) -> torch.Tensor:
    """Reference: uint8 [n, nbytes] unified images (nbytes % 4 == 0) -> int32 [n, 2], in torch
    int64 arithmetic (any device). Bit-identical to the kernel by definition (module doc)."""
    if images.dtype != torch.uint8 or images.dim() != 2 or images.shape[1] % 4:
        raise ValueError(f"images must be uint8 [n, nbytes] with nbytes % 4 == 0, got {images.dtype} "
                         f"{tuple(images.shape)}")
    w = images.contiguous().view(torch.int32).to(torch.int64) & _MASK
    i = torch.arange(w.shape[1], dtype=torch.int64, device=w.device)
    lanes = []
    for m, s in zip(_M, _S):
        x = w ^ ((i * m + s) & _MASK)
        x = x ^ (x >> 16)
        x = (x * 0x85EBCA6B) & _MASK
        x = x ^ (x >> 13)
        x = (x * 0xC2B2AE35) & _MASK
        x = x ^ (x >> 16)
        t = x.sum(dim=1) & _MASK
        lanes.append(torch.where(t >= 1 << 31, t - (1 << 32), t))
    return torch.stack(lanes, dim=1).to(torch.int32)


def _word_view(t: torch.Tensor) -> torch.Tensor:
    """The storage of `t` from its first byte on, as 1-D int32 (the kernel's base pointer)."""
    es = t.element_size()
    u8 = torch.empty(0, dtype=torch.uint8, device=t.device)
    off = t.storage_offset() * es
    span = (t.untyped_storage().nbytes() - off) // 4 * 4
    u8.set_(t.untyped_storage(), off, (span,), (1,))
    return u8.view(torch.int32)


class BlockChecksum:
    """Checksums of whole blocks of one KV cache (module doc), bound once.

    Args:
      src: a layout.fragments.FragmentTable (the engine's blocks, any layout: the checksum is
        the one of each block's unified image), or a uint8 [num_blocks, block_bytes] tensor
        with any row stride (one fragment: the block itself).
    Raises ValueError for sizes, offsets or strides that are not multiples of 4 bytes.
    """

    def __init__(self, src: Any) -> None:  # a torch.Tensor or a layout FragmentTable (see Args)
        if isinstance(src, torch.Tensor):
            if src.dtype != torch.uint8 or src.dim() != 2 or src.stride(1) != 1:
                raise ValueError(f"blocks must be uint8 [num_blocks, block_bytes] with unit inner stride, "
                                 f"got {src.dtype} {tuple(src.shape)} strides {src.stride()}")
            arr = np.array([[src.data_ptr()], [src.stride(0)], [src.shape[1]], [0]], dtype=np.int64)
            self.num_blocks, self.block_bytes, tensors, self.device = src.shape[0], src.shape[1], [src], src.device
        else:  # a FragmentTable
            arr = src.as_array()
            self.num_blocks, self.block_bytes, tensors, self.device = (
                src.num_blocks, src.unified_block_bytes, list(src.tensors), src.device)
        if not tensors:
            raise ValueError("the fragment table holds no tensors to take a base pointer from")
        if self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"block checksums of {self.device.type} tensors run only under Triton's interpreter "
                             "(set TRITON_INTERPRET=1 before importing triton); the kernel is for CUDA tensors")
        if (arr % 4).any() or self.block_bytes % 4:
            raise ValueError("block checksums read 32-bit words: fragment addresses, strides, sizes and the "
                             f"block size ({self.block_bytes} B) must be multiples of 4 bytes")
        self._keep = tensors
        self._base = _word_view(tensors[0])
        rel = arr.copy()
        rel[0] -= self._base.data_ptr()
        rel //= 4
        self.num_frags = int(arr.shape[1])
        self._table = torch.from_numpy(np.ascontiguousarray(rel)).to(self.device)
        self._dummy_flags = torch.zeros(1, dtype=torch.int32, device=self.device)

    def _check(self, ids: torch.Tensor, name: str) -> None:
        # bounds are the caller's to check (the worker refuses bad ids before any copy, and
        # the integrity wrapper launches only for jobs the worker accepted)
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1 \
                or ids.device != self.device:
            raise ValueError(f"{name} must be a 1-D int64 tensor on {self.device}")

    def _launch(self, block_ids, slot_ids, sums, flags, k: int, verify: bool) -> None:
        if not HAVE_TRITON:
            raise RuntimeError(TRITON_REASON)
        n = block_ids.shape[0]
        if n == 0:
            return
        if sums.dtype != torch.int32 or sums.dim() != 2 or sums.shape[1] != 2 or not sums.is_contiguous() \
                or sums.device != self.device:
            raise ValueError(f"sums must be a contiguous int32 [slots, 2] tensor on {self.device}")
        _checksum_kernel[(n,)](self._base, self._table, block_ids, slot_ids, sums, flags, k, self.num_frags,
                               VERIFY=verify, CHUNK=CHUNK_WORDS, num_warps=8)

    def compute(self, block_ids: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """int32 [n, 2]: the checksum of each block (out[j] for block_ids[j])."""
        self._check(block_ids, "block_ids")
        n = block_ids.shape[0]
        out = torch.empty(n, 2, dtype=torch.int32, device=self.device) if out is None else out
        self._launch(block_ids, torch.arange(n, device=self.device), out, self._dummy_flags, 0, False)
        return out

    def record(self, block_ids: torch.Tensor, slot_ids: torch.Tensor, sums: torch.Tensor) -> None:
        """sums[slot_ids[j]] = checksum of block block_ids[j] (sums: int32 [slots, 2])."""
        self._check(block_ids, "block_ids")
        self._check(slot_ids, "slot_ids")
        self._launch(block_ids, slot_ids, sums, self._dummy_flags, 0, False)

    def verify(self, block_ids: torch.Tensor, slot_ids: torch.Tensor, sums: torch.Tensor,
               flags: torch.Tensor, k: int) -> None:
        """flags[k] += the number of j whose block's checksum differs from sums[slot_ids[j]]
        (flags: int32 [K] on the device; the caller zeroes flags[k] first)."""
        self._check(block_ids, "block_ids")
        self._check(slot_ids, "slot_ids")
        self._launch(block_ids, slot_ids, sums, flags, k, True)
