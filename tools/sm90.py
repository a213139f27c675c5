"""Compiling the kernels for an H100 (sm_90) without a GPU, with Triton's bundled ptxas: CI's compile check
(tests/compile_sm90.py) and the decode walk's instruction mix (tools/sass_mix.py). TRITON_INTERPRET must be
unset in the process that compiles."""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import triton
from triton.backends.compiler import GPUTarget

from esm_turbo.kernels.common import FP_FUSION

#: pointer dtypes of the decode kernels' packed-cache arguments (others default to fp32)
CODE_PTRS = dict(k_idx_ptr="*u8", k_sign_ptr="*u8", v_idx_ptr="*u8", v_sign_ptr="*u8", len_ptr="*i64", page_ptr="*i64",
                 k_lay_ptr="*i32", v_lay_ptr="*i32")


def compile_sm90(fn, consts: dict, ints: Iterable[str], ptrs: dict, num_warps: int = 2, maxnreg: int | None = None,
                 aligned: Iterable[str] | None = None):
    """``fn`` compiled for sm_90 as the wrappers launch it: constexprs from ``consts``, i32 scalars ``ints``, every
    other parameter a pointer (``ptrs`` names its dtype, default fp32), registers capped at ``maxnreg``, FMA
    contraction on. ``aligned``: the specialization a launch gets — every pointer 16-byte aligned and these integers
    multiples of 16 (Triton infers wide loads from them); None compiles without it. Returns Triton's compiled kernel
    (``.asm["cubin"]``, ``.asm["ptx"]``)."""
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in consts]
    assert not missing, f"{fn.fn.__name__}: no value for constexprs {missing}"
    ints = set(ints)
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in consts else "i32" if n in ints else ptrs.get(n, "*fp32") for n in names}
    attrs = {}
    if aligned is not None:
        aligned = set(aligned)
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                 if n in aligned or sig[n].startswith("*")}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    options = dict(num_warps=num_warps, enable_fp_fusion=FP_FUSION) | (dict(maxnreg=maxnreg) if maxnreg else {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
