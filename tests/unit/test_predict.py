"""stages/predict.py on the `debug` model of conftest.py: batched generation equals one-by-one
generation (plain HF dir, LoRA and prefix adapters, a wint8 quantized dir), greedy output equals
stages.evaluate's, seeded sampling, the JSON-lines output and the bad-input errors."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint_fixtures import chat_tokenizer, save_adapter
from stages import evaluate, predict
from stages.checkpoint.atomic import write_json
from stages.data.sft import encode_prompt, read_sft_file
from stages.errors import InputError
from stages.serving import generation_settings

ROOT = Path(__file__).resolve().parents[2]
# Prompts of different lengths (the debug tokenizer's words are single tokens), so that batches
# are left-padded and per-record budgets differ.
RECORDS = [
    {"src": "what colour is the apple?", "tgt": "red"},
    {"src": "sky"},
    {"src": ["question: one two", "the colour of the sky is"], "tgt": ["three", "blue"]},
    {"src": "a banana is yellow and a plum is purple, snow is white, coal is black, what colour is grass?",
     "tgt": "green"},
    {"src": "def main(argv): return 0", "tgt": "python"},
    {"src": "the colour of the apple is"},
    {"src": "one two three four five six seven eight nine", "tgt": "ten"},
]


def _write_jsonl(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def variants(debug_model_dir, tmp_path_factory):
    """{name: dir}: the debug model, a LoRA adapter (B != 0, so it changes outputs), a prefix
    adapter and the wint8 quantization of the debug model."""
    import peft

    from stages import quantize

    root = tmp_path_factory.mktemp("predict")
    lora = save_adapter(debug_model_dir, root / "lora", peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM"))
    prefix = save_adapter(debug_model_dir, root / "prefix",
                      peft.PrefixTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"))
    quantize.run(debug_model_dir, root / "wint8", "wint8", 16)
    return {"hf": debug_model_dir, "lora": lora, "prefix": prefix, "wint8": root / "wint8"}


def _prompts(tokenizer, tmp_path, src_length=64):
    """RECORDS' prompts as the predictor encodes them."""
    rows = predict.read_records(_write_jsonl(tmp_path / "records.jsonl", RECORDS))
    return [encode_prompt(tokenizer, row.record, src_length) for row in rows]


@pytest.mark.parametrize("name", ["hf", "lora", "prefix", "wint8"])
def test_batched_generation_equals_one_by_one(variants, name, tmp_path):
    """The required proof: left padding, the attention mask and per-record budgets make a batch's
    greedy outputs those of batch size 1, for full, adapter and quantized models."""
    model, tokenizer, kind = evaluate.load_variant(variants[name])
    assert kind == {"hf": "hf", "lora": "adapter", "prefix": "adapter", "wint8": "quantized"}[name]
    prompts = _prompts(tokenizer, tmp_path, src_length=16)
    # max_length 24: budgets differ from record to record (24 - prompt length, at most 10).
    settings = predict.PredictSettings(batch_size=4, src_length=16, max_length=24, max_new_tokens=10)
    kwargs = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    single = predict.generate_batched(model, prompts, predict.PredictSettings(
        batch_size=1, src_length=16, max_length=24, max_new_tokens=10), **kwargs)
    batched = predict.generate_batched(model, prompts, settings, **kwargs)
    assert [g.tokens for g in batched] == [g.tokens for g in single]
    budgets = predict.token_budgets(prompts, 24, 10)
    assert len(set(budgets)) > 1
    for g, budget in zip(single, budgets):
        assert len(g.tokens) == budget or g.tokens[-1] == tokenizer.eos_token_id
    assert {g.batch for g in batched} == {0, 1} and {g.batch for g in single} == set(range(len(prompts)))

    # Stopping at eos: call a token the model emits the eos, so rows stop early in both runs.
    stop = single[0].tokens[2]
    kwargs["eos_token_id"] = stop
    single = predict.generate_batched(model, prompts, predict.PredictSettings(
        batch_size=1, src_length=16, max_length=24, max_new_tokens=10), **kwargs)
    batched = predict.generate_batched(model, prompts, settings, **kwargs)
    assert [g.tokens for g in batched] == [g.tokens for g in single]
    assert single[0].tokens[-1] == stop and len(single[0].tokens) <= 3
    assert all(stop not in g.tokens[:-1] for g in single)  # cut after the first eos


