"""Launch planning for the decode kernels: how a step's work is cut into programs (split-K chunks, stream-K runs,
merge rows), which path a step takes, the launch configuration per cache layout. The constants were chosen by timing
the alternatives on an H100 (``tools/tune_kernels.py``; ``results/gpu/launch_constants_h100.txt``; reasons in
``docs/kernels.md``)."""

from __future__ import annotations

import math

from ...quant.layout import CodeLayout, decode_grid


#: the longest walk one split program takes: longer ones leave a ragged last wave of programs that shorter chunks
#: even out
MAX_CHUNK = 2048


def plan_splits(programs: int, capacity: int, block_t: int, sms: int, waves: int = 4,
                splits: int | None = None) -> tuple[int, int]:
    """(splits, chunk): enough programs for ``waves`` waves of the GPU and chunks of at most ``MAX_CHUNK``
    tokens (or ``splits`` as asked), chunks a multiple of ``block_t``."""
    blocks = max(1, math.ceil(capacity / block_t))
    if splits is None:
        splits = max(math.ceil(waves * sms / max(programs, 1)), math.ceil(capacity / MAX_CHUNK))
    splits = max(1, min(blocks, splits, 64))
    chunk = math.ceil(blocks / splits) * block_t
    splits = max(1, math.ceil(capacity / chunk))
    return splits, chunk


def stream_plan(rows: int, capacity: int, block_t: int, programs: int) -> tuple[int, int, int, int]:
    """A stream-K cut (``_stream_kernel``) of ``rows`` walks over ``capacity`` cached rows for about ``programs``
    programs: (tiles a row, tiles a program, partial slots a row, programs launched)."""
    nt = max(1, math.ceil(capacity / block_t))
    run = math.ceil(rows * nt / max(programs, 1))
    return nt, run, min(math.ceil(nt / run) + 1, nt), math.ceil(rows * nt / run)


#: the one-launch path (``_small_kernel``) for S = 1, head_dim ≤ 64 and at most this many cached
#: (row, head, position) slots: where it beat the three-launch path on an H100
#: (its per-program query rotation is too costly at d = 128)
SMALL_MAX_SLOTS = 1 << 18
#: the same for a grid codec's cache of equal widths (the default), up to this many slots and (row, head) pairs: past
#: them each program's own query rotation and merge cost more than the prep and merge launches they save
GRID_MAX_SLOTS = 3 << 19
GRID_MAX_ROWS = 640
#: grid codes decoded as float32 subnormals by default (``launch_config``'s ``subnormal``)
SUBNORMAL_CODES = True
#: keys whose rotation permutes their channels: the walk gathers each query and the merge makes c0, with no prep
#: launch (``launch_config``'s ``gather_query``)
GATHER_QUERY = True
#: a paged step's shared prefix (forks of one scaffold) read once for groups of queries by the shared walk
#: (``shared.py``; ``launch_config``'s ``shared``), not once a query by the walks: off, as on an H100 it took
#: 0.41–0.87× the per-row walks' speed (``results/gpu/shared_walk_h100.txt``), which find the shared blocks in L2
SHARED_WALK = False
#: tiles ahead of the walk whose codes are asked into L2 beside its register double buffer (``launch_config``'s
#: ``prefetch`` = this; 0: none), so a one-warp program keeps more bytes in flight than its registers hold; taken by
#: the default cache's walk where a token's key and value codes are narrower than ``L2_AHEAD_BELOW`` bits a channel
#: together (the 3.0-bit default's 4 + 2), and at any width at heads under 64: on an H100 it took
#: the 3.0-bit walk from 84% to 90% of a pure read at 650M-shaped B=64 T=16K and the 4.0-bit one at heads of 16 and 32
#: by 1–2%, and moved the 4.0-bit one at heads of 64 by −2% to +1%; three tiles ahead were slower
L2_AHEAD = 2
#: the key and value code bits a channel below which the default cache's walk asks tiles ahead (``L2_AHEAD``)
L2_AHEAD_BELOW = 8
#: channels × tokens of the default cache's tile at heads of 64 or less (one warp's; block_t = this / head_dim): on
#: an H100 the walk at heads of 16 took 0.67–0.69× the time of 32-token tiles (57% → 83% of a read at 8M-shaped B=64
#: T=4K) and at heads of 32 0.84–0.85× (74% → 87% at 150M-shaped); 32 tokens at heads of 64 stay the fastest
LEAN_TILE = 2048


