"""One door into the kernels: product code outside kernels/ (connector/, layout/) uses only
kernels' public API. Read from the source (ast), no import, no GPU:

  * no import of kernels._C, kernels._ext, or any kernels module or name starting with "_";
  * no attribute access `<kernels module>._name` (kernels._C, copy._NULL, ...);
  * no access `x._name` (x not self/cls) to a private member that a kernels class defines
    (BlockCopier._lock, ._ring_get, ._dma_lanes, ...): the copier's internals stay inside;
  * no import circle between kernels' modules (module-level imports).

profiling/ (benchmarks, probes, analysis) keeps the first two rules: it imports kernels through
public names only (kernels.native, kernels.tracing, kernels.timing, ...). Its probes may still time
a kernels class's private members (they measure internals on purpose), and tests/ are white-box;
neither is held to the third rule, and tests/ are not read.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRODUCT = ("connector", "layout")
# files another helper owns whose fix is pending as a patch (remove the entry once it is applied)
PENDING: dict = {}
# profiling files allowed one named exception, with the reason
PROFILING_ALLOWED = {"profiling/probes/probe_triton_launch.py":
                     "triton_copy._FAST: flips the fast-launch switch (KVO_TRITON_FAST_LAUNCH at import) in one process"}


def _py_files(folder: str):
    for dp, _, fs in os.walk(os.path.join(ROOT, folder)):
        for f in sorted(fs):
            if f.endswith(".py"):
                yield os.path.join(dp, f)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _kernels_private_members() -> set[str]:
    """`_x` attributes and methods that classes in kernels/*.py define (self._x = ..., def _x)."""
    out: set[str] = set()
    for path in _py_files("kernels"):
        tree = ast.parse(open(path).read(), path)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for n in ast.walk(cls):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(n.name):
                    out.add(n.name)
                elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and \
                        isinstance(n.value, ast.Name) and n.value.id == "self" and _private(n.attr):
                    out.add(n.attr)
    return out


def violations(path: str, members: set[str], class_members: bool = True) -> list[str]:
    """What in one file goes around kernels' public API, as 'file:line: what' strings."""
    src = open(path).read()
    tree = ast.parse(src, path)
    rel = os.path.relpath(path, ROOT)
    bad: list[str] = []
    kmods: set[str] = set()  # local names bound to kernels modules

    def flag(node, what):
        bad.append(f"{rel}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "kernels":
                    if any(_private(p) for p in parts):
                        flag(node, f"import {a.name}")
                    kmods.add(a.asname or parts[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "kernels":
                continue
            if any(_private(p) for p in parts):
                flag(node, f"from {node.module} import ...")
            for a in node.names:
                if _private(a.name):
                    flag(node, f"from {node.module} import {a.name}")
                elif node.module == "kernels" or a.name in ("native", "tracing", "copy", "plan", "cost_model",
                                                            "triton_copy", "calibration"):
                    kmods.add(a.asname or a.name)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in kmods:
            flag(node, f"{base.id}.{node.attr}")
        elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id == "kernels":
            flag(node, f"{base.value.id}.{base.attr}.{node.attr}")
        elif class_members and node.attr in members and not (isinstance(base, ast.Name) and base.id in ("self", "cls")):
            flag(node, f"{ast.unparse(base)}.{node.attr} (a private member of a kernels class)")
    return bad


def test_product_code_uses_only_kernels_public_api():
    members = _kernels_private_members()
    assert {"_lock", "_ring_get", "_dma_lanes", "_views"} <= members  # the reader sees the copier's internals
    bad = [v for folder in PRODUCT for p in _py_files(folder) if os.path.relpath(p, ROOT) not in PENDING
           for v in violations(p, members)]
    assert not bad, "code outside kernels/ goes around kernels' public API:\n  " + "\n  ".join(bad)


def test_profiling_imports_kernels_by_public_names_only():
    """Benchmarks, probes and analysis scripts reach the extension through kernels.native and
    tracing/timing through their public modules: no kernels._ext, kernels._C, kernels._nvtx."""
    bad = []
    for p in _py_files("profiling"):
        rel = os.path.relpath(p, ROOT)
        if rel in PENDING:
            continue
        got = violations(p, set(), class_members=False)
        allowed = PROFILING_ALLOWED.get(rel)
        if allowed is not None:
            got = [v for v in got if allowed.split(":")[0] not in v]
        bad += got
    assert not bad, "profiling/ goes around kernels' public names:\n  " + "\n  ".join(bad)


def test_profiling_check_fails_on_a_private_import(tmp_path):
    """Negative control for the profiling rule: a bench importing kernels._ext (as the benches
    did) is flagged, and so are kernels._nvtx, kernels._timing and a private name of copy."""
    p = tmp_path / "bench_x.py"
    p.write_text("from kernels._ext import _C\n"
                 "from kernels import _nvtx as nv\n"
                 "from kernels._timing import cuda_ms\n"
                 "from kernels.copy import _check_ids_fast\n"
                 "from kernels import native, tracing, timing\n"
                 "def f(cp):\n"
                 "    return native.DMA_BATCH, cp._ring_get\n")
    got = violations(str(p), {"_ring_get"}, class_members=False)
    assert sorted({int(v.split(":")[1]) for v in got}) == [1, 2, 3, 4], got


def test_the_check_catches_each_kind(tmp_path):
    """The reader flags each way around the door (a check that cannot fail is no check)."""
    p = tmp_path / "x.py"
    p.write_text("import kernels._C\n"
                 "from kernels._ext import _C\n"
                 "from kernels.copy import _NULL, on_device\n"
                 "from kernels import copy as kc, native\n"
                 "import kernels\n"
                 "a = kernels._C\n"
                 "b = kc._check_ids_fast\n"
                 "def f(cp):\n"
                 "    with cp._lock:\n"
                 "        return cp.lock, native.pack_layers, self_._x\n")
    got = violations(str(p), {"_lock"})
    lines = sorted({int(v.split(":")[1]) for v in got})
    assert lines == [1, 2, 3, 6, 7, 9], got


def test_no_import_circle_in_kernels():
    """No two kernels modules import each other, at module level or inside a function."""
    mods = {os.path.basename(p)[:-3]: p for p in _py_files("kernels") if os.path.dirname(p).endswith("kernels")}
    deps = {}
    for name, path in mods.items():
        tree = ast.parse(open(path).read(), path)
        d = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    d.add(node.module.split(".")[0])
                else:
                    d.update(a.name for a in node.names)
        deps[name] = d & set(mods) - {name, "__init__"}

    def reach(a, seen):
        for b in deps.get(a, ()):
            if b not in seen:
                seen.add(b)
                reach(b, seen)
        return seen

    circles = sorted(f"{a} <-> {b}" for a in deps for b in reach(a, set()) if a < b and a in reach(b, set()))
    assert not circles, circles
