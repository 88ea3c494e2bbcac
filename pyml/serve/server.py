"""`pyml serve`: the OpenAI chat-completions and completions APIs over a model folder, on FastAPI
and uvicorn.

FastAPI (on Starlette) and uvicorn are what most Python model servers run on: request bodies are
validated by Pydantic models, which pyml's specs already use, server-sent events are a streaming
response, and uvicorn finishes in-flight requests on SIGTERM before it exits.

Endpoints: POST /v1/chat/completions and /v1/completions (streamed as server-sent events in
OpenAI's chunk format, ending with `data: [DONE]`, or whole), GET /v1/models; POST /tokenize,
POST /detokenize and GET /tokenizer_info in vLLM's shapes (evaluation harnesses probe for them);
GET /metrics (Prometheus), GET /health; and GET /, a chat page (chat_page.html: one static file,
no build step) that streams its answers from /v1/chat/completions.

A completions `prompt` is a string, a list of strings, a list of token ids or a list of such lists:
one choice per prompt (times `n`), in order. `echo` puts the prompt before the answer, and
`logprobs` gives every token's log-probability (pyml.serve.logprobs), an echoed prompt's
included: its positions are scored in the same steps that prefill it. `n` choices of one prompt
are sampled with seeds seed, seed + 1, ...: each choice is the answer of a request with its seed.

Continuous batching: one worker thread decodes up to `--max-sequences` choices at once, one
token each per step of the fused decode step (pyml.generate.quantized.DecodingBatch), which reads
each weight row once for all of them. A choice joins the batch at the next token boundary once a
sequence's row is free; its prompt is prefilled in the same steps, `--prefill-chunk` tokens per
step, so a long prompt does not hold the others for its whole prefill; it leaves the batch when it
ends or its client disconnects. A prompt that begins with what a free row last held (a chat's
earlier turns, a shared system prompt) is prefilled from there on (the prefix cache; `--no-prefix-cache`).
Beyond the batch, choices wait in a queue of `--max-queue`; beyond that a request gets HTTP 429.
Answers do not depend on the load: the step computes each sequence as it would alone, bit for
bit, a cached prefix's keys and values are those bits, and each choice samples from its own
seeded generator.

On stderr the server says where it listens once it does, and writes one line per completion
request when its answer ends: its id, tokens and times (with `--access-log`, one line per HTTP
request too).
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from pyml.errors import PymlError
from pyml.formats.chat_template import ChatTemplate
from pyml.generate import decoding
from pyml.serve.constrained import Grammars, Matcher, gbnf_grammar, response_format_grammar
from pyml.serve.logprobs import (
    MAX_TOP_LOGPROBS,
    TokenLogprob,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    token_logprob,
)
from pyml.serve.operations import ApiKey, BodyLimit, CountRequests, Metrics
from pyml.generate.quantized import PREFILL_CHUNK, DecodingBatch, QuantizedDecoder
from pyml.serve.tools import (
    ChatMessage,
    Tool,
    ToolCallStream,
    ToolFields,
    ToolSyntax,
    parse_tool_calls,
    template_tools,
    tool_call_grammar,
    tool_syntax,
)


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """The request fields every completion takes. Unknown fields are ignored, as OpenAI's server
    ignores fields it does not use; a sampling option pyml does not implement is refused."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0: the prompt alone, with echo
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
    n: int = Field(1, ge=1)
    response_format: dict | None = None  # OpenAI's text, json_object or json_schema
    grammar: str | None = None  # not OpenAI's: llama.cpp's server takes a GBNF grammar here


