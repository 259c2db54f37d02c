# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The MTP drafter under HiSparse: its KV-cache groups and slot mappings
(docs/mtp.md 3.4, issue 17 item 1).

The pin's proposer assumes one KV-cache group for all draft layers and hands
every draft layer the slot mapping of that group. Under HiSparse a draft
layer's sparse-MLA attention sits in the source group (block ids are host
blocks, slots are host rows) and its indexer in the indexer group, and the
attention writes KV into its resident pages. The patch
``spec-decode-hisparse-drafter`` calls, each a no-op with HiSparse off:

- ``init_draft_attention`` (``initialize_attn_backend``): one attention
  group per draft layer's own KV-cache group, ``kv_cache_gid`` = the source
  group, so the drafter gets the source metadata the resolver reads (its
  block table is the host table);
- ``DraftBinding.common_for`` (``build_per_group_and_layer_attn_metadata``):
  the indexer's metadata from the indexer group's table and slots;
- ``DraftBinding.slot_mappings`` (``_get_slot_mapping``): the attention
  writes with its pair's resident slots, the indexer with indexer slots;
- ``DraftBinding.advance`` (``_update_positions_dependent_metadata``): the
  slots of the next draft pass, by the pin's own rule.
"""

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from vllm.v1.hisparse.kv_cache_config import HiSparseKVCacheConfig
from vllm.v1.hisparse.layout import HiSparseLayout

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

PADDING_SLOT = -1


def draft_layer_groups(
    kv_cache_config: "KVCacheConfig", draft_names: Iterable[str]
) -> dict[str, int]:
    """Draft layer -> the KV-cache group its metadata is built from: the
    source group for a sparse-MLA layer, the indexer group for an indexer.
    Anything else is refused: HiSparse drives no other draft layer."""
    layout: HiSparseLayout = kv_cache_config.layout
    group_of = {
        name: gid
        for gid, group in enumerate(kv_cache_config.kv_cache_groups)
        for name in group.layer_names
    }
    allowed = (layout.SOURCE_GROUP_ID, layout.INDEXER_GROUP_ID)
    groups = {}
    for name in sorted(draft_names):
        gid = group_of.get(name)
        if gid not in allowed:
            raise RuntimeError(
                f"HiSparse: the drafter's layer {name} is in KV-cache group {gid}; "
                "HiSparse runs MTP drafters whose layers are sparse-MLA attention "
                f"(group {layout.SOURCE_GROUP_ID}) and its indexer (group "
                f"{layout.INDEXER_GROUP_ID}) only."
            )
        groups[name] = gid
    if layout.SOURCE_GROUP_ID not in groups.values():
        raise RuntimeError(
            "HiSparse: the drafter has no sparse-MLA attention layer; "
            f"its layers are {sorted(groups)}."
        )
    return groups


def draft_write_groups(layout: HiSparseLayout, groups: Mapping[str, int]) -> dict[str, int]:
    """Draft layer -> the group whose slots it writes KV with: a sparse-MLA
    layer its pair's resident group (INV-12: KV lands in resident pages,
    never at host rows), an indexer the indexer group."""
    return {
        name: layout.resident_group_ids[layout.pair_of(name)]
        if gid == layout.SOURCE_GROUP_ID
        else gid
        for name, gid in groups.items()
    }


def init_draft_attention(
    proposer: Any,
    kv_cache_config: "KVCacheConfig",
    kernel_block_sizes: list[int] | None,
    attn_layers: Mapping[str, Any],
) -> bool:
    """The proposer's attention groups under HiSparse; False (nothing done)
    with HiSparse off. One group per (backend, KV-cache group), each with
    its layer's own spec and kernel block size."""
    if not isinstance(kv_cache_config, HiSparseKVCacheConfig):
        return False
    from vllm.v1.worker.utils import AttentionGroup

    layout = kv_cache_config.layout
    groups = draft_layer_groups(kv_cache_config, proposer._draft_attn_layer_names)
    attention_groups: dict[tuple[str, int], AttentionGroup] = {}
    for name, gid in groups.items():
        backend = attn_layers[name].get_attn_backend()
        key = (backend.full_cls_name(), gid)
        if key in attention_groups:
            attention_groups[key].layer_names.append(name)
            continue
        spec = kv_cache_config.kv_cache_groups[gid].kv_cache_spec
        group = AttentionGroup(
            backend=backend,
            layer_names=[name],
            kv_cache_spec=spec.kv_cache_specs[name],
            kv_cache_group_id=gid,
        )
        kernel_block_size = (
            kernel_block_sizes[gid]
            if kernel_block_sizes is not None and gid < len(kernel_block_sizes)
            else None
        )
        group.create_metadata_builders(
            proposer.vllm_config, proposer.device, kernel_block_size=kernel_block_size
        )
        attention_groups[key] = group
    # The source group first: its metadata is what the runner hands over
    # (kv_cache_gid) and what the resolver reads (the host table).
    proposer.draft_attn_groups = sorted(
        attention_groups.values(), key=lambda g: g.kv_cache_group_id
    )
    proposer.kv_cache_gid = layout.SOURCE_GROUP_ID
    proposer.block_size = layout.block_size
    return True


