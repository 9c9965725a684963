"""PNG plots of the end-to-end results, drawn from their JSON (so a plot can be redrawn
from committed results: `python -m profiling.analysis.plots ttft throughput throughput_fig6 multi_gpu`).
Matplotlib is optional: without it, benchmarks skip the plot and say so."""
from __future__ import annotations

import json
import os
import sys

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")  # profiling/results


def save_png(fig, path: str, dpi: int = 110) -> str:
    """Saves a figure as a 256-colour PNG (a third of the size of matplotlib's RGBA output for
    line plots, the same to the eye), so committed plots stay small."""
    import io

    from PIL import Image  # matplotlib depends on Pillow

    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    return path


def _title(doc, what):
    m = doc["meta"]
    return f"{what}\n{m.get('gpu', 'CPU')}, {m['date'][:10]}, sha {m['git_sha'][:10]}"


def _ttft(doc, ax):
    rows = doc["rows"]
    x = [r["len"] for r in rows]
    ax.plot(x, [r["recompute_s"] * 1e3 for r in rows], "k-o", label="recompute")
    for m in ("dma", "cuda", "triton", "auto"):
        if f"load_{m}_s" in rows[0]:
            ax.plot(x, [r[f"load_{m}_s"] * 1e3 for r in rows], "-o", ms=3, label=f"load {m}")
    if "floor_s" in rows[0]:
        ax.plot(x, [r["floor_s"] * 1e3 for r in rows], "k--", label="floor (KV / big H2D + 1-token forward)")
    ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="TTFT (ms)")
    ax.set_title(_title(doc, f"TTFT, {doc.get('model')}: recompute vs load from CPU"))


def _throughput(doc, ax):
    rows = [r for r in doc["rows"] if r["mode"] != "no-offload"]
    base = next((r["tokens_per_s"] for r in doc["rows"] if r["mode"] == "no-offload"), None)
    for m in dict.fromkeys(r["mode"] for r in rows):
        rs = [r for r in rows if r["mode"] == m]
        ax.plot([r["hit_pct"] for r in rs], [r["tokens_per_s"] for r in rs], "-o", ms=3, label=f"offload, {m}")
    if base is not None:  # a run split over calls (--no-baseline) has it in another part
        ax.axhline(base, color="k", ls="--", label="no offload")
    ax.set(xlabel="CPU hit rate (%)", ylabel="prompt tokens / s", yscale="log")
    ax.set_title(_title(doc, f"Throughput, {doc.get('model')}, {doc.get('requests')} x {doc.get('prompt_len')} tokens, "
                             f"max_seqs {doc.get('max_seqs', '?')}"))


def _multi_gpu(doc, ax):
    kinds = ["d2h", "h2d", "both"]
    n = doc["gpus"]
    width = 0.8 / (n + 2)
    for j, who in enumerate([str(d) for d in range(n)] + ["all"]):
        vals = [next(r["gbps"] for r in doc["rows"] if r["kind"] == k and r["gpus"] == who) for k in kinds]
        ax.bar([i + j * width for i in range(3)], vals, width, label=f"GPU {who} alone" if who != "all" else "all at once")
    sums = [next(r["sum_alone_gbps"] for r in doc["rows"] if r["kind"] == k and r["gpus"] == "all") for k in kinds]
    ax.bar([i + (n + 1) * width for i in range(3)], sums, width, color="lightgray", label="sum alone")
    ax.set_xticks([i + width * (n + 1) / 2 for i in range(3)], kinds)
    ax.set(ylabel="GB/s")
    how = {"tp": "one process per GPU", "pinned": "torch pinned region"}.get(doc.get("pool"), "HostPool, one process")
    ax.set_title(_title(doc, f"{n} GPUs, one pinned host pool ({how})"))


