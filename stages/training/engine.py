"""The distributed training engine shared by pretraining and full fine-tuning.

One process per rank (torchrun locally, srun under SLURM); world_size = data x tensor x pipeline
parallel degrees. Tensor parallelism shards the built model in place
(`stages.parallel.apply_tensor_parallel`); pipeline parallelism keeps this rank's chunks and drives
them with torch.distributed.pipelining (1F1B, or interleaved 1F1B when virtual_pp_degree > 1), the
step's `gradient_accumulation_steps` being its micro-batches; DeepSpeed ZeRO (`sharding`) shards
over the data-parallel group, with `mpu=topology`. Every layout starts from the full model's
weights, sees the same global batch, and the loss of a step is the mean over every learned token
of that global batch, so all layouts follow the single-process curve (exactly so without dropout:
each rank draws the dropout masks of its own examples).

The model is our LlamaForCausalLM (every layout) or any transformers causal LM (data parallel and
ZeRO only; `stages.training.families` says which families go where and holds what differs: the
config written and hashed, gradient checkpointing, the FLOPs estimate). Parameters are named as in
the single-device model, a tied lm_head under its embedding's name only, as Hugging Face saves it.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import copy_tokenizer
from stages.checkpoint.meta import write_meta
from stages.model import IGNORE_INDEX, LlamaForCausalLM
from stages.parallel import ParallelDegrees, Topology, apply_tensor_parallel
from stages.parallel.mappings import collective_device
from stages.parallel.pipeline import PipelineRunner
from stages.parallel.tensor import vocab_parallel_cross_entropy
from stages.training.checkpointing import (
    Checkpointer,
    OptimizerAccess,
    engine_state,
    load_model_weights,
    restore_training_state,
    run_fingerprint,
    snapshot,
    trained_parameters,
    write_final,
)
from stages.training.capabilities import fp16_unsupported_reason
from stages.training.families import (
    check_transformers_model,
    config_identity,
    estimated_flops_per_token,
    prepare_transformers_model,
    write_config,
)
from stages.training.flops import flops_per_token, peak_matmul_flops
from stages.training.launcher_watch import exit_with_launcher
from stages.training.log import TrainLog
from stages.training.materialize import ResumeWeights, is_lazy, materialize
from stages.training.schedule import build_scheduler

log = logging.getLogger(__name__)

ZERO_STAGES = {"none": 0, "stage1": 1, "stage2": 2, "stage3": 3}


def deepspeed_config(section: dict[str, Any], data_parallel: int, pipeline: bool = False) -> dict[str, Any]:
    """The DeepSpeed JSON config for a validated training section over `data_parallel` replicas.
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


def parallel_degrees(section: dict[str, Any]) -> ParallelDegrees:
    """The parallel degrees of a validated training section (data parallel derived)."""
    return ParallelDegrees(world_size=section["world_size"],
                           tensor_parallel_degree=section["tensor_parallel_degree"],
                           pipeline_parallel_degree=section["pipeline_parallel_degree"])


def init_distributed() -> None:
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        return
    exit_with_launcher()  # torchrun's ranks have a session of their own: die with torchrun, not after it
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:  # one task of `srun`
        from stages.cluster.rendezvous import derived_port, first_host

        # stages.launch sets MASTER_ADDR/PORT (a port free for this job); a bare srun derives them
        os.environ.update(RANK=os.environ["SLURM_PROCID"], LOCAL_RANK=os.environ["SLURM_LOCALID"],
                          WORLD_SIZE=os.environ["SLURM_NTASKS"],
                          MASTER_ADDR=os.environ.get("MASTER_ADDR") or first_host(step=True),
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(derived_port()))
        if "SLURM_NTASKS_PER_NODE" in os.environ or "SLURM_STEP_TASKS_PER_NODE" in os.environ:
            per_node = os.environ.get("SLURM_NTASKS_PER_NODE") or os.environ["SLURM_STEP_TASKS_PER_NODE"]
            os.environ.setdefault("LOCAL_WORLD_SIZE", per_node.split("(")[0].split(",")[0])
    if "RANK" not in os.environ:  # a plain `python -m stages.<verb>`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(_free_port()))
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    log.info("rank %s of %s on node %s (local rank %s, rendezvous %s:%s, %s)", os.environ["RANK"],
             os.environ["WORLD_SIZE"], os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
             os.environ["LOCAL_RANK"], os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], backend)


