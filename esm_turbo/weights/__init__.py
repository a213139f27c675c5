"""Quantized weights: ESM-2's block linears in 2-4 bits (rotated groups, a Lloyd-Max codebook, per-row scales)."""

from .codec import WeightQuantConfig
from .linear import QuantizedLinear
from .model import is_quantized_dir, load_quantized, quantize_model, save_quantized, weight_memory
from .offload import ResidualOffload, offload_residual

__all__ = ["QuantizedLinear", "ResidualOffload", "WeightQuantConfig", "is_quantized_dir", "load_quantized",
           "offload_residual", "quantize_model", "save_quantized", "weight_memory"]
