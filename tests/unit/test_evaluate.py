"""stages/evaluate.py on a debug model, a tiny tokenizer and a tiny data dir: plain HF dir, LoRA
and prefix-tuning adapters, batched left-padded generation, and the bad-input errors."""

import json
import math
import shutil

import numpy as np
import pytest
import torch

from stages import evaluate
from stages.checkpoint.atomic import atomic_dir, write_json
from stages.checkpoint.hf import copy_tokenizer, save_pretrained
from stages.checkpoint.meta import write_meta
from stages.model import build_model, config_for_flavour

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
CONFIG = {"max_new_tokens": 6, "num_dev_examples": 6, "ppl_max_length": 16, "ppl_max_windows": 3,
          "per_device_eval_batch_size": 4, "speed_prefill_tokens": 8, "speed_batch_sizes": [1, 2],
          "speed_decode_tokens": 3, "speed_repeats": 1}
DOCUMENTED_KEYS = {"variant", "model_dir", "kind", "sft_format", "ppl", "unigram_ppl", "ppl_tokens", "ppl_windows",
                   "dev_ppl", "dev_ppl_tokens", "exact_match", "bleu4", "rouge_l", "metric_implementations",
                   "num_dev_examples", "gen_tokens", "gen_seconds", "gen_tokens_per_s", "size_bytes", "num_parameters",
                   "eval_seconds", "settings", "samples", "model_bytes", "rss_bytes", "prefill_tokens_per_s_b1",
                   "prefill_tokens_per_s_b2", "decode_tokens_per_s_b1", "speed_tokens", "torch_threads", "kernels",
                   "quantization", "preference_accuracy", "preference_margin", "preference_pairs", "lm_eval"}


def _texts(n, seed):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(3, 9))) for _ in range(n)]


