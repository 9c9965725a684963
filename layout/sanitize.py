"""Pack/unpack kernels under compute-sanitizer (called from tests/sanitize_kernels.py)."""
import numpy as np
import torch

from .fragments import allocate
from .pack import KVBlockMover
from .spec import KVLayout, KVSpec


def run() -> int:
    bad = 0
    for spec, layout in ((KVSpec(3, 2, 64, 16, dtype=torch.float16), KVLayout.TWO_NB_BS_NH_HS),
                         (KVSpec(2, 2, 128, 16, head_size_v=64), KVLayout.NB_BS_NH_HS),
                         (KVSpec(2, 1, 576, 8, mla=True), KVLayout.NB_BS_HS),
                         (KVSpec(2, 3, 24, 5, dtype=torch.float16), KVLayout.NL_NH_NB_BS_C)):
        kv = allocate(spec, layout, 9, device="cuda", fill=lambda t: t.view(-1).view(torch.uint8).random_(1, 255))
        kv2 = allocate(spec, layout, 9, device="cuda", fill=lambda t: t.view(-1).view(torch.uint8).fill_(0))
        m, m2 = KVBlockMover(spec, layout, kv), KVBlockMover(spec, layout, kv2)
        host = torch.zeros(6, spec.unified_block_bytes, dtype=torch.uint8, pin_memory=True)
        ref = torch.zeros_like(host)
        b, s = np.array([8, 0, 4]), np.array([5, 1, 2])
        m.pack(b, host, s, method="cuda")
        m2.unpack(host, s, b, method="cuda")
        torch.cuda.synchronize()
        m.pack(b, ref, s, method="torch")
        back = torch.zeros_like(host)
        m2.pack(b, back, s, method="torch")
        ok = torch.equal(host, ref) and torch.equal(back, ref)
        bad += not ok
        print(f"pack/unpack {layout.value}: {'ok' if ok else 'MISMATCH'}")
    return bad
