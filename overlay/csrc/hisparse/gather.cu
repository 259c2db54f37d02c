// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// The byte movers: K2 gather_compact (spec 5.2), K3 gather_plan (5.3),
// K5 copy_descriptors (5.5) and K7's gather_ordered (docs/kernels.md P9).
//
// K2/K3 grid: a persistent, fully occupied grid (8 CTAs of 8 warps per SM,
// fewer for small plans) whose warps stride over the plan's cells in
// row-major order: warp w copies cells w, w + warps, ... one W-byte row
// each, with 16-, 4- or 1-byte ld/st.global.cg words (the width is chosen on
// the host from the alignment of every address term and W). Row-major order
// keeps the rows in flight within a few requests' host blocks at a time;
// spreading every row's columns over its own CTAs (the spec's suggested
// x = row, y = column split) kept all requests in flight at once and reached
// only ~0.7x the zero-copy ceiling on large plans (results/kernels).
// Every byte offset is int64 (INV-14).
#include "hisparse_common.cuh"
#include "ops.h"

#include <type_traits>

namespace hisparse {
namespace {

// Source rows: base + g*row_stride, g in [0, rows).
struct SrcRows {
  const unsigned char* base;  // device-readable (HBM or mapped host)
  int64_t row_stride;
  int64_t rows;
};

// Destination rows of a [N, B, W] view: base + (d/B)*block_stride +
// (d%B)*row_stride, d in [0, N*B).
struct DstRows {
  unsigned char* base;
  int64_t block_stride;
  int64_t row_stride;
  int64_t block_rows;  // B
  int64_t rows;        // N*B
};

// Spec 5.0: skip negative ids and out-of-range destinations; zero-fill a
// source id past the last source row instead of reading it.
template <int kWidth>
__device__ __forceinline__ void move_row(const SrcRows& src,
                                         const DstRows& dst, int64_t width,
                                         int64_t g, int64_t d, int lane) {
  if (g < 0 || d < 0 || d >= dst.rows) return;
  unsigned char* to = dst.base + (d / dst.block_rows) * dst.block_stride +
                      (d % dst.block_rows) * dst.row_stride;
  const unsigned char* from =
      g < src.rows ? src.base + g * src.row_stride : nullptr;
  warp_copy_bytes<kWidth>(from, to, width, lane);
}

__device__ __forceinline__ int64_t first_cell() {
  return static_cast<int64_t>(blockIdx.x) * kCopyWarps + (threadIdx.x >> 5);
}

__device__ __forceinline__ int64_t cell_stride() {
  return static_cast<int64_t>(gridDim.x) * kCopyWarps;
}

template <int kWidth>
__global__ void __launch_bounds__(kCopyThreads)
    gather_compact_kernel(const SrcRows src, const DstRows dst,
                          const int64_t width, const int32_t* plan_src,
                          const int32_t* plan_dst, const int32_t* plan_count,
                          const int64_t rows, const int64_t top_k) {
  const int lane = threadIdx.x & 31;
  const int64_t cells = rows * top_k;
  for (int64_t e = first_cell(); e < cells; e += cell_stride()) {
    const int64_t row = e / top_k;
    // For 0 <= j < K, j < plan_count is j < clamp(plan_count, 0, K).
    if (e - row * top_k >= plan_count[row]) continue;
    move_row<kWidth>(src, dst, width, plan_src[e], plan_dst[e], lane);
  }
}

// K7: the cells of order_step's sorted list, in list order (ascending host
// row), the first clamp(total, 0, cells) of them; each entry is a cell
// index into the plan, whose (src, dst) K2 would copy. Consecutive warps
// take consecutive entries, so the rows in flight are neighbours in the
// host pool whichever request planned them.
template <int kWidth>
__global__ void __launch_bounds__(kCopyThreads)
    gather_ordered_kernel(const SrcRows src, const DstRows dst,
                          const int64_t width, const int32_t* plan_src,
                          const int32_t* plan_dst, const int32_t* order,
                          const int32_t* total, const int64_t cells) {
  const int lane = threadIdx.x & 31;
  int64_t live = *total;
  live = live < 0 ? 0 : (live > cells ? cells : live);
  for (int64_t e = first_cell(); e < live; e += cell_stride()) {
    const int64_t c = order[e];
    if (c < 0 || c >= cells) continue;  // never an out-of-bounds read
    move_row<kWidth>(src, dst, width, plan_src[c], plan_dst[c], lane);
  }
}

template <int kWidth>
__global__ void __launch_bounds__(kCopyThreads)
    gather_plan_kernel(const SrcRows src, const DstRows dst,
                       const int64_t width, const int32_t* src_rows,
                       const int32_t* dst_rows, const int32_t* mask,
                       const int32_t* req_state, int32_t* out_rows,
                       const int64_t rows, const int64_t cols,
                       const int64_t attn_stride) {
  const int lane = threadIdx.x & 31;
  const int64_t cells = rows * cols;
  for (int64_t e = first_cell(); e < cells; e += cell_stride()) {
    if (req_state != nullptr && req_state[e / cols] < 0) {  // padding row
      if (out_rows != nullptr && lane == 0) out_rows[e] = -1;
      continue;
    }
    const int64_t d = dst_rows[e];
    if (out_rows != nullptr && lane == 0) {
      int32_t id = -1;
      if (d >= 0) {
        id = hma_row(d / dst.block_rows, d % dst.block_rows, attn_stride);
        id = id < 0 ? -1 : id;
      }
      out_rows[e] = id;
    }
    if (mask[e] != 0) move_row<kWidth>(src, dst, width, src_rows[e], d, lane);
  }
}

// K5: warp (x*8 + w) owns descriptor x*8 + w; grid.y splits long runs into
// kSegmentBytes pieces so a few large descriptors still use many SMs.
constexpr int64_t kSegmentBytes = 16 * 1024;

__global__ void __launch_bounds__(kCopyThreads)
    copy_descriptors_kernel(const int64_t* src_ptr, const int64_t* dst_ptr,
                            const int64_t* nbytes, const int64_t count) {
  const int lane = threadIdx.x & 31;
  const int64_t desc =
      static_cast<int64_t>(blockIdx.x) * kCopyWarps + (threadIdx.x >> 5);
  if (desc >= count) return;
  const int64_t n = nbytes[desc];
  const uint64_t s = static_cast<uint64_t>(src_ptr[desc]);
  const uint64_t d = static_cast<uint64_t>(dst_ptr[desc]);
  if (n <= 0 || s == 0 || d == 0) return;
  const int width = copy_width_for(s | d | static_cast<uint64_t>(n));
  for (int64_t off = blockIdx.y * kSegmentBytes; off < n;
       off += static_cast<int64_t>(gridDim.y) * kSegmentBytes) {
    const int64_t len = n - off < kSegmentBytes ? n - off : kSegmentBytes;
    const auto* from = reinterpret_cast<const unsigned char*>(s + off);
    auto* to = reinterpret_cast<unsigned char*>(d + off);
    if (width == 16) {
      warp_copy_bytes<16>(from, to, len, lane);
    } else if (width == 4) {
      warp_copy_bytes<4>(from, to, len, lane);
    } else {
      warp_copy_bytes<1>(from, to, len, lane);
    }
  }
}

// ---------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------

struct ByteViews {
  SrcRows src;
  DstRows dst;
  int64_t width;  // W
  int copy_width;
};

// src: [rows, W] uint8 rows (HBM or mapped host); dst: [N, B, W] uint8 view
// of the device slab with any block/row stride (hot, resident or staging).
ByteViews check_byte_views(const Tensor& src, const Tensor& dst,
                           int device) {
  using ST = ScalarType;
  STD_TORCH_CHECK(dst.is_cuda() && dst.get_device_index() == device,
                  "dst must be a CUDA tensor on cuda:", device);
  STD_TORCH_CHECK(dst.scalar_type() == ST::Byte,
                  "dst must be uint8 (view the slab as bytes)");
  STD_TORCH_CHECK(dst.dim() == 3, "dst must be a [blocks, block_size, W] "
                  "view (found ", dst.dim(), " dimensions)");
  STD_TORCH_CHECK(dst.stride(2) == 1, "dst rows must be contiguous bytes");
  STD_TORCH_CHECK(src.scalar_type() == ST::Byte,
                  "src must be uint8 (view the host pool as bytes)");
  STD_TORCH_CHECK(src.dim() == 2, "src must be a [rows, W] view (found ",
                  src.dim(), " dimensions)");
  STD_TORCH_CHECK(src.stride(1) == 1, "src rows must be contiguous bytes");
  check_size(src, "src", 1, dst.size(2), "dst.size(2) (W)");
  ByteViews v{};
  v.width = dst.size(2);
  STD_TORCH_CHECK(v.width % 16 == 0, "row size W must be a multiple of 16 "
                  "bytes (found ", v.width, ")");
  v.src.base = device_readable_ptr(src, "src", device);
  v.src.row_stride = src.stride(0);
  v.src.rows = src.size(0);
  v.dst.base = static_cast<unsigned char*>(dst.mutable_data_ptr());
  v.dst.block_stride = dst.stride(0);
  v.dst.row_stride = dst.stride(1);
  v.dst.block_rows = dst.size(1);
  v.dst.rows = dst.size(0) * dst.size(1);
  STD_TORCH_CHECK(v.dst.block_rows >= 1 || v.dst.rows == 0,
                  "dst.size(1) (block_size) must be >= 1");
  const uint64_t terms =
      reinterpret_cast<uint64_t>(v.src.base) |
      static_cast<uint64_t>(v.src.row_stride) |
      reinterpret_cast<uint64_t>(v.dst.base) |
      static_cast<uint64_t>(v.dst.block_stride) |
      static_cast<uint64_t>(v.dst.row_stride) |
      static_cast<uint64_t>(v.width);
  v.copy_width = copy_width_for(terms);
  return v;
}

// Full occupancy (8 CTAs of 256 threads per SM), or one warp per cell for
// plans smaller than that.
unsigned copy_grid(int device, int64_t cells) {
  const int64_t sms = device_limits(device).sm_count;
  const int64_t needed = ceil_div(cells, kCopyWarps);
  const int64_t full = 8 * sms;
  return static_cast<unsigned>(needed < full ? needed : full);
}

template <typename Launch>
void dispatch_width(int copy_width, Launch&& launch) {
  if (copy_width == 16) {
    launch(std::integral_constant<int, 16>{});
  } else if (copy_width == 4) {
    launch(std::integral_constant<int, 4>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
}

}  // namespace

void gather_compact(const Tensor& src, Tensor dst, const Tensor& plan_src,
                    const Tensor& plan_dst, const Tensor& plan_count) {
  STD_TORCH_CHECK(dst.is_cuda(), "dst must be a CUDA tensor");
  const int device = dst.get_device_index();
  const PlanShape plan = check_plan(plan_src, plan_dst, plan_count, device);
  const int64_t rows = plan.rows;
  const int64_t top_k = plan.top_k;
  const torch::stable::accelerator::DeviceGuard guard(device);
  const ByteViews v = check_byte_views(src, dst, device);
  if (rows == 0 || top_k == 0 || v.dst.rows == 0) return;
  const unsigned grid = copy_grid(device, rows * top_k);
  const cudaStream_t stream = current_stream(device);
  const int32_t* ps = plan_src.const_data_ptr<int32_t>();
  const int32_t* pd = plan_dst.const_data_ptr<int32_t>();
  const int32_t* pc = plan_count.const_data_ptr<int32_t>();
  dispatch_width(v.copy_width, [&](auto w) {
    gather_compact_kernel<decltype(w)::value><<<grid, kCopyThreads, 0, stream>>>(
        v.src, v.dst, v.width, ps, pd, pc, rows, top_k);
  });
  check_launch("gather_compact");
}

void gather_ordered(const Tensor& src, Tensor dst, const Tensor& plan_src,
                    const Tensor& plan_dst, const Tensor& order,
                    const Tensor& total) {
  using ST = ScalarType;
  STD_TORCH_CHECK(dst.is_cuda(), "dst must be a CUDA tensor");
  const int device = dst.get_device_index();
  check_cuda(plan_src, "plan_src", ST::Int, 2, device);
  const int64_t cells = plan_src.numel();
  check_cuda(plan_dst, "plan_dst", ST::Int, 2, device);
  check_size(plan_dst, "plan_dst", 0, plan_src.size(0), "plan_src.size(0)");
  check_size(plan_dst, "plan_dst", 1, plan_src.size(1), "plan_src.size(1)");
  check_cuda(order, "order", ST::Int, 1, device);
  check_size(order, "order", 0, cells, "plan_src.numel()");
  check_cuda(total, "total", ST::Int, 1, device);
  check_size(total, "total", 0, 1, "1");
  const torch::stable::accelerator::DeviceGuard guard(device);
  const ByteViews v = check_byte_views(src, dst, device);
  if (cells == 0 || v.dst.rows == 0) return;
  // Sized for every cell: the live count is on the device only.
  const unsigned grid = copy_grid(device, cells);
  const cudaStream_t stream = current_stream(device);
  const int32_t* ps = plan_src.const_data_ptr<int32_t>();
  const int32_t* pd = plan_dst.const_data_ptr<int32_t>();
  const int32_t* od = order.const_data_ptr<int32_t>();
  const int32_t* tot = total.const_data_ptr<int32_t>();
  dispatch_width(v.copy_width, [&](auto w) {
    gather_ordered_kernel<decltype(w)::value><<<grid, kCopyThreads, 0, stream>>>(
        v.src, v.dst, v.width, ps, pd, od, tot, cells);
  });
  check_launch("gather_ordered");
}

void gather_plan(const Tensor& src, Tensor dst, const Tensor& src_rows,
                 const Tensor& dst_rows, const Tensor& mask,
                 std::optional<Tensor> req_state,
                 std::optional<Tensor> out_rows, int64_t attn_block_stride) {
  using ST = ScalarType;
  STD_TORCH_CHECK(dst.is_cuda(), "dst must be a CUDA tensor");
  const int device = dst.get_device_index();
  check_cuda(src_rows, "src_rows", ST::Int, 2, device);
  const int64_t rows = src_rows.size(0);
  const int64_t cols = src_rows.size(1);
  check_cuda(dst_rows, "dst_rows", ST::Int, 2, device);
  check_size(dst_rows, "dst_rows", 0, rows, "src_rows.size(0)");
  check_size(dst_rows, "dst_rows", 1, cols, "src_rows.size(1)");
  check_cuda(mask, "mask", ST::Int, 2, device);
  check_size(mask, "mask", 0, rows, "src_rows.size(0)");
  check_size(mask, "mask", 1, cols, "src_rows.size(1)");
  if (req_state.has_value()) {
    check_cuda(*req_state, "req_state", ST::Int, 1, device);
    STD_TORCH_CHECK(req_state->size(0) >= rows,
                    "req_state.size(0) must be >= src_rows.size(0) = ", rows,
                    " (found ", req_state->size(0), ")");
  }
  if (out_rows.has_value()) {
    check_cuda(*out_rows, "out_rows", ST::Int, 2, device);
    check_size(*out_rows, "out_rows", 0, rows, "src_rows.size(0)");
    check_size(*out_rows, "out_rows", 1, cols, "src_rows.size(1)");
  }
  const torch::stable::accelerator::DeviceGuard guard(device);
  const ByteViews v = check_byte_views(src, dst, device);
  STD_TORCH_CHECK(attn_block_stride >= v.dst.block_rows,
                  "attn_block_stride must be >= dst.size(1) (found ",
                  attn_block_stride, ")");
  if (rows == 0 || cols == 0) return;
  const unsigned grid = copy_grid(device, rows * cols);
  const cudaStream_t stream = current_stream(device);
  const int32_t* sr = src_rows.const_data_ptr<int32_t>();
  const int32_t* dr = dst_rows.const_data_ptr<int32_t>();
  const int32_t* mk = mask.const_data_ptr<int32_t>();
  const int32_t* rs = req_state ? req_state->const_data_ptr<int32_t>() : nullptr;
  int32_t* orow = out_rows ? out_rows->mutable_data_ptr<int32_t>() : nullptr;
  dispatch_width(v.copy_width, [&](auto w) {
    gather_plan_kernel<decltype(w)::value><<<grid, kCopyThreads, 0, stream>>>(
        v.src, v.dst, v.width, sr, dr, mk, rs, orow, rows, cols,
        attn_block_stride);
  });
  check_launch("gather_plan");
}

void copy_descriptors(const Tensor& src_ptr, const Tensor& dst_ptr,
                      const Tensor& nbytes) {
  using ST = ScalarType;
  STD_TORCH_CHECK(src_ptr.is_cuda(), "src_ptr must be a CUDA tensor");
  const int device = src_ptr.get_device_index();
  check_cuda(src_ptr, "src_ptr", ST::Long, 1, device);
  const int64_t count = src_ptr.size(0);
  check_cuda(dst_ptr, "dst_ptr", ST::Long, 1, device);
  check_size(dst_ptr, "dst_ptr", 0, count, "src_ptr.size(0)");
  check_cuda(nbytes, "nbytes", ST::Long, 1, device);
  check_size(nbytes, "nbytes", 0, count, "src_ptr.size(0)");
  if (count == 0) return;
  const torch::stable::accelerator::DeviceGuard guard(device);
  const int64_t ctas = ceil_div(count, kCopyWarps);
  STD_TORCH_CHECK(ctas <= INT32_MAX, "too many descriptors: ", count);
  const int64_t sms = device_limits(device).sm_count;
  int64_t split = ceil_div(2 * sms, ctas);
  split = split < 1 ? 1 : (split > 64 ? 64 : split);
  const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(split));
  copy_descriptors_kernel<<<grid, kCopyThreads, 0, current_stream(device)>>>(
      src_ptr.const_data_ptr<int64_t>(), dst_ptr.const_data_ptr<int64_t>(),
      nbytes.const_data_ptr<int64_t>(), count);
  check_launch("copy_descriptors");
}

}  // namespace hisparse
