"""review36: regressions found reviewing the strategy / cost-model-table refactor (CPU)."""
from kernels.cost_model import CostModel

AV = ("torch", "dma", "cuda", "staged")


def test_settled_table_refills_after_its_clear():
    """BlockCopier.copy()'s small-job hot path reads CostModel.settled_limits' table inline and
    calls kernel_limits only on a miss. The table is cleared at 4096 entries; a shape that
    kernel_limits had settled (in its own memo) before that clear must come back into the table
    at its next miss, as the copier's own memo did before the refactor: else it misses (two
    Python calls per job) for as long as kernel_limits' memo keeps it. Negative control: without
    the re-insert in kernel_limits' settled return, 96 of the 200 steady shapes miss for ever."""
    cm = CostModel()
    tab = cm.settled_limits(AV)

    def call(n):
        if ("h2d", 4096, n) in tab:
            return "hit"
        cm.kernel_limits("h2d", 4096, n, AV)
        return "miss"
    for n in range(1, 4001):          # 4000 shapes settled
        call(n), call(n)
    for n in range(20000, 20100):     # one-off shapes: kernel_limits' memo clears (> 4096)
        call(n)
    steady = range(10000, 10200)      # a steady set: settled, then the table clears at 4096
    for _ in range(3):
        for n in steady:
            call(n)
    for n in steady:
        call(n)                       # at most one miss each, then back in the table
    assert all(call(n) == "hit" for n in steady)
    for n in steady:                  # and the table's answers are kernel_limits' own
        assert tab[("h2d", 4096, n)] == cm.kernel_limits("h2d", 4096, n, AV)


import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.mark.gpu
@pytest.mark.parametrize("d", ["d2h", "h2d"])
def test_gpu_staged_on_the_legacy_stream_keeps_its_order_without_host_sync(d):
    """A staged job queued on the legacy default stream runs on the staging's created stream,
    forked from and joined back to the caller's (kernels/copy.py staged_pipeline). With no host
    sync between them: the job must see what the caller queued before it (d2h: a fill queued
    behind ~0.1 s of GPU sleep) and what the caller queues after it must see the job's bytes
    (h2d: a clone of the destination queued right after); two jobs back to back on the legacy
    stream (the fork/join events reused) are both exact."""
    from kernels import BlockCopier
    from tests.reference import poisoned, random_bytes

    legacy = torch.cuda.default_stream()
    assert legacy.cuda_stream == 0, "not the legacy default stream: nothing to test"
    cp = BlockCopier("cuda", staging_bytes=1 << 20)
    cp.staged_chunk_bytes = 64 << 10  # many chunks: both halves alternate
    bb, n = 4096, 600
    perm = np.random.default_rng(7).permutation(n)
    with torch.cuda.stream(legacy):
        if d == "d2h":
            g = poisoned(n * bb, device="cuda").view(n, bb)
            h = poisoned(n * bb, pin=True).view(n, bb)
            h2 = poisoned(n * bb, pin=True).view(n, bb)
            src = random_bytes((n * bb,), device="cuda", seed=3).view(n, bb)
            scratch = poisoned(bb, pin=True).view(1, bb)
            cp.copy(src[:1], scratch, [0], [0], method="staged", stream=legacy)  # staging made first
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)
            g.copy_(src)  # queued behind the sleep: the job must wait for it
            cp.copy(g, h, perm, np.arange(n), method="staged", stream=legacy)
            cp.copy(g, h2, np.arange(n), perm, method="staged", stream=legacy)  # back to back
            legacy.synchronize()
            assert torch.equal(h, src.cpu()[torch.from_numpy(perm)])
            assert torch.equal(h2[torch.from_numpy(perm)], src.cpu())
        else:
            h = random_bytes((n * bb,), seed=4, pin=True).view(n, bb)
            g = poisoned(n * bb, device="cuda").view(n, bb)
            g2 = poisoned(n * bb, device="cuda").view(n, bb)
            cp.copy(h[:1], g2[:1], [0], [0], method="staged", stream=legacy)  # staging made (cudaMalloc) first
            g2.fill_(0xA5)
            snap, snap2 = torch.empty_like(g), torch.empty_like(g2)  # no allocation once queued
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)  # the job queued behind it, the clones behind the job
            cp.copy(h, g, np.arange(n), perm, method="staged", stream=legacy)
            snap.copy_(g)
            cp.copy(h, g2, perm, np.arange(n), method="staged", stream=legacy)  # back to back
            snap2.copy_(g2)
            legacy.synchronize()
            want = h.clone()
            assert torch.equal(snap[torch.from_numpy(perm).cuda()].cpu(), want)
            assert torch.equal(snap2.cpu(), want[torch.from_numpy(perm)])
