// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// K4 invalidate_written_slots (spec 5.4, INV-41): after a forward, forget
// every hot entry whose host row was rewritten by that forward.
//
// dgi is one index group's [S, H] or every group's [G, S, H] (the runtime's
// stacked hot state): the groups share the tokens, their requests' slots and
// the written rows, so one launch serves all of them (a step's K4 is one
// launch whatever the layer count; P2).
//
// Grid: (written token t, group). Each CTA of 256 threads looks up the
// token's state slot (token_req -> req_state) and strides over that slot's
// dgi row of its group, setting each entry equal to written_g[t] to -1. Rows
// are read as int4 when the row start is 16-B aligned. Different tokens clear
// disjoint or identical entries with the same value, so the result does not
// depend on CTA order.
#include "hisparse_common.cuh"
#include "ops.h"

namespace hisparse {
namespace {

constexpr int kInvalidateThreads = 256;

template <bool kVector>
__global__ void __launch_bounds__(kInvalidateThreads)
    invalidate_kernel(int32_t* dgi, const int64_t num_states,
                      const int64_t hot_size, const int32_t* req_state,
                      const int64_t num_reqs, const int32_t* token_req,
                      const int64_t* written_g) {
  const int64_t t = blockIdx.x;
  dgi += static_cast<int64_t>(blockIdx.y) * num_states * hot_size;
  const int32_t r = token_req[t];
  if (r < 0 || r >= num_reqs) return;
  const int32_t s = req_state[r];
  const int64_t g = written_g[t];
  // dgi holds int32 rows: an id past INT32_MAX can match nothing.
  if (s < 0 || s >= num_states || g < 0 || g > INT32_MAX) return;
  const int32_t key = static_cast<int32_t>(g);
  int32_t* row = dgi + static_cast<int64_t>(s) * hot_size;
  if (kVector) {
    const int4* vec = reinterpret_cast<const int4*>(row);
    for (int64_t i = threadIdx.x; i < hot_size / 4; i += kInvalidateThreads) {
      const int4 v = vec[i];
      if (v.x == key) row[4 * i + 0] = -1;
      if (v.y == key) row[4 * i + 1] = -1;
      if (v.z == key) row[4 * i + 2] = -1;
      if (v.w == key) row[4 * i + 3] = -1;
    }
  } else {
    for (int64_t i = threadIdx.x; i < hot_size; i += kInvalidateThreads) {
      if (row[i] == key) row[i] = -1;
    }
  }
}

}  // namespace

void invalidate_written_slots(Tensor dgi, const Tensor& req_state,
                              const Tensor& token_req,
                              const Tensor& written_g) {
  using ST = ScalarType;
  STD_TORCH_CHECK(dgi.is_cuda(), "dgi must be a CUDA tensor");
  const int device = dgi.get_device_index();
  // [S, H] (one group) or [G, S, H] (every group, one launch).
  STD_TORCH_CHECK(dgi.dim() == 2 || dgi.dim() == 3,
                  "dgi must have 2 or 3 dimension(s) (found ", dgi.dim(), ")");
  check_cuda(dgi, "dgi", ST::Int, dgi.dim(), device);
  check_cuda(req_state, "req_state", ST::Int, 1, device);
  check_cuda(token_req, "token_req", ST::Int, 1, device);
  check_cuda(written_g, "written_g", ST::Long, 1, device);
  const int64_t tokens = token_req.size(0);
  check_size(written_g, "written_g", 0, tokens, "token_req.size(0)");
  STD_TORCH_CHECK(tokens <= INT32_MAX, "too many written tokens: ", tokens);
  const int64_t groups = dgi.dim() == 3 ? dgi.size(0) : 1;
  const int64_t num_states = dgi.size(dgi.dim() - 2);
  const int64_t hot_size = dgi.size(dgi.dim() - 1);
  STD_TORCH_CHECK(groups <= 65535, "too many index groups: ", groups);
  if (tokens == 0 || hot_size == 0 || num_states == 0 || groups == 0) return;
  const torch::stable::accelerator::DeviceGuard guard(device);
  int32_t* base = dgi.mutable_data_ptr<int32_t>();
  const bool vector =
      hot_size % 4 == 0 && reinterpret_cast<uintptr_t>(base) % 16 == 0;
  const cudaStream_t stream = current_stream(device);
  const auto launch = [&](auto kernel) {
    const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>(groups));
    kernel<<<grid, kInvalidateThreads, 0, stream>>>(
        base, num_states, hot_size, req_state.const_data_ptr<int32_t>(),
        req_state.size(0), token_req.const_data_ptr<int32_t>(),
        written_g.const_data_ptr<int64_t>());
  };
  if (vector) {
    launch(invalidate_kernel<true>);
  } else {
    launch(invalidate_kernel<false>);
  }
  check_launch("invalidate_written_slots");
}

}  // namespace hisparse
