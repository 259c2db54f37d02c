# SPDX-License-Identifier: Apache-2.0
"""A stand-in for vLLM's OpenAI server, for the soak client's CPU tests.

It answers /v1/completions (plain and SSE-streamed) in the shape vLLM
0.26's completion serving produces with ``logprobs``,
``return_token_ids`` and ``return_tokens_as_token_ids`` (choices with
``logprobs.tokens`` as "token_id:N", ``token_logprobs``, ``top_logprobs``
and ``token_ids``), /health, /metrics and /reset_prefix_cache, from a
deterministic fake model (``fake_model``) that the tests also use as the
"replay". Streams emit one token per chunk with a short delay, so clients
can disconnect mid-way; the server counts disconnects it saw.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import struct
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

FIRST_TOKEN_DELAY = 0.05  # > the soak's before-first-token disconnect delays
TOKEN_DELAY = 0.005
PLAIN_DELAY = 0.25  # > the soak's non-streamed cancel delays


def fake_model(prompt: list[int], n: int) -> list[tuple[int, dict[int, float]]]:
    """Per generated position: (token, {id: float32 logprob}) with the
    sampled token first and 5 more."""
    seed = hashlib.sha256(json.dumps(prompt).encode()).hexdigest()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = rng.sample(range(2, 8192), 6)
        vals = sorted((struct.unpack("f", struct.pack("f", -rng.random() * 9))[0]
                       for _ in ids), reverse=True)
        out.append((ids[0], dict(zip(ids, vals))))
    return out


def _logprobs(positions) -> dict:
    return {"text_offset": [0] * len(positions),
            "token_logprobs": [lps[t] for t, lps in positions],
            "tokens": [f"token_id:{t}" for t, _ in positions],
            "top_logprobs": [{f"token_id:{i}": v for i, v in lps.items()}
                             for _, lps in positions]}


def _choice(positions, finish) -> dict:
    return {"index": 0, "text": " ".join(f"w{t}" for t, _ in positions),
            "logprobs": _logprobs(positions), "finish_reason": finish,
            "token_ids": [t for t, _ in positions]}


def make_app(state: dict) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return PlainTextResponse("")

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            f'vllm:kv_cache_usage_perc{{engine="0"}} {state["usage"]}\n'
            f'vllm:num_requests_running{{engine="0"}} {state["running"]}\n'
            'vllm:num_requests_waiting{engine="0"} 0.0\n')

    @app.post("/reset_prefix_cache")
    async def reset():
        return JSONResponse({"success": state["running"] == 0})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        positions = fake_model(body["prompt"], body["max_tokens"])
        # vLLM's completion request field: the engine's request id
        state["request_ids"].append(body["request_id"])
        if "logprobs" not in body:  # the soak's idle probe
            state["probes"] += 1
            return JSONResponse({"choices": [{"index": 0, "text": "x",
                                              "finish_reason": "length"}]})
        assert body["logprobs"] == 5 and body["temperature"] == 0 and body["ignore_eos"]
        assert body["return_token_ids"] and body["return_tokens_as_token_ids"]
        state["requests"] += 1
        if not body.get("stream"):
            await asyncio.sleep(PLAIN_DELAY)
            return JSONResponse({"id": "x", "object": "text_completion", "created": 0,
                                 "model": body["model"], "choices": [
                                     _choice(positions, "length")]})
        return StreamingResponse(_stream(positions, body["model"], request, state),
                                 media_type="text/event-stream")

    return app


async def _stream(positions, model, request, state):
    state["running"] += 1
    try:
        await asyncio.sleep(FIRST_TOKEN_DELAY)
        for i, pos in enumerate(positions):
            finish = "length" if i == len(positions) - 1 else None
            chunk = {"id": "x", "object": "text_completion", "created": 0, "model": model,
                     "choices": [_choice([pos], finish)]}
            yield f"data: {json.dumps(chunk)}\n\n"
            await asyncio.sleep(TOKEN_DELAY)
        yield "data: [DONE]\n\n"
    except asyncio.CancelledError:
        state["disconnects"] += 1
        raise
    finally:
        state["running"] -= 1


class FakeServer:
    """The app on a uvicorn thread; ``url``, ``state``, ``stop()``."""

    def __init__(self, port: int) -> None:
        self.state = {"usage": 0.0, "running": 0, "requests": 0, "disconnects": 0,
                      "probes": 0, "request_ids": []}
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(make_app(self.state), host="127.0.0.1", port=port,
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started and time.time() < deadline:
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.thread.is_alive()

    def engine_pid(self) -> int:
        return 1

    def log_text(self) -> str:
        return ""

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
