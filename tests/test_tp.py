"""TP ranks offloading shards of the same blocks into one shared host pool: two processes on
CPU tensors, two processes on one GPU, and one process per GPU where two are present."""
import multiprocessing as mp
import os
import uuid

import numpy as np
import pytest
import torch

from connector.host_pool import HostPool
from connector.tp import is_writer, rank_cells, row_bytes
from layout import KVBlockMover, KVLayout, KVSpec, allocate

NB, ROWS = 10, 8


def _spec(rank_tp, mla):
    return KVSpec(3, 1, 576, 8, mla=True, tp_size=rank_tp) if mla else KVSpec(3, 4, 16, 8, tp_size=rank_tp)


def _fill(kv, rank):
    for t in kv:
        flat = t.view(-1).view(torch.uint8)
        flat.copy_(((torch.arange(flat.numel()) * 7 + 13 * (rank + 1)) % 251 + 1).to(flat.device, torch.uint8))


def _worker(name, rank, world, mla, q, go, where="cpu"):
    """One TP rank: store its shard of blocks 9, 2, 5 into its cells, wait for the other, load back.
    where: "cpu" (CPU tensors, torch path), "cuda" (every rank on GPU 0), "cuda2" (rank r on GPU r);
    on a GPU the pool is pinned in each process and the copies take method "auto"."""
    try:
        spec = _spec(world, mla)
        lay = KVLayout.NB_BS_HS if mla else KVLayout.TWO_NB_BS_NH_HS
        cell = spec.unified_block_bytes
        dev = torch.device("cpu") if where == "cpu" else torch.device("cuda", rank if where == "cuda2" else 0)
        method = "torch" if where == "cpu" else "auto"
        pool = HostPool(ROWS, row_bytes(cell, world, mla), dev if where != "cpu" else None, shared_name=name,
                        background=False, pin=where != "cpu")
        kv = allocate(spec, lay, NB, device=dev)
        _fill(kv, 0 if mla else rank)  # replicated KV is the same on every rank
        mine = rank_cells(pool.tensor, rank, world, cell, replicated=mla)
        blocks, slots = np.array([9, 2, 5]), np.array([0, 7, 3])
        if is_writer(rank, mla):
            KVBlockMover(spec, lay, kv).pack(blocks, mine, slots, method=method)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        q.put(("stored", rank))
        go.wait(60)  # every rank has stored
        back = allocate(spec, lay, NB, device=dev, fill=lambda t: t.zero_())
        KVBlockMover(spec, lay, back).unpack(mine, slots, blocks, method=method)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        q.put(("loaded", rank, _same_blocks(kv, back, blocks, mla)))
        del mine
        pool.close()
    except Exception as e:  # reported to the parent
        q.put(("error", rank, repr(e)))


def _same_blocks(a, b, blocks, mla):
    for x, y in zip(a, b):
        xs = x[blocks] if mla else x[:, blocks]
        ys = y[blocks] if mla else y[:, blocks]
        if not torch.equal(xs.contiguous().view(torch.uint8), ys.contiguous().view(torch.uint8)):
            return False
    return True


def _can_run(where):
    if where == "cpu":
        return None
    if not torch.cuda.is_available():
        return "needs CUDA"
    from kernels._ext import _C
    if _C is None:
        return "needs kernels._C"
    if where == "cuda2" and torch.cuda.device_count() < 2:
        return "needs two GPUs"
    return None


