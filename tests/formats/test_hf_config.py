"""Whether a Hugging Face config describes a spec (`pyml.formats.hf_config`), with configs as
transformers itself writes them: a LlamaConfig and a Gemma3TextConfig saved by transformers 5 keep
their RoPE bases in `rope_parameters`, where import-gguf writes `rope_theta` (and Gemma's
`rope_local_base_freq`); both forms describe the same spec."""

from pathlib import Path

import pytest
from transformers import AutoConfig, LlamaConfig, Qwen2Config

from pyml.formats.hf_config import config_mismatches
from pyml.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[2]
LLAMA_TINY = load_spec(ROOT / "specs" / "llama_tiny.toml")
THETA = LLAMA_TINY.block.attention.rope.theta


def llama_tiny_config(**changes) -> dict:
    """transformers' LlamaConfig of specs/llama_tiny.toml, as save_pretrained writes it."""
    fields = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=THETA,
                  tie_word_embeddings=True)
    return LlamaConfig(**(fields | changes)).to_dict()


def test_transformers_llama_config_describes_the_llama_spec():
    assert "rope_parameters" in llama_tiny_config()
    assert config_mismatches(LLAMA_TINY, llama_tiny_config()) == []


@pytest.mark.parametrize("changes, message", [
    ({"num_key_value_heads": 4}, "num_key_value_heads is 4 in config.json but 2 in the spec"),
    ({"rope_theta": 1234.0}, f"rope_theta is 1234.0 in config.json but {THETA!r} in the spec"),
    ({"hidden_act": "gelu"}, "hidden_act is 'gelu' in config.json but 'silu' in the spec"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings is False in config.json but True"),
])
def test_a_llama_config_that_differs_is_named_by_field(changes, message):
    assert config_mismatches(LLAMA_TINY, llama_tiny_config(**changes)) == [message + (
        "" if message.endswith("spec") else " in the spec")]


def test_transformers_gemma_config_describes_the_gemma_spec(gemma3_dir):
    saved = AutoConfig.from_pretrained(gemma3_dir).to_dict()  # the imported folder, as transformers keeps it
    assert "rope_local_base_freq" not in saved or saved["rope_local_base_freq"] is None
    assert config_mismatches(load_spec(ROOT / "specs" / "gemma3_270m.toml"), saved) == []


def llama_spec(**attention) -> dict:
    return {
        "name": "odd", "form": "decoder", "max_seq_len": 16,
        "embedding": {"vocab_size": 11, "dim": 8},
        "block": {"count": 1, "attn_norm": {"dim": 8}, "mlp_norm": {"dim": 8}, "mlp": {"dim": 8, "hidden": 16},
                  "attention": {"dim": 8, "n_heads": 2, "n_kv_heads": 1, "head_dim": 4,
                                "rope": {"theta": 10000.0}} | attention},
        "final_norm": {"dim": 8}, "lm_head": {"dim": 8, "vocab_size": 11, "tied": True},
    }


def test_transformers_qwen2_config_describes_llamas_block_with_q_k_v_biases():
    spec = parse_spec(llama_spec(qkv_bias=True), "qwen.toml")
    saved = Qwen2Config(vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                        rms_norm_eps=1e-5, tie_word_embeddings=True).to_dict()
    assert saved.get("head_dim") is None and config_mismatches(spec, saved) == []
    assert config_mismatches(spec, llama_tiny_config()) == [
        "model_type is 'llama' in config.json but the spec is 'qwen2'"]
    both = parse_spec(llama_spec(qkv_bias=True, out_bias=True), "odd.toml")  # Llama's attention_bias
    assert config_mismatches(both, {"model_type": "qwen2"}) == [
        "model_type is 'qwen2' in config.json but the spec is 'llama'"]
    output_only = parse_spec(llama_spec(out_bias=True), "odd.toml")
    assert config_mismatches(output_only, {"model_type": "llama"}) == [
        "config.json cannot describe the spec's bias on the attention's output projection alone"]


def test_what_no_config_can_describe_is_named():
    data = llama_spec()
    norm = {"kind": "rmsnorm", "dim": 8}
    data["block"] = {"count": 1, "layers": [norm, {"kind": "residual", "body": [norm]}]}
    assert config_mismatches(parse_spec(data, "odd.toml"), {"model_type": "llama"}) == [
        "model_type is 'llama' in config.json but the spec is neither Llama nor Gemma 3"]


def test_transformers_qwen3_config_describes_llamas_block_with_qk_norm():
    from transformers import Qwen3Config

    spec = parse_spec(llama_spec(qk_norm={"eps": 1e-5}), "qwen3.toml")
    saved = Qwen3Config(vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                        max_position_embeddings=16, rms_norm_eps=1e-5, tie_word_embeddings=True,
                        rope_theta=10000.0).to_dict()
    assert config_mismatches(spec, saved) == []
    assert config_mismatches(spec, saved | {"head_dim": 8}) == [
        "head_dim is 8 in config.json but 4 in the spec"]
    assert config_mismatches(spec, llama_tiny_config()) == [
        "model_type is 'llama' in config.json but the spec is 'qwen3'"]
    with_biases = parse_spec(llama_spec(qk_norm={"eps": 1e-5}, qkv_bias=True), "odd.toml")
    assert config_mismatches(with_biases, {"model_type": "qwen3"}) == [
        "config.json cannot describe the spec's QK-norm with biases"]
    gemma_like = parse_spec(llama_spec(qk_norm={"eps": 1e-5, "unit_offset": True}), "odd.toml")
    assert config_mismatches(gemma_like, {"model_type": "qwen3"}) == [
        "config.json cannot describe the spec's unit-offset norms"]


def test_transformers_config_with_rope_scaling_describes_the_scaled_spec():
    scaling = {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    spec = parse_spec(llama_spec(rope={"theta": 10000.0, "scaling": scaling}), "llama3.toml")
    hf = {"rope_type": "llama3"} | {key: value for key, value in scaling.items() if key != "type"}
    saved = LlamaConfig(vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                        max_position_embeddings=16, rms_norm_eps=1e-5, tie_word_embeddings=True,
                        rope_parameters=hf | {"rope_theta": 10000.0}).to_dict()
    assert "rope_scaling" not in saved and config_mismatches(spec, saved) == []
    # as import-gguf writes it, and a config that leaves the scaling out
    legacy = {key: value for key, value in saved.items() if key != "rope_parameters"}
    assert config_mismatches(spec, legacy | {"rope_theta": 10000.0, "rope_scaling": hf}) == []
    assert config_mismatches(spec, legacy | {"rope_theta": 10000.0}) == [
        f"rope_scaling is None in config.json but {hf!r} in the spec"]


def test_transformers_phi3_config_describes_llamas_block_with_fused_tensors():
    from transformers import Phi3Config

    spec = parse_spec(llama_spec(fused_qkv=True, rope={"theta": 10000.0, "dims": 2},
                                 pattern=[{"window": 4}]) | {}, "phi3.toml")
    spec = parse_spec(spec.model_dump(exclude_none=True) | {
        "block": spec.block.model_dump(exclude_none=True) | {
            "mlp": spec.block.mlp.model_dump() | {"fused_gate_up": True}}}, "phi3.toml")
    saved = Phi3Config(vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                       rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=10000.0,
                       partial_rotary_factor=0.5, sliding_window=4, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2, original_max_position_embeddings=16).to_dict()
    assert config_mismatches(spec, saved) == []
    assert config_mismatches(spec, saved | {"sliding_window": None}) == [
        "sliding_window is None in config.json but 4 in the spec"]
    assert config_mismatches(spec, llama_tiny_config()) == [
        "model_type is 'llama' in config.json but the spec is 'phi3'"]
    half_fused = parse_spec(llama_spec(fused_qkv=True), "odd.toml")
    assert config_mismatches(half_fused, {"model_type": "phi3"}) == [
        "config.json cannot describe the spec's q, k, v and gate, up stored as one tensor each only in part"]
