"""Tiny model folders of the GGUF families, for the checkpoint and export tests.

Each is made as a user makes one: a GGUF written the way llama.cpp's converter writes it (with the
gguf package: llama's Q and K rows permuted, Gemma's norm gains stored as 1 + w, the tokenizer as
metadata), imported with `pyml import-gguf`. The llama one has `specs/llama_tiny.toml`'s dims, so
that gen/llama_tiny trains it; the gemma one is small and has six layers (five sliding-window
ones and a global one), a user-defined token and a SentencePiece vocabulary. The qwen2 one is the
llama one with biases on its q, k and v projections, Q and K rows as Hugging Face stores them
(qwen2 is converted without the reordering) and Qwen2's pre-tokenizer; the qwen3 one has no
biases but QK-norm gains, and heads of 128 (QWEN3).
"""

import math
from pathlib import Path

import gguf
import numpy as np

from pyml.formats.gguf_import import import_gguf
from pyml.weight_formats import GGMLType, quantize
from pyml.formats.safetensors_io import write_safetensors
from pyml.formats.stored_tensors import StoredFolder
from pyml.spec import load_spec

SPECS = Path(__file__).resolve().parents[2] / "specs"
K_QUANTS = (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K,
            gguf.GGMLQuantizationType.Q6_K)
# llama_tiny's dims, read from its spec so that the two never part.
LLAMA_SPEC = load_spec(SPECS / "llama_tiny.toml")
LLAMA_ATTENTION = LLAMA_SPEC.block.attention
LLAMA = {
    "hidden": LLAMA_SPEC.embedding.dim, "layers": LLAMA_SPEC.block.count,
    "heads": LLAMA_ATTENTION.n_heads, "kv_heads": LLAMA_ATTENTION.n_kv_heads,
    "head_dim": LLAMA_ATTENTION.head_dim, "ffn": LLAMA_SPEC.block.mlp.hidden,
}  # fmt: skip
# Heads of 256, as Gemma 3's: llama.cpp scales the scores by head_dim ** -0.5, and transformers'
# GGUF loader by 256 ** -0.5 whatever head_dim is (it leaves query_pre_attn_scalar at its default).
GEMMA = {"hidden": 64, "layers": 6, "heads": 2, "kv_heads": 1, "head_dim": 256, "ffn": 96}
GEMMA_WINDOW = 8
# Heads of 128, as every Qwen3's: transformers' GGUF loader takes no head_dim from a qwen3 file
# and uses Qwen3Config's default, 128.
QWEN3 = LLAMA | {"head_dim": 128}

