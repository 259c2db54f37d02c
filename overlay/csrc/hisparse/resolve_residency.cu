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
// Phases of one group (each ends at a block barrier):
//   1 classify   entries -> invalid (-1) | resident (final hma id) | pending;
//                pending keys go into the smem hash (atomicMin keeps the first
//                flat index per key); the entry's hash slot h is kept in smem
//                (LRU output array, free until phase 3) and its out_rows cell
//                temporarily holds the marker -2-h. If nothing is pending the
//                group ends here: dgi/lru are never read (INV-34).
//   2 union      ballot-compact the first references in flat order -> union
//                index u per key (U ordered by first occurrence).
//   2b filter    one bit per union key in the scan arrays (free until 4).
//   3 lru scan   per LRU position: tripwire 1, filter test, dgi lookup in
//                the hash; the earliest position per key wins (a key in two
//                slots only happens in corrupted state).
//   4 hit rank   ballot words + prefix -> Hl and E in LRU-position order.
//   5 reorder    new lru row = E[|M|:] ++ E[:|M|] ++ Hl, built in smem.
//   6 misses     rank misses in U order, miss m takes E[m] (tripwire 2),
//                writes dgi and plan entry m (row row0 + m/K, column m%K).
//   7 emit       replace markers by hot-row hma ids, miss_mask, resolved_g,
//                valid_counts; stats.
// Shared memory holds only the arrays of the normative layout (see
// resolver_smem_layout); each array is reused across phases as noted.
//
// Latency, divergence and barriers, not bandwidth, bound this kernel (one
// CTA per SM, ~15 barriers; Nsight Compute: 1.9 IPC, a third of the stalls
// at barriers). Linear probing at load factor 2/3 gives the slowest lane of
// a warp chains of 20-40 slots when a key is absent, which is what most LRU
// positions hold once the hot buffer is full: a Bloom filter over the union
// keys (phase 2b) lets those positions skip the probe, and probes read four
// slots per 16-byte shared load. Tuning switches (defaults chosen by
// measuring all of them on an H200, results/kernels/README.md):
//   HISPARSE_PROBE_VEC4   probe four slots per 16-byte shared load
//   HISPARSE_HIT_ATOMIC   first hit position by 16-bit CAS minimum instead
//                         of a plain store plus a fix-up pass
//   HISPARSE_MISS_FILTER  the Bloom filter
//   HISPARSE_BATCHED      several entries/positions per thread per load
//                         round, per-row counts by block_sum(); otherwise
//                         one per round, counted by __syncthreads_count
#include "hisparse_common.cuh"
#include "ops.h"

#include <atomic>

#ifndef HISPARSE_PROBE_VEC4
#define HISPARSE_PROBE_VEC4 1
#endif
#ifndef HISPARSE_HIT_ATOMIC
#define HISPARSE_HIT_ATOMIC 0
#endif
#ifndef HISPARSE_MISS_FILTER
#define HISPARSE_MISS_FILTER 1
#endif
#ifndef HISPARSE_BATCHED
#define HISPARSE_BATCHED 0
#endif

