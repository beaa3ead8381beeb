"""Checkpoints of the training engine: save in any layout, resume in any other.

What a checkpoint holds (see `stages.checkpoint.store` for the files): the fp32 master weights
and Adam's moments of every trained parameter under its single-device name (for LoRA and prefix
tuning the adapter's only: the frozen base is the run's input, part of its fingerprint), the optimizer step count,
the LR scheduler, DeepSpeed's loss scaler and step counters, the RNG states of every rank, the
data position (the optimizer step: batches are indexed by step) and the loss history.

Saving is collective. For every parameter the ranks of its pipeline stage first make the
tensor-parallel slice whole over the data-parallel group (DeepSpeed's fragment API under ZeRO;
the parameter itself without), then

- unified (default): all-gather it over the tensor-parallel group along `partition_dim`; the
  stage's ranks take turns writing whole tensors, so each rank writes about 1/(tp x dp) of its
  stage and no process gathers the model;
- sharded (`unified_checkpoint: false`): no tensor-parallel communication; each tensor-parallel
  rank writes its own slice (replicated tensors once), the data-parallel ranks taking turns.

The tensors are copied to CPU memory in the step loop; serialising, hashing and writing run in a
background thread when `async_save` is on, and the step loop goes on. Each step while a save is
pending the ranks agree (one small all-reduce) whether every writer is done; then rank 0 writes
the index, renames the directory and writes the completion marker.

Resuming reads whole tensors by name (`StateReader`, which also joins sharded slices), so the new
layout may differ in world size, ZeRO stage, tensor or pipeline degree: weights are loaded into
the full model before it is parallelised, optimizer state is sliced for this rank and handed to
DeepSpeed after `deepspeed.initialize`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from stages.checkpoint.atomic import atomic_dir, disk_full, is_disk_full, write_json
from stages.checkpoint.integrity import FileRecord, sha256_file, write_tensors
from stages.checkpoint.store import (
    INDEX,
    OPTIMIZER_KEYS,
    SHARDED,
    UNIFIED,
    StateReader,
    checkpoint_name,
    complete_checkpoints,
    finalize,
    newest_valid,
    optimizer_key,
    problems,
    prune,
    remove_partial,
    write_hf_index,
)
from stages.checkpoint.weights import open_safetensors
from stages.model.gpt2_layout import hf_name, to_hf
from stages.parallel.mappings import collective_device
from stages.parallel.tensor import join_shards, partition_chunks, partition_dim, shard_tensor
from stages.parallel.topology import Topology
from stages.sections import TrainingSettings
from stages.training.families import write_config

log = logging.getLogger(__name__)

# Keys that change how a run is laid out or saved, not what it computes: checkpoints written under
# one value resume under another.
LAYOUT_KEYS = frozenset({
    "world_size", "sharding", "sharding_offload", "tensor_parallel_degree", "tensor_parallel_output",
    "sequence_parallel", "context_parallel_degree", "context_parallel_mode",
    "pipeline_parallel_degree", "virtual_pp_degree", "expert_parallel_degree", "recompute", "torch_compile",
    "logging_steps",
    "per_device_train_batch_size", "gradient_accumulation_steps", "save_steps", "save_total_limit",
    "unified_checkpoint", "async_save", "resume_from_checkpoint",
    "eval_steps", "eval_with_do_generation", "per_device_eval_batch_size", "num_eval_examples",
})


def run_fingerprint(section: Mapping[str, Any], global_batch: int, identity: dict[str, Any]) -> str:
    """A short hash of what determines the training trajectory: the section without its layout
    keys, the global batch, and `identity` (model config, input data). Checkpoints are kept per
    fingerprint, so a changed recipe starts afresh while a changed layout resumes."""
    recipe = {k: v for k, v in section.items() if k not in LAYOUT_KEYS}
    blob = json.dumps({"recipe": recipe, "global_batch": global_batch, "identity": identity}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def model_identity(model_dir: str | Path) -> dict[str, str]:
    """Content hashes of a base model: its checkpoint index (which holds every weight file's sha256)
    when a training stage wrote it, else the weight files themselves."""
    model_dir = Path(model_dir)
    files = [model_dir / "checkpoint_index.json"] if (model_dir / "checkpoint_index.json").exists() else \
        sorted(model_dir.glob("*.safetensors"))
    return {f.name: sha256_file(f) for f in [model_dir / "config.json", *files]}


class OptimizerAccess:
    """The fp32 master copy and Adam moments of a model parameter, whole over the data-parallel
    group, in the three shapes DeepSpeed keeps them: ZeRO 1/2/3 (the fragment API; collective over
    the data-parallel group), FP16_UnfusedOptimizer (bf16/fp16 without ZeRO: one fp32 copy per
    parameter) and the bare torch optimizer (fp32 without ZeRO: the parameter is the master)."""

    def __init__(self, engine):
        self.engine = engine
        self.wrapper = engine.optimizer
        self.inner: torch.optim.Optimizer = getattr(self.wrapper, "optimizer", None) or self.wrapper
        params = list(engine.module.parameters())
        self.fragments = any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in params)
        self.master: dict[int, torch.Tensor] = {}
        if not self.fragments and hasattr(self.wrapper, "fp32_groups") and hasattr(self.wrapper, "fp16_groups"):
            for low, high in zip(self.wrapper.fp16_groups, self.wrapper.fp32_groups):
                self.master.update({id(lp): hp for lp, hp in zip(low, high)})

    def _hp(self, param: torch.Tensor) -> torch.Tensor:
        return self.master.get(id(param), param)

    def get(self, param: torch.nn.Parameter, key: str | None) -> torch.Tensor:
        if self.fragments:
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            return safe_get_full_fp32_param(param) if key is None else safe_get_full_optimizer_state(param, key)
        hp = self._hp(param)
        if key is None:
            return hp.detach()
        state = self.inner.state.get(hp, {})
        return state[key].detach() if key in state else torch.zeros_like(hp, dtype=torch.float32)

    def set(self, param: torch.nn.Parameter, key: str | None, value: torch.Tensor) -> None:
        if self.fragments:
            from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

            value = value.to(torch.float32)
            (safe_set_full_fp32_param(param, value) if key is None
             else safe_set_full_optimizer_state(param, value, key))
            return
        hp = self._hp(param)
        with torch.no_grad():
            if key is None:
                hp.copy_(value)
                if hp is not param:
                    param.copy_(value)
            else:
                self.inner.state[hp][key].copy_(value)

    def link_state(self) -> None:
        """Point every parameter's fragment at Adam's state again (ZeRO 1/2). DeepSpeed links them once,
        right after the first param group's first update, when a second group (an expert-parallel run's
        experts, `stages.training.deepspeed_engine`) has no state yet: its moments would stay unreadable."""
        link = getattr(self.wrapper, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None and len(self.inner.param_groups) > 1 and self.inner.state:
            self.wrapper._hp_optimizer_states_linked = False
            link()

    def step_count(self) -> int:
        """Optimizer updates applied so far (skipped fp16 steps do not count)."""
        return adam_step_count(self.inner)

    def ensure_state(self, step: int) -> None:
        """Create Adam's state (zeros, `step`) for every tensor the optimizer updates: torch creates
        it lazily at the first update, and DeepSpeed links its per-parameter views only then."""
        # ZeRO-3 points the param groups at its flat fp32 partitions only during its step
        flat = getattr(self.wrapper, "fp32_partitioned_groups_flat", None)
        tensors = list(flat) if flat is not None else [hp for g in self.inner.param_groups for hp in g["params"]]
        # torch's rule (Adam's _init_group): a fused or capturable optimizer keeps `step` on the
        # parameter's device, the others on the CPU; fused AdamW on a GPU refuses a CPU step
        on_device = any(g.get("fused") or g.get("capturable") for g in self.inner.param_groups)
        for hp in tensors:
            state = self.inner.state[hp]
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=hp.device if on_device else "cpu")
            state.setdefault("exp_avg", torch.zeros_like(hp, memory_format=torch.preserve_format))
            state.setdefault("exp_avg_sq", torch.zeros_like(hp, memory_format=torch.preserve_format))
        link = getattr(self.wrapper, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:
            link()


def adam_step_count(optimizer: torch.optim.Optimizer) -> int:
    """Adam's update count (its per-tensor `step`; 0 before the first update)."""
    steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
    return int(max(steps)) if steps else 0


