"""profiling/bench/ab_trees.{sh,py}: the same-run A/B of two source trees. CPU only: the
summary's medians and 3% verdicts on made-up rounds, and the shell driver's --dry-run (both
trees' benches parse their arguments, both trees import) with this tree on both sides."""
import json
import os
import subprocess
import sys

from profiling.bench import ab_trees

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(out, tree, r, name, rows):
    d = os.path.join(out, tree, f"r{r}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"{name}.json"), "w") as f:
        json.dump({"rows": rows}, f)


def test_summary_takes_medians_and_flags_what_got_worse_by_over_3pct(tmp_path):
    out = str(tmp_path)
    sub = {"section": "submit", "worker": "w", "kind": "store"}
    for r, (hb, ha, gb, ga) in enumerate([(10.0, 10.2, 50.0, 47.0), (12.0, 10.1, 50.0, 47.5),
                                          (11.0, 99.0, 50.0, 48.0)], 1):
        _write(out, "before", r, "connector", [dict(sub, host_us=hb), {"section": "worker_bidir", "worker": "w", "gbps": gb}])
        _write(out, "after", r, "connector", [dict(sub, host_us=ha), {"section": "worker_bidir", "worker": "w", "gbps": ga}])
    doc = ab_trees.summary(out)
    rows = {(x["row"], x["metric"]): x for x in doc["rows"]}
    host = rows[("connector:submit/w/store", "host_us")]
    assert (host["before_median"], host["after_median"], host["ok"]) == (11.0, 10.2, True)  # median, not the 99 outlier
    rate = rows[("connector:worker_bidir/w", "gbps")]
    assert (rate["after_median"], rate["ok"]) == (47.5, False)  # a rate 5% lower is over the limit
    assert doc["failing"] == 1 and doc["worst"]["metric"] == "gbps"
    assert json.load(open(os.path.join(out, "summary.json")))["checked"] == 2


def test_summary_targets_are_the_issues_measures_and_sections_get_a_geomean(tmp_path):
    """Target rows: transfer rates, connector submit host times, the worker's rate, TTFT. A
    transfer row's host_us is information only (it may fail without failing the targets)."""
    out = str(tmp_path)
    tr = {"section": "sweep", "dir": "h2d", "method": "cuda", "block_bytes": 4096, "count": 1000}
    for tree, host, gbps in (("before", 40.0, 50.0), ("after", 60.0, 49.0)):
        _write(out, tree, 1, "transfer", [dict(tr, gbps=gbps, host_us=host)])
        _write(out, tree, 1, "ttft", [{"len": 32768, "method": "auto", "load_ttft_ms": 100.0 if tree == "before" else 104.0}])
    doc = ab_trees.summary(out)
    rows = {(x["row"], x["metric"]): x for x in doc["rows"]}
    assert rows[("transfer:sweep/h2d/cuda/4096/1000", "host_us")]["target"] is False
    assert rows[("transfer:sweep/h2d/cuda/4096/1000", "gbps")]["target"] is True
    assert rows[("ttft:32768/auto", "load_ttft_ms")]["target"] is True
    assert doc["failing"] == 2 and doc["targets"]["failing"] == 1                      # host_us 1.5x, TTFT 1.04x
    assert doc["targets"]["worst"]["row"] == "ttft:32768/auto" and doc["targets"]["rounds"] == [1]
    assert doc["geomean_by_section"]["transfer:sweep host_us"] == 1.5
    assert ab_trees.is_target("connector:submit/w/load", "host_us_busy")
    assert not ab_trees.is_target("connector:worker_bidir/w", "host_us")


def test_driver_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    p = subprocess.run(["bash", os.path.join(ROOT, "profiling", "bench", "ab_trees.sh"), "--dry-run", ROOT],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    for t in ("before", "after"):
        for what in ("bench_transfer --help ok", "bench_ttft --help ok", "check ok", "connector args ok"):
            assert f"{t} {what}" in p.stdout, p.stdout
    assert "FAILED" not in p.stdout
    assert os.path.exists(os.path.join(str(tmp_path), "ab_trees", "summary.json"))
