// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// K1 resolve_residency (spec 5.1): the fused decode-row resolver.
//
// Grid: one CTA of 1024 threads per batch row. A union group is a maximal run
// of consecutive rows with the same request (the q MTP verification rows of a
// request); the CTA of its first row does all the work for the group and the
// other CTAs of the group exit at once. Groups touch disjoint state slots, so
// CTAs never race on dgi/lru.
//
// A group takes six block barriers (B0..B5); every phase between two of them
// is one pass:
//   start    row_req, the first top-k entries and their table cells are
//            loaded before anything waits; smem init; group size.   -> B0
//   1 classify  entries -> invalid | resident (final id written now) |
//            pending: the key goes into the smem hash (an atomic minimum
//            keeps its first flat index), a new key also into the Bloom
//            filter and the union count. Each entry's code (its key's hash
//            slot, or invalid/resident) is kept per flat index.      -> B1
//            Nothing pending: count, write, stop; dgi/lru are never read
//            (INV-34).
//   2 lru scan  each warp owns a contiguous run of LRU positions: filter
//            test, dgi lookup, first position per key by CAS minimum; one
//            ballot word per 32 positions ("found").                  -> B2
//            (A key found twice, only in corrupted state, is flagged; then
//            the words are recomputed with the earliest-position rule, one
//            extra barrier.)
//   3 reorder   hit ranks from the words (each warp sums the popcounts
//            before its run: no block scan), new lru row E[|M|:] ++ E[:|M|]
//            ++ Hl in smem; one ballot word per 32 flat entries for "first
//            reference of a missed key" (U order = flat order).       -> B3
//   4 assign    miss m (rank in U order) takes E[m] (tripwire 2), writes
//            dgi and plan entry m; the key's hash value then holds its
//            slot and the miss bit.                                  -> B4
//   5 emit   pending entries get hot-row ids (a hit's slot is the old lru
//            row at its first position), miss_mask, resolved_g; per-row
//            valid counts.                                           -> B5
//            new lru row, valid_counts, stats.
// Shared memory holds only the arrays of the normative layout (see
// resolver_smem_layout); their roles in this kernel are listed at Smem.
//
// Why this shape (results/kernels/README.md has the measurements): the
// resolver is latency and barrier bound (one CTA per request, 64 of 132 SMs
// busy at batch 64), so the design minimises dependent global loads, block
// barriers and block-wide scans rather than bytes. Hash lookups after a
// barrier use plain shared loads (only inserts need volatile ones).
// Measured per phase (run 5, batch 64, all-hit, median CTA): start 1.7 us,
// classify 9.5, scan 5.5, reorder 1.8, assign 0.6, emit 1.2: the hash
// inserts and the hit lookups, not the passes or barriers, are what is
// left. Run 6 showed it is not the number of shared atomics: taking 4,000
// of the 6,300 classify atomics and all 2,048 scan CASes out (the
// SCAN_PLAIN / FIRST_PLAIN / MISS_FILTER=0 switches below) left all-hit
// within -0.7..+0.8 us, while classify still varies 7.5-14 us between CTAs
// doing the same 2,048 inserts (the launch waits for the slowest CTA).
//
// Tuning switches (defaults chosen by measurement on an H200, runs 5 and 6
// in results/kernels/README.md):
//   HISPARSE_HASH_HIGH    home slot = the spec's product mod Hs (0), or the
//                         high bits of the product scaled to Hs (1: measured
//                         equal, probe chains are short either way)
//   HISPARSE_PROBE_VEC4   probe four slots per 16-byte shared load
//   HISPARSE_MISS_FILTER  1: Bloom filter (2 bits per key in one word, 32
//                         bits per union entry, atomic OR) in front of the
//                         dgi lookups; 0: none (all-hit -0.7 us, 10% misses
//                         +2.8 us, 100% misses +9 us); 2: byte flags set by
//                         plain stores (~22% false positives; slower)
//   HISPARSE_SCAN_PLAIN   1: the scan stores a hit's position with a plain
//                         16-bit store (no CAS); a key at two positions
//                         (corrupted state) is caught after B3 and resolved
//                         by a CAS rescan (measured +0.5 us, default 0)
//   HISPARSE_FIRST_PLAIN  1: the creating thread stores a key's first flat
//                         index plainly; keys referenced twice merge after
//                         B1 (one extra barrier then; measured no faster,
//                         default 0)
//   HISPARSE_MIN_BLOCKS   CTAs per SM the register allocation must allow
//                         (2 caps registers at 32: batch > #SMs in one wave)
//   HISPARSE_PHASE_CLOCK  instrumentation only: thread 0 of every CTA prints
//                         the clock64() cycles spent in each phase
#include "hisparse_common.cuh"
#include "ops.h"

#include <atomic>

#ifndef HISPARSE_HASH_HIGH
#define HISPARSE_HASH_HIGH 0
#endif
#ifndef HISPARSE_PROBE_VEC4
#define HISPARSE_PROBE_VEC4 1
#endif
#ifndef HISPARSE_MISS_FILTER
#define HISPARSE_MISS_FILTER 1
#endif
#ifndef HISPARSE_SCAN_PLAIN
#define HISPARSE_SCAN_PLAIN 0
#endif
#ifndef HISPARSE_FIRST_PLAIN
#define HISPARSE_FIRST_PLAIN 0
#endif
#ifndef HISPARSE_MIN_BLOCKS
#define HISPARSE_MIN_BLOCKS 1
#endif
#ifndef HISPARSE_PHASE_CLOCK
#define HISPARSE_PHASE_CLOCK 0
#endif
#if HISPARSE_PHASE_CLOCK
#include <cstdio>
#endif

