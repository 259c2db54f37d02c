// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// K5b mirror_descriptors (docs/kernels.md): the row mirror's K5 descriptors
// of one step, built in one launch from the runner's slot mappings.
//
// Descriptor (l, t), l a mirrored layer and t a token of [first, first + n),
// stored at l * n + t: the token's row in the layer's resident group
// (r = resident_slots[pair_of_layer[l]][first + t], from the GPU slab) goes
// to its host row (h = source_slots[first + t]):
//   src    = src_base[l] + (r / B) * bytes_per_block + (r % B) * row_bytes
//   dst    = dst_base[l] + h * row_bytes
//   nbytes = row_bytes if r >= 0 and h >= 0 else 0 (padding: K5 skips it)
// with r and h clamped at 0 in the addresses. It replaces the dozen small
// tensor ops the Python build launched per step (bench-tax run 3: the
// largest HiSparse item of a decode step's host time).
//
// Grid: one thread per descriptor, 256 per CTA. The resident groups' slot
// mappings are separate persistent buffers of the runner; their addresses
// come in slot_ptrs (int64 [G], on the device).
#include "hisparse_common.cuh"
#include "ops.h"

namespace hisparse {
namespace {

constexpr int kMirrorThreads = 256;

__global__ void __launch_bounds__(kMirrorThreads)
    mirror_descriptors_kernel(const int64_t* slot_ptrs,
                              const int64_t* source_slots,
                              const int64_t* pair_of_layer,
                              const int64_t* src_base, const int64_t* dst_base,
                              int64_t* src, int64_t* dst, int64_t* nbytes,
                              const int64_t first, const int64_t n,
                              const int64_t count, const int64_t block_size,
                              const int64_t bytes_per_block,
                              const int64_t row_bytes) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kMirrorThreads +
                    threadIdx.x;
  if (i >= count) return;
  const int64_t l = i / n;
  const int64_t t = first + i % n;
  const auto* resident =
      reinterpret_cast<const int64_t*>(slot_ptrs[pair_of_layer[l]]);
  const int64_t r = resident[t];
  const int64_t h = source_slots[t];
  const int64_t rr = r > 0 ? r : 0;
  const int64_t hh = h > 0 ? h : 0;
  src[i] = src_base[l] + (rr / block_size) * bytes_per_block +
           (rr % block_size) * row_bytes;
  dst[i] = dst_base[l] + hh * row_bytes;
  nbytes[i] = (r >= 0 && h >= 0) ? row_bytes : 0;
}

}  // namespace

void mirror_descriptors(const Tensor& slot_ptrs, const Tensor& source_slots,
                        const Tensor& pair_of_layer, const Tensor& src_base,
                        const Tensor& dst_base, Tensor src, Tensor dst,
                        Tensor nbytes, int64_t first, int64_t n,
                        int64_t slot_len, int64_t block_size,
                        int64_t bytes_per_block, int64_t row_bytes) {
  using ST = ScalarType;
  STD_TORCH_CHECK(source_slots.is_cuda(), "source_slots must be a CUDA tensor");
  const int device = source_slots.get_device_index();
  check_cuda(slot_ptrs, "slot_ptrs", ST::Long, 1, device);
  check_cuda(source_slots, "source_slots", ST::Long, 1, device);
  check_cuda(pair_of_layer, "pair_of_layer", ST::Long, 1, device);
  check_cuda(src_base, "src_base", ST::Long, 1, device);
  check_cuda(dst_base, "dst_base", ST::Long, 1, device);
  check_cuda(src, "src", ST::Long, 1, device);
  check_cuda(dst, "dst", ST::Long, 1, device);
  check_cuda(nbytes, "nbytes", ST::Long, 1, device);
  const int64_t layers = pair_of_layer.size(0);
  check_size(src_base, "src_base", 0, layers, "pair_of_layer.size(0)");
  check_size(dst_base, "dst_base", 0, layers, "pair_of_layer.size(0)");
  STD_TORCH_CHECK(first >= 0 && n >= 0, "bad token range [", first, ", ",
                  first + n, ")");
  // The resident buffers' length comes from the caller (their addresses
  // are all the kernel sees); the source buffer's is checked here.
  STD_TORCH_CHECK(first + n <= slot_len && first + n <= source_slots.size(0),
                  "tokens [", first, ", ", first + n,
                  ") past the slot mappings (", slot_len, ", ",
                  source_slots.size(0), ")");
  const int64_t count = layers * n;
  STD_TORCH_CHECK(src.size(0) >= count && dst.size(0) >= count &&
                      nbytes.size(0) >= count,
                  "descriptor buffers hold fewer than ", count, " entries");
  STD_TORCH_CHECK(block_size > 0 && bytes_per_block > 0 && row_bytes > 0,
                  "block_size, bytes_per_block and row_bytes must be positive");
  if (count == 0) return;
  STD_TORCH_CHECK(count <= INT32_MAX * static_cast<int64_t>(kMirrorThreads),
                  "too many descriptors: ", count);
  const torch::stable::accelerator::DeviceGuard guard(device);
  const unsigned blocks =
      static_cast<unsigned>((count + kMirrorThreads - 1) / kMirrorThreads);
  mirror_descriptors_kernel<<<blocks, kMirrorThreads, 0,
                              current_stream(device)>>>(
      slot_ptrs.const_data_ptr<int64_t>(),
      source_slots.const_data_ptr<int64_t>(),
      pair_of_layer.const_data_ptr<int64_t>(),
      src_base.const_data_ptr<int64_t>(), dst_base.const_data_ptr<int64_t>(),
      src.mutable_data_ptr<int64_t>(), dst.mutable_data_ptr<int64_t>(),
      nbytes.mutable_data_ptr<int64_t>(), first, n, count, block_size,
      bytes_per_block, row_bytes);
  check_launch("mirror_descriptors");
}

}  // namespace hisparse
