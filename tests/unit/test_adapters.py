"""stages/adapters: peft configs from our config sections, trainable-parameter counts, and the
prefix-tuning behaviours this project relies on with transformers 5.23 + peft 0.21.2."""

from __future__ import annotations

import peft
import pytest
import torch
from sft_fixtures import finetune_section
from transformers import AutoModelForCausalLM

from stages.adapters import (attach_adapter, build_lora_config, build_prefix_config, check_target_modules,
                             count_parameters, lora_modules)


@pytest.fixture
def base(debug_model_dir):
    return AutoModelForCausalLM.from_pretrained(debug_model_dir, dtype=torch.float32)


def test_lora_config_maps_our_names_to_peft():
    section = finetune_section("lora", lora_rank=6, lora_alpha=12, lora_dropout=0.1, target_modules=["q_proj"])
    config = build_lora_config(section)
    assert (config.r, config.lora_alpha, config.lora_dropout) == (6, 12, 0.1)
    assert set(config.target_modules) == {"q_proj"}
    assert config.task_type == peft.TaskType.CAUSAL_LM


def test_prefix_config_maps_num_prefix_tokens():
    config = build_prefix_config(finetune_section("prefix", num_prefix_tokens=7))
    assert config.num_virtual_tokens == 7 and config.task_type == peft.TaskType.CAUSAL_LM


def test_unknown_target_module_names_it_and_the_choices(base):
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= set(lora_modules(base))
    with pytest.raises(ValueError, match=r"\['qkv_proj'\].*choose from \[.*'q_proj'"):
        check_target_modules(base, ["q_proj", "qkv_proj"])
    with pytest.raises(ValueError, match="target_modules is empty"):
        check_target_modules(base, [])


def test_lora_trains_only_lora_params_with_expected_count(base):
    section = finetune_section("lora", lora_rank=4, target_modules=["q_proj", "down_proj"])
    linears = {n: m for n, m in base.named_modules() if n.endswith(("q_proj", "down_proj"))}
    expected = sum(4 * (m.in_features + m.out_features) for m in linears.values())
    _, base_total = count_parameters(base)
    model = attach_adapter(base, "lora", section)
    trainable, total = count_parameters(model)
    assert trainable == expected and total == base_total + expected
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_A" in n or "lora_B" in n for n in names)


def test_prefix_trains_only_the_prefix_with_expected_count(base):
    c = base.config
    model = attach_adapter(base, "prefix", finetune_section("prefix", num_prefix_tokens=5))
    trainable, _ = count_parameters(model)
    head_dim = c.hidden_size // c.num_attention_heads
    # one key and one value vector per layer and prefix token, GQA-sized (kv heads, not query heads)
    assert trainable == c.num_hidden_layers * 2 * 5 * c.num_key_value_heads * head_dim
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["prompt_encoder.default.embedding.weight"]


def test_unknown_method_is_rejected(base):
    with pytest.raises(ValueError, match="method='ia3' is unknown"):
        attach_adapter(base, "ia3", {})


def test_prefix_forward_and_generate_agree(base):
    """The checks behind stages/adapters/prefix.py's compatibility note: the prefix reaches the
    logits and the gradient, real tokens keep positions 0.., and generate = step-by-step greedy."""
    torch.manual_seed(0)
    model = attach_adapter(base, "prefix", finetune_section("prefix", num_prefix_tokens=4))
    with torch.no_grad():
        model.prompt_encoder.default.embedding.weight.normal_(0, 3.0)  # a prefix that matters
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    model.train()
    model(input_ids=ids).logits.sum().backward()
    assert model.prompt_encoder.default.embedding.weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        with model.disable_adapter():
            plain = model(input_ids=ids).logits
        prefixed = model(input_ids=ids).logits
        positioned = model(input_ids=ids, position_ids=torch.arange(5)[None]).logits
        assert (prefixed - plain).abs().max() > 1e-2
        torch.testing.assert_close(prefixed, positioned, rtol=0, atol=1e-6)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                             do_sample=False, output_scores=True, return_dict_in_generate=True)
        again = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
        cur = ids
        for _ in range(5):
            cur = torch.cat([cur, model(input_ids=cur).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        full = model(input_ids=out.sequences).logits
    assert out.sequences.tolist() == cur.tolist() == again.tolist()
    for i, score in enumerate(out.scores):  # cached decoding = full forward, 1e-5 for fp32 reordering
        torch.testing.assert_close(score[0], full[0, ids.shape[1] - 1 + i], rtol=0, atol=1e-5)
