# SPDX-License-Identifier: Apache-2.0
"""Composition of HiSparse's connector with --kv-transfer-config (spec 6.2;
target T3: HiSparse off leaves every config untouched).

Each case builds a real ``VllmConfig``: the hook in ``__post_init__`` runs
``compose_kv_transfer_config`` after vLLM resolves ``--kv-offloading-size``
and before its HMA decision. Every refusal names the setting at fault
(``HiSparseConfigError``, which pydantic reports as a ValueError of the
``VllmConfig``).
"""

import json

import pytest

from tests.hisparse.scheduler.harness import B, glm_config
from vllm.config import (
    AttentionConfig,
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    VllmConfig,
)
from vllm.config.hisparse import HiSparseConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.compose import (
    compose_kv_transfer_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.offloading import (
    HiSparseOffloadingConnector,
)

OFFLOAD_EXTRA = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 30}


@pytest.fixture
def config(tmp_path):
    """config(kv_transfer_config, host_pool_gib=8.0, hisparse=True, **cache)
    -> VllmConfig."""
    model_dir = tmp_path / "glm"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(glm_config()))

    def _build(ktc=None, *, host_pool_gib=8.0, hisparse=True, **cache_kwargs):
        return VllmConfig(
            model_config=ModelConfig(
                model=str(model_dir),
                dtype="float16",
                seed=0,
                skip_tokenizer_init=True,
                max_model_len=4096,
            ),
            cache_config=CacheConfig(
                block_size=B, enable_prefix_caching=True, cache_dtype="fp8",
                **cache_kwargs
            ),
            attention_config=AttentionConfig(
                hisparse_config=HiSparseConfig(host_pool_gib=host_pool_gib)
                if hisparse
                else None
            ),
            kv_transfer_config=ktc,
        )

    return _build


def ktc(name: str, role: str = "kv_both", **kwargs) -> KVTransferConfig:
    return KVTransferConfig(kv_connector=name, kv_role=role, **kwargs)


def multi(*children: dict, role: str = "kv_both") -> KVTransferConfig:
    return ktc(
        "MultiConnector", role, kv_connector_extra_config={"connectors": list(children)}
    )


def child(name: str, **fields) -> dict:
    return {"kv_connector": name, "kv_role": "kv_both", **fields}


def children(vllm_config: VllmConfig) -> list[dict]:
    composed = vllm_config.kv_transfer_config
    assert composed.kv_connector == "MultiConnector"
    return composed.kv_connector_extra_config["connectors"]


def assert_hma_and_full_graphs_kept(vllm_config: VllmConfig) -> None:
    """vLLM's HMA auto-disable and PIECEWISE downgrade stay off."""
    composed = vllm_config.kv_transfer_config
    assert vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert KVConnectorFactory.supports_hma_config(composed)
    cls = KVConnectorFactory.get_connector_class(composed)
    assert (
        cls.requires_piecewise_for_cudagraph(composed.kv_connector_extra_config)
        is False
    )


# ------------------------------------------------------------- composed


def test_no_kv_transfer_config_installs_hisparse_alone(config):
    c = config()
    assert c.kv_transfer_config.kv_connector == "HiSparseConnector"
    assert c.kv_transfer_config.kv_role == "kv_both"
    assert_hma_and_full_graphs_kept(c)


def test_a_config_naming_no_connector_keeps_its_engine_id(config):
    c = config(KVTransferConfig(engine_id="e0"))
    assert c.kv_transfer_config.kv_connector == "HiSparseConnector"
    assert c.kv_transfer_config.engine_id == "e0"


def test_offloading_connector_is_wrapped_with_its_extra_config(config):
    """The blog's command line: OffloadingConnector + TieringOffloadingSpec."""
    c = config(
        ktc(
            "OffloadingConnector",
            kv_connector_extra_config=dict(OFFLOAD_EXTRA),
            engine_id="e1",
        )
    )
    assert children(c) == [
        child("HiSparseConnector"),
        child("HiSparseOffloadingConnector", kv_connector_extra_config=OFFLOAD_EXTRA),
    ]
    assert c.kv_transfer_config.engine_id == "e1"
    assert c.kv_transfer_config.kv_role == "kv_both"
    assert (
        KVConnectorFactory.get_connector_class(KVTransferConfig(**children(c)[1]))
        is HiSparseOffloadingConnector
    )
    assert_hma_and_full_graphs_kept(c)


def test_kv_offloading_size_is_composed_too(config, monkeypatch):
    """--kv-offloading-size makes vLLM install an OffloadingConnector first
    (_post_init_kv_transfer_config); HiSparse composes after it."""
    monkeypatch.setenv("VLLM_USE_SIMPLE_KV_OFFLOAD", "0")
    c = config(kv_offloading_size=2.0, kv_offloading_backend="native")
    (hisparse, offloader) = children(c)
    assert hisparse == child("HiSparseConnector")
    assert offloader["kv_connector"] == "HiSparseOffloadingConnector"
    assert offloader["kv_connector_extra_config"] == {"cpu_bytes_to_use": 2 << 30}
    assert_hma_and_full_graphs_kept(c)


