"""Importing a llama-architecture GGUF as a Hugging Face model directory.

`import_gguf` writes model.safetensors (float32, Hugging Face tensor names and layout),
config.json (LlamaConfig fields), generation_config.json, tokenizer.json, tokenizer_config.json
and chat_template.jinja. Everything is validated before anything is decoded or written, so a bad
file fails with one PymlError line and leaves no half-written directory behind.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pyml.errors import PymlError
from pyml.runtime.gguf_read import GGUFFile, read_gguf
from pyml.runtime.quant import dequantize
from pyml.runtime.safetensors_io import atomic_write, write_safetensors
from pyml.runtime.tokenizer import (
    build_tokenizer,
    chat_template,
    special_token_id,
    tokenizer_config,
)

# GGUF tensor name -> Hugging Face LlamaForCausalLM name; "blk.{i}." becomes "model.layers.{i}.".
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when the head is tied to the embedding
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


@dataclass(frozen=True)
class LlamaDims:
    """What the GGUF's `llama.*` metadata says about the model's dimensions."""

    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    context_length: int
    rms_norm_eps: float
    rope_theta: float


def import_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
    """Write the Hugging Face model directory for the GGUF at `gguf_path` into `out_dir`."""
    gguf = read_gguf(gguf_path)
    dims = llama_dims(gguf)
    tied = check_llama_tensors(gguf, dims)
    tokenizer = build_tokenizer(gguf)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise PymlError(f"{out_dir}: exists and is not a directory")

    files = {
        "config.json": _json_bytes(hf_config(gguf, dims, tied)),
        "generation_config.json": _json_bytes(_generation_config(gguf)),
        "tokenizer.json": tokenizer.to_str(pretty=True).encode("utf-8"),
        "tokenizer_config.json": _json_bytes(tokenizer_config(gguf)),
    }
    template = chat_template(gguf)
    if template is not None:
        files["chat_template.jinja"] = template.encode("utf-8")

    with tqdm(total=len(gguf.tensors) + 1 + len(files), disable=not progress, unit="step") as bar:
        bar.set_description("decoding tensors")
        tensors = _decode_tensors(gguf, dims, bar)
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            bar.set_description("writing model.safetensors")
            write_safetensors(out_dir / "model.safetensors", tensors, metadata={"format": "pt"})
            bar.update()
            for name, content in files.items():
                bar.set_description(f"writing {name}")
                atomic_write(out_dir / name, lambda handle, content=content: handle.write(content))
                bar.update()
        except OSError as error:
            raise PymlError(f"{out_dir}: cannot write the model: {error.strerror}") from None
    return out_dir


def load_gguf_tensors(gguf_path: Path) -> dict[str, np.ndarray]:
    """The GGUF's weights as float32 arrays under Hugging Face names, in Hugging Face layout."""
    gguf = read_gguf(gguf_path)
    dims = llama_dims(gguf)
    check_llama_tensors(gguf, dims)
    return _decode_tensors(gguf, dims, bar=None)


def llama_dims(gguf: GGUFFile) -> LlamaDims:
    """The model dimensions from the metadata, checked for consistency."""

    def integer(key: str) -> int:
        value = gguf.metadata.get(key)
        if type(value) is not int or value <= 0:
            raise PymlError(f"{gguf.path}: {key} is {value!r}, not a positive integer")
        return value

    def real(key: str) -> float:
        value = gguf.metadata.get(key)
        if type(value) is not float or not value > 0:
            raise PymlError(f"{gguf.path}: {key} is {value!r}, not a positive number")
        # Stored as float32: write the shortest decimal that reads back as that float32
        # (1e-05, not 9.999999747378752e-06), which is what the model's authors wrote.
        return float(str(np.float32(value)))

    architecture = gguf.metadata.get("general.architecture")
    if architecture != "llama":
        raise PymlError(
            f"{gguf.path}: architecture {architecture!r} is not supported (only 'llama')"
        )
    hidden = integer("llama.embedding_length")
    n_heads = integer("llama.attention.head_count")
    n_kv_heads = integer("llama.attention.head_count_kv")
    if "llama.attention.key_length" in gguf.metadata:
        head_dim = integer("llama.attention.key_length")
    elif hidden % n_heads == 0:
        head_dim = hidden // n_heads
    else:
        raise PymlError(f"{gguf.path}: {hidden} hidden units do not split into {n_heads} heads")
    if gguf.metadata.get("llama.attention.value_length", head_dim) != head_dim:
        raise PymlError(f"{gguf.path}: attention value length differs from the key length")
    if n_heads % n_kv_heads:
        raise PymlError(f"{gguf.path}: {n_heads} heads do not share {n_kv_heads} key/value heads")
    if head_dim % 2:
        raise PymlError(f"{gguf.path}: head size {head_dim} is odd; rotary embeddings need pairs")
    if gguf.metadata.get("llama.rope.dimension_count", head_dim) != head_dim:
        raise PymlError(f"{gguf.path}: rotary embeddings on part of each head are not supported")
    if gguf.metadata.get("llama.rope.scaling.type", "none") != "none":
        raise PymlError(f"{gguf.path}: rope scaling is not supported")

    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise PymlError(f"{gguf.path}: tokenizer.ggml.tokens is missing or not a list of strings")
    vocab = integer("llama.vocab_size") if "llama.vocab_size" in gguf.metadata else len(tokens)
    if vocab != len(tokens):
        raise PymlError(
            f"{gguf.path}: vocab size {vocab} differs from the {len(tokens)} tokens listed"
        )
    return LlamaDims(
        hidden=hidden,
        n_layers=integer("llama.block_count"),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn=integer("llama.feed_forward_length"),
        vocab=vocab,
        context_length=integer("llama.context_length"),
        rms_norm_eps=real("llama.attention.layer_norm_rms_epsilon"),
        rope_theta=real("llama.rope.freq_base") if "llama.rope.freq_base" in gguf.metadata else 1e4,
    )


