// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// K7 order_step (docs/kernels.md P9): the step's miss cells as one flat
// list in ascending host-row order, for K7's gather (gather_ordered in
// gather.cu). Per-row order (K6) left the rows of different requests
// interleaved in K2's row-major walk and reached 0.74x of the sequential
// zero-copy ceiling at a 16 GiB pool; the same cells sorted across the
// whole step reached 0.89x (results/kernels/run-p9-k6).
//
// Two launches on the current stream, nothing else:
//   1. keys: cell i = row*K + j of the plan gets key min(src, pad - 1) and
//      value i when j < clamp(count[row], 0, K), else key pad and value -1.
//      pad = 2^bits - 1 with bits = bit_length(host_rows): every host row
//      is below it, so the live cells sort first. CTA 0 also writes the
//      live total (the sum of the clamped counts).
//   2. cub::DeviceRadixSort::SortPairs over bits [0, bits): stable, so
//      equal keys keep their cell order and the result is unique (the
//      reference sorts the same way). A 16 GiB pool of 656-B rows needs 25
//      bits: four 8-bit passes instead of a full 32-bit sort.
// The values are cell indices, not destinations: the plan stays as K1
// wrote it, and the gather reads each cell's (src, dst) through its index,
// so out-of-range sources keep K2's zero-fill / skip rules exactly and the
// (src, dst) pairs cannot change (INV-36).
//
// The CUB temporary storage is the caller's (order_step_temp_bytes sizes
// it once per capacity), so a launch allocates nothing and never
// synchronises: it can be captured in a CUDA graph (INV-32).
#include "hisparse_common.cuh"
#include "ops.h"

#include <cub/block/block_reduce.cuh>
#include <cub/device/device_radix_sort.cuh>

#include <cstdint>

namespace hisparse {
namespace {

constexpr int kKeyThreads = 256;

// bit_length(max(host_rows, 1)): host rows are < 2^31 (INV-14), so <= 31.
int key_bits(int64_t host_rows) {
  int bits = 1;
  while (bits < 31 && (int64_t{1} << bits) <= host_rows) ++bits;
  return bits;
}

__global__ void __launch_bounds__(kKeyThreads)
    order_step_keys_kernel(const int32_t* plan_src, const int32_t* plan_count,
                           int64_t rows, int64_t top_k, uint32_t pad,
                           uint32_t* keys, int32_t* cells, int32_t* total) {
  const int64_t n = rows * top_k;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kKeyThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kKeyThreads +
                   threadIdx.x;
       i < n; i += stride) {
    const int64_t row = i / top_k;
    // For 0 <= j < K, j < plan_count is j < clamp(plan_count, 0, K).
    const bool live = i - row * top_k < plan_count[row];
    // A negative source reads as a huge unsigned one: both clamp to
    // pad - 1, below the padding (K2 skips or zero-fills them anyway).
    const uint32_t src = static_cast<uint32_t>(plan_src[i]);
    keys[i] = live ? (src < pad ? src : pad - 1) : pad;
    cells[i] = live ? static_cast<int32_t>(i) : -1;
  }
  if (blockIdx.x != 0) return;
  using Reduce = cub::BlockReduce<int32_t, kKeyThreads>;
  __shared__ typename Reduce::TempStorage scratch;
  int32_t sum = 0;  // <= rows * K < 2^31 (checked on the host)
  for (int64_t r = threadIdx.x; r < rows; r += kKeyThreads) {
    const int64_t c = plan_count[r];
    sum += static_cast<int32_t>(c < 0 ? 0 : (c > top_k ? top_k : c));
  }
  sum = Reduce(scratch).Sum(sum);
  if (threadIdx.x == 0) *total = sum;
}

// The one SortPairs instantiation: query (temp == nullptr) or sort.
cudaError_t radix_sort(void* temp, size_t& temp_bytes, const uint32_t* keys,
                       uint32_t* sorted_keys, const int32_t* cells,
                       int32_t* sorted_cells, int n, int bits,
                       cudaStream_t stream) {
  return cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, sorted_keys,
                                         cells, sorted_cells, n, 0, bits,
                                         stream);
}

size_t query_temp_bytes(int64_t n, int bits) {
  size_t bytes = 0;
  const cudaError_t err =
      radix_sort(nullptr, bytes, nullptr, nullptr, nullptr, nullptr,
                 static_cast<int>(n), bits, nullptr);
  if (err != cudaSuccess) cudaGetLastError();
  STD_TORCH_CHECK(err == cudaSuccess, "hisparse_ops.order_step: the sort's "
                  "temporary storage query failed: ", cudaGetErrorString(err));
  return bytes;
}

