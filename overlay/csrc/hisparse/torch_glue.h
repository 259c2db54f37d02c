// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Host-side glue between the libtorch stable ABI and the HiSparse launchers:
// argument checks whose messages name the argument, the current stream, the
// device pointer of a host view, cached device attributes.
//
// Built with TORCH_TARGET_VERSION = 2.11, so one binary serves every torch
// >= 2.11 and only C-shim calls of that release are used.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/shim_utils.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>

namespace hisparse {

using torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;

inline const char* dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Byte: return "uint8";
    case ScalarType::Short: return "int16";
    case ScalarType::Int: return "int32";
    case ScalarType::Long: return "int64";
    case ScalarType::UInt64: return "uint64";
    default: return "another dtype";
  }
}

// A CUDA tensor on `device` with the given dtype and rank, contiguous.
inline void check_cuda(const Tensor& t, const char* name, ScalarType dtype,
                       int64_t dim, int device) {
  STD_TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  STD_TORCH_CHECK(t.get_device_index() == device, name,
                  " must be on cuda:", device, " (found cuda:",
                  static_cast<int>(t.get_device_index()), ")");
  STD_TORCH_CHECK(t.scalar_type() == dtype, name, " must be ",
                  dtype_name(dtype), " (found ", dtype_name(t.scalar_type()),
                  ")");
  STD_TORCH_CHECK(t.dim() == dim, name, " must have ", dim,
                  " dimension(s) (found ", t.dim(), ")");
  STD_TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

inline void check_size(const Tensor& t, const char* name, int64_t d,
                       int64_t expected, const char* what) {
  STD_TORCH_CHECK(t.size(d) == expected, name, ".size(", d, ") must equal ",
                  what, " = ", expected, " (found ", t.size(d), ")");
}

// K1's miss plan as K2 and K6 take it: plan_src/plan_dst int32 [rows, K],
// plan_count int32 [rows], on `device`. Returns {rows, K}.
struct PlanShape {
  int64_t rows;
  int64_t top_k;
};

inline PlanShape check_plan(const Tensor& plan_src, const Tensor& plan_dst,
                            const Tensor& plan_count, int device) {
  check_cuda(plan_src, "plan_src", ScalarType::Int, 2, device);
  const PlanShape p{plan_src.size(0), plan_src.size(1)};
  check_cuda(plan_dst, "plan_dst", ScalarType::Int, 2, device);
  check_size(plan_dst, "plan_dst", 0, p.rows, "plan_src.size(0)");
  check_size(plan_dst, "plan_dst", 1, p.top_k, "plan_src.size(1)");
  check_cuda(plan_count, "plan_count", ScalarType::Int, 1, device);
  check_size(plan_count, "plan_count", 0, p.rows, "plan_src.size(0)");
  return p;
}

inline cudaStream_t current_stream(int device) {
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device, &stream));
  return reinterpret_cast<cudaStream_t>(stream);
}

inline void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();
  STD_TORCH_CHECK(err == cudaSuccess, "hisparse_ops.", op,
                  " launch failed: ", cudaGetErrorString(err));
}

// Multiprocessor count and opt-in shared memory per block, cached per device
// (the launchers run every decode step; attribute queries are not free).
struct DeviceLimits {
  int sm_count = 0;
  int smem_optin = 0;
};
DeviceLimits device_limits(int device);

// Device-readable address of a byte-row source: a CUDA tensor on `device`,
// or a CPU tensor whose memory is pinned and mapped into the device address
// space. The spec (5.0) requires the CUDA pointer attributes rather than
// torch's is_pinned(), because the host pool is registered outside torch.
const unsigned char* device_readable_ptr(const Tensor& t, const char* name,
                                         int device);

}  // namespace hisparse