def finish_distributed() -> None:
    """End a successful run: every rank waits for the others, then the process groups are destroyed
    while the interpreter is whole. Left to interpreter exit, gloo's worker threads can be torn down
    mid-destruction and abort the process ("terminate called without an active exception", SIGABRT),
    failing a job whose outputs were already written. Engines left in reference cycles (ZeRO-3
    keeps communication handles) are collected first, while their process groups still exist."""
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _peak_flops(section: dict[str, Any], device: torch.device, world: int) -> float:
    """Matmul FLOP/s of all devices of the run, measured in the training dtype (once per process):
    on GPU each rank has a device; on CPU the ranks of a node share its cores, so a node counts once."""
    dtype = torch.bfloat16 if section["bf16"] else torch.float16 if section["fp16"] else torch.float32
    per_device = _measured_peak(dtype, str(device))
    if torch.device(device).type == "cuda":
        return per_device * world
    return per_device * max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", world)))


@functools.lru_cache(maxsize=None)
def _measured_peak(dtype: torch.dtype, device: str) -> float:
    """`peak_matmul_flops`, kept for the process (one that trains several times, tests or sweeps,
    measures once). On a CPU, 1024-wide matmuls reach the rate of the default 2048-wide loop (fp32,
    one thread: 36 vs 35 GFLOP/s) in ~1 s instead of ~20 s, which a short CPU run would feel."""
    size = dict(n=1024, iters=4, repeats=3) if torch.device(device).type == "cpu" else {}
    return peak_matmul_flops(dtype, device, **size)


class PipelineModules(torch.nn.Module):
    """This rank's pipeline chunks as one module for DeepSpeed; parameter names stay those of the
    single-device model (the chunks hold `model.layers.<i>` under their own names)."""

    def __init__(self, chunks: list[torch.nn.Module]):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)

    def full_names(self) -> dict[str, str]:
        """Local parameter/buffer name -> single-device name (drops the `chunks.<k>.` prefix)."""
        return {k: k.split(".", 2)[2] for k in self.state_dict()}


