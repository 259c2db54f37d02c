# SPDX-License-Identifier: Apache-2.0
"""F16 on the offloader's worker side (docs/worker.md K10): a CPU -> GPU load
into a GPU block that was an unpinned page until this step waits for the
compute stream; other loads do not."""

from types import SimpleNamespace

import numpy as np

from vllm.distributed.kv_transfer.kv_connector.v1.hisparse import offloading
from vllm.v1.hisparse import worker as hs_worker


def _connector(dst_blocks: list[list[int]]):
    jobs = {i: SimpleNamespace(dst_spec=SimpleNamespace(block_ids=np.array(b)))
            for i, b in enumerate(dst_blocks)}
    return SimpleNamespace(_connector_metadata=SimpleNamespace(load_jobs=jobs))


def test_loads_into_reused_blocks_wait_for_compute(monkeypatch):
    waits = []
    monkeypatch.setattr(offloading, "_synchronize_compute", lambda: waits.append(1))
    fence = offloading.HiSparseOffloadingConnector._fence_loads_into_reused_blocks
    monkeypatch.setattr(hs_worker, "_ACTIVE",
                        [SimpleNamespace(reused_block_ids=np.array([7, 42]))])
    fence(_connector([[3, 4], [5]]))
    assert waits == []  # no load lands in a reused block
    fence(_connector([[3, 42]]))
    assert waits == [1]
    monkeypatch.setattr(hs_worker, "_ACTIVE", [])
    fence(_connector([[7]]))  # no HiSparse worker step: nothing reused
    assert waits == [1]
    fence(SimpleNamespace(_connector_metadata=SimpleNamespace(load_jobs={})))
    assert waits == [1]
