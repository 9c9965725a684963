// Host-side id validation and DMA descriptor planning: plain C++, no CUDA, so
// it runs (and is tested) on machines without a GPU. One pass per array.
#pragma once
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <climits>
#include <vector>

#include "work_pool.h"

namespace kvo {

enum IdError : int {
  kIdsOk = 0,
  kSrcNegative = 1,
  kSrcOutOfRange = 2,
  kDstNegative = 3,
  kDstOutOfRange = 4,
  kDstDuplicate = 5,
  // Not an error: IndexRing.copy_blocks found runs long enough that `auto` should weigh DMA
  // (index = runs_both, value = runs of the host side); nothing was queued.
  kTryOtherMethod = 6,
};

struct IdCheck {
  int code = kIdsOk;
  int64_t index = -1;  // position of the offending id
  int64_t value = 0;   // the offending id
  int64_t runs_both = 0;  // descriptors after coalescing where both ids advance by 1
  int64_t runs_src = 0;   // ... where the src id advances by 1
  int64_t runs_dst = 0;   // ... where the dst id advances by 1
};

// The id pass runs on every submit, so it is compiled for AVX-512, AVX2 and baseline x86-64
// and picked at load time (GCC/Clang function multiversioning): 64-bit min/max and compares
// only vectorise with AVX2+, several times faster on large jobs (docs/design/host-id-pass.md).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVO_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KVO_MULTIVERSION
#endif

struct IdScan {
  int64_t smin, smax, dmin, dmax, bs, bd, bb, notinc;
};

// Pass 1 over ids [lo, hi), branch-free so the compiler vectorises it: extremes, run breaks
// (at i in [max(lo, 1), hi), against id i - 1), and whether dst is strictly increasing; with
// kNarrow, the ids also go to out[lo, hi) (src) and out[n + lo, n + hi) (dst) as int32 in the
// same pass. Inlined into each multiversioned caller below, so every clone compiles it for its
// own instruction set.
template <bool kNarrow>
static inline __attribute__((always_inline)) IdScan scan_ids_impl(const int64_t* __restrict src,
                                                                   const int64_t* __restrict dst, int64_t n,
                                                                   int32_t* __restrict out, int64_t lo,
                                                                   int64_t hi) {
  int64_t smin = src[lo], smax = src[lo], dmin = dst[lo], dmax = dst[lo];
  int64_t bs = 0, bd = 0, bb = 0, notinc = 0;
  if (kNarrow) {
    out[lo] = (int32_t)src[lo];
    out[n + lo] = (int32_t)dst[lo];
  }
  if (lo > 0) {
    const int64_t sr = src[lo] != src[lo - 1] + 1, dr = dst[lo] != dst[lo - 1] + 1;
    bs += sr;
    bd += dr;
    bb += sr | dr;
    notinc += dst[lo] <= dst[lo - 1];
  }
  for (int64_t i = lo + 1; i < hi; ++i) {
    const int64_t s = src[i], d = dst[i];
    if (kNarrow) {
      out[i] = (int32_t)s;
      out[n + i] = (int32_t)d;
    }
    smin = s < smin ? s : smin;
    smax = s > smax ? s : smax;
    dmin = d < dmin ? d : dmin;
    dmax = d > dmax ? d : dmax;
    const int64_t sr = s != src[i - 1] + 1, dr = d != dst[i - 1] + 1;
    bs += sr;
    bd += dr;
    bb += sr | dr;
    notinc += d <= dst[i - 1];
  }
  return {smin, smax, dmin, dmax, bs, bd, bb, notinc};
}

KVO_MULTIVERSION static IdScan scan_ids_only(const int64_t* __restrict src, const int64_t* __restrict dst,
                                             int64_t n, int64_t lo, int64_t hi) {
  return scan_ids_impl<false>(src, dst, n, nullptr, lo, hi);
}

// The scan of ids [lo, hi) writing them narrowed to int32 into out[0, n) (src) and
// out[n, 2n) (dst) as it goes. Half the bytes go into the pinned slot and over PCIe, and the
// one pass replaces a scan plus an int64 memcpy (docs/design/host-id-pass.md).
KVO_MULTIVERSION static IdScan scan_and_narrow(const int64_t* __restrict src, const int64_t* __restrict dst,
                                               int64_t n, int32_t* __restrict out, int64_t lo, int64_t hi) {
  return scan_ids_impl<true>(src, dst, n, out, lo, hi);
}

inline IdScan merge_scans(IdScan a, const IdScan& b) {
  a.smin = b.smin < a.smin ? b.smin : a.smin;
  a.smax = b.smax > a.smax ? b.smax : a.smax;
  a.dmin = b.dmin < a.dmin ? b.dmin : a.dmin;
  a.dmax = b.dmax > a.dmax ? b.dmax : a.dmax;
  a.bs += b.bs;
  a.bd += b.bd;
  a.bb += b.bb;
  a.notinc += b.notinc;
  return a;
}

// Jobs from this many ids on split their scan over the WorkPool's threads, in pieces of
// kScanPiece ids (small enough that a helper joining late still takes a share).
constexpr int64_t kParallelScanMin = 8192;
constexpr int64_t kScanPiece = 2048;
constexpr int kMaxScanPieces = 64;

// The whole scan of n ids (narrowing into `out` unless it is null), split when large.
inline IdScan scan_ids(const int64_t* src, const int64_t* dst, int64_t n, int32_t* out) {
  auto piece = [&](int64_t lo, int64_t hi) {
    return out ? scan_and_narrow(src, dst, n, out, lo, hi) : scan_ids_only(src, dst, n, lo, hi);
  };
  WorkPool& pool = WorkPool::instance();
  if (n < kParallelScanMin || !pool.enabled()) return piece(0, n);
  struct Ctx {
    const int64_t *src, *dst;
    int32_t* out;
    int64_t n, per;
    IdScan part[kMaxScanPieces];
  } c{src, dst, out, n, 0, {}};
  const int64_t pieces = std::min<int64_t>(kMaxScanPieces, (n + kScanPiece - 1) / kScanPiece);
  c.per = (n + pieces - 1) / pieces;
  pool.run((int)pieces, [](void* p, int k) {
    Ctx& c = *static_cast<Ctx*>(p);
    const int64_t lo = k * c.per, hi = std::min(c.n, lo + c.per);
    if (lo >= hi) {  // an empty tail piece: neutral for merge_scans
      c.part[k] = IdScan{INT64_MAX, INT64_MIN, INT64_MAX, INT64_MIN, 0, 0, 0, 0};
      return;
    }
    c.part[k] = c.out ? scan_and_narrow(c.src, c.dst, c.n, c.out, lo, hi) : scan_ids_only(c.src, c.dst, c.n, lo, hi);
  }, &c);
  IdScan r = c.part[0];
  for (int64_t k = 1; k < pieces; ++k) r = merge_scans(r, c.part[k]);
  return r;
}

// Marks ids (bit positions) in bitmap b; returns nonzero iff some bit was set already (a repeat
// within ids, or of an id marked before). No early exit, so loads and stores pipeline, and
// four ids per iteration, whose address math overlaps (each measured faster:
// docs/design/host-id-pass.md). Two ids of a group in one word stay exact: each load
// follows the previous store.
template <typename T>
inline uint64_t mark_bits(uint64_t* __restrict b, const T* __restrict ids, int64_t n) {
  uint64_t seen = 0;
  const int64_t n4 = n & ~(int64_t)3;
  for (int64_t i = 0; i < n4; i += 4) {
    const uint64_t w0 = (uint64_t)ids[i] >> 6, m0 = 1ull << (ids[i] & 63);
    const uint64_t w1 = (uint64_t)ids[i + 1] >> 6, m1 = 1ull << (ids[i + 1] & 63);
    const uint64_t w2 = (uint64_t)ids[i + 2] >> 6, m2 = 1ull << (ids[i + 2] & 63);
    const uint64_t w3 = (uint64_t)ids[i + 3] >> 6, m3 = 1ull << (ids[i + 3] & 63);
    const uint64_t o0 = b[w0]; seen |= o0 & m0; b[w0] = o0 | m0;
    const uint64_t o1 = b[w1]; seen |= o1 & m1; b[w1] = o1 | m1;
    const uint64_t o2 = b[w2]; seen |= o2 & m2; b[w2] = o2 | m2;
    const uint64_t o3 = b[w3]; seen |= o3 & m3; b[w3] = o3 | m3;
  }
  for (int64_t i = n4; i < n; ++i) {
    const uint64_t w = (uint64_t)ids[i] >> 6, m = 1ull << (ids[i] & 63);
    const uint64_t old = b[w];
    seen |= old & m;
    b[w] = old | m;
  }
  return seen;
}

// Zeroes the words of b that ids set: word by word when few words were touched.
template <typename T>
inline void clear_bits(uint64_t* b, const T* ids, int64_t n) {
  for (int64_t j = 0; j < n; ++j) b[(uint64_t)ids[j] >> 6] = 0;
}

// Position of the first id that repeats an earlier one, or -1; ids must lie in [0, n_ids).
// A bitmap over the id space (per thread, kept all-zero between calls), cleared word by word
// when few words were touched, else with one memset. Only a job with a duplicate pays a second
// pass to find where.
inline int64_t first_duplicate(const int64_t* ids, int64_t n, int64_t n_ids) {
  thread_local std::vector<uint64_t> bits;
  const size_t words = (size_t)((n_ids + 63) / 64);
  if (bits.size() < words) bits.assign(words, 0);
  uint64_t* b = bits.data();
  const uint64_t seen = mark_bits(b, ids, n);
  auto clear = [&] {
    if ((size_t)n * 4 < words)
      clear_bits(b, ids, n);
    else
      std::memset(b, 0, words * sizeof(uint64_t));
  };
  clear();
  if (!seen) return -1;
  int64_t bad = -1;
  for (int64_t i = 0; i < n; ++i) {  // rare: find the first repeat
    const uint64_t w = (uint64_t)ids[i] >> 6, m = 1ull << (ids[i] & 63);
    if (b[w] & m) { bad = i; break; }
    b[w] |= m;
  }
  clear();
  return bad;
}

// Large jobs of unsorted destination ids split their duplicate check over the WorkPool's
// threads when a helper is awake: on one core it is the larger part of such a job's id pass.
// Split, it wins from about 32768 ids in an id space of 2^20 slots up; below that (fewer ids,
// or a bitmap that stays in cache) it lost on one host or both. Hence the thresholds (the
// figures: docs/design/host-id-pass.md, profiling/results/dup_split.txt).
constexpr int64_t kSplitDupMin = 32768;        // ids, with an id space of at least ...
constexpr int64_t kSplitDupMinSpace = 1 << 20;  // ... this many slots (a 128 KiB bitmap)
constexpr int64_t kSplitDupAlways = 65536;     // ids, any id space
constexpr int64_t kSplitDupMax = 1 << 18;      // ids: the buckets take 4 * kDupParts bytes per id
constexpr int kDupParts = 8;

inline bool split_dup_check(int64_t n, int64_t n_ids) {
  return n <= kSplitDupMax && (n >= kSplitDupAlways || (n >= kSplitDupMin && n_ids >= kSplitDupMinSpace)) &&
         WorkPool::instance().awake();
}

// Whether ids (in [0, n_ids)) hold a repeat, in two passes over the pool, with no word of the
// bitmap written by two threads and no merge: pass 1 (pieces of the array) buckets each id by
// its range of the id space, a power of two of >= 512 ids, so that every range owns whole cache
// lines of the bitmap; pass 2 (one range per piece) marks a range's ids from every bucket in its
// part of the bitmap, then clears that part. With the pool off it runs both passes on the caller.
inline bool has_duplicate_split(const int64_t* ids, int64_t n, int64_t n_ids) {
  if (n < 2) return false;
  int shift = 9;
  while (((int64_t)kDupParts << shift) < n_ids) ++shift;
  if (shift > 32) return first_duplicate(ids, n, n_ids) >= 0;  // offsets must fit 32 bits
  const int parts = (int)((n_ids + ((int64_t)1 << shift) - 1) >> shift);
  const int64_t pieces = std::min<int64_t>(kMaxScanPieces, (n + kScanPiece - 1) / kScanPiece);
  const int64_t per = (n + pieces - 1) / pieces;
  const size_t part_words = (size_t)1 << (shift - 6);
  // Scratch of the calling thread, kept between calls (split_dup_check bounds it to 8 MiB of
  // buckets): each (piece, range) bucket has room for a whole piece; the bitmap, 64-byte
  // aligned, stays all-zero between calls.
  thread_local std::vector<uint32_t> buckets;
  thread_local std::vector<uint64_t> bits;
  if (buckets.size() < (size_t)(pieces * parts * per)) buckets.resize((size_t)(pieces * parts * per));
  if (bits.size() < parts * part_words + 8) bits.assign(parts * part_words + 8, 0);
  struct Ctx {
    const int64_t* ids;
    int64_t n, per, pieces;
    int shift, parts;
    size_t part_words;
    uint32_t* buckets;
    uint64_t* bits;
    int64_t count[kMaxScanPieces][kDupParts];
    bool dup[kDupParts];
  } c{ids, n, per, pieces, shift, parts, part_words, buckets.data(),
      bits.data() + ((8 - ((uintptr_t)bits.data() / 8) % 8) % 8), {}, {}};
  WorkPool& pool = WorkPool::instance();
  pool.run((int)pieces, [](void* p, int k) {
    Ctx& c = *static_cast<Ctx*>(p);
    const int64_t lo = k * c.per, hi = std::min(c.n, lo + c.per);
    uint32_t* first[kDupParts];
    uint32_t* out[kDupParts];
    for (int r = 0; r < c.parts; ++r) first[r] = out[r] = c.buckets + ((size_t)k * c.parts + r) * c.per;
    const uint64_t mask = ((uint64_t)1 << c.shift) - 1;
    for (int64_t i = lo; i < hi; ++i) {
      const uint64_t v = (uint64_t)c.ids[i];
      *out[v >> c.shift]++ = (uint32_t)(v & mask);
    }
    for (int r = 0; r < c.parts; ++r) c.count[k][r] = out[r] - first[r];
  }, &c);
  pool.run(parts, [](void* p, int r) {
    Ctx& c = *static_cast<Ctx*>(p);
    uint64_t* b = c.bits + (size_t)r * c.part_words;
    uint64_t seen = 0;
    int64_t total = 0;
    for (int64_t k = 0; k < c.pieces; ++k) {
      seen |= mark_bits(b, c.buckets + ((size_t)k * c.parts + r) * c.per, c.count[k][r]);
      total += c.count[k][r];
    }
    if ((size_t)total * 4 < c.part_words) {
      for (int64_t k = 0; k < c.pieces; ++k) clear_bits(b, c.buckets + ((size_t)k * c.parts + r) * c.per, c.count[k][r]);
    } else {
      std::memset(b, 0, c.part_words * sizeof(uint64_t));
    }
    c.dup[r] = seen != 0;
  }, &c);
  for (int r = 0; r < parts; ++r)
    if (c.dup[r]) return true;
  return false;
}

// Range checks, the duplicate check on dst and run counts from a finished scan.
// Strictly increasing dst ids are duplicate-free by construction; otherwise a
// bitmap over the dst id space is used (only touched words are cleared).
inline IdCheck finish_check(const IdScan& sc, const int64_t* src, const int64_t* dst, int64_t n,
                            int64_t n_src, int64_t n_dst) {
  IdCheck r;
  if (sc.smin < 0 || sc.smax >= n_src || sc.dmin < 0 || sc.dmax >= n_dst) {
    // Pass 2 only on error: report the first offending position.
    for (int64_t i = 0; i < n; ++i) {
      if (src[i] < 0) return IdCheck{kSrcNegative, i, src[i]};
      if (src[i] >= n_src) return IdCheck{kSrcOutOfRange, i, src[i]};
      if (dst[i] < 0) return IdCheck{kDstNegative, i, dst[i]};
      if (dst[i] >= n_dst) return IdCheck{kDstOutOfRange, i, dst[i]};
    }
  }
  r.runs_src = sc.bs + 1;
  r.runs_dst = sc.bd + 1;
  r.runs_both = sc.bb + 1;
  if (sc.notinc) {
    // a helper awake (as in an engine's burst of jobs, or woken by the scan just now): split;
    // the position of a repeat is looked for only when there is one
    if (split_dup_check(n, n_dst) && !has_duplicate_split(dst, n, n_dst)) return r;
    const int64_t bad = first_duplicate(dst, n, n_dst);
    if (bad >= 0) return IdCheck{kDstDuplicate, bad, dst[bad]};
  }
  return r;
}

// Range checks on both arrays, duplicate check on dst, and run counts.
inline IdCheck check_ids(const int64_t* src, const int64_t* dst, int64_t n, int64_t n_src,
                         int64_t n_dst) {
  if (n <= 0) return IdCheck{};
  return finish_check(scan_ids(src, dst, n, nullptr), src, dst, n, n_src, n_dst);
}

// check_ids, then (only if the ids are valid) src ids to out[0, n) and dst ids to out[n, 2n).
// Two passes on purpose: memcpy's streaming stores beat the fused store-as-you-scan loop on
// large jobs (about twice as fast into a cold pinned slot: docs/design/host-id-pass.md), and a
// failed check writes nothing.
inline IdCheck check_and_stage_ids(const int64_t* src, const int64_t* dst, int64_t n, int64_t n_src,
                                   int64_t n_dst, int64_t* out) {
  if (n <= 0) return IdCheck{};
  const IdCheck r = finish_check(scan_ids(src, dst, n, nullptr), src, dst, n, n_src, n_dst);
  if (r.code == kIdsOk) {
    std::memcpy(out, src, (size_t)n * sizeof(int64_t));
    std::memcpy(out + n, dst, (size_t)n * sizeof(int64_t));
  }
  return r;
}

constexpr int64_t kMaxId32 = 0x7fffffff;

// check_ids' verdict (code, index, value, run counts) with the ids staged as int32
// (see scan_and_narrow). Needs n_src, n_dst <= kMaxId32 + 1.
inline IdCheck check_and_stage_ids32(const int64_t* src, const int64_t* dst, int64_t n, int64_t n_src,
                                     int64_t n_dst, int32_t* out) {
  if (n <= 0) return IdCheck{};
  return finish_check(scan_ids(src, dst, n, out), src, dst, n, n_src, n_dst);
}

// Writes (dst address, src address, bytes) descriptors; returns how many.
// With `coalesce`, runs where both ids advance by one become one descriptor
// (callers pass coalesce only when blocks are back to back: stride == bytes).
// Output arrays need room for n entries.
// A memory segment (e.g. one cudaHostRegister chunk of a host pool): a DMA
// must not span two of them, so runs break where an address crosses a
// multiple of `bytes` counted from `base`. bytes == 0: one segment.
struct Segments {
  uint64_t base = 0;
  uint64_t bytes = 0;
  bool same(uint64_t a, uint64_t b) const {
    return bytes == 0 || (a - base) / bytes == (b - base) / bytes;
  }
};

inline int64_t plan_dma(const int64_t* src_ids, const int64_t* dst_ids, int64_t n,
                        uint64_t src_base, uint64_t dst_base, int64_t src_stride,
                        int64_t dst_stride, int64_t block_bytes, bool coalesce, uint64_t* dsts,
                        uint64_t* srcs, uint64_t* sizes, Segments src_seg = {},
                        Segments dst_seg = {}) {
  int64_t k = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (coalesce && k >= 0 && src_ids[i] == src_ids[i - 1] + 1 && dst_ids[i] == dst_ids[i - 1] + 1 &&
        src_seg.same(srcs[k], srcs[k] + sizes[k] + block_bytes - 1) &&
        dst_seg.same(dsts[k], dsts[k] + sizes[k] + block_bytes - 1)) {
      sizes[k] += (uint64_t)block_bytes;
      continue;
    }
    ++k;
    srcs[k] = src_base + (uint64_t)src_ids[i] * (uint64_t)src_stride;
    dsts[k] = dst_base + (uint64_t)dst_ids[i] * (uint64_t)dst_stride;
    sizes[k] = (uint64_t)block_bytes;
  }
  return k + 1;
}

