"""The instruction mix of the stream-K decode walk's tile loop (sm_90 SASS), compiled without a GPU as a launch on the
bench's default cache compiles it: the default codec's widths, fields and grid, one warp, 168 registers, and the
specialization Triton gives a launch (S = 1 a constant; pointers and T_CAP, T0, PS, R and NT divisible by 16).
A listing compiled without that specialization loads its codes 32 bits at a time and counts other instructions.

    python tools/sass_mix.py            # head_dim 64 (650M-shaped) and 128 (15B-shaped); the 3.0-bit default at 64
    python tools/sass_mix.py --dump DIR # also writes each kernel's PTX and SASS there
    python tools/sass_mix.py --predicted # the two walks over values predicted from the keys, per cached token,
                                         # and their registers and programs an SM (occupancy)

Needs Triton's NVIDIA backend (its bundled ptxas and nvdisasm); TRITON_INTERPRET must be unset."""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import subprocess
import tempfile

import sys

import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))  # the repository's tools/

from esm_turbo.bench.synthetic import default_codec  # noqa: E402
from esm_turbo.kernels.decode import launch_config, walk  # noqa: E402
from esm_turbo.model.recipe import recipe  # noqa: E402
from esm_turbo.ops.compressed import fused_tables  # noqa: E402
from esm_turbo.quant.layout import decode_grid  # noqa: E402
from tools.sm90 import CODE_PTRS, compile_sm90, resident_programs, resources  # noqa: E402


def compile_stream(d: int, index_bits: int = 3, subnormal: bool | None = None):
    """The stream kernel for a 20- (d = 64) or 40-head (d = 128) default codec at ``index_bits`` mean index bits a
    value (3: 4.0 bits all-in; 2: 3.0, code words of 4 and 2 bits), compiled for sm_90 with a launch's specialization
    (S = 1; pointers and T_CAP, T0, PS, R and NT multiples of 16), its codes decoded as subnormals or not
    (``subnormal``; None: as the launch's default): (kernel, its block_t)."""
    heads = 20 if d == 64 else 40
    tables = fused_tables(default_codec(heads, d, recipe=recipe("default", index_bits).resolved()))
    key, value = tables.k_code, tables.v_code
    cfg = launch_config(d, key, value, 64, heads, 1, 16384)  # a step the stream-K walk takes
    consts = dict(D=d, KCODE_BITS=key.code_bits, VCODE_BITS=value.code_bits, KFIELDS=key.kernel_fields(),
                  VFIELDS=value.kernel_fields(), KSIGN=key.sign == "plane", VSIGN=value.sign == "plane", BLOCK_S=1,
                  BLOCK_T=cfg["block_t"], NK=tables.k_tab[0].numel(), NV=tables.v_tab[0].numel(),
                  PREFETCH=cfg["prefetch"], INTERPRET=0, ROWS=cfg["rows"], GRID=decode_grid(key, value), PDL=True, S=1,
                  PAGE=0, SLOTS=False, SUBN=cfg["subnormal"] if subnormal is None else subnormal,
                  GATHER=False)
    assert cfg["stream"], "the default cache's walk at this shape is the stream-K kernel"
    ints = ("H", "T_CAP", "T0", "PS", "R", "NT", "W", "NS", "sqb", "sqh", "sqs")
    kernel = compile_sm90(walk._stream_kernel, consts, ints, CODE_PTRS, num_warps=cfg["num_warps"],
                          maxnreg=cfg["maxnreg"], aligned=("T_CAP", "T0", "PS", "R", "NT"))
    return kernel, cfg["block_t"]


def disassemble(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout


def tile_loop(sass: str) -> list[str]:
    """The instructions of the innermost loop that loads (LDG): the tile loop (the row loop around it is larger)."""
    labels, instrs = {}, []
    for line in sass.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(instrs)
        elif m := re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line):
            instrs.append(m.group(1))
    loops = [instrs[labels[m.group(1)]:i + 1] for i, ins in enumerate(instrs)
             if (m := re.search(r"BRA\s+`?\(?(\.L_x_\d+)", ins)) and labels.get(m.group(1), i + 1) <= i]
    loops = [body for body in loops if any(" LDG" in f" {x}" for x in body)]
    if not loops:
        raise RuntimeError("no loop with global loads in the listing")
    return min(loops, key=len)


def opcode_mix(body: list[str]) -> collections.Counter:
    """Opcodes (predicates and modifiers dropped) of a loop body."""
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in body)


#: the step whose grids the occupancy lines size (queries × cached tokens a row), and an H100's multiprocessors
OCCUPANCY_QUERIES, OCCUPANCY_T, H100_SMS = 64, 4096, 132


