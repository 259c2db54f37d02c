# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""R1 / U-3 / U-5: every HiSparse startup check fails with a message that
names the setting, its value, the limit and the fix (spec 6.3), and the
config-only checks run through ``verify_hisparse_config`` on a real
VllmConfig. The RAM check reads psutil, which is monkeypatched."""

import logging
import re
from collections import namedtuple

import psutil
import pytest

from tests.hisparse.layout.hs_layout_builders import write_sparse_mla_config
from vllm.config import (
    AttentionConfig,
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    VllmConfig,
)
from vllm.config.hisparse import HiSparseConfig
from vllm.v1.hisparse import config_checks as cc
from vllm.v1.hisparse.config_checks import HiSparseConfigError

GiB = 1 << 30


def raises(message: str):
    """The exact message (spec 6.3 wording plus setting/value/limit/fix)."""
    return pytest.raises(HiSparseConfigError, match=f"^{re.escape(message)}$")


@pytest.fixture
def ram(monkeypatch):
    """Set the RAM psutil reports as available, in GiB."""

    def set_available(gib: float) -> None:
        vm = namedtuple("vm", "available")(available=int(gib * GiB))
        monkeypatch.setattr(psutil, "virtual_memory", lambda: vm)

    set_available(1 << 20)
    return set_available


# ------------------------------------------------------------ unit checks


def test_model_not_sparse_mla():
    """6.3 #3: a model without index_topk."""
    with raises(
        "HiSparse supports sparse-MLA models with an indexer (DeepSeek-V3.2, "
        "GLM-5.x); OPTForCausalLM is not supported (its config has no index_topk: "
        "not a sparse-MLA model). Remove attention_config.hisparse_config to serve "
        "this model."
    ):
        cc.check_model_supported("OPTForCausalLM", None, "opt")


def test_model_deepseek_v4():
    """6.3 #3: DeepSeek-V4 compressed caches are a non-goal."""
    with pytest.raises(
        HiSparseConfigError,
        match="DeepseekV4ForCausalLM is not "
        "supported \\(DeepSeek-V4 compressed caches are a non-goal\\)",
    ):
        cc.check_model_supported("DeepseekV4ForCausalLM", 512, "deepseek_v4")
    cc.check_model_supported("GlmMoeDsaForCausalLM", 2048, "glm_moe_dsa")


@pytest.mark.parametrize(
    "sizes, name",
    [
        ((2, 1, 1), "pipeline_parallel_size"),
        ((1, 4, 1), "decode_context_parallel_size"),
        ((1, 1, 2), "prefill_context_parallel_size"),
    ],
)
def test_parallelism(sizes, name):
    """6.3 #5: PP = DCP = PCP = 1."""
    value = max(sizes)
    with raises(
        f"HiSparse does not support {name}={value} (the limit is 1); set "
        f"{name}=1 or remove attention_config.hisparse_config."
    ):
        cc.check_parallelism(*sizes)
    cc.check_parallelism(1, 1, 1)


