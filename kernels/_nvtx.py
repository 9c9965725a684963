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


try:
    import torch.autograd.profiler as _prof_mod
except Exception:  # pragma: no cover
    _prof_mod = None


def _torch_profiling() -> bool:
    # read the module attribute each time: it flips while a torch profiler records
    return bool(getattr(_prof_mod, "_is_profiler_enabled", False))


class _Range:
    """A plain context manager (a generator-based one costs ~2 us per copy on the hot path)."""

    __slots__ = ("name", "rf")

    def __init__(self, name: str):
        self.name = name
        self.rf = None

    def __enter__(self):
        push(self.name)
        if _torch_profiling():
            import torch

            self.rf = torch.autograd.profiler.record_function(self.name)
            self.rf.__enter__()
        return self

    def __exit__(self, *exc):
        if self.rf is not None:
            self.rf.__exit__(None, None, None)
        pop()
        return False


_NULL = contextlib.nullcontext()


def nvtx_range(name: str):
    """`with nvtx_range("store d2h n=128"):` marks a host range for Nsight Systems, and for
    torch.profiler traces too while a torch profiler is recording. Free when neither exists."""
    if BACKEND == "none" and not _torch_profiling():
        return _NULL
    return _Range(name)
