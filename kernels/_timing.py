"""CUDA-event timing shared by the benchmarks and `python -m kernels calibrate`, so the cost
model is calibrated on the same quantity the benchmarks judge it by."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

# A spin kernel queued before the start event holds the stream while the host submits the
# timed call, so the events time the device work alone: from an idle stream, a 1 GiB DMA job
# of 512 descriptors also counted its 0.5-0.9 ms of host submit on one H200 host and far less
# on another, which moved its GB/s by 3% between hosts. The host time is measured too, and
# rates use max(device, host): the rate of back-to-back calls, where whichever is slower
# bounds it (1 GiB of 16 KiB blocks is 65536 DMA descriptors: host-bound at ~1 us each).
TIMING = ("per call: device time by CUDA events (the call queued behind a spin kernel) and host "
          "submit time; GB/s = bytes / max(medians of the two), the rate of back-to-back calls")
_SPIN_CYCLES_PER_US = 2000  # >= the SM clock (H200: 1.98 GHz), so the spin never runs short


def _queue_ahead(host_us: float) -> None:
    # a spin that runs short only lets some host time into the device time (a lower rate)
    torch.cuda._sleep(int((1.5 * min(host_us, 100e3) + 50.0) * _SPIN_CYCLES_PER_US))


def cuda_ms(fn: Callable[[], object], reps: int = 10, warmup: int = 2, stream=None,
            queue_ahead: bool = True) -> float:
    """Median milliseconds per call of fn() in steady state: max(device time by CUDA events,
    host submit time), each median over `reps` calls after warm-up (see cuda_ms_round_robin)."""
    host = {}
    dev = cuda_ms_round_robin({0: fn}, reps, warmup, stream=stream, queue_ahead=queue_ahead, host_ms=host)[0]
    return max(dev, host[0]) if queue_ahead else dev


def cuda_ms_round_robin(fns: dict, reps: int = 10, warmup: int = 1, after: Callable[[str], object] = None,
                        stream=None, queue_ahead: bool = True, host_ms: dict = None) -> dict:
    """Median device milliseconds of each fns[k]() by CUDA events, the calls taken in turns
    (k1, k2, ..., k1, k2, ...) so every entry sees the same clock and host drift: methods
    timed one block after another differed by 5-10% on identical work (an H200 sweep: auto
    issuing DMA at 47.9 GB/s, the dma row just before it at 51.5). `after(k)` runs
    untimed after each call of k (e.g. to read which method it used). With queue_ahead,
    each timed call is submitted behind a spin kernel sized from that entry's previous
    host time (warm-up takes at least two rounds, so a first call's compile is not it), so the events bracket GPU work only; without it they also
    hold the host submit. `host_ms`, if given, receives each entry's median host time of
    the timed calls (wall clock around the call, GPU not waited for)."""
    s = stream or torch.cuda.current_stream()
    host = {k: 0.0 for k in fns}  # each entry's latest host time: its first call may compile
    for _ in range(max(warmup, 2)):
        for k, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            host[k] = (time.perf_counter() - t0) * 1e6
            if after is not None:
                after(k)
    torch.cuda.synchronize()
    ts = {k: [] for k in fns}
    hs = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if queue_ahead:
                with torch.cuda.stream(s):
                    _queue_ahead(host[k])
            a.record(s)
            t0 = time.perf_counter()
            fn()
            host[k] = (time.perf_counter() - t0) * 1e6
            hs[k].append(host[k] / 1e3)
            b.record(s)
            b.synchronize()
            ts[k].append(a.elapsed_time(b))
            if after is not None:
                after(k)
    if host_ms is not None:
        host_ms.update({k: float(np.median(v)) for k, v in hs.items()})
    return {k: float(np.median(v)) for k, v in ts.items()}