namespace hisparse {
namespace {

constexpr int32_t kEmptyKey = -1;
constexpr uint16_t kNoSlot = 0xFFFF;   // "no hit yet" / "tripped"
constexpr uint16_t kNoEntry = 0xFFFF;  // phase 1-2: entry is not pending
#if HISPARSE_BATCHED
constexpr int kEntryBatch = 2;  // top-k entries per thread per load round
constexpr int kLruBatch = 4;    // LRU positions per thread per load round
#else
constexpr int kEntryBatch = 1;
constexpr int kLruBatch = 1;
#endif

// counters int32[8]; kCtrSum..kCtrSum+2 rotate in block_sum().
enum Counter : int {
  kCtrGroupRows = 0,
  kCtrUnion,
  kCtrHits,
  kCtrTrips,
  kCtrSum
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
  int64_t attn_stride;          // Sa
  int64_t max_query_len;        // q
  int32_t hot_size;             // H
  int32_t block_size;           // B
  int32_t block_shift;          // log2(B) when B is a power of two, else -1
  ResolverSmemLayout layout;
};

struct Smem {
  int32_t* hash_keys;
  int32_t* hash_values;
  int32_t* union_keys;
  unsigned* scan_a;
  int32_t* scan_b;
  int32_t* ctr;
  uint16_t* union_slots;
  int16_t* lru_out;
  uint16_t* entry_h;  // phases 1-2: hash slot per flat entry (aliases lru_out)
  int32_t hash_size;
  int32_t scan_words;  // C
  int sum_calls;       // block_sum() rotation, uniform across the block
};

struct Group {
  int64_t row0;  // first batch row
  int64_t n;     // rows in the group (<= q)
  int32_t req;
  int32_t state;
};

__device__ Smem carve_smem(unsigned char* base, const ResolverSmemLayout& l) {
  Smem s;
  s.hash_keys = reinterpret_cast<int32_t*>(base + l.hash_keys);
  s.hash_values = reinterpret_cast<int32_t*>(base + l.hash_values);
  s.union_keys = reinterpret_cast<int32_t*>(base + l.union_keys);
  s.scan_a = reinterpret_cast<unsigned*>(base + l.scan_a);
  s.scan_b = reinterpret_cast<int32_t*>(base + l.scan_b);
  s.ctr = reinterpret_cast<int32_t*>(base + l.counters);
  s.union_slots = reinterpret_cast<uint16_t*>(base + l.union_slots);
  s.lru_out = reinterpret_cast<int16_t*>(base + l.lru_out);
  s.entry_h = reinterpret_cast<uint16_t*>(base + l.lru_out);
  s.hash_size = static_cast<int32_t>(l.hash_size);
  s.scan_words = static_cast<int32_t>(l.scan_words);
  s.sum_calls = 0;
  return s;
}

// Knuth multiplicative hash with linear probing (spec 5.1).
__device__ __forceinline__ int hash_home(int32_t key, int32_t size) {
  return static_cast<int>((static_cast<uint32_t>(key) * 2654435761u) %
                          static_cast<uint32_t>(size));
}

#if HISPARSE_PROBE_VEC4
// Four consecutive keys of the table (Hs is a multiple of 32, so an aligned
// group never wraps). Volatile: inserts by other threads must be observed.
__device__ __forceinline__ int4 load_keys4(const int32_t* keys, int base) {
  int4 v;
  const unsigned addr =
      static_cast<unsigned>(__cvta_generic_to_shared(keys + base));
  asm volatile("ld.volatile.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}

// First slot at or after h (in probe order) holding `key` or empty.
__device__ __forceinline__ int probe(const Smem& s, int32_t key, int h) {
  int base = h & ~3;
  int first = h & 3;
  while (true) {
    const int4 v = load_keys4(s.hash_keys, base);
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
__device__ __forceinline__ int probe(const Smem& s, int32_t key, int h) {
  const volatile int32_t* keys = s.hash_keys;
  while (true) {
    const int32_t k = keys[h];
    if (k == key || k == kEmptyKey) return h;
    h = (h + 1 == s.hash_size) ? 0 : h + 1;
  }
}
#endif

__device__ __forceinline__ int hash_insert(const Smem& s, int32_t key) {
  int h = hash_home(key, s.hash_size);
  while (true) {
    h = probe(s, key, h);
    const int32_t prev = atomicCAS(&s.hash_keys[h], kEmptyKey, key);
    if (prev == kEmptyKey || prev == key) return h;
    h = (h + 1 == s.hash_size) ? 0 : h + 1;  // lost a race for slot h
  }
}

// The table never fills (|U| <= Umax < Hs), so a probe always ends.
__device__ __forceinline__ int hash_find(const Smem& s, int32_t key) {
  const int h = probe(s, key, hash_home(key, s.hash_size));
  return s.hash_keys[h] == key ? h : -1;
}

#if HISPARSE_MISS_FILTER
// Bloom filter over the union keys in the scan arrays (2*C words, C >= 2):
// the largest power-of-two word count that fits, one bit per key.
struct Filter {
  unsigned* words;
  int shift;  // 32 - log2(bits)
};

__device__ __forceinline__ Filter make_filter(const Smem& s) {
  const int words = 2 * s.scan_words;
  int log_words = 31 - __clz(words);
  Filter f;
  f.words = s.scan_a;  // scan_b follows scan_a directly
  f.shift = 32 - (5 + log_words);
  return f;
}

__device__ __forceinline__ uint32_t filter_bit(const Filter& f, int32_t key) {
  return (static_cast<uint32_t>(key) * 0x9E3779B1u) >> f.shift;
}

__device__ __forceinline__ bool filter_may_hold(const Filter& f,
                                                int32_t key) {
  const uint32_t b = filter_bit(f, key);
  return (f.words[b >> 5] >> (b & 31)) & 1u;
}
#endif

#if HISPARSE_BATCHED
// Sum of x over the block, returned to every thread. Three counters rotate:
// call N zeroes the counter call N+1 uses before its own barrier, which is
// after every read of that counter (made in call N-2) has completed.
__device__ int block_sum(Smem& s, int x) {
  int32_t* sums = s.ctr + kCtrSum;
  const int cur = s.sum_calls % 3;
  ++s.sum_calls;
  const int w = __reduce_add_sync(0xffffffffu, x);
  if ((threadIdx.x & 31) == 0 && w != 0) atomicAdd(&sums[cur], w);
  if (threadIdx.x == 0) sums[(cur + 1) % 3] = 0;
  __syncthreads();
  return sums[cur];
}
#endif

// Per-row valid counts: `round` is this thread's count in one load round.
// Batched rounds accumulate locally and reduce once per row (row_total);
// single-entry rounds reduce every round with the hardware barrier count.
__device__ __forceinline__ int round_count(int in_round) {
#if HISPARSE_BATCHED
  return in_round;
#else
  return __syncthreads_count(in_round);
#endif
}

__device__ __forceinline__ int row_total(Smem& s, int count) {
#if HISPARSE_BATCHED
  return block_sum(s, count);
#else
  (void)s;
  return count;
#endif
}

// 16-bit atomic minimum (CAS loop): only duplicated keys in dgi, i.e.
// corrupted state, ever contend here.
__device__ __forceinline__ void atomic_min_u16(uint16_t* addr, uint16_t v) {
  unsigned short old = *reinterpret_cast<volatile unsigned short*>(addr);
  while (v < old) {
    const unsigned short prev =
        atomicCAS(reinterpret_cast<unsigned short*>(addr), old, v);
    if (prev == old) break;
    old = prev;
  }
}

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

// Attention ids are non-negative int32; an id that would not be one (only
// possible when INV-14's startup range check was bypassed) resolves to -1.
__device__ __forceinline__ int32_t checked_hma(int64_t block, int64_t offset,
                                               int64_t sa) {
  const int32_t id = hma_row(block, offset, sa);
  return id < 0 ? -1 : id;
}

// Rows of this CTA's union group; thread 0 counts, everyone reads after the
// barrier. A run longer than q is counted in full so it can be rejected.
__device__ int64_t group_rows(const ResolveArgs& a, int64_t num_rows,
                              int64_t row0, int32_t req, const Smem& s) {
  if (threadIdx.x == 0) {
    int64_t n = 1;
    while (row0 + n < num_rows && a.row_req[row0 + n] == req) ++n;
    s.ctr[kCtrGroupRows] = static_cast<int32_t>(n);
    s.ctr[kCtrTrips] = 0;
    s.ctr[kCtrSum] = 0;
  }
  __syncthreads();
  return s.ctr[kCtrGroupRows];
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

__device__ void init_hash(const Smem& s) {
  for (int h = threadIdx.x; h < s.hash_size; h += kResolveThreads) {
    s.hash_keys[h] = kEmptyKey;
    s.hash_values[h] = INT32_MAX;
  }
  __syncthreads();
}

// Phase 1. Returns (block-uniformly) whether any entry is pending.
__device__ bool classify_entries(const ResolveArgs& a, const Group& g,
                                 Smem& s) {
  const int32_t seq_len = a.seq_lens[g.req];
  const int32_t* src_row = a.src_bt + g.req * a.src_width;
  const int32_t* res_row = a.res_bt + g.req * a.res_width;
  const int K = static_cast<int>(a.top_k);
  bool pending = false;
  for (int i = 0; i < g.n; ++i) {
    const int64_t e0 = (g.row0 + i) * a.top_k;
    int valid_count = 0;
    for (int k0 = 0; k0 < K; k0 += kEntryBatch * kResolveThreads) {
      int32_t p[kEntryBatch], rb[kEntryBatch], sb[kEntryBatch];
      uint32_t page[kEntryBatch];
#pragma unroll
      for (int j = 0; j < kEntryBatch; ++j) {
        const int k = k0 + j * kResolveThreads + threadIdx.x;
        p[j] = k < K ? a.topk[e0 + k] : -1;
      }
#pragma unroll
      for (int j = 0; j < kEntryBatch; ++j) {  // both tables, in parallel
        const bool ok = p[j] >= 0 && p[j] < seq_len;
        page[j] = ok ? div_block(static_cast<uint32_t>(p[j]), a) : UINT32_MAX;
        rb[j] = page[j] < a.res_width ? res_row[page[j]] : 0;
        sb[j] = page[j] < a.src_width ? src_row[page[j]] : 0;
      }
      int in_round = 0;
#pragma unroll
      for (int j = 0; j < kEntryBatch; ++j) {
        const int k = k0 + j * kResolveThreads + threadIdx.x;
        if (k >= K) continue;
        const uint32_t off = mod_block(static_cast<uint32_t>(p[j]), a);
        const int f = i * K + k;
        int32_t out = -1;
        uint16_t mark = kNoEntry;
        if (page[j] == UINT32_MAX) {
          // -1 or a position outside [0, seq_len)
        } else if (rb[j] > 0) {
          out = checked_hma(rb[j], off, a.attn_stride);
        } else {
          const int64_t key =
              static_cast<int64_t>(sb[j]) * a.block_size + off;
          if (sb[j] > 0 && key < a.host_rows) {
            const int h = hash_insert(s, static_cast<int32_t>(key));
            atomicMin(&s.hash_values[h], f);
            out = -2 - h;  // marker, replaced in phase 7
            mark = static_cast<uint16_t>(h);
            pending = true;
          }
        }
        s.entry_h[f] = mark;
        a.out_rows[e0 + k] = out;
        if (out >= -1) {
          if (a.miss_mask != nullptr) a.miss_mask[e0 + k] = 0;
          if (a.resolved_g != nullptr) a.resolved_g[e0 + k] = -1;
        }
        in_round += out >= 0;
      }
      valid_count += round_count(in_round);
    }
    // Final when nothing is pending; phase 7 rewrites it otherwise.
    const int total = row_total(s, valid_count);
    if (threadIdx.x == 0) a.valid_counts[g.row0 + i] = total;
  }
  return __syncthreads_or(pending) != 0;
}

// Phase 2. Union index u = rank of a key's first reference in flat order.
// Returns |U|.
__device__ int build_union(const ResolveArgs& a, const Group& g,
                           const Smem& s) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int entries = static_cast<int>(g.n * a.top_k);
  const int nwords = static_cast<int>(ceil_div(entries, 32));
  for (int f0 = 0; f0 < entries; f0 += kResolveThreads) {
    const int f = f0 + threadIdx.x;
    bool first = false;
    if (f < entries) {
      const uint16_t h = s.entry_h[f];
      first = h != kNoEntry && s.hash_values[h] == f;
    }
    const unsigned bits = __ballot_sync(0xffffffffu, first);
    const int w = (f0 >> 5) + warp;
    if (lane == 0 && w < nwords) s.scan_a[w] = bits;
  }
  __syncthreads();
  if (warp == 0) {
    const int total = warp_scan_words(s.scan_a, s.scan_b, nwords, lane);
    if (lane == 0) s.ctr[kCtrUnion] = total;
  }
  __syncthreads();
  for (int f = threadIdx.x; f < entries; f += kResolveThreads) {
    const unsigned word = s.scan_a[f >> 5];
    if (((word >> lane) & 1u) == 0) continue;
    const int h = s.entry_h[f];
    const int u = s.scan_b[f >> 5] + __popc(word & lane_mask_lt(lane));
    s.union_keys[u] = s.hash_keys[h];
    s.hash_values[h] = (u << 16) | f;
    s.union_slots[u] = kNoSlot;
  }
  __syncthreads();
  return s.ctr[kCtrUnion];
}

// Phase 2b. The scan arrays are free until phase 4: fill the filter.
__device__ void build_filter(const Smem& s, int n_union) {
#if HISPARSE_MISS_FILTER
  const Filter f = make_filter(s);
  const int words = 1 << (32 - 5 - f.shift);
  for (int w = threadIdx.x; w < words; w += kResolveThreads) f.words[w] = 0;
  __syncthreads();
  for (int u = threadIdx.x; u < n_union; u += kResolveThreads) {
    const uint32_t b = filter_bit(f, s.union_keys[u]);
    atomicOr(&f.words[b >> 5], 1u << (b & 31));
  }
  __syncthreads();
#endif
}

// Phase 3. lru_out[p] = union index hit at LRU position p, or -1, and the
// first such position per key ends up in union_slots (tripwire 1: a slot
// outside [0, H) is evictable and dgi is not read).
__device__ void scan_lru(const ResolveArgs& a, const Group& g, const Smem& s) {
  const int32_t H = a.hot_size;
  const int16_t* lru_row = a.lru + static_cast<int64_t>(g.state) * H;
  const int32_t* dgi_row = a.dgi + static_cast<int64_t>(g.state) * H;
#if HISPARSE_MISS_FILTER
  const Filter filter = make_filter(s);
#endif
  for (int p0 = 0; p0 < H; p0 += kLruBatch * kResolveThreads) {
    int slot[kLruBatch];
    int32_t cached[kLruBatch];
#pragma unroll
    for (int j = 0; j < kLruBatch; ++j) {
      const int p = p0 + j * kResolveThreads + threadIdx.x;
      slot[j] = p < H ? lru_row[p] : -1;
    }
#pragma unroll
    for (int j = 0; j < kLruBatch; ++j) {
      cached[j] = slot[j] >= 0 && slot[j] < H ? dgi_row[slot[j]] : -1;
    }
#pragma unroll
    for (int j = 0; j < kLruBatch; ++j) {
      const int p = p0 + j * kResolveThreads + threadIdx.x;
      if (p >= H) continue;
      int16_t u = -1;
      bool look = cached[j] >= 0;
#if HISPARSE_MISS_FILTER
      look = look && filter_may_hold(filter, cached[j]);
#endif
      if (look) {
        const int h = hash_find(s, cached[j]);
        if (h >= 0) {
          u = static_cast<int16_t>(s.hash_values[h] >> 16);
#if HISPARSE_HIT_ATOMIC
          atomic_min_u16(&s.union_slots[u], static_cast<uint16_t>(p));
#else
          s.union_slots[u] = static_cast<uint16_t>(p);  // any writer wins
#endif
        }
      }
      s.lru_out[p] = u;
    }
  }
  __syncthreads();
#if !HISPARSE_HIT_ATOMIC
  // A key held by two slots (corrupted state only) had several writers:
  // keep the earliest position, as spec 5.1 step 3 requires.
  for (int p = threadIdx.x; p < H; p += kResolveThreads) {
    const int u = s.lru_out[p];
    if (u >= 0 && p < s.union_slots[u]) {
      atomic_min_u16(&s.union_slots[u], static_cast<uint16_t>(p));
    }
  }
  __syncthreads();
#endif
}

// Phase 4. scan_a bit p = "position p is a hit"; scan_b = hits before each
// word. Returns |Hl|.
__device__ int rank_hits(const ResolveArgs& a, const Smem& s) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int32_t H = a.hot_size;
  const int nwords = static_cast<int>(ceil_div(H, 32));
  for (int p0 = 0; p0 < H; p0 += kResolveThreads) {
    const int p = p0 + threadIdx.x;
    bool hit = false;
    if (p < H) {
      const int u = s.lru_out[p];
      hit = u >= 0 && s.union_slots[u] == p;
    }
    const unsigned bits = __ballot_sync(0xffffffffu, hit);
    const int w = (p0 >> 5) + warp;
    if (lane == 0 && w < nwords) s.scan_a[w] = bits;
  }
  __syncthreads();
  if (warp == 0) {
    const int total = warp_scan_words(s.scan_a, s.scan_b, nwords, lane);
    if (lane == 0) s.ctr[kCtrHits] = total;
  }
  __syncthreads();
  return s.ctr[kCtrHits];
}

// Phase 5 (INV-35). Evictable of rank i goes to i - |M| (untouched) or to
// |E| - |M| + i (refilled), hit of rank j to |E| + j.
__device__ void reorder_lru(const ResolveArgs& a, const Group& g,
                            const Smem& s, int n_hits, int n_miss) {
  const int32_t H = a.hot_size;
  const int n_evict = H - n_hits;
  const int16_t* lru_row = a.lru + static_cast<int64_t>(g.state) * H;
  for (int p0 = 0; p0 < H; p0 += kLruBatch * kResolveThreads) {
    int16_t slot[kLruBatch];
#pragma unroll
    for (int j = 0; j < kLruBatch; ++j) {
      const int p = p0 + j * kResolveThreads + threadIdx.x;
      slot[j] = p < H ? lru_row[p] : 0;
    }
#pragma unroll
    for (int j = 0; j < kLruBatch; ++j) {
      const int p = p0 + j * kResolveThreads + threadIdx.x;
      if (p >= H) continue;
      const unsigned word = s.scan_a[p >> 5];
      const int bit = p & 31;
      const int hit_rank =
          s.scan_b[p >> 5] + __popc(word & lane_mask_lt(bit));
      int dst;
      if ((word >> bit) & 1u) {
        dst = n_evict + hit_rank;
      } else {
        const int ev_rank = p - hit_rank;
        dst = ev_rank >= n_miss ? ev_rank - n_miss
                                : n_evict - n_miss + ev_rank;
      }
      s.lru_out[dst] = slot[j];
    }
  }
  __syncthreads();
}

// Phase 6 (INV-36/37). Miss m (U order) takes victim E[m], which phase 5 put
// at lru_out[|E| - |M| + m]. Afterwards union_slots[u] is u's slot (kNoSlot
// when tripped) and union_keys[u] is 1 for a miss, 0 for a hit.
__device__ void assign_misses(const ResolveArgs& a, const Group& g,
                              const Smem& s, int n_union, int n_hits,
                              int n_miss) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int32_t H = a.hot_size;
  const int nwords = static_cast<int>(ceil_div(n_union, 32));
  for (int u0 = 0; u0 < n_union; u0 += kResolveThreads) {
    const int u = u0 + threadIdx.x;
    const bool miss = u < n_union && s.union_slots[u] == kNoSlot;
    const unsigned bits = __ballot_sync(0xffffffffu, miss);
    const int w = (u0 >> 5) + warp;
    if (lane == 0 && w < nwords) s.scan_a[w] = bits;
  }
  __syncthreads();
  if (warp == 0) warp_scan_words(s.scan_a, s.scan_b, nwords, lane);
  __syncthreads();

  const int n_evict = H - n_hits;
  const int16_t* lru_row = a.lru + static_cast<int64_t>(g.state) * H;
  int32_t* dgi_row = a.dgi + static_cast<int64_t>(g.state) * H;
  const int32_t* hot_row = a.hot_bt + g.req * a.hot_width;
  for (int u = threadIdx.x; u < n_union; u += kResolveThreads) {
    const unsigned word = s.scan_a[u >> 5];
    const int bit = u & 31;
    if (((word >> bit) & 1u) == 0) {  // hit: slot at its first hit position
      s.union_slots[u] = static_cast<uint16_t>(lru_row[s.union_slots[u]]);
      s.union_keys[u] = 0;
      continue;
    }
    const int m = s.scan_b[u >> 5] + __popc(word & lane_mask_lt(bit));
    const int slot = s.lru_out[n_evict - n_miss + m];
    const int32_t key = s.union_keys[u];
    const int64_t pe = g.row0 * a.top_k + m;  // row row0 + m/K, col m%K
    a.plan_src[pe] = key;
    if (slot >= 0 && slot < H) {
      dgi_row[slot] = key;
      const uint32_t us = static_cast<uint32_t>(slot);
      a.plan_dst[pe] = static_cast<int32_t>(
          static_cast<int64_t>(hot_row[div_block(us, a)]) * a.block_size +
          mod_block(us, a));
      s.union_slots[u] = static_cast<uint16_t>(slot);
    } else {  // tripwire 2: never index dgi or the hot cache with it
      a.plan_dst[pe] = -1;
      s.union_slots[u] = kNoSlot;
      atomicAdd(&s.ctr[kCtrTrips], 1);
    }
    s.union_keys[u] = 1;
  }
  __syncthreads();
}

__device__ void store_state(const ResolveArgs& a, const Group& g,
                            const Smem& s, int n_miss) {
  const int32_t H = a.hot_size;
  int16_t* lru_row = a.lru + static_cast<int64_t>(g.state) * H;
  for (int p = threadIdx.x; p < H; p += kResolveThreads) {
    lru_row[p] = s.lru_out[p];
  }
  for (int64_t i = threadIdx.x; i < g.n; i += kResolveThreads) {
    const int64_t left = static_cast<int64_t>(n_miss) - i * a.top_k;
    a.plan_count[g.row0 + i] =
        static_cast<int32_t>(left < 0 ? 0 : (left > a.top_k ? a.top_k : left));
  }
}

// Phase 7. Markers become hot-row ids; valid_counts are recounted.
__device__ void emit_entries(const ResolveArgs& a, const Group& g, Smem& s) {
  const int32_t* hot_row = a.hot_bt + g.req * a.hot_width;
  const int K = static_cast<int>(a.top_k);
  for (int i = 0; i < g.n; ++i) {
    const int64_t e0 = (g.row0 + i) * a.top_k;
    int valid_count = 0;
    for (int k0 = 0; k0 < K; k0 += kEntryBatch * kResolveThreads) {
      int32_t v[kEntryBatch], block[kEntryBatch];
      int slot[kEntryBatch];
#pragma unroll
      for (int j = 0; j < kEntryBatch; ++j) {
        const int k = k0 + j * kResolveThreads + threadIdx.x;
        v[j] = k < K ? a.out_rows[e0 + k] : -1;
      }
#pragma unroll
      for (int j = 0; j < kEntryBatch; ++j) {  // hot blocks, in parallel
        slot[j] = kNoSlot;
        if (v[j] <= -2) slot[j] = s.union_slots[s.hash_values[-2 - v[j]] >> 16];
        block[j] = slot[j] != kNoSlot
                       ? hot_row[div_block(static_cast<uint32_t>(slot[j]), a)]
                       : 0;
      }
      int in_round = 0;
#pragma unroll
      for (int j = 0; j < kEntryBatch; ++j) {
        const int k = k0 + j * kResolveThreads + threadIdx.x;
        if (k >= K) continue;
        if (v[j] > -2) {
          in_round += v[j] >= 0;
          continue;
        }
        const int h = -2 - v[j];
        const int32_t packed = s.hash_values[h];
        int32_t out = -1, key = -1, miss = 0;
        if (slot[j] != kNoSlot) {
          out = checked_hma(block[j],
                            mod_block(static_cast<uint32_t>(slot[j]), a),
                            a.attn_stride);
          key = s.hash_keys[h];
          miss = s.union_keys[packed >> 16] == 1 &&
                 (packed & 0xFFFF) == i * K + k;
        }
        a.out_rows[e0 + k] = out;
        if (a.miss_mask != nullptr) a.miss_mask[e0 + k] = miss;
        if (a.resolved_g != nullptr) a.resolved_g[e0 + k] = key;
        in_round += out >= 0;
      }
      valid_count += round_count(in_round);
    }
    const int total = row_total(s, valid_count);
    if (threadIdx.x == 0) a.valid_counts[g.row0 + i] = total;
  }
}

__device__ void add_stats(const ResolveArgs& a, const Smem& s, int n_hits,
                          int n_miss) {
  if (threadIdx.x != 0 || a.stats == nullptr) return;
  atomicAdd(&a.stats[0], static_cast<unsigned long long>(n_hits));
  atomicAdd(&a.stats[1], static_cast<unsigned long long>(n_miss));
  if (a.stats_len >= 3) {
    atomicAdd(&a.stats[2], static_cast<unsigned long long>(s.ctr[kCtrTrips]));
  }
}

__global__ void __launch_bounds__(kResolveThreads, 1)
    resolve_residency_kernel(const ResolveArgs a, const int64_t num_rows) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem s = carve_smem(smem_raw, a.layout);
  const int64_t row = blockIdx.x;
  const int32_t req = a.row_req[row];
  const bool req_ok = req >= 0 && req < a.num_reqs;
  // Not the first row of its union group: the first row's CTA owns it.
  if (req_ok && row > 0 && a.row_req[row - 1] == req) return;
  if (!req_ok) {
    write_padding(a, row, 1);
    return;
  }
  Group g;
  g.row0 = row;
  g.req = req;
  g.state = a.req_state[req];  // load overlaps the group-size barrier
  g.n = group_rows(a, num_rows, row, req, s);
  if (g.state < 0 || g.state >= a.num_states) {
    write_padding(a, g.row0, g.n);
    return;
  }
  if (g.n > a.max_query_len) {  // caller broke the q-row contract
    write_padding(a, g.row0, g.n);
    if (threadIdx.x == 0 && a.stats != nullptr && a.stats_len >= 4) {
      atomicAdd(&a.stats[3], static_cast<unsigned long long>(g.n));
    }
    return;
  }

  init_hash(s);
  if (!classify_entries(a, g, s)) {  // resident short-circuit (INV-34)
    for (int64_t i = threadIdx.x; i < g.n; i += kResolveThreads) {
      a.plan_count[g.row0 + i] = 0;
    }
    return;
  }
  const int n_union = build_union(a, g, s);
  build_filter(s, n_union);
  scan_lru(a, g, s);
  const int n_hits = rank_hits(a, s);
  const int n_miss = n_union - n_hits;
  reorder_lru(a, g, s, n_hits, n_miss);
  assign_misses(a, g, s, n_union, n_hits, n_miss);
  store_state(a, g, s, n_miss);
  emit_entries(a, g, s);
  add_stats(a, s, n_hits, n_miss);
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
                       int64_t host_rows, int64_t block_size,
                       int64_t attn_block_stride, int64_t max_query_len,
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
  a.attn_stride = attn_block_stride;
  a.max_query_len = max_query_len;
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
