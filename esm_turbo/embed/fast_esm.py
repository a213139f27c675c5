"""A fast ESM-2 and ESM C forward for embeddings: the batch packed into one token stream, no padding.

:class:`FastEsm` loads the weights transformers' ``EsmForMaskedLM`` or ``EsmcForMaskedLM`` holds (from a hub id, a
``save_pretrained`` directory or a fair-esm ``.pt``, through :func:`esm_turbo.load_esm`) into one
internal layout (Q, K and V projections fused into one matrix; ESM C's gate and up too) and returns the same hidden
states as ``EsmModel`` / ``EsmcModel(output_hidden_states=True)``: layer 0 the embedding output, layer ``i`` the output
of block ``i``, the last layer after the final LayerNorm. What each family computes differently is read from
:mod:`esm_turbo.model.family`.

Sequences of a batch sit one after another (``<cls> residues <eos>``, N tokens in all), so no GEMM
touches a padding row; attention runs per sequence (:mod:`esm_turbo.embed.varlen`: in fp16 in 64-token tiles,
:mod:`esm_turbo.kernels.varlen_attention`; else flash-attention's variable-length kernel). On CUDA in fp16/bf16 each
block is eight or nine launches with nothing to compile (:meth:`FastEsm._forward_fused`): the products (cuBLAS with
their biases, or where it measured faster the Triton kernel with GELU or the residual add folded in,
:mod:`esm_turbo.embed.products`), one Triton kernel for each residual add and the LayerNorm after it, one for the
query scaling and rotary embedding of q and k, the attention and the GELU.
Elsewhere the same block runs as two plain PyTorch functions (:func:`attention_inputs`, :func:`block_output`, the
reference). Pooling (mean over residues, ``<cls>``) is done on the device, and only the layers asked for are kept.

    model = FastEsm.from_pretrained("facebook/esm2_t33_650M_UR50D", dtype=torch.float16, device="cuda")
    out = model.embed(["MKTAYIAKQR", "GSHMLEDPV"], layers=[-1])   # {"mean": {33: [2, 1280]}, ...}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..model.alphabet import check_sequence, encode_packed
from ..model.family import ESM2, FAMILIES, Family, family_of_net
from ..quant.predict import rotary_angles
from .block_replay import BlockGraph, PackedBlocks, replay_pays, replayed_run
from .fp8 import FP8_COMPUTE_DTYPE, Fp8Weight, linear
from .varlen import flash_available, padded_layout, varlen_attention

#: ESM-2's token dropout: the share of tokens masked in training (15% selected × 80% masked)
MASK_RATIO_TRAIN = 0.15 * 0.8


@dataclass
class PackedBatch:
    """Sequences one after another. tokens, positions: [N] long; cu_seqlens: [S + 1] int32 (sequence
    starts, then N), all on one device; lengths: tokens per sequence on the host (``<cls>`` and ``<eos>``
    included; what the PyTorch attention path loops over); max_seqlen: the longest."""

    tokens: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: list[int]
    max_seqlen: int

    def segment(self) -> torch.Tensor:
        """[N] long: which sequence each token belongs to (computed on the device, no host sync)."""
        idx = torch.arange(self.tokens.shape[0], device=self.tokens.device, dtype=torch.int32)
        return torch.searchsorted(self.cu_seqlens[1:].contiguous(), idx, right=True)

    @classmethod
    def from_arrays(cls, ids, positions, cu, device: torch.device | str = "cpu") -> "PackedBatch":
        """From host arrays (numpy or tensors): ids, positions [N]; cu [S + 1] sequence starts."""
        from ..io import to_device_queued
        device = torch.device(device)
        cu = torch.as_tensor(cu)
        lengths = (cu[1:] - cu[:-1]).tolist()
        return cls(to_device_queued(ids, device), to_device_queued(positions, device),
                   to_device_queued(cu, device, torch.int32), lengths, max(lengths))

    @classmethod
    def from_sequences(cls, seqs: list[str], device: torch.device | str = "cpu") -> "PackedBatch":
        """``<cls> residues <eos>`` per sequence (residues checked; errors name the sequence)."""
        return cls.from_arrays(*pack_sequences(seqs), device=device)


def pack_sequences(seqs: list[str]) -> tuple:
    """Checked sequences (errors name "sequence i") → host arrays of :func:`encode_packed`."""
    return encode_packed([check_sequence(s, f"sequence {i + 1}") for i, s in enumerate(seqs)])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def attention_inputs(h: torch.Tensor, norm_w: torch.Tensor, norm_b: torch.Tensor, w_qkv: torch.Tensor,
                     b_qkv: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, heads: int, eps: float,
                     q_norm: torch.Tensor | None = None,
                     k_norm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pre-LN, fused QKV projection, (ESM C) the query and key LayerNorms over the whole width, the query scaled by
    d ** -0.5 in h's dtype and the rotary embedding in fp32, as transformers applies them (attention then takes
    scale 1). h: [N, D]; w_qkv: [3D, D]; q_norm, k_norm: [D] or None; cos, sin: [N, d] float32. Returns q, k, v
    [N, H, d] in h's dtype."""
    n, dim = h.shape
    qkv = linear(F.layer_norm(h, (dim,), norm_w, norm_b, eps), w_qkv, b_qkv)
    if q_norm is not None:
        qkv = torch.cat([F.layer_norm(qkv[:, :dim], (dim,), q_norm, None, eps),
                         F.layer_norm(qkv[:, dim: 2 * dim], (dim,), k_norm, None, eps), qkv[:, 2 * dim:]], 1)
    qkv = qkv.view(n, 3, heads, dim // heads)
    q, k, v = qkv.unbind(1)
    q = q * (dim // heads) ** -0.5
    c, s = cos[:, None, :], sin[:, None, :]
    q = (q.float() * c + _rotate_half(q.float()) * s).to(h.dtype)
    k = (k.float() * c + _rotate_half(k.float()) * s).to(h.dtype)
    return q, k, v  # v stays a view of the projection: the kernel takes any row stride


def activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The feed-forward's nonlinearity: ``"gelu"`` exact erf GELU ([N, F] → [N, F]; ``"gelu_tanh"``: its tanh
    approximation), ``"swiglu"`` silu(gate) · up of the stacked [N, 2F] (gate first) → [N, F]."""
    if kind == "swiglu":
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def block_output(h: torch.Tensor, attn: torch.Tensor, w_o: torch.Tensor, b_o: torch.Tensor | None,
                 norm_w: torch.Tensor, norm_b: torch.Tensor, w_1: torch.Tensor, b_1: torch.Tensor | None,
                 w_2: torch.Tensor, b_2: torch.Tensor | None, eps: float, act: str = "gelu",
                 branch_scale: float = 1.0) -> torch.Tensor:
    """Output projection + residual, then pre-LN feed-forward (:func:`activation`) + residual, each branch divided by
    ``branch_scale`` (ESM C) before it is added. The weights are tensors or :class:`~esm_turbo.embed.fp8.Fp8Weight`
    s. h: [N, D]; attn: [N, H, d]. Returns [N, D]."""
    n, dim = h.shape
    y = linear(attn.reshape(n, dim), w_o, b_o)
    h = h + (y if branch_scale == 1.0 else y / branch_scale)
    x = activation(linear(F.layer_norm(h, (dim,), norm_w, norm_b, eps), w_1, b_1), act)
    y = linear(x, w_2, b_2)
    return h + (y if branch_scale == 1.0 else y / branch_scale)


class BlockTensors(NamedTuple):
    """What block i of the fused path reads (:meth:`FastEsm.block_tensors`): the four products' weights (tensors,
    :class:`~esm_turbo.embed.fp8.Fp8Weight` or :class:`~esm_turbo.weights.step.StepProduct`) and biases, the
    feed-forward's LayerNorm, ESM C's query and key LayerNorms (None for ESM-2) and the LayerNorm after the block (the
    next block's attention norm, or the final norm)."""

    w_qkv: object
    b_qkv: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    w_o: object
    b_o: torch.Tensor | None
    ffn_w: torch.Tensor
    ffn_b: torch.Tensor | None
    w_1: object
    b_1: torch.Tensor | None
    w_2: object
    b_2: torch.Tensor | None
    after_w: torch.Tensor
    after_b: torch.Tensor | None

    def leaves(self) -> list[torch.Tensor]:
        """Every tensor, in order (an FP8 weight's codes, then its scales)."""
        out: list[torch.Tensor] = []
        for v in self:
            if isinstance(v, Fp8Weight):
                out += [v.q, v.scale]
            elif isinstance(v, torch.Tensor):
                out.append(v)
        return out

    def with_leaves(self, leaves: list[torch.Tensor]) -> "BlockTensors":
        """The same fields over other tensors (:meth:`leaves`' order)."""
        it = iter(leaves)
        return BlockTensors(*(Fp8Weight(next(it), next(it)) if isinstance(v, Fp8Weight)
                              else next(it) if isinstance(v, torch.Tensor) else v for v in self))


#: FastEsm.gelu's forms → the feed-forward's activation kind
GELU_CHOICES = {"erf": "gelu", "tanh": "gelu_tanh"}
#: the attention kernels the fused path can run (:attr:`FastEsm.attention_kernel`)
ATTENTION_KERNELS = ("triton", "flash", "gluon")


class FastEsmBlock(nn.Module):
    """One transformer block's weights in the fused layout (ESM-2's or ESM C's, as ``family`` says)."""

    def __init__(self, dim: int, heads: int, ffn: int, device: torch.device | str | None = None,
                 family: Family = ESM2):
        super().__init__()
        self.heads = heads
        self.activation = family.activation
        bias = family.linear_bias
        self.attn_norm = nn.LayerNorm(dim, device=device)
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias, device=device)
        self.q_norm = nn.LayerNorm(dim, bias=False, device=device) if family.q_norm else None
        self.k_norm = nn.LayerNorm(dim, bias=False, device=device) if family.k_norm else None
        self.out = nn.Linear(dim, dim, bias=bias, device=device)
        self.ffn_norm = nn.LayerNorm(dim, device=device)
        self.fc1 = nn.Linear(dim, family.ffn_in_width(ffn), bias=bias, device=device)
        self.fc2 = nn.Linear(ffn, dim, bias=bias, device=device)
        # quantized weights (esm_turbo.weights): the source net's QuantizedLinear modules (q, k, v, out, the
        # feed-forward's in (one, or gate and up), its out), dequantized per forward in the norms' dtype; None: the
        # weights above
        self.quantized: tuple | None = None
        self._step_products: tuple | None = None  # the quantized weights as a decode step's products, made once
        # FP8 weights (FastEsm.to_fp8): (W_qkv, W_o, W_1, W_2) as Fp8Weight; the dense weights are then dropped
        self.fp8: tuple[Fp8Weight, ...] | None = None

    def weights(self, rows: int | None = None) -> tuple:
        """(W_qkv [3D, D], W_o [D, D], W_1 [F, D], W_2 [D, F]) as the block functions take them: tensors, or
        :class:`~esm_turbo.embed.fp8.Fp8Weight` s after :meth:`FastEsm.to_fp8`. Quantized weights at up to
        ``KERNEL_ROWS`` ``rows`` (a decode step's): :class:`~esm_turbo.weights.step.StepProduct` s, which
        :func:`~.products.product` runs on the 4-bit kernels; at more, dequantized."""
        if self.fp8 is not None:
            return self.fp8
        if self.quantized is None:
            return self.qkv.weight, self.out.weight, self.fc1.weight, self.fc2.weight
        products = self.step_products(rows)
        if products is not None:
            return products
        dtype = self.attn_norm.weight.dtype
        q, k, v, o, *f1, f2 = self.quantized
        return (torch.cat([m.dequantize(dtype) for m in (q, k, v)]), o.dequantize(dtype),
                torch.cat([m.dequantize(dtype) for m in f1]), f2.dequantize(dtype))

    def step_products(self, rows: int | None) -> tuple | None:
        """The quantized weights as :class:`~esm_turbo.weights.step.StepProduct` s (made once) at up to
        ``KERNEL_ROWS`` ``rows``; None for other weights or more rows."""
        if self.quantized is None or self.fp8 is not None or rows is None:
            return None
        from ..weights.linear import KERNEL_ROWS
        if rows > KERNEL_ROWS:
            return None
        if self._step_products is None:
            from ..weights.step import step_products
            self._step_products = step_products(self.quantized)
        return self._step_products

    def qk_norms(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """ESM C's query and key LayerNorm weights [D] (None for ESM-2)."""
        if self.q_norm is None:
            return None, None
        return self.q_norm.weight, self.k_norm.weight


class LMHead(nn.Module):
    """transformers' ``EsmLMHead`` on given tensors: dense, erf GELU, LayerNorm, then the decoder (the token
    embeddings, tied, unless the checkpoint has its own) plus a bias. [N, D] → [N, vocab]."""

    def __init__(self, tensors: dict[str, torch.Tensor], embeddings: torch.Tensor, eps: float):
        super().__init__()
        self.dense_w, self.dense_b = tensors["lm_head.dense.weight"], tensors["lm_head.dense.bias"]
        self.norm_w, self.norm_b = tensors["lm_head.layer_norm.weight"], tensors["lm_head.layer_norm.bias"]
        self.decoder = tensors.get("lm_head.decoder.weight", embeddings)
        # ESM-2 keeps the decoder's bias as lm_head.bias, ESM C as lm_head.decoder.bias
        self.bias = tensors["lm_head.bias"] if "lm_head.bias" in tensors else tensors["lm_head.decoder.bias"]
        self.eps = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = F.linear(h, self.dense_w, self.dense_b)
        x = x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))  # transformers' gelu, op for op
        x = F.layer_norm(x, (x.shape[-1],), self.norm_w, self.norm_b, self.eps)
        return F.linear(x, self.decoder) + self.bias


