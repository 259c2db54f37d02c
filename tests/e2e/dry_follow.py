# SPDX-License-Identifier: Apache-2.0
"""Follow a soak's recorded schedule on the CPU, without a GPU or a model.

The soak (``soak.py``) keeps the server's schedule (``trace.jsonl.gz``)
and the client's feed (``requests.jsonl.gz``) beside ``soak.json``. This
runs the soak's own ``follow()`` over them with vLLM's real scheduler
(HiSparse off, the soak's limits, a pool as large as the replay's) in an
engine stand-in with vLLM's batch queue: a schedule the replay cannot
follow shows here in seconds, with the step where it diverges. Only the
schedule is checked: the stand-in model samples each request's recorded
output tokens (the feed's ``tokens``, so a follow-up's prefix hit over its
parent's output hashes as on the server) and a stand-in token past them.

usage: .venv/bin/python tests/e2e/dry_follow.py DIR
  DIR  a folder holding trace.jsonl[.gz] and requests.jsonl[.gz]
Exit 0: followed to the end; 1: diverged or left steps; 2: bad input.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import vllm.platforms as _platforms  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402

# A CPU tool: vLLM's CPU platform, as ci/cpu_test_harness forces it for the
# tests (the version string of this build would not detect one).
_platforms._current_platform = CpuPlatform()

from vllm.v1.request import RequestStatus  # noqa: E402

from tests.hisparse.scheduler.harness import (  # noqa: E402
    baseline_kv_cache_config,
    make_request,
    make_scheduler,
    model_output,
    schedule,
)

REPLAY_BLOCKS = 90_000
"""~5.8M tokens at 64 per block: the GPU replay's 16 GiB pool holds ~5.4M."""


class Engine:
    """What follow() uses of vLLM's LLMEngine, over a real scheduler with
    the async engine loop (one step in flight)."""

    def __init__(self, scheduler, recorded: dict[str, list[int]] | None = None) -> None:
        self.s = scheduler
        self.engine_core = SimpleNamespace(engine_core=SimpleNamespace(scheduler=scheduler))
        self.in_flight = None
        self.external, self.tokens = {}, {}
        self.recorded = recorded or {}
        """Server request key -> the output tokens the server returned."""

    def add_request(self, key, prompt, params) -> str:
        r = make_request(f"{key}-replay", prompt["prompt_token_ids"], params.max_tokens)
        self.s.add_request(r)
        self.external[r.request_id], self.tokens[r.request_id] = key, []
        return r.request_id

    def has_unfinished_requests(self) -> bool:
        return self.s.has_unfinished_requests() or self.in_flight is not None

    def step(self) -> list:
        so = schedule(self.s)
        outs = [] if self.in_flight is None else self._outputs(self.in_flight)
        self.in_flight = so if so.num_scheduled_tokens else None
        return outs

    def _outputs(self, so) -> list:
        """``so``'s model output applied; the requests it finished, as
        LLMEngine reports them (an aborted request is never reported)."""
        outs = []
        for eco in self.s.update_from_output(so, self._model_output(so)).values():
            for o in eco.outputs:
                self.tokens[o.request_id] += o.new_token_ids
                if o.finish_reason is None or o.finish_reason.name == "ABORT":
                    continue
                toks = self.tokens[o.request_id]
                outs.append(SimpleNamespace(
                    request_id=self.external[o.request_id], finished=True,
                    outputs=[SimpleNamespace(
                        token_ids=toks, finish_reason="length",
                        logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in toks])]))
        return outs

    def _model_output(self, so):
        """The harness's model output with each sampled token replaced by
        the request's recorded one at that position, where recorded."""
        out = model_output(self.s, so, None)
        for i, rid in enumerate(out.req_ids):
            rec = self.recorded.get(self.external.get(rid, ""))
            sampled = out.sampled_token_ids[i]
            at = len(self.s.requests[rid].output_token_ids) if rid in self.s.requests else 0
            if rec and len(sampled) == 1 and at < len(rec):
                out.sampled_token_ids[i] = [rec[at]]
        return out

    def abort_request(self, ids, internal=False) -> None:
        """As LLMEngine's: the output processor forwards only requests it
        still tracks, so an abort of a finished request never reaches the
        scheduler."""
        assert internal
        live = [i for i in ids if i in self.s.requests and not self.s.requests[i].is_finished()]
        if live:
            self.s.finish_requests(live, RequestStatus.FINISHED_ABORTED)


