"""A same-run A/B of two source trees (ab_trees.sh): its connector rows and summary, one file
run against either tree.

    python profiling/bench/ab_trees.py check                      # imports + the tree it sees
    python profiling/bench/ab_trees.py connector --out DIR [--reps 9]
    python profiling/bench/ab_trees.py summary --out DIR [--before-sha S --after-sha S]  # after/before medians

Run from a tree's root with PYTHONPATH=<that tree>: `connector` uses only the public API both
trees share (TransferWorker, HostPool, UnifiedKVCache, KVBlockMover, allocate, MODELS), so the
same measuring code times the library before and after a change. It writes connector.json
rows as bench_connector's: "submit" (1000-block jobs of 2 MiB unified blocks, Llama-3.1-8B
shape; host us on the caller per job in four GPU states: after a device sync, idle as polled
by get_finished, after a small job, busy behind a sleep kernel) and "worker_bidir" (GB/s of a
store and a load of 512 blocks each in flight together, timed from a common start).
`summary` reads DIR/<tree>/r<k>/*.json (tree: before, after), takes medians over rounds and
writes DIR/summary.json: after/before per row and metric (host us and ms: lower is better;
GB/s: higher), ok when within 3% or better.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time
from typing import Optional

LIMIT = 1.03  # "within 3% or better"


def check() -> None:
    import connector
    import kernels
    import layout

    print(f"kernels {os.path.dirname(kernels.__file__)}; connector {os.path.dirname(connector.__file__)}; "
          f"layout {os.path.dirname(layout.__file__)}")
    from connector import HostPool, TransferWorker  # noqa: F401
    from layout import MODELS, KVBlockMover, KVLayout, UnifiedKVCache, allocate  # noqa: F401

    print("public API ok; extension built:", kernels.backends()["dma"])


def _sleep_burst(torch, ms: float = 30.0) -> None:
    torch.cuda._sleep(int(ms * 2e6))  # ~2 GHz SM clock; the exact length does not matter


def connector_rows(out: str, reps: int) -> None:
    import numpy as np
    import torch

    from connector import HostPool, TransferWorker
    from layout import MODELS, KVBlockMover, KVLayout, UnifiedKVCache, allocate

    torch.cuda.init()
    spec = MODELS["llama-3.1-8b"]
    ub = spec.unified_block_bytes
    n = (1 << 30) // ub
    cache = UnifiedKVCache(spec, 2 * n, device="cuda")
    cache.buffer.random_(1, 255)
    pool = HostPool(2 * n, ub)
    pool.wait_pinned()
    mover = KVBlockMover(spec, KVLayout.NB_NL_TWO_BS_NH_HS, cache.unified())
    kv = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, 1024, device="cuda")
    rows: list = []
    rng = np.random.default_rng(0)
    os.makedirs(out, exist_ok=True)

    def save() -> None:  # after every row: a run cut short keeps what it measured
        with open(os.path.join(out, "connector.json"), "w") as f:
            json.dump({"meta": {"gpu": torch.cuda.get_device_name(), "reps": reps,
                                "date": time.strftime("%FT%TZ", time.gmtime())}, "rows": rows}, f, indent=1)
    w = TransferWorker(mover, pool.tensor, native_submit=False)
    wn = TransferWorker(mover, pool.tensor)
    # ---- bidirectional rate through the worker (native: the default; inline)
    gb, hs = rng.permutation(2 * n), rng.permutation(2 * n)
    job = [0]
    for wname, wk in (("native", wn), ("inline", w)):
        def both(ev, wk=wk):
            job[0] += 2
            wk.submit_store(job[0], gb[:n], hs[:n], after=ev)
            wk.submit_load(job[0] + 1, hs[n:], gb[n:], after=ev)
            wk.fence(job[0])
            wk.fence(job[0] + 1)

        spans = []
        for i in range(8):
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            _sleep_burst(torch, 10.0)
            t0.record()
            both(t0)
            t1.record()
            t1.synchronize()
            if i:  # the first is a warm-up
                spans.append(t0.elapsed_time(t1))
        fin = wk.get_finished()
        assert fin and all(r.ok for r in fin), fin
        gbps = 2 * n * ub / statistics.median(spans) / 1e6
        rows.append({"section": "worker_bidir", "worker": wname, "blocks_each_way": n, "gbps": round(gbps, 2)})
        save()
        print(f"worker bidir {wname:>6}: {gbps:.1f} GB/s", flush=True)
    # ---- host us per 1000-block submit, four GPU states
    workers = (("unified", w), ("unified-native", wn),
               ("per-layer-cuda", TransferWorker(KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv), pool.tensor,
                                                 method="cuda")),
               ("per-layer-auto", TransferWorker(KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv), pool.tensor)),
               ("per-layer-cuda-inline", TransferWorker(KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv),
                                                        pool.tensor, method="cuda", native_submit=False)),
               ("unified-async", TransferWorker(mover, pool.tensor, async_submit=True)))

    def submit(wk, kind, jid, ids, slots):
        return wk.submit_store(jid, ids, slots) if kind == "store" else wk.submit_load(jid, slots, ids)

    def job_ids():
        return rng.permutation(1000), np.sort(rng.permutation(2 * n)[:1000])

    jid = [100_000]

    def nxt():
        jid[0] += 1
        return jid[0]

    for name, wk in workers:
        for kind in ("store", "load"):
            synced, polled, small, busy = [], [], [], []
            for i in range(reps + 1):
                ids, slots = job_ids()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                ok = submit(wk, kind, nxt(), ids, slots)
                synced.append((time.perf_counter() - t0) * 1e6)
                assert ok
                wk.flush()
                torch.cuda.synchronize()
                fin = wk.get_finished()
                assert fin and all(r.ok for r in fin), fin
            for i in range(reps + 1):  # idle as an engine sees it: the previous end seen by polling
                ids, slots = job_ids()
                t0 = time.perf_counter()
                submit(wk, kind, nxt(), ids, slots)
                polled.append((time.perf_counter() - t0) * 1e6)
                fin = []
                while not fin:
                    fin = wk.get_finished()
                assert all(r.ok for r in fin), fin
            for i in range(reps + 1):  # after a sync, but the job before was 4 blocks (caches stay warm)
                ids, slots = job_ids()
                for a, b, timed in ((ids[:4], slots[:4], False), (ids, slots, True)):
                    torch.cuda.synchronize()
                    wk.get_finished()
                    t0 = time.perf_counter()
                    submit(wk, kind, nxt(), a, b)
                    if timed:
                        small.append((time.perf_counter() - t0) * 1e6)
                    wk.flush()
            torch.cuda.synchronize()
            assert all(r.ok for r in wk.get_finished())
            jobs = [job_ids() for _ in range(8)]
            submit(wk, kind, nxt(), *jobs[0])  # warm-up
            torch.cuda.synchronize()
            wk.get_finished()
            while len(busy) < 2 * 8:  # compute running, no host wait between submits: bursts of 8
                _sleep_burst(torch)
                for k in range(8):
                    t0 = time.perf_counter()
                    submit(wk, kind, nxt(), *jobs[k])
                    busy.append((time.perf_counter() - t0) * 1e6)
                wk.flush()
                wk.wait(list(wk.jobs))
                assert all(r.ok for r in wk.get_finished())
            med = lambda v: round(statistics.median(v[1:]), 1)  # noqa: E731  (the first is a warm-up)
            r = {"section": "submit", "worker": name, "kind": kind, "blocks": 1000, "host_us": med(synced),
                 "host_us_polled": med(polled), "host_us_after_small": med(small),
                 "host_us_busy": round(statistics.median(busy), 1), "methods": dict(wk.methods)}
            rows.append(r)
            save()
            print(f"submit {name:>22} {kind}: {r['host_us']:7.1f} us synced, {r['host_us_polled']:7.1f} polled, "
                  f"{r['host_us_after_small']:7.1f} after small, {r['host_us_busy']:7.1f} busy", flush=True)
    for _, wk in workers:
        wk.shutdown()


# ---------------------------------------------------------------- summary
def _metrics(name: str, doc: dict):
    """(row key, metric, value, higher_is_better) of one results file."""
    for r in doc.get("rows", []):
        sec = r.get("section")
        if name == "transfer":
            key = "/".join(str(r.get(k)) for k in ("section", "dir", "method", "block_bytes", "count", "size_label")
                           if r.get(k) is not None)
            for m in ("gbps", "host_us", "host_us_busy", "ms"):
                if isinstance(r.get(m), (int, float)):
                    yield f"transfer:{key}", m, r[m], m == "gbps"
        elif name == "connector":
            key = f"{sec}/{r.get('worker')}" + (f"/{r['kind']}" if "kind" in r else "")
            for m in ("gbps", "host_us", "host_us_polled", "host_us_after_small", "host_us_busy"):
                if isinstance(r.get(m), (int, float)):
                    yield f"connector:{key}", m, r[m], m == "gbps"
        elif name == "ttft":
            key = "/".join(str(r.get(k)) for k in ("len", "length", "prompt_len", "method", "mode") if r.get(k) is not None)
            for m, v in r.items():
                # the loads' TTFT and job time (recompute and GPU-hit TTFT do not touch the offload path)
                if isinstance(v, (int, float)) and m.startswith("load_") and "floor" not in m:
                    yield f"ttft:{key}", m, v, False


def is_target(row: str, metric: str) -> bool:
    """The measures issue 36's no-regression target names: each transfer row's rate, the
    1000-block connector submit's host time in its four GPU states, the worker's bidirectional
    rate, the TTFT rows. The transfer rows' host_us (one call, timed around the rate's loop) are
    kept in the summary as information: within one run they move 2x with the host's state."""
    if row.startswith("transfer:"):
        return metric == "gbps"
    if row.startswith("connector:submit/"):
        return metric.startswith("host_us")
    if row.startswith("connector:worker_bidir/"):
        return metric == "gbps"
    return row.startswith("ttft:")


