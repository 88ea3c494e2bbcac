"""`pyml serve` under load, against llama.cpp's server: aggregate decode tokens/s and time to first
token at 1, 4, 8 and 16 concurrent streams.

Both serve the same GGUF, the SmolLM2 one `make demo` imports (models/smollm2-135m-instruct; pyml
runs its weights as the GGUF stores them, from the folder's copy source.gguf), in a process of
their own on 127.0.0.1, each with 16 sequences of 2048 positions: `pyml serve --max-sequences 16`
twice, with float32 activations (its default) and with `--activations q8_0` (the activations
rounded to int8 per 32 values before each quantized product, as llama.cpp's CPU products round
them), and llama.cpp's `llama-server -np 16 -c 32768` (continuous batching, its default), built from the
llama.cpp source vendored in the llama-cpp-python sdist (`make bench-serve` builds it; without it
only pyml runs, and the report says so), on all cores. At each concurrency C, C clients (threads
of this process, each with its own HTTP connection) each send `--requests` streaming chat requests
one after the other, every request a different question, greedy, `--max-tokens` at most, usage
included. Time to first token is from a request's send to its first content chunk; aggregate
decode tokens/s is every completion token of the round (the usage counts) over the round's wall
time, first tokens and prefill included, as a user of the server sees it. Each concurrency is
warmed up once, then measured `--repeats` times; the median round by tokens/s is reported.

    python bench/serve.py [--model DIR] [--llama-server PATH] [--max-tokens 64] [--requests 2] [--repeats 3]

Results go to bench/results/serve.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path

import httpx2 as httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CONCURRENCY = (1, 4, 8, 16)
SEQUENCES, CONTEXT = 16, 2048  # each server's batch: sequences of CONTEXT positions
TOPICS = ["lighthouses", "volcanoes", "the moon", "bread", "bees", "rivers", "glass", "trains",
          "owls", "salt", "clocks", "maps", "tea", "snow", "copper", "kites"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def started(command: list[str], url: str) -> subprocess.Popen:
    """`command` running, once `url`/health answers 200 (llama-server answers 503 while loading)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            sys.exit(f"{command[0]} did not start: {process.stdout.read()[-2000:]}")
        time.sleep(0.5)


def pyml_command(model: Path, port: int, activations: str) -> list[str]:
    return [sys.executable, "-m", "pyml.cli", "serve", "--model", str(model), "--port", str(port),
            "--max-sequences", str(SEQUENCES), "--max-queue", "64", "--context", str(CONTEXT),
            "--activations", activations]


def llama_cpp_command(server: Path, model: Path, port: int) -> list[str]:
    return [str(server), "-m", str(model / "source.gguf"), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(SEQUENCES), "-c", str(SEQUENCES * CONTEXT), "-t", str(os.cpu_count()),
            "--jinja", "--no-webui", "--log-disable"]


def one_request(client: httpx.Client, url: str, question: str, max_tokens: int) -> tuple[float, int]:
    """(seconds to the first content chunk, completion tokens) of one streamed chat request."""
    body = {"model": "m", "messages": [{"role": "user", "content": question}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "stream_options": {"include_usage": True}}
    sent, first, tokens = time.perf_counter(), None, 0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - sent
    return (first if first is not None else time.perf_counter() - sent), tokens


def round_of(url: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    first_token, tokens, failures, lock = [], [0], [], threading.Lock()

    def client_loop(index: int) -> None:
        for n in range(requests):
            topic = TOPICS[(index * requests + n) % len(TOPICS)]
            # a connection per request: llama-server closes idle keep-alive connections, and a
            # request sent on one as it closes is lost ("Server disconnected")
            try:
                with httpx.Client() as client:
                    seconds, count = one_request(client, url, f"Tell me about {topic}.", max_tokens)
            except httpx.HTTPError as error:
                with lock:
                    failures.append(repr(error))
                continue
            with lock:
                first_token.append(seconds)
                tokens[0] += count

    started = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if failures:  # a round with lost requests measures nothing
        sys.exit(f"{url}: {len(failures)} of {concurrency * requests} requests failed: {failures[0]}")
    return {"concurrency": concurrency, "requests": concurrency * requests, "tokens": tokens[0],
            "seconds": round(wall, 2), "tokens_per_s": round(tokens[0] / wall, 1),
            "median_first_token_ms": round(1000 * statistics.median(first_token), 1)}


def measure(name: str, command: list[str], url: str, max_tokens: int, requests: int, repeats: int) -> list[dict]:
    """Each concurrency's round, the median of `repeats` by tokens/s (this machine is shared)."""
    process = started(command, url)
    try:
        round_of(url, 1, 1, 8)  # warms the caches and the thread pools
        rounds = []
        for concurrency in CONCURRENCY:
            round_of(url, concurrency, 1, 16)  # this batch size's buffers allocated
            runs = sorted((round_of(url, concurrency, requests, max_tokens) for _ in range(repeats)),
                          key=lambda entry: entry["tokens_per_s"])
            rounds.append(runs[len(runs) // 2])
            print(name, json.dumps(rounds[-1]), flush=True)
        return rounds
    finally:
        process.terminate()
        process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m-instruct")
    parser.add_argument("--llama-server", type=Path, default=ROOT / ".venv/share/llama.cpp/build/bin/llama-server")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2, help="requests per client per round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per concurrency; the median is kept")
    args = parser.parse_args()
    if not (args.model / "source.gguf").is_file():
        sys.exit(f"{args.model}: no imported GGUF folder (`make demo` or `pyml import-gguf --out DIR` makes one)")
    systems, urls = {}, {}
    for name, activations in (("pyml", "f32"), ("pyml q8_0", "q8_0")):
        systems[name] = pyml_command(args.model, port := free_port(), activations)
        urls[name] = f"http://127.0.0.1:{port}"
    if args.llama_server.is_file():
        systems["llama.cpp"] = llama_cpp_command(args.llama_server, args.model, port := free_port())
        urls["llama.cpp"] = f"http://127.0.0.1:{port}"
    results = {name: measure(name, command, urls[name], args.max_tokens, args.requests, args.repeats)
               for name, command in systems.items()}
    report = {"date": date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores", "model": args.model.name, "max_tokens": args.max_tokens,
              "llama_server": str(args.llama_server) if "llama.cpp" in results else None,
              "results": results}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "serve.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"Serving {report['model']} (the GGUF's weights as stored), {report['date']}, "
             f"{report['machine']}: greedy streamed chat requests of up to {args.max_tokens} tokens; "
             f"aggregate tokens/s (x its 1-stream figure), median time to first token; the median of "
             f"{args.repeats} rounds.", "",
             "| streams | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]
    for index, concurrency in enumerate(CONCURRENCY):
        cells = []
        for rounds in results.values():
            entry = rounds[index]
            cells.append(f"{entry['tokens_per_s']} tok/s ({entry['tokens_per_s'] / rounds[0]['tokens_per_s']:.1f}x), "
                         f"{entry['median_first_token_ms']:.0f} ms")
        lines.append(f"| {concurrency} | " + " | ".join(cells) + " |")
    if "llama.cpp" not in results:
        lines += ["", f"llama.cpp not run: no llama-server at {args.llama_server} (`make bench-serve` builds it)."]
    (RESULTS / "serve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
