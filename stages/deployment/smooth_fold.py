"""Folding SmoothQuant's per-input-channel scale out of A8W8 layers, so that an A8W8 checkpoint
(`stages.quant.a8w8`) needs no `smooth_scale` tensor: the form every runtime without one reads.

An A8W8 layer with smoothing s (in,) computes on x' = x / s. Dividing by s is moved to whatever
produces x, exactly where that producer is per channel (Llama-style decoder block):

    producer of x                       consumers (one shared s)    fold
    input_layernorm  g * x / rms(x)     q_proj, k_proj, v_proj      g' = g / s
    post_attention_layernorm            gate_proj, up_proj          g' = g / s
                                        (GLM, GLM-4: gate_up_proj)
    v_proj rows, through attention      o_proj                      sw_v' = sw_v / s (and b_v)
    up_proj rows, act(gate) * up        down_proj                   sw_u' = sw_u / s (and b_u)
    (GLM, GLM-4: the second half of gate_up_proj's rows, [gate; up])

Qwen3's q/k head norms act on q_proj's / k_proj's outputs and GLM-4's extra norms on o_proj's /
down_proj's outputs: neither sits between a consumer and its producer, so the folds are the same.

Each norm feeds several layers, so their s must be one tensor: `stages.quant.smoothquant` computes
one s per group of layers reading the same input, and this module checks the group's tensors are
equal before folding (a mismatch is refused, naming the layers). o_proj's input channel
(head h, d) is v_proj's output channel (kv head h // (heads / kv_heads), d): with grouped-query
attention several heads read one v row, so the fold is exact only when s is equal across each
group of heads, checked, else refused. The producer folds scale the int8 rows' per-output-channel
scales (codes unchanged): exact up to float rounding. The norm fold rounds g / s to the norm's
stored dtype.

`input_shift` (Outlier Suppression+'s x - z) has no such fold: a norm's output cannot be shifted
by a per-channel constant in these runtimes, so checkpoints with it are refused.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from stages.errors import InputError
from stages.quant.scale_folds import FOLD_FAMILIES, fold_tables

_LEAF = re.compile(r"^(?P<block>.+)\.(?P<leaf>(?:self_attn|mlp)\.[A-Za-z0-9_]+)$")


def refuse_shift(state: dict[str, torch.Tensor]) -> None:
    """InputError naming `shift` when any layer carries an `input_shift`."""
    shifted = sorted(k.removesuffix(".input_shift") for k in state if k.endswith(".input_shift"))
    if shifted:
        raise InputError(
            f"{shifted[0]} (and {len(shifted) - 1} more layers) carries input_shift: the variant was quantized "
            "with quantize.a8w8.shift (Outlier Suppression+, x - z), which compressed-tensors cannot express "
            "(no per-channel input offset, and a norm output cannot be shifted); re-quantize with shift: false "
            "(e.g. variant a8w8-smooth) to export it")


def _split(name: str, model_type: str) -> tuple[str, str]:
    norms, rows = fold_tables(model_type)
    m = _LEAF.match(name)
    if m is None or (m["leaf"] not in rows and not any(m["leaf"] in c for c in norms.values())):
        raise InputError(f"{name}.smooth_scale: no fold is known for this layer of model_type={model_type!r} "
                         f"(folds: {sorted(rows)} and the consumers of {sorted(norms)}); "
                         "re-quantize with quantize.a8w8.smooth_all_linears: false or smooth: false")
    return m["block"], m["leaf"]


def _head_groups(config: dict[str, Any]) -> tuple[int, int, int]:
    """(kv_heads, heads per kv head, head_dim) of a config.json."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    return kv_heads, heads // kv_heads, head_dim