class QueueEngine(Engine):
    """vLLM's EngineCore.step_with_batch_queue (batch queue of 2) under the
    LLMEngine calls follow() makes: a schedule that admits nothing still
    takes a slot of the queue (the replay schedules empty steps while it
    waits for the server's next ones), and outputs come one call later."""

    def __init__(self, scheduler, recorded: dict[str, list[int]] | None = None) -> None:
        super().__init__(scheduler, recorded)
        self.queue: list = []

    def has_unfinished_requests(self) -> bool:
        return self.s.has_unfinished_requests() or bool(self.queue)

    def step(self) -> list:
        if self.s.has_requests():
            so = schedule(self.s)
            self.queue.insert(0, so)
            if len(self.queue) < 2 and (so.total_num_scheduled_tokens > 0
                                        or self.s.has_requests()):
                return []
        elif not self.queue:
            return []
        return self._outputs(self.queue.pop())


def _inputs(folder: Path, work: Path) -> None:
    for name in ("trace.jsonl", "requests.jsonl"):
        plain, packed = folder / name, folder / f"{name}.gz"
        if plain.exists():
            shutil.copyfile(plain, work / name)
        elif packed.exists():
            with gzip.open(packed, "rb") as src, open(work / name, "wb") as dst:
                shutil.copyfileobj(src, dst)
        else:
            raise FileNotFoundError(f"{folder} has neither {name} nor {name}.gz")


def recorded_outputs(requests_jsonl: Path) -> dict[str, list[int]]:
    """Server request key -> output tokens, from the feed's ``tokens`` lines."""
    from soak_logic import server_key

    out = {}
    with open(requests_jsonl) as f:
        for line in f:
            d = json.loads(line)
            if "tokens" in d and "id" in d:
                out[server_key(d["id"])] = list(d["tokens"])
    return out


def dry_follow(folder: Path, timeout_s: float = 600.0) -> dict:
    """follow() over a soak's saved inputs on a CPU scheduler."""
    import soak

    with tempfile.TemporaryDirectory(prefix="dry-follow-") as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        _inputs(folder, work)
        s = make_scheduler(Path(tmp) / "sched", baseline_kv_cache_config(
            num_gpu_blocks=REPLAY_BLOCKS), async_scheduling=True,
            max_num_batched_tokens=soak.CHUNK, max_num_seqs=soak.MAX_NUM_SEQS,
            max_model_len=soak.MAX_MODEL_LEN)
        engine = QueueEngine(s, recorded_outputs(work / "requests.jsonl"))
        out = soak.follow(SimpleNamespace(llm_engine=engine), work,
                          deadline=time.time() + timeout_s)
    return {"diverged": out["diverged"], "followed": len(out["followed"]),
            "replayed": len(out["replayed"]), "records": len(out["records"]),
            "skipped_steps": out["skipped_steps"], "foreign_steps": out["foreign_steps"],
            "pending_steps": out["pending_steps"], "unfinished": out["unfinished"],
            "follow_s": out["follow_s"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", type=Path, help="folder with trace.jsonl[.gz], requests.jsonl[.gz]")
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_args(argv)
    try:
        out = dry_follow(a.dir, a.timeout)
    except FileNotFoundError as err:
        print(f"dry_follow.py: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(out))  # one line, the last: a report to parse
    return 0 if out["diverged"] is None and not out["pending_steps"] else 1


if __name__ == "__main__":
    sys.exit(main())
