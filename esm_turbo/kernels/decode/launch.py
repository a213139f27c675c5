"""``compressed_attention_triton``: the fused decode attention launcher (the PyTorch reference with the same
contract is ``esm_turbo.ops.compressed.compressed_attention_reference``)."""

from __future__ import annotations

import torch
import triton

from ...quant.layout import CachedCodes, decode_grid
from ..common import FP_FUSION, dot_precision, interpreting, num_sms, part_or, split16, token_strides
from .codes import aligned_table, slot_parts
from .merge import _merge_kernel, _prep_kernel
from .plan import launch_config, merge_rows, plan_splits, stream_plan
from .shared import BLOCK_T as SHARED_T, _shared_kernel, shared_span, shared_tiles
from .small import attention_one_launch
from .walk import _prefix_kernel, _stream_kernel


def compressed_attention_triton(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, new_valid: torch.Tensor,
                                lengths: torch.Tensor, keys: CachedCodes, values: CachedCodes,
                                config: dict | None = None, pages: torch.Tensor | None = None,
                                block_size: int = 0, shared: int = 0,
                                leads: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``compressed_attention_reference`` (see there for shapes, and for a paged cache's
    ``pages`` [B, blocks] int32 and ``block_size``); CUDA tensors (or CPU under Triton's interpreter). ``config``
    overrides the launch choice (:func:`~.plan.launch_config`) for tuning: ``path`` (auto | one | split), block_t /
    num_warps / waves (or ``splits``: split-K programs per query), ``prefetch``, ``rows``, ``maxnreg``, ``pdl``,
    ``stream``, ``subnormal``, ``gather_query`` and for the prep and merge kernels ``prep_block``, ``prep_cols`` /
    ``merge_cols`` and ``merge_rows``. ``shared``: tokens at the start of every row held in the same blocks of a paged
    cache as its lead row's (``leads`` [B] int32, None: row 0; ``DecodeCache.shared_prefix``); where ``config``'s
    ``shared`` is on and :func:`~.shared.shared_span` takes them, the shared walk (``shared.py``) reads them once for
    the queries of a lead in a group and the walks start past them."""
    batch, heads, s, d = q.shape
    page = int(block_size) if pages is not None and pages.numel() else 0
    t_cap = pages.shape[1] * page if page else keys.main.shape[2]
    if not page:
        pages = lengths  # never read
    keys = keys._replace(table=aligned_table(keys.table))
    values = values._replace(table=aligned_table(values.table))
    cfg = launch_config(d, keys.code, values.code, batch, heads, s, t_cap, config)
    span = shared_span(shared, batch * s, cfg["block_t"], page > 0, keys.has_slots()) if cfg["shared"] else 0
    if cfg["path"] == "one" or (cfg["path"] == "auto" and cfg["small"] and not span):
        if s != 1:
            raise ValueError("the one-launch path takes one query per sequence")
        return attention_one_launch(q, k_new, v_new, new_valid, lengths, keys, values, cfg, pages, page, t_cap)
    grid = decode_grid(keys.code, values.code)
    precision = dot_precision(q)
    pdl = bool(cfg["pdl"]) and q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] >= 9
    block_s = max(triton.next_power_of_2(s), 1)
    block_t = cfg["block_t"]
    programs = batch * heads * s
    sms = num_sms(q.device)
    if span:  # the shared walk's splits: waves of its (head, group) programs, as the walks'
        block_g, shared_warps = shared_tiles(d)
        groups = triton.cdiv(batch * s, block_g)
        ps, pchunk = plan_splits(heads * groups, span, SHARED_T, sms)
    else:
        ps = pchunk = 0
    if cfg["stream"]:
        nt, run, splits, launched = stream_plan(programs, t_cap - span, block_t, cfg["stream"] * sms)
    else:
        splits, chunk = plan_splits(programs, t_cap - span, block_t, sms, cfg["waves"], cfg.get("splits"))
        nt = run = 0
    nparts = ps + splits  # each query's partials: the shared walk's first, then its own walk's
    block_ns = triton.next_power_of_2(nparts)
    dev = q.device
    gather = bool(cfg["gather_query"]) and keys.perm is not None
    (q, q_strides), (k_new, k_strides), (v_new, v_strides) = map(token_strides, (q, k_new, v_new))
    if gather:  # the keys' rotation permutes their channels: the walk gathers q, the merge makes c0, no prep launch
        qt, c0, perm = q, q, keys.perm
    else:
        qt = torch.empty(batch, heads, s, d, device=dev, dtype=torch.float32)
        c0 = torch.empty(batch, heads, s, device=dev, dtype=torch.float32)
        perm = lengths  # never read
        _prep_kernel[(heads, triton.cdiv(batch * s, cfg["prep_block"]))](
            q, *q_strides, keys.rot, keys.offset, keys.scale, qt, c0, batch, heads, s, D=d,
            BLOCK_N=cfg["prep_block"], COLS=min(d, cfg["prep_cols"]), PRECISION=precision,
            SPLIT16=split16(q, precision), PDL=pdl, num_warps=4, enable_fp_fusion=FP_FUSION)
    m = torch.empty(batch * heads * nparts * block_s, device=dev, dtype=torch.float32)
    l_ = torch.empty_like(m)
    acc = torch.empty(batch * heads * nparts * block_s, d, device=dev, dtype=torch.float32)
    out = torch.empty(batch, heads, s, d, device=dev, dtype=q.dtype)
    codes = (qt, *q_strides, perm, keys.scale, keys.main, part_or(keys.sign, keys.main), values.main,
             part_or(values.sign, values.main), keys.table, values.table, part_or(keys.layout, keys.table),
             part_or(values.layout, values.table),
             lengths, pages, *slot_parts(keys, values, lengths), m, l_, acc, heads, s, t_cap, span, ps)
    consts = dict(D=d, KCODE_BITS=keys.code.code_bits, VCODE_BITS=values.code.code_bits,
                  KFIELDS=keys.code.kernel_fields(), VFIELDS=values.code.kernel_fields(),
                  KSIGN=keys.code.sign == "plane",
                  VSIGN=values.code.sign == "plane", BLOCK_S=block_s, BLOCK_T=block_t, NK=keys.table[0].numel(),
                  NV=values.table[0].numel(), PREFETCH=cfg["prefetch"], ROWS=cfg["rows"], GRID=grid, PDL=pdl,
                  PAGE=page, SLOTS=keys.has_slots(), SUBN=bool(cfg["subnormal"]) and grid > 0, GATHER=gather,
                  num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"],
                  launch_pdl=pdl,
                  enable_fp_fusion=FP_FUSION)
    if run:
        _stream_kernel[(launched,)](*codes, programs, nt, run, nparts, INTERPRET=run if interpreting() else 0,
                                    **consts)
    else:
        _prefix_kernel[(programs, splits)](*codes, chunk, nparts, INTERPRET=chunk // block_t if interpreting() else 0,
                                           **consts)
    if span:  # after the walk, which keeps its programmatic dependent launch on the prep kernel
        _shared_kernel[(heads, ps, groups)](
            qt, *q_strides, perm, keys.scale, keys.main, part_or(keys.sign, keys.main), values.main,
            part_or(values.sign, values.main), keys.table, values.table, part_or(keys.layout, keys.table),
            part_or(values.layout, values.table), pages, lengths if leads is None else leads, m, l_, acc, heads, s,
            batch * s, span, pchunk, nparts, pages.shape[1],
            D=d, KCODE_BITS=consts["KCODE_BITS"], VCODE_BITS=consts["VCODE_BITS"], KFIELDS=consts["KFIELDS"],
            VFIELDS=consts["VFIELDS"], KSIGN=consts["KSIGN"], VSIGN=consts["VSIGN"], BLOCK_S=block_s,
            BLOCK_T=SHARED_T, BLOCK_G=block_g, NK=consts["NK"], NV=consts["NV"], ROWS=cfg["rows"], GRID=grid,
            PAGE=page, GATHER=gather, LEADS=leads is not None, PRECISION=precision, num_warps=shared_warps,
            enable_fp_fusion=FP_FUSION)
    block_b = cfg.get("merge_rows") or merge_rows(batch, heads, block_s, block_ns, d, sms)
    _merge_kernel[(heads, triton.cdiv(batch, block_b))](
        c0, q, *q_strides, k_new, *k_strides, v_new, *v_strides, m, l_, acc, new_valid, values.scale, values.offset,
        values.rot, perm, keys.offset, out, batch, heads, s, nparts, nt, run, ps,
        D=d, BLOCK_B=block_b, BLOCK_S=block_s, BLOCK_NS=block_ns, COLS=min(d, cfg["merge_cols"]), PRECISION=precision,
        GATHER=gather, num_warps=4, enable_fp_fusion=FP_FUSION)
    return out
