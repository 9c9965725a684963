"""NVTX ranges (public: kernels.tracing; nvtx_range, TOOL, PROF): the `nvtx` package if present, else torch.cuda.nvtx, else no-op.

Ranges are pushed only when a tool can receive them. nvtx3 hands NVTX calls to the library
that NVTX_INJECTION64_PATH names, read at the process's first NVTX call; Nsight Systems and
Nsight Compute set it for the process they launch (NVTX.jl gates its calls the same way).
Without it every push is a no-op in C, but not in Python: right after a wait of tens of
milliseconds, a pushed range (and the f-string of its name) costs many times its warm cost
(docs/design/cold-host-path.md). KVO_NVTX=1 forces ranges on (a tool
injected some other way), KVO_NVTX=0 off; both environment variables are read once, at import
(as nvtx3 reads its own at the first NVTX call). While a torch profiler records, ranges also go to
it as record_function, whatever TOOL says.
"""
from __future__ import annotations

import contextlib
import os

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


def _tool_injected() -> bool:
    force = os.environ.get("KVO_NVTX")
    if force in ("0", "1"):
        return force == "1"
    return bool(os.environ.get("NVTX_INJECTION64_PATH"))


# whether pushes can reach an NVTX tool (module docstring); hot paths read it inline
TOOL = BACKEND != "none" and _tool_injected()

try:
    import torch.autograd.profiler as _prof_mod
except Exception:  # pragma: no cover
    _prof_mod = None


class _NoProfiler:
    _is_profiler_enabled = False


# hot paths read PROF._is_profiler_enabled inline (an attribute, not a call)
PROF = _prof_mod if hasattr(_prof_mod, "_is_profiler_enabled") else _NoProfiler


def _torch_profiling() -> bool:
    # read the module attribute each time: it flips while a torch profiler records
    return bool(getattr(_prof_mod, "_is_profiler_enabled", False))


class _Range:
    """A plain context manager (a generator-based one costs several times more per copy on the hot path)."""

    __slots__ = ("name", "rf")

    def __init__(self, name: str):
        self.name = name
        self.rf = None

    def __enter__(self):
        if TOOL:
            push(self.name)
        if _torch_profiling():
            import torch

            self.rf = torch.autograd.profiler.record_function(self.name)
            self.rf.__enter__()
        return self

    def __exit__(self, *exc):
        if self.rf is not None:
            self.rf.__exit__(None, None, None)
        if TOOL:
            pop()
        return False


Range = _Range  # public name: what nvtx_range returns when a tool or a profiler listens (probes time it)
NULL = _NULL = contextlib.nullcontext()  # what nvtx_range returns when nothing listens


def nvtx_range(name: str) -> contextlib.AbstractContextManager:
    """`with nvtx_range("store d2h n=128"):` marks a host range for Nsight Systems (when a tool
    is injected: TOOL), and for torch.profiler traces too while a torch profiler is recording.
    A no-op when neither listens."""
    if not TOOL and not _torch_profiling():
        return _NULL
    return _Range(name)
