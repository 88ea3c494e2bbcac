"""Supervised fine-tuning data: conversations, instructions or texts, read from JSON Lines or JSON
arrays and tokenised with the loss on the answers only.

`--data` names a `.jsonl` file (JSON Lines, one example a line), a `.json` file (a JSON array of
examples, or JSON Lines as Hugging Face `datasets` writes them with `to_json`), either suffix in
any case, or a folder of such files. Each example has one of these shapes (one shape per file):

    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}   a chat
    {"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}, ...]}     ShareGPT
    {"instruction": "...", "input": "...", "output": "..."}                        Alpaca
    {"prompt": [messages], "completion": [messages]}                               TRL's conversational
                                                                                   prompt-completion
    {"prompt": "...", "completion": "..."}                                         an instruction
    {"text": "..."}                                                                a text

ShareGPT, Alpaca and the conversational prompt-completion are read as the chats they stand for
(`chat_of`, which says whose mapping each follows). A chat is rendered with the model folder's chat
template (`pyml.formats.chat_template`). Its assistant tokens are found by rendering the
conversation's prefixes and comparing token ids, not by markers a template may lack: the tokens
the template adds for assistant turn i are those of `messages[:i + 1]` past those of
`messages[:i]` with the generation prompt, and they must be a prefix of the whole conversation's
tokens (a template that rewrites earlier turns is refused). Each turn's targets are its content and the special token that ends the turn; what the template
writes after it (a newline) is not a target. An instruction is the prompt (framed as the
tokenizer frames any text) followed by the completion and the end-of-text token; a text is all
targets. `--train-on all` makes every token a target.

An example of n tokens takes n - 1 places of a row of `seq` (inputs ids[:-1], next-token targets
ids[1:]). With packing (`--packing`, the default), several examples share a row, placed best fit
decreasing (longest first, each into the fullest row it fits, as TRL's "bfd" packing does): each
token's position restarts at 0 at its example's first token, and attention does not cross from one
example to another (`positions`, `DecoderModel.load_positions`), so a packed row computes exactly
what its examples would one by one. Without packing each example has a row of its own. Either way
the rest of a row is padding: no target, and no earlier token attends to it. Examples longer than
a row are truncated or dropped (`--long-examples`).
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pyml.errors import PymlError
from pyml.formats.chat_template import ROLES, ChatTemplate
from pyml.package.cpu.loss import IGNORED_TARGET
from pyml.train.data import EXAMPLE_SUFFIXES, TEXT_SUFFIXES

CHAT_SHAPES = ("chat", "ShareGPT", "Alpaca", "prompt-completion chat")
TRAIN_ON = ("assistant", "all")
LONG_EXAMPLES = ("truncate", "drop")
# ShareGPT's speakers as axolotl's chat_template strategy maps them by default (human and user to
# user, gpt and assistant to assistant, system to system) and TRL's maybe_convert_to_chatml does
# (human -> user, gpt -> assistant). Tool turns (axolotl's "tool", LLaMA-Factory's "observation"
# and "function_call") have no role in pyml's chats, and are refused by name.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
JSON_SPACE = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True)
class Example:
    where: str  # file:line
    ids: list[int]
    targets: list[bool]  # whether token i is a target (predicted from the tokens before it)


@dataclass(frozen=True)
class Record:
    where: str
    shape: str
    value: dict


@dataclass(frozen=True)
class Chat:
    messages: list[dict]  # {"role": one of ROLES, "content": str}
    answers_from: int  # the assistant turns from this message on are targets


def is_examples_file(path: Path) -> bool:
    return path.suffix.lower() in EXAMPLE_SUFFIXES


def is_examples(data: Path) -> bool:
    """Whether `--data` names examples (a .jsonl or .json file, or a folder of them) rather than
    text."""
    data = Path(data)
    if data.is_file():
        return is_examples_file(data)
    return data.is_dir() and any(is_examples_file(path) for path in data.rglob("*") if path.is_file())


def example_files(data: Path) -> list[Path]:
    data = Path(data)
    if data.is_file():
        if not is_examples_file(data):
            raise PymlError(f"{data}: examples are {' or '.join(EXAMPLE_SUFFIXES)} files (in any case), "
                            f"not {data.suffix or 'a file without a suffix'}")
        return [data]
    if not data.is_dir():
        raise PymlError(f"{data}: no such file or folder")
    files = sorted(path for path in data.rglob("*") if path.is_file())
    examples = [path for path in files if is_examples_file(path)]
    others = [path for path in files if path.suffix.lower() in TEXT_SUFFIXES]
    if not examples:
        raise PymlError(f"{data}: no examples in this folder (looked for {', '.join(EXAMPLE_SUFFIXES)})")
    if others:
        raise PymlError(f"{data} mixes examples ({examples[0].name}) with text files "
                        f"({others[0].name}): give one kind of data")
    return examples


def read_records(path: Path) -> list[Record]:
    """The examples of one .jsonl or .json file, each checked for its shape; every one has the
    same shape, and each is named by its file and the line it starts on."""
    records = [Record(where, shape_of(value, where), value) for where, value in read_values(path)]
    if not records:
        raise PymlError(f"{path}: holds no examples")
    first = records[0]
    for record in records[1:]:
        if record.shape != first.shape:
            raise PymlError(f"{record.where}: a {record.shape} example in a file of {first.shape} "
                            f"examples ({first.where}): one shape per file")
    return records


def read_values(path: Path) -> list[tuple[str, object]]:
    """(file:line, value) of each JSON value of a .jsonl or .json file (`pyml.train.preference`
    reads its pairs with it too)."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: without the byte-order mark Notepad writes
    except UnicodeDecodeError as error:
        raise PymlError(f"{path}: not UTF-8 text (byte {error.start})") from None
    except OSError as error:
        raise PymlError(f"{path}: cannot read: {error.strerror}") from None
    return json_file_values(text, path) if path.suffix.lower() == ".json" else json_lines_values(text, path)


