# SPDX-License-Identifier: Apache-2.0
"""F16 on the offloader's worker side (docs/worker.md K10): a CPU -> GPU load
into a GPU block that was an unpinned page until this step waits for the
compute stream; other loads do not. The load jobs are the pin's own
``OffloadingConnectorMetadata`` / ``TransferJob`` / load-store specs."""

from types import SimpleNamespace

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse import offloading
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.v1.hisparse import worker as hs_worker
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec


def _connector(dst_blocks: list[list[int]]):
    jobs = {
        i: TransferJob(
            req_id=f"r{i}",
            src_spec=CPULoadStoreSpec([100 + x for x in b]),
            dst_spec=GPULoadStoreSpec(b, group_sizes=[len(b)], block_indices=[0]),
        )
        for i, b in enumerate(dst_blocks)
    }
    meta = OffloadingConnectorMetadata(load_jobs=jobs, store_jobs={})
    return SimpleNamespace(_connector_metadata=meta)


def test_loads_into_reused_blocks_wait_for_compute(monkeypatch):
    waits = []
    monkeypatch.setattr(offloading, "_synchronize_compute", lambda: waits.append(1))
    fence = offloading.HiSparseOffloadingConnector._fence_loads_into_reused_blocks
    # The process's HiSparse worker started a step that reused blocks 7, 42.
    monkeypatch.setattr(
        hs_worker, "_current", SimpleNamespace(reused_block_ids=np.array([7, 42]))
    )
    fence(_connector([[3, 4], [5]]))
    assert waits == []  # no load lands in a reused block
    fence(_connector([[3, 42]]))
    assert waits == [1]
    monkeypatch.setattr(hs_worker, "_current", None)
    fence(_connector([[7]]))  # no HiSparse worker step: nothing reused
    assert waits == [1]
    fence(_connector([]))
    assert waits == [1]
