"""Quantizing a mixture of experts (the moe-debug flavour, Mixtral blocks; and Qwen2-MoE with its
shared expert): every routed expert is quantized one Linear per expert and projection, as the
checkpoint names them, the routers stay float; the quantized directory loads into transformers'
model (whose fused experts are split back into Linears) and computes what the dequantized weights
compute; GPTQ gives an expert no calibration token reached round-to-nearest instead of failing."""

import logging

import pytest
import torch
import transformers
from safetensors import safe_open

from stages import quantize
from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import load_pretrained, save_pretrained
from stages.model import LlamaConfig, build_model, config_for_flavour
from stages.quant import load_quantized
from stages.quant.gptq import gptq_quantize_model
from stages.quant.gptq_config import GPTQConfig
from stages.quant.moe_experts import ExpertLinears

VOCAB = 256
GROUP = 32


def _source(path, config):
    with atomic_dir(path) as tmp:
        save_pretrained(build_model(config, seed=0), tmp)
        (tmp / "tokenizer_config.json").write_text("{}\n")  # stands in for the tokenizer files
    return path


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def source(request, tmp_path_factory):
    if request.param == "mixtral":
        config = config_for_flavour("moe-debug", vocab_size=VOCAB)
    else:
        config = LlamaConfig(model_type="qwen2_moe", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96)
    return _source(tmp_path_factory.mktemp(request.param) / "source", config)


def _logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out if torch.is_tensor(out) else out.logits


@pytest.mark.parametrize("variant", ["wint8", "wint4"])
def test_experts_are_quantized_and_routers_stay_float(source, tmp_path, variant):
    out = tmp_path / variant
    quantize.run(source, out, variant, GROUP)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    experts = "block_sparse_moe" if "block_sparse_moe" in str(keys) else "mlp"
    w1 = "w1" if experts == "block_sparse_moe" else "gate_proj"
    for e in range(4):
        assert f"model.layers.1.{experts}.experts.{e}.{w1}.qweight" in keys
    assert f"model.layers.0.{experts}.gate.weight" in keys and f"model.layers.0.{experts}.gate.qweight" not in keys
    if experts == "mlp":  # Qwen2-MoE: the shared expert is quantized, its one-output gate is a router
        assert "model.layers.0.mlp.shared_expert.down_proj.qweight" in keys
        assert "model.layers.0.mlp.shared_expert_gate.weight" in keys

    model = load_quantized(out)  # transformers' model, its fused experts split into quantized Linears
    assert isinstance(model.get_submodule("model.layers.0.mlp.experts"), ExpertLinears)
    kernels = model.quant_kernels
    assert sum(".experts." in name for name in kernels) == 2 * 4 * 3  # layers x experts x projections
    reference = load_quantized(out, kernels=False)  # the dequantized weights in transformers' fused experts
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    ours, theirs = _logits(model, ids), _logits(reference, ids)
    # the int8/int4 kernels compute in bf16 (stages.quant.weight_only): agreement, not equality
    assert float((ours - theirs).norm() / theirs.norm()) < 0.02
    source_logits = _logits(transformers.AutoModelForCausalLM.from_pretrained(source).eval(), ids)
    assert float((theirs - source_logits).norm() / source_logits.norm()) < (0.02 if variant == "wint8" else 0.2)


def test_gptq_quantizes_an_expert_no_token_reached_round_to_nearest(tmp_path, caplog):
    """One calibration token, top 1 of 4 experts: three experts get no Hessian; they are quantized
    with H = I (round-to-nearest on GPTQ's grid), with a warning naming them."""
    config = LlamaConfig(model_type="mixtral", vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                         num_experts_per_tok=1)
    model = load_pretrained(_source(tmp_path / "one", config)).eval()
    with caplog.at_level(logging.WARNING, logger="stages.quant.gptq"):
        results = gptq_quantize_model(model, model.model.layers, [torch.tensor([[5]])],
                                      GPTQConfig(bits=4, group_size=32), prefix="model.layers")
    unreached = {line.split(":")[0] for line in caplog.messages if "no calibration token" in line}
    assert len(unreached) == 3 * 2  # 3 experts x (w1/w3 share one Hessian, w2 its own)
    assert all(f"model.layers.0.block_sparse_moe.experts.{e}.w1" in results for e in range(4))
    assert "model.layers.0.block_sparse_moe.gate" not in results  # the router is not quantized
