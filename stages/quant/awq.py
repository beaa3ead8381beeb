"""AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration"): weight-only quantization that first scales up the input channels that carry large
activations, so their weights lose less to rounding, and then rounds to nearest.

For layers y = x W^T reading one input x (n, in), a per-input-channel scale s (in,) leaves the
float outputs unchanged, y = (x / s) (W diag(s))^T, but not the quantized ones: AWQ picks s to
minimise the output error of the quantized layers on calibration inputs,

    s(r)  = mean_n |x_nj|^r / w_j^(1 - r)     w_j: mean over rows of |W_oj| / max_{k in j's group} |W_ok|
    error = sum over the layers || x W^T - (x / s) Q(W diag(s))^T ||^2 / (n out)
    r     in {0, 1/n_grid, ..., (n_grid - 1) / n_grid}, and s = 1 (plain RTN) as one more candidate

(s normalised by sqrt(max s * min s); AutoAWQ's "duo scaling"; `duo_scaling: false` drops the
weight term, as the paper's search does). Dividing by s is folded into what produces x, exactly, as
SmoothQuant's export folds (`stages.quant.scale_folds`): the norm before q/k/v and gate/up
(g' = g / s), v_proj's rows for o_proj (with grouped-query attention s is tied over the heads that
read one v row: the mean of the heads' s), up_proj's rows for down_proj (GLM: the up half of
gate_up_proj). Then each layer's weights are clipped per (row, group) to the magnitude among
{1, 1 - 1/n_grid, ..., 1 - max_shrink} of the group's maximum that gives the lowest error of the
group's share of the outputs (q/k are not clipped: attention scores amplify their error, AutoAWQ's
rule), and rounded to nearest on the groups' grid (`stages.quant.rtn`).

Both errors are quadratic forms of D = W - Q(W diag(s)) / s in the inputs' second moment
G = X^T X / n (in, in), error = sum(D G * D) / out, and a group's share d_g^T G_gg d_g, so the
calibration rows are read once per block into G and mean |x| (no rows are kept), every candidate
is scored on all of them, and the cost does not grow with the calibration set (AutoAWQ scores its
clips on 512 sampled tokens, a GPU-memory compromise).

Families whose norms compute g * x_hat with these layer names (`scale_folds.FOLD_FAMILIES`) are
scaled; the others (GPT-2, transformers-only families) get the clipping and RTN only, said in the
log. Blocks are quantized one after another on the driver GPTQ and A8W8 share
(`stages.quant.block_calibration`): a block's inputs are the outputs of the blocks before it,
quantized. Inside a block every search reads the float block's inputs (the scalings before it
change no float output), as AutoAWQ does.

The result is round-to-nearest codes of the scaled weights plus the folded norms and producers, so
it is written in the GPTQ layout (`gptq_v2` for the default asymmetric grid) that GPTQModel,
transformers and our int4 kernels read, like `wint4`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stages.quant.block_calibration import (BlockInput, GPTQHessian, StopForward, forward_batches,
                                            quantize_blocks_sequentially, run_block, sequential_groups)
from stages.quant.layers import linear_weight
from stages.quant.rtn import QuantizedWeight, dequantize_weight, quantize_weight, relative_error
from stages.quant.scale_folds import FOLD_FAMILIES, fold_tables

log = logging.getLogger(__name__)

KEY = "quantize.awq"
UNCLIPPED = ("q_proj", "k_proj")  # leaves whose weights keep their range (AutoAWQ: queries and keys)


@dataclass(frozen=True)
class AWQConfig:
    """AWQ options (`quantize.awq`); defaults are the schema's (AutoAWQ's)."""

    bits: int = 4
    group_size: int = 128
    sym: bool = False  # AutoAWQ's zero point: asymmetric
    n_grid: int = 20  # scale exponents r = i / n_grid; clip ratios 1 - i / n_grid
    duo_scaling: bool = True  # s = x^r / w^(1-r); false: s = x^r
    clip: bool = True
    max_shrink: float = 0.5  # the smallest clip ratio tried is 1 - max_shrink

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"{KEY}.bits={self.bits}: AWQ writes round-to-nearest codes of 4 or 8 bits")
        if self.group_size == 0 or self.group_size < -1:
            raise ValueError(f"{KEY}.group_size={self.group_size} must be positive or -1 (per channel)")
        if self.n_grid < 1:
            raise ValueError(f"{KEY}.n_grid={self.n_grid} must be at least 1 (20 is AutoAWQ's)")
        if not 0.0 <= self.max_shrink < 1.0:
            raise ValueError(f"{KEY}.max_shrink={self.max_shrink} must lie in [0, 1) (0.5 is AutoAWQ's)")


@dataclass
class AWQLayerResult:
    """One layer's AWQ: its codes (of the scaled, clipped weight), the scale its input channels got
    (None: not scaled), the chosen exponent r (None: s = 1 won or no scaling), and the group's
    calibration output error at the chosen s and with s = 1 (both before clipping)."""

    quantized: QuantizedWeight
    scale: torch.Tensor | None
    ratio: float | None
    error: float
    rtn_error: float
    weight_error: float  # ||W_s - W_hat||_F / ||W_s||_F of the scaled weight W_s (clipping included)


def pseudo_quantize(w: torch.Tensor, config: AWQConfig) -> torch.Tensor:
    """Q(w) dequantized: round-to-nearest on the groups' grid, as it will be stored."""
    return dequantize_weight(quantize_weight(w, config.bits, config.group_size, sym=config.sym))


