"""Structured output: the tokens a grammar allows at each step of an answer, for `pyml serve`'s
`response_format` (OpenAI's json_object and json_schema) and its `grammar` field (llama.cpp's GBNF).

The grammars are llguidance's (a structured-output engine of vLLM, SGLang and llama.cpp). Its
wheel needs no other Python package, it reads the model's tokenizer.json as a string (no
transformers), and it compiles JSON schemas, Lark and (through its GBNF-to-Lark converter) GBNF
lazily: a matcher costs well under a millisecond. xgrammar, the other maintained engine, pulls in
torch, triton and transformers, and takes the vocabulary from a transformers tokenizer.

A grammar here is llguidance's grammar string: the `*_grammar` functions make one from a request's
field and check it, naming the field in the error; `Grammars` holds the model's vocabulary as
llguidance sees it and makes one `Matcher` per answer, which masks the logits before each token is
drawn and is told the token drawn.
"""

from __future__ import annotations

import llguidance
import llguidance.numpy
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from pyml.errors import PymlError

# The whitespace JSON may hold between its tokens: llama.cpp's json-schema-to-grammar rule (a space,
# or one or two newlines and an indent of up to 20 spaces or tabs). llguidance's default, any run
# of whitespace, lets a model that starts writing newlines go on until max_tokens, as small models
# do; allowing none pushes a model that writes `{"a": 1}` off the spacing it was trained on.
JSON_WHITESPACE = r" |\n{1,2}[ \t]{0,20}"
ANY_JSON_OBJECT = {"type": "object"}
# OpenAI's response_format, the keys each type takes.
RESPONSE_FORMAT_KEYS = {
    "text": {"type"},
    "json_object": {"type"},
    "json_schema": {"type", "json_schema"},
}
JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


def first_line(message: str) -> str:
    """llguidance's messages go on with the grammar's source and the parser's state; the first line
    says what is wrong."""
    return next((line.strip() for line in message.splitlines() if line.strip()), message)


def checked(grammar: str, field: str) -> str:
    """`grammar` once llguidance finds nothing wrong with it (warnings pass); PymlError naming the
    request's `field` otherwise. Checks that need the vocabulary are `Grammars.check`'s."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise PymlError(f"{field}: {first_line(messages[0])}")
    return grammar


def json_schema_grammar(schema: dict, strict: bool = False, field: str = "schema") -> str:
    """The grammar of the JSON texts `schema` describes. A keyword llguidance does not implement is
    an error when `strict` (the answer could break it) and ignored when not (OpenAI's default)."""
    if not isinstance(schema, dict):
        raise PymlError(f"{field}: must be a JSON Schema object, not {type(schema).__name__}")
    options = {"whitespace_pattern": JSON_WHITESPACE, "lenient": not strict}
    return checked(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options), field)


def lark_grammar(lark: str, field: str = "grammar") -> str:
    """The grammar of Lark source in llguidance's dialect (which has %json{...} for an inline JSON
    schema, and <|token|> for a special token)."""
    if not isinstance(lark, str):
        raise PymlError(f"{field}: must be a string of Lark grammar, not {type(lark).__name__}")
    return checked(llguidance.LLMatcher.grammar_from_lark(lark), field)


def gbnf_grammar(gbnf: str, field: str = "grammar") -> str:
    """The grammar of llama.cpp's GBNF source (what its server takes as `grammar`): a `root` rule
    and the rules it uses."""
    if not isinstance(gbnf, str):
        raise PymlError(f"{field}: must be a string of GBNF grammar, not {type(gbnf).__name__}")
    try:
        lark = gbnf_to_lark(gbnf)
    except Exception as error:  # GbnfToLarkError for bad syntax, bare Exception for a missing rule
        raise PymlError(f"{field}: {first_line(str(error))}") from None
    return lark_grammar(lark, field)