class ChatRequest(Sampling, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionRequest(Sampling):
    # a string, strings, token ids, or lists of token ids: one choice (times n) per prompt
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered by the template first."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


DRAIN_SECONDS = 30  # how long a SIGTERM waits for the requests in flight
# positions per sequence unless --context says: each sequence's keys and values are allocated up
# front (SmolLM2: 94 MiB per sequence at 2048)
DEFAULT_CONTEXT = 2048
DEFAULT_MAX_BODY = 8 * 2**20  # bytes: a prompt of a model's whole context is far less
# request fields pyml does not implement yet: refused (400) rather than ignored, since a client that
# sends one relies on it (a JSON answer, the prompt echoed with its log-probabilities)
UNSUPPORTED = ("functions", "function_call", "logit_bias", "suffix")


@dataclass
class Job:
    """One choice's decoding: the worker puts (index, event...) in the request's `events`:
    ("prompt", its echoed prompt's TokenLogprobs), ("text", delta, the TokenLogprobs of its
    tokens), and finally ("done", finish_reason, completion tokens, cached prompt tokens) or
    ("error", message); the request's `cancelled` stops it at the next token."""

    index: int  # the choice's
    prompt_ids: list[int]
    max_tokens: int
    sampler: decoding.Sampler
    seed: int
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: threading.Event
    logprobs: int | None = None  # each answer token's and its top-N's; None: none
    prompt_logprobs: int | None = None  # the same of every prompt token's (echo)
    grammar: str | None = None  # what the answer must be (pyml.serve.constrained)
    arrived: float = field(default_factory=time.perf_counter)

    def emit(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, *event))


@dataclass
class Sequence:
    """A job in the running batch: its row of the batch's caches, its generator, its tokens, their
    text, how many characters of it were sent, and the log-probabilities not yet sent with it
    ((where the token's text starts, its TokenLogprob))."""

    job: Job
    row: int
    rng: np.random.Generator
    text: decoding.IncrementalText
    cached: int  # prompt tokens the prefix cache held
    new_ids: list[int] = field(default_factory=list)
    sent: int = 0
    length: int = 0  # of the text so far
    pending: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)
    prompt_entries: list[TokenLogprob] = field(default_factory=list)
    last_token: float = 0.0
    matcher: Matcher | None = None  # the job's grammar's, as far as its tokens go


