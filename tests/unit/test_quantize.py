"""stages/quantize.py and stages/quant/{model,loader}.py on a debug model written HF-style."""

import json

import pytest
import torch
import transformers
from safetensors import safe_open

from stages import quantize
from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import load_state_dict, save_pretrained, save_state_dict
from stages.model import build_model, config_for_flavour
from stages.quant import load_quantized
from stages.quant.gptq_format import pack_bits, unpack_bits

VOCAB = 256
GROUP = 16  # divides the debug flavour's widths 64 and 192


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("quant") / "source"
    with atomic_dir(path) as tmp:
        save_pretrained(build_model(config_for_flavour("debug", vocab_size=VOCAB), seed=0), tmp)
        (tmp / "tokenizer_config.json").write_text("{}\n")  # stands in for the tokenizer files
    return path


@pytest.fixture(scope="module")
def quantized(source):
    out = {}
    for variant in ("wint8", "wint4"):
        path = source.parent / variant
        out[variant] = (path, quantize.run(source, path, variant, GROUP))
    return out


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_layout_dtypes_and_shapes(quantized):
    path, _ = quantized["wint4"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        p = "model.layers.0.mlp.down_proj"  # W (64, 192): in 192, out 64
        assert f.get_tensor(f"{p}.qweight").dtype == torch.int32
        assert tuple(f.get_tensor(f"{p}.qweight").shape) == (192 // 8, 64)
        assert tuple(f.get_tensor(f"{p}.qzeros").shape) == (192 // GROUP, 64 // 8)
        assert f.get_tensor(f"{p}.qzeros").dtype == torch.int32
        assert f.get_tensor(f"{p}.scales").dtype == torch.float16
        assert tuple(f.get_tensor(f"{p}.scales").shape) == (192 // GROUP, 64)
        assert f.get_tensor(f"{p}.g_idx").dtype == torch.int32
        assert tuple(f.get_tensor(f"{p}.g_idx").shape) == (192,)
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
    for layer in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        assert f"model.layers.1.{layer}.qweight" in names
        assert f"model.layers.1.{layer}.weight" not in names
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= names
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False,
        "format": "gptq_v2", "checkpoint_format": "gptq_v2", "true_sequential": True}
    assert json.loads((quantized["wint8"][0] / "config.json").read_text())["quantization_config"]["group_size"] == -1
    assert (path / "generation_config.json").exists() and (path / "tokenizer_config.json").exists()


def test_metrics_sizes_and_meta(quantized, source):
    (p8, m8), (p4, m4) = quantized["wint8"], quantized["wint4"]
    assert m4["size_bytes"] < m8["size_bytes"] < m8["source_size_bytes"]
    assert m8["bits"] == 8 and m8["group_size"] == -1 and m4["bits"] == 4 and m4["group_size"] == GROUP
    assert m4["bits_per_weight"] == 4 + 20 / GROUP
    assert m8["num_quantized_layers"] == 14  # 2 layers x 7 Linears
    assert m8["mean_rel_weight_error"] < 0.1 * m4["mean_rel_weight_error"]
    meta = json.loads((p4 / "meta.json").read_text())
    assert meta["stage"] == "quantize" and meta["parent"] == str(source) and meta["metrics"] == m4


def test_load_quantized_logits_are_close_to_the_source(quantized, source):
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = _logits(transformers.AutoModelForCausalLM.from_pretrained(source).eval(), ids)
    err = {}
    for variant, (path, _) in quantized.items():
        model = load_quantized(path)
        assert isinstance(model, transformers.LlamaForCausalLM)
        assert getattr(model.config, "quantization_config", None) is None  # a plain float model
        err[variant] = float((_logits(model, ids) - ref).norm() / ref.norm())
    assert err["wint8"] < 0.02  # INT8 per channel is tight
    assert err["wint8"] < 0.2 * err["wint4"]
    assert err["wint4"] < 0.2


def test_per_channel_int4_is_worse_than_group_wise(source, quantized, tmp_path):
    per_channel = quantize.run(source, tmp_path / "pc", "wint4", -1)
    assert per_channel["mean_rel_weight_error"] > quantized["wint4"][1]["mean_rel_weight_error"]


def test_bad_group_size_fails_before_writing(source, tmp_path):
    out = tmp_path / "bad"
    expected = r"quantize\.group_size=40 does not divide the input width\(s\) \[64, 192\].*divisor of 64 or -1"
    with pytest.raises(ValueError, match=expected):
        quantize.run(source, out, "wint4", 40)
    assert not out.exists()
    with pytest.raises(ValueError, match="variant 'wint2' is unknown"):
        quantize.run(source, out, "wint2", GROUP)


def _with_format(src, dst, qzeros_shift: int, **keys):
    """A copy of quantized dir `src` (weights rewritten, so no meta.json) with `qzeros_shift` added to
    every stored zero point and `keys` set in its quantization_config."""
    config = json.loads((src / "config.json").read_text())
    bits = config["quantization_config"]["bits"]
    state = load_state_dict(src)
    for name in [k for k in state if k.endswith(".qzeros")]:
        stored = unpack_bits(state[name].t().contiguous(), bits) + qzeros_shift  # (out, G)
        state[name] = pack_bits(stored, bits).t().contiguous()  # (G, out * bits // 32)
    dst.mkdir()
    save_state_dict(state, dst)
    config["quantization_config"].update(keys)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_load_quantized_reads_both_formats_and_refuses_others(quantized, tmp_path):
    """RTN writes "gptq_v2" (z stored); the same weights in the classic "gptq" (z - 1 stored), named by
    either key, load to the same model; an unknown format is refused naming the file."""
    path, _ = quantized["wint4"]
    expected = load_quantized(path, kernels=False).state_dict()
    v1 = _with_format(path, tmp_path / "v1", -1, format="gptq", checkpoint_format="gptq")
    alias = _with_format(path, tmp_path / "alias", -1, checkpoint_format="gptq")
    config = json.loads((alias / "config.json").read_text())
    del config["quantization_config"]["format"]  # only the deprecated alias left
    (alias / "config.json").write_text(json.dumps(config))
    for other in (v1, alias):
        state = load_quantized(other, kernels=False).state_dict()
        assert all(torch.equal(state[k], expected[k]) for k in expected)
    marlin = _with_format(path, tmp_path / "marlin", 0, format="marlin", checkpoint_format="marlin")
    with pytest.raises(ValueError, match=r"marlin/config\.json: quantization_config checkpoint format 'marlin' "
                                         r"is not supported.*\['gptq', 'gptq_v2'\]"):
        load_quantized(marlin)


def test_load_quantized_rejects_a_float_directory(source):
    with pytest.raises(ValueError, match="no quantization_config"):
        load_quantized(source)


def test_cli(source, tmp_path):
    out = tmp_path / "cli"
    metrics = quantize.main(["--source", str(source), "--out", str(out), "--variant", "wint4",
                             "--config", json.dumps({"source": "sft", "variants": ["wint4"], "group_size": 8})])
    assert metrics["group_size"] == 8
    # meta.json records what the variant read (stages.quant.variants.variant_settings), as the workflow passes it
    assert json.loads((out / "meta.json").read_text())["config"] == {"group_size": 8, "variant": "wint4"}


@pytest.mark.parametrize("case", ["already-quantized", "bad-group-size"])
def test_cli_refuses_bad_input_in_one_line(case, quantized, source, tmp_path):
    """An input error ends the quantize CLI with exit status 2 and one line naming the cause
    (stages.errors.run_cli), before anything is written."""
    import subprocess
    import sys
    from pathlib import Path

    src, group, expected = {
        "already-quantized": (quantized["wint4"][0], GROUP, "is already quantized; quantize.source must name a float model"),
        "bad-group-size": (source, -5, "'quantize.group_size': -5 is less than the minimum of -1"),
    }[case]
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "stages.quantize", "--source", str(src), "--out", str(out),
                           "--variant", "wint4", "--config", json.dumps({"group_size": group})],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("quantize: error: ") and expected in last, last
    assert not out.exists()
