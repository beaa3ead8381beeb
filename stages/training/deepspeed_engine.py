"""DeepSpeed over a parallelized module: its JSON config from a training section (ZeRO stage,
offload, mixed precision, batch sizes) and the engine with torch AdamW and the LR schedule."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from stages.parallel import Topology
from stages.training.capabilities import resolved_bf16
from stages.training.checkpointing import OptimizerAccess
from stages.training.schedule import build_scheduler


ZERO_STAGES = {"none": 0, "stage1": 1, "stage2": 2, "stage3": 3}


def deepspeed_config(section: Mapping[str, Any], data_parallel: int, pipeline: bool = False) -> dict[str, Any]:
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
        "bf16": {"enabled": bool(resolved_bf16(section)["bf16"])},  # auto: decided for this machine
        # dynamic loss scaling from 2^16, halved on overflow (the step is skipped), doubled after
        # 1000 clean steps; DeepSpeed keeps fp32 master weights in the optimizer
        "fp16": {"enabled": bool(section["fp16"]), "loss_scale": 0, "initial_scale_power": 16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def adamw(params, section: Mapping[str, Any]) -> torch.optim.AdamW:
    """torch AdamW with the section's settings, fused: one pass over each tensor (DeepSpeed hands
    it one flat fp32 partition) instead of the single-tensor loop's dozen on a CPU; transformers'
    Trainer defaults to the same (`adamw_torch_fused`). Same maths, rounded differently in the last
    bit (bench/README, train_throughput.py)."""
    return torch.optim.AdamW(params, lr=section["learning_rate"], betas=(section["adam_beta1"], section["adam_beta2"]),
                             weight_decay=section["weight_decay"], eps=1e-8, fused=True)


def build_engine(module: torch.nn.Module, section: Mapping[str, Any], topology: Topology, *, pipeline: bool):
    """DeepSpeed over `module`: torch AdamW, the LR schedule and ZeRO as the section says. Returns
    (engine, scheduler, OptimizerAccess, clip); `clip` clips and measures the gradient norm when
    ZeRO is off (see `train_step`), else None."""
    import deepspeed
    from deepspeed.runtime.utils import clip_grad_norm_

    trained = [p for p in module.parameters() if p.requires_grad]  # an adapter's only; the base is frozen
    optimizer = adamw(trained, section)
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
