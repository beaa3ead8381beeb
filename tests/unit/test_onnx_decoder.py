"""stages/deployment/onnx_*.py through the export stage on a debug model: the cache graph's names,
onnxruntime's cached greedy generation equal to stages.predict's (torch, transformers' generate)
token for token on left-padded batches, logits with a past equal to logits without one, padding
that changes no other row, the INT8 variant's quality, and onnxruntime-genai on the directory."""

import json

import numpy as np
import pytest
import torch
from genai_fixtures import genai_greedy

from stages import export, predict
from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import save_pretrained
from stages.deployment.onnx_checks import left_pad
from stages.deployment.onnx_decoder import check_exportable, past_names, present_names
from stages.deployment.onnx_generate import OnnxDecoder, greedy_generate
from stages.deployment.onnx_int8 import perplexity
from stages.evaluate import load_variant
from stages.model import build_model, config_for_flavour

NEW_TOKENS = 32
# Prompts of 1 to 12 tokens (the tiny tokenizer's words are single tokens): left-padded batches.
RECORDS = [{"src": "sky"}, {"src": "the colour of the apple is"},
           {"src": "one two three four five six seven eight nine"},
           {"src": "a banana is yellow and a plum is purple, what colour is grass?"},
           {"src": "def main(argv): return 0"}, {"src": "snow is white"}]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_tokenizer_dir):
    """(root, metrics): a debug Llama (initializer_range 0.2: logits far from uniform, so greedy
    choices are no near-ties) with the tiny tokenizer, exported with its INT8 variant."""
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("onnx_decoder")
    vocab = len(PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir))
    config = config_for_flavour("debug", vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                initializer_range=0.2)
    with atomic_dir(root / "model") as tmp:
        save_pretrained(build_model(config, seed=0), tmp, tokenizer_dir=tiny_tokenizer_dir)
    metrics = export.run(root / "model", root / "onnx", {"int8": True})
    return root, metrics


def test_directory_names_and_metrics(exported):
    root, m = exported
    assert m["kv_cache"] and m["genai_config"] and m["torch_model"] == "project"
    assert m["rel_err"] <= 1e-5 and m["top1_agreement"] == 1.0
    assert (m["generation_rows"], m["generation_new_tokens"]) == (3, 16)
    assert m["generation_tokens_compared"] == 48 and m["generation_near_ties"] == 0
    decoder = OnnxDecoder(root / "onnx" / "model.onnx")
    inputs = {i.name: i.shape for i in decoder.session.get_inputs()}
    outputs = {o.name: o.shape for o in decoder.session.get_outputs()}
    assert list(inputs) == ["input_ids", "attention_mask", "position_ids", *past_names(2)]
    assert list(outputs) == ["logits", *present_names(2)]
    assert inputs["attention_mask"] == ["batch_size", "total_sequence_length"]
    assert inputs["past_key_values.1.value"] == ["batch_size", 2, "past_sequence_length", 16]
    assert outputs["present.0.key"] == ["batch_size", 2, "total_sequence_length", 16]
    genai = json.loads((root / "onnx" / "genai_config.json").read_text())
    assert genai["model"]["type"] == "llama" and genai["model"]["context_length"] == 512
    assert (genai["model"]["eos_token_id"], genai["model"]["pad_token_id"], genai["model"]["bos_token_id"]) == (2, 0, 1)
    assert genai["model"]["decoder"]["inputs"]["past_key_names"] == "past_key_values.%d.key"
    for d in (root / "onnx", root / "onnx" / "int8"):
        assert {"model.onnx", "genai_config.json", "tokenizer.json"} <= {f.name for f in d.iterdir()}
    meta = json.loads((root / "onnx" / "meta.json").read_text())
    assert meta["metrics"] == m and meta["config"]["int8"] is True


