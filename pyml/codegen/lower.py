"""Lowering: from a spec to the graph of ops (`pyml.codegen.ir`).

Each layer kind lowers to ops on values; a residual lowers its body and then a join. Nothing here
knows an architecture: a Llama block and a Gemma block are both lists of norms, attentions, MLPs and
residuals, lowered one layer at a time. Two choices are made for speed and are invisible to the
numerics: projections that read the same input are one linear op with their weights stacked as rows
(q/k/v, gate/up), so one matrix product computes them and its adjoint sums their input gradients;
and q, k and v are heads of one buffer, viewed as (B, T, heads, head_dim) by attention.
"""

from __future__ import annotations

from pyml.codegen.ir import Graph, Instance, Link, Op, Param, Skeleton, Storage, Value
from pyml.codegen.kinds import kind_of
from pyml.errors import PymlError
from pyml.spec.layers import (
    GELU,
    MLP,
    Attention,
    BlockResidual,
    LayerNorm,
    Linear,
    ReLU,
    Residual,
    RMSNorm,
    SiLU,
)
from pyml.spec.models import DecoderModel, SequentialModel

# Laws of pieces that are not kernels of their own: the join of a residual, a bias, a constant scale.
PIECE_LAWS = ("residual_adjoint", "bias_adjoint", "smul_adjoint")
# The generated backward pass runs the forward ops' adjoints in reverse (compose_adjoint); the
# spec's Lean skeleton instantiates the chain laws.
MODEL_LAWS = ("compose_adjoint", "chain_adjoint", "chain_transposed_forward")


def linear_instances(layer: str, fan_in: int, fan_out: int, bias: bool,
                     frozen: bool = False) -> tuple[Instance, ...]:
    comment = f"{layer}: linear {fan_in} -> {fan_out}" + (" with a bias" if bias else "")
    if frozen:  # a LoRA model's base matrix, which the kernels may read where its file stores it
        comment += (", frozen; W is the base's matrix as its rows decode (dequantized from the"
                    " stored type, or as stored)")
    instances = [
        Instance(layer, "linear_input_adjoint", {"m": fan_out, "n": fan_in}, comment),
        Instance(layer, "linear_weight_adjoint_input", {"m": fan_out, "k": fan_in}),
        Instance(layer, "linear_weight_adjoint_weight", {"m": fan_out, "k": fan_in}),
    ]
    if bias:
        instances.append(Instance(layer, "bias_adjoint", {"n": fan_out}))
    return tuple(instances)


def gain_instance(layer: str, width: int, what: str) -> Instance:
    return Instance(layer, "hadamard_adjoint", {"n": width}, f"{layer}: {what}")


def dense(fan_in: int, fan_out: int) -> Link:
    return Link("dense", (fan_in, fan_out))


def gain(width: int) -> Link:
    return Link("gain", (width,))


