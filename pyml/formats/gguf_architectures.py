"""What a llama, qwen2, qwen3, phi3 or gemma3 GGUF means: its hyper-parameters, tensors, Hugging Face form and spec.

A GGUF names its architecture in `general.architecture` and keeps the hyper-parameters under
`{architecture}.*` metadata keys; what the file does not state, llama.cpp fixes per architecture
(gemma3: five sliding-window layers to every global one, a RoPE base of 10000 on the sliding
ones, the embedding scaled by sqrt(hidden)), and so do we. Each architecture here turns the
metadata into checked dimensions and those into: the tensors the file must hold (GGUF name ->
Hugging Face name and shape), the change that takes a GGUF tensor to its Hugging Face value, the
Hugging Face config.json, and the pyml spec of the model.

The two changes llama.cpp's converter (convert_hf_to_gguf.py) makes, which we undo:
- llama: the Q and K rows of each head are reordered so that rotary pairs are neighbours
  (its `permute`); Hugging Face rotates the halves of each head, so we put the rows back. qwen2
  and qwen3 are converted without the reordering: llama.cpp rotates them in the NEOX (halves)
  layout.
- gemma3: Gemma's RMSNorm multiplies by (1 + w); the converter stores 1 + w so that llama.cpp can
  multiply by the stored gain, and transformers' GGUF loader subtracts 1 again (in float32). We do
  the same, so our weights equal transformers'. Gemma's Q and K rows are not reordered: llama.cpp
  rotates gemma3 in the NEOX (halves) layout, as Hugging Face does.

RoPE scaling: a linear one is stated in `rope.scaling.type` and `rope.scaling.factor`; Llama 3's
only as the factor of each frequency, in a `rope_freqs.weight` tensor that is no Hugging Face
weight, from which we recover its parameters (`llama3_scaling_of`) and which export writes back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pyml.errors import PymlError
from pyml.formats.gguf_read import GGUFFile
from pyml.formats.hf_config import hf_rope_scaling, longrope_default_attention_factor
from pyml.weight_formats import GGMLType

SUPPORTED = ("llama", "qwen2", "qwen3", "phi3", "gemma3")

# Llama 3's RoPE scaling as llama.cpp stores it: the factor that divides each frequency.
ROPE_FACTORS = "rope_freqs.weight"

# Phi-3's LongRoPE as llama.cpp stores it: each set of per-frequency factors as a tensor.
LONGROPE_FACTORS = {"short_factor": "rope_factors_short.weight", "long_factor": "rope_factors_long.weight"}

# GGUF -> Hugging Face names of the tensors outside the blocks, for both architectures.
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when the head is tied to the embedding
}


@dataclass(frozen=True)
class LlamaDims:
    """What the GGUF's metadata says about a llama model's dimensions."""

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
    rope_dims: int  # the features of each head RoPE rotates (the first ones)
    # the spec's RoPE scaling ({"type": "linear" or "llama3", its parameters}), or None
    rope_scaling: dict | None


@dataclass(frozen=True)
class Phi3Dims(LlamaDims):
    """A phi3 model's dimensions: a llama's, plus its window (0: none) and the context its RoPE
    was trained for."""

    sliding_window: int
    original_context_length: int


@dataclass(frozen=True)
class Gemma3Dims(LlamaDims):
    """A gemma3 model's dimensions: a llama's, plus its sliding-window attention and scales."""

    sliding_window: int
    sliding_pattern: int  # layer l attends globally when (l + 1) % sliding_pattern == 0
    rope_local_theta: float  # the RoPE base of the sliding-window layers
    query_pre_attn_scalar: int  # attention scores are scaled by its inverse square root


class Metadata:
    """Typed, checked reads of a GGUF's `{architecture}.*` hyper-parameters."""

    def __init__(self, gguf: GGUFFile, architecture: str):
        self.gguf = gguf
        self.prefix = architecture + "."

    def fail(self, message: str) -> PymlError:
        return PymlError(f"{self.gguf.path}: {message}")

    def has(self, key: str) -> bool:
        return self.prefix + key in self.gguf.metadata

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.gguf.metadata.get(self.prefix + key, default)
        if type(value) is not int or value <= 0:
            raise self.fail(f"{self.prefix}{key} is {value!r}, not a positive integer")
        return value

    def real(self, key: str, default: float | None = None) -> float:
        value = self.gguf.metadata.get(self.prefix + key, default)
        if type(value) is not float or not value > 0 or math.isinf(value):
            raise self.fail(f"{self.prefix}{key} is {value!r}, not a positive number")
        # Stored as float32: write the shortest decimal that reads back as that float32
        # (1e-05, not 9.999999747378752e-06), which is what the model's authors wrote.
        return float(str(np.float32(value)))

    def refuse(self, key: str, what: str, allowed: object = None) -> None:
        """Fail if the file sets `key` to anything but `allowed`: a feature pyml lacks."""
        value = self.gguf.metadata.get(self.prefix + key, allowed)
        if value != allowed:
            raise self.fail(f"{what} is not supported ({self.prefix}{key} is {value!r})")