def _weight_mean(weights: Sequence[torch.Tensor], group_size: int) -> torch.Tensor:
    """w_j (in,): each weight's |W| relative to its (row, group) maximum, averaged over every row."""
    w = torch.cat(list(weights)).float()
    in_f = w.shape[1]
    gs = in_f if group_size == -1 else group_size
    g = w.abs().reshape(-1, gs)
    g = g / g.amax(dim=1, keepdim=True).clamp(min=1e-12)
    return g.reshape(-1, in_f).mean(dim=0)


class InputStatistics:
    """What AWQ needs of one input's calibration rows x (n, in): G = X^T X / n (GPTQ's Hessian
    halved) and mean |x_j|."""

    def __init__(self, width: int):
        self.hessian = GPTQHessian(width)
        self.abs_sum = torch.zeros(width)

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        self.hessian.add_batch(x)
        self.abs_sum += x.detach().reshape(-1, self.abs_sum.shape[0]).float().abs().sum(dim=0)

    @property
    def second_moment(self) -> torch.Tensor:
        return self.hessian.hessian / 2

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.hessian.num_rows, 1)


def output_error(weights: Sequence[torch.Tensor], moment: torch.Tensor, s: torch.Tensor | None,
                 config: AWQConfig) -> float:
    """Mean squared difference, over the calibration rows and every output of the layers `weights`
    (out_i, in), between the float layers and the quantized ones with input scale `s` (None: s = 1):
    x W^T against (x / s) Q(W diag(s))^T, from the inputs' second moment `moment` (in, in)."""
    total, count = 0.0, 0
    for w in weights:
        w = w.float()
        q = pseudo_quantize(w, config) if s is None else pseudo_quantize(w * s, config) / s
        d = w - q
        total += float(((d @ moment) * d).sum())
        count += w.shape[0]
    return total / count


