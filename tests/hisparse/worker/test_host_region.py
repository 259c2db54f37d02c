# SPDX-License-Identifier: Apache-2.0
"""The TP-shared host pool on CPU (spec 4.12, 3.3 shared mode, 6.3 #13;
INV-27, INV-28, INV-29; W-6).

TP ranks are real processes joined by a gloo group (``tp_harness``); the
region is a real file on ``/dev/shm`` that every rank maps. Only the CUDA
registration is replaced by a recorder (``test_host_region_gpu.py`` runs it
for real).
"""

import dataclasses
import faulthandler
import os
import signal
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_worker import fill_slab
from tp_harness import (
    in_child,
    mapped_regions,
    region_names,
    remove_directory,
    run_ranks,
    shm_directory,
)
from worker_harness import B, W, RecordingRegistrar, WorkerRig, tiny_config

from vllm.v1.hisparse import config_checks as cc
from vllm.v1.hisparse import host_pool as hp
from vllm.v1.hisparse.config_checks import HiSparseConfigError
from vllm.v1.hisparse.host_region import (
    CONTROL_BYTES,
    SharedHostRegion,
    SharedRegionError,
    sweep_stale,
)
from vllm.v1.hisparse.tp_shared import HostSharing, ReaderHostWriteEvents, WriterLink
from vllm.v1.hisparse.worker import HostWriteEvents, StreamOps


@pytest.fixture
def shm_dir():
    """A fresh directory on /dev/shm; no region name may be left in it."""
    directory = shm_directory()
    yield directory
    left = region_names(directory)
    remove_directory(directory)
    assert not left, f"leaked region names: {left}"


def shared_plan(num_host_blocks: int = 64):
    return tiny_config(shared=True, num_host_blocks=num_host_blocks).host_pool


def open_pool(rdv, directory, plan=None):
    return hp.open_shared_pool(
        plan or shared_plan(), rdv, RecordingRegistrar().registrar(),
        directory=str(directory),
    )


def pattern(layer: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + layer)
    return torch.randint(0, 256, (rows, W), dtype=torch.uint8, generator=g)


# ------------------------------------------------------------ lifecycle


def _lifecycle(rank, rdv, directory):
    pool = open_pool(rdv, directory)
    layers = list(pool.plan.layer_offsets)
    if rank == 0:
        for i, name in enumerate(layers):
            pool.layer_rows(name, W)[10 * B:11 * B] = pattern(i, B)
    rdv.barrier()  # rank 0 wrote; rank 0 unlinked the name after the mapping
    seen = [pool.layer_rows(name, W)[10 * B:11 * B].clone() for name in layers]
    out = dict(
        writable=pool.writable,
        names=region_names(directory),
        mapped=len(mapped_regions()),
        equal=all(torch.equal(s, pattern(i, B)) for i, s in enumerate(seen)),
    )
    rdv.barrier()
    if rank == 1:
        pool.shutdown()  # a reader leaves first: the others keep the pages
    rdv.barrier()
    if rank != 1:
        out["still_equal"] = torch.equal(
            pool.layer_rows(layers[0], W)[10 * B:11 * B], pattern(0, B))
        pool.shutdown()
    out["mapped_after"] = len(mapped_regions())
    return out


def test_rank0_creates_the_others_map_and_read_its_bytes(shm_dir, tmp_path):
    """4.12 step 1, 3.3: rank 0 creates and alone may write (its view is
    writable, the readers' are not, INV-28); every rank maps the same pages
    and sees rank 0's bytes; the name is gone once every rank has mapped
    it, a rank leaving does not take the pages from the others, and no
    mapping survives shutdown."""
    out = [o.get() for o in run_ranks(3, _lifecycle, shm_dir, store_dir=tmp_path)]
    assert [o["writable"] for o in out] == [True, False, False]
    assert all(o["equal"] for o in out)
    assert all(o["names"] == [] for o in out)
    assert all(o["mapped"] == 2 for o in out)  # the pool and the control page
    assert out[0]["still_equal"] and out[2]["still_equal"]
    assert all(o["mapped_after"] == 0 for o in out)


