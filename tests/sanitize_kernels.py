"""Small driver for compute-sanitizer (memcheck, racecheck) over the CUDA kernels.

    compute-sanitizer --tool memcheck python tests/sanitize_kernels.py
Exercises every vector width, every direction, tail chunks, the Triton copy launched from
C++ and the pack kernels;
exits non-zero on any mismatch.
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels import BlockCopier  # noqa: E402


def main():
    cp = BlockCopier("cuda", ring_slots=4, ring_capacity=256, staging_bytes=4 << 20)
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
            for variant in ("warp", "cta", "bulk"):
                cp.cuda_variant = variant
                cp.copy(src, dst, si, di, method="cuda")
            for _ in range(3):  # auto, idle: from the second call on, the fused check + launch
                cp.copy(src, dst, si, di, method="auto", busy=False)
            torch.cuda.synchronize()
            ok = torch.equal(dst.cpu()[torch.from_numpy(di)], src.cpu()[torch.from_numpy(si)])
            bad += not ok
            print(f"cuda {d} bb={bb}: {'ok' if ok else 'MISMATCH'}")
            dst.fill_(0xA5)
            for _ in range(2):  # triton: the second call launches the compiled kernel from C++
                cp.copy(src, dst, si, di, method="triton")
            torch.cuda.synchronize()
            ok = torch.equal(dst.cpu()[torch.from_numpy(di)], src.cpu()[torch.from_numpy(si)])
            bad += not ok
            print(f"triton {d} bb={bb}: {'ok' if ok else 'MISMATCH'}")
            if d != "d2d" and bb >= 16:  # staged: the int64-id kernel behind a GPU staging buffer
                dst.fill_(0xA5)
                cp.copy(src, dst, si, di, method="staged")
                torch.cuda.synchronize()
                ok = torch.equal(dst.cpu()[torch.from_numpy(di)], src.cpu()[torch.from_numpy(si)])
                bad += not ok
                print(f"staged {d} bb={bb}: {'ok' if ok else 'MISMATCH'}")
    try:
        from layout.sanitize import run as run_layout
        bad += run_layout()
    except ImportError:
        pass
    bad += engine_kernels()
    bad += worker_pack_jobs()
    return 1 if bad else 0


def worker_pack_jobs() -> int:
    """The transfer worker's per-layer fast paths, through the native submitter's thread
    (_C.pack_submit_native, the default) and inline (_C.pack_native: id staging, events and the
    pack kernel in one call): a store, then a load into a second cache, both exact."""
    return sum(_worker_pack_jobs(native, method) for native, method in ((True, "cuda"), (True, "staged"),
                                                                         (False, "cuda")))


def _worker_pack_jobs(native: bool, method: str) -> int:
    from connector import TransferWorker
    from layout import KVBlockMover, KVLayout, KVSpec, allocate

    spec = KVSpec(3, 2, 64, 16, dtype=torch.float16)
    kv = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, 9, device="cuda",
                  fill=lambda t: t.view(-1).view(torch.uint8).random_(1, 255))
    kv2 = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, 9, device="cuda",
                   fill=lambda t: t.view(-1).view(torch.uint8).fill_(0))
    m, m2 = KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv), KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv2)
    host = torch.zeros(6, spec.unified_block_bytes, dtype=torch.uint8, pin_memory=True)
    cp = m.copier  # the device's copier, shared: its staging size is put back at once
    old = cp.staging_bytes
    cp.staging_bytes = 2 * spec.unified_block_bytes  # staged: halves of one block, three chunks per job
    try:
        w = TransferWorker(m, host, method=method, native_submit=native)
        w2 = TransferWorker(m2, host, method=method, native_submit=native)
    finally:
        cp.staging_bytes = old
    key = f"{method}-native" if native else method
    b, s = np.array([8, 0, 4], np.int64), np.array([5, 1, 2], np.int64)
    w.submit_store(1, b, s)
    w.wait([1])
    w2.submit_load(2, s, b)
    w2.wait([2])
    ref, back = torch.zeros_like(host), torch.zeros_like(host)
    m.pack(b, ref, s, method="torch")
    m2.pack(b, back, s, method="torch")
    ok = (torch.equal(host, ref) and torch.equal(back, ref) and w.methods == {f"store:{key}": 1}
          and w2.methods == {f"load:{key}": 1} and all(r.ok for r in w.shutdown() + w2.shutdown()))
    print(f"worker {'pack_submit_native' if native else 'pack_native'} {method} store/load: {'ok' if ok else 'MISMATCH'}")
    return not ok


def engine_kernels() -> int:
    """The engine's Triton RoPE/cache-write and paged attention (split and unsplit)."""
    from connector.engine.attention import paged_attention, paged_meta, rope_store

    g = torch.Generator().manual_seed(0)
    bad = 0
    for lens, ctx in (([16], [1000]), ([1, 5, 2], [40, 5, 300])):
        KV, G, D, bs = 2, 4, 64, 16
        nb = sum(-(-c // bs) for c in ctx) + 2
        cache = torch.randn(nb, 2, bs, KV, D, generator=g).to("cuda")
        K, V = cache[:, 0], cache[:, 1]
        tables, used = [], 0
        for c in ctx:
            tables.append(list(range(used, used + -(-c // bs))))
            used += len(tables[-1])
        starts = [sum(lens[:i]) for i in range(len(lens))]
        T = sum(lens)
        qkv = torch.randn(T, (KV * G + 2 * KV) * D, generator=g).to("cuda")
        cos, sin = torch.rand(T, D // 2).cuda(), torch.rand(T, D // 2).cuda()
        blocks = torch.tensor([t[-1] for t, n in zip(tables, lens) for _ in range(n)], device="cuda")
        offs = torch.arange(T, device="cuda") % bs
        q = rope_store(qkv, cos, sin, K, V, blocks, offs, KV * G, KV, D)
        out = torch.full_like(q, float("nan"))
        meta = paged_meta(starts, lens, ctx, tables, G, KV, torch.device("cuda"))
        paged_attention(q, K, V, meta, out)
        torch.cuda.synchronize()
        ok = bool(torch.isfinite(out).all())
        bad += not ok
        print(f"engine attention lens={lens} splits={meta.splits}: {'ok' if ok else 'NaN'}")
    return bad


if __name__ == "__main__":
    sys.exit(main())
