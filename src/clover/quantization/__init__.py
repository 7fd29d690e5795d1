"""Weight-only quantization (int8 / int4, group-wise): the stored format, the modules, the converter."""

from .format import QuantSpec, dequantize, quantize
from .modules import QuantizedLinear, QuantizedWeight, quantizable, quantize_model

__all__ = ["QuantSpec", "quantize", "dequantize", "QuantizedWeight", "QuantizedLinear", "quantizable",
           "quantize_model"]
