"""Triton kernels (CUDA; tests also run them under Triton's interpreter): ``quantize`` (quantize-and-pack into the
cache) and ``decode`` (fused decode attention over it). Each has a PyTorch reference with the same contract in
``esm_turbo.ops.compressed``; which one runs is decided in ``esm_turbo.ops``."""

from __future__ import annotations

import functools
import re
import warnings

#: the oldest Triton the kernels build with: they read packed layouts through ``triton.constexpr_function`` (3.5)
MIN_TRITON = (3, 5)


def triton_version_ok(version: str) -> bool:
    """Whether a Triton version string (``3.6.0``, ``3.5.0+git1a2b``) is at least :data:`MIN_TRITON`."""
    return tuple(int(p) for p in re.findall(r"\d+", version)[:2]) >= MIN_TRITON


@functools.lru_cache(maxsize=1)
def triton_supported() -> bool:
    """Triton installed and at least :data:`MIN_TRITON`, so the kernels build (on a GPU, or under Triton's interpreter
    in tests). An older Triton is reported once."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return False
    import triton
    if not triton_version_ok(triton.__version__):
        warnings.warn(f"triton {triton.__version__} is older than {'.'.join(map(str, MIN_TRITON))}, which the "
                      "esm_turbo kernels need: decoding takes the PyTorch path", RuntimeWarning, stacklevel=2)
        return False
    return True


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """CUDA and a supported Triton (:func:`triton_supported`): the kernels run; else the PyTorch path is taken."""
    import torch
    return torch.cuda.is_available() and triton_supported()
