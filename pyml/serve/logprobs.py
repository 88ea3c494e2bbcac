"""Log-probabilities of tokens as the OpenAI API returns them: a token's own, and the most probable
tokens' at its position.

They are the model's own distribution, the log-softmax of the logits the step computed (in
float64, from its float32 logits), before the request's penalties, temperature, filters or
grammar, as vLLM returns them by default: so a token's log-probability is the same whatever was
asked of the sampling, and equal to a scoring run's (`pyml eval`). Ties in the most probable
tokens go to the lower id.

A token's text is its own decoding (`TokenTexts.text`); its bytes are what it adds to the answer's
UTF-8, which for a byte-level BPE (GPT-2's alphabet: Llama 3, Qwen, SmolLM2) or a byte-fallback
SentencePiece vocabulary (`<0xE2>`: Gemma, Llama 2) may be part of a character.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from tokenizers import Tokenizer

# the most top_logprobs a request may ask for (OpenAI's chat API allows 20)
MAX_TOP_LOGPROBS = 20


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p over the vocabulary, float64."""
    scores = logits.astype(np.float64)
    top = scores.max()
    return scores - (top + np.log(np.exp(scores - top).sum()))


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token there, its log-probability (None for a text's first token, which
    nothing predicts), and the most probable tokens' (id, log-probability), most probable first."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...]


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability under `logits` (VOCAB,), and the `top` most probable tokens'."""
    logprobs = log_softmax(logits)
    if top:
        candidates = np.argpartition(-logprobs, top - 1)[:top]
        # most probable first, ties to the lower id
        best = candidates[np.lexsort((candidates, -logprobs[candidates]))]
        ranked = tuple((int(t), float(logprobs[t])) for t in best)
    else:
        ranked = ()
    return TokenLogprob(int(token), float(logprobs[token]), ranked)


class TokenTexts:
    """Each token's text and bytes in a tokenizer's vocabulary."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = '"ByteLevel"' in tokenizer.to_str()  # its decoder maps GPT-2's alphabet
        self.special = frozenset(token.content for token in tokenizer.get_added_tokens_decoder().values())
        self.raw_of: dict[int, bytes] = {}

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def bytes(self, token: int) -> list[int]:
        if token not in self.raw_of:
            self.raw_of[token] = self.raw(token)
        return list(self.raw_of[token])

    def raw(self, token: int) -> bytes:
        """The bytes `token` adds to the UTF-8 text: its piece mapped back through GPT-2's byte
        alphabet, or a `<0xNN>` byte-fallback piece's byte, or else its text's UTF-8."""
        piece = self.tokenizer.id_to_token(token)
        if piece is None:
            return b""
        if piece in self.special:  # an added token is written as it is
            return piece.encode("utf-8")
        if self.byte_level:
            alphabet = gpt2_byte_of()
            if all(char in alphabet for char in piece):
                return bytes(alphabet[char] for char in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self.text(token).encode("utf-8")


@lru_cache(maxsize=1)
def gpt2_byte_of() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def completion_logprobs(entries: list[TokenLogprob], texts: TokenTexts, offset: int) -> dict:
    """The completions API's `logprobs` of `entries`, their text beginning at character `offset`
    of the choice's text."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for entry in entries:
        text = texts.text(entry.token)
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        token_logprobs.append(entry.logprob)
        if entry.logprob is None:  # an echoed prompt's first token
            top_logprobs.append(None)
            continue
        # OpenAI: the most probable tokens and always the token itself
        ranked = {texts.text(token): logprob for token, logprob in entry.top}
        ranked.setdefault(text, entry.logprob)
        top_logprobs.append(ranked)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> dict:
    """The chat API's `logprobs` of `entries`: OpenAI's content list."""
    return {"content": [
        {"token": texts.text(entry.token), "logprob": entry.logprob, "bytes": texts.bytes(entry.token),
         "top_logprobs": [{"token": texts.text(token), "logprob": logprob, "bytes": texts.bytes(token)}
                          for token, logprob in entry.top]}
        for entry in entries]}
