"""Calibrating A8W8 layers (`stages.quant.a8w8`) with SmoothQuant and the shift of Outlier
Suppression+, one decoder block at a time like GPTQ (`stages.quant.gptq`'s driver).

For each decoder block, for each group of Linears sharing one input, in the order the forward calls
them (q/k/v, o, gate/up, down; GPT-2: c_attn, c_proj, c_fc, c_proj), on the calibration rows X
(n, in) of that input:

    shift     z_j = (max_n X_nj + min_n X_nj) / 2            centre of channel j's range
    smooth    s_j = a_j^alpha / m_j^(1 - alpha)              a_j = max_n |X_nj - z_j|, m_j = max over
                                                             the group's weights of |W[:, j]|
                                                             (1 where a_j or m_j is 0)
    weights   W * s quantized per output channel; b + W z is the new bias
    static    sx = max_j a_j / s_j / 127                     the calibration absmax of (X - z) / s

The layers of a group share one z and one s, since they read one tensor. With `smooth_search`,
alpha is chosen per group from `smooth_alpha_grid` by the lowest output MSE of the quantized
layers against the float ones on X (summed over the group). Which groups are smoothed / shifted:
those whose input is the output of a module whose class name contains "Norm" (the attention and
MLP inputs of every pre-norm family), or every group with `smooth_all_linears` /
`shift_all_linears`.

The group's layers are then replaced in the block by simulated `A8W8Linear`s, so later groups
and, through the block's output, later blocks are calibrated on the quantized model's activations.
The calibration rows of one group are held in memory (rows x in_features float32), as the block
inputs are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from stages.quant.a8w8 import QMAX, A8W8Config, A8W8LayerResult, quantize_weight_int8
from stages.quant.block_calibration import (BlockInput, StopForward, forward_batches, linear_inputs_hooks,
                                            quantize_blocks_sequentially, run_block, sequential_groups)
from stages.quant.layers import linear_weight

log = logging.getLogger(__name__)

__all__ = ["A8W8LayerResult", "a8w8_quantize_model", "norm_fed_linears", "quantize_block", "quantize_group",
           "smoothing_scale"]


def smoothing_scale(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s (in,) = act_absmax^alpha / weight_absmax^(1 - alpha), 1 on channels where either is 0
    (a channel that never fires, or that no weight reads, is left as it is)."""
    live = (act_absmax > 0) & (weight_absmax > 0)
    a = torch.where(live, act_absmax, torch.ones_like(act_absmax))
    m = torch.where(live, weight_absmax, torch.ones_like(weight_absmax))
    return torch.where(live, a.pow(alpha) / m.pow(1.0 - alpha), torch.ones_like(a))


@torch.no_grad()
def quantize_group(layers: Mapping[str, nn.Module], x: torch.Tensor, config: A8W8Config, *,
                   smooth: bool, shift: bool) -> dict[str, A8W8LayerResult]:
    """A8W8 of the Linears / Conv1Ds `layers` ({name: float module}), which all read the input whose
    calibration rows are `x` (n, in); see the module docstring for the maths. `smooth` / `shift`:
    whether this group is smoothed / shifted (alpha searched when `config.smooth_search`).
    The modules are not modified; each result's output_mse is measured on `x`."""
    x = x.detach().reshape(-1, x.shape[-1]).float()  # (n, in)
    hi, lo = x.amax(dim=0), x.amin(dim=0)  # (in,)
    z = (hi + lo) / 2 if shift else None
    act_absmax = (hi - lo) / 2 if shift else x.abs().amax(dim=0)  # max |x - z| per channel
    floats = {}
    for name, m in layers.items():
        w = linear_weight(m).detach().float()  # (out, in)
        b = m.bias.detach().float() if getattr(m, "bias", None) is not None else None
        floats[name] = (w, b, x @ w.t() + (b if b is not None else 0.0))  # (out, in), (out,), (n, out)
    weight_absmax = torch.cat([w for w, _, _ in floats.values()]).abs().amax(dim=0)  # (in,)

    if not smooth:
        alphas: Sequence[float | None] = (None,)
    else:
        alphas = config.smooth_alpha_grid if config.smooth_search else (config.smooth_alpha,)
    best: tuple[float, dict[str, A8W8LayerResult]] | None = None
    for alpha in alphas:
        s = smoothing_scale(act_absmax, weight_absmax, alpha) if alpha is not None else None
        input_scale = None
        if config.activation == "static":
            amax = (act_absmax / s if s is not None else act_absmax).max()
            input_scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))  # ()
        results, sq_err, count = {}, 0.0, 0
        for name, (w, b, y_float) in floats.items():
            q, sw = quantize_weight_int8(w * s if s is not None else w)
            bias = b
            if z is not None:
                bias = (b if b is not None else 0.0) + w @ z  # y = W (x - z) + (b + W z)
            r = A8W8LayerResult(weight=q, weight_scale=sw, input_scale=input_scale, smooth_scale=s,
                                input_shift=z, bias=bias, alpha=alpha)
            err = (r.module(simulate=True)(x) - y_float).pow(2)  # (n, out)
            r.output_mse = float(err.mean())
            sq_err, count = sq_err + float(err.sum()), count + err.numel()
            results[name] = r
        total = sq_err / count
        if len(alphas) > 1:
            log.debug("alpha %.2f: output MSE %.4g (%s)", alpha, total, ", ".join(layers))
        if best is None or total < best[0]:
            best = (total, results)
    return best[1]


