"""The KV-cache methods by name, in one registry that the engine (``TurboEsm.codecs("turboquant-4")``), the Hydra
sweeps (``quant.method``) and the reports all read.

A method builds one :class:`~esm_turbo.quant.codec.KVCodec` per layer from a :class:`MethodRequest`; what it needs to
do so is stated (``needs``): the shapes alone, K/V samples collected from the model, or a calibration run. A codec
pairs two quantizers (keys, values), each keeping the :class:`~esm_turbo.quant.codec.Quantizer` contract (and, to run
on the fused ops, :class:`~esm_turbo.quant.codec.FusedQuantizer`'s). A new method is one :func:`register` call::

    @register("mine", "what it does", needs="shapes")
    def _mine(req: MethodRequest) -> tuple[list[KVCodec], dict]:
        return [KVCodec(MyQuantizer(req.heads, req.dim), MyQuantizer(req.heads, req.dim))
                for _ in range(req.layers)], {}

Engine cache kinds are method names with an optional width: ``fp32``/``fp16``/``bf16`` (dense), ``fp8``,
``turboquant-<bits>``; ``turbo`` (the session's calibration) is the engine's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import torch

from .codec import FusedQuantizer, KVCodec, Quantizer, dense_codec

NEEDS = ("shapes", "samples", "calibration")


@dataclass
class MethodRequest:
    """What a method builds from: the model's shapes, its options (a :class:`~esm_turbo.experiments.config.QuantConf`
    or any object with the same fields; missing ones take QuantConf's defaults), and, for methods that fit, the
    K/V ``samples()`` per layer ([(k [H, N, d], v [H, N, d])]) or the ``model`` and ``calibration`` records."""

    heads: int
    dim: int
    layers: int
    options: Any = field(default_factory=SimpleNamespace)
    samples: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]] | None = None
    model: Any = None
    calibration: list | None = None

    def option(self, name: str, default):
        value = getattr(self.options, name, None)
        return default if value is None else value


@dataclass(frozen=True)
class KVMethod:
    name: str
    summary: str
    needs: str  # one of NEEDS
    build: Callable[[MethodRequest], tuple[list[KVCodec], dict]]


KV_METHODS: dict[str, KVMethod] = {}


def register(name: str, summary: str, needs: str = "shapes"):
    """Add a method under ``name`` (a decorator of its build function)."""
    if needs not in NEEDS:
        raise ValueError(f"needs={needs!r}: one of {NEEDS}")

    def add(build: Callable[[MethodRequest], tuple[list[KVCodec], dict]]):
        KV_METHODS[name] = KVMethod(name, summary, needs, build)
        return build
    return add


#: the public name of :func:`register` (``esm_turbo.register_kv_method``)
register_kv_method = register


def kv_method(name: str) -> KVMethod:
    """The method called ``name``; an unknown one is a ValueError naming the known ones."""
    if name not in KV_METHODS:
        raise ValueError(f"unknown KV method {name!r}: choose one of {', '.join(sorted(KV_METHODS))}")
    return KV_METHODS[name]


def parse_kind(kind: str) -> tuple[str, SimpleNamespace]:
    """An engine cache kind → (method, options): ``fp16`` → dense in fp16, ``turboquant-4`` → turboquant at 4 bits,
    ``int-8`` → int at 8 bits; a bare name takes the method's defaults."""
    if kind in ("fp32", "fp16", "bf16"):
        return "dense", SimpleNamespace(dtype=kind)
    if kind in KV_METHODS:
        return kind, SimpleNamespace()
    name, _, width = kind.rpartition("-")
    if name and width.isdigit():
        return name, SimpleNamespace(bits=int(width))
    return kind, SimpleNamespace()


def build_codecs(method: str, request: MethodRequest) -> tuple[list[KVCodec], dict]:
    """(one codec per layer, extra information such as calibration seconds) of ``method`` for ``request``."""
    m = kv_method(method)
    if m.needs == "samples" and request.samples is None:
        raise ValueError(f"KV method {method!r} is fitted on K/V samples: pass MethodRequest(samples=…)")
    if m.needs == "calibration" and request.model is None:
        raise ValueError(f"KV method {method!r} calibrates on a model: pass MethodRequest(model=…, calibration=…)")
    return m.build(request)


# ---- the built-in methods ---------------------------------------------------------------------------------------
@register("dense", "uncompressed fp32/fp16/bf16 (option dtype): the reference")
def _dense(req: MethodRequest):
    from ..schema import dtype_of
    return [dense_codec(req.heads, req.dim, dtype_of(req.option("dtype", "fp16"))) for _ in range(req.layers)], {}


@register("fp8", "float8 e4m3 after a per token-head absmax scale")
def _fp8(req: MethodRequest):
    from .methods import Fp8Quantizer
    return [KVCodec(Fp8Quantizer(req.heads, req.dim), Fp8Quantizer(req.heads, req.dim)) for _ in range(req.layers)], {}


@register("turboquant", "data-oblivious: randomized Hadamard rotation, Lloyd-Max levels (options bits, residual)")
def _turboquant(req: MethodRequest):
    from .fit import oblivious_codec
    bits, residual = req.option("bits", 3), req.option("residual", "none")
    return [oblivious_codec(req.heads, req.dim, bits, "hadamard", residual, seed=i) for i in range(req.layers)], {}


@register("turboesm", "calibrated TurboESM: esm-turbo calibrate's recipe (options recipe, index_bits or bits all-in, "
                      "calibration)", needs="calibration")
def _turboesm(req: MethodRequest):
    from ..model.calibrate import calibrate
    cal = calibrate(req.model, req.calibration, req.options.calibration_config(req.model.config), progress=False)
    return list(cal.codecs), {"calibration_seconds": cal.seconds}


def _per_layer(req: MethodRequest, make_key, make_value, window: int = 0) -> list[KVCodec]:
    return [KVCodec(make_key(k), make_value(v), window=window) for k, v in req.samples()]


@register("int", "uniform INT: keys per channel (fitted), values per token (options bits, window)", needs="samples")
def _int(req: MethodRequest):
    from .methods import AffineIntQuantizer
    bits = req.option("bits", 4)
    return _per_layer(req, lambda k: AffineIntQuantizer.fit(k, bits, "channel"),
                      lambda v: AffineIntQuantizer(req.heads, req.dim, bits, "token"), req.option("window", 0)), {}


@register("outlier", "outlier channels at more bits, the rest Lloyd-Max (options bits, outlier_bits, outlier_frac)",
          needs="samples")
def _outlier(req: MethodRequest):
    from .methods import OutlierSplitQuantizer
    bits, high = req.option("bits", 3), req.option("outlier_bits", 8)
    n_out = max(1, round(req.option("outlier_frac", 0.125) * req.dim))
    return _per_layer(req, lambda k: OutlierSplitQuantizer.fit(k, bits, high, n_out),
                      lambda v: OutlierSplitQuantizer.fit(v, bits, high, n_out)), {}


@register("rvq", "residual vector quantization (options depth, group)", needs="samples")
def _rvq(req: MethodRequest):
    from .methods import RVQQuantizer
    depth, group = req.option("depth", 3), req.option("group", 8)
    return _per_layer(req, lambda k: RVQQuantizer.fit(k, depth, group, contiguous=False),
                      lambda v: RVQQuantizer.fit(v, depth, group, contiguous=True)), {}


__all__ = ["FusedQuantizer", "KVMethod", "KV_METHODS", "MethodRequest", "NEEDS", "Quantizer", "build_codecs",
           "kv_method", "parse_kind", "register", "register_kv_method"]
