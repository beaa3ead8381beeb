"""Quantized inference on CPU: latency and memory of each quantized variant against fp32 and bf16.

Per model size (`--sizes`: a flavour of `stages.model.config.FLAVOURS` such as tiny, built with our
model and saved by `stages.checkpoint.hf.save_pretrained`, or `135m`: transformers' LlamaForCausalLM
with the SmolLM2-135M shape, random init, saved by transformers): a float32 source directory and a
prepared data directory of random Zipf-like tokens are written, every variant (`--variants`) is made
by the quantize stage itself (`stages.quantize.run`, calibrated ones on `--calib-samples` windows of
`--calib-seq-len` tokens) and loaded with `stages.quant.load_quantized`. Then, for fp32 (the source
loaded by transformers in float32), bf16 (the same `.to(torch.bfloat16)`) and each variant:

  prefill     ms of one cache-free forward over batch 1 and batch 8 x `--prefill-tokens` random ids
              (logits of the last position only, as generation computes them)
  decode      ms per token of greedy decoding with the KV cache at batch 1, after an untimed
              `--decode-prompt`-token prompt: the mean over `--decode-tokens` single-token steps
  weights     bytes of the loaded model's parameters and buffers (each storage once,
              `stages.metrics.speed.model_bytes`) and of its quantized decoder Linears alone
  peak RSS    VmHWM of a separate process per model that loads it and runs one batch-8 prefill
              and a few decode steps (so peaks do not mix), and that less its RSS after the imports
  quantize    the stage's `quantize_seconds` (the quantization itself), the wall time of the whole
              `stages.quantize.run` call, and GPTQ's / A8W8's seconds per decoder layer (meta.json)

GPTQ against GPTQModel (`--gptqmodel`, with gptq-w4 among the variants; `--gptqmodel-source DIR
--gptqmodel-data DIR` does it alone on an existing float model, e.g. a trained one): GPTQModel
quantizes the same float source with the same calibration windows (the token ids that
`stages.quant.calibration.calibration_ids` gives the stage, in batches of its `CALIBRATION_BATCH`)
and gptq-w4's settings (bits, group_size, sym, desc_act, static_groups, damp_percent,
true_sequential, mse; its act_group_aware off, which ours lacks; `--gptqmodel-configs defaults` runs
it with its own defaults beyond the grid instead, `same,defaults` both; `awq` adds GPTQModel's AWQ
with its defaults on the same grid, beside our awq-w4 from `--awq`), in a subprocess per
`--gptqmodel-dtypes` entry (GPTQModel's CPU default is bfloat16, weights and calibration forward).
Ours and each GPTQModel run go `--gptqmodel-repeats` times in turn; the medians are printed.
Reported: ours `quantize_seconds` and the stage call's wall time; GPTQModel's `quantize()` call and
load + quantize + save; and, on held-out windows of the data's validation split, for the float32
source with each result's dequantized decoder Linears swapped in (the quantizer's effect alone; both
results read by `stages.quant.load_quantized(kernels=False)`, GPTQModel's AWQ GEMM file by
`awq_gemm_state_dict`, its folded norms included): perplexity, relative logit error
||l - l_fp32|| / ||l_fp32||, top-1 agreement and mean KL(fp32 || quantized). With random weights the
perplexity is near the vocabulary size for every model; the logit error, top-1 and KL are the
measures that separate them there. Our calibration forwards run in `--calib-dtype`
(quantize.calibration.dtype, auto: bfloat16 where native). `--awq` adds our awq-w4 and wint4 of the
source to that table (with the float tensors a file changed, AWQ's folded norms, swapped in too);
`--gptq-asym` runs both GPTQs on the asymmetric grid AWQ and RTN use.

Timings are medians of `--repeats` rounds after `--warmup` rounds; within a round every model runs
once, in a rotated order, so load from other processes hits all of them alike. Ratios to fp32
are measured in the same run; compare those, not absolute numbers across runs.

    .venv/bin/python bench/quant.py                                 # tiny and 135m, all variants
    .venv/bin/python bench/quant.py --sizes tiny --repeats 3
    .venv/bin/python bench/quant.py --sizes 135m --variants gptq-w4 --gptqmodel --skip-memory --repeats 1 --warmup 0
    .venv/bin/python bench/quant.py --help

Prints one table per size and writes JSON (default bench/out/quant.json).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file from anywhere: `stages` is the repo's package

from bench.common import csv_list, finish, load_average, machine_info  # noqa: E402
from stages.checkpoint.atomic import atomic_dir  # noqa: E402
from stages.checkpoint.hf import save_pretrained  # noqa: E402
from stages.config import check_config  # noqa: E402
from stages.data.corpus import write_token_files  # noqa: E402
from stages.metrics.speed import model_bytes  # noqa: E402
from stages.model import build_model, config_for_flavour  # noqa: E402
from stages.model.config import FLAVOURS  # noqa: E402
from stages.quant.layers import decoder_linear_layers, meta_model  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "out" / "quant.json"
ALL_VARIANTS = ("wint8", "wint4", "gptq-w4", "a8w8", "a8w8-smooth")
BASELINES = ("fp32", "bf16")
# SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M config.json); weights are random here.
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, rope_theta=100000.0, hidden_act="silu", bos_token_id=1, eos_token_id=2,
                    pad_token_id=0, initializer_range=0.02)
# Targets of the issue, printed as pass/fail (never asserted).
A8W8_PREFILL_MAX = 0.6  # a8w8 prefill batch 8 x T at most 0.6x fp32's latency
W4_LINEAR_BYTES_MAX = 0.3  # wint4 / gptq-w4 decoder Linear bytes at most 0.3x fp32's; and decode < fp32
A8W8_NAMES = ("a8w8", "a8w8-smooth")
W4_NAMES = ("wint4", "gptq-w4")


# -- machine -----------------------------------------------------------------------------------


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def vm_rss_bytes() -> int:
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """This process's peak resident set size: VmHWM, the high-water mark of its own address space.
    Not `ru_maxrss`, which a process started by fork + exec inherits from its parent's RSS at the
    fork (the bench's parent holds every model, so every worker would report the parent's size)."""
    return _status_bytes("VmHWM")


# -- source model, data and variants -------------------------------------------------------------

def write_source(size: str, path: Path, vocab_size: int) -> dict[str, Any]:
    """A float32 HF-layout source directory of `size`; returns its shape."""
    with atomic_dir(path) as tmp:
        if size == "135m":
            config = transformers.LlamaConfig(**SMOLLM2_135M)
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(config).float().eval()
            model.save_pretrained(tmp, safe_serialization=True)
            n_params = sum(p.numel() for p in model.parameters())  # tied embedding counted once
            shape = {k: SMOLLM2_135M[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                   "num_attention_heads", "num_key_value_heads", "vocab_size",
                                                   "tie_word_embeddings")}
            built_by = "transformers.LlamaForCausalLM (random init, SmolLM2-135M shape)"
        else:
            config = config_for_flavour(size, vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0)
            model = build_model(config, seed=0).eval()
            save_pretrained(model, tmp)
            n_params = config.num_parameters()
            shape = {**FLAVOURS[size], "vocab_size": vocab_size}
            built_by = f"stages.model flavour {size} (random init)"
        del model
    return {"num_parameters": n_params, "built_by": built_by, **shape}


def write_data(path: Path, vocab_size: int, num_tokens: int, seed: int = 0) -> None:
    """A prepared data dir (index.json + token splits) of Zipf-like random documents of 256 tokens."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, vocab_size - 2, dtype=torch.float) ** 1.1  # ids 3..V-1

    def docs(n: int) -> list[list[int]]:
        return [(torch.multinomial(weights, 256, replacement=True, generator=gen) + 3).tolist() for _ in range(n)]

    # validation: held-out windows for GPTQ vs GPTQModel (drawn after train, so train does not change)
    write_token_files(path, {"train": docs(num_tokens // 256 + 2), "validation": docs(8)}, vocab_size=vocab_size,
                      bos_id=1, eos_id=2, pad_id=0)


def quantize_section(args: argparse.Namespace) -> dict[str, Any]:
    """The validated `quantize` section (schema defaults) the variants are made with."""
    section = {"group_size": args.group_size, "variants": list(args.variants),
               "calibration": {"num_samples": args.calib_samples, "seq_len": args.calib_seq_len,
                               "source": "corpus", "seed": getattr(args, "calib_seed", 0),
                               "dtype": getattr(args, "calib_dtype", "auto")}}
    if getattr(args, "gptq_asym", False):
        section["gptq"] = {"sym": False}
    return check_config({"experiments": {"bench": {"quantize": section}}})["experiments"]["bench"]["quantize"]


def make_variant(source: Path, out: Path, variant: str, section: dict[str, Any], data: Path) -> dict[str, Any]:
    from stages import quantize

    start = time.perf_counter()
    metrics = quantize.run(source, out, variant, config=section, data_dir=data)
    return {"stage_wall_s": time.perf_counter() - start, "metrics": metrics}


# -- loading -------------------------------------------------------------------------------------

def load_model(name: str, model_dir: Path) -> tuple[torch.nn.Module, str]:
    """(model in eval mode, how it was loaded) for a baseline name or a quantized variant's dir."""
    if name in BASELINES:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, local_files_only=True, use_safetensors=True).eval()
        if name == "bf16":
            model = model.to(torch.bfloat16)
        return model, f"transformers {name}"
    from stages.quant import load_quantized

    return load_quantized(model_dir), "load_quantized"


def kernel_summary(model: torch.nn.Module, linear_names: list[str]) -> dict[str, int]:
    """{kernel: layers}: the loader's `quant_kernels` when it sets them, else the decoder Linears'
    module type and weight dtype (e.g. `Linear/float32` for a dequantizing loader)."""
    kernels = getattr(model, "quant_kernels", None)
    counts: dict[str, int] = {}
    if kernels:
        for k in kernels.values():
            counts[str(k)] = counts.get(str(k), 0) + 1
        return counts
    for name in linear_names:
        m = model.get_submodule(name)
        w = getattr(m, "weight", None)
        key = f"{type(m).__name__}/{str(w.dtype).removeprefix('torch.') if w is not None else '?'}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def linear_bytes(model: torch.nn.Module, linear_names: list[str]) -> int:
    """Bytes of the parameters and buffers of the decoder Linears (whatever modules replaced them),
    each tensor once."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    total = 0
    for name in linear_names:
        module = model.get_submodule(name)
        for t in [*module.parameters(), *module.buffers()]:
            key = (t.data_ptr(), t.storage_offset(), tuple(t.shape))
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def source_linear_names(source: Path) -> list[str]:
    config = transformers.AutoConfig.from_pretrained(source, local_files_only=True)
    return sorted(decoder_linear_layers(meta_model(config)))


# -- timing --------------------------------------------------------------------------------------

def random_ids(batch: int, tokens: int, vocab_size: int, seed: int) -> torch.Tensor:
    return torch.randint(3, vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def prefill_s(model: torch.nn.Module, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return time.perf_counter() - start


@torch.inference_mode()
def decode_s_per_token(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> float:
    """Mean seconds per greedy single-token step with the KV cache after `prompt` (not timed)."""
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=token, past_key_values=past, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return (time.perf_counter() - start) / steps


def time_models(models: dict[str, torch.nn.Module], vocab_size: int, args: argparse.Namespace
                ) -> dict[str, dict[str, list[float]]]:
    """{name: {prefill_b1, prefill_b8, decode}: seconds per measured round}; rounds interleave the
    models (a rotated order each round), the first `args.warmup` rounds are dropped."""
    b1 = random_ids(1, args.prefill_tokens, vocab_size, seed=1)
    b8 = random_ids(args.batch, args.prefill_tokens, vocab_size, seed=2)
    prompt = random_ids(1, args.decode_prompt, vocab_size, seed=3)
    names = list(models)
    times = {n: {"prefill_b1": [], f"prefill_b{args.batch}": [], "decode": []} for n in names}
    for r in range(args.warmup + args.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            m = models[n]
            sample = {"prefill_b1": prefill_s(m, b1), f"prefill_b{args.batch}": prefill_s(m, b8),
                      "decode": decode_s_per_token(m, prompt, args.decode_tokens)}
            if r >= args.warmup:
                for k, v in sample.items():
                    times[n][k].append(v)
        print(f"  round {r + 1}/{args.warmup + args.repeats}{' (warm-up)' if r < args.warmup else ''} done",
              file=sys.stderr, flush=True)
    return times


# -- memory worker (one process per model) -------------------------------------------------------

def memory_worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    baseline_peak, baseline_rss = peak_rss_bytes(), vm_rss_bytes()
    start = time.perf_counter()
    model, how = load_model(args.memory_worker, Path(args.model_dir))
    load_s = time.perf_counter() - start
    rss_loaded = vm_rss_bytes()
    vocab = model.config.vocab_size
    prefill_s(model, random_ids(args.batch, args.prefill_tokens, vocab, seed=2))
    decode_s_per_token(model, random_ids(1, args.decode_prompt, vocab, seed=3), 4)
    record = {"name": args.memory_worker, "loaded_by": how, "load_s": load_s, "model_bytes": model_bytes(model),
              "baseline_rss_bytes": baseline_rss, "baseline_peak_rss_bytes": baseline_peak,
              "rss_after_load_bytes": rss_loaded, "peak_rss_bytes": peak_rss_bytes(),
              "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    Path(args.result).write_text(json.dumps(record))


def measure_memory(name: str, model_dir: Path, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    result = tmp / f"memory-{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--memory-worker", name, "--model-dir", str(model_dir),
           "--result", str(result), "--threads", str(args.threads), "--batch", str(args.batch),
           "--prefill-tokens", str(args.prefill_tokens), "--decode-prompt", str(args.decode_prompt)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    if proc.returncode != 0:
        raise RuntimeError(f"memory worker for {name} failed:\n{proc.stderr[-4000:]}")
    return json.loads(result.read_text())


# -- GPTQ against GPTQModel ----------------------------------------------------------------------

GPTQMODEL_DTYPES = ("bfloat16", "float32")


def gptqmodel_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("gptqmodel") is not None


def _with_tokenizer(source: Path, scratch: Path, vocab_size: int) -> Path:
    """A copy of `source` (weights symlinked) with a tokenizer: GPTQModel.load insists on one; the
    bench's sources have none (a word-level one of `vocab_size` ids is written; calibration is passed
    as token ids anyway)."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    for f in source.iterdir():  # weights linked, the small files copied: nothing written reaches `source`
        if f.suffix == ".safetensors":
            (scratch / f.name).symlink_to(f.resolve())
        elif f.is_file():
            shutil.copy2(f, scratch / f.name)
    if (scratch / "tokenizer.json").exists() or (scratch / "tokenizer_config.json").exists():
        return scratch
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         pad_token="<pad>").save_pretrained(scratch)
    return scratch


