# SPDX-License-Identifier: Apache-2.0
"""A P/D consumer rig: vLLM's real scheduler with HiSparse and a user's
``ExampleConnector`` (kv_consumer), composed into
MultiConnector[HiSparseConnector, HiSparseImportingConnector] by the real
composition; the HiSparse SimWorker; and the importer's *real* worker half
(``start_load_kv``, ``load_job``, ``get_finished``, its failure report) as a
MultiConnector child of the SimWorker.

The importer's files are real safetensors files in the pin's layout (one per
layer, ``<folder>/<layer>.safetensors`` holding ``kv_cache``), written on
the CPU by ``write_prefill``. Each row is 8 bytes, the SimWorker's tag of
that position salted with the group the row belongs to (the indexer group
for indexer layers, the layer's resident group for sparse-MLA layers), so a
row loaded into the wrong group, block, host row or position is caught by
the SimWorker's reads of every context row (spec 4.13, INV-30, T1).

The worker child writes into the SimWorker's own arrays through byte views:
the GPU slab (``gpu``, one int64 per row: resident and indexer blocks) and
the host pool (``host``, one int64 column per resident group).
"""

from __future__ import annotations

import copy
import dataclasses
import os

import numpy as np
import safetensors.torch
import torch

from tests.hisparse.scheduler.harness import (
    B,
    RowTags,
    SimWorker,
    group_salt,
    hisparse_kv_cache_config,
    make_scheduler,
)
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.importing import (
    KV_KEY,
    HiSparseImportingConnector,
    ImportTarget,
    MLATarget,
    file_tokens,
    layer_file,
)
from vllm.v1.core.sched.scheduler import Scheduler


def consumer_config(path: str, role: str = "kv_consumer") -> KVTransferConfig:
    """What a user writes on the decode instance (the pin's connector)."""
    return KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role=role,
        kv_connector_extra_config={"shared_storage_path": path},
    )


class RestoringSimWorker(SimWorker):
    """The SimWorker plus the restore copies of ``start_step`` (4.13 step
    4): host -> resident, every resident group, before the forward."""

    restores_seen: list[tuple[int, int]]

    def _transfers(self, meta, batch) -> None:
        if not hasattr(self, "restores_seen"):
            self.restores_seen = []
        for tid, hb, res, restore in zip(
            meta.transfer_ids.tolist(), meta.transfer_host_blocks.tolist(),
            meta.transfer_resident_blocks.tolist(), meta.transfer_restore.tolist(),
        ):
            if not restore:
                continue
            self.restores_seen.append((tid, hb))
            for j, blk in enumerate(res):
                self.gpu[blk * B:(blk + 1) * B] = self.host[hb * B:(hb + 1) * B, j]
        super()._transfers(meta, batch)

    def _attend(self, *args, **kwargs) -> None:
        # The importer writes indexer rows into the SimWorker's own slab (no
        # offloader double models them), so every indexer read is checked.
        children, self.children = self.children, []
        try:
            super()._attend(*args, **kwargs)
        finally:
            self.children = children


class SimImportWorker:
    """The real worker half of HiSparseImportingConnector over the
    SimWorker's bytes (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, worker: SimWorker) -> None:
        sched_side = scheduler.connector._connectors[1]
        assert isinstance(sched_side, HiSparseImportingConnector)
        self.connector = HiSparseImportingConnector(
            copy.copy(sched_side._vllm_config),
            KVConnectorRole.WORKER,
            sched_side._kv_cache_config,
        )
        layout = sched_side._layout
        gpu = torch.from_numpy(worker.gpu).view(torch.uint8).view(-1, B, 8)
        host = torch.from_numpy(worker.host).view(torch.uint8)
        mla = {
            name: MLATarget(
                layout.pair_of(name), gpu, host[:, 8 * layout.pair_of(name):][:, :8]
            )
            for name in layout.sparse_layers
        }
        indexer = {name: gpu for name in layout.indexer_layers}
        self.connector._target = ImportTarget(B, mla, indexer)
        self.loads: list = []
        self.reports: list = []

    def step(self, child_meta, so):
        self.connector.bind_connector_metadata(child_meta)
        self.loads.extend(child_meta.jobs)
        self.connector.start_load_kv(None)
        _, recving = self.connector.get_finished(set())
        report = self.connector.build_connector_worker_meta()
        if report is not None:
            self.reports.append(report)
        self.connector.clear_connector_metadata()
        return report, recving or set(), set()


@dataclasses.dataclass
class ImportRig:
    scheduler: Scheduler
    worker: RestoringSimWorker
    importer: SimImportWorker
    path: str

    @property
    def connector(self) -> HiSparseImportingConnector:
        return self.scheduler.connector._connectors[1]

    @property
    def hisparse(self):
        return self.scheduler.kv_cache_manager.coordinator.hisparse


def build_rig(tmp_path, *, num_gpu_blocks=120, num_host_blocks=400,
              role="kv_consumer", **scheduler_kwargs) -> ImportRig:
    path = str(tmp_path / "kv")
    os.makedirs(path, exist_ok=True)
    config = hisparse_kv_cache_config(
        num_gpu_blocks=num_gpu_blocks, num_host_blocks=num_host_blocks,
        max_model_len=scheduler_kwargs.get("max_model_len", 4096),
        max_num_batched_tokens=scheduler_kwargs.get("max_num_batched_tokens", 256),
    )
    scheduler = make_scheduler(
        tmp_path, config, kv_transfer_config=consumer_config(path, role),
        **scheduler_kwargs,
    )
    worker = RestoringSimWorker(scheduler)
    importer = SimImportWorker(scheduler, worker)
    worker.children = [importer]
    return ImportRig(scheduler, worker, importer, path)


def write_prefill(rig: ImportRig, prompt: list[int], *, rows: int | None = None,
                  skip_layers: tuple[str, ...] = ()) -> str:
    """The files a prefill instance leaves for ``prompt`` (real safetensors,
    the pin's folder and file names): every sparse-MLA and indexer layer's
    first ``rows`` rows (default: all T). Returns the folder."""
    conn = rig.connector
    layout = conn._layout
    t = file_tokens(len(prompt), B)
    folder = conn._generate_foldername_debug(
        torch.tensor(prompt[:t]), [], create_folder=True
    )
    tags = RowTags().extend_to(prompt)[:t]
    n = t if rows is None else rows
    for name in (*layout.sparse_layers, *layout.indexer_layers):
        if name in skip_layers:
            continue
        gid = (layout.INDEXER_GROUP_ID if name in layout.indexer_layers
               else layout.resident_group_ids[layout.pair_of(name)])
        kv = torch.from_numpy((tags[:n] ^ np.int64(group_salt(gid))).reshape(n, 1))
        safetensors.torch.save_file({KV_KEY: kv}, layer_file(folder, name))
    return folder


__all__ = ["ImportRig", "build_rig", "consumer_config", "write_prefill"]
