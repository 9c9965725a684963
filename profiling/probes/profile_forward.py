"""Where a small engine forward spends its time (host launch vs GPU), Llama-3.1-8B layer shape.

    python -m profiling.probes.profile_forward --layers 8 --ctx 1024

Times three forwards with the prefix already in the GPU cache: a 1-token prompt, 16 new tokens
over `ctx` cached tokens (the TTFT load path) and one decode step. For each: host time of
`step()` until it returns, GPU time of the step (CUDA events), wall time to the first token.
Then prints a torch.profiler table of the 16-token forward (CPU and CUDA time per op).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from connector.engine import EngineConfig, LlamaConfig, LLMEngine


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    base = LlamaConfig.llama_3_1_8b()
    cfg = LlamaConfig(**{**base.__dict__, "layers": a.layers})
    eng = LLMEngine(EngineConfig(cfg, block_size=16, num_gpu_blocks=a.ctx // 16 + 64, device="cuda",
                                 attention=a.attention))
    prompt = [(i * 7919) % (cfg.vocab_size - 1) + 1 for i in range(a.ctx)]

    def first_token(p):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rid = eng.add_request(p, 1)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        th = time.perf_counter()
        while not eng.seqs[rid].output:
            eng.step()
        e1.record()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        while eng.has_work():
            eng.step()
        return (t1 - t0) * 1e3, e0.elapsed_time(e1)

    eng.generate([prompt], 1)
    for name, p in (("1-token prompt", prompt[:1]), (f"16 tokens over {a.ctx - 16} cached", prompt),
                    ("cold prefill", None)):
        for gc_on in (True, False):
            (gc.enable if gc_on else gc.disable)()
            ws, gs = [], []
            for _ in range(a.reps):
                if p is None:
                    eng.reset_prefix_cache()
                w, g = first_token(p if p is not None else prompt)
                ws.append(w)
                gs.append(g)
            print(f"{name:>30} gc={'on ' if gc_on else 'off'}: wall {statistics.median(ws):7.2f} ms "
                  f"(min {min(ws):6.2f} max {max(ws):6.2f}), GPU {statistics.median(gs):7.2f} ms", flush=True)
    gc.enable()
    from torch.profiler import ProfilerActivity, profile

    first_token(prompt)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        first_token(prompt)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
