"""TTFT (the blog's Fig. 1): one request, recompute vs load-from-CPU, per transfer method.

    python -m profiling.bench.bench_ttft                      # Llama-3.1-8B shape on the GPU
    python -m profiling.bench.bench_ttft --tiny --lengths 64,128 --device cpu   # smoke run

For each prompt length: TTFT with recompute (cold engine), and TTFT after the
prompt's KV was stored to the host pool and the GPU copy dropped (loads with
each method). Reports the ratio and the load TTFT against its floor: KV bytes
over the same-run big H2D copy plus the forward of the one token left.
Writes ttft.json/.csv.
"""
from __future__ import annotations

import argparse
import gc
import time

import torch

from connector.engine import EngineConfig, LlamaConfig, LLMEngine
from profiling.common import nvtx_range, results_dir, write_rows
from profiling.analysis.plots import plot


def ttft(eng: LLMEngine, prompt: list) -> float:
    """Seconds from add_request to the first token (host clock after a device sync)."""
    if eng.cuda:
        torch.cuda.synchronize()
    gc.collect()  # the previous run's garbage is not this request's cost
    t0 = time.perf_counter()
    rid = eng.add_request(prompt, 1)
    while eng.seqs[rid].output == []:
        eng.step()
    if eng.cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    while eng.has_work():
        eng.step()
    eng.drain()
    return dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768,65536,102400")
    ap.add_argument("--methods", default="dma,cuda,triton,auto")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3, help="load runs per method and length (median)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.out = results_dir(a.out, smoke=a.tiny or a.device == "cpu")
    mcfg = LlamaConfig.tiny() if a.tiny else LlamaConfig.llama_3_1_8b()
    lengths = [int(x) for x in a.lengths.split(",")]
    bs = a.block_size
    blocks = max(lengths) // bs + 8
    ub = mcfg.kv_spec(bs).unified_block_bytes
    ref_h2d = None
    if a.device == "cuda":
        g = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        h = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        g.copy_(h, non_blocking=True)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(3):
            g.copy_(h, non_blocking=True)
        e1.record()
        e1.synchronize()
        ref_h2d = 3 * (1 << 30) / (e0.elapsed_time(e1) / 1e3)
        del g, h
    rows = []
    methods = a.methods.split(",")
    base = LLMEngine(EngineConfig(mcfg, block_size=bs, num_gpu_blocks=blocks, device=a.device))
    # one offloading engine for every method: its host pool is pinned once, and a prompt's KV is
    # computed and stored once per length, then loaded once per method
    off = LLMEngine(EngineConfig(mcfg, block_size=bs, num_gpu_blocks=blocks, offload_blocks=blocks,
                                 device=a.device, method="dma"), model=base.model)
    for i, L in enumerate([lengths[0]] + lengths):  # the first pass warms every path up and is dropped
        prompt = [(i * 7919) % (mcfg.vocab_size - 1) + 1 for i in range(L)]
        with nvtx_range(f"ttft recompute L={L}"):
            ttft(base, prompt[:bs])  # warm-up
            base.reset_prefix_cache()
            rec = ttft(base, prompt)
            # the compute the load path still does: the tokens after the last full block it
            # loads, attending over the whole prefix, here already in the GPU prefix cache
            # (two untimed runs first: the second captures this shape's CUDA graph, which
            # the load runs below replay as well)
            for _ in range(2):
                ttft(base, prompt)
            hit = sorted(ttft(base, prompt) for _ in range(3))[1]
            base.reset_prefix_cache()
        one = sorted(ttft(base, prompt[:1]) for _ in range(3))[1]  # forward of a 1-token prompt
        base.reset_prefix_cache()
        row = {"len": L, "recompute_s": rec, "one_token_s": one, "gpu_hit_s": hit}
        off.reset_offload()
        off.reset_prefix_cache()
        ttft(off, prompt)                           # computes and stores the prompt's KV
        for k, m in enumerate(methods):
            if off.cuda:
                off.worker.method = m
            off.reset_prefix_cache()                # drop the GPU copy
            ttft(off, prompt[:bs + 1])              # warm-up of this method (one block)
            # untimed full loads: the first two also capture this length's CUDA graph in the
            # offloading engine (else the first method's reps would include an eager forward
            # and the capture)
            for _ in range(2 if k == 0 else 1):
                off.reset_prefix_cache()
                ttft(off, prompt)
            runs = []
            for _ in range(a.reps):  # median of reps (each drops the GPU copy and loads again)
                off.reset_prefix_cache()
                loaded0 = off.stats["loaded_blocks"]
                ms0 = off.worker.stats["load_ms"] if off.cuda else 0.0
                with nvtx_range(f"ttft load {m} L={L}"):
                    t = ttft(off, prompt)
                n = off.stats["loaded_blocks"] - loaded0
                if n != (L - 1) // bs:
                    raise RuntimeError(f"L={L} {m}: loaded {n} blocks, expected {(L - 1) // bs}")
                # GPU time of the load job (its start to end event)
                runs.append((t, off.worker.stats["load_ms"] - ms0 if off.cuda else 0.0))
            t, job_ms = sorted(runs)[len(runs) // 2]
            if off.cuda:
                row[f"load_{m}_job_ms"] = job_ms
            row[f"load_{m}_s"] = t
            row[f"ratio_{m}"] = rec / t
            if ref_h2d:
                # floor: KV bytes at the big-copy rate + the remaining forward over the prefix;
                # floor1 (earlier definition): + the forward of a 1-token prompt instead
                floor, floor1 = n * ub / ref_h2d + hit, n * ub / ref_h2d + one
                row["floor_s"], row["floor1_s"] = floor, floor1
                row[f"load_{m}_over_floor"] = t / floor
                row[f"load_{m}_over_floor1"] = t / floor1
        if i == 0:
            continue
        rows.append(row)
        print(f"L={L:>6} recompute {rec * 1e3:9.1f} ms | " + " ".join(
            f"{m} {row[f'load_{m}_s'] * 1e3:8.1f} ms ({row[f'ratio_{m}']:5.1f}x, job "
            f"{row.get(f'load_{m}_job_ms', 0):6.1f})" for m in methods)
              + (f" | floor {row['floor_s'] * 1e3:.1f} ms (1-token {row['floor1_s'] * 1e3:.1f})" if ref_h2d else ""),
              flush=True)
    write_rows("ttft", rows, {"ref_h2d_gbps": ref_h2d / 1e9 if ref_h2d else None,
                              "model": "tiny" if a.tiny else "llama-3.1-8b"}, a.out)
    plot("ttft", a.out)


if __name__ == "__main__":
    main()
