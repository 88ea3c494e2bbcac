"""`pyml serve` on the shipped SmolLM2, started once for the module with an API key and limits, as
real clients use it: structured answers (every one parses and validates against its schema, alone
and under load), tool calls (the folder given Qwen2.5's chat template, which carries tool syntax:
SmolLM2's has none), the key on every endpoint but /health, the body and max_tokens limits, a
quiet access log, and lm-evaluation-harness's `local-completions` against the server giving the
log-likelihoods and accuracy of its own `hf` backend on the same folder."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself depends on
import jsonschema
import openai
import pytest

from tests.support.chat_templates import QWEN25_INSTRUCT
from tests.support.model_folders import transformers_folder
from tests.support.server_process import started

pytestmark = pytest.mark.slow
KEY = "sk-test-0123456789"
CONTEXT = 1024
MAX_TOKENS = 96
MAX_BODY = 8192
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Describe a person called Ada who is 36 and has a cat, as JSON."}]


@pytest.fixture(scope="module")
def tool_folder(smollm2_folder, tmp_path_factory) -> Path:
    """The SmolLM2 folder with Qwen2.5's chat template (ChatML too, and its tools' syntax): the
    weights and every other file linked."""
    folder = tmp_path_factory.mktemp("smollm2-tools") / smollm2_folder.name
    folder.mkdir()
    for path in smollm2_folder.iterdir():
        if path.name != "tokenizer_config.json":
            (folder / path.name).symlink_to(path.resolve())
    config = json.loads((smollm2_folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": QWEN25_INSTRUCT}))
    return folder


@pytest.fixture(scope="module")
def server_process(tool_folder):
    process, url = started(tool_folder, "--api-key", KEY, "--max-tokens", str(MAX_TOKENS),
                           "--max-body", str(MAX_BODY), "--context", str(CONTEXT),
                           "--max-sequences", "4")
    yield process, url
    process.terminate()
    assert process.wait(timeout=30) == 0


@pytest.fixture(scope="module")
def url(server_process) -> str:
    return server_process[1]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def test_every_endpoint_but_health_and_the_page_needs_the_key(url):
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/").status_code == 200  # the page asks for the key itself
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics"),
                         ("POST", "/tokenize"), ("GET", "/tokenizer_info")):
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"bearer {KEY}"}):
            response = httpx.request(method, f"{url}{path}", headers=headers, json={"prompt": "x"})
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["type"] == "authentication_error"
            assert response.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_a_body_over_the_limit_gets_413_and_max_tokens_over_the_limit_400(url, client):
    headers = {"Authorization": f"Bearer {KEY}"}
    big = {"model": "m", "prompt": "x" * MAX_BODY, "max_tokens": 1}
    response = httpx.post(f"{url}/v1/completions", json=big, headers=headers)
    assert response.status_code == 413 and f"exceeds {MAX_BODY} bytes" in response.json()["error"]["message"]

    def chunks():  # no Content-Length: the server counts what it reads
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 512 + 1):
            yield b"x" * 512
        yield b'", "max_tokens": 1}'

    chunked = httpx.post(f"{url}/v1/completions", content=chunks(),
                         headers=headers | {"content-type": "application/json"})
    assert chunked.status_code == 413
    with pytest.raises(openai.BadRequestError, match=f"max_tokens: at most {MAX_TOKENS}"):
        client.completions.create(model="m", prompt="x", max_tokens=MAX_TOKENS + 1)
    assert client.completions.create(model="m", prompt="1, 2,", max_tokens=2).usage.completion_tokens == 2


def test_the_access_log_is_quiet_by_default_and_each_completion_has_its_line(server_process, client):
    process, url = server_process
    reply = client.completions.create(model="m", prompt="1, 2, 3,", max_tokens=3, temperature=0)
    httpx.get(f"{url}/health")
    output = "".join(process.output)
    assert f"pyml serve: {reply.id} 200: 1 choice, prompt " in output, output
    assert "GET /health" not in output and "POST /v1/completions" not in output


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def person(client, seed: int | None, temperature: float = 0.8):
    return client.chat.completions.create(model="m", messages=ASK_PERSON, max_tokens=MAX_TOKENS,
                                          temperature=temperature, seed=seed,
                                          response_format=schema_format(PERSON)).choices[0]


def test_json_schema_answers_parse_and_validate_alone_and_under_load(client):
    greedy = person(client, None, temperature=0)
    alone = {seed: person(client, seed) for seed in range(4)}
    for choice in [greedy, *alone.values()]:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert len({choice.message.content for choice in alone.values()}) > 1  # sampled, not one answer
    with ThreadPoolExecutor(4) as pool:
        loaded = dict(zip(range(4), pool.map(lambda seed: person(client, seed), range(4))))
    assert {seed: c.message.content for seed, c in loaded.items()} == \
        {seed: c.message.content for seed, c in alone.items()}


def test_json_object_and_a_gbnf_grammar_constrain_the_answer(client):
    capital = [{"role": "user", "content": 'What is the capital of France? Answer as JSON: {"capital": ...}'}]
    reply = client.chat.completions.create(
        model="m", messages=capital, max_tokens=MAX_TOKENS, temperature=0,
        response_format={"type": "json_object"}).choices[0]
    assert reply.finish_reason == "stop", reply.message.content
    assert isinstance(json.loads(reply.message.content), dict)
    question = [{"role": "user", "content": "Is Paris the capital of France? Answer yes or no."}]
    for seed in range(3):
        answer = client.chat.completions.create(
            model="m", messages=question, max_tokens=8, temperature=1.0, seed=seed,
            extra_body={"grammar": 'root ::= "yes" | "no"'}).choices[0]
        assert (answer.message.content, answer.finish_reason) in (("yes", "stop"), ("no", "stop"))
    free = client.chat.completions.create(model="m", messages=question, max_tokens=8, temperature=0)
    assert free.choices[0].message.content not in ("yes", "no")  # the grammar, not the model, did it


def write_task(folder: Path, name: str, rows: list[dict], config: dict) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    lines = [f"task: {name}", "dataset_path: json", "dataset_kwargs:", "  data_files:",
             f"    test: {data}", "test_split: test"] + [f"{key}: {json.dumps(value)}" for key, value in config.items()]
    (folder / f"{name}.yaml").write_text("\n".join(lines) + "\n")


MULTIPLE_CHOICE = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " Berlin"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" three", " four", " five"], "answer": 1},
    {"question": "The opposite of hot is", "choices": [" cold", " warm", " blue"], "answer": 0},
    {"question": "A cat says", "choices": [" woof", " moo", " meow"], "answer": 2},
    {"question": "Water freezes at zero degrees", "choices": [" Celsius", " Kelvin"], "answer": 0},
    {"question": "The sun rises in the", "choices": [" west", " east", " north"], "answer": 1},
]
COUNTING = [{"question": f"{', '.join(str(n) for n in range(start, start + 5))},",
             "answer": f" {start + 5}"} for start in (1, 7, 20, 41)]


def test_lm_evaluation_harness_scores_as_its_own_hf_backend(url, smollm2_folder, tmp_path, monkeypatch):
    """lm-evaluation-harness (local-completions: token-id prompts, echo with logprobs for
    loglikelihood, the remote tokenizer endpoints) against the server, and its hf backend on the
    same folder in float32, offline: per-sample log-likelihoods within 2e-3, the same greedy flags,
    the same accuracy; generate_until gives the same answers and exact-match score."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    write_task(tmp_path, "pyml_choice", MULTIPLE_CHOICE, {
        "output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}]})
    write_task(tmp_path, "pyml_count", COUNTING, {
        "output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": [","], "max_gen_toks": 8, "do_sample": False},
        "metric_list": [{"metric": "exact_match"}]})
    tasks = ["pyml_choice", "pyml_count"]
    manager = TaskManager(include_path=str(tmp_path))
    served = lm_eval.simple_evaluate(
        model="local-completions", tasks=tasks, task_manager=manager, log_samples=True,
        model_args={"model": "m", "base_url": f"{url}/v1/completions", "tokenizer_backend": "remote",
                    "auth_token": KEY, "tokenized_requests": True, "num_concurrent": 2,
                    "max_retries": 1, "max_length": CONTEXT, "max_gen_toks": 8})
    local = lm_eval.simple_evaluate(
        model="hf", tasks=tasks, task_manager=manager, log_samples=True,
        model_args={"pretrained": str(transformers_folder(smollm2_folder)), "dtype": "float32",
                    "device": "cpu"})
    for task in tasks:
        ours = sorted(served["samples"][task], key=lambda sample: sample["doc_id"])
        theirs = sorted(local["samples"][task], key=lambda sample: sample["doc_id"])
        assert len(ours) == len(theirs) == len(MULTIPLE_CHOICE if task == "pyml_choice" else COUNTING)
        for mine, reference in zip(ours, theirs):
            if task == "pyml_choice":
                for (log_likelihood, greedy), (expected, expected_greedy) in zip(
                        (response[0] for response in mine["resps"]),
                        (response[0] for response in reference["resps"])):
                    assert log_likelihood == pytest.approx(expected, abs=2e-3)
                    assert greedy == expected_greedy
            else:
                assert mine["resps"] == reference["resps"]
        metric = "acc,none" if task == "pyml_choice" else "exact_match,none"
        assert served["results"][task][metric] == local["results"][task][metric]
    assert served["results"]["pyml_choice"]["acc,none"] >= 0.5  # the tasks are not noise to the model


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris?"}]


