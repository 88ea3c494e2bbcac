"""`pyml export-gguf`: a model folder written as a GGUF.

References, none of them ours: the gguf package (its reader for what the file holds, its
`quants.quantize` for the bytes of every quantised tensor), llama.cpp's converter (the permutation
and 1 + w it applies, restated in tests/support/model_folders.py, and the metadata it wrote into the two
shipped GGUFs), Hugging Face transformers loading the exported file (`gguf_file=`), and, where it
is installed, llama.cpp itself. Round trip: `pyml import-gguf` of the exported file gives the
folder back.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize as reference_quantize

from pyml.errors import PymlError
from pyml.formats.gguf_architectures import unpermute_rotary_rows
from pyml.formats.gguf_export import export_gguf
from pyml.formats.gguf_import import import_gguf
from pyml.formats.gguf_read import read_gguf
from pyml.weight_formats import GGMLType, quantize
from pyml.formats.safetensors_io import write_safetensors
from pyml.formats.stored_tensors import StoredFolder
from tests.support.model_folders import GEMMA, LLAMA, llama_cpp_permute, tiny_folder, write_gguf, transformers_folder

TYPES = ["f32", "f16", "q8_0", "q4_0", "q4_1"]
GGML_TYPE = {"f32": GGMLType.F32, "f16": GGMLType.F16, "q8_0": GGMLType.Q8_0,
             "q4_0": GGMLType.Q4_0, "q4_1": GGMLType.Q4_1}  # fmt: skip
FOLDER_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja"]  # fmt: skip
PROMPT = "The capital of France is"


def transformers_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def gguf_value(architecture: str, hf_name: str, weight: np.ndarray, dims: dict) -> np.ndarray:
    """What llama.cpp's converter stores for a Hugging Face tensor (tests/support/model_folders.py)."""
    if architecture == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = dims["heads"] if hf_name.endswith("q_proj.weight") else dims["kv_heads"]
        return llama_cpp_permute(weight, heads)
    if architecture == "gemma3" and hf_name.endswith("norm.weight"):
        return weight + np.float32(1)
    return weight


GGUF_NAMES = {
    "embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}  # fmt: skip


def gguf_name(architecture: str, hf_name: str) -> str:
    if not hf_name.startswith("model.layers."):
        return GGUF_NAMES[hf_name.removeprefix("model.")]
    _, _, layer, within = hf_name.split(".", 3)
    if within == "post_attention_layernorm.weight":  # llama: before the MLP; gemma3: after attention
        within = "ffn_norm.weight" if architecture == "llama" else "post_attention_norm.weight"
        return f"blk.{layer}.{within}"
    if architecture == "gemma3" and within == "pre_feedforward_layernorm.weight":
        return f"blk.{layer}.ffn_norm.weight"
    return f"blk.{layer}.{GGUF_NAMES[within]}"


# -- the quantisers


@pytest.mark.parametrize("kind", [GGMLType.F16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1])
def test_quantisers_give_the_bytes_of_gguf_quants(kind):
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((48, 128)) * rng.uniform(1e-3, 4, (48, 1))).astype(np.float32)
    weight[0, :32] = 0  # a block of zeros: scale 0
    weight[1, :32] = 3  # a constant block: max = min
    weight[2, :32] = -1
    weight[2, 7] = 1  # |max| twice, of both signs: the first one counts
    weight[3, :32] = np.linspace(-1, 1, 32) * np.float32(0.49999997)  # roundf at its edge
    weight[4, :32] = np.arange(32) - 15.5  # halves: away from zero
    ours = quantize(weight, kind)
    theirs = reference_quantize(weight, gguf.GGMLQuantizationType(int(kind)))
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    assert np.array_equal(ours.view(np.uint8), theirs.view(np.uint8))


# -- tiny models of both families


