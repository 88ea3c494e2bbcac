"""`pyml serve`: the OpenAI chat-completions API over a model folder, on FastAPI and uvicorn.

FastAPI (on Starlette) and uvicorn are what most Python model servers run on: request bodies are
validated by Pydantic models, which pyml's specs already use, server-sent events are a streaming
response, and uvicorn finishes in-flight requests on SIGTERM before it exits.

Endpoints: POST /v1/chat/completions and /v1/completions (streamed as server-sent events in
OpenAI's chunk format, ending with `data: [DONE]`, or whole), GET /v1/models and GET /health; and
GET /, a chat page (chat_page.html: one static file, no build step) that streams its answers from
/v1/chat/completions.

Continuous batching: one worker thread decodes up to `--max-sequences` requests at once, one
token each per step of the fused decode step (pyml.generate.quantized.DecodingBatch), which reads
each weight row once for all of them. A request joins the batch at the next token boundary once a
sequence's row is free; its prompt is prefilled in the same steps, `--prefill-chunk` tokens per
step, so a long prompt does not hold the others for its whole prefill; it leaves the batch when it
ends or its client disconnects.
Beyond the batch, requests wait in a queue of `--max-queue`; beyond that a request gets HTTP 429.
Answers do not depend on the load: the step computes each sequence as it would alone, bit for
bit, and each request samples from its own seeded generator.

On stderr the server says where it listens once it does, and writes one line per request when its
answer ends (a streamed one included): method, path, status and seconds (`AccessLog`).
"""

from __future__ import annotations

import asyncio
from importlib import resources
import json
import queue
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from pyml.errors import PymlError
from pyml.formats.chat_template import ChatTemplate
from pyml.generate import decoding
from pyml.generate.quantized import PREFILL_CHUNK, DecodingBatch, QuantizedDecoder


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """The request fields every completion takes. Unknown fields are ignored, as OpenAI's server
    ignores fields it does not use; a sampling option pyml does not implement is refused."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # not OpenAI's: vLLM's and llama.cpp's servers take these too
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(Sampling):
    prompt: str = Field(min_length=1)


DRAIN_SECONDS = 30  # how long a SIGTERM waits for the requests in flight
# positions per sequence unless --context says: each sequence's keys and values are allocated up
# front (SmolLM2: 94 MiB per sequence at 2048)
DEFAULT_CONTEXT = 2048
# request fields pyml does not implement yet: refused (400) rather than ignored, since a client that
# sends one relies on it (a JSON answer, the prompt echoed with its log-probabilities)
UNSUPPORTED = ("logprobs", "top_logprobs", "tools", "tool_choice", "functions", "function_call",
               "logit_bias", "echo", "response_format")


@dataclass
class Job:
    """One request's decoding: the worker fills `events` with ("text", delta) and finally
    ("done", finish_reason, completion tokens); `cancelled` stops it at the next token."""

    prompt_ids: list[int]
    max_tokens: int
    sampler: decoding.Sampler
    seed: int
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass
class Sequence:
    """A job in the running batch: its row of the batch's caches, its generator, its tokens, their
    text and how many characters of it were sent."""

    job: Job
    row: int
    rng: np.random.Generator
    text: decoding.IncrementalText
    new_ids: list[int] = field(default_factory=list)
    sent: int = 0


class Engine:
    """The model, its tokenizer and template, and the worker thread that decodes the queued jobs
    in one batch of up to `max_sequences`, each of up to `context` positions, prefilling prompts
    `prefill_chunk` tokens per step."""

    def __init__(self, model_dir: Path, decoder, name: str, max_queue: int, max_sequences: int,
                 context: int, prefill_chunk: int):
        self.name = name
        self.tokenizer = decoding.load_tokenizer(model_dir)
        self.template = ChatTemplate.of_folder(model_dir)
        self.eos = decoding.eos_ids(model_dir)
        self.batch = DecodingBatch(decoder, max_sequences, context, prefill_chunk)
        self.jobs: queue.Queue[Job] = queue.Queue(max_queue)
        self.running: dict[int, Sequence] = {}  # by row, those whose prompt is being prefilled too
        self.steps = 0  # decoding steps run: fewer than the tokens drawn when sequences share them
        self.warm_up()
        self.worker = threading.Thread(target=self.run, name="pyml-decoder", daemon=True)
        self.worker.start()

    def warm_up(self) -> None:
        """One step on a throwaway one-token prompt, so that the step is compiled (Numba, where
        its cache is cold: seconds) before /health answers, not while the first request waits.
        The row's cache positions are overwritten by the next sequence before it reads them."""
        row = self.batch.add([0])
        self.batch.step({})
        self.batch.release(row)

    @property
    def active(self) -> int:
        return len(self.running)

    def run(self) -> None:
        while True:
            try:
                self.admit()
                for sequence in [s for s in self.running.values() if s.job.cancelled.is_set()]:
                    self.leave(sequence)
                # one step: the next token of each sequence that has one, a chunk of the prompts
                decoding = {row: s.new_ids[-1] for row, s in self.running.items() if s.new_ids}
                for row, logits in self.batch.step(decoding).items():
                    self.advance(self.running[row], logits)
                self.steps += 1
            except Exception as error:  # a bug must not kill the worker: the running requests fail
                for sequence in list(self.running.values()):
                    sequence.job.emit("error", str(error))
                    self.leave(sequence)

    def admit(self) -> None:
        """Take queued jobs into the free rows (waiting for one when nothing runs); their prompts
        are prefilled by the next steps, and each one's first token drawn from its prompt's logits."""
        while self.batch.free:
            try:
                job = self.jobs.get(block=not self.running)
            except queue.Empty:
                return
            if job.cancelled.is_set():
                continue
            try:
                row = self.batch.add(job.prompt_ids)
            except Exception as error:
                job.emit("error", str(error))
                continue
            self.running[row] = Sequence(job, row, np.random.default_rng(job.seed),
                                         decoding.IncrementalText(self.tokenizer))

    def advance(self, sequence: Sequence, logits: np.ndarray) -> None:
        """Draw the sequence's next token from `logits` and send the text that can no longer be
        part of a stop string; end it at an end-of-turn token, a stop string (left out of the
        text) or max_tokens (the context's end included)."""
        job, new_ids = sequence.job, sequence.new_ids
        token = job.sampler.next_token(logits, sequence.rng, job.prompt_ids, new_ids)
        new_ids.append(token)
        text = sequence.text.add(token)  # an end-of-turn token decodes to nothing
        cut = first_stop(text, job.stops)
        if token in self.eos or cut is not None or len(new_ids) == job.max_tokens:
            end = len(text) if cut is None else cut
            if end > sequence.sent:
                job.emit("text", text[sequence.sent:end])
            job.emit("done", "stop" if token in self.eos or cut is not None else "length", len(new_ids))
            self.leave(sequence)
            return
        ready = len(text) - held_back(text, job.stops)
        if ready > sequence.sent:
            job.emit("text", text[sequence.sent:ready])
            sequence.sent = ready

    def leave(self, sequence: Sequence) -> None:
        del self.running[sequence.row]
        self.batch.release(sequence.row)


