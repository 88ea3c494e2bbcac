"""OpenAI tool calling for `pyml serve`: the request's tools and messages, the tool-call syntax of
a model folder's chat template, the model's calls read back from its text (whole or streamed),
and the grammar that forces a call when the request requires one.

A request: `tools` ([{"type": "function", "function": {"name", "description", "parameters",
"strict"}}]) and `tool_choice` ("auto", the default with tools; "none"; "required"; or
{"type": "function", "function": {"name"}}); its messages may hold an assistant's calls
(`tool_calls`, content then possibly null) and the tools' answers (role "tool", `tool_call_id`).
The template receives them as transformers' `apply_chat_template` does: the tools as given, each
call's arguments as a dict (Qwen2.5's template writes `tool_call.arguments | tojson`, Llama 3.1's
indexes `message.tool_calls[0].function`), and no key whose value is null, as transformers drops
them (Llama 3.1's template tests `'tool_calls' in message`); but a null content is "", as vLLM
passes it, since templates such as Qwen3's read the content of every assistant message.

The syntaxes read, each as a template writes a call and its model was trained to:
- Hermes (Qwen2.5, Qwen3, Hermes 2/3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call, possibly after some text;
- Llama 3.1's JSON: the whole answer is `{"name": ..., "parameters": {...}}`, possibly after
  `<|python_tag|>`, several calls separated by ";" (as vLLM's llama3_json parser reads them).
A block or answer that looks like a call but does not parse as one stays content, as vLLM's
parsers leave it. Whitespace touching a call is dropped, so that calls alone give content None.

`tool_choice` "none" renders the tools all the same and reads no call from the answer: what vLLM
does unless started with --exclude-tools-when-tool-choice-none. The model still sees the functions
that its earlier calls in the conversation used (Azure's documentation of this API: the answer
"may still be influenced by the provided tool definitions"); a model that writes a call anyway
answers with that text as content. "required" and a named function are forced by a grammar
(llguidance's Lark, with the function's parameters as an inline JSON schema) in the template's
own syntax, written as its template writes calls (`written_call`: json.dumps' separators).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pyml.errors import PymlError
from pyml.formats.chat_template import ChatTemplate
from pyml.serve.constrained import json_schema_grammar, lark_grammar


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none means no parameters
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(BaseModel):
    """The tool fields of a chat request, checked as OpenAI checks them: a tool_choice needs
    tools, and a named one must be among them."""

    model_config = ConfigDict(extra="ignore")
    tools: list[Tool] | None = Field(None, min_length=1)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True  # False: "required" means exactly one call

    @field_validator("tool_choice")
    @classmethod
    def choice_among_tools(cls, choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        if choice is None or "tools" not in info.data:  # tools itself failed, and says so
            return choice
        tools = info.data["tools"]
        if not tools:
            raise PydanticCustomError("tool_choice_without_tools",
                                      "tool_choice is only allowed when tools are given")
        names = [tool.function.name for tool in tools]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise PydanticCustomError(
                "unknown_tool", "the function {name} is not among the tools ({names})",
                {"name": repr(choice.function.name), "names": ", ".join(names)})
        return choice

    def resolved_tool_choice(self) -> ToolChoice | None:
        """None without tools; "auto" where tools come without a choice, as OpenAI defaults."""
        if not self.tools:
            return None
        return self.tool_choice or "auto"


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str  # a JSON object, as text: what the call's answer gave

    @field_validator("arguments")
    @classmethod
    def is_json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise PydanticCustomError("arguments_not_json_object",
                                      "must be a JSON object as text, as the tool call gave it")
        return arguments


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message of a chat request. Content is a string, or OpenAI's list of text parts, joined
    with newlines as vLLM joins them for templates that take a string; it may be null only in an
    assistant message with tool_calls."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def joined_text_parts(cls, content: Any) -> Any:
        if not isinstance(content, list):
            return content
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise PydanticCustomError(
                    "unsupported_content_part",
                    "only text parts (type \"text\") are supported, not {kind}",
                    {"kind": repr(kind)})
            texts.append(part["text"])
        return "\n".join(texts)

    @model_validator(mode="after")
    def fits_its_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("tool_calls_not_assistant",
                                      "only assistant messages have tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("content_missing",
                                      "content is required, unless an assistant message has tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError("tool_call_id_missing",
                                      "a tool message needs the tool_call_id of the call it answers")
        return self

    def for_template(self) -> dict:
        message: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name,
                              "arguments": json.loads(call.function.arguments)}}
                for call in self.tool_calls]  # fmt: skip
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as the template receives them: as the request gave them, less null fields."""
    return None if tools is None else [tool.model_dump(exclude_none=True) for tool in tools]


