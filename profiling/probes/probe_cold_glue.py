"""The Python glue of the worker's native fast path, timed cold and warm on any machine (no
GPU): a TransferWorker over CPU tensors whose DmaSubmitter is a stand-in that only counts, so
what is timed is `submit_store`'s own Python and its `_C.check_pair` call, right after a
40 ms sleep (the state where a submit runs cold) and back to back (warm). Compare commits on
one machine; the figures are this machine's, not the H200 host's.

    python -m profiling.probes.probe_cold_glue [--lines]   # --lines: per statement of _submit_fast too
    python -m profiling.probes.probe_cold_glue --calls     # single calls: Python, pybind11, raw C, f-string, NVTX
"""
import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

from connector.worker import TransferWorker
from layout import KVBlockMover, KVLayout, KVSpec, UnifiedKVCache


class _CountingSubmitter:
    """Takes the real calls' positional arguments (record_and_submit: 18; submit_native: 7) and
    returns a ticket."""

    def __init__(self):
        self.n = 0

    def record_and_submit(self, *args):
        self.n += 1
        return self.n

    def submit_native(self, *args):  # _C.submit_native's place (the address is unused here)
        self.n += 1
        return self.n


def worker(method: str) -> TransferWorker:
    spec = KVSpec(4, 2, 16, 4, dtype=torch.float16)
    nb, ns = 4096, 8192
    cache = UnifiedKVCache(spec, nb, device="cpu")
    mover = KVBlockMover(spec, KVLayout.NB_NL_TWO_BS_NH_HS, cache.unified())
    host = torch.zeros(ns, spec.unified_block_bytes, dtype=torch.uint8)
    torch.Tensor.is_pinned = lambda self: True  # CPU stands in for pinned host memory
    w = TransferWorker.__new__(TransferWorker)  # the fields the fast path reads; no CUDA streams
    w.mover, w.host, w.method, w.ub, w.jobs, w.methods, w._closed = mover, host, method, spec.unified_block_bytes, \
        {}, {}, False
    w.compute_stream = SimpleNamespace(cuda_stream=1)
    w._sh = {"store": 2, "load": 3}
    w._free_events = {False: [SimpleNamespace(cuda_event=10 + i) for i in range(100_000)], True: []}
    w._native = _CountingSubmitter()
    from connector.worker import _NativeDma

    st = _NativeDma.__new__(_NativeDma)  # the unified-block strategy, its fields as its __init__ sets them
    st.w, st.sub, st.kv_blocks = w, w._native, mover.as_blocks()
    st.avail, st.fixed, st.call = mover.copier.available_methods(), {}, (w._native.submit_native, 0)
    st.args = st.fast_args()
    st.fast, st.submit = st.submit_fast, st.submit_held
    w._bind(st)
    # the cost model's answer on a CPU copier is "torch": stand in one that picks DMA, as the
    # H200 calibration does for these jobs
    cp = mover.copier
    cp.cost_model = SimpleNamespace(choose=lambda *a, **k: "dma", dma_both={}, dma_either_way=lambda *a, **k: True)
    return w


def main() -> None:
    rng = np.random.default_rng(0)
    jobs = [(rng.permutation(4096)[:1000], np.sort(rng.permutation(8192)[:1000])) for _ in range(20)]
    sha = os.environ.get("KVO_GIT_SHA", "unknown")
    print(f"# {os.uname().nodename}, {time.strftime('%FT%TZ', time.gmtime())}, sha {sha}")
    for method in ("dma", "auto"):
        w = worker(method)
        jid = 0
        for state in ("warm", "after 40 ms sleep"):
            ts = []
            for rep in range(3):
                for i, (b, s) in enumerate(jobs):
                    if state != "warm":
                        time.sleep(0.04)
                    jid += 1
                    t0 = time.perf_counter()
                    ok = w.submit_store(jid, b, s)
                    ts.append((time.perf_counter() - t0) * 1e6)
                    assert ok is True, ok
                    w.jobs.clear()
            print(f"method {method:<5} {state:<18} submit_store median {np.median(ts):6.1f} us  "
                  f"p10 {np.percentile(ts, 10):6.1f}  p90 {np.percentile(ts, 90):6.1f}", flush=True)
        if "--lines" in sys.argv:
            from profiling.probes.host_overhead import line_stopwatch

            marks: list = []
            src = line_stopwatch(w._strategy, "submit_fast", marks)
            w._fast_fn = w._strategy.submit_fast  # submit_store calls the fast path bound on the worker
            per: dict = {}
            for i, (b, s) in enumerate(jobs * 2):
                time.sleep(0.04)
                marks.clear()
                jid += 1
                w.submit_store(jid, b, s)
                w.jobs.clear()
                prev = None
                for ln, t in marks:
                    if prev is not None:
                        per.setdefault(ln, []).append((t - prev) / 1e3)
                    prev = t
            for ln in sorted(per):
                print(f"    {np.median(per[ln]):7.1f} us  line {ln:4d}: {src[ln - 1].strip()[:90]}")


def calls() -> None:
    """The cost of one call of each kind, cold (after a 40 ms sleep) and warm: what the fast
    paths' design counts (median of 41)."""
    from kernels import native, tracing as nv

    a = np.arange(4, dtype=np.int64)
    pa = a.ctypes.data
    kind, n = "store", 1000

    def noop():
        return None

    def with_range():  # an nvtx_range as pushed when a tool listens
        with nv.Range(f"kvo.{kind}.submit native n={n}"):
            pass

    pieces = {"Python no-op call": noop,
              "pybind11: _C.check_ids, n=0 (5 ints)": lambda: native.check_ids(pa, pa, 0, 4, 4),
              "pybind11: _C.int64_pair (2 arrays)": lambda: native.int64_pair(a, a),
              "raw METH_FASTCALL: _C.check_pair (2 arrays)": lambda: native.check_pair(a, a, 4, 4, False),
              "f-string of a range name": lambda: f"kvo.{kind}.submit native n={n}",
              f"with nvtx range (backend {nv.BACKEND}, pushed)": with_range}
    saved = nv.TOOL
    nv.TOOL = nv.BACKEND != "none"
    try:
        for name, fn in pieces.items():
            cold, warm = [], []
            for _ in range(41):
                time.sleep(0.04)
                t0 = time.perf_counter()
                fn()
                cold.append((time.perf_counter() - t0) * 1e6)
            for _ in range(41):
                t0 = time.perf_counter()
                fn()
                warm.append((time.perf_counter() - t0) * 1e6)
            print(f"{name:<48} after 40 ms sleep {np.median(cold):6.1f} us   warm {np.median(warm):5.2f} us",
                  flush=True)
    finally:
        nv.TOOL = saved


if __name__ == "__main__":
    calls() if "--calls" in sys.argv else main()
