"""Random valid specs, generated packages built from them, and their comparison with the torch
reference (`tests/support/torch_reference.py`). Shared by the CPU fuzz test and its CUDA-simulator twin.

A package is generated (`pyml.packages.derived_package`) into a cache of its own under the system
temp dir, keyed by the spec and the generator and written only when absent, so Numba's cache
(keyed on file path and mtime) compiles a spec once per machine: the regression corpus costs its
compile time once.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from pyml.errors import PymlError
from pyml.formats.spec_toml import spec_toml
from pyml.packages import derived_package
from pyml.spec import parse_spec
from tests.support.torch_reference import Reference, loss_and_grads

FUZZ_DIR = Path(tempfile.gettempdir()) / "pyml-generator-fuzz"
CORPUS = Path(__file__).resolve().parents[1] / "fuzz_corpus"
RTOL = 1e-9


def to_toml(data: dict) -> str:
    """A spec's data as TOML, for messages and the corpus."""
    return spec_toml(data, "a spec the fuzzer drew")


def generated_package(data: dict):
    """The generated package of the spec `data`, imported under a name of its own."""
    return derived_package(data, cache=FUZZ_DIR)


def random_tensors(package, seed: int) -> dict[str, np.ndarray]:
    """Weights large enough that every non-linearity bends: matrices N(0, 1/fan_in), gains near 1
    (near 0 where the gain is 1 + w), biases N(0, 0.3)."""
    rng = np.random.default_rng(seed)
    table = package.Model.tensor_entries(package.Model.host_parameters())  # frozen ones too
    tensors = {}
    for name, (view, init, _) in table.items():
        if view.ndim == 2:
            tensors[name] = rng.normal(0.0, 1.0 / np.sqrt(view.shape[1]), view.shape)
        elif init in ("ones", "zeros"):
            tensors[name] = (1.0 if init == "ones" else 0.0) + rng.normal(0.0, 0.3, view.shape)
        else:
            tensors[name] = rng.normal(0.0, 0.3, view.shape)
    return tensors


def relative_error(ours, theirs, floor: float = 1e-30) -> float:
    """The largest difference relative to the reference's largest entry, or to `floor` where that
    is smaller: a gradient that is zero analytically (a key bias: softmax ignores a constant added
    to every score) is rounding noise on both sides."""
    scale = max(np.abs(theirs).max(), floor)
    return float(np.abs(np.asarray(ours) - theirs).max() / scale)


