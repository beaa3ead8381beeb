"""stages/quant/weight_only.py (int8 / int4 weight-only kernel modules) and the kernel path of
stages/quant/loader.py, against the dequantized float reference.

Tolerances: with compute_dtype bfloat16 (the default) x and the scales are rounded to 8 significant
bits, so a layer's output may differ from the float32 reference by a few bfloat16 epsilons
(2**-8 = 0.0039) of the output's scale: asserted max |y - ref| <= 1e-2 * max |ref| (measured
0.003-0.004). With compute_dtype float32 the same kernels agree to float32 accumulation order
(<= 1e-5 * max |ref|, measured ~5e-7). The dequantized fallback equals the reference exactly.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
import transformers
from torch import nn

from stages import quantize
from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import save_pretrained, save_state_dict
from stages.errors import InputError
from stages.model import build_model, config_for_flavour
from stages.quant import gptq_format, load_quantized
from stages.quant.gptq import GPTQHessian, gptq_quantize
from stages.quant.loader import read_quantization_config
from stages.quant.rtn import quantize_weight
from stages.quant.weight_only import (GroupedCodes, Int4WeightOnlyLinear, Int8WeightOnlyLinear,
                                      apply_weight_only_kernels, kernel_module)

BF16_TOL = 1e-2  # of max |ref|: a few bfloat16 epsilons
FP32_TOL = 1e-5
VOCAB = 256


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _rel_max_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


def _gptq(w: torch.Tensor, bits: int, group_size: int, desc_act: bool = False, sym: bool = True):
    x = torch.randn(256, w.shape[1], generator=torch.Generator().manual_seed(1))
    x[:, : w.shape[1] // 8] *= 4  # uneven activations, so act-order really reorders
    h = GPTQHessian(w.shape[1])
    h.add_batch(x)
    return gptq_quantize(w, h.hessian, bits=bits, group_size=group_size, sym=sym, desc_act=desc_act)


def _case(name: str):
    """(GPTQ tensors, bits, checkpoint format) of one small layer, quantized as `name` says."""
    gen = torch.Generator().manual_seed(0)
    out_f, in_f = {"wint4-out40": (40, 256), "wint8-in72": (64, 72), "gptq-w4-g64-last32": (64, 288),
                   "gptq-w4-g64-last32-act": (64, 288)}.get(name, (64, 256))
    w = torch.randn(out_f, in_f, generator=gen) * 0.05
    if name.startswith("wint"):
        bits = 8 if name.startswith("wint8") else 4
        group = {"wint4-g32": 32, "wint4-g64": 64, "wint4-g16": 16, "wint8-g32": 32}.get(name, -1)
        q, g_idx, fmt = quantize_weight(w, bits, group), None, "gptq_v2"
    else:
        bits, group, desc_act = {"gptq-w4-act": (4, 32, True), "gptq-w4-ragged": (4, 40, False),
                                 "gptq-w4-g64-last32": (4, 64, False), "gptq-w4-g64-last32-act": (4, 64, True),
                                 "gptq-w3": (3, 64, False), "gptq-w8-g32": (8, 32, False)}[name]
        q = _gptq(w, bits, group, desc_act)
        g_idx, fmt = q.g_idx, "gptq"
    return gptq_format.pack(q, fmt, g_idx=g_idx), bits, fmt


KERNEL_CASES = {  # case -> the kernel it must run on
    "wint8": "int8pack", "wint4-g32": "int4pack", "wint4-g64": "int4pack", "wint4-pc": "int4pack",
    "gptq-w4-act": "int4pack", "gptq-w3": "int4pack",
    # a narrower last group (288 = 4 x 64 + 32, as g128 leaves on a 576-wide model) is padded
    "gptq-w4-g64-last32": "int4pack", "gptq-w4-g64-last32-act": "int4pack",
    "gptq-w4-ragged": "dequantized", "wint4-g16": "dequantized", "gptq-w8-g32": "dequantized",
    "wint4-out40": "dequantized", "wint8-in72": "dequantized",
}


@pytest.mark.parametrize("case", sorted(KERNEL_CASES))
def test_kernel_modules_match_the_dequantized_reference(case):
    tensors, bits, fmt = _case(case)
    w_ref = gptq_format.dequantize_packed(tensors, bits, fmt)  # (out, in) float32
    codes = GroupedCodes.from_gptq(tensors, bits, fmt)
    assert torch.equal(codes.dequantize(), w_ref)
    bias = torch.randn(w_ref.shape[0], generator=torch.Generator().manual_seed(2))
    x = torch.randn(2, 5, w_ref.shape[1], generator=torch.Generator().manual_seed(3))  # (B, T, in)
    ref = x @ w_ref.t() + bias

    module, kernel = kernel_module(codes, bias)
    assert kernel == KERNEL_CASES[case]
    y = module(x)
    assert y.shape == ref.shape and y.dtype == torch.float32
    if kernel == "dequantized":  # the fallback is the reference itself
        assert isinstance(module, nn.Linear) and torch.equal(module.weight, w_ref)
        assert torch.equal(y, nn.functional.linear(x, w_ref, bias))
        return
    assert _rel_max_err(y, ref) <= BF16_TOL
    assert module(x.bfloat16()).dtype == torch.bfloat16  # returns in the input's dtype
    assert _rel_max_err(kernel_module(codes, bias, torch.float32)[0](x), ref) <= FP32_TOL
    # the weights are resident as codes: (out, in) int8 or (out, in / 2) uint8, plus small scales
    assert _bytes(module) < (0.3 if kernel == "int8pack" else 0.2) * 4 * w_ref.numel()


def test_act_order_gathers_input_columns():
    tensors, bits, fmt = _case("gptq-w4-act")
    assert not bool((tensors["g_idx"][1:] >= tensors["g_idx"][:-1]).all())  # really act-order
    module = Int4WeightOnlyLinear.from_codes(GroupedCodes.from_gptq(tensors, bits, fmt), compute_dtype=torch.float32)
    assert module.perm is not None and module.group_size == 32
    assert torch.equal(tensors["g_idx"].long()[module.perm], torch.arange(256) // 32)  # group order
    # with groups that equal runs of k, no permutation is kept
    assert Int4WeightOnlyLinear.from_codes(GroupedCodes.from_gptq(*_case("wint4-g64"))).perm is None


def test_symmetric_int8_has_no_zero_correction_and_float_cast_changes_compute_dtype():
    codes = torch.randint(0, 256, (32, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    sym = GroupedCodes(codes=codes, scales=torch.rand(32, 1) + 0.1, zeros=torch.full((32, 1), 128, dtype=torch.int32),
                       g_idx=torch.zeros(64, dtype=torch.long), bits=8)
    module = Int8WeightOnlyLinear.from_codes(sym)
    assert module.zero_correction is None and module.compute_dtype == torch.bfloat16
    module.float()  # model.float() turns the scales, so the compute dtype, to float32 ...
    assert module.compute_dtype == torch.float32
    x = torch.randn(3, 64)
    rounded = GroupedCodes(codes, sym.scales.bfloat16().float(), sym.zeros, sym.g_idx, 8)  # ... as rounded once
    assert _rel_max_err(module(x), x @ rounded.dequantize().t()) <= FP32_TOL


def test_apply_weight_only_kernels_names_a_layer_that_does_not_fit():
    tensors, bits, fmt = _case("wint4-g32")
    model = nn.Sequential(nn.Linear(256, 64), nn.Linear(64, 64))
    qcfg = {"bits": bits, "format": fmt}
    packed = {f"0.{k}": v for k, v in tensors.items()}
    kernels = apply_weight_only_kernels(model, packed, qcfg, {"0": False, "1": False})
    assert kernels == {"0": "int4pack"} and isinstance(model[0], Int4WeightOnlyLinear)
    with pytest.raises(ValueError, match=r"1: packed weight \(out, in\) = \(64, 256\) does not match.*\(64, 64\)"):
        apply_weight_only_kernels(model, {f"1.{k}": v for k, v in tensors.items()}, qcfg, {"1": False})
    with pytest.raises(ValueError, match="2.qweight names no Linear"):
        apply_weight_only_kernels(model, {f"2.{k}": v for k, v in tensors.items()}, qcfg, {"0": False})


# ---------------------------------------------------------------- end to end: load_quantized


def _gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                     bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight_only")
    out = {}
    for family in ("llama", "gpt2"):
        path = root / family
        with atomic_dir(path) as tmp:
            if family == "llama":  # debug flavour: widths 64 and 192
                save_pretrained(build_model(config_for_flavour("debug", vocab_size=VOCAB), seed=0), tmp)
            else:  # Conv1D layers, weights stored (in, out)
                _gpt2().save_pretrained(tmp)
            (tmp / "tokenizer_config.json").write_text("{}\n")  # stands in for the tokenizer files
        out[family] = path
    return out


@pytest.mark.parametrize("family,variant,group,kernel", [
    ("llama", "wint8", -1, "int8pack"), ("llama", "wint4", 32, "int4pack"), ("gpt2", "wint4", 64, "int4pack")])
def test_load_quantized_with_kernels_matches_the_reference(sources, tmp_path, family, variant, group, kernel):
    path = tmp_path / variant
    quantize.run(sources[family], path, variant, group)
    fast, ref = load_quantized(path), load_quantized(path, kernels=False)
    n_layers = 14 if family == "llama" else 8
    assert fast.quant_kernels == dict.fromkeys(ref.quant_kernels, kernel) and len(fast.quant_kernels) == n_layers
    assert set(ref.quant_kernels.values()) == {"dequantized"}
    assert getattr(fast.config, "quantization_config", None) is None

    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = fast(ids).logits, ref(ids).logits
    assert _rel_max_err(a, b) <= 2e-2  # bf16 through every layer, relative to the logit scale
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9

    quantized = [fast.get_submodule(n) for n in fast.quant_kernels]
    q_bytes = sum(_bytes(m) for m in quantized)
    f_bytes = sum(_bytes(ref.get_submodule(n)) for n in ref.quant_kernels)
    assert q_bytes < (0.3 if kernel == "int8pack" else 0.2) * f_bytes
    assert _bytes(fast) < _bytes(ref) - 0.7 * f_bytes
    # the non-quantized tensors are the reference's (loaded by transformers in both paths)
    ref_state = ref.state_dict()
    for key, t in fast.state_dict().items():
        if key.rpartition(".")[0] not in fast.quant_kernels:
            assert torch.equal(t, ref_state[key]), key


def test_a8w8_directories_go_to_apply_a8w8_state(sources, tmp_path, monkeypatch):
    """Only the dispatch: a stand-in for stages.quant.a8w8 receives every quantized layer's tensors
    with the model's float tensors, and simulate = not kernels."""
    src = transformers.AutoModelForCausalLM.from_pretrained(sources["llama"])
    state = {k: v for k, v in src.state_dict().items() if k != "lm_head.weight" or not src.config.tie_word_embeddings}
    name = "model.layers.0.mlp.down_proj"
    w = state.pop(f"{name}.weight")
    scale = w.abs().amax(1) / 127
    state.update({f"{name}.weight": torch.round(w / scale[:, None]).to(torch.int8), f"{name}.weight_scale": scale,
                  f"{name}.bias": torch.zeros(w.shape[0])})
    path = tmp_path / "a8w8"
    path.mkdir()
    save_state_dict(state, path)
    config = json.loads((sources["llama"] / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "a8w8"}}))

    calls = []

    def apply_a8w8_state(model, given, quantization_config, *, simulate=False):
        calls.append((set(given), quantization_config, simulate))
        layer = nn.Linear(w.shape[1], w.shape[0])
        model.get_submodule("model.layers.0.mlp").down_proj = layer
        return {name: "simulated" if simulate else "int_mm"}

    monkeypatch.setitem(sys.modules, "stages.quant.a8w8", types.SimpleNamespace(apply_a8w8_state=apply_a8w8_state))
    assert load_quantized(path).quant_kernels == {name: "int_mm"}
    assert load_quantized(path, kernels=False).quant_kernels == {name: "simulated"}
    given, qcfg, _ = calls[0]
    assert {f"{name}.weight", f"{name}.weight_scale", f"{name}.bias", "model.embed_tokens.weight"} <= given
    assert qcfg == {"quant_method": "a8w8"} and [c[2] for c in calls] == [False, True]


def test_unknown_quant_method_names_the_file_and_the_valid_ones(sources, tmp_path):
    config = json.loads((sources["llama"] / "config.json").read_text())
    path = tmp_path / "awq"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(InputError, match=r"awq/config\.json: quantization_config quant_method 'awq' is not "
                                         r"supported; valid methods: \['gptq', 'a8w8'\]"):
        read_quantization_config(path)