def _write_tokenizer(out_dir):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_texts(200, 0) + ["copy: " + t for t in _texts(50, 1)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    assert (fast.pad_token_id, fast.bos_token_id, fast.eos_token_id) == (0, 1, 2)
    fast.save_pretrained(out_dir)
    return fast


def _write_data(data_dir, tokenizer):
    """The prepare layout of docs/artifacts.md: <split>.bin/.idx, index.json, sft/dev.json."""
    data_dir.mkdir()
    splits = {}
    for split, seed, n in (("train", 2, 120), ("validation", 3, 30)):
        ids, offsets = [], [0]
        for doc in _texts(n, seed):
            ids += tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            offsets.append(len(ids))
        np.asarray(ids, dtype="<u2").tofile(data_dir / f"{split}.bin")
        np.asarray(offsets, dtype="<i8").tofile(data_dir / f"{split}.idx")
        splits[split] = {"tokens": f"{split}.bin", "offsets": f"{split}.idx", "num_tokens": len(ids),
                         "num_documents": n}
    write_json(data_dir / "index.json", {"dtype": "uint16", "vocab_size": len(tokenizer), "bos_token_id": 1,
                                         "eos_token_id": 2, "pad_token_id": 0, "splits": splits})
    (data_dir / "sft").mkdir()
    lines = [{"src": f"copy: {t}", "tgt": t} for t in _texts(8, 4)]
    lines[1] = {"src": ["copy: alpha", "copy: beta gamma"], "tgt": ["alpha", "beta gamma"]}  # multi-turn
    (data_dir / "sft" / "dev.json").write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    tokenizer = _write_tokenizer(root / "tokenizer")
    _write_data(root / "data", tokenizer)
    config = config_for_flavour("debug", vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with atomic_dir(root / "sft") as d:
        save_pretrained(build_model(config, seed=0), d, tokenizer_dir=root / "tokenizer")
    return root


def _adapter(root, name, peft_config):
    """Save a peft adapter of the `sft` model as finetune does: adapter files, tokenizer, meta.json."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(root / "sft", dtype=torch.float32)
    model = peft.get_peft_model(base, peft_config)
    with atomic_dir(root / name) as d:
        model.save_pretrained(d)
        copy_tokenizer(root / "tokenizer", d)
        write_meta(d, stage="finetune", config={}, parent=root / "sft", seed=0, metrics={})
    return root / name


def _check_metrics(metrics, out_path, variant, kind, preference=False):
    assert set(metrics) == DOCUMENTED_KEYS
    assert json.loads(out_path.read_text()) == json.loads(json.dumps(metrics))
    assert metrics["variant"] == variant and metrics["kind"] == kind
    # A random debug model is roughly uniform over the vocabulary; the unigram floor is below that.
    assert 1.0 < metrics["ppl"] < 10 * 120 and math.isfinite(metrics["ppl"])
    assert 1.0 < metrics["unigram_ppl"] < 120
    assert metrics["ppl_windows"] == 3 and metrics["ppl_tokens"] == 3 * 15
    assert metrics["dev_ppl"] > 1 and metrics["dev_ppl_tokens"] > 0
    for key in ("exact_match", "bleu4", "rouge_l"):
        assert 0.0 <= metrics[key] <= 1.0
    assert set(metrics["metric_implementations"]) == {"bleu4", "rouge_l"}
    assert "tok:13a" in metrics["metric_implementations"]["bleu4"]
    assert metrics["num_dev_examples"] == 6
    assert 6 <= metrics["gen_tokens"] <= 6 * 6 and metrics["gen_tokens_per_s"] > 0
    assert metrics["size_bytes"] > 0 and metrics["num_parameters"] > 0 and metrics["eval_seconds"] > 0
    assert metrics["model_bytes"] >= 4 * metrics["num_parameters"]  # float32 parameters, plus buffers
    assert metrics["rss_bytes"] > metrics["model_bytes"]
    for key in ("prefill_tokens_per_s_b1", "prefill_tokens_per_s_b2", "decode_tokens_per_s_b1"):
        assert metrics[key] > 0
    assert metrics["speed_tokens"] == {"prefill": 8, "decode_prompt": 16, "decode_new": 3}
    if kind != "quantized":
        assert metrics["kernels"] == {} and metrics["quantization"] is None
    assert metrics["settings"]["src_length"] == 64  # default filled
    if not preference:  # the workspace's data has no preference/dev.json: prepare wrote no pairs
        assert [metrics[k] for k in ("preference_accuracy", "preference_margin", "preference_pairs")] == [None] * 3
    assert len(metrics["samples"]) == 5
    assert metrics["samples"][1] == {"src": "copy: beta gamma", "reference": "beta gamma",
                                     "prediction": metrics["samples"][1]["prediction"]}


def test_plain_hf_dir_through_the_cli(workspace):
    out = workspace / "eval" / "sft.json"
    metrics = evaluate.main(["--model", str(workspace / "sft"), "--data", str(workspace / "data"),
                             "--out", str(out), "--variant", "sft", "--config", json.dumps(CONFIG),
                             "--src-length", "64"])
    _check_metrics(metrics, out, "sft", "hf")
    assert metrics["size_bytes"] == (workspace / "sft" / "model.safetensors").stat().st_size


def test_lora_adapter_dir(workspace):
    import peft

    # init_lora_weights=False: B != 0, so the adapter really changes the outputs.
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                           task_type="CAUSAL_LM")
    adapter = _adapter(workspace, "lora", lora)
    out = workspace / "eval" / "lora.json"
    metrics = evaluate.run(adapter, workspace / "data", out, "lora", CONFIG)
    _check_metrics(metrics, out, "lora", "adapter")
    assert metrics["size_bytes"] == (adapter / "adapter_model.safetensors").stat().st_size
    base_params = sum(p.numel() for p in evaluate.load_variant(workspace / "sft")[0].parameters())
    assert metrics["num_parameters"] > base_params


def test_an_adapter_config_naming_layers_its_file_lacks_is_refused(workspace, tmp_path):
    """target_modules widened after training: peft would adapt k_proj with B = 0 and only warn."""
    import peft

    from stages.errors import InputError

    adapter = _adapter(workspace, "lora-qv", peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                             task_type="CAUSAL_LM"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "k_proj", "v_proj"]
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=r"no LoRA weights for 2 of them \(model\.layers\.0\.self_attn\.k_proj, "):
        evaluate.run(adapter, workspace / "data", tmp_path / "eval.json", "lora", CONFIG)
    assert not (tmp_path / "eval.json").exists()


def test_batched_left_padded_generation_matches_one_by_one(workspace):
    """Left padding must not change greedy outputs, also for prefix tuning (past_key_values)."""
    import peft

    adapter = _adapter(workspace, "prefix", peft.PrefixTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"))
    prompts = [[1, 5, 6, 7, 8, 9, 10], [1, 11], [1, 12, 13, 14]]
    for model_dir in (workspace / "sft", adapter):
        model = evaluate.load_variant(model_dir)[0]
        kwargs = dict(max_new_tokens=5, eos_token_id=2, pad_token_id=0)
        batched = evaluate.generate_greedy(model, prompts, batch_size=3, **kwargs)
        single = evaluate.generate_greedy(model, prompts, batch_size=1, **kwargs)
        assert batched == single, model_dir.name
    out = workspace / "eval" / "prefix.json"
    _check_metrics(evaluate.run(adapter, workspace / "data", out, "prefix", CONFIG), out, "prefix", "adapter")


def _data_with_pairs(workspace, data_dir):
    """A copy of the workspace's data dir with 7 preference dev pairs; returns the pairs."""
    from stages.data.preference import PreferenceRecord, write_preference_file

    shutil.copytree(workspace / "data", data_dir)
    pairs = [PreferenceRecord([f"copy: {t}"], [], t, " ".join(reversed(t.split())) + " beta") for t in _texts(7, 5)]
    write_preference_file(data_dir / "preference" / "dev.json", pairs)
    return pairs


def test_onnx_export_dir_and_its_int8(workspace, tmp_path):
    """An export directory (cache graph on onnxruntime) is evaluated like every other variant: the
    float graph scores and generates what the torch model does; int8/ close to it."""
    from stages import export

    export.run(workspace / "sft", tmp_path / "onnx", {"int8": True})
    _data_with_pairs(workspace, tmp_path / "data")
    want = evaluate.run(workspace / "sft", tmp_path / "data", tmp_path / "sft.json", "sft", CONFIG)
    out = tmp_path / "onnx.json"
    got = evaluate.run(tmp_path / "onnx", tmp_path / "data", out, "onnx", CONFIG)
    _check_metrics(got, out, "onnx", "onnx", preference=True)
    assert got["preference_pairs"] == want["preference_pairs"] == 7
    assert got["preference_accuracy"] == want["preference_accuracy"]
    for key in ("ppl", "dev_ppl", "preference_margin"):
        assert got[key] == pytest.approx(want[key], rel=1e-4), key
    assert [s["prediction"] for s in got["samples"]] == [s["prediction"] for s in want["samples"]]
    assert got["exact_match"] == want["exact_match"] and got["gen_tokens"] == want["gen_tokens"]
    assert got["size_bytes"] == (tmp_path / "onnx" / "model.onnx").stat().st_size
    # the graph's initializers: + the RoPE frequencies, - equal tensors the exporter stored once
    # (this random model's RMSNorm weights are all ones)
    assert got["num_parameters"] == pytest.approx(want["num_parameters"], rel=0.01)
    int8 = evaluate.run(tmp_path / "onnx" / "int8", workspace / "data", tmp_path / "int8.json", "int8", CONFIG)
    assert int8["kind"] == "onnx" and int8["ppl"] == pytest.approx(want["ppl"], rel=0.05)
    assert int8["model_bytes"] < 0.5 * got["model_bytes"] and int8["size_bytes"] < 0.5 * got["size_bytes"]


def test_quantized_dir_goes_through_stages_quant(workspace, tmp_path, monkeypatch):
    """Only the dispatch: a stand-in for stages.quant.load_quantized is called for such a dir."""
    import sys
    import types

    from transformers import AutoModelForCausalLM

    shutil.copytree(workspace / "sft", tmp_path / "wint8")
    config = json.loads((tmp_path / "wint8" / "config.json").read_text())
    write_json(tmp_path / "wint8" / "config.json", {**config, "quantization_config": {"bits": 8}})
    calls = []

    def load_quantized(model_dir):
        calls.append(model_dir)
        return AutoModelForCausalLM.from_pretrained(workspace / "sft", dtype=torch.float32)

    monkeypatch.setitem(sys.modules, "stages.quant", types.SimpleNamespace(load_quantized=load_quantized))
    model, _, kind = evaluate.load_variant(tmp_path / "wint8")
    assert kind == "quantized" and calls == [tmp_path / "wint8"]


def test_adapter_base_falls_back_to_a_sibling_dir(workspace, tmp_path):
    """A moved experiment dir: meta.json's parent no longer exists, a sibling of that name does."""
    shutil.copytree(workspace / "sft", tmp_path / "sft")
    shutil.copytree(workspace / "lora", tmp_path / "lora")
    for name, key in (("meta.json", "parent"), ("adapter_config.json", "base_model_name_or_path")):
        obj = json.loads((tmp_path / "lora" / name).read_text())
        obj[key] = "/nonexistent/results/llama/sft"
        write_json(tmp_path / "lora" / name, obj)
    assert evaluate.adapter_base_dir(tmp_path / "lora") == tmp_path / "sft"
    shutil.rmtree(tmp_path / "sft")
    with pytest.raises(ValueError, match="cannot find the base model"):
        evaluate.adapter_base_dir(tmp_path / "lora")


def test_bad_inputs_name_the_problem(workspace, tmp_path):
    with pytest.raises(ValueError, match="'evaluate.max_new_token' is unknown; did you mean 'max_new_tokens'"):
        evaluate.eval_settings({"max_new_token": 3})
    with pytest.raises(ValueError, match="'evaluate.max_new_tokens': 0 is less than the minimum of 1"):
        evaluate.eval_settings({"max_new_tokens": 0})
    with pytest.raises(ValueError, match="src_length=0 must be a positive integer"):
        evaluate.eval_settings({}, src_length=0)
    with pytest.raises(ValueError, match="config.json is missing"):
        evaluate.run(tmp_path, workspace / "data", tmp_path / "x.json", "x", CONFIG)
    with pytest.raises(ValueError, match="dev.json is missing"):
        evaluate.run(workspace / "sft", tmp_path, tmp_path / "x.json", "x", CONFIG)
    assert not (tmp_path / "x.json").exists()


def test_run_from_python_gets_the_schema_defaults(workspace, tmp_path):
    from stages import settings

    metrics = evaluate.run(workspace / "sft", workspace / "data", tmp_path / "e.json", "sft")
    defaults = settings.defaults("evaluate")
    assert metrics["settings"] == {"src_length": settings.defaults("sft")["src_length"], **defaults}


def test_preference_pairs_are_scored_for_every_torch_variant(workspace, tmp_path):
    """With data/preference/dev.json, the full model and its LoRA adapter get the preference keys,
    equal to stages.metrics.preference on the same pairs (encoded with src_length and
    src_length + max_new_tokens, as the dev answers are)."""
    import peft

    from stages.inference.loading import load_variant
    from stages.metrics.preference import preference_metrics

    pairs = _data_with_pairs(workspace, tmp_path / "data")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                           task_type="CAUSAL_LM")
    adapter = workspace / "lora" if (workspace / "lora").exists() else _adapter(workspace, "lora", lora)
    for name in ("sft", "lora"):
        out = tmp_path / f"{name}.json"
        metrics = evaluate.run(workspace / name, tmp_path / "data", out, name, CONFIG, src_length=64)
        _check_metrics(metrics, out, name, "hf" if name == "sft" else "adapter", preference=True)
        model, tokenizer, _ = load_variant(workspace / name if name == "sft" else adapter)
        want = preference_metrics(model, tokenizer, pairs, 64, 64 + CONFIG["max_new_tokens"], False, 0, 4)
        assert metrics["preference_pairs"] == 7 and want["preference_pairs"] == 7
        assert metrics["preference_accuracy"] == want["preference_accuracy"]
        assert metrics["preference_margin"] == pytest.approx(want["preference_margin"], abs=1e-6)


def test_num_preference_pairs_caps_the_pairs_scored_and_zero_skips_them(workspace, tmp_path):
    """evaluate.num_preference_pairs: the first N dev pairs are scored (as stages.metrics.preference
    scores exactly those), and 0 leaves the preference keys null."""
    from stages.inference.loading import load_variant
    from stages.metrics.preference import preference_metrics

    pairs = _data_with_pairs(workspace, tmp_path / "data")
    capped = evaluate.run(workspace / "sft", tmp_path / "data", tmp_path / "three.json", "sft",
                          {**CONFIG, "num_preference_pairs": 3}, src_length=64)
    model, tokenizer, _ = load_variant(workspace / "sft")
    want = preference_metrics(model, tokenizer, pairs[:3], 64, 64 + CONFIG["max_new_tokens"], False, 0, 4)
    assert capped["preference_pairs"] == want["preference_pairs"] == 3
    assert capped["preference_margin"] == pytest.approx(want["preference_margin"], abs=1e-6)
    skipped = evaluate.run(workspace / "sft", tmp_path / "data", tmp_path / "none.json", "sft",
                           {**CONFIG, "num_preference_pairs": 0}, src_length=64)
    assert [skipped[k] for k in ("preference_accuracy", "preference_margin", "preference_pairs")] == [None] * 3


def test_lm_eval_tasks_run_on_every_variant_kind(workspace, tmp_path):
    """evaluate.lm_eval_tasks: the local tasks on a full model, a prefix adapter (peft's past key
    values) and an ONNX export, which scores as its torch source."""
    import peft

    from stages import export
    from stages.metrics.measured import without_measured

    _data_with_pairs(workspace, tmp_path / "data")
    export.run(workspace / "sft", tmp_path / "onnx", {"int8": False})
    prefix = workspace / "prefix" if (workspace / "prefix").exists() else \
        _adapter(workspace, "prefix", peft.PrefixTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"))
    config = {**CONFIG, "lm_eval_tasks": ["lifecycle_qa", "lifecycle_pairs"]}
    results = {}
    for name, model_dir in (("sft", workspace / "sft"), ("prefix", prefix), ("onnx", tmp_path / "onnx")):
        metrics = evaluate.run(model_dir, tmp_path / "data", tmp_path / f"{name}.json", name, config, src_length=64)
        lm_eval = metrics["lm_eval"]
        assert lm_eval["limit"] is None and lm_eval["chat_template"] is False and lm_eval["wall_seconds"] > 0
        assert "wall_seconds" not in without_measured(lm_eval)  # what a rerun of the DAG must reproduce
        assert lm_eval["tasks"]["lifecycle_qa"]["samples"] == 8 and lm_eval["tasks"]["lifecycle_pairs"]["samples"] == 7
        results[name] = {task: r["metrics"] for task, r in lm_eval["tasks"].items()}
    assert results["onnx"] == results["sft"]
    assert set(results["prefix"]["lifecycle_pairs"]) == {"acc", "acc_norm"}
    plain = evaluate.run(workspace / "sft", tmp_path / "data", tmp_path / "plain.json", "sft", CONFIG, src_length=64)
    assert plain["lm_eval"] is None
