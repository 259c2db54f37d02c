# SPDX-License-Identifier: Apache-2.0
"""The importer's worker half against the real HiSparse slab geometry and
real safetensors files in the pin's format, on the CPU (spec 4.13
"worker", INV-30, T1).

The prefill side is a HiSparse-off instance: one uniform KV-cache group, a
[blocks, B, W] cache per layer (656-B fp8_ds_mla rows, 132-B indexer rows)
filled with random bytes; its rows are saved with the gather that
``SparseMLAExampleConnector.save_kv_layer`` uses. The decode side is the
tiny GLM-5 HiSparse layout: sparse-MLA layers are strided views of one
device slab at their pair's offset, the indexer layers views of the same
slab at theirs, host rows one array per layer.
"""

import safetensors.torch
import torch

from tests.hisparse.scheduler.harness import B, hisparse_kv_cache_config
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.importing import (
    KV_KEY,
    ImportJob,
    ImportTarget,
    MLATarget,
    _gather_rows,
    _scatter_rows,
    layer_file,
    load_job,
    read_rows,
)
from vllm.v1.hisparse.binding import resident_view, tensor_offsets

N_GPU, N_HOST, N_PROD = 40, 32, 16
T = 5 * B  # imported tokens


def decode_side():
    config = hisparse_kv_cache_config(num_gpu_blocks=N_GPU, num_host_blocks=N_HOST)
    layout = config.layout
    slab = torch.zeros(N_GPU * layout.bytes_per_block, dtype=torch.uint8)
    offsets = tensor_offsets(config)
    mla = {
        name: MLATarget(
            layout.pair_of(name),
            resident_view(slab, layout, N_GPU, layout.sparse_layer_offset(name)),
            torch.zeros(N_HOST * B, layout.row_bytes, dtype=torch.uint8),
        )
        for name in layout.sparse_layers
    }
    spec = config.kv_cache_groups[layout.INDEXER_GROUP_ID].kv_cache_spec
    w = spec.page_size_bytes // B  # 132-B rows
    indexer = {}
    for name in layout.indexer_layers:
        indexer[name] = torch.as_strided(
            slab, (N_GPU, B, w), (layout.bytes_per_block, w, 1), offsets[name]
        )
    return layout, slab, ImportTarget(B, mla, indexer)


def prefill_files(tmp_path, target: ImportTarget, rows=T) -> tuple[str, dict]:
    """Random producer caches, saved row-wise for a prompt placed in
    producer blocks 7, 3, 11, 2, 9 (a HiSparse-off instance's one group)."""
    gen = torch.Generator().manual_seed(0)
    blocks = torch.tensor([7, 3, 11, 2, 9])
    slots = (blocks[:, None] * B + torch.arange(B)).flatten()[:rows]
    saved = {}
    widths = {n: t.host.shape[-1] for n, t in target.mla.items()}
    widths.update({n: t.shape[-1] for n, t in target.indexer.items()})
    for name, w in widths.items():
        cache = torch.randint(0, 256, (N_PROD, B, w), dtype=torch.uint8, generator=gen)
        saved[name] = _gather_rows(cache, slots, B)
        safetensors.torch.save_file({KV_KEY: saved[name]}, layer_file(str(tmp_path), name))
    return str(tmp_path), saved


def job(folder, landing, first=0, resident=None):
    pages = range(first // B, T // B)
    return ImportJob(
        req_id="a", folder=folder, first_token=first, end_token=T, landing=landing,
        host_block_ids=[30 - p for p in pages],
        indexer_block_ids=[4 + 2 * p for p in pages],
        resident_block_ids=resident or [],
    )


def rows_at(view3d, block_ids, first=0):
    pos = torch.arange(T - first) + first % B
    blk = torch.tensor(block_ids)[pos // B]
    return view3d[blk, pos % B]


def test_rows_land_in_each_groups_places_host_landing(tmp_path):
    """Indexer rows -> the indexer group's blocks; sparse-MLA rows -> the
    host rows of the source group's host blocks; no resident row written."""
    layout, slab, target = decode_side()
    folder, saved = prefill_files(tmp_path, target)
    j = job(folder, "host")
    assert load_job(j, read_rows, target)
    for name, view in target.indexer.items():
        assert torch.equal(rows_at(view, j.indexer_block_ids), saved[name])
    for name, t in target.mla.items():
        host = t.host.view(N_HOST, B, -1)
        assert torch.equal(rows_at(host, j.host_block_ids), saved[name])
    # Only the indexer blocks of the slab were written.
    written = (slab.view(N_GPU, -1) != 0).any(-1).nonzero().flatten().tolist()
    assert written == j.indexer_block_ids


def test_device_landing_writes_each_layers_resident_group(tmp_path):
    """Device landing: each sparse-MLA layer's rows go to the blocks of its
    own resident group (pair), and to host."""
    layout, slab, target = decode_side()
    folder, saved = prefill_files(tmp_path, target)
    g = len(layout.resident_group_ids)
    resident = [[13 + p * g + j for p in range(T // B)] for j in range(g)]
    j = job(folder, "device", resident=resident)
    assert load_job(j, read_rows, target)
    for name, t in target.mla.items():
        assert torch.equal(rows_at(t.resident, resident[t.resident_group]), saved[name])
        host = t.host.view(N_HOST, B, -1)
        assert torch.equal(rows_at(host, j.host_block_ids), saved[name])


def test_an_import_after_a_local_hit_writes_only_its_pages(tmp_path):
    layout, slab, target = decode_side()
    folder, saved = prefill_files(tmp_path, target)
    j = job(folder, "host", first=2 * B)
    assert load_job(j, read_rows, target)
    name = layout.sparse_layers[0]
    host = target.mla[name].host.view(N_HOST, B, -1)
    assert torch.equal(rows_at(host, j.host_block_ids, 2 * B), saved[name][2 * B:])
    assert not host[30].any() and not host[29].any()  # pages 0, 1: untouched


def test_a_short_or_missing_file_writes_nothing(tmp_path):
    """4.13 step 5: every file is read before any row is written."""
    layout, slab, target = decode_side()
    folder, _ = prefill_files(tmp_path, target, rows=T - 1)
    assert not load_job(job(folder, "host"), read_rows, target)
    assert not slab.any() and not any(t.host.any() for t in target.mla.values())
    assert not load_job(job(str(tmp_path / "none"), "host"), read_rows, target)


def test_rows_of_another_width_are_refused(tmp_path):
    layout, slab, target = decode_side()
    folder, _ = prefill_files(tmp_path, target)
    name = layout.sparse_layers[0]
    bf16 = torch.zeros(T, 576, dtype=torch.bfloat16)  # a bf16 MLA cache's rows
    safetensors.torch.save_file({KV_KEY: bf16}, layer_file(folder, name))
    assert not load_job(job(folder, "host"), read_rows, target)
    assert not slab.any()


def test_the_reference_consumer_scatters_what_the_producer_gathered():
    """SparseMLAExampleConnector moves whole rows of a [blocks, B, W] cache
    (the pin's branch for non-MLACommonMetadata moved a byte column)."""
    src = torch.randint(0, 256, (N_PROD, B, 656), dtype=torch.uint8)
    slots = torch.tensor([3 * B + 5, 3 * B + 6, 9 * B])
    dst = torch.zeros_like(src)
    _scatter_rows(dst, slots, _gather_rows(src, slots, B), B)
    assert torch.equal(dst[3, 5], src[3, 5]) and torch.equal(dst[9, 0], src[9, 0])
    assert int((dst != 0).any(-1).sum()) == 3
