"""phi3 GGUFs (Phi-3 mini and medium, Phi-4 mini) imported, trained and exported.

Each GGUF is written as llama.cpp's converter (conversion/phi.py) writes one: q, k and v in one
tensor and gate and up in one, rope.dimension_count for a partial rotary, the window in
attention.sliding_window (0: none), a SentencePiece vocabulary. Two variants: full rotary with a
window of 8, RoPE on half of each head with no window, and LongRoPE (Phi-3 128k's and Phi-3.5's
scaling: rope_factors_short and rope_factors_long, an attention factor, a model of 64 positions
trained on 16, so its long factors apply). References: transformers'
Phi3ForCausalLM on our folder (float32 logits, float64 loss and every gradient, greedy tokens),
transformers' GGUF loader for the tensors (it takes neither rope.dimension_count nor the window
from a phi3 file, so its logits are compared only where those do not matter), and llama.cpp
where llama-cpp-python is installed (it runs Phi-3 without its window: compared within it).
"""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing from a hub

import numpy as np
import pytest
import torch

from pyml.errors import PymlError
from pyml.formats.gguf_architectures import architecture_of
from pyml.formats.gguf_export import export_gguf
from pyml.formats.gguf_import import import_gguf
from pyml.formats.gguf_read import GGUFFile, GGUFTensor, read_gguf
from pyml.formats.stored_tensors import StoredFolder
from pyml.generate.decoding import load_model, load_tokenizer
from pyml.spec import load_spec
from pyml.spec.layers import Attention
from tests.support.hf_reference import compute_in_float64
from tests.support.llama_cpp_reference import assert_llama_cpp_logits_equal_transformers
from tests.support.model_folders import LLAMA, PHI3_TOKENS, write_gguf, transformers_folder

VOCAB = len(PHI3_TOKENS)
# inputs are drawn from ids 3 to 298: the last four are control tokens, <|endoftext|> the pad id,
# whose embedding row transformers never trains
WINDOW = 8
VARIANTS = {"windowed": LLAMA | {"window": WINDOW}, "partial-rotary": LLAMA | {"rope_dims": 4},
            "longrope": LLAMA}
ORIGINAL = 16  # the longrope model's original context: its sequences here are longer
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.03, 1.1, 1.3],
            "long_factor": [1.0, 2.5, 6.0, 16.0], "original_max_position_embeddings": ORIGINAL}


@pytest.fixture(scope="module", params=list(VARIANTS))
def phi3(request, tmp_path_factory):
    """(the variant, the GGUF, the folder `pyml import-gguf` made of it)."""
    root = tmp_path_factory.mktemp(f"phi3-{request.param}")
    gguf_path = root / "tiny-phi3.gguf"
    write_gguf(gguf_path, "phi3", VARIANTS[request.param],
               LONGROPE if request.param == "longrope" else None)
    return request.param, gguf_path, import_gguf(gguf_path, root / "tiny-phi3", progress=False)


