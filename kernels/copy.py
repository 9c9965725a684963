"""Block copy between GPU memory and pinned host memory (and GPU to GPU).

    copier = BlockCopier(device="cuda:0")
    copier.copy(gpu_cache, host_pool, src_ids, dst_ids)            # D2H, method="auto"
    copy_blocks(host_pool, gpu_cache, pairs, method="dma", stream=s)  # H2D

Semantics (the reference in tests/reference.py): for every i,
``dst block dst_ids[i] <- src block src_ids[i]`` byte for byte. Destinations
must be distinct. Every call is asynchronous on `stream` (default: the current
stream) and never synchronises the host, except when more than `ring_slots`
kernel jobs are still in flight and an index slot must be reused.

Methods:
  dma     copy engines: cudaMemcpyBatchAsync in calls of up to 512 descriptors (runs of
          consecutive ids coalesced), falling back to a loop of cudaMemcpyAsync.
  cuda    CUDA C++ SM kernel, 16-byte vectors, reads/writes pinned memory via UVA.
  triton  the same in Triton.
  staged  SM gather into a GPU staging buffer, then DMA (D2H); DMA into staging,
          then SM scatter (H2D). SMs only touch HBM, so compute is barely slowed.
  torch   index_select/index_copy; the portable fallback.
  auto    chosen by the calibrated cost model (kernels.cost_model).
"""
from __future__ import annotations

import contextlib
import numbers
import threading
from typing import Any, Callable, Literal, Optional, Sequence, Union

import numpy as np
import torch

from . import native
from . import tracing as _nvtx
from ._ext import _C, _C_REASON
from .cost_model import CostModel, load_cost_model
from .plan import (_SEGMENTS, BlockView, KVOffloadError, as_host_ids, block_view, check_ids, count_runs, segments_for,
                   ranges_overlap, vec_width)
from . import triton_copy
from .triton_copy import HAVE_TRITON, DevPtr, launch_triton_copy

Method = Literal["auto", "dma", "cuda", "triton", "staged", "torch"]
BoundMethod = Literal["cuda", "triton", "dma"]
# block ids: a 1-D integer numpy array, CPU tensor or sequence (int64 numpy arrays are used as they are);
# copy()/copy_blocks() also take one [n, 2] array of (src, dst) pairs as src_ids with dst_ids=None
Ids = Union[np.ndarray, torch.Tensor, Sequence[int]]
Device = Union[torch.device, str, int, None]
METHODS = ("dma", "cuda", "triton", "staged", "torch")
BOUND_METHODS = ("cuda", "triton", "dma")  # what BlockCopier.bind serves
_WARP = 0  # kvo::CopyVariant warp (BlockCopier._VARIANTS)
DEFAULT_NUM_CTAS = 16  # at most 16 SMs: PCIe saturates long before that
# Triton programs for H2D when the caller gives no count. A Triton program keeps fewer host
# reads in flight than a CUDA CTA, so 16 programs leave H2D short of the SM ceiling where 16
# CUDA CTAs reach it (figures: docs/design/sm-pcie-ceiling.md). D2H is at its ceiling with
# fewer programs, and busy-mode auto never takes an SM path.
DEFAULT_TRITON_H2D_CTAS = 32
DEFAULT_MAX_DESC_PER_CALL = 512  # descriptors per cudaMemcpyBatchAsync (BlockCopier doc)
DEFAULT_DMA_LANES = 4  # copy-engine lanes per DMA job (profiling/results/dma_lanes.json)
DEFAULT_DMA_LANE_MIN_BYTES = 1 << 20
DEFAULT_DMA_LANE_MIN_DESC_BYTES = 64 << 10
STAGED_PACK_CTAS = 32  # staging gathers are HBM<->HBM bursts


def direction(src_dev: torch.device, dst_dev: torch.device) -> str:
    """'d2h', 'h2d', 'd2d' or 'h2h'."""
    a = "d" if src_dev.type == "cuda" else "h"
    b = "d" if dst_dev.type == "cuda" else "h"
    return f"{a}2{b}"


