"""Does offloading slow an engine step? An engine loop with stores in flight, per submit mode.

    python -m profiling.probes.probe_step_overlap [--steps 8] [--blocks 756] [--jobs 28] [--out DIR]

Emulates what vLLM (async scheduling, eager) does each step: at the step's start it submits the
previous step's stores (--jobs jobs, --blocks 2 MiB blocks in all: ~1.5 GB, as vLLM stored per
step at 0% hits with 512-token prompts), each waiting on the compute stream, where the previous
forward is still running; then it launches this step's forward (many kernels, ~--fwd-ms of GPU
time), polls get_finished(), and waits for the previous forward (the sampled tokens). A step
whose host thread is held up inside the driver (a full stream queue behind compute it cannot
pass) shows as a longer step, a longer launch or a longer get_finished.

Modes, interleaved in rounds: none (no stores); inline (native_submit=False: the caller
issues); native with the submit thread's pacing (kernels/csrc/dma_submitter.h) off, host wait
only, window only, both. Reports medians per mode: step ms, submit / launch / get_finished ms
and the host thread's CPU ms per step; and checks the last step's stores bit-exact.
Writes step_overlap.json (profiling/results/ with --out unset on a GPU).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from connector import HostPool, TransferWorker
from layout import MODELS, KVBlockMover, KVLayout, UnifiedKVCache
from profiling.common import results_dir, write_rows

# (name, native_submit, pacing (host_wait, window) or None)
MODES = [("none", None, None), ("inline", False, None), ("native-nopace", True, (0, 0)),
         ("native-hostwait", True, (1, 0)), ("native-window", True, (0, 256)), ("native-both", True, (1, 256))]


def make_forward(fwd_ms: float):
    """A forward of many launches (matmuls and small element-wise kernels, as an eager model),
    sized to about fwd_ms of GPU time."""
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    y = torch.empty_like(x)

    def layer():
        torch.matmul(x, w, out=y)
        y.mul_(0.5)
        y.add_(x)
        y.tanh_()

    for _ in range(5):
        layer()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(50):
        layer()
    e.record()
    e.synchronize()
    per = s.elapsed_time(e) / 50
    n = max(1, int(fwd_ms / per))

    def forward():
        for _ in range(n):
            layer()
    return forward, n * 4, n * per


def run_mode(name, native, pacing, ctx, steps, rng):
    mover, pool, nb, ns, jobs, blocks, forward = ctx
    w = None
    if native is not None:
        w = TransferWorker(mover, pool.tensor, native_submit=native)
        if pacing is not None:
            sub = getattr(w, "_native", None)
            if sub is None or not hasattr(sub, "set_pacing"):
                return {"mode": name, "error": "no native submitter with set_pacing"}
            sub.set_pacing(host_wait=pacing[0], window=pacing[1])
    per_job = blocks // jobs
    jid = [0]
    last = []
    rows = []
    prev_end = None
    forward()  # a forward in flight before the first step, as in steady state
    prev_end = torch.cuda.Event()
    prev_end.record()
    for step in range(steps + 2):
        t0, c0 = time.perf_counter(), time.thread_time()
        last = []
        if w is not None:
            gb = rng.choice(nb, blocks, replace=False)
            base = (step * blocks) % (ns - blocks + 1)
            hs = np.arange(base, base + blocks, dtype=np.int64)
            rng.shuffle(hs)
            for j in range(jobs):
                jid[0] += 1
                g, h = gb[j * per_job:(j + 1) * per_job], hs[j * per_job:(j + 1) * per_job]
                w.submit_store(jid[0], g, h)
                last.append((g, h))
        t1 = time.perf_counter()
        forward()
        end = torch.cuda.Event()
        end.record()
        t2 = time.perf_counter()
        fin = w.get_finished() if w is not None else []
        t3 = time.perf_counter()
        prev_end.synchronize()  # the previous step's sampled tokens
        t4, c4 = time.perf_counter(), time.thread_time()
        prev_end = end
        bad = [r for r in fin if not r.ok]
        if step >= 2:  # warm-up steps skipped
            rows.append({"step_ms": (t4 - t0) * 1e3, "submit_ms": (t1 - t0) * 1e3, "launch_ms": (t2 - t1) * 1e3,
                         "get_finished_ms": (t3 - t2) * 1e3, "cpu_ms": (c4 - c0) * 1e3, "failed": len(bad)})
    torch.cuda.synchronize()
    ok = None
    if w is not None:
        w.wait(list(range(1, jid[0] + 1)))
        w.get_finished()
        ok = True
        host = pool.tensor
        kv = mover.as_blocks()
        for g, h in last[:4]:
            a = kv[torch.as_tensor(g, device="cuda")]
            b = host[torch.as_tensor(h)].to("cuda")
            ok = ok and bool(torch.equal(a, b))
        w.shutdown()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {"mode": name, **{k: round(v, 3) for k, v in med.items()}, "steps": len(rows), "stores_exact": ok}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=756, help="2 MiB blocks stored per step")
    ap.add_argument("--jobs", type=int, default=28, help="store jobs per step")
    ap.add_argument("--fwd-ms", type=float, default=300.0)
    ap.add_argument("--modes", default=",".join(m[0] for m in MODES))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    spec = MODELS["llama-3.1-8b"]
    ub = spec.unified_block_bytes
    nb = ns = max(2048, 2 * a.blocks)
    cache = UnifiedKVCache(spec, nb, device="cuda")
    cache.buffer.random_(1, 255)
    pool = HostPool(ns, ub)
    pool.wait_pinned()
    mover = KVBlockMover(spec, KVLayout.NB_NL_TWO_BS_NH_HS, cache.unified())
    forward, launches, fwd_ms = make_forward(a.fwd_ms)
    print(f"forward: {launches} launches, ~{fwd_ms:.0f} ms GPU; stores per step: {a.jobs} jobs, "
          f"{a.blocks} x {ub >> 20} MiB", flush=True)
    ctx = (mover, pool, nb, ns, a.jobs, a.blocks, forward)
    want = a.modes.split(",")
    rows = []
    rng = np.random.default_rng(0)
    for rnd in range(a.rounds):
        for name, native, pacing in MODES:
            if name not in want:
                continue
            r = run_mode(name, native, pacing, ctx, a.steps, rng)
            r["round"] = rnd
            rows.append(r)
            if "error" in r:
                print(f"{name:16s} {r['error']}", flush=True)
                continue
            print(f"{name:16s} round {rnd}  step {r['step_ms']:8.1f} ms  submit {r['submit_ms']:7.2f}  "
                  f"launch {r['launch_ms']:7.2f}  get_finished {r['get_finished_ms']:7.2f}  cpu {r['cpu_ms']:7.1f}  "
                  f"exact {r['stores_exact']}", flush=True)
    base = [r["step_ms"] for r in rows if r["mode"] == "none" and "step_ms" in r]
    ref = statistics.median(base) if base else None
    for r in rows:
        if ref and "step_ms" in r:
            r["step_vs_none"] = round(r["step_ms"] / ref, 4)
    out = results_dir(a.out)
    p = write_rows("step_overlap", rows, {"forward_launches": launches, "forward_ms": round(fwd_ms, 1),
                                          "blocks_per_step": a.blocks, "jobs_per_step": a.jobs,
                                          "block_bytes": ub}, out)
    print(f"wrote {p}")


if __name__ == "__main__":
    main()
