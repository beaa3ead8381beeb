"""DeepSpeed over a parallelized module: its JSON config from a training section (ZeRO stage,
offload, mixed precision, batch sizes) and the engine with torch AdamW and the LR schedule.

One mixed-precision recipe in every layout (docs/parallel.md, "Mixed precision"), ZeRO's: the model
and its gradients are bf16/fp16; gradients are summed over data parallel in fp32; the optimizer
updates fp32 master weights with fp32 Adam moments. ZeRO 1/2/3 do this inside DeepSpeed's ZeRO
optimizer; without ZeRO (one process, plain data parallel, TP, PP) DeepSpeed wraps torch AdamW in
its FP16_UnfusedOptimizer, whose construction takes one optimizer step on zero gradients that
`forget_initial_step` undoes, and whose fp16 loss scale the training step applies itself
(`loss_scale`). Within one step the micro-batches' gradients add up in the model's
dtype in every layout (DeepSpeed's default; its fp32 accumulation, `grad_accum_dtype`, exists for
ZeRO-1 and its own pipeline engine only, and raises NotImplementedError without ZeRO).

Expert parallelism (`stages.parallel.experts`) reaches DeepSpeed as its own MoE does: the expert
parameters are marked (`allreduce=False`, `group_name`), put in their own optimizer param group
(`moe: True`), and the expert groups are our topology's (`expert_parallel_in_deepspeed`); DeepSpeed
then averages their gradients over the ranks holding the same experts (divided by the whole data
group, as each rank's experts saw every data rank's tokens) and ZeRO 1/2 shard their state there.

Each function takes a typed training section or a mapping (`stages.sections.training_section`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from stages.model.moe import SparseMoeBlock
from stages.parallel import Topology
from stages.sections import training_section
from stages.training.capabilities import resolved_bf16
from stages.training.checkpointing import OptimizerAccess
from stages.training.schedule import build_scheduler


ZERO_STAGES = {"none": 0, "stage1": 1, "stage2": 2, "stage3": 3}


def deepspeed_config(section: Mapping[str, Any], data_parallel: int, pipeline: bool = False) -> dict[str, Any]:
    """The DeepSpeed JSON config for a training section over `data_parallel` replicas. With
    `pipeline`, DeepSpeed sees one batch of micro x accum per step: the pipeline schedule, not
    DeepSpeed, cuts it into the micro-batches. `bf16: auto` is decided for this machine
    (`resolved_bf16`; the engine's sections come decided already)."""
    section = resolved_bf16(training_section(section))
    micro, accum = section.per_device_train_batch_size, section.gradient_accumulation_steps
    zero = ZERO_STAGES[section.sharding]
    if pipeline:
        micro, accum = micro * accum, 1
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * data_parallel,
        "gradient_clipping": section.max_grad_norm,
        "zero_optimization": {"stage": zero,
                              **({"offload_optimizer": {"device": "cpu"}} if section.sharding_offload else {})},
        "zero_force_ds_cpu_optimizer": False,  # offload runs our torch AdamW on the CPU copy
        "zero_allow_untested_optimizer": True,  # torch AdamW runs on CPU; DeepSpeed's fused Adam is CUDA-only
        "bf16": {"enabled": section.bf16},
        # Gradients are summed over data parallel in fp32 (DeepSpeed's default is the model's dtype).
        # Over 2 ranks the two are bit-identical: a + b of two bf16 numbers is exact in fp32 and
        # rounded once either way.
        "communication_data_type": "fp32",
        # dynamic loss scaling from 2^16, halved on overflow (the step is skipped), doubled after
        # 1000 clean steps; DeepSpeed keeps fp32 master weights in the optimizer
        "fp16": {"enabled": section.fp16, "loss_scale": 0, "initial_scale_power": 16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def adamw(params, section: Mapping[str, Any]) -> torch.optim.AdamW:
    """torch AdamW with the section's settings, fused: one pass over each tensor (DeepSpeed hands
    it one flat fp32 partition) instead of the single-tensor loop's dozen on a CPU; transformers'
    Trainer defaults to the same (`adamw_torch_fused`). Same maths, rounded differently in the last
    bit (bench/README, train_throughput.py)."""
    section = training_section(section)
    return torch.optim.AdamW(params, lr=section.learning_rate, betas=(section.adam_beta1, section.adam_beta2),
                             weight_decay=section.weight_decay, eps=1e-8, fused=True)


def build_engine(module: torch.nn.Module, section: Mapping[str, Any], topology: Topology, *, pipeline: bool):
    """DeepSpeed over `module`: torch AdamW, the LR schedule and ZeRO as the section says. Returns
    (engine, scheduler, OptimizerAccess, clip); `clip` clips and measures the gradient norm when
    ZeRO is off (see `train_step`), else None."""
    import deepspeed
    from deepspeed.runtime.utils import clip_grad_norm_

    section = training_section(section)
    trained = [p for p in module.parameters() if p.requires_grad]  # an adapter's only; the base is frozen
    experts = [p for p in trained if getattr(p, "expert_parallel", False)]
    dense = [p for p in trained if not getattr(p, "expert_parallel", False)]
    # Every expert-parallel parameter must be known to DeepSpeed as this rank's own, frozen ones too: it
    # broadcasts every other parameter from data rank 0 when it is built, which gave a frozen base (LoRA
    # on attention) rank 0's experts on every rank. With trained experts they are all marked as experts'
    # (broadcast within their expert-data group only); without, DeepSpeed would want an empty MoE
    # optimizer group, so they get its mark of a parameter unique to its rank (never broadcast).
    held = [p for p in module.parameters() if getattr(p, "expert_parallel", False)]
    if not experts:
        for param in held:
            param.ds_optim_param = True
    groups = [{"params": dense, "name": "dense"}, {"params": experts, "name": expert_group_name(topology), "moe": True}]
    optimizer = adamw(groups if experts else trained, section)
    scheduler = build_scheduler(optimizer, section)
    ds_config = deepspeed_config(section, topology.get_data_parallel_world_size(), pipeline=pipeline)
    zero_off = ZERO_STAGES[section.sharding] == 0
    if zero_off:  # clipped by `clip` below
        ds_config["gradient_clipping"] = 0.0
    with expert_parallel_in_deepspeed(held, topology) if experts else nullcontext():
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, mpu=topology)
    forget_initial_step(engine.optimizer)
    # Without ZeRO, DeepSpeed clips but does not keep the norm: clip here (same maths, with the
    # topology's model-parallel reduction) so train_log.csv has grad_norm for every layout.
    clip = None
    if zero_off:
        max_norm = section.max_grad_norm or float("inf")

        def clip_and_measure(m: torch.nn.Module) -> float:
            scale = loss_scale(engine)  # fp16: the gradients are still multiplied by the loss scale
            params = [p for p in m.parameters() if p.requires_grad]
            if experts:
                return float(clip_expert_parallel(params, max_norm * scale, topology)) / scale
            return float(clip_grad_norm_(params, max_norm * scale, mpu=topology)) / scale

        clip = clip_and_measure
    return engine, scheduler, OptimizerAccess(engine), clip


def loss_scale(engine) -> float:
    """What the loss handed to `engine.backward` must be multiplied by: the dynamic loss scale of
    DeepSpeed's FP16_UnfusedOptimizer (fp16 without ZeRO), else 1. DeepSpeed 0.19.8's
    engine.backward scales the loss for its ZeRO optimizers only, while this one divides the
    gradients by the scale in its step: fp16 gradients without ZeRO came out 2^16 times too small
    (Adam's eps then damped every update: 8.6% above the fp32 loss after 10 steps, issue 50), and
    its overflow check looked at unscaled gradients."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    wrapper = engine.optimizer
    if isinstance(wrapper, FP16_UnfusedOptimizer) and wrapper.loss_scale_config.use_grad_scaling:
        return float(wrapper.loss_scale)
    return 1.0


def forget_initial_step(wrapper) -> None:
    """Undo the optimizer step that DeepSpeed's FP16_UnfusedOptimizer (bf16/fp16 without ZeRO) takes on
    zero gradients when it is built, to create Adam's state. That step counts: the first real update
    got step 2's bias correction (0.74x the update ZeRO and fp32 make, with betas 0.9/0.95) and
    AdamW's decay had shrunk the fp32 masters once, so bf16 runs on this optimizer lagged the ZeRO
    and fp32 curves by ~1% (issue 50). Adam's state is dropped (torch creates it at the first real
    step) and the masters are copied back from the model's weights."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if not isinstance(wrapper, FP16_UnfusedOptimizer):
        return
    wrapper.optimizer.state.clear()
    wrapper.refresh_fp32_params()


