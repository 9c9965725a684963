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

// Variant (sm_90+): bulk copies through shared memory (cp.async.bulk, Hopper's TMA
// engine). One thread per CTA issues whole chunks of up to kBulkChunk bytes: a bulk load
// into a shared-memory stage (an mbarrier counts its bytes), then a bulk store out of it.
// Why: SM loads and stores move 16 B per thread-instruction and keep the LSU pipes busy;
// a bulk op moves a whole chunk per instruction from a single thread, so the SM stays
// nearly free and the PCIe side sees long sequential streams. kBulkStages stages keep
// several chunks in flight per CTA. Requires 16-byte aligned addresses and sizes.
constexpr int kBulkChunk = 8192;
constexpr int kBulkStages = 4;
constexpr int kBulkThreads = 32;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void bulk_load(uint32_t dst_smem, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst_smem), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void bar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}" :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, uint32_t src_smem, uint32_t bytes) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
               :: "l"(dst), "r"(src_smem), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
#endif

template <typename Id>
__global__ void __launch_bounds__(kBulkThreads)
copy_blocks_bulk_kernel(const char* __restrict__ src, char* __restrict__ dst,
                        const Id* __restrict__ src_ids, const Id* __restrict__ dst_ids,
                        int64_t n_pairs, int64_t src_stride, int64_t dst_stride,
                        int64_t src_offset, int64_t dst_offset, int64_t block_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ alignas(128) char buf[kBulkStages][kBulkChunk];
  __shared__ alignas(8) uint64_t full[kBulkStages];
  if (threadIdx.x != 0) return;  // one issuing thread; the rest of the warp has nothing to do
  for (int s = 0; s < kBulkStages; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_u32(&full[s])) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the async proxy

  const int64_t per_block = (block_bytes + kBulkChunk - 1) / kBulkChunk;
  const int64_t total = n_pairs * per_block;
  // this CTA's chunks: w = blockIdx.x + j * gridDim.x, j = 0 .. mine-1
  const int64_t mine = total > blockIdx.x ? (total - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  auto where = [&](int64_t j, const char*& s, char*& d, uint32_t& bytes) {
    const int64_t w = (int64_t)blockIdx.x + j * gridDim.x;
    const int64_t pair = w / per_block;
    const int64_t off = (w - pair * per_block) * kBulkChunk;
    s = src + (int64_t)src_ids[pair] * src_stride + src_offset + off;
    d = dst + (int64_t)dst_ids[pair] * dst_stride + dst_offset + off;
    const int64_t left = block_bytes - off;
    bytes = (uint32_t)(left < kBulkChunk ? left : kBulkChunk);
  };
  const char* s;
  char* d;
  uint32_t bytes;
  for (int64_t j = 0; j < mine && j < kBulkStages; ++j) {
    where(j, s, d, bytes);
    bulk_load(smem_u32(buf[j]), s, bytes, smem_u32(&full[j]));
  }
  for (int64_t j = 0; j < mine; ++j) {
    const int st = (int)(j % kBulkStages);
    bar_wait(smem_u32(&full[st]), (uint32_t)((j / kBulkStages) & 1));
    where(j, s, d, bytes);
    bulk_store(d, smem_u32(buf[st]), bytes);
    // refill the stage of chunk j-1 once its store has read shared memory (at most the
    // store just issued still reading), so loads run a stage ahead of the stores
    const int64_t next = j - 1 + kBulkStages;
    if (j >= 1 && next < mine) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      const int ps = (int)((j - 1) % kBulkStages);
      where(next, s, d, bytes);
      bulk_load(smem_u32(buf[ps]), s, bytes, smem_u32(&full[ps]));
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // stores done before the CTA exits
#else
  __trap();  // launch_copy_blocks never picks this variant below sm_90
#endif
}

enum CopyVariant : int { kWarpChunks = 0, kCtaPerBlock = 1, kBulk = 2 };

// Copies `block_bytes` bytes for each pair i:
//   dst + dst_ids[i]*dst_stride + dst_offset  <-  src + src_ids[i]*src_stride + src_offset
// variant: kWarpChunks, kCtaPerBlock or kBulk (sm_90+, vec_bytes 16 only).
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
  KVO_RETURN_IF_ERROR(fault::check(fault::Site::kKernelLaunch));  // test-only hook (fault.h)
  const int64_t vecs = block_bytes / vec_bytes;
  const int64_t chunks = n_pairs * ((vecs + 32 * kCopyUnroll - 1) / (32 * kCopyUnroll));
  const int64_t needed = (chunks + (kCopyThreads / 32) - 1) / (kCopyThreads / 32);
  int grid = (int)(needed < num_ctas ? needed : num_ctas);
  if (variant == kCtaPerBlock) grid = (int)(n_pairs < num_ctas ? n_pairs : num_ctas);
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  if (variant == kBulk) {
    // bulk copies need 16-byte alignment of every address and size (vec_bytes 16 says so)
    // and sm_90; the caller checks both, this is the backstop
    if (vec_bytes != 16) return cudaErrorInvalidValue;
    int dev = 0;
    KVO_RETURN_IF_ERROR(cudaGetDevice(&dev));
    static int major_of[64] = {0};  // 0: not looked up yet (a benign race: same value written)
    int major = dev < 64 ? major_of[dev] : 0;
    if (major == 0) {
      KVO_RETURN_IF_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
      if (dev < 64) major_of[dev] = major;
    }
    if (major < 9) return cudaErrorInvalidValue;
    const int64_t bulk_chunks = n_pairs * ((block_bytes + kBulkChunk - 1) / kBulkChunk);
    const int bgrid = (int)(bulk_chunks < num_ctas ? bulk_chunks : num_ctas);
    copy_blocks_bulk_kernel<Id><<<bgrid, kBulkThreads, 0, stream>>>(s, d, src_ids, dst_ids, n_pairs,
        src_stride, dst_stride, src_offset, dst_offset, block_bytes);
    return cudaGetLastError();
  }
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
