"""Compile every Triton kernel of esm_turbo for an H100 (sm_90) without a GPU, with Triton's bundled
ptxas, under the constexprs the wrappers use; prints one ``compiled <kernel> <cubin bytes>`` line each.
Run by tests/test_kernels.py::test_kernels_compile_for_sm90 (TRITON_INTERPRET must be unset)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tools/


from esm_turbo.bench import read  # noqa: E402
from esm_turbo.kernels import (activation, blocks, ffn_step, gemm, gemm_split, gemm_ws, quantize,  # noqa: E402
                               rope, segment, varlen_attention, varlen_attention_gluon, weights_mma, write)
from esm_turbo.kernels.weights import dequant, matmul, rotate  # noqa: E402
from esm_turbo.kernels import norm as add_norm  # noqa: E402
from esm_turbo.kernels.decode import merge, predicted, small, walk  # noqa: E402
from esm_turbo.kernels.decode import shared as shared_walk  # noqa: E402
from tools.sm90 import (CODE_PTRS, compile_gluon_sm90, compile_sm90 as compile_kernel, loads_after_wait,  # noqa: E402
                        resources)
from esm_turbo.quant.packing import packed_shifts  # noqa: E402
from esm_turbo.bench.synthetic import default_codec  # noqa: E402
from esm_turbo.kernels.decode import launch_config  # noqa: E402
from esm_turbo.ops.compressed import fused_tables  # noqa: E402
from esm_turbo.quant.layout import decode_grid  # noqa: E402


def compile_sm90(fn, consts: dict, ints: set, ptrs: dict, num_warps: int = 2, maxnreg: int | None = None):
    """``tools/sm90.compile_sm90`` (without a launch's specialization), printed with its cubin's size; returns the
    compiled kernel. A programmatic dependent launch reads nothing after its wait through the read-only path
    (``tools.sm90.loads_after_wait``)."""
    kernel = compile_kernel(fn, consts, ints, ptrs, num_warps, maxnreg)
    stale = loads_after_wait(kernel)
    assert not stale, (fn.fn.__name__, "reads through the read-only path after its wait", stale[:2])
    print("compiled", fn.fn.__name__, len(kernel.asm["cubin"]), flush=True)
    return kernel


SHARED_CONSTS = {p.name for p in shared_walk._shared_kernel.params if p.is_constexpr}


def main() -> None:
    u8, i64, f16 = "*u8", "*i64", "*fp16"
    codes = CODE_PTRS
    walk_consts = dict(BLOCK_T=32, PREFETCH=True, INTERPRET=0, ROWS=False, GRID=0, SLOTS=False, SUBN=False)
    small_ints = {"sqb", "sqh", "skb", "skh", "svb", "svh", "H", "T_CAP", "CHUNK", "NS"}
    small_ptrs = dict(codes, q_ptr=f16, k_ptr=f16, v_ptr=f16, valid_ptr=u8, count_ptr="*i32", out_ptr=f16,
                      k_sl_ptr="*i32", v_sl_ptr="*i32")
    codes = dict(codes, k_sl_ptr="*i32", v_sl_ptr="*i32")
    # fused 3+1-bit codes at d=64, and separate index/sign planes (3+1 keys, 2+1 values) at d=16; tables of
    # allocated widths (NK = d · codes per channel)
    # (field shifts compiled in for d = 64 — equal widths for keys, shared allocated ones for values — and field
    # layouts read per head at d = 16); fp16 tables for d = 16; each also as a grid codec's (values computed from the
    # codes: 5-bit fields at most at d = 64, 3 + sign at d = 16)
    shared = packed_shifts([5, 5, 4, 4, 4, 4, 3, 3])
    for d, kbits, ksign, vbits, vsign, nk, nv, kf, vf, tab in (
            (64, 4, False, 4, False, 64 * 16, 64 * 32, packed_shifts([4] * 8), shared, "*fp32"),
            (16, 3, True, 2, True, 16 * 32, 16 * 16, -1, -1, f16)):
        bits = dict(D=d, KCODE_BITS=kbits, KSIGN=ksign, VCODE_BITS=vbits, VSIGN=vsign, NK=nk, NV=nv, KFIELDS=kf,
                    VFIELDS=vf, **walk_consts)
        codes = dict(codes, k_tab_ptr=tab, v_tab_ptr=tab)
        small_ptrs = dict(small_ptrs, k_tab_ptr=tab, v_tab_ptr=tab)
        # each contiguous (PAGE = 0) and, for the grid codec, paged: blocks of whole tiles at d = 64 (a table entry
        # a tile), smaller than a tile at d = 16 (an entry a token); the grid codec's contiguous and the LUT's also
        # with one slot a token and kind read; grid codes decoded as subnormals, and contiguous also through 1.0's
        # exponent, and with the query gathered from q (keys' channels permuted: no prep launch)
        g = 5 if d == 64 else 4
        for grid, page, slots, subn, gather in ((0, 0, False, False, False), (g, 0, False, False, False),
                                                (g, 0, False, True, False), (g, 0, False, True, True),
                                                (g, 64 if d == 64 else 16, False, True, False),
                                                (0, 0, True, False, False), (g, 0, True, True, False)):
            paged = dict(page_ptr="*i32" if page else "*i64")
            consts = dict(bits, GRID=grid, PAGE=page, SLOTS=slots, SUBN=subn)
            walks = dict(codes, **paged, qt_ptr=f16 if gather else "*fp32", perm_ptr="*i32" if gather else "*i64")
            compile_sm90(walk._prefix_kernel, dict(consts, BLOCK_S=1, PDL=True, GATHER=gather),
                         {"H", "S", "T_CAP", "T0", "PS", "CHUNK", "NS", "sqb", "sqh", "sqs"}, walks)
            compile_sm90(small._small_kernel, dict(consts, BLOCK_NS=16), small_ints, dict(small_ptrs, **paged))
            compile_sm90(walk._stream_kernel, dict(consts, BLOCK_S=1, PDL=True, GATHER=gather),
                         {"H", "S", "T_CAP", "T0", "PS", "R", "NT", "W", "NS", "sqb", "sqh", "sqs"}, walks,
                         num_warps=1, maxnreg=168)
            # the shared prefix of a paged step's rows, read once for a group of queries: grid codes with leads of
            # their own and looked-up codes with row 0 leading
            for sg in (grid, 0) if page else ():
                sconsts = {n: v for n, v in dict(consts, GRID=sg).items() if n in SHARED_CONSTS}
                block_g, warps = shared_walk.shared_tiles(d)
                compile_sm90(shared_walk._shared_kernel,
                             dict(sconsts, BLOCK_S=1, BLOCK_T=shared_walk.BLOCK_T, BLOCK_G=block_g, GATHER=gather,
                                  LEADS=sg > 0, PRECISION="tf32x3"),
                             {"H", "S", "N", "SPAN", "CHUNK", "NS", "TABLE_W", "sqb", "sqh", "sqs"},
                             dict(walks, lead_ptr="*i32"), num_warps=warps)
    # the 3.0-bit default's stream-K walk (grid codes of 4 and 2 bits, subnormals, the query gathered) asking the
    # tile two on into L2, through a block table of whole tiles
    stream_ints = {"H", "S", "T_CAP", "T0", "PS", "R", "NT", "W", "NS", "sqb", "sqh", "sqs"}
    stream_ptrs = dict(CODE_PTRS, k_sl_ptr="*i32", v_sl_ptr="*i32", k_tab_ptr="*fp32", v_tab_ptr="*fp32",
                       page_ptr="*i32", qt_ptr=f16, perm_ptr="*i32")
    compile_sm90(walk._stream_kernel, dict(walk_consts, D=64, KCODE_BITS=4, KSIGN=False, VCODE_BITS=2, VSIGN=False,
                                           NK=64 * 16, NV=64 * 4, KFIELDS=packed_shifts([4] * 8), VFIELDS=-1, GRID=5,
                                           PAGE=64, SUBN=True, PREFETCH=2, BLOCK_S=1, PDL=True, GATHER=True),
                 stream_ints, stream_ptrs, num_warps=1, maxnreg=168)
    # the heads-of-16 default cache's stream-K walk at its launch (plan.LEAN_TILE / 16 = 128-token tiles, the tile two
    # on asked into L2), contiguous and, reading one slot a token and kind, through a block table of 16-token blocks
    # (an entry a token); no spills
    tables = fused_tables(default_codec(20, 16))
    key, value = tables.k_code, tables.v_code
    cfg = launch_config(16, key, value, 64, 20, 1, 4096)
    for page, slots in ((0, False), (16, True)):
        consts = dict(walk_consts, D=16, KCODE_BITS=key.code_bits, KSIGN=False, VCODE_BITS=value.code_bits, VSIGN=False,
                      NK=tables.k_tab[0].numel(), NV=tables.v_tab[0].numel(), KFIELDS=key.kernel_fields(),
                      VFIELDS=value.kernel_fields(), GRID=decode_grid(key, value), PAGE=page, SLOTS=slots,
                      SUBN=cfg["subnormal"], PREFETCH=cfg["prefetch"], BLOCK_T=cfg["block_t"], BLOCK_S=1, PDL=True,
                      GATHER=True)
        kernel = compile_sm90(walk._stream_kernel, consts, stream_ints,
                              dict(stream_ptrs, page_ptr="*i32" if page else i64), cfg["num_warps"], cfg["maxnreg"])
        assert resources(kernel)[1] == 0, ("_stream_kernel at heads of 16 spills", resources(kernel))
    strides = {f"s{t}{a}" for t in "qkv" for a in "bhs"}
    compile_sm90(merge._prep_kernel, dict(D=64, BLOCK_N=16, COLS=32, PRECISION="tf32x3", SPLIT16=True, PDL=True),
                 {"sqb", "sqh", "sqs", "B", "H", "S"}, dict(q_ptr=f16), num_warps=4)
    for block_b, block_s, block_ns, gather in ((16, 1, 8, False), (1, 2, 32, False), (16, 1, 8, True)):
        compile_sm90(merge._merge_kernel, dict(D=64, BLOCK_B=block_b, BLOCK_S=block_s, BLOCK_NS=block_ns, COLS=32,
                                                PRECISION="tf32x3", GATHER=gather),
                     strides | {"B", "H", "S", "NS", "NT", "W", "PS"},
                     dict(q_ptr=f16, k_ptr=f16, v_ptr=f16, valid_ptr=u8, out_ptr=f16,
                          perm_ptr="*i32" if gather else "*i64"), num_warps=4)
    # quantize-and-pack: shared allocated fields compiled in for keys (split by position in a prefill), each head's
    # layout row read for values; Π's fp16 halves read for keys, split in the kernel for values; a prefill
    # (programs per sequence, in blocks of 32 and in the 64-token blocks of the place-major path) and a decode step;
    # the last two also with grid codes (rounded, not searched); a decode step also into a paged pool (through a
    # block table); slots picked in a prefill of 64-token blocks (grid codes) and a paged decode step (LUT codes)
    for per_seq, block_n, grid, paged, slots in (
            (True, 32, False, False, False), (True, 64, False, False, False), (False, 32, False, False, False),
            (False, 32, False, True, False), (True, 64, True, False, False), (False, 32, True, False, False),
            (True, 64, True, False, True), (False, 32, False, True, True)):
        compile_sm90(quantize._quantize_pack_kernel,
                     dict(D=64, KINDEX_BITS=3, KK=16, KFIELDS=shared, KSIGN=True, KCOMB=True, VINDEX_BITS=3, VK=8,
                          VFIELDS=-1, VSIGN=True, VCOMB=False, BLOCK_N=block_n, PER_SEQ=per_seq, PRECISION="tf32x3",
                          KSPLIT=2,
                          VSPLIT=1, KPOS=per_seq, VPOS=False, KGRID=grid, VGRID=grid, ASM=True, PAGED=paged,
                          SLOTS=slots, RELATIVE=False, KNT=32, VNT=16),
                     strides | {"B", "H", "S", "PART_T", "PW"},
                     dict(k_ptr=f16, v_ptr=f16, k_rot=f16, k_idx=u8, k_sign=u8, v_idx=u8, v_sign=u8, pos_ptr=i64,
                          pages_ptr="*i32" if paged else i64, k_lay="*i32", v_lay="*i32", k_slot="*i32",
                          v_slot="*i32", scratch_ptr=i64, count_ptr="*i32"), num_warps=4,
                     maxnreg=96 if block_n == 64 else None)
    # 4-bit weights (codes read as int32 words, looked up in registers): groups of 32 (several scales per tile) with
    # a bias and an earlier pass added, and of 128 (one) with the input channels split over programs, fp16
    # activations on tensor cores; the CUDA-core kernel; the input rotated per group; the weight dequantized and
    # turned back to the original domain (fp32 tiles in fp16 halves)
    i32 = "*i32"
    # (split over programs, merged by the last to arrive; codes requested a tile ahead)
    # (the last also a programmatic dependent launch, its codes prefetched into L2)
    for group, extras, split, ahead, hop in ((32, True, 1, 0, 0), (128, False, 4, 1, 0), (32, True, 2, 1, 1)):
        compile_sm90(matmul._dequant_matmul_kernel, dict(BLOCK_B=16, BLOCK_M=32, BLOCK_K=256, GROUP=group,
                                                          HAS_PREV=extras, HAS_BIAS=extras, GELU=extras,
                                                          PRECISION="tf32", LUT=True, SPLIT=split, AHEAD=ahead,
                                                          PDL=hop, PREFETCH=hop),
                     {"B", "M", "N", "G", "sxb", "sob", "PR", "sxp"},
                     dict(x_ptr=f16, codes_ptr=i32, cb_ptr=f16, scales_ptr=f16, bias_ptr=f16, out_ptr=f16,
                          count_ptr=i32), num_warps=4)
    compile_sm90(matmul._gemv_kernel, dict(R=4, BLOCK_M=8, BLOCK_K=512, GROUP=32, HAS_PREV=True, HAS_BIAS=True,
                                            GELU=True, LUT=True, X16=True, STAGES=3, AHEAD=True),
                 {"B", "M", "N", "G", "sxb", "sob", "PR", "sxp"},
                 dict(x_ptr=f16, codes_ptr=i32, cb_ptr=f16, scales_ptr=f16, bias_ptr=f16, out_ptr=f16), num_warps=4)
    # the register-fed tensor-core kernel: 1–8 and 9–16 rows, 4 and 2 code words a lane, split over programs
    # (the second also a programmatic dependent launch, its codes and scales prefetched into L2; the last two with
    # a stage left out, as tools/weights_stages.py times them)
    # (and every step's codes before the walk, also as a programmatic dependent launch)
    for tiles, wl, split, extras, ahead, hop, probe, steps in (
            (1, 4, 1, True, 1, 0, 0, 0), (2, 4, 4, True, 1, 1, 0, 0), (2, 2, 2, False, 0, 0, 1, 0),
            (2, 4, 1, False, 1, 0, 2, 0), (2, 4, 1, True, 1, 0, 0, 5), (1, 4, 2, False, 1, 1, 0, 5)):
        compile_sm90(weights_mma._mma_kernel, dict(TILES=tiles, S=4, WL=wl, SPLIT=split, GROUP=32, HAS_PREV=extras,
                                                   HAS_BIAS=extras, GELU=extras, AHEAD=ahead, PDL=hop,
                                                   PREFETCH=hop, PROBE=probe, STEPS=steps),
                     {"B", "M", "N", "G", "sxb", "sob", "PR", "sxp", "zero"},
                     dict(x_ptr=f16, codes_ptr=i32, cb_ptr=f16, scales_ptr=f16, bias_ptr=f16, out_ptr=f16,
                          count_ptr=i32), num_warps=4)
    for norm, early in ((0, False), (2560, True)):  # the input rotated; layer-normalized (3B's width), then rotated,
        # a dependent launch that lets the product after it start at once
        compile_sm90(rotate._rotate_kernel, dict(BLOCK_B=16, BLOCK_K=256, GROUP=32, PRECISION="tf32", NORM=norm,
                                                 EARLY=early, DEPENDENT=early),
                     {"B", "N", "sxb"}, dict(x_ptr=f16, rot_scale="fp32", out_ptr=f16, w_ptr=f16, b_ptr=f16,
                                             y_ptr=f16, eps="fp32"), num_warps=4)
    # a decode step's query scaling and rotary embedding, q and k of 64-wide heads, eight heads a program
    compile_sm90(rope._rope_kernel, dict(H=40, D=64, DP=64, BH=8), {"S", "sqb", "sqs", "skb", "sks", "scb", "scs"},
                 dict(q_ptr=f16, k_ptr=f16, cos_ptr=f16, sin_ptr=f16, qo_ptr=f16, ko_ptr=f16, scale="fp32"),
                 num_warps=4)
    # an uncompressed cache's write of a step's keys and values, 64-wide heads, sixteen heads a program
    compile_sm90(write._write_rows_kernel, dict(D=64, DP=64, BH=16),
                 {"S", "H", "skb", "skh", "sks", "svb", "svh", "svs", "sbb", "sbh", "sbt", "scb", "sch", "sct"},
                 dict(k_ptr=f16, v_ptr=f16, kb_ptr=f16, vb_ptr=f16, pos_ptr=i64), num_warps=4)
    # FastEsm's residual add and LayerNorm (650M's width, 1 row a program; the LayerNorm alone at 3B's; 4 rows a
    # program at 8M's; ESMC-600M's scaled branch with an e4m3 output and row scales; ESM C's bias-free query/key
    # LayerNorm in place on strided rows)
    for d, block, rows, add, scaled, bias, fp8 in ((1280, 2048, 1, True, False, True, False),
                                                   (2560, 4096, 1, False, False, True, False),
                                                   (320, 512, 4, True, False, True, False),
                                                   (1152, 2048, 1, True, True, True, True),
                                                   (1152, 2048, 1, False, False, False, False)):
        compile_sm90(add_norm._add_ln_kernel, dict(D=d, BLOCK=block, ROWS=rows, ADD=add, SCALED=scaled, BIAS=bias,
                                                   FP8=fp8), {"n_rows", "h_stride", "x_stride"},
                     dict(h_ptr=f16, y_ptr=f16, w_ptr=f16, b_ptr=f16, s_ptr=f16, x_ptr="*fp8e4nv" if fp8 else f16,
                          xs_ptr="*fp32", eps="fp32", y_scale="fp32"), num_warps=4 if block <= 2048 else 8)
    # FastEsm's feed-forward activation and FP8 input quantization: GELU into e4m3 (its rows' maxima from their
    # bounding values, and from GELU over the row), SwiGLU in bf16 and into e4m3, the attention output into e4m3
    # (and the quantization alone with the rows' maxima known)
    form = activation.GELU_FORMS[activation.GELU_FORM]
    for kind, fp8, known, bounds in ((1, True, False, True), (1, True, False, False), (2, False, False, False),
                                     (2, True, False, False), (0, True, False, False), (0, True, True, False)):
        compile_sm90(activation._activation_kernel, dict(F=3072, BLOCK=1024, ROWS=4, KIND=kind, FP8=fp8,
                                                         KNOWN_AMAX=known, GELU=form, BOUNDS=bounds,
                                                         ARGMIN=activation.GELU_ARGMIN),
                     {"n_rows", "u_stride"}, dict(u_ptr="*bf16", out_ptr="*fp8e4nv" if fp8 else "*bf16",
                                                  scale_ptr="*fp32", amax_ptr="*fp32"), num_warps=4)
    # and GELU into e4m3 with each 650M-shaped row held in registers (one read)
    compile_sm90(activation._held_rows_kernel, dict(F=5120, HI=4096, LO=1024, KIND=1, GELU=form),
                 {"n_rows", "u_stride"}, dict(u_ptr="*bf16", out_ptr="*fp8e4nv", scale_ptr="*fp32"),
                 num_warps=activation.held_warps(5120))
    # products with their epilogue in warps of their own (Gluon: a loader warp, two warp groups of products, the
    # epilogue's warps): fp16 GELU with a bias (epilogue partitions of 2 + 1 warps, and 1 + 1; GELU's tanh form),
    # bf16 with none, e4m3 GELU with scales, a bias and the rows' maxima, fp16 and e4m3 QKV with the rotary embedding
    # at heads of 64 (no FMA contraction), specialized as ESM-2's shapes launch them (N, K and the strides multiples of
    # 16: 16-byte stores); no spills
    for dt, epi, has_bias, t in (("fp16", 1, True, gemm_ws.WsTile()), ("fp16", 1, True, gemm_ws.WsTile(epi_warps=1)),
                                 ("fp16", 1, True, gemm_ws.WsTile(gelu="tanh")),
                                 ("fp16", 1, True, gemm_ws.WsTile(gelu="exp2poly")),
                                 ("bf16", 0, False, gemm_ws.WsTile()),
                                 ("fp8e4nv", 1, True, gemm_ws.WS_FP8), ("fp16", 2, True, gemm_ws.WsTile()),
                                 ("fp8e4nv", 2, True, gemm_ws.WS_FP8)):
        fp8 = dt == "fp8e4nv"
        gdt = {"fp16": gemm_ws.gl.float16, "bf16": gemm_ws.gl.bfloat16, "fp8e4nv": gemm_ws.gl.float8e4nv}[dt]
        lay_a, lay_b = gemm_ws.operand_layouts(t, gdt)
        out = "bf16" if fp8 else dt
        sig = dict(a_desc=f"tensordesc<{dt}[{t.bm}, {t.bk}],{lay_a}>",
                   b_desc=f"tensordesc<{dt}[{t.bn}, {t.bk}],{lay_b}>", c_ptr=f"*{out}", bias_ptr=f"*{out}",
                   xs_ptr="*fp32", ws_ptr="*fp32", amax_ptr="*fp32", cos_ptr="*fp32", sin_ptr="*fp32", M="i32",
                   N="i32", K="i32", stride_c="i32", stride_amax="i32", stride_cos="i32", q_cols="i32", q_scale="fp32")
        kernel = compile_gluon_sm90(gemm_ws._ws_gemm_kernel, sig,
                                    gemm_ws.launch_constants(t, epi, has_bias, fp8, fp8 and epi == 1, 132), t.warps,
                                    fp_fusion=epi != gemm_ws.EPILOGUES["rope"],
                                    aligned={"N", "K", "stride_c", "stride_amax", "stride_cos", "q_cols"})
        assert resources(kernel)[1] == 0, f"_ws_gemm_kernel spills: {resources(kernel)}"
        print("compiled", "_ws_gemm_kernel", len(kernel.asm["cubin"]), flush=True)
    # FastEsm's products with folded epilogues, as kernels.gemm.TILES launches them: fp16 GELU through tensor
    # descriptors and through pointers, e4m3 QKV (bias) and FFN-down (residual) with row and column scales, e4m3 GELU
    # with the rows' maxima (GELU's erf in each form: the fit, and libdevice's where TILES keeps it; and GELU's tanh
    # form), fp16 and e4m3 QKV with the rotary embedding at heads of 64 (compiled here with FMA contraction on), the
    # 150M-shaped FFN-up tile (two programs a multiprocessor under a register cap); then the
    # attention of 64-token tiles at heads of 64 and of 32
    ints = {"M", "N", "K", "stride_am", "stride_wn", "stride_cm", "stride_rm", "stride_cos", "q_cols"}
    for dt, tile, epi, tma, amax in (("fp16", gemm.Tile(128, 256, 64, 3, 8, 8, True), 1, True, False),
                                     ("fp16", gemm.Tile(128, 256, 64, 3, 8, 8, True), 3, True, False),
                                     ("fp8e4nv", gemm.Tile(128, 256, 128, 4, 8, 8, True), 3, True, False),
                                     ("fp16", gemm.Tile(128, 256, 64, 3, 8, 8, True, gelu="erf"), 1, True, False),
                                     ("fp16", gemm.Tile(128, 256, 64, 3, 8, 8, True, gelu="tanh"), 1, True, False),
                                     ("fp16", gemm.TILES[5120, 1280, "float16", "gelu"], 1, True, False),
                                     ("fp16", gemm.Tile(128, 256, 64, 3, 8, 8, True), 2, False, False),
                                     ("fp8e4nv", gemm.Tile(128, 256, 128, 4, 8, 8, True), 0, True, False),
                                     ("fp8e4nv", gemm.Tile(128, 256, 128, 4, 8, 8, True), 2, True, False),
                                     ("fp8e4nv", gemm.Tile(128, 128, 128, 4, 8, 8, False), 1, True, True),
                                     ("fp16", gemm.Tile(128, 128, 64, 3, 8, 8, 2, programs=2, maxnreg=128), 1, True,
                                      False)):
        out = "bf16" if dt == "fp8e4nv" else dt
        desc = lambda rows: f"tensordesc<{dt}[{rows}, {tile.bk}]>"  # noqa: E731
        compile_sm90(gemm._gemm_kernel, dict(BM=tile.bm, BN=tile.bn, BK=tile.bk, GROUP_M=tile.group_m, NUM_SMS=132,
                                             TMA=tma, SUBTILE=tile.subtile, EPI=epi, HAS_BIAS=True,
                                             FP8=dt == "fp8e4nv", SCALED=False, AMAX=amax, WS=tile.ws,
                                             GELU=gemm.GELU_FORMS[tile.gelu], HD=64), ints,
                     dict(a_ptr=f"*{dt}", w_ptr=f"*{dt}", c_ptr=f"*{out}", bias_ptr=f"*{out}", res_ptr=f"*{out}",
                          a_desc=desc(tile.bm) if tma else f"*{dt}", w_desc=desc(tile.bn) if tma else f"*{dt}",
                          res_scale="fp32", q_scale="fp32"), num_warps=tile.warps, maxnreg=tile.maxnreg)
    # a step's few rows split along K (kernels.gemm_split): the last to arrive adds the partials, every epilogue (the
    # rotary one in 8 warps, as step_tile launches it)
    for epi, split in ((0, 8), (1, 2), (2, 16), (0, 1), (3, 4)):
        compile_sm90(gemm_split._split_gemm_kernel, dict(BM=64, BN=128, BK=64, SPLIT=split, EPI=epi, HAS_BIAS=True,
                                                         SCALED=True, GELU=gemm.GELU_FORMS[gemm.GELU_FORM], HD=64),
                     ints, dict(a_ptr=f16, w_ptr=f16, c_ptr=f16, bias_ptr=f16, res_ptr=f16, part_ptr="*fp32",
                                count_ptr="*i32", res_scale="fp32", q_scale="fp32"), num_warps=8 if epi == 3 else 4)
    # a block's feed-forward half at a step's rows in one persistent launch (grid barriers, W2 asked into L2), rows in
    # tiles of 64 and 16 (the latter's barrier sleeping between looks)
    for bm, prefetch, backoff in ((64, True, 0), (16, False, 200)):
        compile_sm90(ffn_step._ffn_step_kernel, dict(BM=bm, BN1=64, BN2=64, BK=64, SPLIT=6, BLOCK=2048, STAGE=0,
                                                     PREFETCH=prefetch, HAS_B1=True, HAS_B2=True, NORM_BIAS=True,
                                                     FORM=ffn_step.ACTIVATIONS["gelu"], BACKOFF=backoff),
                     {"M", "D", "FD", "sxm", "shm"},
                     dict(x_ptr=f16, w1_ptr=f16, b1_ptr=f16, f_ptr=f16, w2_ptr=f16, part_ptr="*fp32", b2_ptr=f16,
                          h_ptr=f16, nw_ptr=f16, nb_ptr=f16, s_ptr=f16, y_ptr=f16, words="*i32", branch_scale="fp32",
                          eps="fp32"), num_warps=4)
    for d, bn in ((64, 64), (64, 32), (32, 32)):  # varlen_attention.LENGTH_CLASSES' key tiles
        compile_sm90(varlen_attention._varlen_kernel, dict(D=d, DP=d, BM=64, BN=bn), {"n_blocks", "sq", "sk", "sv",
                                                                                        "so"},
                     dict(q_ptr=f16, k_ptr=f16, v_ptr=f16, o_ptr=f16, blocks_ptr="*i32", scale_log2e="fp32"),
                     num_warps=4)
    # the packed attention with each key tile's scores under the previous tile's softmax (Gluon), heads of 32 and 64,
    # 64-token key tiles in a ring of three; no spills
    for d in (32, 64):
        lay = varlen_attention_gluon.kv_layout(64, d, torch.float16)
        sig = dict(q_ptr=f16, k_desc=f"tensordesc<fp16[64, {d}],{lay}>", v_desc=f"tensordesc<fp16[64, {d}],{lay}>",
                   o_ptr=f16, blocks_ptr="*i32", n_blocks="i32", sq="i32", so="i32", scale_log2e="fp32")
        kernel = compile_gluon_sm90(varlen_attention_gluon._attention_kernel, sig,
                                    dict(D=d, BN=64, STAGES=3, num_warps=4), 4, aligned={"sq", "so"})
        assert resources(kernel)[1] == 0, f"_attention_kernel spills: {resources(kernel)}"
        print("compiled", "_attention_kernel", len(kernel.asm["cubin"]), flush=True)
    # FastEsm's query scaling and rotary embedding over (token, head) pairs, and its mean pooling of the residues
    compile_sm90(rope._rope_packed_kernel, dict(H=20, D=64, DP=64, P=32), {"n_pairs", "s_tok", "s_cos"},
                 dict(qkv_ptr=f16, cos_ptr="*fp32", sin_ptr="*fp32", qo_ptr=f16, ko_ptr=f16, scale="fp32"),
                 num_warps=4)
    compile_sm90(segment._segment_mean_kernel, dict(ROWS=32, BLOCK_D=128), {"D", "h_stride"},
                 dict(h_ptr=f16, starts_ptr="*i32", ends_ptr="*i32", out_ptr="*fp32"), num_warps=4)
    compile_sm90(dequant._dequant_kernel, dict(BLOCK_M=64, BLOCK_K=64, GROUP=32, ROTATE=True, HAS_PREV=True,
                                               PRECISION="tf32", LUT=True),
                 {"M", "N", "G"}, dict(codes_ptr=i32, cb_ptr=f16, scales_ptr=f16, rot_scale="fp32", out_ptr=f16),
                 num_warps=4)
    # a paged pool's blocks to and from staging rows (8-byte words)
    for to_pool in (True, False):
        compile_sm90(blocks._blocks_kernel, dict(TO_POOL=to_pool, BLOCK=2048), {"row_words"},
                     dict(stage_ptr=i64, base_ptr=i64, offset_ptr=i64, words_ptr=i64, slot_ptr=i64), num_warps=4)
    # the walks over values predicted from the keys at each ESM-2 head shape they take (fits), within a Hopper
    # program's shared memory and registers (no local memory: spills or stack), compiled as a launch specializes them
    # (pointers 16-byte aligned): LUT codes with a sign plane and a coded residual, and grid codes of the keys alone
    for heads, dim in ((20, 16), (20, 32), (20, 64), (40, 64)):
        if not predicted.fits(heads, dim):
            continue
        for grid, stored in ((False, True), (True, False)):
            fc, _ = predicted.feature_chunk(heads, dim)
            consts = dict(D=dim, HQ=predicted.query_heads(heads), KCB=4, KNC=16, KSIGN=not grid, KGRID=grid, PAGE=0,
                          FT=4)
            ptrs = dict(codes, k_main=u8, k_sign=u8, v_main=u8, v_sign=u8, k_tab=f16, v_tab=f16, p_ptr=f16, q_ptr=f16,
                        perm_ptr="*i32")
            for fn, extra, ints, warps in (
                    (predicted._scores_kernel, dict(HG=predicted.score_heads(heads, dim), BT=predicted.SCORE_T, VCB=2,
                                                    VNC=4, VSIGN=False, VGRID=grid, VSTORED=stored, POOL=False),
                     {"H", "S", "T_CAP", "CHUNK", "TILES", "NS", "NT", "sqb", "sqh", "sqs"}, predicted.SCORE_WARPS),
                    # the one-pass walk (a map within the scores walk's groups of heads)
                    (predicted._scores_kernel, dict(HG=predicted.score_heads(heads, dim), VCB=2, VNC=4, VSIGN=False,
                                                    BT=predicted.one_pass_tile(dim, stored), VGRID=grid,
                                                    VSTORED=stored, POOL=True),
                     {"H", "S", "T_CAP", "CHUNK", "TILES", "NS", "NT", "sqb", "sqh", "sqs"}, predicted.ONE_PASS_WARPS),
                    (predicted._pool_kernel, dict(FC=fc, BT=predicted.pool_tile(heads, dim),
                                                  BTS=predicted.SCORE_T),
                     {"H", "S", "T_CAP", "CHUNK", "TILES", "NS", "NF", "NT"}, predicted.pool_warps(heads, dim, grid))):
                kernel = compile_kernel(fn, dict(consts, **extra), ints, ptrs, num_warps=warps, aligned=())
                assert kernel.metadata.shared <= predicted.SM90_SHARED, (heads, dim, kernel.metadata.shared)
                assert resources(kernel)[1] == 0, (fn.fn.__name__, heads, dim, grid, "local memory")
                print("compiled", fn.fn.__name__, len(kernel.asm["cubin"]), flush=True)
    # the write's read-back of a token's keys as features (grid codes; LUT codes with a sign plane), at 20 heads of 64
    for grid in (True, False):
        compile_sm90(predicted._features_kernel, dict(D=64, HQ=32, KCB=4, KNC=16, KSIGN=not grid, KGRID=grid, PAGE=0,
                                                      FT=4),
                     {"H", "S", "T_CAP"}, dict(codes, k_main=u8, k_sign=u8, k_tab=f16, perm_ptr="*i32",
                                               pos_ptr="*i64"), num_warps=4)
    compile_sm90(predicted._predicted_merge_kernel, dict(D=64, HQ=32, BLOCK_NS=16, BLOCK_J=1, FB=128, NFB=10,
                                                         VSTORED=True, FT=4),
                 {"sqb", "sqh", "sqs", "skb", "skh", "sks", "svb", "svh", "svs", "H", "S", "NS", "HALF", "GROUP"},
                 dict(q_ptr=f16, k_ptr=f16, v_ptr=f16, kn_ptr=f16, vn_ptr=f16, valid_ptr=u8, w_ptr=f16, bias_ptr=f16,
                      out_ptr=f16), num_warps=4)
    # the bench's read-only floor
    compile_sm90(read._read_kernel, dict(BLOCK=read.WORDS_PER_WARP), {"n_chunks", "per_prog"},
                 dict(x_ptr="*i32", out_ptr="*i32"), num_warps=1)


if __name__ == "__main__":
    main()
