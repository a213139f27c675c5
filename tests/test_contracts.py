"""The cache contract (``esm_turbo.cache_contract``): both caches keep it, and the decode engine, the attention layers
and the ops touch a cache only through it (read from their source, so a new reach into a cache's state fails here)."""

import ast
import inspect
from pathlib import Path

import torch

import esm_turbo
from esm_turbo.cache import KVCache
from esm_turbo.cache_contract import DecodeCache, RowsView
from esm_turbo.paged import PagedKVCache
from esm_turbo.quant.codec import dense_codec

ROOT = Path(esm_turbo.__file__).parent
#: the modules that run a decode step over a cache
USERS = ["model/engine.py", "model/attention.py", "model/evaluate.py", "ops/__init__.py", "ops/reference.py",
         "ops/compressed.py"]


def _members(protocol) -> set[str]:
    names = set()
    for cls in protocol.__mro__:
        if cls in (object,) or not getattr(cls, "_is_protocol", False):
            continue
        names |= set(getattr(cls, "__annotations__", {}))
        names |= {n for n, _ in inspect.getmembers(cls) if not n.startswith("_")}
    return names


def _cache_attributes(source: str) -> set[str]:
    """Attributes read or called on anything named ``cache`` (``cache.x``, ``self.cache.x``, ``ctx.cache.x``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            base = node.value
            name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
            if name == "cache":
                found.add(node.attr)
    return found


def test_the_engine_and_the_ops_use_only_the_contract():
    allowed = _members(RowsView)
    for rel in USERS:
        used = _cache_attributes((ROOT / rel).read_text())
        assert used <= allowed, f"{rel} reaches past the cache contract: {sorted(used - allowed)}"
    assert "write" in _cache_attributes((ROOT / "model/attention.py").read_text())  # the scan sees real uses


def test_both_caches_and_a_row_view_keep_it():
    codecs = [dense_codec(2, 16) for _ in range(2)]
    flat, paged = KVCache(codecs, 3, 8), PagedKVCache(codecs, 3, 8, block_size=4)
    assert isinstance(flat, DecodeCache) and isinstance(paged, DecodeCache)
    view = paged.view([0, 2])
    assert isinstance(view, RowsView) and view.batch_size == 2
    k = torch.randn(2, 2, 3, 16)
    for layer in range(2):
        view.write(layer, k, k)
    view.commit(3)
    view.give_back()
    assert paged.lengths.tolist() == [3, 0, 3]
    try:
        flat.view([0])
    except ValueError as err:
        assert "paged" in str(err)
    else:
        raise AssertionError("a contiguous cache gave a row view")
