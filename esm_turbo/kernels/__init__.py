"""Triton kernels (CUDA only). Each has a PyTorch reference in ``esm_turbo.ops.reference``."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()
