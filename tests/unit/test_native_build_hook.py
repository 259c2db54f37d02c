"""The native-build hook (patch build-hisparse-ext) stays in step with the
kernel sources: every .cu/.cpp in overlay/csrc/hisparse is compiled by the
CMake fragment, which the patched CMakeLists.txt includes, and setup.py
declares the extension. (The standalone build compiles the same sources in
CI, so a source that builds there builds here.)"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "overlay/csrc/hisparse"
PATCH = ROOT / "patches/build-hisparse-ext.patch"


def added_lines(path: str) -> list[str]:
    text = PATCH.read_text()
    section = text.split(f"diff --git a/{path} b/{path}")[1].split("diff --git")[0]
    return [ln[1:] for ln in section.splitlines() if ln.startswith("+") and not ln.startswith("+++")]


def test_fragment_compiles_every_kernel_source():
    fragment = (KERNELS / "hisparse.cmake").read_text()
    listed = set(re.findall(r'"csrc/hisparse/([^"]+)"', fragment))
    on_disk = {p.name for p in KERNELS.iterdir() if p.suffix in (".cu", ".cpp")}
    assert listed == on_disk


def test_cmakelists_includes_the_fragment():
    assert any("include(${CMAKE_CURRENT_LIST_DIR}/csrc/hisparse/hisparse.cmake)" in ln
               for ln in added_lines("CMakeLists.txt"))


def test_setup_declares_the_optional_extension():
    assert any('CMakeExtension(name="vllm._hisparse_C", optional=True)' in ln
               for ln in added_lines("setup.py"))


def test_loader_knows_the_native_extension_name():
    loader = (ROOT / "overlay/vllm/v1/hisparse/kernels.py").read_text()
    assert "_hisparse_C" in loader