def test_multi_connector_gets_hisparse_first_and_the_aware_offloader(config):
    c = config(
        multi(
            child(
                "OffloadingConnector",
                kv_connector_extra_config=OFFLOAD_EXTRA,
                engine_id="child",
            )
        )
    )
    assert children(c) == [
        child("HiSparseConnector"),
        child(
            "HiSparseOffloadingConnector",
            kv_connector_extra_config=OFFLOAD_EXTRA,
            engine_id="child",
        ),
    ]
    assert_hma_and_full_graphs_kept(c)


def test_multi_connector_with_hisparse_later_puts_it_first(config):
    hisparse = child(
        "HiSparseConnector", kv_connector_extra_config={"host_pool_gib": 8}
    )
    c = config(multi(child("HiSparseOffloadingConnector"), hisparse))
    assert children(c) == [hisparse, child("HiSparseOffloadingConnector")]


def test_explicit_hisparse_connector_is_accepted_and_gives_host_pool_gib(config):
    c = config(
        ktc("HiSparseConnector", kv_connector_extra_config={"host_pool_gib": 16}),
        host_pool_gib=None,
    )
    assert c.kv_transfer_config.kv_connector == "HiSparseConnector"
    assert c.attention_config.hisparse_config.host_pool_gib == 16.0
    c = config(
        ktc("HiSparseConnector", kv_connector_extra_config={"host_pool_gib": 8.0})
    )
    assert c.attention_config.hisparse_config.host_pool_gib == 8.0  # equal: accepted


def test_host_pool_gib_from_a_multi_connector_child(config):
    c = config(
        multi(
            child("HiSparseConnector", kv_connector_extra_config={"host_pool_gib": 4}),
            child("OffloadingConnector", kv_connector_extra_config=OFFLOAD_EXTRA),
        ),
        host_pool_gib=None,
    )
    assert c.attention_config.hisparse_config.host_pool_gib == 4.0
    assert [x["kv_connector"] for x in children(c)] == [
        "HiSparseConnector",
        "HiSparseOffloadingConnector",
    ]


def test_composition_is_a_fixed_point(config):
    c = config(
        ktc("OffloadingConnector", kv_connector_extra_config=dict(OFFLOAD_EXTRA))
    )
    before = (c.kv_transfer_config, c.attention_config.hisparse_config)
    compose_kv_transfer_config(c)
    assert (c.kv_transfer_config, c.attention_config.hisparse_config) == before


def test_hisparse_off_changes_nothing(config):
    """Target T3: without hisparse_config the hook is a no-op."""
    original = ktc("OffloadingConnector", kv_connector_extra_config=dict(OFFLOAD_EXTRA))
    c = config(original, hisparse=False)
    assert c.kv_transfer_config is original
    assert c.kv_transfer_config.kv_connector == "OffloadingConnector"
    assert config(hisparse=False).kv_transfer_config is None


# -------------------------------------------------------------- refused


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_pd_roles_are_refused(config, role):
    with pytest.raises(ValueError, match=f"kv_transfer_config.kv_role={role!r}"):
        config(
            ktc("OffloadingConnector", role, kv_connector_extra_config=OFFLOAD_EXTRA)
        )
    with pytest.raises(ValueError, match=r"connectors\[0\].kv_role"):
        config(multi(child("OffloadingConnector", kv_role=role)))


@pytest.mark.parametrize(
    "name", ["NixlConnector", "LMCacheConnectorV1", "SimpleCPUOffloadConnector"]
)
def test_other_connectors_are_refused(config, name):
    with pytest.raises(ValueError, match=f"kv_transfer_config.kv_connector='{name}'"):
        config(ktc(name))
    with pytest.raises(ValueError, match=rf"connectors\[1\].kv_connector='{name}'"):
        config(multi(child("OffloadingConnector"), child(name)))


def test_a_module_path_to_another_class_is_refused(config):
    with pytest.raises(ValueError, match="OffloadingConnector from my.module"):
        config(ktc("OffloadingConnector", kv_connector_module_path="my.module"))


def test_nested_multi_connector_is_refused(config):
    with pytest.raises(
        ValueError, match=r"connectors\[0\].kv_connector='MultiConnector'"
    ):
        config(multi(child("MultiConnector")))


def test_two_hisparse_connectors_are_refused(config):
    with pytest.raises(ValueError, match=r"connectors\[1\].*appears twice"):
        config(multi(child("HiSparseConnector"), child("HiSparseConnector")))


def test_an_empty_multi_connector_is_refused(config):
    with pytest.raises(
        ValueError, match="kv_connector_extra_config.connectors is empty"
    ):
        config(multi())


def test_different_host_pool_gib_values_are_refused(config):
    match = (
        r"hisparse_config.host_pool_gib=8.0 and "
        r"kv_transfer_config.kv_connector_extra_config.host_pool_gib=16.0 differ"
    )
    with pytest.raises(ValueError, match=match):
        config(
            ktc("HiSparseConnector", kv_connector_extra_config={"host_pool_gib": 16})
        )
    match = r"connectors\[0\].kv_connector_extra_config.host_pool_gib=2.0 differ"
    with pytest.raises(ValueError, match=match):
        config(
            multi(
                child(
                    "HiSparseConnector", kv_connector_extra_config={"host_pool_gib": 2}
                )
            )
        )


def test_a_non_positive_host_pool_gib_is_refused(config):
    with pytest.raises(ValueError, match="extra_config.host_pool_gib=0.0 must be > 0"):
        config(
            ktc("HiSparseConnector", kv_connector_extra_config={"host_pool_gib": 0}),
            host_pool_gib=None,
        )
