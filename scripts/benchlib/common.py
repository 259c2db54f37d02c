# SPDX-License-Identifier: Apache-2.0
"""Shared by the benchmark commands: paths, the tiny model directory, the
environment of the engines they start, JSON output, byte sizes."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
E2E = REPO / "tests" / "e2e"
PLUGIN = E2E / "seeded_weights"
MAKE_MODEL = E2E / "make_tiny_glm5.py"
DEFAULT_STAGE = os.environ.get("HISPARSE_STAGE", "/root/stage")
SEEDED_LOAD_FORMAT = "hisparse_seeded"
VARIANT_ENV = "HISPARSE_E2E_VARIANT"  # tests/e2e/seeded_init.py
CANONICAL_TOPK_ENV = "VLLM_HISPARSE_CANONICAL_TOPK"
# Never NVLink multicast on the lent hosts (KINDS.md); kept in every child.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
QUIET = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
         "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?[bB]?|[bB])?\s*$")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'128MiB', '128M', '2g', '1073741824' -> bytes (binary units)."""
    m = _SIZE.match(str(text))
    if m is None:
        raise ValueError(f"not a byte size: {text!r} (e.g. 128MiB, 2GiB, 1073741824)")
    unit = (m.group(2) or "").lower()[:1]
    value = float(m.group(1)) * _UNITS[unit]
    if value <= 0 or value != int(value):
        raise ValueError(f"not a positive whole number of bytes: {text!r}")
    return int(value)


