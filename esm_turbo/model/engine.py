"""TurboEsm (a loaded ESM-2 or ESM C with TurboEsmSelfAttention installed) and the decode-session API.

Decode semantics (both families are bidirectional, not causal): ``start`` runs an exact prefill of each
sequence (``<cls>`` + residues, right-padded for ragged batches) and stores its post-RoPE K/V in the
cache. Each ``step`` feeds new tokens at the next positions of each sequence; they attend to the
cached prefix (compressed) and to each other (full precision). The prefix is never recomputed, so
its states do not see the new tokens. Running the same procedure with an uncompressed FP32 cache
(``cache="fp32"``) is the fidelity reference.

Token dropout (ESM-2's mask scaling; ESM C has none) in a step uses the mask ratio of the whole sequence so far.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import nn

from ..cache import KVCache, MemoryReport
from ..cache_contract import DecodeCache
from ..io import to_device_queued
from ..ops.blocks import BLOCK_SIZE
from ..quant.codec import KVCodec
from .alphabet import alphabet, encode
from .attention import RunContext, install
from .family import ESM2, family_of_net
from .fused_step import fused_decode, fused_step_applies

if TYPE_CHECKING:
    from ..embed.fast_esm import FastEsm

_TRAIN_MASK_RATIO = 0.15 * 0.8  # fixed by ESM-2 training, as in transformers' EsmEmbeddings


@dataclass
class StepOutput:
    """logits [B, S, V] and final hidden states [B, S, D] of the tokens just fed (float32)."""

    logits: torch.Tensor
    hidden: torch.Tensor


class TurboEsm:
    """An ESM-2 ``EsmForMaskedLM`` or ESM C ``EsmcForMaskedLM`` whose self-attention layers can prefill into and
    decode from a (compressed) KV cache. ``calibration`` (a :class:`~esm_turbo.model.checkpoint.Calibration`)
    supplies the TurboESM codecs; it is checked against the model's fingerprint. ``base`` is transformers' base
    model inside (``EsmModel``, ``EsmcModel``). ``fused_step``: whether decode steps run FastEsm's fused blocks
    (:mod:`esm_turbo.model.fused_step`; None: where they apply) or transformers' layers."""

    def __init__(self, model: nn.Module, calibration=None, check_fingerprint: bool = True):
        self.model = model.eval()
        self.family = family_of_net(model)
        self.base = self.family.base(model)
        self.layers = self.family.layers(model)
        # the modules a decode step calls besides the blocks, found once (not per step)
        self.embeddings = self.base.get_submodule(self.family.embeddings)
        self.rotary = self.base.get_submodule(self.family.rotary)
        self.final_norm = self.base.get_submodule(self.family.final_norm)
        self.attention = install(model)
        cfg = model.config
        self.num_layers = cfg.num_hidden_layers
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.calibration = None
        if calibration is not None:
            self.attach(calibration, check_fingerprint)
        # decode steps through FastEsm's fused blocks (esm_turbo.model.fused_step): None where they apply (CUDA,
        # fp16/bf16, dense or quantized weights), True / False to force it either way
        self.fused_step: bool | None = None
        from ..weights.linear import QuantizedLinear
        # every block linear a plain nn.Linear, or every one a QuantizedLinear (esm_turbo.weights), not a stand-in a
        # bench put there: the weights FastEsm's blocks take
        linears = [self.submodule(i, path) for i in range(self.num_layers) for path in self.family.linear_roles()]
        self.dense_weights = all(isinstance(m, nn.Linear) for m in linears)
        self.quantized_weights = all(isinstance(m, QuantizedLinear) for m in linears)
        self._fast = None

    def fast(self) -> "FastEsm":
        """A :class:`~esm_turbo.embed.fast_esm.FastEsm` over this engine's weights (shared, no copy: the Q, K and V
        weights become views of one matrix), made on first use; fused decode steps run its blocks."""
        if self._fast is None:
            from ..embed.fast_esm import FastEsm
            with self.original() as net:  # transformers' module paths, the attention modules' own
                self._fast = FastEsm.from_hf(net)
        return self._fast

    def submodule(self, layer: int, path: str) -> nn.Module:
        """A module of block ``layer`` by its path in transformers' layout (:mod:`esm_turbo.model.family`), also
        where it sits inside the installed attention hook (ESM C's ``self_attn.o_proj``)."""
        prefix = self.family.attention + "."
        if path.startswith(prefix):
            return self.attention[layer].inner.get_submodule(path[len(prefix):])
        return self.layers[layer].get_submodule(path)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def attach(self, calibration, check_fingerprint: bool = True) -> None:
        """Use ``calibration``'s codecs for ``cache="turbo"`` (refused if made for another model)."""
        calibration.check_model(self.model, fingerprint=check_fingerprint)
        self.calibration = calibration

    def codecs(self, cache: str | Callable[[int, int, int], KVCodec] = "turbo") -> list[KVCodec]:
        """Per-layer codecs for a cache kind: ``turbo`` (this engine's calibration), a method of the registry
        (:mod:`esm_turbo.quant.registry`) built from the shapes alone — ``fp32``/``fp16``/``bf16`` (dense), ``fp8``,
        ``turboquant-<bits>`` (data-oblivious) — or a factory ``f(layer, heads, head_dim)``."""
        h, d = self.heads, self.head_dim
        if callable(cache):
            made = [cache(i, h, d) for i in range(self.num_layers)]
        elif cache == "turbo":
            if self.calibration is None:
                raise ValueError("cache='turbo' needs a calibration: TurboEsm(model, Calibration.load(path))")
            made = self.calibration.codecs
        else:
            from ..quant.registry import KV_METHODS, MethodRequest, build_codecs, parse_kind
            name, options = parse_kind(cache)
            if name not in KV_METHODS or KV_METHODS[name].needs != "shapes":
                built = sorted(k for k, m in KV_METHODS.items() if m.needs == "shapes")
                raise ValueError(f"unknown cache kind {cache!r}: turbo, fp32, fp16, bf16, a method built from shapes "
                                 f"alone ({', '.join(built)}; a width as turboquant-4), or a factory")
            made, _ = build_codecs(name, MethodRequest(h, d, self.num_layers, options))
        return [c.to(self.device) for c in made]

    @contextlib.contextmanager
    def context(self, ctx: RunContext) -> Iterator[RunContext]:
        for m in self.attention:
            m.context = ctx
        try:
            yield ctx
        finally:
            for m in self.attention:
                m.context = None

    @contextlib.contextmanager
    def original(self) -> Iterator[nn.Module]:
        """Temporarily put the unmodified self-attention modules back (reference computations)."""
        for layer, mod in zip(self.layers, self.attention):
            self.family.set_attention_module(layer, mod.inner)
        try:
            yield self.model
        finally:
            for layer, mod in zip(self.layers, self.attention):
                self.family.set_attention_module(layer, mod)

    def session(self, cache: str | Callable = "turbo", capacity: int = 256, paged: bool = False,
                block_size: int = BLOCK_SIZE, gpu_budget_gib: float | None = None) -> "DecodeSession":
        """A decode session over a ``cache`` kind. ``paged``: the cache is kept in blocks of ``block_size`` tokens
        that forks share (:class:`~esm_turbo.paged.PagedKVCache`): ``fork(k)`` copies block tables, not rows.
        ``gpu_budget_gib`` (paged): the most cache bytes kept on the device; blocks of rows not being stepped move
        to host memory past it, and come back when a step needs them."""
        return DecodeSession(self, cache, capacity, paged, block_size, gpu_budget_gib)