def expected_shapes(dims: LlamaDims, tied: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor a llama GGUF with these dims holds, and its shape in numpy order (HF layout)."""
    q_rows, kv_rows = dims.n_heads * dims.head_dim, dims.n_kv_heads * dims.head_dim
    block = {
        "attn_norm.weight": (dims.hidden,),
        "attn_q.weight": (q_rows, dims.hidden),
        "attn_k.weight": (kv_rows, dims.hidden),
        "attn_v.weight": (kv_rows, dims.hidden),
        "attn_output.weight": (dims.hidden, q_rows),
        "ffn_norm.weight": (dims.hidden,),
        "ffn_gate.weight": (dims.ffn, dims.hidden),
        "ffn_up.weight": (dims.ffn, dims.hidden),
        "ffn_down.weight": (dims.hidden, dims.ffn),
    }
    shapes = {"token_embd.weight": (dims.vocab, dims.hidden), "output_norm.weight": (dims.hidden,)}
    if not tied:
        shapes["output.weight"] = (dims.vocab, dims.hidden)
    for layer in range(dims.n_layers):
        shapes.update({f"blk.{layer}.{name}": shape for name, shape in block.items()})
    return shapes


def check_llama_tensors(gguf: GGUFFile, dims: LlamaDims) -> bool:
    """Check the tensor names and shapes against the dims; returns whether the head is tied."""
    # Checked first so that a corrupt block count cannot make us list billions of names.
    if dims.n_layers * len(_BLOCK_NAMES) > len(gguf.tensors):
        raise PymlError(
            f"{gguf.path}: llama.block_count is {dims.n_layers}, but the file holds "
            f"only {len(gguf.tensors)} tensors"
        )
    tied = "output.weight" not in gguf.tensors
    expected = expected_shapes(dims, tied)
    missing = [name for name in expected if name not in gguf.tensors]
    if missing:
        raise PymlError(f"{gguf.path}: missing tensors {_first_few(missing)} of a llama model")
    unexpected = [name for name in gguf.tensors if name not in expected]
    if unexpected:
        raise PymlError(
            f"{gguf.path}: tensors {_first_few(unexpected)} are not part of a llama "
            f"model with {dims.n_layers} layers"
        )
    for name, tensor in gguf.tensors.items():
        if tensor.shape != expected[name]:
            raise PymlError(
                f"{gguf.path}: tensor {name!r}: expected shape {expected[name]}, observed "
                f"{tensor.shape} (metadata: hidden {dims.hidden}, {dims.n_heads} heads, "
                f"{dims.n_kv_heads} kv heads of {dims.head_dim}, ffn {dims.ffn}, vocab {dims.vocab})"
            )
    return tied


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a (validated) llama GGUF tensor name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    _, layer, suffix = gguf_name.split(".", 2)
    return f"model.layers.{layer}.{_BLOCK_NAMES[suffix]}"


def unpermute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of a Q or K projection's rows (n_heads: its number of heads).

    Hugging Face rotates the two halves of each head (i, i + d/2) together; llama.cpp rotates
    neighbours (2i, 2i + 1), so its converter reorders each head's rows with
        w.reshape(n_heads, 2, d // 2, cols).swapaxes(1, 2).reshape(w.shape)
    which this inverts.
    """
    rows = weight.shape[0]
    head_dim = rows // n_heads
    return np.ascontiguousarray(
        weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def hf_config(gguf: GGUFFile, dims: LlamaDims, tied: bool) -> dict[str, object]:
    """config.json: the Hugging Face LlamaConfig of this model."""
    config: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dims.hidden,
        "intermediate_size": dims.ffn,
        "num_hidden_layers": dims.n_layers,
        "num_attention_heads": dims.n_heads,
        "num_key_value_heads": dims.n_kv_heads,
        "head_dim": dims.head_dim,
        "vocab_size": dims.vocab,
        "max_position_embeddings": dims.context_length,
        "rms_norm_eps": dims.rms_norm_eps,
        "rope_theta": dims.rope_theta,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    config.update(_generation_config(gguf))
    return config


def _generation_config(gguf: GGUFFile) -> dict[str, int]:
    ids = {
        "bos_token_id": special_token_id(gguf, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": special_token_id(gguf, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": special_token_id(gguf, "tokenizer.ggml.padding_token_id"),
    }
    return {name: index for name, index in ids.items() if index is not None}


def _decode_tensors(gguf: GGUFFile, dims: LlamaDims, bar: tqdm | None) -> dict[str, np.ndarray]:
    heads_of_rows = {"attn_q.weight": dims.n_heads, "attn_k.weight": dims.n_kv_heads}
    tensors = {}
    for name, tensor in gguf.tensors.items():
        weight = dequantize(tensor.data, tensor.ggml_type, tensor.shape)
        n_heads = heads_of_rows.get(name.split(".", 2)[-1])
        if n_heads is not None:
            weight = unpermute_rotary_rows(weight, n_heads)
        tensors[hf_name(name)] = weight
        if bar is not None:
            bar.update()
    return tensors


def _json_bytes(value: dict[str, object]) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _first_few(names: list[str]) -> str:
    shown = ", ".join(repr(name) for name in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")