def predicted_mix() -> None:
    """Warp instructions a cached token and query of the predicted-values walks (``kernels.decode.predicted``: the
    scores walk over every head, the pooling walk over every feature chunk), compiled as their launches compile them
    (pointers 16-byte aligned) for the bench's default codec (grid codes, sign combined into the code word: 4-bit
    words of keys, 2-bit of the coded residual), beside the plain 3.0-bit walk's (the stream-K kernel, one warp a
    head) at 20 heads of 64."""
    from esm_turbo.kernels.decode import predicted
    u8, f16 = "*u8", "*fp16"
    ptrs = dict(CODE_PTRS, k_main=u8, k_sign=u8, v_main=u8, v_sign=u8, k_tab=f16, v_tab=f16, p_ptr=f16, q_ptr=f16,
                perm_ptr="*i32")
    for heads, dim in ((20, 16), (20, 32), (20, 64), (40, 64)):
        fc, nf = predicted.feature_chunk(heads, dim)
        hg = predicted.score_heads(heads, dim)
        groups = -(-heads // hg)
        consts = dict(D=dim, HQ=predicted.query_heads(heads), KCB=4, KNC=16, KSIGN=False, KGRID=True, PAGE=0, FT=4)
        rows, kernels = [], []
        for stored in (False, True):
            scores = compile_sm90(predicted._scores_kernel, dict(consts, HG=hg, BT=predicted.SCORE_T, VCB=2, VNC=4,
                                                                VSIGN=False, VGRID=True, VSTORED=stored, POOL=False),
                                  ("H", "S", "T_CAP", "CHUNK", "TILES", "NS", "NT", "sqb", "sqh", "sqs"), ptrs,
                                  num_warps=predicted.SCORE_WARPS, aligned=())
            kernels.append(scores)
            rows.append(len(tile_loop(disassemble(scores.asm["cubin"]))) * predicted.SCORE_WARPS * groups
                        / predicted.SCORE_T)
        bt, warps = predicted.pool_tile(heads, dim), predicted.pool_warps(heads, dim, True)
        pool = compile_sm90(predicted._pool_kernel, dict(consts, FC=fc, BT=bt, BTS=predicted.SCORE_T),
                            ("H", "S", "T_CAP", "CHUNK", "TILES", "NS", "NF", "NT"), ptrs,
                            num_warps=warps, aligned=())
        pooled = len(tile_loop(disassemble(pool.asm["cubin"]))) * warps * nf / bt
        one = compile_sm90(predicted._scores_kernel, dict(consts, HG=hg, BT=predicted.one_pass_tile(dim, False), VCB=2,
                                                          VNC=4, VSIGN=False, VGRID=True, VSTORED=False, POOL=True),
                           ("H", "S", "T_CAP", "CHUNK", "TILES", "NS", "NT", "sqb", "sqh", "sqs"), ptrs,
                           num_warps=predicted.ONE_PASS_WARPS, aligned=())
        kernels.append(one)
        one_pass = len(tile_loop(disassemble(one.asm["cubin"]))) * predicted.ONE_PASS_WARPS * groups \
            / predicted.one_pass_tile(dim, False)
        line = (f"{heads} heads of {dim}: scores walk {rows[0]:.0f} (the residual's sums too: {rows[1]:.0f}) "
                f"+ pooling walk {pooled:.0f} = {rows[0] + pooled:.0f} ({rows[1] + pooled:.0f}); one pass over a "
                f"map within the scores walk's groups {one_pass:.0f}")
        if (heads, dim) == (20, 64):
            kernel, block_t = compile_stream(dim, 2)
            plain = len(tile_loop(disassemble(kernel.asm["cubin"]))) * heads / block_t
            line += f"; the plain 3.0-bit walk {plain:.0f}"
        print(line, flush=True)
        for label, kernel, programs in (("scores walk", kernels[0], groups), ("residual's too", kernels[1], groups),
                                        ("pooling walk", pool, nf), ("one pass", kernels[2], groups)):
            splits = predicted.walk_splits(OCCUPANCY_QUERIES, heads, dim, OCCUPANCY_T, H100_SMS, label == "one pass")
            regs, local = resources(kernel)
            resident, warps = resident_programs(kernel), kernel.metadata.num_warps
            grid = OCCUPANCY_QUERIES * splits * programs
            print(f"  {label}: {regs} registers, {local} B local, {kernel.metadata.shared // 1024} KB shared a "
                  f"program of {warps} warps; {resident} an SM ({resident * warps} warps); B={OCCUPANCY_QUERIES} "
                  f"T={OCCUPANCY_T}: {grid} programs, {grid / (resident * H100_SMS):.2f} waves on {H100_SMS} SMs",
                  flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump", help="write each kernel's PTX and SASS to this directory")
    parser.add_argument("--predicted", action="store_true",
                        help="the predicted-values walks' warp instructions a cached token instead")
    args = parser.parse_args(argv)
    print(f"triton {triton.__version__}, sm_90", flush=True)
    if args.predicted:
        print("warp instructions a cached token and query (the tile loops' SASS; heads and chunks summed):")
        predicted_mix()
        return
    for (d, index_bits), subnormal in itertools.product(((64, 3), (128, 3), (64, 2)), (False, True)):
        kernel, block_t = compile_stream(d, index_bits, subnormal)
        sass = disassemble(kernel.asm["cubin"])
        body = tile_loop(sass)
        mix = opcode_mix(body)
        wide = sum(1 for x in body if "LDG.E.128" in x)
        label = f"d={d}" if index_bits == 3 else f"{index_bits + 1}.0 bits d={d}"
        label += ", subnormal" if subnormal else ""
        print(f"{label} block_t={block_t}: {len(body)} instructions a tile, {mix['LDG']} loads "
              f"({wide} of them 128-bit): " + ", ".join(f"{k} {v}" for k, v in mix.most_common(12)), flush=True)
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            for ext, text in (("ptx", kernel.asm["ptx"]), ("sass", sass)):
                with open(os.path.join(args.dump, f"stream_d{d}_{index_bits}{'_sub' if subnormal else ''}.{ext}"),
                          "w") as f:
                    f.write(text)


if __name__ == "__main__":
    main()