def test_greedy_output_equals_evaluate(variants, tmp_path):
    """Same prompts (encode_prompt), same greedy tokens and text as stages.evaluate's generation."""
    outputs = {}
    for name in ("hf", "lora"):
        inp = _write_jsonl(tmp_path / "data" / "sft" / "dev.json", [r for r in RECORDS if "tgt" in r])
        out = tmp_path / f"{name}.jsonl"
        predict.run(variants[name], inp, out, predict.PredictSettings(batch_size=3, src_length=12,
                                                                      max_length=200, max_new_tokens=6))
        model, tokenizer, _ = evaluate.load_variant(variants[name])
        prompts = [encode_prompt(tokenizer, r, 12) for r in read_sft_file(inp)]
        generated = evaluate.generate_greedy(model, prompts, max_new_tokens=6, eos_token_id=tokenizer.eos_token_id,
                                             pad_token_id=tokenizer.pad_token_id, batch_size=4)
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert [line["output"] for line in lines] == [tokenizer.decode(g, skip_special_tokens=True)
                                                       for g in generated]
        assert [line["output_tokens"] for line in lines] == [len(g) for g in generated]
        assert [line["prompt_tokens"] for line in lines] == [len(p) for p in prompts]
        outputs[name] = [line["output"] for line in lines]
    assert outputs["hf"] != outputs["lora"]  # the adapter is applied


@pytest.mark.parametrize("name", ["hf", "lora"])
def test_prompt_lookup_predicts_what_plain_decoding_does(variants, name, tmp_path, caplog):
    """--prompt-lookup-num-tokens at --batch-size 1 (the command line, as the rule passes it): the same
    predictions; the log counts the draft tokens checked and taken; refused with compile."""
    import logging

    inp = _write_jsonl(tmp_path / "in.jsonl", RECORDS)
    outputs = {}
    for n in (0, 5):
        out = tmp_path / f"{n}.jsonl"
        with caplog.at_level(logging.INFO, logger="stages.inference.generation"):
            summary = predict.main(["--model", str(variants[name]), "--input", str(inp), "--out", str(out),
                                    "--batch-size", "1", "--src-length", "16", "--max-length", "48",
                                    "--prompt-lookup-num-tokens", str(n)])
        assert summary["settings"]["prompt_lookup_num_tokens"] == n
        outputs[n] = [json.loads(line)["output"] for line in out.read_text().splitlines()]
    assert outputs[5] == outputs[0] and any(outputs[0])
    assert "prompt lookup:" in caplog.text and "draft tokens taken" in caplog.text
    with pytest.raises(InputError, match="choose one"):
        predict.PredictSettings(compile=True, prompt_lookup_num_tokens=4)


@pytest.mark.slow  # torch.compile: about 20 s per batch shape on 2 cores
@pytest.mark.parametrize("name", ["hf", "lora"])
def test_compiled_decoding_predicts_what_eager_decoding_does(variants, name, tmp_path):
    """predict.compile: the decode engine's compiled step (torch.compile on a StaticCache) writes the
    eager run's predictions here (on other weights a near tie may flip: the option says so)."""
    from torch._dynamo.utils import counters

    inp = _write_jsonl(tmp_path / "in.jsonl", RECORDS)
    outputs, frames = {}, {}
    for compiled in (False, True):
        out = tmp_path / f"{compiled}.jsonl"
        before = counters["frames"]["ok"]
        summary = predict.run(variants[name], inp, out, predict.PredictSettings(
            batch_size=len(RECORDS), src_length=16, max_length=40, max_new_tokens=8, compile=compiled))
        frames[compiled] = counters["frames"]["ok"] - before  # frames dynamo traced
        assert summary["settings"]["compile"] is compiled
        outputs[compiled] = [json.loads(line)["output"] for line in out.read_text().splitlines()]
    assert outputs[True] == outputs[False] and any(outputs[True])
    assert frames == {False: 0, True: 1}  # the compiled run went through dynamo: its decode step


