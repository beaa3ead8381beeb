"""Our GPTQ-layout directories in real GPTQ runtimes: GPTQModel (`GPTQModel.load`) and transformers'
own `from_pretrained` (which needs `optimum` and delegates the kernels to gptqmodel).

Skipped without gptqmodel (and, for the transformers path, optimum); see docs/gptq_interop.md for
the install recipe and the format rules these tests pin down.

What each runtime computes, so what "equal" means here:
- transformers with `GPTQConfig(backend="torch")` and dtype float32 runs GPTQModel's TorchLinear
  in float32, but it forms W = scales * (q - z) in the dtype of the float16 `scales`: W is rounded to
  float16 once. Against our loader with the same rounding of W the logits are bit-identical; that
  is asserted with float32 tolerances.
- the default CPU kernel (TorchAtenLinear, 4 bits) computes in bfloat16: top-1 agreement with our
  loader >= 97%. GPTQModel.load is run with dtype=float16 (it has no float32 kernel on CPU that
  honours zero points; its default bfloat16 also rounds embeddings and norms, which alone costs a
  real model ~5% top-1, format aside).

What is written (docs/gptq_interop.md): symmetric grids as `format`/`checkpoint_format` "gptq",
asymmetric ones (RTN, GPTQ with sym false) as "gptq_v2", never with a `meta.quantizer` claim.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from gptq_runtimes import import_gptq_runtimes
from safetensors import safe_open

from stages import quantize
from stages.checkpoint.hf import copy_tokenizer, load_state_dict, save_state_dict
from stages.data.corpus import write_token_files
from stages.quant import load_quantized, quantization_config
from stages.quant.gptq import GPTQConfig, gptq_quantize_model
from stages.quant.gptq_pack import pack_bits, pack_gptq, unpack_bits
from stages.quant.layers import decoder_blocks

ROOT = Path(__file__).resolve().parents[2]


gptqmodel = import_gptq_runtimes()

# transformers warns that only the loading attributes (backend) of a passed GPTQConfig are used: intended
pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")

GROUP = 32  # divides the debug flavour's widths 64 and 192, and is a group size every CPU kernel takes
TOP1 = 0.97


def _ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(3, vocab_size, (8, 64), generator=torch.Generator().manual_seed(0))  # (B, T)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def _top1(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def _qcfg(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())["quantization_config"]


def _quantized_names(model_dir: Path) -> list[str]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return [k.removesuffix(".qweight") for k in f.keys() if k.endswith(".qweight")]


def _round_quantized_weights(model: torch.nn.Module, names: list[str]) -> torch.nn.Module:
    """W of each quantized layer rounded through float16, as GPTQModel's torch kernel forms it."""
    for name in names:
        w = model.get_submodule(name).weight
        w.data = w.data.half().float()
    return model


def _gptqmodel(model_dir: Path, **kwargs) -> torch.nn.Module:
    return gptqmodel.GPTQModel.load(str(model_dir), device="cpu", **kwargs).model


def _transformers(model_dir: Path, backend: str | None) -> torch.nn.Module:
    """AutoModelForCausalLM in float32; backend "torch" picks the float32-capable TorchLinear, None
    keeps transformers' choice (TorchAtenLinear at 4 bits on CPU)."""
    pytest.importorskip("optimum")
    kwargs = {}
    if backend is not None:  # only the loading attributes of a passed GPTQConfig are used
        qcfg = {k: v for k, v in _qcfg(model_dir).items() if k != "quant_method"}
        kwargs["quantization_config"] = transformers.GPTQConfig(**qcfg, backend=backend)
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()


def _as_classic_gptq(src: Path, dst: Path) -> Path:
    """The asymmetric layout we must not write: the same tensors with zero points stored as z - 1
    and format "gptq" (v1), no producer meta."""
    qcfg = _qcfg(src)
    bits = qcfg["bits"]
    state = load_state_dict(src)
    for name in [k for k in state if k.endswith(".qzeros")]:
        z = unpack_bits(state[name].t().contiguous(), bits) - 1  # (out, G); rtn keeps z >= 1
        state[name] = pack_bits(z, bits).t().contiguous()  # (G, out * bits // 32)
    _write_dir(src, dst, state, {**qcfg, "format": "gptq", "checkpoint_format": "gptq"})
    return dst


def _write_dir(source: Path, dst: Path, state: dict[str, torch.Tensor], qcfg: dict) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    save_state_dict(state, dst)
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": qcfg}, indent=2) + "\n")
    copy_tokenizer(source, dst)


# ---------------------------------------------------------------- RTN, as `stages.quantize` writes it


