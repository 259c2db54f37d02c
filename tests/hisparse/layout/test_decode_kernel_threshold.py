# SPDX-License-Identifier: Apache-2.0
"""R28 / spec 2.11: the scheduler's staging bound applies to the chunks
FlashMLA sparse runs on its decode kernel. HiSparse mirrors the backend's
reorder thresholds (the scheduler process builds no attention backend);
this checks the copy against the pinned source, so a rebase that changes
them fails here instead of letting the bound miss chunks."""

import ast
import inspect
import textwrap

from vllm.v1.attention.backends.mla import flashmla_sparse
from vllm.v1.hisparse import kv_cache_config as kcc


def _threshold_tables() -> list[dict]:
    source = inspect.getsource(flashmla_sparse.FlashMLASparseMetadataBuilder.__init__)
    tree = ast.parse(textwrap.dedent(source))
    tables = []
    for node in ast.walk(tree):
        # {heads: tokens}.get(num_q_heads, default)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get" and isinstance(node.func.value, ast.Dict)):
            table = ast.literal_eval(node.func.value)
            default = ast.literal_eval(node.args[1])
            tables.append((table, default))
    return tables


def test_the_thresholds_equal_the_pinned_backend():
    tables = _threshold_tables()
    assert (kcc._DECODE_KERNEL_TOKENS_SM100, kcc._DECODE_KERNEL_TOKENS_SM100_DEFAULT) in tables
    assert (kcc._DECODE_KERNEL_TOKENS, kcc._DECODE_KERNEL_TOKENS_DEFAULT) in tables
    assert len(tables) == 2


class _Spec:
    def __init__(self, n, parallel=False):
        self.num_speculative_tokens = n
        self.parallel_drafting = parallel


class _Model:
    def __init__(self, heads):
        self.heads = heads

    def get_num_attention_heads(self, parallel_config):
        return self.heads


class _Config:
    def __init__(self, heads, spec=None):
        self.model_config = _Model(heads)
        self.parallel_config = None
        self.speculative_config = spec


def test_decode_kernel_tokens_per_heads_and_speculation():
    # The CPU platform is not SM100: the Hopper table.
    assert kcc.decode_kernel_tokens(_Config(64)) == 256
    assert kcc.decode_kernel_tokens(_Config(128)) == 256
    assert kcc.decode_kernel_tokens(_Config(32)) == 128
    assert kcc.decode_kernel_tokens(_Config(48)) == 256  # the default
    # supports_spec_as_decode: max(threshold, 1 + k * tokens).
    assert kcc.decode_kernel_tokens(_Config(32, _Spec(3))) == 128
    assert kcc.decode_kernel_tokens(_Config(32, _Spec(200))) == 201
    assert kcc.decode_kernel_tokens(_Config(32, _Spec(100, parallel=True))) == 201
