// Thin pybind11 bindings. Python validates everything and passes raw
// pointers, sizes and the stream as integers; no libtorch is linked.
#include <pybind11/pybind11.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "copy_blocks.cuh"
#include "dma_batch.cuh"
#include "pack_layers.cuh"

namespace py = pybind11;

#define KVO_CHECK(expr)                                                                     \
  do {                                                                                      \
    cudaError_t kvo_err_ = (expr);                                                          \
    if (kvo_err_ != cudaSuccess)                                                            \
      throw std::runtime_error(std::string(__FILE__) + ":" + std::to_string(__LINE__) +     \
                               ": " #expr " failed: " + cudaGetErrorName(kvo_err_) + ": " + \
                               cudaGetErrorString(kvo_err_));                               \
  } while (0)

template <typename T> static T* as_ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

static void copy_blocks(uintptr_t src, uintptr_t dst, uintptr_t src_ids, uintptr_t dst_ids,
                        int64_t n_pairs, int64_t block_bytes, int64_t src_stride,
                        int64_t dst_stride, int64_t src_offset, int64_t dst_offset, int vec_bytes,
                        int num_ctas, uintptr_t stream) {
  KVO_CHECK(kvo::launch_copy_blocks(as_ptr<const void>(src), as_ptr<void>(dst),
                                    as_ptr<const int64_t>(src_ids), as_ptr<const int64_t>(dst_ids),
                                    n_pairs, block_bytes, src_stride, dst_stride, src_offset,
                                    dst_offset, vec_bytes, num_ctas,
                                    reinterpret_cast<cudaStream_t>(stream)));
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

static py::dict build_info() {
  py::dict d;
  d["cudart_version"] = CUDART_VERSION;
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

PYBIND11_MODULE(_C, m) {
  m.doc() = "kvoffload CUDA kernels and DMA batcher (raw pointers, no libtorch).";
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("copy_blocks", &copy_blocks, py::arg("src"), py::arg("dst"), py::arg("src_ids"),
        py::arg("dst_ids"), py::arg("n_pairs"), py::arg("block_bytes"), py::arg("src_stride"),
        py::arg("dst_stride"), py::arg("src_offset"), py::arg("dst_offset"), py::arg("vec_bytes"),
        py::arg("num_ctas"), py::arg("stream"), nogil,
        "SM copy of n_pairs blocks (device/pinned pointers as ints).");
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
  m.def("build_info", &build_info);
  m.attr("DMA_BATCH") = int(kvo::kDmaBatch);
  m.attr("DMA_LOOP") = int(kvo::kDmaLoop);
}
