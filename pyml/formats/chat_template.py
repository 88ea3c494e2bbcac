"""A model folder's chat template: conversations rendered to text as transformers renders them.

The template is the Jinja source in tokenizer_config.json (`chat_template`), or in
chat_template.jinja beside it where that has none (transformers 5 saves it there), rendered as
transformers' `apply_chat_template` renders it: a sandboxed environment with trim_blocks,
lstrip_blocks and the loop controls, the special tokens (`bos_token`, `eos_token`) and the tools
(`tools`, None without them) as variables, `raise_exception` for the template's own checks,
`strftime_now` for the date some templates write, and transformers' `tojson`, which writes JSON
as json.dumps does: Jinja's own sorts the keys and escapes <, > and &, which would change every
tool schema and call a template writes. The text is then tokenised without adding special tokens:
the template writes the ones it wants.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pyml.errors import PymlError

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    special_tokens: dict[str, str]  # bos_token, eos_token: what the template may write
    where: str  # for messages: the folder it came from

    @classmethod
    def of_folder(cls, model_dir: Path) -> ChatTemplate | None:
        """The folder's template, or None when it has none (a base model)."""
        path = Path(model_dir) / "tokenizer_config.json"
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise PymlError(f"{path}: cannot read the tokenizer config ({error})") from None
        source = config.get("chat_template")
        jinja = Path(model_dir) / "chat_template.jinja"
        if not isinstance(source, str) and jinja.is_file():
            # where transformers 5 saves it (and newer Hub folders keep it), beside the config
            try:
                source = jinja.read_text(encoding="utf-8")
            except (OSError, ValueError) as error:
                raise PymlError(f"{jinja}: cannot read the chat template ({error})") from None
        if not isinstance(source, str) or not source:
            return None
        special = {key: config[key] for key in ("bos_token", "eos_token") if isinstance(config.get(key), str)}
        return cls(source, special, str(model_dir))

    def render(self, messages: list[dict], add_generation_prompt: bool,
               tools: list[dict] | None = None) -> str:
        """`messages` as transformers takes them: {"role", "content"}, an assistant's calls as
        "tool_calls": [{"type": "function", "function": {"name", "arguments": dict}}], a tool's
        answer with "tool_call_id"; `tools` as [{"type": "function", "function": {...}}]."""
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=[loopcontrols])

        def raise_exception(message):
            raise PymlError(f"the chat template of {self.where} refuses the conversation: {message}")

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        environment.globals["raise_exception"] = raise_exception
        environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
        environment.filters["tojson"] = tojson
        try:
            return environment.from_string(self.source).render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                **self.special_tokens)
        # TypeError: the template's own operations on values it did not expect (a dict added to
        # a string, an undefined value given to tojson), which no caller can mend either
        except (TemplateError, TypeError) as error:
            raise PymlError(f"the chat template of {self.where} failed: {error}") from None
