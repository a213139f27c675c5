"""4-bit quantized weights on the GPU (Triton): the fused dequantize-and-multiply ``out = x_rot Ŵ_rotᵀ`` where
``Ŵ_rot[m, k] = codebook[code[m, k]] · scale[m, k / group]``, the rotation of the input per group, and the
dequantization of a whole weight back to the original domain for many rows. The PyTorch references with the same
contracts are :func:`matmul_reference`, ``QuantizedLinear.rotate_input`` and ``QuantPass.decode``;
``esm_turbo.weights.linear.QuantizedLinear`` picks between them.

The codes are read as int32 words, eight 4-bit codes a word, and each is looked up in the layer's 16-entry fp16
codebook in registers (``_lookup8``: PTX ``prmt`` byte permutes over the codebook's bytes, about 2.6 integer
instructions a code, no memory access; Triton's interpreter, which runs no PTX, gathers through memory instead).
The matmul, for one or two rows (:data:`GEMV_ROWS`) on the CUDA cores (``_gemv_kernel``), stays in the code words'
own layout: each word's eight products with an input row are summed in float32 and scaled once, into a float32 sum a
word, reduced once at the end (no tile reshaped or moved between threads). For more rows on the tensor cores
(``_dequant_matmul_kernel``): each program owns a [BLOCK_B, BLOCK_M] tile of the output and walks its run of input
channels BLOCK_K at a time, the decoded tile scaled per (row, group) and fed to a dot with the input tile; a layer
with few outputs splits its input channels over programs (float32 partial sums, added by the last program of each
tile to finish). Both add a bias and an earlier pass's output in the epilogue (then, for FFN up, the GELU); the
dequantized weight never reaches global memory. A rotation (the layer's Hadamard matrix, ±1 entries) is one small
dot per group of channels, in a launch of its own or after the LayerNorm that makes the input
(:func:`norm_rotate_triton`).

Modules: ``lookup`` (code words into weight values, in registers), ``matmul`` (the fused dequantize-and-multiply
kernels, their reference and launch rules), ``rotate`` (the input's rotation, alone or after a LayerNorm) and
``dequant`` (a whole weight back to the original domain).
"""

from .dequant import dequantize_triton
from .lookup import LOOKUP_REGS, codebook_bytes, lookup_word
from .matmul import GEMV_ROWS, launch_config, matmul_reference, matmul_triton
from .rotate import NORM_ROWS, norm_rotate_triton, rotate_triton, sign_matrix

__all__ = ["GEMV_ROWS", "LOOKUP_REGS", "NORM_ROWS", "codebook_bytes", "dequantize_triton", "launch_config",
           "lookup_word", "matmul_reference", "matmul_triton", "norm_rotate_triton", "rotate_triton", "sign_matrix"]
