# SPDX-License-Identifier: Apache-2.0
"""Binding (C9, spec 2.9): per-layer views at their own offsets (INV-10),
resident/hot/runner views aliasing exactly (INV-13, F9), the attention view
addressing hma(r) (3.2), and the runner hooks (residency updates W0, slot
retargeting)."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from worker_harness import B, W, host_pool, tiny_config

from vllm.v1.hisparse.binding import (
    apply_residency_updates,
    build_layer_views,
    resident_view,
    retarget_slot_mappings,
)
from vllm.v1.hisparse.metadata import HiSparseStepMetadata
from vllm.v1.hisparse.specs import resident_layer_name


@pytest.mark.parametrize("freq", [1, 2])
def test_each_layer_writes_only_its_own_bytes(freq):
    """INV-10 / F9 (U-4): a distinct pattern written through every sparse
    layer's view of one block reads back intact through each view: no two
    layers of a resident group overlap, and none starts at the group base
    unless it is the group's first layer."""
    config = tiny_config(freq=freq, num_gpu_blocks=8)
    layout = config.layout
    slab = torch.zeros(config.num_blocks * layout.bytes_per_block, dtype=torch.uint8)
    views = build_layer_views(config, slab, host_pool(config))
    # A block is leased to one resident/hot pair at a time (INV-4): write
    # every layer of the pair that leases block 5, then read each back.
    for pair in range(layout.num_pairs):
        members = [(n, v) for n, v in views.items() if v["pair"] == pair]
        for i, (_, v) in enumerate(members):
            v["resident"][5].fill_(i + 1)
        for i, (name, v) in enumerate(members):
            assert torch.all(v["resident"][5] == i + 1), name
    pairs = {}
    for name, v in views.items():
        pairs.setdefault(v["pair"], []).append(v["offset"])
    for offsets in pairs.values():
        assert offsets == [k * layout.page_bytes for k in range(len(offsets))]


