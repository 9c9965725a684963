"""Where the host time of one copy() goes, piece by piece (median microseconds), and a
cProfile of TransferWorker submits (1000-block jobs, unified and per-layer).

    python -m profiling.probes.host_overhead [--worker | --lines]   # --lines: per statement of the fast paths
"""
import sys
import time

import numpy as np
import torch

from kernels import BlockCopier
from kernels import native
from kernels.copy import check_id_pairs
from kernels.plan import as_host_ids
from profiling.common import host_us_busy


def us(fn, reps=200, spin_us=0):
    """Median host time of fn(); the GPU is drained before each call (not timed), so a
    full index ring or launch queue never turns the figure into GPU time. spin_us: the
    thread then busy-waits that long first, as a thread that did host work since its last
    wait would be (tells a cold-after-wait effect from the call's own cost)."""
    fn()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t_spin = time.perf_counter() + spin_us * 1e-6
        while time.perf_counter() < t_spin:
            pass
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return np.median(ts) * 1e6


def main():
    cp = BlockCopier("cuda")
    nb, bb = 1 << 17, 4096
    g = torch.empty(nb, bb, dtype=torch.uint8, device="cuda")
    h = torch.empty(nb, bb, dtype=torch.uint8, pin_memory=True)
    rng = np.random.default_rng(0)
    for n in (1000, 32768):
        si = rng.permutation(nb)[:n]
        di = np.sort(rng.permutation(nb)[:n])  # as the transfer benchmark's host-submit rows
        ring = cp._ring_get()
        bc, bt = cp.bind(g, h, method="cuda"), cp.bind(g, h, method="triton")
        # the bare launch reads its own int64 ids (ring slots hold whatever their last job staged,
        # int32 ids for the SM path)
        ids_dev = torch.from_numpy(np.concatenate([si, di]).astype(np.int64)).cuda()
        s = torch.cuda.current_stream()
        sh = s.cuda_stream
        parts = {
            "current_stream": lambda: torch.cuda.current_stream(cp.device),
            "is_pinned": lambda: h.is_pinned(),
            "view x2": lambda: (cp.view(g, None, "src"), cp.view(h, None, "dst")),
            "as_host_ids x2": lambda: (as_host_ids(si, "s"), as_host_ids(di, "d")),
            "check_ids": lambda: check_id_pairs(si, di, nb, nb),
            "ring stage+release": lambda: ring.release(ring.stage(si.ctypes.data, di.ctypes.data, n, sh)[0], sh),
            "C++ check+stage+launch": lambda: ring.ring.copy_blocks(
                src=g.data_ptr(), dst=h.data_ptr(), src_ids=si.ctypes.data, dst_ids=di.ctypes.data, n=n,
                n_src=nb, n_dst=nb, block_bytes=bb, src_stride=bb, dst_stride=bb, vec_bytes=16,
                num_ctas=16, stream=sh, variant=0),
            "kernel launch": lambda: native.copy_blocks(src=g.data_ptr(), dst=h.data_ptr(),
                                                   src_ids=ids_dev.data_ptr(),
                                                   dst_ids=ids_dev.data_ptr() + 8 * n, n_pairs=n,
                                                   block_bytes=bb, src_stride=bb, dst_stride=bb,
                                                   src_offset=0, dst_offset=0, vec_bytes=16,
                                                   num_ctas=16, stream=sh),
            "bound(cuda) call": lambda: bc(si, di),
            "bound(triton) call": lambda: bt(si, di),
            "copy(cuda)": lambda: cp.copy(g, h, si, di, method="cuda"),
            "copy(triton)": lambda: cp.copy(g, h, si, di, method="triton"),
            "copy(auto idle)": lambda: cp.copy(g, h, si, di, method="auto", busy=False),
            "copy(auto query)": lambda: cp.copy(g, h, si, di, method="auto"),
        }
        if n == 1000:
            print(f"{'':>8} {'piece':<24} {'after sync':>12} {'sync+spin':>12} {'GPU busy':>12}   (median us)")
        for name, fn in parts.items():
            reps = 50 if 'copy' in name else 200
            print(f"n={n:>6} {name:<24} {us(fn, reps):12.1f} {us(fn, reps, spin_us=300):12.1f} "
                  f"{host_us_busy(lambda i: fn(), reps=48):12.1f}", flush=True)