# A byte-level vocabulary of 96 tokens (llama_tiny's): three control tokens, the byte symbols of
# letters, digits, space, newline and some punctuation, and the tokens of 27 merges.
LLAMA_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SYMBOLS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
    chr(c) for c in range(ord("A"), ord("Z") + 1)
] + [str(d) for d in range(10)] + ["Ġ", "Ċ", ".", ","]  # fmt: skip
LLAMA_MERGES = [
    "Ġ t", "h e", "Ġt he", "i n", "e r", "a n", "o n", "r e", "Ġ a", "e n", "a t", "o r", "e s",
    "Ġ s", "i s", "i t", "o u", "Ġ o", "Ġ w", "n d", "e d", "Ġ c", "a r", "a l", "Ġ f", "Ġ p", "l e",
]  # fmt: skip
LLAMA_TOKENS = LLAMA_SPECIAL + LLAMA_SYMBOLS + [merge.replace(" ", "") for merge in LLAMA_MERGES]
assert len(LLAMA_TOKENS) == LLAMA_SPEC.embedding.vocab_size
LLAMA_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A SentencePiece vocabulary as Gemma's: control tokens, the 256 byte tokens, a user-defined
# token, then pieces scored best first.
GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
GEMMA_BYTES = [f"<0x{byte:02X}>" for byte in range(256)]
GEMMA_USER_DEFINED = ["\n\n"]
GEMMA_PIECES = [
    "▁t", "he", "▁the", "in", "▁a", "er", "on", "▁c", "at", "ap", "it", "al", "ital", "of", "▁of",
    "is", "▁is", "ris", "▁Pa", "Pa",
    "▁", "t", "h", "e", "i", "n", "a", "r", "o", "c", "p", "l", "f", "s", "F", "P", ".",
]  # fmt: skip
GEMMA_TOKENS = GEMMA_SPECIAL + GEMMA_BYTES + GEMMA_USER_DEFINED + GEMMA_PIECES
# Llama 2's and Mistral's SentencePiece vocabulary: <unk>, <s>, </s>, the byte tokens, then pieces
# scored best first; a space goes in front of the text (add_space_prefix), and their chat template.
MISTRAL_SPECIAL = ["<unk>", "<s>", "</s>"]
MISTRAL_TOKENS = MISTRAL_SPECIAL + GEMMA_BYTES + GEMMA_PIECES
# Phi-3's: Mistral's kind, with its added control tokens after the pieces (<|endoftext|> its pad).
PHI3_ADDED = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"]
PHI3_TOKENS = MISTRAL_TOKENS + PHI3_ADDED
PHI3_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to the Q and K rows (its `permute`)."""
    return (
        weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def block_shapes(dims: dict[str, int], gemma: bool, qkv_bias: bool = False,
                 qk_norm: bool = False, phi3: bool = False) -> dict[str, tuple[int, ...]]:
    hidden, ffn = dims["hidden"], dims["ffn"]
    q_rows, kv_rows = dims["heads"] * dims["head_dim"], dims["kv_heads"] * dims["head_dim"]
    if phi3:  # q, k, v in one tensor, gate and up in one (gate rows first)
        return {
            "attn_norm.weight": (hidden,),
            "attn_qkv.weight": (q_rows + 2 * kv_rows, hidden),
            "attn_output.weight": (hidden, q_rows),
            "ffn_norm.weight": (hidden,),
            "ffn_up.weight": (2 * ffn, hidden),
            "ffn_down.weight": (hidden, ffn),
        }
    shapes = {
        "attn_norm.weight": (hidden,),
        "attn_q.weight": (q_rows, hidden),
        "attn_k.weight": (kv_rows, hidden),
        "attn_v.weight": (kv_rows, hidden),
        "attn_output.weight": (hidden, q_rows),
        "ffn_norm.weight": (hidden,),
        "ffn_gate.weight": (ffn, hidden),
        "ffn_up.weight": (ffn, hidden),
        "ffn_down.weight": (hidden, ffn),
    }
    if qkv_bias:
        shapes |= {"attn_q.bias": (q_rows,), "attn_k.bias": (kv_rows,), "attn_v.bias": (kv_rows,)}
    if gemma or qk_norm:
        shapes |= {"attn_q_norm.weight": (dims["head_dim"],), "attn_k_norm.weight": (dims["head_dim"],)}
    if gemma:
        shapes |= {
            "post_attention_norm.weight": (hidden,),
            "post_ffw_norm.weight": (hidden,),
        }
    return shapes


def converter_rope_factors(scaling: dict, head_dim: int, theta: float) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py computes it for a Hugging Face
    `rope_scaling` of rope_type "llama3" (LlamaModel.generate_extra_tensors), in torch."""
    import torch

    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context_len / high:
            factors.append(1)
        elif wavelen > old_context_len / low:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


# Llama 3's kind ("llama-bpe"): the byte-level vocabulary with two tokens no merge makes, a word and
# a run of three digits, which its pre-tokenizer's ignore_merges and \p{N}{1,3} reach whole.
LLAMA3_TOKENS = LLAMA_TOKENS + ["Ġcapital", "123"]