@pytest.fixture(scope="module")
def exports(tiny_folders, tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("exports")
    return {
        (architecture, kind): export_gguf(folder, root / f"{architecture}-{kind}.gguf", kind,
                                          progress=False)
        for architecture, folder in tiny_folders.items() for kind in TYPES
    }  # fmt: skip


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
@pytest.mark.parametrize("kind", TYPES)
def test_tensors_are_gguf_quants_of_the_converter_values(tiny_folders, exports, architecture, kind):
    dims = LLAMA if architecture == "llama" else GEMMA
    weights = StoredFolder(tiny_folders[architecture]).dense_tensors()
    reader = gguf.GGUFReader(exports[architecture, kind])
    stored = {tensor.name: tensor for tensor in reader.tensors}
    assert set(stored) == {gguf_name(architecture, name) for name in weights}
    for hf_name, weight in weights.items():
        tensor = stored[gguf_name(architecture, hf_name)]
        expected_type = GGMLType.F32 if weight.ndim == 1 else GGML_TYPE[kind]  # norms stay f32
        assert tensor.tensor_type == int(expected_type), hf_name
        expected = reference_quantize(
            gguf_value(architecture, hf_name, weight, dims), gguf.GGMLQuantizationType(int(expected_type))
        )
        assert np.array_equal(tensor.data.view(np.uint8), expected.view(np.uint8)), hf_name


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
@pytest.mark.parametrize("kind", TYPES)
def test_importing_the_export_gives_the_folder_back(
    tiny_folders, exports, tmp_path, architecture, kind
):
    folder = tiny_folders[architecture]
    dims = LLAMA if architecture == "llama" else GEMMA
    again = import_gguf(exports[architecture, kind], tmp_path / "again", progress=False)
    for name in FOLDER_FILES:
        assert (folder / name).is_file() == (again / name).is_file(), name
        if (folder / name).is_file():
            assert (again / name).read_bytes() == (folder / name).read_bytes(), name
    ours, back = StoredFolder(folder).dense_tensors(), StoredFolder(again).dense_tensors()
    assert set(back) == set(ours)
    for name, weight in ours.items():
        if architecture == "gemma3" and name.endswith("norm.weight"):
            # the file holds 1 + w in float32, the importer subtracts 1 again, as transformers does
            assert np.array_equal(back[name], (weight + np.float32(1)) - np.float32(1)), name
        elif kind == "f32" or weight.ndim == 1:
            assert np.array_equal(back[name], weight), name
        else:
            kind_type = gguf.GGMLQuantizationType(int(GGML_TYPE[kind]))
            value = gguf_value(architecture, name, weight, dims)
            decoded = reference_dequantize(reference_quantize(value, kind_type), kind_type)
            if architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = dims["heads"] if name.endswith("q_proj.weight") else dims["kv_heads"]
                decoded = unpermute_rotary_rows(decoded.reshape(value.shape), heads)
            assert np.array_equal(back[name], decoded.reshape(weight.shape)), name


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
@pytest.mark.parametrize("kind", TYPES)
def test_transformers_reads_the_tensors_we_read(exports, tmp_path, architecture, kind):
    path = exports[architecture, kind]
    theirs = transformers_from_gguf(path).state_dict()
    ours = StoredFolder(import_gguf(path, tmp_path / "ours", progress=False)).dense_tensors()
    assert set(ours) | {"lm_head.weight"} == set(theirs)
    for name, weight in ours.items():
        assert np.array_equal(theirs[name].numpy(), weight), name


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_transformers_gives_the_logits_of_the_folder(tiny_folders, exports, architecture):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, path = tiny_folders[architecture], exports[architecture, "f32"]
    ids = AutoTokenizer.from_pretrained(folder)(PROMPT, return_tensors="pt").input_ids
    gguf_ids = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)(
        PROMPT, return_tensors="pt"
    ).input_ids
    assert gguf_ids.tolist() == ids.tolist()
    reference = AutoModelForCausalLM.from_pretrained(transformers_folder(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(ids).logits
        logits = transformers_from_gguf(path)(ids).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_rows_of_no_whole_block_are_stored_as_f16(tmp_path):
    folder = tiny_folder(tmp_path, "gemma3", GEMMA | {"hidden": 80})  # rows of 80 are no Q8_0 rows
    reader = gguf.GGUFReader(export_gguf(folder, tmp_path / "tiny.gguf", "q8_0", progress=False))
    types = {tensor.name: GGMLType(tensor.tensor_type) for tensor in reader.tensors}
    assert types["blk.0.attn_q.weight"] == GGMLType.F16  # (512, 80)
    assert types["blk.0.ffn_down.weight"] == GGMLType.Q8_0  # (80, 96)
    assert types["blk.0.attn_norm.weight"] == GGMLType.F32


def test_metadata_keys_and_their_types(exports):
    reader = gguf.GGUFReader(exports["llama", "q8_0"])
    fields = reader.fields
    assert fields["general.architecture"].contents() == "llama"
    assert fields["general.file_type"].contents() == 7  # LLAMA_FTYPE_MOSTLY_Q8_0
    assert fields["general.quantization_version"].contents() == gguf.GGML_QUANT_VERSION
    assert fields["llama.block_count"].types == [gguf.GGUFValueType.UINT32]
    assert fields["llama.rope.freq_base"].types == [gguf.GGUFValueType.FLOAT32]
    assert fields["tokenizer.ggml.token_type"].types == [gguf.GGUFValueType.ARRAY,
                                                          gguf.GGUFValueType.INT32]  # fmt: skip
    gemma = gguf.GGUFReader(exports["gemma3", "f32"]).fields
    assert gemma["tokenizer.ggml.scores"].types == [gguf.GGUFValueType.ARRAY,
                                                     gguf.GGUFValueType.FLOAT32]  # fmt: skip
    assert "tokenizer.ggml.merges" not in gemma and "tokenizer.ggml.scores" not in fields


# -- where the model comes from: the source GGUF's general.* keys

GENERAL = {
    "general.name": "Tiny Llama 1M Instruct", "general.basename": "Tiny-Llama",
    "general.size_label": "1M", "general.finetune": "Instruct", "general.license": "apache-2.0",
    "general.organization": "Example Org", "general.repo_url": "https://example.org/tiny-llama",
    "general.quantized_by": "someone", "general.base_model.count": 1,
    "general.base_model.0.name": "Tiny Llama 1M", "general.tags": ["text-generation", "tiny"],
}  # fmt: skip


def general_fields(path: Path) -> dict[str, object]:
    return {name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()
            if name.startswith("general.")}


def test_the_source_general_metadata_is_carried_over_and_a_fine_tune_names_its_base(tmp_path):
    """As imported, the folder exports the source's general.* keys as they were (but who quantized
    it); a fine-tune (here the folder without the source GGUF, as a checkpoint or a merged LoRA
    is) is named after the source with a suffix, the source becoming its base model."""
    write_gguf(tmp_path / "source.gguf", "llama", LLAMA, general=GENERAL)
    folder = import_gguf(tmp_path / "source.gguf", tmp_path / "imported", progress=False)
    exported = general_fields(export_gguf(folder, tmp_path / "imported.gguf", "q8_0", progress=False))
    carried = {key: value for key, value in GENERAL.items() if key != "general.quantized_by"}
    assert {key: exported[key] for key in carried} == carried
    assert "general.quantized_by" not in exported and exported["general.file_type"] == 7

    fine_tune = copy_folder(folder, tmp_path / "fine-tune")
    (fine_tune / "source.gguf").unlink()
    write_safetensors(fine_tune / "model.safetensors", StoredFolder(folder).dense_tensors())
    exported = general_fields(export_gguf(fine_tune, tmp_path / "fine-tune.gguf", "q8_0", progress=False))
    assert exported["general.name"] == "Tiny Llama 1M Instruct (fine-tune)"
    for key in ("general.basename", "general.size_label", "general.finetune", "general.license",
                "general.tags"):
        assert exported[key] == GENERAL[key], key
    assert exported["general.base_model.count"] == 1
    assert exported["general.base_model.0.name"] == "Tiny Llama 1M Instruct"
    assert exported["general.base_model.0.organization"] == "Example Org"
    assert exported["general.base_model.0.repo_url"] == "https://example.org/tiny-llama"
    assert "general.organization" not in exported and "general.repo_url" not in exported


def test_a_folder_without_the_source_metadata_is_named_after_itself(tiny_folders, tmp_path):
    folder = copy_folder(tiny_folders["llama"], tmp_path / "my-model")
    (folder / "gguf_general.json").unlink()
    exported = general_fields(export_gguf(folder, tmp_path / "my-model.gguf", "f32", progress=False))
    assert exported["general.name"] == "my-model"


def test_a_k_quant_export_says_how_many_tensors_fell_back(tiny_folders, tmp_path):
    """The tiny rows are no whole number of 256-value blocks: each matrix falls back, as
    llama-quantize's would, but the output (the tied embedding), which the mix puts in Q8_0."""
    out = tmp_path / "model.gguf"
    run = pyml("export-gguf", str(tiny_folders["llama"]), "--out", str(out), "--type", "q4_k_m")
    assert run.returncode == 0, run.stderr
    tensors = gguf.GGUFReader(out).tensors
    matrices = [tensor for tensor in tensors if len(tensor.shape) == 2]
    fell_back = [tensor for tensor in matrices if tensor.name != "token_embd.weight"]
    assert fell_back and all(tensor.tensor_type != gguf.GGMLQuantizationType.Q4_K for tensor in matrices)
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith(f"model.gguf: {len(fell_back)} of {len(tensors)} tensors fell back to "
                           "another type"), line


# -- bad input: one line, exit 2, nothing written


def pyml(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyml.cli", *args], capture_output=True,
                          text=True, cwd=cwd)  # fmt: skip


def copy_folder(folder: Path, to: Path) -> Path:
    to.mkdir()
    for path in folder.iterdir():
        (to / path.name).write_bytes(path.read_bytes())
    return to


def without(tensors: dict, name: str) -> dict:
    return {key: value for key, value in tensors.items() if key != name}


@pytest.mark.parametrize("change, message", [
    (lambda config, tensors: (config | {"intermediate_size": 128}, tensors),
     r"tensor model\.layers\.0\.mlp\.gate_proj\.weight has shape \(64, 32\); config\.json's model "
     r"has \(128, 32\)"),
    (lambda config, tensors: (config | {"num_hidden_layers": 3}, tensors),
     r"lacks model\.layers\.2\.input_layernorm\.weight"),
    (lambda config, tensors: (config, without(tensors, "model.norm.weight")), r"lacks model\.norm\.weight"),
    (lambda config, tensors: (config, tensors | {"lm_head.weight": tensors["model.embed_tokens.weight"]}),
     r"holds lm_head\.weight, which config\.json's model does not have"),
    (lambda config, tensors: (config | {"rope_theta": "fast"}, tensors), r"rope_theta is 'fast', not a float"),
    (lambda config, tensors: (config | {"model_type": "mistral"}, tensors),
     r"model_type 'mistral' cannot be exported"),
    (lambda config, tensors: (config | {"hidden_act": "gelu"}, tensors),
     r"hidden_act is 'gelu'; a llama GGUF says 'silu'"),
])  # fmt: skip
def test_a_folder_that_is_not_its_config_is_refused(tiny_folders, tmp_path, change, message):
    folder = copy_folder(tiny_folders["llama"], tmp_path / "bad")
    config = json.loads((folder / "config.json").read_text())
    config, tensors = change(config, StoredFolder(folder).dense_tensors())
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "source.gguf").unlink()  # the weights as a checkpoint holds them, changed
    write_safetensors(folder / "model.safetensors", tensors)
    with pytest.raises(PymlError, match=message):
        export_gguf(folder, tmp_path / "out" / "model.gguf", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_gguf_cannot_hold_is_refused(tiny_folders, tmp_path):
    folder = copy_folder(tiny_folders["llama"], tmp_path / "bad")
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["normalizer"] = {"type": "Lowercase"}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(PymlError, match="describes a tokenizer GGUF metadata cannot hold"):
        export_gguf(folder, tmp_path / "model.gguf", progress=False)


@pytest.mark.parametrize("args, message", [
    (["--type", "q3_k_m"], r"^error: --type 'q3_k_m' is not one pyml writes \(only f32, f16, q8_0, q4_0, q4_1, "
                           r"q4_k_m, q5_k_m, q6_k, as-stored\)$"),
    ([], r"^error: .*config\.json: missing; export a folder written by `pyml import-gguf`"),
])  # fmt: skip
def test_cli_refuses_bad_input_in_one_line(tiny_folders, tmp_path, args, message):
    folder = tiny_folders["llama"] if args else tmp_path / "empty"
    folder.mkdir(exist_ok=True)
    out = tmp_path / "written"
    out.mkdir()
    run = pyml("export-gguf", str(folder), "--out", str(out / "model.gguf"), *args)
    assert run.returncode == 2
    assert len(run.stderr.strip().splitlines()) == 1 and run.stdout == ""
    assert re.match(message, run.stderr.strip()), run.stderr
    assert list(out.iterdir()) == []


def test_cli_writes_the_file_with_a_progress_bar_on_stderr(tiny_folders, tmp_path):
    out = tmp_path / "model.gguf"
    run = pyml("export-gguf", str(tiny_folders["gemma3"]), "--out", str(out), "--type", "q4_0")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"wrote {out}"
    assert "writing model.gguf" in run.stderr and "tensor" in run.stderr
    assert read_gguf(out).metadata["general.file_type"] == 2  # LLAMA_FTYPE_MOSTLY_Q4_0
    assert [path.name for path in tmp_path.iterdir()] == ["model.gguf"]  # no temporary left


# -- the shipped models, fine-tuned a step (tests/conftest.py): metadata as llama.cpp's converter
# wrote it into the shipped GGUFs (the metadata does not change with the weights)


# What the shipped files hold that a model folder does not (where they came from, what they were
# quantised to), and what we write that their converter did not yet (key_length, which the
# converter now writes whenever config.json has head_dim; add_eos_token, which it writes when
# tokenizer_config.json has it).
PROVENANCE = ("general.", "tokenizer.ggml.add_sep_token")
WRITTEN_SINCE = ("llama.attention.key_length", "llama.attention.value_length",
                 "tokenizer.ggml.add_eos_token")  # fmt: skip


def assert_metadata_as_shipped(exported: Path, shipped: Path) -> None:
    ours, theirs = read_gguf(exported).metadata, read_gguf(shipped).metadata
    compared = {key for key in theirs if not key.startswith(PROVENANCE)} - {"tokenizer.ggml.scores"}
    # general.* is checked on its own (test_the_source_general_metadata_is_carried_over_...)
    assert {key for key in ours if not key.startswith(PROVENANCE)} - set(theirs) <= set(WRITTEN_SINCE)
    for key in compared:
        if isinstance(theirs[key], np.ndarray):
            assert np.array_equal(ours[key], theirs[key]), key
        else:
            assert ours[key] == theirs[key], key
    if "tokenizer.ggml.scores" in theirs:
        # the normal tokens in the same order of score: llama.cpp merges them in the same order
        kinds = theirs["tokenizer.ggml.token_type"]
        normal = np.flatnonzero(kinds == 1)
        order = lambda scores: normal[np.argsort(-scores[normal], kind="stable")]  # noqa: E731
        assert np.array_equal(order(ours["tokenizer.ggml.scores"]), order(theirs["tokenizer.ggml.scores"]))
        other = kinds != 1
        assert np.array_equal(ours["tokenizer.ggml.scores"][other], theirs["tokenizer.ggml.scores"][other])


@pytest.mark.slow
def test_smollm2_export_holds_the_metadata_of_the_shipped_gguf(smollm2_export):
    from pyml.formats.smollm2_gguf import shipped_gguf_path

    assert_metadata_as_shipped(smollm2_export, shipped_gguf_path())


@pytest.mark.slow
def test_gemma3_export_holds_the_metadata_of_the_shipped_gguf(gemma3_export):
    from pyml.formats.gemma3_gguf import shipped_gguf_path

    assert_metadata_as_shipped(gemma3_export, shipped_gguf_path())
