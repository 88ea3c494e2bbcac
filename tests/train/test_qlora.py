"""LoRA over a base kept as its GGUF stores it (QLoRA), against the `peft` library on Hugging Face's
LlamaForCausalLM holding the dequantized base, float64: per stored format, the loss and every
adapter's gradient to 1e-10, and three AdamW steps against torch.optim.AdamW to 1e-10 (their
losses) and 1e-9 (the adapters after them). The base's
linear maps are never a float matrix in pyml's model: each is read from the GGUF's memory map a
tile of rows at a time (pyml/package/cpu/frozen_linear.py)."""

import gguf
import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model

from pyml.formats.gguf_import import import_gguf
from pyml.package.bf16_products import has_bf16_products
from pyml.package.stored_rows import StoredMaps
from pyml.train.lora import PEFT_MODULES, lora_settings, lora_spec
from tests.support.generator_fuzz import relative_error
from tests.support.hf_reference import llama_in_float64, reference_loss
from tests.support.model_folders import LLAMA, write_gguf

TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
# K-quants store rows of whole 256-value blocks: every matrix's columns (hidden, heads x head_dim,
# ffn) a multiple of 256
K_DIMS = LLAMA | {"hidden": 256, "head_dim": 64, "ffn": 256}
FORMATS = {"Q8_0": LLAMA, "Q4_0": LLAMA, "Q4_1": LLAMA, "Q5_0": LLAMA, "BF16": LLAMA, "F16": LLAMA,
           "Q4_K": K_DIMS, "Q5_K": K_DIMS, "Q6_K": K_DIMS}
SETTINGS = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def quantized_folder(root, stored: str):
    """A tiny llama GGUF whose matrices are stored `stored` (the embedding too), imported. The
    spec is named by its dims, not its format: the formats of one shape share a compiled package
    (the stored type is the weights', not the spec's)."""
    path = root / f"tiny-{stored}.gguf"
    write_gguf(path, "llama", FORMATS[stored], general={"general.name": "Tiny"},
               tensor_types={"": gguf.GGMLQuantizationType[stored]})
    name = "tiny_qlora_k" if FORMATS[stored] is K_DIMS else "tiny_qlora"
    return import_gguf(path, root / f"tiny-{stored}", progress=False, name=name)


def our_name(peft_name: str) -> str:
    return peft_name.removeprefix("base_model.model.").replace(".default", "")


def batch(seed, vocab, length=12):
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (2, length)), rng.integers(0, vocab, (2, length))


@pytest.mark.parametrize("stored", sorted(FORMATS))
def test_adapters_over_a_stored_base_equal_peft_on_the_dequantized_base(stored, tmp_path, monkeypatch):
    monkeypatch.setattr("pyml.package.cpu.frozen_linear.TILE_VALUES", 1)  # tiles of 16 rows: several a map
    folder = quantized_folder(tmp_path, stored)
    spec, package = lora_spec(folder / "spec.toml", lora_settings(4, 12.0, TARGETS))
    model = package.Model.from_base(folder, seed=1, dtype=np.float64)
    # the linear maps stay in the GGUF: no float buffer holds them
    assert isinstance(model.params.maps, StoredMaps)
    assert set(model.params.maps.formats.values()) == {stored}
    assert model.params.frozen.size == package.Parameters.FROZEN_SIZE < package.Parameters.MAPS_SIZE

    base = llama_in_float64(folder, monkeypatch)
    config = LoraConfig(r=4, lora_alpha=12.0, lora_dropout=0.0, bias="none",
                        target_modules=[PEFT_MODULES[t] for t in TARGETS])
    reference = get_peft_model(base, config)
    rng = np.random.default_rng(2)  # B starts at zero: give both adapters values
    adapters = {name: rng.normal(0.0, 0.3, t.shape) for name, t in model.adapter_tensors().items()}
    model.load_adapter_tensors(adapters, "test")
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.requires_grad:
                param.copy_(torch.tensor(adapters[our_name(name)]))

    vocab = spec.embedding.vocab_size
    ids, targets = batch(0, vocab)
    logits, loss = reference_loss(reference, ids, targets)
    loss.backward()
    assert relative_error(model.forward(ids), logits.detach().numpy()) < 1e-10
    assert model.loss_and_grads(ids, targets) == pytest.approx(loss.item(), rel=1e-10)
    grads = model.tensors(package.Parameters(model.grads.flat))
    trainable = {our_name(n): p for n, p in reference.named_parameters() if p.requires_grad}
    assert set(grads) == set(trainable)
    for name, param in trainable.items():
        assert relative_error(grads[name], param.grad.numpy()) < 1e-10, name

    ours = package.AdamW(model, **SETTINGS)
    theirs = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], **SETTINGS)
    for step in range(3):
        ids, targets = batch(step + 1, vocab)
        theirs.zero_grad()
        _, loss = reference_loss(reference, ids, targets)
        loss.backward()
        theirs.step()
        assert package.train_step(model, ours, ids, targets) == pytest.approx(loss.item(), rel=1e-10)
    after = model.adapter_tensors()
    # AdamW divides by the root of each entry's squared-gradient average, which magnifies the
    # gradients' float64 rounding where that average is small: Q5_K's adapters came within
    # 1.7e-10 (transformers 5.25, peft 0.21.2), the losses and gradients above within 1e-10
    for name, param in trainable.items():
        assert relative_error(after[name], param.detach().numpy()) < 1e-9, name


