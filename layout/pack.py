"""Pack/unpack between an engine's paged KV tensors and unified host blocks.

    mover = KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, per_layer_tensors)
    mover.pack(block_ids, host_pool, slot_ids)       # GPU KV -> unified blocks
    mover.unpack(host_pool, slot_ids, block_ids)     # unified blocks -> GPU KV

`host_pool` is [num_slots, unified_block_bytes] (pinned host, or GPU). The
fragment table is built and copied to the device once, here, at registration.

Methods:
  cuda / triton  one launch gathers (scatters) every fragment of N blocks,
                 straight to pinned host through UVA, or to a GPU buffer;
  staged         pack into GPU staging with the CUDA kernel, then one DMA per
                 run of unified blocks (pipelined); SMs touch only HBM;
  dma            one cudaMemcpyBatchAsync of all fragments;
  dma-loop       one cudaMemcpyAsync per fragment (what vLLM 0.11 did);
  auto           block-outer layouts: a block copy, its method from CostModel.choose;
                 otherwise CostModel.choose_pack (staged when compute is running and
                 the unified side is host memory, cuda else).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from kernels import BlockCopier, Ids, KVOffloadError, check_id_pairs, get_copier, native
from kernels import tracing as _nv
from kernels.copy import STAGED_PACK_CTAS, on_device
from kernels.tracing import NULL as NO_RANGE, nvtx_range
from kernels.plan import BlockView, as_host_ids, segments_for, vec_width
from kernels.triton_copy import HAVE_TRITON, DevPtr, launch_triton_pack

from .fragments import FragmentTable, KVTensors, fragments
from .spec import KVLayout, KVSpec, as_layout

PACK_METHODS = ("cuda", "triton", "staged", "dma", "dma-loop", "torch")


@dataclass
class PreparedMove:
    """A validated pack/unpack with its method resolved (see KVBlockMover.prepare)."""
    block_ids: np.ndarray
    slot_ids: np.ndarray
    unified: BlockView
    to_unified: bool
    method: str
    block_method: str
    stream: Optional[torch.cuda.Stream]
    num_ctas: int
    busy: Optional[bool]
    # descriptor counts in copy orientation (source = GPU for a pack, host for an unpack):
    # (runs of consecutive (src, dst) pairs, runs of src ids, runs of dst ids)
    runs: tuple = (0, 0, 0)


class KVBlockMover:
    """Moves whole KV blocks (all layers) between an engine's KV tensors and unified blocks.

    canonical=True stores heads-first (HND) layouts tokens-first on the host (see
    layout.fragments), so they share host blocks with NHD engines."""

    def __init__(self, spec: Optional[KVSpec], layout: KVLayout | str | None, tensors: Optional[KVTensors],
                 copier: Optional[BlockCopier] = None, table: Optional[FragmentTable] = None,
                 canonical: bool = False) -> None:
        self.spec = spec
        self.layout = as_layout(layout) if layout is not None else None
        self.table: FragmentTable = table if table is not None else fragments(
            spec, self.layout, tensors, canonical=canonical)
        self.device = self.table.device
        self.copier = copier or get_copier(self.device)
        t = self.table
        self.unified_block_bytes = t.unified_block_bytes
        self.vec = vec_width(*t.ptr.tolist(), *t.block_stride.tolist(), *t.nbytes.tolist(),
                             *t.unified_offset.tolist(), t.unified_block_bytes)
        self.max_frag_bytes = int(t.nbytes.max())
        self._host_table = t.as_array()  # for the DMA planner
        # Triton wants element offsets relative to one base tensor.
        self._base = t.tensors[0]
        w = min(self.vec, 8)
        rel = self._host_table.copy()
        rel[0] -= self._base.data_ptr()
        rel //= w
        self._table_dev = None
        self._triton_table = None
        if self.device.type == "cuda":
            self._table_dev = torch.from_numpy(self._host_table).to(self.device)
        self._triton_table = torch.from_numpy(rel).to(self.device)
        # a layout whose block is one contiguous range needs no packing at all
        self.contiguous_blocks = t.num_fragments == 1 or bool(
            (t.block_stride == t.unified_block_bytes).all()
            and (np.diff(t.ptr) == t.nbytes[:-1]).all())

    @classmethod
    def from_table(cls, table: FragmentTable, copier: Optional[BlockCopier] = None) -> "KVBlockMover":
        """A mover over an already resolved fragment table (e.g. an engine's canonical
        per-block tensors, one fragment per tensor)."""
        return cls(None, None, None, copier=copier, table=table)

    # ------------------------------------------------------------------
    def pack(self, block_ids: Ids, unified: torch.Tensor, slot_ids: Ids, *, method: str = "auto",
             stream: Optional[torch.cuda.Stream] = None, num_ctas: Optional[int] = None, busy: Optional[bool] = None) -> str:
        """unified[slot_ids[i]] <- every fragment of KV block block_ids[i]. Returns the method used."""
        return self._move(block_ids, unified, slot_ids, True, method, stream, num_ctas, busy)

    def unpack(self, unified: torch.Tensor, slot_ids: Ids, block_ids: Ids, *, method: str = "auto",
               stream: Optional[torch.cuda.Stream] = None, num_ctas: Optional[int] = None, busy: Optional[bool] = None) -> str:
        """Every fragment of KV block block_ids[i] <- unified[slot_ids[i]]."""
        return self._move(block_ids, unified, slot_ids, False, method, stream, num_ctas, busy)

    # ------------------------------------------------------------------
    def unified_view(self, unified: torch.Tensor) -> BlockView:
        """unified's block geometry, checked against the spec's unified block size (KVOffloadError)."""
        return self._unified_view(unified)

    @property
    def table_dev(self) -> Optional[torch.Tensor]:
        """The fragment table on the device (int64 [4, F], see FragmentTable.as_array), or None
        for a CPU KV cache: what the pack kernels read."""
        return self._table_dev

    def as_blocks(self) -> torch.Tensor:
        """A contiguous-block layout (contiguous_blocks) seen as [num_blocks, unified_block_bytes] bytes."""
        return self._as_blocks()

    def _unified_view(self, unified: torch.Tensor) -> BlockView:
        if not isinstance(unified, torch.Tensor):
            raise KVOffloadError("unified must be a torch.Tensor")
        # the copier caches geometry and pinned-ness per buffer: no re-derivation per job
        v = self.copier.view(unified, None if unified.dim() >= 2 else self.unified_block_bytes, "unified")
        if v.block_bytes != self.unified_block_bytes:
            raise KVOffloadError(f"unified blocks are {v.block_bytes} B, the spec needs "
                                 f"{self.unified_block_bytes} B")
        return v

    def _move(self, block_ids, unified, slot_ids, to_unified, method, stream, num_ctas, busy) -> str:
        return self.run(self.prepare(block_ids, unified, slot_ids, to_unified, method=method,
                                     stream=stream, num_ctas=num_ctas, busy=busy))

    def prepare(self, block_ids: Ids, unified: torch.Tensor, slot_ids: Ids, to_unified: bool, *,
                method: str = "auto", stream: Optional[torch.cuda.Stream] = None, num_ctas: Optional[int] = None,
                busy: Optional[bool] = None, runs: Optional[tuple] = None) -> "PreparedMove":
        """Validates a pack (to_unified=True) or unpack and resolves its method, without
        queueing anything; `run` queues it later, possibly from another thread.
        runs: check_id_pairs' (runs_both, runs_src, runs_dst) for these ids, when the caller
        already checked them against this cache and `unified` (block_ids and slot_ids 1-D int64
        numpy arrays, src/dst in the move's direction): they are then neither converted nor
        checked again (the connector worker's native fast paths handing a job back); () when the
        caller checked them without counting runs, which only a per-layer move can do without
        (a contiguous-block one is then checked again here, for its runs).
        Raises KVOffloadError for invalid input."""
        uv = self._unified_view(unified)
        nb = self.table.num_blocks
        if runs is not None and (runs or not self.contiguous_blocks):
            bi, si = block_ids, slot_ids  # checked by the caller; () = no runs counted (per-layer)
        else:
            bi = as_host_ids(block_ids, "block_ids")
            si = as_host_ids(slot_ids, "slot_ids")
            # duplicates are checked on the written side
            if to_unified:
                runs = check_id_pairs(bi, si, nb, uv.num_blocks)
            else:
                runs = check_id_pairs(si, bi, uv.num_blocks, nb)
        host = uv.device.type == "cpu"
        if uv.device.type == "cuda" and uv.device != self.device:
            raise KVOffloadError(f"unified is on {uv.device}, the KV cache on {self.device}")
        if self.device.type != "cuda":
            if method not in ("auto", "torch", "triton"):
                raise KVOffloadError(f"method {method!r} needs a CUDA KV cache")
            method = "triton" if method == "triton" else "torch"
        elif host and method != "torch" and not self.copier.host_pinned(uv):
            raise KVOffloadError("unified is pageable host memory; pack/unpack needs pinned memory")
        block_method = "auto"
        if method == "dma" and self.contiguous_blocks and self.device.type == "cuda":
            # whole contiguous blocks: the transfer core's coalescing DMA (runs of consecutive
            # ids become one descriptor) instead of one descriptor per fragment
            method, block_method = "block", "dma"
        if self.device.type == "cuda" and busy is None and method in ("auto", "block") and \
                not (self.contiguous_blocks and block_method == "auto"):
            # resolved here, on the caller's thread: `run` may execute on another one
            busy = self.copier.stream_busy()
        if method == "auto":
            method = "block" if self.contiguous_blocks else self.copier.cost_model.choose_pack(host, bool(busy))
        if method == "block" and block_method == "auto" and self.device.type == "cuda":
            # the copier's cost model picks now, on the caller's thread: `run` then takes the
            # copier's bound fast path, and the worker can hand a DMA job to its native thread
            d = ("d2h" if to_unified else "h2d") if host else "d2d"
            cp = self.copier
            args = (d, uv.block_bytes, bi.shape[0])
            kw = dict(n_desc=runs[0], n_desc_host=runs[1] if d == "h2d" else runs[2])
            if busy is None:
                # the stream query (a driver call) only when the idle and busy picks differ,
                # which for whole unified blocks of >= 1 MiB they do not (both are DMA)
                avail = cp.available_methods()
                idle, quiet = (cp.cost_model.choose(*args, b, avail, **kw) for b in (False, True))
                busy = False if idle == quiet else cp.stream_busy()
                block_method = quiet if busy else idle
            else:
                block_method = cp.cost_model.choose(*args, bool(busy), cp.available_methods(), **kw)
        if method not in PACK_METHODS + ("block",):
            raise KVOffloadError(f"unknown method {method!r}; choose from auto, {', '.join(PACK_METHODS)}")
        if method == "staged" and not host:
            method = "cuda"
        if method in ("cuda", "staged", "dma", "dma-loop"):
            native.require(f"method {method!r}")
        if method == "triton" and not HAVE_TRITON:
            raise KVOffloadError("triton is not available")
        if self.device.type == "cuda" and stream is None:
            stream = torch.cuda.current_stream(self.device)
        ctas = int(num_ctas or self.copier.default_ctas(method, "d2h" if to_unified or not host else "h2d"))
        return PreparedMove(bi, si, uv, bool(to_unified), method, block_method, stream, ctas, busy, runs)

    def run(self, p: "PreparedMove") -> str:
        """Queues a prepared move on its stream; returns the method used."""
        bi, si, uv, to_unified, method = p.block_ids, p.slot_ids, p.unified, p.to_unified, p.method
        n = bi.shape[0]
        out = p.block_method if p.block_method != "auto" else method
        if n == 0:
            return out
        stream = p.stream
        rng = nvtx_range(f"kvo.{'pack' if to_unified else 'unpack'} {method} n={n} "
                         f"F={self.table.num_fragments} ub={self.unified_block_bytes}") \
            if _nv.TOOL or _nv.PROF._is_profiler_enabled else NO_RANGE  # the name only when heard
        with on_device(self.device), rng:
            if method == "block":
                # ids planned once, in prepare (converted, checked, method picked): the copier
                # neither converts nor checks them again
                kv = self._as_blocks()
                if to_unified:
                    self.copier.copy(kv, uv.tensor, bi, si, method=p.block_method, stream=stream, busy=p.busy,
                                     ids_checked=p.block_method != "auto")
                else:
                    self.copier.copy(uv.tensor, kv, si, bi, method=p.block_method, stream=stream, busy=p.busy,
                                     ids_checked=p.block_method != "auto")
            elif method == "torch":
                self._torch_move(bi, uv, si, to_unified)
            elif method in ("dma", "dma-loop"):
                sb, ss = segments_for(uv.ptr)
                native.dma_fragments(table=self._host_table.ctypes.data,
                                 num_frags=self.table.num_fragments, unified=uv.ptr,
                                 unified_stride=uv.stride, block_ids=bi.ctypes.data,
                                 slot_ids=si.ctypes.data, n=n, to_unified=to_unified,
                                 max_per_call=self.copier.max_desc,
                                 mode=native.DMA_BATCH if method == "dma" else native.DMA_LOOP,
                                 src_any_order=False, stream=stream.cuda_stream,
                                 seg_base=sb, seg_bytes=ss,
                                 lanes=self.copier.dma_lanes if method == "dma" else None)
            elif method in ("cuda", "triton"):
                self._kernel(method, bi, uv, si, to_unified, stream, p.num_ctas)
            else:
                self._staged(bi, uv, si, to_unified, stream, p.num_ctas)
        return out

    def _as_blocks(self) -> torch.Tensor:
        """A contiguous-block layout seen as [NB, unified_block_bytes] bytes."""
        t = self.table
        base = t.tensors[0]
        out = torch.empty(0, dtype=torch.uint8, device=self.device)
        off = int(t.ptr[0]) - base.data_ptr() + base.storage_offset() * base.element_size()
        out.set_(base.untyped_storage(), off, (t.num_blocks, t.unified_block_bytes),
                 (int(t.block_stride[0]) if t.num_fragments == 1 else t.unified_block_bytes, 1))
        return out

    def _kernel(self, method, bi, uv, si, to_unified, stream, ctas) -> None:
        if self.device.type != "cuda":  # Triton interpreter on CPU tensors
            launch_triton_pack(self._base, uv.tensor, self._triton_table, torch.from_numpy(bi),
                               torch.from_numpy(si), bi.shape[0], self.table.num_fragments,
                               self.max_frag_bytes, uv.stride, vec_width(self.vec, uv.ptr, uv.stride),
                               to_unified, ctas)
            return
        # the copier's index ring is shared with every other user of the copier (get_copier's
        # is process-wide) and its C++ bookkeeping is not thread-safe: hold the copier's lock,
        # as BlockCopier.copy does
        with self.copier.lock:
            self._kernel_locked(method, bi, uv, si, to_unified, stream, ctas)

    def _kernel_locked(self, method, bi, uv, si, to_unified, stream, ctas) -> None:
        ring = self.copier.index_ring()
        sh = stream.cuda_stream
        vec = vec_width(self.vec, uv.ptr, uv.stride)
        for a in range(0, bi.shape[0], ring.capacity):
            b = min(bi.shape[0], a + ring.capacity)
            r, db, ds = ring.stage(bi[a:].ctypes.data, si[a:].ctypes.data, b - a, sh)
            if method == "cuda":  # positional: pybind11's keyword matching costs microseconds
                native.pack_layers(self._table_dev.data_ptr(), self.table.num_fragments, uv.ptr, db, ds, b - a,
                               self.max_frag_bytes, uv.stride, vec, to_unified, ctas, sh)
            else:
                n = b - a
                with torch.cuda.stream(stream):
                    launch_triton_pack(self._base, uv.tensor, self._triton_table, DevPtr(db, torch.int64),
                                       DevPtr(ds, torch.int64), n, self.table.num_fragments,
                                       self.max_frag_bytes, uv.stride, min(vec, self.vec),
                                       to_unified, ctas)
            ring.release(r, sh)

    def _staged(self, bi, uv, si, to_unified, stream, ctas) -> None:
        with self.copier.lock:  # the ring and the staging buffers are the copier's (see _kernel)
            self._staged_locked(bi, uv, si, to_unified, stream, ctas)

    def _staged_locked(self, bi, uv, si, to_unified, stream, ctas) -> None:
        cp = self.copier
        ub = self.unified_block_bytes
        d = "d2h" if to_unified else "h2d"
        slots = cp.slot_ids(cp.index_ring().capacity)
        pack_ctas = max(ctas, STAGED_PACK_CTAS)
        st = cp.staging(d)
        vec = vec_width(self.vec, st.buf.data_ptr(), st.half)

        def sm_step(a, b, buf, aux, dev_blocks, dev_slots):
            native.pack_layers(table=self._table_dev.data_ptr(), num_frags=self.table.num_fragments,
                           unified=buf.ptr, block_ids=dev_blocks, slot_ids=dev_slots, n_blocks=b - a,
                           max_frag_bytes=self.max_frag_bytes, unified_block_stride=ub,
                           vec_bytes=vec, to_unified=to_unified, num_ctas=pack_ctas, stream=aux.cuda_stream)

        def dma_step(a, b, buf, s):
            if to_unified:
                cp.run_dma(buf, uv, slots[: b - a], si[a:b], s, d, lanes=False)
            else:
                cp.run_dma(uv, buf, si[a:b], slots[: b - a], s, d, lanes=False)

        cp.staged_pipeline(d, bi, ub, stream, sm_step, dma_step)

    def _torch_move(self, bi, uv, si, to_unified) -> None:
        """Reference path: per-fragment torch copies (any device, slow)."""
        t = self.table
        u = torch.empty(0, dtype=torch.uint8, device=uv.device)
        u.set_(uv.tensor.untyped_storage(), uv.tensor.storage_offset() * uv.tensor.element_size(),
               (uv.num_blocks, uv.block_bytes), (uv.stride, 1))
        views = []
        for f in range(t.num_fragments):
            ten = next(x for x in t.tensors if x.data_ptr() <= t.ptr[f] < x.data_ptr() +
                       x.numel() * x.element_size())
            base = torch.empty(0, dtype=torch.uint8, device=ten.device)
            off = int(t.ptr[f]) - ten.data_ptr() + ten.storage_offset() * ten.element_size()
            base.set_(ten.untyped_storage(), off, (t.num_blocks, int(t.nbytes[f])),
                      (int(t.block_stride[f]), 1))
            views.append(base)
        bidx = torch.from_numpy(bi).to(self.device)
        sidx = torch.from_numpy(si).to(uv.device)
        for f, v in enumerate(views):
            o, nbytes = int(t.unified_offset[f]), int(t.nbytes[f])
            if to_unified:
                u[sidx, o:o + nbytes] = v[bidx].to(uv.device)
            else:
                v[bidx] = u[sidx, o:o + nbytes].to(self.device)
