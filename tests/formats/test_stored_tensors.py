"""A folder's weights as they are stored (`StoredFolder`): views of the file's memory map, and their
dense values the same as the readers we trust give.

References: for a GGUF, `load_gguf_tensors` (checked against transformers in the import tests),
bit for bit, on llama (Q and K rows stored permuted), gemma3 (norm gains stored as 1 + w) and a
llama exported as Q8_0; for safetensors, the safetensors library's own reader, single file and
sharded, in bf16, f16, f32 and f64. Then every bad input, one PymlError line each.
"""

import json
import mmap
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pyml.errors import PymlError
from pyml.formats.gguf_export import export_gguf
from pyml.formats.gguf_import import load_gguf_tensors
from pyml.weight_formats import GGMLType
from pyml.formats.stored_tensors import StoredFolder
from tests.support.model_folders import GEMMA, LLAMA, tiny_folder, write_gguf


def gguf_folder(root: Path, gguf_path: Path, link: bool = True) -> Path:
    folder = root / "folder"
    folder.mkdir()
    if link:
        (folder / "source.gguf").symlink_to(gguf_path.resolve())
    else:
        shutil.copyfile(gguf_path, folder / "source.gguf")
    return folder


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def maps_the_file(array: np.ndarray) -> bool:
    """Whether `array` is a view whose memory is a file's memory map (no copy)."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return isinstance(base, mmap.mmap)


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_gguf_dense_tensors_equal_the_importers_bit_for_bit(tmp_path, architecture):
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(gguf_path, architecture, GEMMA if architecture == "gemma3" else LLAMA)
    stored = StoredFolder(gguf_folder(tmp_path, gguf_path))
    expected = load_gguf_tensors(gguf_path)
    assert stored.tensors.keys() == expected.keys()
    for name, tensor in stored.tensors.items():
        assert same_bits(tensor.dense(), expected[name]), name
        assert tensor.shape == expected[name].shape and tensor.ggml_type == GGMLType.F32
        assert maps_the_file(tensor.data) and not tensor.data.flags.writeable, name
    assert stored.dense_tensors().keys() == expected.keys()
    assert stored.describe().startswith("source.gguf (F32, ")


def test_llama_q_and_k_rows_are_stored_permuted_and_row_order_finds_them(tmp_path):
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(gguf_path, "llama", LLAMA)
    stored = StoredFolder(gguf_folder(tmp_path, gguf_path, link=False))
    permuted = [name for name, tensor in stored.tensors.items() if tensor.row_order is not None]
    assert sorted(permuted) == sorted(
        f"model.layers.{layer}.self_attn.{kind}_proj.weight"
        for layer in range(LLAMA["layers"]) for kind in "qk"
    )  # fmt: skip
    for tensor in stored.tensors.values():
        rows = tensor.data.view("<f4").reshape(tensor.shape)
        in_order = rows if tensor.row_order is None else rows[tensor.row_order]
        assert same_bits(in_order, tensor.dense())
        assert tensor.row_bytes == 4 * tensor.shape[-1]


def test_a_quantized_gguf_is_read_as_stored(tmp_path):
    folder = tiny_folder(tmp_path, "llama")
    q8_path = tmp_path / "tiny-q8.gguf"
    export_gguf(folder, q8_path, "q8_0", progress=False)
    stored = StoredFolder(gguf_folder(tmp_path, q8_path))
    expected = load_gguf_tensors(q8_path)
    for name, tensor in stored.tensors.items():
        assert same_bits(tensor.dense(), expected[name]), name
        assert same_bits(tensor.dense(np.float64), expected[name].astype(np.float64)), name
    projection = stored.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert projection.ggml_type == GGMLType.Q8_0 and projection.row_order is not None
    assert projection.row_bytes == projection.shape[1] // 32 * 34
    assert projection.data.size == projection.shape[0] * projection.row_bytes
    assert stored.describe().startswith("source.gguf (Q8_0, F32, ")


# -- safetensors, against the safetensors library


def hf_tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    shapes = {"model.embed_tokens.weight": (11, 8), "model.norm.weight": (8,),
              "model.layers.0.mlp.down_proj.weight": (8, 24), "lm_head.weight": (11, 8)}  # fmt: skip
    return {name: torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
            for name, shape in shapes.items()}  # fmt: skip


DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


@pytest.mark.parametrize("kind", DTYPES)
def test_single_safetensors_file_equals_the_safetensors_reader(tmp_path, kind):
    save_file(hf_tensors(DTYPES[kind]), tmp_path / "model.safetensors", metadata={"format": "pt"})
    stored = StoredFolder(tmp_path)
    reference = load_file(tmp_path / "model.safetensors")
    assert stored.tensors.keys() == reference.keys()
    for name, tensor in stored.tensors.items():
        assert tensor.ggml_type == GGMLType[kind] and tensor.row_order is None
        assert maps_the_file(tensor.data)
        wide = np.float64 if kind == "F64" else np.float32
        assert same_bits(tensor.dense(wide), reference[name].to(torch.float64).numpy().astype(wide))
    assert stored.describe().startswith(f"model.safetensors ({kind}, ")


def sharded_folder(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Hugging Face's sharded layout: two shards and the index naming each tensor's."""
    tensors = hf_tensors(dtype)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for shard, held in shards.items():
        save_file({name: tensors[name] for name in held}, folder / shard, metadata={"format": "pt"})
    weight_map = {name: shard for shard, held in shards.items() for name in held}
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return tensors


