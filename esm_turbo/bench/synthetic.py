"""Random caches, codecs, models and sessions for speed measurements: speed does not depend on the values, so
nothing is calibrated or prefilled."""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator

import torch

from ..cache import KVCache
from ..model.checkpoint import CalibrationConfig
from ..testing import random_turbo_codec

#: the recipe a default calibration runs (its widths and residual, :meth:`CalibrationConfig.resolved`)
DEFAULT_RECIPE = CalibrationConfig().resolved()


#: σ of the log of a random channel importance like a trained model's: at heads of 64 and 3.0 bits its allocation
#: leaves half the value channels at 0 index bits and gives a quarter 5 or 6, as calibration does on the trained
#: testbed (testing's default, 1.5, spreads the widths far less)
TRAINED_SPREAD = 4.5


def default_codec(heads: int, dim: int, seed: int = 0, grid: bool | None = None,
                  recipe: CalibrationConfig = DEFAULT_RECIPE, spread: float = 1.5, permuted_keys: bool | None = None):
    """A random codec of a calibration's widths, widest channels and residual (``recipe``, resolved; default
    :data:`DEFAULT_RECIPE`) and tables (its grid, unless ``grid`` says: uniform levels or per-channel LUTs), the
    widths allocated by a random importance of log-σ ``spread``; ``permuted_keys``: the keys' rotation a
    permutation, as the recipe's "identity" key rotation calibrates it (None: as the recipe says), else a Haar
    rotation."""
    r = recipe
    grid = r.lut == "grid" if grid is None else grid
    permuted_keys = r.key_rotation == "identity" if permuted_keys is None else permuted_keys
    return random_turbo_codec(heads, dim, r.key_index_bits, r.value_index_bits, r.residual, seed, r.bit_allocation,
                              r.channel_cap("k"), grid=grid, value_max_bits=r.channel_cap("v"),
                              importance_spread=spread, permuted_keys=permuted_keys)


def layer_codec(layer: int, heads: int, dim: int):
    """A cache factory (``engine.session(layer_codec)``): layer ``layer``'s :func:`default_codec`, seeded by it (fit
    once a process, a copy each call: sessions may move their codecs)."""
    return copy.deepcopy(_fitted_codec(layer, heads, dim))


@functools.lru_cache(maxsize=None)
def _fitted_codec(layer: int, heads: int, dim: int):
    return default_codec(heads, dim, seed=layer)


def synthetic_cache(heads: int, dim: int, batch: int, length: int, device, seed: int = 0,
                     grid: bool | None = None, recipe: CalibrationConfig = DEFAULT_RECIPE,
                     spread: float = 1.5) -> KVCache:
    """A one-layer TurboESM cache of a recipe's widths (:func:`default_codec`; default the default's) full of random
    codes at ``length`` per row."""
    codec = default_codec(heads, dim, seed, grid, recipe, spread).to(device)
    cache = KVCache([codec], batch, capacity=length, device=device)
    fill_synthetic(cache, length, torch.Generator(device=device).manual_seed(seed))
    return cache


def fill_synthetic(cache: KVCache, length: int, generator: torch.Generator | None = None) -> None:
    """Make every row of ``cache`` hold ``length`` tokens of random codes (packed parts) or values
    (dense parts): speed only, nothing is prefilled."""
    for layer in cache.parts:
        for buf in layer.values():
            if buf.dtype == torch.uint8:
                buf.random_(0, 256, generator=generator)
            else:
                buf.normal_(generator=generator)
    cache.set_lengths(length)


def shuffled_pages(batch: int, blocks: int, spare: int = 0, seed: int = 0, device=None) -> torch.Tensor:
    """A block table [batch, blocks] int32 naming distinct slots of a pool of ``batch·blocks + spare``, in random
    order (a paged cache after forks and frees holds its rows' blocks anywhere)."""
    order = torch.randperm(batch * blocks + spare, generator=torch.Generator().manual_seed(seed))
    return order[:batch * blocks].view(batch, blocks).to(device=device, dtype=torch.int32)


def as_blocks(part: torch.Tensor, pages: torch.Tensor, block_size: int, slots: int, fill: int = 0) -> torch.Tensor:
    """A contiguous cache part [B, H, T, *] as a paged cache's pool [slots, H, block_size, *]: row b's blocks at the
    slots ``pages`` [B, ceil(T / block_size)] names, the other slots holding ``fill``."""
    batch, heads, t = part.shape[:3]
    blocks = pages.shape[1]
    padded = part.new_zeros(batch, heads, blocks * block_size, *part.shape[3:])
    padded[:, :, :t] = part
    pool = part.new_full((slots, heads, block_size, *part.shape[3:]), fill)
    pool[pages.long()] = padded.view(batch, heads, blocks, block_size, *part.shape[3:]).transpose(1, 2)
    return pool