def gptqmodel_worker(args: argparse.Namespace) -> None:
    """Subprocess: GPTQModel quantizes --model-dir on the saved calibration ids, saves to --quant-out
    and writes its timings to --result (GPTQModel's import changes os.environ and logging, so it
    runs apart from the bench)."""
    torch.set_num_threads(args.threads)
    settings = json.loads(args.gptqmodel_settings)
    ids = torch.load(args.calib, weights_only=True)  # (n, seq_len) int64
    source = _with_tokenizer(Path(args.model_dir), Path(args.result).with_suffix(".src"),
                             json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"])
    import gptqmodel
    from gptqmodel import GPTQModel, QuantizeConfig

    if settings.get("awq"):  # GPTQModel's AWQ (its defaults: scale search, clipping, GEMM packing)
        qcfg = QuantizeConfig(method="awq", format="gemm", bits=settings["bits"], group_size=settings["group_size"],
                              sym=settings["sym"], device="cpu")
    elif settings.get("own_defaults"):  # GPTQModel's defaults for everything but the grid (damp, act_group_aware, ...)
        qcfg = QuantizeConfig(bits=settings["bits"], group_size=settings["group_size"], sym=settings["sym"],
                              device="cpu")
    else:
        qcfg = QuantizeConfig(bits=settings["bits"], group_size=settings["group_size"], sym=settings["sym"],
                              desc_act=settings["desc_act"], static_groups=settings["static_groups"],
                              damp_percent=settings["damp_percent"], true_sequential=settings["true_sequential"],
                              mse=settings.get("mse", 0.0), act_group_aware=False, device="cpu")
    start = time.perf_counter()
    model = GPTQModel.load(str(source), qcfg, dtype=getattr(torch, args.gptqmodel_dtype))
    load_s = time.perf_counter() - start
    calibration = [{"input_ids": row.tolist(), "attention_mask": [1] * len(row)} for row in ids]
    start = time.perf_counter()
    extra = {}
    if settings.get("awq"):  # its AWQ picks a CUDA packer by default; the torch one runs on CPU
        from gptqmodel.utils.backend import BACKEND
        extra["backend"] = BACKEND.AWQ_TORCH
    model.quantize(calibration, batch_size=settings["batch"], **extra)
    quantize_s = time.perf_counter() - start
    start = time.perf_counter()
    model.save(args.quant_out)
    save_s = time.perf_counter() - start
    Path(args.result).write_text(json.dumps({
        "gptqmodel": gptqmodel.__version__, "dtype": args.gptqmodel_dtype, "load_s": load_s,
        "quantize_s": quantize_s, "save_s": save_s, "total_s": load_s + quantize_s + save_s,
        "cpu_workers": os.environ.get("GPTQMODEL_CPU_WORKERS"), "settings": settings,
        "quantize_config": {k: str(v) for k, v in qcfg.to_dict().items() if k != "meta"}}))


def run_gptqmodel(source: Path, out: Path, ids: torch.Tensor, settings: dict[str, Any], dtype: str,
                  args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    calib, result = tmp / f"gptqmodel-calib-{dtype}.pt", tmp / f"{out.name}.json"
    torch.save(ids, calib)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--gptqmodel-worker", "--model-dir", str(source),
           "--quant-out", str(out), "--calib", str(calib), "--result", str(result), "--threads", str(args.threads),
           "--gptqmodel-dtype", dtype, "--gptqmodel-settings", json.dumps(settings)]
    # GPTQModel's model-loader pool wants 2 workers and refuses more than the CPU pool holds
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), GPTQMODEL_CPU_WORKERS=str(max(2, args.threads)))
    start = time.perf_counter()
    # cwd: GPTQModel writes logs/gptq_log_*.log under the working directory; keep them in the bench's tmp
    proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=3600, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"GPTQModel worker ({dtype}) failed:\n{proc.stderr[-4000:]}")
    return {**json.loads(result.read_text()), "process_wall_s": time.perf_counter() - start}