namespace hisparse {
namespace {

constexpr int32_t kEmptyKey = -1;
// Per flat entry code (union slots array): the hash slot of a pending
// entry's key (Hs <= 49,152), or one of these.
constexpr uint32_t kCodeResident = 0xFFFEu;  // resident, id >= 0
constexpr uint32_t kCodeInvalid = 0xFFFFu;   // out_rows = -1
// Hash value of a key: bits 31..16 its first-hit LRU position during the
// scan, then its slot (kNone16: none yet / tripped); bit 15 "loaded by this
// call"; bits 14..0 the first flat index of the key (flat < Umax <= 32768).
constexpr uint32_t kNone16 = 0xFFFFu;
constexpr uint32_t kMissBit = 0x8000u;
constexpr uint32_t kFirstMask = 0x7FFFu;
constexpr int kEntryBatch = 2;  // top-k entries per thread per load batch
constexpr int kLruBatch = 4;    // LRU positions per lane per load batch

enum Counter : int {
  kCtrGroupRows = 0,
  kCtrUnion,  // |U|
  kCtrTrips,  // tripped misses
  kCtrDup,    // a key was found at two LRU positions (corrupted state)
  kCtrMissKeys,  // HISPARSE_SCAN_PLAIN: keys without a hit (entry ballot)
  kCtrDupRefs,   // HISPARSE_FIRST_PLAIN: a key is referenced twice
};

struct ResolveArgs {
  const int32_t* topk;
  const int32_t* row_req;
  const int32_t* seq_lens;
  const int32_t* req_state;
  const int32_t* src_bt;
  const int32_t* res_bt;
  const int32_t* hot_bt;
  int32_t* dgi;
  int16_t* lru;
  int32_t* out_rows;
  int32_t* valid_counts;
  int32_t* plan_src;
  int32_t* plan_dst;
  int32_t* plan_count;
  int32_t* miss_mask;           // optional (nullptr)
  int32_t* resolved_g;          // optional (nullptr)
  unsigned long long* stats;    // optional (nullptr)
  int64_t stats_len;
  int64_t top_k;                // K
  int64_t num_reqs;             // Rq
  int64_t src_width;            // Mh
  int64_t res_width;            // Mr
  int64_t hot_width;
  int64_t num_states;           // S
  int64_t host_rows;
  int32_t attn_stride;          // Sa (< 2^31: INV-14 check at launch)
  int64_t max_query_len;        // q
  uint32_t gpu_blocks_m1;       // N_gpu - 1: valid GPU block ids are [1, N_gpu)
  int32_t hot_size;             // H
  int32_t block_size;           // B
  int32_t block_shift;          // log2(B) when B is a power of two, else -1
  ResolverSmemLayout layout;
};

// The normative arrays (hisparse_common.cuh) and what this kernel keeps in
// them:
//   hash_keys    int32[Hs]   key per hash slot, -1 = empty
//   hash_values  uint32[Hs]  per key: position/slot | miss bit | first flat
//   filter       int32[Umax] (union keys) Bloom filter until the scan ends,
//                then the per-row valid counts
//   words_pos    int32[C]    (scan A) one "hit" bit per LRU position
//   words_ent    int32[C]    (scan B) one "first reference of a miss" bit
//                per flat entry
//   entry_code   int16[Umax] (union slots) code per flat entry
//   lru_out      int16[H]    the new lru row
struct Smem {
  int32_t* hash_keys;
  uint32_t* hash_values;
  uint32_t* filter;
  unsigned* words_pos;
  unsigned* words_ent;
  int32_t* ctr;
  uint16_t* entry_code;
  int16_t* lru_out;
  int32_t hash_size;   // Hs
  int32_t union_max;   // Umax (filter words)
};

struct Group {
  int64_t row0;  // first batch row
  int32_t n;     // rows in the group (<= q)
  int32_t req;
  int32_t state;
  int32_t seq_len;
};

__device__ Smem carve_smem(unsigned char* base, const ResolverSmemLayout& l) {
  Smem s;
  s.hash_keys = reinterpret_cast<int32_t*>(base + l.hash_keys);
  s.hash_values = reinterpret_cast<uint32_t*>(base + l.hash_values);
  s.filter = reinterpret_cast<uint32_t*>(base + l.union_keys);
  s.words_pos = reinterpret_cast<unsigned*>(base + l.scan_a);
  s.words_ent = reinterpret_cast<unsigned*>(base + l.scan_b);
  s.ctr = reinterpret_cast<int32_t*>(base + l.counters);
  s.entry_code = reinterpret_cast<uint16_t*>(base + l.union_slots);
  s.lru_out = reinterpret_cast<int16_t*>(base + l.lru_out);
  s.hash_size = static_cast<int32_t>(l.hash_size);
  s.union_max = static_cast<int32_t>(l.union_max);
  return s;
}

// Knuth multiplicative hashing with linear probing (spec 5.1): the spec's
// (key*2654435761 mod 2^32) mod Hs by default; HISPARSE_HASH_HIGH=1 takes
// the high bits of the product instead (one multiply-high, measured no
// faster). Only the table layout depends on it, never an output.
__device__ __forceinline__ int hash_home(int32_t key, int32_t size) {
  const uint32_t x = static_cast<uint32_t>(key) * 2654435761u;
#if HISPARSE_HASH_HIGH
  return static_cast<int>(__umulhi(x, static_cast<uint32_t>(size)));
#else
  return static_cast<int>(x % static_cast<uint32_t>(size));
#endif
}

__device__ __forceinline__ int next_slot(int h, int size) {
  return h + 1 == size ? 0 : h + 1;
}

#if HISPARSE_PROBE_VEC4
// Four consecutive keys of the table (Hs is a multiple of 32, so an aligned
// group never wraps).
template <bool kVolatile>
__device__ __forceinline__ int4 load_keys4(const int32_t* keys, int base) {
  if (kVolatile) {  // inserts by other threads must be observed
    int4 v;
    const unsigned addr =
        static_cast<unsigned>(__cvta_generic_to_shared(keys + base));
    asm volatile("ld.volatile.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr));
    return v;
  }
  return *reinterpret_cast<const int4*>(keys + base);
}

// First slot at or after h (in probe order) holding `key` or empty.
template <bool kVolatile>
__device__ __forceinline__ int probe(const Smem& s, int32_t key, int h) {
  int base = h & ~3;
  int first = h & 3;
  while (true) {
    const int4 v = load_keys4<kVolatile>(s.hash_keys, base);
    const int32_t k[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j >= first && (k[j] == key || k[j] == kEmptyKey)) return base + j;
    }
    first = 0;
    base = (base + 4 == s.hash_size) ? 0 : base + 4;
  }
}
#else
// First slot at or after h (in probe order) holding `key` or empty.
template <bool kVolatile>
__device__ __forceinline__ int probe(const Smem& s, int32_t key, int h) {
  while (true) {
    const int32_t k =
        kVolatile ? *reinterpret_cast<const volatile int32_t*>(s.hash_keys + h)
                  : s.hash_keys[h];
    if (k == key || k == kEmptyKey) return h;
    h = next_slot(h, s.hash_size);
  }
}
#endif

// Insert (phase 1, concurrent): returns the key's slot; `created` is set for
// exactly one thread per distinct key.
__device__ __forceinline__ int hash_insert(const Smem& s, int32_t key,
                                           bool& created) {
  int h = hash_home(key, s.hash_size);
  while (true) {
    h = probe<true>(s, key, h);
    const int32_t prev = atomicCAS(&s.hash_keys[h], kEmptyKey, key);
    if (prev == kEmptyKey) {
      created = true;
      return h;
    }
    if (prev == key) return h;
    h = next_slot(h, s.hash_size);  // lost a race for slot h
  }
}

// Lookup after the inserts' barrier: plain loads. The table never fills
// (|U| <= Umax < Hs), so a probe always ends.
#if HISPARSE_SCAN_PLAIN && HISPARSE_PROBE_VEC4
// The probe's own loads decide found / not found (no second read of the
// slot's key).
__device__ __forceinline__ int hash_find(const Smem& s, int32_t key) {
  const int h = hash_home(key, s.hash_size);
  int base = h & ~3;
  int first = h & 3;
  while (true) {
    const int4 v = load_keys4<false>(s.hash_keys, base);
    const int32_t k[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j >= first && k[j] == key) return base + j;
      if (j >= first && k[j] == kEmptyKey) return -1;
    }
    first = 0;
    base = (base + 4 == s.hash_size) ? 0 : base + 4;
  }
}
#else
__device__ __forceinline__ int hash_find(const Smem& s, int32_t key) {
  const int h = probe<false>(s, key, hash_home(key, s.hash_size));
  return s.hash_keys[h] == key ? h : -1;
}
#endif

#if HISPARSE_MISS_FILTER == 2
// Byte-flag filter over the union keys: one byte of the 4*Umax-byte array
// per key, set with a plain store (every writer stores the same 1, so no
// atomic is needed): ~22% false positives at |U| = Umax.
__device__ __forceinline__ int filter_byte(const Smem& s, int32_t key) {
  const uint32_t x = static_cast<uint32_t>(key) * 0x9E3779B1u;
  return static_cast<int>(
      __umulhi(x, 4u * static_cast<uint32_t>(s.union_max)));
}
#elif HISPARSE_MISS_FILTER
// Bloom filter over the union keys: one word of the Umax-word array per key
// (high bits of a second multiplicative hash), two bits in it. 32 bits per
// possible union entry: ~0.7% false positives at |U| = Umax.
struct FilterProbe {
  int word;
  uint32_t mask;
};

__device__ __forceinline__ FilterProbe filter_probe(const Smem& s,
                                                    int32_t key) {
  const uint32_t x = static_cast<uint32_t>(key) * 0x9E3779B1u;
  const uint32_t y = static_cast<uint32_t>(key) * 0x85EBCA77u;
  FilterProbe f;
  f.word = static_cast<int>(__umulhi(x, static_cast<uint32_t>(s.union_max)));
  f.mask = (1u << (y >> 27)) | (1u << ((y >> 22) & 31u));
  return f;
}
#endif

__device__ __forceinline__ uint32_t div_block(uint32_t x,
                                              const ResolveArgs& a) {
  return a.block_shift >= 0 ? x >> a.block_shift
                            : x / static_cast<uint32_t>(a.block_size);
}

__device__ __forceinline__ uint32_t mod_block(uint32_t x,
                                              const ResolveArgs& a) {
  return a.block_shift >= 0 ? x & static_cast<uint32_t>(a.block_size - 1)
                            : x % static_cast<uint32_t>(a.block_size);
}

// F18: the row id block*stride + offset of a GPU block (resident or hot
// table; stride Sa for attention ids, B for plan rows), or -1 when the
// block id is outside [1, N_gpu) (0 is the null block) or the id is not a
// non-negative int32. The product is formed in 64 bits (one widening
// multiply) and range checked before the cast, so it never wraps into a
// plausible row. The multiply is unsigned: a block that passes the range
// test is positive, so its unsigned and signed products agree. With the
// launch check N_gpu * max(Sa, B) < 2^31 (INV-14) a valid block always
// fits; the 64-bit test guards a bypassed check. `&` instead of `&&` keeps
// the compiler from branching.
__device__ __forceinline__ int32_t checked_row(int32_t block, uint32_t offset,
                                               int32_t stride,
                                               const ResolveArgs& a) {
  const uint32_t b = static_cast<uint32_t>(block);
  const uint64_t id =
      static_cast<uint64_t>(b) * static_cast<uint32_t>(stride) + offset;
  const bool ok = (b - 1u < a.gpu_blocks_m1) &
                  (id <= static_cast<uint64_t>(INT32_MAX));
  return ok ? static_cast<int32_t>(id) : -1;
}

// Sum over the block of popc(words[i]) for i < upto and for all i < nwords,
// computed by one warp on its own (every warp calls it for its own `upto`).
__device__ __forceinline__ void warp_word_sums(const unsigned* words,
                                               int nwords, int upto, int lane,
                                               int& before, int& total) {
  int b = 0, t = 0;
  for (int i = lane; i < nwords; i += 32) {
    const int c = __popc(words[i]);
    t += c;
    b += i < upto ? c : 0;
  }
  before = __reduce_add_sync(0xffffffffu, b);
  total = __reduce_add_sync(0xffffffffu, t);
}

// Step 0 (INV-33): -1 everywhere, zero counts, no state touched.
__device__ void write_padding(const ResolveArgs& a, int64_t row0, int64_t n) {
  const int64_t entries = n * a.top_k;
  const int64_t e0 = row0 * a.top_k;
  for (int64_t f = threadIdx.x; f < entries; f += kResolveThreads) {
    a.out_rows[e0 + f] = -1;
    if (a.miss_mask != nullptr) a.miss_mask[e0 + f] = 0;
    if (a.resolved_g != nullptr) a.resolved_g[e0 + f] = -1;
  }
  for (int64_t i = threadIdx.x; i < n; i += kResolveThreads) {
    a.valid_counts[row0 + i] = 0;
    a.plan_count[row0 + i] = 0;
  }
}

// One load batch of phase 1: kEntryBatch top-k entries of one row per
// thread and both table cells of each, all loads in flight together. The
// table cells are read for any p >= 0 (range checked against the tables);
// seq_len is applied afterwards, so these loads do not wait for it.
struct EntryBatch {
  int32_t p[kEntryBatch];
  int32_t rb[kEntryBatch];
  int32_t sb[kEntryBatch];
};

__device__ __forceinline__ void load_entries(const ResolveArgs& a, int32_t req,
                                             int64_t row, int k0,
                                             EntryBatch& b) {
  const int K = static_cast<int>(a.top_k);
  const int32_t* src_row = a.src_bt + req * a.src_width;
  const int32_t* res_row = a.res_bt + req * a.res_width;
#pragma unroll
  for (int j = 0; j < kEntryBatch; ++j) {
    const int k = k0 + j * kResolveThreads + threadIdx.x;
    b.p[j] = k < K ? a.topk[row * a.top_k + k] : -1;
  }
#pragma unroll
  for (int j = 0; j < kEntryBatch; ++j) {
    const uint32_t page =
        b.p[j] >= 0 ? div_block(static_cast<uint32_t>(b.p[j]), a) : UINT32_MAX;
    b.rb[j] = page < a.res_width ? res_row[page] : 0;
    b.sb[j] = page < a.src_width ? src_row[page] : 0;
  }
}

// Phase 1. Returns (block-uniformly) whether any entry is pending.
__device__ bool classify_entries(const ResolveArgs& a, const Group& g,
                                 const Smem& s, const EntryBatch& first) {
  const int K = static_cast<int>(a.top_k);
  bool pending = false;
  int created_keys = 0;
  int res_trips = 0;  // resident-table entries with an invalid block id
#if HISPARSE_FIRST_PLAIN
  bool dup_refs = false;
#endif
  for (int i = 0; i < g.n; ++i) {
    const int64_t e0 = (g.row0 + i) * a.top_k;
    for (int k0 = 0; k0 < K; k0 += kEntryBatch * kResolveThreads) {
      EntryBatch b;
      if (i == 0 && k0 == 0) {
        b = first;  // loaded before the start barrier
      } else {
        load_entries(a, g.req, g.row0 + i, k0, b);
      }
#pragma unroll
      for (int j = 0; j < kEntryBatch; ++j) {
        const int k = k0 + j * kResolveThreads + threadIdx.x;
        if (k >= K) continue;
        const int f = i * K + k;
        const int32_t p = b.p[j];
        uint32_t code = kCodeInvalid;
        int32_t out = -1;
        if (p >= 0 && p < g.seq_len) {
          const uint32_t off = mod_block(static_cast<uint32_t>(p), a);
          if (b.rb[j] != 0) {
            // F18: a resident id outside [1, N_gpu) (or whose id does not
            // fit int32) is tripped: -1, and never pending either (the
            // page's host copy need not be current while it is resident).
            out = checked_row(b.rb[j], off, a.attn_stride, a);
            code = out >= 0 ? kCodeResident : kCodeInvalid;
            res_trips += out < 0;
          } else {
            const int64_t key =
                static_cast<int64_t>(b.sb[j]) * a.block_size + off;
            if (b.sb[j] > 0 && key < a.host_rows) {
              bool created = false;
              const int h = hash_insert(s, static_cast<int32_t>(key), created);
#if HISPARSE_FIRST_PLAIN
              // The creating thread stores the first flat index plainly;
              // other references of the key merge after the barrier
              // (merge_first_refs), so a key referenced once costs no
              // atomic here.
              if (created) {
                s.hash_values[h] = (kNone16 << 16) | f;
              } else {
                dup_refs = true;
              }
#else
              atomicMin(&s.hash_values[h], (kNone16 << 16) | f);
#endif
              code = static_cast<uint32_t>(h);
              pending = true;
              if (created) {
                ++created_keys;
#if HISPARSE_MISS_FILTER == 2
                reinterpret_cast<unsigned char*>(
                    s.filter)[filter_byte(s, static_cast<int32_t>(key))] = 1;
#elif HISPARSE_MISS_FILTER
                const FilterProbe fp =
                    filter_probe(s, static_cast<int32_t>(key));
                atomicOr(&s.filter[fp.word], fp.mask);
#endif
              }
            }
          }
        }
        s.entry_code[f] = static_cast<uint16_t>(code);
        if (code >= kCodeResident) {  // final now; pending ones in phase 5
          a.out_rows[e0 + k] = out;
          if (a.miss_mask != nullptr) a.miss_mask[e0 + k] = 0;
          if (a.resolved_g != nullptr) a.resolved_g[e0 + k] = -1;
        }
      }
    }
  }
  const int w = __reduce_add_sync(0xffffffffu, created_keys);
  if ((threadIdx.x & 31) == 0 && w != 0) atomicAdd(&s.ctr[kCtrUnion], w);
  if (__any_sync(0xffffffffu, res_trips != 0)) {  // corrupted tables only
    const int t = __reduce_add_sync(0xffffffffu, res_trips);
    if ((threadIdx.x & 31) == 0) atomicAdd(&s.ctr[kCtrTrips], t);
  }
#if HISPARSE_FIRST_PLAIN
  if (__ballot_sync(0xffffffffu, dup_refs) != 0 && (threadIdx.x & 31) == 0) {
    atomicOr(&s.ctr[kCtrDupRefs], 1);
  }
#endif
  return __syncthreads_or(pending) != 0;
}

#if HISPARSE_FIRST_PLAIN
// After B1, only when some key is referenced twice (MTP unions, repeated
// positions): a key's value holds its creator's flat index, which need not
// be the smallest; every reference with a smaller index lowers it. Nothing
// else touches the values in this pass; a stale read only costs an extra
// atomic (the value only decreases). Ends with a barrier, so the scan's
// writes to the same words never meet these atomics.
__device__ void merge_first_refs(const ResolveArgs& a, const Group& g,
                                 const Smem& s) {
  const int K = static_cast<int>(a.top_k);
  const int entries = g.n * K;
  for (int f = threadIdx.x; f < entries; f += kResolveThreads) {
    const uint32_t code = s.entry_code[f];
    if (code >= kCodeResident) continue;
    const uint32_t v =
        *reinterpret_cast<volatile uint32_t*>(&s.hash_values[code]);
    if ((v & kFirstMask) > static_cast<uint32_t>(f)) {
      atomicMin(&s.hash_values[code], (kNone16 << 16) | f);
    }
  }
  __syncthreads();
}
#endif

// Valid entries of a group with nothing pending, per row into filter[i]
// (still all zero: nothing was inserted). Ends with a barrier.
__device__ void count_resident(const ResolveArgs& a, const Group& g,
                               const Smem& s) {
  const int K = static_cast<int>(a.top_k);
  for (int i = 0; i < g.n; ++i) {
    int c = 0;
    for (int k = threadIdx.x; k < K; k += kResolveThreads) {
      c += s.entry_code[i * K + k] == kCodeResident;
    }
    const int w = __reduce_add_sync(0xffffffffu, c);
    if ((threadIdx.x & 31) == 0 && w != 0) {
      atomicAdd(&s.filter[i], static_cast<uint32_t>(w));
    }
  }
  __syncthreads();
}

// Record a hit of the key in hash slot h at LRU position p: the smallest
// position wins (CAS minimum on the high half). Returns true when the key
// was already found elsewhere (corrupted state: a key in two slots).
__device__ __forceinline__ bool record_hit(const Smem& s, int h, int p) {
  uint32_t old = *reinterpret_cast<volatile uint32_t*>(&s.hash_values[h]);
  bool dup = (old >> 16) != kNone16;
  const uint32_t pos = static_cast<uint32_t>(p);
  while ((old >> 16) > pos) {
    const uint32_t prev =
        atomicCAS(&s.hash_values[h], old, (pos << 16) | (old & 0xFFFFu));
    if (prev == old) break;
    old = prev;
    dup = dup || (old >> 16) != kNone16;
  }
  return dup;
}

// Positions of one warp: a contiguous run of `rounds` words (32 positions
// each) starting at word warp*rounds; a word exists only below H.
struct WarpRun {
  int rounds;     // words per warp
  int word0;      // first word of this warp
  int nwords;     // words in the whole array
};

__device__ __forceinline__ WarpRun warp_run(int count, int warp) {
  WarpRun r;
  r.nwords = static_cast<int>(ceil_div(count, 32));
  r.rounds = static_cast<int>(ceil_div(r.nwords, kResolveWarps));
  r.word0 = warp * r.rounds;
  return r;
}

// Phase 2. words_pos bit p = a union key was found at position p (tripwire
// 1: a slot outside [0, H) is evictable and dgi is not read); the key's
// hash value holds the smallest such position.
__device__ void scan_lru(const ResolveArgs& a, const Group& g,
                         const Smem& s) {
  const int lane = threadIdx.x & 31;
  const int32_t H = a.hot_size;
  const int16_t* lru_row = a.lru + static_cast<int64_t>(g.state) * H;
  const int32_t* dgi_row = a.dgi + static_cast<int64_t>(g.state) * H;
  const WarpRun run = warp_run(H, threadIdx.x >> 5);
#if !HISPARSE_SCAN_PLAIN
  bool dup = false;
#endif
  for (int j0 = 0; j0 < run.rounds; j0 += kLruBatch) {
    int slot[kLruBatch];
    int32_t cached[kLruBatch];
#pragma unroll
    for (int j = 0; j < kLruBatch; ++j) {
      const int p = (run.word0 + j0 + j) * 32 + lane;
      slot[j] = (j0 + j < run.rounds && p < H) ? lru_row[p] : -1;
    }
#pragma unroll
    for (int j = 0; j < kLruBatch; ++j) {
      cached[j] = slot[j] >= 0 && slot[j] < H ? dgi_row[slot[j]] : -1;
    }
#pragma unroll
    for (int j = 0; j < kLruBatch; ++j) {
      if (j0 + j >= run.rounds) break;  // warp-uniform
      const int pb = (run.word0 + j0 + j) * 32;
      bool found = false;
      bool look = cached[j] >= 0;
#if HISPARSE_MISS_FILTER == 2
      if (look) {
        look = reinterpret_cast<const unsigned char*>(
                   s.filter)[filter_byte(s, cached[j])] != 0;
      }
#elif HISPARSE_MISS_FILTER
      if (look) {
        const FilterProbe fp = filter_probe(s, cached[j]);
        look = (s.filter[fp.word] & fp.mask) == fp.mask;
      }
#endif
      if (look) {
        const int h = hash_find(s, cached[j]);
        if (h >= 0) {
          found = true;
#if HISPARSE_SCAN_PLAIN
          // Plain store of the position into the high half of the key's
          // value. Under valid state a key sits at one position, so this is
          // its only writer; a key at two positions (corrupted state) is
          // caught after B3 (hit and miss counts disagree) and then
          // resolved by fix_first_hits with the earliest-position rule.
          reinterpret_cast<uint16_t*>(&s.hash_values[h])[1] =
              static_cast<uint16_t>(pb + lane);
#else
          dup = record_hit(s, h, pb + lane) || dup;
#endif
        }
      }
      const unsigned bits = __ballot_sync(0xffffffffu, found);
      if (lane == 0 && pb < H) s.words_pos[pb >> 5] = bits;
    }
  }
#if !HISPARSE_SCAN_PLAIN
  if (dup) atomicOr(&s.ctr[kCtrDup], 1);
#endif
}

// Corrupted state only (a key held by two slots): a position is a hit only
// if it is its key's smallest position. Recomputes words_pos, then a barrier.
__device__ void rescan_first_hits(const ResolveArgs& a, const Group& g,
                                  const Smem& s) {
  const int lane = threadIdx.x & 31;
  const int32_t H = a.hot_size;
  const int16_t* lru_row = a.lru + static_cast<int64_t>(g.state) * H;
  const int32_t* dgi_row = a.dgi + static_cast<int64_t>(g.state) * H;
  const WarpRun run = warp_run(H, threadIdx.x >> 5);
  for (int j = 0; j < run.rounds; ++j) {
    const int pb = (run.word0 + j) * 32;
    const int p = pb + lane;
    bool hit = false;
    if (p < H) {
      const int slot = lru_row[p];
      if (slot >= 0 && slot < H) {
        const int32_t c = dgi_row[slot];
        if (c >= 0) {
          const int h = hash_find(s, c);
          hit = h >= 0 && (s.hash_values[h] >> 16) == static_cast<uint32_t>(p);
        }
      }
    }
    const unsigned bits = __ballot_sync(0xffffffffu, hit);
    if (lane == 0 && pb < H) s.words_pos[pb >> 5] = bits;
  }
  __syncthreads();
}

#if HISPARSE_SCAN_PLAIN
// Corrupted state only, after B3: some key was found at two positions (the
// hit and miss counts disagree), and the scan's plain stores left any one of
// its positions. Every found position now lowers its key's position by CAS
// minimum, then words_pos is recomputed with the earliest-position rule
// (spec 5.1 step 3); the caller redoes the reorder. Two barriers.
__device__ void fix_first_hits(const ResolveArgs& a, const Group& g,
                               const Smem& s) {
  const int lane = threadIdx.x & 31;
  const int32_t H = a.hot_size;
  const int16_t* lru_row = a.lru + static_cast<int64_t>(g.state) * H;
  const int32_t* dgi_row = a.dgi + static_cast<int64_t>(g.state) * H;
  const WarpRun run = warp_run(H, threadIdx.x >> 5);
  for (int j = 0; j < run.rounds; ++j) {
    const int pb = (run.word0 + j) * 32;
    const int p = pb + lane;
    if (pb >= H) break;  // warp-uniform
    if (p < H && ((s.words_pos[pb >> 5] >> lane) & 1u)) {
      const int slot = lru_row[p];
      if (slot >= 0 && slot < H) {
        const int32_t c = dgi_row[slot];
        const int h = c >= 0 ? hash_find(s, c) : -1;
        if (h >= 0) record_hit(s, h, p);
      }
    }
  }
  __syncthreads();
  // Every thread has read the count that sent it here; the redone reorder
  // counts again (after rescan_first_hits' barrier).
  if (threadIdx.x == 0) s.ctr[kCtrMissKeys] = 0;
  rescan_first_hits(a, g, s);
}
#endif

struct Totals {
  int n_union;
  int n_hits;
  int n_miss;
  int n_evict;
};

// Phase 3 (INV-35). Evictable of rank i goes to i - |M| (untouched) or to
// |E| - |M| + i (refilled), hit of rank j to |E| + j. Then words_ent bit f =
// flat entry f is the first reference of a key without a hit.
__device__ Totals reorder_lru(const ResolveArgs& a, const Group& g,
                              const Smem& s) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int32_t H = a.hot_size;
  const int16_t* lru_row = a.lru + static_cast<int64_t>(g.state) * H;
  const WarpRun run = warp_run(H, warp);
  int hits_before;
  Totals t;
  warp_word_sums(s.words_pos, run.nwords, run.word0, lane, hits_before,
                 t.n_hits);
  t.n_union = s.ctr[kCtrUnion];
  t.n_miss = t.n_union - t.n_hits;
  t.n_evict = H - t.n_hits;
  int carry = hits_before;
  for (int j0 = 0; j0 < run.rounds; j0 += kLruBatch) {
    int16_t slot[kLruBatch];
#pragma unroll
    for (int j = 0; j < kLruBatch; ++j) {
      const int p = (run.word0 + j0 + j) * 32 + lane;
      slot[j] = (j0 + j < run.rounds && p < H) ? lru_row[p] : 0;
    }
#pragma unroll
    for (int j = 0; j < kLruBatch; ++j) {
      if (j0 + j >= run.rounds) break;  // warp-uniform
      const int pb = (run.word0 + j0 + j) * 32;
      if (pb >= H) break;
      const unsigned word = s.words_pos[pb >> 5];
      const int p = pb + lane;
      if (p < H) {
        const int hit_rank = carry + __popc(word & lane_mask_lt(lane));
        int dst;
        if ((word >> lane) & 1u) {
          dst = t.n_evict + hit_rank;
        } else {
          const int ev_rank = p - hit_rank;
          dst = ev_rank >= t.n_miss ? ev_rank - t.n_miss
                                    : t.n_evict - t.n_miss + ev_rank;
        }
        s.lru_out[dst] = slot[j];
      }
      carry += __popc(word);
    }
  }

