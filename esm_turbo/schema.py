"""One configuration schema, three front ends: a frozen dataclass whose fields carry their help, choices and range in
their metadata is the Python API; :func:`add_flags` makes its command-line flags; :func:`overrides_schema` makes the
Hydra node that nests it (every field optional: unset keeps the preset's value).

Metadata keys of a field: ``help`` (required to be a flag), ``choices``, ``range`` ((lo, hi) for numbers, either
None), ``flags`` (extra spellings, e.g. ``("--rotation",)``), ``cli`` (False: not a flag).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Optional

import torch

#: the compute and storage dtypes the toolkit names, one map for every command and config
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def dtype_of(name: str) -> torch.dtype:
    """``fp32`` / ``fp16`` / ``bf16`` → the torch dtype, or a one-line error naming the choices."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def _base_type(hint) -> type:
    """int / float / str / bool of a field's type hint (``Optional[X]`` → X)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _number(kind: type, lo, hi):
    from .cli_checks import float_in, int_in
    if kind is int:
        return int_in(lo if lo is not None else -(1 << 62), hi)
    return float_in(lo if lo is not None else float("-inf"), hi if hi is not None else float("inf"))


def add_flags(parser: argparse.ArgumentParser, cls, defaults: Any = None) -> None:
    """One flag per field of dataclass ``cls`` with ``help`` metadata: ``--field-name`` (plus its ``flags``),
    booleans as ``--x / --no-x``; every default None (the value then comes from ``defaults``, a preset, shown in the
    help)."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "help" not in meta or meta.get("cli") is False:
            continue
        kind = _base_type(hints[f.name])
        names = [f"--{f.name.replace('_', '-')}", *meta.get("flags", ())]
        shown = getattr(defaults, f.name, f.default) if defaults is not None else f.default
        help_text = f"{meta['help']} (default: {shown})"
        if kind is bool:
            parser.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        elif kind in (int, float):
            lo, hi = meta.get("range", (None, None))
            parser.add_argument(*names, dest=f.name, type=_number(kind, lo, hi), default=None,
                                help=help_text)
        else:
            parser.add_argument(*names, dest=f.name, choices=meta.get("choices"), default=None, help=help_text)


def overrides_from_args(args: argparse.Namespace, cls) -> dict[str, Any]:
    """The fields of ``cls`` given on the command line (not None)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if getattr(args, f.name, None) is not None}


def overrides_schema(cls, name: str | None = None) -> type:
    """A dataclass with the fields of ``cls``, each ``Optional`` and None by default: a Hydra node whose set fields
    override a preset of ``cls`` (:func:`set_fields`)."""
    hints = _hints(cls)
    spec = [(f.name, Optional[_base_type(hints[f.name])], dataclasses.field(default=None, metadata=f.metadata))
            for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass(name or f"{cls.__name__}Overrides", spec)


def set_fields(node: Any) -> dict[str, Any]:
    """The fields of an overrides node (a dataclass or a mapping, e.g. an OmegaConf node) that are set."""
    items = (dataclasses.asdict(node) if dataclasses.is_dataclass(node) else dict(node)).items()
    return {k: v for k, v in items if v is not None}


def check_choices(obj: Any) -> Any:
    """Refuse a field of dataclass ``obj`` outside its ``choices`` or ``range`` metadata (one line naming it)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None:
            continue
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ValueError(f"{f.name}={value!r}: choose one of {list(choices)}")
        lo, hi = f.metadata.get("range", (None, None))
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise ValueError(f"{f.name}={value!r}: outside {lo}..{hi}")
    return obj
