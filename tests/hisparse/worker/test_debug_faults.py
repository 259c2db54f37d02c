# SPDX-License-Identifier: Apache-2.0
"""The debug-only host-row fault of the e2e negative control (docs/worker.md
K26) on the CPU worker: off unless the env var is set at startup, fires once
on a host-only context page of the batch after synchronizing the previous
step's host writes, changes exactly that page's NoPE bytes in every layer,
and the resolver then serves the corrupted bytes."""

import numpy as np
import pytest
import torch
from vllm.v1.hisparse import debug_faults
from vllm.v1.hisparse.metadata import HiSparseStepMetadata
from worker_harness import B, WorkerRig, attn_metadata, fill_pattern


class FaultRig(WorkerRig):
    """A CPU worker over batch row 0, every layer's host rows filled."""

    def __init__(self) -> None:
        super().__init__()
        for name, lv in self.rt.layers.items():
            fill_pattern(lv.host, seed=len(name) + lv.pair)

    def decode(self, computed: int, scheduled: int, finish: bool = True, **meta):
        """A step of row 0 (one decode request), ``meta`` its metadata
        fields; without ``finish`` the forward is left open."""
        self.batch.schedule(computed=[computed], scheduled=[scheduled])
        md = attn_metadata(self.batch, 1, 1)
        self.worker.start_step(self.meta(**meta), md)
        if finish:
            self.worker.finish_forward()
        return md

    def host(self) -> dict[str, torch.Tensor]:
        return {n: lv.host.clone() for n, lv in self.rt.layers.items()}


@pytest.fixture
def faults_on(monkeypatch):
    monkeypatch.setenv(debug_faults.FAULTS_ENV, "1")


def test_off_unless_enabled_at_startup(monkeypatch):
    """Without the env var at startup there is no injector and arming is an
    error naming the variable, even if it is set later."""
    monkeypatch.delenv(debug_faults.FAULTS_ENV, raising=False)
    rig = FaultRig()
    assert rig.worker.fault_injector is None
    monkeypatch.setenv(debug_faults.FAULTS_ENV, "1")
    with pytest.raises(RuntimeError, match=debug_faults.FAULTS_ENV):
        debug_faults.arm_host_row_fault()
    assert debug_faults.fault_status()["enabled"] is False


def test_fires_once_on_the_host_only_page_of_every_layer(faults_on):
    rig = FaultRig()
    rig.place(0, resident=[3, 4], host=[5, 6])
    rig.decode(computed=100, scheduled=1)  # all resident: a step to synchronize
    before = rig.host()
    debug_faults.arm_host_row_fault()
    rig.place(0, resident=[0, 4], host=[5, 6])  # page 0 lost: host block 5 is host-only
    log = rig.worker.streams.log
    start = len(log)
    rig.decode(computed=101, scheduled=1)
    status = debug_faults.fault_status()
    assert status["fired"] == 1 and not status["armed"]
    assert status["last"] == {"row": 0, "page": 0, "host_block": 5}
    # the previous step's host writes were waited for before the CPU write
    assert any(e[0] == "synchronize" for e in log[start:])
    page = slice(5 * B, 6 * B)
    for name, lv in rig.rt.layers.items():
        old, new = before[name], lv.host
        assert torch.equal(new[page, :512], old[page, :512] ^ 0x80), name
        assert torch.equal(new[page, 512:], old[page, 512:]), name
        # block 6 holds this step's mirrored row; every other block is untouched
        assert torch.equal(new[:5 * B], old[:5 * B]) and torch.equal(new[7 * B:], old[7 * B:])
    after = rig.host()
    rig.decode(computed=102, scheduled=1)  # one shot
    assert all(torch.equal(after[n][page], lv.host[page]) for n, lv in rig.rt.layers.items())
    assert debug_faults.fault_status()["fired"] == 1


def test_waits_armed_until_a_host_only_page_is_in_the_batch(faults_on):
    """Armed with every context page resident (a host block past the context
    does not count): nothing fires, nor in a step without a forward; it
    fires once a context page is host-only."""
    rig = FaultRig()
    rig.place(0, resident=[3, 4, 0], host=[5, 6, 7])
    debug_faults.arm_host_row_fault()
    before = rig.host()
    rig.decode(computed=100, scheduled=1)
    rig.place(0, resident=[0, 4], host=[5, 6])
    rig.worker.start_step(HiSparseStepMetadata(step=99), None)
    page = slice(5 * B, 6 * B)
    assert all(torch.equal(before[n][page], lv.host[page]) for n, lv in rig.rt.layers.items())
    assert debug_faults.fault_status()["armed"]
    rig.decode(computed=101, scheduled=1)
    assert debug_faults.fault_status()["fired"] == 1


def test_the_resolver_serves_the_corrupted_rows(faults_on):
    """What the negative control relies on: a hot miss on the corrupted page
    gathers the flipped bytes into the hot slot that attention reads."""
    rig = FaultRig()
    rt, name = rig.rt, rig.layout.sparse_layers[0]
    rig.place(0, resident=[0, 4], host=[5, 6], hot=[20, 21])
    original = rt.layers[name].host[5 * B + 2].clone()
    debug_faults.arm_host_row_fault()
    md = rig.decode(computed=100, scheduled=1, finish=False,
                    hot_regions_allocated=np.array([20]), hot_region_requests=["r0"])
    topk = torch.full((1, 64), -1, dtype=torch.int32)
    topk[0, 0] = 2  # position 2: page 0, host block 5
    rows, _ = rt.decode_rows(name, 1, topk, md.seq_lens, md.block_table)
    block, off = divmod(int(rows[0, 0]), rt.geometry.attention_block_stride)
    served = rt.layers[name].resident[block, off]
    assert torch.equal(served[:512], original[:512] ^ 0x80)
    assert not torch.equal(served, original)
    rig.worker.finish_forward()
