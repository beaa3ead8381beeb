"""Checkpoints of a single-process training loop (LoRA and prefix tuning) in the engine's format.

The same on-disk layout as `stages.training.checkpointing` writes with one unified rank, so
`StateReader`, `problems` / `newest_valid` and `prune` work unchanged:

- `model.safetensors`: the trainable parameters under their peft names (what
  `model.named_parameters()` calls them), fp32;
- `optimizer.safetensors`: Adam's `<name>.exp_avg` / `<name>.exp_avg_sq`; Adam's step count is the
  index's (and trainer state's) `optimizer_step`;
- `rng_state_0.safetensors`: torch, numpy and python RNG states (LoRA dropout draws from them);
- `trainer_state.json`: whatever the loop hands over (step, losses, train log rows, ...) plus the LR
  scheduler's `state_dict()`;
- `checkpoint_index.json`, then `checkpoint_complete.json` via `store.finalize`.

Saves are synchronous, whatever `async_save` says: the tensors are the adapter's (a few MB at most)
and the write takes milliseconds, so a background thread would buy nothing. No torch.distributed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from stages.checkpoint.store import (
    OPTIMIZER_KEYS,
    UNIFIED,
    StateReader,
    checkpoint_name,
    finalize,
    optimizer_key,
    prune,
)
from stages.training.checkpointing import (
    RankPart,
    adam_step_count,
    add_rng_state,
    build_index,
    choose_checkpoint,
    restore_rng,
    restore_scheduler,
    write_part,
)

log = logging.getLogger(__name__)

MODEL_FILE, OPTIMIZER_FILE = "model.safetensors", "optimizer.safetensors"


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters the optimizer updates, by name (peft names for an adapter model)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


class LocalCheckpointer:
    """Saves every `save_steps` optimizer steps into `run_dir` (keeping `save_total_limit`) and finds
    the checkpoint to resume from, as the section's `resume_from_checkpoint` says."""

    def __init__(self, run_dir: str | Path, section: dict[str, Any]):
        self.run_dir = Path(run_dir)
        self.save_steps = int(section.get("save_steps", 0))
        self.limit = int(section.get("save_total_limit", 0))
        self.resume_from = section.get("resume_from_checkpoint", True)

    def find(self) -> StateReader | None:
        """The checkpoint to resume from (`stages.training.checkpointing.choose_checkpoint`)."""
        chosen = choose_checkpoint(self.run_dir, self.resume_from)
        return StateReader(chosen) if chosen is not None else None

    def due(self, step: int, max_steps: int) -> bool:
        """Whether to save after optimizer step `step` (1-based); never after the last one, whose
        result is the stage's output."""
        return self.save_steps > 0 and step % self.save_steps == 0 and step < max_steps

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler, trainer_state: dict[str, Any]) -> Path:
        """Write the state after optimizer step `step` as `run_dir/checkpoint-<step>`, then rotate."""
        part = RankPart(0)
        for name, param in trainable_parameters(model).items():
            part.add(MODEL_FILE, name, param.detach().float())
            state = optimizer.state.get(param, {})
            for key in OPTIMIZER_KEYS:
                moment = state[key] if key in state else torch.zeros_like(param, dtype=torch.float32)
                part.add(OPTIMIZER_FILE, optimizer_key(name, key), moment.detach().float())
        add_rng_state(part, 0)
        partial = self.run_dir / f"{checkpoint_name(step)}.partial"
        n_updates = adam_step_count(optimizer)
        index = build_index({"format": UNIFIED, "step": step, "optimizer_step": n_updates}, [write_part(partial, part)])
        state = {**trainer_state, "global_step": step, "optimizer_step": n_updates,
                 "lr_scheduler": scheduler.state_dict()}
        # No HF weight map: peft names do not load as a model; the adapter artifact is the output.
        final = self.run_dir / checkpoint_name(step)
        finalize(partial, final, index=index, trainer_state=state, hf_index=False)
        prune(self.run_dir, self.limit)
        log.info("saved %s", final)
        return final


def restore(reader: StateReader, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    """Load the trainable parameters, Adam's state, the LR scheduler and the RNG states of a
    checkpoint written by `LocalCheckpointer.save`; returns its trainer state."""
    state = reader.trainer_state
    params = trainable_parameters(model)
    missing = sorted(set(params) - set(reader.keys("model")))
    if missing:
        raise ValueError(f"{reader.path} lacks trainable parameters {missing[:3]} (of {len(missing)}); "
                         "it was written for another model or adapter configuration")
    n_updates = torch.tensor(float(state["optimizer_step"]), dtype=torch.float32)  # as torch's Adam keeps it
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(reader.get(name))
            # Adam's state as its first update would have created it, then the saved values
            optimizer.state[param] = {"step": n_updates.clone(), **{
                key: reader.get(optimizer_key(name, key)).to(param.dtype).clone() for key in OPTIMIZER_KEYS}}
    restore_scheduler(scheduler, state)
    restore_rng(reader, 0)
    return state
