"""The trace analysis on synthetic Nsight SQLite and torch.profiler traces with known answers."""
import json
import sqlite3

import pytest

from profiling.analysis.analyze_trace import analyze, intersect, load_sqlite, load_torch_json, union

MS = 1_000_000


def test_interval_math():
    assert union([[5, 7], [0, 2], [1, 3], [7, 9]]) == [[0, 3], [5, 9]]
    assert intersect([[0, 10], [20, 30]], [[5, 25]]) == [[5, 10], [20, 25]]


def make_sqlite(path):
    con = sqlite3.connect(path)
    con.executescript("""
      create table StringIds(id integer, value text);
      create table NVTX_EVENTS(start integer, end integer, text text, textId integer);
      create table CUPTI_ACTIVITY_KIND_KERNEL(start integer, end integer, demangledName integer, shortName integer);
      create table CUPTI_ACTIVITY_KIND_MEMCPY(start integer, end integer, copyKind integer, bytes integer);
    """)
    con.executemany("insert into StringIds values (?, ?)", [(1, "ampere_bf16_gemm"), (2, "void kvo::copy_blocks_kernel<int4>(...)"),
                                                          (3, "engine.forward seqs=4")])
    con.executemany("insert into NVTX_EVENTS values (?, ?, ?, ?)",
                    [(0, 10 * MS, None, 3), (20 * MS, 30 * MS, "engine.forward seqs=7", None),
                     (1 * MS, 2 * MS, "kvo.copy d2h dma n=12", None)])
    # compute 0-10 ms; DMA H2D 5-15 ms (1 GB); DMA D2H 8-12 ms (0.2 GB); SM copy kernel 20-22 ms (no compute then)
    con.executemany("insert into CUPTI_ACTIVITY_KIND_KERNEL values (?, ?, ?, ?)", [(0, 10 * MS, 1, 1), (20 * MS, 22 * MS, 2, 2)])
    con.executemany("insert into CUPTI_ACTIVITY_KIND_MEMCPY values (?, ?, ?, ?)",
                    [(5 * MS, 15 * MS, 1, 1_000_000_000), (8 * MS, 12 * MS, 2, 200_000_000)])
    con.commit()


def test_nsys_sqlite(tmp_path):
    p = str(tmp_path / "t.sqlite")
    make_sqlite(p)
    r = analyze(load_sqlite(p))
    assert r["ranges"]["engine.forward seqs=#"]["count"] == 2
    assert r["ranges"]["engine.forward seqs=#"]["total_ms"] == pytest.approx(20.0)
    assert r["copy_ms"] == pytest.approx(12.0)          # 5-15 and 20-22
    assert r["compute_ms"] == pytest.approx(10.0)       # the SM copy kernel is not compute
    assert r["copy_compute_overlap_pct"] == pytest.approx(100 * 5 / 12)
    assert r["pcie"]["h2d"]["gbps"] == pytest.approx(100.0)  # 1 GB / 10 ms
    assert r["pcie"]["d2h"]["gbps"] == pytest.approx(50.0)
    assert r["bidirectional_ms"] == pytest.approx(4.0)


def test_torch_trace(tmp_path):
    ev = [{"ph": "X", "cat": "user_annotation", "name": "kvo.store.submit job=3 n=8", "ts": 0, "dur": 50},
          {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 1000},
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 500, "dur": 1000,
           "args": {"bytes": 50_000_000}}]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    r = analyze(load_torch_json(str(p)))
    assert r["ranges"]["kvo.store.submit job=# n=#"]["count"] == 1
    assert r["copy_compute_overlap_pct"] == pytest.approx(50.0)
    assert r["pcie"]["d2h"]["gbps"] == pytest.approx(50.0)


def test_report_says_why_kvo_ranges_may_be_missing(tmp_path):
    """A trace without kvo.* ranges (no NVTX tool injected, KVO_NVTX unset) says so in the
    report; one with them does not."""
    from profiling.analysis.analyze_trace import report

    p = str(tmp_path / "t.sqlite")
    make_sqlite(p)
    res = analyze(load_sqlite(p))
    assert "no kvo.* ranges" not in report(res)
    res["ranges"] = {k: v for k, v in res["ranges"].items() if not k.startswith("kvo.")}
    assert "no kvo.* ranges" in report(res) and "KVO_NVTX=1" in report(res)
