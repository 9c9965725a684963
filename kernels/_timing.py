"""CUDA-event timing shared by the benchmarks and `python -m kernels calibrate`, so the cost
model is calibrated on the same quantity the benchmarks judge it by."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

# Device time: a spin kernel queued before the start event holds the stream while the host
# submits the timed call, so the events bracket device work alone (from an idle stream a big
# DMA job's events would also count its host submit, which differs between hosts). Host time:
# the wall clock around calls issued to an idle stream. Not around the spin-held calls: a job
# of thousands of DMA descriptors fills the driver's queue behind the spin and the host then
# waits for the spin. Rates use max(device, host), the rate of back-to-back calls: whichever is
# slower bounds it (DMA of small blocks is host-bound). Figures: docs/design/bench-timing.md.
TIMING = ("per call: device time by CUDA events (the call queued behind a spin kernel) and host "
          "submit time (calls to an idle stream); GB/s = bytes / max(medians of the two), the "
          "rate of back-to-back calls")
_SPIN_CYCLES_PER_US = 2000  # >= the SM clock (H200: 1.98 GHz), so the spin never runs short


def _queue_ahead(host_us: float) -> None:
    # a spin that runs short only lets some host time into the device time (a lower rate)
    torch.cuda._sleep(int((1.5 * min(host_us, 100e3) + 50.0) * _SPIN_CYCLES_PER_US))


def cuda_ms(fn: Callable[[], object], reps: int = 10, warmup: int = 2, stream=None,
            queue_ahead: bool = True) -> float:
    """Median milliseconds per call of fn() in steady state: max(device time by CUDA events,
    host submit time), each a median after warm-up (see cuda_ms_round_robin)."""
    host = {}
    dev = cuda_ms_round_robin({0: fn}, reps, warmup, stream=stream, queue_ahead=queue_ahead, host_ms=host)[0]
    return max(dev, host[0]) if queue_ahead else dev


def turn_orders(keys: list, rounds: int, seed: int = 0) -> list:
    """The order of each timed round of cuda_ms_round_robin: a fresh permutation per round
    (seeded, so a rerun takes the same turns), so no entry always follows the same one."""
    rng = np.random.default_rng(seed)
    return [[keys[i] for i in rng.permutation(len(keys))] for _ in range(rounds)]


def cuda_ms_round_robin(fns: dict, reps: int = 10, warmup: int = 1, after: Callable[[str], object] = None,
                        stream=None, queue_ahead: bool = True, host_ms: dict = None,
                        idle_ms: dict = None, idle_every: int = 2, shuffle: bool = True) -> dict:
    """Median device milliseconds of each fns[k]() by CUDA events, the calls taken in turns
    (k1, k2, ..., k1, k2, ...) so every entry sees the same clock and host drift: methods
    timed one block after another differed by more than the targets allow on identical work.
    With shuffle, each timed round takes its turns in a new order (turn_orders): in a fixed
    order the entry right after "dma" ran measurably slower on identical work (the figures:
    docs/design/bench-timing.md). `after(k)` runs untimed after each call of k (e.g. to read
    which method it used).

    After `warmup` untimed rounds (a first call may compile), one call of each entry goes
    to an idle stream and is timed on the host and by events; with queue_ahead, so is one
    more after every `idle_every`-th timed round (1: after every round, for jobs whose host
    time, that of many DMA descriptors, varies most). Each timed call is queued behind a spin kernel
    sized from the median host time of that entry's idle-stream calls, so its events bracket
    device work only; without queue_ahead it is timed from an idle stream. `host_ms`, if
    given, receives each entry's median host time (idle-stream calls), `idle_ms` the median
    event time of those calls (host submit and copy from an idle stream: the older timing)."""
    s = stream or torch.cuda.current_stream()
    hs = {k: [] for k in fns}
    es = {k: [] for k in fns}

    def idle_call(k, fn):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(s)
        t0 = time.perf_counter()
        fn()
        hs[k].append((time.perf_counter() - t0) * 1e3)
        b.record(s)
        b.synchronize()
        es[k].append(a.elapsed_time(b))
        if after is not None:
            after(k)

    for _ in range(max(warmup, 1)):
        for k, fn in fns.items():
            torch.cuda.synchronize()
            fn()
            if after is not None:
                after(k)
    for k, fn in fns.items():
        idle_call(k, fn)
    ts = {k: [] for k in fns}
    keys = list(fns)
    orders = turn_orders(keys, reps) if shuffle else [keys] * reps
    for r in range(reps):
        for k in orders[r]:
            fn = fns[k]
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if queue_ahead:
                with torch.cuda.stream(s):
                    _queue_ahead(float(np.median(hs[k])) * 1e3)
            a.record(s)
            fn()
            b.record(s)
            b.synchronize()
            ts[k].append(a.elapsed_time(b))
            if after is not None:
                after(k)
            if queue_ahead and r % idle_every == idle_every - 1:
                idle_call(k, fn)
    if host_ms is not None:
        host_ms.update({k: float(np.median(v)) for k, v in hs.items()})
    if idle_ms is not None:
        idle_ms.update({k: float(np.median(v)) for k, v in es.items()})
    return {k: float(np.median(v)) for k, v in ts.items()}
