"""Shared helpers for the benchmarks: timing, metadata, result files, plots."""
from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable

import numpy as np
import torch

from kernels.tracing import nvtx_range  # noqa: F401  (re-exported for benchmarks)
from kernels.timing import TIMING, cuda_ms, cuda_ms_round_robin  # noqa: F401  (one timer for benches and calibrate)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_smoke_dir: str | None = None


def results_dir(out: str | None = None, smoke: bool | None = None) -> str:
    """Where a run writes its rows and plots: `out` (a script's --out) if given, else
    $KVO_RESULTS, else profiling/results/ for a real run, else one temporary folder per process
    for a smoke run (`smoke`: --tiny, --quick, --device cpu; None: no CUDA device), so a smoke
    run never overwrites the committed results."""
    global _smoke_dir
    if out:
        return out
    if os.environ.get("KVO_RESULTS"):
        return os.environ["KVO_RESULTS"]
    if smoke is None:
        smoke = not torch.cuda.is_available()
    if not smoke:
        return RESULTS
    if _smoke_dir is None:
        _smoke_dir = tempfile.mkdtemp(prefix="kvo-smoke-")
        print(f"smoke run: results go to {_smoke_dir} (not profiling/results; --out DIR to choose)",
              file=sys.stderr)
    return _smoke_dir


def git_sha() -> str:
    if os.environ.get("KVO_GIT_SHA"):
        return os.environ["KVO_GIT_SHA"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def meta() -> dict:
    m = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
         "git_sha": git_sha(), "torch": torch.__version__}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        m.update(gpu=p.name, sms=p.multi_processor_count, cuda=torch.version.cuda)
    m["host_cpus"] = os.cpu_count()
    try:
        from kernels import native
        if native.host_threads is not None:
            helpers, on, spin, _ = native.host_threads()
            # the thread pool of the host id pass (kernels/csrc/work_pool.h)
            m["host_id_pass"] = {"helpers": helpers, "enabled": on, "spin_us": spin}
    except ImportError:
        pass
    return m


def on_streams(fns, streams=None):
    """A function that queues each fns[i](s_i) at once on its own stream, after everything
    already on the current stream and before anything queued on it later."""
    ss = streams or [torch.cuda.Stream() for _ in fns]

    def run():
        cur = torch.cuda.current_stream()
        ev = torch.cuda.Event()
        ev.record(cur)
        for s, f in zip(ss, fns):
            s.wait_event(ev)
            with torch.cuda.stream(s):
                f(s)
        for s in ss:
            e = torch.cuda.Event()
            e.record(s)
            cur.wait_event(e)

    return run


def on_two_streams(a, b, streams=None):
    """on_streams([a, b]): a(s1) and b(s2) at once on two streams."""
    return on_streams([a, b], streams)