def check_against_torch(data: dict, batch: tuple[int, int], seed: int, device: str = "cpu",
                        fused: bool = False) -> None:
    """Loss, logits and every parameter gradient of the generated package equal the torch
    reference's to RTOL (float64), a decoder's loss and gradients on rows packing several
    examples (random starts), and for a decoder, decoding with the cache equals the full
    forward pass; with `fused`, so does the package's decode step for quantized weights
    (`fused_decoding`; on the CPU compiled anew for each spec, 6 s here: the corpus, whose specs do
    not change, checks it)."""
    spec, package = generated_package(data)
    tensors = random_tensors(package, seed)
    model = package.Model(dtype=np.float64, device=device)
    model.load_tensors(tensors, "fuzz")
    rng = np.random.default_rng(seed + 1)
    B, T = batch
    packed = {}
    if spec.form == "decoder":
        inputs = rng.integers(0, spec.embedding.vocab_size, (B, T))
        targets = rng.integers(0, spec.embedding.vocab_size, (B, T))
        packed = {"positions": packed_positions(rng, B, T)}
    else:
        inputs = rng.normal(0.0, 1.0, (B, spec.input_dim))
        targets = rng.integers(0, spec.output_dim, B)
    logits, loss, grads = loss_and_grads(Reference(spec, tensors), inputs, targets)
    # a draw whose float64 reference overflows compares nothing: with weights of scale 1, each gated
    # MLP squares the stream's scale and a block may hold nine, so three blocks can pass 1e308
    assume(np.isfinite(loss) and all(np.isfinite(a).all() for a in (logits, *grads.values())))
    assert relative_error(model.forward(inputs), logits) < RTOL, "logits"
    if packed:  # the loss and gradients of rows packing several examples
        _, loss, grads = loss_and_grads(Reference(spec, tensors), inputs, targets, **packed)
        assume(np.isfinite(loss) and all(np.isfinite(a).all() for a in grads.values()))
    ours = model.loss_and_grads(inputs, targets, **packed)
    assert abs(ours - loss) <= RTOL * abs(loss), f"loss {ours} != {loss}"
    our_grads = model.tensors(package.Parameters(model.device.to_host(model.grads.flat)))
    # the trainable parameters' gradients: every one, unless the spec freezes a base (LoRA)
    assert set(our_grads) <= set(grads) and (our_grads or not grads)
    floor = max(1e-5 * max(np.abs(grads[name]).max() for name in our_grads), 1e-30)
    for name in our_grads:
        assert relative_error(our_grads[name], grads[name], floor) < RTOL, f"gradient of {name}"
    if spec.form == "decoder" and T > 1:
        cache, last = model.start_decoding(inputs[:, :1], T)
        for position in range(1, T):
            last = model.decode(cache, inputs[:, position])
        assert relative_error(last, logits[:, -1]) < RTOL, "decoding with the cache"
        if fused and spec.lora is None:
            first, fused = fused_decoding(model, inputs[:1])
            assert relative_error(fused, logits[0, first:]) < RTOL, "the fused decode step"


