"""Calibration of the cost model: `python -m kernels calibrate` (needs a CUDA GPU and kernels._C).

Kept apart from kernels.cost_model so that the model (pure Python, no torch) does not import
the copier that it serves: copy -> cost_model, calibration -> copy + cost_model.
"""
from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Callable, Iterable, Optional

if TYPE_CHECKING:
    import torch

from .cost_model import DEFAULT_TABLE, CostModel, calib_path

CURVES = ("gbps", "gbps_small", "gbps_hostseq")


def calibrate(device: "torch.device | str | int | None" = None, sizes: Optional[list[int]] = None,
              budget_bytes: int = 1 << 30, reps: int = 5, save: bool = True, log: Callable[[str], object] = print,
              small_count: int = 1000, host_bytes: int = 2 << 30, curves: Iterable[str] = CURVES,
              base: Optional[dict] = None) -> CostModel:
    """Measures GB/s per (direction, method, block size, block count) and fixed latency on `device`.

    Two job sizes per point: `budget_bytes` worth of blocks (table "gbps") and `small_count`
    blocks ("gbps_small"); `auto` interpolates between them in log2(count). Ids are random and
    non-contiguous on both sides (no coalescing), spread over `host_bytes` of pinned memory and
    as much GPU memory: random DMA runs slower over a larger host region, and real CPU pools
    are larger still. "gbps_hostseq" is DMA alone on `budget_bytes` jobs whose host ids are
    sequential (GPU ids still random), as a block pool hands out a request's blocks, which DMA
    moves faster than random ones (figures for both: docs/design/cost-model-rules.md,
    docs/design/host-order.md). Per point, the
    methods take turns (kernels._timing.cuda_ms_round_robin, the benchmarks' timer): the
    larger of the medians of `reps` device times (CUDA events, each call queued behind a spin
    kernel) and host submit times, after warm-up.

    `curves` picks what to measure; with `base` (a table), the others are kept from it, e.g.
    `calibrate(curves=["gbps_hostseq"], base=load_cost_model(dev).table)` adds the host-order
    curve to an older calibration (`python -m kernels calibrate --curves gbps_hostseq`).
    """
    import torch

    from ._timing import TIMING, cuda_ms, cuda_ms_round_robin
    from .copy import BlockCopier
    from .plan import KVOffloadError

    if not torch.cuda.is_available():
        raise KVOffloadError("calibration measures copies on a CUDA GPU, and this process sees none "
                             "(torch.cuda.is_available() is False); without one, `auto` uses the "
                             "shipped table (kernels/default_calibration.json)")
    t_start = time.perf_counter()
    dev = torch.device(device or "cuda")
    sizes = sizes or [1 << k for k in range(12, 25)]
    cm = CostModel()
    copier = BlockCopier(dev, cost_model=cm)
    methods = [m for m in ("dma", "cuda", "triton", "staged") if m in copier.available_methods()]
    host_bytes = max(host_bytes, 2 * budget_bytes)
    curves = [c for c in CURVES if c in set(curves)]
    if base is not None:
        table = json.loads(json.dumps(base))
        sizes, budget_bytes = table["sizes"], table.get("budget_bytes", budget_bytes)
        small_count, host_bytes = table.get("small_count", small_count), table.get("host_bytes", host_bytes)
    else:
        table = {"sizes": sizes, "fixed_us": dict(DEFAULT_TABLE["fixed_us"]),
                 "budget_bytes": budget_bytes, "small_count": small_count, "host_bytes": host_bytes}
        curves = list(dict.fromkeys(["gbps", *curves]))  # a new table needs its main curve
    for c in curves:
        table[c] = {}
    gen = torch.Generator().manual_seed(0)

    def timed(fn, r):  # the fixed latency: microseconds per call, max(device, host)
        return cuda_ms(fn, r, warmup=1) * 1e3

    gpu = torch.empty(host_bytes, dtype=torch.uint8, device=dev)
    host = torch.empty(host_bytes, dtype=torch.uint8, pin_memory=True)
    for d in ("d2h", "h2d", "d2d"):
        for curve in curves:
            if curve == "gbps_hostseq":
                if d != "d2d" and "dma" in methods:
                    table[curve][d] = {"dma": []}
            else:
                table[curve][d] = {m: [] for m in methods if not (m == "staged" and d == "d2d")}
        for bb in sizes:
            nbuf = host_bytes // bb
            n_big = max(16, min(budget_bytes // bb, nbuf // 2))
            g = gpu[: nbuf * bb].view(nbuf, bb)
            h = host[: nbuf * bb].view(nbuf, bb)
            src, dst = {"d2h": (g, h), "h2d": (h, g), "d2d": (g[: nbuf // 2], g[nbuf // 2:])}[d]
            for curve in curves:
                if d not in table[curve]:
                    continue
                n = n_big if curve != "gbps_small" else min(small_count, n_big)
                src_ids = torch.randperm(src.shape[0], generator=gen)[:n].numpy()
                dst_ids = torch.randperm(dst.shape[0], generator=gen)[:n].numpy()
                if curve == "gbps_hostseq":  # host ids in order, from an odd offset; GPU ids random
                    seq = torch.arange(3, n + 3).numpy()
                    src_ids, dst_ids = (src_ids, seq) if d == "d2h" else (seq, dst_ids)
                # the methods take turns, as in the benchmark: a DMA job's host submit is slower
                # after other work than run back to back with itself (cache state;
                # docs/design/bench-timing.md)
                fns = {m: (lambda m=m: copier.copy(src, dst, src_ids, dst_ids, method=m)) for m in table[curve][d]}
                submit_ms: dict = {}
                dev_ms = cuda_ms_round_robin(fns, reps, warmup=1, host_ms=submit_ms)
                for m in fns:
                    table[curve][d][m].append(round(n * bb / (max(dev_ms[m], submit_ms[m]) * 1e6), 2))
                log(f"calib {curve:>12} {d} {bb:>9} B x {n:>6}: " +
                    "  ".join(f"{m}={v[-1]:7.1f}" for m, v in table[curve][d].items()))
    one = gpu[:4096].view(1, 4096)
    oneh = host[:4096].view(1, 4096)
    if "gbps" in curves:
        for m in methods:
            table["fixed_us"][m] = round(timed(lambda: copier.copy(one, oneh, [0], [0], method=m), 20), 2)
        table["source"] = f"calibrated on {torch.cuda.get_device_name(dev)}"
    else:
        table["source"] = (f"{table.get('source', '?')}; {', '.join(curves)} calibrated on "
                           f"{torch.cuda.get_device_name(dev)} {time.strftime('%Y-%m-%d')}")
    table["timing"] = TIMING  # older tables (no "timing" key) timed each call from an idle stream
    table["seconds"] = round(time.perf_counter() - t_start, 1)
    cm = CostModel(table)
    if save:
        p = calib_path(torch.cuda.get_device_name(dev))
        cm.save(p)
        log(f"saved {p} (calibration took {table['seconds']} s)")
    return cm