  const int entries = g.n * static_cast<int>(a.top_k);
  const WarpRun er = warp_run(entries, warp);
#if HISPARSE_SCAN_PLAIN
  int miss_keys = 0;
#endif
  for (int j = 0; j < er.rounds; ++j) {
    const int fb = (er.word0 + j) * 32;
    if (fb >= entries) break;  // warp-uniform
    const int f = fb + lane;
    bool first_miss = false;
    if (f < entries) {
      const uint32_t code = s.entry_code[f];
      if (code < kCodeResident) {
        const uint32_t v = s.hash_values[code];
        first_miss = (v & kFirstMask) == static_cast<uint32_t>(f) &&
                     (v >> 16) == kNone16;
      }
    }
    const unsigned bits = __ballot_sync(0xffffffffu, first_miss);
    if (lane == 0) s.words_ent[fb >> 5] = bits;
#if HISPARSE_SCAN_PLAIN
    miss_keys += __popc(bits);
#endif
  }
#if HISPARSE_SCAN_PLAIN
  // Keys without a hit: with hits + misses = |U| every found key was found
  // at exactly one position (checked after B3).
  if (lane == 0 && miss_keys != 0) atomicAdd(&s.ctr[kCtrMissKeys], miss_keys);
#endif
  // The filter is dead: its first n words become the per-row valid counts.
  for (int i = threadIdx.x; i < g.n; i += kResolveThreads) s.filter[i] = 0;
  return t;
}

