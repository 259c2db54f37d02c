# SPDX-License-Identifier: Apache-2.0
"""The TP-shared host pool on CUDA (spec 4.12, 4.11; INV-27, INV-28): two
processes (TP ranks) register the same shared mapping, rank 0 read-write and
rank 1 read-only, and hand host writes over through CUDA interprocess
events. Runs on one GPU (both ranks on it) or one GPU per rank; skips
without CUDA."""

import pytest
import torch
from tp_harness import region_names, remove_directory, run_ranks, shm_directory
from worker_harness import B, W, tiny_config

from vllm.v1.hisparse.host_pool import open_shared_pool
from vllm.v1.hisparse.tp_shared import ReaderHostWriteEvents, WriterLink
from vllm.v1.hisparse.worker import HostWriteEvents, StreamOps

DELAY_CYCLES = 200_000_000  # ~0.1 s of GPU sleep before rank 0's copy


@pytest.fixture
def shm_dir():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    directory = shm_directory()
    yield directory
    left = region_names(directory)
    remove_directory(directory)
    assert not left, f"leaked region names: {left}"


def _expected(rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(4242)
    return torch.randint(0, 256, (rows, W), dtype=torch.uint8, generator=g)


def _hand_off(rank, rdv, directory):
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    plan = tiny_config(shared=True).host_pool
    # The real cudaHostRegister: read-write on rank 0, read-only on rank 1.
    pool = open_shared_pool(plan, rdv, directory=str(directory))
    layer = next(iter(plan.layer_offsets))
    rows = pool.layer_rows(layer, W)[3 * B:4 * B]
    streams = StreamOps(device)
    out = {"pinned": bool(rows.is_pinned()), "writable": pool.writable}
    if rank == 0:
        events = HostWriteEvents(streams, WriterLink(pool.sharing))
        source = _expected(B).to(device)
        torch.cuda.synchronize()
        events.rotate(1)
        with torch.cuda.stream(streams.dma):
            torch.cuda._sleep(DELAY_CYCLES)  # a reader that did not wait reads zeros
            rows.copy_(source, non_blocking=True)
        events.record(streams.dma)
        rdv.barrier()  # rank 0 has recorded step 1; the copy is still running
        rdv.barrier()
    else:
        events = ReaderHostWriteEvents(streams, pool.sharing)
        events.rotate(1)
        rdv.barrier()
        events.rotate(2)  # compute waits on rank 0's step-1 event
        seen = rows.to(device, non_blocking=True)  # on the compute stream
        torch.cuda.synchronize()
        out.update(equal=torch.equal(seen.cpu(), _expected(B)),
                   exact=events.exact_waits)
        rdv.barrier()
    torch.cuda.synchronize()
    out["host_equal"] = torch.equal(rows.clone(), _expected(B))
    pool.shutdown()
    return out


def test_ipc_events_order_a_readers_host_reads_after_rank0s_writes(shm_dir, tmp_path):
    """INV-27 across processes: rank 1's compute stream waits on the
    interprocess event rank 0 recorded after its (delayed) device-to-host
    copy into the shared region, so rank 1's host-to-device read of the
    same rows sees rank 0's bytes. Both mappings are registered (pinned),
    rank 1's read-only (INV-28)."""
    out = [o.get() for o in run_ranks(2, _hand_off, shm_dir, store_dir=tmp_path,
                                       method="spawn")]
    writer, reader = out
    assert writer["pinned"] and reader["pinned"]
    assert (writer["writable"], reader["writable"]) == (True, False)
    assert reader["exact"] == 1 and reader["equal"]
    assert writer["host_equal"] and reader["host_equal"]