def _mismatched_layout(rank, rdv, directory):
    plan = shared_plan(80 if rank == 2 else 64)
    try:
        open_pool(rdv, directory, plan)
    except Exception as err:
        rdv.barrier()
        return type(err).__name__, str(err), len(mapped_regions())
    return None


def test_a_failure_on_one_rank_raises_on_every_rank_and_leaves_nothing(
        shm_dir, tmp_path):
    """4.12: a rank whose layout differs from rank 0's refuses the region;
    every rank raises (none is left waiting), every mapping is released and
    rank 0 still unlinks the name."""
    out = [o.get() for o in run_ranks(3, _mismatched_layout, shm_dir,
                                       store_dir=tmp_path)]
    assert out[2][0] == "SharedRegionError"
    assert "layout differs from TP rank 0's" in out[2][1]
    for kind, message, mapped in out[:2]:
        assert kind == "SharedRegionError" and "failed on TP rank(s) [2]" in message
        assert mapped == 0
    assert region_names(shm_dir) == []


def _ram(rank, rdv, directory, available):
    cc.available_host_ram_bytes = lambda: available  # a forked rank's own copy
    try:
        pool = open_pool(rdv, directory)
    except Exception as err:
        return type(err).__name__, str(err)
    pool.shutdown()
    return "ok", ""


def test_rank0_checks_ram_counting_the_pool_once(shm_dir, tmp_path):
    """6.3 #13 in shared mode: only rank 0 checks, and it counts the pool
    once per replica, not once per rank: a pool that fits once starts with
    TP=3; one that does not is refused with the RAM message on rank 0 and
    reported on the other ranks."""
    plan = shared_plan()
    file_bytes = plan.region_bytes + CONTROL_BYTES
    fits_once = int(file_bytes * 1.5 / 0.95)  # < 3 copies
    out = [o.get() for o in run_ranks(3, _ram, shm_dir, fits_once,
                                       store_dir=tmp_path)]
    assert out == [("ok", "")] * 3
    out = [o.get() for o in run_ranks(2, _ram, shm_dir, file_bytes // 2,
                                       store_dir=tmp_path)]
    assert out[0][0] == "HiSparseConfigError"
    assert out[0][1].startswith("HiSparse pinned host pool needs")
    assert "one pool shared by the TP ranks" in out[0][1]
    assert out[1][0] == "SharedRegionError"
    assert "TP rank 0 could not set up the shared host pool: " \
        "HiSparseConfigError: HiSparse pinned host pool needs" in out[1][1]


def test_a_full_tmpfs_is_refused_before_anything_is_created(shm_dir, monkeypatch):
    """No SIGBUS later: a /dev/shm without room fails at creation."""
    real = os.statvfs

    class Full:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(
        os, "statvfs", lambda p: Full() if p == str(shm_dir) else real(p))
    with pytest.raises(HiSparseConfigError, match="--shm-size"):
        SharedHostRegion.create(shared_plan(), 2, host_pool_gib=1.0,
                                directory=str(shm_dir))
    assert region_names(shm_dir) == []


def test_attach_refuses_a_stale_name_the_wrong_size_or_another_region(shm_dir):
    """4.12: a rank maps only the region rank 0 created for this layout."""
    plan = shared_plan()
    region = SharedHostRegion.create(plan, 2, host_pool_gib=1.0, directory=str(shm_dir))
    other = SharedHostRegion.create(plan, 2, host_pool_gib=1.0, directory=str(shm_dir))
    try:
        with pytest.raises(SharedRegionError, match="layout differs"):
            SharedHostRegion.attach(region.ticket, shared_plan(80))
        bigger = dataclasses.replace(
            region.ticket, file_bytes=region.ticket.file_bytes + 4096)
        with pytest.raises(SharedRegionError, match=r"TP rank 0 created \d+ B"):
            SharedHostRegion.attach(bigger, plan)
        swapped = dataclasses.replace(region.ticket, path=other.ticket.path)
        with pytest.raises(SharedRegionError, match="identity mismatch"):
            SharedHostRegion.attach(swapped, plan)
        region.unlink()
        with pytest.raises(SharedRegionError, match="does not exist"):
            SharedHostRegion.attach(region.ticket, plan)
    finally:
        region.close()
        other.close()


