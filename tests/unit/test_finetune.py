"""stages/finetune.py: encoding and batching, a short real run per method on the debug model, the
artifacts each method writes, reproducibility, and bad-input errors."""

from __future__ import annotations

import csv
import json

import peft
import pytest
import torch
from runs_in_one_world import start_world
from sft_fixtures import finetune_section, toy_records, torchrun_finetune_sft, train_losses, write_toy_data
from transformers import AutoModelForCausalLM, AutoTokenizer

from stages import finetune
from stages.data.sft import IGNORE_INDEX, encode_prompt

# Learning rates that move a random debug model visibly within 30 steps (constant schedule).
FAST_LR = {"sft": 1e-2, "lora": 1e-2, "prefix": 3e-1}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_toy_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def tokenizer(debug_model_dir):
    return AutoTokenizer.from_pretrained(debug_model_dir)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, debug_model_dir, data_dir):
    """method -> (out_dir, metrics) of a 30-step run of each method."""
    runs = {}
    for method in finetune.METHODS:
        out = tmp_path_factory.mktemp("finetune") / method
        config = finetune_section(method, learning_rate=FAST_LR[method], lr_scheduler_type="constant")
        runs[method] = (out, finetune.run(method, debug_model_dir, data_dir, out, config))
    return runs


def test_labels_mask_the_prompt(data_dir, tokenizer):
    examples = finetune.load_examples(data_dir / "sft" / "train.json", tokenizer, 16, 24)
    record = toy_records()[0]
    prompt = encode_prompt(tokenizer, record, 16)
    ids, labels = examples[0]
    assert ids[:len(prompt)] == prompt and labels[:len(prompt)] == [IGNORE_INDEX] * len(prompt)
    assert labels[len(prompt):] == ids[len(prompt):] and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[len(prompt):-1]).strip() == record.tgt[0]