void check_cells(const Tensor& t, const char* name, int64_t n, int device) {
  check_cuda(t, name, ScalarType::Int, 1, device);
  check_size(t, name, 0, n, "plan_src.numel()");
}

void check_host_rows(int64_t host_rows) {
  STD_TORCH_CHECK(host_rows >= 0 && host_rows <= INT32_MAX, "host_rows=",
                  host_rows, " must be in [0, 2^31) (INV-14)");
}

}  // namespace

int64_t order_step_temp_bytes(int64_t cells, int64_t host_rows,
                              int64_t device) {
  STD_TORCH_CHECK(cells >= 0 && cells <= INT32_MAX, "cells=", cells,
                  " must be in [0, 2^31)");
  check_host_rows(host_rows);
  if (cells == 0) return 0;
  const torch::stable::accelerator::DeviceGuard guard(
      static_cast<int32_t>(device));
  return static_cast<int64_t>(query_temp_bytes(cells, key_bits(host_rows)));
}

void order_step(const Tensor& plan_src, const Tensor& plan_count,
                int64_t host_rows, Tensor keys, Tensor cells,
                Tensor sorted_keys, Tensor sorted_cells, Tensor total,
                Tensor temp) {
  using ST = ScalarType;
  STD_TORCH_CHECK(plan_src.is_cuda(), "plan_src must be a CUDA tensor");
  const int device = plan_src.get_device_index();
  check_cuda(plan_src, "plan_src", ST::Int, 2, device);
  const int64_t rows = plan_src.size(0);
  const int64_t top_k = plan_src.size(1);
  check_cuda(plan_count, "plan_count", ST::Int, 1, device);
  check_size(plan_count, "plan_count", 0, rows, "plan_src.size(0)");
  check_host_rows(host_rows);
  const int64_t n = rows * top_k;
  STD_TORCH_CHECK(n <= INT32_MAX, "order_step: plan_src holds ", n,
                  " cells; cell ids must fit int32");
  check_cells(keys, "keys", n, device);
  check_cells(cells, "cells", n, device);
  check_cells(sorted_keys, "sorted_keys", n, device);
  check_cells(sorted_cells, "sorted_cells", n, device);
  check_cuda(total, "total", ST::Int, 1, device);
  check_size(total, "total", 0, 1, "1");
  check_cuda(temp, "temp", ST::Byte, 1, device);
  if (n == 0) return;
  // CUB reads a null temp pointer as a size query and sorts nothing.
  STD_TORCH_CHECK(temp.numel() > 0, "temp is empty; size it with "
                  "order_step_temp_bytes");
  const torch::stable::accelerator::DeviceGuard guard(device);
  const cudaStream_t stream = current_stream(device);
  const int bits = key_bits(host_rows);
  const uint32_t pad = (uint32_t{1} << bits) - 1;
  auto* k_in = reinterpret_cast<uint32_t*>(keys.mutable_data_ptr<int32_t>());
  auto* k_out =
      reinterpret_cast<uint32_t*>(sorted_keys.mutable_data_ptr<int32_t>());
  int32_t* c_in = cells.mutable_data_ptr<int32_t>();
  int32_t* c_out = sorted_cells.mutable_data_ptr<int32_t>();
  const int64_t sms = device_limits(device).sm_count;
  const int64_t blocks = ceil_div(n, kKeyThreads);
  const unsigned grid =
      static_cast<unsigned>(blocks < 8 * sms ? blocks : 8 * sms);
  order_step_keys_kernel<<<grid, kKeyThreads, 0, stream>>>(
      plan_src.const_data_ptr<int32_t>(), plan_count.const_data_ptr<int32_t>(),
      rows, top_k, pad, k_in, c_in, total.mutable_data_ptr<int32_t>());
  check_launch("order_step");
  size_t temp_bytes = static_cast<size_t>(temp.numel());
  const cudaError_t err =
      radix_sort(temp.mutable_data_ptr(), temp_bytes, k_in, k_out, c_in,
                 c_out, static_cast<int>(n), bits, stream);
  if (err != cudaSuccess) {
    cudaGetLastError();
    STD_TORCH_CHECK(false, "hisparse_ops.order_step: the sort failed (",
                    cudaGetErrorString(err), "); temp holds ", temp.numel(),
                    " B, ", query_temp_bytes(n, bits), " B are needed "
                    "(order_step_temp_bytes)");
  }
}

}  // namespace hisparse
