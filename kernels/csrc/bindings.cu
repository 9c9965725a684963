// Thin pybind11 bindings. Python validates everything and passes raw
// pointers, sizes and the stream as integers; no libtorch is linked. State lives in headers
// (index_ring.h: IndexRing; desc_arrays.h: the per-thread descriptor arrays; dma_submitter.h).
#include <pybind11/pybind11.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "copy_blocks.cuh"
#include "dma_batch.cuh"
#include "pack_layers.cuh"
#include "host_plan.h"
#include "dma_submitter.h"
#include "fn_launch.h"
#include "binding_util.h"
#include "desc_arrays.h"
#include "index_ring.h"

#include <pybind11/stl.h>
#include <tuple>
#include <chrono>
#include <algorithm>
#include <vector>

namespace py = pybind11;



static void copy_blocks(uintptr_t src, uintptr_t dst, uintptr_t src_ids, uintptr_t dst_ids,
                        int64_t n_pairs, int64_t block_bytes, int64_t src_stride,
                        int64_t dst_stride, int64_t src_offset, int64_t dst_offset, int vec_bytes,
                        int num_ctas, uintptr_t stream, int variant) {
  KVO_CHECK(kvo::launch_copy_blocks(as_ptr<const void>(src), as_ptr<void>(dst),
                                    as_ptr<const int64_t>(src_ids), as_ptr<const int64_t>(dst_ids),
                                    n_pairs, block_bytes, src_stride, dst_stride, src_offset,
                                    dst_offset, vec_bytes, num_ctas,
                                    reinterpret_cast<cudaStream_t>(stream), variant));
}

static int dma_batch(uintptr_t dsts, uintptr_t srcs, uintptr_t sizes, size_t count,
                     size_t max_per_call, int mode, bool src_any_order, uintptr_t stream) {
  int used_batch = 0;
  KVO_CHECK(kvo::launch_dma_batch(as_ptr<void* const>(dsts), as_ptr<const void* const>(srcs),
                                  as_ptr<const size_t>(sizes), count, max_per_call, mode,
                                  src_any_order, reinterpret_cast<cudaStream_t>(stream),
                                  &used_batch));
  return used_batch;
}

static void pack_layers(uintptr_t table, int num_frags, uintptr_t unified, uintptr_t block_ids,
                        uintptr_t slot_ids, int64_t n_blocks, int64_t max_frag_bytes,
                        int64_t unified_block_stride, int vec_bytes, bool to_unified, int num_ctas,
                        uintptr_t stream) {
  KVO_CHECK(kvo::launch_pack_layers(as_ptr<const int64_t>(table), num_frags, as_ptr<char>(unified),
                                    as_ptr<const int64_t>(block_ids), as_ptr<const int64_t>(slot_ids),
                                    n_blocks, max_frag_bytes, unified_block_stride, vec_bytes,
                                    to_unified, num_ctas, reinterpret_cast<cudaStream_t>(stream)));
}


static std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t> check_ids(
    uintptr_t src_ids, uintptr_t dst_ids, int64_t n, int64_t n_src, int64_t n_dst) {
  kvo::IdCheck r = kvo::check_ids(as_ptr<const int64_t>(src_ids), as_ptr<const int64_t>(dst_ids), n,
                                  n_src, n_dst);
  return {r.code, r.index, r.value, r.runs_both, r.runs_src, r.runs_dst};
}

// (n, address of a, address of b) when a and b are 1-D C-contiguous buffers of signed 64-bit
// integers of one length n (numpy int64 id arrays), else None; the buffers are released again,
// so the caller keeps a and b alive while it uses the addresses. The workers' fast paths take
// their id addresses here: numpy's `.ctypes.data` costs several times more, warm and above all
// right after a wait (docs/design/cold-host-path.md).
// pack_native's answer for ids that are not 1-D C-contiguous int64 arrays of one length
// within the ring's capacity: not an id error (kvo::IdError's codes are 1-6); nothing was done
// and the caller's general path takes the job.
constexpr int kNotIdArrays = 7;

struct Int64Pair {
  int64_t n = -1;  // -1: not a pair of 1-D C-contiguous int64 buffers of one length
  uintptr_t a = 0, b = 0;
};

static Int64Pair read_int64_pair(py::handle a, py::handle b) {
  auto take = [](py::handle o, Py_buffer* v) {
    if (PyObject_GetBuffer(o.ptr(), v, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) return true;
    PyErr_Clear();  // not a contiguous buffer: the caller's general path judges it
    return false;
  };
  auto is_i64 = [](const Py_buffer& v) {
    const char* f = v.format ? v.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') ++f;  // a little-endian host: native order
    return v.ndim == 1 && v.itemsize == 8 && (f[0] == 'l' || f[0] == 'q') && f[1] == '\0';
  };
  Int64Pair out;
  Py_buffer va, vb;
  if (!take(a, &va)) return out;
  if (!take(b, &vb)) {
    PyBuffer_Release(&va);
    return out;
  }
  if (is_i64(va) && is_i64(vb) && va.shape[0] == vb.shape[0])
    out = {(int64_t)va.shape[0], reinterpret_cast<uintptr_t>(va.buf), reinterpret_cast<uintptr_t>(vb.buf)};
  PyBuffer_Release(&vb);
  PyBuffer_Release(&va);
  return out;
}

static py::object int64_pair(py::handle a, py::handle b) {
  Int64Pair p = read_int64_pair(a, b);
  if (p.n < 0) return py::none();
  return py::make_tuple(p.n, p.a, p.b);
}

// ---------------------------------------------------------------------------------------
// Raw CPython entry points (METH_FASTCALL) for the worker's per-job fast paths. Right after a
// wait of tens of milliseconds every call runs cold, and each call's entry counts: a raw entry
// that reads two arrays and checks them costs no more, cold, than pybind11's call that only
// reads them (docs/design/host-id-pass.md). Still several times a warm call each, so the fast
// paths also cut the number of calls and their Python around them.
// Positional arguments only; errors are raised with file:line, like KVO_CHECK's.
#define KVO_RAW_FAIL(exc, ...)                                                         \
  do {                                                                                 \
    PyErr_Format(exc, "%s:%d: " __VA_ARGS__);                                          \
    return nullptr;                                                                    \
  } while (0)

// PyLong to C integers for the raw entry points; errors are left set (check PyErr_Occurred once)
static inline uint64_t raw_u64(PyObject* o) { return (uint64_t)PyLong_AsUnsignedLongLong(o); }
static inline int64_t raw_i64(PyObject* o) { return (int64_t)PyLong_AsLongLong(o); }

static PyObject* raw_tuple(std::initializer_list<long long> v) {
  PyObject* t = PyTuple_New((Py_ssize_t)v.size());
  if (!t) return nullptr;
  Py_ssize_t i = 0;
  for (long long x : v) {
    PyObject* o = PyLong_FromLongLong(x);
    if (!o) {
      Py_DECREF(t);
      return nullptr;
    }
    PyTuple_SET_ITEM(t, i++, o);
  }
  return t;
}

// check_pair(a, b, n_src, n_dst, b_is_src): int64_pair and check_ids in one call. None unless a
// and b are 1-D C-contiguous int64 buffers of one length n > 0, else (n, address of a, address
// of b, code, index, value, runs_both, runs_src, runs_dst), the check run on (src, dst) = (a, b),
// or (b, a) with b_is_src.
static PyObject* check_pair(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) KVO_RAW_FAIL(PyExc_TypeError, "check_pair takes 5 positional arguments (a, b, n_src, n_dst, b_is_src), got %zd", __FILE__, __LINE__, nargs);
  const long long n_src = PyLong_AsLongLong(args[2]), n_dst = PyLong_AsLongLong(args[3]);
  const int b_is_src = PyObject_IsTrue(args[4]);
  if (PyErr_Occurred()) return nullptr;
  const Int64Pair p = read_int64_pair(args[0], args[1]);
  if (p.n <= 0) Py_RETURN_NONE;
  const auto s = as_ptr<const int64_t>(b_is_src ? p.b : p.a), d = as_ptr<const int64_t>(b_is_src ? p.a : p.b);
  kvo::IdCheck r;
  if (p.n >= 8192) {  // the pass may take tens of us: let other threads run
    Py_BEGIN_ALLOW_THREADS
    r = kvo::check_ids(s, d, p.n, n_src, n_dst);
    Py_END_ALLOW_THREADS
  } else {
    r = kvo::check_ids(s, d, p.n, n_src, n_dst);
  }
  return raw_tuple({p.n, (long long)p.a, (long long)p.b, r.code, r.index, r.value, r.runs_both, r.runs_src,
                    r.runs_dst});
}