def packed_positions(rng, B: int, T: int) -> np.ndarray:
    """(B, T) positions of rows that pack examples from random starts (0 at each); with T > 2 the
    first row holds two examples or more."""
    positions = np.tile(np.arange(T), (B, 1))
    for row in range(B):
        starts = rng.choice(np.arange(1, T), size=rng.integers(row == 0, T // 2 + 1), replace=False) if T > 2 else []
        for start in sorted(starts):
            positions[row, start:] = np.arange(T - start)
    return positions


def fused_decoding(model, ids: np.ndarray) -> tuple[int, np.ndarray]:
    """(first, the logits of positions first .. T - 1 of `ids` (1, T)) from the generated decode
    step of the model's device (decode_cpu.py, decode_cuda.py), its linear maps on the model's own
    float rows: the step's structure (biases, heads, windows, norms) in float64. On the CPU the
    step prefills the first half of the positions two per step (so a sliding layer's ring of keys
    wraps within a step) and decodes the others, every position's logits from the prompt's last
    on; on CUDA it decodes only the last, after the float32 model's prefill of the others, since
    the simulator runs each GPU thread of a token in Python (tens of seconds a token here)."""
    from pyml.generate.quantized import DecodingBatch, QuantizedDecoder

    decoder = QuantizedDecoder.of_model(model)
    if model.device.name == "cpu":
        prompt = max(1, ids.shape[1] // 2)
        cache = DecodingBatch(decoder, 1, ids.shape[1], chunk=2)
        cache.add(list(ids[0, :prompt]))
        logits = {}
        while not logits:
            logits = cache.step({})
        found = [logits[0]]
    else:
        prompt = ids.shape[1] - 1
        cache, _ = decoder.start_decoding(ids[:, :prompt], ids.shape[1])
        found = []
    for position in range(prompt, ids.shape[1]):
        found.append(decoder.decode(cache, ids[:, position])[0])
    return ids.shape[1] - len(found), np.array(found)


# -- strategies -------------------------------------------------------------------------------------

FEATURES = st.integers(2, 12)
EPS = st.sampled_from([1e-5, 1e-6, 0.1])


@st.composite
def rmsnorm(draw, dim, name=None):
    layer = {"kind": "rmsnorm", "dim": dim, "eps": draw(EPS), "unit_offset": draw(st.booleans())}
    return layer | ({"name": name} if name else {})


@st.composite
def layernorm(draw, dim):
    return {"kind": "layernorm", "dim": dim, "eps": draw(EPS), "bias": draw(st.booleans())}


@st.composite
def attention(draw, dim, n_layers, max_len):
    kv = draw(st.integers(1, 2))
    heads = kv * draw(st.integers(1, 3))  # MHA, GQA and MQA
    rope = draw(st.booleans())
    head_dim = draw(st.sampled_from([2, 4, 6])) if rope else draw(st.integers(1, 5))
    layer = {"kind": "attention", "dim": dim, "n_heads": heads, "n_kv_heads": kv,
             "head_dim": head_dim, "qkv_bias": draw(st.booleans()), "out_bias": draw(st.booleans())}
    if rope:
        layer["rope"] = {"theta": draw(st.sampled_from([100.0, 10000.0, 1e6]))}
        if draw(st.booleans()):  # partial rotary: the first features of each head
            layer["rope"]["dims"] = draw(st.sampled_from([d for d in (2, 4) if d <= head_dim]))
        scaling = draw(st.sampled_from([None, "linear", "llama3", "longrope"]))
        if scaling == "linear":
            layer["rope"]["scaling"] = {"type": "linear", "factor": draw(st.floats(0.5, 8.0))}
        elif scaling == "llama3":  # bands around the drawn heads' wavelengths (2 pi to ~2 pi theta)
            low = draw(st.floats(0.5, 2.0))
            layer["rope"]["scaling"] = {
                "type": "llama3", "factor": draw(st.floats(1.0, 32.0)), "low_freq_factor": low,
                "high_freq_factor": low * draw(st.floats(1.5, 8.0)),
                "original_max_position_embeddings": draw(st.integers(4, 512))}
        elif scaling == "longrope":  # an original context below the model's (long factors) or not
            factors = st.lists(st.floats(0.5, 64.0), min_size=(layer["rope"].get("dims") or head_dim) // 2,
                               max_size=(layer["rope"].get("dims") or head_dim) // 2)
            layer["rope"]["scaling"] = {
                "type": "longrope", "short_factor": draw(factors), "long_factor": draw(factors),
                "original_max_position_embeddings": draw(st.integers(1, 2 * max_len)),
                "attention_factor": draw(st.floats(0.5, 2.0))}
    if draw(st.booleans()):
        layer["scale"] = draw(st.floats(0.1, 1.5))
    if draw(st.booleans()):
        layer["qk_norm"] = {"eps": draw(EPS), "unit_offset": draw(st.booleans())}
    if draw(st.booleans()):
        # windows shorter and longer than T, and global layers among them
        entries = draw(st.lists(st.fixed_dictionaries({}, optional={
            "window": st.integers(1, max_len + 2),
            # a base of their own on some layers (the spec refuses it beside a scaling)
            **({"rope_theta": st.sampled_from([50.0, 5000.0])}
               if rope and "scaling" not in layer["rope"] else {}),
        }), min_size=1, max_size=n_layers + 1))
        layer["pattern"] = entries
    return layer


@st.composite
def mlp(draw, dim):
    return {"kind": "mlp", "dim": dim, "hidden": draw(FEATURES),
            "activation": draw(st.sampled_from(["swiglu", "geglu"])), "bias": draw(st.booleans())}


@st.composite
def block_layer(draw, dim, n_layers, max_len, depth=0):
    kinds = ["rmsnorm", "layernorm", "attention", "mlp"] + (["residual"] if depth < 2 else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "rmsnorm":
        return draw(rmsnorm(dim))
    if kind == "layernorm":
        return draw(layernorm(dim))
    if kind == "attention":
        return draw(attention(dim, n_layers, max_len))
    if kind == "mlp":
        return draw(mlp(dim))
    body = draw(st.lists(block_layer(dim, n_layers, max_len, depth + 1), min_size=1, max_size=3))
    return {"kind": "residual", "body": body}


@st.composite
def decoder_specs(draw, max_len=8):
    """Decoders of every shape the spec language allows: the Llama shorthand, a Gemma-like
    sandwich, or a random composition; tied and untied heads; odd vocab and feature sizes."""
    dim, vocab, count = draw(FEATURES), draw(st.integers(3, 23)), draw(st.integers(1, 3))
    form = draw(st.sampled_from(["shorthand", "sandwich", "random"]))
    if form == "shorthand":
        block = {"count": count, "attn_norm": draw(rmsnorm(dim)),
                 "attention": draw(attention(dim, count, max_len)),
                 "mlp_norm": draw(rmsnorm(dim)), "mlp": draw(mlp(dim))}
    elif form == "sandwich":  # pre- and post-norms around attention and MLP, as Gemma 3
        block = {"count": count, "layers": [
            {"kind": "residual", "body": [draw(rmsnorm(dim, "input_layernorm")),
                                          draw(attention(dim, count, max_len)) | {"name": "self_attn"},
                                          draw(rmsnorm(dim, "post_attention_layernorm"))]},
            {"kind": "residual", "body": [draw(rmsnorm(dim, "pre_feedforward_layernorm")),
                                          draw(mlp(dim)) | {"name": "mlp"},
                                          draw(rmsnorm(dim, "post_feedforward_layernorm"))]},
        ]}
    else:
        block = {"count": count, "layers": draw(st.lists(block_layer(dim, count, max_len),
                                                         min_size=1, max_size=3))}
    embedding = {"vocab_size": vocab, "dim": dim}
    if draw(st.booleans()):
        embedding["scale"] = float(np.sqrt(dim))
    spec = {"name": "fuzz_decoder", "form": "decoder", "max_seq_len": max_len,
            "embedding": embedding, "block": block, "final_norm": draw(rmsnorm(dim)),
            "lm_head": {"dim": dim, "vocab_size": vocab, "tied": draw(st.booleans())}}
    if draw(st.integers(0, 3)) == 0:  # a LoRA model: the base frozen, adapters on some projections
        targets = draw(st.lists(st.sampled_from(["q", "k", "v", "o", "gate", "up", "down"]),
                                min_size=1, max_size=7, unique=True))
        with_lora = spec | {"lora": {"rank": 1, "alpha": draw(st.sampled_from([1.0, 8.0])),
                                     "targets": targets}}
        try:
            parse_spec(with_lora, "fuzz")
        except PymlError:
            return spec  # the targets name no projection this block has
        return with_lora
    return spec


@st.composite
def sequential_layers(draw, width, depth=0):
    layers = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["linear", "relu", "gelu", "silu", "rmsnorm", "layernorm"]
                                    + (["residual"] if depth < 2 else [])))
        if kind == "linear":
            out = draw(FEATURES)
            layers.append({"kind": "linear", "in_features": width, "out_features": out,
                           "bias": draw(st.booleans())})
            width = out
        elif kind == "rmsnorm":
            layers.append(draw(rmsnorm(width)))
        elif kind == "layernorm":
            layers.append(draw(layernorm(width)))
        elif kind == "residual":
            body, body_width = draw(sequential_layers(width, depth + 1))
            if body_width != width:
                body.append({"kind": "linear", "in_features": body_width, "out_features": width,
                             "bias": draw(st.booleans())})
            layers.append({"kind": "residual", "body": body})
        else:
            layers.append({"kind": kind})
    return layers, width


@st.composite
def sequential_specs(draw):
    width = draw(FEATURES)
    layers, out = draw(sequential_layers(width))
    classes = draw(st.integers(2, 9))
    layers.append({"kind": "linear", "in_features": out, "out_features": classes,
                   "bias": draw(st.booleans())})
    return {"name": "fuzz_sequential", "form": "sequential", "input_dim": width,
            "output_dim": classes, "layers": layers}


def corpus_specs() -> list[Path]:
    return sorted(CORPUS.glob("*.toml"))
