"""vLLM 0.26.0's own CUDA-graph sizing and dispatcher, for the benchmarks'
engine arguments: the mode each uniform decode batch would run in."""
from __future__ import annotations

from types import SimpleNamespace


def decode_graph_modes(max_num_seqs: int, max_num_batched_tokens: int,
                       compilation_config: dict | None) -> list[str]:
    """The runtime mode (FULL, PIECEWISE or NONE) of a uniform decode batch
    of 1..max_num_seqs requests under ``compilation_config`` (its
    cudagraph_mode, FULL_AND_PIECEWISE by default, and its sizes)."""
    from vllm.config import CompilationConfig, VllmConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    given = dict(compilation_config or {})
    mode = CUDAGraphMode[given.pop("cudagraph_mode", "FULL_AND_PIECEWISE")]
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=mode,
                           splitting_ops=list(CompilationConfig._attention_ops), **given)
    vc = SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=False), compilation_config=cc,
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=max_num_batched_tokens),
        num_speculative_tokens=0, performance_mode="balanced",
        parallel_config=SimpleNamespace(tensor_parallel_size=1, enable_sp=False),
        lora_config=None)
    VllmConfig._set_cudagraph_sizes(vc)
    d = CudagraphDispatcher(vc)
    d.initialize_cudagraph_keys(mode, 1)
    return [d.dispatch(n, uniform_decode=True, has_lora=False)[0].name
            for n in range(1, max_num_seqs + 1)]
