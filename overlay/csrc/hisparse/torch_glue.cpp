// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#include "torch_glue.h"

#include <array>
#include <mutex>

namespace hisparse {

namespace {
constexpr int kMaxDevices = 64;

void check_cuda_call(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so torch is not blamed
    STD_TORCH_CHECK(false, "hisparse_ops: ", what, " failed: ",
                    cudaGetErrorString(err));
  }
}
}  // namespace

DeviceLimits device_limits(int device) {
  static std::array<DeviceLimits, kMaxDevices> cache{};
  static std::array<std::once_flag, kMaxDevices> once;
  STD_TORCH_CHECK(device >= 0 && device < kMaxDevices,
                  "hisparse_ops: CUDA device index ", device,
                  " is out of range");
  std::call_once(once[device], [device] {
    DeviceLimits l;
    check_cuda_call(cudaDeviceGetAttribute(&l.sm_count,
                                           cudaDevAttrMultiProcessorCount,
                                           device),
                    "cudaDeviceGetAttribute(MultiProcessorCount)");
    check_cuda_call(
        cudaDeviceGetAttribute(&l.smem_optin,
                               cudaDevAttrMaxSharedMemoryPerBlockOptin,
                               device),
        "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
    cache[device] = l;
  });
  return cache[device];
}

const unsigned char* device_readable_ptr(const Tensor& t, const char* name,
                                         int device) {
  if (t.numel() == 0) return nullptr;  // no rows: every id zero-fills
  const void* host = t.const_data_ptr();
  if (t.is_cuda()) {
    STD_TORCH_CHECK(t.get_device_index() == device, name,
                    " must be on cuda:", device, " or pinned host memory");
    return static_cast<const unsigned char*>(host);
  }
  STD_TORCH_CHECK(t.is_cpu(), name,
                  " must be a CUDA tensor or pinned, device-mapped host "
                  "memory");
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, host);
  if (err != cudaSuccess) cudaGetLastError();
  STD_TORCH_CHECK(err == cudaSuccess && attr.type == cudaMemoryTypeHost &&
                      attr.devicePointer != nullptr,
                  name,
                  " is a CPU tensor that is not pinned and device-mapped; "
                  "register it with cudaHostRegister(..., "
                  "cudaHostRegisterMapped) or allocate it pinned");
  return static_cast<const unsigned char*>(attr.devicePointer);
}

}  // namespace hisparse
