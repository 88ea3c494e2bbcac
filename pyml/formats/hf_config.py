"""Which Hugging Face config describes a pyml spec, and how a config.json disagrees with one.

A model folder's config.json is Hugging Face's description of the model its spec.toml declares: a
LlamaConfig for a spec whose block is Llama's (the decoder shorthand), a Qwen2Config for Llama's
block with biases on the q, k and v projections only, a Qwen3Config for Llama's block with
QK-norm (gains without a unit offset) and no biases, a Phi3Config for Llama's block whose q, k, v
and gate, up are stored as one tensor each (optionally partial RoPE and one window), a
Gemma3TextConfig for one whose block is Gemma 3's (pre- and post-norms around attention and
MLP). From the spec we derive the
config fields it determines and compare them with the file's, field by field, so that a folder
holding another model is refused with the fields that differ.
"""

from __future__ import annotations

import math

from pyml.spec import DecoderModel
from pyml.spec.layers import MLP, Attention, RMSNorm

# Each family's block as the layer kinds of its residuals; the shorthand expands into Llama's.
LLAMA_BLOCK = (("rmsnorm", "attention"), ("rmsnorm", "mlp"))
GEMMA3_BLOCK = (("rmsnorm", "attention", "rmsnorm"), ("rmsnorm", "mlp", "rmsnorm"))
# The Hugging Face name of each MLP activation (`hidden_act` in Llama, `hidden_activation` in Gemma).
HF_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}


def block_kinds(spec: DecoderModel) -> tuple[tuple[str, ...], ...] | None:
    """The layer kinds of each residual of the block, or None if the block is not residuals."""
    items = spec.block_items()
    if any(item.layer.kind != "residual" for item in items):
        return None
    return tuple(tuple(inner.layer.kind for inner in item.body) for item in items)


def block_layers(spec: DecoderModel, kind: type) -> list:
    found = []

    def visit(items) -> None:
        for item in items:
            if isinstance(item.layer, kind):
                found.append(item.layer)
            visit(item.body)

    visit(spec.block_items())
    return found


def common_fields(spec: DecoderModel, attention: Attention, mlp: MLP) -> dict[str, object]:
    """The fields LlamaConfig and Gemma3TextConfig share, as the spec determines them."""
    return {
        "vocab_size": spec.embedding.vocab_size,
        "hidden_size": spec.embedding.dim,
        "num_hidden_layers": spec.block.count,
        "num_attention_heads": attention.n_heads,
        "num_key_value_heads": attention.n_kv_heads,
        "head_dim": attention.head_dim,
        "intermediate_size": mlp.hidden,
        "max_position_embeddings": spec.max_seq_len,
        "tie_word_embeddings": spec.lm_head.tied,
        "rms_norm_eps": spec.final_norm.eps,
        "rope_theta": attention.rope.theta if attention.rope else None,
        "rope_scaling": (hf_rope_scaling(attention.rope.scaling.model_dump())
                         if attention.rope and attention.rope.scaling else None),
    }


def not_describable(spec: DecoderModel, attention: Attention, mlp: MLP, gemma: bool,
                    phi3: bool = False) -> list[str]:
    """What of the spec its family's config has no field for (gemma: Gemma 3, phi3: Phi-3, else
    Llama, Qwen2 or Qwen3)."""
    norms = [spec.final_norm, *block_layers(spec, RMSNorm)]
    norms += [attention.qk_norm] if attention.qk_norm else []
    types = [attention.type_of_layer(l) for l in range(spec.block.count)]
    problems = []
    if attention.rope is None:
        problems.append("attention without RoPE")
    if attention.rotary_dims != attention.head_dim and not phi3:
        problems.append("RoPE on part of each head")
    if attention.fused_qkv != phi3 or mlp.fused_gate_up != phi3:
        problems.append("q, k, v and gate, up stored as one tensor each only in part"
                        if phi3 else "q, k, v or gate, up stored as one tensor")
    if phi3 and (attention.qkv_bias or attention.out_bias or mlp.bias or attention.qk_norm):
        problems.append("biases or QK-norm in Phi-3's block")
    if attention.out_bias and not attention.qkv_bias:
        problems.append("bias on the attention's output projection alone")
    if attention.qkv_bias and not attention.out_bias and (gemma or mlp.bias):
        problems.append("q, k and v biases in " + ("Gemma 3's block" if gemma else "a block with MLP biases"))
    if len({norm.eps for norm in norms}) > 1:
        problems.append("norms with different eps")
    if not gemma:
        if any(norm.unit_offset for norm in norms):
            problems.append("unit-offset norms")
        if attention.qk_norm is not None and (attention.qkv_bias or mlp.bias):
            problems.append("QK-norm with biases")
        one_window = phi3 and len(attention.pattern or ()) == 1 and attention.pattern[0].rope_theta is None
        if attention.pattern is not None and not one_window:
            problems.append("attention pattern" + (" other than one window on every layer" if phi3 else ""))
        if attention.scale is not None:
            problems.append("attention scale")
        if spec.embedding.scale != 1.0:
            problems.append("embedding scale")
        return problems
    if not all(norm.unit_offset for norm in norms) or attention.qk_norm is None:
        problems.append("norms without a unit offset or attention without QK-norm")
    for layer_type in (True, False):  # sliding, global: one window and one RoPE base each
        if len({(kind.window, kind.rope_theta) for kind in types if bool(kind.window) == layer_type}) > 1:
            problems.append("windows or RoPE bases that differ between layers of one type")
    if attention.rope is not None and attention.rope.scaling is not None:
        problems.append("RoPE scaling")  # Gemma 3 scales its global layers only
    if not math.isclose(spec.embedding.scale, spec.embedding.dim**0.5, rel_tol=1e-7):
        problems.append(f"embedding scale other than sqrt({spec.embedding.dim})")
    if mlp.bias:
        problems.append("MLP biases")
    return problems


