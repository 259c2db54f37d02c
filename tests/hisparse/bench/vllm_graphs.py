"""vLLM 0.26.0's own CUDA-graph sizing and dispatcher, for the benchmarks'
engine arguments: the capture sizes vLLM picks and the mode each uniform
decode batch would run in. The config is a stand-in holding only the fields
``VllmConfig._set_cudagraph_sizes`` and ``CudagraphDispatcher`` read (the CPU
platform's real VllmConfig drops every capture size); a field they start to
read fails here with an AttributeError, not silently."""
from __future__ import annotations

from types import SimpleNamespace


def sized_config(max_num_seqs: int, max_num_batched_tokens: int,
                 compilation_config: dict | None):
    """The stand-in config after vLLM's own ``_set_cudagraph_sizes``, and
    its CUDA-graph mode (FULL_AND_PIECEWISE unless the config names one)."""
    from vllm.config import CompilationConfig, VllmConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

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
    return vc, mode


def decode_graph_modes(max_num_seqs: int, max_num_batched_tokens: int,
                       compilation_config: dict | None) -> list[str]:
    """The runtime mode (FULL, PIECEWISE or NONE) of a uniform decode batch
    of 1..max_num_seqs requests under ``compilation_config``."""
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    vc, mode = sized_config(max_num_seqs, max_num_batched_tokens, compilation_config)
    d = CudagraphDispatcher(vc)
    d.initialize_cudagraph_keys(mode, 1)
    return [d.dispatch(n, uniform_decode=True, has_lora=False)[0].name
            for n in range(1, max_num_seqs + 1)]