def json_lines_values(text: str, path: Path) -> list[tuple[str, object]]:
    values = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            values.append((where, json.loads(line)))
        except ValueError as error:
            raise PymlError(f"{where}: not JSON ({error.msg} at column {error.colno})") from None
    return values


def json_file_values(text: str, path: Path) -> list[tuple[str, object]]:
    """A .json file's examples: a JSON array (how a list is saved with json.dump), or JSON Lines
    (what Hugging Face datasets' `to_json` writes by default, under a .json name)."""
    if text.lstrip().startswith("["):
        return json_array_values(text, path)
    first = next((line for line in text.splitlines() if line.strip()), None)
    if first is None:
        return []
    try:
        json.loads(first)
    except ValueError:
        raise PymlError(f"{path}: neither a JSON array of examples nor JSON Lines (one example a "
                        "line)") from None
    return json_lines_values(text, path)


def json_array_values(text: str, path: Path) -> list[tuple[str, object]]:
    try:
        json.loads(text)
    except json.JSONDecodeError as error:
        raise PymlError(f"{path}:{error.lineno}: not JSON ({error.msg} at column {error.colno})") from None
    # The array is well formed, but json.loads keeps no positions: decode it again item by item to
    # name each by the line it starts on, as a JSON Lines example is named.
    decoder = json.JSONDecoder()
    values, line, counted = [], 1, 0
    at = JSON_SPACE.match(text, text.index("[") + 1).end()
    while text[at] != "]":
        line, counted = line + text.count("\n", counted, at), at
        value, end = decoder.raw_decode(text, at)
        values.append((f"{path}:{line}", value))
        at = JSON_SPACE.match(text, end).end()
        at = JSON_SPACE.match(text, at + 1).end() if text[at] == "," else at
    return values


def shape_of(value: object, where: str) -> str:
    shape = shape_by_keys(value) if isinstance(value, dict) else None
    if shape is None:
        raise PymlError(f"{where}: an example is an object with \"messages\" (a chat), \"conversations\" "
                        "(ShareGPT), \"instruction\" and \"output\" (Alpaca), \"prompt\" and "
                        "\"completion\", or \"text\"")
    if shape in CHAT_SHAPES:
        chat_of(value, shape, where)
    else:
        for key in ("prompt", "completion") if shape == "instruction" else ("text",):
            required_string(value, key, where)
    return shape


def shape_by_keys(value: dict) -> str | None:
    """The shape an example's keys name, the first that fits in this order (an Alpaca line often
    carries its formatted prompt as "text" too: the Alpaca fields are what is trained on)."""
    if "messages" in value:
        return "chat"
    if "conversations" in value:
        return "ShareGPT"
    if "instruction" in value and "output" in value:
        return "Alpaca"
    if "prompt" in value and "completion" in value:
        lists = any(isinstance(value[key], list) for key in ("prompt", "completion"))
        return "prompt-completion chat" if lists else "instruction"
    return "text" if "text" in value else None


def chat_of(value: dict, shape: str, where: str) -> Chat:
    """The conversation of an example of a chat shape, checked."""
    if shape == "chat":
        return Chat(messages_of(value, "messages", where), 0)
    if shape == "ShareGPT":
        return Chat(sharegpt_messages(value, where), 0)
    if shape == "Alpaca":
        return Chat(alpaca_messages(value, where), 0)
    # TRL's conversational prompt-completion: the chat is the prompt followed by the completion,
    # and only the completion is trained on (TRL's completion_only_loss), so an assistant turn in
    # the prompt is context, not a target.
    prompt, completion = (messages_of(value, key, where) for key in ("prompt", "completion"))
    return Chat(prompt + completion, len(prompt))


