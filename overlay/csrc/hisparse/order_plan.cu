// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// K6 order_plan (docs/kernels.md P9): each plan row's first plan_count
// cells sorted by source row, i.e. by host address, so that K2's warps,
// which stride over the cells in row-major order, read the host pool in
// address order. Random 656-byte reads of a 16 GiB pool ran at 0.41x the
// sequential zero-copy ceiling, K1's order (first reference) at 0.65x and
// sorted rows at 0.92x (results/kernels/run-p9). The (src, dst) pairs of a
// row are the same afterwards (INV-36), and a row's sources are distinct
// (K1 plans each missed key of a union group once), so the order is
// unique. Cells past the count are not touched.
//
// One CTA per row: the count's cells are loaded into shared memory (padded
// to a power of two with keys past every row id) and bitonic-sorted there.
#include "hisparse_common.cuh"
#include "ops.h"

#include <cstdint>

namespace hisparse {
namespace {

constexpr int kOrderThreads = 512;
constexpr int64_t kOrderMaxCells = 2048;  // top_k of GLM-5.x and DSv3.2

__device__ __forceinline__ void compare_exchange(int64_t* keys, int32_t* vals,
                                                 int i, int p, bool up) {
  const int64_t a = keys[i];
  const int64_t b = keys[p];
  if ((a > b) == up) {
    keys[i] = b;
    keys[p] = a;
    const int32_t v = vals[i];
    vals[i] = vals[p];
    vals[p] = v;
  }
}

__global__ void __launch_bounds__(kOrderThreads)
    order_plan_kernel(int32_t* plan_src, int32_t* plan_dst,
                      const int32_t* plan_count, int64_t top_k, int cap) {
  extern __shared__ int64_t order_smem[];
  int64_t* keys = order_smem;
  int32_t* vals = reinterpret_cast<int32_t*>(order_smem + cap);
  const int64_t row = blockIdx.x;
  int count = plan_count[row];
  count = count < 0 ? 0 : (count > top_k ? static_cast<int>(top_k) : count);
  if (count <= 1) return;  // block-uniform
  int n = 1;
  while (n < count) n <<= 1;
  int32_t* src = plan_src + row * top_k;
  int32_t* dst = plan_dst + row * top_k;
  for (int i = threadIdx.x; i < n; i += kOrderThreads) {
    // Padding sorts after every int32 source: the first count cells out
    // are exactly the row's cells.
    keys[i] = i < count ? static_cast<int64_t>(src[i]) : INT64_MAX;
    vals[i] = i < count ? dst[i] : -1;
  }
  __syncthreads();
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < n; i += kOrderThreads) {
        const int p = i ^ j;
        if (p > i) compare_exchange(keys, vals, i, p, (i & k) == 0);
      }
      __syncthreads();
    }
  }
  for (int i = threadIdx.x; i < count; i += kOrderThreads) {
    src[i] = static_cast<int32_t>(keys[i]);
    dst[i] = vals[i];
  }
}

}  // namespace

void order_plan(Tensor plan_src, Tensor plan_dst, const Tensor& plan_count) {
  STD_TORCH_CHECK(plan_src.is_cuda(), "plan_src must be a CUDA tensor");
  const int device = plan_src.get_device_index();
  const PlanShape plan = check_plan(plan_src, plan_dst, plan_count, device);
  const int64_t rows = plan.rows;
  const int64_t top_k = plan.top_k;
  STD_TORCH_CHECK(top_k <= kOrderMaxCells, "order_plan sorts rows of at most ",
                  kOrderMaxCells, " cells (plan_src.size(1) = ", top_k, ")");
  const torch::stable::accelerator::DeviceGuard guard(device);
  if (rows == 0 || top_k <= 1) return;
  int cap = 1;
  while (cap < top_k) cap <<= 1;
  const size_t smem = static_cast<size_t>(cap) * (sizeof(int64_t) + sizeof(int32_t));
  order_plan_kernel<<<static_cast<unsigned>(rows), kOrderThreads, smem,
                      current_stream(device)>>>(
      plan_src.mutable_data_ptr<int32_t>(), plan_dst.mutable_data_ptr<int32_t>(),
      plan_count.const_data_ptr<int32_t>(), top_k, cap);
  check_launch("order_plan");
}

}  // namespace hisparse
