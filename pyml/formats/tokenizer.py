"""The tokenizer a GGUF describes, rebuilt with the `tokenizers` library.

A GGUF carries no tokenizer.json: llama.cpp keeps the vocabulary, the token kinds, the special
token ids and either BPE merges or token scores as `tokenizer.ggml.*` metadata. We support its two
BPE vocabularies (`tokenizer.ggml.model`):

- "gpt2": byte-level BPE with the merges listed, after a pre-tokenizer (the regexes that cut text
  into words, named in `tokenizer.ggml.pre`) whose llama.cpp regexes we reproduce exactly.
- "llama": SentencePiece BPE (Llama 2, Gemma). Spaces become "▁", and unless
  `tokenizer.ggml.add_space_prefix` is false each stretch of text (at the start, and after each
  special or user-defined token) gets one in front; the text is not cut into words; the pair of
  neighbouring pieces that make the token with the highest score is merged first, and a
  character no token spells is written as its UTF-8 byte tokens <0x00>..<0xFF>. Those are
  SentencePiece's rules, and llama.cpp's. We state them as BPE merges: every cut of a normal
  token into two tokens, ranked by the token's score (a token with several cuts: the longer left
  piece first, as transformers ranks them).

In both, control and user-defined tokens (Gemma's runs of spaces, tabs and newlines, its HTML
tags) are matched whole in the text, the longest first, before anything else, as llama.cpp does.
"""

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from pyml.errors import PymlError
from pyml.formats.gguf_read import GGUFFile

# llama.cpp's token kinds (llama_token_type): control tokens like <|im_start|> are matched whole
# and are "special" (skipped when decoding with skip_special_tokens); user-defined ones are
# matched whole but decoded as text; the unknown token of a SentencePiece vocabulary (Llama 2's,
# Mistral's <unk>) has a kind of its own.
NORMAL_TOKEN = 1
UNKNOWN_TOKEN = 2
CONTROL_TOKEN = 3
USER_DEFINED_TOKEN = 4
SPACE_PIECE = "\u2581"  # SentencePiece's visible space, "▁"

# The GPT-2 word regex, which the ByteLevel pre-tokenizer applies with use_regex=True.
_GPT2_WORDS = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)

# llama.cpp (llama-vocab.cpp) gives "smollm" two regexes applied in turn: `\p{N}` isolates every
# digit, then the GPT-2 regex splits the rest. `Digits(individual_digits=True)` isolates exactly the
# characters of Unicode category N, as `\p{N}` does. llama.cpp names a file "smollm" when SmolLM's
# own Hugging Face tokenizer reproduces these splits on its test text. transformers' GGUF loader
# uses the GPT-2 regex alone for "smollm", so "    1" becomes "ĠĠĠ", "Ġ", "1" there but "ĠĠĠĠ", "1"
# in llama.cpp; we follow llama.cpp.
# "qwen2": Qwen2's one regex (llama.cpp's spelling of it, without the (?i:) group its regex engine
# lacks), whose matches are the words, then the byte-level mapping alone, as Qwen2's own
# tokenizer.json has it.
_QWEN2_WORDS = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# "llama-bpe" (Llama 3's, and llama.cpp's "llama3"): Qwen2's regex with runs of up to three
# digits, and a word that is a token of its own is that token, whatever the merges say (llama.cpp's
# ignore_merges, which Llama 3's own tokenizer.json sets too).
_LLAMA3_WORDS = _QWEN2_WORDS.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
_PRE_TOKENIZERS = {
    "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _GPT2_WORDS]),
    "qwen2": pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_WORDS), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]),
    "llama-bpe": pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_WORDS), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]),
}
_IGNORE_MERGES = {"llama-bpe"}

_SPECIAL_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def build_tokenizer(gguf: GGUFFile) -> Tokenizer:
    """The GGUF's tokenizer: same ids, same splits, same special tokens as llama.cpp's."""
    model = _metadata(gguf, "tokenizer.ggml.model", str)
    if model == "gpt2":
        tokenizer = _byte_level_bpe(gguf)
    elif model == "llama":
        tokenizer = _sentencepiece_bpe(gguf)
    else:
        raise PymlError(
            f"{gguf.path}: tokenizer model {model!r} is not supported (only 'gpt2' and 'llama')"
        )
    tokens = _tokens(gguf)
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