@pytest.fixture(scope="module")
def rtn_dirs(debug_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("interop_rtn")
    for variant in ("wint4", "wint8"):
        quantize.run(debug_model_dir, root / variant, variant, GROUP)
    return {variant: root / variant for variant in ("wint4", "wint8")}


@pytest.mark.parametrize("variant", ["wint4", "wint8"])
def test_rtn_config_claims_no_foreign_producer(rtn_dirs, variant):
    qcfg = _qcfg(rtn_dirs[variant])
    quantizers = (qcfg.get("meta") or {}).get("quantizer", [])
    quantizers = [quantizers] if isinstance(quantizers, str) else quantizers
    assert not [q for q in quantizers if q.split(":")[0].lower() in ("gptqmodel", "optimum", "auto_gptq")]
    assert (qcfg["sym"], qcfg["format"], qcfg["checkpoint_format"]) == (False, "gptq_v2", "gptq_v2")


@pytest.mark.parametrize("variant", ["wint4", "wint8"])
def test_transformers_reads_rtn_exactly(rtn_dirs, variant):
    path = rtn_dirs[variant]
    ref = _round_quantized_weights(load_quantized(path, kernels=False), _quantized_names(path))
    ids = _ids(ref.config.vocab_size)
    model = _transformers(path, backend="torch")
    torch.testing.assert_close(_logits(model, ids), _logits(ref, ids))


def test_transformers_default_kernel_reads_rtn(rtn_dirs):
    path = rtn_dirs["wint4"]
    ref = load_quantized(path, kernels=False)
    ids = _ids(ref.config.vocab_size)
    assert _top1(_logits(_transformers(path, backend=None), ids), _logits(ref, ids)) >= TOP1


@pytest.mark.parametrize("variant", ["wint4", "wint8"])
def test_gptqmodel_loads_rtn(rtn_dirs, variant):
    path = rtn_dirs[variant]
    ref = load_quantized(path, kernels=False)
    ids = _ids(ref.config.vocab_size)
    assert _top1(_logits(_gptqmodel(path, dtype=torch.float16), ids), _logits(ref, ids)) >= TOP1


def test_gptqmodel_refuses_asymmetric_classic_gptq(rtn_dirs, tmp_path):
    """Why asymmetric files are "gptq_v2": the same tensors as "gptq" (v1), with no gptqmodel>=0.9.0
    producer claim, are refused by GPTQModel 7.6 (`models/loader.py`); our loader reads both alike."""
    src = rtn_dirs["wint4"]
    v1 = _as_classic_gptq(src, tmp_path / "wint4-v1")
    with pytest.raises(ValueError, match="sym=False.*gptqmodel version >= 0.9.0"):
        _gptqmodel(v1, dtype=torch.float16)
    expected = load_quantized(src, kernels=False).state_dict()
    assert all(torch.equal(t, expected[k]) for k, t in load_quantized(v1, kernels=False).state_dict().items())


# ---------------------------------------------------------------- GPTQ (stages.quant.gptq + gptq_pack)


def _gptq_results(source: Path, config: GPTQConfig):
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    blocks = decoder_blocks(model)
    g = torch.Generator().manual_seed(1)
    calibration = [torch.randint(3, model.config.vocab_size, (4, 64), generator=g) for _ in range(2)]
    return gptq_quantize_model(model, model.get_submodule(blocks), calibration, config, prefix=blocks)


def _reference_from_results(source: Path, results, fp16_weights: bool) -> torch.nn.Module:
    """The float model with every quantized W replaced by the GPTQ result's s * (q - z)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    for name, r in results.items():
        w = r.weight.half().float() if fp16_weights else r.weight
        model.get_submodule(name).weight.data = w
    return model


def _honest_gptq_config(config: GPTQConfig) -> dict:
    """What a GPTQ runtime needs in config.json for a symmetric result: `format` is GPTQModel 7's key,
    `checkpoint_format` the older alias (transformers writes both); no meta.quantizer."""
    return {"quant_method": "gptq", "bits": config.bits, "group_size": config.group_size,
            "desc_act": config.desc_act, "sym": True, "format": "gptq", "checkpoint_format": "gptq",
            "true_sequential": True}


GPTQ_CASES = {
    "4bit": GPTQConfig(bits=4, group_size=GROUP),  # the defaults: act-order, static groups, clipping search
    "4bit-desc_act": GPTQConfig(bits=4, group_size=GROUP, desc_act=True, static_groups=False),  # permuted g_idx
    "3bit": GPTQConfig(bits=3, group_size=GROUP),
    "3bit-asym": GPTQConfig(bits=3, group_size=GROUP, sym=False),  # "gptq_v2"
    "4bit-group128": GPTQConfig(bits=4, group_size=128),  # in 192: groups of 128 and 64; in 64: one
}


@pytest.fixture(scope="module")
def gptq_dirs(debug_model_dir, tmp_path_factory):
    """GPTQ results packed and described by our writer (pack_gptq, quantization_config)."""
    root = tmp_path_factory.mktemp("interop_gptq")
    out = {}
    for case, config in GPTQ_CASES.items():
        results = _gptq_results(debug_model_dir, config)
        qcfg = quantization_config(config.bits, config.group_size, gptq=config)
        state = load_state_dict(debug_model_dir)
        for name, r in results.items():
            del state[f"{name}.weight"]
            state.update({f"{name}.{suffix}": t for suffix, t in pack_gptq(r, qcfg["format"]).items()})
        _write_dir(debug_model_dir, root / case, state, qcfg)
        out[case] = (root / case, results)
    return out


@pytest.mark.parametrize("case", list(GPTQ_CASES))
def test_gptq_loads_in_transformers_exactly(debug_model_dir, gptq_dirs, case):
    path, results = gptq_dirs[case]
    ref = _reference_from_results(debug_model_dir, results, fp16_weights=True)
    ids = _ids(ref.config.vocab_size)
    torch.testing.assert_close(_logits(_transformers(path, backend="torch"), ids), _logits(ref, ids))


@pytest.mark.parametrize("case", list(GPTQ_CASES))
def test_gptq_loads_in_gptqmodel(debug_model_dir, gptq_dirs, case):
    path, results = gptq_dirs[case]
    ref = _reference_from_results(debug_model_dir, results, fp16_weights=False)
    ids = _ids(ref.config.vocab_size)
    # TorchAtenLinear, the 4-bit CPU default, needs group_size to divide in_features (it fails in
    # forward otherwise); TorchLinear takes any group layout.
    kwargs = {"backend": gptqmodel.BACKEND.TORCH} if case == "4bit-group128" else {}
    assert _top1(_logits(_gptqmodel(path, dtype=torch.float16, **kwargs), ids), _logits(ref, ids)) >= TOP1


@pytest.mark.parametrize("case", ["4bit", "4bit-desc_act", "3bit-asym"])
def test_our_loader_reads_gptq(debug_model_dir, gptq_dirs, case):
    path, results = gptq_dirs[case]
    ref = _reference_from_results(debug_model_dir, results, fp16_weights=False)
    ids = _ids(ref.config.vocab_size)
    torch.testing.assert_close(_logits(load_quantized(path, kernels=False), ids), _logits(ref, ids))


def test_writer_config_matches_honest_config():
    config = GPTQ_CASES["4bit-desc_act"]
    honest = _honest_gptq_config(config)
    assert quantization_config(config.bits, config.group_size, sym=True, desc_act=True) == honest
    # with the GPTQ options: the same keys plus those GPTQ applied
    assert quantization_config(config.bits, config.group_size, gptq=config) == \
        {**honest, "static_groups": False, "damp_percent": config.damp_percent}
    plain = GPTQ_CASES["4bit"]  # the defaults: act-order with static groups (a monotonic g_idx)
    assert quantization_config(plain.bits, plain.group_size, gptq=plain) == \
        {**_honest_gptq_config(plain), "desc_act": True, "static_groups": True, "damp_percent": plain.damp_percent}
    asym = quantization_config(config.bits, config.group_size, gptq=GPTQ_CASES["3bit-asym"])
    assert (asym["sym"], asym["format"], asym["checkpoint_format"]) == (False, "gptq_v2", "gptq_v2")
    assert "meta" not in asym


# ---------------------------------------------------------------- the stage: python -m stages.quantize


@pytest.fixture(scope="module")
def stage_data_dir(debug_model_dir, tmp_path_factory):
    """A prepared corpus of random tokens in the debug model's vocabulary: the calibration source."""
    root = tmp_path_factory.mktemp("interop_stage")
    vocab = json.loads((debug_model_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(2)
    docs = {split: [torch.randint(3, vocab, (100,), generator=g).tolist() for _ in range(n)]
            for split, n in (("train", 12), ("validation", 2))}
    write_token_files(root / "data", docs, vocab_size=vocab, bos_id=1, eos_id=2, pad_id=0)
    return root / "data"


CALIBRATION = {"num_samples": 16, "seq_len": 64, "source": "corpus", "seed": 0}


@pytest.fixture(scope="module")
def stage_gptq_dir(debug_model_dir, stage_data_dir):
    """`python -m stages.quantize --variant gptq-w4` with quantize.gptq's defaults (act-order with static
    groups, the clipping search, symmetric) on the debug model, calibrated on a corpus of random tokens."""
    section = {"group_size": GROUP, "calibration": CALIBRATION}
    out = stage_data_dir.parent / "gptq-w4"
    subprocess.run([sys.executable, "-m", "stages.quantize", "--source", str(debug_model_dir), "--out", str(out),
                    "--variant", "gptq-w4", "--data", str(stage_data_dir), "--config", json.dumps(section)],
                   cwd=ROOT, check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def stage_awq_dir(debug_model_dir, stage_data_dir):
    """The awq-w4 variant of the debug model (asymmetric, group 32), calibrated as gptq-w4."""
    out = stage_data_dir.parent / "awq-w4"
    quantize.run(debug_model_dir, out, "awq-w4", GROUP, config={"calibration": CALIBRATION}, data_dir=stage_data_dir)
    return out


def test_stage_gptq_output_loads_in_both_runtimes(stage_gptq_dir):
    path = stage_gptq_dir
    qcfg = _qcfg(path)
    assert (qcfg["sym"], qcfg["desc_act"], qcfg["format"], qcfg["checkpoint_format"]) == (True, True, "gptq", "gptq")
    assert "meta" not in qcfg
    ref = load_quantized(path, kernels=False)
    ids = _ids(ref.config.vocab_size)
    expected = _logits(ref, ids)
    # bf16 (transformers' default kernel) and fp16 (GPTQModel) computation: the same tokens win
    top1 = {"transformers": _top1(_logits(_transformers(path, backend=None), ids), expected),
            "gptqmodel": _top1(_logits(_gptqmodel(path, dtype=torch.float16), ids), expected)}
    assert min(top1.values()) >= TOP1, top1
    # float32 TorchLinear forms W in float16: equal to our loader with W rounded the same way
    _round_quantized_weights(ref, _quantized_names(path))
    torch.testing.assert_close(_logits(_transformers(path, backend="torch"), ids), _logits(ref, ids))


def test_gptqmodel_users_encode_prompt_text_as_the_predictor(debug_model_dir, tmp_path):
    """GPTQModel as its users call it on a variant quantized from a model with the tokenizer prepare
    writes: `GPTQModel.load(dir)` brings the directory's tokenizer, and `generate(text)` continues
    the predictor's prompt ids (`[bos] src`) of the text. Its fp16 greedy tokens are not compared with
    ours: quantized logits near-tie on this random model (TOP1 above)."""
    from checkpoint_fixtures import save_prepared_tokenizer

    from stages.data.sft import SftRecord, encode_prompt
    from stages.data.tokenizer import load_model_tokenizer

    base = tmp_path / "base"
    shutil.copytree(debug_model_dir, base)
    save_prepared_tokenizer(base)
    quantize.run(base, tmp_path / "wint8", "wint8", GROUP)
    loaded = gptqmodel.GPTQModel.load(str(tmp_path / "wint8"), device="cpu", dtype=torch.float16)
    ours = load_model_tokenizer(tmp_path / "wint8")
    for text in ("what colour is the apple?", "sky", "def main(argv): return 0"):
        prompt = encode_prompt(ours, SftRecord(src=[text], tgt=[""]), 1 << 20)
        assert prompt[0] == ours.bos_token_id and loaded.tokenizer(text)["input_ids"] == prompt
        out = loaded.generate(text, max_new_tokens=4, do_sample=False)
        assert out[0, :len(prompt)].tolist() == prompt and out.shape[1] > len(prompt)


def test_stage_awq_output_loads_in_transformers_gptqmodel_and_our_kernels(stage_awq_dir):
    """AWQ writes round-to-nearest codes of its scaled weights and the norms it folded the scales
    into, in the GPTQ layout: transformers (exactly, with the float32 kernel) and GPTQModel read it
    as our loader does, and our int4 kernels run it."""
    path = stage_awq_dir
    qcfg = _qcfg(path)
    assert (qcfg["quant_method"], qcfg["sym"], qcfg["format"], qcfg["bits"]) == ("gptq", False, "gptq_v2", 4)
    ref = load_quantized(path, kernels=False)
    ids = _ids(ref.config.vocab_size)
    expected = _logits(ref, ids)
    top1 = {"transformers": _top1(_logits(_transformers(path, backend=None), ids), expected),
            "gptqmodel": _top1(_logits(_gptqmodel(path, dtype=torch.float16), ids), expected),
            "our int4 kernels": _top1(_logits(load_quantized(path), ids), expected)}
    assert min(top1.values()) >= TOP1, top1
    _round_quantized_weights(ref, _quantized_names(path))
    torch.testing.assert_close(_logits(_transformers(path, backend="torch"), ids), _logits(ref, ids))