// Phase 4 (INV-36/37). Miss m (U order = flat order of first references;
// words_ent marks them) takes victim E[m], which phase 3 put at
// lru_out[|E| - |M| + m]. Only those entries touch a hash value here (their
// own key's), so no thread reads a value another thread writes. Afterwards a
// missed key's value holds (slot, or kNone16 when tripped) << 16 | miss bit
// | first flat index; a hit key's still holds its first position.
__device__ void assign_misses(const ResolveArgs& a, const Group& g,
                              const Smem& s, const Totals& t) {
  const int lane = threadIdx.x & 31;
  const int32_t H = a.hot_size;
  int32_t* dgi_row = a.dgi + static_cast<int64_t>(g.state) * H;
  const int32_t* hot_row = a.hot_bt + g.req * a.hot_width;
  const int entries = g.n * static_cast<int>(a.top_k);
  const WarpRun er = warp_run(entries, threadIdx.x >> 5);
  int carry, total;
  warp_word_sums(s.words_ent, er.nwords, er.word0, lane, carry, total);
  for (int j = 0; j < er.rounds; ++j) {
    const int fb = (er.word0 + j) * 32;
    if (fb >= entries) break;  // warp-uniform
    const unsigned word = s.words_ent[fb >> 5];
    if ((word >> lane) & 1u) {
      const uint32_t f = static_cast<uint32_t>(fb + lane);
      const uint32_t code = s.entry_code[f];
      const int m = carry + __popc(word & lane_mask_lt(lane));
      const int slot = s.lru_out[t.n_evict - t.n_miss + m];
      const int32_t key = s.hash_keys[code];
      const int64_t pe = g.row0 * a.top_k + m;  // row0 + m/K, col m%K
      a.plan_src[pe] = key;
      const uint32_t us = static_cast<uint32_t>(slot);
      int32_t dst = -1;
      if (slot >= 0 && slot < H) {
        // F18: the victim's hot block must be a valid GPU block and both
        // of its row ids must fit int32, else the miss is tripped.
        const int32_t blk = hot_row[div_block(us, a)];
        const uint32_t off = mod_block(us, a);
        if (checked_row(blk, off, a.attn_stride, a) >= 0) {
          dst = checked_row(blk, off, a.block_size, a);
        }
      }
      uint32_t v;
      if (dst >= 0) {
        dgi_row[slot] = key;
        a.plan_dst[pe] = dst;
        v = (us << 16) | kMissBit | f;
      } else {  // tripwire 2 / F18: never index dgi or the hot cache with it
        a.plan_dst[pe] = -1;
        v = (kNone16 << 16) | kMissBit | f;
        atomicAdd(&s.ctr[kCtrTrips], 1);
      }
      s.hash_values[code] = v;
    }
    carry += __popc(word);
  }
}

