"""Structured output (`pyml.serve.constrained`) on SmolLM2's real vocabulary: answers drawn from
random logits through the grammar's mask, token by token as `pyml serve` draws them, parse and
validate against their schema; the end-of-sequence tokens are allowed exactly where the grammar may
end; the tokens of a padded embedding beyond the tokenizer's are never allowed; bad grammars and
response_formats are one-line errors naming the request's field.

Every answer must end (`done`) within a cap of tokens, which it cannot if `accept` leaves the
matcher where it was, and every drawn token is accepted, which raises if `mask` let through a
token the grammar forbids.
"""

import json
import threading

import jsonschema
import numpy as np
import pytest

from pyml.errors import PymlError
from pyml.serve.constrained import (
    Grammars,
    gbnf_grammar,
    json_schema_grammar,
    lark_grammar,
    response_format_grammar,
)
from pyml.generate.decoding import Sampler
from tests.support import anchors

# SmolLM2's embedding padded by 64 rows beyond its tokenizer's 49152 tokens, as some models pad.
TOKENIZER_VOCAB = 49152
VOCAB = TOKENIZER_VOCAB + 64
EOS = [0, 2]  # <|endoftext|> and <|im_end|>
CAP = 400  # tokens; every answer here ends well within it
SAMPLERS = {"temperature 1": (Sampler(temperature=1.0), np.float32),
            "greedy": (Sampler(), np.float64)}  # fmt: skip

SCHEMAS = {
    "nested objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                               "name": {"type": "string", "maxLength": 8}},
                "required": ["id", "name"], "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"], "additionalProperties": False,
    },
    "array with minItems": {
        "type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 3, "maxItems": 5,
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"enum": [1, 2, 3, None]}},
        "required": ["color", "size"], "additionalProperties": False,
    },
    "bounded integer": {"type": "integer", "minimum": 10, "maximum": 20},
    "optional fields": {
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"type": "null"},
                       "c": {"type": "string", "pattern": "^[a-z]{2,4}$"},
                       "d": {"type": "array", "items": {"enum": ["x", "y"]},
                             "minItems": 1, "maxItems": 2}},
        "required": ["a", "d"], "additionalProperties": False,
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    from pyml.formats.gguf_read import read_gguf
    from pyml.formats.smollm2_gguf import shipped_gguf_path
    from pyml.formats.tokenizer import build_tokenizer

    try:
        path = shipped_gguf_path()
    except PymlError as error:
        anchors.missing(str(error))
    tokenizer = build_tokenizer(read_gguf(path))  # what `pyml import-gguf` writes as tokenizer.json
    assert tokenizer.get_vocab_size() == TOKENIZER_VOCAB
    return tokenizer


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer.to_str(), VOCAB, EOS)


def json_schema_format(**fields) -> dict:
    return {"type": "json_schema", "json_schema": fields}


def answer(matcher, sampler, seed, dtype=np.float32, bias=None) -> list[int]:
    """The tokens drawn, as the server draws them, from seeded random logits (plus `bias`) until
    the matcher is done or an end-of-sequence token is drawn; a failure if neither within CAP."""
    rng = np.random.default_rng(seed)
    ids = []
    while not matcher.done:
        assert len(ids) < CAP, f"no end after {CAP} tokens: {ids[:40]}..."
        logits = rng.standard_normal(VOCAB).astype(dtype)
        if bias is not None:
            logits += bias
        matcher.mask(logits)
        token = sampler.next_token(logits, rng, [], ids)
        if token in EOS:
            break
        matcher.accept(token)
        ids.append(token)
    return ids


def allowed(matcher) -> np.ndarray:
    """The tokens the matcher allows next, by masking logits of zeros."""
    logits = np.zeros(VOCAB, np.float32)
    matcher.mask(logits)
    return np.flatnonzero(logits == 0)


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("name", SCHEMAS)
def test_answers_validate_against_their_schema(grammars, tokenizer, name, sampler):
    schema = SCHEMAS[name]
    sampler, dtype = SAMPLERS[sampler]
    grammar = response_format_grammar(json_schema_format(name="answer", schema=schema, strict=True))
    for seed in range(3):
        text = tokenizer.decode(answer(grammars.matcher(grammar), sampler, seed, dtype))
        jsonschema.validate(json.loads(text), schema)


