"""Every bad input raises KVOffloadError before anything is launched (CPU)."""
import numpy as np
import pytest
import torch

from kernels import BlockCopier, KVOffloadError
from tests.conftest import HAS_CUDA


@pytest.fixture
def cp():
    return BlockCopier("cpu")


def bufs(nb=8, bb=64):
    return torch.arange(nb * bb // 4, dtype=torch.int32).view(nb, bb // 4) + 1, torch.zeros(nb, bb // 4, dtype=torch.int32)


def test_out_of_range(cp):
    s, d = bufs()
    with pytest.raises(KVOffloadError, match="out of range"):
        cp.copy(s, d, [0, 8], [0, 1], method="torch")
    with pytest.raises(KVOffloadError, match="out of range"):
        cp.copy(s, d, [0, 1], [0, 99], method="torch")
    assert int(d.abs().sum()) == 0  # nothing was copied


def test_negative(cp):
    s, d = bufs()
    with pytest.raises(KVOffloadError, match="negative"):
        cp.copy(s, d, [-1], [0], method="torch")
    with pytest.raises(KVOffloadError, match="negative"):
        cp.copy(s, d, [0], [-3], method="torch")


def test_duplicate_destinations(cp):
    s, d = bufs()
    with pytest.raises(KVOffloadError, match="duplicate destination block 2"):
        cp.copy(s, d, [0, 1, 3], [2, 5, 2], method="torch")
    assert int(d.abs().sum()) == 0
    cp.copy(s, d, [0, 0], [1, 2], method="torch")  # duplicate *sources* are fine


def test_length_mismatch_and_bad_types(cp):
    s, d = bufs()
    with pytest.raises(KVOffloadError, match="differ in length"):
        cp.copy(s, d, [0, 1], [0], method="torch")
    with pytest.raises(KVOffloadError, match="integers"):
        cp.copy(s, d, np.array([0.5]), [0], method="torch")
    with pytest.raises(KVOffloadError, match="1-D"):
        cp.copy(s, d, np.zeros((2, 2), np.int64), np.zeros((2, 2), np.int64), method="torch")
    with pytest.raises(KVOffloadError, match=r"\[N, 2\]"):
        cp.copy(s, d, np.zeros((3, 3), np.int64), method="torch")
    with pytest.raises(KVOffloadError, match="torch.Tensor"):
        cp.copy(np.zeros(4), d, [0], [0], method="torch")


def test_block_bytes_not_multiple_of_element(cp):
    s = torch.ones(64, dtype=torch.float32)
    d = torch.zeros(64, dtype=torch.float32)
    with pytest.raises(KVOffloadError, match="multiple of src's element width"):
        cp.copy(s, d, [0], [0], block_bytes=6, method="torch")
    with pytest.raises(KVOffloadError, match="not a multiple of block_bytes"):
        cp.copy(s, d, [0], [0], block_bytes=24, method="torch")
    with pytest.raises(KVOffloadError, match="positive"):
        cp.copy(s, d, [0], [0], block_bytes=0, method="torch")


def test_mismatched_block_sizes_and_dtypes(cp):
    s = torch.ones(8, 16, dtype=torch.float16)
    with pytest.raises(KVOffloadError, match="block size mismatch"):
        cp.copy(s, torch.zeros(8, 8, dtype=torch.float16), [0], [0], method="torch")
    with pytest.raises(KVOffloadError, match="dtype mismatch"):
        cp.copy(s, torch.zeros(8, 16, dtype=torch.bfloat16), [0], [0], method="torch")


def test_overlapping_blocks_in_one_buffer(cp):
    s, _ = bufs()
    with pytest.raises(KVOffloadError, match="overlapping"):
        cp.copy(s, s, [0, 1], [1, 2], method="torch")
    with pytest.raises(KVOffloadError, match="different geometry"):
        cp.copy(s[:4], s.view(-1)[8:72].view(4, 16), [0], [3], method="torch")
    before = s.clone()
    cp.copy(s, s, [0, 1], [5, 6], method="torch")  # disjoint in-place move is allowed
    assert torch.equal(s[5], before[0]) and torch.equal(s[6], before[1])


def test_unknown_and_unavailable_method(cp):
    s, d = bufs()
    with pytest.raises(KVOffloadError, match="unknown method"):
        cp.copy(s, d, [0], [0], method="warp")
    with pytest.raises(KVOffloadError, match="not available"):
        cp.copy(s, d, [0], [0], method="dma")


def test_bind_rejects_what_copy_rejects(cp):
    """BlockCopier.bind checks the buffers once, with copy()'s messages, before any launch."""
    s, d = bufs()
    with pytest.raises(KVOffloadError, match="bind\\(\\) takes method"):
        cp.bind(s, d, method="staged")
    with pytest.raises(KVOffloadError, match="not available"):
        cp.bind(s, d, method="cuda")  # a CPU copier has no CUDA paths
    with pytest.raises(KVOffloadError, match="dtype mismatch"):
        cp.bind(s, d.view(torch.float32), method="dma")
    with pytest.raises(KVOffloadError, match="block size mismatch"):
        cp.bind(s, torch.zeros(8, 8, dtype=torch.int32), method="dma")
    with pytest.raises(KVOffloadError, match="must be a torch.Tensor"):
        cp.bind(np.zeros((8, 16), np.int32), d, method="dma")


@pytest.mark.gpu
def test_ids_on_gpu_rejected(cp):
    s, d = bufs()
    with pytest.raises(KVOffloadError, match="must be on the host"):
        cp.copy(s, d, torch.zeros(1, dtype=torch.int64, device="cuda"), [0], method="torch")


def test_gpu_tensor_on_cpu_copier_rejected():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device to make a GPU tensor")
    cp = BlockCopier("cpu")
    with pytest.raises(KVOffloadError, match="serves cpu"):
        cp.copy(torch.zeros(4, 4, device="cuda"), torch.zeros(4, 4), [0], [0], method="torch")


@pytest.mark.gpu
def test_gpu_validation_errors():
    cp = BlockCopier("cuda")
    g = torch.ones(8, 256, dtype=torch.uint8, device="cuda")
    pageable = torch.zeros(8, 256, dtype=torch.uint8)
    for m in ("dma", "cuda", "triton", "staged"):
        with pytest.raises(KVOffloadError, match="pageable"):
            cp.copy(g, pageable, [0], [0], method=m)
        with pytest.raises(KVOffloadError, match="pageable"):
            cp.copy(pageable, g, [0], [0], method=m)
    with pytest.raises(KVOffloadError, match="needs at least one GPU tensor"):
        cp.copy(pageable.pin_memory(), pageable.pin_memory(), [0], [0], method="cuda")
    if torch.cuda.device_count() > 1:
        with pytest.raises(KVOffloadError, match="serves"):
            cp.copy(torch.ones(8, 256, dtype=torch.uint8, device="cuda:1"), g, [0], [0], method="cuda")
    with pytest.raises(KVOffloadError, match="num_ctas"):
        cp.copy(g, g.clone(), [0], [0], method="cuda", num_ctas=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["cuda", "triton", "dma", "staged", "auto"])
def test_gpu_bad_ids_queue_nothing_and_the_next_copy_is_exact(method):
    """Every GPU path (the fused C++ check-stage-launch of 'cuda' included) rejects bad ids
    before queueing anything, and the copier is intact afterwards."""
    cp = BlockCopier("cuda")
    g = torch.randint(1, 255, (16, 512), dtype=torch.uint8, device="cuda")
    h = torch.full((12, 512), 0xEE, dtype=torch.uint8).pin_memory()
    for si, di, what in (([0, 16], [0, 1], "out of range"), ([0, 1], [0, 12], "out of range"),
                         ([-1, 2], [0, 1], "negative"), ([0, 1], [3, -2], "negative"),
                         ([0, 1, 2], [4, 9, 4], "duplicate")):
        with pytest.raises(KVOffloadError, match=what):
            cp.copy(g, h, np.array(si), np.array(di), method=method)
    torch.cuda.synchronize()
    assert (h == 0xEE).all()
    cp.copy(g, h, np.array([5, 0, 15]), np.array([11, 2, 7]), method=method)
    torch.cuda.synchronize()
    assert torch.equal(h[[11, 2, 7]], g[[5, 0, 15]].cpu())
    assert (h[[0, 1, 3, 4, 5, 6, 8, 9, 10]] == 0xEE).all()


def test_disjoint_views_of_one_storage_are_allowed(cp):
    s, _ = bufs()
    before = s.clone()
    cp.copy(s[:4], s[4:], [0, 1], [3, 2], method="torch")
    assert torch.equal(s[7], before[0]) and torch.equal(s[6], before[1])


# ---- what a newcomer meets on a CPU box (issue 36): the real cause, never a raw CUDA assertion
@pytest.mark.skipif(HAS_CUDA, reason="checks the messages of a box without a GPU")
@pytest.mark.parametrize("method", ["cuda", "dma", "staged"])
def test_gpu_method_on_cpu_names_the_missing_gpu(method):
    src = torch.randint(1, 255, (8, 256), dtype=torch.uint8)
    with pytest.raises(KVOffloadError, match="CUDA") as e:
        BlockCopier("cpu").copy(src, torch.zeros_like(src), [0], [1], method=method)
    assert "not built" not in str(e.value)


@pytest.mark.skipif(HAS_CUDA, reason="the CPU path of bind")
def test_bind_triton_on_cpu_tensors_runs_under_the_interpreter():
    from kernels.triton_copy import HAVE_TRITON

    if not HAVE_TRITON:
        pytest.skip("no triton")
    g = torch.Generator().manual_seed(3)
    src = torch.randint(1, 255, (16, 512), dtype=torch.uint8, generator=g)
    dst = torch.full_like(src, 0xA5)
    b = BlockCopier("cpu").bind(src, dst, method="triton")
    assert b([3, 1, 7], [0, 9, 4]) == "triton"
    ref = torch.full_like(src, 0xA5)
    ref[[0, 9, 4]] = src[[3, 1, 7]]
    assert torch.equal(dst, ref)
    with pytest.raises(KVOffloadError, match="out of range"):
        b([16], [0])


def test_python_m_kernels_help_and_calibrate_without_gpu():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    h = subprocess.run([sys.executable, "-m", "kernels", "--help"], capture_output=True, text=True, env=env, cwd=root)
    assert h.returncode == 0 and all(c in h.stdout for c in ("backends", "demo", "calibrate", "commands:"))
    if HAS_CUDA:
        return
    c = subprocess.run([sys.executable, "-m", "kernels", "calibrate"], capture_output=True, text=True, env=env,
                       cwd=root)
    assert c.returncode == 2 and "Traceback" not in c.stderr and "CUDA GPU" in c.stderr, c.stderr
