"""From a spec to what the templates render: kernel blocks, parameters, and the op list.

The op list is the model's forward pass as a sequence of ops, each with its forward statement and
its backward statement. The templates emit the forward statements in order and the backward
statements in reverse order, so the generated backward pass is the reversed composition of the
forward one by construction (the Lean law `compose_adjoint`).

A fan-out (one value read by two consumers) is an op of its own: its forward is nothing and its
backward sums the consumers' gradients (the Lean law `residual_adjoint`). Projections that read the
same input are one linear layer with their weights stacked as rows (q/k/v, gate/up): its adjoint
sums the parts' input gradients inside one matrix product, so they need no fan-out op.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pyml.spec.layers import GELU, Linear, ReLU, Residual, RMSNorm, SiLU
from pyml.spec.models import DecoderModel, SequentialModel


@dataclass(frozen=True)
class Op:
    """One step of the forward pass. `forward`/`backward` are lists of Python statements;
    `laws` are the Lean laws the backward statements implement."""

    name: str
    forward: tuple[str, ...]
    backward: tuple[str, ...]
    laws: tuple[str, ...] = ()


@dataclass(frozen=True)
class Param:
    """A parameter tensor: its attribute on `Parameters`, its shape, and where it is stacked per
    layer (`per_layer`), its shape excludes the layer axis."""

    attr: str
    shape: tuple[int, ...]
    per_layer: bool = False
    external: str = ""  # sequential models: the tensor's name in safetensors files (`fc1.weight`)


@dataclass
class Plan:
    kernel_blocks: list[tuple[str, dict]]
    params: list[Param]
    head_ops: list[Op]              # before the blocks (decoder) or the whole model (sequential)
    block_ops: list[Op] = field(default_factory=list)
    tail_ops: list[Op] = field(default_factory=list)
    laws: tuple[str, ...] = ()
    widths: list[int] = field(default_factory=list)          # sequential: a[i]'s feature dim
    norms: list[str] = field(default_factory=list)           # sequential: rmsnorm layers
    grad_aliases: list[tuple[int, int]] = field(default_factory=list)


# The Lean laws each kernel kind's backward implements; recorded in the manifest by statement hash.
KIND_LAWS = {
    "linear": ("linear_input_adjoint", "linear_weight_adjoint_input", "linear_weight_adjoint_weight"),
    "embedding": ("embedding_adjoint",),
    "attention": ("matmul_adjoint_left", "matmul_adjoint_right"),
    "rope": ("rotation_adjoint",),
    "swiglu": ("hadamard_adjoint",),
    "residual": ("residual_adjoint",),
    "rmsnorm": ("hadamard_adjoint",),  # the weight, an element-wise gain
    "relu": ("hadamard_adjoint",),  # dy times the derivative at x, element-wise
    "gelu": ("hadamard_adjoint",),
    "silu": ("hadamard_adjoint",),
    "cross_entropy": (),
    "adamw": (),
}
# The generated backward pass runs the forward ops' adjoints in reverse (compose_adjoint); the
# spec's Lean skeleton instantiates the chain laws.
MODEL_LAWS = ("compose_adjoint", "chain_adjoint", "chain_transposed_forward")


def linear_op(name: str, x: str, w: str, y: str, dy: str, dx: str, dw: str,
              b: str | None = None, db: str | None = None) -> Op:
    bias_in, bias_grad = (f", {b}", f", {db}") if b else ("", "")
    return Op(
        name,
        (f"k.{name}_forward({x}, {w}{bias_in}, {y})",),
        (f"k.{name}_backward({x}, {w}, {dy}, {dx}, {dw}{bias_grad})",),
        KIND_LAWS["linear"],
    )


def decoder_plan(spec: DecoderModel) -> Plan:
    block, head = spec.block, spec.lm_head
    attention, mlp = block.attention, block.mlp
    dim, vocab = spec.embedding.dim, spec.embedding.vocab_size
    q_dim, kv_dim = attention.n_heads * attention.head_dim, attention.n_kv_heads * attention.head_dim

    def linear_block(name: str, fan_in: int, fan_out: int) -> tuple[str, dict]:
        return ("linear", {"p": name, "in_features": fan_in, "out_features": fan_out, "bias": False})

    def norm_block(name: str, norm: RMSNorm) -> tuple[str, dict]:
        return ("rmsnorm", {"p": name, "dim": norm.dim, "eps": norm.eps})

    kernel_blocks = [
        ("embedding", {"p": "embed", "vocab_size": vocab, "dim": dim}),
        norm_block("attn_norm", block.attn_norm),
        linear_block("qkv_proj", dim, q_dim + 2 * kv_dim),
        ("attention", {"p": "attention", "n_heads": attention.n_heads,
                       "n_kv_heads": attention.n_kv_heads, "head_dim": attention.head_dim}),
        linear_block("o_proj", q_dim, dim),
        ("residual", {"p": "residual"}),
        norm_block("mlp_norm", block.mlp_norm),
        linear_block("gate_up_proj", dim, 2 * mlp.hidden),
        ("swiglu", {"p": "swiglu", "dim": dim, "hidden": mlp.hidden}),
        linear_block("down_proj", mlp.hidden, dim),
        norm_block("final_norm", spec.final_norm),
        linear_block("lm_head", dim, vocab),
        ("cross_entropy", {"p": "loss", "classes": vocab}),
        ("adamw", {"p": "adamw"}),
    ]
    if attention.rope is not None:
        kernel_blocks.insert(5, ("rope", {"p": "rope", "head_dim": attention.head_dim,
                                          "theta": attention.rope.theta,
                                          "max_seq_len": spec.max_seq_len}))

    params = [
        Param("embed", (vocab, dim)),
        Param("attn_norm", (dim,), True),
        Param("qkv_proj", (q_dim + 2 * kv_dim, dim), True),  # q, k, v weights stacked as rows
        Param("o_proj", (dim, q_dim), True),
        Param("mlp_norm", (dim,), True),
        Param("gate_up_proj", (2 * mlp.hidden, dim), True),  # gate, up weights stacked as rows
        Param("down_proj", (dim, mlp.hidden), True),
        Param("final_norm", (dim,)),
    ]
    if not head.tied:
        params.append(Param("lm_head", (vocab, dim)))
    head_weight = "p.lm_head" if not head.tied else "p.embed"
    head_grad = "gr.lm_head" if not head.tied else "gr.embed"

    embed_backward = ("k.embed_backward(ids, g.dx, gr.embed)",)
    if not head.tied:
        embed_backward = ("self.zero(gr.embed)", *embed_backward)
    head_ops = [Op(
        "embed",
        ("k.embed_forward(ids, p.embed, s.x[0])",),
        embed_backward,
        KIND_LAWS["embedding"],
    )]

    rope_forward = rope_backward = ()
    if attention.rope is not None:
        # q and k heads are adjacent in the fused projection's output: one call rotates both
        rope_forward = ("k.rope_forward(s.qk4[l], self.cos, self.sin, 0)",)
        rope_backward = ("k.rope_backward(g.dqk4, self.cos, self.sin)",)
    residual = KIND_LAWS["residual"]
    # A norm's input also carries on along the residual stream (a fan-out): the norm's backward adds
    # its input gradient into g.dx, the stream's gradient, instead of a separate add.
    block_ops = [
        Op("attn_norm",
           ("k.attn_norm_forward(s.x[l], p.attn_norm[l], s.ln1[l], s.rstd1[l])",),
           ("k.attn_norm_backward_add(s.x[l], p.attn_norm[l], s.rstd1[l], g.dln, g.dx, "
            "gr.attn_norm[l])",), residual),
        linear_op("qkv_proj", "s.ln1[l]", "p.qkv_proj[l]", "s.qkv[l]", "g.dqkv", "g.dln",
                  "gr.qkv_proj[l]"),
    ]
    if rope_forward:
        block_ops.append(Op("rope", rope_forward, rope_backward, KIND_LAWS["rope"]))
    block_ops += [
        Op("attention",
           ("k.attention_forward(s.q4[l], s.k4[l], s.v4[l], s.att[l], s.y[l])",),
           ("k.attention_backward(s.q4[l], s.k4[l], s.v4[l], s.att[l], g.dy, g.dq4, g.dk4, g.dv4)",),
           KIND_LAWS["attention"]),
        linear_op("o_proj", "s.y2[l]", "p.o_proj[l]", "s.o", "g.dx", "g.dy2", "gr.o_proj[l]"),
        # the join xm = x + o fused with the norm that reads xm; both branches of the join read
        # g.dx as their gradient, so its backward is the norm's alone
        Op("attn_join_mlp_norm",
           ("k.mlp_norm_forward_residual(s.x[l], s.o, s.xm[l], p.mlp_norm[l], s.ln2[l], "
            "s.rstd2[l])",),
           ("k.mlp_norm_backward_add(s.xm[l], p.mlp_norm[l], s.rstd2[l], g.dln, g.dx, "
            "gr.mlp_norm[l])",), residual),
        linear_op("gate_up_proj", "s.ln2[l]", "p.gate_up_proj[l]", "s.gate_up[l]", "g.dgate_up",
                  "g.dln", "gr.gate_up_proj[l]"),
        Op("swiglu",
           ("k.swiglu_forward(s.gate_up[l], s.h[l])",),
           ("k.swiglu_backward(s.gate_up[l], g.dh, g.dgate_up)",),
           KIND_LAWS["swiglu"]),
        linear_op("down_proj", "s.h[l]", "p.down_proj[l]", "s.down", "g.dx", "g.dh",
                  "gr.down_proj[l]"),
        Op("mlp_join", ("k.residual_forward(s.xm[l], s.down, s.x[l + 1])",), (), residual),
    ]
    tail_ops = [
        Op("final_norm",
           ("k.final_norm_forward(s.x[-1], p.final_norm, s.xf, s.rstdf)",),
           ("k.final_norm_backward(s.x[-1], p.final_norm, s.rstdf, g.dxf, g.dx, gr.final_norm)",)),
        linear_op("lm_head", "s.xf", head_weight, "s.logits", "s.logits", "g.dxf", head_grad),
    ]
    laws = sorted({law for kind, _ in kernel_blocks for law in KIND_LAWS[kind]} | set(MODEL_LAWS))
    return Plan(kernel_blocks, params, head_ops, block_ops, tail_ops, tuple(laws))


def sequential_plan(spec: SequentialModel) -> Plan:
    """Ops over activations a[0] (the input) .. a[n]; a layer reads a[i] and writes a[i + 1].

    `widths[i]` is a[i]'s feature dim. A residual's join passes its gradient to the body's output
    unchanged, so that gradient buffer is the join's own (`grad_aliases`)."""
    kernel_blocks: list[tuple[str, dict]] = []
    params: list[Param] = []
    widths = [spec.input_dim]
    norms: list[str] = []
    grad_aliases: list[tuple[int, int]] = []

    def emit(layers, place: str, source: int) -> tuple[list[Op], int]:
        ops: list[Op] = []
        current = source
        for index, layer in enumerate(layers):
            name = layer.name or f"{place}{index}"
            if isinstance(layer, Residual):
                body_ops, body_out = emit(layer.body, f"{name}_body", current)
                widths.append(widths[current])
                out = len(widths) - 1
                grad_aliases.append((body_out, out))
                kernel_blocks.append(("residual", {"p": name}))
                ops += [
                    Op(f"{name}_fanout", (), (f"k.{name}_backward(d[{out}], d[{current}])",),
                       KIND_LAWS["residual"]),
                    *body_ops,
                    Op(name, (f"k.{name}_forward(a[{current}], a[{body_out}], a[{out}])",), (),
                       KIND_LAWS["residual"]),
                ]
                current = out
                continue
            widths.append(layer.out_features if isinstance(layer, Linear) else widths[current])
            out = len(widths) - 1
            x, y, dx, dy = f"a[{current}]", f"a[{out}]", f"d[{current}]", f"d[{out}]"
            if isinstance(layer, Linear):
                kernel_blocks.append(("linear", {"p": name, "in_features": layer.in_features,
                                                 "out_features": layer.out_features,
                                                 "bias": layer.bias}))
                params.append(Param(f"{name}_weight", (layer.out_features, layer.in_features),
                                    external=f"{layer.name or name}.weight"))
                bias = (None, None)
                if layer.bias:
                    params.append(Param(f"{name}_bias", (layer.out_features,),
                                        external=f"{layer.name or name}.bias"))
                    bias = (f"p.{name}_bias", f"gr.{name}_bias")
                ops.append(linear_op(name, x, f"p.{name}_weight", y, dy, dx, f"gr.{name}_weight",
                                     *bias))
            elif isinstance(layer, RMSNorm):
                kernel_blocks.append(("rmsnorm", {"p": name, "dim": layer.dim, "eps": layer.eps}))
                params.append(Param(f"{name}_weight", (layer.dim,),
                                    external=f"{layer.name or name}.weight"))
                norms.append(name)
                ops.append(Op(name, (f"k.{name}_forward({x}, p.{name}_weight, {y}, s.{name}_rstd)",),
                              (f"k.{name}_backward({x}, p.{name}_weight, s.{name}_rstd, {dy}, {dx}, "
                               f"gr.{name}_weight)",)))
            elif isinstance(layer, (ReLU, GELU, SiLU)):
                kernel_blocks.append((layer.kind, {"p": name}))
                ops.append(Op(name, (f"k.{name}_forward({x}, {y})",),
                              (f"k.{name}_backward({x}, {dy}, {dx})",)))
            current = out
        return ops, current

    ops, _ = emit(spec.layers, "layer", 0)
    kernel_blocks += [("cross_entropy", {"p": "loss", "classes": spec.output_dim}),
                      ("adamw", {"p": "adamw"})]
    laws = sorted({law for kind, _ in kernel_blocks for law in KIND_LAWS[kind]} | set(MODEL_LAWS))
    return Plan(kernel_blocks, params, ops, laws=tuple(laws), widths=widths, norms=norms,
                grad_aliases=grad_aliases)