def messages_of(value: dict, key: str, where: str) -> list[dict]:
    messages = value[key]
    if not isinstance(messages, list) or not messages:
        raise PymlError(f"{where}: \"{key}\" must be a non-empty list of messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise PymlError(f"{where}: {key}[{index}] must have a string \"content\"")
        if message.get("role") not in ROLES:
            raise PymlError(f"{where}: {key}[{index}] has role {message.get('role')!r}; the roles "
                            f"are {', '.join(ROLES)}")
    return messages


def required_string(value: dict, key: str, where: str) -> str:
    if not isinstance(value[key], str):
        raise PymlError(f"{where}: \"{key}\" must be a string")
    return value[key]


def optional_string(value: dict, key: str, where: str) -> str:
    """An optional field; null counts as absent, as `datasets` writes a missing value."""
    field = value.get(key)
    if field is not None and not isinstance(field, str):
        raise PymlError(f"{where}: \"{key}\" must be a string")
    return field or ""


def sharegpt_messages(value: dict, where: str) -> list[dict]:
    turns = value["conversations"]
    if not isinstance(turns, list) or not turns:
        raise PymlError(f"{where}: \"conversations\" must be a non-empty list of turns")
    # A "system" field beside the turns, as LLaMA-Factory's sharegpt layout has, is the first turn.
    system = optional_string(value, "system", where)
    messages = [{"role": "system", "content": system}] if system else []
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise PymlError(f"{where}: conversations[{index}] must have a string \"value\"")
        role = SHAREGPT_ROLES.get(turn.get("from"))
        if role is None:
            raise PymlError(f"{where}: conversations[{index}] is from {turn.get('from')!r}; the "
                            f"speakers are {', '.join(SHAREGPT_ROLES)}")
        messages.append({"role": role, "content": turn["value"]})
    return messages


def alpaca_messages(value: dict, where: str) -> list[dict]:
    instruction, output = (required_string(value, key, where) for key in ("instruction", "output"))
    # The request as axolotl's Alpaca chat styles write it ("{instruction}\n{input}") and
    # LLaMA-Factory's AlpacaDatasetConverter builds its user turn ("\n".join of the non-empty two);
    # an optional "system" is the system turn, as axolotl's alpaca_w_system takes it.
    request = "\n".join(part for part in (instruction, optional_string(value, "input", where)) if part)
    system = optional_string(value, "system", where)
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": request}, {"role": "assistant", "content": output}]


class Tokenization:
    """What turns a record into an Example: the folder's tokenizer, chat template and end-of-text
    id, and whether only the answers are targets."""

    def __init__(self, tokenizer, template: ChatTemplate | None, eos_id: int, train_on: str):
        if train_on not in TRAIN_ON:
            raise PymlError(f"--train-on must be one of {', '.join(TRAIN_ON)}, not {train_on!r}")
        self.tokenizer, self.template, self.eos_id = tokenizer, template, eos_id
        self.train_on = train_on
        self.special_ids = {index for index, token in tokenizer.get_added_tokens_decoder().items()
                            if token.special}

    def encode(self, text: str, framed: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=framed).ids

    def example(self, record: Record) -> Example:
        value, where = record.value, record.where
        if record.shape == "text":
            ids = self.encode(value["text"], framed=True) + [self.eos_id]
            return Example(where, ids, [True] * len(ids))
        if record.shape == "instruction":
            prompt = self.encode(value["prompt"], framed=True)
            answer = self.encode(value["completion"]) + [self.eos_id]
            everything = self.train_on == "all"
            return Example(where, prompt + answer, [everything] * len(prompt) + [True] * len(answer))
        if self.template is None:
            raise PymlError(f"{where}: a {record.shape} example is a chat, but the model folder has no "
                            "chat template (a base model): give {\"text\"} or {\"prompt\", \"completion\"} "
                            "examples")
        return self.chat(chat_of(value, record.shape, where), where)

    def chat(self, chat: Chat, where: str) -> Example:
        messages = chat.messages
        ids = self.encode(self.template.render(messages, add_generation_prompt=False))
        if self.train_on == "all":
            return Example(where, ids, [True] * len(ids))
        targets = [False] * len(ids)
        turns = [index for index, message in enumerate(messages)
                 if message["role"] == "assistant" and index >= chat.answers_from]
        if not turns:
            raise PymlError(f"{where}: no assistant turn to train on (or train with --train-on all)")
        for index in turns:
            before = self.encode(self.template.render(messages[:index], add_generation_prompt=True))
            through = self.encode(self.template.render(messages[: index + 1], add_generation_prompt=False))
            if through[: len(before)] != before or ids[: len(through)] != through:
                raise PymlError(
                    f"{where}: the chat template does not render this conversation's turns as "
                    f"prefixes of the whole (assistant turn messages[{index}]), so its tokens cannot "
                    "be found: the template rewrites earlier turns")
            span = range(len(before), len(through))
            ends = [position for position in span if ids[position] in self.special_ids]
            for position in span if not ends else range(span.start, ends[-1] + 1):
                targets[position] = True
        return Example(where, ids, targets)


