// The index ring: pinned + device slots that carry block ids to the SM kernels, with the
// fused check + stage + launch entry points (copy_blocks, copy_blocks_fn, pack_job) that the
// binding layer exposes as kernels._C.IndexRing. Host memory is owned by the caller (Python).
#pragma once
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "binding_util.h"
#include "copy_blocks.cuh"
#include "pack_layers.cuh"
#include "host_plan.h"
#include "fn_launch.h"

// Block ids travel host -> device through a ring of pinned slots. Each slot's
// event is recorded after the launch that reads it; staging into a slot waits
// on that event only when the ring has wrapped onto a job still running.
class IndexRing {
 public:
  // uva: kernels read the ids straight from the pinned slot (a cudaHostAlloc pointer is a
  // device pointer under UVA) instead of a device copy made by cudaMemcpyAsync. That copy
  // runs on a copy engine, where it can wait behind a bulk DMA in the same direction for
  // the whole DMA (see profiling/ce_contention.py); the kernel then reads the ids over PCIe.
  IndexRing(uintptr_t host, uintptr_t dev, int slots, int64_t capacity, bool uva)
      : host_(as_ptr<int64_t>(host)), dev_(as_ptr<int64_t>(dev)), cap_(capacity), uva_(uva),
        events_(slots, nullptr), used_(slots, false) {
    for (auto& e : events_) KVO_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  ~IndexRing() {
    for (auto e : events_) if (e) cudaEventDestroy(e);
  }
  int64_t capacity() const { return cap_; }
  bool uva() const { return uva_; }
  // Returns (slot, device pointer of src ids, device pointer of dst ids).
  std::tuple<int, uintptr_t, uintptr_t> stage(uintptr_t src_ids, uintptr_t dst_ids, int64_t n,
                                              uintptr_t stream) {
    if (n > cap_) throw std::invalid_argument("IndexRing.stage: more ids than slot capacity");
    const int k = take_slot();
    int64_t* h = host_ + (int64_t)k * 2 * cap_;
    std::memcpy(h, as_ptr<const int64_t>(src_ids), n * sizeof(int64_t));
    std::memcpy(h + n, as_ptr<const int64_t>(dst_ids), n * sizeof(int64_t));
    return upload(k, n, stream);
  }
  // Validates the ids (kvo::check_and_stage_ids: the check, then the copy into the slot only
  // if they are valid). On an error nothing is queued and the slot stays free:
  // (code, index, value, -1, 0, 0).
  // Else (0, runs_both, runs_src, slot, device src ids, device dst ids); runs_dst is
  // not needed by callers that already chose their method. ids_uva: the "device" ids are the
  // pinned slot itself, read through UVA (no upload), as on a uva ring.
  std::tuple<int, int64_t, int64_t, int, uintptr_t, uintptr_t> stage_checked(
      uintptr_t src_ids, uintptr_t dst_ids, int64_t n, int64_t n_src, int64_t n_dst, uintptr_t stream,
      bool ids_uva = false) {
    if (n > cap_) throw std::invalid_argument("IndexRing.stage_checked: more ids than slot capacity");
    const int k = peek_slot();
    int64_t* h = host_ + (int64_t)k * 2 * cap_;
    const kvo::IdCheck c = kvo::check_and_stage_ids(as_ptr<const int64_t>(src_ids),
                                                    as_ptr<const int64_t>(dst_ids), n, n_src, n_dst, h);
    if (c.code) return {c.code, c.index, c.value, -1, 0, 0};
    commit_slot(k);
    auto [slot, ds, dd] = upload(k, n, stream, ids_uva);
    return {0, c.runs_both, c.runs_src, slot, ds, dd};
  }
  // The whole SM copy in one call, the GIL released: validate + stage ids, upload them,
  // launch kvo::copy_blocks, mark the slot busy until the kernel is done. Returns the
  // check's (code, index, value); nothing is queued unless code == 0.
  // `auto`'s fast path passes run limits: if runs_both <= max_runs_both, or the host side's
  // runs (src if host_is_src, else dst) <= max_runs_host, the ids are valid but coalesce well
  // enough that DMA may win: nothing is queued and (kTryOtherMethod, runs_both, runs_host)
  // comes back. -1: no limit. Limits apply to the int32 path (n_src, n_dst <= 2**31) only.
  // ids_uva: this job's kernel reads its ids from the pinned slot through UVA even if the ring
  // uploads them (BlockCopier ids_uva_d2h_max_bytes / ids_uva_h2d_max_bytes: small warp-shape jobs
  // skip the upload call and its wait; in D2H the id reads also ride the idle H2D direction).
  std::tuple<int, int64_t, int64_t> copy_blocks(uintptr_t src, uintptr_t dst, uintptr_t src_ids,
                                                uintptr_t dst_ids, int64_t n, int64_t n_src, int64_t n_dst,
                                                int64_t block_bytes, int64_t src_stride, int64_t dst_stride,
                                                int vec_bytes, int num_ctas, uintptr_t stream, int variant,
                                                int64_t max_runs_both, int64_t max_runs_host, bool host_is_src,
                                                bool ids_uva) {
    if (n > cap_) throw std::invalid_argument("IndexRing.copy_blocks: more ids than slot capacity");
    if (n > 0 && n_src <= kvo::kMaxId32 + 1 && n_dst <= kvo::kMaxId32 + 1) {
      // int32 ids: one pass checks and narrows them into the slot; half the bytes to upload
      int k = -1;
      const int32_t* ids = nullptr;
      const kvo::IdCheck c = stage32(src_ids, dst_ids, n, n_src, n_dst, stream, &k, &ids, max_runs_both,
                                     max_runs_host, host_is_src, ids_uva);
      if (c.code) return {c.code, c.index, c.value};  // the slot stays free, nothing queued
      const cudaError_t e = kvo::launch_copy_blocks(
          as_ptr<const void>(src), as_ptr<void>(dst), ids, ids + n, n, block_bytes, src_stride, dst_stride, 0, 0,
          vec_bytes, num_ctas, reinterpret_cast<cudaStream_t>(stream), variant);
      release(k, stream);  // even on failure: the queued id upload still reads the pinned slot
      KVO_CHECK(e);
      return {0, 0, 0};
    }
    auto [code, a, b, slot, ds, dd] = stage_checked(src_ids, dst_ids, n, n_src, n_dst, stream, ids_uva);
    if (code) return {code, a, b};
    const cudaError_t e = kvo::launch_copy_blocks(
        as_ptr<const void>(src), as_ptr<void>(dst), as_ptr<const int64_t>(ds), as_ptr<const int64_t>(dd), n,
        block_bytes, src_stride, dst_stride, 0, 0, vec_bytes, num_ctas, reinterpret_cast<cudaStream_t>(stream),
        variant);
    release(slot, stream);  // even on failure: the queued id upload still reads the pinned slot
    KVO_CHECK(e);
    return {0, 0, 0};
  }
  // stage_checked with the ids narrowed to int32 (n_src, n_dst <= 2**31): what a Triton
  // kernel's first launch through Triton's own launcher reads.
  std::tuple<int, int64_t, int64_t, int, uintptr_t, uintptr_t> stage_checked32(
      uintptr_t src_ids, uintptr_t dst_ids, int64_t n, int64_t n_src, int64_t n_dst, uintptr_t stream) {
    check_job32("IndexRing.stage_checked32", n, n_src, n_dst);
    int k = -1;
    const int32_t* ids = nullptr;
    const kvo::IdCheck c = stage32(src_ids, dst_ids, n, n_src, n_dst, stream, &k, &ids);
    if (c.code) return {c.code, c.index, c.value, -1, 0, 0};
    return {0, c.runs_both, c.runs_src, k, reinterpret_cast<uintptr_t>(ids), reinterpret_cast<uintptr_t>(ids + n)};
  }
  // copy_blocks with a kernel compiled elsewhere: validate + stage int32 ids, upload them and
  // launch `function` (kvo::launch_fn) with the runtime arguments of Triton's block copy
  // (src, dst, src ids, dst ids, n, elements per block, src stride, dst stride, src offset,
  // dst offset; sizes in elements) on min(num_programs, n * chunks) programs. Returns
  // check_ids' (code, index, value); nothing is queued unless code is 0.
  std::tuple<int, int64_t, int64_t> copy_blocks_fn(uintptr_t function, unsigned threads, unsigned shared,
                                                   uint32_t kinds, int scratch, int64_t num_programs,
                                                   int64_t chunks, uintptr_t src, uintptr_t dst, uintptr_t src_ids,
                                                   uintptr_t dst_ids, int64_t n, int64_t n_src, int64_t n_dst,
                                                   int64_t elems_per_block, int64_t src_stride, int64_t dst_stride,
                                                   int64_t src_offset, int64_t dst_offset, uintptr_t stream) {
    check_job32("IndexRing.copy_blocks_fn", n, n_src, n_dst);
    if (!function || threads == 0 || num_programs < 1 || chunks < 1)
      throw std::invalid_argument("IndexRing.copy_blocks_fn: bad kernel launch spec");
    int k = -1;
    const int32_t* ids = nullptr;
    const kvo::IdCheck c = stage32(src_ids, dst_ids, n, n_src, n_dst, stream, &k, &ids);
    if (c.code) return {c.code, c.index, c.value};
    const int64_t vals[10] = {(int64_t)src, (int64_t)dst, (int64_t)(uintptr_t)ids, (int64_t)(uintptr_t)(ids + n),
                              n, elems_per_block, src_stride, dst_stride, src_offset, dst_offset};
    const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(num_programs, n * chunks));
    const kvo::FnSpec spec{function, threads, shared, kinds, 10, scratch};
    const int r = kvo::launch_fn(spec, (unsigned)grid, vals, reinterpret_cast<cudaStream_t>(stream));
    release(k, stream);  // even on failure: the queued id upload still reads the pinned slot
    if (r)
      throw std::runtime_error(std::string(__FILE__) + ":" + std::to_string(__LINE__) +
                               ": cuLaunchKernel of a compiled Triton kernel failed: " + kvo::fn_error_name(r) +
                               " (" + std::to_string(r) + ")");
    return {0, 0, 0};
  }
  // A transfer worker's whole per-layer pack (to_unified) or unpack job in one GIL-free call,
  // on `device`: if skip_if_busy, `compute` still running gives (kTryOtherMethod, 0, 0) with
  // nothing done (auto then takes the staged path). Else the ids are checked (duplicates on
  // the written side: slots for a pack, blocks for an unpack) and staged; bad ids give
  // check_ids' (code, index, value) with nothing queued. Then `after` is recorded on `compute`,
  // `stream` waits on it, `start` is recorded, kvo::pack_layers is launched and `end` recorded.
  // Through Python that is prepare() plus run(), several times this call's host time
  // (docs/design/native-submit.md; rows "per-layer-cuda-general" against "per-layer-cuda").
  std::tuple<int, int64_t, int64_t> pack_job(uintptr_t table, int num_frags, uintptr_t unified,
                                             int64_t unified_stride, uintptr_t block_ids, uintptr_t slot_ids,
                                             int64_t n, int64_t n_blocks, int64_t n_slots, int64_t max_frag_bytes,
                                             int vec_bytes, bool to_unified, int num_ctas, uintptr_t stream,
                                             uintptr_t compute, bool skip_if_busy, uintptr_t after, uintptr_t start,
                                             uintptr_t end, int device) {
    if (n <= 0 || n > cap_)
      throw std::invalid_argument("IndexRing.pack_job: n must be in [1, slot capacity " + std::to_string(cap_) +
                                  "], got " + std::to_string(n));
    if (!after || !start || !end) throw std::invalid_argument("IndexRing.pack_job: null event");
    int cur = -1;
    KVO_CHECK(cudaGetDevice(&cur));
    if (cur != device) KVO_CHECK(cudaSetDevice(device));
    struct Restore {  // the caller's device back, on every exit
      int cur, dev;
      ~Restore() { if (cur != dev) (void)cudaSetDevice(cur); }
    } restore{cur, device};
    const auto cs = reinterpret_cast<cudaStream_t>(compute);
    const auto s = reinterpret_cast<cudaStream_t>(stream);
    if (skip_if_busy) {
      const cudaError_t q = cudaStreamQuery(cs);
      if (q == cudaErrorNotReady) {
        (void)cudaGetLastError();
        return {kvo::kTryOtherMethod, 0, 0};
      }
      KVO_CHECK(q);
    }
    // check_ids orientation: the source is read, the destination written
    const uintptr_t src = to_unified ? block_ids : slot_ids, dst = to_unified ? slot_ids : block_ids;
    auto [code, a, b, slot, ds, dd] = stage_checked(src, dst, n, to_unified ? n_blocks : n_slots,
                                                    to_unified ? n_slots : n_blocks, stream);
    if (code) return {code, a, b};
    const auto dev_blocks = as_ptr<const int64_t>(to_unified ? ds : dd);
    const auto dev_slots = as_ptr<const int64_t>(to_unified ? dd : ds);
    cudaError_t e = cudaEventRecord(reinterpret_cast<cudaEvent_t>(after), cs);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(s, reinterpret_cast<cudaEvent_t>(after), 0);
    if (e == cudaSuccess) e = cudaEventRecord(reinterpret_cast<cudaEvent_t>(start), s);
    if (e == cudaSuccess)
      e = kvo::launch_pack_layers(as_ptr<const int64_t>(table), num_frags, as_ptr<char>(unified), dev_blocks,
                                  dev_slots, n, max_frag_bytes, unified_stride, vec_bytes, to_unified, num_ctas, s);
    release(slot, stream);  // even on failure: the queued id upload still reads the pinned slot
    KVO_CHECK(e);
    KVO_CHECK(cudaEventRecord(reinterpret_cast<cudaEvent_t>(end), s));
    return {0, 0, 0};
  }
  void release(int slot, uintptr_t stream) {
    KVO_CHECK(cudaEventRecord(events_[slot], reinterpret_cast<cudaStream_t>(stream)));
    used_[slot] = true;
    last_ = slot;
  }