class Engine:
    """The model, its tokenizer and template, and the worker thread that decodes the queued jobs
    in one batch of up to `max_sequences`, each of up to `context` positions, prefilling prompts
    `prefill_chunk` tokens per step."""

    def __init__(self, model_dir: Path, decoder, name: str, max_queue: int, max_sequences: int,
                 context: int, prefill_chunk: int, prefix_cache: bool = True):
        self.name, self.model_dir = name, model_dir
        self.tokenizer = decoding.load_tokenizer(model_dir)
        self.texts = TokenTexts(self.tokenizer)
        self.template = ChatTemplate.of_folder(model_dir)
        self.eos = decoding.eos_ids(model_dir)
        self.vocab = decoder.model.VOCAB
        self.batch = DecodingBatch(decoder, max_sequences, context, prefill_chunk, prefix_cache)
        self.jobs: queue.Queue[Job] = queue.Queue(max_queue)
        self.running: dict[int, Sequence] = {}  # by row, those whose prompt is being prefilled too
        self.steps = 0  # decoding steps run: fewer than the tokens drawn when sequences share them
        self.metrics = Metrics(self.jobs.qsize, lambda: len(self.running))
        # the vocabulary as the grammar engine sees it (Gemma 3's: 2 s), for structured answers
        self.grammars = (Grammars((model_dir / "tokenizer.json").read_text(encoding="utf-8"), self.vocab,
                                  sorted(self.eos)) if self.eos else None)
        # the worker thread runs every step, the first (warm_up) included: Numba's parallel loops
        # run on libgomp's team of the thread that starts them, and a thread that starts them after
        # the main thread's team exists ran the step at half speed here (SmolLM2: 70 steps/s
        # against 125)
        warmed: queue.Queue = queue.Queue()
        self.worker = threading.Thread(target=self.run, args=(warmed,), name="pyml-decoder", daemon=True)
        self.worker.start()
        failure = warmed.get()
        if failure is not None:
            raise failure

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

    def run(self, warmed: queue.Queue) -> None:
        """The worker: the warm-up step (`warmed` gets None, or the error it raised), then the
        batch's steps for as long as the server runs."""
        try:
            self.warm_up()
        except Exception as error:
            warmed.put(error)
            return
        warmed.put(None)
        while True:
            try:
                self.admit()
                for sequence in [s for s in self.running.values() if s.job.cancelled.is_set()]:
                    self.leave(sequence)
                # one step: the next token of each sequence that has one, a chunk of the prompts
                decoding = {row: s.new_ids[-1] for row, s in self.running.items() if s.new_ids}
                prompt_logits: dict = {}
                drawn = self.batch.step(decoding, prompt_logits)
                for row, (positions, logits) in prompt_logits.items():
                    self.score_prompt(self.running[row], positions, logits)
                for row, logits in drawn.items():
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
                row = self.batch.add(job.prompt_ids, score_prompt=job.prompt_logprobs is not None)
            except Exception as error:
                job.emit("error", str(error))
                continue
            self.running[row] = Sequence(job, row, np.random.default_rng(job.seed),
                                         decoding.IncrementalText(self.tokenizer), int(self.batch.lengths[row]),
                                         matcher=None if job.grammar is None else self.grammars.matcher(job.grammar))

    def score_prompt(self, sequence: Sequence, positions: list[int], logits: list[np.ndarray]) -> None:
        """The log-probabilities of the prompt tokens that `logits` (at `positions`) predict."""
        prompt, top = sequence.job.prompt_ids, sequence.job.prompt_logprobs
        sequence.prompt_entries += [token_logprob(row, prompt[position + 1], top)
                                    for position, row in zip(positions, logits)]

    def advance(self, sequence: Sequence, logits: np.ndarray) -> None:
        """Draw the sequence's next token from `logits` and send the text that can no longer be
        part of a stop string; end it at an end-of-turn token, a stop string (left out of the
        text) or max_tokens (the context's end included)."""
        job, new_ids = sequence.job, sequence.new_ids
        now = time.perf_counter()
        if not new_ids and job.prompt_logprobs is not None:  # the prompt is whole: its own first
            first = TokenLogprob(job.prompt_ids[0], None, ())
            job.emit("prompt", [first, *sequence.prompt_entries])
        if job.max_tokens == 0:  # the prompt alone (echo)
            job.emit("done", "length", 0, sequence.cached)
            self.leave(sequence)
            return
        allowed = logits
        if sequence.matcher is not None:  # the tokens the grammar forbids next cannot be drawn
            allowed = logits.copy()
            sequence.matcher.mask(allowed)
        token = job.sampler.next_token(allowed, sequence.rng, job.prompt_ids, new_ids)
        if sequence.matcher is not None and token not in self.eos:
            sequence.matcher.accept(token)
        self.metrics.generation_tokens.inc()
        if new_ids:
            self.metrics.per_token.observe(now - sequence.last_token)
        else:
            self.metrics.first_token.observe(now - job.arrived)
        sequence.last_token = now
        new_ids.append(token)
        entry = None if job.logprobs is None else token_logprob(logits, token, job.logprobs)
        sequence.pending.append((sequence.length, entry))
        text = sequence.text.add(token)  # an end-of-turn token decodes to nothing
        sequence.length = len(text)
        cut = first_stop(text, job.stops)
        # a grammar that is complete allows nothing but the end: the answer ends, its end token
        # not drawn (it adds no text)
        complete = sequence.matcher is not None and sequence.matcher.done
        if token in self.eos or cut is not None or complete or len(new_ids) == job.max_tokens:
            end = len(text) if cut is None else cut
            # the tokens of the text sent: those that begin before its end, and on a length
            # finish the last ones even if they add no character yet
            sent = [entry for start, entry in sequence.pending if entry is not None
                    and (start < end or (cut is None and token not in self.eos))]
            job.emit("text", text[sequence.sent:end] if end > sequence.sent else "", sent)
            stopped = token in self.eos or cut is not None or complete
            job.emit("done", "stop" if stopped else "length", len(new_ids), sequence.cached)
            self.leave(sequence)
            return
        ready = len(text) - held_back(text, job.stops)
        if ready > sequence.sent:
            count = sum(start < ready for start, _ in sequence.pending)
            sent = [entry for _, entry in sequence.pending[:count] if entry is not None]
            sequence.pending = sequence.pending[count:]
            job.emit("text", text[sequence.sent:ready], sent)
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


