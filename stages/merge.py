"""Fold a LoRA adapter into its base model: W <- W + (alpha / r) B A, written as a plain HF model.

    python -m stages.merge --adapter results/llama/lora --out results/llama/lora-merged

Works for every family peft's LoRA supports, GPT-2's Conv1D layers included (peft folds B A in
transposed there, `fan_in_fan_out`).

The merge is checked, not trusted: logits of a fixed probe batch are computed through the adapter
(unmerged) and through the merged model, and a max |difference| above `rtol` of the logits' scale
(max |adapter logits|) stops the stage before anything is written. The bound is relative because
fp32 reordering grows with the logits: ~5e-7 of the scale on a debug model, ~7e-6 on a 135M Llama
(2.2e-4 absolute, over the old absolute bound of 1e-4), while a wrong merge is off by ~1e-1.

Both inputs pass `stages.checkpoint.weights` before transformers or peft reads them (the sha256
their meta.json records, no pickle weights, whole safetensors files).

The output has no `lora_` weights, so it loads with `transformers.AutoModelForCausalLM.from_pretrained(dir)`
and no peft; merging it again is impossible by construction (it is not an adapter directory).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import tempfile

import peft
import torch
import transformers

from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import copy_tokenizer
from stages.adapters.peft_files import check_adapter_fits, check_every_adapted_layer_loaded
from stages.checkpoint.meta import META_NAME, write_meta
from stages.checkpoint.store import INDEX, SHARDED
from stages.checkpoint.weights import check_adapter_dir, check_model_dir, refuse_quantized
from stages.errors import InputError, run_cli
from stages.metrics.logit_agreement import logit_error
from stages.stage_logs import configure_logging, log_io
from stages.training.shard_merge import merge as merge_shards

log = logging.getLogger(__name__)

RTOL = 1e-4  # of max |logits|; fp32 merging only reorders sums (observed <= 7e-6, see above)
PROBE_SHAPE = (2, 16)  # (batch, tokens) of the probe batch
PROBE_SEED = 0


class MergeMismatchError(RuntimeError):
    """The merged model's logits differ from the adapter model's beyond the tolerance."""


def read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    """adapter_config.json of a LoRA adapter; ValueError when missing or not LoRA."""
    path = adapter_dir / "adapter_config.json"
    if not path.exists():
        raise InputError(f"--adapter {adapter_dir}: no adapter_config.json; expected a peft adapter "
                         "directory written by `stages.finetune --method lora`")
    config = json.loads(path.read_text())
    if config.get("peft_type") != "LORA":
        raise InputError(f"--adapter {adapter_dir}: peft_type={config.get('peft_type')!r}; only LORA "
                         "adapters can be merged (a prefix adds keys/values, not weight updates)")
    return config


def resolve_base(adapter_dir: Path, adapter_config: dict[str, Any], base_dir: str | Path | None) -> Path:
    """The base model directory: `base_dir` if given, else meta.json's `parent`, else the
    adapter's `base_model_name_or_path`. Relative paths are taken from the working directory,
    as the finetune stage wrote them."""
    if base_dir is None and (adapter_dir / META_NAME).exists():
        base_dir = json.loads((adapter_dir / META_NAME).read_text()).get("parent")
    if base_dir is None:
        base_dir = adapter_config.get("base_model_name_or_path")
    if not base_dir:
        raise InputError(f"--adapter {adapter_dir}: neither meta.json's parent nor adapter_config.json's "
                         "base_model_name_or_path names the base model; pass --base DIR")
    base_dir = Path(base_dir)
    if not (base_dir / "config.json").exists():
        raise InputError(f"base model {base_dir} (for adapter {adapter_dir}) has no config.json; "
                         "pass --base with the directory the adapter was trained on")
    return base_dir


def probe_batch(vocab_size: int) -> torch.Tensor:
    """Fixed pseudo-random token ids (B, T), independent of any tokenizer."""
    g = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, vocab_size, PROBE_SHAPE, generator=g)


@torch.no_grad()
def logits_of(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits.float()


def run(adapter_dir: str | Path, out_dir: str | Path, base_dir: str | Path | None = None,
        rtol: float = RTOL) -> dict[str, Any]:
    """Merge the LoRA adapter in `adapter_dir` into its base, check logits, write `out_dir`.

    Returns metrics: max_abs_logit_diff, logit_scale (max |adapter logits|), rel_err (their
    ratio), rtol, lora_rank, lora_alpha, merged_modules, total_params. Raises MergeMismatchError
    (nothing written) when rel_err > rtol.
    """
    adapter_dir = Path(adapter_dir)
    adapter_config = read_adapter_config(adapter_dir)
    base_dir = resolve_base(adapter_dir, adapter_config, base_dir)
    log_io("merge", reads={"LoRA adapter": adapter_dir, "base model": base_dir}, writes={"merged model": out_dir},
           logger=log)
    check_adapter_dir(adapter_dir)  # sha256 against meta.json, no pickle, a whole safetensors file
    # a LoRA update cannot be folded into quantized weights without re-quantizing them
    refuse_quantized(base_dir, lambda method: (
        f"--base {base_dir} is a quantized model (quant_method={method!r}); merging {adapter_dir} into it would "
        "need its weights de- and re-quantized. Merge into the float model the adapter was trained on, then "
        "quantize the merged model (quantize.source: lora-merged)"))
    model = _adapted_model(adapter_dir, base_dir)
    merged_modules = sum(1 for m in model.modules() if isinstance(m, peft.tuners.lora.LoraLayer))
    merged, diff, scale, rel_err = _merge_checked(model, adapter_dir, base_dir, rtol)

    metrics = {"max_abs_logit_diff": diff, "logit_scale": scale, "rel_err": rel_err, "rtol": rtol,
               "lora_rank": adapter_config.get("r"), "lora_alpha": adapter_config.get("lora_alpha"),
               "merged_modules": merged_modules,
               "total_params": sum(p.numel() for p in merged.parameters())}
    _write_merged(merged, out_dir, adapter_dir, base_dir, rtol, metrics)
    log.info("merged %d LoRA modules of %s into %s: max |logit diff| %.2e (%.2e of the logit scale)",
             merged_modules, adapter_dir, base_dir, diff, rel_err)
    return metrics


def _adapted_model(adapter_dir: Path, base_dir: Path) -> peft.PeftModel:
    """The float base with the adapter attached (unmerged, eval mode). A base of tensor/pipeline
    slices is joined into whole tensors first; every weight file is checked before it is read."""
    with tempfile.TemporaryDirectory(prefix="merge-tp-") as joined:
        if is_sharded(base_dir):  # tensor/pipeline slices: joined into whole tensors first
            log.info("%s holds tensor/pipeline-parallel slices: joining them with merge_tp first", base_dir)
            merge_shards(base_dir, Path(joined) / "base")
            load_dir = Path(joined) / "base"
        else:
            check_model_dir(base_dir)
            load_dir = base_dir
        check_adapter_fits(adapter_dir, load_dir)
        base = transformers.AutoModelForCausalLM.from_pretrained(
            load_dir, dtype=torch.float32, local_files_only=True, trust_remote_code=False, use_safetensors=True)
    model = peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=False)
    check_every_adapted_layer_loaded(model, adapter_dir)
    model.eval()
    return model


def _merge_checked(model: peft.PeftModel, adapter_dir: Path, base_dir: Path, rtol: float
                   ) -> tuple[torch.nn.Module, float, float, float]:
    """(merged model, max |logit diff|, logit scale, rel_err) of `model.merge_and_unload()`, its
    probe logits checked against the adapter's; MergeMismatchError beyond `rtol` or with a
    `lora_` weight left."""
    ids = probe_batch(model.get_base_model().config.vocab_size)
    before = logits_of(model, ids)
    merged = model.merge_and_unload()
    after = logits_of(merged, ids)
    diff, scale, rel_err = logit_error(before, after)
    if not rel_err <= rtol:  # also catches NaN
        raise MergeMismatchError(f"merging {adapter_dir} into {base_dir} changed the probe logits by "
                                 f"max |diff|={diff:.3e}, {rel_err:.3e} of the logit scale {scale:.3e} > "
                                 f"rtol={rtol:.1e}; nothing was written")
    leftovers = [n for n, _ in merged.named_parameters() if "lora_" in n]
    if leftovers:
        raise MergeMismatchError(f"merge_and_unload left LoRA weights {leftovers[:3]} in the model")
    return merged, diff, scale, rel_err


def _write_merged(merged: torch.nn.Module, out_dir: str | Path, adapter_dir: Path, base_dir: Path, rtol: float,
                  metrics: dict[str, Any]) -> None:
    """`out_dir`, atomically: the merged model, the tokenizer finetune used and meta.json."""
    with atomic_dir(out_dir) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)  # also writes generation_config.json
        # The adapter dir carries the tokenizer finetune used; fall back to the base's.
        tokenizer_src = adapter_dir if (adapter_dir / "tokenizer.json").exists() else base_dir
        copy_tokenizer(tokenizer_src, tmp)
        write_meta(tmp, stage="merge", config={"base": str(base_dir), "rtol": rtol},
                   parent=adapter_dir, seed=None, metrics=metrics)


def is_sharded(model_dir: Path) -> bool:
    """Whether `model_dir` holds tensor/pipeline-parallel slices (`unified_checkpoint: false`)."""
    index = model_dir / INDEX
    return index.exists() and json.loads(index.read_text()).get("format") == SHARDED


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m stages.merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapter", required=True, metavar="DIR",
                        help="LoRA adapter directory written by stages.finetune")
    parser.add_argument("--out", required=True, metavar="DIR", help="output HF model directory, written atomically")
    parser.add_argument("--base", default=None, metavar="DIR",
                        help="base model directory (default: the adapter's meta.json parent)")
    args = parser.parse_args(argv)
    configure_logging()
    return run(args.adapter, args.out, args.base)


if __name__ == "__main__":
    run_cli(main, "merge")
