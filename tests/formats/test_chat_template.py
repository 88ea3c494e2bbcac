"""What a chat template may use beyond plain Jinja, rendered as transformers' apply_chat_template
renders it (the real tool-calling templates: tests/serve/test_tools.py), and a template that
fails on the conversation fails with pyml's error, naming the template."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing from a hub

import pytest
from tokenizers import Tokenizer, models

from pyml.errors import PymlError
from pyml.formats.chat_template import ChatTemplate

# tojson as transformers writes it (keys in their order, <, > and & as they are, indent),
# break/continue, tools, and a date written by strftime_now
TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{{ m.role }}: {{ m.content }}\n{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}"
    "{% for tool in tools or [] %}{{ tool | tojson }}\n{{ tool.function | tojson(indent=2) }}\n{% endfor %}"
    "{{ strftime_now('%Y') | length }}{% if add_generation_prompt %}assistant:{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "skipped"},
    {"role": "user", "content": "a < b & c"},
    {"role": "assistant", "content": "yes"},
    {"role": "user", "content": "last one shown"},
    {"role": "user", "content": "after the break"},
]
TOOLS = [{"type": "function", "function": {"name": "zeta", "description": "<b> & co", "parameters": {
    "type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "integer"}}}}}]


def test_the_template_renders_as_transformers_renders_it():
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, "<unk>")))
    reference.chat_template = TEMPLATE
    ours = ChatTemplate(TEMPLATE, {}, "test")
    for tools in (TOOLS, None):
        rendered = ours.render(MESSAGES, add_generation_prompt=True, tools=tools)
        assert rendered == reference.apply_chat_template(MESSAGES, tools=tools, tokenize=False,
                                                         add_generation_prompt=True)
    assert "after the break" not in rendered and "skipped" not in rendered
    assert '"properties": {"z": {"type": "string"}, "a"' in ours.render(MESSAGES, False, TOOLS)


def test_a_template_that_fails_on_the_conversation_names_itself():
    adds_a_dict = ChatTemplate("{{ messages[0].content + messages[0] }}", {}, "adds-a-dict")
    with pytest.raises(PymlError, match=r"^the chat template of adds-a-dict failed: "):
        adds_a_dict.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    refusing = ChatTemplate("{{ raise_exception('no system messages') }}", {}, "refusing")
    with pytest.raises(PymlError, match=r"^the chat template of refusing refuses the conversation: no system"):
        refusing.render([{"role": "system", "content": "hi"}], add_generation_prompt=True)
