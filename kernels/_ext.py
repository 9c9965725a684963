"""Loads the optional CUDA extension and remembers why it is missing."""
from __future__ import annotations

_C = None
_C_REASON = ""
try:  # pragma: no cover - depends on the build
    from . import _C as _C  # type: ignore[attr-defined,no-redef]
except ImportError as e:  # built without nvcc, or a broken build
    _C = None
    _C_REASON = f"kernels._C not importable ({e}); reinstall with nvcc on PATH"


def ext():
    """Returns the extension module or raises a RuntimeError saying why it is absent."""
    if _C is None:
        raise RuntimeError(_C_REASON)
    return _C
