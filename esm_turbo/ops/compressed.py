"""Ops on the packed cache, registered with ``torch.library`` so torch.compile and CUDA graphs capture
them whole: ``esm_turbo::quantize_pack`` (encode new K or V straight into the cache) and
``esm_turbo::compressed_attention`` (decode attention that reads the cache packed).

Each op has a pure-PyTorch reference here (CPU/MPS, or forced) and a Triton implementation in
``esm_turbo.kernels`` with the same signature. :func:`fused_supported` says which codecs they cover: any whose
quantizers keep the :class:`~esm_turbo.quant.codec.FusedQuantizer` contract at 1–4 index bits (the calibrated and
Hadamard LUT quantizers without per-vector norms, residual ``sign`` or ``none``, among them). Anything else (QJL,
TurboQuant norms, dense caches) takes the two-step reference path.
"""

from __future__ import annotations

import weakref

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..quant.codec import FusedQuantizer, KVCodec, keeps_fused_contract
from ..quant.tables import lookup_codes, lut_bounds, lut_code_parts
from ..quant.layout import CachedCodes, CodeLayout
from ..quant.packing import layout_of
from ..quant.predict import stores_values
from ..quant.rotations import affine_forward, key_permutation
from ..quant.slots import KERNEL_SLOTS, apply_slots, pick_slots

FUSED_BITS = (1, 2, 3, 4)


