"""No commit shas in the comments and docstrings of kernels/, layout/ and connector/ (the team's
rule: a finding and the run it comes from go to docs/design/, the code keeps the reason and a
pointer). A sha-like token is 7-40 hex digits with at least one digit and one letter a-f, as a
whole word (a file name's `_<sha>` suffix included); constants in code (not comments or docstrings) are not looked at."""
import ast
import io
import os
import re
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("kernels", "layout", "connector")
CPP = (".h", ".cuh", ".cu", ".cpp", ".cc")
SHA = re.compile(r"(?<![0-9A-Za-z])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![0-9A-Za-z_])")


def _py_prose(src: str):
    """(line, text) of every comment and docstring of Python source."""
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                yield body[0].lineno, body[0].value.value


def _cpp_prose(src: str):
    """(line, text) of every // and /* */ comment of C++/CUDA source (string literals skipped)."""
    for m in re.finditer(r'"(?:\\.|[^"\\\n])*"|//[^\n]*|/\*.*?\*/', src, re.S):
        if not m.group(0).startswith('"'):
            yield src.count("\n", 0, m.start()) + 1, m.group(0)


def shas_in(path: str, src: str) -> list:
    prose = _cpp_prose(src) if path.endswith(CPP) else _py_prose(src)
    return [f"{path}:{line + text.count(chr(10), 0, m.start())}: {m.group(0)}"
            for line, text in prose for m in SHA.finditer(text)]


def _sources():
    for pkg in PACKAGES:
        for d, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in sorted(files):
                if f.endswith((".py",) + CPP):
                    yield os.path.relpath(os.path.join(d, f), ROOT)


def test_no_commit_shas_in_comments_or_docstrings():
    hits = []
    for rel in _sources():
        hits += shas_in(rel, open(os.path.join(ROOT, rel), encoding="utf-8").read())
    assert not hits, "commit shas in code prose (move the figure and its run to docs/design/):\n" + "\n".join(hits)


@pytest.mark.parametrize("path,src,want", [
    # negative controls: the check finds what it is for ...
    ("x.py", '"""Measured at ab1727f."""\n', ["x.py:1: ab1727f"]),
    ("x.py", "x = 1  # see dup_split_ab1727f.txt\n", ["x.py:1: ab1727f"]),
    ("x.py", 'def f():\n    """run e2ab55b0c1d2"""\n', ["x.py:2: e2ab55b0c1d2"]),
    ("x.h", "int x;  // transfer_host_950c2f3.json\n", ["x.h:1: 950c2f3"]),
    ("x.cu", "/* from\n   5275124a */\n", ["x.cu:2: 5275124a"]),
    # ... and leaves alone what it is not for
    ("x.py", 'bus = f"{a:04x}:{b:02x}"  # 68719476736 bytes, 1.4426950408889634\n', []),
    ("x.py", "X = 'ab1727f'\n", []),  # a string constant in code, not prose
    ("x.h", 'const char* s = "// ab1727f";  // deadbeef cafebabe 0x1f2e3d4c\n', []),
    ("x.py", "# the 'facade' and 'decade' words, 1234567 and abcdefab\n", []),
])
def test_sha_check_finds_shas_and_only_shas(path, src, want):
    assert shas_in(path, src) == want
