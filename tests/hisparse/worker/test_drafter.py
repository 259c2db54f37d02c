# SPDX-License-Identifier: Apache-2.0
"""The MTP drafter's KV-cache groups and slot mappings under HiSparse
(overlay drafter.py, patch spec-decode-hisparse-drafter; docs/mtp.md 3.4).

A real HiSparse KV-cache config of a tiny GLM-5-architecture model with
three target layers and one MTP layer (model.layers.3), and the runner's
block tables as vLLM's own ``BlockTable`` (tests/hisparse/worker/
worker_harness.Batch)."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm.v1.hisparse.drafter import (
    PADDING_SLOT,
    DraftBinding,
    draft_layer_groups,
    draft_write_groups,
    init_draft_attention,
)
from vllm.v1.hisparse.host_pool_plan import plan_host_pool
from vllm.v1.hisparse.kv_cache_config import build_hisparse_kv_cache_config
from vllm.v1.hisparse.layout import HiSparseParams, build_hisparse_layout
from vllm.v1.hisparse.specs import kv_cache_specs_from_hf_config

from worker_harness import Batch

B = 64
MTP_ATTN = "model.layers.3.self_attn.attn"
MTP_INDEXER = "model.layers.3.self_attn.indexer.k_cache"
DRAFT = {MTP_ATTN, MTP_INDEXER}


@pytest.fixture(scope="module")
def config():
    hf = {"num_hidden_layers": 3, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
          "index_head_dim": 128, "index_topk": 64, "index_topk_freq": 1}
    specs = kv_cache_specs_from_hf_config(hf, block_size=B, num_mtp_layers=1)
    params = HiSparseParams(index_topk=64, max_decode_query_len=4,
                            device_buffer_size=320, admission_max_tokens=256,
                            host_pool_bytes=0)
    layout = build_hisparse_layout(specs, params)
    params = dataclasses.replace(params, host_pool_bytes=64 * layout.host_block_stride(False))
    return build_hisparse_kv_cache_config(layout, 64, plan_host_pool(layout, params))


def _gid(config, name: str) -> int:
    return next(g for g, group in enumerate(config.kv_cache_groups)
                if name in group.layer_names)


def test_draft_layers_read_source_and_indexer_metadata(config):
    """docs/mtp.md 3.4: the attention's metadata is the source group's (the
    resolver reads its host table), the indexer's the indexer group's."""
    layout = config.layout
    assert draft_layer_groups(config, DRAFT) == {
        MTP_ATTN: layout.SOURCE_GROUP_ID, MTP_INDEXER: layout.INDEXER_GROUP_ID}


def test_draft_attention_writes_its_resident_pages(config):
    """INV-12: the draft attention writes with its pair's resident slots,
    never with the source group's host rows; the indexer with its own."""
    groups = draft_write_groups(config.layout, draft_layer_groups(config, DRAFT))
    assert groups[MTP_ATTN] == _gid(config, MTP_ATTN + ".hisparse_resident")
    assert groups[MTP_ATTN] in config.layout.resident_group_ids
    assert groups[MTP_INDEXER] == config.layout.INDEXER_GROUP_ID


def test_a_draft_layer_outside_the_hisparse_groups_is_refused(config):
    hot = MTP_ATTN + ".hisparse_hot"
    with pytest.raises(RuntimeError, match=r"drafter's layer .*hisparse_hot.* group"):
        draft_layer_groups(config, {MTP_ATTN, hot})
    with pytest.raises(RuntimeError, match="no sparse-MLA attention layer"):
        draft_layer_groups(config, {MTP_INDEXER})


def test_hisparse_off_leaves_the_proposer_alone():
    """The patch's hook returns False for any other KV-cache config and
    touches nothing, so the pin's own code runs."""
    proposer = SimpleNamespace(kv_cache_gid=-1, draft_attn_groups=[])
    plain = SimpleNamespace(kv_cache_groups=[])
    assert init_draft_attention(proposer, plain, None, {}) is False
    assert proposer.kv_cache_gid == -1 and proposer.draft_attn_groups == []