def test_the_graphs_name_no_file_of_this_machine(exported):
    """The same model exported from another checkout or venv is the same file: no node metadata
    (the dynamo exporter's Python stack traces) names the checkout or the venv."""
    import sys
    from pathlib import Path

    import onnx

    checkout = str(Path(__file__).resolve().parents[2])
    root, _ = exported
    for path in (root / "onnx" / "model.onnx", root / "onnx" / "int8" / "model.onnx"):
        proto = onnx.load(str(path), load_external_data=False)
        values = [kv.value for node in proto.graph.node for kv in node.metadata_props]
        assert values, path  # the module scopes and fx nodes stay: they name no file
        for place in (checkout, sys.prefix):
            assert not any(place in v for v in values), (path, place)


def _prompts(tokenizer, tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return [predict.encode_prompt(tokenizer, row.record, 64) for row in predict.read_records(path)], path


@pytest.mark.parametrize("variant", ["onnx", "onnx/int8"])
def test_cached_generation_equals_the_torch_predictor(exported, tmp_path, variant):
    """Batches of 4 left-padded prompts (1..17 tokens), 32 new tokens, eos handled by the predictor:
    onnxruntime with the cache equals transformers' generate (stages.predict's torch backend),
    token for token. The INT8 graph is compared with the float graph the same way: only its rate
    of agreement is asserted (loosely)."""
    root, _ = exported
    torch_model, tokenizer, _ = load_variant(root / "model", "torch")
    onnx_model, _, kind = load_variant(root / variant, "onnxruntime")
    assert kind == "onnx"
    prompts, _ = _prompts(tokenizer, tmp_path)
    assert len({len(p) for p in prompts}) == len(prompts)
    settings = predict.PredictSettings(batch_size=4, src_length=64, max_length=128, max_new_tokens=NEW_TOKENS)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    want = [g.tokens for g in predict.generate_batched(torch_model, prompts, settings, **ids)]
    got = [g.tokens for g in predict.generate_batched(onnx_model, prompts, settings, **ids)]
    assert any(len(w) < NEW_TOKENS for w in want) and any(len(w) == NEW_TOKENS for w in want)  # eos and budget
    if variant == "onnx":
        assert got == want
    else:
        same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
        assert same / sum(len(w) for w in want) > 0.2  # reported by the export: int8_greedy_agreement


def test_predict_cli_with_the_onnxruntime_backend(exported, tmp_path):
    root, _ = exported
    _, path = _prompts(load_variant(root / "model")[1], tmp_path)
    argv = ["--model", str(root / "onnx"), "--input", str(path), "--batch-size", "4", "--max-new-tokens", "8",
            "--chat-template", "false"]
    onnx = predict.main([*argv, "--out", str(tmp_path / "onnx.jsonl"), "--backend", "onnxruntime"])
    assert onnx["kind"] == "onnx" and onnx["settings"]["backend"] == "onnxruntime" and onnx["generated_tokens"] > 0
    predict.main(["--model", str(root / "model"), *argv[2:], "--out", str(tmp_path / "torch.jsonl")])
    rows = [[json.loads(line)["output"] for line in (tmp_path / f"{n}.jsonl").read_text().splitlines()]
            for n in ("onnx", "torch")]
    assert rows[0] == rows[1]
    with pytest.raises(ValueError, match="--backend onnxruntime"):
        predict.main([*argv, "--out", str(tmp_path / "x.jsonl")])  # torch backend on an ONNX dir
    with pytest.raises(ValueError, match="greedy_search only"):
        predict.main([*argv, "--out", str(tmp_path / "x.jsonl"), "--backend", "onnxruntime",
                      "--decode-strategy", "sampling"])


def test_logits_with_a_past_equal_logits_without(exported):
    """Prefill 9 tokens, then 4 steps of 1 token and one of 3, against one cache-free forward over
    all 16; on a left-padded batch whose padded rows equal the same rows run alone."""
    root, _ = exported
    decoder = OnnxDecoder(root / "onnx" / "model.onnx")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (16, 11, 5)]
    ids, mask = left_pad(prompts, 0)
    full = decoder.logits(ids, mask)  # (3, 16, V)
    scale = np.abs(full).max()
    past, pieces, start = decoder.empty_past(3), [], 0
    for stop in (9, 10, 11, 12, 13, 16):
        logits, past = decoder.step(ids[:, start:stop], mask[:, :stop], past)
        pieces.append(logits)
        start = stop
    assert past[0].shape == (3, 2, 16, 16)
    stepped = np.concatenate(pieces, axis=1)
    real = mask.astype(bool)
    assert np.abs(stepped - full)[real].max() <= 1e-5 * scale
    for r, p in enumerate(prompts):  # padding changes nothing for the real tokens of any row
        alone = decoder.logits(np.asarray([p]))[0]
        assert np.abs(full[r, real[r]] - alone).max() <= 1e-5 * scale