def _stopwatch(obj, name: str, acc: dict, label: str, undo: list) -> None:
    """Replaces obj.name with a wrapper that adds its wall time to acc[label] (seconds);
    `undo` collects what restores it."""
    f = getattr(obj, name)
    own = name in getattr(obj, "__dict__", {})
    undo.append((obj, name, obj.__dict__[name] if own else None, own))

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] = acc.get(label, 0.0) + time.perf_counter() - t

    setattr(obj, name, timed)


def worker_stopwatch(w, jobs, acc: dict, busy: bool = False) -> None:
    """Where a submit's host time goes, without cProfile's distortion: plain wall-clock
    wrappers around the pieces of TransferWorker._submit (mean us per submit)."""
    import connector.worker as cw

    undo: list = []
    _stopwatch(w.mover, "prepare", acc, "mover.prepare (views, id check, busy query)", undo)
    _stopwatch(w.mover, "run", acc, "mover.run (inline issue)", undo)
    _stopwatch(w.mover.copier.cost_model, "choose", acc, "cost_model.choose", undo)
    st = w._strategy  # the worker's submit strategy (connector/worker.py)
    if type(st).__name__ == "_NativeDma":  # the general path's C++ plan + enqueue
        _stopwatch(st, "ticket", acc, "_NativeDma.ticket (DmaSubmitter.submit_blocks: C++ plan + enqueue)", undo)
    if st.fast is not None:  # the fast path, all of it (native DMA: check_pair + submit_native;
        # per-layer: one pack_native or pack_submit_native call)
        _stopwatch(st, "submit_fast", acc, f"{type(st).__name__}.submit_fast (the fast path, all of it)", undo)
    if st.fast is not None:  # submit_store calls the fast path bound on the worker: the timed one
        w._fast_fn = st.submit_fast
    _stopwatch(w, "_event", acc, "  _event (pooled CUDA event)", undo)
    # (the extension's entry points are bound by kernels and the worker at import or construction,
    # so they are timed within the pieces above, not wrapped one by one)
    _stopwatch(cw, "_Job", acc, "_Job()", undo)
    _stopwatch(cw, "segments_for", acc, "segments_for x2", undo)
    _stopwatch(torch.cuda.Event, "record", acc, "Event.record (incl. event creation)", undo)
    import layout.pack as lp  # the pieces of prepare

    _stopwatch(w.mover, "_unified_view", acc, "  prepare: _unified_view", undo)
    _stopwatch(lp, "as_host_ids", acc, "  prepare: as_host_ids x2", undo)
    _stopwatch(lp, "check_id_pairs", acc, "  prepare: check_id_pairs", undo)
    _stopwatch(torch.cuda, "current_stream", acc, "  torch.cuda.current_stream (all callers)", undo)
    _stopwatch(torch.cuda.Stream, "query", acc, "  Stream.query (busy probe)", undo)
    _stopwatch(lp, "PreparedMove", acc, "  prepare: PreparedMove()", undo)
    split = getattr(w._native, "last_split", None)  # inside record_and_submit / submit_blocks (C++)
    split_labels = ("  DmaSubmitter: event record, gate held", "  DmaSubmitter: plan (take a job + descriptors)",
                    "  DmaSubmitter: queue (lock, push, wake)")

    def one(i, base):
        t0 = time.perf_counter()
        w.submit_store(base + i, *jobs[i % len(jobs)])
        acc["total submit_store"] = acc.get("total submit_store", 0.0) + time.perf_counter() - t0
        if split is not None:
            for label, v in zip(split_labels, split()):
                acc[label] = acc.get(label, 0.0) + v * 1e-6

    calls = len(jobs)
    try:
        if busy:  # GPU busy, no wait between submits (as in an engine step)
            calls = 24 + 1
            host_us_busy(lambda i: one(i, 300_000), reps=calls - 1, burst=8, between=w.get_finished)
        else:
            for i in range(len(jobs)):
                torch.cuda.synchronize()
                one(i, 100_000)
                w.wait([100_000 + i])
                torch.cuda.synchronize()
                w.get_finished()
    finally:
        for obj, name, orig, own in reversed(undo):
            if own:
                setattr(obj, name, orig)
            else:
                delattr(obj, name)
        w._bind(w._strategy)
    for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"    {k:<52} {v / calls * 1e6:8.1f} us per submit", flush=True)


