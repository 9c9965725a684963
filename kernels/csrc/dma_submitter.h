// Native submit thread for DMA jobs.
//
// cudaMemcpyBatchAsync costs the calling thread driver time per descriptor, milliseconds for
// a job of a thousand (docs/design/native-submit.md). A Python submit thread did not help: it
// contends for the GIL with the engine. Here the caller plans the descriptors (one pass,
// microseconds) and queues them; a C++ thread, which never takes the GIL, waits on the
// caller's event, records the job's start event, issues the batch and records its end event.
//
// Tickets identify jobs. A ticket's events are only meaningful once the job is issued:
// query() reports "pending" until then (an unrecorded CUDA event would read as complete).
// No validation here: callers validate ids and buffers first (KVBlockMover.prepare, or the
// worker's fast path: _C.check_ids on ids whose buffers TransferWorker._fast_args checked once).
//
// The caller's own driver calls (its event record, a query) would wait behind the thread's
// long batch calls on the driver's lock (an event record then takes hundreds of times its
// usual cost: docs/design/native-submit.md).
// So the thread issues in slices of `max_per_call` descriptors and passes a DmaGate before
// each: a caller brackets its driver calls with hold()/release() and the thread pauses at the
// next slice boundary, for at most kGateWaitUs per job.
//
// Per-layer pack/unpack jobs (kvo::pack_layers) go through the same thread: the caller checks
// and stages the ids into the job's own pinned buffer and records the compute event; the
// thread uploads the ids to the job's device buffer and launches the kernel between the job's
// timing events. That moves most of a job's driver calls, each costly right after a wait,
// off the caller (docs/design/native-submit.md).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "dma_batch.cuh"
#include "fault.h"
#include "host_plan.h"

namespace kvo {

// A per-layer pack (to_unified) or unpack job's fixed arguments (see launch_pack_layers):
// the device fragment table, the unified side, the id bounds, the vector width and CTA count.
struct PackSpec {
  const int64_t* table = nullptr;
  int num_frags = 0;
  char* unified = nullptr;
  int64_t unified_stride = 0;
  int64_t n_blocks = 0, n_slots = 0;  // id bounds: GPU blocks, unified slots
  int64_t max_frag_bytes = 0;
  int vec_bytes = 16;
  bool to_unified = true;
  int num_ctas = 1;
};

// Launches a pack job's kernel on `stream` with the ids on the device (bindings.cu passes
// kvo::launch_pack_layers; a host-only test passes its own). Keeps this header kernel-free.
using PackLaunch = cudaError_t (*)(const PackSpec& spec, const int64_t* block_ids, const int64_t* slot_ids,
                                   int64_t n, cudaStream_t stream);

// Pack modes of record_and_submit_pack: straight to/from the unified side with the pack
// kernel; staged (pack into GPU staging, then DMA, pipelined in chunks); auto: the caller's
// cost model answered "direct when compute is idle, staged when it runs" (CostModel.pack_modes
// in Python, the one place that rule lives), and this side only observes which holds (without
// a staged pipe a busy job is given back, kTryOtherMethod). No policy is kept here.
enum PackMode : int { kPackDirect = 0, kPackAuto = 1, kPackStaged = 2 };

// A staged pipeline's fixed shape and its GPU resources: two staging halves filled and drained
// alternately, the aux stream the pack kernel runs on, the events that order every reuse of a
// half after its last reader or writer. The resources are made on the submit thread at first
// use and live as long as the submitter; only the thread touches them (jobs issue in order).
struct StagedPipe {
  int64_t ub = 0;        // unified block bytes (a staging slot)
  int64_t half = 0;      // bytes per half
  int64_t per = 0;       // blocks per chunk
  int vec_bytes = 16;    // the pack kernel's vector width into staging
  int min_ctas = 32;     // staging gathers are HBM bursts: at least this many CTAs
  int mode = kDmaBatch;  // the DMA half's issue mode
  char* stage = nullptr;
  int64_t* dev_local = nullptr;  // 0..per-1 on the device: the pack kernel's staging slots
  std::vector<int64_t> local;    // the same on the host: the DMA descriptors' staging side
  cudaStream_t aux = nullptr;
  cudaEvent_t entry = nullptr, exit = nullptr, ready[2] = {nullptr, nullptr}, free[2] = {nullptr, nullptr};
  bool used[2] = {false, false};
  bool made = false;