def test_json_object_gives_a_json_object(grammars, tokenizer):
    """Random logits favouring JSON's punctuation (as a model writing JSON does), so that the keys
    and values close instead of running on, and objects and arrays nest."""
    punctuation = np.zeros(VOCAB, np.float32)
    for token in range(TOKENIZER_VOCAB):
        text = tokenizer.decode([token])
        if text and set(text) <= set('{}[]",:0123456789'):
            punctuation[token] = 8.0
    grammar = response_format_grammar({"type": "json_object"})
    texts = [tokenizer.decode(answer(grammars.matcher(grammar), Sampler(temperature=1.0), seed,
                                     bias=punctuation)) for seed in range(6)]
    assert all(isinstance(json.loads(text), dict) for text in texts)
    assert max(len(text) for text in texts) > 20, texts  # more than "{}"


@pytest.mark.parametrize("grammar", [gbnf_grammar('root ::= "yes" | "no"'),
                                     lark_grammar('start: "yes" | "no"')], ids=["gbnf", "lark"])
def test_a_grammar_gives_one_of_its_strings(grammars, tokenizer, grammar):
    texts = {tokenizer.decode(answer(grammars.matcher(grammar), Sampler(temperature=1.0), seed))
             for seed in range(8)}
    assert texts == {"yes", "no"}


def test_lark_inline_json(grammars, tokenizer):
    number = '%json{"type": "integer", "minimum": 0, "maximum": 99}'
    grammar = lark_grammar(f'start: "Answer: " {number}')
    for seed in range(4):
        text = tokenizer.decode(answer(grammars.matcher(grammar), Sampler(temperature=1.0), seed))
        assert text.startswith("Answer: ") and 0 <= json.loads(text.removeprefix("Answer: ")) <= 99


def test_eos_is_allowed_exactly_at_the_end(grammars, tokenizer):
    """Along a JSON answer, EOS only once the object closes, when the matcher is done and allows
    nothing else; along an answer that may end or go on (digits), EOS beside the digits."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    matcher = grammars.matcher(json_schema_grammar(schema))
    for token in tokenizer.encode('{"a": 12}').ids:
        assert not matcher.done and not set(EOS) & set(allowed(matcher))
        matcher.accept(token)
    assert matcher.done and list(allowed(matcher)) == EOS

    matcher = grammars.matcher(gbnf_grammar("root ::= [0-9]+"))
    assert not set(EOS) & set(allowed(matcher))
    matcher.accept(tokenizer.token_to_id("7"))
    after_digit = set(allowed(matcher))
    assert set(EOS) <= after_digit and tokenizer.token_to_id("3") in after_digit
    assert not matcher.done
    matcher.accept(EOS[1])  # the server may tell the matcher the EOS it drew
    assert matcher.done


def test_tokens_beyond_the_tokenizer_are_masked(grammars, tokenizer):
    matcher = grammars.matcher(lark_grammar(r'start: "x" /(.|\n)*/'))
    assert {tokenizer.decode([token])[0] for token in allowed(matcher)} == {"x"}
    matcher.accept(tokenizer.token_to_id("x"))
    anything = allowed(matcher)
    assert len(anything) > TOKENIZER_VOCAB // 2 and anything.max() < TOKENIZER_VOCAB


def test_a_forbidden_token_is_refused(grammars, tokenizer):
    matcher = grammars.matcher(gbnf_grammar('root ::= "yes" | "no"'))
    assert tokenizer.token_to_id("maybe") not in allowed(matcher)
    with pytest.raises(PymlError, match="breaks the grammar") as raised:
        matcher.accept(tokenizer.token_to_id("maybe"))
    assert "\n" not in str(raised.value)


def test_answers_depend_only_on_their_own_tokens(grammars):
    """The same seed gives the same answer alone and interleaved with another answer's steps."""
    schema = SCHEMAS["nested objects"]
    grammar = response_format_grammar(json_schema_format(name="n", schema=schema))
    alone = answer(grammars.matcher(grammar), Sampler(temperature=1.0), seed=5)
    other = grammars.matcher(gbnf_grammar("root ::= [a-z]+"))
    other_rng = np.random.default_rng(9)

    class Interleaved:
        """The matcher, with a step of another answer before each of its masks."""

        def __init__(self, matcher):
            self.matcher = matcher

        def mask(self, logits):
            other_logits = other_rng.standard_normal(VOCAB)
            other.mask(other_logits)
            other.accept(int(np.argmax(other_logits)))
            self.matcher.mask(logits)

        def accept(self, token):
            self.matcher.accept(token)

        @property
        def done(self):
            return self.matcher.done

    interleaved = answer(Interleaved(grammars.matcher(grammar)), Sampler(temperature=1.0), seed=5)
    assert interleaved == alone and len(alone) > 5