def expert_group_name(topology: Topology) -> str:
    """DeepSpeed's name of the expert groups (`group_name` of an expert parameter)."""
    return f"ep_size_{topology.degrees.expert_parallel_degree}"


@contextmanager
def expert_parallel_in_deepspeed(experts: list[torch.nn.Parameter], topology: Topology) -> Iterator[None]:
    """DeepSpeed's engine, built inside, treats `experts` as expert-parallel parameters over our
    topology's expert groups. DeepSpeed knows expert parallelism only from its own MoE layer classes:
    it looks for them among the module's children (`isinstance(module, MoE)`) while it is built and
    then reads the expert groups from its `groups` registry. Inside this block our sparse block counts
    as such a layer (the engine module's `MoE` name is a tuple with it, restored on exit), the
    parameters carry DeepSpeed's marks, and the registry holds our groups under DeepSpeed's name, so
    DeepSpeed's own placement never differs from ours."""
    import deepspeed.runtime.engine as ds_engine
    from deepspeed.utils import groups

    name = expert_group_name(topology)
    for param in experts:
        param.allreduce, param.group_name = False, name
    groups._EXPERT_PARALLEL_GROUP[name] = topology.get_expert_parallel_group()
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = topology.ranks("expert")
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = topology.get_expert_data_parallel_group()
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = topology.ranks("expert_data")
    native = ds_engine.MoE
    ds_engine.MoE = (native, SparseMoeBlock)
    try:
        yield
    finally:
        ds_engine.MoE = native


def clip_expert_parallel(params: list[torch.nn.Parameter], max_norm: float, topology: Topology) -> torch.Tensor:
    """Clip the gradients to `max_norm` by their global L2 norm under expert parallelism (ZeRO off) and
    return that norm: a replicated tensor counted once per tensor-parallel group, a split one on every
    rank (summed over the model group), each expert once (summed over the expert group too).
    DeepSpeed's `clip_grad_norm_` averages each rank's norm over the data group instead, which is the
    global norm only when every rank holds the same tensors. Same clip coefficient as DeepSpeed's."""
    import torch.distributed as dist

    tp_rank = topology.coordinates["tensor"]
    grads = [p for p in params if p.grad is not None]
    sums = torch.zeros(2, dtype=torch.float32, device=grads[0].grad.device if grads else "cpu")  # (dense, experts)
    for p in grads:
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            sums[int(getattr(p, "expert_parallel", False))] += p.grad.detach().float().norm(2) ** 2
    dist.all_reduce(sums, group=topology.get_model_parallel_group())
    expert = sums[1:].clone()
    dist.all_reduce(expert, group=topology.get_expert_parallel_group())
    total = (sums[0] + expert[0]).sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in grads:
        p.grad.mul_(coef)
    return total