def heldout_windows(data: Path, seq_len: int) -> torch.Tensor:
    """(n, seq_len) consecutive non-overlapping windows of the data's validation split."""
    from stages.data.corpus import TokenFile

    tokens = torch.from_numpy(np.array(TokenFile.open(data, "validation").tokens, dtype=np.int64))
    n = len(tokens) // seq_len
    return tokens[:n * seq_len].view(n, seq_len)


@torch.no_grad()
def scored_model(ref: torch.nn.Module, directory: Path, folded: bool = False) -> torch.nn.Module:
    """A float32 copy of `ref` (the source) with `directory`'s dequantized decoder Linears swapped
    in: the quantizer's effect alone. With `folded` (our own files) also the float tensors the file
    changed (AWQ's folded norms; GPTQModel's bf16 copies of the norms stay the source's); an AWQ GEMM
    file (GPTQModel's AWQ) brings its folded norms always."""
    import copy

    from stages.quant import load_quantized

    m = copy.deepcopy(ref)
    own = m.state_dict()
    if json.loads((directory / "config.json").read_text())["quantization_config"].get("quant_method") == "awq":
        for key, value in awq_gemm_state_dict(directory).items():
            own[key].copy_(value)
        return m
    q = load_quantized(directory, kernels=False)
    quantized = {f"{layer}.weight" for layer in q.quant_kernels}
    for key, value in q.state_dict().items():
        if key in quantized or (folded and key in own and own[key].shape == value.shape):
            own[key].copy_(value)
    return m


