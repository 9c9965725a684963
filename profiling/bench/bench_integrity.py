"""Cost of the integrity mode (connector.integrity): load GB/s with and without block checksums.

    python -m profiling.bench.bench_integrity                 # H200: 2 MiB blocks, unified layout
    python -m profiling.bench.bench_integrity --layout per_layer --out profiling/results/integrity.json

A Llama-3.1-8B-shaped KV cache (32 layers, 8 KV heads, head size 128, bf16, 16-token blocks:
2 MiB per block), a pinned host pool of the same number of slots, loads of `--job-blocks`
blocks submitted back to back (`--jobs` of them, as an engine step's loads would be) and
polled with get_finished until all are reported; GB/s = bytes / wall time from the first
submit to the last report. Plain and checked runs alternate (`--reps` each); medians reported.
Also the store direction, and the host time per submit. One aligned line per configuration;
rows as JSON to --out (default: a temporary folder, never over committed results).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from profiling.common import meta


def _setup(layout: str, num_blocks: int):
    from layout.fragments import fragments
    from layout.pack import KVBlockMover
    from layout.spec import KVLayout, KVSpec

    dev = torch.device("cuda", 0)
    spec = KVSpec(num_layers=32, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(0)
    if layout == "unified":
        kv = torch.randn(spec.shape(KVLayout.NB_NL_TWO_BS_NH_HS, num_blocks), device=dev, generator=g).to(spec.dtype)
        table = fragments(spec, KVLayout.NB_NL_TWO_BS_NH_HS, kv)
    else:
        kv = [torch.randn(spec.shape(KVLayout.TWO_NB_BS_NH_HS, num_blocks), device=dev, generator=g).to(spec.dtype)
              for _ in range(spec.num_layers)]
        table = fragments(spec, KVLayout.TWO_NB_BS_NH_HS, kv)
    from connector.host_pool import HostPool

    pool = HostPool(num_blocks, table.unified_block_bytes, dev, background=False)
    mover = KVBlockMover.from_table(table)
    return mover, pool, kv


def _run(w, kind: str, jobs: int, job_blocks: int, num_blocks: int, base_id: int):
    torch.cuda.synchronize()
    # disjoint GPU blocks per job (a job's blocks are nobody else's until it is reported,
    # as in an engine; the check reads them after the copy)
    if jobs * job_blocks > num_blocks:
        raise SystemExit("--jobs x --job-blocks must not exceed --num-blocks")
    p = np.random.default_rng(base_id).permutation(num_blocks).astype(np.int64)
    perm = [p[i * job_blocks:(i + 1) * job_blocks] for i in range(jobs)]
    slots = [np.arange(i * job_blocks, (i + 1) * job_blocks, dtype=np.int64) % num_blocks for i in range(jobs)]
    t0 = time.perf_counter()
    submit_s = 0.0
    for i in range(jobs):
        a = time.perf_counter()
        ok = (w.submit_load(base_id + i, slots[i], perm[i]) if kind == "load"
              else w.submit_store(base_id + i, perm[i], slots[i]))
        submit_s += time.perf_counter() - a
        assert ok
    seen, bad = 0, 0
    while seen < jobs:
        time.sleep(2e-4)  # a hot poll would hold the native submitter's gate most of the time
        for r in w.get_finished():
            seen += 1
            bad += not r.ok
    dt = time.perf_counter() - t0
    return jobs * job_blocks * w.mover.unified_block_bytes / dt / 1e9, submit_s / jobs * 1e6, bad


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", choices=["unified", "per_layer"], default="unified")
    ap.add_argument("--num-blocks", type=int, default=2048, help="GPU blocks = host slots (2 MiB each)")
    ap.add_argument("--job-blocks", type=int, default=64)
    ap.add_argument("--jobs", type=int, default=24)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-native", action="store_true", help="TransferWorker(native_submit=False)")
    ap.add_argument("--out", default=None, help="JSON rows (default: a temporary folder)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_integrity needs a CUDA device")
    from connector.integrity import CheckedTransferWorker
    from connector.worker import TransferWorker

    mover, pool, kv = _setup(a.layout, a.num_blocks)
    plain = TransferWorker(mover, pool.tensor, native_submit=not a.no_native)
    checked = CheckedTransferWorker(TransferWorker(mover, pool.tensor, native_submit=not a.no_native), mover)
    # the checked worker's table must hold every slot's sum before loads: store everything once.
    # Both workers share pool and KV: the load phase changes only GPU blocks, so the checked
    # worker's sums stay valid through it; the store phase (plain stores too) comes last.
    for w in (plain, checked):
        ids = np.arange(a.num_blocks, dtype=np.int64)
        w.submit_store(1, ids, ids)
        w.wait([1])
        w.get_finished()
    rows = []
    jid = 1000
    for kind in ("load", "store"):
        res = {"plain": [], "checked": []}
        for _ in range(a.reps + 1):  # first round: warm-up (Triton compile, events)
            for name, w in (("plain", plain), ("checked", checked)):
                jid += 10_000
                res[name].append(_run(w, kind, a.jobs, a.job_blocks, a.num_blocks, jid))
        for name in ("plain", "checked"):
            runs = res[name][1:]
            gbs = statistics.median(r[0] for r in runs)
            us = statistics.median(r[1] for r in runs)
            bad = sum(r[2] for r in runs)
            rows.append({"bench": "integrity", "layout": a.layout, "kind": kind, "mode": name,
                         "block_bytes": mover.unified_block_bytes, "job_blocks": a.job_blocks, "jobs": a.jobs,
                         "native": not a.no_native, "gbps_median": round(gbs, 2),
                         "gbps_runs": [round(r[0], 2) for r in runs], "submit_us_median": round(us, 1),
                         "failed_jobs": bad})
        p, c = rows[-2]["gbps_median"], rows[-1]["gbps_median"]
        rows[-1]["ratio_vs_plain"] = round(c / p, 4)
    for r in rows:
        print(f"{r['layout']:>9} {r['kind']:>5} {r['mode']:>7}  {r['gbps_median']:7.2f} GB/s  "
              f"submit {r['submit_us_median']:7.1f} us  failed {r['failed_jobs']}"
              + (f"  x{r['ratio_vs_plain']:.4f} of plain" if "ratio_vs_plain" in r else ""))
    print("integrity counters:", checked.integrity)
    out = a.out or os.path.join(tempfile.mkdtemp(prefix="kvo-bench-integrity-"), "integrity.json")
    with open(out, "w") as f:
        json.dump({"meta": meta(), "reference": "each checked row against the plain row of the same run",
                   "rows": rows, "integrity": checked.integrity, "device": torch.cuda.get_device_name(0)}, f, indent=1)
    print("rows ->", out)
    plain.shutdown()
    checked.shutdown()


if __name__ == "__main__":
    main()
