"""import_base: a local pretrained checkpoint (`model.model_name_or_path`) -> results/<name>/base/.

    python -m stages.import_base --source /models/SmolLM2-135M-Instruct --out results/smollm2/base

The chain starts from this artifact when the experiment names a checkpoint: `prepare` tokenizes
with its tokenizer, fine-tuning starts from its weights (pretraining is skipped unless
`pretrain.enabled` asks for continued pretraining), and it is evaluated as the `base` variant.

What it does, in order, before anything is written:
1. checks the directory (`stages.checkpoint.source.read_source_config`): config.json with a
   supported architecture, safetensors weights (pickle files are refused), a tokenizer;
2. checks every safetensors file (`stages.checkpoint.weights`: a truncated or foreign file, a shard
   the index lists but the directory lacks, a pickle renamed `.safetensors` is named) and loads the
   tokenizer;
3. for the families our own Llama implements (Llama, Qwen2, Mistral, Qwen3, GLM, GLM-4), loads the
   checkpoint into our model and into transformers' and compares their logits on a fixed probe
   batch: the model our training engine trains must be the one transformers evaluates (max |diff| /
   max |logit| <= 1e-4 in fp32, else the stage fails naming the config field to look at).
Then it copies config.json, generation_config.json, the weights (byte for byte, index included)
and the tokenizer files into `out` atomically, with meta.json: the source path, family,
architecture, parameter count, the weight files' sha256, the parity figures, and (`files`) the
size and sha256 of every weight file, which every later stage verifies before loading `base/`.
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from stages.checkpoint import hf
from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.integrity import sha256_file
from stages.checkpoint.meta import write_meta
from stages.checkpoint.source import FAMILIES, family_of, read_source_config
from stages.checkpoint.tokenizer_files import copy_tokenizer
from stages.checkpoint.weights import check_model_dir, read_header
from stages.data.tokenizer import load_model_tokenizer
from stages.errors import run_cli
from stages.metrics.logit_agreement import logit_agreement
from stages.stage_logs import configure_logging, log_io

log = logging.getLogger(__name__)

PARITY_RTOL = 1e-4  # max |ours - transformers| / max |transformers| on the probe, fp32
PROBE_SHAPE = (2, 48)  # (batch, tokens)
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")


@torch.no_grad()
def our_model_parity(model_dir: Path, vocab_size: int) -> dict[str, float]:
    """Logits of our Llama against transformers' on a seeded probe, both fp32 from `model_dir`."""
    from transformers import AutoModelForCausalLM


    ids = torch.randint(0, vocab_size, PROBE_SHAPE, generator=torch.Generator().manual_seed(0))
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True,
                                                  trust_remote_code=False, use_safetensors=True).eval()
    want = theirs(input_ids=ids).logits.float()
    del theirs
    ours = hf.load_pretrained(model_dir).eval()
    found = logit_agreement(want, ours(ids).float())
    return {"max_abs_logit_diff": found.max_abs_diff, "max_rel_logit_diff": found.rel_err,
            "top1_agreement": found.top1_agreement}


def run(source: str | Path, out_dir: str | Path, check_parity: bool = True) -> dict[str, Any]:
    """Check and import `source` into `out_dir`; returns the metrics written to meta.json."""
    t0 = time.perf_counter()
    source, out_dir = Path(source), Path(out_dir)
    log_io("import_base", reads={"Hugging Face checkpoint": source}, writes={"checked copy": out_dir}, logger=log)
    config = read_source_config(source, key="--source")
    family = family_of(config, source / "config.json")
    check_model_dir(source)  # every shard its index lists is there and whole (meta.json's sha256 if any)
    weights = sorted(source.glob("*.safetensors"))
    num_tensors = sum(len(read_header(p)) for p in weights)
    tokenizer = load_model_tokenizer(source)
    metrics: dict[str, Any] = {
        "family": family.name, "model_type": config.get("model_type"),
        "architecture": (config.get("architectures") or [None])[0], "our_model": family.ours,
        "vocab_size": config.get("vocab_size"), "tokenizer_size": len(tokenizer),
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "num_tensors": num_tensors, "weights_bytes": sum(p.stat().st_size for p in weights),
    }
    if family.ours and check_parity:
        parity = our_model_parity(source, config["vocab_size"])
        metrics.update(parity)
        if not parity["max_rel_logit_diff"] <= PARITY_RTOL:  # also catches NaN
            raise ValueError(
                f"{source}: our Llama and transformers' {metrics['architecture']} disagree on this checkpoint "
                f"(max |logit diff| {parity['max_abs_logit_diff']:.3g}, relative {parity['max_rel_logit_diff']:.3g} "
                f"> {PARITY_RTOL:g}); a config.json field is read differently (rope_parameters / rope_scaling, "
                "head_dim, biases, sliding_window): nothing was written")
    with atomic_dir(out_dir) as tmp:
        for name in MODEL_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, tmp / name)
        for path in weights:
            shutil.copy2(path, tmp / path.name)
        metrics["tokenizer_files"] = copy_tokenizer(source, tmp)
        metrics["weights_sha256"] = {p.name: sha256_file(tmp / p.name) for p in weights}
        metrics["num_parameters"] = _num_parameters(tmp)
        metrics["import_seconds"] = time.perf_counter() - t0
        write_meta(tmp, stage="import_base",
                   config={"model_name_or_path": str(source), "family": family.name,
                           "architecture": metrics["architecture"]},
                   parent=str(source), seed=None, metrics=metrics)
    log.info("imported %s (%s, %d parameters) into %s", source, family.name, metrics["num_parameters"], out_dir)
    return metrics


def _num_parameters(model_dir: Path) -> int:
    """Elements of every tensor in the directory's safetensors files (read from the headers)."""
    return sum(math.prod(entry["shape"]) for path in sorted(model_dir.glob("*.safetensors"))
               for entry in read_header(path).values())


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m stages.import_base", description=__doc__.split("\n")[0])
    parser.add_argument("--source", required=True, metavar="DIR",
                        help="local Hugging Face checkpoint directory (model.model_name_or_path)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory (results/<name>/base), atomic")
    parser.add_argument("--no-parity-check", action="store_true",
                        help=f"skip the our-Llama-vs-transformers logits check (families: "
                             f"{', '.join(f.name for f in FAMILIES.values() if f.ours)}); it loads the model twice")
    args = parser.parse_args(argv)
    configure_logging()
    return run(args.source, args.out, check_parity=not args.no_parity_check)


if __name__ == "__main__":
    run_cli(main, "import_base")
