# SPDX-License-Identifier: Apache-2.0
"""The pinned host pool (spec 3.3; F6, F14, F19; W-12)."""

import logging

import pytest
import torch
from worker_harness import W, RecordingRegistrar, tiny_config

from vllm.v1.hisparse import host_pool as hp


def test_layer_arrays_are_layer_major_and_disjoint():
    """Spec 3.3: layer l's host row g is at byte layer_offsets[l] + g * W."""
    config = tiny_config()
    pool = hp.HostPool(config.host_pool, RecordingRegistrar().registrar())
    layers = config.layout.sparse_layers
    for i, name in enumerate(layers):
        rows = pool.layer_rows(name, W)
        assert rows.shape == (config.host_num_blocks * 64, W)
        assert rows.data_ptr() == pool.base_ptr + config.host_pool.layer_offsets[name]
        rows[5].fill_(i + 1)
    for i, name in enumerate(layers):
        assert torch.all(pool.layer_rows(name, W)[5] == i + 1)
        assert pool.layer_pages(name)[0, 5 * W] == i + 1
    pool.shutdown()


def test_registration_follows_the_plan_chunks():
    """F14: one cudaHostRegister per planned chunk, at the chunk's bytes."""
    config = tiny_config(registration_chunk_bytes=4 * 41984 * 4)
    chunks = config.host_pool.registration_chunks
    assert len(chunks) > 1
    rec = RecordingRegistrar()
    pool = hp.HostPool(config.host_pool, rec.registrar())
    assert [c[1:] for c in rec.calls] == [
        (pool.base_ptr + s, e - s) for s, e in chunks]
    pool.shutdown()
    unregs = [c[1] for c in rec.calls if c[0] == "unregister"]
    assert unregs == [pool.base_ptr + s for s, _ in reversed(chunks)]


def test_failed_registration_unregisters_what_was_pinned():
    config = tiny_config(registration_chunk_bytes=4 * 41984 * 4)
    rec = RecordingRegistrar(fail_register_at=2)
    with pytest.raises(hp.HostRegistrationError, match="host_pool_gib"):
        hp.HostPool(config.host_pool, rec.registrar())
    assert [c[0] for c in rec.calls] == [
        "register", "register", "synchronize", "unregister"]


def test_double_shutdown_is_a_no_op(caplog):
    """W-12: a second shutdown does nothing; the log reports the bytes."""
    rec = RecordingRegistrar()
    pool = hp.HostPool(tiny_config().host_pool, rec.registrar())
    with caplog.at_level(logging.INFO):
        pool.shutdown()
        n = len(rec.calls)
        pool.shutdown()
    assert len(rec.calls) == n and pool.closed
    assert "unpinned" in caplog.text


def test_unregister_failure_logs_and_stops(caplog):
    """F6/W-12: an injected unregister failure warns and stops, no raise."""
    config = tiny_config(registration_chunk_bytes=4 * 41984 * 4)
    rec = RecordingRegistrar(fail_unregister_at=1)
    pool = hp.HostPool(config.host_pool, rec.registrar())
    with caplog.at_level(logging.WARNING):
        pool.shutdown()
    assert sum(c[0] == "unregister" for c in rec.calls) == 1
    assert "cudaHostUnregister failed" in caplog.text


def test_unusable_context_leaves_the_pool_to_the_os(caplog):
    rec = RecordingRegistrar(sync_raises=True)
    pool = hp.HostPool(tiny_config().host_pool, rec.registrar())
    with caplog.at_level(logging.WARNING):
        pool.shutdown()
    assert not any(c[0] == "unregister" for c in rec.calls)
    assert "unusable" in caplog.text


def test_one_pool_per_process(monkeypatch):
    """F19: the same plan gets the same pool, pinned once; another layout
    while one is pinned is refused."""
    rec = RecordingRegistrar()
    monkeypatch.setattr(hp.HostRegistrar, "cuda",
                        classmethod(lambda cls, read_only=False: rec.registrar()))
    config = tiny_config()
    try:
        first = hp.acquire_host_pool(config.host_pool)
        assert hp.acquire_host_pool(config.host_pool) is first
        assert sum(c[0] == "register" for c in rec.calls) == len(
            config.host_pool.registration_chunks)
        with pytest.raises(RuntimeError, match="one engine pins one pool"):
            hp.acquire_host_pool(tiny_config(num_host_blocks=80).host_pool)
    finally:
        hp.release_host_pools()
    assert first.closed


def test_one_pool_with_an_mtp_drafter(monkeypatch):
    """F19 with MTP (docs/mtp.md 3.8): the drafter shares the target's
    runner, so the target and draft layers live in one pool, pinned once:
    the registered bytes are the plan's, and the MTP layer's array sits in
    it beside the target layers'."""
    rec = RecordingRegistrar()
    monkeypatch.setattr(hp.HostRegistrar, "cuda",
                        classmethod(lambda cls, read_only=False: rec.registrar()))
    config = tiny_config(num_layers=3, num_mtp=1, q=2)
    mtp = "model.layers.3.self_attn.attn"
    assert list(config.layout.draft_layers) == [mtp]
    try:
        pool = hp.acquire_host_pool(config.host_pool)
        assert hp.acquire_host_pool(config.host_pool) is pool  # the drafter's bind
        registered = sum(c[2] for c in rec.calls if c[0] == "register")
        assert registered == config.host_pool.region_bytes
        rows = pool.layer_rows(mtp, config.layout.row_bytes)
        assert rows.shape[0] == config.host_pool.num_blocks * config.layout.block_size
        assert len({pool.layer_ptr(n) for n in config.layout.sparse_layers}) == 4
    finally:
        hp.release_host_pools()