// Phase 5. Pending entries get their hot-row ids (a hit's slot is the old
// lru row at its first position, which is why the new row is stored only
// after the final barrier); per-row valid counts into filter[i]. Ends with
// a barrier (B5).
__device__ void emit_entries(const ResolveArgs& a, const Group& g,
                             const Smem& s, const Totals& t) {
  const int32_t H = a.hot_size;
  const int16_t* lru_row = a.lru + static_cast<int64_t>(g.state) * H;
  for (int64_t i = threadIdx.x; i < g.n; i += kResolveThreads) {
    const int64_t left = static_cast<int64_t>(t.n_miss) - i * a.top_k;
    a.plan_count[g.row0 + i] =
        static_cast<int32_t>(left < 0 ? 0 : (left > a.top_k ? a.top_k : left));
  }
  const int32_t* hot_row = a.hot_bt + g.req * a.hot_width;
  const int K = static_cast<int>(a.top_k);
  int trips = 0;  // hit references whose hot block is invalid (F18)
  for (int i = 0; i < g.n; ++i) {
    const int64_t e0 = (g.row0 + i) * a.top_k;
    int count = 0;
    for (int k0 = 0; k0 < K; k0 += kEntryBatch * kResolveThreads) {
      uint32_t code[kEntryBatch], v[kEntryBatch], slot[kEntryBatch];
      int32_t block[kEntryBatch];
#pragma unroll
      for (int j = 0; j < kEntryBatch; ++j) {  // slots of hits, in parallel
        const int k = k0 + j * kResolveThreads + threadIdx.x;
        code[j] = k < K ? s.entry_code[i * K + k] : kCodeInvalid;
        v[j] = code[j] < kCodeResident ? s.hash_values[code[j]] : 0u;
        slot[j] = kNone16;
        if (code[j] < kCodeResident) {
          slot[j] = (v[j] & kMissBit) != 0
                        ? v[j] >> 16
                        : static_cast<uint16_t>(lru_row[v[j] >> 16]);
        }
      }
#pragma unroll
      for (int j = 0; j < kEntryBatch; ++j) {  // hot blocks, in parallel
        block[j] = slot[j] != kNone16 ? hot_row[div_block(slot[j], a)] : 0;
      }
#pragma unroll
      for (int j = 0; j < kEntryBatch; ++j) {
        const int k = k0 + j * kResolveThreads + threadIdx.x;
        if (k >= K) continue;
        if (code[j] >= kCodeResident) {
          count += code[j] == kCodeResident;
          continue;
        }
        int32_t out = -1, key = -1, miss = 0;
        if (slot[j] != kNone16) {
          // F18: a hit whose slot's hot block is invalid cannot be read: -1
          // (it stays a hit for the LRU; each such reference is a trip). A
          // miss that got a slot passed the same check on the same block in
          // phase 4, so its out >= 0 and miss needs no gating.
          out = checked_row(block[j], mod_block(slot[j], a), a.attn_stride,
                            a);
          key = out >= 0 ? s.hash_keys[code[j]] : -1;
          miss = (v[j] & kMissBit) != 0 &&
                 (v[j] & kFirstMask) == static_cast<uint32_t>(i * K + k);
          trips += static_cast<uint32_t>(out) >> 31;
        }
        a.out_rows[e0 + k] = out;
        if (a.miss_mask != nullptr) a.miss_mask[e0 + k] = miss;
        if (a.resolved_g != nullptr) a.resolved_g[e0 + k] = key;
        count += out >= 0;
      }
    }
    const int w = __reduce_add_sync(0xffffffffu, count);
    if ((threadIdx.x & 31) == 0 && w != 0) {
      atomicAdd(&s.filter[i], static_cast<uint32_t>(w));
    }
  }
  if (__any_sync(0xffffffffu, trips != 0)) {  // corrupted hot table only
    const int t = __reduce_add_sync(0xffffffffu, trips);
    if ((threadIdx.x & 31) == 0) atomicAdd(&s.ctr[kCtrTrips], t);
  }
  __syncthreads();
}

