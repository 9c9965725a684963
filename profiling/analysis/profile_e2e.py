"""Profiles an end-to-end scenario: store a prompt's KV to the host, drop the GPU copy, load it back
and decode, with NVTX ranges on every stage (schedule, load/store submit, forward per layer, copies).

Run from the repository root. Under Nsight Systems (nsys from $NSYS, else from PATH):
    python -m profiling.analysis.profile_e2e --model 8b --nsys --out out
runs the scenario under `nsys profile -t cuda,nvtx`, exports out/e2e.sqlite, and writes the
analysis (profiling.analysis.analyze_trace) to out/e2e_analysis.json. By hand, the same:
    $NSYS profile -t cuda,nvtx --sample=none --cpuctxsw=none -o out/e2e --force-overwrite true \\
        python -m profiling.analysis.profile_e2e --model 8b
    $NSYS export --type sqlite -o out/e2e.sqlite out/e2e.nsys-rep
    python -m profiling.analysis.analyze_trace out/e2e.sqlite
Without --nsys and outside nsys (detected from the environment), it records a torch.profiler
trace (out/e2e_torch.json) and analyzes it right away (runs on CPU too):
    python -m profiling.analysis.profile_e2e --model tiny --out out
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import torch

from connector.engine import EngineConfig, LlamaConfig, LLMEngine
from kernels.tracing import nvtx_range
from profiling.analysis.analyze_trace import analyze, load_sqlite, load_torch_json, report

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


def find_nsys() -> str:
    """The Nsight Systems CLI: $NSYS if set, else `nsys` on PATH; a clear error otherwise."""
    p = os.environ.get("NSYS") or shutil.which("nsys")
    if not p or not os.access(p, os.X_OK):
        raise SystemExit(f"nsys (Nsight Systems CLI) not found{f' at NSYS={p}' if p else ' on PATH'}: install "
                         "Nsight Systems, or set NSYS=/path/to/nsys (CUDA toolkits and Nsight Compute bundles "
                         "ship one, e.g. under <nsight>/host/target-linux-x64/)")
    return p


def under_nsys(a, argv: list) -> None:
    """Re-runs this script (argv without --nsys) under `nsys profile`, exports the report to
    SQLite and writes analyze_trace's figures to <out>/e2e_analysis.json."""
    nsys = find_nsys()
    os.makedirs(a.out, exist_ok=True)
    rep = os.path.join(a.out, "e2e")
    subprocess.run([nsys, "profile", "-t", "cuda,nvtx", "--sample=none", "--cpuctxsw=none", "-o", rep,
                    "--force-overwrite", "true", sys.executable, "-m", "profiling.analysis.profile_e2e", *argv],
                   check=True)
    subprocess.run([nsys, "export", "--type", "sqlite", "--force-overwrite", "true", "-o", rep + ".sqlite",
                    rep + ".nsys-rep"], check=True)
    res = analyze(load_sqlite(rep + ".sqlite"))
    print(report(res))
    with open(os.path.join(a.out, "e2e_analysis.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {rep}.nsys-rep, {rep}.sqlite, {os.path.join(a.out, 'e2e_analysis.json')}")


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
    ap.add_argument("--nsys", action="store_true", help="run under Nsight Systems ($NSYS or nsys on PATH), "
                    "export and analyze the trace")
    a = ap.parse_args()
    if a.nsys:
        under_nsys(a, [x for x in sys.argv[1:] if x != "--nsys"])
        return
    if os.environ.get("NSYS_PROFILING_SESSION_ID") or os.environ.get("NSYS_LAUNCH_ID"):
        scenario(a)  # nsys records; export + analyze_trace afterwards
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
