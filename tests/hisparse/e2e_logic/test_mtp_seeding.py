# SPDX-License-Identifier: Apache-2.0
"""Seeding and fingerprinting the MTP drafter (tests/e2e/seeded_init.py;
docs/mtp.md 4, E2E-5 under T1: both arms load identical bytes).

Small torch modules named like vLLM's GLM-5 target and its DeepSeekMTP
drafter; ``share`` makes the drafter use the target's modules as the pin's
proposer does after load_model (v1/spec_decode/llm_base_proposer.py
``_maybe_share_embeddings``: ``model.embed_tokens``; ``_maybe_share_lm_head``:
``lm_head`` and every MTP layer's ``shared_head.head``). ``Worker`` has the
two accessors of vLLM's gpu_worker that the functions use."""

import pytest
import seeded_init as si
import torch
from torch import nn

H, VOCAB = 16, 32


def tree(names: dict) -> nn.Module:
    """A module with parameters at dotted names (zeros; bf16 matrices)."""
    root = nn.Module()
    for name, shape in names.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        dtype = torch.bfloat16 if len(shape) > 1 else torch.float32
        mod.register_parameter(leaf, nn.Parameter(torch.zeros(shape, dtype=dtype),
                                                  requires_grad=False))
    return root


def target() -> nn.Module:
    names = {"model.embed_tokens.weight": (VOCAB, H), "model.norm.weight": (H,),
             "lm_head.weight": (VOCAB, H)}
    for i in range(3):
        names[f"model.layers.{i}.input_layernorm.weight"] = (H,)
        names[f"model.layers.{i}.self_attn.q_b_proj.weight"] = (H, H)
    return tree(names)


def drafter() -> nn.Module:
    """DeepSeekMTP with one layer (index 3 after 3 target layers), before
    sharing: its own embed_tokens and shared_head.head."""
    layer = "model.layers.3."
    return tree({"model.embed_tokens.weight": (VOCAB, H),
                 layer + "enorm.weight": (H,), layer + "hnorm.weight": (H,),
                 layer + "eh_proj.weight": (H, 2 * H),
                 layer + "shared_head.norm.weight": (H,),
                 layer + "shared_head.head.weight": (VOCAB, H),
                 layer + "mtp_block.self_attn.q_b_proj.weight": (H, H)})


def share(draft: nn.Module, tgt: nn.Module) -> nn.Module:
    """What the proposer's load_model does to an MTP drafter."""
    del draft.model.embed_tokens
    draft.model.embed_tokens = tgt.model.embed_tokens
    draft.lm_head = tgt.lm_head
    head = draft.model.layers.get_submodule("3.shared_head")
    del head.head
    head.head = tgt.lm_head
    return draft


class Worker:
    """vLLM's gpu_worker accessors: get_model() and get_draft_model()
    (model_runner.drafter.model, None without a drafter)."""

    def __init__(self, model: nn.Module, draft: nn.Module | None) -> None:
        self.model, self.draft = model, draft

    def get_model(self) -> nn.Module:
        return self.model

    def get_draft_model(self) -> nn.Module | None:
        return self.draft


