"""Replays `auto`'s cost-model picks on a committed transfer sweep, without a GPU.

    python -m profiling.analysis.replay_auto [profiling/results/transfer.json] [--table kernels/default_calibration.json]
    python -m profiling.analysis.replay_auto profiling/results/host_order.json   # host ids random and sequential

For every (direction, block size, count) point of the sweep, asks the cost model what `auto`
would pick, idle and busy (random ids: no coalescing), and looks up what that method measured
at that point in the same run. Prints the points where the pick is more than 5% below the best
qualifying method (idle: dma, cuda, triton, staged; busy: dma, staged). This isolates the
model's decisions from auto's own host time, which the sweep's auto rows also include (sweeps
from 4361a1b on rate each call at bytes / max(device, host time); earlier ones timed each call
from an idle stream, host time added).
"""
from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

from kernels.cost_model import CostModel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
AVAILABLE = ("torch", "dma", "cuda", "staged", "triton")
QUALIFY = {False: ("dma", "cuda", "triton", "staged"), True: ("dma", "staged")}


def replay(sweep_rows: list, cm: CostModel) -> dict:
    """{busy: [(point, pick, share of best)]} for every point of the sweep. Rows of
    probe_host_order.py (GPU ids random, host ids random, sequential or sorted) are asked with
    the host-side run count they record (`host_runs`; rows before it: one for sequential);
    all others with none coalescing."""
    pts, hruns = defaultdict(dict), {}
    for r in sweep_rows:
        key = (r["dir"], r["block_bytes"], r["count"], r.get("host_ids", "random"))
        pts[key][r["method"]] = r["gbps"]
        hruns[key] = r.get("host_runs", 1 if key[3] == "sequential" else r["count"])
    out = {False: [], True: []}
    for (d, bb, n, ho), g in sorted(pts.items()):
        for busy in (False, True):
            pick = cm.choose(d, bb, n, busy, AVAILABLE, n_desc=n, n_desc_host=hruns[(d, bb, n, ho)])
            best = max(g[m] for m in QUALIFY[busy] if m in g)
            out[busy].append(((d, bb, n, ho), pick, g.get(pick, 0.0) / best))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sweep", nargs="?", default=os.path.join(ROOT, "profiling", "results", "transfer.json"))
    ap.add_argument("--table", default=os.path.join(ROOT, "kernels", "default_calibration.json"))
    a = ap.parse_args()
    doc = json.load(open(a.sweep))
    # a transfer sweep, or probe_host_order.py's rows (host ids random and sequential)
    rows = [r for r in doc["rows"] if r["section"] == "sweep"] or [r for r in doc["rows"] if r["section"] == "order"]
    res = replay(rows, CostModel(json.load(open(a.table))))
    print(f"{a.sweep} ({doc['meta']['git_sha']}), table {a.table}")
    for busy in (False, True):
        bad = [x for x in res[busy] if x[2] < 0.95]
        print(f"{'busy' if busy else 'idle'}: {len(res[busy]) - len(bad)}/{len(res[busy])} picks within 5% of the best")
        for (d, bb, n, ho), pick, share in bad:
            print(f"   {d} {bb:>9} B x {n:>7}{'' if ho == 'random' else ' host ' + ho}: picks {pick:<7} "
                  f"{share:6.1%} of the best")


if __name__ == "__main__":
    main()