@torch.inference_mode()
def heldout_quality(source: Path, dirs: dict[str, Path], windows: torch.Tensor, batch: int = 4,
                    folded: Iterable[str] = ()) -> dict[str, dict[str, float]]:
    """{name: perplexity, rel_logit_err, top1, kl} on `windows`, for the float32 source ("fp32") and
    for each directory's `scored_model` (`folded`: the names of our own files)."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, local_files_only=True,
                                                            use_safetensors=True).eval()
    models = {"fp32": ref, **{name: scored_model(ref, d, name in folded) for name, d in dirs.items()}}
    sums = {n: {"nll": 0.0, "err2": 0.0, "top1": 0.0, "kl": 0.0} for n in models}
    ref2, positions = 0.0, 0
    for ids in windows.split(batch):
        ref_logits = ref(ids).logits[:, :-1].float()
        ref_logp = torch.log_softmax(ref_logits, dim=-1)
        ref2 += float(ref_logits.pow(2).sum())
        positions += ref_logits.shape[0] * ref_logits.shape[1]
        for name, m in models.items():
            logits = ref_logits if m is ref else m(ids).logits[:, :-1].float()
            logp = torch.log_softmax(logits, dim=-1)
            acc = sums[name]
            acc["nll"] -= float(logp.gather(-1, ids[:, 1:, None]).sum())
            acc["err2"] += float((logits - ref_logits).pow(2).sum())
            acc["top1"] += float((logits.argmax(-1) == ref_logits.argmax(-1)).sum())
            acc["kl"] += float((ref_logp.exp() * (ref_logp - logp)).sum())
    return {n: {"perplexity": float(torch.exp(torch.tensor(a["nll"] / positions))),
                "rel_logit_err": (a["err2"] / ref2) ** 0.5, "top1": a["top1"] / positions, "kl": a["kl"] / positions}
            for n, a in sums.items()}


AWQ_GEMM_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the output column of each of a packed int32's 8 nibbles


def awq_gemm_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """The float state dict of an AWQ GEMM checkpoint (GPTQModel's and AutoAWQ's `format: gemm`):
    each quantized Linear's weight (out, in) = ((q - z) * s)^T, with `qweight` (in, out / 8) and
    `qzeros` (in / g, out / 8) int32 packing 8 nibbles along the output in AWQ_GEMM_ORDER and
    `scales` (in / g, out); the other tensors as stored. A bench reader, not a loader: the stage
    files are GPTQ's layout."""
    from safetensors.torch import load_file

    from stages.quant.gptq_format import unpack_bits

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(f))
    position = torch.tensor(AWQ_GEMM_ORDER).argsort()  # packed slot of each output column in a run of 8

    def unpack(packed: torch.Tensor) -> torch.Tensor:  # (r, c / 8) int32 -> (r, c) in column order
        slots = unpack_bits(packed.t().contiguous(), 4).t()  # (r, c): slot t of a word is its bits 4t..4t+3
        return slots.reshape(packed.shape[0], -1, 8)[:, :, position].reshape(packed.shape[0], -1)

    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if key.endswith(".qweight"):
            base = key.removesuffix(".qweight")
            q, z, s = unpack(value), unpack(tensors[f"{base}.qzeros"]), tensors[f"{base}.scales"].float()
            group = q.shape[0] // s.shape[0]
            w_t = (q.float() - z.float().repeat_interleave(group, 0)) * s.repeat_interleave(group, 0)
            out[f"{base}.weight"] = w_t.t().contiguous()
        elif not key.endswith((".qzeros", ".scales")):
            out[key] = value.float()
    return out


