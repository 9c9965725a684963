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

S (stress, bounded, bytes checked; the GPU command of docs/design/staged-h2d-fault.md):
staged H2D of the three host orders behind 600 ms sleeps, on the legacy default stream and on
a created stream, with the default copier and one asking for calls of 8192 descriptors (the
batcher caps calls at 2048 now), a dma call after each round; before each call the GPU side is
poisoned, after it the copied blocks must equal the host's random non-zero bytes and every
other GPU block must still hold the poison. Prints "S: N calls, M bad" and exits 1 on a bad
call. `S --small` (16384 blocks, 50 ms sleeps) is sized for compute-sanitizer memcheck.

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
small = "--small" in sys.argv[2:]
bb = 4 * KiB; nbuf = (2 * GiB if not small else 128 << 20) // bb; n = nbuf // 2
g = torch.empty(nbuf * bb, dtype=torch.uint8, device="cuda"); h = torch.empty(nbuf * bb, dtype=torch.uint8, pin_memory=True)
gv, hv = g.view(nbuf, bb), h.view(nbuf, bb)
cp = BlockCopier("cuda")
if os.environ.get("KVO_REPRO_DMA") == "loop":
    from kernels import native
    cp.dma_mode = native.DMA_LOOP
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
    from kernels import native
    variant = phase[1:]
    if variant == "1lane":
        cp = BlockCopier("cuda", dma_lanes=1)
    if variant == "loop":
        cp.dma_mode = native.DMA_LOOP
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
elif phase == "S":
    ms = 50 if small else 600
    ref = torch.randint(1, 256, (nbuf * bb,), dtype=torch.uint8, device="cuda")
    h.copy_(ref)  # the host blocks: random non-zero bytes; `ref` is their copy for the check
    refv = ref.view(nbuf, bb)
    gi_t = torch.from_numpy(gi).cuda()
    outside = torch.ones(nbuf, dtype=torch.bool, device="cuda")
    outside[gi_t] = False
    cp8k = BlockCopier("cuda", max_descriptors_per_call=8192)
    side = torch.cuda.Stream()
    calls = bad = 0

    def checked(tag, copier, o, m, stream):
        global calls, bad
        g.fill_(0xA5)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(ms * 1.98e6))
            print(f"{tag} h2d {o} {m} ...", end="", flush=True)
            copier.copy(hv, gv, his[o], gi, method=m)
        torch.cuda.synchronize()
        ok = torch.equal(gv[gi_t], refv[torch.from_numpy(his[o]).cuda()])
        untouched = bool((gv[outside] == 0xA5).all())
        calls += 1
        bad += not (ok and untouched)
        print(" ok" if ok and untouched else f" BAD (copied blocks exact: {ok}, others untouched: {untouched})",
              flush=True)

    for sname, stream in (("legacy", torch.cuda.default_stream()), ("side", side)):
        for r, (cname, copier) in enumerate((("512", cp), ("8192->2048", cp8k))):
            for o in his:
                checked(f"S {sname} calls<={cname} r{r}", copier, o, "staged", stream)
            checked(f"S {sname} calls<={cname} r{r}", copier, "ran", "dma", stream)
    print(f"S: {calls} calls, {bad} bad", flush=True)
    sys.exit(1 if bad else 0)
