"""Python and C calls per submit on the worker's general path, counted, not timed (no GPU needed).

    PYTHONPATH=<tree> python profiling/probes/probe_call_counts.py --out DIR [--tag NAME]
    python profiling/probes/probe_call_counts.py --compare DIR/before.json DIR/after.json

Submit host times do not resolve a few percent between two trees (docs/design/ab-resolution.md).
A count of the calls one submit makes does: it is exact and the same on every host. This probe
builds a TransferWorker for real over CPU tensors, with CPU stand-ins for torch.cuda's Stream
and Event and no extension (`connector.worker._C` set to None: the general path, `prepare` on the
caller's thread, then an inline torch copy). It submits 1000-block stores and loads (Llama-3.1-8B
shape, per-layer and unified layouts) under `sys.setprofile` and records every call by
(file, function). It uses only public API that the trees before and after issue 36's door
refactor share, so the same file counts any of them that PYTHONPATH names
(plus `connector.worker._C`, set to None). It does not cover the native (C++) paths.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import numpy as np
import torch

LAYOUTS = ("TWO_NB_BS_NH_HS", "NB_NL_TWO_BS_NH_HS")


class CpuEvent:
    """A CPU stand-in for torch.cuda.Event (also the tests' fake CUDA worker's)."""

    def __init__(self, enable_timing: bool = False):
        self.cuda_event = 0

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


class CpuStream:
    """A CPU stand-in for torch.cuda.Stream."""

    cuda_stream = 0

    def __init__(self, device=None):
        pass

    def wait_event(self, e) -> None:
        pass

    def synchronize(self) -> None:
        pass


def count(blocks: int, reps: int) -> list:
    """One row per (layout, kind): the calls of the last of `reps` submits (the first ones warm up
    caches such as the cost model's memo)."""
    torch.cuda.Stream, torch.cuda.Event = CpuStream, CpuEvent
    import connector.worker as cw
    from layout import MODELS, KVBlockMover, KVLayout, UnifiedKVCache, allocate

    cw._C = None
    spec = MODELS["llama-3.1-8b"]
    nb = blocks + blocks // 4
    rows = []
    for name in LAYOUTS:
        lay = KVLayout[name]
        kv = allocate(spec, lay, nb, device="cpu") if lay.per_layer else UnifiedKVCache(spec, nb, device="cpu").unified()
        mover = KVBlockMover(spec, lay, kv)
        host = torch.zeros((nb, spec.unified_block_bytes), dtype=torch.uint8)
        w = cw.TransferWorker(mover, host, method="torch", compute_stream=CpuStream(), native_submit=False)
        rng = np.random.default_rng(0)
        job = 0
        for kind in ("store", "load"):
            for _ in range(reps):
                ids = rng.permutation(blocks).astype(np.int64)
                slots = np.sort(rng.permutation(nb)[:blocks]).astype(np.int64)
                calls: collections.Counter = collections.Counter()

                def prof(frame, event, arg, calls=calls):
                    if event == "call":
                        co = frame.f_code
                        calls["py " + "/".join(co.co_filename.split(os.sep)[-2:]) + ":" + co.co_name] += 1
                    elif event == "c_call":
                        calls["c " + str(getattr(arg, "__qualname__", arg))] += 1

                job += 1
                sys.setprofile(prof)
                try:
                    ok = w.submit_store(job, ids, slots) if kind == "store" else w.submit_load(job, slots, ids)
                finally:
                    sys.setprofile(None)
                fin = w.get_finished()
                if not ok or not all(r.ok for r in fin):
                    raise RuntimeError(f"{name} {kind}: the submit failed: {fin}")
            py = sum(v for k, v in calls.items() if k.startswith("py "))
            rows.append({"layout": name, "kind": kind, "blocks": blocks, "python_calls": py,
                         "c_calls": sum(calls.values()) - py, "calls": dict(sorted(calls.items()))})
            print(f"{name:>20} {kind:5} {blocks} blocks: {py:5d} python calls, {rows[-1]['c_calls']:6d} C calls", flush=True)
        w.shutdown()
        del w, mover, kv, host  # before the next layout's buffers
    return rows


def compare(a_path: str, b_path: str) -> int:
    """Prints each row's totals and the calls whose counts differ (b minus a). The function
    names are matched without their module, so a function that moved keeps its line."""
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    strip = lambda k: k.split(" ", 1)[0] + " " + k.rsplit(":", 1)[-1] if k.startswith("py ") else k  # noqa: E731
    for ra, rb in zip(a["rows"], b["rows"]):
        print(f"{ra['layout']:>20} {ra['kind']:5}  python {ra['python_calls']:5d} -> {rb['python_calls']:5d}   "
              f"C {ra['c_calls']:6d} -> {rb['c_calls']:6d}")
        ca, cb = collections.Counter(), collections.Counter()
        for k, v in ra["calls"].items():
            ca[strip(k)] += v
        for k, v in rb["calls"].items():
            cb[strip(k)] += v
        for k in sorted(set(ca) | set(cb)):
            if ca[k] != cb[k]:
                print(f"{'':28}{cb[k] - ca[k]:+5d}  {k}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for <tag>.json")
    ap.add_argument("--tag", default="calls", help="the file's name in --out (e.g. before, after)")
    ap.add_argument("--blocks", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two files this wrote: their differences")
    a = ap.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    if a.out is None:
        ap.error("--out is required")
    rows = count(a.blocks, a.reps)
    import connector

    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"{a.tag}.json")
    with open(path, "w") as f:
        json.dump({"meta": {"tree": os.path.dirname(os.path.dirname(os.path.abspath(connector.__file__))),
                            "python": sys.version.split()[0], "torch": torch.__version__}, "rows": rows}, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