def _worse(ratio, hib: bool) -> float:
    """After/before as "worse by" (a factor >= 1 means worse: time grows, or a rate falls);
    a missing or non-positive ratio counts as worst."""
    return float("inf") if not ratio or ratio <= 0 else (1 / ratio if hib else ratio)


def summary(out: str, shas: Optional[dict] = None) -> dict:
    """shas: {"before": sha, "after": sha}, recorded in the summary's meta with the GPU and
    the dates the rounds' files carry."""
    vals: dict = {}
    meta: dict = {"shas": shas or {}, "gpu": set(), "dates": set()}
    for tree in ("before", "after"):
        for p in sorted(glob.glob(os.path.join(out, tree, "r*", "*.json"))):
            name = os.path.basename(p)[:-5]
            try:
                doc = json.load(open(p))
            except (OSError, ValueError):
                continue
            m0 = doc.get("meta") if isinstance(doc, dict) else None
            m0 = m0 if isinstance(m0, dict) else {}
            meta["gpu"].update([str(m0["gpu"])] if m0.get("gpu") else [])
            meta["dates"].update([str(m0["date"])[:10]] if m0.get("date") else [])
            for key, m, v, hib in _metrics(name, doc):
                vals.setdefault((key, m), {"before": [], "after": [], "hib": hib})[tree].append(v)
    rows, worst = [], None
    for (key, m), d in sorted(vals.items()):
        b, a = d["before"], d["after"]
        if not b or not a:
            continue
        mb, ma = statistics.median(b), statistics.median(a)
        ratio = ma / mb if mb else None
        worse = _worse(ratio, d["hib"])
        ok = worse <= LIMIT
        rows.append({"row": key, "metric": m, "before_median": mb, "after_median": ma,
                     "after_over_before": None if ratio is None else round(ratio, 4),
                     "higher_is_better": d["hib"], "n_before": len(b), "n_after": len(a), "ok": ok,
                     "target": is_target(key, m)})
        if worse != float("inf") and (worst is None or worse > worst[0]):
            worst = (worse, key, m)
    tg = [r for r in rows if r["target"]]
    tworst = max(tg, key=lambda r: _worse(r["after_over_before"], r["higher_is_better"]), default=None)
    # per section and metric: the geometric mean of after/before (a shift every row shares vs noise)
    sec: dict = {}
    for r in rows:
        if r["after_over_before"]:
            sec.setdefault(f"{r['row'].split('/')[0]} {r['metric']}", []).append(r["after_over_before"])
    doc = {"meta": {"shas": meta["shas"], "gpu": sorted(meta["gpu"]), "dates": sorted(meta["dates"])},
           "limit": LIMIT, "rows": rows, "checked": len(rows), "failing": sum(not r["ok"] for r in rows),
           "worst": None if worst is None else {"factor": round(worst[0], 4), "row": worst[1], "metric": worst[2]},
           "targets": {"checked": len(tg), "failing": sum(not r["ok"] for r in tg),
                       "rounds": sorted({min(r["n_before"], r["n_after"]) for r in tg}),
                       "worst": None if tworst is None else {k: tworst[k] for k in ("row", "metric", "after_over_before")}},
           "geomean_by_section": {k: round(statistics.geometric_mean(v), 4) for k, v in sorted(sec.items())}}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(doc, f, indent=1)
    for r in rows:
        if not r["ok"]:
            print(f"OVER 3%: {r['row']} {r['metric']}: before {r['before_median']} after {r['after_median']} "
                  f"({r['after_over_before']})")
    print(f"summary: {doc['checked']} medians compared, {doc['failing']} over {LIMIT}; worst {doc['worst']}")
    t = doc["targets"]
    print(f"targets: {t['checked']} medians (rounds per row {t['rounds']}), {t['failing']} over {LIMIT}; worst {t['worst']}")
    for k, g in doc["geomean_by_section"].items():
        print(f"  geomean after/before  {k:<40} {g:.4f}")
    return doc


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("check", "connector", "summary"))
    ap.add_argument("--out", default=None, help="output folder (required for connector and summary)")
    ap.add_argument("--reps", type=int, default=9, help="timed submits per (worker, kind, state)")
    ap.add_argument("--before-sha", default=os.environ.get("AB_BEFORE_SHA", "unknown"),
                    help="summary: the tree before's git sha, recorded in its meta (env AB_BEFORE_SHA)")
    ap.add_argument("--after-sha", default=os.environ.get("AB_AFTER_SHA", "unknown"),
                    help="summary: the tree after's git sha (env AB_AFTER_SHA)")
    a = ap.parse_args(argv)
    if a.what == "check":
        check()
    elif a.out is None:
        ap.error("--out is required")
    elif a.what == "connector":
        connector_rows(a.out, a.reps)
    else:
        summary(a.out, {"before": a.before_sha, "after": a.after_sha})


if __name__ == "__main__":
    sys.exit(main())