def test_a_readers_view_is_read_only(shm_dir, monkeypatch):
    """INV-28: a reader's pool is mapped read-only (a CPU write kills the
    process) and registered read-only for the device; rank 0's is not."""
    flags = []

    def cuda(cls, read_only=False):
        flags.append(read_only)
        return RecordingRegistrar().registrar()

    monkeypatch.setattr(hp.HostRegistrar, "cuda", classmethod(cuda))
    plan = shared_plan()
    region = SharedHostRegion.create(plan, 2, host_pool_gib=1.0, directory=str(shm_dir))
    try:
        # Built directly, not rendezvoused: a two-rank group stand-in.
        writer = hp.HostPool(plan, region=region, sharing=HostSharing(
            SimpleNamespace(rank=0, world_size=2), region.control))
        reader_region = SharedHostRegion.attach(region.ticket, plan)
        reader = hp.HostPool(plan, region=reader_region, sharing=HostSharing(
            SimpleNamespace(rank=1, world_size=2), reader_region.control))
        assert flags == [False, True]
        name = next(iter(plan.layer_offsets))
        writer.layer_rows(name, W)[3].fill_(7)
        assert int(reader.layer_rows(name, W)[3, 0]) == 7
        with pytest.raises(ValueError, match="read-only"):
            reader.layer_pages(name)[0, 0] = 1

        def write_through_the_reader():
            faulthandler.disable()  # the fault is the expected outcome
            reader.layer_rows(name, W)[3].fill_(9)

        assert in_child(write_through_the_reader) == -signal.SIGSEGV
        assert int(writer.layer_rows(name, W)[3, 0]) == 7
        reader.shutdown()
        writer.shutdown()
    finally:
        region.close()


def test_sweep_removes_only_old_names_of_dead_creators(shm_dir):
    """A crash inside the rendezvous window can leave a name: the next
    creator removes it once its creator is gone and it is older than any
    rendezvous; live creators' and young names stay."""
    def touch(name: str, age_s: float) -> None:
        path = shm_dir / name
        path.write_bytes(b"")
        os.utime(path, (time.time() - age_s,) * 2)

    touch("vllm-hisparse-111-00ab", 3600)   # dead, old: stale
    touch("vllm-hisparse-222-00cd", 3600)   # alive
    touch("vllm-hisparse-111-00ef", 5)      # dead but young: maybe mid-rendezvous
    touch("vllm_offload_x.mmap", 3600)      # not ours
    removed = sweep_stale(str(shm_dir), alive=lambda pid: pid == 222)
    assert [os.path.basename(p) for p in removed] == ["vllm-hisparse-111-00ab"]
    assert sorted(p.name for p in shm_dir.iterdir()) == [
        "vllm-hisparse-111-00ef", "vllm-hisparse-222-00cd", "vllm_offload_x.mmap"]
    for p in shm_dir.iterdir():
        p.unlink()


# ---------------------------------------------------- writer and readers


class SharedRig(WorkerRig):
    """``WorkerRig`` over this rank's view of a shared pool (its own slab)."""

    def __init__(self, rdv, directory):
        config = tiny_config(shared=True)
        super().__init__(config=config, eager=False, rank=rdv.rank,
                         pool=open_pool(rdv, directory, config.host_pool))


def _host_page(rig, block):
    return [rig.rt.layers[n].host[block * B:(block + 1) * B].clone()
            for n in rig.layout.sparse_layers]


def _resident_page(rig, block, pair_offset=50):
    out = []
    for name, lv in rig.rt.layers.items():
        out.append(lv.resident[pair_offset * lv.pair + block].clone())
    return out