class FastEsm(nn.Module):
    """ESM-2 or ESM C over packed batches. Build with :meth:`from_pretrained`, :meth:`from_tensors` or
    :meth:`from_hf`, which put the weights in: the modules are made on the meta device, where nothing is initialised
    (no op there that would import torch's compiler stack, which costs seconds). ``config``: a
    :class:`~esm_turbo.model.folder.ModelShape` or transformers' ``EsmConfig`` / ``EsmcConfig`` (kept as a
    ModelShape)."""

    def __init__(self, config, fused: bool | None = None):
        from ..model.folder import shape_of
        super().__init__()
        config = shape_of(config)
        self.config = config
        self.family: Family = FAMILIES[config.family]
        dim, heads = config.hidden_size, config.num_attention_heads
        self.num_layers = config.num_hidden_layers
        self.eps = config.layer_norm_eps
        self.branch_scale = self.family.residual_scale(self.num_layers)
        meta = torch.device("meta")
        self.embed_tokens = nn.Embedding(config.vocab_size, dim, _weight=torch.empty(config.vocab_size, dim,
                                                                                     device=meta))
        self.blocks = nn.ModuleList(FastEsmBlock(dim, heads, config.intermediate_size, meta, self.family)
                                    for _ in range(config.num_hidden_layers))
        self.final_norm = nn.LayerNorm(dim, eps=config.layer_norm_eps, bias=self.family.final_norm_bias, device=meta)
        d = dim // heads
        self.register_buffer("inv_freq", 1.0 / (config.rope_theta ** (torch.arange(0, d, 2).float() / d)))
        self.lm_head = None  # transformers' EsmLMHead, when logits are wanted (from_hf keeps it)
        self._fused = fused
        self.cuda_graphs = True  # FastEsm.embed replays CUDA graphs for short batches on CUDA
        # the fused path's products with their pointwise work (GELU, the residual adds) folded into the epilogue
        # (esm_turbo.kernels.gemm): None where it measured faster (kernels.gemm.TILES), True always, False never
        self.fused_products: bool | None = None
        self.attention_kernel = "triton"  # the fused path's attention (FastEsm.attention_kernel)
        # the fused path on CUDA captures block 2 of each batch as a CUDA graph and replays it for the blocks after
        # it with their tensors copied in (block_replay.BlockGraph): the host's launch work once a batch, not once a
        # block.
        # None: where replay_pays says it pays; True: wherever it can (FastEsm._replayed_blocks); False: never
        self.block_graphs: bool | None = None
        self._block_graph: BlockGraph | None = None
        self._packed: PackedBlocks | None = None  # blocks 2 … num_layers in one flat buffer each, made at a replay
        self._block_pool = None  # the memory pool every batch's captured block allocates from (made at the first)
        self._graphs: dict = {}

    # ---- loading ---------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, net, fused: bool | None = None) -> "FastEsm":
        """From a transformers ``EsmForMaskedLM`` / ``EsmcForMaskedLM`` (or the base model), on the net's device and
        dtype. The weights are shared with ``net`` (no copy): Q, K and V (ESM C's gate and up too) are concatenated
        into one matrix, and the net's own become views of it."""
        from ..weights.linear import QuantizedLinear
        family = family_of_net(net)
        base = family.base(net)
        model = cls(base.config, fused=fused)

        def share(dst: nn.Module, src: nn.Module) -> None:
            dst.weight = None if isinstance(src, QuantizedLinear) else src.weight
            dst.bias = getattr(src, "bias", None)

        def fuse(dst: nn.Linear, parts: list[nn.Module]) -> None:
            for kind in ("weight", "bias") if family.linear_bias else ("weight",):
                tensors = [getattr(m, kind) for m in parts]
                joined = torch.cat(tensors)
                setattr(dst, kind, nn.Parameter(joined, requires_grad=False))
                for m, part, view in zip(parts, tensors, joined.split([t.shape[0] for t in tensors])):
                    setattr(m, kind, nn.Parameter(view, requires_grad=part.requires_grad))

        with torch.no_grad():
            share(model.embed_tokens, base.get_submodule(family.embeddings))
            for block, layer in zip(model.blocks, family.layers(net)):
                get = layer.get_submodule
                share(block.attn_norm, get(family.attn_norm))
                projections = [get(n) for n in (family.q, family.k, family.v)]
                ffn_in = [get(n) for n in family.ffn_in]
                if isinstance(projections[0], QuantizedLinear):  # quantized weights: dequantized per forward
                    block.quantized = (*projections, get(family.o), *ffn_in, get(family.ffn_out))
                    for dst, parts in ((block.qkv, projections), (block.fc1, ffn_in)):
                        dst.weight = None
                        dst.bias = (nn.Parameter(torch.cat([m.bias for m in parts]), requires_grad=False)
                                    if family.linear_bias else None)
                else:
                    fuse(block.qkv, projections)
                    fuse(block.fc1, ffn_in)
                share(block.out, get(family.o))
                share(block.ffn_norm, get(family.ffn_norm))
                share(block.fc2, get(family.ffn_out))
                if family.q_norm is not None:
                    share(block.q_norm, get(family.q_norm))
                    share(block.k_norm, get(family.k_norm))
            final = base.get_submodule(family.final_norm)
            share(model.final_norm, final)
            model.inv_freq = _rotary_frequencies(base, family).detach().to(final.weight.device, torch.float32).clone()
        model.lm_head = getattr(net, "lm_head", None)
        if getattr(net, "residual_offload", None) is not None:  # copies queued from the host as blocks run
            model.cuda_graphs = False
        return model.eval()

    @classmethod
    def from_tensors(cls, config, tensors: dict[str, torch.Tensor], fused: bool | None = None) -> "FastEsm":
        """From tensors named as in ``EsmModel`` / ``EsmcModel`` (:func:`esm_turbo.model.folder.load_tensors`), on
        their device and in their dtype: no transformers module is built. The LM head is kept when its tensors are
        there (ESM-2's decoder tied to the token embeddings unless it has its own)."""
        model = cls(config, fused=fused)
        family = model.family

        def put(module: nn.Module, prefix: str) -> None:
            module.weight = nn.Parameter(tensors[prefix + ".weight"], requires_grad=False)
            if prefix + ".bias" in tensors:
                module.bias = nn.Parameter(tensors[prefix + ".bias"], requires_grad=False)

        def stack(module: nn.Linear, prefixes: list[str]) -> None:
            for kind in ("weight", "bias") if family.linear_bias else ("weight",):
                module.register_parameter(kind, nn.Parameter(torch.cat([tensors.pop(f"{p}.{kind}") for p in prefixes]),
                                                             requires_grad=False))

        put(model.embed_tokens, family.embeddings)
        for i, block in enumerate(model.blocks):
            p = family.layer_prefix(i)
            stack(block.qkv, [p + family.q, p + family.k, p + family.v])
            stack(block.fc1, [p + n for n in family.ffn_in])
            put(block.attn_norm, p + family.attn_norm)
            put(block.out, p + family.o)
            put(block.ffn_norm, p + family.ffn_norm)
            put(block.fc2, p + family.ffn_out)
            if family.q_norm is not None:
                put(block.q_norm, p + family.q_norm)
                put(block.k_norm, p + family.k_norm)
        put(model.final_norm, family.final_norm)
        weight = model.embed_tokens.weight
        # the rotary frequencies the constructor computed on the host, as transformers does, rounded as its buffer
        # is: ESM-2's built in the checkpoint's dtype, ESM C's in float32, then cast to the one the model runs in
        stored = getattr(torch, getattr(model.config, "stored_dtype", "float32"), torch.float32)
        stored = stored if family is ESM2 else torch.float32
        model.inv_freq = model.inv_freq.to(stored).to(weight.dtype).to(weight.device, torch.float32)
        if "lm_head.dense.weight" in tensors:
            model.lm_head = LMHead(tensors, model.embed_tokens.weight, config.layer_norm_eps)
        return model.eval()

    @classmethod
    def from_pretrained(cls, model: str | Path, dtype: torch.dtype | str = torch.float16,
                        device: str | torch.device = "cuda", fused: bool | None = None,
                        lm_head: bool = True) -> "FastEsm":
        """Load ESM-2 or ESM C by size name (``650M``, ``ESMC-300M``), hub id, ``save_pretrained`` directory or
        fair-esm ``.pt``. A folder
        with safetensors (a hub id in the local cache too) is read straight onto the device
        (:mod:`esm_turbo.model.folder`); anything else goes through :func:`esm_turbo.load_esm`. ``dtype="fp8"``:
        read in bf16, then :meth:`to_fp8`; refused in one line on a device without FP8 tensor cores."""
        if isinstance(dtype, str) and dtype == "fp8":
            from .fp8 import require_fp8
            require_fp8(device, "dtype fp8", "use fp16 or bf16 (FastEsm.to_fp8() runs the PyTorch reference anywhere)")
            return cls.from_pretrained(model, FP8_COMPUTE_DTYPE, device, fused, lm_head).to_fp8()
        from ..model.folder import direct_folder, load_tensors
        from ..model.sizes import resolve_model_id
        folder = direct_folder(resolve_model_id(str(model)))
        if folder is not None:
            config, tensors = load_tensors(folder, device=device, dtype=dtype, heads=lm_head)
            return cls.from_tensors(config, tensors, fused=fused)
        from ..model.loading import load_esm
        return cls.from_hf(load_esm(model, dtype=dtype, device=device), fused=fused)

    @torch.no_grad()
    def to_fp8(self, keep: tuple[int, ...] = ()) -> "FastEsm":
        """The four matrix products of every block in FP8 (:mod:`esm_turbo.embed.fp8`: e4m3 weights with a scale per
        output channel, activations with a scale per token, fp32 accumulation) and everything else in bf16, in place;
        the blocks ``keep`` names (0 the first, −1 the last) keep their products in bf16. On GPUs without FP8 (and on
        CPU) the products run in the PyTorch reference, which computes the same numbers slowly: it is there to
        measure fidelity, not for speed."""
        n = len(self.blocks)
        kept = {k % n for k in check_blocks(keep, n)}
        for i, b in enumerate(self.blocks):
            if b.fp8 is None and i not in kept:
                b.fp8 = tuple(Fp8Weight.quantize(w) for w in b.weights())
                b.quantized = None
                for m in (b.qkv, b.out, b.fc1, b.fc2):
                    m.weight = None
        return self.to_dtype(FP8_COMPUTE_DTYPE)

    @torch.no_grad()
    def to_dtype(self, dtype: torch.dtype) -> "FastEsm":
        """Every weight and bias (the LM head's too) in ``dtype``, in place; the rotary frequencies stay float32.
        FP8 weights stay FP8. A transformers LM head shared with the net it came from is converted as a copy (the
        net keeps its own)."""
        if self.lm_head is not None and not isinstance(self.lm_head, LMHead):
            import copy
            self.lm_head = copy.deepcopy(self.lm_head)
        for module in self.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if param is not None and param.is_floating_point():
                    setattr(module, name, nn.Parameter(param.to(dtype), requires_grad=False))
        if isinstance(self.lm_head, LMHead):
            head = self.lm_head
            for name in ("dense_w", "dense_b", "norm_w", "norm_b", "bias", "decoder"):
                setattr(head, name, getattr(head, name).to(dtype))
        self._drop_graphs()
        return self

    def _drop_graphs(self) -> None:
        """The captured graphs go, and with the last one its memory pool: the next capture makes a new pool (a pool
        no graph holds any more is freed, and capturing into its handle again fails inside PyTorch's allocator)."""
        self._graphs, self._block_graph, self._packed, self._block_pool = {}, None, None, None

    @property
    def is_fp8(self) -> bool:
        return any(b.fp8 is not None for b in self.blocks)

    @property
    def attention_kernel(self) -> str:
        """The fused path's attention over batches planned on the host: ``"triton"`` (the default:
        :mod:`~esm_turbo.kernels.varlen_attention`, query blocks of 64 tokens, in the dtypes it measured faster in,
        ``GPU_DTYPES``), ``"flash"`` (flash-attention's variable-length kernel), or ``"gluon"`` (the same plan in
        :mod:`~esm_turbo.kernels.varlen_attention_gluon` where it runs, else as "triton": faster alone at heads of
        64, slower in the whole forward on an H200, docs/embed-speed.md). Captured graphs take flash."""
        return self._attention_kernel

    @attention_kernel.setter
    def attention_kernel(self, kernel: str) -> None:
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel {kernel!r}: one of {list(ATTENTION_KERNELS)}")
        self._attention_kernel = kernel

    @property
    def gelu(self) -> str | None:
        """ESM-2's GELU as the forward computes it: ``"erf"`` (the model's own, the default) or ``"tanh"`` (GELU's
        tanh approximation, ``F.gelu(approximate="tanh")``: another function, within 4.8e-4 of erf GELU everywhere;
        on Hopper its FFN-up kernel takes 0.76–0.87× the erf one's time, :data:`~esm_turbo.kernels.gemm.TILES`, the
        forward 0.93–0.95×; docs/embed-speed.md has its fidelity). None for a model without GELU (ESM C's SwiGLU).
        Setting it drops the captured CUDA graphs."""
        acts = {b.activation for b in self.blocks}
        return None if acts == {"swiglu"} else "tanh" if acts == {"gelu_tanh"} else "erf"

    @gelu.setter
    def gelu(self, form: str) -> None:
        if form not in GELU_CHOICES:
            raise ValueError(f"gelu {form!r}: one of {list(GELU_CHOICES)}")
        if self.gelu is None:
            raise ValueError(f"gelu {form!r}: this model's feed-forward has no GELU ({self.family.name}: SwiGLU)")
        for b in self.blocks:
            b.activation = GELU_CHOICES[form]
        self._drop_graphs()

    # ---- the forward -----------------------------------------------------------------------------
    def uses_kernels(self) -> bool:
        """Whether the forward runs the fused Triton path (:meth:`_forward_fused`): ``fused`` when given, else on
        CUDA with a supported Triton in fp16/bf16, where flash attention runs."""
        if self._fused is not None:
            return self._fused
        from ..ops import use_kernels
        return use_kernels(self.embed_tokens.weight) and self._flash()

    def _embed(self, batch: PackedBatch) -> torch.Tensor:
        """Token embeddings with ESM-2's token-dropout rescaling per sequence: [N, D]."""
        x = self.embed_tokens(batch.tokens)
        if getattr(self.config, "token_dropout", False):
            masked = batch.tokens == self.config.mask_token_id
            x = x.masked_fill(masked[:, None], 0.0)
            seg = batch.segment()
            lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).float()
            observed = torch.zeros(len(lengths), device=x.device).index_add_(0, seg, masked.float()) / lengths
            x = (x * ((1 - MASK_RATIO_TRAIN) / (1 - observed))[seg][:, None]).to(x.dtype)
        return x

    def rotary_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, d] float32 of positions [N] (transformers' rotary table)."""
        return rotary_angles(positions, self.inv_freq)

    @torch.inference_mode()
    def forward(self, batch: PackedBatch, layers: list[int] | None = None) -> dict[int, torch.Tensor]:
        """Hidden states of ``layers`` (0 … num_layers, fair-esm numbering; default: the last):
        ``{layer: [N, D]}`` in the model's dtype."""
        wanted = {self.num_layers} if layers is None else set(layers)
        if self.uses_kernels():
            return self._forward_fused(batch, wanted)
        cos, sin = self.rotary_tables(batch.positions)
        h = self._embed(batch)
        out = {0: h} if 0 in wanted else {}
        layout = None if self._flash() else padded_layout(batch.positions, batch.segment(), batch.lengths)
        for i, b in enumerate(self.blocks, start=1):
            if i > max(wanted, default=0):
                break  # nothing asked for lies deeper
            w_qkv, w_o, w_1, w_2 = b.weights()
            q, k, v = attention_inputs(h, b.attn_norm.weight, b.attn_norm.bias, w_qkv, b.qkv.bias, cos, sin, b.heads,
                                       self.eps, *b.qk_norms())
            a = varlen_attention(q, k, v, batch.cu_seqlens, batch.max_seqlen, layout, scale=1.0)
            h = block_output(h, a, w_o, b.out.bias, b.ffn_norm.weight, b.ffn_norm.bias, w_1, b.fc1.bias, w_2,
                             b.fc2.bias, self.eps, b.activation, self.branch_scale)
            if i == self.num_layers:
                h = self.final_norm(h)
            if i in wanted:
                out[i] = h
        return out

    def _forward_fused(self, batch: PackedBatch, wanted: set[int]) -> dict[int, torch.Tensor]:
        """The same forward in fewer launches, with no compiler to wait for: each residual add fused with the
        LayerNorm after it (:func:`~esm_turbo.kernels.norm.add_layer_norm_triton`; the next block's LayerNorm too),
        the query scaling and the rotary embedding of q and k in one launch
        (:func:`~esm_turbo.kernels.rope.rope_packed_triton`), the biases in the matrix products' epilogues, and
        where :func:`~esm_turbo.embed.products.folds` says so GELU or the residual add too: nine launches a block or
        fewer (ESM C adds its query and key LayerNorms, in place, and SwiGLU is one launch,
        :func:`~esm_turbo.kernels.activation.activation_triton`). With FP8 weights on an FP8 GPU, every product's
        input leaves the kernel before it already in e4m3 with its row scales (the LayerNorms', the activation's;
        the attention output takes one quantizing launch)."""
        cos, sin = self.rotary_tables(batch.positions)
        h = self._embed(batch)
        out = {0: h} if 0 in wanted else {}
        n, dim = h.shape
        fp8s = self.fp8_forms(h.device)  # block i's products in FP8: fp8s[i - 1]
        _, x = self.first_norm(h, fp8s[0])
        last = min(max(wanted, default=0), self.num_layers)
        layout = None if self._flash() else padded_layout(batch.positions, batch.segment(), batch.lengths)
        blocks = None
        if self.attention_kernel in ("triton", "gluon") and batch.lengths:
            from ..kernels.varlen_attention import GPU_DTYPES, attention_plan
            if not h.is_cuda or h.dtype in GPU_DTYPES:  # where it measured faster than flash (and the interpreter)
                blocks = attention_plan(batch.lengths, h.device)  # cut once, read by every layer
                if self.attention_kernel == "gluon":
                    from ..kernels.varlen_attention_gluon import usable
                    blocks.gluon = usable(h.device, h.dtype, dim // self.blocks[0].heads)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _layer: int) -> torch.Tensor:
            return varlen_attention(q, k, v, batch.cu_seqlens, batch.max_seqlen, layout, 1.0, blocks).reshape(n, dim)

        first, stop = 1, self._replayed_blocks(h, last, fp8s)
        if stop > 2:  # block 1 eager (every kernel built and loaded), then blocks 2 … stop − 1 replayed
            h, x = self.fused_block(1, h, x, cos, sin, attend, fp8s[0], fp8s[1])
            if 1 in wanted:
                out[1] = h.clone()
            if self._packed is None or self._packed.stale:
                self._packed = PackedBlocks(self, n)  # each replay's weight copy then one contiguous copy
            graph = BlockGraph(self, h, x, cos, sin, attend, fp8s[1], self._packed)
            self._block_graph = graph  # kept until the next batch's is captured: their pool then stays allocated
            for i in range(2, stop):
                graph.replay(i, self.block_tensors(i, n))
                if i in wanted:
                    out[i] = h.clone()  # the graph's buffers hold the next block's output after its replay
            first = stop
        for i in range(first, last + 1):
            h, x = self.fused_block(i, h, x, cos, sin, attend, fp8s[i - 1], fp8s[i])
            if i in wanted:
                out[i] = x if i == self.num_layers else h
        return out

    def _replayed_blocks(self, h: torch.Tensor, last: int, fp8s: list[bool]) -> int:
        """The block after those :meth:`_forward_fused` replays from one captured block 2 (2: none). A captured block
        writes its output over its input, so the blocks replayed are 2 … up to ``last`` − 1 while a block's products
        and its next block's take block 2's input form (``fp8s[i - 1]``: block i's products in FP8). It replays where
        it can (on CUDA, dense or FP8 weights, not inside a capture) and :attr:`block_graphs` is True, or None and
        :func:`replay_pays` says so for h's tokens and that many blocks."""
        if self.block_graphs is False or not h.is_cuda or torch.cuda.is_current_stream_capturing():
            return 2
        if any(b.quantized is not None for b in self.blocks):
            return 2
        stop = replayed_run(fp8s, last)
        replays = stop - 2
        return stop if replays and (self.block_graphs or replay_pays(h.shape[0], h.shape[1], replays)) else 2

    def fp8_forms(self, device: torch.device) -> list[bool]:
        """Per block, whether its products run in FP8 on ``device`` (its input comes as e4m3 rows), and False after
        the last: [num_layers + 1]."""
        from .fp8 import fp8_supported
        on_fp8 = fp8_supported(device)
        return [on_fp8 and b.fp8 is not None for b in self.blocks] + [False]

    def first_norm(self, h: torch.Tensor, fp8: bool = False):
        """(h, the first block's attention LayerNorm of it) in one launch, as :meth:`fused_block` takes them."""
        from ..kernels.norm import add_layer_norm_triton
        first = self.blocks[0].attn_norm
        products = None if fp8 else self.blocks[0].step_products(h.shape[0])
        x = products[0].normalize(h, first.weight, first.bias, self.eps) if products else None
        return (h, x) if x is not None else add_layer_norm_triton(h, None, first.weight, first.bias, self.eps, fp8=fp8)

    def block_tensors(self, i: int, rows: int) -> BlockTensors:
        """What block ``i`` (1 … num_layers) reads over ``rows`` tokens (:meth:`FastEsmBlock.weights` at those
        rows)."""
        b = self.blocks[i - 1]
        after = self.final_norm if i == self.num_layers else self.blocks[i].attn_norm
        w_qkv, w_o, w_1, w_2 = b.weights(rows=rows)
        return BlockTensors(w_qkv, b.qkv.bias, *b.qk_norms(), w_o, b.out.bias, b.ffn_norm.weight, b.ffn_norm.bias,
                            w_1, b.fc1.bias, w_2, b.fc2.bias, after.weight, after.bias)

    def fused_block(self, i: int, h: torch.Tensor, x, cos: torch.Tensor, sin: torch.Tensor,
                    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor],
                    fp8: bool = False, fp8_next: bool | None = None, tensors: BlockTensors | None = None,
                    into: tuple | None = None) -> tuple:
        """Block ``i`` (1 … num_layers) of the fused path over N tokens: h [N, D] the residual stream, x its LayerNorm
        by the block's attention norm (or its e4m3 rows, ``fp8``), cos, sin [N, d] float32. ``attend(q, k, v, i - 1)``
        (q scaled and rotated, k rotated, v: [N, H, d]) gives the attention output [N, D] (or, ``fp8``, of any
        layout the next product takes). Returns (h after the block, its LayerNorm by the next block's attention norm
        or, after the last block, the final norm) as the next call takes them: as e4m3 rows where ``fp8_next`` (the
        next block's products in FP8; default ``fp8`` before the last block). ``tensors``: what the block reads
        (default :meth:`block_tensors` of block i); ``into``: (h, x) buffers the two outputs are written to (a
        captured block's own inputs, :class:`~.block_replay.BlockGraph`)."""
        from ..kernels.activation import activation_triton
        from ..kernels.ffn_step import ffn_step
        from ..kernels.gemm import epilogue_reference
        from ..kernels.norm import layer_norm_columns_
        from ..kernels.rope import rope_packed_triton
        from .products import ffn_folds, folds, is_step_product, product, rope_folds
        n, dim = h.shape
        b = self.blocks[i - 1]  # the shape of every block alike: heads, activation
        last = i == self.num_layers
        then = None  # the product after the block, where it makes its input's rotation with the LayerNorm
        if tensors is None:
            tensors = self.block_tensors(i, n)
            then = None if last else (self.blocks[i].step_products(n) or (None,))[0]
        t = tensors
        policy, inv_scale = self.fused_products, 1.0 / self.branch_scale
        head_dim = dim // b.heads
        if t.q_norm is None and folds(x, t.w_qkv, "rope", policy) and rope_folds(t.w_qkv, head_dim, x):
            qkv = product(x, t.w_qkv, t.b_qkv, "rope", rope=(cos, sin))  # q scaled, q and k rotated in its epilogue
            q, k = qkv[:, :dim].view(n, b.heads, head_dim), qkv[:, dim: 2 * dim].view(n, b.heads, head_dim)
        else:
            qkv = product(x, t.w_qkv, t.b_qkv, kernel=folds(x, t.w_qkv, "bias", policy))
            if t.q_norm is not None:  # ESM C: LayerNorms over the whole width of the query and the key, in place
                layer_norm_columns_(qkv[:, :dim], t.q_norm, self.eps)
                layer_norm_columns_(qkv[:, dim: 2 * dim], t.k_norm, self.eps)
            q, k = rope_packed_triton(qkv, cos, sin, b.heads)
        v = qkv[:, 2 * dim:].view(n, b.heads, head_dim)
        a = attend(q, k, v, i - 1)
        a = activation_triton(a, "none", fp8=True) if fp8 else a
        h, x = self._residual(h, a, t.w_o, t.b_o, (t.ffn_w, t.ffn_b), inv_scale, fp8, policy, then=t.w_1)
        act = b.activation  # "gelu", "gelu_tanh" (FastEsm.gelu) or "swiglu"
        fp8_next = (fp8 and not last) if fp8_next is None else fp8_next
        if not (fp8 or fp8_next or is_step_product(then)) and ffn_folds(x, t.w_1, t.w_2, act, policy):
            return ffn_step(h, x, t.w_1, t.b_1, t.w_2, t.b_2, t.after_w, t.after_b, self.eps, inv_scale, act, into)
        if act != "swiglu" and folds(x, t.w_1, act, policy):  # bias and GELU in the epilogue
            if fp8:  # the rows' maxima come with it: one read of the activation to quantize it
                f, amax = product(x, t.w_1, t.b_1, act, row_amax=True)
                f = activation_triton(f, "none", fp8=True, amax=amax)
            else:
                f = product(x, t.w_1, t.b_1, act)
        else:
            u = product(x, t.w_1, t.b_1, kernel=False)
            f = epilogue_reference(u, act) if act != "swiglu" and not fp8 else activation_triton(u, act, fp8=fp8)
        return self._residual(h, f, t.w_2, t.b_2, (t.after_w, t.after_b), inv_scale, fp8_next, policy, then=then,
                              into=into)

    def _residual(self, h: torch.Tensor, x, w, bias: torch.Tensor | None, norm: tuple, inv_scale: float,
                  fp8: bool, policy: bool | None, then=None, into: tuple | None = None) -> tuple:
        """An output projection, the residual add and the LayerNorm after it: (h + (x wᵀ + b) · inv_scale, the
        LayerNorm of that), h [N, D]. Where the product folds its epilogue (:func:`~.products.folds`) the add is in
        it and the LayerNorm reads one tensor; else the add and the LayerNorm run in one launch after a cuBLAS
        product. ``norm``: the LayerNorm's (weight, bias). ``fp8``: the LayerNorm's output as e4m3 rows. ``then``: the
        product the LayerNorm feeds (a :class:`~esm_turbo.weights.step.StepProduct` makes its own input's rotation
        with the LayerNorm). ``into``: (h, x) buffers to write the two outputs to."""
        from ..kernels.norm import add_layer_norm_triton
        from .products import folds, is_step_product, product
        norm_w, norm_b = norm
        if folds(x, w, "residual", policy):
            s = product(x, w, bias, "residual", residual=h, residual_scale=inv_scale)
            y = then.normalize(s, norm_w, norm_b, self.eps) if is_step_product(then) else None
            if y is not None:
                return s, y
            if into is not None:
                s = into[0].copy_(s)
            return add_layer_norm_triton(s, None, norm_w, norm_b, self.eps, fp8=fp8, out=into)
        return add_layer_norm_triton(h, product(x, w, bias, kernel=False), norm_w, norm_b, self.eps, inv_scale,
                                     fp8=fp8, out=into)

    def _flash(self) -> bool:
        """Whether attention runs in the flash variable-length kernel (else one padded SDPA per layer)."""
        weight = self.embed_tokens.weight
        return flash_available(weight.device, weight.dtype, self.config.hidden_size // self.config.num_attention_heads)

    def logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        """[N, D] last-layer states → [N, vocab] masked-LM logits (transformers' LM head)."""
        if self.lm_head is None:
            raise ValueError("this FastEsm was built without an LM head (load it from a masked-LM checkpoint)")
        with torch.inference_mode():
            return self.lm_head(hidden_last)

    # ---- pooling ---------------------------------------------------------------------------------
    @staticmethod
    def pool(h: torch.Tensor, batch: PackedBatch, sequences: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """On h's device, in float32: mean over each sequence's residues (``<cls>``/``<eos>`` left out)
        [S, D] and each ``<cls>`` state [S, D]. h: [N, D]; only the first S sequences of the batch when
        ``sequences`` = S is given. On CUDA one Triton launch (:mod:`esm_turbo.kernels.segment`), else its
        reference; both sum in float32 in a fixed order."""
        from ..kernels import triton_available
        from ..kernels.segment import segment_mean_reference, segment_mean_triton
        starts = batch.cu_seqlens[:-1][:sequences]
        ends = batch.cu_seqlens[1:][:sequences]
        # residues of sequence s are tokens [start + 1, end - 1)
        lo, hi = starts + 1, torch.maximum(ends - 1, starts + 1)
        if h.is_cuda and triton_available():
            mean = segment_mean_triton(h, lo, hi)
        else:
            mean = segment_mean_reference(h, lo.long(), hi.long())
        return mean, h[starts.long()].float()

    def _graphed(self, n_tokens: int, n_seqs: int, layers: tuple[int, ...]) -> "_GraphedEmbed":
        key = (n_tokens, n_seqs, layers)
        if key not in self._graphs:
            self._graphs[key] = _GraphedEmbed(self, n_tokens, n_seqs, layers)
        return self._graphs[key]

    @torch.inference_mode()
    def embed(self, sequences: list[str], layers: list[int] | None = None,
              per_token: bool = False) -> dict[str, dict[int, object]]:
        """Embeddings of a few sequences in one packed batch (for batches of many use ``esm-turbo embed``
        or :class:`esm_turbo.embed.extract.Embedder`). ``layers`` as in fair-esm (negative counts from the
        end; default the last). Returns {"mean": {layer: [S, D]}, "bos": {layer: [S, D]}} float32 on the
        host, plus "per_token": {layer: list of [L_s, D]} when asked.

        On CUDA in fp16/bf16, batches of fewer than ``GRAPH_MAX_TOKENS`` tokens replay a CUDA graph captured once per
        (token bucket, number of sequences, layers): a short query is not held up by launches."""
        from .extract import resolve_layers
        device = self.embed_tokens.weight.device
        resolved = resolve_layers(layers if layers is not None else [-1], self.num_layers)
        ids, positions, cu = pack_sequences(sequences)
        lengths = (cu[1:] - cu[:-1]).tolist()
        if self.cuda_graphs and self._flash() and len(ids) < GRAPH_MAX_TOKENS:
            bucket = max(64, 1 << len(ids).bit_length())  # > N: the padding is a sequence of its own
            hidden, means, boss = self._graphed(bucket, len(sequences), tuple(resolved)).run(ids, positions, cu)
        else:
            batch = PackedBatch.from_arrays(ids, positions, cu, device=device)
            hidden = self.forward(batch, resolved)
            pooled = {layer: self.pool(hidden[layer], batch) for layer in resolved}
            means = {layer: m for layer, (m, _) in pooled.items()}
            boss = {layer: b for layer, (_, b) in pooled.items()}
        result: dict[str, dict[int, object]] = {"mean": {k: v.cpu() for k, v in means.items()},
                                                "bos": {k: v.cpu() for k, v in boss.items()}}
        if per_token:
            result["per_token"] = {layer: [p[1:-1] for p in hidden[layer][: len(ids)].float().cpu().split(lengths)]
                                   for layer in resolved}
        return result


def check_blocks(blocks, count: int, name: str = "keep") -> tuple[int, ...]:
    """``blocks`` (0 the first, −1 the last) checked against a model of ``count`` blocks, refused in one line naming
    ``name`` and the first block out of range."""
    bad = [k for k in blocks if not -count <= k < count]
    if bad:
        from ..errors import EsmTurboError
        raise EsmTurboError(f"{name} {bad[0]}: the model has blocks 0 … {count - 1} (or -{count} … -1)")
    return tuple(blocks)


def _rotary_frequencies(base, family: Family) -> torch.Tensor:
    """The rotary inverse frequencies [d / 2] a transformers base model holds (where this transformers keeps them)."""
    for holder in (getattr(base, "rotary_emb", None), getattr(base, "rotary_embeddings", None)):
        if holder is not None and getattr(holder, "inv_freq", None) is not None:
            return holder.inv_freq
    if family is ESM2:  # older transformers keep it per layer
        return base.encoder.layer[0].attention.self.rotary_embeddings.inv_freq
    raise ValueError(f"no rotary frequencies found in this {family.label} model")


#: batches below this many tokens replay CUDA graphs in :meth:`FastEsm.embed`
GRAPH_MAX_TOKENS = 4096


class _GraphedEmbed:
    """One CUDA graph of FastEsm's forward and pooling for ``n_seqs`` sequences in ``n_tokens`` tokens
    (the tokens past the real ones form one more sequence of padding, attending only to itself)."""

    def __init__(self, model: FastEsm, n_tokens: int, n_seqs: int, layers: tuple[int, ...]):
        device = model.embed_tokens.weight.device
        self.tokens = torch.full((n_tokens,), model.config.pad_token_id, dtype=torch.long, device=device)
        self.positions = torch.zeros(n_tokens, dtype=torch.long, device=device)
        self.pad_positions = torch.arange(n_tokens, device=device)
        self.pad_id = model.config.pad_token_id
        self.cu = torch.zeros(n_seqs + 2, dtype=torch.int32, device=device)
        self.cu[-1] = n_tokens
        self.cu[1:-1] = torch.arange(1, n_seqs + 1, device=device, dtype=torch.int32)  # a valid warm-up layout
        batch = PackedBatch(self.tokens, self.positions, self.cu, [], n_tokens)

        def step():
            hidden = model.forward(batch, list(layers))
            pooled = {layer: model.pool(hidden[layer], batch, n_seqs) for layer in layers}
            return hidden, {k: m for k, (m, _) in pooled.items()}, {k: b for k, (_, b) in pooled.items()}

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # build and warm every kernel outside the capture
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = step()

    def run(self, ids, positions, cu):
        """Host arrays of one packed batch (N < n_tokens, S = n_seqs) → (hidden, means, bos), views of the
        graph's outputs (copy before the next replay)."""
        n = len(ids)
        self.tokens[:n].copy_(torch.as_tensor(ids))
        self.tokens[n:].fill_(self.pad_id)
        self.positions[:n].copy_(torch.as_tensor(positions))
        self.positions[n:].copy_(self.pad_positions[: len(self.positions) - n])
        self.cu[: len(cu)].copy_(torch.as_tensor(cu, dtype=torch.int32))
        self.graph.replay()
        return self.out


__all__ = ["ATTENTION_KERNELS", "FastEsm", "FastEsmBlock", "GELU_CHOICES", "PackedBatch", "activation",
           "attention_inputs", "block_output", "pack_sequences"]
