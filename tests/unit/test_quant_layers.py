"""stages/quant/layers.py and the layer checks of stages/quant/model.py: which layers are quantized,
found by module type on a model built on the meta device, and the errors naming layer widths."""

import pytest
import torch
import transformers

from stages.quant.layers import decoder_blocks, decoder_linear_layers, meta_model
from stages.quant.model import quantize_model


def _gpt2():
    return meta_model(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=16, vocab_size=64))


def test_meta_model_holds_no_weights():
    model = _gpt2()
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize("config,blocks,expected", [
    (transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              vocab_size=64),
     "model.layers", {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}),
    (transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=16, vocab_size=64),
     "transformer.h", {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}),
    (transformers.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
                            word_embed_proj_dim=32, vocab_size=64),
     "model.decoder.layers", {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
                              "fc1", "fc2"}),
    (transformers.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                vocab_size=64),
     "gpt_neox.layers", {"attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"}),
])
def test_decoder_linear_layers_by_family(config, blocks, expected):
    model = meta_model(config)
    assert decoder_blocks(model) == blocks
    layers = decoder_linear_layers(model)
    assert set(layers) == {f"{blocks}.{i}.{name}" for i in range(2) for name in expected}
    # lm_head, embeddings and norms are never included; only GPT-2's Conv1D is stored transposed
    assert not any("lm_head" in n or "embed" in n for n in layers)
    assert set(layers.values()) == {isinstance(config, transformers.GPT2Config)}


def test_ambiguous_blocks_are_refused():
    class TwoStacks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = transformers.LlamaConfig(num_hidden_layers=2)
            self.a = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
            self.b = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])

    with pytest.raises(ValueError, match=r"cannot tell the decoder blocks apart: .*\['a', 'b'\]"):
        decoder_blocks(TwoStacks())


def _gpt2_state(n_embd: int = 32) -> tuple[dict[str, torch.Tensor], dict[str, bool]]:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=n_embd, n_layer=1, n_head=2,
                                                                 n_positions=16, vocab_size=64))
    return model.state_dict(), decoder_linear_layers(model)


def test_conv1d_is_quantized_as_its_out_in_view():
    state, layers = _gpt2_state()
    packed, errors = quantize_model(state, layers, bits=8, group_size=-1)
    # c_attn: Conv1D weight (in=32, out=96) -> GPTQ qweight (in // 4, out), scales (1, out)
    assert tuple(state["transformer.h.0.attn.c_attn.weight"].shape) == (32, 96)
    assert tuple(packed["transformer.h.0.attn.c_attn.qweight"].shape) == (32 // 4, 96)
    assert tuple(packed["transformer.h.0.attn.c_attn.scales"].shape) == (1, 96)
    assert tuple(packed["transformer.h.0.mlp.c_proj.qweight"].shape) == (128 // 4, 32)
    assert "transformer.h.0.attn.c_attn.weight" not in packed and "transformer.h.0.attn.c_attn.bias" in packed
    assert max(errors.values()) < 0.01


def test_group_size_error_names_the_layer_widths():
    state, layers = _gpt2_state()
    with pytest.raises(ValueError, match=r"group_size=48 does not divide the input width\(s\) \[32, 128\] .*"
                                         r"transformer\.h\.0\.attn\.c_attn has 32, transformer\.h\.0\.mlp\.c_proj "
                                         r"has 128.*divisor of 32 or -1"):
        quantize_model(state, layers, bits=4, group_size=48)


def test_unpackable_width_and_missing_tensor_name_the_layer():
    state, layers = _gpt2_state(n_embd=36)  # c_attn out = 108: not a multiple of 8 codes per word
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.c_attn: weight \(out=108, in=36\) cannot be "
                                         r"packed at 4 bits.*divisible by 8"):
        quantize_model(state, layers, bits=4, group_size=-1)
    state, layers = _gpt2_state()
    del state["transformer.h.0.mlp.c_fc.weight"]
    with pytest.raises(ValueError, match=r"no tensor transformer\.h\.0\.mlp\.c_fc\.weight"):
        quantize_model(state, layers, bits=8, group_size=-1)
