"""Profiles an end-to-end scenario: store a prompt's KV to the host, drop the GPU copy, load it back
and decode, with NVTX ranges on every stage (schedule, load/store submit, forward per layer, copies).

Under Nsight Systems (exact command, also in the README):
    NSYS=/opt/nvidia/nsight-compute/2025.3.1/host/target-linux-x64/nsys
    $NSYS profile -t cuda,nvtx --sample=none --cpuctxsw=none -o out/e2e --force-overwrite true \\
        python profiling/profile_e2e.py --model 8b
    $NSYS export --type sqlite -o out/e2e.sqlite out/e2e.nsys-rep
    python profiling/analyze_trace.py out/e2e.sqlite
Without nsys (detected from the environment), it records a torch.profiler trace
(out/e2e_torch.json) and analyzes it right away:
    python profiling/profile_e2e.py --model tiny --out out
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from connector.engine import EngineConfig, LlamaConfig, LLMEngine  # noqa: E402
from kernels._nvtx import nvtx_range  # noqa: E402
from profiling.analyze_trace import analyze, load_torch_json, report  # noqa: E402

MODELS = {"tiny": LlamaConfig.tiny, "1b": LlamaConfig.llama_3_2_1b, "8b": LlamaConfig.llama_3_1_8b}


def scenario(a) -> None:
    cfg = MODELS[a.model]()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    blocks = a.prompt_len // a.block_size * a.requests + 64
    eng = LLMEngine(EngineConfig(cfg, block_size=a.block_size, num_gpu_blocks=blocks, offload_blocks=blocks,
                                 layout=a.layout, method=a.method, device=dev))
    prompts = [[(i * 31 + r * 7) % (cfg.vocab_size - 1) + 1 for i in range(a.prompt_len)] for r in range(a.requests)]
    with nvtx_range(f"scenario store {a.model} L={a.prompt_len} R={a.requests}"):
        eng.generate(prompts, 1)
    eng.reset_prefix_cache()
    with nvtx_range(f"scenario load+decode {a.model} method={a.method}"):
        eng.generate(prompts, a.decode)
    print(eng.stats)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", choices=list(MODELS))
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layout", default="unified", choices=["unified", "per_layer"])
    ap.add_argument("--method", default="auto")
    ap.add_argument("--out", default="profile_out")
    a = ap.parse_args()
    if os.environ.get("NSYS_PROFILING_SESSION_ID") or os.environ.get("NSYS_LAUNCH_ID"):
        scenario(a)  # nsys records; export + analyze_trace.py afterwards
        return
    os.makedirs(a.out, exist_ok=True)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        scenario(a)
    path = os.path.join(a.out, "e2e_torch.json")
    prof.export_chrome_trace(path)
    print(f"wrote {path}")
    print(report(analyze(load_torch_json(path))))


if __name__ == "__main__":
    main()