def search_scale(weights: Sequence[torch.Tensor], moment: torch.Tensor, x_mean: torch.Tensor, config: AWQConfig,
                 tie: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 ) -> tuple[torch.Tensor | None, float | None, float, float]:
    """(s, r, error at s, error at s = 1) for the layers `weights` (out_i, in) reading an input of
    second moment `moment` (in, in) and channel means of |x| `x_mean` (in,); s and r None when s = 1
    wins. `tie(s)` makes s foldable (equal over a GQA group). See the module docstring."""
    w_mean = _weight_mean(weights, config.group_size)
    rtn_error = output_error(weights, moment, None, config)
    best: tuple[float, torch.Tensor | None, float | None] = (rtn_error, None, None)
    for i in range(config.n_grid):
        r = i / config.n_grid
        s = x_mean.pow(r) / w_mean.pow(1 - r) if config.duo_scaling else x_mean.pow(r)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        if tie is not None:
            s = tie(s)
        if not torch.isfinite(s).all():
            continue
        error = output_error(weights, moment, s, config)
        if error < best[0]:
            best = (error, s, r)
    return best[1], best[2], best[0], rtn_error


@torch.no_grad()
def search_clip(w: torch.Tensor, moment: torch.Tensor, config: AWQConfig) -> torch.Tensor:
    """max_val (out, groups): the clip of each (row, group) of `w` (out, in) whose quantized share of
    the outputs is closest to the float one on inputs of second moment `moment` (in, in), among the
    group's max |w| times 1, 1 - 1/n_grid, ..., down to 1 - max_shrink."""
    out_f, in_f = w.shape
    gs = in_f if config.group_size == -1 else config.group_size
    n_groups = in_f // gs
    blocks = moment.reshape(n_groups, gs, n_groups, gs).diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # (G, gs, gs)
    wg = w.float().reshape(out_f, n_groups, gs)
    org_max = wg.abs().amax(dim=-1)  # (out, G)
    best_err = torch.full_like(org_max, float("inf"))
    chosen = org_max.clone()
    for i in range(max(1, int(config.max_shrink * config.n_grid))):
        max_val = org_max * (1 - i / config.n_grid)
        cur = torch.maximum(torch.minimum(wg, max_val[..., None]), -max_val[..., None])
        d = wg - pseudo_quantize(cur.reshape(out_f, in_f), config).reshape(out_f, n_groups, gs)
        err = torch.einsum("ogk,gkl,ogl->og", d, blocks, d)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        chosen = torch.where(better, max_val, chosen)
    return chosen


def _group_statistics(block: nn.Module, groups: list[list[str]], inputs: Sequence[BlockInput]
                      ) -> dict[str, InputStatistics]:
    """{first layer of each group: the statistics of its input} over every calibration batch, from
    one pass of the float block."""
    modules = dict(block.named_modules())
    stats = {g[0]: InputStatistics(linear_weight(modules[g[0]]).shape[1]) for g in groups}
    last = groups[-1][0]

    def grab(mod, args, out, name):
        stats[name].add(args[0])
        if name == last:
            raise StopForward

    hooks = [modules[g[0]].register_forward_hook(lambda mod, args, out, name=g[0]: grab(mod, args, out, name))
             for g in groups]
    forward_batches(block, inputs, hooks)
    return stats


@dataclass
class _Fold:
    """Where a group's 1 / s goes: a norm's weight (and bias), or rows [start, stop) of a producer
    Linear's weight (and bias); `tie` makes s foldable into those rows."""

    module: nn.Module
    rows: slice | None = None
    tie: Callable[[torch.Tensor], torch.Tensor] | None = None
    row_scale: Callable[[torch.Tensor], torch.Tensor] | None = None

    def apply(self, s: torch.Tensor) -> None:
        if self.rows is None:
            for p in (self.module.weight, getattr(self.module, "bias", None)):
                if p is not None:
                    p.copy_((p.float() / s).to(p.dtype))
            return
        c = self.row_scale(s) if self.row_scale is not None else s
        w = self.module.weight  # (out, in): a Linear's rows are its outputs
        w[self.rows] = (w[self.rows].float() / c[:, None]).to(w.dtype)
        bias = getattr(self.module, "bias", None)
        if bias is not None:
            bias[self.rows] = (bias[self.rows].float() / c).to(bias.dtype)