def reference_model(folder, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(transformers_folder(folder), dtype=dtype, attn_implementation="sdpa").eval()


def test_the_folder_is_phi3s_model(phi3):
    variant, _, folder = phi3
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("phi3", ["Phi3ForCausalLM"])
    assert config["partial_rotary_factor"] == (0.5 if variant == "partial-rotary" else 1.0)
    assert config["sliding_window"] == (WINDOW if variant == "windowed" else None)
    spec = load_spec(folder / "spec.toml")
    attention = spec.block.attention
    assert attention.fused_qkv and spec.block.mlp.fused_gate_up and not spec.lm_head.tied
    assert attention.rotary_dims == (4 if variant == "partial-rotary" else 8)
    if variant == "longrope":  # the converter's attention factor, sqrt(1 + ln(64/16) / ln 16)
        scaling = {key: value for key, value in LONGROPE.items() if key != "rope_type"}
        scaling["attention_factor"] = float(str(np.float32(1.5**0.5)))
        assert attention.rope.scaling.model_dump() == {"type": "longrope"} | scaling
        assert config["rope_scaling"] == LONGROPE | {"attention_factor": scaling["attention_factor"]}
        assert config["original_max_position_embeddings"] == ORIGINAL
    else:
        assert attention.rope.scaling is None and "rope_scaling" not in config
    tensors = StoredFolder(folder).dense_tensors()
    assert tensors["model.layers.0.self_attn.qkv_proj.weight"].shape == ((4 + 2 * 2) * 8, 32)
    assert tensors["model.layers.1.mlp.gate_up_proj.weight"].shape == (2 * 64, 32)
    assert "lm_head.weight" in tensors


# the tensors' names and layout are the same for every variant: LongRoPE's model adds only its factors
@pytest.mark.parametrize("phi3", ["windowed", "partial-rotary"], indirect=True)
def test_tensors_equal_transformers_reading_the_gguf(phi3):
    from transformers import AutoModelForCausalLM

    variant, gguf_path, folder = phi3
    reference = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.float32).eval()
    theirs = reference.state_dict()
    for name, tensor in StoredFolder(folder).dense_tensors().items():
        np.testing.assert_array_equal(tensor, theirs[name].numpy(), err_msg=name)
    if variant == "windowed":  # full rotary; within the window, which their loader leaves out
        ids = np.random.default_rng(0).integers(3, VOCAB - 4, (2, WINDOW))
        with torch.no_grad():
            expected = reference(torch.tensor(ids)).logits.numpy()
        np.testing.assert_allclose(load_model(folder).forward(ids), expected, rtol=1e-4, atol=1e-5)


def test_logits_equal_phi3_for_causal_lm_past_the_window(phi3):
    _, _, folder = phi3
    reference = reference_model(folder)
    ids = np.random.default_rng(1).integers(3, VOCAB - 4, (2, 3 * WINDOW))  # past ORIGINAL too
    with torch.no_grad():
        expected = reference(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(load_model(folder).forward(ids), expected, rtol=1e-4, atol=1e-5)


def test_loss_and_every_gradient_equal_transformers_in_float64(phi3, monkeypatch):
    from transformers.models.phi3 import modeling_phi3

    _, _, folder = phi3
    config = json.loads((folder / "config.json").read_text())
    rotary = round(config["partial_rotary_factor"] * config["head_dim"])
    scaling = load_spec(folder / "spec.toml").block.attention.rope.scaling
    compute_in_float64(monkeypatch, rotary, config["rope_theta"], modeling_phi3, "Phi3",
                       scaling and scaling.model_dump())
    reference = reference_model(folder, torch.float64).train()
    model = load_model(folder, dtype=np.float64)
    ids = np.random.default_rng(2).integers(3, VOCAB - 4, (2, 3 * WINDOW + 1))  # past ORIGINAL
    loss = model.loss_and_grads(ids[:, :-1], ids[:, 1:])
    logits = reference(torch.tensor(ids[:, :-1])).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), torch.tensor(ids[:, 1:]).reshape(-1))
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-12)
    grads = type(model).tensors(model.grads)
    for name, parameter in reference.named_parameters():
        np.testing.assert_allclose(grads[name], parameter.grad.numpy(), rtol=1e-8, atol=1e-12, err_msg=name)


def test_the_export_is_phi3s_gguf_that_imports_back(phi3, tmp_path):
    variant, gguf_path, folder = phi3
    exported = export_gguf(folder, tmp_path / "out.gguf", "f32", progress=False)
    ours, source = read_gguf(exported), read_gguf(gguf_path)
    assert ours.metadata["general.architecture"] == "phi3"
    keys = ["phi3.rope.dimension_count", "phi3.attention.sliding_window",
            "phi3.rope.scaling.original_context_length"]
    for key in keys + ["phi3.rope.scaling.attn_factor"] * (variant == "longrope"):
        assert ours.metadata[key] == source.metadata[key], key
    assert ours.tensors.keys() == source.tensors.keys()
    for name, tensor in ours.tensors.items():
        np.testing.assert_array_equal(tensor.data, source.tensors[name].data, err_msg=name)
    back = import_gguf(exported, tmp_path / "back", progress=False)
    assert (back / "config.json").read_text() == (folder / "config.json").read_text()
    assert load_spec(back / "spec.toml").block == load_spec(folder / "spec.toml").block


