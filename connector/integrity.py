"""Integrity mode: per-block checksums taken on the GPU at store and checked at load.

    tw = CheckedTransferWorker(TransferWorker(mover, host), mover)   # same public API

A block that comes back from the host must be the block that went out. With this wrapper:

  * store (submit_store accepted): a checksum kernel (kernels.checksum) reads the job's source
    GPU blocks on the wrapper's own stream, behind the same point of compute the store waits
    for (`after`, or an event recorded on the compute stream at submit), and writes one 64-bit
    sum per block into `sums[slot]`, a GPU table indexed by host slot;
  * load (submit_load accepted): the wrapper's stream waits for the load job (the worker's
    public `fence`, no host sync), recomputes the sums of the loaded GPU blocks, compares them
    with `sums[slot]` on the GPU and counts mismatches into a per-job flag, copied to pinned
    host memory, and records an event;
  * get_finished: a job is reported once the worker reports it AND its check event has
    completed (an event query; a job whose check is still running is held for a later call).
    A load with a nonzero flag is reported ok=False (nbytes 0, error says why), so the engine
    treats it as a failed load and recomputes, and it is counted in `integrity`.

Host cost per job: an id upload from a pinned buffer, one kernel, one flag reset and one 4-byte
copy, two event records; no host sync is added (only event queries in get_finished). The
kernel reads the blocks once more from HBM, on its own stream, overlapping the next job's copy.

Limits (say so where it is enabled):
  * the sums live in this process: a rank that loads cells it did not store itself (replicated
    MLA KV, read by ranks > 0) cannot check them; enable it on writer ranks only
    (connector.tp.is_writer);
  * a consumer that reads loaded blocks through `fence` without waiting for get_finished (the
    engine's fast path) still reads them before the verdict; `fence` orders it after the
    check, and the verdict arrives with get_finished. vLLM waits for get_finished.

Works on CUDA tensors; on CPU (stand-in workers in tests, TRITON_INTERPRET=1) the checks run
synchronously at submit.
"""
from __future__ import annotations

from contextlib import nullcontext as _nullctx
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterable, Optional

import numpy as np
import torch

from kernels.checksum import BlockChecksum

if TYPE_CHECKING:
    from kernels import Ids
    from layout.pack import KVBlockMover

    from .worker import JobResult, TransferWorker

MAX_CHECKS = 1 << 16  # jobs checked at once (flag slots); a submit beyond it raises


@dataclass(slots=True)
class _Check:
    kind: str
    n: int
    flag: int                              # index into the flag arrays (loads), -1 for stores
    event: Optional[torch.cuda.Event]      # None on CPU (the check already ran)