def arguments_of(call, tool: dict) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_a_required_or_named_tool_choice_gets_a_call_of_a_tool(client):
    """"required" without parallel calls, or a named function: one call, whose arguments validate
    against the function's parameters. "required" with parallel calls (OpenAI's default): calls,
    one or more, until the model ends or max_tokens does."""
    several = client.chat.completions.create(model="m", messages=ASK_WEATHER, tools=[WEATHER, TIME],
                                             tool_choice="required", max_tokens=MAX_TOKENS, temperature=0)
    assert several.choices[0].message.tool_calls, several.choices[0].message
    for call in several.choices[0].message.tool_calls:
        arguments_of(call, WEATHER if call.function.name == "get_weather" else TIME)
    for choice, tool in (("required", WEATHER), ({"type": "function", "function": {"name": "get_time"}}, TIME)):
        reply = client.chat.completions.create(model="m", messages=ASK_WEATHER, tools=[WEATHER, TIME],
                                               tool_choice=choice, max_tokens=MAX_TOKENS, temperature=0,
                                               parallel_tool_calls=False)
        answer = reply.choices[0]
        assert len(answer.message.tool_calls) == 1
        assert answer.finish_reason == "tool_calls", answer.message
        assert answer.message.content is None
        calls = answer.message.tool_calls
        assert calls and all(call.type == "function" and call.id.startswith("call_") for call in calls)
        named = [call for call in calls if call.function.name == tool["function"]["name"]]
        assert named, calls
        arguments_of(named[0], tool)