@pytest.mark.parametrize("kind", ["BF16", "F16", "F32"])
def test_sharded_safetensors_equal_the_safetensors_reader(tmp_path, kind):
    tensors = sharded_folder(tmp_path, DTYPES[kind])
    stored = StoredFolder(tmp_path)
    assert stored.tensors.keys() == tensors.keys()
    for name, tensor in stored.tensors.items():
        assert maps_the_file(tensor.data)
        assert same_bits(tensor.dense(), tensors[name].to(torch.float32).numpy())
    assert stored.describe().startswith(f"model.safetensors.index.json ({kind}, 2 shards, ")


# -- bad input


def refused(folder: Path, *parts: str) -> None:
    with pytest.raises(PymlError) as error:
        StoredFolder(folder)
    message = str(error.value)
    assert "\n" not in message and all(part in message for part in parts), message


def test_a_folder_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    refused(tmp_path, "holds no weights", "source.gguf", "model.safetensors")
    refused(tmp_path / "nowhere", "no such folder")


def test_a_gguf_moved_away_from_its_link_is_refused(tmp_path):
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(gguf_path, "llama", LLAMA)
    folder = gguf_folder(tmp_path, gguf_path)
    gguf_path.rename(tmp_path / "elsewhere.gguf")
    refused(folder, "source.gguf: the GGUF it points to", str(gguf_path.resolve()),
            "is missing", "import it again")


def test_a_truncated_gguf_is_refused(tmp_path):
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(gguf_path, "llama", LLAMA)
    folder = gguf_folder(tmp_path, gguf_path)
    with open(gguf_path, "r+b") as handle:
        handle.truncate(gguf_path.stat().st_size - 100)
    refused(folder, "runs past the end of the file", "truncated")


def test_a_truncated_safetensors_file_is_refused(tmp_path):
    save_file(hf_tensors(torch.bfloat16), tmp_path / "model.safetensors")
    path = tmp_path / "model.safetensors"
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 10)
    refused(tmp_path, "model.safetensors", "past the", "data section")


def test_an_index_naming_a_missing_shard_is_refused(tmp_path):
    sharded_folder(tmp_path, torch.bfloat16)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    refused(tmp_path, "model.safetensors.index.json", "model-00002-of-00002.safetensors", "missing")


def test_an_index_whose_shard_lacks_a_tensor_is_refused(tmp_path):
    sharded_folder(tmp_path, torch.float32)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.extra.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(tmp_path, "'model.layers.9.extra.weight' is not in model-00001-of-00002.safetensors")


def test_a_dtype_that_holds_no_weights_is_refused(tmp_path):
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4, dtype=torch.int8)},
              tmp_path / "model.safetensors")
    refused(tmp_path, "'model.embed_tokens.weight' has dtype I8", "not a weight dtype pyml reads")


def test_a_hugging_face_folder_as_downloaded_runs_given_a_spec(tmp_path):
    """config.json, the tokenizer and bf16 shards with their index, no spec.toml: `load_model`
    (pyml eval, generate --weights f32) runs it with --spec, its weights the shards' values."""
    from pyml.generate.decoding import load_model

    imported = tiny_folder(tmp_path, "llama")
    downloaded = tmp_path / "downloaded"
    downloaded.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (downloaded / name).write_bytes((imported / name).read_bytes())
    dense = StoredFolder(imported).dense_tensors()
    names = sorted(dense)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, held in shards.items():
        save_file({name: torch.from_numpy(dense[name]).to(torch.bfloat16) for name in held}, downloaded / shard)
    weight_map = {name: shard for shard, held in shards.items() for name in held}
    (downloaded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load_model(downloaded, Path(__file__).resolve().parents[2] / "specs" / "llama_tiny.toml")
    for name, weight in model.host_tensors().items():
        bf16 = torch.from_numpy(dense[name]).to(torch.bfloat16).to(torch.float32).numpy()
        assert same_bits(weight, bf16), name
