"""`pyml serve` on the tiny Llama folder, started once for the module on a free port of 127.0.0.1 in
a subprocess, and driven by the official `openai` client (and its HTTP client, httpx2, for malformed requests): its
greedy answers are `pyml generate`'s tokens (pyml.generate.decoding.generate on the same folder),
streamed or whole; stop strings end the text even across token boundaries; usage counts the tokens;
answers do not depend on what else is running in the batch; bad requests get 400 with OpenAI's
error body."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself depends on
import numpy as np
import openai
import pytest
import torch

from pyml.formats.chat_template import ChatTemplate
from pyml.generate import decoding
from pyml.serve.logprobs import TokenTexts
from tests.support import anchors
from tests.support.hf_reference import llama_in_float64
from tests.support.server_process import started

QUESTION = [{"role": "user", "content": "the cat sat on the"}]


@pytest.fixture(scope="module")
def server_process(tiny_folders):
    """(the process, its base URL) while `pyml serve` runs on the tiny Llama folder."""
    process, url = started(tiny_folders["llama"], "--access-log")
    yield process, url
    process.terminate()
    assert process.wait(timeout=30) == 0  # SIGTERM with nothing in flight: exits cleanly


@pytest.fixture(scope="module")
def server(server_process, tiny_folders):
    """(the folder, the server's base URL)."""
    return tiny_folders["llama"], server_process[1]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0)


def generated(folder: Path, ids: list[int], max_tokens: int, sampler=decoding.GREEDY, seed: int = 0,
              adapter: Path | None = None):
    """`pyml generate`'s decoding of `ids` on the folder, as the server loads it."""
    decoder = decoding.load_decoder(folder, adapter=adapter)
    return decoding.generate(decoder, decoding.load_tokenizer(folder), ids, max_tokens,
                             decoding.eos_ids(folder), sampler, seed, out=None)


def chat_ids(folder: Path) -> list[int]:
    text = ChatTemplate.of_folder(folder).render(QUESTION, add_generation_prompt=True)
    return decoding.load_tokenizer(folder).encode(text, add_special_tokens=False).ids


def test_the_server_says_where_it_listens_and_writes_a_line_per_request(server_process, client):
    """With --access-log, a line per HTTP request; and always a line per completion request."""
    process, url = server_process
    client.models.list()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    reply = client.completions.create(model="tiny", prompt="the cat", max_tokens=2, temperature=0)
    deadline = time.monotonic() + 10
    while sum(reply.id in line for line in process.output) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    output = "".join(process.output)
    assert f"pyml serve: {url}/v1 ready (model tiny-llama, weights " in output, output
    assert re.search(r"^pyml serve: GET /v1/models 200 \d+\.\d{3} s$", output, re.M), output
    assert re.search(r"^pyml serve: POST /v1/completions 400 \d+\.\d{3} s$", output, re.M), output
    prompt_tokens = reply.usage.prompt_tokens
    assert re.search(rf"^pyml serve: {reply.id} 200: 1 choice, prompt {prompt_tokens} tokens \(\d+ "
                     rf"cached\), answer 2 tokens, \d+\.\d{{3}} s$", output, re.M), output


def test_a_greedy_chat_answer_is_pyml_generates_streamed_or_whole(server, client):
    folder, _ = server
    expected = generated(folder, chat_ids(folder), 12)
    whole = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].finish_reason == ("stop" if len(expected.new_ids) < 12 else "length")
    assert whole.usage.prompt_tokens == len(chat_ids(folder))
    assert whole.usage.completion_tokens == len(expected.new_ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=12,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == expected.text
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == \
        whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.new_ids) and not chunks[-1].choices


def test_max_completion_tokens_ends_the_answer_and_outranks_max_tokens(server, client):
    """OpenAI's newer name for max_tokens (the one its client documents for chat) stops the
    answer there, whatever max_tokens says, as OpenAI's server does."""
    folder, _ = server
    assert len(generated(folder, chat_ids(folder), 12).new_ids) > 3  # the answer runs past 3
    expected = generated(folder, chat_ids(folder), 3)
    for limits in (dict(max_completion_tokens=3), dict(max_completion_tokens=3, max_tokens=12)):
        reply = client.chat.completions.create(model="tiny", messages=QUESTION, temperature=0, **limits)
        assert reply.choices[0].message.content == expected.text
        assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("length", 3)


