"""Weight-only low-bit Linear layers that compute on the packed codes with torch's CPU kernels, the
way torchao's int8 / int4 weight-only layouts call them, so that a GPTQ-layout checkpoint is
evaluated with its real low-bit weights instead of a float copy.

Every quantized weight here is W[o, k] = s[o, g(k)] * (q[o, k] - z[o, g(k)]) (out, in), with codes q,
scales s and zero points z per group of input features (`GroupedCodes`, read from the GPTQ tensors).

`Int8WeightOnlyLinear` (8 bits, one group per output channel): codes stored as q - 128 (int8) and

    y = x W^T + b = _weight_int8pack_mm(x, q - 128, s) - rowsum(x) (x) (s * (z - 128)) + b

i.e. the kernel computes the symmetric part x (s * (q - 128))^T, and the zero point enters as a
rank-1 correction (the outer product of x's row sums with s * (z - 128); zero when z = 128).

`Int4WeightOnlyLinear` (codes of 2, 3 or 4 bits, groups of 32-256 input features):
`_weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)` dequantizes
w = (q - 8) * scale + zero per group (verified against its output), so our W = s * (q - z) is
scale = s, zero = s * (8 - z). Act-order checkpoints (a non-monotonic g_idx) have the weight's input
columns permuted into group order at load time and x's columns gathered in the forward pass,
x[..., perm], as exllama does: x W^T = x[..., perm] W[:, perm]^T.

Both compute in `compute_dtype` (the dtype of their scales; bfloat16 by default): with bfloat16
inputs the kernels are the fast path (2048 x 2048 at batch 1: int8 ~6x, int4 ~45x faster than with
float32 inputs), with float32 they are slower than a float32 matmul. The output comes back in the
input's dtype. Precision is then bfloat16's: x and s are rounded to 8 significant bits, int4's zero
term s * (8 - z) too (at most 1/64 of a quantization step per group row).

What the kernels accept (torch 2.13, found by experiment; anything else falls back, see
`kernel_module`):
- int8: in_features a multiple of 16 (the bfloat16 kernel reads past the row otherwise: wrong
  values or a segfault); any out_features; one group per row.
- int4: out_features a multiple of 16 (`_convert_weight_to_int4pack_for_cpu` refuses others); a
  kernel group size of 32, 64, 128 or 256 dividing in_features. A checkpoint's groups of c
  features are run as groups of the largest of those dividing c (scales repeated), so per-channel
  and groups of 512 or 1024 run too, and a narrower last group (GPTQ's g128 on a 576-wide layer)
  is padded with zero input columns to a whole group; groups of 16 or 40 do not run. The
  packed layout is (out, in / 2) uint8 whatever inner_k_tiles is.
Layers they cannot take become a plain float `nn.Linear` holding the dequantized W ("dequantized"),
never an approximation of it.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from stages.quant.gptq_format import format_of, unpack_bits, zero_offset
from stages.quant.layers import LINEAR_TYPES

log = logging.getLogger(__name__)

INT8_IN_MULTIPLE = 16
INT4_OUT_MULTIPLE = 16
INT4_GROUP_SIZES = (256, 128, 64, 32)  # what _weight_int4pack_mm_for_cpu accepts, largest first
INT4_INNER_K_TILES = 8  # torchao's default; the CPU packing ignores it
KERNELS = ("int8pack", "int4pack", "dequantized")


class UnsupportedLayout(ValueError):
    """A layer's shape or grouping that a low-bit kernel cannot run; the message says which rule."""


@dataclass
class GroupedCodes:
    """One layer's quantized weight, W[o, k] = scales[o, g_idx[k]] * (codes[o, k] - zeros[o, g_idx[k]]).

    codes:  (out, in) int32 in [0, 2**bits - 1]
    scales: (out, G) float32
    zeros:  (out, G) int32
    g_idx:  (in,) int64 group of each input feature (any order: act-order, a narrower last group)
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    bits: int

    @classmethod
    def from_gptq(cls, tensors: dict[str, torch.Tensor], bits: int, checkpoint_format: str) -> GroupedCodes:
        """From a layer's GPTQ tensors {"qweight", "qzeros", "scales", "g_idx"} (`stages.quant.gptq_format`)."""
        codes = unpack_bits(tensors["qweight"], bits).t().contiguous()  # (out, in)
        stored = unpack_bits(tensors["qzeros"].t().contiguous(), bits)  # (out, G)
        # z = stored + offset, wrapping modulo 2**bits as gptq_format's reader does
        zeros = torch.remainder(stored + zero_offset(checkpoint_format), 2**bits).to(torch.int32)
        return cls(codes=codes, scales=tensors["scales"].t().float().contiguous(), zeros=zeros,
                   g_idx=tensors["g_idx"].long(), bits=bits)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """W (out, in) float32."""
        g = self.g_idx
        return self.scales[:, g] * (self.codes.float() - self.zeros[:, g].float())


