// SM copy kernel for (src block, dst block) pairs. Framework-free: raw
// pointers, byte sizes and a cudaStream_t in, cudaError_t out.
//
// Either side may be device memory or pinned host memory reached through UVA
// (zero-copy), so one kernel body serves D2H, H2D and D2D.
#pragma once
#include "common.cuh"

namespace kvo {

// Streaming (evict-first) hints: every byte is touched exactly once, so keep
// it from displacing the model's working set in L2.
template <typename V> __device__ __forceinline__ V ld_stream(const V* p) { return __ldcs(p); }
template <typename V> __device__ __forceinline__ void st_stream(V* p, V v) { __stcs(p, v); }

constexpr int kCopyThreads = 512;  // 16 warps per CTA
constexpr int kCopyUnroll = 4;     // independent loads in flight per thread

// Work is split into warp-sized chunks of 32 * kCopyUnroll vectors
// (2 KiB with 16-byte vectors). A warp takes a chunk, issues all its loads,
// then all its stores. Chunks never straddle a block, so the block lookup
// (one 64-bit division) is paid once per chunk rather than per vector.
template <typename V, typename Id>
__global__ void __launch_bounds__(kCopyThreads)
copy_blocks_kernel(const char* __restrict__ src, char* __restrict__ dst,
                   const Id* __restrict__ src_ids, const Id* __restrict__ dst_ids,
                   int64_t n_pairs, int64_t src_stride, int64_t dst_stride,
                   int64_t src_offset, int64_t dst_offset, int64_t vecs_per_block) {
  constexpr int64_t kChunk = 32 * kCopyUnroll;
  const int64_t chunks_per_block = (vecs_per_block + kChunk - 1) / kChunk;
  const int64_t total = n_pairs * chunks_per_block;
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t)gridDim.x * (kCopyThreads / 32);
  for (int64_t w = (int64_t)blockIdx.x * (kCopyThreads / 32) + (threadIdx.x >> 5); w < total; w += warps) {
    const int64_t pair = w / chunks_per_block;
    const int64_t c = w - pair * chunks_per_block;
    const V* s = reinterpret_cast<const V*>(src + (int64_t)src_ids[pair] * src_stride + src_offset);
    V* d = reinterpret_cast<V*>(dst + (int64_t)dst_ids[pair] * dst_stride + dst_offset);
    const int64_t base = c * kChunk + lane;
    V v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = base + u * 32;
      if (i < vecs_per_block) v[u] = ld_stream(s + i);
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = base + u * 32;
      if (i < vecs_per_block) st_stream(d + i, v[u]);
    }
  }
}

// Variant: one CTA walks a whole block at a time (all 512 threads stream
// through it, kCopyUnroll vectors per thread in flight). Long sequential
// streams per SM instead of 2 KiB warp chunks interleaved across blocks.
template <typename V, typename Id>
__global__ void __launch_bounds__(kCopyThreads)
copy_blocks_cta_kernel(const char* __restrict__ src, char* __restrict__ dst,
                       const Id* __restrict__ src_ids, const Id* __restrict__ dst_ids,
                       int64_t n_pairs, int64_t src_stride, int64_t dst_stride,
                       int64_t src_offset, int64_t dst_offset, int64_t vecs_per_block) {
  constexpr int64_t kStep = (int64_t)kCopyThreads * kCopyUnroll;
  for (int64_t pair = blockIdx.x; pair < n_pairs; pair += gridDim.x) {
    const V* s = reinterpret_cast<const V*>(src + (int64_t)src_ids[pair] * src_stride + src_offset);
    V* d = reinterpret_cast<V*>(dst + (int64_t)dst_ids[pair] * dst_stride + dst_offset);
    for (int64_t base = threadIdx.x; base < vecs_per_block; base += kStep) {
      V v[kCopyUnroll];
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int64_t i = base + (int64_t)u * kCopyThreads;
        if (i < vecs_per_block) v[u] = ld_stream(s + i);
      }
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int64_t i = base + (int64_t)u * kCopyThreads;
        if (i < vecs_per_block) st_stream(d + i, v[u]);
      }
    }
  }
}

enum CopyVariant : int { kWarpChunks = 0, kCtaPerBlock = 1 };

// Copies `block_bytes` bytes for each pair i:
//   dst + dst_ids[i]*dst_stride + dst_offset  <-  src + src_ids[i]*src_stride + src_offset
// `vec_bytes` (16, 8, 4, 2 or 1) must divide block_bytes, both strides, both
// offsets and both base addresses; the caller picks the widest that does.
// src_ids / dst_ids (int64 or int32) must be readable by the device (device or pinned memory).
template <typename Id>
inline cudaError_t launch_copy_blocks(const void* src, void* dst, const Id* src_ids,
                                      const Id* dst_ids, int64_t n_pairs, int64_t block_bytes,
                                      int64_t src_stride, int64_t dst_stride, int64_t src_offset,
                                      int64_t dst_offset, int vec_bytes, int num_ctas,
                                      cudaStream_t stream, int variant = kWarpChunks) {
  if (n_pairs <= 0 || block_bytes <= 0) return cudaSuccess;
  if (num_ctas <= 0) return cudaErrorInvalidValue;
  const int64_t vecs = block_bytes / vec_bytes;
  const int64_t chunks = n_pairs * ((vecs + 32 * kCopyUnroll - 1) / (32 * kCopyUnroll));
  const int64_t needed = (chunks + (kCopyThreads / 32) - 1) / (kCopyThreads / 32);
  int grid = (int)(needed < num_ctas ? needed : num_ctas);
  if (variant == kCtaPerBlock) grid = (int)(n_pairs < num_ctas ? n_pairs : num_ctas);
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  return dispatch_vec(vec_bytes, [&](auto v) {
    using V = decltype(v);
    if (variant == kCtaPerBlock)
      copy_blocks_cta_kernel<V, Id><<<grid, kCopyThreads, 0, stream>>>(s, d, src_ids, dst_ids, n_pairs,
          src_stride, dst_stride, src_offset, dst_offset, vecs);
    else
      copy_blocks_kernel<V, Id><<<grid, kCopyThreads, 0, stream>>>(s, d, src_ids, dst_ids, n_pairs,
          src_stride, dst_stride, src_offset, dst_offset, vecs);
  });
}

}  // namespace kvo