def norm_fed_linears(block: nn.Module, inp: BlockInput) -> set[str]:
    """Names of the block's Linears / Conv1Ds whose input tensor is the output of a submodule whose
    class name contains "Norm" (RMSNorm, LayerNorm, ...): the attention and MLP inputs."""
    norm_outputs: list[torch.Tensor] = []  # kept alive so no tensor's identity is reused
    linear_inputs: list[tuple[str, torch.Tensor]] = []
    hooks = [m.register_forward_hook(lambda mod, args, out: norm_outputs.append(out))
             for m in block.modules() if "Norm" in type(m).__name__]
    forward_batches(block, [inp], hooks + linear_inputs_hooks(block, linear_inputs))
    return {name for name, x in linear_inputs if any(x is out for out in norm_outputs)}


def _group_inputs(block: nn.Module, first: nn.Module, inputs: Sequence[BlockInput]) -> torch.Tensor:
    """The rows (n, in) that `first` (a submodule of `block`) receives over all `inputs`; each
    forward stops as soon as it has them."""
    rows: list[torch.Tensor] = []

    def grab(mod, args, out):
        rows.append(args[0].detach().reshape(-1, args[0].shape[-1]).float())
        raise StopForward

    forward_batches(block, inputs, [first.register_forward_hook(grab)])
    return torch.cat(rows) if rows else torch.empty(0)


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


@torch.no_grad()
def quantize_block(block: nn.Module, inputs: Sequence[BlockInput], config: A8W8Config,
                   prefix: str = "") -> dict[str, A8W8LayerResult]:
    """A8W8 of every Linear / Conv1D of one decoder block, group by group in call order, each
    replaced in `block` by a simulated `A8W8Linear` before the next group is calibrated. Returns
    {f"{prefix}.{name}": result} in quantization order."""
    groups = sequential_groups(block, inputs[0])
    fed = norm_fed_linears(block, inputs[0])
    modules = dict(block.named_modules())
    dot = f"{prefix}." if prefix else ""
    results: dict[str, A8W8LayerResult] = {}
    for group in groups:
        x = _group_inputs(block, modules[group[0]], inputs)  # (n, in)
        if x.numel() == 0:
            raise ValueError(f"{dot}{group[0]} received no calibration input")
        reads_norm = group[0] in fed
        smooth = config.smooth and (config.smooth_all_linears or reads_norm)
        shift = config.shift and (config.shift_all_linears or reads_norm)
        group_results = quantize_group({name: modules[name] for name in group}, x, config, smooth=smooth,
                                       shift=shift)
        for name, r in group_results.items():
            _set_submodule(block, name, r.module(simulate=True))
            results[f"{dot}{name}"] = r
            log.debug("%s%s: alpha %s, shift %s, output MSE %.4g", dot, name, r.alpha, shift, r.output_mse)
    return results


@torch.no_grad()
def a8w8_quantize_model(
    model: nn.Module, blocks: nn.ModuleList | nn.ModuleDict | Mapping[str, nn.Module],
    calibration: Iterable[torch.Tensor], config: A8W8Config, prefix: str = "",
    on_block: Callable[[str, float, dict[str, A8W8LayerResult]], None] | None = None,
    forward_dtype: torch.dtype | None = None,
) -> dict[str, A8W8LayerResult]:
    """A8W8 of every Linear / Conv1D of `blocks` (the decoder blocks of `model`, in order), block by
    block, calibrated on `calibration` (input_ids batches (B, T), unpadded), as
    `stages.quant.gptq.gptq_quantize_model` does GPTQ: each block sees the previous blocks'
    quantized outputs.

    The layers are replaced in `model` by simulated `A8W8Linear`s (the float modules are dropped,
    their tensors untouched, so a state dict taken before still holds the float weights for
    `stages.quant.a8w8.pack_a8w8`). Result names are f"{prefix}.{block key}.{submodule}", the
    checkpoint names when `prefix` is the blocks' path. `on_block(key, seconds, block_results)` is
    called after each block; the calibration forwards run in `forward_dtype` (None: float32).
    """
    def step(block: nn.Module, inputs: list[BlockInput], names: str):
        block_results = quantize_block(block, inputs, config, prefix=names)
        return block_results, [run_block(block, inp) for inp in inputs]

    def summary(block_results: dict[str, A8W8LayerResult]) -> str:
        alphas = sorted({r.alpha for r in block_results.values() if r.alpha is not None})
        mse = sum(r.output_mse for r in block_results.values()) / len(block_results)
        return f"mean output MSE {mse:.4g}, alpha {alphas or '-'}"

    return quantize_blocks_sequentially(model, blocks, calibration, step, summary, desc="A8W8", prefix=prefix,
                                        on_block=on_block, forward_dtype=forward_dtype)
