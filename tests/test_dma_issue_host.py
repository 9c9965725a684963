"""The DMA batcher's issue logic (kernels/csrc/dma_batch.cuh: launch_dma_batch, DmaLanes;
kernels/csrc/dma_submitter.h: DmaSubmitter) on a fake CUDA runtime, so CI checks it without a
GPU: tests/cpp/dma_issue_fake_cuda.cpp builds against tests/cpp/fake_cuda/cuda_runtime.h,
where a copy is a memcpy done during the call and every stream operation is logged. It checks
the bytes and, from the log, the calls: slices of at most max_per_call descriptors, each
descriptor issued once and in order, the stream each lands on, the fallback to the
cudaMemcpyAsync loop, the lanes' fork/join events, the submit thread's tickets and failures, and the test-only fault hook (kernels/csrc/fault.h)
armed at each site (the error reaches every issue path, the failing call is not made, the next
job is exact) and disarmed (nothing changes). Built with -fsanitize=address,undefined.
Also: the disarmed hook's cost per check (tests/cpp/fault_bench.cpp, -O2). Skipped without g++."""
import os
import re
import shutil
import subprocess

import pytest

from tests.host_cpp import env_without_preload

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "cpp", "dma_issue_fake_cuda.cpp")
FAKE = os.path.join(HERE, "cpp", "fake_cuda")
GXX = shutil.which("g++")


@pytest.mark.skipif(GXX is None, reason="needs g++")
def test_dma_issue_logic_on_a_fake_runtime(tmp_path):
    exe = str(tmp_path / "dma_issue")
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
    assert "dma_issue_fake_cuda: 0 failures" in r.stdout


@pytest.mark.skipif(GXX is None, reason="needs g++")
def test_disarmed_fault_hook_costs_about_nothing(tmp_path):
    """fault::check() disarmed (a relaxed load + a not-taken branch) next to a loop whose body
    costs about a nanosecond: far under the microseconds of the driver call it guards. The
    bound is loose (a shared 2-core machine); the printed figure is the measurement."""
    exe = str(tmp_path / "fault_bench")
    b = subprocess.run([GXX, "-std=c++17", "-O2", "-I", FAKE, os.path.join(HERE, "cpp", "fault_bench.cpp"), "-o", exe],
                       capture_output=True, text=True, timeout=300)
    assert b.returncode == 0, b.stderr[-4000:]
    r = subprocess.run([exe], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    print(r.stdout.strip())
    m = re.search(r"check (-?[0-9.]+) ns$", r.stdout.strip())
    assert m, r.stdout
    assert float(m.group(1)) < 5.0, r.stdout
