"""A8W8: INT8 weights and INT8 activations with an INT8 x INT8 -> INT32 matrix product
(`torch._int_mm`), plus the two activation transforms that make 8-bit activations work on LLMs:
SmoothQuant (Xiao et al. 2022) and the shift of Outlier Suppression+ (Wei et al. 2023). Option
names follow PaddleNLP's PTQ (`smooth`, `shift`, `smooth_all_linears`, `shift_all_linears`).

For a linear layer y = x W^T + b, W (out, in), with a per-input-channel shift z (in,) and smoothing
s (in,) (both optional, from calibration, see `stages.quant.smoothquant`):

    x'  = (x - z) / s                          activation channels centred and flattened
    W'  = W * s                                (column j times s_j), so x' W'^T = (x - z) W^T
    b'  = b + W z                              the shift folded into the bias (created if absent)
    W'  ~ Wq * sw[:, None]                     Wq int8 (out, in), sw = max_k |W'[o, k]| / 127 (out,)
    x'  ~ xq * sx                              xq int8 (M, in); sx = max_k |x'[m, k]| / 127 per token
                                               (dynamic) or one calibrated scalar (static)
    y   = (xq @ Wq^T) * sx * sw + b'           the product exact in int32, then rescaled in float32

Both grids are symmetric with codes in [-127, 127]; a value beyond a static scale's range is
clamped. An all-zero row gets scale 1 (any scale is exact for it).

`A8W8Linear` keeps z and s as buffers and applies them to its input, instead of folding 1/s into
the preceding norm's weight as SmoothQuant's reference does: that fold only exists for layers fed
by a norm, and only for norms with a per-channel weight, so keeping it in the layer works for every
family and for every Linear (`smooth_all_linears`). The cost is one elementwise pass over x.

Checkpoint format ("a8w8", this project's own; safetensors), for each quantized layer `<name>`:

    <name>.weight        int8 (out, in)    Wq; (out, in) for GPT-2's Conv1D too, whose float weight
                                           is stored (in, out): the layer is no longer a Conv1D
    <name>.weight_scale  float32 (out,)    sw
    <name>.input_scale   float32 ()        sx, only with activation "static"
    <name>.smooth_scale  float32 (in,)     s, only when the layer was smoothed
    <name>.input_shift   float32 (in,)     z, only when the layer was shifted
    <name>.bias          float32 (out,)    b' when the layer has a bias or a shift created one

Every other tensor (embeddings, norms, lm_head, biases of unquantized layers) is the float
checkpoint's. config.json carries `a8w8_quantization_config(config)`; a module named by a
`<name>.weight_scale` key is what `apply_a8w8_state` replaces. The keys are exactly the state_dict
of an `A8W8Linear`, so a model with its layers replaced loads the file with `load_state_dict`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stages.quant.layers import LINEAR_TYPES
from stages.quant.model import layer_weights
from stages.quant.rtn import relative_error

log = logging.getLogger(__name__)

KEY = "quantize.a8w8"
QMAX = 127  # symmetric int8 codes in [-127, 127]
ACTIVATIONS = ("dynamic", "static")
DEFAULT_ALPHA_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
OPTIONAL_SUFFIXES = ("input_scale", "smooth_scale", "input_shift", "bias")
HAS_INT_MM = hasattr(torch, "_int_mm")


@dataclass(frozen=True)
class A8W8Config:
    """A8W8 options (`quantize.a8w8`); defaults are the schema's. The smooth_* options do nothing
    without `smooth`, and shift_all_linears nothing without `shift` (a variant may turn smoothing
    off while the section's defaults set them)."""

    activation: str = "dynamic"  # dynamic: per-token scale at run time; static: per-tensor from calibration
    smooth: bool = False  # SmoothQuant: x / s, W * s with s = max|X_j|^alpha / max|W_j|^(1 - alpha)
    smooth_alpha: float = 0.5  # migration strength alpha, in [0, 1]
    smooth_search: bool = False  # per group of layers sharing an input: alpha from smooth_alpha_grid
    smooth_alpha_grid: tuple[float, ...] = DEFAULT_ALPHA_GRID  # candidates, best calibration output MSE wins
    shift: bool = False  # Outlier Suppression+: x - z, z = (max X_j + min X_j) / 2, W z into the bias
    smooth_all_linears: bool = False  # False: only layers reading a norm's output (q/k/v, gate/up); True: all
    shift_all_linears: bool = False  # the same choice for shift

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"{KEY}.activation={self.activation!r} must be one of {ACTIVATIONS}")
        for key in ("smooth", "smooth_search", "shift", "smooth_all_linears", "shift_all_linears"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{KEY}.{key}={getattr(self, key)!r} must be true or false")
        if not 0.0 <= self.smooth_alpha <= 1.0:
            raise ValueError(f"{KEY}.smooth_alpha={self.smooth_alpha} must lie in [0, 1]; 0.5 is usual")
        grid = tuple(float(a) for a in self.smooth_alpha_grid)
        if not grid or any(not 0.0 <= a <= 1.0 for a in grid):
            raise ValueError(f"{KEY}.smooth_alpha_grid={list(self.smooth_alpha_grid)} must be a non-empty "
                             "list of values in [0, 1]")
        object.__setattr__(self, "smooth_alpha_grid", grid)  # a YAML list becomes a hashable tuple


def a8w8_quantization_config(config: A8W8Config) -> dict[str, Any]:
    """The `quantization_config` entry of config.json for an A8W8 checkpoint made with `config`."""
    return {
        "quant_method": "a8w8",
        "activation": config.activation,
        "smooth": config.smooth,
        "smooth_alpha": config.smooth_alpha,
        "shift": config.shift,
        "smooth_all_linears": config.smooth_all_linears,
        "shift_all_linears": config.shift_all_linears,
        "weight_granularity": "per_channel",
        "activation_granularity": "per_token" if config.activation == "dynamic" else "per_tensor",
    }


# ---------------------------------------------------------------- the int8 grids


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 127, with 1 where amax is 0 (an all-zero row is exact at any scale)."""
    return torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W (out, in) -> (Wq int8 (out, in), sw float32 (out,)), symmetric per output channel."""
    w = weight.detach().float()
    scale = _scale(w.abs().amax(dim=1))  # (out,)
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def quantize_activation_int8(x: torch.Tensor, input_scale: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float32 -> (xq int8 (M, K), sx): per token, sx (M, 1), without `input_scale`;
    else sx = input_scale (a 0-d tensor) and values beyond its range are clamped."""
    scale = _scale(x.abs().amax(dim=1, keepdim=True)) if input_scale is None else input_scale
    return torch.round(x / scale).clamp_(-QMAX, QMAX).to(torch.int8), scale


def _quantize_activation_int8_(x: torch.Tensor, input_scale: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activation_int8` (the same codes and scales) computed in `x`'s own storage, which
    it overwrites: one temporary less per step of the kernel path."""
    scale = _scale(x.abs().amax(dim=1, keepdim=True)) if input_scale is None else input_scale
    return x.div_(scale).round_().clamp_(-QMAX, QMAX).to(torch.int8), scale


# ---------------------------------------------------------------- the layer


class A8W8Linear(nn.Module):
    """y = (xq @ Wq^T) * sx * sw + b with x' = (x - input_shift) / smooth_scale quantized to xq
    (see the module docstring). Input (..., in) of any float dtype, output (..., out) in that dtype;
    the arithmetic is int8 x int8 -> int32 (`torch._int_mm`), the rescale float32.

    smooth_scale is kept here, not folded into the preceding norm, so any Linear of any family can
    be smoothed. `simulate=True` computes the same quantization with a float32 matmul of the
    dequantized values, the reference the kernel is tested against: the int32 accumulation is exact,
    so the two differ only by float rounding. Without `torch._int_mm` the layer always simulates.
    The buffers are the checkpoint's tensors (`weight`, `weight_scale`, and those given of
    `input_scale`, `smooth_scale`, `input_shift`, `bias`).
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                 input_scale: torch.Tensor | None = None, smooth_scale: torch.Tensor | None = None,
                 input_shift: torch.Tensor | None = None, simulate: bool = False):
        super().__init__()
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise ValueError(f"A8W8Linear: weight must be int8 (out, in), got {weight.dtype} {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        expected = {"weight_scale": (self.out_features,), "bias": (self.out_features,), "input_scale": (),
                    "smooth_scale": (self.in_features,), "input_shift": (self.in_features,)}
        given = {"weight_scale": weight_scale, "bias": bias, "input_scale": input_scale,
                 "smooth_scale": smooth_scale, "input_shift": input_shift}
        self.register_buffer("weight", weight.contiguous())  # (out, in) row-major: _int_mm reads its .t() view
        for name, t in given.items():
            if t is None:
                continue
            if tuple(t.shape) != expected[name]:
                raise ValueError(f"A8W8Linear: {name} of shape {tuple(t.shape)} does not match weight "
                                 f"(out={self.out_features}, in={self.in_features}); expected {expected[name]}")
            self.register_buffer(name, t.detach().to(device=weight.device, dtype=torch.float32).contiguous())
        self.simulate = simulate or not HAS_INT_MM

    @property
    def kernel(self) -> str:
        return "simulated" if self.simulate else "int_mm"

    def _buffer(self, name: str) -> torch.Tensor | None:
        return self._buffers.get(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        h = x.reshape(-1, self.in_features).float()  # (M, in), M = prod(leading dims)
        shift, smooth, bias = self._buffer("input_shift"), self._buffer("smooth_scale"), self._buffer("bias")
        if shift is not None:
            h = h - shift
        if smooth is not None:
            h = h / smooth
        if self.simulate:
            xq, sx = quantize_activation_int8(h, self._buffer("input_scale"))  # (M, in) int8; (M, 1) or ()
            w = self.weight.float() * self.weight_scale[:, None]  # (out, in) dequantized
            y = (xq.float() * sx) @ w.t()
        else:
            if h.data_ptr() == x.data_ptr():  # no shift or smoothing made a copy: quantize one
                h = h.clone()
            xq, sx = _quantize_activation_int8_(h, self._buffer("input_scale"))
            # the rescale in place: large temporaries cost page faults on every call on CPU
            y = torch._int_mm(xq, self.weight.t()).float().mul_(sx).mul_(self.weight_scale)  # (M, out)
        if bias is not None:
            y = y + bias
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        parts = [f"in_features={self.in_features}", f"out_features={self.out_features}", self.kernel,
                 "static" if "input_scale" in self._buffers else "dynamic"]
        parts += [name for name in ("smooth_scale", "input_shift", "bias") if name in self._buffers]
        return ", ".join(parts)


# ---------------------------------------------------------------- calibration results and the checkpoint


@dataclass
class A8W8LayerResult:
    """One layer's A8W8 quantization (the checkpoint's tensors, see the module docstring).

    weight:        (out, in) int8, Wq of the smoothed weight W * s
    weight_scale:  (out,) float32
    input_scale:   () float32 with static activations, else None
    smooth_scale:  (in,) float32 when smoothed, else None
    input_shift:   (in,) float32 when shifted, else None
    bias:          (out,) float32, the layer's bias with W z folded in; None when it has none and
                   was not shifted
    alpha:         the smoothing strength used (None when not smoothed)
    output_mse:    mean squared difference of the quantized and the float layer's outputs on the
                   calibration inputs it saw
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor | None = None
    smooth_scale: torch.Tensor | None = None
    input_shift: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    alpha: float | None = None
    output_mse: float = 0.0

    def tensors(self) -> dict[str, torch.Tensor]:
        """{suffix: tensor} as stored, on the CPU, float32 / int8. Copies: the layers of a group
        share their smooth_scale / input_scale, and safetensors refuses tensors sharing memory."""
        out = {"weight": self.weight, "weight_scale": self.weight_scale}
        out.update({k: getattr(self, k) for k in OPTIONAL_SUFFIXES if getattr(self, k) is not None})
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in out.items()}

    def module(self, simulate: bool = False) -> A8W8Linear:
        return A8W8Linear(self.weight, self.weight_scale, self.bias, input_scale=self.input_scale,
                          smooth_scale=self.smooth_scale, input_shift=self.input_shift, simulate=simulate)

    def effective_weight(self) -> torch.Tensor:
        """The float (out, in) weight the layer applies to the shifted input x - z: Wq * sw / s."""
        w = self.weight.float() * self.weight_scale[:, None]
        return w / self.smooth_scale if self.smooth_scale is not None else w