  cudaError_t make() {
    if (made) return cudaSuccess;
    // each resource made once: a make() that failed part-way is retried by the next job without
    // leaking what the failed one made
    if (!stage) KVO_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&stage), (size_t)(2 * half)));
    if (!dev_local)
      KVO_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&dev_local), (size_t)per * sizeof(int64_t)));
    // highest priority: a gather waiting behind a long compute kernel would stall the copy engine
    int lo = 0, hi = 0;
    KVO_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    if (!aux) KVO_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&aux, cudaStreamNonBlocking, hi));
    // on aux, before any pack reads it; a plain cudaMemcpy would wait for the legacy default
    // stream (an engine's compute) and hold up every caller's driver call meanwhile
    KVO_RETURN_IF_ERROR(
        cudaMemcpyAsync(dev_local, local.data(), (size_t)per * sizeof(int64_t), cudaMemcpyHostToDevice, aux));
    for (cudaEvent_t* e : {&entry, &exit, &ready[0], &ready[1], &free[0], &free[1]})
      if (!*e) KVO_RETURN_IF_ERROR(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    made = true;
    return cudaSuccess;
  }
  ~StagedPipe() {  // errors ignored: at process exit the context may be gone
    for (cudaEvent_t e : {entry, exit, ready[0], ready[1], free[0], free[1]})
      if (e) (void)cudaEventDestroy(e);
    if (aux) (void)cudaStreamDestroy(aux);
    if (dev_local) (void)cudaFree(dev_local);
    if (stage) (void)cudaFree(stage);
  }
};

class DmaSubmitter {
 public:
  // lanes (may be null): spread each job over copy-engine lanes; must outlive the submitter.
  // pack (may be null: pack jobs are refused with cudaErrorNotSupported): a pack job's launcher.
  static constexpr int kGateWaitUs = 2000;

