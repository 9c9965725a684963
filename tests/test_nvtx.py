"""kernels._nvtx: ranges reach NVTX only when a tool is injected (or KVO_NVTX=1 says so), and
reach a recording torch profiler either way; the worker's fast paths follow the same rule."""
import pytest

import kernels._nvtx as nv


@pytest.mark.parametrize("env, want", [({}, False), ({"NVTX_INJECTION64_PATH": "/x/libinj.so"}, True),
                                       ({"NVTX_INJECTION64_PATH": ""}, False), ({"KVO_NVTX": "1"}, True),
                                       ({"KVO_NVTX": "0", "NVTX_INJECTION64_PATH": "/x/libinj.so"}, False),
                                       ({"KVO_NVTX": "yes"}, False)])
def test_tool_injected_reads_the_injection_path_and_the_override(monkeypatch, env, want):
    for k in ("NVTX_INJECTION64_PATH", "KVO_NVTX"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert nv._tool_injected() is want


def test_ranges_are_pushed_only_when_a_tool_listens(monkeypatch):
    log = []
    monkeypatch.setattr(nv, "push", lambda name: log.append(("push", name)))
    monkeypatch.setattr(nv, "pop", lambda: log.append(("pop",)))
    monkeypatch.setattr(nv, "_torch_profiling", lambda: False)
    monkeypatch.setattr(nv, "TOOL", False)
    with nv.nvtx_range("kvo.a"):
        pass
    assert log == [] and nv.nvtx_range("kvo.a") is nv._NULL
    monkeypatch.setattr(nv, "TOOL", True)
    with pytest.raises(ValueError):
        with nv.nvtx_range("kvo.b"):
            raise ValueError("inside")
    assert log == [("push", "kvo.b"), ("pop",)]  # popped on the way out of an exception too


def test_a_recording_torch_profiler_gets_ranges_without_a_tool(monkeypatch):
    import torch

    log = []
    monkeypatch.setattr(nv, "push", lambda name: log.append(("push", name)))
    monkeypatch.setattr(nv, "pop", lambda: log.append(("pop",)))
    monkeypatch.setattr(nv, "TOOL", False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with nv.nvtx_range("kvo.recorded"):
            torch.ones(4).sum()
    assert log == []
    assert any(e.name == "kvo.recorded" for e in prof.events())


def test_copy_and_pack_ranges_follow_the_same_rule(monkeypatch):
    """BlockCopier.copy and KVBlockMover's pack build and push their range only when heard: a
    listening tool sees kvo.copy / kvo.pack ranges, a recording torch profiler sees them as
    events, and with neither nothing is pushed."""
    import numpy as np
    import torch

    from kernels import BlockCopier
    from layout import KVBlockMover, KVLayout, KVSpec, allocate

    log = []
    monkeypatch.setattr(nv, "push", lambda name: log.append(name))
    monkeypatch.setattr(nv, "pop", lambda: log.append("pop"))
    src = torch.arange(64, dtype=torch.uint8).view(4, 16)
    dst = torch.zeros(4, 16, dtype=torch.uint8)
    spec = KVSpec(2, 2, 16, 4, dtype=torch.float16)
    kv = allocate(spec, KVLayout.TWO_NB_BS_NH_HS, 4, device="cpu")
    mover = KVBlockMover(spec, KVLayout.TWO_NB_BS_NH_HS, kv)
    host = torch.zeros(4, spec.unified_block_bytes, dtype=torch.uint8)

    def run():
        BlockCopier("cpu").copy(src, dst, np.array([0, 1]), np.array([2, 3]), method="torch")
        mover.pack(np.array([0, 1]), host, np.array([2, 3]), method="torch")

    monkeypatch.setattr(nv, "TOOL", False)
    run()
    assert log == []
    monkeypatch.setattr(nv, "TOOL", True)
    run()
    assert [x.split()[0] for x in log] == ["kvo.copy", "pop", "kvo.pack", "pop"], log
    monkeypatch.setattr(nv, "TOOL", False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    names = [e.name.split()[0] for e in prof.events()]
    assert "kvo.copy" in names and "kvo.pack" in names and log[4:] == []