def int_list(text: str, name: str = "list") -> list[int]:
    try:
        out = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, not {text!r}") from None
    if not out or any(x <= 0 for x in out):
        raise ValueError(f"{name} must be positive integers, not {text!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"{name} repeats a value: {text!r}")
    return out


def name_list(text: str, known, name: str) -> list[str]:
    out = [x.strip() for x in str(text).split(",") if x.strip()]
    unknown = [x for x in out if x not in known]
    if unknown:
        raise ValueError(f"unknown {name} {', '.join(unknown)} (known: {', '.join(known)})")
    if not out:
        raise ValueError(f"no {name} given")
    if len(set(out)) != len(out):
        raise ValueError(f"{name} repeated: {text!r}")
    return out


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def command_line(prog: str, argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in [prog, *argv])


def write_json(path: Path, data) -> None:
    """Atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False, default=str) + "\n")
    tmp.replace(path)


def host_info() -> dict:
    out = {"python": platform.python_version(), "machine": platform.machine(),
           "hostname": platform.node()}
    try:
        gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                              timeout=20).stdout.strip().splitlines()
        out["gpus"] = gpus
    except (OSError, subprocess.TimeoutExpired):
        out["gpus"] = []
    if out["gpus"]:
        try:  # the GPU's CPU and NUMA affinity, beside the engines' cores
            out["gpu_topology"] = subprocess.run(
                ["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                timeout=20).stdout.strip().splitlines()
        except (OSError, subprocess.TimeoutExpired):
            pass
    out["cpu_siblings"] = cpu_siblings()
    return out


def cpu_siblings() -> dict[str, str]:
    """{cpu: "siblings 0,8 package 0 node 0"} for the cores this process
    may use (Linux sysfs; {} elsewhere): two engines on sibling vCPUs share
    one physical core, and a core on the GPU's far socket launches slower;
    bench-tax's per-core-set medians then show either."""
    out = {}
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return out
    for c in cpus:
        base = Path(f"/sys/devices/system/cpu/cpu{c}")
        try:
            sib = (base / "topology/thread_siblings_list").read_text().strip()
            pkg = (base / "topology/physical_package_id").read_text().strip()
        except OSError:
            continue
        nodes = [p.name[4:] for p in base.glob("node[0-9]*")]
        out[str(c)] = f"siblings {sib} package {pkg} node {','.join(nodes) or '?'}"
    return out


def has_gpu() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                              timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def gpu_memory_gib() -> float | None:
    """The smallest GPU's total memory in GiB (nvidia-smi), None where it
    cannot be read."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20)
        mib = [float(v) for v in out.stdout.split()] if out.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    return min(mib) / 1024 if mib else None


def prepend_path(env: dict, var: str, *paths: str | Path) -> None:
    parts = [str(p) for p in paths] + [p for p in env.get(var, "").split(os.pathsep) if p]
    seen, out = set(), []
    for p in parts:
        if p not in seen:
            seen.add(p)
            out.append(p)
    env[var] = os.pathsep.join(out)


def child_env(base: dict | None = None, *, variant: str | None = None,
              in_process: bool) -> dict:
    """The environment of an engine (our bundle's vLLM, as the parent has
    it): the seeded-weights plugin and tests/e2e on PYTHONPATH, the weight
    variant, timing defaults. The canonical top-k order of the e2e gate is
    never set: production leaves it off, and it adds a sort per layer."""
    env = dict(os.environ if base is None else base)
    env.update(QUIET)
    env.update(NO_MULTICAST)
    env.pop(CANONICAL_TOPK_ENV, None)
    prepend_path(env, "PYTHONPATH", SCRIPTS, PLUGIN, E2E)
    if variant is not None:
        env[VARIANT_ENV] = variant
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # not in the test bundle
    return env


def default_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """vLLM 0.26.0's CUDA-graph capture sizes when none are given
    (``VllmConfig._set_cudagraph_sizes``, performance mode "balanced", no
    speculative tokens)."""
    top = min(max_num_seqs * 2, 512, max_num_batched_tokens)
    sizes = [i for i in (1, 2, 4) if i <= top]
    if top >= 8:
        sizes += range(8, min(top + 1, 256), 8)
    if top >= 256:
        sizes += range(256, top + 1, 16)
    if max_num_batched_tokens <= top:
        sizes.append(max_num_batched_tokens)
    return sorted(set(sizes))


def with_full_decode_graphs(cc: dict | None, max_num_seqs: int,
                            max_num_batched_tokens: int) -> dict | None:
    """``cc`` such that a decode batch of ``max_num_seqs`` requests replays
    a FULL CUDA graph. vLLM captures FULL decode graphs only at capture
    sizes <= max_num_seqs, so under the default sizes a max_num_seqs that
    is not one of them (6, 12) pads its fullest decode batches (5-6, 9-12)
    to a size with no FULL graph: PIECEWISE (FULL_AND_PIECEWISE) or eager
    (FULL_DECODE_ONLY). It joins the sizes; sizes given in ``cc`` are kept
    as given, and a config without CUDA graphs is returned as it is."""
    if cc is not None and ("cudagraph_capture_sizes" in cc or cc.get("cudagraph_mode") == "NONE"):
        return cc
    sizes = default_capture_sizes(max_num_seqs, max_num_batched_tokens)
    if max_num_seqs in sizes or max_num_seqs > max_num_batched_tokens:
        return cc
    return {**(cc or {}), "cudagraph_capture_sizes": sorted({*sizes, max_num_seqs})}


# Lines that say why something failed: vLLM's and the multi-turn tool's
# errors, a refused request (the tool's "Received HTTP status", "Request
# rejected", "Timeout during", "Exception during"; the server's access log
# with a 4xx/5xx status) and tracebacks.
FAILURE_LINE = re.compile(r"\bERROR\b|Traceback|Error:|Received HTTP status|Request rejected"
                          r"|Timeout during|Exception during|HTTP/1\.1\" [45]\d\d")


def log_digest(log_dir: Path, out_file: Path, lines: int = 150,
               failure_lines: int = 40) -> Path | None:
    """The last ``lines`` lines of every log in ``log_dir``, one file (a
    device call returns at most 8 files: the logs themselves stay behind),
    each after its first ``failure_lines`` lines before the tail that match
    FAILURE_LINE (run 24 lost the cause of the offloader's one failed
    request: it was logged before the tool's last 150 lines)."""
    logs = sorted(Path(log_dir).glob("*.log"))
    if not logs:
        return None
    parts = []
    for log in logs:
        text = log.read_text(errors="replace").splitlines()
        head = text[:-lines] if len(text) > lines else []
        failed = [f"{i + 1}: {t}" for i, t in enumerate(head) if FAILURE_LINE.search(t)]
        if failed:
            parts.append(f"===== {log.name} (failure lines before the tail: "
                         f"{min(failure_lines, len(failed))} of {len(failed)})")
            parts += failed[:failure_lines]
        parts.append(f"===== {log.name} (last {min(lines, len(text))} of {len(text)} lines)")
        parts += text[-lines:]
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text("\n".join(parts) + "\n")
    return out_file


# ------------------------------------------------------- the tiny model


def model_config_matches(cfg: dict, layers: int, max_pos: int,
                         index_topk_freq: int = 1) -> bool:
    return cfg.get("num_hidden_layers") == layers and \
        cfg.get("max_position_embeddings") == max_pos and \
        cfg.get("index_topk_freq", 1) == index_topk_freq


def ensure_model(path: Path, layers: int, max_pos: int, python: str = sys.executable,
                 index_topk_freq: int = 1) -> Path:
    """tests/e2e/make_tiny_glm5.py's model directory with ``layers`` layers
    (all sparse-MLA; each ``index_topk_freq`` share one top-k) and
    ``max_pos`` positions, written unless already there."""
    path = Path(path)
    cfg = path / "config.json"
    if cfg.exists() and model_config_matches(json.loads(cfg.read_text()), layers, max_pos,
                                             index_topk_freq):
        return path
    share = ["--index-topk-freq", str(index_topk_freq)] if index_topk_freq > 1 else []
    subprocess.run([python, str(MAKE_MODEL), str(path), "--layers", str(layers),
                    "--max-pos", str(max_pos), *share], check=True, stdout=subprocess.DEVNULL)
    return path
