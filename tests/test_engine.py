"""The minimal engine: greedy generation is token-identical with and without the connector.

CPU (CI): the tiny model, both KV layouts, the synchronous reference transfer path.
GPU (marked): the same with every transfer method through the TransferWorker.
"""
import pytest
import torch

from connector.engine import EngineConfig, Llama, LlamaConfig, LLMEngine, block_hashes, rope_inv_freq

PROMPTS = [list(range(1, 23)), list(range(5, 19)), [7, 3, 9] * 9]


def engine(layout="unified", offload=64, gpu_blocks=40, device="cpu", method="auto", bs=4):
    return LLMEngine(EngineConfig(LlamaConfig.tiny(), block_size=bs, num_gpu_blocks=gpu_blocks,
                                  layout=layout, offload_blocks=offload, device=device, method=method))


def wipe_gpu(e):
    e.reset_prefix_cache()
    for t in e.kv_views:
        t.fill_(0.25)  # GPU copies are gone: only the host copy can bring them back


@pytest.mark.parametrize("layout", ["unified", "per_layer"])
def test_load_from_host_is_token_identical_to_recompute(layout):
    ref = engine(layout, offload=0).generate(PROMPTS, 6)
    e = engine(layout)
    assert e.generate(PROMPTS, 6) == ref
    stored = e.stats["stored_blocks"]
    assert stored > 0
    wipe_gpu(e)
    assert e.generate(PROMPTS, 6) == ref
    assert e.stats["loaded_blocks"] == sum((len(p) - 1) // 4 for p in PROMPTS)
    assert e.stats["prefill_tokens"] == sum(len(p) for p in PROMPTS) + sum(len(p) - (len(p) - 1) // 4 * 4 for p in PROMPTS)


def test_corrupted_host_copy_changes_the_output():
    """Negative control: the identity above is not vacuous."""
    ref = engine(offload=0).generate(PROMPTS[:1], 6)
    e = engine()
    e.generate(PROMPTS[:1], 6)
    wipe_gpu(e)
    e.host.view(torch.float32).mul_(-3.0)
    assert e.generate(PROMPTS[:1], 6) != ref


def test_restore_offload_repeats_a_run_from_the_same_stored_set():
    """Benchmarks repeat a hit-rate run by restoring the pool's bookkeeping after the warm-up
    stores (bench_throughput): the repeat loads the same blocks and gives the same tokens."""
    ref = engine(offload=0).generate(PROMPTS, 5)
    e = engine()
    e.generate(PROMPTS[:1], 1)  # the "hits": only the first prompt is stored
    state = e.offload_state()
    hits = (len(PROMPTS[0]) - 1) // 4
    loads = []
    for _ in range(2):
        e.restore_offload(state)
        wipe_gpu(e)
        before = e.stats["loaded_blocks"]
        assert e.generate(PROMPTS, 5) == ref
        loads.append(e.stats["loaded_blocks"] - before)
    assert loads == [hits, hits]  # the other prompts' blocks (stored by the first repeat) were forgotten
    assert e.bm.counters.stored_blocks > state[1].counters.stored_blocks  # restore_offload copies: state unchanged
    assert len(state[1].blocks) == hits


def test_restore_offload_refuses_after_an_eviction():
    e = engine(offload=6)
    e.generate(PROMPTS[:1], 1)
    state = e.offload_state()
    wipe_gpu(e)
    e.generate(PROMPTS[1:], 1)  # more blocks than the 6 slots: the pool evicts
    assert e.bm.counters.evictions > 0
    with pytest.raises(RuntimeError, match="evicted"):
        e.restore_offload(state)


def test_restore_offload_refuses_after_a_reset():
    e = engine()
    e.generate(PROMPTS[:1], 1)
    state = e.offload_state()
    e.reset_offload()  # every slot free again: the next stores may overwrite the snapshot's
    with pytest.raises(RuntimeError, match="reset_offload"):
        e.restore_offload(state)


def test_gpu_prefix_cache_hit_skips_the_host():
    e = engine()
    ref = e.generate(PROMPTS[:1], 4)
    assert e.generate(PROMPTS[:1], 4) == ref
    assert e.stats["gpu_prefix_hit_blocks"] == (len(PROMPTS[0]) - 1) // 4 and e.stats["loaded_blocks"] == 0


@pytest.mark.parametrize("layout", ["unified", "per_layer"])
@pytest.mark.parametrize("offload", [0, 64])
def test_preempted_request_produces_the_same_tokens(layout, offload):
    long = [[i * 7 % 250 + 1 for i in range(26)], [i * 11 % 250 + 1 for i in range(22)],
            [i * 13 % 250 + 1 for i in range(18)]]
    ref = engine(layout, offload=0, gpu_blocks=64).generate(long, 12)
    e = engine(layout, offload=offload, gpu_blocks=17)  # too few blocks for all three
    assert e.generate(long, 12) == ref
    assert e.stats["preemptions"] > 0, "the scenario must preempt"
    if offload:
        assert e.stats["stored_blocks"] > 0


def test_block_hashes_chain():
    a = block_hashes(list(range(12)), 4)
    b = block_hashes(list(range(8)) + [99, 9, 10, 11], 4)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    c = block_hashes([0, 1, 2, 99] + list(range(4, 12)), 4)
    assert c[1] != a[1]  # a change earlier in the prefix changes every later key
    assert block_hashes(list(range(12)), 4, prefix=a[:1]) == a      # extending a cached prefix
    assert block_hashes(list(range(12)), 4, prefix=[b"x"])[0] == b"x"  # the prefix is trusted, not redone


@pytest.mark.parametrize("lens,ctx,max_elems", [([3, 1, 5], [3, 9, 12], None), ([1, 1], [17, 2], None),
                                                ([4, 4], [4, 4], None), ([1, 16, 1, 2, 16, 1], [9, 16, 3, 20, 30, 1], None),
                                                ([1, 1, 1, 1], [12, 12, 12, 12], 3 * 16 * 2)])
def test_padded_attention_matches_per_sequence(lens, ctx, max_elems, monkeypatch):
    from connector.engine.model import SeqBatch, _attend_each, _Padded, attend

    if max_elems:  # groups split to stay under the cap
        monkeypatch.setattr(_Padded, "MAX_ELEMS", max_elems)

    g = torch.Generator().manual_seed(1)
    bs, KV, G, D, nb = 4, 2, 3, 8, 64
    K, V = torch.randn(nb, bs, KV, D, generator=g), torch.randn(nb, bs, KV, D, generator=g)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, used = [], 0
    for c in ctx:
        k = -(-c // bs)
        tables.append(torch.tensor(perm[used:used + k]))
        used += k
    starts = [sum(lens[:i]) for i in range(len(lens))]
    T = sum(lens)
    q = torch.randn(T, KV * G, D, generator=g)
    b = SeqBatch(torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long), torch.zeros(T), torch.zeros(T),
                 starts, lens, ctx, tables)
    groups = _Padded.plan(b, bs, G)
    if len({int(n - 1).bit_length() for n in lens}) < len(lens):  # some bucket holds two sequences
        assert any(isinstance(g, _Padded) for g in groups)
    if max_elems:
        assert len(groups) == 2  # four 1-token queries over 12 keys, two per group
    torch.testing.assert_close(attend(q, K, V, b, groups, KV), _attend_each(q, K, V, b, KV), rtol=1e-5, atol=1e-5)


def test_llama3_rope_scaling():
    cfg = LlamaConfig.llama_3_1_8b()
    inv = rope_inv_freq(cfg)
    plain = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    assert torch.allclose(inv[:8].double(), plain[:8], rtol=1e-6)                      # high frequencies kept
    assert torch.allclose(inv[-4:].double(), plain[-4:] / cfg.rope_factor, rtol=1e-6)  # low ones divided


def test_safetensors_weights_load_exactly(tmp_path):
    from safetensors.torch import save_file

    cfg = LlamaConfig.tiny()
    src = Llama(cfg, seed=1)
    params = dict(src.named_parameters())
    save_file({hf: params[ours].detach().contiguous() for ours, hf in src.hf_state_dict_names().items()},
              str(tmp_path / "model.safetensors"))
    dst = Llama(cfg, seed=2)
    assert not torch.equal(dst.embed, src.embed)
    dst.load_safetensors(str(tmp_path))
    for n, p in dst.named_parameters():
        assert torch.equal(p, params[n]), n
    a = LLMEngine(EngineConfig(cfg, block_size=4, num_gpu_blocks=16), model=src).generate(PROMPTS[:1], 5)
    b = LLMEngine(EngineConfig(cfg, block_size=4, num_gpu_blocks=16), model=dst).generate(PROMPTS[:1], 5)
    assert a == b
    with pytest.raises(KeyError):
        save_file({"x": torch.zeros(1)}, str(tmp_path / "bad.safetensors"))
        Llama(cfg).load_safetensors(str(tmp_path / "bad.safetensors"))


def test_bad_engine_config():
    with pytest.raises(ValueError, match="layout"):
        LLMEngine(EngineConfig(LlamaConfig.tiny(), layout="paged"))
    with pytest.raises(ValueError, match="empty"):
        engine().add_request([], 3)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["unified", "per_layer"])
@pytest.mark.parametrize("method", ["auto", "dma", "cuda", "triton", "staged"])
def test_gpu_load_and_preemption_token_identical(layout, method):
    ref = engine(layout, offload=0, device="cuda", gpu_blocks=64).generate(PROMPTS, 6)
    e = engine(layout, device="cuda", method=method)
    assert e.generate(PROMPTS, 6) == ref
    wipe_gpu(e)
    assert e.generate(PROMPTS, 6) == ref and e.stats["loaded_blocks"] > 0
    e2 = engine(layout, device="cuda", method=method, gpu_blocks=17)
    long = [[i * 7 % 250 + 1 for i in range(26)], [i * 11 % 250 + 1 for i in range(22)],
            [i * 13 % 250 + 1 for i in range(18)]]
    ref2 = engine(layout, offload=0, device="cuda", gpu_blocks=64).generate(long, 12)
    assert e2.generate(long, 12) == ref2 and e2.stats["preemptions"] > 0


def test_one_store_job_per_step_and_one_load_job_per_admit_round():
    e = engine(gpu_blocks=64)
    calls = []
    real = e._transfer

    def spy(job, store, gpu_blocks, slots):
        calls.append((store, len(gpu_blocks), len(slots)))
        real(job, store, gpu_blocks, slots)

    e._transfer = spy
    ref = e.generate(PROMPTS, 1)  # one prefill step for all three prompts
    stores = [c for c in calls if c[0]]
    # 22, 14 and 27 tokens in 4-token blocks: 5 + 3 + 6 full blocks, in one job
    assert stores == [(True, 14, 14)], calls
    calls.clear()
    wipe_gpu(e)
    assert e.generate(PROMPTS, 1) == ref
    loads = [c for c in calls if not c[0]]
    # every prompt keeps its last token to compute: (22-1)//4 + (14-1)//4 + (27-1)//4 = 5 + 3 + 6
    assert loads == [(False, 14, 14)], calls
    assert e.stats["loaded_blocks"] == 14


@pytest.mark.parametrize("cap, jobs", [(0, [14]), (8, [8, 6]), (5, [5, 3, 6]), (1, [5, 3, 6])])
def test_load_jobs_are_split_at_request_boundaries(cap, jobs):
    """A step's loads go out as jobs of at most load_job_blocks blocks (so several queue back
    to back on the load stream), never splitting one request; tokens are unchanged."""
    ref = engine(offload=0).generate(PROMPTS, 2)
    e = LLMEngine(EngineConfig(LlamaConfig.tiny(), block_size=4, num_gpu_blocks=64, offload_blocks=64,
                               load_job_blocks=cap))
    e.generate(PROMPTS, 2)
    calls = []
    real = e._transfer
    e._transfer = lambda job, store, g, sl: (calls.append((store, len(g))), real(job, store, g, sl))
    wipe_gpu(e)
    assert e.generate(PROMPTS, 2) == ref
    assert [n for store, n in calls if not store] == jobs, calls


def test_finished_blocks_are_freed_only_after_their_stores():
    """A finished request's GPU blocks stay referenced until its store job is reported
    done (compute never waits on a store); when blocks run short they are reclaimed."""
    e = engine(gpu_blocks=64)
    sid = e.add_request(PROMPTS[0], 1)
    e.step()                                   # prefill + store job queued; request finishes
    s = e.seqs[sid]
    assert s.status == "finished" and len(e.deferred) == 1
    jobs, blocks = e.deferred[0]
    assert jobs <= set(e.pending_stores) and len(blocks) == 6
    assert not set(blocks) & set(e.pool.free), "blocks freed while their store is pending"
    e._poll()                                  # the CPU path reports its jobs at the next poll
    assert e.deferred == [] and set(blocks) <= set(e.pool.free)
    # blocks run short: a deferred release is reclaimed instead of refusing admission
    e2 = engine(gpu_blocks=8)
    e2.add_request(PROMPTS[0], 1)
    e2.step()
    assert len(e2.deferred) == 1 and len(e2.pool.free) == 2
    e2.add_request(PROMPTS[1], 1)              # needs 4 blocks: only possible after reclaim
    e2._admit()
    assert e2.deferred == [] and len(e2.running) == 1


def test_loading_requests_do_not_take_batch_slots():
    """With max_seqs=1, a request loads from the host while another one computes (vLLM's
    WAITING_FOR_REMOTE_KVS requests are not in the running batch either)."""
    ref = engine(offload=0).generate(PROMPTS, 3)
    e = LLMEngine(EngineConfig(LlamaConfig.tiny(), block_size=4, num_gpu_blocks=40, offload_blocks=64,
                               max_seqs=1))
    assert e.generate(PROMPTS, 3) == ref
    wipe_gpu(e)
    for p in PROMPTS:
        e.add_request(p, 3)
    overlap = False
    while e.has_work():
        e.step()
        overlap |= bool(e.loading) and any(s.status == "running" for s in e.running)
    e.drain()
    assert overlap, "no load ever overlapped a running request"
    assert [s.output for s in list(e.seqs.values())[3:]] == ref
    assert e.stats["loaded_blocks"] > 0


@pytest.fixture(scope="module")
def model_8b_fp32():
    """The Llama-3.1-8B shape (32 layers, 8 KV heads of 128, 4 MiB fp32 blocks of 16 tokens),
    random weights, in fp32 so that greedy ties cannot flip between the whole-prompt and the
    paged attention kernels. One model shared by every engine of the module."""
    import dataclasses

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    cfg = dataclasses.replace(LlamaConfig.llama_3_1_8b(), dtype=torch.float32)
    return cfg, Llama(cfg, seed=0).to("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["unified", "per_layer"])
@pytest.mark.parametrize("method", ["auto", "dma", "cuda", "triton", "staged"])
def test_gpu_8b_shape_load_and_preemption_token_identical(model_8b_fp32, layout, method):
    cfg, model = model_8b_fp32
    prompts = [[(r * 7919 + i * 104729) % (cfg.vocab_size - 1) + 1 for i in range(n)] for r, n in
               enumerate((63, 47, 31))]

    def eng(offload, blocks):
        return LLMEngine(EngineConfig(cfg, block_size=16, num_gpu_blocks=blocks, layout=layout, device="cuda",
                                      offload_blocks=offload, method=method), model=model)

    ref = eng(0, 64).generate(prompts, 4)
    e = eng(64, 64)
    assert e.generate(prompts, 4) == ref
    wipe_gpu(e)
    assert e.generate(prompts, 4) == ref and e.stats["loaded_blocks"] == sum((n - 1) // 16 for n in (63, 47, 31))
    # the prompts fill 4 + 3 + 2 blocks and each needs one more while decoding: with 10 GPU
    # blocks someone is preempted and resumed
    e2 = eng(64, 10)
    assert e2.generate(prompts, 4) == ref and e2.stats["preemptions"] > 0