def test_grammars_check_while_another_thread_decodes(grammars, tokenizer):
    """The server checks requests' grammars on its request thread while the worker thread makes
    matchers and decodes: the answers are those of a lone thread."""
    grammar = json_schema_grammar(SCHEMAS["enums"])

    def answers():
        sampler = Sampler(temperature=1.0)
        return [answer(grammars.matcher(grammar), sampler, seed) for seed in range(4)]

    expected = answers()
    stop, failures = threading.Event(), []

    def check_requests():
        while not stop.is_set():
            grammars.check(json_schema_grammar(SCHEMAS["optional fields"]))
            try:
                grammars.check(lark_grammar("start: <[99999]>"))
                failures.append("a token id beyond the vocabulary passed")
            except PymlError:
                pass

    checker = threading.Thread(target=check_requests)
    checker.start()
    try:
        decoded = answers()
    finally:
        stop.set()
        checker.join()
    assert decoded == expected and not failures


@pytest.mark.parametrize("response_format", [None, {"type": "text"}])
def test_no_grammar_for_text(response_format):
    assert response_format_grammar(response_format) is None


def test_a_json_schema_without_schema_gives_any_json_value(grammars, tokenizer):
    grammar = response_format_grammar(json_schema_format(name="any"))
    for text in ('[1, "a"]', '"text"', '{"k": null}'):
        matcher = grammars.matcher(grammar)
        *start, last = tokenizer.encode(text).ids
        for token in start:
            matcher.accept(token)
        assert not set(EOS) & set(allowed(matcher))
        matcher.accept(last)
        assert matcher.done


def test_strict_false_ignores_what_llguidance_does_not_implement():
    schema = {"type": "object", "not": {"required": ["a"]}}
    assert response_format_grammar(json_schema_format(name="n", schema=schema))
    unimplemented = r"^response_format\.json_schema\.schema: Unimplemented keys"
    with pytest.raises(PymlError, match=unimplemented):
        response_format_grammar(json_schema_format(name="n", schema=schema, strict=True))


SCHEMA_FIELD = "response_format.json_schema.schema"


@pytest.mark.parametrize("response_format, field", [
    ("json", "response_format"),
    ({}, "response_format.type"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_object", "schema": {}}, "response_format (of type json_object)"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": "{}"}, "response_format.json_schema"),
    (json_schema_format(name="n", schemas={}), "response_format.json_schema"),
    (json_schema_format(schema={}), "response_format.json_schema.name"),
    (json_schema_format(name=3, schema={}), "response_format.json_schema.name"),
    (json_schema_format(name="n", description=1), "response_format.json_schema.description"),
    (json_schema_format(name="n", strict="yes"), "response_format.json_schema.strict"),
    (json_schema_format(name="n", schema='{"type": "object"}'), SCHEMA_FIELD),
    (json_schema_format(name="n", schema={"type": "foo"}), SCHEMA_FIELD),
    (json_schema_format(name="n", schema={"$ref": "#/nowhere"}), SCHEMA_FIELD),
])  # fmt: skip
def test_bad_response_formats_name_the_field(response_format, field):
    with pytest.raises(PymlError) as raised:
        response_format_grammar(response_format)
    message = str(raised.value)
    assert message.startswith(f"{field}: ") and "\n" not in message


@pytest.mark.parametrize("make, source", [
    (gbnf_grammar, "root ::= foo"),
    (gbnf_grammar, 'root ::= "unterminated'),
    (gbnf_grammar, 'answer ::= "yes"'),
    (gbnf_grammar, ["root ::= x"]),
    (lark_grammar, "start: foo"),
    (lark_grammar, "start: /[a-/"),
])  # fmt: skip
def test_bad_grammars_name_the_field(make, source):
    with pytest.raises(PymlError) as raised:
        make(source)
    message = str(raised.value)
    assert message.startswith("grammar: ") and "\n" not in message


def test_grammars_check_what_needs_the_vocabulary(grammars):
    grammar = lark_grammar("start: <[99999]>")  # fine until the vocabulary is known
    with pytest.raises(PymlError, match="99999") as raised:
        grammars.check(grammar)
    assert "\n" not in str(raised.value)
    with pytest.raises(PymlError, match="99999"):
        grammars.matcher(grammar)
    grammars.check(lark_grammar("start: <|im_end|>"))


def test_grammars_refuse_a_short_vocabulary_and_no_eos(tokenizer):
    with pytest.raises(PymlError, match="tokenizer.json"):
        Grammars(tokenizer.to_str(), TOKENIZER_VOCAB - 1, EOS)
    with pytest.raises(PymlError, match="eos_token_id"):
        Grammars(tokenizer.to_str(), VOCAB, [])
