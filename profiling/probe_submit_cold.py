"""Why a native-submit job costs the caller ~185 us right after a 2 GB job and ~80 us otherwise.

    python profiling/probe_submit_cold.py

The worker's native fast path is two C++ calls (id check; event record + plan + queue).
After a device sync that followed a 1000 x 2 MiB DMA job the second call took ~150 us on the
H200 host (profiling/results/hostprof.txt), after a 4-block job far less. Two candidates:
  * the CPU: its caches and clocks are cold after waiting ~40 ms (the host-side pieces,
    check_ids or pure Python, would slow down too);
  * the driver: work left by the big job (1000 descriptors) is done by the next driver call
    of any thread (then a cudaEventRecord alone pays it, and a call made earlier by another
    thread would take it off the caller).
Each row: median us over 15 trials of the first call timed after `before` completed and the
device was synchronised; `then` is a second, identical call right after.
"""
import os
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from connector import TransferWorker  # noqa: E402
from kernels._ext import _C  # noqa: E402
from layout import KVBlockMover, KVLayout, KVSpec, UnifiedKVCache  # noqa: E402


def main():
    spec = KVSpec(32, 8, 128, 16, dtype=torch.bfloat16)  # 2 MiB unified blocks
    nb = 1024
    cache = UnifiedKVCache(spec, nb, device="cuda")
    mover = KVBlockMover(spec, KVLayout.NB_NL_TWO_BS_NH_HS, cache.unified())
    host = torch.empty(2 * nb, spec.unified_block_bytes, dtype=torch.uint8, pin_memory=True)
    w = TransferWorker(mover, host, native_submit=True)
    wi = TransferWorker(mover, host)  # inline: the caller's thread issues the DMA
    rng = np.random.default_rng(0)
    dev = torch.cuda.current_device()
    ev = torch.cuda.Event()
    ev.record()
    s0 = torch.cuda.current_stream().cuda_stream
    ids = rng.permutation(nb)[:1000]
    slots = np.sort(rng.permutation(2 * nb)[:1000])
    jid = [0]

    def job(worker, n, how="sync"):
        """One store job, then the caller waits for it: "sync" (a device synchronize, the
        thread may sleep), "poll" (get_finished in a loop, as an idle engine polls) or "spin"
        (pure Python busy work for 60 ms, no driver call, then get_finished)."""
        jid[0] += 1
        worker.submit_store(jid[0], ids[:n], slots[:n])
        if how == "sync":
            worker.wait([jid[0]])
            torch.cuda.synchronize()
            worker.get_finished()
        elif how == "poll":
            while not worker.get_finished():
                pass
        else:
            t_end = time.perf_counter() + 0.06
            while time.perf_counter() < t_end:
                pure_python()
            assert worker.get_finished()

    def pure_python():
        x = 0
        for i in range(2000):
            x += i * i
        return x

    calls = {
        "event_record (driver)": lambda: _C.event_record(ev.cuda_event, s0, dev),
        "check_ids 1000 (C++, CPU only)": lambda: _C.check_ids(ids.ctypes.data, slots.ctypes.data, 1000, nb, 2 * nb),
        "pure Python loop (CPU only)": pure_python,
        "stream query (driver)": lambda: _C.stream_busy(s0, dev),
    }
    befores = {
        "native 1000-block job": lambda: job(w, 1000),
        "native 1000, polled": lambda: job(w, 1000, "poll"),
        "native 1000, CPU spun": lambda: job(w, 1000, "spin"),
        "native 4-block job": lambda: job(w, 4),
        "inline 1000-block job": lambda: job(wi, 1000),
    }
    print(f"# {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, "
          f"sha {os.environ.get('KVO_GIT_SHA', 'unknown')}")
    print(f"{'before':<24} {'timed call':<32} {'extra':<28} {'first us':>9} {'then us':>9}")

    def other_thread_call():
        t = threading.Thread(target=lambda: _C.event_record(ev.cuda_event, s0, dev))
        t.start()
        t.join()

    extras = {"-": None, "sleep 5 ms": lambda: time.sleep(0.005),
              "event_record on another thread": other_thread_call}
    for bname, before in befores.items():
        for cname, call in calls.items():
            for xname, extra in extras.items():
                if xname != "-" and not cname.startswith("event_record"):
                    continue
                first, then = [], []
                for _ in range(16):
                    before()
                    if extra is not None:
                        extra()
                    t0 = time.perf_counter()
                    call()
                    t1 = time.perf_counter()
                    call()
                    t2 = time.perf_counter()
                    first.append((t1 - t0) * 1e6)
                    then.append((t2 - t1) * 1e6)
                print(f"{bname:<24} {cname:<32} {xname:<28} {np.median(first[1:]):9.1f} {np.median(then[1:]):9.1f}",
                      flush=True)
    # the fast path's own call after each kind of job, the same way
    for bname, before in befores.items():
        t = []
        for i in range(16):
            before()
            jid[0] += 1
            t0 = time.perf_counter()
            w.submit_store(jid[0], ids, slots)
            t.append((time.perf_counter() - t0) * 1e6)
            w.wait([jid[0]])
            torch.cuda.synchronize()
            w.get_finished()
        print(f"{bname:<24} {'native submit_store 1000':<32} {'-':<28} {np.median(t[1:]):9.1f}", flush=True)
    w.shutdown()
    wi.shutdown()


if __name__ == "__main__":
    main()
