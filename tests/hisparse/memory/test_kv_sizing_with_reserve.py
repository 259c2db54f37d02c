# SPDX-License-Identifier: Apache-2.0
"""KV sizing leaves room for HiSparse's reserve (spec 3.5 "allocated before
KV sizing", 2.8, 2.11; docs/layout.md L17), through vLLM's own
``get_kv_cache_configs``.

Without an override the pool is the largest whose blocks, staging blocks,
worker state and extra block tables fit the available KV memory; with
``num_gpu_blocks_override`` the pool is the override, and startup refuses an
override whose pool and reserve exceed that memory, naming the largest that
fits. The reserve is logged once.
"""

import pytest
from hs_layout_builders import (
    capture_logs,
    model_specs,
    plenty_of_ram,
    write_sparse_mla_config,
)

from vllm.config import AttentionConfig, CacheConfig, ModelConfig, VllmConfig
from vllm.config.hisparse import HiSparseConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
from vllm.v1.hisparse.config_checks import HiSparseConfigError
from vllm.v1.hisparse.layout import HiSparseParams, build_hisparse_layout
from vllm.v1.hisparse.memory import (
    BatchLimits,
    hisparse_gpu_reserve,
    max_pool_blocks,
    staging_block_count,
)

BPB = 64 * 656  # 4 single-layer pairs: bytes_per_block = P
LEN = 8192
MiB = 1 << 20
BUDGET = 20_000 * BPB  # 0.78 GiB


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_sparse_mla_config(tmp_path_factory.mktemp("dsv32") / "m", 4)


@pytest.fixture(autouse=True)
def ram(monkeypatch):
    """The RAM check passes on any host, in every test here."""
    plenty_of_ram(monkeypatch)


@pytest.fixture
def logs():
    with capture_logs("vllm.v1.hisparse.memory",
                      "vllm.v1.hisparse.kv_cache_config") as messages:
        yield messages


def make_config(model_dir, *, seqs=256, tokens=8192, max_model_len=LEN, hot=None,
                override=None):
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=model_dir, max_model_len=max_model_len,
                                 skip_tokenizer_init=True),
        attention_config=AttentionConfig(hisparse_config=HiSparseConfig(
            host_pool_gib=1.0, device_buffer_size=hot)),
        cache_config=CacheConfig(cache_dtype="fp8"),
    )
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    vllm_config.scheduler_config.max_num_seqs = seqs
    vllm_config.scheduler_config.max_num_batched_tokens = tokens
    vllm_config.cache_config.num_gpu_blocks_override = override
    return vllm_config


def layout_of(vllm_config):
    return build_hisparse_layout(model_specs(),
                                 HiSparseParams.from_vllm_config(vllm_config))


def reserve_of(vllm_config, max_model_len=LEN):
    """HiSparse's reserve for the config's limits (not a function of the
    pool size: the same beside any number of blocks)."""
    return hisparse_gpu_reserve(layout_of(vllm_config),
                                BatchLimits.from_vllm_config(vllm_config),
                                max_model_len)


def sized(vllm_config, budget):
    return get_kv_cache_configs(vllm_config, [model_specs()], [budget])[0]


@pytest.mark.parametrize("seqs, hot, extra", [
    (256, None, 12_345), (8, None, 0), (1024, 4096, BPB - 1)])
def test_pool_and_reserve_fit_the_available_memory(model_dir, seqs, hot, extra):
    """3.5: the staging blocks, the hot-slot state, the workspace, the
    staging cache, the mirror descriptors and the extra block tables come
    off the available memory before the pool is sized; the pool is the
    largest that fits beside them (one more block does not)."""
    vllm_config = make_config(model_dir, seqs=seqs, hot=hot)
    budget = BUDGET + extra
    config = sized(vllm_config, budget)
    n = config.num_blocks
    reserve = reserve_of(vllm_config)
    assert config.gpu_reserve == reserve
    assert n * BPB + reserve.total <= budget
    assert (n + 1) * BPB + reserve.total > budget
    # Not only the staging blocks (the accounting before L17): the worker's
    # state is in too.
    staging = staging_block_count(LEN, 64, 8192)
    assert n < budget // BPB - staging
    assert config.staging_blocks == staging


def test_larger_batch_limits_leave_a_smaller_pool(model_dir):
    """The reserve grows with S (dgi/lru rows, block-table rows) and H."""
    budget = BUDGET
    small = sized(make_config(model_dir, seqs=8), budget).num_blocks
    large = sized(make_config(model_dir, seqs=1024), budget).num_blocks
    larger_h = sized(make_config(model_dir, seqs=1024, hot=8192), budget).num_blocks
    assert small > large > larger_h


def test_the_override_is_the_pool_and_must_fit_beside_the_reserve(model_dir, logs):
    """L17: ``num_gpu_blocks_override`` is the pool the scheduler gets
    (staging blocks are not taken out of it); the largest override that fits
    with the reserve starts, one more block is refused with the bound."""
    budget = BUDGET
    probe = make_config(model_dir)
    limit = max_pool_blocks(layout_of(probe), BatchLimits.from_vllm_config(probe),
                            LEN, budget)
    config = sized(make_config(model_dir, override=limit), budget)
    assert config.num_blocks == limit
    assert config.staging_blocks == staging_block_count(LEN, 64, 8192)
    assert limit * BPB + config.gpu_reserve.total <= budget
    assert (f"Overriding num_gpu_blocks={limit} with num_gpu_blocks_override="
            f"{limit}") in logs
    with pytest.raises(
        HiSparseConfigError,
        match=rf"num_gpu_blocks_override={limit + 1} does not fit the "
              rf".* Set num_gpu_blocks_override <= {limit}, or raise "
              "gpu_memory_utilization",
    ):
        sized(make_config(model_dir, override=limit + 1), budget)


def test_a_small_override_still_starts(model_dir):
    """An override well inside the budget keeps its exact size (the e2e
    pressure engines rely on it)."""
    config = sized(make_config(model_dir, override=700), 10**12)
    assert config.num_blocks == 700


def test_a_reserve_larger_than_the_memory_is_refused(model_dir):
    """Without room for one pool block the error names the reserve and what
    shrinks it; with an override too."""
    tiny = 10 * MiB
    with pytest.raises(HiSparseConfigError, match=r"leaves no room for the pool"):
        sized(make_config(model_dir, seqs=1024, hot=8192), tiny)
    with pytest.raises(HiSparseConfigError, match=r"Lower max_model_len"):
        sized(make_config(model_dir, seqs=1024, hot=8192, override=10), tiny)


def test_auto_fit_shortens_the_length_for_the_reserve(model_dir):
    """Auto-fit (max_model_len=-1) searches lengths whose admission cost and
    reserve fit together; the fitted engine's pool and reserve fit."""
    budget = 1200 * BPB
    vllm_config = make_config(model_dir, max_model_len=-1, seqs=512)
    config = sized(vllm_config, budget)
    fitted = vllm_config.model_config.max_model_len
    assert fitted < 16384
    assert config.num_blocks * BPB + config.gpu_reserve.total <= budget
    assert config.gpu_reserve == reserve_of(vllm_config, fitted)


def test_the_reserve_is_logged_once(model_dir, logs):
    """Startup names what HiSparse took outside the pool, once."""
    config = sized(make_config(model_dir), BUDGET)
    lines = [m for m in logs if m.startswith("HiSparse: reserved ")]
    assert lines == [config.gpu_reserve.describe()]
