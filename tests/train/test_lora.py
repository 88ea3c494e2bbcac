"""LoRA against the `peft` library on Hugging Face's LlamaForCausalLM, same base weights and
adapters, float64: the loss and every adapter's gradient to rtol 1e-9, ten AdamW steps of the
adapters against torch.optim.AdamW on PEFT's trainable parameters, the base left untouched."""

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model

from pyml.errors import PymlError
from pyml.spec import parse_spec
from tests.support.generator_fuzz import generated_package, relative_error
from tests.support.hf_reference import float64_llama, reference_loss

TARGETS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
           "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
           "down": "mlp.down_proj"}
LORA = {"rank": 4, "alpha": 12.0, "targets": ["q", "v", "o", "gate", "down"]}
SPEC = {
    "name": "llama_lora", "form": "decoder", "max_seq_len": 32,
    "embedding": {"vocab_size": 53, "dim": 24},
    "block": {"count": 2, "attn_norm": {"dim": 24}, "mlp_norm": {"dim": 24},
              "attention": {"dim": 24, "n_heads": 4, "n_kv_heads": 2, "head_dim": 6,
                            "rope": {"theta": 50000.0}},
              "mlp": {"dim": 24, "hidden": 40}},
    "final_norm": {"dim": 24}, "lm_head": {"dim": 24, "vocab_size": 53, "tied": True},
    "lora": LORA,
}


def our_name(peft_name: str) -> str:
    """PEFT's parameter name to the tensor name of ours: no wrapper prefix, no adapter name."""
    return peft_name.removeprefix("base_model.model.").replace(".default", "")


@pytest.fixture
def models(monkeypatch):
    base = float64_llama(monkeypatch, SPEC)
    base_tensors = {n: t.detach().numpy().copy() for n, t in base.state_dict().items()
                    if n != "lm_head.weight"}  # tied: lm_head is the embedding
    config = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0, bias="none",
                        target_modules=[TARGETS[t].split(".")[1] for t in LORA["targets"]])
    reference = get_peft_model(base, config)
    _, package = generated_package(SPEC)
    model = package.Model.initialized(seed=1, dtype=np.float64)
    # B is zero at initialisation (so are A's gradients): give both adapters random values
    rng = np.random.default_rng(2)
    adapters = {name: rng.normal(0.0, 0.3, t.shape) for name, t in model.adapter_tensors().items()}
    model.load_tensors(base_tensors | adapters, "reference")
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.requires_grad:
                param.copy_(torch.tensor(adapters[our_name(name)]))
    return package, model, reference


def batch(seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 53, (2, 10)), rng.integers(0, 53, (2, 10))


def test_only_the_adapters_train():
    spec = parse_spec(SPEC, "lora")
    _, package = generated_package(SPEC)
    adapters = package.Model.initialized(seed=0, dtype=np.float64).adapter_tensors()
    expected = {f"model.layers.{l}.{TARGETS[t]}.lora_{m}.weight" for l in range(2)
                for t in LORA["targets"] for m in "AB"}
    assert set(adapters) == expected
    assert package.Parameters.SIZE == sum(a.size for a in adapters.values())
    assert all(not adapters[n].any() for n in expected if n.endswith("lora_B.weight"))
    assert spec.lora.scale == 3.0


def test_loss_and_adapter_gradients_match_peft(models):
    package, model, reference = models
    ids, targets = batch(0)
    logits, loss = reference_loss(reference, ids, targets)
    loss.backward()
    assert relative_error(model.forward(ids), logits.detach().numpy()) < 1e-9
    assert model.loss_and_grads(ids, targets) == pytest.approx(loss.item(), rel=1e-9)
    grads = model.tensors(package.Parameters(model.grads.flat))
    trainable = {our_name(n): p for n, p in reference.named_parameters() if p.requires_grad}
    assert set(grads) == set(trainable)
    for name, param in trainable.items():
        assert relative_error(grads[name], param.grad.numpy()) < 1e-9, name


def test_ten_adamw_steps_of_the_adapters_track_torch(models):
    package, model, reference = models
    before = model.host_tensors()
    settings = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    trainable = [p for p in reference.parameters() if p.requires_grad]
    ours, theirs = package.AdamW(model, **settings), torch.optim.AdamW(trainable, **settings)
    assert ours.exp_avg.size == package.Parameters.SIZE  # AdamW state for the adapters only
    for step in range(10):
        ids, targets = batch(step)
        theirs.zero_grad()
        _, loss = reference_loss(reference, ids, targets)
        loss.backward()
        theirs.step()
        assert package.train_step(model, ours, ids, targets) == pytest.approx(loss.item(), rel=1e-9)
    after = model.host_tensors()
    for name, param in reference.named_parameters():
        if param.requires_grad:
            assert relative_error(after[our_name(name)], param.detach().numpy()) < 1e-9, name
    for name in before:
        if "lora_" not in name:
            assert np.array_equal(after[name], before[name]), f"{name} is frozen"


def test_a_rank_larger_than_a_projection_is_refused():
    spec = {**SPEC, "lora": {"rank": 13, "targets": ["k"]}}
    with pytest.raises(PymlError, match=r"lora.rank 13 exceeds block.attention's k projection "
                                        r"\(24 -> 12\); choose a rank of at most 12"):
        parse_spec(spec, "lora")


def test_targets_that_name_no_projection_are_refused():
    spec = {**SPEC, "block": {"count": 1, "layers": [{"kind": "rmsnorm", "dim": 24}]},
            "lora": {"rank": 1, "targets": ["q"]}}
    with pytest.raises(PymlError, match=r"lora.targets \['q'\] name no projection of the block "
                                        r"\(it has none\): nothing would train"):
        parse_spec(spec, "lora")
