"""The gptq-w4 variant of stages/quantize.py and its calibration set (stages/quant/calibration.py):
corpus / sft / path sources and their errors, the packed files read back by load_quantized exactly
as GPTQ computed them (act-order and a narrower last group included), and GPTQ against RTN."""

import json

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import PreTrainedTokenizerFast

from sft_fixtures import toy_records, write_toy_data
from stages import quantize
from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import load_pretrained, save_pretrained
from stages.config import load_schema
from stages.data.corpus import TokenFile, write_token_files
from stages.data.sft import encode_example, write_sft_file
from stages.data.tokenizer import tokenizer_fingerprint
from stages.model import build_model, config_for_flavour
from stages.quant import load_quantized
from stages.quant.calibration import CalibrationError, CalibrationSettings, calibration_ids
from stages.quant.awq import AWQConfig, awq_quantize_model
from stages.quant.block_calibration import FORWARD_DTYPES
from stages.quant.gptq import GPTQConfig, gptq_quantize_model
from stages.quant.variants import A8W8_KEYS
from stages.training.capabilities import native_bf16
from stages.training.families import load_causal_lm

SEQ = 32


def _structured_llama(vocab: int, seed: int = 0, **overrides):
    """A debug-flavour Llama (widths 64 and 192) whose activations look like a trained model's:
    embeddings with correlated channels, a few norm weights 8x larger (outlier features); as in
    tests/unit/test_quant_gptq.py."""
    model = build_model(config_for_flavour("debug", vocab_size=vocab, bos_token_id=1, eos_token_id=2,
                                           pad_token_id=0, **overrides), seed=seed).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        d = model.config.hidden_size
        mix = torch.linalg.qr(torch.randn(d, d, generator=g))[0] * torch.logspace(0, -1.5, d)
        model.model.embed_tokens.weight.copy_(torch.randn(vocab, d, generator=g) @ mix.t())
        for layer in model.model.layers.values():
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[torch.randperm(d, generator=g)[:3]] = 8.0
    return model


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_tokenizer_dir, tokenizer):
    path = tmp_path_factory.mktemp("gptq") / "source"
    with atomic_dir(path) as tmp:
        save_pretrained(_structured_llama(len(tokenizer)), tmp, tokenizer_dir=tiny_tokenizer_dir)
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, tokenizer):
    """A prepared data dir: token splits of Zipf-like random documents (as a corpus' token
    statistics are skewed), index.json with the tokenizer's fingerprint, and sft/train.json."""
    path = tmp_path_factory.mktemp("gptq") / "data"
    path.mkdir(exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    weights = 1.0 / torch.arange(1, len(tokenizer) - 2, dtype=torch.float) ** 1.1  # Zipf over ids 3..V-1

    def docs(n):
        return [(torch.multinomial(weights, 100, replacement=True, generator=gen) + 3).tolist() for _ in range(n)]

    write_token_files(path, {"train": docs(40), "validation": docs(8)}, vocab_size=len(tokenizer), bos_id=1,
                      eos_id=2, pad_id=0, extra={"tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
                                                 "sft_format": "plain"})
    return write_toy_data(path)


def _section(group_size: int, calibration: dict | None = None, **gptq) -> dict:
    return {"group_size": group_size, "gptq": gptq,
            "calibration": {"num_samples": 8, "seq_len": SEQ, "source": "corpus", "seed": 0, **(calibration or {})}}


# ---------------------------------------------------------------- calibration


def test_corpus_windows_are_distinct_slices_of_the_training_split(data_dir):
    ids, info = calibration_ids(CalibrationSettings(num_samples=8, seq_len=SEQ, seed=3), data_dir)
    assert ids.shape == (8, SEQ) and ids.dtype == torch.int64
    tokens = torch.from_numpy(TokenFile.open(data_dir, "train").tokens.astype("int64"))
    starts = []
    for row in ids:
        matches = [s for s in range(0, len(tokens) - SEQ + 1, SEQ) if torch.equal(tokens[s:s + SEQ], row)]
        assert matches, "a window is not an aligned slice of the train split"
        starts.append(matches[0])
    assert len(set(starts)) == 8
    assert info == {"source": "corpus", "num_samples": 8, "seq_len": SEQ, "seed": 3, "num_windows": 8,
                    "num_tokens": 8 * SEQ}
    again, _ = calibration_ids(CalibrationSettings(num_samples=8, seq_len=SEQ, seed=3), data_dir)
    other, _ = calibration_ids(CalibrationSettings(num_samples=8, seq_len=SEQ, seed=4), data_dir)
    assert torch.equal(ids, again) and not torch.equal(ids, other)


def test_sft_windows_pack_prompts_and_answers_without_padding(data_dir, tokenizer, tiny_tokenizer_dir):
    settings = CalibrationSettings(num_samples=4, seq_len=SEQ, source="sft", seed=0)
    ids, info = calibration_ids(settings, data_dir, tokenizer, tiny_tokenizer_dir)
    assert ids.shape == (4, SEQ) and info["sft_format"] == "plain"
    assert not (ids == tokenizer.pad_token_id).any()
    # several short examples per window, each as finetune encodes it: bos, prompt, answer, eos
    assert (ids == tokenizer.bos_token_id).sum() > ids.shape[0]  # more examples than windows
    assert (ids == tokenizer.eos_token_id).sum() >= 4
    encoded = {tuple(encode_example(tokenizer, r, SEQ, SEQ)[0]) for r in toy_records()[:48]}
    first = ids[0].tolist()
    ends = [i + 1 for i, t in enumerate(first) if t == tokenizer.eos_token_id]
    assert tuple(first[:ends[0]]) in encoded


def test_a_jsonl_path_is_an_sft_source(data_dir, tokenizer, tiny_tokenizer_dir, tmp_path):
    path = tmp_path / "calib.jsonl"
    write_sft_file(path, toy_records()[48:])
    ids, info = calibration_ids(CalibrationSettings(num_samples=100, seq_len=16, source=str(path)), data_dir,
                                tokenizer, tiny_tokenizer_dir)
    assert info["source"] == str(path) and 1 <= ids.shape[0] < 100 and ids.shape[1] == 16  # fewer: a warning


@pytest.mark.parametrize("settings,match", [
    ({"num_samples": 0}, r"quantize\.calibration\.num_samples=0: the calibration set would be empty"),
    ({"seq_len": 10**6}, r"quantize\.calibration\.source=corpus: .* fewer than quantize\.calibration\.seq_len"),
    ({"source": "sft", "seq_len": 10**6}, r"quantize\.calibration\.source=sft: .* fewer than "
                                           r"quantize\.calibration\.seq_len"),
    ({"source": "nowhere.jsonl"}, r"quantize\.calibration\.source=nowhere\.jsonl: nowhere\.jsonl is not a file"),
    ({"source": "EMPTY"}, r"quantize\.calibration\.source=.*empty"),
])
def test_an_empty_calibration_set_names_the_key(data_dir, tokenizer, tiny_tokenizer_dir, tmp_path, settings, match):
    if settings.get("source") == "EMPTY":
        (tmp_path / "empty.jsonl").write_text("")
        settings = {"source": str(tmp_path / "empty.jsonl")}
    with pytest.raises(CalibrationError, match=match):
        calibration_ids(CalibrationSettings(**{"seq_len": SEQ, **settings}), data_dir, tokenizer, tiny_tokenizer_dir)


def test_defaults_are_the_schemas():
    quant = load_schema()["$defs"]["experiment"]["properties"]["quantize"]["properties"]
    calibration = {k: v["default"] for k, v in quant["calibration"]["properties"].items()}
    gptq = {k: v["default"] for k, v in quant["gptq"]["properties"].items()}
    assert calibration == {k: getattr(CalibrationSettings(), k) for k in calibration}
    assert gptq.pop("group_size") is None  # inherits quantize.group_size
    assert gptq == {k: getattr(GPTQConfig(), k) for k in gptq}
    assert quant["variants"]["items"]["type"] == "string"  # names resolved by stages.quant.variants
    assert set(quant["a8w8"]["properties"]) == set(A8W8_KEYS)
    awq = {k: v["default"] for k, v in quant["awq"]["properties"].items()}
    assert awq.pop("group_size") is None  # inherits quantize.group_size
    assert awq == {k: getattr(AWQConfig(), k) for k in awq}


# ---------------------------------------------------------------- the gptq-w4 variant


def _gptq_reference(source, data_dir, section, dtype: str) -> tuple[torch.nn.Module, dict]:
    """transformers' float model of `source` with GPTQ run on it directly (same calibration,
    same batches, the calibration forwards in `dtype` as the stage resolved it), and the results."""
    ids, _ = calibration_ids(CalibrationSettings.from_section(section["calibration"]), data_dir)
    config = quantize.gptq_config(section["gptq"], section["group_size"])
    ours = load_pretrained(source).eval()
    results = gptq_quantize_model(ours, ours.model.layers, list(ids.split(quantize.CALIBRATION_BATCH)), config,
                                  prefix="model.layers", forward_dtype=FORWARD_DTYPES[dtype])
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, r in results.items():
            hf.get_submodule(name).weight.copy_(r.weight)
    return hf, results


@pytest.mark.parametrize("desc_act,static_groups,mse,true_sequential,bits", [
    (True, True, 2.4, True, 4),  # the defaults: act-order, static groups, clipping search
    (False, False, 0.0, True, 4),  # AutoGPTQ's defaults
    (True, False, 0.0, False, 3),  # act-order's classic layout: a non-monotonic g_idx
])
def test_files_read_back_as_the_gptq_dequantized_model(source, data_dir, tmp_path, desc_act, static_groups, mse,
                                                       true_sequential, bits):
    group = 40  # widths 64 and 192: groups of 40 with a narrower last one (24 and 32)
    defaults = (desc_act, static_groups, mse) == (True, True, 2.4)
    options = {} if defaults else dict(desc_act=desc_act, static_groups=static_groups, mse=mse)
    section = _section(group, true_sequential=true_sequential, bits=bits, **options)
    # a custom variant that sets nothing itself: every GPTQ option comes from quantize.gptq
    section["custom_variants"] = {"gptq-custom": {"method": "gptq"}}
    out = tmp_path / "gptq-custom"
    metrics = quantize.main(["--source", str(source), "--out", str(out), "--variant", "gptq-custom",
                             "--data", str(data_dir), "--config", json.dumps(section)])
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg == {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": True,
                    "static_groups": static_groups, "damp_percent": 0.01, "true_sequential": true_sequential,
                    "format": "gptq", "checkpoint_format": "gptq"}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        p = "model.layers.0.mlp.down_proj"  # in 192: groups 40, 40, 40, 40, 32
        assert tuple(f.get_tensor(f"{p}.scales").shape) == (5, 64)
        assert tuple(f.get_tensor(f"{p}.qweight").shape) == (192 * bits // 32, 64)
        assert tuple(f.get_tensor(f"{p}.qzeros").shape) == (5, 64 * bits // 32)
        g_idx = f.get_tensor(f"{p}.g_idx")
        assert (torch.diff(g_idx) < 0).any() == (desc_act and not static_groups)  # classic act-order: not monotonic
        assert torch.bincount(g_idx).tolist() == [40, 40, 40, 40, 32]
        assert "model.layers.0.mlp.down_proj.weight" not in f.keys()

    assert metrics["calibration"]["dtype"] == quantize.calibration_dtype("auto")  # the default
    reference, results = _gptq_reference(source, data_dir, section, metrics["calibration"]["dtype"])
    loaded = load_quantized(out, kernels=False)
    state = loaded.state_dict()
    for name, r in results.items():
        torch.testing.assert_close(state[f"{name}.weight"], r.weight, rtol=0, atol=0)
    ids = torch.randint(3, loaded.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=0, atol=1e-6)

    assert metrics["method"] == "gptq" and metrics["variant"] == "gptq-custom" and metrics["num_quantized_layers"] == 14
    assert metrics["spec"] == {"method": "gptq", "bits": bits, "group_size": group, "sym": True, "desc_act": desc_act,
                               "static_groups": static_groups, "damp_percent": 0.01,
                               "true_sequential": true_sequential, "mse": mse}
    assert metrics["gptq"] == {"sym": True, "desc_act": desc_act, "static_groups": static_groups, "damp_percent": 0.01,
                               "true_sequential": true_sequential, "mse": mse}
    assert metrics["calibration"]["num_windows"] == 8 and metrics["calibration"]["source"] == "corpus"
    losses = [r.loss for r in results.values()]
    assert metrics["max_gptq_loss"] == pytest.approx(max(losses))
    assert metrics["mean_gptq_loss"] == pytest.approx(sum(losses) / len(losses))
    assert 0 < metrics["seconds_per_decoder_layer"] <= metrics["max_seconds_per_decoder_layer"]
    assert metrics["quantize_seconds"] >= metrics["seconds_per_decoder_layer"]
    assert 0 < metrics["mean_rel_weight_error"] <= metrics["max_rel_weight_error"] < 0.5
    assert json.loads((out / "meta.json").read_text())["metrics"] == metrics


def _logit_err(path, reference, ids) -> float:
    with torch.no_grad():
        ref = reference(ids).logits
        return float(torch.linalg.vector_norm(load_quantized(path)(ids).logits - ref) / torch.linalg.vector_norm(ref))


def test_gptq_beats_rtn_on_held_out_data(source, data_dir, tmp_path):
    group = 32
    rtn = quantize.run(source, tmp_path / "wint4", "wint4", group)
    gptq = quantize.run(source, tmp_path / "gptq-w4", "gptq-w4", group,
                        config=_section(group, {"num_samples": 16}), data_dir=data_dir)
    held_out = torch.from_numpy(TokenFile.open(data_dir, "validation").tokens[:4 * 64].astype("int64")).view(4, 64)
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    err_rtn = _logit_err(tmp_path / "wint4", reference, held_out)
    err_gptq = _logit_err(tmp_path / "gptq-w4", reference, held_out)
    print(f"held-out logit error: wint4 RTN {err_rtn:.4f}, gptq-w4 {err_gptq:.4f}; "
          f"weight error RTN {rtn['mean_rel_weight_error']:.4f}, GPTQ {gptq['mean_rel_weight_error']:.4f}")
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)


def test_calibration_forwards_in_bfloat16_or_float32(source, data_dir, tmp_path):
    """quantize.calibration.dtype: auto resolves by the machine (bf16 where native), each choice is
    recorded, both give a GPTQ better than round-to-nearest's on held-out data and within 10% of
    each other (the bf16 forwards round the activations the Hessians see)."""
    native = native_bf16() is not None
    assert quantize.calibration_dtype("auto") == ("bfloat16" if native else "float32")
    assert quantize.calibration_dtype("float32") == "float32"
    held_out = torch.from_numpy(TokenFile.open(data_dir, "validation").tokens[:4 * 64].astype("int64")).view(4, 64)
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    rtn = quantize.run(source, tmp_path / "wint4", "wint4", 32)
    errors, codes = {"wint4": _logit_err(tmp_path / "wint4", reference, held_out)}, {}
    for dtype in ("float32", "bfloat16"):
        metrics = quantize.run(source, tmp_path / dtype, "gptq-w4", 32, data_dir=data_dir,
                               config=_section(32, {"num_samples": 16, "dtype": dtype}))
        assert metrics["calibration"]["dtype"] == dtype
        errors[dtype] = _logit_err(tmp_path / dtype, reference, held_out)
        with safe_open(str(tmp_path / dtype / "model.safetensors"), "pt") as f:
            codes[dtype] = f.get_tensor("model.layers.1.mlp.down_proj.qweight")
    print(f"held-out logit error: {errors}; wint4 weight error {rtn['mean_rel_weight_error']:.4f}")
    assert max(errors["float32"], errors["bfloat16"]) < 0.8 * errors["wint4"], errors
    assert abs(errors["bfloat16"] - errors["float32"]) < 0.1 * errors["float32"], errors
    assert not torch.equal(codes["float32"], codes["bfloat16"])  # the bf16 forwards did run


def test_bench_heldout_quality_scores_the_quantizer_alone(source, data_dir, tmp_path):
    """bench/quant.py's GPTQ-vs-GPTQModel measure: the float32 source scores itself exactly, and a
    result is scored as the source with its dequantized decoder Linears (load_quantized(kernels=False))."""
    from bench.quant import format_versus, heldout_quality, heldout_windows

    group = 32
    quantize.run(source, tmp_path / "gptq-w4", "gptq-w4", group, config=_section(group), data_dir=data_dir)
    windows = heldout_windows(data_dir, 64)
    tokens = TokenFile.open(data_dir, "validation").tokens
    assert windows.shape == (len(tokens) // 64, 64) and torch.equal(windows[1], torch.tensor(tokens[64:128]).long())
    ids = windows[:4]
    q = heldout_quality(source, {"ours": tmp_path / "gptq-w4"}, ids, batch=3)
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = reference(ids).logits[:, :-1]
        ours = load_quantized(tmp_path / "gptq-w4", kernels=False)(ids).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(ref.reshape(-1, ref.shape[-1]), ids[:, 1:].reshape(-1))
    assert q["fp32"]["perplexity"] == pytest.approx(float(torch.exp(nll)), rel=1e-4)
    assert q["fp32"]["rel_logit_err"] == 0 and q["fp32"]["top1"] == 1 and abs(q["fp32"]["kl"]) < 1e-6
    err = float(torch.linalg.vector_norm(ours - ref) / torch.linalg.vector_norm(ref))
    assert q["ours"]["rel_logit_err"] == pytest.approx(err, rel=1e-4) and err > 0
    assert q["ours"]["kl"] > 0 and 0 < q["ours"]["top1"] <= 1
    rows = {"ours": {"quantizer": "ours", "dtype": "float32", "quantize_s": 1.0, "quantize_s_samples": [1.0, 2.0],
                     "total_s": 2.0, **q["ours"]},
            "fp32": {"quantizer": "float32 source", "dtype": "float32", **q["fp32"]}}
    text = format_versus({"settings": {"bits": 4, "group_size": group, "sym": True, "desc_act": False,
                                       "damp_percent": 0.01, "true_sequential": True, "batch": 8},
                          "calibration_windows": [8, 32], "heldout_windows": [4, 64], "repeats": 2, "rows": rows})
    assert "| ours " in text and "1.0 (1.0-2.0)" in text and f"{err:.4f}" in text


def test_bench_reads_what_gptqmodel_writes(data_dir, tmp_path, tokenizer, tiny_tokenizer_dir):
    """bench/quant.py's GPTQModel runs (its worker subprocess, the --gptqmodel-configs same and awq
    rows) on a tiny source, scored by bench's heldout_quality: every quantized Linear it scores
    (GPTQModel's GPTQ file read by our loader, its AWQ GEMM file by bench's awq_gemm_state_dict) is
    the weight GPTQModel's own code dequantizes from the file (its loaded module's
    dequantize_weight, its AWQ dequantize_gemm; float16 scales, hence the tolerance; a wrong nibble
    order is off by about the weights' size), and the AWQ file's folded norms are read. Four KV
    heads: GPTQModel's AWQ clips output rows in batches of 64."""
    gptqmodel = pytest.importorskip("gptqmodel")
    import argparse

    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    from bench.quant import heldout_quality, run_gptqmodel, scored_model

    source = tmp_path / "source"
    with atomic_dir(source) as tmp:
        save_pretrained(_structured_llama(len(tokenizer), num_key_value_heads=4), tmp, tokenizer_dir=tiny_tokenizer_dir)
    ids = torch.from_numpy(TokenFile.open(data_dir, "train").tokens[:8 * SEQ].astype("int64")).view(8, SEQ)
    group = 32
    settings = {"bits": 4, "group_size": group, "sym": False, "desc_act": True, "static_groups": True,
                "damp_percent": 0.01, "true_sequential": True, "mse": 2.4, "batch": 4}
    dirs = {name: tmp_path / name for name in ("gptq", "awq")}
    for name, extra in (("gptq", {}), ("awq", {"awq": True})):
        run_gptqmodel(source, dirs[name], ids, {**settings, **extra}, "bfloat16", argparse.Namespace(threads=1),
                      tmp_path)
    assert json.loads((dirs["awq"] / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    for name, directory in dirs.items():
        scored = scored_model(reference, directory)
        theirs = gptqmodel.GPTQModel.load(str(directory), device="cpu", dtype=torch.float16).model
        layers = {n: m for n, m in theirs.named_modules() if hasattr(m, "qweight")}
        assert len(layers) == 7 * reference.config.num_hidden_layers, sorted(layers)
        for layer, module in layers.items():
            if name == "awq":
                expected = dequantize_gemm(module.qweight, module.qzeros, module.scales, 4, group).t()
            else:
                expected = module.dequantize_weight().t()
            ours = scored.get_submodule(layer).weight.detach()
            torch.testing.assert_close(ours, expected.float(), rtol=2e-3, atol=2e-3 * float(ours.abs().max()),
                                       msg=lambda m, layer=layer: f"{name} {layer}: {m}")
        norm = "model.layers.0.input_layernorm.weight"
        folded = scored.state_dict()[norm]
        assert torch.equal(folded, theirs.state_dict()[norm].float()) and (name == "gptq") == torch.equal(
            folded, reference.state_dict()[norm])  # AWQ folded its scales into the norm
    held_out = torch.from_numpy(TokenFile.open(data_dir, "validation").tokens[:4 * SEQ].astype("int64")).view(4, SEQ)
    quality = heldout_quality(source, dirs, held_out)
    assert all(0 < quality[name]["rel_logit_err"] < 0.3 for name in dirs), quality


def test_gptq_needs_its_data_and_fails_before_writing(source, data_dir, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(CalibrationError, match=r"quantize\.calibration\.source=corpus reads the experiment's "
                                                r"prepared data: pass --data"):
        quantize.run(source, out, "gptq-w4", 32, config=_section(32))
    with pytest.raises(CalibrationError, match=r"fewer than quantize\.calibration\.seq_len"):
        quantize.run(source, out, "gptq-w4", 32, config=_section(32, {"seq_len": 10**6}), data_dir=data_dir)
    with pytest.raises(ValueError, match=r"quantize\.gptq\.group_size=0"):
        quantize.run(source, out, "gptq-w4", 32, config={**_section(32), "gptq": {"group_size": 0}}, data_dir=data_dir)
    assert not out.exists()


def test_sft_calibration_through_the_stage(source, data_dir, tmp_path):
    """The tokenizer comes from the source dir and is checked against the data's fingerprint."""
    metrics = quantize.run(source, tmp_path / "sft", "gptq-w4", 32, data_dir=data_dir,
                           config=_section(32, {"source": "sft", "num_samples": 4}))
    assert metrics["calibration"]["sft_format"] == "plain" and metrics["calibration"]["num_windows"] == 4
    assert load_quantized(tmp_path / "sft").config.vocab_size > 0


# ---------------------------------------------------------------- the awq variants


def test_awq_beats_rtn_and_its_files_hold_the_model_it_computed(source, data_dir, tmp_path):
    """awq-w4 through the stage: every layer of this Llama (grouped-query attention, outlier norm
    channels) scaled, the 4 norms changed, the held-out logit error below wint4's at the same
    group; the files read back as exactly the model the driver left (dequantized weights and
    folded norms)."""
    group = 32
    section = {"group_size": group, "calibration": {"num_samples": 16, "seq_len": SEQ, "source": "corpus", "seed": 0}}
    quantize.run(source, tmp_path / "wint4", "wint4", group)
    metrics = quantize.run(source, tmp_path / "awq-w4", "awq-w4", group, config=section, data_dir=data_dir)
    assert (metrics["method"], metrics["bits"], metrics["group_size"]) == ("awq", 4, group)
    assert (metrics["awq_scaled_layers"], metrics["awq_folded_tensors"], metrics["num_quantized_layers"]) == (14, 4, 14)
    assert metrics["awq_error_vs_rtn"] < 1.0
    held_out = torch.from_numpy(TokenFile.open(data_dir, "validation").tokens[:4 * 64].astype("int64")).view(4, 64)
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    err_rtn = _logit_err(tmp_path / "wint4", reference, held_out)
    err_awq = _logit_err(tmp_path / "awq-w4", reference, held_out)
    print(f"held-out logit error: wint4 RTN {err_rtn:.4f}, awq-w4 {err_awq:.4f}")
    assert err_awq < 0.9 * err_rtn, (err_awq, err_rtn)

    model = load_causal_lm(source).float().eval()
    ids, _ = calibration_ids(CalibrationSettings(**section["calibration"]), data_dir, None, source)
    awq_quantize_model(model, model.model.layers, list(ids.split(quantize.CALIBRATION_BATCH)),
                       AWQConfig(group_size=group), prefix="model.layers",
                       forward_dtype=FORWARD_DTYPES[metrics["calibration"]["dtype"]])
    with torch.no_grad():
        torch.testing.assert_close(load_quantized(tmp_path / "awq-w4", kernels=False)(held_out).logits,
                                   model(held_out), rtol=1e-5, atol=1e-5)  # our Llama returns the logits


# ---------------------------------------------------------------- the a8w8 variants


def test_a8w8_variants_through_the_stage(source, data_dir, tmp_path):
    """a8w8 and a8w8-smooth: INT8 files in the documented layout, loaded with real INT8 matrix
    products; on the outlier channels of this model, smoothing lowers the held-out logit error."""
    section = _section(32, {"num_samples": 16})
    metrics = {v: quantize.run(source, tmp_path / v, v, config=section, data_dir=data_dir)
               for v in ("a8w8", "a8w8-smooth")}
    qcfg = json.loads((tmp_path / "a8w8-smooth" / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "a8w8" and qcfg["smooth"] is True and qcfg["activation"] == "dynamic"
    with safe_open(str(tmp_path / "a8w8-smooth" / "model.safetensors"), "pt") as f:
        p = "model.layers.0.self_attn.q_proj"
        assert f.get_tensor(f"{p}.weight").dtype == torch.int8
        assert tuple(f.get_tensor(f"{p}.weight_scale").shape) == (64,)
        assert tuple(f.get_tensor(f"{p}.smooth_scale").shape) == (64,)  # q/k/v read the norm: smoothed
        assert "model.layers.0.self_attn.o_proj.smooth_scale" not in f.keys()  # smooth_all_linears false
    m = metrics["a8w8-smooth"]
    assert m["method"] == "a8w8" and m["bits"] == 8 and m["num_quantized_layers"] == 14
    assert m["spec"]["smooth"] is True and m["a8w8"]["smooth_alpha"] == 0.5
    assert set(m["smooth_alphas"]) == {f"model.layers.{i}.{n}" for i in (0, 1) for n in
                                       ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                        "mlp.gate_proj", "mlp.up_proj")}
    assert m["calibration"]["num_windows"] == 16 and m["calibration"]["memory_bytes"] > 0
    assert metrics["a8w8"]["smooth_alphas"] == {}

    held_out = torch.from_numpy(TokenFile.open(data_dir, "validation").tokens[:4 * 64].astype("int64")).view(4, 64)
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    err = {v: _logit_err(tmp_path / v, reference, held_out) for v in metrics}
    kernels = load_quantized(tmp_path / "a8w8-smooth").quant_kernels
    assert set(kernels.values()) == {"int_mm"} and len(kernels) == 14
    print(f"held-out logit error: a8w8 {err['a8w8']:.4f}, a8w8-smooth {err['a8w8-smooth']:.4f}")
    assert err["a8w8-smooth"] < err["a8w8"] < 0.1


def test_calibration_memory_estimate_refuses_before_loading():
    from stages.quant.calibration import calibration_memory_bytes, check_calibration_memory

    widths = [(4096, 4096), (11008, 4096), (4096, 11008)]  # a 7B Llama block
    need = calibration_memory_bytes(6_700_000_000, widths, num_windows=128, seq_len=2048, batch=8)
    assert need["activations"] == 3 * 128 * 2048 * 4096 * 4 and need["model"] == 8 * 6_700_000_000
    with pytest.raises(CalibrationError, match=r"calibration needs about \d+\.\d\d GiB \(model 49\.92, activations "
                                               r"12\.00, .*\) but 16\.00 GiB are available: 128 windows of 2048 "
                                               r"tokens; lower quantize\.calibration\.num_samples"):
        check_calibration_memory(6_700_000_000, widths, 128, 2048, 8, available=16 * 2**30)
    assert check_calibration_memory(1000, [(8, 8)], 1, 2, 1, available=2**30) > 0
