# SPDX-License-Identifier: Apache-2.0
"""The configuration surface: --attention-config '{"hisparse_config": ...}'.

Covers target R1 (bad configuration gets a clear error that names the field,
before anything is allocated) and the "every hook is a no-op when unset"
rule for the config hash. Runs on the installed patched vLLM.
"""

import json

import pytest

from vllm.config.attention import AttentionConfig
from vllm.config.hisparse import MAX_DEVICE_BUFFER_SIZE, HiSparseConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from tests.hisparse.scheduler.harness import glm_config

# AttentionConfig().compute_hash() of pristine vLLM 0.26.0 (measured on the
# unpatched sdist). HiSparse off must hash exactly like the pin, or every
# existing deployment would miss its compile cache after the upgrade.
PIN_DEFAULT_ATTENTION_HASH = (
    "139f6e00df9d193dd0083fb92d740a856e3084be2e1cf2c5faa0b95923e7f8bf"
)

BLOG_KV_TRANSFER = {
    "kv_connector": "OffloadingConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 137438953472,
    },
}


# A local model directory (config.json only) keeps EngineArgs offline.
OPT_CONFIG = {
    "architectures": ["OPTForCausalLM"], "model_type": "opt",
    "activation_function": "relu", "do_layer_norm_before": True,
    "ffn_dim": 3072, "hidden_size": 768, "num_attention_heads": 12,
    "num_hidden_layers": 12, "max_position_embeddings": 2048,
    "vocab_size": 50272, "word_embed_proj_dim": 768, "torch_dtype": "float16",
    "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("opt")
    (d / "config.json").write_text(json.dumps(OPT_CONFIG))
    return str(d)


@pytest.fixture
def parse(model_dir):
    def _parse(*argv: str) -> EngineArgs:
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        return EngineArgs.from_cli_args(parser.parse_args(
            ["--model", model_dir, "--skip-tokenizer-init", *argv]))
    return _parse


def rejected(parse, capsys, *argv: str) -> str:
    """Parse argv expecting the CLI to refuse it; return what it printed."""
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def hisparse_of(args: EngineArgs) -> HiSparseConfig | None:
    cfg = args.attention_config
    if isinstance(cfg, dict):  # EngineArgs may keep the raw dict
        cfg = AttentionConfig(**cfg)
    return cfg.hisparse_config


def test_json_form_parses(parse):
    """The blog's command line: the whole attention config as JSON."""
    args = parse(
        "--attention-config",
        json.dumps({"hisparse_config": {"host_pool_gib": 384,
                                        "device_buffer_size": 4096}}),
    )
    hs = hisparse_of(args)
    assert isinstance(hs, HiSparseConfig)
    assert hs.host_pool_gib == 384.0
    assert hs.device_buffer_size == 4096
    assert hs.eager_host_mirror is True


def test_dotted_form_parses(parse):
    args = parse("--attention-config.hisparse_config",
                 '{"host_pool_gib": 8, "eager_host_mirror": false}')
    hs = hisparse_of(args)
    assert hs.host_pool_gib == 8.0 and hs.eager_host_mirror is False


def test_blog_kv_transfer_config_parses_beside_hisparse(parse):
    """Spec 6.2: the OffloadingConnector config of the blog is accepted."""
    args = parse(
        "--attention-config", '{"hisparse_config": {"host_pool_gib": 384}}',
        "--kv-transfer-config", json.dumps(BLOG_KV_TRANSFER),
    )
    assert hisparse_of(args).host_pool_gib == 384.0
    assert args.kv_transfer_config.kv_connector == "OffloadingConnector"


def test_unset_is_none_and_hash_equals_the_pin(parse):
    """HiSparse off: the field is None and the hash is the pin's."""
    assert hisparse_of(parse()) is None
    assert AttentionConfig().compute_hash() == PIN_DEFAULT_ATTENTION_HASH


def test_enabled_changes_the_hash():
    on = AttentionConfig(hisparse_config={"host_pool_gib": 64})
    other = AttentionConfig(
        hisparse_config={"host_pool_gib": 64, "device_buffer_size": 8192})
    hashes = {on.compute_hash(), other.compute_hash(), PIN_DEFAULT_ATTENTION_HASH}
    assert len(hashes) == 3


def test_hash_covers_only_graph_shaping_fields():
    """issue 10 part 4: the compile-cache hash keeps only what shapes the
    attention path. Resizing the host pool, or the scheduler/runtime knobs
    (eager_host_mirror, admission_max_tokens, shared_host_pool,
    order_misses, prefetch_followers), must not
    invalidate the torch.compile cache; device_buffer_size (H, the width of
    the per-request hot-slot tensors) must."""
    base = {"host_pool_gib": 64}
    same = [
        {"host_pool_gib": 384},
        {"host_pool_gib": 64, "eager_host_mirror": False},
        {"host_pool_gib": 64, "admission_max_tokens": 4096},
        {"host_pool_gib": 64, "shared_host_pool": True},
        {"host_pool_gib": 64, "order_misses": True},
        {"host_pool_gib": 64, "order_misses": "row"},
        {"host_pool_gib": 64, "order_misses": "step"},
        {"host_pool_gib": 64, "prefetch_followers": True},
    ]
    for fields in same:
        assert HiSparseConfig(**fields).compute_hash() == HiSparseConfig(
            **base).compute_hash(), fields
        # ... and through the hash vLLM's compile cache actually uses.
        assert AttentionConfig(hisparse_config=fields).compute_hash() == (
            AttentionConfig(hisparse_config=base).compute_hash()), fields

    for shaped in ({"device_buffer_size": 8192}, {"device_buffer_size": 4096}):
        fields = {**base, **shaped}
        assert HiSparseConfig(**fields).compute_hash() != HiSparseConfig(
            **base).compute_hash(), fields
        assert AttentionConfig(hisparse_config=fields).compute_hash() != (
            AttentionConfig(hisparse_config=base).compute_hash()), fields


def test_default_device_buffer_size_is_q_plus_one_times_topk():
    """Spec 5.7: H = (q + 1) * K unless configured."""
    assert HiSparseConfig().default_device_buffer_size(2048, 1) == 4096
    assert HiSparseConfig().default_device_buffer_size(2048, 4) == 10240
    assert HiSparseConfig(device_buffer_size=6000).default_device_buffer_size(
        2048, 1) == 6000


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"host_pool_gib": 0}, "hisparse_config.host_pool_gib=0"),
        ({"host_pool_gib": -3.5}, "hisparse_config.host_pool_gib=-3.5"),
        ({"device_buffer_size": 0}, "hisparse_config.device_buffer_size=0"),
        ({"device_buffer_size": MAX_DEVICE_BUFFER_SIZE + 1},
         "exceeds the int16 slot limit 32768"),
        ({"admission_max_tokens": -1}, "hisparse_config.admission_max_tokens=-1"),
        ({"host_pool_gib": "lots"}, "host_pool_gib"),
        ({"eager_host_mirror": "sometimes"}, "eager_host_mirror"),
    ],
)
def test_out_of_range_values_name_the_field(parse, capsys, fields, needle):
    """R1: each bad value is rejected with a message naming the field."""
    err = rejected(parse, capsys, "--attention-config",
                   json.dumps({"hisparse_config": fields}))
    assert needle in err


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"host_pool_gib": 0}, "hisparse_config.host_pool_gib=0"),
        ({"device_buffer_size": 40000}, "exceeds the int16 slot limit 32768"),
    ],
)
def test_python_api_rejects_the_same_values(fields, needle):
    """The same validation guards LLM(attention_config=...) users."""
    with pytest.raises(ValueError, match=needle):
        AttentionConfig(hisparse_config=fields)