def _token_sum_loss(engine, ids: torch.Tensor, labels: torch.Tensor, tp_group,
                    position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy over labels != -100 (logits split over the vocabulary when
    `tp_group` is given, i.e. tensor_parallel_output). Our model returns the logits, a transformers
    model a ModelOutput holding them; right padding needs no attention mask under causal attention.
    `position_ids` marks packed rows (our model only)."""
    output = engine(input_ids=ids) if position_ids is None else engine(input_ids=ids, position_ids=position_ids)
    logits = output if torch.is_tensor(output) else output.logits  # (B, T, V) or (B, T, V/tp)
    shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    shift_labels = labels[:, 1:].reshape(-1)
    if tp_group is None:
        return F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    per_token = vocab_parallel_cross_entropy(shift_logits, shift_labels, tp_group, ignore_index=IGNORE_INDEX)
    return per_token.sum()


def train_step(engine, runner: PipelineRunner | None, batches: list[tuple[torch.Tensor, ...]],
               num_tokens: int, dp: int, clip: Callable[[torch.nn.Module], float] | None,
               tp_group=None) -> tuple[torch.Tensor, float | None]:
    """One optimizer step over this rank's micro-batches; returns (this rank's share of the step
    loss, grad norm or None). `num_tokens` counts the learned tokens of the whole global batch:
    the step loss is their mean, and the shares of the data-parallel ranks add up to it.

    DeepSpeed divides gradients by gradient_accumulation_steps (engine.backward) and by dp (its
    data-parallel average), so each micro-batch's summed loss is scaled by accum x dp / num_tokens.
    With a pipeline the schedule runs the micro-batches (normalised by num_tokens / dp) and
    DeepSpeed's reduction and step are called explicitly. `clip`, when given, clips and measures
    the gradients just before the update (ZeRO off).
    """
    if runner is not None:
        if any(len(b) > 2 for b in batches):
            raise ValueError("packed micro-batches (with position_ids) under pipeline parallelism: the stages pass "
                             "hidden states only; set packing: false or pipeline_parallel_degree: 1")
        ids = torch.cat([b[0] for b in batches]).to(engine.device)
        labels = torch.cat([b[1] for b in batches]).to(engine.device)
        engine.zero_grad()
        share = runner.train_step(ids, labels, normalizer=num_tokens / dp).cpu() / dp
        engine.allreduce_gradients()  # the schedule ran backward, not engine.backward
        grad_norm = clip(engine.module) if clip else None
        engine.step()
        return share, grad_norm
    share, grad_norm, accum = torch.zeros(()), None, len(batches)
    for i, (ids, labels, *packed) in enumerate(batches):
        position_ids = packed[0].to(engine.device) if packed else None  # a packed micro-batch
        loss_sum = _token_sum_loss(engine, ids.to(engine.device), labels.to(engine.device), tp_group, position_ids)
        engine.backward(loss_sum * (accum * dp / num_tokens))
        if clip and i == accum - 1:
            grad_norm = clip(engine.module)
        engine.step()  # DeepSpeed applies the optimizer only at the accumulation boundary
        share += loss_sum.detach().float().cpu() / num_tokens
    return share, grad_norm


def learned_tokens(batches: list[tuple[torch.Tensor, ...]], dp_group) -> int:
    """Learned (next-token) positions in the global batch: this rank's count summed over dp."""
    import torch.distributed as dist

    count = torch.tensor(sum(int((b[1][:, 1:] != IGNORE_INDEX).sum()) for b in batches),
                         device=collective_device(dp_group))
    dist.all_reduce(count, group=dp_group)
    return max(int(count), 1)


def check_model_fits(model: torch.nn.Module, section: dict[str, Any], degrees: ParallelDegrees) -> None:
    """Raise ValueError when the section's layout cannot train `model`: our model's degrees must
    divide its shapes; a transformers model takes data parallel and ZeRO only."""
    if isinstance(model, LlamaForCausalLM):
        degrees.validate_for_model(model.config)
    else:
        check_transformers_model(model, section, degrees.tensor_parallel_degree, degrees.pipeline_parallel_degree)


def model_flops_per_token(model: torch.nn.Module, seq_len: int) -> int:
    """Training FLOPs per token: exact for our model, a 6N estimate for a transformers model."""
    if isinstance(model, LlamaForCausalLM):
        return flops_per_token(model.config, seq_len)["total"]
    return estimated_flops_per_token(model, seq_len)["total"]


def parallelize(model: torch.nn.Module, section: dict[str, Any],
                topology: Topology) -> tuple[torch.nn.Module, PipelineRunner | None]:
    """Apply the section's layout to the full `model` in place, in the torchtitan order (tensor
    parallel, activation recompute, compile, pipeline split). Returns the module DeepSpeed wraps
    (this rank's pipeline chunks under a pipeline) and the pipeline runner, if any."""
    if not isinstance(model, LlamaForCausalLM):  # data parallel and ZeRO only (check_model_fits)
        prepare_transformers_model(model, section)
        return model, None
    degrees = topology.degrees
    if degrees.tensor_parallel_degree > 1:
        apply_tensor_parallel(model, topology, tensor_parallel_output=section["tensor_parallel_output"])
    model.gradient_checkpointing = bool(section["recompute"])
    if section["torch_compile"]:
        # In place, layer by layer, so parameter names stay those of the single-device model;
        # the collectives inside tensor-parallel layers become graph breaks.
        for layer in model.model.layers.values():
            layer.compile()
    if degrees.pipeline_parallel_degree == 1:
        return model, None
    runner = PipelineRunner(model, degrees.pipeline_parallel_degree, section["virtual_pp_degree"],
                            n_microbatches=section["gradient_accumulation_steps"], pp_group=topology.group("pipeline"))
    return PipelineModules(runner.modules), runner


