# SPDX-License-Identifier: Apache-2.0
"""The seeded context-sensitive init (tests/e2e/seeded_init.py) on CPU
modules named like vLLM's GlmMoeDsaForCausalLM, and the load-format plugin
that applies it at load time: both paths give identical weights."""

import sys
from pathlib import Path

import pytest
import seeded_init as si
import torch
from torch import nn

PLUGIN_DIR = str(Path(si.__file__).resolve().parent / "seeded_weights")

# (name, shape) of the tiny model's parameters, as vLLM names them
# (shapes shrunk; rank matters, not size).
L, N, P, V, H = 8, 2, 3, 4, 16
NAMES = {
    "model.embed_tokens.weight": (32, H),
    "model.layers.0.input_layernorm.weight": (H,),
    "model.layers.0.self_attn.fused_qkv_a_proj.weight": (12, H),
    "model.layers.0.self_attn.q_a_layernorm.weight": (L,),
    "model.layers.0.self_attn.q_b_proj.weight": (N * 5, L),
    "model.layers.0.self_attn.kv_a_layernorm.weight": (L,),
    "model.layers.0.self_attn.kv_b_proj.weight": (N * (P + V), L),
    "model.layers.0.self_attn.o_proj.weight": (H, N * V),
    "model.layers.0.self_attn.indexer.wq_b.weight": (8, L),
    "model.layers.0.self_attn.indexer.wk_weights_proj.weight": (6, H),
    "model.layers.0.self_attn.indexer.k_norm.weight": (4,),
    "model.layers.0.self_attn.indexer.k_norm.bias": (4,),
    "model.layers.1.mlp.gate.weight": (4, H),
    "model.layers.1.mlp.gate.e_score_correction_bias": (4,),
    "model.layers.1.mlp.experts.w13_weight": (4, 6, H),
    "model.layers.1.mlp.experts.w2_weight": (4, H, 3),
    "model.layers.1.mlp.shared_experts.down_proj.weight": (H, 3),
    "model.norm.weight": (H,),
    "lm_head.weight": (32, H),
}
EXPECTED = {
    "embed_tokens.weight": "normal", "input_layernorm.weight": "ones",
    "fused_qkv_a_proj.weight": "normal", "q_a_layernorm.weight": "ones",
    "k_norm.weight": "ones", "k_norm.bias": "zeros",
    "gate.e_score_correction_bias": "zeros", "w13_weight": "normal",
    "norm.weight": "ones", "lm_head.weight": "normal",
}


class Mla(nn.Module):
    """The attributes of vLLM's MLAAttention that the absorbed weights
    come from (it holds kv_b_proj too)."""

    def __init__(self, kv_b_proj: nn.Module) -> None:
        super().__init__()
        self.kv_b_proj = kv_b_proj
        self.kv_lora_rank, self.num_heads = L, N
        self.qk_nope_head_dim, self.v_head_dim = P, V
        self._k_scale = nn.Parameter(torch.tensor(1.0), requires_grad=False)

    def process_weights_after_loading(self) -> None:
        """vLLM 0.26 MLAAttention.process_weights_after_loading, unquantized
        branch (layers/attention/mla_attention.py): views of kv_b_proj."""
        from vllm.model_executor.utils import replace_parameter

        kv = self.kv_b_proj.weight.T.view(L, N, P + V)
        w_uk, w_uv = kv.split([P, V], dim=-1)
        replace_parameter(self, "W_UV", w_uv.transpose(0, 1), prefer_copy=True)
        replace_parameter(self, "W_UK_T", w_uk.permute(1, 2, 0), prefer_copy=True)


def tiny_model(order=None) -> nn.Module:
    root = nn.Module()
    for name in order or NAMES:
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(
            torch.zeros(NAMES[name], dtype=torch.bfloat16 if len(NAMES[name]) > 1
                        else torch.float32), requires_grad=False))
    attn = root.get_submodule("model.layers.0.self_attn")
    attn.add_module("mla_attn", Mla(attn.kv_b_proj))
    return root


def dummy(model) -> None:
    from vllm.model_executor.model_loader.weight_utils import initialize_dummy_weights

    initialize_dummy_weights(model, None)


def params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("suffix,action", sorted(EXPECTED.items()))
def test_actions_on_vllm_names(suffix, action):
    name = next(n for n in NAMES if n.endswith(suffix))
    assert si.action(name, len(NAMES[name]), True) == action
    assert si.action(name, 2, False) == "keep"


def test_derived_and_scalars_are_not_drawn():
    assert si.action("x.mla_attn.mla_attn.W_UV", 3, True) == "derived"
    assert si.action("x.mla_attn.mla_attn._k_scale", 0, True) == "keep"