// submit_native(submitter, record_stream, src_ids, dst_ids, n, wait_event, fixed) -> ticket:
// DmaSubmitter.record_and_submit with the arguments that are fixed per worker and direction in
// one tuple, fixed = (src_base, dst_base, src_stride, dst_stride, block_bytes, coalesce, mode,
// src_any_order, stream, src_seg_base, src_seg_bytes, dst_seg_base, dst_seg_bytes), which the
// caller builds once; submitter is DmaSubmitter.address (the caller keeps the object alive).
static PyObject* submit_native(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 7 || !PyTuple_Check(args[6]) || PyTuple_GET_SIZE(args[6]) != 13)
    KVO_RAW_FAIL(PyExc_TypeError, "submit_native takes (submitter, record_stream, src_ids, dst_ids, n, wait_event, "
                 "fixed: a tuple of 13)", __FILE__, __LINE__);
  PyObject* const* f = &PyTuple_GET_ITEM(args[6], 0);
  const auto u = raw_u64;
  const auto i = raw_i64;
  auto* q = reinterpret_cast<kvo::DmaSubmitter*>((uintptr_t)u(args[0]));
  const auto record_stream = reinterpret_cast<cudaStream_t>((uintptr_t)u(args[1]));
  const auto src_ids = as_ptr<const int64_t>((uintptr_t)u(args[2]));
  const auto dst_ids = as_ptr<const int64_t>((uintptr_t)u(args[3]));
  const int64_t n = i(args[4]);
  const auto wait_event = reinterpret_cast<cudaEvent_t>((uintptr_t)u(args[5]));
  const uint64_t src_base = u(f[0]), dst_base = u(f[1]);
  const int64_t src_stride = i(f[2]), dst_stride = i(f[3]), block_bytes = i(f[4]);
  const int coalesce = PyObject_IsTrue(f[5]);
  const int mode = (int)i(f[6]);
  const int src_any_order = PyObject_IsTrue(f[7]);
  const auto stream = reinterpret_cast<cudaStream_t>((uintptr_t)u(f[8]));
  const kvo::Segments ss{u(f[9]), u(f[10])}, ds{u(f[11]), u(f[12])};
  if (PyErr_Occurred()) return nullptr;
  if (!q || !src_ids || !dst_ids || n <= 0)
    KVO_RAW_FAIL(PyExc_ValueError, "submit_native: null submitter or ids, or n = %lld <= 0", __FILE__, __LINE__, (long long)n);
  int64_t t = 0;
  cudaError_t e = cudaSuccess;
  std::string what;
  Py_BEGIN_ALLOW_THREADS
  try {
    e = q->record_and_submit(&t, record_stream, src_ids, dst_ids, n, src_base, dst_base, src_stride, dst_stride,
                             block_bytes, coalesce != 0, mode, src_any_order != 0, stream, wait_event, ss, ds);
  } catch (const std::exception& x) {  // a stopped submitter, a bad argument
    what = x.what();
  }
  Py_END_ALLOW_THREADS
  if (!what.empty()) KVO_RAW_FAIL(PyExc_RuntimeError, "submit_native: %s", __FILE__, __LINE__, what.c_str());
  if (e != cudaSuccess)
    KVO_RAW_FAIL(PyExc_RuntimeError, "DmaSubmitter.record_and_submit failed: %s: %s", __FILE__, __LINE__,
                 cudaGetErrorName(e), cudaGetErrorString(e));
  return PyLong_FromLongLong(t);
}

static PyMethodDef kRawMethods[] = {
    {"check_pair", (PyCFunction)(void (*)(void))check_pair, METH_FASTCALL,
     "check_pair(a, b, n_src, n_dst, b_is_src): int64_pair(a, b) and check_ids in one call: None unless a and b "
     "are 1-D C-contiguous int64 buffers of one length n > 0, else (n, address of a, address of b, code, index, "
     "value, runs_both, runs_src, runs_dst), checking (src, dst) = (a, b), or (b, a) when b_is_src. Positional "
     "arguments only (a raw METH_FASTCALL function: see bindings.cu)."},
    {"submit_native", (PyCFunction)(void (*)(void))submit_native, METH_FASTCALL,
     "submit_native(submitter, record_stream, src_ids, dst_ids, n, wait_event, fixed) -> ticket: "
     "DmaSubmitter.record_and_submit(record_stream, src_ids, dst_ids, n, *fixed[:9], wait_event, *fixed[9:]) "
     "with submitter = DmaSubmitter.address. Positional arguments only (a raw METH_FASTCALL function)."},
    {nullptr, nullptr, 0, nullptr}};

static std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t> check_and_stage_ids(
    uintptr_t src_ids, uintptr_t dst_ids, int64_t n, int64_t n_src, int64_t n_dst, uintptr_t out) {
  kvo::IdCheck r = kvo::check_and_stage_ids(as_ptr<const int64_t>(src_ids), as_ptr<const int64_t>(dst_ids), n,
                                            n_src, n_dst, as_ptr<int64_t>(out));
  return {r.code, r.index, r.value, r.runs_both, r.runs_src, r.runs_dst};
}