@pytest.mark.parametrize("value", [None, False, True, "row", "step"])
def test_order_misses_values_parse(parse, value):
    """P9: order_misses takes true/false (true = "row", K6), "row" or
    "step" (K7's whole-step order); left out it is None (off)."""
    fields = {"host_pool_gib": 8}
    if value is not None:
        fields["order_misses"] = value
    args = parse("--attention-config", json.dumps({"hisparse_config": fields}))
    assert hisparse_of(args).order_misses == value
    assert type(hisparse_of(args).order_misses) is type(value)


@pytest.mark.parametrize("value", ["Step", "sorted", 1, 0, "true", ["step"]])
def test_order_misses_other_values_are_one_line_errors(parse, capsys, value):
    """R1, P9: anything else is refused with one message naming the field
    and the accepted values (no coercion of 1 or "true" to a mode)."""
    err = rejected(parse, capsys, "--attention-config", json.dumps(
        {"hisparse_config": {"host_pool_gib": 8, "order_misses": value}}))
    needle = (f"hisparse_config.order_misses={value!r} must be true, false, "
              '"row" or "step" (or left out)')
    assert needle in err
    with pytest.raises(ValueError, match="must be true, false"):
        HiSparseConfig(host_pool_gib=8, order_misses=value)


def test_max_device_buffer_size_is_accepted():
    assert HiSparseConfig(device_buffer_size=MAX_DEVICE_BUFFER_SIZE)


def test_unknown_key_is_rejected_by_name(parse, capsys):
    err = rejected(parse, capsys, "--attention-config",
                   '{"hisparse_config": {"host_pool_gib": 1, "hot_rows": 4096}}')
    assert "hisparse_config.hot_rows" in err
    assert "Unexpected keyword argument" in err


def test_malformed_json_is_rejected(parse, capsys):
    """R1: malformed JSON fails at parse time, naming the option."""
    err = rejected(parse, capsys, "--attention-config",
                   '{"hisparse_config": {"host_pool_gib": ')
    assert "--attention-config" in err


@pytest.fixture(scope="module")
def glm_model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("glm")
    (d / "config.json").write_text(json.dumps(glm_config()))
    return str(d)


def test_engine_config_round_trip(glm_model_dir):
    """EngineArgs -> VllmConfig keeps the parsed HiSparse config intact on a
    sparse-MLA model, and installs HiSparseConnector (spec 6.2)."""
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args([
        "--model", glm_model_dir, "--skip-tokenizer-init", "--max-model-len", "4096",
        "--kv-cache-dtype", "fp8",
        "--attention-config.hisparse_config", '{"host_pool_gib": 1}']))
    vllm_config = args.create_engine_config()
    assert vllm_config.attention_config.hisparse_config == HiSparseConfig(
        host_pool_gib=1)
    assert vllm_config.kv_transfer_config.kv_connector == "HiSparseConnector"


def test_dense_model_is_refused_before_the_model_loads(parse):
    """R1: HiSparse on a model without a sparse-MLA indexer fails while the
    engine config is built (VllmConfig), with the model named."""
    args = parse("--attention-config.hisparse_config", '{"host_pool_gib": 16}')
    with pytest.raises(Exception, match="OPTForCausalLM is not supported"):
        args.create_engine_config()
