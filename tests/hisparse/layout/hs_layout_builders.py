# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Small builders for the layout tests: model configs, specs, parameters,
log capture and a host with plenty of RAM (tests/hisparse/memory uses them
too).

A uniquely named module (not conftest.py) so that test files can import it.
"""

import logging
from collections import namedtuple
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

from vllm.v1.hisparse.layout import HiSparseParams
from vllm.v1.hisparse.specs import kv_cache_specs_from_hf_config

GiB = 1 << 30
B = 64
W_FP8 = 656
P_FP8 = B * W_FP8  # 41,984
IDX_LAYER_PAGE = B * 132  # 8,448


def model_config(num_layers: int, **index_share) -> dict:
    """A DeepSeek-V3.2/GLM-5-shaped config (MLA 512 + 64, indexer 128)."""
    return {
        "num_hidden_layers": num_layers,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "index_topk": 2048,
        "index_head_dim": 128,
        **index_share,
    }


def specs(
    num_layers: int, kv_cache_dtype: str = "fp8_ds_mla", num_mtp: int = 0, **index_share
):
    return kv_cache_specs_from_hf_config(
        model_config(num_layers, **index_share),
        kv_cache_dtype=kv_cache_dtype,
        num_mtp_layers=num_mtp,
    )


def model_specs():
    """The specs of ``write_sparse_mla_config``'s default 4-layer model."""
    return specs(4)


def params(**overrides) -> HiSparseParams:
    values = dict(
        index_topk=2048,
        max_decode_query_len=1,
        device_buffer_size=4096,
        admission_max_tokens=8192,
        host_pool_bytes=384 * GiB,
        host_pool_gib=384.0,
    )
    values.update(overrides)
    return HiSparseParams(**values)


# DeepSeek-V3.2-like: 61 layers, every layer a leader.
DSV32 = {"num_layers": 61}
# GLM-like IndexShare: freq 4 with 0.26.0's GLM offset 3 (leaders 0,1,2,6,...).
GLM = {"num_layers": 60, "index_topk_freq": 4, "index_skip_topk_offset": 3}


def write_sparse_mla_config(directory, num_layers: int = 4, **extra) -> str:
    """A tiny DeepSeek-V3.2-architecture config.json (no weights needed to
    build a ModelConfig); returns the model directory."""
    import json
    import os

    config = {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "hidden_size": 1024,
        "num_hidden_layers": num_layers,
        # 32: the fewest heads per rank HiSparse's attention path serves.
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "kv_lora_rank": 512,
        "q_lora_rank": 256,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "index_topk": 256,
        "index_head_dim": 128,
        "index_n_heads": 8,
        "vocab_size": 8192,
        "max_position_embeddings": 16384,
        "intermediate_size": 2048,
        "moe_intermediate_size": 256,
        "n_routed_experts": 16,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "torch_dtype": "bfloat16",
        "rope_theta": 10000,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        **extra,
    }
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return str(directory)


def plenty_of_ram(monkeypatch) -> None:
    """The 95% RAM check reads psutil (R1); make it independent of the host."""
    vm = namedtuple("vm", "available")(available=1 << 50)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: vm)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def capture_logs(*names: str) -> Iterator[list[str]]:
    """The messages logged to the loggers ``names`` while inside."""
    handler = _Records()
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