class CheckedTransferWorker:
    """Wraps a TransferWorker (or anything with its public API) with block checksums.

    Args:
      tw: the worker (submit_store, submit_load, fence, get_finished, wait, flush, shutdown).
      mover: the layout.KVBlockMover the worker moves through (its FragmentTable says where each
        block's bytes are), or a kernels.checksum.BlockChecksum already bound to the KV cache.
      num_slots: host slots (default: rows of tw.host).
      compute_stream: what stores wait for when no `after` event is given (default: the worker's
        compute_stream, else the current stream at submit), as the worker does.
    Counters in `integrity`: stored_blocks, checked_blocks, failed_blocks, failed_jobs.
    Everything else (stats, methods, host, mover, ...) is the wrapped worker's.
    """

    def __init__(self, tw: TransferWorker, mover: KVBlockMover | BlockChecksum, num_slots: Optional[int] = None,
                 compute_stream: Optional[torch.cuda.Stream] = None) -> None:
        self.tw = tw
        self.checksum = mover if isinstance(mover, BlockChecksum) else BlockChecksum(mover.table)
        self.device = self.checksum.device
        if num_slots is None:
            num_slots = int(tw.host.shape[0])
        self.num_slots = num_slots
        self.cuda = self.device.type == "cuda"
        self.compute_stream = compute_stream if compute_stream is not None else getattr(tw, "compute_stream", None)
        # sums[slot] = the 2 x 32-bit checksum of the block last stored there
        self.sums = torch.zeros(num_slots, 2, dtype=torch.int32, device=self.device)
        self.flags = torch.zeros(MAX_CHECKS, dtype=torch.int32, device=self.device)
        self.flags_host = torch.zeros(MAX_CHECKS, dtype=torch.int32, pin_memory=self.cuda) if self.cuda \
            else self.flags
        self._free_flags = list(range(MAX_CHECKS - 1, -1, -1))
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._free_events: list = []
        self._checks: dict[int, _Check] = {}
        self._held: list = []   # results the worker reported whose check is still running
        self.integrity = {"stored_blocks": 0, "checked_blocks": 0, "failed_blocks": 0, "failed_jobs": 0}
        # compile both kernel variants now (a Triton compile takes long: docs/design/engine-host-path.md), not at the first job
        with torch.cuda.stream(self._stream) if self.cuda else _nullctx():
            one = torch.zeros(2, 1, dtype=torch.int64, device=self.device)
            scratch = torch.zeros(1, 2, dtype=torch.int32, device=self.device)
            self.checksum.record(one[0], one[1], scratch)
            self.checksum.verify(one[0], one[1], scratch, torch.zeros(1, dtype=torch.int32, device=self.device), 0)
        if self.cuda:
            self._stream.synchronize()

    def __getattr__(self, name):  # stats, methods, host, mover, jobs, ...: the worker's
        return getattr(self.__dict__["tw"], name)

    # ------------------------------------------------------------------ submit
    def submit_store(self, job_id: int, block_ids: Ids, slot_ids: Ids, *, after: Optional[torch.cuda.Event] = None) -> bool:
        """As TransferWorker.submit_store; also records the blocks' checksums for their slots."""
        own = None
        if self.cuda and after is None:  # the point of compute the store waits for, taken now
            own = self._event()
            own.record(self.compute_stream or torch.cuda.current_stream(self.device))
        ok = self.tw.submit_store(job_id, block_ids, slot_ids) if after is None \
            else self.tw.submit_store(job_id, block_ids, slot_ids, after=after)
        if not ok:
            if own is not None:
                self._free_events.append(own)
            return ok
        after = own if own is not None else after
        ids = self._ids(block_ids, slot_ids)
        if not self.cuda:
            self.checksum.record(ids[0], ids[1], self.sums)
            self._checks[job_id] = _Check("store", ids.shape[1], -1, None)
            return ok
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(after)
            self.checksum.record(ids[0], ids[1], self.sums)
            ev = self._event()
            ev.record(self._stream)
        if own is not None:
            self._free_events.append(own)  # its wait is enqueued; re-recording it later is safe
        self._checks[job_id] = _Check("store", ids.shape[1], -1, ev)
        return ok

    def submit_load(self, job_id: int, slot_ids: Ids, block_ids: Ids, *, after: Optional[torch.cuda.Event] = None) -> bool:
        """As TransferWorker.submit_load; the job is reported ok only if every loaded block's
        checksum matches the one recorded when its slot was stored."""
        ok = self.tw.submit_load(job_id, slot_ids, block_ids) if after is None \
            else self.tw.submit_load(job_id, slot_ids, block_ids, after=after)
        if not ok:
            return ok
        if not self._free_flags:
            raise RuntimeError(f"integrity: more than {MAX_CHECKS} loads in flight")
        k = self._free_flags.pop()
        ids = self._ids(block_ids, slot_ids)
        if not self.cuda:
            self.tw.wait([job_id])  # a stand-in worker: the copy must have landed
            self.flags[k] = 0
            self.checksum.verify(ids[0], ids[1], self.sums, self.flags, k)
            self._checks[job_id] = _Check("load", ids.shape[1], k, None)
            return ok
        with torch.cuda.stream(self._stream):
            self.tw.fence(job_id, self._stream)
            self.flags[k:k + 1].zero_()
            self.checksum.verify(ids[0], ids[1], self.sums, self.flags, k)
            self.flags_host[k:k + 1].copy_(self.flags[k:k + 1], non_blocking=True)
            ev = self._event()
            ev.record(self._stream)
        self._checks[job_id] = _Check("load", ids.shape[1], k, ev)
        return ok

    # ------------------------------------------------------------------ completion
    def get_finished(self) -> list[JobResult]:
        """The worker's finished jobs whose checks completed too (event queries only)."""
        out, held = [], []
        for r in self._held + self.tw.get_finished():
            c = self._checks.get(r.job_id)
            if c is not None and c.event is not None and not c.event.query():
                held.append(r)
            else:
                out.append(self._verdict(r))
        self._held = held
        return out

    def fence(self, job_id: int, stream: Optional[torch.cuda.Stream] = None) -> None:
        """The worker's fence, plus the job's check (it reads the same blocks)."""
        self.tw.fence(job_id, stream)
        c = self._checks.get(job_id)
        if c is not None and c.event is not None:
            (stream or torch.cuda.current_stream(self.device)).wait_event(c.event)

    def wait(self, job_ids: Iterable[int]) -> None:
        self.tw.wait(job_ids)
        for jid in job_ids:
            c = self._checks.get(jid)
            if c is not None and c.event is not None:
                c.event.synchronize()

    def flush(self) -> None:
        self.tw.flush()

    def shutdown(self, drain: bool = True) -> list[JobResult]:
        res = self._held + self.tw.shutdown(drain)
        self._held = []
        for r in res:
            c = self._checks.get(r.job_id)
            if c is not None and c.event is not None:
                c.event.synchronize()
        return [self._verdict(r) for r in res]

    # ------------------------------------------------------------------ internals
    def _verdict(self, r):
        c = self._checks.pop(r.job_id, None)
        if c is None:
            return r
        if c.event is not None:
            self._free_events.append(c.event)
        if c.kind == "store":
            if r.ok:
                self.integrity["stored_blocks"] += c.n
            return r
        bad = int(self.flags_host[c.flag])
        self._free_flags.append(c.flag)
        if not r.ok:
            return r
        self.integrity["checked_blocks"] += c.n
        if bad == 0:
            return r
        self.integrity["failed_blocks"] += bad
        self.integrity["failed_jobs"] += 1
        return replace(r, ok=False, nbytes=0, ms=None,
                       error=f"integrity: {bad} of {c.n} loaded blocks differ from the checksum taken at store")

    def _event(self) -> torch.cuda.Event:
        return self._free_events.pop() if self._free_events else torch.cuda.Event()

    def _ids(self, block_ids, slot_ids) -> torch.Tensor:
        """int64 [2, n] (block ids, slot ids) on the device; uploaded from a pinned buffer on
        the wrapper's stream (torch's caching host allocator keeps it until the copy ran)."""
        b = np.asarray(block_ids.cpu() if isinstance(block_ids, torch.Tensor) else block_ids, dtype=np.int64)
        s = np.asarray(slot_ids.cpu() if isinstance(slot_ids, torch.Tensor) else slot_ids, dtype=np.int64)
        if not self.cuda:
            return torch.from_numpy(np.stack([b, s]))
        h = torch.empty(2, b.shape[0], dtype=torch.int64, pin_memory=True)
        hn = h.numpy()
        hn[0], hn[1] = b, s
        with torch.cuda.stream(self._stream):
            return h.to(self.device, non_blocking=True)