def restore_scheduler(scheduler, state: dict[str, Any]) -> None:
    """The LR scheduler of `state['lr_scheduler']`, and the optimizer's current rate to match. Its
    per-group lists follow this run's param groups: an expert-parallel run has two (dense and
    experts, `stages.training.deepspeed_engine`), others one, all at the same rate."""
    saved = dict(state["lr_scheduler"])
    groups = len(scheduler.optimizer.param_groups)
    for key in ("base_lrs", "_last_lr"):
        if key in saved and len(saved[key]) != groups:
            saved[key] = saved[key][:1] * groups
    scheduler.load_state_dict(saved)
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr


def trained_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of what the optimizer updates: every parameter, or an adapter's only."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


@dataclass
class RankPart:
    """What one rank writes for one checkpoint: tensors already copied to CPU memory."""

    rank: int
    files: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # file name -> tensors
    metadata: dict[str, dict[str, Any]] = field(default_factory=dict)  # file name -> safetensors metadata
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)  # tensor key -> where it lives

    def add(self, file: str, key: str, tensor: torch.Tensor, tp_rank: int = 0, tp_size: int = 1,
            partition_dim: int | None = None, partition_chunks: int = 1) -> None:
        self.files.setdefault(file, {})[key] = tensor
        self.entries[key] = {"file": file, "tp_rank": tp_rank, "tp_size": tp_size, "partition_dim": partition_dim}
        if partition_chunks > 1:  # a fused layer's slices (stages.parallel.tensor.shard_tensor)
            self.entries[key]["partition_chunks"] = partition_chunks