def build_engine(module: torch.nn.Module, section: dict[str, Any], topology: Topology, *, pipeline: bool):
    """DeepSpeed over `module`: torch AdamW, the LR schedule and ZeRO as the section says. Returns
    (engine, scheduler, OptimizerAccess, clip); `clip` clips and measures the gradient norm when
    ZeRO is off (see `train_step`), else None."""
    import deepspeed
    from deepspeed.runtime.utils import clip_grad_norm_

    trained = [p for p in module.parameters() if p.requires_grad]  # an adapter's only; the base is frozen
    optimizer = torch.optim.AdamW(trained, lr=section["learning_rate"],
                                  betas=(section["adam_beta1"], section["adam_beta2"]),
                                  weight_decay=section["weight_decay"], eps=1e-8)
    scheduler = build_scheduler(optimizer, section)
    ds_config = deepspeed_config(section, topology.get_data_parallel_world_size(), pipeline=pipeline)
    # Without ZeRO, DeepSpeed clips but does not keep the norm: clip here (same maths, with the
    # topology's model-parallel reduction) so train_log.csv has grad_norm for every layout.
    clip = None
    if ZERO_STAGES[section["sharding"]] == 0:
        ds_config["gradient_clipping"] = 0.0
        max_norm = section["max_grad_norm"] or float("inf")

        def clip_and_measure(m: torch.nn.Module) -> float:
            return float(clip_grad_norm_([p for p in m.parameters() if p.requires_grad], max_norm, mpu=topology))

        clip = clip_and_measure
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=module, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, mpu=topology)
    return engine, scheduler, OptimizerAccess(engine), clip


def open_checkpoints(model: torch.nn.Module, section: dict[str, Any], topology: Topology, checkpoint_dir: Path,
                     global_batch: int, identity: dict[str, Any] | None):
    """The run's Checkpointer in `checkpoint_dir/<fingerprint>/` and the checkpoint to resume from
    (a StateReader, or None). When resuming, the checkpoint's weights are already loaded into the
    full `model`, before any slicing (every layout starts from whole tensors); a lazy model (on
    the meta device) is filled from them after slicing instead."""
    fingerprint = run_fingerprint(section, global_batch, {"model": config_identity(model.config), **(identity or {})})
    checkpointer = Checkpointer(checkpoint_dir / fingerprint, section, topology, model_config=model.config)
    resume = checkpointer.find()
    if resume is not None:
        load_model_weights(model, resume)
    return checkpointer, resume


def layout_metrics(section: dict[str, Any], topology: Topology) -> dict[str, int]:
    """The degrees of the run, for meta.json."""
    degrees = topology.degrees
    return {"world_size": degrees.world_size, "data_parallel_degree": topology.get_data_parallel_world_size(),
            "tensor_parallel_degree": degrees.tensor_parallel_degree,
            "pipeline_parallel_degree": degrees.pipeline_parallel_degree,
            "zero_stage": ZERO_STAGES[section["sharding"]]}