def described_config(spec: DecoderModel) -> tuple[dict[str, object], list[str]]:
    """The Hugging Face config fields that describe `spec`, model_type first, and what of the spec
    no config of its family can describe (empty when the spec is a Llama or a Gemma 3 model)."""
    kinds = block_kinds(spec)
    if kinds not in (LLAMA_BLOCK, GEMMA3_BLOCK):
        return {"model_type": None}, ["a block that is neither Llama's nor Gemma 3's"]
    gemma = kinds == GEMMA3_BLOCK
    (attention,), (mlp,) = block_layers(spec, Attention), block_layers(spec, MLP)
    phi3 = not gemma and attention.fused_qkv
    qwen2 = not gemma and attention.qkv_bias and not attention.out_bias
    qwen3 = not gemma and attention.qk_norm is not None
    model_type = ("gemma3_text" if gemma else "phi3" if phi3 else "qwen3" if qwen3 else
                  "qwen2" if qwen2 else "llama")
    fields = {"model_type": model_type} | common_fields(spec, attention, mlp)
    activation = HF_ACTIVATIONS[mlp.activation]
    if not gemma:
        fields |= {"hidden_act": activation}
        if model_type == "llama":
            fields |= {"attention_bias": attention.qkv_bias, "mlp_bias": mlp.bias}
        elif qwen3:
            fields |= {"attention_bias": attention.qkv_bias}
        elif phi3:
            window = attention.type_of_layer(0).window
            fields |= {"partial_rotary_factor": attention.rotary_dims / attention.head_dim,
                       "sliding_window": window}
        return fields, not_describable(spec, attention, mlp, gemma, phi3)
    types = [attention.type_of_layer(l) for l in range(spec.block.count)]
    sliding = [kind for kind in types if kind.window]
    full = [kind for kind in types if not kind.window]
    fields |= {
        "rope_theta": full[0].rope_theta if full else fields["rope_theta"],
        "rope_local_base_freq": sliding[0].rope_theta if sliding else None,
        "sliding_window": sliding[0].window if sliding else None,
        "layer_types": ["sliding_attention" if kind.window else "full_attention" for kind in types],
        "query_pre_attn_scalar": attention.score_scale**-2,
        "hidden_activation": activation,
        "attention_bias": attention.qkv_bias,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }
    return fields, not_describable(spec, attention, mlp, gemma)


def hf_rope_scaling(scaling: dict) -> dict:
    """The spec's RoPE scaling as a Hugging Face config's `rope_scaling` (`rope_type` for `type`)."""
    return {"rope_type": scaling["type"]} | {key: value for key, value in scaling.items() if key != "type"}


# What transformers' config class of each model_type (5.x) takes for a field that config.json
# leaves out, for the fields a spec determines; a head_dim of None is hidden_size // heads.
HF_DEFAULTS = {
    "llama": {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "head_dim": None,
              "rope_theta": 10000.0, "tie_word_embeddings": False},
    "mistral": {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "head_dim": None,
                "rope_theta": 10000.0, "tie_word_embeddings": False, "sliding_window": 4096},
    "qwen2": {"hidden_act": "silu", "head_dim": None, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "use_sliding_window": False},
    "qwen3": {"attention_bias": False, "hidden_act": "silu", "head_dim": 128, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "use_sliding_window": False},
    "phi3": {"hidden_act": "silu", "head_dim": None, "rope_theta": 10000.0,
             "tie_word_embeddings": False, "partial_rotary_factor": 1.0, "sliding_window": None,
             "original_max_position_embeddings": 4096},
    "gemma3_text": {"hidden_activation": "gelu_pytorch_tanh", "head_dim": 256, "rope_theta": 1e6,
                    "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256,
                    "sliding_window": 4096, "sliding_window_pattern": 6, "attention_bias": False,
                    "final_logit_softcapping": None, "attn_logit_softcapping": None,
                    "tie_word_embeddings": True},
}
# model_types whose model is another's block under its own name: Mistral's is Llama's
SAME_BLOCK_AS = {"mistral": "llama"}


