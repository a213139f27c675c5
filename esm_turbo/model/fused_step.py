"""A decode step through FastEsm's fused blocks (:meth:`~esm_turbo.embed.fast_esm.FastEsm.fused_block`) on the
engine's own weights (shared, no copy): per block one QKV product, the query scaling and rotary embedding in one
launch, the cache written and attended as the installed attention does (:func:`~.attention.decode_attend`), each
residual add in one launch with the LayerNorm after it, GELU in one launch: a 650M-shaped step of 195 rows launches
403 kernels where transformers' layers launch 672. Over 4-bit weights (``esm_turbo.weights``) a step's products
run on the 4-bit kernels up to ``KERNEL_ROWS`` rows (:class:`~esm_turbo.weights.step.StepProduct`) and on the
dequantized weights past it. The hidden states are transformers' within the rounding of fp16
(``tests/test_fused_step.py``); an engine steps through transformers' layers where this path does not apply
(:func:`fused_step_applies`)."""

from __future__ import annotations

import torch

from .attention import RunContext, decode_attend


def fused_step_applies(engine, probed: bool) -> bool:
    """Whether ``engine``'s decode steps run the fused blocks: ``engine.fused_step`` when set, else (None) on CUDA
    with the Triton kernels, in fp16 or bf16, with dense or quantized weights on the device (no residual pass held on
    the host), and no probe watching each layer's attention (evaluation's probes see transformers' layers)."""
    if probed:
        return False
    if engine.fused_step is not None:
        return engine.fused_step
    from .. import ops
    weight = engine.embeddings.weight
    if not ops.use_kernels(weight) or weight.dtype not in (torch.float16, torch.bfloat16):
        return False
    return ((engine.dense_weights or engine.quantized_weights)
            and getattr(engine.model, "residual_offload", None) is None)


def fused_decode(fast, hidden: torch.Tensor, positions: torch.Tensor, ctx: RunContext) -> torch.Tensor:
    """Every block of ``fast`` (a :class:`~esm_turbo.embed.fast_esm.FastEsm` over the engine's weights) over a decode
    step's embedded tokens hidden [B, S, D] at positions [B, S], attending through ``ctx`` (mode ``decode``): the
    final LayerNorm of the last block's output, [B, S, D]."""
    batch, seq, dim = hidden.shape
    heads = fast.config.num_attention_heads
    cos, sin = fast.rotary_tables(positions.reshape(-1))

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        q, k, v = (t.view(batch, seq, heads, -1).transpose(1, 2) for t in (q, k, v))
        out = decode_attend(ctx, layer, q, k, v)
        return out.transpose(1, 2).reshape(batch * seq, dim)

    h, x = fast.first_norm(hidden.reshape(batch * seq, dim))
    for i in range(1, fast.num_layers + 1):
        h, x = fast.fused_block(i, h, x, cos, sin, attend)
    return x.view(batch, seq, dim)
