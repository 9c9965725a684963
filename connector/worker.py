"""Worker-side asynchronous transfer engine: stores and loads on their own streams.

    w = TransferWorker(mover, pool.tensor)        # mover: layout.KVBlockMover
    w.submit_store(job_id, gpu_block_ids, host_slots)   # waits for compute first
    w.submit_load(job_id, host_slots, gpu_block_ids)
    w.fence(job_id)           # compute stream waits on the job (no host sync)
    for r in w.get_finished(): ...   # JobResult(job_id, kind, ok, nbytes, ms, error)

A job moves whole blocks: block_ids (GPU blocks of the engine's KV cache) and slot_ids (rows of
the host tensor, [num_slots, unified_block_bytes] pinned bytes), 1-D int64 ids of one length.

Ordering (vLLM's): a store waits on an event recorded on the compute stream at submit, so it
never reads KV that compute still writes; a load waits on it too (its GPU blocks may just have
been freed by running compute), and `fence` makes a stream wait on the load before anything
reads its blocks. Stores and loads use separate streams, so both PCIe directions run at once.
Completion is polled with event queries; only `wait()` and `shutdown(drain=True)` block the host.

How jobs are issued is one strategy, chosen once at construction (a `_Strategy` below); every
submit goes through the same door (submit_store / submit_load -> the strategy's fast path, if
it has one and takes the job, else the general path `_submit_held`: `prepare` checks the ids and
resolves `method`, then the strategy issues the prepared job):

  _NativeDma   (default; the KV cache is whole unified blocks, so a job is DMA of contiguous
               blocks) the job is planned on the caller's thread in C++ and issued by a C++ thread
               (kernels.native.DmaSubmitter) that never takes the GIL. Fast path: one C++ call
               checks the ids, records the compute event and queues the job. Why a thread: one
               batch call of a thousand descriptors holds the driver's lock about a millisecond;
               the thread issues it in slices of NATIVE_SLICE descriptors and the caller holds
               the submitter's gate while it makes its own driver calls.
  _NativePack  (default; per-layer layouts, where a block is many fragments gathered by the
               pack kernel) the same thread uploads the ids and launches the pack kernel, or,
               for `staged` (and `auto` while compute runs) runs its staged pipeline: pack into
               one of two GPU staging halves, DMA that half while the other fills.
  _Inline      (native_submit=False) the caller's thread issues every job; per-layer jobs take
               one C++ call (pack_native: ids staged in the copier's ring, events, launch).
  _Async       (async_submit=True) ids checked on the caller's thread (bad input still returns
               False at once), copies issued by one Python thread (which needs the GIL, so an
               engine loop polling for completion slows it).

A fast path answers True (queued), False (a failed job, reported by get_finished) or None (not
its kind of job; nothing done, the general path takes it and reports bad input). The fast paths
run right after host waits of tens of milliseconds, when every Python step runs cold, so they
are few steps: entry points bound at construction, arguments fixed per direction kept as
tuples, NVTX names built only when a tool listens (kernels.tracing). Any failure (bad ids, a
failed record or launch, a stopped submitter) is a failed job, never an exception out of
submit, get_finished, wait or shutdown. Caller time per job in each strategy and GPU state:
profiling/bench/bench_connector.py.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional, Union

import numpy as np
import torch

from kernels import current_stream_handle as _current_stream_handle
from kernels import native
from kernels import tracing as _nv
from kernels.copy import STAGED_PACK_CTAS
from kernels.cost_model import STEPS
from kernels.tracing import nvtx_range

if TYPE_CHECKING:
    from kernels import Ids
    from layout.pack import KVBlockMover

_C = native if native.AVAILABLE else None  # the extension's entry points this worker binds (kernels.native)
_NATIVE_KEYS = {"store": "store:dma-native", "load": "load:dma-native"}
_NSTEPS = len(STEPS)  # run counts below this are stepped by indexing STEPS (CostModel.dma_both's key)
_PACK_KEYS = {"store": "store:cuda", "load": "load:cuda"}
_PACK_NATIVE_KEYS = {(k, st): f"{k}:{'staged' if st else 'cuda'}-native" for k in ("store", "load") for st in (0, 1)}
_TRY_OTHER = native.TRY_OTHER_METHOD  # a fast path's "valid ids, another path takes the job"
from kernels.plan import SEGMENTS_VERSION, as_host_ids, segments_for, vec_width

_ND, _I64 = np.ndarray, np.dtype(np.int64)


def _fast_ids(ids, name: str):
    """ids as the fast paths read them (a 1-D C-contiguous int64 numpy array: lists, CPU
    tensors and other integer arrays are converted; a list costs far more than an array), or ids themselves
    when they cannot be, for the general path to report."""
    try:
        return as_host_ids(ids, name)
    except (TypeError, ValueError, OverflowError):  # KVOffloadError is a ValueError
        return ids


@dataclass
class JobResult:
    job_id: int
    kind: str            # "store" or "load"
    ok: bool
    nbytes: int
    ms: Optional[float]  # GPU time from the job's start to end event
    error: Optional[str] = None


# Descriptors per driver call on the native submit thread. The thread lets a caller's own
# driver calls in between calls (DmaSubmitter.hold), so a caller waits at most about one
# slice instead of a whole 1000-descriptor batch (docs/design/native-submit.md).
NATIVE_SLICE = 64
# Jobs in flight before a submit creates a CUDA event; also the pool's size at rest: events made
# for a burst beyond it are destroyed when their job is reported (cudaEventDestroy does not
# wait), so a long-running engine holds a constant number of events (issue 37's soak). 128
# covers the jobs a vLLM step keeps in flight (tens; profiling/results/vllm.json "inflight").
EVENTS_PREMADE = 128

# Jobs issued on the caller's thread are issued before anyone can see them: they share one
# event that is already set instead of building a threading.Event (a Condition) per job.
_ISSUED = threading.Event()
_ISSUED.set()


@dataclass(slots=True)
class _Job:
    kind: str
    nbytes: int
    start: Optional[torch.cuda.Event]
    end: Optional[torch.cuda.Event]
    error: Optional[str] = None
    issued: threading.Event = field(default_factory=threading.Event)
    ticket: Optional[int] = None                 # native submit: the DmaSubmitter ticket
    after: Optional[torch.cuda.Event] = None     # kept alive until the native thread waited on it
    own_after: bool = False                      # `after` came from the worker's event pool


class TransferWorker:
    """Runs store (GPU -> host) and load (host -> GPU) jobs through a KVBlockMover.

    Args:
      mover: a layout.KVBlockMover registered on the engine's KV tensors.
      host: [num_slots, unified_block_bytes] host tensor (e.g. HostPool.tensor).
      method: pack/unpack method, "auto" by default.
      compute_stream: the stream whose work stores must wait for (default:
        the current stream at each submit).
      async_submit: queue the copies from a Python submit thread (see the module doc).
      native_submit: issue DMA jobs of whole unified blocks, and per-layer pack jobs of the
        fast path, from a C++ thread (the default; module doc). False: the caller's thread
        issues every job (inline).
    """

    def __init__(self, mover: KVBlockMover, host: torch.Tensor, method: str = "auto",
                 compute_stream: Optional[torch.cuda.Stream] = None, async_submit: bool = False,
                 native_submit: bool = True) -> None:
        self.mover = mover
        self.host = host
        self.method = method
        self.device = mover.device
        self.compute_stream = compute_stream
        self.store_stream = torch.cuda.Stream(self.device)
        self.load_stream = torch.cuda.Stream(self.device)
        self.jobs: dict[int, _Job] = {}
        self.done: list[JobResult] = []
        self.ub = mover.unified_block_bytes
        self.stats = {"store_bytes": 0, "load_bytes": 0, "store_ms": 0.0, "load_ms": 0.0,
                      "failed_jobs": 0}
        self.methods: dict = {}  # "store:dma" -> jobs issued that way (what `auto` resolved to)
        self.last_method: Optional[str] = None  # how the last fast-path job was issued ("dma", "cuda", "staged")
        self._closed = False
        self.async_submit = async_submit
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        # CUDA events are reused, not created per job: a job takes them at submit and gives
        # them back when it is reported finished (nothing waits on them after that)
        self._free_events: dict = {True: [], False: []}  # enable_timing -> idle events
        # and some are made now: creating one (torch Event + its first record) cost the caller
        # tens of microseconds per job when jobs were submitted faster than they finished
        for timing, count in ((False, EVENTS_PREMADE), (True, 2 * EVENTS_PREMADE)):
            self._free_events[timing] = [self._event(timing) for _ in range(count)]
        # raw handles: one C++ call records and waits (native.job_begin) instead of torch's wrappers
        self._raw = _C is not None
        self._dev_index = self.device.index
        self._sh = {"store": self.store_stream.cuda_stream, "load": self.load_stream.cuda_stream}
        self._native = None  # the DmaSubmitter of the native strategies (also read by the completion path)
        blocks = bool(getattr(mover, "contiguous_blocks", False))  # unified blocks: DMA; else per-layer pack
        # the one decision: which strategy issues this worker's jobs
        if async_submit:
            strategy: _Strategy = _Async(self)
        elif native_submit and _C is not None:
            # its own lanes (their mutex is held while the thread issues) and short slices,
            # between which the thread yields to the caller's driver calls (see _Native.submit_held)
            self._native = mover.copier.make_submitter(NATIVE_SLICE, lanes=blocks)
            strategy = _NativeDma(self) if blocks else _NativePack(self)
        else:
            strategy = _Inline(self)
        self._bind(strategy)

    def _bind(self, strategy: "_Strategy") -> None:
        """Makes `strategy` this worker's: its fast path and general submit bound as attributes,
        so submit_store/submit_load call them without a further frame."""
        self._strategy = strategy
        self._fast_fn = strategy.fast          # None: every job takes the general path
        self._submit = strategy.submit         # the general path (holds the submitter's gate if any)

    # ------------------------------------------------------------------
    def submit_store(self, job_id: int, block_ids: Ids, slot_ids: Ids, *, after: Optional[torch.cuda.Event] = None) -> bool:
        """Queues GPU blocks -> host slots. Returns False (and reports a failed
        job) if the job could not be queued; the blocks must then not be served.

        block_ids, slot_ids: 1-D integer ids on the host (numpy arrays, lists or CPU tensors;
        int64 numpy arrays are used as they are, others converted to them first)."""
        fast = self._fast_fn  # called from here, not from _submit: every call frame counts when cold
        if fast is not None and after is None:
            # the fast paths take int64 numpy ids: other ids are converted first (once taking the
            # general path instead cost several times the converted job; profiling/results/connector.json)
            if type(block_ids) is not _ND or type(slot_ids) is not _ND or block_ids.dtype is not _I64 \
                    or slot_ids.dtype is not _I64:
                block_ids, slot_ids = _fast_ids(block_ids, "block_ids"), _fast_ids(slot_ids, "slot_ids")
            r = fast(job_id, "store", block_ids, slot_ids)
            if r.__class__ is bool:
                return r
            # None, or the runs of ids the fast path checked before handing the job back
            return self._submit(job_id, "store", block_ids, slot_ids, after, r)
        return self._submit(job_id, "store", block_ids, slot_ids, after)

    def submit_load(self, job_id: int, slot_ids: Ids, block_ids: Ids, *, after: Optional[torch.cuda.Event] = None) -> bool:
        """Queues host slots -> GPU blocks."""
        fast = self._fast_fn
        if fast is not None and after is None:
            if type(block_ids) is not _ND or type(slot_ids) is not _ND or block_ids.dtype is not _I64 \
                    or slot_ids.dtype is not _I64:  # as in submit_store
                block_ids, slot_ids = _fast_ids(block_ids, "block_ids"), _fast_ids(slot_ids, "slot_ids")
            r = fast(job_id, "load", block_ids, slot_ids)
            if r.__class__ is bool:
                return r
            # None, or the runs of ids the fast path checked before handing the job back
            return self._submit(job_id, "load", block_ids, slot_ids, after, r)
        return self._submit(job_id, "load", block_ids, slot_ids, after)

    def fence(self, job_id: int, stream: Optional[torch.cuda.Stream] = None) -> None:
        """Makes `stream` (default: current) wait for a job, without blocking the host:
        before compute reads blocks being loaded, or reuses blocks being stored."""
        j = self.jobs.get(job_id)
        if j is not None and j.ticket is not None:
            self._native.fence(ticket=j.ticket, stream=(stream or torch.cuda.current_stream(self.device)).cuda_stream)
        elif j is not None:
            j.issued.wait()
            if j.end is not None:
                (stream or torch.cuda.current_stream(self.device)).wait_event(j.end)

    def get_finished(self) -> list[JobResult]:
        """Jobs that completed since the last call (non-blocking event queries)."""
        if self._native is None:
            return self._get_finished()
        self._native.hold()
        try:
            return self._get_finished()
        finally:
            self._native.release_hold()

    def _get_finished(self) -> list[JobResult]:
        try:
            ready = [k for k, j in self.jobs.items()
                     if (self._native.query(ticket=j.ticket) != 0 if j.ticket is not None else
                         j.issued.is_set() and (j.end is None or j.end.query()))]
        except Exception:  # an event query failed: job by job, a job whose query fails is failed
            ready = [k for k, j in list(self.jobs.items()) if self._done_or_failed(j)]
        for jid in ready:
            self._finish(jid)
        out, self.done = self.done, []
        return out

    def _done_or_failed(self, j: _Job) -> bool:
        """Whether j is finished; a job whose completion query raised is finished, failed
        (never raised out of get_finished: the caller recomputes its blocks)."""
        try:
            if j.ticket is not None:
                return self._native.query(ticket=j.ticket) != 0
            return j.issued.is_set() and (j.end is None or j.end.query())
        except Exception as e:
            j.error = j.error or f"completion query failed: {type(e).__name__}: {e}"
            if j.ticket is not None:
                self._sync(j)  # its queued work, before its buffers are reused
            return True

    def flush(self) -> None:
        """Blocks the host until every submitted job has been issued to its stream
        (not until the GPU has run it): after this, a device synchronize covers them."""
        for j in list(self.jobs.values()):
            if j.ticket is not None:
                self._native.wait_issued(ticket=j.ticket)
            j.issued.wait()

    def wait(self, job_ids: Iterable[int]) -> None:
        """Blocks the host until the given jobs are done (for flushes on preemption)."""
        for jid in job_ids:
            j = self.jobs.get(jid)
            if j is not None:
                self._sync(j)

    def shutdown(self, drain: bool = True) -> list[JobResult]:
        """Drains (waits for) in-flight jobs, or cancels them: GPU work that is
        already queued cannot be recalled, so cancelled jobs are waited for and
        then reported as failed, which keeps half-written blocks from being served."""
        if self._thread is not None:
            self._q.put(None)
            self._thread.join()
            self._thread = None
        for jid, j in list(self.jobs.items()):
            self._sync(j)  # a failed job's error is kept on it and reported below
            if not drain:
                j.error = j.error or "cancelled at shutdown"
            self._finish(jid)
        self._closed = True
        if self._native is not None:
            self._native.stop()
        out, self.done = self.done, []
        return out

    def _sync(self, j: _Job) -> None:
        """Blocks until j's queued work ran. A failed job's error is kept on j (reported by
        get_finished / shutdown), never raised: its blocks are just not served."""
        try:
            if j.ticket is not None:
                self._native.synchronize(ticket=j.ticket)  # waits for what it queued even when it failed
                return
            j.issued.wait()
            if j.end is not None:
                j.end.synchronize()
        except RuntimeError as e:
            j.error = j.error or f"{type(e).__name__}: {e}"

    # ------------------------------------------------------------------
    def _event(self, timing: bool) -> torch.cuda.Event:
        free = self._free_events[timing]
        if free:
            return free.pop()
        e = torch.cuda.Event(enable_timing=timing)
        # torch creates the CUDA event at its first record: do that now, so that its handle
        # (`cuda_event`) is valid for the raw-handle calls and query()/elapsed_time() accept it
        e.record(self.store_stream)
        return e

    def _compute_handle(self) -> int:
        cs = self.compute_stream
        return cs.cuda_stream if cs is not None else _current_stream_handle(self.device)

    def _pinned_host_view(self):
        """The host tensor's BlockView if it is pinned host memory of the spec's block size
        (what the fast paths take as checked once), else None (`prepare` judges each job)."""
        if self.host.device.type != "cpu":
            return None
        try:
            uv = self.mover.unified_view(self.host)
        except Exception:  # prepare reports it, job by job
            return None
        return uv if self.host.is_pinned() else None
    def _submit_held(self, job_id, kind, block_ids, slot_ids, after, runs=None) -> bool:
        """The general path: `prepare` checks the ids and resolves the method on this thread,
        then the strategy issues the prepared job (inline, on its native thread, or queued).
        runs: check_id_pairs' result for these int64 ids, or () without runs, when a fast path
        checked them already and handed the job back (KVBlockMover.prepare's `runs`)."""
        if self._closed:
            raise RuntimeError("TransferWorker is shut down")
        if job_id in self.jobs:
            raise ValueError(f"job id {job_id} is already in flight")
        st = self._strategy
        stream = self.store_stream if kind == "store" else self.load_stream
        n = len(block_ids)
        with nvtx_range(f"kvo.{kind}.submit job={job_id} n={n}"):
            own = after is None
            try:
                if own:
                    after = self._event(False)
                    if not (st.inline and self._raw):  # else recorded by _issue's job_begin
                        if self._raw:
                            _C.event_record(after.cuda_event, self._compute_handle(), self._dev_index)
                        else:
                            after.record(self.compute_stream or torch.cuda.current_stream(self.device))
                # validation and the method choice happen here, on the caller's thread
                prep = self.mover.prepare(block_ids, self.host, slot_ids, kind == "store",
                                          method=self.method, stream=stream, runs=runs)
                ticket = st.ticket(prep, stream, after)
            except Exception as e:  # invalid input, or a failed event record or queueing: nothing is queued
                self.jobs[job_id] = _Job(kind, n * self.ub, None, None, error=f"{type(e).__name__}: {e}",
                                         issued=_ISSUED, after=after if own else None, own_after=own)
                return False
            if ticket is not None:
                # the C++ side tracks issue; see query/fence
                self.jobs[job_id] = _Job(kind, n * self.ub, None, None, issued=_ISSUED, ticket=ticket,
                                         after=after, own_after=own)
                self._count(kind, "dma-native")
                return True
            j = _Job(kind, n * self.ub, self._event(True), self._event(True),
                     issued=threading.Event() if st.queued else _ISSUED,
                     after=after if own else None, own_after=own)
            if not st.queued:
                self._issue(j, stream, after, prep, own and st.inline and self._raw, kind)  # issued before visible
                self.jobs[job_id] = j
                return j.error is None
            self.jobs[job_id] = j
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvo-submit", daemon=True)
                self._thread.start()
            self._q.put((j, stream, after, prep, False, kind))
        return True

    def _loop(self) -> None:
        torch.cuda.set_device(self.device)
        while True:
            item = self._q.get()
            if item is None:
                return
            self._issue(*item)

    def _issue(self, j: _Job, stream, after, prep, record_after: bool, kind: str) -> None:
        """Queues a prepared job on its stream behind `after`, between the job's timing events.
        record_after (raw handles, inline issue only): `after` is recorded on the compute stream
        here, on the caller's thread, in the same C++ call."""
        try:
            with nvtx_range(f"kvo.{j.kind}.issue n={prep.block_ids.shape[0]}"):
                if self._raw:
                    sh = self._sh[kind]
                    if record_after or after.cuda_event:
                        _C.job_begin(after.cuda_event, self._compute_handle() if record_after else 0, record_after,
                                     sh, j.start.cuda_event, self._dev_index)
                    else:  # a caller's event never recorded: nothing to wait for (as torch's wait_event)
                        _C.event_record(j.start.cuda_event, sh, self._dev_index)
                    used = self.mover.run(prep)
                    _C.event_record(j.end.cuda_event, sh, self._dev_index)
                else:  # no raw handles: `after` was recorded at submit
                    stream.wait_event(after)
                    j.start.record(stream)
                    used = self.mover.run(prep)
                    j.end.record(stream)
            # "block": whole unified blocks through the copier, whose `auto` resolved the method
            self._count(j.kind, f"block-{self.mover.copier.last_method}" if used == "block" else used)
        except Exception as e:  # launch failure: the job's blocks must not be served
            j.error = f"{type(e).__name__}: {e}"
            try:  # the end event covers what was queued before the failure: reported after it ran
                j.end.record(stream)
            except Exception:  # not even that: wait for the stream here, and report without an end
                try:
                    stream.synchronize()
                except Exception:  # a broken context: nothing more to wait for
                    pass
                j.end = None
        finally:
            j.issued.set()

    def _count(self, kind: str, method) -> None:
        k = f"{kind}:{method}"
        self.methods[k] = self.methods.get(k, 0) + 1

    def _finish(self, jid) -> None:
        j = self.jobs.pop(jid)
        if j.ticket is not None:
            if j.error is None and self._native.query(ticket=j.ticket) < 0:
                j.error = f"DMA job failed: {self._native.error(ticket=j.ticket)}"
            ms = self._native.elapsed_ms(ticket=j.ticket) if j.error is None else None
            self._native.release(ticket=j.ticket)
        ok = j.error is None
        if j.ticket is None:
            ms = j.start.elapsed_time(j.end) if (ok and j.start is not None) else None
        if j.start is not None:  # read; nothing waits on the job's events any more
            self._free_events[True].append(j.start)
            if j.end is not None:
                self._free_events[True].append(j.end)
        if j.own_after and j.after is not None:
            self._free_events[False].append(j.after)
        fe = self._free_events
        if len(fe[False]) > EVENTS_PREMADE or len(fe[True]) > 2 * EVENTS_PREMADE:  # after a burst
            del fe[False][EVENTS_PREMADE:], fe[True][2 * EVENTS_PREMADE:]
        if ok:
            self.stats[f"{j.kind}_bytes"] += j.nbytes
            self.stats[f"{j.kind}_ms"] += ms or 0.0
        else:
            self.stats["failed_jobs"] += 1
        self.done.append(JobResult(jid, j.kind, ok, j.nbytes if ok else 0, ms, j.error))


# ---------------------------------------------------------------------- strategies
class _Strategy:
    """How a worker issues its jobs (see the module doc). `fast`: the fast path, a bound method
    (job_id, kind, block_ids, slot_ids) -> True / False / None, or None; `submit`: the general
    path; `ticket(prep, stream, after)`: a native ticket for a prepared job, or None to issue it
    here; inline: the general path issues on the caller's thread, its own compute event then
    recorded by _issue's job_begin (with raw handles); queued: jobs go to the Python submit thread."""

    __slots__ = ("w", "fast", "submit", "__dict__")  # slots: the fast paths read fields without a dict
    inline = False
    queued = False

    def __init__(self, w: TransferWorker):
        self.w = w
        self.fast = None
        self.submit = w._submit_held

    def ticket(self, prep, stream, after) -> Optional[int]:
        return None


class _Native(_Strategy):
    """A strategy with a native submitter: the general path holds its gate, so our event record
    and stream query do not wait behind its batches."""

    __slots__ = ("sub",)

    def __init__(self, w: TransferWorker):
        super().__init__(w)
        self.sub = w._native
        self.submit = self.submit_held

    def submit_held(self, job_id, kind, block_ids, slot_ids, after, runs=None) -> bool:
        sub = self.sub
        sub.hold()
        try:
            return self.w._submit_held(job_id, kind, block_ids, slot_ids, after, runs)
        finally:
            sub.release_hold()


class _NativeDma(_Native):
    """Unified blocks: DMA jobs planned in C++ on the caller's thread and issued by the
    submitter's thread. Jobs whose method resolves to something else are issued inline."""

    __slots__ = ("kv_blocks", "avail", "fixed", "args", "call")

    def __init__(self, w: TransferWorker):
        super().__init__(w)
        self.kv_blocks = w.mover.as_blocks()  # the KV cache as [num_blocks, block bytes]
        cp = w.mover.copier
        self.avail = cp.available_methods()  # what `auto` may use here, part of the cost model's memo keys
        self.fixed: dict = {}  # kind -> (segments version, DMA mode, submit_native's fixed tuple)
        self.args = self.fast_args()
        # (the raw entry point, the submitter's address): one C++ call per fast-path job
        self.call = (_C.submit_native, self.sub.address) if self.args is not None else None
        self.fast = self.submit_fast if self.args is not None else None

    def fast_args(self) -> Optional[dict]:
        """What `prepare` would derive for every job and the fast path takes as fixed, per kind:
        id bounds, direction, stream, and the copy's geometry (both buffers' bases and strides,
        the block size, whether runs may coalesce); the registration segments are looked up
        when the per-direction argument tuple (`fixed`) is built. None when `prepare` must judge
        each job (a host tensor that is pageable or not the spec's block size). The method is
        read per job."""
        w = self.w
        uv = w._pinned_host_view()
        if uv is None:
            return None
        kvb = self.kv_blocks
        kv = (kvb.data_ptr(), kvb.stride(0) * kvb.element_size())
        hv = (uv.ptr, uv.stride)
        nb, ns = w.mover.table.num_blocks, uv.num_blocks
        out = {}
        for kind, (s, d) in (("store", (kv, hv)), ("load", (hv, kv))):
            out[kind] = (nb if kind == "store" else ns, ns if kind == "store" else nb,
                         "d2h" if kind == "store" else "h2d", w._sh[kind],
                         (s[0], d[0], s[1], d[1], uv.block_bytes, s[1] == uv.block_bytes and d[1] == uv.block_bytes),
                         (s[0], d[0]))
        return out

    def submit_fast(self, job_id, kind, block_ids, slot_ids) -> Union[bool, tuple, None]:
        """The common job in two raw C++ calls (check_pair: ids read and checked; submit_native:
        event record + plan + queue) instead of `prepare`'s dozen: int64 numpy ids, the worker's
        own compute event, and a cost model that picks DMA whether or not the GPU is busy.
        Returns True / False (queued / failed), None (the general path judges the job), or the
        ids' (runs_both, runs_src, runs_dst) when they passed check_pair but the job is not a
        DMA job (the general path takes them as checked)."""
        w = self.w
        if type(block_ids) is not np.ndarray or type(slot_ids) is not np.ndarray or w._closed \
                or job_id in w.jobs:
            return None
        n_src, n_dst, d, sh, geo, bases = self.args[kind]
        # 1-D contiguous int64 of one length, their addresses and the id check, in one C++ call
        r = _C.check_pair(block_ids, slot_ids, n_src, n_dst, kind == "load")
        if r is None or r[3]:
            return None
        n, bp, spp, _, _, _, rb, rs, rd = r
        sp, dp = (bp, spp) if kind == "store" else (spp, bp)
        cp = w.mover.copier
        method = w.method
        if method == "auto":
            ndh = rd if kind == "store" else rs
            # the cost model's remembered answer, read inline by its public key (CostModel.dma_both;
            # a call per job ran several us cold after an idle wait: docs/design/cold-host-path.md),
            # and asked for (CostModel.dma_either_way decides and remembers) when absent
            cm = cp.cost_model
            ok = cm.dma_both.get((d, geo[4], n, STEPS[rb], STEPS[ndh], self.avail)) \
                if rb < _NSTEPS and ndh < _NSTEPS else None
            if ok is None:
                ok = cm.dma_either_way(d, geo[4], n, self.avail, rb, ndh)
            if not ok:
                return (rb, rs, rd)  # the general path, with the ids checked here
        elif method != "dma":  # `method` may be changed after construction
            return (rb, rs, rd)
        free = w._free_events[False]
        after = free.pop() if free else w._event(False)
        # the arguments fixed per direction, as one tuple built again only when a pool registers
        # or drops segments or the DMA mode changes
        fx = self.fixed.get(kind)
        if fx is None or fx[0] != SEGMENTS_VERSION[0] or fx[1] != cp.dma_mode:
            fx = self.fixed[kind] = (SEGMENTS_VERSION[0], cp.dma_mode, (
                *geo, _C.DMA_BATCH if cp.dma_mode is None else cp.dma_mode, False, sh,
                *segments_for(bases[0]), *segments_for(bases[1])))
        cs = w.compute_stream
        rng = nvtx_range(f"kvo.{kind}.submit native n={n}") if _nv.TOOL or _nv.PROF._is_profiler_enabled else None
        if rng is not None:  # (no `with`, no name built, when nothing listens: see kernels/tracing.py)
            rng.__enter__()
        try:
            ticket = self.call[0](self.call[1], cs.cuda_stream if cs is not None else _current_stream_handle(w.device),
                                  sp, dp, n, after.cuda_event, fx[2])
        except Exception as e:  # a failed record: nothing queued; a failed job, as the pack paths report it
            w._free_events[False].append(after)
            w.jobs[job_id] = _Job(kind, n * w.ub, None, None, error=f"{type(e).__name__}: {e}", issued=_ISSUED)
            return False
        finally:
            if rng is not None:
                rng.__exit__(None, None, None)
        # positional: keyword matching ran several us cold (fields: kind, nbytes, start, end,
        # error, issued, ticket, after, own_after)
        w.jobs[job_id] = _Job(kind, n * w.ub, None, None, None, _ISSUED, ticket, after, True)
        w.last_method = "dma"
        k, m = _NATIVE_KEYS[kind], w.methods  # _count, inline
        m[k] = m.get(k, 0) + 1
        return True

    def ticket(self, prep, stream, after) -> Optional[int]:
        """Queues a prepared DMA job of whole unified blocks on the native thread; None if the
        job's method is not that (it is then issued inline)."""
        if prep.method != "block" or prep.unified.device.type != "cpu":
            return None
        if prep.block_method != "dma":  # prepare() resolved auto with the copier's cost model
            return None
        cp = self.w.mover.copier
        kvb = self.kv_blocks
        bi, si, uv = prep.block_ids, prep.slot_ids, prep.unified
        n = bi.shape[0]
        src_ids, dst_ids = (bi, si) if prep.to_unified else (si, bi)
        kv_ptr, kv_stride = kvb.data_ptr(), kvb.stride(0) * kvb.element_size()
        src, sst, dst, dstr = (kv_ptr, kv_stride, uv.ptr, uv.stride) if prep.to_unified else \
            (uv.ptr, uv.stride, kv_ptr, kv_stride)
        ssb, sss = segments_for(src)
        dsb, dss = segments_for(dst)
        ub = uv.block_bytes
        with nvtx_range(f"kvo.{'pack' if prep.to_unified else 'unpack'} dma native n={n} ub={ub}"):
            t = self.sub.submit_blocks(
                src_ids=src_ids.ctypes.data, dst_ids=dst_ids.ctypes.data, n=n, src_base=src, dst_base=dst,
                src_stride=sst, dst_stride=dstr, block_bytes=ub, coalesce=(sst == ub and dstr == ub),
                mode=_C.DMA_BATCH if cp.dma_mode is None else cp.dma_mode, src_any_order=False,
                stream=stream.cuda_stream, wait_event=after.cuda_event, src_seg_base=ssb, src_seg_bytes=sss,
                dst_seg_base=dsb, dst_seg_bytes=dss)
        self.w.last_method = "dma"
        return t


def _pack_args(w: TransferWorker) -> Optional[tuple]:
    """What `prepare` would derive for every per-layer job and the pack fast paths take as
    fixed: the fragment table, the host's base and stride, the id bounds, the vector width.
    None when `prepare` must judge each job (no device table, a host tensor that is not pinned
    host memory of the spec's block size). The method and CTA count are read per job."""
    mover = w.mover
    uv = w._pinned_host_view() if mover.table_dev is not None else None
    if uv is None:
        return None
    return (mover.table_dev.data_ptr(), mover.table.num_fragments, uv.ptr, uv.stride,
            mover.table.num_blocks, uv.num_blocks, mover.max_frag_bytes, vec_width(mover.vec, uv.ptr, uv.stride))


def _pack_fixed_args(w: TransferWorker, args: tuple) -> dict:
    """The pack calls' arguments fixed per direction (kind -> tuple), from _pack_args."""
    table, nf, hp, hs, nb, ns, mfb, vec = args
    return {k: (table, nf, hp, hs, nb, ns, mfb, vec, k == "store", w._sh[k], w._dev_index) for k in ("store", "load")}


class _NativePack(_Native):
    """Per-layer layouts through the submitter's thread: the pack kernel, or its staged pipeline
    (`staged`, and `auto` while compute runs)."""

    __slots__ = ("args", "pack_fixed", "modes", "call", "pipes", "staged_args")
    inline = True  # jobs the general path takes are issued on the caller's thread

    def __init__(self, w: TransferWorker):
        super().__init__(w)
        cp = w.mover.copier
        self.args = _pack_args(w)
        self.pack_fixed = _pack_fixed_args(w, self.args) if self.args is not None else None
        # the submitter's mode per method (PACK_DIRECT, PACK_STAGED); `auto`: the cost model's
        # (the submitter only observes whether compute runs)
        self.modes = {"cuda": 0, "staged": 2, "auto": cp.cost_model.pack_submit_mode(host=True)}
        self.call = (_C.pack_submit_native, self.sub.address) if self.args is not None else None
        # the staged pipelines, one per direction (GPU staging allocated by the thread at the first
        # staged job); their shape and DMA mode are the copier's now (later changes are not seen)
        self.pipes: Optional[dict] = None
        if self.args is not None:
            try:
                self.pipes = {k: self.sub.add_staged(
                    ub=w.ub, staging_bytes=cp.staging_bytes, chunk_bytes=cp.staged_chunk_bytes,
                    vec_bytes=vec_width(w.mover.vec, w.ub), min_ctas=STAGED_PACK_CTAS,
                    dma_mode=_C.DMA_BATCH if cp.dma_mode is None else cp.dma_mode) for k in ("store", "load")}
            except ValueError:  # a block over half the staging: staged jobs take the general path
                self.pipes = None
        self.staged_args: tuple = (-1, None)  # (segments version, kind -> (pipe, segment base, bytes))
        self.fast = self.submit_fast if self.args is not None else None

    def submit_fast(self, job_id, kind, block_ids, slot_ids) -> Union[bool, tuple, None]:
        """One raw C++ call (pack_submit_native) reads, checks and stages the ids in the job's
        own pinned buffer and records the compute event; the submitter's thread then makes the
        job's stream wait, uploads the ids and launches the pack kernel or runs the staged
        pipeline, between the job's timing events. The job is tracked by its ticket.
        Returns True / False (queued / failed), None (the general path judges the job), or ()
        when the ids passed the check but compute is running under auto with no pipe (the
        general path takes them as checked; a per-layer job needs no runs)."""
        w = self.w
        mode = self.modes.get(w.method)
        if mode is None or type(block_ids) is not np.ndarray or type(slot_ids) is not np.ndarray \
                or w._closed or job_id in w.jobs:
            return None
        staged = None
        if self.pipes is not None:
            sa = self.staged_args
            if sa[0] != SEGMENTS_VERSION[0]:  # a pool registered or dropped segments: look them up again
                seg = segments_for(self.args[2])
                sa = self.staged_args = (SEGMENTS_VERSION[0], {k: (p, *seg) for k, p in self.pipes.items()})
            staged = sa[1][kind]
        elif mode == 2:
            return None
        free = w._free_events[False]
        after = free.pop() if free else w._event(False)
        cs = w.compute_stream
        call = self.call
        rng = nvtx_range(f"kvo.{kind}.submit pack native n={len(block_ids)}") \
            if _nv.TOOL or _nv.PROF._is_profiler_enabled else None
        if rng is not None:  # as in _NativeDma.submit_fast
            rng.__enter__()
        try:
            code, _, _, n, ticket, st = call[0](
                call[1], block_ids, slot_ids, cs.cuda_stream if cs is not None else _current_stream_handle(w.device),
                mode, w.mover.copier.num_ctas, after.cuda_event, self.pack_fixed[kind], staged)
        except Exception as e:  # a failed record (nothing queued) or a stopped submitter
            code, n, err = -1, len(block_ids), f"{type(e).__name__}: {e}"
        finally:
            if rng is not None:
                rng.__exit__(None, None, None)
        if code:  # nothing queued: the event goes back
            free.append(after)
            if code == _TRY_OTHER:  # compute running under auto, no pipe: the ids passed the
                return ()           # check here, so the general path takes them as checked
            if code > 0:  # bad ids: the general path raises the error
                return None
            w.jobs[job_id] = _Job(kind, n * w.ub, None, None, error=err, issued=_ISSUED)
            return False
        # positional (see _NativeDma.submit_fast): kind, nbytes, start, end, error, issued, ticket, after, own_after
        w.jobs[job_id] = _Job(kind, n * w.ub, None, None, None, _ISSUED, ticket, after, True)
        w.last_method = "staged" if st else "cuda"
        k, m = _PACK_NATIVE_KEYS[kind, st], w.methods  # _count, inline
        m[k] = m.get(k, 0) + 1
        return True


class _Inline(_Strategy):
    """The caller's thread issues every job; per-layer jobs of method cuda (or auto with
    compute idle) take one C++ call."""

    __slots__ = ("args", "pack_fixed", "skip_busy", "ring", "call")
    inline = True

    def __init__(self, w: TransferWorker):
        super().__init__(w)
        per_layer = not getattr(w.mover, "contiguous_blocks", True)
        self.args = _pack_args(w) if (w._raw and per_layer) else None
        self.pack_fixed = _pack_fixed_args(w, self.args) if self.args is not None else None
        # auto packs straight to the host only while compute is idle (the cost model's PACK_AUTO)
        self.skip_busy = self.args is not None and w.mover.copier.cost_model.pack_submit_mode(host=True) == 1
        self.ring: tuple = (None, 0)  # (the copier's ring, its address), read at the first job
        self.call = _C.pack_native if _C is not None else None
        self.fast = self.submit_fast if self.args is not None else None

    def submit_fast(self, job_id, kind, block_ids, slot_ids) -> Optional[bool]:
        """One raw C++ call (pack_native) reads, checks and stages the ids, records the compute
        event, makes the job's stream wait on it and launches the pack kernel between the job's
        timing events, instead of `prepare` + `run`. For method cuda, or auto with compute idle
        (auto packs through GPU staging while compute runs: the general path)."""
        w = self.w
        method = w.method
        if (method != "cuda" and method != "auto") or type(block_ids) is not np.ndarray \
                or type(slot_ids) is not np.ndarray or w._closed or job_id in w.jobs:
            return None
        cp = w.mover.copier
        ra = self.ring
        if ra[0] is None:  # the copier's ring (made once, kept) and its address, read at the first job
            ring = cp.index_ring()
            ra = self.ring = (ring, ring.ring.address)
        fx = self.pack_fixed[kind]
        free, freet = w._free_events[False], w._free_events[True]  # _event, inline
        after = free.pop() if free else w._event(False)
        start = freet.pop() if freet else w._event(True)
        end = freet.pop() if freet else w._event(True)
        cs = w.compute_stream
        n = len(block_ids)
        rng = nvtx_range(f"kvo.{kind}.submit pack n={n}") if _nv.TOOL or _nv.PROF._is_profiler_enabled else None
        if rng is not None:  # as in _NativeDma.submit_fast
            rng.__enter__()
        try:
            with cp.lock:
                # reads the ids as check_pair does (PACK_NOT_ID_ARRAYS: not 1-D contiguous int64
                # of one length within the ring's capacity), checks, stages, records and launches
                code, _, _, n = self.call(
                    ra[1], block_ids, slot_ids,
                    cs.cuda_stream if cs is not None else _current_stream_handle(w.device),
                    method == "auto" and self.skip_busy, cp.num_ctas, after.cuda_event, start.cuda_event,
                    end.cuda_event, fx)
        except Exception as e:  # a failed record or launch: the job's blocks must not be served
            code, err = -1, f"{type(e).__name__}: {e}"
            # what was queued before the failure (a launched kernel whose end record failed) runs
            # out before the job is reported: a failed load's blocks are recomputed right after
            try:
                (w.store_stream if kind == "store" else w.load_stream).synchronize()
            except Exception:  # a broken context: nothing more to wait for
                pass
        finally:
            if rng is not None:
                rng.__exit__(None, None, None)
        if code:  # nothing (usable) queued: the events go back
            w._free_events[False].append(after)
            w._free_events[True] += (start, end)
            if code > 0:  # bad ids, or compute running under auto: the general path
                return None
            w.jobs[job_id] = _Job(kind, n * w.ub, None, None, error=err, issued=_ISSUED)
            return False
        w.jobs[job_id] = _Job(kind, n * w.ub, start, end, None, _ISSUED, None, after, True)  # positional
        w.last_method = "cuda"
        k, m = _PACK_KEYS[kind], w.methods  # _count, inline
        m[k] = m.get(k, 0) + 1
        return True


class _Async(_Strategy):
    """Ids checked on the caller's thread, copies issued by the Python submit thread (_loop)."""

    __slots__ = ()
    queued = True
