"""The KV codec: rotation → affine (centre, scale) → optional per-vector norm → LUT index → residual.

A :class:`VectorQuantizer` compresses one tensor kind (keys or values) of one layer, H heads of
head_dim d. Encoding ``x`` [..., H, T, d]:

1. ``y = (x @ Π_hᵀ - offset_h) / scale_h``                      (rotation and affine, per head)
2. if ``normalize``: ``n = ‖y‖``, ``y ← y / n``  (n stored as fp16: data-oblivious TurboQuant)
3. ``idx = argmin_k |y_c - LUT_{h,c}[k]|`` packed at ``bits`` bits (a LUT per head and channel: one
   per head repeated over the channels, or each channel its own)
4. residual ``r = y - LUT_{h,c}[idx]``: ``sign`` bit, or the QJL sketch bits and ‖r‖ (fp16)

Decoding inverts this. Because step 1 is linear, attention can be computed in the quantized domain:
``⟨q, x̂⟩ = ⟨(Π q) ⊙ scale, n · ŷ⟩ + ⟨Π q, offset⟩`` — the fused kernel never rotates a key back.

A :class:`KVCodec` pairs one quantizer for keys and one for values (dual LUTs, own bit widths).
Every codec exposes ``part_specs()`` — the byte layout of one token — so caches allocate exactly
what it stores.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .lloyd_max import check_bits, density_points, lloyd_max, lloyd_max_batched, midpoints
from .allocation import ChannelTables, allocate, channel_tables, grid_tables, tier_order, widest_bits
from .packing import field_layout, pack_1bit_u8, pack_fields, unpack_1bit_u8, unpack_fields
from .residual import check_residual_kind, qjl_projection, qjl_scale, sign_eps_batched, sign_eps_table
from .rotations import FITTED_KINDS, AffineStats, affine_forward, affine_inverse, build_rotation, check_rotation_kind

PartSpecs = dict[str, tuple[tuple[int, ...], torch.dtype]]

#: code widths (index bits + 1 sign bit) stored as one combined code
COMBINED_CODE_BITS = (2, 3, 4)

#: LUT granularity: one LUT per head (the paper), one per head and (rotated) channel, or per channel a uniform grid
#: whose values the decoder computes from the code (no look-up; ``esm_turbo.quant.allocation.grid_tables``)
LUT_KINDS = ("head", "channel", "grid")


def check_lut_kind(kind: str) -> str:
    if kind not in LUT_KINDS:
        raise ValueError(f"unknown LUT granularity {kind!r}: choose one of {LUT_KINDS}")
    return kind


def check_head_dim(dim: int) -> int:
    if dim <= 0 or dim % 8:
        raise ValueError(f"head_dim {dim} is not a positive multiple of 8 (ESM-2 uses 16, 24, 32, 64, 128)")
    return dim


def check_input(x: torch.Tensor, heads: int, dim: int, ref: torch.Tensor, what: str) -> None:
    """Shape / dtype / device / finiteness checks with messages naming the problem."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{what}: expected a floating-point tensor, got {x.dtype}")
    if x.dim() < 3 or x.shape[-1] != dim or x.shape[-3] != heads:
        raise ValueError(f"{what}: expected shape [..., {heads} heads, T, {dim}], got {list(x.shape)}")
    if x.device != ref.device:
        raise ValueError(f"{what}: tensor is on {x.device} but the codec is on {ref.device}; "
                         f"move one with .to()")
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing and not torch.compiler.is_compiling() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{what}: input contains NaN or Inf")


def lut_bounds(centroids: torch.Tensor) -> torch.Tensor:
    """Decision boundaries (midpoints) of sorted LUTs: centroids [H, d, K] → [H, d, K-1]; +inf from the first
    level equal to the last on (a channel with fewer levels than K is padded with its last one), so
    ``#{bounds < y}`` never goes past it."""
    tail = centroids[..., :-1] == centroids[..., -1:]
    return torch.where(tail, torch.inf, midpoints(centroids)).contiguous()


