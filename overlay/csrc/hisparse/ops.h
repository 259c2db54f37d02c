// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Host entry points of the hisparse_ops extension (spec section 5). Each
// launches on the current CUDA stream of its tensors' device, performs no
// host synchronisation and allocates nothing, so it can be captured in a
// CUDA graph (INV-32).
#pragma once

#include "torch_glue.h"

namespace hisparse {

// K1 (spec 5.1).
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
                       std::optional<Tensor> stats);

// Shared-memory bytes of one resolver CTA: the preflight's number (K-13).
int64_t resolver_smem_bytes(int64_t top_k, int64_t max_query_len,
                            int64_t hot_size);

// K2 (spec 5.2).
void gather_compact(const Tensor& src, Tensor dst, const Tensor& plan_src,
                    const Tensor& plan_dst, const Tensor& plan_count);

// K6 (docs/kernels.md P9): each row's first plan_count cells sorted by
// source row, in place; rows of at most 2048 cells.
void order_plan(Tensor plan_src, Tensor plan_dst, const Tensor& plan_count);

// K7 (docs/kernels.md P9): the step's live plan cells as one list sorted by
// source row (stable), through CUB radix sort over bit_length(host_rows)
// bits; keys/cells/sorted_* int32 [rows*K], total int32 [1], temp uint8
// of at least order_step_temp_bytes(rows*K, host_rows, device) bytes.
void order_step(const Tensor& plan_src, const Tensor& plan_count,
                int64_t host_rows, Tensor keys, Tensor cells,
                Tensor sorted_keys, Tensor sorted_cells, Tensor total,
                Tensor temp);

// Bytes of CUB temporary storage order_step needs for `cells` plan cells
// (queried once, when the workspace is allocated).
int64_t order_step_temp_bytes(int64_t cells, int64_t host_rows,
                              int64_t device);

// K7's gather: K2's copies of the first clamp(total, 0, cells) cells of
// order_step's sorted list, in list order.
void gather_ordered(const Tensor& src, Tensor dst, const Tensor& plan_src,
                    const Tensor& plan_dst, const Tensor& order,
                    const Tensor& total);

// K3 (spec 5.3).
void gather_plan(const Tensor& src, Tensor dst, const Tensor& src_rows,
                 const Tensor& dst_rows, const Tensor& mask,
                 std::optional<Tensor> req_state,
                 std::optional<Tensor> out_rows, int64_t attn_block_stride);

// K4 (spec 5.4).
void invalidate_written_slots(Tensor dgi, const Tensor& req_state,
                              const Tensor& token_req,
                              const Tensor& written_g);

// K5 (spec 5.5).
void copy_descriptors(const Tensor& src_ptr, const Tensor& dst_ptr,
                      const Tensor& nbytes);

// K5b (docs/kernels.md): the row mirror's K5 descriptors of one step.
void mirror_descriptors(const Tensor& slot_ptrs, const Tensor& source_slots,
                        const Tensor& pair_of_layer, const Tensor& src_base,
                        const Tensor& dst_base, Tensor src, Tensor dst,
                        Tensor nbytes, int64_t first, int64_t n,
                        int64_t slot_len, int64_t block_size,
                        int64_t bytes_per_block, int64_t row_bytes);

}  // namespace hisparse
