"""stages/deployment/compressed_tensors.py and smooth_fold.py: A8W8 variants of the quantize stage
written in the compressed-tensors format and loaded by transformers (with the `compressed-tensors`
package) on CPU, against our loader (`stages.quant.load_quantized`); the folds and the refusals.

What transformers computes on CPU (compressed-tensors 0.20): the int8 weights are decompressed to
float on the first forward (W = Wq * sw, exact), and every quantized Linear fake-quantizes its
input (quantize-dequantize in float) before a float matmul: per token with scale max|x| / 127.5 on
codes [-128, 127] (dynamic), or with our input_scale (static). Our loader uses max|x| / 127 on
[-127, 127], so the dynamic exports differ from it by that rounding; with the runtime's grid put
into our layer (`_runtime_grid`) the logits are equal up to the norm fold's float rounding.

The model is a debug-flavour Llama (multi-head, so o_proj folds into v_proj) trained for a few
seconds on a fixed bigram language: its next-token choices have real margins. On a random-init
model top-1 flips under any 8-bit noise (float vs our A8W8 agree on 98.6% there), which measures
the probe, not the format.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

import stages.quant.a8w8 as a8w8
from stages import quantize
from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import save_pretrained
from stages.data.corpus import write_token_files
from stages.deployment.compressed_tensors import check_layers, main, quantization_config, write_compressed_tensors
from stages.deployment.smooth_fold import fold_smoothing
from stages.errors import InputError
from stages.model import build_model, config_for_flavour
from stages.quant import load_quantized

TOP1 = 0.99
CUSTOM = {"a8w8-smooth-all-static": {"method": "a8w8", "activation": "static", "smooth": True,
                                     "smooth_all_linears": True}}
VARIANTS = ["a8w8", "a8w8-static", "a8w8-smooth", "a8w8-smooth-all-static"]
LAYERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj")


def _bigram_ids(successor: torch.Tensor, n: int, length: int, seed: int) -> torch.Tensor:
    """(n, length) sequences of the language t -> successor[t], from random first tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(n, length, dtype=torch.long)
    ids[:, 0] = torch.randint(3, len(successor), (n,), generator=g)
    for t in range(1, length):
        ids[:, t] = successor[ids[:, t - 1]]
    return ids


