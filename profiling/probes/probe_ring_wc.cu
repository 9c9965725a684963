// Would a write-combined pinned slot make the cold id pass cheaper? After a big D2H copy (as in
// bench_transfer's "after a device sync" host rows: the previous job wrote 128 MiB to pinned
// host memory, which passes through the CPU's last-level cache), a 32768-pair job's id pass
// reads 512 KiB of int64 ids and writes 256 KiB of int32 into the ring's pinned slot; a
// cacheable slot costs a read-for-ownership of every line it writes, a write-combined one
// (cudaHostAllocWriteCombined) does not. Times kvo::check_ids (scan only) and
// kvo::check_and_stage_ids32 into each kind of slot, warm and right after such a copy, on one
// thread (the pool off) and with the pool; plus the GPU's upload of the slot (cudaMemcpyAsync).
//   nvcc -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 -o /tmp/p profiling/probes/probe_ring_wc.cu && /tmp/p
#include <cuda_runtime.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "../kernels/csrc/host_plan.h"

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void copy_out(int4* __restrict dst, const int4* __restrict src, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) dst[i] = src[i];
}

static double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main() {
  const int64_t n = 32768, nb = 1 << 19;
  std::mt19937_64 rng(5);
  std::vector<int64_t> perm(nb);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int64_t> s(perm.begin(), perm.begin() + n), d(perm.begin() + n, perm.begin() + 2 * n);
  std::sort(d.begin(), d.end());  // sorted destinations: no duplicate bitmap, as the -bind rows
  const size_t big = 128 << 20;
  void *hbig, *dbig, *dslot, *slot[2];
  CK(cudaHostAlloc(&hbig, big, cudaHostAllocDefault));
  CK(cudaMalloc(&dbig, big));
  CK(cudaMalloc(&dslot, 2 * n * 4));
  CK(cudaHostAlloc(&slot[0], 2 * n * 4, cudaHostAllocDefault));
  CK(cudaHostAlloc(&slot[1], 2 * n * 4, cudaHostAllocWriteCombined));
  CK(cudaMemset(dbig, 1, big));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  kvo::WorkPool& pool = kvo::WorkPool::instance();
  std::printf("# %d helpers; 32768 pairs (sorted destinations), us (median of 41)\n", pool.helpers());
  std::printf("%-10s %-8s %-22s %10s\n", "slot", "pool", "state", "median_us");
  const char* states[] = {"warm", "after 128 MiB SM D2H", "after 128 MiB DMA D2H"};
  for (int pool_on = 0; pool_on < 2; ++pool_on) {
    pool.set_enabled(pool_on != 0);
    for (int what = 0; what < 3; ++what) {  // 0: scan only, 1: default slot, 2: write-combined slot
      for (int state = 0; state < 3; ++state) {
        std::vector<double> t;
        for (int rep = 0; rep < 41; ++rep) {
          int32_t* out = what == 0 ? nullptr : static_cast<int32_t*>(slot[what - 1]);
          if (state == 0) {
            if (out) (void)kvo::check_and_stage_ids32(s.data(), d.data(), n, nb, nb, out);
            else (void)kvo::check_ids(s.data(), d.data(), n, nb, nb);
          } else if (state == 1) {
            copy_out<<<32, 512, 0, st>>>(static_cast<int4*>(hbig), static_cast<const int4*>(dbig), big / 16);
            CK(cudaStreamSynchronize(st));
          } else {
            CK(cudaMemcpyAsync(hbig, dbig, big, cudaMemcpyDeviceToHost, st));
            CK(cudaStreamSynchronize(st));
          }
          const double t0 = now_us();
          const kvo::IdCheck c = out ? kvo::check_and_stage_ids32(s.data(), d.data(), n, nb, nb, out)
                                     : kvo::check_ids(s.data(), d.data(), n, nb, nb);
          _mm_sfence();
          t.push_back(now_us() - t0);
          if (c.code) std::printf("unexpected verdict %d\n", c.code);
        }
        std::sort(t.begin(), t.end());
        std::printf("%-10s %-8s %-22s %10.1f\n", what == 0 ? "scan-only" : what == 1 ? "cached" : "wc",
                    pool_on ? "on" : "off", states[state], t[t.size() / 2]);
      }
    }
  }
  // the GPU's side: upload of the 256 KiB slot (as the ring does for non-UVA jobs)
  for (int k = 0; k < 2; ++k) {
    std::vector<float> g;
    for (int rep = 0; rep < 41; ++rep) {
      CK(cudaEventRecord(e0, st));
      CK(cudaMemcpyAsync(dslot, slot[k], 2 * n * 4, cudaMemcpyHostToDevice, st));
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      g.push_back(ms * 1000.f);
    }
    std::sort(g.begin(), g.end());
    std::printf("upload of the %s slot (256 KiB H2D): %.1f us GPU time (median of 41)\n", k ? "wc" : "cached",
                g[g.size() / 2]);
  }
  return 0;
}
