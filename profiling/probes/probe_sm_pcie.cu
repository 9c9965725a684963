// Probe: the ceiling of SM-issued PCIe traffic on this GPU, per load/store flavour.
//
// The SM copy kernels (kernels/csrc/copy_blocks.cuh) top out near 51 GB/s H2D and 52.6 GB/s
// D2H here, against ~55.5 for the copy engines, at every CTA count and kernel shape. This
// probe asks whether the PTX access flavour moves that ceiling: L2 prefetch sizes
// (.L2::64B/128B/256B), non-coherent and L1::no_allocate loads, plain vs streaming vs
// write-through stores, an L2 bulk prefetch ahead of the loads, and TMA bulk copies of
// 8-32 KiB chunks. Each case copies 1 GiB as 32 KiB blocks in a random order between a
// device buffer and cudaHostAlloc memory, timed by CUDA events (median of --reps after
// warm-up), beside same-run cudaMemcpyAsync references (one 2 GiB copy, and two streams).
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 -o /tmp/probe profiling/probes/probe_sm_pcie.cu
//   /tmp/probe [out.json]
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#define CK(x)                                                                   \
  do {                                                                          \
    cudaError_t e_ = (x);                                                       \
    if (e_ != cudaSuccess) {                                                    \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

enum Ld { LD_CS, LD_PLAIN, LD_NC, LD_L2_64, LD_L2_128, LD_L2_256, LD_NC_NA_256, LD_PF_256 };
enum St { ST_CS, ST_PLAIN, ST_WT, ST_NA };
static const char* ld_name[] = {"ld.cs", "ld", "ld.nc", "ld.L2::64B", "ld.L2::128B", "ld.L2::256B",
                                "ld.nc.L1::no_allocate.L2::256B", "prefetch.L2 + ld.cs"};
static const char* st_name[] = {"st.cs", "st", "st.wt", "st.L1::no_allocate"};

template <int L>
__device__ __forceinline__ int4 load(const int4* p) {
  int4 v;
  if constexpr (L == LD_CS || L == LD_PF_256) v = __ldcs(p);
  else if constexpr (L == LD_PLAIN) asm volatile("ld.global.v4.s32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else if constexpr (L == LD_NC) asm volatile("ld.global.nc.v4.s32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else if constexpr (L == LD_L2_64) asm volatile("ld.global.L2::64B.v4.s32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else if constexpr (L == LD_L2_128) asm volatile("ld.global.L2::128B.v4.s32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else if constexpr (L == LD_L2_256) asm volatile("ld.global.L2::256B.v4.s32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

template <int S>
__device__ __forceinline__ void store(int4* p, int4 v) {
  if constexpr (S == ST_CS) __stcs(p, v);
  else if constexpr (S == ST_PLAIN) asm volatile("st.global.v4.s32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
  else if constexpr (S == ST_WT) __stwt(p, v);
  else asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// The shape of copy_blocks_kernel: 2 KiB warp chunks, kUnroll loads then kUnroll stores.
template <int L, int S, int kUnroll>
__global__ void __launch_bounds__(512) copy_k(const char* __restrict__ src, char* __restrict__ dst,
                                              const int* __restrict__ sid, const int* __restrict__ did,
                                              int64_t n, int64_t bb) {
  constexpr int64_t kChunk = 32 * kUnroll;
  const int64_t vpb = bb / 16, cpb = (vpb + kChunk - 1) / kChunk, total = n * cpb;
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t)gridDim.x * 16;
  for (int64_t w = (int64_t)blockIdx.x * 16 + (threadIdx.x >> 5); w < total; w += warps) {
    const int64_t pair = w / cpb, c = w - pair * cpb;
    const int4* s = reinterpret_cast<const int4*>(src + (int64_t)sid[pair] * bb);
    int4* d = reinterpret_cast<int4*>(dst + (int64_t)did[pair] * bb);
    const int64_t base = c * kChunk + lane;
    if constexpr (L == LD_PF_256) {
      // one L2 bulk prefetch of the warp's next chunk ahead of its loads
      const int64_t wn = w + warps;
      if (lane == 0 && wn < total) {
        const int64_t pn = wn / cpb, cn = wn - pn * cpb;
        const char* q = src + (int64_t)sid[pn] * bb + cn * kChunk * 16;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(q), "r"((int)(kChunk * 16)) : "memory");
      }
    }
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = load<L>(s + base + u * 32);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) store<S>(d + base + u * 32, v[u]);
  }
}

// TMA bulk copy through shared memory, kChunkB per stage, 4 stages, one issuing thread.
template <int kChunkB>
__global__ void __launch_bounds__(32) bulk_k(const char* __restrict__ src, char* __restrict__ dst,
                                             const int* __restrict__ sid, const int* __restrict__ did,
                                             int64_t n, int64_t bb) {
  constexpr int kStages = 4;
  extern __shared__ __align__(128) char smem[];
  __shared__ alignas(8) uint64_t full[kStages];
  if (threadIdx.x) return;
  auto su = [](const void* p) { return (uint32_t)__cvta_generic_to_shared(p); };
  for (int s = 0; s < kStages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(su(&full[s])) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const int64_t per = bb / kChunkB, total = n * per;
  const int64_t mine = total > blockIdx.x ? (total - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  auto at = [&](int64_t j, const char*& s, char*& d) {
    const int64_t w = blockIdx.x + j * gridDim.x, pair = w / per, off = (w - pair * per) * kChunkB;
    s = src + (int64_t)sid[pair] * bb + off;
    d = dst + (int64_t)did[pair] * bb + off;
  };
  auto ld = [&](int st, const char* s) {
    const uint32_t bar = su(&full[st]), to = su(smem + st * kChunkB);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(kChunkB) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" :: "r"(to), "l"(s), "r"(kChunkB), "r"(bar) : "memory");
  };
  const char* s;
  char* d;
  for (int64_t j = 0; j < mine && j < kStages; ++j) { at(j, s, d); ld((int)j, s); }
  for (int64_t j = 0; j < mine; ++j) {
    const int st = (int)(j % kStages);
    const uint32_t bar = su(&full[st]), par = (uint32_t)((j / kStages) & 1);
    asm volatile("{\n .reg .pred p;\nW_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W_%=;\n}" :: "r"(bar), "r"(par) : "memory");
    at(j, s, d);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(d), "r"(su(smem + st * kChunkB)), "r"(kChunkB) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    const int64_t nx = j - 1 + kStages;
    if (j >= 1 && nx < mine) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      at(nx, s, d);
      ld((int)((j - 1) % kStages), s);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

struct Ctx {
  char *dev, *host;
  int *sid, *did;  // device id arrays: [n] identity for the device side, [n] shuffled host side
  int64_t n, bb;
  cudaStream_t st;
  cudaEvent_t a, b;
  int reps;
};

template <typename F>
static double median_ms(Ctx& c, F&& f) {
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> t;
  for (int i = 0; i < c.reps; ++i) {
    CK(cudaEventRecord(c.a, c.st));
    f();
    CK(cudaEventRecord(c.b, c.st));
    CK(cudaEventSynchronize(c.b));
    float ms;
    CK(cudaEventElapsedTime(&ms, c.a, c.b));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

static FILE* js;
static bool first_row = true;
static void row(const char* dir, const std::string& what, int ctas, double gbps, double ref) {
  printf("%-4s %-44s ctas=%4d %7.2f GB/s %6.1f%%\n", dir, what.c_str(), ctas, gbps, 100 * gbps / ref);
  fprintf(js, "%s\n  {\"dir\": \"%s\", \"case\": \"%s\", \"ctas\": %d, \"gbps\": %.2f, \"of_ref\": %.4f}",
          first_row ? "" : ",", dir, what.c_str(), ctas, gbps, gbps / ref);
  first_row = false;
}

template <int L, int S, int U>
static void run_copy(Ctx& c, bool h2d, int ctas, double ref, const char* tag = nullptr) {
  const char* src = h2d ? c.host : c.dev;
  char* dst = h2d ? c.dev : c.host;
  const int* si = h2d ? c.did : c.sid;  // host side shuffled, device side in order
  const int* di = h2d ? c.sid : c.did;
  double ms = median_ms(c, [&] { copy_k<L, S, U><<<ctas, 512, 0, c.st>>>(src, dst, si, di, c.n, c.bb); });
  CK(cudaGetLastError());
  std::string name = tag ? tag : (std::string(h2d ? ld_name[L] : st_name[S]) + " u" + std::to_string(U));
  row(h2d ? "h2d" : "d2h", name, ctas, c.n * c.bb / ms / 1e6, ref);
}

template <int B>
static void run_bulk(Ctx& c, bool h2d, int ctas, double ref) {
  const char* src = h2d ? c.host : c.dev;
  char* dst = h2d ? c.dev : c.host;
  const int* si = h2d ? c.did : c.sid;
  const int* di = h2d ? c.sid : c.did;
  const int smem = 4 * B;
  CK(cudaFuncSetAttribute(bulk_k<B>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  double ms = median_ms(c, [&] { bulk_k<B><<<ctas, 32, smem, c.st>>>(src, dst, si, di, c.n, c.bb); });
  CK(cudaGetLastError());
  row(h2d ? "h2d" : "d2h", "tma bulk " + std::to_string(B / 1024) + " KiB x4", ctas, c.n * c.bb / ms / 1e6, ref);
}

int main(int argc, char** argv) {
  const char* out = argc > 1 ? argv[1] : "probe_sm_pcie.json";
  Ctx c;
  c.bb = 32768;
  c.n = (1ll << 30) / c.bb;
  c.reps = 15;
  const size_t big = 2ull << 30;
  CK(cudaMalloc(&c.dev, big));
  CK(cudaHostAlloc(&c.host, big, cudaHostAllocDefault));
  CK(cudaMemset(c.dev, 1, big));
  memset(c.host, 2, big);
  std::vector<int> ids(c.n), sh(c.n);
  for (int64_t i = 0; i < c.n; ++i) ids[i] = (int)i;
  sh = ids;
  std::mt19937 rng(0);
  std::shuffle(sh.begin(), sh.end(), rng);
  CK(cudaMalloc(&c.sid, c.n * 4));
  CK(cudaMalloc(&c.did, c.n * 4));
  CK(cudaMemcpy(c.sid, ids.data(), c.n * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(c.did, sh.data(), c.n * 4, cudaMemcpyHostToDevice));
  CK(cudaStreamCreateWithFlags(&c.st, cudaStreamNonBlocking));
  cudaStream_t s2;
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  CK(cudaEventCreate(&c.a));
  CK(cudaEventCreate(&c.b));
  cudaEvent_t j1, j2;
  CK(cudaEventCreateWithFlags(&j1, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&j2, cudaEventDisableTiming));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  js = fopen(out, "w");
  char date[32];
  const time_t now = time(nullptr);
  strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
  const char* sha = getenv("KVO_GIT_SHA");
  fprintf(js, "{\"meta\": {\"gpu\": \"%s\", \"date\": \"%s\", \"git_sha\": \"%s\"}, \"block_bytes\": %lld, "
          "\"bytes\": %lld, \"rows\": [", prop.name, date, sha ? sha : "unknown", (long long)c.bb, (long long)(c.n * c.bb));

  // references: one 2 GiB copy, and the same bytes split over two streams
  double ref[2];
  for (int h2d = 0; h2d < 2; ++h2d) {
    void* dst = h2d ? (void*)c.dev : (void*)c.host;
    const void* src = h2d ? (const void*)c.host : (const void*)c.dev;
    double one = median_ms(c, [&] { CK(cudaMemcpyAsync(dst, src, big, cudaMemcpyDefault, c.st)); });
    double two = median_ms(c, [&] {
      CK(cudaEventRecord(j1, c.st));
      CK(cudaStreamWaitEvent(s2, j1));
      CK(cudaMemcpyAsync(dst, src, big / 2, cudaMemcpyDefault, c.st));
      CK(cudaMemcpyAsync((char*)dst + big / 2, (const char*)src + big / 2, big / 2, cudaMemcpyDefault, s2));
      CK(cudaEventRecord(j2, s2));
      CK(cudaStreamWaitEvent(c.st, j2));
    });
    const double g1 = big / one / 1e6, g2 = big / two / 1e6;
    ref[h2d] = std::max(g1, g2);
    row(h2d ? "h2d" : "d2h", "reference: cudaMemcpyAsync 2 GiB", 0, g1, ref[h2d]);
    row(h2d ? "h2d" : "d2h", "reference: 2 streams x 1 GiB", 0, g2, ref[h2d]);
  }
  for (int ctas : {16, 64}) {
    // H2D: the load flavour matters (reads of host memory); stores go to HBM
    run_copy<LD_CS, ST_CS, 4>(c, true, ctas, ref[1]);
    run_copy<LD_PLAIN, ST_CS, 4>(c, true, ctas, ref[1]);
    run_copy<LD_NC, ST_CS, 4>(c, true, ctas, ref[1]);
    run_copy<LD_L2_64, ST_CS, 4>(c, true, ctas, ref[1]);
    run_copy<LD_L2_128, ST_CS, 4>(c, true, ctas, ref[1]);
    run_copy<LD_L2_256, ST_CS, 4>(c, true, ctas, ref[1]);
    run_copy<LD_NC_NA_256, ST_CS, 4>(c, true, ctas, ref[1]);
    run_copy<LD_PF_256, ST_CS, 4>(c, true, ctas, ref[1]);
    run_copy<LD_CS, ST_CS, 8>(c, true, ctas, ref[1]);
    run_copy<LD_L2_256, ST_CS, 8>(c, true, ctas, ref[1]);
    run_bulk<8192>(c, true, ctas, ref[1]);
    run_bulk<16384>(c, true, ctas, ref[1]);
    run_bulk<32768>(c, true, ctas, ref[1]);
    // D2H: the store flavour matters (writes to host memory)
    run_copy<LD_CS, ST_CS, 4>(c, false, ctas, ref[0]);
    run_copy<LD_CS, ST_PLAIN, 4>(c, false, ctas, ref[0]);
    run_copy<LD_CS, ST_WT, 4>(c, false, ctas, ref[0]);
    run_copy<LD_CS, ST_NA, 4>(c, false, ctas, ref[0]);
    run_copy<LD_CS, ST_CS, 8>(c, false, ctas, ref[0]);
    run_bulk<8192>(c, false, ctas, ref[0]);
    run_bulk<16384>(c, false, ctas, ref[0]);
    run_bulk<32768>(c, false, ctas, ref[0]);
  }
  fprintf(js, "\n]}\n");
  fclose(js);
  printf("wrote %s\n", out);
  return 0;
}