def response_format_grammar(response_format: dict | None) -> str | None:
    """The grammar OpenAI's `response_format` asks for: None for none or {"type": "text"}; any JSON
    object for json_object; for json_schema its `schema`, strict or not (`json_schema_grammar`),
    and where the schema is left out any JSON value, as llama.cpp's server reads it (vLLM's then
    leaves the answer free, which a client that asked for JSON cannot parse)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise PymlError("response_format: must be an object with a type "
                        "(text, json_object or json_schema)")
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMAT_KEYS:
        raise PymlError(f"response_format.type: must be text, json_object or json_schema, "
                        f"not {kind!r}")
    unknown_fields(response_format, RESPONSE_FORMAT_KEYS[kind], f"response_format (of type {kind})")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar(ANY_JSON_OBJECT)
    described = response_format.get("json_schema")
    if not isinstance(described, dict):
        raise PymlError("response_format.json_schema: must be an object with a name and a schema")
    unknown_fields(described, JSON_SCHEMA_KEYS, "response_format.json_schema")
    if not isinstance(described.get("name"), str):
        raise PymlError("response_format.json_schema.name: must be a string (the schema's name)")
    if not isinstance(described.get("description"), str | None):
        raise PymlError("response_format.json_schema.description: must be a string")
    strict = described.get("strict")
    if not isinstance(strict, bool | None):
        raise PymlError(f"response_format.json_schema.strict: must be true or false, "
                        f"not {strict!r}")
    schema = described.get("schema")
    return json_schema_grammar({} if schema is None else schema, strict=bool(strict),
                               field="response_format.json_schema.schema")


def unknown_fields(given: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(given) - known)
    if unknown:
        raise PymlError(f"{where}: unknown field {unknown[0]!r} "
                        f"(it takes {', '.join(sorted(known))})")


class Grammars:
    """Grammars compiled for one model's tokenizer (built once per server: 0.3 s for a
    vocabulary of 49152 tokens, 2 s for 262144).

    The request thread `check`s a request's grammar when it arrives (about 0.2 ms for an ordinary
    schema), to refuse a bad one before it is queued, while the worker thread makes `matcher`s
    (under a millisecond: llguidance compiles lazily, as the answer goes): llguidance's tokenizer
    is immutable and shared, and the matchers are each the worker's own."""

    def __init__(self, tokenizer_json: str, vocab: int, eos_ids: list[int]):
        """`vocab`: the length of the model's logits, which may exceed the tokenizer's (a padded
        embedding: those tokens are never allowed); `eos_ids`: the model's end-of-sequence tokens
        (generation_config.json's eos_token_id), allowed exactly where the grammar may end."""
        if not eos_ids:
            raise PymlError("structured output needs the model's end-of-sequence token ids "
                            "(eos_token_id in generation_config.json)")
        try:
            self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab,
                                                    eos_token=sorted(eos_ids))
        except ValueError as error:  # a vocabulary smaller than the tokenizer's, an EOS beyond it
            message = first_line(str(error))
            raise PymlError(f"tokenizer.json for structured output: {message}") from None
        self.vocab = vocab

    def check(self, grammar: str) -> None:
        """PymlError, one line, if `grammar` cannot be used with this vocabulary: what the
        `*_grammar` functions check, and the special tokens and token ids it names."""
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar,
                                                                                 self.tokenizer)
        if is_error:
            raise PymlError(first_line(messages[0]))

    def matcher(self, grammar: str) -> Matcher:
        """A matcher at the start of `grammar`; PymlError, one line, if the grammar is bad."""
        # log_level 0: llguidance would print its warnings to stderr for every answer
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise PymlError(first_line(matcher.get_error()))
        return Matcher(matcher, self.vocab)


class Matcher:
    """Where one answer stands in its grammar: `mask` the logits, draw a token, `accept` it, until
    `done`. The mask depends only on the tokens accepted, so a seeded answer is reproducible."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int):
        self.matcher = matcher
        self.vocab = vocab
        # bitmask is (1, ceil(vocab / 32)) int32: bit t % 32 of word t // 32 is token t's
        self.bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab)

    def mask(self, logits: np.ndarray) -> None:
        """Set every logit the grammar forbids next to -inf, in place (logits is (vocab,), float32
        or float64)."""
        if logits.shape != (self.vocab,):
            raise ValueError(f"logits of shape {logits.shape}, expected ({self.vocab},)")
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self.bitmask)
        if self.matcher.is_error():  # a grammar too complex for llguidance's limits at this step
            raise PymlError(f"the grammar failed: {first_line(self.matcher.get_error())}")
        # the int32 words' bytes (little-endian, as on every machine pyml runs on) hold the
        # tokens' bits in order
        allowed = np.unpackbits(self.bitmask.view(np.uint8), count=self.vocab, bitorder="little")
        np.copyto(logits, -np.inf, where=allowed == 0)

    def accept(self, token: int) -> None:
        """Advance past `token` (an end-of-sequence token where the grammar may end is accepted);
        PymlError if the grammar forbids it here."""
        if not self.matcher.consume_token(token):
            raise PymlError(f"token {token} breaks the grammar: "
                            f"{first_line(self.matcher.get_error())}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (its JSON object closed, its last
        alternative matched): the answer ends here with finish_reason "stop". llguidance then
        allows only the end-of-sequence tokens, and vLLM spends a step drawing one; the server need
        not, since the draw is forced and its token would add no text."""
        return self.matcher.is_stopped() and not self.matcher.is_error()