def _byte_level_bpe(gguf: GGUFFile) -> Tokenizer:
    pre = _metadata(gguf, "tokenizer.ggml.pre", str)
    if pre not in _PRE_TOKENIZERS:
        raise PymlError(
            f"{gguf.path}: pre-tokenizer {pre!r} is not supported (only {sorted(_PRE_TOKENIZERS)})"
        )
    tokens = _tokens(gguf)
    vocab = _vocab(gguf, tokens)
    merges = _merges(gguf)
    try:
        tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                  ignore_merges=pre in _IGNORE_MERGES))
    except Exception as error:  # tokenizers reports bad merges as a bare Exception
        raise PymlError(f"{gguf.path}: the BPE merges do not fit the vocabulary: {error}") from None
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(gguf: GGUFFile) -> Tokenizer:
    tokens = _tokens(gguf)
    vocab = _vocab(gguf, tokens)
    kinds = _token_kinds(gguf, len(tokens))
    scores = gguf.metadata.get("tokenizer.ggml.scores")
    if not hasattr(scores, "dtype") or scores.dtype.kind != "f" or len(scores) != len(tokens):
        raise PymlError(f"{gguf.path}: tokenizer.ggml.scores is not one number per token")
    missing_bytes = [f"<0x{byte:02X}>" for byte in range(256) if f"<0x{byte:02X}>" not in vocab]
    if missing_bytes:
        raise PymlError(
            f"{gguf.path}: the vocabulary lacks the byte tokens {', '.join(missing_bytes[:3])}..."
        )
    unknown = special_token_id(gguf, "tokenizer.ggml.unknown_token_id")
    if unknown is None:
        raise PymlError(f"{gguf.path}: has no tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=_merges_by_score(tokens, scores.tolist(), kinds, vocab),
            unk_token=tokens[unknown],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # Unless the file says not to, llama.cpp puts a space in front of the text and of the text
    # after each special or user-defined token: the normalizer runs on each stretch of text
    # between added tokens, so a Prepend does just that.
    space_prefix = _flag(gguf, "tokenizer.ggml.add_space_prefix", default=True)
    spaces = normalizers.Replace(" ", SPACE_PIECE)
    tokenizer.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE_PIECE), spaces]) if space_prefix else spaces
    )
    steps = [decoders.Replace(SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges_by_score(
    tokens: list[str], scores: list[float], kinds: list[int], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Every cut of a normal token into two tokens of the vocabulary, the best-scoring token's
    first, and of one token's cuts the one with the longer left piece first."""
    cuts = []
    for token, score, kind in zip(tokens, scores, kinds):
        if kind != NORMAL_TOKEN:
            continue
        for length in range(len(token) - 1, 0, -1):
            left, right = token[:length], token[length:]
            if left in vocab and right in vocab:
                cuts.append((-score, len(cuts), left, right))
    cuts.sort()
    return [(left, right) for _, _, left, right in cuts]


def tokenizer_config(gguf: GGUFFile) -> dict[str, object]:
    """tokenizer_config.json for transformers' AutoTokenizer: special tokens and chat template."""
    tokens = _tokens(gguf)
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": _adds_bos(gguf),
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
    if _adds_bos(gguf):
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


def _adds_bos(gguf: GGUFFile) -> bool:
    """Whether BOS goes in front of the text: llama.cpp does so for a SentencePiece vocabulary
    unless the file says not to."""
    sentencepiece = gguf.metadata.get("tokenizer.ggml.model") == "llama"
    return _flag(gguf, "tokenizer.ggml.add_bos_token", default=sentencepiece)


def _flag(gguf: GGUFFile, key: str, default: bool = False) -> bool:
    value = gguf.metadata.get(key, default)
    if not isinstance(value, bool):
        raise PymlError(f"{gguf.path}: {key} is {value!r}, not a boolean")
    return value


def _tokens(gguf: GGUFFile) -> list[str]:
    tokens = _metadata(gguf, "tokenizer.ggml.tokens", list)
    if not tokens or not all(isinstance(token, str) for token in tokens):
        raise PymlError(f"{gguf.path}: tokenizer.ggml.tokens is not a list of strings")
    return tokens


def _vocab(gguf: GGUFFile, tokens: list[str]) -> dict[str, int]:
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise PymlError(f"{gguf.path}: tokenizer.ggml.tokens lists a token twice")
    return vocab


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