@pytest.mark.parametrize("where", ["cpu", "cuda", "cuda2"], ids=["cpu", "one-gpu-two-procs", "two-gpus"])
@pytest.mark.parametrize("mla", [False, True], ids=["sharded", "mla-replicated"])
def test_two_ranks_share_one_pool(mla, where):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    why = _can_run(where)
    if why:
        pytest.skip(why)
    name = f"test-{uuid.uuid4().hex[:8]}"
    world = 2
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_worker, args=(name, r, world, mla, q, go, where)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        stored = [q.get(timeout=120) for _ in range(world)]
        assert all(s[0] == "stored" for s in stored), stored
        go.set()
        loaded = [q.get(timeout=120) for _ in range(world)]
        assert sorted(loaded) == [("loaded", 0, True), ("loaded", 1, True)], loaded
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
        # the parent sees both ranks' cells side by side in each row (or one cell, replicated)
        spec = _spec(world, mla)
        cell = spec.unified_block_bytes
        pool = HostPool(ROWS, row_bytes(cell, world, mla), shared_name=name, background=False, pin=False)
        rows = pool.tensor[[0, 7, 3]]
        assert (rows != 0).all(), "a cell was not written"
        if not mla:
            assert not torch.equal(rows[:, :cell], rows[:, cell:])  # different shards
        assert pool.tensor.shape[1] == (cell if mla else 2 * cell)  # MLA stored once per block
        pool.unlink()
        pool.close()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def test_rank_cells_checks():
    pool = torch.zeros(4, 30, dtype=torch.uint8)
    a, b = rank_cells(pool, 0, 2, 15), rank_cells(pool, 1, 2, 15)
    b.fill_(1)
    assert int(a.sum()) == 0 and int(pool[:, 15:].sum()) == 60
    rep = torch.zeros(4, 15, dtype=torch.uint8)
    assert rank_cells(rep, 1, 2, 15, replicated=True).data_ptr() == rank_cells(rep, 0, 2, 15, replicated=True).data_ptr()
    with pytest.raises(ValueError):
        rank_cells(pool, 2, 2, 15)
    with pytest.raises(ValueError):
        rank_cells(pool, 0, 2, 16)
    assert is_writer(0, True) and not is_writer(1, True) and is_writer(1, False)


# ---------------------------------------------------------------- a second GPU, current device 0
def _second_gpu():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from kernels._ext import _C
    if _C is None:
        pytest.skip("needs kernels._C")
    return torch.device("cuda", 1)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["dma", "cuda", "triton", "staged", "auto"])
@pytest.mark.parametrize("d", ["d2h", "h2d", "d2d"])
def test_copier_on_second_gpu_while_current_device_is_0(method, d):
    """A TP rank that never called set_device: every launch must still go to the copier's GPU."""
    from kernels import BlockCopier
    from tests.reference import POISON, copy_blocks_ref, poisoned, random_bytes

    dev = _second_gpu()
    if method == "staged" and d == "d2d":
        pytest.skip("staged is host<->device only")
    torch.cuda.set_device(0)
    bb, n_src, n_dst = 4096, 24, 30
    sdev, ddev = {"d2h": (dev, "cpu"), "h2d": ("cpu", dev), "d2d": (dev, dev)}[d]
    src = random_bytes((n_src * bb,), device=sdev, seed=5, pin=sdev == "cpu").view(n_src, bb)
    dst = poisoned(n_dst * bb, device=ddev, pin=ddev == "cpu").view(n_dst, bb)
    rng = np.random.default_rng(1)
    si, di = rng.permutation(n_src)[:17], rng.permutation(n_dst)[:17]
    want = copy_blocks_ref(src, dst, si, di, bb)
    BlockCopier(dev).copy(src, dst, si, di, method=method)
    torch.cuda.synchronize(dev)
    assert torch.cuda.current_device() == 0
    assert torch.equal(dst.cpu(), want)
    untouched = torch.from_numpy(np.setdiff1d(np.arange(n_dst), di))
    assert (dst.cpu()[untouched] == POISON).all()


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["cuda", "triton", "staged", "dma", "auto"])
def test_mover_on_second_gpu_while_current_device_is_0(method):
    dev = _second_gpu()
    torch.cuda.set_device(0)
    spec, lay = _spec(1, False), KVLayout.TWO_NB_BS_NH_HS
    kv = allocate(spec, lay, NB, device=dev)
    _fill(kv, 1)
    host = torch.full((4, spec.unified_block_bytes), 0xA5, dtype=torch.uint8, pin_memory=True)
    blocks, slots = np.array([9, 2, 5]), np.array([0, 3, 1])
    KVBlockMover(spec, lay, kv).pack(blocks, host, slots, method=method)
    back = allocate(spec, lay, NB, device=dev, fill=lambda t: t.zero_())  # the data has no zero byte
    KVBlockMover(spec, lay, back).unpack(host, slots, blocks, method=method)
    torch.cuda.synchronize(dev)
    assert torch.cuda.current_device() == 0
    assert _same_blocks(kv, back, blocks, False)
    assert (host[2] == 0xA5).all()  # the slot no block went to is untouched
    others = np.setdiff1d(np.arange(NB), blocks)
    for t in back:  # blocks outside the job stay untouched
        assert not t[:, torch.from_numpy(others).to(dev)].contiguous().view(torch.uint8).any()
