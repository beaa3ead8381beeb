"""Weight quantization: RTN and GPTQ (with its calibration sets), packing to the Hugging Face GPTQ
layout, and loading it back onto low-bit CPU kernels (or dequantized, the float reference)."""

from stages.quant.layers import decoder_linear_layers
from stages.quant.loader import load_quantized
from stages.quant.model import quantization_config, quantize_model
from stages.quant.weight_only import (Int4WeightOnlyLinear, Int8WeightOnlyLinear, apply_weight_only_kernels,
                                      kernel_module)

__all__ = ["Int4WeightOnlyLinear", "Int8WeightOnlyLinear", "apply_weight_only_kernels", "decoder_linear_layers",
           "kernel_module", "load_quantized", "quantization_config", "quantize_model"]