def bytes_read(cache: KVCache) -> int:
    """Bytes of the cache's layer 0 that a decode call over every row (all ``cache.lengths.max()`` long) reads."""
    return cache.memory_report().bytes_per_token_per_layer * cache.batch_size * int(cache.lengths.max())


def write_inputs(shapes, device) -> Iterator[tuple[str, int, int, int, int, torch.Tensor, torch.Tensor]]:
    """For each (name, heads, d, batch, s) of ``shapes``: it with the inputs of a cache write of ``s`` tokens a row,
    x [batch, heads, s, d] fp16 (strided, as a model's projections give them) and the write positions [batch] (0)."""
    for name, heads, d, batch, s in shapes:
        x = torch.randn(batch, s, heads, d, device=device, dtype=torch.float16).transpose(1, 2)
        yield name, heads, d, batch, s, x, torch.zeros(batch, dtype=torch.long, device=device)


def decode_inputs(batch: int, heads: int, dim: int, device) -> tuple[torch.Tensor, ...]:
    """A decode step's inputs, one token a row: q [batch, heads, 1, dim] scaled by dim^−½, the step's own k and v
    (the same shape, unscaled) and their validity [batch, 1] (all true)."""
    q = torch.randn(batch, heads, 1, dim, device=device) * dim**-0.5
    k_new = torch.randn(batch, heads, 1, dim, device=device)
    v_new = torch.randn_like(k_new)
    return q, k_new, v_new, torch.ones(batch, 1, dtype=torch.bool, device=device)


def default_recipe_caches(shapes, device) -> Iterator[tuple[str, KVCache, tuple[torch.Tensor, ...], float]]:
    """For each (heads, dim, batch, length) of ``shapes`` and the default recipe at 4.0 and 3.0 bits all-in: ("4.0"
    or "3.0", a cache of random codes of the recipe's widths allocated as on a trained model (``TRAINED_SPREAD``),
    its decode inputs (:func:`decode_inputs`), µs of a pure read of the bytes a decode call over it reads)."""
    from ..model.recipe import recipe
    from .timing import read_floor_us
    for heads, dim, batch, length in shapes:
        for label, bits in (("4.0", 3), ("3.0", 2)):
            cache = synthetic_cache(heads, dim, batch, length, device, recipe=recipe("default", bits).resolved(),
                                    spread=TRAINED_SPREAD)
            yield label, cache, decode_inputs(batch, heads, dim, device), read_floor_us(bytes_read(cache), device)


def step_args(cache: KVCache, dtype: torch.dtype = torch.float16) -> tuple:
    """Arguments of ``compressed_attention_triton`` for a decode step of one random query a row over layer 0 of
    ``cache``: (q, k_new, v_new, new_valid, lengths, keys, values)."""
    from ..ops.compressed import cached_codes
    codec = cache.codecs[0]
    keys, values = (cached_codes(codec, cache.parts[0], kind) for kind in "kv")
    q = torch.randn(cache.batch_size, cache.heads, 1, cache.head_dim, device=cache.device, dtype=dtype)
    y = torch.randn_like(q)
    valid = torch.ones(cache.batch_size, 1, dtype=torch.uint8, device=cache.device)
    return q, y, y, valid, cache.lengths, keys, values


def stand_in_model(size: str, device, dtype, layers: int | None = None):
    from ..model.sizes import esm2_config
    from transformers import EsmForMaskedLM
    cfg = esm2_config(size, layers=layers)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return EsmForMaskedLM(cfg).to(device=device, dtype=dtype).eval()


def random_protein(n: int, seed: int) -> str:
    gen = torch.Generator().manual_seed(seed)
    aa = "ACDEFGHIKLMNPQRSTVWY"
    return "".join(aa[i] for i in torch.randint(0, 20, (n,), generator=gen).tolist())


def synthetic_session(engine, factory, batch: int, context: int, extra: int):
    """A decode session of ``batch`` rows whose caches hold ``context`` tokens of random codes/values
    (speed only: nothing is prefilled), with room for ``extra`` more."""
    session = engine.session(factory, capacity=context + extra)
    session.start(["M"] * batch)
    fill_synthetic(session.cache, context)
    session.fit_to_cache()
    return session
