"""Two questions the transfer sweep leaves open, measured in one run.

    python -m profiling.probes.probe_host_order [--out DIR] [--skip order,clocks]

order   Does the order of the *host-side* block ids change the rate? 1 GiB in blocks of
        4 KiB .. 2 MiB, GPU ids always random, host ids random (as the sweep), sequential
        (as a block pool hands out a request's blocks) or sorted (the sweep's random slots in
        ascending order, as a planner that sorted a job's pairs by host address would issue
        them: does ascending order alone recover DMA's rate, or only contiguity?), per method
        and direction (--host-orders picks among them). The
        interference sweep saw DMA of 32 KiB blocks at 60-66% of the big copy with random
        host ids and 88-97% with sequential ones: DMA's rate depends on more than its
        descriptor size.
clocks  Is a GEMM's slowdown beside a big DMA a clock (power) effect, and does it depend on
        the DMA's piece size? A bf16 8192^3 GEMM window alone and beside DMA of random blocks
        of 32 KiB .. 2 MiB (and 32 KiB with sequential host ids), with `nvidia-smi -lms 20`
        sampling the SM clock, power and temperature; each window's mean is reported.

Rates are bytes over the slower of device time (CUDA events, median, methods in turns) and
host submit time, as in bench_transfer's sweep. Writes host_order.json/.csv (+ .png).
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import subprocess
import tempfile
import time

import numpy as np
import torch

from kernels import BlockCopier
from profiling.common import ComputeLoad, big_copy_refs, cuda_ms_round_robin, results_dir, write_rows

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
METHODS = ("dma", "cuda", "triton", "staged")


HOST_ORDERS = ("random", "sequential", "sorted")


def host_ids(order: str, nbuf: int, n: int, rng) -> np.ndarray:
    """n host block ids out of nbuf: random (a random subset in random order), sorted (a
    random subset, ascending) or sequential (n consecutive ids)."""
    if order == "sequential":
        return np.arange(n, dtype=np.int64) + 3
    ids = rng.permutation(nbuf)[:n]
    return np.sort(ids) if order == "sorted" else ids


def runs(ids: np.ndarray) -> int:
    """Runs of consecutive ids (what the DMA planner coalesces on that side)."""
    return int(np.count_nonzero(np.diff(ids) != 1)) + 1 if ids.size else 0


def order(cp, g, h, ref, rows, orders=HOST_ORDERS[:2]):
    rng = np.random.default_rng(1)
    for bb in (4 * KiB, 32 * KiB, 256 * KiB, 2 * MiB):
        nbuf = (2 * GiB) // bb
        gv, hv = g[: nbuf * bb].view(nbuf, bb), h[: nbuf * bb].view(nbuf, bb)
        n = GiB // bb
        gi = rng.permutation(nbuf)[:n]
        for d in ("d2h", "h2d"):
            fns, hruns = {}, {}
            for ho in orders:
                hi = host_ids(ho, nbuf, n, rng)
                hruns[ho] = runs(hi)
                s, t, si, di = (gv, hv, gi, hi) if d == "d2h" else (hv, gv, hi, gi)
                for m in METHODS:
                    fns[(ho, m)] = (lambda s=s, t=t, si=si, di=di, m=m: cp.copy(s, t, si, di, method=m))
            hms: dict = {}
            ms = cuda_ms_round_robin(fns, 5, warmup=1, host_ms=hms, idle_every=1)
            line = []
            for (ho, m), v in ms.items():
                gbps = n * bb / max(v, hms[(ho, m)]) / 1e6
                rows.append({"section": "order", "dir": d, "block_bytes": bb, "count": n, "host_ids": ho,
                             "host_runs": hruns[ho], "method": m, "gbps": round(gbps, 2), "of_ref": round(gbps / ref[d], 4),
                             "device_gbps": round(n * bb / v / 1e6, 2), "host_ms": round(hms[(ho, m)], 3)})
                line.append(f"{ho[:3]}:{m}={gbps:5.1f}")
            print(f"order {d} {bb:>8} B x {n:>6}: " + " ".join(line) + f" | ref {ref[d]:.1f}", flush=True)


class Smi:
    """nvidia-smi sampling the SM clock, power and temperature every 20 ms into a file, and
    where this nvidia-smi knows them the enforced power limit and the active clock event
    reasons (why the clock is below its maximum: a power cap, a thermal or hardware slowdown)."""

    BASE = "timestamp,clocks.sm,power.draw,temperature.gpu"
    EXTRA = ",enforced.power.limit,clocks_event_reasons.active"
    # clocks_event_reasons bits (nvidia-smi --help-query-gpu)
    SW_POWER_CAP, HW_SLOWDOWN, SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE = 0x4, 0x8, 0x20, 0x40, 0x80

    def __init__(self):
        probe = subprocess.run(["nvidia-smi", f"--query-gpu={self.BASE + self.EXTRA}", "--format=csv,noheader"],
                               capture_output=True, text=True)
        self.fields = self.BASE + (self.EXTRA if probe.returncode == 0 else "")
        self.f = tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False)
        self.path = self.f.name
        self.p = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.fields}", "--format=csv,noheader,nounits",
                                   "-lms", "20"], stdout=self.f, stderr=subprocess.DEVNULL)
        time.sleep(0.5)

    def stop(self):
        """Samples as (time s, SM MHz, W, C, power limit W or None, reasons bitmask or None)."""
        self.p.terminate()
        self.p.wait()
        self.f.close()
        with open(self.path) as f:
            lines = f.readlines()
        os.unlink(self.path)
        return [s for s in (parse_sample(ln) for ln in lines) if s is not None]


def parse_sample(line: str):
    """One nvidia-smi csv line (Smi's fields) -> a sample tuple, or None if it does not parse."""
    parts = [x.strip() for x in line.split(",")]
    try:
        ts = dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        base = (ts, float(parts[1]), float(parts[2]), float(parts[3]))
    except (ValueError, IndexError):
        return None
    try:
        return base + (float(parts[4]), int(parts[5], 16))
    except (ValueError, IndexError):
        return base + (None, None)


def window_stats(samples, t0, t1):
    inside = [s for s in samples if t0 <= s[0] <= t1]
    if not inside:
        return None
    out = {"sm_mhz": round(statistics.mean(s[1] for s in inside), 1),
           "power_w": round(statistics.mean(s[2] for s in inside), 1),
           "temp_c": round(statistics.mean(s[3] for s in inside), 1), "samples": len(inside)}
    rs = [s for s in inside if len(s) > 5 and s[5] is not None]
    if rs:  # share of the window's samples with each clock event reason active
        out["power_limit_w"] = round(statistics.mean(s[4] for s in rs), 1)
        for k, bits in (("sw_power_cap", Smi.SW_POWER_CAP), ("thermal", Smi.SW_THERMAL | Smi.HW_THERMAL),
                        ("hw_slowdown", Smi.HW_SLOWDOWN | Smi.HW_POWER_BRAKE)):
            out[f"{k}_frac"] = round(sum(1 for s in rs if s[5] & bits) / len(rs), 3)
    return out


def clocks(cp, g, h, ref, rows, only=None):
    """only: (block bytes, host ids) pairs to run, default all."""
    load = ComputeLoad("gemm")
    rng = np.random.default_rng(2)
    cases = []
    # descriptor size: is a big DMA piece itself what slows the GEMM (same bytes/s in smaller pieces)?
    for bb, ho in ((2 * MiB, "random"), (1 * MiB, "random"), (512 * KiB, "random"), (256 * KiB, "random"),
                   (128 * KiB, "random"), (64 * KiB, "random"), (32 * KiB, "sequential"), (32 * KiB, "random")):
        nbuf = (2 * GiB) // bb
        gv, hv = g[: nbuf * bb].view(nbuf, bb), h[: nbuf * bb].view(nbuf, bb)
        n = (512 * MiB) // bb
        gi = rng.permutation(nbuf)[:n]
        hi = rng.permutation(nbuf)[:n] if ho == "random" else np.arange(n, dtype=np.int64) + 3
        for d in ("d2h", "h2d"):
            if only and (bb, ho) not in only:
                continue
            s, t, si, di = (gv, hv, gi, hi) if d == "d2h" else (hv, gv, hi, gi)
            cases.append((d, bb, ho, n, lambda st, s=s, t=t, si=si, di=di: cp.copy(s, t, si, di, method="dma",
                                                                                   stream=st)))
    smi = Smi()
    spans = []  # (label, t0, t1, ms per GEMM, copy GB/s or None)
    try:
        for d, bb, ho, n, submit in cases:
            n_copies = int(1.6 * load.iters / (n * bb / (ref[d] * 1e6)) * 1.3) + 2
            for rep in range(3):
                t0 = time.time()
                a = load.window()
                spans.append((("alone", d, bb, ho, rep), t0, time.time(), a, None))
                t0 = time.time()
                tc, tx, covered = load._measure_once(submit, n_copies)
                spans.append((("beside", d, bb, ho, rep), t0, time.time(), tc, n_copies * n * bb / tx / 1e6))
        t0 = time.time()
        a = load.window()
        spans.append((("alone", "end", 0, "-", 0), t0, time.time(), a, None))
    finally:
        samples = smi.stop()
    for (kind, d, bb, ho, rep), t0, t1, ms, gbps in spans:
        st = window_stats(samples, t0, t1) or {}
        rows.append({"section": "clocks", "window": kind, "dir": d, "block_bytes": bb, "host_ids": ho,
                     "rep": rep, "gemm_ms": round(ms, 4), "copy_gbps": None if gbps is None else round(gbps, 2),
                     **st})
        print(f"clocks {kind:>6} {d:>3} {bb:>8} {ho:>10} #{rep}: GEMM {ms:6.3f} ms  "
              f"{'' if gbps is None else f'copy {gbps:5.1f} GB/s  '}"
              f"SM {st.get('sm_mhz', float('nan')):6.0f} MHz  {st.get('power_w', float('nan')):5.0f} W  "
              f"{st.get('temp_c', float('nan')):3.0f} C ({st.get('samples', 0)} samples)"
              + (f"  limit {st['power_limit_w']:.0f} W, power cap {st['sw_power_cap_frac']:.0%} thermal "
                 f"{st['thermal_frac']:.0%} hw {st['hw_slowdown_frac']:.0%} of samples" if "power_limit_w" in st else ""),
              flush=True)


def plot(rows, ref, path, info):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from profiling.analysis.plots import save_png

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, d in zip(axes[:2], ("d2h", "h2d")):
        for m in METHODS:
            for ho, ls in (("random", "--"), ("sequential", "-"), ("sorted", ":")):
                rs = [r for r in rows if r["section"] == "order" and r["dir"] == d and r["method"] == m
                      and r["host_ids"] == ho]
                if rs:
                    ax.plot([r["block_bytes"] for r in rs], [r["gbps"] for r in rs], ls=ls, marker="o",
                            label=f"{m}, host {ho}")
        ax.axhline(ref[d], color="k", lw=1, label=f"big copy {ref[d]:.1f}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block bytes (1 GiB, GPU ids random)")
        ax.set_ylabel("GB/s")
        ax.set_title(d.upper())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    ax = axes[2]
    cr = [r for r in rows if r["section"] == "clocks" and "sm_mhz" in r]
    for kind, mk in (("alone", "o"), ("beside", "x")):
        rs = [r for r in cr if r["window"] == kind]
        ax.scatter([r["sm_mhz"] for r in rs], [r["gemm_ms"] for r in rs], marker=mk, label=f"GEMM {kind} DMA")
    ax.set_xlabel("mean SM clock in the window (MHz)")
    ax.set_ylabel("ms per 8192^3 bf16 GEMM")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(f"host-side id order and GEMM clocks, {info.get('gpu')} ({info['date']}, {info['git_sha'][:10]})")
    fig.tight_layout()
    save_png(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip", default="")
    ap.add_argument("--name", default="host_order", help="results file stem")
    ap.add_argument("--host-orders", default=",".join(HOST_ORDERS),
                    help=f"order section: host id orders among {', '.join(HOST_ORDERS)}")
    ap.add_argument("--clock-cases", default="",
                    help="clocks section: only these BYTES:HOSTIDS cases, e.g. 2097152:random,32768:sequential")
    a = ap.parse_args()
    a.out = results_dir(a.out)
    orders = tuple(a.host_orders.split(","))
    if set(orders) - set(HOST_ORDERS):
        raise SystemExit(f"--host-orders: choose among {', '.join(HOST_ORDERS)}")
    g = torch.randint(1, 255, (2 * GiB,), dtype=torch.uint8, device="cuda")
    h = torch.empty(2 * GiB, dtype=torch.uint8, pin_memory=True)
    h.copy_(g)
    detail: dict = {}
    ref = big_copy_refs(g, h, detail=detail)
    print(f"reference: D2H {ref['d2h']:.1f} H2D {ref['h2d']:.1f} both {ref['bidir']:.1f} GB/s "
          f"({torch.cuda.get_device_name()})", flush=True)
    cp = BlockCopier("cuda")
    rows = [{"section": "reference", "dir": k, "gbps": round(v, 2)} for k, v in ref.items()]
    skip = set(a.skip.split(","))
    extra = {"reference_gbps": ref, "reference_detail": detail}
    p = None
    only = {(int(b), ho) for b, ho in (c.split(":") for c in a.clock_cases.split(","))} if a.clock_cases else None
    for name, fn in (("order", lambda *x: order(*x, orders=orders)), ("clocks", lambda *x: clocks(*x, only=only))):
        if name not in skip:
            fn(cp, g, h, ref, rows)
            p = write_rows(a.name, rows, extra, a.out)
    if p:
        import json

        plot(rows, ref, p.replace(".json", ".png"), json.load(open(p))["meta"])
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