def _to_hf_layout(part: RankPart) -> None:
    """GPT-2's names and Conv1D weights for a unified part's model tensors, in place (the optimizer's
    moments keep our names and layout: no library reads them)."""

    model_files = {file for file in part.files if file.startswith("model")}
    part.files = {file: to_hf(tensors) if file in model_files else tensors for file, tensors in part.files.items()}
    part.entries = {hf_name(key) if entry["file"] in model_files else key: entry for key, entry in part.entries.items()}


def write_part(directory: Path, part: RankPart) -> dict[str, Any]:
    """Write a rank's files into `directory`; the records and entries rank 0 needs for the index."""
    directory.mkdir(parents=True, exist_ok=True)
    records: list[FileRecord] = [write_tensors(directory / name, tensors, part.metadata.get(name))
                                 for name, tensors in part.files.items()]
    return {"rank": part.rank, "files": [r.to_json() for r in records], "entries": part.entries}


def add_rng_state(part: RankPart, rank: int) -> None:
    """This rank's random-number generator states (torch CPU/CUDA, numpy, python)."""
    name = f"rng_state_{rank}.safetensors"
    np_state = np.random.get_state()
    part.files[name] = {"torch_cpu": torch.get_rng_state(),
                        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64))}
    if torch.cuda.is_available():
        part.files[name]["torch_cuda"] = torch.cuda.get_rng_state()
    version, internal, gauss = random.getstate()
    part.metadata[name] = {"numpy": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])],
                           "python": [version, list(internal), gauss]}


def restore_rng(reader: StateReader, rank: int) -> None:
    """This rank's RNG states, or rank 0's when the checkpoint had fewer ranks."""
    path = reader.path / f"rng_state_{rank}.safetensors"
    if not path.exists():
        path = reader.path / "rng_state_0.safetensors"
    with open_safetensors(path) as f:
        meta = {k: json.loads(v) for k, v in f.metadata().items() if k != "format"}
        torch.set_rng_state(f.get_tensor("torch_cpu"))
        if torch.cuda.is_available() and "torch_cuda" in f.keys():
            torch.cuda.set_rng_state(f.get_tensor("torch_cuda"))
        keys = f.get_tensor("numpy_keys").numpy().astype(np.uint32)
    algo, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((algo, keys, pos, has_gauss, cached))
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))


