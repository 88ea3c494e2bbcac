"""Llama GGUFs with RoPE scaling (Llama 3.x's "llama3", and "linear") imported, trained and exported.

Each GGUF is written as llama.cpp's converter writes one (tests/support/model_folders.py): a linear
scaling as `rope.scaling.type` and `rope.scaling.factor`, Llama 3's as nothing but the factor of
each frequency in a `rope_freqs.weight` tensor, computed by the converter's own code. References:
transformers' LlamaForCausalLM on our folder (its own rope_scaling code, float32, and in float64
for the loss and every gradient), its rope initialisation functions for the frequencies, and the
gguf reader and transformers' GGUF loader on our export.
"""

import json
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing from a hub

import numpy as np
import pytest
import torch

from pyml.errors import PymlError
from pyml.formats.gguf_architectures import Metadata, architecture_of, llama3_scaling_of
from pyml.formats.gguf_export import export_gguf
from pyml.formats.gguf_import import import_gguf
from pyml.formats.gguf_read import GGUFFile, read_gguf
from pyml.formats.stored_tensors import StoredFolder
from pyml.generate.decoding import load_model, load_tokenizer
from pyml.package.cpu.rope import scaled_frequencies
from pyml.spec import load_spec
from tests.support.hf_reference import compute_in_float64
from tests.support.llama_cpp_reference import assert_llama_cpp_logits_equal_transformers
from tests.support.model_folders import LLAMA, converter_rope_factors, write_gguf, transformers_folder

# heads of 32 (16 frequencies), so that two fall between Llama 3's bands, as in every Llama 3
SCALED = LLAMA | {"head_dim": 32}
THETA = 50000.0  # llama_tiny's, which write_gguf gives every llama
SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "linear": {"rope_type": "linear", "factor": 4.0},
}
# Llama 3.1 8B's and Llama 3.2 1B's scaling, as their config.json state it
LLAMA_31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
LLAMA_32 = LLAMA_31 | {"factor": 32.0}


@pytest.fixture(scope="module", params=list(SCALINGS))
def scaled(request, tmp_path_factory):
    """(the scaling's name, the GGUF, the folder `pyml import-gguf` made of it)."""
    root = tmp_path_factory.mktemp(f"rope-{request.param}")
    gguf_path = root / f"tiny-{request.param}.gguf"
    write_gguf(gguf_path, "llama", SCALED, SCALINGS[request.param])
    return request.param, gguf_path, import_gguf(gguf_path, root / f"tiny-{request.param}", progress=False)


def spec_form(scaling: dict) -> dict:
    return {"type": scaling["rope_type"]} | {k: v for k, v in scaling.items() if k != "rope_type"}


def test_the_folder_states_the_scaling_in_its_spec_and_config(scaled):
    name, _, folder = scaled
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_scaling"] == SCALINGS[name] and config["head_dim"] == 32
    rope = load_spec(folder / "spec.toml").block.attention.rope
    assert rope.theta == THETA and rope.scaling.model_dump() == spec_form(SCALINGS[name])
    assert "rope_freqs.weight" not in str(StoredFolder(folder).dense_tensors().keys())


def test_logits_equal_transformers_scaling_its_rotary_frequencies(scaled):
    from transformers import AutoModelForCausalLM

    _, _, folder = scaled
    reference = AutoModelForCausalLM.from_pretrained(transformers_folder(folder), dtype=torch.float32).eval()
    assert reference.config.rope_parameters["rope_type"] == scaled[0]
    ids = np.random.default_rng(0).integers(0, 96, (2, 48))  # positions past every band's edge
    with torch.no_grad():
        expected = reference(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(load_model(folder).forward(ids), expected, rtol=1e-4, atol=1e-5)


def test_loss_and_every_gradient_equal_transformers_in_float64(scaled, monkeypatch):
    from transformers import AutoModelForCausalLM

    name, _, folder = scaled
    config = json.loads((folder / "config.json").read_text())
    compute_in_float64(monkeypatch, config["head_dim"], config["rope_theta"], scaling=spec_form(SCALINGS[name]))
    reference = AutoModelForCausalLM.from_pretrained(transformers_folder(folder), dtype=torch.float64, attn_implementation="sdpa")
    model = load_model(folder, dtype=np.float64)
    ids = np.random.default_rng(1).integers(0, 96, (2, 41))
    ids[ids == config["pad_token_id"]] = 50  # transformers' padding_idx row is never trained
    loss = model.loss_and_grads(ids[:, :-1], ids[:, 1:])
    logits = reference(torch.tensor(ids[:, :-1])).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 96), torch.tensor(ids[:, 1:]).reshape(-1))
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-12)
    grads = type(model).tensors(model.grads)
    for parameter_name, parameter in reference.named_parameters():
        np.testing.assert_allclose(grads[parameter_name], parameter.grad.numpy(), rtol=1e-8, atol=1e-12,
                                   err_msg=parameter_name)