def write_gguf(path: Path, architecture: str, dims: dict[str, int],
               rope_scaling: dict | None = None, sentencepiece: bool = False,
               pre: str | None = None, general: dict[str, object] | None = None,
               tensor_types: dict[str, "gguf.GGMLQuantizationType"] | None = None) -> None:
    """A tiny GGUF of `architecture` (llama, qwen2, qwen3, phi3 or gemma3), every tensor float32;
    a llama one with `rope_scaling` (Hugging Face's: rope_type "linear" or "llama3"; a phi3 one:
    "longrope") stores it as llama.cpp's converter does, with `sentencepiece` Mistral's kind of
    vocabulary (phi3's always), with `pre` another byte-level pre-tokenizer ("llama-bpe":
    LLAMA3_TOKENS), with `general` these `general.*` keys (strings, counts and lists of strings, as
    llama.cpp's converter types them), with `tensor_types` the matrices whose name holds a key
    stored in its type (the first key that matches; "" matches every matrix; F16, a type gguf-py
    quantizes, or a K-quant, which pyml's quantizer encodes). A phi3 one has its own head (untied), RoPE on dims["rope_dims"] features of
    each head (default all) and a window of dims["window"] positions (default 0: none). Every
    model is of 64 positions."""
    gemma, qwen2, qwen3 = architecture == "gemma3", architecture == "qwen2", architecture == "qwen3"
    phi3 = architecture == "phi3"
    sentencepiece = sentencepiece or phi3
    tokens = (GEMMA_TOKENS if gemma else PHI3_TOKENS if phi3 else MISTRAL_TOKENS if sentencepiece
              else LLAMA3_TOKENS if pre == "llama-bpe" else LLAMA_TOKENS)
    writer = gguf.GGUFWriter(path, architecture)
    for key, value in (general or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_array(key, value)
    writer.add_context_length(64)
    writer.add_embedding_length(dims["hidden"])
    writer.add_block_count(dims["layers"])
    writer.add_feed_forward_length(dims["ffn"])
    writer.add_head_count(dims["heads"])
    writer.add_head_count_kv(dims["kv_heads"])
    writer.add_key_length(dims["head_dim"])
    writer.add_value_length(dims["head_dim"])
    writer.add_token_list(tokens)
    if gemma:
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_rope_freq_base(1e6)
        writer.add_sliding_window(GEMMA_WINDOW)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        n_added = len(GEMMA_SPECIAL) + len(GEMMA_BYTES) + len(GEMMA_USER_DEFINED)
        writer.add_token_scores(
            [-1000.0] * len(GEMMA_SPECIAL) + [0.0] * len(GEMMA_BYTES)
            + [-1000.0] * len(GEMMA_USER_DEFINED) + [-float(i) for i in range(len(GEMMA_PIECES))]
        )  # fmt: skip
        writer.add_token_types(
            [3] * len(GEMMA_SPECIAL) + [6] * len(GEMMA_BYTES) + [4] * len(GEMMA_USER_DEFINED)
            + [1] * (len(tokens) - n_added)
        )  # fmt: skip
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        writer.add_add_space_prefix(False)
    else:
        writer.add_vocab_size(len(tokens))
        writer.add_rope_dimension_count(dims.get("rope_dims", dims["head_dim"]))
        writer.add_layer_norm_rms_eps(LLAMA_SPEC.final_norm.eps)
        writer.add_rope_freq_base(LLAMA_ATTENTION.rope.theta)
    if phi3:
        writer.add_rope_scaling_orig_ctx_len(rope_scaling["original_max_position_embeddings"]
                                             if rope_scaling else 64)
        writer.add_sliding_window(dims.get("window", 0))
        writer.add_pad_token_id(PHI3_TOKENS.index("<|endoftext|>"))
    if sentencepiece:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        added = PHI3_ADDED if phi3 else []
        writer.add_token_scores([0.0] * (len(MISTRAL_SPECIAL) + len(GEMMA_BYTES))
                                + [-float(i) for i in range(len(GEMMA_PIECES))] + [-1000.0] * len(added))
        writer.add_token_types([2] + [3] * (len(MISTRAL_SPECIAL) - 1) + [6] * len(GEMMA_BYTES)
                               + [1] * len(GEMMA_PIECES) + [3] * len(added))
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        writer.add_add_space_prefix(True)
        writer.add_chat_template(PHI3_CHAT_TEMPLATE if phi3 else MISTRAL_CHAT_TEMPLATE)
    elif not gemma:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre or ("qwen2" if qwen2 or qwen3 else "smollm"))
        writer.add_token_types([3] * len(LLAMA_SPECIAL) + [1] * (len(tokens) - len(LLAMA_SPECIAL)))
        writer.add_token_merges(LLAMA_MERGES)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_pad_token_id(2)
        writer.add_add_bos_token(False)
        writer.add_add_space_prefix(False)
        writer.add_chat_template(LLAMA_CHAT_TEMPLATE)
    if rope_scaling and rope_scaling["rope_type"] == "longrope":  # Phi3MiniModel's way
        scale = 64 / rope_scaling["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(rope_scaling["original_max_position_embeddings"])))
        writer.add_tensor("rope_factors_long.weight", np.array(rope_scaling["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope_scaling["short_factor"], np.float32))
    elif rope_scaling and rope_scaling["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_scaling["factor"])
    elif rope_scaling:
        writer.add_tensor("rope_freqs.weight", converter_rope_factors(
            rope_scaling, dims["head_dim"], LLAMA_ATTENTION.rope.theta))

    rng = np.random.default_rng(7)
    shapes = {
        "token_embd.weight": (len(tokens), dims["hidden"]),
        "output_norm.weight": (dims["hidden"],),
    }
    if phi3:
        shapes["output.weight"] = (len(tokens), dims["hidden"])
    for layer in range(dims["layers"]):
        shapes |= {
            f"blk.{layer}.{name}": shape
            for name, shape in block_shapes(dims, gemma, qwen2, qwen3, phi3).items()
        }
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):  # a gain (for Gemma: 1 + w, as the converter stores it)
            weight = (1 + rng.standard_normal(shape) * 0.3).astype(np.float32)
        else:
            weight = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if architecture == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = dims["heads"] if name.endswith("attn_q.weight") else dims["kv_heads"]
            weight = np.ascontiguousarray(llama_cpp_permute(weight, heads))
        stored_type = next((kind for key, kind in (tensor_types or {}).items() if key in name), None)
        if weight.ndim == 2 and stored_type == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, weight.astype(np.float16))
        elif weight.ndim == 2 and stored_type in K_QUANTS:  # gguf-py dequantizes these only
            writer.add_tensor(name, quantize(weight, GGMLType(int(stored_type))), raw_dtype=stored_type)
        elif weight.ndim == 2 and stored_type is not None:
            writer.add_tensor(name, gguf.quants.quantize(weight, stored_type), raw_dtype=stored_type)
        else:
            writer.add_tensor(name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_folder(root: Path, architecture: str, dims: dict[str, int] | None = None) -> Path:
    """`root`/tiny-<architecture>/, imported from a tiny GGUF written beside it."""
    dims = dims or (GEMMA if architecture == "gemma3" else LLAMA)
    gguf_path = root / f"tiny-{architecture}.gguf"
    write_gguf(gguf_path, architecture, dims)
    return import_gguf(gguf_path, root / f"tiny-{architecture}", progress=False)


def transformers_folder(folder: Path) -> Path:
    """`folder` as transformers' `from_pretrained` loads it. transformers reads no source.gguf, so
    an imported folder is written again beside it (`<name>.transformers`, replaced each time) with
    its weights as model.safetensors, float32, as pyml reads them: the folder's config and
    tokenizer with the weights pyml runs. A folder of model.safetensors is itself."""
    folder = Path(folder)
    if not (folder / "source.gguf").exists():
        return folder
    loadable = folder.with_name(folder.name + ".transformers")
    loadable.mkdir(exist_ok=True)
    for path in folder.iterdir():
        if path.name != "source.gguf":
            (loadable / path.name).write_bytes(path.read_bytes())
    write_safetensors(loadable / "model.safetensors", StoredFolder(folder).dense_tensors(),
                      metadata={"format": "pt"})
    return loadable


def tiny_text(path: Path) -> Path:
    """A text file in the tiny llama's alphabet, to train on."""
    lines = [
        "The capital of France is Paris, and the capital of Italy is Rome.",
        "In the spring, the rivers run high and the fields are green.",
        "A cat sat on the mat. It was warm, and the sun was out.",
        "Seven and five are twelve. Twelve and eight are twenty.",
    ]
    path.write_text("\n".join(lines * 12) + "\n", encoding="utf-8")
    return path


def tiny_training(init: Path, out: Path, **options):
    """A few float64 steps of llama_tiny from `init`, checkpoints every 2 steps."""
    from pyml.train.run import train

    # a constant rate: the tests resume a run of 2 steps to 4 and compare it with a run of 4,
    # which a decaying schedule (the decoders' default, linear) would make two different runs
    values = dict(steps=4, batch=2, seq=16, lr=3e-3, eval_every=2, eval_batches=2,
                  checkpoint_every=2, dtype="float64", schedule="constant")  # fmt: skip
    return train(SPECS / "llama_tiny.toml", init=init, data=tiny_text(out.parent / "text.txt"),
                 out=out, progress=False, **(values | options))  # fmt: skip
