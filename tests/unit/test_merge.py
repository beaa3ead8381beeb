"""stages/merge.py: a trained LoRA adapter folded into its base gives the same logits, as a plain
HF model with no LoRA weights; wrong inputs fail clearly and write nothing."""

from __future__ import annotations

import json

import peft
import pytest
import torch
from safetensors import safe_open
from sft_fixtures import finetune_section, write_toy_data
from transformers import AutoModelForCausalLM

from stages import finetune, merge

TOL = 1e-4  # fp32: merging only reorders the sums; observed max |diff| is ~4e-7


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, debug_model_dir):
    """A LoRA adapter trained 10 steps at a high LR, so that B A is far from zero."""
    root = tmp_path_factory.mktemp("merge")
    data = write_toy_data(root / "data")
    finetune.run("lora", debug_model_dir, data, root / "lora",
                 finetune_section("lora", max_steps=10, learning_rate=3e-2, lr_scheduler_type="constant"))
    return root / "lora"


@pytest.fixture(scope="module")
def merged(tmp_path_factory, adapter_dir):
    out = tmp_path_factory.mktemp("merged") / "lora-merged"
    return out, merge.run(adapter_dir, out)


def probe(vocab_size: int) -> torch.Tensor:
    return torch.randint(3, vocab_size, (3, 12), generator=torch.Generator().manual_seed(1))


