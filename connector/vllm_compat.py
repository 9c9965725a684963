"""What differs between the vLLM releases the adapter supports (0.26.0 <= vLLM < 0.34), in one place.

`connector.vllm_adapter` is written once against the API below; nothing else in the
project looks at vLLM's version. Outside the range, importing this module raises an
ImportError that names the range and the version found.

Differences handled here (vLLM's own files: v1/kv_offload/base.py, config.py and
distributed/kv_transfer/kv_connector/v1/offloading_connector.py, offloading/*.py):

  * `Medium` enum (0.32+): `OffloadingEvent.medium` is `Medium.CPU`; 0.26 has no enum and
    takes the string "CPU" -> `MEDIUM_CPU`.
  * KV cache layout names: 0.26 knows only "NHD"/"HND" and gets the block-outer layout
    from `OffloadingConnector.prefer_cross_layer_blocks()` (one cross-layer tensor);
    0.32+ name layouts by dimension letters and block-outer is "BLHNC" -> `LAYOUTS`,
    `DEFAULT_LAYOUT`.
  * `OffloadingConfig` fields `replicated_layout`, `canonical_layout`, `kv_cache_layout`
    exist from 0.32 (0.26: absent, i.e. False/False/None) -> `config_field`.
  * `kv_connector_extra_config` keys vLLM itself reads (`VLLM_EXTRA_KEYS`):
    `canonical_layout` from 0.32, `sync_load_budget_bytes` from 0.33.
  * Block ids in load/store specs are int64 in 0.26 and int32 from 0.32: the adapter
    converts them to int64 itself (TransferWorker's fast path takes int64 numpy ids).
  * 0.33 additions, honoured by the adapter in every version (harmless before 0.33):
    `OffloadingWorker.submit_load(..., expedited=False)` (an expedited load is waited on
    within the step: it takes its own stream), `OffloadingManager.lock` (a context
    manager the scheduler holds across a step; ours is a no-op, the manager is entered
    from the scheduler thread only), `OffloadingSpec.config_info_keys(extra_config)` with
    `OffloadingManager.config_info()` (the `vllm:kv_offload_config_info` labels), and
    `on_reset_flushed()` (base no-op is right: reset_cache drops every block, as vLLM's own
    manager does, and vLLM's workers wait for the flushed jobs before they submit new ones).
    0.33's 3-argument `CachePolicy.insert` belongs to vLLM's own CPU tier: kvoffload's
    eviction lives in `connector.block_manager` and never meets vLLM's policies.
  * Tests only (tests/vllm_harness.py, test_vllm_tp.py): `KVCacheTensor` is (size, shared_by,
    offset, block_stride) in 0.26 and (size, layers, layer_stride, block_stride, offset) from
    0.32; the offloading config dataclasses gain fields (`dataclass_kwargs`); 0.26's
    `init_none_hash` draws a new random seed per call (call it once); `OffloadingConnector.scheduler`
    is 0.32+ (`connector_scheduler` is in all). vLLM 0.26's scheduler asserts when a request that
    never got device blocks is aborted (offloading/scheduler.py, `len(offload_keys) ==
    len(offload_block_ids)`); 0.32 fixed it. Nothing in the adapter can avoid that one.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

SUPPORTED = ((0, 26, 0), (0, 34, 0))  # [min, max)
SUPPORTED_TEXT = "vllm >= 0.26.0, < 0.34"


def _parse(ver: str) -> tuple:
    """(major, minor, patch) of a version string such as "0.33.0", "0.32.0+cpu" or "0.33.0rc1"."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", ver)
    return tuple(int(x) for x in m.groups(default="0")) if m else ()


def _check() -> tuple:
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"connector.vllm_adapter needs vLLM ({SUPPORTED_TEXT}): pip install -e '.[vllm]'") from e
    ver = getattr(vllm, "__version__", "unknown")
    v = _parse(ver)
    if len(v) < 2 or not (SUPPORTED[0] <= v < SUPPORTED[1]):
        raise ImportError(f"connector.vllm_adapter supports {SUPPORTED_TEXT}; found vllm {ver} "
                          f"at {getattr(vllm, '__file__', '?')}")
    return v


VERSION = _check()

# Features are detected, not inferred from the version, so 0.27-0.31 get whichever API they have.
import inspect  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402
from vllm.v1.kv_offload.base import OffloadingWorker  # noqa: E402
from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: E402

try:  # 0.32+
    from vllm.v1.kv_offload.base import Medium

    MEDIUM_CPU = Medium.CPU
except ImportError:  # 0.26: OffloadingEvent.medium is a str
    MEDIUM_CPU = "CPU"

CROSS_LAYER_BLOCKS = hasattr(OffloadingConnector, "prefer_cross_layer_blocks")  # 0.26 layout scheme
if CROSS_LAYER_BLOCKS:
    LAYOUTS = frozenset({"NHD", "HND"})
    DEFAULT_LAYOUT = "HND"  # block-outer comes from prefer_cross_layer_blocks()
else:
    LAYOUTS = frozenset({"BLHNC", "BLNHC", "BHLNC", "LBHNC", "LBNHC", "LHBNC", "NHD", "HND"})
    DEFAULT_LAYOUT = "BLHNC"  # block-outer: a block is one contiguous range (one DMA)

EXPEDITED_LOADS = "expedited" in inspect.signature(OffloadingWorker.submit_load).parameters  # 0.33
_CONFIG_FIELDS = {f.name for f in dataclasses.fields(OffloadingConfig)}
VLLM_EXTRA_KEYS = frozenset({"spec_name", "spec_module_path", "block_size", "blocks_per_chunk",
                             "offload_prompt_only", "self_describing_kv_events"}
                            | ({"canonical_layout"} if "canonical_layout" in _CONFIG_FIELDS else set())
                            | ({"sync_load_budget_bytes"} if EXPEDITED_LOADS else set()))


def config_field(config: Any, name: str, default: Any = None) -> Any:
    """A field of vLLM's OffloadingConfig that older releases lack (see module doc)."""
    return getattr(config, name, default)


def dataclass_kwargs(cls: type, **kwargs: Any) -> dict[str, Any]:
    """The kwargs `cls` (a vLLM dataclass) accepts: drops fields this release lacks."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in kwargs.items() if k in names}
