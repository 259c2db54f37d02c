# SPDX-License-Identifier: Apache-2.0
"""bench-tax's engine process (runs ON the GPU host): one in-process vLLM
engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), driven by the parent over JSON
lines: the first line on stdin is the spec ({"key", "vllm": "ours" |
"upstream", "kwargs": LLM keyword arguments}), then one command per line,
one reply per command on stdout. vLLM's own output goes to stderr (the
parent's log file).

Commands ({"op": ...}):
  prepare  {batch, prompt_len, seed, m}  build the batch's prompts (seeded,
           the same in every arm), generate M tokens once: compiles what the
           batch size needs and puts the prompts in the prefix cache
  sample   {batch, n, m}  wall time of generating M, then N + M new tokens,
           and the median step-to-step interval of the latter;
           with the engine's CPU time, its busiest threads and the time
           Python's garbage collector took in each
  pin      {cpus}  move every thread of the engine's processes onto these
           cores (bench-tax rotates the arms' core sets per repetition)
  profile  {batch, n, m}  torch.profiler over the same two generations:
           aggregated events of each, then cProfile over them, then the
           stage clock (STAGE_TARGETS timed without a profiler) over them
  counters               HiSparse's counters (ours; {} upstream)
  shutdown

Run as ``python -m benchlib.engine_worker`` with scripts/ on PYTHONPATH.
Everything GPU-bound is imported inside functions.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
import traceback

VOCAB = 8192  # tests/e2e/make_tiny_glm5.py
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
OPS = ("prepare", "sample", "pin", "profile", "counters", "shutdown")


def to_configs(kwargs: dict, flavor: str) -> dict:
    """Our vLLM gets config objects (as tests/e2e/run_e2e.py builds them);
    upstream 0.30.0 gets the dicts its LLM converts (as the peer's script)."""
    kw = dict(kwargs)
    if flavor != "ours":
        return kw
    from vllm.config import AttentionConfig, KVTransferConfig

    ac = dict(kw.get("attention_config") or {})
    if "hisparse_config" in ac:
        from vllm.config.hisparse import HiSparseConfig

        ac["hisparse_config"] = HiSparseConfig(**ac["hisparse_config"])
    if ac:
        kw["attention_config"] = AttentionConfig(**ac)
    if kw.get("kv_transfer_config"):
        kw["kv_transfer_config"] = KVTransferConfig(**kw["kv_transfer_config"])
    return kw


def register_seeded() -> str:
    """The hisparse_seeded load format (tests/e2e/seeded_weights); vLLM's
    plugin discovery finds it on PYTHONPATH too, this makes it certain."""
    try:
        import hisparse_e2e_weights

        hisparse_e2e_weights.register()
        return "registered"
    except Exception as err:  # noqa: BLE001 - reported, the engine may still find it
        return f"manual registration failed: {err!r}"


def apply_seeded(llm) -> str:
    """tests/e2e/seeded_init.py through LLM.apply_model (variant from the
    environment); what happened, for the report."""
    try:
        import functools

        import seeded_init

        name = seeded_init.variant_from_env().name
        llm.apply_model(functools.partial(seeded_init.apply, variant_name=name))
        llm.reset_prefix_cache()
        return f"applied {name} after a dummy load"
    except Exception as err:  # noqa: BLE001 - the run goes on with dummy weights
        return f"dummy weights (seeded init failed: {err!r})"


def prompts_for(batch: int, prompt_len: int, seed: int) -> list[dict]:
    rng = random.Random(f"bench-tax-{seed}-{batch}-{prompt_len}")
    return [{"prompt_token_ids": [rng.randrange(2, VOCAB) for _ in range(prompt_len)]}
            for _ in range(batch)]


class Engine:
    def __init__(self, spec: dict) -> None:
        import torch
        import vllm
        from vllm import LLM

        self.flavor = spec["vllm"]
        self.info: dict = {"key": spec.get("key"), "flavor": self.flavor}
        kwargs = dict(spec["kwargs"])
        after_load = False
        if kwargs.get("load_format") == "hisparse_seeded":
            self.info["seeded_weights"] = register_seeded()
            if self.info["seeded_weights"] != "registered":
                # the plugin's loader API is missing (another vLLM): the same
                # seeded init after a dummy load, as tests/e2e/run_e2e.py does
                kwargs["load_format"], after_load = "dummy", True
        t0 = time.time()
        self.llm = LLM(**to_configs(kwargs, self.flavor))
        self.info["init_s"] = round(time.time() - t0, 1)
        # off_pinned: the on arm's pool size pinned beside an off engine
        self._pinned, self.info["pinned_host"] = pin_host_region(spec.get("pin_host_gib"))
        if after_load:
            self.info["seeded_weights"] += "; " + apply_seeded(self.llm)
        self.info["cpus"] = sorted(os.sched_getaffinity(0))
        self.info["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__,
                                 "cuda": torch.version.cuda,
                                 "gpu": torch.cuda.get_device_name(0)}
        self.info["defaults"] = self.defaults()
        self.prompts: dict[int, list[dict]] = {}
        self.step_stamps: list[float] | None = self._clock_steps()
        self.info["step_clock"] = self.step_stamps is not None

    def _clock_steps(self) -> list[float] | None:
        """Stamp every engine-loop step that returns tokens (the in-process
        client's get_output, which LLMEngine.step calls once per step);
        None where the client has no such method (another vLLM)."""
        client = getattr(self.llm.llm_engine, "engine_core", None)
        get = getattr(client, "get_output", None)
        if get is None:
            return None
        stamps: list[float] = []

        def stamped():
            out = get()
            if getattr(out, "outputs", None):  # async scheduling: some calls return none
                stamps.append(time.perf_counter())
            return out

        client.get_output = stamped
        return stamps

    def defaults(self) -> dict:
        vc = self.llm.llm_engine.vllm_config
        kv = vc.kv_transfer_config
        return {
            "async_scheduling": bool(getattr(vc.scheduler_config, "async_scheduling", False)),
            "cudagraph_mode": str(vc.compilation_config.cudagraph_mode),
            "compilation_mode": str(vc.compilation_config.mode),
            "max_num_seqs": vc.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
            "num_gpu_blocks": vc.cache_config.num_gpu_blocks,
            "kv_connector": kv.kv_connector if kv else None,
            "sparse_mla_force_mqa": getattr(vc.attention_config, "sparse_mla_force_mqa", None),
            "hisparse_config": repr(getattr(vc.attention_config, "hisparse_config", None)),
            "use_v2_model_runner": getattr(vc, "use_v2_model_runner", None),
        }

    # ------------------------------------------------------------ timing

    def timed(self, batch: int, n: int) -> float:
        import torch
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = self.llm.generate(self.prompts[batch], params, use_tqdm=False)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        short = [len(o.outputs[0].token_ids) for o in outs if len(o.outputs[0].token_ids) != n]
        if short or len(outs) != batch:
            raise RuntimeError(f"expected {batch} outputs of {n} tokens, got {short or len(outs)}")
        return dt

    def prepare(self, batch: int, prompt_len: int, seed: int, m: int) -> dict:
        """Prefill the prompts (into the prefix cache), then generate from
        the cache once: run 5's first timed generation after a prefill
        took 0.5 s more than later ones in the off arms."""
        self.prompts[batch] = prompts_for(batch, prompt_len, seed)
        return {"warmup_s": self.timed(batch, m), "warmup_cached_s": self.timed(batch, m)}

    def step_median_ms(self) -> tuple[float, int] | tuple[None, None]:
        return median_interval_ms(self.step_stamps)

    def sample(self, batch: int, n: int, m: int) -> dict:
        """Wall times of M and N + M new tokens, and the CPU time the engine's
        processes spent in each: a decode step that costs more CPU than
        wall time has threads burning cores beside the one that steps.
        ``busy_threads`` names them (CPU seconds per thread over the long
        generation); ``gc_short_s``/``gc_long_s`` is the time Python's
        collector paused this process, which grows with the objects a
        process keeps alive outside vLLM's startup freeze."""
        with GcClock() as gc_clock:
            c0, g0 = process_tree_cpu_s(), gc_clock.total_s
            t_short = self.timed(batch, m)
            c1, g1, th1 = process_tree_cpu_s(), gc_clock.total_s, thread_cpu_s()
            if self.step_stamps is not None:
                self.step_stamps.clear()
            t_long = self.timed(batch, n + m)
            c2, g2, th2 = process_tree_cpu_s(), gc_clock.total_s, thread_cpu_s()
        step_ms, step_count = self.step_median_ms()
        probe = self.probe()
        return {"t_short_s": t_short, "t_long_s": t_long, "probe": probe,
                "step_ms": step_ms, "step_count": step_count,
                "steady": steady_intervals(self.step_stamps, skip=m + 1),
                "cpu_short_s": c1 - c0, "cpu_long_s": c2 - c1,
                "gc_short_s": g1 - g0, "gc_long_s": g2 - g1,
                "gc_collections": gc_clock.collections,
                "busy_threads": busiest(th1, th2),
                "threads": thread_counts()}

    def pin(self, cpus: list[int]) -> dict:
        return pin_tree(cpus)

    def probe(self, tries: int = 3) -> dict:
        """Fixed workloads outside vLLM, the same in every process: pure
        Python (dict and sort work, the kind the scheduler does) and 100
        launches of a tiny kernel, timed on the host before the device
        catches up (the CUDA runtime's per-call cost). The fastest of
        ``tries``. Where these read slower in one arm, that process runs
        slower, whatever HiSparse's code does."""
        import torch

        best_py = min(_timed_us(_python_work) for _ in range(tries))
        out = {"python_us": best_py}
        if torch.cuda.is_available():
            x = torch.zeros(16, device="cuda")
            torch.cuda.synchronize()
            launches = []
            for _ in range(tries):
                launches.append(_timed_us(lambda: [x.add_(1) for _ in range(100)]))
                torch.cuda.synchronize()  # deliberate: outside the timed region
            out["launch_us"] = min(launches)
        return out

    def profile(self, batch: int, n: int, m: int) -> dict:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        def run(k: int) -> list[dict]:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                self.timed(batch, k)
            out = []
            for e in prof.key_averages():
                dev = getattr(e, "self_device_time_total", None)
                if dev is None:
                    dev = getattr(e, "self_cuda_time_total", 0)
                out.append({"name": e.key, "count": int(e.count),
                            "device": "cuda" if e.device_type == DeviceType.CUDA else "cpu",
                            "self_device_us": float(dev),
                            "self_cpu_us": float(getattr(e, "self_cpu_time_total", 0.0))})
            return out

        return {"short": run(m), "long": run(n + m),
                "python": {"short": self.python_profile(batch, m),
                           "long": self.python_profile(batch, n + m)},
                "stages": self.stage_profile(batch, n, m)}

    def stage_profile(self, batch: int, n: int, m: int) -> dict:
        """The stage clock over M and N + M new tokens (no profiler running)."""
        clock = StageClock()
        try:
            out = {}
            for label, k in (("short", m), ("long", n + m)):
                clock.reset()
                self.timed(batch, k)
                out[label] = clock.snapshot()
            out["absent"] = clock.absent
            return out
        finally:
            clock.remove()

    def python_profile(self, batch: int, k: int) -> list[dict]:
        """cProfile over one generation: every function's calls, self and
        cumulative seconds (where the host time of a step goes; cProfile
        slows Python, so these are shares, not the step's wall time)."""
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        self.timed(batch, k)
        prof.disable()
        out = []
        for (path, line, fn), (_, calls, tottime, cumtime, _) in pstats.Stats(prof).stats.items():
            if cumtime >= 1e-4:
                out.append({"fn": python_key(path, line, fn), "calls": int(calls),
                            "tottime": tottime, "cumtime": cumtime})
        return out

    # ---------------------------------------------------------- counters

    def counters(self) -> dict:
        if self.flavor != "ours":
            return {}
        out: dict = {}
        client = self.llm.llm_engine.engine_core
        core = getattr(client, "engine_core", client)
        coordinator = core.scheduler.kv_cache_manager.coordinator
        stats = getattr(getattr(coordinator, "hisparse", None), "stats", None)
        if stats is not None:
            out.update({k: int(v) for k, v in vars(stats).items() if isinstance(v, int)})
        for part in self.llm.collective_rpc(_worker_counters):
            for k, v in part.items():
                out[k] = out.get(k, 0) + v
        return out

    def shutdown(self) -> dict:
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - the process exits next anyway
            pass
        return {}


def _tree():
    import psutil  # a vLLM dependency

    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def process_tree_cpu_s() -> float:
    """User + system CPU seconds of this process and its children (vLLM's
    EngineCore), every thread included."""
    import psutil

    total = 0.0
    for proc in _tree():
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def thread_counts() -> list[int]:
    """OS threads of this process and of each child, in that order."""
    import psutil

    out = []
    for proc in _tree():
        try:
            out.append(proc.num_threads())
        except psutil.Error:
            continue
    return out


def median_interval_ms(stamps: list[float] | None) -> tuple[float, int] | tuple[None, None]:
    """The median interval (ms) between consecutive ``stamps`` (seconds) and
    how many intervals; (None, None) below two intervals."""
    if not stamps or len(stamps) < 3:
        return None, None
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return statistics.median(gaps) * 1e3, len(gaps)


def _python_work() -> int:
    d = {i: (i * 7919) % 1009 for i in range(4000)}
    return sum(sorted(d.values(), reverse=True)[:100]) + len([k for k in d if k % 3])


def _timed_us(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def pin_host_region(gib: float | None):
    """(mapping, info): an anonymous host region of ``gib`` GiB registered
    with CUDA as HiSparse registers its pool (portable | mapped, one
    registration; vllm/v1/hisparse/host_pool.py), kept for the process's
    life. (None, None) for no size. Raises where CUDA refuses."""
    if not gib:
        return None, None
    import mmap

    import numpy as np
    import torch

    size = int(gib * (1 << 30))
    region = mmap.mmap(-1, size)
    ptr = np.frombuffer(region, dtype=np.uint8).ctypes.data
    t0 = time.time()
    code = torch.cuda.cudart().cudaHostRegister(ptr, size, 1 | 2)
    code = int(getattr(code, "value", code))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister of {gib} GiB failed with CUDA error {code}")
    return region, {"gib": gib, "register_s": round(time.time() - t0, 2)}


STALL_FACTOR = 5.0
"""An interval over this many times the median is a stall (the VM's host
paused the engine, or periodic work), kept out of ``mean_ms``, counted."""


def steady_intervals(stamps: list[float] | None, skip: int) -> dict | None:
    """The long generation's step intervals after its first ``skip`` stamps
    (the prefill and the steps the short generation also ran, whose
    admission work differs between arms: session 13 found the HiSparse
    arm's 16 prefix-hit admissions ~0.15 s slower, which the difference of
    two generations' totals does not cancel). ``mean_ms`` is the time per
    token step (stalls out); ``median_ms`` with ``short_share`` (intervals
    under half the median) shows bursts: under async scheduling outputs
    can come in pairs, and then the median overstates the step. None
    below three intervals."""
    if not stamps or len(stamps) - skip < 4:
        return None
    gaps = sorted(b - a for a, b in zip(stamps[skip:], stamps[skip + 1:]))
    med = statistics.median(gaps)
    kept = [g for g in gaps if g <= STALL_FACTOR * med]
    stalls = gaps[len(kept):]
    # below ten intervals the extremes stand in for the deciles
    p10, p90 = (statistics.quantiles(gaps, n=10)[::8] if len(gaps) >= 10
                else (gaps[0], gaps[-1]))
    return {"mean_ms": statistics.fmean(kept) * 1e3, "median_ms": med * 1e3,
            "p10_ms": p10 * 1e3, "p90_ms": p90 * 1e3, "count": len(gaps),
            "stalls": len(stalls), "stall_ms": sum(stalls) * 1e3,
            "short_share": sum(g < 0.5 * med for g in gaps) / len(gaps)}


def pin_tree(cpus) -> dict:
    """Every thread of this process and its children onto ``cpus``
    (sched_setaffinity per thread: a process-wide call moves only the
    calling thread)."""
    import psutil

    want = {int(c) for c in cpus}
    moved = 0
    for proc in _tree():
        try:
            tids = [t.id for t in proc.threads()]
        except psutil.Error:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, want)
                moved += 1
            except OSError:  # the thread ended meanwhile
                continue
    return {"cpus": sorted(want), "threads_moved": moved}


def thread_cpu_s() -> dict[str, tuple[str, float]]:
    """{"pid/tid": (thread name, user + system CPU seconds)} of every
    thread of this process and its children (Linux: /proc)."""
    out = {}
    for proc in _tree():
        pid = proc.pid
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
            except OSError:
                continue
            # fields after the ")" closing the name: utime is 14th, stime 15th
            fields = stat.rsplit(")", 1)[1].split()
            out[f"{pid}/{tid}"] = (name, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    return out


def busiest(before: dict, after: dict, top: int = 6) -> list[dict]:
    """The ``top`` threads by CPU seconds spent between two
    ``thread_cpu_s`` snapshots (threads that started meanwhile count from 0)."""
    spent = []
    for key, (name, cpu) in after.items():
        d = cpu - before.get(key, (name, 0.0))[1]
        if d > 0:
            spent.append({"thread": key, "name": name, "cpu_s": round(d, 3)})
    spent.sort(key=lambda t: -t["cpu_s"])
    return spent[:top]


class GcClock:
    """Time Python's cyclic collector pauses this process, by generation,
    while the ``with`` block runs (gc.callbacks)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self.collections = {0: 0, 1: 0, 2: 0}
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._t0
            gen = info.get("generation", 0)
            self.collections[gen] = self.collections.get(gen, 0) + 1

    def __enter__(self) -> "GcClock":
        import gc

        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        import gc

        gc.callbacks.remove(self._callback)


# The functions the stage clock times, inclusive wall time per call: the
# engine loop's stages and HiSparse's step hooks ("module:Class.method" or
# "module:function"). cProfile (python_profile) inflates small Python calls
# ~2x and cannot say which part of a CUDA-bound method costs; these wrappers
# add ~0.3 us per call. A target a build lacks (upstream 0.30.0's tree) is
# skipped and reported as absent; one a run never calls (HiSparse's hooks in
# the off arm) reads 0.
STAGE_TARGETS = (
    "vllm.v1.core.sched.scheduler:Scheduler.schedule",
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
    "vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector:"
    "HiSparseConnector.build_connector_meta",
    "vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector:"
    "HiSparseConnector.update_connector_output",
    "vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector:"
    "HiSparseConnector.start_load_kv",
    "vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector:"
    "HiSparseConnector.wait_for_save",
    "vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector:"
    "HiSparseConnector.get_kv_connector_stats",
    "vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector:"
    "HiSparseConnector.build_connector_worker_meta",
    "vllm.v1.hisparse.coordinator:HiSparseCoordinator.build_step_metadata",
    "vllm.v1.hisparse.binding:apply_residency_updates",
    "vllm.v1.hisparse.binding:retarget_slot_mappings",
    "vllm.v1.hisparse.worker:HiSparseWorker.start_step",
    "vllm.v1.hisparse.worker:HiSparseWorker.finish_forward",
    "vllm.v1.hisparse.worker:HiSparseWorker._submit_mirror_ranges",
    "vllm.v1.hisparse.worker:HiSparseWorker.take_acks",
    "vllm.v1.hisparse.worker:MirrorPlan.build",
    "vllm.v1.hisparse.worker:HostWriteEvents.rotate",
    "vllm.v1.hisparse.worker:HostWriteEvents.record",
    "vllm.v1.hisparse.runtime:HiSparseRuntime.apply_hot_regions",
    "vllm.v1.hisparse.runtime:HiSparseRuntime.prepare_forward",
    "vllm.v1.hisparse.runtime:HiSparseRuntime.invalidate_written",
    "vllm.v1.hisparse.runtime:HiSparseRuntime.end_forward",
    "vllm.v1.hisparse.runtime:StepInputs.host_views",
    "vllm.v1.hisparse.runtime:StepInputs.send",
    "vllm.v1.hisparse.metrics:DeviceCounterSampler.sample",
    "vllm.v1.hisparse.metrics:SchedulerMetrics.collect",
    # The OffloadingConnector composed beside HiSparse (issue 16's "adds
    # nothing"): its scheduler and worker halves, MultiConnector's fan-out
    # and the engine's stats, each per step (take_events is a generator:
    # a wrapper would time its creation only, so it is not listed).
    "vllm.v1.core.sched.scheduler:Scheduler.make_stats",
    "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector:"
    "MultiConnector.build_connector_meta",
    "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector:"
    "MultiConnector.update_connector_output",
    "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector:"
    "MultiConnector.get_kv_connector_stats",
    "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector:"
    "MultiConnector.start_load_kv",
    "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector:"
    "MultiConnector.wait_for_save",
    "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector:"
    "MultiConnector.get_finished",
    "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector:"
    "MultiConnector.build_connector_worker_meta",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:"
    "OffloadingConnectorScheduler.build_connector_meta",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:"
    "OffloadingConnectorScheduler.update_connector_output",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:"
    "OffloadingConnectorScheduler.get_stats",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker:"
    "OffloadingConnectorWorker.start_kv_transfers",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker:"
    "OffloadingConnectorWorker.prepare_store_kv",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker:"
    "OffloadingConnectorWorker.get_finished",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker:"
    "OffloadingConnectorWorker.build_connector_worker_meta",
    "vllm.distributed.kv_transfer.kv_connector.v1.hisparse.offloading:"
    "HiSparseOffloadingConnector.build_connector_meta",
    "vllm.distributed.kv_transfer.kv_connector.v1.hisparse.offloading:"
    "HiSparseOffloadingConnector.start_load_kv",
)


class StageClock:
    """Inclusive wall time and calls of ``targets`` while installed: each is
    replaced on its class (or module) by a wrapper that adds to its total,
    and restored on ``remove``. Recursion counts the outer call only."""

    def __init__(self, targets=STAGE_TARGETS) -> None:
        import importlib

        self.ns: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.absent: list[str] = []
        self._saved: list[tuple[object, str, object]] = []
        for target in targets:
            module_name, _, path = target.partition(":")
            try:
                owner = importlib.import_module(module_name)
                *outer, name = path.split(".")
                for part in outer:
                    owner = getattr(owner, part)
                original = owner.__dict__[name]
            except (ImportError, AttributeError, KeyError):
                self.absent.append(target)
                continue
            self._saved.append((owner, name, original))
            setattr(owner, name, self._wrap(path, original))

    def _wrap(self, key: str, fn):
        import functools

        ns, calls, active = self.ns, self.calls, set()
        ns[key], calls[key] = 0, 0
        clock = time.perf_counter_ns

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if key in active:
                return fn(*args, **kwargs)
            active.add(key)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[key] += clock() - t0
                calls[key] += 1
                active.discard(key)

        return timed

    def reset(self) -> None:
        for key in self.ns:
            self.ns[key], self.calls[key] = 0, 0

    def snapshot(self) -> dict:
        return {k: {"us": self.ns[k] / 1e3, "calls": self.calls[k]} for k in self.ns}

    def remove(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def python_key(path: str, line: int, fn: str) -> str:
    """'vllm/v1/worker/gpu_model_runner.py:123(execute_model)': the path from
    the package root, so that keys match across machines."""
    for root in ("site-packages/", "/site/", "dist-packages/"):
        if root in path:
            path = path.rsplit(root, 1)[1]
            break
    return f"{path}:{line}({fn})"


def _worker_counters(worker) -> dict:
    runtime = getattr(worker.model_runner, "hisparse_runtime", None)
    if runtime is None:
        return {}
    return {k: int(v) for k, v in runtime.stats().items()}


def main() -> int:
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM logs to stdout: into the log file with stderr

    def send(obj: dict) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    spec = json.loads(sys.stdin.readline())
    cpus = os.environ.get("BENCH_TAX_CPUS")  # tax.CPUS_ENV (this module imports no benchlib)
    if cpus:
        # Before vLLM and torch start their threads, which inherit it.
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    try:
        engine = Engine(spec)
    except BaseException:  # noqa: BLE001 - the parent records why
        send({"ok": False, "error": traceback.format_exc()[-4000:]})
        return 1
    send({"ok": True, **engine.info})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.pop("op", None)
        if op not in OPS:
            send({"ok": False, "error": f"unknown op {op!r} (known: {', '.join(OPS)})"})
            continue
        try:
            send({"ok": True, **getattr(engine, op)(**cmd)})
        except Exception:  # noqa: BLE001
            send({"ok": False, "error": traceback.format_exc()[-4000:]})
        if op == "shutdown":
            break
    reply.flush()
    os._exit(0)  # no interpreter teardown behind a live engine


if __name__ == "__main__":
    sys.exit(main())
