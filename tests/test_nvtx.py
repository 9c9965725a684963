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