@dataclass
class Run:
    """A training run between `setup` and `finish`: the engine and what the step loop keeps."""

    section: dict[str, Any]
    stage: str
    topology: Topology
    engine: Any
    scheduler: Any
    access: OptimizerAccess
    clip: Callable[[torch.nn.Module], float] | None
    runner: PipelineRunner | None
    names: dict[str, str]  # local parameter name -> single-device name (pipeline chunks)
    config: Any  # the model config, written beside the weights
    generation_config: Any
    checkpointer: Checkpointer | None
    train_log: TrainLog
    staging: Path  # rank 0's live log directory, moved into the artifact
    global_batch: int
    seq_len: int
    num_parameters: int
    trainable_parameters: int
    flops_per_token: int
    peak_flops: float | None
    start_step: int = 0
    losses: list[float] = field(default_factory=list)
    evaluations: list[dict[str, Any]] = field(default_factory=list)  # {"step", metric: value}
    best: dict[str, Any] | None = None  # the best evaluation and its weights (load_best_model_at_end)

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()

    def layout(self) -> dict[str, Any]:
        d = self.topology.degrees
        return {"world_size": d.world_size, "data_parallel_degree": self.topology.get_data_parallel_world_size(),
                "tensor_parallel_degree": d.tensor_parallel_degree, "pipeline_parallel_degree": d.pipeline_parallel_degree,
                "virtual_pp_degree": self.section["virtual_pp_degree"], "sharding": self.section["sharding"]}

    def trainer_state(self, step: int) -> dict[str, Any]:
        return {"global_step": step, "consumed_samples": step * self.global_batch,
                "global_batch_size": self.global_batch, "max_steps": self.section["max_steps"],
                "losses": list(self.losses), "train_log": list(self.train_log.rows), "layout": self.layout(),
                "evaluations": list(self.evaluations), **engine_state(self.engine, self.scheduler)}


def setup(model: torch.nn.Module, source, section: dict[str, Any], *, stage: str,
          num_parameters: int | None = None, checkpoint_dir: str | Path | None = None,
          identity: dict[str, Any] | None = None, out_dir: str | Path) -> Run:
    """Check the layout against `model`, find the checkpoint to resume from (its weights loaded
    into the full model), parallelise (a lazy model on the meta device is then filled with this
    rank's slice, from the checkpoint when resuming), build the DeepSpeed engine, restore the
    training state and open the log. Collective; call after `init_distributed()`."""
    import torch.distributed as dist

    degrees = parallel_degrees(section)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != degrees.world_size:
        raise ValueError(f"world_size={degrees.world_size} but {world} processes were launched; launch "
                         "with torchrun --nproc_per_node equal to world_size")
    topology = Topology(degrees)
    dp = topology.get_data_parallel_world_size()
    check_model_fits(model, section, degrees)
    if section["fp16"] and fp16_unsupported_reason():  # the config check, for runs outside Snakemake
        raise ValueError(f"fp16=true: {fp16_unsupported_reason()}")
    global_batch = section["per_device_train_batch_size"] * section["gradient_accumulation_steps"] * dp

    checkpointer = resume = None
    if checkpoint_dir is not None:
        checkpointer, resume = open_checkpoints(model, section, topology, Path(checkpoint_dir), global_batch, identity)

    # Counted on the whole model, before tensor parallelism slices it or ZeRO-3 partitions it.
    n_params = num_parameters or sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for _, p in trained_parameters(model))
    fpt = model_flops_per_token(model, source.seq_len)
    config = model.config
    generation_config = getattr(model, "generation_config", None)  # a transformers model's, for out_dir
    lazy = model.weight_source if is_lazy(model) else None
    module, runner = parallelize(model, section, topology)
    del model  # the pipeline keeps only this rank's chunks
    names = module.full_names() if runner is not None else {}
    if lazy is not None:  # only this rank's slice is ever allocated
        materialize(module, ResumeWeights(resume, lazy) if resume is not None else lazy, names,
                    topology.coordinates["tensor"], degrees.tensor_parallel_degree)
    engine, scheduler, access, clip = build_engine(module, section, topology, pipeline=runner is not None)

    start_step, losses, rows, evaluations = 0, [], [], []
    if resume is not None:
        state = restore_training_state(engine, access, names, topology, resume, scheduler)
        start_step, losses, rows = state["global_step"], state["losses"], state["train_log"]
        evaluations = state.get("evaluations", [])
        if rank == 0:
            log.info("%s: resumed at step %d of %d (checkpoint saved with %s)", stage, start_step,
                     section["max_steps"], state["layout"])
        resume.close()

    out_dir = Path(out_dir)
    staging = out_dir.parent / f".{out_dir.name}.log"
    staging.mkdir(parents=True, exist_ok=True)
    peak = _peak_flops(section, engine.device, world) if rank == 0 else None
    dist.barrier()  # the peak was measured while the other ranks waited
    train_log = TrainLog(staging / "train_log.csv", section["max_steps"], enabled=rank == 0, desc=stage,
                         flops_per_token=fpt, peak_flops=peak, previous=rows)
    return Run(section=section, stage=stage, topology=topology, engine=engine, scheduler=scheduler, access=access,
               clip=clip, runner=runner, names=names, config=config, generation_config=generation_config,
               checkpointer=checkpointer, train_log=train_log, staging=staging, global_batch=global_batch,
               seq_len=source.seq_len, num_parameters=n_params, trainable_parameters=n_trainable,
               flops_per_token=fpt, peak_flops=peak, start_step=start_step, losses=losses, evaluations=evaluations)


