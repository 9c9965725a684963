"""connector.engine.io: the engine's per-step uploads and token read-backs (SM copies on the GPU)."""
import numpy as np
import pytest
import torch

from connector.engine.io import tokens_to_host, upload
from connector.engine.model import _Arena, _Padded, _resolve, SeqBatch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_upload_and_read_back_on_cpu():
    flat = np.arange(7, dtype=np.int64) * 3 - 5
    assert upload(flat, "cpu").tolist() == flat.tolist()
    out = torch.full((10,), -1, dtype=torch.int64)
    assert upload(flat, "cpu", out=out) is out and out.tolist() == flat.tolist() + [-1] * 3
    assert tokens_to_host(torch.tensor([4, 0, 9])) == [4, 0, 9]


def test_arena_refs_slice_the_upload():
    a = _Arena(5)
    r1, r2 = a.put(np.array([[1, 2], [3, 4]])), a.put(np.array([7, 8, 9]))
    buf = torch.from_numpy(np.concatenate([np.zeros(5, np.int64)] + a.parts))
    assert r1.get(buf).tolist() == [[1, 2], [3, 4]] and r2.get(buf).tolist() == [7, 8, 9]


def test_padded_groups_planned_into_the_upload_match_direct_ones():
    lens, ctx, bs = [3, 2, 1, 1], [7, 2, 5, 9], 4
    tables = [[5, 1], [2], [0, 3], [6, 7, 4]]
    starts = [0, 3, 5, 6]
    b = SeqBatch(torch.zeros(7, dtype=torch.long), None, None, None, starts, lens, ctx, None, tables)
    direct = _resolve(_Padded.plan(b, bs, 2), None)
    a = _Arena(0)
    planned = _Padded.plan(b, bs, 2, put=a.put)
    via = _resolve(planned, torch.from_numpy(np.concatenate(a.parts)))
    assert len(direct) == len(via) > 0
    for d, v in zip(direct, via):
        if isinstance(d, _Padded):
            for f in ("table", "q_idx", "valid_idx", "rows", "qpos0", "mask"):
                assert torch.equal(getattr(d, f), getattr(v, f)), f
        else:
            assert d[0] == v[0] and torch.equal(d[1], v[1])


@cuda
def test_gpu_upload_and_read_back_exact():
    rng = np.random.default_rng(0)
    for n in (1, 5, 1023, 1025, 70000):  # across the kernel's 1024-value programs and a regrow
        flat = rng.integers(-2**62, 2**62, n, dtype=np.int64)
        assert torch.equal(upload(flat, "cuda").cpu(), torch.from_numpy(flat))
        out = torch.full((n + 3,), -7, dtype=torch.int64, device="cuda")
        upload(flat, "cuda", out=out)
        assert torch.equal(out[:n].cpu(), torch.from_numpy(flat)) and out[n:].tolist() == [-7] * 3
        ids = torch.from_numpy(flat).cuda()
        assert tokens_to_host(ids) == flat.tolist()
    with pytest.raises(ValueError):
        upload(np.zeros(4, np.int64), "cuda", out=torch.zeros(3, dtype=torch.int64, device="cuda"))


@cuda
def test_gpu_read_back_does_not_queue_behind_a_bulk_copy():
    """A token read-back issued while a 4 GiB D2H copy runs on another stream returns before
    that copy ends: it does not use the copy engine the copy occupies."""
    g = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    h = torch.empty(4 << 30, dtype=torch.uint8, pin_memory=True)
    ids = torch.arange(8, device="cuda")
    tokens_to_host(ids)  # compiled
    s = torch.cuda.Stream()
    done = torch.cuda.Event()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        h.copy_(g, non_blocking=True)
        done.record()
    assert tokens_to_host(ids) == list(range(8))
    assert not done.query(), "the read-back waited for the bulk copy"
    done.synchronize()