# decoding and training compile each spec's package anew: once, on the windowed model, suffices
@pytest.mark.parametrize("phi3", ["windowed"], indirect=True)
def test_greedy_tokens_on_the_stored_weights_equal_transformers(phi3):
    from pyml.generate import decoding as generation

    _, _, folder = phi3
    tokenizer = load_tokenizer(folder)
    ids = tokenizer.encode("the capital of France is Paris, the capital of").ids
    decoder = generation.load_decoder(folder, weights="as-stored")
    ours = generation.generate(decoder, tokenizer, ids, 10, set(), out=None).new_ids
    with torch.no_grad():
        expected = reference_model(folder).generate(
            torch.tensor([ids]), max_new_tokens=10, do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    theirs = expected[0, len(ids):].tolist()
    # transformers stops at an end-of-sequence id (config.json's eos_token_id) where we were told
    # to go on: the same tokens up to there
    assert ours[:len(theirs)] == theirs
    assert len(theirs) == 10 or theirs[-1] == json.loads((folder / "config.json").read_text())["eos_token_id"]


@pytest.mark.parametrize("phi3", ["windowed"], indirect=True)
def test_a_folder_trains_full_and_with_lora_on_its_fused_projections(phi3, tmp_path):
    from pyml.train.run import train
    from tests.support.model_folders import tiny_text

    _, _, folder = phi3
    text = tiny_text(tmp_path / "text.txt")
    common = dict(init=folder, data=text, steps=2, batch=2, seq=16, eval_every=2, eval_batches=1,
                  checkpoint_every=2, progress=False)
    full = train(None, out=tmp_path / "full", **common)
    assert full.evaluations[-1]["loss"] < full.evaluations[0]["loss"]
    assert json.loads((full.checkpoint / "config.json").read_text())["model_type"] == "phi3"
    lora = train(None, out=tmp_path / "lora", lora_rank=2, lora_alpha=4.0,
                 lora_targets=["qkv", "gate_up"],
                 lr=1e-2, **common)
    assert lora.evaluations[-1]["loss"] < lora.evaluations[0]["loss"]
    adapter = json.loads((lora.checkpoint / "adapter_config.json").read_text())
    assert adapter["target_modules"] == ["gate_up_proj", "qkv_proj"]


def test_llama_cpp_runs_our_export_as_transformers_within_the_window(phi3, tmp_path):
    variant, _, folder = phi3
    # llama.cpp takes LongRoPE's long factors for its context of 64, transformers past ORIGINAL
    length = 3 * WINDOW if variant == "longrope" else WINDOW
    ids = np.random.default_rng(4).integers(3, VOCAB - 4, length).tolist()
    assert_llama_cpp_logits_equal_transformers(folder, tmp_path, ids)


def bad_factors(tensors: dict) -> dict:
    short = tensors["rope_factors_short.weight"]
    return tensors | {"rope_factors_short.weight": GGUFTensor(
        short.name, short.ggml_type, (3,), np.array([1.0, 1.0, -1.0], np.float32).view(np.uint8))}


@pytest.mark.parametrize("change, message", [
    (lambda t: {n: v for n, v in t.items() if n != "rope_factors_long.weight"},
     "rope_factors_long.weight is missing beside the other LongRoPE factors"),
    (bad_factors, r"rope_factors_short.weight is not 4 float32 values \(one per rotated frequency\)"),
])
@pytest.mark.parametrize("phi3", ["longrope"], indirect=True)
def test_longrope_factors_that_do_not_fit_are_refused_in_one_line(phi3, change, message):
    _, gguf_path, _ = phi3
    source = read_gguf(gguf_path)
    with pytest.raises(PymlError, match=message):
        architecture_of(GGUFFile(path=gguf_path, version=3, metadata=source.metadata,
                                 tensors=change(source.tensors)))


def test_a_spec_with_a_factor_per_frequency_too_few_is_refused():
    scaling = {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0, 2.0],
               "original_max_position_embeddings": 16, "attention_factor": 1.0}
    with pytest.raises(ValueError, match=r"one factor per rotated frequency \(4\), got 1 and 2"):
        Attention(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, rope={"scaling": scaling})
