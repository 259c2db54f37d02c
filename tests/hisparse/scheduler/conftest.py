# SPDX-License-Identifier: Apache-2.0
import pytest

from tests.hisparse.scheduler.harness import (
    Faults,
    SimWorker,
    hisparse_kv_cache_config,
    make_scheduler,
)


@pytest.fixture
def build(tmp_path):
    """build(...) -> (scheduler, simulated worker) with HiSparse on."""

    def _build(
        *,
        num_gpu_blocks: int = 120,
        num_host_blocks: int = 400,
        ranks: int = 1,
        faults: Faults | None = None,
        seed: int = 0,
        num_layers: int = 4,
        freq: int = 1,
        admission_max_tokens: int = 256,
        device_buffer_size: int | None = None,
        **scheduler_kwargs,
    ):
        config = hisparse_kv_cache_config(
            num_gpu_blocks=num_gpu_blocks,
            num_host_blocks=num_host_blocks,
            num_layers=num_layers,
            freq=freq,
            admission_max_tokens=admission_max_tokens,
            device_buffer_size=device_buffer_size,
            max_model_len=scheduler_kwargs.get("max_model_len", 4096),
            max_num_batched_tokens=scheduler_kwargs.get("max_num_batched_tokens", 256),
        )
        scheduler = make_scheduler(tmp_path, config, **scheduler_kwargs)
        return scheduler, SimWorker(scheduler, ranks=ranks, faults=faults, seed=seed)

    return _build