def test_sampling_repeats_with_its_seed(variants, tmp_path):
    model, tokenizer, _ = evaluate.load_variant(variants["hf"])
    prompts = _prompts(tokenizer, tmp_path)
    kwargs = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)

    def sample(seed, **overrides):
        settings = predict.PredictSettings(batch_size=4, max_new_tokens=8, decode_strategy="sampling",
                                           seed=seed, **overrides)
        return [g.tokens for g in predict.generate_batched(model, prompts, settings, **kwargs)]

    torch.manual_seed(123)  # the global state before the call must not matter
    first = sample(1)
    assert sample(1) == first
    assert sample(2) != first
    greedy = [g.tokens for g in predict.generate_batched(
        model, prompts, predict.PredictSettings(batch_size=4, max_new_tokens=8), **kwargs)]
    assert first != greedy
    # top_k=1 keeps only the most likely token: sampling becomes greedy.
    assert sample(3, top_k=1, temperature=0.7, top_p=0.9) == greedy


def test_cli_writes_every_record_in_input_order(variants, tmp_path):
    inp = _write_jsonl(tmp_path / "in.jsonl", RECORDS)
    out = tmp_path / "pred" / "hf.jsonl"
    summary = predict.main(["--model", str(variants["hf"]), "--input", str(inp), "--out", str(out),
                            "--batch-size", "3", "--max-new-tokens", "5", "--src-length", "32", "--max-length", "64"])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["src"] for line in lines] == [r["src"] for r in RECORDS]
    for line, record in zip(lines, RECORDS):
        assert ("tgt" in line) == ("tgt" in record) and line.get("tgt") == record.get("tgt")
        assert set(line) == set(record) | {"output", "output_tokens", "prompt_tokens", "batch", "batch_seconds"}
        assert isinstance(line["output"], str) and 1 <= line["output_tokens"] <= 5
        assert 0 < line["prompt_tokens"] <= 32 and line["batch_seconds"] > 0
    assert {line["batch"] for line in lines} == {0, 1, 2}
    assert json.loads(predict.summary_path(out).read_text()) == json.loads(json.dumps(summary))
    assert predict.summary_path(out) == tmp_path / "pred" / "hf.summary.json"
    assert summary["kind"] == "hf" and summary["sft_format"] == "plain"
    assert summary["num_records"] == len(RECORDS) and summary["num_batches"] == 3
    assert summary["generated_tokens"] == sum(line["output_tokens"] for line in lines)
    assert summary["tokens_per_s"] > 0 and summary["settings"]["batch_size"] == 3
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_bad_input_names_the_file_and_line(variants, tmp_path):
    model = str(variants["hf"])

    def fails(lines, match):
        inp = _write_jsonl(tmp_path / "bad.jsonl", lines)
        with pytest.raises(InputError, match=match):
            predict.run(model, inp, tmp_path / "out.jsonl")
        assert not (tmp_path / "out.jsonl").exists()

    fails([RECORDS[0], '{"src": "x",\n'], re.escape(f"{tmp_path / 'bad.jsonl'}:2: malformed JSON"))
    fails([RECORDS[0], RECORDS[1], {"prompt": "x"}], r"bad.jsonl:3: record has no 'src'")
    fails([{"src": ["a", "b"]}], r"bad.jsonl:1: without 'tgt', 'src' must be one string")
    fails([{"src": ["a", "b"], "tgt": ["c"]}], r"bad.jsonl:1: 'src' has 2 rounds but 'tgt' has 1")
    fails([], r"bad.jsonl: no JSON lines")
    (tmp_path / "empty_dir").mkdir()
    inp = _write_jsonl(tmp_path / "ok.jsonl", RECORDS[:1])
    with pytest.raises(InputError, match="neither an HF model dir nor a peft adapter dir"):
        predict.run(tmp_path / "empty_dir", inp, tmp_path / "out.jsonl")
    with pytest.raises(InputError, match="must be below predict.max_length"):
        predict.PredictSettings(src_length=64, max_length=64)
    with pytest.raises(InputError, match="top_p"):
        predict.PredictSettings(top_p=0.0)


