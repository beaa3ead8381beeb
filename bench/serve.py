"""What the server costs and what batching buys: `python -m stages.serve` on loopback against
calling `generate` and our decode engine directly, in one run, on the same model and prompts.

Peers: transformers `generate` (greedy, KV cache) in this process, on one prompt, and on a batch
of C prompts for each concurrency C; and our engine (`DecodeEngine.generate`, what the server's
running batch is made of) on the same batch of C, while the server (`python -m stages.serve
--model DIR`, its own process on a free 127.0.0.1 port) idles. One request is timed `--repeats`
times, interleaved: `generate`, the server streaming, the server answering whole. Then, per
concurrency, `--repeats // 2` rounds (at least one) of: `generate` and the engine on a batch of C,
then C client threads (1, 4, 16 by default) each sending `--requests` streamed greedy chat
requests (raw HTTP, server-sent events read as they come). Per concurrency (medians over the
rounds): generated tokens/s over the wall time, request latency p50/p95, time to first token
p50, and the ratios against the peers (medians of each round's ratio):
  - one request, streamed and answered whole, against one `generate` call for the same prompt
    (the server's overhead: HTTP, JSON, the scheduler thread, per-token detokenizing and stop
    checks, and the client's reading, all on the same cores);
  - C streams: tokens/s against `generate` and against the engine on a batch of C prompts (what
    continuous batching recovers: the batch is refilled as requests end, but every request
    pays HTTP, detokenizing and a prefill of its own, which interrupts the others' decoding).
Issue 52's targets, at the largest concurrency (16 by default): the server's tokens/s at least the
engine's on one batch of as many prompts (>= 1.0x), and its first-token p50 at most twice a lone
request's (<= 2x). The machine's load average is recorded before and after.
Bounded: every request has max_tokens `--max-tokens`, and a concurrency level stops sending new
requests after `--time-limit` seconds.

    .venv/bin/python bench/serve.py --model results/llama/lora-merged     # after `make demo`
    .venv/bin/python bench/serve.py --model DIR --concurrency 1,4 --requests 2
    .venv/bin/python bench/serve.py --model DIR --compile     # the server's decode steps compiled
Prints a table and writes JSON (default bench/out/serve.json).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import csv_list, finish, machine_info  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "out" / "serve.json"
DEFAULT_MODEL = ROOT / "results" / "llama" / "lora-merged"
PROMPTS = ["What colour is the sky on a clear day?", "Name three animals that live on a farm.",
           "Write one sentence about the sea.", "What is the opposite of cold?",
           "Give a short title for a story about a lost cat.", "What do bees make?",
           "Count from one to five.", "Describe bread in a few words."]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# -- the peer: generate directly ------------------------------------------------------------------
class Direct:
    """transformers `generate` and our engine in this process, on the prompts as the server
    encodes them (served_model.prompt_ids of the same chat requests), each call in one long-lived
    worker thread as the server's model runs in its scheduler's: on a loaded machine torch's
    OpenMP threads behave very differently in the main thread (one batch-16 engine call measured
    22 s there against 0.9 s in a worker thread, the same minute), which would skew the ratios."""

    def __init__(self, model_dir: Path, max_tokens: int):
        from stages.serving.openai_api import parse_request
        from stages.serving.served_model import load_served_model

        self.served = load_served_model(model_dir)
        self.engine = None  # made on first use
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="peer")
        self.max_tokens = max_tokens
        self.prompts = [self.served.prompt_ids(parse_request(_body(p, max_tokens, self.served.model_id), "chat"))
                        for p in PROMPTS]

    def run(self, count: int) -> tuple[float, int]:
        """(seconds, generated tokens) of one greedy generate call on the first `count` prompts
        (cycled), left-padded as the server pads."""
        return self.worker.submit(self._generate, count).result()

    def run_engine(self, count: int) -> tuple[float, int]:
        """(seconds, generated tokens) of one greedy `DecodeEngine.generate` call on the same
        batch as `run` (each row ends at its eos or max_tokens)."""
        return self.worker.submit(self._engine, count).result()

    def _generate(self, count: int) -> tuple[float, int]:
        import torch

        from stages.inference.generation import left_padded

        served = self.served
        ids, mask = left_padded([self.prompts[i % len(self.prompts)] for i in range(count)], served.pad_token_id)
        width = ids.shape[1]
        start = time.perf_counter()
        with torch.no_grad():
            out = served.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=self.max_tokens,
                                        do_sample=False, eos_token_id=served.eos_token_id,
                                        pad_token_id=served.pad_token_id)
        seconds = time.perf_counter() - start
        new = out[:, width:]
        tokens = sum(int((row != served.pad_token_id).sum()) for row in new)  # rows ended by eos are padded
        return seconds, tokens

    def _engine(self, count: int) -> tuple[float, int]:
        from stages.inference.engine import DecodeEngine

        if self.engine is None:
            served = self.served
            self.engine = DecodeEngine(served.model, eos_token_id=served.eos_token_id, pad_token_id=served.pad_token_id)
        prompts = [self.prompts[i % len(self.prompts)] for i in range(count)]
        start = time.perf_counter()
        rows = self.engine.generate(prompts, self.max_tokens)
        return time.perf_counter() - start, sum(len(r.tokens) for r in rows)


# -- the server --------------------------------------------------------------------------------
def _body(prompt: str, max_tokens: int, model: str, stream: bool = False) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "stream": stream, "stream_options": {"include_usage": stream}}


def start_server(model_dir: Path, max_batch_size: int, max_queue: int,
                 compile: bool = False) -> tuple[subprocess.Popen, str, int]:
    """The server in its own process; returns once it listens (with `compile`, after its warm-up)."""
    proc = subprocess.Popen([sys.executable, "-m", "stages.serve", "--model", str(model_dir), "--max-batch-size",
                             str(max_batch_size), "--max-queue", str(max_queue), *(["--compile"] if compile else [])],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if not line.startswith("serving "):
        proc.kill()
        raise RuntimeError(f"the server did not start: {line!r}")
    host, port = line.split()[3].removeprefix("http://").split(":")
    return proc, host, int(port)


def stream_request(host: str, port: int, body: dict) -> dict:
    """One streamed request: latency, time to first content, completion tokens."""
    conn = http.client.HTTPConnection(host, port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    first, tokens = None, 0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "usage" in event:
            tokens = event["usage"]["completion_tokens"]
        elif first is None and event["choices"] and event["choices"][0]["delta"].get("content"):
            first = time.perf_counter() - start
    seconds = time.perf_counter() - start
    conn.close()
    if response.status != 200:
        raise RuntimeError(f"status {response.status}")
    return {"seconds": seconds, "first_token_seconds": first if first is not None else seconds, "tokens": tokens}


def plain_request(host: str, port: int, body: dict) -> dict:
    """One request answered whole (no streaming): latency and completion tokens."""
    conn = http.client.HTTPConnection(host, port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    answer = json.loads(response.read())
    seconds = time.perf_counter() - start
    conn.close()
    if response.status != 200:
        raise RuntimeError(f"status {response.status}: {answer}")
    return {"seconds": seconds, "tokens": answer["usage"]["completion_tokens"]}


def load(host: str, port: int, model: str, clients: int, requests: int, max_tokens: int, time_limit: float) -> dict:
    results: list[dict] = []
    lock = threading.Lock()
    deadline = time.perf_counter() + time_limit

    def client(i: int) -> None:
        for k in range(requests):
            if time.perf_counter() > deadline:
                return
            r = stream_request(host, port, _body(PROMPTS[(i + k) % len(PROMPTS)], max_tokens, model, stream=True))
            with lock:
                results.append(r)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    latencies = [r["seconds"] for r in results]
    return {"clients": clients, "requests": len(results), "wall_seconds": wall,
            "tokens": sum(r["tokens"] for r in results),
            "tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "latency_p50_s": percentile(latencies, 0.5), "latency_p95_s": percentile(latencies, 0.95),
            "first_token_p50_s": percentile([r["first_token_seconds"] for r in results], 0.5)}


def level_in_rounds(direct: Direct, host: str, port: int, model: str, clients: int, requests: int,
                    max_tokens: int, time_limit: float, rounds: int) -> dict:
    """One concurrency level in `rounds` rounds, each: generate and the engine on a batch of
    `clients` prompts, then the server under `clients` streams. Each figure is the median over the
    rounds and each ratio the median of the rounds' ratios, so that a slower or faster minute of a
    shared machine touches a ratio's both sides alike."""
    runs = []
    for _ in range(rounds):
        peer, engine = direct.run(clients), direct.run_engine(clients)
        level = load(host, port, model, clients, requests, max_tokens, time_limit)
        level["peer_tokens_per_s"], level["engine_tokens_per_s"] = peer[1] / peer[0], engine[1] / engine[0]
        level["over_peer"] = level["tokens_per_s"] / level["peer_tokens_per_s"]
        level["over_engine"] = level["tokens_per_s"] / level["engine_tokens_per_s"]
        runs.append(level)
    out = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    out.update(clients=clients, rounds=rounds, requests=sum(r["requests"] for r in runs),
               tokens=sum(r["tokens"] for r in runs))
    return out