def test_collate_pads_on_the_right():
    batch = finetune.collate([([1, 5, 6], [-100, 5, 6]), ([1, 7], [-100, 7])], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[1, 5, 6], [1, 7, 0]]
    assert batch["labels"].tolist() == [[-100, 5, 6], [-100, 7, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert finetune.target_token_count(batch["labels"]) == 3


@pytest.mark.parametrize("method", finetune.METHODS)
def test_loss_decreases(trained, method):
    out, metrics = trained[method]
    curve = train_losses(out)
    assert len(curve) == 30 and curve[0] == pytest.approx(metrics["first_loss"], abs=1e-5)
    # A random debug model moves far only with full SFT (5.8 -> 0.5 here); a frozen one with an
    # adapter still learns, slowly (LoRA 5.8 -> 5.1, prefix 5.8 -> 5.3). Windows of 5 steps
    # average out batch-to-batch noise.
    margin = 2.0 if method == "sft" else 0.2
    assert sum(curve[-5:]) / 5 < sum(curve[:5]) / 5 - margin
    assert metrics["dev_loss"] < metrics["first_loss"] - margin
    with open(out / "train_log.csv") as f:
        assert next(csv.reader(f)) == ["step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "elapsed_s",
                                       "eval_loss", "eval_exact_match", "eval_bleu4", "eval_rouge_l"]


def test_sft_writes_a_plain_hf_model(trained, debug_model_dir):
    out, metrics = trained["sft"]
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "meta.json", "train_log.csv"} <= {p.name for p in out.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == metrics["total_params"] == metrics["trainable_params"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["stage"] == "finetune-sft" and meta["parent"] == str(debug_model_dir) and meta["seed"] == 0


def test_lora_output_loads_with_peft_and_has_the_rank(trained, debug_model_dir):
    out, metrics = trained["lora"]
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "meta.json"} <= names
    assert not (out / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(json.loads((out / "meta.json").read_text())["parent"])
    model = peft.PeftModel.from_pretrained(base, out)
    assert model.peft_config["default"].r == 4
    lora_a = [m for n, m in model.named_modules() if n.endswith("lora_A.default")]
    assert lora_a and all(m.out_features == 4 for m in lora_a)
    # q_proj, v_proj, down_proj in 2 layers: r * (in + out) each
    c = base.config
    kv = c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    per_layer = 4 * ((c.hidden_size * 2) + (c.hidden_size + kv) + (c.intermediate_size + c.hidden_size))
    assert metrics["trainable_params"] == c.num_hidden_layers * per_layer


def test_prefix_output_loads_and_generates(trained, debug_model_dir, tokenizer):
    out, metrics = trained["prefix"]
    base = AutoModelForCausalLM.from_pretrained(debug_model_dir)
    model = peft.PeftModel.from_pretrained(base, out).eval()
    assert model.peft_config["default"].num_virtual_tokens == 4
    assert metrics["trainable_params"] == model.prompt_encoder.default.embedding.weight.numel()
    ids = torch.tensor([encode_prompt(tokenizer, toy_records()[0], 16)])
    gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    assert gen.shape[1] > ids.shape[1] and gen[0, :ids.shape[1]].tolist() == ids[0].tolist()


def test_same_seed_same_train_losses(tmp_path, debug_model_dir, data_dir):
    """Reruns reproduce every logged loss, LoRA dropout and adapter init included; through the CLI."""
    config = json.dumps(dict(finetune_section("lora", max_steps=5, lora_dropout=0.1, seed=7)))
    for name in ("a", "b"):
        finetune.main(["--method", "lora", "--model", str(debug_model_dir), "--data", str(data_dir),
                       "--out", str(tmp_path / name), "--config", config])
    assert train_losses(tmp_path / "a") == train_losses(tmp_path / "b")


def test_accumulation_weighs_tokens_like_one_big_batch(tmp_path, debug_model_dir, data_dir):
    """2 micro-batches of 4 = the same 8 examples as 1 batch of 8: same first-step loss."""
    one = finetune.run("sft", debug_model_dir, data_dir, tmp_path / "one",
                       finetune_section("sft", max_steps=1, warmup_steps=0, per_device_train_batch_size=8))
    two = finetune.run("sft", debug_model_dir, data_dir, tmp_path / "two",
                       finetune_section("sft", max_steps=1, warmup_steps=0, per_device_train_batch_size=4,
                                        gradient_accumulation_steps=2))
    assert two["first_loss"] == pytest.approx(one["first_loss"], abs=1e-5)


def test_bf16_autocast_runs(tmp_path, debug_model_dir, data_dir):
    metrics = finetune.run("lora", debug_model_dir, data_dir, tmp_path / "bf16",
                           finetune_section("lora", max_steps=2, bf16=True))
    assert torch.isfinite(torch.tensor(metrics["final_loss"]))


def test_bf16_full_sft_in_one_process_follows_its_fp32_curve(tmp_path, debug_model_dir, data_dir):
    """A one-rank SFT job (ZeRO off) in bf16 keeps fp32 master weights and Adam's step count right
    (stages.training.deepspeed_engine.forget_initial_step): its curve is the fp32 one within
    BF16_RTOL (pretrain_fixtures: why that tolerance)."""
    from pretrain_fixtures import BF16_RTOL

    curves = {}
    for name, bf16 in (("fp32", False), ("bf16", True)):
        finetune.run("sft", debug_model_dir, data_dir, tmp_path / name,
                     finetune_section("sft", max_steps=6, warmup_steps=1, bf16=bf16))
        curves[name] = train_losses(tmp_path / name)
    assert curves["bf16"] == pytest.approx(curves["fp32"], rel=BF16_RTOL)


def test_bad_target_module_is_a_clear_error_and_writes_nothing(tmp_path, debug_model_dir, data_dir):
    with pytest.raises(ValueError, match=r"target_modules names \['attn_proj'\].*choose from"):
        finetune.run("lora", debug_model_dir, data_dir, tmp_path / "out",
                     finetune_section("lora", target_modules=["q_proj", "attn_proj"]))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method, config, message", [
    ("lora", {"max_steps": 3, "lora_rnak": 4}, r"'finetune.lora.lora_rnak' is unknown; did you mean 'lora_rank'"),
    ("ia3", {}, "--method 'ia3' is unknown"),
])
def test_bad_section_is_a_clear_error(tmp_path, debug_model_dir, data_dir, method, config, message):
    with pytest.raises(ValueError, match=message):
        finetune.run(method, debug_model_dir, data_dir, tmp_path / "out", config)


def test_src_length_must_leave_room(tmp_path, debug_model_dir, data_dir):
    with pytest.raises(ValueError, match="src_length=24 must be smaller than max_length=24"):
        finetune.run("sft", debug_model_dir, data_dir, tmp_path / "out", {**finetune_section("sft"), "src_length": 24})


def test_missing_data_names_the_file(tmp_path, debug_model_dir):
    with pytest.raises(ValueError, match=r"sft/train.json is missing; run the prepare stage"):
        finetune.run("sft", debug_model_dir, tmp_path, tmp_path / "out", finetune_section("sft"))


# Full SFT in every layout follows the single-process engine run: same starting weights, same
# global batch of 8 padded examples per step, loss = mean over the step's answer tokens.
# Evaluation with generation every 3 steps: in the reference and in the layouts that evaluate (all
# but pipeline parallelism, whose schedule only trains); it leaves the weights as they are.
DEV_EVAL = dict(eval_steps=3, eval_with_do_generation=True, num_eval_examples=4, per_device_eval_batch_size=2)
SFT_LAYOUTS = {
    "dp2_sharding_stage1": dict(world_size=2, sharding="stage1", per_device_train_batch_size=4,
                                gradient_accumulation_steps=1, **DEV_EVAL),
    "tp2": dict(world_size=2, tensor_parallel_degree=2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                **DEV_EVAL),
    # lm_head's vocabulary stays split: the loss is vocab-parallel, generation gathers the last logits
    "tp2_vocab_split": dict(world_size=2, tensor_parallel_degree=2, tensor_parallel_output=True,
                            per_device_train_batch_size=4, gradient_accumulation_steps=2, **DEV_EVAL),
    "pp2_1f1b": dict(world_size=2, pipeline_parallel_degree=2, per_device_train_batch_size=2,
                     gradient_accumulation_steps=4),
}


def sft_section(**overrides):
    return finetune_section("sft", max_steps=6, warmup_steps=1, learning_rate=1e-2, **overrides)


def torchrun_sft(nproc: int, model_dir, data_dir, out, **overrides) -> list[float]:
    return torchrun_finetune_sft(nproc, model_dir, data_dir, out, sft_section(**overrides))


@pytest.fixture(scope="module")
def sft_reference(tmp_path_factory, debug_model_dir, data_dir):
    out = tmp_path_factory.mktemp("sft_reference") / "out"
    torchrun_sft(1, debug_model_dir, data_dir, out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                 **DEV_EVAL)
    return out


@pytest.fixture(scope="module")
def sft_layout_runs(tmp_path_factory, debug_model_dir, data_dir):
    """name -> output dir: every layout has two ranks, so all run one after another in one torchrun
    (tests/unit/runs_in_one_world.py)."""
    root = tmp_path_factory.mktemp("sft_layouts")
    assert {layout["world_size"] for layout in SFT_LAYOUTS.values()} == {2}
    world = start_world(2, {name: {"stage": "finetune", "method": "sft", "model": debug_model_dir, "data": data_dir,
                                   "out": root / name, "section": dict(sft_section(**layout))}
                            for name, layout in SFT_LAYOUTS.items()}, root / "world")
    return {name: world.out(name) for name in SFT_LAYOUTS}


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(SFT_LAYOUTS))
def test_full_sft_layout_matches_the_single_process_run(name, sft_reference, sft_layout_runs):
    curve, reference = train_losses(sft_layout_runs[name]), train_losses(sft_reference)
    assert len(curve) == len(reference) == 6
    assert curve == pytest.approx(reference, rel=1e-5)
    assert reference[-1] < reference[0]