def test_cudagraph_full_refused():
    """6.3 #6, the spec's wording."""
    with raises(
        "HiSparse needs per-batch routing; use FULL_AND_PIECEWISE, "
        "FULL_DECODE_ONLY or PIECEWISE instead of FULL "
        "(compilation_config.cudagraph_mode=FULL)."
    ):
        cc.check_cudagraph_mode("FULL")
    for mode in ("NONE", "PIECEWISE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
        cc.check_cudagraph_mode(mode)


def test_hybrid_kv_cache_manager_required():
    """6.3 #7."""
    with pytest.raises(
        HiSparseConfigError, match="disable_hybrid_kv_cache_manager=True"
    ):
        cc.check_hybrid_kv_cache_manager(True)
    cc.check_hybrid_kv_cache_manager(False)


def test_speculation_mtp_only(monkeypatch):
    """6.3 #15: proposers other than MTP are refused; MTP is served (its
    e2e gate passed: results/e2e runs 37-38) with the padded drafter batch
    and without parallel drafting (docs/mtp.md 3.1), with no opt-in."""
    with raises(
        "HiSparse supports speculative decoding with MTP only; "
        "speculative_config.method=eagle3. Use method 'mtp' (or no speculation), "
        "or remove attention_config.hisparse_config."
    ):
        cc.check_speculative_method("eagle3")
    cc.check_speculative_method(None)
    monkeypatch.delenv("VLLM_HISPARSE_EXPERIMENTAL_MTP", raising=False)
    cc.check_speculative_method("mtp")
    assert not hasattr(cc, "MTP_ENV")
    with pytest.raises(HiSparseConfigError, match="disable_padded_drafter_batch=True"):
        cc.check_speculative_method("mtp", disable_padded_drafter_batch=True)
    with pytest.raises(HiSparseConfigError, match="parallel_drafting=True"):
        cc.check_speculative_method("mtp", parallel_drafting=True)
    with pytest.raises(HiSparseConfigError, match="MTP only"):
        cc.check_speculative_method("eagle3")


def test_f15_full_input_reservation_is_required():
    """F15: scheduler_reserve_full_isl=False is refused before the model
    loads (admission must reserve the full input in the host pool)."""
    with pytest.raises(HiSparseConfigError, match="scheduler_reserve_full_isl=True"):
        cc.check_full_isl_reservation(False)
    cc.check_full_isl_reservation(True)


def test_prefix_caching_is_required_at_config_time():
    with pytest.raises(HiSparseConfigError, match="--no-enable-prefix-caching"):
        cc.check_prefix_caching(False)
    cc.check_prefix_caching(True)
    cc.check_prefix_caching(None)


@pytest.mark.parametrize("dtype,heads,message", [
    ("auto", 64, "fp8_ds_mla KV cache only"),
    ("bfloat16", 64, "fp8_ds_mla KV cache only"),
    ("fp8", 24, "can pad to"),
    ("fp8", 96, "can pad to"),
    ("fp8", 256, "can pad to"),
])
def test_attention_path_refusals(dtype, heads, message):
    """K8 (docs/worker.md): the bf16 cache, and head counts FlashMLA
    sparse's FP8 kernels cannot pad, are refused before the model loads."""
    with pytest.raises(HiSparseConfigError, match=message):
        cc.check_attention_path(dtype, heads)


@pytest.mark.parametrize("heads", [8, 16, 32, 64, 128])
def test_every_heads_per_rank_shape_of_glm5_and_dsv32_is_served(heads):
    """Issue 17 item 2: GLM-5's 64 heads at TP 1-8 (64, 32, 16, 8) and
    DeepSeek-V3.2's 128 at TP 1-16 pass, on Hopper (padding 64) and
    Blackwell (128)."""
    cc.check_attention_path("fp8", heads)
    cc.check_attention_path("fp8_ds_mla", heads, prefill_padding=128)


def test_the_separate_fp8_path_with_hisparse_or_when_asked(monkeypatch):
    """K31: FlashMLA sparse keeps its separate FP8 prefill/decode path
    below 32 heads per rank whenever HiSparse is on, and in a HiSparse-off
    engine only when the comparison asks for it at startup."""
    on = VllmConfig(attention_config=AttentionConfig(
        hisparse_config=HiSparseConfig(host_pool_gib=1)))
    off = VllmConfig()
    monkeypatch.delenv(cc.FP8_SEPARATE_PREFILL_ENV, raising=False)
    assert cc.fp8_separate_prefill(on) is True
    assert cc.fp8_separate_prefill(off) is False
    monkeypatch.setenv(cc.FP8_SEPARATE_PREFILL_ENV, "1")
    assert cc.fp8_separate_prefill(off) is True
    monkeypatch.setenv(cc.FP8_SEPARATE_PREFILL_ENV, "0")
    assert cc.fp8_separate_prefill(off) is False


def test_micro_batching_is_refused():
    with pytest.raises(HiSparseConfigError, match="micro-batching"):
        cc.check_micro_batching(True)
    cc.check_micro_batching(False)


def test_defaults_force_mqa_prefill_only_when_on():
    """K9: HiSparse implies sparse-MLA prefill through MQA; off: unchanged."""
    on = VllmConfig(attention_config=AttentionConfig(
        hisparse_config=HiSparseConfig(host_pool_gib=1)))
    off = VllmConfig()
    on.attention_config.sparse_mla_force_mqa = False
    cc.apply_hisparse_defaults(on)
    cc.apply_hisparse_defaults(off)
    assert on.attention_config.sparse_mla_force_mqa is True
    assert off.attention_config.sparse_mla_force_mqa is False


def test_device_buffer_below_q_times_k():
    """5.7 / 6.3 #10 / U-5: H >= q * K (MTP3: q = 4)."""
    with raises(
        "hisparse_config.device_buffer_size=6144 must be >= max_decode_query_len "
        "x index_topk = 4 x 2048 = 8192; raise it to at least that (every decode "
        "row of a step may select index_topk distinct rows)."
    ):
        cc.check_device_buffer_size(6144, 4, 2048, 64, configured=True)
    cc.check_device_buffer_size(8192, 4, 2048, 64, configured=True)


def test_device_buffer_default_above_int16():
    """5.7 / 6.3 #10 / U-5: the default (q + 1) * K can exceed 32768."""
    with raises(
        "hisparse_config.device_buffer_size=33000 (the default "
        "(max_decode_query_len + 1) x index_topk) exceeds the int16 slot limit "
        "32768; set device_buffer_size between 30000 and 32768, or lower "
        "num_speculative_tokens."
    ):
        cc.check_device_buffer_size(11 * 3000, 10, 3000, 64, configured=False)
    cc.check_device_buffer_size(32768, 10, 3000, 64, configured=True)


def test_q_times_k_above_int16():
    """5.7 / U-5: no H can satisfy q * K <= H <= 32768 (MTP with 16 tokens)."""
    with raises(
        "HiSparse needs device_buffer_size >= max_decode_query_len x index_topk "
        "= 17 x 2048 = 34816, beyond the int16 slot limit 32768; lower "
        "num_speculative_tokens to at most 15."
    ):
        cc.check_device_buffer_size(32768, 17, 2048, 64, configured=True)
    cc.check_device_buffer_size(32768, 16, 2048, 64, configured=True)


def test_device_buffer_alignment_warns():
    """5.7 / U-5: H % B != 0 is a warning (wasted padding rows), not an error."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("vllm.v1.hisparse.config_checks")
    logger.addHandler(handler)
    try:
        cc.check_device_buffer_size(4100, 1, 2048, 64, configured=True)
    finally:
        logger.removeHandler(handler)
    assert records == [
        (
            "HiSparse: device_buffer_size=4100 is not a multiple of the block "
            "size 64; the last hot block of every region wastes 60 rows."
        )
    ]


def test_one_block_size():
    """6.3 #8."""
    with raises(
        "HiSparse needs one block size across the sparse-MLA, indexer and other "
        "KV-cache layers (the limit is 1 distinct value); found [64, 128] (e.g. "
        "a.attn=64, b.indexer.k_cache=128). Set one --block-size (64, the "
        "FlashMLA sparse block size)."
    ):
        cc.check_block_sizes({"a.attn": 64, "b.indexer.k_cache": 128, "c.attn": 64})
    assert cc.check_block_sizes({"a": 64, "b": 64}) == 64


@pytest.mark.parametrize(
    "cache_dtype, dtype, row",
    [("auto", "float16", 1152), ("fp8_e4m3", "float8_e4m3fn", 576)],
)
def test_row_format(cache_dtype, dtype, row):
    """6.3 #4: fp8_ds_mla (656 B) or bf16 (1152 B) rows only."""
    with raises(
        "HiSparse supports the sparse-MLA KV formats fp8_ds_mla (656-B rows) and "
        f"bf16 (1152-B rows); layer l.attn has kv_cache_dtype={cache_dtype} (dtype "
        f"{dtype}, {row}-B rows). Use --kv-cache-dtype fp8 (stored as fp8_ds_mla "
        "by FlashMLA sparse) or auto with a bf16 model."
    ):
        cc.check_row_format("l.attn", cache_dtype, dtype, row)
    cc.check_row_format("l.attn", "fp8_ds_mla", "uint8", 656)
    cc.check_row_format("l.attn", "auto", "bfloat16", 1152)


def test_host_pool_one_request():
    """6.3 #12 / U-3: N_host >= cdiv(max_model_len, B) + 2; the advice is
    rounded up: (1563 + 2) * 2,519,040 B = 3.67 GiB -> 3.7."""
    with raises(
        "HiSparse host pool holds 1000 blocks but one max_model_len=100000 request "
        "needs 1565; raise host_pool_gib to at least 3.7 "
        "(hisparse_config.host_pool_gib=2.35, 2519040 B per host block) or lower "
        "max_model_len."
    ):
        cc.check_host_pool_holds_one_request(1000, 100_000, 64, 2_519_040, 2.35)
    cc.check_host_pool_holds_one_request(1565, 100_000, 64, 2_519_040, 3.7)


def test_host_ram_private_pools(ram):
    """6.3 #13 / U-3: private TP pools multiply; the limit is 95%."""
    ram(100)
    with raises(
        "HiSparse pinned host pool needs 96.0 GiB but only 100.0 GiB of RAM is "
        "available (limit 95%: 95.0 GiB); lower host_pool_gib or leave headroom "
        "for co-tenants (hisparse_config.host_pool_gib=48.0, 2 private pools, one "
        "per TP rank)."
    ):
        cc.check_host_ram(48 * GiB, 48.0, 2, shared=False)
    cc.check_host_ram(48 * GiB, 48.0, 2, shared=True)  # one shared pool: fits
    cc.check_host_ram(95 * GiB, 95.0, 1, shared=False)  # exactly 95%: fits
    with pytest.raises(HiSparseConfigError, match="one pool shared by the TP ranks"):
        cc.check_host_ram(95 * GiB + 1, 95.0, 1, shared=False)


def test_host_pool_gib_resolution():
    """6.1/6.2: hisparse_config.host_pool_gib, else an explicitly named
    HiSparseConnector's kv_connector_extra_config, else an error."""

    def config(hisparse: dict, kv_transfer: KVTransferConfig | None = None):
        vllm_config = VllmConfig(
            attention_config=AttentionConfig(
                hisparse_config=HiSparseConfig(**hisparse)
            ),
        )
        vllm_config.kv_transfer_config = kv_transfer
        return vllm_config

    assert cc.resolve_host_pool_gib(config({"host_pool_gib": 8})) == 8
    with raises(
        "hisparse_config.host_pool_gib is not set; HiSparse keeps all sparse-MLA "
        "KV history in a pinned host pool and needs its size (GiB per DP "
        "replica). Set it, e.g. --attention-config "
        '\'{"hisparse_config": {"host_pool_gib": 64}}\'.'
    ):
        cc.resolve_host_pool_gib(config({}))
    connector = KVTransferConfig(
        kv_connector="HiSparseConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"host_pool_gib": "12"},
    )
    assert cc.resolve_host_pool_gib(config({}, connector)) == 12.0


# ------------------------------------------------- verify_hisparse_config


@pytest.fixture(scope="module")
def sparse_model_dir(tmp_path_factory):
    return write_sparse_mla_config(tmp_path_factory.mktemp("dsv32"), num_layers=2)


def vllm_config_for(model: str, hisparse: dict | None) -> VllmConfig:
    attention = AttentionConfig(
        hisparse_config=HiSparseConfig(**hisparse) if hisparse is not None else None
    )
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=model, max_model_len=2048, skip_tokenizer_init=True
        ),
        attention_config=attention,
        cache_config=CacheConfig(cache_dtype="fp8"),
    )
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return vllm_config