def test_variants_scale_their_modules_only():
    v = si.variant("qk4_o4")
    assert v.std("q_b_proj") == pytest.approx(0.08) and v.std("w13_weight") == 0.02
    with pytest.raises(ValueError, match="n02"):
        si.variant("nope")
    assert si.DEFAULT_VARIANT == si.VARIANTS[0].name
    assert len({v.name for v in si.VARIANTS}) == len(si.VARIANTS)


def test_apply_fixes_norms_biases_and_draws_matrices():
    m = tiny_model()
    dummy(m)
    summary = si.apply(m, "n02")
    p = dict(m.named_parameters())
    assert torch.all(p["model.norm.weight"] == 1) and torch.all(
        p["model.layers.0.self_attn.indexer.k_norm.bias"] == 0)
    assert torch.all(p["model.layers.1.mlp.gate.e_score_correction_bias"] == 0)
    w = p["lm_head.weight"].float()
    assert 0.01 < w.std().item() < 0.03
    assert summary["counts"]["normal"] == 12 and summary["kept"] == [
        "model.layers.0.self_attn.mla_attn._k_scale"]


def test_values_depend_on_the_name_not_the_order():
    a, b = tiny_model(), tiny_model(order=list(reversed(NAMES)))
    si.apply(a, "qk2")
    si.apply(b, "qk2")
    pa, pb = params(a), params(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    w = pa["model.layers.0.self_attn.o_proj.weight"]
    assert not torch.equal(w, pa["model.layers.0.self_attn.q_b_proj.weight"][:H, :N * V])


def test_a_variant_rescales_the_same_draws():
    a, b = tiny_model(), tiny_model()
    si.apply(a, "n02")
    si.apply(b, "qk2")
    name = "model.layers.0.self_attn.q_b_proj.weight"
    ratio = params(b)[name].float() / params(a)[name].float()
    assert torch.allclose(ratio, torch.full_like(ratio, 2.0), rtol=1e-2)
    same = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(params(a)[same], params(b)[same])


@pytest.fixture
def plugin_loader():
    sys.path.insert(0, PLUGIN_DIR)
    try:
        import hisparse_e2e_weights
        from vllm.config.load import LoadConfig
        from vllm.model_executor.model_loader import get_model_loader

        hisparse_e2e_weights.register()
        yield get_model_loader(LoadConfig(load_format="hisparse_seeded"))
    finally:
        sys.path.remove(PLUGIN_DIR)


@pytest.mark.parametrize("variant", ["n02", "qk4_o4"])
def test_plugin_and_apply_model_paths_agree(plugin_loader, monkeypatch, variant):
    """Plugin: dummy + init before process_weights_after_loading derives
    W_UV / W_UK_T. apply_model: dummy, processing, then the init, which
    re-derives them in place (they alias kv_b_proj). Same bytes."""
    monkeypatch.setenv(si.VARIANT_ENV, variant)
    plugin = tiny_model()
    plugin_loader.load_weights(plugin, None)
    plugin.model.layers.get_submodule("0.self_attn.mla_attn").process_weights_after_loading()
    served = tiny_model()
    dummy(served)
    mla = served.model.layers.get_submodule("0.self_attn.mla_attn")
    mla.process_weights_after_loading()
    uv_ptr = mla.W_UV.data_ptr()
    summary = si.apply(served, variant)
    assert mla.W_UV.data_ptr() == uv_ptr and summary["counts"]["rederived_modules"] == 1
    a, b = params(plugin), params(served)
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a), [
        n for n in a if not torch.equal(a[n], b[n])]
    assert si.fingerprint(plugin) == si.fingerprint(served)


def test_rederive_copies_into_non_aliasing_absorbed_weights():
    m = tiny_model()
    si.apply(m, "n02")
    mla = m.model.layers.get_submodule("0.self_attn.mla_attn")
    mla.W_UV = nn.Parameter(torch.zeros(N, L, V, dtype=torch.bfloat16), requires_grad=False)
    mla.W_UK_T = nn.Parameter(torch.zeros(N, P, L, dtype=torch.bfloat16),
                              requires_grad=False)
    si.rederive_absorbed(m)
    kv = mla.kv_b_proj.weight.T.reshape(L, N, P + V)
    assert torch.equal(mla.W_UV, kv[..., P:].transpose(0, 1))
    assert torch.equal(mla.W_UK_T, kv[..., :P].permute(1, 2, 0))


def test_fingerprint_sees_one_flipped_bit():
    a = tiny_model()
    si.apply(a, "n02")
    before = si.fingerprint(a)
    name = "model.layers.1.mlp.experts.w2_weight"
    p = dict(a.named_parameters())[name]
    p.view(torch.int16).view(-1)[7] ^= 1
    after = si.fingerprint(a)
    assert before["digest"] != after["digest"]
    assert si.differing_params([before], [after]) == [name]
    assert si.differing_params([before], [before]) == []
