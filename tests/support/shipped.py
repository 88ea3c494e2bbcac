"""Each shipped family's real model, our generated package's models of it and transformers'
answers, each made once per test module when a test first asks (the `shipped` fixture of
tests/conftest.py)."""

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from pydoc_data.topics import topics

import torch

from pyml.generate import decoding as generation
from tests.support.families import FAMILIES

NEW_TOKENS = 32


@dataclass(frozen=True)
class Prompt:
    text: str
    chat: bool = False


PROMPTS = {
    "smollm2": {"chat": Prompt("What is the capital of France?", chat=True)},
    "gemma3": {
        "prose": Prompt("The capital of France is"),
        "code": Prompt('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
        # CPython's own documentation of class definitions: 681 tokens, past the window
        "long": Prompt(topics["class"]),
    },
}


class Shipped:
    """One family's imported folder, our models of it and transformers' answers, each made once.

    `fixtures` resolves a fixture for the test that asks now (pytest's `request.getfixturevalue`),
    so that transformers' model is loaded only by the tests that need it."""

    def __init__(self, family: str):
        self.family = family
        self.fixtures = None

    @property
    def folder(self) -> Path:
        return self.fixtures(FAMILIES[self.family].folder_fixture)

    @property
    def reference_model(self):
        return self.fixtures(FAMILIES[self.family].reference_fixture)[0]

    @cached_property
    def tokenizer(self):
        return generation.load_tokenizer(self.folder)

    @cached_property
    def model(self):
        return generation.load_model(self.folder)

    @cached_property
    def fused(self):
        return generation.load_decoder(self.folder)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        return generation.prompt_ids(self.folder, self.tokenizer, prompt.text, chat=prompt.chat)

    @cached_property
    def reference_greedy(self) -> dict[str, list[int]]:
        greedy = {}
        for name, prompt in PROMPTS[self.family].items():
            ids = self.prompt_ids(prompt)
            with torch.no_grad():
                out = self.reference_model.generate(
                    torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            greedy[name] = out[0, len(ids):].tolist()
        return greedy

    def greedy(self, decoder, prompt: Prompt) -> list[int]:
        return generation.generate(decoder, self.tokenizer, self.prompt_ids(prompt), NEW_TOKENS,
                                   generation.eos_ids(self.folder), out=None).new_ids
