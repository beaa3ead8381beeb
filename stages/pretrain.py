"""Pretrain the project's Llama on the tokenized corpus through a DeepSpeed engine.

Launched by the `pretrain` rule as `torchrun --nproc_per_node <world_size> -m stages.pretrain ...`
(or directly, as one process). Every process is a data-parallel rank; `sharding` selects the
DeepSpeed ZeRO stage. Collectives go through gloo on CPU and NCCL on GPU.

Determinism: the model is initialised from `seed` before any parallel wrapping (every rank builds
the same weights), and the data order is a seeded permutation of fixed-length windows; the global
batch of step s is the same whatever the number of ranks, so runs with different layouts see the
same tokens.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import load_pretrained, save_pretrained
from stages.checkpoint.meta import write_meta
from stages.data.corpus import load_split
from stages.model import LlamaForCausalLM, build_model, config_for_flavour
from stages.training.log import TrainLog
from stages.training.schedule import build_scheduler
from stages.training.seed import set_seed

log = logging.getLogger("stages.pretrain")

ZERO_STAGES = {"none": 0, "stage1": 1, "stage2": 2, "stage3": 3}


class WindowSampler:
    """Fixed-length training windows of a token file, in a seeded order, batched globally.

    Window i covers tokens [i*T, (i+1)*T). Optimizer step s consumes the `global_batch` windows
    order[s*G : (s+1)*G] (epochs reshuffle with seed+epoch); rank r of `world` takes the r-th
    contiguous slice of them, cut into micro-batches.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.num_windows = len(tokens) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"the training split has {len(tokens)} tokens, fewer than one window of "
                             f"pretrain.max_length={seq_len}; lower max_length or add corpus text")

    def _window_ids(self, start: int, count: int) -> np.ndarray:
        ids, pos = [], start
        while len(ids) < count:
            epoch, offset = divmod(pos, self.num_windows)
            order = np.random.default_rng(self.seed + epoch).permutation(self.num_windows)
            take = min(count - len(ids), self.num_windows - offset)
            ids.extend(order[offset:offset + take])
            pos += take
        return np.asarray(ids)

    def micro_batches(self, step: int, global_batch: int, rank: int, world: int, micro: int) -> list[torch.Tensor]:
        """The micro-batches (each (micro, T) int64) of `rank` for optimizer step `step`."""
        ids = self._window_ids(step * global_batch, global_batch)
        per_rank = global_batch // world
        mine = ids[rank * per_rank:(rank + 1) * per_rank]
        T = self.seq_len
        rows = np.stack([self.tokens[i * T:(i + 1) * T].astype(np.int64) for i in mine])  # (per_rank, T)
        return [torch.from_numpy(rows[j:j + micro]) for j in range(0, per_rank, micro)]


def deepspeed_config(section: dict[str, Any], world: int) -> dict[str, Any]:
    """The DeepSpeed JSON config for a validated `pretrain` section."""
    micro = section["per_device_train_batch_size"]
    accum = section["gradient_accumulation_steps"]
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * world,
        "gradient_clipping": section["max_grad_norm"],
        "zero_optimization": {"stage": ZERO_STAGES[section["sharding"]]},
        "zero_allow_untested_optimizer": True,  # torch AdamW runs on CPU; DeepSpeed's fused Adam is CUDA-only
        "bf16": {"enabled": bool(section["bf16"])},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _build(model_section: dict[str, Any], vocab_size: int, index: dict[str, Any], seed: int) -> LlamaForCausalLM:
    if model_section.get("model_name_or_path"):
        model = load_pretrained(model_section["model_name_or_path"])
        if model.config.vocab_size < vocab_size:
            raise ValueError(f"model.model_name_or_path has vocab_size={model.config.vocab_size} but the "
                             f"tokenizer has {vocab_size} tokens")
        return model
    config = config_for_flavour(model_section["flavour"], vocab_size=vocab_size,
                                bos_token_id=index["bos_token_id"], eos_token_id=index["eos_token_id"],
                                pad_token_id=index["pad_token_id"])
    return build_model(config, seed=seed)


def _gathered_state(engine, zero_stage: int) -> dict[str, torch.Tensor]:
    """The full fp32 state dict (ZeRO-3 parameters are gathered from their shards)."""
    import deepspeed

    module = engine.module
    if zero_stage == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().clone().float() for k, v in module.state_dict().items()}
    return {k: v.detach().clone().float() for k, v in module.state_dict().items()}


