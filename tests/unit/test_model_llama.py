"""Our Llama saved by us and run by transformers (LlamaForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM, MistralForCausalLM, GlmForCausalLM, Glm4ForCausalLM) from the same weights. The other direction, checkpoints that transformers wrote
read by us, is tests/unit/test_model_config_fidelity.py."""

import pytest
import torch
import transformers

from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import load_pretrained, save_pretrained
from stages.model import FLAVOURS, build_model, config_for_flavour
from stages.model.config import ARCHITECTURES

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}


@pytest.mark.parametrize("overrides", [
    {},  # GQA (4 query heads, 2 kv heads), untied
    {"num_key_value_heads": 4, "tie_word_embeddings": True},  # MHA, tied embeddings (Llama 3.2 style)
    {"rope_scaling": LLAMA3_SCALING, "rope_theta": 500000.0},  # Llama 3.1 RoPE scaling
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"model_type": "qwen2", "attention_bias": True},  # Qwen2: q/k/v bias, none on o_proj
    {"attention_bias": True, "mlp_bias": True, "head_dim": 32},  # Llama: q/k/v/o and MLP biases
    {"model_type": "mistral", "sliding_window": 8},  # window shorter than the 40-token probe
    {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    {"rope_layout": "rope_parameters", "max_position_embeddings": 16,  # transformers-5 layout
     "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}},
    {"max_position_embeddings": 16, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    {"model_type": "qwen3", "attention_bias": True},  # Qwen3: q/k norms, q/k/v/o bias
    {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
     "rope_layout": "rope_parameters", "head_dim": 32},
    {"model_type": "glm", "attention_bias": True, "partial_rotary_factor": 0.5},  # GLM: half of each head, pairs
    {"model_type": "glm4", "attention_bias": True, "partial_rotary_factor": 0.5, "rope_layout": "rope_parameters"},
    {"model_type": "glm4", "partial_rotary_factor": 0.75, "head_dim": 32, "tie_word_embeddings": True,
     "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
], ids=["gqa", "tied-mha", "llama3-rope", "linear-rope", "qwen2-bias", "llama-biases-head-dim", "mistral-window",
        "qwen2-window", "yarn-rope-parameters", "dynamic-rope", "qwen3-bias", "qwen3-window", "glm", "glm4",
        "glm4-partial-linear-rope"])
def test_logits_match_transformers(tmp_path, overrides):
    config = config_for_flavour("debug", vocab_size=301, **overrides)
    ours = build_model(config, seed=0).eval()
    with torch.no_grad():  # zero-init biases and unit norms would hide a bias or norm bug
        for name, p in ours.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
            elif name.endswith("norm.weight"):
                p.normal_(1, 0.2)
    with atomic_dir(tmp_path / "m") as out:
        save_pretrained(ours, out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    assert type(theirs).__name__ == ARCHITECTURES[config.model_type]
    ids = torch.randint(0, 301, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=0, atol=1e-5)


def test_loss_matches_transformers(tmp_path):
    ours = build_model(config_for_flavour("debug", vocab_size=128), seed=3)
    with atomic_dir(tmp_path / "m") as out:
        save_pretrained(ours, out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    ids = torch.randint(0, 128, (3, 17))
    labels = ids.clone()
    labels[:, :5] = -100  # prompt tokens are not learned
    _, loss = ours(ids, labels=labels)
    torch.testing.assert_close(loss, theirs(ids, labels=labels).loss, rtol=1e-6, atol=1e-6)


def test_round_trip_through_hf_layout_is_exact(tmp_path):
    model = build_model(config_for_flavour("debug", vocab_size=64, tie_word_embeddings=True), seed=5)
    with atomic_dir(tmp_path / "m") as out:
        save_pretrained(model, out)
    again = load_pretrained(tmp_path / "m")
    assert again.lm_head.weight is again.model.embed_tokens.weight
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n


def test_same_seed_same_weights_and_meta_device_builds_large_flavours():
    a = build_model(config_for_flavour("debug", vocab_size=64), seed=11)
    b = build_model(config_for_flavour("debug", vocab_size=64), seed=11)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    for flavour in FLAVOURS:
        config = config_for_flavour(flavour, vocab_size=32000)
        big = build_model(config, device="meta")
        assert sum(p.numel() for p in big.parameters()) == config.num_parameters()
    for overrides in ({"attention_bias": True, "mlp_bias": True, "head_dim": 32}, {"model_type": "qwen2"},
                      {"model_type": "mistral", "head_dim": 8, "tie_word_embeddings": True}):
        config = config_for_flavour("debug", vocab_size=64, **overrides)
        small = build_model(config, device="meta")
        assert sum(p.numel() for p in small.parameters()) == config.num_parameters(), overrides
    assert 6.5e9 < config_for_flavour("7b", vocab_size=32000).num_parameters() < 7e9


def test_bad_model_config_errors_name_the_numbers():
    with pytest.raises(ValueError, match="num_attention_heads=4 is not a multiple of num_key_value_heads=3"):
        config_for_flavour("debug", vocab_size=10, num_key_value_heads=3)
    with pytest.raises(ValueError, match="model.flavour='huge'"):
        config_for_flavour("huge", vocab_size=10)