def with_rope_bases(config: dict) -> dict:
    """`config` with `rope_theta`, `rope_scaling` (and Gemma's `rope_local_base_freq`, Phi-3's
    `partial_rotary_factor`) as import-gguf writes them, also where transformers 5 saved them in
    `rope_parameters` instead."""
    parameters = config.get("rope_parameters")
    if not isinstance(parameters, dict):
        return config
    if "rope_theta" in parameters:  # one base for every layer (Llama)
        bases = {"rope_theta": parameters["rope_theta"],
                 "partial_rotary_factor": parameters.get("partial_rotary_factor")}
        if parameters.get("rope_type", "default") != "default":
            bases["rope_scaling"] = {key: value for key, value in parameters.items()
                                     if key not in ("rope_theta", "partial_rotary_factor")}
    else:  # a base per layer type (Gemma 3)
        per_type = {kind: value for kind, value in parameters.items() if isinstance(value, dict)}
        bases = {"rope_theta": per_type.get("full_attention", {}).get("rope_theta"),
                 "rope_local_base_freq": per_type.get("sliding_attention", {}).get("rope_theta")}
    return config | {key: value for key, value in bases.items()
                     if value is not None and config.get(key) is None}


def config_as_read(config: dict) -> dict:
    """config.json as transformers reads it, in the keys import-gguf writes: the RoPE bases out of
    `rope_parameters` (`with_rope_bases`), `rope_scaling` with `rope_type` (older files say
    `type`; "default" is none) and LongRoPE's original context and attention factor filled in as
    transformers computes them, Gemma 3's `layer_types` from its `sliding_window_pattern`, and
    the defaults of HF_DEFAULTS where the file leaves a field out."""
    config = with_rope_bases(config)
    defaults = HF_DEFAULTS.get(config.get("model_type"), {})
    config = {key: value for key, value in defaults.items() if key not in config} | config
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if config.get("head_dim") is None and type(hidden) is int and type(heads) is int and heads > 0:
        config["head_dim"] = hidden // heads  # Qwen2Config keeps no head_dim, nor do older files
    if config.get("num_key_value_heads") is None and heads is not None:
        config["num_key_value_heads"] = heads
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict):
        scaling = {("rope_type" if key == "type" else key): value for key, value in scaling.items()}
        if scaling.get("rope_type") == "default":
            scaling = None
        elif scaling.get("rope_type") == "longrope":
            original = scaling.get("original_max_position_embeddings",
                                   config.get("original_max_position_embeddings"))
            context = config.get("max_position_embeddings")
            scaling["original_max_position_embeddings"] = original
            if scaling.get("attention_factor") is None and type(original) is int and type(context) is int:
                scaling["attention_factor"] = longrope_default_attention_factor(context, original)
        config["rope_scaling"] = scaling
    pattern = config.get("sliding_window_pattern")
    layers = config.get("num_hidden_layers")
    if config.get("model_type") == "gemma3_text" and config.get("layer_types") is None and \
            type(pattern) is int and pattern > 0 and type(layers) is int:
        config["layer_types"] = ["sliding_attention" if (layer + 1) % pattern else "full_attention"
                                 for layer in range(layers)]
    return config


def longrope_default_attention_factor(context: int, original: int) -> float:
    """LongRoPE's attention factor for a model of `context` positions trained on `original`, as
    transformers' _compute_longrope_parameters and llama.cpp's converter compute it."""
    scale = context / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0


def same(ours: object, theirs: object) -> bool:
    """Equal, floats to rounding (a config may hold 256 where the spec holds 256.0)."""
    if isinstance(ours, float) and isinstance(theirs, (int, float)):
        return math.isclose(ours, theirs, rel_tol=1e-12)
    return ours == theirs


def config_mismatches(spec: DecoderModel, config: dict) -> list[str]:
    """How a Hugging Face config.json disagrees with the spec, one entry per field; empty when it
    describes the spec's model."""
    expected, not_described = described_config(spec)
    config = config_as_read(config)
    model_type = config.get("model_type")
    if model_type in SAME_BLOCK_AS and SAME_BLOCK_AS[model_type] == expected["model_type"]:
        # Mistral's config describes a Llama with its own name, and no window to be the same
        expected = expected | {"model_type": model_type, "sliding_window": None}
    if expected["model_type"] != model_type:
        family = repr(expected["model_type"]) if expected["model_type"] else "neither Llama nor Gemma 3"
        return [f"model_type is {model_type!r} in config.json but the spec is {family}"]
    if not_described:
        return [f"config.json cannot describe the spec's {', '.join(not_described)}"]
    return [f"{key} is {config.get(key)!r} in config.json but {value!r} in the spec"
            for key, value in expected.items() if not same(value, config.get(key))]
