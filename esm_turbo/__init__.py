"""esm_turbo: fast embeddings, a calibrated 3-bit(+sign) KV cache (TurboESM) and 4-bit weights for ESM-2 and ESM C,
with a PyTorch reference path and Triton kernels on CUDA. The public API is what this module exports.

Names are imported on first use (PEP 562), so a command imports only what it runs: ``esm-turbo embed`` never
pays for the calibration code or transformers' modelling classes it does not need.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: public name → the module that defines it
_EXPORTS = {
    "KVCache": ".cache", "MemoryReport": ".cache", "DecodeCache": ".cache_contract", "RowsView": ".cache_contract",
    "FastEsm": ".embed.fast_esm",
    "CheckpointError": ".errors", "EsmTurboError": ".errors", "FastaError": ".errors", "ModelLoadError": ".errors",
    "Record": ".fasta", "read_fasta": ".fasta", "read_fastas": ".fasta",
    "calibrate": ".model.calibrate",
    "PRESETS": ".model.checkpoint", "Calibration": ".model.checkpoint", "CalibrationConfig": ".model.checkpoint",
    "DecodeSession": ".model.engine", "StepOutput": ".model.engine", "TurboEsm": ".model.engine",
    "load_esm": ".model.loading", "model_fingerprint": ".model.loading",
    "ESM2_SIZES": ".model.sizes", "esm2_config": ".model.sizes", "ESMC_SIZES": ".model.sizes",
    "esmc_config": ".model.sizes", "FAMILIES": ".model.family", "family_of": ".model.family",
    "KVCodec": ".quant.codec", "VectorQuantizer": ".quant.codec", "dense_codec": ".quant.codec",
    "Quantizer": ".quant.codec", "FusedQuantizer": ".quant.codec",
    "KV_METHODS": ".quant.registry", "MethodRequest": ".quant.registry", "register_kv_method": ".quant.registry",
    "FitOptions": ".quant.fit", "fit_quantizer": ".quant.fit", "oblivious_codec": ".quant.fit",
    "lloyd_max": ".quant.lloyd_max", "lloyd_max_weighted": ".quant.lloyd_max",
    "open_embeddings": ".embed.h5",
    "EmbedConfig": ".embed.extract", "Embedder": ".embed.extract", "Fp8Weight": ".embed.fp8",
    "PagedKVCache": ".paged",
    "Alphabet": ".model.alphabet", "alphabet": ".model.alphabet", "encode": ".model.alphabet",
    "residue_ids": ".model.alphabet",
    "QuantizedLinear": ".weights.linear", "WeightQuantConfig": ".weights.codec", "quantize_model": ".weights.model",
    "load_quantized": ".weights.model", "save_quantized": ".weights.model",
    "stress_esm2": ".testing", "stress_esmc": ".testing", "plant_outliers": ".testing",
    "plant_product_outliers": ".testing",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'esm_turbo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
