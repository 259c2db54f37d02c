# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The kv_cache_utils forks, through vLLM's own entry points.

``get_kv_cache_configs`` and ``get_kv_cache_capacity`` with
``attention_config.hisparse_config`` set build the HiSparse layout (grouping,
override, auto-fit, memory check on the 3.5 accounting, config build, the
capacity and the spec 6.4 log lines); with it unset they are vLLM's.
"""

import pickle

import hs_layout_builders
import pytest
from hs_layout_builders import GiB, capture_logs, model_specs, write_sparse_mla_config

from vllm.config import AttentionConfig, CacheConfig, ModelConfig, VllmConfig
from vllm.config.hisparse import HiSparseConfig
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_kv_cache_capacity,
    get_kv_cache_configs,
)
from vllm.v1.hisparse.config_checks import HiSparseConfigError
from vllm.v1.hisparse.kv_cache_config import HiSparseKVCacheConfig
from vllm.v1.hisparse.layout import HiSparseParams, build_hisparse_layout
from vllm.v1.hisparse.memory import BatchLimits, hisparse_gpu_reserve
from vllm.v1.hisparse.specs import (
    HiSparseHotSpec,
    HiSparseResidentSpec,
    HiSparseSourceSpec,
)
from vllm.v1.kv_cache_interface import KVCacheConfig, MLAAttentionSpec

P = 64 * 656  # 41,984
# 4 layers, each a leader: 4 indexers (33,792 B page) < P, so every layer is
# an oversized unit: 4 pairs, bytes_per_block = P, flat, Sa = 64.
BPB = P


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_sparse_mla_config(tmp_path_factory.mktemp("dsv32") / "m", 4)


@pytest.fixture
def plenty_of_ram(monkeypatch):
    hs_layout_builders.plenty_of_ram(monkeypatch)


def make_config(model_dir, hisparse: dict | None, max_model_len=8192, **cache):
    model_config = ModelConfig(
        model=model_dir, max_model_len=max_model_len, skip_tokenizer_init=True
    )
    attention = AttentionConfig(
        hisparse_config=HiSparseConfig(**hisparse) if hisparse is not None else None
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        attention_config=attention,
        cache_config=CacheConfig(cache_dtype="fp8"),
    )
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    vllm_config.scheduler_config.max_num_batched_tokens = 8192
    for key, value in cache.items():
        setattr(vllm_config.cache_config, key, value)
    return vllm_config


@pytest.fixture
def layout_log():
    with capture_logs("vllm.v1.hisparse.capacity") as messages:
        yield messages


def test_hisparse_off_is_vllm(model_dir):
    """With hisparse_config unset the fork is inert: vLLM's single group."""
    vllm_config = make_config(model_dir, None)
    configs = get_kv_cache_configs(vllm_config, [model_specs()], [100 * 1024 * 1024])
    assert type(configs[0]) is KVCacheConfig
    assert len(configs[0].kv_cache_groups) == 1


STAGING = 8192 // 64 + 8192 // 64


def reserve_at(vllm_config, max_model_len=8192):
    """HiSparse's GPU bytes beside the pool, whatever its size (L17; the
    sizes themselves are tested against real allocations in
    tests/hisparse/memory)."""
    layout = build_hisparse_layout(
        model_specs(), HiSparseParams.from_vllm_config(vllm_config))
    return hisparse_gpu_reserve(
        layout, BatchLimits.from_vllm_config(vllm_config), max_model_len)


def budget_for(vllm_config, num_blocks, max_model_len=8192):
    """The KV memory that holds exactly ``num_blocks`` pool blocks."""
    reserve = reserve_at(vllm_config, max_model_len)
    return num_blocks * BPB + reserve.total


