"""Offload engine: pinned host pool, block manager, asynchronous transfer worker.

  HostPool         one mmap region, pre-faulted, pinned lazily in chunks
  BlockManager     scheduler side: hashes -> host slots, LRU/ARC, ref counts
  TransferWorker   worker side: store/load jobs on their own streams

The vLLM adapter is not part of this package yet (see the README).
"""
from .block_manager import ARCPolicy, BlockManager, LRUPolicy, StorePlan
from .host_pool import HostPool
from .worker import JobResult, TransferWorker

__all__ = ["HostPool", "BlockManager", "LRUPolicy", "ARCPolicy", "StorePlan", "TransferWorker", "JobResult"]
