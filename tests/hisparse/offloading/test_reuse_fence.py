# SPDX-License-Identifier: Apache-2.0
"""F16 on the offloader's worker side (docs/worker.md K10): a step that starts
CPU -> GPU loads waits for the compute stream before submitting them, since
their blocks may have been freed after the step in flight was scheduled
(a finished request's last block it still writes, an unpinned page it still
reads); a step without loads does not wait. The load jobs are the pin's own
``OffloadingConnectorMetadata`` / ``TransferJob`` / load-store specs."""

from types import SimpleNamespace

from vllm.distributed.kv_transfer.kv_connector.v1.hisparse import offloading
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    TransferJob,
)
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


def test_a_step_with_loads_waits_for_compute_first(monkeypatch):
    """Run 20's chat_chain: a follow-up's load landed in the block of a
    filler that had just finished while the step writing its last token was
    still in flight; one indexer row per turn was stale."""
    waits = []
    monkeypatch.setattr(offloading, "_synchronize_compute", lambda: waits.append(1))
    fence = offloading.HiSparseOffloadingConnector._fence_loads
    fence(_connector([[3, 4], [5]]))
    assert waits == [1]
    fence(_connector([]))  # stores only, or nothing: no wait
    assert waits == [1]
    fence(SimpleNamespace(_connector_metadata=None))
    assert waits == [1]


def test_the_wait_comes_before_the_pin_submits_the_loads(monkeypatch):
    order = []
    monkeypatch.setattr(offloading, "_synchronize_compute", lambda: order.append("sync"))
    monkeypatch.setattr(
        offloading.OffloadingConnector, "start_load_kv",
        lambda self, ctx, **kw: order.append("submit"),
    )
    cls = offloading.HiSparseOffloadingConnector
    conn = cls.__new__(cls)  # the worker-side call path only
    conn._connector_metadata = _connector([[9]])._connector_metadata
    conn.start_load_kv(None)
    assert order == ["sync", "submit"]
