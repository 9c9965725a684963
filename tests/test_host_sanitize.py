"""The host-side planning code (kernels/csrc/host_plan.h, work_pool.h: plain C++, no CUDA)
under the compiler's sanitizers: tests/cpp/host_plan_sanitize.cpp checks random jobs against
a reference (serial and split over the thread pool, concurrent callers) and runs clean under
AddressSanitizer + UndefinedBehaviorSanitizer, and under ThreadSanitizer where its runtime
works on this machine. Skipped without g++."""
import os
import shutil
import subprocess

import pytest

from tests.host_cpp import env_without_preload

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "cpp", "host_plan_sanitize.cpp")
GXX = shutil.which("g++")


def build_and_run(tmp_path, flags, name):
    exe = str(tmp_path / name)
    b = subprocess.run([GXX, "-std=c++17", "-O1", "-g", "-fno-omit-frame-pointer", *flags, SRC, "-o", exe, "-pthread"],
                       capture_output=True, text=True, timeout=300)
    if b.returncode:
        pytest.skip(f"g++ {' '.join(flags)} does not build here: {b.stderr[-400:]}")
    env = env_without_preload(ASAN_OPTIONS="detect_leaks=1:abort_on_error=0", UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
               TSAN_OPTIONS="halt_on_error=1")
    return subprocess.run([exe], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.skipif(GXX is None, reason="needs g++")
def test_host_plan_clean_under_asan_and_ubsan(tmp_path):
    r = build_and_run(tmp_path, ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"], "hps_asan")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "0 failures" in r.stdout


@pytest.mark.skipif(GXX is None, reason="needs g++")
def test_host_plan_and_pool_clean_under_tsan(tmp_path):
    r = build_and_run(tmp_path, ["-fsanitize=thread"], "hps_tsan")
    if r.returncode != 0 and "host_plan_sanitize" not in r.stdout and "ThreadSanitizer" not in r.stderr:
        pytest.skip(f"the ThreadSanitizer runtime does not start here (exit {r.returncode}; e.g. ASLR settings)")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "0 failures" in r.stdout
