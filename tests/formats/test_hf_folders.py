"""A Hugging Face model folder as a user downloads it (config.json, tokenizer, safetensors in bf16,
f16 or f32, sharded with an index or in one file; no spec.toml) runs as it is, and `pyml import-hf`
makes a model folder of it whose weights are links to the downloaded files.

Each folder is written by transformers itself (`save_pretrained`, small shards for the sharded
ones), its weights drawn large enough that greedy tokens are no near-tie. Reference: transformers'
own greedy tokens, in float32 on the same stored values. Then each config pyml cannot run is
refused in one line naming the field.
"""

import json
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing from a hub

import pytest
import torch

from pyml.errors import PymlError
from pyml.formats.gguf_import import import_gguf
from pyml.formats.hf_import import folder_spec, import_hf
from pyml.formats.stored_tensors import StoredFolder
from pyml.generate import decoding as generation
from tests.support.model_folders import LLAMA_TOKENS, write_gguf

VOCAB = len(LLAMA_TOKENS)
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=64,
             bos_token_id=1, eos_token_id=2, pad_token_id=2)
# architecture -> (config class, its fields, dtype stored, sharded); together they cover Llama 3's
# RoPE scaling, a tied head, partial RoPE with a window, and Gemma 3's sliding-window layers
FAMILIES = {
    "llama": ("LlamaConfig", dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}), torch.bfloat16, True),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True), torch.float32, False),
    "qwen3": ("Qwen3Config", {}, torch.float16, True),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5, sliding_window=12), torch.float16, False),
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=6, sliding_window=8,
                                        query_pre_attn_scalar=16), torch.bfloat16, True),
}
# Mistral's model is Llama's (its spec is checked, not run again), without Mistral's default window
MISTRAL = ("MistralConfig", dict(sliding_window=None), torch.bfloat16, False)
CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
PROMPT = "the capital of France is"


