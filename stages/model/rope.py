"""Rotary position embeddings (RoPE) exactly as transformers computes them, one rope type at a time.

`RotaryEmbedding(config)(seq_len, device, dtype)` returns the cos/sin tables of positions
0..seq_len-1. The model and every pipeline stage call the same object, so a stage that holds
layers 4..7 rotates by the same angles as the whole model, whatever the rope type.

Each `_inv_freq_*` function follows `transformers/modeling_rope_utils.py` (5.23) operation by
operation, in fp32 on the CPU (the tables are built before any `.to(device)`, as transformers
builds its `inv_freq` buffer), so the tables equal transformers' bit for bit rather than being
merely close. Rope types and their parameters (HF names, in `rope_parameters` / `rope_scaling`):

- `default`: inv_freq = 1 / theta^(2i/hd).
- `linear`: default / factor.
- `dynamic` (NTK-aware): for a sequence longer than `max_position_embeddings` the base becomes
  theta * (factor * T / max_pos - (factor - 1))^(hd / (hd - 2)), recomputed from T at every forward.
  transformers caches the longest length seen so far and keeps using it for shorter sequences
  until one is shorter than max_pos; ours is stateless (each forward uses its own T), which equals
  transformers' for a fresh model and for non-decreasing lengths.
- `llama3`: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings.
- `yarn`: factor (None: max_pos / original), original_max_position_embeddings, beta_fast (32),
  beta_slow (1), truncate (True), and attention_factor (or mscale / mscale_all_dim) that scales
  cos and sin.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from stages.model.rope_types import SUPPORTED_ROPE_TYPES, depends_on_length, rope_type


class RopeConfig(Protocol):
    """The fields of a model config RoPE reads (LlamaConfig has them; this module needs no more)."""

    rope_scaling: dict[str, Any] | None
    rope_theta: float
    rotary_dim: int  # the dimensions of a head RoPE turns (head_dim unless partial_rotary_factor < 1)
    rope_interleaved: bool  # pairs (0,1), (2,3), ... (GLM) rather than (i, i + rotary_dim/2) (Llama)
    max_position_embeddings: int


def _exponents(dim: int) -> torch.Tensor:
    """2i/dim for i < dim/2, fp32 on the CPU (transformers: arange(0, dim, 2, int64).float() / dim)."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim


def _inv_freq_default(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** _exponents(dim))


def _inv_freq_dynamic(theta: float, dim: int, factor: float, max_pos: int, seq_len: int | None) -> torch.Tensor:
    """NTK-aware base for `seq_len` tokens (None: the model's own max_pos, i.e. the default base).
    transformers passes max(position_ids) + 1 as an int64 tensor, so the base is an fp32 tensor."""
    if seq_len is None:
        seq = max_pos
    else:
        seq = torch.maximum(torch.tensor(seq_len, device="cpu"), torch.tensor(max_pos, device="cpu"))
    base = theta * ((factor * seq / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** _exponents(dim))


def _inv_freq_llama3(theta: float, dim: int, s: dict[str, Any], original_max: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the band between blended."""
    inv_freq = _inv_freq_default(theta, dim)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    low_freq_wavelen, high_freq_wavelen = original_max / low, original_max / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_attention_factor(s: dict[str, Any], factor: float) -> float:
    """YaRN's cos/sin multiplier: `attention_factor`, else 0.1 ln(factor) + 1 (with mscale ratios)."""
    if s.get("attention_factor") is not None:
        return s["attention_factor"]

    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def _inv_freq_yarn(theta: float, dim: int, s: dict[str, Any], original_max: int,
                   max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies by `factor`, keep the high ones, ramp between the
    dimensions whose rotation counts over `original_max` lie between beta_slow and beta_fast."""
    factor = s["factor"] if s["factor"] is not None else max_pos / original_max
    attention_factor = _yarn_attention_factor(s, factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # dimension that turns `rotations` times over original_max
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)

    pos_freqs = theta ** _exponents(dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: keep the original frequency (high frequencies), 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def rope_tables(config: RopeConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq (rotary_dim/2,) fp32 on the CPU, attention_factor) of `config`'s rope type, for a
    sequence of `seq_len` tokens (only `dynamic` depends on it; None: max_position_embeddings).
    As transformers does, a partial rotation computes every rope type over the rotated dimensions."""
    s = config.rope_scaling or {}
    kind, theta, dim = rope_type(s), config.rope_theta, config.rotary_dim
    original_max = s.get("original_max_position_embeddings", config.max_position_embeddings)
    if kind == "default":
        return _inv_freq_default(theta, dim), 1.0
    if kind == "linear":
        return _inv_freq_default(theta, dim) / s["factor"], 1.0
    if kind == "dynamic":
        return _inv_freq_dynamic(theta, dim, s["factor"], config.max_position_embeddings, seq_len), 1.0
    if kind == "llama3":
        return _inv_freq_llama3(theta, dim, s, original_max), 1.0
    if kind == "yarn":
        return _inv_freq_yarn(theta, dim, s, original_max, config.max_position_embeddings)
    raise ValueError(f"rope_type={kind!r} is not supported; supported rope types: {', '.join(SUPPORTED_ROPE_TYPES)}")


class RotaryEmbedding:
    """The cos/sin tables of one model's RoPE; shared by the model and its pipeline stages.

    A plain object, not an nn.Module: its fp32 CPU frequencies are no state-dict entry, and
    `model.to(torch.bfloat16)` (or DeepSpeed's cast) cannot round them to 8 bits of mantissa.
    """

    def __init__(self, config: RopeConfig):
        self.config = config
        self.dynamic = depends_on_length(config.rope_scaling)
        self.inv_freq, self.attention_factor = rope_tables(config)  # (rd/2,), at the original length

    def __call__(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions 0..seq_len-1, each (T, rotary_dim) in `dtype`, scaled by the attention factor."""
        inv_freq = self.inv_freq
        if self.dynamic and seq_len > self.config.max_position_embeddings:
            inv_freq, _ = rope_tables(self.config, seq_len)  # NTK: a larger base for a longer sequence
        pos = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq.to(device))  # (T, rd/2)
        emb = angles(freqs, self.config.rope_interleaved)  # (T, rd)
        cos, sin = emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def angles(freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The angle of each rotated dimension from the (..., rd/2) angle of each pair: the pairs' angles
    repeated as [a0 a1 .. a0 a1 ..] (Llama: dimension i pairs with i + rd/2) or [a0 a0 a1 a1 ..]
    (interleaved, GLM: 2i pairs with 2i + 1)."""
    if interleaved:
        return torch.stack((freqs, freqs), dim=-1).flatten(-2)
    return torch.cat((freqs, freqs), dim=-1)
