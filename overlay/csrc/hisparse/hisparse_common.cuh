// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Shared pieces of the HiSparse kernels (spec section 5): the resolver's
// shared-memory layout (the one function both the launcher and the startup
// preflight use), the byte-copy primitives with their width rule, and small
// warp/block helpers. Device code only depends on <cuda_runtime.h>.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace hisparse {

// One CTA of this many threads resolves one union group (spec 5.1).
constexpr int kResolveThreads = 1024;
constexpr int kResolveWarps = kResolveThreads / 32;
// Slot ids are int16 (lru), so the hot region holds at most this many rows.
constexpr int64_t kMaxHotSize = 32768;
// Warps per CTA of the byte movers (K2, K3, K5).
constexpr int kCopyWarps = 8;
constexpr int kCopyThreads = kCopyWarps * 32;

// ---------------------------------------------------------------------------
// Resolver shared memory (spec 5.1, normative sizes).
//
// With Umax = q*K, Hs = round_up(ceil(1.5*Umax), 32), C = ceil(max(H,Umax)/32)+1:
//   hash keys    int32[Hs]    key (host row g) per hash slot, -1 = empty
//   hash values  int32[Hs]    per key: first-hit position, then slot | miss
//                             bit | first flat index (packed)
//   union keys   int32[Umax]  Bloom filter of the union keys, then the
//                             per-row valid counts
//   scan A       int32[C]     ballot words, one bit per LRU position
//   scan B       int32[C]     ballot words, one bit per flat top-k entry
//   counters     int32[8]
//   union slots  int16[Umax]  per flat entry: its key's hash slot or a code
//   LRU output   int16[H]     the new lru row
// (resolve_residency.cu, struct Smem, says how each array is used.)
// total = 8*Hs + 6*Umax + 2*H + 8*C + 32 bytes. The int16 arrays are placed
// last (the spec lists them earlier) so every int32 array stays 4-B aligned
// and the hash arrays 16-B aligned (Hs is a multiple of 32).
// ---------------------------------------------------------------------------
struct ResolverSmemLayout {
  int64_t union_max;    // Umax
  int64_t hash_size;    // Hs
  int64_t scan_words;   // C
  int64_t hash_keys;    // byte offsets into the dynamic smem block
  int64_t hash_values;
  int64_t union_keys;
  int64_t scan_a;
  int64_t scan_b;
  int64_t counters;
  int64_t union_slots;
  int64_t lru_out;
  int64_t total_bytes;
};

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

__host__ __device__ inline ResolverSmemLayout resolver_smem_layout(
    int64_t top_k, int64_t max_query_len, int64_t hot_size) {
  ResolverSmemLayout l{};
  l.union_max = max_query_len * top_k;
  // ceil(1.5 * Umax) in integers, then a multiple of 32: load factor <= 2/3.
  l.hash_size = ceil_div(3 * l.union_max, 2);
  l.hash_size = ceil_div(l.hash_size, 32) * 32;
  const int64_t widest = hot_size > l.union_max ? hot_size : l.union_max;
  l.scan_words = ceil_div(widest, 32) + 1;
  int64_t off = 0;
  l.hash_keys = off;   off += 4 * l.hash_size;
  l.hash_values = off; off += 4 * l.hash_size;
  l.union_keys = off;  off += 4 * l.union_max;
  l.scan_a = off;      off += 4 * l.scan_words;
  l.scan_b = off;      off += 4 * l.scan_words;
  l.counters = off;    off += 4 * 8;
  l.union_slots = off; off += 2 * l.union_max;
  l.lru_out = off;     off += 2 * hot_size;
  l.total_bytes = off;
  return l;
}

// Attention row id of (block, offset): hma(r) = (r div B)*Sa + r mod B for
// r = block*B + offset, computed in 64 bit and stored as int32 (INV-14).
__host__ __device__ inline int32_t hma_row(int64_t block, int64_t offset,
                                           int64_t attn_block_stride) {
  return static_cast<int32_t>(block * attn_block_stride + offset);
}

// ---------------------------------------------------------------------------
// Byte copies (spec 5.0): width 16, 4 or 1 byte, chosen by the caller from
// the alignment of the source, the destination and the row size together.
// ld.global.cg / st.global.cg keep the streamed rows out of L1.
// ---------------------------------------------------------------------------
template <int kWidth>
struct CopyWord;
template <>
struct CopyWord<16> {
  using type = uint4;
};
template <>
struct CopyWord<4> {
  using type = unsigned int;
};
template <>
struct CopyWord<1> {
  using type = unsigned char;
};

template <typename T>
__device__ __forceinline__ T zero_word() {
  return T{};
}
template <>
__device__ __forceinline__ uint4 zero_word<uint4>() {
  return make_uint4(0u, 0u, 0u, 0u);
}

// One warp copies (or zero-fills, src == nullptr) `nbytes` bytes. The four
// independent loads per lane keep several host reads in flight per warp,
// which is what hides the PCIe round trip of zero-copy reads.
template <int kWidth>
__device__ __forceinline__ void warp_copy_bytes(const unsigned char* src,
                                                unsigned char* dst,
                                                int64_t nbytes, int lane) {
  using T = typename CopyWord<kWidth>::type;
  constexpr int kUnroll = 4;
  const int64_t n = nbytes / kWidth;
  const T* s = reinterpret_cast<const T*>(src);
  T* d = reinterpret_cast<T*>(dst);
  for (int64_t base = 0; base < n; base += 32 * kUnroll) {
    T v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      v[u] = zero_word<T>();
      if (src != nullptr && i < n) v[u] = __ldcg(s + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i < n) __stcg(d + i, v[u]);
    }
  }
}

// The copy width for a set of addresses/sizes OR-ed together.
__host__ __device__ inline int copy_width_for(uint64_t or_of_all) {
  if ((or_of_all & 15u) == 0) return 16;
  if ((or_of_all & 3u) == 0) return 4;
  return 1;
}

// ---------------------------------------------------------------------------
// Warp and block helpers.
// ---------------------------------------------------------------------------
__device__ __forceinline__ unsigned lane_mask_lt(int lane) {
  return (1u << lane) - 1u;
}

__device__ __forceinline__ int warp_inclusive_sum(int x, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x += y;
  }
  return x;
}

// Warp 0 turns ballot words into an exclusive prefix of their popcounts and
// returns the total in every lane of warp 0. A single warp walks the words
// 32 at a time: at most 1024 words (H = 32768), no extra scratch needed.
__device__ inline int warp_scan_words(const unsigned* words, int* prefix,
                                      int nwords, int lane) {
  int carry = 0;
  for (int base = 0; base < nwords; base += 32) {
    const int i = base + lane;
    const int x = i < nwords ? __popc(words[i]) : 0;
    const int inc = warp_inclusive_sum(x, lane);
    if (i < nwords) prefix[i] = carry + inc - x;
    carry += __shfl_sync(0xffffffffu, inc, 31);
  }
  return carry;
}

}  // namespace hisparse