class RequestError(Exception):
    """A request the server refuses: (HTTP status, message, the field)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


@dataclass
class Prompt:
    """One prompt of a request: its token ids and its text (what echo puts before the answer)."""

    ids: list[int]
    text: str


def completion_prompts(engine: Engine, prompt) -> list[Prompt]:
    """The prompts of a completions request's `prompt` field, in order."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise RequestError(400, "prompt: give at least one prompt", "prompt")
    prompts = []
    for index, one in enumerate(prompt):
        where = "prompt" if len(prompt) == 1 else f"prompt.{index}"
        if not one:
            raise RequestError(400, f"{where}: the prompt is empty", where)
        if isinstance(one, str):
            prompts.append(Prompt(engine.tokenizer.encode(one).ids, one))
            continue
        outside = [token for token in one if not 0 <= token < engine.vocab]
        if outside:
            raise RequestError(400, f"{where}: token {outside[0]} is not in the vocabulary "
                               f"(0 to {engine.vocab - 1})", where)
        prompts.append(Prompt(list(one), engine.tokenizer.decode(one, skip_special_tokens=False)))
    return prompts


@dataclass
class Choice:
    """What a request has received of one choice so far."""

    text: list[str] = field(default_factory=list)
    prompt: list[TokenLogprob] = field(default_factory=list)
    tokens: list[TokenLogprob] = field(default_factory=list)
    finish: str | None = None
    completion_tokens: int = 0
    cached: int = 0