// After B5: the new lru row, the valid counts, the counters.
__device__ void finish_group(const ResolveArgs& a, const Group& g,
                             const Smem& s, const Totals& t) {
  const int32_t H = a.hot_size;
  int16_t* lru_row = a.lru + static_cast<int64_t>(g.state) * H;
  for (int p = threadIdx.x; p < H; p += kResolveThreads) {
    lru_row[p] = s.lru_out[p];
  }
  for (int i = threadIdx.x; i < g.n; i += kResolveThreads) {
    a.valid_counts[g.row0 + i] = static_cast<int32_t>(s.filter[i]);
  }
  if (threadIdx.x != 0 || a.stats == nullptr) return;
  atomicAdd(&a.stats[0], static_cast<unsigned long long>(t.n_hits));
  atomicAdd(&a.stats[1], static_cast<unsigned long long>(t.n_miss));
  if (a.stats_len >= 3) {
    atomicAdd(&a.stats[2], static_cast<unsigned long long>(s.ctr[kCtrTrips]));
  }
}

#if HISPARSE_PHASE_CLOCK
#define PHASE_MARK(i) \
  if (threadIdx.x == 0) clk[i] = clock64()
#else
#define PHASE_MARK(i) \
  do {                \
  } while (0)
#endif

__global__ void __launch_bounds__(kResolveThreads, HISPARSE_MIN_BLOCKS)
    resolve_residency_kernel(const ResolveArgs a, const int64_t num_rows) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