def worker_profile():
    import cProfile
    import pstats

    from connector.host_pool import HostPool
    from connector.worker import TransferWorker
    from layout import KVBlockMover, KVLayout, KVSpec, UnifiedKVCache, allocate

    spec = KVSpec(32, 8, 128, 16, dtype=torch.bfloat16)
    pool = HostPool(2048, spec.unified_block_bytes, torch.device("cuda"))
    pool.wait_pinned()
    uc = UnifiedKVCache(spec, 1024, device="cuda")
    kv = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, 1024, device="cuda")
    rng = np.random.default_rng(0)
    umover = KVBlockMover(spec, KVLayout.NB_NL_TWO_BS_NH_HS, uc.unified())
    for name, mover, method, native in (("unified", umover, "auto", False), ("unified-native", umover, "auto", True),
                                        ("per-layer", KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv), "cuda", False)):
        w = TransferWorker(mover, pool.tensor, method=method, native_submit=native)
        jobs = [(rng.permutation(1000), np.sort(rng.permutation(2048)[:1000])) for _ in range(40)]
        prof = cProfile.Profile()
        plain = []
        for i, (ids, slots) in enumerate(jobs):
            torch.cuda.synchronize()
            if 10 <= i < 25:
                prof.enable()
            t0 = time.perf_counter()
            w.submit_store(i, ids, slots)
            plain.append(time.perf_counter() - t0)
            if 10 <= i < 25:
                prof.disable()
            w.wait([i])
            torch.cuda.synchronize()
            w.get_finished()
        print(f"--- worker {name} ({method}): submit_store of 1000 blocks, median host "
              f"{np.median(plain[25:]) * 1e6:.1f} us unprofiled; cProfile of 15 submits:")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
        print("  stopwatch (20 more submits, each after a device sync, no profiler):")
        worker_stopwatch(w, jobs[:20], {})
        print("  stopwatch (25 submits in bursts of 8 while the GPU is busy, no host wait between them):")
        worker_stopwatch(w, jobs[:20], {}, busy=True)


def line_stopwatch(obj, name: str, marks: list):
    """A copy of obj.name (a method) with a timestamp after each statement, nested ones in
    with/try/if/for blocks included: the source is re-compiled with `marks.append((line,
    perf_counter_ns()))` inserted, in the method's module globals, and bound on obj as an
    instance attribute (undo: `del obj.name`). Timed from the code itself, so it cannot drift
    from it; each mark costs ~0.1-0.2 us."""
    import ast
    import inspect
    import textwrap
    import types

    fn = getattr(type(obj), name)
    src = textwrap.dedent(inspect.getsource(fn))
    first = fn.__code__.co_firstlineno
    tree = ast.parse(src)

    def mark(line):
        return ast.parse(f"_kvo_marks.append(({line}, _kvo_ns()))").body[0]

    def instrument(body):
        out = []
        for st in body:
            for field in ("body", "orelse", "finalbody"):
                if isinstance(getattr(st, field, None), list) and getattr(st, field) and \
                        isinstance(st, (ast.With, ast.Try, ast.If, ast.For, ast.While)):
                    setattr(st, field, instrument(getattr(st, field)))
            if isinstance(st, ast.Try):
                for h in st.handlers:
                    h.body = instrument(h.body)
            out.append(st)
            if not isinstance(st, (ast.Return, ast.Raise)):
                out.append(mark(first + st.lineno - 1))  # a compound statement: its own part (test, exit)
        return out

    f = tree.body[0]
    body = f.body[1:] if isinstance(f.body[0], ast.Expr) and isinstance(f.body[0].value, ast.Constant) else f.body
    f.body = [mark(first)] + instrument(body)
    f.decorator_list = []
    ast.fix_missing_locations(tree)
    g = dict(sys.modules[fn.__module__].__dict__, _kvo_marks=marks, _kvo_ns=time.perf_counter_ns)
    exec(compile(tree, inspect.getsourcefile(fn), "exec"), g)
    setattr(obj, name, types.MethodType(g[f.name], obj))
    lines = inspect.getsourcefile(fn)
    return [ln.rstrip() for ln in open(lines).read().splitlines()]


