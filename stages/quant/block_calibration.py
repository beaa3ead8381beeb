"""The block-by-block calibration driver of GPTQ, AWQ and A8W8 (SmoothQuant): the first decoder
block's inputs are captured from the calibration batches, then each block is quantized on the
outputs of the already-quantized blocks before it (`quantize_blocks_sequentially`).

The calibration forwards (`forward_batches`, `run_block`) run in the driver's `forward_dtype`:
bfloat16 autocast (the Linears' and attention's products in bf16, 2-3x faster than float32 on a
CPU with AVX512-BF16 or AMX), the weights, the residual stream between blocks and whatever the
methods compute from what their hooks record (Hessians, second moments, absolute maxima) staying
float32. GPTQ and AWQ solve on the float32 weights; only the activations they read are rounded."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext, suppress
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from stages.quant.layers import quantizable
from stages.stage_logs import Progress

log = logging.getLogger(__name__)


@dataclass
class BlockInput:
    """One calibration batch as a decoder block receives it: the hidden states (B, T, d) and the
    other arguments of its forward (our Llama: cos, sin; transformers: position_embeddings,
    attention_mask, ... as keywords)."""

    hidden: torch.Tensor
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


class StopForward(Exception):
    """Raised from a hook to end a forward pass once the inputs it wanted are recorded."""


class GPTQHessian:
    """H = 2 X^T X / n over every calibration row x (in,) seen by one linear layer (GPTQ's Hessian;
    AWQ scores its candidates on H / 2, the rows' second moment), kept as a running
    mean in float32 so batches of any size (and count) can be added. The rows are the layer's inputs:
    (..., in) is flattened to (n, in), e.g. (batch, seq, in) gives batch * seq rows. A Conv1D's input
    is (..., in) too; only its weight is transposed, which the caller handles."""

    def __init__(self, in_features: int, device: torch.device | str | None = None):
        self.in_features = in_features
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.num_rows = 0

    @torch.no_grad()
    def add_batch(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"calibration input of shape {tuple(x.shape)} does not end in "
                             f"in_features={self.in_features}")
        rows = x.detach().reshape(-1, self.in_features).to(self.hessian.device, torch.float32)  # (n, in)
        n = rows.shape[0]
        if n == 0:
            return
        total = self.num_rows + n
        self.hessian.mul_(self.num_rows / total)
        self.hessian.addmm_(rows.t(), rows, alpha=2.0 / total)
        self.num_rows = total


FORWARD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_FORWARD_DTYPE: ContextVar[torch.dtype] = ContextVar("calibration_forward_dtype", default=torch.float32)


@contextmanager
def forward_precision(dtype: torch.dtype | None) -> Iterator[None]:
    """The calibration forwards inside run in `dtype` (None: float32); see the module docstring."""
    token = _FORWARD_DTYPE.set(torch.float32 if dtype is None else dtype)
    try:
        yield
    finally:
        _FORWARD_DTYPE.reset(token)


def _autocast(module: nn.Module):
    dtype = _FORWARD_DTYPE.get()
    if dtype == torch.float32:
        return nullcontext()
    device = next(module.parameters()).device.type
    return torch.autocast(device, dtype=dtype)


def run_block(block: nn.Module, inp: BlockInput) -> torch.Tensor:
    """The block's output hidden states (B, T, d) on one captured batch, float32."""
    with _autocast(block):
        out = block(inp.hidden, *inp.args, **inp.kwargs)
    out = out[0] if isinstance(out, tuple) else out  # transformers 4 blocks return a tuple
    return out.float()


def forward_batches(block: nn.Module, inputs: Iterable[BlockInput], hooks: list,
                    before_batch: Callable[[], None] | None = None) -> None:
    """The block's forward on each captured batch, without gradients, for what the forward hooks
    `hooks` (their handles) record; a hook ends a forward early by raising StopForward once it has
    what it needs. `before_batch()` runs before each batch. The hooks are removed afterwards,
    whatever happens."""
    try:
        with torch.no_grad(), _autocast(block):
            for inp in inputs:
                if before_batch is not None:
                    before_batch()
                with suppress(StopForward):
                    run_block(block, inp)
    finally:
        for h in hooks:
            h.remove()


class FinishedOutputs:
    """Reuse of a block's finished parts across true-sequential passes. Each pass runs the block's
    forward on every calibration batch; once every Linear of a direct child of the block (its
    attention, say) is quantized and every Linear the forward calls before it is too, the child's
    inputs and weights are final, so its output is the same in every later pass. The first pass
    after that records it per batch; the passes after read it back (a copy, so in-place use
    downstream cannot change it) instead of computing it again. With the call order q/k/v, o,
    gate/up, down this computes the attention twice per batch instead of four times. The outputs are
    the same bits as recomputed ones: the forward is deterministic on the same inputs.

    `call_order`: the block's Linear / Conv1D names in the order its forward calls them.
    `finish(names)` after each group is quantized; `batches(inputs)` wraps a pass (the batch index
    follows the inputs); `close()` restores the children's forwards."""

    def __init__(self, block: nn.Module, call_order: list[str]):
        self._call_order = list(call_order)
        position = {name: k for k, name in enumerate(call_order)}
        self._children: dict[str, tuple[nn.Module, int]] = {}  # child -> (module, position of its last Linear)
        for child_name, child in block.named_children():
            names = [f"{child_name}.{n}" for n, m in child.named_modules() if quantizable(m)]
            if names and all(n in position for n in names):
                self._children[child_name] = (child, max(position[n] for n in names))
        self._quantized: set[str] = set()
        self._outputs: dict[str, list[Any]] = {}  # finished child -> its output per batch
        self._patched: list[nn.Module] = []
        self._batch = -1

    def finish(self, names: Iterable[str]) -> None:
        """`names` are quantized: a child is finished once every Linear up to its last one is."""
        self._quantized.update(names)
        for child_name, (_, last) in self._children.items():
            if child_name not in self._outputs and self._quantized.issuperset(self._call_order[:last + 1]):
                self._outputs[child_name] = []

    def batches(self, inputs: list[BlockInput], record: bool = True) -> Iterator[BlockInput]:
        """`inputs` one by one, with the finished children replaying their outputs, and recording
        them where not recorded yet unless `record` is False (the last pass: nothing reads them)."""
        hooks = []
        for child_name, outputs in self._outputs.items():
            child = self._children[child_name][0]
            if outputs:  # recorded in an earlier pass: replay
                if "forward" not in vars(child):
                    child.forward = lambda *args, _outputs=outputs, **kwargs: _copy(_outputs[self._batch])
                    self._patched.append(child)
            elif record:
                hooks.append(child.register_forward_hook(
                    lambda mod, args, out, _outputs=outputs: _outputs.append(_copy(out))))
        try:
            for self._batch, inp in enumerate(inputs):
                yield inp
        finally:
            for h in hooks:
                h.remove()
            for outputs in self._outputs.values():
                if outputs and len(outputs) != len(inputs):  # a pass ended early: record again next time
                    outputs.clear()

    def close(self) -> None:
        for child in self._patched:
            del child.forward
        self._patched.clear()
        self._outputs.clear()


def _copy(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple):
        return tuple(_copy(x) for x in out)
    return out


def linear_inputs_hooks(block: nn.Module, calls: list[tuple[str, torch.Tensor]]) -> list:
    """Forward hooks appending (name, input) to `calls` for each Linear / Conv1D the block calls."""
    return [m.register_forward_hook(lambda mod, args, out, name=name: calls.append((name, args[0])))
            for name, m in block.named_modules() if quantizable(m)]


def sequential_groups(block: nn.Module, inp: BlockInput) -> list[list[str]]:
    """The block's Linear / Conv1D names in the order its forward calls them, grouped by shared
    input: consecutive layers fed the same tensor (q/k/v, gate/up) form one group."""
    calls: list[tuple[str, torch.Tensor]] = []
    forward_batches(block, [inp], linear_inputs_hooks(block, calls))
    groups: list[list[str]] = []
    for k, (name, x) in enumerate(calls):  # `calls` keeps every input alive: no storage is reused
        if k and x is calls[k - 1][1]:
            groups[-1].append(name)
        else:
            groups.append([name])
    return groups


def capture_block_inputs(model: nn.Module, first_block: nn.Module,
                         calibration: Iterable[torch.Tensor]) -> list[BlockInput]:
    """Run `model(input_ids)` for each calibration batch up to the first block and keep that
    block's arguments. A KV cache is dropped: calibration runs the blocks repeatedly."""
    captured: list[BlockInput] = []

    def grab(mod, args, kwargs):
        kwargs = dict(kwargs)
        if args:
            hidden, args = args[0], tuple(args[1:])
        else:
            hidden = kwargs.pop("hidden_states")
        if "past_key_values" in kwargs:
            kwargs["past_key_values"] = None
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        captured.append(BlockInput(hidden=hidden, args=args, kwargs=kwargs))
        raise StopForward

    hook = first_block.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for ids in calibration:
            with suppress(StopForward):
                model(ids)
    finally:
        hook.remove()
    return captured


@torch.no_grad()
def quantize_blocks_sequentially(
    model: nn.Module, blocks: nn.ModuleList | nn.ModuleDict | Mapping[str, nn.Module],
    calibration: Iterable[torch.Tensor],
    step: Callable[[nn.Module, list[BlockInput], str], tuple[dict[str, Any], list[torch.Tensor]]],
    summary: Callable[[dict[str, Any]], str], *, desc: str, prefix: str = "",
    on_block: Callable[[str, float, dict[str, Any]], None] | None = None,
    forward_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """The block-by-block calibration loop of GPTQ, AWQ and A8W8: the first block's inputs are
    captured from `calibration`, then each block is quantized by `step(block, inputs, names_prefix)`,
    which returns its layers' results and the block's outputs on those inputs, the next block's
    inputs (so each block sees the previous blocks quantized). `on_block(key, seconds, results)`
    after each block; `summary(results)` ends its log line. The calibration forwards run in
    `forward_dtype` (None: float32; see the module docstring). The model is left in its training
    mode."""
    named = list(blocks.items()) if isinstance(blocks, (nn.ModuleDict, Mapping)) else \
        [(str(i), b) for i, b in enumerate(blocks)]
    if not named:
        raise ValueError("no decoder blocks were given to quantize")
    was_training = model.training
    model.eval()
    inputs = capture_block_inputs(model, named[0][1], calibration)
    if not inputs:
        raise ValueError("the calibration set is empty")
    results: dict[str, Any] = {}
    dot = f"{prefix}." if prefix else ""
    progress = Progress(log, f"{desc} blocks", len(named), lines=len(named), min_interval_s=0)  # every block
    for key, block in named:
        start = time.perf_counter()
        with forward_precision(forward_dtype):
            block_results, outputs = step(block, inputs, f"{dot}{key}")
        if on_block is not None:
            on_block(key, time.perf_counter() - start, block_results)
        results.update(block_results)
        inputs = [replace(inp, hidden=out) for inp, out in zip(inputs, outputs)]
        progress.advance(detail=f"block {key}: {len(block_results)} layers, {summary(block_results)}")
    model.train(was_training)
    return results
