"""Hugging Face Llama in float64 as the reference-precision model: transformers computes two
things in float32 whatever the model dtype (RMSNorm upcasts to float32, the rotary tables come from
float32 cos/sin), so these patches compute them in the model's dtype instead."""

import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

from tests.support.torch_reference import scaled_in_float64
from tests.support.model_folders import transformers_folder


def rms_norm_in_input_dtype(self, hidden):
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


def compute_in_float64(monkeypatch, head_dim: int, theta: float, modeling=modeling_llama,
                       prefix: str = "Llama", scaling: dict | None = None) -> None:
    """transformers' RMSNorm and rotary tables in the model's dtype, for this test: Llama's, or
    those of the family whose modeling module and class prefix are given (Qwen2's); the
    frequencies scaled as `scaling` (a spec's RoPE scaling) says."""

    def rotary_in_float64(self, x, position_ids):
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float64) / head_dim
        attention_factor = 1.0
        if scaling is not None and scaling["type"] == "longrope":
            # transformers' choice: the long factors for a sequence longer than the original context
            long = int(position_ids.max()) + 1 > scaling["original_max_position_embeddings"]
            factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float64)
            inv_freq = 1.0 / (factors * theta**exponents)
            attention_factor = scaling["attention_factor"]
        else:
            inv_freq = 1.0 / theta**exponents
            if scaling is not None:
                inv_freq = scaled_in_float64(inv_freq, scaling)
        freqs = position_ids[..., None].to(torch.float64) * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * attention_factor).to(x.dtype), (angles.sin() * attention_factor).to(x.dtype)

    monkeypatch.setattr(getattr(modeling, f"{prefix}RMSNorm"), "forward", rms_norm_in_input_dtype)
    monkeypatch.setattr(getattr(modeling, f"{prefix}RotaryEmbedding"), "forward", rotary_in_float64)


def float64_llama(monkeypatch, spec: dict, seed: int = 0) -> LlamaForCausalLM:
    """LlamaForCausalLM of a Llama-shorthand spec's dims, float64 throughout, seeded weights."""
    block, attention = spec["block"], spec["block"]["attention"]
    head_dim, theta = attention["head_dim"], attention["rope"]["theta"]
    compute_in_float64(monkeypatch, head_dim, theta)
    config = LlamaConfig(
        vocab_size=spec["embedding"]["vocab_size"], hidden_size=spec["embedding"]["dim"],
        intermediate_size=block["mlp"]["hidden"], num_hidden_layers=block["count"],
        num_attention_heads=attention["n_heads"], num_key_value_heads=attention["n_kv_heads"],
        head_dim=head_dim, max_position_embeddings=spec["max_seq_len"],
        rms_norm_eps=block["attn_norm"].get("eps", 1e-5), rope_theta=theta,
        tie_word_embeddings=spec["lm_head"]["tied"])
    torch.manual_seed(seed)
    reference = LlamaForCausalLM(config).to(torch.float64)
    reference.config._attn_implementation = "sdpa"  # eager attention takes its softmax in float32
    return reference


def llama_in_float64(folder: Path, monkeypatch) -> LlamaForCausalLM:
    """transformers' LlamaForCausalLM of a model folder, float64 throughout."""
    from transformers import AutoModelForCausalLM

    config = json.loads((folder / "config.json").read_text())
    compute_in_float64(monkeypatch, config["head_dim"], config["rope_theta"])
    return AutoModelForCausalLM.from_pretrained(transformers_folder(folder), dtype=torch.float64, attn_implementation="sdpa").eval()


def reference_loss(reference, ids, targets):
    logits = reference(torch.tensor(ids)).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.tensor(targets).reshape(-1))
    return logits, loss
