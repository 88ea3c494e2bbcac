"""Text generation with a generated decoder package and a KV cache.

The model folder is what `pyml import-gguf` or `pyml import-hf` writes, a training checkpoint, or
a Hugging Face folder as downloaded (`pyml.formats.model_folder`): the weights as stored
(source.gguf, model.safetensors, or shards with their index), config.json, tokenizer.json,
tokenizer_config.json, generation_config.json, and spec.toml, which a downloaded folder lacks: its
spec is then made from config.json (`pyml.formats.hf_import`). The spec, unless one is given,
picks the generated package (`pyml.packages.package_for`: generated into pyml's cache the first
time); config.json must describe that spec (`pyml.formats.hf_config`): a mismatch is reported by
field before any weight is read.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np
from tokenizers import Tokenizer

from pyml.errors import PymlError
from pyml.formats.chat_template import ChatTemplate
from pyml.formats.hf_config import config_mismatches
from pyml.formats.model_folder import SPEC_FILE, is_adapter_folder
from pyml.packages import package_for, spec_file
from pyml.spec import DecoderModel, load_spec


@dataclass
class Generation:
    prompt_ids: list[int]
    new_ids: list[int]
    text: str
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PymlError(f"{path}: missing (is {path.parent} a folder written by `pyml import-gguf`?)") from None
    except (OSError, ValueError) as error:
        raise PymlError(f"{path}: not readable JSON ({error})") from None


def existing_folder(model_dir: Path) -> Path:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise PymlError(f"{model_dir}: no such folder (--model takes a folder written by "
                        "`pyml import-gguf`)")
    return model_dir


def folder_spec_path(model_dir: Path) -> Path:
    """The spec of the model in `model_dir`: its spec.toml, or for a Hugging Face folder as
    downloaded the spec made from its config.json, in the cache (`pyml.packages.spec_file`)."""
    folder = existing_folder(model_dir)
    if not (folder / SPEC_FILE).is_file() and not (folder / "config.json").is_file():
        raise PymlError(f"{folder / SPEC_FILE}: missing, and no config.json to make it from "
                        "(`pyml import-gguf` writes both); give the model's spec with --spec")
    return spec_file(folder)


def load_decoder_spec(spec_path: Path) -> DecoderModel:
    spec = load_spec(spec_path)
    if not isinstance(spec, DecoderModel):
        raise PymlError(f"{spec_path}: `pyml generate` needs a decoder spec")
    return spec


def folder_package(model_dir: Path, spec_path: Path | None = None):
    """The generated package that runs the model of `model_dir`: its spec's (`spec_path`, default
    `folder_spec_path`'s), once config.json is checked to describe that spec."""
    model_dir = existing_folder(model_dir)
    if is_adapter_folder(model_dir):
        raise PymlError(f"{model_dir} holds LoRA adapters, not a model: give its base as --model "
                        f"and --adapter {model_dir}, or fold them in first with `pyml merge-lora "
                        f"BASE {model_dir} --out DIR`")
    spec_path = folder_spec_path(model_dir) if spec_path is None else Path(spec_path)
    spec = load_decoder_spec(spec_path)
    mismatches = config_mismatches(spec, read_json(model_dir / "config.json"))
    if mismatches:
        raise PymlError(f"{model_dir} does not hold the model of {spec_path}: " + "; ".join(mismatches))
    return package_for(spec_path)


def load_model(model_dir: Path, spec_path: Path | None = None, device: str = "cpu",
               adapter: Path | None = None, dtype=np.float32):
    """The model of `model_dir` in its generated package, in `dtype`; `spec_path` (default: the
    folder's spec.toml) names the spec, hence the package. `adapter` (a LoRA adapter folder of
    `model_dir`) is folded into the weights as `pyml merge-lora` folds it."""
    package = folder_package(model_dir, spec_path)
    model = package.Model(dtype, device)
    if adapter is None:
        from pyml.formats.stored_tensors import stored_weights

        model.load_tensors(*stored_weights(model_dir, dtype))
        return model
    from pyml.train.lora import merged_tensors

    model.load_tensors(merged_tensors(Path(model_dir), Path(adapter)), f"{model_dir} with {adapter}")
    return model