def architecture_of(gguf: GGUFFile) -> Llama:
    """The architecture the GGUF declares, with its dimensions read and checked."""
    architecture = gguf.metadata.get("general.architecture")
    if architecture == "llama":
        return Llama(gguf)
    if architecture == "qwen2":
        return Qwen2(gguf)
    if architecture == "qwen3":
        return Qwen3(gguf)
    if architecture == "gemma3":
        return Gemma3(gguf)
    if architecture == "phi3":
        return Phi3(gguf)
    raise PymlError(
        f"{gguf.path}: architecture {architecture!r} is not supported (only {', '.join(SUPPORTED)})"
    )


class Llama:
    """A llama-architecture GGUF (Llama, SmolLM2, ...): a pre-norm SwiGLU decoder."""

    name = "llama"
    hf_class = "LlamaForCausalLM"
    stores_rope_factors = True  # Llama 3's RoPE scaling as rope_freqs.weight (llama.cpp loads it)
    partial_rotary = False  # RoPE on the first rope.dimension_count features of each head only
    linear_rope_scaling = True  # rope.scaling.type "linear" (Gemma 3 scales its global layers only)
    qkv_bias = False  # biases on the q, k and v projections (not on the output's)
    qk_norm = False  # an RMSNorm of each q and k head (its gain w, no unit offset)
    # GGUF name within block i ("blk.{i}.") -> Hugging Face name within "model.layers.{i}.".
    block_names = {
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

    def __init__(self, gguf: GGUFFile):
        self.path = gguf.path
        self.dims = self.read_dims(Metadata(gguf, self.name), gguf)

    @classmethod
    def of_dims(cls, dims: LlamaDims, path: Path) -> Llama:
        """The architecture of dims read from elsewhere than a GGUF (a Hugging Face config.json at
        `path`, `pyml.formats.hf_import`), so that its tensors and spec are the ones an import of
        the same model's GGUF finds."""
        architecture = cls.__new__(cls)
        architecture.path, architecture.dims = path, dims
        return architecture

    def read_dims(self, meta: Metadata, gguf: GGUFFile) -> LlamaDims:
        return LlamaDims(**self.common_dims(meta, gguf))

    def common_dims(self, meta: Metadata, gguf: GGUFFile) -> dict[str, object]:
        """The fields of LlamaDims, which both architectures store under the same keys."""
        hidden = meta.integer("embedding_length")
        n_heads = meta.integer("attention.head_count")
        n_kv_heads = meta.integer("attention.head_count_kv")
        if meta.has("attention.key_length"):
            head_dim = meta.integer("attention.key_length")
        elif hidden % n_heads == 0:
            head_dim = hidden // n_heads
        else:
            raise meta.fail(f"{hidden} hidden units do not split into {n_heads} heads")
        if meta.integer("attention.value_length", head_dim) != head_dim:
            raise meta.fail("attention value length differs from the key length")
        if n_heads % n_kv_heads:
            raise meta.fail(f"{n_heads} heads do not share {n_kv_heads} key/value heads")
        if head_dim % 2:
            raise meta.fail(f"head size {head_dim} is odd; rotary embeddings need pairs")
        rope_dims = meta.integer("rope.dimension_count", head_dim)
        if rope_dims != head_dim and not self.partial_rotary:
            raise meta.fail("rotary embeddings on part of each head are not supported")
        if rope_dims > head_dim or rope_dims % 2:
            raise meta.fail(f"rope.dimension_count {rope_dims} is not an even part of heads of {head_dim}")
        rope_theta = meta.real("rope.freq_base", 1e4)  # llama.cpp's default

        tokens = gguf.metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list):
            raise meta.fail("tokenizer.ggml.tokens is missing or not a list of strings")
        vocab = meta.integer("vocab_size", len(tokens))
        if vocab != len(tokens):
            raise meta.fail(f"vocab size {vocab} differs from the {len(tokens)} tokens listed")
        return dict(
            hidden=hidden,
            n_layers=meta.integer("block_count"),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            ffn=meta.integer("feed_forward_length"),
            vocab=vocab,
            context_length=meta.integer("context_length"),
            rms_norm_eps=meta.real("attention.layer_norm_rms_epsilon"),
            rope_theta=rope_theta,
            rope_dims=rope_dims,
            rope_scaling=self.read_rope_scaling(meta, gguf, head_dim, rope_theta),
        )

    def read_rope_scaling(self, meta: Metadata, gguf: GGUFFile, head_dim: int,
                          theta: float) -> dict | None:
        """The RoPE scaling the file states: `rope.scaling.type` "linear" with its factor, or (llama
        only) Llama 3's, which llama.cpp's converter stores as nothing but the per-frequency
        factors of a `rope_freqs.weight` tensor."""
        kind = gguf.metadata.get(meta.prefix + "rope.scaling.type", "none")
        factors = gguf.tensors.get(ROPE_FACTORS) if self.stores_rope_factors else None
        if kind == "linear" and factors is None and self.linear_rope_scaling:
            return {"type": "linear", "factor": meta.real("rope.scaling.factor")}
        meta.refuse("rope.scaling.type", "rope scaling", allowed="none")
        if factors is None:
            return None
        if factors.ggml_type != GGMLType.F32 or factors.shape != (head_dim // 2,):
            raise meta.fail(f"{ROPE_FACTORS} is not {head_dim // 2} float32 values")
        return llama3_scaling_of(factors.data.view(np.float32), head_dim, theta, meta)

    # -- tensors

    def block_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of one block (GGUF name within it) and its shape in Hugging Face layout."""
        dims = self.dims
        q_rows, kv_rows = dims.n_heads * dims.head_dim, dims.n_kv_heads * dims.head_dim
        return {
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

    def expected_shapes(self, tied: bool) -> dict[str, tuple[int, ...]]:
        """Every tensor the file must hold (GGUF names) and its shape in Hugging Face layout."""
        dims = self.dims
        shapes = {
            "token_embd.weight": (dims.vocab, dims.hidden),
            "output_norm.weight": (dims.hidden,),
        }
        if not tied:
            shapes["output.weight"] = (dims.vocab, dims.hidden)
        block = self.block_shapes()
        for layer in range(dims.n_layers):
            shapes.update({f"blk.{layer}.{name}": shape for name, shape in block.items()})
        return shapes | {name: tensor.shape for name, tensor in self.derived_tensors().items()}

    def derived_tensors(self) -> dict[str, np.ndarray]:
        """The tensors llama.cpp reads from the file that are no Hugging Face weights but follow
        from the config (GGUF name -> value): Llama 3's RoPE frequency factors."""
        scaling = self.dims.rope_scaling
        if scaling is None or scaling["type"] != "llama3":
            return {}
        return {ROPE_FACTORS: llama3_rope_factors(scaling, self.dims.head_dim, self.dims.rope_theta)}

    def hf_name(self, gguf_name: str) -> str:
        """The Hugging Face name of one of the file's (checked) tensor names."""
        if gguf_name in GLOBAL_NAMES:
            return GLOBAL_NAMES[gguf_name]
        _, layer, within = gguf_name.split(".", 2)
        return f"model.layers.{layer}.{self.block_names[within]}"

    def hf_weight(self, gguf_name: str, weight: np.ndarray) -> np.ndarray:
        """The Hugging Face value of a decoded GGUF tensor."""
        within = gguf_name.split(".", 2)[-1]
        if within == "attn_q.weight":
            return unpermute_rotary_rows(weight, self.dims.n_heads)
        if within == "attn_k.weight":
            return unpermute_rotary_rows(weight, self.dims.n_kv_heads)
        return weight

    def describe_dims(self) -> str:
        dims = self.dims
        return (
            f"hidden {dims.hidden}, {dims.n_heads} heads, {dims.n_kv_heads} kv heads of "
            f"{dims.head_dim}, ffn {dims.ffn}, vocab {dims.vocab}"
        )

    # -- what we write

    def hf_config(self, tied: bool) -> dict[str, object]:
        """config.json without the special token ids: the Hugging Face LlamaConfig."""
        dims = self.dims
        return {
            "architectures": [self.hf_class],
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
            **({"rope_scaling": hf_rope_scaling(dims.rope_scaling)} if dims.rope_scaling else {}),
            "tie_word_embeddings": tied,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }

    def spec(self, name: str, tied: bool) -> dict[str, object]:
        """The pyml spec of the model, as the data a spec file holds (the decoder shorthand)."""
        dims = self.dims
        norm = {"dim": dims.hidden, "eps": dims.rms_norm_eps}
        attention = {
            "dim": dims.hidden,
            "n_heads": dims.n_heads,
            "n_kv_heads": dims.n_kv_heads,
            "head_dim": dims.head_dim,
            "rope": {"theta": dims.rope_theta},
        }
        if dims.rope_scaling:
            attention["rope"]["scaling"] = dict(dims.rope_scaling)
        if self.qkv_bias:
            attention["qkv_bias"] = True
        if self.qk_norm:
            attention["qk_norm"] = {"eps": dims.rms_norm_eps}
        return {
            "name": name,
            "form": "decoder",
            "max_seq_len": dims.context_length,
            "embedding": {"vocab_size": dims.vocab, "dim": dims.hidden},
            "block": {
                "count": dims.n_layers,
                "attn_norm": dict(norm),
                "attention": attention,
                "mlp_norm": dict(norm),
                "mlp": {"dim": dims.hidden, "hidden": dims.ffn},
            },
            "final_norm": dict(norm),
            "lm_head": {"dim": dims.hidden, "vocab_size": dims.vocab, "tied": tied},
        }


class Qwen2(Llama):
    """A qwen2-architecture GGUF (Qwen2, Qwen2.5): Llama's block with biases on the q, k and v
    projections, its Q and K rows as Hugging Face stores them."""

    name = "qwen2"
    hf_class = "Qwen2ForCausalLM"
    stores_rope_factors = False
    qkv_bias = True
    block_names = Llama.block_names | {
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
    }

    def block_shapes(self) -> dict[str, tuple[int, ...]]:
        dims = self.dims
        shapes = super().block_shapes()
        shapes.update({
            "attn_q.bias": (dims.n_heads * dims.head_dim,),
            "attn_k.bias": (dims.n_kv_heads * dims.head_dim,),
            "attn_v.bias": (dims.n_kv_heads * dims.head_dim,),
        })
        return shapes

    def hf_weight(self, gguf_name: str, weight: np.ndarray) -> np.ndarray:
        return weight

    def hf_config(self, tied: bool) -> dict[str, object]:
        """config.json without the special token ids: the Hugging Face Qwen2Config (which has no
        bias options: its q, k and v projections always have them)."""
        config = super().hf_config(tied)
        for llama_only in ("attention_bias", "mlp_bias"):
            del config[llama_only]
        return config | {"model_type": "qwen2", "use_sliding_window": False}


class Qwen3(Llama):
    """A qwen3-architecture GGUF (Qwen3's dense models): Llama's block with an RMSNorm of each q
    and k head before the rotation (QK-norm), its Q and K rows as Hugging Face stores them."""

    name = "qwen3"
    hf_class = "Qwen3ForCausalLM"
    stores_rope_factors = False
    qk_norm = True
    block_names = Llama.block_names | {
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    }

    def block_shapes(self) -> dict[str, tuple[int, ...]]:
        dims = self.dims
        return super().block_shapes() | {
            "attn_q_norm.weight": (dims.head_dim,),
            "attn_k_norm.weight": (dims.head_dim,),
        }

    def hf_weight(self, gguf_name: str, weight: np.ndarray) -> np.ndarray:
        return weight

    def hf_config(self, tied: bool) -> dict[str, object]:
        """config.json without the special token ids: the Hugging Face Qwen3Config."""
        config = super().hf_config(tied)
        del config["mlp_bias"]  # Qwen3Config has attention_bias only
        return config | {"model_type": "qwen3", "use_sliding_window": False}


class Phi3(Llama):
    """A phi3-architecture GGUF (Phi-3 mini and medium, Phi-4 mini): Llama's block with q, k and v
    in one tensor (attn_qkv) and gate and up in one (ffn_up, gate rows first), as Hugging Face's
    Phi3 keeps them (qkv_proj, gate_up_proj); RoPE on the first rope.dimension_count features of
    each head (partial_rotary_factor), rotated in halves (no Q/K reordering); and a sliding window
    on every layer when attention.sliding_window is positive (llama.cpp currently runs Phi-3
    without it, which is the same up to that many tokens)."""

    name = "phi3"
    hf_class = "Phi3ForCausalLM"
    stores_rope_factors = False
    partial_rotary = True
    block_names = {
        "attn_norm.weight": "input_layernorm.weight",
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }

    def read_dims(self, meta: Metadata, gguf: GGUFFile) -> Phi3Dims:
        window = gguf.metadata.get(meta.prefix + "attention.sliding_window", 0)
        if type(window) is not int or window < 0:
            raise meta.fail(f"{meta.prefix}attention.sliding_window is {window!r}, not a count of positions")
        common = self.common_dims(meta, gguf)
        original = meta.integer("rope.scaling.original_context_length", common["context_length"])
        longrope = longrope_scaling_of(gguf, meta, common["rope_dims"], common["context_length"], original)
        if longrope is not None:
            common["rope_scaling"] = longrope
        return Phi3Dims(**common, sliding_window=window, original_context_length=original)

    def derived_tensors(self) -> dict[str, np.ndarray]:
        """LongRoPE's factors (Phi-3 128k, Phi-3.5), which llama.cpp reads from the file."""
        scaling = self.dims.rope_scaling
        if scaling is None or scaling["type"] != "longrope":
            return {}
        return {LONGROPE_FACTORS[key]: np.array(scaling[key], np.float32) for key in LONGROPE_FACTORS}

    def block_shapes(self) -> dict[str, tuple[int, ...]]:
        dims = self.dims
        rows = (dims.n_heads + 2 * dims.n_kv_heads) * dims.head_dim
        return {
            "attn_norm.weight": (dims.hidden,),
            "attn_qkv.weight": (rows, dims.hidden),
            "attn_output.weight": (dims.hidden, dims.n_heads * dims.head_dim),
            "ffn_norm.weight": (dims.hidden,),
            "ffn_up.weight": (2 * dims.ffn, dims.hidden),
            "ffn_down.weight": (dims.hidden, dims.ffn),
        }

    def hf_weight(self, gguf_name: str, weight: np.ndarray) -> np.ndarray:
        return weight

    def hf_config(self, tied: bool) -> dict[str, object]:
        """config.json without the special token ids: the Hugging Face Phi3Config."""
        dims = self.dims
        config = super().hf_config(tied)
        for llama_only in ("attention_bias", "mlp_bias"):
            del config[llama_only]
        return config | {
            "model_type": "phi3",
            "partial_rotary_factor": dims.rope_dims / dims.head_dim,
            "original_max_position_embeddings": dims.original_context_length,
            "sliding_window": dims.sliding_window or None,
        }

    def spec(self, name: str, tied: bool) -> dict[str, object]:
        dims = self.dims
        spec = super().spec(name, tied)
        attention, mlp = spec["block"]["attention"], spec["block"]["mlp"]
        attention["fused_qkv"] = True
        mlp["fused_gate_up"] = True
        if dims.rope_dims != dims.head_dim:
            attention["rope"]["dims"] = dims.rope_dims
        if dims.sliding_window:
            attention["pattern"] = [{"window": dims.sliding_window}]
        return spec


class Gemma3(Llama):
    """A gemma3-architecture GGUF (the text model of Gemma 3): pre- and post-norms around
    attention and MLP, QK-norm, GeGLU, unit-offset RMSNorm, a scaled embedding and
    sliding-window attention on five of every six layers."""

    name = "gemma3"
    hf_class = "Gemma3ForCausalLM"
    stores_rope_factors = False
    linear_rope_scaling = False
    block_names = {
        "attn_norm.weight": "input_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    }
    # llama.cpp's constants for gemma3 (llama-model.cpp): what the file does not store.
    SLIDING_PATTERN = 6
    ROPE_LOCAL_THETA = 10000.0
    LAYERS_OF_27B = 62  # the one size whose scores are scaled by hidden / heads, not head_dim

    def read_dims(self, meta: Metadata, gguf: GGUFFile) -> Gemma3Dims:
        common = self.common_dims(meta, gguf)
        meta.refuse("attn_logit_softcapping", "attention logit soft-capping")
        meta.refuse("final_logit_softcapping", "final logit soft-capping")
        if common["n_layers"] == self.LAYERS_OF_27B:
            query_pre_attn_scalar = common["hidden"] // common["n_heads"]
        else:
            query_pre_attn_scalar = common["head_dim"]
        return Gemma3Dims(
            **common,
            sliding_window=meta.integer("attention.sliding_window"),
            sliding_pattern=self.SLIDING_PATTERN,
            rope_local_theta=self.ROPE_LOCAL_THETA,
            query_pre_attn_scalar=query_pre_attn_scalar,
        )

    def block_shapes(self) -> dict[str, tuple[int, ...]]:
        dims = self.dims
        shapes = super().block_shapes()
        shapes.update({
            "attn_q_norm.weight": (dims.head_dim,),
            "attn_k_norm.weight": (dims.head_dim,),
            "post_attention_norm.weight": (dims.hidden,),
            "post_ffw_norm.weight": (dims.hidden,),
        })
        return shapes

    def hf_weight(self, gguf_name: str, weight: np.ndarray) -> np.ndarray:
        if gguf_name.endswith("norm.weight"):
            return weight - np.float32(1)  # the file holds 1 + w; see the module docstring
        return weight

    def is_sliding(self, layer: int) -> bool:
        return (layer + 1) % self.dims.sliding_pattern != 0

    def hf_config(self, tied: bool) -> dict[str, object]:
        """config.json without the special token ids: the Hugging Face Gemma3TextConfig.

        `rope_theta` and `rope_local_base_freq` are the keys every Gemma 3 config on the Hub
        has; transformers 5 reads them into its `rope_parameters`.
        """
        dims = self.dims
        return {
            "architectures": [self.hf_class],
            "model_type": "gemma3_text",
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
            "rope_local_base_freq": dims.rope_local_theta,
            "sliding_window": dims.sliding_window,
            "layer_types": [
                "sliding_attention" if self.is_sliding(layer) else "full_attention"
                for layer in range(dims.n_layers)
            ],
            "query_pre_attn_scalar": dims.query_pre_attn_scalar,
            "hidden_activation": "gelu_pytorch_tanh",
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "attention_bias": False,
            "tie_word_embeddings": tied,
            "torch_dtype": "float32",
        }

    def spec(self, name: str, tied: bool) -> dict[str, object]:
        """The pyml spec of the model: a block composed of two residuals, named as Hugging Face
        names the layers so that the tensor names follow."""
        dims = self.dims

        def norm(layer_name: str) -> dict[str, object]:
            return {
                "kind": "rmsnorm",
                "name": layer_name,
                "dim": dims.hidden,
                "eps": dims.rms_norm_eps,
                "unit_offset": True,
            }

        attention: dict[str, object] = {
            "kind": "attention",
            "name": "self_attn",
            "dim": dims.hidden,
            "n_heads": dims.n_heads,
            "n_kv_heads": dims.n_kv_heads,
            "head_dim": dims.head_dim,
            "rope": {"theta": dims.rope_theta},
        }
        scale = dims.query_pre_attn_scalar**-0.5
        if scale != dims.head_dim**-0.5:
            attention["scale"] = scale
        attention["qk_norm"] = {"eps": dims.rms_norm_eps, "unit_offset": True}
        sliding = {"window": dims.sliding_window, "rope_theta": dims.rope_local_theta}
        attention["pattern"] = [
            dict(sliding) if self.is_sliding(layer) else {}
            for layer in range(dims.sliding_pattern)
        ]
        mlp = {"kind": "mlp", "name": "mlp", "dim": dims.hidden, "hidden": dims.ffn,
               "activation": "geglu"}
        return {
            "name": name,
            "form": "decoder",
            "max_seq_len": dims.context_length,
            # Gemma multiplies the embedding by sqrt(hidden), as transformers computes it.
            "embedding": {"vocab_size": dims.vocab, "dim": dims.hidden, "scale": dims.hidden**0.5},
            "block": {
                "count": dims.n_layers,
                "layers": [
                    {"kind": "residual", "body": [
                        norm("input_layernorm"), attention, norm("post_attention_layernorm"),
                    ]},
                    {"kind": "residual", "body": [
                        norm("pre_feedforward_layernorm"), mlp, norm("post_feedforward_layernorm"),
                    ]},
                ],
            },
            "final_norm": {"dim": dims.hidden, "eps": dims.rms_norm_eps, "unit_offset": True},
            "lm_head": {"dim": dims.hidden, "vocab_size": dims.vocab, "tied": tied},
        }


def unpermute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of a Q or K projection's rows (n_heads: its number of heads).

    Hugging Face rotates the two halves of each head (i, i + d/2) together; llama.cpp rotates
    neighbours (2i, 2i + 1) in llama models, so its converter reorders each head's rows with
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


def llama3_rope_factors(scaling: dict, head_dim: int, theta: float) -> np.ndarray:
    """The factors llama.cpp's converter stores as rope_freqs.weight for Llama 3's scaling
    (its LlamaModel.generate_extra_tensors): each frequency is divided by its factor, 1 for short
    wavelengths, `factor` for long ones, interpolated between; computed in float32 as there."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    freqs = np.float32(1) / (theta ** exponents.astype(np.float64)).astype(np.float32)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    f32 = np.float32
    factors = []
    for freq in freqs:
        # torch divides a number by a tensor as the tensor's reciprocal times the number
        wavelen = (f32(1) / freq) * f32(2 * math.pi)
        if wavelen < context / high:
            factors.append(1.0)
        elif wavelen > context / low:
            factors.append(factor)
        else:
            smooth = ((f32(1) / wavelen) * f32(context) - f32(low)) / f32(high - low)
            factors.append(f32(1) / ((f32(1) - smooth) / f32(factor) + smooth))
    return np.array(factors, dtype=np.float32)


def llama3_scaling_of(factors: np.ndarray, head_dim: int, theta: float, meta: Metadata) -> dict | None:
    """Llama 3's scaling parameters from the per-frequency factors llama.cpp stores.

    Between the bands, 1 / factor_i = (1 - s_i) / F + s_i with s_i = a * inv_freq_i + b, linear in
    the frequency; two such factors give a and b. F is the factor of the long wavelengths. Only
    the band edges' ratios are determined (scaling original_max_position_embeddings and both
    frequency factors together changes nothing), so low_freq_factor is taken as 1, its value in
    every Llama 3 config. The parameters found must give back every stored factor, or the file
    is refused."""
    if not np.all(np.isfinite(factors)) or np.any(factors <= 0):
        raise meta.fail(f"{ROPE_FACTORS} holds factors that are not positive numbers")
    if np.all(factors == 1):
        return None  # no scaling
    inv_freq = np.float32(1) / (theta ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
    factor = float(factors.max())
    between = (factors > 1) & (factors < np.float32(factor))
    if factor <= 1 or between.sum() < 2:
        raise meta.fail(f"{ROPE_FACTORS} is not Llama 3's RoPE scaling (fewer than two "
                        "frequencies between its bands, or factors below 1)")
    smooth = (1 / factors[between].astype(np.float64) - 1 / factor) / (1 - 1 / factor)
    a, b = np.polyfit(inv_freq[between].astype(np.float64), smooth, 1)
    if not (a > 0 and b < 0):
        raise meta.fail(f"{ROPE_FACTORS} is not Llama 3's RoPE scaling (its factors do not "
                        "fall from long wavelengths to short ones)")
    high = 1 - 1 / b  # b = -low / (high - low), a = context / (2 pi (high - low)), low = 1
    context = round(a * 2 * math.pi * (high - 1))
    for digits in range(7):  # the shortest high_freq_factor that gives every factor back
        scaling = {"type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                   "high_freq_factor": round(float(high), digits),
                   "original_max_position_embeddings": context}
        if scaling["high_freq_factor"] > 1 and context > 0 and np.allclose(
                llama3_rope_factors(scaling, head_dim, theta), factors, rtol=1e-5, atol=0):
            return scaling
    raise meta.fail(f"{ROPE_FACTORS} is not Llama 3's RoPE scaling (no factor, band and "
                    "original context length give its factors)")


def longrope_scaling_of(gguf: GGUFFile, meta: Metadata, rope_dims: int, context: int,
                        original: int) -> dict | None:
    """The spec's LongRoPE scaling of a phi3 file holding rope_factors_long and
    rope_factors_short (llama.cpp's converter writes both, with rope.scaling.attn_factor), or None
    where it holds neither."""
    found = {key: gguf.tensors.get(name) for key, name in LONGROPE_FACTORS.items()}
    if all(tensor is None for tensor in found.values()):
        return None
    scaling: dict[str, object] = {"type": "longrope"}
    for key, tensor in found.items():
        name = LONGROPE_FACTORS[key]
        if tensor is None:
            raise meta.fail(f"{name} is missing beside the other LongRoPE factors")
        if tensor.ggml_type != GGMLType.F32 or tensor.shape != (rope_dims // 2,):
            raise meta.fail(f"{name} is not {rope_dims // 2} float32 values (one per rotated frequency)")
        factors = tensor.data.view(np.float32)
        if not np.all(np.isfinite(factors)) or np.any(factors <= 0):
            raise meta.fail(f"{name} holds factors that are not positive numbers")
        # the shortest decimals that read back as the stored float32 values, as Metadata.real
        scaling[key] = [float(str(value)) for value in factors]
    default = float(str(np.float32(longrope_default_attention_factor(context, original))))
    scaling["original_max_position_embeddings"] = original
    scaling["attention_factor"] = meta.real("rope.scaling.attn_factor", default)
    return scaling