def big_copy_refs(g: torch.Tensor, h: torch.Tensor, reps: int = 5, detail: dict | None = None) -> dict:
    """Same-run physical references in GB/s, each direction and both at once: the better of
    one pinned cudaMemcpyAsync of all of g<->h, and the same bytes as two halves on two
    streams (two copy engines). Why both: on some H200 hosts one 2 GiB H2D copy ran at 53
    GB/s and one each way at once at 82, while two engines (and our multi-lane DMA) reached
    55.3 and 99; a reference under what the link carries would flatter every ratio.
    h must be one cudaHostAlloc buffer. `detail`, if given, receives every measurement."""
    n = g.numel()

    def piece(i, k, d2h):  # the i-th of k equal pieces, one direction
        a, b = i * (n // k), (i + 1) * (n // k)
        return lambda s=None: h[a:b].copy_(g[a:b], non_blocking=True) if d2h else g[a:b].copy_(h[a:b], non_blocking=True)

    def rate(fns, k):
        return (n // k) * k / cuda_ms(fns[0] if len(fns) == 1 else on_streams(fns), reps) / 1e6

    one = {d: rate([piece(0, 1, d == "d2h")], 1) for d in ("d2h", "h2d")}
    two = {d: rate([piece(0, 2, d == "d2h"), piece(1, 2, d == "d2h")], 2) for d in ("d2h", "h2d")}
    one["bidir"] = rate([piece(0, 2, True), piece(1, 2, False)], 2)
    two["bidir"] = rate([piece(0, 4, True), piece(1, 4, True), piece(2, 4, False), piece(3, 4, False)], 4)
    if detail is not None:
        detail.update({f"{k}_one_copy": round(v, 2) for k, v in one.items()})
        detail.update({f"{k}_two_streams": round(v, 2) for k, v in two.items()})
    return {k: max(one[k], two[k]) for k in one}


def probe_setup(nbytes: int = 2 << 30):
    """A probe's buffers and same-run references: (g, h, ref, rows) with g random non-zero
    bytes on the GPU, h one pinned host buffer of the same size, ref = big_copy_refs(g, h)
    (printed), rows its "reference" rows for write_rows."""
    g = torch.randint(1, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    ref = big_copy_refs(g, h)
    print(f"reference: D2H {ref['d2h']:.1f} H2D {ref['h2d']:.1f} both {ref['bidir']:.1f} GB/s", flush=True)
    return g, h, ref, [{"section": "reference", "dir": d, "gbps": round(v, 2)} for d, v in ref.items()]


def host_us(fn: Callable[[], object], reps: int = 20) -> float:
    """Median host microseconds of one fn() call, synchronising between calls (not inside)."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return float(np.median(ts))


def host_us_busy(fn: Callable[[int], object], reps: int = 24, burst: int = 8, sleep_ms: float = 30.0,
                 between: Callable[[], object] | None = None) -> float:
    """Median host microseconds of one fn(i) call issued the way an engine issues it: the
    GPU is busy (a sleep kernel on the current stream, which the copies queue behind) and
    the calling thread never blocks between timed calls. Bursts of `burst` calls (fewer
    than the index ring's slots, so no call waits for a slot) follow each sleep; the GPU is
    drained between bursts, untimed, and `between()` runs then. `fn` gets a call counter
    (e.g. for distinct job ids; -1 for the untimed warm-up call)."""
    cycles = int(sleep_ms * 2e6)  # ~2 GHz SM clock; the exact length does not matter
    fn(-1)
    torch.cuda.synchronize()
    if between is not None:
        between()
    ts, i = [], 0
    while len(ts) < reps:
        torch.cuda._sleep(cycles)
        for _ in range(min(burst, reps - len(ts))):
            t0 = time.perf_counter()
            fn(i)
            ts.append((time.perf_counter() - t0) * 1e6)
            i += 1
        torch.cuda.synchronize()
        if between is not None:
            between()
    return float(np.median(ts))


def write_rows(name: str, rows: list[dict], extra: dict | None = None, out_dir: str | None = None,
               timing: str | None = None) -> str:
    """Writes name.json ({meta, **extra, rows}) and name.csv; `timing`, if given, is recorded
    in meta (how the rates were timed, e.g. TIMING). Without `out_dir`: `results_dir()`."""
    out_dir = results_dir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    doc = {"meta": {**meta(), **({"timing": timing} if timing else {})}, **(extra or {}), "rows": rows}
    p = os.path.join(out_dir, f"{name}.json")
    with open(p, "w") as f:
        json.dump(doc, f, indent=1)
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(os.path.join(out_dir, f"{name}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return p


class ComputeLoad:
    """A long compute window (bf16 8192^3 GEMMs or an HBM-bound copy) on a high-priority stream.

    `measure(submit_copy)` runs the window once alone and once beside copies
    that `submit_copy(stream)` queues, and returns (slowdown, copy_ms, covered):
    slowdown of the compute per iteration against the paired alone window,
    the span of the copies, and whether the copies covered the whole window.
    """

    def __init__(self, kind: str = "gemm", iters: int | None = None):
        self.kind = kind
        if kind == "gemm":
            a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            c = torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16)
            self.work = lambda: torch.matmul(a, b, out=c)
            self.iters = iters or 100
        else:
            x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
            y = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
            self.work = lambda: y.copy_(x)
            self.iters = iters or 200
        # default priority, as an engine's compute stream has
        self.comp = torch.cuda.Stream()
        self.xfer = torch.cuda.Stream()
        self.window()  # warm-up: library handles, heuristics, clocks

    def window(self) -> float:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(self.comp):
            e0.record(self.comp)
            for _ in range(self.iters):
                self.work()
            e1.record(self.comp)
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / self.iters

    def measure(self, submit_copy, n_copies: int, pairs: int = 3):
        """Median over `pairs` of (window beside copies) / (mean of the alone windows around it)."""
        res = []
        alone = [self.window()]
        for _ in range(pairs):
            r = self._measure_once(submit_copy, n_copies)
            alone.append(self.window())
            res.append((r[0] / ((alone[-2] + alone[-1]) / 2) - 1, r[1], r[2], (alone[-2] + alone[-1]) / 2))
        res.sort(key=lambda x: x[0])
        return res[len(res) // 2]  # the median pair

    def _measure_once(self, submit_copy, n_copies: int):
        torch.cuda.synchronize()
        ce0, ce1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        xe0, xe1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        xe0.record(self.xfer)
        for _ in range(min(n_copies, 2)):
            submit_copy(self.xfer)
        with torch.cuda.stream(self.comp):
            ce0.record(self.comp)
            for _ in range(self.iters):
                self.work()
            ce1.record(self.comp)
        for _ in range(max(0, n_copies - 2)):
            submit_copy(self.xfer)
        xe1.record(self.xfer)
        torch.cuda.synchronize()
        t_comp = ce0.elapsed_time(ce1) / self.iters
        t_x = xe0.elapsed_time(xe1)
        return t_comp, t_x, t_x >= ce0.elapsed_time(ce1)


class StackSampler:
    """A poor man's sampling profiler for the calling thread: a side thread reads that
    thread's innermost frames every `interval_s` and counts them, so a run's host time can
    be placed without a profiler's per-call overhead (cProfile doubled the engine's host
    time). Counts are by innermost frame ("file:function") and by the innermost frame inside
    this repository (where the engine's own code waits). Also keeps the longest gaps between
    samples (a sampler starved of the GIL, or the process descheduled).

        with StackSampler() as s: run()
        s.top(10)  # [(frame, samples), ...]
    """

    def __init__(self, interval_s: float = 0.002):
        import threading

        self.interval = interval_s
        self.target = threading.get_ident()
        self.leaf: dict = {}
        self.ours: dict = {}
        self.n = 0
        self.gaps: list = []
        self.after_gaps: list = []  # (gap ms, innermost frame, innermost repo frame) for gaps > 20 ms
        self.gc_ms: list = []  # (generation, ms) of every collection in the window
        self._gc_t0 = None
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def _loop(self):
        import sys

        last = time.perf_counter()
        while not self._stop.wait(self.interval):
            now = time.perf_counter()
            self.gaps.append(now - last)
            last = now
            f = sys._current_frames().get(self.target)
            if f is None:
                continue
            self.n += 1
            c = f.f_code
            k = f"{os.path.basename(c.co_filename)}:{c.co_name}:{f.f_lineno}"
            self.leaf[k] = self.leaf.get(k, 0) + 1
            while f is not None and not f.f_code.co_filename.startswith(self._repo):
                f = f.f_back
            ko = None
            if f is not None:
                ko = f"{os.path.relpath(f.f_code.co_filename, self._repo)}:{f.f_code.co_name}:{f.f_lineno}"
                self.ours[ko] = self.ours.get(ko, 0) + 1
            if self.gaps[-1] > 0.02:
                # the sampler could not run: the thread held the GIL (a long C call) or the
                # process stood still; where the thread is right after says which call it was
                self.after_gaps.append((round(self.gaps[-1] * 1e3, 1), k, ko))

    def _gc(self, phase, info):
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            self.gc_ms.append((info.get("generation"), round((time.perf_counter() - self._gc_t0) * 1e3, 2)))
            self._gc_t0 = None

    def __enter__(self):
        import gc

        gc.callbacks.append(self._gc)
        self._t.start()
        return self

    def __exit__(self, *exc):
        import gc

        self._stop.set()
        self._t.join()
        gc.callbacks.remove(self._gc)

    def top(self, k: int = 8, ours: bool = False) -> list:
        d = self.ours if ours else self.leaf
        return sorted(d.items(), key=lambda kv: -kv[1])[:k]

    def summary(self, k: int = 8) -> dict:
        """Shares of samples (0..1) of the top frames, and the longest sampling gaps (ms)."""
        n = max(self.n, 1)
        return {"samples": self.n, "interval_ms": self.interval * 1e3,
                "leaf": {f: round(c / n, 3) for f, c in self.top(k)},
                "ours": {f: round(c / n, 3) for f, c in self.top(k, ours=True)},
                "longest_gaps_ms": [round(g * 1e3, 1) for g in sorted(self.gaps)[-5:]],
                "after_gaps": sorted(self.after_gaps, reverse=True)[:5],
                "gc": {"collections": len(self.gc_ms), "ms": round(sum(t for _, t in self.gc_ms), 1),
                       "longest": sorted(self.gc_ms, key=lambda x: -x[1])[:3]}}