class Completion:
    """One completion request in flight: its choices' jobs, in the queue or the batch, and what
    they have sent."""

    def __init__(self, engine: Engine, body: Sampling, prompts: list[Prompt], chat: bool,
                 logprobs: int | None, echo: bool, server_max_tokens: int | None, grammar: str | None,
                 tool_calls: ToolSyntax | None = None):
        self.engine, self.chat, self.prompts, self.echo = engine, chat, prompts, echo
        self.logprobs = logprobs
        self.tool_calls = tool_calls  # the syntax the answers' tool calls are read in, if any
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.started = time.perf_counter()
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        name = "messages" if chat else "prompt"
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not stop for stop in stops) or len(stops) > 4:
            raise RequestError(400, "stop: up to 4 non-empty strings", "stop")
        asked = body.max_completion_tokens or body.max_tokens
        if asked == 0 and not echo:
            raise RequestError(400, "max_tokens: 0 asks for no answer: it is for echo's scoring of "
                               "the prompt alone", "max_tokens")
        if server_max_tokens is not None and asked is not None and asked > server_max_tokens:
            raise RequestError(400, f"max_tokens: at most {server_max_tokens} (the server's "
                               "--max-tokens)", "max_tokens")
        sampler = decoding.Sampler(body.temperature, body.top_p, body.top_k, body.min_p,
                                   body.repetition_penalty, body.frequency_penalty, body.presence_penalty)
        seed = body.seed if body.seed is not None else int(time.time_ns() % 2**32)
        loop = asyncio.get_running_loop()
        self.jobs = []
        for number, prompt in enumerate(prompts):
            ids = prompt.ids
            room = engine.batch.max_len - len(ids)
            if room < 1:
                raise RequestError(400, f"{name}: the prompt has {len(ids)} tokens; the "
                                   f"context holds {engine.batch.max_len}", name)
            limit = room if server_max_tokens is None else min(room, server_max_tokens)
            for sample in range(body.n):
                self.jobs.append(Job(number * body.n + sample, ids, min(limit if asked is None else asked, room),
                                     sampler, (seed + sample) % 2**64, stops, loop, self.events,
                                     self.cancelled, logprobs, logprobs if echo and logprobs is not None else None,
                                     grammar))
        self.choices = [Choice() for _ in self.jobs]
        if len(self.jobs) > engine.jobs.maxsize:
            raise RequestError(400, f"n: {len(self.jobs)} choices; the server queues at most "
                               f"{engine.jobs.maxsize} (its --max-queue)", "n")

    def queue(self) -> None:
        """Queue every choice, or none (429)."""
        if self.engine.jobs.maxsize - self.engine.jobs.qsize() < len(self.jobs):
            raise RequestError(429, "the server is busy: every queue place is taken; retry later")
        for job in self.jobs:
            self.engine.jobs.put_nowait(job)  # only this thread puts: the room checked is there

    async def events_until_done(self, request: Request | None):
        """(index, event...) as the choices send them, until every choice is done; None and stop
        when the client has gone (checked every half second while nothing comes)."""
        left = len(self.jobs)
        while left:
            try:
                event = await asyncio.wait_for(self.events.get(), 0.5)
            except TimeoutError:
                if request is not None and await request.is_disconnected():
                    yield None
                    return
                continue
            choice = self.choices[event[0]]
            if event[1] == "text":
                choice.text.append(event[2])
                choice.tokens += event[3]
            elif event[1] == "prompt":
                choice.prompt = event[2]
            elif event[1] == "done":
                choice.finish, choice.completion_tokens, choice.cached = event[2], event[3], event[4]
                left -= 1
            yield event
            if event[1] == "error":
                return

    def usage(self) -> dict:
        """OpenAI's usage: each prompt counted once, however many choices it has; its cached
        tokens, the most the prefix cache held for any of its choices."""
        n = len(self.jobs) // len(self.prompts)
        prompt_tokens = sum(len(prompt.ids) for prompt in self.prompts)
        cached = sum(max(choice.cached for choice in self.choices[start:start + n])
                     for start in range(0, len(self.choices), n))
        completion_tokens = sum(choice.completion_tokens for choice in self.choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def prompt_of(self, index: int) -> Prompt:
        return self.prompts[index // (len(self.jobs) // len(self.prompts))]

    def logprobs_of(self, index: int, prompt: list[TokenLogprob], tokens: list[TokenLogprob],
                    offset: int) -> dict | None:
        if self.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(tokens, self.engine.texts)
        return completion_logprobs(prompt + tokens, self.engine.texts, offset)

    def whole(self) -> dict:
        choices = []
        for index, choice in enumerate(self.choices):
            text = "".join(choice.text)
            logprobs = self.logprobs_of(index, choice.prompt, choice.tokens, 0)
            if self.chat:
                message, finish = {"role": "assistant", "content": text}, choice.finish
                if self.tool_calls is not None:
                    message["content"], calls = parse_tool_calls(self.tool_calls, text)
                    if calls:
                        message["tool_calls"] = calls
                        finish = "tool_calls" if finish == "stop" else finish
                choices.append({"index": index, "message": message, "finish_reason": finish,
                                "logprobs": logprobs})
            else:
                echoed = self.prompt_of(index).text if self.echo else ""
                choices.append({"index": index, "text": echoed + text, "finish_reason": choice.finish,
                                "logprobs": logprobs})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.engine.name, "choices": choices,
                "usage": self.usage()}

    def chunk(self, index: int, content, finish: str | None = None, logprobs: dict | None = None,
              final: bool = False) -> dict:
        if self.chat:
            delta = {} if final else content if isinstance(content, dict) else {"content": content}
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": content, "finish_reason": finish, "logprobs": logprobs}
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.engine.name, "choices": [choice]}

    def usage_chunk(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.engine.name, "choices": [],
                "usage": self.usage()}

    async def stream(self, include_usage: bool):
        sent_chars = [0] * len(self.jobs)  # characters of each choice's text sent, an echo's included
        # each choice's tool calls, read from its text as it comes
        calls = [None if self.tool_calls is None else ToolCallStream.of(self.tool_calls) for _ in self.jobs]
        try:
            for index in range(len(self.jobs)):
                if self.chat:
                    yield sse(self.chunk(index, {"role": "assistant", "content": ""}))
                elif self.echo and self.logprobs is None:
                    text = self.prompt_of(index).text
                    yield sse(self.chunk(index, text))
                    sent_chars[index] = len(text)
            async for event in self.events_until_done(None):
                index, kind = event[0], event[1]
                if kind == "prompt":  # the echoed prompt with its log-probabilities
                    text = self.prompt_of(index).text
                    yield sse(self.chunk(index, text, logprobs=self.logprobs_of(index, event[2], [], 0)))
                    sent_chars[index] = len(text)
                elif kind == "text":
                    if event[2] or event[3]:
                        logprobs = self.logprobs_of(index, [], event[3], sent_chars[index])
                        if calls[index] is None:
                            yield sse(self.chunk(index, event[2], logprobs=logprobs))
                        else:  # deltas of content and of whole calls; the logprobs with the first
                            for delta in calls[index].feed(event[2]) or [{}]:
                                yield sse(self.chunk(index, delta, logprobs=logprobs))
                                logprobs = None
                        sent_chars[index] += len(event[2])
                elif kind == "error":
                    yield sse({"error": {"message": event[2], "type": "server_error"}})
                    break
                else:
                    finish = event[2]
                    if calls[index] is not None:
                        for delta in calls[index].finish():
                            yield sse(self.chunk(index, delta))
                        finish = calls[index].finish_reason(finish)
                    yield sse(self.chunk(index, "", finish, final=True))
            else:
                if include_usage:
                    yield sse(self.usage_chunk())
                self.log(200)
            yield "data: [DONE]\n\n"
        finally:  # the client left, or the answer is whole: the worker stops at its next token
            self.cancelled.set()

    def log(self, status: int) -> None:
        """The request's line on stderr, and its tokens in the metrics."""
        usage = self.usage()
        seconds = time.perf_counter() - self.started
        metrics = self.engine.metrics
        metrics.prompt_tokens.inc(usage["prompt_tokens"])
        metrics.cached_prompt_tokens.inc(usage["prompt_tokens_details"]["cached_tokens"])
        metrics.request_seconds.observe(seconds)
        print(f"pyml serve: {self.id} {status}: {len(self.jobs)} choice{'s' * (len(self.jobs) > 1)}, "
              f"prompt {usage['prompt_tokens']} tokens ({usage['prompt_tokens_details']['cached_tokens']} "
              f"cached), answer {usage['completion_tokens']} tokens, {seconds:.3f} s",
              file=sys.stderr, flush=True)