def dev_evaluations(out_dir) -> tuple[dict[int, dict[str, float]], dict[str, float]]:
    """step -> the eval columns of train_log.csv, and meta.json's final dev metrics."""
    with open(out_dir / "train_log.csv") as f:
        logged = {int(row["step"]): {k: float(v) for k, v in row.items() if k.startswith("eval_")}
                  for row in csv.DictReader(f) if row["eval_loss"]}
    meta = json.loads((out_dir / "meta.json").read_text())["metrics"]
    return logged, {k: v for k, v in meta.items() if k.startswith("dev_") and isinstance(v, float)}


@pytest.mark.multiproc
@pytest.mark.parametrize("name", [name for name, layout in SFT_LAYOUTS.items() if "eval_steps" in layout])
def test_dev_evaluation_with_generation_matches_the_single_process_run(name, sft_reference, sft_layout_runs):
    """Dev loss, exact match, BLEU-4 and ROUGE-L of greedy generations at steps 3 and 6 and of the
    final weights: every rank generates the whole dev set and the ranks stop together."""
    (logged, final), (logged_ref, final_ref) = dev_evaluations(sft_layout_runs[name]), dev_evaluations(sft_reference)
    assert sorted(logged) == sorted(logged_ref) == [3, 6]
    assert {"dev_loss", "dev_exact_match", "dev_bleu4", "dev_rouge_l"} <= final_ref.keys()
    for step in logged:
        assert logged[step] == pytest.approx(logged_ref[step], rel=1e-5)
    assert final == pytest.approx(final_ref, rel=1e-5)


