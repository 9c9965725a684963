"""Reproducer of an open defect: a GPU fault or a host segfault around the staged H2D path.

    python -m profiling.probes.repro_staged_fault A|B|C|D|F|E<lanes|1lane|loop>

2 GiB of device memory and 2 GiB of pinned host memory as 4 KiB blocks; jobs of 262144
blocks (1 GiB) with three host-id orders (random, sequential, sorted); each call is
synchronised and prints "ok". What was seen on the H200 (sha edcbe8b, 2026-11-30):
- probe_host_order.py with all three orders in one process: a segmentation fault in
  _C.dma_blocks called from the staged H2D pipeline, twice in two runs, also with
  KVO_HOST_THREADS=0; one order per process: no fault.
- D (dma and staged H2D, each behind a 600 ms sleep kernel on the legacy default stream):
  "unspecified launch failure" once (at the dma call after the staged calls of round 0),
  no fault in a second run.
- F (staged H2D behind 600 ms sleeps, then dma): the process died at the 5th staged call;
  the kernel log showed Xid 32 (invalid or corrupted push buffer stream), with Xid 13/69
  from an earlier process.
- A, B, C (no sleep ahead, a sync after each call) and E* (dma alone behind sleeps, with
  lanes, one lane, or the cudaMemcpyAsync loop): no fault.
Not yet found: whether the cause is in kvoffload's host code or in the driver's handling
of batched copies queued deep behind a long kernel.

Variants (environment): KVO_REPRO_STREAM=side runs every call and sleep on a created stream
instead of the legacy default one (whose batch copies go to the per-thread stream);
KVO_REPRO_DMA=loop issues the DMA steps with the cudaMemcpyAsync loop instead of
cudaMemcpyBatchAsync.
"""
import faulthandler
import os
import sys

import numpy as np
import torch

faulthandler.enable()
from kernels import BlockCopier
KiB, GiB = 1024, 1 << 30
bb = 4 * KiB; nbuf = 2 * GiB // bb; n = GiB // bb
g = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda"); h = torch.empty(2 * GiB, dtype=torch.uint8, pin_memory=True)
gv, hv = g.view(nbuf, bb), h.view(nbuf, bb)
cp = BlockCopier("cuda")
if os.environ.get("KVO_REPRO_DMA") == "loop":
    from kernels._ext import _C
    cp.dma_mode = _C.DMA_LOOP
if os.environ.get("KVO_REPRO_STREAM") == "side":
    torch.cuda.set_stream(torch.cuda.Stream())
print(f"stream {torch.cuda.current_stream().cuda_stream:#x}, dma_mode {cp.dma_mode}", flush=True)
rng = np.random.default_rng(1)
gi = rng.permutation(nbuf)[:n]
his = {"ran": rng.permutation(nbuf)[:n], "seq": np.arange(n, dtype=np.int64) + 3, "sor": np.sort(rng.permutation(nbuf)[:n])}
def call(tag, d, o, m):
    print(f"{tag} {d} {o} {m} ...", end="", flush=True)
    s, t, si, di = (gv, hv, gi, his[o]) if d == "d2h" else (hv, gv, his[o], gi)
    cp.copy(s, t, si, di, method=m); torch.cuda.synchronize(); print(" ok", flush=True)
phase = sys.argv[1]
if phase == "A":
    for r in range(3):
        for o in his: call(f"A{r}", "h2d", o, "staged")
elif phase == "B":
    for o in his: call("B", "d2h", o, "staged")
    for r in range(2):
        for o in his: call(f"B{r}", "h2d", o, "staged")
elif phase == "C":
    for d in ("d2h", "h2d"):
        for r in range(2):
            for o in his:
                for m in ("dma", "cuda", "triton", "staged"): call(f"C{r}", d, o, m)
elif phase == "D":
    def spin_call(tag, d, o, m, ms):
        torch.cuda._sleep(int(ms * 1.98e6))
        call(tag, d, o, m)
    for r in range(3):
        for o in his:
            for m in ("dma", "staged"):
                spin_call(f"D{r}", "h2d", o, m, 600)
elif phase.startswith("E"):
    from kernels._ext import _C
    variant = phase[1:]
    if variant == "1lane":
        cp = BlockCopier("cuda", dma_lanes=1)
    if variant == "loop":
        cp.dma_mode = _C.DMA_LOOP
    for r in range(4):
        torch.cuda._sleep(int(600 * 1.98e6))
        call(f"E{variant}{r}", "h2d", "ran", "dma")
    for r in range(2):
        torch.cuda._sleep(int(600 * 1.98e6))
        call(f"E{variant}{r}", "h2d", "ran", "cuda")
elif phase == "F":
    for r in range(3):
        for o in his:
            torch.cuda._sleep(int(600 * 1.98e6))
            call(f"F{r}", "h2d", o, "staged")
    for r in range(3):
        torch.cuda._sleep(int(600 * 1.98e6))
        call(f"F{r}", "h2d", "ran", "dma")