def test_the_export_stores_the_scaling_as_llama_cpp_and_imports_back(scaled, tmp_path):
    from transformers import AutoModelForCausalLM

    name, gguf_path, folder = scaled
    exported = export_gguf(folder, tmp_path / "out.gguf", "f32", progress=False)
    ours, source = read_gguf(exported), read_gguf(gguf_path)
    if name == "linear":
        assert ours.metadata["llama.rope.scaling.type"] == "linear"
        assert ours.metadata["llama.rope.scaling.factor"] == 4.0 and "rope_freqs.weight" not in ours.tensors
    else:  # the converter's factors, byte for byte
        assert "llama.rope.scaling.type" not in ours.metadata
        np.testing.assert_array_equal(ours.tensors["rope_freqs.weight"].data,
                                      source.tensors["rope_freqs.weight"].data)
    back = import_gguf(exported, tmp_path / "back", progress=False)
    assert (back / "config.json").read_text() == (folder / "config.json").read_text()
    assert load_spec(back / "spec.toml").block == load_spec(folder / "spec.toml").block
    # transformers' GGUF loader reads the weights as ours (it takes no RoPE scaling from a llama
    # GGUF, neither key nor tensor, so its logits are not compared)
    reference = AutoModelForCausalLM.from_pretrained(exported.parent, gguf_file=exported.name, dtype=torch.float32)
    theirs = reference.state_dict()
    for tensor_name, tensor in StoredFolder(folder).dense_tensors().items():
        np.testing.assert_array_equal(tensor, theirs[tensor_name].numpy(), err_msg=tensor_name)


def test_llama_cpp_runs_our_export_with_the_scaling_as_transformers(scaled, tmp_path):
    """llama.cpp's logits on our export for 40 positions, past every band's edge, against
    LlamaForCausalLM's on the folder."""
    _, _, folder = scaled
    assert_llama_cpp_logits_equal_transformers(folder, tmp_path, np.random.default_rng(4).integers(3, 96, 40).tolist())


# decoding and training compile each spec's package anew: once, on the llama3-scaled model, suffices
@pytest.mark.parametrize("scaled", ["llama3"], indirect=True)
def test_greedy_tokens_on_the_stored_weights_equal_transformers(scaled):
    from transformers import AutoModelForCausalLM

    from pyml.generate import decoding as generation

    _, _, folder = scaled
    tokenizer = load_tokenizer(folder)
    ids = tokenizer.encode("the capital of France is Paris, and the capital of Italy is").ids
    decoder = generation.load_decoder(folder, weights="as-stored")
    ours = generation.generate(decoder, tokenizer, ids, 12, set(), out=None).new_ids
    reference = AutoModelForCausalLM.from_pretrained(transformers_folder(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                      attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert ours == expected[0, len(ids):].tolist()


@pytest.mark.parametrize("scaled", ["llama3"], indirect=True)
def test_a_scaled_folder_trains_and_its_checkpoint_keeps_the_scaling(scaled, tmp_path):
    from pyml.train.run import train
    from tests.support.model_folders import tiny_text

    name, _, folder = scaled
    result = train(None, init=folder, data=tiny_text(tmp_path / "text.txt"), steps=2, batch=2, seq=16,
                   eval_every=2, eval_batches=1, checkpoint_every=2, out=tmp_path / "run", progress=False)
    assert result.evaluations[-1]["loss"] < result.evaluations[0]["loss"]
    assert json.loads((result.checkpoint / "config.json").read_text())["rope_scaling"] == SCALINGS[name]


@pytest.mark.parametrize("scaling", [LLAMA_31, LLAMA_32, SCALINGS["linear"]], ids=["3.1", "3.2", "linear"])
@pytest.mark.parametrize("head_dim, theta", [(64, 500000.0), (128, 500000.0), (32, THETA)])
def test_scaled_frequencies_equal_transformers(scaling, head_dim, theta):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=131072,
                         rope_parameters=scaling | {"rope_theta": theta})
    expected, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config)
    exponents = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1) / (theta ** exponents.astype(np.float64)).astype(np.float32)
    np.testing.assert_allclose(scaled_frequencies(inv_freq, spec_form(scaling)), expected.numpy(),
                               rtol=2e-7, atol=0)