def _file_names(unified: bool, rank: int, world: int, topology: Topology) -> tuple[str, str]:
    if not unified:
        tag = (f"tp{topology.coordinates['tensor']:02d}-pp{topology.coordinates['pipeline']:02d}"
               f"-dp{topology.get_data_parallel_rank():02d}")
        return f"model-{tag}.safetensors", f"optimizer-{tag}.safetensors"
    if world == 1:
        return "model.safetensors", "optimizer.safetensors"
    tag = f"{rank + 1:05d}-of-{world:05d}"
    return f"model-{tag}.safetensors", f"optimizer-{tag}.safetensors"


def snapshot(engine, access: OptimizerAccess, names: dict[str, str], topology: Topology, *,
             unified: bool, optimizer: bool, writer: int | None = None) -> RankPart:
    """This rank's share of the checkpoint, copied to CPU memory. Collective over every rank.
    With `writer` (unified, no pipeline) that rank takes every whole tensor. Under expert
    parallelism an expert's tensors are written by one of the ranks holding it (the tensor-parallel
    rank 0 of its expert-data group, taking turns); every rank lists as many experts at the same
    places, so the turns stay aligned."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tp, dp = topology.degrees.tensor_parallel_degree, topology.get_data_parallel_world_size()
    tp_rank, dp_rank = topology.coordinates["tensor"], topology.get_data_parallel_rank()
    model_file, optim_file = _file_names(unified, rank, world, topology)
    part = RankPart(rank)
    keys = [None, *OPTIMIZER_KEYS] if optimizer else [None]
    if optimizer:
        access.link_state()
    turn = 0
    for local_name, param in trained_parameters(engine.module):
        name, dim, chunks = names.get(local_name, local_name), partition_dim(param), partition_chunks(param)
        expert = getattr(param, "expert_parallel", False)
        if expert and writer is not None:
            raise ValueError(f"{name}: one writer cannot take an expert-parallel run's experts (each rank holds "
                             "its own); write them unified by every rank")
        holders, place = (topology.get_expert_data_parallel_world_size(), topology.get_expert_data_parallel_rank()) \
            if expert else (dp, dp_rank)  # the ranks that hold this tensor, and this rank's place among them
        for key in keys:
            tensor = access.get(param, key)  # this tensor-parallel slice, whole over data parallel
            file, tkey = (model_file, name) if key is None else (optim_file, optimizer_key(name, key))
            if unified:
                if dim is not None and tp > 1:
                    slices = [torch.empty_like(tensor) for _ in range(tp)]
                    dist.all_gather(slices, tensor.contiguous(), group=topology.tp_group)
                    tensor = join_shards(slices, dim, chunks)
                if (rank == writer) if writer is not None else turn % (tp * holders) == place * tp + tp_rank:
                    part.add(file, tkey, tensor.detach().float().cpu().clone())
            elif (dim is not None or tp_rank == 0) and turn % holders == place:
                part.add(file, tkey, tensor.detach().float().cpu().clone(), tp_rank=tp_rank,
                         tp_size=tp if dim is not None else 1, partition_dim=dim, partition_chunks=chunks)
            turn += 1
    if optimizer:
        add_rng_state(part, rank)
    return part


def load_model_weights(model: torch.nn.Module, reader: StateReader) -> None:
    """Copy the checkpoint's master weights into the full (not yet parallelised) model's trained
    parameters. A tied lm_head is one parameter under its embedding's name (`named_parameters`
    lists it once, and a checkpoint holds it once), so loading the embedding loads both and the tie stays.
    A lazy model's meta parameters are skipped: they are filled from the checkpoint after slicing
    (`stages.training.materialize`)."""
    with torch.no_grad():
        for name, param in trained_parameters(model):
            if not param.is_meta:
                param.copy_(reader.get(name).to(param.dtype))


def restore_training_state(engine, access: OptimizerAccess, names: dict[str, str], topology: Topology,
                           reader: StateReader, scheduler) -> dict[str, Any]:
    """Hand the checkpoint's master weights, Adam moments, step count, scheduler, loss scaler and
    RNG to this rank's engine (sliced for its tensor-parallel rank). Returns the trainer state."""
    state = reader.trainer_state
    access.ensure_state(state["optimizer_step"])
    tp, tp_rank = topology.degrees.tensor_parallel_degree, topology.coordinates["tensor"]
    for local_name, param in trained_parameters(engine.module):
        name, dim = names.get(local_name, local_name), partition_dim(param)
        for key in (None, *OPTIMIZER_KEYS):
            full = reader.get(name if key is None else optimizer_key(name, key))
            access.set(param, key, shard_tensor(full, dim, tp_rank, tp, partition_chunks(param))
                       if dim is not None and tp > 1 else full)
    restore_scheduler(scheduler, state)
    for holder in _scaler_holders(engine.optimizer):
        for attr, value in state["loss_scaler"].items():
            if holder is not None and hasattr(holder, attr):
                current = getattr(holder, attr)
                setattr(holder, attr, torch.tensor(value, dtype=current.dtype, device=current.device)
                        if torch.is_tensor(current) else type(current)(value))
    engine.global_steps = state["engine"]["global_steps"]
    engine.global_samples = state["engine"]["global_samples"]
    engine.skipped_steps = state["engine"]["skipped_steps"]
    engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    restore_rng(reader, dist.get_rank())
    return state


