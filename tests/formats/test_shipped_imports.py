"""`pyml import-gguf --shipped` of each family's real GGUF, against transformers loading the same
GGUF (`from_pretrained(dir, gguf_file=...)`): an independent implementation of the format, the
dequantisers, llama's Q/K un-permutation and Gemma's norm convention (the file holds 1 + w;
transformers subtracts 1). Our tensors must equal its tensors bit for bit, and the folder we write
must load in transformers and give the same logits. Each family's tiny GGUFs, written here with
the gguf package, cover what the real files cannot: test_llama_import.py, test_gemma3_import.py.
"""

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from pyml.formats.gguf_import import load_gguf_tensors
from pyml.formats.gguf_read import read_gguf
from pyml.formats.stored_tensors import StoredFolder
from tests.support.families import FAMILIES
from tests.support.model_folders import transformers_folder

pytestmark = pytest.mark.parametrize("family", list(FAMILIES))
SLIDING, FULL = "sliding_attention", "full_attention"
# What each import writes: source.gguf, a link to the file itself, which every command reads
# by memory map, and the files that describe the model.
FILES = {
    "smollm2": ["chat_template.jinja", "config.json", "generation_config.json", "gguf_general.json",
                "source.gguf", "spec.toml", "tokenizer.json", "tokenizer_config.json"],
    # no chat template: Gemma 3 270M is the base model
    "gemma3": ["config.json", "generation_config.json", "gguf_general.json", "source.gguf",
               "spec.toml", "tokenizer.json", "tokenizer_config.json"],
}
CONFIGS = {
    "smollm2": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-05, "rope_theta": 100000.0, "tie_word_embeddings": True, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    },
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 640,
        "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "sliding_window": 512, "layer_types": ([SLIDING] * 5 + [FULL]) * 3, "query_pre_attn_scalar": 256,
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "attention_bias": False, "tie_word_embeddings": True,
        "torch_dtype": "float32", "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    },
}
# transformers' config fields that the folder's config must give as its GGUF load gives them
COMPARED_FIELDS = {
    "smollm2": ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"],
    "gemma3": ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
               "sliding_window", "layer_types", "rope_parameters", "query_pre_attn_scalar",
               "hidden_activation", "final_logit_softcapping", "attn_logit_softcapping",
               "attention_bias", "use_bidirectional_attention", "tie_word_embeddings",
               "bos_token_id", "eos_token_id", "pad_token_id"],
}
# Gemma's second prompt is longer than its 512-token window, so the sliding layers drop its start.
PROMPTS = {
    "smollm2": ["What is the capital of France? 42"],
    "gemma3": ["The capital of France is", " ".join(["The quick brown fox jumps over the lazy dog."] * 70)],
}


@pytest.fixture
def imported(request, family) -> Path:
    return request.getfixturevalue(FAMILIES[family].folder_fixture)


@pytest.fixture
def reference(request, family):
    """transformers' model and tokenizer from the GGUF (tests/conftest.py loads each once)."""
    return request.getfixturevalue(FAMILIES[family].reference_fixture)


@pytest.mark.slow
def test_weights_equal_transformers_loading_the_gguf(imported, reference):
    ours = StoredFolder(imported).dense_tensors()
    theirs = {name: tensor.numpy() for name, tensor in reference[0].state_dict().items()}
    # The head is tied: transformers lists it, the file (like Hugging Face's own) does not.
    assert set(theirs) == set(ours) | {"lm_head.weight"}
    assert np.array_equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])
    for name, weight in ours.items():
        assert weight.dtype == np.float32 and weight.shape == theirs[name].shape, name
        assert np.array_equal(weight.view(np.uint32), theirs[name].view(np.uint32)), name


@pytest.mark.slow
def test_the_folder_gives_transformers_the_model_of_the_gguf(imported, reference, family):
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(transformers_folder(imported), dtype=torch.float32).eval()
    theirs, tokenizer = reference
    assert type(ours) is type(theirs)
    for field in COMPARED_FIELDS[family]:
        assert getattr(ours.config, field) == getattr(theirs.config, field), field
    # transformers keeps the file's float32 epsilon widened (9.99999997e-07 for 1e-06)
    assert ours.config.rms_norm_eps == pytest.approx(theirs.config.rms_norm_eps, rel=1e-7)
    for prompt in PROMPTS[family]:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        keep = 8 if ids.shape[1] > 64 else 0  # 0: every position
        with torch.no_grad():
            assert torch.equal(ours(ids, logits_to_keep=keep).logits, theirs(ids, logits_to_keep=keep).logits)


def test_written_files(imported, family):
    shipped = FAMILIES[family].shipped_gguf()
    assert sorted(path.name for path in imported.iterdir()) == FILES[family]
    assert (imported / "source.gguf").is_symlink()
    assert (imported / "source.gguf").readlink() == shipped.resolve()
    general = json.loads((imported / "gguf_general.json").read_text())
    assert general["general.name"] == read_gguf(shipped).metadata["general.name"]
    config = json.loads((imported / "config.json").read_text())
    assert config == CONFIGS[family]
    generation = json.loads((imported / "generation_config.json").read_text())
    assert generation == {name: config[name] for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    tokenizer_config = json.loads((imported / "tokenizer_config.json").read_text())
    template = read_gguf(shipped).metadata.get("tokenizer.chat_template")
    assert tokenizer_config.get("chat_template") == template
    if template is not None:
        assert (imported / "chat_template.jinja").read_text() == template
    vocab_size = config["vocab_size"]
    assert Tokenizer.from_file(str(imported / "tokenizer.json")).get_vocab_size() == vocab_size


def test_written_spec_is_the_hand_written_spec(imported, family):
    # The shipped model's spec keeps its name in specs/; everything else comes from the metadata.
    with open(imported / "spec.toml", "rb") as handle:
        written = tomllib.load(handle)
    with open(FAMILIES[family].spec_path, "rb") as handle:
        assert written == tomllib.load(handle)


def test_load_gguf_tensors_gives_what_import_writes(imported, family):
    written = StoredFolder(imported).dense_tensors()
    loaded = load_gguf_tensors(FAMILIES[family].shipped_gguf())
    assert loaded.keys() == written.keys()
    assert all(np.array_equal(loaded[name], written[name]) for name in written)
