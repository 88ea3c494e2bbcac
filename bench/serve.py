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

Then, on each pyml server and llama-server (`--features`, on by default), what the server's
features cost or save:
- the time to first token of a chat's second turn (a long system prompt, a question, its answer,
  a new question), with the prefix cache (pyml's; llama-server's prompt cache, its default) and,
  for pyml, without it (`--no-prefix-cache`): the median of 3, each after its first turn;
- aggregate tokens/s of 4 streams asking for JSON of a schema (`response_format` json_schema),
  against the same 4 streams unconstrained;
- one stream's decode tokens/s (first token excluded) against `pyml generate`'s on the same folder
  and prompt.

Results go to bench/results/serve.{json,md} and serve_features.{json,md}.
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


SYSTEM = ("You are a careful assistant for a museum of maritime history. " * 24).strip()
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4}},
    "required": ["name", "age", "hobbies"], "additionalProperties": False}


def first_token_of(url: str, messages: list[dict], max_tokens: int = 1) -> tuple[float, str]:
    """(seconds to the first content chunk, the answer) of a streamed greedy chat request."""
    body = {"model": "m", "messages": messages, "stream": True, "max_tokens": max_tokens, "temperature": 0}
    sent, first, text = time.perf_counter(), None, []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"] if json.loads(line[6:])["choices"] else {}
            if delta.get("content"):
                first = first if first is not None else time.perf_counter() - sent
                text.append(delta["content"])
    return first if first is not None else time.perf_counter() - sent, "".join(text)


def second_turn_first_token(url: str) -> float:
    """The median time to first token of 3 chats' second turns, each after its first turn."""
    times = []
    for topic in ("lighthouses", "anchors", "sextants"):
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Tell me about {topic}."}]
        _, answer = first_token_of(url, first, 32)
        second = first + [{"role": "assistant", "content": answer},
                          {"role": "user", "content": "And who used them first?"}]
        times.append(first_token_of(url, second)[0])
    return statistics.median(times)


def structured_rate(url: str, schema: dict | None) -> float:
    """Aggregate tokens/s of 4 concurrent greedy chats asking for people, as JSON of `schema` or free."""
    tokens, lock = [0], threading.Lock()

    def ask(n: int) -> None:
        body = {"model": "m", "max_tokens": 96, "temperature": 0,
                "messages": [{"role": "user", "content": f"Describe person number {n} as JSON."}]}
        if schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()
        with lock:
            tokens[0] += reply["usage"]["completion_tokens"]

    started = time.perf_counter()
    threads = [threading.Thread(target=ask, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return round(tokens[0] / (time.perf_counter() - started), 1)


def one_stream_rate(url: str, max_tokens: int) -> float:
    """One greedy completion's decode tokens/s, its first token excluded."""
    body = {"model": "m", "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    first, count = None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    count = chunk["usage"]["completion_tokens"]
                elif first is None and chunk["choices"][0]["text"]:
                    first = time.perf_counter()
    return round((count - 1) / (time.perf_counter() - first), 1)


def generate_rate(model: Path, max_tokens: int) -> float:
    """`pyml generate`'s decode tokens/s on the same prompt (the figure it prints)."""
    run = subprocess.run([sys.executable, "-m", "pyml.cli", "generate", "--model", str(model), "--prompt",
                          "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "--max-new-tokens", str(max_tokens)],
                         capture_output=True, text=True, check=True)
    return float(run.stderr.split("decode: ")[1].split(" tokens at ")[1].split(" ")[0])


def features(name: str, command: list[str], url: str, model: Path) -> dict:
    """What the server's features cost or save (the module's docstring says how each is measured)."""
    process = started(command, url)
    try:
        first_token_of(url, [{"role": "user", "content": "Hi"}], 8)  # warm
        result = {"second_turn_first_token_ms": round(1000 * second_turn_first_token(url), 1),
                  "plain_4_streams_tokens_per_s": structured_rate(url, None)}
        if name != "llama.cpp":
            result["json_schema_4_streams_tokens_per_s"] = structured_rate(url, PERSON)
            result["one_stream_tokens_per_s"] = statistics.median(one_stream_rate(url, 200) for _ in range(3))
        print(name, json.dumps(result), flush=True)
        return result
    finally:
        process.terminate()
        process.wait(timeout=60)


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
    parser.add_argument("--features", action=argparse.BooleanOptionalAction, default=True,
                        help="the prefix cache, structured output and one stream (the docstring)")
    parser.add_argument("--concurrency", action=argparse.BooleanOptionalAction, default=True,
                        help="the rounds of 1 to 16 streams")
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
    feature_results = {}
    if args.features:
        uncached = pyml_command(args.model, port := free_port(), "f32") + ["--no-prefix-cache"]
        feature_results["pyml, no prefix cache"] = features("pyml, no prefix cache", uncached,
                                                            f"http://127.0.0.1:{port}", args.model)
        for name, command in systems.items():
            feature_results[name] = features(name, command, urls[name], args.model)
        feature_results["pyml generate"] = {"one_stream_tokens_per_s": statistics.median(
            generate_rate(args.model, 200) for _ in range(3))}
    results = ({name: measure(name, command, urls[name], args.max_tokens, args.requests, args.repeats)
                for name, command in systems.items()} if args.concurrency else {})
    stamp = {"date": date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} cores", "model": args.model.name,
             "llama_server": str(args.llama_server) if "llama.cpp" in systems else None}
    RESULTS.mkdir(parents=True, exist_ok=True)
    if results:
        report = stamp | {"max_tokens": args.max_tokens, "results": results}
        (RESULTS / "serve.json").write_text(json.dumps(report, indent=2) + "\n")
        lines = concurrency_table(report, results, args)
        (RESULTS / "serve.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    if feature_results:
        (RESULTS / "serve_features.json").write_text(json.dumps(stamp | {"features": feature_results}, indent=2) + "\n")
        lines = [f"The server's features on {stamp['model']}, {stamp['date']}, {stamp['machine']} "
                 "(bench/serve.py's docstring says how each is measured).", "",
                 "| system | " + " | ".join(FEATURES.values()) + " |", "|---|" + "---|" * len(FEATURES)]
        for name, entry in feature_results.items():
            lines.append(f"| {name} | " + " | ".join(str(entry.get(key, "")) for key in FEATURES) + " |")
        (RESULTS / "serve_features.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))


FEATURES = {"second_turn_first_token_ms": "second turn's first token, ms",
            "plain_4_streams_tokens_per_s": "4 streams, tok/s", "json_schema_4_streams_tokens_per_s":
            "4 streams of json_schema, tok/s", "one_stream_tokens_per_s": "one stream's decode, tok/s"}


def concurrency_table(report: dict, results: dict, args) -> list[str]:
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
    return lines


if __name__ == "__main__":
    main()