def described(metadata: dict, tensors: dict | None = None) -> GGUFFile:
    return GGUFFile(path=Path("model.gguf"), version=3, metadata=metadata, tensors=tensors or {})


@pytest.mark.parametrize("scaling, head_dim, theta",
                         [(LLAMA_31, 128, 500000.0), (LLAMA_32, 64, 500000.0), (SCALINGS["llama3"], 32, THETA)])
def test_llama3_parameters_are_recovered_from_the_converters_factors(scaling, head_dim, theta):
    factors = converter_rope_factors(scaling, head_dim, theta)
    assert llama3_scaling_of(factors, head_dim, theta, Metadata(described({}), "llama")) == spec_form(scaling)


@pytest.mark.parametrize("change, message", [
    (lambda f: f * np.float32(1.5), "is not Llama 3's RoPE scaling"),
    (lambda f: f[::-1].copy(), "is not Llama 3's RoPE scaling"),
    (lambda f: np.where(f > 1, np.float32(np.nan), f), "not positive numbers"),
])
def test_factors_that_are_not_llama3s_are_refused(change, message):
    factors = change(converter_rope_factors(LLAMA_32, 64, 500000.0))
    with pytest.raises(PymlError, match=message):
        llama3_scaling_of(factors, 64, 500000.0, Metadata(described({}), "llama"))


def test_a_scaling_pyml_lacks_is_refused_in_one_line(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", SCALED)
    source = read_gguf(path)
    metadata = source.metadata | {"llama.rope.scaling.type": "yarn"}
    with pytest.raises(PymlError, match=r"rope scaling is not supported \(llama.rope.scaling.type is 'yarn'\)"):
        architecture_of(described(metadata, source.tensors))


# LongRoPE factors of Phi-3.5 mini's kind (short ones near 1, long ones up to about 48), written as
# its config.json writes them: float32 values in full
PHI35_SHORT = [1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705,
               1.0799999237060547, 1.0799999237060547, 1.0799999237060547, 1.0799999237060547]
PHI35_LONG = [1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601,
              47.77000045776367, 48.0099983215332, 48.0099983215332, 48.770000457763672]


@pytest.mark.parametrize("max_seq_len", [16, 17, 64], ids=["short", "just-past", "long"])
def test_longrope_tables_equal_phi3_rotary_embedding_over_as_many_positions(max_seq_len):
    """transformers chooses LongRoPE's factors by the length of the sequence it runs, pyml by the
    model's max_seq_len: a model of L positions has the tables transformers computes for a
    sequence of L positions, short factors up to the original context (16 here), long beyond."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from pyml.package.cpu.rope import rope_tables

    head_dim, theta = 2 * len(PHI35_SHORT), 10000.0
    scaling = {"rope_type": "longrope", "short_factor": PHI35_SHORT, "long_factor": PHI35_LONG}
    config = Phi3Config(hidden_size=head_dim * 2, num_attention_heads=2, max_position_embeddings=64,
                        original_max_position_embeddings=16, rope_scaling=scaling | {"rope_theta": theta})
    with torch.no_grad():
        expected_cos, expected_sin = Phi3RotaryEmbedding(config)(
            torch.zeros(1, dtype=torch.float32), torch.arange(max_seq_len)[None])
    attention_factor = float(np.float32((1 + np.log(4) / np.log(16)) ** 0.5))  # transformers' default
    cos = np.zeros((max_seq_len, head_dim // 2), np.float32)
    sin = np.zeros_like(cos)
    rope_tables(cos, sin, theta, {"type": "longrope", "short_factor": PHI35_SHORT, "long_factor": PHI35_LONG,
                                  "original_max_position_embeddings": 16,
                                  "attention_factor": attention_factor})
    np.testing.assert_allclose(cos, expected_cos[0, :, : head_dim // 2].numpy(), rtol=0, atol=3e-7)
    np.testing.assert_allclose(sin, expected_sin[0, :, : head_dim // 2].numpy(), rtol=0, atol=3e-7)
