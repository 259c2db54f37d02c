# SPDX-License-Identifier: Apache-2.0
"""A stand-in for vLLM's benchmarks/multi_turn/benchmark_serving_multi_turn.py
(which needs pandas) with the interface bench-agentic uses: the same flags,
the conversation-list input, streamed /v1/chat/completions turn by turn
(max_tokens = the dataset answer's token count), each answer fed back into
the conversation, the clients' "num_failures" log line and the
--stats-json-output records (same fields). Clients are threads here.
"""

import argparse
import json
import threading
import time
import urllib.request


def turn(url: str, model: str, messages: list, max_tokens: int, timeout: float) -> dict:
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens,
                       "stream": True, "stream_options": {"include_usage": False}}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter_ns()
    ttft, last, text, gaps = None, t0, "", []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter_ns()
            content = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if content:
                if ttft is None:
                    ttft = now - t0
                else:
                    gaps.append(now - last)
                text += content
            last = now
    latency = time.perf_counter_ns() - t0
    n = len(text.split())
    tpot = (latency - ttft) / 1e6 / (n - 1) if n > 1 else 0.0
    return {"ttft_ms": ttft / 1e6, "tpot_ms": tpot, "latency_ms": latency / 1e6,
            "start_time_ms": t0 / 1e6, "input_num_tokens": sum(len(m["content"].split())
                                                               for m in messages),
            "output_num_tokens": n, "output_num_chunks": len(gaps),
            "output_num_first_chunk_tokens": 1, "approx_cached_percent": 0.0, "text": text}


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("--model", "--served-model-name", "--url", "--input-file",
                 "--stats-json-output"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--num-clients", type=int, required=True)
    ap.add_argument("--max-active-conversations", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout-sec", type=int, default=120)
    a = ap.parse_args()
    convs = json.load(open(a.input_file))
    stats, lock = [], threading.Lock()

    def client(cid: int) -> None:
        ok = failed = 0
        for conv in convs[cid::a.num_clients]:
            msgs = conv["messages"]
            for i in range(0, len(msgs), 2):
                try:
                    r = turn(a.url, a.served_model_name, msgs[:i + 1],
                             len(msgs[i + 1]["content"].split()), a.request_timeout_sec)
                except OSError:
                    failed += 1
                    break
                msgs[i + 1] = {"role": "assistant", "content": r.pop("text")}
                with lock:
                    stats.append({**r, "input_num_turns": i + 1, "conversation_id": conv["id"],
                                  "client_id": cid})
                ok += 1
        print(f"Client {cid} is done (num_successes={ok}, num_failures={failed})", flush=True)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(a.num_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    json.dump(stats, open(a.stats_json_output, "w"))


if __name__ == "__main__":
    main()