def create_app(engine: Engine, max_tokens: int | None = None) -> FastAPI:
    app = FastAPI(title="pyml", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"] if part != "body") or "body"
        return error_response(400, f"{where}: {first['msg']}", where)

    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError) -> JSONResponse:
        kind = "rate_limit_exceeded" if error.status == 429 else "invalid_request_error"
        return error_response(error.status, str(error), error.param, kind)

    page = resources.files("pyml.serve").joinpath("chat_page.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def chat_page() -> str:
        return page

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "active": engine.active, "queued": engine.jobs.qsize(),
                "max_sequences": engine.batch.capacity, "context": engine.batch.max_len,
                "steps": engine.steps}

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = engine.metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": engine.name, "object": "model", "created": 0, "owned_by": "pyml",
             "max_model_len": engine.batch.max_len}]}

    def chat_text(messages: list[ChatMessage], tools: list[Tool] | None,
                  add_generation_prompt: bool = True) -> str:
        if engine.template is None:
            raise RequestError(400, f"{engine.name} has no chat template: use /v1/completions",
                               "messages")
        try:
            return engine.template.render([m.for_template() for m in messages], add_generation_prompt,
                                          tools=template_tools(tools))
        except PymlError as error:
            raise RequestError(400, f"messages: {error}", "messages") from None

    def tool_syntax_of(tools: list[Tool] | None) -> ToolSyntax | None:
        if tools is None or engine.template is None:
            return None
        try:
            return tool_syntax(engine.template)
        except PymlError as error:
            raise RequestError(400, f"tools: {error}", "tools") from None

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatRequest):
        syntax = tool_syntax_of(body.tools)
        ids = engine.tokenizer.encode(chat_text(body.messages, body.tools), add_special_tokens=False).ids
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        choice = body.resolved_tool_choice()
        forced = None
        if syntax is not None:
            added = {token.content for token in engine.tokenizer.get_added_tokens_decoder().values()}
            try:
                forced = tool_call_grammar(syntax, body.tools, choice, added, body.parallel_tool_calls)
            except PymlError as error:
                raise RequestError(400, str(error), "tools") from None
        if forced is not None and (body.response_format is not None or body.grammar is not None):
            raise RequestError(400, f"tool_choice: {choice if isinstance(choice, str) else 'a named function'} "
                               "forces the answer to be a call: leave out response_format and grammar",
                               "tool_choice")
        return await complete(request, body, [Prompt(ids, "")], True, logprobs, echo=False,
                              grammar=forced, tool_calls=None if choice == "none" else syntax)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await complete(request, body, completion_prompts(engine, body.prompt), False,
                              body.logprobs, body.echo)

    async def complete(request: Request, body: Sampling, prompts: list[Prompt], chat: bool,
                       logprobs: int | None, echo: bool, grammar: str | None = None,
                       tool_calls: ToolSyntax | None = None):
        raw = await request.json()
        unsupported = [name for name in UNSUPPORTED if raw.get(name) not in (None, False)]
        if raw.get("best_of") not in (None, 1):
            unsupported.insert(0, "best_of")
        if unsupported:
            raise RequestError(400, f"{unsupported[0]} is not supported by pyml serve yet", unsupported[0])
        if grammar is not None:  # a call the request forces
            check_grammar(grammar, "tools")
        else:
            grammar = answer_grammar(body)
        completion = Completion(engine, body, prompts, chat, logprobs, echo, max_tokens, grammar, tool_calls)
        completion.queue()
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(completion.stream(include_usage), media_type="text/event-stream")
        async for event in completion.events_until_done(request):
            if event is None:  # nobody waits for the answer any more
                completion.cancelled.set()
                return error_response(499, "the client closed the request")
            if event[1] == "error":
                completion.cancelled.set()
                return error_response(500, event[2], kind="server_error")
        completion.log(200)
        return completion.whole()

    def answer_grammar(body: Sampling) -> str | None:
        """The grammar a request's answer must follow (its response_format or GBNF `grammar`),
        checked against the vocabulary: a 400 now rather than an error once it runs."""
        if body.response_format is not None and body.grammar is not None:
            raise RequestError(400, "grammar: give response_format or grammar, not both", "grammar")
        param = "grammar" if body.grammar is not None else "response_format"
        try:
            grammar = (gbnf_grammar(body.grammar) if body.grammar is not None
                       else response_format_grammar(body.response_format))
        except PymlError as error:
            raise RequestError(400, str(error) if str(error).startswith(param) else f"{param}: {error}",
                               param) from None
        if grammar is not None:
            check_grammar(grammar, param)
        return grammar

    def check_grammar(grammar: str, param: str) -> None:
        try:
            if engine.grammars is None:
                raise PymlError(f"{engine.name} names no end-of-sequence token (eos_token_id in "
                                "generation_config.json): a structured answer could not end")
            engine.grammars.check(grammar)
        except PymlError as error:
            raise RequestError(400, str(error) if str(error).startswith(param) else f"{param}: {error}",
                               param) from None

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        if (body.prompt is None) == (body.messages is None):
            raise RequestError(400, "give prompt or messages", "prompt")
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = engine.tokenizer.encode(body.prompt, add_special_tokens=special).ids
        else:
            text = chat_text(body.messages, body.tools, body.add_generation_prompt)
            ids = engine.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens)).ids
        return {"count": len(ids), "max_model_len": engine.batch.max_len, "tokens": ids,
                "token_strs": [engine.tokenizer.id_to_token(token) for token in ids]
                if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        outside = [token for token in body.tokens if not 0 <= token < engine.vocab]
        if outside:
            raise RequestError(400, f"tokens: {outside[0]} is not in the vocabulary (0 to "
                               f"{engine.vocab - 1})", "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        return tokenizer_description(engine)

    return app


def tokenizer_description(engine: Engine) -> dict:
    """/tokenizer_info as vLLM serves it: the tokenizer's configuration (tokenizer_config.json
    without its added-tokens table), special tokens as strings, the chat template and the context."""
    path = engine.model_dir / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    info = {key: value for key, value in config.items() if key != "added_tokens_decoder"}
    for key, value in info.items():
        if isinstance(value, dict) and isinstance(value.get("content"), str):  # an AddedToken
            info[key] = value["content"]
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info.setdefault(key, None)
    info["chat_template"] = engine.template.source if engine.template is not None else None
    info["model_max_length"] = engine.batch.max_len
    return info


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


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
          context: int | None = None, prefill_chunk: int = PREFILL_CHUNK, prefix_cache: bool = True,
          api_key: str | None = None, max_body: int = DEFAULT_MAX_BODY, max_tokens: int | None = None,
          access_log: bool = False) -> None:
    """Load the folder's model and serve it until SIGTERM or Ctrl-C: new connections are refused,
    the requests in flight get DRAIN_SECONDS to finish, and a SIGTERM exits with status 0.
    `context` (positions per sequence) defaults to the model's max_seq_len, at most DEFAULT_CONTEXT.
    `api_key` (default: PYML_API_KEY, if set) is what every request but GET /health must send."""
    import uvicorn

    for option, value in (("--max-queue", max_queue), ("--max-sequences", max_sequences),
                          ("--context", context), ("--prefill-chunk", prefill_chunk),
                          ("--max-body", max_body), ("--max-tokens", max_tokens)):
        if value is not None and value < 1:
            raise PymlError(f"{option} must be at least 1, not {value}")
    api_key = api_key if api_key is not None else os.environ.get("PYML_API_KEY") or None
    if api_key is not None and not api_key.strip():
        raise PymlError("--api-key is empty: give the key clients must send, or leave it out")
    model_dir = Path(model_dir)
    decoder = decoding.load_decoder(model_dir, weights=weights, adapter=adapter, activations=activations)
    if not isinstance(decoder, QuantizedDecoder):  # float32 weights: the fused step on float rows
        decoder = QuantizedDecoder.of_model(decoder)
    max_seq_len = decoder.model.MAX_SEQ_LEN
    if context is not None and context > max_seq_len:
        raise PymlError(f"--context {context} exceeds the model's max_seq_len {max_seq_len}")
    engine = Engine(model_dir, decoder, model_dir.resolve().name, max_queue, max_sequences,
                    context or min(max_seq_len, DEFAULT_CONTEXT), prefill_chunk, prefix_cache)
    routes = create_app(engine, max_tokens)
    app = BodyLimit(routes, max_body)
    if api_key is not None:
        app = ApiKey(app, api_key)
    app = CountRequests(app, engine.metrics, {route.path for route in routes.routes}, access_log)
    # uvicorn drains on SIGTERM, then raises the signal again under the handler it found: this one
    # lets the drained server return, so a SIGTERM ends it with status 0
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=DRAIN_SECONDS)
    announcing_server(config, engine, decoder).run()
