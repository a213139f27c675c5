"""Compiling the kernels for an H100 (sm_90) without a GPU, with Triton's bundled ptxas: CI's compile check
(tests/compile_sm90.py) and the decode walks' instruction mix (tools/sass_mix.py); what a compiled kernel holds
(registers, local memory) and how many of its programs an SM runs at once. TRITON_INTERPRET must be unset in the
process that compiles."""

from __future__ import annotations

import inspect
import struct
from collections.abc import Iterable

import triton
from triton.backends.compiler import GPUTarget

from esm_turbo.kernels.common import FP_FUSION

#: pointer dtypes of the decode kernels' packed-cache arguments (others default to fp32)
CODE_PTRS = dict(k_idx_ptr="*u8", k_sign_ptr="*u8", v_idx_ptr="*u8", v_sign_ptr="*u8", len_ptr="*i64", page_ptr="*i64",
                 k_lay_ptr="*i32", v_lay_ptr="*i32")


def _aligned_attrs(fn, sig: dict, aligned: Iterable[str] | None) -> dict:
    """The specialization attributes a launch gives ``fn`` (signature ``sig``): every pointer and each integer named
    in ``aligned`` a multiple of 16; none where ``aligned`` is None."""
    if aligned is None:
        return {}
    aligned = set(aligned)
    return {(i,): [["tt.divisibility", 16]] for i, n in enumerate(inspect.signature(fn.fn).parameters)
            if n in aligned or sig.get(n, "").startswith("*")}


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
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=_aligned_attrs(fn, sig, aligned))
    options = dict(num_warps=num_warps, enable_fp_fusion=FP_FUSION) | (dict(maxnreg=maxnreg) if maxnreg else {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_gluon_sm90(fn, signature: dict, consts: dict, num_warps: int, fp_fusion: bool = FP_FUSION,
                       aligned: Iterable[str] | None = None):
    """A Gluon kernel ``fn`` compiled for sm_90: ``signature`` names every non-constexpr parameter's type (pointers
    ``*fp16``, scalars ``i32``, tensor descriptors ``tensordesc<fp16[128, 64],layout>``), ``consts`` the constexprs;
    FMA contraction as ``fp_fusion`` says; ``aligned`` as :func:`compile_sm90` takes it. Returns Triton's compiled
    kernel."""
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = dict(signature, **{name: "constexpr" for name in consts})
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=_aligned_attrs(fn, sig, aligned))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, enable_fp_fusion=fp_fusion))


#: an sm_90 multiprocessor's registers, warps, programs and shared memory (bytes; each program also reserves 1 KB)
SM90_REGISTERS, SM90_WARPS, SM90_PROGRAMS, SM90_SHARED = 65536, 64, 32, 233472


def resources(kernel) -> tuple[int, int]:
    """(registers a thread, bytes of local memory a thread: spills and stack) of a kernel compiled by
    :func:`compile_sm90`, read from its cubin's ``.nv.info`` section (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE)."""
    cubin = kernel.asm["cubin"]
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def section(i: int) -> tuple:  # ELF64 section header: name, type, flags, addr, offset, size, link, info, ...
        return struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)

    names = section(shstrndx)[4]
    found = {}
    for i in range(shnum):
        head = section(i)
        if cubin[names + head[0]:cubin.index(b"\0", names + head[0])] != b".nv.info":
            continue
        data, p = cubin[head[4]:head[4] + head[5]], 0
        while p < len(data):  # attributes: format, id, then (format 4) a u16 size and the value, (3) two bytes
            fmt, attr = data[p], data[p + 1]
            size = struct.unpack_from("<H", data, p + 2)[0] if fmt == 4 else 2 if fmt == 3 else 0
            start = p + (4 if fmt == 4 else 2)
            if fmt == 4 and size == 8:
                found[attr] = struct.unpack_from("<II", data, start)[1]  # (function symbol, value)
            p = start + size
    return found[0x2F], found.get(0x11, 0)


def resident_programs(kernel) -> int:
    """Programs of ``kernel`` one sm_90 multiprocessor holds at once, by registers (allocated 8 a thread at a time),
    warps, shared memory and the programs' own limit."""
    regs, _ = resources(kernel)
    warps = kernel.metadata.num_warps
    by_regs = SM90_REGISTERS // (-(-regs // 8) * 8 * 32 * warps)
    by_shared = SM90_SHARED // (kernel.metadata.shared + 1024)
    return min(by_regs, SM90_WARPS // warps, by_shared, SM90_PROGRAMS)


def loads_after_wait(kernel) -> list[str]:
    """The read-only-path global loads (``ld.global.nc``) of a compiled kernel's PTX after its
    ``griddepcontrol.wait``: [] when it has no wait. ptxas may move such a load ahead of the wait (the read-only path
    promises the data does not change while the kernel runs), so a programmatic dependent launch may read what the
    kernel before has not yet written: every load of the kernel before's results must be coherent."""
    ptx = kernel.asm["ptx"].splitlines()
    at = next((i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line), None)
    return [] if at is None else [line.strip() for line in ptx[at:] if "ld.global.nc" in line]