def test_eval_steps_log_dev_metrics_and_the_best_model_is_written(tmp_path, debug_model_dir, data_dir):
    """eval_steps=2 with generation: eval columns on every second row; load_best_model_at_end
    writes the evaluation with the lowest eval_loss, and meta.json's dev_loss is that model's."""
    config = finetune_section("lora", max_steps=6, eval_steps=2, eval_with_do_generation=True,
                              load_best_model_at_end=True, learning_rate=5e-1, lr_scheduler_type="constant",
                              num_eval_examples=4, per_device_eval_batch_size=2)
    metrics = finetune.run("lora", debug_model_dir, data_dir, tmp_path / "out", config)
    with open(tmp_path / "out" / "train_log.csv") as f:
        rows = list(csv.DictReader(f))
    evaluated = [r for r in rows if r["eval_loss"]]
    assert [int(r["step"]) for r in evaluated] == [2, 4, 6]
    assert all(r["eval_exact_match"] != "" and 0 <= float(r["eval_rouge_l"]) <= 1 for r in evaluated)
    losses = {e["step"]: e["eval_loss"] for e in metrics["evaluations"]}
    best = min(losses, key=losses.get)
    assert metrics["best_step"] == best
    assert metrics["dev_loss"] == pytest.approx(losses[best], rel=1e-5)  # the written weights are the best's
    assert {"dev_exact_match", "dev_bleu4", "dev_rouge_l"} <= metrics.keys()
    assert set(metrics["dev_metric_implementations"]) == {"bleu4", "rouge_l"}  # meta.json says what they are


def test_examples_longer_than_max_length_are_cut_and_counted(tmp_path, tokenizer, caplog):
    from stages.data.sft import SftRecord, write_sft_file

    records = [SftRecord(src=["colour of apple"], tgt=["red " * 30]), SftRecord(src=["sky"], tgt=["blue"])]
    write_sft_file(tmp_path / "train.json", records)
    examples = finetune.load_examples(tmp_path / "train.json", tokenizer, 8, 16)
    assert max(len(ids) for ids, _ in examples) == 16
    assert "1 of 2 examples are longer than max_length=16 and were truncated" in caplog.text


def test_an_empty_target_names_the_line(tmp_path, debug_model_dir):
    data = tmp_path / "data"
    (data / "sft").mkdir(parents=True)
    (data / "sft" / "train.json").write_text('{"src": "a", "tgt": "b"}\n{"src": "sky", "tgt": " "}\n')
    with pytest.raises(ValueError, match=r"train.json:2: 'tgt' is empty"):
        finetune.run("lora", debug_model_dir, data, tmp_path / "out", finetune_section("lora"))
    assert not (tmp_path / "out").exists()