def step(run: Run, source, index: int) -> tuple[float, float | None]:
    """Optimizer step `index` (0-based) over its global batch; returns (step loss, grad norm or None)."""
    import torch.distributed as dist

    topology, section = run.topology, run.section
    dp, dp_rank = topology.get_data_parallel_world_size(), topology.get_data_parallel_rank()
    batches = source.micro_batches(index, run.global_batch, dp_rank, dp, section["per_device_train_batch_size"])
    num_tokens = learned_tokens(batches, topology.get_data_parallel_group())
    step_loss, grad_norm = train_step(run.engine, run.runner, batches, num_tokens, dp, run.clip, tp_output_group(run))
    if dp > 1:  # the ranks' shares add up to the step loss
        dist.all_reduce(step_loss, group=topology.get_data_parallel_group())
    return step_loss.item(), grad_norm


def tp_output_group(run: Run):
    """The tensor-parallel group when the logits stay split over the vocabulary, else None."""
    tp = run.topology.degrees.tensor_parallel_degree
    return run.topology.tp_group if tp > 1 and run.section["tensor_parallel_output"] else None


def run_steps(run: Run, source, evaluator: Callable[..., dict[str, float]] | None = None) -> None:
    """Steps from the resumed one to `max_steps`: log every `logging_steps`, evaluate every
    `eval_steps` with `evaluator(engine)` (dev metrics; collective), checkpoint every `save_steps`."""
    section, engine = run.section, run.engine
    eval_steps = section.get("eval_steps", 0) if evaluator is not None else 0
    engine.train()
    since_log = 0
    for index in range(run.start_step, section["max_steps"]):
        lr = run.scheduler.get_last_lr()[0]  # the rate this step's update uses
        loss, grad_norm = step(run, source, index)
        done = index + 1
        run.losses.append(loss)
        since_log += run.global_batch * run.seq_len
        run.train_log.advance()
        evaluation = None
        if eval_steps and (done % eval_steps == 0 or done == section["max_steps"]):
            evaluation = evaluate(run, evaluator, done)
        if done % section["logging_steps"] == 0 or done == section["max_steps"] or evaluation:
            if grad_norm is None:
                grad_norm = engine.get_global_grad_norm()
            run.train_log.log(done, loss, lr, None if grad_norm is None else float(grad_norm), since_log, evaluation)
            since_log = 0
        if run.checkpointer is not None:
            run.checkpointer.poll()
            if run.checkpointer.due(done, section["max_steps"]):
                run.checkpointer.save(done, engine, run.access, run.names, lambda: run.trainer_state(done))
    run.train_log.close()
    if run.checkpointer is not None:
        run.checkpointer.close()


