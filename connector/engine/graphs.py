"""CUDA graphs for the engine's small paged forwards (decode, prefix hits, loads).

A 16-token forward of the 8B model is hundreds of launches, each paid in Python and driver
time, so it is host-bound (docs/design/engine-host-path.md). A captured graph replays them
with one launch.

Everything a replay depends on is either in the key (token count, batch size, the paged
plan's grid and table width) or in one static int64 device buffer that each call refills
with a single upload (connector.engine.io): tokens, positions, cache slots, last-token rows and the
paged-attention metadata. A shape is captured on its `capture_after`-th occurrence (a shape
seen once is not worth the warm-up and capture); at most `max_graphs` are kept, LRU.

Only batches of up to `max_seqs` sequences (default 1: the latency path, a prompt's forward
after its prefix was loaded, and single-stream decode) are captured. Batched steps vary in
shape from step to step, so lazy capture would rarely be reused, and their GPU work already
outweighs the launches. (A run capturing every batch was slower, but it also compiled Triton
kernels inside its timed region, so the cost of batched capture itself is not isolated:
docs/design/engine-host-path.md.)
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import numpy as np
import torch

from kernels.tracing import nvtx_range

from .io import upload


class GraphRunner:
    def __init__(self, device: torch.device, max_tokens: int = 256, max_seqs: int = 1, max_graphs: int = 16,
                 capture_after: int = 2):
        self.device = torch.device(device)
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.max_graphs = max_graphs
        self.capture_after = capture_after
        self.graphs: OrderedDict = OrderedDict()   # key -> (graph, static buffer, static output)
        self.seen: dict = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.stats = {"captures": 0, "replays": 0, "eager": 0}

    def applies(self, num_tokens: int, num_seqs: int) -> bool:
        return num_tokens <= self.max_tokens and num_seqs <= self.max_seqs

    def run(self, key: tuple, flat: np.ndarray, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """fn(buf) runs the forward reading only `buf` (a device copy of `flat`) for its
        per-call inputs. Returns fn's output: a static buffer when replayed."""
        hit = self.graphs.get(key)
        if hit is not None:
            self.graphs.move_to_end(key)
            g, buf, out = hit
            upload(flat, self.device, out=buf)
            with nvtx_range(f"engine.graph.replay T={key[0]}"):
                g.replay()
            self.stats["replays"] += 1
            return out
        n = self.seen.get(key, 0) + 1
        if len(self.seen) > 4096:  # shapes seen once or twice do not accumulate forever
            self.seen.clear()
        self.seen[key] = n
        if n < self.capture_after:
            self.stats["eager"] += 1
            return fn(upload(flat, self.device))
        with nvtx_range(f"engine.graph.capture T={key[0]}"):
            # the graph's own static buffer: later uploads must not move or overwrite it
            buf = upload(flat, self.device, out=torch.empty(flat.size, dtype=torch.int64, device=self.device))
            # warm-up on a side stream (cuBLAS workspaces, Triton compiles) before capture;
            # it computes this very batch, so its cache writes are the ones the replay repeats
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                fn(buf)
            torch.cuda.current_stream(self.device).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = fn(buf)
            g.replay()
        self.graphs[key] = (g, buf, out)
        self.stats["captures"] += 1
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return out