@pytest.fixture(scope="module")
def bigram(tmp_path_factory, tiny_tokenizer_dir):
    """(float model dir, prepared data dir, probe ids (8, 64)) of the trained debug Llama."""
    root = tmp_path_factory.mktemp("ct_bigram")
    vocab = len(transformers.PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir))
    successor = torch.arange(vocab)
    successor[3:] = torch.randperm(vocab - 3, generator=torch.Generator().manual_seed(0)) + 3  # ids 0-2 special
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-wide model: more threads only contend on a shared machine
    try:
        model = build_model(config_for_flavour("debug", vocab_size=vocab, num_key_value_heads=4, bos_token_id=1,
                                               eos_token_id=2, pad_token_id=0), seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(150):  # ~3 s; the loss falls from 5.7 to ~0.02
            ids = _bigram_ids(successor, 8, 32, seed=step)
            loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, vocab), ids[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    with atomic_dir(root / "float") as tmp:
        save_pretrained(model.eval(), tmp, tokenizer_dir=tiny_tokenizer_dir)
    splits = {"train": _bigram_ids(successor, 12, 100, 10**6).tolist(),
              "validation": _bigram_ids(successor, 2, 100, 10**6 + 1).tolist()}
    write_token_files(root / "data", splits, vocab_size=vocab, bos_id=1, eos_id=2, pad_id=0)
    return root / "float", root / "data", _bigram_ids(successor, 8, 64, seed=12345)


@pytest.fixture(scope="module")
def exported(bigram, tmp_path_factory):
    """{variant: (a8w8 dir, compressed-tensors dir, metrics)} made by the quantize stage and the writer."""
    source, data, _ = bigram
    root = tmp_path_factory.mktemp("ct_export")
    section = {"calibration": {"num_samples": 8, "seq_len": 64, "source": "corpus", "seed": 0},
               "custom_variants": CUSTOM}
    out = {}
    for variant in VARIANTS:
        quantize.run(source, root / variant, variant, config=section, data_dir=data)
        metrics = write_compressed_tensors(root / variant, root / f"{variant}-ct")
        out[variant] = (root / variant, root / f"{variant}-ct", metrics)
    return out


def _runtime_grid(x: torch.Tensor, input_scale: torch.Tensor | None = None):
    """compressed-tensors' symmetric int8 activation grid, in place of ours in A8W8Linear."""
    if input_scale is None:
        amax = x.abs().amax(dim=1, keepdim=True)
        input_scale = torch.where(amax > 0, amax / 127.5, torch.ones_like(amax))
    return torch.round(x / input_scale).clamp_(-128, 127).to(torch.int8), input_scale


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def _top1(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


# ---------------------------------------------------------------- transformers loads the export


@pytest.mark.parametrize("variant", VARIANTS)
def test_transformers_runs_the_export_like_our_loader(bigram, exported, variant, monkeypatch):
    pytest.importorskip("compressed_tensors")
    ids = bigram[2]
    a8w8_dir, ct_dir, _ = exported[variant]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(ct_dir, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    static = "static" in variant
    for i, block in enumerate(model.model.layers):
        for leaf in LAYERS:
            scheme = block.get_submodule(leaf).quantization_scheme
            assert scheme.input_activations.strategy == ("tensor" if static else "token"), (i, leaf)
    assert getattr(model.lm_head, "quantization_scheme", None) is None  # ignored: stays float

    out = _logits(model.eval(), ids)
    ours = load_quantized(a8w8_dir, kernels=False)
    reference = _logits(ours, ids)
    monkeypatch.setattr(a8w8, "quantize_activation_int8", _runtime_grid)
    emulated = _logits(ours, ids)
    # Measured: bit-identical without smoothing; with smoothing the folded norm computes x * (g / s)
    # where our layer computes (x * g) / s, and the rounding moves a few activation codes by one
    # step: relative difference 9.6e-4 (a8w8-smooth), 4.1e-4 (a8w8-smooth-all-static).
    assert _rel(out, emulated) < (5e-3 if "smooth" in variant else 1e-6)
    # Measured top-1 against our loader: a8w8 0.998, a8w8-static 1.0, a8w8-smooth 1.0,
    # a8w8-smooth-all-static 1.0; relative logit difference 1.1e-2 dynamic (the two grids), 6e-4
    # static (probe activations beyond the calibrated range clamp at -128 there, -127 here).
    assert _top1(out, reference) >= TOP1
    assert _rel(out, reference) < (3e-2 if not static else 5e-3)


def test_config_parses_in_compressed_tensors(exported):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    for variant in ("a8w8", "a8w8-static"):
        qcfg = json.loads((exported[variant][1] / "config.json").read_text())["quantization_config"]
        assert (qcfg["quant_method"], qcfg["format"], qcfg["ignore"]) == ("compressed-tensors", "int-quantized",
                                                                           ["lm_head"])
        parsed = QuantizationConfig.model_validate(qcfg)
        scheme = parsed.config_groups["group_0"]
        assert scheme.targets == ["Linear"] and scheme.format == "int-quantized"
        assert parsed.quantization_status == "compressed"
        hf = transformers.CompressedTensorsConfig.from_dict(qcfg)
        assert ModelCompressor.from_compression_config(hf).quantization_config.config_groups == parsed.config_groups
        w8a8 = preset_name_to_scheme("W8A8", ["Linear"])  # INT8 per channel, dynamic per-token inputs
        assert scheme.weights == w8a8.weights
        if variant == "a8w8":
            assert scheme.input_activations == w8a8.input_activations
        else:
            args = scheme.input_activations
            assert (args.strategy, args.dynamic, args.symmetric, args.num_bits) == ("tensor", False, True, 8)
    assert ct.__version__.startswith("0.20")


# ---------------------------------------------------------------- what is written


def test_tensors_carry_our_codes_and_the_folded_scales(bigram, exported):
    a8w8_dir, ct_dir, metrics = exported["a8w8-smooth-all-static"]
    ours, theirs = load_file(a8w8_dir / "model.safetensors"), load_file(ct_dir / "model.safetensors")
    floats = load_file(bigram[0] / "model.safetensors")
    assert not [k for k in theirs if k.endswith((".smooth_scale", ".input_shift"))]
    for i in range(2):
        p = f"model.layers.{i}"
        for leaf in LAYERS:
            name = f"{p}.{leaf}"
            assert torch.equal(theirs[f"{name}.weight"], ours[f"{name}.weight"])  # the same int8 codes
            assert theirs[f"{name}.weight_scale"].shape == (ours[f"{name}.weight"].shape[0], 1)
            assert theirs[f"{name}.input_scale"].shape == (1,)
            assert theirs[f"{name}.input_scale"].item() == ours[f"{name}.input_scale"].item()
        for norm, reader in (("input_layernorm", "self_attn.q_proj"), ("post_attention_layernorm", "mlp.up_proj")):
            torch.testing.assert_close(theirs[f"{p}.{norm}.weight"],
                                       floats[f"{p}.{norm}.weight"] / ours[f"{p}.{reader}.smooth_scale"])
        for consumer, producer in (("self_attn.o_proj", "self_attn.v_proj"), ("mlp.down_proj", "mlp.up_proj")):
            torch.testing.assert_close(theirs[f"{p}.{producer}.weight_scale"][:, 0],
                                       ours[f"{p}.{producer}.weight_scale"] / ours[f"{p}.{consumer}.smooth_scale"])
        q = f"{p}.self_attn.q_proj.weight_scale"
        assert torch.equal(theirs[q][:, 0], ours[q])  # not a producer: its scales as they were
    assert torch.equal(theirs["lm_head.weight"], floats["lm_head.weight"])
    assert (metrics["folded_norms"], metrics["folded_row_producers"], metrics["num_quantized_layers"]) == (4, 4, 14)
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "meta.json"} <= \
        {f.name for f in ct_dir.iterdir()}
    assert json.loads((ct_dir / "meta.json").read_text())["metrics"] == metrics


def test_cli_writes_the_same_directory(exported, tmp_path):
    a8w8_dir, ct_dir, _ = exported["a8w8-static"]
    metrics = main(["--model", str(a8w8_dir), "--out", str(tmp_path / "ct")])
    assert metrics["activation"] == "static"
    assert load_file(tmp_path / "ct" / "model.safetensors").keys() == load_file(ct_dir / "model.safetensors").keys()


# ---------------------------------------------------------------- refusals


def test_shift_is_refused_naming_the_setting(bigram, tmp_path):
    source, data, _ = bigram
    section = {"calibration": {"num_samples": 2, "seq_len": 32, "source": "corpus", "seed": 0}}
    quantize.run(source, tmp_path / "shift", "a8w8-smooth-shift", config=section, data_dir=data)
    with pytest.raises(InputError, match=r"input_shift: the variant was quantized with quantize\.a8w8\.shift .*"
                                         r"re-quantize with shift: false"):
        write_compressed_tensors(tmp_path / "shift", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_gptq_layout_directory_is_refused(debug_model_dir, tmp_path):
    quantize.run(debug_model_dir, tmp_path / "wint8", "wint8")
    with pytest.raises(InputError, match="is a 'gptq' checkpoint; the compressed-tensors export takes an a8w8"):
        write_compressed_tensors(tmp_path / "wint8", tmp_path / "out")


def test_gpt2_conv1d_is_refused_by_name():
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2).to_dict()
    with pytest.raises(InputError, match=r"transformer\.h\.0\.attn\.c_attn is a Conv1D \(model_type='gpt2'"):
        check_layers(config, ["transformer.h.0.attn.c_attn"])


LLAMA = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 8}


def _attention_state(s_o: torch.Tensor) -> dict[str, torch.Tensor]:
    """One block of A8W8 tensors, hidden 8, 4 heads of 2 over 2 kv heads: q/k/v smoothed alike, o smoothed."""
    g = torch.Generator().manual_seed(0)
    s_in = torch.rand(8, generator=g) + 0.5
    state = {"model.layers.0.input_layernorm.weight": torch.rand(8, generator=g) + 0.5}
    for leaf, out in (("q_proj", 8), ("k_proj", 4), ("v_proj", 4), ("o_proj", 8)):
        name = f"model.layers.0.self_attn.{leaf}"
        state[f"{name}.weight"] = torch.randint(-127, 128, (out, 8), generator=g, dtype=torch.int8)
        state[f"{name}.weight_scale"] = torch.rand(out, generator=g) + 0.1
        state[f"{name}.smooth_scale"] = s_o if leaf == "o_proj" else s_in.clone()
    return state


def test_gqa_o_proj_folds_only_when_heads_sharing_a_kv_head_share_s():
    per_kv = torch.tensor([1.5, 2.0, 3.0, 4.0])  # (kv head, d) for 2 kv heads of head_dim 2
    s_o = per_kv.reshape(2, 1, 2).expand(2, 2, 2).reshape(8)  # heads 0,1 read kv 0; heads 2,3 kv 1
    state = _attention_state(s_o)
    folded, folds = fold_smoothing(state, LLAMA)
    assert folds == {"norms": 1, "row_producers": 1}
    v = "model.layers.0.self_attn.v_proj.weight_scale"
    torch.testing.assert_close(folded[v], state[v] / per_kv)
    torch.testing.assert_close(folded["model.layers.0.input_layernorm.weight"],
                               state["model.layers.0.input_layernorm.weight"]
                               / state["model.layers.0.self_attn.q_proj.smooth_scale"])

    uneven = _attention_state(torch.arange(1.0, 9.0))
    with pytest.raises(InputError, match=r"num_key_value_heads=2\): it cannot be folded into v_proj's rows; "
                                         r"re-quantize with quantize\.a8w8\.smooth_all_linears: false"):
        fold_smoothing(uneven, LLAMA)


def test_unfoldable_smoothing_is_refused_by_name():
    state = _attention_state(torch.ones(8))
    state["model.layers.0.self_attn.k_proj.smooth_scale"] *= 2
    with pytest.raises(InputError, match=r"input_layernorm feeds \['q_proj', 'k_proj', 'v_proj'\], whose smooth_scale "
                                         r"tensors differ \(q_proj: equal, k_proj: differs, v_proj: equal"):
        fold_smoothing(state, LLAMA)
    with pytest.raises(InputError, match=r"model_type='gemma' is not supported .*smooth: false"):
        fold_smoothing(_attention_state(torch.ones(8)), {**LLAMA, "model_type": "gemma"})
    odd = {"model.layers.0.mlp.fc1.weight_scale": torch.ones(2), "model.layers.0.mlp.fc1.smooth_scale": torch.ones(2)}
    with pytest.raises(InputError, match=r"mlp\.fc1\.smooth_scale: no fold is known"):
        fold_smoothing(odd, LLAMA)


def test_glm_folds_down_proj_into_the_up_half_of_gate_up_proj():
    """GLM's gate_up_proj is [gate; up] (2 x 3 rows here): post_attention_layernorm carries its s,
    and down_proj's s divides the up rows' scales (and bias) only; a Llama name in a GLM checkpoint
    has no fold."""
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0"
    s_in, s_down = torch.rand(8, generator=g) + 0.5, torch.rand(3, generator=g) + 0.5
    state = {f"{p}.post_attention_layernorm.weight": torch.rand(8, generator=g) + 0.5,
             f"{p}.mlp.gate_up_proj.weight_scale": torch.rand(6, generator=g) + 0.1,
             f"{p}.mlp.gate_up_proj.bias": torch.randn(6, generator=g),
             f"{p}.mlp.gate_up_proj.smooth_scale": s_in,
             f"{p}.mlp.down_proj.weight_scale": torch.rand(8, generator=g) + 0.1,
             f"{p}.mlp.down_proj.smooth_scale": s_down}
    glm = {**LLAMA, "model_type": "glm"}
    folded, folds = fold_smoothing(state, glm)
    assert folds == {"norms": 1, "row_producers": 1}
    torch.testing.assert_close(folded[f"{p}.post_attention_layernorm.weight"],
                               state[f"{p}.post_attention_layernorm.weight"] / s_in)
    for key in ("weight_scale", "bias"):
        before, after = state[f"{p}.mlp.gate_up_proj.{key}"], folded[f"{p}.mlp.gate_up_proj.{key}"]
        assert torch.equal(after[:3], before[:3])  # gate rows
        torch.testing.assert_close(after[3:], before[3:] / s_down)  # up rows
    assert not any(k.endswith(".smooth_scale") for k in folded)

    with pytest.raises(InputError, match=r"down_proj\.smooth_scale: 3 channels to fold, "
                                         r"model\.layers\.0\.mlp\.gate_up_proj has 4 rows, not 2 x 3"):
        fold_smoothing({**state, f"{p}.mlp.gate_up_proj.weight_scale": torch.ones(4)}, glm)
    llama_names = {f"{p}.mlp.up_proj.weight_scale": torch.ones(3), f"{p}.mlp.up_proj.smooth_scale": torch.ones(8)}
    with pytest.raises(InputError, match=r"mlp\.up_proj\.smooth_scale: no fold is known for this layer of "
                                         r"model_type='glm4'"):
        fold_smoothing(llama_names, {**LLAMA, "model_type": "glm4"})


def test_quantization_config_rejects_an_unknown_activation():
    with pytest.raises(ValueError, match="activation='per_channel'"):
        quantization_config("per_channel", [])


def test_the_deploy_stage_checks_the_export_against_our_loader_before_publishing(bigram, exported, tmp_path):
    pytest.importorskip("compressed_tensors")
    from stages import deploy

    a8w8_dir = exported["a8w8-smooth"][0]
    metrics = deploy.compressed_tensors(a8w8_dir, bigram[1], tmp_path / "ct")
    check = metrics["check"]
    assert check["top1_agreement"] >= TOP1 and "compressed-tensors" in check["runtime"], check
    assert check["prompt_texts"] > 0 and check["prompt_text_mismatches"] is not None  # from text: test_deploy.py
    assert json.loads((tmp_path / "ct" / "meta.json").read_text())["metrics"]["check"] == check
    assert metrics["folded_norms"] > 0 and (tmp_path / "ct" / "config.json").exists()
