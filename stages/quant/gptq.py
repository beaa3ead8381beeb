"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"): weight quantization that feeds each column's rounding error into the columns not yet
quantized, so that the layer's *output* on calibration inputs X changes as little as possible.

For a linear layer y = x W^T with W (out, in), GPTQ minimises ||X W^T - X W_hat^T||^2 one input
column at a time. With H = 2 X^T X / n (in, in), the proxy Hessian of that loss, and U the upper
Cholesky factor of H^-1 (H^-1 = U^T U), quantizing column j to q_j and then updating

    e_j      = (w_j - q_j) / U[j, j]
    w_k     -= e_j * U[j, k]            for every k > j

is the optimal (OBS) correction of the remaining columns. The updates are applied lazily: inside a
block of `block_size` columns immediately, to the columns after the block once per block (one
matmul), which gives the same result with far fewer memory passes.

Options, as GPTQModel / AutoGPTQ name them:
- dead columns (H_jj = 0: the feature is always 0 in the calibration data) are set to W[:, j] = 0
  and H_jj = 1; their weight cannot matter on such inputs.
- damp_percent: damp_percent * mean(diag(H)) is added to the diagonal before inverting.
- group_size: -1 is one scale / zero point per output row; otherwise each run of `group_size`
  columns gets its own, computed from the *error-updated* weights when the group's first column is
  reached (static_groups: from the original weights, all groups up front). When group_size does
  not divide `in`, the last group is narrower: g_idx[k] = k // group_size, ceil(in / group_size)
  groups, which is what GPTQ runtimes allocate.
- desc_act (act-order): columns are processed in descending order of diag(H), the most active
  input features first. Without static_groups the groups are runs of the *processing* order, so the
  group index of the original feature k is g_idx[k] = position_of_k // group_size, not monotonic
  in k; with static_groups the groups stay those of the original order and g_idx = k // group_size.
- sym: the zero point is fixed at 2**(bits - 1) and s = 2 * max|w| / (2**bits - 1); asymmetric
  groups use `stages.quant.rtn`'s grid (range containing 0, zero point in [1, 2**bits - 1]).
- mse (> 0; 0 = off): a group's parameters come from `clipped_group_params`, each row's range shrunk
  where that lowers sum |w - w_hat|^mse over the group's columns (the reference's `mse` option; it
  scans fewer shrinks, see there).

Two details differ from the reference code (IST-DASLab/gptq, which AutoGPTQ and GPTQModel follow),
both towards the stated maths: a group's parameters are computed from its weights with *every*
earlier column's update applied (the reference omits the updates from earlier columns of the same
lazy block when a group starts mid-block, so its result depends on block_size; this one does not),
and per-channel parameters are computed after dead columns are zeroed (the reference includes
their original weights in the range). With block_size == group_size and no dead column the codes
equal the reference loop's bit for bit.

Scales are float16-exact (rounded up, as in rtn.py) and zero points lie in [1, 2**bits - 1], so a
result packs into either checkpoint format, the classic "gptq" (which stores z - 1; symmetric results
are written so) or "gptq_v2" (z as is; asymmetric ones), see `stages.quant.gptq_format`. The
weights are always

    W_hat[o, k] = scales[o, g_idx[k]] * (codes[o, k] - zeros[o, g_idx[k]])

and `dequantize_gptq` computes exactly the values the error feedback used (`GPTQResult.weight`).

The layer-by-layer step (`quantize_layer_sequential`, `gptq_quantize_model`, on the block driver
shared with A8W8, `stages.quant.block_calibration`) runs the calibration batches through one decoder
block at a time: inside a block the Linears are quantized in the order
the forward pass calls them ("true sequential": q/k/v, then o, then gate/up, then down), each group
calibrated on inputs produced by the already-quantized earlier ones, and the block's quantized
output is the input of the next block. Layers fed the same tensor (q/k/v, gate/up) share one Hessian
and one GPTQ over their stacked rows (`gptq_quantize_shared`): GPTQ treats rows independently, so
each gets exactly the result it would get alone, for one Hessian, one factorisation and one column
loop instead of three.

Speed: the column loop runs on W^T, where a column is a contiguous row, with about a dozen small
torch calls per column, on one intra-op thread (`COLUMN_LOOP_THREADS`); the block updates, the
Hessians and the factorisations use every thread. The float results are the same as the plain
(out, in) loop's bit for bit (tests/unit/test_quant_gptq.py holds it against the reference loop).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from stages.quant.block_calibration import (BlockInput, FinishedOutputs, GPTQHessian,  # noqa: F401 (re-exported)
                                            StopForward, capture_block_inputs, forward_batches,
                                            quantize_blocks_sequentially, run_block, sequential_groups)
