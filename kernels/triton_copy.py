"""Triton block-copy kernel: same semantics as the CUDA `copy_blocks` kernel.

Runs on the GPU (pinned host tensors are reached through UVA) and on the CPU
under TRITON_INTERPRET=1, which is how CI exercises it.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

# Without a GPU, Triton kernels can only run in its interpreter; it must be
# chosen before any @triton.jit runs, so decide here (an explicit
# TRITON_INTERPRET=0/1 from the user is left alone).
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
    TRITON_REASON = ""
except Exception as e:  # pragma: no cover - depends on the install
    HAVE_TRITON = False
    TRITON_REASON = f"triton not importable ({e}); pip install triton"

CHUNK_BYTES = 8192  # bytes one program moves per loop iteration


def jit_unspecialized(*names: str) -> Callable[[Callable], Any]:
    """triton.jit that does not specialise the named arguments on their value (== 1,
    divisible by 16) or 16-byte alignment: for arguments that change from call to call
    (sizes, views at varying offsets), where each specialisation would compile a new
    variant mid-run. Uses whichever of the two options this Triton has."""
    import inspect

    params = inspect.signature(triton.jit).parameters
    kw = {k: list(names) for k in ("do_not_specialize", "do_not_specialize_on_alignment") if k in params}
    return triton.jit(**kw)

if HAVE_TRITON:

    # n_pairs and the id pointers change with every job (and the dst ids' alignment with
    # n): unspecialised, one compiled kernel serves every job of a buffer pair
    @jit_unspecialized("n_pairs", "src_ids_ptr", "dst_ids_ptr")
    def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, n_pairs, elems_per_block,
                            src_stride, dst_stride, src_off, dst_off,
                            CHUNK: tl.constexpr, ALIGN: tl.constexpr):
        # Persistent grid: each program walks (pair, chunk) work items.
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        chunks = tl.cdiv(elems_per_block, CHUNK)
        total = n_pairs * chunks
        for w in range(pid, total, nprog):
            pair = w // chunks
            c = w - pair * chunks
            s = tl.load(src_ids_ptr + pair).to(tl.int64)
            d = tl.load(dst_ids_ptr + pair).to(tl.int64)
            s_base = tl.multiple_of(s * src_stride + src_off, ALIGN)
            d_base = tl.multiple_of(d * dst_stride + dst_off, ALIGN)
            offs = c * CHUNK + tl.arange(0, CHUNK)
            mask = offs < elems_per_block
            x = tl.load(src_ptr + s_base + offs, mask=mask, eviction_policy="evict_first")
            tl.store(dst_ptr + d_base + offs, x, mask=mask, cache_modifier=".cs")


_VIEW_DTYPE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def flat_view(t: torch.Tensor, width: int) -> torch.Tensor:
    """The tensor's whole storage span seen as 1-D elements of `width` bytes."""
    es = t.element_size()
    nbytes = (t.storage_offset() * es) % width  # 0 by construction of `width`
    assert nbytes == 0
    u8 = torch.empty(0, dtype=torch.uint8, device=t.device)
    span = t.untyped_storage().nbytes() - t.storage_offset() * es
    u8.set_(t.untyped_storage(), t.storage_offset() * es, (span,), (1,))
    return u8.view(_VIEW_DTYPE[width]) if width > 1 else u8