def test_get_kv_cache_configs_builds_hisparse(model_dir, plenty_of_ram, layout_log):
    """3.1-3.5 end to end: group order and roles, N_gpu = min over workers of
    available // bytes_per_block, host pool outside kv_cache_tensors, the
    steady-state capacity, the scheduler-side collapse and the 6.4 lines."""
    vllm_config = make_config(model_dir, {"host_pool_gib": 1.0})
    specs = model_specs()
    # 256 blocks of in-slab staging (cdiv(8192, 64) + cdiv(8192, 64), K13)
    # and the rest of HiSparse's reserve (L17) come off the available memory.
    memory = [budget_for(vllm_config, 1000) + 5, budget_for(vllm_config, 1200)]
    configs = get_kv_cache_configs(vllm_config, [specs, dict(specs)], memory)
    assert all(isinstance(c, HiSparseKVCacheConfig) for c in configs)
    config = configs[0]
    assert config.num_blocks == configs[1].num_blocks == 1000
    names = [g.layer_names for g in config.kv_cache_groups]
    attn = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    assert names[0] == attn
    assert names[1] == [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(4)]
    assert names[2:6] == [[f"{a}.hisparse_resident"] for a in attn]
    assert names[6:10] == [[f"{a}.hisparse_hot"] for a in attn]
    assert config.layout.bytes_per_block == BPB
    # Host: 1 GiB / (4 * P) = 6393 blocks, outside kv_cache_tensors.
    assert config.host_num_blocks == GiB // (4 * P) == 6393
    assert [h.layer_name for h in config.host_kv_cache_tensors] == attn
    assert config.staging_blocks == STAGING
    assert {t.size for t in config.kv_cache_tensors} == {(1000 + STAGING) * BPB}

    # Capacity (vLLM's get_kv_cache_capacity, forked): 8192 tokens = 128
    # pages; cap_res = 130 -> 128 per group; H = 2 * 256 = 512 -> 8 blocks;
    # admission = 128 + 4 * 128 + 4 * 8 = 672; steady = 128 + 8 + 32 = 168.
    tokens, concurrency = get_kv_cache_capacity(vllm_config, config)
    gpu = 1 + (1000 - 672) / 168
    host = 6393 / 128
    assert concurrency == min(gpu, host) == gpu
    assert tokens == int(gpu * 8192)

    # Workers receive the config pickled; the host description survives.
    assert pickle.loads(pickle.dumps(config)) == config

    scheduler_config = generate_scheduler_kv_cache_config(configs)
    assert isinstance(scheduler_config, HiSparseKVCacheConfig)
    kinds = [type(g.kv_cache_spec) for g in scheduler_config.kv_cache_groups]
    assert (
        kinds
        == [HiSparseSourceSpec, MLAAttentionSpec]
        + [HiSparseResidentSpec] * 4
        + [HiSparseHotSpec] * 4
    )

    assert any(
        m.startswith(
            "HiSparse: 1.0 GiB pinned host pool per DP replica (6393 blocks x "
            "64 tokens, stride 167936 B, private); shared GPU indexer/resident/"
            "hot pool 0.0 GiB (1000 blocks, 4 resident/hot group pairs, 41984 "
            "B/block, attention addressing flat)."
        )
        for m in layout_log
    ), layout_log
    assert (
        f"HiSparse steady-state maximum concurrency at max_model_len=8192: "
        f"{gpu:.1f} (GPU {gpu:.1f}, host {host:.1f})."
    ) in layout_log


def test_memory_check_uses_admission_cost(model_dir, plenty_of_ram):
    """3.5: the "one max_model_len request" check needs the admission cost
    (672 blocks here), not the fully-resident one (128 * 8 blocks)."""
    vllm_config = make_config(model_dir, {"host_pool_gib": 1.0})
    budget = budget_for(vllm_config, 672)
    configs = get_kv_cache_configs(vllm_config, [model_specs()], [budget])
    assert configs[0].num_blocks == 672
    with pytest.raises(ValueError, match=r"max seq len \(8192\)"):
        get_kv_cache_configs(vllm_config, [model_specs()], [budget - 1])


def test_num_gpu_blocks_override(model_dir, plenty_of_ram):
    vllm_config = make_config(
        model_dir, {"host_pool_gib": 1.0}, num_gpu_blocks_override=700
    )
    configs = get_kv_cache_configs(vllm_config, [model_specs()], [10**12])
    assert configs[0].num_blocks == 700


def test_auto_fit_uses_hisparse_accounting(model_dir, plenty_of_ram):
    """Auto-fit (max_model_len=-1) searches the 3.5 admission cost, the
    in-slab staging blocks (pages + cdiv(8192, 64), K13), the rest of the
    reserve (L17) and the host pool: with 400 blocks for pool and staging the
    largest length satisfying pages + 4 * min(pages, cap_res) + 4 * 8 +
    pages + 128 <= 400 is 40 pages."""
    vllm_config = make_config(model_dir, {"host_pool_gib": 1.0}, max_model_len=-1)
    # The worker state and block tables at 40 pages, in whole blocks.
    rest = reserve_at(vllm_config, 40 * 64)
    rest_blocks = -(-(rest.total - rest.staging_bytes) // BPB)
    configs = get_kv_cache_configs(
        vllm_config, [model_specs()], [(400 + rest_blocks) * BPB])
    # 6 * 40 + 160 = 400 <= 400 < 6 * 41 + 160 = 406.
    assert vllm_config.model_config.max_model_len == 40 * 64
    # The fitted engine's pool and reserve fit the memory it had.
    fitted = configs[0]
    assert fitted.num_blocks * BPB + fitted.gpu_reserve.total <= (400 + rest_blocks) * BPB


def test_host_pool_too_small(model_dir, plenty_of_ram):
    """R1 / U-3: the pool must hold one max_model_len request (+2 blocks)."""
    vllm_config = make_config(model_dir, {"host_pool_gib": 0.01})
    with pytest.raises(
        HiSparseConfigError,
        match=r"host pool holds 63 blocks but one max_model_len=8192 request needs "
        r"130; raise host_pool_gib to at least 0\.1",
    ):
        get_kv_cache_configs(vllm_config, [model_specs()], [10**9])


def test_workers_must_hold_every_layer(model_dir, plenty_of_ram):
    vllm_config = make_config(model_dir, {"host_pool_gib": 1.0})
    specs = model_specs()
    half = dict(list(specs.items())[:4])
    with pytest.raises(HiSparseConfigError, match="pipeline_parallel_size must be 1"):
        get_kv_cache_configs(vllm_config, [specs, half], [10**9, 10**9])
