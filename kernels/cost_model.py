"""Cost model behind method="auto", and its calibration.

Predicted time of a job = fixed latency of the method + bytes / bandwidth,
with bandwidth a function of the *descriptor* size (piecewise-linear in
log2 bytes). For the SM kernels the descriptor is the block; for DMA it is a
coalesced run; for "staged" it is a run on the host side only.

Idle GPU: pick the fastest method. Busy GPU (compute queued on the current
stream): pick among the paths whose SMs touch only HBM (dma, staged), because
SM stores into host memory slow a concurrent GEMM far more than DMA does (the figures:
docs/design/power-cap.md, docs/design/cost-model-rules.md).

Calibration (`python -m kernels calibrate`, kernels.calibration) measures the table on
the device at hand and caches it in ~/.cache/kvoffload/calib-<gpu>.json (override the
folder with KVO_CACHE_DIR). Without it, DEFAULT_TABLE is used: the shipped
calibration of an H200 (kernels/default_calibration.json).
"""
from __future__ import annotations

import bisect
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Iterable


# The documented default: a calibration of an H200 (PCIe Gen5 x16) shipped with the
# package, used when the device has no cached calibration of its own.
_DEFAULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_calibration.json")
with open(_DEFAULT_PATH) as _f:
    DEFAULT_TABLE = json.load(_f)


