// A small process-wide pool of helper threads for the host-side id pass of large jobs
// (host_plan.h): plain C++, no CUDA. One pass over tens of thousands of id pairs is
// memory-bound on one core and takes as long as the submit budget of the whole job (50 us);
// split over a few cores it takes a fraction of that (docs/design/host-id-pass.md).
//
// The caller never waits for a helper to wake up: it takes pieces from a shared counter
// itself and waits only for pieces a helper has already started. A helper that wakes late
// finds no work left. Helpers spin for a while after each job (submits come in bursts, and
// waking a sleeping thread costs more than the pass it would help with), then sleep.
//   KVO_HOST_THREADS  helper threads (default min(3, cores - 1); 0: every pass on the caller)
//   KVO_HOST_SPIN_US  how long a helper spins after a job before it sleeps (default 2000)
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>
#include <algorithm>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace kvo {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class WorkPool {
 public:
  using Fn = void (*)(void*, int);

  static WorkPool& instance() {
    static WorkPool pool(env_int("KVO_HOST_THREADS", default_helpers(), 64),
                         env_int("KVO_HOST_SPIN_US", 2000, 10000000));
    return pool;
  }

  WorkPool(int helpers, int spin_us) : helpers_(helpers < 0 ? 0 : helpers), spin_us_(spin_us < 0 ? 0 : spin_us) {}
  ~WorkPool() {
    stop_.store(true);
    {
      std::lock_guard<std::mutex> g(m_);
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;

  int helpers() const { return helpers_; }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed) && helpers_ > 0; }
  void set_enabled(bool on) { enabled_.store(on); }
  int spin_us() const { return spin_us_.load(std::memory_order_relaxed); }
  void set_spin_us(int us) { spin_us_.store(us < 0 ? 0 : us); }
  // Whether a helper is running or spinning (not asleep): work split now is shared at once.
  bool awake() const { return enabled() && sleepers_.load() < live_.load(); }
  // Pieces run by helpers since the process started (tests and benchmarks read it).
  int64_t helper_pieces() const { return helper_pieces_.load(); }

  // Runs fn(ctx, p) for every p in [0, pieces) and returns once all have run: on the caller
  // and whichever helpers join. Serial on the caller when the pool is off, busy with another
  // caller's job, or inherited through fork().
  void run(int pieces, Fn fn, void* ctx) {
    std::unique_lock<std::mutex> own(caller_, std::try_to_lock);
    if (pieces < 2 || !own.owns_lock() || !enabled() || !start()) {
      for (int p = 0; p < pieces; ++p) fn(ctx, p);
      return;
    }
    // Close the previous job; once no helper is inside it, its fields may be rewritten.
    job_.store(0);
    while (active_.load() != 0) cpu_relax();
    fn_ = fn;
    ctx_ = ctx;
    pieces_ = pieces;
    next_.store(0);
    done_.store(0);
    if (++seq_ == 0) ++seq_;  // 0 means "no job"
    job_.store(seq_);
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> g(m_); }  // a helper between its check and its wait sees the job
      cv_.notify_all();
    }
    for (int p; (p = next_.fetch_add(1)) < pieces;) {
      fn(ctx, p);
      done_.fetch_add(1);
    }
    while (done_.load() < pieces) cpu_relax();
  }

 private:
  static int env_int(const char* name, int dflt, long max) {
    const char* v = std::getenv(name);
    if (!v || !*v) return dflt;
    char* end = nullptr;
    const long x = std::strtol(v, &end, 10);
    return (*end == 0 && x >= 0 && x <= max) ? (int)x : dflt;
  }
  static int default_helpers() {
    const unsigned hw = std::thread::hardware_concurrency();
    return hw <= 1 ? 0 : (int)std::min(3u, hw - 1);
  }

  // Starts the helpers on first use; false in a child of fork() (its helpers did not come along).
  bool start() {
    if (started_pid_ == 0) {
      started_pid_ = getpid();
      try {
        for (int i = 0; i < helpers_; ++i) threads_.emplace_back([this] { helper_loop(); });
      } catch (...) {  // no threads to be had: the caller does every pass
        helpers_ = (int)threads_.size();
      }
      live_.store((int)threads_.size());
    }
    return started_pid_ == getpid() && !threads_.empty();
  }

  bool has_new_job(uint32_t seen) const {
    const uint32_t j = job_.load();
    return j != 0 && j != seen;
  }

  void helper_loop() {
    uint32_t seen = 0;
    while (!stop_.load()) {
      if (!has_new_job(seen)) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us());
        bool found = false;
        while (!stop_.load()) {
          for (int k = 0; k < 64 && !(found = has_new_job(seen)); ++k) cpu_relax();
          if (found || std::chrono::steady_clock::now() >= until) break;
        }
        if (!found && !stop_.load()) {
          std::unique_lock<std::mutex> lk(m_);
          sleepers_.fetch_add(1);
          cv_.wait(lk, [&] { return stop_.load() || has_new_job(seen); });
          sleepers_.fetch_sub(1);
        }
        continue;
      }
      // Announce, then re-read the job: run() rewrites a job's fields only after closing it
      // (job_ = 0) and seeing no helper active, so fields read here belong to job j.
      active_.fetch_add(1);
      const uint32_t j = job_.load();
      if (j != 0 && j != seen) {
        seen = j;
        const Fn fn = fn_;
        void* const ctx = ctx_;
        const int pieces = pieces_;
        for (int p; (p = next_.fetch_add(1)) < pieces;) {
          fn(ctx, p);
          helper_pieces_.fetch_add(1);
          done_.fetch_add(1);
        }
      }
      active_.fetch_sub(1);
    }
  }

  int helpers_;
  std::atomic<int> spin_us_;
  std::atomic<bool> enabled_{true};
  std::mutex caller_;  // one job at a time; other callers run serially
  std::vector<std::thread> threads_;
  pid_t started_pid_ = 0;
  // the current job
  std::atomic<uint32_t> job_{0};
  uint32_t seq_ = 0;
  Fn fn_ = nullptr;
  void* ctx_ = nullptr;
  int pieces_ = 0;
  std::atomic<int> next_{0};
  std::atomic<int> done_{0};
  std::atomic<int> active_{0};
  std::atomic<int64_t> helper_pieces_{0};
  // sleeping helpers
  std::mutex m_;
  std::condition_variable cv_;
  std::atomic<int> sleepers_{0};
  std::atomic<int> live_{0};  // helper threads started
  std::atomic<bool> stop_{false};
};

}  // namespace kvo
