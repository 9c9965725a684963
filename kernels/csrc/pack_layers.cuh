// Pack/unpack between per-layer paged KV tensors and unified cross-layer
// blocks. One launch moves every fragment of N blocks.
//
// A "fragment" is one contiguous byte range of one block inside one per-layer
// tensor (e.g. layer l's K for block b). The fragment table, built once at
// registration and kept on the device, is int64[4][F]:
//   row 0: base address of the fragment's tensor (+ its K/V offset)
//   row 1: byte stride between consecutive blocks in that tensor
//   row 2: fragment bytes
//   row 3: byte offset of the fragment inside a unified block
// The unified side (pinned host through UVA, or a GPU staging buffer) holds
// block slot s at unified + s * unified_block_stride.
#pragma once
#include "copy_blocks.cuh"

namespace kvo {

template <typename V>
__global__ void __launch_bounds__(kCopyThreads)
pack_layers_kernel(const int64_t* __restrict__ table, int num_frags, char* __restrict__ unified,
                   const int64_t* __restrict__ block_ids, const int64_t* __restrict__ slot_ids,
                   int64_t n_blocks, int64_t chunks_per_frag, int64_t unified_block_stride,
                   bool to_unified) {
  constexpr int64_t kChunk = 32 * kCopyUnroll;
  const int64_t per_block = (int64_t)num_frags * chunks_per_frag;
  const int64_t total = n_blocks * per_block;
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t)gridDim.x * (kCopyThreads / 32);
  for (int64_t w = (int64_t)blockIdx.x * (kCopyThreads / 32) + (threadIdx.x >> 5); w < total; w += warps) {
    const int64_t blk = w / per_block;
    const int64_t r = w - blk * per_block;
    const int f = (int)(r / chunks_per_frag);
    const int64_t c = r - (int64_t)f * chunks_per_frag;
    const int64_t nvec = table[2 * num_frags + f] / (int64_t)sizeof(V);
    const int64_t base = c * kChunk + lane;
    if (base >= nvec) continue;  // shorter fragment (e.g. V head dim < K head dim)
    V* layer = reinterpret_cast<V*>(table[f] + block_ids[blk] * table[num_frags + f]);
    V* uni = reinterpret_cast<V*>(unified + slot_ids[blk] * unified_block_stride +
                                  table[3 * num_frags + f]);
    const V* s = to_unified ? layer : uni;
    V* d = to_unified ? uni : layer;
    V v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = base + u * 32;
      if (i < nvec) v[u] = ld_stream(s + i);
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = base + u * 32;
      if (i < nvec) st_stream(d + i, v[u]);
    }
  }
}

// table: device int64[4][num_frags]; block_ids/slot_ids: device int64[n_blocks].
// vec_bytes must divide every fragment's size, address, block stride and
// unified offset, and unified_block_stride and the unified base address.
inline cudaError_t launch_pack_layers(const int64_t* table, int num_frags, char* unified,
                                      const int64_t* block_ids, const int64_t* slot_ids,
                                      int64_t n_blocks, int64_t max_frag_bytes,
                                      int64_t unified_block_stride, int vec_bytes, bool to_unified,
                                      int num_ctas, cudaStream_t stream) {
  if (n_blocks <= 0 || num_frags <= 0 || max_frag_bytes <= 0) return cudaSuccess;
  if (num_ctas <= 0) return cudaErrorInvalidValue;
  KVO_RETURN_IF_ERROR(fault::check(fault::Site::kKernelLaunch));  // test-only hook (fault.h)
  const int64_t kChunk = 32 * kCopyUnroll;
  const int64_t cpf = (max_frag_bytes / vec_bytes + kChunk - 1) / kChunk;
  const int64_t chunks = n_blocks * num_frags * cpf;
  const int64_t needed = (chunks + (kCopyThreads / 32) - 1) / (kCopyThreads / 32);
  const int grid = (int)(needed < num_ctas ? needed : num_ctas);
  return dispatch_vec(vec_bytes, [&](auto v) {
    pack_layers_kernel<decltype(v)><<<grid, kCopyThreads, 0, stream>>>(table, num_frags, unified,
        block_ids, slot_ids, n_blocks, cpf, unified_block_stride, to_unified);
  });
}

}  // namespace kvo
