"""NVTX ranges: the `nvtx` package if present, else torch.cuda.nvtx, else no-op."""
from __future__ import annotations

import contextlib

try:
    import nvtx as _nvtx  # type: ignore

    def push(name: str) -> None:
        _nvtx.push_range(name, domain="kvoffload")

    def pop() -> None:
        _nvtx.pop_range(domain="kvoffload")

    BACKEND = "nvtx"
except Exception:  # pragma: no cover - depends on the machine
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError
        push = torch.cuda.nvtx.range_push  # type: ignore[assignment]

        def pop() -> None:  # type: ignore[misc]
            torch.cuda.nvtx.range_pop()

        BACKEND = "torch.cuda.nvtx"
    except Exception:
        def push(name: str) -> None:  # type: ignore[misc]
            pass

        def pop() -> None:  # type: ignore[misc]
            pass

        BACKEND = "none"


def _torch_profiling() -> bool:
    try:
        from torch.autograd.profiler import _is_profiler_enabled

        return bool(_is_profiler_enabled)
    except Exception:  # pragma: no cover - older/newer torch
        return False


@contextlib.contextmanager
def nvtx_range(name: str):
    """`with nvtx_range("store d2h n=128"):` marks a host range for Nsight Systems, and for
    torch.profiler traces too while a torch profiler is recording."""
    push(name)
    rf = None
    if _torch_profiling():
        import torch

        rf = torch.autograd.profiler.record_function(name)
        rf.__enter__()
    try:
        yield
    finally:
        if rf is not None:
            rf.__exit__(None, None, None)
        pop()