class Lowering:
    """Collects storages, values, params, ops and kernel blocks while layers are lowered."""

    def __init__(self, max_seq_len: int = 0, lora=None):
        self.storages: dict[str, Storage] = {}
        self.values: dict[str, Value] = {}
        self.params: list[Param] = []
        self.kernel_blocks: dict[str, tuple[str, dict]] = {}
        self.constants: dict = {}
        # (theta, head_dim, scaling) of each RoPE table, the scaling as a dict or None
        self.rope_thetas: list[tuple[float, int, dict | None]] = []
        self.attention_caches: list[dict] = []
        self.max_seq_len = max_seq_len
        self.scope = "model"
        self.lora = lora  # a LoRA spec freezes every base parameter and adds adapters

    # -- building blocks ------------------------------------------------------------------------

    def storage(self, name: str, shape: tuple, dtype: str = "float", scope: str | None = None) -> str:
        if name in self.storages:
            raise PymlError(f"two buffers of the generated model would be named '{name}'; "
                            "rename one of the layers")
        self.storages[name] = Storage(name, shape, scope or self.scope, dtype)
        self.values[name] = Value(name, name, shape)
        return name

    def view(self, name: str, storage: str, shape: tuple, view: str, start: int = 0,
             stop: int = 0) -> str:
        self.values[name] = Value(name, storage, shape, view, start, stop)
        return name

    def param(self, attr: str, shape: tuple, init: str, tensors, fan_in: int = 0,
              trainable: bool | None = None) -> str:
        if trainable is None:
            trainable = self.lora is None
        if any(existing.attr == attr for existing in self.params):
            raise PymlError(f"two parameters of the generated model would be named '{attr}'; "
                            "rename one of the layers")
        self.params.append(Param(attr, tuple(shape), self.scope == "block", init, tuple(tensors),
                                 fan_in, trainable))
        return attr

    def kernel(self, kind: str, context: dict) -> None:
        self.kernel_blocks.setdefault(context["p"], (kind, context))

    def features(self, value: str) -> int:
        return self.values[value].shape[-1]

    # -- layer kinds ----------------------------------------------------------------------------

    def linear(self, name: str, x: str, fan_out: int, bias: bool, tensors, out: str | None = None,
               init: str = "normal", targets: tuple[str, ...] = ()) -> tuple[Op, str]:
        """y = x Wᵀ (+ b) over rows; `tensors` names the weight's row blocks in tensor files and
        `targets` their LoRA target names. Decoders initialise weights N(0, 0.02) and biases 0
        (`init` "normal"), sequential models both as torch.nn.Linear does ("uniform"). In a LoRA
        model the weight is frozen and each targeted row block gets an adapter."""
        fan_in = self.features(x)
        y = out or self.storage(f"{name}_out", ("N", fan_out))
        params = {"weight": self.param(name, (fan_out, fan_in), init,
                                       [(f"{t}.weight", a, b) for t, a, b in tensors], fan_in)}
        if bias:
            params["bias"] = self.param(f"{name}_bias", (fan_out,),
                                        "uniform" if init == "uniform" else "zeros",
                                        [(f"{t}.bias", a, b) for t, a, b in tensors], fan_in)
        instances = linear_instances(name, fan_in, fan_out, bias, frozen=self.lora is not None)
        if self.lora is None:
            self.kernel("linear", {"p": name, "in_features": fan_in, "out_features": fan_out,
                                   "bias": bias})
            return Op("linear", name, (x,), (y,), params, instances=instances), y
        adapters, aux = [], {}
        for (tensor, first, last), target in zip(tensors, targets):
            if target not in self.lora.targets:
                continue
            rank, part = self.lora.rank, f"{name}_{target}_lora"
            # PEFT's initialisation: A as nn.Linear's weight (kaiming uniform, a = sqrt(5)), B zero
            params[f"{target}_lora_a"] = self.param(
                f"{part}_a", (rank, fan_in), "uniform", [(f"{tensor}.lora_A.weight", 0, rank)],
                fan_in, trainable=True)
            params[f"{target}_lora_b"] = self.param(
                f"{part}_b", (last - first, rank), "zeros", [(f"{tensor}.lora_B.weight", 0, last - first)],
                rank, trainable=True)
            aux[f"{target}_lora_h"] = self.storage(f"{part}_h", ("N", rank))
            adapters.append((first, last))
            instances += (
                *linear_instances(f"{part}_a", fan_in, rank, False),
                *linear_instances(f"{part}_b", rank, last - first, False),
                Instance(f"{part}", "compose_adjoint", {"m": last - first, "k": rank, "n": fan_in},
                         f"{part}: B A, two linear maps composed"),
                Instance(f"{part}", "smul_adjoint", {"n": last - first},
                         f"{part}: scaled by alpha / rank = {self.lora.scale!r}"),
            )
        self.kernel("frozen_linear", {"p": name, "in_features": fan_in, "out_features": fan_out,
                                      "bias": bias, "adapters": tuple(adapters), "rank": self.lora.rank,
                                      "scale": self.lora.scale})
        return Op("frozen_linear", name, (x,), (y,), params, aux, {"adapters": adapters},
                  instances=instances), y

    def rmsnorm(self, name: str, norm: RMSNorm, x: str, tensor: str) -> tuple[Op, str]:
        rows = self.values[x].shape[:-1]
        y = self.storage(f"{name}_out", (*rows, norm.dim))
        rstd = self.storage(f"{name}_rstd", rows)
        init = "zeros" if norm.unit_offset else "ones"
        weight = self.param(name, (norm.dim,), init, [(tensor, 0, norm.dim)])
        self.kernel("rmsnorm", {"p": name, "dim": norm.dim, "eps": norm.eps,
                                "unit_offset": norm.unit_offset})
        gain = "1 + w" if norm.unit_offset else "w"
        return Op("rmsnorm", name, (x,), (y,), {"weight": weight}, {"rstd": rstd},
                  {"unit_offset": norm.unit_offset},
                  (gain_instance(name, norm.dim, f"the RMSNorm gain {gain}, element-wise"),)), y

    def layernorm(self, name: str, norm: LayerNorm, x: str, tensor: str) -> tuple[Op, str]:
        """`tensor` names the gain's tensor (`....weight`); the bias is `....bias` beside it."""
        rows = self.values[x].shape[:-1]
        y = self.storage(f"{name}_out", (*rows, norm.dim))
        mean, rstd = self.storage(f"{name}_mean", rows), self.storage(f"{name}_rstd", rows)
        params = {"weight": self.param(name, (norm.dim,), "ones", [(tensor, 0, norm.dim)])}
        instances = [gain_instance(name, norm.dim, "the LayerNorm gain w, element-wise")]
        if norm.bias:
            bias_tensor = tensor.removesuffix(".weight") + ".bias"
            params["bias"] = self.param(f"{name}_bias", (norm.dim,), "zeros", [(bias_tensor, 0, norm.dim)])
            instances.append(Instance(name, "bias_adjoint", {"n": norm.dim}))
        self.kernel("layernorm", {"p": name, "dim": norm.dim, "eps": norm.eps, "bias": norm.bias})
        return Op("layernorm", name, (x,), (y,), params, {"mean": mean, "rstd": rstd},
                  instances=tuple(instances)), y

    def residual(self, name: str, x: str, body_out: str) -> tuple[Op, str]:
        out = self.storage(f"{name}_out", self.values[x].shape)
        width = self.features(x)
        return Op("residual", name, (x, body_out), (out,),
                  instances=(Instance(name, "residual_adjoint", {"n": width}, f"{name}: x + body(x)"),)), out

    def rope_table(self, theta: float, head_dim: int, scaling: dict | None) -> int:
        """The index of the cos/sin tables of RoPE base `theta` for heads of `head_dim`, its
        frequencies scaled as `scaling` says."""
        table = (theta, head_dim, scaling)
        if table not in self.rope_thetas:
            self.rope_thetas.append(table)
        return self.rope_thetas.index(table)

    def attention(self, name: str, attention: Attention, x: str, n_layers: int,
                  prefix: str) -> tuple[list[Op], str]:
        H, KV, HD = attention.n_heads, attention.n_kv_heads, attention.head_dim
        dim, heads = self.features(x), H + 2 * KV
        ops: list[Op] = []
        qkv = self.storage(f"{name}_qkv", ("B", "T", heads, HD))
        rows = self.view(f"{name}_qkv_rows", qkv, ("N", heads * HD), "rows")
        if attention.fused_qkv:
            q_rows, targets = [(f"{prefix}.qkv_proj", 0, heads * HD)], ("qkv",)
        else:
            q_rows = [(f"{prefix}.q_proj", 0, H * HD), (f"{prefix}.k_proj", H * HD, (H + KV) * HD),
                      (f"{prefix}.v_proj", (H + KV) * HD, heads * HD)]
            targets = ("q", "k", "v")
        op, _ = self.linear(f"{name}_qkv", x, heads * HD, attention.qkv_bias, q_rows, out=rows,
                            targets=targets)
        ops.append(op)
        q = self.view(f"{name}_q", qkv, ("B", "T", H, HD), "heads", 0, H)
        k = self.view(f"{name}_k", qkv, ("B", "T", KV, HD), "heads", H, H + KV)
        v = self.view(f"{name}_v", qkv, ("B", "T", KV, HD), "heads", H + KV, heads)
        qk = self.view(f"{name}_qk", qkv, ("B", "T", H + KV, HD), "heads", 0, H + KV)
        if attention.qk_norm is not None:
            # the normed q and k heads side by side in one buffer, so RoPE rotates both in one call
            norm = attention.qk_norm
            normed = self.storage(f"{name}_qk_normed", ("B", "T", H + KV, HD))
            for part, start, stop in (("q", 0, H), ("k", H, H + KV)):
                source = self.view(f"{name}_{part}_rows", qkv, ("N", stop - start, HD), "row_heads",
                                   start, stop)
                target = self.view(f"{name}_{part}_normed_rows", normed, ("N", stop - start, HD),
                                   "row_heads", start, stop)
                rstd = self.storage(f"{name}_{part}_norm_rstd", ("N", stop - start))
                weight = self.param(f"{name}_{part}_norm", (HD,),
                                    "zeros" if norm.unit_offset else "ones",
                                    [(f"{prefix}.{part}_norm.weight", 0, HD)])
                self.kernel("head_rmsnorm", {"p": f"{name}_{part}_norm", "n_heads": stop - start,
                                             "head_dim": HD, "eps": norm.eps,
                                             "unit_offset": norm.unit_offset})
                gain = "1 + w" if norm.unit_offset else "w"
                ops.append(Op("head_rmsnorm", f"{name}_{part}_norm", (source,), (target,),
                              {"weight": weight}, {"rstd": rstd},
                              instances=(gain_instance(f"{name}_{part}_norm", HD,
                                                       f"QK-norm gain {gain} of each {part} head"),)))
            q = self.view(f"{name}_q_normed", normed, ("B", "T", H, HD), "heads", 0, H)
            k = self.view(f"{name}_k_normed", normed, ("B", "T", KV, HD), "heads", H, H + KV)
            qk = self.view(f"{name}_qk_normed_heads", normed, ("B", "T", H + KV, HD), "heads", 0,
                           H + KV)
        types = [attention.type_of_layer(layer) for layer in range(n_layers)]
        if attention.rope is not None:
            scaling = attention.rope.scaling.model_dump() if attention.rope.scaling else None
            R = attention.rotary_dims
            tables = tuple(self.rope_table(kind.rope_theta, R, scaling) for kind in types)
            self.constants[f"{name.upper()}_ROPE_TABLE"] = tables
            # every table of one head_dim has the same rotation kernel: the first one's
            ops.append(Op("rope", f"rope_table{tables[0]}", (qk,), (qk,),
                          attrs={"tables": f"{name.upper()}_ROPE_TABLE"},
                          instances=(Instance(f"{name}_rope", "rotation_adjoint", {"n": R // 2},
                                              f"{name}_rope: rotation of the two halves of a "
                                              + (f"{HD}-dim head" if R == HD else
                                                 f"{HD}-dim head's first {R} features (the other "
                                                 f"{HD - R} pass unchanged: the identity, its own "
                                                 "adjoint)")
                                              + "; c, s are the table's row at each "
                                              "token's position: data, so the law holds for any "
                                              "frequencies and positions"
                                              + (f", {scaling['type']}-scaled ones included"
                                                 if scaling else "")),)))
        windows = tuple(kind.window or 0 for kind in types)
        self.constants[f"{name.upper()}_WINDOW"] = windows
        y = self.storage(f"{name}_heads_out", ("B", "T", H * HD))
        y_rows = self.view(f"{name}_heads_out_rows", y, ("N", H * HD), "rows")
        probs = self.storage(f"{name}_probs", ("B", H, "T", "T"))
        scale = attention.score_scale
        self.kernel("attention", {"p": f"{name}_core", "n_heads": H, "n_kv_heads": KV,
                                  "head_dim": HD, "scale": scale})
        ops.append(Op("attention", f"{name}_core", (q, k, v), (y,), aux={"probs": probs},
                      attrs={"window": f"{name.upper()}_WINDOW"},
                      instances=(
                          Instance(f"{name}_scores", "matmul_adjoint_left", {"k": HD},
                                   f"{name} scores Q Kᵀ, per head: (T x {HD}) ({HD} x T)"),
                          Instance(f"{name}_scores", "matmul_adjoint_right", {"k": HD}),
                          Instance(f"{name}_scores", "smul_adjoint", {},
                                   f"{name} scores scaled by {scale!r} before the softmax"),
                          Instance(f"{name}_values", "matmul_adjoint_left", {"n": HD},
                                   f"{name} output P V, per head: (T x T) (T x {HD}); P is 0 "
                                   "outside the causal, window and packed-example masks: data"),
                          Instance(f"{name}_values", "matmul_adjoint_right", {"n": HD}),
                      )))
        self.attention_caches.append({"k": k, "v": v, "window": f"{name.upper()}_WINDOW",
                                      "n_kv_heads": KV, "head_dim": HD})
        op, out = self.linear(f"{name}_o", y_rows, dim, attention.out_bias,
                              [(f"{prefix}.o_proj", 0, dim)], targets=("o",))
        ops.append(op)
        return ops, out

    def mlp(self, name: str, mlp: MLP, x: str, prefix: str) -> tuple[list[Op], str]:
        dim, hidden = self.features(x), mlp.hidden
        if mlp.fused_gate_up:
            rows, targets = [(f"{prefix}.gate_up_proj", 0, 2 * hidden)], ("gate_up",)
        else:
            rows = [(f"{prefix}.gate_proj", 0, hidden), (f"{prefix}.up_proj", hidden, 2 * hidden)]
            targets = ("gate", "up")
        op_gate_up, gate_up = self.linear(f"{name}_gate_up", x, 2 * hidden, mlp.bias, rows,
                                          targets=targets)
        h = self.storage(f"{name}_hidden", ("N", hidden))
        self.kernel(mlp.activation, {"p": f"{name}_glu", "dim": dim, "hidden": hidden})
        activation = "silu" if mlp.activation == "swiglu" else "tanh-approximated GELU"
        glu = Op(mlp.activation, f"{name}_glu", (gate_up,), (h,),
                 instances=(gain_instance(f"{name}_glu", hidden,
                                          f"{activation}(gate) ⊙ up: the gate acts on up as a gain"),))
        op_down, out = self.linear(f"{name}_down", h, dim, mlp.bias,
                                   [(f"{prefix}.down_proj", 0, dim)], targets=("down",))
        return [op_gate_up, glu, op_down], out

    # -- compositions ---------------------------------------------------------------------------

    def block_items(self, items, x: str, n_layers: int) -> tuple[list[Op], str, list[Link]]:
        """Ops of a block's layers applied to `x`, their output, and the Lean skeleton's links of
        the block's value path."""
        ops: list[Op] = []
        chain: list[Link] = []
        for item in items:
            layer, name = item.layer, item.name
            prefix = f"model.layers.{{l}}.{name}"
            if isinstance(layer, BlockResidual):
                body_ops, body_out, body_chain = self.block_items(item.body, x, n_layers)
                op, x = self.residual(name, x, body_out)
                ops += [*body_ops, op]
                chain.append(Link("residual", body=tuple(body_chain)))
            elif isinstance(layer, RMSNorm):
                op, x = self.rmsnorm(name, layer, x, f"{prefix}.weight")
                ops.append(op)
                chain.append(gain(layer.dim))
            elif isinstance(layer, LayerNorm):
                op, x = self.layernorm(name, layer, x, f"{prefix}.weight")
                ops.append(op)
                chain.append(gain(layer.dim))
            elif isinstance(layer, Attention):
                new_ops, x = self.attention(name, layer, x, n_layers, prefix)
                ops += new_ops
                q_dim, kv_dim = layer.n_heads * layer.head_dim, layer.n_kv_heads * layer.head_dim
                # the value path per token: v projection, the heads' mixing (each kv head serving
                # its group of query heads), the output projection
                chain += [dense(layer.dim, kv_dim), dense(kv_dim, q_dim), dense(q_dim, layer.dim)]
            elif isinstance(layer, MLP):
                new_ops, x = self.mlp(name, layer, x, prefix)
                ops += new_ops
                chain += [dense(layer.dim, layer.hidden), gain(layer.hidden),
                          dense(layer.hidden, layer.dim)]
        return ops, x, chain

    def sequential_layers(self, layers, x: str, place: str) -> tuple[list[Op], str, list[Link]]:
        ops: list[Op] = []
        chain: list[Link] = []
        for index, layer in enumerate(layers):
            name = layer.name or f"{place}{index}"
            width = self.features(x)
            if isinstance(layer, Residual):
                body_ops, body_out, body_chain = self.sequential_layers(layer.body, x, f"{name}_body")
                op, x = self.residual(name, x, body_out)
                ops += [*body_ops, op]
                chain.append(Link("residual", body=tuple(body_chain)))
            elif isinstance(layer, Linear):
                op, x = self.linear(name, x, layer.out_features, layer.bias,
                                    [(name, 0, layer.out_features)], init="uniform")
                ops.append(op)
                chain.append(dense(layer.in_features, layer.out_features))
            elif isinstance(layer, RMSNorm):
                op, x = self.rmsnorm(name, layer, x, f"{name}.weight")
                ops.append(op)
                chain.append(gain(layer.dim))
            elif isinstance(layer, LayerNorm):
                op, x = self.layernorm(name, layer, x, f"{name}.weight")
                ops.append(op)
                chain.append(gain(layer.dim))
            elif isinstance(layer, (ReLU, GELU, SiLU)):
                y = self.storage(f"{name}_out", ("N", width))
                self.kernel(layer.kind, {"p": name})
                ops.append(Op(layer.kind, name, (x,), (y,), instances=(gain_instance(
                    name, width, f"{layer.kind}: its derivative at the input is an element-wise gain"),)))
                x = y
                chain.append(gain(width))
        return ops, x, chain

    def loss(self, logits: str, classes: int) -> Op:
        self.kernel("loss", {"p": "loss", "classes": classes})
        return Op("loss", "loss", (logits,), ())


def rename_output(ops: list[Op], old: str, new: str) -> None:
    """Make the op that writes `old` write `new` instead (the block's last op writes the stream)."""
    for op in ops:
        op.outputs = tuple(new if value == old else value for value in op.outputs)
        op.inputs = tuple(new if value == old else value for value in op.inputs)


def finish(lowering: Lowering, form: str, head, block, tail, n_layers, constants,
           skeleton: Skeleton, input_value, logits) -> Graph:
    theta_blocks = [(theta, head_dim // 2, scaling) for theta, head_dim, scaling in lowering.rope_thetas]
    return Graph(
        form=form, storages=lowering.storages, values=lowering.values, params=lowering.params,
        head=head, block=block, tail=tail, n_layers=n_layers,
        kernel_blocks=list(lowering.kernel_blocks.values()),
        constants={**constants, **lowering.constants}, skeleton=skeleton,
        input=input_value, logits=logits, rope_tables=theta_blocks,
        attention_caches=lowering.attention_caches,
    )


def lower_sequential(spec: SequentialModel) -> Graph:
    lowering = Lowering()
    x = lowering.storage("inputs", ("N", spec.input_dim))
    ops, logits, chain = lowering.sequential_layers(spec.layers, x, "layer")
    ops.append(lowering.loss(logits, spec.output_dim))
    skeleton = Skeleton(tuple(chain), (), 0, (), (spec.input_dim, spec.output_dim))
    constants = {"INPUT_DIM": spec.input_dim, "OUTPUT_DIM": spec.output_dim}
    return finish(lowering, "sequential", ops, [], [], 0, constants, skeleton, x, logits)


def lower_decoder(spec: DecoderModel) -> Graph:
    n_layers, dim, vocab = spec.block.count, spec.embedding.dim, spec.embedding.vocab_size
    lowering = Lowering(spec.max_seq_len, spec.lora)
    ids = lowering.storage("ids", ("N",), dtype="int64")
    # the residual stream: the embedding writes the first block's input, block l reads stream[l]
    # and writes stream[l + 1], the final norm reads the last
    lowering.storages["stream"] = Storage("stream", ("N", dim), "stream")
    first = "stream_first"
    lowering.values[first] = Value(first, "stream", ("N", dim), position="first")
    embed = lowering.param("embed", (vocab, dim), "normal", [("model.embed_tokens.weight", 0, vocab)])
    scale = spec.embedding.scale
    lowering.kernel("embedding", {"p": "embed", "vocab_size": vocab, "dim": dim, "scale": scale})
    embed_instances = [Instance("embed", "embedding_adjoint", {"V": vocab, "D": dim},
                                f"embed: gather rows of a {vocab} x {dim} table")]
    if scale != 1.0:
        embed_instances.append(Instance("embed", "smul_adjoint", {"n": dim},
                                        f"embed: rows scaled by {scale!r}"))
    head = [Op("embedding", "embed", (ids,), (first,), {"weight": embed},
               instances=tuple(embed_instances))]

    lowering.scope = "block"
    block_in = lowering.values["block_in"] = Value("block_in", "stream", ("N", dim), position="in")
    block_ops, block_out, block_chain = lowering.block_items(spec.block_items(), block_in.name, n_layers)
    lowering.values["block_out"] = Value("block_out", "stream", ("N", dim), position="out")
    if block_out == block_in.name:
        raise PymlError("the decoder block computes nothing")
    rename_output(block_ops, block_out, "block_out")
    del lowering.storages[block_out], lowering.values[block_out]

    lowering.scope = "model"
    last = lowering.values["stream_last"] = Value("stream_last", "stream", ("N", dim), position="last")
    norm_op, xf = lowering.rmsnorm("final_norm", spec.final_norm, last.name, "model.norm.weight")
    head_tensor = embed if spec.lm_head.tied else None
    if head_tensor is None:
        head_op, logits = lowering.linear("lm_head", xf, vocab, False, [("lm_head", 0, vocab)])
    else:
        # the tied head multiplies by the embedding matrix: a linear op on that parameter
        logits = lowering.storage("logits", ("N", vocab))
        kind = "linear" if spec.lora is None else "frozen_linear"
        context = {"p": "lm_head", "in_features": dim, "out_features": vocab, "bias": False}
        if spec.lora is not None:
            context |= {"adapters": (), "rank": spec.lora.rank, "scale": spec.lora.scale}
        lowering.kernel(kind, context)
        head_op = Op(kind, "lm_head", (xf,), (logits,), {"weight": embed},
                     attrs={"adapters": []} if spec.lora else {},
                     instances=linear_instances("lm_head", dim, vocab, False))
    tail = [norm_op, head_op, lowering.loss(logits, vocab)]

    # the embedding's scale is a gain on the value path; the final norm's gain and the head end it
    start = (gain(dim),) if scale != 1.0 else ()
    skeleton = Skeleton(start, tuple(block_chain), n_layers, (gain(dim), dense(dim, vocab)),
                        (dim, vocab))
    constants = {"VOCAB": vocab, "DIM": dim, "N_LAYERS": n_layers, "MAX_SEQ_LEN": spec.max_seq_len,
                 "TIED_HEAD": spec.lm_head.tied}
    for index, (theta, head_dim, _) in enumerate(lowering.rope_thetas):
        lowering.kernel("rope", {"p": f"rope_table{index}", "head_dim": head_dim,
                                 "theta": theta, "max_seq_len": spec.max_seq_len})
    return finish(lowering, "decoder", head, block_ops, tail, n_layers, constants, skeleton,
                  ids, logits)


def lower(spec: SequentialModel | DecoderModel) -> Graph:
    return lower_decoder(spec) if isinstance(spec, DecoderModel) else lower_sequential(spec)


def relied_on_laws(graph: Graph) -> tuple[str, ...]:
    """Every Lean law the generated code relies on, for the manifest."""
    laws = {instance.law for op in graph.ops() for instance in op.instances}
    laws |= {law for op in graph.ops() for law in kind_of(op).laws}
    return tuple(sorted(laws | set(MODEL_LAWS)))
