# SPDX-License-Identifier: Apache-2.0
"""A miniature of the upstream 0.30.0 peer's bundle (split site tar.xz +
dg026.tar.xz) for the tests of its staging."""

import io
import tarfile
from pathlib import Path


def tar_xz(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as t:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def make_bundle(d: Path, with_dg: bool = True) -> Path:
    d.mkdir(parents=True)
    blob = tar_xz({"site/vllm/__init__.py": "__version__ = '0.30.0'\n",
                   "site/vllm/third_party/deep_gemm/__init__.py": "# 0.30.0's\n"})
    half = len(blob) // 2
    (d / "site030.tar.xz.part0").write_bytes(blob[:half])
    (d / "site030.tar.xz.part1").write_bytes(blob[half:])
    if with_dg:
        (d / "dg026.tar.xz").write_bytes(tar_xz({"vllm/third_party/deep_gemm/__init__.py":
                                                 "# 0.26.0's\n"}))
    return d
