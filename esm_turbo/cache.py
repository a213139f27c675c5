"""The contiguous KV cache: L layers × B rows × H heads, storing whatever its per-layer codecs encode, each codec
part in a buffer [B, H, capacity, *part_shape] that grows by doubling.

It keeps the cache contract, stated with its shapes in :mod:`esm_turbo.cache_contract`: ``write`` then ``commit``
(a step written and not committed is a peek), ``truncate``, ``select`` (beam forks), ``dequantize`` (the reference
path) and ``memory_report`` (every byte held). Codecs that keep KIVI's recent tokens in fp16 get a
:class:`~esm_turbo.window.RecentWindow` beside the codes, laid over what ``dequantize`` gives.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import torch

from . import ops
from .quant.codec import KVCodec
from .quant.slots import KERNEL_SLOTS
from .window import RecentWindow


@dataclass(frozen=True)
class MemoryReport:
    """Exact memory accounting of a cache. Per-token figures count keys + values of every head; a token's bytes over
    all layers are ``bytes_per_token`` (layers of different widths: ``bytes_per_token_per_layer`` is their mean, a
    fraction where they do not divide evenly)."""

    layers: int
    heads: int
    head_dim: int
    bytes_per_token_per_layer: int | float
    part_bytes_per_token_per_layer: dict
    tokens: int
    used_bytes: int
    allocated_bytes: int
    constant_bytes: int
    fp32_bytes_per_token_per_layer: int
    fp16_bytes_per_token_per_layer: int
    window_bytes: int = 0  # fp16 recent-token windows (KIVI), a fixed cost per sequence, in allocated_bytes
    shared_saved_bytes: int = 0  # a paged cache: what rows sharing blocks would hold more with blocks of their own
    host_bytes: int = 0  # a paged cache over a device budget: blocks moved to host memory (counted in used_bytes)
    bytes_per_token: int = 0  # one token over every layer

    @property
    def bits_per_value(self) -> float:
        return 8 * self.bytes_per_token / (2 * self.heads * self.head_dim * self.layers)

    @property
    def ratio_vs_fp32(self) -> float:
        return self.fp32_bytes_per_token_per_layer / self.bytes_per_token_per_layer

    @property
    def ratio_vs_fp16(self) -> float:
        return self.fp16_bytes_per_token_per_layer / self.bytes_per_token_per_layer

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(bits_per_value=self.bits_per_value, ratio_vs_fp32=self.ratio_vs_fp32,
                   ratio_vs_fp16=self.ratio_vs_fp16)
        return out


def token_bytes(codecs: list[KVCodec], heads: int) -> int:
    """Stored bytes of one token over every layer of ``codecs`` (each layer's :meth:`KVCodec.token_bytes`)."""
    return sum(c.token_bytes(heads) for c in codecs)


def new_positions(codec: KVCodec, lengths: torch.Tensor, s: int) -> dict[str, torch.Tensor]:
    """``positions=`` [B, S] of S new tokens written at ``lengths[b] + j``, for a codec that reads them
    (:attr:`KVCodec.needs_positions`); nothing for the others."""
    if not getattr(codec, "needs_positions", False):
        return {}
    return {"positions": lengths[:, None] + torch.arange(s, device=lengths.device)}


def per_layer(total: int, layers: int) -> int | float:
    """A token's mean bytes a layer: an int where the layers divide ``total`` evenly, else the exact fraction."""
    return total // layers if total % layers == 0 else total / layers


#: a replayed captured step past the room reserved before its capture (the graph's buffers cannot grow)
ROOM_USED_UP = "the captured step's reserved cache room is used up; capture again with a larger reserve"


class KVCache:
    """Batched, ragged KV cache over per-layer codecs (compressed or dense)."""

    #: rows stored as [B, H, T_cap, …] buffers that ops may read in place (a paged cache reads through block tables)
    contiguous = True

    def __init__(self, codecs: list[KVCodec], batch_size: int, capacity: int = 64,
                 device: torch.device | str | None = None):
        if not codecs:
            raise ValueError("a cache needs at least one layer codec")
        self.codecs = codecs
        first = codecs[0].key
        self.heads, self.head_dim = first.heads, first.dim
        self.device = torch.device(device) if device is not None else next(iter(codecs[0].buffers())).device
        self.batch_size = batch_size
        self.capacity = max(int(capacity), 1)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        # host-side upper bound of lengths.max(): capacity checks need no device sync (CUDA graphs)
        self._max_bound = 0
        self._version = 0  # bumped when the stored buffers are replaced (storage_version)
        self._written = 0
        self.parts: list[dict[str, torch.Tensor]] = [self._alloc(c, batch_size, self.capacity) for c in codecs]
        #: KIVI's fp16 recent-token window, a layer over the codes for the codecs that keep one (esm_turbo.window)
        self.window: RecentWindow | None = (RecentWindow(codecs, batch_size, self.heads, self.head_dim, self.device)
                                            if RecentWindow.wanted(codecs) else None)
        #: per layer: the fused ops (Triton on CUDA) write and read it, or the PyTorch reference (ops.kernel_path)
        self.fused: list[bool] = [ops.kernel_path(c, self.device) for c in codecs]
        if any(getattr(c, "slots", 0) > KERNEL_SLOTS for c in codecs) and ops.use_kernels(self.device):
            warnings.warn(f"codecs with more than {KERNEL_SLOTS} slot a token (calibrate --slots) are written and read "
                          f"on the PyTorch path: the fused GPU kernels read {KERNEL_SLOTS}", stacklevel=2)
        from .ops.compressed import fused_supported, kernel_head_width
        narrow = sorted({c.key.dim for c in codecs if fused_supported(c) and not kernel_head_width(c.key.dim)})
        if narrow and ops.use_kernels(self.device):
            warnings.warn(f"heads of {', '.join(map(str, narrow))} channels are written and read on the PyTorch path: "
                          "the fused GPU kernels take head widths whose eighth is a power of two (16, 32, 64, 128, …)",
                          stacklevel=2)
        if any(getattr(c, "needs_positions", False) and not on for c, on in zip(codecs, self.fused)) \
                and ops.use_kernels(self.device):
            warnings.warn("values predicted from the keys (calibrate --predict-values) are written and read on the "
                          "PyTorch path: the fused walk is off (ESM_TURBO_PREDICTED_WALK=0) or takes no slots, keys "
                          "under a dense rotation nor layers wider than it holds "
                          "(esm_turbo.kernels.decode.predicted.fits)", stacklevel=2)

    @property
    def num_layers(self) -> int:
        return len(self.codecs)

    def _alloc(self, codec: KVCodec, batch: int, capacity: int) -> dict[str, torch.Tensor]:
        return {name: torch.zeros(batch, codec.part_heads(name, self.heads), capacity, *shape, dtype=dtype,
                                  device=self.device)
                for name, (shape, dtype) in codec.part_specs().items()}

    def set_lengths(self, length: int) -> None:
        """Declare every row ``length`` tokens long, taking the stored parts as they are (a benchmark fills them with
        random codes; 0 empties the cache)."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"length {length} outside the cache's capacity 0..{self.capacity}")
        self.lengths.fill_(length)
        self._max_bound = length
        self._written = 0

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` more tokens per row now (before capturing a CUDA graph)."""
        self._ensure_capacity(self._max_bound + tokens)

    @property
    def length_bound(self) -> int:
        """An upper bound on every row's length, kept on the host (read without waiting for the device)."""
        return self._max_bound

    def rewind_bound(self, bound: int) -> None:
        """Put :attr:`length_bound` back to ``bound``: a CUDA-graph capture records a step without running it."""
        self._max_bound = int(bound)

    def claim(self, tokens: int) -> None:
        """Count ``tokens`` more per row on the host for a replayed captured step that commits them; refused when
        they pass the room reserved before the capture (the graph's buffers cannot grow)."""
        if self._max_bound + tokens > self.capacity:
            raise RuntimeError(ROOM_USED_UP)
        self._max_bound += tokens

    @property
    def storage_version(self) -> object:
        """Changes whenever the stored buffers are replaced (growth, select): a captured step replays while it
        stays."""
        return self._version

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        self._version += 1
        new_cap = max(needed, 2 * self.capacity)
        for layer, codec in enumerate(self.codecs):
            fresh = self._alloc(codec, self.batch_size, new_cap)
            for name, buf in self.parts[layer].items():
                fresh[name][:, :, : self.capacity] = buf
            self.parts[layer] = fresh
        self.capacity = new_cap

    def _check_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for a cache of {self.num_layers} layers")
        expect = (self.batch_size, self.heads)
        for name, t in (("keys", k), ("values", v)):
            if t.dim() != 4 or tuple(t.shape[:2]) != expect or t.shape[-1] != self.head_dim:
                raise ValueError(f"{name}: expected [B={self.batch_size}, H={self.heads}, S, d={self.head_dim}], "
                                 f"got {list(t.shape)}")
        if k.shape != v.shape:
            raise ValueError(f"keys {list(k.shape)} and values {list(v.shape)} differ in shape")

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Encode S new tokens of ``layer`` at positions ``lengths[b] + j`` (not yet committed).
        ``valid`` [B, S] marks real tokens (ragged prefill); only windowed codecs need it."""
        self._check_kv(layer, k, v)
        if self.window is not None:
            self.window.write(layer, k, v, valid, self.lengths)
        s = k.shape[2]
        self._ensure_capacity(self._max_bound + s)
        self._written = s
        codec = self.codecs[layer]
        if self.fused[layer]:
            ops.write_compressed(codec, self.parts[layer], k, v, self.lengths)
            return
        vals = codec.encode(k, v, **new_positions(codec, self.lengths, s))
        if vals.keys() == {"k.x", "v.x"}:  # uncompressed: both in one launch on the kernel path
            ops.write_dense(self.parts[layer], vals["k.x"], vals["v.x"], self.lengths)
            return
        for name, val in vals.items():
            ops.scatter_rows(self.parts[layer][name], val, self.lengths)

    def commit(self, counts: torch.Tensor | int) -> None:
        """Make the written tokens visible: ``lengths += counts`` ([B] or one int for all rows)."""
        if isinstance(counts, int):
            if counts > self._written:
                raise ValueError(f"commit of {counts} tokens past the {self._written} written: "
                                 f"write() every layer before commit()")
            self._max_bound += counts  # added as a number: no host-to-device copy, nothing waits for the device
        else:
            if not counts.is_cuda and bool((counts > self._written).any()):  # no device sync on CUDA
                raise ValueError(f"commit past the {self._written} tokens written: write() every layer first")
            self._max_bound += self._written
            counts = torch.as_tensor(counts, dtype=torch.long, device=self.device).expand(self.batch_size)
        self.lengths.add_(counts)  # in place: a captured CUDA graph of a committed step replays it
        self._written = 0

    def append(self, keys: list[torch.Tensor], values: list[torch.Tensor],
               counts: torch.Tensor | int | None = None) -> None:
        """Write every layer's new tokens (lists of [B, H, S, d]) and commit ``counts`` (default S)."""
        if len(keys) != self.num_layers or len(values) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} layers of keys and values, "
                             f"got {len(keys)} and {len(values)}")
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.write(layer, k, v)
        self.commit(keys[0].shape[2] if counts is None else counts)

    def truncate(self, n: torch.Tensor | int) -> None:
        """Roll back the last ``n`` tokens of each sequence ([B] or one int); never below zero."""
        if isinstance(n, int):
            if n < 0:
                raise ValueError("truncate needs a non-negative number of tokens")
            self._max_bound = max(0, self._max_bound - n)
        n = torch.as_tensor(n, dtype=torch.long, device=self.device).expand(self.batch_size)
        if not n.is_cuda and bool((n < 0).any()):
            raise ValueError("truncate needs a non-negative number of tokens")
        self.lengths.sub_(n).clamp_(min=0)

    def select(self, rows: torch.Tensor | list[int]) -> None:
        """Keep rows ``rows`` (may repeat: forking beams); the batch size becomes ``len(rows)``."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        if rows.dim() != 1 or rows.numel() == 0:
            raise ValueError("select needs a non-empty 1-D list of row indices")
        if bool(((rows < 0) | (rows >= self.batch_size)).any()):
            raise IndexError(f"row index out of range for a batch of {self.batch_size}")
        self._select_storage(rows)
        self._version += 1
        self.lengths = self.lengths.index_select(0, rows)
        if self.window is not None:
            self.window.select(rows)
        self.batch_size = rows.numel()

    def attends_from_storage(self, layer: int) -> bool:
        """Whether decode attention over ``layer`` reads the new tokens from the stored buffer (an uncompressed cache
        on CUDA, attended in place by SDPA): they are then written before it, also in a step that is not committed."""
        from .quant.codec import DenseQuantizer
        return self.contiguous and self.device.type == "cuda" and isinstance(self.codecs[layer].key, DenseQuantizer)

    def view(self, rows: list[int]) -> "KVCache":
        """Some rows as a cache of their own: a paged cache's (:meth:`~esm_turbo.paged.PagedKVCache.view`); a
        contiguous cache refuses."""
        raise ValueError("stepping some rows needs a paged cache: turbo.session(paged=True)")

    def pages(self) -> tuple[torch.Tensor | None, int]:
        """(block table, block size) that decode attention reads the parts through: none here, rows are contiguous
        (:meth:`~esm_turbo.paged.PagedKVCache.pages`)."""
        return None, 0

    def shared_prefix(self) -> tuple[int, torch.Tensor | None]:
        """(tokens, leads) that rows hold in the same storage as their lead: none here, every row has its own
        (:meth:`~esm_turbo.paged.PagedKVCache.shared_prefix`)."""
        return 0, None

    def prefill_groups(self, width: int) -> list[list[int]]:
        """Rows a prefill of ``width`` tokens writes together: every row (a paged cache under a device budget splits
        them)."""
        return [list(range(self.batch_size))]

    def _select_storage(self, rows: torch.Tensor) -> None:
        """The stored rows of :meth:`select` (copied: a fork holds its own copy)."""
        self.parts = [{n: b.index_select(0, rows) for n, b in layer.items()} for layer in self.parts]

    def layer_parts(self, layer: int, upto: int | None = None) -> dict[str, torch.Tensor]:
        """The stored parts of one layer, cut to the first ``upto`` positions (default: max length; while a CUDA graph
        is captured, the whole buffer: its replays' lengths are not known now, and the readers mask by ``lengths``)."""
        if upto is None:
            upto = self.capacity if ops.capturing(self.lengths) else int(self.lengths.max())
        return {n: b[:, :, :upto] for n, b in self.parts[layer].items()}

    def dequantize(self, layer: int,
                   split_values: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Reference path: (K̂ [B,H,T,d], V̂ [B,H,T,d], valid [B,T] bool), T = max length. ``split_values``: V̂ less
        the layer's value prediction from K̂ (:meth:`KVCodec.decode_split`; V̂ itself for a codec without one; None
        for values not stored, unless a recent-token window lays exact values over them)."""
        parts = self.layer_parts(layer)
        codec = self.codecs[layer]
        predicted = getattr(codec, "needs_positions", False)
        split = split_values and predicted
        k, v = codec.decode_split(parts) if split else codec.decode(parts)
        t = k.shape[2]
        pos = torch.arange(t, device=self.device)[None, :]
        valid = pos < self.lengths[:, None]
        if self.window is not None:  # the most recent `window` committed tokens come back in fp16
            if split:
                v = codec.predictor(k) if v is None else v + codec.predictor(k)
            k, v = self.window.overlay(layer, k, v, valid, self.lengths)
            if split:
                v = v - codec.predictor(k)
        return k, v, valid

    def memory_report(self) -> MemoryReport:
        per_part: dict[str, int] = {}
        for name, buf in self.parts[0].items():
            per_part[name] = buf[0, :, 0].numel() * buf.element_size()
        per_token = token_bytes(self.codecs, self.heads)
        window = self.window.nbytes() if self.window is not None else 0
        allocated = sum(b.numel() * b.element_size() for layer in self.parts for b in layer.values()) + window
        tokens = int(self.lengths.sum())
        values_per_token = 2 * self.heads * self.head_dim
        return MemoryReport(
            layers=self.num_layers, heads=self.heads, head_dim=self.head_dim,
            bytes_per_token_per_layer=per_layer(per_token, self.num_layers), part_bytes_per_token_per_layer=per_part,
            tokens=tokens, used_bytes=tokens * per_token + window, allocated_bytes=allocated,
            constant_bytes=sum(c.constant_nbytes() for c in self.codecs),
            fp32_bytes_per_token_per_layer=4 * values_per_token,
            fp16_bytes_per_token_per_layer=2 * values_per_token, window_bytes=window, bytes_per_token=per_token)
