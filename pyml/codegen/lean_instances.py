"""The Lean file generated for a spec: its skeleton, and one instance of the laws per layer.

An instance is the law's own statement, read from the law index, with the spec's dims put in for
the law's dim variables; its proof is the law applied to its arguments. Because the statement is
copied from the index, a changed law changes every instance, and `pyml check` sees the drift.
Dims that the spec leaves open (the number of tokens T) stay variables.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pyml import __version__
from pyml.laws import Law, load_law_index
from pyml.spec.layers import GELU, Linear, ReLU, Residual, RMSNorm, SiLU
from pyml.spec.models import DecoderModel, SequentialModel

@dataclass(frozen=True)
class Instance:
    """`law` at `dims` ({dim variable: value}), named `{layer}_{law}`, under a comment."""

    layer: str
    law: str
    dims: dict
    comment: str = ""


def split_statement(statement: str) -> tuple[list[str], str]:
    """`{m n : Nat} (W : Mat m n) : type` -> (["{m n : Nat}", "(W : Mat m n)"], "type")."""
    binders, depth, start = [], 0, None
    for position, char in enumerate(statement):
        if char in "({":
            if depth == 0:
                start = position
            depth += 1
        elif char in ")}":
            depth -= 1
            if depth == 0:
                binders.append(statement[start:position + 1])
        elif char == ":" and depth == 0:
            return binders, statement[position + 1:].strip()
    raise ValueError(f"cannot split law statement: {statement}")


def substitute(text: str, dims: dict) -> str:
    for name, value in dims.items():
        text = re.sub(rf"(?<![\w.]){re.escape(name)}(?![\w₀-₉])", str(value), text)
    return text


def instantiate(law: Law, instance: Instance) -> str:
    binders, conclusion = split_statement(law.statement)
    kept, arguments = [], []
    for binder in binders:
        names, _, kind = binder[1:-1].partition(":")
        names = names.split()
        if binder.startswith("{") and kind.strip() == "Nat":
            open_dims = [name for name in names if name not in instance.dims]
            if open_dims:
                kept.append("{" + " ".join(open_dims) + " : Nat}")
            continue
        kept.append(substitute(binder, instance.dims))
        if binder.startswith("("):
            arguments += names
    lines = [f"-- {instance.comment}"] if instance.comment else []
    lines += [
        f"theorem {instance.layer}_{law.name} {' '.join(kept)} :",
        f"    {substitute(conclusion, instance.dims)} :=",
        f"  {' '.join([law.name, *arguments])}",
    ]
    return "\n".join(lines)


def linear_instances(layer: str, fan_in: int, fan_out: int) -> list[Instance]:
    comment = f"{layer}: linear {fan_in} -> {fan_out}"
    return [
        Instance(layer, "linear_input_adjoint", {"m": fan_out, "n": fan_in}, comment),
        Instance(layer, "linear_weight_adjoint_input", {"m": fan_out, "k": fan_in}),
        Instance(layer, "linear_weight_adjoint_weight", {"m": fan_out, "k": fan_in}),
    ]


def gain_instance(layer: str, width: int, what: str) -> Instance:
    return Instance(layer, "hadamard_adjoint", {"n": width}, f"{layer}: {what}")


def sequential_skeleton(spec: SequentialModel) -> tuple[str, list[Instance]]:
    instances: list[Instance] = []

    def steps(layers, width: int, place: str) -> tuple[list[str], int]:
        parts: list[str] = []
        for index, layer in enumerate(layers):
            name = layer.name or f"{place}{index}"
            if isinstance(layer, Linear):
                instances.extend(linear_instances(name, layer.in_features, layer.out_features))
                parts.append(f".layer (Layer.dense {layer.in_features} {layer.out_features})")
                width = layer.out_features
            elif isinstance(layer, RMSNorm):
                instances.append(gain_instance(name, layer.dim, "the RMSNorm weight, an element-wise gain"))
                parts.append(f".layer (Layer.gain {layer.dim})")
            elif isinstance(layer, (ReLU, GELU, SiLU)):
                instances.append(gain_instance(
                    name, width, f"{layer.kind}: its derivative at the input is an element-wise gain"))
                parts.append(f".layer (Layer.gain {width})")
            elif isinstance(layer, Residual):
                body, _ = steps(layer.body, width, f"{name}_body")
                instances.append(Instance(name, "residual_adjoint", {"n": width}, f"{name}: residual"))
                parts.append(f".residual ({nest(body)})")
        return parts, width

    parts, _ = steps(spec.layers, spec.input_dim, "layer")
    return f"def skeleton : Chain {spec.input_dim} {spec.output_dim} :=\n  {nest(parts)}", instances


def nest(parts: list[str]) -> str:
    """[".layer a", ".residual b"] -> ".layer a (.residual b .nil)"."""
    text = ".nil"
    for part in reversed(parts):
        text = f"{part} ({text})" if text != ".nil" else f"{part} .nil"
    return text


def decoder_skeleton(spec: DecoderModel) -> tuple[str, list[Instance]]:
    block, attention = spec.block, spec.block.attention
    dim, vocab, hidden = spec.embedding.dim, spec.embedding.vocab_size, block.mlp.hidden
    q_dim, kv_dim = attention.n_heads * attention.head_dim, attention.n_kv_heads * attention.head_dim
    instances = [Instance("embed", "embedding_adjoint", {"V": vocab, "D": dim},
                          f"embed: gather rows of a {vocab} x {dim} table")]
    instances.append(gain_instance("attn_norm", dim, "the RMSNorm weight, an element-wise gain"))
    # q, k and v are one linear layer (weights stacked as rows), as the kernels compute them
    instances += linear_instances("qkv_proj", dim, q_dim + 2 * kv_dim)
    if attention.rope is not None:
        instances.append(Instance("rope", "rotation_adjoint", {"n": attention.head_dim // 2},
                                  f"rope: rotation of the two halves of a {attention.head_dim}-dim head"))
    head_dim = attention.head_dim
    instances += [
        Instance("attention_scores", "matmul_adjoint_left", {"k": head_dim},
                 f"attention scores Q Kᵀ, per head: (T x {head_dim}) (({head_dim} x T))"),
        Instance("attention_scores", "matmul_adjoint_right", {"k": head_dim}),
        Instance("attention_values", "matmul_adjoint_left", {"n": head_dim},
                 f"attention output P V, per head: (T x T) (T x {head_dim})"),
        Instance("attention_values", "matmul_adjoint_right", {"n": head_dim}),
    ]
    instances += linear_instances("o_proj", q_dim, dim)
    instances.append(Instance("attn_residual", "residual_adjoint", {"n": dim}, "attention residual"))
    instances.append(gain_instance("mlp_norm", dim, "the RMSNorm weight, an element-wise gain"))
    instances += linear_instances("gate_up_proj", dim, 2 * hidden)
    instances.append(gain_instance("swiglu", hidden, "silu(gate) ⊙ up: the gate product"))
    instances += linear_instances("down_proj", hidden, dim)
    instances.append(Instance("mlp_residual", "residual_adjoint", {"n": dim}, "MLP residual"))
    instances.append(gain_instance("final_norm", dim, "the RMSNorm weight, an element-wise gain"))
    instances += linear_instances("lm_head", dim, vocab)

    # The value path of a block: per token, the attention mixes the value heads (expanding the
    # KV heads to the query heads) linearly, so dims compose as below.
    attention_path = nest([f".layer (Layer.gain {dim})", f".layer (Layer.dense {dim} {kv_dim})",
                           f".layer (Layer.dense {kv_dim} {q_dim})", f".layer (Layer.dense {q_dim} {dim})"])
    mlp_path = nest([f".layer (Layer.gain {dim})", f".layer (Layer.dense {dim} {hidden})",
                     f".layer (Layer.gain {hidden})", f".layer (Layer.dense {hidden} {dim})"])
    skeleton = "\n".join([
        "/-- One decoder block: the residual attention (value) path, then the residual SwiGLU path",
        "(the gate acts on the up projection as an element-wise gain). -/",
        f"def block : Chain {dim} {dim} :=",
        f"  .residual ({attention_path})",
        f"    (.residual ({mlp_path}) .nil)",
        "",
        "/-- `n` blocks, each with its own weights in the model, composed with `Chain.append`. -/",
        f"def blocks : Nat → Chain {dim} {dim}",
        "  | 0 => .nil",
        "  | n + 1 => block.append (blocks n)",
        "",
        f"def skeleton : Chain {dim} {vocab} :=",
        f"  (blocks {block.count}).append (.layer (Layer.gain {dim}) (.layer (Layer.dense {dim} {vocab}) .nil))",
    ])
    return skeleton, instances


def module_name(spec) -> str:
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[_\W]+", spec.name) if part)


def render(spec: SequentialModel | DecoderModel, spec_path: str, lean_dir: Path) -> tuple[str, str]:
    """(path relative to the project root, text) of the spec's Lean file."""
    index = load_law_index(lean_dir)
    if isinstance(spec, DecoderModel):
        skeleton, instances = decoder_skeleton(spec)
        out_dim = spec.embedding.vocab_size
    else:
        skeleton, instances = sequential_skeleton(spec)
        out_dim = spec.output_dim
    name = module_name(spec)
    parts = [
        f"-- Generated by pyml {__version__} from {spec_path}; do not edit (`pyml check` fails on drift).",
        "import PyML",
        "",
        f"namespace Generated.{name}",
        "open PyML",
        "",
        "/-! ## The skeleton: it type-checks only where every junction's dims agree. -/",
        "",
        skeleton,
        "",
        "/-- The skeleton's backward map is the adjoint of its forward map. -/",
        "theorem skeleton_adjoint : IsAdjoint skeleton.forward skeleton.backward :=",
        "  chain_adjoint skeleton",
        "",
        "/-- The backward pass is the reversed chain of transposed layers. -/",
        f"theorem skeleton_backward_is_reversed (g : Vec {out_dim}) :",
        "    skeleton.transposed.forward g = skeleton.backward g :=",
        "  chain_transposed_forward skeleton g",
        "",
        "/-! ## The laws at this spec's dims, one instance per layer -/",
    ]
    for instance in instances:
        parts += ["", instantiate(index[instance.law], instance)]
    parts += ["", f"end Generated.{name}", ""]
    return f"lean/Generated/{name}.lean", "\n".join(parts)