def test_a_stored_base_trains_as_its_float_copy_does(tmp_path):
    """float32: the same run over the GGUF's Q8_0 rows and over their float32 copy (the maps in a
    float buffer) take the same steps, to float32 rounding (the tiles' products sum in another
    order than one product of the whole matrix)."""
    from pyml.formats.stored_tensors import stored_weights

    folder = quantized_folder(tmp_path, "Q8_0")
    spec, package = lora_spec(folder / "spec.toml", lora_settings(4, 12.0, TARGETS))
    stored = package.Model.from_base(folder, seed=1)
    dense = package.Model(np.float32)
    base, source = stored_weights(folder)
    dense.load_tensors(stored.adapter_tensors() | base, source)
    assert stored.stored_maps is not None and dense.stored_maps is None
    losses = []
    for model in (stored, dense):
        optimizer = package.AdamW(model, **SETTINGS)
        # 2 x 40 rows: the tiles' BLAS products (the decode step's row products take fewer rows)
        losses.append([package.train_step(model, optimizer, *batch(step, spec.embedding.vocab_size, 40))
                       for step in range(3)])
    assert np.allclose(losses[0], losses[1], rtol=1e-5)
    assert np.allclose(stored.adapter_tensors()["model.layers.0.mlp.down_proj.lora_B.weight"],
                       dense.adapter_tensors()["model.layers.0.mlp.down_proj.lora_B.weight"], atol=1e-6)


@pytest.mark.skipif(not has_bf16_products(), reason="this CPU has no AVX-512 BF16")
def test_bf16_over_a_stored_base_is_bf16_over_its_float_copy(tmp_path, monkeypatch):
    """`--precision bf16` with LoRA: the frozen maps' products round their operands to bf16 over
    the GGUF's Q8_0 rows, a tile at a time, as over their float32 copy: the same steps, bit for
    bit (the input gradient's sums run on from tile to tile); and a bf16 run's losses are not the
    f32 run's, though within bf16's reach of them."""
    from pyml.formats.stored_tensors import stored_weights

    monkeypatch.setattr("pyml.package.cpu.frozen_linear.TILE_VALUES", 1)  # tiles of 16 rows: several a map
    folder = quantized_folder(tmp_path, "Q8_0")
    spec, package = lora_spec(folder / "spec.toml", lora_settings(4, 12.0, TARGETS))
    batches = [batch(step, spec.embedding.vocab_size, 40) for step in range(3)]
    runs = {}
    for precision in ("bf16", "f32"):
        stored = package.Model.from_base(folder, seed=1)
        dense = package.Model(np.float32)
        base, source = stored_weights(folder)
        dense.load_tensors(stored.adapter_tensors() | base, source)
        for model in (stored, dense):
            model.set_precision(precision)
        runs[precision] = []
        for model in (stored, dense):
            optimizer = package.AdamW(model, **SETTINGS)
            runs[precision].append([package.train_step(model, optimizer, *rows) for rows in batches])
    assert runs["bf16"][0] == runs["bf16"][1]
    assert not np.allclose(runs["bf16"][0], runs["f32"][0], rtol=1e-6, atol=0)
    assert np.allclose(runs["bf16"][0], runs["f32"][0], rtol=1e-2)


