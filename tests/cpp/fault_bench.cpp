// What the disarmed fault hook (kernels/csrc/fault.h) costs per check: a loop of N checks
// against the same loop without one (each iteration does a little work that the compiler
// cannot drop, standing in for the driver call the hook guards). Prints ns per check; built
// and run by tests/test_dma_issue_host.py (-O2, fake runtime), which asserts it stays well
// under the microseconds each guarded driver call costs.
#include <cuda_runtime.h>  // the fake: built with -I tests/cpp/fake_cuda

#include <chrono>
#include <cstdint>
#include <cstdio>

#include "../../kernels/csrc/fault.h"

static volatile uint64_t sink;

template <bool kCheck>
static double run(int64_t n) {
  uint64_t acc = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
    if (kCheck) {
      const cudaError_t e = kvo::fault::check(kvo::fault::Site::kMemcpyBatch);
      if (e != cudaSuccess) acc += (uint64_t)e;
    }
    acc = acc * 6364136223846793005ull + (uint64_t)i;
    asm volatile("" : "+r"(acc) : : "memory");  // keeps the loop as written; the flag is reloaded each time
  }
  const auto t1 = std::chrono::steady_clock::now();
  sink = acc;
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / (double)n;
}

int main() {
  const int64_t n = 50'000'000;
  double base = 1e9, hook = 1e9;
  for (int r = 0; r < 5; ++r) {  // best of 5: a shared machine's noise only adds
    const double b = run<false>(n), h = run<true>(n);
    base = b < base ? b : base;
    hook = h < hook ? h : hook;
  }
  std::printf("fault_bench: base %.3f ns/iter  with check %.3f ns/iter  check %.3f ns\n", base, hook, hook - base);
  return 0;
}