def test_every_sampling_option_is_pyml_generates(server, client):
    """The same Sampler and seed as `pyml generate --top-k ... --seed`: the same answer."""
    folder, _ = server
    options = dict(temperature=0.9, top_p=0.95, top_k=20, min_p=0.02, repetition_penalty=1.2,
                   frequency_penalty=0.4, presence_penalty=0.3)
    expected = generated(folder, chat_ids(folder), 16, decoding.Sampler(**options), seed=11)
    extra = {name: options.pop(name) for name in ("top_k", "min_p", "repetition_penalty")}
    reply = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=16, seed=11,
                                           extra_body=extra, **options)
    assert reply.choices[0].message.content == expected.text


def test_seed_0_is_a_seed_not_none(server, client):
    """A sampled request with "seed": 0 is reproducible and is `pyml generate --seed 0`'s answer
    (a server that read 0 as "no seed", the `seed or clock` idiom, would answer at random); seed 1
    gives another answer."""
    folder, _ = server
    sampler = decoding.Sampler(temperature=1.5)
    expected = {seed: generated(folder, chat_ids(folder), 16, sampler, seed=seed).text for seed in (0, 1)}
    assert expected[0] != expected[1]  # else this test could not tell the seeds apart

    def answer(seed: int) -> str:
        return client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=16,
                                              temperature=1.5, seed=seed).choices[0].message.content

    assert answer(0) == answer(0) == expected[0]
    assert answer(1) == expected[1]


def test_a_lora_adapter_is_served_as_pyml_generate_runs_it(tiny_folders, tmp_path):
    """`pyml serve --adapter` on the tiny Llama (a LoRA checkpoint of a few steps, which changes
    the answer): the greedy continuation of a prompt is `pyml generate`'s with the adapter (the
    tiny folders have no chat template: /v1/completions)."""
    from tests.support.model_folders import tiny_training

    folder, prompt = tiny_folders["llama"], "the cat sat on the"
    ids = decoding.load_tokenizer(folder).encode(prompt).ids
    # tests/train/test_lora_cli.py's adapters: the same LoRA package, compiled once for both
    adapter = tiny_training(folder, tmp_path / "run", steps=4, lr=0.05, lora_rank=4, lora_alpha=12.0,
                            lora_targets=["q", "v", "o", "down"]).checkpoint
    expected = generated(folder, ids, 12, adapter=adapter)
    assert expected.text != generated(folder, ids, 12).text
    process, url = started(folder, "--adapter", str(adapter))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0)
        assert answer.choices[0].text == expected.text
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0


def test_curl_streams_the_answer_as_docs_serving_shows(server):
    """docs/serving.md's curl command, run: server-sent events whose deltas make up `pyml
    generate`'s greedy answer, ending with `data: [DONE]`."""
    import subprocess

    curl = anchors.program("curl", "apt-get install curl")
    folder, url = server
    body = {"model": "tiny", "messages": QUESTION, "max_tokens": 12, "temperature": 0, "stream": True}
    run = subprocess.run([curl, "-sN", f"{url}/v1/chat/completions", "-H", "Content-Type: application/json",
                          "-d", json.dumps(body)], capture_output=True, text=True, timeout=60, check=True)
    events = [line.removeprefix("data: ") for line in run.stdout.splitlines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    assert text == generated(folder, chat_ids(folder), 12).text


def test_completions_continue_the_prompt_as_pyml_generate_does(server, client):
    folder, _ = server
    prompt = "the cat sat on the"
    expected = generated(folder, decoding.load_tokenizer(folder).encode(prompt).ids, 10)
    answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    assert answer.choices[0].text == expected.text and answer.usage.completion_tokens == len(expected.new_ids)


def test_a_stop_string_across_two_tokens_ends_the_answer_before_it(server, client):
    folder, _ = server
    tokenizer = decoding.load_tokenizer(folder)
    expected = generated(folder, chat_ids(folder), 20)
    pieces = [tokenizer.decode(expected.new_ids[:n]) for n in range(len(expected.new_ids) + 1)]
    # the last character of one token and the first of the next, where both are text
    boundary = next(n for n in range(2, len(pieces) - 1)
                    if len(pieces[n]) > len(pieces[n - 1]) and len(pieces[n + 1]) > len(pieces[n]))
    stop = pieces[boundary][-1] + pieces[boundary + 1][len(pieces[boundary])]
    cut = expected.text.find(stop)
    for stream in (False, True):
        reply = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=20,
                                               temperature=0, stop=[stop], stream=stream)
        if stream:
            chunks = list(reply)
            text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert (text, finish) == (expected.text[:cut], "stop"), (stop, expected.text)


