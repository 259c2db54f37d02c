# SPDX-License-Identifier: Apache-2.0
"""``get_kv_cache_coordinator`` picks the HiSparse coordinator by type.

The hook of patch ``core-hisparse-kv-cache-coordinator`` selects
``HiSparseKVCacheCoordinator`` for a ``HiSparseKVCacheConfig`` (the only
config type the HiSparse layout builds) and leaves every other config to the
pin's own selection, even one that happens to carry a ``host_num_blocks``
attribute (issue 10 part 4: an explicit type, not ``hasattr``).
"""

import pytest

from vllm.v1.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from vllm.v1.hisparse.kv_cache_coordinator import HiSparseKVCacheCoordinator

from tests.hisparse.scheduler.harness import (
    B,
    baseline_kv_cache_config,
    hisparse_kv_cache_config,
)


def coordinator_for(kv_cache_config, *, enable_caching: bool = True):
    return get_kv_cache_coordinator(
        kv_cache_config,
        max_model_len=4096,
        max_in_flight_tokens=256,
        use_eagle=False,
        enable_caching=enable_caching,
        enable_kv_cache_events=False,
        dcp_world_size=1,
        pcp_world_size=1,
        scheduler_block_size=B,
        hash_block_size=B,
    )


def test_hisparse_config_gets_the_hisparse_coordinator():
    config = hisparse_kv_cache_config(num_gpu_blocks=120, num_host_blocks=400)
    coordinator = coordinator_for(config)
    assert type(coordinator) is HiSparseKVCacheCoordinator
    assert coordinator.host_pool.num_gpu_blocks == config.host_num_blocks


@pytest.mark.parametrize(
    ("enable_caching", "expected"),
    [(True, UnitaryKVCacheCoordinator), (False, KVCacheCoordinatorNoPrefixCache)],
)
def test_plain_config_gets_the_pins_coordinator(enable_caching, expected):
    config = baseline_kv_cache_config(num_gpu_blocks=120)
    coordinator = coordinator_for(config, enable_caching=enable_caching)
    assert type(coordinator) is expected


def test_a_host_num_blocks_attribute_alone_does_not_select_hisparse():
    """Duck typing is not enough: a plain KVCacheConfig with a stray
    ``host_num_blocks`` still gets the pin's coordinator."""
    config = baseline_kv_cache_config(num_gpu_blocks=120)
    config.host_num_blocks = 400
    coordinator = coordinator_for(config)
    assert type(coordinator) is UnitaryKVCacheCoordinator
    assert not isinstance(coordinator, HybridKVCacheCoordinator)
