// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// torch.ops.hisparse_ops.* registration through the libtorch stable ABI.
// Schemas mark every tensor an op writes (Tensor(a!)) so torch.compile and
// functionalization see the mutations. Ops whose tensors are all on the GPU
// dispatch to CUDA; the gathers may also take a pinned host source, which the
// dispatcher routes to the CUDA kernel as well (CUDA outranks CPU).
#include "ops.h"

STABLE_TORCH_LIBRARY(hisparse_ops, m) {
  m.def(
      "resolve_residency(Tensor topk, Tensor row_req, Tensor seq_lens, "
      "Tensor req_state, Tensor src_bt, Tensor res_bt, Tensor hot_bt, "
      "Tensor(a!) dgi, Tensor(b!) lru, int host_rows, int num_gpu_blocks, "
      "int block_size, int attn_block_stride, int max_query_len, "
      "Tensor(c!) out_rows, Tensor(d!) valid_counts, Tensor(e!) plan_src, "
      "Tensor(f!) plan_dst, Tensor(g!) plan_count, "
      "Tensor(h!)? miss_mask=None, Tensor(i!)? resolved_g=None, "
      "Tensor(j!)? stats=None) -> ()");
  m.def(
      "gather_compact(Tensor src, Tensor(a!) dst, Tensor plan_src, "
      "Tensor plan_dst, Tensor plan_count) -> ()");
  m.def(
      "order_plan(Tensor(a!) plan_src, Tensor(b!) plan_dst, "
      "Tensor plan_count) -> ()");
  m.def(
      "order_step(Tensor plan_src, Tensor plan_count, int host_rows, "
      "Tensor(a!) keys, Tensor(b!) cells, Tensor(c!) sorted_keys, "
      "Tensor(d!) sorted_cells, Tensor(e!) total, Tensor(f!) temp) -> ()");
  m.def(
      "gather_ordered(Tensor src, Tensor(a!) dst, Tensor plan_src, "
      "Tensor plan_dst, Tensor order, Tensor total) -> ()");
  m.def(
      "order_step_temp_bytes(int cells, int host_rows, int device) -> int");
  m.def(
      "gather_plan(Tensor src, Tensor(a!) dst, Tensor src_rows, "
      "Tensor dst_rows, Tensor mask, Tensor? req_state, "
      "Tensor(b!)? out_rows, int attn_block_stride) -> ()");
  m.def(
      "invalidate_written_slots(Tensor(a!) dgi, Tensor req_state, "
      "Tensor token_req, Tensor written_g) -> ()");
  m.def(
      "copy_descriptors(Tensor src_ptr, Tensor dst_ptr, Tensor nbytes) -> ()");
  m.def(
      "mirror_descriptors(Tensor slot_ptrs, Tensor source_slots, "
      "Tensor pair_of_layer, Tensor src_base, Tensor dst_base, "
      "Tensor(a!) src, Tensor(b!) dst, Tensor(c!) nbytes, int first, int n, "
      "int slot_len, int block_size, int bytes_per_block, int row_bytes) "
      "-> ()");
  m.def(
      "resolver_smem_bytes(int top_k, int max_query_len, int hot_size) "
      "-> int");
}

STABLE_TORCH_LIBRARY_IMPL(hisparse_ops, CUDA, m) {
  m.impl("resolve_residency", TORCH_BOX(&hisparse::resolve_residency));
  m.impl("gather_compact", TORCH_BOX(&hisparse::gather_compact));
  m.impl("order_plan", TORCH_BOX(&hisparse::order_plan));
  m.impl("order_step", TORCH_BOX(&hisparse::order_step));
  m.impl("gather_ordered", TORCH_BOX(&hisparse::gather_ordered));
  m.impl("gather_plan", TORCH_BOX(&hisparse::gather_plan));
  m.impl("invalidate_written_slots",
         TORCH_BOX(&hisparse::invalidate_written_slots));
  m.impl("copy_descriptors", TORCH_BOX(&hisparse::copy_descriptors));
  m.impl("mirror_descriptors", TORCH_BOX(&hisparse::mirror_descriptors));
}

// No tensor arguments, hence no device to dispatch on.
STABLE_TORCH_LIBRARY_IMPL(hisparse_ops, CompositeExplicitAutograd, m) {
  m.impl("resolver_smem_bytes", TORCH_BOX(&hisparse::resolver_smem_bytes));
  m.impl("order_step_temp_bytes",
         TORCH_BOX(&hisparse::order_step_temp_bytes));
}