def one_launch(batch: int, heads: int, s: int, d: int, capacity: int, grid: bool = False) -> bool:
    """Whether a decode step of this shape takes the one-launch path (``grid``: a grid codec's cache of equal
    widths)."""
    if s != 1 or d > 64:
        return False
    if grid:
        return batch * heads * capacity <= GRID_MAX_SLOTS and batch * heads <= GRID_MAX_ROWS
    return batch * heads * capacity <= SMALL_MAX_SLOTS


def merge_rows(batch: int, heads: int, block_s: int, block_ns: int, d: int, sms: int) -> int:
    """Sequences per merge program (``_merge_kernel``), a power of two: up to 16 while there are at least half as
    many programs as SMs, and fewer where its [splits, sequences, queries, d] partials (or the queries × keys × d
    products of the step's own tokens) would pass 8192 values (64 registers a thread at four warps). One where a row
    has eight partials or more at head_dim ≤ 64, whose Πᵥ is a quarter of d = 128's to read again per program."""
    if d <= 64 and block_ns >= 8:
        return 1
    cap = 8192 // d
    fill = 1 << max(0, (2 * batch * heads // sms).bit_length() - 1)  # the largest power of two ≤ 2·B·H / SMs
    return max(1, min(16, fill, cap // (block_ns * block_s), cap // (block_s * block_s)))




def launch_config(d: int, key: CodeLayout, value: CodeLayout, batch: int, heads: int, s: int, capacity: int,
                  overrides: dict | None = None) -> dict:
    """The launch configuration of a decode step (``compressed_attention_triton``'s ``config`` keys), chosen per
    cache layout and shape; ``overrides`` replace any key (for tuning). Reasons: ``docs/kernels.md``."""
    lean = "plane" not in (key.sign, value.sign)  # one code word a channel (keys and values of any widths)
    lean_grid = lean and decode_grid(key, value) > 0  # the default cache
    if d <= 64:
        cfg = dict(block_t=64, num_warps=2, waves=4)
    else:  # wider keys and values spill two warps' registers at d = 128 unless one code word holds a channel
        cfg = dict(block_t=32, num_warps=2 if lean else 4, waves=8)
    if lean_grid:  # computed values leave registers for one-warp programs of LEAN_TILE channels × tokens
        cfg.update(block_t=min(128, LEAN_TILE // d) if d <= 64 else cfg["block_t"] // 2, num_warps=1)
    # four-warp tiles spread a token's channels over threads: their look-ups OR codes into per-group row addresses
    cfg.update(rows=d > 64 and not lean, maxnreg=168 if lean or d > 64 else None)
    small = one_launch(batch, heads, s, d, capacity, lean_grid)
    if small:
        cfg = (dict(block_t=64, num_warps=2, waves=4, rows=False, maxnreg=168) if lean_grid else
               dict(block_t=32, num_warps=2, waves=4, rows=False, maxnreg=None))
    # prefetch: the next tile's codes requested before this one is computed (a register double buffer); n > 1: and
    # the codes n tiles ahead asked into L2;
    # pdl: on sm_90+, a grid codec's walk launches while the prep kernel runs (programmatic dependent launch);
    # stream: the default cache's walk cut stream-K, this many one-warp programs per SM (one full wave)
    # subnormal: a grid codec's codes decoded as float32 subnormals (``codes._decode_codes``), two integer
    # instructions a value where 1.0's exponent OR-ed in and 1 subtracted took three or four;
    # shared: a paged step's shared prefix read once for groups of queries (``shared.py``)
    ahead = lean_grid and (key.code_bits + value.code_bits < L2_AHEAD_BELOW or d < 64)
    cfg.update(path="auto", small=small, prefetch=max(1, L2_AHEAD) if ahead else 1, pdl=decode_grid(key, value) > 0,
               stream=12 if lean_grid else 0, subnormal=SUBNORMAL_CODES, gather_query=GATHER_QUERY, shared=SHARED_WALK)
    # prep / merge: tokens per prep program, output channels per rotation dot (a whole Π spills at d = 128)
    cfg.update(prep_block=16, prep_cols=64, merge_cols=64)
    cfg.update(overrides or {})
    return cfg