  DmaSubmitter(int device, size_t max_per_call, DmaLanes* lanes = nullptr, PackLaunch pack = nullptr)
      : device_(device), max_per_call_(max_per_call), lanes_(lanes), pack_(pack) {
    thread_ = std::thread([this] { loop(); });
  }
  ~DmaSubmitter() {
    stop();
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  DmaSubmitter(const DmaSubmitter&) = delete;
  DmaSubmitter& operator=(const DmaSubmitter&) = delete;

  // Plans block descriptors (coalescing runs, splitting at registration segments) on the
  // calling thread and queues them. Returns the job's ticket.
  int64_t submit_blocks(const int64_t* src_ids, const int64_t* dst_ids, int64_t n, uint64_t src_base,
                        uint64_t dst_base, int64_t src_stride, int64_t dst_stride, int64_t block_bytes,
                        bool coalesce, int mode, bool src_any_order, cudaStream_t stream,
                        cudaEvent_t wait_event, Segments src_seg, Segments dst_seg) {
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_ptr<Job> j = take_job();
    j->reserve((size_t)n);
    j->count = (size_t)plan_dma(src_ids, dst_ids, n, src_base, dst_base, src_stride, dst_stride, block_bytes,
                                coalesce, j->d.data(), j->s.data(), j->z.data(), src_seg, dst_seg);
    j->mode = mode;
    j->src_any_order = src_any_order;
    j->stream = stream;
    j->wait = wait_event;
    j->pack = false;
    const auto t1 = std::chrono::steady_clock::now();
    const int64_t t = enqueue(std::move(j));
    split_record_us_.store(0.0, std::memory_order_relaxed);
    split_plan_us_.store(us_between(t0, t1), std::memory_order_relaxed);
    split_queue_us_.store(us_between(t1, std::chrono::steady_clock::now()), std::memory_order_relaxed);
    return t;
  }

  // The caller's time in its last submit, in microseconds: (event record with the gate held,
  // 0 for submit_blocks; descriptor plan, including taking a job; queueing: lock, push, wake).
  // For profiling/host_overhead.py, which cannot time inside one C++ call from Python.
  std::tuple<double, double, double> last_split() const {
    return {split_record_us_.load(std::memory_order_relaxed), split_plan_us_.load(std::memory_order_relaxed),
            split_queue_us_.load(std::memory_order_relaxed)};
  }

  // submit_blocks for a job that waits on work queued so far on `record_stream` (the compute
  // stream): `wait_event` is recorded there first, with the gate held so that the record does
  // not wait behind this thread's batch calls, then the job is planned and queued. One call
  // for what took four from Python (hold, record, submit, release): the worker's fast path.
  // A failed record queues nothing and returns its error; *ticket is set only on success.
  cudaError_t record_and_submit(int64_t* ticket, cudaStream_t record_stream, const int64_t* src_ids,
                                const int64_t* dst_ids, int64_t n, uint64_t src_base, uint64_t dst_base,
                                int64_t src_stride, int64_t dst_stride, int64_t block_bytes, bool coalesce,
                                int mode, bool src_any_order, cudaStream_t stream, cudaEvent_t wait_event,
                                Segments src_seg, Segments dst_seg) {
    if (wait_event == nullptr) return cudaErrorInvalidResourceHandle;
    const auto t0 = std::chrono::steady_clock::now();
    gate_.hold();
    int cur = -1;
    cudaError_t e = cudaGetDevice(&cur);
    if (e == cudaSuccess && cur != device_) e = cudaSetDevice(device_);
    if (e == cudaSuccess) e = cudaEventRecord(wait_event, record_stream);
    if (cur >= 0 && cur != device_) {
      const cudaError_t r = cudaSetDevice(cur);
      if (e == cudaSuccess) e = r;
    }
    gate_.release();
    if (e != cudaSuccess) return e;
    const double record_us = us_between(t0, std::chrono::steady_clock::now());
    *ticket = submit_blocks(src_ids, dst_ids, n, src_base, dst_base, src_stride, dst_stride, block_bytes,
                            coalesce, mode, src_any_order, stream, wait_event, src_seg, dst_seg);
    split_record_us_.store(record_us, std::memory_order_relaxed);
    return cudaSuccess;
  }

  // A per-layer pack/unpack job: the ids are checked (kvo::check_ids, the written side's
  // duplicates included: slots for a pack, blocks for an unpack) and staged in the job's pinned
  // buffer; then, with the gate held, `wait_event` is recorded on `record_stream` (unless
  // skip_if_busy and that stream still has work: nothing queued, code kTryOtherMethod), and the
  // job is queued. The thread uploads the ids and launches the kernel on `stream` behind
  // `wait_event`. A nonzero code (bad ids, busy) queues nothing; *err is a failed driver call
  // (nothing queued either). *ticket is set only when both are clear.
  //
  // mode (PackMode): direct; auto (direct with `record_stream` idle, else staged through
  // `pipe`, or kTryOtherMethod with pipe < 0); staged (through `pipe`). host_seg: the unified
  // side's registration segments (a staged job's DMA descriptors never span two).
  // *staged: whether the queued job is staged.
  IdCheck record_and_submit_pack(int64_t* ticket, cudaError_t* err, cudaStream_t record_stream, int mode,
                                 const int64_t* block_ids, const int64_t* slot_ids, int64_t n, const PackSpec& p,
                                 cudaStream_t stream, cudaEvent_t wait_event, int pipe = -1, Segments host_seg = {},
                                 bool* staged = nullptr) {
    *err = cudaSuccess;
    if (staged) *staged = false;
    if (pack_ == nullptr) {
      *err = cudaErrorNotSupported;
      return IdCheck{};
    }
    StagedPipe* sp = nullptr;
    if (pipe >= 0) {
      std::lock_guard<std::mutex> lk(mu_);
      if ((size_t)pipe < pipes_.size()) sp = pipes_[(size_t)pipe].get();
    }
    if (wait_event == nullptr || n <= 0 || p.table == nullptr || p.num_ctas <= 0 || mode < kPackDirect ||
        mode > kPackStaged || (pipe >= 0 && sp == nullptr) || (mode == kPackStaged && sp == nullptr)) {
      *err = cudaErrorInvalidValue;
      return IdCheck{};
    }
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t* src = p.to_unified ? block_ids : slot_ids;
    const int64_t* dst = p.to_unified ? slot_ids : block_ids;
    // check_and_stage_ids in its two steps: the check before any driver call, so bad ids are
    // answered the same with or without a GPU
    const IdCheck c = check_ids(src, dst, n, p.to_unified ? p.n_blocks : p.n_slots,
                                p.to_unified ? p.n_slots : p.n_blocks);
    if (c.code != kIdsOk) return c;
    std::unique_ptr<Job> j = take_job();
    // growing the pinned buffer is a driver call: made with the gate held (rare: jobs are reused)
    if (j->ids_cap < (size_t)n) {
      gate_.hold();
      *err = j->grow_host((size_t)n);
      gate_.release();
      if (*err != cudaSuccess) {
        give_back(std::move(j));
        return IdCheck{};
      }
    }
    std::memcpy(j->host_ids, src, (size_t)n * sizeof(int64_t));
    std::memcpy(j->host_ids + n, dst, (size_t)n * sizeof(int64_t));
    const auto t1 = std::chrono::steady_clock::now();
    gate_.hold();
    int cur = -1;
    cudaError_t e = cudaGetDevice(&cur);
    if (e == cudaSuccess && cur != device_) e = cudaSetDevice(device_);
    bool busy = false;
    if (e == cudaSuccess && mode == kPackAuto) {
      const cudaError_t q = cudaStreamQuery(record_stream);
      if (q == cudaErrorNotReady) {
        (void)cudaGetLastError();
        busy = true;
      } else {
        e = q;
      }
    }
    const bool use_staged = mode == kPackStaged || (busy && sp != nullptr);
    if (use_staged) busy = false;  // compute running: staged, not refused
    if (e == cudaSuccess && !busy) e = cudaEventRecord(wait_event, record_stream);
    if (cur >= 0 && cur != device_) {
      const cudaError_t r = cudaSetDevice(cur);
      if (e == cudaSuccess) e = r;
    }
    gate_.release();
    if (e != cudaSuccess || busy) {
      give_back(std::move(j));
      *err = e;
      return busy ? IdCheck{kTryOtherMethod} : IdCheck{};
    }
    const auto t2 = std::chrono::steady_clock::now();
    j->pack = true;
    j->pk = p;
    j->pipe = use_staged ? sp : nullptr;
    j->seg = host_seg;
    j->n = n;
    j->count = 0;
    if (staged) *staged = use_staged;
    j->stream = stream;
    j->wait = wait_event;
    *ticket = enqueue(std::move(j));
    split_record_us_.store(us_between(t1, t2), std::memory_order_relaxed);
    split_plan_us_.store(us_between(t0, t1), std::memory_order_relaxed);
    split_queue_us_.store(us_between(t2, std::chrono::steady_clock::now()), std::memory_order_relaxed);
    return c;
  }

  int device() const { return device_; }

  // A staged pipeline for pack jobs (record_and_submit_pack's `pipe`): staging_bytes of GPU
  // memory split in two halves, chunks of min(half, chunk_bytes) / ub blocks, the pack kernel on
  // at least min_ctas CTAs with vec_bytes vectors, the DMA half issued in `dma_mode`. Its GPU
  // resources are made on the thread at its first job. Returns its index.
  int add_staged(int64_t ub, int64_t staging_bytes, int64_t chunk_bytes, int vec_bytes, int min_ctas, int dma_mode) {
    auto p = std::make_unique<StagedPipe>();
    p->half = (staging_bytes / 2) & ~(int64_t)255;
    if (ub <= 0 || chunk_bytes <= 0 || vec_bytes <= 0 || min_ctas <= 0 || p->half < ub || ub % vec_bytes)
      throw std::invalid_argument("DmaSubmitter.add_staged: need ub > 0 divisible by vec_bytes, a staging half "
                                  "of at least one block, chunk_bytes, min_ctas > 0");
    p->ub = ub;
    p->per = std::max<int64_t>(1, std::min(p->half, chunk_bytes) / ub);
    p->vec_bytes = vec_bytes;
    p->min_ctas = min_ctas;
    p->mode = dma_mode;
    p->local.resize((size_t)p->per);
    for (int64_t i = 0; i < p->per; ++i) p->local[(size_t)i] = i;
    std::lock_guard<std::mutex> lk(mu_);
    pipes_.push_back(std::move(p));
    return (int)pipes_.size() - 1;
  }
  // (blocks per chunk, bytes per half) of a pipe
  std::tuple<int64_t, int64_t> staged_shape(int pipe) {
    std::lock_guard<std::mutex> lk(mu_);
    if (pipe < 0 || (size_t)pipe >= pipes_.size()) throw std::out_of_range("DmaSubmitter: unknown staged pipe");
    return {pipes_[(size_t)pipe]->per, pipes_[(size_t)pipe]->half};
  }

  // A caller about to make driver calls holds the gate; the thread waits between slices.
  void hold() { gate_.hold(); }
  void release_hold() { gate_.release(); }
  int holders() const { return gate_.holders.load(); }

  // 0: not issued yet or still running; 1: done; -1: failed (see error()).
  // A failed job is reported only once its end event has completed: a job that fails part-way
  // (a later slice's batch call, a staged chunk) has its earlier slices, uploads and kernels
  // queued, and they still read and write the job's buffers. Reporting it at once let the
  // caller reuse them meanwhile (a failed load's GPU blocks recomputed, then overwritten by
  // its queued copies; a failed store's host slots handed to the next store). The end event is
  // recorded even after a failure; where it was never recorded for this job, nothing was queued
  // after the failure point either, and the query returns at once.
  int query(int64_t t) {
    Job* j = find(t);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!j->issued) return 0;
    }
    const cudaError_t e = j->end ? cudaEventQuery(j->end) : cudaSuccess;
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return 0;
    }
    if (j->err != cudaSuccess) return -1;
    if (e != cudaSuccess) { j->err = e; return -1; }
    return 1;
  }

  void wait_issued(int64_t t) {
    Job* j = find(t);
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return j->issued; });
  }

  // Makes `stream` wait for the job on the GPU (the host only waits for it to be issued).
  // A failed job is fenced too, behind what it queued before the failure (its end event is
  // recorded even then), and the fence itself succeeds: the failure is the job's, reported by
  // query/error/synchronize, and a caller fencing before it reuses the job's blocks (an
  // engine freeing blocks behind its stores) must not be stopped by it. Only a failed
  // cudaStreamWaitEvent is an error here.
  cudaError_t fence(int64_t t, cudaStream_t stream) {
    wait_issued(t);
    Job* j = find(t);
    if (j->end == nullptr) return cudaSuccess;  // failed before anything was queued
    return cudaStreamWaitEvent(stream, j->end, 0);
  }

  // Waits for the job's queued work even when it failed (see query), then returns its error.
  cudaError_t synchronize(int64_t t) {
    wait_issued(t);
    Job* j = find(t);
    const cudaError_t e = j->end ? cudaEventSynchronize(j->end) : cudaSuccess;
    return j->err != cudaSuccess ? j->err : e;
  }

  float elapsed_ms(int64_t t) {
    Job* j = find(t);
    float ms = 0.f;
    if (j->err == cudaSuccess && cudaEventElapsedTime(&ms, j->start, j->end) != cudaSuccess) ms = -1.f;
    return ms;
  }

  std::string error(int64_t t) {
    Job* j = find(t);
    if (j->err == cudaSuccess) return "";
    return std::string(cudaGetErrorName(j->err)) + ": " + cudaGetErrorString(j->err);
  }

  // DMA descriptors the job issued (0 for a pack job).
  int64_t descriptors(int64_t t) { return (int64_t)find(t)->count; }

  // Forgets a finished job (after query() != 0 or synchronize()); its buffers and events are reused.
  void release(int64_t t) {
    wait_issued(t);
    Job* f = find(t);
    // a failed pack job may still have its id upload queued: its buffers are reused only after
    // the end event, which is recorded even after a failure
    if (f->pack && f->err != cudaSuccess && f->end) (void)cudaEventSynchronize(f->end);
    std::lock_guard<std::mutex> lk(mu_);
    auto it = jobs_.find(t);
    if (it == jobs_.end()) return;
    std::unique_ptr<Job> j = std::move(it->second);
    jobs_.erase(it);
    if (j->start) events_free_.push_back(j->start);
    if (j->end) events_free_.push_back(j->end);
    j->start = j->end = nullptr;
    j->issued = false;
    j->err = cudaSuccess;
    j->pack = false;
    j->pipe = nullptr;
    // Kept, however many: a job's buffers are freed only with the submitter. cudaFreeHost and
    // cudaFree synchronise the whole device, so freeing here made the caller (an engine's
    // completion poll) wait for the running forward whenever more jobs had been in flight
    // than the spares kept (tests/cpp/dma_issue_fake_cuda.cpp). Jobs in flight are bounded by
    // the engine, and a job's buffers are small (16 bytes per id, rounded to 1024 ids).
    spare_.push_back(std::move(j));
  }

  // Issues everything queued, then ends the thread.
  void stop() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stopped_) return;
      stopped_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  int64_t in_flight() {
    std::lock_guard<std::mutex> lk(mu_);
    return (int64_t)jobs_.size();
  }

 private:
  static double us_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
    return std::chrono::duration<double, std::micro>(b - a).count();
  }
  struct Job {
    std::vector<uint64_t> d, s, z;  // descriptor arrays, reused across jobs
    size_t count = 0;
    // a pack job: its spec, id count, and ids (src then dst, as check_and_stage_ids writes
    // them) in pinned memory and on the device, both reused across jobs
    bool pack = false;
    PackSpec pk{};
    StagedPipe* pipe = nullptr;  // a staged pack job's pipe
    Segments seg{};              // ... and its unified side's registration segments
    int64_t n = 0;
    int64_t* host_ids = nullptr;
    int64_t* dev_ids = nullptr;
    size_t ids_cap = 0, dev_cap = 0;  // id pairs each buffer holds
    int mode = kDmaBatch;
    bool src_any_order = false;
    cudaStream_t stream = nullptr;
    cudaEvent_t wait = nullptr, start = nullptr, end = nullptr;
    cudaError_t err = cudaSuccess;
    bool issued = false;
    int64_t ticket = 0;
    void reserve(size_t n) {
      if (d.size() < n) { d.resize(n); s.resize(n); z.resize(n); }
    }
    static size_t rounded(size_t n) { return std::max<size_t>(1024, (n + 1023) / 1024 * 1024); }
    // The outgrown pinned buffer is kept until the job is destroyed (with the submitter):
    // cudaFreeHost synchronises the device, and this runs on the caller's thread (see release).
    // Growth at least doubles, so the kept buffers add at most the live one's size.
    std::vector<int64_t*> retired_host;
    cudaError_t grow_host(size_t n) {
      if (host_ids) retired_host.push_back(host_ids);
      host_ids = nullptr;
      const size_t cap = rounded(std::max(n, 2 * ids_cap));
      ids_cap = 0;
      KVO_RETURN_IF_ERROR(cudaHostAlloc(reinterpret_cast<void**>(&host_ids), 2 * cap * sizeof(int64_t),
                                        cudaHostAllocPortable));
      ids_cap = cap;
      return cudaSuccess;
    }
    // On the submit thread (device set), stream-ordered on the job's stream: cudaFree would
    // synchronise the device (wait for the engine's compute) and hold up callers meanwhile. The
    // old buffer is idle: a job is reused only after its end event completed.
    cudaError_t grow_dev(size_t n, cudaStream_t s) {
      if (dev_ids) (void)cudaFreeAsync(dev_ids, s);
      dev_ids = nullptr;
      dev_cap = 0;
      const size_t cap = rounded(n);
      KVO_RETURN_IF_ERROR(cudaMallocAsync(reinterpret_cast<void**>(&dev_ids), 2 * cap * sizeof(int64_t), s));
      dev_cap = cap;
      return cudaSuccess;
    }
    ~Job() {  // errors ignored: at process exit the context may be gone
      for (int64_t* p : retired_host) (void)cudaFreeHost(p);
      if (host_ids) (void)cudaFreeHost(host_ids);
      if (dev_ids) (void)cudaFree(dev_ids);
    }
  };

  int64_t enqueue(std::unique_ptr<Job> j) {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopped_) {
      spare_.push_back(std::move(j));  // (kept: see release)
      throw std::runtime_error("DmaSubmitter is stopped");
    }
    const int64_t t = ++next_ticket_;
    j->ticket = t;
    queue_.push_back(j.get());
    jobs_.emplace(t, std::move(j));
    cv_.notify_one();
    return t;
  }

  void give_back(std::unique_ptr<Job> j) {
    std::lock_guard<std::mutex> lk(mu_);
    spare_.push_back(std::move(j));  // (kept: see release)
  }

  std::unique_ptr<Job> take_job() {
    std::lock_guard<std::mutex> lk(mu_);
    if (spare_.empty()) return std::make_unique<Job>();
    std::unique_ptr<Job> j = std::move(spare_.back());
    spare_.pop_back();
    return j;
  }

  Job* find(int64_t t) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = jobs_.find(t);
    if (it == jobs_.end()) throw std::out_of_range("DmaSubmitter: unknown ticket " + std::to_string(t));
    return it->second.get();
  }

  cudaError_t take_event(cudaEvent_t* e) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!events_free_.empty()) {
        *e = events_free_.back();
        events_free_.pop_back();
        return cudaSuccess;
      }
    }
    const cudaError_t err = cudaEventCreate(e);  // timing enabled: jobs report their GPU time
    if (err == cudaSuccess) {
      std::lock_guard<std::mutex> lk(mu_);
      events_.push_back(*e);
    }
    return err;
  }

  cudaError_t issue(Job* j) {
    KVO_RETURN_IF_ERROR(take_event(&j->start));
    KVO_RETURN_IF_ERROR(take_event(&j->end));
    if (j->pack && j->dev_cap < j->ids_cap) KVO_RETURN_IF_ERROR(j->grow_dev(j->ids_cap, j->stream));
    gate_.until = std::chrono::steady_clock::now() + std::chrono::microseconds(kGateWaitUs);
    gate_.pass();
    if (j->wait) KVO_RETURN_IF_ERROR(cudaStreamWaitEvent(j->stream, j->wait, 0));
    KVO_RETURN_IF_ERROR(cudaEventRecord(j->start, j->stream));
    if (j->pack && j->pipe) {
      const cudaError_t e = issue_staged(j);
      const cudaError_t r = cudaEventRecord(j->end, j->stream);  // even after a failure: waiters never hang
      return e != cudaSuccess ? e : r;
    }
    if (j->pack) {
      const PackSpec& p = j->pk;
      const int64_t n = j->n;
      cudaError_t e = fault::check(fault::Site::kMemcpyAsync);
      if (e == cudaSuccess)
        e = cudaMemcpyAsync(j->dev_ids, j->host_ids, 2 * (size_t)n * sizeof(int64_t), cudaMemcpyHostToDevice,
                            j->stream);
      // staged as (src, dst): blocks first for a pack, slots first for an unpack
      const int64_t* blocks = p.to_unified ? j->dev_ids : j->dev_ids + n;
      const int64_t* slots = p.to_unified ? j->dev_ids + n : j->dev_ids;
      if (e == cudaSuccess) e = pack_(p, blocks, slots, n, j->stream);
      const cudaError_t r = cudaEventRecord(j->end, j->stream);  // even after a failure: waiters never hang
      return e != cudaSuccess ? e : r;
    }
    auto d = reinterpret_cast<void* const*>(j->d.data());
    auto sr = reinterpret_cast<const void* const*>(j->s.data());
    auto sz = reinterpret_cast<const size_t*>(j->z.data());
    const cudaError_t e =
        lanes_ ? lanes_->launch(d, sr, sz, j->count, max_per_call_, j->mode, j->src_any_order, j->stream, nullptr,
                                &gate_)
               : launch_dma_batch(d, sr, sz, j->count, max_per_call_, j->mode, j->src_any_order, j->stream, nullptr,
                                  &gate_);
    // the end event is recorded even after a failure, so waiters never hang on it
    const cudaError_t r = cudaEventRecord(j->end, j->stream);
    return e != cudaSuccess ? e : r;
  }

  // A staged pack job on the thread, after its stream's wait and start event: the block ids go
  // up on the aux stream (the DMA side reads the slots on the host), then chunk by chunk
  // through the two halves. D2H: pack into half k on aux, DMA half k to the host slots on the
  // job's stream; H2D: the mirror image. Events order each reuse of a half after its last
  // reader; the job ends in its stream's order (H2D: the stream waits for aux's last unpack).
  cudaError_t issue_staged(Job* j) {
    StagedPipe& p = *j->pipe;
    const cudaError_t e = staged_chunks(j, p);
    if (e != cudaSuccess && p.made) {
      // a half may still be in use by what was queued: wait, so the next job starts clean
      (void)cudaStreamSynchronize(p.aux);
      (void)cudaStreamSynchronize(j->stream);
      p.used[0] = p.used[1] = false;
    }
    return e;
  }

  cudaError_t staged_chunks(Job* j, StagedPipe& p) {
    KVO_RETURN_IF_ERROR(p.make());
    const int64_t n = j->n;
    const bool d2h = j->pk.to_unified;
    const int64_t* hb = d2h ? j->host_ids : j->host_ids + n;  // staged as (src, dst)
    const int64_t* hs = d2h ? j->host_ids + n : j->host_ids;
    const uint64_t host_base = (uint64_t)(uintptr_t)j->pk.unified;
    const int64_t host_stride = j->pk.unified_stride;
    const bool coalesce = host_stride == p.ub;  // staging slots are back to back
    PackSpec ps = j->pk;
    ps.unified_stride = p.ub;
    ps.vec_bytes = p.vec_bytes;
    ps.num_ctas = std::max(ps.num_ctas, p.min_ctas);
    KVO_RETURN_IF_ERROR(cudaEventRecord(p.entry, j->stream));
    KVO_RETURN_IF_ERROR(cudaStreamWaitEvent(p.aux, p.entry, 0));  // the pack sees all before the job
    KVO_RETURN_IF_ERROR(fault::check(fault::Site::kMemcpyAsync));
    KVO_RETURN_IF_ERROR(cudaMemcpyAsync(j->dev_ids, hb, (size_t)n * sizeof(int64_t), cudaMemcpyHostToDevice, p.aux));
    j->reserve((size_t)p.per);
    auto d = reinterpret_cast<void* const*>(j->d.data());
    auto sr = reinterpret_cast<const void* const*>(j->s.data());
    auto sz = reinterpret_cast<const size_t*>(j->z.data());
    for (int64_t a = 0, c = 0; a < n; a += p.per, ++c) {
      const int64_t b = std::min(n, a + p.per);
      const int k = (int)(c & 1);
      ps.unified = p.stage + k * p.half;
      const uint64_t sbase = (uint64_t)(uintptr_t)ps.unified;
      if (d2h) {
        if (p.used[k]) KVO_RETURN_IF_ERROR(cudaStreamWaitEvent(p.aux, p.free[k], 0));
        p.used[k] = true;
        KVO_RETURN_IF_ERROR(pack_(ps, j->dev_ids + a, p.dev_local, b - a, p.aux));
        KVO_RETURN_IF_ERROR(cudaEventRecord(p.ready[k], p.aux));
        KVO_RETURN_IF_ERROR(cudaStreamWaitEvent(j->stream, p.ready[k], 0));
        const size_t cnt = (size_t)plan_dma(p.local.data(), hs + a, b - a, sbase, host_base, p.ub, host_stride, p.ub,
                                            coalesce, j->d.data(), j->s.data(), j->z.data(), Segments{}, j->seg);
        KVO_RETURN_IF_ERROR(launch_dma_batch(d, sr, sz, cnt, max_per_call_, p.mode, false, j->stream, nullptr, &gate_));
        KVO_RETURN_IF_ERROR(cudaEventRecord(p.free[k], j->stream));
      } else {
        if (p.used[k]) KVO_RETURN_IF_ERROR(cudaStreamWaitEvent(j->stream, p.free[k], 0));
        p.used[k] = true;
        const size_t cnt = (size_t)plan_dma(hs + a, p.local.data(), b - a, host_base, sbase, host_stride, p.ub, p.ub,
                                            coalesce, j->d.data(), j->s.data(), j->z.data(), j->seg, Segments{});
        KVO_RETURN_IF_ERROR(launch_dma_batch(d, sr, sz, cnt, max_per_call_, p.mode, false, j->stream, nullptr, &gate_));
        KVO_RETURN_IF_ERROR(cudaEventRecord(p.ready[k], j->stream));
        KVO_RETURN_IF_ERROR(cudaStreamWaitEvent(p.aux, p.ready[k], 0));
        KVO_RETURN_IF_ERROR(pack_(ps, j->dev_ids + a, p.dev_local, b - a, p.aux));
        KVO_RETURN_IF_ERROR(cudaEventRecord(p.free[k], p.aux));
      }
    }
    if (!d2h) {
      KVO_RETURN_IF_ERROR(cudaEventRecord(p.exit, p.aux));
      KVO_RETURN_IF_ERROR(cudaStreamWaitEvent(j->stream, p.exit, 0));
    }
    return cudaSuccess;
  }

  void loop() {
    const cudaError_t dev_err = cudaSetDevice(device_);
    for (;;) {
      Job* j = nullptr;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stopped_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopped and drained
        j = queue_.front();
        queue_.pop_front();
      }
      const cudaError_t e = dev_err != cudaSuccess ? dev_err : issue(j);
      {
        std::lock_guard<std::mutex> lk(mu_);
        j->err = e;
        j->issued = true;
      }
      done_cv_.notify_all();
    }
  }

  int device_;
  size_t max_per_call_;
  DmaLanes* lanes_;
  PackLaunch pack_;
  std::vector<std::unique_ptr<StagedPipe>> pipes_;  // freed after the thread (stop() in the destructor)
  DmaGate gate_;  // `until` is only touched by the submit thread
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<Job*> queue_;
  std::unordered_map<int64_t, std::unique_ptr<Job>> jobs_;
  std::vector<std::unique_ptr<Job>> spare_;
  std::vector<cudaEvent_t> events_, events_free_;
  int64_t next_ticket_ = 0;
  bool stopped_ = false;
  std::atomic<double> split_record_us_{0.0}, split_plan_us_{0.0}, split_queue_us_{0.0};  // last_split()
  std::thread thread_;
};

}  // namespace kvo