def evaluate(run: Run, evaluator: Callable[..., dict[str, float]], done: int) -> dict[str, float]:
    """Dev metrics after step `done`; with load_best_model_at_end, keeps this rank's trained
    weights (fp32 masters, whole over data parallel) when they are the best so far."""
    run.engine.eval()
    with torch.no_grad():
        metrics = evaluator(run.engine, tp_output_group(run))
    run.engine.train()
    run.evaluations.append({"step": done, **metrics})
    if run.rank == 0:
        log.info("%s: step %d: %s", run.stage, done, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    if run.section.get("load_best_model_at_end"):
        key = run.section["metric_for_best_model"]
        if key not in metrics:
            raise ValueError(f"metric_for_best_model={key!r} is not measured; measured: {sorted(metrics)} "
                             "(generation metrics need eval_with_do_generation: true)")
        better = run.best is None or (metrics[key] < run.best["value"] if key == "eval_loss"
                                      else metrics[key] > run.best["value"])
        if better:
            weights = {name: run.access.get(p, None).detach().clone() for name, p in trained_parameters(run.engine.module)}
            run.best = {"step": done, "value": metrics[key], "metrics": metrics, "weights": weights}
    return metrics


def restore_best(run: Run) -> None:
    """Put the best evaluation's weights back (load_best_model_at_end) before the output is written."""
    if run.best is None:
        return
    with torch.no_grad():
        for name, p in trained_parameters(run.engine.module):
            run.access.set(p, None, run.best["weights"][name])
    if run.rank == 0:
        log.info("%s: load_best_model_at_end: step %d (%s %.4f)", run.stage, run.best["step"],
                 run.section["metric_for_best_model"], run.best["value"])


def final_evaluation(run: Run, evaluator: Callable[..., dict[str, float]]) -> dict[str, float]:
    """The dev metrics of the weights about to be written: the best evaluation's when they were
    put back, the last step's when it was evaluated, else measured now."""
    if run.best is not None:
        return run.best["metrics"]
    if run.evaluations and run.evaluations[-1]["step"] == run.section["max_steps"]:
        return {k: v for k, v in run.evaluations[-1].items() if k != "step"}
    run.engine.eval()
    with torch.no_grad():
        return evaluator(run.engine, tp_output_group(run))


def run_metrics(run: Run) -> dict[str, Any]:
    section, rows, losses = run.section, run.train_log.rows, run.losses
    return {
        "first_loss": losses[0], "final_loss": losses[-1],
        "final_loss_mean_last10": float(np.mean(losses[-10:])),
        "steps": section["max_steps"], "num_parameters": run.num_parameters,
        "trainable_parameters": run.trainable_parameters, **layout_metrics(section, run.topology),
        "tokens_seen": run.global_batch * run.seq_len * section["max_steps"],
        "tokens_per_s": float(np.median([float(r["tokens_per_s"]) for r in rows[1:] or rows])) if rows else None,
        "mfu": float(np.median([float(r["mfu"]) for r in rows[1:] or rows])) if rows and run.peak_flops else None,
        "flops_per_token": run.flops_per_token, "peak_flops": run.peak_flops,
        "skipped_steps": int(getattr(run.engine, "skipped_steps", 0)),  # fp16 overflow: update skipped
        "resumed_from_step": run.start_step or None,
        "checkpoint_save_stall_s": [round(s, 4) for s in run.checkpointer.stall_s] if run.checkpointer else [],
        "evaluations": run.evaluations,
        "best_step": run.best["step"] if run.best else None,
    }


def finish(run: Run, out_dir: str | Path, metrics: dict[str, Any], *, tokenizer_dir: str | Path | None,
           parent: str | Path, meta_config: dict[str, Any], sharded_output: bool = False,
           adapter_writer: Callable[[Path, dict[str, torch.Tensor]], None] | None = None) -> None:
    """Write `out_dir` atomically: the single-device HF checkpoint (each rank writing its share),
    the tensor/pipeline slices for `merge_tp` (`sharded_output`), or with `adapter_writer` an
    adapter directory (rank 0 gets the whole trained tensors and calls it); plus the tokenizer,
    train_log.csv and meta.json. Collective."""
    import torch.distributed as dist

    out_dir = Path(out_dir)

    def extra(tmp: Path) -> None:  # rank 0: everything but the weights
        if adapter_writer is None:
            write_config(run.config, tmp, run.generation_config)
        if tokenizer_dir is not None:
            copy_tokenizer(tokenizer_dir, tmp)
        os.replace(run.staging / "train_log.csv", tmp / "train_log.csv")
        write_meta(tmp, stage=run.stage, config=meta_config, parent=parent, seed=run.section["seed"], metrics=metrics)

    if adapter_writer is None:
        write_final(out_dir, run.engine, run.access, run.names, run.topology, unified=not sharded_output, extra=extra)
    else:
        part = snapshot(run.engine, run.access, run.names, run.topology, unified=True, optimizer=False, writer=0)
        if run.rank == 0:
            tensors = {k: v for file in part.files.values() for k, v in file.items()}
            with atomic_dir(out_dir) as tmp:
                adapter_writer(tmp, tensors)
                extra(tmp)
    if run.rank == 0:
        run.staging.rmdir()
        log.info("%s: wrote %s (final loss %.4f)", run.stage, out_dir, run.losses[-1])
    dist.barrier()


def train(model: torch.nn.Module, source, section: dict[str, Any], out_dir: str | Path, *, stage: str,
          tokenizer_dir: str | Path | None, parent: str | Path, meta_config: dict[str, Any],
          num_parameters: int | None = None, checkpoint_dir: str | Path | None = None,
          identity: dict[str, Any] | None = None, sharded_output: bool = False,
          evaluator: Callable[..., dict[str, float]] | None = None,
          adapter_writer: Callable[[Path, dict[str, torch.Tensor]], None] | None = None,
          extra_metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train `model` (the full fp32 model, identical on every rank: our LlamaForCausalLM, or a
    transformers causal LM for data parallel and ZeRO only; with an adapter attached, only its
    parameters train; our model may come on the meta device with a weight source, and each rank
    then allocates and fills only its slice, `stages.training.materialize`) for
    `section['max_steps']` steps on `source` (a `stages.training.batches` sampler: `seq_len`,
    `micro_batches`) in the section's layout, and write `out_dir` (see `finish`). A transformers model's config.json is its own, every field kept.

    With `checkpoint_dir`, checkpoints go to `checkpoint_dir/<fingerprint>/` every `save_steps`
    steps, and the run resumes from the newest complete one there (any layout); the fingerprint
    hashes the recipe (the section without its layout keys, the global batch) and `identity`
    (what the caller knows of its inputs). With `evaluator`, dev metrics are logged beside the loss
    every `eval_steps` (`load_best_model_at_end` writes the best evaluated weights) and measured
    once more on the weights written (metrics `dev_loss`, `dev_exact_match`, ...). Returns the
    metrics, `extra_metrics` included (on every rank). Call after `init_distributed()`."""
    run = setup(model, source, section, stage=stage, num_parameters=num_parameters, checkpoint_dir=checkpoint_dir,
                identity=identity, out_dir=out_dir)
    del model
    run_steps(run, source, evaluator)
    if section.get("load_best_model_at_end"):
        restore_best(run)
    metrics = {**run_metrics(run), **(extra_metrics or {}), "dev_loss": None}
    if evaluator is not None:
        metrics.update({k.replace("eval_", "dev_", 1): v for k, v in final_evaluation(run, evaluator).items()})
    finish(run, out_dir, metrics, tokenizer_dir=tokenizer_dir, parent=parent, meta_config=meta_config,
           sharded_output=sharded_output, adapter_writer=adapter_writer)
    return metrics
