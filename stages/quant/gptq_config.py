"""GPTQ's options (`quantize.gptq`) and one layer's result, apart from the algorithm
(`stages.quant.gptq`): packing, loading and evaluating a GPTQ checkpoint read these, and so do not
depend on the code that computes it (a change to the algorithm reruns only the GPTQ jobs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SUPPORTED_BITS = (2, 3, 4, 8)


@dataclass(frozen=True)
class GPTQConfig:
    """GPTQ options (`quantize.gptq` in the config), with AutoGPTQ's names. The defaults are
    AutoGPTQ's BaseQuantizeConfig's but three, measured on SmolLM2-135M (docs/quantization.md): act-order
    with static groups (a monotonic g_idx, so the file reads like a plain one) and the clipping search
    (mse 2.4, GPTQModel's option, off there by default)."""

    bits: int = 4  # 2, 3, 4 or 8
    group_size: int = 128  # input features per scale / zero point; -1 = one per output row
    sym: bool = True  # zero point fixed at 2**(bits - 1)
    desc_act: bool = True  # act-order: quantize columns by descending diag(H)
    static_groups: bool = True  # group parameters from the original weights, before any update
    damp_percent: float = 0.01  # fraction of mean(diag(H)) added to the diagonal
    block_size: int = 128  # columns per lazy batch update
    true_sequential: bool = True  # calibrate each Linear on the outputs of the already-quantized ones
    mse: float = 2.4  # > 0: clip each group's range where that lowers sum |w - w_hat|^mse (2.4: the paper's)

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"quantize.bits={self.bits} is not supported by GPTQ; choose one of {SUPPORTED_BITS}")
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"quantize.group_size={self.group_size} must be positive or -1 (per channel)")
        if not 0.0 < self.damp_percent < 1.0:
            raise ValueError(f"quantize.damp_percent={self.damp_percent} must lie in (0, 1); 0.01 is usual")
        if self.mse < 0:
            raise ValueError(f"quantize.gptq.mse={self.mse} must be >= 0 (0: no clipping search; 2.4 is usual)")
        if self.block_size <= 0:
            raise ValueError(f"quantize.block_size={self.block_size} must be positive")


@dataclass
class GPTQResult:
    """One quantized weight W (out, in), columns in the original order.

    codes:   (out, in) int32 in [0, 2**bits - 1]
    scales:  (out, G) float32, float16-exact; G = ceil(in / group_size), 1 per channel
    zeros:   (out, G) int32 in [1, 2**bits - 1]
    g_idx:   (in,) int32, the group of each input feature
    perm:    (in,) int64 processing order (perm[j] = the original column quantized j-th), None
             without desc_act
    weight:  (out, in) float32, the dequantized weights, = dequantize_gptq(self)
    loss:    GPTQ's proxy loss, sum_j ||w_j - q_j||^2 / (2 U[j, j]^2), for logging
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    perm: torch.Tensor | None
    weight: torch.Tensor
    bits: int
    group_size: int
    sym: bool
    loss: float = 0.0
