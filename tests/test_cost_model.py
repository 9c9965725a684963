"""The auto cost model: choices follow the table; busy mode avoids SM stores to host."""
import json

import numpy as np
import pytest

from kernels.cost_model import DEFAULT_TABLE, CostModel, calib_path, load_cost_model

ALL = ("torch", "dma", "cuda", "triton", "staged")


def one_curve_model() -> CostModel:
    """The shipped table reduced to one curve per method (the format before the per-count curves: rates by
    block size only), for tests that set rates by editing table["gbps"]."""
    t = json.loads(json.dumps(DEFAULT_TABLE))
    for k in ("gbps_small", "small_count", "budget_bytes", "gbps_hostseq"):
        t.pop(k, None)
    return CostModel(t)


def test_default_table_is_complete():
    for d in ("d2h", "h2d", "d2d"):
        for m in ("dma", "cuda", "triton"):
            assert len(DEFAULT_TABLE["gbps"][d][m]) == len(DEFAULT_TABLE["sizes"])
    for d in ("d2h", "h2d"):  # the host-order DMA curve (no host side in d2d)
        assert len(DEFAULT_TABLE["gbps_hostseq"][d]["dma"]) == len(DEFAULT_TABLE["sizes"])
    assert "d2d" not in DEFAULT_TABLE["gbps_hostseq"]
    assert "source" in DEFAULT_TABLE


def test_idle_prefers_kernel_small_dma_large():
    cm = CostModel()
    assert cm.choose("d2h", 4096, 1000, False, ALL, n_desc=1000, n_desc_host=1000) in ("cuda", "triton")
    assert cm.choose("h2d", 16 << 20, 64, False, ALL, n_desc=64, n_desc_host=64) == "dma"
    # one coalesced run of small blocks is one big descriptor: DMA wins
    assert cm.choose("d2h", 4096, 1 << 16, False, ALL, n_desc=1, n_desc_host=1) == "dma"


def test_busy_never_picks_sm_stores_to_host():
    cm = CostModel()
    for bb in (4096, 32768, 1 << 21):
        for d in ("d2h", "h2d"):
            assert cm.choose(d, bb, 1000, True, ALL, n_desc=1000, n_desc_host=1000) in ("dma", "staged")
    # sequential host slots: per-block DMA runs near line rate there (the shipped host-order
    # curve), as fast as staged's gather + one DMA and without its SM gather beside compute
    assert cm.choose("d2h", 32768, 8192, True, ALL, n_desc=8192, n_desc_host=1) == "dma"
    # 4 KiB blocks: per-block DMA is bound by its descriptor rate (10 GB/s) whatever the host
    # order, so staged's gather + one DMA is still the way
    assert cm.choose("d2h", 4096, 65536, True, ALL, n_desc=65536, n_desc_host=1) == "staged"