static std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t> check_and_stage_ids32(
    uintptr_t src_ids, uintptr_t dst_ids, int64_t n, int64_t n_src, int64_t n_dst, uintptr_t out) {
  if (n_src > kvo::kMaxId32 + 1 || n_dst > kvo::kMaxId32 + 1)
    throw std::invalid_argument("check_and_stage_ids32: block counts must fit in int32");
  kvo::IdCheck r = kvo::check_and_stage_ids32(as_ptr<const int64_t>(src_ids), as_ptr<const int64_t>(dst_ids), n,
                                              n_src, n_dst, as_ptr<int32_t>(out));
  return {r.code, r.index, r.value, r.runs_both, r.runs_src, r.runs_dst};
}

// The host id pass's thread pool (work_pool.h): enable < 0 / spin_us < 0 leave a setting as
// it is. Returns (helper threads, enabled, spin us, pieces run by helpers so far).
static std::tuple<int, bool, int, int64_t> host_threads(int enable, int spin_us) {
  kvo::WorkPool& p = kvo::WorkPool::instance();
  if (enable >= 0) p.set_enabled(enable != 0);
  if (spin_us >= 0) p.set_spin_us(spin_us);
  return {p.helpers(), p.enabled(), p.spin_us(), p.helper_pieces()};
}

static int64_t plan_dma(uintptr_t src_ids, uintptr_t dst_ids, int64_t n, uint64_t src_base,
                        uint64_t dst_base, int64_t src_stride, int64_t dst_stride,
                        int64_t block_bytes, bool coalesce, uintptr_t dsts, uintptr_t srcs,
                        uintptr_t sizes, uint64_t src_seg_base, uint64_t src_seg_bytes,
                        uint64_t dst_seg_base, uint64_t dst_seg_bytes) {
  return kvo::plan_dma(as_ptr<const int64_t>(src_ids), as_ptr<const int64_t>(dst_ids), n, src_base,
                       dst_base, src_stride, dst_stride, block_bytes, coalesce,
                       as_ptr<uint64_t>(dsts), as_ptr<uint64_t>(srcs), as_ptr<uint64_t>(sizes),
                       {src_seg_base, src_seg_bytes}, {dst_seg_base, dst_seg_bytes});
}


// Plans block descriptors (coalescing runs) and issues them.
static std::tuple<int, int64_t> dma_blocks(uintptr_t src_ids, uintptr_t dst_ids, int64_t n,
                                           uint64_t src_base, uint64_t dst_base,
                                           int64_t src_stride, int64_t dst_stride,
                                           int64_t block_bytes, bool coalesce, size_t max_per_call,
                                           int mode, bool src_any_order, uintptr_t stream,
                                           uint64_t src_seg_base, uint64_t src_seg_bytes,
                                           uint64_t dst_seg_base, uint64_t dst_seg_bytes,
                                           kvo::DmaLanes* lanes) {
  DescArrays& a = desc_arrays();
  a.reserve((size_t)n);
  const int64_t k = kvo::plan_dma(as_ptr<const int64_t>(src_ids), as_ptr<const int64_t>(dst_ids), n,
                                  src_base, dst_base, src_stride, dst_stride, block_bytes, coalesce,
                                  a.d.data(), a.sr.data(), a.sz.data(), {src_seg_base, src_seg_bytes},
                                  {dst_seg_base, dst_seg_bytes});
  return issue_planned(a, k, max_per_call, mode, src_any_order, stream, lanes);
}


// Plans one descriptor per (block, fragment) from the fragment table and issues them.
static std::tuple<int, int64_t> dma_fragments(uintptr_t table, int64_t num_frags, uint64_t unified,
                                              int64_t unified_stride, uintptr_t block_ids,
                                              uintptr_t slot_ids, int64_t n, bool to_unified,
                                              size_t max_per_call, int mode, bool src_any_order,
                                              uintptr_t stream, uint64_t seg_base,
                                              uint64_t seg_bytes, kvo::DmaLanes* lanes) {
  DescArrays& a = desc_arrays();
  a.reserve((size_t)(n * num_frags));
  const int64_t k = kvo::plan_fragments(as_ptr<const int64_t>(table), num_frags, unified,
                                        unified_stride, as_ptr<const int64_t>(block_ids),
                                        as_ptr<const int64_t>(slot_ids), n, to_unified, a.d.data(),
                                        a.sr.data(), a.sz.data(), {seg_base, seg_bytes});
  return issue_planned(a, k, max_per_call, mode, src_any_order, stream, lanes);
}

static int64_t plan_fragments(uintptr_t table, int64_t num_frags, uint64_t unified,
                              int64_t unified_stride, uintptr_t block_ids, uintptr_t slot_ids,
                              int64_t n, bool to_unified, uintptr_t dsts, uintptr_t srcs,
                              uintptr_t sizes) {
  return kvo::plan_fragments(as_ptr<const int64_t>(table), num_frags, unified, unified_stride,
                             as_ptr<const int64_t>(block_ids), as_ptr<const int64_t>(slot_ids), n,
                             to_unified, as_ptr<uint64_t>(dsts), as_ptr<uint64_t>(srcs),
                             as_ptr<uint64_t>(sizes));
}

// ---- host pool helpers (host code; cudaHostRegister needs a driver)
#include <thread>
// write=true: allocate private anonymous pages (a read would map the shared
// zero page); write=false: fault in pages of a shared mapping without
// touching contents another process may already have written.
static void prefault(uintptr_t ptr, size_t nbytes, int threads, bool write) {
  const size_t page = 4096;
  if (threads < 1) threads = 1;
  std::vector<std::thread> ts;
  const size_t per = ((nbytes / page + threads - 1) / threads) * page;
  for (int t = 0; t < threads; ++t) {
    const size_t a = t * per, b = std::min(nbytes, a + per);
    if (a >= b) break;
    ts.emplace_back([=] {
      volatile char* p = reinterpret_cast<volatile char*>(ptr);
      if (write) {
        for (size_t o = a; o < b; o += page) p[o] = 0;
      } else {
        char sink = 0;
        for (size_t o = a; o < b; o += page) sink ^= p[o];
        (void)sink;
      }
    });
  }
  for (auto& t : ts) t.join();
}

static int host_register(uintptr_t ptr, size_t nbytes) {
  cudaError_t e = cudaHostRegister(reinterpret_cast<void*>(ptr), nbytes, cudaHostRegisterPortable);
  if (e != cudaSuccess) (void)cudaGetLastError();
  return (int)e;
}

static int host_unregister(uintptr_t ptr) {
  cudaError_t e = cudaHostUnregister(reinterpret_cast<void*>(ptr));
  if (e != cudaSuccess) (void)cudaGetLastError();
  return (int)e;
}

// Reference measurement for the pool: seconds for cudaHostAlloc of nbytes
// (freed again afterwards).
static double time_cuda_host_alloc(size_t nbytes) {
  void* p = nullptr;
  auto t0 = std::chrono::steady_clock::now();
  KVO_CHECK(cudaHostAlloc(&p, nbytes, cudaHostAllocDefault));
  auto t1 = std::chrono::steady_clock::now();
  KVO_CHECK(cudaFreeHost(p));
  return std::chrono::duration<double>(t1 - t0).count();
}

