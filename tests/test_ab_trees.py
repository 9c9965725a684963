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