def snapshot(model: nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def seeded_worker(variant: str = "n02") -> Worker:
    tgt = target()
    si.apply(tgt, variant)
    return Worker(tgt, share(drafter(), tgt))


ALIASED = ["model.embed_tokens.weight", "model.layers.3.shared_head.head.weight",
           "lm_head.weight"]


def test_drafter_seeding_leaves_the_targets_tensors_alone():
    """E2E-5 / T1 (docs/mtp.md 4): seeding the drafter skips the parameters
    that ARE the target's (embed_tokens, shared_head.head, lm_head); had it
    drawn shared_head.head under the drafter's name, the target's lm_head
    would change. Its own parameters are seeded."""
    w = seeded_worker()
    before = snapshot(w.model)
    summary = si.apply_drafter(w, "n02")
    after = snapshot(w.model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert sorted(summary["aliased"]) == sorted(ALIASED)
    p = dict(w.draft.named_parameters())
    assert torch.all(p["model.layers.3.enorm.weight"] == 1)
    assert torch.all(p["model.layers.3.shared_head.norm.weight"] == 1)
    assert 0.01 < p["model.layers.3.eh_proj.weight"].float().std().item() < 0.03
    assert summary["counts"] == {"ones": 3, "normal": 2, "rederived_modules": 0}


def test_aliases_are_found_by_identity_not_by_name():
    """An equal copy of a target tensor is the drafter's own (seeded); a
    target tensor under an unrelated drafter name is an alias (skipped)."""
    tgt = target()
    si.apply(tgt, "n02")
    draft = drafter()  # not shared: its embed_tokens is a copy, not the target's
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(tgt.model.embed_tokens.weight)
    draft.model.layers.get_submodule("3").extra = tgt.model.layers.get_submodule("0.self_attn")
    own, aliased = si.own_params(draft, tgt)
    assert aliased == ["model.layers.3.extra.q_b_proj.weight"]
    assert "model.embed_tokens.weight" in own
    assert "model.layers.3.shared_head.head.weight" in own


def test_no_drafter_nothing_to_seed():
    tgt = target()
    assert si.apply_drafter(Worker(tgt, None), "n02") is None
    assert si.worker_fingerprint(Worker(tgt, None)) == si.fingerprint(tgt)


@pytest.mark.parametrize("variant", ["n02", "qk4_o4", "mtp_e10"])
def test_plugin_and_rpc_paths_give_the_drafter_the_same_bytes(variant):
    """T1 across `vllm serve` (the hisparse_seeded plugin seeds the whole
    drafter at load, before sharing replaces its embed_tokens and heads) and
    the driver (seeds after sharing, through collective_rpc, skipping the
    aliases): the served bytes and the fingerprints are equal."""
    tgt_a = target()
    si.apply(tgt_a, variant)
    loaded = drafter()
    si.apply(loaded, variant)  # what the plugin's loader does to the drafter
    plugin = Worker(tgt_a, share(loaded, tgt_a))
    rpc = seeded_worker(variant)
    si.apply_drafter(rpc, variant)
    a, b = snapshot(plugin.draft), snapshot(rpc.draft)
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert si.worker_fingerprint(plugin) == si.worker_fingerprint(rpc)


def test_the_fingerprint_covers_the_drafters_own_bytes():
    """T1: a flipped bit in a drafter-only parameter changes the worker's
    fingerprint and is named under the drafter prefix; the aliases are
    fingerprinted once, as the target's."""
    w = seeded_worker()
    si.apply_drafter(w, "n02")
    before = si.worker_fingerprint(w)
    drafted = {n for n in before["params"] if n.startswith(si.DRAFTER_PREFIX)}
    assert drafted == {si.DRAFTER_PREFIX + n for n in (
        "model.layers.3.enorm.weight", "model.layers.3.hnorm.weight",
        "model.layers.3.eh_proj.weight", "model.layers.3.shared_head.norm.weight",
        "model.layers.3.mtp_block.self_attn.q_b_proj.weight")}
    name = "model.layers.3.eh_proj.weight"
    dict(w.draft.named_parameters())[name].view(torch.int16).view(-1)[5] ^= 1
    after = si.worker_fingerprint(w)
    assert before["digest"] != after["digest"]
    assert si.differing_params([before], [after]) == [si.DRAFTER_PREFIX + name]
    assert si.fingerprint(w.model) == si.fingerprint(seeded_worker().model)


def test_an_mtp_variant_passes_the_embedding_through_eh_proj():
    """E2E-5 G2 (runs 21, 24: the n02 drafter never agreed): an MTP variant
    draws eh_proj as every matrix, then makes its embedding half the
    identity and scales the embedding, so the drafter sees the next token
    the way the target's residual stream does; n02 keeps eh_proj drawn."""
    w = seeded_worker("mtp_e10")
    si.apply_drafter(w, "mtp_e10")
    e = dict(w.draft.named_parameters())["model.layers.3.eh_proj.weight"].float()
    assert torch.equal(e[:, :H], torch.eye(H))
    assert 0.001 < e[:, H:].std().item() < 0.003  # eh_proj x 0.1
    emb = dict(w.model.named_parameters())["model.embed_tokens.weight"].float()
    assert 0.1 < emb.std().item() < 0.3  # embed_tokens x 10
    n02 = seeded_worker("n02")
    si.apply_drafter(n02, "n02")
    e = dict(n02.draft.named_parameters())["model.layers.3.eh_proj.weight"].float()
    assert not torch.equal(e[:, :H], torch.eye(H))
    assert si.variant("mtp_e30").embed_pass and si.DEFAULT_VARIANT == "n02"
