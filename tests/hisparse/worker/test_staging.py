# SPDX-License-Identifier: Apache-2.0
"""Prefill staging (C11, spec 2.11; docs/worker.md K3, K4) on CPU."""

import numpy as np
import pytest
import torch
from vllm.v1.hisparse.staging import StagingCache, host_backed_rows, plan_staged_request
from worker_harness import B, ReferenceOps, W, fill_pattern


def test_host_backed_rows_are_found_without_a_loop_over_requests():
    """K3: a prefill row needs staging iff a null resident entry lies among
    its first cdiv(seq_len, B) pages (entries past them do not count)."""
    table = np.array([[3, 4, 0, 0],    # 2 pages live, both resident
                      [0, 5, 6, 0],    # page 0 host-only
                      [7, 8, 0, 0],    # 3 pages live, page 2 null
                      [9, 0, 0, 0]], dtype=np.int32)
    rows = np.arange(4)
    seq = np.array([2 * B, 3 * B, 2 * B + 1, B])
    assert host_backed_rows(table, rows, seq, B).tolist() == [1, 2]
    assert host_backed_rows(table, rows[2:], seq[2:], B).tolist() == [2]


def test_staged_context_equals_resident_pages_and_host_pages():
    """Spec 2.11: page p of a host-backed request lands in staging block
    p + 1, from its resident block when it has one (device-to-device), from
    its host block otherwise (gather_plan); the cache keeps the row format."""
    n_gpu, n_host = 16, 16
    resident_view = torch.zeros((n_gpu, B, W), dtype=torch.uint8)
    host = torch.zeros((n_host * B, W), dtype=torch.uint8)
    fill_pattern(resident_view, 1)
    fill_pattern(host, 2)
    resident = np.zeros((2, 8), dtype=np.int32)
    source = np.zeros((2, 8), dtype=np.int32)
    resident[1, :3] = [0, 4, 9]      # page 0 host-only, pages 1-2 resident
    source[1, :3] = [11, 12, 13]
    plan = plan_staged_request(1, 2 * B + 10, [resident], source, B, torch.device("cpu"))
    assert plan.num_pages == 3
    staging = StagingCache(max_model_len=8 * B, block_size=B, row_bytes=W,
                           device=torch.device("cpu"))
    cache = staging.fill(plan, 0, resident_view, host, ReferenceOps.gather_plan)
    assert torch.equal(cache[1], host[11 * B:12 * B])
    assert torch.equal(cache[2], resident_view[4])
    assert torch.equal(cache[3], resident_view[9])
    assert staging.table_for(plan).tolist() == [[1, 2, 3]]
    assert staging.num_blocks == 8 + 1  # one max_model_len request + null


def test_a_host_only_page_without_a_host_block_is_an_error():
    """INV-6: every computed page has a host block."""
    resident = np.zeros((1, 4), dtype=np.int32)
    source = np.zeros((1, 4), dtype=np.int32)
    with pytest.raises(RuntimeError, match="INV-6"):
        plan_staged_request(0, B, [resident], source, B, torch.device("cpu"))