_NULL = contextlib.nullcontext()
_MISS = object()


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Makes `device` the calling thread's current CUDA device for the launches inside.

    Kernels (CUDA and Triton), events and the ring's staging copies go to the current
    device; a copier or mover for cuda:1 used from a thread whose current device is 0
    (a TP rank that never called set_device) would otherwise launch on the wrong GPU.
    Free (no context switch) when the device is already current."""
    if device.type == "cuda" and torch.cuda.current_device() != device.index:
        return torch.cuda.device(device)
    return _NULL


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def _u8_blocks(v: BlockView) -> torch.Tensor:
    """[num_blocks, block_bytes] uint8 alias of a BlockView."""
    t = v.tensor
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    out.set_(t.untyped_storage(), t.storage_offset() * t.element_size(),
             (v.num_blocks, v.block_bytes), (v.stride, 1))
    return out


class _IndexRing:
    """Pinned + device id slots (memory owned here, bookkeeping in C++ `_C.IndexRing`).
    Kernels read the device slots, or with uva the pinned slots themselves; a slot holds
    int64 ids, or int32 ids after an SM copy job (IndexRing.copy_blocks)."""

    def __init__(self, device: torch.device, slots: int, capacity: int, uva: bool = False):
        self.capacity = capacity
        self.host = torch.empty((slots, 2 * capacity), dtype=torch.int64, pin_memory=True)
        self.dev = torch.empty((slots, 2 * capacity) if not uva else (1, 1), dtype=torch.int64, device=device)
        self.ring = _C.IndexRing(host=self.host.data_ptr(), dev=self.dev.data_ptr(), slots=slots,
                                 capacity=capacity, uva=uva)
        self.stage = self.ring.stage
        self.release = self.ring.release


_PAIR = getattr(_C, "int64_pair", None)
_CHECK_PAIR = getattr(_C, "check_pair", None)


def id_addrs(si: np.ndarray, di: np.ndarray) -> tuple:
    """Addresses of two int64 id arrays (as_host_ids' output, one length), in one C++ call
    where built: numpy's `.ctypes.data` costs several times more, warm and above all right
    after an idle wait (docs/design/cold-host-path.md)."""
    r = _PAIR(si, di) if _PAIR is not None else None
    if r is None:
        return si.ctypes.data, di.ctypes.data
    return r[1], r[2]


def check_id_pairs(si: np.ndarray, di: np.ndarray, n_src: int, n_dst: int) -> tuple[int, int, int]:
    """Validates copy ids: si, di 1-D int64 of one length (as_host_ids' output), si[i] in
    [0, n_src), di[i] in [0, n_dst), no duplicate in di. One C++ pass where built, else numpy.
    Returns the descriptor counts a DMA of them needs: (runs of consecutive (si, di) pairs,
    runs of si, runs of di). Raises KVOffloadError."""
    if si.shape[0] != di.shape[0]:
        raise KVOffloadError(f"src_ids and dst_ids differ in length ({si.shape[0]} vs {di.shape[0]})")
    if _C is None:
        check_ids(si, di, n_src, n_dst)
        return count_runs(si, di), count_runs(si), count_runs(di)
    # positional: pybind11's keyword matching costs microseconds per call
    r = _CHECK_PAIR(si, di, n_src, n_dst, False) if _CHECK_PAIR is not None else None
    if r is not None:  # the addresses and the check in one call
        code, idx, val, rb, rs, rd = r[3:]
    else:
        code, idx, val, rb, rs, rd = _C.check_ids(*id_addrs(si, di), si.shape[0], n_src, n_dst)
    if code:
        raise _ids_error(code, idx, val, n_src, n_dst)
    return rb, rs, rd


_check_ids_fast = check_id_pairs  # old name, for scripts


def _ids_error(code: int, idx: int, val: int, n_src: int, n_dst: int) -> KVOffloadError:
    """The exception for a failed C++ id check (kvo::IdError codes)."""
    name = "src_ids" if code in (1, 2) else "dst_ids"
    if code in (1, 3):
        return KVOffloadError(f"{name} contains a negative block id ({val}) at position {idx}")
    if code in (2, 4):
        n = n_src if code == 2 else n_dst
        return KVOffloadError(f"{name} contains block id {val}, out of range for {n} blocks "
                              f"(position {idx})")
    return KVOffloadError(f"dst_ids contains duplicate destination block {val} (position {idx}): "
                          "two copies would race for the same bytes")


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(device: torch.device) -> int:
    """cudaStream_t (as an int) of the device's current stream, without building a Stream object."""
    if _raw_stream is not None:
        return _raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


_current_stream_handle = current_stream_handle  # old name, for scripts


class _Staging:
    """Two halves of one GPU buffer plus the aux stream and events that pipeline them."""

    def __init__(self, device: torch.device, nbytes: int):
        self.half = (nbytes // 2) & ~255
        self.buf = torch.empty(2 * self.half, dtype=torch.uint8, device=device)
        self.views = [self.buf[: self.half], self.buf[self.half:]]
        # Highest priority: a gather/scatter waiting behind a long compute kernel
        # would stall the copy engine; high priority lets its CTAs in first.
        self.aux = torch.cuda.Stream(device, priority=-1)
        self.ready = [torch.cuda.Event(), torch.cuda.Event()]
        self.free = [torch.cuda.Event(), torch.cuda.Event()]
        self.entry, self.exit = torch.cuda.Event(), torch.cuda.Event()
        self.used = [False, False]
        # A job queued on the legacy default stream runs on `work` between `fork` and `join`
        # (BlockCopier.staged_pipeline): created by torch, so non-blocking.
        self.work = torch.cuda.Stream(device)
        self.fork, self.join = torch.cuda.Event(), torch.cuda.Event()


class BlockCopier:
    """Per-device copy engine: preallocated index ring, staging, and cost model.

    Args:
      device: the CUDA device (default: current), or "cpu" for the CPU paths.
      num_ctas: CTAs (Triton programs) for the SM kernels, default 16.
      triton_h2d_ctas: Triton programs for host -> device copies when a call gives no
        num_ctas, default 32 (see DEFAULT_TRITON_H2D_CTAS).
      ring_slots / ring_capacity: in-flight kernel jobs before back-pressure,
        and the most pairs per launch (bigger jobs are split).
      max_descriptors_per_call: bound on descriptors per cudaMemcpyBatchAsync. Small calls
        let the copy engines start while the host still issues the rest of a job, and the
        driver's cost per H2D descriptor grows with the call's size (random 4-32 KiB blocks:
        512 per call beat 16384 and one call for a job in both directions;
        profiling/results/dma_per_call*.json). The batcher caps it at 2048
        (kvo::kMaxDescPerCall; docs/design/staged-h2d-fault.md).
      staging_bytes: GPU staging per direction for method "staged" (allocated on
        first use, split in two halves that are filled and drained alternately).
      cost_model: a CostModel; default loads the device's calibration cache or
        the built-in H200 defaults.
      ids_via_uva: SM kernels read block ids straight from the pinned ring slot through
        UVA, skipping the id upload (a cudaMemcpyAsync that can queue behind bulk DMA on a
        copy engine), in every direction and shape ("cuda-uva" rows of
        profiling/results/transfer*.json). Off: the caps below pick the jobs that gain.
      ids_uva_d2h_max_bytes: D2H jobs of the cuda kernel's "warp" shape up to this many bytes
        read their ids through UVA even when ids_via_uva is off (0: never). Their id reads ride
        the idle H2D direction and the job needs no upload before it starts. 1000-block D2H jobs
        gain most at 4 KiB blocks and less as blocks grow; 1 GiB jobs gain nothing, hence the
        cap ("cuda-uva" rows of profiling/results/transfer.json). Not the "cta" and "bulk"
        shapes, which read a block's ids before its copy starts: UVA ids slowed them.
      ids_uva_h2d_max_bytes: the same for H2D "warp" jobs (0: never). Their id reads share the
        direction the data comes in by, yet the job skips the upload call and its wait: small
        1000-block H2D jobs gain a little, 64 KiB blocks and 1 GiB jobs nothing
        (profiling/probes/probe_ids_uva.py), hence a smaller cap than D2H's.
      dma_lanes: copy-engine lanes for method "dma" (1..8; 1 = the caller's stream only). A
        job's descriptors are spread over this many streams, forked from and joined back to
        the caller's stream, so several copy engines hide each other's per-descriptor cost
        (docs/design/dma-descriptor-cost.md, profiling/results/dma_lanes.json). Ordering is unchanged: the job starts after earlier
        work on the caller's stream and later work waits for all of it.
      dma_lane_min_bytes: the least bytes per lane; jobs under 2x this use one stream.
      dma_lane_min_desc_bytes: jobs whose mean descriptor (after coalescing) is smaller use
        one stream: with many tiny descriptors several engines are slower than one.
    """

    def __init__(self, device: Device = None, *, num_ctas: int = DEFAULT_NUM_CTAS,
                 triton_h2d_ctas: int = DEFAULT_TRITON_H2D_CTAS, ring_slots: int = 16,
                 ring_capacity: int = 32768, max_descriptors_per_call: int = DEFAULT_MAX_DESC_PER_CALL,
                 staging_bytes: int = 128 << 20, cost_model: Optional[CostModel] = None,
                 ids_via_uva: bool = False, ids_uva_d2h_max_bytes: int = 64 << 20,
                 ids_uva_h2d_max_bytes: int = 16 << 20,
                 dma_lanes: int = DEFAULT_DMA_LANES,
                 dma_lane_min_bytes: int = DEFAULT_DMA_LANE_MIN_BYTES,
                 dma_lane_min_desc_bytes: int = DEFAULT_DMA_LANE_MIN_DESC_BYTES):
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda":
            # checked before torch touches CUDA: its own error on a CPU-only box is a bare
            # AssertionError ("Torch not compiled with CUDA enabled") from deep inside
            seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if seen == 0 or (self.device.index is not None and self.device.index >= seen):
                why = "no CUDA device is visible to this process" if seen == 0 else \
                    f"this process sees {seen} CUDA device(s)"
                raise KVOffloadError(f"BlockCopier({str(self.device)!r}): {why}; make the copier on "
                                     "device='cpu' (methods 'torch', or 'triton' with TRITON_INTERPRET=1) "
                                     "or run on a GPU")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if not (isinstance(dma_lanes, int) and 1 <= dma_lanes <= 8):
            raise KVOffloadError(f"dma_lanes must be an int in [1, 8], got {dma_lanes!r}")
        for k, v in (("dma_lane_min_bytes", dma_lane_min_bytes), ("dma_lane_min_desc_bytes", dma_lane_min_desc_bytes),
                     ("ids_uva_d2h_max_bytes", ids_uva_d2h_max_bytes),
                     ("ids_uva_h2d_max_bytes", ids_uva_h2d_max_bytes)):
            if not (isinstance(v, int) and v >= 0):
                raise KVOffloadError(f"{k} must be an int >= 0, got {v!r}")
        # checked here, not at the first job: a zero bound would otherwise fail deep in a
        # launch (the DMA batcher refuses 0 descriptors per call; a 0-slot ring never frees)
        for k, v in (("num_ctas", num_ctas), ("triton_h2d_ctas", triton_h2d_ctas), ("ring_slots", ring_slots),
                     ("ring_capacity", ring_capacity), ("max_descriptors_per_call", max_descriptors_per_call),
                     ("staging_bytes", staging_bytes)):
            if not (isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1):
                raise KVOffloadError(f"{k} must be an int >= 1, got {v!r}")
        num_ctas, triton_h2d_ctas, max_descriptors_per_call = int(num_ctas), int(triton_h2d_ctas), \
            int(max_descriptors_per_call)
        self.num_ctas = num_ctas
        self.triton_h2d_ctas = triton_h2d_ctas
        self.max_desc = max_descriptors_per_call
        # one lane set per copier: its side streams are made lazily, per caller stream
        self._dma_lanes = (_C.DmaLanes(dma_lanes, dma_lane_min_bytes, dma_lane_min_desc_bytes)
                           if _C is not None and dma_lanes > 1 else None)
        self.staging_bytes = staging_bytes
        self._staging: dict = {}
        self.staged_chunk_bytes = 32 << 20  # pipeline granularity of method "staged"
        self._ring: Optional[_IndexRing] = None
        self._ring_args = (ring_slots, ring_capacity, ids_via_uva)
        self.ids_uva_d2h_max_bytes = ids_uva_d2h_max_bytes
        self.ids_uva_h2d_max_bytes = ids_uva_h2d_max_bytes
        # held while the index ring or staging is used (their C++ bookkeeping is not thread-safe)
        self.lock = self._lock = threading.Lock()
        self.cost_model = cost_model or load_cost_model(self.device)
        self.last_method: Optional[str] = None
        self._views: dict = {}
        self._bound: dict = {}  # copy() of an explicit kernel/DMA method: cached BoundCopy
        # (cost model, its table of settled kernel_limits for our methods: CostModel.settled_limits),
        # read inline by copy()'s small-job hot path, which then skips two calls
        self._auto_lims: tuple = (None, {})
        # SM kernel shape: "warp" (2 KiB warp chunks), "cta" (a CTA per block), "bulk"
        # (TMA bulk copies through shared memory; sm_90+, 16-byte aligned blocks, else
        # "warp") or "auto": bulk for H2D if bulk_h2d, else bulk from bulk_min_bytes up, else
        # cta from cta_min_bytes up, else warp. bulk_h2d is off: alone, bulk H2D only tied warp
        # (both at the SM ceiling), but beside a warp D2H copy (loads and stores in flight
        # together) both directions fell by about a fifth against warp both ways
        # (profiling/results/transfer.json, bidir rows).
        self.cuda_variant = "auto"
        self.bulk_h2d = False
        self.cta_min_bytes = 1 << 62  # set from measurements; see profiling/results
        self.bulk_min_bytes = 1 << 62
        self._bulk_ok = (self.device.type == "cuda"
                         and torch.cuda.get_device_capability(self.device)[0] >= 9)
        self._pinned: dict = {}
        # DMA issue mode: _C.DMA_BATCH (batch API with the overlap-with-compute hint),
        # _C.DMA_BATCH_NO_HINT or _C.DMA_LOOP; set by benchmarks that compare them
        self.dma_mode: Optional[int] = None

    # ------------------------------------------------------------------ API
    def available_methods(self) -> tuple[str, ...]:
        am = self.__dict__.get("_avail")
        if am is None or (self.device.type != "cuda" and am[0] != _interpreting()):
            am = self._avail = (_interpreting(), self._available_methods())
        return am[1]

    def _available_methods(self) -> tuple[str, ...]:
        if self.device.type != "cuda":
            return ("torch", "triton") if (HAVE_TRITON and _interpreting()) else ("torch",)
        m = ["torch"]
        if _C is not None:
            m += ["dma", "cuda", "staged"]
        if HAVE_TRITON:
            m.append("triton")
        return tuple(m)

    def copy(self, src: torch.Tensor, dst: torch.Tensor, src_ids: Ids, dst_ids: Optional[Ids] = None, *,
             block_bytes: Optional[int] = None, method: Method = "auto",
             stream: Optional[torch.cuda.Stream] = None, num_ctas: Optional[int] = None,
             busy: Optional[bool] = None, ids_checked: bool = False) -> str:
        """Copies src blocks src_ids[i] to dst blocks dst_ids[i]; returns the method used.

        Args:
          src, dst: tensors whose dim 0 indexes blocks (``t[i]`` contiguous), or
            any contiguous tensors when `block_bytes` is given. GPU tensors on
            this copier's device; host tensors pinned (except for method torch).
            Same dtype on both sides.
          src_ids, dst_ids: host integer arrays (list, numpy or CPU tensor) of
            equal length; or `src_ids` alone as an [N, 2] array of pairs.
          block_bytes: block size in bytes, a multiple of the element width.
          method: "auto", "dma", "cuda", "triton", "staged" or "torch".
          stream: CUDA stream to queue on (default: current stream).
          num_ctas: CTAs / programs for the SM paths (default: default_ctas(method, direction)).
          busy: for auto, whether compute is running; None = query the current
            stream without blocking.
          ids_checked: the caller converted the ids to 1-D int64 numpy arrays (as_host_ids)
            and checked them against these two buffers (check_id_pairs) itself, so they are
            neither converted nor checked again: a planned job crosses this layer once
            (layout.KVBlockMover.run's block route, planned in KVBlockMover.prepare). Needs
            an explicit method and both id arrays.
        Raises:
          KVOffloadError before anything is queued, for any invalid input.
        """
        if ids_checked:
            if method == "auto" or type(src_ids) is not np.ndarray or type(dst_ids) is not np.ndarray:
                raise KVOffloadError("copy(ids_checked=True) needs an explicit method and both id arrays "
                                     "as as_host_ids returns them (1-D int64 numpy)")
            if method in BOUND_METHODS and self.device.type == "cuda" and type(src) is torch.Tensor \
                    and type(dst) is torch.Tensor:
                b = self._bound_for(src, dst, block_bytes, method, num_ctas)
                if b is not None:
                    return b._issue(src_ids, dst_ids, stream, checked=True,
                                    addrs=(src_ids.ctypes.data, dst_ids.ctypes.data))
        if dst_ids is None:
            pairs = as_host_ids_2d(src_ids)
            src_ids, dst_ids = pairs[:, 0], pairs[:, 1]
        if method in BOUND_METHODS and self.device.type == "cuda" and type(src) is torch.Tensor \
                and type(dst) is torch.Tensor:
            # explicit kernel/DMA method: the buffers' checks are cached in a BoundCopy
            b = self._bound_for(src, dst, block_bytes, method, num_ctas)
            if b is not None:
                return b(src_ids, dst_ids, stream)
        if method == "auto" and self.device.type == "cuda" and type(src) is torch.Tensor \
                and type(dst) is torch.Tensor:
            # auto on buffers seen before: their checks are cached, the pick is memoised, and
            # a kernel/DMA pick goes through its BoundCopy (an idle GPU waits on this host time)
            # (the cache lookup inline: _auto_for's call and closure cost microseconds cold)
            key = (src.data_ptr(), dst.data_ptr(), src.shape, dst.shape, src.stride(), dst.stride(),
                   src.dtype, dst.dtype, src.device, dst.device, block_bytes, "auto", num_ctas)
            a = self._bound.get(key, _MISS)
            if a is _MISS:
                a = self._auto_for(src, dst, block_bytes, num_ctas, key)
            if a is not None:
                d, bb, n_src, n_dst, bound = a
                si = as_host_ids(src_ids, "src_ids")
                di = as_host_ids(dst_ids, "dst_ids")
                n = si.shape[0]
                if busy is None:
                    busy = self._stream_busy()
                runs = None
                if not busy and bound is not None and 0 < n <= self._ring_args[1] and n == di.shape[0]:
                    # small blocks on an idle GPU: one fused C++ check + stage + launch, which
                    # hands the job back unqueued only if its ids coalesce enough for DMA to matter.
                    # An idle GPU waits on this host time: a settled answer is read here, not
                    # through available_methods() and kernel_limits() (two calls, each costly
                    # cold: docs/design/cold-host-path.md)
                    cm, al = self._auto_lims
                    lim = al.get((d, bb, n), _MISS) if cm is self.cost_model else _MISS
                    if lim is _MISS:
                        lim = self._kernel_limits(d, bb, n)
                    if lim is not None:
                        r = bound._issue(si, di, stream, limits=lim)
                        if r.__class__ is str:
                            return r
                        runs = r  # (runs_both, runs_host), ids checked
                if runs is None:
                    rb, rs, rd = check_id_pairs(si, di, n_src, n_dst)
                    runs = (rb, rs if d == "h2d" else rd)
                pick = self.cost_model.choose(d, bb, n, busy, self.available_methods(), n_desc=runs[0],
                                              n_desc_host=runs[1])
                if pick in BOUND_METHODS:
                    b = bound if pick == "cuda" and bound is not None else \
                        self._bound_for(src, dst, block_bytes, pick, num_ctas)
                    if b is not None:
                        return b._issue(si, di, stream, checked=True)
                method = pick  # staged / torch: the general path below
        sv = self.view(src, block_bytes, "src")
        dv = self.view(dst, block_bytes, "dst")
        si, di = (src_ids, dst_ids) if ids_checked else (as_host_ids(src_ids, "src_ids"), as_host_ids(dst_ids, "dst_ids"))
        self._check_tensors(sv, dv)
        d = direction(sv.device, dv.device)
        n = si.shape[0]
        runs = None if ids_checked else check_id_pairs(si, di, sv.num_blocks, dv.num_blocks)
        if ranges_overlap(sv, dv):
            self._check_no_alias(sv, dv, si, di)
        if method == "auto":
            if busy is None:
                busy = d != "h2h" and self._stream_busy()
            method = self.cost_model.choose(d, sv.block_bytes, si.shape[0], busy,
                                            self.available_methods(), n_desc=runs[0],
                                            n_desc_host=runs[1] if d == "h2d" else runs[2])
        self._check_method(method, sv, dv, d)
        self.last_method = method
        if n == 0:
            return method
        if method in BOUND_METHODS and self.device.type == "cuda":
            # auto's pick, issued through the cached BoundCopy (None for overlapping buffers)
            b = self._bound_for(src, dst, block_bytes, method, num_ctas)
            if b is not None:
                return b(si, di, stream)
        ctas = self._check_launch_args(stream, num_ctas, method, d)
        if stream is None and self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
        # the range's name is built only when something listens (kernels/_nvtx.py: cold, the
        # f-string and the calls cost a submit microseconds)
        rng = _nvtx.nvtx_range(f"kvo.copy {d} {method} n={n} bb={sv.block_bytes}") \
            if _nvtx.TOOL or _nvtx.PROF._is_profiler_enabled else _NULL
        with self._lock, on_device(self.device), rng:
            if method == "torch":
                self._run_torch(sv, dv, si, di, stream)
            elif method == "dma":
                self._run_dma(sv, dv, si, di, stream, d)
            elif method in ("cuda", "triton"):
                self._run_kernel(method, sv, dv, si, di, stream, ctas)
            elif method == "staged":
                self._run_staged(sv, dv, si, di, stream, d, ctas)
        return method

    # ---------------------------------------------------- for layout/ and connector/
    # The copier's parts that a caller issuing its own launches (layout.KVBlockMover, the
    # connector's worker) needs: hold `lock` around index_ring / staging use.
    def host_pinned(self, v: BlockView) -> bool:
        """Whether a host view from `view` is pinned (the answer `view` remembered, else asked)."""
        return bool(self._pinned.pop(id(v.tensor), None)) or v.tensor.is_pinned()

    def stream_busy(self) -> bool:
        """Whether the device's current stream still has work queued (never waits)."""
        return self._stream_busy()

    def index_ring(self) -> "_IndexRing":
        """The copier's ring of pinned + device id slots (made at first use); `.capacity` pairs per
        launch, `.stage(src_ptr, dst_ptr, n, stream) -> (slot, dev_src, dev_dst)`,
        `.release(slot, stream)`, `.ring.address` for native.pack_native. Hold `lock`."""
        return self._ring_get()

    def staging(self, d: str) -> "_Staging":
        """The GPU staging of direction d ("d2h"/"h2d") for staged_pipeline (made at first use)."""
        return self._staging_get(d)

    def slot_ids(self, n: int) -> np.ndarray:
        """int64 [0, n): the staging slots of a staged chunk."""
        return self._slot_ids(n)

    def run_dma(self, sv: BlockView, dv: BlockView, si: np.ndarray, di: np.ndarray, stream: torch.cuda.Stream, d: str,
                lanes: bool = True) -> None:
        """dv[di[i]] <- sv[si[i]] on the copy engines (checked ids), over the copier's lanes if `lanes`."""
        self._run_dma(sv, dv, si, di, stream, d, lanes)

    @property
    def dma_lanes(self) -> Optional[Any]:
        """The copier's DMA lane set (None: one stream); read-only."""
        return self._dma_lanes

    def make_submitter(self, max_per_call: int, lanes: bool = True) -> Any:
        """A native.DmaSubmitter (a C++ submit thread) on this copier's device that issues at most
        min(max_per_call, max_descriptors_per_call) descriptors per driver call, with its own copy
        of this copier's DMA lane settings when `lanes` (a lane set's mutex is held while it issues,
        so the thread must not share the copier's). Raises KVOffloadError without kernels._C."""
        if _C is None:
            raise KVOffloadError(f"a native submitter needs kernels._C: {_C_REASON}")
        dl = self._dma_lanes
        own = None if (dl is None or not lanes) else _C.DmaLanes(
            lanes=dl.lanes, min_lane_bytes=dl.min_lane_bytes, min_desc_bytes=dl.min_desc_bytes)
        return _C.DmaSubmitter(device=self.device.index, max_per_call=min(self.max_desc, int(max_per_call)),
                               lanes=own)

    def _stream_busy(self) -> bool:
        """Whether the device's current stream still has work queued (never waits)."""
        if _C is not None:
            return _C.stream_busy(current_stream_handle(self.device), self.device.index)
        return not torch.cuda.current_stream(self.device).query()

    def bind(self, src: torch.Tensor, dst: torch.Tensor, *, method: BoundMethod = "cuda",
             block_bytes: Optional[int] = None, num_ctas: Optional[int] = None) -> "BoundCopy":
        """A copy from `src` blocks to `dst` blocks whose buffers are checked once, here:
        calls then take only the ids (the engine's hot path). `method`: "cuda", "triton" or
        "dma". Raises KVOffloadError for buffers `copy` would reject, or that overlap."""
        if method not in BOUND_METHODS:
            raise KVOffloadError(f"bind() takes method 'cuda', 'triton' or 'dma', got {method!r}; "
                                 "use copy() for the others")
        sv = self.view(src, block_bytes, "src")
        dv = self.view(dst, block_bytes, "dst")
        self._check_tensors(sv, dv)
        d = direction(sv.device, dv.device)
        self._check_method(method, sv, dv, d)
        if ranges_overlap(sv, dv):
            raise KVOffloadError("bind() needs src and dst that do not overlap in memory; "
                                 "use copy() for moves inside one buffer")
        return BoundCopy(self, sv, dv, method, d, self._check_launch_args(None, num_ctas, method, d))

    def _kernel_limits(self, d: str, bb: int, n: int) -> Optional[tuple]:
        """cost_model.kernel_limits (its first sight of a shape answers None without working it
        out); the cost model keeps its settled answers in the table _auto_lims holds (the cost
        model's own, CostModel.settled_limits: no second memo here)."""
        cm, avail = self.cost_model, self.available_methods()
        if self._auto_lims[0] is not cm:
            self._auto_lims = (cm, cm.settled_limits(avail))
        return cm.kernel_limits(d, bb, n, avail)

    def _auto_for(self, src, dst, block_bytes, num_ctas, key=None) -> Optional[tuple]:
        """(direction, block bytes, src blocks, dst blocks, cuda BoundCopy or None) of two
        checked, non-overlapping device/pinned buffers, cached like _bound_for; None for
        overlapping or host-only ones. key: _per_buffers' key, if the caller built it."""
        def make(sv, dv):
            d = direction(sv.device, dv.device)
            if d == "h2h" or ranges_overlap(sv, dv):
                return None
            # the fused path needs the cuda kernel and int32 block ids
            fused = "cuda" in self.available_methods() and max(sv.num_blocks, dv.num_blocks) <= 2 ** 31
            return (d, sv.block_bytes, sv.num_blocks, dv.num_blocks,
                    self._bound_for(src, dst, block_bytes, "cuda", num_ctas) if fused else None)
        return self._per_buffers(src, dst, block_bytes, "auto", num_ctas, make, key)

    def _bound_for(self, src, dst, block_bytes, method, num_ctas) -> Optional["BoundCopy"]:
        """The cached BoundCopy of (src, dst, method); None (cached too) for overlapping
        buffers, which take the general path."""
        def make(sv, dv):
            if ranges_overlap(sv, dv):
                return None
            return self.bind(src, dst, method=method, block_bytes=block_bytes, num_ctas=num_ctas)
        return self._per_buffers(src, dst, block_bytes, method, num_ctas, make)

    def _per_buffers(self, src, dst, block_bytes, tag, num_ctas, make, key=None):
        # Keyed by everything that defines the buffers' geometry; a hit skips every tensor check.
        # (copy()'s auto path builds the same key inline)
        if key is None:
            key = (src.data_ptr(), dst.data_ptr(), src.shape, dst.shape, src.stride(), dst.stride(),
                   src.dtype, dst.dtype, src.device, dst.device, block_bytes, tag, num_ctas)
        try:
            return self._bound[key]
        except KeyError:
            pass
        sv = self.view(src, block_bytes, "src")
        dv = self.view(dst, block_bytes, "dst")
        self._check_tensors(sv, dv)
        v = make(sv, dv)
        if len(self._bound) >= 64:
            self._bound.clear()
        self._bound[key] = v
        return v

    # ------------------------------------------------------------ checks
    def view(self, t: torch.Tensor, block_bytes: Optional[int] = None, name: str = "buffer") -> BlockView:
        """t's block geometry (remembered per buffer: no re-derivation per job). Raises KVOffloadError.
        Public for layout/ and connector/ (their general path calls it per job, so it is the
        implementation itself, not a wrapper: no extra call frame)."""
        # Geometry and pinned-ness of the same buffer are re-derived only when
        # its address, shape, strides or dtype change: keeps the hot path short.
        if not isinstance(t, torch.Tensor):
            return block_view(t, block_bytes, name)
        key = (name, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device, block_bytes)
        hit = self._views.get(key)
        if hit is None:
            v = block_view(t, block_bytes, name)
            pinned = t.device.type == "cpu" and torch.cuda.is_available() and t.is_pinned()
            if len(self._views) > 256:
                self._views.clear()
            hit = self._views[key] = (v, pinned)
        elif hit[0].tensor is not t:
            hit = (BlockView(t, hit[0].num_blocks, hit[0].block_bytes, hit[0].stride), hit[1])
        self._pinned[id(hit[0].tensor)] = hit[1]
        return hit[0]

    def _check_tensors(self, sv: BlockView, dv: BlockView) -> None:
        if sv.tensor.dtype != dv.tensor.dtype:
            raise KVOffloadError(f"dtype mismatch: src {sv.tensor.dtype}, dst {dv.tensor.dtype}")
        if sv.block_bytes != dv.block_bytes:
            raise KVOffloadError(f"block size mismatch: src {sv.block_bytes} B, "
                                 f"dst {dv.block_bytes} B")
        for v, name in ((sv, "src"), (dv, "dst")):
            dev = v.device
            if dev.type == "cuda":
                if self.device.type != "cuda" or dev.index != self.device.index:
                    raise KVOffloadError(f"{name} is on {dev}, but this copier serves {self.device}")
            elif dev.type != "cpu":
                raise KVOffloadError(f"{name} is on unsupported device {dev}")

    def _check_method(self, method: str, sv: BlockView, dv: BlockView, d: str) -> None:
        if method not in METHODS:
            raise KVOffloadError(f"unknown method {method!r}; choose from auto, {', '.join(METHODS)}")
        if method not in self.available_methods():
            raise KVOffloadError(f"method {method!r} is not available on {self.device}: "
                                 f"{self._unavailable_why(method)}")
        if method == "torch" or self.device.type != "cuda":
            return
        if d == "h2h":
            raise KVOffloadError(f"method {method!r} needs at least one GPU tensor; use 'torch'")
        if method == "staged" and d == "d2d":
            raise KVOffloadError("method 'staged' is for host<->device copies")
        for v, name in ((sv, "src"), (dv, "dst")):
            pinned = self._pinned.pop(id(v.tensor), None)
            if pinned is None:
                pinned = v.tensor.is_pinned()
            if v.device.type == "cpu" and not pinned:
                raise KVOffloadError(f"{name} is pageable host memory; method {method!r} needs "
                                     "pinned memory (tensor.pin_memory() or a registered pool)")

    def _unavailable_why(self, method: str) -> str:
        """The real cause of a method missing from available_methods()."""
        if method == "triton":
            if not HAVE_TRITON:
                return f"triton is unavailable ({triton_copy.TRITON_REASON})"
            return "triton runs on CPU tensors only under its interpreter: set TRITON_INTERPRET=1"
        if self.device.type != "cuda":
            gpu = "no CUDA device is visible" if not torch.cuda.is_available() else \
                f"this copier serves {self.device}; make one on a CUDA device"
            return f"it runs on a CUDA GPU, and {gpu} (use 'torch', or 'triton' with TRITON_INTERPRET=1)"
        return f"kernels._C, the CUDA extension, is missing: {_C_REASON}"

    def default_ctas(self, method: str, d: str) -> int:
        """CTAs / programs an SM path of `method` in direction `d` uses when the caller gives none."""
        return self.triton_h2d_ctas if (method == "triton" and d == "h2d") else self.num_ctas

    def _check_launch_args(self, stream, num_ctas, method: str = "", d: str = "") -> int:
        """Validates the stream's device and the CTA count; returns the CTA count."""
        if stream is not None and stream.device != self.device:
            raise KVOffloadError(f"stream is on {stream.device}, copier on {self.device}")
        ctas = int(num_ctas or self.default_ctas(method, d))
        if ctas <= 0:
            raise KVOffloadError(f"num_ctas must be positive, got {ctas}")
        return ctas

    @staticmethod
    def _check_no_alias(sv, dv, si, di) -> None:
        # Same memory on both sides: only legal if no written block is also read
        # in this job (in-place moves inside one buffer, e.g. compaction).
        if sv.ptr != dv.ptr or sv.stride != dv.stride:
            raise KVOffloadError("src and dst overlap in memory with different geometry")
        if np.intersect1d(si, di).size:
            raise KVOffloadError("overlapping source and destination blocks in one buffer")

    # ------------------------------------------------------------ paths
    def _ring_get(self) -> _IndexRing:
        if self._ring is None:
            self._ring = _IndexRing(self.device, *self._ring_args)
        return self._ring

    def _ids_uva_cap(self, sv, dv) -> int:
        """The most bytes a warp-shape job from sv to dv may move with its ids read through
        UVA (-1: none, GPU to GPU)."""
        if sv.device.type == "cuda" and dv.device.type == "cpu":
            return self.ids_uva_d2h_max_bytes
        if sv.device.type == "cpu" and dv.device.type == "cuda":
            return self.ids_uva_h2d_max_bytes
        return -1

    def _run_kernel(self, method, sv, dv, si, di, stream, ctas) -> None:
        vec = vec_width(sv.ptr, dv.ptr, sv.block_bytes, sv.stride, dv.stride)
        if self.device.type != "cuda":  # Triton interpreter on CPU tensors
            launch_triton_copy(sv.tensor, dv.tensor, torch.from_numpy(si), torch.from_numpy(di),
                               si.shape[0], sv.block_bytes, sv.stride, dv.stride, 0, 0, vec, ctas)
            return
        ring = self._ring_get()
        # stream None: the current stream (Triton launches on the current stream)
        cur = stream is None or stream == torch.cuda.current_stream(self.device)
        sh = stream.cuda_stream if stream is not None else current_stream_handle(self.device)
        variant = self._variant(sv.block_bytes, vec, sv.device.type == "cpu" and dv.device.type == "cuda")
        uva = variant == _WARP and si.shape[0] * sv.block_bytes <= self._ids_uva_cap(sv, dv)  # as in BoundCopy._issue
        for a in range(0, si.shape[0], ring.capacity):
            b = min(si.shape[0], a + ring.capacity)
            if method == "cuda":  # ids already checked; the C++ re-check of a chunk is one cheap pass
                code, idx, val = ring.ring.copy_blocks(
                    src=sv.ptr, dst=dv.ptr, src_ids=si[a:].ctypes.data, dst_ids=di[a:].ctypes.data, n=b - a,
                    n_src=sv.num_blocks, n_dst=dv.num_blocks, block_bytes=sv.block_bytes, src_stride=sv.stride,
                    dst_stride=dv.stride, vec_bytes=vec, num_ctas=ctas, stream=sh,
                    variant=variant, ids_uva=uva)
                if code:
                    raise _ids_error(code, idx, val, sv.num_blocks, dv.num_blocks)
                continue
            k, ds, dd = ring.stage(si[a:].ctypes.data, di[a:].ctypes.data, b - a, sh)
            n = b - a
            dsrc, ddst = DevPtr(ds, torch.int64), DevPtr(dd, torch.int64)  # no tensor views per launch
            if cur:
                launch_triton_copy(sv.tensor, dv.tensor, dsrc, ddst, n, sv.block_bytes,
                                   sv.stride, dv.stride, 0, 0, vec, ctas)
            else:
                with torch.cuda.stream(stream):
                    launch_triton_copy(sv.tensor, dv.tensor, dsrc, ddst, n, sv.block_bytes,
                                       sv.stride, dv.stride, 0, 0, vec, ctas)
            ring.release(k, sh)

    _VARIANTS = {"warp": _WARP, "cta": 1, "bulk": 2}

    def _variant(self, block_bytes: int, vec: int, h2d: bool = False) -> int:
        """kvo::CopyVariant of the cuda kernel for one job (see cuda_variant)."""
        v = self.cuda_variant
        if v == "auto":
            v = ("bulk" if vec == 16 and ((h2d and self.bulk_h2d) or block_bytes >= self.bulk_min_bytes) else
                 "cta" if block_bytes >= self.cta_min_bytes else "warp")
        if v == "bulk" and not (vec == 16 and self._bulk_ok):
            v = "warp"  # bulk copies need 16-byte alignment and sm_90
        if v not in self._VARIANTS:
            raise KVOffloadError(f"cuda_variant must be one of auto, {', '.join(self._VARIANTS)}; got {v!r}")
        return self._VARIANTS[v]

    def _run_dma(self, sv, dv, si, di, stream, d, lanes: bool = True) -> None:
        # lanes=False: one stream. The staged pipeline's DMA steps use that: its chunks are
        # already large and pipelined, and with lanes its H2D rate fell a few percent of the
        # big copy (profiling/results/transfer.json, staged rows).
        bb = sv.block_bytes
        ssb, sss = segments_for(sv.ptr) if _SEGMENTS else (0, 0)
        dsb, dss = segments_for(dv.ptr) if _SEGMENTS else (0, 0)
        sa, da = id_addrs(si, di)
        _C.dma_blocks(src_ids=sa, dst_ids=da, n=si.shape[0],
                      src_base=sv.ptr, dst_base=dv.ptr, src_stride=sv.stride, dst_stride=dv.stride,
                      block_bytes=bb, coalesce=(sv.stride == bb and dv.stride == bb),
                      max_per_call=self.max_desc, mode=_C.DMA_BATCH if self.dma_mode is None else self.dma_mode,
                      src_any_order=False,
                      stream=stream.cuda_stream, src_seg_base=ssb, src_seg_bytes=sss,
                      dst_seg_base=dsb, dst_seg_bytes=dss, lanes=self._dma_lanes if lanes else None)

    def _staging_get(self, d: str) -> "_Staging":
        st = self._staging.get(d)
        if st is None:
            st = self._staging[d] = _Staging(self.device, self.staging_bytes)
        return st

    def staged_pipeline(self, d: str, ids: np.ndarray, bb: int, stream: torch.cuda.Stream,
                        sm_step: Callable[..., None], dma_step: Callable[..., None]) -> None:
        """Pipelined staging: two GPU buffers per direction, SM work on an aux stream.

        ids: the GPU-side block ids of the job (host int64 array). D2H:
        ``sm_step(a, b, buf, aux, dev_ids, dev_slots)`` fills staging slots
        0..b-a of `buf` with items a..b on the aux stream while the copy engine
        drains the previous chunk with ``dma_step(a, b, buf, stream)`` from the
        other buffer. H2D: the mirror image. dev_ids / dev_slots are device
        pointers to items a..b of `ids` and to their staging slots; they are
        staged once per group of chunks, not per chunk, so a long job never
        waits on the index ring. Events order every reuse of a buffer after its
        last reader or writer; the job completes in `stream` order.

        One of two staged pipelines: the native submitter has its own (StagedPipe in
        kernels/csrc/dma_submitter.h), which runs the connector worker's per-layer pack jobs by
        default. This one stays for what that one cannot run: block copies (copy_blocks /
        BlockCopier.copy with method "staged", or `auto` picking it with compute running,
        including a worker's unified-block jobs that `auto` resolves to staged), and per-layer
        moves on the caller's stream (KVBlockMover.pack/unpack, the worker's inline and async
        strategies, and its native one when a block is over half the staging). The native
        pipe runs only on the submitter's thread, behind its ticket, so a caller's-stream API
        cannot use it: this one stays. The native one stays too: on the same jobs it moves the
        same GB/s, but its caller spends a small fraction of this one's host time per submit,
        and the caller is the engine's thread (profiling/probes/probe_staged_pipes.py; the
        figures: docs/design/two-staged-pipelines.md).
        """
        st = self._staging_get(d)
        ring = self._ring_get()
        per = min(st.half, self.staged_chunk_bytes) // bb
        if per < 1:
            raise KVOffloadError(f"block of {bb} B exceeds half the staging buffer "
                                 f"({st.half} B); raise staging_bytes or use method 'dma'")
        per = min(per, ring.capacity)
        group = (ring.capacity // per) * per  # chunks never straddle two staged groups
        n = ids.shape[0]
        ah = st.aux.cuda_stream
        outer = None
        if stream.cuda_stream == 0:
            # The legacy default stream: the batch API refuses it, so each DMA step would go to the
            # per-thread default stream, interleaved with this job's events on the legacy one and
            # ordered by the implicit sync between the two: the configuration of the staged H2D
            # fault (docs/design/staged-h2d-fault.md). The job runs on a created stream instead,
            # forked from and joined back to the caller's, so it keeps plain stream semantics.
            outer, stream = stream, st.work
            st.fork.record(outer)
            stream.wait_event(st.fork)
        st.entry.record(stream)
        st.aux.wait_event(st.entry)  # SM work sees everything queued before this job
        r = None  # the ring slot of the group being issued, until it is released
        try:
            for g0 in range(0, n, group):
                g1 = min(n, g0 + group)
                local = np.arange(g1 - g0, dtype=np.int64) % per
                r, dev_ids, dev_slots = ring.stage(ids[g0:].ctypes.data, local.ctypes.data, g1 - g0, ah)
                for j, a in enumerate(range(g0, g1, per)):
                    b = min(g1, a + per)
                    k = (a // per) % 2
                    buf = BlockView(st.views[k], st.half // bb, bb, bb)
                    off = 8 * (a - g0)
                    if d == "d2h":
                        if st.used[k]:
                            st.aux.wait_event(st.free[k])
                        sm_step(a, b, buf, st.aux, dev_ids + off, dev_slots + off)
                        st.ready[k].record(st.aux)
                        stream.wait_event(st.ready[k])
                        dma_step(a, b, buf, stream)
                        st.free[k].record(stream)
                    else:
                        if st.used[k]:
                            stream.wait_event(st.free[k])
                        dma_step(a, b, buf, stream)
                        st.ready[k].record(stream)
                        st.aux.wait_event(st.ready[k])
                        sm_step(a, b, buf, st.aux, dev_ids + off, dev_slots + off)
                        st.free[k].record(st.aux)
                    st.used[k] = True
                ring.release(r, ah)  # after the group's last SM step on the aux stream
                r = None
            if d == "h2d":
                st.exit.record(st.aux)
                stream.wait_event(st.exit)
            if outer is not None:
                st.join.record(stream)
                outer.wait_event(st.join)
        except BaseException:
            self._staged_abort(st, ring, r, ah, stream)
            raise

    @staticmethod
    def _staged_abort(st: "_Staging", ring, r, ah: int, stream) -> None:
        """After a step of a staged job failed (a driver error, a bad argument), part of the job
        is queued: an id upload and SM steps on the aux stream that read ring slot `r`, DMA into
        or out of a staging half. Without this, `r` stays taken with the event of its previous
        use, so the ring later hands it out and overwrites the pinned ids that the queued upload
        has not read yet (the queued kernels then move other jobs' blocks), and the next job's
        reuse of a half waits on events that do not cover the queued DMA. So: release `r` on
        aux (its event then covers what was queued), wait for both streams, and start the next
        job with both halves free, as the native pipe does (DmaSubmitter::issue_staged).
        Errors here (a sticky device error) are dropped: the caller re-raises the first one."""
        steps = [st.aux.synchronize, stream.synchronize]
        if r is not None:
            steps.insert(0, lambda: ring.release(r, ah))
        for step in steps:
            try:
                step()
            except Exception:
                pass
        st.used = [False, False]

    def _run_staged(self, sv, dv, si, di, stream, d, ctas) -> None:
        bb = sv.block_bytes
        st = self._staging_get(d)
        vec = vec_width(sv.ptr, dv.ptr, bb, sv.stride, dv.stride, st.buf.data_ptr(), st.half)
        slots = self._slot_ids(self._ring_get().capacity)
        pack_ctas = max(ctas, STAGED_PACK_CTAS)

        def sm_step(a, b, buf, aux, dev_ids, dev_slots):
            if d == "d2h":  # gather GPU blocks into staging slots 0..b-a
                _C.copy_blocks(src=sv.ptr, dst=buf.ptr, src_ids=dev_ids, dst_ids=dev_slots, n_pairs=b - a,
                               block_bytes=bb, src_stride=sv.stride, dst_stride=bb, src_offset=0,
                               dst_offset=0, vec_bytes=vec, num_ctas=pack_ctas, stream=aux.cuda_stream)
            else:  # scatter staging slots 0..b-a into GPU blocks
                _C.copy_blocks(src=buf.ptr, dst=dv.ptr, src_ids=dev_slots, dst_ids=dev_ids, n_pairs=b - a,
                               block_bytes=bb, src_stride=bb, dst_stride=dv.stride, src_offset=0,
                               dst_offset=0, vec_bytes=vec, num_ctas=pack_ctas, stream=aux.cuda_stream)

        def dma_step(a, b, buf, stream_):
            if d == "d2h":
                self._run_dma(buf, dv, slots[: b - a], di[a:b], stream_, d, lanes=False)
            else:
                self._run_dma(sv, buf, si[a:b], slots[: b - a], stream_, d, lanes=False)

        self.staged_pipeline(d, si if d == "d2h" else di, bb, stream, sm_step, dma_step)

    def _slot_ids(self, n: int) -> np.ndarray:
        if getattr(self, "_slots", None) is None or self._slots.shape[0] < n:
            self._slots = np.arange(n, dtype=np.int64)
        return self._slots

    def _run_torch(self, sv, dv, si, di, stream) -> None:
        s = _u8_blocks(sv)
        t = _u8_blocks(dv)
        ctx = torch.cuda.stream(stream) if stream is not None else _null()
        with ctx:
            src_idx = torch.from_numpy(si).to(s.device, non_blocking=True)
            dst_idx = torch.from_numpy(di).to(t.device, non_blocking=True)
            # blocking when landing in host memory: index_copy_ on the CPU would
            # otherwise read the temporary before the device copy finished
            rows = s.index_select(0, src_idx).to(t.device, non_blocking=t.device.type == "cuda")
            t.index_copy_(0, dst_idx, rows)


class BoundCopy:
    """A block copy between two fixed buffers, its method chosen and its buffers checked
    once (`BlockCopier.bind`). Each call takes only the ids:

        store = copier.bind(gpu_cache, host_pool, method="cuda")  # [NB, block] each
        store(src_ids, dst_ids)            # dst block dst_ids[i] <- src block src_ids[i]
        store(src_ids, dst_ids, stream=s)

    A call checks the ids (range, duplicate destinations: KVOffloadError before anything
    is queued) and queues the copy, in one call into C++ for "cuda". It is asynchronous and
    never synchronises the host (except when the index ring must wait for a slot). The
    buffers must keep their storage while bound (no resize_ or set_); the bound copy holds
    references to them. Safe to call from several threads (the copier's lock)."""

    def __init__(self, copier: BlockCopier, sv: BlockView, dv: BlockView, method: str, d: str, num_ctas: int):
        self.copier, self.src, self.dst, self.method, self.direction = copier, sv, dv, method, d
        self.num_ctas = num_ctas
        self._dev = copier.device.index
        self._ptrs = (sv.ptr, dv.ptr)
        self._vec = vec_width(sv.ptr, dv.ptr, sv.block_bytes, sv.stride, dv.stride)
        self._seg = (segments_for(sv.ptr) + segments_for(dv.ptr)) if _SEGMENTS else (0, 0, 0, 0)
        self._label = f"kvo.copy {d} {method} bb={sv.block_bytes} n="
        # triton: jobs of int32-sized buffers stage int32 ids in C++ (one pass with the check);
        # after a shape's first launch through Triton's launcher, its compiled kernel is
        # launched from C++ too (IndexRing.copy_blocks_fn): per job, one call like "cuda"
        self._t32 = (method == "triton" and _C is not None and copier.device.type == "cuda"
                     and max(sv.num_blocks, dv.num_blocks) <= 2 ** 31)
        self._tfn: dict = {}  # (n == 1, n % 16 == 0, n % 4 == 0) -> fn_spec tuple, or False
        if self._t32:
            _, epb, _, chunks, ss, ds = triton_copy.copy_launch_args(sv.block_bytes, sv.stride, dv.stride,
                                                                     self._vec)
            self._targs = (num_ctas, chunks, sv.ptr, dv.ptr)
            self._tgeom = (epb, ss, ds, 0, 0)
        self.fast_launches = 0  # triton jobs launched from C++ (tests read it)
        if copier.device.type != "cuda":  # CPU tensors: Triton's interpreter (the only bound method there)
            self._issue = self._issue_cpu

    def _issue_cpu(self, si: np.ndarray, di: np.ndarray, stream, limits=None, checked: bool = False,
                   addrs=None) -> str:
        """_issue for a CPU copier: the Triton interpreter on CPU tensors (TRITON_INTERPRET=1),
        the ids checked first; no CUDA stream, so `stream` must be None."""
        if stream is not None:
            raise KVOffloadError("a CPU copier takes no CUDA stream")
        cp, sv, dv = self.copier, self.src, self.dst
        check_id_pairs(si, di, sv.num_blocks, dv.num_blocks)
        cp.last_method = self.method
        if si.shape[0]:
            cp._run_kernel(self.method, sv, dv, si, di, None, self.num_ctas)
        return self.method

    def __call__(self, src_ids: Ids, dst_ids: Ids, stream: Optional[torch.cuda.Stream] = None) -> str:
        """Queues the copy on `stream` (default: the current stream); returns the method."""
        return self._issue(as_host_ids(src_ids, "src_ids"), as_host_ids(dst_ids, "dst_ids"), stream)

    def _issue(self, si: np.ndarray, di: np.ndarray, stream, limits=None, checked: bool = False, addrs=None):
        """__call__ on int64 id arrays. checked: the ids passed check_ids against these
        buffers already. addrs: the arrays' addresses, when the caller has planned the ids
        (copy(ids_checked=True)): then nothing re-reads them before the launch. limits (cuda,
        n <= ring capacity, from CostModel.kernel_limits): returns (runs_both, runs_host) with nothing queued if the ids coalesce within them."""
        n = si.shape[0]
        if n != di.shape[0]:
            raise KVOffloadError(f"src_ids and dst_ids differ in length ({n} vs {di.shape[0]})")
        cp, sv, dv = self.copier, self.src, self.dst
        if stream is None:
            sh = _raw_stream(self._dev) if _raw_stream is not None else \
                torch.cuda.current_stream(cp.device).cuda_stream
        else:
            if stream.device_index != self._dev:
                raise KVOffloadError(f"stream is on {stream.device}, copier on {cp.device}")
            sh = stream.cuda_stream
        cp.last_method = self.method
        if n == 0:
            return self.method
        sp, dp = self._ptrs
        sa, da = id_addrs(si, di) if addrs is None else addrs
        rng = _nvtx.nvtx_range(self._label + str(n)) if _nvtx.TOOL or _nvtx.PROF._is_profiler_enabled else _NULL
        with cp._lock, on_device(cp.device), rng:
            if self.method == "cuda" and n <= cp._ring_args[1]:
                # check + stage + upload + launch in one GIL-free call (positional: pybind11's
                # keyword matching costs microseconds per call)
                ring = cp._ring_get().ring
                variant = cp._variant(sv.block_bytes, self._vec, self.direction == "h2d")
                args = (sp, dp, sa, da, n, sv.num_blocks, dv.num_blocks, sv.block_bytes,
                        sv.stride, dv.stride, self._vec, self.num_ctas, sh, variant)
                # small warp-kernel jobs to or from the host read their ids through UVA
                # (ids_uva_d2h_max_bytes, ids_uva_h2d_max_bytes)
                d = self.direction
                uva = variant == _WARP and n * sv.block_bytes <= (
                    cp.ids_uva_d2h_max_bytes if d == "d2h" else cp.ids_uva_h2d_max_bytes if d == "h2d" else -1)
                if limits is None:
                    code, idx, val = ring.copy_blocks(*args, -1, -1, False, uva)
                else:
                    code, idx, val = ring.copy_blocks(*args, limits[0], limits[1], self.direction == "h2d", uva)
                    if code == native.TRY_OTHER_METHOD:  # valid ids, nothing queued
                        cp.last_method = None
                        return idx, val
                if code:  # nothing was queued
                    raise _ids_error(code, idx, val, sv.num_blocks, dv.num_blocks)
                return "cuda"
            if self._t32 and n <= cp._ring_args[1]:
                self._issue_triton32(si, di, n, stream, sh, sa, da)
                return "triton"
            if not checked:
                code, idx, val, _, _, _ = _C.check_ids(sa, da, n, sv.num_blocks,
                                                       dv.num_blocks)
                if code:
                    raise _ids_error(code, idx, val, sv.num_blocks, dv.num_blocks)
            if self.method == "dma":
                bb = sv.block_bytes
                _C.dma_blocks(sa, da, n, sp, dp, sv.stride, dv.stride, bb,
                              sv.stride == bb and dv.stride == bb, cp.max_desc,
                              _C.DMA_BATCH if cp.dma_mode is None else cp.dma_mode, False, sh, *self._seg,
                              cp._dma_lanes)
            else:  # triton, or a cuda job longer than one ring slot
                cp._run_kernel(self.method, sv, dv, si, di, stream, self.num_ctas)
        return self.method

    def _issue_triton32(self, si: np.ndarray, di: np.ndarray, n: int, stream, sh: int, sa: int, da: int) -> None:
        """A triton job on int32 ids (caller holds the copier's lock and device): check + stage
        in C++, then the launch, from C++ once this shape's compiled kernel is known. sa, da:
        the id arrays' addresses."""
        cp, sv, dv = self.copier, self.src, self.dst
        ring = cp._ring_get().ring
        # what Triton may still specialise on per job (ids are unspecialised, but older
        # Triton versions may ignore that): n == 1, n's divisibility, the dst ids' alignment
        key = (n == 1, n & 15 == 0, n & 3 == 0)
        spec = self._tfn.get(key)
        if spec and triton_copy._FAST and not triton_copy.hooks_set():
            code, idx, val = ring.copy_blocks_fn(*spec, *self._targs, sa, da, n,
                                                 sv.num_blocks, dv.num_blocks, *self._tgeom, sh)
            if code:
                raise _ids_error(code, idx, val, sv.num_blocks, dv.num_blocks)
            self.fast_launches += 1
            return
        code, idx, val, slot, ds, dd = ring.stage_checked32(sa, da, n, sv.num_blocks,
                                                            dv.num_blocks, sh)
        if code:
            raise _ids_error(code, idx, val, sv.num_blocks, dv.num_blocks)
        try:
            with (_null() if stream is None else torch.cuda.stream(stream)):
                ck = launch_triton_copy(sv.tensor, dv.tensor, DevPtr(ds, torch.int32), DevPtr(dd, torch.int32), n,
                                        sv.block_bytes, sv.stride, dv.stride, 0, 0, self._vec, self.num_ctas)
        finally:
            ring.release(slot, sh)
        if key not in self._tfn and triton_copy._FAST and not triton_copy.hooks_set():
            self._tfn[key] = (ck is not None and triton_copy.fn_spec(ck, 10)) or False


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def as_host_ids_2d(pairs: Union[np.ndarray, torch.Tensor, Sequence[Sequence[int]]]) -> np.ndarray:
    arr = pairs.numpy() if isinstance(pairs, torch.Tensor) and pairs.device.type == "cpu" \
        else np.asarray(pairs)
    if isinstance(pairs, torch.Tensor) and pairs.device.type != "cpu":
        raise KVOffloadError("pairs must be on the host")
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise KVOffloadError(f"pairs must have shape [N, 2], got {tuple(arr.shape)}")
    return arr


_default: dict = {}


def get_copier(device: Device = None) -> BlockCopier:
    """The process-wide BlockCopier for a device (created on first use)."""
    dev = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
        else torch.device("cpu"))
    key = str(dev)
    if key not in _default:
        _default[key] = BlockCopier(dev)
    return _default[key]


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: Ids, dst_ids: Optional[Ids] = None, *,
                block_bytes: Optional[int] = None, method: Method = "auto",
                stream: Optional[torch.cuda.Stream] = None, num_ctas: Optional[int] = None,
                busy: Optional[bool] = None) -> str:
    """Functional form of BlockCopier.copy (same arguments) on the device of the GPU-side
    tensor's process-wide copier (get_copier). Returns the method used."""
    dev = src.device if src.device.type == "cuda" else dst.device
    return get_copier(dev).copy(src, dst, src_ids, dst_ids, block_bytes=block_bytes, method=method,
                                stream=stream, num_ctas=num_ctas, busy=busy)
