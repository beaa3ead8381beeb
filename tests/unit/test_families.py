"""Every stage after fine-tuning, for every causal-LM family: LoRA ("all-linear") and prefix tuning
(stages/finetune.py), merge, RTN quantization to the GPTQ layout and loading it back, ONNX export
and evaluation, on a tiny random-init checkpoint of each family saved by the installed transformers
(each family's own config class: hidden 64, 2 layers, 4 heads, the 320-token test tokenizer).

The chain of one family is built once (module-scoped fixtures) and the tests read its artifacts.
Default run: LoRA, merge, both quantizations, export and two evaluations per family; `slow` adds
prefix tuning and the evaluation of the adapters and of wint8.
"""

from __future__ import annotations

import json
import math

import numpy as np
import peft
import pytest
import torch
import transformers
from genai_fixtures import genai_greedy
from safetensors import safe_open
from sft_fixtures import finetune_section, toy_records, write_toy_data
from transformers import AutoModelForCausalLM

from stages import evaluate, export, finetune, merge, quantize
from stages.adapters.peft_files import adapted_module
from stages.checkpoint.atomic import write_json
from stages.checkpoint.hf import copy_tokenizer
from stages.data.tokenizer import TokenizerError, load_model_tokenizer, save_tokenizer, train_tokenizer
from stages.deployment.onnx_generate import OnnxDecoder, greedy_generate
from stages.quant import decoder_linear_layers, load_quantized
from stages.quant.layers import checkpoint_model
from stages.model.registry import BY_MODEL_TYPE
from stages.quant.moe_experts import is_moe, unfuse_experts

GROUP = 32  # divides every input width below (64, 128, 256)
SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)


def _family_config(family: str, special: dict) -> transformers.PretrainedConfig:
    """A tiny config of `family` in its own config class (its own argument names)."""
    if family in ("llama", "qwen2", "mistral"):
        cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "mistral": transformers.MistralConfig}[family]
        return cls(**SIZES, intermediate_size=128, num_key_value_heads=2, max_position_embeddings=128, **special)
    if family in ("qwen3", "glm", "glm4"):  # their classes default head_dim to 128, not hidden / heads
        cls = {"qwen3": transformers.Qwen3Config, "glm": transformers.GlmConfig,
               "glm4": transformers.Glm4Config}[family]
        return cls(**SIZES, intermediate_size=128, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                   **special)  # GlmConfig's default pad / eos ids lie outside the test vocabulary
    if family == "mixtral":
        return transformers.MixtralConfig(**SIZES, intermediate_size=128, num_key_value_heads=2,
                                          max_position_embeddings=128, num_local_experts=4, **special)
    if family == "qwen2_moe":  # its shared expert too
        return transformers.Qwen2MoeConfig(**SIZES, intermediate_size=128, num_key_value_heads=2,
                                           max_position_embeddings=128, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=64, shared_expert_intermediate_size=128, **special)
    if family == "qwen3_moe":  # a dense layer among the sparse ones (mlp_only_layers)
        return transformers.Qwen3MoeConfig(**SIZES, intermediate_size=128, num_key_value_heads=2, head_dim=16,
                                           max_position_embeddings=128, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=64, mlp_only_layers=[0], **special)
    if family == "olmoe":
        return transformers.OlmoeConfig(**SIZES, intermediate_size=64, num_key_value_heads=2,
                                        max_position_embeddings=128, num_experts=4, num_experts_per_tok=2,
                                        clip_qkv=8.0, **special)
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, **special)
    if family == "opt":
        return transformers.OPTConfig(**SIZES, ffn_dim=128, max_position_embeddings=128, word_embed_proj_dim=64,
                                      **special)
    if family == "bloom":
        return transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, **special)
    if family == "gpt_neox":
        return transformers.GPTNeoXConfig(**SIZES, intermediate_size=128, max_position_embeddings=128, **special)
    raise KeyError(family)


FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "glm", "glm4", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt2",
            "opt", "bloom", "gpt_neox")
# Which torch model export uses: ours where it implements the family (Mistral: when stages.model does).
EXPORT_MODEL = {"llama": "project", "qwen2": "project", "qwen3": "project", "glm": "project", "glm4": "project",
                "mixtral": "project", "qwen2_moe": "project", "qwen3_moe": "project", "olmoe": "project",
                "gpt2": "transformers", "opt": "transformers", "bloom": "transformers", "gpt_neox": "transformers"}
ADAPTERS = ("lora", "prefix")
EVAL_CONFIG = {"max_new_tokens": 4, "num_dev_examples": 4, "ppl_max_length": 16, "ppl_max_windows": 2,
               "per_device_eval_batch_size": 4}


