"""qwen2 (Qwen2, Qwen2.5) and qwen3 (Qwen3) GGUFs imported, trained and exported.

Each GGUF is written as llama.cpp's converter writes one (tests/support/model_folders.py: no Q/K
reordering, the "qwen2" pre-tokenizer; qwen2 with biases on q, k and v, qwen3 with QK-norm gains
and heads of 128). References: transformers loading that GGUF itself (`gguf_file=`: its own
reader, dequantisers and tokenizer builder), transformers' Qwen2ForCausalLM and Qwen3ForCausalLM
on our folder in float64 for the loss and every gradient, and the gguf reader and transformers
again on our export.
"""

import json
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing from a hub

import numpy as np
import pytest
import torch

from pyml.formats.gguf_export import export_gguf
from pyml.formats.gguf_import import import_gguf
from pyml.formats.gguf_read import read_gguf
from pyml.formats.stored_tensors import StoredFolder
from pyml.generate.decoding import load_model, load_tokenizer
from pyml.spec import load_spec
from tests.support.hf_reference import compute_in_float64
from tests.support.llama_cpp_reference import assert_llama_cpp_logits_equal_transformers
from tests.support.model_folders import LLAMA, QWEN3, write_gguf, transformers_folder

TEXT = "The capital of France is Paris, and 12 and 7 are 19.\n\nIn the spring, the rivers run high."


FAMILIES = {"qwen2": ("Qwen2ForCausalLM", LLAMA), "qwen3": ("Qwen3ForCausalLM", QWEN3)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def qwen(request, tmp_path_factory):
    """(the architecture, the GGUF, the folder `pyml import-gguf` made of it)."""
    architecture = request.param
    root = tmp_path_factory.mktemp(architecture)
    gguf_path = root / f"tiny-{architecture}.gguf"
    write_gguf(gguf_path, architecture, FAMILIES[architecture][1])
    return architecture, gguf_path, import_gguf(gguf_path, root / f"tiny-{architecture}", progress=False)


def transformers_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def test_the_folder_is_its_familys_model(qwen):
    architecture, _, folder = qwen
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (architecture, [FAMILIES[architecture][0]])
    assert config["use_sliding_window"] is False and "mlp_bias" not in config
    attention = load_spec(folder / "spec.toml").block.attention
    tensors = StoredFolder(folder).dense_tensors()
    assert "model.layers.0.self_attn.o_proj.bias" not in tensors and not attention.out_bias
    biases = {"model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.v_proj.bias"}
    norms = {"model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"}
    if architecture == "qwen2":  # biases on q, k and v
        assert "attention_bias" not in config and attention.qkv_bias and attention.qk_norm is None
        assert biases <= set(tensors) and not norms & set(tensors)
    else:  # QK-norm, no biases
        assert config["attention_bias"] is False and config["head_dim"] == 128
        assert not attention.qkv_bias and not attention.qk_norm.unit_offset
        assert norms <= set(tensors) and not biases & set(tensors)


def test_tensors_and_logits_equal_transformers_reading_the_gguf(qwen):
    _, gguf_path, folder = qwen
    reference = transformers_from_gguf(gguf_path)
    ours = StoredFolder(folder).dense_tensors()
    theirs = {name: tensor.numpy() for name, tensor in reference.state_dict().items()}
    for name, tensor in ours.items():
        np.testing.assert_array_equal(tensor, theirs[name], err_msg=name)  # no reordering undone
    ids = np.random.default_rng(0).integers(0, 96, (2, 12))
    with torch.no_grad():
        expected = reference(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(load_model(folder).forward(ids), expected, rtol=1e-4, atol=1e-5)


def test_the_tokenizer_splits_as_transformers_qwen2_tokenizer(qwen):
    from transformers import AutoTokenizer

    _, gguf_path, folder = qwen
    reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ours = load_tokenizer(folder)
    for text in (TEXT, "  a  b\n\n\nc 1234 end.", "Seven, eight.\r\nnine"):
        assert ours.encode(text).ids == reference(text)["input_ids"], text
    # the words themselves (the tiny vocabulary merges no digits, so ids alone cannot tell "1234"
    # from "1", "2", "3", "4"), on text outside the vocabulary too
    for text in (TEXT, "it's 2025: ÉTÉ, naïve!\n\n  x\ty  ", "1234567 apples"):
        assert (ours.pre_tokenizer.pre_tokenize_str(text)
                == reference.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)), text


def test_loss_and_every_gradient_equal_transformers_in_float64(qwen, monkeypatch):
    import importlib

    from transformers import AutoModelForCausalLM

    architecture, _, folder = qwen
    modeling = importlib.import_module(f"transformers.models.{architecture}.modeling_{architecture}")
    config = json.loads((folder / "config.json").read_text())
    compute_in_float64(monkeypatch, config["head_dim"], config["rope_theta"], modeling,
                       FAMILIES[architecture][0].removesuffix("ForCausalLM"))
    reference = AutoModelForCausalLM.from_pretrained(transformers_folder(folder), dtype=torch.float64, attn_implementation="sdpa")
    model = load_model(folder, dtype=np.float64)
    # transformers' embedding takes config.json's pad id as its padding_idx, whose row no lookup
    # trains; that token is left out of the input
    ids = np.random.default_rng(1).integers(0, 96, (2, 17))
    ids[ids == config["pad_token_id"]] = 50
    loss = model.loss_and_grads(ids[:, :-1], ids[:, 1:])
    logits = reference(torch.tensor(ids[:, :-1])).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 96), torch.tensor(ids[:, 1:]).reshape(-1))
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-12)
    grads = type(model).tensors(model.grads)
    for name, parameter in reference.named_parameters():
        np.testing.assert_allclose(grads[name], parameter.grad.numpy(), rtol=1e-8, atol=1e-12, err_msg=name)