@pytest.mark.parametrize("freq", [1, 2])
def test_attention_row_is_the_physical_row(freq):
    """Spec 3.2 flat mode: row hma(r) = (r div B) * Sa + r mod B of the
    attention view is physical row r of the layer's resident view."""
    config = tiny_config(freq=freq, num_gpu_blocks=8)
    layout = config.layout
    slab = torch.zeros(config.num_blocks * layout.bytes_per_block, dtype=torch.uint8)
    views = build_layer_views(config, slab, host_pool(config))
    sa = layout.attention_block_stride
    for v in views.values():
        flat = v["attention"].reshape(-1, W)
        for r in (0, 63, 64, 3 * B + 17, config.num_blocks * B - 1):
            v["resident"][r // B, r % B].fill_(r % 251 + 1)
            assert torch.equal(flat[(r // B) * sa + r % B], v["resident"][r // B, r % B])


def test_misplaced_hot_twin_is_refused():
    """INV-13: resident and hot twins must share one offset (a layout whose
    hot tensor sits elsewhere would make hot rows overwrite other layers)."""
    config = tiny_config(freq=2, num_gpu_blocks=8)
    tensors = []
    for t in config.kv_cache_tensors:
        if any(n.endswith(".hisparse_hot") for n in t.shared_by) and t.offset == 0:
            hot = [n for n in t.shared_by if n.endswith(".hisparse_hot")]
            rest = [n for n in t.shared_by if n not in hot]
            tensors += [dataclasses.replace(t, shared_by=rest),
                        dataclasses.replace(t, shared_by=hot, offset=t.offset + 16)]
        else:
            tensors.append(t)
    broken = dataclasses.replace(config, kv_cache_tensors=tensors)
    slab = torch.zeros(config.num_blocks * config.layout.bytes_per_block,
                       dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="INV-10"):
        build_layer_views(broken, slab, host_pool(config))


def test_runner_view_must_alias_the_resident_view():
    config = tiny_config(num_gpu_blocks=8)
    layout = config.layout
    slab = torch.zeros((config.num_blocks + 1) * layout.bytes_per_block,
                       dtype=torch.uint8)
    name = layout.sparse_layers[0]
    shifted = resident_view(slab, layout, config.num_blocks, W)  # one row off
    with pytest.raises(RuntimeError, match="INV-13"):
        build_layer_views(config, slab, host_pool(config), {name: shifted})
    good = resident_view(slab, layout, config.num_blocks, 0)
    build_layer_views(config, slab, host_pool(config), {name: good})


def _block_tables(groups: int, rows: int, width: int) -> dict:
    """vLLM's own per-group BlockTable (CPU buffers and their "device" copy)."""
    from vllm.v1.worker.block_table import BlockTable

    return {g: BlockTable(B, rows, width, 512, pin_memory=False,
                          device=torch.device("cpu"), kernel_block_size=B,
                          cp_kv_cache_interleave_size=1)
            for g in range(groups)}


def test_residency_updates_rewrite_request_state_and_batch_rows():
    """W0 (spec 4.1, 4.6 step 4): an update replaces the resident entries
    from its start page in every resident group, in the request's cached
    block ids and in its persistent-batch row; other rows are untouched.
    The rows are written directly, so the tables are marked for the next
    commit, which copies them although vLLM changed nothing this step."""
    res_ids = [2, 3]
    noted = []
    runtime = SimpleNamespace(resident_group_ids=res_ids, layers={},
                              note_residency_updates=lambda: noted.append(1))
    tables = _block_tables(6, 4, 8)
    for g in res_ids:
        tables[g].add_row([99, 98], 0)
        tables[g].add_row([10 + g, 20 + g, 30 + g, 40 + g], 1)
    for t in tables.values():
        t.commit_block_table(2)
    state = SimpleNamespace(block_ids=[[], [], [12, 22, 32, 42], [13, 23, 33, 43]])
    runner = SimpleNamespace(
        hisparse_runtime=runtime,
        requests={"r": state},
        input_batch=SimpleNamespace(block_table=tables, req_id_to_index={"r": 1}),
    )
    meta = HiSparseStepMetadata(
        update_req_ids=["r"],
        update_start_pages=np.array([1], dtype=np.int32),
        update_indptr=np.array([0, 3], dtype=np.int64),
        update_block_ids=np.array([[0, 0], [31, 41], [0, 0]], dtype=np.int32),
    )
    apply_residency_updates(runner, SimpleNamespace(kv_connector_metadata=meta))
    assert noted == [1]  # the runtime checks its slots again (P2's cache)
    assert state.block_ids[2] == [12, 0, 31, 0]
    assert state.block_ids[3] == [13, 0, 41, 0]
    for t in tables.values():
        t.commit_block_table(2)
    for g, want in ((2, [12, 0, 31, 0]), (3, [13, 0, 41, 0])):
        for table in (tables[g].block_table.np, tables[g].block_table.gpu.numpy()):
            assert table[1, :4].tolist() == want
            assert table[0, :2].tolist() == [99, 98]


def test_a_residency_update_out_of_step_with_the_table_is_an_error():
    runtime = SimpleNamespace(resident_group_ids=[2], layers={},
                              note_residency_updates=lambda: None)
    state = SimpleNamespace(block_ids=[[], [], [1, 2]])
    runner = SimpleNamespace(hisparse_runtime=runtime, requests={"r": state},
                             input_batch=SimpleNamespace(block_table={},
                                                         req_id_to_index={}))
    meta = HiSparseStepMetadata(
        update_req_ids=["r"], update_start_pages=np.array([1], dtype=np.int32),
        update_indptr=np.array([0, 2], dtype=np.int64),
        update_block_ids=np.array([[0], [5]], dtype=np.int32))
    with pytest.raises(RuntimeError, match="covers pages"):
        apply_residency_updates(runner, SimpleNamespace(kv_connector_metadata=meta))


def test_sparse_layers_write_with_their_resident_slot_mapping():
    """The KV write of a sparse-MLA layer uses its resident group's slot
    mapping (its own group's maps tokens to host rows)."""
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    runner = SimpleNamespace(hisparse_runtime=SimpleNamespace(layers=dict.fromkeys(names)))
    source, res0, res1 = torch.zeros(1), torch.ones(1), torch.ones(1) * 2
    mappings = {names[0]: source, names[1]: source,
                resident_layer_name(names[0]): res0, resident_layer_name(names[1]): res1}
    retarget_slot_mappings(runner, mappings)
    assert mappings[names[0]] is res0 and mappings[names[1]] is res1
    retarget_slot_mappings(SimpleNamespace(hisparse_runtime=None), mappings)


def test_the_runner_pads_no_hot_group_slot_mapping():
    """P2 (runner hook in ``GPUModelRunner._get_slot_mappings``, run here on
    the real method): the hot groups, which the resolver reads by block id,
    get no slot mapping and their layers none; the resident groups' are
    not filled again (the step's slot-mapping kernel padded them); every
    other group is padded with -1 past the real tokens as in the pin, and
    each sparse-MLA layer writes through its resident group's. With
    HiSparse off every group is there."""
    from worker_harness import WorkerRig

    from vllm.v1.worker.block_table import MultiGroupBlockTable
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    rig = WorkerRig()
    layout, groups = rig.layout, rig.config.kv_cache_groups
    n = len(groups)
    tables = MultiGroupBlockTable(8, 512, False, torch.device("cpu"), [B] * n, [B] * n,
                                  [8] * n)
    for t in tables.block_tables:
        t.slot_mapping.gpu.fill_(7)
    runner = SimpleNamespace(kv_cache_config=rig.config, hisparse_runtime=rig.rt,
                             input_batch=SimpleNamespace(block_table=tables))
    by_gid, by_layer = GPUModelRunner._get_slot_mappings(runner, 16, 4, 10)
    hot = set(layout.hot_group_ids)
    assert hot and set(by_gid) == set(range(n)) - hot
    resident = set(layout.resident_group_ids)
    for gid, m in by_gid.items():
        assert (m[:10] == 7).all()
        # A resident group's padding is the slot-mapping kernel's (it writes
        # -1 past the step's tokens: test_fused_slot_mapping): no fill here.
        assert (m[10:16] == (7 if gid in resident else -1)).all(), gid
    for gid in hot:
        assert not set(groups[gid].layer_names) & set(by_layer)
        assert (tables[gid].slot_mapping.gpu == 7).all()  # not touched
    for name, lv in rig.rt.layers.items():
        assert by_layer[name] is by_gid[layout.resident_group_ids[lv.pair]]
    runner.hisparse_runtime = None
    assert set(GPUModelRunner._get_slot_mappings(runner, 16, 4, 10)[0]) == set(range(n))



def test_a_dummy_run_resets_the_step_inputs_before_anything_else():
    """F13 (runner hook at the top of ``GPUModelRunner._dummy_run``, run on
    the real method): a run outside a step may replay a FULL graph that
    reads the resolver's step inputs, which a real step now leaves on the
    device; the runtime resets them before the run does anything (here the
    run stops at its first check, after the hook)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    calls = []
    runner = SimpleNamespace(
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(multimodal_config=None)),
        hisparse_runtime=SimpleNamespace(before_dummy_run=lambda: calls.append("reset")),
    )
    invalid = SimpleNamespace(is_valid_runtime_mode=lambda: calls.append("mode") or False)
    with pytest.raises(AssertionError):
        GPUModelRunner._dummy_run(runner, 4, cudagraph_runtime_mode=invalid)
    assert calls == ["reset", "mode"]
    runner.hisparse_runtime = None  # HiSparse off: no hook
    calls.clear()
    with pytest.raises(AssertionError):
        GPUModelRunner._dummy_run(runner, 4, cudagraph_runtime_mode=invalid)
    assert calls == ["mode"]
