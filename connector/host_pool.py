"""Pinned host pool: one mmap region, pre-faulted in parallel, pinned chunk by chunk.

    pool = HostPool(num_blocks, block_bytes, device="cuda:0")
    pool.tensor            # uint8 [num_blocks, block_bytes] over the whole region
    pool.usable_blocks     # blocks whose chunk is already pinned (grows in the background)
    pool.wait_pinned()     # block until every chunk is registered

* Chunk boundaries fall on block boundaries (a DMA spanning two
  registrations fails), and the DMA planners are told where they are.
* The region is bound to the GPU's NUMA node when the machine has several
  (mbind, MPOL_BIND) and asks for transparent huge pages (MADV_HUGEPAGE).
* The first chunk is pinned before the constructor returns; the rest in a
  background thread. If pinning fails the pool stays usable as pageable
  memory: `pool.pinned` is False and a warning says why.
* torch's pinned allocator (power-of-two rounding) is never used.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
import warnings
from typing import Optional

import torch

from kernels import native
from kernels.plan import register_segments, unregister_segments

GiB = 1 << 30
MPOL_BIND, MPOL_MF_MOVE = 2, 2
SYS_mbind = 237  # x86_64


def gpu_numa_node(device: torch.device | str | int | None) -> int:
    """NUMA node of a GPU from sysfs, or -1 if unknown."""
    try:
        p = torch.cuda.get_device_properties(device)
        bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        with open(f"/sys/bus/pci/devices/{bus}/numa_node") as f:
            return int(f.read().strip())
    except Exception:
        return -1


def numa_node_count() -> int:
    try:
        return len([d for d in os.listdir("/sys/devices/system/node") if d.startswith("node") and d[4:].isdigit()])
    except OSError:
        return 1


SHM_DIR = "/dev/shm"


class HostPoolError(RuntimeError):
    """The pool cannot be set up as asked (raised at start-up, with what to change)."""


def _reserve_shm(fd: int, nbytes: int, path: str) -> None:
    """Gives a shared pool file its size with every page allocated now. A plain ftruncate
    makes a sparse tmpfs file of any size; if /dev/shm is smaller than the pool (containers
    default to 64 MiB), the first touch of a page past its end is a SIGBUS that kills the
    process mid-run (vLLM's offloading met this as "Bus error"). posix_fallocate instead
    fails at start-up, here, with ENOSPC; the file is then removed and a HostPoolError says
    what to change."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        try:
            st = os.statvfs(os.path.dirname(path))
            free = f"{st.f_bavail * st.f_frsize / GiB:.2f} GiB free of {st.f_blocks * st.f_frsize / GiB:.2f} GiB"
        except OSError:
            free = "free space unknown"
        try:
            os.unlink(path)
        except OSError:
            pass
        raise HostPoolError(
            f"kvoffload HostPool: cannot reserve {nbytes / GiB:.2f} GiB in {os.path.dirname(path)} for the shared "
            f"(tensor-parallel) pool ({free}; {e.strerror or e}). Give the container a larger /dev/shm "
            f"(docker run --shm-size=..., or a memory-backed emptyDir in Kubernetes) or ask for a smaller "
            f"pool (cpu_bytes_to_use)") from e


def _mbind(addr: int, nbytes: int, node: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_ulong(1 << node)
    r = libc.syscall(SYS_mbind, ctypes.c_void_p(addr), ctypes.c_ulong(nbytes), MPOL_BIND,
                     ctypes.byref(mask), ctypes.c_ulong(64), MPOL_MF_MOVE)
    return r == 0


class HostPool:
    """`num_blocks` blocks of `block_bytes` in one pinned mmap region.

    Args:
      num_blocks, block_bytes: the pool's geometry (bytes = their product).
      device: the GPU that will copy to/from the pool (for NUMA placement).
      chunk_bytes: registration granularity (rounded down to whole blocks,
        at least one block); the first chunk is pinned before the constructor
        returns, the others in the background.
      threads: threads that pre-fault pages.
      background: pin the rest in a background thread (else in the constructor).
      numa, hugepages: placement options (best effort, reported in `info`). numa binds
        the pool to the GPU's NUMA node where the machine has several.
      numa_node: bind to this node instead (benchmarks compare placements); needs a
        machine with more than one node.
      shared_name: map /dev/shm/kvoffload-<name> shared, so that several processes
        (one per tensor-parallel rank) use one pool; each registers it for itself.
        `unlink()` removes the file when every rank is done. The file's pages are
        allocated at start-up (posix_fallocate): a /dev/shm too small for the pool raises
        HostPoolError here instead of a SIGBUS later.

    Pinning that fails (cudaHostRegister error, no CUDA device, no CUDA extension) is not fatal:
    the pool stays usable as pageable memory, `pinned` is False, `error` says why, and a
    RuntimeWarning is issued once (transfers then take slower paths).
    """

    def __init__(self, num_blocks: int, block_bytes: int, device: torch.device | str | int | None = None, *, chunk_bytes: int = 256 << 20,
                 threads: Optional[int] = None,
                 background: bool = True, numa: bool = True, hugepages: bool = True,
                 pin: bool = True, shared_name: Optional[str] = None, numa_node: Optional[int] = None) -> None:
        if num_blocks < 1 or block_bytes < 1:
            raise ValueError(f"a host pool needs at least one block of at least one byte "
                             f"(got {num_blocks} x {block_bytes} B)")
        if numa_node is not None and not 0 <= numa_node < numa_node_count():
            raise ValueError(f"numa_node={numa_node} but this machine has {numa_node_count()} NUMA node(s)")
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self.nbytes = num_blocks * block_bytes
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None)
        self.info: dict = {}
        t0 = time.perf_counter()
        self.shared_path = None
        if shared_name:  # one region for several processes (tensor-parallel ranks)
            self.shared_path = f"{SHM_DIR}/kvoffload-{shared_name}"
            fd = os.open(self.shared_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size < self.nbytes:
                    _reserve_shm(fd, self.nbytes, self.shared_path)
                self._mm = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
        else:
            self._mm = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._buf = (ctypes.c_char * self.nbytes).from_buffer(self._mm)
        self.ptr = ctypes.addressof(self._buf)
        if hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._mm.madvise(mmap.MADV_HUGEPAGE)
                self.info["hugepages"] = True
            except OSError:
                self.info["hugepages"] = False
        self.info["numa_nodes"] = numa_node_count()
        gnode = gpu_numa_node(self.device) if self.device is not None else -1
        node = numa_node if numa_node is not None else (gnode if numa else -1)
        self.info["gpu_numa_node"], self.info["numa_node"] = gnode, node
        self.info["numa_bound"] = bool(node >= 0 and self.info["numa_nodes"] > 1 and
                                       _mbind(self.ptr, self.nbytes, node))
        # equal chunks (a whole number of blocks each): the first is pinned
        # before returning, so its size bounds the time to the first usable block
        per = max(1, min(chunk_bytes, 64 * GiB) // block_bytes)
        self.chunks = [(a, min(num_blocks, a + per)) for a in range(0, num_blocks, per)]
        self.chunk_bytes = per * block_bytes
        register_segments(self.ptr, self.nbytes, self.chunk_bytes)
        self.threads = threads or max(1, min(16, os.cpu_count() or 1))
        self.tensor = torch.frombuffer(self._buf, dtype=torch.uint8).view(num_blocks, block_bytes)
        self._registered: list = []
        self._usable = 0
        self.pinned = False
        self.error: Optional[str] = None
        self._lock = threading.Lock()
        self._closed = False
        self._want_pin = pin and native.AVAILABLE and torch.cuda.is_available()
        if pin and not self._want_pin:
            self._fail("no CUDA device or no CUDA extension (kernels.native): the pool is pageable")
        self._pin_chunk(0)
        self.info["first_usable_s"] = time.perf_counter() - t0
        self._t0 = t0
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._pin_rest, name="kvo-hostpool-pin", daemon=True)
            self._thread.start()
        else:
            self._pin_rest()

    # ------------------------------------------------------------------
    def huge_page_bytes(self) -> Optional[int]:
        """Bytes of the pool currently backed by 2 MiB pages (from /proc/self/smaps), or None
        where that cannot be read. madvise only asks; this says what the kernel gave. PCIe
        reads of host memory (H2D) are the side that suffers from 4 KiB pages."""
        try:
            lines = open("/proc/self/smaps").read().splitlines()
        except OSError:
            return None
        total, inside = 0, False
        for ln in lines:
            head = ln.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < self.ptr + self.nbytes and hi > self.ptr
            elif inside and head in ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:"):
                total += int(ln.split()[1]) * 1024
        return total

    @property
    def usable_blocks(self) -> int:
        """Leading blocks already pre-faulted (and pinned, if pinning works)."""
        return self._usable

    def unlink(self) -> None:
        """Removes the shared file (the mapping stays valid until closed)."""
        if self.shared_path and os.path.exists(self.shared_path):
            os.unlink(self.shared_path)

    def wait_pinned(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        """Stops background pinning, unregisters, and unmaps."""
        self._closed = True
        self.wait_pinned()
        with self._lock:
            for a in self._registered:
                native.host_unregister(ptr=a)
            self._registered.clear()
            unregister_segments(self.ptr)
        del self.tensor
        self._buf = None
        try:
            self._mm.close()
        except BufferError:  # a tensor view is still alive elsewhere
            pass

    def __del__(self):
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------
    def _fail(self, why: str) -> None:
        if self.error is None:
            self.error = why
            warnings.warn(f"kvoffload HostPool: {why}; falling back to pageable memory "
                          "(DMA and kernels need pinned memory, so transfers use the slow path)",
                          RuntimeWarning, stacklevel=3)
        self._want_pin = False
        self.pinned = False

    def _pin_chunk(self, i: int) -> None:
        self._fault(i, self.threads)
        self._register(i)

    def _fault(self, i: int, threads: int) -> None:
        a, b = self.chunks[i]
        t0 = time.perf_counter()
        if native.AVAILABLE:
            # a shared region may already hold another rank's blocks: read-fault it
            native.prefault(ptr=self.ptr + a * self.block_bytes, nbytes=(b - a) * self.block_bytes, threads=threads,
                        write=self.shared_path is None)
        # where start-up time goes (seconds, summed over chunks): faulting pages in vs pinning;
        # after the first chunk the two overlap (_pin_rest), so their sum exceeds the wall time
        self.info["prefault_s"] = self.info.get("prefault_s", 0.0) + (time.perf_counter() - t0)

    def _register(self, i: int) -> None:
        a, b = self.chunks[i]
        addr, n = self.ptr + a * self.block_bytes, (b - a) * self.block_bytes
        t1 = time.perf_counter()
        if self._want_pin and not self._closed:
            err = native.host_register(ptr=addr, nbytes=n)
            self.info["register_s"] = self.info.get("register_s", 0.0) + (time.perf_counter() - t1)
            if err:
                self._fail(f"cudaHostRegister of chunk {i} failed with CUDA error {err}")
            else:
                with self._lock:
                    self._registered.append(addr)
                    self.pinned = True
        self._usable = b

    def _pin_rest(self) -> None:
        """Chunks 1.. as a two-stage pipeline: chunk i+1 is faulted in (a helper thread, one
        prefault thread fewer) while chunk i is registered: faulting runs on CPU threads and
        registration in the driver, so the two overlap (figures: docs/design/host-pool-pinning.md)."""
        n = len(self.chunks)
        ahead: Optional[threading.Thread] = None
        try:
            for i in range(1, n):
                if self._closed:
                    return
                if ahead is None:
                    self._fault(i, self.threads)
                else:
                    ahead.join()
                ahead = None
                if i + 1 < n:
                    ahead = threading.Thread(target=self._fault, args=(i + 1, max(1, self.threads - 1)),
                                             name="kvo-hostpool-fault", daemon=True)
                    ahead.start()
                self._register(i)
        finally:
            if ahead is not None:
                ahead.join()
        self.info["all_pinned_s"] = time.perf_counter() - self._t0