def measure(model_dir: Path, concurrency: list[int], requests: int, max_tokens: int, time_limit: float,
            repeats: int, compile: bool = False) -> dict:
    load_before = os.getloadavg()[0]
    direct = Direct(model_dir, max_tokens)
    model_id = direct.served.model_id
    started = time.perf_counter()
    proc, host, port = start_server(model_dir, max_batch_size=max(concurrency), max_queue=max(concurrency),
                                    compile=compile)
    start_seconds = time.perf_counter() - started
    try:
        streamed_body, whole_body = (_body(PROMPTS[0], max_tokens, model_id, stream=s) for s in (True, False))
        direct.run(1), stream_request(host, port, streamed_body), plain_request(host, port, whole_body)  # warm-ups
        # interleaved, so that a slower or faster minute of a shared machine touches all three alike
        single = {"generate": [], "streamed": [], "whole": []}
        for _ in range(repeats):
            single["generate"].append(dict(zip(("seconds", "tokens"), direct.run(1))))
            single["streamed"].append(stream_request(host, port, streamed_body))
            single["whole"].append(plain_request(host, port, whole_body))
        levels = []
        direct.run_engine(1)  # warm-up
        for c in concurrency:
            levels.append(level_in_rounds(direct, host, port, model_id, c, requests, max_tokens, time_limit,
                                          max(1, repeats // 2)))
    finally:
        direct.worker.shutdown()
        proc.terminate()
        proc.wait(timeout=60)
    median = {k: statistics.median(r["seconds"] for r in v) for k, v in single.items()}
    lone_first = statistics.median(r["first_token_seconds"] for r in single["streamed"])
    top = max(levels, key=lambda v: v["clients"])
    targets = {"clients": top["clients"], "over_engine": top["over_engine"],
               "first_token_over_lone": top["first_token_p50_s"] / lone_first}
    return {"model_dir": str(model_dir), "kind": direct.served.kind, "max_tokens": max_tokens, "repeats": repeats,
            "compile": compile, "server_start_seconds": start_seconds,
            "load_average": {"before": load_before, "after": os.getloadavg()[0]}, "targets": targets,
            "single_request": {"generate_seconds": median["generate"], "peer_tokens": single["generate"][0]["tokens"],
                               "tokens": single["streamed"][0]["tokens"], "whole_tokens": single["whole"][0]["tokens"],
                               "server_seconds": median["streamed"],
                               "overhead": median["streamed"] / median["generate"] - 1.0,
                               "whole_seconds": median["whole"], "first_token_seconds": lone_first,
                               "whole_overhead": median["whole"] / median["generate"] - 1.0},
            "levels": levels}


def report(result: dict) -> str:
    r = result["result"]
    s = r["single_request"]
    single = (f"one request against generate {s['generate_seconds'] * 1e3:.1f} ms ({s['peer_tokens']} tokens): "
              f"streamed {s['server_seconds'] * 1e3:.1f} ms ({s['tokens']} tokens, {s['overhead']:+.1%}), "
              f"answered whole {s['whole_seconds'] * 1e3:.1f} ms ({s['whole_tokens']} tokens, "
              f"{s['whole_overhead']:+.1%}), first token {s['first_token_seconds'] * 1e3:.0f} ms")
    header = ("| streams | requests | tokens/s | generate on a batch, tokens/s | ratio | engine on a batch, tokens/s | "
              "ratio | latency p50 | p95 | first token p50 |")
    mode = "compiled decode steps (--compile)" if r["compile"] else "eager decode steps"
    lines = [f"serving {r['model_dir']} ({r['kind']}), greedy, max_tokens {r['max_tokens']}, {mode}; the server "
             f"listened after {r['server_start_seconds']:.1f} s", "", single, "",
             header, "|---|---|---|---|---|---|---|---|---|---|"]
    for v in r["levels"]:
        lines.append(f"| {v['clients']} | {v['requests']} | {v['tokens_per_s']:.1f} | {v['peer_tokens_per_s']:.1f} | "
                     f"{v['over_peer']:.2f} | {v['engine_tokens_per_s']:.1f} | {v['over_engine']:.2f} | "
                     f"{v['latency_p50_s'] * 1e3:.0f} ms | {v['latency_p95_s'] * 1e3:.0f} ms | "
                     f"{v['first_token_p50_s'] * 1e3:.0f} ms |")
    t, load = r["targets"], r["load_average"]
    throughput = "met" if t["over_engine"] >= 1.0 else "not met"
    first = "met" if t["first_token_over_lone"] <= 2.0 else "not met"
    targets = (f"targets (issue 52) at {t['clients']} streams: tokens/s over the engine on a batch of as many "
               f"{t['over_engine']:.2f}x (>= 1.0: {throughput}), first-token p50 over a lone request's "
               f"{t['first_token_over_lone']:.2f}x (<= 2.0: {first})")
    lines += ["", targets, f"load average (1 min): {load['before']:.2f} before, {load['after']:.2f} after"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                        help="model dir to serve (default: the default run's lora-merged, after `make demo`)")
    parser.add_argument("--concurrency", default="1,4,16", help="concurrent streams, comma-separated")
    parser.add_argument("--requests", type=int, default=4, help="requests per stream and level (default 4)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed single requests / generate calls (default 5)")
    parser.add_argument("--time-limit", type=float, default=120.0,
                        help="seconds after which a level sends no new request (default 120)")
    parser.add_argument("--compile", action="store_true",
                        help="serve with --compile (decode steps compiled before the server listens)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if not (args.model / "config.json").exists() and not (args.model / "adapter_config.json").exists():
        parser.error(f"--model {args.model} holds no model; run `make demo` first or pass a model dir")
    started = time.perf_counter()
    concurrency = [int(c) for c in csv_list(args.concurrency)]
    result = {"machine": machine_info("transformers"),
              "result": measure(args.model, concurrency, args.requests, args.max_tokens, args.time_limit,
                                args.repeats, args.compile)}
    return finish(args.out, result, report, started)


if __name__ == "__main__":
    sys.exit(main())