class DraftBinding:
    """Slot mappings of the draft layers, one persistent int64 buffer per
    write group (CUDA graphs capture their addresses, as the pin's own
    buffer). ``tables`` is the runner's ``BatchState``."""

    def __init__(
        self,
        tables: Any,
        layout: HiSparseLayout,
        groups: Mapping[str, int],
        max_num_tokens: int,
        device: torch.device,
    ) -> None:
        self.tables = tables
        self.block_size = layout.block_size
        self.source_gid = layout.SOURCE_GROUP_ID
        self.write_gid = draft_write_groups(layout, groups)
        self.buffers = {
            gid: torch.full((max_num_tokens,), PADDING_SLOT, dtype=torch.int64, device=device)
            for gid in sorted(set(self.write_gid.values()))
        }
        self._armed = False

    def common_for(self, gid: int, common: Any) -> Any:
        """A draft group's metadata input: the indexer's from its own table
        and slots; the source group's unchanged."""
        if gid == self.source_gid:
            return common
        return replace(
            common,
            block_table_tensor=self.tables.device(gid)[: common.num_reqs],
            slot_mapping=self.buffers[gid][: common.slot_mapping.shape[0]],
        )

    def slot_mappings(self, num_tokens: int, num_actual: int | None) -> dict[str, torch.Tensor]:
        """The forward context's slot mappings of a draft pass. Pass 0
        (``num_actual`` given) writes the target's tokens again: the step's
        committed slots of each write group. A later pass uses what
        ``advance`` computed. Any other call (a dummy run, a capture) writes
        nothing: every slot is padding."""
        for gid, buf in self.buffers.items():
            if num_actual is not None:
                buf[:num_actual].copy_(self.tables.slot_mapping(gid)[:num_actual])
                buf[num_actual:num_tokens].fill_(PADDING_SLOT)
            elif not self._armed:
                buf[:num_tokens].fill_(PADDING_SLOT)
        self._armed = False
        return {name: self.buffers[gid][:num_tokens] for name, gid in self.write_gid.items()}

    def advance(
        self,
        positions: torch.Tensor,
        source_slots: torch.Tensor,
        batch_size: int,
        input_batch_size: int,
    ) -> None:
        """The next pass's slots (one token per request): the pin's rule on
        each write group's table (block at min(pos // B, width - 1), offset
        pos % B), padding where the pin's source slot is padding (a position
        past max_model_len) and for rows past ``batch_size``."""
        pos = positions[:batch_size].to(torch.int64)
        dead = source_slots[:batch_size] < 0
        for gid, buf in self.buffers.items():
            table = self.tables.device(gid)[:batch_size]
            column = torch.clamp(pos // self.block_size, max=table.shape[1] - 1)
            block = table.gather(1, column.unsqueeze(1)).squeeze(1).to(torch.int64)
            slots = block * self.block_size + pos % self.block_size
            buf[:batch_size] = torch.where(dead, PADDING_SLOT, slots)
            buf[batch_size:input_batch_size].fill_(PADDING_SLOT)
        self._armed = True


def attach_drafter(runner: Any, runtime: Any, max_num_tokens: int) -> DraftBinding | None:
    """``bind_runtime``: the runner's MTP drafter gets its ``DraftBinding``
    (None without a drafter)."""
    proposer = getattr(runner, "drafter", None)
    if proposer is None or not hasattr(proposer, "hisparse"):
        return None
    config = runner.kv_cache_config
    groups = draft_layer_groups(config, proposer._draft_attn_layer_names)
    proposer.hisparse = DraftBinding(
        runtime.tables, config.layout, groups, max_num_tokens, runtime.device
    )
    return proposer.hisparse


__all__ = [
    "DraftBinding",
    "attach_drafter",
    "draft_layer_groups",
    "draft_write_groups",
    "init_draft_attention",
]
