"""Tensor-parallel ranks sharing one host pool.

The pool is laid out as vLLM does: one row per offloaded block, a cell per rank,
all layers of a rank's shard contiguous inside its cell:

    row b:  | rank 0 cell | rank 1 cell | ... | rank W-1 cell |

Each rank packs/unpacks only its own cell (a strided [rows, cell_bytes] view),
so ranks never overlap and need no locks. A model whose KV is replicated on
every rank (MLA) is stored once: rank 0 writes cell 0 and every rank loads it.

CellCommits / CommittedWorker (below): a commit word per cell, so that a rank killed in the
middle of a store never leaves a half-written cell that another rank (or its restart) reads.
"""
from __future__ import annotations

import mmap
import os
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

if TYPE_CHECKING:
    from kernels import Ids

    from .worker import JobResult, TransferWorker


def row_bytes(cell_bytes: int, world: int, replicated: bool) -> int:
    """Bytes of one pool row: one cell per rank, or one cell for replicated KV."""
    return cell_bytes if replicated else cell_bytes * world


def rank_cells(pool: torch.Tensor, rank: int, world: int, cell_bytes: int, replicated: bool = False) -> torch.Tensor:
    """This rank's cells of a [rows, row_bytes] uint8 pool: a zero-copy [rows, cell_bytes] view."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world of {world}")
    rb = row_bytes(cell_bytes, world, replicated)
    if pool.dim() != 2 or pool.shape[1] != rb or pool.dtype != torch.uint8:
        raise ValueError(f"pool must be uint8 [rows, {rb}], got {pool.dtype} {tuple(pool.shape)}")
    off = 0 if replicated else rank * cell_bytes
    return pool[:, off:off + cell_bytes]


def is_writer(rank: int, replicated: bool) -> bool:
    """Replicated KV is written by rank 0 only; sharded KV by every rank."""
    return rank == 0 or not replicated


# ---------------------------------------------------------------------------- commit words
# A rank that dies in the middle of a store (killed, OOM, a crashed driver call) leaves its
# cells half-written in the shared pool, which outlives it. Every cell therefore has a 64-bit
# commit word in a small shared file beside the pool: 0 while the cell is being written (or
# was never written), a nonzero generation once a store of it completed. A writer zeroes the
# words of its cells before it submits a store and sets them only when the store is reported
# done; a reader checks the words of the cells it will read (its own, or rank 0's for
# replicated KV) before it submits a load, and fails the load (a recompute) where one is 0.
# A write killed at any point leaves 0 behind, so no rank ever reads a half-written cell.

_GEN = [0]


def _next_generation() -> int:
    """Nonzero, unique per process and call: (pid << 32) | counter."""
    _GEN[0] = (_GEN[0] + 1) & 0xFFFFFFFF or 1
    return (os.getpid() << 32) | _GEN[0]


class CellCommits:
    """Commit words of a shared pool: int64 [rows, cells] (cells = world, or 1 replicated).

    Args:
      rows, rank, world, replicated: the pool's geometry and this rank (as rank_cells).
      shared_name: the pool's shared name; the words live in /dev/shm/kvoffload-<name>-commit
        (created zeroed by the first rank, mapped by the others). None: private (tests).
    """

    def __init__(self, rows: int, rank: int, world: int, replicated: bool = False,
                 shared_name: Optional[str] = None):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world of {world}")
        self.rows, self.rank, self.world, self.replicated = rows, rank, world, replicated
        cells = 1 if replicated else world
        self.cell = 0 if replicated else rank  # the cell this rank writes (if a writer) and reads
        self.writer = is_writer(rank, replicated)
        nbytes = rows * cells * 8
        self.path = None
        if shared_name:
            from .host_pool import SHM_DIR, _reserve_shm

            self.path = f"{SHM_DIR}/kvoffload-{shared_name}-commit"
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size < nbytes:
                    _reserve_shm(fd, nbytes, self.path)
                self._mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
        else:
            self._mm = mmap.mmap(-1, nbytes)
        self.words = np.frombuffer(self._mm, dtype=np.int64).reshape(rows, cells)

    def begin(self, rows: Ids) -> None:
        """Before a store into `rows` is submitted: their cells are not readable any more."""
        self.words[np.asarray(rows, np.int64), self.cell] = 0

    def commit(self, rows: Ids, generation: Optional[int] = None) -> None:
        """After a store into `rows` was reported done: their cells are readable."""
        self.words[np.asarray(rows, np.int64), self.cell] = generation or _next_generation()

    def ready(self, rows: Ids) -> np.ndarray:
        """bool [n]: whether each row's cell that this rank reads was completely written."""
        return self.words[np.asarray(rows, np.int64), self.cell] != 0

    def unlink(self) -> None:
        if self.path and os.path.exists(self.path):
            os.unlink(self.path)


class CommittedWorker:
    """Wraps a TransferWorker (same public API) with CellCommits for a shared pool.

    submit_store zeroes the job's cells' commit words, then submits; a store reported ok by
    get_finished sets them (a failed one leaves them 0). submit_load first checks the words:
    if any cell it would read is not committed, nothing is queued, it returns False and the job
    is reported failed (ok=False) at the next get_finished, as the worker does for a job it
    could not queue. Non-writer ranks (replicated KV, rank > 0) do not touch the words on store.
    """

    def __init__(self, tw: TransferWorker, commits: CellCommits) -> None:
        self.tw, self.commits = tw, commits
        self._stores: dict = {}
        self._refused: list = []
        self.refused_loads = 0

    def __getattr__(self, name):
        return getattr(self.__dict__["tw"], name)

    def submit_store(self, job_id: int, block_ids: Ids, slot_ids: Ids, **kw: Any) -> bool:
        if self.commits.writer:
            slots = np.array(slot_ids, dtype=np.int64, copy=True)
            self.commits.begin(slots)
            self._stores[job_id] = slots
        ok = self.tw.submit_store(job_id, block_ids, slot_ids, **kw)
        return ok

    def submit_load(self, job_id: int, slot_ids: Ids, block_ids: Ids, **kw: Any) -> bool:
        ready = self.commits.ready(slot_ids)
        if not ready.all():
            from .worker import JobResult

            self.refused_loads += 1
            self._refused.append(JobResult(job_id, "load", False, 0, None,
                                           f"{int((~ready).sum())} of {len(ready)} cells not committed "
                                           "(a store into them did not complete)"))
            return False
        return self.tw.submit_load(job_id, slot_ids, block_ids, **kw)

    def _done(self, results: list) -> list:
        for r in results:
            slots = self._stores.pop(r.job_id, None)
            if slots is not None and r.ok:
                self.commits.commit(slots)
        out, self._refused = self._refused + results, []
        return out

    def get_finished(self) -> list[JobResult]:
        return self._done(self.tw.get_finished())

    def shutdown(self, drain: bool = True) -> list[JobResult]:
        return self._done(self.tw.shutdown(drain))
