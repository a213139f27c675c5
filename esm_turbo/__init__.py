"""esm_turbo: a calibrated 3-bit(+sign) KV cache for ESM-2 (TurboESM), with a PyTorch reference path
and Triton kernels on CUDA. The public API is what this module exports."""

__version__ = "0.1.0"

from .cache import KVCache, MemoryReport  # noqa: E402
from .embed.fast_esm import FastEsm  # noqa: E402
from .errors import CheckpointError, EsmTurboError, FastaError, ModelLoadError  # noqa: E402
from .fasta import Record, read_fasta, read_fastas  # noqa: E402
from .model.calibrate import calibrate  # noqa: E402
from .model.checkpoint import PRESETS, Calibration, CalibrationConfig  # noqa: E402
from .model.engine import DecodeSession, StepOutput, TurboEsm  # noqa: E402
from .model.loading import load_esm, model_fingerprint  # noqa: E402
from .model.sizes import ESM2_SIZES, esm2_config  # noqa: E402
from .quant.codec import KVCodec, VectorQuantizer, dense_codec  # noqa: E402
from .quant.fit import FitOptions, fit_quantizer, oblivious_codec  # noqa: E402
from .quant.lloyd_max import lloyd_max, lloyd_max_weighted  # noqa: E402

__all__ = [
    "Calibration", "CalibrationConfig", "CheckpointError", "DecodeSession", "ESM2_SIZES", "EsmTurboError",
    "FastEsm", "FastaError", "FitOptions", "KVCache", "KVCodec", "MemoryReport", "ModelLoadError", "PRESETS", "Record", "StepOutput",
    "TurboEsm", "VectorQuantizer", "__version__", "calibrate", "dense_codec", "esm2_config", "fit_quantizer", "load_esm",
    "lloyd_max", "lloyd_max_weighted", "model_fingerprint", "oblivious_codec", "read_fasta", "read_fastas",
]