def test_int8_quality(exported):
    """Reported by the export (on the float graph's own continuations) and re-measured here on
    the predictor's prompts: close to the float graph, not equal."""
    root, m = exported
    assert 0.8 <= m["int8_top1_agreement"] <= 1.0 and 0.9 < m["int8_ppl_ratio"] < 1.1
    assert 0.0 <= m["int8_greedy_agreement"] <= 1.0 and m["int8_greedy_tokens"] == 48
    assert m["int8_onnx_size_bytes"] < 0.6 * m["onnx_size_bytes"] and m["int8_block_size"] == 32
    float_decoder = OnnxDecoder(root / "onnx" / "model.onnx")
    int8_decoder = OnnxDecoder(root / "onnx" / "int8" / "model.onnx")
    ids, mask = left_pad([[1, 40, 41, 42], [1, 50]], 0)
    sequences = greedy_generate(float_decoder, ids, mask, NEW_TOKENS, None, 0)
    full_mask = np.concatenate([mask, np.ones((2, NEW_TOKENS), np.int64)], axis=1)
    ppl_float, ppl_int8 = perplexity(float_decoder, sequences, full_mask), perplexity(int8_decoder, sequences, full_mask)
    print(f"int8 on {NEW_TOKENS} float-greedy tokens: ppl {ppl_int8:.3f} vs float {ppl_float:.3f}")
    assert 0.8 < ppl_int8 / ppl_float < 1.25


def test_onnxruntime_genai_generates_the_same_tokens(exported, tiny_tokenizer_dir):
    """onnxruntime-genai opens the export directory as written (genai_config.json, tokenizer.json)
    and, prompt by prompt, generates our generator's greedy tokens. (A batch left-padded by the
    caller is not compared: onnxruntime-genai pads and numbers positions its own way.)"""
    og = pytest.importorskip("onnxruntime_genai")
    from transformers import PreTrainedTokenizerFast

    root, _ = exported
    model = og.Model(str(root / "onnx"))
    hf_tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir)
    text = "the colour of the sky is"
    assert list(og.Tokenizer(model).encode(text)) == hf_tokenizer(text)["input_ids"]
    decoder = OnnxDecoder(root / "onnx" / "model.onnx")
    for prompt in ([1, 40, 41, 42, 43], [1, 7], [1] + hf_tokenizer(text)["input_ids"]):
        got = genai_greedy(og, model, prompt, NEW_TOKENS)
        ids = np.asarray([prompt])
        want = greedy_generate(decoder, ids, np.ones_like(ids), NEW_TOKENS, 2, 0)[0, len(prompt):].tolist()
        want = want[:want.index(2) + 1] if 2 in want else want
        assert got == want


@pytest.fixture(scope="module")
def exported_with_bos(tmp_path_factory):
    """(model dir, export dir): the debug Llama of `exported` with the tokenizer as prepare writes
    it (encoding adds bos), exported without the INT8 variant."""
    from checkpoint_fixtures import save_prepared_tokenizer
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("onnx_bos")
    tokenizer_dir = save_prepared_tokenizer(root / "tokenizer")
    config = config_for_flavour("debug", vocab_size=len(AutoTokenizer.from_pretrained(tokenizer_dir)), bos_token_id=1,
                                eos_token_id=2, pad_token_id=0, initializer_range=0.2)
    with atomic_dir(root / "model") as tmp:
        save_pretrained(build_model(config, seed=0), tmp, tokenizer_dir=tokenizer_dir)
    export.run(root / "model", root / "onnx", {"int8": False})
    return root / "model", root / "onnx"