class DecodeSession:
    """Batched prefill + incremental decode over a KV cache, with rollback and beam fork/select."""

    def __init__(self, engine: TurboEsm, cache: str | Callable = "turbo", capacity: int = 256, paged: bool = False,
                 block_size: int = BLOCK_SIZE, gpu_budget_gib: float | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be a positive number of tokens, got {block_size}")
        if gpu_budget_gib is not None and (not paged or gpu_budget_gib <= 0):
            raise ValueError(f"gpu_budget_gib={gpu_budget_gib}: a device budget needs paged=True and a positive size")
        self.engine = engine
        self.cache_kind = cache
        self.capacity = capacity
        self.paged, self.block_size, self.gpu_budget_gib = paged, block_size, gpu_budget_gib
        self.cache: DecodeCache | None = None  # a KVCache or PagedKVCache, used only through the contract
        self.tokens: torch.Tensor | None = None  # [B, T_cap] committed token ids
        self.mask_counts: torch.Tensor | None = None  # [B]
        self.probe: Callable | None = None

    # ---- helpers -------------------------------------------------------------------------------
    def _require_started(self) -> DecodeCache:
        if self.cache is None:
            raise RuntimeError("call start(sequences) before step / rollback / select")
        return self.cache

    @property
    def lengths(self) -> torch.Tensor:
        return self._require_started().lengths

    def sequences(self) -> list[str]:
        """The committed tokens of each row, as text (``<cls>`` and specials included)."""
        from .alphabet import decode_ids
        cache = self._require_started()
        return [decode_ids(self.tokens[b, : int(n)].tolist()) for b, n in enumerate(cache.lengths)]

    def _heads(self, hidden: torch.Tensor, normed: bool = False) -> StepOutput:
        hidden = hidden if normed else self.engine.final_norm(hidden)
        logits = self.engine.model.lm_head(hidden)
        return StepOutput(logits=logits.float(), hidden=hidden.float())

    # ---- API ----------------------------------------------------------------------------------
    @torch.no_grad()
    def start(self, sequences: list[str], names: list[str] | None = None, add_eos: bool = False,
              recorder: Callable | None = None) -> StepOutput:
        """Exact batched prefill of ``<cls> + residues`` (ragged lengths). Returns outputs [B, T, *].
        ``recorder(layer, q, k, v, valid)`` also sees each layer's post-RoPE Q/K/V."""
        eng = self.engine
        tokens, mask = encode(sequences, names, add_eos=add_eos)
        tokens, mask = tokens.to(eng.device), mask.to(eng.device)
        batch, width = tokens.shape
        if self.paged:
            from ..paged import PagedKVCache
            budget = None if self.gpu_budget_gib is None else int(self.gpu_budget_gib * 2**30)
            self.cache = PagedKVCache(eng.codecs(self.cache_kind), batch, max(self.capacity, width), eng.device,
                                      self.block_size, budget)
        else:
            self.cache = KVCache(eng.codecs(self.cache_kind), batch, max(self.capacity, width), eng.device)
        hidden = []
        for rows in self.cache.prefill_groups(width):  # under a device budget: groups of rows that fit it
            cache = self.cache if len(rows) == batch else self.cache.view(rows)
            ctx = RunContext(mode="prefill", cache=cache, valid=mask[rows].bool(), recorder=recorder)
            with eng.context(ctx):
                hidden.append(eng.base(input_ids=tokens[rows], attention_mask=mask[rows]).last_hidden_state)
            cache.commit(mask[rows].sum(1))
            if cache is not self.cache:
                cache.give_back()
        last = torch.cat(hidden)
        self.tokens = torch.full((batch, self.cache.capacity), alphabet().padding_idx,
                                 dtype=torch.long, device=eng.device)
        self.tokens[:, :width] = tokens
        self.mask_counts = ((tokens == alphabet().mask_idx) & mask.bool()).sum(1)
        return StepOutput(logits=eng.model.lm_head(last).float(), hidden=last.float())

    def _embed(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        eng = self.engine
        emb = eng.embeddings(tokens)
        if eng.family is ESM2 and eng.base.embeddings.token_dropout:  # ESM C has no token-dropout rescaling
            is_mask = tokens == eng.base.embeddings.mask_token_id
            emb = emb.masked_fill(is_mask.unsqueeze(-1), 0.0)
            masks = self.mask_counts + (is_mask & valid).sum(1)
            total = self.cache.lengths + valid.sum(1)
            ratio = masks.float() / total.float()
            emb = (emb * (1 - _TRAIN_MASK_RATIO) / (1 - ratio)[:, None, None]).to(emb.dtype)
        return emb

    @torch.no_grad()
    def step(self, tokens: torch.Tensor | list[str], counts: torch.Tensor | None = None,
             commit: bool = True, rows: list[int] | None = None) -> StepOutput:
        """Feed S new tokens per row at the next positions. ``tokens``: [B, S] ids or B strings of
        equal length (one residue or ``<mask>`` is one token); ``counts`` [B]: how many of the S are
        real per row (default all). With ``commit=False`` (peek) the cache is left unchanged. ``rows``
        (a paged session): step only these distinct rows (``tokens`` has one row each); the others wait,
        their blocks free to move to host memory under a device budget."""
        if rows is not None:
            return self._step_rows(tokens, counts, commit, [int(r) for r in rows])
        cache = self._require_started()
        eng = self.engine
        if isinstance(tokens, (list, tuple)):
            tokens = torch.stack([torch.as_tensor(alphabet().encode(t)) for t in tokens])
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=eng.device)
        if tokens.dim() == 1:
            tokens = tokens[:, None]
        if tokens.shape[0] != cache.batch_size:
            raise ValueError(f"step got {tokens.shape[0]} rows, the session has {cache.batch_size}")
        seq = tokens.shape[1]
        added = seq if counts is None else None  # every token real: the cache commits an int, no copy to the device
        counts = (torch.full((cache.batch_size,), seq, device=eng.device) if counts is None
                  else torch.as_tensor(counts, dtype=torch.long, device=eng.device))
        valid = torch.arange(seq, device=eng.device)[None, :] < counts[:, None]
        positions = cache.lengths[:, None] + torch.arange(seq, device=eng.device)[None, :]
        hidden = self._embed(tokens, valid)
        ctx = RunContext(mode="decode", cache=cache, new_valid=valid, commit=commit, probe=self.probe)
        if fused_step_applies(eng, self.probe is not None):
            result = self._heads(fused_decode(eng.fast(), hidden, positions, ctx), normed=True)
        else:
            cos_sin = eng.rotary(hidden, positions)
            with eng.context(ctx):
                for layer in eng.layers:
                    hidden = layer(hidden, attention_mask=None, position_embeddings=cos_sin)
            result = self._heads(hidden)
        if commit:
            cache.commit(counts if added is None else added)
            self.fit_to_cache()
            rows = torch.arange(cache.batch_size, device=eng.device)[:, None]
            self.tokens[rows, positions.clamp_max(self.tokens.shape[1] - 1)] = torch.where(
                valid, tokens, self.tokens[rows, positions.clamp_max(self.tokens.shape[1] - 1)])
            self.mask_counts.add_(((tokens == alphabet().mask_idx) & valid).sum(1))
        return result

    def _step_rows(self, tokens, counts, commit: bool, rows: list[int]) -> StepOutput:
        cache = self._require_started()
        if cache.contiguous:
            raise ValueError("stepping some rows needs a paged session: turbo.session(paged=True)")
        sub = _RowsSession(self, rows)
        out = sub.step(tokens, counts, commit)
        if commit:
            sub.give_back()
        return out

    def capture_step(self, tokens: torch.Tensor, counts: torch.Tensor | None = None, commit: bool = False,
                     reserve: int = 64) -> "CapturedStep":
        """Capture one decode step (all layers, fixed batch shape) as a CUDA graph.

        ``tokens`` [B, S] (and ``counts``) are copied into static inputs that ``CapturedStep.replay``
        refills; with ``commit`` each replay appends to the cache, and room for ``reserve`` such steps is
        made now (the graph holds the cache buffers, so they may not grow later; a paged cache takes its rows'
        blocks for them now, and its captured step commits every token of every row). A replay refuses once the
        cache has changed under it (``select``, ``fork``, growth): capture again."""
        cache = self._require_started()
        if not cache.device.type == "cuda":
            raise RuntimeError("capture_step needs the model and cache on a CUDA device")
        if getattr(self.engine.model, "residual_offload", None) is not None:
            raise RuntimeError("capture_step: the model's residual pass is offloaded (its copies are queued from the "
                               "host as layers run); step eagerly")
        if not cache.contiguous and counts is not None:
            raise ValueError("capture_step: a captured paged step commits every token of every row (counts=None)")
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=cache.device).clone()
        static_counts = (torch.full((cache.batch_size,), tokens.shape[1], device=cache.device) if counts is None
                         else torch.as_tensor(counts, dtype=torch.long, device=cache.device).clone())
        step_counts = static_counts if cache.contiguous else None  # paged: whole steps, counted on the host
        if commit:
            cache.reserve(reserve * tokens.shape[1])
            self.fit_to_cache()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compiles kernels and builds the fused tables
            for _ in range(2):
                self.step(tokens, step_counts, commit=False)
        torch.cuda.current_stream().wait_stream(side)
        bound = cache.length_bound
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.step(tokens, step_counts, commit=commit)
        cache.rewind_bound(bound)  # capture ran no kernels; replays advance it
        return CapturedStep(self, graph, tokens, static_counts, out, commit, tokens.shape[1], cache,
                            cache.storage_version)

    def fit_to_cache(self) -> None:
        """Grow the session's token record to the cache's capacity (after the cache grew)."""
        cache = self.cache
        if self.tokens.shape[1] < cache.capacity:
            grown = torch.full((cache.batch_size, cache.capacity), alphabet().padding_idx,
                               dtype=torch.long, device=cache.device)
            grown[:, : self.tokens.shape[1]] = self.tokens
            self.tokens = grown

    def rollback(self, n: int | torch.Tensor) -> None:
        """Forget the last ``n`` committed tokens of each row (never the prefix start below zero)."""
        cache = self._require_started()
        n = torch.as_tensor(n, dtype=torch.long, device=cache.device).expand(cache.batch_size)
        old = cache.lengths.clone()
        cache.truncate(n)
        pos = torch.arange(self.tokens.shape[1], device=cache.device)[None, :]
        dropped = (pos >= cache.lengths[:, None]) & (pos < old[:, None])
        # in place: a captured step reads this tensor (a new one would leave the graph reading freed memory)
        self.mask_counts.sub_(((self.tokens == alphabet().mask_idx) & dropped).sum(1))

    def select(self, rows: torch.Tensor | list[int]) -> None:
        """Keep (or repeat, to fork beams) rows of the batch."""
        cache = self._require_started()
        cache.select(rows)
        idx = torch.as_tensor(rows, dtype=torch.long, device=cache.device)
        self.tokens = self.tokens.index_select(0, idx)
        self.mask_counts = self.mask_counts.index_select(0, idx)

    def fork(self, copies: int) -> None:
        """Repeat every row ``copies`` times (row b becomes rows b*copies … b*copies+copies-1)."""
        cache = self._require_started()
        self.select(torch.arange(cache.batch_size).repeat_interleave(copies).tolist())

    def memory_report(self) -> MemoryReport:
        return self._require_started().memory_report()


