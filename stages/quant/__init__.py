"""Weight quantization: RTN and GPTQ (with its calibration sets), packing to the Hugging Face GPTQ
layout, and loading it back."""

from stages.quant.layers import decoder_linear_layers
from stages.quant.loader import load_quantized
from stages.quant.model import quantization_config, quantize_model

__all__ = ["decoder_linear_layers", "load_quantized", "quantization_config", "quantize_model"]