def test_staged_first_chunk_moves_at_plain_dma_speed():
    """A staged job's first chunk is gathered, then DMAed, with nothing to overlap: one chunk
    of random host slots is never predicted faster than plain DMA of the same descriptors
    (H200: 1000 random 8-32 KiB blocks, staged 12-25% slower than dma), while a job of many
    chunks whose host slots coalesce (here in pairs) still gets the table's pipelined staged
    rate. With random host slots staged submits as many descriptors as dma plus a gather: it is
    not picked over dma at all, whatever the table says."""
    cm = one_curve_model()
    sizes = len(cm.table["sizes"])
    for d in ("d2h", "h2d"):
        cm.table["gbps"][d]["dma"] = [20.0 if x <= 32768 else 50.0 for x in cm.table["sizes"]]
        cm.table["gbps"][d]["staged"] = [45.0] * sizes
    cm.table["fixed_us"]["dma"] = cm.table["fixed_us"]["staged"] = 0.0
    one_chunk = (CostModel.STAGED_CHUNK // 32768) - 24
    for d in ("d2h", "h2d"):
        assert cm.choose(d, 32768, one_chunk, True, ALL, n_desc=one_chunk, n_desc_host=one_chunk) == "dma"
        lone = cm.predict_us(d, "staged", 32768, one_chunk, one_chunk, one_chunk)
        assert lone == pytest.approx(one_chunk * 32768 / (0.97 * 20e3))
        many = 32 * one_chunk
        assert cm.choose(d, 32768, many, True, ALL, n_desc=many, n_desc_host=many // 2) == "staged"
        assert cm.predict_us(d, "staged", 32768, many, many, many) < cm.predict_us(d, "dma", 32768, many, many, many)
        for busy in (True, False):
            assert cm.choose(d, 32768, many, busy, ("torch", "dma", "staged"), n_desc=many, n_desc_host=many) == "dma"
            assert cm.choose(d, 32768, many, busy, ("torch", "dma", "staged")) == "dma"  # no run counts: none
        # contiguous host slots make the first chunk one big descriptor as well
        assert cm.predict_us(d, "staged", 32768, one_chunk, one_chunk, 1) < lone


def test_fallbacks_and_memo():
    cm = CostModel()
    assert cm.choose("h2h", 4096, 10, False, ALL) == "torch"
    assert cm.choose("d2h", 4096, 10, False, ("torch",)) == "torch"
    a = cm.choose("d2h", 65536, 100, False, ALL, 100, 100)
    cm.table["gbps"]["d2h"]["cuda"] = [0.1] * len(cm.table["sizes"])  # memo keeps the first answer
    assert cm.choose("d2h", 65536, 100, False, ALL, 100, 100) == a
    assert CostModel(json.loads(json.dumps(cm.table))).choose("d2h", 65536, 100, False, ALL, 100, 100) != "cuda"


def test_calibration_cache_roundtrip(tmp_path, monkeypatch):
    monkeypatch.setenv("KVO_CACHE_DIR", str(tmp_path))
    p = calib_path("NVIDIA H200")
    assert p.startswith(str(tmp_path)) and p.endswith("calib-NVIDIA_H200.json")
    cm = CostModel()
    cm.table["source"] = "test"
    cm.save(p)
    assert json.load(open(p))["source"] == "test"
    assert load_cost_model("cpu").table["source"] == DEFAULT_TABLE["source"]  # CPU: defaults


def test_dma_wins_a_near_tie_only():
    cm = one_curve_model()
    sizes = len(cm.table["sizes"])
    for slower, want in ((1.02, "dma"), (1.20, "staged")):
        cm = one_curve_model()
        cm.table["gbps"]["d2h"]["staged"] = [50.0] * sizes
        cm.table["gbps"]["d2h"]["dma"] = [50.0 / slower] * sizes
        cm.table["fixed_us"]["dma"] = cm.table["fixed_us"]["staged"] = 0.0
        # GPU blocks scattered, host slots contiguous: where staged can come out ahead
        got = cm.choose("d2h", 1 << 21, 1000, True, ALL, n_desc=1000, n_desc_host=1)
        assert got == want, (slower, got)
        # idle: the same rule (DMA costs the host one call; staged a pipeline of steps)
        assert cm.choose("d2h", 1 << 21, 1000, False, ("dma", "staged"), n_desc=1000, n_desc_host=1) == want
        # small blocks too: staged must beat dma by more than HOST_RISK_SLACK
        assert cm.choose("d2h", 1 << 18, 1000, True, ALL, n_desc=1000, n_desc_host=1) == want
        # both sides contiguous: staged would submit as many descriptors as dma, plus a gather
        assert cm.choose("d2h", 1 << 21, 1000, True, ALL, n_desc=1, n_desc_host=1) == "dma"


def test_kernel_keeps_a_near_tie_against_small_dma_descriptors():
    """Below 64 KiB per descriptor DMA's host submit (per descriptor, and varying with the
    host's cache state) can bound the job: idle auto takes the kernel unless DMA is predicted
    more than HOST_RISK_SLACK faster; from 64 KiB on, the fastest."""
    for dma_gbps, bb, want in ((52.0, 32768, "cuda"), (60.0, 32768, "dma"), (52.0, 65536, "dma")):
        cm = one_curve_model()
        sizes = len(cm.table["sizes"])
        cm.table["gbps"]["h2d"]["cuda"] = [50.0] * sizes
        cm.table["gbps"]["h2d"]["triton"] = [40.0] * sizes
        cm.table["gbps"]["h2d"]["dma"] = [dma_gbps] * sizes
        cm.table["gbps"]["h2d"]["staged"] = [dma_gbps] * sizes
        for m in ("cuda", "dma", "staged", "triton"):
            cm.table["fixed_us"][m] = 0.0
        n = (1 << 30) // bb
        assert cm.choose("h2d", bb, n, False, ALL, n_desc=n, n_desc_host=n) == want, (dma_gbps, bb)


def test_bandwidth_interpolates_like_np_interp():
    """The pure-Python interpolation (hot path) equals np.interp in log2(bytes), clamped."""
    cm = CostModel()
    xs = np.log2(np.asarray(cm.table["sizes"], float))
    for d, per in cm.table["gbps"].items():
        for m, ys in per.items():
            for b in (0.5, 1, 100, 4096, 5000, 32768, 1e5, 2 ** 21, 3e6, 2 ** 24, 2 ** 34):
                want = float(np.interp(np.log2(max(b, 1.0)), xs, np.asarray(ys, float)))
                assert cm.bandwidth(d, m, b) == pytest.approx(want, rel=1e-12, abs=1e-12), (d, m, b)
    assert cm.bandwidth("d2h", "no-such-method", 4096) == 0.0


def test_replay_auto_reports_each_pick_against_the_measured_best():
    """profiling/analysis/replay_auto.py: the model's pick at each sweep point, as a share of the best
    qualifying method measured there."""
    from profiling.analysis.replay_auto import replay

    cm = CostModel()
    rows = [{"dir": "d2h", "block_bytes": 1 << 21, "count": 512, "method": m, "gbps": g}
            for m, g in (("dma", 50.0), ("cuda", 40.0), ("triton", 30.0), ("staged", 45.0))]
    res = replay(rows, cm)
    (pt, pick, share), = res[False]
    assert pt == ("d2h", 1 << 21, 512, "random") and pick == "dma" and share == 1.0
    (_, pick_b, share_b), = res[True]
    assert pick_b in ("dma", "staged") and share_b == {"dma": 1.0, "staged": 0.9}[pick_b]
    # probe_host_order rows: the same shape with host ids random and sequential is two points,
    # the sequential one asked with one host-side run (busy: DMA near line rate there)
    rows = [{"dir": "d2h", "block_bytes": 32768, "count": 8192, "host_ids": ho, "method": m, "gbps": g}
            for ho in ("random", "sequential") for m, g in (("dma", 45.0), ("staged", 46.0), ("cuda", 52.0))]
    res = replay(rows, cm)
    assert [p[0][3] for p in res[True]] == ["random", "sequential"]
    assert res[True][1][1] == "dma" and res[True][1][2] == pytest.approx(45.0 / 46.0)
    # rows that record their host-side run count are asked with it: a sorted point with one
    # run is asked as the sequential one, with one run per block as the random one
    # 1 GiB of 16 KiB H2D, busy: the shipped table picks dma for random host ids and staged
    # for sequential ones
    rows = [{**r, "dir": "h2d", "block_bytes": 16384, "count": 65536} for r in rows]
    picks = {p[0][3]: p[1] for p in replay(rows, cm)[True]}
    assert picks == {"random": "dma", "sequential": "staged"}
    for runs, like in ((1, "sequential"), (65536, "random")):
        rs = [{**r, "host_ids": "sorted", "host_runs": runs} for r in rows if r["host_ids"] == "sequential"]
        (_, pick, _), = replay(rs, cm)[True]
        assert pick == picks[like]


def _limits_hold(cm, d, bb, n, avail=ALL):
    """Every (runs_both, runs_host) past kernel_limits is chosen 'cuda'; returns the limits."""
    from kernels.cost_model import _step, _unstep

    assert cm.kernel_limits(d, bb, n, avail) is None  # first sighting: the ordinary path
    lim = cm.kernel_limits(d, bb, n, avail)
    if lim is None:
        assert cm.choose(d, bb, n, False, avail, n_desc=n, n_desc_host=n) != "cuda"
        return None
    mb, mh = lim
    counts = sorted({_unstep(k) for k in range(_step(n) + 1)} | {mb, mb + 1, mh, mh + 1, n})
    counts = [r for r in counts if 1 <= r <= n]
    for rb in counts:
        for rh in counts:
            if rb > mb and rh > mh:
                assert cm.choose(d, bb, n, False, avail, n_desc=rb, n_desc_host=rh) == "cuda", (d, bb, n, rb, rh)
    return lim


def test_limits_settled_follows_kernel_limits():
    """copy()'s auto path remembers an answer only once kernel_limits has settled it: not at
    a shape's first sight (None, not worked out), yes from the second on, per shape."""
    cm = CostModel()
    assert not cm.limits_settled("h2d", 4096, 1000, ALL)
    assert cm.kernel_limits("h2d", 4096, 1000, ALL) is None
    assert not cm.limits_settled("h2d", 4096, 1000, ALL)
    lim = cm.kernel_limits("h2d", 4096, 1000, ALL)
    assert lim is not None and cm.limits_settled("h2d", 4096, 1000, ALL)
    assert not cm.limits_settled("h2d", 4096, 999, ALL) and not cm.limits_settled("d2h", 4096, 1000, ALL)
    assert not cm.limits_settled("h2d", 4096, 1000, ("torch", "dma", "cuda"))
    # a settled "no": big blocks never take the fused path
    cm.kernel_limits("h2d", 16 << 20, 64, ALL)
    assert cm.kernel_limits("h2d", 16 << 20, 64, ALL) is None and cm.limits_settled("h2d", 16 << 20, 64, ALL)


def test_copier_remembers_settled_limits_per_cost_model():
    """BlockCopier._kernel_limits (copy()'s auto hot path reads its memo inline): an answer
    is kept only when settled, equals the cost model's, and a new cost model starts afresh."""
    import torch

    from kernels.copy import BlockCopier

    cp = BlockCopier(torch.device("cpu"))
    cp.available_methods = lambda: ALL  # the GPU's methods, so that cuda can be picked
    cm = cp.cost_model
    assert cp._kernel_limits("h2d", 4096, 1000) is None  # first sight
    assert ("h2d", 4096, 1000) not in cp._auto_lims[1]
    lim = cp._kernel_limits("h2d", 4096, 1000)
    assert lim == cm.kernel_limits("h2d", 4096, 1000, ALL) and lim is not None
    assert cp._auto_lims[0] is cm and cp._auto_lims[1][("h2d", 4096, 1000)] == lim
    other = one_curve_model()
    other.table["gbps"]["h2d"]["cuda"] = [1e-3] * len(other.table["sizes"])  # cuda never wins
    cp.cost_model = other
    assert cp._kernel_limits("h2d", 4096, 1000) is None
    assert cp._kernel_limits("h2d", 4096, 1000) is None  # settled: a "no" under this model
    assert cp._auto_lims[0] is other and cp._auto_lims[1] == {("h2d", 4096, 1000): None}


def test_kernel_limits_only_let_cuda_picks_through():
    """auto's fused path (IndexRing.copy_blocks with run limits) launches the cuda kernel
    without asking `choose`: that is right only if choose says cuda for every run count past
    the limits. Checked over every 1/16-octave run count, on the shipped (non-monotone) DMA
    curve, where the limits come from a scan, and on a rising one, where they come from a
    bisection that must agree with the scan."""
    cm = CostModel()
    for d in ("d2h", "h2d", "d2d"):
        for bb in (4096, 8192, 32768, 131072, 1 << 20):
            for n in (1, 7, 100, 1000, 4096):
                _limits_hold(cm, d, bb, n)
    # 1000 random 4 KiB blocks go through; one run of them (one 4 MiB descriptor) is handed back
    mb, _ = cm.kernel_limits("h2d", 4096, 1000, ALL)
    assert 1 <= mb < 1000
    rising = one_curve_model()
    for d in ("d2h", "h2d"):
        ys = rising.table["gbps"][d]["dma"]
        rising.table["gbps"][d]["dma"] = [max(ys[: i + 1]) for i in range(len(ys))]
        assert rising._dma_curve_rises(d)
    scan = CostModel(json.loads(json.dumps(rising.table)))
    scan._dma_curve_rises = lambda d: False
    for d in ("d2h", "h2d"):
        for bb in (4096, 16384, 65536):
            for n in (16, 1000, 32768):
                assert _limits_hold(rising, d, bb, n) == _limits_hold(scan, d, bb, n)


def _two_curve_table(small, big, budget=1 << 30, small_count=1000):
    t = json.loads(json.dumps(DEFAULT_TABLE))
    n = len(t["sizes"])
    t["gbps_small"] = {d: {m: [small] * n for m in t["gbps"][d]} for d in t["gbps"]}
    for d in t["gbps"]:
        for m in t["gbps"][d]:
            t["gbps"][d][m] = [big] * n
    t.update(budget_bytes=budget, small_count=small_count)
    return CostModel(t)


def test_rate_interpolates_between_the_two_calibrated_counts():
    """Tables with a small-job curve: 1000 descriptors read it, budget_bytes' worth read the
    big curve, counts between them are interpolated in log2(count); no count, or a table
    without the small curve (older calibrations), reads the big curve."""
    cm = _two_curve_table(small=10.0, big=50.0)
    bb = 32768
    n_big = (1 << 30) // bb  # 32768
    assert cm.bandwidth("d2h", "dma", bb, 1000) == pytest.approx(10.0)
    assert cm.bandwidth("d2h", "dma", bb, 10) == pytest.approx(10.0)
    assert cm.bandwidth("d2h", "dma", bb, n_big) == pytest.approx(50.0)
    assert cm.bandwidth("d2h", "dma", bb, 10 * n_big) == pytest.approx(50.0)
    assert cm.bandwidth("d2h", "dma", bb) == pytest.approx(50.0)
    mid = int(round(1000 * (n_big / 1000) ** 0.5))  # halfway in log2
    assert cm.bandwidth("d2h", "dma", bb, mid) == pytest.approx(30.0, rel=1e-3)
    # 16 MiB blocks: budget_bytes is only 64 of them, under small_count: one curve, the big one
    assert cm.bandwidth("h2d", "cuda", 16 << 20, 64) == pytest.approx(50.0)
    # a one-curve table (calibrated before the per-count curves) reads its one curve at every count
    old = one_curve_model()
    for n in (10, 1000, 50000):
        assert old.bandwidth("d2h", "dma", bb, n) == old.bandwidth("d2h", "dma", bb)
    assert old.bandwidth("h2d", "dma", 16384, 1000) == pytest.approx(DEFAULT_TABLE["gbps"]["h2d"]["dma"][2])
    # predicted times follow: 1000 x 32 KiB at 10 GB/s, plus the fixed latency
    fixed = cm.table["fixed_us"]["cuda"]
    assert cm.predict_us("d2h", "cuda", bb, 1000) == pytest.approx(fixed + 1000 * bb / 10e3)


def test_count_curves_change_the_choice():
    """DMA slow in small jobs, fast in big ones (H200 16 KiB H2D: 4 GB/s at 1000 descriptors,
    12 at 65536): auto takes the kernel for the small job and dma for the big one."""
    cm = _two_curve_table(small=40.0, big=40.0)
    n = len(cm.table["sizes"])
    cm.table["gbps_small"]["h2d"]["dma"] = [4.0] * n
    cm.table["gbps"]["h2d"]["dma"] = [60.0] * n
    cm = CostModel(cm.table)
    bb = 16384
    assert cm.choose("h2d", bb, 1000, False, ALL, n_desc=1000, n_desc_host=1000) in ("cuda", "triton")
    big = (1 << 30) // bb
    assert cm.choose("h2d", bb, big, False, ALL, n_desc=big, n_desc_host=big) == "dma"


def _hostseq_model(seq=55.0, rand=40.0):
    """One-curve table with DMA at `rand` GB/s for random host ids and a host-order curve
    at `seq` GB/s for sequential ones (the H200's 32 KiB D2H: 45 vs 54.6)."""
    cm = one_curve_model()
    n = len(cm.table["sizes"])
    for d in ("d2h", "h2d"):
        cm.table["gbps"][d]["dma"] = [rand] * n
    cm.table["gbps_hostseq"] = {d: {"dma": [seq] * n} for d in ("d2h", "h2d")}
    return CostModel(cm.table)


def test_host_sequential_dma_blends_the_two_curves():
    """DMA of descriptors that follow each other in host memory reads the host-order curve:
    time-weighted by the fraction of descriptor boundaries inside a host run. Random host ids
    (as many host runs as descriptors), no host count, or a table without the curve read the
    random-host curve alone."""
    cm = _hostseq_model(seq=50.0, rand=25.0)
    bb, n = 32768, 4097
    fixed = cm.table["fixed_us"]["dma"]
    total = bb * n
    rand_us = fixed + total / 25e3
    assert cm.predict_us("d2h", "dma", bb, n, n_desc=n, n_desc_host=n) == pytest.approx(rand_us)
    assert cm.predict_us("d2h", "dma", bb, n, n_desc=n) == pytest.approx(rand_us)
    assert cm.predict_us("h2d", "dma", bb, n, n_desc=n, n_desc_host=1) == pytest.approx(fixed + total / 50e3)
    # half the boundaries inside host runs: half the time at each rate
    half = 1 + (n - 1) // 2
    assert cm.host_adjacent_fraction(n, half) == pytest.approx(0.5)
    assert cm.predict_us("d2h", "dma", bb, n, n_desc=n, n_desc_host=half) == \
        pytest.approx(fixed + total * (0.5 / 25e3 + 0.5 / 50e3))
    # a host-order curve under the random one never slows DMA down
    slow = _hostseq_model(seq=20.0, rand=25.0)
    assert slow.predict_us("d2h", "dma", bb, n, n_desc=n, n_desc_host=1) == pytest.approx(rand_us)
    # d2d has no host side; tables calibrated before the curve existed ignore host runs
    assert cm.host_adjacent_fraction(1, 1) == 0.0
    old = one_curve_model()
    assert old.host_adjacent_fraction(n, 1) == 0.0
    assert old.predict_us("d2h", "dma", bb, n, n_desc=n, n_desc_host=1) == \
        old.predict_us("d2h", "dma", bb, n, n_desc=n, n_desc_host=n)


def test_busy_host_sequential_takes_dma_over_staged():
    """Busy GPU, 32 KiB blocks from random GPU slots to sequential host slots: staged (an SM
    gather, then one DMA) cost a concurrent GEMM +6-8% at 84% of the big copy, plain DMA
    +1-3% at 88-97% (H200, transfer interference rows). With the host-order curve auto sees
    that DMA runs near line rate there and takes it; without it, staged looks faster D2H."""
    n = 8192
    t = one_curve_model().table  # the shipped random-host curves
    sizes = t["sizes"]
    t["gbps_hostseq"] = {d: {"dma": [max(y, 54.6) if x >= 32768 else y for x, y in zip(sizes, t["gbps"][d]["dma"])]}
                         for d in ("d2h", "h2d")}
    with_curve = CostModel(t)
    without = json.loads(json.dumps(with_curve.table))
    del without["gbps_hostseq"]
    without = CostModel(without)
    for d in ("d2h", "h2d"):
        assert with_curve.choose(d, 32768, n, True, ALL, n_desc=n, n_desc_host=1) == "dma"
        # (the shipped random-host curve has 32 KiB H2D DMA at 50 GB/s: near staged already)
        assert without.choose(d, 32768, n, True, ALL, n_desc=n, n_desc_host=1) == \
            ("staged" if d == "d2h" else "dma")
        # random host slots: the curve does not apply, DMA as before
        assert with_curve.choose(d, 32768, n, True, ALL, n_desc=n, n_desc_host=n) == \
            without.choose(d, 32768, n, True, ALL, n_desc=n, n_desc_host=n)


def test_kernel_limits_hold_with_a_host_order_curve():
    """With the host-order curve, DMA's time falls with the host run count too: the fused
    path's limits must still only let through jobs that `choose` gives to cuda."""
    cm = _hostseq_model(seq=56.0, rand=30.0)
    for d in ("d2h", "h2d"):
        for bb in (4096, 32768, 131072):
            for n in (7, 1000, 4096):
                _limits_hold(cm, d, bb, n)


def test_calibrate_cli_rejects_unknown_curves(capsys):
    from kernels.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--curves", "gbps,bogus"])
    assert e.value.code == 2
    assert "unknown curves ['bogus']" in capsys.readouterr().err


def test_pack_auto_is_the_cost_models_one_rule():
    """Per-layer pack jobs: `auto` is CostModel.choose_pack, the pair the native submitter is
    handed is pack_modes (staged only with compute running and host memory on the unified side)."""
    cm = CostModel()
    assert [cm.choose_pack(h, b) for h in (False, True) for b in (False, True)] == ["cuda", "cuda", "cuda", "staged"]
    assert cm.pack_modes(True) == ("cuda", "staged") and cm.pack_modes(False) == ("cuda", "cuda")


def test_dma_either_way_is_remembered_per_step():
    """The worker's `auto` answer for native DMA lives in the cost model, keyed on choose's steps."""
    cm = CostModel()
    avail = ("torch", "dma", "cuda", "staged")
    want = all(cm.choose("d2h", 2 << 20, 1000, b, avail, n_desc=1000, n_desc_host=1000) == "dma" for b in (0, 1))
    assert cm.dma_either_way("d2h", 2 << 20, 1000, avail, 1000, 1000) is want
    assert list(cm.dma_both.values()) == [want] and len(cm.dma_both) == 1
    cm.dma_either_way("d2h", 2 << 20, 1000, avail, 999, 999)  # same 1/16-octave step: the same entry
    assert len(cm.dma_both) == 1
    assert CostModel().dma_both == {}  # a new model starts empty


def test_dma_either_way_keys_every_count_one_way(monkeypatch):
    """dma_either_way is the only place its answers are decided and stored, under a public key
    (the worker's native fast path reads it inline: tests/test_layers_once.py): counts stepped
    through the STEPS table and counts past it give the same key, a remembered answer is
    returned without a second `choose`, and a count whose step differs is decided afresh."""
    from kernels.cost_model import STEPS, count_step
    cm = CostModel()
    avail = ("torch", "dma", "cuda", "staged")
    big = len(STEPS) + 5
    for nd in (1000, big):
        cm.dma_either_way("d2h", 2 << 20, big, avail, nd, nd)
        assert ("d2h", 2 << 20, big, count_step(nd), count_step(nd), avail) in cm.dma_both
    assert len(cm.dma_both) == 2
    asked = []
    real = cm.choose
    monkeypatch.setattr(cm, "choose", lambda *a, **k: asked.append(a) or real(*a, **k))
    cm.dma_either_way("d2h", 2 << 20, big, avail, 999, 999)  # the step of 1000: remembered
    cm.dma_either_way("d2h", 2 << 20, big, avail, big - 1, big - 1)
    assert asked == []
    cm.dma_either_way("d2h", 2 << 20, big, avail, 500, 500)  # another step: decided (idle, busy)
    assert len(asked) == 2 and len(cm.dma_both) == 3


def test_cost_model_hands_out_its_tables():
    """The cost model owns what hot paths look up inline: STEPS (count_step by index), the
    settled kernel_limits per `available` (settled_limits: one dict, filled as shapes settle,
    which the copier keeps), and the pack submit mode (no table of its own in the worker)."""
    from kernels.cost_model import PACK_SUBMIT_MODES, STEPS, count_step

    assert STEPS[1000] == count_step(1000) and STEPS[0] is None and len(STEPS) == 1 << 14
    cm = one_curve_model()
    table = cm.settled_limits(ALL)
    assert table == {} and cm.settled_limits(list(ALL)) is table  # one dict per tuple of methods
    assert cm.kernel_limits("h2d", 4096, 1000, ALL) is None and table == {}  # first sight: not settled
    lim = cm.kernel_limits("h2d", 4096, 1000, ALL)
    assert table == {("h2d", 4096, 1000): lim} and cm.limits_settled("h2d", 4096, 1000, ALL)
    assert cm.settled_limits(("torch",)) == {}
    assert cm.pack_submit_mode(host=True) == PACK_SUBMIT_MODES[cm.pack_modes(host=True)] == 1  # direct idle, staged busy
    assert cm.pack_submit_mode(host=False) == 0
