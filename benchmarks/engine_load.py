"""Load on the OpenAI-compatible server: N requests from C concurrent clients over loopback.

Starts `surgeon serve MODEL` in a subprocess on a free port (or uses --url), sends chat requests
with the official openai client from C asyncio workers, and prints requests ok / failed, p50 / p99
latency, time to first token and generated tokens per second.

    python benchmarks/engine_load.py out/smollm2-drop6 [--requests 200] [--clients 32] [--max-tokens 64]
    python benchmarks/engine_load.py --url http://127.0.0.1:8000 ...
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai

QUESTIONS = [
    "Write one sentence about the sea.",
    "What is the capital of France?",
    "Name three colours.",
    "Give me a short greeting.",
    "What is two plus two?",
    "Describe a cat in a few words.",
    "Suggest a name for a dog.",
    "What do bees make?",
    "Say something kind.",
    "What is rain?",
]


def start_server(model: str, max_num_seqs: int, device: str | None) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "surgeon",
        "-q",
        "serve",
        model,
        "--port",
        str(port),
        "--max-num-seqs",
        str(max_num_seqs),
    ] + (["--device", device] if device else [])
    server = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if server.poll() is not None:
            sys.exit(f"the server exited with status {server.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.kill()
            sys.exit("the server did not come up in 300 s")
        time.sleep(0.25)


async def load(url: str, requests: int, clients: int, max_tokens: int, stream: bool) -> dict:
    api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = (await api.models.list()).data[0].id
    todo: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        todo.put_nowait(i)
    latencies, first_tokens, tokens, errors = [], [], [0], []

    async def one(i: int) -> None:
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        started = time.perf_counter()
        if stream:
            chunks = await api.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=max_tokens,
                temperature=0.7,
                seed=i,
                stream=True,
                stream_options={"include_usage": True},
            )
            first = None
            async for chunk in chunks:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - started
                if chunk.usage is not None:
                    tokens[0] += chunk.usage.completion_tokens
            first_tokens.append(first if first is not None else time.perf_counter() - started)
        else:
            reply = await api.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, temperature=0.7, seed=i
            )
            tokens[0] += reply.usage.completion_tokens
        latencies.append(time.perf_counter() - started)

    async def client() -> None:
        while not todo.empty():
            i = todo.get_nowait()
            try:
                await one(i)
            except openai.OpenAIError as exc:
                errors.append(f"request {i}: {type(exc).__name__}: {exc}")

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return {
        "model": model,
        "wall": time.perf_counter() - started,
        "latencies": sorted(latencies),
        "first_tokens": sorted(first_tokens),
        "tokens": tokens[0],
        "errors": errors,
    }


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="served with `surgeon serve` in a subprocess (unless --url)")
    parser.add_argument("--url", help="a server already running, e.g. http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16, help="for the server this script starts")
    parser.add_argument("--device", help="for the server this script starts (default: cuda if available)")
    parser.add_argument("--no-stream", action="store_true", help="whole replies instead of streams")
    args = parser.parse_args()
    if not args.url and not args.model:
        parser.error("give a MODEL to serve or the --url of a running server")

    server = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        server, url = start_server(args.model, args.max_num_seqs, args.device)
    try:
        result = asyncio.run(load(url, args.requests, args.clients, args.max_tokens, not args.no_stream))
    finally:
        if server is not None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()

    ok, failed = len(result["latencies"]), len(result["errors"])
    lat, ttft = result["latencies"], result["first_tokens"]
    print(
        f"model {result['model']}: {args.requests} requests from {args.clients} concurrent clients, "
        f"max_tokens {args.max_tokens}, {'streamed' if not args.no_stream else 'whole replies'}"
    )
    print(f"requests ok {ok}  failed {failed}")
    print(f"latency p50 {percentile(lat, 50):.3f} s  p99 {percentile(lat, 99):.3f} s  max {percentile(lat, 100):.3f} s")
    if ttft:
        print(f"time to first token p50 {percentile(ttft, 50):.3f} s  p99 {percentile(ttft, 99):.3f} s")
    print(
        f"generated {result['tokens']} tokens in {result['wall']:.1f} s: "
        f"{result['tokens'] / result['wall']:.1f} tokens/s "
        f"({ok / result['wall']:.2f} requests/s)"
    )
    for error in result["errors"][:5]:
        print(error, file=sys.stderr)
    sys.exit(1 if failed or ok != args.requests else 0)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