def test_onnxruntime_genai_answers_prompt_text_as_the_predictor(exported_with_bos, tmp_path):
    """onnxruntime-genai as its users call it (the export's own tokenizer encodes the prompt text,
    the generator continues it) generates the project's predictions token for token. Its `encode`
    adds no special tokens unless asked (since 0.8: chat templates carry their bos as text); asked,
    it applies tokenizer.json's post-processor and the prompt is `[bos] src`, as trained
    (docs/deployment.md). Tokens, not text, are compared: this random model's answers are byte
    soup, which onnxruntime-extensions and transformers decode differently."""
    og = pytest.importorskip("onnxruntime_genai")
    model_dir, onnx_dir = exported_with_bos
    torch_model, hf_tokenizer, _ = load_variant(model_dir, "torch")
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    prompts = [predict.encode_prompt(hf_tokenizer, row.record, 64) for row in predict.read_records(path)]
    settings = predict.PredictSettings(batch_size=4, src_length=64, max_length=128, max_new_tokens=NEW_TOKENS)
    ours = [g.tokens for g in predict.generate_batched(torch_model, prompts, settings, eos_token_id=2, pad_token_id=0)]
    model = og.Model(str(onnx_dir))
    tokenizer = og.Tokenizer(model)
    bare = [int(t) for t in tokenizer.encode(RECORDS[0]["src"])]
    tokenizer.update_options(add_special_tokens="true")
    assert [int(t) for t in tokenizer.encode(RECORDS[0]["src"])] == [1] + bare
    for record, prompt, want in zip(RECORDS, prompts, ours):
        from_text = [int(t) for t in tokenizer.encode(record["src"])]
        assert from_text == prompt
        # genai_config.json names eos: onnxruntime-genai stops there and leaves it out of the sequence
        assert genai_greedy(og, model, from_text, NEW_TOKENS) == (want[:-1] if want[-1:] == [2] else want)


def test_transformers_answers_prompt_text_as_the_predictor(exported_with_bos, tmp_path):
    """transformers as its users call it, `tokenizer(text)` then `generate`, on the shipped model
    directory gives the project's predictions (bos included by the shipped tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, _ = exported_with_bos
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    predict.main(["--model", str(model_dir), "--input", str(path), "--out", str(tmp_path / "torch.jsonl"),
                  "--max-new-tokens", str(NEW_TOKENS), "--chat-template", "false"])
    ours = [json.loads(line)["output"] for line in (tmp_path / "torch.jsonl").read_text().splitlines()]
    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    theirs = []
    for record in RECORDS:
        inputs = tokenizer(record["src"], return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        theirs.append(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    assert theirs == ours


def test_the_export_check_starts_from_prompt_text(exported, exported_with_bos):
    """The export encodes prompt text as transformers' users do with the directory's tokenizer and
    compares with the predictor's prompts: none differs with the prepared tokenizer; the tiny test
    tokenizer, which adds no bos, loses it on every one (reported, not refused: an imported
    tokenizer keeps its own behaviour)."""
    from stages.deployment.checks import TOKENIZER_PROBES

    _, onnx_dir = exported_with_bos
    metrics = json.loads((onnx_dir / "meta.json").read_text())["metrics"]
    assert metrics["prompt_texts"] == len(TOKENIZER_PROBES) and metrics["prompt_text_mismatches"] == 0
    _, metrics = exported
    assert metrics["prompt_text_mismatches"] == len(TOKENIZER_PROBES)


def test_dynamic_rope_is_the_one_rope_type_the_cache_graph_refuses():
    """`dynamic` rotates a position by an angle that changes as the sequence grows; the cache graph
    (keys rotated once) refuses it, and the workflow reads the same rule (no onnx-int8 for it)."""
    dynamic = config_for_flavour("debug", vocab_size=64, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        check_exportable(build_model(dynamic))
    check_exportable(build_model(config_for_flavour("debug", vocab_size=64,
                                                    rope_scaling={"rope_type": "linear", "factor": 2.0})))