#if HISPARSE_PHASE_CLOCK
  long long clk[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#endif
  PHASE_MARK(0);
  const Smem s = carve_smem(smem_raw, a.layout);
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x;
  const int32_t req = a.row_req[row];
  // The first entries and their table cells load while the block decides
  // what the row is (wasted only on padding and follower rows).
  const bool req_ok = req >= 0 && req < a.num_reqs;
  EntryBatch first{};
  if (req_ok) load_entries(a, req, row, 0, first);
  // Not the first row of its union group: the first row's CTA owns it.
  if (req_ok && row > 0 && a.row_req[row - 1] == req) return;
  if (!req_ok) {
    write_padding(a, row, 1);
    return;
  }
  Group g;
  g.row0 = row;
  g.req = req;
  g.state = a.req_state[req];
  g.seq_len = a.seq_lens[req];

  // Shared-memory init, overlapping the loads above.
  {
    int4* hk = reinterpret_cast<int4*>(s.hash_keys);
    uint4* hv = reinterpret_cast<uint4*>(s.hash_values);
    for (int i = threadIdx.x; i < s.hash_size / 4; i += kResolveThreads) {
      hk[i] = make_int4(kEmptyKey, kEmptyKey, kEmptyKey, kEmptyKey);
      hv[i] = make_uint4(~0u, ~0u, ~0u, ~0u);
    }
    for (int i = threadIdx.x; i < s.union_max; i += kResolveThreads) {
      s.filter[i] = 0;
    }
    if (threadIdx.x < 8) s.ctr[threadIdx.x] = 0;
  }
  // Rows of the union group: warp 0 compares 32 rows per step. A run longer
  // than q is counted in full so it can be rejected.
  if (threadIdx.x < 32) {
    int64_t n = 1;
    while (true) {
      const int64_t r = row + n + lane;
      const bool same = r < num_rows && a.row_req[r] == req;
      const unsigned run = ~__ballot_sync(0xffffffffu, same);
      const int len = run == 0 ? 32 : __ffs(run) - 1;
      n += len;
      if (len < 32) break;
    }
    if (lane == 0) s.ctr[kCtrGroupRows] = static_cast<int32_t>(n);
  }
  __syncthreads();  // B0
  PHASE_MARK(1);
  const int64_t n_rows = s.ctr[kCtrGroupRows];
  if (g.state < 0 || g.state >= a.num_states) {
    write_padding(a, g.row0, n_rows);
    return;
  }
  if (n_rows > a.max_query_len) {  // caller broke the q-row contract
    write_padding(a, g.row0, n_rows);
    if (threadIdx.x == 0 && a.stats != nullptr && a.stats_len >= 4) {
      atomicAdd(&a.stats[3], static_cast<unsigned long long>(n_rows));
    }
    return;
  }
  g.n = static_cast<int32_t>(n_rows);

  if (!classify_entries(a, g, s, first)) {  // B1; resident short-circuit
    count_resident(a, g, s);
    for (int i = threadIdx.x; i < g.n; i += kResolveThreads) {
      a.valid_counts[g.row0 + i] = static_cast<int32_t>(s.filter[i]);
      a.plan_count[g.row0 + i] = 0;
    }
    // Tripped resident ids (F18) still reach the debug counter.
    if (threadIdx.x == 0 && a.stats != nullptr && a.stats_len >= 3 &&
        s.ctr[kCtrTrips] != 0) {
      atomicAdd(&a.stats[2],
                static_cast<unsigned long long>(s.ctr[kCtrTrips]));
    }
    return;  // INV-34: dgi and lru untouched
  }
  PHASE_MARK(2);
#if HISPARSE_FIRST_PLAIN
  if (s.ctr[kCtrDupRefs] != 0) merge_first_refs(a, g, s);  // + a barrier
#endif
  scan_lru(a, g, s);
  __syncthreads();  // B2
#if HISPARSE_SCAN_PLAIN
  PHASE_MARK(3);
  Totals t = reorder_lru(a, g, s);
  __syncthreads();  // B3
  if (t.n_hits + s.ctr[kCtrMissKeys] != t.n_union) {  // block-uniform
    // Corrupted state only: a key at two LRU positions.
    fix_first_hits(a, g, s);
    t = reorder_lru(a, g, s);
    __syncthreads();
  }
#else
  if (s.ctr[kCtrDup] != 0) rescan_first_hits(a, g, s);
  PHASE_MARK(3);
  const Totals t = reorder_lru(a, g, s);
  __syncthreads();  // B3
#endif
  PHASE_MARK(4);
  assign_misses(a, g, s, t);
  __syncthreads();  // B4
  PHASE_MARK(5);
  emit_entries(a, g, s, t);  // ends with B5
  PHASE_MARK(6);
  finish_group(a, g, s, t);
#if HISPARSE_PHASE_CLOCK
  if (threadIdx.x == 0) {
    printf("phase_clock row %lld start %lld classify %lld scan %lld "
           "reorder %lld assign %lld emit %lld total %lld\n",
           static_cast<long long>(row), clk[1] - clk[0], clk[2] - clk[1],
           clk[3] - clk[2], clk[4] - clk[3], clk[5] - clk[4],
           clk[6] - clk[5], clk[6] - clk[0]);
  }
#endif
}

// Raise the kernel's dynamic shared-memory limit once per device as needed.
void ensure_smem_limit(int device, int64_t bytes) {
  static std::atomic<int64_t> configured[64];
  if (bytes <= 48 * 1024 || configured[device].load() >= bytes) return;
  const cudaError_t err = cudaFuncSetAttribute(
      resolve_residency_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(bytes));
  STD_TORCH_CHECK(err == cudaSuccess,
                  "hisparse_ops.resolve_residency: cannot raise shared memory "
                  "to ", bytes, " B: ", cudaGetErrorString(err));
  int64_t cur = configured[device].load();
  while (cur < bytes && !configured[device].compare_exchange_weak(cur, bytes)) {
  }
}

}  // namespace

int64_t resolver_smem_bytes(int64_t top_k, int64_t max_query_len,
                            int64_t hot_size) {
  STD_TORCH_CHECK(top_k >= 1 && max_query_len >= 1 && hot_size >= 1,
                  "resolver_smem_bytes needs top_k, max_query_len and "
                  "hot_size >= 1");
  return resolver_smem_layout(top_k, max_query_len, hot_size).total_bytes;
}

namespace {

struct ResolveShape {
  int64_t rows, top_k, reqs, states, hot_size;
};

ResolveShape check_resolve_inputs(const Tensor& topk, const Tensor& row_req,
                                  const Tensor& seq_lens,
                                  const Tensor& req_state,
                                  const Tensor& src_bt, const Tensor& res_bt,
                                  const Tensor& hot_bt, const Tensor& dgi,
                                  const Tensor& lru, int device) {
  using ST = ScalarType;
  ResolveShape sh{};
  check_cuda(topk, "topk", ST::Int, 2, device);
  sh.rows = topk.size(0);
  sh.top_k = topk.size(1);
  STD_TORCH_CHECK(sh.top_k >= 1, "topk.size(1) (top_k) must be >= 1");
  check_cuda(row_req, "row_req", ST::Int, 1, device);
  check_size(row_req, "row_req", 0, sh.rows, "topk.size(0)");
  check_cuda(seq_lens, "seq_lens", ST::Int, 1, device);
  sh.reqs = seq_lens.size(0);
  check_cuda(req_state, "req_state", ST::Int, 1, device);
  check_size(req_state, "req_state", 0, sh.reqs, "seq_lens.size(0)");
  check_cuda(src_bt, "src_bt", ST::Int, 2, device);
  check_size(src_bt, "src_bt", 0, sh.reqs, "seq_lens.size(0)");
  check_cuda(res_bt, "res_bt", ST::Int, 2, device);
  check_size(res_bt, "res_bt", 0, sh.reqs, "seq_lens.size(0)");
  check_cuda(hot_bt, "hot_bt", ST::Int, 2, device);
  check_size(hot_bt, "hot_bt", 0, sh.reqs, "seq_lens.size(0)");
  check_cuda(dgi, "dgi", ST::Int, 2, device);
  sh.states = dgi.size(0);
  sh.hot_size = dgi.size(1);
  check_cuda(lru, "lru", ST::Short, 2, device);
  check_size(lru, "lru", 0, sh.states, "dgi.size(0)");
  check_size(lru, "lru", 1, sh.hot_size, "dgi.size(1)");
  return sh;
}

void check_resolve_outputs(const ResolveShape& sh, const Tensor& out_rows,
                           const Tensor& valid_counts, const Tensor& plan_src,
                           const Tensor& plan_dst, const Tensor& plan_count,
                           const std::optional<Tensor>& miss_mask,
                           const std::optional<Tensor>& resolved_g,
                           const std::optional<Tensor>& stats, int device) {
  using ST = ScalarType;
  struct Entry {
    const Tensor* t;
    const char* name;
  };
  for (const Entry& e : {Entry{&out_rows, "out_rows"},
                         Entry{&plan_src, "plan_src"},
                         Entry{&plan_dst, "plan_dst"}}) {
    check_cuda(*e.t, e.name, ST::Int, 2, device);
    check_size(*e.t, e.name, 0, sh.rows, "topk.size(0)");
    check_size(*e.t, e.name, 1, sh.top_k, "topk.size(1)");
  }
  for (const Entry& e : {Entry{&valid_counts, "valid_counts"},
                         Entry{&plan_count, "plan_count"}}) {
    check_cuda(*e.t, e.name, ST::Int, 1, device);
    check_size(*e.t, e.name, 0, sh.rows, "topk.size(0)");
  }
  if (miss_mask.has_value()) {
    check_cuda(*miss_mask, "miss_mask", ST::Int, 2, device);
    check_size(*miss_mask, "miss_mask", 0, sh.rows, "topk.size(0)");
    check_size(*miss_mask, "miss_mask", 1, sh.top_k, "topk.size(1)");
  }
  if (resolved_g.has_value()) {
    check_cuda(*resolved_g, "resolved_g", ST::Int, 2, device);
    check_size(*resolved_g, "resolved_g", 0, sh.rows, "topk.size(0)");
    check_size(*resolved_g, "resolved_g", 1, sh.top_k, "topk.size(1)");
  }
  if (stats.has_value()) {
    check_cuda(*stats, "stats", ST::UInt64, 1, device);
    STD_TORCH_CHECK(stats->size(0) >= 2 && stats->size(0) <= 4,
                    "stats must hold 2 to 4 counters (found ",
                    stats->size(0), ")");
  }
}

}  // namespace

