"""python -m kernels [backends|demo|calibrate [--curves gbps,gbps_small,gbps_hostseq]] (see --help)"""
from __future__ import annotations

import argparse
import os
import sys


def report() -> None:
    from . import backends

    from . import tracing as _nvtx

    print("kvoffload backends:")
    for name, (ok, why) in backends().items():
        print(f"  {name:<7} {'yes' if ok else 'no ':<4} {why}")
    if _nvtx.BACKEND == "none":
        why = "no nvtx package and no CUDA torch.cuda.nvtx"
    elif _nvtx.TOOL:
        why = f"{_nvtx.BACKEND}; a tool is injected (NVTX_INJECTION64_PATH) or KVO_NVTX=1"
    else:
        why = (f"{_nvtx.BACKEND}, but no tool is injected (NVTX_INJECTION64_PATH unset; nsys and ncu set it): "
               "ranges go to a recording torch profiler only; KVO_NVTX=1 forces them")
    print(f"  {'nvtx':<7} {'yes' if _nvtx.TOOL else 'no ':<4} {why}")


def _median_ms(fn, reps=10):
    import numpy as np
    import torch

    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return float(np.median(ts))


def demo() -> int:
    import numpy as np
    import torch

    from . import BlockCopier

    report()
    rng = np.random.default_rng(0)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        print("\nno GPU here: running the CPU paths (torch reference, Triton interpreter) for "
              "correctness only; GB/s needs a GPU")
        copier = BlockCopier("cpu")
        nb, bb = 64, 4096
        src = torch.randint(1, 255, (nb, bb), dtype=torch.uint8)
        for m in copier.available_methods():
            dst = torch.zeros_like(src)
            ids = rng.permutation(nb)[:48]
            di = rng.permutation(nb)[:48]
            copier.copy(src, dst, ids, di, method=m)
            ok = torch.equal(dst[torch.from_numpy(di)], src[torch.from_numpy(ids)])
            print(f"  {m:<7} 48 blocks of {bb} B: {'exact' if ok else 'MISMATCH'}")
            if not ok:
                return 1
        return 0
    dev = torch.device("cuda")
    print(f"\nGPU: {torch.cuda.get_device_name(dev)}")
    big = 1 << 30
    g = torch.randint(0, 255, (big,), dtype=torch.uint8, device=dev)
    h = torch.empty(big, dtype=torch.uint8, pin_memory=True)
    ref = {"d2h": big / _median_ms(lambda: h.copy_(g, non_blocking=True)) / 1e6,
           "h2d": big / _median_ms(lambda: g.copy_(h, non_blocking=True)) / 1e6}
    print(f"big pinned copy (1 GiB): D2H {ref['d2h']:.1f} GB/s, H2D {ref['h2d']:.1f} GB/s")
    copier = BlockCopier(dev)
    print(f"{'block':>8} {'count':>6} {'dir':>4} {'method':>7} {'GB/s':>7} {'of ref':>7}")
    for bb, label in ((32768, "32 KiB (8B per-layer fragment)"), (2 << 20, "2 MiB (8B unified block)")):
        nbuf = big // bb
        gv, hv = g.view(nbuf, bb), h.view(nbuf, bb)
        n = min(nbuf, (256 << 20) // bb)
        si, di = rng.permutation(nbuf)[:n], rng.permutation(nbuf)[:n]
        for d, (s, t) in (("d2h", (gv, hv)), ("h2d", (hv, gv))):
            for m in ("dma", "cuda", "triton", "auto"):
                if m != "auto" and m not in copier.available_methods():
                    continue
                ms = _median_ms(lambda: copier.copy(s, t, si, di, method=m, busy=False))
                gbps = n * bb / ms / 1e6
                used = copier.last_method
                print(f"{bb:>8} {n:>6} {d:>4} {m if m != 'auto' else 'auto:' + used:>7} "
                      f"{gbps:7.1f} {gbps / ref[d]:6.1%}")
        print(f"  ({label})")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kernels", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="kvoffload transfer core: block copies between GPU memory and pinned host memory.",
        epilog="commands:\n"
               "  backends   (default) which copy methods work in this process, and why not\n"
               "  demo       copy KV blocks with each method and print GB/s (GPU); on a CPU box, check\n"
               "             the CPU paths (torch, Triton interpreter) for exactness\n"
               "  calibrate  measure the cost model behind method='auto' on this GPU and cache it in\n"
               "             ~/.cache/kvoffload (KVO_CACHE_DIR); needs a CUDA GPU and kernels._C")
    ap.add_argument("cmd", nargs="?", default="backends", choices=["backends", "demo", "calibrate"],
                    help="what to run (see commands below)")
    ap.add_argument("--curves", default=None,
                    help="calibrate: comma list of curves to measure (gbps, gbps_small, gbps_hostseq); "
                         "the others are kept from this GPU's current table (cached, else the default)")
    a = ap.parse_args(argv)
    if a.cmd == "backends":
        report()
        return 0
    if a.cmd == "demo":
        return demo()
    from .calibration import CURVES, calibrate
    from .cost_model import load_cost_model
    from .plan import KVOffloadError

    try:
        return _calibrate(a, ap, CURVES, calibrate, load_cost_model)
    except KVOffloadError as e:
        print(f"python -m kernels calibrate: {e}", file=sys.stderr)
        return 2


def _calibrate(a, ap, CURVES, calibrate, load_cost_model) -> int:
    if a.curves is None:
        calibrate()
        return 0
    curves = [c.strip() for c in a.curves.split(",") if c.strip()]
    bad = sorted(set(curves) - set(CURVES))
    if bad:
        ap.error(f"unknown curves {bad}; known: {', '.join(CURVES)}")
    import torch

    calibrate(curves=curves, base=load_cost_model(torch.device("cuda")).table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
