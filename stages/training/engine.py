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

This module is the run: `setup` -> `run_steps` -> `finish` (`train` calls the three). Its parts,
one idea a module: `distributed` (process groups), `parallelize` (the layout on the model),
`deepspeed_engine` (ZeRO, optimizer, schedule), `step` (one optimizer step and its loss).
`setup` takes the training section as a typed section or a mapping, makes it the typed section of
its keys (`stages.sections.training_section`) with `bf16: auto` decided for this machine, and the
run reads that one (`Run.section`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import copy_tokenizer
from stages.checkpoint.meta import write_meta
from stages.checkpoint.store import checkpoint_name
from stages.errors import StopRequested
from stages.model import LlamaForCausalLM
from stages.parallel import Topology
from stages.parallel.mappings import collective_device
from stages.parallel.pipeline import PipelineRunner
from stages.sections import SftSettings, TrainingSettings, training_section
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
from stages.training.allocator import keep_freed_host_memory
from stages.training.capabilities import fp16_unsupported_reason, native_bf16, resolved_bf16
from stages.training.deepspeed_engine import build_engine
from stages.training.families import (
    config_identity,
    estimated_flops_per_token,
    write_config,
)
from stages.training.flops import (
    cpu_matmul_width,
    cpu_ranks_at_peak,
    flops_per_token,
    matmul_weights,
    peak_matmul_flops,
)
from stages.training.log import TrainLog, event_files
from stages.training.materialize import ResumeWeights, is_lazy, materialize
from stages.training.parallelize import check_model_fits, layout_metrics, parallel_degrees, parallelize
from stages.training.preemption import StopWatch, reason_name, requeue_slurm_job
from stages.training.preference_step import STATS, PairStats, global_counts, preference_train_step
from stages.training.router_stats import RouterStats
from stages.training.step import learned_tokens, train_step

log = logging.getLogger(__name__)


def _peak_flops(section: Mapping[str, Any], device: torch.device, world: int) -> float:
    """Matmul FLOP/s of all devices of the run, measured in the training dtype (once per process, by
    rank 0): on GPU each rank has a device; on CPU rank 0 measures at its own share of the node's
    threads, and the node's ranks run side by side as far as its cores allow (`cpu_ranks_at_peak`)."""
    section = training_section(section)
    dtype = torch.bfloat16 if section.bf16 else torch.float16 if section.fp16 else torch.float32
    per_device = _measured_peak(dtype, str(device))
    if torch.device(device).type == "cuda":
        return per_device * world
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return per_device * cpu_ranks_at_peak(world, local_world, cores, torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _measured_peak(dtype: torch.dtype, device: str) -> float:
    """`peak_matmul_flops`, kept for the process (one that trains several times, tests or sweeps,
    measures once). On a CPU, 1024-wide matmuls reach the rate of the default 2048-wide loop (fp32,
    one thread: 36 vs 35 GFLOP/s) in ~1 s instead of ~20 s, which a short CPU run would feel; a dtype
    the CPU only emulates is measured on smaller products (`cpu_matmul_width`)."""
    if torch.device(device).type == "cpu":
        return peak_matmul_flops(dtype, device, n=cpu_matmul_width(dtype), iters=4, repeats=3)
    return peak_matmul_flops(dtype, device)


def model_flops_per_token(model: torch.nn.Module, seq_len: int) -> int:
    """Training FLOPs per token: exact for our model, a 6N estimate for a transformers model; frozen
    weights (LoRA's base, prefix tuning's model) count 4 FLOPs, not 6."""
    if isinstance(model, LlamaForCausalLM):
        return flops_per_token(model.config, seq_len, weights=matmul_weights(model))["total"]
    return estimated_flops_per_token(model, seq_len)["total"]


def logits_flops_per_token(model: torch.nn.Module) -> int:
    """The part of `model_flops_per_token` that only a learned position costs: our model's lm_head
    (6 FLOPs per weight, 4 frozen), which the training step skips at the other positions
    (`stages.training.step.token_sum_loss`); 0 for a transformers model, which projects them all."""
    if not isinstance(model, LlamaForCausalLM):
        return 0
    return (6 if model.lm_head.weight.requires_grad else 4) * model.lm_head.weight.numel()


def open_checkpoints(model: torch.nn.Module, section: TrainingSettings, topology: Topology, checkpoint_dir: Path,
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


@dataclass
class Run:
    """A training run between `setup` and `finish`: the engine and what the step loop keeps."""

    section: TrainingSettings  # bf16 decided
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
    logits_flops_per_token: int  # of flops_per_token, what only a learned position costs
    peak_flops: float | None
    objective: Any = None  # a PreferenceObjective: the step is preference_train_step's, over pairs
    rows_per_item: int = 1  # rows of one item of the global batch (a preference pair: 2)
    pair_stats: PairStats | None = None  # the preference statistics since the last logged row
    router_stats: RouterStats | None = None  # a mixture of experts: router loss and expert loads
    start_step: int = 0
    learned_tokens: int = 0  # of the global batches stepped since the last logged row
    losses: list[float] = field(default_factory=list)
    evaluations: list[dict[str, Any]] = field(default_factory=list)  # {"step", metric: value}
    stops: list[dict[str, Any]] = field(default_factory=list)  # {"step", "reason"}: stopped on request there
    best: dict[str, Any] | None = None  # the best evaluation and its weights (load_best_model_at_end)

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()

    def layout(self) -> dict[str, Any]:
        d = self.topology.degrees
        return {"world_size": d.world_size, "data_parallel_degree": self.topology.get_batch_world_size(),
                "tensor_parallel_degree": d.tensor_parallel_degree,
                "context_parallel_degree": d.context_parallel_degree,
                "pipeline_parallel_degree": d.pipeline_parallel_degree,
                "expert_parallel_degree": d.expert_parallel_degree,
                "virtual_pp_degree": self.section.virtual_pp_degree, "sharding": self.section.sharding}

    def trainer_state(self, step: int) -> dict[str, Any]:
        return {"global_step": step, "consumed_samples": step * self.global_batch,
                "global_batch_size": self.global_batch, "max_steps": self.section.max_steps,
                "losses": list(self.losses), "train_log": list(self.train_log.rows), "layout": self.layout(),
                "evaluations": list(self.evaluations), "stops": list(self.stops),
                **engine_state(self.engine, self.scheduler)}


def setup(model: torch.nn.Module, source, section: Mapping[str, Any], *, stage: str,
          num_parameters: int | None = None, checkpoint_dir: str | Path | None = None,
          identity: dict[str, Any] | None = None, out_dir: str | Path, objective=None) -> Run:
    """Check the layout against `model`, find the checkpoint to resume from (its weights loaded
    into the full model), parallelise (a lazy model on the meta device is then filled with this
    rank's slice, from the checkpoint when resuming), build the DeepSpeed engine, restore the
    training state and open the log. Collective; call after `init_distributed()`. `section` is a
    typed training section or a mapping (`training_section`); `bf16: auto` is decided here, once,
    for this machine (`resolved_bf16`), and the run's fingerprint, engine and metrics see the
    decision. With `objective` (a PreferenceObjective) the source's items are preference pairs and
    each step is `preference_train_step`'s."""
    import torch.distributed as dist

    section = _bf16_decided(training_section(section), stage)
    keep_freed_host_memory()  # every step reuses the pages the last one freed (stages.training.allocator)
    degrees = parallel_degrees(section)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != degrees.world_size:
        raise ValueError(f"world_size={degrees.world_size} but {world} processes were launched; launch "
                         "with torchrun --nproc_per_node equal to world_size")
    topology = Topology(degrees)
    check_model_fits(model, section, degrees)
    if section.fp16 and fp16_unsupported_reason():  # the config check, for runs outside Snakemake
        raise ValueError(f"fp16=true: {fp16_unsupported_reason()}")
    if degrees.context_parallel_degree > 1 and objective is not None:
        raise ValueError(f"context_parallel_degree={degrees.context_parallel_degree} with preference alignment: "
                         "not supported yet; set context_parallel_degree: 1")
    # the context-parallel ranks of one batch rank read the same samples (their own tokens of them)
    global_batch = section.per_device_train_batch_size * section.gradient_accumulation_steps * \
        topology.get_batch_world_size()

    checkpointer = resume = None
    if checkpoint_dir is not None:
        checkpointer, resume = open_checkpoints(model, section, topology, Path(checkpoint_dir), global_batch, identity)

    # Counted on the whole model, before tensor parallelism slices it or ZeRO-3 partitions it.
    n_params = num_parameters or sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for _, p in trained_parameters(model))
    fpt, logits_fpt = model_flops_per_token(model, source.seq_len), logits_flops_per_token(model)
    config = model.config
    generation_config = getattr(model, "generation_config", None)  # a transformers model's, for out_dir
    lazy = model.weight_source if is_lazy(model) else None
    module, runner = parallelize(model, section, topology)
    if runner is not None:  # the pipeline's last stage projects every position
        logits_fpt = 0
    del model  # the pipeline keeps only this rank's chunks
    names = module.full_names() if runner is not None else {}
    if lazy is not None:  # only this rank's slice is ever allocated
        materialize(module, ResumeWeights(resume, lazy) if resume is not None else lazy, names,
                    topology.coordinates["tensor"], degrees.tensor_parallel_degree)
    engine, scheduler, access, clip = build_engine(module, section, topology, pipeline=runner is not None)

    start_step, losses, rows, evaluations, stops = 0, [], [], [], []
    if resume is not None:
        state = restore_training_state(engine, access, names, topology, resume, scheduler)
        start_step, losses, rows = state["global_step"], state["losses"], state["train_log"]
        evaluations, stops = state.get("evaluations", []), state.get("stops", [])
        if rank == 0:
            on_stop = [s["reason"] for s in stops if s["step"] == start_step]
            log.info("%s: resumed at step %d of %d (checkpoint saved with %s%s)", stage, start_step,
                     section.max_steps, state["layout"], f" when stopped by {on_stop[-1]}" if on_stop else "")
        resume.close()

    out_dir = Path(out_dir)
    staging = out_dir.parent / f".{out_dir.name}.log"
    staging.mkdir(parents=True, exist_ok=True)
    peak = _peak_flops(section, engine.device, world) if rank == 0 else None
    dist.barrier()  # the peak was measured while the other ranks waited
    pair_stats = None if objective is None else PairStats(topology.get_data_parallel_group(),
                                                          mixing=getattr(source, "mix_ratio", 0.0) > 0)
    router_stats = None
    if getattr(config, "moe", False):  # our model's config, a mixture of experts
        cp_group = topology.get_context_parallel_group() if topology.degrees.context_parallel_degree > 1 else None
        router_stats = RouterStats(topology.get_data_parallel_group(), sum(config.sparse_layers()), config.num_experts,
                                   cp_group)
    columns = (pair_stats.columns if pair_stats is not None else ()) + \
        (router_stats.columns if router_stats is not None else ())
    train_log = TrainLog(staging / "train_log.csv", section.max_steps, enabled=rank == 0, desc=stage,
                         flops_per_token=fpt, logits_flops_per_token=logits_fpt, peak_flops=peak, previous=rows,
                         columns=columns)
    return Run(section=section, stage=stage, topology=topology, engine=engine, scheduler=scheduler, access=access,
               clip=clip, runner=runner, names=names, config=config, generation_config=generation_config,
               checkpointer=checkpointer, train_log=train_log, staging=staging, global_batch=global_batch,
               seq_len=source.seq_len, num_parameters=n_params, trainable_parameters=n_trainable,
               flops_per_token=fpt, logits_flops_per_token=logits_fpt, peak_flops=peak, start_step=start_step,
               losses=losses, evaluations=evaluations, stops=stops, objective=objective,
               rows_per_item=getattr(source, "rows_per_item", 1),
               pair_stats=pair_stats, router_stats=router_stats)


def _bf16_decided(section: TrainingSettings, stage: str) -> TrainingSettings:
    """`section` with `bf16: auto` decided for this machine (`resolved_bf16`), the decision logged by rank 0."""
    if section.bf16 != "auto":
        return section
    section = resolved_bf16(section)
    if torch.distributed.get_rank() == 0:
        log.info("%s: bf16=auto -> %s (%s)", stage, str(section.bf16).lower(),
                 native_bf16() or "bf16 would be emulated here, slower than fp32")
    return section


def _keeps_best(section: TrainingSettings) -> bool:
    """load_best_model_at_end: a fine-tuning section's setting (pretraining has no dev set)."""
    return isinstance(section, SftSettings) and section.load_best_model_at_end


def step(run: Run, source, index: int) -> tuple[float, float | None]:
    """Optimizer step `index` (0-based) over its global batch; returns (step loss, grad norm or None)."""
    import torch.distributed as dist

    topology, section = run.topology, run.section
    batches = source.micro_batches(index, run.global_batch, topology.get_batch_rank(), topology.get_batch_world_size(),
                                   section.per_device_train_batch_size)
    # DeepSpeed averages the gradients over its data group (dp x sharding x cp), whose context ranks
    # hold the same samples
    dp, dp_group = topology.get_data_parallel_world_size(), topology.get_data_parallel_group()
    num_tokens = learned_tokens(batches, dp_group, copies=topology.get_context_parallel_world_size())
    run.learned_tokens += num_tokens
    if run.objective is not None:  # a global batch of pairs
        counts = global_counts(batches, run.objective, run.global_batch, dp_group)
        run.learned_tokens += counts.mix_tokens  # the general text mixed in is learned too
        step_loss, grad_norm, stats = preference_train_step(run.engine, run.objective, batches, counts, dp, run.clip,
                                                            tp_output_group(run), run.runner)
        run.pair_stats.add(stats)
    else:
        step_loss, grad_norm = train_step(run.engine, run.runner, batches, num_tokens, dp, run.clip,
                                          tp_output_group(run), router=run.router_stats)
    if dp > 1:  # the ranks' shares add up to the step loss
        dist.all_reduce(step_loss, group=topology.get_data_parallel_group())
    return step_loss.item(), grad_norm


def tp_output_group(run: Run):
    """The tensor-parallel group when the logits stay split over the vocabulary, else None."""
    tp = run.topology.degrees.tensor_parallel_degree
    return run.topology.tp_group if tp > 1 and run.section.tensor_parallel_output else None


def run_steps(run: Run, source, evaluator: Callable[..., dict[str, float]] | None = None) -> None:
    """Steps from the resumed one to `max_steps`: log every `logging_steps`, evaluate every
    `eval_steps` with `evaluator(engine)` (dev metrics; collective), checkpoint every `save_steps`.
    Asked to stop (SIGTERM, SIGUSR1, the SLURM job's deadline: `stages.training.preemption`), every
    rank stops after the same step, saves a checkpoint there and raises StopRequested."""
    section, engine = run.section, run.engine
    eval_steps = section.eval_steps if evaluator is not None else 0  # fine-tuning sections only
    engine.train()
    since_log = 0
    with StopWatch(watch_deadline=run.rank == 0) as watch:  # the others learn of it in agreed()
        for index in range(run.start_step, section.max_steps):
            started = time.perf_counter()
            lr = run.scheduler.get_last_lr()[0]  # the rate this step's update uses
            loss, grad_norm = step(run, source, index)
            done = index + 1
            run.losses.append(loss)
            since_log += run.global_batch * run.rows_per_item * run.seq_len
            run.train_log.advance()
            evaluation = None
            if eval_steps and (done % eval_steps == 0 or done == section.max_steps):
                evaluation = evaluate(run, evaluator, done)
            if done % section.logging_steps == 0 or done == section.max_steps or evaluation:
                if grad_norm is None:
                    grad_norm = engine.get_global_grad_norm()
                grad_norm = None if grad_norm is None else float(grad_norm)
                extra = run.pair_stats.means() if run.pair_stats is not None else None
                if run.router_stats is not None:
                    extra = {**(extra or {}), **run.router_stats.means()}
                run.train_log.log(done, loss, lr, grad_norm, since_log, evaluation, learned=run.learned_tokens,
                                  extra=extra)
                since_log = run.learned_tokens = 0
            watch.longest_step_s = max(watch.longest_step_s, time.perf_counter() - started)
            if done < section.max_steps:
                reason = watch.agreed(collective_device())
                if reason:
                    stop(run, done, reason)  # its own save, before a periodic one of this step
            if run.checkpointer is not None:
                run.checkpointer.poll()
                if run.checkpointer.due(done, section.max_steps):
                    run.checkpointer.save(done, engine, run.access, run.names, lambda: run.trainer_state(done))
                watch.longest_save_s = run.checkpointer.longest_save_s
    run.train_log.close()
    if run.checkpointer is not None:
        run.checkpointer.close()


def stop(run: Run, done: int, reason: int) -> None:
    """Save a complete checkpoint after step `done` (the stop recorded in its trainer state), wait
    for it, ask SLURM to requeue the job (rank 0, inside an allocation), and raise StopRequested."""
    name = reason_name(reason)
    if run.rank == 0:
        log.warning("%s: asked to stop by %s: saving a checkpoint at step %d", run.stage, name, done)
    checkpoint = None
    run.stops.append({"step": done, "reason": name})  # in the checkpoint's trainer state, then meta.json
    if run.checkpointer is not None:
        run.checkpointer.save(done, run.engine, run.access, run.names, lambda: run.trainer_state(done))
        run.checkpointer.close()
        checkpoint = str(run.checkpointer.run_dir / checkpoint_name(done))
    run.train_log.close()
    error = StopRequested(name, done, run.section.max_steps, checkpoint)
    if run.rank == 0:
        log.warning("%s: %s", run.stage, error)
        if checkpoint is not None:
            requeue_slurm_job()  # inside a SLURM job only
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # a rank that exits first would have srun (--kill-on-bad-exit) end rank 0's requeue
    raise error


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
    if _keeps_best(run.section):
        key = run.section.metric_for_best_model
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
                 run.section.metric_for_best_model, run.best["value"])


def final_evaluation(run: Run, evaluator: Callable[..., dict[str, float]]) -> dict[str, float]:
    """The dev metrics of the weights about to be written: the best evaluation's when they were
    put back, the last step's when it was evaluated, else measured now."""
    if run.best is not None:
        return run.best["metrics"]
    if run.evaluations and run.evaluations[-1]["step"] == run.section.max_steps:
        return {k: v for k, v in run.evaluations[-1].items() if k != "step"}
    run.engine.eval()
    with torch.no_grad():
        return evaluator(run.engine, tp_output_group(run))


def run_metrics(run: Run) -> dict[str, Any]:
    section, rows, losses = run.section, run.train_log.rows, run.losses
    return {
        "first_loss": losses[0], "final_loss": losses[-1],
        "final_loss_mean_last10": float(np.mean(losses[-10:])),
        "steps": section.max_steps, "num_parameters": run.num_parameters,
        "trainable_parameters": run.trainable_parameters, **layout_metrics(section, run.topology),
        "tokens_seen": run.global_batch * run.rows_per_item * run.seq_len * section.max_steps,
        "tokens_per_s": float(np.median([float(r["tokens_per_s"]) for r in rows[1:] or rows])) if rows else None,
        "mfu": float(np.median([float(r["mfu"]) for r in rows[1:] or rows])) if rows and run.peak_flops else None,
        "flops_per_token": run.flops_per_token,
        "logits_flops_per_token": run.logits_flops_per_token, "peak_flops": run.peak_flops,
        "skipped_steps": int(getattr(run.engine, "skipped_steps", 0)),  # fp16 overflow: update skipped
        "resumed_from_step": run.start_step or None,
        "checkpoint_save_stall_s": [round(s, 4) for s in run.checkpointer.stall_s] if run.checkpointer else [],
        "evaluations": run.evaluations,
        "best_step": run.best["step"] if run.best else None,
        "stops": run.stops,  # where a signal or the job's time limit stopped the run, resumed since
        **({"tokens_per_expert": run.router_stats.tokens_per_expert()} if run.router_stats is not None else {}),
    }


def finish(run: Run, out_dir: str | Path, metrics: dict[str, Any], *, tokenizer_dir: str | Path | None,
           parent: str | Path, meta_config: dict[str, Any], sharded_output: bool = False,
           adapter_writer: Callable[[Path, dict[str, torch.Tensor]], None] | None = None) -> None:
    """Write `out_dir` atomically: the single-device HF checkpoint (each rank writing its share),
    the tensor/pipeline slices for `merge_tp` (`sharded_output`), or with `adapter_writer` an
    adapter directory (rank 0 gets the whole trained tensors and calls it); plus the tokenizer,
    train_log.csv with its TensorBoard event file, and meta.json. Collective."""
    import torch.distributed as dist

    out_dir = Path(out_dir)

    def extra(tmp: Path) -> None:  # rank 0: everything but the weights
        if adapter_writer is None:
            write_config(run.config, tmp, run.generation_config)
        if tokenizer_dir is not None:
            copy_tokenizer(tokenizer_dir, tmp)
        for path in [run.staging / "train_log.csv", *event_files(run.staging)]:
            os.replace(path, tmp / path.name)
        write_meta(tmp, stage=run.stage, config=meta_config, parent=parent, seed=run.section.seed, metrics=metrics)

    if adapter_writer is None:
        write_final(out_dir, run.engine, run.access, run.names, run.topology, unified=not sharded_output, extra=extra,
                    gpt2_layout=getattr(run.config, "gpt2_blocks", False))
    else:
        tensors = _adapter_tensors(run)
        if run.rank == 0:
            with atomic_dir(out_dir) as tmp:
                adapter_writer(tmp, tensors)
                extra(tmp)
    if run.rank == 0:
        run.staging.rmdir()
        log.info("%s: wrote %s (final loss %.4f)", run.stage, out_dir, run.losses[-1])
    dist.barrier()


def _adapter_tensors(run: Run) -> dict[str, torch.Tensor] | None:
    """The trained adapter's whole tensors on rank 0 (None elsewhere). Collective. Under expert
    parallelism the experts' LoRA factors live on the ranks holding their experts: each rank takes
    its turn's share (`snapshot`) and rank 0 gathers them (an adapter is small)."""
    import torch.distributed as dist

    if run.topology.degrees.expert_parallel_degree == 1:
        part = snapshot(run.engine, run.access, run.names, run.topology, unified=True, optimizer=False, writer=0)
        return {k: v for file in part.files.values() for k, v in file.items()} if run.rank == 0 else None
    part = snapshot(run.engine, run.access, run.names, run.topology, unified=True, optimizer=False)
    shares = [None] * dist.get_world_size() if run.rank == 0 else None
    dist.gather_object({k: v for file in part.files.values() for k, v in file.items()}, shares, dst=0)
    return {k: v for share in shares for k, v in share.items()} if run.rank == 0 else None


def train(model: torch.nn.Module, source, section: Mapping[str, Any], out_dir: str | Path, *, stage: str,
          tokenizer_dir: str | Path | None, parent: str | Path, meta_config: dict[str, Any],
          num_parameters: int | None = None, checkpoint_dir: str | Path | None = None,
          identity: dict[str, Any] | None = None, sharded_output: bool = False,
          evaluator: Callable[..., dict[str, float]] | None = None,
          adapter_writer: Callable[[Path, dict[str, torch.Tensor]], None] | None = None,
          extra_metrics: dict[str, Any] | None = None, objective=None) -> dict[str, Any]:
    """Train `model` (the full fp32 model, identical on every rank: our LlamaForCausalLM, or a
    transformers causal LM for data parallel and ZeRO only; with an adapter attached, only its
    parameters train; our model may come on the meta device with a weight source, and each rank
    then allocates and fills only its slice, `stages.training.materialize`) for
    `section.max_steps` steps on `source` (a `stages.training.batches` sampler: `seq_len`,
    `micro_batches`) in the section's layout, and write `out_dir` (see `finish`). A transformers model's config.json is its own, every field kept.

    With `checkpoint_dir`, checkpoints go to `checkpoint_dir/<fingerprint>/` every `save_steps`
    steps, and the run resumes from the newest complete one there (any layout); the fingerprint
    hashes the recipe (the section without its layout keys, the global batch) and `identity`
    (what the caller knows of its inputs). With `evaluator`, dev metrics are logged beside the loss
    every `eval_steps` (`load_best_model_at_end` writes the best evaluated weights) and measured
    once more on the weights written (metrics `dev_loss`, `dev_exact_match`, ...). Returns the
    metrics, `extra_metrics` included (on every rank). Call after `init_distributed()`. `section`
    is as `setup` takes it; `bf16: auto` is decided there (metric `bf16`, the precision the run used).
    With `objective` (a PreferenceObjective), `source` yields preference pairs
    (`stages.training.preference_batches`) and the last logged row's preference statistics join
    the metrics (`final_<stat>`)."""
    run = setup(model, source, section, stage=stage, num_parameters=num_parameters, checkpoint_dir=checkpoint_dir,
                identity=identity, out_dir=out_dir, objective=objective)
    del model
    run_steps(run, source, evaluator)
    if _keeps_best(run.section):
        restore_best(run)
    metrics = {**run_metrics(run), **(extra_metrics or {}), "bf16": run.section.bf16, "dev_loss": None}
    if objective is not None and run.train_log.rows:  # the last row's, e.g. final_rewards_accuracy
        metrics.update({f"final_{k}": float(run.train_log.rows[-1][k]) for k in STATS})
    if evaluator is not None:
        metrics.update({k.replace("eval_", "dev_", 1): v for k, v in final_evaluation(run, evaluator).items()})
    finish(run, out_dir, metrics, tokenizer_dir=tokenizer_dir, parent=parent, meta_config=meta_config,
           sharded_output=sharded_output, adapter_writer=adapter_writer)
    return metrics