def load_decoder(model_dir: Path, spec_path: Path | None = None, device: str = "cpu",
                 weights: str = "as-stored", adapter: Path | None = None, activations: str = "f32"):
    """What `pyml generate` decodes with: the float32 model (`load_model`) for --weights f32;
    otherwise a `QuantizedDecoder` on the weights asked for (pyml/generate/quantized.py says what
    each --weights and --activations means). On the CPU it reads the folder's weights where they
    are stored, with no float32 copy, and a LoRA `adapter`'s updates beside them (as llama.cpp's
    --lora: the model costs the file plus the adapter). On CUDA the float32 model prefills the
    prompt, and an adapter is folded into its float32 weights."""
    from pyml.formats.gguf_import import SOURCE_GGUF
    from pyml.generate.quantized import QuantizedDecoder, check_weights

    check_weights(weights, activations)
    if weights == "f32":
        return load_model(model_dir, spec_path, device, adapter)
    if device == "cuda":
        if activations != "f32":
            raise PymlError(f"--activations {activations} runs on the CPU only: leave it out to decode "
                            "on the GPU")
        gguf_path = existing_folder(model_dir) / SOURCE_GGUF
        stored = gguf_path if gguf_path.is_file() and adapter is None else None
        return QuantizedDecoder.of_model(load_model(model_dir, spec_path, device, adapter), weights,
                                         activations, gguf_path=stored)
    return QuantizedDecoder.of_folder(folder_package(model_dir, spec_path), model_dir, weights, activations,
                                      adapter)


def load_tokenizer(model_dir: Path) -> Tokenizer:
    path = existing_folder(model_dir) / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception for missing or bad files
        raise PymlError(f"{path}: cannot load the tokenizer ({error})") from None


def prompt_ids(model_dir: Path, tokenizer: Tokenizer, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return tokenizer.encode(prompt).ids
    template = ChatTemplate.of_folder(model_dir)
    if template is None:
        raise PymlError(f"{model_dir} has no chat template (a base model is prompted with plain "
                        "text): drop --chat")
    text = template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False).ids


def eos_ids(model_dir: Path) -> set[int]:
    config = read_json(model_dir / "generation_config.json")
    eos = config.get("eos_token_id")
    return set(eos) if isinstance(eos, list) else {eos} if isinstance(eos, int) else set()


@dataclass(frozen=True)
class Sampler:
    """How the next token is chosen from the logits, in transformers' order: the repetition
    penalty (on every token of the prompt and the answer so far: a logit divided by it where
    positive, multiplied where negative), the frequency and presence penalties (OpenAI's: each
    token's logit lowered by frequency_penalty times its count in the answer so far, and by
    presence_penalty once it occurs there), then the temperature, top_k, top_p and min_p (the tokens
    whose probability is below min_p times the most probable one's are dropped). Temperature 0
    takes the most probable token after the penalties (greedy); otherwise the token is drawn."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 keeps every token
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def penalised(self, logits: np.ndarray, prompt_ids: list[int], new_ids: list[int]) -> np.ndarray:
        """The logits after the penalties, float64."""
        scores = logits.astype(np.float64)
        if self.repetition_penalty != 1.0 and (prompt_ids or new_ids):
            seen = np.unique(np.asarray(list(prompt_ids) + list(new_ids), dtype=np.int64))
            values = scores[seen]
            scores[seen] = np.where(values < 0, values * self.repetition_penalty,
                                    values / self.repetition_penalty)
        if (self.frequency_penalty or self.presence_penalty) and new_ids:
            counts = np.bincount(np.asarray(new_ids, dtype=np.int64), minlength=len(scores))
            scores -= self.frequency_penalty * counts + self.presence_penalty * (counts > 0)
        return scores

    def probabilities(self, logits: np.ndarray, prompt_ids: list[int] = (), new_ids: list[int] = ()
                      ) -> np.ndarray:
        """The distribution a token is drawn from at temperature > 0, float64 over the vocabulary:
        zero for every token the filters drop, the rest renormalised."""
        tokens, probs = self.candidates(logits, prompt_ids, new_ids)
        full = np.zeros(len(logits))
        full[tokens] = probs
        return full

    def candidates(self, logits: np.ndarray, prompt_ids: list[int] = (), new_ids: list[int] = ()
                   ) -> tuple[np.ndarray, np.ndarray]:
        """The tokens the filters keep, in increasing order, and their probabilities (float64,
        summing to 1): `probabilities` without the tokens it gives 0."""
        scaled = self.penalised(logits, prompt_ids, new_ids) / self.temperature
        if 0 < self.top_k < len(scaled):
            scaled[scaled < np.partition(scaled, -self.top_k)[-self.top_k]] = -np.inf
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        # top_p: the smallest set of most probable tokens whose probability reaches it (1: all,
        # as transformers, which then leaves its TopPLogitsWarper out)
        tokens = nucleus(probs, self.top_p) if self.top_p < 1 else np.arange(len(probs))
        kept = probs[tokens]
        if self.min_p > 0:
            enough = kept >= self.min_p * kept.max()
            tokens, kept = tokens[enough], kept[enough]
        return tokens, kept / kept.sum()

    def next_token(self, logits: np.ndarray, rng: np.random.Generator, prompt_ids: list[int] = (),
                   new_ids: list[int] = ()) -> int:
        if self.temperature == 0:
            penalised = self.repetition_penalty != 1.0 or self.frequency_penalty or self.presence_penalty
            return int(np.argmax(self.penalised(logits, prompt_ids, new_ids) if penalised else logits))
        tokens, probs = self.candidates(logits, prompt_ids, new_ids)
        # inverse transform sampling, as numpy's Generator.choice draws with p
        cumulative = np.cumsum(probs)
        drawn = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
        return int(tokens[min(drawn, len(tokens) - 1)])

    def check(self) -> None:
        """One line naming the first value out of range (`pyml generate` and `pyml serve`)."""
        ranges = {"temperature": (self.temperature >= 0, "a number >= 0 (0: greedy)"),
                  "top_p": (0 < self.top_p <= 1, "a number in (0, 1]"),
                  "top_k": (self.top_k >= 0, "an integer >= 0 (0: off)"),
                  "min_p": (0 <= self.min_p <= 1, "a number in [0, 1]"),
                  "repetition_penalty": (self.repetition_penalty > 0, "a number > 0 (1: off)"),
                  "frequency_penalty": (-2 <= self.frequency_penalty <= 2, "a number in [-2, 2]"),
                  "presence_penalty": (-2 <= self.presence_penalty <= 2, "a number in [-2, 2]")}
        for name, (fine, what) in ranges.items():
            value = getattr(self, name)
            if not fine or not math.isfinite(value):  # NaN compares false to everything
                raise PymlError(f"--{name.replace('_', '-')} must be {what}, not {value}")


# `nucleus` looks for the nucleus among the tokens at least this fraction as probable as the most
# probable one, then the next fraction's, before it sorts them all (0)
NUCLEUS_CUTOFFS = (1e-3, 1e-6, 1e-9, 0.0)


def nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The smallest set of most probable tokens (ties in token order) whose probability reaches
    top_p, in increasing order. Sorting a 50 000-token vocabulary took 4 ms a token; the tokens
    above a cutoff are sorted instead, and the set is found among them when their probability
    reaches top_p. It is the same set: every other token is less probable than each of them, so
    they come first in the whole vocabulary's order, in the same order, with the same running
    sums."""
    for fraction in NUCLEUS_CUTOFFS:
        inside = np.flatnonzero(probs >= probs.max() * fraction)
        order = inside[np.argsort(-probs[inside], kind="stable")]
        running = np.cumsum(probs[order])
        if running[-1] >= top_p:
            break
    return np.sort(order[:int(np.searchsorted(running, top_p)) + 1])


