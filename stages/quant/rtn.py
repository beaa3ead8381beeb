"""Round-to-nearest (RTN) weight quantization: asymmetric (default) or symmetric, per output channel
or group-wise.

A weight matrix W (out, in) is cut along its input features into groups of `group_size` columns
(group_size = -1 means one group spanning all of `in`, i.e. per output channel). Each row of each
group gets its own scale s > 0 and integer zero point z, and every element an integer code q:

    maxq = 2**bits - 1
    lo   = min(min(w), 0),  hi = max(max(w), 0)      # the range always contains 0
    s    = (hi - lo) / maxq                          # rounded *up* to the next float16
    z    = round(-lo / s)                            # so that w = 0 is exactly representable
    q    = clamp(round(w / s) + z, 0, maxq)
    W   ~= s * (q - z)                               # dequantization

Because z = round(-lo / s) is within 1/2 of -lo / s and (hi - lo) / s <= maxq, every element lies
within half a step of the grid: |w - s * (q - z)| <= s / 2 (plus float32 rounding).

Symmetric (`sym=True`, GPTQ's usual grid): z = 2**(bits - 1) and s = 2 * max|w| / maxq, rounded up
to a float16 value; the top code lies half a step short of max|w|, so the s / 2 bound holds too.

Two choices are made for the packed checkpoint format (`stages.quant.gptq_format`), not for
accuracy:
- s is stored as float16, so it is computed here already rounded up to a float16 value; rounding
  up (not to nearest) keeps (hi - lo) / s <= maxq and with it the s / 2 bound.
- z is kept in [1, maxq], never 0: the classic GPTQ layout ("gptq") stores z - 1, and several
  kernels (ExLlama, GPTQModel's v1->v2 conversion) add the 1 back without masking, so a stored -1
  would be read as 2**bits. A group whose weights are all >= 0 would get z = 0; there the scale is
  widened to s = hi / (maxq - 1) and z set to 1, which keeps the s / 2 bound with the wider s.
  RTN files are written as "gptq_v2" (z stored as is; GPTQModel reads asymmetric files only so),
  where z = 0 would be storable; the rule is kept so that the codes fit either format and stay
  those of earlier runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (4, 8)
# Smallest normal float16: a scale below it would be stored as a subnormal or zero.
_MIN_SCALE = torch.finfo(torch.float16).tiny


@dataclass
class QuantizedWeight:
    """Integer codes and per-group parameters of one weight matrix W (out, in).

    codes:  (out, in) int32 in [0, 2**bits - 1]
    scales: (out, n_groups) float32 holding float16-exact values
    zeros:  (out, n_groups) int32 in [1, 2**bits - 1]
    Column k of W belongs to group k // group_size (group_size == in when per channel).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int  # as requested: -1 for per channel

    @property
    def columns_per_group(self) -> int:
        return self.codes.shape[1] if self.group_size == -1 else self.group_size


def check_group_size(in_features: int, group_size: int, name: str = "weight") -> int:
    """Return the number of groups along the input features, or raise naming the fix."""
    if group_size == -1:
        return 1
    if group_size <= 0 or in_features % group_size:
        raise ValueError(
            f"quantize.group_size={group_size} does not divide in_features={in_features} of {name}; "
            "choose a divisor of every layer's input width (e.g. 32, 64, 128) or -1 for per channel"
        )
    return in_features // group_size


def _round_up_to_fp16(x: torch.Tensor) -> torch.Tensor:
    """Smallest float16 value >= x (as float32), for positive finite x."""
    h = x.to(torch.float16)
    low = h.float() < x
    h = torch.where(low, torch.nextafter(h, torch.full_like(h, float("inf"))), h)
    return h.float()


def fp16_scale(step: torch.Tensor) -> torch.Tensor:
    """A quantization step as it is stored: at least the smallest normal float16, rounded up to a
    float16 value (rounding up keeps every element within half a step of the grid)."""
    return _round_up_to_fp16(step.clamp(min=_MIN_SCALE))


def asymmetric_grid(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (float16-exact) and zero point (integers in [1, 2**bits - 1], as float32) of groups whose
    range is [lo, hi] with lo <= 0 <= hi; see the module docstring. Shared by RTN and GPTQ."""
    maxq = 2**bits - 1
    # An all-zero group has no range; any positive scale represents it exactly.
    span = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
    scale = fp16_scale(span / maxq)
    zero = torch.round(-lo / scale)
    # z = 0 is not storable in the classic GPTQ layout (see module docstring): widen instead.
    needs_widen = zero < 1
    scale = torch.where(needs_widen, fp16_scale(hi / (maxq - 1)), scale)
    zero = torch.where(needs_widen, torch.ones_like(zero), zero).clamp(1, maxq)
    return scale, zero


def symmetric_grid(amax: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (float16-exact) and zero point 2**(bits - 1) (as float32) of groups whose largest
    magnitude is `amax`; see the module docstring. Shared by RTN and GPTQ."""
    span = torch.where(amax > 0, 2 * amax, torch.ones_like(amax))  # all-zero group: any scale is exact
    scale = fp16_scale(span / (2**bits - 1))
    return scale, torch.full_like(scale, 2 ** (bits - 1))


def quantize_weight(
    weight: torch.Tensor, bits: int, group_size: int = -1, name: str = "weight", sym: bool = False,
) -> QuantizedWeight:
    """RTN quantization of `weight` (out, in), asymmetric unless `sym`; see the module docstring."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported; choose one of {SUPPORTED_BITS}")
    if weight.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D weight (out, in), got shape {tuple(weight.shape)}")
    out_f, in_f = weight.shape
    n_groups = check_group_size(in_f, group_size, name)
    maxq = 2**bits - 1
    w = weight.detach().float().reshape(out_f, n_groups, in_f // n_groups)  # (out, G, cols)
    if not torch.isfinite(w).all():
        raise ValueError(f"{name} holds inf or nan values; it cannot be quantized")

    lo = w.amin(dim=-1).clamp(max=0.0)  # (out, G)
    hi = w.amax(dim=-1).clamp(min=0.0)
    scale, zero = symmetric_grid(torch.maximum(-lo, hi), bits) if sym else asymmetric_grid(lo, hi, bits)
    if not torch.isfinite(scale.to(torch.float16)).all():
        raise ValueError(f"{name}: a quantization scale overflows float16 "
                         f"(weights beyond ~{65504 * maxq:.0f})")

    codes = torch.clamp(torch.round(w / scale[..., None]) + zero[..., None], 0, maxq)  # (out, G, cols)
    return QuantizedWeight(
        codes=codes.reshape(out_f, in_f).to(torch.int32),
        scales=scale,
        zeros=zero.to(torch.int32),
        bits=bits,
        group_size=group_size,
    )


def dequantize_weight(q: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W_hat = s * (q - z), broadcast over each group's columns; returns (out, in) in `dtype`."""
    out_f, in_f = q.codes.shape
    n_groups = q.scales.shape[1]
    codes = q.codes.reshape(out_f, n_groups, in_f // n_groups).float()  # (out, G, cols)
    w = q.scales.float()[..., None] * (codes - q.zeros.float()[..., None])
    return w.reshape(out_f, in_f).to(dtype)


def relative_error(weight: torch.Tensor, approx: torch.Tensor) -> float:
    """||W - W_hat||_F / ||W||_F (0 for an all-zero W reproduced exactly)."""
    num = torch.linalg.vector_norm((weight.float() - approx.float()))
    den = torch.linalg.vector_norm(weight.float())
    return float(num / den) if den > 0 else float(num)
