"""Throughput (the blog's Fig. 2, and Fig. 6 with --fig6): unique requests of 512 prompt tokens,
one output token each, at CPU hit rates 0..100%, with and without offloading.

    python -m profiling.bench.bench_throughput                         # Llama-3.1-8B shape, GPU
    python -m profiling.bench.bench_throughput --fig6                  # Llama-3.2-1B: dma vs cuda vs auto
    python -m profiling.bench.bench_throughput --tiny --device cpu --requests 24 --rates 0,50,100   # smoke

A hit rate p means the first p% of the requests were computed and stored to
the host pool beforehand (not timed), and the GPU prefix cache was dropped.
The blog used 10,000 requests; the host pool must hold p% of all their KV
(2 MiB per 16-token block for the 8B shape: 671 GB for 10,000), more than a 128 GiB
host. `--window W` runs the requests in consecutive windows of W: each window's hits
are stored (not timed) and the window then runs timed, so the pool holds one window;
tokens/s is all tokens over the summed timed runs. The no-offload run uses the same
windows, so both pay the same drain at each window's end. Example, 10,000 requests:

    python -m profiling.bench.bench_throughput --requests 10000 --window 1000 --max-seqs 64

Reports prompt tokens/s and KV GB/s loaded. Writes throughput.json/.csv.
"""
from __future__ import annotations

import argparse
import gc
import os
import time

import torch

from connector.engine import EngineConfig, LlamaConfig, LLMEngine, block_hashes
from profiling.common import StackSampler, nvtx_range, results_dir, write_rows
from profiling.analysis.plots import plot


def run(eng: LLMEngine, prompts: list) -> float:
    # the previous run's garbage is not this run's cost (as bench_ttft): stack-sampled Fig. 6
    # runs spent 11-13 ms in collections, and 42-66 ms in two slow ones (714483a)
    gc.collect()
    if eng.cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.generate(prompts, 1)
    if eng.cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def mark_stored(eng: LLMEngine, prompts: list) -> None:
    """--synthetic-hits: registers the prompts' full blocks as stored in the host pool, without
    computing or writing them; their slots come from the pool's free list as a real store's do
    (in prompt order; a real warm-up stores in the order its steps finish the blocks). The
    timed run then loads as many blocks, of the same size, as after a real warm-up; the bytes
    are whatever those slots held, so the hits' generated tokens are meaningless, but no
    path's speed depends on the values (copies move bytes, attention's work does not vary
    with them). It saves the forward passes over the hits (137 s per 10,000 x 512 tokens of
    the 8B shape, as long as the no-offload run) that the warm-up otherwise costs."""
    bs = eng.cfg.block_size
    plan = eng.bm.prepare_store([h for pr in prompts for h in block_hashes(pr, bs)])
    eng.bm.complete_store(plan.hashes, True)


def windows(prompts: list, w: int) -> list:
    return [prompts[i:i + w] for i in range(0, len(prompts), w)]


def _snapshot(eng: LLMEngine) -> dict:
    """Counters that explain a run: steps, forwards, host time per phase, the worker's GPU
    milliseconds per direction and the methods `auto` resolved to, graph replays."""
    if eng.cuda:
        eng.forward_gpu_ms()  # folds the GPU time of finished forwards into eng.timing
    out = {k: eng.stats[k] for k in ("steps", "forwards", "forward_seqs", "stored_blocks")}
    out.update({f"host_{k}_s": v for k, v in eng.timing.items()})
    w = getattr(eng, "worker", None)
    if w is not None:
        out.update({k: w.stats[k] for k in ("load_ms", "store_ms", "failed_jobs")})
        out.update({f"jobs[{k}]": v for k, v in w.methods.items()})
    if eng.graphs is not None:
        out.update({f"graph_{k}": v for k, v in eng.graphs.stats.items()})
    return out


def _diff(a: dict, b: dict) -> dict:
    return {k: round(v - b.get(k, 0), 4) for k, v in a.items() if v != b.get(k, 0)}