def lut_index(y: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Nearest-centroid index of y [..., H, T, d] under per-(head, channel) LUTs [H, d, K]: ``#{bounds < y}``
    (long), ``torch.searchsorted``'s answer, counted with K − 1 compares into uint8 (2–3× faster on CPU)."""
    heads, dim = centroids.shape[:2]
    bounds = lut_bounds(centroids).permute(2, 0, 1).contiguous()  # [K-1, H, d]
    idx = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for b in bounds:
        idx += y > b.view(heads, 1, dim)
    return idx.long()


def pad_levels(table: torch.Tensor, widths: torch.Tensor, k: int) -> torch.Tensor:
    """Per-channel LUTs table [H, d, K0, *tail] of which channel (h, c) uses its first 2^widths[h, c] levels →
    [H, d, k, *tail], each channel's last level repeated (the padding :func:`lut_bounds` never picks)."""
    levels = (1 << widths.long().to(table.device))[..., None]  # [H, d, 1]
    idx = torch.arange(k, device=table.device).clamp_max(levels - 1)  # [H, d, k]
    idx = idx.view(*idx.shape, *[1] * (table.dim() - 3)).expand(*idx.shape, *table.shape[3:])
    return table.gather(2, idx)


def table_lookup(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Per-(head, channel) gather: table [H, d, K, *tail] at idx [..., H, T, d] → [..., H, T, d, *tail] (one
    ``index_select`` into the flattened table: half the time of advanced indexing on CPU)."""
    heads, dim, k = table.shape[:3]
    rows = torch.arange(heads * dim, device=idx.device).view(heads, 1, dim)
    flat = (idx.long() + rows * k).reshape(-1)
    out = table.reshape(heads * dim * k, *table.shape[3:]).index_select(0, flat)
    return out.reshape(*idx.shape, *table.shape[3:])


def code_table(q: "VectorQuantizer") -> torch.Tensor:
    """[H, d, n_codes] float16 values of a fused code: ``2·idx + sign → c[idx] + ε₁ | c[idx] − ε₀`` with a
    sign residual, ``idx → c[idx]`` without, rounded to fp16. These are the values decoding reconstructs, on
    every path: the kernels may read the table in fp16 (half the bytes of fp32) and still match. A
    :attr:`VectorQuantizer.wide` quantizer's table stays float32."""
    table = q.centroids
    if q.residual == "sign":
        lo = q.centroids - q.eps[..., 0]
        hi = q.centroids + q.eps[..., 1]
        table = torch.stack([lo, hi], dim=-1).reshape(q.heads, q.dim, -1)
    return (table.float() if q.wide else table.half()).contiguous()


def identity_code(q: "VectorQuantizer") -> bool:
    """Whether code j decodes to j on every code a channel uses (2^(width + sign bit) of them): the tables of a
    :attr:`VectorQuantizer.grid` quantizer. Reads the device."""
    table = code_table(q).float()
    j = torch.arange(table.shape[-1], device=table.device, dtype=torch.float32)
    used = j < (1 << (q.widths + int(q.residual == "sign")))[..., None]
    return bool(((table == j) | ~used).all())


def check_code_table(q: "VectorQuantizer") -> "VectorQuantizer":
    """Refuse tables whose decoded levels overflow fp16 (reads the device: at calibration, not per step)."""
    if not bool(torch.isfinite(code_table(q)).all()):
        raise ValueError("decoded levels beyond the fp16 range: use a scaled rotation (svd-scaled)")
    return q


def lookup_codes(table: torch.Tensor, packed: torch.Tensor, sign: torch.Tensor | None, layout: torch.Tensor,
                 width: int) -> torch.Tensor:
    """Packed codes [..., H, T, d·width/8] of a field layout [H, d] (``esm_turbo.quant.packing``; and
    separate sign bits [..., H, T, d/8], or None / empty) → table [H, d, codes] values [..., H, T, d], one
    look-up per value: of the code, or of ``2·code + sign`` with separate sign bits (see :func:`code_table`)."""
    codes = unpack_fields(packed, layout, width)
    if sign is not None and sign.numel():
        codes = 2 * codes + unpack_1bit_u8(sign).long()
    return table_lookup(table, codes)


def lut_code_parts(y: torch.Tensor, centroids: torch.Tensor, layout: torch.Tensor, width: int, sign: bool,
                   combined: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Nearest-LUT codes of y [..., H, T, d] (affine domain), packed under ``layout`` [H, d] at ``width`` bits
    per value on average: ``code`` = 2·idx + sign when ``combined``, else ``idx`` (+ ``sign`` bits). Returns
    (parts, idx)."""
    idx = lut_index(y, centroids)
    if not sign:
        return {"idx": pack_fields(idx, layout, width)}, idx
    above = y >= table_lookup(centroids, idx)
    if combined:
        return {"code": pack_fields(2 * idx + above, layout, width)}, idx
    return {"idx": pack_fields(idx, layout, width), "sign": pack_1bit_u8(above)}, idx


class VectorQuantizer(nn.Module):
    """Quantizer for one tensor kind of one layer. Buffers (float32 unless said):

    rot [H,d,d], offset [H,d], scale [H,d], centroids [H,d,K] and eps [H,d,K,2] (sign residual) per head
    and channel, widths [H,d] (int64: index bits of each channel; ``bits`` everywhere unless allocated, see
    ``esm_turbo.quant.allocation``; K = 2^max_bits, a channel of fewer bits repeats its last level),
    proj [m,d] (QJL sketch; m = d).

    ``grid``: every channel's levels are evenly spaced and folded into its affine map, so the value of code j
    (``2·idx + sign`` with a sign residual) is j itself — the kernels compute it instead of looking it up.
    """

    def __init__(self, heads: int, dim: int, bits: int, residual: str = "none",
                 normalize: bool = False, qjl_seed: int = 0, max_bits: int | None = None):
        super().__init__()
        self.heads, self.dim = heads, check_head_dim(dim)
        self.bits = check_bits(bits)
        self.residual = check_residual_kind(residual)
        self.normalize = bool(normalize)
        self.qjl_seed = int(qjl_seed)
        k = 2 ** max(self.bits, max_bits or 0)
        self.register_buffer("rot", torch.eye(dim).expand(heads, dim, dim).clone())
        self.register_buffer("offset", torch.zeros(heads, dim))
        self.register_buffer("scale", torch.ones(heads, dim))
        self.register_buffer("centroids", torch.zeros(heads, dim, k))
        self.register_buffer("eps", torch.zeros(heads, dim, k, 2))
        self.register_buffer("widths", torch.full((heads, dim), self.bits, dtype=torch.long))
        proj = qjl_projection(dim, dim, qjl_seed) if residual == "qjl" else torch.zeros(0, dim)
        self.register_buffer("proj", proj)
        self.rot_stored: torch.Tensor | None = None
        self.rot_order: torch.Tensor | None = None  # [H, d] rows of the fitted rotation kept, in order
        self.grid = False
        # fp32 tables: a calibration whose levels overflow fp16 (unscaled rotations of large activations, the
        # paper's recipe) keeps them in fp32; such a codec decodes on the PyTorch path (the kernels read fp16)
        self.wide = False

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def oblivious(cls, heads: int, dim: int, bits: int, rotation: str = "hadamard",
                  residual: str = "none", seed: int = 0) -> "VectorQuantizer":
        """Data-oblivious TurboQuant: random rotation, per-vector norm, LUT of the sphere density."""
        if check_rotation_kind(rotation) in FITTED_KINDS:
            raise ValueError(f"rotation {rotation!r} needs calibration; use from_calibration")
        q = cls(heads, dim, bits, residual, normalize=True, qjl_seed=seed + 1)
        q.set_rotation(build_rotation(rotation, heads, dim, seed))
        lut = lloyd_max(q.bits, "sphere", dim).centroids
        values, weights = density_points("sphere", dim)
        eps = sign_eps_table(values, weights, lut, "bin")
        q.centroids.copy_(torch.as_tensor(lut).half())  # fp16 values, as calibrated LUTs
        q.eps.copy_(torch.as_tensor(eps))
        return q

    @classmethod
    def from_calibration(cls, affine: AffineStats, points: tuple[torch.Tensor, torch.Tensor], bits: int,
                         residual: str = "sign", sign_mode: str = "bin", seed: int = 0,
                         lut_points: tuple[torch.Tensor, torch.Tensor] | None = None,
                         importance: torch.Tensor | None = None, max_bits: int | None = None,
                         tables: ChannelTables | None = None, shared_widths: bool = False,
                         grid: bool = False) -> "VectorQuantizer":
        """Calibrated codec: ``points`` = (values, weights) [G, N], weighted samples in the affine domain
        (after rotation, centring and scaling) of G = H groups (one LUT per head) or G = H·d (one per head
        and channel, channel-minor). LUTs are fitted on ``lut_points`` (default ``points``; other points
        give e.g. a K/V-shared LUT). Tables are rounded to fp16 values, the precision checkpoints keep.
        ``grid`` (or grid ``tables``): uniform levels per channel instead of LUTs (:attr:`grid`; per-channel points).

        With ``importance`` [H, d] (how much an error of each affine channel reaches the output), channels get
        allocated widths of 0 … ``max_bits`` (default bits + 1) index bits, ``bits`` on average
        (``esm_turbo.quant.allocation``; ``shared_widths``: the same widths for every head); needs per-channel
        points, whose LUTs at every width ``tables`` may hold already (fitted for many layers at once)."""
        heads, dim = affine.offset.shape
        values, weights = points
        if values.shape[0] not in (heads, heads * dim):
            raise ValueError(f"expected calibration points for {heads} heads or {heads * dim} channels, "
                             f"got {values.shape[0]} groups")
        if grid and tables is not None and not tables.grid:
            raise ValueError("grid=True was asked for with per-channel LUT tables: pass grid tables "
                             "(quant.allocation.grid_tables) or none")
        grid = grid or (tables is not None and tables.grid)
        if importance is not None or grid:
            if values.shape[0] != heads * dim or lut_points is not None:
                raise ValueError("bit allocation and grids need per-channel calibration points and the codec's "
                                 "own tables")
            top = widest_bits(bits, max_bits) if importance is not None else bits
            if tables is None and grid:
                tables = grid_tables(*points, top, residual == "sign")
            elif tables is None:
                tables = channel_tables(*points, top, sign_mode if residual == "sign" else None)
            return cls._allocated(affine, tables, bits, residual, seed, importance, shared_widths)
        q = cls(heads, dim, bits, residual, normalize=False, qjl_seed=seed + 1)
        q.set_rotation(affine)
        lut, _ = lloyd_max_batched(*(lut_points or points), q.bits)
        fits = bool(torch.isfinite(lut.half()).all())
        q.wide = not fits  # levels beyond the fp16 range: kept in fp32 (see :attr:`wide`)
        lut = lut.half().double() if fits else lut.double()
        eps = sign_eps_batched(values, weights, lut, sign_mode)
        eps = eps.half() if fits and bool(torch.isfinite(eps.half()).all()) else eps.float()
        groups = values.shape[0] // heads
        q.centroids.copy_(lut.view(heads, groups, -1).expand(heads, dim, -1))
        q.eps.copy_(eps.view(heads, groups, -1, 2).expand(heads, dim, -1, 2))
        return check_code_table(q)

    @classmethod
    def _allocated(cls, affine: AffineStats, tables: ChannelTables, bits: int, residual: str, seed: int,
                   importance: torch.Tensor | None, shared_widths: bool) -> "VectorQuantizer":
        """A quantizer of per-channel ``tables``: widths allocated by ``importance`` (channels reordered into
        tiers), or ``bits`` everywhere without one."""
        heads, dim = affine.offset.shape
        luts, eps, mse = tables.luts, tables.eps, tables.mse
        if importance is None:
            rows = torch.arange(heads * dim, device=mse.device)
            widths = torch.full((heads * dim,), bits, dtype=torch.long, device=mse.device)
        else:
            cost = importance.double().to(mse.device).reshape(-1, 1) * mse  # [H·d, top + 1]
            order = tier_order(cost[:, bits].reshape(heads, dim).cpu()).to(mse.device)
            rows = (order + torch.arange(heads, device=order.device)[:, None] * dim).reshape(-1)
            widths = allocate(cost[rows].reshape(heads, dim, -1), bits, shared_widths).reshape(-1)
            affine = affine.permuted(order)
        top = int(widths.max())  # tables only as long as the widest channel needs
        q = cls(heads, dim, bits, residual, normalize=False, qjl_seed=seed + 1, max_bits=top)
        q.set_rotation(affine)
        k = q.centroids.shape[-1]
        centroids = torch.zeros(heads * dim, k, dtype=torch.float64, device=mse.device)
        table = torch.zeros(heads * dim, k, 2, dtype=torch.float64, device=mse.device)
        for b in range(top + 1):  # each channel's own levels; pad_levels fills the rest
            pick = widths == b
            centroids[pick, :2**b] = luts[b][rows[pick]]
            if eps[b] is not None:
                table[pick, :2**b] = eps[b][rows[pick]]
        widths = widths.view(heads, dim)
        centroids, table = centroids.view(heads, dim, k), table.view(heads, dim, k, 2)
        if tables.grid:
            centroids, table = q._fold_grid(centroids, table, widths)
        q.centroids.copy_(pad_levels(centroids, widths, k))
        q.eps.copy_(pad_levels(table, widths, k))
        q.widths.copy_(widths)
        return check_code_table(q)

    def _fold_grid(self, centroids: torch.Tensor, eps: torch.Tensor,
                   widths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Uniform levels ``a + s·j`` of each channel (centroids [H, d, K], eps [H, d, K, 2] of
        :func:`~esm_turbo.quant.allocation.grid_tables`, widths [H, d]) moved into the affine map — offset += scale·a,
        scale ·= s — leaving the identity code (level j is j): returns the new (centroids, eps), and sets
        :attr:`grid`."""
        sign = self.residual == "sign"
        if sign:
            a, s = centroids[..., 0] - eps[..., 0, 0], 2 * eps[..., 0, 0]
        else:
            a, s = centroids[..., 0], torch.where(widths > 0, centroids[..., 1] - centroids[..., 0], 1.0)
        s = torch.where(s > 0, s, 1.0)
        self.offset.copy_(self.offset.double() + self.scale.double() * a)
        self.scale.copy_(self.scale.double() * s)
        idx = torch.arange(centroids.shape[-1], dtype=torch.float64, device=centroids.device).expand_as(centroids)
        self.grid = True
        if sign:
            return 2 * idx + 0.5, torch.full_like(eps, 0.5)
        return idx.clone(), torch.zeros_like(eps)

    def set_rotation(self, affine: AffineStats) -> None:
        self.rot_stored = affine.stored  # fp16 reflectors of a fitted rotation, for checkpoints
        self.rot_order = affine.order
        self.rot.copy_(affine.rot)
        self.offset.copy_(affine.offset)
        self.scale.copy_(affine.scale)

    # ---- layout -------------------------------------------------------------------------------
    @property
    def combined_sign(self) -> bool:
        """A sign residual over ≤3 index bits is stored fused as one (bits+1)-bit code ``2·idx + sign``
        (3 + 1 bits → one nibble per value): the same bytes as separate planes, one aligned load less."""
        return self.residual == "sign" and self.bits + 1 in COMBINED_CODE_BITS

    @property
    def field_widths(self) -> torch.Tensor:
        """[H, d] bits of each channel's stored code: its index width, + 1 for a combined sign bit."""
        return self.widths + int(self.combined_sign)

    @property
    def code_width(self) -> int:
        """Average bits per channel of the main packed part (its bytes per group of 8 channels)."""
        return self.bits + int(self.combined_sign)

    def layout(self) -> torch.Tensor:
        """Field layout [H, d] int32 of the main packed part (``esm_turbo.quant.packing.field_layout``), kept
        until the widths change: its checks read values on the host, which a CUDA graph capture forbids."""
        key = (self.widths.data_ptr(), self.widths._version, self.combined_sign)
        if getattr(self, "_layout_key", None) != key:
            self._layout, self._layout_key = field_layout(self.field_widths), key
        return self._layout

    def part_specs(self) -> PartSpecs:
        """Trailing shape and dtype of each stored part, per (token, head): ``code`` (combined index and
        sign), or ``idx`` plus ``sign`` / ``qjl`` + ``qjl_norm``; ``norm`` for TurboQuant."""
        d = self.dim
        if self.combined_sign:
            specs: PartSpecs = {"code": ((d * (self.bits + 1) // 8,), torch.uint8)}
        else:
            specs = {"idx": ((d * self.bits // 8,), torch.uint8)}
        if self.normalize:
            specs["norm"] = ((), torch.float16)
        if self.residual == "sign" and not self.combined_sign:
            specs["sign"] = ((d // 8,), torch.uint8)
        elif self.residual == "qjl":
            specs["qjl"] = ((self.proj.shape[0] // 8,), torch.uint8)
            specs["qjl_norm"] = ((), torch.float16)
        return specs

    def bits_per_value(self) -> float:
        """All-in stored bits per scalar value (norms and sketches included)."""
        total = 0
        for shape, dtype in self.part_specs().values():
            total += int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        return 8 * total / self.dim

    # ---- transform ----------------------------------------------------------------------------
    def to_affine(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H, T, d] → y [..., H, T, d] = (x Πᵀ - offset) / scale (float32)."""
        return affine_forward(x, self.rot, self.offset, self.scale)

    def from_affine(self, y: torch.Tensor) -> torch.Tensor:
        return affine_inverse(y, self.rot, self.offset, self.scale)

    # ---- encode / decode ----------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x [..., H, T, d] float → parts, each [..., H, T, *part_shape]."""
        check_input(x, self.heads, self.dim, self.rot, "VectorQuantizer.encode")
        y = self.to_affine(x)
        parts: dict[str, torch.Tensor] = {}
        if self.normalize:
            norm = y.norm(dim=-1, keepdim=True)
            parts["norm"] = norm.squeeze(-1).to(torch.float16)
            y = y / norm.clamp_min(1e-30)
        codes, idx = lut_code_parts(y, self.centroids, self.layout(), self.code_width, self.residual == "sign",
                                    self.combined_sign)
        parts.update(codes)
        if self.residual == "qjl":
            r = y - table_lookup(self.centroids, idx)
            sketch = r @ self.proj.T
            parts["qjl"] = pack_1bit_u8(sketch >= 0)
            parts["qjl_norm"] = r.norm(dim=-1).to(torch.float16)
        return parts

    def decode_affine(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """parts → ẑ [..., H, T, d] in the affine domain (norm applied), float32."""
        main = parts["code" if self.combined_sign else "idx"]  # idx: its sign bits apart, if any
        y = lookup_codes(code_table(self), main, parts.get("sign"), self.layout(), self.code_width).float()
        if self.residual == "qjl":
            signs = unpack_1bit_u8(parts["qjl"]).float() * 2 - 1
            m = self.proj.shape[0]
            y = y + qjl_scale(m) * parts["qjl_norm"].float().unsqueeze(-1) * (signs @ self.proj)
        if self.normalize:
            y = y * parts["norm"].float().unsqueeze(-1)
        return y

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """parts → x̂ [..., H, T, d] float32 in the original domain."""
        return self.from_affine(self.decode_affine(parts))

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, dim={self.dim}, bits={self.bits}, residual={self.residual}, "
                f"normalize={self.normalize}")


def _specs_nbytes(specs: PartSpecs) -> int:
    return sum(int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
               for shape, dt in specs.values())


class KVCodec(nn.Module):
    """Key and value quantizers of one layer (dual LUTs). Parts are named ``k.<part>`` / ``v.<part>``."""

    def __init__(self, key: nn.Module, value: nn.Module, window: int = 0):
        super().__init__()
        self.key, self.value = key, value
        self.window = int(window)  # > 0: the most recent ``window`` tokens are also kept in fp16 (KIVI)

    def part_specs(self) -> PartSpecs:
        specs = {f"k.{n}": s for n, s in self.key.part_specs().items()}
        specs.update({f"v.{n}": s for n, s in self.value.part_specs().items()})
        return specs

    def bytes_per_token(self) -> int:
        """Stored bytes per token per head (keys + values, all parts)."""
        return _specs_nbytes(self.part_specs())

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = {f"k.{n}": t for n, t in self.key.encode(k).items()}
        parts.update({f"v.{n}": t for n, t in self.value.encode(v).items()})
        return parts

    def decode(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        def sub(prefix: str) -> dict[str, torch.Tensor]:
            return {n[2:]: t for n, t in parts.items() if n.startswith(prefix)}
        return self.key.decode(sub("k.")), self.value.decode(sub("v."))

    def constant_nbytes(self) -> int:
        """Bytes of the codec's own tables (rotations, LUTs, scales): fixed, not per token."""
        return sum(b.numel() * b.element_size() for b in self.buffers())


class DenseQuantizer(nn.Module):
    """Uncompressed storage (fp32 / fp16 / bf16) behind the same interface: the fidelity reference."""

    def __init__(self, heads: int, dim: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.heads, self.dim, self.dtype = heads, dim, dtype
        self.register_buffer("_device_anchor", torch.zeros(0))

    def part_specs(self) -> PartSpecs:
        return {"x": ((self.dim,), self.dtype)}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        check_input(x, self.heads, self.dim, self._device_anchor, "DenseQuantizer.encode")
        return {"x": x.to(self.dtype)}

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return parts["x"].float()


def dense_codec(heads: int, dim: int, dtype: torch.dtype = torch.float32) -> KVCodec:
    return KVCodec(DenseQuantizer(heads, dim, dtype), DenseQuantizer(heads, dim, dtype))


def oblivious_codec(heads: int, dim: int, bits: int = 3, rotation: str = "hadamard",
                    residual: str = "none", seed: int = 0, value_bits: int | None = None) -> KVCodec:
    """A data-oblivious TurboQuant codec for one layer (no calibration)."""
    return KVCodec(VectorQuantizer.oblivious(heads, dim, bits, rotation, residual, seed),
                   VectorQuantizer.oblivious(heads, dim, value_bits or bits, rotation, residual, seed + 7919))