_SCALER_ATTRS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _scaler_holders(optimizer) -> tuple:
    """Where DeepSpeed keeps fp16's loss-scaler state: the ZeRO optimizers in a `loss_scaler`,
    FP16_UnfusedOptimizer (fp16 without ZeRO) in its `loss_scale_config`."""
    return (optimizer, getattr(optimizer, "loss_scaler", None), getattr(optimizer, "loss_scale_config", None))


def engine_state(engine, scheduler) -> dict[str, Any]:
    """The JSON part of the training state DeepSpeed and the scheduler keep."""
    scaler = {}
    for holder in _scaler_holders(engine.optimizer):
        for attr in _SCALER_ATTRS:
            value = getattr(holder, attr, None) if holder is not None else None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                scaler[attr] = value
            elif torch.is_tensor(value) and value.numel() == 1:
                scaler[attr] = value.item()
    return {"lr_scheduler": scheduler.state_dict(), "loss_scaler": scaler,
            "engine": {"global_steps": int(engine.global_steps), "global_samples": int(engine.global_samples),
                       "skipped_steps": int(getattr(engine, "skipped_steps", 0))}}


def choose_checkpoint(run_dir: Path, resume_from: bool | str) -> Path | None:
    """Where a run resumes from, as `resume_from_checkpoint` says: a path (which must verify), the
    newest complete and intact checkpoint of `run_dir` (true), or none (false: earlier checkpoints
    are moved aside, not deleted). Leftovers of interrupted saves are removed first. One process
    only (rank 0): no other writer may be running."""
    if isinstance(resume_from, str):
        found = problems(Path(resume_from))
        if found:
            raise ValueError(f"resume_from_checkpoint={resume_from}: " + "; ".join(found))
        return Path(resume_from)
    remove_partial(run_dir)
    if resume_from:
        return newest_valid(run_dir)
    if complete_checkpoints(run_dir):
        aside = run_dir.with_name(f"{run_dir.name}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(aside)
        log.info("resume_from_checkpoint=false: moved the earlier checkpoints to %s", aside)
    return None


class Checkpointer:
    """Saves every `save_steps` steps into `run_dir` (rotating to `save_total_limit`), optionally in
    a background thread, and finds the checkpoint to resume from. Every method is collective."""

    def __init__(self, run_dir: Path, section: TrainingSettings, topology: Topology, model_config=None):
        """`model_config` (our LlamaConfig or a transformers config), when given, is written as
        config.json into unified checkpoints, so that they load with
        `AutoModelForCausalLM.from_pretrained`."""
        self.run_dir = Path(run_dir)
        self.model_config = model_config
        self.save_steps = section.save_steps
        self.limit = section.save_total_limit
        self.unified = section.unified_checkpoint
        self.async_save = section.async_save
        self.resume_from = section.resume_from_checkpoint
        self.topology = topology
        self.rank = dist.get_rank()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint") if self.async_save else None
        self._pending: PendingSave | None = None
        self.stall_s: list[float] = []  # time the step loop spent in each save call
        self.longest_save_s = 0.0  # the longest time from a save call to its checkpoint being complete

    # -- resume --------------------------------------------------------------------------------
    def find(self) -> StateReader | None:
        """The checkpoint to resume from (`choose_checkpoint`, decided by rank 0), the same on every rank."""
        box = [None]
        if self.rank == 0:
            chosen = choose_checkpoint(self.run_dir, self.resume_from)
            box = [str(chosen) if chosen else None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return None
        log.info("resuming from %s", box[0])
        return StateReader(box[0])

    # -- save ----------------------------------------------------------------------------------
    def due(self, step: int, max_steps: int) -> bool:
        return self.save_steps > 0 and step % self.save_steps == 0 and step < max_steps

    def save(self, step: int, engine, access: OptimizerAccess, names: dict[str, str],
             trainer_state: Callable[[], dict[str, Any]]) -> None:
        """Checkpoint the state after optimizer step `step` (1-based)."""
        start = time.perf_counter()
        self.wait()  # one save in flight at a time
        begun = time.perf_counter()
        part = snapshot(engine, access, names, self.topology, unified=self.unified, optimizer=True)
        gpt2 = self.unified and getattr(self.model_config, "gpt2_blocks", False)
        if gpt2:  # a plain GPT-2 model directory, as the final output; StateReader translates back
            _to_hf_layout(part)
        state = trainer_state() if self.rank == 0 else None
        partial = self.run_dir / f"{checkpoint_name(step)}.partial"
        header = {"format": UNIFIED if self.unified else SHARDED, "step": step,
                  "optimizer_step": access.step_count(), **({"hf_layout": "gpt2"} if gpt2 else {})}
        if self._pool is not None:
            future = self._pool.submit(write_part, partial, part)
        else:
            future = Future()
            try:
                future.set_result(write_part(partial, part))
            except Exception as exc:  # noqa: BLE001 - reported to every rank by _finish
                future.set_exception(exc)
        self._pending = PendingSave(step, partial, future, state, header, begun, part_bytes(part))
        if self._pool is None:
            self._finish()
        self.stall_s.append(time.perf_counter() - start)

    def poll(self) -> None:
        """Finish the pending save if every rank's writer is done (one small all-reduce)."""
        if self._pending is None:
            return
        done = torch.tensor(int(self._pending.future.done()), device=collective_device())
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if int(done):
            start = time.perf_counter()
            self._finish()
            self.stall_s[-1] += time.perf_counter() - start  # the index and rename are part of the stall

    def wait(self) -> None:
        """Block until the pending save, if any, is complete."""
        if self._pending is not None:
            futures_wait([self._pending.future])  # a failed write raises in _finish, on every rank
            self._finish()

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()

    def _finish(self) -> None:
        pending, self._pending = self._pending, None
        step, partial, state, header = pending.step, pending.partial, pending.state, pending.header
        try:
            written = pending.future.result()
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it, or the others would hang
            written = {"rank": self.rank, "error": f"{type(exc).__name__}: {exc}", "disk_full": is_disk_full(exc)}
        written["nbytes"] = pending.nbytes
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, written)
        failed = [p for p in parts if "error" in p]
        if failed:
            if self.rank == 0:  # what was written of it only takes space; resume never reads a .partial
                shutil.rmtree(partial, ignore_errors=True)
            dist.barrier()
            if any(p["disk_full"] for p in failed):
                raise disk_full(self.run_dir / checkpoint_name(step), sum(p["nbytes"] for p in parts))
            raise RuntimeError(f"saving {partial} failed (the previous checkpoint is intact): "
                               + "; ".join(f"rank {p['rank']}: {p['error']}" for p in failed))
        outcome: list[Any] = [None]  # rank 0's error, if finishing the directory fails (it alone writes)
        if self.rank == 0:
            try:
                self._complete(partial, step, header, state, parts)
            except Exception as exc:  # noqa: BLE001 - the other ranks wait for the outcome below
                shutil.rmtree(partial, ignore_errors=True)
                outcome = [(f"{type(exc).__name__}: {exc}", is_disk_full(exc))]
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            error, full = outcome[0]
            if full:
                raise disk_full(self.run_dir / checkpoint_name(step), sum(p["nbytes"] for p in parts))
            raise RuntimeError(f"finishing {partial} failed (the previous checkpoint is intact): {error}")
        self.longest_save_s = max(self.longest_save_s, time.perf_counter() - pending.begun)

    def _complete(self, partial: Path, step: int, header: dict[str, Any], state: dict[str, Any],
                  parts: list[dict[str, Any]]) -> None:
        """Rank 0: the index, trainer state and config into `partial`, then rename it complete."""
        index = build_index(header, parts)
        state = {**state, "optimizer_step": header["optimizer_step"]}
        if self.unified and self.model_config is not None:
            write_config(self.model_config, partial)
        finalize(partial, self.run_dir / checkpoint_name(step), index=index, trainer_state=state,
                 hf_index=self.unified)  # sharded slices do not load with from_pretrained
        prune(self.run_dir, self.limit)
        log.info("saved %s", self.run_dir / checkpoint_name(step))


@dataclass
class PendingSave:
    """A save whose files are being written (in the background with async_save)."""

    step: int
    partial: Path
    future: Future
    state: dict[str, Any] | None  # trainer_state.json (rank 0)
    header: dict[str, Any]
    begun: float  # perf_counter at the save call
    nbytes: int  # this rank's tensors


def part_bytes(part: RankPart) -> int:
    return sum(t.numel() * t.element_size() for tensors in part.files.values() for t in tensors.values())


def build_index(header: dict[str, Any], parts: list[dict[str, Any]]) -> dict[str, Any]:
    """checkpoint_index.json from every rank's `write_part` result: tensor key -> its slices, all files."""
    tensors: dict[str, list[dict[str, Any]]] = {}
    files: list[dict[str, Any]] = []
    for written in parts:
        files += written["files"]
        for key, entry in written["entries"].items():
            tensors.setdefault(key, []).append(entry)
    return {**header, "tensors": tensors, "files": sorted(files, key=lambda r: r["name"])}


def write_final(out_dir: Path, engine, access: OptimizerAccess, names: dict[str, str], topology: Topology, *,
                unified: bool, extra: Callable[[Path], None], gpt2_layout: bool = False) -> None:
    """The trained model (weights only) as an artifact directory, each rank writing its share:
    unified = the Hugging Face layout (an index when several files), sharded = the slices for
    `merge_tp`. Rank 0 adds the rest with `extra(tmp_dir)` and swaps the directory in whole.
    With `gpt2_layout` the unified tensors get GPT-2's names and Conv1D layout
    (`stages.model.gpt2_layout`); the sharded slices keep our names (merge_tp translates)."""
    part = snapshot(engine, access, names, topology, unified=unified, optimizer=False)
    if unified and gpt2_layout:
        _to_hf_layout(part)
    header = {"format": UNIFIED if unified else SHARDED, "step": None,
              **({"hf_layout": "gpt2"} if unified and gpt2_layout else {})}
    rank = dist.get_rank()
    partial = out_dir.parent / f".{out_dir.name}.partial"
    if rank == 0 and partial.exists():
        shutil.rmtree(partial)
    dist.barrier()
    try:
        written = write_part(partial, part)
    except Exception as exc:  # this rank exits; the launcher ends the others
        if is_disk_full(exc):
            shutil.rmtree(partial, ignore_errors=True)
            raise disk_full(out_dir, part_bytes(part), exc, at_least=True) from exc  # this rank's share
        raise
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, written)
    if rank == 0:
        index = build_index(header, parts)
        with atomic_dir(out_dir) as tmp:
            for record in index["files"]:
                (partial / record["name"]).rename(tmp / record["name"])
            write_json(tmp / INDEX, index)
            if unified and [r["name"] for r in index["files"]] != ["model.safetensors"]:
                write_hf_index(tmp, index)
            extra(tmp)
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