def compare_gptqmodel(source: Path, data: Path, ours_dir: Path, ours: dict[str, Any], section: dict[str, Any],
                      args: argparse.Namespace, tmp: Path, log,
                      others: dict[str, tuple[Path, dict[str, Any]]] | None = None) -> dict[str, Any]:
    """GPTQModel on the same source, windows and settings as the stage's gptq-w4 run `ours`
    ({stage_wall_s, metrics}, written to `ours_dir`), then the held-out quality of both (and of
    `others`: {variant: (dir, its make_variant result)}, our other variants of the source). With
    `--gptqmodel-repeats` N, ours (the stage again) and each GPTQModel run go N times in turn
    (`ours` is the first of ours) and the medians are reported, every sample in the JSON."""
    from statistics import median

    from stages.quant.calibration import CalibrationSettings, calibration_ids
    from stages.quantize import CALIBRATION_BATCH

    metrics = ours["metrics"]
    ids, _ = calibration_ids(CalibrationSettings.from_section(section["calibration"]), data)
    if ids.shape[0] != metrics["calibration"]["num_windows"]:
        raise RuntimeError("the calibration windows differ from the stage's")
    spec = metrics["spec"]
    settings = {k: spec[k] for k in ("bits", "group_size", "sym", "desc_act", "static_groups", "damp_percent",
                                     "true_sequential", "mse")}
    settings["batch"] = CALIBRATION_BATCH
    samples: dict[str, list[dict[str, Any]]] = {"ours": [{"quantize_s": metrics["quantize_seconds"],
                                                          "total_s": ours["stage_wall_s"]}]}
    dirs = {"ours": ours_dir}
    for r in range(args.gptqmodel_repeats):
        if r:
            again = make_variant(source, ours_dir, "gptq-w4", section, data)
            samples["ours"].append({"quantize_s": again["metrics"]["quantize_seconds"],
                                    "total_s": again["stage_wall_s"]})
            log(f"ours again: quantize {samples['ours'][-1]['quantize_s']:.1f} s")
        configs = {}  # name suffix -> GPTQModel's settings
        if "same" in args.gptqmodel_configs:
            configs[""] = settings
        if "defaults" in args.gptqmodel_configs:
            configs["-defaults"] = {**settings, "own_defaults": True}
        if "awq" in args.gptqmodel_configs:
            configs["-awq"] = {**settings, "awq": True}
        for dtype in args.gptqmodel_dtypes:
            for suffix, config in configs.items():
                name = f"gptqmodel-{dtype}{suffix}"
                dirs[name] = tmp / name
                samples.setdefault(name, []).append(run_gptqmodel(source, dirs[name], ids, config, dtype, args, tmp))
                g = samples[name][-1]
                log(f"GPTQModel ({dtype}{suffix}): quantize() {g['quantize_s']:.1f} s, "
                    f"load + quantize + save {g['total_s']:.1f} s")
    rows: dict[str, dict[str, Any]] = {}
    for name, runs in samples.items():
        first = runs[0]
        rows[name] = {
            "quantizer": "stages.quantize (ours)" if name == "ours" else
                         f"GPTQModel {first['gptqmodel']}" + {"-defaults": " (its defaults)", "-awq": " AWQ"}.get(
                             name[name.rfind("-"):], ""),
            "dtype": metrics["calibration"]["dtype"] if name == "ours" else first["dtype"],
            "quantize_s": median(x["quantize_s"] for x in runs), "total_s": median(x["total_s"] for x in runs),
            "quantize_s_samples": [x["quantize_s"] for x in runs], "total_s_samples": [x["total_s"] for x in runs]}
        if name != "ours":
            rows[name]["runs"] = runs
    for variant, (path, made) in (others or {}).items():
        dirs[variant] = path
        rows[variant] = {"quantizer": f"stages.quantize {variant} (ours)",
                         "dtype": made["metrics"].get("calibration", {}).get("dtype", "-"),
                         "quantize_s": made["metrics"]["quantize_seconds"], "total_s": made["stage_wall_s"]}
    windows = heldout_windows(data, args.calib_seq_len)
    quality = heldout_quality(source, dirs, windows, folded=["ours", *(others or {})])
    for name, row in rows.items():
        row.update(quality[name])
    rows["fp32"] = {"quantizer": "float32 source", "dtype": "float32", **quality["fp32"]}
    log(f"held-out quality on {windows.shape[0]} windows: "
        + ", ".join(f"{n} err {q['rel_logit_err']:.4f}" for n, q in quality.items()))
    return {"settings": settings, "calibration_windows": list(ids.shape), "heldout_windows": list(windows.shape),
            "repeats": args.gptqmodel_repeats, "rows": rows}


