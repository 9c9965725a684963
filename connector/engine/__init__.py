"""Minimal paged-KV Llama engine that hosts the offload connector (see engine.py)."""
from .engine import BlockPool, EngineConfig, LLMEngine, Seq, block_hashes
from .model import Llama, LlamaConfig, SeqBatch, rope_inv_freq

__all__ = ["LLMEngine", "EngineConfig", "Seq", "BlockPool", "block_hashes", "Llama", "LlamaConfig",
           "SeqBatch", "rope_inv_freq"]
