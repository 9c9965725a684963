"""Small driver for compute-sanitizer (memcheck, racecheck) over the CUDA kernels.

    compute-sanitizer --tool memcheck python tests/sanitize_kernels.py
Exercises every vector width, every direction, tail chunks and the pack kernels;
exits non-zero on any mismatch.
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels import BlockCopier  # noqa: E402


def main():
    cp = BlockCopier("cuda", ring_slots=4, ring_capacity=256)
    rng = np.random.default_rng(0)
    bad = 0
    for bb in (1, 2, 4, 8, 16, 48, 4100, 65536):
        for d in ("d2h", "h2d", "d2d"):
            nb = 37
            g = torch.randint(1, 255, (nb * bb,), dtype=torch.uint8, device="cuda").view(nb, bb)
            other = torch.full((nb * bb,), 0xA5, dtype=torch.uint8,
                               device="cuda" if d == "d2d" else "cpu")
            if d != "d2d":
                other = other.pin_memory()
            other = other.view(nb, bb)
            src, dst = (g, other) if d != "h2d" else (other, g)
            if d == "h2d":
                other.copy_(torch.randint(1, 255, other.shape, dtype=torch.uint8))
                g.fill_(0xA5)
            si, di = rng.permutation(nb)[:29], rng.permutation(nb)[:29]
            for variant in ("warp", "cta"):
                cp.cuda_variant = variant
                cp.copy(src, dst, si, di, method="cuda")
            torch.cuda.synchronize()
            ok = torch.equal(dst.cpu()[torch.from_numpy(di)], src.cpu()[torch.from_numpy(si)])
            bad += not ok
            print(f"cuda {d} bb={bb}: {'ok' if ok else 'MISMATCH'}")
    try:
        from layout.sanitize import run as run_layout
        bad += run_layout()
    except ImportError:
        pass
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