GREEDY = Sampler()


class IncrementalText:
    """The text of a growing list of token ids, without decoding the whole list at each token
    (quadratic in the answer's length). As vLLM's incremental detokenizer does, each token
    decodes the ids since the settle before last twice, with and without those since the last
    settle; the difference is the new text. Starting a settle early keeps a decoder that treats
    a text's first token apart (a stripped leading space) from treating the new tokens so. New
    text ending in U+FFFD (an incomplete UTF-8 character) does not settle; `add` returns it
    anyway, as decoding every id would."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids, self.settled = tokenizer, [], ""
        self.prefix = self.read = 0  # ids[prefix:read] decode to the end of `settled`

    def add(self, token: int) -> str:
        """The text of every id so far, `token` appended."""
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.settled += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            return self.settled
        return self.settled + after[len(before):]


class TextStream:
    """Prints decoded text as tokens arrive, holding back an incomplete UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, out: TextIO | None):
        self.text, self.out, self.shown = IncrementalText(tokenizer), out, ""

    def add(self, token: int) -> None:
        text = self.text.add(token)
        if self.out is not None and not text.endswith("\ufffd"):
            self.out.write(text[len(self.shown):])
            self.out.flush()
            self.shown = text


def generate(model, tokenizer: Tokenizer, ids: list[int], max_new_tokens: int, stop: set[int],
             sampler: Sampler = GREEDY, seed: int = 0, out: TextIO | None = sys.stdout) -> Generation:
    if max_new_tokens < 1:
        raise PymlError("--max-new-tokens must be at least 1")
    if not ids:
        raise PymlError("the prompt is empty")
    rng = np.random.default_rng(seed)
    stream = TextStream(tokenizer, out)
    started = time.perf_counter()
    cache, logits = model.start_decoding(np.array([ids]), len(ids) + max_new_tokens)
    prefill_seconds = time.perf_counter() - started
    new_ids: list[int] = []
    started = time.perf_counter()
    for _ in range(max_new_tokens):
        token = sampler.next_token(logits[0], rng, ids, new_ids)
        new_ids.append(token)
        if token in stop:
            break
        stream.add(token)
        if len(new_ids) == max_new_tokens:
            break
        logits = model.decode(cache, np.array([token]))
    decode_seconds = time.perf_counter() - started
    decoded = max(len(new_ids) - 1, 1)  # the first new token came from the prefill's logits
    return Generation(ids, new_ids, tokenizer.decode(new_ids),
                      len(ids) / prefill_seconds, decoded / max(decode_seconds, 1e-9))