class Int8WeightOnlyLinear(nn.Module):
    """y = x W^T + b with W = s[:, None] * (q - z[:, None]) (out, in), q in [0, 255], one scale and zero
    point per output channel:

        y = _weight_int8pack_mm(x, q - 128, s) - rowsum(x) (x) (s * (z - 128)) + b

    Buffers: weight_int8 (out, in) int8 = q - 128; scales (out,) in compute_dtype; zero_correction
    (out,) float32 = s * (z - 128) with s as rounded to compute_dtype (None when every z is 128);
    bias (out,) float32 or None. Build with `from_codes`."""

    kernel = "int8pack"

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, zero_correction: torch.Tensor | None,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scales", scales)
        self.register_buffer("zero_correction", zero_correction)
        self.register_buffer("bias", bias)

    @classmethod
    def from_codes(cls, w: GroupedCodes, bias: torch.Tensor | None = None,
                   compute_dtype: torch.dtype = torch.bfloat16) -> Int8WeightOnlyLinear:
        """UnsupportedLayout unless `w` is 8-bit with one group and in_features % 16 == 0."""
        out_f, in_f = w.shape
        if w.bits != 8 or w.scales.shape[1] != 1:
            raise UnsupportedLayout(f"int8pack needs 8-bit codes with one group per row, got {w.bits} bits "
                                    f"in {w.scales.shape[1]} groups")
        if in_f % INT8_IN_MULTIPLE:
            raise UnsupportedLayout(f"int8pack needs in_features divisible by {INT8_IN_MULTIPLE}, got {in_f}")
        scales = w.scales[:, 0].to(compute_dtype)  # (out,)
        zeros = w.zeros[:, 0].float()  # (out,)
        correction = scales.float() * (zeros - 128) if bool((zeros != 128).any()) else None
        q = (w.codes - 128).to(torch.int8)  # (out, in)
        return cls(q, scales, correction, None if bias is None else bias.detach().float().clone())

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.scales.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xc = x.reshape(-1, self.in_features).to(self.compute_dtype).contiguous()  # (M, in)
        y = torch.ops.aten._weight_int8pack_mm(xc, self.weight_int8, self.scales)  # (M, out)
        if self.zero_correction is not None:
            # y - rowsum(x) (x) s(z - 128), in float32: the two terms can nearly cancel
            y = torch.addr(y.float(), xc.sum(-1, dtype=torch.float32), self.zero_correction.float(), alpha=-1)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"compute_dtype={self.compute_dtype}, zero_points={self.zero_correction is not None}, "
                f"bias={self.bias is not None}")


def int4_group_size(w: GroupedCodes) -> tuple[int, torch.Tensor | None, int]:
    """(kernel group size, input permutation or None, padding) under which `w` runs on the int4
    kernel: sorting the input features by g_idx (stably) must give G runs of c features, the last
    possibly shorter (GPTQ's narrower last group: it is padded with `padding` zero-input columns to
    c), and the kernel group size is the largest of 256/128/64/32 dividing c. UnsupportedLayout
    otherwise."""
    out_f, in_f = w.shape
    if w.bits > 4:
        raise UnsupportedLayout(f"int4pack needs codes of at most 4 bits, got {w.bits}")
    if out_f % INT4_OUT_MULTIPLE:
        raise UnsupportedLayout(f"int4pack needs out_features divisible by {INT4_OUT_MULTIPLE}, got {out_f}")
    counts = torch.bincount(w.g_idx, minlength=w.scales.shape[1])  # (G,) features per group
    c = int(counts[0])
    if not bool((counts[:-1] == c).all()) or not 0 < int(counts[-1]) <= c:
        raise UnsupportedLayout(f"int4pack needs groups of equal size but the last, got sizes "
                                f"{sorted(set(counts.tolist()))} (an empty or uneven group)")
    group = next((gs for gs in INT4_GROUP_SIZES if c % gs == 0), None)
    if group is None:
        raise UnsupportedLayout(f"int4pack needs a group size divisible by one of {INT4_GROUP_SIZES[::-1]}, got {c}")
    monotonic = bool((w.g_idx[1:] >= w.g_idx[:-1]).all())
    perm = None if monotonic else torch.argsort(w.g_idx, stable=True)
    return group, perm, c - int(counts[-1])