class ToolSyntax(Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
CALL_SEPARATOR = re.compile(r"\s*;\s*")  # between Llama 3.1's calls, as vLLM reads them


def written_call(syntax: ToolSyntax, name: str, arguments: dict) -> str:
    """A call as the templates of `syntax` write it (and their models were trained to)."""
    name, arguments = (json.dumps(value, ensure_ascii=False) for value in (name, arguments))
    if syntax is ToolSyntax.HERMES:
        return f'{HERMES_OPEN}\n{{"name": {name}, "arguments": {arguments}}}\n{HERMES_CLOSE}'
    return f'{{"name": {name}, "parameters": {arguments}}}'


PROBE_ARGUMENTS = {"probe_argument": 1}
PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_function", "description": "A probe.",
    "parameters": {"type": "object", "properties": {"probe_argument": {"type": "integer"}}}}}
PROBE_CHAT = [
    {"role": "user", "content": "Call the probe."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_probe", "type": "function",
         "function": {"name": "probe_function", "arguments": PROBE_ARGUMENTS}}]},
]  # fmt: skip


def tool_syntax(template: ChatTemplate) -> ToolSyntax:
    """How the template writes an assistant's call, found by rendering one: a template's source
    may name tags and keys in other ways (GLM 4.6 and Qwen3-Coder put XML in <tool_call> tags,
    Command R writes "parameters" under "tool_name")."""
    try:
        text = template.render(PROBE_CHAT, add_generation_prompt=False, tools=[PROBE_TOOL])
    except PymlError:
        text = ""
    for syntax in ToolSyntax:
        if written_call(syntax, "probe_function", PROBE_ARGUMENTS) in text:
            return syntax
    raise PymlError(f"the chat template of {template.where} has no tool syntax pyml reads (Hermes "
                    f"<tool_call> tags or Llama 3.1's JSON calls): send the request without tools")


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class ToolCallStream:
    """Reads the model's text as it comes: `feed` each piece and `finish` at the end; each returns
    the OpenAI chunk deltas ready so far, {"content": ...} or {"tool_calls": [...]}. A call is given
    out once its text is complete (its closing tag, or the end of a Llama answer): before then the
    text may still turn out to be no call, and then it is content, and a delta cannot be taken
    back. Text that may begin a call is held back until it is known. Joining the deltas gives
    what `parse_tool_calls` gives for the whole text, however the text was split."""

    def __init__(self):
        self.calls_made = 0

    @staticmethod
    def of(syntax: ToolSyntax) -> ToolCallStream:
        return HermesCallStream() if syntax is ToolSyntax.HERMES else LlamaJsonCallStream()

    def feed(self, text: str) -> list[dict]:
        raise NotImplementedError

    def finish(self) -> list[dict]:
        raise NotImplementedError

    def finish_reason(self, reason: str) -> str:
        """The answer's finish_reason: "tool_calls" where it stopped after making calls."""
        return "tool_calls" if self.calls_made and reason == "stop" else reason

    def call_deltas(self, name: str, arguments: dict) -> list[dict]:
        """A call as OpenAI streams one: its id, type and name first, then its arguments."""
        index = self.calls_made
        self.calls_made += 1
        arguments_text = json.dumps(arguments, ensure_ascii=False)
        return [
            {"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                             "function": {"name": name, "arguments": ""}}]},
            {"tool_calls": [{"index": index, "function": {"arguments": arguments_text}}]},
        ]  # fmt: skip


class HermesCallStream(ToolCallStream):
    def __init__(self):
        super().__init__()
        self.held = ""  # text not yet read: an open <tool_call> block, or what may start one
        self.in_block = False
        self.space = ""  # whitespace after the last content, given out only if content follows
        self.after_call = False

    def feed(self, text: str) -> list[dict]:
        self.held += text
        deltas = []
        while True:
            if self.in_block:
                end = self.held.find(HERMES_CLOSE)
                if end < 0:
                    return deltas
                end += len(HERMES_CLOSE)
                block, self.held = self.held[:end], self.held[end:]
                self.in_block = False
                call = hermes_call(block[len(HERMES_OPEN):-len(HERMES_CLOSE)])
                if call is None:
                    deltas += self.content(block)
                else:
                    self.space, self.after_call = "", True
                    deltas += self.call_deltas(*call)
            else:
                start = self.held.find(HERMES_OPEN)
                if start < 0:
                    keep = partial_tag_length(self.held, HERMES_OPEN)
                    deltas += self.content(self.held[:len(self.held) - keep])
                    self.held = self.held[len(self.held) - keep:]
                    return deltas
                deltas += self.content(self.held[:start])
                self.held, self.in_block = self.held[start:], True

    def finish(self) -> list[dict]:
        deltas = self.content(self.held)  # an unclosed block, or a tag's start: content
        self.held, self.in_block = "", False
        if self.space and not self.after_call:
            deltas.append({"content": self.space})
        self.space = ""
        return deltas

    def content(self, text: str) -> list[dict]:
        words = text.rstrip()
        if not words:
            self.space += text
            return []
        piece = self.space + words
        if self.after_call:  # whitespace after a call belongs to no content
            piece = piece.lstrip()
        self.space, self.after_call = text[len(words):], False
        return [{"content": piece}]


class LlamaJsonCallStream(ToolCallStream):
    def __init__(self):
        super().__init__()
        self.held = ""
        self.answer: Literal["content", "calls"] | None = None  # None until its first characters tell

    def feed(self, text: str) -> list[dict]:
        if self.answer == "content":
            return [{"content": text}] if text else []
        self.held += text
        if self.answer is None:
            start = self.held.lstrip()
            if start.startswith(("{", PYTHON_TAG)):
                self.answer = "calls"  # held whole: only its end tells whether it parses
            elif start and not PYTHON_TAG.startswith(start):
                self.answer = "content"
                text, self.held = self.held, ""
                return [{"content": text}]
        return []

    def finish(self) -> list[dict]:
        text, self.held = self.held, ""
        calls = llama_json_calls(text) if self.answer == "calls" else None
        if calls is None:
            return [{"content": text}] if text else []
        return [delta for name, arguments in calls for delta in self.call_deltas(name, arguments)]


def hermes_call(text: str) -> tuple[str, dict] | None:
    """The name and arguments in a <tool_call> block, or None where it holds no call."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("name"), str) and isinstance(value.get("arguments"), dict):
        return value["name"], value["arguments"]
    return None


def llama_json_calls(text: str) -> list[tuple[str, dict]] | None:
    """The calls of a Llama 3.1 answer, or None where the answer is not calls alone."""
    text = text.strip().removeprefix(PYTHON_TAG).lstrip()
    decoder, calls, position = json.JSONDecoder(), [], 0
    while True:
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            return None
        arguments = value.get("parameters", value.get("arguments")) if isinstance(value, dict) else None
        if not (isinstance(arguments, dict) and isinstance(value.get("name"), str)):
            return None
        calls.append((value["name"], arguments))
        if position == len(text):
            return calls
        separator = CALL_SEPARATOR.match(text, position)
        if separator is None:
            return None
        position = separator.end()


def partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    sizes = range(min(len(text), len(tag) - 1), 0, -1)
    return next((size for size in sizes if tag.startswith(text[-size:])), 0)


def joined_deltas(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    """A message's content (None where empty) and tool_calls, from its stream's deltas."""
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", []):
            if "id" in piece:
                calls.append({"id": piece["id"], "type": "function",
                              "function": {"name": piece["function"]["name"], "arguments": ""}})
            calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
    return content or None, calls


def parse_tool_calls(syntax: ToolSyntax, text: str) -> tuple[str | None, list[dict]]:
    """The whole answer's content (None where it has none) and its calls, as OpenAI's message
    has them: {"id": "call_<24 hex>", "type": "function", "function": {"name", "arguments": JSON}}."""
    stream = ToolCallStream.of(syntax)
    return joined_deltas(stream.feed(text) + stream.finish())


# The JSON of a forced call, written as json.dumps writes it (and so as the templates write calls
# with tojson): no free whitespace, ", " between items, ": " after keys.
JSON_AS_DUMPED = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_call_grammar(syntax: ToolSyntax, tools: list[Tool], choice: ToolChoice,
                      added_tokens: Collection[str], parallel: bool = True) -> str | None:
    """The grammar (llguidance's, as pyml.serve.constrained makes them) of the answers `choice`
    allows: None for "auto" and "none"; for "required", one or more calls of any of the tools
    (one where not `parallel`, and in Llama 3.1's syntax, whose template refuses several); for a
    named function, one call of it. `added_tokens` are the contents of the tokenizer's added tokens (tokenizer.json's
    added_tokens): llguidance matches those only by name, as `<tool_call>`, never as text, so a
    tag that is one (as Qwen2.5's are) is written so. Each function's parameters are checked as
    response_format's schemas are, strict or not as the function says, and an error names them."""
    if choice in ("auto", "none"):
        return None
    chosen = [(index, tool.function) for index, tool in enumerate(tools)
              if choice == "required" or tool.function.name == choice.function.name]
    for index, function in chosen:
        json_schema_grammar(function.parameters or NO_PARAMETERS, strict=bool(function.strict),
                            field=f"tools.{index}.function.parameters")
    arguments_key = "arguments" if syntax is ToolSyntax.HERMES else "parameters"
    calls = [{"type": "object",
              "properties": {"name": {"const": function.name},
                             arguments_key: function.parameters or NO_PARAMETERS},
              "required": ["name", arguments_key], "additionalProperties": False}
             for _, function in chosen]  # fmt: skip
    # a strict function's schema passed the check above unlenient: leniency changes nothing in it
    lenient = not all(function.strict for _, function in chosen)
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}),
              "x-guidance": JSON_AS_DUMPED | {"lenient": lenient}}
    if syntax is ToolSyntax.LLAMA3_JSON:
        return lark_grammar(f"start: %json {json.dumps(schema)}\n", "tools")
    several = ' ("\\n" call)*' if choice == "required" and parallel else ""
    open_tag, close_tag = (tag if tag in added_tokens else json.dumps(tag)
                           for tag in (HERMES_OPEN, HERMES_CLOSE))
    return lark_grammar(f"start: call{several}\n"
                        f'call: {open_tag} "\\n" json_call "\\n" {close_tag}\n'
                        f"json_call: %json {json.dumps(schema)}\n", "tools")
