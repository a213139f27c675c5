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
what it stores. Quantizers are built by ``esm_turbo.quant.fit`` (calibrated or data-oblivious); the level tables
and look-ups are ``esm_turbo.quant.tables``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from .layout import CodeLayout
from .lloyd_max import check_bits
from .packing import field_layout, pack_1bit_u8, unpack_1bit_u8
from .predict import stores_values
from .residual import check_residual_kind, qjl_projection, qjl_scale
from .rotations import AffineStats, affine_forward, affine_inverse
from .tables import code_table, lookup_codes, lut_code_parts, table_lookup

PartSpecs = dict[str, tuple[tuple[int, ...], torch.dtype]]


@runtime_checkable
class Quantizer(Protocol):
    """The codec contract: one of a layer's key or value quantizers. ``x``: [..., H, T, d] vectors (the cache passes
    [B, H, S, d]); parts: named tensors [..., H, T, *shape] whose trailing shapes and dtypes :meth:`part_specs` states
    per token and head (the cache allocates them and stores them as they come). ``decode(encode(x))`` ≈ x, float32.
    A :class:`KVCodec` pairs two; :func:`esm_turbo.quant.registry.register` names a method that builds them."""

    def part_specs(self) -> PartSpecs: ...

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor: ...


@runtime_checkable
class FusedQuantizer(Quantizer, Protocol):
    """A quantizer the fused ops (quantize-and-pack, decode attention: Triton on CUDA, their references elsewhere)
    read straight from its stored codes, whatever its class. It states its codes as:

    - an affine map ``y = (x Πᵀ − offset) / scale``: ``rot`` [H, d, d] (orthogonal), ``offset`` / ``scale`` [H, d];
    - per channel, levels ``centroids`` [H, d, K] (ascending): encoding picks the nearest level's index, and with a
      sign residual the sign of ``y − level``;
    - :meth:`code_layout`: how the codes are stored (:class:`~esm_turbo.quant.layout.CodeLayout`: index bits, sign
      plane or combined, field shifts); :meth:`layout`: the field layout [H, d] int32 of the packed part;
    - :meth:`code_values`: [H, d, codes] float16, the value in ``y`` that each stored code decodes to;
    - :meth:`fused_ready`: whether its parts are exactly the code layout's (nothing the ops would not read or write,
      such as per-vector norms or sketches) and its values fit fp16.

    ``decode`` must equal ``x̂ = (code_values[code] ⊙ scale + offset) Π``: the fused path and the codec's own decode
    then agree (``tests/test_codec_contract.py`` holds a codec that is not a :class:`VectorQuantizer` to it).

    The tensors (and ``heads``, ``dim``) are attributes, often module buffers, which ``isinstance`` against a Protocol
    cannot see on every Python: :func:`keeps_fused_contract` checks them by name."""

    def code_layout(self) -> CodeLayout: ...

    def layout(self) -> torch.Tensor: ...

    def code_values(self) -> torch.Tensor: ...

    def fused_ready(self) -> bool: ...

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

    def set_rotation(self, affine: AffineStats) -> None:
        self.rot_stored = affine.stored  # fp16 reflectors of a fitted rotation, for checkpoints
        self.rot_order = affine.order
        self.rot.copy_(affine.rot)
        self.offset.copy_(affine.offset)
        self.scale.copy_(affine.scale)

    # ---- layout -------------------------------------------------------------------------------
    def code_layout(self) -> CodeLayout:
        """How the codes are stored (:class:`~esm_turbo.quant.layout.CodeLayout`): built from the widths on the
        host once and kept until they change (a CUDA graph capture forbids host reads)."""
        key = (self.widths.data_ptr(), self.widths._version, self.bits, self.residual, self.grid)
        if getattr(self, "_code_layout_key", None) != key:
            self._code_layout = CodeLayout.of(self.dim, self.widths, self.bits, self.residual == "sign", self.grid)
            self._field_layout = field_layout(self.widths + int(self._code_layout.sign == "combined"))
            self._code_layout_key = key
        return self._code_layout

    def layout(self) -> torch.Tensor:
        """Field layout [H, d] int32 of the main packed part (``esm_turbo.quant.packing.field_layout``), kept with
        :meth:`code_layout`."""
        self.code_layout()
        return self._field_layout

    def code_values(self) -> torch.Tensor:
        """[H, d, codes] float16 (float32 if :attr:`wide`): what each stored code decodes to in the affine domain
        (:func:`~esm_turbo.quant.tables.code_table`)."""
        return code_table(self)

    def fused_ready(self) -> bool:
        """Whether the fused ops read and write all it stores: no per-vector norms (TurboQuant), no QJL sketch, and
        fp16 tables."""
        return not self.normalize and self.residual in ("none", "sign") and not self.wide

    def part_specs(self) -> PartSpecs:
        """Trailing shape and dtype of each stored part, per (token, head): the code layout's ``code`` (combined
        index and sign), or ``idx`` plus ``sign``; ``qjl`` + ``qjl_norm`` for a QJL residual; ``norm`` for
        TurboQuant."""
        specs: PartSpecs = dict(self.code_layout().part_specs())
        if self.normalize:
            specs["norm"] = ((), torch.float16)
        if self.residual == "qjl":
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
        code = self.code_layout()
        codes, idx = lut_code_parts(y, self.centroids, self.layout(), code.code_bits, code.has_sign,
                                    code.sign == "combined")
        parts.update(codes)
        if self.residual == "qjl":
            r = y - table_lookup(self.centroids, idx)
            sketch = r @ self.proj.T
            parts["qjl"] = pack_1bit_u8(sketch >= 0)
            parts["qjl_norm"] = r.norm(dim=-1).to(torch.float16)
        return parts

    def decode_affine(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """parts → ẑ [..., H, T, d] in the affine domain (norm applied), float32."""
        code = self.code_layout()
        y = lookup_codes(code_table(self), parts[code.part], parts.get("sign"), self.layout(), code.code_bits).float()
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


#: the attributes a :class:`FusedQuantizer` holds besides its methods
FUSED_TENSORS = ("rot", "offset", "scale", "centroids")


def keeps_fused_contract(q) -> bool:
    """Whether ``q`` keeps :class:`FusedQuantizer`'s contract: its methods, its tensors by name (module buffers are
    invisible to a Protocol's ``isinstance`` from Python 3.12), and ready for the fused ops (``fused_ready()``)."""
    return (isinstance(q, FusedQuantizer) and all(isinstance(getattr(q, n, None), torch.Tensor) for n in FUSED_TENSORS)
            and isinstance(getattr(q, "dim", None), int) and bool(q.fused_ready()))


def _specs_nbytes(specs: PartSpecs) -> int:
    return sum(int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
               for shape, dt in specs.values())


class KVCodec(nn.Module):
    """Key and value quantizers of one layer (dual LUTs). Parts are named ``k.<part>`` / ``v.<part>``, each stored per
    token and head, [..., H, T, *shape], but the token parts (:meth:`token_parts`), stored once per token over all
    heads, [..., 1, T, *shape]. ``slots`` > 0 (quantizers with an affine domain, :class:`VectorQuantizer`'s): each
    token keeps its ``slots`` worst-coded values of each kind as corrections (:mod:`esm_turbo.quant.slots`, ranked
    by their share of the token's squared error, or with ``relative_slots`` in their channel's scale), the token
    parts ``k.slots`` and ``v.slots``. With a ``predictor`` (:class:`~esm_turbo.quant.predict.ValuePredictor`) the
    value parts code v − predictor(k̂), k̂ the decoded keys: encoding and decoding then need each token's position
    (``positions`` [..., T] long; None: 0..T−1, a row from its start), which :attr:`needs_positions` says."""

    def __init__(self, key: nn.Module, value: nn.Module, window: int = 0, slots: int = 0,
                 relative_slots: bool = False, predictor: nn.Module | None = None):
        super().__init__()
        self.key, self.value = key, value
        #: values coded as their residual after this prediction from the decoded keys (esm_turbo.quant.predict)
        self.predictor = predictor
        self.window = int(window)  # > 0: the most recent ``window`` tokens are also kept in fp16 (KIVI)
        self.slots, self.relative_slots = int(slots), bool(relative_slots)
        if self.slots:
            from .slots import check_slot_values
            for q in (key, value):
                if not all(hasattr(q, a) for a in ("to_affine", "decode_affine", "from_affine", "scale")):
                    raise ValueError(f"slots need quantizers with an affine domain; {type(q).__name__} has none")
                check_slot_values(q.heads, q.dim)

    def token_parts(self) -> frozenset[str]:
        """The parts stored once per token over all heads ([..., 1, T, *shape]); the others per token and head."""
        return frozenset(("k.slots", "v.slots")) if self.slots else frozenset()

    def part_heads(self, name: str, heads: int) -> int:
        """How many heads part ``name`` is stored for in a cache of ``heads``: 1 for a token part."""
        return 1 if name in self.token_parts() else heads

    def part_specs(self) -> PartSpecs:
        specs = {f"k.{n}": s for n, s in self.key.part_specs().items()}
        specs.update({f"v.{n}": s for n, s in self.value.part_specs().items()})
        if self.slots:
            from .slots import SLOT_DTYPE
            specs.update({"k.slots": ((self.slots,), SLOT_DTYPE), "v.slots": ((self.slots,), SLOT_DTYPE)})
        return specs

    def bytes_per_token(self) -> int:
        """Stored bytes per token and head of the parts stored per head (keys + values; :meth:`token_bytes` counts
        every part of a token)."""
        return _specs_nbytes({n: s for n, s in self.part_specs().items() if n not in self.token_parts()})

    def token_bytes(self, heads: int) -> int:
        """Stored bytes of one token over ``heads`` heads: every part, the token parts once."""
        token = {n: s for n, s in self.part_specs().items() if n in self.token_parts()}
        return self.bytes_per_token() * heads + _specs_nbytes(token)

    @property
    def needs_positions(self) -> bool:
        """Whether :meth:`encode` and :meth:`decode` read the tokens' positions (a value predictor un-rotates keys)."""
        return self.predictor is not None

    def encode(self, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """k, v [..., H, T, d] → parts (see the class); ``positions`` only for a predictor."""
        parts: dict[str, torch.Tensor] = {}
        self._encode_kind("k", self.key, k, parts)
        if self.predictor is not None:
            v = v.float() - self.predictor(self._decode_kind("k", self.key, parts), positions)
        self._encode_kind("v", self.value, v, parts)
        return parts

    def coded_keys(self, k: torch.Tensor) -> torch.Tensor:
        """k [..., H, T, d] → k̂ as this codec stores and decodes them (slots applied), float32: what a predictor
        reads."""
        parts: dict[str, torch.Tensor] = {}
        self._encode_kind("k", self.key, k, parts)
        return self._decode_kind("k", self.key, parts)

    def _encode_kind(self, kind: str, q: nn.Module, x: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        parts.update({f"{kind}.{n}": t for n, t in q.encode(x).items()})
        if self.slots:
            from .slots import pick_slots
            y_hat = q.decode_affine(self._sub(parts, f"{kind}."))
            picked = pick_slots(q.to_affine(x), y_hat, q.scale, self.slots, self.relative_slots)
            parts[f"{kind}.slots"] = picked.unsqueeze(-3)  # [..., 1, T, k]

    def _decode_kind(self, kind: str, q: nn.Module, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        if not self.slots:
            return q.decode(self._sub(parts, f"{kind}."))
        from .slots import apply_slots
        return q.from_affine(apply_slots(q.decode_affine(self._sub(parts, f"{kind}.")),
                                         parts[f"{kind}.slots"].squeeze(-3)))

    @staticmethod
    def _sub(parts: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        return {n[2:]: t for n, t in parts.items() if n.startswith(prefix) and n[2:] != "slots"}

    def decode(self, parts: dict[str, torch.Tensor],
               positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """parts → (k̂, v̂) [..., H, T, d] float32; ``positions`` only for a predictor."""
        k_hat, r_hat = self.decode_split(parts)
        if self.predictor is None:
            return k_hat, r_hat
        v_hat = self.predictor(k_hat, positions)
        return k_hat, v_hat if r_hat is None else v_hat + r_hat

    def decode_split(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """parts → (k̂, r̂) [..., H, T, d] float32: r̂ the values as coded, before a predictor's prediction from k̂ is
        added (the values themselves without a predictor; None when the values are not stored at all,
        :class:`~esm_turbo.quant.predict.Unstored`). Attention can add Σ p·prediction once a row
        (:func:`esm_turbo.ops.reference.attend_predicted`) instead of predicting every cached token's values."""
        r_hat = self._decode_kind("v", self.value, parts) if stores_values(self) else None
        return self._decode_kind("k", self.key, parts), r_hat

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
