# SPDX-License-Identifier: Apache-2.0
"""Patch worker-block-table-fused-slot-mapping on the H200: the runner's
MultiGroupBlockTable fuses its same-layout token-to-slot tables, and the
compiled fused kernel writes every table's slot mapping, padding included,
as the pin's per-table kernel does. Skips without CUDA."""

import numpy as np
import pytest
import torch

from vllm.v1.worker.block_table import (
    FusedSlotMappings,
    MultiGroupBlockTable,
    SlotMappingMode,
)

B = 64
MAX_TOKENS = 2048


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device("cuda")


@pytest.mark.parametrize("seed", range(4))
def test_fused_launch_equals_the_per_table_launches_on_cuda(cuda, seed):
    rng = np.random.default_rng(seed)
    modes = [SlotMappingMode.TOKEN_TO_KV_SLOT] * 4 + [SlotMappingMode.NONE]
    multi = MultiGroupBlockTable(32, MAX_TOKENS, False, cuda, [B] * 5, [B] * 5, [256] * 5,
                                 slot_mapping_modes=modes)
    fused = [p for p in multi._slot_mapping_launches if isinstance(p, FusedSlotMappings)]
    assert len(fused) == 1 and fused[0].tables == multi.block_tables[:4]
    num_reqs = int(rng.integers(1, 32))
    qlens = rng.integers(1, 40, size=num_reqs)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(qlens)]), dtype=torch.int32, device=cuda)
    pos = torch.tensor(np.concatenate([np.arange(s, s + q) for s, q in zip(
        rng.integers(0, 200 * B, size=num_reqs), qlens)]), dtype=torch.int64, device=cuda)
    for t in multi.block_tables:
        for row in range(num_reqs):
            t.add_row(rng.integers(1, 10**5, size=256).tolist(), row)
    multi.commit_block_table(num_reqs)
    tables = multi.block_tables[:4]
    for t in tables:
        t.compute_slot_mapping(num_reqs, qsl, pos)
    own = [t.slot_mapping.gpu.clone() for t in tables]
    for t in tables:
        t.slot_mapping.gpu.fill_(7)
    multi.compute_slot_mapping(num_reqs, qsl, pos)
    torch.cuda.synchronize()
    n = pos.shape[0]
    for t, expected in zip(tables, own):
        assert torch.equal(t.slot_mapping.gpu, expected)
        assert (expected[n:] == -1).all()
