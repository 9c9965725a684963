"""Brings a device run's results into profiling/results/, keeping one line of history per replaced run.

    python -m profiling.analysis.history add DIR [--dry-run]   # DIR: a device_run.sh output (its results.tgz unpacked)
    python -m profiling.analysis.history show transfer          # the history of one benchmark

For every file in DIR that replaces a committed one (same name), the committed file's meta (file,
sha, date, GPU) and headline figures are appended to results/history/<name>.jsonl before the new
file is copied in: for JSON results with targets, the target lines as summarize computes them; for
other JSON, its references and row count; for logs, the pytest summary line or the lines that carry
figures. CSVs and traces are not copied (results/.gitignore).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil

from profiling.analysis import summarize

R = summarize.R
HISTORY = os.path.join(R, "history")
SKIP = (".csv", ".nsys-rep", ".sqlite", ".tgz")
PICTURES = (".png", ".svg")
TARGETS = {  # result name -> the summarize function whose target lines are its headline
    "transfer": summarize.transfer, "transfer_quick": summarize.transfer, "layout": summarize.layout,
    "connector": summarize.connector, "ttft": summarize.ttft,
    "throughput": lambda d: summarize.throughput(d, "Throughput"),
    "throughput_fig6": lambda d: summarize.throughput(d, "Fig. 6", True),
}
KEY = re.compile(r"GB/s|passed|failed|error|SUMMARY|exit|hazard|Xid|segfault|us/desc", re.I)


def _targets(lines: list) -> list:
    out = []
    for ln in lines:
        m = re.match(r"^\| (.+) \| (.*) \| (met|NOT met) \|$", ln)
        if m:
            out.append({"target": m.group(1), "measured": m.group(2), "met": m.group(3) == "met"})
    return out


def headline(path: str) -> dict:
    """One history record of a results file: what it is, when, where, and its key figures."""
    name, ext = os.path.splitext(os.path.basename(path))
    rec: dict = {"file": os.path.basename(path)}
    if ext == ".json":
        doc = json.load(open(path))
        m = doc.get("meta", {})
        rec.update(sha=m.get("git_sha", "")[:12] or None, date=m.get("date"), gpu=m.get("gpu"))
        if isinstance(doc.get("reference_gbps"), dict):
            rec["reference_gbps"] = {k: round(v, 2) for k, v in doc["reference_gbps"].items()}
        fn = TARGETS.get(name)
        if fn:
            try:
                rec["targets"] = _targets(fn(doc))
            except (KeyError, TypeError, ValueError, IndexError) as e:  # an older run's format
                rec["note"] = f"targets not extracted ({type(e).__name__}: {e})"
        if isinstance(doc.get("rows"), list):
            rec["rows"] = len(doc["rows"])
        return rec
    text = open(path, errors="replace").read()
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    if lines and lines[0].startswith("#"):
        rec["header"] = lines[0][:300]
        d = re.search(r"\d{4}-\d{2}-\d{2}(?:T\d{2}:\d{2}(?::\d{2})?Z?)?", lines[0])
        sha = re.search(r"sha (\w+)", lines[0])
        rec.update(date=d.group(0) if d else None, sha=sha.group(1) if sha else None)
    summ = [ln.strip("= ") for ln in lines if re.search(r"\d+ (passed|failed)", ln)]
    if summ:
        rec["summary"] = summ[-1]
        rec["failed"] = [ln for ln in lines if ln.startswith("FAILED ")][:10]
    else:
        rec["lines"] = [ln[:200] for ln in lines if KEY.search(ln) and not ln.startswith("#")][:16] or \
            [ln[:200] for ln in lines if not ln.startswith("#")][:14]
    return rec


def add(src: str, dry_run: bool = False) -> list:
    """Copies src's results into R; each replaced file's headline goes to history first."""
    done = []
    for f in sorted(os.listdir(src)):
        p = os.path.join(src, f)
        if not os.path.isfile(p) or f.endswith(SKIP):
            continue
        old = os.path.join(R, f)
        if os.path.exists(old) and not f.endswith(PICTURES):  # a plot's history is its JSON's
            rec = headline(old)
            name = os.path.splitext(f)[0]
            if not dry_run:
                os.makedirs(HISTORY, exist_ok=True)
                with open(os.path.join(HISTORY, f"{name}.jsonl"), "a") as h:
                    h.write(json.dumps(rec, separators=(",", ":")) + "\n")
        if not dry_run:
            shutil.copyfile(p, old)
        done.append(f)
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a_add = sub.add_parser("add", help="copy a run's results in, history first")
    a_add.add_argument("dir")
    a_add.add_argument("--dry-run", action="store_true")
    a_show = sub.add_parser("show", help="print one benchmark's history")
    a_show.add_argument("name")
    a = ap.parse_args()
    if a.cmd == "add":
        for f in add(a.dir, a.dry_run):
            print(("would copy " if a.dry_run else "copied ") + f)
    else:
        p = os.path.join(HISTORY, f"{a.name}.jsonl")
        for ln in open(p):
            r = json.loads(ln)
            t = r.get("targets") or []
            met = f"{sum(x['met'] for x in t)}/{len(t)} targets met" if t else (r.get("summary") or "")
            print(f"{(r.get('date') or '?')[:19]:<19} {(r.get('sha') or '?')[:10]:<10} {r.get('gpu') or '':<12} "
                  f"{r['file']:<32} {met}")


if __name__ == "__main__":
    main()