def _connector(doc, ax):
    labels, vals, colors = [], [], []
    p = next((r for r in doc["rows"] if r["section"] == "pool"), None)
    if p:
        labels += ["pool first usable (s)", "pool fully pinned (s)", "cudaHostAlloc (s)"]
        vals += [p["first_usable_s"], p["all_pinned_s"], p["cuda_host_alloc_s"]]
        colors += ["C0", "C0", "gray"]
    w = next((r for r in doc["rows"] if r["section"] == "worker_bidir"), None)
    if w:
        labels += ["worker bidir (GB/s / 10)", "bidir reference (GB/s / 10)"]
        vals += [w["gbps"] / 10, w["ref_bidir_gbps"] / 10]
        colors += ["C1", "gray"]
    for r in (r for r in doc["rows"] if r["section"] == "submit"):
        labels.append(f"submit {r['worker']} {r['kind']} (ms)")
        vals.append(r["host_us"] / 1e3)
        colors.append("C2")
    ax.barh(labels, vals, color=colors)
    ax.invert_yaxis()
    ax.set_title(_title(doc, "Offload engine: pool start-up, worker bidirectional, submit cost"))


def _ce_contention(doc, ax):
    rows = doc["rows"]
    ax.barh([f"{r['small_copy']}\nbehind {r['bulk']}" for r in rows], [r["median_ms"] for r in rows], color="tab:blue")
    ax.set_xscale("log")
    ax.set_xlabel("host time of the small copy, ms (median of 5, log scale)")
    ax.set_title(_title(doc, "small per-step copies while a bulk copy runs"))


def _ids_uva(doc, ax):
    import numpy as np
    rows = [r for r in doc["rows"] if r["section"] == "ab"]
    for d, wl, c in (("d2h", "1000 blocks", "tab:blue"), ("h2d", "1000 blocks", "tab:red"),
                     ("d2h", "1 GiB", "tab:cyan"), ("h2d", "1 GiB", "tab:orange")):
        sizes = sorted({r["block_bytes"] for r in rows if r["dir"] == d and r["workload"] == wl})
        gain = [np.median([u["gbps"] - x["gbps"] for u in rows for x in rows
                           if u["ids"] == "uva" and x["ids"] == "upload" and u["pass"] == x["pass"]
                           and u["dir"] == x["dir"] == d and u["workload"] == x["workload"] == wl
                           and u["block_bytes"] == x["block_bytes"] == bb]) for bb in sizes]
        ax.plot([bb >> 10 for bb in sizes], gain, "-o", color=c, label=f"{d.upper()}, {wl}")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size, KiB (cuda kernel, warp shape, random ids)")
    ax.set_ylabel("GB/s with ids read through UVA minus uploaded (median over passes)")
    ax.set_title(_title(doc, "block ids through UVA vs uploaded"))


def _dma_lanes(doc, ax):
    rows = [r for r in doc["rows"] if r["section"] == "lanes" and r["mode"] == "batch"]
    for d, ls in (("d2h", "-"), ("h2d", "--")):
        for lanes, c in ((1, "tab:gray"), (2, "tab:blue"), (4, "tab:red")):
            rs = sorted((r for r in rows if r["dir"] == d and r["lanes"] == lanes), key=lambda r: r["block_bytes"])
            ax.plot([r["block_bytes"] >> 10 for r in rs], [100 * r["of_ref"] for r in rs], ls, color=c, marker="o",
                    label=f"{d.upper()}, {lanes} lane{'s' if lanes > 1 else ''}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size, KiB (1 GiB of random blocks per job)")
    ax.set_ylabel("% of the same-run big pinned copy")
    ax.set_title(_title(doc, "one DMA job over several copy-engine streams"))


