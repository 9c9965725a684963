"""profiling/ runs without sys.path patching (issue 36, item 6).

Benchmarks, probes and analysis scripts run as modules from the repo root (`python -m
profiling.bench.bench_x`), where the repo root is already on sys.path, and import what they
share as packages (`from profiling import common, vllm_util`, `from connector import ...`).
Read from the source (ast), no import: no file under profiling/ may

  * touch `sys.path` (insert, append, extend, assignment, `from sys import path`), or
  * load a module by file path (`importlib.util.spec_from_file_location`, `SourceFileLoader`,
    `runpy.run_path`, `site.addsitedir`, `imp.load_source`).

Setting PYTHONPATH in os.environ for a child process (profiling/vllm_util.set_env_defaults: vLLM's
engine-core and server processes import connector.vllm_adapter) is not a patch of this process's
path and is allowed.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PENDING: dict = {}  # files excused while a fix is under way (none)
BY_PATH = {"spec_from_file_location", "SourceFileLoader", "run_path", "addsitedir", "load_source"}


def path_patches(path: str) -> list[str]:
    """'file:line: what' for each sys.path use or by-path import in one file."""
    tree = ast.parse(open(path).read(), path)
    rel = os.path.relpath(path, ROOT)
    bad = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name) and n.value.id == "sys":
            bad.append(f"{rel}:{n.lineno}: sys.path")
        elif isinstance(n, ast.ImportFrom) and n.module == "sys" and any(a.name == "path" for a in n.names):
            bad.append(f"{rel}:{n.lineno}: from sys import path")
        elif isinstance(n, ast.Attribute) and n.attr in BY_PATH:
            bad.append(f"{rel}:{n.lineno}: {n.attr} (import by path)")
        elif isinstance(n, ast.ImportFrom) and any(a.name in BY_PATH for a in n.names):
            bad.append(f"{rel}:{n.lineno}: from {n.module} import {', '.join(a.name for a in n.names)} (import by path)")
    return bad


def _profiling_files():
    for dp, _, fs in os.walk(os.path.join(ROOT, "profiling")):
        for f in sorted(fs):
            if f.endswith(".py"):
                yield os.path.join(dp, f)


def test_profiling_does_not_patch_sys_path():
    files = list(_profiling_files())
    assert any(f.endswith(os.path.join("profiling", "vllm_util.py")) for f in files)  # the walk sees the tree
    bad = [v for p in files if os.path.relpath(p, ROOT) not in PENDING for v in path_patches(p)]
    assert not bad, ("profiling/ patches sys.path or imports by path (run it as `python -m profiling....` "
                     "from the repo root and import packages instead):\n  " + "\n  ".join(bad))


def test_the_path_check_catches_each_kind(tmp_path):
    """Negative control: the two patches profiling/bench/ had (bench_vllm.py and soak_vllm.py
    inserted tests/ to import vllm_engine_util by path) and the other ways are flagged; imports
    of packages and PYTHONPATH for a child are not."""
    p = tmp_path / "bench_x.py"
    p.write_text("import os, sys, importlib.util, runpy, site\n"
                 "sys.path.insert(0, os.path.join(os.path.dirname(__file__), 'tests'))\n"
                 "import vllm_engine_util as U\n"
                 "sys.path.append('x')\n"
                 "sys.path[:0] = ['y']\n"
                 "from sys import path\n"
                 "s = importlib.util.spec_from_file_location('m', 'm.py')\n"
                 "runpy.run_path('x.py')\n"
                 "site.addsitedir('z')\n"
                 "from importlib.machinery import SourceFileLoader\n"
                 "from profiling import vllm_util, common\n"
                 "os.environ['PYTHONPATH'] = '/repo'\n"
                 "print(sys.argv, os.path.join('a', 'b'))\n")
    got = path_patches(str(p))
    assert sorted({int(v.split(":")[1]) for v in got}) == [2, 4, 5, 6, 7, 8, 9, 10], got