def test_the_decode_step_adds_an_adapter_beside_the_stored_rows(tmp_path):
    """`pyml generate/serve/eval --adapter` on the CPU: the fused decode step on the GGUF's rows
    with the adapter's updates added beside them (not folded in) gives the LoRA model's logits."""
    from pyml.generate.decoding import folder_package
    from pyml.generate.quantized import QuantizedDecoder
    from pyml.train.lora import adapter_files, write_adapter_folder

    folder = quantized_folder(tmp_path, "Q4_1")
    spec, package = lora_spec(folder / "spec.toml", lora_settings(4, 12.0, ["q", "v", "down"]))
    model = package.Model.from_base(folder, seed=1)
    rng = np.random.default_rng(3)
    model.load_adapter_tensors({name: rng.normal(0.0, 0.3, t.shape) for name, t in
                                model.adapter_tensors().items()}, "test")
    write_adapter_folder(tmp_path / "adapter", model, adapter_files(spec.lora, folder))
    decoder = QuantizedDecoder.of_folder(folder_package(folder), folder, adapter=tmp_path / "adapter")
    assert decoder.formats["self_attn_qkv"] == "Q4_1 + LoRA" and decoder.formats["self_attn_o"] == "Q4_1"
    ids = rng.integers(0, spec.embedding.vocab_size, (1, 20))
    expected = model.forward(ids)
    assert np.abs(decoder.forward(ids) - expected).max() < 1e-4 * np.abs(expected).max()
    without = QuantizedDecoder.of_folder(folder_package(folder), folder).forward(ids)
    assert np.abs(without - expected).max() > 1e-2 * np.abs(expected).max()  # the adapter matters


@pytest.mark.parametrize("stored", ["Q8_0", "Q4_K"])
def test_merge_lora_keeps_the_base_in_its_types(stored, tmp_path, capsys):
    """merge-lora on a GGUF base writes a GGUF of its own in the base's types: the merged matrices
    requantized (within the type's own rounding of the float merge), every other tensor's bytes
    as they were; the merged folder generates and exports (as stored) like any folder."""
    from pyml.formats.gguf_export import export_gguf
    from pyml.formats.gguf_read import read_gguf
    from pyml.formats.stored_tensors import StoredFolder
    from pyml.train.lora import adapter_files, merge_lora, merged_tensors, write_adapter_folder

    folder = quantized_folder(tmp_path, stored)
    spec, package = lora_spec(folder / "spec.toml", lora_settings(4, 12.0, ["q", "down"]))
    model = package.Model.from_base(folder, seed=1)
    rng = np.random.default_rng(3)
    model.load_adapter_tensors({name: rng.normal(0.0, 0.3, t.shape) for name, t in
                                model.adapter_tensors().items()}, "test")
    write_adapter_folder(tmp_path / "adapter", model, adapter_files(spec.lora, folder))
    out = merge_lora(folder, tmp_path / "adapter", tmp_path / "merged")
    assert "requantized to their stored types" in capsys.readouterr().out
    assert (out / "source.gguf").is_file() and not (out / "source.gguf").is_symlink()
    base, result = StoredFolder(folder).tensors, StoredFolder(out).tensors
    assert {n: t.ggml_type for n, t in result.items()} == {n: t.ggml_type for n, t in base.items()}
    float_merge = merged_tensors(folder, tmp_path / "adapter")
    for name, tensor in result.items():
        if "q_proj" in name or "down_proj" in name:
            assert not np.array_equal(tensor.data, base[name].data), name
            scale = np.abs(float_merge[name]).max()
            assert np.abs(tensor.dense() - float_merge[name]).max() < 0.1 * scale, name
        else:
            assert np.array_equal(tensor.data, base[name].data), name
    assert read_gguf(out / "source.gguf").metadata["general.name"] == "Tiny (fine-tune)"
    export_gguf(out, tmp_path / "merged.gguf", "as-stored", progress=False)
    exported = read_gguf(tmp_path / "merged.gguf")
    assert {t.ggml_type for t in exported.tensors.values()} == {
        t.ggml_type for t in read_gguf(out / "source.gguf").tensors.values()}


def test_a_type_the_kernels_do_not_read_is_refused_in_one_line(tmp_path):
    """Q5_1 has no row kernel: a LoRA run over it is refused, naming the tensor and what to do,
    rather than holding a float32 copy of it unasked."""
    from pyml.errors import PymlError

    path = tmp_path / "tiny-q5_1.gguf"
    write_gguf(path, "llama", LLAMA, tensor_types={"ffn_down": gguf.GGMLQuantizationType.Q5_1})
    folder = import_gguf(path, tmp_path / "tiny-q5_1", progress=False)
    _, package = lora_spec(folder / "spec.toml", lora_settings(4, 12.0, TARGETS))
    with pytest.raises(PymlError, match=r"^model\.layers\.0\.mlp\.down_proj\.weight is stored Q5_1, which "
                                        r"LoRA over the base as stored does not read .*export-gguf"):
        package.Model.from_base(folder, seed=1)