def test_merged_logits_equal_adapter_logits(merged, adapter_dir, debug_model_dir):
    out, metrics = merged
    assert metrics["max_abs_logit_diff"] <= TOL and metrics["lora_rank"] == 4
    assert metrics["rel_err"] == metrics["max_abs_logit_diff"] / metrics["logit_scale"] <= merge.RTOL
    assert metrics["merged_modules"] == 2 * 3  # (q_proj, v_proj, down_proj) x 2 layers
    base = AutoModelForCausalLM.from_pretrained(debug_model_dir, dtype=torch.float32).eval()
    ids = probe(base.config.vocab_size)
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        adapter_logits = peft.PeftModel.from_pretrained(base, adapter_dir).eval()(input_ids=ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(input_ids=ids).logits
    assert (adapter_logits - base_logits).abs().max() > 100 * TOL  # the adapter does change the model
    torch.testing.assert_close(merged_logits, adapter_logits, rtol=0, atol=TOL)


def test_merged_dir_is_a_plain_model(merged, adapter_dir):
    out, metrics = merged
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "meta.json"} <= names
    assert "adapter_config.json" not in names
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert keys and not [k for k in keys if "lora_" in k or "base_layer" in k]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == metrics["total_params"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["stage"] == "merge" and meta["parent"] == str(adapter_dir)
    assert meta["metrics"]["max_abs_logit_diff"] == metrics["max_abs_logit_diff"]


def test_cli_with_explicit_base(tmp_path, adapter_dir, debug_model_dir):
    metrics = merge.main(["--adapter", str(adapter_dir), "--out", str(tmp_path / "m"), "--base", str(debug_model_dir)])
    assert metrics["max_abs_logit_diff"] <= TOL and (tmp_path / "m" / "model.safetensors").exists()


def test_mismatch_raises_with_the_numbers_and_writes_nothing(tmp_path, adapter_dir, monkeypatch):
    calls = []
    real = merge.logits_of

    def drifting(model, ids):  # the second call (merged model) comes back off by 1e-3
        calls.append(1)
        return real(model, ids) + (1e-3 if len(calls) == 2 else 0.0)

    monkeypatch.setattr(merge, "logits_of", drifting)
    with pytest.raises(merge.MergeMismatchError,
                       match=r"max \|diff\|=1\.0\d*e-03, .* of the logit scale .* > rtol=1\.0e-04"):
        merge.run(adapter_dir, tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_tolerance_scales_with_the_logits(tmp_path, adapter_dir, monkeypatch):
    """Logits 1000x larger (a trained model's range) with an extra 2e-4 of float noise pass: the
    bound is relative (an absolute 1e-4 failed a correct 135M merge, 2.2e-4 off)."""
    calls = []
    real = merge.logits_of

    def large(model, ids):
        calls.append(1)
        return real(model, ids) * 1000 + (2e-4 if len(calls) == 2 else 0.0)

    monkeypatch.setattr(merge, "logits_of", large)
    metrics = merge.run(adapter_dir, tmp_path / "m")
    assert metrics["max_abs_logit_diff"] > 1e-4 and metrics["rel_err"] <= merge.RTOL


def test_prefix_adapter_is_refused(tmp_path, debug_model_dir):
    (tmp_path / "prefix").mkdir()
    (tmp_path / "prefix" / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    with pytest.raises(ValueError, match="peft_type='PREFIX_TUNING'; only LORA"):
        merge.run(tmp_path / "prefix", tmp_path / "m", base_dir=debug_model_dir)


def test_not_an_adapter_dir(tmp_path, debug_model_dir):
    with pytest.raises(ValueError, match="no adapter_config.json"):
        merge.run(debug_model_dir, tmp_path / "m")


def test_missing_base_names_the_fix(tmp_path, adapter_dir):
    with pytest.raises(ValueError, match="has no config.json; pass --base"):
        merge.run(adapter_dir, tmp_path / "m", base_dir=tmp_path / "nowhere")


def test_an_adapter_file_missing_a_targeted_layer_is_refused(tmp_path, adapter_dir, debug_model_dir):
    """peft would load it with only a warning, leaving that layer's B at zero (no update): merged,
    the model silently loses the layer's training. Refused, naming the layer; nothing written."""
    import shutil

    from safetensors.torch import load_file, save_file

    from stages.errors import InputError

    partial = tmp_path / "partial"
    shutil.copytree(adapter_dir, partial)
    (partial / "meta.json").unlink()  # as a user-supplied adapter: no records to compare against
    tensors = load_file(partial / "adapter_model.safetensors")
    dropped = [k for k in tensors if ".layers.0.self_attn.q_proj." in k]
    assert len(dropped) == 2  # its lora_A and lora_B
    save_file({k: t for k, t in tensors.items() if k not in dropped}, partial / "adapter_model.safetensors")
    with pytest.raises(InputError, match=r"no LoRA weights for 1 of them \(model\.layers\.0\.self_attn\.q_proj\)"):
        merge.run(partial, tmp_path / "out", base_dir=debug_model_dir)
    assert not (tmp_path / "out").exists()


def test_a_quantized_base_is_refused(tmp_path, adapter_dir, debug_model_dir):
    import shutil

    base = tmp_path / "quantized"
    shutil.copytree(debug_model_dir, base)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantized model \(quant_method='gptq'\).*then quantize the merged model"):
        merge.run(adapter_dir, tmp_path / "out", base_dir=base)
    assert not (tmp_path / "out").exists()


def _write_tp2_shards(model_dir, out):
    """The debug model as a tp2 training run writes it with unified_checkpoint: false: column
    weights split by rows, row weights by columns, each slice with its partition_dim."""
    import shutil

    from stages.checkpoint.atomic import write_json
    from stages.checkpoint.store import INDEX, SHARDED
    from stages.checkpoint.weights import load_state_dict
    from stages.training.checkpointing import RankPart, build_index, write_part

    columns, rows = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj")
    parts = []
    for tp_rank in range(2):
        part = RankPart(tp_rank)
        for name, tensor in load_state_dict(model_dir).items():
            dim = 0 if any(f".{c}." in name for c in columns) else 1 if any(f".{r}." in name for r in rows) else None
            if dim is not None:
                part.add(f"model-tp{tp_rank:02d}.safetensors", name, tensor.chunk(2, dim=dim)[tp_rank].clone(),
                         tp_rank=tp_rank, tp_size=2, partition_dim=dim)
            elif tp_rank == 0:
                part.add("model-tp00.safetensors", name, tensor)
        parts.append(write_part(out, part))
    write_json(out / INDEX, build_index({"format": SHARDED, "step": None}, parts))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_dir / name).exists():
            shutil.copy2(model_dir / name, out / name)


def test_a_sharded_base_goes_through_merge_tp_first(tmp_path, adapter_dir, debug_model_dir, merged):
    _write_tp2_shards(debug_model_dir, tmp_path / "shards")
    metrics = merge.run(adapter_dir, tmp_path / "out", base_dir=tmp_path / "shards")
    assert metrics["merged_modules"] == merged[1]["merged_modules"]
    ids = probe(AutoModelForCausalLM.from_pretrained(debug_model_dir).config.vocab_size)
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(tmp_path / "out")(input_ids=ids).logits
        expected = AutoModelForCausalLM.from_pretrained(merged[0])(input_ids=ids).logits
    assert torch.allclose(ours, expected, atol=1e-6)