def test_streamed_tool_calls_are_the_whole_answers_calls(client):
    options = dict(model="m", messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
                   max_tokens=MAX_TOKENS, temperature=0.7, seed=5, parallel_tool_calls=False)
    whole = client.chat.completions.create(**options).choices[0]
    calls, finish = {}, None
    for chunk in client.chat.completions.create(**options, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or part.id
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(call["name"], json.loads(call["arguments"])) for call in calls.values()] == \
        [(call.function.name, arguments_of(call, WEATHER)) for call in whole.message.tool_calls]


def test_a_conversation_with_calls_and_their_results_is_rendered_by_the_template(client, url, tool_folder):
    """An assistant message with tool_calls (no content) and the tool's answer, then the model's
    turn: the prompt is the folder's template rendering them, as transformers renders it."""
    from transformers import PreTrainedTokenizerFast

    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = ASK_WEATHER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                              {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    reply = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER],
                                           max_tokens=12, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tool_folder / "tokenizer.json"))
    hf_messages = ASK_WEATHER + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "content": '{"temperature": 21}'}]
    text = tokenizer.apply_chat_template(hf_messages, tools=[WEATHER], chat_template=QWEN25_INSTRUCT,
                                         tokenize=False, add_generation_prompt=True)
    assert reply.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False)["input_ids"])
    tokenized = httpx.post(f"{url}/tokenize", json={"messages": messages, "tools": [WEATHER]},
                           headers={"Authorization": f"Bearer {KEY}"}).json()
    assert tokenized["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