def test_the_export_is_its_familys_gguf_that_imports_back_and_transformers_reads(qwen, tmp_path):
    architecture, gguf_path, folder = qwen
    exported = export_gguf(folder, tmp_path / "out.gguf", "f32", progress=False)
    metadata = read_gguf(exported).metadata
    assert metadata["general.architecture"] == architecture and metadata["tokenizer.ggml.pre"] == "qwen2"
    back = import_gguf(exported, tmp_path / "back", progress=False)
    original, again = (StoredFolder(f).dense_tensors() for f in (folder, back))
    assert original.keys() == again.keys()
    for name in original:
        np.testing.assert_array_equal(original[name], again[name], err_msg=name)
    ids = np.random.default_rng(2).integers(0, 96, (1, 10))
    with torch.no_grad():
        from_ours = transformers_from_gguf(exported)(torch.tensor(ids)).logits.numpy()
        from_source = transformers_from_gguf(gguf_path)(torch.tensor(ids)).logits.numpy()
    np.testing.assert_array_equal(from_ours, from_source)


def test_greedy_tokens_on_the_stored_weights_equal_transformers(qwen):
    from pyml.generate import decoding as generation

    _, gguf_path, folder = qwen
    tokenizer = load_tokenizer(folder)
    ids = tokenizer.encode("the capital of France is").ids
    decoder = generation.load_decoder(folder, weights="as-stored")
    ours = generation.generate(decoder, tokenizer, ids, 10, set(), out=None).new_ids
    with torch.no_grad():
        expected = transformers_from_gguf(gguf_path).generate(
            torch.tensor([ids]), max_new_tokens=10, do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert ours == expected[0, len(ids):].tolist()


def test_a_folder_trains_and_its_checkpoint_is_a_folder_of_its_family(qwen, tmp_path):
    from pyml.train.run import train
    from tests.support.model_folders import tiny_text

    architecture, _, folder = qwen
    result = train(None, init=folder, data=tiny_text(tmp_path / "text.txt"), steps=2, batch=2, seq=16,
                   eval_every=2, eval_batches=1, checkpoint_every=2, out=tmp_path / "run", progress=False)
    assert result.evaluations[-1]["loss"] < result.evaluations[0]["loss"]
    assert json.loads((result.checkpoint / "config.json").read_text())["model_type"] == architecture
    assert load_model(result.checkpoint).forward(np.zeros((1, 4), np.int64)).shape == (1, 4, 96)


def test_llama_cpp_runs_our_export_as_transformers(qwen, tmp_path):
    """The check that our file means to llama.cpp what the folder means to transformers."""
    _, _, folder = qwen
    assert_llama_cpp_logits_equal_transformers(folder, tmp_path, np.random.default_rng(5).integers(3, 96, 24).tolist())