def _roles(rank, rdv, directory):
    rig = SharedRig(rdv, directory)
    rdv.barrier()  # the region name is gone on every rank from here on
    fill_slab(rig, seed=7)  # MLA KV is identical on every TP rank
    rig.place(0, resident=[3, 4], host=[5, 6])
    rig.batch.schedule(computed=[0], scheduled=[B])
    rig.run(rig.meta(**rig.spill(1, host_block=5, resident_block=3)))  # lazy spill
    spill_ack = rig.worker.take_acks()
    rdv.barrier()  # rank 0's copies are done (CPU program order)
    host = _host_page(rig, 5)
    resident = _resident_page(rig, 3)
    # CoW (4.12 step 5): rank 0 copies host block 5 -> 9, then a TP barrier.
    rig.batch.schedule(computed=[B], scheduled=[1])
    rig.run(rig.meta(cow_src=np.array([5], np.int32), cow_dst=np.array([9], np.int32)),
            num_decodes=1, num_decode_tokens=1)
    cow_host = _host_page(rig, 9)  # right after the barrier, no extra sync
    cow_ack = rig.worker.take_acks()
    # A restore: every rank copies host block 9 into its own resident block 7.
    rig.batch.schedule(computed=[B + 1], scheduled=[1])
    rig.run(rig.meta(**rig.spill(2, host_block=9, resident_block=7, restore=True)),
            num_decodes=1, num_decode_tokens=1)
    restore_ack = rig.worker.take_acks()
    restored = _resident_page(rig, 7)
    log = rig.worker.streams.log
    rdv.barrier()
    rig.worker.shutdown()
    return dict(
        writer=rig.worker.writer,
        host_equals_resident=all(torch.equal(h, r) for h, r in zip(host, resident)),
        cow_equals=all(torch.equal(c, h) for c, h in zip(cow_host, host)),
        restored_equals=all(torch.equal(r, h) for r, h in zip(restored, host)),
        spill_ack=spill_ack and (spill_ack.enqueued, spill_ack.completed),
        cow_done=None if cow_ack is None else cow_ack.cow_done,
        restore_ack=(restore_ack.enqueued.get(2), restore_ack.completed.get(2)),
        reader_spill_ids=set(restore_ack.completed) - {2},
        dma_ops=sum(e == ("enter", "dma") for e in log),
        cpu_syncs=sum(e[0] == "synchronize" for e in log),
    )


def test_only_rank0_writes_host_memory_and_acks_spills(shm_dir, tmp_path):
    """W-6, INV-28, 4.12 steps 2, 4, 5: rank 0 alone copies the spill (its
    bytes are what every rank reads), runs the CoW and acks both; the
    reader submits nothing to a DMA stream, never synchronizes host writes
    on the CPU and acks no spill and no CoW, yet sees the CoW's bytes right
    after the barrier; every rank runs and acks its own restore."""
    out = [o.get() for o in run_ranks(2, _roles, shm_dir, store_dir=tmp_path)]
    writer, reader = out
    assert (writer["writer"], reader["writer"]) == (True, False)
    for o in out:
        assert o["host_equals_resident"] and o["cow_equals"] and o["restored_equals"]
    assert writer["spill_ack"] == ({1: frozenset({0})}, {1: frozenset({0})})
    assert writer["cow_done"] == frozenset({9})
    assert writer["dma_ops"] > 0 and writer["cpu_syncs"] == 1  # the CoW's
    assert reader["spill_ack"] is None and reader["cow_done"] is None
    assert reader["dma_ops"] == 0 and reader["cpu_syncs"] == 0
    for rank, o in enumerate(out):
        assert o["restore_ack"] == (frozenset({rank}), frozenset({rank}))
    assert writer["reader_spill_ids"] == {1} and reader["reader_spill_ids"] == set()


# ------------------------------------------------------ host-write events