def _write_corpus(data_dir, tokenizer) -> None:
    """prepare's token files for evaluate: <split>.bin (uint16 ids, eos after each document) + index.json."""
    texts = [f"{r.src[0]} {r.tgt[0]}" for r in toy_records()]
    splits = {}
    for split, docs in (("train", texts[:40]), ("validation", texts[40:])):
        ids = [i for doc in docs for i in tokenizer(doc, add_special_tokens=False)["input_ids"] + [2]]
        np.asarray(ids, dtype="<u2").tofile(data_dir / f"{split}.bin")
        splits[split] = {"tokens": f"{split}.bin", "num_tokens": len(ids), "num_documents": len(docs)}
    write_json(data_dir / "index.json", {"dtype": "uint16", "vocab_size": len(tokenizer), "bos_token_id": 1,
                                         "eos_token_id": 2, "pad_token_id": 0, "splits": splits})


def _probe(vocab_size: int) -> torch.Tensor:
    return torch.randint(3, vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model.eval()(input_ids=ids).logits.float()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE of ~320 tokens in prepare's format (stages.data.tokenizer)."""
    texts = [f"{r.src[0]} {r.tgt[0]}" for r in toy_records()]
    return save_tokenizer(train_tokenizer(texts * 4, vocab_size=320), tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module", params=FAMILIES)
def chain(request, tmp_path_factory, tokenizer_dir):
    """One family's chain: base -> LoRA ("all-linear") -> merge -> wint8, wint4, and the evaluation
    of the merged and wint4 models (the ONNX export is `exported`'s, which only its tests wait on:
    the slow tests below run without it). Returns (family, root dir, {stage: metrics})."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    vocab_size = len(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    config = _family_config(family, dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "base")
    copy_tokenizer(tokenizer_dir, root / "base")
    # Tokenize as finetune and evaluate load it (the same vocabulary from the model and adapter dirs).
    tokenizer = load_model_tokenizer(root / "base")
    data = write_toy_data(root / "data")
    _write_corpus(data, tokenizer)
    dev = finetune.load_examples(data / "sft" / "dev.json", tokenizer, 16, 24)

    m = {"base_dev_loss": finetune.dev_loss(AutoModelForCausalLM.from_pretrained(root / "base"), dev, 8, 0)}
    lora = finetune_section("lora", max_steps=8, learning_rate=1e-2, lr_scheduler_type="constant",
                            target_modules="all-linear")  # the schema's default: the same for every family
    m["lora"] = finetune.run("lora", root / "base", data, root / "lora", lora)
    m["merge"] = merge.run(root / "lora", root / "merged")
    for variant in ("wint8", "wint4"):
        m[variant] = quantize.run(root / "merged", root / variant, variant, GROUP)
    for name in ("merged", "wint4"):
        m[f"eval_{name}"] = evaluate.run(root / name, data, root / "eval" / f"{name}.json", name, EVAL_CONFIG)
    return family, root, m


@pytest.fixture(scope="module")
def exported(chain):
    """The chain's merged model exported to ONNX (adds `export` to the chain's metrics)."""
    family, root, m = chain
    m["export"] = export.run(root / "merged", root / "onnx", {"opset_version": 18, "int8": False})
    return family, root, m


@pytest.fixture(scope="module")
def extras(chain):
    """The slow rest of one family's chain: prefix tuning, and the evaluation of the LoRA and prefix
    adapters and of wint8 (adds the metrics to the chain's)."""
    family, root, m = chain
    data = root / "data"
    m["prefix"] = finetune.run("prefix", root / "base", data, root / "prefix",
                               finetune_section("prefix", max_steps=8, learning_rate=0.3,
                                                lr_scheduler_type="constant"))
    for name in ("wint8", "lora", "prefix"):
        try:
            m[f"eval_{name}"] = evaluate.run(root / name, data, root / "eval" / f"{name}.json", name, EVAL_CONFIG)
        except TokenizerError as e:
            if not (family == "qwen2" and name in ADAPTERS):
                raise
            # An adapter dir has the tokenizer files but no config.json, so AutoTokenizer reads 320
            # tokens there and 321 (Qwen2Tokenizer) beside the model's config.json: the stages load
            # tokenizers inconsistently (reported; not this module's code).
            m[f"eval_{name}"] = e
    return family, root, m


def test_lora_trains(chain):
    """Eight steps lower the dev loss (per target token) below the base model's."""
    family, root, m = chain
    assert m["lora"]["dev_loss"] < m["base_dev_loss"] - 0.05, (m["base_dev_loss"], m["lora"])
    assert m["lora"]["final_loss"] < m["lora"]["first_loss"]


@pytest.mark.slow
def test_prefix_trains(extras):
    family, root, m = extras
    assert m["prefix"]["dev_loss"] < m["base_dev_loss"] - 0.05, (m["base_dev_loss"], m["prefix"])
    assert m["prefix"]["final_loss"] < m["prefix"]["first_loss"]


def test_all_linear_lora_wraps_exactly_the_quantized_layers(chain):
    """peft's "all-linear" and stages.quant pick the same layers: the Linear / Conv1D of the blocks
    (of transformers' model: a mixture's routers and fused experts are none; Mixtral, Qwen3-MoE and
    OLMoE adapt attention only)."""
    family, root, m = chain
    base = AutoModelForCausalLM.from_pretrained(root / "base")
    adapted = peft.PeftModel.from_pretrained(base, root / "lora")
    wrapped = {n.removeprefix("base_model.model.") for n, mod in adapted.named_modules()
               if isinstance(mod, peft.tuners.lora.LoraLayer)}
    blocks = decoder_linear_layers(AutoModelForCausalLM.from_pretrained(root / "base"))  # fused experts: none
    if not BY_MODEL_TYPE[family].lora_mlp:  # peft maps these MoE families' MLP names onto their fused experts
        blocks = {name: t for name, t in blocks.items() if ".self_attn." in name}
    assert wrapped == set(blocks) and m["merge"]["merged_modules"] == len(blocks)
    # and the adapter trained each of them (peft fills a wrapped layer the file lacks with B = 0)
    with safe_open(str(root / "lora" / "adapter_model.safetensors"), "pt") as f:
        assert {adapted_module(k) for k in f.keys()} == set(blocks)
    assert any(blocks.values()) == (family == "gpt2")  # only GPT-2 has Conv1D layers


def test_merged_logits_equal_adapter_logits(chain):
    family, root, m = chain
    assert m["merge"]["rel_err"] <= 1e-5
    base = AutoModelForCausalLM.from_pretrained(root / "base")
    ids = _probe(base.config.vocab_size)
    base_logits = _logits(base, ids)
    adapter_logits = _logits(peft.PeftModel.from_pretrained(base, root / "lora"), ids)
    merged_logits = _logits(AutoModelForCausalLM.from_pretrained(root / "merged"), ids)
    assert (adapter_logits - base_logits).abs().max() > 1e-2  # the adapter changed the model
    torch.testing.assert_close(merged_logits, adapter_logits, rtol=0, atol=1e-4)


def test_quantized_layout_keeps_the_rest_in_float(chain):
    family, root, m = chain
    # the checkpoint's layer names (a mixture of experts: one Linear per expert, which transformers fuses)
    blocks = decoder_linear_layers(checkpoint_model(transformers.AutoConfig.from_pretrained(root / "merged")))
    assert m["wint8"]["num_quantized_layers"] == m["wint4"]["num_quantized_layers"] == len(blocks)
    with safe_open(str(root / "wint4" / "model.safetensors"), "pt") as f, \
            safe_open(str(root / "merged" / "model.safetensors"), "pt") as src:
        names = set(f.keys())
        assert {k.removesuffix(".qweight") for k in names if k.endswith(".qweight")} == set(blocks)
        for name, transposed in blocks.items():
            weight = src.get_tensor(f"{name}.weight")
            out_f, in_f = weight.shape[::-1] if transposed else weight.shape  # Conv1D stores (in, out)
            assert tuple(f.get_tensor(f"{name}.qweight").shape) == (in_f // 8, out_f)
            assert tuple(f.get_tensor(f"{name}.scales").shape) == (in_f // GROUP, out_f)
        for key in names - {f"{n}.{s}" for n in blocks for s in ("qweight", "qzeros", "scales", "g_idx")}:
            assert torch.equal(f.get_tensor(key), src.get_tensor(key)), key  # embeddings, norms, biases, head
    qcfg = json.loads((root / "wint4" / "config.json").read_text())["quantization_config"]
    assert qcfg == {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False,
                    "format": "gptq_v2", "checkpoint_format": "gptq_v2", "true_sequential": True}
    transformers.GPTQConfig.from_dict(qcfg)  # transformers' own validation of the entry


def test_dequantized_model_is_close_to_float(chain):
    """Each dequantized layer is the float one within its RTN error (a Conv1D read back in the
    wrong orientation would not be), and the logits follow: relative logit error
    ||q - f|| / ||f|| at most 4x the mean relative weight error (observed 0.05x to 2.5x over the
    families: INT8 0.03-1.4%, INT4 0.4-11%), INT8 well below INT4."""
    family, root, m = chain
    ref_model = AutoModelForCausalLM.from_pretrained(root / "merged")
    if is_moe(family):  # transformers' fused experts as the Linears the checkpoint quantizes
        unfuse_experts(ref_model, family)
    ref_weights = ref_model.state_dict()
    ids = _probe(ref_model.config.vocab_size)
    ref = _logits(ref_model, ids)
    err = {}
    for variant in ("wint8", "wint4"):
        model = load_quantized(root / variant, kernels=False)  # the dequantized reference
        assert type(model) is type(ref_model)
        if is_moe(family):
            unfuse_experts(model, family)
        weights = model.state_dict()
        for name in decoder_linear_layers(model):
            w, w_hat = ref_weights[f"{name}.weight"], weights[f"{name}.weight"]
            assert float((w_hat - w).norm() / w.norm()) <= m[variant]["max_rel_weight_error"] * (1 + 1e-4), name
        for key in ref_weights.keys() - {f"{n}.weight" for n in decoder_linear_layers(model)}:
            assert torch.equal(weights[key], ref_weights[key]), key
        err[variant] = float((_logits(model, ids) - ref).norm() / ref.norm())
        assert err[variant] <= 4 * m[variant]["mean_rel_weight_error"], (variant, err, m[variant])
        # the low-bit kernels (bfloat16 compute) give the reference's logits up to bfloat16 rounding
        kernel = load_quantized(root / variant)
        assert set(kernel.quant_kernels) == set(decoder_linear_layers(model))
        dequantized = _logits(model, ids)
        assert float((_logits(kernel, ids) - dequantized).norm() / dequantized.norm()) < 0.02, variant
    assert err["wint8"] < 0.2 * err["wint4"], err


def test_onnx_agrees_with_transformers(exported):
    """The exported graph against transformers' own model (whichever torch model export used)."""
    family, root, m = exported
    e = m["export"]
    assert e["torch_model"] == EXPORT_MODEL.get(family, e["torch_model"])
    assert e["rel_err"] < 1e-5 and e["top1_agreement"] == 1.0
    model = AutoModelForCausalLM.from_pretrained(root / "merged")
    ids = _probe(model.config.vocab_size)
    # the cache graph (our model's families) or the cache-free one (transformers'), past of length 0
    got = OnnxDecoder(root / "onnx" / "model.onnx").logits(ids.numpy())
    want = _logits(model, ids).numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_onnxruntime_genai_runs_the_export(exported):
    """onnxruntime-genai opens the cache graph's directory as written (genai_config.json: GLM's and
    GLM-4's model.type is its generic "decoder", it knows no "glm") and generates its greedy tokens
    (eos held off: the fine-tuned models end their answers at once)."""
    family, root, m = exported
    if not m["export"]["genai_config"]:
        pytest.skip(f"{family} exports transformers' cache-free graph: no genai_config.json")
    og = pytest.importorskip("onnxruntime_genai")
    model = og.Model(str(root / "onnx"))
    prompt, new = _probe(json.loads((root / "merged" / "config.json").read_text())["vocab_size"])[0, :5].tolist(), 8
    got = genai_greedy(og, model, prompt, new, exact=True)
    ids = np.asarray([prompt])
    want = greedy_generate(OnnxDecoder(root / "onnx" / "model.onnx"), ids, np.ones_like(ids), new, 2, 0,
                           min_new_tokens=new)[0, len(prompt):].tolist()
    assert got == want


def _check_eval(e: dict, kind: str) -> None:
    assert e["kind"] == kind and e["num_dev_examples"] == 4 and e["gen_tokens"] > 0
    for key in ("ppl", "dev_ppl", "bleu4", "rouge_l", "exact_match"):
        assert math.isfinite(e[key]), (key, e[key])
    assert 1.0 < e["ppl"] < 10 * 320


def test_evaluate_merged_and_wint4(chain):
    family, root, m = chain
    _check_eval(m["eval_merged"], "hf")
    _check_eval(m["eval_wint4"], "quantized")


@pytest.mark.slow
def test_evaluate_adapters_and_wint8(extras):
    family, root, m = extras
    _check_eval(m["eval_wint8"], "quantized")
    assert m["eval_wint8"]["ppl"] == pytest.approx(m["eval_merged"]["ppl"], rel=0.02)  # INT8 barely moves it
    failed = {name: m[f"eval_{name}"] for name in ADAPTERS if isinstance(m[f"eval_{name}"], Exception)}
    assert not failed, failed
    for name in ADAPTERS:
        _check_eval(m[f"eval_{name}"], "adapter")
    # the merged model is the LoRA adapter folded in
    assert m["eval_merged"]["ppl"] == pytest.approx(m["eval_lora"]["ppl"], rel=1e-4)