def kernel_head_width(dim: int) -> bool:
    """Whether the Triton kernels take heads of ``dim`` channels: dim/8 a power of two (16, 32, 64, 128, ...)."""
    return (dim // 8) & (dim // 8 - 1) == 0


def fused_supported(codec: KVCodec, need_kernel_shape: bool = False) -> bool:
    """True if both quantizers of ``codec`` keep the :class:`~esm_turbo.quant.codec.FusedQuantizer` contract and say
    they are ready for it (``fused_ready``), with 1–4 index bits (and, with ``need_kernel_shape``, the Triton kernels'
    shape rule: head_dim/8 a power of two, i.e. d ∈ {16, 32, 64, 128, ...}); a codec with a recent-token window
    (``esm_turbo.window``) or more than :data:`~esm_turbo.quant.slots.KERNEL_SLOTS` slots a token
    (``esm_turbo.quant.slots``) is read on the reference path. A codec whose values are predicted from its keys
    (``esm_turbo.quant.predict``) takes its own walk over every head's keys (``esm_turbo.ops.predicted``): without
    slots, keys whose rotation permutes each head's channels (the default recipe's; ``quant.rotations.key_permutation``)
    and with ``need_kernel_shape`` for the head counts and widths it holds (``kernels.decode.predicted.fits``)."""
    if getattr(codec, "window", 0) or getattr(codec, "slots", 0) > KERNEL_SLOTS:
        return False
    if getattr(codec, "predictor", None) is not None:
        from ..kernels.decode.predicted import fits
        if codec.slots or (need_kernel_shape and not fits(codec.key.heads, codec.key.dim)):
            return False
        if key_permutation(codec.key.rot) is None:
            return False
    for q in (codec.key, codec.value) if stores_values(codec) else (codec.key,):
        if not keeps_fused_contract(q):
            return False
        if q.code_layout().index_bits not in FUSED_BITS:
            return False
        if need_kernel_shape and not kernel_head_width(q.dim):
            return False
    return True


@dataclass
class FusedTables:
    """Per-layer constants of the fused ops, derived once from a codec.

    k_code / v_code: how the keys' and values' codes are stored (:class:`~esm_turbo.quant.layout.CodeLayout`, the
    quantizers' own); k_tab / v_tab [H, d, codes] (fp16 values, in a float16 or float32 tensor); k_bounds / v_bounds
    [H, K-1, d] (level-major: the quantize kernel reads one level of every channel at a time, coalesced);
    k_layout / v_layout [H, d] int32 field layouts of the packed codes (``esm_turbo.quant.packing.field_layout``),
    empty when every channel has the same width; k_rot16 / v_rot16 [H, 2, d, d] float16: the rotations' halves
    (:func:`split_rotation`) the quantize kernel reads for fp16 inputs, on CUDA (elsewhere empty).
    """

    k_code: CodeLayout
    v_code: CodeLayout
    k_tab: torch.Tensor
    v_tab: torch.Tensor
    k_bounds: torch.Tensor
    v_bounds: torch.Tensor
    k_layout: torch.Tensor
    v_layout: torch.Tensor
    k_rot16: torch.Tensor | None = None
    v_rot16: torch.Tensor | None = None
    #: [H, d] int32 where the keys' rotation permutes each head's channels (:func:`key_permutation`), else None
    k_perm: torch.Tensor | None = None
    #: False for values not stored (``esm_turbo.quant.predict.Unstored``): the v_* fields are then the keys' (never
    #: read)
    values_stored: bool = True

    def packed(self, parts: dict[str, torch.Tensor], kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, sign bits or an empty tensor) of ``kind`` ('k' or 'v') in a layer's cache parts."""
        code = self.k_code if kind == "k" else self.v_code
        main = parts[f"{kind}.{code.part}"]
        return main, parts[f"{kind}.{code.sign_part}"] if code.sign_part else main.new_empty(0)


#: each codec's tables, made once (a codec's buffers are fixed once calibrated) and kept while the codec lives
_TABLES: "weakref.WeakKeyDictionary[KVCodec, FusedTables]" = weakref.WeakKeyDictionary()


def fused_tables(codec: KVCodec) -> FusedTables:
    """The kernels' view of ``codec``'s tables: made once per codec (kept here, not on the codec), rebuilt if it
    moved device."""
    cached = _TABLES.get(codec)
    key, value = codec.key, codec.value
    if cached is not None and cached.k_tab.device == key.rot.device:
        return cached
    stored = stores_values(codec)
    if not stored:
        value = key  # stand-ins: nothing reads them
    tables = FusedTables(k_code=key.code_layout(), v_code=value.code_layout(), k_tab=_op_table(key),
                         v_tab=_op_table(value), k_bounds=_level_major(lut_bounds(key.centroids)),
                         v_bounds=_level_major(lut_bounds(value.centroids)), k_layout=_kernel_layout(key),
                         v_layout=_kernel_layout(value), k_rot16=_kernel_halves(key), v_rot16=_kernel_halves(value),
                         k_perm=_kernel_perm(key), values_stored=stored)
    _TABLES[codec] = tables
    return tables


def split_rotation(rot: torch.Tensor) -> torch.Tensor:
    """Π [H, d, d] float32 → [H, 2, d, d] float16: Π_hi = fp16(Π) and Π_lo = fp16((Π − Π_hi)·2048), whose two
    fp16 dots with fp32 accumulation give x Πᵀ of fp16 x to fp32 accuracy (``esm_turbo.kernels.common.rotate``)."""
    hi = rot.to(torch.float16)
    lo = ((rot - hi.float()) * 2048.0).to(torch.float16)
    return torch.stack([hi, lo], dim=1).contiguous()


def _kernel_halves(q: FusedQuantizer) -> torch.Tensor:
    """:func:`split_rotation` of q's Π where the kernels run (CUDA), else empty (nothing reads it)."""
    return split_rotation(q.rot) if q.rot.is_cuda else q.rot.new_empty(0, dtype=torch.float16)


def _kernel_perm(q: FusedQuantizer) -> torch.Tensor | None:
    """[H, d] int32: the model channel of each code channel where q's rotation permutes them, else None."""
    perm = key_permutation(q.rot)
    return None if perm is None else perm.to(torch.int32).contiguous()


def _level_major(bounds: torch.Tensor) -> torch.Tensor:
    """[H, d, K-1] → [H, K-1, d] contiguous."""
    return bounds.transpose(1, 2).contiguous()


def _op_table(q: FusedQuantizer) -> torch.Tensor:
    """The code table the ops read: its fp16 values (``q.code_values()``) held in float32 up to head_dim 64 and
    in float16 beyond (a head's tables twice as long), whichever the H100 read faster in 9 of 10 layouts
    (``tools/bench_layouts.py``); the values are the same."""
    table = q.code_values()
    return table if q.dim >= 128 else table.float()


def _kernel_layout(q: FusedQuantizer) -> torch.Tensor:
    """The field layout the ops take: empty for equal widths (read on the host once, at table build); else
    [H, d], the same in every group of 8 channels (what bit allocation makes: the kernels read 8 per head)."""
    if q.code_layout().equal_widths:
        return q.rot.new_empty(0, dtype=torch.int32)
    layout = q.layout()
    if not torch.equal(layout, layout[:, :8].repeat(1, q.dim // 8)):
        raise ValueError("the fused ops take field layouts of period 8 (the same widths in every group)")
    return layout


def _full_layout(layout: torch.Tensor, heads: int, dim: int, width: int, device) -> torch.Tensor:
    """An op's layout argument made explicit: an empty one is equal ``width``-bit fields."""
    return layout if layout.numel() else layout_of(torch.full((heads, dim), width, device=device))


# ---- references (same contracts as the Triton kernels) ----------------------------------------------

def scatter_rows(buf: torch.Tensor, val: torch.Tensor, pos: torch.Tensor, pages: torch.Tensor | None = None) -> None:
    """buf [B, H, T_cap, *] ← val [B, H, S, *] at rows ``pos[b] + j`` of each sequence. A paged cache (``pages``
    [B, blocks] slot ids, non-empty): buf is a pool [slots, H, block, *] and row b's position t lies in slot
    ``pages[b, t // block]`` at ``t % block``."""
    rows, at = row_index(pos, val.shape[2], buf.shape[2], pages)
    buf[rows, :, at] = val.transpose(1, 2)  # advanced indices split by a slice put [B, S] first


def gather_rows(buf: torch.Tensor, pos: torch.Tensor, s: int, pages: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of :func:`scatter_rows`: rows ``pos[b] + j`` (j < s) of buf [B, H, T_cap, *] (a paged pool [slots,
    H, block, *] through ``pages``) → [B, H, s, *]."""
    rows, at = row_index(pos, s, buf.shape[2], pages)
    return buf[rows, :, at].transpose(1, 2)


def row_index(pos: torch.Tensor, s: int, block: int, pages: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, at) [B, S] indices of positions ``pos[b] + j`` (j < s): each sequence's row and the position itself in a
    contiguous buffer, or through ``pages`` [B, blocks] (non-empty) the slot and the place in a block of ``block``."""
    rows = torch.arange(pos.shape[0], device=pos.device)[:, None]
    at = pos[:, None] + torch.arange(s, device=pos.device)  # [B, S]
    if pages is not None and pages.numel():
        rows = pages.long().gather(1, at // block)
        at = at % block
    return rows, at


def write_dense(parts: dict[str, torch.Tensor], k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
    """An uncompressed layer's new keys and values k, v [B, H, S, d] into its buffers ``parts["k.x"]``,
    ``parts["v.x"]`` [B, H, T_cap, d] at rows ``pos[b] + j``: one launch on the kernel path
    (:func:`~esm_turbo.kernels.write.write_rows_triton`), :func:`scatter_rows` each elsewhere."""
    from . import use_kernels
    if use_kernels(k):
        from ..kernels.write import write_rows_triton
        write_rows_triton(parts["k.x"], parts["v.x"], k, v, pos)
        return
    scatter_rows(parts["k.x"], k.to(parts["k.x"].dtype), pos)
    scatter_rows(parts["v.x"], v.to(parts["v.x"].dtype), pos)


def gather_blocks(pool: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """A paged cache's rows: pool [slots, H, block, *] read through pages [B, blocks] (slot ids) → [B, H,
    blocks·block, *]."""
    rows = pool[pages.long()]  # [B, blocks, H, block, *]
    return rows.transpose(1, 2).reshape(pages.shape[0], pool.shape[1], pages.shape[1] * pool.shape[2],
                                        *pool.shape[3:])


def quantize_pack_reference(x: torch.Tensor, rot: torch.Tensor, offset: torch.Tensor, scale: torch.Tensor,
                            bounds: torch.Tensor, centroids: torch.Tensor, layout: torch.Tensor,
                            main_out: torch.Tensor, sign_out: torch.Tensor, pos: torch.Tensor,
                            code: CodeLayout, pages: torch.Tensor | None = None,
                            slots_out: torch.Tensor | None = None, table: torch.Tensor | None = None,
                            relative: bool = False) -> None:
    """Encode x [B,H,S,d] (rot [H,d,d], offset/scale [H,d], centroids [H,d,K], bounds [H,K-1,d] unused here, field
    layout [H,d] of the packed part or empty: equal widths) at rows pos[b] + j of the cache parts stored as ``code``
    says: main_out [B,H,T_cap,d·code_bits/8] (``code``, or ``idx``) and sign_out [B,H,T_cap,d/8] (a sign plane) or
    empty. ``pages`` [B, blocks] int32 (a paged cache, non-empty): the parts are pools [slots, H, block, ·] written
    through it (:func:`scatter_rows`). ``slots_out`` [B, 1, T_cap, k] int32 (non-empty: the kind's slots,
    :func:`~esm_turbo.quant.slots.pick_slots` over the codes' values in ``table`` [H, d, codes], ``relative``
    ranking) is written at the same rows."""
    layout = _full_layout(layout, *centroids.shape[:2], code.code_bits, x.device)
    y = affine_forward(x, rot, offset, scale)
    parts, _ = lut_code_parts(y, centroids, layout, code.code_bits, sign=code.has_sign,
                              combined=code.sign == "combined")
    scatter_rows(main_out, parts[code.part], pos, pages)
    if code.sign_part:
        scatter_rows(sign_out, parts[code.sign_part], pos, pages)
    if slots_out is not None and slots_out.numel():
        y_hat = lookup_codes(table, parts[code.part], parts.get(code.sign_part), layout, code.code_bits).float()
        picked = pick_slots(y.float(), y_hat, scale, slots_out.shape[-1], relative)  # [B, S, k]
        scatter_rows(slots_out, picked.unsqueeze(1), pos, pages)


def compressed_attention_reference(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                                   new_valid: torch.Tensor, lengths: torch.Tensor, keys: CachedCodes,
                                   values: CachedCodes, pages: torch.Tensor | None = None,
                                   block_size: int = 0) -> torch.Tensor:
    """Attention of S new tokens over the packed prefix plus themselves, computed in each codec's affine
    domain ``y = (x Πᵀ − offset) / scale``: no cached key is rotated back.

    q [B,H,S,d] (scaled, post-RoPE), k_new/v_new [B,H,S,d] the step's own keys/values, new_valid [B,S]
    (bool or uint8), lengths [B] valid prefix rows; keys / values: each kind's packed cache and codec constants
    (:class:`~esm_turbo.quant.layout.CachedCodes`; a grid codec's tables are the identity code, which the kernels
    compute rather than read: here the tables serve). The score of a cached key is ``⟨q̃, ŷ⟩ + c0`` with
    ``q̃ = (q Πₖᵀ) ⊙ scaleₖ`` and ``c0 = ⟨q Πₖᵀ, offsetₖ⟩``; values are summed as ``Σ p ŷ`` and mapped back once
    (``(· ⊙ scaleᵥ + offsetᵥ) Πᵥ``). Returns [B,H,S,d] in q's dtype (computed in the rotations' float dtype); a
    query with no valid key gets zeros.

    A paged cache (``pages`` [B, blocks] int32, non-empty): each kind's parts are pools [slots, H, block_size, ·]
    and row b's position t lies in slot ``pages[b, t // block_size]`` (:func:`gather_blocks`). A kind's slots
    (``CachedCodes.slots``) correct its decoded ŷ before either sum (:func:`~esm_turbo.quant.slots.apply_slots`).
    """
    keys, values = gathered(keys, values, pages)
    k_rot, k_offset, k_scale = keys.rot, keys.offset, keys.scale
    v_rot, v_offset, v_scale = values.rot, values.offset, values.scale
    z = torch.einsum("bhsd,hed->bhse", q.to(k_rot.dtype), k_rot)
    qk, c0 = z * k_scale[:, None, :], (z * k_offset[:, None, :]).sum(-1, keepdim=True)
    k_hat, v_hat = (cached_values(c, q.device) for c in (keys, values))
    t = k_hat.shape[2]
    k_all = torch.cat([k_hat.to(k_rot.dtype), affine_forward(k_new, k_rot, k_offset, k_scale)], dim=2)
    v_all = torch.cat([v_hat.to(v_rot.dtype), affine_forward(v_new, v_rot, v_offset, v_scale)], dim=2)
    valid = torch.cat([torch.arange(t, device=lengths.device)[None, :] < lengths[:, None], new_valid.bool()], 1)
    scores = torch.einsum("bhsd,bhtd->bhst", qk, k_all) + c0
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    any_valid = valid.any(dim=1)[:, None, None, None]
    probs = torch.softmax(scores.masked_fill(~any_valid, 0.0), dim=-1)
    out = torch.einsum("bhst,bhtd->bhsd", probs, v_all) * v_scale[:, None, :] + v_offset[:, None, :]
    out = torch.einsum("bhse,hed->bhsd", torch.where(any_valid, out, torch.zeros_like(out)), v_rot)
    return out.to(q.dtype)


def gathered(keys: CachedCodes, values: CachedCodes, pages: torch.Tensor | None) -> tuple[CachedCodes, CachedCodes]:
    """Both kinds' packed parts (and slots) as contiguous rows [B, H, T, ·]: a paged cache's pools read through
    ``pages`` [B, blocks] (:func:`gather_blocks`); a contiguous cache's (``pages`` None or empty) as they are."""
    if pages is None or not pages.numel():
        return keys, values
    return tuple(c._replace(main=gather_blocks(c.main, pages),
                            sign=gather_blocks(c.sign, pages) if c.sign.numel() else c.sign,
                            slots=gather_blocks(c.slots, pages) if c.has_slots() else c.slots)
                 for c in (keys, values))


def cached_values(c: CachedCodes, device: torch.device) -> torch.Tensor:
    """ŷ [B, H, T_cap, d] of one kind's packed cache (its slots applied), in the table's dtype or float32."""
    layout = _full_layout(c.layout, *c.table.shape[:2], c.code.code_bits, device)
    y_hat = lookup_codes(c.table, c.main, c.sign, layout, c.code.code_bits)
    return apply_slots(y_hat, c.slots[:, 0]) if c.has_slots() else y_hat


# ---- custom ops -------------------------------------------------------------------------------------

def _triton() -> bool:
    from ..kernels import triton_available
    return triton_available()


def _never() -> bool:
    return False


def _quantize_pack_with(kernel: Callable[[], bool]) -> Callable:
    """The body of ``esm_turbo::quantize_pack``: the Triton kernel when ``kernel()`` says so (the CUDA
    implementation: Triton available), else the reference (the default implementation)."""

    def quantize_pack(k: torch.Tensor, v: torch.Tensor, k_rot: torch.Tensor, k_offset: torch.Tensor,
                      k_scale: torch.Tensor, k_bounds: torch.Tensor, k_centroids: torch.Tensor, k_layout: torch.Tensor,
                      k_main: torch.Tensor, k_sign: torch.Tensor, v_rot: torch.Tensor, v_offset: torch.Tensor,
                      v_scale: torch.Tensor, v_bounds: torch.Tensor, v_centroids: torch.Tensor, v_layout: torch.Tensor,
                      v_main: torch.Tensor, v_sign: torch.Tensor, pos: torch.Tensor, k_code: list[int],
                      v_code: list[int], k_rot16: torch.Tensor | None = None,
                      v_rot16: torch.Tensor | None = None, pages: torch.Tensor | None = None,
                      k_slots: torch.Tensor | None = None, v_slots: torch.Tensor | None = None,
                      k_tab: torch.Tensor | None = None, v_tab: torch.Tensor | None = None,
                      relative: bool = False) -> None:
        """Keys and values of one layer into their cache parts (the reference; one Triton launch on CUDA). Bounds
        [H, K-1, d] level-major (``FusedTables``); ``*_code``: the :class:`CodeLayout` as :meth:`~CodeLayout.to_op`
        gives it; ``*_rot16``: the rotations' fp16 halves (:func:`split_rotation`) for the kernel, or None / empty. A
        grid codec's codes the kernel rounds to (the reference searches the centroids as for any LUT: the same
        codes). ``pages`` [B, blocks] int32 (a paged cache; None or empty: contiguous): the parts are pools written
        through it (:func:`quantize_pack_reference`). ``*_slots`` [B, 1, T_cap, k] int32 (None or empty: no slots):
        each kind's slots, picked over its codes' values ``*_tab`` [H, d, codes] (``relative``: the ranking)."""
        k_tables = (k_rot, k_offset, k_scale, k_bounds, k_centroids, k_layout)
        v_tables = (v_rot, v_offset, v_scale, v_bounds, v_centroids, v_layout)
        k_code, v_code = CodeLayout.from_op(k_code), CodeLayout.from_op(v_code)
        if kernel():
            from ..kernels.quantize import quantize_pack_triton
            halves = None if k_rot16 is None or v_rot16 is None else (k_rot16, v_rot16)
            slots = None if k_slots is None or not k_slots.numel() else (k_slots, v_slots, k_tab, v_tab, relative)
            quantize_pack_triton(k, v, k_tables, v_tables, (k_main, k_sign), (v_main, v_sign), pos, k_code, v_code,
                                 halves, pages=pages, slots=slots)
        else:
            quantize_pack_reference(k, *k_tables, k_main, k_sign, pos, k_code, pages, k_slots, k_tab, relative)
            quantize_pack_reference(v, *v_tables, v_main, v_sign, pos, v_code, pages, v_slots, v_tab, relative)

    return quantize_pack


_QUANTIZE_PACK = (_quantize_pack_with(_never), _quantize_pack_with(_triton))  # (default body, CUDA body)
quantize_pack = torch.library.custom_op("esm_turbo::quantize_pack", mutates_args=(
    "k_main", "k_sign", "v_main", "v_sign", "k_slots", "v_slots"))(_QUANTIZE_PACK[0])
quantize_pack.register_kernel("cuda")(_QUANTIZE_PACK[1])


@quantize_pack.register_fake
def _quantize_pack_fake(*args) -> None:
    return None


def _compressed_attention_with(kernel: Callable[[], bool]) -> Callable:
    """The body of ``esm_turbo::compressed_attention``, as :func:`_quantize_pack_with` makes quantize_pack's."""

    def compressed_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, new_valid: torch.Tensor,
                             lengths: torch.Tensor, k_main: torch.Tensor, k_sign: torch.Tensor, k_tab: torch.Tensor,
                             k_layout: torch.Tensor, k_rot: torch.Tensor, k_offset: torch.Tensor,
                             k_scale: torch.Tensor, k_code: list[int], v_main: torch.Tensor, v_sign: torch.Tensor,
                             v_tab: torch.Tensor, v_layout: torch.Tensor, v_rot: torch.Tensor,
                             v_offset: torch.Tensor, v_scale: torch.Tensor, v_code: list[int], pages: torch.Tensor,
                             block_size: int, k_slots: torch.Tensor | None = None,
                             v_slots: torch.Tensor | None = None, k_perm: torch.Tensor | None = None,
                             shared: int = 0, leads: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`compressed_attention_reference` (or the Triton kernel on CUDA) with each kind's
        :class:`~esm_turbo.quant.layout.CachedCodes` flattened, its code layout as :meth:`CodeLayout.to_op` gives
        it; ``pages`` empty for a contiguous cache; ``*_slots`` each kind's slot words or None; ``k_perm`` the keys'
        channel permutation or None; ``shared`` the tokens every row holds in the same blocks as its lead row
        (``leads`` [B] int32, or None: row 0), which the kernel may read once for the rows of a lead (the reference's
        sums are the same)."""
        keys = CachedCodes(k_main, k_sign, k_tab, k_layout, k_rot, k_offset, k_scale, CodeLayout.from_op(k_code),
                           k_slots, k_perm)
        values = CachedCodes(v_main, v_sign, v_tab, v_layout, v_rot, v_offset, v_scale, CodeLayout.from_op(v_code),
                             v_slots)
        if kernel():
            from ..kernels.decode import compressed_attention_triton
            return compressed_attention_triton(q, k_new, v_new, new_valid, lengths, keys, values, pages=pages,
                                               block_size=block_size, shared=shared, leads=leads)
        return compressed_attention_reference(q, k_new, v_new, new_valid, lengths, keys, values, pages, block_size)

    return compressed_attention


_COMPRESSED_ATTENTION = (_compressed_attention_with(_never), _compressed_attention_with(_triton))
compressed_attention = torch.library.custom_op("esm_turbo::compressed_attention",
                                               mutates_args=())(_COMPRESSED_ATTENTION[0])
compressed_attention.register_kernel("cuda")(_COMPRESSED_ATTENTION[1])

#: Eager calls run an op's body for the tensors' device directly: dispatch through ``torch.library`` costs tens of
#: microseconds of host time a call, two calls a layer, and an eager decode step is bound by the host. Under
#: torch.compile the registered ops are traced (CUDA graph capture takes either).
DIRECT_IN_EAGER = True


def _run(op, bodies: tuple[Callable, Callable], *args):
    """``op(*args)``, or in eager mode (:data:`DIRECT_IN_EAGER`) the body ``op`` dispatches to for ``args[0]``'s
    device: ``bodies`` = (default, CUDA)."""
    if not DIRECT_IN_EAGER or torch.compiler.is_compiling():
        return op(*args)
    return bodies[args[0].device.type == "cuda"](*args)


@compressed_attention.register_fake
def _compressed_attention_fake(q, *args) -> torch.Tensor:
    return torch.empty_like(q)


# ---- layer-level entry points -----------------------------------------------------------------------

def _codec_tables(q: FusedQuantizer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.rot, q.offset, q.scale


def write_compressed(codec: KVCodec, parts: dict[str, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                     pos: torch.Tensor, pages: torch.Tensor | None = None) -> None:
    """Quantize-and-pack k, v [B,H,S,d] into one layer's cache parts at rows ``pos[b] + j`` (a paged cache's pools
    through ``pages`` [B, blocks] int32), the slots too where the codec keeps them; values predicted from the keys:
    :func:`esm_turbo.ops.predicted.write_predicted`."""
    if getattr(codec, "predictor", None) is not None:
        from .predicted import write_predicted
        write_predicted(codec, parts, k, v, pos, pages)
        return
    pack_layer(codec, parts, k, v, pos, pages)


def pack_layer(codec: KVCodec, parts: dict[str, torch.Tensor], k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
               pages: torch.Tensor | None = None) -> None:
    """k and v as given (no prediction) into the layer's packed parts: ``esm_turbo::quantize_pack``, one Triton launch
    on CUDA (:func:`write_compressed`'s contract)."""
    tables = fused_tables(codec)
    key, value = codec.key, codec.value
    _run(quantize_pack, _QUANTIZE_PACK, k, v, *_codec_tables(key), tables.k_bounds, key.centroids,
         tables.k_layout, *tables.packed(parts, "k"), *_codec_tables(value), tables.v_bounds, value.centroids,
         tables.v_layout, *tables.packed(parts, "v"), pos, tables.k_code.to_op(), tables.v_code.to_op(),
         tables.k_rot16, tables.v_rot16, pages, parts.get("k.slots"), parts.get("v.slots"), tables.k_tab,
         tables.v_tab, bool(getattr(codec, "relative_slots", False)))


def cached_codes(codec: KVCodec, parts: dict[str, torch.Tensor], kind: str) -> CachedCodes:
    """One kind's ('k' or 'v') packed cache of a layer and the constants that decode it."""
    tables = fused_tables(codec)
    q = codec.key if kind == "k" else codec.value
    table, layout, code = ((tables.k_tab, tables.k_layout, tables.k_code) if kind == "k" else
                           (tables.v_tab, tables.v_layout, tables.v_code))
    return CachedCodes(*tables.packed(parts, kind), table, layout, q.rot, q.offset, q.scale, code,
                       parts.get(f"{kind}.slots"), tables.k_perm if kind == "k" else None)


def attend_compressed(codec: KVCodec, parts: dict[str, torch.Tensor], lengths: torch.Tensor,
                      q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      new_valid: torch.Tensor, pages: torch.Tensor | None = None,
                      block_size: int = 0, shared: int = 0, leads: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of q [B,H,S,d] over one layer's packed prefix (``lengths`` [B] rows) plus the
    step's own k_new/v_new [B,H,S,d] (new_valid [B,S]). Returns [B,H,S,d] in q's dtype. A paged cache's parts
    are pools read through ``pages`` [B, blocks] int32 (:func:`compressed_attention_reference`), the first ``shared``
    tokens of every row in the same blocks as its lead's (``leads``; ``DecodeCache.shared_prefix``). Values predicted
    from the keys: :func:`esm_turbo.ops.predicted.attend_predicted_compressed`."""
    if getattr(codec, "predictor", None) is not None:
        from .predicted import attend_predicted_compressed
        return attend_predicted_compressed(codec, parts, lengths, q, k_new, v_new, new_valid, pages, block_size)
    keys, values = cached_codes(codec, parts, "k"), cached_codes(codec, parts, "v")
    if pages is None:
        pages = lengths.new_empty(0, dtype=torch.int32)
    return _run(compressed_attention, _COMPRESSED_ATTENTION, q, k_new, v_new,
                new_valid.contiguous().view(torch.uint8), lengths, *keys[:7], keys.code.to_op(), *values[:7],
                values.code.to_op(), pages, int(block_size), keys.slots, values.slots, keys.perm, int(shared), leads)