def _row_scale(name: str, leaf: str, s: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
    """The per-row divisor of the producer of `name`'s input: s itself for down_proj; for o_proj,
    s (heads * head_dim,) as (kv_heads * head_dim,) when equal across each GQA group, else refused."""
    if leaf != "self_attn.o_proj":
        return s
    kv_heads, rep, head_dim = _head_groups(config)
    if s.numel() != kv_heads * rep * head_dim:
        raise InputError(f"{name}.smooth_scale has {s.numel()} channels, config.json says "
                         f"{kv_heads * rep} heads x {head_dim}")
    grouped = s.reshape(kv_heads, rep, head_dim)  # o_proj channel (h, d) reads v row (h // rep, d)
    if not torch.equal(grouped, grouped[:, :1].expand_as(grouped)):
        raise InputError(
            f"{name}.smooth_scale differs between the {rep} attention heads that share one key/value head "
            f"(num_attention_heads={kv_heads * rep}, num_key_value_heads={kv_heads}): it cannot be folded into "
            f"v_proj's rows; re-quantize with quantize.a8w8.smooth_all_linears: false")
    return grouped[:, 0].reshape(-1)


def fold_smoothing(state: dict[str, torch.Tensor], config: dict[str, Any]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """A copy of the A8W8 `state` with every `<name>.smooth_scale` folded as the module docstring
    says, and {"norms": n, "row_producers": n} folded. `config` is config.json's dict (model_type,
    head counts). InputError naming the layer and the setting for anything it cannot fold."""
    smoothed = [k.removesuffix(".smooth_scale") for k in state if k.endswith(".smooth_scale")]
    if not smoothed:
        return dict(state), {"norms": 0, "row_producers": 0}
    model_type = config.get("model_type")
    if model_type not in FOLD_FAMILIES:
        raise InputError(f"{smoothed[0]}.smooth_scale: folding SmoothQuant into model_type={model_type!r} is not "
                         f"supported (families: {list(FOLD_FAMILIES)}); re-quantize with quantize.a8w8.smooth: false")
    out = {k: v for k, v in state.items() if not k.endswith(".smooth_scale")}
    blocks: dict[str, set[str]] = {}
    for name in smoothed:
        block, leaf = _split(name, model_type)
        blocks.setdefault(block, set()).add(leaf)
    folds = {"norms": 0, "row_producers": 0}
    norms, rows = fold_tables(model_type)
    for block, leaves in blocks.items():
        for norm, consumers in norms.items():
            if leaves & set(consumers):
                _fold_norm(state, out, block, norm, consumers)
                folds["norms"] += 1
        for leaf in sorted(leaves & set(rows)):
            _fold_rows(state, out, block, leaf, rows[leaf], config)
            folds["row_producers"] += 1
    return out, folds


def _against(s: torch.Tensor | None, first: torch.Tensor | None) -> str:
    return "none" if s is None else "equal" if first is not None and torch.equal(s, first) else "differs"


def _fold_norm(state: dict[str, torch.Tensor], out: dict[str, torch.Tensor], block: str, norm: str,
               consumers: tuple[str, ...]) -> None:
    names = [f"{block}.{leaf}" for leaf in consumers]
    leaves = [n.rpartition(".")[2] for n in names]
    scales = [state.get(f"{n}.smooth_scale") for n in names]
    first = scales[0]
    if first is None or any(s is None or not torch.equal(s, first) for s in scales):
        seen = ", ".join(f"{leaf}: {_against(s, first)}" for leaf, s in zip(leaves, scales))
        raise InputError(f"{block}.{norm} feeds {leaves}, whose smooth_scale tensors differ ({seen}, against "
                         f"{leaves[0]}); one norm can carry only one fold. Re-quantize with this project's quantize "
                         "stage, which smooths the layers sharing an input with one s")
    key = f"{block}.{norm}.weight"
    if key not in state:
        raise InputError(f"{names[0]}.smooth_scale: the checkpoint has no {key} to fold it into")
    g = state[key]
    out[key] = (g.float() / first.float()).to(g.dtype)  # g * x_hat / s


def _fold_rows(state: dict[str, torch.Tensor], out: dict[str, torch.Tensor], block: str, leaf: str,
               producer_rows: tuple[str, int, int], config: dict[str, Any]) -> None:
    """Divide the rows of `leaf`'s producer that make its input (`producer_rows`: the producer and
    which of its equal row blocks, see ROW_PRODUCER) by `leaf`'s smoothing scale."""
    producer_leaf, index, blocks = producer_rows
    name, producer = f"{block}.{leaf}", f"{block}.{producer_leaf}"
    c = _row_scale(name, leaf, state[f"{name}.smooth_scale"].float(), config)
    key = f"{producer}.weight_scale"
    if key not in out:
        raise InputError(f"{name}.smooth_scale: its input's producer {producer} is not an A8W8 layer of the "
                         "checkpoint; re-quantize with quantize.a8w8.smooth_all_linears: false")
    if out[key].numel() != blocks * c.numel():
        what = f"{out[key].numel()} rows" if blocks == 1 else f"{out[key].numel()} rows, not {blocks} x {c.numel()}"
        raise InputError(f"{name}.smooth_scale: {c.numel()} channels to fold, {producer} has {what}")
    rows = slice(index * c.numel(), (index + 1) * c.numel())  # GLM's gate_up_proj: the up half
    for tensor_key in (key, f"{producer}.bias"):
        if tensor_key in out:  # rows of W_p scaled by 1 / s: the codes stay, their scales change
            t = out[tensor_key].clone()
            t[rows] = t[rows] / c.to(t.dtype)
            out[tensor_key] = t