def test_answers_do_not_depend_on_what_else_runs(server, client):
    """16 requests, greedy and sampled (seeded), of different lengths, one at a time and then all
    at once, decoded in batches of up to 8 that they join and leave at different tokens: the same
    text, token for token. The server's step count shows they were decoded together: alone, a
    step draws at most one token; together, fewer steps than tokens."""
    def ask(n: int) -> tuple[str, int]:
        messages = [{"role": "user", "content": "the cat sat on the " + "mat " * (n % 5)}]
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6 + n,
                                               temperature=0.9 if n % 2 else 0, seed=n)
        return reply.choices[0].message.content, reply.usage.completion_tokens

    def steps() -> int:
        return httpx.get(f"{server[1]}/health").json()["steps"]

    start = steps()
    alone = [ask(n) for n in range(16)]
    alone_steps, tokens = steps() - start, sum(count for _, count in alone)
    start = steps()
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(ask, range(16)))
    assert together == alone and len(set(alone)) > 1
    assert alone_steps >= tokens > steps() - start  # some steps drew tokens of several sequences


def test_64_requests_from_16_clients_are_each_answered_as_alone(server, client):
    """A bounded load test on loopback: 16 clients ask 4 questions each at once (the queue holds
    16). None is lost or duplicated, and every greedy answer is the one it gets alone."""
    questions = [[{"role": "user", "content": f"the cat {n} sat on"}] for n in range(64)]

    def ask(messages) -> str:
        return client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                              temperature=0).choices[0].message.content

    alone = {n: ask(questions[n]) for n in range(0, 64, 8)}
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, questions))
    assert len(answers) == 64 and all(answers[n] == text for n, text in alone.items())
    assert answers == [ask(messages) for messages in questions]  # each, one at a time


def test_clients_that_leave_mid_stream_free_the_decoder_and_its_memory(server_process):
    """A client that reads one chunk and hangs up: the server's batch and queue are empty again
    soon after, and after 20 such clients (the first one's allocations aside) its resident memory
    has not grown."""
    process, url = server_process
    body = {"model": "tiny", "messages": QUESTION, "max_tokens": 60, "temperature": 0.9, "stream": True}

    def leave_mid_stream():
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
            next(response.iter_lines())
        wait_for_health(url, active=0, queued=0)

    leave_mid_stream()
    idle = resident_bytes(process.pid)
    for _ in range(20):
        leave_mid_stream()
    assert resident_bytes(process.pid) - idle < 4 << 20, (idle, resident_bytes(process.pid))


def resident_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) << 10


def test_an_answer_that_reaches_the_contexts_end_stops_with_length(server, client):
    """A prompt three tokens short of the context, no max_tokens: the answer fills the context."""
    folder, url = server
    context = httpx.get(f"{url}/health").json()["context"]
    tokenizer = decoding.load_tokenizer(folder)
    words = 1
    while len(tokenizer.encode("the cat " * (words + 1)).ids) <= context - 3:
        words += 1
    prompt = "the cat " * words
    ids = tokenizer.encode(prompt).ids
    expected = generated(folder, ids, context - len(ids))
    assert len(expected.new_ids) == context - len(ids) >= 3  # greedy meets no end-of-turn token
    answer = client.completions.create(model="tiny", prompt=prompt, temperature=0)
    assert answer.choices[0].finish_reason == "length" and answer.choices[0].text == expected.text
    assert answer.usage.prompt_tokens + answer.usage.completion_tokens == context