def pack_a8w8(state: dict[str, torch.Tensor], layers: dict[str, bool], results: dict[str, A8W8LayerResult]
              ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Replace `<name>.weight` (and `<name>.bias`) of each of `layers` ({name: stored transposed},
    `stages.quant.layers.decoder_linear_layers`) by the A8W8 tensors of `results[name]`; every other
    tensor of `state` passes through. `state` holds the float weights before quantization; the
    errors are ||W - Wq sw / s||_F / ||W||_F against them (the weight as applied to x - z)."""
    missing = sorted(set(layers) - set(results))
    if missing:
        raise ValueError(f"A8W8 produced no result for {missing[0]} ({len(missing)} of {len(layers)} decoder "
                         "Linears); the model's blocks do not hold the checkpoint's layers")
    weights = layer_weights(state, layers)  # (out, in), Conv1D transposed
    replaced = {f"{name}.{suffix}" for name in weights for suffix in ("weight", "bias")}
    out = {k: v for k, v in state.items() if k not in replaced}
    errors: dict[str, float] = {}
    for name, w in weights.items():
        r = results[name]
        if tuple(r.weight.shape) != tuple(w.shape):
            raise ValueError(f"{name}: A8W8 weight of shape {tuple(r.weight.shape)} does not match the "
                             f"checkpoint's (out, in) = {tuple(w.shape)}")
        out.update({f"{name}.{suffix}": t for suffix, t in r.tensors().items()})
        errors[name] = relative_error(w, r.effective_weight().cpu())
    return out, errors


def apply_a8w8_state(model: nn.Module, state: dict[str, torch.Tensor], quantization_config: dict, *,
                     simulate: bool = False) -> dict[str, str]:
    """Load an A8W8 checkpoint's tensors into `model`, a causal LM built from its config.json (real
    tensors, not the meta device): every Linear / Conv1D named by a `<name>.weight_scale` key is
    replaced by an `A8W8Linear` built from `<name>.*`, then every other tensor is copied into the
    model by name. Returns {name: "int_mm" | "simulated"}, the kernel of each replaced layer.

    ValueError when quantization_config is not A8W8's, a name is not a Linear / Conv1D of the model,
    a static checkpoint lacks an input_scale, a tensor names no parameter of the model, or a
    parameter gets no tensor (parameters tied to a loaded one, e.g. lm_head, excepted)."""
    if quantization_config.get("quant_method") != "a8w8":
        raise ValueError(f"quantization_config quant_method={quantization_config.get('quant_method')!r} is not "
                         "'a8w8'")
    static = quantization_config.get("activation") == "static"
    names = [k.removesuffix(".weight_scale") for k in state if k.endswith(".weight_scale")]
    kernels: dict[str, str] = {}
    for name in names:
        try:
            old = model.get_submodule(name)
        except AttributeError:
            old = None
        if not isinstance(old, LINEAR_TYPES):
            raise ValueError(f"checkpoint tensor {name}.weight_scale names no Linear / Conv1D of "
                             f"{type(model).__name__} (found {type(old).__name__})")
        if static and f"{name}.input_scale" not in state:
            raise ValueError(f"quantization_config says activation 'static' but {name}.input_scale is missing")
        device = old.weight.device
        extra = {s: state[f"{name}.{s}"].to(device) for s in OPTIONAL_SUFFIXES if f"{name}.{s}" in state}
        new = A8W8Linear(state[f"{name}.weight"].to(device), state[f"{name}.weight_scale"].to(device),
                         simulate=simulate, **extra)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        kernels[name] = new.kernel
    _load_float_tensors(model, state)
    log.info("A8W8: %d layers replaced (%s)", len(kernels), ", ".join(sorted(set(kernels.values()))) or "none")
    return kernels


def _load_float_tensors(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """load_state_dict(strict=False) with the checks strict would make, but tolerant of tied
    parameters that the checkpoint stores once (GPT-2's lm_head.weight is wte.weight)."""
    info = model.load_state_dict(state, strict=False)
    if info.unexpected_keys:
        raise ValueError(f"checkpoint tensors name no parameter of {type(model).__name__}: "
                         f"{sorted(info.unexpected_keys)[:5]}")
    current = model.state_dict()
    loaded = {current[k].data_ptr() for k in state if k in current}
    untied = [k for k in info.missing_keys if current[k].data_ptr() not in loaded]
    if untied:
        raise ValueError(f"the checkpoint holds no tensor for {sorted(untied)[:5]} ({len(untied)} parameters of "
                         f"{type(model).__name__})")
