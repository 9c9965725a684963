"""The engine's small per-step transfers, done by SM kernels instead of the copy engines.

Each step uploads its indices (tokens, positions, cache slots, attention metadata: KBs) and
reads back one token id per sequence. As cudaMemcpy calls they queue on the copy engines
behind the KV stores and loads: a step's 8-byte token read-back then waits for a whole bulk
store, which cost 0%-hit throughput measurably (docs/design/engine-host-path.md).
Here the host writes a pinned buffer, and a one-program-per-1024-values Triton kernel moves
it through UVA; the reverse for token ids. Nothing waits for a bulk DMA.

    buf = upload(flat_int64, device)              # device int64 [n], valid on the current stream
    ids = tokens_to_host(logits.argmax(-1))       # list of ints (waits for the forward)

Without CUDA or Triton both fall back to torch copies.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from kernels.triton_copy import HAVE_TRITON, jit_unspecialized

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @jit_unspecialized("n")
    def _copy_i64_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=m), mask=m)

_BLOCK = 1024


def _copy(src: torch.Tensor, dst: torch.Tensor, n: int) -> None:
    _copy_i64_kernel[(triton.cdiv(n, _BLOCK),)](src, dst, n, BLOCK=_BLOCK)


class _SmallIO:
    """Per device: two pinned upload slots (the host fills one while the GPU may still read
    the other), one device buffer, and a pinned read-back buffer."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cap = 0
        self.slots: list = []
        self.events = [torch.cuda.Event(), torch.cuda.Event()]
        self.k = 0
        self.dev: Optional[torch.Tensor] = None
        self.back = torch.empty(1 << 12, dtype=torch.int64, pin_memory=True)
        self.back_event = torch.cuda.Event()

    def _grow(self, n: int) -> None:
        for e in self.events:  # old slots may still be read by queued kernels
            e.synchronize()
        self.cap = max(n, 2 * self.cap, 1 << 14)
        self.slots = [torch.empty(self.cap, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.dev = torch.empty(self.cap, dtype=torch.int64, device=self.device)

    def upload(self, flat: np.ndarray, out: Optional[torch.Tensor]) -> torch.Tensor:
        n = flat.size
        if n > self.cap:
            self._grow(n)
        k, self.k = self.k, self.k ^ 1
        self.events[k].synchronize()   # the kernel that read this slot last has run
        h = self.slots[k]
        h.numpy()[:n] = flat.ravel()
        dst = self.dev[:n] if out is None else out
        if n:
            _copy(h, dst, n)
        self.events[k].record()
        return dst

    def tokens(self, ids: torch.Tensor) -> list:
        n = ids.numel()
        if n > self.back.numel():
            self.back_event.synchronize()
            self.back = torch.empty(max(n, 2 * self.back.numel()), dtype=torch.int64, pin_memory=True)
        if n:
            _copy(ids.reshape(-1).to(torch.int64), self.back, n)
        self.back_event.record()
        self.back_event.synchronize()
        return self.back[:n].tolist()


_IO: dict = {}


def _io(device: torch.device) -> Optional[_SmallIO]:
    if device.type != "cuda" or not HAVE_TRITON:
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    io = _IO.get(idx)
    if io is None:
        io = _IO[idx] = _SmallIO(torch.device("cuda", idx))
    return io


def upload(flat: np.ndarray, device: torch.device | str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """flat (int64 host array) on `device`, ordered on the current stream. Returns `out`
    (int64, contiguous, >= flat.size values) when given, else a view of one device buffer
    that every upload without `out` reuses: queue all of its readers, on the current stream,
    before the next such upload."""
    io = _io(torch.device(device))
    if io is None:
        t = torch.from_numpy(np.ascontiguousarray(flat, np.int64))
        if out is None:
            return t.to(device)
        out[:t.numel()].copy_(t)
        return out
    if out is not None and (out.dtype != torch.int64 or not out.is_contiguous() or out.numel() < flat.size):
        raise ValueError("out must be a contiguous int64 tensor of at least flat.size values")
    return io.upload(np.ascontiguousarray(flat, np.int64), out)


def tokens_to_host(ids: torch.Tensor) -> list:
    """ids (int64 [B], any device) as a list of ints; waits for the work that produced them."""
    io = _io(ids.device)
    if io is None:
        return ids.tolist()
    return io.tokens(ids)