def test_verify_off_is_a_noop(ram):
    """HiSparse off: nothing is checked (a non-sparse model is fine)."""
    ram(0.001)
    cc.verify_hisparse_config(vllm_config_for("facebook/opt-125m", None))


def test_verify_refuses_non_sparse_model(ram):
    """R1: HiSparse on a dense model fails with the model check's message,
    already while VllmConfig is built (the config-post-init hook)."""
    with pytest.raises(
        ValueError,
        match="HiSparse supports sparse-MLA "
        "models with an indexer .*; OPTForCausalLM is not supported",
    ):
        vllm_config_for("facebook/opt-125m", {"host_pool_gib": 1})


def test_verify_sparse_model(sparse_model_dir, ram):
    """R1: a sparse-MLA model passes; each config-level violation then fails
    with its own check's message, in spec 6.3 order."""
    vllm_config = vllm_config_for(sparse_model_dir, {"host_pool_gib": 4})
    cc.verify_hisparse_config(vllm_config)

    vllm_config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(HiSparseConfigError, match="pipeline_parallel_size=2"):
        cc.verify_hisparse_config(vllm_config)
    vllm_config.parallel_config.pipeline_parallel_size = 1

    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = True
    with pytest.raises(HiSparseConfigError, match="hybrid KV-cache manager"):
        cc.verify_hisparse_config(vllm_config)
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False

    # index_topk 256, q 1: H = 200 < 256.
    vllm_config.attention_config.hisparse_config.device_buffer_size = 200
    with pytest.raises(
        HiSparseConfigError,
        match="device_buffer_size=200 must be >= "
        "max_decode_query_len x index_topk = 1 x 256 = 256",
    ):
        cc.verify_hisparse_config(vllm_config)
    vllm_config.attention_config.hisparse_config.device_buffer_size = None

    ram(4)  # 4 GiB pool > 95% of 4 GiB
    with pytest.raises(HiSparseConfigError, match="needs 4.0 GiB but only 4.0 GiB"):
        cc.verify_hisparse_config(vllm_config)


