"""A training section's layout applied to a built model: the parallel degrees, the checks that
the model fits them, and tensor parallel, expert parallel, context parallel, recompute, compile and
the pipeline split in torchtitan's order. Parameter names stay those of the single-device model. The functions
a caller outside the engine calls take a typed training section or a mapping
(`stages.sections.training_section`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from stages.model import LlamaForCausalLM
from stages.model.moe_layouts import moe_layout_problem
from stages.parallel import ParallelDegrees, Topology, apply_tensor_parallel
from stages.parallel.context import apply_context_parallel
from stages.parallel.experts import apply_expert_parallel
from stages.parallel.pipeline import PipelineRunner
from stages.sections import TrainingSettings, training_section
from stages.training.deepspeed_engine import ZERO_STAGES
from stages.training.families import check_transformers_model, prepare_transformers_model


def parallel_degrees(section: Mapping[str, Any]) -> ParallelDegrees:
    """The parallel degrees of a training section (data parallel derived)."""
    section = training_section(section)
    return ParallelDegrees(world_size=section.world_size, tensor_parallel_degree=section.tensor_parallel_degree,
                           pipeline_parallel_degree=section.pipeline_parallel_degree,
                           context_parallel_degree=section.context_parallel_degree,
                           expert_parallel_degree=section.expert_parallel_degree)


class PipelineModules(torch.nn.Module):
    """This rank's pipeline chunks as one module for DeepSpeed; parameter names stay those of the
    single-device model (the chunks hold `model.layers.<i>` under their own names)."""

    def __init__(self, chunks: list[torch.nn.Module]):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)

    def full_names(self) -> dict[str, str]:
        """Local parameter/buffer name -> single-device name (drops the `chunks.<k>.` prefix)."""
        return {k: k.split(".", 2)[2] for k in self.state_dict()}


def check_model_fits(model: torch.nn.Module, section: Mapping[str, Any], degrees: ParallelDegrees) -> None:
    """Raise ValueError when the section's layout cannot train `model`: our model's degrees must
    divide its shapes; a transformers model takes data parallel and ZeRO only."""
    if isinstance(model, LlamaForCausalLM):
        degrees.validate_for_model(model.config)
    elif degrees.context_parallel_degree > 1:
        raise ValueError(f"context_parallel_degree={degrees.context_parallel_degree}: {type(model).__name__} "
                         "trains through transformers, whose attention does not read keys split over ranks; "
                         "context parallelism runs on the project's own model (set context_parallel_degree: 1)")
    elif degrees.expert_parallel_degree > 1:
        raise ValueError(f"expert_parallel_degree={degrees.expert_parallel_degree}: {type(model).__name__} trains "
                         "through transformers; expert parallelism runs on the project's own model (the mixture "
                         "of experts families); set expert_parallel_degree: 1")
    else:
        check_transformers_model(model, training_section(section), degrees.tensor_parallel_degree,
                                 degrees.pipeline_parallel_degree)


def parallelize(model: torch.nn.Module, section: Mapping[str, Any],
                topology: Topology) -> tuple[torch.nn.Module, PipelineRunner | None]:
    """Apply the section's layout to the full `model` in place, in the torchtitan order (tensor
    parallel, activation recompute, compile, pipeline split). Returns the module DeepSpeed wraps
    (this rank's pipeline chunks under a pipeline) and the pipeline runner, if any."""
    section = training_section(section)
    if not isinstance(model, LlamaForCausalLM):  # data parallel and ZeRO only (check_model_fits)
        prepare_transformers_model(model, section)
        return model, None
    degrees = topology.degrees
    problem = moe_layout_problem(model.config.model_type, degrees.tensor_parallel_degree,
                                 degrees.pipeline_parallel_degree, degrees.context_parallel_degree,
                                 section.sequence_parallel, ep=degrees.expert_parallel_degree,
                                 num_experts=model.config.num_experts, sharding=section.sharding,
                                 capacity_factor=model.config.moe_capacity_factor) \
        if model.config.moe else None
    if problem:
        raise ValueError(problem)
    if degrees.tensor_parallel_degree > 1:
        apply_tensor_parallel(model, topology, tensor_parallel_output=section.tensor_parallel_output,
                              sequence_parallel=section.sequence_parallel)
    if degrees.expert_parallel_degree > 1:
        apply_expert_parallel(model, topology.get_expert_parallel_group(), topology.get_expert_parallel_rank(),
                              degrees.expert_parallel_degree)
    if degrees.context_parallel_degree > 1:
        sp = degrees.tensor_parallel_degree if section.sequence_parallel else 1
        apply_context_parallel(model, topology.get_context_parallel_group(), sequence_parallel_degree=sp,
                               mode=section.context_parallel_mode)
    model.gradient_checkpointing = section.recompute
    if section.torch_compile:
        # In place, layer by layer, so parameter names stay those of the single-device model;
        # the collectives inside tensor-parallel layers become graph breaks.
        for layer in model.model.layers.values():
            layer.compile()
    if degrees.pipeline_parallel_degree == 1:
        return model, None
    runner = PipelineRunner(model, degrees.pipeline_parallel_degree, section.virtual_pp_degree,
                            n_microbatches=section.gradient_accumulation_steps, pp_group=topology.group("pipeline"))
    return PipelineModules(runner.modules), runner


def layout_metrics(section: TrainingSettings, topology: Topology) -> dict[str, int]:
    """The degrees of the run, for meta.json."""
    degrees = topology.degrees
    return {"world_size": degrees.world_size, "data_parallel_degree": topology.get_batch_world_size(),
            "tensor_parallel_degree": degrees.tensor_parallel_degree,
            "context_parallel_degree": degrees.context_parallel_degree,
            "pipeline_parallel_degree": degrees.pipeline_parallel_degree,
            "expert_parallel_degree": degrees.expert_parallel_degree,
            "zero_stage": ZERO_STAGES[section.sharding]}
