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

With ``HISPARSE_E2E_SCHEDULE_TRACE=<path>`` it also records the schedule of
every scheduler the process builds (the server's engine core), one JSON
line per step (tests/e2e/schedule_replay.py): the soak's off arm follows
it (docs/worker.md K28).

With ``HISPARSE_ABLATE=<name>[,<name>]`` it turns a named HiSparse
behaviour off in this process, for a benchmark's ablation arm (the same
build beside its normal arm on one machine): ``admission_backoff``, R35
(docs/residency.md; bench-agentic's ``hisparse_nobackoff``).
"""

import json
import os
import sys
from pathlib import Path

_E2E = str(Path(__file__).resolve().parents[1])
TRACE_ENV = "HISPARSE_E2E_SCHEDULE_TRACE"
ABLATE_ENV = "HISPARSE_ABLATE"


def _no_admission_backoff() -> None:
    from vllm.v1.hisparse import kv_cache_coordinator

    kv_cache_coordinator.ADMISSION_RETRY_STEPS = 0  # every step retries


ABLATIONS = {"admission_backoff": _no_admission_backoff}


def apply_ablations(spec: str) -> list[str]:
    """Turn off the behaviours ``spec`` names (comma-separated); an
    unknown name is an error, not a silent no-op."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = sorted(set(names) - set(ABLATIONS))
    if unknown:
        raise ValueError(f"{ABLATE_ENV}: unknown ablation(s) {unknown} "
                         f"(known: {sorted(ABLATIONS)})")
    for name in names:
        ABLATIONS[name]()
    return names


def register() -> None:
    from vllm.logger import init_logger
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    if _E2E not in sys.path:
        sys.path.insert(0, _E2E)
    import seeded_init

    if os.environ.get(TRACE_ENV):
        trace_schedulers(os.environ[TRACE_ENV])

    logger = init_logger(__name__)
    if os.environ.get(ABLATE_ENV):
        logger.warning("HiSparse ablated in this process: %s",
                       apply_ablations(os.environ[ABLATE_ENV]))

    @register_model_loader("hisparse_seeded")
    class SeededDummyLoader(DummyModelLoader):
        def load_weights(self, model, model_config) -> None:
            super().load_weights(model, model_config)
            summary = seeded_init.apply(model, seeded_init.variant_from_env().name)
            logger.info("hisparse_seeded weights: %s", summary["variant"])


def trace_schedulers(path: str) -> None:
    """Every vLLM Scheduler built from now on records its steps to
    ``path`` (appended, a line per step, flushed: a replay tails it)."""
    import schedule_replay
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler, "_hs_traced", False):
        return
    init = Scheduler.__init__

    def traced_init(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        out = open(path, "a", buffering=1)  # noqa: SIM115 - lives with the scheduler
        self._hs_tap = schedule_replay.ScheduleTap(
            self, sink=lambda step: out.write(json.dumps(step) + "\n"))
        self._hs_tap.start()

    Scheduler.__init__ = traced_init
    Scheduler._hs_traced = True