@dataclass(frozen=True)
class Rows:
    inputs: np.ndarray  # (n, seq) int64
    targets: np.ndarray  # (n, seq) int64, IGNORED_TARGET where nothing is predicted
    positions: np.ndarray  # (n, seq) int64: each token's position in its example
    examples: int  # the examples the rows hold
    truncated: int
    dropped: int

    @property
    def target_count(self) -> int:
        return int(np.count_nonzero(self.targets != IGNORED_TARGET))


def rows(examples: list[Example], seq: int, pad_id: int, long_examples: str, packing: bool) -> Rows:
    """Rows of `seq` places holding the examples: one each, or packed several to a row; an example
    longer than seq + 1 tokens is truncated or dropped, and one left with no target is dropped."""
    if long_examples not in LONG_EXAMPLES:
        raise PymlError(f"--long-examples must be one of {', '.join(LONG_EXAMPLES)}, not {long_examples!r}")
    kept, truncated, dropped = [], 0, 0
    for example in examples:
        ids, targeted = example.ids, example.targets
        if len(ids) > seq + 1:
            if long_examples == "drop":
                dropped += 1
                continue
            ids, targeted, truncated = ids[: seq + 1], targeted[: seq + 1], truncated + 1
        if not any(targeted[1:]):
            dropped += 1
            continue
        kept.append((ids, targeted))
    if not kept:
        raise PymlError(f"no example fits a window of {seq} tokens with a target in it "
                        f"({dropped} dropped): use a longer --seq or --long-examples truncate")
    groups = best_fit_decreasing([len(ids) - 1 for ids, _ in kept], seq) if packing else [
        [index] for index in range(len(kept))]
    inputs = np.full((len(groups), seq), pad_id, dtype=np.int64)
    targets = np.full((len(groups), seq), IGNORED_TARGET, dtype=np.int64)
    positions = np.zeros((len(groups), seq), dtype=np.int64)
    for row, group in enumerate(groups):
        start = 0
        for index in group:
            ids, targeted = kept[index]
            places = len(ids) - 1
            inputs[row, start : start + places] = ids[:-1]
            for position in range(1, len(ids)):
                if targeted[position]:
                    targets[row, start + position - 1] = ids[position]
            positions[row, start : start + places] = np.arange(places)
            start += places
        positions[row, start:] = np.arange(seq - start)  # the padding: an example of its own
    return Rows(inputs, targets, positions, len(kept), truncated, dropped)


def best_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Indices of `sizes` grouped into bins of `capacity`: the largest first, each into the bin
    with the least room that holds it (a new bin when none does); the bins in the order opened,
    each listing its items in the order placed. Deterministic: ties keep the input order."""
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, bin), sorted
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        at = bisect.bisect_left(room, (sizes[index], -1))
        if at == len(room):
            bins.append([index])
            bisect.insort(room, (capacity - sizes[index], len(bins) - 1))
            continue
        left, chosen = room.pop(at)
        bins[chosen].append(index)
        bisect.insort(room, (left - sizes[index], chosen))
    return bins


def split_examples(examples: list[Example], held_out_fraction: float, seed: int
                   ) -> tuple[list[Example], list[Example]]:
    """(train, held-out): a seeded choice of whole examples, at least one on each side."""
    if len(examples) < 2:
        raise PymlError(f"{examples[0].where if examples else 'the data'}: one example cannot be "
                        "split into training and held-out data: give more, or --eval-data")
    count = min(len(examples) - 1, max(1, round(held_out_fraction * len(examples))))
    held_out = set(np.random.default_rng(seed).permutation(len(examples))[:count].tolist())
    return ([example for index, example in enumerate(examples) if index not in held_out],
            [example for index, example in enumerate(examples) if index in held_out])


def load_examples(data: Path, tokenization: Tokenization) -> list[Example]:
    return [tokenization.example(record) for path in example_files(data) for record in read_records(path)]