def _cache_dir() -> str:
    return os.environ.get("KVO_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "kvoffload"))


def calib_path(device_name: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") or "device"
    return os.path.join(_cache_dir(), f"calib-{slug}.json")


def count_step(x: int | None) -> int | None:
    """A run (descriptor) count in the 1/16-octave steps that `CostModel.choose` decides on:
    two counts with one step get one answer, so callers may remember answers keyed on it."""
    return None if not x else round(math.log2(x) * 16)


_step = count_step
# count_step for every count below 2**14, as a list: CostModel.dma_either_way keys its
# remembered answers (dma_both) on it by indexing, without a Python call
STEPS: list = [count_step(x) for x in range(1 << 14)]
# kernels.native.pack_submit_native's mode for each (idle, busy) pick of CostModel.pack_modes:
# PACK_DIRECT (0: the pack kernel straight to or from the host), PACK_AUTO (1: direct while
# compute is idle, the staged pipeline while it runs; the submitter observes which), PACK_STAGED (2)
PACK_SUBMIT_MODES = {("cuda", "cuda"): 0, ("cuda", "staged"): 1, ("staged", "staged"): 2}


def _unstep(k: int | None) -> int | None:
    return None if k is None else max(1, round(2.0 ** (k / 16)))


_UNSEEN, _SEEN_ONCE = object(), object()


def _max_with_step_at_most(k: int) -> int:
    """The largest run count r with _step(r) <= k (0 for k < 0: no count qualifies)."""
    if k < 0:
        return 0
    r = int(2.0 ** ((k + 0.5) / 16)) + 1
    while r > 1 and _step(r) > k:
        r -= 1
    return r


@dataclass
class CostModel:
    table: dict = field(default_factory=lambda: json.loads(json.dumps(DEFAULT_TABLE)))
    # dma_either_way's answers (a plain attribute: hot paths read it inline, without a call)
    dma_both: dict = field(default_factory=dict, repr=False, compare=False)
    # kernel_limits' settled answers, per `available` tuple: {(d, block_bytes, n): limits}
    # (settled_limits hands a table out; hot paths read it inline, without a call)
    settled: dict = field(default_factory=dict, repr=False, compare=False)

    def bandwidth(self, d: str, method: str, desc_bytes: float, n: int | None = None) -> float:
        """GB/s for descriptors of `desc_bytes` (log-linear interpolation, clamped at the ends
        like np.interp), in a job of `n` descriptors.

        Current tables hold two curves per method: "gbps" measured on jobs of
        `budget_bytes` (1 GiB: thousands of descriptors) and "gbps_small" on jobs of
        `small_count` (1000) descriptors; a job in between reads the two interpolated in
        log2(n), and n=None reads "gbps". Small jobs differ: their host submit does not hide
        behind the copy, so the same descriptor size runs several times slower in a
        1000-descriptor job than in a big one (docs/design/cost-model-rules.md). Curves are
        read from the table once: this runs on every `auto` job whose shape is new, so it is
        plain Python (numpy's per-call overhead on 13 points outweighs the interpolation)."""
        big = self._interp("gbps", d, method, desc_bytes)
        if n is None or "gbps_small" not in self.table:
            return big
        n_small = float(self.table["small_count"])
        n_big = float(self.table["budget_bytes"]) / max(desc_bytes, 1.0)
        if n >= n_big or n_big <= n_small:  # (at or under small_count both curves are one count)
            return big
        small = self._interp("gbps_small", d, method, desc_bytes)
        if n <= n_small:
            return small
        w = math.log2(n / n_small) / math.log2(n_big / n_small)
        return small + (big - small) * w

    def _interp(self, curve: str, d: str, method: str, desc_bytes: float) -> float:
        curves = self.__dict__.setdefault("_curves", {})
        c = curves.get((curve, d, method))
        if c is None:
            g = self.table[curve].get(d, {})
            c = curves[(curve, d, method)] = (([math.log2(x) for x in self.table["sizes"]],
                                               [float(y) for y in g[method]]) if method in g else ())
        if not c:
            return 0.0
        xs, ys = c
        x = math.log2(max(desc_bytes, 1.0))
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, x)
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])

    def predict_us(self, d: str, method: str, block_bytes: int, n: int, n_desc: int | None = None,
                   n_desc_host: int | None = None) -> float:
        """Predicted microseconds for `n` blocks of `block_bytes`.

        n_desc: descriptors after coalescing both sides (DMA);
        n_desc_host: descriptors after coalescing the host side only (staged).
        """
        total = float(block_bytes) * n
        fixed = self.table["fixed_us"].get(method, 50.0)
        if method == "dma":
            nd = max(1, n_desc or n)
            desc = total / nd
            bw = self.bandwidth(d, "dma", desc, nd)
            adj = self.host_adjacent_fraction(nd, n_desc_host)
            if adj > 0.0 and bw > 0:
                # descriptors that follow each other in host memory run faster than the
                # random-host curve says (docs/design/host-order.md): a time-weighted blend
                # of the two curves, the sequential one scaled to this job's count
                seq = self._interp("gbps_hostseq", d, "dma", desc)
                big = self._interp("gbps", d, "dma", desc)
                if seq > 0 and big > 0:
                    bw_seq = bw * max(1.0, seq / big)
                    return fixed + total * ((1.0 - adj) / bw + adj / bw_seq) / 1e3
        elif method == "staged":
            # measured with random host slots (one DMA per block from contiguous
            # staging); a coalesced host side turns into big DMAs: pipelined, the
            # HBM gather of one chunk hides under the DMA of the other (the 0.97 below: a
            # few percent lost). The table's staged rates come from jobs of many chunks. A
            # job's first chunk has nothing to overlap with and its DMA is issued only after
            # its gather: it moves no faster than plain DMA of its host-side descriptors
            # (one-chunk jobs measured slower than dma: docs/design/cost-model-rules.md).
            nh = max(1, n_desc_host or n)
            desc = total / nh
            lone = 0.97 * self.bandwidth(d, "dma", desc, nh)
            piped = max(self.bandwidth(d, "staged", block_bytes, n), lone)
            first = min(total, float(self.STAGED_CHUNK))
            if lone <= 0 or piped <= 0:
                return float("inf")
            return fixed + first / (lone * 1e3) + (total - first) / (piped * 1e3)
        elif method in ("cuda", "triton"):
            bw = self.bandwidth(d, method, block_bytes, n)
        else:
            bw = 5.0
        if bw <= 0:
            return float("inf")
        return fixed + total / (bw * 1e3)  # GB/s == 1e3 bytes/us

    def host_adjacent_fraction(self, n_desc: int, n_desc_host: int | None) -> float:
        """Fraction of a DMA job's descriptor boundaries where the next descriptor starts
        right after the previous one in host memory (0 without a "gbps_hostseq" curve).

        n_desc descriptors have n_desc - 1 boundaries; n_desc_host host-side runs end at
        n_desc_host - 1 of them, so n_desc - n_desc_host boundaries lie inside a host run."""
        if n_desc_host is None or n_desc <= 1 or "gbps_hostseq" not in self.table:
            return 0.0
        return min(1.0, max(0.0, (n_desc - max(1, n_desc_host)) / (n_desc - 1)))

    def choose(self, d: str, block_bytes: int, n: int, busy: bool, available: Iterable[str],
               n_desc: int | None = None, n_desc_host: int | None = None) -> str:
        # Jobs repeat their shapes (same block size, count, id pattern), so
        # decisions are memoised: the hot path pays one dict lookup. Descriptor counts of
        # random ids differ from job to job, so they are keyed (and decided) in steps of
        # 1/16 octave (a factor 2**(1/16)): the predicted descriptor size moves by at most that.
        key = (d, block_bytes, n, busy, tuple(available), _step(n_desc), _step(n_desc_host))
        memo = self.__dict__.setdefault("_memo", {})
        m = memo.get(key)
        if m is None:
            if len(memo) > 4096:
                memo.clear()
            m = memo[key] = self._choose(d, block_bytes, n, busy, available, _unstep(key[5]), _unstep(key[6]))
        return m

    def _choose(self, d, block_bytes, n, busy, available, n_desc, n_desc_host) -> str:
        avail = [m for m in available if m != "torch"]
        if d in ("h2h",) or not avail:
            return "torch"
        if busy:
            quiet = [m for m in avail if m in ("dma", "staged")]
            avail = quiet or avail
        if d == "d2d":
            avail = [m for m in avail if m != "staged"] or avail
        t = {m: self.predict_us(d, m, block_bytes, n, n_desc, n_desc_host) for m in avail}
        best = min(avail, key=t.__getitem__)
        # DMA-driven paths pay host time per descriptor, and it moves with the host's cache
        # state, so a calibrated small-descriptor DMA rate is not reliable from one run to the
        # next (docs/design/dma-descriptor-cost.md, cost-model-rules.md). So below HOST_RISK_MAX_DESC per
        # descriptor a kernel keeps a near tie (HOST_RISK_SLACK), and staged, which submits the
        # same host-side descriptors as dma plus a gather, must clearly beat dma to be taken.
        # (From 64 KiB descriptors on, a descriptor's copy outlasts its submit: no such risk.)
        if best == "staged" and "dma" in t and t["dma"] <= t["staged"] * (1 + self.HOST_RISK_SLACK):
            best = "dma"
        # Nor can staged beat dma where the host side coalesces no better than both sides do
        # (random host slots): it submits as many descriptors, plus an SM gather or scatter. A
        # table that puts it ahead there measured noise: across sweeps the staged/dma ratio of
        # 4 KiB D2H scattered around 1 as the host's DMA submit rate swung between jobs
        # (docs/design/cost-model-rules.md).
        if best == "staged" and "dma" in t and (n_desc_host or n) >= (n_desc or n):
            best = "dma"
        if best in ("dma", "staged"):
            nd = max(1, (n_desc if best == "dma" else n_desc_host) or n)
            kernels = [m for m in avail if m in ("cuda", "triton")]
            if kernels and block_bytes * n / nd < self.HOST_RISK_MAX_DESC:
                k = min(kernels, key=t.__getitem__)
                if t[k] <= t[best] * (1 + self.HOST_RISK_SLACK):
                    best = k
        # DMA uses no SMs and a few driver calls per job (staged: a Python-driven pipeline of
        # ~32 MiB steps, milliseconds of host time for a 2 GB job), so for big blocks, where it
        # runs at line rate, it wins a near-tie: within DMA_TIE_SLACK of the fastest, which
        # keeps auto within the 5% target of the best. Below DMA_TIE_MIN_BLOCK the measured
        # DMA rate varies more than the slack between runs (docs/design/cost-model-rules.md).
        if block_bytes >= self.DMA_TIE_MIN_BLOCK and "dma" in t \
                and t["dma"] <= t[best] * (1 + self.DMA_TIE_SLACK):
            return "dma"
        return best

    def dma_either_way(self, d: str, block_bytes: int, n: int, available: tuple, n_desc: int | None,
                       n_desc_host: int | None) -> bool:
        """Whether `choose` picks "dma" for this job both with compute idle and busy: a caller that
        does not look at the GPU (the connector's native submit thread) may then hand it to DMA.
        `available` is a tuple (part of the key), n_desc / n_desc_host the job's run counts.

        The one place that decides and remembers the answer: in `dma_both`, keyed (d,
        block_bytes, n, count_step(n_desc), count_step(n_desc_host), available), the steps
        `choose` itself decides on. That key is public: a hot path may read `dma_both` inline
        (counts below 2**14 stepped by indexing STEPS) and call this only when the answer is
        absent; such a reader never stores into `dma_both` (the worker's native fast path does
        this: tests/test_layers_once.py checks its key against this one)."""
        s = STEPS
        if n_desc is not None and n_desc_host is not None and n_desc < len(s) and n_desc_host < len(s):
            key = (d, block_bytes, n, s[n_desc], s[n_desc_host], available)
            ok = self.dma_both.get(key)
            if ok is not None:
                return ok
        else:
            key = (d, block_bytes, n, _step(n_desc), _step(n_desc_host), available)
        memo = self.dma_both
        ok = memo.get(key)
        if ok is None:
            if len(memo) > 4096:
                memo.clear()
            ok = memo[key] = (self.choose(d, block_bytes, n, False, available, n_desc=n_desc, n_desc_host=n_desc_host)
                              == "dma" and
                              self.choose(d, block_bytes, n, True, available, n_desc=n_desc, n_desc_host=n_desc_host)
                              == "dma")
        return ok

    # ---- per-layer pack jobs (layout.KVBlockMover and the connector's pack paths)
    def choose_pack(self, host: bool, busy: bool) -> str:
        """`auto` for a per-layer pack/unpack (every fragment of N blocks gathered into, or
        scattered from, unified blocks): "staged" when the unified side is host memory and
        compute is running (the gather then stays in HBM and DMA carries the bytes: SM stores
        into host memory slow concurrent compute far more than DMA does), else "cuda" (one
        gather launch straight to or from the host). The only place this rule lives; whole
        unified blocks (a block-outer layout) are block copies and take `choose` instead."""
        return "staged" if (host and busy) else "cuda"

    def pack_modes(self, host: bool = True) -> tuple[str, str]:
        """(idle pick, busy pick) of choose_pack: what a native submitter is handed, which then
        only observes whether compute is running (kernels/csrc/dma_submitter.h, kPackAuto)."""
        return self.choose_pack(host, False), self.choose_pack(host, True)

    def pack_submit_mode(self, host: bool = True) -> int:
        """`auto`'s pick for a per-layer pack job as kernels.native.pack_submit_native's mode
        (PACK_SUBMIT_MODES: 0 direct, 1 direct while idle / staged while compute runs, 2 staged).
        The submitter and the inline pack call are handed this; they keep no rule of their own."""
        return PACK_SUBMIT_MODES[self.pack_modes(host)]

    def settled_limits(self, available: Iterable[str]) -> dict:
        """The table of kernel_limits' settled answers for `available`, {(d, block_bytes, n):
        limits}, filled as kernel_limits settles shapes: a hot path keeps it and looks a shape up
        inline (a miss: call kernel_limits). The same dict for as long as this model lives."""
        return self.settled.setdefault(tuple(available), {})

    def kernel_limits(self, d: str, block_bytes: int, n: int, available: Iterable[str]) -> tuple[int, int] | None:
        """For an idle GPU: (max_runs_both, max_runs_host) such that `choose` picks "cuda"
        whenever runs_both > max_runs_both and runs_host > max_runs_host; None if it does not
        pick "cuda" even for ids that do not coalesce at all.

        This lets `auto` hand a small-block job straight to the fused C++ check + stage +
        launch (IndexRing.copy_blocks), which counts the runs in its id pass and gives the job
        back, unqueued, only when it coalesces enough for DMA or staged to be worth weighing:
        one C++ call instead of a check, a choice and a launch (an idle GPU waits on that host
        time, a sizeable share of a small job: docs/design/cost-model-rules.md). DMA's predicted time depends on
        runs_both (and, with a "gbps_hostseq" curve, falls as runs_host falls: it is scanned
        at its best, one host run) and staged's on runs_host only; both are scanned over
        choose's 1/16-octave steps, with a 2% margin (plus the DMA tie slack) so near-ties are weighed by
        `choose` itself. The first job of a shape gets None (the ordinary path); limits are
        worked out when the shape comes again."""
        available = tuple(available)
        key = (d, block_bytes, n, available)
        lm = self.__dict__.setdefault("_limits", {})
        res = lm.get(key, _UNSEEN)
        if res is not _UNSEEN and res is not _SEEN_ONCE:
            # settled: back into the hot paths' table too (it may have been cleared since; a hot
            # path calls here only on a miss of that table)
            self._settle(available, d, block_bytes, n, res)
            return res
        if len(lm) > 4096:
            lm.clear()
        if res is _UNSEEN:
            # the scan costs far more than a job's submit: spent on shapes that repeat, not on one-off jobs
            lm[key] = _SEEN_ONCE
            return None
        res = None
        if n >= 1 and self.choose(d, block_bytes, n, False, available, n_desc=n, n_desc_host=n) == "cuda":
            t_kernel = self.predict_us(d, "cuda", block_bytes, n)
            slack = 0.02 + (self.DMA_TIE_SLACK if block_bytes >= self.DMA_TIE_MIN_BLOCK else 0.0)
            res = []
            for method, kw in (("dma", "n_desc"), ("staged", "n_desc_host")):
                top = -1  # highest step at which `method` comes within the margin of cuda
                if method in available and not (method == "staged" and d == "d2d"):
                    # dma at its best host pattern (every descriptor host-adjacent): its time
                    # only grows with more host runs, so no host pattern brings it nearer
                    best_host = {"n_desc_host": 1} if method == "dma" else {}

                    def near(k):
                        return self.predict_us(d, method, block_bytes, n, **{kw: _unstep(k)}, **best_host) \
                            <= t_kernel * (1 + slack)
                    if self._dma_curve_rises(d):
                        # fewer runs, bigger descriptors, no slower: near() holds up to a step, then never
                        lo, hi = 0, _step(n) + 1
                        while lo < hi:
                            mid = (lo + hi) // 2
                            lo, hi = (mid + 1, hi) if near(mid) else (lo, mid)
                        top = lo - 1
                    else:
                        top = next((k for k in range(_step(n), -1, -1) if near(k)), -1)
                res.append(_max_with_step_at_most(top))
            res = tuple(res)
        lm[key] = res
        self._settle(available, d, block_bytes, n, res)
        return res

    def _settle(self, available: tuple, d: str, block_bytes: int, n: int, res) -> None:
        """Puts a settled kernel_limits answer in settled_limits' table (cleared, in place, at 4096)."""
        st = self.settled.setdefault(available, {})
        if len(st) >= 4096:
            st.clear()
        st[(d, block_bytes, n)] = res

    def limits_settled(self, d: str, block_bytes: int, n: int, available: Iterable[str]) -> bool:
        """Whether kernel_limits has worked out (d, block_bytes, n, available): its answer
        will not change (the first sight of a shape answers None without working it out)."""
        res = self.__dict__.get("_limits", {}).get((d, block_bytes, n, tuple(available)), _UNSEEN)
        return res is not _UNSEEN and res is not _SEEN_ONCE

    def _dma_curve_rises(self, d: str) -> bool:
        # dma's and staged's predicted times depend on the run count only through the DMA
        # curve: if its GB/s never drop with the descriptor size, they only grow with runs
        # (with a per-count curve, rate also moves with the run count itself: no such shortcut)
        if "gbps_small" in self.table or "gbps_hostseq" in self.table:
            return False
        ys = self.table["gbps"].get(d, {}).get("dma", [])
        return all(b >= a for a, b in zip(ys, ys[1:]))

    DMA_TIE_SLACK = 0.04
    HOST_RISK_SLACK = 0.06
    HOST_RISK_MAX_DESC = 64 << 10
    STAGED_CHUNK = 32 << 20  # BlockCopier.staged_chunk_bytes: the staged pipeline's step
    DMA_TIE_MIN_BLOCK = 1 << 20

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.table, f, indent=1)


def load_cost_model(device: object) -> CostModel:  # a torch.device, or anything torch.device() takes
    """The cached calibration for this device's GPU model, else the defaults."""
    try:
        import torch

        if getattr(device, "type", "cpu") == "cuda":
            p = calib_path(torch.cuda.get_device_name(device))
            if os.path.exists(p):
                with open(p) as f:
                    return CostModel(json.load(f))
    except Exception:
        pass
    return CostModel()
