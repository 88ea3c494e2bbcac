"""The tokenizer a GGUF describes, rebuilt with the `tokenizers` library.

A GGUF carries no tokenizer.json: llama.cpp keeps the vocabulary, the BPE merges, the token kinds
and the special token ids as `tokenizer.ggml.*` metadata, and names its pre-tokenizer (the regexes
that cut text into words before BPE) in `tokenizer.ggml.pre`. We support the byte-level BPE
("gpt2") vocabulary with the pre-tokenizers whose llama.cpp regexes we reproduce exactly.
"""

from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from pyml.errors import PymlError
from pyml.runtime.gguf_read import GGUFFile

# llama.cpp's token kinds (llama_token_type): control tokens like <|im_start|> are matched whole
# and are "special" (skipped when decoding with skip_special_tokens); user-defined ones are
# matched whole but decoded as text.
NORMAL_TOKEN = 1
CONTROL_TOKEN = 3
USER_DEFINED_TOKEN = 4

# The GPT-2 word regex, which the ByteLevel pre-tokenizer applies with use_regex=True.
_GPT2_WORDS = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)

# llama.cpp (llama-vocab.cpp) gives "smollm" two regexes applied in turn: `\p{N}` isolates every
# digit, then the GPT-2 regex splits the rest. `Digits(individual_digits=True)` isolates exactly the
# characters of Unicode category N, as `\p{N}` does. llama.cpp names a file "smollm" when SmolLM's
# own Hugging Face tokenizer reproduces these splits on its test text. transformers' GGUF loader
# uses the GPT-2 regex alone for "smollm", so "    1" becomes "ĠĠĠ", "Ġ", "1" there but "ĠĠĠĠ", "1"
# in llama.cpp; we follow llama.cpp.
_PRE_TOKENIZERS = {
    "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _GPT2_WORDS]),
}

_SPECIAL_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def build_tokenizer(gguf: GGUFFile) -> Tokenizer:
    """The GGUF's tokenizer: same ids, same splits, same special tokens as llama.cpp's."""
    model = _metadata(gguf, "tokenizer.ggml.model", str)
    if model != "gpt2":
        raise PymlError(f"{gguf.path}: tokenizer model {model!r} is not supported (only 'gpt2')")
    pre = _metadata(gguf, "tokenizer.ggml.pre", str)
    if pre not in _PRE_TOKENIZERS:
        raise PymlError(
            f"{gguf.path}: pre-tokenizer {pre!r} is not supported (only {sorted(_PRE_TOKENIZERS)})"
        )
    tokens = _tokens(gguf)
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise PymlError(f"{gguf.path}: tokenizer.ggml.tokens lists a token twice")
    merges = _merges(gguf)
    try:
        tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    except Exception as error:  # tokenizers reports bad merges as a bare Exception
        raise PymlError(f"{gguf.path}: the BPE merges do not fit the vocabulary: {error}") from None
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]
    tokenizer.decoder = decoders.ByteLevel()

    kinds = _token_kinds(gguf, len(tokens))
    tokenizer.add_special_tokens(
        [_whole(token, special=True) for token, kind in zip(tokens, kinds) if kind == CONTROL_TOKEN]
    )
    tokenizer.add_tokens(
        [
            _whole(token, special=False)
            for token, kind in zip(tokens, kinds)
            if kind == USER_DEFINED_TOKEN
        ]
    )
    template = _added_around_text(gguf, tokens)
    if template is not None:
        tokenizer.post_processor = template
    return tokenizer


def tokenizer_config(gguf: GGUFFile) -> dict[str, object]:
    """tokenizer_config.json for transformers' AutoTokenizer: special tokens and chat template."""
    tokens = _tokens(gguf)
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": _flag(gguf, "tokenizer.ggml.add_bos_token"),
        "add_eos_token": _flag(gguf, "tokenizer.ggml.add_eos_token"),
        "clean_up_tokenization_spaces": False,
    }
    for name, key in _SPECIAL_TOKEN_IDS.items():
        index = special_token_id(gguf, key)
        if index is not None:
            config[name] = tokens[index]
    template = chat_template(gguf)
    if template is not None:
        config["chat_template"] = template
    return config