class DevPtr:
    """A bare address that Triton takes as a pointer argument (Triton accepts anything with
    ``data_ptr()`` and ``dtype``). Building tensor views per launch costs microseconds of
    host time each; on the GPU the kernels need nothing but the address and element type.
    Pinned host addresses work too (UVA). Not for the interpreter, which needs tensors."""

    __slots__ = ("ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self.ptr = ptr
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.ptr


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def ptr_arg(t: torch.Tensor, width: int) -> Any:  # a flat view (interpreter) or a DevPtr
    """The kernel argument for a buffer seen as elements of `width` bytes."""
    if _interpreting():
        return flat_view(t, width)
    return DevPtr(t.data_ptr(), _VIEW_DTYPE[width])


_FAST = os.environ.get("KVO_TRITON_FAST_LAUNCH", "1") != "0"
_compiled: dict = {}


def _spec_key(args, consts=()) -> tuple:
    """What Triton specialises a compiled kernel on: per runtime argument, for ints
    divisibility by 16, == 1 and whether they fit int32; for pointers element type and
    16-byte alignment; the constexprs by value. A superset of Triton 3.x's rules: two calls
    with equal keys run the same compiled kernel."""
    k = [consts]
    for a in args:
        if a.__class__ is int:
            k.append((a % 16 == 0, a == 1, -(1 << 31) <= a < (1 << 31)))
        elif hasattr(a, "data_ptr"):
            k.append((a.dtype, a.data_ptr() % 16 == 0))
        else:
            k.append(a)
    return tuple(k)


def _launch_hooks():
    """Triton's launch enter/exit hooks, read at each launch (a profiler may set them)."""
    if _knobs is not None:
        return _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
    from triton.compiler import CompiledKernel  # older Triton: hooks on CompiledKernel

    return CompiledKernel.launch_enter_hook, CompiledKernel.launch_exit_hook


try:
    from triton import knobs as _knobs
except Exception:
    _knobs = None


def launch(kernel: Any, grid: tuple, args: tuple, consts: tuple, num_warps: int) -> Any:
    """kernel[grid](*args, num_warps=...) on the current torch stream, minus most of Triton's
    per-launch Python: the first launch of each specialisation goes through the JIT (which
    compiles or finds the kernel and returns it); later ones call the compiled kernel's
    launcher directly, as JITFunction.run does after its cache lookup. Saves most of Triton's
    per-launch host time, a large share of a job's 50 us submit budget
    (profiling/results/triton_launch.json). `args` are all of the
    kernel's runtime parameters in order, `consts` its trailing constexpr ones (keyed by
    value). KVO_TRITON_FAST_LAUNCH=0 turns it off."""
    args = args + consts
    if not _FAST or _interpreting():
        ck = kernel[grid](*args, num_warps=num_warps)
        return None if _interpreting() else ck
    dev = torch.cuda.current_device()
    # id(kernel): JITFunction hashes its source's cache key under a lock; identity is what counts
    key = (id(kernel), dev, num_warps, _spec_key(args[:len(args) - len(consts)], consts))
    ck = _compiled.get(key)
    if ck is None:
        ck = kernel[grid](*args, num_warps=num_warps)
        ok = all(hasattr(ck, a) for a in ("run", "function", "packed_metadata", "launch_metadata"))
        _compiled[key] = ck if ok else False
        return ck
    if ck is False:
        return kernel[grid](*args, num_warps=num_warps)
    stream = torch.cuda.current_stream(dev).cuda_stream if _raw_stream is None else _raw_stream(dev)
    enter, exit_ = _launch_hooks()
    if _hook_active(enter) or _hook_active(exit_):
        md = ck.launch_metadata(grid, stream, *args)
    else:  # no hook: skip building the hooks' metadata (Triton >= 3.5 keeps empty chains there)
        enter = exit_ = md = None
    ck.run(grid[0], 1, 1, stream, ck.function, ck.packed_metadata, md, enter, exit_, *args)
    return ck


# Bytes per runtime argument in a compiled kernel's parameter list (kvo::FnSpec kinds: 1 = 4
# bytes, 2 = 8 bytes); other types are not launched from C++.
_ARG_KINDS = {"i32": 1, "u32": 1, "i64": 2, "u64": 2}


def fn_spec(ck: Any, n_runtime: int) -> Optional[tuple]:
    """(function, threads, shared, kinds, scratch) for launching the compiled Triton kernel
    `ck` from C++ (kernels/csrc/fn_launch.h, as IndexRing.copy_blocks_fn does) with its first
    `n_runtime` arguments; None where that launch would not match Triton's own (see
    param_spec) or the kernel is not loaded."""
    p = param_spec(ck, n_runtime)
    try:
        function = int(ck.function or 0)
    except (AttributeError, TypeError, ValueError):
        return None
    return None if p is None or not function else (function, *p)


def param_spec(ck: Any, n_runtime: int) -> Optional[tuple]:
    """(threads, shared, kinds, scratch) of a compiled Triton kernel, or None.

    Triton's launcher passes each argument the compiler kept (its signature type not
    "constexpr" and not in src.constants) by value, then one pointer per hidden scratch
    buffer the metadata declares (global, profile), null when its size is 0: the rules
    torch inductor's static launcher follows too. kinds: 2 bits per argument, 0 dropped,
    1 four bytes, 2 eight bytes. Declines (None) kernels that need a scratch buffer, a
    cooperative or PDL launch or thread-block clusters, that take an argument of another
    type than a pointer or a 32/64-bit integer, or whose arguments past `n_runtime` are not
    all compile-time constants."""
    try:
        src, md = ck.src, ck.metadata
        names = list(src.fn.arg_names)
        sig = {(names[k] if isinstance(k, int) else k): v for k, v in src.signature.items()}
        consts = set()
        for k in getattr(src, "constants", None) or {}:
            k = k[0] if isinstance(k, tuple) and len(k) == 1 else k
            consts.add(names[k] if isinstance(k, int) else k)
        kinds = 0
        for i, name in enumerate(names):
            ty = sig[name]
            if ty == "constexpr" or name in consts:
                continue
            if i >= n_runtime:
                return None
            kind = 2 if isinstance(ty, str) and ty.startswith("*") else _ARG_KINDS.get(ty)
            if kind is None:
                return None
            kinds |= kind << (2 * i)
        scratch = 0
        for attr in ("global_scratch_size", "profile_scratch_size"):
            if hasattr(md, attr):
                if getattr(md, attr):
                    return None
                scratch += 1
        if getattr(md, "launch_cooperative_grid", False) or getattr(md, "launch_pdl", False):
            return None
        cluster = tuple(getattr(md, "cluster_dims", None) or (1, 1, 1))
        if getattr(md, "num_ctas", 1) != 1 or any(c != 1 for c in cluster):
            return None
        shared = getattr(ck, "shared", None)
        shared = md.shared if shared is None else shared
        return (32 * int(md.num_warps), int(shared), kinds, scratch)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        return None


def _hook_active(h) -> bool:
    # None, or (Triton >= 3.5) an empty HookChain: no hook
    if h is None:
        return False
    calls = getattr(h, "calls", None)
    return True if calls is None else bool(calls)


def hooks_set() -> bool:
    """Whether a profiler set Triton's launch hooks (launches must then go through Triton)."""
    enter, exit_ = _launch_hooks()
    return _hook_active(enter) or _hook_active(exit_)


def copy_launch_args(block_bytes: int, src_stride: int, dst_stride: int,
                     vec_bytes: int) -> tuple[int, int, int, int, int, int]:
    """What launch_triton_copy computes from a job's geometry: (element width, elements per
    block, elements per chunk, chunks per block, src stride and dst stride in elements)."""
    w = min(vec_bytes, 8)
    epb = block_bytes // w
    chunk = max(16, min(CHUNK_BYTES // w, triton.next_power_of_2(epb)))
    return w, epb, chunk, (epb + chunk - 1) // chunk, src_stride // w, dst_stride // w


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def launch_triton_copy(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor,
                       dst_ids: torch.Tensor, n_pairs: int, block_bytes: int, src_stride: int,
                       dst_stride: int, src_offset: int, dst_offset: int, vec_bytes: int,
                       num_programs: int) -> Any:
    """Launches on the current torch stream. Sizes and strides are in bytes. src_ids and
    dst_ids: int64 tensors, or DevPtr addresses of int64 or int32 ids on the GPU path.
    Returns the compiled kernel that ran (None on the interpreter or for no pairs)."""
    if not HAVE_TRITON:
        raise RuntimeError(TRITON_REASON)
    if n_pairs == 0:
        return None
    w, epb, chunk, chunks, ss, ds = copy_launch_args(block_bytes, src_stride, dst_stride, vec_bytes)
    align = max(vec_bytes // w, 1)
    s = ptr_arg(src, w)
    d = ptr_arg(dst, w)
    grid = (max(1, min(num_programs, n_pairs * chunks)),)
    return launch(_copy_blocks_kernel, grid, (s, d, src_ids, dst_ids, n_pairs, epb, ss, ds,
                                              src_offset // w, dst_offset // w), (chunk, align), num_warps=4)


if HAVE_TRITON:

    @triton.jit
    def _pack_layers_kernel(base_ptr, uni_ptr, table_ptr, block_ids_ptr, slot_ids_ptr, n_blocks,
                            num_frags, chunks_per_frag, uni_stride, TO_UNIFIED: tl.constexpr,
                            CHUNK: tl.constexpr, ALIGN: tl.constexpr):
        # Same work split as the CUDA pack kernel. Fragment addresses are taken
        # relative to base_ptr (int64 offsets in elements, may be negative).
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        per_block = num_frags * chunks_per_frag
        total = n_blocks * per_block
        for w in range(pid, total, nprog):
            blk = w // per_block
            r = w - blk * per_block
            f = r // chunks_per_frag
            c = r - f * chunks_per_frag
            # every table entry is a multiple of ALIGN elements (checked on the
            # host); saying so lets Triton keep 16-byte accesses under the mask
            frag_off = tl.multiple_of(tl.load(table_ptr + f), ALIGN)
            stride = tl.multiple_of(tl.load(table_ptr + num_frags + f), ALIGN)
            nelem = tl.multiple_of(tl.load(table_ptr + 2 * num_frags + f), ALIGN)
            uoff = tl.multiple_of(tl.load(table_ptr + 3 * num_frags + f), ALIGN)
            b = tl.load(block_ids_ptr + blk).to(tl.int64)
            s = tl.load(slot_ids_ptr + blk).to(tl.int64)
            la = tl.multiple_of(frag_off + b * stride, ALIGN)
            ua = tl.multiple_of(s * uni_stride + uoff, ALIGN)
            offs = c * CHUNK + tl.arange(0, CHUNK)
            mask = offs < nelem
            if TO_UNIFIED:
                x = tl.load(base_ptr + la + offs, mask=mask, eviction_policy="evict_first")
                tl.store(uni_ptr + ua + offs, x, mask=mask, cache_modifier=".cs")
            else:
                x = tl.load(uni_ptr + ua + offs, mask=mask, eviction_policy="evict_first")
                tl.store(base_ptr + la + offs, x, mask=mask, cache_modifier=".cs")


def launch_triton_pack(base: torch.Tensor, unified: torch.Tensor, table_elems: torch.Tensor,
                       block_ids: torch.Tensor, slot_ids: torch.Tensor, n_blocks: int,
                       num_frags: int, max_frag_bytes: int, unified_stride: int, vec_bytes: int,
                       to_unified: bool, num_programs: int) -> None:
    """table_elems: int64 [4, F] on the device, offsets/strides/sizes already in elements of
    width min(vec_bytes, 8) and fragment offsets relative to `base`."""
    if not HAVE_TRITON:
        raise RuntimeError(TRITON_REASON)
    if n_blocks == 0:
        return
    w = min(vec_bytes, 8)
    b = ptr_arg(base, w)
    u = ptr_arg(unified, w)
    max_elems = max_frag_bytes // w
    chunk = max(16, min(CHUNK_BYTES // w, triton.next_power_of_2(max_elems)))
    cpf = (max_elems + chunk - 1) // chunk
    grid = (max(1, min(num_programs, n_blocks * num_frags * cpf)),)
    launch(_pack_layers_kernel, grid, (b, u, table_elems, block_ids, slot_ids, n_blocks, num_frags, cpf,
                                       unified_stride // w), (to_unified, chunk, max(vec_bytes // w, 1)), num_warps=4)
