"""Reads an Nsight Systems SQLite export or a torch.profiler trace and prints, per run:
  * time per NVTX / record_function range (count, total, mean),
  * copy/compute overlap: the share of copy time during which a compute kernel ran,
  * achieved PCIe GB/s per direction (bytes over the union of that direction's copy time).

    nsys export --type sqlite -o trace.sqlite trace.nsys-rep
    python -m profiling.analysis.analyze_trace trace.sqlite            # or trace.json from torch.profiler
    python -m profiling.analysis.analyze_trace trace.sqlite --json out.json

Copies are DMA memcpys and the kvoffload SM copy kernels (copy_blocks*,
pack_layers*, _copy_blocks_kernel, _pack_layers_kernel); every other kernel is
compute.
"""
from __future__ import annotations

import argparse
import json
import re
import sqlite3
from collections import defaultdict
from dataclasses import dataclass, field

COPY_KERNEL = re.compile(r"copy_blocks|pack_layers|_copy_blocks_kernel|_pack_layers_kernel")


@dataclass
class Trace:
    ranges: list = field(default_factory=list)    # (name, start_ns, end_ns)
    kernels: list = field(default_factory=list)   # (name, start_ns, end_ns)
    copies: list = field(default_factory=list)    # (kind "h2d"|"d2h"|"d2d"|"sm", start, end, bytes)


def union(iv: list) -> list:
    out = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def length(iv: list) -> int:
    return sum(e - s for s, e in iv)


def intersect(a: list, b: list) -> list:
    i = j = 0
    out = []
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append([s, e])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def load_sqlite(path: str) -> Trace:
    t = Trace()
    con = sqlite3.connect(path)
    tables = {r[0] for r in con.execute("select name from sqlite_master where type='table'")}
    strings = {}
    if "StringIds" in tables:
        strings = dict(con.execute("select id, value from StringIds"))
    if "NVTX_EVENTS" in tables:
        for text, tid, s, e in con.execute("select text, textId, start, end from NVTX_EVENTS where end is not null"):
            t.ranges.append((text if text is not None else strings.get(tid, "?"), s, e))
    if "CUPTI_ACTIVITY_KIND_KERNEL" in tables:
        cols = {r[1] for r in con.execute("pragma table_info(CUPTI_ACTIVITY_KIND_KERNEL)")}
        name_col = "demangledName" if "demangledName" in cols else "shortName"
        for nid, s, e in con.execute(f"select {name_col}, start, end from CUPTI_ACTIVITY_KIND_KERNEL"):
            name = strings.get(nid, str(nid))
            (t.copies.append(("sm", s, e, 0)) if COPY_KERNEL.search(name) else None)
            t.kernels.append((name, s, e))
    if "CUPTI_ACTIVITY_KIND_MEMCPY" in tables:
        kinds = {1: "h2d", 2: "d2h", 8: "d2d", 10: "p2p"}
        for kind, s, e, nbytes in con.execute("select copyKind, start, end, bytes from CUPTI_ACTIVITY_KIND_MEMCPY"):
            t.copies.append((kinds.get(kind, f"kind{kind}"), s, e, nbytes))
    return t


def load_torch_json(path: str) -> Trace:
    t = Trace()
    with open(path) as f:
        doc = json.load(f)
    for ev in doc.get("traceEvents", []):
        if ev.get("ph") != "X":
            continue
        s = int(float(ev["ts"]) * 1000)
        e = s + int(float(ev.get("dur", 0)) * 1000)
        cat, name = ev.get("cat", ""), ev.get("name", "")
        if cat == "user_annotation":
            t.ranges.append((name, s, e))
        elif cat == "kernel":
            t.kernels.append((name, s, e))
            if COPY_KERNEL.search(name):
                t.copies.append(("sm", s, e, 0))
        elif cat == "gpu_memcpy":
            kind = "h2d" if "HtoD" in name else "d2h" if "DtoH" in name else "d2d"
            nbytes = int(ev.get("args", {}).get("bytes", 0))
            t.copies.append((kind, s, e, nbytes))
    return t


def analyze(t: Trace) -> dict:
    per = defaultdict(lambda: [0, 0])
    for name, s, e in t.ranges:
        key = re.sub(r"\d+", "#", name)  # "kvo.copy d2h dma n=128" -> one row per shape of name
        per[key][0] += 1
        per[key][1] += e - s
    compute = union([[s, e] for n, s, e in t.kernels if not COPY_KERNEL.search(n)])
    copy_all = union([[s, e] for k, s, e, b in t.copies])
    overlap = length(intersect(copy_all, compute))
    pcie = {}
    for d in ("h2d", "d2h"):
        iv = union([[s, e] for k, s, e, b in t.copies if k == d])
        nbytes = sum(b for k, s, e, b in t.copies if k == d)
        pcie[d] = {"bytes": nbytes, "busy_ms": length(iv) / 1e6,
                   "gbps": nbytes / length(iv) if length(iv) else 0.0}
    both = intersect(union([[s, e] for k, s, e, b in t.copies if k == "h2d"]),
                     union([[s, e] for k, s, e, b in t.copies if k == "d2h"]))
    return {
        "ranges": {k: {"count": c, "total_ms": ns / 1e6, "mean_us": ns / c / 1e3} for k, (c, ns) in
                   sorted(per.items(), key=lambda kv: -kv[1][1])},
        "copy_ms": length(copy_all) / 1e6,
        "compute_ms": length(compute) / 1e6,
        "copy_compute_overlap_pct": 100.0 * overlap / length(copy_all) if copy_all else 0.0,
        "bidirectional_ms": length(both) / 1e6,
        "pcie": pcie,
    }


def report(res: dict) -> str:
    lines = [f"{'range':<48} {'count':>7} {'total ms':>10} {'mean us':>10}"]
    for k, v in res["ranges"].items():
        lines.append(f"{k[:48]:<48} {v['count']:>7} {v['total_ms']:>10.3f} {v['mean_us']:>10.1f}")
    if not any(k.startswith("kvo.") for k in res["ranges"]):
        lines.append("(no kvo.* ranges in this trace: kvoffload pushes NVTX ranges only when a tool is injected, "
                     "NVTX_INJECTION64_PATH, which nsys and ncu set, or with KVO_NVTX=1; a torch profiler gets them "
                     "while it records)")
    lines.append(f"copy time {res['copy_ms']:.3f} ms, compute time {res['compute_ms']:.3f} ms, "
                 f"copy/compute overlap {res['copy_compute_overlap_pct']:.1f}%, "
                 f"both PCIe directions busy {res['bidirectional_ms']:.3f} ms")
    for d, v in res["pcie"].items():
        lines.append(f"PCIe {d.upper()}: {v['bytes'] / 1e9:.3f} GB in {v['busy_ms']:.3f} ms busy = {v['gbps']:.1f} GB/s")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", help="nsys SQLite export (.sqlite) or torch.profiler trace (.json)")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    a = ap.parse_args()
    t = load_sqlite(a.trace) if a.trace.endswith((".sqlite", ".db")) else load_torch_json(a.trace)
    res = analyze(t)
    print(report(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
