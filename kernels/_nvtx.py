"""Old name of kernels.tracing (kept for scripts that import it); the same module object."""
import sys

from . import tracing

sys.modules[__name__] = tracing