class _RowsSession(DecodeSession):
    """Some rows of a paged session, stepped alone. Shared with the parent session: the engine and every setting;
    its own: the cache (a :class:`~esm_turbo.paged.PagedRows` view of the rows), and copies of the rows' token
    record and mask counts, which :meth:`give_back` writes into the parent's rows with the cache's lengths."""

    def __init__(self, parent: DecodeSession, rows: list[int]):  # noqa: D107 - the parent's state, not a new one
        self.__dict__.update(parent.__dict__)  # the engine and the session's settings …
        self.parent, self.rows = parent, list(rows)
        self.idx = to_device_queued(self.rows, parent.cache.device)
        self.cache = parent.cache.view(self.rows)  # … over these rows' blocks
        self.tokens, self.mask_counts = parent.tokens[self.idx], parent.mask_counts[self.idx]  # copies

    def give_back(self) -> None:
        """After a committed step: the rows' lengths, tokens and mask counts back into the parent."""
        parent = self.parent
        self.cache.give_back()
        parent.fit_to_cache()
        parent.tokens[self.idx, : self.tokens.shape[1]] = self.tokens[:, : parent.tokens.shape[1]]
        parent.mask_counts[self.idx] = self.mask_counts


@dataclass
class CapturedStep:
    """A decode step recorded as a CUDA graph (see :meth:`DecodeSession.capture_step`). ``output``
    holds the static logits / hidden states that every :meth:`replay` overwrites."""

    session: DecodeSession
    graph: "torch.cuda.CUDAGraph"
    tokens: torch.Tensor
    counts: torch.Tensor
    output: StepOutput
    commit: bool
    width: int
    cache: DecodeCache  # the cache it was captured on (held: the graph writes its buffers) …
    version: object  # … and its storage_version then: a replay needs both unchanged

    def replay(self, tokens: torch.Tensor | None = None) -> StepOutput:
        cache = self.session.cache
        if cache is not self.cache or cache.storage_version != self.version:
            raise RuntimeError("the cache changed since this step was captured (a new start, select, fork, growth or "
                               "blocks taken): capture the step again")
        if tokens is not None:
            self.tokens.copy_(tokens)
        if self.commit:
            cache.claim(self.width)
        self.graph.replay()
        return self.output