def test_models_and_health(server, client):
    folder, url = server
    assert [model.id for model in client.models.list().data] == [folder.resolve().name]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": QUESTION, "temperature": "hot"}, "temperature"),
    ({"messages": QUESTION, "max_tokens": 0}, "max_tokens"),
    ({"messages": QUESTION, "top_k": -1}, "top_k"),
    ({"messages": QUESTION, "presence_penalty": 3}, "presence_penalty"),
    ({"messages": QUESTION, "repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"messages": QUESTION, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"messages": QUESTION, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": QUESTION, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"messages": QUESTION, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": QUESTION, "grammar": "root ::= missing"}, "grammar"),
    ({"messages": QUESTION, "n": 17}, "n"),  # more choices than the queue holds
    ({"messages": QUESTION, "best_of": 2}, "best_of"),
    ({"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": QUESTION, "stop": ""}, "stop"),
    ({"messages": [{"role": "user", "content": "the cat " * 40}]}, "messages"),  # past the context
])
def test_bad_requests_get_400_naming_the_field(server, body, param):
    _, url = server
    # json.dumps writes inf as Infinity, which Python's JSON reader (and so the server's) reads
    response = httpx.post(f"{url}/v1/chat/completions", content=json.dumps({"model": "tiny", **body}),
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


@pytest.mark.parametrize("body, param", [
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": ["the cat", ""]}, "prompt.1"),
    ({"prompt": [5, 10**6]}, "prompt"),  # a token id outside the vocabulary
    ({"prompt": [[1, 2], [3, -1]]}, "prompt.1"),
    ({"prompt": "the cat", "logprobs": 21}, "logprobs"),
    ({"prompt": "the cat", "max_tokens": 0}, "max_tokens"),  # no answer, and no echo to score
    ({"prompt": "the cat", "suffix": "mat"}, "suffix"),
    ({"prompt": "the cat", "logit_bias": {"5": 10}}, "logit_bias"),
])
def test_bad_completion_requests_get_400_naming_the_field(server, body, param):
    response = httpx.post(f"{server[1]}/v1/completions", json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_a_text_response_format_is_the_default(server):
    _, url = server
    body = {"messages": QUESTION, "max_tokens": 4, "temperature": 0}
    plain = httpx.post(f"{url}/v1/chat/completions", json=body)
    text = httpx.post(f"{url}/v1/chat/completions", json=body | {"response_format": {"type": "text"}})
    assert plain.status_code == text.status_code == 200, text.text
    assert text.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


def test_malformed_json_gets_400(server):
    response = httpx.post(f"{server[1]}/v1/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "error" in response.json()



@pytest.mark.slow
def test_beyond_the_queue_429_and_on_sigterm_the_requests_in_flight_finish(smollm2_folder):
    """SmolLM2 with one sequence and a queue of one: while one answer is decoded (200 tokens,
    seconds here) and one request waits, a third gets 429 with OpenAI's error body. Then SIGTERM:
    new connections are refused while the two are still being answered, both are answered in
    full, and the server exits with status 0."""
    process, url = started(smollm2_folder, "--max-sequences", "1", "--max-queue", "1")
    try:
        story = [{"role": "user", "content": "Write a long story about a cat who sails to Paris."}]
        body = {"model": "m", "messages": story, "max_tokens": 200, "temperature": 0.9, "seed": 1}
        # one short answer first, so that nothing left to compile on a cold cache runs inside the
        # SIGTERM's drain time (a CI run once lost the two answers there)
        assert httpx.post(f"{url}/v1/chat/completions", json=body | {"max_tokens": 2}, timeout=300).status_code == 200
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, f"{url}/v1/chat/completions", json=body, timeout=300)
            wait_for_health(url, active=1, queued=0)
            second = pool.submit(httpx.post, f"{url}/v1/chat/completions", json=body, timeout=300)
            wait_for_health(url, active=1, queued=1)
            refused = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
            assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_exceeded"
            process.terminate()
            deadline = time.monotonic() + 10
            while True:  # the listening socket closes soon after the signal
                try:
                    httpx.get(f"{url}/health", timeout=1)
                except httpx.ConnectError:
                    break
                assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
                time.sleep(0.01)
            assert not second.done()  # refused while the queued request still waits for its turn
            for answer in (first.result(), second.result()):
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["finish_reason"] in ("stop", "length")
                assert answer.json()["usage"]["completion_tokens"] > 0
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.slow
def test_a_client_that_leaves_mid_stream_frees_its_row_at_the_next_token(smollm2_folder):
    """SmolLM2 asked to go on counting, greedy, for up to 1000 tokens: the client hangs up after
    the first chunk, and the server leaves the sequence within a few steps, not at the answer's end."""
    process, url = started(smollm2_folder, "--max-sequences", "1")
    try:
        body = {"model": "m", "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 1000,
                "temperature": 0, "stream": True}
        before = httpx.get(f"{url}/health").json()["steps"]
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            next(line for line in response.iter_lines() if line.startswith("data:"))
        wait_for_health(url, active=0, queued=0)
        assert httpx.get(f"{url}/health").json()["steps"] - before < 100
    finally:
        process.terminate()
        assert process.wait(timeout=60) == 0


def wait_for_health(url: str, **counts) -> None:
    deadline = time.monotonic() + 60
    while True:
        health = httpx.get(f"{url}/health").json()
        if all(health[name] == count for name, count in counts.items()):
            return
        assert time.monotonic() < deadline, health
        time.sleep(0.01)


@pytest.mark.parametrize("options, message", [
    ({"max_queue": 0}, "--max-queue must be at least 1, not 0"),
    ({"max_sequences": 0}, "--max-sequences must be at least 1, not 0"),
    ({"context": 0}, "--context must be at least 1, not 0"),
    ({"prefill_chunk": 0}, "--prefill-chunk must be at least 1, not 0"),
    ({"context": 10**6}, "--context 1000000 exceeds the model's max_seq_len"),
])
def test_options_the_server_cannot_run_are_refused_in_one_line(tiny_folders, options, message):
    from pyml.errors import PymlError
    from pyml.serve.server import serve

    with pytest.raises(PymlError, match=message):
        serve(tiny_folders["llama"], "127.0.0.1", 0, **{"max_queue": 16, **options})


# --- completions as the API defines them: token prompts, echo, logprobs, n; the tokenizer endpoints


def token_ids_of_texts(tokenizer) -> dict[str, int]:
    """Each token's text (its own decoding) to its id, for the log-probability tables keyed by text."""
    texts = TokenTexts(tokenizer)
    return {texts.text(token): token for token in range(tokenizer.get_vocab_size())}


def test_an_echoed_prompts_logprobs_equal_transformers_in_float64(server, client, monkeypatch):
    """lm-evaluation-harness's loglikelihood request (token ids, echo, logprobs 1, max_tokens 1),
    with 3 top tokens: every prompt token's log-probability (the first's null) and the top tokens'
    equal transformers' float64 log-softmax within float32's error; the answer is the greedy
    token; the text is the prompt's and the answer's, each token at its offset."""
    folder, _ = server
    tokenizer = decoding.load_tokenizer(folder)
    ids = tokenizer.encode("the cat sat on the mat, then the dog sat on the cat").ids
    reply = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=3, max_tokens=1,
                                      temperature=0)
    logprobs = reply.choices[0].logprobs
    reference = llama_in_float64(folder, monkeypatch)
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([ids])).logits[0], -1).numpy()
    assert len(logprobs.tokens) == len(ids) + 1 and reply.usage.completion_tokens == 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    np.testing.assert_allclose(logprobs.token_logprobs[1:len(ids)],
                               expected[np.arange(len(ids) - 1), ids[1:]], rtol=0, atol=1e-4)
    np.testing.assert_allclose(logprobs.token_logprobs[-1], expected[-1].max(), rtol=0, atol=1e-4)
    id_of = token_ids_of_texts(tokenizer)
    for position in range(1, len(ids) + 1):
        top = logprobs.top_logprobs[position]
        assert 3 <= len(top) <= 4  # the 3 most probable, and the token itself if it is not among them
        for text, value in top.items():
            np.testing.assert_allclose(value, expected[position - 1, id_of[text]], rtol=0, atol=1e-4)
        assert max(top.values()) == pytest.approx(expected[position - 1].max(), abs=1e-4)
    texts = TokenTexts(tokenizer)
    assert logprobs.tokens[:len(ids)] == [texts.text(token) for token in ids]
    assert reply.choices[0].text == tokenizer.decode(ids) + logprobs.tokens[-1]
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:n])) for n in range(len(ids) + 1)]