void resolve_residency(const Tensor& topk, const Tensor& row_req,
                       const Tensor& seq_lens, const Tensor& req_state,
                       const Tensor& src_bt, const Tensor& res_bt,
                       const Tensor& hot_bt, Tensor dgi, Tensor lru,
                       int64_t host_rows, int64_t num_gpu_blocks,
                       int64_t block_size, int64_t attn_block_stride,
                       int64_t max_query_len,
                       Tensor out_rows, Tensor valid_counts, Tensor plan_src,
                       Tensor plan_dst, Tensor plan_count,
                       std::optional<Tensor> miss_mask,
                       std::optional<Tensor> resolved_g,
                       std::optional<Tensor> stats) {
  STD_TORCH_CHECK(topk.is_cuda(), "topk must be a CUDA tensor");
  const int device = topk.get_device_index();
  const ResolveShape sh = check_resolve_inputs(
      topk, row_req, seq_lens, req_state, src_bt, res_bt, hot_bt, dgi, lru,
      device);
  check_resolve_outputs(sh, out_rows, valid_counts, plan_src, plan_dst,
                        plan_count, miss_mask, resolved_g, stats, device);
  STD_TORCH_CHECK(block_size >= 1 && block_size <= INT32_MAX,
                  "block_size must be in [1, 2^31) (found ", block_size, ")");
  STD_TORCH_CHECK(attn_block_stride >= block_size,
                  "attn_block_stride must be >= block_size (found ",
                  attn_block_stride, " < ", block_size, ")");
  STD_TORCH_CHECK(host_rows >= 0 && host_rows <= INT32_MAX,
                  "host_rows must be in [0, 2^31) (INV-14; found ", host_rows,
                  ")");
  // F18 / INV-14: block ids are checked against N_gpu, and every row id of
  // a valid block (block * max(Sa, B) + offset) then fits int32.
  STD_TORCH_CHECK(num_gpu_blocks >= 1, "num_gpu_blocks must be >= 1 (found ",
                  num_gpu_blocks, ")");
  const int64_t row_stride =
      attn_block_stride > block_size ? attn_block_stride : block_size;
  STD_TORCH_CHECK(num_gpu_blocks <= INT32_MAX / row_stride,
                  "num_gpu_blocks x max(attn_block_stride, block_size) must "
                  "be < 2^31 (INV-14; found ", num_gpu_blocks, " x ",
                  row_stride, ")");
  STD_TORCH_CHECK(max_query_len >= 1, "max_query_len must be >= 1");
  STD_TORCH_CHECK(sh.hot_size >= 1 && sh.hot_size <= kMaxHotSize,
                  "dgi.size(1) (device_buffer_size) must be in [1, 32768] "
                  "(found ", sh.hot_size, ")");
  STD_TORCH_CHECK(sh.hot_size >= max_query_len * sh.top_k,
                  "device_buffer_size ", sh.hot_size,
                  " must be >= max_decode_query_len x index_topk = ",
                  max_query_len * sh.top_k);
  STD_TORCH_CHECK(hot_bt.size(1) >= ceil_div(sh.hot_size, block_size),
                  "hot_bt.size(1) must be >= cdiv(device_buffer_size, "
                  "block_size) = ", ceil_div(sh.hot_size, block_size),
                  " (found ", hot_bt.size(1), ")");
  const ResolverSmemLayout layout =
      resolver_smem_layout(sh.top_k, max_query_len, sh.hot_size);
  const DeviceLimits limits = device_limits(device);
  STD_TORCH_CHECK(layout.total_bytes <= limits.smem_optin,
                  "HiSparse resolver needs ", layout.total_bytes,
                  " B of shared memory per block for device_buffer_size=",
                  sh.hot_size, " and ", max_query_len, "x", sh.top_k,
                  " union rows; the device allows ", limits.smem_optin,
                  " B. Lower device_buffer_size or num_speculative_tokens.");
  if (sh.rows == 0) return;

  ResolveArgs a{};
  a.topk = topk.const_data_ptr<int32_t>();
  a.row_req = row_req.const_data_ptr<int32_t>();
  a.seq_lens = seq_lens.const_data_ptr<int32_t>();
  a.req_state = req_state.const_data_ptr<int32_t>();
  a.src_bt = src_bt.const_data_ptr<int32_t>();
  a.res_bt = res_bt.const_data_ptr<int32_t>();
  a.hot_bt = hot_bt.const_data_ptr<int32_t>();
  a.dgi = dgi.mutable_data_ptr<int32_t>();
  a.lru = lru.mutable_data_ptr<int16_t>();
  a.out_rows = out_rows.mutable_data_ptr<int32_t>();
  a.valid_counts = valid_counts.mutable_data_ptr<int32_t>();
  a.plan_src = plan_src.mutable_data_ptr<int32_t>();
  a.plan_dst = plan_dst.mutable_data_ptr<int32_t>();
  a.plan_count = plan_count.mutable_data_ptr<int32_t>();
  a.miss_mask = miss_mask ? miss_mask->mutable_data_ptr<int32_t>() : nullptr;
  a.resolved_g =
      resolved_g ? resolved_g->mutable_data_ptr<int32_t>() : nullptr;
  a.stats = stats ? reinterpret_cast<unsigned long long*>(
                        stats->mutable_data_ptr<uint64_t>())
                  : nullptr;
  a.stats_len = stats ? stats->size(0) : 0;
  a.top_k = sh.top_k;
  a.num_reqs = sh.reqs;
  a.src_width = src_bt.size(1);
  a.res_width = res_bt.size(1);
  a.hot_width = hot_bt.size(1);
  a.num_states = sh.states;
  a.host_rows = host_rows;
  a.attn_stride = static_cast<int32_t>(attn_block_stride);  // checked above
  a.max_query_len = max_query_len;
  a.gpu_blocks_m1 = static_cast<uint32_t>(num_gpu_blocks - 1);
  a.hot_size = static_cast<int32_t>(sh.hot_size);
  a.block_size = static_cast<int32_t>(block_size);
  a.block_shift = (block_size & (block_size - 1)) == 0
                      ? __builtin_ctzll(static_cast<uint64_t>(block_size))
                      : -1;
  a.layout = layout;

  const torch::stable::accelerator::DeviceGuard guard(device);
  ensure_smem_limit(device, layout.total_bytes);
  resolve_residency_kernel<<<static_cast<unsigned>(sh.rows), kResolveThreads,
                             layout.total_bytes, current_stream(device)>>>(
      a, sh.rows);
  check_launch("resolve_residency");
}

}  // namespace hisparse
