"""Shared by the tests that build and run plain C++ under the compiler's sanitizers."""
import os


def env_without_preload(**extra: str) -> dict:
    """os.environ without LD_PRELOAD, plus `extra`: vLLM's CPU platform sets LD_PRELOAD in this
    process (libgomp, tcmalloc) when an earlier test starts an engine in-process, and an ASan
    binary must load its runtime first ("ASan runtime does not come first")."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(extra)
    return env
