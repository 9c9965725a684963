"""Tensor-parallel ranks sharing one host pool.

The pool is laid out as vLLM does: one row per offloaded block, a cell per rank,
all layers of a rank's shard contiguous inside its cell:

    row b:  | rank 0 cell | rank 1 cell | ... | rank W-1 cell |

Each rank packs/unpacks only its own cell (a strided [rows, cell_bytes] view),
so ranks never overlap and need no locks. A model whose KV is replicated on
every rank (MLA) is stored once: rank 0 writes cell 0 and every rank loads it.
"""
from __future__ import annotations

import torch


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
