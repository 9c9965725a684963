"""Layout benchmark: per-layer paged KV <-> unified host blocks, for the blog's model shapes.

    python -m profiling.bench.bench_layout [--out DIR] [--models a,b]

For each model (Llama-3.1-8B, Llama-3.2-1B, Llama-3.1-70B TP=4, DeepSeek-V2-Lite)
and direction, ~1 GiB of blocks with random GPU block ids and random host slots:
  dma-loop   per-fragment cudaMemcpyAsync (vLLM 0.11)
  dma        one cudaMemcpyBatchAsync of all fragments
  cuda       pack kernel straight to pinned host (UVA)
  triton     the same in Triton
  staged     pack to GPU staging, then DMA (pipelined)
  unified    DMA of already-unified blocks (UnifiedKVCache, block-outer layout)
and, in the same run, the big pinned copy references, the bidirectional unified
DMA, and the busy case: staged/cuda/unified beside a bf16 GEMM.
Writes layout.json/.csv/.png.
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import torch

from kernels import BlockCopier
from layout import MODELS, KVBlockMover, KVLayout, UnifiedKVCache, allocate
from profiling.common import (TIMING, ComputeLoad, big_copy_refs, cuda_ms, meta, nvtx_range,
                              on_two_streams, results_dir, write_rows)

GiB = 1 << 30
PER_LAYER = {"llama-3.1-8b": KVLayout.TWO_NB_BS_NH_HS, "llama-3.2-1b": KVLayout.TWO_NB_BS_NH_HS,
             "llama-3.1-70b-tp4": KVLayout.TWO_NB_BS_NH_HS, "deepseek-v2-lite": KVLayout.NB_BS_HS}
METHODS = ["dma-loop", "dma", "cuda", "triton", "staged", "unified"]


def refs(host):
    g = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
    r = big_copy_refs(g, host[: 2 * GiB])
    del g
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", default=",".join(PER_LAYER))
    ap.add_argument("--skip-busy", action="store_true")
    a = ap.parse_args()
    host = torch.empty(int(2.5 * GiB), dtype=torch.uint8, pin_memory=True)
    ref = refs(host)
    print(f"reference: D2H {ref['d2h']:.1f}  H2D {ref['h2d']:.1f}  both {ref['bidir']:.1f} GB/s "
          f"({torch.cuda.get_device_name()})", flush=True)
    rows = [{"section": "reference", "dir": k, "gbps": round(v, 2)} for k, v in ref.items()]
    rng = np.random.default_rng(0)
    cp = BlockCopier("cuda")
    load = None if a.skip_busy else ComputeLoad("gemm")
    for name in a.models.split(","):
        spec = MODELS[name]
        ub = spec.unified_block_bytes
        n = GiB // ub
        nb = 2 * n
        fill = lambda t: t.view(-1).view(torch.uint8).random_(1, 255)  # noqa: E731
        kv = allocate(spec, PER_LAYER[name], nb, device="cuda", fill=fill)
        mover = KVBlockMover(spec, PER_LAYER[name], kv, copier=cp)
        uni = UnifiedKVCache(spec, nb, device="cuda")
        uni.buffer.random_(1, 255)
        pool = host[: 2 * n * ub].view(2 * n, ub)
        blocks = rng.permutation(nb)[:n]
        slots = rng.permutation(2 * n)[:n]
        for d in ("d2h", "h2d"):
            line = []
            for m in METHODS:
                def run(stream=None, m=m):
                    if m == "unified":
                        if d == "d2h":
                            return cp.copy(uni.buffer, pool, blocks, slots, method="dma", stream=stream)
                        return cp.copy(pool, uni.buffer, slots, blocks, method="dma", stream=stream)
                    if d == "d2h":
                        return mover.pack(blocks, pool, slots, method=m, stream=stream)
                    return mover.unpack(pool, slots, blocks, method=m, stream=stream)
                with nvtx_range(f"layout {name} {d} {m}"):
                    ms = cuda_ms(run, 3, warmup=1)
                gbps = n * ub / ms / 1e6
                rows.append({"section": "move", "model": name, "dir": d, "method": m,
                             "fragment_bytes": spec.fragment_bytes, "unified_block_bytes": ub,
                             "blocks": n, "fragments": mover.table.num_fragments * n,
                             "gbps": round(gbps, 2), "of_ref": round(gbps / ref[d], 4)})
                line.append(f"{m}={gbps:5.1f}")
            print(f"{name:>18} {d} {n:>5} x {ub:>8} B ({mover.table.num_fragments} frags/block): "
                  + " ".join(line) + f" | ref {ref[d]:.1f}", flush=True)
        # bidirectional: unified DMA store and load in flight together, n blocks (1 GiB) each way
        # as the reference moves 1 GiB each way (half of that each way, before 95d8efe, let
        # the start and end of a short job weigh twice as much: DeepSeek-V2-Lite's 269 x 1.9 MB
        # read 87-99% in three runs); the store reads GPU blocks the load does not write
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        gperm, hperm = rng.permutation(nb), rng.permutation(2 * n)

        both = on_two_streams(
            lambda st: cp.copy(uni.buffer, pool, gperm[:n], hperm[:n], method="dma", stream=st),
            lambda st: cp.copy(pool, uni.buffer, hperm[n:], gperm[n:2 * n], method="dma", stream=st),
            (s1, s2))
        gbps = 2 * n * ub / cuda_ms(both, 7) / 1e6
        rows.append({"section": "bidir", "model": name, "method": "unified", "blocks_each_way": n, "gbps": round(gbps, 2),
                     "of_ref": round(gbps / ref["bidir"], 4)})
        print(f"{name:>18} bidir unified dma: {gbps:5.1f} GB/s = {gbps / ref['bidir']:.1%}", flush=True)
        if load is not None and name == "llama-3.1-8b":
            for d in ("d2h", "h2d"):
                for m in ("staged", "cuda", "auto-busy", "unified"):
                    def submit(stream, m=m, d=d):
                        if m == "unified":
                            if d == "d2h":
                                cp.copy(uni.buffer, pool, blocks, slots, method="dma", stream=stream)
                            else:
                                cp.copy(pool, uni.buffer, slots, blocks, method="dma", stream=stream)
                            return
                        kw = {"method": "auto", "busy": True} if m == "auto-busy" else {"method": m}
                        if d == "d2h":
                            mover.pack(blocks, pool, slots, stream=stream, **kw)
                        else:
                            mover.unpack(pool, slots, blocks, stream=stream, **kw)
                    window_ms = 1.6 * load.iters
                    per_copy = n * ub / (ref[d] * 1e6)
                    k = int(window_ms / per_copy * 1.3) + 2
                    with nvtx_range(f"layout busy {name} {d} {m}"):
                        slow, t_x, covered, base = load.measure(submit, k)
                    gbps = k * n * ub / t_x / 1e6
                    rows.append({"section": "busy", "model": name, "dir": d, "method": m,
                                 "gemm_slowdown": round(slow, 4), "gemm_alone_ms": round(base, 4),
                                 "gbps": round(gbps, 2), "of_ref": round(gbps / ref[d], 4),
                                 "copy_covered_window": covered})
                    print(f"{name:>18} busy {d} {m:>9}: GEMM {slow:+6.1%}  copy {gbps:5.1f} GB/s "
                          f"({gbps / ref[d]:.0%}){'' if covered else ' [copy ended early]'}", flush=True)
        del kv, mover, uni
        torch.cuda.empty_cache()
    out = results_dir(a.out)
    p = write_rows("layout", rows, {"reference_gbps": ref}, out, timing=TIMING)
    plot(rows, ref, os.path.join(os.path.dirname(p), "layout.png"))
    print(f"wrote {p}")


def plot(rows, ref, path, info=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from profiling.analysis.plots import save_png

    models = list(dict.fromkeys(r["model"] for r in rows if r.get("section") == "move"))
    fig, axes = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    for ax, d in zip(axes, ("d2h", "h2d")):
        x = np.arange(len(models))
        w = 0.8 / len(METHODS)
        for i, m in enumerate(METHODS):
            ys = [next((r["gbps"] for r in rows if r.get("section") == "move" and r["model"] == mo
                        and r["dir"] == d and r["method"] == m), 0) for mo in models]
            ax.bar(x + i * w, ys, w, label=m)
        ax.axhline(ref[d], color="k", lw=1, label=f"big copy {ref[d]:.1f}")
        ax.set_xticks(x + 0.4 - w / 2)
        ax.set_xticklabels(models, rotation=15, fontsize=8)
        ax.set_title(f"{'pack (GPU->host)' if d == 'd2h' else 'unpack (host->GPU)'}")
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=7)
    m = info or meta()
    fig.suptitle(f"per-layer KV <-> unified blocks on {m.get('gpu')} ({m['date']}, {m['git_sha'][:10]})")
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
