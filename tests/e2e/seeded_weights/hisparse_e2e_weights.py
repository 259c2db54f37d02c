# SPDX-License-Identifier: Apache-2.0
"""Test-only vLLM plugin: the load format ``hisparse_seeded``.

vLLM's dummy weights re-initialised N(0, 0.02) from one seeded generator, at
load time, so that two `vllm serve` processes (HiSparse off and on) serve
identical, non-degenerate weights without a checkpoint on disk (the tiny
model's state dict holds views that vLLM's sharded-state saver cannot write).
Put this folder on PYTHONPATH; vLLM discovers it through its
``vllm.general_plugins`` entry point (tests/e2e/serve_check.py does this).
"""

SEED = 1234


def register() -> None:
    import torch

    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    @register_model_loader("hisparse_seeded")
    class SeededDummyLoader(DummyModelLoader):
        def load_weights(self, model, model_config) -> None:
            super().load_weights(model, model_config)
            g = torch.Generator(device="cuda").manual_seed(SEED)
            with torch.no_grad():
                for _, p in model.named_parameters():
                    if p.dtype in (torch.bfloat16, torch.float16, torch.float32) \
                            and p.dim() >= 2:
                        p.copy_(torch.randn(p.shape, generator=g, device=p.device,
                                            dtype=torch.float32).mul_(0.02).to(p.dtype))