def tokenizer_files(root: Path) -> dict[str, bytes]:
    """The tiny byte-level tokenizer's files, as an imported tiny llama holds them."""
    gguf_path = root / "tokenizer.gguf"
    write_gguf(gguf_path, "llama", {"hidden": 8, "layers": 1, "heads": 1, "kv_heads": 1,
                                    "head_dim": 8, "ffn": 8})
    folder = import_gguf(gguf_path, root / "tokenizer", progress=False)
    return {name: (folder / name).read_bytes()
            for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json")}


def save_downloaded(folder: Path, family: str, tokenizer: dict[str, bytes]) -> None:
    """What a user downloads of a tiny model of `family`: transformers' save_pretrained."""
    import transformers

    class_name, fields, dtype, sharded = FAMILIES[family] if family in FAMILIES else MISTRAL
    config = getattr(transformers, class_name)(**(SMALL | fields))
    config.architectures = None
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn_like(parameter)
            gain = "norm" in name and family != "gemma3"  # Gemma's norms hold w of (1 + w)
            parameter.copy_(1 + 0.3 * noise if gain else 0.3 * noise if "norm" in name else 0.2 * noise)
    model.to(dtype).save_pretrained(folder, max_shard_size="40KB" if sharded else "1GB")
    for name, content in tokenizer.items():
        (folder / name).write_bytes(content)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> dict[str, bytes]:
    return tokenizer_files(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module", params=list(FAMILIES))
def downloaded(request, tmp_path_factory, tokenizer) -> tuple[str, Path, list[int]]:
    """(the family, its folder as downloaded, transformers' greedy tokens on it)."""
    from transformers import AutoModelForCausalLM

    family = request.param
    folder = tmp_path_factory.mktemp(family) / f"Tiny-{family}-Instruct"
    save_downloaded(folder, family, tokenizer)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    ids = generation.load_tokenizer(folder).encode(PROMPT).ids
    with torch.no_grad():
        tokens = reference.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return family, folder, tokens[0, len(ids):].tolist()


def greedy(folder: Path) -> list[int]:
    tokenizer = generation.load_tokenizer(folder)
    decoder = generation.load_decoder(folder, weights="as-stored")
    ids = tokenizer.encode(PROMPT).ids
    return generation.generate(decoder, tokenizer, ids, 10, set(), out=None).new_ids


def test_a_downloaded_folder_generates_transformers_greedy_tokens(downloaded):
    family, folder, expected = downloaded
    assert not (folder / "spec.toml").exists()
    sharded = FAMILIES[family][3]
    assert (folder / "model.safetensors.index.json").is_file() == sharded
    assert greedy(folder) == expected


def test_import_hf_links_the_weights_and_generates_the_same(downloaded, tmp_path):
    family, folder, expected = downloaded
    out = import_hf(folder, tmp_path / folder.name, progress=False)  # the same spec, so one package
    weights = sorted(path.name for path in out.iterdir() if "safetensors" in path.name)
    assert weights == sorted(path.name for path in folder.iterdir() if "safetensors" in path.name)
    for name in weights:
        assert (out / name).is_symlink() and (out / name).resolve() == (folder / name).resolve()
    assert (out / "spec.toml").is_file() and (out / "config.json").read_bytes() == (folder / "config.json").read_bytes()
    stored = StoredFolder(out)
    kind = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[FAMILIES[family][2]]
    assert {tensor.ggml_type.name for tensor in stored.tensors.values()} == {kind}
    assert greedy(out) == expected


def test_the_spec_is_the_one_a_gguf_import_writes(tmp_path):
    """A tiny llama's GGUF imported, and the same model as Hugging Face stores it: one spec."""
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(gguf_path, "llama", {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2,
                                    "head_dim": 16, "ffn": 96})
    imported = import_gguf(gguf_path, tmp_path / "same", progress=False)
    downloaded = tmp_path / "downloaded" / "same"
    downloaded.mkdir(parents=True)
    (downloaded / "config.json").write_bytes((imported / "config.json").read_bytes())
    import tomllib

    assert folder_spec(downloaded) == tomllib.loads((imported / "spec.toml").read_text())


def test_import_hf_copies_with_copy_and_writes_the_chat_template(tmp_path, tokenizer):
    folder = tmp_path / "Tiny"
    save_downloaded(folder, "qwen2", tokenizer)
    template = json.loads(tokenizer["tokenizer_config.json"])["chat_template"]
    out = import_hf(folder, tmp_path / "copied", copy=True, progress=False)
    assert not (out / "model.safetensors").is_symlink()
    assert (out / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    assert (out / "chat_template.jinja").read_text() == template


def edited(folder: Path, tmp_path: Path, **changes) -> Path:
    """A copy of `folder`'s config.json (alone) with `changes`; None removes a key."""
    copy = tmp_path / "edited"
    copy.mkdir(exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config = {key: value for key, value in (config | changes).items() if value is not None}
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("family, changes, message", [
    ("llama", {"architectures": ["GPT2LMHeadModel"]}, "architectures is ['GPT2LMHeadModel']; pyml runs one of"),
    ("llama", {"model_type": "gpt2"}, "model_type is 'gpt2', but LlamaForCausalLM's is 'llama'"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "rope_scaling of type 'yarn' is not supported for LlamaForCausalLM (it takes linear or llama3)"),
    ("llama", {"attention_bias": True}, "biases on the attention's projections is not supported (attention_bias is True)"),
    ("llama", {"hidden_act": "gelu"}, "an MLP activation other than silu is not supported (hidden_act is 'gelu')"),
    ("llama", {"num_key_value_heads": 3}, "num_attention_heads 4 do not share num_key_value_heads 3"),
    ("llama", {"vocab_size": "many"}, "vocab_size is 'many', not a positive integer"),
    ("mistral", {"sliding_window": 4096}, "sliding-window attention in a Mistral model is not supported (sliding_window is 4096)"),
    ("mistral", {"sliding_window": None}, "(sliding_window is 4096)"),  # MistralConfig's default
    ("qwen2", {"use_sliding_window": True}, "sliding-window attention is not supported (use_sliding_window is True)"),
    ("gemma3", {"final_logit_softcapping": 30.0}, "final logit soft-capping is not supported"),
    ("gemma3", {"layer_types": ["full_attention"] + ["sliding_attention"] * 5},
     "layer_types is not one global layer after every few sliding-window ones"),
    ("phi3", {"partial_rotary_factor": 0.3, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}},
     "partial_rotary_factor 0.3 does not rotate an even part of heads of 16"),
])
def test_a_config_pyml_cannot_run_is_refused_naming_the_field(tmp_path, tokenizer, family, changes, message):
    folder = tmp_path / "model"
    folder.mkdir()
    import transformers

    class_name, fields, _, _ = FAMILIES[family] if family in FAMILIES else MISTRAL
    getattr(transformers, class_name)(**(SMALL | fields)).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = [CLASSES[family]]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(PymlError) as raised:
        folder_spec(edited(folder, tmp_path, **changes))
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert str(raised.value).startswith(str(tmp_path / "edited" / "config.json"))


def test_import_hf_refuses_weights_config_json_does_not_describe(tmp_path, tokenizer):
    folder = tmp_path / "Tiny"
    save_downloaded(folder, "qwen2", tokenizer)
    config = json.loads((folder / "config.json").read_text()) | {"intermediate_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(PymlError, match=r"has shape \(96, 64\); config.json's model has \(128, 64\)"):
        import_hf(folder, tmp_path / "out", progress=False)


def test_a_mistral_folder_is_a_llama_without_a_window(tmp_path, tokenizer):
    """Mistral's spec is Llama's of the same dims; its folder passes the config check as such."""
    from pyml.formats.hf_config import config_mismatches
    from pyml.spec import parse_spec

    mistral, llama = tmp_path / "mistral" / "Tiny", tmp_path / "llama" / "Tiny"
    save_downloaded(mistral, "mistral", tokenizer)
    config = json.loads((mistral / "config.json").read_text())
    llama.mkdir(parents=True)
    (llama / "config.json").write_text(json.dumps(
        config | {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    spec = folder_spec(mistral)
    assert spec == folder_spec(llama)
    assert config_mismatches(parse_spec(spec, "mistral"), config) == []
    assert config_mismatches(parse_spec(spec, "mistral"), config | {"sliding_window": 4096}) == [
        "sliding_window is 4096 in config.json but None in the spec"]
