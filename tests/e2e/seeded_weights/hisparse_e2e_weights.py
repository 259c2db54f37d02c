# SPDX-License-Identifier: Apache-2.0
"""Test-only vLLM plugin: the load format ``hisparse_seeded``.

vLLM's dummy weights, then the seeded context-sensitive init of
``tests/e2e/seeded_init.py`` (the one the e2e driver applies with
``LLM.apply_model``), at load time: two processes (a server and an
off-arm replay) serve identical weights without a checkpoint on disk (the
tiny model's state dict holds views that vLLM's sharded-state saver cannot
write). The variant comes from ``HISPARSE_E2E_VARIANT`` (default: the
module's first). Put this folder on PYTHONPATH; vLLM discovers it through
its ``vllm.general_plugins`` entry point.
"""

import sys
from pathlib import Path

_E2E = str(Path(__file__).resolve().parents[1])


def register() -> None:
    from vllm.logger import init_logger
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    if _E2E not in sys.path:
        sys.path.insert(0, _E2E)
    import seeded_init

    logger = init_logger(__name__)

    @register_model_loader("hisparse_seeded")
    class SeededDummyLoader(DummyModelLoader):
        def load_weights(self, model, model_config) -> None:
            super().load_weights(model, model_config)
            summary = seeded_init.apply(model, seeded_init.variant_from_env().name)
            logger.info("hisparse_seeded weights: %s", summary["variant"])