from stages.quant.gptq_config import SUPPORTED_BITS, GPTQConfig, GPTQResult  # noqa: F401 (re-exported)
from stages.quant.layers import linear_weight
from stages.quant.rtn import QuantizedWeight, asymmetric_grid, symmetric_grid

log = logging.getLogger(__name__)

# Intra-op threads of the per-column loop (0: leave torch's setting). Its operations touch at most
# block_size x out elements: an OpenMP fork/join costs about as much as the work, and on a busy machine
# every one of them waits for a descheduled thread (135m shapes, 2 threads while another process held
# a core: torch.outer and sub_ 0.8 ms each per column; on 1 thread 0.01-0.04 ms for both). The block
# updates, Hessians and factorisations keep every thread.
COLUMN_LOOP_THREADS = 1


def group_params(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (out,) float32 (float16-exact) and zero point (out,) float32 holding integers in
    [1, 2**bits - 1] for the columns `w` (out, cols) of one group.

    Asymmetric: `stages.quant.rtn.asymmetric_grid`, the grid RTN uses. Symmetric: z = 2**(bits - 1) and
    s = 2 * max|w| / maxq, so every element is within s / 2 of the grid (the top code, z - 1 steps
    above zero, is half a step short of max|w|).
    """
    return _grid(*_row_range(w), bits, sym)


def _row_range(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's range [lo, hi] of `w` (out, cols), widened to contain 0."""
    return w.amin(dim=1).clamp(max=0.0), w.amax(dim=1).clamp(min=0.0)


def _grid(lo: torch.Tensor, hi: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of ranges [lo, hi] (any shape): rtn's symmetric or asymmetric grid."""
    return symmetric_grid(torch.maximum(-lo, hi), bits) if sym else asymmetric_grid(lo, hi, bits)


CLIP_MAX_SHRINK = 0.8  # the clipping search's ranges go down to 1 - CLIP_MAX_SHRINK of the full one
CLIP_COARSE_STEP, CLIP_FINE_STEP = 0.04, 0.01  # shrink steps of its two passes
_CLIP_CHUNK_ELEMENTS = 1 << 18  # (candidates, rows, cols) elements scored at once: their temporaries stay in cache


def _clip_errors(w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, shrinks: torch.Tensor, bits: int, sym: bool,
                 norm: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For shrinks (P, out): the grids of the ranges shrinks * [lo, hi] (scale, zero, each (P, out)) and
    their errors sum_cols |w - w_hat|^norm (P, out), in chunks of rows that stay in cache."""
    maxq = 2**bits - 1
    scale, zero = _grid(shrinks * lo, shrinks * hi, bits, sym)
    err = torch.empty_like(scale)
    rows = max(1, _CLIP_CHUNK_ELEMENTS // (shrinks.shape[0] * w.shape[1]))
    for r in range(0, w.shape[0], rows):
        x, s, z = w[r:r + rows], scale[:, r:r + rows, None], zero[:, r:r + rows, None]
        q = torch.div(x, s).round_().add_(z).clamp_(0, maxq)  # (P, rows, cols)
        err[:, r:r + rows] = q.sub_(z).mul_(s).sub_(x).abs_().pow_(norm).sum(dim=2)
    return scale, zero, err


def clipped_group_params(w: torch.Tensor, bits: int, sym: bool, norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`group_params` with the range clipped where that lowers the rounding error (GPTQ's `mse`
    option): each row's range [lo, hi] may shrink to p * [lo, hi], p in [1 - CLIP_MAX_SHRINK, 1], and the
    p whose grid gives the smallest sum |w - w_hat|^norm over the row's columns is kept; elements
    outside a clipped range saturate at the extreme codes. norm 2.4 is the GPTQ paper's (GPTQModel's
    `mse`). The reference scans p = 1, 0.99, ..., 0.21 (80 grids); this scans p = 1, 0.96, ..., 0.24,
    then the 0.01 steps within 0.03 of each row's best (26 grids, about 3x less work). p = 1 wins ties,
    so a row is clipped only where that lowers its error."""
    lo, hi = _row_range(w)
    coarse = 1 - torch.arange(0, CLIP_MAX_SHRINK + 1e-9, CLIP_COARSE_STEP, dtype=torch.float32, device=w.device)
    scale, zero, err = _clip_errors(w, lo, hi, coarse[:, None].expand(-1, w.shape[0]), bits, sym, norm)
    best_err, pick = err.min(dim=0)  # the first minimum: the widest range among equals
    rows = torch.arange(w.shape[0], device=w.device)
    best_scale, best_zero, best_p = scale[pick, rows], zero[pick, rows], coarse[pick]
    offsets = torch.tensor([-3, -2, -1, 1, 2, 3], dtype=torch.float32, device=w.device) * CLIP_FINE_STEP
    fine = (best_p[None] + offsets[:, None]).clamp(1 - CLIP_MAX_SHRINK, 1.0)  # (6, out)
    scale, zero, err = _clip_errors(w, lo, hi, fine, bits, sym, norm)
    fine_err, pick = err.min(dim=0)
    better = fine_err < best_err
    return (torch.where(better, scale[pick, rows], best_scale), torch.where(better, zero[pick, rows], best_zero))


def _inverse_hessian_factor(hessian: torch.Tensor, damp_percent: float, name: str) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp I)^-1; the damping grows tenfold while H is not
    positive definite (float32 round-off on nearly singular H), up to 100% of mean(diag(H))."""
    mean_diag = torch.diag(hessian).mean()
    eye = torch.eye(hessian.shape[0], dtype=hessian.dtype, device=hessian.device)
    damps = [damp_percent]
    while damps[-1] < 1.0:
        damps.append(min(damps[-1] * 10, 1.0))
    for damp in damps:
        chol, info = torch.linalg.cholesky_ex(hessian + damp * mean_diag * eye)
        if info == 0:
            # = torch.cholesky_inverse(chol), which is ~100x slower on multi-threaded CPU LAPACK
            inverse = torch.cholesky_solve(eye, chol)
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if info == 0:
                if damp != damp_percent:
                    log.warning("%s: Hessian not positive definite at damp_percent=%g; used %g",
                                name, damp_percent, damp)
                return upper
    raise ValueError(f"{name}: the calibration Hessian is not positive definite even with damp_percent=1; "
                     "check the calibration inputs for inf / nan")


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True,
    desc_act: bool = False, static_groups: bool = False, damp_percent: float = 0.01, block_size: int = 128,
    name: str = "weight", mse: float = 0.0,
) -> GPTQResult:
    """GPTQ of `weight` (out, in) given the Hessian (in, in) of its calibration inputs (see the
    module docstring for the maths and the options). Neither argument is modified."""
    return gptq_quantize_shared([weight], hessian, bits, group_size, sym, desc_act, static_groups, damp_percent,
                                block_size, names=[name], mse=mse)[0]


@torch.no_grad()
def gptq_quantize_shared(
    weights: Sequence[torch.Tensor], hessian: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True,
    desc_act: bool = False, static_groups: bool = False, damp_percent: float = 0.01, block_size: int = 128,
    names: Sequence[str] | None = None, mse: float = 0.0,
) -> list[GPTQResult]:
    """`gptq_quantize` of several weights (out_i, in) fed the same inputs (q/k/v, gate/up), so sharing
    one Hessian: each result is the one `gptq_quantize` gives that weight alone. GPTQ treats the
    output rows independently (per-row group parameters, per-row error feedback, the same H^-1 for
    all), so the weights are stacked into one (sum out_i, in) matrix and the column loop, the
    damping and the factorisation of H^-1 run once for all of them.

    The loop works on W^T (in, out), where the column being quantized is a contiguous row: per
    column one division, round, shift and clamp (the codes), one subtraction and product (s * (q - z)),
    the scaled error, and one rank-1 update (outer product, subtraction) of the block's remaining
    columns."""
    names = [f"weight{k}" for k in range(len(weights))] if names is None else list(names)
    if not weights or len(names) != len(weights):
        raise ValueError("gptq_quantize_shared needs one name per weight and at least one weight")
    GPTQConfig(bits, group_size, sym, desc_act, static_groups, damp_percent, block_size, mse=mse)  # validates
    for w, name in zip(weights, names):
        if w.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D weight (out, in), got shape {tuple(w.shape)}")
    in_f = weights[0].shape[1]
    for w, name in zip(weights, names):
        if w.shape[1] != in_f:
            raise ValueError(f"{name}: in_features={w.shape[1]} differs from {names[0]}'s {in_f}; only weights "
                             "with the same inputs share a Hessian")
    label = names[0] if len(names) == 1 else "/".join(names)
    if hessian.shape != (in_f, in_f):
        raise ValueError(f"{label}: hessian of shape {tuple(hessian.shape)} does not match in_features={in_f}")
    device = weights[0].device
    # W^T (in, out): the columns of W are rows here; a fresh float32 copy, the inputs stay untouched
    Wt = torch.cat([w.detach().to(device, torch.float32) for w in weights]).t().contiguous()
    for w, name in zip(weights, names):
        if not torch.isfinite(w).all():
            raise ValueError(f"{name} holds inf or nan values; it cannot be quantized")
    H = hessian.detach().to(device, torch.float32).clone()
    in_f, out_f = Wt.shape
    maxq = 2**bits - 1
    gs = in_f if group_size == -1 else group_size
    n_groups = math.ceil(in_f / gs)

    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    Wt[dead] = 0.0

    scales = torch.zeros(n_groups, out_f, device=device)  # transposed: (G, out)
    zeros = torch.zeros(n_groups, out_f, device=device)
    # Groups whose parameters come from the weights before any update: per channel (one group,
    # as GPTQ does) and static_groups (original column order).
    upfront = group_size == -1 or static_groups
    threads = torch.get_num_threads()

    def params(cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # cols (out, n)
        if mse <= 0:
            return group_params(cols, bits, sym)
        loop_threads = torch.get_num_threads()
        torch.set_num_threads(threads)  # the clipping search is bulk work: every thread
        try:
            return clipped_group_params(cols, bits, sym, mse)
        finally:
            torch.set_num_threads(loop_threads)

    if upfront:
        for g in range(n_groups):
            scales[g], zeros[g] = params(Wt[g * gs:(g + 1) * gs].t())

    perm = None
    if desc_act:
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
        Wt, H = Wt[perm], H[perm][:, perm]
    # group of the j-th processed column: its original column's group when the groups are fixed in
    # the original order, else its position's
    position = torch.arange(in_f, device=device)
    column_group = (perm if (perm is not None and upfront) else position) // gs  # (in,)

    U = _inverse_hessian_factor(H, damp_percent, label)  # (in, in) upper
    del H
    Qt = torch.empty_like(Wt)  # dequantized weights, processing order, transposed
    codes = torch.empty_like(Wt)  # integer-valued
    Err = torch.empty_like(Wt)  # (w_j - q_j) / U[j, j]
    # plain Python numbers: tensor indexing per column costs more than the maths
    groups = column_group.tolist()
    pivots = torch.diagonal(U).tolist()
    current, s, z = -1, None, None
    try:
        for i1 in range(0, in_f, block_size):
            i2 = min(i1 + block_size, in_f)
            W1 = Wt[i1:i2]  # (b, out): updated eagerly inside the block; nothing reads it afterwards
            Err1 = Err[i1:i2]
            U1 = U[i1:i2, i1:i2]
            if COLUMN_LOOP_THREADS and threads > COLUMN_LOOP_THREADS:
                torch.set_num_threads(COLUMN_LOOP_THREADS)
            for i in range(i2 - i1):
                j = i1 + i
                if not upfront and j % gs == 0:
                    g_end = min(j + gs, in_f)
                    cols = W1[i:min(g_end, i2) - i1]
                    if g_end > i2:  # the group runs past this block: add the block's pending updates
                        rest = Wt[i2:g_end] - U[i1:j, i2:g_end].t() @ Err1[:i]
                        cols = torch.cat([cols, rest])
                    scales[j // gs], zeros[j // gs] = params(cols.t())
                    current = -1  # the group's parameters were just (re)computed
                if groups[j] != current:
                    current = groups[j]
                    s, z = scales[current], zeros[current]
                w, q, dq, err = W1[i], codes[j], Qt[j], Err1[i]
                torch.div(w, s, out=q).round_().add_(z).clamp_(0, maxq)
                torch.sub(q, z, out=dq).mul_(s)
                torch.sub(w, dq, out=err).div_(pivots[j])
                if i + 1 < i2 - i1:  # not addr_: its fused multiply-add rounds differently from the reference
                    W1[i + 1:].sub_(torch.outer(U1[i, i + 1:], err))
            torch.set_num_threads(threads)
            if i2 < in_f:
                Wt[i2:].addmm_(U[i1:i2, i2:].t(), Err1, alpha=-1)
    finally:
        torch.set_num_threads(threads)
    row_loss = (Err * Err).sum(dim=0) / 2  # (out,)

    g_idx = column_group.to(torch.int32)  # processing order
    if perm is not None:
        inverse = torch.argsort(perm)
        Qt, codes, g_idx = Qt[inverse], codes[inverse], g_idx[inverse]
    results = []
    row = 0
    for k, w in enumerate(weights):
        rows = slice(row, row + w.shape[0])
        row += w.shape[0]
        own = (lambda t: t) if k == 0 else (lambda t: None if t is None else t.clone())  # no shared storage
        results.append(GPTQResult(
            codes=codes[:, rows].t().to(torch.int32).contiguous(), scales=scales[:, rows].t().contiguous(),
            zeros=zeros[:, rows].t().to(torch.int32).contiguous(), g_idx=own(g_idx), perm=own(perm),
            weight=Qt[:, rows].t().contiguous(), bits=bits, group_size=group_size, sym=sym,
            loss=float(row_loss[rows].sum())))
    return results


def dequantize_gptq(result: GPTQResult, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W_hat[o, k] = scales[o, g_idx[k]] * (codes[o, k] - zeros[o, g_idx[k]]), (out, in) in `dtype`."""
    g = result.g_idx.long()
    w = result.scales[:, g] * (result.codes.float() - result.zeros[:, g].float())
    return w.to(dtype)


def to_quantized_weight(result: GPTQResult) -> QuantizedWeight:
    """The result as rtn's QuantizedWeight, which `gptq_format.pack` takes: only when g_idx is
    k // group_size (no desc_act, or static_groups) and group_size divides in_features."""
    in_f = result.codes.shape[1]
    gs = in_f if result.group_size == -1 else result.group_size
    if in_f % gs or not torch.equal(result.g_idx, (torch.arange(in_f, device=result.g_idx.device) // gs).int()):
        raise ValueError("this GPTQ result has a permuted g_idx or a narrower last group; "
                         "pack it with stages.quant.gptq_pack.pack_gptq")
    return QuantizedWeight(codes=result.codes, scales=result.scales, zeros=result.zeros, bits=result.bits,
                           group_size=result.group_size)


# ---------------------------------------------------------------- layer-by-layer calibration


@torch.no_grad()
def quantize_layer_sequential(
    block: nn.Module, inputs: Sequence[BlockInput], config: GPTQConfig,
    sequential: Sequence[Sequence[str]] | None = None, prefix: str = "", reuse: bool = True,
) -> tuple[list[torch.Tensor], dict[str, GPTQResult]]:
    """GPTQ every Linear / Conv1D of one decoder block in true-sequential order, replacing each
    weight by its dequantized value before the next group is calibrated.

    `sequential` lists groups of submodule names (default: `sequential_groups`, the call order;
    with `config.true_sequential` False, one group of them all, calibrated on the float block).
    Returns the block's outputs on `inputs` with every weight quantized (the next block's inputs),
    and {f"{prefix}.{name}": result} in quantization order.
    """
    call_order = sequential_groups(block, inputs[0])
    if sequential is not None:
        groups = [list(g) for g in sequential]
    else:
        groups = call_order
        if not config.true_sequential:
            groups = [[name for group in groups for name in group]]
    modules = dict(block.named_modules())
    dot = f"{prefix}." if prefix else ""
    results: dict[str, GPTQResult] = {}
    finished = FinishedOutputs(block, [name for group in call_order for name in group]) if reuse else None
    try:
        for group in groups:
            _quantize_group(block, modules, group, inputs, config, dot, results, finished)
        if finished is None:
            return [run_block(block, inp) for inp in inputs], results
        return [run_block(block, inp) for inp in finished.batches(inputs, record=False)], results
    finally:
        if finished is not None:
            finished.close()


def _quantize_group(block: nn.Module, modules: dict[str, nn.Module], group: list[str], inputs: list[BlockInput],
                    config: GPTQConfig, dot: str, results: dict[str, GPTQResult],
                    finished: FinishedOutputs | None) -> None:
    """One true-sequential group: its Hessians from a pass over `inputs`, its GPTQ, its weights
    replaced by their dequantized values; results added to `results`."""
    hessians: dict[str, GPTQHessian] = {}
    leader: dict[str, str] = {}  # layer -> the layer whose Hessian it shares (itself if none)
    batch_inputs: dict[str, torch.Tensor] = {}  # this batch: leader -> its input
    seen: set[str] = set()

    def record(mod, args, out, name):
        x = args[0]
        if name not in leader:  # decided on the first batch: the same tensor as an earlier layer's
            leader[name] = next((n for n, t in batch_inputs.items() if t is x), name)
        if leader[name] == name:
            if name not in hessians:
                hessians[name] = GPTQHessian(linear_weight(modules[name]).shape[1], modules[name].weight.device)
            hessians[name].add_batch(x)
            batch_inputs[name] = x
        elif batch_inputs.get(leader[name]) is not x:
            raise RuntimeError(f"{dot}{name} was fed {dot}{leader[name]}'s input on the first calibration batch "
                               "but not on a later one; the block's forward is not the same for every batch")
        seen.add(name)
        if len(seen) == len(group):  # the rest of the block cannot change these inputs
            raise StopForward

    def new_batch():  # what `record` keeps of one batch
        seen.clear()
        batch_inputs.clear()

    hooks = [modules[name].register_forward_hook(lambda mod, args, out, name=name: record(mod, args, out, name))
             for name in group]
    forward_batches(block, inputs if finished is None else finished.batches(inputs), hooks, before_batch=new_batch)
    batch_inputs.clear()
    missing = [name for name in group if name not in leader]
    if missing:
        raise ValueError(f"{dot}{missing[0]} received no calibration input: the block's forward does not "
                         "call it; pass `sequential` without it")
    # layers sharing an input share H: one GPTQ over their stacked rows (bit-identical to one each)
    shared: dict[str, list[str]] = {}
    for name in group:
        shared.setdefault(leader[name], []).append(name)
    group_results: dict[str, GPTQResult] = {}
    for first, members in shared.items():
        hessian = hessians[first].hessian
        if hessians[first].num_rows == 0:
            # a mixture's expert no calibration token was routed to: GPTQ on H = I is round-to-nearest
            # on GPTQ's grid (its groups, its scales), the fallback GPTQModel also takes
            log.warning("%s%s: no calibration token reached it (an expert the router never chose); quantized "
                        "round-to-nearest (GPTQ with H = I)", dot, first)
            hessian = torch.eye(hessian.shape[0], dtype=hessian.dtype, device=hessian.device)
        rs = gptq_quantize_shared([linear_weight(modules[name]) for name in members], hessian,
                                  config.bits, config.group_size, config.sym, config.desc_act,
                                  config.static_groups, config.damp_percent, config.block_size,
                                  names=[f"{dot}{name}" for name in members], mse=config.mse)
        group_results.update(zip(members, rs))
    for name in group:  # in the group's order
        module, r = modules[name], group_results[name]
        w = r.weight.t() if isinstance(module, Conv1D) else r.weight
        module.weight.copy_(w.to(module.weight.dtype))
        results[f"{dot}{name}"] = r
        log.debug("%s%s: GPTQ loss %.4g", dot, name, r.loss)
    if finished is not None:
        finished.finish(group)


@torch.no_grad()
def gptq_quantize_model(
    model: nn.Module, blocks: nn.ModuleList | nn.ModuleDict | Mapping[str, nn.Module],
    calibration: Iterable[torch.Tensor], config: GPTQConfig, prefix: str = "",
    on_block: Callable[[str, float, dict[str, GPTQResult]], None] | None = None,
    forward_dtype: torch.dtype | None = None,
) -> dict[str, GPTQResult]:
    """GPTQ every Linear / Conv1D of `blocks` (the decoder blocks of `model`, in order) in place,
    block by block, calibrated on `calibration` (input_ids batches, each (B, T), unpadded: the model
    is called with input_ids alone, so every token counts in the Hessians).

    Works for any model that calls each block as block(hidden, ...) with the same other arguments
    for every block: our Llama (`model.model.layers`) and transformers' causal LMs
    (`model.get_submodule(stages.quant.layers.decoder_blocks(model))`). Result names are
    f"{prefix}.{block key}.{submodule}", the checkpoint names when `prefix` is the blocks' path.
    `on_block(key, seconds, block_results)` is called after each block (wall time of its Hessians,
    GPTQ and the forward that makes the next block's inputs). The calibration forwards run in
    `forward_dtype` (None: float32; bfloat16 autocast, `stages.quant.block_calibration`); GPTQ
    solves on the float32 weights.
    """
    def step(block: nn.Module, inputs: list[BlockInput], names: str):
        outputs, block_results = quantize_layer_sequential(block, inputs, config, prefix=names)
        return block_results, outputs

    def summary(block_results: dict[str, GPTQResult]) -> str:
        return f"mean loss {sum(r.loss for r in block_results.values()) / len(block_results):.4g}"

    return quantize_blocks_sequentially(model, blocks, calibration, step, summary, desc="GPTQ", prefix=prefix,
                                        on_block=on_block, forward_dtype=forward_dtype)