def first_stop(text: str, stops: list[str]) -> int | None:
    """Where the first stop string found in `text` begins, or None."""
    found = [index for index in (text.find(stop) for stop in stops) if index >= 0]
    return min(found) if found else None


def held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` must wait: a character still being decoded
    (U+FFFD of an incomplete UTF-8 sequence), or the longest end that begins a stop string."""
    if text.endswith("\ufffd"):
        return 1
    return max((size for stop in stops for size in range(1, len(stop)) if text.endswith(stop[:size])),
               default=0)


def error_response(status: int, message: str, param: str | None = None,
                   kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status)


def create_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="pyml", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"] if part != "body") or "body"
        return error_response(400, f"{where}: {first['msg']}", where)

    page = resources.files("pyml.generate").joinpath("chat_page.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def chat_page() -> str:
        return page

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "active": engine.active, "queued": engine.jobs.qsize(),
                "max_sequences": engine.batch.capacity, "context": engine.batch.max_len,
                "steps": engine.steps}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": engine.name, "object": "model", "created": 0, "owned_by": "pyml"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatRequest):
        if engine.template is None:
            return error_response(400, f"{engine.name} has no chat template: use /v1/completions",
                                  "messages")
        text = engine.template.render([m.model_dump() for m in body.messages], add_generation_prompt=True)
        ids = engine.tokenizer.encode(text, add_special_tokens=False).ids
        return await complete(request, body, ids, "messages", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await complete(request, body, engine.tokenizer.encode(body.prompt).ids, "prompt",
                              chat=False)

    async def complete(request: Request, body: Sampling, ids: list[int], field_name: str, chat: bool):
        raw = await request.json()
        unsupported = [name for name in UNSUPPORTED if raw.get(name) not in (None, False)
                       and not (name == "response_format" and raw[name] == {"type": "text"})]
        if unsupported:
            return error_response(400, f"{unsupported[0]} is not supported by pyml serve yet",
                                  unsupported[0])
        room = engine.batch.max_len - len(ids)
        if room < 1:
            return error_response(400, f"{field_name}: the prompt has {len(ids)} tokens; the "
                                  f"context holds {engine.batch.max_len}", field_name)
        asked = body.max_completion_tokens or body.max_tokens
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not stop for stop in stops) or len(stops) > 4:
            return error_response(400, "stop: up to 4 non-empty strings", "stop")
        sampler = decoding.Sampler(body.temperature, body.top_p, body.top_k, body.min_p,
                                   body.repetition_penalty, body.frequency_penalty, body.presence_penalty)
        job = Job(ids, min(asked or room, room), sampler,
                  body.seed if body.seed is not None else int(time.time_ns() % 2**32), stops,
                  asyncio.get_running_loop())
        try:
            engine.jobs.put_nowait(job)
        except queue.Full:
            return error_response(429, "the server is busy: every queue place is taken; retry later",
                                  kind="rate_limit_exceeded")
        reply = Reply(engine.name, chat, len(ids))
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream(job, reply, include_usage), media_type="text/event-stream")
        parts, finish, completion_tokens = [], "length", 0
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), 0.5)
            except TimeoutError:
                if await request.is_disconnected():  # nobody waits for the answer any more
                    job.cancelled.set()
                    return error_response(499, "the client closed the request")
                continue
            if event[0] == "text":
                parts.append(event[1])
            elif event[0] == "error":
                return error_response(500, event[1], kind="server_error")
            else:
                finish, completion_tokens = event[1], event[2]
                break
        return reply.whole("".join(parts), finish, completion_tokens)

    async def stream(job: Job, reply: Reply, include_usage: bool):
        try:
            if reply.chat:
                yield sse(reply.chunk({"role": "assistant", "content": ""}, None))
            while True:
                event = await job.events.get()
                if event[0] == "text":
                    if event[1]:
                        yield sse(reply.chunk(event[1], None))
                elif event[0] == "error":
                    yield sse({"error": {"message": event[1], "type": "server_error"}})
                    break
                else:
                    yield sse(reply.chunk("", event[1], final=True))
                    if include_usage:
                        yield sse(reply.usage_chunk(event[2]))
                    break
            yield "data: [DONE]\n\n"
        finally:  # the client left, or the answer is whole: the worker stops at its next token
            job.cancelled.set()

    return app


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


@dataclass
class Reply:
    """The response objects of one request, in OpenAI's shapes."""

    model: str
    chat: bool
    prompt_tokens: int
    id: str = field(default_factory=lambda: f"pyml-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def whole(self, text: str, finish: str, completion_tokens: int) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": self.usage(completion_tokens)}

    def chunk(self, content, finish: str | None, final: bool = False) -> dict:
        if self.chat:
            delta = {} if final else content if isinstance(content, dict) else {"content": content}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": content, "finish_reason": finish, "logprobs": None}
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}

    def usage_chunk(self, completion_tokens: int) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [],
                "usage": self.usage(completion_tokens)}


class AccessLog:
    """ASGI middleware: one line on stderr per HTTP request, when its answer has been sent or
    abandoned, so that a streamed answer's time is the whole stream's (uvicorn's own access log
    writes its line when the answer starts, without a time)."""

    def __init__(self, app):
        self.app = app

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
            print(f"pyml serve: {scope['method']} {scope['path']} {status} "
                  f"{time.perf_counter() - started:.3f} s", file=sys.stderr, flush=True)


def announcing_server(config, engine: Engine, decoder: QuantizedDecoder):
    """A uvicorn server that says on stderr where it listens once its sockets are bound (the port
    it got, when asked for port 0)."""
    import uvicorn

    class AnnouncingServer(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if not self.should_exit:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
                print(f"pyml serve: {url}/v1 ready (model {engine.name}, weights "
                      f"{decoder.describe_formats()}, {engine.batch.capacity} sequences of "
                      f"{engine.batch.max_len} positions; chat page {url}/)", file=sys.stderr,
                      flush=True)

    return AnnouncingServer(config)


def serve(model_dir: Path, host: str, port: int, max_queue: int, adapter: Path | None = None,
          weights: str = "as-stored", activations: str = "f32", max_sequences: int = 8,
          context: int | None = None, prefill_chunk: int = PREFILL_CHUNK) -> None:
    """Load the folder's model and serve it until SIGTERM or Ctrl-C: new connections are refused,
    the requests in flight get DRAIN_SECONDS to finish, and a SIGTERM exits with status 0.
    `context` (positions per sequence) defaults to the model's max_seq_len, at most DEFAULT_CONTEXT."""
    import uvicorn

    for option, value in (("--max-queue", max_queue), ("--max-sequences", max_sequences),
                          ("--context", context), ("--prefill-chunk", prefill_chunk)):
        if value is not None and value < 1:
            raise PymlError(f"{option} must be at least 1, not {value}")
    model_dir = Path(model_dir)
    decoder = decoding.load_decoder(model_dir, weights=weights, adapter=adapter, activations=activations)
    if not isinstance(decoder, QuantizedDecoder):  # float32 weights: the fused step on float rows
        decoder = QuantizedDecoder.of_model(decoder)
    max_seq_len = decoder.model.MAX_SEQ_LEN
    if context is not None and context > max_seq_len:
        raise PymlError(f"--context {context} exceeds the model's max_seq_len {max_seq_len}")
    engine = Engine(model_dir, decoder, model_dir.resolve().name, max_queue, max_sequences,
                    context or min(max_seq_len, DEFAULT_CONTEXT), prefill_chunk)
    # uvicorn drains on SIGTERM, then raises the signal again under the handler it found: this one
    # lets the drained server return, so a SIGTERM ends it with status 0
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    config = uvicorn.Config(AccessLog(create_app(engine)), host=host, port=port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=DRAIN_SECONDS)
    announcing_server(config, engine, decoder).run()
