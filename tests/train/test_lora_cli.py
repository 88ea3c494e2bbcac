"""LoRA runs of `pyml train --lora-rank` and `pyml merge-lora`, against the `peft` library.

A LoRA checkpoint is a peft adapter folder: `PeftModel.from_pretrained(base, CHECKPOINT)` loads it
onto transformers' model of the --init folder and computes our logits (the tiny llama, float64,
rtol 1e-9); merge-lora's folder gives transformers the logits of peft's `merge_and_unload()`. The
tiny Gemma 3 passes the same two checks; the real SmolLM2-135M trains three LoRA AdamW steps as
peft + torch.optim.AdamW do (float32, 1e-3).
Also: resume is bit-identical, and bad inputs are refused in one line.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict

from pyml.errors import PymlError
from pyml.formats.safetensors_io import read_safetensors, write_safetensors
from pyml.formats.stored_tensors import StoredFolder
from pyml.generate import decoding as generation
from pyml.train.checkpoint import read_state
from pyml.train.config import TrainingConfig
from pyml.train.data import load_corpus
from pyml.train.evaluation import evaluate_folder
from pyml.train.folder_data import FolderTokens
from pyml.train.lora import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_MODEL_FILE,
    PEFT_MODULES,
    PEFT_PREFIX,
    base_weights_digest,
    lora_settings,
    lora_spec,
    merge_lora,
    read_adapter_tensors,
)
from pyml.train.loss_curve import describe_settings
from pyml.train.run import train
from tests.support.hf_reference import llama_in_float64
from tests.support.model_folders import tiny_text, tiny_training, transformers_folder

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "specs"
LORA = {"lora_rank": 4, "lora_alpha": 12.0, "lora_targets": ["q", "v", "o", "down"]}


def peft_config(settings: dict) -> LoraConfig:
    return LoraConfig(r=settings["rank"], lora_alpha=settings["alpha"], lora_dropout=0.0,
                      bias="none", task_type="CAUSAL_LM",
                      target_modules=[PEFT_MODULES[target] for target in settings["targets"]])


def lora_training(init: Path, out: Path, **options):
    return tiny_training(init, out, **(dict(steps=2, checkpoint_every=1, **LORA) | options))


@pytest.fixture(scope="module")
def lora_run(tiny_folders, tmp_path_factory):
    return lora_training(tiny_folders["llama"], tmp_path_factory.mktemp("lora_run") / "run")


def tiny_lora_model(init: Path, checkpoint: Path):
    """Our LoRA model of `init` with the adapters of `checkpoint`, float64."""
    _, package = lora_spec(SPECS / "llama_tiny.toml", read_state(checkpoint)["config"]["lora"])
    model = package.Model.from_base(init, dtype=np.float64)
    model.load_adapter_tensors(read_adapter_tensors(checkpoint), str(checkpoint))
    return model


def logits_of(reference, ids):
    with torch.no_grad():
        return reference(torch.tensor(ids)).logits.numpy()


def test_a_lora_checkpoint_is_a_peft_adapter_folder(tiny_folders, lora_run, monkeypatch):
    checkpoint, init = lora_run.checkpoint, tiny_folders["llama"]
    assert sorted(path.name for path in checkpoint.iterdir()) == sorted([
        ADAPTER_CONFIG_FILE, ADAPTER_MODEL_FILE, "tokenizer.json", "tokenizer_config.json",
        "chat_template.jinja", "optimizer.safetensors", "state.json"])  # no copy of the base
    settings = read_state(checkpoint)["config"]["lora"]
    assert settings == {"rank": 4, "alpha": 12.0, "targets": ["q", "v", "o", "down"]}
    assert "LoRA rank 4 alpha 12 on q,v,o,down" in describe_settings(
        TrainingConfig(**read_state(checkpoint)["config"]))
    # the adapter tensors as peft names them, and adapter_config.json as peft writes it
    reference = get_peft_model(llama_in_float64(init, monkeypatch), peft_config(settings))
    expected = get_peft_model_state_dict(reference)
    adapters = read_safetensors(checkpoint / ADAPTER_MODEL_FILE)
    assert {name: a.shape for name, a in adapters.items()} == {
        name: tuple(t.shape) for name, t in expected.items()}
    reference.peft_config["default"].base_model_name_or_path = str(init)
    reference.peft_config["default"].inference_mode = True
    reference.save_pretrained(checkpoint.parent / "peft_saved")
    theirs = json.loads((checkpoint.parent / "peft_saved" / ADAPTER_CONFIG_FILE).read_text())
    ours = json.loads((checkpoint / ADAPTER_CONFIG_FILE).read_text())
    theirs["target_modules"] = sorted(theirs["target_modules"])
    assert {key: theirs[key] for key in ours} == ours


def test_peft_loads_the_checkpoint_with_our_logits(tiny_folders, lora_run, monkeypatch):
    checkpoint, init = lora_run.checkpoint, tiny_folders["llama"]
    base = llama_in_float64(init, monkeypatch)
    ids = np.random.default_rng(0).integers(0, 96, (2, 16))
    base_logits = logits_of(base, ids)
    reference = PeftModel.from_pretrained(base, checkpoint).eval()
    expected = logits_of(reference, ids)
    assert not np.allclose(expected, base_logits, rtol=1e-6)  # the adapters changed the model
    ours = tiny_lora_model(init, checkpoint).forward(ids)
    np.testing.assert_allclose(ours, expected, rtol=1e-9, atol=1e-12)


def test_eval_with_an_adapter_is_peft_loss(tiny_folders, lora_run, tmp_path, monkeypatch):
    """`pyml eval --adapter` scores the base with the adapters folded in, as peft computes it."""
    checkpoint, init = lora_run.checkpoint, tiny_folders["llama"]
    text = tiny_text(tmp_path / "text.txt")
    result = evaluate_folder(init, text, adapter=checkpoint, seq=16, batch=4, dtype="float64")
    inputs, targets = FolderTokens(init, 96, "llama_tiny").text_pairs(load_corpus(text), 16)
    reference = PeftModel.from_pretrained(llama_in_float64(init, monkeypatch), checkpoint).eval()
    with torch.no_grad():
        logits = reference(torch.tensor(inputs)).logits
    expected = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       torch.tensor(targets).reshape(-1)))
    # folded as merge-lora folds, into the base's float32 weights: float32's rounding, not float64's
    assert result["loss"] == pytest.approx(expected, rel=1e-7)
    assert result["loss"] != pytest.approx(evaluate_folder(init, text, seq=16, dtype="float64")["loss"])


def test_merge_lora_folder_has_the_logits_of_peft_merge_and_unload(tiny_folders, lora_run,
                                                                    monkeypatch, tmp_path):
    """The merged weights are stored in the base's dtype (float32 here), so they equal peft's
    float64 merge rounded to float32 (within an ulp: the products' summation order differs), and
    the logits agree to that rounding."""
    checkpoint, init = lora_run.checkpoint, tiny_folders["llama"]
    merged = merge_lora(init, checkpoint, tmp_path / "merged", weights="f32")
    reference = PeftModel.from_pretrained(llama_in_float64(init, monkeypatch), checkpoint)
    reference = reference.merge_and_unload().eval()
    ours = read_safetensors(merged / "model.safetensors")
    theirs = {name: t.numpy() for name, t in reference.state_dict().items()
              if name != "lm_head.weight"}  # tied: lm_head is the embedding
    assert set(ours) == set(theirs) == set(StoredFolder(init).tensors)
    for name, tensor in ours.items():
        assert tensor.dtype == np.float32
        np.testing.assert_array_max_ulp(tensor, theirs[name].astype(np.float32), maxulp=1)
    ids = np.random.default_rng(1).integers(0, 96, (2, 16))
    np.testing.assert_allclose(logits_of(llama_in_float64(merged, monkeypatch), ids),
                               logits_of(reference, ids), rtol=1e-5, atol=1e-6)
    assert (merged / "spec.toml").read_bytes() == (init / "spec.toml").read_bytes()
    # as stored: a GGUF in the base's types, F32 here, so the very same values
    in_gguf = merge_lora(init, checkpoint, tmp_path / "merged-gguf")
    assert not (in_gguf / "model.safetensors").exists()
    for name, tensor in StoredFolder(in_gguf).dense_tensors().items():
        assert np.array_equal(tensor, ours[name]), name


def test_resume_is_bit_identical(tiny_folders, lora_run, tmp_path):
    out = tmp_path / "run"
    lora_training(tiny_folders["llama"], out, steps=1)
    resumed = lora_training(tiny_folders["llama"], out, steps=2, resume=True)
    assert resumed.train_losses == lora_run.train_losses
    for name in (ADAPTER_MODEL_FILE, "optimizer.safetensors", ADAPTER_CONFIG_FILE):
        assert (resumed.checkpoint / name).read_bytes() == (lora_run.checkpoint / name).read_bytes()


def test_resume_refuses_other_lora_settings(tiny_folders, lora_run, tmp_path):
    out = lora_run.checkpoint.parent
    with pytest.raises(PymlError, match=r"^--lora-rank 8 differs from the checkpoint's 4 \(.*"
                                        r"step_000002\); leave it out to resume"):
        lora_training(tiny_folders["llama"], out, steps=3, resume=True, lora_rank=8)
    with pytest.raises(PymlError, match=r"^--lora-targets q,v differs from the checkpoint's "
                                        r"q,v,o,down"):
        lora_training(tiny_folders["llama"], out, steps=3, resume=True, lora_targets=["q", "v"])


def test_resume_refuses_a_base_whose_weights_changed(tiny_folders, tmp_path):
    """A LoRA checkpoint holds only adapters: resuming onto other base weights (the --init folder
    fine-tuned or re-imported in place) is refused, and the checkpoint is left as it was."""
    init = tmp_path / "base"
    init.mkdir()
    for source in tiny_folders["llama"].iterdir():
        (init / source.name).write_bytes(source.read_bytes())
    out = tmp_path / "run"
    first = lora_training(init, out, steps=1)
    assert read_state(first.checkpoint)["config"]["base_weights"] == base_weights_digest(init)
    saved = {path: path.read_bytes() for path in first.checkpoint.iterdir()}
    weights = bytearray((init / "source.gguf").read_bytes())  # the copy's: write_bytes copied it
    weights[-1] ^= 1  # a bit of the last weight
    (init / "source.gguf").write_bytes(weights)
    with pytest.raises(PymlError, match=r"^--init .*base holds other weights than the "
                                        r"base .*step_000001's adapters were trained on; resume "
                                        r"with that base as --init, or start a new --out$"):
        lora_training(init, out, steps=2, resume=True)
    assert {path: path.read_bytes() for path in first.checkpoint.iterdir()} == saved


def test_lora_flags_are_refused_where_they_cannot_apply(tiny_folders, tmp_path):
    init = tiny_folders["llama"]
    with pytest.raises(PymlError, match=r"^--lora-alpha and --lora-targets need --lora-rank$"):
        lora_training(init, tmp_path / "a", lora_rank=None)
    with pytest.raises(PymlError, match=r"with --lora-rank 17: lora.rank 17 exceeds "
                                        r"block.attention's v projection \(32 -> 16\); choose a "
                                        r"rank of at most 16$"):
        lora_training(init, tmp_path / "b", lora_rank=17)
    spec = tmp_path / "llama_tiny.toml"
    spec.write_text((SPECS / "llama_tiny.toml").read_text() + "\n[lora]\nrank = 2\n")
    with pytest.raises(PymlError, match=r"already has a \[lora\] table: train it without"):
        lora_spec(spec, lora_settings(4, None, None))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_merge_lora_refuses_an_adapter_of_another_base(tiny_folders, lora_run, tmp_path):
    checkpoint = lora_run.checkpoint
    with pytest.raises(PymlError, match=r"lora_A \(4, 64\) and lora_B \(32, 4\); the base's "
                                        r"model.layers.0.mlp.down_proj.weight \(64, 96\)"):
        merge_lora(tiny_folders["gemma3"], checkpoint, tmp_path / "merged")
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / ADAPTER_CONFIG_FILE).write_bytes((checkpoint / ADAPTER_CONFIG_FILE).read_bytes())
    write_safetensors(renamed / ADAPTER_MODEL_FILE, {
        name.replace("layers.0", "layers.7"): tensor
        for name, tensor in read_safetensors(checkpoint / ADAPTER_MODEL_FILE).items()})
    with pytest.raises(PymlError, match=r"adapts model.layers.7.mlp.down_proj.weight, which .* "
                                        r"does not hold; is ADAPTER an adapter of this base\?"):
        merge_lora(tiny_folders["llama"], renamed, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def pyml(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyml.cli", *args], capture_output=True,
                          text=True, cwd=ROOT)  # fmt: skip


def test_train_cli_names_an_unknown_lora_target_in_one_line(tiny_folders, tmp_path):
    result = pyml("train", "--spec", "specs/llama_tiny.toml", "--init", str(tiny_folders["llama"]),
                  "--out", str(tmp_path / "run"), "--lora-rank", "2", "--lora-targets", "q,query")
    assert result.returncode == 2
    assert result.stderr == ("error: specs/llama_tiny.toml with --lora-rank 2: lora.targets[1]: "
                             "Input should be 'q', 'k', 'v', 'o', 'gate', 'up', 'down', 'qkv' or 'gate_up'\n")
    assert not (tmp_path / "run").exists()


def test_merge_lora_cli_says_what_is_missing_in_one_line(tiny_folders, tmp_path):
    result = pyml("merge-lora", str(tiny_folders["llama"]), str(tmp_path), "--out",
                  str(tmp_path / "merged"))
    assert result.returncode == 2
    assert result.stderr == (f"error: {tmp_path / ADAPTER_CONFIG_FILE}: missing; ADAPTER must be "
                             "a LoRA checkpoint of `pyml train --lora-rank` or a folder peft's "
                             "save_pretrained wrote\n")
    assert not (tmp_path / "merged").exists()


@pytest.mark.slow
def test_smollm2_three_lora_steps_track_peft(smollm2_folder):
    """The real model, float32: our LoRA (rank 8 on q and v) and peft's on transformers, the same
    base and initial adapters, three AdamW steps on one sequence of 16 tokens (the same one, so
    that the loss falls as the adapters learn it)."""
    from transformers import AutoModelForCausalLM

    settings = lora_settings(8, 16.0, ["q", "v"])
    _, package = lora_spec(SPECS / "smollm2_135m.toml", settings)
    model = package.Model.from_base(smollm2_folder, seed=3)
    adapters = model.adapter_tensors()
    base = AutoModelForCausalLM.from_pretrained(transformers_folder(smollm2_folder), dtype=torch.float32)
    reference = get_peft_model(base, peft_config(settings))
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.requires_grad:
                key = name.removeprefix(PEFT_PREFIX).replace(".default", "")
                param.copy_(torch.tensor(adapters[key]))
    options = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    ours = package.AdamW(model, **options)
    theirs = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], **options)
    ids = np.random.default_rng(4).integers(0, package.model.VOCAB, (1, 17))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    losses = []
    for _ in range(3):
        theirs.zero_grad()
        logits = reference(torch.tensor(inputs)).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.tensor(targets).reshape(-1))
        loss.backward()
        theirs.step()
        losses.append((package.train_step(model, ours, inputs, targets), loss.item()))
    for step, (our_loss, their_loss) in enumerate(losses):
        assert our_loss == pytest.approx(their_loss, rel=1e-3), f"step {step + 1}"
    assert losses[2][1] < 0.99 * losses[0][1]  # the adapters moved: the steps compared something


def test_generate_with_an_adapter_answers_as_the_merged_folder(tiny_folders, lora_run, tmp_path):
    """--adapter adds the adapter's updates beside the base's rows (the decode step's low-rank
    update), the merged folder holds them folded in: the same greedy answer."""
    init, checkpoint = tiny_folders["llama"], lora_run.checkpoint
    merged = merge_lora(init, checkpoint, tmp_path / "merged", weights="f32")
    options = ("--spec", "specs/llama_tiny.toml", "--chat", "--prompt", "The capital of France",
               "--max-new-tokens", "12")
    with_adapter = pyml("generate", "--model", str(init), "--adapter", str(checkpoint), *options)
    from_merged = pyml("generate", "--model", str(merged), *options)
    assert with_adapter.returncode == from_merged.returncode == 0, with_adapter.stderr
    assert with_adapter.stdout == from_merged.stdout
    # the weights it ran are the merged folder's, not the base's
    loaded = generation.load_model(init, SPECS / "llama_tiny.toml", adapter=checkpoint)
    merged_tensors = read_safetensors(merged / "model.safetensors")
    base_tensors = StoredFolder(init).dense_tensors()
    for name, tensor in loaded.host_tensors().items():
        assert np.array_equal(tensor, merged_tensors[name]), name
    adapted = "model.layers.1.mlp.down_proj.weight"
    assert not np.array_equal(merged_tensors[adapted], base_tensors[adapted])


def test_gemma3_lora_checkpoint_and_merge_match_peft(tiny_folders, tmp_path):
    """The other family: every projection of the tiny Gemma 3 adapted, float64. transformers'
    Gemma computes its norms and rotary tables in float32 whatever the dtype (the base alone
    differs from ours by 2e-7 relative), hence 1e-6 here."""
    from transformers import AutoModelForCausalLM

    init = tiny_folders["gemma3"]
    targets = ["q", "k", "v", "o", "gate", "up", "down"]
    # the folder's own spec (not in specs/, no package in gen/): a LoRA run derives its package
    checkpoint = train(init / "spec.toml", init=init, data=tiny_text(tmp_path / "text.txt"),
                       out=tmp_path / "run", progress=False, steps=2, batch=1, seq=16, lr=1e-2,
                       eval_every=2, eval_batches=1, dtype="float64", lora_rank=4,
                       lora_targets=targets).checkpoint
    _, package = lora_spec(init / "spec.toml", read_state(checkpoint)["config"]["lora"])
    ours = package.Model.from_base(init, dtype=np.float64)
    ours.load_adapter_tensors(read_adapter_tensors(checkpoint), str(checkpoint))

    def gemma(folder):
        return AutoModelForCausalLM.from_pretrained(transformers_folder(folder), dtype=torch.float64,
                                                    attn_implementation="eager").eval()

    ids = np.random.default_rng(0).integers(0, package.model.VOCAB, (1, 12))
    reference = PeftModel.from_pretrained(gemma(init), checkpoint).eval()
    expected = logits_of(reference, ids)
    scale = np.abs(expected).max()
    assert np.abs(expected - logits_of(gemma(init), ids)).max() > 1e-3 * scale  # adapters count
    assert np.abs(ours.forward(ids) - expected).max() < 1e-6 * scale
    merged = merge_lora(init, checkpoint, tmp_path / "merged")
    unloaded = logits_of(reference.merge_and_unload().eval(), ids)
    assert np.abs(logits_of(gemma(merged), ids) - unloaded).max() < 1e-5 * scale
