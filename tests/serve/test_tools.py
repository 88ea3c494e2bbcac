"""OpenAI tool calling (pyml.serve.tools), without model weights: the real Qwen2.5 and Llama 3.1
chat templates render a conversation with tools, calls and tool answers as transformers'
apply_chat_template renders it; the model's text is read back into OpenAI tool_calls, whole and
streamed in any split; the grammar of a required or named call, masking random logits token by
token over a byte-level vocabulary, gives text that reads back as calls whose arguments satisfy
the function's schema; and the requests OpenAI refuses are refused."""

from __future__ import annotations

import json
import os
import re

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing from a hub

import jsonschema
import llguidance
import numpy as np
import pytest
from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask
from pydantic import ValidationError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pyml.errors import PymlError
from pyml.formats.chat_template import ChatTemplate
from pyml.serve.tools import (
    ChatMessage,
    NamedToolChoice,
    Tool,
    ToolCallStream,
    ToolFields,
    ToolSyntax,
    joined_deltas,
    parse_tool_calls,
    template_tools,
    tool_call_grammar,
    tool_syntax,
)
from tests.support.chat_templates import GEMMA3_IT, LLAMA31_INSTRUCT, QWEN25_INSTRUCT, XML_TOOL_CALLS

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "The city's name", "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast <of a city> & more",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time"}},
]  # fmt: skip
EOS = "<|endoftext|>"
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


TEMPLATES = {
    ToolSyntax.HERMES: ChatTemplate(QWEN25_INSTRUCT, {"eos_token": "<|im_end|>"}, "Qwen2.5-Instruct"),
    ToolSyntax.LLAMA3_JSON: ChatTemplate(
        LLAMA31_INSTRUCT, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, "Llama-3.1-Instruct"),
}