def _head_tie(heads: int, kv_heads: int) -> tuple[Callable, Callable] | tuple[None, None]:
    """(tie, row_scale) for o_proj under grouped-query attention: s averaged over the heads reading
    one v row, and that s per v row; (None, None) without GQA (s folds as is)."""
    if kv_heads == heads:
        return None, None
    rep = heads // kv_heads

    def tie(s: torch.Tensor) -> torch.Tensor:
        grouped = s.reshape(kv_heads, rep, -1)
        return grouped.mean(dim=1, keepdim=True).expand_as(grouped).reshape(-1)

    def row_scale(s: torch.Tensor) -> torch.Tensor:
        return s.reshape(kv_heads, rep, -1)[:, 0].reshape(-1)

    return tie, row_scale


def block_folds(block: nn.Module, groups: list[list[str]], model_type: str | None,
                heads: int, kv_heads: int) -> dict[str, _Fold]:
    """{first layer of a group: where its scale folds} for the groups of `block` that can be
    scaled (see the module docstring); the others are missing."""
    if model_type not in FOLD_FAMILIES:
        return {}
    norms, producers = fold_tables(model_type)
    modules = dict(block.named_modules())
    folds: dict[str, _Fold] = {}
    for group in groups:
        norm = next((n for n, consumers in norms.items() if set(consumers) == set(group)), None)
        if norm is not None and norm in modules:
            folds[group[0]] = _Fold(modules[norm])
        elif len(group) == 1 and group[0] in producers and producers[group[0]][0] in modules:
            producer, index, count = producers[group[0]]
            width = linear_weight(modules[group[0]]).shape[1]
            tie, row_scale = _head_tie(heads, kv_heads) if group[0].endswith("o_proj") else (None, None)
            rows_width = width if row_scale is None else width // (heads // kv_heads)
            if linear_weight(modules[producer]).shape[0] != count * rows_width:
                continue  # a producer of another shape: not foldable, clipping and RTN only
            folds[group[0]] = _Fold(modules[producer], slice(index * rows_width, (index + 1) * rows_width),
                                    tie, row_scale)
    return folds


@torch.no_grad()
def quantize_block(block: nn.Module, inputs: Sequence[BlockInput], config: AWQConfig, *, model_type: str | None,
                   heads: int, kv_heads: int, prefix: str = "") -> dict[str, AWQLayerResult]:
    """AWQ of every Linear of one decoder block: scales searched and folded group by group, then
    every layer clipped and quantized, its dequantized weight written into `block`. Returns
    {f"{prefix}.{name}": result}; the folded norms and producers are changed in `block`."""
    groups = sequential_groups(block, inputs[0])
    modules = dict(block.named_modules())
    dot = f"{prefix}." if prefix else ""
    stats = _group_statistics(block, groups, inputs)
    folds = block_folds(block, groups, model_type, heads, kv_heads)
    scaled: dict[str, tuple[torch.Tensor | None, float | None, float, float]] = {}
    for group in groups:
        moment = stats[group[0]].second_moment
        fold = folds.get(group[0])
        weights = [linear_weight(modules[name]) for name in group]
        if fold is None:
            error = output_error(weights, moment, None, config)
            scaled[group[0]] = (None, None, error, error)
            continue
        s, r, error, rtn_error = search_scale(weights, moment, stats[group[0]].mean_abs, config, fold.tie)
        scaled[group[0]] = (s, r, error, rtn_error)
        if s is not None:
            fold.apply(s)
            for name in group:
                w = linear_weight(modules[name])
                w.copy_((w.float() * s).to(w.dtype))
    results: dict[str, AWQLayerResult] = {}
    for group in groups:
        s, r, error, rtn_error = scaled[group[0]]
        moment = stats[group[0]].second_moment
        if s is not None:  # the layers now read x / s
            moment = moment / torch.outer(s, s)
        for name in group:
            w = linear_weight(modules[name])
            wf = w.float()
            if config.clip and name.rpartition(".")[2] not in UNCLIPPED:
                max_val = search_clip(wf, moment, config)
                gs = wf.shape[1] if config.group_size == -1 else config.group_size
                bound = max_val.repeat_interleave(gs, dim=1)
                wf = torch.maximum(torch.minimum(wf, bound), -bound)
            q = quantize_weight(wf, config.bits, config.group_size, name=f"{dot}{name}", sym=config.sym)
            deq = dequantize_weight(q)
            results[f"{dot}{name}"] = AWQLayerResult(quantized=q, scale=s, ratio=r, error=error, rtn_error=rtn_error,
                                                     weight_error=relative_error(w, deq))
            w.copy_(deq.to(w.dtype))
    return results