def run(data_dir: str | Path, out_dir: str | Path, model_section: dict[str, Any],
        section: dict[str, Any]) -> dict[str, Any]:
    """Train for `section['max_steps']` optimizer steps; rank 0 writes the HF checkpoint, the
    tokenizer, train_log.csv and meta.json into `out_dir`. Returns the metrics (on every rank)."""
    import deepspeed
    import torch.distributed as dist

    data_dir, out_dir = Path(data_dir), Path(out_dir)
    seed = section["seed"]
    set_seed(seed)
    index = json.loads((data_dir / "index.json").read_text())
    tokens, _ = load_split(data_dir, "train")

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" not in os.environ:  # a plain `python -m stages.pretrain`: a world of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != section["world_size"]:
        raise ValueError(f"pretrain.world_size={section['world_size']} but {world} processes were "
                         "launched; launch with torchrun --nproc_per_node equal to world_size")

    model = _build(model_section, index["vocab_size"], index, seed)
    model.gradient_checkpointing = bool(section.get("recompute", False))
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=section["learning_rate"],
                                  betas=(section["adam_beta1"], section["adam_beta2"]),
                                  weight_decay=section["weight_decay"], eps=1e-8)
    scheduler = build_scheduler(optimizer, section)
    ds_config = deepspeed_config(section, world)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)

    micro, accum = section["per_device_train_batch_size"], section["gradient_accumulation_steps"]
    global_batch = micro * accum * world
    sampler = WindowSampler(tokens, section["max_length"], seed)
    tokens_per_step = global_batch * section["max_length"]
    staging = out_dir.parent / f".{out_dir.name}.log"  # rank 0's live log, moved into the artifact
    staging.mkdir(parents=True, exist_ok=True)
    train_log = TrainLog(staging / "train_log.csv", section["max_steps"], enabled=rank == 0, desc="pretrain")
    losses: list[float] = []
    engine.train()
    since_log = 0
    for step in range(section["max_steps"]):
        step_loss = torch.zeros(())
        lr = scheduler.get_last_lr()[0]  # the rate this step's update uses
        for batch in sampler.micro_batches(step, global_batch, rank, world, micro):
            batch = batch.to(engine.device)
            _, loss = engine(batch, labels=batch)
            engine.backward(loss)
            engine.step()  # DeepSpeed applies the optimizer only at the accumulation boundary
            step_loss += loss.detach().float().cpu() / accum
        if world > 1:  # mean over data-parallel ranks, for the log only
            dist.all_reduce(step_loss)
            step_loss /= world
        losses.append(step_loss.item())
        since_log += tokens_per_step
        train_log.advance()
        if (step + 1) % section["logging_steps"] == 0 or step + 1 == section["max_steps"]:
            grad_norm = engine.get_global_grad_norm()
            train_log.log(step + 1, losses[-1], lr,
                          None if grad_norm is None else float(grad_norm), since_log)
            since_log = 0
    train_log.close()

    zero_stage = ZERO_STAGES[section["sharding"]]
    state = _gathered_state(engine, zero_stage)
    rows = train_log.rows
    metrics = {
        "first_loss": losses[0], "final_loss": losses[-1],
        "final_loss_mean_last10": float(np.mean(losses[-10:])),
        "steps": section["max_steps"], "num_parameters": n_params, "world_size": world,
        "zero_stage": zero_stage, "tokens_seen": tokens_per_step * section["max_steps"],
        "tokens_per_s": float(np.median([float(r["tokens_per_s"]) for r in rows[1:] or rows])) if rows else None,
    }
    if rank == 0:
        final = build_model(engine.module.config, device="meta")  # ZeRO-3 left `model` partitioned
        final.load_state_dict(state, assign=True)
        with atomic_dir(out_dir) as tmp:
            save_pretrained(final, tmp, tokenizer_dir=data_dir / "tokenizer")
            os.replace(staging / "train_log.csv", tmp / "train_log.csv")
            write_meta(tmp, stage="pretrain", config={"model": model_section, "pretrain": section},
                       parent=data_dir, seed=seed, metrics=metrics)
        staging.rmdir()
        log.info("pretrain: wrote %s (final loss %.4f)", out_dir, losses[-1])
    dist.barrier()
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.pretrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="prepare's output directory (tokenizer + token files)")
    parser.add_argument("--out", required=True, help="output directory of the HF-layout checkpoint")
    parser.add_argument("--model-config", required=True, help="the experiment's validated `model` section as JSON")
    parser.add_argument("--config", required=True, help="the experiment's validated `pretrain` section as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run(args.data, args.out, json.loads(args.model_config), json.loads(args.config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