 private:
  void check_job32(const char* who, int64_t n, int64_t n_src, int64_t n_dst) const {
    if (n <= 0 || n > cap_)
      throw std::invalid_argument(std::string(who) + ": n must be in [1, slot capacity " + std::to_string(cap_) +
                                  "], got " + std::to_string(n));
    if (n_src > kvo::kMaxId32 + 1 || n_dst > kvo::kMaxId32 + 1)
      throw std::invalid_argument(std::string(who) + ": block counts must fit in int32");
  }
  // The int32 staging of a job: check + narrow the ids into the next free slot
  // (kvo::check_and_stage_ids32); with valid ids and no run limit hit, commit the slot, queue
  // the upload and set *slot and *ids (what the kernel reads: dst ids at *ids + n). Returns the
  // check; kTryOtherMethod (index = runs_both, value = the host side's runs): a run limit was
  // hit. Unless code is 0 the slot stays free and nothing is queued. ids_uva: no upload, *ids
  // is the pinned slot itself (as for a uva ring).
  kvo::IdCheck stage32(uintptr_t src_ids, uintptr_t dst_ids, int64_t n, int64_t n_src, int64_t n_dst,
                       uintptr_t stream, int* slot, const int32_t** ids, int64_t max_runs_both = -1,
                       int64_t max_runs_host = -1, bool host_is_src = false, bool ids_uva = false) {
    const int k = peek_slot();
    int32_t* h = reinterpret_cast<int32_t*>(host_ + (int64_t)k * 2 * cap_);
    const kvo::IdCheck c = kvo::check_and_stage_ids32(as_ptr<const int64_t>(src_ids),
                                                      as_ptr<const int64_t>(dst_ids), n, n_src, n_dst, h);
    if (c.code) return c;
    const int64_t runs_host = host_is_src ? c.runs_src : c.runs_dst;
    if (c.runs_both <= max_runs_both || runs_host <= max_runs_host)
      return kvo::IdCheck{kvo::kTryOtherMethod, c.runs_both, runs_host};
    commit_slot(k);
    const int32_t* p = h;
    if (!uva_ && !ids_uva) {
      int32_t* dv = reinterpret_cast<int32_t*>(dev_ + (int64_t)k * 2 * cap_);
      KVO_CHECK(kvo::fault::check(kvo::fault::Site::kMemcpyAsync));
      KVO_CHECK(cudaMemcpyAsync(dv, h, 2 * n * sizeof(int32_t), cudaMemcpyHostToDevice,
                                reinterpret_cast<cudaStream_t>(stream)));
      p = dv;
    }
    *slot = k;
    *ids = p;
    return c;
  }
  // The slot for the next job. The slot released last, if the GPU is done reading it: its
  // cache lines are likely still in this core's cache. Writing ids into a slot gone cold is
  // the likely reason a job submitted after a sync cost more than one submitted while the GPU
  // was busy (with this reuse the gap mostly closed; profiling/results/connector.json). Else the next slot in ring order, once the job that last read it is
  // done (at once unless the ring wrapped).
  int peek_slot() {
    if (last_ >= 0) {
      const cudaError_t q = cudaEventQuery(events_[last_]);
      if (q == cudaSuccess) return last_;
      if (q == cudaErrorNotReady) (void)cudaGetLastError();  // not an error: clear it, as torch does
    }
    const int k = next_;
    if (used_[k]) KVO_CHECK(cudaEventSynchronize(events_[k]));
    return k;
  }
  // Marks slot k taken (by a job that will release() it).
  void commit_slot(int k) {
    if (k == last_) last_ = -1;  // taken again: not reusable until its next release()
    if (k == next_) next_ = (k + 1) % (int)events_.size();
  }
  int take_slot() {
    const int k = peek_slot();
    commit_slot(k);
    return k;
  }
  std::tuple<int, uintptr_t, uintptr_t> upload(int k, int64_t n, uintptr_t stream, bool ids_uva = false) {
    int64_t* h = host_ + (int64_t)k * 2 * cap_;
    if (uva_ || ids_uva) return {k, reinterpret_cast<uintptr_t>(h), reinterpret_cast<uintptr_t>(h + n)};
    int64_t* dv = dev_ + (int64_t)k * 2 * cap_;
    KVO_CHECK(kvo::fault::check(kvo::fault::Site::kMemcpyAsync));
    KVO_CHECK(cudaMemcpyAsync(dv, h, 2 * n * sizeof(int64_t), cudaMemcpyHostToDevice,
                              reinterpret_cast<cudaStream_t>(stream)));
    return {k, reinterpret_cast<uintptr_t>(dv), reinterpret_cast<uintptr_t>(dv + n)};
  }
  int64_t* host_;
  int64_t* dev_;
  int64_t cap_;
  bool uva_;
  std::vector<cudaEvent_t> events_;
  std::vector<bool> used_;
  int next_ = 0;
  int last_ = -1;  // the slot released last, while no job holds it
};
