"""A decoder with an untied LM head (its own lm_head.weight) against Hugging Face
LlamaForCausalLM(tie_word_embeddings=False): loss, logits and every gradient in float64, and ten
AdamW steps against torch.optim.AdamW. Before the generator compiled compositions, such a spec
generated fine and crashed on its first backward pass."""

import numpy as np
import pytest
import torch

from tests.support.generator_fuzz import generated_package, relative_error
from tests.support.hf_reference import float64_llama, reference_loss

SPEC = {
    "name": "llama_untied", "form": "decoder", "max_seq_len": 32,
    "embedding": {"vocab_size": 53, "dim": 24},
    "block": {"count": 2, "attn_norm": {"dim": 24}, "mlp_norm": {"dim": 24},
              "attention": {"dim": 24, "n_heads": 4, "n_kv_heads": 2, "head_dim": 6,
                            "rope": {"theta": 50000.0}},
              "mlp": {"dim": 24, "hidden": 40}},
    "final_norm": {"dim": 24}, "lm_head": {"dim": 24, "vocab_size": 53, "tied": False},
}


@pytest.fixture
def models(monkeypatch):
    reference = float64_llama(monkeypatch, SPEC)
    _, package = generated_package(SPEC)
    model = package.Model(dtype=np.float64)
    model.load_tensors({n: t.detach().numpy() for n, t in reference.state_dict().items()}, "reference")
    return package, model, reference


def batch(seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 53, (2, 10)), rng.integers(0, 53, (2, 10))


def test_untied_head_loss_logits_and_gradients_match_transformers(models):
    package, model, reference = models
    ids, targets = batch(0)
    logits, loss = reference_loss(reference, ids, targets)
    loss.backward()
    assert relative_error(model.forward(ids), logits.detach().numpy()) < 1e-9
    assert model.loss_and_grads(ids, targets) == pytest.approx(loss.item(), rel=1e-9)
    grads = model.tensors(package.Parameters(model.grads.flat))
    assert "lm_head.weight" in grads
    for name, param in reference.named_parameters():
        assert relative_error(grads[name], param.grad.numpy()) < 1e-9, name


def test_untied_head_ten_adamw_steps_track_torch(models):
    package, model, reference = models
    settings = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    ours, theirs = package.AdamW(model, **settings), torch.optim.AdamW(reference.parameters(), **settings)
    for step in range(10):
        ids, targets = batch(step)
        theirs.zero_grad()
        _, loss = reference_loss(reference, ids, targets)
        loss.backward()
        theirs.step()
        assert package.train_step(model, ours, ids, targets) == pytest.approx(loss.item(), rel=1e-9)
    tensors = model.host_tensors()
    for name, param in reference.named_parameters():
        assert relative_error(tensors[name], param.detach().numpy()) < 1e-9, name