class Int4WeightOnlyLinear(nn.Module):
    """y = x W^T + b with W[o, k] = s[o, g(k)] * (q[o, k] - z[o, g(k)]), codes of at most 4 bits in
    groups of input features, on `_weight_int4pack_mm_for_cpu`, which computes
    w = (q - 8) * scale + zero per group; hence scale = s, zero = s * (8 - z).

    Buffers: weight_int4pack (out, in / 2) uint8, the codes with the input features in group order;
    scales_and_zeros (in / group_size, out, 2) in compute_dtype; perm (in,) int64, the input feature
    at each packed column, or None when g_idx is monotonic; bias (out,) float32 or None.
    Build with `from_codes`."""

    kernel = "int4pack"

    def __init__(self, weight_int4pack: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 perm: torch.Tensor | None = None, bias: torch.Tensor | None = None, padding: int = 0):
        super().__init__()
        self.out_features = weight_int4pack.shape[0]
        self.padding = padding  # zero input columns appended to fill a narrower last group
        self.in_features = weight_int4pack.shape[1] * 2 - padding
        self.group_size = group_size
        self.register_buffer("weight_int4pack", weight_int4pack)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("perm", perm)
        self.register_buffer("bias", bias)

    @classmethod
    def from_codes(cls, w: GroupedCodes, bias: torch.Tensor | None = None,
                   compute_dtype: torch.dtype = torch.bfloat16) -> Int4WeightOnlyLinear:
        """UnsupportedLayout when `w` breaks a rule of `int4_group_size`."""
        group, perm, padding = int4_group_size(w)
        codes, g = (w.codes, w.g_idx) if perm is None else (w.codes[:, perm], w.g_idx[perm])  # (out, in)
        if padding:  # any code will do: its input column is always zero
            codes = torch.nn.functional.pad(codes, (0, padding), value=8)  # (out, in + padding)
            g = torch.cat([g, g[-1:].expand(padding)])
        first = g[::group]  # (in / group,) the checkpoint group of each kernel group
        scales = w.scales[:, first].t()  # (in / group, out)
        zeros = w.zeros[:, first].t().float()
        scales_and_zeros = torch.stack([scales, scales * (8 - zeros)], dim=-1).to(compute_dtype)  # (n, out, 2)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(),
                                                                     INT4_INNER_K_TILES)  # (out, in / 2)
        return cls(packed, scales_and_zeros.contiguous(), group, perm,
                   None if bias is None else bias.detach().float().clone(), padding)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xc = x.reshape(-1, self.in_features).to(self.compute_dtype)  # (M, in)
        if self.perm is not None:
            xc = xc.index_select(-1, self.perm)  # (M, in) columns in group order
        if self.padding:
            xc = torch.nn.functional.pad(xc, (0, self.padding))  # (M, in + padding)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xc.contiguous(), self.weight_int4pack, self.group_size,
                                                       self.scales_and_zeros)  # (M, out)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"compute_dtype={self.compute_dtype}, act_order={self.perm is not None}, bias={self.bias is not None}")


def dequantized_linear(w: GroupedCodes, bias: torch.Tensor | None = None) -> nn.Linear:
    """The fallback: a float32 nn.Linear holding W = s * (q - z) exactly as `GroupedCodes.dequantize`."""
    out_f, in_f = w.shape
    linear = nn.Linear(in_f, out_f, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(w.dequantize(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().float().clone(), requires_grad=False)
    return linear


def kernel_module(w: GroupedCodes, bias: torch.Tensor | None = None,
                  compute_dtype: torch.dtype = torch.bfloat16) -> tuple[nn.Module, str]:
    """(module computing x W^T + b, kernel name): int8pack for 8-bit per-channel codes, int4pack for
    codes of at most 4 bits, else (or when the kernel's shape rules fail) the dequantized nn.Linear."""
    build = Int8WeightOnlyLinear if w.bits == 8 else Int4WeightOnlyLinear
    try:
        return build.from_codes(w, bias, compute_dtype), build.kernel
    except UnsupportedLayout as e:
        log.debug("falling back to a dequantized Linear: %s", e)
        return dequantized_linear(w, bias), "dequantized"


def _linear_shape(module: nn.Module, transposed: bool) -> tuple[int, int]:
    """(out, in) of a Linear, or of a Conv1D (weight stored (in, out))."""
    rows, cols = module.weight.shape
    return (cols, rows) if transposed else (rows, cols)


def apply_weight_only_kernels(model: nn.Module, packed_state: dict[str, torch.Tensor], quantization_config: dict,
                              transposed: dict[str, bool], *,
                              compute_dtype: torch.dtype = torch.bfloat16) -> dict[str, str]:
    """Replace each Linear / Conv1D `<name>` of `model` that has `<name>.qweight` in `packed_state`
    (the GPTQ tensors, zero points stored as quantization_config's `format` says) by the module of
    `kernel_module`; its bias is taken from the replaced module (loaded by transformers).
    `transposed` ({name: weight stored (in, out)}, `stages.quant.layers.linear_layers`) tells a
    Conv1D's (out, in). Returns {name: "int8pack" | "int4pack" | "dequantized"}.

    ValueError naming the layer when a packed name is not a Linear / Conv1D of `model` or its
    (out, in) differs from the packed codes'."""
    bits = int(quantization_config["bits"])
    fmt = format_of(quantization_config)
    names = [k.removesuffix(".qweight") for k in packed_state if k.endswith(".qweight")]
    kernels: dict[str, str] = {}
    for name in names:
        old = model.get_submodule(name) if name in transposed else None
        if not isinstance(old, LINEAR_TYPES):
            raise ValueError(f"checkpoint tensor {name}.qweight names no Linear / Conv1D of {type(model).__name__}")
        w = GroupedCodes.from_gptq({s: packed_state[f"{name}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")},
                                   bits, fmt)
        if _linear_shape(old, transposed[name]) != w.shape:
            raise ValueError(f"{name}: packed weight (out, in) = {w.shape} does not match the model's layer "
                             f"{_linear_shape(old, transposed[name])}")
        new, kernels[name] = kernel_module(w, old.bias, compute_dtype)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    log.info("weight-only kernels: %s", dict(Counter(kernels.values())))
    return kernels
