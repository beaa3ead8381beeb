"""Pretrain the project's Llama on the tokenized corpus through a DeepSpeed engine.

Launched by the `pretrain` rule as `torchrun --nproc_per_node <world_size> -m stages.pretrain ...`
(or directly, as one process). world_size = data x tensor x pipeline parallel degrees;
`sharding` selects the DeepSpeed ZeRO stage over the data-parallel group. Collectives go through
gloo on CPU and NCCL on GPU.

Determinism: the model is initialised from `seed` as if whole (every rank draws the same weights
and keeps only its own slice, `stages.training.materialize`), and the data order is a seeded
permutation of fixed-length windows; the global batch of step s is the same whatever the number
of ranks, so runs with different layouts see the same tokens.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stages import settings
from stages.checkpoint.hf import load_config
from stages.checkpoint.integrity import sha256_file
from stages.config import ARCH_OVERRIDES, sharded_output
from stages.data.corpus import load_split
from stages.data.tokenizer import check_same_tokenizer, load_model_tokenizer
from stages.errors import InputError, run_cli
from stages.model import LlamaConfig, LlamaForCausalLM, config_for_flavour
from stages.sections import ModelSettings, PretrainSettings
from stages.stage_logs import configure_logging, log_io
from stages.training.batches import WindowSampler
from stages.training.checkpointing import model_identity
from stages.training.distributed import finish_distributed, init_distributed
from stages.training.engine import train
from stages.training.materialize import lazy_model, lazy_pretrained
from stages.training.parallelize import parallel_degrees
from stages.training.peak_memory import log_memory_against_plan
from stages.training.seed import set_seed


def _build_config(model_section: ModelSettings, index: dict[str, Any]) -> LlamaConfig:
    if model_section.model_name_or_path:  # GPT-2 too: it pretrains on our model (stages.checkpoint.source)
        return load_config(model_section.model_name_or_path, families="all")
    overrides = {k: model_section[k] for k in ARCH_OVERRIDES}
    return config_for_flavour(model_section.flavour, vocab_size=index["vocab_size"],
                              bos_token_id=index["bos_token_id"], eos_token_id=index["eos_token_id"],
                              pad_token_id=index["pad_token_id"], **overrides)


def _build(model_section: ModelSettings, vocab_size: int, index: dict[str, Any], seed: int,
           init_dir: Path | None = None) -> LlamaForCausalLM:
    """The full model on the meta device, filled with only this rank's slice once the engine has
    sliced it (`stages.training.materialize`): continued pretraining from `init_dir` (the imported
    checkpoint), or initialised from `seed` (the same weights whatever the layout)."""
    if init_dir is not None:
        model = lazy_pretrained(init_dir, families="all")
        if model.config.vocab_size != vocab_size:
            raise InputError(f"--init {init_dir} has vocab_size={model.config.vocab_size} but the data was "
                             f"tokenized for {vocab_size}; prepare the data with this checkpoint's tokenizer "
                             "(prepare --tokenizer)")
        return model
    return lazy_model(_build_config(model_section, index), seed=seed)


def recorded_model_section(model_section: ModelSettings, init_dir: Path | None,
                           model: LlamaForCausalLM) -> dict[str, Any]:
    """The model section meta.json records: for continued pretraining the real source and
    architecture (the flavour and overrides did not apply), else the section as given."""
    if init_dir is None:
        return model_section.as_dict()
    return {"model_name_or_path": model_section.model_name_or_path, "init": str(init_dir),
            "model_type": model.config.model_type, "num_hidden_layers": model.config.num_hidden_layers,
            "hidden_size": model.config.hidden_size}


def data_identity(data_dir: Path, init_dir: Path | None) -> dict[str, Any]:
    """What the checkpoints of a run depend on besides its config: the content of the training
    token files and of a starting checkpoint (hashing reads them once, ~1 s per GB)."""
    identity = {name: sha256_file(data_dir / name) for name in ("index.json", "train.idx", "train.bin")}
    if init_dir is not None:
        identity["init"] = model_identity(init_dir)
    return identity


def run(data_dir: str | Path, out_dir: str | Path, model_section: Mapping[str, Any] | None = None,
        section: Mapping[str, Any] | None = None, checkpoint_dir: str | Path | None = None,
        init_dir: str | Path | None = None) -> dict[str, Any]:
    """Train for `section.max_steps` optimizer steps in the section's layout
    (`stages.training.engine`), checkpointing into `checkpoint_dir` and resuming from it; write the
    HF checkpoint (or, with unified_checkpoint off and tp/pp > 1, the slices for merge_tp), the
    tokenizer, train_log.csv and meta.json into `out_dir`. Returns the metrics (on every rank).
    The `model` and `pretrain` sections are typed settings (`stages.sections`) or mappings, whose
    missing settings take the schema's defaults."""
    data_dir = Path(data_dir)
    model_section, section = ModelSettings.of(model_section), PretrainSettings.of(section)
    log_io("pretrain", reads={"train tokens, tokenizer": data_dir, "starting checkpoint": init_dir},
           writes={"model, train_log.csv, meta.json": out_dir, "checkpoints, resumed from on a rerun": checkpoint_dir})
    set_seed(section.seed)
    index = json.loads((data_dir / "index.json").read_text())
    tokens, _ = load_split(data_dir, "train")
    parallel_degrees(section)  # bad degrees fail here, before any process group exists
    init_distributed()
    init_dir = Path(init_dir) if init_dir is not None else None
    if init_dir is not None:  # the data must be tokenized by the checkpoint's own tokenizer
        check_same_tokenizer(load_model_tokenizer(init_dir), init_dir, index, data_dir)
    model = _build(model_section, index["vocab_size"], index, section.seed, init_dir)
    source = WindowSampler(tokens, section.max_length, section.seed)
    recorded = recorded_model_section(model_section, init_dir, model)
    return train(model, source, section, out_dir, stage="pretrain", tokenizer_dir=data_dir / "tokenizer",
                 parent=init_dir or data_dir, meta_config={"model": recorded, "pretrain": section},
                 checkpoint_dir=checkpoint_dir, identity=data_identity(data_dir, init_dir),
                 sharded_output=sharded_output(section))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.pretrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="prepare's output directory (tokenizer + token files)")
    parser.add_argument("--out", required=True, help="output directory of the HF-layout checkpoint")
    parser.add_argument("--checkpoints", help="working directory of the run's checkpoints (resumed from when "
                        "it holds a complete one of the same recipe); none: no checkpoints")
    parser.add_argument("--model-config", metavar="JSON", help="the experiment's `model` section as one JSON object")
    parser.add_argument("--config", metavar="JSON", help="the experiment's `pretrain` section as one JSON object")
    parser.add_argument("--init", default=None, metavar="DIR",
                        help="continued pretraining: start from this HF checkpoint (results/<name>/base) "
                             "instead of a random-init flavour")
    parser.add_argument("--plan", metavar="JSON", default=None,
                        help="results/<name>/plan.json: log its planned per-device memory beside the measured peak")
    settings.add_arguments(parser, "pretrain")
    settings.add_arguments(parser, "model")
    args = parser.parse_args(argv)
    configure_logging()
    model_section = settings.from_arguments(args, "model", args.model_config)
    section = settings.from_arguments(args, "pretrain", args.config)
    init = args.init or model_section.model_name_or_path  # a direct call without --init
    run(args.data, args.out, model_section, section, args.checkpoints, init)
    if args.plan:
        log_memory_against_plan(args.plan, "pretrain")
    finish_distributed()
    return 0


if __name__ == "__main__":
    run_cli(main, "pretrain")