def _cold_submit(doc, ax):
    rows = doc["rows"]
    waits = list(dict.fromkeys(r["wait"] for r in rows))
    ops = list(dict.fromkeys(r["op"] for r in rows))
    w = 0.8 / len(ops)
    for i, o in enumerate(ops):
        ax.bar([k + i * w for k in range(len(waits))],
               [next(r["median_us"] for r in rows if r["wait"] == wt and r["op"] == o) for wt in waits], w, label=o)
    ax.set_xticks([k + w * (len(ops) - 1) / 2 for k in range(len(waits))], waits, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("host us of the op right after the wait (median, log scale)")
    ax.set_title(_title(doc, "host work right after different waits"))


def _dma_per_call(doc, ax):
    rows = doc["rows"]
    bb = rows[0]["block_bytes"]
    for d, ls in (("d2h", "-"), ("h2d", "--")):
        for meth, c in (("dma", "tab:blue"), ("staged", "tab:red")):
            rs = sorted(((int(r["variant"].split("=")[1]), r) for r in rows
                         if r["dir"] == d and r["variant"].startswith(f"{d} {meth} per_call=")), key=lambda t: t[0])
            ax.plot([k for k, _ in rs], [100 * r["of_ref"] for _, r in rs], ls, color=c, marker="o",
                    label=f"{d.upper()} {meth}" + (", one stream" if meth == "dma" else ""))
    ax.axvline(doc.get("default_max_desc_per_call", 512), color="gray", lw=0.8, label="default")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"descriptors per cudaMemcpyBatchAsync call (1 GiB of random {bb >> 10} KiB blocks)")
    ax.set_ylabel("% of the same-run big pinned copy (idle GPU to completion)")
    ax.set_title(_title(doc, "DMA job time against the batch call's size"))


DRAW = {"dma_per_call_4096": _dma_per_call, "dma_per_call_32768": _dma_per_call, "cold_submit": _cold_submit, "dma_lanes": _dma_lanes, "ids_uva": _ids_uva, "ce_contention": _ce_contention, "connector": _connector, "ttft": _ttft, "throughput": _throughput, "throughput_fig6": _throughput, "multi_gpu": _multi_gpu,
        "multi_gpu_pinned": _multi_gpu, "multi_gpu_tp": _multi_gpu,
        "multi_gpu_tp_2886728": _multi_gpu}


def plot_fig2_10k(out_dir: str | None = None) -> str | None:
    """throughput_10k.png: Fig. 2 at 10,000 requests from its parts (throughput_10k_<rates>.json,
    a few hit rates per device call), each part's points marked, no-offload runs as lines."""
    import glob
    out_dir = out_dir or os.environ.get("KVO_RESULTS", RESULTS)
    docs = sorted((json.load(open(p)) for p in glob.glob(os.path.join(out_dir, "throughput_10k_*.json"))),
                  key=lambda d: d["meta"]["date"])
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    if not docs:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = sorted((r["hit_pct"], r["tokens_per_s"]) for d in docs for r in d["rows"] if r["mode"] == "auto")
    ax.plot([p for p, _ in pts], [t for _, t in pts], "-", color="tab:blue", label="offload, auto")
    for i, d in enumerate(docs):
        rs = [r for r in d["rows"] if r["mode"] == "auto"]
        ax.plot([r["hit_pct"] for r in rs], [r["tokens_per_s"] for r in rs], "os^"[i % 3], ms=5,
                label=f"part {i + 1}: sha {d['meta']['git_sha'][:7]}, {d['meta']['date'][11:16]} UTC")
        b = next((r["tokens_per_s"] for r in d["rows"] if r["mode"] == "no-offload"), None)
        if b is not None:
            ax.axhline(b, color="k", ls="--", lw=0.8, label=f"no offload (part {i + 1})")
    d0 = docs[0]
    ax.set(xlabel="CPU hit rate (%)", ylabel="prompt tokens / s", yscale="log")
    ax.set_title(_title(d0, f"Fig. 2, {d0.get('model')}, {d0.get('requests')} x {d0.get('prompt_len')} tokens "
                            f"(windows of {d0.get('window')}), {len(docs)} device calls"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, "throughput_10k.png")
    save_png(fig, path)
    plt.close(fig)
    return path


def plot(name: str, out_dir: str | None = None) -> str | None:
    out_dir = out_dir or os.environ.get("KVO_RESULTS", RESULTS)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot (pip install matplotlib)")
        return None
    doc = json.load(open(os.path.join(out_dir, f"{name}.json")))
    fig, ax = plt.subplots(figsize=(8, 5))
    DRAW[name.split("_max")[0] if name not in DRAW else name](doc, ax)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    save_png(fig, path)
    plt.close(fig)
    return path


if __name__ == "__main__":
    for n in sys.argv[1:]:
        print(plot_fig2_10k() if n == "throughput_10k" else plot(n))
