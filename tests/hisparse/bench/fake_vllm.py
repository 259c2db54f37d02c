# SPDX-License-Identifier: Apache-2.0
"""A stand-in for `vllm serve` (standard library HTTP server) with what
bench-agentic and vLLM's multi-turn tool use: /health, /version,
/v1/models, /metrics (the series vLLM 0.26.0 exports, HiSparse's for the
hisparse arm), POST /reset_prefix_cache, POST /v1/chat/completions
(streamed like vLLM: one token word per chunk, then [DONE]), and with
``--profiler-config`` (vLLM's flag) POST /start_profile and /stop_profile,
the stop writing a trace of the engine's shape (fake_trace.py) into its
``torch_profiler_dir``. The "arm"
decides what the metrics show: plain preempts, only hisparse has
vllm:hisparse_*; running requests are the streams in flight.

usage: python3 fake_vllm.py --port P --arm ARM [--version V] [--profiler-config JSON]
FAKE_VLLM_EXIT=ARM: that arm's server exits at once.
FAKE_VLLM_FAIL_UNSTREAMED=ARM: that arm answers 500 to every unstreamed chat
request (bench-agentic's warm-up; the tool streams).
FAKE_VLLM_PROMPTS=DIR: every chat request appends its prompt's word count
(one token per word) and whether it streamed to DIR/ARM.txt.
FAKE_VLLM_ENGINE=1: the server starts fake_engine_core.py's titled child
(VLLM::EngineCore) for bench-agentic --sample-engines to find and sample
(it spins: a core while its server lives).
"""

import argparse
import json
import os
import random
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import fake_engine_core
from fake_trace import serving_steps, write_trace

STATE = {"running": 0, "preemptions": 0, "generation": 0, "prompt": 0, "requests": 0,
         "hits": 0, "lookups": 0, "resets": 0}
LOCK = threading.Lock()
TOKEN_DELAY = 0.001


def metrics(arm: str) -> str:
    lab = 'engine="0",model_name="tiny"'
    with LOCK:
        s = dict(STATE)
    out = [f"vllm:num_requests_running{{{lab}}} {float(s['running'])}",
           f"vllm:num_requests_waiting{{{lab}}} 0.0",
           f"vllm:num_preemptions_total{{{lab}}} {float(s['preemptions'])}",
           f"vllm:generation_tokens_total{{{lab}}} {float(s['generation'])}",
           f"vllm:prompt_tokens_total{{{lab}}} {float(s['prompt'])}",
           f"vllm:kv_cache_usage_perc{{{lab}}} 0.5",
           f'vllm:cache_config_info{{{lab},block_size="64",num_gpu_blocks="3196"}} 1.0']
    if arm == "hisparse":
        out += [f"vllm:hisparse_hits_total{{{lab}}} {float(s['hits'])}",
                f"vllm:hisparse_lookups_total{{{lab}}} {float(s['lookups'])}",
                f"vllm:hisparse_host_to_device_bytes_total{{{lab}}} "
                f"{float((s['lookups'] - s['hits']) * 2624)}"]
    return "\n".join(out) + "\n"


def make_handler(arm: str, version: str, profiler: dict | None = None):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def send(self, status: int, body: str, ctype: str = "application/json") -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self.send(200, "")
            elif self.path == "/version":
                self.send(200, json.dumps({"version": version}))
            elif self.path == "/v1/models":
                self.send(200, json.dumps({"data": [{"id": "tiny", "max_model_len": 16384}]}))
            elif self.path == "/metrics":
                self.send(200, metrics(arm), "text/plain")
            else:
                self.send(404, "{}")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/reset_prefix_cache":
                with LOCK:
                    STATE["resets"] += 1
                self.send(200, "")
            elif self.path == "/v1/chat/completions":
                self.chat(body)
            elif self.path in ("/start_profile", "/stop_profile"):
                self.profile(self.path == "/start_profile")
            else:
                self.send(404, "{}")

        def profile(self, start: bool) -> None:
            if not profiler:  # vLLM: only routed with --profiler-config
                self.send(404, "{}")
                return
            with LOCK:
                was = STATE.get("profiling", False)
                STATE["profiling"] = start
            if was and not start:
                folder = Path(profiler["torch_profiler_dir"])
                write_trace(folder / f"fake_engine.{time.time_ns()}.pt.trace.json.gz",
                            serving_steps(min(40, profiler.get("max_iterations") or 40)))
            self.send(200, "")

        def chat(self, body: dict) -> None:
            n = int(body.get("max_tokens") or 16)
            prompt = sum(len(m["content"].split()) for m in body["messages"])
            record = os.environ.get("FAKE_VLLM_PROMPTS")
            if record:
                with LOCK, open(Path(record) / f"{arm}.txt", "a") as f:
                    f.write(f"{prompt} {int(bool(body.get('stream')))}\n")
            if not body.get("stream") and os.environ.get("FAKE_VLLM_FAIL_UNSTREAMED") == arm:
                self.send(500, json.dumps({"error": "fake failure"}))
                return
            rng = random.Random(prompt)
            words = [f"w{rng.randrange(2, 8192)}" for _ in range(n)]
            with LOCK:
                STATE["running"] += 1
                STATE["requests"] += 1
                STATE["prompt"] += prompt
                if arm == "plain" and STATE["requests"] % 3 == 0:
                    STATE["preemptions"] += 1
            try:
                if not body.get("stream"):
                    self.send(200, json.dumps({"choices": [{"message": {
                        "role": "assistant", "content": " ".join(words)}}]}))
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for i, w in enumerate(words):
                    time.sleep(TOKEN_DELAY)
                    delta = {"content": (" " if i else "") + w}
                    self.wfile.write(f"data: {json.dumps({'choices': [{'delta': delta}]})}\n\n"
                                     .encode())
                    self.wfile.flush()
                    with LOCK:
                        STATE["generation"] += 1
                        STATE["lookups"] += 10
                        STATE["hits"] += 9
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True
            finally:
                with LOCK:
                    STATE["running"] -= 1

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--arm", required=True)
    ap.add_argument("--version", default="0.0.0-fake")
    ap.add_argument("--profiler-config", type=json.loads, default=None)
    a = ap.parse_args()
    if os.environ.get("FAKE_VLLM_EXIT") == a.arm:
        sys.exit(3)  # a server that does not come up
    if os.environ.get("FAKE_VLLM_ENGINE") == "1":
        fake_engine_core.spawn()
    ThreadingHTTPServer(("127.0.0.1", a.port), make_handler(a.arm, a.version,
                                                                a.profiler_config)).serve_forever()


if __name__ == "__main__":
    main()