def chat_template(gguf: GGUFFile) -> str | None:
    """The Jinja chat template the GGUF carries, if any."""
    template = gguf.metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise PymlError(f"{gguf.path}: tokenizer.chat_template is not a string")
    return template


def special_token_id(gguf: GGUFFile, key: str) -> int | None:
    """The token id stored under `key` (e.g. tokenizer.ggml.eos_token_id), checked against the vocab."""
    index = gguf.metadata.get(key)
    if index is None:
        return None
    n_tokens = len(_tokens(gguf))
    if type(index) is not int or not 0 <= index < n_tokens:
        raise PymlError(f"{gguf.path}: {key} is {index!r}, not a token id below {n_tokens}")
    return index


def _whole(token: str, special: bool) -> AddedToken:
    # normalized=False: match the literal text, never a normalised form of it.
    return AddedToken(token, normalized=False, special=special)


def _added_around_text(gguf: GGUFFile, tokens: list[str]) -> processors.TemplateProcessing | None:
    """The post-processor that adds BOS/EOS when the GGUF asks for it, as llama.cpp does."""
    before, after = [], []
    if _flag(gguf, "tokenizer.ggml.add_bos_token"):
        before.append(special_token_id(gguf, "tokenizer.ggml.bos_token_id"))
    if _flag(gguf, "tokenizer.ggml.add_eos_token"):
        after.append(special_token_id(gguf, "tokenizer.ggml.eos_token_id"))
    if None in before + after:
        raise PymlError(f"{gguf.path}: asks to add BOS/EOS tokens but does not say which")
    if not before and not after:
        return None
    pieces = [tokens[i] for i in before] + ["$A"] + [tokens[i] for i in after]
    return processors.TemplateProcessing(
        single=" ".join(pieces),
        pair=" ".join(pieces + ["$B:1"] + [f"{tokens[i]}:1" for i in after]),
        special_tokens=[(tokens[i], i) for i in before + after],
    )


def _metadata(gguf: GGUFFile, key: str, kind: type):
    value = gguf.metadata.get(key)
    if value is None:
        raise PymlError(f"{gguf.path}: has no {key}, so it describes no tokenizer pyml can build")
    if not isinstance(value, kind):
        raise PymlError(f"{gguf.path}: {key} is not a {kind.__name__}")
    return value


def _flag(gguf: GGUFFile, key: str) -> bool:
    value = gguf.metadata.get(key, False)
    if not isinstance(value, bool):
        raise PymlError(f"{gguf.path}: {key} is {value!r}, not a boolean")
    return value


def _tokens(gguf: GGUFFile) -> list[str]:
    tokens = _metadata(gguf, "tokenizer.ggml.tokens", list)
    if not tokens or not all(isinstance(token, str) for token in tokens):
        raise PymlError(f"{gguf.path}: tokenizer.ggml.tokens is not a list of strings")
    return tokens


def _merges(gguf: GGUFFile) -> list[tuple[str, str]]:
    merges = _metadata(gguf, "tokenizer.ggml.merges", list)
    pairs = [merge.split(" ") if isinstance(merge, str) else None for merge in merges]
    for merge, pair in zip(merges, pairs):
        if pair is None or len(pair) != 2:
            raise PymlError(f"{gguf.path}: BPE merge {merge!r} is not two tokens 'a b'")
    return [tuple(pair) for pair in pairs]


def _token_kinds(gguf: GGUFFile, n_tokens: int) -> list[int]:
    kinds = gguf.metadata.get("tokenizer.ggml.token_type")
    if kinds is None:
        return [NORMAL_TOKEN] * n_tokens
    if not hasattr(kinds, "dtype") or kinds.dtype.kind not in "iu" or len(kinds) != n_tokens:
        raise PymlError(f"{gguf.path}: tokenizer.ggml.token_type is not one integer per token")
    return kinds.tolist()