def test_logprobs_are_the_same_bits_alone_and_under_load(server, client):
    """An echoed prompt's log-probabilities, and a sampled answer's, alone and while 8 chats run
    beside them (their prompts prefilled in the same steps): identical, to the last bit."""
    folder, _ = server
    ids = decoding.load_tokenizer(folder).encode("a dog and a cat sat on a mat in the sun").ids

    def score():
        return client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=2, max_tokens=3,
                                         temperature=0.8, seed=4).model_dump()["choices"]

    def chat(n: int) -> str:
        messages = [{"role": "user", "content": "the cat " * (n + 1)}]
        return client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                              temperature=0).choices[0].message.content

    alone = score()
    with ThreadPoolExecutor(9) as pool:
        others = [pool.submit(chat, n) for n in range(8)]
        loaded = pool.submit(score)
        assert loaded.result() == alone
        [other.result() for other in others]


def test_several_prompts_and_n_choices_are_each_the_answer_alone(server, client):
    """A list of prompts (text, or token ids) gets one choice per prompt times n, in order; choice j
    of a prompt is the answer to that prompt alone with seed + j."""
    folder, _ = server
    tokenizer = decoding.load_tokenizer(folder)
    texts = ["the cat sat", "on the mat the"]

    def alone(prompt, seed) -> str:
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1.2,
                                         seed=seed).choices[0].text

    for prompts in (texts, [tokenizer.encode(text).ids for text in texts]):
        reply = client.completions.create(model="tiny", prompt=prompts, n=3, max_tokens=6,
                                          temperature=1.2, seed=10)
        assert [choice.index for choice in reply.choices] == list(range(6))
        expected = [alone(prompt, 10 + j) for prompt in prompts for j in range(3)]
        assert [choice.text for choice in reply.choices] == expected
        assert len(set(expected[:3])) > 1  # the seeds differ
        # each prompt counted once, as OpenAI counts them
        assert reply.usage.prompt_tokens == sum(len(tokenizer.encode(text).ids) for text in texts)
    assert alone(texts[1], 10) == alone(tokenizer.encode(texts[1]).ids, 10)