// Descriptors for moving fragments between per-layer tensors and unified
// blocks. table is int64[4][F] (ptr, block stride, bytes, unified offset).
// A descriptor that continues the previous one on both sides is merged into
// it, which turns whole-block layouts and runs of consecutive blocks into
// single descriptors. Output arrays need room for n * F entries.
inline int64_t plan_fragments(const int64_t* table, int64_t num_frags, uint64_t unified,
                              int64_t unified_stride, const int64_t* block_ids,
                              const int64_t* slot_ids, int64_t n, bool to_unified,
                              uint64_t* dsts, uint64_t* srcs, uint64_t* sizes,
                              Segments unified_seg = {}) {
  const int64_t* fp = table;
  const int64_t* fs = table + num_frags;
  const int64_t* fb = table + 2 * num_frags;
  const int64_t* fo = table + 3 * num_frags;
  int64_t k = -1;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t ub = unified + (uint64_t)slot_ids[i] * (uint64_t)unified_stride;
    for (int64_t f = 0; f < num_frags; ++f) {
      const uint64_t a = (uint64_t)fp[f] + (uint64_t)block_ids[i] * (uint64_t)fs[f];
      const uint64_t u = ub + (uint64_t)fo[f];
      const uint64_t s = to_unified ? a : u, d = to_unified ? u : a;
      const uint64_t sz = (uint64_t)fb[f];
      const uint64_t uk = to_unified ? dsts[k < 0 ? 0 : k] : srcs[k < 0 ? 0 : k];
      if (k >= 0 && srcs[k] + sizes[k] == s && dsts[k] + sizes[k] == d &&
          unified_seg.same(uk, uk + sizes[k] + sz - 1)) {
        sizes[k] += sz;
        continue;
      }
      ++k;
      srcs[k] = s;
      dsts[k] = d;
      sizes[k] = sz;
    }
  }
  return k + 1;
}

}  // namespace kvo
