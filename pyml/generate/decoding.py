"""Text generation with a generated decoder package and a KV cache.

The model folder is what `pyml import-gguf` writes (model.safetensors, config.json, tokenizer.json,
tokenizer_config.json, generation_config.json, spec.toml). Its spec.toml, unless a spec is given,
picks the generated package (`pyml.packages.package_for`: generated into pyml's cache the first
time); config.json must describe that spec (`pyml.formats.hf_config`): a mismatch is reported by
field before any weight is read.
"""

from __future__ import annotations

import json
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
from pyml.packages import package_for
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
    path = existing_folder(model_dir) / SPEC_FILE
    if not path.is_file():
        raise PymlError(f"{path}: missing (`pyml import-gguf` writes one); give the model's spec "
                        "with --spec")
    return path


def load_decoder_spec(spec_path: Path) -> DecoderModel:
    spec = load_spec(spec_path)
    if not isinstance(spec, DecoderModel):
        raise PymlError(f"{spec_path}: `pyml generate` needs a decoder spec")
    return spec


def load_model(model_dir: Path, spec_path: Path | None = None, device: str = "cpu",
               adapter: Path | None = None, dtype=np.float32):
    """The model of `model_dir` in its generated package, in `dtype`; `spec_path` (default: the
    folder's spec.toml) names the spec, hence the package. `adapter` (a LoRA adapter folder of
    `model_dir`) is folded into the weights as `pyml merge-lora` folds it."""
    model_dir = existing_folder(model_dir)
    if is_adapter_folder(model_dir):
        raise PymlError(f"{model_dir} holds LoRA adapters, not a model: give its base as --model "
                        f"and --adapter {model_dir}, or fold them in first with `pyml merge-lora "
                        f"BASE {model_dir} --out DIR`")
    spec_path = folder_spec_path(model_dir) if spec_path is None else Path(spec_path)
    spec = load_decoder_spec(spec_path)
    config = read_json(model_dir / "config.json")
    mismatches = config_mismatches(spec, config)
    if mismatches:
        raise PymlError(f"{model_dir} does not hold the model of {spec_path}: " + "; ".join(mismatches))
    package = package_for(spec_path)
    if adapter is None:
        return package.Model.from_safetensors(model_dir / "model.safetensors", dtype=dtype, device=device)
    from pyml.train.lora import merged_tensors

    model = package.Model(dtype, device)
    model.load_tensors(merged_tensors(model_dir, Path(adapter)), f"{model_dir} with {adapter}")
    return model


def load_decoder(model_dir: Path, spec_path: Path | None = None, device: str = "cpu",
                 weights: str = "as-stored", adapter: Path | None = None, activations: str = "f32"):
    """What `pyml generate` decodes with: the float32 model (`load_model`) for --weights f32, and
    for a folder that stores float32 only; otherwise a `QuantizedDecoder` on the weights asked for
    (pyml/generate/quantized.py says what each --weights and --activations means). With a
    LoRA `adapter` folded in, the folder's GGUF no longer holds the weights: as-stored is then
    float32."""
    from pyml.formats.gguf_import import SOURCE_GGUF
    from pyml.generate.quantized import QuantizedDecoder, check_weights

    check_weights(weights, activations)
    gguf_path = existing_folder(model_dir) / SOURCE_GGUF
    stored = gguf_path.is_file() and adapter is None
    if weights == "f32" or (weights == "as-stored" and not stored):
        if activations != "f32":
            raise PymlError(f"--activations {activations} needs quantized weights, and {model_dir} "
                            "stores float32 only: add --weights q8_0, q4_0 or q4_1")
        return load_model(model_dir, spec_path, device, adapter)
    if device == "cuda" and activations != "f32":
        raise PymlError(f"--activations {activations} runs on the CPU only: leave it out to decode "
                        "on the GPU")
    return QuantizedDecoder.load(load_model(model_dir, spec_path, device, adapter), weights, gguf_path,
                                 activations)


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


def sampling_probabilities(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """The distribution a token is drawn from at temperature > 0: softmax(logits / T) restricted to
    the smallest set of most probable tokens whose probability reaches top_p, renormalised; zero
    for every other token. Float64, over the whole vocabulary."""
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = int(np.searchsorted(np.cumsum(probs[order]), top_p) + 1)
    kept = np.zeros_like(probs)
    kept[order[:keep]] = probs[order[:keep]]
    return kept / kept.sum()


def next_token(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """Greedy at temperature 0; otherwise a draw from `sampling_probabilities`."""
    if temperature == 0:
        return int(np.argmax(logits))
    probs = sampling_probabilities(logits, temperature, top_p)
    return int(rng.choice(len(probs), p=probs))


class TextStream:
    """Prints decoded text as tokens arrive, holding back an incomplete UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, out: TextIO | None):
        self.tokenizer, self.out, self.ids, self.shown = tokenizer, out, [], ""

    def add(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if self.out is not None and not text.endswith("\ufffd"):
            self.out.write(text[len(self.shown):])
            self.out.flush()
            self.shown = text


def generate(model, tokenizer: Tokenizer, ids: list[int], max_new_tokens: int, stop: set[int],
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             out: TextIO | None = sys.stdout) -> Generation:
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
        token = next_token(logits[0], temperature, top_p, rng)
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