# ---------------------------------------------------------------- slots


def _batch(config) -> Batch:
    """Two requests: row 0 at 130 computed tokens, row 1 at 60, each with
    distinct blocks per group (host ids in the source group)."""
    batch = Batch(len(config.kv_cache_groups), max_reqs=4, max_blocks=8, max_tokens=64)
    for gid in range(len(config.kv_cache_groups)):
        base = 10 * gid + 1
        batch.set_row(0, gid, [base, base + 1, base + 2], "a")
        batch.set_row(1, gid, [base + 5, base + 6], "b")
    return batch


def _rule(batch: Batch, gid: int, rows: list[int], positions: list[int]) -> list[int]:
    """The runner's slot rule: table[row, pos // B] * B + pos % B."""
    table = batch.host(gid)
    return [int(table[r, p // B]) * B + p % B for r, p in zip(rows, positions)]


def test_pass_zero_writes_the_targets_committed_slots(config):
    """Pass 0 rewrites the target's tokens: each write group's committed
    slot mapping for them, padding after (INV-12)."""
    batch = _batch(config)
    batch.schedule([128, 58], [2, 2])  # q = 2 per request (MTP 1)
    binding = DraftBinding(batch, config.layout, draft_layer_groups(config, DRAFT), 16, "cpu")
    out = binding.slot_mappings(num_tokens=6, num_actual=4)
    write = draft_write_groups(config.layout, draft_layer_groups(config, DRAFT))
    for name in DRAFT:
        expect = _rule(batch, write[name], [0, 0, 1, 1], [128, 129, 58, 59])
        assert out[name].tolist() == expect + [PADDING_SLOT] * 2
        source = _rule(batch, config.layout.SOURCE_GROUP_ID, [0, 0, 1, 1], [128, 129, 58, 59])
        assert out[name][:4].tolist() != source  # never the host rows


def test_later_passes_follow_the_runner_rule_and_the_pins_padding(config):
    """A pass after the first: one token per request at its next position;
    padding where the pin's source slot is padding (past max_model_len) and
    for rows past the batch. Row 1 crosses into its second block."""
    batch = _batch(config)
    batch.schedule([128, 58], [2, 2])
    groups = draft_layer_groups(config, DRAFT)
    binding = DraftBinding(batch, config.layout, groups, 16, "cpu")
    positions = torch.tensor([131, 64, 0, 0], dtype=torch.int64)
    source = torch.tensor([5, PADDING_SLOT], dtype=torch.int64)
    binding.advance(positions, source, batch_size=2, input_batch_size=4)
    out = binding.slot_mappings(num_tokens=4, num_actual=None)
    write = draft_write_groups(config.layout, groups)
    for name in DRAFT:
        expect = _rule(batch, write[name], [0], [131])
        assert out[name].tolist() == expect + [PADDING_SLOT] * 3
    binding.advance(positions, torch.tensor([5, 7]), batch_size=2, input_batch_size=2)
    out = binding.slot_mappings(num_tokens=2, num_actual=None)
    assert out[MTP_ATTN].tolist() == _rule(batch, write[MTP_ATTN], [0, 1], [131, 64])


def test_a_position_past_the_table_clamps_to_its_last_column(config):
    """The pin's kernel clamps the block index to the table width; so does
    the draft rule (the pin pads that slot through the source mask)."""
    batch = _batch(config)
    batch.schedule([128, 58], [1, 1])
    groups = draft_layer_groups(config, DRAFT)
    binding = DraftBinding(batch, config.layout, groups, 8, "cpu")
    width = batch.host(0).shape[1]
    far = width * B + 3
    binding.advance(torch.tensor([far, 60]), torch.tensor([1, 1]), 2, 2)
    out = binding.slot_mappings(2, None)
    gid = draft_write_groups(config.layout, groups)[MTP_ATTN]
    assert out[MTP_ATTN][0].item() == int(batch.host(gid)[0, width - 1]) * B + 3


def test_a_dummy_run_writes_nothing(config):
    """A call not prepared by pass 0 or ``advance`` (a dummy run, a graph
    capture, a second call after a pass) gets padding only, so stale slots
    of a finished pass are never written again."""
    batch = _batch(config)
    batch.schedule([128, 58], [1, 1])
    binding = DraftBinding(batch, config.layout, draft_layer_groups(config, DRAFT), 8, "cpu")
    binding.advance(torch.tensor([129, 59]), torch.tensor([1, 1]), 2, 2)
    assert binding.slot_mappings(2, None)[MTP_ATTN].min().item() >= 0
    again = binding.slot_mappings(4, None)
    assert all((t == PADDING_SLOT).all() for t in again.values())


def test_slot_buffers_are_persistent(config):
    """INV-32: CUDA graphs capture the slot tensors' addresses, so every
    pass returns views of the same buffers."""
    batch = _batch(config)
    batch.schedule([128, 58], [1, 1])
    binding = DraftBinding(batch, config.layout, draft_layer_groups(config, DRAFT), 8, "cpu")
    first = {k: v.data_ptr() for k, v in binding.slot_mappings(4, 2).items()}
    binding.advance(torch.tensor([129, 59]), torch.tensor([1, 1]), 2, 2)
    second = {k: v.data_ptr() for k, v in binding.slot_mappings(2, None).items()}
    assert first == second
    assert len(set(first.values())) == 2  # one buffer per write group


def test_the_indexer_metadata_uses_its_own_table_and_slots(config):
    """build_per_group_and_layer_attn_metadata's hook: the indexer group's
    metadata input gets that group's block table and the indexer slots;
    the source group's is passed through unchanged."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    batch = _batch(config)
    batch.schedule([128, 58], [1, 1])
    binding = DraftBinding(batch, config.layout, draft_layer_groups(config, DRAFT), 8, "cpu")
    fields = {f.name: None for f in dataclasses.fields(CommonAttentionMetadata)
              if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    common = CommonAttentionMetadata(**{
        **fields, "num_reqs": 2, "block_table_tensor": batch.device(0)[:2],
        "slot_mapping": torch.zeros(2, dtype=torch.int64)})
    layout = config.layout
    assert binding.common_for(layout.SOURCE_GROUP_ID, common) is common
    indexer = binding.common_for(layout.INDEXER_GROUP_ID, common)
    assert torch.equal(indexer.block_table_tensor, batch.device(layout.INDEXER_GROUP_ID)[:2])
    assert indexer.slot_mapping.data_ptr() == binding.buffers[layout.INDEXER_GROUP_ID].data_ptr()
    assert indexer.slot_mapping.shape[0] == 2
    assert np.array_equal(common.block_table_tensor.numpy(), batch.device(0)[:2].numpy())


def test_bind_attaches_a_binding_to_the_runners_drafter(config):
    """bind_runtime's hook: a runner with an MTP proposer (which carries the
    patch's ``hisparse`` attribute) gets a DraftBinding over the runtime's
    tables; a runner without a drafter gets none."""
    from vllm.v1.hisparse.drafter import attach_drafter

    batch = _batch(config)
    runtime = SimpleNamespace(tables=batch, device=torch.device("cpu"))
    proposer = SimpleNamespace(hisparse=None, _draft_attn_layer_names=DRAFT)
    runner = SimpleNamespace(drafter=proposer, kv_cache_config=config)
    binding = attach_drafter(runner, runtime, 32)
    assert proposer.hisparse is binding and binding.tables is batch
    assert {b.shape[0] for b in binding.buffers.values()} == {32}
    assert attach_drafter(SimpleNamespace(drafter=None), runtime, 32) is None