def _fmt(d: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in d.items())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--fig6", action="store_true", help="Llama-3.2-1B, methods dma,cuda,auto")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rates", default="0,10,20,30,40,50,60,70,80,90,100")
    ap.add_argument("--methods", default=None)
    ap.add_argument("--gpu-blocks", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--max-seqs", type=int, default=256, help="requests running or loading at once (vLLM: 256)")
    ap.add_argument("--native-submit", action="store_true", help="DMA jobs from the C++ submit thread")
    ap.add_argument("--cuda-graph-seqs", type=int, default=1, help="largest batch replayed as a CUDA graph")
    ap.add_argument("--repeat", type=int, default=3,
                    help="0%%-hit runs, alternated with no-offload runs, compared by median")
    ap.add_argument("--repeat-hits", type=int, default=1,
                    help="runs per hit rate above 0%%, compared by median (short runs vary by ~20%%)")
    ap.add_argument("--sequential", action="store_true",
                    help="run the methods one after another instead of alternating them at each hit rate")
    ap.add_argument("--window", type=int, default=0,
                    help="run the requests in windows of this many (0: one window); the host pool holds one window")
    ap.add_argument("--sample-stacks", action="store_true",
                    help="sample the host thread's stack every 2 ms during timed runs; each row gets the "
                         "top frames per sample run (diag_stacks) and every run's seconds (samples_s)")
    ap.add_argument("--no-freeze-gc", dest="freeze_gc", action="store_false",
                    help="no gc.freeze() after the warm-ups (the engine still freezes at start-up)")
    ap.add_argument("--warm-each-run", action="store_true",
                    help="compute and store the hits again before every repeat (default: once per hit rate, "
                         "then restore the pool's bookkeeping)")
    ap.add_argument("--synthetic-hits", action="store_true",
                    help="register the hits as stored without computing them (see mark_stored): for "
                         "--requests 10000, whose warm-ups would cost as much device time as the runs")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false",
                    help="skip the no-offload run (rows get no speedup): for a run split over device calls "
                         "whose other part measured it; hit rate 0 needs it")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.out = results_dir(a.out, smoke=a.tiny or a.device == "cpu")
    mcfg = LlamaConfig.tiny() if a.tiny else (LlamaConfig.llama_3_2_1b() if a.fig6 else LlamaConfig.llama_3_1_8b())
    methods = (a.methods or ("dma,cuda,auto" if a.fig6 else "auto")).split(",")
    bs, L, R = a.block_size, a.prompt_len, a.requests
    W = a.window if 0 < a.window < R else R
    prompts = [[(r * 100003 + i * 7919) % (mcfg.vocab_size - 1) + 1 for i in range(L)] for r in range(R)]
    ub = mcfg.kv_spec(bs).unified_block_bytes
    common = dict(block_size=bs, num_gpu_blocks=a.gpu_blocks, device=a.device, max_batch_tokens=a.max_batch_tokens,
                  max_seqs=a.max_seqs, cuda_graph_seqs=a.cuda_graph_seqs, time_forwards=True)
    ref_h2d = None
    if a.device == "cuda":  # same-run physical limit: a big pinned H2D copy (median of 3)
        g = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        h = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        ts = []
        for _ in range(4):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.copy_(h, non_blocking=True)
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1))
        ref_h2d = (1 << 30) / (sorted(ts[1:])[1] / 1e3) / 1e9
        del g, h
        print(f"reference: big pinned H2D copy {ref_h2d:.1f} GB/s", flush=True)
    base = LLMEngine(EngineConfig(mcfg, **common))
    run(base, prompts[: min(R, 8)])  # warm-up
    base.reset_prefix_cache()

    diag_none = []

    def run_none() -> float:
        snap = _snapshot(base)
        t = 0.0
        for win in windows(prompts, W):
            base.reset_prefix_cache()
            with nvtx_range("throughput no-offload"):
                t += run(base, win)
        diag_none.append(_diff(_snapshot(base), snap))
        return t

    def run_offload(eng: LLMEngine, p: int, m: str) -> tuple:
        """Timed seconds and blocks loaded for all windows at hit rate p."""
        t, nload = 0.0, 0
        for wi, win in enumerate(windows(prompts, W)):
            key = (m, p, wi)
            if key in warm_state:       # a repeat: the same stored set, back without recomputing it
                eng.restore_offload(warm_state[key])
            else:
                eng.reset_offload()
                eng.reset_prefix_cache()    # else the warm-up would hit the previous run's GPU blocks
                warm = win[: len(win) * p // 100]
                if warm and a.synthetic_hits:
                    mark_stored(eng, warm)
                elif warm:
                    eng.generate(warm, 1)   # computes and stores their KV (not timed)
                    eng.drain()
                if not a.warm_each_run and W == R:  # one window: later windows reset the pool
                    warm_state[key] = eng.offload_state()
            eng.reset_prefix_cache()
            loaded0 = eng.stats["loaded_blocks"]
            with nvtx_range(f"throughput {m} hit={p}%"):
                if a.sample_stacks:
                    steps: list = []
                    step = eng.step

                    def timed_step():  # each step's wall time: stalls show as outliers
                        t0 = time.perf_counter()
                        step()
                        steps.append(time.perf_counter() - t0)
                    eng.step = timed_step
                    try:
                        with StackSampler() as smp:
                            t += run(eng, win)
                    finally:
                        del eng.step  # back to the class's method
                    steps.sort()
                    stacks.setdefault((m, p), []).append(
                        {**smp.summary(), "steps": len(steps),
                         "step_ms_median": round(steps[len(steps) // 2] * 1e3, 2) if steps else None,
                         "step_ms_longest": [round(x * 1e3, 1) for x in steps[-5:]]})
                else:
                    t += run(eng, win)
            nload += eng.stats["loaded_blocks"] - loaded0
        return t, nload

    stacks: dict = {}
    # (method, hit rate, window) -> the host pool's bookkeeping right after the warm-up stores:
    # repeats restore it (LLMEngine.restore_offload) instead of computing and storing the hits
    # again, which took as long as the timed run itself
    warm_state: dict = {}

    def freeze_heap() -> None:
        # As vLLM's EngineCore does after its warm-up (vllm.utils.gc_utils.freeze_gc_heap): the
        # objects alive now (model, engines, pools, the prompts) move to the permanent generation,
        # so a collection inside a timed run no longer walks them. Every mode alike; untimed.
        if a.freeze_gc:
            gc.collect()
            gc.freeze()

    rates = [int(x) for x in a.rates.split(",")]
    if not a.baseline and 0 in rates:
        raise SystemExit("--no-baseline: hit rate 0 is compared with the no-offload run; drop 0 from --rates")
    freeze_heap()
    t_nones = [run_none()] if a.baseline else []
    if a.baseline:
        print(f"no offload: {R * L / t_nones[0]:,.0f} prompt tokens/s ({R} x {L}"
              f"{f', in windows of {W}' if W < R else ''})", flush=True)
        print(f"      {_fmt(diag_none[0])}", flush=True)
    rows = []
    pool_blocks = W * (L // bs) + 64

    def make_engine(m: str) -> LLMEngine:
        # one engine per method; its host pool is pinned once and emptied before each hit rate
        eng = LLMEngine(EngineConfig(mcfg, offload_blocks=pool_blocks, method=m, native_submit=a.native_submit,
                                     **common), model=base.model)
        # untimed warm-up of the offload path: stores, then loads of the same prompts
        k = min(W, 2 * a.max_seqs)  # what one window's pool holds
        eng.generate(prompts[:k], 1)
        eng.drain()
        eng.reset_prefix_cache()
        eng.generate(prompts[:k], 1)
        return eng

    def measure(engines: dict, p: int) -> None:
        """Every method at hit rate p. With several engines the runs alternate between
        methods (GPU clocks drift over minutes: methods run one after another were compared
        at different clocks), and each method's median is reported."""
        ts_by = {m: [] for m in engines}
        diags, nloads = {}, {}
        for m, eng in engines.items():
            snap = _snapshot(eng)
            t, nloads[m] = run_offload(eng, p, m)
            diags[m] = _diff(_snapshot(eng), snap)
            ts_by[m].append(t)
        extra = (a.repeat - 1) if p == 0 else (a.repeat_hits - 1)
        for _ in range(max(0, extra)):
            if p == 0:  # the 2% target: alternate with no-offload runs and compare medians
                t_nones.append(run_none())
            for m, eng in engines.items():
                t2, nl2 = run_offload(eng, p, m)
                ts_by[m].append(t2)
                if nl2 != nloads[m]:
                    raise RuntimeError(f"{m} hit {p}%: runs loaded {nloads[m]} and {nl2} blocks")
        warm_state.clear()
        tps_none = R * L / sorted(t_nones)[len(t_nones) // 2] if t_nones else None
        if p == 0 and extra > 0:
            print(f"   0% hit: no offload {', '.join(f'{R * L / x:,.0f}' for x in t_nones)} tokens/s "
                  f"(medians compared)", flush=True)
        for m, ts in ts_by.items():
            t = sorted(ts)[len(ts) // 2]
            nload = nloads[m]
            hits = sum(len(win) * p // 100 for win in windows(prompts, W))
            if nload != hits * ((L - 1) // bs):
                raise RuntimeError(f"{m} hit {p}%: loaded {nload} blocks, expected {hits * ((L - 1) // bs)}")
            kv_bytes = nload * ub
            tps = R * L / t
            samples = [round(R * L / x, 1) for x in ts] if len(ts) > 1 else None
            rows.append({"mode": m, "hit_pct": p, "tokens_per_s": round(tps, 1), "speedup": round(tps / tps_none, 3) if tps_none else None,
                         "kv_gbps": round(kv_bytes / t / 1e9, 2), "kv_blocks": nload, "seconds": round(t, 3),
                         "diag": diags[m], **({"samples_tokens_per_s": samples} if samples else {}),
                         **({"samples_s": [round(x, 4) for x in ts], "diag_stacks": stacks.get((m, p), [])}
                            if a.sample_stacks else {})})
            print(f"{m:>5} hit {p:>3}%: {tps:>12,.0f} tokens/s "
                  f"({f'{tps / tps_none:5.2f}x' if tps_none else 'no baseline'}), KV {kv_bytes / t / 1e9:6.2f} GB/s"
                  + (f"  [{', '.join(f'{x:,.0f}' for x in samples)}]" if samples else ""), flush=True)
            print(f"      {_fmt(diags[m])}", flush=True)
            for i, st in enumerate(stacks.get((m, p), []) if a.sample_stacks else []):
                print(f"      run {i}: {st['steps']} steps, median {st['step_ms_median']} ms, longest "
                      f"{st['step_ms_longest']} ms; {st['samples']} samples, gaps {st['longest_gaps_ms']} ms; "
                      f"gc {st['gc']['collections']}x {st['gc']['ms']} ms; ours "
                      + ", ".join(f"{k} {v:.0%}" for k, v in list(st['ours'].items())[:3]), flush=True)
                for g in st["after_gaps"][:3]:
                    print(f"        after a {g[0]} ms gap: {g[1]}  ({g[2]})", flush=True)

    name = "throughput_fig6" if a.fig6 else "throughput"
    done = []

    def save() -> None:
        # rewritten after every hit rate: a run cut short by a time limit keeps what it
        # measured; `done` says how far it got (hit rates when interleaved, else methods)
        out = sorted(rows, key=lambda r: methods.index(r["mode"]))  # stable: hit rates stay in order
        if t_nones:
            # against the final no-offload median, from the figures as recorded (rounded), so the
            # file's speedups are exactly its tokens_per_s ratios
            tn = round(R * L / sorted(t_nones)[len(t_nones) // 2], 1)
            out = [{**r, "speedup": round(r["tokens_per_s"] / tn, 3)} for r in out]
            out.insert(0, {"mode": "no-offload", "hit_pct": None, "tokens_per_s": tn,
                           "samples_tokens_per_s": [round(R * L / x, 1) for x in t_nones], "diag": diag_none})
        write_rows(name, out, {"model": "tiny" if a.tiny else ("llama-3.2-1b" if a.fig6 else "llama-3.1-8b"),
                               "requests": R, "window": W, "prompt_len": L,
                               "max_seqs": a.max_seqs, "gpu_blocks": a.gpu_blocks,
                               "max_batch_tokens": a.max_batch_tokens, "ref_h2d_gbps": ref_h2d,
                               "native_submit": a.native_submit, "cuda_graph_seqs": a.cuda_graph_seqs,
                               "rates": rates, "repeat": a.repeat, "repeat_hits": a.repeat_hits,
                               "freeze_gc": a.freeze_gc, "warm_each_run": a.warm_each_run,
                               "synthetic_hits": a.synthetic_hits, "baseline": a.baseline,
                               "done": list(done)}, a.out)

    # all methods' pools pinned at once, if they fit in half the host memory; else one method after another
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    interleave = len(methods) > 1 and not a.sequential and len(methods) * pool_blocks * ub <= ram // 2
    print(f"methods {'interleaved at each hit rate' if interleave else 'one after another'}", flush=True)
    if interleave:
        engines = {m: make_engine(m) for m in methods}
        freeze_heap()
        for p in rates:
            measure(engines, p)
            done.append(p)
            save()
        del engines
    else:
        for m in methods:
            engines = {m: make_engine(m)}
            freeze_heap()
            for p in rates:
                measure(engines, p)
                save()
            done.append(m)
            del engines
    save()
    plot(name, a.out)


if __name__ == "__main__":
    main()