def _events(rank, rdv, directory, scenario):
    pool = open_pool(rdv, directory)
    sharing = pool.sharing
    streams = StreamOps(torch.device("cpu"))
    if scenario == "no_ipc" and rank == 0:
        def no_ipc(event):
            raise RuntimeError("CUDA error: operation not supported")
        streams.ipc_handle = no_ipc
    if rank == 0:
        link = WriterLink(sharing, timeout_s=0.5 if scenario == "gone" else 30)
        events = HostWriteEvents(streams, link)
    else:
        events = ReaderHostWriteEvents(streams, sharing)
    out = scenario_steps.get(scenario, _in_lockstep)(rank, rdv, events)
    rdv.barrier()
    if rank:
        out.update(exact=events.exact_waits, early=events.early_steps,
                   waits=[e[2] for e in streams.log if e[0] == "wait"])
    else:
        out.update(guard_waits=link.guard_waits)
    pool.shutdown()
    return out


def _in_lockstep(rank, rdv, events):
    for step in (1, 2, 3):
        if rank == 0:
            events.rotate(step)
            events.record("dma")
        rdv.barrier()
        if rank:
            events.rotate(step)
        rdv.barrier()
    # The reader runs ahead: it starts step 5 before rank 0 records step 4.
    if rank == 0:
        events.rotate(4)
    rdv.barrier()
    if rank:
        events.rotate(4)
        events.rotate(5)
    rdv.barrier()
    if rank == 0:
        events.record("dma")
    return {}


def _reader_behind(rank, rdv, events):
    if rank == 0:
        events.rotate(1)
        events.record("dma")
        events.rotate(2)
        start = time.monotonic()
        events.record("dma")  # re-records step 0's event: the reader must have
        return {"blocked_s": time.monotonic() - start}  # started step 1
    time.sleep(0.5)
    events.rotate(1)
    return {}


def _reader_gone(rank, rdv, events):
    if rank == 0:
        events.rotate(1)
        events.record("dma")
        events.rotate(2)
        with pytest.raises(SharedRegionError,
                           match=r"TP rank\(s\) \[1\] have not started step 1"):
            events.record("dma")
    return {}


scenario_steps = {
    "lockstep": _in_lockstep, "behind": _reader_behind, "gone": _reader_gone}


def test_a_reader_waits_on_rank0s_record_of_the_previous_step(shm_dir, tmp_path):
    """4.11/4.12 step 3, INV-27: the reader's compute stream waits on the
    interprocess event rank 0 recorded in the previous step (alternating
    events); a reader that starts a step before rank 0 recorded the previous
    one does not wait on an older record: it counts the step early and
    relies on INV-29."""
    _, reader = [o.get() for o in run_ranks(2, _events, shm_dir, "lockstep",
                                             store_dir=tmp_path)]
    assert reader["waits"] == ["host_write1", "host_write0", "host_write1"]
    assert (reader["exact"], reader["early"]) == (3, 1)


def test_rank0_rerecords_an_event_only_after_the_readers_waited_on_it(
        shm_dir, tmp_path):
    """INV-27 (ping-pong, a reader up to one step behind): rank 0 re-records
    an event only once every reader has started the step after its last
    record, so no reader's wait binds to a later record (which would
    deadlock on the later step's collectives); a reader that never comes is
    an error, not a hang."""
    writer, _ = [o.get() for o in run_ranks(2, _events, shm_dir, "behind",
                                             store_dir=tmp_path)]
    assert writer["blocked_s"] >= 0.3 and writer["guard_waits"] == 1
    writer, _ = [o.get() for o in run_ranks(2, _events, shm_dir, "gone",
                                             store_dir=tmp_path)]
    assert writer["guard_waits"] == 0


def test_without_interprocess_events_readers_do_not_wait(shm_dir, tmp_path):
    """INV-29's fallback: where rank 0 cannot export its events it warns
    and the readers start every step without a wait (their host reads are
    still after rank 0's acked completions)."""
    _, reader = [o.get() for o in run_ranks(2, _events, shm_dir, "no_ipc",
                                             store_dir=tmp_path)]
    assert reader["waits"] == [] and (reader["exact"], reader["early"]) == (0, 0)
