"""The staged H2D fault's code path stressed on purpose, without a GPU
(docs/design/staged-h2d-fault.md). tests/cpp/staged_fault_stress.cpp runs the DMA planning
and issue of `staged` jobs (kernels/csrc/desc_arrays.h, host_plan.h, dma_batch.cuh, the
DmaSubmitter's staged pipe) at the fault's sizes, 262144 x 4 KiB blocks, host offsets past
2^32 bytes, calls of 8192 and 512 descriptors, the legacy default stream, four threads at
once, on the fake CUDA runtime with check_ranges: every descriptor must lie inside one known
buffer and registration segment, match the planned blocks exactly, and the descriptor arrays
must be readable for `count` entries (ASan); also the id pass at n = 2^18, the batcher's call
cap (kvo::kMaxDescPerCall) and a driver that re-reads earlier calls' arrays (lazy_reads).
Built with -fsanitize=address,undefined. Negative controls (by hand, see the commits):
plan_dma with 32-bit address math fails 1116 checks; issue_planned issuing one descriptor more
than planned is an ASan heap-buffer-overflow in the fake's batch call; the old
DescArrays::reserve under lazy_reads an ASan heap-use-after-free; no call cap 42 failures. The Python side of `staged` (BlockCopier.staged_pipeline's chunks
and ids) is tested in test_staged_fault_plan.py."""
import os
import shutil
import subprocess

import pytest

from tests.host_cpp import env_without_preload

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "cpp", "staged_fault_stress.cpp")
FAKE = os.path.join(HERE, "cpp", "fake_cuda")
GXX = shutil.which("g++")


@pytest.mark.skipif(GXX is None, reason="needs g++")
def test_staged_path_descriptors_stay_inside_their_buffers(tmp_path):
    exe = str(tmp_path / "staged_fault_stress")
    b = subprocess.run([GXX, "-std=c++17", "-O1", "-g", "-fno-omit-frame-pointer", "-Wall", "-Wextra", "-Werror",
                        "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-I", FAKE, SRC, "-o", exe,
                        "-pthread"], capture_output=True, text=True, timeout=300)
    if b.returncode and "sanitize" in b.stderr and "cannot find" in b.stderr:
        pytest.skip(f"the sanitizer runtimes are missing here: {b.stderr[-300:]}")
    assert b.returncode == 0, b.stderr[-4000:]
    env = env_without_preload(ASAN_OPTIONS="detect_leaks=1:abort_on_error=0",
               UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1")
    r = subprocess.run([exe], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "staged_fault_stress: 0 failures" in r.stdout
    assert "python staged path: 96 jobs" in r.stdout and "submitter staged pipe: 16 jobs" in r.stdout
