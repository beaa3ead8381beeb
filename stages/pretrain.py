"""Pretrain the project's Llama on the tokenized corpus through a DeepSpeed engine.

Launched by the `pretrain` rule as `torchrun --nproc_per_node <world_size> -m stages.pretrain ...`
(or directly, as one process). world_size = data x tensor x pipeline parallel degrees;
`sharding` selects the DeepSpeed ZeRO stage over the data-parallel group. Collectives go through
gloo on CPU and NCCL on GPU.

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
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import load_config, load_pretrained, save_pretrained
from stages.checkpoint.meta import write_meta
from stages.config import ARCH_OVERRIDES
from stages.data.corpus import load_split
from stages.model import LlamaConfig, LlamaForCausalLM, build_model, config_for_flavour
from stages.parallel import ParallelDegrees, Topology, apply_tensor_parallel, gather_full_state_dict
from stages.parallel.pipeline import PipelineRunner
from stages.training.flops import flops_per_token, peak_matmul_flops
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


def deepspeed_config(section: dict[str, Any], data_parallel: int, pipeline: bool = False) -> dict[str, Any]:
    """The DeepSpeed JSON config for a validated `pretrain` section over `data_parallel` replicas.
    With `pipeline`, DeepSpeed sees one batch of micro x accum per step: the pipeline schedule,
    not DeepSpeed, cuts it into the micro-batches."""
    micro = section["per_device_train_batch_size"]
    accum = section["gradient_accumulation_steps"]
    if pipeline:
        micro, accum = micro * accum, 1
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * data_parallel,
        "gradient_clipping": section["max_grad_norm"],
        "zero_optimization": {"stage": ZERO_STAGES[section["sharding"]],
                              **({"offload_optimizer": {"device": "cpu"}} if section["sharding_offload"] else {})},
        "zero_force_ds_cpu_optimizer": False,  # offload runs our torch AdamW on the CPU copy
        "zero_allow_untested_optimizer": True,  # torch AdamW runs on CPU; DeepSpeed's fused Adam is CUDA-only
        "bf16": {"enabled": bool(section["bf16"])},
        # dynamic loss scaling from 2^16, halved on overflow (the step is skipped), doubled after
        # 1000 clean steps; DeepSpeed keeps fp32 master weights in the optimizer
        "fp16": {"enabled": bool(section["fp16"]), "loss_scale": 0, "initial_scale_power": 16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _build_config(model_section: dict[str, Any], index: dict[str, Any]) -> LlamaConfig:
    if model_section.get("model_name_or_path"):
        return load_config(model_section["model_name_or_path"])
    overrides = {k: model_section.get(k) for k in ARCH_OVERRIDES}
    return config_for_flavour(model_section["flavour"], vocab_size=index["vocab_size"],
                              bos_token_id=index["bos_token_id"], eos_token_id=index["eos_token_id"],
                              pad_token_id=index["pad_token_id"], **overrides)


def _build(model_section: dict[str, Any], vocab_size: int, index: dict[str, Any], seed: int) -> LlamaForCausalLM:
    """The full model on every rank: from a local checkpoint, or initialised from `seed` (the same
    weights whatever the layout; parallelism slices them afterwards)."""
    if model_section.get("model_name_or_path"):
        model = load_pretrained(model_section["model_name_or_path"])
        if model.config.vocab_size < vocab_size:
            raise ValueError(f"model.model_name_or_path has vocab_size={model.config.vocab_size} but the "
                             f"tokenizer has {vocab_size} tokens")
        return model
    return build_model(_build_config(model_section, index), seed=seed)


def layout(section: dict[str, Any]) -> ParallelDegrees:
    """The parallel degrees of a validated pretrain section (data parallel derived)."""
    return ParallelDegrees(world_size=section["world_size"],
                           tensor_parallel_degree=section["tensor_parallel_degree"],
                           pipeline_parallel_degree=section["pipeline_parallel_degree"])


def _init_distributed() -> None:
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:  # one task of `srun`
        os.environ.update(RANK=os.environ["SLURM_PROCID"], LOCAL_RANK=os.environ["SLURM_LOCALID"],
                          WORLD_SIZE=os.environ["SLURM_NTASKS"], MASTER_ADDR=_slurm_master(),
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    if "RANK" not in os.environ:  # a plain `python -m stages.pretrain`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    deepspeed.init_distributed(dist_backend=backend, verbose=False)


def _peak_flops(section: dict[str, Any], device: torch.device, world: int) -> float:
    """Matmul FLOP/s of all devices of the run, measured now in the training dtype: on GPU each rank
    has a device; on CPU the ranks of a node share its cores, so a node counts once."""
    dtype = torch.bfloat16 if section["bf16"] else torch.float16 if section["fp16"] else torch.float32
    per_device = peak_matmul_flops(dtype, device)
    if torch.device(device).type == "cuda":
        return per_device * world
    return per_device * max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def _slurm_master() -> str:
    """The first host of the SLURM allocation (rank 0 runs there)."""
    import subprocess

    nodes = os.environ.get("SLURM_JOB_NODELIST", "")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True,
                             timeout=30, check=True)
        return out.stdout.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return nodes.split(",")[0] or "127.0.0.1"


class PipelineModules(torch.nn.Module):
    """This rank's pipeline chunks as one module for DeepSpeed; parameter names stay those of the
    single-device model (the chunks hold `model.layers.<i>` under their own names)."""

    def __init__(self, chunks: list[torch.nn.Module]):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)

    def full_names(self) -> dict[str, str]:
        """Local parameter/buffer name -> single-device name (drops the `chunks.<k>.` prefix)."""
        return {k: k.split(".", 2)[2] for k in self.state_dict()}


def _gather_full_state(engine, topology: Topology, zero_stage: int, runner) -> dict[str, torch.Tensor] | None:
    """The single-device fp32 state dict on global rank 0 (None elsewhere): ZeRO-3 shards are
    gathered, TP slices merged along `partition_dim`, pipeline stages collected. Collective."""
    import deepspeed
    import torch.distributed as dist

    module = engine.module
    params = list(module.parameters())
    ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None) if zero_stage == 3 else nullcontext()
    with ctx:
        if topology.degrees.tensor_parallel_degree > 1:
            state = gather_full_state_dict(module, topology.tp_group)
        else:
            state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    state = {k: v.float().cpu() for k, v in state.items()}
    if runner is not None:
        names = module.full_names()
        state = {names[k]: v for k, v in state.items()}
    if topology.degrees.pipeline_parallel_degree == 1:
        return state if dist.get_rank() == 0 else None
    # One copy per pipeline stage: the first data-parallel, first tensor-parallel rank of each.
    coords = topology.coordinates
    holder = coords["tensor"] == 0 and coords["data"] == 0 and coords["sharding"] == 0
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, state if holder else None)
    if dist.get_rank() != 0:
        return None
    full: dict[str, torch.Tensor] = {}
    for part in parts:
        if part:
            full.update(part)
    return full


def train_step(engine, runner: PipelineRunner | None, batches: list[torch.Tensor],
               clip: Callable[[torch.nn.Module], float] | None) -> tuple[torch.Tensor, float | None]:
    """One optimizer step over this rank's micro-batches; returns (mean loss, grad norm or None).

    Without a pipeline DeepSpeed accumulates: backward per micro-batch (gradients reduced over data
    parallel at the last one), the optimizer only at the boundary. With a pipeline the schedule
    runs all micro-batches, so DeepSpeed's reduction and step are called explicitly. `clip`, when
    given, clips and measures the gradients just before the update (ZeRO off).
    """
    if runner is not None:
        batch = torch.cat(batches).to(engine.device)
        engine.zero_grad()
        loss = runner.train_step(batch, batch).cpu()
        engine.allreduce_gradients()  # the schedule ran backward, not engine.backward
        grad_norm = clip(engine.module) if clip else None
        engine.step()
        return loss, grad_norm
    total, grad_norm = torch.zeros(()), None
    for i, batch in enumerate(batches):
        batch = batch.to(engine.device)
        _, loss = engine(batch, labels=batch)
        engine.backward(loss)
        if clip and i == len(batches) - 1:
            grad_norm = clip(engine.module)
        engine.step()
        total += loss.detach().float().cpu() / len(batches)
    return total, grad_norm


def run(data_dir: str | Path, out_dir: str | Path, model_section: dict[str, Any],
        section: dict[str, Any]) -> dict[str, Any]:
    """Train for `section['max_steps']` optimizer steps; rank 0 writes the HF checkpoint, the
    tokenizer, train_log.csv and meta.json into `out_dir`. Returns the metrics (on every rank).

    Layout: world_size = dp x tp x pp. Tensor parallelism shards the built model in place
    (`stages.parallel.apply_tensor_parallel`); pipeline parallelism keeps this rank's chunks and
    drives them with torch.distributed.pipelining (1F1B, or interleaved 1F1B when
    virtual_pp_degree > 1), with the step's `gradient_accumulation_steps` as micro-batches;
    DeepSpeed ZeRO (`sharding`) shards over the data-parallel group.
    """
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.utils import clip_grad_norm_

    data_dir, out_dir = Path(data_dir), Path(out_dir)
    seed = section["seed"]
    set_seed(seed)
    index = json.loads((data_dir / "index.json").read_text())
    tokens, _ = load_split(data_dir, "train")

    degrees = layout(section)  # bad degrees fail here, before any process group exists
    _init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != degrees.world_size:
        raise ValueError(f"pretrain.world_size={degrees.world_size} but {world} processes were "
                         "launched; launch with torchrun --nproc_per_node equal to world_size")
    topology = Topology(degrees)
    dp, dp_rank = topology.get_data_parallel_world_size(), topology.get_data_parallel_rank()
    tp, pp = degrees.tensor_parallel_degree, degrees.pipeline_parallel_degree

    model = _build(model_section, index["vocab_size"], index, seed)
    degrees.validate_for_model(model.config)
    model.gradient_checkpointing = bool(section["recompute"])
    n_params = sum(p.numel() for p in model.parameters())
    if tp > 1:
        apply_tensor_parallel(model, topology, tensor_parallel_output=section["tensor_parallel_output"])
    if section["torch_compile"]:
        # In place, layer by layer, so parameter names stay those of the single-device model;
        # the collectives inside tensor-parallel layers become graph breaks.
        for layer in model.model.layers.values():
            layer.compile()
    runner = None
    micro, accum = section["per_device_train_batch_size"], section["gradient_accumulation_steps"]
    if pp > 1:
        runner = PipelineRunner(model, pp, section["virtual_pp_degree"], n_microbatches=accum,
                                pp_group=topology.group("pipeline"))
        module = PipelineModules(runner.modules)
    else:
        module = model
    del model  # the pipeline keeps only this rank's chunks

    optimizer = torch.optim.AdamW(module.parameters(), lr=section["learning_rate"],
                                  betas=(section["adam_beta1"], section["adam_beta2"]),
                                  weight_decay=section["weight_decay"], eps=1e-8)
    scheduler = build_scheduler(optimizer, section)
    ds_config = deepspeed_config(section, dp, pipeline=runner is not None)
    # Without ZeRO, DeepSpeed clips but does not keep the norm: clip here (same maths, with the
    # topology's model-parallel reduction) so train_log.csv has grad_norm for every layout.
    clip = None
    if ZERO_STAGES[section["sharding"]] == 0:
        ds_config["gradient_clipping"] = 0.0
        max_norm = section["max_grad_norm"] or float("inf")

        def clip_and_measure(m: torch.nn.Module) -> float:
            return float(clip_grad_norm_(list(m.parameters()), max_norm, mpu=topology))

        clip = clip_and_measure
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=module, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, mpu=topology)

    global_batch = micro * accum * dp
    sampler = WindowSampler(tokens, section["max_length"], seed)
    tokens_per_step = global_batch * section["max_length"]
    staging = out_dir.parent / f".{out_dir.name}.log"  # rank 0's live log, moved into the artifact
    staging.mkdir(parents=True, exist_ok=True)
    fpt = flops_per_token(_build_config(model_section, index), section["max_length"])["total"]
    peak = _peak_flops(section, engine.device, world) if rank == 0 else None
    dist.barrier()  # the peak was measured while the other ranks waited
    train_log = TrainLog(staging / "train_log.csv", section["max_steps"], enabled=rank == 0, desc="pretrain",
                         flops_per_token=fpt, peak_flops=peak)
    losses: list[float] = []
    engine.train()
    since_log = 0
    dp_group = topology.get_data_parallel_group()
    for step in range(section["max_steps"]):
        lr = scheduler.get_last_lr()[0]  # the rate this step's update uses
        batches = sampler.micro_batches(step, global_batch, dp_rank, dp, micro)
        step_loss, grad_norm = train_step(engine, runner, batches, clip)
        if dp > 1:  # mean over data-parallel replicas, for the log only
            dist.all_reduce(step_loss, group=dp_group)
            step_loss /= dp
        losses.append(step_loss.item())
        since_log += tokens_per_step
        train_log.advance()
        if (step + 1) % section["logging_steps"] == 0 or step + 1 == section["max_steps"]:
            if grad_norm is None:
                grad_norm = engine.get_global_grad_norm()
            train_log.log(step + 1, losses[-1], lr, None if grad_norm is None else float(grad_norm), since_log)
            since_log = 0
    train_log.close()

    zero_stage = ZERO_STAGES[section["sharding"]]
    state = _gather_full_state(engine, topology, zero_stage, runner)
    rows = train_log.rows
    metrics = {
        "first_loss": losses[0], "final_loss": losses[-1],
        "final_loss_mean_last10": float(np.mean(losses[-10:])),
        "steps": section["max_steps"], "num_parameters": n_params, "world_size": world,
        "data_parallel_degree": dp, "tensor_parallel_degree": tp, "pipeline_parallel_degree": pp,
        "zero_stage": zero_stage, "tokens_seen": tokens_per_step * section["max_steps"],
        "tokens_per_s": float(np.median([float(r["tokens_per_s"]) for r in rows[1:] or rows])) if rows else None,
        "mfu": float(np.median([float(r["mfu"]) for r in rows[1:] or rows])) if rows and peak else None,
        "flops_per_token": fpt, "peak_flops": peak,
        "skipped_steps": int(getattr(engine, "skipped_steps", 0)),  # fp16 overflow: update skipped
    }
    if rank == 0:
        config = _build_config(model_section, index)
        final = build_model(config, device="meta")
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        final.load_state_dict(state, assign=True, strict=not config.tie_word_embeddings)
        if config.tie_word_embeddings:
            final.lm_head.weight = final.model.embed_tokens.weight
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
