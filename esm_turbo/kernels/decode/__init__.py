"""Fused decode attention over the packed, compressed KV cache (Triton).

The PyTorch reference with the same contract is ``esm_turbo.ops.compressed.compressed_attention_reference``; the
design and its measurements are in ``docs/kernels.md``.

Cached keys and values stay in each head's *affine domain* ``y = (x Πᵀ − offset) / scale`` of its codec, so no
key is ever rotated back: the score of a cached key is ``⟨q̃, ŷ⟩ + c0`` with ``q̃ = (q Πᵀ) ⊙ scale`` (prepared once
per step) and ``c0 = ⟨q Πᵀ, offset⟩``, the same for every key of the query, so the walks drop it; values are
accumulated as ``Σ p ŷ`` and mapped back once at the end. The step's own keys and values are never rotated: Π is
orthogonal, so a new key's score less c0 is ``⟨q, k⟩ − c0`` and a new value joins the output after the rotation back.

Modules: ``codes`` (reading packed codes into values), ``walk`` (one query's online softmax over its share of the
prefix; split-K and stream-K kernels), ``merge`` (prep: queries into the keys' domain; merge: partials combined,
output mapped back, the step's own tokens added), ``small`` (the whole step in one launch for small steps), ``plan``
(launch planning and configuration), ``launch`` (the launcher). No dequantized tensor is written to global memory.

Constants: ``CODE_BITS`` (``KCODE_BITS`` / ``VCODE_BITS``) are the bits of one stored field
(:attr:`~esm_turbo.quant.layout.CodeLayout.code_bits`: the index, plus the sign where it is combined); ``T_CAP`` is
the positions a row can hold (a paged cache: its block table's width times ``PAGE``, the block size).
"""

from ..common import split_counters
from .launch import compressed_attention_triton
from .plan import launch_config, merge_rows, one_launch, plan_splits, stream_plan

__all__ = ["compressed_attention_triton", "launch_config", "merge_rows", "one_launch", "plan_splits",
           "split_counters", "stream_plan"]
