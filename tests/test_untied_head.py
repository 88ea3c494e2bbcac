"""A decoder with an untied LM head (its own lm_head.weight) against Hugging Face
LlamaForCausalLM(tie_word_embeddings=False): loss, logits and every gradient in float64, and ten
AdamW steps against torch.optim.AdamW. Before the generator compiled compositions, such a spec
generated fine and crashed on its first backward pass."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

from generator_fuzz import generated_package, relative_error

THETA = 50000.0
SPEC = {
    "name": "llama_untied", "form": "decoder", "max_seq_len": 32,
    "embedding": {"vocab_size": 53, "dim": 24},
    "block": {"count": 2, "attn_norm": {"dim": 24}, "mlp_norm": {"dim": 24},
              "attention": {"dim": 24, "n_heads": 4, "n_kv_heads": 2, "head_dim": 6,
                            "rope": {"theta": THETA}},
              "mlp": {"dim": 24, "hidden": 40}},
    "final_norm": {"dim": 24}, "lm_head": {"dim": 24, "vocab_size": 53, "tied": False},
}


def rms_norm_in_input_dtype(self, hidden):
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


def rotary_in_float64(self, x, position_ids):
    head_dim = SPEC["block"]["attention"]["head_dim"]
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float64) / head_dim
    freqs = position_ids[..., None].to(torch.float64) * (1.0 / THETA**exponents)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


@pytest.fixture
def models(monkeypatch):
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm_in_input_dtype)
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", rotary_in_float64)
    attention = SPEC["block"]["attention"]
    config = LlamaConfig(
        vocab_size=53, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=attention["n_heads"], num_key_value_heads=attention["n_kv_heads"],
        head_dim=attention["head_dim"], max_position_embeddings=32, rms_norm_eps=1e-5,
        rope_theta=THETA, tie_word_embeddings=False)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config).to(torch.float64)
    reference.config._attn_implementation = "sdpa"
    _, package = generated_package(SPEC)
    model = package.Model(dtype=np.float64)
    model.load_tensors({n: t.detach().numpy() for n, t in reference.state_dict().items()}, "reference")
    return package, model, reference


def batch(seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 53, (2, 10)), rng.integers(0, 53, (2, 10))


def reference_loss(reference, ids, targets):
    logits = reference(torch.tensor(ids)).logits
    return logits, torch.nn.functional.cross_entropy(logits.reshape(-1, 53), torch.tensor(targets).reshape(-1))


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