def test_a_chat_answers_logprobs_are_its_tokens_scored(server, client):
    """Chat's logprobs (OpenAI's content list, 2 top tokens): the answer's tokens, in order, whose
    log-probabilities are what echo scoring gives the same tokens after the same prompt, bit for
    bit, whole or streamed."""
    folder, _ = server
    sampler = decoding.Sampler(temperature=0.9)
    expected = generated(folder, chat_ids(folder), 8, sampler, seed=3)
    options = dict(model="tiny", messages=QUESTION, max_tokens=8, temperature=0.9, seed=3,
                   logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**options)
    content = whole.choices[0].logprobs.content
    texts = TokenTexts(decoding.load_tokenizer(folder))
    answer = [token for token in expected.new_ids if token not in decoding.eos_ids(folder)]
    assert [entry.token for entry in content] == [texts.text(token) for token in answer]
    assert [entry.bytes for entry in content] == [texts.bytes(token) for token in answer]
    scored = client.completions.create(model="tiny", prompt=chat_ids(folder) + answer, echo=True,
                                       logprobs=2, max_tokens=0).choices[0].logprobs
    start = len(chat_ids(folder))
    assert [entry.logprob for entry in content] == scored.token_logprobs[start:]
    for entry, top in zip(content, scored.top_logprobs[start:]):
        assert len(entry.top_logprobs) == 2
        assert all(top[pair.token] == pair.logprob for pair in entry.top_logprobs)
    streamed = [chunk.choices[0].logprobs.content for chunk in client.chat.completions.create(
        **options, stream=True) if chunk.choices and chunk.choices[0].logprobs]
    assert [entry for part in streamed for entry in part] == content


