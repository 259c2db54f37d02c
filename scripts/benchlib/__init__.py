# SPDX-License-Identifier: Apache-2.0
"""Library of the benchmark commands scripts/bench-tax and scripts/bench-agentic.

Why here (beside scriptlib.py) and not in tests/e2e: these are user-facing
commands; tests/e2e is the correctness gate. The benchmarks reuse two things
of tests/e2e by path (the tiny model generator make_tiny_glm5.py and the
seeded-weights plugin tests/e2e/seeded_weights), nothing else.

Every module here imports only the standard library at import time, so the
CPU tests (tests/hisparse/bench/) import all of them without torch, vLLM or
a GPU. What runs on the GPU host imports vLLM inside functions:

  stats          medians, percentiles, spreads, the fixed + per-layer fit,
                 the alternation order of arms, time-weighted means
  prom           Prometheus text exposition -> samples (with labels)
  targets        P2, P4, P5, P6, P8 (targets.md) evaluated on measured figures
  tax            bench-tax: arms, engine arguments, the plan, summaries, merge
  engine_worker  bench-tax's engine process (GPU host): one in-process vLLM
                 engine driven over JSON lines on stdin/stdout
  workerproc     the parent's handle on an engine process
  agentic        bench-agentic: the multi-turn workload, server and tool
                 command lines, per-level summaries
  serving        bench-agentic's I/O: servers, the /metrics poller, the tool
  upstream       the upstream vLLM 0.30.0 peer: its stage and environment
  plot           the PNGs of bench-agentic (matplotlib imported on use)
  common         paths, versions, JSON output, the tiny model directory
"""
