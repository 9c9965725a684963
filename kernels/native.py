"""The door to the CUDA extension (kernels._C) for code outside kernels/.

layout/ and connector/ reach the extension only through the names below (tests/test_imports.py
enforces it); kernels' own modules use kernels._ext. Callers bind these names once, at
construction (`self._submit = native.submit_native`), so a hot path pays no extra call frame.

    AVAILABLE                 whether kernels._C was importable in this process
    REASON                    why not ("" when it is)
    require(what)             raises KVOffloadError naming `what` and REASON when it is not

Entry points (None when the extension is absent; arguments are raw addresses and handles as
ints, see kernels/csrc/bindings.cu for each one's full argument list):

  ids        check_pair(block_ids, slot_ids, n_src, n_dst, swap) -> None (not two 1-D int64
             arrays of one length) or (n, addr, addr, code, index, value, runs_both, runs_src,
             runs_dst): the checks of kernels.check_id_pairs in one call, positional only
  events     job_begin(after, compute, record_after, stream, start, device);
             event_record(event, stream, device)
  submitter  DmaSubmitter (make one with BlockCopier.make_submitter); submit_native(address,
             compute, src_ids, dst_ids, n, after, fixed) and pack_submit_native(...): the
             worker's one-call submits of a whole job onto the submitter's thread
  pack       pack_native(ring_address, ...): a per-layer pack job in one call on the caller's
             thread (ring: BlockCopier.index_ring().address); pack_layers(...): the fragment
             gather/scatter kernel; dma_fragments(...): fragments on the copy engines
  host       host_register(ptr, nbytes) -> cudaError_t code; host_unregister(ptr);
             prefault(ptr, nbytes, threads, write)
  faults     TEST ONLY: inject_fault(site, after=0, error=999, times=1), clear_faults(),
             fault_counts(site) -> (calls, hits, armed): make the `after`+1-th driver call at a
             site ("memcpy_batch", "memcpy_async", "kernel_launch"; kernels/csrc/fault.h) fail
             with cudaError_t `error` instead of being made (tests/test_gpu_faults.py)
  profiling  host_threads(enable=-1) -> (helpers, on, spin, ...): the host id scan's helper
             threads; time_cuda_host_alloc(nbytes): cudaHostAlloc timed; and, for probes that time
             the pieces of a submit: int64_pair, check_ids, copy_blocks, dma_blocks (the raw
             block-copy launchers; product code goes through BlockCopier)
  constants  DMA_BATCH, DMA_LOOP, DMA_BATCH_NO_HINT (DMA issue modes); PACK_DIRECT, PACK_AUTO,
             PACK_STAGED (pack_submit_native's mode); PACK_NOT_ID_ARRAYS (its "not id arrays" code);
             TRY_OTHER_METHOD (kvo::kTryOtherMethod: valid ids, nothing queued, another path
             takes the job: IndexRing.copy_blocks' run limits, pack_submit_native's busy auto)
"""
from __future__ import annotations

from typing import Any, NoReturn

from ._ext import _C, _C_REASON
from .plan import KVOffloadError

AVAILABLE: bool = _C is not None
REASON: str = "" if AVAILABLE else _C_REASON


def require(what: str) -> None:
    """Raises KVOffloadError("<what> needs kernels._C: <reason>") when the extension is absent."""
    if not AVAILABLE:
        _missing(what)


def _missing(what: str) -> NoReturn:
    raise KVOffloadError(f"{what} needs kernels._C, the CUDA extension: {REASON}")


def _get(name: str) -> Any:
    return getattr(_C, name) if _C is not None else None


check_pair = _get("check_pair")
job_begin = _get("job_begin")
event_record = _get("event_record")
DmaSubmitter = _get("DmaSubmitter")
submit_native = _get("submit_native")
pack_submit_native = _get("pack_submit_native")
pack_native = _get("pack_native")
pack_layers = _get("pack_layers")
dma_fragments = _get("dma_fragments")
host_register = _get("host_register")
host_unregister = _get("host_unregister")
prefault = _get("prefault")
inject_fault = _get("inject_fault")
clear_faults = _get("clear_faults")
fault_counts = _get("fault_counts")
host_threads = _get("host_threads")
time_cuda_host_alloc = _get("time_cuda_host_alloc")
int64_pair = _get("int64_pair")
check_ids = _get("check_ids")
copy_blocks = _get("copy_blocks")
dma_blocks = _get("dma_blocks")
FAULT_SITES = ("memcpy_batch", "memcpy_async", "kernel_launch")
DMA_BATCH = _get("DMA_BATCH")
DMA_LOOP = _get("DMA_LOOP")
DMA_BATCH_NO_HINT = _get("DMA_BATCH_NO_HINT")
PACK_DIRECT = _get("PACK_DIRECT")
PACK_AUTO = _get("PACK_AUTO")
PACK_STAGED = _get("PACK_STAGED")
PACK_NOT_ID_ARRAYS = _get("PACK_NOT_ID_ARRAYS")
TRY_OTHER_METHOD = 6  # kvo::kTryOtherMethod (kernels/csrc/host_plan.h)

__all__ = ["AVAILABLE", "REASON", "require", "check_pair", "job_begin", "event_record", "DmaSubmitter",
           "submit_native", "pack_submit_native", "pack_native", "pack_layers", "dma_fragments",
           "host_register", "host_unregister", "prefault", "inject_fault", "clear_faults",
           "fault_counts", "FAULT_SITES", "host_threads", "time_cuda_host_alloc", "int64_pair",
           "check_ids", "copy_blocks", "dma_blocks", "DMA_BATCH", "DMA_LOOP", "DMA_BATCH_NO_HINT",
           "PACK_DIRECT", "PACK_AUTO", "PACK_STAGED", "PACK_NOT_ID_ARRAYS", "TRY_OTHER_METHOD"]