def test_a_streamed_echo_with_logprobs_is_the_whole_one_in_parts(server, client):
    folder, _ = server
    options = dict(model="tiny", prompt="the cat sat on", echo=True, logprobs=1, max_tokens=5,
                   temperature=0)
    whole = client.completions.create(**options).choices[0]
    chunks = [chunk.choices[0] for chunk in client.completions.create(**options, stream=True)]
    assert "".join(chunk.text for chunk in chunks) == whole.text
    assert whole.text.startswith("the cat sat on")
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [value for chunk in chunks if chunk.logprobs for value in getattr(chunk.logprobs, key)] \
            == getattr(whole.logprobs, key), key


def test_the_tokenizer_endpoints_answer_as_vllms(server):
    folder, url = server
    tokenizer = decoding.load_tokenizer(folder)
    text = "the cat sat on the mat"
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": text}).json()
    assert tokens["tokens"] == tokenizer.encode(text).ids and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 64 and tokens["token_strs"] is None
    chat = httpx.post(f"{url}/tokenize", json={"messages": QUESTION, "return_token_strs": True}).json()
    assert chat["tokens"] == chat_ids(folder)
    assert chat["token_strs"] == [tokenizer.id_to_token(token) for token in chat_ids(folder)]
    assert httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": text}
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["chat_template"] == ChatTemplate.of_folder(folder).source
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 64
    for path, body in (("/detokenize", {"tokens": [10**6]}), ("/tokenize", {}),
                       ("/tokenize", {"prompt": "x", "messages": QUESTION})):
        refused = httpx.post(f"{url}{path}", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["message"], (path, body)


def test_a_chats_next_turn_takes_its_earlier_turns_from_the_prefix_cache(server, client):
    """The second turn of a chat begins with the first turn's prompt and answer: those positions
    come from the cache (usage.prompt_tokens_details.cached_tokens), and the answer is `pyml
    generate`'s on the whole prompt."""
    folder, _ = server
    first = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=5, temperature=0)
    turns = QUESTION + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "and the dog"}]
    second = client.chat.completions.create(model="tiny", messages=turns, max_tokens=5, temperature=0)
    template, tokenizer = ChatTemplate.of_folder(folder), decoding.load_tokenizer(folder)
    ids = tokenizer.encode(template.render(turns, add_generation_prompt=True), add_special_tokens=False).ids
    assert second.choices[0].message.content == generated(folder, ids, 5).text
    assert first.usage.prompt_tokens <= second.usage.prompt_tokens_details.cached_tokens < len(ids)


def test_metrics_count_requests_tokens_and_latencies(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    _, url = server
    client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4, temperature=0)
    httpx.post(f"{url}/v1/chat/completions", json={"messages": []})
    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(response.text) for sample in family.samples}
    chat_path = "/v1/chat/completions"
    assert samples[("pyml_requests_total", (("path", chat_path), ("status", "200")))] >= 1
    assert samples[("pyml_requests_total", (("path", chat_path), ("status", "400")))] >= 1
    assert samples[("pyml_generation_tokens_total", ())] >= 4
    assert samples[("pyml_prompt_tokens_total", ())] >= len(chat_ids(server[0]))
    assert samples[("pyml_time_to_first_token_seconds_count", ())] >= 1
    assert samples[("pyml_time_per_output_token_seconds_count", ())] >= 3
    assert ("pyml_queue_length", ()) in samples and ("pyml_active_sequences", ()) in samples
