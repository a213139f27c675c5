"""Triton kernels (CUDA; tests also run them under Triton's interpreter). Each has a PyTorch reference with
the same signature in ``esm_turbo.ops.compressed``; dispatch is in ``esm_turbo.ops``."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    import importlib.util

    import torch
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()
