"""What running `pyml serve` for others needs, as ASGI middleware and Prometheus metrics: an API
key, a limit on request bodies, the metrics, and an access log.

- `ApiKey`: with a key set (`--api-key` or PYML_API_KEY), every request but GET /health and the
  chat page (which asks for the key) needs the header `Authorization: Bearer KEY`; otherwise 401
  in OpenAI's error shape. The key is compared
  in constant time (hmac.compare_digest), so its prefix cannot be found from response times.
- `BodyLimit`: a body larger than the limit gets 413 before the server parses it (read up to the
  limit and no further, whether or not the client sent a Content-Length).
- `Metrics`: counters, gauges and histograms through prometheus-client, in its text format on GET
  /metrics (what Prometheus scrapes; vLLM's and llama.cpp's servers export the same quantities).
- `AccessLog`: a line on stderr per HTTP request once its answer is sent (`--access-log`).
"""

from __future__ import annotations

import hmac
import json
import sys
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# no key needed: what a load balancer probes, and the chat page (static; it asks for the key)
OPEN_PATHS = ("/health", "/")
# time to first token and per-token latency buckets (seconds): a CPU server's first token takes
# from tens of milliseconds (a short prompt) to minutes (a long prompt on an 8B model)
FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


async def send_error(send, status: int, message: str, kind: str) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ApiKey:
    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            return await send_error(send, 401, "a valid API key is needed: send the header "
                                    "'Authorization: Bearer KEY'", "authentication_error")
        return await self.app(scope, receive, send)


class BodyLimit:
    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = f"the request body exceeds {self.limit} bytes (the server's --max-body)"
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await send_error(send, 413, too_large, "invalid_request_error")
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.limit:
                return await send_error(send, 413, too_large, "invalid_request_error")
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(parts), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        return await self.app(scope, replay, send)


class Metrics:
    """The server's metrics, in a registry of their own (not the process-wide default, so that two
    servers in one process, as in tests, do not collide)."""

    def __init__(self, queue_length, active_sequences):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("pyml_requests", "HTTP requests answered, by path and status",
                                ["path", "status"], registry=registry)
        Gauge("pyml_queue_length", "Requests waiting for a place in the batch",
              registry=registry).set_function(queue_length)
        Gauge("pyml_active_sequences", "Sequences being decoded or prefilled",
              registry=registry).set_function(active_sequences)
        self.prompt_tokens = Counter("pyml_prompt_tokens", "Prompt tokens of the completed choices",
                                     registry=registry)
        self.cached_prompt_tokens = Counter("pyml_cached_prompt_tokens",
                                            "Prompt tokens taken from the prefix cache, not prefilled",
                                            registry=registry)
        self.generation_tokens = Counter("pyml_generation_tokens", "Tokens generated", registry=registry)
        self.first_token = Histogram("pyml_time_to_first_token_seconds",
                                     "From a choice's arrival to its first generated token",
                                     buckets=FIRST_TOKEN_BUCKETS, registry=registry)
        self.per_token = Histogram("pyml_time_per_output_token_seconds",
                                   "Between a choice's generated tokens", buckets=TOKEN_BUCKETS,
                                   registry=registry)
        self.request_seconds = Histogram("pyml_request_duration_seconds",
                                         "From a completion request's arrival to its last byte",
                                         buckets=REQUEST_BUCKETS, registry=registry)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class CountRequests:
    """Counts every HTTP request by path (one of `paths`, the server's own, or "other": a client
    probing paths cannot grow the metrics without bound) and status in `metrics`, and with `log`
    writes a line on stderr for it once its answer has been sent or abandoned, so that a streamed
    answer's time is the whole stream's (uvicorn's own access log writes its line when the answer
    starts)."""

    def __init__(self, app, metrics: Metrics, paths: set[str], log: bool):
        self.app, self.metrics, self.paths, self.log = app, metrics, paths, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), "-"

        async def send_noting_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            path = scope["path"] if scope["path"] in self.paths else "other"
            self.metrics.requests.labels(path, str(status)).inc()
            if self.log:
                print(f"pyml serve: {scope['method']} {scope['path']} {status} "
                      f"{time.perf_counter() - started:.3f} s", file=sys.stderr, flush=True)