// True while work queued on the stream has not finished (cudaStreamQuery, no wait): the
// transfer paths' "is the GPU computing" probe without building a torch Stream object.
// Queried with `device` current: handle 0 (the legacy default stream) means the current
// device's stream, and a TP rank's thread may have another device current.
static bool stream_busy(uintptr_t stream, int device) {
  int cur = -1;
  KVO_CHECK(cudaGetDevice(&cur));
  if (cur != device) KVO_CHECK(cudaSetDevice(device));
  const cudaError_t e = cudaStreamQuery(reinterpret_cast<cudaStream_t>(stream));
  if (cur != device) KVO_CHECK(cudaSetDevice(cur));
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not an error: clear it, as torch's Stream.query does
    return true;
  }
  KVO_CHECK(e);
  return false;
}

// The start of a transfer-worker job in one call, on `device`: `after` recorded on `compute`
// (unless record_after is false: the caller recorded it already), `stream` made to wait on it,
// and `start` (0: none) recorded on `stream`. Through torch that is a current_stream() and
// three wrapper calls, a large share of a 1000-block submit's host time
// (docs/design/native-submit.md).
static void job_begin(uintptr_t after, uintptr_t compute, bool record_after, uintptr_t stream, uintptr_t start,
                      int device) {
  int cur = -1;
  KVO_CHECK(cudaGetDevice(&cur));
  if (cur != device) KVO_CHECK(cudaSetDevice(device));  // handle 0 means this device's default stream
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  const auto a = reinterpret_cast<cudaEvent_t>(after);
  cudaError_t e = cudaSuccess;
  if (record_after) e = cudaEventRecord(a, reinterpret_cast<cudaStream_t>(compute));
  if (e == cudaSuccess) e = cudaStreamWaitEvent(s, a, 0);
  if (e == cudaSuccess && start) e = cudaEventRecord(reinterpret_cast<cudaEvent_t>(start), s);
  if (cur != device) KVO_CHECK(cudaSetDevice(cur));
  KVO_CHECK(e);
}

// cudaEventRecord(event, stream) on `device` (both handles as ints).
static void event_record(uintptr_t event, uintptr_t stream, int device) {
  int cur = -1;
  KVO_CHECK(cudaGetDevice(&cur));
  if (cur != device) KVO_CHECK(cudaSetDevice(device));
  const cudaError_t e = cudaEventRecord(reinterpret_cast<cudaEvent_t>(event), reinterpret_cast<cudaStream_t>(stream));
  if (cur != device) KVO_CHECK(cudaSetDevice(cur));
  KVO_CHECK(e);
}

static py::dict build_info() {
  py::dict d;
  d["cudart_version"] = CUDART_VERSION;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  // which clone of the id scan (host_plan.h) this CPU runs
  d["host_id_scan"] = __builtin_cpu_supports("avx512f") ? "avx512f"
                      : __builtin_cpu_supports("avx2") ? "avx2" : "baseline";
#else
  d["host_id_scan"] = "baseline";
#endif
#if CUDART_VERSION >= 12080
  d["has_memcpy_batch"] = true;
#else
  d["has_memcpy_batch"] = false;
#endif
  int driver = 0;
  cudaError_t e = cudaDriverGetVersion(&driver);
  d["driver_version"] = (e == cudaSuccess) ? driver : 0;
  int n = 0;
  e = cudaGetDeviceCount(&n);
  d["device_count"] = (e == cudaSuccess) ? n : 0;
  if (e != cudaSuccess) {
    d["device_error"] = std::string(cudaGetErrorName(e));
    (void)cudaGetLastError();
  }
  return d;
}

// pack_native(ring, block_ids, slot_ids, compute, skip_if_busy, num_ctas, after, start, end, fixed)
// -> (code, index, value, n): IndexRing::pack_job as a raw METH_FASTCALL function (see
// check_pair above), the ids read as int64_pair reads them and the arguments fixed per worker
// and direction in one tuple, fixed = (table, num_frags, unified, unified_stride, n_blocks,
// n_slots, max_frag_bytes, vec_bytes, to_unified, stream, device); ring is IndexRing.address
// (the caller keeps the object alive). Code
// PACK_NOT_ID_ARRAYS and nothing done unless the ids are 1-D C-contiguous int64 arrays of one
// length n in [1, capacity].
static PyObject* pack_native(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 10 || !PyTuple_Check(args[9]) || PyTuple_GET_SIZE(args[9]) != 11)
    KVO_RAW_FAIL(PyExc_TypeError, "pack_native takes (ring, block_ids, slot_ids, compute, skip_if_busy, num_ctas, "
                 "after, start, end, fixed: a tuple of 11)", __FILE__, __LINE__);
  PyObject* const* f = &PyTuple_GET_ITEM(args[9], 0);
  const auto u = raw_u64;
  const auto i = raw_i64;
  auto* ring = reinterpret_cast<IndexRing*>((uintptr_t)u(args[0]));
  const uintptr_t compute = (uintptr_t)u(args[3]);
  const int skip_if_busy = PyObject_IsTrue(args[4]);
  const int num_ctas = (int)i(args[5]);
  const uintptr_t after = (uintptr_t)u(args[6]), start = (uintptr_t)u(args[7]), end = (uintptr_t)u(args[8]);
  const uintptr_t table = (uintptr_t)u(f[0]);
  const int num_frags = (int)i(f[1]);
  const uintptr_t unified = (uintptr_t)u(f[2]);
  const int64_t unified_stride = i(f[3]), n_blocks = i(f[4]), n_slots = i(f[5]), max_frag_bytes = i(f[6]);
  const int vec_bytes = (int)i(f[7]);
  const int to_unified = PyObject_IsTrue(f[8]);
  const uintptr_t stream = (uintptr_t)u(f[9]);
  const int device = (int)i(f[10]);
  if (PyErr_Occurred()) return nullptr;
  if (!ring) KVO_RAW_FAIL(PyExc_ValueError, "pack_native: null ring", __FILE__, __LINE__);
  const Int64Pair p = read_int64_pair(args[1], args[2]);
  if (p.n <= 0 || p.n > ring->capacity()) return raw_tuple({kNotIdArrays, 0, 0, p.n});
  std::tuple<int, int64_t, int64_t> r{0, 0, 0};
  std::string what;
  Py_BEGIN_ALLOW_THREADS
  try {
    r = ring->pack_job(table, num_frags, unified, unified_stride, p.a, p.b, p.n, n_blocks, n_slots, max_frag_bytes,
                       vec_bytes, to_unified != 0, num_ctas, stream, compute, skip_if_busy != 0, after, start, end,
                       device);
  } catch (const std::exception& x) {  // KVO_CHECK's failed record or launch, a bad argument
    what = x.what();
  }
  Py_END_ALLOW_THREADS
  if (!what.empty()) KVO_RAW_FAIL(PyExc_RuntimeError, "pack_native: %s", __FILE__, __LINE__, what.c_str());
  return raw_tuple({std::get<0>(r), std::get<1>(r), std::get<2>(r), p.n});
}

