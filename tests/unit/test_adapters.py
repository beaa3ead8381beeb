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


def test_all_linear_on_llama_is_the_default_list(debug_model_dir):
    """"all-linear" wraps exactly q, k, v, o, gate, up, down of every block (not lm_head) and, from
    the same seed, gives the very adapter the schema's default list gives."""
    default = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = {}
    for targets in (default, "all-linear"):
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(debug_model_dir, dtype=torch.float32)
        section = finetune_section("lora", target_modules=default).replace(target_modules=targets)
        model = attach_adapter(base, "lora", section)
        wrapped = {n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
        assert wrapped == set(default)
        adapters[str(targets)] = peft.get_peft_model_state_dict(model)
    a, b = adapters.values()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_target_modules_string_must_be_all_linear(base):
    check_target_modules(base, "all-linear")
    with pytest.raises(ValueError, match=r"target_modules='q_proj': a string must be 'all-linear'"):
        check_target_modules(base, "q_proj")


def test_gpt2_conv1d_layers_are_targets():
    """GPT-2's Conv1D layers (weight (in, out)) are LoRA targets; a dotted suffix picks one of two
    layers sharing a leaf name; fan_in_fan_out is set so peft applies B A transposed."""
    from transformers import GPT2Config

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=16, vocab_size=64))
    assert {"c_attn", "c_fc", "c_proj", "lm_head"} <= set(lora_modules(base))
    check_target_modules(base, ["c_attn", "mlp.c_proj"])
    with pytest.raises(ValueError, match=r"\['mlp\.c_attn'\]"):
        check_target_modules(base, ["mlp.c_attn"])
    section = finetune_section("lora", lora_rank=2) | {"target_modules": ["c_attn", "mlp.c_proj"]}
    model = attach_adapter(base, "lora", section)
    assert model.peft_config["default"].fan_in_fan_out
    wrapped = sorted(n for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer))
    assert [n.removeprefix("base_model.model.") for n in wrapped] == ["transformer.h.0.attn.c_attn",
                                                                     "transformer.h.0.mlp.c_proj"]
    with torch.no_grad():  # a non-zero B: the adapter's output must be B A x on the (in, out) weight
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    ids = torch.randint(0, 64, (1, 8))
    model.eval()  # GPT-2's dropout
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        merged = model.merge_and_unload()(input_ids=ids).logits
    torch.testing.assert_close(merged, adapted, rtol=0, atol=1e-5)
