"""Offload engine: pinned host pool, block manager, asynchronous transfer worker.

  HostPool         one mmap region, pre-faulted, pinned lazily in chunks
  BlockManager     scheduler side: hashes -> host slots, LRU/ARC, ref counts
  TransferWorker   worker side: store/load jobs on their own streams

The vLLM adapter lives in connector.vllm_adapter (needs the [vllm] extra).
"""
from .block_manager import ARCPolicy, BlockManager, LRUPolicy, StorePlan
from .host_pool import HostPool
from .worker import JobResult, TransferWorker

__all__ = ["HostPool", "BlockManager", "LRUPolicy", "ARCPolicy", "StorePlan", "TransferWorker", "JobResult"]