def worker_lines():
    """Per statement of the two fast paths (native unified DMA, per-layer pack): median host
    us of each statement over 20 submits of 1000 blocks, each after a 2 GB copy and a device
    sync (the state where a submit runs cold), and over 25 submits with the GPU busy."""
    from connector.host_pool import HostPool
    from connector.worker import TransferWorker
    from layout import KVBlockMover, KVLayout, KVSpec, UnifiedKVCache, allocate

    spec = KVSpec(32, 8, 128, 16, dtype=torch.bfloat16)
    pool = HostPool(2048, spec.unified_block_bytes, torch.device("cuda"))
    pool.wait_pinned()
    uc = UnifiedKVCache(spec, 1024, device="cuda")
    kv = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, 1024, device="cuda")
    big_g = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    big_h = torch.empty(2 << 30, dtype=torch.uint8, pin_memory=True)
    rng = np.random.default_rng(0)
    for label, mover, method, native, fast in (
            ("unified-native", KVBlockMover(spec, KVLayout.NB_NL_TWO_BS_NH_HS, uc.unified()), "auto", True,
             "submit_fast"),
            ("per-layer-cuda", KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv), "cuda", False, "submit_fast"),
            ("per-layer-cuda-native", KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv), "cuda", True,
             "submit_fast")):
        w = TransferWorker(mover, pool.tensor, method=method, native_submit=native)
        jobs = [(rng.permutation(1000), np.sort(rng.permutation(2048)[:1000])) for _ in range(20)]
        for i, (b, sl) in enumerate(jobs[:5]):  # warm-up, uninstrumented
            w.submit_store(900_000 + i, b, sl)
            w.wait([900_000 + i])
        w.get_finished()
        marks: list = []
        src = line_stopwatch(w._strategy, fast, marks)
        w._fast_fn = w._strategy.submit_fast  # submit_store calls the fast path bound on the worker
        for state in ("after a 2 GB copy + sync", "GPU busy, bursts of 8"):
            per: dict = {}
            totals = []

            def one(i, base, per=per, totals=totals):
                marks.clear()
                t0 = time.perf_counter_ns()
                w.submit_store(base + i, *jobs[i % len(jobs)])
                if i < 0:  # host_us_busy's untimed warm-up call
                    return
                totals.append((time.perf_counter_ns() - t0) / 1e3)
                prev = None
                for ln, t in marks:
                    if prev is not None:
                        per.setdefault(ln, []).append((t - prev) / 1e3)
                    prev = t

            if state.startswith("after"):
                for i in range(len(jobs)):
                    big_h.copy_(big_g, non_blocking=True)
                    torch.cuda.synchronize()
                    one(i, 100_000)
                    w.wait([100_000 + i])
                    torch.cuda.synchronize()
                    w.get_finished()
            else:
                host_us_busy(lambda i: one(i, 300_000), reps=24, burst=8, between=w.get_finished)
            print(f"--- {label} {fast}, {state}: whole submit_store median {np.median(totals):.1f} us "
                  f"(statement times below sum to less: the call into {fast} and the marks' own cost are outside)")
            for ln in sorted(per):
                print(f"    {np.median(per[ln]):7.1f} us  line {ln:4d}: {src[ln - 1].strip()[:90]}", flush=True)
        del w._strategy.__dict__[fast]
        w._bind(w._strategy)
        w.shutdown()


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker_profile()
    elif "--lines" in sys.argv:
        worker_lines()
    else:
        main()