@torch.no_grad()
def awq_quantize_model(
    model: nn.Module, blocks: nn.ModuleList | nn.ModuleDict | Mapping[str, nn.Module],
    calibration: Iterable[torch.Tensor], config: AWQConfig, prefix: str = "",
    on_block: Callable[[str, float, dict[str, AWQLayerResult]], None] | None = None,
    forward_dtype: torch.dtype | None = None,
) -> dict[str, AWQLayerResult]:
    """AWQ of every Linear / Conv1D of `blocks` (the decoder blocks of `model`, in order), block by
    block on `calibration` (input_ids batches (B, T), unpadded), on the driver GPTQ uses. The
    blocks' layers end holding their dequantized weights and the folded norms / producers their
    new values, so `model.state_dict()` afterwards has every float tensor the checkpoint needs
    (`folded_tensors`). Result names are f"{prefix}.{block key}.{submodule}". The calibration
    forwards run in `forward_dtype` (None: float32; `stages.quant.block_calibration`)."""
    model_type = model.config.model_type
    heads = model.config.num_attention_heads  # transformers maps GPT-2's n_head to it
    kv_heads = getattr(model.config, "num_key_value_heads", None) or heads
    if model_type not in FOLD_FAMILIES:
        log.warning("AWQ: model_type=%r has no known fold of the scales into its norms (families: %s); its "
                    "layers get AWQ's clipping and round-to-nearest without scaling", model_type,
                    sorted(FOLD_FAMILIES))

    def step(block: nn.Module, inputs: list[BlockInput], names: str):
        block_results = quantize_block(block, inputs, config, model_type=model_type, heads=heads,
                                       kv_heads=kv_heads, prefix=names)
        return block_results, [run_block(block, inp) for inp in inputs]

    def summary(block_results: dict[str, AWQLayerResult]) -> str:
        gains = [r.error / r.rtn_error for r in block_results.values() if r.rtn_error > 0]
        scaled = f"{sum(r.scale is not None for r in block_results.values())}/{len(block_results)} layers scaled"
        return f"{scaled}, output error x{sum(gains) / len(gains):.3f} of RTN's" if gains else scaled

    return quantize_blocks_sequentially(model, blocks, calibration, step, summary, desc="AWQ", prefix=prefix,
                                        on_block=on_block, forward_dtype=forward_dtype)


def folded_tensors(model: nn.Module, state: Mapping[str, torch.Tensor], results: Mapping[str, Any]
                   ) -> dict[str, torch.Tensor]:
    """The checkpoint tensors AWQ changed outside the quantized layers (the norms and biases the
    scales were folded into), read from the quantized `model`, in `state`'s dtypes."""
    quantized = {f"{name}.weight" for name in results}
    changed: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if key in quantized or key not in state:
            continue
        old = state[key]
        new = value.detach().to(old.dtype)
        if new.shape == old.shape and not torch.equal(new, old):
            changed[key] = new.contiguous()
    return changed


def awq_settings(config: AWQConfig) -> dict[str, Any]:
    return {k: getattr(config, k) for k in AWQConfig.__dataclass_fields__}