def bench_source(source: Path, data: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """GPTQ against GPTQModel alone on an existing float model and its prepared data (e.g. a trained
    results/<name>/pretrain with results/<name>/data, where perplexity means something)."""
    t0 = time.perf_counter()
    log = lambda msg: print(f"[source {time.perf_counter() - t0:5.0f} s] {msg}", file=sys.stderr,  # noqa: E731
                            flush=True)
    section = quantize_section(argparse.Namespace(**{**vars(args), "variants": ["gptq-w4"]}))
    out = work / "source" / "gptq-w4"
    ours = make_variant(source, out, "gptq-w4", section, data)
    log(f"quantized gptq-w4: {ours['metrics']['quantize_seconds']:.1f} s")
    others = {}
    for variant in ("awq-w4", "wint4") if args.awq else ():
        others[variant] = (work / "source" / variant, make_variant(source, work / "source" / variant, variant,
                                                                   section, data))
        log(f"quantized {variant}: {others[variant][1]['metrics']['quantize_seconds']:.1f} s")
    versus = compare_gptqmodel(source, data, out, ours, section, args, work / "source", log, others)
    return {"source": str(source), "data": str(data), "gptq_vs_gptqmodel": versus,
            "seconds": time.perf_counter() - t0}


# -- one size ------------------------------------------------------------------------------------

def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def bench_size(size: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    t_size = time.perf_counter()
    log = lambda msg: print(f"[{size} {time.perf_counter() - t_size:5.0f} s] {msg}", file=sys.stderr,  # noqa: E731
                            flush=True)
    source, data = work / size / "source", work / size / "data"
    shape = write_source(size, source, args.vocab_size)
    vocab = shape["vocab_size"]
    section = quantize_section(args)
    calibrated = any(v.startswith(("gptq", "a8w8")) for v in args.variants)
    if calibrated:
        write_data(data, vocab, args.calib_samples * args.calib_seq_len * 2)
    log(f"source written ({shape['num_parameters']:,} parameters)")

    quantization: dict[str, Any] = {}
    dirs: dict[str, Path] = {b: source for b in BASELINES}
    for variant in args.variants:
        out = work / size / "quant" / variant
        quantization[variant] = make_variant(source, out, variant, section, data if calibrated else None)
        dirs[variant] = out
        m = quantization[variant]["metrics"]
        log(f"quantized {variant}: {m['quantize_seconds']:.1f} s"
            + (f", {m['seconds_per_decoder_layer']:.2f} s/layer" if "seconds_per_decoder_layer" in m else ""))

    versus: dict[str, Any] | None = None
    if "gptq-w4" in quantization and args.gptqmodel:
        versus = compare_gptqmodel(source, data, dirs["gptq-w4"], quantization["gptq-w4"], section, args,
                                   work / size, log)

    memory: dict[str, Any] = {}
    if not args.skip_memory:
        for name, d in dirs.items():
            memory[name] = measure_memory(name, d, args, work)
            log(f"memory {name}: peak RSS {memory[name]['peak_rss_bytes'] / 2**20:.0f} MiB")

    linear_names = source_linear_names(source)
    models: dict[str, torch.nn.Module] = {}
    rows: dict[str, dict[str, Any]] = {}
    for name, d in dirs.items():
        start = time.perf_counter()
        models[name], how = load_model(name, d)
        rows[name] = {"loaded_by": how, "load_s": time.perf_counter() - start,
                      "kernels": kernel_summary(models[name], linear_names),
                      "model_bytes": model_bytes(models[name]),
                      "linear_bytes": linear_bytes(models[name], linear_names),
                      "dtype": str(next(models[name].parameters()).dtype).removeprefix("torch.")}
    log(f"loaded {len(models)} models; timing {args.warmup} + {args.repeats} interleaved rounds")
    times = time_models(models, vocab, args)
    del models

    pb = f"prefill_b{args.batch}"
    for name, row in rows.items():
        row["samples_s"] = times[name]
        row["prefill_b1_ms"] = _median(times[name]["prefill_b1"]) * 1e3
        row[f"{pb}_ms"] = _median(times[name][pb]) * 1e3
        row["decode_ms_per_token"] = _median(times[name]["decode"]) * 1e3
        if name in memory:
            row["memory"] = memory[name]
        if name in quantization:
            row["quantization"] = quantization[name]
    fp32 = rows["fp32"]
    for row in rows.values():
        row["ratio_to_fp32"] = {
            "prefill_b1": row["prefill_b1_ms"] / fp32["prefill_b1_ms"],
            pb: row[f"{pb}_ms"] / fp32[f"{pb}_ms"],
            "decode": row["decode_ms_per_token"] / fp32["decode_ms_per_token"],
            "model_bytes": row["model_bytes"] / fp32["model_bytes"],
            "linear_bytes": row["linear_bytes"] / fp32["linear_bytes"],
        }
    bf16 = rows["bf16"]
    for row in rows.values():  # the other peer: what a quantized variant gains over plain bf16
        row["ratio_to_bf16"] = {"prefill_b1": row["prefill_b1_ms"] / bf16["prefill_b1_ms"],
                                pb: row[f"{pb}_ms"] / bf16[f"{pb}_ms"],
                                "decode": row["decode_ms_per_token"] / bf16["decode_ms_per_token"],
                                "linear_bytes": row["linear_bytes"] / bf16["linear_bytes"]}
    targets: dict[str, Any] = {}
    for name in A8W8_NAMES:
        if name in rows:
            r = rows[name]["ratio_to_fp32"][pb]
            targets[name] = {f"{pb}_ratio": r, f"{pb}_max": A8W8_PREFILL_MAX, "pass": r <= A8W8_PREFILL_MAX}
    for name in W4_NAMES:
        if name in rows:
            dec, lin = rows[name]["ratio_to_fp32"]["decode"], rows[name]["ratio_to_fp32"]["linear_bytes"]
            targets[name] = {"decode_ratio": dec, "decode_pass": dec < 1.0, "linear_bytes_ratio": lin,
                             "linear_bytes_max": W4_LINEAR_BYTES_MAX, "linear_bytes_pass": lin <= W4_LINEAR_BYTES_MAX,
                             "model_bytes_ratio": rows[name]["ratio_to_fp32"]["model_bytes"],
                             "pass": dec < 1.0 and lin <= W4_LINEAR_BYTES_MAX}
    log(f"done in {time.perf_counter() - t_size:.0f} s")
    result = {"model": shape, "num_decoder_linears": len(linear_names), "rows": rows, "targets": targets,
              "seconds": time.perf_counter() - t_size}
    if versus is not None:
        result["gptq_vs_gptqmodel"] = versus
    return result


# -- report --------------------------------------------------------------------------------------

def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _pf(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def format_size(size: str, result: dict[str, Any], s: dict[str, Any]) -> str:
    m, pb = result["model"], f"prefill_b{s['batch']}"
    lines = [f"## {size}: {m['num_parameters'] / 1e6:.1f}M parameters (hidden {m['hidden_size']}, intermediate "
             f"{m['intermediate_size']}, {m['num_hidden_layers']} layers, {m['num_attention_heads']}/"
             f"{m['num_key_value_heads']} heads, vocab {m['vocab_size']}); {result['num_decoder_linears']} decoder Linears",
             f"prefill 1 and {s['batch']} x {s['prefill_tokens']} tokens; decode {s['decode_tokens']} tokens after a "
             f"{s['decode_prompt']}-token prompt, batch 1; median of {s['repeats']} interleaved rounds "
             f"(+{s['warmup']} warm-up); {s['threads']} threads", ""]
    header = ["variant", "kernels", "pf b1 ms", "x fp32", f"pf b{s['batch']} ms", "x fp32", "dec ms/tok", "x fp32",
              "model MiB", "linears MiB", "lin x fp32", "peak RSS MiB", "RSS-base MiB", "quant s", "s/layer",
              f"a8w8 pf b{s['batch']}<={A8W8_PREFILL_MAX}", "w4 dec<fp32", f"w4 lin<={W4_LINEAR_BYTES_MAX}"]
    table = [header]
    for name, r in result["rows"].items():
        ratio, mem, q = r["ratio_to_fp32"], r.get("memory"), (r.get("quantization") or {}).get("metrics", {})
        kernels = " ".join(f"{k}:{v}" for k, v in r["kernels"].items()) if name not in BASELINES else r["dtype"]
        t = result["targets"].get(name, {})
        table.append([
            name, kernels,
            f"{r['prefill_b1_ms']:.1f}", f"{ratio['prefill_b1']:.2f}",
            f"{r[pb + '_ms']:.1f}", f"{ratio[pb]:.2f}",
            f"{r['decode_ms_per_token']:.2f}", f"{ratio['decode']:.2f}",
            _mib(r["model_bytes"]), _mib(r["linear_bytes"]), f"{ratio['linear_bytes']:.3f}",
            _mib(mem["peak_rss_bytes"]) if mem else "-",
            _mib(mem["peak_rss_bytes"] - mem["baseline_rss_bytes"]) if mem else "-",
            f"{q['quantize_seconds']:.2f}" if q else "-",
            f"{q['seconds_per_decoder_layer']:.2f}" if "seconds_per_decoder_layer" in q else "-",
            _pf(t["pass"]) + f" ({t[pb + '_ratio']:.2f})" if name in A8W8_NAMES and t else "-",
            _pf(t["decode_pass"]) + f" ({t['decode_ratio']:.2f})" if name in W4_NAMES and t else "-",
            _pf(t["linear_bytes_pass"]) + f" ({t['linear_bytes_ratio']:.3f})" if name in W4_NAMES and t else "-",
        ])
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    fmt = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    lines.append(fmt(table[0]))
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += [fmt(row) for row in table[1:]]
    extra = []
    for name, r in result["rows"].items():
        q = (r.get("quantization") or {})
        if q:
            met = q["metrics"]
            extra.append(f"{name}: quantize {met['quantize_seconds']:.2f} s (stage call {q['stage_wall_s']:.1f} s)"
                         + (f", {met['seconds_per_decoder_layer']:.2f} s/decoder layer (max "
                            f"{met['max_seconds_per_decoder_layer']:.2f})" if "seconds_per_decoder_layer" in met else "")
                         + f", mean rel. weight error {met['mean_rel_weight_error']:.4f}, files "
                           f"{met['size_bytes'] / 2**20:.1f} MiB; loaded by {r['loaded_by']} in {r['load_s']:.1f} s")
    vs_bf16 = ", ".join(f"{name} {r['ratio_to_bf16'][pb]:.2f}/{r['ratio_to_bf16']['decode']:.2f}"
                        for name, r in result["rows"].items() if name not in BASELINES)
    lines += ["", f"x bf16 (pf b{s['batch']} / decode): {vs_bf16}"] + extra
    versus = result.get("gptq_vs_gptqmodel")
    if versus is not None:
        lines += ["", format_versus(versus)]
    lines.append(f"size done in {result['seconds']:.0f} s")
    return "\n".join(lines)


def format_versus(versus: dict[str, Any]) -> str:
    st = versus["settings"]
    lines = [f"GPTQ vs GPTQModel: bits {st['bits']}, group_size {st['group_size']}, sym {st['sym']}, desc_act "
             f"{st['desc_act']}, static_groups {st.get('static_groups', False)}, mse {st.get('mse', 0.0)}, damp "
             f"{st['damp_percent']}, true_sequential {st['true_sequential']}; calibration "
             f"{versus['calibration_windows'][0]} x {versus['calibration_windows'][1]} tokens (the same ids, batches "
             f"of {st['batch']}); held-out {versus['heldout_windows'][0]} x {versus['heldout_windows'][1]} tokens, "
             "float32 model with each result's dequantized decoder Linears; times: median of "
             f"{versus.get('repeats', 1)} runs each, in turn", ""]
    header = ["quantizer", "dtype", "quantize s", "total s", "perplexity", "rel. logit err", "top-1 vs fp32",
              "KL vs fp32"]
    table = [header]

    def seconds(r: dict[str, Any], key: str) -> str:
        if key not in r:
            return "-"
        runs = r.get(f"{key}_samples", [])
        return f"{r[key]:.1f}" + (f" ({min(runs):.1f}-{max(runs):.1f})" if len(runs) > 1 else "")

    for r in versus["rows"].values():
        table.append([r["quantizer"], r["dtype"], seconds(r, "quantize_s"), seconds(r, "total_s"),
                      f"{r['perplexity']:.{3 if r['perplexity'] < 1000 else 1}f}", f"{r['rel_logit_err']:.4f}",
                      f"{r['top1']:.4f}", f"{r['kl']:.2e}"])
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    fmt = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    lines += [fmt(table[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(row) for row in table[1:]]
    lines.append("quantize s: ours = meta.json's quantize_seconds (calibration + GPTQ, no packing), GPTQModel = its "
                 "quantize() call (calibration, GPTQ and packing); total s: ours = the stage call (load, GPTQ, pack, "
                 "write), GPTQModel = load + quantize() + save")
    return "\n".join(lines)


def format_report(result: dict[str, Any]) -> str:
    m, s = result["machine"], result["settings"]
    lines = [f"machine: {m['cpu']} | {m['cores']} cores, {m['torch_threads']} torch threads | torch {m['torch']}, "
             f"transformers {m['transformers']} | load average at start {m['loadavg_at_start']}",
             f"variants: group_size {s['group_size']}, calibration {s['calib_samples']} x {s['calib_seq_len']} tokens "
             f"(seed {s.get('calib_seed', 0)}); "
             "linears = the decoder blocks' Linear modules (what is quantized); model = all parameters and buffers "
             "(embeddings, norms and the tied lm_head stay float)", ""]
    for size, r in result["sizes"].items():
        lines += [format_size(size, r, s), ""]
    if "source" in result:
        r = result["source"]
        lines += [f"## {r['source']} (data {r['data']})", "", format_versus(r["gptq_vs_gptqmodel"]), ""]
    return "\n".join(lines).rstrip()


# -- main ----------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    machine = machine_info("transformers", "safetensors", "numpy", has_int_mm=hasattr(torch, "_int_mm"))
    result: dict[str, Any] = {"machine": machine, "settings": {
        "sizes": args.sizes, "variants": args.variants, "repeats": args.repeats, "warmup": args.warmup,
        "threads": args.threads, "batch": args.batch, "prefill_tokens": args.prefill_tokens,
        "decode_prompt": args.decode_prompt, "decode_tokens": args.decode_tokens, "group_size": args.group_size,
        "calib_samples": args.calib_samples, "calib_seq_len": args.calib_seq_len, "calib_dtype": args.calib_dtype,
        "calib_seed": args.calib_seed,
        "vocab_size": args.vocab_size,
        "prefill_logits": "last position only (logits_to_keep=1)",
        "skip_memory": args.skip_memory, "gptqmodel": args.gptqmodel,
        "gptqmodel_dtypes": args.gptqmodel_dtypes, "gptqmodel_repeats": args.gptqmodel_repeats,
        "gptqmodel_source": None if args.gptqmodel_source is None else str(args.gptqmodel_source)}, "sizes": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="quant-bench-", dir=args.out.parent) as tmp:
        for size in args.sizes:
            result["sizes"][size] = bench_size(size, args, Path(tmp))
        if args.gptqmodel_source is not None:
            result["source"] = bench_source(args.gptqmodel_source, args.gptqmodel_data, args, Path(tmp))
    result["machine"]["loadavg_at_end"] = load_average()
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/quant.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=csv_list, default=["tiny", "135m"],
                   help=f"comma-separated: 135m (SmolLM2-135M shape) or flavours {sorted(FLAVOURS)} (default tiny,135m)")
    p.add_argument("--variants", type=csv_list, default=list(ALL_VARIANTS),
                   help=f"comma-separated quantized variants (default {','.join(ALL_VARIANTS)})")
    p.add_argument("--repeats", type=int, default=5, help="measured interleaved rounds (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (default 1)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help=f"torch threads (default {torch.get_num_threads()}, this machine's)")
    p.add_argument("--batch", type=int, default=8, help="the larger prefill batch (default 8)")
    p.add_argument("--prefill-tokens", type=int, default=128, help="tokens per prefill sequence (default 128)")
    p.add_argument("--decode-prompt", type=int, default=32, help="prompt tokens before decoding (default 32)")
    p.add_argument("--decode-tokens", type=int, default=32, help="timed decode steps per round (default 32)")
    p.add_argument("--group-size", type=int, default=64, help="quantize.group_size (wint4, gptq-w4; default 64)")
    p.add_argument("--calib-samples", type=int, default=8, help="calibration windows (default 8)")
    p.add_argument("--calib-seq-len", type=int, default=128, help="tokens per calibration window (default 128)")
    p.add_argument("--calib-seed", type=int, default=0,
                   help="quantize.calibration.seed: which windows calibrate ours and GPTQModel (default 0)")
    p.add_argument("--calib-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="quantize.calibration.dtype: our calibration forwards' precision (default auto)")
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary of flavour sizes (default 4096; 135m: 49152)")
    p.add_argument("--skip-memory", action="store_true", help="skip the peak-RSS subprocesses")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT.relative_to(ROOT)})")
    p.add_argument("--gptqmodel", action="store_true",
                   help="GPTQ against GPTQModel: with gptq-w4 among the variants, GPTQModel quantizes the same "
                        "source with the same windows and settings; times and held-out quality of both")
    p.add_argument("--gptqmodel-dtypes", type=csv_list, default=list(GPTQMODEL_DTYPES),
                   help=f"GPTQModel's model dtype(s), one run each (default {','.join(GPTQMODEL_DTYPES)}; "
                        "bfloat16 is its CPU default)")
    p.add_argument("--gptqmodel-repeats", type=int, default=3,
                   help="rounds of ours and each GPTQModel run, in turn; medians reported (default 3)")
    p.add_argument("--gptqmodel-source", type=Path,
                   help="also compare GPTQ and GPTQModel on this float model dir (e.g. a trained "
                        "results/<name>/pretrain), calibrated on --gptqmodel-data; --sizes '' for this alone")
    p.add_argument("--gptqmodel-data", type=Path, help="the prepared data dir of --gptqmodel-source")
    p.add_argument("--gptqmodel-configs", type=csv_list, default=["same"],
                   help="GPTQModel's settings: same (gptq-w4's, default) and/or defaults (its own beyond bits, "
                        "group size and sym: damp_percent, act_group_aware, desc_act, mse)")
    p.add_argument("--awq", action="store_true",
                   help="with --gptqmodel-source: also our awq-w4 and wint4 (RTN) of the source, in the quality table")
    p.add_argument("--gptq-asym", action="store_true",
                   help="gptq-w4 (ours and GPTQModel's) on AWQ's and RTN's asymmetric grid (quantize.gptq.sym false)")
    p.add_argument("--memory-worker", choices=[*BASELINES, *ALL_VARIANTS], help=argparse.SUPPRESS)
    p.add_argument("--gptqmodel-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gptqmodel-dtype", choices=GPTQMODEL_DTYPES, help=argparse.SUPPRESS)
    p.add_argument("--gptqmodel-settings", help=argparse.SUPPRESS)
    p.add_argument("--calib", help=argparse.SUPPRESS)
    p.add_argument("--quant-out", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_worker or args.gptqmodel_worker:
        return args
    if (args.gptqmodel_source is None) != (args.gptqmodel_data is None):
        p.error("--gptqmodel-source and --gptqmodel-data go together")
    if (args.gptqmodel or args.gptqmodel_source) and not gptqmodel_available():
        p.error("--gptqmodel / --gptqmodel-source need gptqmodel installed (docs/gptq_interop.md)")
    if args.gptqmodel and "gptq-w4" not in args.variants:
        p.error("--gptqmodel compares the gptq-w4 variant: add it to --variants")
    bad = [s for s in args.sizes if s != "135m" and s not in FLAVOURS]
    if bad or not (args.sizes or args.gptqmodel_source):
        p.error(f"--sizes {bad or args.sizes}: choose from 135m, {', '.join(sorted(FLAVOURS))}")
    unknown = [v for v in args.variants if v not in ALL_VARIANTS]
    if unknown:
        p.error(f"--variants {unknown}: choose from {', '.join(ALL_VARIANTS)}")
    bad = [d for d in args.gptqmodel_dtypes if d not in GPTQMODEL_DTYPES]
    if bad:
        p.error(f"--gptqmodel-dtypes {bad}: choose from {', '.join(GPTQMODEL_DTYPES)}")
    if not args.gptqmodel_configs or set(args.gptqmodel_configs) - {"same", "defaults", "awq"}:
        p.error(f"--gptqmodel-configs {','.join(args.gptqmodel_configs)}: choose from same, defaults, awq")
    if args.gptqmodel_repeats < 1:
        p.error("--gptqmodel-repeats must be >= 1")
    if args.repeats < 1 or args.warmup < 0 or args.decode_tokens < 1 or args.threads < 1:
        p.error("--repeats, --decode-tokens and --threads must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory_worker:
        memory_worker(args)
        return 0
    if args.gptqmodel_worker:
        gptqmodel_worker(args)
        return 0
    start = time.perf_counter()
    result = run(args)
    return finish(args.out, result, format_report, start)


if __name__ == "__main__":
    sys.exit(main())
