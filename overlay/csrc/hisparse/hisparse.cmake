# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# HiSparse kernels (torch.ops.hisparse_ops.*) inside a full vLLM source build.
#
# The default way to get the kernels is the standalone build
# (scripts/build-kernels.sh), which keeps the vLLM patches Python-only. For a
# native build of the patched tree, one line in vLLM's CMakeLists.txt after
# the _C_stable_libtorch target:
#
#   include(${CMAKE_CURRENT_LIST_DIR}/csrc/hisparse/hisparse.cmake)
#
# plus `ext_modules.append(CMakeExtension(name="vllm._hisparse_C"))` in
# setup.py produce vllm/_hisparse_C.abi3.so, which
# vllm/v1/hisparse/kernels.py loads when no standalone build is found.
# Same flags as the standalone build: libtorch stable ABI pinned to torch
# 2.11, sm_90a machine code for Hopper plus sm_80 (+PTX) where requested.

if(VLLM_GPU_LANG STREQUAL "CUDA")
  set(HISPARSE_EXT_SRC
    "csrc/hisparse/bindings.cpp"
    "csrc/hisparse/gather.cu"
    "csrc/hisparse/invalidate.cu"
    "csrc/hisparse/mirror.cu"
    "csrc/hisparse/order_plan.cu"
    "csrc/hisparse/order_step.cu"
    "csrc/hisparse/resolve_residency.cu"
    "csrc/hisparse/torch_glue.cpp")

  cuda_archs_loose_intersection(HISPARSE_ARCHS "8.0;9.0a" "${CUDA_ARCHS}")
  if(HISPARSE_ARCHS)
    set_gencode_flags_for_srcs(
      SRCS "${HISPARSE_EXT_SRC}"
      CUDA_ARCHS "${HISPARSE_ARCHS}")
    message(STATUS "Building _hisparse_C for archs: ${HISPARSE_ARCHS}")
    define_extension_target(
      _hisparse_C
      DESTINATION vllm
      LANGUAGE ${VLLM_GPU_LANG}
      SOURCES ${HISPARSE_EXT_SRC}
      COMPILE_FLAGS ${VLLM_GPU_FLAGS}
      ARCHITECTURES ${VLLM_GPU_ARCHES}
      USE_SABI 3
      WITH_SOABI)
    target_include_directories(_hisparse_C PRIVATE csrc/hisparse)
    target_compile_definitions(_hisparse_C PRIVATE
      TORCH_TARGET_VERSION=0x020B000000000000ULL
      USE_CUDA)
  else()
    message(STATUS "Not building _hisparse_C: no CUDA arch in "
                   "${CUDA_ARCHS} matches 8.0 or 9.0a")
  endif()
endif()