def test_command_line_error_is_one_line_with_the_location(tmp_path):
    inp = _write_jsonl(tmp_path / "bad.jsonl", [RECORDS[0], "not json\n"])
    proc = subprocess.run([sys.executable, "-m", "stages.predict", "--model", str(tmp_path), "--input", str(inp),
                           "--out", str(tmp_path / "out.jsonl")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    first, *rest = proc.stderr.strip().splitlines()  # the log's first line says what the stage reads and writes
    assert first.endswith(f"predict: reads {tmp_path} (model), {inp} (records); writes {tmp_path / 'out.jsonl'} "
                          f"(predictions), {tmp_path / 'out.summary.json'} (summary)")
    assert rest == [f"predict: error: {inp}:2: malformed JSON (Expecting value at column 1); "
                    'each line must be one JSON object such as {"src": "...", "tgt": "..."}']


def test_chat_format_follows_the_data_dir_then_the_tokenizer(tiny_tokenizer_dir, tmp_path):
    chat, plain = chat_tokenizer(tiny_tokenizer_dir), chat_tokenizer(tiny_tokenizer_dir, chat_template=False)
    loose = tmp_path / "in.jsonl"
    assert predict.chat_format("auto", chat, "m", loose) is True  # no data dir: the tokenizer decides
    assert predict.chat_format("auto", plain, "m", loose) is False
    assert predict.chat_format("false", chat, "m", loose) is False
    with pytest.raises(InputError, match="has no chat template"):
        predict.chat_format("true", plain, "m", loose)
    dev = tmp_path / "data" / "sft" / "dev.json"
    for fmt, want in (("plain", False), ("chat_template", True)):
        write_json(tmp_path / "data" / "index.json", {"vocab_size": len(chat), "sft_format": fmt})
        assert predict.chat_format("auto", chat, "m", dev) is want  # as prepare decided
    write_json(tmp_path / "data" / "index.json", {"vocab_size": len(chat) + 1, "sft_format": "plain"})
    with pytest.raises(InputError, match="tokenizer mismatch"):
        predict.chat_format("auto", chat, "m", dev)


def test_config_section_becomes_the_command_line_flags():
    from stages.config import load_schema

    section = {"batch_size": 4, "max_new_tokens": 7, "decode_strategy": "sampling", "compile": True}
    flags = generation_settings.settings_flags(section)
    assert "--compile true" in flags
    args = predict.build_parser().parse_args(["--model", "m", "--input", "i", "--out", "o", *flags.split()])
    assert {k: getattr(args, k) for k in generation_settings.SECTION_DEFAULTS} == {
        **generation_settings.SECTION_DEFAULTS, **section}
    assert predict.build_parser().parse_args(["--model", "m", "--input", "i", "--out", "o"]).compile is False
    with pytest.raises(InputError, match="predict.compile='yes' must be true or false"):
        predict.PredictSettings(compile="yes")
    assert "--max-new-tokens" not in generation_settings.settings_flags({})  # null: max_length decides
    with pytest.raises(InputError, match="'predict.batchsize' is unknown; did you mean 'batch_size'"):
        generation_settings.settings_flags({"batchsize": 4})
    with pytest.raises(InputError, match="src_length=128 must be below predict.max_length=128"):
        generation_settings.settings_flags({"src_length": 128})
    # the dataclass's defaults are the schema's section, field for field (chat_template and backend
    # are no config keys)
    section = load_schema()["$defs"]["experiment"]["properties"]["predict"]["properties"]
    schema = {k: v["default"] for k, v in section.items()}
    assert {k: v for k, v in predict.DEFAULTS.items() if k not in ("chat_template", "backend")} == schema \
        == generation_settings.SECTION_DEFAULTS


def test_peft_users_answer_prompt_text_as_the_predictor(debug_model_dir, tmp_path):
    """A LoRA adapter as peft's users run it: the base from transformers, `PeftModel.from_pretrained`,
    the adapter directory's tokenizer called on the prompt text, `generate`; with the tokenizer as
    prepare writes it (bos added), the answers are the predictor's."""
    import shutil

    import peft
    from checkpoint_fixtures import save_prepared_tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = tmp_path / "base"
    shutil.copytree(debug_model_dir, base)
    save_prepared_tokenizer(base)
    adapter = save_adapter(base, tmp_path / "lora", peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM"))
    texts = [r["src"] for r in RECORDS if isinstance(r["src"], str)]  # one-round prompts: what a user types
    records = _write_jsonl(tmp_path / "records.jsonl", [{"src": text} for text in texts])
    predict.main(["--model", str(adapter), "--input", str(records), "--out", str(tmp_path / "ours.jsonl"),
                  "--max-new-tokens", "12", "--chat-template", "false"])
    ours = [json.loads(line)["output"] for line in (tmp_path / "ours.jsonl").read_text().splitlines()]
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    theirs = []
    for text in texts:
        inputs = tokenizer(text, return_tensors="pt")
        assert inputs["input_ids"][0, 0] == tokenizer.bos_token_id
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
        theirs.append(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    assert theirs == ours