def test_verify_refuses_routed_experts(sparse_model_dir, ram):
    """R1: vLLM's own refusal of routed experts with a KV connector runs
    before HiSparse installs its connector, so HiSparse refuses it."""
    vllm_config = vllm_config_for(sparse_model_dir, {"host_pool_gib": 4})
    vllm_config.model_config.enable_return_routed_experts = True
    with pytest.raises(HiSparseConfigError, match="--enable-return-routed-experts"):
        cc.verify_hisparse_config(vllm_config)


# ------------------------------------------------------ shared host pool

ELIGIBLE = dict(
    tensor_parallel_size=2, pipeline_parallel_size=1,
    prefill_context_parallel_size=1, decode_context_parallel_size=1,
    world_size=2, executor_backend="mp", nodes_per_replica=1, is_cuda=True,
)


@pytest.mark.parametrize("change, reason", [
    ({}, None),
    ({"is_cuda": False}, "the platform is not CUDA"),
    ({"tensor_parallel_size": 1, "world_size": 1}, "tensor_parallel_size=1"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
    ({"decode_context_parallel_size": 2}, "decode_context_parallel_size=2"),
    ({"world_size": 4}, "the world size 4 differs from tensor_parallel_size=2"),
    ({"executor_backend": "ray"}, "distributed_executor_backend='ray' is not 'mp'"),
    ({"nodes_per_replica": 2}, "a DP replica spans 2 nodes"),
])
def test_shared_host_pool_eligibility(change, reason):
    """Spec 4.12 eligibility: CUDA, TP > 1, PP = PCP = DCP = 1, world size =
    TP, the multiprocess executor, one node per DP replica."""
    got = cc.shared_host_pool_ineligibility(**{**ELIGIBLE, **change})
    assert got == reason if reason is None else got.startswith(reason)


def test_shared_mode_decides_the_ram_check(tmp_path, ram, monkeypatch):
    """4.12 + 6.3 #13: on an eligible TP=2 setup the pool is shared by
    default and its pinned bytes count once per replica (a pool that fits
    once starts); forced private, the two copies do not fit; forced shared
    on an ineligible setup is refused, automatic falls back to private."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    model = write_sparse_mla_config(tmp_path, num_layers=2, num_attention_heads=64,
                                    num_key_value_heads=64)  # 32 per rank at TP=2
    vllm_config = vllm_config_for(model, {"host_pool_gib": 4})
    pc = vllm_config.parallel_config
    pc.tensor_parallel_size = pc.world_size = 2
    pc.distributed_executor_backend = "mp"
    ram(6)  # one 4 GiB pool fits in 95% of 6 GiB, two do not
    assert cc.shared_host_pool(vllm_config)
    cc.verify_hisparse_config(vllm_config)

    vllm_config.attention_config.hisparse_config.shared_host_pool = False
    assert not cc.shared_host_pool(vllm_config)
    with pytest.raises(HiSparseConfigError, match="2 private pools, one per TP rank"):
        cc.verify_hisparse_config(vllm_config)

    pc.distributed_executor_backend = "ray"
    vllm_config.attention_config.hisparse_config.shared_host_pool = None
    assert not cc.shared_host_pool(vllm_config)
    vllm_config.attention_config.hisparse_config.shared_host_pool = True
    with pytest.raises(
        HiSparseConfigError,
        match=r"shared_host_pool=true needs CUDA, .* but "
        r"distributed_executor_backend='ray' is not 'mp'; set shared_host_pool=false",
    ):
        cc.shared_host_pool(vllm_config)


def test_order_misses_is_opt_in():
    """P9 (docs/kernels.md): left unset (or false), the ordered gather stays
    off at any pool size (K6 reached 0.74x, K7 is not yet measured on the
    GPU, neither's per-step launches are); true is K6's per-row order as
    before, "row"/"step" pick K6 or K7; a top-k wider than K6 sorts is
    refused for "row" with the reason, not for "step"."""
    assert cc.resolve_order_misses(None, 2048) is None
    assert cc.resolve_order_misses(False, 2048) is None
    assert cc.resolve_order_misses(True, 256) == "row"
    assert cc.resolve_order_misses(True, 2048) == "row"
    assert cc.resolve_order_misses("row", 2048) == "row"
    assert cc.resolve_order_misses("step", 2048) == "step"
    assert cc.resolve_order_misses("step", 4096) == "step"
    for value in (True, "row"):
        with pytest.raises(HiSparseConfigError, match='index_topk is 4096. Use "step"'):
            cc.resolve_order_misses(value, 4096)
    assert cc.resolve_order_misses(None, 4096) is None
    with pytest.raises(HiSparseConfigError, match='must be true, false, "row" or "step"'):
        cc.resolve_order_misses("rows", 2048)
    assert HiSparseConfig(host_pool_gib=1, order_misses=True).order_misses
    assert HiSparseConfig(host_pool_gib=1, order_misses="step").order_misses == "step"