// pack_submit_native(submitter, block_ids, slot_ids, compute, mode, num_ctas, after, fixed, staged)
// -> (code, index, value, n, ticket, is_staged): DmaSubmitter.record_and_submit_pack as a raw
// METH_FASTCALL function, with pack_native's `fixed` tuple (its `device` must be the
// submitter's; its unified side is the host's), mode PACK_DIRECT / PACK_AUTO / PACK_STAGED, and
// staged = None or (pipe index from add_staged, the host's segment base, segment bytes). The
// ids are read as pack_native reads them: PACK_NOT_ID_ARRAYS (ticket -1) and nothing done
// unless they are 1-D C-contiguous int64 arrays of one length n >= 1. A nonzero code queues
// nothing; a failed driver call or a bad argument raises (nothing queued either).
static PyObject* pack_submit_native(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 9 || !PyTuple_Check(args[7]) || PyTuple_GET_SIZE(args[7]) != 11 ||
      !(args[8] == Py_None || (PyTuple_Check(args[8]) && PyTuple_GET_SIZE(args[8]) == 3)))
    KVO_RAW_FAIL(PyExc_TypeError, "pack_submit_native takes (submitter, block_ids, slot_ids, compute, mode, "
                 "num_ctas, after, fixed: a tuple of 11, staged: None or a tuple of 3)", __FILE__, __LINE__);
  PyObject* const* f = &PyTuple_GET_ITEM(args[7], 0);
  const auto u = raw_u64;
  const auto i = raw_i64;
  auto* q = reinterpret_cast<kvo::DmaSubmitter*>((uintptr_t)u(args[0]));
  const auto compute = reinterpret_cast<cudaStream_t>((uintptr_t)u(args[3]));
  const int mode = (int)i(args[4]);
  kvo::PackSpec p;
  p.num_ctas = (int)i(args[5]);
  const auto after = reinterpret_cast<cudaEvent_t>((uintptr_t)u(args[6]));
  p.table = as_ptr<const int64_t>((uintptr_t)u(f[0]));
  p.num_frags = (int)i(f[1]);
  p.unified = as_ptr<char>((uintptr_t)u(f[2]));
  p.unified_stride = i(f[3]);
  p.n_blocks = i(f[4]);
  p.n_slots = i(f[5]);
  p.max_frag_bytes = i(f[6]);
  p.vec_bytes = (int)i(f[7]);
  p.to_unified = PyObject_IsTrue(f[8]) != 0;
  const auto stream = reinterpret_cast<cudaStream_t>((uintptr_t)u(f[9]));
  const int device = (int)i(f[10]);
  int pipe = -1;
  kvo::Segments seg{};
  if (args[8] != Py_None) {
    PyObject* const* g = &PyTuple_GET_ITEM(args[8], 0);
    pipe = (int)i(g[0]);
    seg = {u(g[1]), u(g[2])};
  }
  if (PyErr_Occurred()) return nullptr;
  if (!q) KVO_RAW_FAIL(PyExc_ValueError, "pack_submit_native: null submitter", __FILE__, __LINE__);
  if (device != q->device())
    KVO_RAW_FAIL(PyExc_ValueError, "pack_submit_native: job on device %d, submitter on device %d", __FILE__, __LINE__,
                 device, q->device());
  if (mode < kvo::kPackDirect || mode > kvo::kPackStaged || (mode == kvo::kPackStaged && pipe < 0))
    KVO_RAW_FAIL(PyExc_ValueError, "pack_submit_native: mode %d (PACK_STAGED needs a staged pipe)", __FILE__, __LINE__,
                 mode);
  const Int64Pair ids = read_int64_pair(args[1], args[2]);
  if (ids.n <= 0) return raw_tuple({kNotIdArrays, 0, 0, ids.n, -1, 0});
  int64_t t = -1;
  cudaError_t e = cudaSuccess;
  bool staged = false;
  kvo::IdCheck c;
  std::string what;
  Py_BEGIN_ALLOW_THREADS
  try {
    c = q->record_and_submit_pack(&t, &e, compute, mode, as_ptr<const int64_t>(ids.a), as_ptr<const int64_t>(ids.b),
                                  ids.n, p, stream, after, pipe, seg, &staged);
  } catch (const std::exception& x) {  // a stopped submitter
    what = x.what();
  }
  Py_END_ALLOW_THREADS
  if (!what.empty()) KVO_RAW_FAIL(PyExc_RuntimeError, "pack_submit_native: %s", __FILE__, __LINE__, what.c_str());
  if (e != cudaSuccess)
    KVO_RAW_FAIL(PyExc_RuntimeError, "DmaSubmitter.record_and_submit_pack failed: %s: %s", __FILE__, __LINE__,
                 cudaGetErrorName(e), cudaGetErrorString(e));
  return raw_tuple({c.code, c.code ? c.index : 0, c.code ? c.value : 0, ids.n, c.code ? -1 : t, staged ? 1 : 0});
}

static PyMethodDef kRawPackMethods[] = {
    {"pack_submit_native", (PyCFunction)(void (*)(void))pack_submit_native, METH_FASTCALL,
     "pack_submit_native(submitter, block_ids, slot_ids, compute, mode, num_ctas, after, fixed, staged) -> "
     "(code, index, value, n, ticket, is_staged): a worker's per-layer pack/unpack job through the "
     "DmaSubmitter's thread (ids read, checked and staged in the job's pinned buffer, the compute event "
     "recorded, then queued; the thread uploads the ids and launches the pack kernel, or runs the staged "
     "pipeline), with pack_native's fixed tuple, mode PACK_DIRECT / PACK_AUTO / PACK_STAGED, staged = None or "
     "(pipe, host segment base, segment bytes), submitter = DmaSubmitter.address. Code 6 and nothing done if "
     "mode is PACK_AUTO, compute is running and there is no pipe; PACK_NOT_ID_ARRAYS unless the ids are 1-D "
     "C-contiguous int64 arrays of one length; the ticket is -1 unless the code is 0. Positional arguments "
     "only (a raw METH_FASTCALL function)."},
    {"pack_native", (PyCFunction)(void (*)(void))pack_native, METH_FASTCALL,
     "pack_native(ring, block_ids, slot_ids, compute, skip_if_busy, num_ctas, after, start, end, fixed) -> "
     "(code, index, value, n): a worker's per-layer pack/unpack job from the compute event to the end event "
     "(ids read, checked and staged, compute event recorded, stream wait, timing events, pack kernel), with "
     "fixed = (table, num_frags, unified, unified_stride, n_blocks, n_slots, max_frag_bytes, vec_bytes, "
     "to_unified, stream, device) and ring = IndexRing.address; (6, 0, 0, n) and nothing done if skip_if_busy "
     "and compute is running; PACK_NOT_ID_ARRAYS unless the ids are 1-D C-contiguous int64 arrays of one length "
     "n in [1, capacity]. Positional arguments only (a raw METH_FASTCALL function)."},
    {nullptr, nullptr, 0, nullptr}};

