"""kvoffload transfer core: block copies between GPU memory and pinned host memory.

Public API:
  copy_blocks(src, dst, src_ids, dst_ids=None, *, method="auto", stream=None, ...)
  BlockCopier(device, num_ctas=16, ...)          per-device engine behind copy_blocks
  BlockCopier.bind(src, dst, method="cuda")      a BoundCopy: buffers checked once, calls take ids
  KVOffloadError                                 raised for bad input, before any launch
  backends()                                     what is available here, and why not
  calibrate(device)                              re-measure the auto cost model (needs a GPU)
  Method                                         Literal type of the `method` argument
  check_id_pairs, current_stream_handle          id checks and stream handles for callers that
                                                 issue their own launches (layout/, connector/)
  native                                         the extension's entry points for layout/ and
                                                 connector/ (the only door to kernels._C)
  tracing                                        NVTX ranges (nvtx_range, TOOL)

`python -m kernels` prints the backends; `python -m kernels demo` moves KV
blocks and prints GB/s; `python -m kernels calibrate` refreshes the cost model.
"""
from __future__ import annotations

from . import native, tracing
from .calibration import calibrate
from .copy import (METHODS, BlockCopier, BoundCopy, BoundMethod, Ids, Method, check_id_pairs, copy_blocks, current_stream_handle,
                   direction, get_copier)
from .cost_model import CostModel
from .plan import KVOffloadError
from .checksum import BlockChecksum, checksum_reference  # noqa: F401  (integrity mode)

__all__ = ["copy_blocks", "BlockCopier", "BoundCopy", "KVOffloadError", "METHODS", "Method", "BoundMethod", "Ids",
           "CostModel",
           "calibrate", "backends", "direction", "get_copier", "check_id_pairs", "current_stream_handle",
           "native", "tracing"]


def backends() -> dict[str, tuple[bool, str]]:
    """{backend: (available, reason)} for this process."""
    import os

    import torch

    from ._ext import _C, _C_REASON
    from .triton_copy import HAVE_TRITON, TRITON_REASON

    cuda = torch.cuda.is_available()
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    out = {"torch": (True, f"torch {torch.__version__}")}
    if _C is None:
        ext_ok, ext_why = False, _C_REASON
    else:
        info = _C.build_info()
        ext_ok = cuda
        ext_why = (f"kernels._C built against CUDA runtime {info['cudart_version']}, "
                   f"memcpy batch API {'yes' if info['has_memcpy_batch'] else 'no'}, "
                   f"host id scan {info.get('host_id_scan', '?')}")
        if not cuda:
            ext_why += "; but no CUDA device is visible"
    for name in ("dma", "cuda", "staged"):
        out[name] = (ext_ok, ext_why)
    if not HAVE_TRITON:
        out["triton"] = (False, TRITON_REASON)
    elif cuda:
        out["triton"] = (True, "triton on the GPU")
    elif interp:
        out["triton"] = (True, "triton interpreter (TRITON_INTERPRET=1), CPU tensors")
    else:
        out["triton"] = (False, "no CUDA device; set TRITON_INTERPRET=1 to run it on the CPU")
    return out
