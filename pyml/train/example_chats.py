"""Example chat data for a first fine-tune, from any folder: one question and answer per topic of
CPython's reference docs (`pydoc_data`, shipped with every CPython), as JSONL chats that
`pyml train --data` reads. The README's quick start and `make demo` train on it.

The question names the topic ("What does the `with` statement do?"); the answer is the topic's
first paragraph of prose. A seeded eighth of the topics is held out, and always the `with`
statement, the question `make demo` asks before and after: the held-out loss and that answer are
on questions the run never saw.

    python -m pyml.train.example_chats OUT_DIR   # writes OUT_DIR/train.jsonl and OUT_DIR/held_out.jsonl
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


def write(out: Path) -> None:
    """Write out/train.jsonl and out/held_out.jsonl (replacing them), each atomically."""
    examples = chats()
    order = list(range(len(examples)))
    random.Random(SEED).shuffle(order)
    held_out = set(order[: len(examples) // HELD_OUT_SHARE]) | {
        index for index, example in enumerate(examples)
        if example["messages"][0]["content"] == question(DEMO_TOPIC)}
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, keep in (("train.jsonl", lambda i: i not in held_out), ("held_out.jsonl", lambda i: i in held_out)):
            lines = [json.dumps(example) + "\n" for index, example in enumerate(examples) if keep(index)]
            content = "".join(lines).encode("utf-8")
            atomic_write(out / name, lambda handle, content=content: handle.write(content))
            print(f"wrote {out / name}: {len(lines)} chats")
    except OSError as error:
        raise PymlError(f"{out}: cannot write the example chats: {os_error(error)}") from None


def main(arguments: list[str]) -> int:
    if len(arguments) != 1:
        print("usage: python -m pyml.train.example_chats OUT_DIR", file=sys.stderr)
        return 2
    try:
        write(Path(arguments[0]))
    except PymlError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