def byte_level_tokenizer(tags_as_tokens: bool) -> Tokenizer:
    """A byte-level BPE vocabulary (every byte a token, so any text can be written) with merges
    learnt from tool-call text, so that tokens cross the grammar's boundaries; the Hermes tags as
    added tokens where Qwen2.5's vocabulary has them so."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    calls = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
             '{"name": "get_time", "parameters": {"unit": "celsius"}}', "The weather in Paris is sunny."]
    tokenizer.train_from_iterator(calls * 4, trainers.BpeTrainer(
        vocab_size=360, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))  # fmt: skip
    if tags_as_tokens:
        tokenizer.add_tokens(["<tool_call>", "</tool_call>"])  # added, not special, as Qwen2.5's
    return tokenizer


# The conversation in OpenAI's request format, and as transformers' documentation writes it for
# apply_chat_template (a call's arguments as a dict), independently.
OPENAI_CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Weather in Paris, 3 days?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny <25°C>"}'},
    {"role": "assistant", "content": "Sunny, about 25°C."},
    {"role": "user", "content": [{"type": "text", "text": "And the time"}, {"type": "text", "text": "there?"}]},
]  # fmt: skip
TRANSFORMERS_CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Weather in Paris, 3 days?"},
    {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny <25°C>"}'},
    {"role": "assistant", "content": "Sunny, about 25°C."},
    {"role": "user", "content": "And the time\nthere?"},
]  # fmt: skip


@pytest.mark.parametrize("syntax", list(ToolSyntax), ids=lambda syntax: syntax.value)
def test_a_conversation_with_tools_renders_as_transformers_renders_it(syntax):
    from transformers import PreTrainedTokenizerFast

    template = TEMPLATES[syntax]
    reference = PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer(True), **template.special_tokens)
    reference.chat_template = template.source
    messages = [ChatMessage.model_validate(message).for_template() for message in OPENAI_CHAT]
    tools = template_tools([Tool.model_validate(tool) for tool in TOOLS])
    for prompt in (True, False):
        rendered = template.render(messages, add_generation_prompt=prompt, tools=tools)
        assert rendered == reference.apply_chat_template(TRANSFORMERS_CHAT, tools=TOOLS, tokenize=False,
                                                         add_generation_prompt=prompt)
    # what transformers' tojson writes, and Jinja's own would not (it sorts keys, escapes < and &)
    assert '"description": "The forecast <of a city> & more"' in rendered
    arguments = '{"city": "Paris", "days": 3}'
    assert (f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
            if syntax is ToolSyntax.HERMES
            else f'{{"name": "get_weather", "parameters": {arguments}}}') in rendered
    assert tool_syntax(template) is syntax


def without_ids(calls: list[dict]) -> list[dict]:
    assert all(CALL_ID.match(call["id"]) for call in calls)
    return [{key: value for key, value in call.items() if key != "id"} for call in calls]


def call(name: str, arguments: str) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# (the model's text, its content ("same": the whole text), its calls less their ids)
HERMES_ANSWERS = {
    "one call": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        None, [call("get_weather", '{"city": "Paris", "days": 3}')]),
    "several calls": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Nice","days":1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
        None, [call("get_weather", '{"city": "Nice", "days": 1}'), call("get_time", "{}")]),
    "text before a call": (
        'Let me look.\n\n<tool_call>\n{"arguments": {"city": "Zürich"}, "name": "get_weather"}\n</tool_call>',
        "Let me look.", [call("get_weather", '{"city": "Zürich"}')]),
    "broken JSON": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', "same", []),
    "no arguments": ('<tool_call>\n{"name": "get_time"}\n</tool_call>', "same", []),
    "never closed": ('<tool_call>\n{"name": "get_time", "arguments": {}}', "same", []),
    "a call, then a broken one": (
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name"\n</tool_call>',
        '<tool_call>\n{"name"\n</tool_call>', [call("get_time", "{}")]),
    "text with a tag's start": ("Tags look like <tool or <tool_cal, but\n  these\n are text.\n", "same", []),
}  # fmt: skip
LLAMA_ANSWERS = {
    "one call": ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None,
                 [call("get_weather", '{"city": "Paris", "days": 3}')]),
    "after the python tag": ('<|python_tag|>{"name": "get_time", "parameters": {}}', None,
                             [call("get_time", "{}")]),
    "several calls": (
        ' {"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Rome"}}\n',
        None, [call("get_time", "{}"), call("get_weather", '{"city": "Rome"}')]),
    "JSON that is no call": ('{"city": "Paris"}', "same", []),
    "broken JSON": ('{"name": "get_time", "parameters": {}', "same", []),
    "text": ("  It is sunny {mostly}.", "same", []),
    "a tag's start": ("<|python", "same", []),
}  # fmt: skip
ANSWERS = [(ToolSyntax.HERMES, name, *answer) for name, answer in HERMES_ANSWERS.items()] + [
    (ToolSyntax.LLAMA3_JSON, name, *answer) for name, answer in LLAMA_ANSWERS.items()]


@pytest.mark.parametrize("syntax, name, text, content, calls", ANSWERS,
                         ids=[f"{answer[0].value}: {answer[1]}" for answer in ANSWERS])
def test_the_answer_reads_back_as_content_and_calls(syntax, name, text, content, calls):
    parsed_content, parsed_calls = parse_tool_calls(syntax, text)
    assert parsed_content == (text if content == "same" else content)
    assert without_ids(parsed_calls) == calls
    assert len({call["id"] for call in parsed_calls}) == len(parsed_calls)
    stream = ToolCallStream.of(syntax)
    stream.feed(text)
    stream.finish()
    assert stream.finish_reason("stop") == ("tool_calls" if calls else "stop")
    assert stream.finish_reason("length") == "length"


@pytest.mark.parametrize("syntax, name, text, content, calls", ANSWERS,
                         ids=[f"{answer[0].value}: {answer[1]}" for answer in ANSWERS])
def test_streamed_in_any_split_the_deltas_join_to_the_whole_answer(syntax, name, text, content, calls):
    whole_content, whole_calls = parse_tool_calls(syntax, text)
    rng = np.random.default_rng(7)
    for _ in range(20):
        cuts = rng.choice(np.arange(1, len(text)), size=rng.integers(1, min(12, len(text))), replace=False)
        bounds = [0, *sorted(cuts), len(text)]
        stream = ToolCallStream.of(syntax)
        deltas = [delta for start, end in zip(bounds, bounds[1:]) for delta in stream.feed(text[start:end])]
        deltas += stream.finish()
        streamed_content, streamed_calls = joined_deltas(deltas)
        assert streamed_content == whole_content
        assert without_ids(streamed_calls) == without_ids(whole_calls)
        # each call as OpenAI streams one: index, id, type and name first, then its arguments
        pieces = [piece for delta in deltas for piece in delta.get("tool_calls", [])]
        assert [piece["index"] for piece in pieces] == [index for index in range(len(calls)) for _ in range(2)]
        for first, rest in zip(pieces[::2], pieces[1::2]):
            assert first["type"] == "function" and first["function"]["arguments"] == "" and "id" in first
            assert set(rest) == {"index", "function"} and set(rest["function"]) == {"arguments"}
        assert all(set(delta) in ({"content"}, {"tool_calls"}) for delta in deltas)


def test_content_streams_as_it_comes_holding_back_only_what_may_begin_a_call():
    hermes = ToolCallStream.of(ToolSyntax.HERMES)
    assert hermes.feed("It is sunny") == [{"content": "It is sunny"}]
    assert hermes.feed(" in <tool") == [{"content": " in"}]  # the space waits: a call may follow
    assert hermes.feed("s") == [{"content": " <tools"}]
    llama = ToolCallStream.of(ToolSyntax.LLAMA3_JSON)
    assert llama.feed(" <|py") == []
    assert llama.feed("thon is") == [{"content": " <|python is"}]
    assert llama.feed(" fun") == [{"content": " fun"}]


# grammar: (the syntax, the Hermes tags as added tokens of the vocabulary)
VOCABULARIES = [(ToolSyntax.HERMES, True), (ToolSyntax.HERMES, False), (ToolSyntax.LLAMA3_JSON, False)]


@pytest.mark.parametrize("choice", ["required", "get_weather", "get_time"])
@pytest.mark.parametrize("syntax, tags_as_tokens", VOCABULARIES,
                         ids=["hermes, tags as tokens", "hermes", "llama3_json"])
def test_a_forced_call_under_random_logits_reads_back_as_a_call_that_fits_its_schema(
        syntax, tags_as_tokens, choice):
    tokenizer = byte_level_tokenizer(tags_as_tokens)
    vocab, eos = tokenizer.get_vocab_size(), tokenizer.token_to_id(EOS)
    tools = [Tool.model_validate(tool) for tool in TOOLS]
    if choice != "required":
        choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": choice}})
    added = [token.content for token in tokenizer.get_added_tokens_decoder().values()]
    grammar = tool_call_grammar(syntax, tools, choice, added)
    ll_tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab, eos_token=eos)
    no_parameters = {"type": "object", "maxProperties": 0}
    schemas = {tool.function.name: tool.function.parameters or no_parameters for tool in tools}
    bitmask, call_counts = allocate_token_bitmask(1, vocab), []
    for seed in range(4):
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        rng, tokens = np.random.default_rng(seed), []
        while len(tokens) < 500:
            fill_next_token_bitmask(matcher, bitmask)
            logits = rng.standard_normal((1, vocab)).astype(np.float32)
            apply_token_bitmask_inplace(logits, bitmask)
            token = int(np.argmax(logits))
            if token == eos:
                break
            assert matcher.consume_token(token), matcher.get_error()
            tokens.append(token)
        assert token == eos and matcher.is_accepting()
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        content, calls = parse_tool_calls(syntax, text)
        assert content is None and calls, text
        names = ["get_weather", "get_time"] if choice == "required" else [choice.function.name]
        call_counts.append(len(calls))
        for made in calls:
            assert made["function"]["name"] in names
            jsonschema.validate(json.loads(made["function"]["arguments"]), schemas[made["function"]["name"]])
        # written as the template writes calls, json.dumps' separators included
        key = "arguments" if syntax is ToolSyntax.HERMES else "parameters"
        written = [f'{{"name": "{made["function"]["name"]}", "{key}": {made["function"]["arguments"]}}}'
                   for made in calls]
        assert text == ("\n".join(f"<tool_call>\n{one}\n</tool_call>" for one in written)
                        if syntax is ToolSyntax.HERMES else written[0])
    # several calls where Hermes is required to call (Qwen2.5's template offers them), else one
    several = choice == "required" and syntax is ToolSyntax.HERMES
    assert (max(call_counts) > 1) if several else call_counts == [1] * 4, call_counts


def test_auto_and_none_are_not_constrained():
    tools = [Tool.model_validate(tool) for tool in TOOLS]
    for syntax in ToolSyntax:
        assert tool_call_grammar(syntax, tools, "auto", ()) is None
        assert tool_call_grammar(syntax, tools, "none", ()) is None


class Request(ToolFields):
    """The tool fields as a chat request holds them."""

    messages: list[ChatMessage]


def refusal(body: dict) -> tuple[str, str]:
    with pytest.raises(ValidationError) as refused:
        Request.model_validate({"messages": [{"role": "user", "content": "hi"}]} | body)
    first = refused.value.errors()[0]
    return ".".join(str(part) for part in first["loc"]), first["msg"]


def test_requests_openai_refuses_are_refused_naming_the_field():
    named = {"type": "function", "function": {"name": "get_wether"}}
    assert refusal({"tools": TOOLS, "tool_choice": named}) == (
        "tool_choice", "the function 'get_wether' is not among the tools (get_weather, get_time)")
    assert refusal({"tool_choice": "auto"}) == (
        "tool_choice", "tool_choice is only allowed when tools are given")
    assert refusal({"tools": []})[0] == "tools"
    spaced = {"type": "function", "function": {"name": "has space"}}
    assert refusal({"tools": [spaced]})[0] == "tools.0.function.name"
    assert refusal({"messages": [{"role": "user", "content": None}]}) == (
        "messages.0", "content is required, unless an assistant message has tool_calls")
    assert refusal({"messages": [{"role": "tool", "content": "22"}]}) == (
        "messages.0", "a tool message needs the tool_call_id of the call it answers")
    image = {"type": "image_url", "image_url": {"url": "x"}}
    assert refusal({"messages": [{"role": "user", "content": [image]}]}) == (
        "messages.0.content", "only text parts (type \"text\") are supported, not 'image_url'")
    bad_arguments = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{"}}
    assert refusal({"messages": [{"role": "assistant", "tool_calls": [bad_arguments]}]})[0] == (
        "messages.0.tool_calls.0.function.arguments")
    # and what is accepted; a null content reaches the template as "" (Qwen3's reads every one)
    assert ChatMessage.model_validate(OPENAI_CHAT[2]).for_template()["content"] == ""
    request = Request.model_validate({"messages": OPENAI_CHAT, "tools": TOOLS})
    assert request.resolved_tool_choice() == "auto"
    assert Request.model_validate({"messages": OPENAI_CHAT}).resolved_tool_choice() is None
    named = Request.model_validate({"messages": OPENAI_CHAT, "tools": TOOLS, "tool_choice": named | {
        "function": {"name": "get_time"}}}).resolved_tool_choice()
    assert named.function.name == "get_time"


def test_tools_for_a_template_without_tool_syntax_are_refused():
    with pytest.raises(PymlError, match=r"^the chat template of gemma-3-270m-it has no tool syntax"):
        tool_syntax(ChatTemplate(GEMMA3_IT, {"bos_token": "<bos>"}, "gemma-3-270m-it"))
    # <tool_call> tags around XML, not JSON: found by rendering a call, not by reading the source
    xml_calls = ChatTemplate(XML_TOOL_CALLS, {}, "xml-tool-calls")
    called = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]}
    assert "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n" in xml_calls.render([called], False)
    with pytest.raises(PymlError, match=r"^the chat template of xml-tool-calls has no tool syntax"):
        tool_syntax(xml_calls)


def test_a_schema_llguidance_cannot_compile_is_refused_naming_the_tool():
    def tools(parameters: dict, strict: bool | None) -> list[Tool]:
        return [Tool.model_validate(TOOLS[1]), Tool.model_validate(
            {"type": "function", "function": {"name": "odd", "parameters": parameters, "strict": strict}})]

    with pytest.raises(PymlError, match=r"^tools\.1\.function\.parameters: .*tuple"):
        tool_call_grammar(ToolSyntax.HERMES, tools({"type": "tuple"}, None), "required", ())
    # a keyword llguidance does not implement: ignored, unless the function is strict
    unknown_format = {"type": "object", "properties": {"day": {"type": "string", "format": "weekday"}}}
    for syntax in ToolSyntax:
        assert tool_call_grammar(syntax, tools(unknown_format, False), "required", ()) is not None
        with pytest.raises(PymlError, match=r"^tools\.1\.function\.parameters: .*weekday"):
            tool_call_grammar(syntax, tools(unknown_format, True), "required", ())
