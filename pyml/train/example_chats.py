"""Example chat data for a first fine-tune, from any folder: one question and answer per topic of
CPython's reference docs (`pydoc_data`, shipped with every CPython), as JSONL chats that
`pyml train --data` reads. The README's quick start and `make demo` train on it.

The question names the topic ("What does the `with` statement do?"); the answer is the topic's
first paragraph of prose. A seeded eighth of the topics is held out, and always the `with`
statement, the question `make demo` asks before and after: the held-out loss and that answer are
on questions the run never saw.

    python -m pyml.train.example_chats OUT_DIR   # writes OUT_DIR/train.jsonl and OUT_DIR/held_out.jsonl

Preference pairs for `pyml train --method dpo|orpo` come from the same topics: the question, its
topic's paragraph as the chosen answer and, as the rejected one, the paragraph of a topic of a
third kept apart for wrong answers (`pairs`).

    python -m pyml.train.example_chats OUT_DIR --pairs   # OUT_DIR/train_pairs.jsonl, held_out_pairs.jsonl
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

from pyml.errors import PymlError
from pyml.outputs import atomic_write, os_error

HELD_OUT_SHARE = 8  # one topic in this many
SEED = 0
DEMO_TOPIC = 'The "with" statement'  # make demo's question


def backticked(title: str) -> str:
    """The docs quote code words as "with"; chat answers write `with`."""
    return re.sub(r'"([^"]+)"', r"`\1`", title)


def question(title: str) -> str:
    statement = re.fullmatch(r'The "(\w+)" statement', title)
    if statement:
        return f"What does the `{statement.group(1)}` statement do?"
    # "Mapping Types" reads "mapping types" mid-sentence; `dict` and Python stay as they are
    words = [word.lower() if word.istitle() and word != "Python" else word for word in backticked(title).split()]
    return f"What should I know about {' '.join(words)} in Python?"


def first_paragraph(text: str) -> str | None:
    """The first paragraph of prose after the title and its underline: not a grammar rule or an
    example (both indented), a numbered step or a method signature, joined onto one line."""
    for paragraph in text.split("\n\n")[1:]:
        prose = paragraph[:1] in ('"', "*") or paragraph[:1].isalpha()
        if prose and not paragraph.startswith("object.") and len(paragraph) >= 80:
            joined = re.sub(r"-\n\s*", "-", paragraph)  # "built-\nin" was wrapped at its hyphen
            return backticked(" ".join(line.strip() for line in joined.splitlines()))
    return None


def chats() -> list[dict]:
    from pydoc_data.topics import topics

    seen, examples = set(), []
    for name in sorted(topics):
        title = topics[name].split("\n", 1)[0].strip()
        answer = first_paragraph(topics[name])
        if title in seen or answer is None:  # "else" is documented under the `if` statement
            continue
        seen.add(title)
        examples.append({"messages": [{"role": "user", "content": question(title)},
                                      {"role": "assistant", "content": answer}]})
    return examples


# Every WRONG_ANSWER_SHARE-th topic is not asked about: its answer is a wrong answer to the others'
# questions, so no answer is ever both a chosen and a rejected one (which would push it up and
# down at once)
WRONG_ANSWER_SHARE = 3


def pairs() -> list[dict]:
    """One {"prompt", "chosen", "rejected"} pair (TRL's conversational shape) per topic of
    `chats()` but every WRONG_ANSWER_SHARE-th: the question, its topic's answer, and as the wrong
    answer one of those other topics' answers, in turn."""
    examples = chats()
    wrong = [example for index, example in enumerate(examples) if index % WRONG_ANSWER_SHARE == 2
             and example["messages"][0]["content"] != question(DEMO_TOPIC)]
    asked = [example for example in examples if example not in wrong]
    return [{"prompt": example["messages"][:1], "chosen": example["messages"][1:],
             "rejected": wrong[index % len(wrong)]["messages"][1:]} for index, example in enumerate(asked)]


def write(out: Path, as_pairs: bool = False) -> None:
    """Write out/train.jsonl and out/held_out.jsonl (replacing them), each atomically; with
    `as_pairs`, the preference pairs as out/train_pairs.jsonl and out/held_out_pairs.jsonl, held
    out by the same topics."""
    examples = pairs() if as_pairs else chats()
    order = list(range(len(examples)))
    random.Random(SEED).shuffle(order)
    held_out = set(order[: len(examples) // HELD_OUT_SHARE]) | {
        index for index, example in enumerate(examples)
        if (example["prompt"] if as_pairs else example["messages"])[0]["content"] == question(DEMO_TOPIC)}
    names = ("train_pairs.jsonl", "held_out_pairs.jsonl") if as_pairs else ("train.jsonl", "held_out.jsonl")
    what = "pairs" if as_pairs else "chats"
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, keep in ((names[0], lambda i: i not in held_out), (names[1], lambda i: i in held_out)):
            lines = [json.dumps(example) + "\n" for index, example in enumerate(examples) if keep(index)]
            content = "".join(lines).encode("utf-8")
            atomic_write(out / name, lambda handle, content=content: handle.write(content))
            print(f"wrote {out / name}: {len(lines)} {what}")
    except OSError as error:
        raise PymlError(f"{out}: cannot write the example chats: {os_error(error)}") from None


def main(arguments: list[str]) -> int:
    as_pairs = arguments[1:] == ["--pairs"]
    if len(arguments) != 1 and not as_pairs:
        print("usage: python -m pyml.train.example_chats OUT_DIR [--pairs]", file=sys.stderr)
        return 2
    try:
        write(Path(arguments[0]), as_pairs)
    except PymlError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