// DmaSubmitter's pack jobs: kvo::launch_pack_layers with a job's spec and device ids.
static cudaError_t launch_pack_job(const kvo::PackSpec& p, const int64_t* block_ids, const int64_t* slot_ids,
                                   int64_t n, cudaStream_t stream) {
  return kvo::launch_pack_layers(p.table, p.num_frags, p.unified, block_ids, slot_ids, n, p.max_frag_bytes,
                                 p.unified_stride, p.vec_bytes, p.to_unified, p.num_ctas, stream);
}

// Test-only fault injection (fault.h), by site name.
static kvo::fault::Site fault_site(const std::string& name) {
  const int i = kvo::fault::site_of(name.c_str());
  if (i < 0)
    throw std::invalid_argument("fault site must be one of memcpy_batch, memcpy_async, kernel_launch; got '" +
                                name + "'");
  return (kvo::fault::Site)i;
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "kvoffload CUDA kernels and DMA batcher (raw pointers, no libtorch).";
  auto nogil = py::call_guard<py::gil_scoped_release>();
  py::class_<kvo::DmaLanes>(m, "DmaLanes",
                            "Copy-engine lanes: one DMA job spread over up to `lanes` streams (see dma_batch.cuh).")
      .def(py::init([](int lanes, size_t min_lane_bytes, size_t min_desc_bytes) {
             if (lanes < 1 || lanes > kvo::kMaxDmaLanes)
               throw std::invalid_argument(std::string(__FILE__) + ":" + std::to_string(__LINE__) +
                                           ": DmaLanes: lanes must be in [1, " +
                                           std::to_string(kvo::kMaxDmaLanes) + "], got " + std::to_string(lanes));
             return new kvo::DmaLanes(lanes, min_lane_bytes, min_desc_bytes);
           }),
           py::arg("lanes"), py::arg("min_lane_bytes"), py::arg("min_desc_bytes") = 64 << 10)
      .def_property_readonly("lanes", &kvo::DmaLanes::lanes)
      .def_property_readonly("min_lane_bytes", &kvo::DmaLanes::min_lane_bytes)
      .def_property_readonly("min_desc_bytes", &kvo::DmaLanes::min_desc_bytes)
      .def("lanes_for", &kvo::DmaLanes::lanes_for, py::arg("count"), py::arg("bytes"),
           "How many lanes a job of `count` descriptors and `bytes` bytes uses.");
  m.attr("MAX_DMA_LANES") = int(kvo::kMaxDmaLanes);
  m.def("copy_blocks", &copy_blocks, py::arg("src"), py::arg("dst"), py::arg("src_ids"),
        py::arg("dst_ids"), py::arg("n_pairs"), py::arg("block_bytes"), py::arg("src_stride"),
        py::arg("dst_stride"), py::arg("src_offset"), py::arg("dst_offset"), py::arg("vec_bytes"),
        py::arg("num_ctas"), py::arg("stream"), py::arg("variant") = 0, nogil,
        "SM copy of n_pairs blocks (device/pinned pointers as ints). variant 0: warp chunks, "
        "1: one CTA per block, 2: bulk (TMA) copies through shared memory, sm_90+ and 16-byte aligned only.");
  m.def("dma_batch", &dma_batch, py::arg("dsts"), py::arg("srcs"), py::arg("sizes"),
        py::arg("count"), py::arg("max_per_call"), py::arg("mode"), py::arg("src_any_order"),
        py::arg("stream"), nogil,
        "Issue host descriptor arrays through cudaMemcpyBatchAsync (or a loop). Returns 1 if the "
        "batch API was used.");
  m.def("pack_layers", &pack_layers, py::arg("table"), py::arg("num_frags"), py::arg("unified"),
        py::arg("block_ids"), py::arg("slot_ids"), py::arg("n_blocks"), py::arg("max_frag_bytes"),
        py::arg("unified_block_stride"), py::arg("vec_bytes"), py::arg("to_unified"),
        py::arg("num_ctas"), py::arg("stream"), nogil,
        "Gather per-layer fragments into unified blocks (to_unified) or scatter them back.");
  m.def("stream_busy", &stream_busy, py::arg("stream"), py::arg("device"), nogil,
        "Whether work queued on the stream (a cudaStream_t as int, of the given device) is still "
        "running; never waits.");
  m.def("job_begin", &job_begin, py::arg("after"), py::arg("compute"), py::arg("record_after"), py::arg("stream"),
        py::arg("start"), py::arg("device"), nogil,
        "Record `after` on `compute` (if record_after), make `stream` wait on it, record `start` (0: none) "
        "on `stream`; cudaEvent_t / cudaStream_t handles as ints.");
  m.def("event_record", &event_record, py::arg("event"), py::arg("stream"), py::arg("device"), nogil,
        "cudaEventRecord(event, stream) on `device`; handles as ints.");
  m.def("int64_pair", &int64_pair,
        "(a, b) -> (n, address of a, address of b) for two 1-D C-contiguous int64 buffers of one length "
        "n (numpy id arrays), else None. Positional arguments only.");
  if (PyModule_AddFunctions(m.ptr(), kRawMethods) != 0 || PyModule_AddFunctions(m.ptr(), kRawPackMethods) != 0)
    throw py::error_already_set();
  m.def("check_ids", &check_ids, py::arg("src_ids"), py::arg("dst_ids"), py::arg("n"),
        py::arg("n_src"), py::arg("n_dst"), nogil,
        "Validate host int64 id arrays: (code, index, value, runs_both, runs_src, runs_dst).");
  m.def("check_and_stage_ids", &check_and_stage_ids, py::arg("src_ids"), py::arg("dst_ids"), py::arg("n"),
        py::arg("n_src"), py::arg("n_dst"), py::arg("out"), nogil,
        "check_ids, then (valid ids only) src ids to out[0, n) and dst ids to out[n, 2n) "
        "(what IndexRing.stage_checked runs on its pinned slot).");
  m.def("check_and_stage_ids32", &check_and_stage_ids32, py::arg("src_ids"), py::arg("dst_ids"), py::arg("n"),
        py::arg("n_src"), py::arg("n_dst"), py::arg("out"), nogil,
        "check_ids' (code, index, value, runs_both, runs_src, runs_dst) with the ids narrowed to int32 "
        "into out[0, 2n) in the same pass "
        "(what IndexRing.copy_blocks stages); needs n_src, n_dst <= 2**31; out is garbage on an error.");
  m.def("host_threads", &host_threads, py::arg("enable") = -1, py::arg("spin_us") = -1,
        "The thread pool that splits the id pass of jobs of >= 8192 pairs: switch it on (1) or off (0), set how "
        "long idle helpers spin before sleeping; -1 keeps a setting. Returns (helpers, enabled, spin_us, "
        "pieces run by helpers so far). Helper count: KVO_HOST_THREADS at first use (default min(3, cores - 1)).");
  m.def("plan_dma", &plan_dma, py::arg("src_ids"), py::arg("dst_ids"), py::arg("n"),
        py::arg("src_base"), py::arg("dst_base"), py::arg("src_stride"), py::arg("dst_stride"),
        py::arg("block_bytes"), py::arg("coalesce"), py::arg("dsts"), py::arg("srcs"),
        py::arg("sizes"), py::arg("src_seg_base") = 0, py::arg("src_seg_bytes") = 0,
        py::arg("dst_seg_base") = 0, py::arg("dst_seg_bytes") = 0, nogil,
        "Fill uint64 descriptor arrays; returns the descriptor count. Runs never cross a segment "
        "boundary (seg_bytes 0: no segments).");
  m.def("dma_blocks", &dma_blocks, py::arg("src_ids"), py::arg("dst_ids"), py::arg("n"),
        py::arg("src_base"), py::arg("dst_base"), py::arg("src_stride"), py::arg("dst_stride"),
        py::arg("block_bytes"), py::arg("coalesce"), py::arg("max_per_call"), py::arg("mode"),
        py::arg("src_any_order"), py::arg("stream"), py::arg("src_seg_base") = 0,
        py::arg("src_seg_bytes") = 0, py::arg("dst_seg_base") = 0, py::arg("dst_seg_bytes") = 0,
        py::arg("lanes") = nullptr, nogil,
        "Plan and issue block copies on the copy engines (over `lanes`, a DmaLanes, if given); "
        "returns (used_batch, descriptors).");
  py::class_<IndexRing>(m, "IndexRing")
      .def(py::init<uintptr_t, uintptr_t, int, int64_t, bool>(), py::arg("host"), py::arg("dev"),
           py::arg("slots"), py::arg("capacity"), py::arg("uva") = false)
      .def_property_readonly("capacity", &IndexRing::capacity)
      .def_property_readonly("uva", &IndexRing::uva)
      .def("stage", &IndexRing::stage, py::arg("src_ids"), py::arg("dst_ids"), py::arg("n"),
           py::arg("stream"), nogil)
      .def("stage_checked", &IndexRing::stage_checked, py::arg("src_ids"), py::arg("dst_ids"),
           py::arg("n"), py::arg("n_src"), py::arg("n_dst"), py::arg("stream"), py::arg("ids_uva") = false, nogil,
           "check_ids + stage in one call: (code, index, value, -1, 0, 0) on bad ids, else "
           "(0, runs_both, runs_src, slot, device src ids, device dst ids).")
      .def("copy_blocks", &IndexRing::copy_blocks, py::arg("src"), py::arg("dst"), py::arg("src_ids"),
           py::arg("dst_ids"), py::arg("n"), py::arg("n_src"), py::arg("n_dst"), py::arg("block_bytes"),
           py::arg("src_stride"), py::arg("dst_stride"), py::arg("vec_bytes"), py::arg("num_ctas"),
           py::arg("stream"), py::arg("variant"), py::arg("max_runs_both") = -1, py::arg("max_runs_host") = -1,
           py::arg("host_is_src") = false, py::arg("ids_uva") = false, nogil,
           "Validate, stage and launch an SM block copy in one call (host int64 ids, n <= capacity); "
           "returns check_ids' (code, index, value), nothing queued unless code is 0. With run limits "
           "(auto): (6, runs_both, runs_host) and nothing queued when the ids coalesce within a limit. "
           "ids_uva: the kernel reads the ids from the pinned slot (no upload) even on a ring that uploads.")
      .def("stage_checked32", &IndexRing::stage_checked32, py::arg("src_ids"), py::arg("dst_ids"),
           py::arg("n"), py::arg("n_src"), py::arg("n_dst"), py::arg("stream"), nogil,
           "stage_checked with int32 ids (n_src, n_dst <= 2**31, 1 <= n <= capacity): (code, index, value, -1, 0, 0) "
           "on bad ids, else (0, runs_both, runs_src, slot, device src ids, device dst ids); release(slot) after the launch.")
      .def("copy_blocks_fn", &IndexRing::copy_blocks_fn, py::arg("function"), py::arg("threads"), py::arg("shared"),
           py::arg("kinds"), py::arg("scratch"), py::arg("num_programs"), py::arg("chunks"), py::arg("src"),
           py::arg("dst"), py::arg("src_ids"), py::arg("dst_ids"), py::arg("n"), py::arg("n_src"), py::arg("n_dst"),
           py::arg("elems_per_block"), py::arg("src_stride"), py::arg("dst_stride"), py::arg("src_offset"),
           py::arg("dst_offset"), py::arg("stream"), nogil,
           "Validate, stage (int32) and launch a compiled Triton block-copy kernel (a CUfunction as an int; "
           "kvo::FnSpec's threads, shared, kinds, scratch) in one call; returns check_ids' (code, index, value), "
           "nothing queued unless code is 0.")
      .def("pack_job", &IndexRing::pack_job, nogil,
           "(table, num_frags, unified, unified_stride, block_ids, slot_ids, n, n_blocks, n_slots, "
           "max_frag_bytes, vec_bytes, to_unified, num_ctas, stream, compute, skip_if_busy, after, start, end, "
           "device) -> check_ids' (code, index, value): a worker's per-layer pack/unpack job, from the compute "
           "event to the end event, in one call; (6, 0, 0) and nothing done if skip_if_busy and compute is "
           "running. Positional arguments only (pybind11's keyword matching costs microseconds).")
      .def_property_readonly(
          "address", [](IndexRing& r) { return reinterpret_cast<uintptr_t>(&r); },
          "This ring's address, for _C.pack_native (valid while the object lives).")
      .def("release", &IndexRing::release, py::arg("slot"), py::arg("stream"), nogil);
  m.attr("PACK_NOT_ID_ARRAYS") = kNotIdArrays;
  m.def("dma_fragments", &dma_fragments, py::arg("table"), py::arg("num_frags"),
        py::arg("unified"), py::arg("unified_stride"), py::arg("block_ids"), py::arg("slot_ids"),
        py::arg("n"), py::arg("to_unified"), py::arg("max_per_call"), py::arg("mode"),
        py::arg("src_any_order"), py::arg("stream"), py::arg("seg_base") = 0,
        py::arg("seg_bytes") = 0, py::arg("lanes") = nullptr, nogil,
        "Move fragments <-> unified blocks on the copy engines; returns (used_batch, descriptors).");
  m.def("plan_fragments", &plan_fragments, py::arg("table"), py::arg("num_frags"),
        py::arg("unified"), py::arg("unified_stride"), py::arg("block_ids"), py::arg("slot_ids"),
        py::arg("n"), py::arg("to_unified"), py::arg("dsts"), py::arg("srcs"), py::arg("sizes"),
        nogil, "Fill fragment descriptor arrays (host int64 table [4][F]); returns the count.");
  m.def("prefault", &prefault, py::arg("ptr"), py::arg("nbytes"), py::arg("threads"),
        py::arg("write") = true, nogil,
        "Touch every 4 KiB page of [ptr, ptr+nbytes) from `threads` threads (write or read).");
  m.def("host_register", &host_register, py::arg("ptr"), py::arg("nbytes"), nogil,
        "cudaHostRegister (portable); returns the cudaError_t code (0 = success).");
  m.def("host_unregister", &host_unregister, py::arg("ptr"), nogil);
  m.def("time_cuda_host_alloc", &time_cuda_host_alloc, py::arg("nbytes"), nogil,
        "Seconds cudaHostAlloc takes for nbytes (reference for the host pool).");
  m.def("build_info", &build_info);
  m.def(
      "inject_fault",
      [](const std::string& site, int64_t after, int error, int64_t times) {
        if (error == 0) throw std::invalid_argument("inject_fault: error must be a nonzero cudaError_t code");
        kvo::fault::arm(fault_site(site), after, (cudaError_t)error, times);
      },
      py::arg("site"), py::arg("after") = 0, py::arg("error") = 999, py::arg("times") = 1,
      "TEST ONLY (kernels/csrc/fault.h): the next `after` driver calls at `site` (memcpy_batch, memcpy_async, "
      "kernel_launch) go through, then `times` of them (< 0: all) return cudaError_t `error` without being made.");
  m.def("clear_faults", &kvo::fault::disarm_all, "Disarms every fault site.");
  m.def(
      "fault_counts",
      [](const std::string& site) {
        const kvo::fault::Counts c = kvo::fault::counts(fault_site(site));
        return std::make_tuple(c.calls, c.hits, c.armed);
      },
      py::arg("site"), "(calls seen while armed, failures injected, still armed) since `site` was last armed.");
  py::class_<kvo::DmaSubmitter>(m, "DmaSubmitter",
                                "Native submit thread for DMA jobs (see dma_submitter.h).")
      .def(py::init([](int device, size_t max_per_call, kvo::DmaLanes* lanes) {
             return new kvo::DmaSubmitter(device, max_per_call, lanes, &launch_pack_job);
           }),
           py::arg("device"), py::arg("max_per_call"), py::arg("lanes") = nullptr, py::keep_alive<1, 4>())
      .def("submit_blocks",
           [](kvo::DmaSubmitter& q, uintptr_t src_ids, uintptr_t dst_ids, int64_t n, uint64_t src_base,
              uint64_t dst_base, int64_t src_stride, int64_t dst_stride, int64_t block_bytes, bool coalesce,
              int mode, bool src_any_order, uintptr_t stream, uintptr_t wait_event, uint64_t src_seg_base,
              uint64_t src_seg_bytes, uint64_t dst_seg_base, uint64_t dst_seg_bytes) {
             return q.submit_blocks(as_ptr<const int64_t>(src_ids), as_ptr<const int64_t>(dst_ids), n,
                                    src_base, dst_base, src_stride, dst_stride, block_bytes, coalesce, mode,
                                    src_any_order, reinterpret_cast<cudaStream_t>(stream),
                                    reinterpret_cast<cudaEvent_t>(wait_event), {src_seg_base, src_seg_bytes},
                                    {dst_seg_base, dst_seg_bytes});
           },
           py::arg("src_ids"), py::arg("dst_ids"), py::arg("n"), py::arg("src_base"), py::arg("dst_base"),
           py::arg("src_stride"), py::arg("dst_stride"), py::arg("block_bytes"), py::arg("coalesce"),
           py::arg("mode"), py::arg("src_any_order"), py::arg("stream"), py::arg("wait_event"),
           py::arg("src_seg_base"), py::arg("src_seg_bytes"), py::arg("dst_seg_base"),
           py::arg("dst_seg_bytes"), nogil)
      .def_property_readonly(
          "address", [](kvo::DmaSubmitter& q) { return reinterpret_cast<uintptr_t>(&q); },
          "This submitter's address, for _C.submit_native (valid while the object lives).")
      .def("hold", &kvo::DmaSubmitter::hold,
           "Before the caller's own driver calls: the submit thread pauses at its next slice boundary.")
      .def("release_hold", &kvo::DmaSubmitter::release_hold, "Ends a hold().")
      .def_property_readonly("holders", &kvo::DmaSubmitter::holders)
      .def("query", &kvo::DmaSubmitter::query, py::arg("ticket"))
      .def("wait_issued", &kvo::DmaSubmitter::wait_issued, py::arg("ticket"), nogil)
      .def("fence",
           [](kvo::DmaSubmitter& q, int64_t t, uintptr_t stream) {
             KVO_CHECK(q.fence(t, reinterpret_cast<cudaStream_t>(stream)));
           },
           py::arg("ticket"), py::arg("stream"), nogil)
      .def("synchronize", [](kvo::DmaSubmitter& q, int64_t t) { KVO_CHECK(q.synchronize(t)); },
           py::arg("ticket"), nogil)
      .def("elapsed_ms", &kvo::DmaSubmitter::elapsed_ms, py::arg("ticket"))
      .def("error", &kvo::DmaSubmitter::error, py::arg("ticket"))
      .def("descriptors", &kvo::DmaSubmitter::descriptors, py::arg("ticket"))
      .def("release", &kvo::DmaSubmitter::release, py::arg("ticket"), nogil)
      .def("last_split", &kvo::DmaSubmitter::last_split,
           "(record_us, plan_us, queue_us) of the caller's last submit: the event record with the gate held "
           "(0 for submit_blocks), the descriptor plan, the queueing.")
      .def("in_flight", &kvo::DmaSubmitter::in_flight)
      .def("add_staged", &kvo::DmaSubmitter::add_staged, py::arg("ub"), py::arg("staging_bytes"),
           py::arg("chunk_bytes"), py::arg("vec_bytes"), py::arg("min_ctas"), py::arg("dma_mode"),
           "A staged pipeline for pack jobs (pack_submit_native's `staged`): returns its index. Its GPU staging "
           "(staging_bytes, two halves) is allocated on the submit thread at its first job.")
      .def("staged_shape", &kvo::DmaSubmitter::staged_shape, py::arg("pipe"),
           "(blocks per chunk, bytes per half) of a staged pipeline.")
      .def("stop", &kvo::DmaSubmitter::stop, nogil);
  m.attr("PACK_DIRECT") = int(kvo::kPackDirect);
  m.attr("PACK_AUTO") = int(kvo::kPackAuto);
  m.attr("PACK_STAGED") = int(kvo::kPackStaged);
  m.attr("DMA_BATCH") = int(kvo::kDmaBatch);
  m.attr("DMA_LOOP") = int(kvo::kDmaLoop);
  m.attr("DMA_BATCH_NO_HINT") = int(kvo::kDmaBatchNoHint);
}
